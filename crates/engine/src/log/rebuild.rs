//! Drive replacement and rebuild on a coded log (issue 5).
//!
//! [`LogHandle::begin_replace`] puts a new drive in a failed (or retiring) drive's place: it
//! writes the new drive's log superblock marked "rebuilding", bumps the drive's generation so
//! every handle reopens its handle of it, and makes the drive *rebuilding*: from then on every
//! batch writes its cells there like on a healthy drive, while reads take the drive's cells only
//! from segments already restored (others are rebuilt from parity on the fly).
//! [`LogHandle::rebuild_step`] then restores, a bounded amount per call, each segment's cells of
//! that drive from the other drives. When every segment is done it rewrites the superblock
//! without the mark: the drive is healthy. A crash before that leaves the mark, and the next open
//! starts the rebuild again (`recovery`).
//!
//! Why no stale cell is ever written over a valid one:
//! - a segment is *pinned* while the rebuild copies it, so it cannot be freed and reallocated
//!   (and written afresh) underneath the copy;
//! - a segment allocated after the rebuild began is written whole and skipped;
//! - of an open segment, only stripes below its completed-write mark are copied; later ones are
//!   written with the new drive, except by writes that began before the switch and skipped the
//!   drive as failed: those record their stripes (`rebuild_later`), and the rebuild copies them
//!   and does not finish while such a write is still in flight.

use std::sync::atomic::Ordering;

use types::AlignedBuf;

use super::engine::{LogEngine, LogHandle};
use super::format::{LogSuperblock, BLOCK_BYTES, SUPERBLOCK_BLOCK};
use super::segments::SegmentState;
use super::LogError;
use crate::drive::Drive;

/// Stripe runs a rebuild remembers for writes that skipped its drive; beyond this it makes
/// another pass over every segment instead.
pub const REBUILD_BACKLOG_MAX: usize = 4096;

/// A drive rebuild in progress.
#[derive(Debug)]
pub(super) struct RebuildState {
    pub drive: u16,
    /// The next segment to restore, and the next stripe in it.
    pub segment: u32,
    pub stripe: u32,
    pub segments_done: u32,
    pub bytes_written: u64,
    /// Stripe runs (segment, first stripe, stripes) written while the drive was skipped.
    pub backlog: Vec<(u32, u32, u32)>,
    /// The backlog overflowed: pass over every segment again.
    pub overflowed: bool,
}

impl RebuildState {
    /// A rebuild of `drive` from its first segment.
    fn new(drive: u16) -> Self {
        Self {
            drive,
            segment: 0,
            stripe: 0,
            segments_done: 0,
            bytes_written: 0,
            backlog: Vec::new(),
            overflowed: false,
        }
    }
}

/// Where a drive rebuild stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RebuildProgress {
    pub drive: u16,
    /// Segments examined (restored or found not to need it) of the node's total.
    pub segments_done: u32,
    pub segments_total: u32,
    pub bytes_written: u64,
    /// The drive is healthy again.
    pub finished: bool,
}

impl LogEngine {
    fn is_durable_checkpoint_segment(&self, segment: u32) -> bool {
        let record = self.checkpoint.lock().unwrap_or_else(|e| e.into_inner());
        record.segments.contains(&segment)
    }

    /// Where the rebuild in progress stands, if one is.
    pub fn rebuild_progress(&self) -> Option<RebuildProgress> {
        let state = self.rebuild.lock().unwrap_or_else(|e| e.into_inner());
        state.as_ref().map(|state| self.progress_of(state, false))
    }

    fn progress_of(&self, state: &RebuildState, finished: bool) -> RebuildProgress {
        RebuildProgress {
            drive: state.drive,
            segments_done: state.segments_done.min(self.geometry.segment_count),
            segments_total: self.geometry.segment_count,
            bytes_written: state.bytes_written,
            finished,
        }
    }

    /// A write skipped a drive as failed that is now being rebuilt: remember its stripes.
    pub(super) fn rebuild_later(&self, segment: u32, stripe_first: u32, stripes: u32) {
        let mut state = self.rebuild.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = state.as_mut() else { return };
        if state.backlog.len() < REBUILD_BACKLOG_MAX {
            state.backlog.push((segment, stripe_first, stripes));
        } else {
            state.overflowed = true;
        }
    }

