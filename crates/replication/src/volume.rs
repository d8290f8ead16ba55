//! `VolumeNode`: one node's part in replicating one volume. It is a replica or, for one epoch
//! at a time, the primary; the events it takes and the actions it returns are the whole of its
//! contact with the world (no clock, socket, disk or thread here).
//!
//! This module holds what both roles share (the epoch and its persistence, the node's view of
//! the control store, the local storage requests in flight, the divergence list and the write
//! intent that keeps it across a restart) and the transitions between roles; `replica` and
//! `primary` hold the roles themselves.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use crate::divergence::Divergence;
use crate::intent::{IntentSet, WriteIntent};
use crate::lease::LeaseStatus;
use crate::message::{merge_ranges, Message};
use crate::primary::{CopyRead, HostRead, Term};
use crate::replica::{PeerReadRequest, Replica};
use crate::store::{StoreReply, StoreRequest, Versioned, VolumeState};
use crate::{
    Block, BlockData, Config, HostOpId, LeaseId, NodeId, ResyncProgress, StorageOpId,
    StoreRequestId, StreamId, DAMAGED_BLOCKS_MAX,
};

/// A command from a host, submitted to the node it believes is the primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostOp {
    Read {
        lba: u64,
        count: u32,
    },
    Write {
        lba: u64,
        blocks: Vec<Block>,
    },
    /// Deallocate `count` blocks at `lba` (NVMe Deallocate or Write Zeroes, NBD trim): a write
    /// of `count` unmapped blocks, which read as zeros once it completes. `count` is 1 to
    /// `DEALLOCATE_BLOCKS_PER_OP_MAX`; the caller splits longer ranges.
    Deallocate {
        lba: u64,
        count: u32,
    },
    /// Every completed write is already durable on every in-sync replica, so a flush only
    /// needs a serving primary.
    Flush,
}

/// A successful host command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostReply {
    Written,
    Deallocated,
    Read(Vec<BlockData>),
    Flushed,
}

/// Why a host command failed. `NotPrimary` is a path error: the host retries on the primary the
/// control store names (it may be this node again, once it serves).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    #[error(
        "this node is not serving the volume (not its primary, not yet, or no longer); \
         retry on the primary the control store names"
    )]
    NotPrimary,
    #[error("too many commands in flight on the primary; retry when some complete")]
    Busy,
    #[error("blocks {lba}..{lba}+{count} are outside the volume of {volume_blocks} blocks")]
    OutOfRange { lba: u64, count: u64, volume_blocks: u64 },
    #[error("a command must cover 1 to {max} blocks, not {count}")]
    BadLength { count: u64, max: u32 },
    #[error("block {index} of the write holds {size_bytes} bytes; blocks hold {expected_bytes}")]
    BlockSize { index: usize, size_bytes: usize, expected_bytes: usize },
    /// The read found damaged data here (a failed checksum) and no in-sync replica could give
    /// another copy: an unrecovered read error, for these blocks only.
    #[error(
        "blocks {lba}..{lba}+{count} failed their checksum on this node and no in-sync replica \
         could give another copy"
    )]
    Damaged { lba: u64, count: u32 },
}

/// What local storage did with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StorageResult {
    /// The write is durable.
    Written,
    /// The blocks read, one per block asked for.
    Read(Vec<BlockData>),
    /// An I/O error. The node latches: it serves and acknowledges nothing more until restarted.
    Failed,
    /// A read found blocks whose data failed their checksum: this copy is damaged, the drive
    /// still works. A primary reads them from an in-sync replica instead (crate docs, "Read
    /// repair"); nothing latches. Only reads answer it (for anything else it counts as
    /// `Failed`).
    Damaged,
}

/// Something that happened, for `VolumeNode::handle`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Time passed; call every few milliseconds (a tenth of the shortest interval is plenty).
    Tick,
    Host {
        id: HostOpId,
        op: HostOp,
    },
    Message {
        from: NodeId,
        message: Message,
    },
    Storage {
        id: StorageOpId,
        result: StorageResult,
    },
    /// A `PersistEpoch` action completed: `epoch` is durable in the node's state.
    EpochPersisted {
        epoch: u64,
    },
    /// The `PersistIntent` action of this `version` completed: its intent is durable.
    IntentPersisted {
        version: u64,
    },
    Store {
        id: StoreRequestId,
        reply: StoreReply,
    },
    /// The node's lease changed or was renewed (from `LeaseKeeper`).
    Lease(LeaseStatus),
}

/// Something the wiring must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Send {
        to: NodeId,
        message: Message,
    },
    /// Write `blocks` at `lba`; reply `StorageResult::Written` once durable. The machine never
    /// has two writes to one block in flight, so their order is its own. `None` blocks are
    /// deallocated (they read as zeros). At most `BLOCKS_PER_OP_MAX` blocks, or
    /// `DEALLOCATE_BLOCKS_PER_OP_MAX` when every block is `None`.
    StorageWrite {
        id: StorageOpId,
        lba: u64,
        blocks: Vec<BlockData>,
    },
    /// Read `count` blocks at `lba`: each reads as the last write to it that completed, or as a
    /// write to it still in flight.
    StorageRead {
        id: StorageOpId,
        lba: u64,
        count: u32,
    },
    /// Make `epoch` durable in the node's state (with the storage, it survives a restart) and
    /// reply `Event::EpochPersisted`.
    PersistEpoch {
        epoch: u64,
    },
    /// Make `intent` durable in the node's state, replacing the one before atomically (a crash
    /// leaves the old or the new one, whole), and reply `Event::IntentPersisted { version }`.
    /// Give it back to `VolumeNode::new` at the next start. At most one is in flight; versions
    /// grow by one from 1 in each `VolumeNode`, so a completion goes back only to the one that
    /// asked for it. The file format is `WriteIntent::to_bytes`. Crate docs, "Write intent".
    PersistIntent {
        version: u64,
        intent: WriteIntent,
    },
    Store {
        id: StoreRequestId,
        request: StoreRequest,
    },
    /// Complete a host command. `epoch` is the epoch the node served it under (its current
    /// epoch for errors).
    CompleteHost {
        id: HostOpId,
        epoch: u64,
        result: Result<HostReply, HostError>,
    },
}

