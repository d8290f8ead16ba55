//! The log's on-disk format, version 1: byte layouts of the log superblock, the checkpoint root,
//! batch headers and checkpoint blocks, and the geometry that maps a log location to a drive
//! and a byte offset. Specified in docs/format-log-v1.md; this module is the only code that
//! knows the bytes.
//!
//! Everything here is a pure function over bytes. Decoders never trust their input: they check
//! the magic, the version, the checksum and every field, and return [`DecodeError`] rather than
//! panic. Encoders assert their inputs, which come from the engine itself.

use std::fmt;

use super::index::TAG_BITS;
use crate::erasure::ErasureScheme;
use crate::format::NodeUuid;

/// Bytes per block; every on-disk structure is one block.
pub const BLOCK_BYTES: usize = types::BLOCK_SIZE_BYTES as usize;
const BLOCK_BYTES_U64: u64 = BLOCK_BYTES as u64;
/// The log format this build reads and writes.
pub const LOG_FORMAT_VERSION: u32 = 7;
/// The first 16 bytes of the log superblock.
pub const LOG_SUPERBLOCK_MAGIC: [u8; 16] = *b"FERRITE\0LOG\0\0\0\0\0";
/// Magics of the other structures (the first 8 bytes of their block).
pub const ROOT_MAGIC: [u8; 8] = *b"FRTROOT\0";
/// The magic of a root's continuation blocks (its lists beyond the first block).
pub const ROOT_CONTINUATION_MAGIC: [u8; 8] = *b"FRTROOT+";
pub const BATCH_MAGIC: [u8; 8] = *b"FRTBATCH";
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"FRTCKPT\0";
pub const LAYERS_MAGIC: [u8; 8] = *b"FRTLAYER";
/// The header region at the start of each drive's log area: superblock, two root slots, and
/// reserved space; segments start after it, 1 MiB aligned.
pub const LOG_HEADER_BYTES: u64 = 1 << 20;
/// Block numbers inside the header region.
pub const SUPERBLOCK_BLOCK: u64 = 0;
/// The first block of each of the two root slots; a slot spans up to [`ROOT_BLOCKS_MAX`].
pub const ROOT_SLOT_BLOCKS: [u64; 2] = [1, 1 + ROOT_BLOCKS_MAX as u64];
/// Blocks one root may span: its first block, then continuation blocks holding the rest of its
/// lists (a node of many segments lists many checkpoint segments).
pub const ROOT_BLOCKS_MAX: usize = 64;
/// The per-drive segment unit: at least 64 KiB (so a batch rarely spans many units) and at most
/// 1 GiB (so a segment stays a bounded amount of work for GC).
pub const UNIT_BYTES_MIN: u64 = 64 << 10;
pub const UNIT_BYTES_MAX: u64 = 1 << 30;
/// Entries in one batch header, and so the most data blocks in one batch.
pub const BATCH_ENTRIES_MAX: usize = (HEADER_TAG_OFFSET - BATCH_ENTRIES_OFFSET) / ENTRY_BYTES;
/// Index entries one checkpoint block holds at least: each in a run of its own (a run header
/// and one slot), as the entries of a sparsely written volume are.
pub const CHECKPOINT_ENTRIES_PER_BLOCK_MIN: usize =
    CHECKPOINT_RUNS_BYTES / (CHECKPOINT_RUN_HEADER_BYTES + CHECKPOINT_SLOT_BYTES);
/// Index entries one checkpoint block holds at most: one run of consecutive blocks.
pub const CHECKPOINT_ENTRIES_PER_BLOCK_MAX: usize =
    (CHECKPOINT_RUNS_BYTES - CHECKPOINT_RUN_HEADER_BYTES) / CHECKPOINT_SLOT_BYTES;
/// Layer-table records in one checkpoint layer block.
pub const LAYER_RECORDS_PER_BLOCK: usize =
    (BLOCK_BYTES - 4 - LAYER_RECORDS_OFFSET) / LAYER_RECORD_BYTES;
/// The checkpoint entry of a tombstone: location and CRC both `u32::MAX` (no block has that
/// location).
pub const TOMBSTONE_LOCATION: u32 = u32::MAX;
/// Open segments (by sequence number) one root can list: two per handle.
pub const ROOT_OPEN_SEGMENTS_MAX: usize = 256;
/// Checkpoint segments one root can list (with a full open list beside them).
pub const ROOT_SEGMENTS_MAX: usize = (ROOT_LIST_BYTES_MAX - 8 * ROOT_OPEN_SEGMENTS_MAX) / 4;
/// The largest volume block number plus one (1 PiB of 4 KiB blocks).
pub const VOLUME_BLOCKS_MAX: u64 = types::VOLUME_SIZE_BYTES_MAX / BLOCK_BYTES_U64;
/// Locations are u32 and `u32::MAX` is never a location (index entries store location + 1).
pub const LOCATIONS_MAX: u64 = u32::MAX as u64 - 1;
pub const DRIVE_COUNT_MAX: u16 = crate::format::DRIVE_COUNT_MAX;

const CHECKSUM_OFFSET: usize = BLOCK_BYTES - 4;
const ENTRY_BYTES: usize = 32;
const BATCH_ENTRIES_OFFSET: usize = 48;
/// Where a batch header keeps its tag (8 bytes), after the most entries it can hold.
const HEADER_TAG_OFFSET: usize = 4080;
/// Where a checkpoint block's runs start, and the bytes they may fill before the checksum.
const CHECKPOINT_RUNS_OFFSET: usize = 32;
const CHECKPOINT_RUNS_BYTES: usize = CHECKSUM_OFFSET - CHECKPOINT_RUNS_OFFSET;
/// A run: layer label, first block (48 bits) and slot count (16 bits), then its slots.
const CHECKPOINT_RUN_HEADER_BYTES: usize = 16;
/// A slot: location and index tag of one block.
const CHECKPOINT_SLOT_BYTES: usize = 8;
const ROOT_OPEN_COUNT_OFFSET: usize = 64;
const ROOT_LAYER_COUNT_OFFSET: usize = 68;
const ROOT_ENTRY_BLOCKS_OFFSET: usize = 76;
const ROOT_BLOCK_COUNT_OFFSET: usize = 84;
/// Where the lists start in a root's first block and in each continuation block.
const ROOT_LISTS_OFFSET: usize = 88;
const ROOT_CONTINUATION_LISTS_OFFSET: usize = 24;
/// The list bytes all the blocks of one root hold.
const ROOT_LIST_BYTES_MAX: usize = (CHECKSUM_OFFSET - ROOT_LISTS_OFFSET)
    + (ROOT_BLOCKS_MAX - 1) * (CHECKSUM_OFFSET - ROOT_CONTINUATION_LISTS_OFFSET);
const LAYER_RECORD_BYTES: usize = 32;
const LAYER_RECORDS_OFFSET: usize = 32;

const _: () = assert!(BATCH_ENTRIES_MAX == 126);
const _: () = assert!(CHECKPOINT_ENTRIES_PER_BLOCK_MIN == 169);
const _: () = assert!(CHECKPOINT_ENTRIES_PER_BLOCK_MAX == 505);
const _: () = assert!(VOLUME_BLOCKS_MAX <= 1 << 48);
const _: () = assert!(BATCH_ENTRIES_OFFSET + BATCH_ENTRIES_MAX * ENTRY_BYTES <= HEADER_TAG_OFFSET);
const _: () = assert!(HEADER_TAG_OFFSET + 8 <= CHECKSUM_OFFSET);
const _: () = assert!(LAYER_RECORDS_PER_BLOCK == 126);
const _: () = assert!(LOG_HEADER_BYTES % BLOCK_BYTES_U64 == 0);
const _: () =
    assert!((ROOT_SLOT_BLOCKS[1] + ROOT_BLOCKS_MAX as u64) * BLOCK_BYTES_U64 <= LOG_HEADER_BYTES);
const _: () = assert!(ROOT_SEGMENTS_MAX == 64_560);
const _: () =
    assert!(UNIT_BYTES_MIN % BLOCK_BYTES_U64 == 0 && UNIT_BYTES_MAX % BLOCK_BYTES_U64 == 0);

/// Why a block read from a drive was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("it does not start with the expected magic")]
    MagicMismatch,
    #[error(
        "it uses log format version {found}, but this build reads only version \
         {LOG_FORMAT_VERSION}: run the Ferrite release that wrote it"
    )]
    VersionUnsupported { found: u32 },
    #[error("its checksum does not match (stored {stored:#010x}, computed {computed:#010x})")]
    ChecksumMismatch { stored: u32, computed: u32 },
    #[error("it is shaped as a batch header but its tag does not match this log's key")]
    HeaderTagMismatch,
    #[error("field {field} holds {value}, which is impossible")]
    FieldInvalid { field: &'static str, value: u64 },
}

fn le_u16(block: &[u8], offset: usize) -> u16 {
    let mut bytes = [0u8; 2];
    bytes.copy_from_slice(&block[offset..offset + 2]);
    u16::from_le_bytes(bytes)
}

fn le_u32(block: &[u8], offset: usize) -> u32 {
    let mut bytes = [0u8; 4];
    bytes.copy_from_slice(&block[offset..offset + 4]);
    u32::from_le_bytes(bytes)
}

fn le_u64(block: &[u8], offset: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&block[offset..offset + 8]);
    u64::from_le_bytes(bytes)
}

fn le_u128(block: &[u8], offset: usize) -> u128 {
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&block[offset..offset + 16]);
    u128::from_le_bytes(bytes)
}

fn put(block: &mut [u8], offset: usize, bytes: &[u8]) {
    block[offset..offset + bytes.len()].copy_from_slice(bytes);
}

/// Seals a block: its last four bytes become the CRC-32C of the rest.
fn seal(block: &mut [u8]) {
    let crc = crc32c::crc32c(&block[..CHECKSUM_OFFSET]);
    put(block, CHECKSUM_OFFSET, &crc.to_le_bytes());
}

/// Checks magic, version (at byte 8 for 8-byte magics, 16 for the superblock) and checksum.
fn check_block(block: &[u8], magic: &[u8], version_offset: usize) -> Result<(), DecodeError> {
    assert_eq!(block.len(), BLOCK_BYTES, "on-disk structures are one block");
    if &block[..magic.len()] != magic {
        return Err(DecodeError::MagicMismatch);
    }
    let found = le_u32(block, version_offset);
    if found != LOG_FORMAT_VERSION {
        return Err(DecodeError::VersionUnsupported { found });
    }
    let stored = le_u32(block, CHECKSUM_OFFSET);
    let computed = crc32c::crc32c(&block[..CHECKSUM_OFFSET]);
    if stored != computed {
        return Err(DecodeError::ChecksumMismatch { stored, computed });
    }
    Ok(())
}

