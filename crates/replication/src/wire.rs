//! The bytes of a replication [`Message`] between two nodes: one frame per message on a TCP
//! connection, so the node's wiring can send what the state machines return (issue 6). One
//! connection between two nodes carries the messages of every volume they share, so each frame
//! names its volume and its sender ([`Envelope`]). The state machines never see bytes; only this
//! module knows the layout. The full specification, with byte diagrams, is
//! docs/replication-wire.md.
//!
//! A frame (version 7) is a 32-byte header and a payload:
//!
//! ```text
//! 0       4    5    6       8               12       16       24         28             32
//! +-------+----+----+-------+---------------+--------+--------+----------+--------------+-----+
//! | magic | ver|type| flags | payload_bytes | sender | volume | checksum | header_check | ... |
//! +-------+----+----+-------+---------------+--------+--------+----------+--------------+-----+
//! ```
//!
//! Integers are little-endian. Blocks of data (an `Append`'s, a `ReadReply`'s) end the
//! payload: a block table gives each one's length and CRC-32C, then their bytes follow back to
//! back. `checksum` is the CRC-32C of header bytes `0..24` followed by the payload up to the
//! block data (the whole payload of other messages); `header_check` the CRC-32C of header bytes
//! `0..28`, so a damaged length (or volume, or sender) is refused before the receiver waits for
//! a payload that will never come. A block's checksum is the one the sender's storage keeps
//! for it, computed once where the block entered the cluster: a primary sends one encoding of
//! the fields to every replica ([`encode_head`]) with the data from where it lies, and neither
//! side hashes a block's bytes more than once.
//!
//! [`decode`] checks everything before it trusts a byte: magic, version, header checksum, type,
//! flags, the payload length against the bounds of its type, then every field (tags, counts
//! against [`BLOCKS_PER_OP_MAX`], [`DEALLOCATE_BLOCKS_PER_OP_MAX`] and
//! [`DIVERGENCE_RANGES_MAX`], block sizes against [`BLOCK_BYTES_MAX`]) before it allocates for
//! it, each block's bytes against its checksum, and the frame checksum.
//! It never panics, and never reads or allocates more than [`MESSAGE_BYTES_MAX`] for one frame.
//! The encoding is canonical: a decoded frame encodes back to the same bytes. [`FrameReader`]
//! cuts a byte stream into messages, buffering at most one largest frame, and hands out each
//! block as a slice of the buffer it was read into (no copy per block).

use std::ops::{Range, RangeInclusive};

use bytes::{BufMut, Bytes, BytesMut};

pub use crate::message::Envelope;
use crate::message::{ranges_canonical, DivergenceReport, Entry, EntryKind, Message};
use crate::{BlockData, NodeId, StreamId, BLOCKS_PER_OP_MAX, DEALLOCATE_BLOCKS_PER_OP_MAX};

/// The first bytes of every frame ("Ferrite replication protocol").
pub const MAGIC: [u8; 4] = *b"FRRP";
/// The version this code writes and the only one it reads. Version 1 (a 20-byte header without
/// volume and sender) was never deployed; version 2 (a `Hello` of epoch and incarnation only)
/// and version 3 (a divergence of single LBAs) are refused like any other, as are version 4
/// (without `Read` and `ReadReply`), version 5 (blocks without checksums of their own, the
/// frame checksum over their bytes) and version 6 (a `ProbeReply` and a `Hello` without the
/// sender's volume size).
pub const VERSION: u8 = 7;
/// Bytes of the fixed header before the payload.
pub const HEADER_BYTES: usize = 32;
/// The largest block an entry carries: the node's block size. The simulation uses smaller ones;
/// every mapped block carries its own length.
pub const BLOCK_BYTES_MAX: usize = 4096;
/// The most LBA ranges a `ProbeReply` or a `Hello` lists. A longer divergence is sent as
/// `Unknown`, exactly what a replica reports past its own `divergence_ranges_max` (the primary
/// then copies everything).
pub const DIVERGENCE_RANGES_MAX: usize = 1 << 14;

/// Header byte offsets.
mod offset {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 4;
    pub const TYPE: usize = 5;
    pub const FLAGS: usize = 6;
    pub const PAYLOAD_BYTES: usize = 8;
    pub const SENDER: usize = 12;
    pub const VOLUME: usize = 16;
    pub const CHECKSUM: usize = 24;
    pub const HEADER_CHECK: usize = 28;
}

const U64_BYTES: usize = 8;
/// Kind tag, op, LBA, block count.
const ENTRY_FIXED_BYTES: usize = 1 + U64_BYTES + U64_BYTES + 4;
/// Epoch, stream, incarnation, seq, commit op, then the entry.
const APPEND_FIXED_BYTES: usize = 5 * U64_BYTES + ENTRY_FIXED_BYTES;
/// An unmapped block is its tag alone.
const BLOCK_UNMAPPED_BYTES: usize = 1;
/// A mapped block in the block table: tag, length, CRC-32C; its bytes follow the table.
const BLOCK_MAPPED_FIXED_BYTES: usize = 1 + 4 + 4;
const APPEND_PAYLOAD_BYTES_MIN: usize = APPEND_FIXED_BYTES + BLOCK_UNMAPPED_BYTES;
/// The largest entry with data: `BLOCKS_PER_OP_MAX` mapped blocks of `BLOCK_BYTES_MAX`.
const APPEND_DATA_PAYLOAD_BYTES_MAX: usize =
    APPEND_FIXED_BYTES + BLOCKS_PER_OP_MAX as usize * (BLOCK_MAPPED_FIXED_BYTES + BLOCK_BYTES_MAX);
/// The largest deallocate: `DEALLOCATE_BLOCKS_PER_OP_MAX` unmapped blocks.
const APPEND_DEALLOCATE_PAYLOAD_BYTES_MAX: usize =
    APPEND_FIXED_BYTES + DEALLOCATE_BLOCKS_PER_OP_MAX as usize * BLOCK_UNMAPPED_BYTES;
const APPEND_PAYLOAD_BYTES_MAX: usize =
    max(APPEND_DATA_PAYLOAD_BYTES_MAX, APPEND_DEALLOCATE_PAYLOAD_BYTES_MAX);
/// One range of a divergence: its first LBA and its block count.
const RANGE_BYTES: usize = 2 * U64_BYTES;
/// A known divergence: its tag, its range count, then at most `DIVERGENCE_RANGES_MAX` ranges.
const DIVERGENCE_BYTES_MAX: usize = 1 + 4 + DIVERGENCE_RANGES_MAX * RANGE_BYTES;
/// Epoch, incarnation, divergence tag.
const PROBE_REPLY_FIXED_BYTES: usize = 3 * U64_BYTES + 1;
const PROBE_REPLY_PAYLOAD_BYTES_MAX: usize = PROBE_REPLY_FIXED_BYTES - 1 + DIVERGENCE_BYTES_MAX;
/// Epoch, incarnation, last term epoch, divergence tag.
const HELLO_FIXED_BYTES: usize = 4 * U64_BYTES + 1;
const HELLO_PAYLOAD_BYTES_MAX: usize = HELLO_FIXED_BYTES - 1 + DIVERGENCE_BYTES_MAX;
/// Epoch, incarnation, request, LBA, block count.
const READ_PAYLOAD_BYTES: usize = 4 * U64_BYTES + 4;
/// Epoch, incarnation, LBA, block count.
const DAMAGED_PAYLOAD_BYTES: usize = 3 * U64_BYTES + 4;
/// Epoch, request, blocks tag; then, with blocks, their count and the blocks.
const READ_REPLY_FIXED_BYTES: usize = 2 * U64_BYTES + 1;
const READ_REPLY_PAYLOAD_BYTES_MAX: usize = READ_REPLY_FIXED_BYTES
    + 4
    + BLOCKS_PER_OP_MAX as usize * (BLOCK_MAPPED_FIXED_BYTES + BLOCK_BYTES_MAX);

/// The largest payload of any message.
pub const PAYLOAD_BYTES_MAX: usize =
    max(APPEND_PAYLOAD_BYTES_MAX, max(PROBE_REPLY_PAYLOAD_BYTES_MAX, HELLO_PAYLOAD_BYTES_MAX));
/// The largest frame: an `Append` of `BLOCKS_PER_OP_MAX` mapped blocks of `BLOCK_BYTES_MAX`.
pub const MESSAGE_BYTES_MAX: usize = HEADER_BYTES + PAYLOAD_BYTES_MAX;

const fn max(a: usize, b: usize) -> usize {
    if a > b {
        a
    } else {
        b
    }
}

// The header's fields follow each other without gaps, and `header_check` ends it.
const _: () = assert!(offset::VERSION == offset::MAGIC + MAGIC.len());
const _: () = assert!(offset::TYPE == offset::VERSION + 1);
const _: () = assert!(offset::FLAGS == offset::TYPE + 1);
const _: () = assert!(offset::PAYLOAD_BYTES == offset::FLAGS + 2);
const _: () = assert!(offset::SENDER == offset::PAYLOAD_BYTES + 4);
const _: () = assert!(offset::VOLUME == offset::SENDER + 4);
const _: () = assert!(offset::CHECKSUM == offset::VOLUME + U64_BYTES);
const _: () = assert!(offset::HEADER_CHECK == offset::CHECKSUM + 4);
const _: () = assert!(offset::HEADER_CHECK + 4 == HEADER_BYTES);
// A deallocate of the longest length fits in the frame a data entry needs anyway.
const _: () = assert!(APPEND_DEALLOCATE_PAYLOAD_BYTES_MAX <= APPEND_DATA_PAYLOAD_BYTES_MAX);
const _: () = assert!(PAYLOAD_BYTES_MAX <= u32::MAX as usize);
const _: () = assert!(BLOCK_BYTES_MAX <= u32::MAX as usize);
const _: () = assert!(DIVERGENCE_RANGES_MAX <= u32::MAX as usize);
const _: () = assert!(PROBE_REPLY_PAYLOAD_BYTES_MAX <= APPEND_PAYLOAD_BYTES_MAX);
const _: () = assert!(HELLO_PAYLOAD_BYTES_MAX <= APPEND_PAYLOAD_BYTES_MAX);
const _: () = assert!(READ_REPLY_PAYLOAD_BYTES_MAX <= APPEND_PAYLOAD_BYTES_MAX);