/// Counters of what one node process did for the volume, since it started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub terms_started: u64,
    pub terms_ended: u64,
    /// Host writes completed as primary.
    pub writes_completed: u64,
    /// Host deallocates completed as primary.
    pub deallocates_completed: u64,
    /// Blocks those deallocates covered.
    pub blocks_deallocated: u64,
    /// Host writes and deallocates failed with a path error because the term ended under them.
    pub writes_failed: u64,
    /// Replicas this primary removed from the in-sync set.
    pub replicas_removed: u64,
    pub resyncs_started: u64,
    /// Resyncs that copied the whole volume (nothing or too much known about what changed).
    pub resyncs_full: u64,
    /// Resyncs of a member out of sync since the term started (the previous primary, or a
    /// replica the new primary could not probe) that copied only the blocks that may differ:
    /// those written in the term, and those of its divergence and of this node's.
    pub returns_incremental: u64,
    /// Resyncs of such a member that copied the whole volume: it was out of sync since an
    /// earlier epoch, or it restarted (its divergence unknown), or too much changed.
    pub returns_full: u64,
    /// Resynced replicas added back to the in-sync set.
    pub resyncs_completed: u64,
    pub blocks_resynced: u64,
    /// Blocks a new primary pushed to reconcile the in-sync replicas after a failover.
    pub blocks_pushed: u64,
    /// Reconciliations of one replica that had to push the whole volume.
    pub reconciled_full: u64,
    /// Planned moves (`VolumeNode::step_down`) this node began as the primary.
    pub step_downs: u64,
    /// `PersistIntent` actions: write intents persisted (grown for a write, or shrunk, or as a
    /// storage probe).
    pub intent_persists: u64,
    /// Of those, storage probes: a primary that had no evidence whether its own storage takes
    /// writes while a replica was late persisted its intent to learn it.
    pub storage_probes: u64,
    /// Host reads whose blocks were damaged here and were served from a replica's copy.
    pub reads_repaired: u64,
    /// Blocks this node rewrote from a replica's copy after such a read (none when a host
    /// write to them came first), or after a reconciliation met them damaged.
    pub blocks_repaired: u64,
    /// Host reads failed as damaged: no in-sync replica could give another copy.
    pub reads_unrecovered: u64,
    /// Reads this node served, as a replica, to a primary whose copy was damaged.
    pub peer_reads_served: u64,
    /// Blocks the node's scrub reported damaged here (`VolumeNode::note_damaged`).
    pub damaged_noted: u64,
    /// Blocks known damaged here that a write then replaced: a repair from a replica, a copy
    /// from the primary, or a host write.
    pub damaged_rewritten: u64,
    /// Blocks this primary sent to replicas that reported their copies damaged.
    pub blocks_sent_for_repair: u64,
    /// Blocks a reconciliation found damaged here, as a new primary after a failover.
    pub reconcile_damaged: u64,
    /// Of those, blocks taken from a probed member and written here, which every member then
    /// got before the term served.
    pub reconcile_repaired: u64,
    /// Reconciliations that stopped the node because no probed member had a good copy of a
    /// block damaged here.
    pub reconcile_unrecovered: u64,
    /// Stream entries this node refused as a replica: blocks beyond its volume (its size
    /// differs from the primary's) or an invalid length. Never acknowledged, so the primary
    /// finds the replica late and removes it from the in-sync set.
    pub entries_refused: u64,
}

/// Why a local storage request was made; its completion goes back to whoever made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// A replica applying entry `seq` of a stream.
    StreamEntry {
        epoch: u64,
        stream: StreamId,
        seq: u64,
    },
    /// A primary writing host write `op` locally.
    LocalWrite {
        epoch: u64,
        op: u64,
    },
    HostRead {
        epoch: u64,
        host: HostOpId,
        lba: u64,
        count: u32,
    },
    /// A replica reading blocks for the primary `to`, whose copy of them is damaged.
    PeerRead {
        epoch: u64,
        to: NodeId,
        request: u64,
        lba: u64,
        count: u32,
    },
    /// A primary rewriting blocks it found damaged with a replica's copy.
    Repair {
        epoch: u64,
    },
    /// A primary reading blocks to send to a replica whose copy of them is damaged.
    PeerRepairRead {
        epoch: u64,
        count: u32,
    },
    /// A primary reading a block to copy it to `peer` on `stream`.
    CopyRead {
        epoch: u64,
        peer: NodeId,
        stream: StreamId,
        lba: u64,
    },
}

#[derive(Debug)]
struct InFlight {
    purpose: Purpose,
    write: Option<Range<u64>>,
}

/// The state both roles share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: Config,
    pub me: NodeId,
    pub incarnation: u64,
    /// The newest epoch this node has seen; it refuses anything older.
    pub epoch: u64,
    pub persisted_epoch: u64,
    persist_in_flight: bool,
    pub lease: Option<LeaseStatus>,
    pub view: Option<Versioned<VolumeState>>,
    get_in_flight: Option<(StoreRequestId, u64)>,
    last_poll_ms: Option<u64>,
    pub cas_in_flight: Option<(StoreRequestId, u64)>,
    /// A CAS timed out: it may still be applied, so reads of the store do not settle who is
    /// in sync until a later CAS is answered (after which the lost one can never apply).
    pub cas_uncertain: bool,
    next_store_request: u64,
    next_storage_op: u64,
    /// The writes in flight, by first LBA: (end LBA, op). At most one per block, so the
    /// ranges are disjoint and a lookup costs the same for a deallocate of thousands of blocks
    /// as for a write of one.
    writes_in_flight: BTreeMap<u64, (u64, StorageOpId)>,
    storage_ops: BTreeMap<StorageOpId, InFlight>,
    /// Set by a storage error, for the life of the process.
    pub latched: bool,
    /// Reads this node runs for a primary whose copy was damaged (`Purpose::PeerRead`).
    pub peer_reads_in_flight: usize,
    /// Blocks known damaged here (found by the scrub, or by a read for a peer), until a write
    /// replaces them; at most `DAMAGED_BLOCKS_MAX`.
    pub damaged: BTreeSet<u64>,
    /// When the damaged blocks are acted on next (see `DAMAGED_PER_ROUND_MAX`).
    pub damaged_next_ms: u64,
    /// Set by `VolumeNode::step_down` and cleared when the epoch moves past the one it gave up:
    /// meanwhile this node starts no term and resigns whenever the store names it primary.
    stepping_down: bool,
    pub divergence: Divergence,
    /// The regions that may hold uncommitted writes, kept durable for a restart.
    pub intent: IntentSet,
    pub stats: Stats,
    /// The newest epoch this process started a term in; it never starts one twice.
    pub term_started: u64,
}

impl Shared {
    pub fn send(&self, to: NodeId, message: Message, out: &mut Vec<Action>) {
        assert_ne!(to, self.me, "a node never sends to itself");
        out.push(Action::Send { to, message });
    }

