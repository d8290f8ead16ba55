//! The replica role: apply the primary's stream in order, acknowledge what is durable, remember
//! what may be uncommitted, answer a new primary's probe, and ask to be taken back when no live
//! stream arrives.
//!
//! A stream is applied strictly in sequence order (entries that arrive early wait in a bounded
//! buffer; duplicates are acknowledged again), and an entry whose blocks still have a write in
//! flight waits for it, so this replica's blocks go through the same sequence of values as the
//! primary's. Acknowledgements are cumulative and are sent only once the stream's epoch is
//! durable here, so a replica that restarts can never go back to accepting an older epoch after
//! it acknowledged a newer one.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::message::{Entry, Message};
use crate::volume::{Action, Purpose, Shared};
use crate::{
    NodeId, StreamId, BLOCKS_PER_OP_MAX, DAMAGED_PER_ROUND_MAX, INFLIGHT_READS_MAX,
    STREAM_WINDOW_MAX,
};

/// A primary's `Read`: blocks it found damaged in its own copy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PeerReadRequest {
    pub epoch: u64,
    pub incarnation: u64,
    pub request: u64,
    pub lba: u64,
    pub count: u32,
}

#[derive(Debug)]
struct InStream {
    epoch: u64,
    primary: NodeId,
    id: StreamId,
    /// The next sequence number to move from `early` to `ready`.
    next_seq: u64,
    /// Entries that arrived before their predecessors.
    early: BTreeMap<u64, Entry>,
    /// Entries in order, waiting for a write in flight to one of their blocks.
    ready: VecDeque<(u64, Entry)>,
    /// Every entry up to this one is durable.
    durable_seq: u64,
    /// Durable entries above `durable_seq`.
    durable_above: BTreeSet<u64>,
    commit_op: u64,
}

#[derive(Debug)]
pub(crate) struct Replica {
    stream: Option<InStream>,
    last_stream_ms: u64,
    last_hello_ms: Option<u64>,
    /// A probe to answer once its epoch is durable.
    probe_from: Option<(NodeId, u64)>,
    /// The primary this process answered a probe of, and in which epoch: from then on it
    /// applies nothing of older epochs, so it may serve that primary's `Read` before any
    /// entry of the new stream arrives (a reconciliation's repair reads).
    probed_by: Option<(NodeId, u64)>,
}

impl Replica {
    pub fn new() -> Self {
        Self {
            stream: None,
            last_stream_ms: 0,
            last_hello_ms: None,
            probe_from: None,
            probed_by: None,
        }
    }

    pub fn on_epoch_raised(&mut self, epoch: u64) {
        if self.stream.as_ref().is_some_and(|stream| stream.epoch < epoch) {
            // Entries already issued stay in flight (and in the divergence list); no more of
            // the old epoch are applied.
            self.stream = None;
        }
        if self.probe_from.is_some_and(|(_, probe_epoch)| probe_epoch < epoch) {
            self.probe_from = None;
        }
        if self.probed_by.is_some_and(|(_, probe_epoch)| probe_epoch < epoch) {
            self.probed_by = None;
        }
    }

    pub fn on_latched(&mut self, shared: &mut Shared, out: &mut Vec<Action>) {
        if let Some(stream) = self.stream.take() {
            let message = Message::Failed { epoch: shared.epoch, incarnation: shared.incarnation };
            shared.send(stream.primary, message, out);
        }
    }