    /// Recovery found drive `drive`'s superblock marked rebuilding: start its rebuild over.
    pub(super) fn resume_rebuild(&self, drive: u16) {
        self.segments.clear_rebuilt();
        *self.rebuild.lock().unwrap_or_else(|e| e.into_inner()) = Some(RebuildState::new(drive));
        self.latches.start_rebuild(drive);
    }
}

/// Unpins the segment a rebuild step (or a scrub repair) holds when it ends, however it ends.
pub(super) struct Pin<'a> {
    pub engine: &'a LogEngine,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        self.engine.segments.unpin();
    }
}

impl<D: Drive> LogHandle<D> {
    /// Puts `new` in drive `drive`'s place and starts rebuilding it (see the module comment).
    /// The drive may be latched failed, or healthy (retired while the others cover it). Every
    /// other handle must have [`LogHandle::set_reopen`] so it can open the new drive itself.
    pub async fn begin_replace(&self, drive: u16, new: D) -> Result<(), LogError> {
        let engine = &*self.engine;
        let geometry = engine.geometry;
        let refuse = |reason: String| Err(LogError::ReplaceRefused { drive, reason });
        if !geometry.is_coded() {
            return refuse(
                "this node's log has no parity, so a lost drive's data cannot be rebuilt; \
                 restore the node from a replica or a backup"
                    .to_owned(),
            );
        }
        if drive >= geometry.drive_count {
            return refuse(format!("the node has drives 0 to {}", geometry.drive_count - 1));
        }
        if let Some(rebuilding) = engine.latches.rebuilding_drive() {
            return refuse(format!(
                "drive {rebuilding} is being rebuilt; replace one drive at a time"
            ));
        }
        let others: Vec<u16> =
            engine.latches.failed_drives().into_iter().filter(|other| *other != drive).collect();
        if others.len() + 1 > usize::from(geometry.parity_shards) {
            return refuse(format!(
                "drives {others:?} are failed too; with {} parity shards taking drive {drive} out \
                 as well would leave stripes without enough cells",
                geometry.parity_shards
            ));
        }
        if new.size_bytes()
            < geometry.row_offset_bytes(geometry.segment_count - 1, 0) + geometry.unit_bytes()
        {
            return refuse(format!(
                "the new drive holds {} bytes, less than the node's geometry needs",
                new.size_bytes()
            ));
        }
        let superblock = LogSuperblock {
            node_uuid: engine.config.node_uuid,
            drive_index: drive,
            geometry,
            rebuilding: true,
        };
        write_superblock(&new, drive, &superblock).await?;
        // Stop using the old drive before the new one takes its place.
        engine.latches.latch(drive);
        engine.segments.clear_rebuilt();
        *engine.rebuild.lock().unwrap_or_else(|e| e.into_inner()) = Some(RebuildState::new(drive));
        // A handle that sees the drive no longer failed must also see the new generation.
        engine.bump_drive_generation(drive);
        self.install_drive(drive, new);
        engine.latches.start_rebuild(drive);
        Ok(())
    }

