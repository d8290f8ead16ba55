//! Laying out free segments ahead of the log.
//!
//! On a drive that is a sparse file (the drive files `ferrite up` creates), the first write to
//! any part of a segment makes the filesystem allocate its blocks, and a durable write there
//! (O_DSYNC) waits for the filesystem to make that allocation durable as well: on ext4, a worker
//! thread converts the extent and writes its metadata (with a journal: commits the journal) for
//! every batch the log writes into fresh space. Measured on three replicating nodes (docs/BENCHMARKS.md, session 16), that
//! work took about a fifth of the machine's CPU while the log's first pass over its drives
//! lasted.
//!
//! So a background task ([`LogHandle::lay_out_step`], on thread 0) keeps the next
//! [`LAY_OUT_AHEAD_SEGMENTS`] segments allocation will hand out laid out: it withholds one of
//! them from allocation, has every drive in turn fill the holes of its unit of the segment with
//! zeros (`Drive::fill_holes`: one write in flight at a time, one sync per drive), and gives it
//! back marked laid out.
//! A log's own writes then only overwrite allocated blocks. Each segment is laid out once: a
//! segment is never punched after the log is formatted, so the marks (in RAM) stay true; after
//! a restart the task finds the segments it looks at laid out already at the cost of a seek
//! per drive.
//!
//! Safe because the segment is free and withheld: no live block is in it, no write can start
//! there while its holes are filled (allocation skips it), and filling a hole with zeros does
//! not change what it reads as, so a crash at any point leaves what recovery would have found
//! without it. Devices have no holes, and memory drives took their RAM when opened: for those
//! `fill_holes` does nothing. Nothing is laid out while a drive is latched failed or being
//! rebuilt (a rebuild writes into segments of its own accord), nor while free segments are
//! scarce.

use super::engine::LogHandle;
use super::LogError;
use crate::drive::Drive;

/// How many of the segments allocation hands out next are kept laid out: enough for the log to
/// fill them at full speed while the task, woken every background tick, lays out the next.
pub const LAY_OUT_AHEAD_SEGMENTS: usize = 3;

impl<D: Drive> LogHandle<D> {
    /// Lays out the first of the next [`LAY_OUT_AHEAD_SEGMENTS`] segments allocation will hand
    /// out that is not known to be laid out: every drive in turn fills the holes of its unit of
    /// that segment. Returns the bytes written (0 if the segment had no holes), or
    /// `None` with nothing to do now. A drive that fails to lay out is not latched (nothing the
    /// log holds was written): the segment stays marked not laid out and the error is returned,
    /// so the caller can say so and try again later; a write of the log that then fails there
    /// latches the drive as always.
    pub async fn lay_out_step(&self) -> Result<Option<u64>, LogError> {
        let engine = &**self.engine();
        let latches = engine.latches();
        if latches.failed_count() > 0 || latches.rebuilding_drive().is_some() {
            return Ok(None);
        }
        // Keep what host writes and checkpoints may take, and one more, always allocatable.
        let keep_free = engine.reserve_segments + engine.checkpoint_segments_max + 1;
        let Some(segment) = engine.segments.begin_lay_out(LAY_OUT_AHEAD_SEGMENTS, keep_free) else {
            return Ok(None);
        };
        let geometry = engine.geometry();
        let offset_bytes = geometry.row_offset_bytes(segment, 0);
        let length_bytes = geometry.unit_bytes();
        // One drive after the other: a background job, it keeps one write in flight so the
        // log's own writes to the same drives never queue long behind it.
        let mut written = 0;
        let mut failure = None;
        for drive in 0..geometry.drive_count {
            match self.drive(drive).fill_holes(offset_bytes, length_bytes).await {
                Ok(bytes) => written += bytes,
                Err(source) => {
                    failure = Some(LogError::Io { drive, source });
                    break;
                }
            }
        }
        engine.segments.end_lay_out(segment, failure.is_none());
        match failure {
            Some(error) => Err(error),
            None => {
                engine.note_laid_out(written);
                Ok(Some(written))
            }
        }
    }
}
