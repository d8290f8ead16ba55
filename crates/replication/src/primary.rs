//! The primary role for one epoch (a "term"): reconcile the in-sync replicas, then serve host
//! I/O, send every write to every replica that takes live writes, complete a write once it is
//! durable locally and on every in-sync replica, remove laggards from the in-sync set through
//! the control store, and bring replicas back (resync) by copying what they missed.
//!
//! Each peer (another member of the volume) is in one state:
//!
//! ```text
//!  term start ─► Probing ─reply─► Pushing ─copies acked─► InSync ◄──CAS done── Adding
//!                   │                │                      │                    ▲
//!                   └──timeout───────┴──────timeout─────────┴─► Removing         │
//!                                                              (CAS out) │       │
//!  not in sync at term start ─► OutOfSync ◄────CAS done─────────────────┘       │
//!                                  │  ▲                                          │
//!                            Hello │  │ timeout                                  │
//!                                  ▼  │                                          │
//!                                CatchingUp ──dirty copied, all acked────────────┘
//! ```
//!
//! A write completes only when, for every peer in InSync or Adding, that peer acknowledged the
//! write, and no peer is Removing. Those three states are exactly the peers the store may list
//! in `in_sync` (a peer leaves Removing, or enters InSync, only when the store's answer shows
//! it: a CAS reply, or a read while no CAS of this primary is unsettled), so the set a write
//! waits for always contains the store's in-sync set.
//!
//! A peer out of sync at term start, or removed while Probing, has a dirty set that still lacks
//! the blocks of its own divergence from before the term ([`Before`]); its first `Hello` of
//! the term adds them, or makes the set full when they cannot be trusted (crate docs, "Resync").

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;

use crate::dirty::{DirtySet, Take};
use crate::message::{DivergenceReport, Entry, EntryKind, Message};
use crate::store::StoreRequest;
use crate::volume::{Action, HostError, HostOp, HostReply, Purpose, Shared, StorageResult};
use crate::{
    BlockData, HostOpId, LeaseId, NodeId, ResyncProgress, StorageOpId, StreamId, BLOCKS_PER_OP_MAX,
    COPY_WINDOW_MAX, DAMAGED_PER_ROUND_MAX, DEALLOCATE_BLOCKS_PER_OP_MAX, INFLIGHT_READS_MAX,
    INFLIGHT_WRITES_MAX, OWN_STALL_LATE_FACTOR, PEER_REPAIRS_MAX, RETRANSMITS_PER_TICK_MAX,
    STREAM_WINDOW_MAX,
};

/// The op number of a term's reconciliation: every block it pushes is tagged with it, and it
/// commits (making the term serve) once every in-sync replica holds them.
const RECONCILE_OP: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the new epoch to be durable here.
    Persisting,
    Reconciling,
    Serving,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Local {
    /// Not issued yet: an earlier write to one of its blocks is in flight.
    Deferred,
    InFlight,
    Durable,
}

#[derive(Debug)]
struct PendingWrite {
    host: HostOpId,
    /// A host deallocate (its blocks are all unmapped) rather than a write.
    deallocate: bool,
    lbas: Range<u64>,
    blocks: Vec<BlockData>,
    local: Local,
    /// When the local write was issued (`Local::InFlight` and after).
    issued_ms: u64,
    /// The stream entry each peer got it as.
    sent: Vec<(NodeId, StreamId, u64)>,
}

#[derive(Debug)]
struct Unacked {
    seq: u64,
    entry: Entry,
    first_sent_ms: u64,
    last_sent_ms: u64,
}

#[derive(Debug)]
struct OutStream {
    id: StreamId,
    incarnation: u64,
    next_seq: u64,
    acked_seq: u64,
    unacked: VecDeque<Unacked>,
    /// How many of `unacked` are copies (`EntryKind::Copy`).
    copies_unacked: usize,
}

impl OutStream {
    fn unacked_lbas(&self, dirty: &mut DirtySet) {
        for unacked in &self.unacked {
            dirty.insert_range(unacked.entry.lbas());
        }
    }
}

#[derive(Debug)]
struct CopyJob {
    dirty: DirtySet,
    /// Copy reads in flight: storage op -> block.
    reads: BTreeMap<StorageOpId, u64>,
    /// Reads overtaken by a host write to their block, which the peer receives live.
    cancelled: BTreeSet<StorageOpId>,
    last_copy_seq: u64,
    /// Reconciliation pushes (tagged `RECONCILE_OP`) rather than a resync.
    reconcile: bool,
    /// The whole volume was dirty when the job started.
    full: bool,
    /// Blocks whose copy read completed: sent, or overtaken by a host write the peer got live.
    blocks_copied: u64,
}

impl CopyJob {
    fn new(dirty: DirtySet, reconcile: bool) -> Self {
        Self {
            full: dirty.is_full(),
            dirty,
            reads: BTreeMap::new(),
            cancelled: BTreeSet::new(),
            last_copy_seq: 0,
            reconcile,
            blocks_copied: 0,
        }
    }

    fn progress(&self, peer: NodeId) -> ResyncProgress {
        // A block leaves the dirty set only for a read, and a read only for the copied count,
        // so the total grows only when blocks are dirtied again.
        let blocks_total = self.blocks_copied + self.reads.len() as u64 + self.dirty.len();
        let progress = ResyncProgress {
            peer,
            full: self.full,
            blocks_total,
            blocks_copied: self.blocks_copied,
        };
        assert!(progress.blocks_copied <= progress.blocks_total);
        progress
    }

    fn finished(&self, stream: &OutStream) -> bool {
        self.dirty.is_empty() && self.reads.is_empty() && stream.acked_seq >= self.last_copy_seq
    }

    /// Everything it still owes, for when it is abandoned.
    fn into_dirty(mut self) -> DirtySet {
        for (_, lba) in std::mem::take(&mut self.reads) {
            self.dirty.insert_range(lba..lba + 1);
        }
        self.dirty
    }
}

#[derive(Debug)]
enum PeerState {
    Probing {
        since_ms: u64,
        last_sent_ms: u64,
    },
    Pushing(CopyJob),
    InSync,
    /// Being removed from the store's in-sync set; every write waits for that.
    Removing(DirtySet),
    OutOfSync(DirtySet),
    /// Receives live writes (from `live_from_op` on) while its dirty blocks are copied.
    CatchingUp {
        job: CopyJob,
        live_from_op: u64,
    },
    /// Caught up; being added to the store's in-sync set. Writes wait for its acks.
    Adding,
}

/// What an out-of-sync peer's dirty set does not cover yet: the blocks on which its replica
/// may have differed from this node's when the term started. The dirty set of such a peer holds
/// this node's own divergence at the start and every block written since; the peer's part
/// comes with its first `Hello` of the term (crate docs, "Resync").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Before {
    /// Nothing: the dirty set is complete (or full).
    Covered,
    /// In the store's in-sync set when the term started, but never probed: the blocks it may
    /// differ on are those of its divergence, which its `Hello` carries.
    InSyncAtStart,
    /// Out of the store's in-sync set when the term started. If it was the primary of the
    /// epoch just before (its `Hello` says so), it held every completed write until the
    /// promotion and its divergence lists the rest; else nothing is known: full copy.
    OutOfSyncAtStart,
}

#[derive(Debug)]
struct Peer {
    state: PeerState,
    /// Anything the dirty set of `OutOfSync` or `Removing` still lacks.
    before: Before,
    stream: Option<OutStream>,
    last_heard_ms: u64,
    last_heartbeat_ms: u64,
}

impl Peer {
    fn job_mut(&mut self) -> Option<&mut CopyJob> {
        match &mut self.state {
            PeerState::Pushing(job) | PeerState::CatchingUp { job, .. } => Some(job),
            _ => None,
        }
    }
}

/// A host read as the primary's storage read carries it; without a host, the repair of blocks
/// the node's scrub found damaged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostRead {
    pub host: Option<HostOpId>,
    pub lba: u64,
    pub count: u32,
}

impl HostRead {
    fn lbas(&self) -> Range<u64> {
        self.lba..self.lba + u64::from(self.count)
    }
}

/// Whether a peer in `state` may be asked for a repair's blocks: an in-sync replica (it
/// applied every write this node completed), or, for a reconciliation's, any member this term
/// probed (`Pushing` or already reconciled), since each held every completed write when the
/// term started.
fn can_serve_repair(state: &PeerState, reconcile: bool) -> bool {
    match state {
        PeerState::InSync => true,
        PeerState::Pushing(_) => reconcile,
        _ => false,
    }
}

/// Whether two LBA ranges share a block.
fn overlap(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

/// A host read whose blocks were damaged here, being read from a replica instead.
#[derive(Debug)]
struct Repair {
    read: HostRead,
    /// The peer asked now, and those that could not give the blocks.
    peer: NodeId,
    tried: Vec<NodeId>,
    asked_ms: u64,
    last_sent_ms: u64,
    /// A write to one of the blocks was pending when the replica was asked, or started
    /// since: the replica's copy may then be older than what this node must hold, so it only
    /// answers the host (a read beside a write may return either) and is not written here.
    overwritten: bool,
    /// A block a reconciliation found damaged here: asked of the probed members, and the copy
    /// becomes this node's own (see `Term::reconcile_damaged`).
    reconcile: bool,
}

/// A read of this node's blocks for a replica whose copy of them is damaged.
#[derive(Debug)]
struct PeerRepair {
    peer: NodeId,
    stream: StreamId,
    lbas: Range<u64>,
    /// A host write to the blocks started meanwhile: its own entry reaches the replica after
    /// this copy would, so the copy is not sent.
    cancelled: bool,
}

/// A copy read that completed: which read, for which peer and stream, of which block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CopyRead {
    pub id: StorageOpId,
    pub peer: NodeId,
    pub stream: StreamId,
    pub lba: u64,
}

