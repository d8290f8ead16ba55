//! Erasure-coded I/O of a coded log (issue 5): a batch's positions are written as whole stripes
//! with their parity, and positions are read back with the cells of failed or unreadable drives
//! reconstructed from the rest of their stripes. Only `write_positions`, `read_positions` and
//! `read_location` of the engine call this; everything above them (group commit, GC,
//! checkpoints, recovery, scrub) sees positions and works unchanged on a degraded node.
//!
//! The layout is [`Geometry`](super::format::Geometry)'s: stripe `s` is cells `s*w..s*w + w`,
//! cell `c` is row `c / drives` of drive `c % drives`, so the cells of a run of stripes are one
//! contiguous run of rows on each drive.

use std::sync::atomic::Ordering;

use types::AlignedBuf;

use super::engine::{DriveSet, Failure, LocalFuture, LogEngine, LogHandle, RowsRead};
use super::format::BLOCK_BYTES;
use super::LogError;
use crate::drive::{Drive, DriveError};
use crate::erasure::{plan, ShardSet, STRIPE_DATA_BLOCKS_MAX};
use crate::join::join_all;

/// The padding of a batch's last stripe, and the stand-in for a data cell past a read's end.
static ZERO_BLOCK: [u8; BLOCK_BYTES] = [0; BLOCK_BYTES];

fn block(buf: &[u8], index: usize) -> &[u8] {
    &buf[index * BLOCK_BYTES..(index + 1) * BLOCK_BYTES]
}

fn block_mut(buf: &mut [u8], index: usize) -> &mut [u8] {
    &mut buf[index * BLOCK_BYTES..(index + 1) * BLOCK_BYTES]
}

impl<D: Drive> LogHandle<D> {
    /// The drives whose cells of `segment` cannot be read: those latched failed, and a drive
    /// being rebuilt whose rebuild has not restored this segment yet.
    pub(super) fn unreadable_drives(&self, segment: u32) -> DriveSet {
        let latches = &self.engine.latches;
        let mut drives = DriveSet::default();
        for drive in 0..self.engine.geometry.drive_count {
            if latches.is_failed(drive)
                || (latches.is_rebuilding(drive) && !self.engine.segments.is_rebuilt(segment))
            {
                drives.insert(drive);
            }
        }
        drives
    }

    /// True while the failed drives are no more than the parity covers (none without parity):
    /// writes, GC and checkpoints go on, degraded.
    pub(super) fn failures_tolerable(&self) -> bool {
        let failed = self.engine.latches.failed_count();
        failed == 0 || failed <= usize::from(self.engine.geometry.parity_shards)
    }

