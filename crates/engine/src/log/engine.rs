//! Hot path. The shared engine state and the per-thread handle: group commit of batches into
//! the open segment, the read path with checksum verification, and the install of a durable
//! batch into the index.
//!
//! Concurrency: one [`LogEngine`] per node, shared (`Arc`) by one [`LogHandle`] per data-path
//! thread. The index and the segment counters are atomics (lookups are loads, host installs are
//! swaps, GC installs are compare-and-swaps); locks are taken only when a segment is allocated
//! or freed, when a volume is first met, and by checkpoints. Each handle appends to its own open
//! segments (one for host writes, one for GC), so threads never contend on a write position.
//!
//! Group commit, per handle: writers copy their blocks into the batch being formed (a queue of
//! at most [`BATCHES_QUEUED_MAX`] batches). One writer at a time is the leader: it takes the
//! oldest batch, writes its header and data to every drive the batch spans, syncs those drives,
//! installs the batch in the index and completes it; the writers that joined meanwhile form the
//! next batch, so one sync covers many writes. Batches of a handle complete in order.
//!
//! Pipelined commits (a log without parity): a batch that fits the open segment is written with
//! O_DSYNC and the leader role passes on as soon as its positions and LSN are taken, so up to
//! [`COMMITS_IN_FLIGHT_MAX`] batches of a handle are in flight at once. Each is installed only
//! when it and every earlier one are durable, in LSN order (`LogHandle::advance`); if one fails,
//! the later ones of its segment fail with it, since recovery stops at the first torn batch of a
//! segment. Anything else the leader does (a segment switch, a checkpoint, GC, a coded log's
//! group) first waits until none is in flight. Beside batches in flight, a batch goes once it
//! is as large as the newest of them (`LogHandle::worth_sending`): the writer whose block makes
//! it so wakes the waiting leader, so it goes beside them rather than after them. A leader lets
//! the thread's other ready tasks run once before taking a small batch
//! ([`BATCH_GATHER_BELOW_BLOCKS`]), so writers woken together share it.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use types::AlignedBuf;

use super::format::DataSlots;
use super::format::{
    BatchHeader, Entry, EntryKind, Geometry, BATCH_ENTRIES_MAX, BLOCK_BYTES,
    CHECKPOINT_ENTRIES_PER_BLOCK_MIN, ROOT_SEGMENTS_MAX,
};
use super::index::{
    entry_units, is_block, pack, packed_tag, raw_tag, unpack, Index, LayerError, Tag, VolumeIndex,
    LAYER_LABEL_BASE, UNITS_PER_POSITION,
};
use super::pool::BufferPool;
use super::segments::{SegmentState, SegmentTable};
use super::{LogConfig, LogError};
use crate::compress::{
    cells_log2_for, compress_block, unpack as unpack_slot, CompressScratch, Compression,
    PackBuilder,
};
use crate::drive::{Drive, DriveError, DriveOperation};
use crate::erasure::{Encoder, ErasureScheme};
use crate::join::join_all;
pub(super) use crate::join::LocalFuture;
use crate::latches::DriveLatches;
use crate::local_sync::LocalNotify;
use crate::store::{StoreError, VolumeStore};
use crate::volumes::VolumeMap;

const BLOCK_BYTES_U64: u64 = BLOCK_BYTES as u64;
/// Batches a handle holds queued behind the one being committed; writers wait beyond it.
pub const BATCHES_QUEUED_MAX: usize = 8;
/// The most queued batches one leader writes before a single sync covers them all.
pub const GROUP_BATCHES_MAX: usize = 4;
/// Host batches a handle of a log without parity has written (O_DSYNC) and not yet installed:
/// the next batch's write starts while the previous one's flush runs. A drive takes a few
/// durable writes at once about as fast as one (fio, 160 KiB O_DSYNC writes, 2 jobs: 2,363/s
/// at depth 1, 4,499 at 2, 6,974 at 4), so one commit at a time left most of it idle. Eight,
/// not four: 128 KiB O_DSYNC writes still gain from depth 4 to 8 here (11,982/s to 14,370/s),
/// and the engine's 4K random writes at QD 128 gained 8% (median of 12 alternating rounds).
pub const COMMITS_IN_FLIGHT_MAX: usize = 8;
/// A batch of fewer data blocks than this, with batches of its handle in flight, waits for the
/// thread's other ready tasks once before it is written, so writers woken together share it.
/// Why 16: the flush that follows each durable write cost about as much as 80 KiB of data here
/// (fio, 128 KiB sequential writes at depth 1: 142 us with O_DSYNC, 102 us without), so below
/// 64 KiB a batch is mostly fixed cost; larger batches go at once (the engine's 4K random writes
/// at QD 128 form batches of about 36 blocks, and lost about 9% when every batch waited:
/// medians of six alternating rounds, 194K against 214K).
pub const BATCH_GATHER_BELOW_BLOCKS: usize = 16;
/// Times a read re-reads a block whose checksum failed because GC moved it meanwhile.
pub const READ_RETRIES_MAX: u32 = 4;
/// The most blocks one drive read of a multi-block host read covers.
pub const READ_RUN_BLOCKS_MAX: usize = 64;
/// The most drive reads one multi-block host read has in flight at once.
pub const READ_RUNS_IN_FLIGHT_MAX: usize = 64;
/// Volumes a handle keeps in its cache before starting the cache over.
pub const VOLUME_CACHE_MAX: usize = 4096;
/// The share of the usable data space offered to hosts; the rest keeps GC efficient. At 90%,
/// 4 KiB random overwrite of a volume of 80% of the capacity measured a write amplification of
/// 2.16; at 85%, 1.92 (scripts/bench-wa.sh; the goal is at most 2.0).
pub const CAPACITY_PERCENT: u64 = 85;
/// Segments beyond the open ones and the checkpoint's that GC keeps for itself.
pub const GC_SLACK_SEGMENTS: u32 = 2;

/// Which of a handle's two append streams a batch goes to. GC writes to its own so relocated
/// (cold) blocks do not mix with fresh (hot) ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stream {
    Host = 0,
    Gc = 1,
}

/// What a handle publishes for checkpoints on other threads.
#[derive(Debug)]
pub(super) struct HandleSlot {
    /// A lower bound of the LSN of this handle's batch in flight, or `u64::MAX`.
    pub lsn_floor: AtomicU64,
    /// Per stream, the sequence number of the open segment, or `u64::MAX` if none. Changed
    /// only under `switch`, which a checkpoint also takes to read it (once per segment, never
    /// per I/O).
    pub open_seqs: [AtomicU64; 2],
    pub switch: Mutex<()>,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub host_bytes_written: AtomicU64,
    /// Bytes hosts asked to read (`LogHandle::read_blocks`), errors and unmapped blocks
    /// included: the background work's measure of how busy hosts keep the node.
    pub host_bytes_read: AtomicU64,
    pub device_bytes_written: AtomicU64,
    pub gc_relocated_blocks: AtomicU64,
    pub gc_segments_cleaned: AtomicU64,
    /// Of those, segments a host write cleaned itself, finding no free segment beyond the
    /// reserve (its thread's writes wait meanwhile: background GC fell behind).
    pub gc_segments_cleaned_inline: AtomicU64,
    /// Blocks read-triggered defragmentation rewrote back to back (`defrag`).
    pub defrag_relocated_blocks: AtomicU64,
    /// Segments laid out (`lay_out`), and the zeros written over holes to do it.
    pub segments_laid_out: AtomicU64,
    pub laid_out_bytes: AtomicU64,
    pub checkpoints: AtomicU64,
    /// Checkpoint blocks written (entries and layer records; in device bytes too).
    pub checkpoint_blocks: AtomicU64,
    pub checksum_errors: AtomicU64,
    pub mapped_blocks: AtomicU64,
    /// Live-space units of the mapped blocks (16 per raw block, fewer when compressed).
    pub mapped_units: AtomicU64,
    /// Blocks admitted for writes in flight that were unmapped when admitted.
    pub admitted_blocks: AtomicU64,
    /// Host batches made durable, and the host blocks they carried (group-commit width).
    pub host_batches: AtomicU64,
    pub host_batch_blocks: AtomicU64,
    /// Drive syncs issued (by host batches, GC and checkpoints): fdatasyncs, and writes made
    /// durable on their own (O_DSYNC), one per drive write.
    pub drive_syncs: AtomicU64,
    /// Background scrub (`scrub`): live blocks verified, damage found (blocks and header chains,
    /// counted each pass that finds them; not in `checksum_errors`), passes completed, and the
    /// most recent findings (at most `scrub::SCRUB_FINDINGS_MAX`).
    pub scrub_blocks_verified: AtomicU64,
    pub scrub_errors: AtomicU64,
    pub scrub_passes: AtomicU64,
    pub scrub_findings: Mutex<VecDeque<super::scrub::ScrubFinding>>,
    /// Coded logs: reads that found a drive unreadable on the fast path, reads served by
    /// reconstruction from parity, and reads that lost more cells than the parity covers.
    pub degraded_reads: AtomicU64,
    pub reconstructed_reads: AtomicU64,
    pub unrecoverable_reads: AtomicU64,
    /// Reads whose block failed its checksum and was served rebuilt from parity.
    pub repaired_reads: AtomicU64,
    /// Coded writes in flight that skipped a failed drive (a rebuild waits for them).
    pub skipping_writes: AtomicU64,
}

/// The durable checkpoint: its id and the segments holding it.
#[derive(Debug, Clone, Default)]
pub(super) struct CheckpointRecord {
    pub id: u64,
    pub segments: Vec<u32>,
}

/// Node-wide space and traffic figures.
#[derive(Debug, Clone, PartialEq)]
pub struct LogStats {
    /// What hosts may map in total (thin: volumes may provision more).
    pub capacity_bytes: u64,
    pub mapped_bytes: u64,
    /// Drive space the mapped blocks take: less than `mapped_bytes` when compressed.
    pub mapped_physical_bytes: u64,
    /// `mapped_bytes / mapped_physical_bytes` (1.0 with nothing mapped or nothing compressed).
    pub data_reduction: f64,
    /// Space of segments in use (live data, garbage not yet collected, checkpoints).
    pub physical_used_bytes: u64,
    /// Space of free segments.
    pub physical_free_bytes: u64,
    /// What hosts may still map: capacity minus mapped.
    pub free_bytes: u64,
    pub segments_total: u32,
    pub segments_free: u32,
    pub host_bytes_written: u64,
    pub device_bytes_written: u64,
    /// Device bytes written per host byte written (0 before any host write).
    pub write_amplification: f64,
    pub gc_relocated_blocks: u64,
    pub gc_segments_cleaned: u64,
    /// Of those, segments host writes cleaned themselves for space, their thread's writes
    /// waiting meanwhile (background GC fell behind).
    pub gc_segments_cleaned_inline: u64,
    /// Blocks rewritten back to back by read-triggered defragmentation.
    pub defrag_relocated_blocks: u64,
    /// Free segments laid out ahead of the log (`LogHandle::lay_out_step`), and the zeros
    /// written over drive-file holes to do it (not host data: not in the write amplification).
    pub segments_laid_out: u64,
    pub laid_out_bytes: u64,
    pub checkpoints: u64,
    /// Bytes of checkpoint blocks written (part of `device_bytes_written`).
    pub checkpoint_bytes_written: u64,
    pub checksum_errors: u64,
    pub index_ram_bytes: u64,
    pub failed_drives: Vec<u16>,
    /// Host batches made durable and the blocks they carried: their ratio is how many writes
    /// one group commit covers.
    pub host_batches: u64,
    pub host_batch_blocks: u64,
    pub drive_syncs: u64,
    /// Background scrub: live blocks verified, damage found (counted each pass that finds it;
    /// see [`LogEngine::scrub_findings`]) and full passes completed.
    pub scrub_blocks_verified: u64,
    pub scrub_errors: u64,
    pub scrub_passes: u64,
    /// The erasure coding the log is formatted with (`1+0` without parity).
    pub erasure: ErasureScheme,
    /// A drive being rebuilt, if any.
    pub rebuilding_drive: Option<u16>,
    /// Coded logs: reads served by rebuilding cells from parity (a drive failed, unreadable or
    /// being rebuilt), reads whose block failed its CRC and was served rebuilt, and reads that
    /// lost more cells than the parity covers (errors).
    pub reconstructed_reads: u64,
    pub repaired_reads: u64,
    pub unrecoverable_reads: u64,
}

/// One volume's space figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VolumeStats {
    pub provisioned_bytes: u64,
    pub mapped_bytes: u64,
    /// Bytes its mapped blocks occupy on the drives (less than mapped when compressed).
    pub physical_used_bytes: u64,
    /// `mapped_bytes / physical_used_bytes` (1.0 with nothing mapped).
    pub data_reduction: f64,
}

/// Logical bytes per physical byte, 1.0 when there is nothing.
fn reduction(logical_bytes: u64, physical_bytes: u64) -> f64 {
    if physical_bytes == 0 {
        1.0
    } else {
        logical_bytes as f64 / physical_bytes as f64
    }
}

