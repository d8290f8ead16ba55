//! Garbage collection and checkpoints: inline, by a handle's pipeline leader, when a host write
//! finds only the reserve left, or when the node's background tasks call [`LogHandle::gc_step`]
//! / [`LogHandle::checkpoint`]. A background GC step reads its victim without the pipeline
//! leadership and leads only to commit each relocation batch; a checkpoint gives the
//! leadership up once its LSN floor is fixed. Either way the thread's host writes do not wait
//! for the reads and writes of a whole segment or index.
//!
//! Background GC starts only when free segments fall to the host reserve plus a small headroom
//! ([`GC_HEADROOM_SEGMENTS_PER_HANDLE`] per handle): free segments beyond what the writers need
//! are over-provisioning taken from every other segment, and under uniform random overwrite the
//! write amplification is set by how full the cleaned segments are. Each background step first
//! lets the handle's waiting host writers commit, so GC never starves a thread's host I/O.
//!
//! GC picks the sealed segment with the best cost-benefit score `(1 - u) * age / (1 + u)` (LFS:
//! `u` = live fraction, age = LSNs since its newest batch), reads its batch headers (side by
//! side where the segment table knows their positions, else walking their chain), copies every
//! block the index still maps there into the handle's GC stream as `Relocated` entries, and
//! installs each copy with a compare-and-swap against the old location, so a host write that
//! landed meanwhile wins. Only segments opened before the durable checkpoint's segment floor are
//! eligible: later ones are replayed by recovery and must stay intact (they may hold trims that
//! hide older data). A segment is freed once nothing maps into it.
//!
//! A checkpoint (see docs/format-log-v1.md for the argument) reads the open-segment floors and
//! then the LSN counter, waits until every batch below that LSN is installed, streams the index
//! into freshly allocated checkpoint segments, syncs, then writes the root to every drive and
//! syncs again; only then are the previous checkpoint's segments freed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use types::AlignedBuf;

use super::engine::{CompressedBlock, DriveSet, Failure, Leadership, LogHandle, OpenPacks, Stream};
use super::format::{
    encode_layer_block, BatchHeader, CheckpointBlockWriter, CheckpointEntry, DataSlots, Entry,
    EntryKind, Geometry, LayerRecordEntry, Root, BATCH_ENTRIES_MAX, BLOCK_BYTES,
    CHECKPOINT_ENTRIES_PER_BLOCK_MAX, LAYER_RECORDS_PER_BLOCK, ROOT_SEGMENTS_MAX, ROOT_SLOT_BLOCKS,
    TOMBSTONE_LOCATION,
};
use super::index::{pack, packed_tag, raw_tag, unpack, LayerTable, TOMBSTONE, UNITS_PER_POSITION};
use super::segments::SegmentState;
use super::LogError;
use crate::compress::pack_entries;
use crate::drive::Drive;
use crate::join::{join_all, yield_now, LocalFuture};

/// Victims a host write cleans while looking for a segment before it gives up. Each round
/// frees a segment but may open one for the relocated blocks, so several rounds can be needed
/// to gain one; a round that finds no victim ends the search at once.
pub const GC_ROUNDS_FOR_SPACE_MAX: u32 = 1024;
/// Polls a checkpoint waits for other threads' batches in flight before giving up.
pub const CHECKPOINT_WAIT_YIELDS_MAX: u64 = 10_000_000;
/// Free segments beyond the host reserve that background GC keeps, per handle: room for every
/// data-path thread to open a host segment or two between background steps without cleaning
/// inline. More would idle space that GC could use to clean emptier segments (measured with
/// scripts/bench-wa.sh: 5% of the segments held idle raised write amplification at 80% fill
/// from 2.16 to about 2.35).
pub const GC_HEADROOM_SEGMENTS_PER_HANDLE: u32 = 2;

/// Reads of live data GC keeps in flight while it reads a victim whose header positions are
/// known, and the batches whose live data it holds at once (each up to a batch of blocks).
pub const GC_READS_IN_FLIGHT: usize = 16;

/// Header blocks (4 KiB each) GC reads at once from a victim whose header positions are known.
/// A victim of the 32K mix (`make compare-ceph`) holds ~330 batches: 16 at a time, a clean
/// took ~21 rounds of reads at a busy disk's latency (a background clean 72-144 ms at the
/// median, session 37), and background GC fell behind the host writes.
pub const GC_HEADER_READS_IN_FLIGHT: usize = 64;

/// Victims an urgent background tick cleans at once, in as many lanes on its handle: a clean
/// waits mostly on reads, so two overlap and background GC frees segments about twice as fast.
/// With one, host writes of the 32K mix found no free segment beyond the reserve and cleaned
/// inline five or six times a second, each holding their thread's writes 60-80 ms (the mix's
/// write p99 was 77-84 ms against 8 ms for its reads).
pub const GC_LANES_URGENT: usize = 2;

/// Dead blocks between two live ones of a batch that GC reads through rather than read the two
/// apart: one more device read costs about as much as a few more blocks of transfer. Victims
/// are mostly dead, so reading whole batches would move several times the live bytes.
pub const GC_READ_GAP_BLOCKS_MAX: u32 = 3;

/// Checkpoint blocks encoded between two drive writes (1 MiB; rounded up to whole stripes on
/// a coded log).
pub const CHECKPOINT_CHUNK_BLOCKS: u32 = 256;

/// Unreachable blocks one sweep drops at most (a few batches of `Dropped` entries).
pub const SWEEP_BLOCKS_MAX: usize = 4 * BATCH_ENTRIES_MAX;

/// How GC holds its handle's pipeline leadership while it cleans a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GcLead {
    /// The caller leads throughout (a host write cleaning inline for space).
    Held,
    /// Background GC: reads the victim without leading and leads for each of its commits.
    PerCommit,
}

/// What one GC step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GcOutcome {
    /// Enough segments are free; nothing was done.
    Idle,
    /// A segment was freed after relocating this many live blocks.
    Cleaned { segment: u32, relocated_blocks: u64 },
    /// No eligible segment holds garbage.
    NoVictim,
}

/// What [`LogHandle::write_checkpoint`] wrote.
struct CheckpointWritten {
    entry_count: u64,
    entry_blocks: u64,
    layer_record_count: u64,
    /// The drives written (to sync).
    touched: DriveSet,
}

/// Clears the engine's checkpoint-in-progress flag when dropped.
pub(super) struct BusyFlag<'a>(pub(super) &'a AtomicBool);

impl Drop for BusyFlag<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

fn failure_of(error: &LogError) -> Failure {
    match error {
        LogError::DriveFailed { drive } => Failure::DriveFailed(*drive),
        LogError::Io { drive, source } => Failure::from_drive(*drive, source),
        _ => Failure::CapacityExceeded,
    }
}