#[derive(Debug)]
pub(crate) struct Term {
    pub epoch: u64,
    /// The lease this node was promoted with; the term ends if the node holds another.
    pub lease: LeaseId,
    phase: Phase,
    next_op: u64,
    committed_op: u64,
    pending: BTreeMap<u64, PendingWrite>,
    /// The pending writes not yet issued locally (`Local::Deferred`), so that issuing them
    /// looks only at those, not at every pending write.
    deferred: BTreeSet<u64>,
    /// The pending writes durable here (`Local::Durable`), so that completing looks only at
    /// those: writes still in flight locally cannot complete, however many peers acked them.
    durable: BTreeSet<u64>,
    /// When a local write (or storage probe) that had been in flight for half the ack timeout
    /// or more last finished: this node's own storage was stalled until then.
    own_stall_ended_ms: Option<u64>,
    /// When the latest-issued local write or storage probe that completed was issued: this
    /// node's own storage took writes issued then.
    own_ok_issued_ms: Option<u64>,
    /// The storage probe in flight (an intent persist this term asked for to learn whether its
    /// own storage takes writes while a peer is late): its version and when it was issued.
    probe: Option<(u64, u64)>,
    reads_in_flight: usize,
    /// Host reads being served from a replica's copy, by request number (counted in
    /// `reads_in_flight` until they complete).
    repairs: BTreeMap<u64, Repair>,
    next_repair: u64,
    /// Reads for replicas whose copies are damaged, by storage request.
    peer_repairs: BTreeMap<StorageOpId, PeerRepair>,
    /// Blocks a reconciliation copy read found damaged here, not rewritten yet: each is read
    /// from a probed member (a reconcile `Repair`), then written here (`reconcile_fetched`,
    /// then a write in flight), and the pushes of the block wait for that. At most the blocks
    /// of the reconciliation's dirty sets (each bounded by `dirty_lbas_max`), as is `adopted`;
    /// `reconcile_fetched` holds at most `INFLIGHT_READS_MAX`, one per repair.
    reconcile_damaged: BTreeSet<u64>,
    /// Copies of `reconcile_damaged` blocks got from a member, waiting for their regions to be
    /// in the durable write intent (or for a write in flight to them) before they are written.
    reconcile_fetched: BTreeMap<u64, BlockData>,
    /// Blocks whose value this term changed while reconciling (a damaged block taken from a
    /// member): every member must get them, so they join every dirty set made from this
    /// node's divergence (`own_divergence_dirty`) as well as those that exist.
    adopted: BTreeSet<u64>,
    /// No probed member could give a damaged block: the reconciliation cannot finish, and the
    /// node stops as on an I/O error, so another in-sync member is promoted.
    reconcile_unrecoverable: bool,
    peers: BTreeMap<NodeId, Peer>,
    next_stream: u64,
    /// This node's divergence when the term started, for reconciliation.
    own_divergence: DivergenceReport,
    dirty_limit: usize,
    /// Blocks resync and reconciliation may still start before the next tick: refilled to
    /// `copy_blocks_per_tick` by every tick, spent by every call of `pump_copies`, so copies
    /// follow the rate limit however often acknowledgements arrive.
    copy_budget: u32,
    volume_blocks: u64,
}

impl Term {
    /// Starts the term the store's view names this node primary of.
    pub fn start(shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) -> Term {
        let Some(view) = &shared.view else {
            unreachable!("a term starts from a view of the store");
        };
        let epoch = view.value.epoch;
        assert_eq!(epoch, shared.epoch);
        assert!(epoch > shared.term_started);
        shared.term_started = epoch;
        shared.stats.terms_started += 1;
        let mut term = Term {
            epoch,
            lease: view.value.primary_lease,
            phase: Phase::Persisting,
            next_op: RECONCILE_OP + 1,
            committed_op: 0,
            pending: BTreeMap::new(),
            deferred: BTreeSet::new(),
            durable: BTreeSet::new(),
            own_stall_ended_ms: None,
            own_ok_issued_ms: None,
            probe: None,
            reads_in_flight: 0,
            repairs: BTreeMap::new(),
            next_repair: 1,
            peer_repairs: BTreeMap::new(),
            reconcile_damaged: BTreeSet::new(),
            reconcile_fetched: BTreeMap::new(),
            adopted: BTreeSet::new(),
            reconcile_unrecoverable: false,
            peers: BTreeMap::new(),
            next_stream: 1,
            own_divergence: shared.divergence.report(),
            dirty_limit: shared.config.dirty_lbas_max,
            copy_budget: shared.config.copy_blocks_per_tick,
            volume_blocks: shared.config.volume_blocks,
        };
        term.on_persisted(shared, now_ms, out);
        term
    }

    /// The blocks of the host writes not yet completed (uncommitted, whether issued locally
    /// or not).
    pub fn pending_lbas(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        self.pending.values().map(|write| write.lbas.clone())
    }

    /// The volume grew to `volume_blocks` (`VolumeNode::grow`): the peers' dirty sets reach
    /// the new end, so a full copy under way copies the new blocks too.
    pub fn grow(&mut self, volume_blocks: u64) {
        assert!(volume_blocks >= self.volume_blocks, "volumes only grow");
        self.volume_blocks = volume_blocks;
        for peer in self.peers.values_mut() {
            match &mut peer.state {
                PeerState::Pushing(job) | PeerState::CatchingUp { job, .. } => {
                    job.dirty.grow(volume_blocks);
                }
                PeerState::Removing(dirty) | PeerState::OutOfSync(dirty) => {
                    dirty.grow(volume_blocks);
                }
                PeerState::Probing { .. } | PeerState::InSync | PeerState::Adding => {}
            }
        }
    }

    /// The copy jobs of this term, one per peer being resynced, rebuilt or reconciled.
    pub fn resync_progress(&self) -> Vec<ResyncProgress> {
        let mut progress = Vec::new();
        for (&node, peer) in &self.peers {
            if let PeerState::Pushing(job) | PeerState::CatchingUp { job, .. } = &peer.state {
                progress.push(job.progress(node));
            }
        }
        progress
    }

    /// Whether a host write may start now as far as the replicas being resynced go: each one's
    /// stream holds fewer live writes than its window leaves them (`STREAM_WINDOW_MAX` less
    /// `COPY_WINDOW_MAX` for its copies). A write started beyond that would end the resync of a
    /// replica that acknowledges more slowly than hosts write; held back, the hosts write at
    /// its pace until it is back in sync, as they do for an in-sync replica.
    ///
    /// Once its copies are all acknowledged, hosts also wait until it has acknowledged every
    /// completed write, the moment it joins (`advance_peer`): writes that complete on the
    /// in-sync replicas faster than it acknowledges them would otherwise put that moment off
    /// for as long as the load lasts. The wait is about one of its acknowledgements.
    pub fn admits_write(&self) -> bool {
        self.peers.values().all(|peer| {
            let (PeerState::CatchingUp { job, .. }, Some(stream)) = (&peer.state, &peer.stream)
            else {
                return true;
            };
            if stream.unacked.len() - stream.copies_unacked >= STREAM_WINDOW_MAX - COPY_WINDOW_MAX {
                return false;
            }
            if !(job.dirty.is_empty() && job.reads.is_empty()) {
                return true;
            }
            stream.unacked.iter().all(|unacked| match unacked.entry.kind {
                EntryKind::Write { op } => self.pending.contains_key(&op),
                EntryKind::Copy { .. } => false,
            })
        })
    }

    /// The peers that hold exactly what this node holds, while no host write is pending (none
    /// admitted and not completed): every write completed on each peer in `InSync` or
    /// `Adding`, and none is in flight to any. `None` while a write is pending or the term does
    /// not serve yet. See `VolumeNode::quiet_copies`.
    pub fn quiet_copies(&self) -> Option<Vec<NodeId>> {
        if self.phase != Phase::Serving || !self.pending.is_empty() {
            return None;
        }
        let copies = self.peers.iter().filter_map(|(&node, peer)| {
            matches!(peer.state, PeerState::InSync | PeerState::Adding).then_some(node)
        });
        Some(copies.collect())
    }

    pub fn serving(&self, shared: &Shared, now_ms: u64) -> bool {
        self.phase == Phase::Serving
            && !shared.latched
            && shared.valid_lease(now_ms) == Some(self.lease)
    }

