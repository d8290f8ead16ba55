//! Read-triggered defragmentation: a multi-block host read whose blocks lie scattered over the
//! log (random small writes put each block of a range in a different batch) queues a rewrite of
//! the range, and the handle's defragmenter task appends the blocks back to back, so the next
//! read of the range is one drive read instead of one per block. NetApp's WAFL calls this read
//! reallocation.
//!
//! The rewrite reuses the data the read returned (no second read) and GC's entry kind:
//! `Relocated { from }`, installed with a compare-and-swap against the location the read
//! found, so a host write, trim or GC move that landed meanwhile wins and the copy is only
//! dead space. Recovery replays it the same way. The entries join the handle's host batches
//! (group commit, O_DSYNC, pipelined) and count as written bytes no host wrote, so the write
//! amplification figure includes them.
//!
//! The defragmenter takes every range queued at once and appends them all before it waits, so
//! one group commit carries many ranges and it keeps up with the reads that queue them.
//!
//! Bounded: at most [`DEFRAG_QUEUED_BLOCKS_MAX`] blocks in ranges of at most
//! [`DEFRAG_BLOCKS_MAX`] wait per handle (a read finding no room queues nothing); nothing is
//! queued or rewritten while free space is below the threshold at which background GC works
//! (GC is behind the writes), so defragmentation never takes the space host writes need; at
//! the threshold, where GC holds a wrapped log, it goes on. Only ranges whose blocks are all
//! stored raw (not compressed) in the volume's own layer (not a snapshot's under it) are
//! rewritten, on logs without parity.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use types::AlignedBuf;

use super::engine::{BatchCell, LogHandle};
use super::format::{Entry, EntryKind, BLOCK_BYTES};
use super::index::{raw_tag, unpack, Tag, VolumeIndex};
use crate::compress::Compression;
use crate::drive::Drive;

/// Blocks of scattered ranges a handle keeps waiting for their rewrite (4 MiB of copies); a
/// read that finds no room queues nothing (defragmentation is best effort).
pub const DEFRAG_QUEUED_BLOCKS_MAX: usize = 1024;
/// The longest range (blocks) a read queues for a rewrite: 256 KiB.
pub const DEFRAG_BLOCKS_MAX: usize = 64;
/// A range a read found scattered: the layer read, its first block, the index entries as read
/// and the data (verified against them).
pub(super) struct DefragJob {
    index: Arc<VolumeIndex>,
    first: u64,
    entries: Vec<u64>,
    data: AlignedBuf,
}

impl<D: Drive> LogHandle<D> {
    /// Whether free space allows defragmentation: background GC keeps up, that is free
    /// segments are not below the threshold at which it works (the reserve plus its headroom).
    /// Once the log has wrapped, GC holds free space at that threshold for good, so a rule that
    /// waited for more would never rewrite a range again on a node in steady state (none in a
    /// whole `make compare-ceph` run after its 4K writes, docs/BENCHMARKS.md). Below it the
    /// space is the host writes'; the reserve is never spent either way.
    fn defrag_has_space(&self) -> bool {
        let engine = &*self.engine;
        engine.segments.free_count() >= engine.reserve_segments + self.gc_headroom_segments()
    }

    /// Called by a multi-block read that took `runs` drive reads for `entries` (blocks `first..`
    /// of `index`, all read and verified into `data`): queues a rewrite if the range is worth
    /// one and may be rewritten.
    pub(super) fn note_read(
        &self,
        index: &Arc<VolumeIndex>,
        first: u64,
        entries: &[u64],
        runs: usize,
        data: &[u8],
    ) {
        if runs < 2
            || entries.len() > DEFRAG_BLOCKS_MAX
            || !self.engine.read_defrag.load(Ordering::Relaxed)
            || self.defrag_queued_blocks.get() + entries.len() > DEFRAG_QUEUED_BLOCKS_MAX
            || index.is_frozen()
            || self.engine.geometry.is_coded()
        {
            return;
        }
        let mut consecutive = true;
        for (slot, &entry) in entries.iter().enumerate() {
            let Some((location, tag)) = unpack(entry) else { return };
            if !matches!(Tag::of(tag), Tag::Raw { .. }) || index.get(first + slot as u64) != entry {
                return;
            }
            if slot > 0 {
                let previous = unpack(entries[slot - 1]).map(|(location, _)| location);
                consecutive &= previous.is_some_and(|previous| previous + 1 == location);
            }
        }
        // Stored in order already, only across a drive or segment boundary: a rewrite could
        // land across one too.
        if consecutive || !self.defrag_has_space() {
            return;
        }
        debug_assert_eq!(data.len(), entries.len() * BLOCK_BYTES);
        let mut copy = self.buffers.take(data.len());
        copy.copy_from_slice(data);
        let job =
            DefragJob { index: Arc::clone(index), first, entries: entries.to_vec(), data: copy };
        self.defrag_queued_blocks.set(self.defrag_queued_blocks.get() + entries.len());
        self.defrag.borrow_mut().push_back(job);
        self.defrag_ready.notify_all();
    }