/// GC steps per background tick while space is merely getting low: a step relocates at most one
/// segment, so this bounds how much foreground bandwidth GC takes.
pub const GC_STEPS_PER_TICK: u32 = 2;
/// GC steps per tick when the free segments are within twice the reserve: catch up.
pub const GC_STEPS_PER_TICK_URGENT: u32 = 16;

impl<D: Drive> LogHandle<D> {
    /// One background tick of paced GC (the node's and the in-process bench's pacing):
    /// [`GC_STEPS_PER_TICK`] steps, or when free segments are within twice the reserve
    /// [`GC_STEPS_PER_TICK_URGENT`] steps in each of [`GC_LANES_URGENT`] lanes cleaning at once;
    /// a lane stops at the first step that finds nothing to do.
    pub async fn gc_tick(&self) -> Result<(), LogError> {
        let stats = self.engine().stats();
        let reserve = stats.segments_total / 20;
        let (steps, lanes) = if stats.segments_free < 2 * reserve.max(8) {
            (GC_STEPS_PER_TICK_URGENT, GC_LANES_URGENT)
        } else {
            (GC_STEPS_PER_TICK, 1)
        };
        let lane = || -> LocalFuture<'_, Result<(), LogError>> {
            Box::pin(async move {
                for _ in 0..steps {
                    match self.gc_step().await? {
                        GcOutcome::Cleaned { .. } => {}
                        GcOutcome::Idle | GcOutcome::NoVictim => break,
                    }
                }
                Ok(())
            })
        };
        join_all((0..lanes).map(|_| lane()).collect()).await.into_iter().collect()
    }

    /// Background GC: cleans one segment if free space is getting low. The node calls it from a
    /// background task on some data-path thread, paced as it sees fit.
    pub async fn gc_step(&self) -> Result<GcOutcome, LogError> {
        // Host writers woken when the previous step released the pipeline run first: a caller
        // that steps in a loop would otherwise take the leadership back before they wake, and
        // this thread's host I/O would wait until free space recovered (seen as 30 s stalls at
        // 90% fill).
        yield_now().await;
        let engine = &*self.engine;
        {
            let _leadership = self.lead().await;
            self.sweep_unreachable().await?;
        }
        if engine.segments.free_count() > engine.reserve_segments + self.gc_headroom_segments() {
            return Ok(GcOutcome::Idle);
        }
        // Not as the leader: the victim's reads would hold up this thread's host writes for as
        // long as the whole segment takes; each relocation batch leads only for its commit.
        let outcome = self.clean_one(GcLead::PerCommit).await?;
        if outcome == GcOutcome::NoVictim {
            let leadership = self.lead().await;
            if self.checkpoint_as_leader(Some(leadership)).await.is_ok() {
                return self.clean_one(GcLead::PerCommit).await;
            }
        }
        Ok(outcome)
    }

    /// As the leader: drops blocks no read can reach (see [`Index::unreachable_blocks`]) with
    /// `Dropped` entries, so their space is reclaimed like any overwritten block's. Runs when
    /// such layers exist and host writes or layer operations happened since the last sweep
    /// that found nothing; at most [`SWEEP_BLOCKS_MAX`] blocks per call.
    ///
    /// [`Index::unreachable_blocks`]: super::index::Index::unreachable_blocks
    pub(super) async fn sweep_unreachable(&self) -> Result<u64, LogError> {
        let engine = &*self.engine;
        let mark = engine.counters.host_batches.load(Ordering::Relaxed)
            ^ engine.index.generation().rotate_left(40);
        if engine.sweep_mark.load(Ordering::Acquire) == mark || !engine.index.has_hidden_layers() {
            return Ok(0);
        }
        let found = engine.index.unreachable_blocks(SWEEP_BLOCKS_MAX);
        if found.len() < SWEEP_BLOCKS_MAX {
            engine.sweep_mark.store(mark, Ordering::Release);
        }
        for chunk in found.chunks(BATCH_ENTRIES_MAX) {
            let entries = chunk
                .iter()
                .filter_map(|&(label, block, entry)| {
                    let (location, tag) = unpack(entry)?;
                    Some(Entry { volume: label, block, kind: EntryKind::Dropped { tag, location } })
                })
                .collect();
            self.commit_batch(Stream::Gc, entries, &[], 0)
                .await
                .map_err(|failure| failure.into_error(engine))?;
        }
        Ok(found.len() as u64)
    }

    /// Free segments beyond the reserve below which background GC works.
    pub(super) fn gc_headroom_segments(&self) -> u32 {
        let engine = &*self.engine;
        let per_handles = GC_HEADROOM_SEGMENTS_PER_HANDLE * u32::from(engine.config.handles_max);
        // At most the 5% earlier versions kept, so many handles on few segments stay usable.
        per_handles.min(engine.geometry.segment_count / 20).max(2)
    }

    /// Takes a checkpoint now, waiting for one already being written (or a snapshot, clone,
    /// rollback or deletion being logged) to finish first.
    pub async fn checkpoint(&self) -> Result<(), LogError> {
        for _ in 0..CHECKPOINT_WAIT_YIELDS_MAX {
            let leadership = self.lead().await;
            match self.checkpoint_as_leader(Some(leadership)).await {
                Err(LogError::CheckpointBusy) => {
                    // Let the other holder (perhaps a writer of this very handle) finish.
                    yield_now().await;
                }
                other => return other,
            }
        }
        Err(LogError::CheckpointBusy)
    }

    /// Whether enough segments were sealed since the last checkpoint to take another, and none
    /// is under way. A due checkpoint sends commits down the group path, whose leader takes it;
    /// once one runs (or a layer operation holds the flag) the count it will subtract still
    /// stands until it ends, and seeing it as due would keep every commit of every handle off
    /// the pipeline, one group at a time, for the whole stream of the index and its syncs
    /// (50-120 ms for 2 GiB mapped on this machine's files).
    pub(super) fn checkpoint_due(&self) -> bool {
        let engine = &*self.engine;
        if engine.checkpoint_busy.load(Ordering::Acquire) {
            return false;
        }
        let in_use = engine.geometry.segment_count - engine.segments.free_count();
        let due = engine.config.checkpoint_interval_segments.max(in_use / 4);
        engine.sealed_since_checkpoint.load(Ordering::Acquire) >= due
    }

    /// As the leader, for a host write that found no free segment: frees one if it can.
    pub(super) async fn collect_for_space(&self) -> Result<bool, Failure> {
        let inline = &self.engine.counters.gc_segments_cleaned_inline;
        match self.clean_one(GcLead::Held).await {
            Ok(GcOutcome::Cleaned { .. }) => {
                inline.fetch_add(1, Ordering::Relaxed);
                return Ok(true);
            }
            Ok(_) => {}
            Err(error) => return Err(failure_of(&error)),
        }
        // Perhaps only segments newer than the checkpoint hold garbage: move the floor.
        match self.checkpoint_as_leader(None).await {
            Ok(()) => {}
            Err(LogError::CheckpointBusy) => {
                yield_now().await;
                return Ok(true);
            }
            Err(error) => return Err(failure_of(&error)),
        }
        match self.clean_one(GcLead::Held).await {
            Ok(GcOutcome::Cleaned { .. }) => {
                inline.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Ok(_) => Ok(false),
            Err(error) => Err(failure_of(&error)),
        }
    }

    /// Claims the eligible sealed segment with the best cost-benefit score (see
    /// [`SegmentTable::claim_for_cleaning`]); None if there is none.
    ///
    /// [`SegmentTable::claim_for_cleaning`]: super::segments::SegmentTable::claim_for_cleaning
    fn claim_victim(&self) -> Option<u32> {
        // Each failed claim means another collector took that segment: at most one per segment.
        for _ in 0..self.engine.geometry.segment_count {
            let victim = self.pick_victim()?;
            if self.engine.segments.claim_for_cleaning(victim) {
                return Some(victim);
            }
        }
        None
    }

    /// The eligible sealed segment with the best cost-benefit score.
    fn pick_victim(&self) -> Option<u32> {
        let engine = &*self.engine;
        let floor = engine.gc_seq_floor.load(Ordering::Acquire);
        let excluded = engine.gc_excluded_seqs.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let now = engine.lsn_next.load(Ordering::Acquire);
        let positions = f64::from(engine.geometry.positions_per_segment());
        let mut best: Option<(f64, u32)> = None;
        for segment in 0..engine.geometry.segment_count {
            let seq = engine.segments.seq(segment);
            if engine.segments.state(segment) != SegmentState::Sealed
                || seq >= floor
                || excluded.contains(&seq)
            {
                continue;
            }
            let live = engine.segments.live_units(segment);
            let utilization = f64::from(live) / (positions * f64::from(UNITS_PER_POSITION));
            if utilization >= 0.99 {
                continue;
            }
            let age = (now.saturating_sub(engine.segments.lsn_max(segment)) + 1) as f64;
            let score = (1.0 - utilization) * age / (1.0 + utilization);
            if best.is_none_or(|(best_score, _)| score > best_score) {
                best = Some((score, segment));
            }
        }
        best.map(|(_, segment)| segment)
    }

    /// Cleans the best victim, as the leader or taking the leadership for each commit (`lead`).
    async fn clean_one(&self, lead: GcLead) -> Result<GcOutcome, LogError> {
        let engine = &*self.engine;
        let Some(victim) = self.claim_victim() else { return Ok(GcOutcome::NoVictim) };
        let mut relocated_blocks = 0;
        if engine.segments.live_units(victim) > 0 {
            match self.relocate(victim, lead).await {
                Ok(count) => relocated_blocks = count,
                Err(error) => {
                    engine.segments.set_state(victim, SegmentState::Sealed);
                    return Err(error);
                }
            }
        }
        let live_blocks = engine.segments.live_units(victim);
        if live_blocks > 0 {
            // Its header chain is damaged: some live blocks cannot be found. It stays in the
            // Cleaning state, out of GC, and the error is reported.
            return Err(LogError::SegmentCorrupt {
                segment: victim,
                position: 0,
                reason: "the batch headers end before every live block was found",
                live_blocks,
            });
        }
        engine.segments.release(victim);
        engine.counters.gc_segments_cleaned.fetch_add(1, Ordering::Relaxed);
        engine.counters.gc_relocated_blocks.fetch_add(relocated_blocks, Ordering::Relaxed);
        Ok(GcOutcome::Cleaned { segment: victim, relocated_blocks })
    }

    /// Copies the live blocks of `victim` to the GC stream; returns how many were installed.
    /// Raw blocks are copied whole; a compressed block's bytes move into a new pack slot of the
    /// same class (never recompressed), so a slot's dead neighbours are left behind.
    ///
    /// Where the segment's header positions are known (it was written in this run), its headers
    /// are read [`GC_HEADER_READS_IN_FLIGHT`] at a time, then the runs of their live data blocks
    /// ([`live_runs`]) [`GC_READS_IN_FLIGHT`] batches at a time; else the header chain is
    /// walked, one read per batch.
    async fn relocate(&self, victim: u32, lead: GcLead) -> Result<u64, LogError> {
        let engine = &*self.engine;
        let mut relocation = Relocation {
            victim,
            seq: engine.segments.seq(victim),
            hidden_layers: engine.index.has_hidden_layers(),
            lead,
            batch: RelocationBatch::new(engine.batch_data_max),
            relocated: 0,
            dropped: Vec::new(),
        };
        match engine.segments.header_positions(victim) {
            Some(headers) => self.relocate_known(&mut relocation, &headers).await?,
            None => self.relocate_chain(&mut relocation).await?,
        }
        self.commit_pending(&mut relocation).await?;
        Ok(relocation.relocated)
    }

    /// Commits what the relocation holds: the partly filled relocation batch and the `Dropped`
    /// entries, so the victim's live count says what is still left in it.
    async fn commit_pending(&self, relocation: &mut Relocation) -> Result<(), LogError> {
        if !relocation.batch.entries.is_empty() {
            relocation.relocated +=
                self.commit_relocation(&mut relocation.batch, relocation.lead).await?;
        }
        if !relocation.dropped.is_empty() {
            let dropped = std::mem::take(&mut relocation.dropped);
            self.commit_gc(relocation.lead, dropped, &[], 0).await?;
        }
        Ok(())
    }

    /// Relocation from the header positions the segment table recorded.
    async fn relocate_known(
        &self,
        relocation: &mut Relocation,
        headers: &[u32],
    ) -> Result<(), LogError> {
        let engine = &*self.engine;
        let victim = relocation.victim;
        for group in headers.chunks(GC_HEADER_READS_IN_FLIGHT) {
            if engine.segments.live_units(victim) == 0 {
                break;
            }
            let reads: Vec<LocalFuture<'_, Result<AlignedBuf, LogError>>> = group
                .iter()
                .map(|&position| -> LocalFuture<'_, _> {
                    Box::pin(self.read_positions(victim, position, 1))
                })
                .collect();
            let mut found: Vec<(u32, u32, Vec<LiveBlock>)> = Vec::new();
            for (&position, block) in group.iter().zip(join_all(reads).await) {
                // A header whose write was torn (its batch failed, and nothing after it in
                // the segment was installed) decodes as nothing: skip it.
                let block = block?;
                let mut header = relocation.header(&block, &engine.geometry, position);
                self.recycle(block);
                if header.is_none() {
                    // A batch started here in this run: its header cell is torn or stale.
                    header = self.rebuilt_header_of(victim, relocation.seq, position).await;
                }
                let Some(header) = header else { continue };
                let live = self.live_blocks(relocation, &header, position);
                self.commit_full_drops(relocation).await?;
                if !live.is_empty() {
                    found.push((position, header.data_blocks(), live));
                }
            }
            while !found.is_empty() {
                let rest = found.split_off(found.len().min(GC_READS_IN_FLIGHT));
                let batches = std::mem::replace(&mut found, rest);
                self.relocate_batches(relocation, batches).await?;
            }
        }
        Ok(())
    }

    /// Reads the live runs of `found` (position, data blocks and live blocks of each of a
    /// victim's batches) and adds their live blocks to the relocation.
    async fn relocate_batches(
        &self,
        relocation: &mut Relocation,
        found: Vec<(u32, u32, Vec<LiveBlock>)>,
    ) -> Result<(), LogError> {
        let victim = relocation.victim;
        // (batch of `found`, first data slot, slots): only the live runs are read.
        let runs: Vec<(usize, u32, u32)> = found
            .iter()
            .enumerate()
            .flat_map(|(batch, (_, _, live))| {
                live_runs(live).into_iter().map(move |(first, count)| (batch, first, count))
            })
            .collect();
        let mut data: Vec<AlignedBuf> = Vec::with_capacity(runs.len());
        for window in runs.chunks(GC_READS_IN_FLIGHT) {
            let reads: Vec<LocalFuture<'_, Result<AlignedBuf, LogError>>> = window
                .iter()
                .map(|&(batch, first, count)| -> LocalFuture<'_, _> {
                    Box::pin(self.read_positions(victim, found[batch].0 + 1 + first, count))
                })
                .collect();
            for read in join_all(reads).await {
                data.push(read?);
            }
        }
        let mut next_run = 0;
        for (batch, (_, _, live)) in found.into_iter().enumerate() {
            let count = runs[next_run..].iter().take_while(|run| run.0 == batch).count();
            let (batch_runs, batch_data) =
                (&runs[next_run..next_run + count], &data[next_run..next_run + count]);
            next_run += count;
            let source = |slot: u32| -> &[u8] {
                let at = batch_runs
                    .iter()
                    .position(|&(_, first, count)| (first..first + count).contains(&slot))
                    .expect("every live slot lies in one of its batch's runs");
                let offset = (slot - batch_runs[at].1) as usize * BLOCK_BYTES;
                &batch_data[at][offset..offset + BLOCK_BYTES]
            };
            self.copy_live(relocation, live, source).await?;
        }
        for buf in data {
            self.recycle(buf);
        }
        Ok(())
    }

    /// Relocation by walking the segment's header chain.
    async fn relocate_chain(&self, relocation: &mut Relocation) -> Result<(), LogError> {
        let engine = &*self.engine;
        let victim = relocation.victim;
        let per_segment = engine.geometry.positions_per_segment();
        let mut position = 0;
        // Each batch takes at least one position, so this loop is bounded by the segment size.
        while position < per_segment && engine.segments.live_units(victim) > 0 {
            let block = self.read_positions(victim, position, 1).await?;
            let mut header = relocation.header(&block, &engine.geometry, position);
            self.recycle(block);
            if header.is_none() {
                // The chain ends here, unless live blocks are left once what was found is
                // installed: then the header cell is bad, and a coded log rebuilds it.
                self.commit_pending(relocation).await?;
                if engine.segments.live_units(victim) > 0 {
                    header = self.rebuilt_header_of(victim, relocation.seq, position).await;
                }
            }
            let Some(header) = header else { break };
            let live = self.live_blocks(relocation, &header, position);
            self.commit_full_drops(relocation).await?;
            if !live.is_empty() {
                let blocks =
                    self.read_positions(victim, position + 1, header.data_blocks()).await?;
                let source = |slot: u32| -> &[u8] {
                    let at = slot as usize * BLOCK_BYTES;
                    &blocks[at..at + BLOCK_BYTES]
                };
                self.copy_live(relocation, live, source).await?;
                self.recycle(blocks);
            }
            position += engine.geometry.padded(header.positions());
        }
        Ok(())
    }

    /// The blocks of the batch at `position` that the index still maps there; blocks no read
    /// can reach go to `relocation.dropped` instead.
    fn live_blocks(
        &self,
        relocation: &mut Relocation,
        header: &BatchHeader,
        position: u32,
    ) -> Vec<LiveBlock> {
        let engine = &*self.engine;
        let mut live: Vec<LiveBlock> = Vec::new();
        let mut slots = DataSlots::default();
        for entry in &header.entries {
            let Some(slot) = slots.next(&entry.kind) else { continue };
            let (crc, tag, packed) = match entry.kind {
                EntryKind::Data { crc } | EntryKind::Relocated { crc, .. } => {
                    (crc, raw_tag(crc), None)
                }
                EntryKind::Packed { crc, cells_log2, sub, .. }
                | EntryKind::RelocatedPacked { crc, cells_log2, sub, .. } => {
                    (crc, packed_tag(cells_log2, sub, crc), Some((cells_log2, sub)))
                }
                _ => continue,
            };
            let location = engine.geometry.location(relocation.victim, position + 1 + slot);
            // The entry names the layer the block was written to; a snapshot deletion may
            // have merged that layer into its child since.
            let owner = engine
                .index
                .resolve_label(entry.volume)
                .filter(|index| index.get(entry.block) == pack(location, tag));
            let Some(owner) = owner else { continue };
            if relocation.hidden_layers && engine.index.is_hidden_block(owner.volume(), entry.block)
            {
                // No read reaches it: drop it rather than move it.
                relocation.dropped.push(Entry {
                    volume: owner.volume(),
                    block: entry.block,
                    kind: EntryKind::Dropped { tag, location },
                });
                continue;
            }
            live.push(LiveBlock {
                volume: owner.volume(),
                block: entry.block,
                crc,
                from: location,
                slot,
                packed,
            });
        }
        live
    }

    /// Commits full batches of `Dropped` entries (a header adds at most a batch's worth).
    async fn commit_full_drops(&self, relocation: &mut Relocation) -> Result<(), LogError> {
        while relocation.dropped.len() >= BATCH_ENTRIES_MAX {
            let rest = relocation.dropped.split_off(BATCH_ENTRIES_MAX);
            let full = std::mem::replace(&mut relocation.dropped, rest);
            self.commit_gc(relocation.lead, full, &[], 0).await?;
        }
        Ok(())
    }

    /// Adds the live blocks of one batch to the relocation batch, committing it whenever it is
    /// full; `source(slot)` is the batch's data block `slot` as read.
    async fn copy_live<'a>(
        &self,
        relocation: &mut Relocation,
        live: Vec<LiveBlock>,
        source: impl Fn(u32) -> &'a [u8],
    ) -> Result<(), LogError> {
        for found in live {
            let source = source(found.slot);
            if !relocation.batch.room_for(found.packed.map(|(cells_log2, _)| cells_log2)) {
                relocation.relocated +=
                    self.commit_relocation(&mut relocation.batch, relocation.lead).await?;
            }
            relocation.batch.add(&found, source);
        }
        Ok(())
    }

    async fn commit_relocation(
        &self,
        batch: &mut RelocationBatch,
        lead: GcLead,
    ) -> Result<u64, LogError> {
        let (entries, data_blocks) = batch.take();
        let count = entries.len() as u64;
        let result = self.commit_gc(lead, entries, &batch.data, data_blocks).await;
        batch.packs = OpenPacks::default();
        result?;
        Ok(count)
    }

    /// Commits a batch to the GC stream, as the leader already or taking the leadership for it.
    async fn commit_gc(
        &self,
        lead: GcLead,
        entries: Vec<Entry>,
        data: &[u8],
        data_blocks: usize,
    ) -> Result<(), LogError> {
        let _leadership = match lead {
            GcLead::Held => None,
            GcLead::PerCommit => Some(self.lead().await),
        };
        self.commit_batch(Stream::Gc, entries, data, data_blocks)
            .await
            .map_err(|failure| failure.into_error(&self.engine))
    }

    /// As the leader: writes a checkpoint and makes it current. A `leadership` handed over is
    /// given up once the LSN floor is fixed, so this thread's host writes go on while the
    /// index streams out (as every other thread's do); without one, the caller keeps leading.
    pub(super) async fn checkpoint_as_leader(
        &self,
        leadership: Option<Leadership<'_>>,
    ) -> Result<(), LogError> {
        let engine = Arc::clone(&self.engine);
        if engine.checkpoint_busy.swap(true, Ordering::AcqRel) {
            return Err(LogError::CheckpointBusy);
        }
        let _busy = BusyFlag(&engine.checkpoint_busy);
        // 1. The segment floor, then the segments open now: a batch that takes an LSN from now
        //    on lands in one of those or in a segment opened later (at or above the floor).
        let slots = engine.slots.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let segment_seq_floor = engine.segment_seq_next.load(Ordering::SeqCst);
        let mut open_seqs = Vec::new();
        for slot in &slots {
            let _switch = slot.switch.lock().unwrap_or_else(|e| e.into_inner());
            for open in &slot.open_seqs {
                let seq = open.load(Ordering::SeqCst);
                if seq < segment_seq_floor {
                    open_seqs.push(seq);
                }
            }
        }
        // 2. The LSN floor, then wait until every batch below it is installed.
        let lsn_floor = engine.lsn_next.load(Ordering::SeqCst);
        let mut yields = 0;
        while slots.iter().any(|slot| slot.lsn_floor.load(Ordering::SeqCst) < lsn_floor) {
            yields += 1;
            if yields > CHECKPOINT_WAIT_YIELDS_MAX {
                return Err(LogError::CheckpointBusy);
            }
            yield_now().await;
        }
        // Every batch below the floor is installed and every later one is replayed over the
        // checkpoint: this handle's writers may go on (their batches take LSNs at or above it).
        drop(leadership);
        let sealed_before = engine.sealed_since_checkpoint.load(Ordering::Acquire);
        let checkpoint_id = engine.checkpoint.lock().unwrap_or_else(|e| e.into_inner()).id + 1;
        // 3. Stream the index into checkpoint segments.
        let mut segments = Vec::new();
        let result = self.write_checkpoint(checkpoint_id, &mut segments).await;
        let CheckpointWritten { entry_count, entry_blocks, layer_record_count, touched } =
            match result {
                Ok(written) => written,
                Err(error) => {
                    for segment in segments {
                        engine.segments.release(segment);
                    }
                    return Err(error);
                }
            };
        let synced = self.sync_drives(touched).await;
        if let Err(failure) = synced {
            for segment in segments {
                engine.segments.release(segment);
            }
            return Err(failure.into_error(&engine));
        }
        // 4. The root, on every drive; from here a crash recovers from this checkpoint.
        let root = Root {
            checkpoint_id,
            lsn_floor,
            segment_seq_floor,
            lsn_next: engine.lsn_next.load(Ordering::SeqCst),
            segment_seq_next: engine.segment_seq_next.load(Ordering::SeqCst),
            entry_count,
            entry_blocks,
            layer_record_count,
            segments: segments.clone(),
            open_seqs: open_seqs.clone(),
        };
        self.write_root(&root).await?;
        // 5. Make it current and free the previous checkpoint.
        let previous = std::mem::replace(
            &mut *engine.checkpoint.lock().unwrap_or_else(|e| e.into_inner()),
            super::engine::CheckpointRecord { id: checkpoint_id, segments },
        );
        for segment in previous.segments {
            engine.segments.release(segment);
        }
        *engine.gc_excluded_seqs.lock().unwrap_or_else(|e| e.into_inner()) = open_seqs;
        engine.gc_seq_floor.store(segment_seq_floor, Ordering::Release);
        engine.sealed_since_checkpoint.fetch_sub(sealed_before, Ordering::AcqRel);
        engine.counters.checkpoints.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Writes every index entry (blocks and tombstones), then the layer table, into newly
    /// allocated checkpoint segments (appended to `segments`).
    async fn write_checkpoint(
        &self,
        checkpoint_id: u64,
        segments: &mut Vec<u32>,
    ) -> Result<CheckpointWritten, LogError> {
        let engine = &*self.engine;
        let per_segment = engine.geometry.positions_per_segment() as usize;
        // Written a chunk at a time: encoding a chunk is a bounded stretch of CPU between two
        // awaits, so the thread's host I/O is served in between.
        let chunk_blocks =
            (engine.geometry.padded(CHECKPOINT_CHUNK_BLOCKS) as usize).min(per_segment);
        let mut buffer = AlignedBuf::new(chunk_blocks * BLOCK_BYTES);
        // The checkpoint segment being filled, and the position its next chunk goes to.
        let mut current: Option<(u32, usize)> = None;
        let mut filled = 0usize;
        let mut block_index = 0u32;
        let mut entry_count = 0u64;
        let mut entry_blocks = 0u64;
        let mut touched = DriveSet::default();
        // Index entries read but not yet written: `chunk[chunk_at..]`, of layer `chunk_volume`.
        let mut chunk: Vec<(u64, u64)> = Vec::with_capacity(CHECKPOINT_ENTRIES_PER_BLOCK_MAX);
        let mut chunk_at = 0;
        let mut chunk_volume = 0;
        // Layer operations never run during a checkpoint (they hold `checkpoint_busy`), so the
        // table is the one every batch below the LSN floor left.
        let layer_records = layer_records(&engine.index.layer_table());
        let mut layers_at = 0;
        let volumes = engine.index.volumes();
        let mut volume_at = 0;
        let mut cursor = Some(0);
        loop {
            // Fill one block with as many entries as it takes, straight into the buffer.
            let slot = &mut buffer[filled * BLOCK_BYTES..(filled + 1) * BLOCK_BYTES];
            let mut writer = CheckpointBlockWriter::new(slot);
            loop {
                if chunk_at == chunk.len() {
                    if volume_at >= volumes.len() {
                        break;
                    }
                    let Some(from) = cursor else {
                        volume_at += 1;
                        cursor = Some(0);
                        continue;
                    };
                    chunk.clear();
                    chunk_at = 0;
                    cursor = volumes[volume_at].collect_mapped(
                        from,
                        CHECKPOINT_ENTRIES_PER_BLOCK_MAX,
                        &mut chunk,
                    );
                    chunk_volume = volumes[volume_at].volume();
                    continue;
                }
                let (block, entry) = chunk[chunk_at];
                let (location, tag) = match unpack(entry) {
                    Some(found) => found,
                    None if entry == TOMBSTONE => (TOMBSTONE_LOCATION, u32::MAX),
                    None => {
                        chunk_at += 1;
                        continue;
                    }
                };
                if !writer.push(&CheckpointEntry { volume: chunk_volume, block, location, tag }) {
                    break;
                }
                chunk_at += 1;
            }
            let entries_done = volume_at >= volumes.len() && chunk_at == chunk.len();
            if writer.entries() > 0 {
                entry_count += u64::from(writer.finish(checkpoint_id, block_index));
                entry_blocks += 1;
                filled += 1;
                block_index += 1;
            } else if entries_done && layers_at < layer_records.len() {
                let end = (layers_at + LAYER_RECORDS_PER_BLOCK).min(layer_records.len());
                let block =
                    encode_layer_block(checkpoint_id, block_index, &layer_records[layers_at..end]);
                buffer[filled * BLOCK_BYTES..(filled + 1) * BLOCK_BYTES].copy_from_slice(&block);
                filled += 1;
                block_index += 1;
                layers_at = end;
            }
            let last = entries_done && layers_at >= layer_records.len();
            let room = per_segment - current.map_or(0, |(_, position)| position);
            if filled > 0 && (filled == chunk_blocks.min(room) || last) {
                let (segment, position) = match current {
                    Some(open) => open,
                    None => {
                        if segments.len() >= ROOT_SEGMENTS_MAX {
                            return Err(LogError::CheckpointInvalid {
                                checkpoint_id,
                                reason: "the index does not fit in the checkpoint segments a \
                                         root lists",
                            });
                        }
                        let Some(segment) = engine.segments.allocate(SegmentState::Checkpoint, 0)
                        else {
                            return Err(LogError::CheckpointNoSpace {
                                needed: 1,
                                free: engine.segments.free_count(),
                            });
                        };
                        segments.push(segment);
                        (segment, 0)
                    }
                };
                let written = self
                    .write_positions(segment, position as u32, filled as u32, |index| {
                        let at = index as usize * BLOCK_BYTES;
                        &buffer[at..at + BLOCK_BYTES]
                    })
                    .await
                    .map_err(|failure| failure.into_error(engine))?;
                for drive in written.iter() {
                    touched.insert(drive);
                }
                engine.counters.checkpoint_blocks.fetch_add(filled as u64, Ordering::Relaxed);
                let position = position + filled;
                current = (position < per_segment).then_some((segment, position));
                filled = 0;
            }
            if last && filled == 0 {
                return Ok(CheckpointWritten {
                    entry_count,
                    entry_blocks,
                    layer_record_count: layer_records.len() as u64,
                    touched,
                });
            }
        }
    }

    /// Writes the root to its slot on every drive, then syncs them all.
    async fn write_root(&self, root: &Root) -> Result<(), LogError> {
        let engine = &*self.engine;
        let slot = ROOT_SLOT_BLOCKS[(root.checkpoint_id % 2) as usize];
        let offset_bytes = engine.geometry.header_offset_bytes(slot);
        let encoded = root.encode();
        let mut touched = DriveSet::default();
        for drive in 0..engine.geometry.drive_count {
            let target = self.drive(drive);
            if engine.latches.is_failed(drive) {
                if engine.geometry.is_coded() && self.failures_tolerable() {
                    // Every drive holds the root; the remaining ones are enough.
                    continue;
                }
                return Err(LogError::DriveFailed { drive });
            }
            let mut buf = AlignedBuf::new(encoded.len());
            buf.copy_from_slice(&encoded);
            let (result, _) = target.write_at(offset_bytes, buf).await;
            engine.counters.device_bytes_written.fetch_add(encoded.len() as u64, Ordering::Relaxed);
            if let Err(source) = result {
                engine.latches.latch(drive);
                if engine.geometry.is_coded() && self.failures_tolerable() {
                    continue;
                }
                return Err(LogError::Io { drive, source });
            }
            touched.insert(drive);
        }
        self.sync_drives(touched).await.map_err(|failure| failure.into_error(engine))
    }
}