/// The engine state every data-path thread shares.
pub struct LogEngine {
    pub(super) geometry: Geometry,
    pub(super) config: LogConfig,
    pub(super) index: Index,
    pub(super) segments: SegmentTable,
    pub(super) latches: Arc<DriveLatches>,
    pub(super) lsn_next: AtomicU64,
    pub(super) segment_seq_next: AtomicU64,
    pub(super) slots: Mutex<Vec<Arc<HandleSlot>>>,
    pub(super) checkpoint: Mutex<CheckpointRecord>,
    /// The durable checkpoint's segment sequence floor: only segments opened before it may be
    /// cleaned (later ones are replayed by recovery and must stay intact).
    pub(super) gc_seq_floor: AtomicU64,
    /// Segments (by sequence) the durable checkpoint lists as open: replayed, so not cleaned.
    pub(super) gc_excluded_seqs: Mutex<Vec<u64>>,
    pub(super) checkpoint_busy: AtomicBool,
    pub(super) sealed_since_checkpoint: AtomicU32,
    /// Free segments host writes never take.
    pub(super) reserve_segments: u32,
    pub(super) checkpoint_segments_max: u32,
    pub(super) batch_data_max: usize,
    pub(super) capacity_blocks: u64,
    pub(super) counters: Counters,
    /// Host batches and index generation when a sweep last found nothing to drop.
    pub(super) sweep_mark: AtomicU64,
    /// Per drive, how many times it was replaced: a handle reopens its handle of a drive whose
    /// generation moved.
    drive_generations: Box<[AtomicU64]>,
    /// The drive rebuild in progress (coded logs), if any.
    pub(super) rebuild: Mutex<Option<super::rebuild::RebuildState>>,
    /// Whether scattered multi-block reads queue a rewrite (`defrag`); off until set.
    pub(super) read_defrag: AtomicBool,
}

impl std::fmt::Debug for LogEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogEngine").field("geometry", &self.geometry).finish()
    }
}

impl LogEngine {
    /// An engine with every segment free and nothing mapped (recovery fills it in).
    pub(super) fn new(
        geometry: Geometry,
        config: LogConfig,
        latches: Arc<DriveLatches>,
    ) -> Result<Self, LogError> {
        assert!(config.handles_max > 0);
        let positions = u64::from(geometry.positions_per_segment());
        let batch_data_max = BATCH_ENTRIES_MAX.min(positions as usize - 1);
        let checkpoint_blocks =
            geometry.location_count().div_ceil(CHECKPOINT_ENTRIES_PER_BLOCK_MIN as u64);
        let checkpoint_segments_max = checkpoint_blocks.div_ceil(positions) + 1;
        let reserve = 2 * u64::from(config.handles_max)
            + checkpoint_segments_max
            + u64::from(GC_SLACK_SEGMENTS);
        // The old checkpoint's segments stay in use while the next one is written.
        let overhead = reserve + checkpoint_segments_max;
        let segment_count = u64::from(geometry.segment_count);
        if checkpoint_segments_max > ROOT_SEGMENTS_MAX as u64 || overhead + 2 > segment_count {
            return Err(LogError::CheckpointInvalid {
                checkpoint_id: 0,
                reason: "the drives are too small for this many handles (or the segments too \
                         small for one checkpoint root): use larger drives, larger segments or \
                         fewer handles",
            });
        }
        let data_per_segment = positions - positions.div_ceil(batch_data_max as u64 + 1);
        let capacity_blocks =
            (segment_count - overhead) * data_per_segment * CAPACITY_PERCENT / 100;
        Ok(Self {
            geometry,
            config,
            index: Index::default(),
            segments: SegmentTable::new(geometry.segment_count, geometry.positions_per_segment()),
            latches,
            lsn_next: AtomicU64::new(1),
            segment_seq_next: AtomicU64::new(1),
            slots: Mutex::new(Vec::new()),
            checkpoint: Mutex::new(CheckpointRecord::default()),
            gc_seq_floor: AtomicU64::new(0),
            gc_excluded_seqs: Mutex::new(Vec::new()),
            checkpoint_busy: AtomicBool::new(false),
            sealed_since_checkpoint: AtomicU32::new(0),
            reserve_segments: reserve as u32,
            checkpoint_segments_max: checkpoint_segments_max as u32,
            batch_data_max,
            capacity_blocks,
            counters: Counters::default(),
            sweep_mark: AtomicU64::new(u64::MAX),
            drive_generations: (0..geometry.drive_count).map(|_| AtomicU64::new(0)).collect(),
            rebuild: Mutex::new(None),
            read_defrag: AtomicBool::new(false),
        })
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Turns read-triggered defragmentation on or off for every handle: a multi-block read of
    /// blocks scattered over the log queues a rewrite of them back to back, which each handle's
    /// [`LogHandle::defragmenter`] carries out (see the `defrag` module).
    pub fn set_read_defrag(&self, on: bool) {
        self.read_defrag.store(on, Ordering::Relaxed);
    }

    pub fn latches(&self) -> &Arc<DriveLatches> {
        &self.latches
    }

    /// Counts a segment laid out with `bytes` of zeros (`lay_out`).
    pub(super) fn note_laid_out(&self, bytes: u64) {
        self.counters.segments_laid_out.fetch_add(1, Ordering::Relaxed);
        self.counters.laid_out_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// How many times drive `index` was replaced in this process.
    pub fn drive_generation(&self, index: u16) -> u64 {
        self.drive_generations[usize::from(index)].load(Ordering::Acquire)
    }

    /// Records that drive `index` was replaced: every handle reopens its handle of it before
    /// its next I/O there.
    pub(super) fn bump_drive_generation(&self, index: u16) -> u64 {
        self.drive_generations[usize::from(index)].fetch_add(1, Ordering::AcqRel) + 1
    }

    /// A handle for one data-path thread, over that thread's handles of the drives (index =
    /// drive index). At most `handles_max` handles exist over the engine's life.
    pub fn handle<D: Drive>(self: &Arc<Self>, drives: Vec<D>) -> LogHandle<D> {
        assert_eq!(drives.len(), usize::from(self.geometry.drive_count), "one handle per drive");
        let slot = Arc::new(HandleSlot {
            lsn_floor: AtomicU64::new(u64::MAX),
            open_seqs: [AtomicU64::new(u64::MAX), AtomicU64::new(u64::MAX)],
            switch: Mutex::new(()),
        });
        {
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            assert!(
                slots.len() < usize::from(self.config.handles_max),
                "more than handles_max ({}) handles",
                self.config.handles_max
            );
            slots.push(Arc::clone(&slot));
        }
        let drives = drives
            .into_iter()
            .map(|drive| DriveSlot {
                drive: RefCell::new(Rc::new(drive)),
                generation: Cell::new(0),
            })
            .collect();
        LogHandle {
            engine: Arc::clone(self),
            drives,
            reopen: RefCell::new(None),
            slot,
            volumes: RefCell::new(HashMap::new()),
            queue: RefCell::new(VecDeque::new()),
            in_flight: RefCell::new(VecDeque::with_capacity(COMMITS_IN_FLIGHT_MAX)),
            in_flight_failure: Cell::new(None),
            admission: Admission::default(),
            leader: Cell::new(false),
            changed: LocalNotify::new(),
            leader_awaits_batch: Cell::new(false),
            batch_grown: LocalNotify::new(),
            streams: [RefCell::new(StreamState::default()), RefCell::new(StreamState::default())],
            buffers: BufferPool::new((self.batch_data_max + 1) * BLOCK_BYTES),
            header_blocks: BufferPool::new(BLOCK_BYTES),
            compress: RefCell::new(CompressScratch::new()),
            erasure: RefCell::new(Encoder::new()),
            defrag: RefCell::new(VecDeque::new()),
            defrag_queued_blocks: Cell::new(0),
            defrag_ready: LocalNotify::new(),
        }
    }

    /// Bytes hosts have read and written through this engine since it opened (writes counted
    /// once durable): two relaxed loads, cheap enough for a pacing decision every tick.
    pub fn host_io_bytes(&self) -> u64 {
        let counters = &self.counters;
        counters.host_bytes_read.load(Ordering::Relaxed)
            + counters.host_bytes_written.load(Ordering::Relaxed)
    }

    /// Node-wide space and traffic figures.
    pub fn stats(&self) -> LogStats {
        let counters = &self.counters;
        let segments_free = self.segments.free_count();
        let segment_bytes = self.geometry.segment_bytes();
        let mapped_blocks = counters.mapped_blocks.load(Ordering::Relaxed);
        let host = counters.host_bytes_written.load(Ordering::Relaxed);
        let device = counters.device_bytes_written.load(Ordering::Relaxed);
        let mapped_units = counters.mapped_units.load(Ordering::Relaxed);
        let mapped_physical_bytes = mapped_units * BLOCK_BYTES_U64 / u64::from(UNITS_PER_POSITION);
        LogStats {
            capacity_bytes: self.capacity_blocks * BLOCK_BYTES_U64,
            mapped_bytes: mapped_blocks * BLOCK_BYTES_U64,
            mapped_physical_bytes,
            data_reduction: reduction(mapped_blocks * BLOCK_BYTES_U64, mapped_physical_bytes),
            physical_used_bytes: u64::from(self.geometry.segment_count - segments_free)
                * segment_bytes,
            physical_free_bytes: u64::from(segments_free) * segment_bytes,
            free_bytes: self.capacity_blocks.saturating_sub(self.physical_blocks())
                * BLOCK_BYTES_U64,
            segments_total: self.geometry.segment_count,
            segments_free,
            host_bytes_written: host,
            device_bytes_written: device,
            write_amplification: if host == 0 { 0.0 } else { device as f64 / host as f64 },
            gc_relocated_blocks: counters.gc_relocated_blocks.load(Ordering::Relaxed),
            defrag_relocated_blocks: counters.defrag_relocated_blocks.load(Ordering::Relaxed),
            segments_laid_out: counters.segments_laid_out.load(Ordering::Relaxed),
            laid_out_bytes: counters.laid_out_bytes.load(Ordering::Relaxed),
            gc_segments_cleaned: counters.gc_segments_cleaned.load(Ordering::Relaxed),
            gc_segments_cleaned_inline: counters.gc_segments_cleaned_inline.load(Ordering::Relaxed),
            checkpoints: counters.checkpoints.load(Ordering::Relaxed),
            checkpoint_bytes_written: counters.checkpoint_blocks.load(Ordering::Relaxed)
                * BLOCK_BYTES as u64,
            checksum_errors: counters.checksum_errors.load(Ordering::Relaxed),
            index_ram_bytes: self.index.allocated_bytes(),
            failed_drives: self.latches.failed_drives(),
            host_batches: counters.host_batches.load(Ordering::Relaxed),
            host_batch_blocks: counters.host_batch_blocks.load(Ordering::Relaxed),
            drive_syncs: counters.drive_syncs.load(Ordering::Relaxed),
            scrub_blocks_verified: counters.scrub_blocks_verified.load(Ordering::Relaxed),
            scrub_errors: counters.scrub_errors.load(Ordering::Relaxed),
            scrub_passes: counters.scrub_passes.load(Ordering::Relaxed),
            erasure: self.geometry.scheme(),
            rebuilding_drive: self.latches.rebuilding_drive(),
            reconstructed_reads: counters.reconstructed_reads.load(Ordering::Relaxed),
            repaired_reads: counters.repaired_reads.load(Ordering::Relaxed),
            unrecoverable_reads: counters.unrecoverable_reads.load(Ordering::Relaxed),
        }
    }

    /// One volume's space figures; `provisioned_bytes` is the size the caller's map holds.
    /// `mapped_bytes` counts the blocks written since its newest snapshot (or creation): its
    /// own layer's, not those it reads from snapshots.
    pub fn volume_stats(&self, volume: &VolumeMap) -> VolumeStats {
        let layer = self.index.resolve(volume.volume().0, false);
        let mapped_bytes = layer.as_ref().map_or(0, |v| v.mapped_blocks()) * BLOCK_BYTES_U64;
        let physical_used_bytes = layer.as_ref().map_or(0, |v| v.mapped_units()) * BLOCK_BYTES_U64
            / u64::from(UNITS_PER_POSITION);
        VolumeStats {
            provisioned_bytes: volume.size_bytes(),
            mapped_bytes,
            physical_used_bytes,
            data_reduction: reduction(mapped_bytes, physical_used_bytes),
        }
    }

    /// The ids of the volumes and snapshots the index holds (mapped blocks or not).
    pub fn volume_ids(&self) -> Vec<u64> {
        self.index.bound_ids()
    }

    /// Bytes that deleting snapshot `snapshot` would free: blocks of its layer that every layer
    /// on it has overwritten or trimmed.
    pub fn snapshot_exclusive_bytes(&self, snapshot: u64) -> u64 {
        self.index.exclusive_blocks(snapshot) * BLOCK_BYTES_U64
    }

    /// The blocks at or after `from` that may read differently in volume `volume` than in
    /// snapshot `snapshot`, ascending, about `limit` at most, and where to continue (`None`:
    /// no more): those written or trimmed in either since they parted. Rewriting each with the
    /// snapshot's contents makes the volume read as the snapshot (a rollback by copying, as a
    /// replicated volume takes one).
    pub fn blocks_differing(
        &self,
        volume: u64,
        snapshot: u64,
        from: u64,
        limit: usize,
    ) -> Result<(Vec<u64>, Option<u64>), LayerError> {
        self.index.blocks_differing(volume, snapshot, from, limit)
    }

    /// The entry a read of `block` of volume or snapshot `id` sees (0 if none); for tests and
    /// tools.
    pub fn lookup(&self, id: u64, block: u64) -> u64 {
        self.index.resolve(id, false).map_or(0, |layer| layer.lookup(block))
    }

    /// The blocks hosts may map in total.
    pub fn capacity_blocks(&self) -> u64 {
        self.capacity_blocks
    }

    /// Positions the mapped blocks take (fewer than mapped blocks when compressed).
    pub fn physical_blocks(&self) -> u64 {
        self.counters.mapped_units.load(Ordering::Acquire).div_ceil(u64::from(UNITS_PER_POSITION))
    }

    pub(super) fn segment_of(&self, location: u32) -> u32 {
        self.geometry.split(location).0
    }

    /// Admits a write that maps `new_blocks` blocks that are unmapped now.
    fn admit(&self, new_blocks: u64) -> Result<(), LogError> {
        if new_blocks == 0 {
            return Ok(());
        }
        let admitted = self.counters.admitted_blocks.fetch_add(new_blocks, Ordering::AcqRel);
        // Physical blocks: compression lets more logical blocks fit.
        let mapped = self.physical_blocks();
        if mapped + admitted + new_blocks > self.capacity_blocks {
            self.counters.admitted_blocks.fetch_sub(new_blocks, Ordering::AcqRel);
            return Err(LogError::CapacityExceeded {
                mapped_blocks: mapped,
                capacity_blocks: self.capacity_blocks,
                needed_blocks: new_blocks,
            });
        }
        Ok(())
    }

    /// Applies a durable batch to the index and the live counts. Runs without awaiting, so it
    /// is never abandoned half way.
    pub(super) fn install(&self, header: &BatchHeader) -> u64 {
        self.apply(header, true)
    }

    /// Applies a batch to the index; with `account`, also to the live counts and the mapped
    /// counter (recovery recomputes those from the index once every batch is applied).
    pub(super) fn apply(&self, header: &BatchHeader, account: bool) -> u64 {
        let mut slots = DataSlots::default();
        let mut mapped_added: i64 = 0;
        let mut units_added: i64 = 0;
        let mut relocated = 0;
        let mut volume: Option<Arc<VolumeIndex>> = None;
        for entry in &header.entries {
            if volume.as_ref().is_none_or(|v| v.volume() != entry.volume || v.is_removed()) {
                // Entries name layers; a merged layer's label leads to the layer that took its
                // blocks, and a freed engine layer is never brought back.
                volume = match entry.kind {
                    EntryKind::Data { .. } | EntryKind::Packed { .. }
                        if entry.volume < LAYER_LABEL_BASE =>
                    {
                        match self.index.resolve_label(entry.volume) {
                            Some(layer) => Some(layer),
                            None => Some(self.index.get_or_create(entry.volume)),
                        }
                    }
                    _ => self.index.resolve_label(entry.volume),
                };
            }
            let data_slot = slots.next(&entry.kind);
            let location = data_slot
                .map(|slot| self.geometry.location(header.segment, header.position + 1 + slot));
            let mut dead = |old: u64| {
                if let Some((old_location, _)) = unpack(old) {
                    let units = entry_units(old);
                    if account {
                        self.segments.remove_live(self.segment_of(old_location), units);
                    }
                    mapped_added -= 1;
                    units_added -= i64::from(units);
                }
            };
            // Host writes install with a swap; GC moves with a compare-and-swap against the
            // entry it copied, so a newer write wins.
            let (new, expected) = match entry.kind {
                EntryKind::Data { crc } => (raw_tag(crc), None),
                EntryKind::Packed { crc, cells_log2, sub, .. } => {
                    (packed_tag(cells_log2, sub, crc), None)
                }
                EntryKind::Relocated { crc, from } => {
                    (raw_tag(crc), Some(pack(from, raw_tag(crc))))
                }
                EntryKind::RelocatedPacked { crc, from, from_sub, cells_log2, sub, .. } => (
                    packed_tag(cells_log2, sub, crc),
                    Some(pack(from, packed_tag(cells_log2, from_sub, crc))),
                ),
                _ => (0, None),
            };
            match entry.kind {
                EntryKind::Data { .. } | EntryKind::Packed { .. } => {
                    let (Some(location), Some(index)) = (location, &volume) else { continue };
                    let new = pack(location, new);
                    let old = index.swap(entry.block, new);
                    let units = entry_units(new);
                    if account {
                        self.segments.add_live(header.segment, units);
                    }
                    dead(old);
                    mapped_added += 1;
                    units_added += i64::from(units);
                }
                EntryKind::Relocated { .. } | EntryKind::RelocatedPacked { .. } => {
                    let (Some(location), Some(index), Some(expected)) =
                        (location, &volume, expected)
                    else {
                        continue;
                    };
                    let new = pack(location, new);
                    if index.compare_exchange(entry.block, expected, new) {
                        if let (true, Some((from, _))) = (account, unpack(expected)) {
                            self.segments.add_live(header.segment, entry_units(new));
                            self.segments.remove_live(self.segment_of(from), entry_units(expected));
                        }
                        units_added +=
                            i64::from(entry_units(new)) - i64::from(entry_units(expected));
                        relocated += 1;
                    }
                }
                EntryKind::Trim { count } => {
                    let Some(index) = &volume else { continue };
                    index.trim(entry.block, u64::from(count), dead);
                }
                EntryKind::VolumeDeleted => {
                    self.index.unbind(entry.volume, dead);
                    volume = None;
                }
                EntryKind::Snapshot { snapshot, layer } => {
                    self.index.snapshot(entry.volume, snapshot, layer);
                    volume = None;
                }
                EntryKind::Clone { snapshot, layer } => {
                    self.index.clone_from(entry.volume, snapshot, layer);
                    volume = None;
                }
                EntryKind::Rollback { snapshot, layer } => {
                    self.index.rollback(entry.volume, snapshot, layer, dead);
                    volume = None;
                }
                EntryKind::Dropped { tag, location } => {
                    // The named layer only: if it merged since, its blocks have new owners.
                    let expected = pack(location, tag);
                    if let Some(layer) = self.index.get(entry.volume) {
                        if layer.remove_if(entry.block, expected) {
                            dead(expected);
                        }
                    }
                }
            }
        }
        self.segments.note_lsn(header.segment, header.lsn);
        if !account {
            return relocated;
        }
        for (counter, added) in [
            (&self.counters.mapped_blocks, mapped_added),
            (&self.counters.mapped_units, units_added),
        ] {
            if added >= 0 {
                counter.fetch_add(added as u64, Ordering::AcqRel);
            } else {
                counter.fetch_sub(added.unsigned_abs(), Ordering::AcqRel);
            }
        }
        relocated
    }
}

/// A failed batch, as every writer that joined it sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failure {
    DriveFailed(u16),
    Io { drive: u16, operation: DriveOperation, kind: io::ErrorKind },
    CapacityExceeded,
    Abandoned,
}

impl Failure {
    pub(super) fn from_drive(drive: u16, error: &DriveError) -> Self {
        let (operation, kind) = match error {
            DriveError::Io { operation, source, .. } => (*operation, source.kind()),
            DriveError::ShortTransfer { operation, .. } => (*operation, io::ErrorKind::WriteZero),
            DriveError::OutOfBounds { operation, .. } => (*operation, io::ErrorKind::InvalidInput),
        };
        Self::Io { drive, operation, kind }
    }