    /// Remembers block `lba` as damaged here (see `VolumeNode::note_damaged`); false if it
    /// is outside the volume or `DAMAGED_BLOCKS_MAX` blocks are remembered already.
    pub fn note_damaged(&mut self, lba: u64) -> bool {
        if self.damaged.contains(&lba) {
            return true;
        }
        if lba >= self.config.volume_blocks || self.damaged.len() >= DAMAGED_BLOCKS_MAX {
            return false;
        }
        self.damaged.insert(lba);
        self.stats.damaged_noted += 1;
        true
    }

    pub fn write_in_flight(&self, lbas: Range<u64>) -> bool {
        // The ranges are disjoint, so the one starting last before `lbas.end` ends last too: if
        // it ends at or before `lbas.start`, so does every other one starting earlier.
        self.writes_in_flight
            .range(..lbas.end)
            .next_back()
            .is_some_and(|(_, &(end, _))| end > lbas.start)
    }

    pub fn storage_write(
        &mut self,
        lba: u64,
        blocks: Vec<BlockData>,
        purpose: Purpose,
        out: &mut Vec<Action>,
    ) -> StorageOpId {
        let lbas = lba..lba + blocks.len() as u64;
        assert!(!blocks.is_empty() && lbas.end <= self.config.volume_blocks);
        assert!(!self.write_in_flight(lbas.clone()), "two writes to one block in flight");
        let id = StorageOpId(self.next_storage_op);
        self.next_storage_op += 1;
        self.writes_in_flight.insert(lbas.start, (lbas.end, id));
        self.storage_ops.insert(id, InFlight { purpose, write: Some(lbas) });
        out.push(Action::StorageWrite { id, lba, blocks });
        id
    }

    pub fn storage_read(
        &mut self,
        lba: u64,
        count: u32,
        purpose: Purpose,
        out: &mut Vec<Action>,
    ) -> StorageOpId {
        assert!(count > 0 && lba + u64::from(count) <= self.config.volume_blocks);
        let id = StorageOpId(self.next_storage_op);
        self.next_storage_op += 1;
        self.storage_ops.insert(id, InFlight { purpose, write: None });
        out.push(Action::StorageRead { id, lba, count });
        id
    }

    pub fn store_request(
        &mut self,
        request: StoreRequest,
        out: &mut Vec<Action>,
    ) -> StoreRequestId {
        let id = StoreRequestId(self.next_store_request);
        self.next_store_request += 1;
        out.push(Action::Store { id, request });
        id
    }

    /// Whether `lbas` may be written now with data that may be uncommitted (a host write of
    /// this node's term; a replica's entries go through `intent` directly, to ask for the
    /// entries behind too): every region it touches is in every write intent that may be
    /// durable. If not, the regions go into the next persist, and the caller retries on
    /// `Event::IntentPersisted`.
    pub fn intend(&mut self, lbas: Range<u64>, now_ms: u64, out: &mut Vec<Action>) -> bool {
        self.intent.want(lbas.clone(), now_ms);
        self.flush_intent(out);
        self.intent.covered(lbas)
    }

    /// Persists the write intent if a write waits for it and no persist is in flight.
    pub fn flush_intent(&mut self, out: &mut Vec<Action>) {
        self.intent.flush(self.divergence.is_lost(), &mut self.stats, out);
    }

    /// Persists the write intent as it stands (a storage probe: a small durable write of this
    /// node's own) unless a persist is in flight; returns the version asked for.
    pub fn probe_storage(&mut self, out: &mut Vec<Action>) -> Option<u64> {
        let version = self.intent.probe(self.divergence.is_lost(), &mut self.stats, out)?;
        self.stats.storage_probes += 1;
        Some(version)
    }

    fn persist_epoch_if_needed(&mut self, out: &mut Vec<Action>) {
        if !self.persist_in_flight && self.persisted_epoch < self.epoch {
            self.persist_in_flight = true;
            out.push(Action::PersistEpoch { epoch: self.epoch });
        }
    }

    /// The lease this node may rely on now, if any.
    pub fn valid_lease(&self, now_ms: u64) -> Option<LeaseId> {
        self.lease.filter(|lease| lease.valid(now_ms)).map(|lease| lease.lease)
    }
}

#[derive(Debug)]
enum Role {
    Replica(Replica),
    Primary(Box<Term>),
}

/// One node's replication state machine for one volume.
#[derive(Debug)]
pub struct VolumeNode {
    shared: Shared,
    role: Role,
}

impl VolumeNode {
    /// A node process starting: `persisted_epoch` is what `PersistEpoch` last made durable (0 on
    /// a new node), `persisted_intent` what `PersistIntent` last made durable (`None` if
    /// nothing, or if it cannot be read: then, unless `persisted_epoch` is 0, this node's
    /// divergence is unknown and a return needs a full copy), and `incarnation` differs from
    /// every earlier start of this node.
    pub fn new(
        config: Config,
        me: NodeId,
        incarnation: u64,
        persisted_epoch: u64,
        persisted_intent: Option<WriteIntent>,
    ) -> Self {
        assert!(config.validate().is_ok(), "the wiring validates the configuration first");
        let limit = config.divergence_ranges_max;
        // The persisted ranges, within the volume and canonical whatever the file said.
        let persisted_intent = persisted_intent.map(|intent| WriteIntent {
            term_epoch: intent.term_epoch,
            lbas: intent.lbas.map(|ranges| {
                let volume_blocks = config.volume_blocks;
                let clipped = ranges
                    .into_iter()
                    .map(|range| range.start.min(volume_blocks)..range.end.min(volume_blocks))
                    .collect();
                merge_ranges(clipped)
            }),
        });
        let divergence = match &persisted_intent {
            // A node that never saw an epoch never applied anything.
            _ if persisted_epoch == 0 => Divergence::known_empty(limit),
            Some(WriteIntent { lbas: Some(ranges), .. }) => {
                Divergence::after_restart_known(limit, persisted_epoch, ranges)
            }
            Some(WriteIntent { lbas: None, .. }) | None => {
                Divergence::after_restart(limit, persisted_epoch)
            }
        };
        let intent = IntentSet::new(&config, persisted_intent.as_ref());
        // A node serves an epoch once, even across restarts, and a return after a restart can
        // still say which epoch it was primary of.
        let term_started = persisted_intent.as_ref().map_or(0, |intent| intent.term_epoch);
        let shared = Shared {
            config,
            me,
            incarnation,
            epoch: persisted_epoch,
            persisted_epoch,
            persist_in_flight: false,
            lease: None,
            view: None,
            get_in_flight: None,
            last_poll_ms: None,
            cas_in_flight: None,
            cas_uncertain: false,
            next_store_request: 1,
            next_storage_op: 1,
            writes_in_flight: BTreeMap::new(),
            peer_reads_in_flight: 0,
            damaged: BTreeSet::new(),
            damaged_next_ms: 0,
            storage_ops: BTreeMap::new(),
            latched: false,
            stepping_down: false,
            divergence,
            intent,
            stats: Stats::default(),
            term_started,
        };
        Self { shared, role: Role::Replica(Replica::new()) }
    }