/// One segment's relocation under way.
struct Relocation {
    victim: u32,
    /// The victim's sequence number: a header of another (an earlier use of the segment) is
    /// not one of its batches.
    seq: u64,
    hidden_layers: bool,
    lead: GcLead,
    batch: RelocationBatch,
    relocated: u64,
    dropped: Vec<Entry>,
}

impl Relocation {
    /// The victim's batch header in `block` (read at `position`), if it is one.
    fn header(&self, block: &[u8], geometry: &Geometry, position: u32) -> Option<BatchHeader> {
        BatchHeader::decode(block, geometry, self.victim, position)
            .ok()
            .filter(|header| header.segment_seq == self.seq)
    }
}

/// A block GC found live in its victim: whose it is, where, and (if compressed) its slot class
/// and sub-index there.
struct LiveBlock {
    volume: u64,
    block: u64,
    crc: u32,
    from: u32,
    /// The data block of its batch (a pack slot for compressed blocks).
    slot: u32,
    packed: Option<(u8, u8)>,
}

/// The data slots of one batch's live blocks as runs to read, `(first slot, slots)`, in slot
/// order: slots at most [`GC_READ_GAP_BLOCKS_MAX`] apart share a run, so a mostly dead batch is
/// read block by block and a mostly live one whole. (Compressed blocks share pack slots, and a
/// later entry may name an earlier slot, so the slots are sorted first.)
fn live_runs(live: &[LiveBlock]) -> Vec<(u32, u32)> {
    let mut slots: Vec<u32> = live.iter().map(|found| found.slot).collect();
    slots.sort_unstable();
    slots.dedup();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for slot in slots {
        match runs.last_mut() {
            Some((first, count)) if slot <= *first + *count + GC_READ_GAP_BLOCKS_MAX => {
                *count = slot - *first + 1;
            }
            _ => runs.push((slot, 1)),
        }
    }
    runs
}

