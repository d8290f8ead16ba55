//! The log-structured engine (issue 4): every write is appended, out of place, to segments
//! striped across all of a node's drives; an index in RAM maps each volume block to its current
//! location and CRC-32C; checkpoints of the index plus the batch headers of recent segments make
//! recovery read a bounded amount; GC relocates live blocks out of mostly-dead segments.
//!
//! The format and every decision behind it are in docs/format-log-v1.md. The pieces:
//! - [`format`]: byte layouts and geometry (pure functions over bytes);
//! - [`index`]: the RAM index (atomic 8-byte entries in a radix tree per volume);
//! - [`segments`]: the segment table (state, sequence, live blocks) and free list;
//! - `engine`: [`LogEngine`] (shared by all threads, `Send + Sync`) and [`LogHandle`] (one per
//!   data-path thread, over that thread's drive handles): group commit, reads, stats;
//! - `gc`: garbage collection and checkpoints; `recovery`: format and open;
//! - `defrag`: read-triggered defragmentation (scattered ranges rewritten back to back).
//!
//! Sans-IO like the rest of the engine: generic over [`Drive`](crate::Drive), no clock, no
//! runtime. Background work (GC, checkpoints) runs when a handle's caller asks for it, or inline
//! when a write needs space.

mod defrag;
mod engine;
pub mod format;
mod gc;
pub mod index;
mod lay_out;
mod pool;
mod rebuild;
mod recovery;
mod scrub;
pub mod segments;
mod stripes;

pub use defrag::{DEFRAG_BLOCKS_MAX, DEFRAG_QUEUED_BLOCKS_MAX};
pub use engine::{LogEngine, LogHandle, LogStats, VolumeStats};
pub use gc::{GcOutcome, GC_STEPS_PER_TICK, GC_STEPS_PER_TICK_URGENT};
pub use lay_out::LAY_OUT_AHEAD_SEGMENTS;
pub use rebuild::{RebuildProgress, REBUILD_BACKLOG_MAX, REBUILD_STRIPES_PER_CALL_MAX};
pub use recovery::RecoveryReport;
pub use scrub::{ScrubCursor, ScrubDamage, ScrubFinding, ScrubProgress};

#[cfg(test)]
mod erasure_tests;
#[cfg(test)]
mod snapshot_tests;
#[cfg(test)]
mod tests;

use std::io;

use crate::drive::{DriveError, DriveOperation};
use crate::erasure::ErasureScheme;
use crate::format::NodeUuid;
use crate::store::StoreError;
use crate::volumes::VolumeId;
use format::DecodeError;

/// How a node's log is laid out and run. Fixed at format time except `handles_max` and the
/// checkpoint interval, which are per process.
#[derive(Debug, Clone)]
pub struct LogConfig {
    pub node_uuid: NodeUuid,
    /// Bytes of each segment on one drive.
    pub unit_bytes: u64,
    /// Where the log area starts on each drive (the drive superblock region comes first).
    pub area_offset_bytes: u64,
    /// The most handles (data-path threads plus background workers) the process will create;
    /// each may hold two open segments, which the free-space reserve covers.
    pub handles_max: u16,
    /// A checkpoint is taken after at least this many segments were sealed since the last one
    /// (and at least a quarter of the segments in use), bounding what recovery replays.
    pub checkpoint_interval_segments: u32,
    /// The erasure coding the drives are formatted with (none by default); an opened log keeps
    /// what its superblocks record.
    pub erasure: ErasureScheme,
    /// The caller has just written zeros over each drive's whole log area (laid-out drive
    /// files): format then skips the punch that would otherwise clear an earlier format's
    /// headers, which would also hand the blocks back to the filesystem.
    pub area_zeroed: bool,
    /// The batch-header key a format writes into the superblocks ([`format::Geometry`]'s
    /// `header_key`): random from the operating system by default; an opened log keeps its own.
    pub header_key: u128,
}

impl LogConfig {
    pub fn new(node_uuid: NodeUuid) -> Self {
        Self {
            node_uuid,
            unit_bytes: 8 << 20,
            area_offset_bytes: crate::format::HEADER_REGION_BYTES,
            handles_max: 64,
            checkpoint_interval_segments: 64,
            erasure: ErasureScheme::NONE,
            area_zeroed: false,
            header_key: random_header_key(),
        }
    }

    /// The configuration for a node's drives of `drive_size_bytes` each, served by
    /// `handles_max` handles: units as large as possible up to 8 MiB while each drive still
    /// holds about [`SEGMENTS_PER_DRIVE_TARGET`] of them, so small (test) drives get enough
    /// segments for the free-space reserve and GC, and large ones get long sequential writes.
    pub fn for_drives(node_uuid: NodeUuid, drive_size_bytes: u64, handles_max: u16) -> Self {
        let area_offset_bytes = crate::format::HEADER_REGION_BYTES;
        let usable = drive_size_bytes.saturating_sub(area_offset_bytes + format::LOG_HEADER_BYTES);
        let per_segment = (usable / SEGMENTS_PER_DRIVE_TARGET).max(1);
        // The largest power of two not above per_segment, within the bounds.
        let floor = 1u64 << (63 - per_segment.leading_zeros());
        let unit_bytes = floor.clamp(UNIT_BYTES_SMALLEST, UNIT_BYTES_LARGEST);
        // Bounds what recovery replays to about REPLAY_BYTES_PER_DRIVE_TARGET per drive (the
        // engine still lets the interval grow to a quarter of the segments in use).
        let checkpoint_interval_segments =
            (REPLAY_BYTES_PER_DRIVE_TARGET / unit_bytes).clamp(4, 64) as u32;
        Self { unit_bytes, handles_max, checkpoint_interval_segments, ..Self::new(node_uuid) }
    }
}