    pub fn on_persisted(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if self.phase != Phase::Persisting || shared.persisted_epoch < self.epoch {
            return;
        }
        // The epoch is durable: from now on this node refuses every older epoch, even after a
        // restart. Only now may anything of this term happen.
        self.phase = Phase::Reconciling;
        // A restart of this node can then still say it was this epoch's primary, which lets
        // the next primary copy it only what changed (crate docs, "Write intent").
        shared.intent.set_term_epoch(self.epoch);
        shared.flush_intent(out);
        let Some(view) = &shared.view else {
            unreachable!("a term starts from a view of the store");
        };
        let volume = &view.value;
        for &member in volume.members.iter().filter(|&&member| member != shared.me) {
            let (state, before) = if volume.in_sync.contains(&member) {
                (PeerState::Probing { since_ms: now_ms, last_sent_ms: now_ms }, Before::Covered)
            } else {
                // It may be the previous primary, which then lacks only the blocks this term
                // writes and those of its own divergence and of this node's.
                (PeerState::OutOfSync(self.own_divergence_dirty()), Before::OutOfSyncAtStart)
            };
            let peer = Peer {
                state,
                before,
                stream: None,
                last_heard_ms: now_ms,
                last_heartbeat_ms: now_ms,
            };
            self.peers.insert(member, peer);
        }
        let probing: Vec<NodeId> = self
            .peers
            .iter()
            .filter(|(_, peer)| matches!(peer.state, PeerState::Probing { .. }))
            .map(|(&node, _)| node)
            .collect();
        for node in probing {
            shared.send(node, Message::Probe { epoch: self.epoch }, out);
        }
        self.maybe_finish_reconcile(shared);
    }

    /// Serving starts once every in-sync peer holds this node's version of every block that
    /// may differ (or has been removed from the in-sync set).
    fn maybe_finish_reconcile(&mut self, shared: &mut Shared) {
        if self.phase != Phase::Reconciling {
            return;
        }
        let done = self
            .peers
            .values()
            .all(|peer| matches!(peer.state, PeerState::InSync | PeerState::OutOfSync(_)));
        if done {
            self.phase = Phase::Serving;
            self.committed_op = RECONCILE_OP;
            // Every in-sync replica now holds this node's blocks wherever they could differ.
            shared.divergence.clear();
        }
    }

    /// The primary steps down: pending writes fail (the host retries on the next primary), and
    /// their blocks join this node's divergence, since it may hold them and others may not.
    pub fn end(self, shared: &mut Shared, out: &mut Vec<Action>) {
        shared.stats.terms_ended += 1;
        shared.stats.writes_failed += self.pending.len() as u64;
        for host in self.repairs.into_values().filter_map(|repair| repair.read.host) {
            out.push(Action::CompleteHost {
                id: host,
                epoch: self.epoch,
                result: Err(HostError::NotPrimary),
            });
        }
        for (op, write) in self.pending {
            shared.divergence.record(self.epoch, op, write.lbas);
            out.push(Action::CompleteHost {
                id: write.host,
                epoch: self.epoch,
                result: Err(HostError::NotPrimary),
            });
        }
    }

    pub fn on_host(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        id: HostOpId,
        op: HostOp,
        out: &mut Vec<Action>,
    ) {
        let result = self.start_host_op(shared, now_ms, id, op, out);
        if let Some(result) = result {
            out.push(Action::CompleteHost { id, epoch: self.epoch, result });
        }
    }

    /// Returns the completion if the command completes at once.
    fn start_host_op(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        id: HostOpId,
        op: HostOp,
        out: &mut Vec<Action>,
    ) -> Option<Result<HostReply, HostError>> {
        if !self.serving(shared, now_ms) {
            return Some(Err(HostError::NotPrimary));
        }
        match op {
            HostOp::Flush => Some(Ok(HostReply::Flushed)),
            HostOp::Read { lba, count } => {
                if let Err(error) = check_range(shared, lba, u64::from(count), BLOCKS_PER_OP_MAX) {
                    return Some(Err(error));
                }
                if self.reads_in_flight >= INFLIGHT_READS_MAX {
                    return Some(Err(HostError::Busy));
                }
                self.reads_in_flight += 1;
                let purpose = Purpose::HostRead { epoch: self.epoch, host: id, lba, count };
                shared.storage_read(lba, count, purpose, out);
                None
            }
            HostOp::Write { lba, blocks } => {
                let count = blocks.len() as u64;
                if let Err(error) = check_range(shared, lba, count, BLOCKS_PER_OP_MAX) {
                    return Some(Err(error));
                }
                let expected_bytes = shared.config.block_size_bytes;
                if let Some((index, block)) =
                    blocks.iter().enumerate().find(|(_, block)| block.len() != expected_bytes)
                {
                    let size_bytes = block.len();
                    return Some(Err(HostError::BlockSize { index, size_bytes, expected_bytes }));
                }
                if self.pending.len() >= INFLIGHT_WRITES_MAX {
                    return Some(Err(HostError::Busy));
                }
                let blocks = blocks.into_iter().map(Some).collect();
                self.start_write(shared, now_ms, id, lba, blocks, out);
                None
            }
            HostOp::Deallocate { lba, count } => {
                let max = DEALLOCATE_BLOCKS_PER_OP_MAX;
                if let Err(error) = check_range(shared, lba, u64::from(count), max) {
                    return Some(Err(error));
                }
                if self.pending.len() >= INFLIGHT_WRITES_MAX {
                    return Some(Err(HostError::Busy));
                }
                // Exactly a write of unmapped blocks: numbered, streamed to every replica,
                // ordered against overlapping writes here and there.
                let blocks = vec![None; count as usize];
                self.start_write(shared, now_ms, id, lba, blocks, out);
                None
            }
        }
    }

    /// Starts a host write, or a host deallocate: every block of a host write holds data, so
    /// blocks that are all unmapped are a deallocate.
    fn start_write(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        host: HostOpId,
        lba: u64,
        blocks: Vec<BlockData>,
        out: &mut Vec<Action>,
    ) {
        assert_eq!(self.phase, Phase::Serving);
        let deallocate = blocks.iter().all(Option::is_none);
        assert!(deallocate || blocks.iter().all(Option::is_some), "a write is data or unmapped");
        let op = self.next_op;
        self.next_op += 1;
        let lbas = lba..lba + blocks.len() as u64;
        for repair in self.repairs.values_mut() {
            if overlap(&repair.read.lbas(), &lbas) {
                repair.overwritten = true;
            }
        }
        for repair in self.peer_repairs.values_mut() {
            if overlap(&repair.lbas, &lbas) {
                repair.cancelled = true;
            }
        }
        let entry = Entry { kind: EntryKind::Write { op }, lba, blocks: blocks.clone() };
        assert!(entry.length_valid(), "host commands are checked before they get here");
        let mut sent = Vec::new();
        let nodes: Vec<NodeId> = self.peers.keys().copied().collect();
        for node in nodes {
            let Some(peer) = self.peers.get_mut(&node) else { continue };
            if let Some(job) = peer.job_mut() {
                // A copy read of these blocks would now be older than this write, which the
                // peer receives live after it.
                for (&read, &block) in &job.reads {
                    if lbas.contains(&block) {
                        job.cancelled.insert(read);
                    }
                }
                // Nor do they need a copy any more: the live write brings them up to date (if
                // the peer leaves the resync before acknowledging it, its blocks are owed
                // again). Copying a block that hosts keep writing would also make the peer's
                // in-order stream wait behind its own live writes to that block.
                job.blocks_copied += job.dirty.remove_range(lbas.clone());
            }
            let full = peer.stream.as_ref().is_some_and(|s| s.unacked.len() >= STREAM_WINDOW_MAX);
            if full && matches!(peer.state, PeerState::CatchingUp { .. }) {
                self.abort_peer(node);
            }
            let Some(peer) = self.peers.get_mut(&node) else { continue };
            match &mut peer.state {
                PeerState::InSync | PeerState::Adding | PeerState::CatchingUp { .. } => {
                    let Some(stream) = peer.stream.as_mut() else {
                        unreachable!("peers taking live writes have a stream");
                    };
                    let seq = send_entry(
                        shared,
                        self.epoch,
                        node,
                        stream,
                        self.committed_op,
                        entry.clone(),
                        now_ms,
                        out,
                    );
                    sent.push((node, stream.id, seq));
                }
                PeerState::Removing(dirty) | PeerState::OutOfSync(dirty) => {
                    dirty.insert_range(lbas.clone());
                }
                PeerState::Probing { .. } | PeerState::Pushing(_) => {
                    unreachable!("no peer is being reconciled while the term serves")
                }
            }
        }
        // Its regions join the write intent now, so that one persist serves every write that
        // arrives meanwhile.
        shared.intent.want(lbas.clone(), now_ms);
        let local = Local::Deferred;
        let write = PendingWrite { host, deallocate, lbas, blocks, local, issued_ms: 0, sent };
        self.pending.insert(op, write);
        self.deferred.insert(op);
        self.issue_deferred(shared, now_ms, out);
    }

    /// Issues local writes in op order, each once no earlier write to its blocks is in flight
    /// and its regions are in the durable write intent (it is uncommitted until it completes).
    fn issue_deferred(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if self.deferred.is_empty() {
            return;
        }
        let mut waiting: Vec<Range<u64>> = Vec::new();
        let (pending, epoch) = (&mut self.pending, self.epoch);
        // In op order; a write issued leaves the deferred set.
        self.deferred.retain(|&op| {
            let Some(write) = pending.get_mut(&op) else {
                unreachable!("a deferred write is pending until it completes");
            };
            assert_eq!(write.local, Local::Deferred);
            let overlaps_waiting = waiting.iter().any(|other| overlap(other, &write.lbas));
            if overlaps_waiting
                || shared.write_in_flight(write.lbas.clone())
                || !shared.intend(write.lbas.clone(), now_ms, out)
            {
                waiting.push(write.lbas.clone());
                return true;
            }
            write.local = Local::InFlight;
            write.issued_ms = now_ms;
            let purpose = Purpose::LocalWrite { epoch, op };
            shared.storage_write(write.lbas.start, write.blocks.clone(), purpose, out);
            false
        });
    }