/// A batch header's tag: SipHash-1-3 under the log's 128-bit header key of the header's bytes
/// up to the end of its `count` entries.
fn header_tag(block: &[u8], count: usize, key: u128) -> u64 {
    use std::hash::Hasher;
    let mut hasher = siphasher::sip::SipHasher13::new_with_keys(key as u64, (key >> 64) as u64);
    hasher.write(&block[..BATCH_ENTRIES_OFFSET + count * ENTRY_BYTES]);
    hasher.finish()
}

/// Makes `block`, a batch header with valid fields, this log's own: writes its tag under
/// `geometry`'s header key, then seals its checksum. For tools and fuzzing that build headers
/// byte by byte; [`BatchHeader::encode`] does it for the engine.
pub fn tag_batch_header(block: &mut [u8], geometry: &Geometry) {
    assert_eq!(block.len(), BLOCK_BYTES, "a batch header is one block");
    let count = usize::from(le_u16(block, 12)).min(BATCH_ENTRIES_MAX);
    let tag = header_tag(block, count, geometry.header_key);
    put(block, HEADER_TAG_OFFSET, &tag.to_le_bytes());
    seal(block);
}

fn field(ok: bool, field: &'static str, value: u64) -> Result<(), DecodeError> {
    if ok {
        Ok(())
    } else {
        Err(DecodeError::FieldInvalid { field, value })
    }
}

/// The largest stripe chunk: this many consecutive positions of a segment sit on one drive.
pub const STRIPE_BLOCKS_MAX: u32 = 128;

/// How the log is laid out over a node's drives. Every drive has the same geometry.
///
/// Without parity (`parity_shards == 0`), a segment is unit `s` of every drive. Its positions
/// are dealt out in chunks of `stripe_blocks`: chunk `c = p / stripe_blocks` is on drive
/// `c % drive_count`, at row `(c / drive_count) * stripe_blocks + p % stripe_blocks` of that
/// drive's unit. So a batch of up to a chunk touches one drive or two (one sync each, not one
/// per drive of the node), large runs still stripe across every drive, and any run of positions
/// is one contiguous range of rows per drive. `stripe_blocks` is the largest power of two up to
/// [`STRIPE_BLOCKS_MAX`] that divides `unit_blocks` (derived, so the superblock need not record
/// it).
///
/// With erasure coding `k+m` (`data_shards`, `parity_shards`, `k + m <= drive_count`), the
/// segment's blocks are *cells*, numbered row-major: cell `c` is row `c / drive_count` of drive
/// `c % drive_count`. Stripe `s` is the `w = k + m` consecutive cells `s*w..s*w + w`, so its
/// cells lie on `w` distinct drives; its shard `i` (data `0..k`, then parity) is cell
/// `s*w + (i + r) % w` where the rotation `r` is `s` plus the row of the stripe's first cell, so
/// parity spreads over the drives. Positions address data cells only:
/// position `p` is data shard `p % k` of stripe `p / k`. Batches start on a stripe boundary and
/// are padded to whole stripes ([`Geometry::padded`]), so parity is computed once, in RAM, and
/// never read-modify-written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub drive_count: u16,
    pub unit_blocks: u32,
    pub stripe_blocks: u32,
    pub segment_count: u32,
    /// Where the log area starts on each drive (after the drive's own superblock region).
    pub area_offset_bytes: u64,
    /// `k`: data cells per stripe (1 without parity, where it has no other meaning).
    pub data_shards: u8,
    /// `m`: parity cells per stripe, the drives the log survives losing; 0 for none.
    pub parity_shards: u8,
    /// The log's secret batch-header key, drawn at format and kept in every drive's log
    /// superblock: each batch header carries a tag made with it ([`BatchHeader::encode`]), so
    /// no block a host wrote (left in a reused segment, or planted) can pass for a header,
    /// whatever bytes it holds. Zero in a geometry not read from or made for a superblock.
    pub header_key: u128,
}

impl Geometry {
    /// The geometry without parity for drives of `drive_size_bytes`, or why it is impossible.
    pub fn new(
        drive_count: u16,
        drive_size_bytes: u64,
        unit_bytes: u64,
        area_offset_bytes: u64,
    ) -> Result<Self, DecodeError> {
        Self::coded(
            drive_count,
            drive_size_bytes,
            unit_bytes,
            area_offset_bytes,
            ErasureScheme::NONE,
        )
    }

    /// The geometry with erasure coding `scheme` (none when it has no parity).
    pub fn coded(
        drive_count: u16,
        drive_size_bytes: u64,
        unit_bytes: u64,
        area_offset_bytes: u64,
        scheme: ErasureScheme,
    ) -> Result<Self, DecodeError> {
        field((1..=DRIVE_COUNT_MAX).contains(&drive_count), "drive_count", drive_count.into())?;
        field(
            (UNIT_BYTES_MIN..=UNIT_BYTES_MAX).contains(&unit_bytes)
                && unit_bytes % BLOCK_BYTES_U64 == 0,
            "unit_bytes",
            unit_bytes,
        )?;
        field(area_offset_bytes % BLOCK_BYTES_U64 == 0, "area_offset_bytes", area_offset_bytes)?;
        field(scheme.check_drives(drive_count).is_ok(), "erasure_shards", scheme.shards().into())?;
        let usable = drive_size_bytes.saturating_sub(area_offset_bytes + LOG_HEADER_BYTES);
        let segment_count = usable / unit_bytes;
        let unit_blocks = unit_bytes / BLOCK_BYTES_U64;
        field(segment_count >= 2, "segment_count", segment_count)?;
        let coded = scheme.parity_shards() > 0;
        let (data_shards, parity_shards) =
            if coded { (scheme.data_shards(), scheme.parity_shards()) } else { (1, 0) };
        let cells = unit_blocks * u64::from(drive_count);
        let positions_per_segment = if coded {
            let width = u64::from(data_shards) + u64::from(parity_shards);
            cells / width * u64::from(data_shards)
        } else {
            cells
        };
        let locations = segment_count * positions_per_segment;
        field(locations <= LOCATIONS_MAX, "segment_count", segment_count)?;
        let unit_blocks = unit_blocks as u32;
        let stripe_blocks = if coded {
            1
        } else {
            1u32 << unit_blocks.trailing_zeros().min(STRIPE_BLOCKS_MAX.ilog2())
        };
        debug_assert!(unit_blocks % stripe_blocks == 0);
        Ok(Self {
            drive_count,
            unit_blocks,
            stripe_blocks,
            segment_count: segment_count as u32,
            area_offset_bytes,
            data_shards,
            parity_shards,
            header_key: 0,
        })
    }

    /// This geometry with batch-header key `key`.
    pub fn with_header_key(self, key: u128) -> Self {
        Self { header_key: key, ..self }
    }

    /// True when the log keeps parity (erasure coding with `m >= 1`).
    pub fn is_coded(&self) -> bool {
        self.parity_shards > 0
    }

    /// The erasure-coding scheme (`1+0` without parity).
    pub fn scheme(&self) -> ErasureScheme {
        match ErasureScheme::new(self.data_shards, self.parity_shards) {
            Ok(scheme) => scheme,
            Err(error) => unreachable!("a geometry holds a valid scheme: {error}"),
        }
    }

    /// `w = k + m`: cells per stripe.
    pub fn stripe_width(&self) -> u32 {
        u32::from(self.data_shards) + u32::from(self.parity_shards)
    }

    /// A run of `positions` rounded up to whole stripes: what a batch of that many positions
    /// occupies (the padding cells hold zeros).
    pub fn padded(&self, positions: u32) -> u32 {
        if self.is_coded() {
            let k = u32::from(self.data_shards);
            positions.div_ceil(k) * k
        } else {
            positions
        }
    }

    /// Stripes in a segment (coded geometry).
    pub fn stripes_per_segment(&self) -> u32 {
        assert!(self.is_coded());
        self.positions_per_segment() / u32::from(self.data_shards)
    }

    /// The cell of shard `shard` (data `0..k`, then parity) of stripe `stripe` (coded geometry).
    pub fn cell(&self, stripe: u32, shard: u32) -> u32 {
        let width = self.stripe_width();
        assert!(self.is_coded() && shard < width && stripe < self.stripes_per_segment());
        stripe * width + (shard + self.rotation(stripe)) % width
    }

    /// How far stripe `stripe`'s shards are rotated: by the stripe number plus the row its first
    /// cell is on, which spreads parity over every drive whether or not `w` divides the drive
    /// count.
    fn rotation(&self, stripe: u32) -> u32 {
        let width = self.stripe_width();
        (stripe + stripe * width / u32::from(self.drive_count)) % width
    }

    /// (stripe, shard) of a cell, or `None` for the unused cells after the last stripe.
    pub fn cell_shard(&self, cell: u32) -> Option<(u32, u32)> {
        let width = self.stripe_width();
        let stripe = cell / width;
        if stripe >= self.stripes_per_segment() {
            return None;
        }
        let slot = cell % width;
        Some((stripe, (slot + width - self.rotation(stripe)) % width))
    }

    /// (drive, row) of a cell.
    pub fn cell_drive_row(&self, cell: u32) -> (u16, u32) {
        let drives = u32::from(self.drive_count);
        ((cell % drives) as u16, cell / drives)
    }

    /// For cells `first..end` of a segment: per drive, the first row and the row count it holds
    /// (each drive's cells in a range are one contiguous range of rows).
    pub fn cell_runs(&self, first: u32, end: u32) -> impl Iterator<Item = (u16, u32, u32)> {
        assert!(first <= end && end <= u32::from(self.drive_count) * self.unit_blocks);
        let drives = u32::from(self.drive_count);
        (0..self.drive_count).filter_map(move |drive| {
            let drive_u32 = u32::from(drive);
            let start = first + (drive_u32 + drives - first % drives) % drives;
            if start >= end {
                return None;
            }
            let last = end - 1 - ((end - 1) % drives + drives - drive_u32) % drives;
            Some((drive, start / drives, (last - start) / drives + 1))
        })
    }

    pub fn unit_bytes(&self) -> u64 {
        u64::from(self.unit_blocks) * BLOCK_BYTES_U64
    }

    pub fn positions_per_segment(&self) -> u32 {
        let cells = u32::from(self.drive_count) * self.unit_blocks;
        if self.is_coded() {
            cells / self.stripe_width() * u32::from(self.data_shards)
        } else {
            cells
        }
    }

    pub fn segment_bytes(&self) -> u64 {
        u64::from(self.positions_per_segment()) * BLOCK_BYTES_U64
    }

    pub fn location_count(&self) -> u64 {
        u64::from(self.segment_count) * u64::from(self.positions_per_segment())
    }

    pub fn location(&self, segment: u32, position: u32) -> u32 {
        assert!(segment < self.segment_count && position < self.positions_per_segment());
        segment * self.positions_per_segment() + position
    }