/// A fresh batch-header key from the operating system's random source.
fn random_header_key() -> u128 {
    let mut key = [0u8; 16];
    // Linux's getrandom(2) does not fail once the pool is initialised, which it is long before
    // a node formats its drives; there is no key without it.
    getrandom::fill(&mut key).expect("the operating system provides random bytes");
    u128::from_le_bytes(key)
}

/// Segments per drive [`LogConfig::for_drives`] aims for.
pub const SEGMENTS_PER_DRIVE_TARGET: u64 = 256;
/// Bytes per drive written between checkpoints that [`LogConfig::for_drives`] aims for.
pub const REPLAY_BYTES_PER_DRIVE_TARGET: u64 = 128 << 20;
/// The smallest unit [`LogConfig::for_drives`] picks.
pub const UNIT_BYTES_SMALLEST: u64 = 256 << 10;
/// The largest unit [`LogConfig::for_drives`] picks.
pub const UNIT_BYTES_LARGEST: u64 = 8 << 20;
const _: () = assert!(UNIT_BYTES_SMALLEST >= format::UNIT_BYTES_MIN);
const _: () = assert!(UNIT_BYTES_LARGEST <= format::UNIT_BYTES_MAX);

/// Why a log operation failed. The messages say what happened, to what, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error(transparent)]
    Request(#[from] StoreError),
    #[error(transparent)]
    Layer(#[from] index::LayerError),
    #[error(
        "the node is full: {mapped_blocks} of {capacity_blocks} blocks are mapped and this write \
         needs {needed_blocks} more; deallocate data, delete volumes or add drives"
    )]
    CapacityExceeded { mapped_blocks: u64, capacity_blocks: u64, needed_blocks: u64 },
    #[error(
        "block {block} of volume {volume} failed its checksum at log location {location} (drive \
         {drive}): the data on the drive is damaged; restore it from a replica or a backup"
    )]
    ChecksumMismatch { volume: u64, block: u64, location: u32, drive: u16 },
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
    #[error("a write was abandoned while its batch was being committed; its outcome is unknown")]
    Abandoned,
    #[error("drive {drive}: the log superblock is unusable: {source}")]
    SuperblockInvalid {
        drive: u16,
        #[source]
        source: DecodeError,
    },
    #[error(
        "drive {drive} belongs to node {found}, not to this node ({expected}): point the data \
         directory at this node's own drives"
    )]
    NodeMismatch { drive: u16, found: NodeUuid, expected: NodeUuid },
    #[error(
        "drive {drive} records drive index {found} or a geometry unlike drive 0's: drives were \
         swapped or come from different formats"
    )]
    DriveMismatch { drive: u16, found: u16 },
    #[error("no drive holds a valid checkpoint root: the log is not formatted or is damaged")]
    RootMissing,
    #[error("checkpoint {checkpoint_id} block {block} is unreadable: {source}")]
    CheckpointCorrupt {
        checkpoint_id: u64,
        block: u64,
        #[source]
        source: DecodeError,
    },
    #[error("checkpoint {checkpoint_id}: {reason}")]
    CheckpointInvalid { checkpoint_id: u64, reason: &'static str },
    #[error(
        "segment {segment} is damaged at position {position} ({reason}); {live_blocks} live \
         blocks in it could not be relocated and it is kept out of GC"
    )]
    SegmentCorrupt { segment: u32, position: u32, reason: &'static str, live_blocks: u32 },
    #[error("drive {drive} cannot be replaced: {reason}")]
    ReplaceRefused { drive: u16, reason: String },
    #[error("another checkpoint is being written; try again when it finishes")]
    CheckpointBusy,
    #[error(
        "a checkpoint needs {needed} free segments but only {free} are free: the free-space \
         reserve was spent; this is a bug"
    )]
    CheckpointNoSpace { needed: u64, free: u32 },
}

impl LogError {
    fn io(drive: u16, source: DriveError) -> Self {
        Self::Io { drive, source }
    }

    /// The [`StoreError`] a frontend sees, for the [`VolumeStore`](crate::VolumeStore) trait.
    pub fn into_store_error(self) -> StoreError {
        match self {
            Self::Request(error) => error,
            Self::DriveFailed { drive } => StoreError::DriveFailed { drive },
            Self::Io { drive, source } => StoreError::Io { drive, source },
            Self::CapacityExceeded { mapped_blocks, capacity_blocks, needed_blocks } => {
                StoreError::CapacityExceeded { mapped_blocks, capacity_blocks, needed_blocks }
            }
            Self::ChecksumMismatch { volume, block, location, drive } => {
                StoreError::ChecksumMismatch { volume: VolumeId(volume), block, drive, location }
            }
            other => StoreError::Io {
                drive: 0,
                source: DriveError::Io {
                    operation: DriveOperation::Write,
                    offset_bytes: 0,
                    length_bytes: 0,
                    source: io::Error::other(other.to_string()),
                },
            },
        }
    }
}