    pub fn on_local_write_done(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        op: u64,
        out: &mut Vec<Action>,
    ) {
        if let Some(write) = self.pending.get_mut(&op) {
            assert_eq!(write.local, Local::InFlight);
            write.local = Local::Durable;
            self.durable.insert(op);
            let issued_ms = write.issued_ms;
            self.own_write_done(shared, issued_ms, now_ms);
        }
        self.try_complete(shared, now_ms, out);
    }

    /// A local write or storage probe issued at `issued_ms` completed.
    fn own_write_done(&mut self, shared: &Shared, issued_ms: u64, now_ms: u64) {
        if issued_ms + shared.config.ack_timeout_ms / 2 <= now_ms {
            self.own_stall_ended_ms = Some(now_ms);
        }
        self.own_ok_issued_ms =
            Some(self.own_ok_issued_ms.map_or(issued_ms, |ok| ok.max(issued_ms)));
    }

    /// An intent persist of `version` completed; if it was this term's storage probe, this
    /// node's own storage took a write issued when the probe was.
    pub fn on_intent_persisted(&mut self, shared: &Shared, version: u64, now_ms: u64) {
        if let Some((probe, issued_ms)) = self.probe {
            if probe == version {
                self.probe = None;
                self.own_write_done(shared, issued_ms, now_ms);
            }
        }
    }

    /// A storage request finished: writes waiting for its blocks may go, and so may copies.
    pub fn on_storage_idle(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        self.issue_deferred(shared, now_ms, out);
        self.write_fetched(shared, now_ms, out);
        self.pump_copies(shared, out);
        self.try_complete(shared, now_ms, out);
    }

    pub fn on_host_read_done(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        read: HostRead,
        result: StorageResult,
        out: &mut Vec<Action>,
    ) {
        assert!(self.reads_in_flight > 0);
        let result = match result {
            StorageResult::Read(blocks) if self.serving(shared, now_ms) => {
                Ok(HostReply::Read(blocks))
            }
            StorageResult::Damaged if self.serving(shared, now_ms) => {
                let lbas = read.lbas();
                let overwritten = shared.write_in_flight(lbas.clone())
                    || self.pending_lbas().any(|write| overlap(&write, &lbas));
                self.start_repair(shared, now_ms, read, overwritten, false, out);
                return;
            }
            _ => Err(HostError::NotPrimary),
        };
        self.reads_in_flight -= 1;
        if let Some(host) = read.host {
            out.push(Action::CompleteHost { id: host, epoch: self.epoch, result });
        }
    }

    /// Asks the next in-sync replica with a stream for the blocks of repair `request` (for a
    /// reconciliation's, the next probed member), or, if every one was tried, fails the host
    /// read as damaged (a reconciliation's: see `reconcile_unrecoverable`).
    fn ask_next_peer(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        request: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(repair) = self.repairs.get_mut(&request) else { return };
        let reconcile = repair.reconcile;
        let next = self.peers.iter().find_map(|(&node, peer)| {
            let stream = peer.stream.as_ref()?;
            let untried = !repair.tried.contains(&node);
            (can_serve_repair(&peer.state, reconcile) && untried)
                .then_some((node, stream.incarnation))
        });
        let Some((node, incarnation)) = next else {
            let read = repair.read;
            self.repairs.remove(&request);
            self.reads_in_flight -= 1;
            if reconcile {
                if !self.reconcile_unrecoverable {
                    shared.stats.reconcile_unrecovered += 1;
                }
                self.reconcile_unrecoverable = true;
                return;
            }
            // A scrub's repair stays among the damaged blocks and is tried again later.
            if let Some(host) = read.host {
                shared.stats.reads_unrecovered += 1;
                let result = Err(HostError::Damaged { lba: read.lba, count: read.count });
                out.push(Action::CompleteHost { id: host, epoch: self.epoch, result });
            }
            return;
        };
        repair.peer = node;
        repair.tried.push(node);
        repair.asked_ms = now_ms;
        repair.last_sent_ms = now_ms;
        let HostRead { lba, count, .. } = repair.read;
        let message = Message::Read { epoch: self.epoch, incarnation, request, lba, count };
        shared.send(node, message, out);
    }

    /// A replica's answer to a repair's `Read`: the host gets its blocks, and this node
    /// rewrites them unless a write to them came first; without blocks, the next replica is
    /// asked.
    fn on_read_reply(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        from: NodeId,
        request: u64,
        blocks: Option<Vec<BlockData>>,
        out: &mut Vec<Action>,
    ) {
        let Some(repair) = self.repairs.get(&request) else { return };
        if repair.peer != from {
            return;
        }
        let count = repair.read.count;
        let Some(blocks) = blocks.filter(|blocks| blocks.len() == count as usize) else {
            self.ask_next_peer(shared, now_ms, request, out);
            return;
        };
        let block_bytes = shared.config.block_size_bytes;
        if repair.reconcile {
            // Mapped blocks of the node's size, or unmapped: anything else is not a copy.
            if blocks.iter().flatten().any(|block| block.len() != block_bytes) {
                self.ask_next_peer(shared, now_ms, request, out);
                return;
            }
            let Some(repair) = self.repairs.remove(&request) else { return };
            self.reads_in_flight -= 1;
            if self.phase == Phase::Reconciling {
                let lba = repair.read.lba;
                if let (true, Some(block)) =
                    (self.reconcile_damaged.contains(&lba), blocks.into_iter().next())
                {
                    self.reconcile_fetched.insert(lba, block);
                    self.write_fetched(shared, now_ms, out);
                }
            }
            return;
        }
        let Some(repair) = self.repairs.remove(&request) else { return };
        self.reads_in_flight -= 1;
        let HostRead { host, lba, .. } = repair.read;
        if !self.serving(shared, now_ms) {
            if let Some(host) = host {
                out.push(Action::CompleteHost {
                    id: host,
                    epoch: self.epoch,
                    result: Err(HostError::NotPrimary),
                });
            }
            return;
        }
        if host.is_some() {
            shared.stats.reads_repaired += 1;
        }
        let lbas = lba..lba + u64::from(count);
        let well_formed = blocks.iter().flatten().all(|block| block.len() == block_bytes);
        // A write to these blocks pending now came after the ask (it sets `overwritten`) or
        // before it (so did it): either way the copy is not written here. Like every write of
        // a primary it goes only inside the durable write intent; if its regions are not there
        // yet, the blocks join the damaged ones and are repaired again once they are.
        if well_formed && !repair.overwritten && !shared.write_in_flight(lbas.clone()) {
            if shared.intend(lbas.clone(), now_ms, out) {
                shared.stats.blocks_repaired += u64::from(count);
                let purpose = Purpose::Repair { epoch: self.epoch };
                shared.storage_write(lba, blocks.clone(), purpose, out);
            } else {
                for lba in lbas {
                    let _ = shared.note_damaged(lba);
                }
            }
        }
        let result = if well_formed {
            Ok(HostReply::Read(blocks))
        } else {
            Err(HostError::Damaged { lba, count })
        };
        if let Some(host) = host {
            out.push(Action::CompleteHost { id: host, epoch: self.epoch, result });
        }
    }

    /// Starts repairs of blocks the node's scrub found damaged here, a few per round, each
    /// read from an in-sync replica and rewritten as a host read's would be (a block with a
    /// host write pending or a repair under way waits: the write replaces it anyway).
    pub fn repair_damaged(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if !self.serving(shared, now_ms) {
            return;
        }
        let pending: Vec<Range<u64>> = self.pending_lbas().collect();
        let repairing: Vec<Range<u64>> =
            self.repairs.values().map(|repair| repair.read.lbas()).collect();
        let overlaps =
            |lba: u64, ranges: &[Range<u64>]| ranges.iter().any(|range| range.contains(&lba));
        let due: Vec<u64> = shared
            .damaged
            .iter()
            .copied()
            .filter(|&lba| !overlaps(lba, &pending) && !overlaps(lba, &repairing))
            .filter(|&lba| !shared.write_in_flight(lba..lba + 1))
            .take(DAMAGED_PER_ROUND_MAX)
            .collect();
        for lba in due {
            if self.reads_in_flight >= INFLIGHT_READS_MAX {
                return;
            }
            self.reads_in_flight += 1;
            let read = HostRead { host: None, lba, count: 1 };
            self.start_repair(shared, now_ms, read, false, false, out);
        }
    }

    /// Reads `read`'s blocks from an in-sync replica (the read counts in `reads_in_flight`
    /// until it completes). `overwritten` and `reconcile`: see `Repair`.
    fn start_repair(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        read: HostRead,
        overwritten: bool,
        reconcile: bool,
        out: &mut Vec<Action>,
    ) {
        let request = self.next_repair;
        self.next_repair += 1;
        let repair = Repair {
            read,
            peer: shared.me,
            tried: Vec::new(),
            asked_ms: now_ms,
            last_sent_ms: now_ms,
            overwritten,
            reconcile,
        };
        self.repairs.insert(request, repair);
        self.ask_next_peer(shared, now_ms, request, out);
    }