    pub(super) fn into_error(self, engine: &LogEngine) -> LogError {
        match self {
            Self::DriveFailed(drive) => LogError::DriveFailed { drive },
            Self::Io { drive, operation, kind } => LogError::Io {
                drive,
                source: DriveError::Io {
                    operation,
                    offset_bytes: 0,
                    length_bytes: 0,
                    source: io::Error::new(kind, "the batch holding this write failed"),
                },
            },
            Self::CapacityExceeded => LogError::CapacityExceeded {
                mapped_blocks: engine.counters.mapped_blocks.load(Ordering::Relaxed),
                capacity_blocks: engine.capacity_blocks,
                needed_blocks: 0,
            },
            Self::Abandoned => LogError::Abandoned,
        }
    }
}

pub(super) struct BatchCell {
    result: Cell<Option<Result<(), Failure>>>,
}

/// A host batch whose durable write was issued and that is not installed yet (see
/// [`COMMITS_IN_FLIGHT_MAX`]).
struct InFlight {
    header: BatchHeader,
    cell: Rc<BatchCell>,
    admitted_blocks: u64,
    host_bytes: u64,
    data_blocks: usize,
    /// The write's outcome, once it completed (or its future was dropped).
    written: Cell<Option<Result<(), Failure>>>,
}

/// Block `index` of a batch as written: its header block, then its data blocks.
fn batch_block<'b>(header_block: &'b [u8], data: &'b [u8], index: u32) -> &'b [u8] {
    if index == 0 {
        header_block
    } else {
        let at = (index as usize - 1) * BLOCK_BYTES;
        &data[at..at + BLOCK_BYTES]
    }
}

/// Completes an in-flight batch as abandoned if the future writing it is dropped.
struct InFlightGuard<'a, D: Drive> {
    handle: &'a LogHandle<D>,
    record: Rc<InFlight>,
    armed: bool,
}

impl<D: Drive> Drop for InFlightGuard<'_, D> {
    fn drop(&mut self) {
        if self.armed {
            self.record.written.set(Some(Err(Failure::Abandoned)));
            self.handle.advance();
        }
    }
}

/// A batch being formed or queued.
struct Pending {
    entries: Vec<Entry>,
    data: AlignedBuf,
    data_blocks: usize,
    admitted_blocks: u64,
    host_bytes: u64,
    cell: Rc<BatchCell>,
    /// Pack slots being filled, per `cells_log2 - 1`; created on the batch's first compressed
    /// block.
    packs: Option<Box<OpenPacks>>,
}

/// A compressed block on its way into a pack slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct CompressedBlock<'a> {
    pub cells_log2: u8,
    pub algorithm: Compression,
    pub bytes: &'a [u8],
    /// CRC-32C of the uncompressed block.
    pub crc: u32,
}

/// One open pack slot per slot class: the batch data block it will be written to, and the
/// compressed blocks gathered for it.
#[derive(Default)]
pub(super) struct OpenPacks {
    pub slots: [Option<(usize, PackBuilder)>; 4],
}

impl OpenPacks {
    /// Writes every open slot into its data block of `data`.
    pub fn finish_all(&mut self, data: &mut [u8]) {
        for (slot, builder) in self.slots.iter_mut().flatten() {
            if builder.is_empty() {
                continue;
            }
            let at = *slot * BLOCK_BYTES;
            let Ok(target) = <&mut [u8; BLOCK_BYTES]>::try_from(&mut data[at..at + BLOCK_BYTES])
            else {
                unreachable!("a block-sized range")
            };
            builder.finish(target);
        }
    }

    /// Adds a compressed block of slot class `cells_log2` to its open slot, or to a new one at
    /// data block `next_data` (finishing the full one into `data`); returns the sub-index and
    /// whether it opened a slot. `None` if a new slot is needed and `can_open` is false.
    pub fn add(
        &mut self,
        block: CompressedBlock<'_>,
        next_data: usize,
        can_open: bool,
        data: &mut [u8],
    ) -> Option<(u8, bool)> {
        let CompressedBlock { cells_log2, algorithm, bytes: compressed, crc } = block;
        let class = usize::from(cells_log2 - 1);
        let cells = 1usize << cells_log2;
        if let Some((_, builder)) = &mut self.slots[class] {
            if builder.len() < cells {
                let sub = builder.try_add(algorithm, compressed, crc);
                assert!(sub.is_some(), "a cell holds any block of its class");
                return sub.map(|sub| (sub, false));
            }
        }
        if !can_open {
            return None;
        }
        if let Some((slot, mut builder)) = self.slots[class].take() {
            let at = slot * BLOCK_BYTES;
            if let Ok(target) = <&mut [u8; BLOCK_BYTES]>::try_from(&mut data[at..at + BLOCK_BYTES])
            {
                builder.finish(target);
            }
            self.slots[class] = Some((next_data, builder));
        } else {
            self.slots[class] = Some((next_data, PackBuilder::new()));
        }
        let (_, builder) = self.slots[class].as_mut()?;
        let sub = builder.try_add(algorithm, compressed, crc);
        assert_eq!(sub, Some(0), "a new slot takes its first block");
        Some((0, true))
    }

    /// True if a block of class `cells_log2` fits an open slot without opening one.
    pub fn has_cell(&self, cells_log2: u8) -> bool {
        let class = usize::from(cells_log2 - 1);
        self.slots[class].as_ref().is_some_and(|(_, builder)| builder.len() < 1 << cells_log2)
    }
}

#[derive(Debug, Default)]
pub(super) struct StreamState {
    pub segment: Option<u32>,
    pub seq: u64,
    pub next_position: u32,
}

/// A set of drive indexes.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct DriveSet(pub [u64; 4]);

/// One drive's read of a run of rows: drive, first row, result, buffer.
pub(super) type RowsRead = (u16, u32, Result<(), DriveError>, AlignedBuf);

impl DriveSet {
    pub fn insert(&mut self, drive: u16) {
        self.0[usize::from(drive / 64)] |= 1 << (drive % 64);
    }

    pub fn contains(self, drive: u16) -> bool {
        self.0[usize::from(drive / 64)] & (1 << (drive % 64)) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0.iter().all(|word| *word == 0)
    }

    pub fn iter(self) -> impl Iterator<Item = u16> {
        (0..256u16).filter(move |drive| self.0[usize::from(drive / 64)] & (1 << (drive % 64)) != 0)
    }
}

const _: () = assert!(crate::format::DRIVE_COUNT_MAX == 256);

/// The leader role of a handle's pipeline; released (and waiters woken) when dropped.
pub(super) struct Leadership<'a> {
    leader: &'a Cell<bool>,
    changed: &'a LocalNotify,
}

impl Drop for Leadership<'_> {
    fn drop(&mut self) {
        self.leader.set(false);
        self.changed.notify_all();
    }
}

/// Completes a batch as abandoned if the leader's future is dropped while committing it, and
/// clears the handle's published LSN floor so checkpoints do not wait for it forever.
struct CommitGuard<'a> {
    cell: Rc<BatchCell>,
    slot: &'a HandleSlot,
    armed: bool,
}

impl Drop for CommitGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.cell.result.set(Some(Err(Failure::Abandoned)));
            self.slot.lsn_floor.store(u64::MAX, Ordering::SeqCst);
        }
    }
}