    /// An `Append` (with `entry`) or a `Heartbeat` (without).
    #[allow(clippy::too_many_arguments)]
    pub fn on_stream(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        from: NodeId,
        epoch: u64,
        stream_id: StreamId,
        incarnation: u64,
        commit_op: u64,
        entry: Option<(u64, Entry)>,
        out: &mut Vec<Action>,
    ) {
        if shared.latched {
            let message = Message::Failed { epoch: shared.epoch, incarnation: shared.incarnation };
            shared.send(from, message, out);
            return;
        }
        if epoch < shared.epoch {
            shared.send(from, Message::Stale { epoch: shared.epoch }, out);
            return;
        }
        assert_eq!(epoch, shared.epoch, "newer epochs are adopted before dispatch");
        if incarnation != shared.incarnation {
            let message = Message::Resync { epoch, incarnation: shared.incarnation };
            shared.send(from, message, out);
            return;
        }
        let current = self.stream.as_ref().map(|stream| (stream.epoch, stream.id));
        match current {
            Some(current) if current == (epoch, stream_id) => {}
            Some(current) if current > (epoch, stream_id) => return,
            _ => {
                // A new stream for this process: a new term, or the primary took this replica
                // back. Nothing of it has been applied yet.
                self.stream = Some(InStream {
                    epoch,
                    primary: from,
                    id: stream_id,
                    next_seq: 1,
                    early: BTreeMap::new(),
                    ready: VecDeque::new(),
                    durable_seq: 0,
                    durable_above: BTreeSet::new(),
                    commit_op: 0,
                });
            }
        }
        self.last_stream_ms = now_ms;
        let Some(stream) = self.stream.as_mut() else {
            return;
        };
        if commit_op > stream.commit_op {
            stream.commit_op = commit_op;
            shared.divergence.prune(epoch, commit_op);
        }
        let Some((seq, entry)) = entry else {
            send_ack(shared, stream, out);
            return;
        };
        let count = entry.blocks.len() as u64;
        let valid = seq > 0
            && entry.length_valid()
            && entry.lba.checked_add(count).is_some_and(|end| end <= shared.config.volume_blocks);
        if !valid {
            shared.stats.entries_refused += 1;
            return;
        }
        if seq < stream.next_seq {
            send_ack(shared, stream, out);
            return;
        }
        if seq - stream.durable_seq > STREAM_WINDOW_MAX as u64 {
            return;
        }
        if seq == stream.next_seq && stream.early.is_empty() {
            // In order, as the stream almost always is: no early entry to look through.
            stream.ready.push_back((seq, entry));
            stream.next_seq += 1;
        } else {
            stream.early.entry(seq).or_insert(entry);
            while let Some(entry) = stream.early.remove(&stream.next_seq) {
                stream.ready.push_back((stream.next_seq, entry));
                stream.next_seq += 1;
            }
        }
        self.pump(shared, now_ms, out);
    }

    /// Issues ready entries, in order, as long as none of their blocks has a write in flight,
    /// and only once the stream's epoch is durable here: a process that restarts then knows it
    /// may hold uncommitted entries, while one that never persisted an epoch has applied
    /// nothing (its divergence is known to be empty). An entry beyond the commit point also
    /// waits until its regions are in the durable write intent, so a restart still lists it.
    pub fn pump(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        let Some(stream) = self.stream.as_mut() else {
            return;
        };
        if shared.persisted_epoch < stream.epoch {
            return;
        }
        while let Some((_, entry)) = stream.ready.front() {
            if shared.write_in_flight(entry.lbas()) {
                break;
            }
            if entry.covers_op() > stream.commit_op {
                shared.intent.want(entry.lbas(), now_ms);
                if !shared.intent.covered(entry.lbas()) {
                    // One persist for the entries waiting behind it too (group commit).
                    for (_, later) in stream.ready.iter().skip(1) {
                        if later.covers_op() > stream.commit_op {
                            shared.intent.want(later.lbas(), now_ms);
                        }
                    }
                    shared.flush_intent(out);
                    break;
                }
            }
            let Some((seq, entry)) = stream.ready.pop_front() else {
                break;
            };
            if entry.covers_op() > stream.commit_op {
                shared.divergence.record(stream.epoch, entry.covers_op(), entry.lbas());
            }
            let purpose = Purpose::StreamEntry { epoch: stream.epoch, stream: stream.id, seq };
            shared.storage_write(entry.lba, entry.blocks, purpose, out);
        }
    }

    pub fn on_entry_durable(
        &mut self,
        shared: &mut Shared,
        epoch: u64,
        stream_id: StreamId,
        seq: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(stream) = self.stream.as_mut() else {
            return;
        };
        if (stream.epoch, stream.id) != (epoch, stream_id) {
            return;
        }
        assert!(seq > stream.durable_seq && seq < stream.next_seq, "entries complete once");
        if seq == stream.durable_seq + 1 {
            stream.durable_seq = seq;
        } else {
            stream.durable_above.insert(seq);
        }
        while !stream.durable_above.is_empty()
            && stream.durable_above.remove(&(stream.durable_seq + 1))
        {
            stream.durable_seq += 1;
        }
        send_ack(shared, stream, out);
    }

    pub fn on_persisted(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if let Some(stream) = &self.stream {
            send_ack(shared, stream, out);
        }
        self.pump(shared, now_ms, out);
        self.try_probe_reply(shared, out);
    }

    pub fn on_probe(
        &mut self,
        shared: &mut Shared,
        from: NodeId,
        epoch: u64,
        out: &mut Vec<Action>,
    ) {
        if shared.latched {
            let message = Message::Failed { epoch: shared.epoch, incarnation: shared.incarnation };
            shared.send(from, message, out);
            return;
        }
        if epoch < shared.epoch {
            shared.send(from, Message::Stale { epoch: shared.epoch }, out);
            return;
        }
        self.probe_from = Some((from, epoch));
        self.try_probe_reply(shared, out);
    }