const ENTRY_WRITE: u8 = 1;
const ENTRY_COPY: u8 = 2;
const BLOCK_UNMAPPED: u8 = 0;
const BLOCK_MAPPED: u8 = 1;
const DIVERGENCE_UNKNOWN: u8 = 0;
const DIVERGENCE_KNOWN: u8 = 1;
const READ_REPLY_NONE: u8 = 0;
const READ_REPLY_BLOCKS: u8 = 1;

/// The type byte of a frame: one per [`Message`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MessageType {
    Append = 1,
    Heartbeat = 2,
    Ack = 3,
    Probe = 4,
    ProbeReply = 5,
    Hello = 6,
    Stale = 7,
    Resync = 8,
    Failed = 9,
    Read = 10,
    ReadReply = 11,
    Damaged = 12,
}

impl MessageType {
    pub fn from_u8(value: u8) -> Option<Self> {
        Some(match value {
            1 => Self::Append,
            2 => Self::Heartbeat,
            3 => Self::Ack,
            4 => Self::Probe,
            5 => Self::ProbeReply,
            6 => Self::Hello,
            7 => Self::Stale,
            8 => Self::Resync,
            9 => Self::Failed,
            10 => Self::Read,
            11 => Self::ReadReply,
            12 => Self::Damaged,
            _ => return None,
        })
    }

    pub fn of(message: &Message) -> Self {
        match message {
            Message::Append { .. } => Self::Append,
            Message::Heartbeat { .. } => Self::Heartbeat,
            Message::Ack { .. } => Self::Ack,
            Message::Probe { .. } => Self::Probe,
            Message::ProbeReply { .. } => Self::ProbeReply,
            Message::Hello { .. } => Self::Hello,
            Message::Stale { .. } => Self::Stale,
            Message::Resync { .. } => Self::Resync,
            Message::Failed { .. } => Self::Failed,
            Message::Read { .. } => Self::Read,
            Message::ReadReply { .. } => Self::ReadReply,
            Message::Damaged { .. } => Self::Damaged,
        }
    }

    /// The payload lengths a frame of this type may declare.
    pub fn payload_bytes(self) -> RangeInclusive<usize> {
        let fixed = |u64s: usize| u64s * U64_BYTES..=u64s * U64_BYTES;
        match self {
            Self::Append => APPEND_PAYLOAD_BYTES_MIN..=APPEND_PAYLOAD_BYTES_MAX,
            Self::Heartbeat => fixed(4),
            Self::Ack => fixed(3),
            Self::Probe | Self::Stale => fixed(1),
            Self::ProbeReply => PROBE_REPLY_FIXED_BYTES..=PROBE_REPLY_PAYLOAD_BYTES_MAX,
            Self::Hello => HELLO_FIXED_BYTES..=HELLO_PAYLOAD_BYTES_MAX,
            Self::Resync | Self::Failed => fixed(2),
            Self::Read => READ_PAYLOAD_BYTES..=READ_PAYLOAD_BYTES,
            Self::ReadReply => READ_REPLY_FIXED_BYTES..=READ_REPLY_PAYLOAD_BYTES_MAX,
            Self::Damaged => DAMAGED_PAYLOAD_BYTES..=DAMAGED_PAYLOAD_BYTES,
        }
    }
}

/// Why bytes are not a frame. Apart from `Incomplete`, the connection's framing can no longer be
/// trusted: the receiver closes it (the protocol tolerates the messages lost with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame incomplete: {needed_bytes} bytes are needed to go on")]
    Incomplete { needed_bytes: usize },
    #[error(
        "byte {offset} of the frame magic is {found:#04x}, not {expected:#04x}: the peer is not \
         a Ferrite replication endpoint, or the stream lost its framing"
    )]
    MagicWrong { offset: usize, found: u8, expected: u8 },
    #[error(
        "frame version {version} is not supported: this node reads only version {VERSION}, and \
         every node of a cluster must run the same replication wire version"
    )]
    VersionUnsupported { version: u8 },
    #[error(
        "frame header checksum mismatch: it carries {stored:#010x}, bytes hash to {computed:#010x}"
    )]
    HeaderChecksumMismatch { stored: u32, computed: u32 },
    #[error("message type {message_type} is unknown")]
    TypeUnknown { message_type: u8 },
    #[error("frame flags {flags:#06x} are reserved and must be zero")]
    FlagsReserved { flags: u16 },
    #[error("a {message_type:?} frame declares {payload_bytes} payload bytes, outside {range:?}")]
    LengthInvalid { message_type: MessageType, payload_bytes: u32, range: RangeInclusive<usize> },
    #[error("frame checksum mismatch: it carries {stored:#010x}, bytes hash to {computed:#010x}")]
    ChecksumMismatch { stored: u32, computed: u32 },
    #[error(
        "checksum mismatch of block {index} of a {message_type:?} frame: the table carries \
         {stored:#010x}, its bytes hash to {computed:#010x}"
    )]
    BlockChecksumMismatch { message_type: MessageType, index: usize, stored: u32, computed: u32 },
    #[error("invalid field at byte {offset} of a {message_type:?} frame: {reason}")]
    FieldInvalid { message_type: MessageType, offset: usize, reason: &'static str },
}

impl WireError {
    /// True when the bytes are a valid beginning of a frame and more are needed.
    pub fn is_incomplete(&self) -> bool {
        matches!(self, WireError::Incomplete { .. })
    }
}

/// A message the wire cannot carry: the sender built an entry outside the protocol's limits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error(
        "an entry holds {count} blocks; the wire carries 1..={BLOCKS_PER_OP_MAX}, or \
         1..={DEALLOCATE_BLOCKS_PER_OP_MAX} when every block is unmapped"
    )]
    BlockCount { count: usize },
    #[error("an entry of {count} blocks at LBA {lba} runs past the last LBA")]
    LbaOverflow { lba: u64, count: usize },
    #[error("block {index} of an entry holds {size_bytes} bytes; the wire carries 1..={BLOCK_BYTES_MAX}")]
    BlockSize { index: usize, size_bytes: usize },
    #[error("a read of {count} blocks at LBA {lba}: the wire carries 1..={BLOCKS_PER_OP_MAX} blocks, not past the last LBA")]
    ReadLength { lba: u64, count: u32 },
    #[error("a read reply of {count} blocks; the wire carries 1..={BLOCKS_PER_OP_MAX}")]
    ReadReplyCount { count: usize },
}

/// Appends the frame of `envelope` to `out` and returns its length. On error `out` is unchanged.
pub fn encode(envelope: &Envelope, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
    let start = out.len();
    let frame_bytes = encode_head(envelope, out)?;
    for block in data_blocks(&envelope.message) {
        out.extend_from_slice(block);
    }
    assert_eq!(out.len() - start, frame_bytes, "block data length computed wrong");
    Ok(frame_bytes)
}

/// The blocks whose bytes end a frame of `message`, in order: the mapped blocks of an `Append`
/// or a `ReadReply` (none for other messages).
pub fn data_blocks(message: &Message) -> impl Iterator<Item = &crate::Block> {
    let blocks: &[BlockData] = match message {
        Message::Append { entry, .. } => &entry.blocks,
        Message::ReadReply { blocks: Some(blocks), .. } => blocks,
        _ => &[],
    };
    blocks.iter().flatten()
}

/// Appends the frame of `envelope` up to its block data to `out`, checksums included, and
/// returns the length of the whole frame: the frame continues with the bytes of
/// [`data_blocks`], back to back, which the caller sends from where they lie (one encoding
/// serves every peer, without copying the data). On error `out` is unchanged.
pub fn encode_head(envelope: &Envelope, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
    let Envelope { volume, sender, message } = envelope;
    match message {
        Message::Append { entry, .. } => check_entry(entry)?,
        Message::Read { lba, count, .. } | Message::Damaged { lba, count, .. } => {
            let fits = lba.checked_add(u64::from(*count)).is_some();
            if !(1..=BLOCKS_PER_OP_MAX).contains(count) || !fits {
                return Err(EncodeError::ReadLength { lba: *lba, count: *count });
            }
        }
        Message::ReadReply { blocks: Some(blocks), .. } => {
            if !(1..=BLOCKS_PER_OP_MAX as usize).contains(&blocks.len()) {
                return Err(EncodeError::ReadReplyCount { count: blocks.len() });
            }
            check_blocks(blocks)?;
        }
        _ => {}
    }
    let message_type = MessageType::of(message);
    let payload_bytes = payload_bytes(message);
    assert!(message_type.payload_bytes().contains(&payload_bytes));
    let data_bytes: usize = data_blocks(message).map(|block| block.len()).sum();
    let start = out.len();
    out.reserve(HEADER_BYTES + payload_bytes - data_bytes);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(message_type as u8);
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(payload_bytes as u32).to_le_bytes());
    out.extend_from_slice(&sender.0.to_le_bytes());
    out.extend_from_slice(&volume.to_le_bytes());
    // The two checksums, filled in once the payload is there.
    out.extend_from_slice(&[0; 8]);
    assert_eq!(out.len() - start, HEADER_BYTES);
    encode_payload(message, out);
    assert_eq!(
        out.len() - start + data_bytes,
        HEADER_BYTES + payload_bytes,
        "payload length computed wrong"
    );
    let frame = &mut out[start..];
    let checksum = frame_checksum(&frame[..offset::CHECKSUM], &frame[HEADER_BYTES..]);
    frame[offset::CHECKSUM..offset::HEADER_CHECK].copy_from_slice(&checksum.to_le_bytes());
    let header_check = crc32c::crc32c(&frame[..offset::HEADER_CHECK]);
    frame[offset::HEADER_CHECK..HEADER_BYTES].copy_from_slice(&header_check.to_le_bytes());
    Ok(HEADER_BYTES + payload_bytes)
}

fn check_entry(entry: &Entry) -> Result<(), EncodeError> {
    let count = entry.blocks.len();
    if !entry.length_valid() {
        return Err(EncodeError::BlockCount { count });
    }
    if entry.lba.checked_add(count as u64).is_none() {
        return Err(EncodeError::LbaOverflow { lba: entry.lba, count });
    }
    check_blocks(&entry.blocks)
}

fn check_blocks(blocks: &[BlockData]) -> Result<(), EncodeError> {
    for (index, block) in blocks.iter().enumerate() {
        if let Some(block) = block {
            if block.is_empty() || block.len() > BLOCK_BYTES_MAX {
                return Err(EncodeError::BlockSize { index, size_bytes: block.len() });
            }
        }
    }
    Ok(())
}