/// First-come first-served entry to a full batch queue: a writer that finds no room takes a
/// ticket; while tickets are waiting, only the oldest may add to the queue, so under overload
/// no writer waits behind an unbounded number of later ones. A served ticket keeps the turn
/// until its writer has added every block of its request ([`LogHandle::turn`]): handing the
/// turn on after each block interleaved the blocks of all waiting writers in the log, and a
/// later read of any of those ranges took a drive read per block.
#[derive(Debug, Default)]
struct Admission {
    next_ticket: Cell<u64>,
    serving: Cell<u64>,
    /// Tickets whose writers were dropped while waiting; skipped when their turn comes.
    abandoned: RefCell<BTreeSet<u64>>,
}

impl Admission {
    fn waiting(&self) -> bool {
        self.serving.get() < self.next_ticket.get()
    }

    fn take(&self) -> u64 {
        let ticket = self.next_ticket.get();
        self.next_ticket.set(ticket + 1);
        ticket
    }

    /// The ticket `ticket` was served or abandoned: move on past it and abandoned ones.
    fn done(&self, ticket: u64) {
        if ticket != self.serving.get() {
            self.abandoned.borrow_mut().insert(ticket);
            return;
        }
        let mut serving = ticket + 1;
        let mut abandoned = self.abandoned.borrow_mut();
        while abandoned.remove(&serving) {
            serving += 1;
        }
        self.serving.set(serving);
    }
}

/// A writer's turn at the batch queue: dropping it (request fully queued, or the writer
/// dropped while waiting) hands the turn to the next ticket.
pub(super) struct Ticket<'a> {
    admission: &'a Admission,
    ticket: Option<u64>,
    changed: &'a LocalNotify,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            self.admission.done(ticket);
            self.changed.notify_all();
        }
    }
}

/// Batch parts written to one stream and not yet installed: synced once and installed in
/// order by `finish_group`. Seals the stream's segment if dropped before that (the future
/// abandoned): a part's positions may hold nothing valid, and recovery walks a segment's header
/// chain only up to the first gap, so a later batch in that segment would be lost.
pub(super) struct Group<'a, D: Drive> {
    handle: &'a LogHandle<D>,
    stream: Stream,
    /// Positions of the stream's segment were taken for a part.
    armed: bool,
    parts: Vec<BatchHeader>,
    touched: DriveSet,
}

impl<'a, D: Drive> Group<'a, D> {
    fn new(handle: &'a LogHandle<D>, stream: Stream) -> Self {
        Self { handle, stream, armed: false, parts: Vec::new(), touched: DriveSet::default() }
    }
}

impl<D: Drive> Drop for Group<'_, D> {
    fn drop(&mut self) {
        if self.armed {
            self.handle.seal_stream(self.stream);
        }
    }
}

/// [`VolumeStore`] over the log, for one data-path thread. Not `Send`: it owns that thread's
/// drive handles. Create one per thread with [`LogEngine::handle`].
pub struct LogHandle<D> {
    pub(super) engine: Arc<LogEngine>,
    /// This thread's handles of the drives (index = drive index); a replaced drive's is
    /// reopened with `reopen` when the engine's generation of that drive moves.
    drives: Box<[DriveSlot<D>]>,
    reopen: RefCell<Option<Reopen<D>>>,
    pub(super) slot: Arc<HandleSlot>,
    /// Volume id -> its layer, resolved at the index generation noted.
    volumes: RefCell<HashMap<u64, (Arc<VolumeIndex>, u64)>>,
    queue: RefCell<VecDeque<Pending>>,
    /// Host batches written or being written and not installed yet, oldest (lowest LSN) first;
    /// at most [`COMMITS_IN_FLIGHT_MAX`], all in the host stream's open segment.
    in_flight: RefCell<VecDeque<Rc<InFlight>>>,
    /// The failure of an in-flight batch, which every later one in flight shares; cleared when
    /// none is left in flight.
    in_flight_failure: Cell<Option<Failure>>,
    /// Writers that found the queue full enter in arrival order (no starvation).
    admission: Admission,
    pub(super) leader: Cell<bool>,
    pub(super) changed: LocalNotify,
    /// Set while the leader waits for the oldest queued batch to be worth sending beside the
    /// batches in flight ([`LogHandle::worth_sending`]); the writer whose block makes it so
    /// clears it and wakes the leader through `batch_grown` (writers add blocks without
    /// notifying anyone otherwise).
    leader_awaits_batch: Cell<bool>,
    batch_grown: LocalNotify,
    pub(super) streams: [RefCell<StreamState>; 2],
    /// Batch data and per-drive write buffers, reused.
    pub(super) buffers: BufferPool,
    /// Batch header blocks, reused: a header lives while its batch is written, and an array
    /// held across that await would make every host write's future a block larger (each
    /// request's task is moved into place when spawned).
    header_blocks: BufferPool,
    /// Codec contexts and buffers for compressing writes and unpacking reads.
    pub(super) compress: RefCell<CompressScratch>,
    /// The erasure codec's working space (coded logs).
    pub(super) erasure: RefCell<Encoder>,
    /// Scattered ranges reads found, waiting for the defragmenter (at most
    /// `defrag::DEFRAG_QUEUED_BLOCKS_MAX` blocks), and its wake-up.
    pub(super) defrag: RefCell<VecDeque<super::defrag::DefragJob>>,
    pub(super) defrag_queued_blocks: Cell<usize>,
    pub(super) defrag_ready: LocalNotify,
}

/// How a handle opens its own handle of a replaced drive (given the drive index).
pub type Reopen<D> = Box<dyn Fn(u16) -> Result<D, DriveError>>;

/// One drive as a handle sees it: its handle and the engine's drive generation it was opened
/// at. `Rc` so an I/O in flight keeps the handle it started on when the drive is swapped.
struct DriveSlot<D> {
    drive: RefCell<Rc<D>>,
    generation: Cell<u64>,
}

impl<D> std::fmt::Debug for LogHandle<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogHandle").field("engine", &self.engine).finish()
    }
}

impl<D: Drive> LogHandle<D> {
    pub fn engine(&self) -> &Arc<LogEngine> {
        &self.engine
    }

    /// This handle's handle of drive `index`, reopened first if the drive was replaced since.
    pub(super) fn drive(&self, index: u16) -> Rc<D> {
        let slot = &self.drives[usize::from(index)];
        let generation = self.engine.drive_generation(index);
        if slot.generation.get() != generation {
            if let Some(reopen) = self.reopen.borrow().as_ref() {
                match reopen(index) {
                    Ok(drive) => {
                        *slot.drive.borrow_mut() = Rc::new(drive);
                        slot.generation.set(generation);
                    }
                    Err(_) => {
                        // Keep the old handle: its I/O fails and latches the drive again,
                        // which the rebuild reports.
                    }
                }
            }
        }
        Rc::clone(&slot.drive.borrow())
    }

    /// Sets how this handle opens a replaced drive (see [`LogEngine::replace_drive`]).
    pub fn set_reopen(&self, reopen: Reopen<D>) {
        *self.reopen.borrow_mut() = Some(reopen);
    }

    /// Swaps this handle's handle of drive `index` for `drive` (the handle that replaced it).
    pub fn install_drive(&self, index: u16, drive: D) {
        let slot = &self.drives[usize::from(index)];
        *slot.drive.borrow_mut() = Rc::new(drive);
        slot.generation.set(self.engine.drive_generation(index));
    }

    /// The layer a volume (or snapshot) reads and writes, from this thread's cache while no
    /// snapshot, clone, rollback or deletion happened since, else from the engine's (a plain
    /// volume's created if `create`).
    fn volume_index(&self, volume: u64, create: bool) -> Option<Arc<VolumeIndex>> {
        let generation = self.engine.index.generation();
        if let Some((index, seen)) = self.volumes.borrow().get(&volume) {
            if *seen == generation && !index.is_removed() {
                return Some(Arc::clone(index));
            }
        }
        let index = self.engine.index.resolve(volume, create)?;
        let mut cache = self.volumes.borrow_mut();
        if cache.len() >= VOLUME_CACHE_MAX {
            cache.clear();
        }
        cache.insert(volume, (Arc::clone(&index), generation));
        Some(index)
    }