    /// Restores about `budget_bytes` of the drive being rebuilt (at least one stripe run), and
    /// finishes the rebuild when nothing is left. `Ok(None)` when no rebuild is running. A write
    /// error on the new drive latches it and ends the rebuild with that error.
    pub async fn rebuild_step(
        &self,
        budget_bytes: u64,
    ) -> Result<Option<RebuildProgress>, LogError> {
        let engine = &*self.engine;
        let geometry = engine.geometry;
        let (drive, segment, stripe, backlog) = {
            let mut state = engine.rebuild.lock().unwrap_or_else(|e| e.into_inner());
            let Some(state) = state.as_mut() else { return Ok(None) };
            (state.drive, state.segment, state.stripe, state.backlog.pop())
        };
        if engine.latches.is_failed(drive) {
            engine.latches.finish_rebuild(drive);
            engine.rebuild.lock().unwrap_or_else(|e| e.into_inner()).take();
            return Err(LogError::DriveFailed { drive });
        }
        let width = geometry.stripe_width();
        let drives = u32::from(geometry.drive_count);
        // Stripes per step: the drive holds about w / drives of a stripe run's cells.
        let budget_stripes = (budget_bytes / BLOCK_BYTES as u64 * u64::from(drives)
            / u64::from(width))
        .clamp(1, u64::from(REBUILD_STRIPES_PER_CALL_MAX)) as u32;
        if let Some((backlog_segment, first, stripes)) = backlog {
            let bytes = self.rebuild_stripes(backlog_segment, first, stripes, drive).await?;
            self.note_rebuilt(bytes, None);
            return Ok(engine.rebuild_progress());
        }
        if segment < geometry.segment_count {
            if !engine.segments.try_pin(segment) {
                // A scrub repair holds the pin for a moment: try again next step.
                return Ok(engine.rebuild_progress());
            }
            let _pin = Pin { engine };
            let state = engine.segments.state(segment);
            let end = match state {
                _ if engine.segments.is_rebuilt(segment) => 0,
                SegmentState::Free => 0,
                // The durable checkpoint's segments are complete.
                SegmentState::Checkpoint if engine.is_durable_checkpoint_segment(segment) => {
                    geometry.stripes_per_segment()
                }
                // Being written (open, or a checkpoint in progress): only completed stripes.
                SegmentState::Open | SegmentState::Checkpoint => {
                    engine.segments.written(segment) / u32::from(geometry.data_shards)
                }
                SegmentState::Sealed | SegmentState::Cleaning => geometry.stripes_per_segment(),
            };
            let stripes = end.saturating_sub(stripe).min(budget_stripes);
            let mut bytes = 0;
            if stripes > 0 {
                bytes = self.rebuild_stripes(segment, stripe, stripes, drive).await?;
            }
            let next = stripe + stripes;
            if next >= end {
                if bytes > 0 || stripe > 0 {
                    self.sync_rebuilt(drive).await?;
                }
                engine.segments.set_rebuilt(segment, true);
                self.note_rebuilt(bytes, Some((segment + 1, 0)));
            } else {
                self.note_rebuilt(bytes, Some((segment, next)));
            }
            return Ok(engine.rebuild_progress());
        }
        {
            let mut state = engine.rebuild.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(state) = state.as_mut() {
                if state.overflowed {
                    state.overflowed = false;
                    state.segment = 0;
                    state.stripe = 0;
                    state.segments_done = 0;
                    engine.segments.clear_rebuilt();
                    return Ok(Some(engine.progress_of(state, false)));
                }
                if !state.backlog.is_empty()
                    || engine.counters.skipping_writes.load(Ordering::Acquire) > 0
                {
                    return Ok(Some(engine.progress_of(state, false)));
                }
            }
        }
        // Every cell is restored: make it durable, then drop the mark.
        self.sync_rebuilt(drive).await?;
        let superblock = LogSuperblock {
            node_uuid: engine.config.node_uuid,
            drive_index: drive,
            geometry,
            rebuilding: false,
        };
        write_superblock(&*self.drive(drive), drive, &superblock).await.inspect_err(|_| {
            engine.latches.latch(drive);
        })?;
        let mut state = engine.rebuild.lock().unwrap_or_else(|e| e.into_inner());
        let finished = state.take().map(|state| engine.progress_of(&state, true));
        engine.latches.finish_rebuild(drive);
        Ok(finished)
    }

    /// Syncs the drive being rebuilt; a failure latches it.
    async fn sync_rebuilt(&self, drive: u16) -> Result<(), LogError> {
        self.engine.counters.drive_syncs.fetch_add(1, Ordering::Relaxed);
        self.drive(drive).sync().await.map_err(|source| {
            self.engine.latches.latch(drive);
            LogError::Io { drive, source }
        })
    }

    fn note_rebuilt(&self, bytes: u64, cursor: Option<(u32, u32)>) {
        let engine = &*self.engine;
        let mut state = engine.rebuild.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = state.as_mut() else { return };
        state.bytes_written += bytes;
        if let Some((segment, stripe)) = cursor {
            if segment != state.segment {
                state.segments_done += 1;
            }
            state.segment = segment;
            state.stripe = stripe;
        }
    }
}

/// Stripes one rebuild step restores at most (bounds its buffers).
pub const REBUILD_STRIPES_PER_CALL_MAX: u32 = 256;

async fn write_superblock<D: Drive>(
    drive: &D,
    index: u16,
    superblock: &LogSuperblock,
) -> Result<(), LogError> {
    let geometry = superblock.geometry;
    let mut buf = AlignedBuf::new(BLOCK_BYTES);
    buf.copy_from_slice(&superblock.encode());
    let (result, _) = drive.write_at(geometry.header_offset_bytes(SUPERBLOCK_BLOCK), buf).await;
    result.map_err(|source| LogError::Io { drive: index, source })?;
    drive.sync().await.map_err(|source| LogError::Io { drive: index, source })
}