/// The divergence as the wire carries it: a list too long to send, or not canonical (which no
/// state machine builds), becomes `Unknown`, which is always safe (the primary copies every
/// block).
fn sendable_ranges(divergence: &DivergenceReport) -> Option<&[Range<u64>]> {
    match divergence {
        DivergenceReport::Known(ranges)
            if ranges.len() <= DIVERGENCE_RANGES_MAX && ranges_canonical(ranges) =>
        {
            Some(ranges)
        }
        _ => None,
    }
}

fn payload_bytes(message: &Message) -> usize {
    match message {
        Message::Append { entry, .. } => APPEND_FIXED_BYTES + blocks_bytes(&entry.blocks),
        Message::ReadReply { blocks, .. } => {
            READ_REPLY_FIXED_BYTES + blocks.as_ref().map_or(0, |blocks| 4 + blocks_bytes(blocks))
        }
        Message::ProbeReply { divergence, .. } => {
            PROBE_REPLY_FIXED_BYTES - 1 + divergence_bytes(divergence)
        }
        Message::Hello { divergence, .. } => HELLO_FIXED_BYTES - 1 + divergence_bytes(divergence),
        _ => *MessageType::of(message).payload_bytes().start(),
    }
}

/// Bytes of a list of blocks on the wire, after its count: the table (a tag per block, and a
/// mapped block's length and checksum), then the mapped blocks' bytes.
fn blocks_bytes(blocks: &[BlockData]) -> usize {
    blocks
        .iter()
        .map(|block| match block {
            None => BLOCK_UNMAPPED_BYTES,
            Some(block) => BLOCK_MAPPED_FIXED_BYTES + block.len(),
        })
        .sum()
}

/// The block table of a list of blocks (their bytes follow it, from [`data_blocks`]).
fn encode_block_table(blocks: &[BlockData], out: &mut Vec<u8>) {
    for block in blocks {
        match block {
            None => out.push(BLOCK_UNMAPPED),
            Some(block) => {
                out.push(BLOCK_MAPPED);
                out.extend_from_slice(&(block.len() as u32).to_le_bytes());
                out.extend_from_slice(&block.crc().to_le_bytes());
            }
        }
    }
}

/// Bytes of a divergence on the wire: its tag, then for a known one its count and ranges.
fn divergence_bytes(divergence: &DivergenceReport) -> usize {
    match sendable_ranges(divergence) {
        None => 1,
        Some(ranges) => 1 + 4 + ranges.len() * RANGE_BYTES,
    }
}

fn encode_divergence(divergence: &DivergenceReport, out: &mut Vec<u8>) {
    match sendable_ranges(divergence) {
        None => out.push(DIVERGENCE_UNKNOWN),
        Some(ranges) => {
            out.push(DIVERGENCE_KNOWN);
            out.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
            for range in ranges {
                out.extend_from_slice(&range.start.to_le_bytes());
                out.extend_from_slice(&(range.end - range.start).to_le_bytes());
            }
        }
    }
}

fn encode_payload(message: &Message, out: &mut Vec<u8>) {
    let mut put = |value: u64| out.extend_from_slice(&value.to_le_bytes());
    match message {
        Message::Append { epoch, stream, incarnation, seq, commit_op, entry } => {
            for value in [*epoch, stream.0, *incarnation, *seq, *commit_op] {
                put(value);
            }
            let (kind, op) = match entry.kind {
                EntryKind::Write { op } => (ENTRY_WRITE, op),
                EntryKind::Copy { covers_op } => (ENTRY_COPY, covers_op),
            };
            out.push(kind);
            out.extend_from_slice(&op.to_le_bytes());
            out.extend_from_slice(&entry.lba.to_le_bytes());
            out.extend_from_slice(&(entry.blocks.len() as u32).to_le_bytes());
            encode_block_table(&entry.blocks, out);
        }
        Message::Heartbeat { epoch, stream, incarnation, commit_op } => {
            for value in [*epoch, stream.0, *incarnation, *commit_op] {
                put(value);
            }
        }
        Message::Ack { epoch, stream, durable_seq } => {
            for value in [*epoch, stream.0, *durable_seq] {
                put(value);
            }
        }
        Message::Probe { epoch } | Message::Stale { epoch } => put(*epoch),
        Message::ProbeReply { epoch, incarnation, volume_blocks, divergence } => {
            for value in [*epoch, *incarnation, *volume_blocks] {
                put(value);
            }
            encode_divergence(divergence, out);
        }
        Message::Hello { epoch, incarnation, last_term_epoch, volume_blocks, divergence } => {
            for value in [*epoch, *incarnation, *last_term_epoch, *volume_blocks] {
                put(value);
            }
            encode_divergence(divergence, out);
        }
        Message::Resync { epoch, incarnation } | Message::Failed { epoch, incarnation } => {
            put(*epoch);
            put(*incarnation);
        }
        Message::Read { epoch, incarnation, request, lba, count } => {
            for value in [*epoch, *incarnation, *request, *lba] {
                put(value);
            }
            out.extend_from_slice(&count.to_le_bytes());
        }
        Message::Damaged { epoch, incarnation, lba, count } => {
            for value in [*epoch, *incarnation, *lba] {
                put(value);
            }
            out.extend_from_slice(&count.to_le_bytes());
        }
        Message::ReadReply { epoch, request, blocks } => {
            put(*epoch);
            put(*request);
            match blocks {
                None => out.push(READ_REPLY_NONE),
                Some(blocks) => {
                    out.push(READ_REPLY_BLOCKS);
                    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
                    encode_block_table(blocks, out);
                }
            }
        }
    }
}

/// The frame checksum: header bytes `0..24`, then the payload up to its block data (`covered`:
/// the whole payload of a message without blocks), whose blocks carry checksums of their own.
fn frame_checksum(header_start: &[u8], covered: &[u8]) -> u32 {
    debug_assert_eq!(header_start.len(), offset::CHECKSUM);
    crc32c::crc32c_append(crc32c::crc32c(header_start), covered)
}

fn le_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

fn le_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn le_u64(bytes: &[u8], at: usize) -> u64 {
    let mut array = [0; U64_BYTES];
    array.copy_from_slice(&bytes[at..at + U64_BYTES]);
    u64::from_le_bytes(array)
}

/// Decodes the frame at the start of `bytes`: the envelope and the bytes it took. Bytes after
/// the frame are left alone. A valid beginning of a frame gives [`WireError::Incomplete`].
/// The blocks are copied out of `bytes` ([`FrameReader`] slices them out of its buffer instead).
pub fn decode(bytes: &[u8]) -> Result<(Envelope, usize), WireError> {
    let (message_type, frame_bytes) = decode_header(bytes)?;
    let Some(frame) = bytes.get(..frame_bytes) else {
        return Err(WireError::Incomplete { needed_bytes: frame_bytes });
    };
    Ok((decode_frame(message_type, frame, None)?, frame_bytes))
}

/// Decodes one whole frame whose header [`decode_header`] accepted. With `shared` (the same
/// bytes as `frame`), the blocks are slices of it; without, copies.
fn decode_frame(
    message_type: MessageType,
    frame: &[u8],
    shared: Option<&Bytes>,
) -> Result<Envelope, WireError> {
    debug_assert!(shared.is_none_or(|shared| shared.as_ref() == frame));
    let (header, payload) = frame.split_at(HEADER_BYTES);
    // The fields are read first, since where the block data starts is in them; each block's
    // bytes are checked against its checksum as it is read.
    let (message, covered) = decode_payload(message_type, payload, shared)?;
    let stored = le_u32(header, offset::CHECKSUM);
    let computed = frame_checksum(&header[..offset::CHECKSUM], &payload[..covered]);
    if stored != computed {
        return Err(WireError::ChecksumMismatch { stored, computed });
    }
    // Any volume and sender are well-formed; whether this node holds that volume, and whether
    // the sender is the peer of this connection, is the receiver's to check.
    let envelope = Envelope {
        volume: le_u64(header, offset::VOLUME),
        sender: NodeId(le_u32(header, offset::SENDER)),
        message,
    };
    Ok(envelope)
}

/// Checks the header; returns the type and the length of the whole frame.
fn decode_header(bytes: &[u8]) -> Result<(MessageType, usize), WireError> {
    // What has arrived of the magic and version is checked at once, so garbage fails on its
    // first byte instead of after a header's worth.
    for (at, (&found, &expected)) in bytes.iter().zip(MAGIC.iter()).enumerate() {
        if found != expected {
            return Err(WireError::MagicWrong { offset: offset::MAGIC + at, found, expected });
        }
    }
    if let Some(&version) = bytes.get(offset::VERSION) {
        if version != VERSION {
            return Err(WireError::VersionUnsupported { version });
        }
    }
    let Some(header) = bytes.get(..HEADER_BYTES) else {
        return Err(WireError::Incomplete { needed_bytes: HEADER_BYTES });
    };
    let stored = le_u32(header, offset::HEADER_CHECK);
    let computed = crc32c::crc32c(&header[..offset::HEADER_CHECK]);
    if stored != computed {
        return Err(WireError::HeaderChecksumMismatch { stored, computed });
    }
    let type_byte = header[offset::TYPE];
    let message_type = MessageType::from_u8(type_byte)
        .ok_or(WireError::TypeUnknown { message_type: type_byte })?;
    let flags = le_u16(header, offset::FLAGS);
    if flags != 0 {
        return Err(WireError::FlagsReserved { flags });
    }
    let payload_bytes = le_u32(header, offset::PAYLOAD_BYTES);
    let range = message_type.payload_bytes();
    if !range.contains(&(payload_bytes as usize)) {
        return Err(WireError::LengthInvalid { message_type, payload_bytes, range });
    }
    Ok((message_type, HEADER_BYTES + payload_bytes as usize))
}

/// Reads the fields of one payload, whose length the header already bounded.
struct Fields<'a> {
    message_type: MessageType,
    payload: &'a [u8],
    position: usize,
    /// The whole frame (header, then `payload`) as shared bytes: blocks are sliced out of it.
    frame: Option<&'a Bytes>,
    /// Where the block data starts (the frame checksum covers the payload up to there): the
    /// end of the payload until a block table is read.
    covered: usize,
    /// Where the block table starts, once one is read.
    table_at: Option<usize>,
    /// Whether each block's bytes are checked against its checksum (not when resealing).
    check_blocks: bool,
}