    /// (segment, position) of a location.
    pub fn split(&self, location: u32) -> (u32, u32) {
        assert!(u64::from(location) < self.location_count(), "location {location}");
        (location / self.positions_per_segment(), location % self.positions_per_segment())
    }

    /// Byte offset on its drive of a header-region block.
    pub fn header_offset_bytes(&self, block: u64) -> u64 {
        self.area_offset_bytes + block * BLOCK_BYTES_U64
    }

    /// (drive, byte offset) of a position of a segment.
    pub fn place(&self, segment: u32, position: u32) -> (u16, u64) {
        let (drive, row) = self.drive_row(position);
        (drive, self.row_offset_bytes(segment, row))
    }

    /// (drive, row) of a position of a segment.
    pub fn drive_row(&self, position: u32) -> (u16, u32) {
        assert!(position < self.positions_per_segment(), "position {position}");
        if self.is_coded() {
            let k = u32::from(self.data_shards);
            return self.cell_drive_row(self.cell(position / k, position % k));
        }
        let drives = u32::from(self.drive_count);
        let chunk = position / self.stripe_blocks;
        let drive = (chunk % drives) as u16;
        let row = (chunk / drives) * self.stripe_blocks + position % self.stripe_blocks;
        (drive, row)
    }

    /// The position of a segment at `row` of `drive` (the inverse of [`Geometry::drive_row`]).
    pub fn position_of(&self, drive: u16, row: u32) -> u32 {
        assert!(drive < self.drive_count && row < self.unit_blocks);
        assert!(!self.is_coded(), "a coded geometry maps cells with cell_shard");
        let chunk = (row / self.stripe_blocks) * u32::from(self.drive_count) + u32::from(drive);
        chunk * self.stripe_blocks + row % self.stripe_blocks
    }

    /// Byte offset of a row of a segment's unit (the same on every drive).
    pub fn row_offset_bytes(&self, segment: u32, row: u32) -> u64 {
        assert!(segment < self.segment_count && row < self.unit_blocks);
        self.area_offset_bytes
            + LOG_HEADER_BYTES
            + u64::from(segment) * self.unit_bytes()
            + u64::from(row) * BLOCK_BYTES_U64
    }

    /// Positions from `position` to the end of its stripe chunk, `position` included (the
    /// positions after them sit on the next drive).
    pub fn chunk_room(&self, position: u32) -> u32 {
        self.stripe_blocks - position % self.stripe_blocks
    }

    /// For positions `first..first + count` of a segment: per drive, the first row and the row
    /// count it holds (drives holding none are skipped).
    pub fn drive_runs(&self, first: u32, count: u32) -> impl Iterator<Item = (u16, u32, u32)> {
        assert!(!self.is_coded(), "a coded geometry reads and writes whole stripes (cell_runs)");
        assert!(u64::from(first) + u64::from(count) <= u64::from(self.positions_per_segment()));
        let drives = u32::from(self.drive_count);
        let stripe = self.stripe_blocks;
        let geometry = *self;
        (0..self.drive_count).filter_map(move |drive| {
            if count == 0 {
                return None;
            }
            let drive_u32 = u32::from(drive);
            let end = first + count;
            // The first position >= first on this drive: in first's chunk, or at the start of
            // the drive's next chunk.
            let first_chunk = first / stripe;
            let start = if first_chunk % drives == drive_u32 {
                first
            } else {
                (first_chunk + (drive_u32 + drives - first_chunk % drives) % drives) * stripe
            };
            // The last position < end on this drive: in the last position's chunk, or at the
            // end of the drive's previous chunk.
            let last_chunk = (end - 1) / stripe;
            let back = (last_chunk % drives + drives - drive_u32) % drives;
            let last = if back == 0 {
                end - 1
            } else if last_chunk >= back {
                (last_chunk - back) * stripe + stripe - 1
            } else {
                return None;
            };
            if start >= end || last < first || start > last {
                return None;
            }
            let first_row = geometry.drive_row(start).1;
            let last_row = geometry.drive_row(last).1;
            Some((drive, first_row, last_row - first_row + 1))
        })
    }
}

/// The per-drive log superblock: names the node, the drive and the geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSuperblock {
    pub node_uuid: NodeUuid,
    pub drive_index: u16,
    pub geometry: Geometry,
    /// A replacement drive whose rebuild has not finished: its cells are not to be trusted
    /// (coded logs; the rebuild starts again at the next open).
    pub rebuilding: bool,
}

impl LogSuperblock {
    pub fn encode(&self) -> [u8; BLOCK_BYTES] {
        let mut block = [0u8; BLOCK_BYTES];
        put(&mut block, 0, &LOG_SUPERBLOCK_MAGIC);
        put(&mut block, 16, &LOG_FORMAT_VERSION.to_le_bytes());
        put(&mut block, 20, &self.drive_index.to_le_bytes());
        put(&mut block, 22, &self.geometry.drive_count.to_le_bytes());
        put(&mut block, 24, &self.node_uuid.0);
        put(&mut block, 40, &self.geometry.area_offset_bytes.to_le_bytes());
        put(&mut block, 48, &self.geometry.unit_bytes().to_le_bytes());
        put(&mut block, 56, &self.geometry.segment_count.to_le_bytes());
        block[60] = self.geometry.data_shards;
        block[61] = self.geometry.parity_shards;
        block[62] = u8::from(self.rebuilding);
        put(&mut block, 64, &self.geometry.header_key.to_le_bytes());
        seal(&mut block);
        block
    }

    pub fn decode(block: &[u8]) -> Result<Self, DecodeError> {
        check_block(block, &LOG_SUPERBLOCK_MAGIC, 16)?;
        let drive_index = le_u16(block, 20);
        let drive_count = le_u16(block, 22);
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&block[24..40]);
        let area_offset_bytes = le_u64(block, 40);
        let unit_bytes = le_u64(block, 48);
        let segment_count = le_u32(block, 56);
        field(drive_index < drive_count, "drive_index", drive_index.into())?;
        field(block[62] <= 1, "flags", block[62].into())?;
        field(block[63] == 0, "reserved", block[63].into())?;
        let rebuilding = block[62] == 1;
        let (data_shards, parity_shards) = (block[60], block[61]);
        let Ok(scheme) = ErasureScheme::new(data_shards, parity_shards) else {
            return Err(DecodeError::FieldInvalid {
                field: "erasure_shards",
                value: u64::from(data_shards) << 8 | u64::from(parity_shards),
            });
        };
        field(parity_shards > 0 || data_shards == 1, "data_shards", data_shards.into())?;
        // Recompute the geometry from the recorded sizes so every derived field is consistent.
        let size_bytes = area_offset_bytes
            .checked_add(LOG_HEADER_BYTES)
            .and_then(|bytes| bytes.checked_add(u64::from(segment_count).checked_mul(unit_bytes)?));
        let Some(size_bytes) = size_bytes else {
            return Err(DecodeError::FieldInvalid {
                field: "segment_count",
                value: segment_count.into(),
            });
        };
        let geometry =
            Geometry::coded(drive_count, size_bytes, unit_bytes, area_offset_bytes, scheme)?
                .with_header_key(le_u128(block, 64));
        field(geometry.segment_count == segment_count, "segment_count", segment_count.into())?;
        field(!rebuilding || geometry.is_coded(), "flags", block[62].into())?;
        Ok(Self { node_uuid: NodeUuid(uuid), drive_index, geometry, rebuilding })
    }
}

/// The checkpoint root: which checkpoint is current and where recovery starts replaying.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Root {
    /// Increases by one per checkpoint; the root is written to slot `checkpoint_id % 2`.
    pub checkpoint_id: u64,
    /// Every batch with a smaller LSN is reflected in the checkpoint; replay applies the others.
    pub lsn_floor: u64,
    /// Every segment opened with a smaller sequence number holds only batches below
    /// `lsn_floor`; recovery replays the segments at or above it.
    pub segment_seq_floor: u64,
    /// The LSN and segment sequence counters when the checkpoint was taken (lower bounds for
    /// the counters after recovery).
    pub lsn_next: u64,
    pub segment_seq_next: u64,
    pub entry_count: u64,
    /// Blocks of index entries (each holds 169 to 505 of them: see
    /// [`CheckpointBlockWriter`]).
    pub entry_blocks: u64,
    /// Layer-table records, in blocks after the entry blocks.
    pub layer_record_count: u64,
    /// The segments holding the checkpoint blocks, in order.
    pub segments: Vec<u32>,
    /// Sequence numbers of segments that were open when the checkpoint was taken: replayed
    /// too, though below `segment_seq_floor`.
    pub open_seqs: Vec<u64>,
}

impl Root {
    /// Blocks of index entries, then blocks of layer records.
    pub fn checkpoint_blocks(&self) -> u64 {
        self.entry_blocks
            .saturating_add(self.layer_record_count.div_ceil(LAYER_RECORDS_PER_BLOCK as u64))
    }