/// The relocation batch GC is filling.
struct RelocationBatch {
    entries: Vec<Entry>,
    data: AlignedBuf,
    data_blocks: usize,
    data_max: usize,
    packs: OpenPacks,
}

impl RelocationBatch {
    fn new(data_max: usize) -> Self {
        Self {
            entries: Vec::with_capacity(BATCH_ENTRIES_MAX),
            data: AlignedBuf::new(data_max * BLOCK_BYTES),
            data_blocks: 0,
            data_max,
            packs: OpenPacks::default(),
        }
    }

    /// True if one more block (of slot class `cells_log2` if compressed) fits.
    fn room_for(&self, cells_log2: Option<u8>) -> bool {
        let cell = cells_log2.is_some_and(|cells_log2| self.packs.has_cell(cells_log2));
        self.entries.len() < BATCH_ENTRIES_MAX && (cell || self.data_blocks < self.data_max)
    }

    /// Adds a live block; `source` is its data block in the victim (the slot, if packed).
    fn add(&mut self, found: &LiveBlock, source: &[u8]) {
        let kind = match found.packed {
            None => {
                let at = self.data_blocks * BLOCK_BYTES;
                self.data[at..at + BLOCK_BYTES].copy_from_slice(source);
                self.data_blocks += 1;
                EntryKind::Relocated { crc: found.crc, from: found.from }
            }
            Some((cells_log2, from_sub)) => {
                // The compressed bytes move as they are; a slot whose directory no longer
                // parses keeps the block where it is (reads report it damaged).
                let Ok(slot) = <&[u8; BLOCK_BYTES]>::try_from(source) else { return };
                let Ok(listing) = pack_entries(slot) else { return };
                let Some(entry) = listing.into_iter().find(|entry| entry.sub() == from_sub) else {
                    return;
                };
                let can_open = self.data_blocks < self.data_max;
                let block = CompressedBlock {
                    cells_log2,
                    algorithm: entry.algorithm(),
                    bytes: entry.compressed(slot),
                    crc: entry.uncompressed_crc(),
                };
                let added = self.packs.add(block, self.data_blocks, can_open, &mut self.data);
                let Some((sub, opens)) = added else { return };
                self.data_blocks += usize::from(opens);
                EntryKind::RelocatedPacked {
                    crc: found.crc,
                    from: found.from,
                    from_sub,
                    cells_log2,
                    sub,
                    opens,
                }
            }
        };
        self.entries.push(Entry { volume: found.volume, block: found.block, kind });
    }