impl<'a> Fields<'a> {
    fn invalid_at(&self, position: usize, reason: &'static str) -> WireError {
        WireError::FieldInvalid {
            message_type: self.message_type,
            offset: HEADER_BYTES + position,
            reason,
        }
    }

    fn remaining_bytes(&self) -> usize {
        self.payload.len() - self.position
    }

    fn take(&mut self, count: usize) -> Result<&'a [u8], WireError> {
        if count > self.remaining_bytes() {
            return Err(self.invalid_at(self.position, "payload ends inside a field"));
        }
        let bytes = &self.payload[self.position..self.position + count];
        self.position += count;
        Ok(bytes)
    }

    /// The payload's bytes `range` as a block's: a slice of the shared frame, or a copy.
    fn block_bytes(&self, range: Range<usize>) -> Bytes {
        match self.frame {
            Some(frame) => frame.slice(HEADER_BYTES + range.start..HEADER_BYTES + range.end),
            None => Bytes::copy_from_slice(&self.payload[range]),
        }
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(le_u32(self.take(4)?, 0))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(le_u64(self.take(U64_BYTES)?, 0))
    }

    fn finish(self) -> Result<(), WireError> {
        if self.remaining_bytes() != 0 {
            return Err(self.invalid_at(self.position, "payload continues after its last field"));
        }
        Ok(())
    }

    fn entry(&mut self) -> Result<Entry, WireError> {
        let kind_at = self.position;
        let kind_tag = self.u8()?;
        let op = self.u64()?;
        let kind = match kind_tag {
            ENTRY_WRITE => EntryKind::Write { op },
            ENTRY_COPY => EntryKind::Copy { covers_op: op },
            _ => return Err(self.invalid_at(kind_at, "unknown entry kind")),
        };
        let lba = self.u64()?;
        let count_at = self.position;
        let count = self.u32()?;
        if count == 0 || count > DEALLOCATE_BLOCKS_PER_OP_MAX {
            return Err(
                self.invalid_at(count_at, "block count outside 1..=DEALLOCATE_BLOCKS_PER_OP_MAX")
            );
        }
        if lba.checked_add(u64::from(count)).is_none() {
            return Err(self.invalid_at(count_at, "entry runs past the last LBA"));
        }
        let blocks = self.blocks(count, count_at)?;
        Ok(Entry { kind, lba, blocks })
    }

    /// `count` blocks (a count the caller checked against its own bounds, read at
    /// `count_at`), the last field of a payload: the block table (a tag each, and a mapped
    /// block's length and checksum), then the mapped blocks' bytes back to back to the end of
    /// the payload, each checked against its checksum.
    fn blocks(&mut self, count: u32, count_at: usize) -> Result<Vec<BlockData>, WireError> {
        if count as usize * BLOCK_UNMAPPED_BYTES > self.remaining_bytes() {
            return Err(self.invalid_at(count_at, "block count exceeds the payload"));
        }
        // The table first, to find where the data starts; nothing is allocated until it holds.
        let table_at = self.position;
        let mut data_bytes = 0usize;
        for _ in 0..count {
            let tag_at = self.position;
            match self.u8()? {
                BLOCK_UNMAPPED => {}
                BLOCK_MAPPED if count > BLOCKS_PER_OP_MAX => {
                    // Only a deallocate (unmapped blocks only) may be that long.
                    return Err(self.invalid_at(
                        tag_at,
                        "mapped block in an entry of more than BLOCKS_PER_OP_MAX blocks",
                    ));
                }
                BLOCK_MAPPED => {
                    let length_at = self.position;
                    let length = self.u32()? as usize;
                    if length == 0 || length > BLOCK_BYTES_MAX {
                        return Err(
                            self.invalid_at(length_at, "block length outside 1..=BLOCK_BYTES_MAX")
                        );
                    }
                    self.u32()?;
                    data_bytes += length;
                }
                _ => return Err(self.invalid_at(tag_at, "unknown block tag")),
            }
        }
        let data_at = self.position;
        if data_bytes > self.remaining_bytes() {
            return Err(self.invalid_at(data_at, "payload ends inside the block data"));
        }
        self.covered = data_at;
        self.table_at = Some(table_at);
        let table = &self.payload[table_at..data_at];
        let mut blocks: Vec<BlockData> = Vec::with_capacity(count as usize);
        let mut at = 0;
        let mut data = data_at;
        while at < table.len() {
            if table[at] == BLOCK_UNMAPPED {
                blocks.push(None);
                at += BLOCK_UNMAPPED_BYTES;
                continue;
            }
            let length = le_u32(table, at + 1) as usize;
            let stored = le_u32(table, at + 5);
            let range = data..data + length;
            let block = if self.check_blocks {
                let computed = crc32c::crc32c(&self.payload[range.clone()]);
                if stored != computed {
                    let (message_type, index) = (self.message_type, blocks.len());
                    return Err(WireError::BlockChecksumMismatch {
                        message_type,
                        index,
                        stored,
                        computed,
                    });
                }
                crate::Block::checked(self.block_bytes(range), stored)
            } else {
                // Resealing: the caller rewrites the checksums and drops the message.
                crate::Block { bytes: self.block_bytes(range), crc: stored }
            };
            blocks.push(Some(block));
            at += BLOCK_MAPPED_FIXED_BYTES;
            data += length;
        }
        self.position = data;
        Ok(blocks)
    }

    fn read(&mut self) -> Result<Message, WireError> {
        let (epoch, incarnation, request, lba) =
            (self.u64()?, self.u64()?, self.u64()?, self.u64()?);
        let count = self.op_count(lba)?;
        Ok(Message::Read { epoch, incarnation, request, lba, count })
    }

    fn damaged(&mut self) -> Result<Message, WireError> {
        let (epoch, incarnation, lba) = (self.u64()?, self.u64()?, self.u64()?);
        let count = self.op_count(lba)?;
        Ok(Message::Damaged { epoch, incarnation, lba, count })
    }

    /// The block count of a `Read` or `Damaged` at `lba`: 1..=`BLOCKS_PER_OP_MAX`, not past
    /// the last LBA.
    fn op_count(&mut self, lba: u64) -> Result<u32, WireError> {
        let count_at = self.position;
        let count = self.u32()?;
        if count == 0 || count > BLOCKS_PER_OP_MAX {
            return Err(self.invalid_at(count_at, "block count outside 1..=BLOCKS_PER_OP_MAX"));
        }
        if lba.checked_add(u64::from(count)).is_none() {
            return Err(self.invalid_at(count_at, "read runs past the last LBA"));
        }
        Ok(count)
    }

    fn read_reply(&mut self) -> Result<Message, WireError> {
        let (epoch, request) = (self.u64()?, self.u64()?);
        let tag_at = self.position;
        let blocks = match self.u8()? {
            READ_REPLY_NONE => None,
            READ_REPLY_BLOCKS => {
                let count_at = self.position;
                let count = self.u32()?;
                if count == 0 || count > BLOCKS_PER_OP_MAX {
                    return Err(
                        self.invalid_at(count_at, "block count outside 1..=BLOCKS_PER_OP_MAX")
                    );
                }
                Some(self.blocks(count, count_at)?)
            }
            _ => return Err(self.invalid_at(tag_at, "unknown read reply tag")),
        };
        Ok(Message::ReadReply { epoch, request, blocks })
    }

    fn divergence(&mut self) -> Result<DivergenceReport, WireError> {
        let tag_at = self.position;
        match self.u8()? {
            DIVERGENCE_UNKNOWN => Ok(DivergenceReport::Unknown),
            DIVERGENCE_KNOWN => {
                let count_at = self.position;
                let count = self.u32()? as usize;
                if count > DIVERGENCE_RANGES_MAX {
                    return Err(
                        self.invalid_at(count_at, "range count above DIVERGENCE_RANGES_MAX")
                    );
                }
                if count * RANGE_BYTES != self.remaining_bytes() {
                    return Err(self.invalid_at(count_at, "range count does not match the payload"));
                }
                let mut ranges: Vec<Range<u64>> = Vec::with_capacity(count);
                for _ in 0..count {
                    let range_at = self.position;
                    let lba = self.u64()?;
                    let blocks = self.u64()?;
                    if blocks == 0 {
                        return Err(self.invalid_at(range_at, "empty range"));
                    }
                    let Some(end) = lba.checked_add(blocks) else {
                        return Err(self.invalid_at(range_at, "range runs past the last LBA"));
                    };
                    if ranges.last().is_some_and(|last| last.end >= lba) {
                        return Err(self.invalid_at(range_at, "range not after the previous one"));
                    }
                    ranges.push(lba..end);
                }
                Ok(DivergenceReport::Known(ranges))
            }
            _ => Err(self.invalid_at(tag_at, "unknown divergence tag")),
        }
    }
}

/// The message of a payload, and how many of its bytes the frame checksum covers (those before
/// the block data).
fn decode_payload(
    message_type: MessageType,
    payload: &[u8],
    frame: Option<&Bytes>,
) -> Result<(Message, usize), WireError> {
    parse_payload(message_type, payload, frame, true)
        .map(|(message, covered, _)| (message, covered))
}

/// [`decode_payload`], also giving where the block table starts; with `check_blocks` false the
/// blocks' checksums are not compared with their bytes.
fn parse_payload(
    message_type: MessageType,
    payload: &[u8],
    frame: Option<&Bytes>,
    check_blocks: bool,
) -> Result<(Message, usize, Option<usize>), WireError> {
    let mut fields = Fields {
        message_type,
        payload,
        position: 0,
        frame,
        covered: payload.len(),
        table_at: None,
        check_blocks,
    };
    let message = match message_type {
        MessageType::Append => Message::Append {
            epoch: fields.u64()?,
            stream: StreamId(fields.u64()?),
            incarnation: fields.u64()?,
            seq: fields.u64()?,
            commit_op: fields.u64()?,
            entry: fields.entry()?,
        },
        MessageType::Heartbeat => Message::Heartbeat {
            epoch: fields.u64()?,
            stream: StreamId(fields.u64()?),
            incarnation: fields.u64()?,
            commit_op: fields.u64()?,
        },
        MessageType::Ack => Message::Ack {
            epoch: fields.u64()?,
            stream: StreamId(fields.u64()?),
            durable_seq: fields.u64()?,
        },
        MessageType::Probe => Message::Probe { epoch: fields.u64()? },
        MessageType::ProbeReply => Message::ProbeReply {
            epoch: fields.u64()?,
            incarnation: fields.u64()?,
            volume_blocks: fields.u64()?,
            divergence: fields.divergence()?,
        },
        MessageType::Hello => Message::Hello {
            epoch: fields.u64()?,
            incarnation: fields.u64()?,
            last_term_epoch: fields.u64()?,
            volume_blocks: fields.u64()?,
            divergence: fields.divergence()?,
        },
        MessageType::Stale => Message::Stale { epoch: fields.u64()? },
        MessageType::Resync => Message::Resync { epoch: fields.u64()?, incarnation: fields.u64()? },
        MessageType::Failed => Message::Failed { epoch: fields.u64()?, incarnation: fields.u64()? },
        MessageType::Read => fields.read()?,
        MessageType::ReadReply => fields.read_reply()?,
        MessageType::Damaged => fields.damaged()?,
    };
    let (covered, table_at) = (fields.covered, fields.table_at);
    fields.finish()?;
    Ok((message, covered, table_at))
}