    pub fn id(&self) -> NodeId {
        self.shared.me
    }

    /// The newest epoch this node has seen.
    pub fn epoch(&self) -> u64 {
        self.shared.epoch
    }

    /// The epoch this node serves host I/O under right now, if it does.
    pub fn serving_epoch(&self, now_ms: u64) -> Option<u64> {
        match &self.role {
            Role::Primary(term) if term.serving(&self.shared, now_ms) => Some(term.epoch),
            _ => None,
        }
    }

    /// While this node serves host I/O, until when it may (the lease it serves under expires
    /// then, in `now_ms`'s clock); `None` while it does not. Only an event can end a term
    /// sooner, so a caller that reads the answer again after every event may serve reads of
    /// local storage on its own, without the state machine, before that time.
    pub fn serving_until(&self, now_ms: u64) -> Option<u64> {
        self.serving_epoch(now_ms)?;
        let lease = self.shared.lease.as_ref()?;
        Some(lease.valid_until_ms)
    }

    /// Whether the newest view of the store this node has names another node primary, in an
    /// epoch at least as new as this node's: the volume moved away (a failover, or a step-down),
    /// and this node serves it again only if a later epoch names it.
    pub fn primary_elsewhere(&self) -> bool {
        let shared = &self.shared;
        shared.view.as_ref().is_some_and(|view| {
            view.value.epoch >= shared.epoch
                && view.value.primary.is_some_and(|primary| primary != shared.me)
        })
    }

    /// Whether this node holds the primary role (in any phase of its term, serving or not).
    pub fn is_primary(&self) -> bool {
        matches!(self.role, Role::Primary(_))
    }

    /// Whether storage failed in this process.
    pub fn latched(&self) -> bool {
        self.shared.latched
    }

    /// Gives up the primary role for a planned move: a node that stops cleanly (SIGTERM, a
    /// rolling restart) or an operator moving the volume away from this node. Hosts then wait
    /// about two store polls for the next primary instead of a lease.
    ///
    /// If this node is the primary (in any phase of its term), or the store names it primary
    /// of its current epoch with a lease, it stops serving at once (pending host writes and
    /// reads fail with `HostError::NotPrimary`, never complete) and then resigns: a CAS under
    /// its view setting `primary_lease` to `LeaseId::NONE`, sent again from every newer view
    /// while the store still names it primary with a lease. The manager promotes another
    /// in-sync member with a live lease at once.
    ///
    /// The step-down lasts until this node sees a newer epoch ([`Self::stepping_down`] says
    /// whether it still does): until then it starts no term, even if the store names it; from
    /// then on it behaves as any node, so the volume may later move back. It cannot be
    /// cancelled earlier: the term it ended never restarts (a node serves an epoch once), so
    /// only a promotion moves the volume on. If no other in-sync member has a live lease, the
    /// manager gives the role back to this node in a new epoch, which ends the step-down: a
    /// volume never moves to a replica that may lack completed writes.
    ///
    /// On a node that is not primary this does nothing: such a node is promoted only if the
    /// primary fails, and one that stops loses its lease, so the manager does not pick it.
    /// Calling it again while stepping down does nothing more.
    pub fn step_down(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let shared = &self.shared;
        let named = shared.view.as_ref().is_some_and(|view| {
            view.value.epoch == shared.epoch
                && view.value.primary == Some(shared.me)
                && view.value.primary_lease != LeaseId::NONE
        });
        let primary = matches!(self.role, Role::Primary(_));
        if !primary && !named {
            return;
        }
        if !self.shared.stepping_down {
            self.shared.stepping_down = true;
            self.shared.stats.step_downs += 1;
        }
        self.end_term(now_ms, out);
        self.resign_if_needed(now_ms, out);
    }

    /// Whether a `step_down` is still in force: this node gave up the primary role of its
    /// epoch and has not yet seen a newer one. The wiring of a clean stop waits for this to
    /// turn false (the store named the next primary) before the process exits.
    pub fn stepping_down(&self) -> bool {
        self.shared.stepping_down
    }

    /// Whether a host write given now would start at once rather than end the resync of a
    /// replica that acknowledges more slowly than hosts write (see the crate docs, "Resync"):
    /// the wiring holds host writes back while this is false, and offers them again as the
    /// replica's acknowledgements come in. Always true on a replica and on a primary with no
    /// replica being resynced.
    pub fn admits_write(&self) -> bool {
        match &self.role {
            Role::Primary(term) => term.admits_write(),
            Role::Replica(_) => true,
        }
    }

    /// While this node serves the volume and no host write it took is still pending: the epoch
    /// it serves and the replicas whose copies hold exactly what its own holds (each
    /// acknowledged every completed write, none has an entry in flight). The wiring takes a
    /// snapshot of a replicated volume by holding host writes back until this answers, then
    /// snapshotting this node's copy and those replicas' (crate docs, "Snapshots").
    pub fn quiet_copies(&self, now_ms: u64) -> Option<(u64, Vec<NodeId>)> {
        let epoch = self.serving_epoch(now_ms)?;
        let Role::Primary(term) = &self.role else { return None };
        Some((epoch, term.quiet_copies()?))
    }

    /// The copies this node is making as primary, one per replica being resynced, rebuilt or
    /// reconciled (for `ferrite volume show`); empty on a replica or when nothing is copied.
    pub fn resync_progress(&self) -> Vec<ResyncProgress> {
        match &self.role {
            Role::Primary(term) => term.resync_progress(),
            Role::Replica(_) => Vec::new(),
        }
    }

    /// Storage found block `lba`'s data damaged here outside the reads this machine asked for
    /// (the node's scrub). It is remembered until a write replaces it: a serving primary reads
    /// it from an in-sync replica and rewrites it, a replica asks its primary to send its copy
    /// (crate docs, "Read repair"), each at the next tick and again every
    /// `hello_interval_ms` until then.
    /// Returns whether the block is remembered (false past `DAMAGED_BLOCKS_MAX`, or outside
    /// the volume).
    pub fn note_damaged(&mut self, lba: u64) -> bool {
        let shared = &mut self.shared;
        let known = shared.damaged.contains(&lba);
        let kept = shared.note_damaged(lba);
        if kept && !known {
            shared.damaged_next_ms = 0;
        }
        kept
    }