    /// The entries and data block count to commit; open slots are written into `data`.
    fn take(&mut self) -> (Vec<Entry>, usize) {
        self.packs.finish_all(&mut self.data);
        let entries = std::mem::replace(&mut self.entries, Vec::with_capacity(BATCH_ENTRIES_MAX));
        (entries, std::mem::take(&mut self.data_blocks))
    }
}

/// A layer table as checkpoint records, in a stable order.
pub(super) fn layer_records(table: &LayerTable) -> Vec<LayerRecordEntry> {
    let mut records: Vec<LayerRecordEntry> = Vec::new();
    let mut layers: Vec<_> = table.layers.values().copied().collect();
    layers.sort_by_key(|layer| layer.label);
    records.extend(layers.into_iter().map(|layer| LayerRecordEntry::Layer {
        label: layer.label,
        parent: layer.parent,
        bound: layer.bound,
        frozen: layer.frozen,
    }));
    let mut bindings: Vec<_> = table.bindings.iter().map(|(id, label)| (*id, *label)).collect();
    bindings.sort_unstable();
    records.extend(bindings.into_iter().map(|(id, label)| LayerRecordEntry::Binding { id, label }));
    let mut aliases: Vec<_> = table.aliases.iter().map(|(from, to)| (*from, *to)).collect();
    aliases.sort_unstable();
    records.extend(aliases.into_iter().map(|(from, to)| LayerRecordEntry::Alias { from, to }));
    records.push(LayerRecordEntry::NextLabel { label: table.next_label });
    records
}