    /// A primary's `Read`: served from this node's storage only if this is the process the
    /// primary streams to, or answered a probe of, in this very epoch (so it applied every
    /// write the primary completed before asking: a probed process was in sync when the term
    /// started and applies nothing of older epochs since), else answered with no blocks.
    /// Beyond `INFLIGHT_READS_MAX` reads at once it is dropped: the primary asks again.
    pub fn on_read(
        &mut self,
        shared: &mut Shared,
        from: NodeId,
        read: PeerReadRequest,
        out: &mut Vec<Action>,
    ) {
        let PeerReadRequest { epoch, incarnation, request, lba, count } = read;
        assert_eq!(epoch, shared.epoch, "older epochs are answered Stale before dispatch");
        if shared.peer_reads_in_flight >= INFLIGHT_READS_MAX {
            return;
        }
        let streaming = self
            .stream
            .as_ref()
            .is_some_and(|stream| stream.epoch == epoch && stream.primary == from);
        let probed = self.probed_by == Some((from, epoch));
        let in_range = (1..=BLOCKS_PER_OP_MAX).contains(&count)
            && lba
                .checked_add(u64::from(count))
                .is_some_and(|end| end <= shared.config.volume_blocks);
        if shared.latched
            || incarnation != shared.incarnation
            || !(streaming || probed)
            || !in_range
        {
            shared.send(from, Message::ReadReply { epoch, request, blocks: None }, out);
            return;
        }
        shared.peer_reads_in_flight += 1;
        let purpose = Purpose::PeerRead { epoch, to: from, request, lba, count };
        shared.storage_read(lba, count, purpose, out);
    }

    /// Asks the primary streaming to this process for its copies of blocks damaged here, a
    /// few at a time; each is asked again until a write replaces it (the primary's copy comes
    /// as a stream entry, so it is applied in order with the host writes).
    pub fn report_damaged(&mut self, shared: &mut Shared, out: &mut Vec<Action>) {
        let Some(stream) = self.stream.as_ref().filter(|stream| stream.epoch == shared.epoch)
        else {
            return;
        };
        let (epoch, incarnation, primary) = (shared.epoch, shared.incarnation, stream.primary);
        let lbas: Vec<u64> = shared.damaged.iter().copied().take(DAMAGED_PER_ROUND_MAX).collect();
        for lba in lbas {
            shared.send(primary, Message::Damaged { epoch, incarnation, lba, count: 1 }, out);
        }
    }

    /// The divergence list is final for older epochs once this node adopted `epoch` (no more
    /// of their entries are applied), and the reply waits until `epoch` is durable.
    fn try_probe_reply(&mut self, shared: &mut Shared, out: &mut Vec<Action>) {
        let Some((to, epoch)) = self.probe_from else {
            return;
        };
        if shared.persisted_epoch < epoch {
            return;
        }
        self.probe_from = None;
        if epoch != shared.epoch {
            return;
        }
        let message = Message::ProbeReply {
            epoch,
            incarnation: shared.incarnation,
            volume_blocks: shared.config.volume_blocks,
            divergence: shared.divergence.report(),
        };
        self.probed_by = Some((to, epoch));
        shared.send(to, message, out);
    }

    pub fn tick(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if shared.latched {
            return;
        }
        let Some(view) = &shared.view else {
            return;
        };
        let state = &view.value;
        let Some(primary) = state.primary else {
            return;
        };
        if primary == shared.me
            || state.epoch != shared.epoch
            || !state.members.contains(&shared.me)
        {
            return;
        }
        let interval = shared.config.hello_interval_ms;
        let streaming = self.stream.as_ref().is_some_and(|stream| {
            stream.epoch == shared.epoch
                && stream.primary == primary
                && self.last_stream_ms + interval > now_ms
        });
        let hello_due = self.last_hello_ms.is_none_or(|last| last + interval <= now_ms);
        if !streaming && hello_due {
            self.last_hello_ms = Some(now_ms);
            // The divergence is final for older epochs (this node applies nothing more of
            // them), and changes in this epoch only through a stream of its primary, which
            // takes a Hello first: what it says here is what the primary needs.
            let message = Message::Hello {
                epoch: shared.epoch,
                incarnation: shared.incarnation,
                last_term_epoch: shared.term_started,
                volume_blocks: shared.config.volume_blocks,
                divergence: shared.divergence.report(),
            };
            shared.send(primary, message, out);
        }
    }
}

fn send_ack(shared: &Shared, stream: &InStream, out: &mut Vec<Action>) {
    if shared.persisted_epoch >= stream.epoch {
        let message = Message::Ack {
            epoch: stream.epoch,
            stream: stream.id,
            durable_seq: stream.durable_seq,
        };
        shared.send(stream.primary, message, out);
    }
}
