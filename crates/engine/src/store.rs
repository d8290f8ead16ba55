//! The interface a frontend (NVMe/TCP, later NBD and replication) uses to reach a volume's data.
//!
//! The log-structured engine's [`crate::log::LogHandle`] implements it. One store per data-path
//! thread: its futures
//! are not `Send`, and buffers are owned and handed back with the result (io_uring style).

use types::AlignedBuf;

use crate::drive::DriveError;
use crate::volumes::{VolumeId, VolumeMap};

/// Why a volume I/O failed. The messages are meant for logs and for mapping to NVMe status codes.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "I/O of {length_bytes} bytes at byte {offset_bytes} reaches beyond the end of the volume \
         ({size_bytes} bytes)"
    )]
    OutOfRange { offset_bytes: u64, length_bytes: u64, size_bytes: u64 },
    #[error(
        "I/O of {length_bytes} bytes at byte {offset_bytes} is not aligned to the 4096-byte block"
    )]
    Unaligned { offset_bytes: u64, length_bytes: u64 },
    #[error("{volume} has been deleted")]
    VolumeRemoved { volume: VolumeId },
    #[error(
        "drive {drive} failed earlier and is latched failed: I/O to it is refused until the node \
         restarts; check the drive and the kernel log"
    )]
    DriveFailed { drive: u16 },
    #[error("drive {drive}: {source}")]
    Io {
        drive: u16,
        #[source]
        source: DriveError,
    },
    /// A write needs more blocks than the node has free (thin provisioning: the volumes may
    /// provision more than the drives hold). Nothing was written.
    #[error(
        "the node is full: this write needs {needed_blocks} more 4 KiB blocks but {mapped_blocks} \
         of {capacity_blocks} are in use; deallocate data, delete volumes or add drives"
    )]
    CapacityExceeded { mapped_blocks: u64, capacity_blocks: u64, needed_blocks: u64 },
    /// A block read back failed its checksum: the data on the drive is damaged. Never returned
    /// as data.
    #[error(
        "block {block} of {volume} failed its checksum (drive {drive}, log location {location}): \
         the data on the drive is damaged; restore it from a replica or a backup"
    )]
    ChecksumMismatch { volume: VolumeId, block: u64, drive: u16, location: u32 },
    /// A write to a snapshot: snapshots are read-only (clone one to write).
    #[error("{volume} is a snapshot and read-only; clone it to get a writable volume")]
    ReadOnly { volume: VolumeId },
    /// A replicated volume this node does not serve now: it holds a replica, or it was the
    /// primary and its term ended. The host retries on the primary's path.
    #[error(
        "{volume} is not served by this node now (it holds a replica, or a failover is under \
         way); use the path of the volume's primary"
    )]
    NotServing { volume: VolumeId },
    /// Blocks of a replicated volume failed their checksum on this node, and no in-sync
    /// replica could give another copy (none is in sync, or theirs are damaged too).
    #[error(
        "blocks {block}..{block}+{count} of {volume} failed their checksum on this node and no \
         in-sync replica could give another copy: restore them from a backup"
    )]
    Unrecovered { volume: VolumeId, block: u64, count: u32 },
}

/// Block storage for volumes, used by one data-path thread.
///
/// Offsets and lengths are multiples of [`types::BLOCK_SIZE_BYTES`]. Every mutation (`write`,
/// `write_zeroes`, `deallocate`) completes only when it is durable: it survives kill -9 and power
/// loss. A read returns, for each block, the last completed mutation, or zeros.
///
/// The volume is passed as the [`VolumeMap`] the caller holds (an `Arc` it got once, when the
/// namespace was attached), so the store needs no lookup, lock or allocation to find it.
#[allow(async_fn_in_trait)] // Single-threaded by design: futures never cross threads.
pub trait VolumeStore {
    /// Fills `buf` (its `len()`) from the volume at `offset_bytes`.
    async fn read(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf);
    /// Writes `buf` (its `len()`) at `offset_bytes`; completes only when durable.
    async fn write(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf);
    /// Makes every completed mutation durable. Mutations are durable when they complete, so this
    /// has nothing left to do today; it exists for stores with a volatile cache.
    async fn flush(&self, volume: &VolumeMap) -> Result<(), StoreError>;
    /// Makes a range read as zeros; completes only when durable.
    async fn write_zeroes(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError>;
    /// Releases a range's space; it reads as zeros afterwards. Completes only when durable.
    async fn deallocate(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError>;
}