    /// An in-sync replica reports its copy of blocks damaged: this node reads its own and
    /// sends them on the replica's stream as a copy entry, unless a host write to them is
    /// pending (its entry replaces them there) or starts before the read is back.
    fn on_peer_damaged(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        from: NodeId,
        incarnation: u64,
        lbas: Range<u64>,
        out: &mut Vec<Action>,
    ) {
        let Some(peer) = self.peers.get(&from) else { return };
        let Some(stream) = peer.stream.as_ref() else { return };
        let count = lbas.end.saturating_sub(lbas.start);
        let valid = (1..=u64::from(BLOCKS_PER_OP_MAX)).contains(&count)
            && lbas.end <= shared.config.volume_blocks;
        if !matches!(peer.state, PeerState::InSync)
            || stream.incarnation != incarnation
            || !valid
            || !self.serving(shared, now_ms)
            || self.peer_repairs.len() >= PEER_REPAIRS_MAX
            || self.peer_repairs.values().any(|repair| repair.peer == from && repair.lbas == lbas)
            || shared.write_in_flight(lbas.clone())
            || self.pending_lbas().any(|write| overlap(&write, &lbas))
        {
            return;
        }
        let stream = stream.id;
        let purpose = Purpose::PeerRepairRead { epoch: self.epoch, count: count as u32 };
        let id = shared.storage_read(lbas.start, count as u32, purpose, out);
        self.peer_repairs.insert(id, PeerRepair { peer: from, stream, lbas, cancelled: false });
    }

    /// This node's copy for a replica's damaged blocks is read: sent on that replica's stream
    /// if it is still the same in-sync stream and no host write came first. Damaged here too,
    /// the blocks join this node's own damaged ones, which it repairs from another replica.
    pub fn on_peer_repair_read(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        id: StorageOpId,
        result: StorageResult,
        out: &mut Vec<Action>,
    ) {
        let Some(repair) = self.peer_repairs.remove(&id) else { return };
        let blocks = match result {
            StorageResult::Read(blocks) => blocks,
            StorageResult::Damaged => {
                for lba in repair.lbas {
                    let _ = shared.note_damaged(lba);
                }
                return;
            }
            _ => return,
        };
        let Some(peer) = self.peers.get_mut(&repair.peer) else { return };
        if repair.cancelled || !matches!(peer.state, PeerState::InSync) {
            return;
        }
        // Copies on one stream stay under COPY_WINDOW_MAX, whatever else it holds: an in-sync
        // replica's live writes (at most INFLIGHT_WRITES_MAX) leave them room in the window,
        // and under a steady load it always has tens of them unacknowledged.
        let Some(stream) = peer
            .stream
            .as_mut()
            .filter(|stream| stream.id == repair.stream && stream.copies_unacked < COPY_WINDOW_MAX)
        else {
            return;
        };
        shared.stats.blocks_sent_for_repair += repair.lbas.end - repair.lbas.start;
        // Only completed writes are in it: none to these blocks was pending.
        let entry =
            Entry { kind: EntryKind::Copy { covers_op: 0 }, lba: repair.lbas.start, blocks };
        send_entry(shared, self.epoch, repair.peer, stream, self.committed_op, entry, now_ms, out);
    }