/// The layer table checkpoint records describe.
pub(super) fn layer_table(records: &[LayerRecordEntry]) -> LayerTable {
    let mut table = LayerTable::default();
    for record in records {
        match *record {
            LayerRecordEntry::Layer { label, parent, bound, frozen } => {
                table
                    .layers
                    .insert(label, super::index::LayerRecord { label, parent, bound, frozen });
            }
            LayerRecordEntry::Binding { id, label } => {
                table.bindings.insert(id, label);
            }
            LayerRecordEntry::Alias { from, to } => {
                table.aliases.insert(from, to);
            }
            LayerRecordEntry::NextLabel { label } => table.next_label = label,
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::sync::Arc;

    use types::AlignedBuf;

    use super::GcOutcome;
    use crate::format::{NodeUuid, HEADER_REGION_BYTES};
    use crate::join::{join_all, LocalFuture};
    use crate::latches::DriveLatches;
    use crate::log::format::{BLOCK_BYTES, LOG_HEADER_BYTES};
    use crate::log::{LogConfig, LogEngine, LogHandle};
    use crate::testing::{block_on, fill_block, Rng, SimDrive};
    use crate::volumes::{VolumeId, VolumeMap, Volumes};

    const BLOCK: u64 = BLOCK_BYTES as u64;
    const DRIVES: u16 = 2;
    const SEGMENTS: u64 = 96;

    #[test]
    fn live_runs_read_through_short_gaps_only() {
        let live = |slots: &[u32]| -> Vec<super::LiveBlock> {
            slots
                .iter()
                .map(|&slot| super::LiveBlock {
                    volume: 1,
                    block: 0,
                    crc: 0,
                    from: 0,
                    slot,
                    packed: None,
                })
                .collect()
        };
        let gap = super::GC_READ_GAP_BLOCKS_MAX;
        assert_eq!(super::live_runs(&live(&[])), []);
        assert_eq!(super::live_runs(&live(&[5])), [(5, 1)]);
        // A gap of GC_READ_GAP_BLOCKS_MAX dead blocks is read through; one more splits.
        assert_eq!(super::live_runs(&live(&[2, 3 + gap])), [(2, 2 + gap)]);
        assert_eq!(super::live_runs(&live(&[2, 4 + gap])), [(2, 1), (4 + gap, 1)]);
        // Pack slots shared by several blocks, named out of order.
        assert_eq!(super::live_runs(&live(&[40, 7, 40, 7, 8])), [(7, 2), (40, 1)]);
    }
    const GC_STEPS: usize = 8;

    /// A log of [`SEGMENTS`] small segments over [`DRIVES`] simulated drives (`uuid_byte` names
    /// the node, `seed` seeds the drives, each operation yields up to `yields_max` times) with
    /// one volume of 85% of its capacity: the engine, its handle, the volume and its blocks.
    fn log_with_volume(
        uuid_byte: u8,
        seed: u64,
        yields_max: u64,
    ) -> (Arc<LogEngine>, LogHandle<SimDrive>, Arc<VolumeMap>, u64) {
        let config = LogConfig {
            unit_bytes: 64 << 10,
            handles_max: 2,
            checkpoint_interval_segments: 4,
            ..LogConfig::new(NodeUuid([uuid_byte; 16]))
        };
        let size_bytes = HEADER_REGION_BYTES + LOG_HEADER_BYTES + SEGMENTS * config.unit_bytes;
        let drives: Vec<SimDrive> = (0..DRIVES)
            .map(|index| SimDrive::new(index, size_bytes, seed + u64::from(index), yields_max))
            .collect();
        block_on(LogEngine::format(&drives, &config)).unwrap();
        let latches = Arc::new(DriveLatches::new(DRIVES));
        let (engine, handle, _) = block_on(LogEngine::open(drives, config, latches)).unwrap();
        let fill = engine.capacity_blocks() * 85 / 100;
        let volumes = Volumes::new();
        volumes.publish(volumes.reserve_create(VolumeId(1), fill * BLOCK).unwrap());
        let map = volumes.mapping(VolumeId(1)).unwrap();
        (engine, handle, map, fill)
    }

    /// `count` blocks of `volume` from block `first`, each filled as `fill_block` fills it with
    /// `tag`.
    fn tagged_blocks(volume: VolumeId, first: u64, count: u64, tag: u64) -> AlignedBuf {
        let mut buf = AlignedBuf::new((count * BLOCK) as usize);
        for (number, block) in (first..).zip(buf.chunks_mut(BLOCK_BYTES)) {
            fill_block(block, volume, number, tag);
        }
        buf
    }

    /// Yields an observer of an urgent tick takes at most (far more than the tick needs).
    const OBSERVER_YIELDS_MAX: usize = 10_000_000;

    /// An urgent background tick cleans victims in [`super::GC_LANES_URGENT`] lanes at once (a
    /// clean waits mostly on reads, so one lane at a time fell behind host writes), and every
    /// block reads back as last written.
    #[test]
    fn urgent_ticks_clean_victims_in_lanes_at_once() {
        use crate::log::segments::SegmentState;
        use crate::testing::block_matches;
        use std::cell::Cell;

        let (engine, handle, map, fill) = log_with_volume(9, 29, 4);
        let mut tags = vec![0u64; fill as usize];
        let mut next_tag = 0;
        let mut write = |first: u64, count: u64| {
            next_tag += 1;
            let buf = tagged_blocks(map.volume(), first, count, next_tag);
            tags[first as usize..(first + count) as usize].fill(next_tag);
            block_on(handle.write_blocks(&map, first * BLOCK, &buf)).unwrap();
        };
        for first in (0..fill).step_by(16) {
            write(first, 16.min(fill - first));
        }
        // Overwrite until host writes have had to clean: free space sits at the reserve.
        let mut rng = Rng::new(5);
        while engine.stats().gc_segments_cleaned < 20 {
            write(rng.below(fill), 1);
        }
        let before = engine.stats();
        // No background GC ran yet: host writes cleaned every victim themselves.
        assert_eq!(before.gc_segments_cleaned_inline, before.gc_segments_cleaned);
        let done = Cell::new(false);
        let most_cleaning = Cell::new(0usize);
        let tick: LocalFuture<'_, ()> = Box::pin(async {
            handle.gc_tick().await.unwrap();
            done.set(true);
        });
        let observer: LocalFuture<'_, ()> = Box::pin(async {
            for _ in 0..OBSERVER_YIELDS_MAX {
                if done.get() {
                    return;
                }
                let cleaning = (0..engine.geometry().segment_count)
                    .filter(|&segment| engine.segments.state(segment) == SegmentState::Cleaning)
                    .count();
                most_cleaning.set(most_cleaning.get().max(cleaning));
                crate::join::yield_now().await;
            }
            panic!("the urgent tick did not end");
        });
        block_on(join_all(vec![tick, observer]));
        let after = engine.stats();
        assert!(after.gc_segments_cleaned > before.gc_segments_cleaned + 1);
        assert_eq!(after.gc_segments_cleaned_inline, before.gc_segments_cleaned_inline);
        let most = most_cleaning.get();
        assert!(
            (2..=super::GC_LANES_URGENT).contains(&most),
            "{most} victims at most were being cleaned at once during an urgent tick"
        );
        for (number, &tag) in (0u64..).zip(&tags) {
            let (result, buf) =
                block_on(handle.read_blocks(&map, number * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
            result.unwrap();
            assert!(block_matches(&buf, map.volume(), number, tag), "block {number}");
        }
    }

    /// A background loop of GC steps on a thread whose free space is at the reserve lets that
    /// thread's host writes commit between steps, instead of holding its pipeline until the
    /// loop ends (which stalled host I/O for over 30 s at 90% fill in scripts/bench-wa.sh).
    #[test]
    fn background_gc_steps_let_host_writes_through() {
        let (engine, handle, map, fill) = log_with_volume(7, 17, 1);
        let mut tag = 0;
        let mut write = |first: u64, count: u64| {
            tag += 1;
            let buf = tagged_blocks(map.volume(), first, count, tag);
            let map = Arc::clone(&map);
            let handle = &handle;
            async move { handle.write_blocks(&map, first * BLOCK, &buf).await }
        };
        for first in (0..fill).step_by(16) {
            block_on(write(first, 16.min(fill - first))).unwrap();
        }
        // Overwrite until host writes have had to clean: free space now sits at the reserve.
        let mut rng = Rng::new(3);
        while engine.stats().gc_segments_cleaned < 20 {
            block_on(write(rng.below(fill), 1)).unwrap();
        }
        let events = RefCell::new(String::new());
        let background: LocalFuture<'_, ()> = Box::pin(async {
            for _ in 0..GC_STEPS {
                let outcome = handle.gc_step().await.unwrap();
                let event = if matches!(outcome, GcOutcome::Cleaned { .. }) { 'G' } else { 'i' };
                events.borrow_mut().push(event);
            }
        });
        let host_write = write(0, 1);
        let host: LocalFuture<'_, ()> = Box::pin(async {
            host_write.await.unwrap();
            events.borrow_mut().push('W');
        });
        block_on(join_all(vec![background, host]));
        let events = events.into_inner();
        let written_at = events.find('W').unwrap();
        assert!(
            events[written_at..].contains('G'),
            "the host write waited for the whole GC loop (G cleaned, i idle, W written): {events}"
        );
    }
}