/// Rewrites the checksums of the frame at the start of `bytes` to match its bytes: each
/// block's in the block table (when the fields read), the frame checksum (when the whole frame
/// is there), and the header check (when the header is). Tests and the fuzz target use it to
/// reach the checks behind the checksums with damaged fields; no node calls it.
#[doc(hidden)]
pub fn reseal(bytes: &mut [u8]) {
    if bytes.len() < HEADER_BYTES {
        return;
    }
    let payload_bytes = le_u32(bytes, offset::PAYLOAD_BYTES) as usize;
    if let Some(frame) = bytes.get_mut(..HEADER_BYTES.saturating_add(payload_bytes)) {
        let (header, payload) = frame.split_at_mut(HEADER_BYTES);
        let parsed = MessageType::from_u8(header[offset::TYPE])
            .and_then(|message_type| parse_payload(message_type, payload, None, false).ok());
        let mut covered = payload.len();
        if let Some((_, data_at, table_at)) = parsed {
            covered = data_at;
            let mut at = table_at.unwrap_or(data_at);
            let mut data = data_at;
            while at < data_at {
                if payload[at] == BLOCK_UNMAPPED {
                    at += BLOCK_UNMAPPED_BYTES;
                    continue;
                }
                let length = le_u32(payload, at + 1) as usize;
                let crc = crc32c::crc32c(&payload[data..data + length]);
                payload[at + 5..at + 9].copy_from_slice(&crc.to_le_bytes());
                at += BLOCK_MAPPED_FIXED_BYTES;
                data += length;
            }
        }
        let checksum = frame_checksum(&header[..offset::CHECKSUM], &payload[..covered]);
        header[offset::CHECKSUM..offset::HEADER_CHECK].copy_from_slice(&checksum.to_le_bytes());
    }
    let header_check = crc32c::crc32c(&bytes[..offset::HEADER_CHECK]);
    bytes[offset::HEADER_CHECK..HEADER_BYTES].copy_from_slice(&header_check.to_le_bytes());
}

/// Bytes a [`FrameReader`] buffers: one largest frame. Once the complete frames are taken out,
/// what remains is part of one frame, so there is always room for more bytes.
pub const FRAME_READER_BUFFER_BYTES: usize = MESSAGE_BYTES_MAX;
/// Room a [`FrameReader`] offers a read at least (less only when less completes its buffer).
const READ_BYTES_MIN: usize = 64 << 10;
/// Bytes of each buffer a [`FrameReader`] allocates: one largest frame and one read. A frame
/// taken out stays in it, shared by its blocks, until the last of them is dropped; the reader
/// moves the part of a frame it holds to a fresh buffer once the room left is short of a read.
const FRAME_READER_ALLOCATION_BYTES: usize = FRAME_READER_BUFFER_BYTES + READ_BYTES_MIN;

/// Cuts the bytes of one connection, as they arrive in pieces of any size, into messages.
/// After an error (other than needing more bytes) the stream's framing is lost: the reader
/// returns that error from then on, and the caller closes the connection.
pub struct FrameReader {
    /// Bytes received and not yet decoded; the next bytes go into its spare capacity.
    buffer: BytesMut,
    error: Option<WireError>,
}

impl std::fmt::Debug for FrameReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameReader")
            .field("buffered_bytes", &self.buffered_bytes())
            .field("error", &self.error)
            .finish()
    }
}

impl Default for FrameReader {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameReader {
    pub fn new() -> Self {
        Self { buffer: BytesMut::with_capacity(FRAME_READER_ALLOCATION_BYTES), error: None }
    }

    /// Bytes received and not yet returned as messages.
    pub fn buffered_bytes(&self) -> usize {
        self.buffer.len()
    }

    /// Where the next bytes of the stream go: read the socket into it (`read_buf`), which
    /// appends them. Never larger than the room left of [`FRAME_READER_BUFFER_BYTES`]; empty
    /// only while a whole frame is buffered: take messages out with [`next_message`] until it
    /// returns `None` first.
    ///
    /// [`next_message`]: FrameReader::next_message
    pub fn read_buffer(&mut self) -> bytes::buf::Limit<&mut BytesMut> {
        let room = FRAME_READER_BUFFER_BYTES - self.buffer.len();
        let wanted = room.min(READ_BYTES_MIN);
        if self.buffer.capacity() - self.buffer.len() < wanted && !self.buffer.try_reclaim(wanted) {
            // Frames taken out still share this allocation: continue in a fresh one.
            let mut fresh = BytesMut::with_capacity(FRAME_READER_ALLOCATION_BYTES);
            fresh.extend_from_slice(&self.buffer);
            self.buffer = fresh;
        }
        assert!(self.buffer.capacity() - self.buffer.len() >= wanted);
        (&mut self.buffer).limit(room)
    }

    /// Copies as much of `bytes` as fits and returns how many it took; the caller offers the
    /// rest after taking messages out.
    pub fn push(&mut self, bytes: &[u8]) -> usize {
        let mut target = self.read_buffer();
        let count = bytes.len().min(target.remaining_mut());
        target.put_slice(&bytes[..count]);
        count
    }