    /// Becomes the pipeline's leader once no one else is and no host batch is in flight, so
    /// what the caller does (GC, a checkpoint) sees every batch of this handle installed.
    pub(super) async fn lead(&self) -> Leadership<'_> {
        let leadership = self.lead_pipeline().await;
        self.drain_in_flight().await;
        leadership
    }

    /// Becomes the pipeline's leader once no one else is; host batches may still be in flight.
    async fn lead_pipeline(&self) -> Leadership<'_> {
        while self.leader.get() {
            self.changed.notified().await;
        }
        self.leader.set(true);
        Leadership { leader: &self.leader, changed: &self.changed }
    }

    /// As the leader: waits until no host batch is in flight (their writers install them).
    async fn drain_in_flight(&self) {
        while !self.in_flight.borrow().is_empty() {
            self.changed.notified().await;
        }
    }

    /// The position a queued batch will take in the host stream's open segment if the batches
    /// ahead of it go pipelined: the open segment's next position plus the positions of the
    /// queued batches but the last `skip_back`. None without an open segment.
    fn next_batch_start(&self, queue: &VecDeque<Pending>, skip_back: usize) -> Option<u32> {
        let state = self.streams[Stream::Host as usize].borrow();
        state.segment?;
        let ahead = queue.len().saturating_sub(skip_back);
        let queued: usize = queue.iter().take(ahead).map(|batch| 1 + batch.data_blocks).sum();
        Some(state.next_position.saturating_add(u32::try_from(queued).unwrap_or(u32::MAX)))
    }

    /// The data blocks a batch starting at `start` may hold: on a log without parity, as many
    /// as fit before its stripe chunk ends (at least one), so the batch is one O_DSYNC write to
    /// one drive, not two writes and two flushes on two drives (about a quarter of the batches
    /// of a 4K random write stream crossed a chunk boundary); the writers behind it start the
    /// next batch at the boundary. A prediction: a segment switch moves the batches, which then
    /// only cross as before.
    fn chunk_data_max(&self, start: Option<u32>) -> usize {
        let geometry = &self.engine.geometry;
        let batch_data_max = self.engine.batch_data_max;
        match start {
            Some(start) if !geometry.is_coded() && geometry.drive_count > 1 => {
                // The header takes the first position.
                let room = geometry.chunk_room(start).saturating_sub(1).max(1);
                batch_data_max.min(room as usize)
            }
            _ => batch_data_max,
        }
    }

    /// A fresh admission turn for [`LogHandle::enqueue`]: hold it across every entry of one
    /// request, so a request's blocks sit back to back in the batches, not interleaved with
    /// those of the writers waiting beside it.
    pub(super) fn turn(&self) -> Ticket<'_> {
        Ticket { admission: &self.admission, ticket: None, changed: &self.changed }
    }

    /// Adds one entry (and its block) to the forming batch and returns that batch. `ticket` is
    /// the caller's turn ([`LogHandle::turn`]): once served it keeps the queue until the caller
    /// drops it, so the entries of one call sequence are contiguous in the log (a batch
    /// boundary aside).
    pub(super) async fn enqueue(
        &self,
        ticket: &mut Ticket<'_>,
        mut entry: Entry,
        data: Option<&[u8]>,
        compression: Compression,
        admitted: bool,
        host_bytes: u64,
    ) -> Rc<BatchCell> {
        // `data_max`: the data blocks the batch may hold (see `LogHandle::chunk_data_max`).
        let has_room = |batch: &Pending, cells_log2: Option<u8>, data_max: usize| {
            let cell = cells_log2.is_some_and(|cells_log2| {
                batch.packs.as_ref().is_some_and(|packs| packs.has_cell(cells_log2))
            });
            batch.entries.len() < BATCH_ENTRIES_MAX
                && (data.is_none() || cell || batch.data_blocks < data_max)
        };
        let batch_data_max = self.engine.batch_data_max;
        loop {
            let my_turn = match ticket.ticket {
                None => !self.admission.waiting(),
                Some(number) => number == self.admission.serving.get(),
            };
            if my_turn {
                // Compressed once, in this synchronous section (the scratch is the handle's).
                let mut compress = self.compress.borrow_mut();
                let compressed = match (data, compression, entry.kind) {
                    (Some(block), Compression::Lz4 | Compression::Zstd, EntryKind::Data { .. }) => {
                        <&[u8; BLOCK_BYTES]>::try_from(block)
                            .ok()
                            .and_then(|block| compress_block(compression, block, &mut compress))
                            .and_then(|bytes| {
                                cells_log2_for(bytes.len()).map(|class| (bytes, class))
                            })
                    }
                    _ => None,
                };
                let class = compressed.map(|(_, class)| class);
                let mut queue = self.queue.borrow_mut();
                // Where the forming batch will start, if the batches before it go pipelined.
                let mut back_max = self.chunk_data_max(self.next_batch_start(&queue, 1));
                if !queue.back().is_some_and(|batch| has_room(batch, class, back_max))
                    && queue.len() < BATCHES_QUEUED_MAX
                {
                    queue.push_back(Pending {
                        entries: Vec::with_capacity(BATCH_ENTRIES_MAX),
                        data: self.buffers.take((1 + batch_data_max) * BLOCK_BYTES),
                        data_blocks: 0,
                        admitted_blocks: 0,
                        host_bytes: 0,
                        cell: Rc::new(BatchCell { result: Cell::new(None) }),
                        packs: None,
                    });
                    // The new batch starts after the one that had no room.
                    back_max = self.chunk_data_max(self.next_batch_start(&queue, 1));
                }
                if let Some(batch) =
                    queue.back_mut().filter(|batch| has_room(batch, class, back_max))
                {
                    match (data, compressed, entry.kind) {
                        (Some(_), Some((bytes, cells_log2)), EntryKind::Data { crc }) => {
                            let can_open = batch.data_blocks < batch_data_max;
                            let packs = batch.packs.get_or_insert_with(Box::default);
                            let block =
                                CompressedBlock { cells_log2, algorithm: compression, bytes, crc };
                            let data = &mut batch.data[BLOCK_BYTES..];
                            let added = packs.add(block, batch.data_blocks, can_open, data);
                            let Some((sub, opens)) = added else {
                                unreachable!("has_room checked a cell or a data block")
                            };
                            batch.data_blocks += usize::from(opens);
                            entry.kind = EntryKind::Packed { crc, cells_log2, sub, opens };
                        }
                        (Some(block), _, _) => {
                            let at = (1 + batch.data_blocks) * BLOCK_BYTES;
                            batch.data[at..at + BLOCK_BYTES].copy_from_slice(block);
                            batch.data_blocks += 1;
                        }
                        (None, _, _) => {}
                    }
                    drop(compress);
                    batch.entries.push(entry);
                    batch.admitted_blocks += u64::from(admitted);
                    batch.host_bytes += host_bytes;
                    let cell = Rc::clone(&batch.cell);
                    if self.leader_awaits_batch.get() && self.worth_sending(&queue) {
                        self.leader_awaits_batch.set(false);
                        self.batch_grown.notify_all();
                    }
                    drop(queue);
                    // Served; the next ticket's turn comes when the caller drops its own.
                    return cell;
                }
            }
            if ticket.ticket.is_none() {
                ticket.ticket = Some(self.admission.take());
            }
            // The queue is full: help drain it, or wait for the leader to take a batch. Not
            // this writer's turn (an earlier one waits): wait for it to be served.
            let queue_full = self.queue.borrow().len() >= BATCHES_QUEUED_MAX;
            if self.leader.get() || !queue_full {
                self.changed.notified().await;
            } else {
                let leadership = self.lead_pipeline().await;
                self.commit_front(leadership).await;
            }
        }
    }

    /// Whether the oldest queued batch goes now beside the batches in flight: only one as large
    /// as the newest of them does (or with another queued behind it), so while the drives keep
    /// up the batch grows instead (one flush for more writes), and batches go out side by side
    /// only when writers outpace single commits.
    fn worth_sending(&self, queue: &VecDeque<Pending>) -> bool {
        let in_flight = self.in_flight.borrow();
        let Some(newest) = in_flight.back() else { return true };
        queue.len() > 1
            || queue.front().is_some_and(|batch| batch.data_blocks >= newest.data_blocks)
    }

    /// Waits until a batch completes, leading the pipeline while no one else does.
    async fn wait_batch(&self, cell: &Rc<BatchCell>) -> Result<(), Failure> {
        loop {
            if let Some(result) = cell.result.get() {
                return result;
            }
            // Another task leads, or the batch is in flight: whoever writes it completes it.
            if self.leader.get() || self.queue.borrow().is_empty() {
                self.changed.notified().await;
                continue;
            }
            let leadership = self.lead_pipeline().await;
            self.commit_front(leadership).await;
        }
    }

    /// As the leader (given up on return, or once a pipelined batch is issued): commits the
    /// oldest queued batch pipelined (see [`COMMITS_IN_FLIGHT_MAX`]) when it fits the open
    /// segment of a log without parity; else, once nothing is in flight, the queued batches,
    /// oldest first, at most [`GROUP_BATCHES_MAX`] of them with one sync of their drives on a
    /// coded log, the oldest alone on a log without parity (each batch is written as soon as it
    /// is taken; all are installed, in order, once the sync covers them). False if the queue
    /// was empty.
    async fn commit_front(&self, leadership: Leadership<'_>) -> bool {
        let mut yielded = false;
        loop {
            let Some(data_blocks) = self.queue.borrow().front().map(|batch| batch.data_blocks)
            else {
                return false;
            };
            let positions = self.engine.geometry.padded(1 + data_blocks as u32);
            let in_flight = self.in_flight.borrow().len();
            let pipelined = !self.engine.geometry.is_coded()
                && self.has_room(Stream::Host, positions)
                && self.failures_tolerable()
                && !self.checkpoint_due();
            let worth_it = self.worth_sending(&self.queue.borrow());
            if pipelined && in_flight < COMMITS_IN_FLIGHT_MAX && worth_it {
                // A small batch beside batches in flight lets the other tasks of this thread
                // that are ready now run first: writers that arrived together (the writes of
                // one replication frame, the requests of one socket read) join it instead of
                // each taking a batch, a drive write and a flush of its own. Alone, or large
                // enough, a batch goes at once.
                if in_flight > 0 && data_blocks < BATCH_GATHER_BELOW_BLOCKS && !yielded {
                    yielded = true;
                    crate::join::yield_now().await;
                    continue;
                }
                return self.commit_pipelined(leadership).await;
            }
            if !pipelined && in_flight == 0 {
                break;
            }
            if pipelined && in_flight < COMMITS_IN_FLIGHT_MAX {
                // Not worth sending yet: it becomes so when a writer adds to it (no other
                // wake-up would come before a batch in flight completes, and the writers whose
                // blocks would fill it are mostly those of the batches in flight, so every
                // batch would wait out the write before it) or when one in flight completes.
                self.leader_awaits_batch.set(true);
                crate::join::either(self.changed.notified(), self.batch_grown.notified()).await;
                self.leader_awaits_batch.set(false);
            } else {
                // A slot frees, or the pipeline drains, when an in-flight batch completes.
                self.changed.notified().await;
            }
        }
        // Boxed: the group path (segment switches, checkpoints, coded logs) holds far more
        // state than the pipelined one, and inline it would enlarge every host write's future.
        let group: LocalFuture<'_, Option<bool>> = Box::pin(self.commit_group());
        let committed = group.await;
        if committed == Some(true) && self.checkpoint_due() {
            // Bounded recovery: a failure here is reported by the next checkpoint attempt or by
            // the drive latch on the next write; the batches themselves are durable. The
            // leadership goes with it and is given up once the LSN floor is fixed, so this
            // thread's writers wait only for that, not for the index to stream out.
            // Boxed: a checkpoint's state is large and rare; inline, it would enlarge every
            // host write's future.
            let checkpoint: LocalFuture<'_, Result<(), LogError>> =
                Box::pin(self.checkpoint_as_leader(Some(leadership)));
            let _ = checkpoint.await;
        } else {
            drop(leadership);
        }
        committed.is_some()
    }

    /// As the leader, with nothing in flight: commits up to [`GROUP_BATCHES_MAX`] queued
    /// batches (one on a log without parity) with one sync (see [`LogHandle::commit_front`]).
    /// None if the queue was empty, else whether the batches are durable.
    async fn commit_group(&self) -> Option<bool> {
        let taken: Vec<Pending> = {
            let mut queue = self.queue.borrow_mut();
            // A log without parity writes each batch durable as written, so a group saves it no
            // sync: it takes the one batch that could not go pipelined (the one that opens a new
            // segment, say), and the batches behind it go pipelined again from the next leader
            // on instead of one drive round trip after another while nothing else is in flight
            // (three-copy 32K mix, about nine group commits a second on each node: 10-16 ms
            // each on average with up to four batches, 6-8 ms with one).
            let group_max = if self.engine.geometry.is_coded() { GROUP_BATCHES_MAX } else { 1 };
            let count = queue.len().min(group_max);
            queue.drain(..count).collect()
        };
        if taken.is_empty() {
            return None;
        }
        self.changed.notify_all();
        let mut guards: Vec<CommitGuard<'_>> = taken
            .iter()
            .map(|batch| CommitGuard {
                cell: Rc::clone(&batch.cell),
                slot: &self.slot,
                armed: true,
            })
            .collect();
        let mut group = Group::new(self, Stream::Host);
        let mut result = Ok(());
        let mut written: Vec<Pending> = Vec::with_capacity(taken.len());
        for mut batch in taken {
            if let Some(mut packs) = batch.packs.take() {
                packs.finish_all(&mut batch.data[BLOCK_BYTES..]);
            }
            if result.is_ok() {
                let entries = std::mem::take(&mut batch.entries);
                let data = &batch.data[BLOCK_BYTES..];
                result = self.write_batch(entries, data, batch.data_blocks, &mut group).await;
            }
            written.push(batch);
        }
        if result.is_ok() {
            result = self.finish_group(group).await;
        } else {
            self.abandon_group(group);
        }
        for (batch, guard) in written.into_iter().zip(guards.iter_mut()) {
            self.count_batch(
                result.is_ok(),
                batch.admitted_blocks,
                batch.host_bytes,
                batch.data_blocks,
            );
            guard.armed = false;
            self.buffers.give(batch.data);
            batch.cell.result.set(Some(result));
        }
        drop(guards);
        self.changed.notify_all();
        Some(result.is_ok())
    }

    /// As the leader, on a log without parity, with the oldest queued batch fitting the host
    /// stream's open segment and a free in-flight slot: takes its positions and LSN, gives up
    /// the leadership, writes it with O_DSYNC and installs it once every earlier batch of this
    /// handle is installed ([`LogHandle::advance`]).
    async fn commit_pipelined(&self, leadership: Leadership<'_>) -> bool {
        let Some(mut batch) = self.queue.borrow_mut().pop_front() else { return false };
        if let Some(mut packs) = batch.packs.take() {
            packs.finish_all(&mut batch.data[BLOCK_BYTES..]);
        }
        let engine = &*self.engine;
        let written = 1 + batch.data_blocks as u32;
        let (segment, segment_seq, position) = {
            let mut state = self.streams[Stream::Host as usize].borrow_mut();
            let Some(segment) = state.segment else { unreachable!("commit_front checked room") };
            let position = state.next_position;
            state.next_position += written;
            assert!(
                state.next_position <= engine.geometry.positions_per_segment(),
                "a pipelined batch fits its segment"
            );
            (segment, state.seq, position)
        };
        engine.segments.note_header(segment, position);
        // With batches in flight, the floor is already the oldest one's.
        let lsn = self.take_lsn(self.in_flight.borrow().is_empty());
        let entries = std::mem::take(&mut batch.entries);
        let header = BatchHeader { segment, segment_seq, position, lsn, entries };
        batch.data[..BLOCK_BYTES].copy_from_slice(&header.encode(&engine.geometry));
        batch.data.set_len(written as usize * BLOCK_BYTES);
        let record = Rc::new(InFlight {
            header,
            cell: Rc::clone(&batch.cell),
            admitted_blocks: batch.admitted_blocks,
            host_bytes: batch.host_bytes,
            data_blocks: batch.data_blocks,
            written: Cell::new(None),
        });
        {
            let mut in_flight = self.in_flight.borrow_mut();
            assert!(in_flight.len() < COMMITS_IN_FLIGHT_MAX, "commit_front checked a free slot");
            in_flight.push_back(Rc::clone(&record));
        }
        let mut guard = InFlightGuard { handle: self, record: Rc::clone(&record), armed: true };
        // The next batch may be issued while this one is written.
        drop(leadership);
        let (result, data) = self.write_batch_buffer(segment, position, batch.data).await;
        guard.armed = false;
        record.written.set(Some(result));
        self.buffers.give(data);
        self.advance();
        true
    }

    /// Installs and completes the in-flight batches whose writes are done, oldest first, up to
    /// the first still being written; publishes the LSN floor of the rest. A failed batch
    /// seals the segment and fails every later one in flight: recovery would stop at it.
    fn advance(&self) {
        let mut completed = false;
        let mut in_flight = self.in_flight.borrow_mut();
        while let Some(written) = in_flight.front().and_then(|record| record.written.get()) {
            let Some(record) = in_flight.pop_front() else { unreachable!("a front was found") };
            let result = match self.in_flight_failure.get() {
                Some(failure) => Err(failure),
                None => written,
            };
            match result {
                Ok(()) => {
                    self.engine.install(&record.header);
                }
                Err(failure) => {
                    if self.in_flight_failure.get().is_none() {
                        self.in_flight_failure.set(Some(failure));
                        self.seal_stream(Stream::Host);
                    }
                }
            }
            self.count_batch(
                result.is_ok(),
                record.admitted_blocks,
                record.host_bytes,
                record.data_blocks,
            );
            record.cell.result.set(Some(result));
            completed = true;
        }
        let floor = in_flight.front().map_or(u64::MAX, |record| record.header.lsn);
        if in_flight.is_empty() {
            self.in_flight_failure.set(None);
        }
        self.slot.lsn_floor.store(floor, Ordering::SeqCst);
        drop(in_flight);
        if completed {
            self.changed.notify_all();
        }
    }

    /// Settles a host batch's accounting once it is done: its admitted blocks leave the
    /// admission count either way; an installed batch counts as written.
    fn count_batch(&self, installed: bool, admitted_blocks: u64, host_bytes: u64, blocks: usize) {
        let counters = &self.engine.counters;
        counters.admitted_blocks.fetch_sub(admitted_blocks, Ordering::AcqRel);
        if installed {
            counters.host_bytes_written.fetch_add(host_bytes, Ordering::Relaxed);
            counters.host_batches.fetch_add(1, Ordering::Relaxed);
            counters.host_batch_blocks.fetch_add(blocks as u64, Ordering::Relaxed);
        }
    }

    /// Takes the next LSN for a batch. The first batch of a handle's unfinished work
    /// (`publish_floor`) publishes a floor before taking it, so a checkpoint that reads the
    /// counter after the batch took its LSN also sees the floor (see `checkpoint`), then lowers
    /// the floor to the LSN taken. Later ones leave the floor alone: it is already lower.
    fn take_lsn(&self, publish_floor: bool) -> u64 {
        let engine = &*self.engine;
        if publish_floor {
            self.slot.lsn_floor.store(engine.lsn_next.load(Ordering::SeqCst), Ordering::SeqCst);
        }
        let lsn = engine.lsn_next.fetch_add(1, Ordering::SeqCst);
        if publish_floor {
            self.slot.lsn_floor.store(lsn, Ordering::SeqCst);
        }
        lsn
    }

    /// Writes a batch to `stream` and installs it once durable (see [`LogHandle::write_batch`]).
    pub(super) async fn commit_batch(
        &self,
        stream: Stream,
        entries: Vec<Entry>,
        data: &[u8],
        data_blocks: usize,
    ) -> Result<(), Failure> {
        let mut group = Group::new(self, stream);
        match self.write_batch(entries, data, data_blocks, &mut group).await {
            Ok(()) => self.finish_group(group).await,
            Err(failure) => {
                self.abandon_group(group);
                Err(failure)
            }
        }
    }

    /// Writes a batch to `stream`, adding its parts to `group` (synced and installed by
    /// [`LogHandle::finish_group`]). If the open segment has room for part of it, the batch is
    /// split so the segment's tail is filled rather than wasted; the parts are installed in
    /// order.
    async fn write_batch(
        &self,
        mut entries: Vec<Entry>,
        data: &[u8],
        data_blocks: usize,
        group: &mut Group<'_, D>,
    ) -> Result<(), Failure> {
        let stream = group.stream;
        let per_segment = self.engine.geometry.positions_per_segment();
        let mut data_offset = 0usize;
        let mut remaining_blocks = data_blocks;
        // Each round writes at least one entry, so it ends within the entry count.
        loop {
            let room = {
                let state = self.streams[stream as usize].borrow();
                state.segment.map_or(0, |_| per_segment - state.next_position) as usize
            };
            // A batch with pack slots stays whole: its packed entries name slots by order.
            if room < 2 || room > remaining_blocks || entries.iter().any(Entry::is_packed) {
                let part = &data[data_offset * BLOCK_BYTES..];
                return self.write_part(entries, part, remaining_blocks, group).await;
            }
            // Take entries in order until the data blocks fill the room after the header.
            let mut taken_blocks = 0;
            let split = entries
                .iter()
                .position(|entry| {
                    if entry.has_data() {
                        if taken_blocks == room - 1 {
                            return true;
                        }
                        taken_blocks += 1;
                    }
                    false
                })
                .unwrap_or(entries.len());
            let rest = entries.split_off(split);
            let part = &data[data_offset * BLOCK_BYTES..(data_offset + taken_blocks) * BLOCK_BYTES];
            self.write_part(entries, part, taken_blocks, group).await?;
            entries = rest;
            data_offset += taken_blocks;
            remaining_blocks -= taken_blocks;
            if entries.is_empty() {
                return Ok(());
            }
        }
    }

    /// Writes one batch that fits a segment to `stream` (not yet synced or installed).
    async fn write_part(
        &self,
        entries: Vec<Entry>,
        data: &[u8],
        data_blocks: usize,
        group: &mut Group<'_, D>,
    ) -> Result<(), Failure> {
        let stream = group.stream;
        let engine = &*self.engine;
        if !self.failures_tolerable() {
            let failed = engine.latches.failed_drives();
            return Err(Failure::DriveFailed(failed.first().copied().unwrap_or(0)));
        }
        // A coded log pads the batch to whole stripes.
        let positions = engine.geometry.padded(1 + data_blocks as u32);
        if !group.parts.is_empty() && !self.has_room(stream, positions) {
            // Making room may collect garbage and take a checkpoint, which waits for this
            // handle's batches in flight: install the group's parts first.
            self.flush_group(group).await?;
        }
        self.make_room(stream, positions).await?;
        let (segment, segment_seq, position) = {
            let mut state = self.streams[stream as usize].borrow_mut();
            let Some(segment) = state.segment else { unreachable!("make_room opened one") };
            let position = state.next_position;
            state.next_position += positions;
            (segment, state.seq, position)
        };
        engine.segments.note_header(segment, position);
        // Until the group is installed, a failure or an abandoned future seals the segment.
        group.armed = true;
        // The group's first part publishes the floor; it stays until the group is installed.
        let lsn = self.take_lsn(group.parts.is_empty());
        let header = BatchHeader { segment, segment_seq, position, lsn, entries };
        let mut header_block = self.header_blocks.take(BLOCK_BYTES);
        header_block.copy_from_slice(&header.encode(&engine.geometry));
        let block_of = |index: u32| batch_block(&header_block, data, index);
        let written = 1 + data_blocks as u32;
        let result = if engine.geometry.is_coded() {
            self.write_positions(segment, position, written, block_of).await
        } else {
            // Durable as written (O_DSYNC): the group's sync has nothing left to do for it, and
            // the kernel flushes without a round trip through this thread.
            self.write_plain(segment, position, written, block_of, true).await
        };
        self.header_blocks.give(header_block);
        let touched = result?;
        if engine.geometry.is_coded() {
            for drive in touched.iter() {
                group.touched.insert(drive);
            }
        }
        group.parts.push(header);
        Ok(())
    }

    /// Whether `stream`'s open segment has `positions` free positions.
    fn has_room(&self, stream: Stream, positions: u32) -> bool {
        let state = self.streams[stream as usize].borrow();
        let per_segment = self.engine.geometry.positions_per_segment();
        state.segment.is_some() && state.next_position + positions <= per_segment
    }

    /// Syncs and installs the group's parts so far; the group goes on empty.
    async fn flush_group(&self, group: &mut Group<'_, D>) -> Result<(), Failure> {
        self.sync_drives(group.touched).await?;
        for header in group.parts.drain(..) {
            self.engine.install(&header);
        }
        group.touched = DriveSet::default();
        group.armed = false;
        self.slot.lsn_floor.store(u64::MAX, Ordering::SeqCst);
        Ok(())
    }

    /// Syncs the drives a group of parts was written to, then installs the parts in order.
    async fn finish_group(&self, mut group: Group<'_, D>) -> Result<(), Failure> {
        let result = self.sync_drives(group.touched).await;
        if result.is_ok() {
            for header in &group.parts {
                self.engine.install(header);
            }
            group.armed = false;
        }
        // Dropping an armed group seals the stream.
        drop(group);
        self.slot.lsn_floor.store(u64::MAX, Ordering::SeqCst);
        result
    }

    /// A part of the group failed: nothing of it is installed, and the stream moves on.
    fn abandon_group(&self, group: Group<'_, D>) {
        drop(group);
        self.slot.lsn_floor.store(u64::MAX, Ordering::SeqCst);
    }

    /// Seals `stream`'s open segment (RAM only): its next batch opens a new segment.
    fn seal_stream(&self, stream: Stream) {
        let mut state = self.streams[stream as usize].borrow_mut();
        let Some(segment) = state.segment.take() else { return };
        let _switch = self.slot.switch.lock().unwrap_or_else(|e| e.into_inner());
        self.engine.segments.set_state(segment, SegmentState::Sealed);
        self.slot.open_seqs[stream as usize].store(u64::MAX, Ordering::SeqCst);
        self.engine.sealed_since_checkpoint.fetch_add(1, Ordering::AcqRel);
    }

    /// Makes sure `stream`'s open segment has `positions` free positions, sealing it and opening
    /// another if not. Host writes collect garbage first when only the reserve is left.
    async fn make_room(&self, stream: Stream, positions: u32) -> Result<(), Failure> {
        let engine = &*self.engine;
        let per_segment = engine.geometry.positions_per_segment();
        assert!(positions <= per_segment);
        {
            let mut state = self.streams[stream as usize].borrow_mut();
            if let Some(segment) = state.segment {
                if state.next_position + positions <= per_segment {
                    return Ok(());
                }
                let _switch = self.slot.switch.lock().unwrap_or_else(|e| e.into_inner());
                engine.segments.set_state(segment, SegmentState::Sealed);
                self.slot.open_seqs[stream as usize].store(u64::MAX, Ordering::SeqCst);
                engine.sealed_since_checkpoint.fetch_add(1, Ordering::AcqRel);
                state.segment = None;
            }
        }
        let keep_free = match stream {
            Stream::Host => engine.reserve_segments,
            Stream::Gc => engine.checkpoint_segments_max,
        };
        let mut attempts = 0;
        loop {
            if let Some(segment) = self.open_segment(stream, keep_free) {
                let seq = engine.segments.seq(segment);
                *self.streams[stream as usize].borrow_mut() =
                    StreamState { segment: Some(segment), seq, next_position: 0 };
                return Ok(());
            }
            attempts += 1;
            if stream == Stream::Gc || attempts > super::gc::GC_ROUNDS_FOR_SPACE_MAX {
                return Err(Failure::CapacityExceeded);
            }
            // Boxed: GC commits its own batches (to the GC stream, which never comes here), so
            // the recursion is one level deep.
            let collect: LocalFuture<'_, Result<bool, Failure>> =
                Box::pin(self.collect_for_space());
            match collect.await {
                Ok(true) => {}
                Ok(false) => return Err(Failure::CapacityExceeded),
                Err(failure) => return Err(failure),
            }
        }
    }

    /// Allocates a segment for `stream` and gives it the next sequence number.
    pub(super) fn open_segment(&self, stream: Stream, keep_free: u32) -> Option<u32> {
        let engine = &*self.engine;
        // Under the switch lock, so a checkpoint sees either no segment or this one, exactly.
        let _switch = self.slot.switch.lock().unwrap_or_else(|e| e.into_inner());
        let segment = engine.segments.allocate(SegmentState::Open, keep_free)?;
        let seq = engine.segment_seq_next.fetch_add(1, Ordering::SeqCst);
        engine.segments.set_seq(segment, seq);
        self.slot.open_seqs[stream as usize].store(seq, Ordering::SeqCst);
        Some(segment)
    }

    /// Writes positions `first..first + count` of `segment`, block `i` being `block_of(i)`;
    /// returns the drives written. A failed write latches its drive.
    pub(super) async fn write_positions<'b>(
        &self,
        segment: u32,
        first: u32,
        count: u32,
        block_of: impl Fn(u32) -> &'b [u8],
    ) -> Result<DriveSet, Failure> {
        if self.engine.geometry.is_coded() {
            return self.write_stripes(segment, first, count, block_of).await;
        }
        self.write_plain(segment, first, count, block_of, false).await
    }

    /// Writes a whole batch, durable as written, to positions `first..` of `segment` of a log
    /// without parity: `buf` holds the batch as written (its header block, then its data
    /// blocks). A batch on one drive (most are: a stripe chunk holds up to
    /// [`super::format::STRIPE_BLOCKS_MAX`] positions) is written from `buf` itself; one that
    /// spans drives is copied into a buffer per drive. A failed write latches its drive. Hands
    /// `buf` back.
    async fn write_batch_buffer(
        &self,
        segment: u32,
        first: u32,
        buf: AlignedBuf,
    ) -> (Result<(), Failure>, AlignedBuf) {
        let geometry = &self.engine.geometry;
        assert!(!geometry.is_coded());
        assert!(buf.len() % BLOCK_BYTES == 0 && !buf.is_empty(), "a batch is whole blocks");
        let count = (buf.len() / BLOCK_BYTES) as u32;
        let mut runs = geometry.drive_runs(first, count);
        let single = match (runs.next(), runs.next()) {
            (Some((drive, first_row, rows)), None) => {
                assert_eq!(rows, count, "one drive's run holds the whole batch");
                Some((drive, first_row))
            }
            _ => None,
        };
        let Some((drive, first_row)) = single else {
            let block_of = |index: u32| {
                let at = index as usize * BLOCK_BYTES;
                &buf[at..at + BLOCK_BYTES]
            };
            let result = self.write_plain(segment, first, count, block_of, true).await;
            return (result.map(|_| ()), buf);
        };
        if self.engine.latches.is_failed(drive) {
            return (Err(Failure::DriveFailed(drive)), buf);
        }
        let counters = &self.engine.counters;
        counters
            .device_bytes_written
            .fetch_add(u64::from(count) * BLOCK_BYTES_U64, Ordering::Relaxed);
        // A durable write is a flush of its drive, as a sync is.
        counters.drive_syncs.fetch_add(1, Ordering::Relaxed);
        let offset_bytes = geometry.row_offset_bytes(segment, first_row);
        let (result, buf) = self.drive(drive).write_durable_at(offset_bytes, buf).await;
        let result = result.map_err(|error| {
            self.engine.latches.latch(drive);
            Failure::from_drive(drive, &error)
        });
        (result, buf)
    }

    /// [`LogHandle::write_positions`] on a log without parity; with `durable`, each drive write
    /// is durable when it completes ([`Drive::write_durable_at`]).
    async fn write_plain<'b>(
        &self,
        segment: u32,
        first: u32,
        count: u32,
        block_of: impl Fn(u32) -> &'b [u8],
        durable: bool,
    ) -> Result<DriveSet, Failure> {
        let geometry = &self.engine.geometry;
        assert!(!geometry.is_coded());
        let mut touched = DriveSet::default();
        let mut writes: Vec<LocalFuture<'_, (u16, Result<(), DriveError>)>> = Vec::new();
        for (drive, first_row, rows) in geometry.drive_runs(first, count) {
            if self.engine.latches.is_failed(drive) {
                return Err(Failure::DriveFailed(drive));
            }
            let mut buf = self.buffers.take(rows as usize * BLOCK_BYTES);
            for row in 0..rows {
                let position = geometry.position_of(drive, first_row + row);
                let at = row as usize * BLOCK_BYTES;
                buf[at..at + BLOCK_BYTES].copy_from_slice(block_of(position - first));
            }
            touched.insert(drive);
            let offset_bytes = geometry.row_offset_bytes(segment, first_row);
            let target = self.drive(drive);
            writes.push(Box::pin(async move {
                let (result, buf) = if durable {
                    target.write_durable_at(offset_bytes, buf).await
                } else {
                    target.write_at(offset_bytes, buf).await
                };
                self.buffers.give(buf);
                (drive, result)
            }));
        }
        self.engine
            .counters
            .device_bytes_written
            .fetch_add(u64::from(count) * BLOCK_BYTES_U64, Ordering::Relaxed);
        if durable {
            // Each is a flush of its drive, as a sync is.
            self.engine.counters.drive_syncs.fetch_add(writes.len() as u64, Ordering::Relaxed);
        }
        let (_, failure) = self.join_latching(writes).await;
        failure.map_or(Ok(touched), Err)
    }

    /// Runs drive operations concurrently; each that fails latches its drive. Returns the drives
    /// whose operation succeeded and the first failure.
    pub(super) async fn join_latching(
        &self,
        operations: Vec<LocalFuture<'_, (u16, Result<(), DriveError>)>>,
    ) -> (DriveSet, Option<Failure>) {
        let mut succeeded = DriveSet::default();
        let mut failure = None;
        for (drive, result) in join_all(operations).await {
            match result {
                Ok(()) => succeeded.insert(drive),
                Err(error) => {
                    self.engine.latches.latch(drive);
                    failure.get_or_insert(Failure::from_drive(drive, &error));
                }
            }
        }
        (succeeded, failure)
    }

    /// Syncs the given drives concurrently; a failed sync latches its drive.
    pub(super) async fn sync_drives(&self, drives: DriveSet) -> Result<(), Failure> {
        let coded = self.engine.geometry.is_coded();
        let mut syncs: Vec<LocalFuture<'_, (u16, Result<(), DriveError>)>> = Vec::new();
        for drive in drives.iter() {
            if self.engine.latches.is_failed(drive) {
                if coded && self.failures_tolerable() {
                    continue;
                }
                return Err(Failure::DriveFailed(drive));
            }
            let target = self.drive(drive);
            self.engine.counters.drive_syncs.fetch_add(1, Ordering::Relaxed);
            syncs.push(Box::pin(async move { (drive, target.sync().await) }));
        }
        let (_, failure) = self.join_latching(syncs).await;
        if coded && self.failures_tolerable() {
            // The batch is whole on the drives that remain: parity covers the lost ones.
            return Ok(());
        }
        failure.map_or(Ok(()), Err)
    }

    /// Reads positions `first..first + count` of `segment` into one buffer, in position order.
    /// The buffer comes from the handle's pool; callers that are done with it may hand it back
    /// with [`LogHandle::recycle`].
    pub(super) async fn read_positions(
        &self,
        segment: u32,
        first: u32,
        count: u32,
    ) -> Result<AlignedBuf, LogError> {
        let geometry = &self.engine.geometry;
        if geometry.is_coded() {
            return self.read_stripes(segment, first, count, DriveSet::default()).await;
        }
        let single = {
            let mut runs = geometry.drive_runs(first, count);
            match (runs.next(), runs.next()) {
                (Some(run), None) => Some(run),
                _ => None,
            }
        };
        if let Some((drive, first_row, rows)) = single {
            // On one drive (most reads: a stripe chunk is many positions): straight into the
            // buffer returned, no copy.
            debug_assert_eq!(rows, count);
            if self.engine.latches.is_failed(drive) {
                return Err(LogError::DriveFailed { drive });
            }
            let offset_bytes = geometry.row_offset_bytes(segment, first_row);
            let buf = self.buffers.take(count as usize * BLOCK_BYTES);
            let (result, buf) = self.drive(drive).read_at(offset_bytes, buf).await;
            return match result {
                Ok(()) => Ok(buf),
                Err(source) => {
                    self.buffers.give(buf);
                    Err(LogError::io(drive, source))
                }
            };
        }
        let mut reads: Vec<LocalFuture<'_, RowsRead>> = Vec::new();
        for (drive, first_row, rows) in geometry.drive_runs(first, count) {
            if self.engine.latches.is_failed(drive) {
                return Err(LogError::DriveFailed { drive });
            }
            let offset_bytes = geometry.row_offset_bytes(segment, first_row);
            let target = self.drive(drive);
            reads.push(Box::pin(async move {
                let buf = self.buffers.take(rows as usize * BLOCK_BYTES);
                let (result, buf) = target.read_at(offset_bytes, buf).await;
                (drive, first_row, result, buf)
            }));
        }
        let mut out = self.buffers.take(count as usize * BLOCK_BYTES);
        let mut failure = None;
        for (drive, first_row, result, buf) in join_all(reads).await {
            match result {
                Ok(()) => {
                    for (row, block) in buf.chunks(BLOCK_BYTES).enumerate() {
                        let position = geometry.position_of(drive, first_row + row as u32);
                        let at = (position - first) as usize * BLOCK_BYTES;
                        out[at..at + BLOCK_BYTES].copy_from_slice(block);
                    }
                }
                Err(source) => failure = failure.or(Some(LogError::io(drive, source))),
            }
            self.buffers.give(buf);
        }
        match failure {
            None => Ok(out),
            Some(error) => {
                self.buffers.give(out);
                Err(error)
            }
        }
    }

    /// Hands a buffer of [`LogHandle::read_positions`] back to the pool.
    pub(super) fn recycle(&self, buf: AlignedBuf) {
        self.buffers.give(buf);
    }

    /// Reads one block at `location` into `buf` (one block long).
    async fn read_location(
        &self,
        location: u32,
        buf: AlignedBuf,
    ) -> (Result<(), LogError>, AlignedBuf) {
        let (segment, position) = self.engine.geometry.split(location);
        let (drive, offset_bytes) = self.engine.geometry.place(segment, position);
        let coded = self.engine.geometry.is_coded();
        let readable = if coded {
            !self.unreadable_drives(segment).contains(drive)
        } else {
            !self.engine.latches.is_failed(drive)
        };
        if readable {
            let (result, buf) = self.drive(drive).read_at(offset_bytes, buf).await;
            match result {
                Ok(()) => return (Ok(()), buf),
                Err(source) if !coded => return (Err(LogError::io(drive, source)), buf),
                Err(_) => return self.read_reconstructed(segment, position, drive, buf).await,
            }
        }
        if coded {
            return self.read_reconstructed(segment, position, drive, buf).await;
        }
        (Err(LogError::DriveFailed { drive }), buf)
    }

    /// Reads one block of a coded log without its own drive, `drive`: rebuilt from its stripe.
    async fn read_reconstructed(
        &self,
        segment: u32,
        position: u32,
        drive: u16,
        mut buf: AlignedBuf,
    ) -> (Result<(), LogError>, AlignedBuf) {
        let mut exclude = DriveSet::default();
        exclude.insert(drive);
        match self.read_stripes(segment, position, 1, exclude).await {
            Ok(block) => {
                buf.copy_from_slice(&block);
                (Ok(()), buf)
            }
            Err(error) => (Err(error), buf),
        }
    }

    /// Checks a block read from the log against its index tag; a pack slot is unpacked in
    /// place into the block its sub-index names. False if the bytes are not that block.
    fn verify_in_place(&self, tag: u32, buf: &mut AlignedBuf) -> bool {
        let tag = Tag::of(tag);
        let Tag::Packed { sub, .. } = tag else {
            return tag.matches(crc32c::crc32c(buf));
        };
        let mut out = self.buffers.take(BLOCK_BYTES);
        let unpacked = {
            let mut compress = self.compress.borrow_mut();
            match (
                <&[u8; BLOCK_BYTES]>::try_from(&buf[..]),
                <&mut [u8; BLOCK_BYTES]>::try_from(&mut out[..]),
            ) {
                (Ok(slot), Ok(target)) => unpack_slot(slot, sub, target, &mut compress).ok(),
                _ => None,
            }
        };
        let verified = unpacked.is_some_and(|crc| tag.matches(crc));
        if verified {
            buf.copy_from_slice(&out);
        }
        self.buffers.give(out);
        verified
    }

    /// Reads one mapped block into `buf` (exactly one block long), verifying its checksum;
    /// re-reads if GC moved it. An unmapped block reads as zeros.
    async fn read_block(
        &self,
        index: &VolumeIndex,
        block: u64,
        mut entry: u64,
        mut buf: AlignedBuf,
    ) -> (Result<(), LogError>, AlignedBuf) {
        debug_assert_eq!(buf.len(), BLOCK_BYTES);
        for _ in 0..READ_RETRIES_MAX {
            let Some((location, tag)) = unpack(entry) else {
                buf.fill(0);
                return (Ok(()), buf);
            };
            let (result, returned) = self.read_location(location, buf).await;
            buf = returned;
            if let Err(error) = result {
                return (Err(error), buf);
            }
            if self.verify_in_place(tag, &mut buf) {
                return (Ok(()), buf);
            }
            let now = index.lookup(block);
            if now == entry {
                self.engine.counters.checksum_errors.fetch_add(1, Ordering::Relaxed);
                let (segment, position) = self.engine.geometry.split(location);
                let drive = self.engine.geometry.place(segment, position).0;
                if self.engine.geometry.is_coded() {
                    // The cell is damaged: rebuild it from the rest of its stripe, and serve it
                    // if that is the block (scrub rewrites it elsewhere).
                    let (result, returned) =
                        self.read_reconstructed(segment, position, drive, buf).await;
                    buf = returned;
                    if result.is_ok() && self.verify_in_place(tag, &mut buf) {
                        self.engine.counters.repaired_reads.fetch_add(1, Ordering::Relaxed);
                        return (Ok(()), buf);
                    }
                }
                let error =
                    LogError::ChecksumMismatch { volume: index.volume(), block, location, drive };
                return (Err(error), buf);
            }
            entry = now;
        }
        // The block kept moving under the read (GC and host writes racing it): report the last
        // location tried rather than spin.
        let (location, _) = unpack(entry).unwrap_or((0, 0));
        let (segment, position) = self.engine.geometry.split(location);
        let drive = self.engine.geometry.place(segment, position).0;
        let error = LogError::ChecksumMismatch { volume: index.volume(), block, location, drive };
        (Err(error), buf)
    }

    /// Fills `buf` from the volume at `offset_bytes`.
    pub async fn read_blocks(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        mut buf: AlignedBuf,
    ) -> (Result<(), LogError>, AlignedBuf) {
        if let Err(error) = volume.check_range(offset_bytes, buf.len() as u64) {
            return (Err(error.into()), buf);
        }
        self.engine.counters.host_bytes_read.fetch_add(buf.len() as u64, Ordering::Relaxed);
        let first = offset_bytes / BLOCK_BYTES_U64;
        let count = buf.len() / BLOCK_BYTES;
        let Some(index) = self.volume_index(volume.volume().0, false) else {
            buf.fill(0);
            return (Ok(()), buf);
        };
        if count == 1 {
            // The common 4 KiB read: straight into the host's buffer, no copy.
            let entry = index.lookup(first);
            return self.read_block(&index, first, entry, buf).await;
        }
        let entries: Vec<u64> = (0..count).map(|slot| index.lookup(first + slot as u64)).collect();
        if self.engine.geometry.is_coded() {
            // A coded log reads block by block (a degraded read rebuilds whole stripes).
            for (slot, out) in buf.chunks_mut(BLOCK_BYTES).enumerate() {
                let (block, entry) = (first + slot as u64, entries[slot]);
                let read = if is_block(entry) {
                    self.read_block_into(&index, block, entry, out).await
                } else {
                    out.fill(0);
                    Ok(())
                };
                if let Err(error) = read {
                    return (Err(error), buf);
                }
            }
            return (Ok(()), buf);
        }
        // Runs of blocks stored back to back on one drive are read with one I/O each, and all
        // runs at once: a multi-block read costs about one device latency, not one per block.
        let runs = self.read_runs(&entries);
        if runs[..] == [(0, count)] {
            // The whole read is one run (written together, or rewritten back to back): straight
            // into the host's buffer, no copy.
            let (result, mut buf) = self.read_at_location(entries[0], buf).await;
            let result = self.verify_run(&index, first, &entries, &mut buf, result.is_ok()).await;
            return (result, buf);
        }
        let mut rest: &mut [u8] = &mut buf;
        let mut next_slot = 0;
        for window in runs.chunks(READ_RUNS_IN_FLIGHT_MAX) {
            let mut reads: Vec<LocalFuture<'_, Result<(), LogError>>> =
                Vec::with_capacity(window.len());
            for &(start, length) in window {
                let (skipped, tail) =
                    std::mem::take(&mut rest).split_at_mut((start - next_slot) * BLOCK_BYTES);
                // Blocks between runs are unmapped: zeros.
                skipped.fill(0);
                let (out, tail) = tail.split_at_mut(length * BLOCK_BYTES);
                rest = tail;
                next_slot = start + length;
                let entries = &entries[start..start + length];
                let index = &index;
                reads.push(Box::pin(async move {
                    self.read_run(index, first + start as u64, entries, out).await
                }));
            }
            for result in join_all(reads).await {
                if let Err(error) = result {
                    return (Err(error), buf);
                }
            }
        }
        rest.fill(0);
        self.note_read(&index, first, &entries, runs.len(), &buf);
        (Ok(()), buf)
    }

    /// The runs of mapped blocks among `entries` (consecutive blocks of a read) as (first
    /// slot, length): a run is one block, or raw blocks at consecutive locations of one segment
    /// on consecutive rows of one drive, at most [`READ_RUN_BLOCKS_MAX`] long. Unmapped blocks
    /// belong to no run.
    fn read_runs(&self, entries: &[u64]) -> Vec<(usize, usize)> {
        let geometry = &self.engine.geometry;
        assert!(!geometry.is_coded(), "a coded log reads block by block");
        let raw_location = |entry: u64| match unpack(entry) {
            Some((location, tag)) if matches!(Tag::of(tag), Tag::Raw { .. }) => Some(location),
            _ => None,
        };
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut previous: Option<u32> = None;
        for (slot, &entry) in entries.iter().enumerate() {
            if !is_block(entry) {
                previous = None;
                continue;
            }
            let location = raw_location(entry);
            let follows = match (previous, location) {
                (Some(before), Some(location)) => {
                    let (segment, position) = geometry.split(before);
                    location == before + 1 && position + 1 < geometry.positions_per_segment() && {
                        let (drive, row) = geometry.drive_row(position);
                        geometry.drive_row(position + 1) == (drive, row + 1)
                            && geometry.split(location).0 == segment
                    }
                }
                _ => false,
            };
            match runs.last_mut() {
                Some((start, length))
                    if follows && *start + *length == slot && *length < READ_RUN_BLOCKS_MAX =>
                {
                    *length += 1;
                }
                _ => runs.push((slot, 1)),
            }
            previous = location;
        }
        runs
    }

    /// [`LogHandle::read_block`] into `out` (one block) through a pooled buffer.
    async fn read_block_into(
        &self,
        index: &VolumeIndex,
        block: u64,
        entry: u64,
        out: &mut [u8],
    ) -> Result<(), LogError> {
        let scratch = self.buffers.take(BLOCK_BYTES);
        let (result, scratch) = self.read_block(index, block, entry, scratch).await;
        if result.is_ok() {
            out.copy_from_slice(&scratch);
        }
        self.buffers.give(scratch);
        result
    }

    /// Reads one run of [`LogHandle::read_runs`] into `out` (its blocks, in order), starting at
    /// volume block `first`. A run of several blocks is one drive read; a block of it that fails
    /// its checksum (GC moved it meanwhile, or damage) is read again on its own, with the single
    /// block path's retries and repair.
    async fn read_run(
        &self,
        index: &VolumeIndex,
        first: u64,
        entries: &[u64],
        out: &mut [u8],
    ) -> Result<(), LogError> {
        debug_assert_eq!(out.len(), entries.len() * BLOCK_BYTES);
        if entries.len() == 1 {
            return self.read_block_into(index, first, entries[0], out).await;
        }
        let run = self.buffers.take(out.len());
        let (result, run) = self.read_at_location(entries[0], run).await;
        if result.is_ok() {
            out.copy_from_slice(&run);
        }
        self.buffers.give(run);
        self.verify_run(index, first, entries, out, result.is_ok()).await
    }

    /// Fills `buf` (its `len()`) from the drive holding the raw block `entry` maps, from that
    /// block on: one drive read, checksums not checked. Fails without a read on a failed drive.
    async fn read_at_location(&self, entry: u64, buf: AlignedBuf) -> (Result<(), ()>, AlignedBuf) {
        let Some((location, _)) = unpack(entry) else { unreachable!("runs hold mapped blocks") };
        let (segment, position) = self.engine.geometry.split(location);
        let (drive, offset_bytes) = self.engine.geometry.place(segment, position);
        if self.engine.latches.is_failed(drive) {
            return (Err(()), buf);
        }
        let (result, buf) = self.drive(drive).read_at(offset_bytes, buf).await;
        (result.map_err(drop), buf)
    }

    /// Checks each block of a run read into `out` against its entry's checksum, and reads a
    /// block that fails (or every block, unless `read_ok`) again alone, which reports a failed
    /// drive, an I/O error or damage exactly (and finds a block GC moved meanwhile).
    async fn verify_run(
        &self,
        index: &VolumeIndex,
        first: u64,
        entries: &[u64],
        out: &mut [u8],
        read_ok: bool,
    ) -> Result<(), LogError> {
        debug_assert_eq!(out.len(), entries.len() * BLOCK_BYTES);
        for (slot, block_out) in out.chunks_mut(BLOCK_BYTES).enumerate() {
            let verified = read_ok
                && unpack(entries[slot])
                    .is_some_and(|(_, tag)| Tag::of(tag).matches(crc32c::crc32c(block_out)));
            if !verified {
                // The single block path reports a failed drive, an I/O error or damage exactly.
                self.read_block_into(index, first + slot as u64, entries[slot], block_out).await?;
            }
        }
        Ok(())
    }

    /// Writes `data` at `offset_bytes`; completes once durable.
    pub async fn write_blocks(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        data: &[u8],
    ) -> Result<(), LogError> {
        volume.check_range(offset_bytes, data.len() as u64)?;
        let blocks = data.chunks_exact(BLOCK_BYTES).map(|block| (block, crc32c::crc32c(block)));
        self.write_block_list(volume, offset_bytes, blocks).await
    }

    /// Writes the blocks `blocks` yields, each exactly one block long with its CRC-32C, back to
    /// back from `offset_bytes`, as [`LogHandle::write_blocks`] writes them from one buffer:
    /// each is copied into its batch from where it lies (a replica's blocks arrive one buffer
    /// each), and its checksum is kept as given instead of computed again (a replicated block's
    /// was computed once where it entered the cluster, and checked where it arrived).
    pub async fn write_block_list<'d>(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        blocks: impl ExactSizeIterator<Item = (&'d [u8], u32)>,
    ) -> Result<(), LogError> {
        let count = blocks.len();
        volume.check_range(offset_bytes, (count * BLOCK_BYTES) as u64)?;
        let volume_id = volume.volume().0;
        let first = offset_bytes / BLOCK_BYTES_U64;
        if count == 0 {
            return Ok(());
        }
        let Some(index) = self.volume_index(volume_id, true) else {
            unreachable!("created on demand")
        };
        if index.is_frozen() {
            return Err(StoreError::ReadOnly { volume: volume.volume() }.into());
        }
        // A block this layer does not hold takes new space even if a snapshot under it maps it.
        let unmapped: Vec<bool> =
            (0..count).map(|slot| !is_block(index.get(first + slot as u64))).collect();
        let label = index.volume();
        let compression = volume.compression();
        let new_blocks = unmapped.iter().filter(|new| **new).count() as u64;
        self.engine.admit(new_blocks)?;
        let mut cells: Vec<Rc<BatchCell>> = Vec::new();
        // One turn for the whole write: its blocks go into the log back to back, so a later
        // read of the range is one drive read, however many writers wait beside this one.
        let mut turn = self.turn();
        for (slot, (block_data, crc)) in blocks.enumerate() {
            assert_eq!(block_data.len(), BLOCK_BYTES, "the blocks of a write are whole blocks");
            debug_assert_eq!(crc32c::crc32c(block_data), crc, "a block's checksum is its bytes'");
            let entry =
                Entry { volume: label, block: first + slot as u64, kind: EntryKind::Data { crc } };
            let (admitted, bytes) = (unmapped[slot], BLOCK_BYTES_U64);
            let cell = self
                .enqueue(&mut turn, entry, Some(block_data), compression, admitted, bytes)
                .await;
            if cells.last().is_none_or(|last| !Rc::ptr_eq(last, &cell)) {
                cells.push(cell);
            }
        }
        drop(turn);
        self.wait_all(&cells).await
    }

    pub(super) async fn wait_all(&self, cells: &[Rc<BatchCell>]) -> Result<(), LogError> {
        let mut first_failure = None;
        for cell in cells {
            if let Err(failure) = self.wait_batch(cell).await {
                first_failure.get_or_insert(failure);
            }
        }
        match first_failure {
            None => Ok(()),
            Some(failure) => Err(failure.into_error(&self.engine)),
        }
    }

    /// Makes a range read as zeros by dropping its mappings (thin); completes once durable.
    pub async fn trim_blocks(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), LogError> {
        volume.check_range(offset_bytes, length_bytes)?;
        // Nothing to drop in a plain volume never written.
        let Some(index) = self.volume_index(volume.volume().0, false) else { return Ok(()) };
        if index.is_frozen() {
            return Err(StoreError::ReadOnly { volume: volume.volume() }.into());
        }
        let label = index.volume();
        let mut first = offset_bytes / BLOCK_BYTES_U64;
        let mut remaining = length_bytes / BLOCK_BYTES_U64;
        let mut cells: Vec<Rc<BatchCell>> = Vec::new();
        let mut turn = self.turn();
        while remaining > 0 {
            let count = remaining.min(u64::from(u32::MAX)) as u32;
            let entry = Entry { volume: label, block: first, kind: EntryKind::Trim { count } };
            let cell = self.enqueue(&mut turn, entry, None, Compression::Off, false, 0).await;
            if cells.last().is_none_or(|last| !Rc::ptr_eq(last, &cell)) {
                cells.push(cell);
            }
            first += u64::from(count);
            remaining -= u64::from(count);
        }
        drop(turn);
        self.wait_all(&cells).await
    }

    /// Deletes a volume's (or a snapshot's) data durably: after this returns, recovery never
    /// brings it back. Blocks that snapshots or clones still read stay. The caller has fenced
    /// the volume's I/O; ids are never reused.
    pub async fn delete_volume(&self, volume: u64) -> Result<(), LogError> {
        let _exclusive = self.layer_operation().await;
        let entry = Entry { volume, block: 0, kind: EntryKind::VolumeDeleted };
        let cell = self.enqueue(&mut self.turn(), entry, None, Compression::Off, false, 0).await;
        self.volumes.borrow_mut().remove(&volume);
        self.wait_all(&[cell]).await
    }

    /// Takes snapshot `snapshot` (a fresh id) of `volume`: instant, read-only, sharing every
    /// block with the volume. It holds every write completed before this call and, for writes
    /// in flight, the old or the new data. Durable when this returns.
    pub async fn snapshot_volume(&self, volume: u64, snapshot: u64) -> Result<(), LogError> {
        let _exclusive = self.layer_operation().await;
        self.engine.index.check_snapshot(volume, snapshot)?;
        let layer = self.engine.index.allocate_label();
        self.log_layer_operation(volume, EntryKind::Snapshot { snapshot, layer }).await
    }

    /// Creates volume `volume` (a fresh id) as a writable clone of snapshot `snapshot`.
    pub async fn clone_volume(&self, volume: u64, snapshot: u64) -> Result<(), LogError> {
        let _exclusive = self.layer_operation().await;
        if self.engine.index.resolve(volume, false).is_some() || self.engine.index.is_bound(volume)
        {
            return Err(LayerError::IdInUse { id: volume }.into());
        }
        self.engine.index.check_layer_on(volume, snapshot)?;
        let layer = self.engine.index.allocate_label();
        self.log_layer_operation(volume, EntryKind::Clone { snapshot, layer }).await
    }

    /// Makes `volume` read what snapshot `snapshot` holds; what it wrote since is dropped. The
    /// caller has fenced the volume's I/O.
    pub async fn rollback_volume(&self, volume: u64, snapshot: u64) -> Result<(), LogError> {
        let _exclusive = self.layer_operation().await;
        self.engine.index.check_layer_on(volume, snapshot)?;
        let layer = self.engine.index.allocate_label();
        self.log_layer_operation(volume, EntryKind::Rollback { snapshot, layer }).await
    }

    async fn log_layer_operation(&self, volume: u64, kind: EntryKind) -> Result<(), LogError> {
        let entry = Entry { volume, block: 0, kind };
        let cell = self.enqueue(&mut self.turn(), entry, None, Compression::Off, false, 0).await;
        self.volumes.borrow_mut().remove(&volume);
        self.wait_all(&[cell]).await
    }

    /// Waits until no checkpoint runs and keeps others from starting until the guard drops: a
    /// checkpoint then never sees a layer table and index half way through an operation that
    /// moves entries between layers (see docs/format-log-v1.md, "Snapshots and clones").
    async fn layer_operation(&self) -> super::gc::BusyFlag<'_> {
        let busy = &self.engine.checkpoint_busy;
        // A checkpoint finishes or fails in bounded time; each poll yields to the runtime.
        while busy.swap(true, Ordering::AcqRel) {
            crate::join::yield_now().await;
        }
        super::gc::BusyFlag(busy)
    }
}