    /// Completes every pending write that is durable here and on every peer it must wait for.
    fn try_complete(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if !self.serving(shared, now_ms) {
            return;
        }
        if self.peers.values().any(|peer| matches!(peer.state, PeerState::Removing(_))) {
            return;
        }
        // The durable writes in op order, up to the first one an in-sync peer has not
        // acknowledged on the stream it still has: every later write went to it after, on that
        // stream, with a higher sequence number, and acknowledgements are cumulative, so none
        // of them is acknowledged either. The scan stays short however many writes are pending.
        let mut complete: Vec<u64> = Vec::new();
        'writes: for &op in &self.durable {
            let Some(write) = self.pending.get(&op) else {
                unreachable!("a durable write stays pending until it completes")
            };
            assert_eq!(write.local, Local::Durable);
            let mut all_acked = true;
            for (&node, peer) in &self.peers {
                if !matches!(peer.state, PeerState::InSync | PeerState::Adding) {
                    continue;
                }
                let sent = write.sent.iter().find(|(sent_to, _, _)| *sent_to == node);
                let current = |stream_id| peer.stream.as_ref().filter(|s| s.id == stream_id);
                match sent {
                    Some(&(_, stream_id, seq)) => match current(stream_id) {
                        Some(stream) if stream.acked_seq >= seq => {}
                        Some(_) => break 'writes,
                        None => all_acked = false,
                    },
                    None => unreachable!(
                        "{node} must acknowledge a write it was never sent: in-sync peers get \
                         every write"
                    ),
                }
            }
            if all_acked {
                complete.push(op);
            }
        }
        for op in complete {
            self.durable.remove(&op);
            let Some(write) = self.pending.remove(&op) else { continue };
            let result = if write.deallocate {
                shared.stats.deallocates_completed += 1;
                shared.stats.blocks_deallocated += write.lbas.end - write.lbas.start;
                Ok(HostReply::Deallocated)
            } else {
                shared.stats.writes_completed += 1;
                Ok(HostReply::Written)
            };
            out.push(Action::CompleteHost { id: write.host, epoch: self.epoch, result });
        }
        self.committed_op = self.pending.keys().next().map_or(self.next_op - 1, |first| first - 1);
        // Peers waiting for the writes from before they took live writes may be done now
        // (only those copying can be; the peers neither come nor go here).
        for index in 0..self.peers.len() {
            let Some((&node, peer)) = self.peers.iter().nth(index) else { break };
            if matches!(peer.state, PeerState::Pushing(_) | PeerState::CatchingUp { .. }) {
                self.advance_peer(shared, node);
            }
        }
    }

    pub fn on_peer_message(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        from: NodeId,
        message: Message,
        out: &mut Vec<Action>,
    ) {
        if !self.peers.contains_key(&from) {
            return;
        }
        match message {
            Message::Ack { stream, durable_seq, .. } => {
                self.on_ack(shared, now_ms, from, stream, durable_seq, out)
            }
            // A peer larger than this node learned of a grow first: its divergence may lie
            // beyond this node's end, where a copy could not reach it. The reply and the
            // `Hello` come again (probes are sent again, hellos repeat) and count once this
            // node has grown too; a probed peer that is still larger after `ack_timeout_ms`
            // leaves the in-sync set like any silent one.
            Message::ProbeReply { volume_blocks, .. } | Message::Hello { volume_blocks, .. }
                if volume_blocks > self.volume_blocks => {}
            Message::ProbeReply { incarnation, divergence, .. } => {
                self.on_probe_reply(shared, now_ms, from, incarnation, divergence)
            }
            Message::Hello { incarnation, last_term_epoch, divergence, .. } => {
                let said = Hello { incarnation, last_term_epoch, divergence };
                self.on_hello(shared, now_ms, from, said, out)
            }
            Message::Resync { incarnation, .. } => {
                let stale = self
                    .peers
                    .get(&from)
                    .and_then(|peer| peer.stream.as_ref())
                    .is_some_and(|stream| stream.incarnation != incarnation);
                if stale {
                    self.abort_peer(from);
                }
            }
            Message::Failed { .. } => self.abort_peer(from),
            Message::ReadReply { request, blocks, .. } => {
                self.on_read_reply(shared, now_ms, from, request, blocks, out)
            }
            Message::Damaged { incarnation, lba, count, .. } => {
                let lbas = lba..lba.saturating_add(u64::from(count));
                self.on_peer_damaged(shared, now_ms, from, incarnation, lbas, out)
            }
            _ => {}
        }
        self.drive_membership(shared, now_ms, out);
        self.try_complete(shared, now_ms, out);
        self.maybe_finish_reconcile(shared);
    }

    fn on_ack(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        from: NodeId,
        stream_id: StreamId,
        durable_seq: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(peer) = self.peers.get_mut(&from) else { return };
        let Some(stream) = peer.stream.as_mut() else { return };
        if stream.id != stream_id {
            return;
        }
        peer.last_heard_ms = now_ms;
        let durable_seq = durable_seq.min(stream.next_seq - 1);
        if durable_seq > stream.acked_seq {
            stream.acked_seq = durable_seq;
            while stream.unacked.front().is_some_and(|unacked| unacked.seq <= durable_seq) {
                if let Some(Unacked { entry: Entry { kind: EntryKind::Copy { .. }, .. }, .. }) =
                    stream.unacked.pop_front()
                {
                    stream.copies_unacked -= 1;
                }
            }
        }
        self.advance_peer(shared, from);
        self.pump_copies(shared, out);
    }

    fn on_probe_reply(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        from: NodeId,
        incarnation: u64,
        divergence: DivergenceReport,
    ) {
        if !self
            .peers
            .get(&from)
            .is_some_and(|peer| matches!(peer.state, PeerState::Probing { .. }))
        {
            return;
        }
        // The blocks where the two may differ: those either applied beyond a commit point.
        let mut dirty = self.own_divergence_dirty();
        add_divergence(&mut dirty, &divergence);
        if dirty.is_full() {
            shared.stats.reconciled_full += 1;
        }
        let Some(peer) = self.peers.get_mut(&from) else { return };
        peer.stream = Some(new_stream(&mut self.next_stream, incarnation));
        peer.last_heard_ms = now_ms;
        peer.state = if dirty.is_empty() {
            PeerState::InSync
        } else {
            PeerState::Pushing(CopyJob::new(dirty, true))
        };
    }

    fn on_hello(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        from: NodeId,
        said: Hello,
        out: &mut Vec<Action>,
    ) {
        let Hello { incarnation, last_term_epoch, divergence } = said;
        let serving = self.phase == Phase::Serving;
        // The peer was the primary of the epoch just before this one, so in sync until the
        // promotion that took it out of the in-sync set.
        let primary_before = last_term_epoch > 0 && last_term_epoch + 1 == self.epoch;
        let full = self.full_dirty();
        let Some(peer) = self.peers.get_mut(&from) else { return };
        if peer.stream.as_ref().is_some_and(|stream| stream.incarnation != incarnation) {
            // The replica restarted: what its stream state was is gone.
            self.abort_peer(from);
        }
        let Some(peer) = self.peers.get_mut(&from) else { return };
        match &mut peer.state {
            PeerState::Probing { last_sent_ms, .. } => {
                *last_sent_ms = now_ms;
                shared.send(from, Message::Probe { epoch: self.epoch }, out);
            }
            PeerState::OutOfSync(dirty) if serving => {
                let mut dirty =
                    std::mem::replace(dirty, DirtySet::empty(self.dirty_limit, self.volume_blocks));
                let before = std::mem::replace(&mut peer.before, Before::Covered);
                match before {
                    Before::Covered => {}
                    Before::InSyncAtStart => add_divergence(&mut dirty, &divergence),
                    Before::OutOfSyncAtStart if primary_before => {
                        add_divergence(&mut dirty, &divergence)
                    }
                    // Out of sync since an earlier epoch (or restarted since its term): what
                    // the earlier terms wrote while it was away is not known here.
                    Before::OutOfSyncAtStart => dirty = full,
                }
                shared.stats.resyncs_started += 1;
                if dirty.is_full() {
                    shared.stats.resyncs_full += 1;
                }
                if before != Before::Covered {
                    if dirty.is_full() {
                        shared.stats.returns_full += 1;
                    } else {
                        shared.stats.returns_incremental += 1;
                    }
                }
                peer.stream = Some(new_stream(&mut self.next_stream, incarnation));
                peer.last_heard_ms = now_ms;
                peer.last_heartbeat_ms = 0;
                peer.state = PeerState::CatchingUp {
                    job: CopyJob::new(dirty, false),
                    live_from_op: self.next_op,
                };
                self.pump_copies(shared, out);
            }
            // A peer that has a stream and still says Hello is not hearing it; it will time
            // out unless its acknowledgements resume.
            _ => {}
        }
    }

    /// The peer stopped answering, restarted, or failed: it no longer counts as in sync, and
    /// it owes every block its stream had not acknowledged.
    fn abort_peer(&mut self, node: NodeId) {
        let (mut empty, own) = (self.empty_dirty(), self.own_divergence_dirty());
        let Some(peer) = self.peers.get_mut(&node) else { return };
        let stream = peer.stream.take();
        let old = std::mem::replace(&mut peer.state, PeerState::InSync);
        peer.state = match old {
            PeerState::InSync | PeerState::Adding => {
                if let Some(stream) = &stream {
                    stream.unacked_lbas(&mut empty);
                }
                PeerState::Removing(empty)
            }
            PeerState::Probing { .. } => {
                // Its divergence never arrived; its Hello brings it.
                peer.before = Before::InSyncAtStart;
                PeerState::Removing(own)
            }
            PeerState::Pushing(job) => {
                // The job held both divergences; the term has written nothing yet (it serves
                // only once every push is done), so what the peer acknowledged is current.
                let mut dirty = job.into_dirty();
                if let Some(stream) = &stream {
                    stream.unacked_lbas(&mut dirty);
                }
                PeerState::Removing(dirty)
            }
            PeerState::CatchingUp { job, .. } => {
                let mut dirty = job.into_dirty();
                if let Some(stream) = &stream {
                    stream.unacked_lbas(&mut dirty);
                }
                PeerState::OutOfSync(dirty)
            }
            state @ (PeerState::Removing(_) | PeerState::OutOfSync(_)) => state,
        };
    }

    fn empty_dirty(&self) -> DirtySet {
        DirtySet::empty(self.dirty_limit, self.volume_blocks)
    }

    fn full_dirty(&self) -> DirtySet {
        DirtySet::full(self.dirty_limit, self.volume_blocks)
    }

    /// The blocks this node may hold differently from a member that was in sync when the
    /// term started (or was the primary just before): its own divergence then.
    fn own_divergence_dirty(&self) -> DirtySet {
        let mut dirty = self.empty_dirty();
        add_divergence(&mut dirty, &self.own_divergence);
        for &lba in &self.adopted {
            dirty.insert_range(lba..lba + 1);
        }
        dirty
    }

    /// Moves a peer on when its copy job is done.
    fn advance_peer(&mut self, shared: &mut Shared, node: NodeId) {
        let oldest_pending = self.pending.keys().next().copied();
        let pending = &self.pending;
        let Some(peer) = self.peers.get_mut(&node) else { return };
        let Some(stream) = &peer.stream else { return };
        match &peer.state {
            PeerState::Pushing(job) if job.finished(stream) => peer.state = PeerState::InSync,
            PeerState::CatchingUp { job, live_from_op }
                if job.finished(stream)
                    && oldest_pending.is_none_or(|oldest| oldest >= *live_from_op)
                    && stream.unacked.iter().all(|unacked| match unacked.entry.kind {
                        EntryKind::Write { op } => pending.contains_key(&op),
                        EntryKind::Copy { .. } => false,
                    }) =>
            {
                // It holds every copy and every completed write; every pending write went to
                // it live. From now on writes wait for its acks.
                peer.state = PeerState::Adding;
            }
            _ => {}
        }
        self.maybe_finish_reconcile(shared);
    }

    pub fn on_copy_read_done(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        read: CopyRead,
        blocks: Vec<BlockData>,
        out: &mut Vec<Action>,
    ) {
        let CopyRead { id: read, peer: node, stream: stream_id, lba } = read;
        let covers_pending = self
            .pending
            .iter()
            .filter(|(_, write)| write.lbas.contains(&lba))
            .map(|(&op, _)| op)
            .max()
            .unwrap_or(0);
        let Some(peer) = self.peers.get_mut(&node) else { return };
        if peer.stream.as_ref().is_none_or(|stream| stream.id != stream_id) {
            return;
        }
        let Some(job) = peer.job_mut() else { return };
        if job.reads.remove(&read).is_none() {
            return;
        }
        job.blocks_copied += 1;
        let reconcile = job.reconcile;
        if !job.cancelled.remove(&read) {
            // A reconciliation push is uncommitted until the reconciliation commits; a resync
            // copy reflects the pending writes to its block (none: only completed ones).
            let covers_op = if job.reconcile { RECONCILE_OP } else { covers_pending };
            let entry = Entry { kind: EntryKind::Copy { covers_op }, lba, blocks };
            let Some(stream) = peer.stream.as_mut() else { return };
            let seq =
                send_entry(shared, self.epoch, node, stream, self.committed_op, entry, now_ms, out);
            if let Some(job) = peer.job_mut() {
                job.last_copy_seq = seq;
            }
            if reconcile {
                shared.stats.blocks_pushed += 1;
            } else {
                shared.stats.blocks_resynced += 1;
            }
        }
        self.advance_peer(shared, node);
    }

    /// A copy read found this node's block damaged. A resync puts the block back in its dirty
    /// set, where it waits until this node's copy is rewritten (the block joins its damaged
    /// ones, repaired from another in-sync replica, or replaced by a host write); with no
    /// good copy in sync the resync waits, and the volume goes on serving. A reconciliation
    /// puts it back too, and takes the block from a probed member (crate docs, "Read
    /// repair"): its pushes of the block wait until that copy is written here.
    pub fn on_copy_read_damaged(
        &mut self,
        shared: &mut Shared,
        now_ms: u64,
        read: CopyRead,
        out: &mut Vec<Action>,
    ) {
        let CopyRead { id, peer: node, stream: stream_id, lba } = read;
        let Some(peer) = self.peers.get_mut(&node) else { return };
        if peer.stream.as_ref().is_none_or(|stream| stream.id != stream_id) {
            return;
        }
        let Some(job) = peer.job_mut() else { return };
        if job.reads.remove(&id).is_none() {
            return;
        }
        if job.reconcile {
            job.cancelled.remove(&id);
            job.dirty.insert_range(lba..lba + 1);
            if self.phase == Phase::Reconciling && self.reconcile_damaged.insert(lba) {
                shared.stats.reconcile_damaged += 1;
                let _ = shared.note_damaged(lba);
                self.start_reconcile_repairs(shared, now_ms, out);
            }
            return;
        }
        if job.cancelled.remove(&id) {
            // A host write overtook it: the peer gets that write live.
            job.blocks_copied += 1;
            return;
        }
        job.dirty.insert_range(lba..lba + 1);
        let _ = shared.note_damaged(lba);
    }

    /// Whether no probed member could give a block a reconciliation found damaged here: the
    /// node then stops as on an I/O error (another in-sync member may hold a good copy and is
    /// promoted in its place).
    pub fn reconcile_unrecoverable(&self) -> bool {
        self.reconcile_unrecoverable
    }

    /// Starts a read from a probed member of each block a reconciliation found damaged here
    /// that has none under way, nor a copy got, nor a write in flight (within
    /// `INFLIGHT_READS_MAX`; the rest on a later call).
    fn start_reconcile_repairs(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if self.phase != Phase::Reconciling {
            return;
        }
        let asking: BTreeSet<u64> = self
            .repairs
            .values()
            .filter(|repair| repair.reconcile)
            .map(|repair| repair.read.lba)
            .collect();
        let due: Vec<u64> = self
            .reconcile_damaged
            .iter()
            .copied()
            .filter(|lba| !asking.contains(lba) && !self.reconcile_fetched.contains_key(lba))
            .filter(|&lba| !shared.write_in_flight(lba..lba + 1))
            .collect();
        for lba in due {
            if self.reads_in_flight >= INFLIGHT_READS_MAX || self.reconcile_unrecoverable {
                return;
            }
            self.reads_in_flight += 1;
            let read = HostRead { host: None, lba, count: 1 };
            self.start_repair(shared, now_ms, read, false, true, out);
        }
    }

    /// Writes the copies got for blocks a reconciliation found damaged, each once its region
    /// is in the durable write intent and no write to it is in flight: the value may be one
    /// no other member holds yet (a write that never completed), like a host write's. It is
    /// this node's divergence until every member holds it.
    fn write_fetched(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if self.phase != Phase::Reconciling || self.reconcile_fetched.is_empty() {
            return;
        }
        let ready: Vec<u64> = self
            .reconcile_fetched
            .keys()
            .copied()
            .filter(|&lba| !shared.write_in_flight(lba..lba + 1))
            .collect();
        for lba in ready {
            if !shared.intend(lba..lba + 1, now_ms, out) {
                continue;
            }
            let Some(block) = self.reconcile_fetched.remove(&lba) else { continue };
            shared.divergence.record(self.epoch, RECONCILE_OP, lba..lba + 1);
            shared.stats.blocks_repaired += 1;
            let purpose = Purpose::Repair { epoch: self.epoch };
            shared.storage_write(lba, vec![block], purpose, out);
        }
    }

    /// A repair's write of `lbas` is durable here. A block a reconciliation found damaged now
    /// holds a member's copy, which may differ from what other members hold: every member
    /// gets it (in-sync ones are pushed it before the term serves; the others' dirty sets take
    /// it), and its pushes, held back until now, may start.
    pub fn on_repair_written(&mut self, shared: &mut Shared, lbas: Range<u64>) {
        let rewritten: Vec<u64> = self.reconcile_damaged.range(lbas).copied().collect();
        if rewritten.is_empty() || self.phase != Phase::Reconciling {
            return;
        }
        let empty = self.empty_dirty();
        for lba in rewritten {
            self.reconcile_damaged.remove(&lba);
            shared.stats.reconcile_repaired += 1;
            self.adopted.insert(lba);
            for peer in self.peers.values_mut() {
                match &mut peer.state {
                    PeerState::Pushing(job) => job.dirty.insert_range(lba..lba + 1),
                    PeerState::InSync => {
                        let mut dirty = empty.clone();
                        dirty.insert_range(lba..lba + 1);
                        peer.state = PeerState::Pushing(CopyJob::new(dirty, true));
                    }
                    PeerState::Removing(dirty) | PeerState::OutOfSync(dirty) => {
                        dirty.insert_range(lba..lba + 1);
                    }
                    // Their dirty sets come from `own_divergence_dirty`, which holds it.
                    PeerState::Probing { .. } => {}
                    PeerState::CatchingUp { .. } | PeerState::Adding => {
                        unreachable!("no peer catches up while the term reconciles")
                    }
                }
            }
        }
    }

    /// Starts copy reads, at most `copy_blocks_per_tick` per call over all peers. A block
    /// with a local write in flight or not yet issued waits: its read would not show that write.
    /// So does a block a resync would copy that is known damaged here, until it is rewritten.
    fn pump_copies(&mut self, shared: &mut Shared, out: &mut Vec<Action>) {
        let mut budget = self.copy_budget;
        let mut reads = Vec::new();
        {
            let pending = &self.pending;
            let shared: &Shared = shared;
            let busy = |lba: u64| {
                shared.write_in_flight(lba..lba + 1)
                    || pending
                        .values()
                        .any(|write| write.local != Local::Durable && write.lbas.contains(&lba))
            };
            for (&node, peer) in self.peers.iter_mut() {
                let Some(stream) = &peer.stream else { continue };
                let (stream_id, in_window) = (stream.id, stream.unacked.len());
                let copies_in_window = stream.copies_unacked;
                let Some(job) = peer.job_mut() else { continue };
                // A resync waits for a damaged block to be repaired here (by a repair of the
                // serving term, or a host write); a reconciliation for the copy it takes from a
                // probed member (`reconcile_damaged`).
                let reconcile = job.reconcile;
                let reconcile_damaged = &self.reconcile_damaged;
                let blocked = |lba: u64| {
                    busy(lba)
                        || if reconcile {
                            reconcile_damaged.contains(&lba)
                        } else {
                            shared.damaged.contains(&lba)
                        }
                };
                // Copies read or sent and not yet acknowledged stay under COPY_WINDOW_MAX
                // whatever else the stream holds: live writes the peer has not acknowledged
                // yet (under a steady host load, tens of them at any moment) leave the copies
                // their own share of the window (`admits_write` keeps the live ones out of
                // it), or a resync under load would never progress.
                let mut started = 0;
                while budget > 0
                    && copies_in_window + job.reads.len() + started < COPY_WINDOW_MAX
                    && in_window + job.reads.len() + started < STREAM_WINDOW_MAX
                {
                    match job.dirty.take(blocked) {
                        Take::Lba(lba) => {
                            reads.push((node, stream_id, lba));
                            started += 1;
                            budget -= 1;
                        }
                        Take::Blocked | Take::Empty => break,
                    }
                }
            }
        }
        self.copy_budget = budget;
        for (node, stream, lba) in reads {
            let purpose = Purpose::CopyRead { epoch: self.epoch, peer: node, stream, lba };
            let id = shared.storage_read(lba, 1, purpose, out);
            if let Some(job) = self.peers.get_mut(&node).and_then(Peer::job_mut) {
                job.reads.insert(id, lba);
            }
        }
        let nodes: Vec<NodeId> = self.peers.keys().copied().collect();
        for node in nodes {
            self.advance_peer(shared, node);
        }
    }

    pub fn on_lease(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        self.try_complete(shared, now_ms, out);
    }

    /// The store's view changed (and still names this node primary of this epoch).
    pub fn on_view(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if self.phase != Phase::Persisting {
            let Some(view) = &shared.view else { return };
            let volume = &view.value;
            let (limit, blocks) = (shared.config.dirty_lbas_max, shared.config.volume_blocks);
            for &member in volume.members.iter().filter(|&&member| member != shared.me) {
                // A member added by the manager holds nothing of the volume.
                self.peers.entry(member).or_insert_with(|| Peer {
                    state: PeerState::OutOfSync(DirtySet::full(limit, blocks)),
                    before: Before::Covered,
                    stream: None,
                    last_heard_ms: now_ms,
                    last_heartbeat_ms: now_ms,
                });
            }
            // A member replaced by the manager was not in sync; it needs nothing more.
            self.peers
                .retain(|node, _| volume.members.contains(node) || volume.in_sync.contains(node));
        }
        self.drive_membership(shared, now_ms, out);
        self.try_complete(shared, now_ms, out);
        self.maybe_finish_reconcile(shared);
    }

    /// Brings the store's in-sync set in line with the peers: settles what the store shows,
    /// then asks for the next change. One CAS at a time; after a CAS timed out, nothing is
    /// settled until a later CAS is answered (a CAS sent now either fails because the lost one
    /// was applied, or makes sure it never will be).
    fn drive_membership(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if shared.cas_in_flight.is_some() || self.phase == Phase::Persisting {
            return;
        }
        let Some(view) = &shared.view else { return };
        assert_eq!(view.value.epoch, self.epoch, "a term ends when the store's epoch moves");
        let in_sync = &view.value.in_sync;
        let mut removals = Vec::new();
        let mut additions = Vec::new();
        for (&node, peer) in self.peers.iter_mut() {
            let settle = !shared.cas_uncertain;
            match &peer.state {
                PeerState::Removing(_) if settle && !in_sync.contains(&node) => {
                    shared.stats.replicas_removed += 1;
                    let old = std::mem::replace(&mut peer.state, PeerState::InSync);
                    let PeerState::Removing(dirty) = old else { unreachable!("matched above") };
                    peer.state = PeerState::OutOfSync(dirty);
                }
                PeerState::Removing(_) => removals.push(node),
                PeerState::Adding if settle && in_sync.contains(&node) => {
                    peer.state = PeerState::InSync;
                    shared.stats.resyncs_completed += 1;
                }
                PeerState::Adding if view.value.members.contains(&node) => additions.push(node),
                _ => {}
            }
        }
        if removals.is_empty() && additions.is_empty() && !shared.cas_uncertain {
            return;
        }
        let mut new = view.value.clone();
        for node in removals {
            new.in_sync.remove(&node);
        }
        for node in additions {
            new.in_sync.insert(node);
        }
        let request = StoreRequest::Cas {
            expected_version: view.version,
            new,
            require_live: None,
            require_not_live: None,
        };
        let id = shared.store_request(request, out);
        shared.cas_in_flight = Some((id, now_ms));
    }

    pub fn tick(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        if self.phase == Phase::Persisting {
            return;
        }
        let config = &shared.config;
        let (timeout, retransmit, heartbeat) =
            (config.ack_timeout_ms, config.retransmit_ms, config.heartbeat_ms);
        let mut laggards = Vec::new();
        // Whether this node's own storage is stalled too (worked out once, when needed).
        let (pending, own_stall_ended_ms, probe) =
            (&self.pending, self.own_stall_ended_ms, self.probe);
        let mut own_stalled = None;
        let own_ok_issued_ms = self.own_ok_issued_ms;
        let mut want_probe = false;
        for (&node, peer) in self.peers.iter_mut() {
            if let PeerState::Probing { since_ms, last_sent_ms } = &mut peer.state {
                if *since_ms + timeout <= now_ms {
                    laggards.push(node);
                } else if *last_sent_ms + retransmit <= now_ms {
                    *last_sent_ms = now_ms;
                    shared.send(node, Message::Probe { epoch: self.epoch }, out);
                }
                continue;
            }
            let Some(stream) = peer.stream.as_mut() else { continue };
            let oldest_sent_ms = stream.unacked.front().map(|oldest| oldest.first_sent_ms);
            let late = |timeout: u64| oldest_sent_ms.is_some_and(|sent| sent + timeout <= now_ms);
            // A pause that holds this node's own writes too (a disk the nodes share) is not the
            // peer's lag: while it lasts, and for a timeout after, the peer is late only after
            // OWN_STALL_LATE_FACTOR timeouts, so a peer whose storage hangs alone still goes.
            // Nor is the peer late while this node does not know whether its own storage takes
            // writes: that takes a write of its own issued half a timeout or more after the
            // peer's oldest unacknowledged entry, completed (a write issued before a pause
            // began may complete, one issued after it does not); without one, a storage probe
            // is issued once the peer is half late.
            let mut stalled = || {
                *own_stalled.get_or_insert_with(|| {
                    own_stall_ended_ms.is_some_and(|ended| ended + timeout > now_ms)
                        || own_writes_stalled(pending, timeout, now_ms)
                        || probe.is_some_and(|(_, issued)| issued + timeout / 2 <= now_ms)
                })
            };
            let own_ok = oldest_sent_ms.is_some_and(|sent| {
                own_ok_issued_ms.is_some_and(|issued| issued >= sent + timeout / 2)
            });
            if late(timeout / 2) && !own_ok && probe.is_none() && !stalled() {
                want_probe = true;
            }
            let lagging =
                late(timeout) && (late(timeout * OWN_STALL_LATE_FACTOR) || (own_ok && !stalled()));
            let silent = peer.last_heard_ms + timeout <= now_ms;
            if lagging || silent {
                laggards.push(node);
                continue;
            }
            if peer.last_heartbeat_ms + heartbeat <= now_ms {
                peer.last_heartbeat_ms = now_ms;
                let message = Message::Heartbeat {
                    epoch: self.epoch,
                    stream: stream.id,
                    incarnation: stream.incarnation,
                    commit_op: self.committed_op,
                };
                shared.send(node, message, out);
            }
            let resend = stream
                .unacked
                .iter_mut()
                .filter(|unacked| unacked.last_sent_ms + retransmit <= now_ms)
                .take(RETRANSMITS_PER_TICK_MAX);
            for unacked in resend {
                unacked.last_sent_ms = now_ms;
                let message = Message::Append {
                    epoch: self.epoch,
                    stream: stream.id,
                    incarnation: stream.incarnation,
                    seq: unacked.seq,
                    commit_op: self.committed_op,
                    entry: unacked.entry.clone(),
                };
                shared.send(node, message, out);
            }
        }
        if want_probe {
            if let Some(version) = shared.probe_storage(out) {
                self.probe = Some((version, now_ms));
            }
        }
        for node in laggards {
            self.abort_peer(node);
        }
        self.tick_repairs(shared, now_ms, out);
        self.start_reconcile_repairs(shared, now_ms, out);
        self.write_fetched(shared, now_ms, out);
        self.copy_budget = shared.config.copy_blocks_per_tick;
        self.pump_copies(shared, out);
        self.drive_membership(shared, now_ms, out);
        self.try_complete(shared, now_ms, out);
        self.maybe_finish_reconcile(shared);
    }
}