    /// The root's blocks: the first, then as many continuation blocks as its lists need.
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.segments.len() <= ROOT_SEGMENTS_MAX);
        assert!(self.open_seqs.len() <= ROOT_OPEN_SEGMENTS_MAX);
        let mut lists = Vec::with_capacity(4 * self.segments.len() + 8 * self.open_seqs.len());
        for segment in &self.segments {
            lists.extend_from_slice(&segment.to_le_bytes());
        }
        for seq in &self.open_seqs {
            lists.extend_from_slice(&seq.to_le_bytes());
        }
        let first_room = CHECKSUM_OFFSET - ROOT_LISTS_OFFSET;
        let more_room = CHECKSUM_OFFSET - ROOT_CONTINUATION_LISTS_OFFSET;
        let block_count = 1 + lists.len().saturating_sub(first_room).div_ceil(more_room);
        assert!(block_count <= ROOT_BLOCKS_MAX);
        let mut blocks = vec![0u8; block_count * BLOCK_BYTES];
        let (first, rest) = blocks.split_at_mut(BLOCK_BYTES);
        put(first, 0, &ROOT_MAGIC);
        put(first, 8, &LOG_FORMAT_VERSION.to_le_bytes());
        put(first, 12, &(self.segments.len() as u32).to_le_bytes());
        put(first, 16, &self.checkpoint_id.to_le_bytes());
        put(first, 24, &self.lsn_floor.to_le_bytes());
        put(first, 32, &self.segment_seq_floor.to_le_bytes());
        put(first, 40, &self.entry_count.to_le_bytes());
        put(first, 48, &self.lsn_next.to_le_bytes());
        put(first, 56, &self.segment_seq_next.to_le_bytes());
        put(first, ROOT_OPEN_COUNT_OFFSET, &(self.open_seqs.len() as u32).to_le_bytes());
        put(first, ROOT_LAYER_COUNT_OFFSET, &self.layer_record_count.to_le_bytes());
        put(first, ROOT_ENTRY_BLOCKS_OFFSET, &self.entry_blocks.to_le_bytes());
        put(first, ROOT_BLOCK_COUNT_OFFSET, &(block_count as u32).to_le_bytes());
        let (head, mut tail) = lists.split_at(lists.len().min(first_room));
        put(first, ROOT_LISTS_OFFSET, head);
        seal(first);
        for (index, block) in rest.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            let (part, left) = tail.split_at(tail.len().min(more_room));
            put(block, 0, &ROOT_CONTINUATION_MAGIC);
            put(block, 8, &LOG_FORMAT_VERSION.to_le_bytes());
            put(block, 12, &(index as u32 + 1).to_le_bytes());
            put(block, 16, &self.checkpoint_id.to_le_bytes());
            put(block, ROOT_CONTINUATION_LISTS_OFFSET, part);
            seal(block);
            tail = left;
        }
        blocks
    }

    /// Decodes the root at the start of `slot` (a root slot's blocks as read, at least the
    /// first; a root spanning more than `slot` holds is refused).
    pub fn decode(slot: &[u8], geometry: &Geometry) -> Result<Self, DecodeError> {
        let first = slot
            .get(..BLOCK_BYTES)
            .ok_or(DecodeError::FieldInvalid { field: "root_blocks", value: 0 })?;
        check_block(first, &ROOT_MAGIC, 8)?;
        let count = le_u32(first, 12) as usize;
        field(count <= ROOT_SEGMENTS_MAX, "segment_list_length", count as u64)?;
        let open_count = le_u32(first, ROOT_OPEN_COUNT_OFFSET) as usize;
        field(open_count <= ROOT_OPEN_SEGMENTS_MAX, "open_list_length", open_count as u64)?;
        let checkpoint_id = le_u64(first, 16);
        let block_count = le_u32(first, ROOT_BLOCK_COUNT_OFFSET) as usize;
        field(
            (1..=ROOT_BLOCKS_MAX).contains(&block_count) && block_count * BLOCK_BYTES <= slot.len(),
            "root_blocks",
            block_count as u64,
        )?;
        // The lists, gathered from every block of the root.
        let mut lists = first[ROOT_LISTS_OFFSET..CHECKSUM_OFFSET].to_vec();
        for index in 1..block_count {
            let block = &slot[index * BLOCK_BYTES..(index + 1) * BLOCK_BYTES];
            check_block(block, &ROOT_CONTINUATION_MAGIC, 8)?;
            field(
                le_u32(block, 12) as usize == index,
                "root_block_index",
                le_u32(block, 12).into(),
            )?;
            field(le_u64(block, 16) == checkpoint_id, "checkpoint_id", le_u64(block, 16))?;
            lists.extend_from_slice(&block[ROOT_CONTINUATION_LISTS_OFFSET..CHECKSUM_OFFSET]);
        }
        let open_offset = 4 * count;
        field(open_offset + 8 * open_count <= lists.len(), "root_blocks", block_count as u64)?;
        let root = Self {
            checkpoint_id,
            lsn_floor: le_u64(first, 24),
            segment_seq_floor: le_u64(first, 32),
            entry_count: le_u64(first, 40),
            entry_blocks: le_u64(first, ROOT_ENTRY_BLOCKS_OFFSET),
            layer_record_count: le_u64(first, ROOT_LAYER_COUNT_OFFSET),
            lsn_next: le_u64(first, 48),
            segment_seq_next: le_u64(first, 56),
            segments: (0..count).map(|i| le_u32(&lists, 4 * i)).collect(),
            open_seqs: (0..open_count).map(|i| le_u64(&lists, open_offset + 8 * i)).collect(),
        };
        field(root.checkpoint_id > 0, "checkpoint_id", 0)?;
        field(root.lsn_floor <= root.lsn_next, "lsn_floor", root.lsn_floor)?;
        field(
            root.segment_seq_floor <= root.segment_seq_next,
            "segment_seq_floor",
            root.segment_seq_floor,
        )?;
        // Every entry block holds at least one entry and at most a run's worth.
        field(root.entry_blocks <= root.entry_count, "entry_blocks", root.entry_blocks)?;
        field(
            root.entry_count
                <= root.entry_blocks.saturating_mul(CHECKPOINT_ENTRIES_PER_BLOCK_MAX as u64),
            "entry_count",
            root.entry_count,
        )?;
        let blocks_needed = root.checkpoint_blocks();
        let blocks_held = count as u64 * u64::from(geometry.positions_per_segment());
        field(blocks_needed <= blocks_held, "entry_blocks", root.entry_blocks)?;
        for segment in &root.segments {
            field(*segment < geometry.segment_count, "checkpoint_segment", (*segment).into())?;
        }
        Ok(root)
    }
}

/// What one batch-header entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A host write of one block; its data is the batch's next data block.
    Data { crc: u32 },
    /// A block GC copied from `from` (a location); its data is the batch's next data block.
    Relocated { crc: u32, from: u32 },
    /// `count` blocks from `block` read as zeros (deallocate, write zeroes).
    Trim { count: u32 },
    /// The volume or snapshot with this id is gone (its layer is freed, merged or kept for
    /// the layers on it).
    VolumeDeleted,
    /// Snapshot `snapshot` of the entry's volume: the volume's layer now serves the snapshot and
    /// the volume continues in the new empty layer `layer` on it.
    Snapshot { snapshot: u64, layer: u64 },
    /// The entry's volume is created as the new empty layer `layer` on snapshot `snapshot`'s.
    Clone { snapshot: u64, layer: u64 },
    /// The entry's volume continues in the new empty layer `layer` on snapshot `snapshot`'s; its
    /// previous layer is released.
    Rollback { snapshot: u64, layer: u64 },
    /// GC dropped the block of a layer kept only for the layers on it, all of which hide it:
    /// applied only if the layer (not one it merged into) still maps it at `location` with
    /// index tag `tag` ([`TAG_BITS`](super::index::TAG_BITS) wide).
    Dropped { tag: u32, location: u32 },
    /// A host write of one block stored compressed in a pack slot of `1 << cells_log2` cells, at
    /// `sub`. An entry that `opens` a slot takes the batch's next data block; the others are in
    /// the slot the latest opening entry with the same `cells_log2` took.
    Packed { crc: u32, cells_log2: u8, sub: u8, opens: bool },
    /// A compressed block GC moved from sub-index `from_sub` of the slot at location `from` to
    /// sub-index `sub` of a slot of this batch (same cell count), data as for `Packed`.
    RelocatedPacked { crc: u32, from: u32, from_sub: u8, cells_log2: u8, sub: u8, opens: bool },
}

/// Which data block of a batch each entry's data is in, walking the entries in order.
#[derive(Debug, Default, Clone)]
pub struct DataSlots {
    next: u32,
    /// Per `cells_log2 - 1`, the data block of the latest slot opened.
    open: [Option<u32>; 4],
}

impl DataSlots {
    /// The data block (counted from 0 after the header) of the entry, or `None` if it carries
    /// no data or names a slot no earlier entry opened (refused by decode).
    pub fn next(&mut self, kind: &EntryKind) -> Option<u32> {
        match *kind {
            EntryKind::Data { .. } | EntryKind::Relocated { .. } => {
                self.next += 1;
                Some(self.next - 1)
            }
            EntryKind::Packed { cells_log2, opens, .. }
            | EntryKind::RelocatedPacked { cells_log2, opens, .. } => {
                let class = usize::from(cells_log2.clamp(1, 4) - 1);
                if opens {
                    self.open[class] = Some(self.next);
                    self.next += 1;
                }
                self.open[class]
            }
            _ => None,
        }
    }
}

/// One entry of a batch header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub volume: u64,
    /// The volume block number (the first one for a trim).
    pub block: u64,
    pub kind: EntryKind,
}

impl Entry {
    /// True if the entry takes a data block of the batch (a raw block, or a pack slot it opens).
    pub fn has_data(&self) -> bool {
        match self.kind {
            EntryKind::Data { .. } | EntryKind::Relocated { .. } => true,
            EntryKind::Packed { opens, .. } | EntryKind::RelocatedPacked { opens, .. } => opens,
            _ => false,
        }
    }

    /// True if the entry's block is stored compressed in a pack slot.
    pub fn is_packed(&self) -> bool {
        matches!(self.kind, EntryKind::Packed { .. } | EntryKind::RelocatedPacked { .. })
    }
}

const KIND_DATA: u8 = 1;
const KIND_RELOCATED: u8 = 2;
const KIND_TRIM: u8 = 3;
const KIND_VOLUME_DELETED: u8 = 4;
const KIND_SNAPSHOT: u8 = 5;
const KIND_CLONE: u8 = 6;
const KIND_ROLLBACK: u8 = 7;
const KIND_DROPPED: u8 = 8;
const KIND_PACKED: u8 = 9;
const KIND_RELOCATED_PACKED: u8 = 10;

/// A batch header: the first position of every batch. Its entries describe the data blocks
/// that follow it (in order) and the trims of the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHeader {
    pub segment: u32,
    pub segment_seq: u64,
    pub position: u32,
    pub lsn: u64,
    pub entries: Vec<Entry>,
}

impl BatchHeader {
    pub fn data_blocks(&self) -> u32 {
        self.entries.iter().filter(|entry| entry.has_data()).count() as u32
    }

    /// Positions the batch occupies: the header and its data blocks.
    pub fn positions(&self) -> u32 {
        1 + self.data_blocks()
    }