    /// Whether block `lba` is known damaged here and not yet replaced by a write.
    pub fn is_damaged(&self, lba: u64) -> bool {
        self.shared.damaged.contains(&lba)
    }

    /// Blocks in the volume as this node knows it: where it takes commands and entries up to.
    pub fn volume_blocks(&self) -> u64 {
        self.shared.config.volume_blocks
    }

    /// The volume grew to `volume_blocks` blocks (never fewer than it has: volumes only grow);
    /// its storage already holds them. From now on this node takes host commands, stream
    /// entries and reads up to the new end.
    ///
    /// Each node grows on its own, when it learns the new size from the volume's record, so
    /// a primary may grow before a replica: a replica refuses an entry beyond its size as it
    /// refuses any entry outside the volume, acknowledges nothing from it on, and the
    /// primary sends it again until the replica has grown too (or, after `ack_timeout_ms`,
    /// removes it from the in-sync set). A write beyond the old size therefore completes only
    /// once every in-sync replica holds the new size, so a promoted replica never lacks it.
    pub fn grow(&mut self, volume_blocks: u64) {
        let shared = &mut self.shared;
        assert!(volume_blocks >= shared.config.volume_blocks, "volumes only grow");
        if volume_blocks == shared.config.volume_blocks {
            return;
        }
        shared.config.volume_blocks = volume_blocks;
        shared.intent.grow(volume_blocks);
        if let Role::Primary(term) = &mut self.role {
            term.grow(volume_blocks);
        }
    }

    /// What this process has done so far (for metrics and tests).
    pub fn stats(&self) -> &Stats {
        &self.shared.stats
    }

    /// Takes one event; appends what to do to `out`.
    pub fn handle(&mut self, now_ms: u64, event: Event, out: &mut Vec<Action>) {
        match event {
            Event::Tick => self.on_tick(now_ms, out),
            Event::Host { id, op } => match &mut self.role {
                Role::Primary(term) => term.on_host(&mut self.shared, now_ms, id, op, out),
                Role::Replica(_) => out.push(Action::CompleteHost {
                    id,
                    epoch: self.shared.epoch,
                    result: Err(HostError::NotPrimary),
                }),
            },
            Event::Message { from, message } => self.on_message(now_ms, from, message, out),
            Event::Storage { id, result } => self.on_storage(now_ms, id, result, out),
            Event::EpochPersisted { epoch } => {
                self.shared.persist_in_flight = false;
                self.shared.persisted_epoch = self.shared.persisted_epoch.max(epoch);
                self.shared.persist_epoch_if_needed(out);
                match &mut self.role {
                    Role::Replica(replica) => replica.on_persisted(&mut self.shared, now_ms, out),
                    Role::Primary(term) => term.on_persisted(&mut self.shared, now_ms, out),
                }
            }
            Event::IntentPersisted { version } => {
                if self.shared.intent.on_persisted(version) {
                    self.shared.flush_intent(out);
                    // Writes waiting for their regions may go.
                    match &mut self.role {
                        Role::Replica(replica) => replica.pump(&mut self.shared, now_ms, out),
                        Role::Primary(term) => {
                            term.on_intent_persisted(&self.shared, version, now_ms);
                            term.on_storage_idle(&mut self.shared, now_ms, out);
                        }
                    }
                }
            }
            Event::Store { id, reply } => self.on_store(now_ms, id, reply, out),
            Event::Lease(status) => {
                self.shared.lease = Some(status);
                if let Role::Primary(term) = &mut self.role {
                    if term.lease != status.lease {
                        self.end_term(now_ms, out);
                    } else {
                        term.on_lease(&mut self.shared, now_ms, out);
                    }
                }
                self.maybe_start_term(now_ms, out);
            }
        }
        // A reconciliation that no member could give a damaged block stops the node, as an
        // I/O error would (crate docs, "Read repair").
        if let Role::Primary(term) = &self.role {
            if term.reconcile_unrecoverable() {
                self.latch(now_ms, out);
            }
        }
    }

    fn on_tick(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let shared = &mut self.shared;
        if shared
            .get_in_flight
            .is_some_and(|(_, sent)| sent + shared.config.store_timeout_ms <= now_ms)
        {
            shared.get_in_flight = None;
        }
        if let Some((_, sent)) = shared.cas_in_flight {
            if sent + shared.config.store_timeout_ms <= now_ms {
                // The outcome is unknown: re-read the state before deciding anything else.
                shared.cas_in_flight = None;
                shared.cas_uncertain = true;
                shared.last_poll_ms = None;
            }
        }
        if shared.get_in_flight.is_none()
            && shared.last_poll_ms.is_none_or(|last| last + shared.config.store_poll_ms <= now_ms)
        {
            let id = shared.store_request(StoreRequest::Get, out);
            shared.get_in_flight = Some((id, now_ms));
            shared.last_poll_ms = Some(now_ms);
        }
        match &mut self.role {
            Role::Replica(replica) => replica.tick(&mut self.shared, now_ms, out),
            Role::Primary(term) => term.tick(&mut self.shared, now_ms, out),
        }
        let shared = &mut self.shared;
        if !shared.damaged.is_empty() && shared.damaged_next_ms <= now_ms && !shared.latched {
            shared.damaged_next_ms = now_ms + shared.config.hello_interval_ms;
            match &mut self.role {
                Role::Replica(replica) => replica.report_damaged(shared, out),
                Role::Primary(term) => term.repair_damaged(shared, now_ms, out),
            }
        }
        self.shrink_intent(now_ms, out);
        self.resign_if_needed(now_ms, out);
    }

    /// Drops from the write intent, at most once per `intent_linger_ms`, the regions no
    /// unresolved divergence mark, pending host write or storage write in flight touches.
    fn shrink_intent(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let shared = &mut self.shared;
        if !shared.intent.shrink_due(now_ms) {
            return;
        }
        let mut needed: Vec<Range<u64>> = shared.divergence.ranges().collect();
        needed.extend(shared.writes_in_flight.iter().map(|(&start, &(end, _))| start..end));
        if let Role::Primary(term) = &self.role {
            needed.extend(term.pending_lbas());
        }
        let lost = shared.divergence.is_lost();
        shared.intent.shrink(now_ms, needed.into_iter(), lost, &mut shared.stats, out);
    }

