//! Hot path. The walking skeleton's store: a volume's blocks live in place in the chunks it owns,
//! and every mutation is acknowledged only once a group commit has made it durable.
//!
//! Group commit, per drive: a mutation is acknowledged after its data reached the drive AND a sync
//! of that drive that started after that moment has returned. At most one sync per drive is in
//! flight; mutations that finish while one is in flight wait for the next, so one sync covers
//! every mutation that finished before it started. The first waiter to find no sync in flight
//! starts it (no background task: the engine has no runtime), and a leader whose future is dropped
//! hands the role on.
//!
//! Failure latching: after a failed write, sync or punch a drive's state is unknown (Linux may
//! already have dropped the dirty pages that failed), so the drive is latched failed and every
//! later I/O to it fails at once with `DriveFailed`; nothing is retried blindly. A failed read
//! changes nothing on the drive and latches nothing. Latches can be shared by every data-path
//! thread of a node ([`DriveLatches`]), so one thread's failure fences them all.
//!
//! A single-chunk I/O (nearly all of them) passes the caller's buffer to the drive untouched; an
//! I/O that crosses a chunk boundary is split, and each piece gets its own buffer and a copy.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use types::AlignedBuf;

use crate::drive::{Drive, DriveError};
use crate::format::{chunk_offset_bytes, CHUNK_SIZE_BYTES, DRIVE_COUNT_MAX};
use crate::layout::{ChunkId, Piece, Pieces, VolumeMap};
use crate::local_sync::LocalNotify;
use crate::store::{StoreError, VolumeStore};

/// Which drives of a node are latched failed. Shared (`Arc`) by the stores of all data-path
/// threads; checked with one relaxed load per I/O.
#[derive(Debug)]
pub struct DriveLatches {
    failed: Box<[AtomicBool]>,
}

impl DriveLatches {
    pub fn new(drive_count: u16) -> Self {
        assert!((1..=DRIVE_COUNT_MAX).contains(&drive_count), "drive count {drive_count}");
        Self { failed: (0..drive_count).map(|_| AtomicBool::new(false)).collect() }
    }

    pub fn is_failed(&self, drive: u16) -> bool {
        self.failed[usize::from(drive)].load(Ordering::Relaxed)
    }

    /// Marks a drive failed for the life of the process.
    pub fn latch(&self, drive: u16) {
        self.failed[usize::from(drive)].store(true, Ordering::Relaxed);
    }

    pub fn failed_drives(&self) -> Vec<u16> {
        (0..self.failed.len() as u16).filter(|drive| self.is_failed(*drive)).collect()
    }
}

/// The group-commit state of one drive. Sync number n is the n-th sync started.
#[derive(Default)]
struct GroupCommit {
    started: Cell<u64>,
    /// The highest sync number that returned `Ok`. Syncs run one at a time, so it only grows.
    done: Cell<u64>,
    in_flight: Cell<bool>,
    finished: LocalNotify,
}

/// Clears a sync leader's role if its future is dropped mid-sync, so a waiter takes over.
struct SyncLeader<'a> {
    commit: &'a GroupCommit,
    armed: bool,
}

impl Drop for SyncLeader<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.commit.in_flight.set(false);
            self.commit.finished.notify_all();
        }
    }
}

/// A set of drive indexes, on the stack.
#[derive(Default)]
struct DriveSet([u64; DRIVE_COUNT_MAX as usize / 64]);

impl DriveSet {
    fn insert(&mut self, drive: u16) {
        self.0[usize::from(drive / 64)] |= 1 << (drive % 64);
    }

    fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        (0..DRIVE_COUNT_MAX)
            .filter(|drive| self.0[usize::from(drive / 64)] & (1 << (drive % 64)) != 0)
    }
}

/// [`VolumeStore`] over a node's drives, in place, with group commit. One per data-path thread,
/// over that thread's handles of the drives (index = drive index).
pub struct ChunkStore<D> {
    drives: Vec<D>,
    commits: Box<[GroupCommit]>,
    latches: Arc<DriveLatches>,
}