    /// The header block, tagged with `geometry`'s header key (see [`Geometry::header_key`]).
    pub fn encode(&self, geometry: &Geometry) -> [u8; BLOCK_BYTES] {
        assert!(!self.entries.is_empty() && self.entries.len() <= BATCH_ENTRIES_MAX);
        let mut block = [0u8; BLOCK_BYTES];
        put(&mut block, 0, &BATCH_MAGIC);
        put(&mut block, 8, &LOG_FORMAT_VERSION.to_le_bytes());
        put(&mut block, 12, &(self.entries.len() as u16).to_le_bytes());
        put(&mut block, 16, &self.segment_seq.to_le_bytes());
        put(&mut block, 24, &self.lsn.to_le_bytes());
        put(&mut block, 32, &self.segment.to_le_bytes());
        put(&mut block, 36, &self.position.to_le_bytes());
        put(&mut block, 40, &self.data_blocks().to_le_bytes());
        // Bytes 44..48: parity blocks of the batch, zero until erasure coding (issue 5).
        for (index, entry) in self.entries.iter().enumerate() {
            let offset = BATCH_ENTRIES_OFFSET + index * ENTRY_BYTES;
            assert!(entry.block < VOLUME_BLOCKS_MAX);
            put(&mut block, offset, &entry.volume.to_le_bytes());
            put(&mut block, offset + 8, &entry.block.to_le_bytes());
            // Layer operations: the snapshot id in the block field, the new layer's label split
            // over the word (low half) and from (high half) fields.
            let layer_op = |kind: u8, snapshot: u64, layer: u64| {
                assert!(entry.block == 0 && snapshot < VOLUME_BLOCKS_MAX);
                (kind, layer as u32, (layer >> 32) as u32, snapshot)
            };
            let (kind, word, from, block_field) = match entry.kind {
                EntryKind::Snapshot { snapshot, layer } => layer_op(KIND_SNAPSHOT, snapshot, layer),
                EntryKind::Clone { snapshot, layer } => layer_op(KIND_CLONE, snapshot, layer),
                EntryKind::Rollback { snapshot, layer } => layer_op(KIND_ROLLBACK, snapshot, layer),
                other => {
                    let (kind, word, from) = match other {
                        EntryKind::Data { crc } => (KIND_DATA, crc, 0),
                        EntryKind::Relocated { crc, from } => (KIND_RELOCATED, crc, from),
                        EntryKind::Trim { count } => {
                            assert!(
                                count > 0 && entry.block + u64::from(count) <= VOLUME_BLOCKS_MAX
                            );
                            (KIND_TRIM, count, 0)
                        }
                        EntryKind::VolumeDeleted => (KIND_VOLUME_DELETED, 0, 0),
                        EntryKind::Dropped { tag, location } => (KIND_DROPPED, tag, location),
                        EntryKind::Packed { crc, .. } => (KIND_PACKED, crc, 0),
                        EntryKind::RelocatedPacked { crc, from, .. } => {
                            (KIND_RELOCATED_PACKED, crc, from)
                        }
                        _ => unreachable!("layer operations are matched above"),
                    };
                    (kind, word, from, entry.block)
                }
            };
            put(&mut block, offset + 8, &block_field.to_le_bytes());
            put(&mut block, offset + 16, &word.to_le_bytes());
            block[offset + 20] = kind;
            put(&mut block, offset + 24, &from.to_le_bytes());
            if let EntryKind::Packed { cells_log2, sub, opens, .. }
            | EntryKind::RelocatedPacked { cells_log2, sub, opens, .. } = entry.kind
            {
                assert!((1..=4).contains(&cells_log2) && u32::from(sub) < 1 << cells_log2);
                block[offset + 21] = sub;
                block[offset + 22] = cells_log2;
                block[offset + 23] = u8::from(opens);
            }
            if let EntryKind::RelocatedPacked { from_sub, .. } = entry.kind {
                put(&mut block, offset + 28, &u32::from(from_sub).to_le_bytes());
            }
        }
        tag_batch_header(&mut block, geometry);
        block
    }

    /// Decodes the header expected at `position` of `segment`. The segment sequence is checked
    /// by the caller (a stale header of an earlier use of the segment decodes fine).
    pub fn decode(
        block: &[u8],
        geometry: &Geometry,
        segment: u32,
        position: u32,
    ) -> Result<Self, DecodeError> {
        check_block(block, &BATCH_MAGIC, 8)?;
        let count = usize::from(le_u16(block, 12));
        field((1..=BATCH_ENTRIES_MAX).contains(&count), "entry_count", count as u64)?;
        if le_u64(block, HEADER_TAG_OFFSET) != header_tag(block, count, geometry.header_key) {
            return Err(DecodeError::HeaderTagMismatch);
        }
        let header_segment = le_u32(block, 32);
        let header_position = le_u32(block, 36);
        field(header_segment == segment, "segment", header_segment.into())?;
        field(header_position == position, "position", header_position.into())?;
        field(le_u32(block, 44) == 0, "parity_blocks", le_u32(block, 44).into())?;
        let mut entries = Vec::with_capacity(count);
        let mut slots = DataSlots::default();
        for index in 0..count {
            let offset = BATCH_ENTRIES_OFFSET + index * ENTRY_BYTES;
            let volume = le_u64(block, offset);
            let first = le_u64(block, offset + 8);
            let word = le_u32(block, offset + 16);
            let from = le_u32(block, offset + 24);
            field(first < VOLUME_BLOCKS_MAX, "block", first)?;
            let kind_byte = block[offset + 20];
            let packed = matches!(kind_byte, KIND_PACKED | KIND_RELOCATED_PACKED);
            let (sub, cells_log2, opens) =
                (block[offset + 21], block[offset + 22], block[offset + 23]);
            if packed {
                field((1..=4).contains(&cells_log2), "cells", cells_log2.into())?;
                field(u32::from(sub) < 1 << cells_log2, "sub", sub.into())?;
                field(opens <= 1 && (opens == 0 || sub == 0), "opens", opens.into())?;
                field(
                    opens == 1 || slots.open[usize::from(cells_log2 - 1)].is_some(),
                    "slot",
                    index as u64,
                )?;
            } else {
                field(block[offset + 21..offset + 24] == [0; 3], "entry_reserved", index as u64)?;
            }
            let from_sub = le_u32(block, offset + 28);
            if kind_byte == KIND_RELOCATED_PACKED {
                field(from_sub < 1 << cells_log2, "from_sub", from_sub.into())?;
            } else {
                field(from_sub == 0, "entry_reserved", index as u64)?;
            }
            let kind = match kind_byte {
                KIND_DATA => EntryKind::Data { crc: word },
                KIND_RELOCATED => {
                    field(u64::from(from) < geometry.location_count(), "from", from.into())?;
                    EntryKind::Relocated { crc: word, from }
                }
                KIND_TRIM => {
                    let end = first + u64::from(word);
                    field(word > 0 && end <= VOLUME_BLOCKS_MAX, "trim_count", word.into())?;
                    EntryKind::Trim { count: word }
                }
                KIND_VOLUME_DELETED => EntryKind::VolumeDeleted,
                KIND_PACKED => EntryKind::Packed { crc: word, cells_log2, sub, opens: opens == 1 },
                KIND_RELOCATED_PACKED => {
                    field(u64::from(from) < geometry.location_count(), "from", from.into())?;
                    EntryKind::RelocatedPacked {
                        crc: word,
                        from,
                        from_sub: from_sub as u8,
                        cells_log2,
                        sub,
                        opens: opens == 1,
                    }
                }
                KIND_DROPPED => {
                    field(u64::from(from) < geometry.location_count(), "from", from.into())?;
                    field(word < 1 << TAG_BITS, "tag", word.into())?;
                    EntryKind::Dropped { tag: word, location: from }
                }
                KIND_SNAPSHOT | KIND_CLONE | KIND_ROLLBACK => {
                    let layer = u64::from(word) | (u64::from(from) << 32);
                    field(layer >= super::index::LAYER_LABEL_BASE, "layer", layer)?;
                    let snapshot = first;
                    match block[offset + 20] {
                        KIND_SNAPSHOT => EntryKind::Snapshot { snapshot, layer },
                        KIND_CLONE => EntryKind::Clone { snapshot, layer },
                        _ => EntryKind::Rollback { snapshot, layer },
                    }
                }
                other => {
                    return Err(DecodeError::FieldInvalid { field: "kind", value: other.into() })
                }
            };
            let layer_op = matches!(
                kind,
                EntryKind::Snapshot { .. } | EntryKind::Clone { .. } | EntryKind::Rollback { .. }
            );
            slots.next(&kind);
            let carries_location = matches!(
                kind,
                EntryKind::Relocated { .. }
                    | EntryKind::Dropped { .. }
                    | EntryKind::RelocatedPacked { .. }
            );
            if !carries_location && !layer_op {
                field(from == 0, "from", from.into())?;
            }
            let first = if layer_op { 0 } else { first };
            entries.push(Entry { volume, block: first, kind });
        }
        let header = Self {
            segment,
            segment_seq: le_u64(block, 16),
            position,
            lsn: le_u64(block, 24),
            entries,
        };
        let data_blocks = le_u32(block, 40);
        field(header.data_blocks() == data_blocks, "data_blocks", data_blocks.into())?;
        let end = u64::from(position) + u64::from(header.positions());
        field(
            end <= u64::from(geometry.positions_per_segment()),
            "data_blocks",
            data_blocks.into(),
        )?;
        Ok(header)
    }
}

/// One index entry in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointEntry {
    pub volume: u64,
    pub block: u64,
    pub location: u32,
    /// The entry's index tag ([`TAG_BITS`] wide), or `u32::MAX` with [`TOMBSTONE_LOCATION`].
    pub tag: u32,
}

/// Where a checkpoint entry block keeps its entry and run counts.
const CHECKPOINT_ENTRY_COUNT_OFFSET: usize = 24;
const CHECKPOINT_RUN_COUNT_OFFSET: usize = 28;
/// The most blocks one run may cover (its count is 16 bits).
const CHECKPOINT_RUN_SLOTS_MAX: u16 = u16::MAX;
const _: () = assert!(CHECKPOINT_ENTRIES_PER_BLOCK_MAX <= CHECKPOINT_RUN_SLOTS_MAX as usize);

/// Fills checkpoint entry block `index` of checkpoint `checkpoint_id` in place: entries are
/// pushed in the order the index is walked (by layer, then by block), and consecutive blocks
/// of one layer share a run, so a densely mapped volume costs 8 bytes per block and a sparse
/// one at most 24.
pub struct CheckpointBlockWriter<'a> {
    block: &'a mut [u8],
    /// Bytes of runs written so far.
    used: usize,
    entries: u32,
    runs: u32,
    /// The open run: its layer, the block its next slot would hold, and its header's offset.
    run: Option<(u64, u64, usize)>,
}

impl<'a> CheckpointBlockWriter<'a> {
    /// Starts a block in `block` (one block's bytes, overwritten).
    pub fn new(block: &'a mut [u8]) -> Self {
        assert_eq!(block.len(), BLOCK_BYTES, "on-disk structures are one block");
        block.fill(0);
        Self { block, used: 0, entries: 0, runs: 0, run: None }
    }

    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Adds one entry; false (and nothing written) when the block has no room left for it.
    /// Entries of one layer come in ascending block order.
    pub fn push(&mut self, entry: &CheckpointEntry) -> bool {
        assert!(entry.block < VOLUME_BLOCKS_MAX, "block {} beyond any volume", entry.block);
        let extends = match self.run {
            Some((volume, next, header)) => {
                volume == entry.volume
                    && next == entry.block
                    && le_u16(self.block, CHECKPOINT_RUNS_OFFSET + header + 14)
                        < CHECKPOINT_RUN_SLOTS_MAX
            }
            None => false,
        };
        let needed = CHECKPOINT_SLOT_BYTES + if extends { 0 } else { CHECKPOINT_RUN_HEADER_BYTES };
        if self.used + needed > CHECKPOINT_RUNS_BYTES {
            return false;
        }
        let base = CHECKPOINT_RUNS_OFFSET;
        let header = match self.run {
            Some((_, _, header)) if extends => header,
            _ => {
                let header = self.used;
                let at = base + header;
                put(self.block, at, &entry.volume.to_le_bytes());
                put(self.block, at + 8, &entry.block.to_le_bytes()[..6]);
                self.used += CHECKPOINT_RUN_HEADER_BYTES;
                self.runs += 1;
                header
            }
        };
        let count_at = base + header + 14;
        let count = le_u16(self.block, count_at) + 1;
        put(self.block, count_at, &count.to_le_bytes());
        put(self.block, base + self.used, &entry.location.to_le_bytes());
        put(self.block, base + self.used + 4, &entry.tag.to_le_bytes());
        self.used += CHECKPOINT_SLOT_BYTES;
        self.entries += 1;
        self.run = Some((entry.volume, entry.block + 1, header));
        true
    }