    fn on_message(&mut self, now_ms: u64, from: NodeId, message: Message, out: &mut Vec<Action>) {
        if from == self.shared.me {
            return;
        }
        let epoch = message.epoch();
        if epoch > self.shared.epoch {
            self.raise_epoch(epoch, now_ms, out);
        }
        let shared = &mut self.shared;
        match (&mut self.role, message) {
            (_, Message::Stale { .. }) => {}
            (
                Role::Replica(replica),
                Message::Append { epoch, stream, incarnation, seq, commit_op, entry },
            ) => replica.on_stream(
                shared,
                now_ms,
                from,
                epoch,
                stream,
                incarnation,
                commit_op,
                Some((seq, entry)),
                out,
            ),
            (
                Role::Replica(replica),
                Message::Heartbeat { epoch, stream, incarnation, commit_op },
            ) => replica.on_stream(
                shared,
                now_ms,
                from,
                epoch,
                stream,
                incarnation,
                commit_op,
                None,
                out,
            ),
            (Role::Replica(replica), Message::Probe { epoch }) => {
                replica.on_probe(shared, from, epoch, out)
            }
            (Role::Replica(replica), Message::Read { epoch, incarnation, request, lba, count }) => {
                let read = PeerReadRequest { epoch, incarnation, request, lba, count };
                replica.on_read(shared, from, read, out)
            }
            // Only the primary of an epoch sends these, and this node is the primary of a newer
            // one.
            (Role::Primary(term), Message::Append { epoch, .. })
            | (Role::Primary(term), Message::Heartbeat { epoch, .. })
            | (Role::Primary(term), Message::Probe { epoch })
                if epoch < term.epoch =>
            {
                shared.send(from, Message::Stale { epoch: shared.epoch }, out);
            }
            (Role::Primary(_), Message::Append { .. })
            | (Role::Primary(_), Message::Heartbeat { .. })
            | (Role::Primary(_), Message::Probe { .. }) => {}
            (Role::Primary(term), message) if message.epoch() == term.epoch => {
                term.on_peer_message(shared, now_ms, from, message, out)
            }
            (_, Message::Hello { epoch, .. }) | (_, Message::Read { epoch, .. })
                if epoch < shared.epoch =>
            {
                shared.send(from, Message::Stale { epoch: shared.epoch }, out);
            }
            // Replies to a term this node no longer holds.
            _ => {}
        }
    }

    fn on_storage(
        &mut self,
        now_ms: u64,
        id: StorageOpId,
        result: StorageResult,
        out: &mut Vec<Action>,
    ) {
        let Some(in_flight) = self.shared.storage_ops.remove(&id) else {
            return;
        };
        if let Some(lbas) = &in_flight.write {
            let removed = self.shared.writes_in_flight.remove(&lbas.start);
            assert_eq!(
                removed,
                Some((lbas.end, id)),
                "the write in flight to these blocks is the one completing"
            );
        }
        let result = match (&in_flight.purpose, result) {
            (Purpose::HostRead { count, .. }, StorageResult::Read(blocks))
            | (Purpose::PeerRead { count, .. }, StorageResult::Read(blocks))
            | (Purpose::PeerRepairRead { count, .. }, StorageResult::Read(blocks))
                if blocks.len() != *count as usize =>
            {
                StorageResult::Failed
            }
            // Damaged data is an answer to the reads that can go elsewhere or say so (a copy
            // read decides below); a write cannot meet it, and stops as on an I/O error.
            (
                Purpose::HostRead { .. }
                | Purpose::PeerRead { .. }
                | Purpose::PeerRepairRead { .. }
                | Purpose::CopyRead { .. },
                StorageResult::Damaged,
            ) => StorageResult::Damaged,
            (_, StorageResult::Damaged) => StorageResult::Failed,
            (Purpose::CopyRead { .. }, StorageResult::Read(blocks)) if blocks.len() != 1 => {
                StorageResult::Failed
            }
            (_, result) => result,
        };
        if result == StorageResult::Failed {
            self.latch(now_ms, out);
        }
        if let (Some(lbas), StorageResult::Written) = (&in_flight.write, &result) {
            let rewritten: Vec<u64> = self.shared.damaged.range(lbas.clone()).copied().collect();
            for lba in rewritten {
                self.shared.damaged.remove(&lba);
                self.shared.stats.damaged_rewritten += 1;
            }
        }
        match (&mut self.role, in_flight.purpose) {
            (Role::Replica(replica), Purpose::StreamEntry { epoch, stream, seq })
                if result == StorageResult::Written =>
            {
                replica.on_entry_durable(&mut self.shared, epoch, stream, seq, out);
            }
            (Role::Primary(term), Purpose::LocalWrite { epoch, op })
                if epoch == term.epoch && result == StorageResult::Written =>
            {
                term.on_local_write_done(&mut self.shared, now_ms, op, out);
            }
            (Role::Primary(term), Purpose::HostRead { epoch, host, lba, count })
                if epoch == term.epoch =>
            {
                let read = HostRead { host: Some(host), lba, count };
                term.on_host_read_done(&mut self.shared, now_ms, read, result, out);
            }
            (_, Purpose::HostRead { host, .. }) => out.push(Action::CompleteHost {
                id: host,
                epoch: self.shared.epoch,
                result: Err(HostError::NotPrimary),
            }),
            (_, Purpose::PeerRead { epoch, to, request, lba, count }) => {
                // Answered whatever this node became meanwhile: the primary checks the epoch.
                assert!(self.shared.peer_reads_in_flight > 0);
                self.shared.peer_reads_in_flight -= 1;
                let blocks = match result {
                    StorageResult::Read(blocks) => {
                        self.shared.stats.peer_reads_served += 1;
                        Some(blocks)
                    }
                    StorageResult::Damaged => {
                        // Damaged here too: repaired like blocks the scrub finds (the primary,
                        // once its own copy is whole again, sends them).
                        for lba in lba..lba + u64::from(count) {
                            let _ = self.note_damaged(lba);
                        }
                        None
                    }
                    _ => None,
                };
                self.shared.send(to, Message::ReadReply { epoch, request, blocks }, out);
            }
            (Role::Primary(term), Purpose::PeerRepairRead { epoch, .. }) if epoch == term.epoch => {
                term.on_peer_repair_read(&mut self.shared, now_ms, id, result, out);
            }
            (Role::Primary(term), Purpose::CopyRead { epoch, peer, stream, lba })
                if epoch == term.epoch =>
            {
                let read = CopyRead { id, peer, stream, lba };
                match result {
                    StorageResult::Read(blocks) => {
                        term.on_copy_read_done(&mut self.shared, now_ms, read, blocks, out);
                    }
                    StorageResult::Damaged => {
                        term.on_copy_read_damaged(&mut self.shared, now_ms, read, out);
                    }
                    _ => {}
                }
            }
            (Role::Primary(term), Purpose::Repair { epoch })
                if epoch == term.epoch && result == StorageResult::Written =>
            {
                if let Some(lbas) = &in_flight.write {
                    term.on_repair_written(&mut self.shared, lbas.clone());
                }
            }
            _ => {}
        }
        // A completed write may unblock entries or local writes waiting for its blocks.
        match &mut self.role {
            Role::Replica(replica) => replica.pump(&mut self.shared, now_ms, out),
            Role::Primary(term) => term.on_storage_idle(&mut self.shared, now_ms, out),
        }
    }