impl<D: Drive> ChunkStore<D> {
    pub fn new(drives: Vec<D>) -> Self {
        let drive_count = u16::try_from(drives.len()).expect("at most 256 drives");
        Self::with_latches(drives, Arc::new(DriveLatches::new(drive_count)))
    }

    /// A store sharing its failure latches with the other data-path threads' stores.
    pub fn with_latches(drives: Vec<D>, latches: Arc<DriveLatches>) -> Self {
        assert_eq!(drives.len(), latches.failed.len(), "one latch per drive");
        let commits = drives.iter().map(|_| GroupCommit::default()).collect();
        Self { drives, commits, latches }
    }

    pub fn drives(&self) -> &[D] {
        &self.drives
    }

    pub fn latches(&self) -> &Arc<DriveLatches> {
        &self.latches
    }

    /// The drives latched failed, in index order.
    pub fn failed_drives(&self) -> Vec<u16> {
        self.latches.failed_drives()
    }

    /// How many syncs this store has started on a drive (for metrics and tests).
    pub fn syncs_started(&self, drive: u16) -> u64 {
        self.commits[usize::from(drive)].started.get()
    }

    /// Punches whole chunks so they read as zeros, durably. Call it on the chunks a reservation
    /// adds ([`crate::Volumes::new_chunks`]) before publishing it: a freed chunk still holds the
    /// data of the volume that owned it.
    pub async fn zero_chunks(&self, chunks: &[ChunkId]) -> Result<(), StoreError> {
        let mut touched = DriveSet::default();
        for chunk in chunks {
            assert!(usize::from(chunk.drive) < self.drives.len(), "{chunk} is not on this node");
            let drive = self.drive(chunk.drive)?;
            let offset_bytes = chunk_offset_bytes(chunk.index);
            let result = drive.punch_hole(offset_bytes, CHUNK_SIZE_BYTES).await;
            result.map_err(|error| self.fail(chunk.drive, error))?;
            touched.insert(chunk.drive);
        }
        self.commit_all(&touched).await
    }

    /// The drive, unless it is latched failed.
    fn drive(&self, drive: u16) -> Result<&D, StoreError> {
        if self.latches.is_failed(drive) {
            return Err(StoreError::DriveFailed { drive });
        }
        Ok(&self.drives[usize::from(drive)])
    }

    /// Latches a drive after a failed mutation and says why.
    fn fail(&self, drive: u16, source: DriveError) -> StoreError {
        self.latches.latch(drive);
        StoreError::Io { drive, source }
    }

    /// Waits until a sync that started after this call has returned on `drive`.
    async fn commit(&self, drive: u16) -> Result<(), StoreError> {
        let commit = &self.commits[usize::from(drive)];
        // Any sync started so far may have begun before the caller's data reached the drive.
        let needed = commit.started.get() + 1;
        loop {
            if self.latches.is_failed(drive) {
                return Err(StoreError::DriveFailed { drive });
            }
            if commit.done.get() >= needed {
                return Ok(());
            }
            if commit.in_flight.get() {
                commit.finished.notified().await;
                continue;
            }
            let number = commit.started.get() + 1;
            commit.started.set(number);
            commit.in_flight.set(true);
            let mut leader = SyncLeader { commit, armed: true };
            let result = self.drives[usize::from(drive)].sync().await;
            leader.armed = false;
            commit.in_flight.set(false);
            let outcome = match result {
                Ok(()) => {
                    assert!(number > commit.done.get(), "syncs complete in order");
                    commit.done.set(number);
                    Ok(())
                }
                Err(error) => Err(self.fail(drive, error)),
            };
            commit.finished.notify_all();
            return outcome;
        }
    }

    async fn commit_all(&self, touched: &DriveSet) -> Result<(), StoreError> {
        for drive in touched.iter() {
            self.commit(drive).await?;
        }
        Ok(())
    }