    /// Writes the header and the checksum; returns the entries the block holds.
    pub fn finish(self, checkpoint_id: u64, index: u32) -> u32 {
        put(self.block, 0, &CHECKPOINT_MAGIC);
        put(self.block, 8, &LOG_FORMAT_VERSION.to_le_bytes());
        put(self.block, 12, &index.to_le_bytes());
        put(self.block, 16, &checkpoint_id.to_le_bytes());
        put(self.block, CHECKPOINT_ENTRY_COUNT_OFFSET, &self.entries.to_le_bytes());
        put(self.block, CHECKPOINT_RUN_COUNT_OFFSET, &self.runs.to_le_bytes());
        seal(self.block);
        self.entries
    }
}

/// Decodes entry block `index` of checkpoint `checkpoint_id`, appending its entries to `out`.
pub fn decode_checkpoint_block(
    block: &[u8],
    geometry: &Geometry,
    checkpoint_id: u64,
    index: u32,
    out: &mut Vec<CheckpointEntry>,
) -> Result<(), DecodeError> {
    check_block(block, &CHECKPOINT_MAGIC, 8)?;
    let found_index = le_u32(block, 12);
    let found_id = le_u64(block, 16);
    field(found_index == index, "block_index", found_index.into())?;
    field(found_id == checkpoint_id, "checkpoint_id", found_id)?;
    let entry_count = le_u32(block, CHECKPOINT_ENTRY_COUNT_OFFSET);
    let run_count = le_u32(block, CHECKPOINT_RUN_COUNT_OFFSET);
    let entries_max = CHECKPOINT_ENTRIES_PER_BLOCK_MAX as u32;
    field((1..=entries_max).contains(&entry_count), "entry_count", entry_count.into())?;
    field((1..=entry_count).contains(&run_count), "run_count", run_count.into())?;
    let mut at = CHECKPOINT_RUNS_OFFSET;
    let mut decoded = 0u32;
    for _ in 0..run_count {
        // Each run's header and slots lie before the checksum (checked before reading them).
        field(at + CHECKPOINT_RUN_HEADER_BYTES <= CHECKSUM_OFFSET, "run_count", run_count.into())?;
        let volume = le_u64(block, at);
        let mut first = [0u8; 8];
        first[..6].copy_from_slice(&block[at + 8..at + 14]);
        let first = u64::from_le_bytes(first);
        let slots = le_u16(block, at + 14);
        field(slots > 0, "run_slots", 0)?;
        field(first + u64::from(slots) <= VOLUME_BLOCKS_MAX, "block", first)?;
        at += CHECKPOINT_RUN_HEADER_BYTES;
        let end = at + usize::from(slots) * CHECKPOINT_SLOT_BYTES;
        field(end <= CHECKSUM_OFFSET, "run_slots", slots.into())?;
        decoded += u32::from(slots);
        field(decoded <= entry_count, "entry_count", entry_count.into())?;
        for (slot, offset) in (at..end).step_by(CHECKPOINT_SLOT_BYTES).enumerate() {
            let entry = CheckpointEntry {
                volume,
                block: first + slot as u64,
                location: le_u32(block, offset),
                tag: le_u32(block, offset + 4),
            };
            let tombstone = entry.location == TOMBSTONE_LOCATION && entry.tag == u32::MAX;
            field(tombstone || entry.tag < 1 << TAG_BITS, "tag", entry.tag.into())?;
            field(
                tombstone || u64::from(entry.location) < geometry.location_count(),
                "location",
                entry.location.into(),
            )?;
            out.push(entry);
        }
        at = end;
    }
    field(decoded == entry_count, "entry_count", entry_count.into())?;
    Ok(())
}

/// One record of a checkpoint's layer table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerRecordEntry {
    /// A layer: its label, the layer under it, the volume or snapshot it serves, and whether it
    /// is a snapshot's (read-only).
    Layer { label: u64, parent: Option<u64>, bound: Option<u64>, frozen: bool },
    /// An external id bound to a layer (the layer's own record names only one).
    Binding { id: u64, label: u64 },
    /// A merged layer's label and the layer that took its blocks.
    Alias { from: u64, to: u64 },
    /// The next label the engine gives a layer.
    NextLabel { label: u64 },
}

const RECORD_LAYER: u8 = 1;
const RECORD_BINDING: u8 = 2;
const RECORD_ALIAS: u8 = 3;
const RECORD_NEXT_LABEL: u8 = 4;
const NONE_ID: u64 = u64::MAX;

/// Encodes block `index` (counted from the first block of the checkpoint) of checkpoint
/// `checkpoint_id`'s layer records.
pub fn encode_layer_block(
    checkpoint_id: u64,
    index: u32,
    records: &[LayerRecordEntry],
) -> [u8; BLOCK_BYTES] {
    assert!(records.len() <= LAYER_RECORDS_PER_BLOCK);
    let mut block = [0u8; BLOCK_BYTES];
    put(&mut block, 0, &LAYERS_MAGIC);
    put(&mut block, 8, &LOG_FORMAT_VERSION.to_le_bytes());
    put(&mut block, 12, &index.to_le_bytes());
    put(&mut block, 16, &checkpoint_id.to_le_bytes());
    put(&mut block, 24, &(records.len() as u32).to_le_bytes());
    for (slot, record) in records.iter().enumerate() {
        let offset = LAYER_RECORDS_OFFSET + slot * LAYER_RECORD_BYTES;
        let (kind, a, b, c) = match *record {
            LayerRecordEntry::Layer { label, parent, bound, frozen } => {
                block[offset + 1] = u8::from(frozen);
                (RECORD_LAYER, label, parent.unwrap_or(NONE_ID), bound.unwrap_or(NONE_ID))
            }
            LayerRecordEntry::Binding { id, label } => (RECORD_BINDING, id, label, 0),
            LayerRecordEntry::Alias { from, to } => (RECORD_ALIAS, from, to, 0),
            LayerRecordEntry::NextLabel { label } => (RECORD_NEXT_LABEL, label, 0, 0),
        };
        block[offset] = kind;
        put(&mut block, offset + 8, &a.to_le_bytes());
        put(&mut block, offset + 16, &b.to_le_bytes());
        put(&mut block, offset + 24, &c.to_le_bytes());
    }
    seal(&mut block);
    block
}

/// Decodes layer block `index` of checkpoint `checkpoint_id`, appending its records to `out`.
pub fn decode_layer_block(
    block: &[u8],
    checkpoint_id: u64,
    index: u32,
    out: &mut Vec<LayerRecordEntry>,
) -> Result<(), DecodeError> {
    check_block(block, &LAYERS_MAGIC, 8)?;
    let found_index = le_u32(block, 12);
    let found_id = le_u64(block, 16);
    field(found_index == index, "block_index", found_index.into())?;
    field(found_id == checkpoint_id, "checkpoint_id", found_id)?;
    let count = le_u32(block, 24) as usize;
    field(count <= LAYER_RECORDS_PER_BLOCK, "record_count", count as u64)?;
    let optional = |value: u64| (value != NONE_ID).then_some(value);
    for slot in 0..count {
        let offset = LAYER_RECORDS_OFFSET + slot * LAYER_RECORD_BYTES;
        let (a, b, c) =
            (le_u64(block, offset + 8), le_u64(block, offset + 16), le_u64(block, offset + 24));
        field(block[offset + 2..offset + 8] == [0; 6], "record_reserved", slot as u64)?;
        let flags = block[offset + 1];
        field(flags <= 1 && (flags == 0 || block[offset] == RECORD_LAYER), "flags", flags.into())?;
        let record = match block[offset] {
            RECORD_LAYER => LayerRecordEntry::Layer {
                label: a,
                parent: optional(b),
                bound: optional(c),
                frozen: flags == 1,
            },
            RECORD_BINDING => LayerRecordEntry::Binding { id: a, label: b },
            RECORD_ALIAS => LayerRecordEntry::Alias { from: a, to: b },
            RECORD_NEXT_LABEL => LayerRecordEntry::NextLabel { label: a },
            other => {
                return Err(DecodeError::FieldInvalid { field: "record_kind", value: other.into() })
            }
        };
        out.push(record);
    }
    Ok(())
}