impl Term {
    /// Repairs whose replica has not answered: asked again every retransmit interval, and
    /// given up for the next replica after the ack timeout, or at once if the replica is no
    /// longer in sync with a stream.
    fn tick_repairs(&mut self, shared: &mut Shared, now_ms: u64, out: &mut Vec<Action>) {
        let (timeout, retransmit) = (shared.config.ack_timeout_ms, shared.config.retransmit_ms);
        let mut give_up = Vec::new();
        for (&request, repair) in self.repairs.iter_mut() {
            let peer = self.peers.get(&repair.peer);
            let stream = peer.filter(|peer| can_serve_repair(&peer.state, repair.reconcile));
            let Some(stream) = stream.and_then(|peer| peer.stream.as_ref()) else {
                give_up.push(request);
                continue;
            };
            if repair.asked_ms + timeout <= now_ms {
                give_up.push(request);
            } else if repair.last_sent_ms + retransmit <= now_ms {
                repair.last_sent_ms = now_ms;
                let HostRead { lba, count, .. } = repair.read;
                let incarnation = stream.incarnation;
                let message = Message::Read { epoch: self.epoch, incarnation, request, lba, count };
                shared.send(repair.peer, message, out);
            }
        }
        for request in give_up {
            self.ask_next_peer(shared, now_ms, request, out);
        }
    }
}