    fn on_store(
        &mut self,
        now_ms: u64,
        id: StoreRequestId,
        reply: StoreReply,
        out: &mut Vec<Action>,
    ) {
        let shared = &mut self.shared;
        let from_get = shared.get_in_flight.is_some_and(|(expected, _)| expected == id);
        let from_cas = shared.cas_in_flight.is_some_and(|(expected, _)| expected == id);
        if from_get {
            shared.get_in_flight = None;
        }
        if from_cas {
            shared.cas_in_flight = None;
            shared.cas_uncertain = false;
        }
        if !from_get && !from_cas {
            return;
        }
        let state = match reply {
            StoreReply::Volume(state)
            | StoreReply::CasDone(state)
            | StoreReply::CasFailed { current: state, .. } => state,
            StoreReply::Snapshot { volume, .. } => volume,
            StoreReply::Lease { .. } => return,
        };
        if shared.view.as_ref().is_none_or(|view| view.version < state.version) {
            shared.view = Some(state);
        }
        self.after_view_change(now_ms, out);
    }

    fn after_view_change(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let Some(view) = &self.shared.view else {
            return;
        };
        let view_epoch = view.value.epoch;
        if view_epoch > self.shared.epoch {
            self.raise_epoch(view_epoch, now_ms, out);
        }
        let Some(view) = &self.shared.view else {
            return;
        };
        if let Role::Primary(term) = &mut self.role {
            let still_mine = view.value.epoch == term.epoch
                && view.value.primary == Some(self.shared.me)
                && view.value.primary_lease == term.lease;
            if still_mine {
                term.on_view(&mut self.shared, now_ms, out);
            } else {
                self.end_term(now_ms, out);
            }
        }
        self.maybe_start_term(now_ms, out);
        self.resign_if_needed(now_ms, out);
    }

    fn raise_epoch(&mut self, epoch: u64, now_ms: u64, out: &mut Vec<Action>) {
        if epoch <= self.shared.epoch {
            return;
        }
        self.shared.epoch = epoch;
        self.shared.persist_epoch_if_needed(out);
        // A newer epoch was created by a promotion after the one given up: the move is done
        // (or, if this node is the new primary, no other member could take the role).
        self.shared.stepping_down = false;
        match &mut self.role {
            Role::Primary(term) => {
                assert!(term.epoch < epoch);
                self.end_term(now_ms, out);
            }
            Role::Replica(replica) => replica.on_epoch_raised(epoch),
        }
    }

    /// Leaves the primary role (deposed, lease lost, or storage failed): pending host writes
    /// fail with a path error, never complete.
    fn end_term(&mut self, _now_ms: u64, out: &mut Vec<Action>) {
        let role = std::mem::replace(&mut self.role, Role::Replica(Replica::new()));
        if let Role::Primary(term) = role {
            term.end(&mut self.shared, out);
        }
    }

    fn maybe_start_term(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let Role::Replica(_) = self.role else {
            return;
        };
        let shared = &self.shared;
        let Some(view) = &shared.view else {
            return;
        };
        let state = &view.value;
        let promoted = state.primary == Some(shared.me)
            && shared.valid_lease(now_ms) == Some(state.primary_lease)
            && state.primary_lease != LeaseId::NONE
            && state.epoch == shared.epoch
            && state.epoch > shared.term_started
            && state.in_sync.contains(&shared.me)
            && state.in_sync.is_subset(&state.members)
            && !shared.latched
            && !shared.stepping_down;
        if promoted {
            let term = Term::start(&mut self.shared, now_ms, out);
            self.role = Role::Primary(Box::new(term));
        }
    }

    fn latch(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        if self.shared.latched {
            return;
        }
        self.shared.latched = true;
        match &mut self.role {
            Role::Primary(_) => self.end_term(now_ms, out),
            Role::Replica(replica) => replica.on_latched(&mut self.shared, out),
        }
        self.resign_if_needed(now_ms, out);
    }

    /// A node that the store names primary but that must not serve (its storage failed, or it
    /// is stepping down) gives the role up at once, so the manager promotes another without
    /// waiting for the lease to expire. Called again on every view and tick, so a CAS that
    /// failed (the version moved) or was lost is sent again from the newer view, until the
    /// store shows no lease or another epoch.
    fn resign_if_needed(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let shared = &mut self.shared;
        if !(shared.latched || shared.stepping_down) || shared.cas_in_flight.is_some() {
            return;
        }
        // The resignation lets the manager promote another node before this node's lease
        // ends, which is safe only because this node serves nothing any more.
        assert!(matches!(self.role, Role::Replica(_)), "a node resigns only once its term ended");
        let Some(view) = &shared.view else {
            return;
        };
        if view.value.primary != Some(shared.me) || view.value.primary_lease == LeaseId::NONE {
            return;
        }
        let mut new = view.value.clone();
        new.primary_lease = LeaseId::NONE;
        let request = StoreRequest::Cas {
            expected_version: view.version,
            new,
            require_live: None,
            require_not_live: None,
        };
        let id = shared.store_request(request, out);
        shared.cas_in_flight = Some((id, now_ms));
    }
}