    /// The next whole message, `None` if more bytes are needed first.
    pub fn next_message(&mut self) -> Result<Option<Envelope>, WireError> {
        if let Some(error) = &self.error {
            return Err(error.clone());
        }
        let decoded = match decode_header(&self.buffer) {
            Ok((message_type, frame_bytes)) if frame_bytes <= self.buffer.len() => {
                let frame = self.buffer.split_to(frame_bytes).freeze();
                decode_frame(message_type, &frame, Some(&frame))
            }
            Ok((_, frame_bytes)) => Err(WireError::Incomplete { needed_bytes: frame_bytes }),
            Err(error) => Err(error),
        };
        match decoded {
            Ok(envelope) => Ok(Some(envelope)),
            Err(WireError::Incomplete { needed_bytes }) => {
                assert!(needed_bytes <= FRAME_READER_BUFFER_BYTES);
                Ok(None)
            }
            Err(error) => {
                self.error = Some(error.clone());
                Err(error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::merge_ranges;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn block(bytes: usize, seed: u8) -> BlockData {
        let data: Vec<u8> =
            (0..bytes).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        Some(data.into())
    }

    fn append(kind: EntryKind, lba: u64, blocks: Vec<BlockData>) -> Message {
        Message::Append {
            epoch: 7,
            stream: StreamId(3),
            incarnation: 0xDEAD_BEEF,
            seq: 12,
            commit_op: 9,
            entry: Entry { kind, lba, blocks },
        }
    }

    /// One or more messages of every variant, small enough to corrupt byte by byte.
    fn samples() -> Vec<Message> {
        vec![
            append(EntryKind::Write { op: 10 }, 100, vec![block(8, 1), None, block(1, 2)]),
            append(EntryKind::Copy { covers_op: 0 }, u64::MAX - 1, vec![None]),
            append(EntryKind::Copy { covers_op: u64::MAX }, 0, vec![block(32, 3)]),
            Message::Heartbeat {
                epoch: u64::MAX,
                stream: StreamId(0),
                incarnation: 1,
                commit_op: 2,
            },
            Message::Ack { epoch: 1, stream: StreamId(u64::MAX), durable_seq: 44 },
            Message::Probe { epoch: 5 },
            Message::ProbeReply {
                epoch: 5,
                incarnation: 6,
                volume_blocks: 1 << 28,
                divergence: DivergenceReport::Unknown,
            },
            Message::ProbeReply {
                epoch: 5,
                incarnation: 6,
                volume_blocks: u64::MAX,
                divergence: DivergenceReport::Known(vec![]),
            },
            Message::ProbeReply {
                epoch: 5,
                incarnation: 6,
                volume_blocks: u64::MAX,
                divergence: DivergenceReport::Known(vec![0..1, 3..300, u64::MAX - 1..u64::MAX]),
            },
            Message::Hello {
                epoch: 0,
                incarnation: 0,
                last_term_epoch: 0,
                volume_blocks: 1,
                divergence: DivergenceReport::Unknown,
            },
            Message::Hello {
                epoch: 9,
                incarnation: 10,
                last_term_epoch: 8,
                volume_blocks: 5,
                divergence: DivergenceReport::Known(vec![1..2, 4..5]),
            },
            Message::Stale { epoch: 8 },
            Message::Resync { epoch: 2, incarnation: 99 },
            Message::Failed { epoch: 3, incarnation: 100 },
            Message::Read { epoch: 4, incarnation: 7, request: 1, lba: 9, count: 2 },
            Message::Read {
                epoch: 4,
                incarnation: 7,
                request: u64::MAX,
                lba: u64::MAX - 64,
                count: 64,
            },
            Message::ReadReply { epoch: 4, request: 1, blocks: None },
            Message::ReadReply { epoch: 4, request: 2, blocks: Some(vec![block(8, 5), None]) },
            Message::Damaged { epoch: 4, incarnation: 7, lba: 3, count: 1 },
        ]
    }

    /// A deallocate of `count` blocks, as the primary streams it.
    fn deallocate(count: u32) -> Message {
        append(EntryKind::Write { op: 11 }, 4096, vec![None; count as usize])
    }

    /// The message in an envelope whose every header byte differs.
    fn envelope(message: Message) -> Envelope {
        Envelope { volume: 0x1122_3344_5566_7788, sender: NodeId(0x99AA_BBCC), message }
    }

    fn random_envelope(rng: &mut StdRng) -> Envelope {
        let message = random_message(rng);
        Envelope { volume: rng.random(), sender: NodeId(rng.random()), message }
    }

    fn random_message(rng: &mut StdRng) -> Message {
        let epoch = rng.random_range(0..4u64);
        let incarnation = rng.random();
        let stream = StreamId(rng.random());
        match rng.random_range(0..12) {
            0 => {
                // Some entries are deallocates: long, and every block unmapped.
                let unmapped = rng.random_bool(0.2);
                let count_max =
                    if unmapped { DEALLOCATE_BLOCKS_PER_OP_MAX } else { BLOCKS_PER_OP_MAX };
                let count = rng.random_range(1..=count_max) as usize;
                let size_bytes = rng.random_range(1..=BLOCK_BYTES_MAX);
                let blocks = (0..count)
                    .map(|_| {
                        let mapped = !unmapped && rng.random_bool(0.7);
                        mapped.then(|| block(size_bytes, rng.random())).flatten()
                    })
                    .collect::<Vec<_>>();
                let op = rng.random();
                let kind = if rng.random() {
                    EntryKind::Write { op }
                } else {
                    EntryKind::Copy { covers_op: op }
                };
                let lba = rng.random_range(0..=u64::MAX - count as u64);
                Message::Append {
                    epoch,
                    stream,
                    incarnation,
                    seq: rng.random(),
                    commit_op: rng.random(),
                    entry: Entry { kind, lba, blocks },
                }
            }
            1 => Message::Heartbeat { epoch, stream, incarnation, commit_op: rng.random() },
            2 => Message::Ack { epoch, stream, durable_seq: rng.random() },
            3 => Message::Probe { epoch },
            4 => Message::ProbeReply {
                epoch,
                incarnation,
                volume_blocks: rng.random(),
                divergence: random_divergence(rng),
            },
            5 => Message::Hello {
                epoch,
                incarnation,
                last_term_epoch: rng.random_range(0..4u64),
                volume_blocks: rng.random(),
                divergence: random_divergence(rng),
            },
            6 => Message::Stale { epoch },
            7 => Message::Resync { epoch, incarnation },
            8 => Message::Failed { epoch, incarnation },
            9 => {
                let count = rng.random_range(1..=BLOCKS_PER_OP_MAX);
                let lba = rng.random_range(0..=u64::MAX - u64::from(count));
                Message::Read { epoch, incarnation, request: rng.random(), lba, count }
            }
            10 => {
                let count = rng.random_range(1..=BLOCKS_PER_OP_MAX);
                let lba = rng.random_range(0..=u64::MAX - u64::from(count));
                Message::Damaged { epoch, incarnation, lba, count }
            }
            _ => {
                let blocks = rng.random_bool(0.8).then(|| {
                    let count = rng.random_range(1..=BLOCKS_PER_OP_MAX);
                    let size_bytes = rng.random_range(1..=BLOCK_BYTES_MAX);
                    (0..count)
                        .map(|_| {
                            rng.random_bool(0.7).then(|| block(size_bytes, rng.random())).flatten()
                        })
                        .collect()
                });
                Message::ReadReply { epoch, request: rng.random(), blocks }
            }
        }
    }

    fn random_divergence(rng: &mut StdRng) -> DivergenceReport {
        if rng.random_bool(0.2) {
            DivergenceReport::Unknown
        } else {
            let count = rng.random_range(0..200);
            let ranges = (0..count)
                .map(|_| {
                    let start = rng.random_range(0..u64::MAX - 1);
                    start..rng.random_range(start + 1..=u64::MAX)
                })
                .collect();
            DivergenceReport::Known(merge_ranges(ranges))
        }
    }

    fn frame(message: &Message) -> Vec<u8> {
        frame_of(&envelope(message.clone()))
    }

    fn frame_of(envelope: &Envelope) -> Vec<u8> {
        let mut out = Vec::new();
        let bytes = encode(envelope, &mut out).unwrap();
        assert_eq!(bytes, out.len());
        out
    }

    fn check_round_trip(envelope: &Envelope) {
        let bytes = frame_of(envelope);
        assert!(bytes.len() <= MESSAGE_BYTES_MAX);
        let (decoded, used) = decode(&bytes).unwrap();
        assert_eq!(&decoded, envelope);
        assert_eq!(used, bytes.len());
        // Canonical: the decoded envelope encodes to the same bytes, and trailing bytes are
        // left alone.
        assert_eq!(frame_of(&decoded), bytes);
        // The head and the blocks' bytes from where they lie make the same frame.
        let mut head = vec![7];
        let frame_bytes = encode_head(envelope, &mut head).unwrap();
        assert_eq!(frame_bytes, bytes.len());
        for block in data_blocks(&envelope.message) {
            head.extend_from_slice(block);
        }
        assert_eq!(head[1..], bytes);
        let mut longer = bytes.clone();
        longer.extend_from_slice(&frame(&Message::Probe { epoch: 1 }));
        assert_eq!(decode(&longer).unwrap(), (decoded, used));
    }

    #[test]
    fn every_variant_round_trips() {
        let samples = samples();
        let mut types: Vec<MessageType> = samples.iter().map(MessageType::of).collect();
        types.dedup();
        assert_eq!(types.len(), 12, "a variant has no sample");
        for message in samples {
            check_round_trip(&envelope(message));
        }
    }

    #[test]
    fn random_messages_round_trip() {
        let mut rng = StdRng::seed_from_u64(6);
        for _ in 0..300 {
            check_round_trip(&random_envelope(&mut rng));
        }
        for (volume, sender) in [(0, 0), (u64::MAX, u32::MAX), (1, 2)] {
            let message = Message::Stale { epoch: 3 };
            check_round_trip(&Envelope { volume, sender: NodeId(sender), message });
        }
    }

    #[test]
    fn the_header_carries_volume_and_sender_where_the_spec_says() {
        let bytes = frame(&Message::Ack { epoch: 1, stream: StreamId(2), durable_seq: 3 });
        // The offsets of docs/replication-wire.md.
        assert_eq!(HEADER_BYTES, 32);
        assert_eq!(&bytes[0..4], b"FRRP");
        assert_eq!(bytes[4], 7, "version");
        assert_eq!(bytes[5], MessageType::Ack as u8);
        assert_eq!(&bytes[6..8], &[0, 0], "flags");
        assert_eq!(&bytes[8..12], &24u32.to_le_bytes(), "payload_bytes");
        assert_eq!(&bytes[12..16], &0x99AA_BBCCu32.to_le_bytes(), "sender");
        assert_eq!(&bytes[16..24], &0x1122_3344_5566_7788u64.to_le_bytes(), "volume");
        let checksum = crc32c::crc32c_append(crc32c::crc32c(&bytes[..24]), &bytes[32..]);
        assert_eq!(&bytes[24..28], &checksum.to_le_bytes(), "checksum");
        assert_eq!(&bytes[28..32], &crc32c::crc32c(&bytes[..28]).to_le_bytes(), "header_check");
        assert_eq!(bytes.len(), 32 + 24);
    }

    /// A frame of version 1 (20-byte header, no volume, no sender), built by hand: a node of
    /// this version refuses it at once, on its version byte, rather than misreading it.
    #[test]
    fn a_version_1_frame_is_refused() {
        let mut v1 = Vec::new();
        v1.extend_from_slice(b"FRRP");
        v1.push(1);
        v1.push(MessageType::Probe as u8);
        v1.extend_from_slice(&0u16.to_le_bytes());
        v1.extend_from_slice(&8u32.to_le_bytes());
        let checksum_at = v1.len();
        v1.extend_from_slice(&[0; 8]);
        v1.extend_from_slice(&5u64.to_le_bytes());
        let checksum = crc32c::crc32c_append(crc32c::crc32c(&v1[..12]), &v1[20..]);
        v1[checksum_at..checksum_at + 4].copy_from_slice(&checksum.to_le_bytes());
        let header_check = crc32c::crc32c(&v1[..16]);
        v1[checksum_at + 4..checksum_at + 8].copy_from_slice(&header_check.to_le_bytes());
        let refused = WireError::VersionUnsupported { version: 1 };
        for length in 5..=v1.len() {
            assert_eq!(decode(&v1[..length]), Err(refused.clone()));
        }
        let mut reader = FrameReader::new();
        reader.push(&v1);
        assert_eq!(reader.next_message(), Err(refused.clone()));
        assert!(refused.to_string().contains("reads only version 7"), "{refused}");
    }

    #[test]
    fn the_largest_messages_fit_the_limit() {
        let full: Vec<BlockData> =
            (0..BLOCKS_PER_OP_MAX).map(|i| block(BLOCK_BYTES_MAX, i as u8)).collect();
        let largest = append(EntryKind::Write { op: 1 }, 0, full);
        assert_eq!(frame(&largest).len(), MESSAGE_BYTES_MAX);
        // The numbers of docs/replication-wire.md.
        assert_eq!(MESSAGE_BYTES_MAX, 262_813);
        assert_eq!(MessageType::Append.payload_bytes(), 62..=262_781);
        assert_eq!(MessageType::ProbeReply.payload_bytes(), 25..=262_173);
        assert_eq!(MessageType::Hello.payload_bytes(), 33..=262_181);
        assert_eq!(MessageType::Read.payload_bytes(), 36..=36);
        assert_eq!(MessageType::Damaged.payload_bytes(), 28..=28);
        assert_eq!(MessageType::ReadReply.payload_bytes(), 17..=262_741);
        let largest_reply = Message::ReadReply {
            epoch: 1,
            request: 2,
            blocks: Some((0..BLOCKS_PER_OP_MAX).map(|i| block(BLOCK_BYTES_MAX, i as u8)).collect()),
        };
        assert_eq!(frame(&largest_reply).len(), HEADER_BYTES + 262_741);
        check_round_trip(&envelope(largest_reply));
        check_round_trip(&envelope(largest));

        let ranges: Vec<Range<u64>> =
            (0..DIVERGENCE_RANGES_MAX as u64).map(|index| index * 2..index * 2 + 1).collect();
        let known = Message::ProbeReply {
            epoch: 1,
            incarnation: 2,
            volume_blocks: 7,
            divergence: DivergenceReport::Known(ranges.clone()),
        };
        check_round_trip(&envelope(known));
        let hello = |divergence| Message::Hello {
            epoch: 1,
            incarnation: 2,
            last_term_epoch: 3,
            volume_blocks: 7,
            divergence,
        };
        let longest_hello = hello(DivergenceReport::Known(ranges.clone()));
        assert_eq!(frame(&longest_hello).len(), HEADER_BYTES + 262_181);
        check_round_trip(&envelope(longest_hello));
        // A list that is not canonical (here the same range twice) goes as Unknown too.
        let mut twice = ranges.clone();
        twice.push(twice[twice.len() - 1].clone());
        let (decoded, _) = decode(&frame(&hello(DivergenceReport::Known(twice)))).unwrap();
        assert_eq!(decoded.message, hello(DivergenceReport::Unknown));

        // One range more than the wire carries goes as Unknown, which makes the new primary copy
        // every block: what the replica itself reports past its own limit.
        let mut too_many = ranges;
        too_many.push(u64::MAX - 1..u64::MAX);
        let overflow = Message::ProbeReply {
            epoch: 1,
            incarnation: 2,
            volume_blocks: 7,
            divergence: DivergenceReport::Known(too_many),
        };
        let (decoded, _) = decode(&frame(&overflow)).unwrap();
        assert_eq!(
            decoded.message,
            Message::ProbeReply {
                epoch: 1,
                incarnation: 2,
                volume_blocks: 7,
                divergence: DivergenceReport::Unknown
            }
        );
    }

    #[test]
    fn a_deallocate_is_one_byte_per_block() {
        let fixed_bytes = HEADER_BYTES + APPEND_FIXED_BYTES;
        for count in [1, 2, BLOCKS_PER_OP_MAX, BLOCKS_PER_OP_MAX + 1, DEALLOCATE_BLOCKS_PER_OP_MAX]
        {
            let message = deallocate(count);
            assert_eq!(frame(&message).len(), fixed_bytes + count as usize, "{count} blocks");
            check_round_trip(&envelope(message));
        }
        // 8 MiB of 4 KiB blocks travel in 2 KiB (and the 93 bytes of header and entry).
        assert_eq!(frame(&deallocate(2048)).len(), 2048 + 93);
    }

    #[test]
    fn every_single_byte_corruption_is_rejected() {
        let mut messages = samples();
        messages.push(deallocate(BLOCKS_PER_OP_MAX + 3));
        for message in messages {
            let bytes = frame(&message);
            for at in 0..bytes.len() {
                for flip in 1..=u8::MAX {
                    let mut corrupt = bytes.clone();
                    corrupt[at] ^= flip;
                    match decode(&corrupt) {
                        Err(error) if !error.is_incomplete() => {}
                        other => panic!("{message:?}: byte {at} ^ {flip:#x} gave {other:?}"),
                    }
                }
            }
        }
    }

    #[test]
    fn every_truncation_asks_for_more() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut messages: Vec<Envelope> = samples().into_iter().map(envelope).collect();
        messages.extend((0..20).map(|_| random_envelope(&mut rng)));
        messages.push(envelope(deallocate(DEALLOCATE_BLOCKS_PER_OP_MAX)));
        for message in messages {
            let bytes = frame_of(&message);
            for length in 0..bytes.len() {
                match decode(&bytes[..length]) {
                    Err(WireError::Incomplete { needed_bytes }) => {
                        assert!(needed_bytes > length && needed_bytes <= bytes.len());
                    }
                    other => panic!("{message:?} cut to {length} bytes gave {other:?}"),
                }
            }
        }
    }

    #[test]
    fn encode_refuses_entries_the_wire_cannot_carry() {
        let check = |blocks: Vec<BlockData>, lba: u64, expected: EncodeError| {
            let mut out = vec![1, 2, 3];
            let message = envelope(append(EntryKind::Write { op: 1 }, lba, blocks));
            assert_eq!(encode(&message, &mut out), Err(expected));
            assert_eq!(out, [1, 2, 3]);
        };
        check(vec![], 0, EncodeError::BlockCount { count: 0 });
        let mut long_with_data = vec![None; 65];
        long_with_data[64] = block(8, 0);
        check(long_with_data, 0, EncodeError::BlockCount { count: 65 });
        check(vec![None; 2049], 0, EncodeError::BlockCount { count: 2049 });
        check(
            vec![None; 2],
            u64::MAX - 1,
            EncodeError::LbaOverflow { lba: u64::MAX - 1, count: 2 },
        );
        check(vec![None, block(0, 0)], 0, EncodeError::BlockSize { index: 1, size_bytes: 0 });
        check(vec![block(4097, 0)], 0, EncodeError::BlockSize { index: 0, size_bytes: 4097 });
    }

    /// Builds a frame of `message`, lets `edit` change it, reseals it and expects `expected`.
    fn check_refused(message: Message, edit: impl FnOnce(&mut Vec<u8>), expected: WireError) {
        let mut bytes = frame(&message);
        edit(&mut bytes);
        let payload_bytes = (bytes.len() - HEADER_BYTES) as u32;
        bytes[offset::PAYLOAD_BYTES..offset::SENDER].copy_from_slice(&payload_bytes.to_le_bytes());
        reseal(&mut bytes);
        assert_eq!(decode(&bytes).map(|(envelope, _)| envelope), Err(expected));
    }

    #[test]
    fn decode_names_each_bad_field() {
        let field =
            |message_type, offset, reason| WireError::FieldInvalid { message_type, offset, reason };
        let one_block = append(EntryKind::Write { op: 1 }, 5, vec![block(4, 0)]);
        // Payload offsets of the entry fields.
        let kind_at = HEADER_BYTES + 40;
        let count_at = kind_at + 17;
        let block_at = count_at + 4;
        let set_u32 = |at: usize, value: u32| {
            move |bytes: &mut Vec<u8>| bytes[at..at + 4].copy_from_slice(&value.to_le_bytes())
        };
        let append_type = MessageType::Append;

        check_refused(
            one_block.clone(),
            |bytes| bytes[kind_at] = 3,
            field(append_type, kind_at, "unknown entry kind"),
        );
        for count in [0, DEALLOCATE_BLOCKS_PER_OP_MAX + 1] {
            check_refused(
                one_block.clone(),
                set_u32(count_at, count),
                field(
                    append_type,
                    count_at,
                    "block count outside 1..=DEALLOCATE_BLOCKS_PER_OP_MAX",
                ),
            );
        }
        // Data in an entry longer than a write: the first block of a deallocate of 65 blocks
        // becomes a mapped one.
        check_refused(
            append(EntryKind::Write { op: 1 }, 0, vec![None; BLOCKS_PER_OP_MAX as usize + 1]),
            |bytes| {
                bytes.splice(block_at..block_at + 1, [BLOCK_MAPPED, 4, 0, 0, 0, 9, 9, 9, 9]);
            },
            field(
                append_type,
                block_at,
                "mapped block in an entry of more than BLOCKS_PER_OP_MAX blocks",
            ),
        );
        // A second table entry where the first block's bytes start (a 0, unmapped) leaves the
        // data one byte short.
        check_refused(
            one_block.clone(),
            set_u32(count_at, 2),
            field(append_type, block_at + 10, "payload ends inside the block data"),
        );
        check_refused(
            append(EntryKind::Write { op: 1 }, 5, vec![block(4, 1)]),
            set_u32(count_at, 2),
            field(append_type, block_at + 10, "payload ends inside a field"),
        );
        check_refused(
            append(EntryKind::Write { op: 1 }, u64::MAX - 1, vec![None]),
            set_u32(count_at, 2),
            field(append_type, count_at, "entry runs past the last LBA"),
        );
        check_refused(
            append(EntryKind::Write { op: 1 }, 0, vec![None]),
            set_u32(count_at, 64),
            field(append_type, count_at, "block count exceeds the payload"),
        );
        check_refused(
            one_block.clone(),
            |bytes| bytes[block_at] = 2,
            field(append_type, block_at, "unknown block tag"),
        );
        for length in [0, BLOCK_BYTES_MAX as u32 + 1] {
            check_refused(
                one_block.clone(),
                set_u32(block_at + 1, length),
                field(append_type, block_at + 1, "block length outside 1..=BLOCK_BYTES_MAX"),
            );
        }
        check_refused(
            one_block.clone(),
            |bytes| bytes.push(0),
            field(append_type, block_at + 13, "payload continues after its last field"),
        );
        // A block's bytes are covered by its own checksum, in the table: the frame checksum
        // stops where the data starts.
        let two_blocks =
            append(EntryKind::Write { op: 1 }, 5, vec![block(4, 0), None, block(8, 3)]);
        let mut bytes = frame(&two_blocks);
        let stored = crc32c::crc32c(&bytes[bytes.len() - 8..]);
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        let computed = crc32c::crc32c(&bytes[bytes.len() - 8..]);
        assert_eq!(
            decode(&bytes).map(|(envelope, _)| envelope),
            Err(WireError::BlockChecksumMismatch {
                message_type: append_type,
                index: 2,
                stored,
                computed
            })
        );
        let checksum = frame_checksum(&bytes[..offset::CHECKSUM], &bytes[HEADER_BYTES..last - 11]);
        assert_eq!(&bytes[offset::CHECKSUM..offset::HEADER_CHECK], &checksum.to_le_bytes());

        // The divergence of a ProbeReply (after 24 bytes) and of a Hello (after 32).
        let hello = |divergence| Message::Hello {
            epoch: 1,
            incarnation: 2,
            last_term_epoch: 3,
            volume_blocks: 7,
            divergence,
        };
        let carriers =
            [(MessageType::ProbeReply, HEADER_BYTES + 24), (MessageType::Hello, HEADER_BYTES + 32)];
        for (message_type, tag_at) in carriers {
            let message = |divergence| match message_type {
                MessageType::Hello => hello(divergence),
                _ => Message::ProbeReply { epoch: 1, incarnation: 2, volume_blocks: 7, divergence },
            };
            check_refused(
                message(DivergenceReport::Unknown),
                |bytes| bytes[tag_at] = 2,
                field(message_type, tag_at, "unknown divergence tag"),
            );
            let two = || message(DivergenceReport::Known(vec![1..3, 5..6]));
            check_refused(
                two(),
                set_u32(tag_at + 1, 3),
                field(message_type, tag_at + 1, "range count does not match the payload"),
            );
            check_refused(
                two(),
                set_u32(tag_at + 1, DIVERGENCE_RANGES_MAX as u32 + 1),
                field(message_type, tag_at + 1, "range count above DIVERGENCE_RANGES_MAX"),
            );
            // The ranges start after the count: (LBA, blocks) each.
            let second = tag_at + 5 + RANGE_BYTES;
            let set_u64 = |at: usize, value: u64| {
                move |bytes: &mut Vec<u8>| bytes[at..at + 8].copy_from_slice(&value.to_le_bytes())
            };
            check_refused(
                two(),
                set_u64(second + 8, 0),
                field(message_type, second, "empty range"),
            );
            check_refused(
                two(),
                set_u64(second, u64::MAX),
                field(message_type, second, "range runs past the last LBA"),
            );
            for (lba, blocks) in [(3, 1), (2, 1), (0, 1)] {
                let edit = |bytes: &mut Vec<u8>| {
                    set_u64(second, lba)(bytes);
                    set_u64(second + 8, blocks)(bytes);
                };
                check_refused(
                    two(),
                    edit,
                    field(message_type, second, "range not after the previous one"),
                );
            }
            check_round_trip(&envelope(message(DivergenceReport::Known(vec![1..3, 4..6]))));
        }
        check_refused(
            hello(DivergenceReport::Unknown),
            |bytes| bytes.truncate(bytes.len() - 9),
            WireError::LengthInvalid {
                message_type: MessageType::Hello,
                payload_bytes: 24,
                range: 33..=262_181,
            },
        );
        check_refused(
            Message::Probe { epoch: 1 },
            |bytes| bytes.push(0),
            WireError::LengthInvalid {
                message_type: MessageType::Probe,
                payload_bytes: 9,
                range: 8..=8,
            },
        );
        check_refused(
            Message::Probe { epoch: 1 },
            |bytes| bytes[offset::TYPE] = 13,
            WireError::TypeUnknown { message_type: 13 },
        );
        check_refused(
            Message::Probe { epoch: 1 },
            |bytes| bytes[offset::FLAGS] = 1,
            WireError::FlagsReserved { flags: 1 },
        );
        for version in [0, 1, 2, 3, 4, 5, 6, 8, u8::MAX] {
            check_refused(
                Message::Probe { epoch: 1 },
                |bytes| bytes[offset::VERSION] = version,
                WireError::VersionUnsupported { version },
            );
        }
        let too_long = PAYLOAD_BYTES_MAX as u32 + 1;
        let mut bytes = frame(&one_block);
        bytes[offset::PAYLOAD_BYTES..offset::SENDER].copy_from_slice(&too_long.to_le_bytes());
        reseal(&mut bytes);
        assert_eq!(
            decode(&bytes[..HEADER_BYTES]).map(|(envelope, _)| envelope),
            Err(WireError::LengthInvalid {
                message_type: append_type,
                payload_bytes: too_long,
                range: APPEND_PAYLOAD_BYTES_MIN..=APPEND_PAYLOAD_BYTES_MAX,
            })
        );
        // Garbage fails on its first byte, without waiting for a header.
        assert_eq!(
            decode(b"G").map(|(envelope, _)| envelope),
            Err(WireError::MagicWrong { offset: 0, found: b'G', expected: b'F' })
        );
    }

    #[test]
    fn decode_names_each_bad_field_of_a_read_its_reply_and_a_damage_report() {
        let field =
            |message_type, offset, reason| WireError::FieldInvalid { message_type, offset, reason };
        let read = Message::Read { epoch: 1, incarnation: 2, request: 3, lba: 4, count: 1 };
        let count_at = HEADER_BYTES + 32;
        for count in [0, BLOCKS_PER_OP_MAX + 1] {
            check_refused(
                read.clone(),
                |bytes| bytes[count_at..count_at + 4].copy_from_slice(&count.to_le_bytes()),
                field(MessageType::Read, count_at, "block count outside 1..=BLOCKS_PER_OP_MAX"),
            );
        }
        let lba_at = HEADER_BYTES + 24;
        check_refused(
            read.clone(),
            |bytes| bytes[lba_at..lba_at + 8].copy_from_slice(&u64::MAX.to_le_bytes()),
            field(MessageType::Read, count_at, "read runs past the last LBA"),
        );
        let damaged = Message::Damaged { epoch: 1, incarnation: 2, lba: 4, count: 1 };
        let damaged_count_at = HEADER_BYTES + 24;
        check_refused(
            damaged.clone(),
            |bytes| bytes[damaged_count_at..damaged_count_at + 4].copy_from_slice(&[65, 0, 0, 0]),
            field(
                MessageType::Damaged,
                damaged_count_at,
                "block count outside 1..=BLOCKS_PER_OP_MAX",
            ),
        );
        let reply = Message::ReadReply { epoch: 1, request: 2, blocks: Some(vec![block(4, 0)]) };
        let tag_at = HEADER_BYTES + 16;
        check_refused(
            reply.clone(),
            |bytes| bytes[tag_at] = 2,
            field(MessageType::ReadReply, tag_at, "unknown read reply tag"),
        );
        let reply_count_at = tag_at + 1;
        for count in [0, BLOCKS_PER_OP_MAX + 1] {
            check_refused(
                reply.clone(),
                |bytes| {
                    bytes[reply_count_at..reply_count_at + 4].copy_from_slice(&count.to_le_bytes())
                },
                field(
                    MessageType::ReadReply,
                    reply_count_at,
                    "block count outside 1..=BLOCKS_PER_OP_MAX",
                ),
            );
        }
        // A reply without blocks that carries some anyway.
        check_refused(
            Message::ReadReply { epoch: 1, request: 2, blocks: None },
            |bytes| bytes.push(0),
            field(MessageType::ReadReply, tag_at + 1, "payload continues after its last field"),
        );
        // The sender's limits hold on encode too.
        let mut out = Vec::new();
        let too_long = Message::Read { epoch: 1, incarnation: 2, request: 3, lba: 0, count: 65 };
        assert_eq!(
            encode(&envelope(too_long), &mut out),
            Err(EncodeError::ReadLength { lba: 0, count: 65 })
        );
        let empty = Message::ReadReply { epoch: 1, request: 2, blocks: Some(vec![]) };
        assert_eq!(
            encode(&envelope(empty), &mut out),
            Err(EncodeError::ReadReplyCount { count: 0 })
        );
        assert!(out.is_empty());
    }

    /// Feeds `bytes` to a reader in chunks of the sizes `chunk` draws, alternating `push` and
    /// writing into `read_buffer`, and returns the messages in order.
    fn read_all(bytes: &[u8], mut chunk: impl FnMut() -> usize) -> Vec<Envelope> {
        let mut reader = FrameReader::new();
        let mut messages = Vec::new();
        let mut position = 0;
        let mut use_push = false;
        while position < bytes.len() {
            let wanted = chunk().min(bytes.len() - position);
            let taken = if use_push {
                reader.push(&bytes[position..position + wanted])
            } else {
                let mut target = reader.read_buffer();
                let count = wanted.min(target.remaining_mut());
                target.put_slice(&bytes[position..position + count]);
                count
            };
            use_push = !use_push;
            position += taken;
            while let Some(message) = reader.next_message().unwrap() {
                messages.push(message);
            }
            assert!(
                reader.read_buffer().remaining_mut() > 0,
                "no room after taking every message out"
            );
            assert!(reader.buffered_bytes() <= FRAME_READER_BUFFER_BYTES);
        }
        assert_eq!(reader.buffered_bytes(), 0);
        messages
    }

    #[test]
    fn frame_reader_splits_and_joins_frames_across_chunks() {
        let mut rng = StdRng::seed_from_u64(8);
        let mut messages: Vec<Envelope> = samples().into_iter().map(envelope).collect();
        messages.extend((0..40).map(|_| random_envelope(&mut rng)));
        let full: Vec<BlockData> =
            (0..BLOCKS_PER_OP_MAX).map(|i| block(BLOCK_BYTES_MAX, i as u8)).collect();
        messages.insert(5, envelope(append(EntryKind::Write { op: 1 }, 0, full.clone())));
        messages.insert(9, envelope(deallocate(DEALLOCATE_BLOCKS_PER_OP_MAX)));
        messages.push(envelope(append(EntryKind::Copy { covers_op: 0 }, 0, full)));
        let mut stream = Vec::new();
        for message in &messages {
            encode(message, &mut stream).unwrap();
        }
        assert_eq!(read_all(&stream, || 1), messages);
        assert_eq!(read_all(&stream, || stream.len()), messages);
        for round in 0..8 {
            let chunk_max = [3, 17, 64, 1500, 9000, 65536, 300_000, 1 << 20][round];
            assert_eq!(read_all(&stream, || rng.random_range(1..=chunk_max)), messages);
        }
    }

    #[test]
    fn frame_reader_hands_out_blocks_without_copying_them() {
        let write = |lba: u64, seed: u8| {
            let blocks = (0..3).map(|i| block(BLOCK_BYTES_MAX, seed + i)).collect();
            envelope(append(EntryKind::Write { op: lba }, lba, blocks))
        };
        let messages = [write(1, 10), write(2, 20)];
        let mut stream = Vec::new();
        for message in &messages {
            encode(message, &mut stream).unwrap();
        }
        let mut reader = FrameReader::new();
        assert_eq!(reader.push(&stream), stream.len());
        let mut received = Vec::new();
        while let Some(envelope) = reader.next_message().unwrap() {
            received.push(envelope);
        }
        assert_eq!(received, messages);
        let starts: Vec<usize> = received
            .iter()
            .flat_map(|envelope| match &envelope.message {
                Message::Append { entry, .. } => entry.blocks.clone(),
                _ => unreachable!("only appends were sent"),
            })
            .map(|block| block.expect("every block is mapped").as_ptr() as usize)
            .collect();
        // Each block sits in the reader's buffer where the stream put it: a frame's blocks back
        // to back, one frame's header, fields and block table between frames.
        let frame_bytes = stream.len() / 2;
        let after_block = BLOCK_BYTES_MAX;
        assert_eq!(
            starts.windows(2).map(|pair| pair[1].wrapping_sub(pair[0])).collect::<Vec<_>>(),
            [after_block, after_block, frame_bytes - 2 * after_block, after_block, after_block]
        );
    }

    #[test]
    fn frame_reader_keeps_an_error() {
        let mut reader = FrameReader::new();
        let mut bytes = frame(&Message::Probe { epoch: 1 });
        let good = bytes.clone();
        bytes[HEADER_BYTES] ^= 1;
        bytes.extend_from_slice(&good);
        assert_eq!(reader.push(&bytes), bytes.len());
        let error = reader.next_message().unwrap_err();
        assert!(matches!(error, WireError::ChecksumMismatch { .. }), "{error:?}");
        assert_eq!(reader.next_message(), Err(error));
    }
}