impl<D: Drive> VolumeStore for LogHandle<D> {
    async fn read(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        let (result, buf) = self.read_blocks(volume, offset_bytes, buf).await;
        (result.map_err(LogError::into_store_error), buf)
    }

    async fn write(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        let result = self.write_blocks(volume, offset_bytes, &buf).await;
        (result.map_err(LogError::into_store_error), buf)
    }

    async fn flush(&self, volume: &VolumeMap) -> Result<(), StoreError> {
        // Every mutation is durable before it completes: there is no volatile cache.
        if volume.is_removed() {
            return Err(StoreError::VolumeRemoved { volume: volume.volume() });
        }
        Ok(())
    }

    async fn write_zeroes(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError> {
        self.trim_blocks(volume, offset_bytes, length_bytes)
            .await
            .map_err(LogError::into_store_error)
    }

    async fn deallocate(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError> {
        self.trim_blocks(volume, offset_bytes, length_bytes)
            .await
            .map_err(LogError::into_store_error)
    }
}

#[cfg(test)]
mod admission_tests {
    use super::Admission;

    #[test]
    fn tickets_are_served_in_order_and_abandoned_ones_skipped() {
        let admission = Admission::default();
        assert!(!admission.waiting());
        let (first, second, third) = (admission.take(), admission.take(), admission.take());
        assert!(admission.waiting());
        // The second writer gives up while the first is still waiting.
        admission.done(second);
        assert_eq!(admission.serving.get(), first);
        admission.done(first);
        assert_eq!(admission.serving.get(), third, "the abandoned ticket is skipped");
        admission.done(third);
        assert!(!admission.waiting());
    }
}