/// Whether a local write of this node has been in flight for half of `timeout` or more: its
/// own storage has stopped too, so the peers' missing acknowledgements say little of them.
fn own_writes_stalled(pending: &BTreeMap<u64, PendingWrite>, timeout: u64, now_ms: u64) -> bool {
    pending
        .values()
        .any(|write| write.local == Local::InFlight && write.issued_ms + timeout / 2 <= now_ms)
}

/// Checks a host command of `count` blocks at `lba`, at most `max` blocks.
fn check_range(shared: &Shared, lba: u64, count: u64, max: u32) -> Result<(), HostError> {
    if count == 0 || count > u64::from(max) {
        return Err(HostError::BadLength { count, max });
    }
    let volume_blocks = shared.config.volume_blocks;
    if lba.checked_add(count).is_none_or(|end| end > volume_blocks) {
        return Err(HostError::OutOfRange { lba, count, volume_blocks });
    }
    Ok(())
}

/// What a `Hello` says about the peer process that sent it.
#[derive(Debug)]
struct Hello {
    incarnation: u64,
    last_term_epoch: u64,
    divergence: DivergenceReport,
}

/// Adds the blocks of a divergence report to `dirty`: all of them if it is unknown (or names a
/// block outside the volume, which no correct replica does).
fn add_divergence(dirty: &mut DirtySet, report: &DivergenceReport) {
    let volume_blocks = dirty.volume_blocks();
    match report {
        DivergenceReport::Known(ranges) => {
            for range in ranges {
                if range.end > volume_blocks {
                    dirty.fill();
                    return;
                }
                dirty.insert_range(range.clone());
            }
        }
        DivergenceReport::Unknown => dirty.fill(),
    }
}

fn new_stream(next_stream: &mut u64, incarnation: u64) -> OutStream {
    let id = StreamId(*next_stream);
    *next_stream += 1;
    OutStream {
        id,
        incarnation,
        next_seq: 1,
        acked_seq: 0,
        unacked: VecDeque::new(),
        copies_unacked: 0,
    }
}

#[allow(clippy::too_many_arguments)]
fn send_entry(
    shared: &Shared,
    epoch: u64,
    to: NodeId,
    stream: &mut OutStream,
    commit_op: u64,
    entry: Entry,
    now_ms: u64,
    out: &mut Vec<Action>,
) -> u64 {
    assert!(stream.unacked.len() < STREAM_WINDOW_MAX + COPY_WINDOW_MAX);
    let seq = stream.next_seq;
    stream.next_seq += 1;
    let message = Message::Append {
        epoch,
        stream: stream.id,
        incarnation: stream.incarnation,
        seq,
        commit_op,
        entry: entry.clone(),
    };
    shared.send(to, message, out);
    if matches!(entry.kind, EntryKind::Copy { .. }) {
        stream.copies_unacked += 1;
    }
    stream.unacked.push_back(Unacked { seq, entry, first_sent_ms: now_ms, last_sent_ms: now_ms });
    seq
}

const _: () = assert!(RETRANSMITS_PER_TICK_MAX > 0);