#[cfg(test)]
// A list of one LBA range is what these tests mean, not a range collected into a list.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn append(epoch: u64, seq: u64, commit_op: u64, op: u64, lba: u64) -> Event {
        let entry = crate::Entry { kind: crate::EntryKind::Write { op }, lba, blocks: vec![None] };
        let message =
            Message::Append { epoch, stream: StreamId(1), incarnation: 2, seq, commit_op, entry };
        Event::Message { from: NodeId(0), message }
    }

    /// A restarted node takes its divergence and its last term from the persisted write
    /// intent: a probe gets the persisted ranges, and a `Hello` names the term.
    #[test]
    fn a_restart_reports_the_persisted_intent_as_its_divergence() {
        use crate::message::DivergenceReport;
        use crate::store::Versioned;
        let config = Config { volume_blocks: 64, ..Config::default() };
        let intent = WriteIntent { term_epoch: 4, lbas: Some(vec![8..12, 60..100]) };
        let mut node = VolumeNode::new(config, NodeId(1), 2, 5, Some(intent));
        let expected = DivergenceReport::Known(vec![8..12, 60..64]);
        let mut out = Vec::new();
        let probe = Message::Probe { epoch: 6 };
        node.handle(0, Event::Message { from: NodeId(0), message: probe }, &mut out);
        assert_eq!(out, vec![Action::PersistEpoch { epoch: 6 }]);
        out.clear();
        node.handle(0, Event::EpochPersisted { epoch: 6 }, &mut out);
        let reply = Message::ProbeReply {
            epoch: 6,
            incarnation: 2,
            volume_blocks: 64,
            divergence: expected.clone(),
        };
        assert_eq!(out, vec![Action::Send { to: NodeId(0), message: reply }]);
        // Node 0 serves epoch 6; node 1 is out of sync and asks to be taken back.
        out.clear();
        node.handle(1, Event::Tick, &mut out);
        let Some(&Action::Store { id, .. }) =
            out.iter().find(|action| matches!(action, Action::Store { .. }))
        else {
            panic!("a tick reads the store: {out:?}");
        };
        let value = VolumeState {
            epoch: 6,
            primary: Some(NodeId(0)),
            primary_lease: LeaseId(9),
            in_sync: [NodeId(0)].into(),
            members: [NodeId(0), NodeId(1)].into(),
        };
        let reply = StoreReply::Volume(Versioned { version: 3, value });
        node.handle(2, Event::Store { id, reply }, &mut out);
        out.clear();
        node.handle(3, Event::Tick, &mut out);
        let hello = Message::Hello {
            epoch: 6,
            incarnation: 2,
            last_term_epoch: 4,
            volume_blocks: 64,
            divergence: expected,
        };
        assert!(out.contains(&Action::Send { to: NodeId(0), message: hello }), "{out:?}");
    }

    /// A replica applies an entry beyond the commit point only once its region is in the
    /// durable write intent; a committed one goes at once.
    #[test]
    fn an_uncommitted_entry_waits_for_the_intent() {
        let config = Config { volume_blocks: 64, intent_region_blocks: 4, ..Config::default() };
        let intent = WriteIntent { term_epoch: 0, lbas: Some(vec![]) };
        let mut node = VolumeNode::new(config, NodeId(1), 2, 1, Some(intent));
        let mut out = Vec::new();
        node.handle(0, append(1, 1, 3, 3, 9), &mut out);
        assert!(
            matches!(out.as_slice(), [Action::StorageWrite { lba: 9, .. }]),
            "committed (op 3, commit point 3): written at once: {out:?}"
        );
        out.clear();
        node.handle(0, append(1, 2, 3, 4, 13), &mut out);
        let [Action::PersistIntent { version, intent }] = out.as_slice() else {
            panic!("the intent first: {out:?}");
        };
        assert_eq!(intent.lbas, Some(vec![12..16]));
        let version = *version;
        out.clear();
        node.handle(0, append(1, 3, 3, 5, 14), &mut out);
        assert_eq!(out, vec![], "behind the entry that waits");
        node.handle(1, Event::IntentPersisted { version }, &mut out);
        let written: Vec<u64> = out
            .iter()
            .filter_map(|action| match action {
                Action::StorageWrite { lba, .. } => Some(*lba),
                _ => None,
            })
            .collect();
        assert_eq!(written, vec![13, 14], "both, in order, once the region is durable");
    }

    /// An entry whose blocks lie beyond this replica's copy of the volume (the primary's size
    /// differs) is refused and counted, never written nor acknowledged (the stream waits at it,
    /// and the primary finds the replica late); a valid entry in its place is written.
    #[test]
    fn an_entry_beyond_the_volume_is_refused_and_counted() {
        let config = Config { volume_blocks: 64, ..Config::default() };
        let mut node = VolumeNode::new(config, NodeId(1), 2, 1, None);
        let mut out = Vec::new();
        node.handle(0, append(1, 1, 1, 1, 64), &mut out);
        assert!(
            !out.iter().any(|action| matches!(action, Action::StorageWrite { .. })),
            "nothing written: {out:?}"
        );
        assert_eq!(node.stats().entries_refused, 1);
        node.handle(0, append(1, 1, 1, 1, 100), &mut out);
        assert_eq!(node.stats().entries_refused, 2, "each time it comes");
        out.clear();
        node.handle(0, append(1, 1, 1, 1, 63), &mut out);
        assert!(
            matches!(out.as_slice(), [Action::StorageWrite { lba: 63, .. }]),
            "the last block is in range: {out:?}"
        );
        assert_eq!(node.stats().entries_refused, 2);
    }

    /// The writes in flight, kept as disjoint ranges, answer overlap queries exactly like a
    /// block-by-block model, for writes and deallocates of every length.
    #[test]
    fn writes_in_flight_find_every_overlap() {
        let volume_blocks = 256;
        let config = Config { volume_blocks, ..Config::default() };
        let mut node = VolumeNode::new(config, NodeId(1), 1, 0, None);
        let mut rng = StdRng::seed_from_u64(9);
        let mut model: BTreeMap<u64, StorageOpId> = BTreeMap::new();
        let mut out = Vec::new();
        for _ in 0..5_000 {
            let lba = rng.random_range(0..volume_blocks);
            let count = rng.random_range(1..=(volume_blocks - lba).min(40));
            let lbas = lba..lba + count;
            let busy = lbas.clone().any(|block| model.contains_key(&block));
            assert_eq!(node.shared.write_in_flight(lbas.clone()), busy, "{lbas:?}");
            if !busy && rng.random_bool(0.6) {
                let purpose = Purpose::LocalWrite { epoch: 1, op: 1 };
                let id =
                    node.shared.storage_write(lba, vec![None; count as usize], purpose, &mut out);
                model.extend(lbas.map(|block| (block, id)));
            } else if let Some(&id) = model.values().nth(rng.random_range(0..model.len().max(1))) {
                node.handle(0, Event::Storage { id, result: StorageResult::Written }, &mut out);
                model.retain(|_, other| *other != id);
            }
        }
    }
}