    /// The handle's defragmenter: rewrites the ranges reads queue, for as long as it runs.
    /// The caller spawns it on the handle's thread beside the host I/O (the node does on every
    /// data-path thread) and drops it to stop. Each block of a range it was rewriting then
    /// stays at its old place or is at its new one (its own compare-and-swap): a range may be
    /// left partly moved, which only leaves it partly scattered.
    /// [`LogEngine::set_read_defrag`](super::LogEngine::set_read_defrag) turns the queueing on.
    pub async fn defragmenter(&self) {
        loop {
            if self.defrag_step().await.is_none() {
                self.defrag_ready.notified().await;
            }
        }
    }

    /// Rewrites every range queued now, all appended before waiting (one group commit carries
    /// many): the blocks moved back to back (none of a range that changed since it was read,
    /// or while space is short), or `None` with nothing queued. A failed rewrite counts 0: its
    /// drive is latched and reported as after any failed write, and the blocks stay where they
    /// were.
    pub async fn defrag_step(&self) -> Option<u64> {
        let jobs: Vec<DefragJob> = self.defrag.borrow_mut().drain(..).collect();
        if jobs.is_empty() {
            return None;
        }
        self.defrag_queued_blocks.set(0);
        let mut cells: Vec<Rc<BatchCell>> = Vec::new();
        let mut appended = Vec::with_capacity(jobs.len());
        for job in jobs {
            if self.append(&job, &mut cells).await {
                appended.push(job);
            } else {
                self.buffers.give(job.data);
            }
        }
        let durable = self.wait_all(&cells).await.is_ok();
        let mut moved = 0;
        for DefragJob { index, first, entries, data } in appended {
            // Installed unless a compare-and-swap lost: count the blocks no longer where the
            // read found them (moved here, or overwritten since: not scattered there anyway).
            if durable {
                moved += entries
                    .iter()
                    .enumerate()
                    .filter(|&(slot, &entry)| index.get(first + slot as u64) != entry)
                    .count() as u64;
            }
            self.buffers.give(data);
        }
        self.engine.counters.defrag_relocated_blocks.fetch_add(moved, Ordering::Relaxed);
        Some(moved)
    }

    /// Appends one queued range back to back as `Relocated` entries (their batches go into
    /// `cells`); false if the range changed since it was read or space is short.
    async fn append(&self, job: &DefragJob, cells: &mut Vec<Rc<BatchCell>>) -> bool {
        let DefragJob { index, first, entries, data } = job;
        let first = *first;
        // Rewritten, trimmed or moved since the read: the range is no longer what was read.
        let unchanged = !index.is_removed()
            && entries
                .iter()
                .enumerate()
                .all(|(slot, &entry)| index.get(first + slot as u64) == entry);
        if !unchanged || !self.defrag_has_space() {
            return false;
        }
        let label = index.volume();
        let mut turn = self.turn();
        for (slot, block) in data.chunks(BLOCK_BYTES).enumerate() {
            let Some((from, _)) = unpack(entries[slot]) else {
                unreachable!("queued ranges hold mapped blocks only")
            };
            let crc = crc32c::crc32c(block);
            // The data was verified against the entry when read; its full CRC rebuilds the
            // exact entry the compare-and-swap expects.
            debug_assert_eq!(super::index::pack(from, raw_tag(crc)), entries[slot]);
            let entry = Entry {
                volume: label,
                block: first + slot as u64,
                kind: EntryKind::Relocated { crc, from },
            };
            let cell =
                self.enqueue(&mut turn, entry, Some(block), Compression::Off, false, 0).await;
            if cells.last().is_none_or(|last| !Rc::ptr_eq(last, &cell)) {
                cells.push(cell);
            }
        }
        true
    }
}