    async fn read_pieces(
        &self,
        pieces: impl Iterator<Item = Piece>,
        data: &mut [u8],
    ) -> Result<(), StoreError> {
        let mut done_bytes = 0;
        for piece in pieces {
            let length = piece.length_bytes as usize;
            let drive = self.drive(piece.drive)?;
            let (result, part) =
                drive.read_at(piece.drive_offset_bytes, AlignedBuf::new(length)).await;
            result.map_err(|source| StoreError::Io { drive: piece.drive, source })?;
            data[done_bytes..done_bytes + length].copy_from_slice(&part[..length]);
            done_bytes += length;
        }
        assert_eq!(done_bytes, data.len(), "pieces cover the I/O");
        Ok(())
    }

    async fn write_pieces(
        &self,
        pieces: impl Iterator<Item = Piece>,
        data: &[u8],
    ) -> Result<(), StoreError> {
        let mut touched = DriveSet::default();
        let mut done_bytes = 0;
        for piece in pieces {
            let length = piece.length_bytes as usize;
            let drive = self.drive(piece.drive)?;
            let mut part = AlignedBuf::new(length);
            part.copy_from_slice(&data[done_bytes..done_bytes + length]);
            let (result, _) = drive.write_at(piece.drive_offset_bytes, part).await;
            result.map_err(|error| self.fail(piece.drive, error))?;
            touched.insert(piece.drive);
            done_bytes += length;
        }
        assert_eq!(done_bytes, data.len(), "pieces cover the I/O");
        self.commit_all(&touched).await
    }

    /// Punches a volume range (write zeroes and deallocate are the same here), durably.
    async fn zero_range(&self, pieces: Pieces<'_>) -> Result<(), StoreError> {
        let mut touched = DriveSet::default();
        for piece in pieces {
            let drive = self.drive(piece.drive)?;
            let result = drive.punch_hole(piece.drive_offset_bytes, piece.length_bytes).await;
            result.map_err(|error| self.fail(piece.drive, error))?;
            touched.insert(piece.drive);
        }
        self.commit_all(&touched).await
    }
}

impl<D: Drive> VolumeStore for ChunkStore<D> {
    async fn read(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        mut buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        let mut pieces = match volume.pieces(offset_bytes, length_bytes) {
            Ok(pieces) => pieces,
            Err(error) => return (Err(error), buf),
        };
        let Some(first) = pieces.next() else { return (Ok(()), buf) };
        if first.length_bytes == length_bytes {
            let drive = match self.drive(first.drive) {
                Ok(drive) => drive,
                Err(error) => return (Err(error), buf),
            };
            let (result, buf) = drive.read_at(first.drive_offset_bytes, buf).await;
            let result = result.map_err(|source| StoreError::Io { drive: first.drive, source });
            return (result, buf);
        }
        let result = self.read_pieces(std::iter::once(first).chain(pieces), &mut buf).await;
        (result, buf)
    }

    async fn write(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        let mut pieces = match volume.pieces(offset_bytes, length_bytes) {
            Ok(pieces) => pieces,
            Err(error) => return (Err(error), buf),
        };
        let Some(first) = pieces.next() else { return (Ok(()), buf) };
        if first.length_bytes == length_bytes {
            let drive = match self.drive(first.drive) {
                Ok(drive) => drive,
                Err(error) => return (Err(error), buf),
            };
            let (result, buf) = drive.write_at(first.drive_offset_bytes, buf).await;
            if let Err(error) = result {
                return (Err(self.fail(first.drive, error)), buf);
            }
            return (self.commit(first.drive).await, buf);
        }
        let result = self.write_pieces(std::iter::once(first).chain(pieces), &buf).await;
        (result, buf)
    }

    async fn flush(&self, volume: &VolumeMap) -> Result<(), StoreError> {
        // Every mutation was durable before it completed; there is nothing left to flush.
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
        self.zero_range(volume.pieces(offset_bytes, length_bytes)?).await
    }

    async fn deallocate(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError> {
        self.zero_range(volume.pieces(offset_bytes, length_bytes)?).await
    }
}

#[cfg(test)]
mod tests;