impl fmt::Display for Geometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} drives, {} segments of {} KiB per drive, ",
            self.drive_count,
            self.segment_count,
            self.unit_bytes() >> 10
        )?;
        if self.is_coded() {
            write!(f, "erasure coding {}", self.scheme())
        } else {
            write!(f, "no parity")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> Geometry {
        Geometry::new(3, (1 << 20) + LOG_HEADER_BYTES + 10 * (256 << 10), 256 << 10, 1 << 20)
            .unwrap()
            .with_header_key(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210)
    }

    #[test]
    fn geometry_stripes_positions_over_drives() {
        let geometry = geometry();
        assert_eq!(geometry.segment_count, 10);
        assert_eq!(geometry.positions_per_segment(), 3 * 64);
        assert_eq!(geometry.stripe_blocks, 64, "the largest power of two dividing the unit");
        let base = (2 << 20) + 2 * (256 << 10);
        assert_eq!(geometry.place(2, 0), (0, base));
        assert_eq!(geometry.place(2, 4), (0, base + 4 * 4096));
        assert_eq!(geometry.place(2, 64), (1, base));
        assert_eq!(geometry.place(2, 130), (2, base + 2 * 4096));
        assert_eq!(geometry.split(geometry.location(7, 100)), (7, 100));
        // Positions 60..=67: rows 60..=63 of drive 0, then rows 0..=3 of drive 1.
        let runs: Vec<_> = geometry.drive_runs(60, 8).collect();
        assert_eq!(runs, [(0, 60, 4), (1, 0, 4)]);
        let runs: Vec<_> = geometry.drive_runs(5, 1).collect();
        assert_eq!(runs, [(0, 5, 1)]);
        assert!(Geometry::new(0, 1 << 30, 1 << 20, 0).is_err());
        assert!(Geometry::new(1, 1 << 30, 4095, 0).is_err());
        assert!(Geometry::new(1, LOG_HEADER_BYTES + (1 << 20), 1 << 20, 0).is_err(), "one segment");
    }

    /// Every position has one place and back, and the runs of any range of positions hold
    /// exactly its positions, each drive's as one range of rows: checked against brute force on
    /// geometries whose drives hold one, several or odd numbers of chunks per segment.
    #[test]
    fn drive_runs_match_positions_exactly() {
        for (drives, unit_bytes) in
            [(1u16, 64u64 << 10), (3, 2 << 20), (4, 2 << 20), (5, 96 << 10), (2, 80 << 10)]
        {
            let size = LOG_HEADER_BYTES + 4 * unit_bytes;
            let geometry = Geometry::new(drives, size, unit_bytes, 0).unwrap();
            let per_segment = geometry.positions_per_segment();
            for position in 0..per_segment {
                let (drive, row) = geometry.drive_row(position);
                assert_eq!(geometry.position_of(drive, row), position, "{geometry:?}");
            }
            let mut rng = 0x9e37_79b9_7f4a_7c15u64;
            for _ in 0..2_000 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let first = (rng % u64::from(per_segment)) as u32;
                let count = ((rng >> 32) % u64::from(per_segment - first + 1)) as u32;
                let mut expected: Vec<Vec<u32>> = vec![Vec::new(); usize::from(drives)];
                for position in first..first + count {
                    let (drive, row) = geometry.drive_row(position);
                    expected[usize::from(drive)].push(row);
                }
                let mut seen = vec![false; usize::from(drives)];
                for (drive, first_row, rows) in geometry.drive_runs(first, count) {
                    let want: Vec<u32> = (first_row..first_row + rows).collect();
                    assert_eq!(
                        expected[usize::from(drive)],
                        want,
                        "{geometry:?} first {first} count {count} drive {drive}"
                    );
                    seen[usize::from(drive)] = true;
                }
                for (drive, rows) in expected.iter().enumerate() {
                    assert_eq!(seen[drive], !rows.is_empty(), "drive {drive} first {first}");
                }
            }
        }
    }

    /// Coded geometries: every stripe's cells are on distinct drives, parity rotates, positions
    /// map to data cells one to one, and the cell runs of any range hold exactly its cells.
    #[test]
    fn coded_geometry_maps_stripes_onto_distinct_drives() {
        for (drives, data, parity) in [(3u16, 2u8, 1u8), (5, 4, 1), (6, 4, 2), (4, 1, 1), (7, 3, 2)]
        {
            let scheme = ErasureScheme::new(data, parity).unwrap();
            let unit_bytes = 96 << 10;
            let geometry =
                Geometry::coded(drives, LOG_HEADER_BYTES + 4 * unit_bytes, unit_bytes, 0, scheme)
                    .unwrap();
            assert!(geometry.is_coded());
            assert_eq!(geometry.scheme(), scheme);
            let width = geometry.stripe_width();
            let cells = u32::from(drives) * geometry.unit_blocks;
            assert_eq!(geometry.stripes_per_segment(), cells / width);
            let mut parity_drives = vec![0u32; usize::from(drives)];
            let mut seen = std::collections::HashSet::new();
            for stripe in 0..geometry.stripes_per_segment() {
                let mut used = std::collections::HashSet::new();
                for shard in 0..width {
                    let cell = geometry.cell(stripe, shard);
                    assert_eq!(geometry.cell_shard(cell), Some((stripe, shard)));
                    let (drive, row) = geometry.cell_drive_row(cell);
                    assert!(used.insert(drive), "{geometry}: stripe {stripe} reuses drive {drive}");
                    assert!(row < geometry.unit_blocks);
                    if shard >= u32::from(data) {
                        parity_drives[usize::from(drive)] += 1;
                    }
                }
            }
            for position in 0..geometry.positions_per_segment() {
                assert!(seen.insert(geometry.drive_row(position)), "{geometry}: {position}");
            }
            let (least, most) = (
                parity_drives.iter().min().copied().unwrap_or(0),
                parity_drives.iter().max().copied().unwrap_or(0),
            );
            assert!(least > 0 && most <= 2 * least + 2, "{geometry}: parity {parity_drives:?}");
            assert_eq!(geometry.padded(1), u32::from(data));
            assert_eq!(geometry.padded(u32::from(data) + 1), 2 * u32::from(data));
            for (first, end) in [(0, cells), (1, 2), (5, 17), (cells - 3, cells), (4, 4)] {
                let mut expected: Vec<Vec<u32>> = vec![Vec::new(); usize::from(drives)];
                for cell in first..end {
                    let (drive, row) = geometry.cell_drive_row(cell);
                    expected[usize::from(drive)].push(row);
                }
                let mut got: Vec<Vec<u32>> = vec![Vec::new(); usize::from(drives)];
                for (drive, first_row, rows) in geometry.cell_runs(first, end) {
                    got[usize::from(drive)] = (first_row..first_row + rows).collect();
                }
                assert_eq!(got, expected, "{geometry}: cells {first}..{end}");
            }
            let superblock = LogSuperblock {
                node_uuid: NodeUuid([3; 16]),
                drive_index: 1,
                geometry,
                rebuilding: true,
            };
            assert_eq!(LogSuperblock::decode(&superblock.encode()), Ok(superblock));
        }
        let too_wide = ErasureScheme::new(4, 1).unwrap();
        assert!(Geometry::coded(4, 1 << 30, 1 << 20, 0, too_wide).is_err());
    }

    #[test]
    fn superblock_round_trips_and_refuses_damage() {
        let superblock = LogSuperblock {
            node_uuid: NodeUuid([7; 16]),
            drive_index: 2,
            geometry: geometry(),
            rebuilding: false,
        };
        let mut block = superblock.encode();
        assert_eq!(LogSuperblock::decode(&block), Ok(superblock));
        assert_eq!(le_u128(&block, 64), superblock.geometry.header_key, "the key is kept");
        block[79] ^= 1;
        assert!(matches!(LogSuperblock::decode(&block), Err(DecodeError::ChecksumMismatch { .. })));
        let mut block = superblock.encode();
        block[30] ^= 1;
        assert!(matches!(LogSuperblock::decode(&block), Err(DecodeError::ChecksumMismatch { .. })));
        let mut block = superblock.encode();
        block[16] = 9;
        assert_eq!(
            LogSuperblock::decode(&block),
            Err(DecodeError::VersionUnsupported { found: 9 })
        );
        assert_eq!(LogSuperblock::decode(&[0; BLOCK_BYTES]), Err(DecodeError::MagicMismatch));
    }

    #[test]
    fn batch_header_round_trips_and_checks_fields() {
        let geometry = geometry();
        let header = BatchHeader {
            segment: 4,
            segment_seq: 99,
            position: 10,
            lsn: 1234,
            entries: vec![
                Entry { volume: 1, block: 5, kind: EntryKind::Data { crc: 0xdead } },
                Entry { volume: 1, block: 9, kind: EntryKind::Trim { count: 3 } },
                Entry { volume: 2, block: 0, kind: EntryKind::Relocated { crc: 1, from: 77 } },
                Entry { volume: 3, block: 0, kind: EntryKind::VolumeDeleted },
            ],
        };
        assert_eq!(header.positions(), 3);
        let block = header.encode(&geometry);
        assert_eq!(BatchHeader::decode(&block, &geometry, 4, 10), Ok(header.clone()));
        // Only the log's own key makes a header: one whose tag was made under another key, or
        // one with any other tag and a valid checksum (as anyone can seal it: a host writing a
        // header-shaped block), is refused.
        let other_key = geometry.with_header_key(geometry.header_key ^ 1 << 100);
        assert_eq!(
            BatchHeader::decode(&block, &other_key, 4, 10),
            Err(DecodeError::HeaderTagMismatch)
        );
        let mut untagged = block;
        untagged[HEADER_TAG_OFFSET..HEADER_TAG_OFFSET + 8].fill(0);
        seal(&mut untagged);
        assert_eq!(
            BatchHeader::decode(&untagged, &geometry, 4, 10),
            Err(DecodeError::HeaderTagMismatch)
        );
        // Every entry byte is covered by the tag, not only by the (public) checksum.
        let mut changed = block;
        changed[BATCH_ENTRIES_OFFSET + ENTRY_BYTES + 8] ^= 1;
        seal(&mut changed);
        assert_eq!(
            BatchHeader::decode(&changed, &geometry, 4, 10),
            Err(DecodeError::HeaderTagMismatch)
        );
        tag_batch_header(&mut changed, &geometry);
        assert!(BatchHeader::decode(&changed, &geometry, 4, 10).is_ok(), "retagged with the key");
        assert!(BatchHeader::decode(&block, &geometry, 4, 11).is_err(), "wrong position");
        assert!(BatchHeader::decode(&block, &geometry, 5, 10).is_err(), "wrong segment");
        // A header whose data would run past the segment's end is refused.
        let late = BatchHeader { position: geometry.positions_per_segment() - 2, ..header };
        let block = late.encode(&geometry);
        let error = BatchHeader::decode(&block, &geometry, 4, late.position).unwrap_err();
        assert!(matches!(error, DecodeError::FieldInvalid { field: "data_blocks", .. }));
        // Every single-bit flip is caught.
        let block = late.encode(&geometry);
        for bit in (0..BLOCK_BYTES * 8).step_by(61) {
            let mut damaged = block;
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(BatchHeader::decode(&damaged, &geometry, 4, late.position).is_err());
        }
    }

    /// Encodes as many of `entries` as fit into checkpoint entry block `index`.
    fn checkpoint_block(
        checkpoint_id: u64,
        index: u32,
        entries: &[CheckpointEntry],
    ) -> ([u8; BLOCK_BYTES], usize) {
        let mut block = [0u8; BLOCK_BYTES];
        let mut writer = CheckpointBlockWriter::new(&mut block);
        let written = entries.iter().take_while(|entry| writer.push(entry)).count();
        assert_eq!(writer.finish(checkpoint_id, index) as usize, written);
        (block, written)
    }

    fn entry(volume: u64, block: u64, location: u32) -> CheckpointEntry {
        CheckpointEntry { volume, block, location, tag: location % 1000 }
    }

    #[test]
    fn checkpoint_blocks_hold_runs_of_consecutive_blocks() {
        let geometry = geometry();
        let decode = |block: &[u8; BLOCK_BYTES]| {
            let mut out = Vec::new();
            decode_checkpoint_block(block, &geometry, 5, 2, &mut out).map(|()| out)
        };
        // One layer's consecutive blocks: one run, 8 bytes per entry.
        let dense: Vec<_> = (0..600).map(|i| entry(7, 1000 + i, i as u32)).collect();
        let (block, written) = checkpoint_block(5, 2, &dense);
        assert_eq!(written, CHECKPOINT_ENTRIES_PER_BLOCK_MAX);
        assert_eq!(decode(&block).unwrap(), dense[..written]);
        // Every entry alone (gaps between blocks): a run each, 24 bytes per entry.
        let sparse: Vec<_> = (0..600).map(|i| entry(1 << 62, 2 * i, i as u32)).collect();
        let (block, written) = checkpoint_block(5, 2, &sparse);
        assert_eq!(written, CHECKPOINT_ENTRIES_PER_BLOCK_MIN);
        assert_eq!(decode(&block).unwrap(), sparse[..written]);
        // Runs broken by a gap, by another layer and by a block of another layer that would
        // continue the first; tombstones are slots like any other.
        let tombstone = |volume, block| CheckpointEntry {
            volume,
            block,
            location: TOMBSTONE_LOCATION,
            tag: u32::MAX,
        };
        let mixed = vec![
            entry(3, 10, 1),
            tombstone(3, 11),
            entry(3, 12, 2),
            entry(3, 20, 3),
            entry(4, 21, 4),
            tombstone(4, 22),
            entry(VOLUME_BLOCKS_MAX, VOLUME_BLOCKS_MAX - 1, 5),
        ];
        let (block, written) = checkpoint_block(5, 2, &mixed);
        assert_eq!(written, mixed.len());
        assert_eq!(le_u32(&block, CHECKPOINT_RUN_COUNT_OFFSET), 4);
        assert_eq!(decode(&block).unwrap(), mixed);
        assert!(decode_checkpoint_block(&block, &geometry, 6, 2, &mut Vec::new()).is_err());
        assert!(decode_checkpoint_block(&block, &geometry, 5, 3, &mut Vec::new()).is_err());
    }

    #[test]
    fn damaged_checkpoint_blocks_are_refused() {
        let geometry = geometry();
        let entries: Vec<_> = (0..40).map(|i| entry(7, 100 + i + i / 10, i as u32)).collect();
        let (good, written) = checkpoint_block(5, 0, &entries);
        assert_eq!(written, 40);
        let refused = |change: &dyn Fn(&mut [u8; BLOCK_BYTES])| {
            let mut block = good;
            change(&mut block);
            seal(&mut block);
            decode_checkpoint_block(&block, &geometry, 5, 0, &mut Vec::new()).is_err()
        };
        assert!(!refused(&|_| {}));
        let run_slots = CHECKPOINT_RUNS_OFFSET + 14;
        assert!(refused(&|b| put(b, run_slots, &0u16.to_le_bytes())), "an empty run");
        assert!(refused(&|b| put(b, run_slots, &11u16.to_le_bytes())), "slots beyond the count");
        assert!(refused(&|b| put(b, run_slots, &600u16.to_le_bytes())), "a run past the block");
        assert!(refused(&|b| put(b, CHECKPOINT_ENTRY_COUNT_OFFSET, &41u32.to_le_bytes())));
        assert!(refused(&|b| put(b, CHECKPOINT_ENTRY_COUNT_OFFSET, &0u32.to_le_bytes())));
        assert!(refused(&|b| put(b, CHECKPOINT_RUN_COUNT_OFFSET, &0u32.to_le_bytes())));
        assert!(refused(&|b| put(b, CHECKPOINT_RUN_COUNT_OFFSET, &5u32.to_le_bytes())));
        let first = CHECKPOINT_RUNS_OFFSET + 8;
        assert!(refused(&|b| put(b, first, &[0xff; 6])), "blocks beyond any volume");
        let location = CHECKPOINT_RUNS_OFFSET + CHECKPOINT_RUN_HEADER_BYTES;
        assert!(refused(&|b| put(b, location, &u32::MAX.to_le_bytes())), "no such location");
        assert!(refused(&|b| put(b, location + 4, &(1u32 << TAG_BITS).to_le_bytes())));
        assert!(refused(&|b| put(b, 8, &5u32.to_le_bytes())), "the previous format version");
        let mut torn = good;
        torn[CHECKPOINT_RUNS_OFFSET + 20] ^= 1;
        assert!(decode_checkpoint_block(&torn, &geometry, 5, 0, &mut Vec::new()).is_err());
    }

    /// A root whose lists outgrow its first block continues in further blocks of its slot;
    /// a damaged, missing or stale continuation block (another checkpoint's) refuses the root.
    #[test]
    fn a_long_root_spans_continuation_blocks() {
        let geometry =
            Geometry::new(4, LOG_HEADER_BYTES + 5_000 * (64 << 10), 64 << 10, 0).unwrap();
        let root = |checkpoint_id: u64| Root {
            checkpoint_id,
            lsn_floor: 10,
            segment_seq_floor: 3,
            lsn_next: 20,
            segment_seq_next: 5,
            entry_count: 3_000 * 60,
            entry_blocks: 3_000 * 60 / 500,
            layer_record_count: 0,
            segments: (0..3_000).map(|i| (i * 7 + checkpoint_id as u32) % 5_000).collect(),
            open_seqs: (0..100).map(|i| 1_000 + i).collect(),
        };
        let long = root(7);
        let blocks = long.encode();
        // 3,000 x 4 + 100 x 8 bytes of lists: 4,004 in the first block, 4,068 in each other.
        assert_eq!(blocks.len(), 4 * BLOCK_BYTES);
        let mut slot = blocks.clone();
        slot.resize(ROOT_BLOCKS_MAX * BLOCK_BYTES, 0xa5);
        assert_eq!(Root::decode(&slot, &geometry), Ok(long.clone()));
        assert!(Root::decode(&blocks[..3 * BLOCK_BYTES], &geometry).is_err(), "a block missing");
        let mut torn = blocks.clone();
        torn[2 * BLOCK_BYTES + 100] ^= 1;
        assert!(Root::decode(&torn, &geometry).is_err(), "a torn continuation block");
        let mut stale = root(8).encode();
        stale[BLOCK_BYTES..].copy_from_slice(&blocks[BLOCK_BYTES..]);
        assert!(Root::decode(&stale, &geometry).is_err(), "another checkpoint's continuation");
        // A short root stays one block, whatever the slot held before.
        let short = Root {
            segments: vec![1, 2],
            open_seqs: vec![],
            entry_count: 10,
            entry_blocks: 1,
            ..long
        };
        let mut slot = short.encode();
        assert_eq!(slot.len(), BLOCK_BYTES);
        slot.extend_from_slice(&blocks[BLOCK_BYTES..]);
        assert_eq!(Root::decode(&slot, &geometry), Ok(short));
        let most = Root {
            segments: vec![9; ROOT_SEGMENTS_MAX],
            open_seqs: vec![4; ROOT_OPEN_SEGMENTS_MAX],
            entry_count: 500,
            entry_blocks: 1,
            ..root(9)
        };
        assert_eq!(most.encode().len(), ROOT_BLOCKS_MAX * BLOCK_BYTES);
        assert_eq!(Root::decode(&most.encode(), &geometry), Ok(most));
    }

    #[test]
    fn root_and_checkpoint_blocks_round_trip() {
        let geometry = geometry();
        let root = Root {
            checkpoint_id: 5,
            lsn_floor: 100,
            segment_seq_floor: 7,
            lsn_next: 120,
            segment_seq_next: 9,
            entry_count: 400,
            entry_blocks: 3,
            layer_record_count: 130,
            segments: vec![3, 8],
            open_seqs: vec![5, 6],
        };
        assert_eq!(Root::decode(&root.encode(), &geometry), Ok(root.clone()));
        let bad = Root { segments: vec![10], ..root.clone() };
        assert!(Root::decode(&bad.encode(), &geometry).is_err(), "segment out of range");
        let bad = Root { segments: vec![], ..root.clone() };
        assert!(Root::decode(&bad.encode(), &geometry).is_err(), "entries without blocks");
        let bad = Root { entry_blocks: 401, ..root.clone() };
        assert!(Root::decode(&bad.encode(), &geometry).is_err(), "an entry block without entries");
        let bad = Root { entry_count: 3 * 505 + 1, ..root };
        assert!(Root::decode(&bad.encode(), &geometry).is_err(), "more entries than blocks hold");

        let tombstone = CheckpointEntry {
            volume: 1 << 62,
            block: 9,
            location: TOMBSTONE_LOCATION,
            tag: u32::MAX,
        };
        let (block, written) = checkpoint_block(5, 0, &[tombstone]);
        assert_eq!(written, 1);
        let mut out = Vec::new();
        decode_checkpoint_block(&block, &geometry, 5, 0, &mut out).unwrap();
        assert_eq!(out, [tombstone]);
        let bogus = CheckpointEntry { tag: 3, ..tombstone };
        assert!(
            decode_checkpoint_block(&checkpoint_block(5, 0, &[bogus]).0, &geometry, 5, 0, &mut out)
                .is_err(),
            "a tombstone location with a CRC is no tombstone"
        );

        let records = [
            LayerRecordEntry::Layer { label: 1 << 62, parent: Some(4), bound: None, frozen: false },
            LayerRecordEntry::Layer { label: 4, parent: None, bound: Some(9), frozen: true },
            LayerRecordEntry::Binding { id: 9, label: 4 },
            LayerRecordEntry::Alias { from: (1 << 62) + 1, to: 1 << 62 },
            LayerRecordEntry::NextLabel { label: (1 << 62) + 2 },
        ];
        let block = encode_layer_block(5, 4, &records);
        let mut decoded = Vec::new();
        decode_layer_block(&block, 5, 4, &mut decoded).unwrap();
        assert_eq!(decoded, records);
        assert!(decode_layer_block(&block, 5, 3, &mut decoded).is_err(), "wrong block index");
        let mut damaged = block;
        damaged[LAYER_RECORDS_OFFSET] = 9;
        assert!(decode_layer_block(&damaged, 5, 4, &mut decoded).is_err(), "checksum or kind");
    }

    #[test]
    fn layer_operations_round_trip_in_batch_headers() {
        let geometry = geometry();
        let layer = (1 << 62) + 77;
        let header = BatchHeader {
            segment: 2,
            segment_seq: 3,
            position: 0,
            lsn: 4,
            entries: vec![
                Entry { volume: 5, block: 0, kind: EntryKind::Snapshot { snapshot: 6, layer } },
                Entry { volume: 7, block: 0, kind: EntryKind::Clone { snapshot: 6, layer } },
                Entry { volume: 5, block: 0, kind: EntryKind::Rollback { snapshot: 6, layer } },
                Entry { volume: 6, block: 0, kind: EntryKind::VolumeDeleted },
                Entry { volume: layer, block: 9, kind: EntryKind::Dropped { tag: 3, location: 4 } },
            ],
        };
        assert_eq!(BatchHeader::decode(&header.encode(&geometry), &geometry, 2, 0), Ok(header));
    }
}