    /// Writes positions `first..first + count` of `segment` (`first` on a stripe boundary),
    /// padded with zero blocks to whole stripes, and their parity; block `i` is `block_of(i)`.
    /// Drives latched failed are skipped while the failures stay within the parity; a failed
    /// write latches its drive and fails the batch only if that takes the failures beyond it.
    pub(super) async fn write_stripes<'b>(
        &self,
        segment: u32,
        first: u32,
        count: u32,
        block_of: impl Fn(u32) -> &'b [u8],
    ) -> Result<DriveSet, Failure> {
        let geometry = &self.engine.geometry;
        let k = u32::from(geometry.data_shards);
        let width = geometry.stripe_width();
        let drives = u32::from(geometry.drive_count);
        assert!(first % k == 0, "batches start on a stripe boundary");
        let stripe_first = first / k;
        let stripes = geometry.padded(count) / k;
        let data_of = |stripe: u32, shard: u32| -> &[u8] {
            let position = stripe * k + shard;
            if position < count {
                block_of(position)
            } else {
                &ZERO_BLOCK
            }
        };
        let mut parity =
            self.buffers.take(usize::from(geometry.parity_shards) * stripes as usize * BLOCK_BYTES);
        self.compute_parity(stripes, &data_of, &mut parity);
        let mut touched = DriveSet::default();
        let mut writes: Vec<LocalFuture<'_, (u16, Result<(), DriveError>)>> = Vec::new();
        let mut cells_written = 0u64;
        let mut skipped = DriveSet::default();
        let cells = stripe_first * width..(stripe_first + stripes) * width;
        for (drive, first_row, rows) in geometry.cell_runs(cells.start, cells.end) {
            if self.engine.latches.is_failed(drive) {
                skipped.insert(drive);
                continue;
            }
            let mut buf = self.buffers.take(rows as usize * BLOCK_BYTES);
            for row in 0..rows {
                let cell = (first_row + row) * drives + u32::from(drive);
                let Some((stripe, shard)) = geometry.cell_shard(cell) else {
                    unreachable!("cell {cell} of a written stripe is in a stripe")
                };
                let at = stripe - stripe_first;
                let source = if shard < k {
                    data_of(at, shard)
                } else {
                    block(&parity, ((shard - k) * stripes + at) as usize)
                };
                block_mut(&mut buf, row as usize).copy_from_slice(source);
            }
            cells_written += u64::from(rows);
            touched.insert(drive);
            let offset_bytes = geometry.row_offset_bytes(segment, first_row);
            let target = self.drive(drive);
            writes.push(Box::pin(async move {
                let (result, buf) = target.write_at(offset_bytes, buf).await;
                self.buffers.give(buf);
                (drive, result)
            }));
        }
        self.buffers.give(parity);
        self.engine
            .counters
            .device_bytes_written
            .fetch_add(cells_written * BLOCK_BYTES as u64, Ordering::Relaxed);
        let _skipping = (!skipped.is_empty()).then(|| SkippingWrite::new(&self.engine));
        let (written, failure) = self.join_latching(writes).await;
        if !self.failures_tolerable() {
            let first_failed = self.engine.latches.failed_drives().first().copied().unwrap_or(0);
            return Err(failure.unwrap_or(Failure::DriveFailed(first_failed)));
        }
        debug_assert!(touched
            .iter()
            .all(|drive| written.contains(drive) || self.engine.latches.is_failed(drive)));
        self.engine.segments.note_written(segment, first + stripes * k);
        if skipped.iter().any(|drive| !self.engine.latches.is_failed(drive)) {
            // A drive skipped as failed was replaced meanwhile: its rebuild must copy these
            // stripes too (it may have passed this segment already).
            self.engine.rebuild_later(segment, stripe_first, stripes);
        }
        Ok(written)
    }

    /// Fills `parity` (parity shard `t` of stripe `i` at block `t * stripes + i`) for `stripes`
    /// stripes whose data shard `j` of stripe `i` is `data_of(i, j)`.
    fn compute_parity<'b>(
        &self,
        stripes: u32,
        data_of: &impl Fn(u32, u32) -> &'b [u8],
        parity: &mut [u8],
    ) {
        let geometry = &self.engine.geometry;
        let k = u32::from(geometry.data_shards);
        let m = u32::from(geometry.parity_shards);
        if m == 1 {
            // One parity shard is the XOR of the data shards (pinned by erasure's tests).
            for stripe in 0..stripes {
                let out = block_mut(parity, stripe as usize);
                out.copy_from_slice(data_of(stripe, 0));
                for shard in 1..k {
                    for (byte, data) in out.iter_mut().zip(data_of(stripe, shard)) {
                        *byte ^= data;
                    }
                }
            }
            return;
        }
        let group_max = STRIPE_DATA_BLOCKS_MAX / k;
        let mut done = 0;
        while done < stripes {
            let group = (stripes - done).min(group_max);
            let mut data = self.buffers.take((k * group) as usize * BLOCK_BYTES);
            for shard in 0..k {
                for at in 0..group {
                    block_mut(&mut data, (shard * group + at) as usize)
                        .copy_from_slice(data_of(done + at, shard));
                }
            }
            let mut out = self.buffers.take((m * group) as usize * BLOCK_BYTES);
            {
                let shard_bytes = group as usize * BLOCK_BYTES;
                let data_shards: Vec<&[u8]> = data.chunks(shard_bytes).collect();
                let mut parity_shards: Vec<&mut [u8]> = out.chunks_mut(shard_bytes).collect();
                let stripe_plan = plan(geometry.scheme(), k * group);
                self.erasure.borrow_mut().encode(&stripe_plan, &data_shards, &mut parity_shards);
            }
            for shard in 0..m {
                for at in 0..group {
                    block_mut(parity, (shard * stripes + done + at) as usize)
                        .copy_from_slice(block(&out, (shard * group + at) as usize));
                }
            }
            self.buffers.give(data);
            self.buffers.give(out);
            done += group;
        }
    }

    /// Reads positions `first..first + count` of `segment` into one buffer, in position order.
    /// Reads only the cells it needs while every drive answers; a cell on a drive that is
    /// latched failed, in `exclude`, or fails its read is reconstructed from its stripe.
    pub(super) async fn read_stripes(
        &self,
        segment: u32,
        first: u32,
        count: u32,
        exclude: DriveSet,
    ) -> Result<AlignedBuf, LogError> {
        self.read_stripes_counted(segment, first, count, exclude, true).await
    }

    /// [`LogHandle::read_stripes`]; `counted`: a read served by reconstruction counts in
    /// `reconstructed_reads` (a caller that only tries whether a rebuilt cell decodes, as
    /// [`LogHandle::rebuilt_header`] does, counts itself once it does).
    pub(super) async fn read_stripes_counted(
        &self,
        segment: u32,
        first: u32,
        count: u32,
        exclude: DriveSet,
        counted: bool,
    ) -> Result<AlignedBuf, LogError> {
        if count == 0 {
            return Ok(AlignedBuf::new(0));
        }
        let mut exclude = exclude;
        for drive in self.unreadable_drives(segment).iter() {
            exclude.insert(drive);
        }
        if exclude.is_empty() {
            match self.read_cells_direct(segment, first, count).await {
                Ok(out) => return Ok(out),
                Err(unreadable) => {
                    return self.read_degraded(segment, first, count, unreadable, counted).await
                }
            }
        }
        self.read_degraded(segment, first, count, exclude, counted).await
    }

    /// The fast path: per drive, one read of the rows from its first to its last needed cell.
    /// Fails with the drives whose reads failed.
    async fn read_cells_direct(
        &self,
        segment: u32,
        first: u32,
        count: u32,
    ) -> Result<AlignedBuf, DriveSet> {
        let geometry = &self.engine.geometry;
        let mut spans: Vec<Option<(u32, u32)>> = vec![None; usize::from(geometry.drive_count)];
        for position in first..first + count {
            let (drive, row) = geometry.drive_row(position);
            let span = &mut spans[usize::from(drive)];
            *span = Some(span.map_or((row, row), |(low, high)| (low.min(row), high.max(row))));
        }
        let mut reads: Vec<LocalFuture<'_, RowsRead>> = Vec::new();
        for (drive, span) in spans.iter().enumerate() {
            let Some((low, high)) = *span else { continue };
            let drive = drive as u16;
            let offset_bytes = geometry.row_offset_bytes(segment, low);
            let target = self.drive(drive);
            reads.push(Box::pin(async move {
                let buf = AlignedBuf::new((high - low + 1) as usize * BLOCK_BYTES);
                let (result, buf) = target.read_at(offset_bytes, buf).await;
                (drive, low, result, buf)
            }));
        }
        let mut bufs: Vec<Option<AlignedBuf>> = (0..geometry.drive_count).map(|_| None).collect();
        let mut unreadable = DriveSet::default();
        for (drive, low, result, buf) in join_all(reads).await {
            debug_assert_eq!(spans[usize::from(drive)].map(|span| span.0), Some(low));
            match result {
                Ok(()) => bufs[usize::from(drive)] = Some(buf),
                Err(_) => unreadable.insert(drive),
            }
        }
        if !unreadable.is_empty() {
            self.engine.counters.degraded_reads.fetch_add(1, Ordering::Relaxed);
            return Err(unreadable);
        }
        let mut out = AlignedBuf::new(count as usize * BLOCK_BYTES);
        for position in first..first + count {
            let (drive, row) = geometry.drive_row(position);
            let (Some(buf), Some((low, _))) =
                (&bufs[usize::from(drive)], spans[usize::from(drive)])
            else {
                unreachable!("every needed drive was read")
            };
            block_mut(&mut out, (position - first) as usize)
                .copy_from_slice(block(buf, (row - low) as usize));
        }
        Ok(out)
    }

    /// The degraded path: reads every cell of the stripes holding the positions from the drives
    /// that answer, and reconstructs the rest.
    async fn read_degraded(
        &self,
        segment: u32,
        first: u32,
        count: u32,
        exclude: DriveSet,
        counted: bool,
    ) -> Result<AlignedBuf, LogError> {
        let geometry = &self.engine.geometry;
        let k = u32::from(geometry.data_shards);
        let width = geometry.stripe_width();
        let stripe_first = first / k;
        let stripes = (first + count - 1) / k + 1 - stripe_first;
        let cells = self.read_stripe_cells(segment, stripe_first, stripes, exclude).await?;
        if counted {
            self.engine.counters.reconstructed_reads.fetch_add(1, Ordering::Relaxed);
        }
        let mut out = AlignedBuf::new(count as usize * BLOCK_BYTES);
        for position in first..first + count {
            let at = position / k - stripe_first;
            let shard = position % k;
            block_mut(&mut out, (position - first) as usize)
                .copy_from_slice(block(&cells, (at * width + shard) as usize));
        }
        Ok(out)
    }

    /// Every cell of stripes `stripe_first..stripe_first + stripes` of `segment`, stripe-major
    /// (stripe `i`'s shard `s` at block `i * w + s`), with every data shard the drives in
    /// `exclude` (and those that fail their reads) hold rebuilt from the rest. Parity cells of
    /// those drives are left as zeros. Fails when a stripe lost more than its parity.
    pub(super) async fn read_stripe_cells(
        &self,
        segment: u32,
        stripe_first: u32,
        stripes: u32,
        exclude: DriveSet,
    ) -> Result<AlignedBuf, LogError> {
        let geometry = &self.engine.geometry;
        let width = geometry.stripe_width();
        let drives = u32::from(geometry.drive_count);
        let mut cells = AlignedBuf::new((stripes * width) as usize * BLOCK_BYTES);
        cells.fill(0);
        let mut lost = vec![ShardSet::EMPTY; stripes as usize];
        let mut lost_drives = DriveSet::default();
        let mut reads: Vec<LocalFuture<'_, RowsRead>> = Vec::new();
        let cell_range = stripe_first * width..(stripe_first + stripes) * width;
        let runs: Vec<(u16, u32, u32)> =
            geometry.cell_runs(cell_range.start, cell_range.end).collect();
        for &(drive, first_row, rows) in &runs {
            if self.engine.latches.is_failed(drive) || exclude.contains(drive) {
                lost_drives.insert(drive);
                continue;
            }
            let offset_bytes = geometry.row_offset_bytes(segment, first_row);
            let target = self.drive(drive);
            reads.push(Box::pin(async move {
                let buf = AlignedBuf::new(rows as usize * BLOCK_BYTES);
                let (result, buf) = target.read_at(offset_bytes, buf).await;
                (drive, first_row, result, buf)
            }));
        }
        let mut read_error = None;
        for (drive, first_row, result, buf) in join_all(reads).await {
            if let Err(error) = result {
                lost_drives.insert(drive);
                read_error.get_or_insert(LogError::Io { drive, source: error });
                continue;
            }
            for (row, bytes) in buf.chunks(BLOCK_BYTES).enumerate() {
                let cell = (first_row + row as u32) * drives + u32::from(drive);
                let Some((stripe, shard)) = geometry.cell_shard(cell) else { continue };
                let at = stripe - stripe_first;
                block_mut(&mut cells, (at * width + shard) as usize).copy_from_slice(bytes);
            }
        }
        for &(drive, first_row, rows) in &runs {
            if !lost_drives.contains(drive) {
                continue;
            }
            for row in first_row..first_row + rows {
                let cell = row * drives + u32::from(drive);
                let Some((stripe, shard)) = geometry.cell_shard(cell) else { continue };
                let at = (stripe - stripe_first) as usize;
                lost[at] = lost[at].with(shard as u8);
            }
        }
        if self.reconstruct(&mut cells, &lost).is_err() {
            self.engine.counters.unrecoverable_reads.fetch_add(1, Ordering::Relaxed);
            let first_lost = lost_drives.iter().next().unwrap_or(0);
            return Err(read_error.unwrap_or(LogError::DriveFailed { drive: first_lost }));
        }
        Ok(cells)
    }

    /// Restores drive `drive`'s cells of stripes `stripe_first..stripe_first + stripes` of
    /// `segment` from the other drives (data rebuilt, parity recomputed) and writes them to it.
    /// Returns the bytes written.
    pub(super) async fn rebuild_stripes(
        &self,
        segment: u32,
        stripe_first: u32,
        stripes: u32,
        drive: u16,
    ) -> Result<u64, LogError> {
        let geometry = &self.engine.geometry;
        let k = u32::from(geometry.data_shards);
        let width = geometry.stripe_width();
        let drives = u32::from(geometry.drive_count);
        let mut exclude = DriveSet::default();
        exclude.insert(drive);
        let cells = self.read_stripe_cells(segment, stripe_first, stripes, exclude).await?;
        let data_of =
            |at: u32, shard: u32| -> &[u8] { block(&cells, (at * width + shard) as usize) };
        let mut parity =
            self.buffers.take(usize::from(geometry.parity_shards) * stripes as usize * BLOCK_BYTES);
        self.compute_parity(stripes, &data_of, &mut parity);
        let cell_range = stripe_first * width..(stripe_first + stripes) * width;
        let run = geometry.cell_runs(cell_range.start, cell_range.end).find(|run| run.0 == drive);
        let Some((_, first_row, rows)) = run else {
            self.buffers.give(parity);
            return Ok(0);
        };
        let mut buf = self.buffers.take(rows as usize * BLOCK_BYTES);
        for row in 0..rows {
            let cell = (first_row + row) * drives + u32::from(drive);
            let source = match geometry.cell_shard(cell) {
                Some((stripe, shard)) if shard < k => data_of(stripe - stripe_first, shard),
                Some((stripe, shard)) => {
                    block(&parity, ((shard - k) * stripes + stripe - stripe_first) as usize)
                }
                None => &ZERO_BLOCK,
            };
            block_mut(&mut buf, row as usize).copy_from_slice(source);
        }
        self.buffers.give(parity);
        let offset_bytes = geometry.row_offset_bytes(segment, first_row);
        let (result, buf) = self.drive(drive).write_at(offset_bytes, buf).await;
        self.buffers.give(buf);
        if let Err(source) = result {
            self.engine.latches.latch(drive);
            return Err(LogError::Io { drive, source });
        }
        let bytes = u64::from(rows) * BLOCK_BYTES as u64;
        self.engine.counters.device_bytes_written.fetch_add(bytes, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Coded logs: rebuilds position `position` of `segment` from the rest of its stripe and,
    /// if `check` accepts the rebuilt block, writes it back in place and syncs. The segment is
    /// pinned meanwhile and must still be sealed with sequence `seq`, so a reused segment is
    /// never written. True if the cell was repaired.
    pub(super) async fn repair_position(
        &self,
        segment: u32,
        seq: u64,
        position: u32,
        check: impl FnOnce(&[u8]) -> bool,
    ) -> bool {
        let engine = &*self.engine;
        if !engine.geometry.is_coded() || !engine.segments.try_pin(segment) {
            return false;
        }
        let _pin = super::rebuild::Pin { engine };
        if engine.segments.seq(segment) != seq
            || engine.segments.state(segment) != super::segments::SegmentState::Sealed
        {
            return false;
        }
        let (drive, offset_bytes) = engine.geometry.place(segment, position);
        let mut exclude = DriveSet::default();
        exclude.insert(drive);
        let Ok(rebuilt) = self.read_stripes(segment, position, 1, exclude).await else {
            return false;
        };
        if !check(&rebuilt) {
            return false;
        }
        self.write_cell(drive, offset_bytes, rebuilt).await
    }

    /// Writes one cell in place and syncs its drive; a failure latches the drive.
    pub(super) async fn write_cell(
        &self,
        drive: u16,
        offset_bytes: u64,
        bytes: AlignedBuf,
    ) -> bool {
        if self.engine.latches.is_failed(drive) {
            return false;
        }
        let target = self.drive(drive);
        let (result, _) = target.write_at(offset_bytes, bytes).await;
        let result = match result {
            Ok(()) => target.sync().await,
            Err(error) => Err(error),
        };
        self.engine.counters.device_bytes_written.fetch_add(BLOCK_BYTES as u64, Ordering::Relaxed);
        if result.is_err() {
            self.engine.latches.latch(drive);
            return false;
        }
        true
    }

    /// Coded logs: checks the parity of the stripes of the batch at `position` (of
    /// `positions` positions, padded) against its data and rewrites, in place, every parity
    /// cell that differs (the segment pinned, still sealed with sequence `seq`). Returns the
    /// stripes found wrong and how many of them were repaired.
    pub(super) async fn verify_parity(
        &self,
        segment: u32,
        seq: u64,
        position: u32,
        positions: u32,
    ) -> Result<(Vec<u32>, u32), LogError> {
        let engine = &*self.engine;
        let geometry = &engine.geometry;
        if !self.unreadable_drives(segment).is_empty() {
            // A drive's cells of this segment are not there to compare (latched failed, or
            // being rebuilt and not restored here yet: a new drive holds nothing of it). Parity
            // recomputed from them would be wrong, and written over the good parity on the
            // other drives it would make the missing cells impossible to rebuild.
            return Ok((Vec::new(), 0));
        }
        let k = u32::from(geometry.data_shards);
        let m = u32::from(geometry.parity_shards);
        let width = geometry.stripe_width();
        let stripe_first = position / k;
        let stripes = geometry.padded(positions) / k;
        let cells =
            self.read_stripe_cells(segment, stripe_first, stripes, DriveSet::default()).await?;
        let data_of =
            |at: u32, shard: u32| -> &[u8] { block(&cells, (at * width + shard) as usize) };
        let mut parity = self.buffers.take((m * stripes) as usize * BLOCK_BYTES);
        self.compute_parity(stripes, &data_of, &mut parity);
        let mut wrong: Vec<(u32, u32)> = Vec::new();
        for at in 0..stripes {
            for shard in 0..m {
                let expected = block(&parity, (shard * stripes + at) as usize);
                if expected != block(&cells, (at * width + k + shard) as usize) {
                    wrong.push((at, shard));
                }
            }
        }
        let mut stripes_wrong: Vec<u32> = wrong.iter().map(|(at, _)| stripe_first + at).collect();
        stripes_wrong.dedup();
        if wrong.is_empty() || !engine.segments.try_pin(segment) {
            self.buffers.give(parity);
            return Ok((stripes_wrong, 0));
        }
        let _pin = super::rebuild::Pin { engine };
        let mut repaired = 0;
        let unchanged = engine.segments.seq(segment) == seq
            && engine.segments.state(segment) == super::segments::SegmentState::Sealed;
        for (at, shard) in wrong.iter().copied() {
            if !unchanged {
                break;
            }
            let cell = geometry.cell(stripe_first + at, k + shard);
            let (drive, row) = geometry.cell_drive_row(cell);
            let mut bytes = AlignedBuf::new(BLOCK_BYTES);
            bytes.copy_from_slice(block(&parity, (shard * stripes + at) as usize));
            if self.write_cell(drive, geometry.row_offset_bytes(segment, row), bytes).await {
                repaired += 1;
            }
        }
        self.buffers.give(parity);
        let repaired_stripes = if repaired == wrong.len() { stripes_wrong.len() as u32 } else { 0 };
        Ok((stripes_wrong, repaired_stripes))
    }

    /// Rebuilds, in `cells` (stripe `i`'s shard `s` at block `i * w + s`), the lost data shards
    /// of every stripe; `lost[i]` are the shards stripe `i` could not read. Stripes that lost the
    /// same shards are rebuilt by one codec call.
    pub(super) fn reconstruct(
        &self,
        cells: &mut [u8],
        lost: &[ShardSet],
    ) -> Result<(), ReconstructError> {
        let geometry = &self.engine.geometry;
        let k = u32::from(geometry.data_shards);
        let width = geometry.stripe_width();
        let data_mask = (1u32 << k) - 1;
        let mut pending: Vec<u32> = (0..lost.len() as u32)
            .filter(|at| lost[*at as usize].bits() & data_mask != 0)
            .collect();
        let group_max = (STRIPE_DATA_BLOCKS_MAX / k) as usize;
        while let Some(&lead) = pending.first() {
            let set = lost[lead as usize];
            if set.count() > geometry.parity_shards {
                return Err(ReconstructError::TooManyLost);
            }
            let members: Vec<u32> = pending
                .iter()
                .copied()
                .filter(|at| lost[*at as usize] == set)
                .take(group_max)
                .collect();
            pending.retain(|at| !members.contains(at));
            let group = members.len();
            let mut shards = self.buffers.take(width as usize * group * BLOCK_BYTES);
            for shard in 0..width as usize {
                for (index, at) in members.iter().enumerate() {
                    block_mut(&mut shards, shard * group + index)
                        .copy_from_slice(block(cells, *at as usize * width as usize + shard));
                }
            }
            let result = {
                let mut slices: Vec<&mut [u8]> = shards.chunks_mut(group * BLOCK_BYTES).collect();
                let stripe_plan = plan(geometry.scheme(), k * group as u32);
                self.erasure.borrow_mut().reconstruct(
                    &stripe_plan,
                    0..group as u32,
                    &mut slices,
                    set,
                )
            };
            if result.is_err() {
                self.buffers.give(shards);
                return Err(ReconstructError::TooManyLost);
            }
            for shard in 0..k as usize {
                if !set.contains(shard as u8) {
                    continue;
                }
                for (index, at) in members.iter().enumerate() {
                    block_mut(cells, *at as usize * width as usize + shard)
                        .copy_from_slice(block(&shards, shard * group + index));
                }
            }
            self.buffers.give(shards);
        }
        Ok(())
    }
}

/// Counts a write that skipped a failed drive while it is in flight (`Counters::skipping_writes`).
struct SkippingWrite<'a> {
    engine: &'a LogEngine,
}

impl<'a> SkippingWrite<'a> {
    fn new(engine: &'a LogEngine) -> Self {
        engine.counters.skipping_writes.fetch_add(1, Ordering::AcqRel);
        Self { engine }
    }
}

impl Drop for SkippingWrite<'_> {
    fn drop(&mut self) {
        self.engine.counters.skipping_writes.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why [`LogHandle::reconstruct`] could not rebuild a stripe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReconstructError {
    /// A stripe lost more cells than it has parity.
    TooManyLost,
}
