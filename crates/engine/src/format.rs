//! The on-drive format, version 2: a reserved header region holding the drive superblock, then the
//! log area of the log-structured engine (docs/format-log-v1.md).
//!
//! The byte layout and its crash analysis are specified in docs/format-drive.md; this module is
//! the only code that knows the drive superblock. Version 1 (the walking skeleton's in-place
//! chunks) is refused with a message saying the data dir is of an older format. Everything here is a pure function over bytes: `io` reads and
//! writes the superblock, this module decides what the bytes mean. Bytes read from a drive are
//! never trusted: [`Superblock::decode`] checks the magic, the version, the checksum and every
//! field before anything else sees them.

use std::fmt;

use types::BLOCK_SIZE_BYTES;

/// The first 16 bytes of every Ferrite drive.
pub const SUPERBLOCK_MAGIC: [u8; 16] = *b"FERRITE\0DRIVE\0\0\0";
/// The only drive format this build reads and writes. Version 1 held in-place 64 MiB chunks;
/// version 2 holds the log area of the log-structured engine after the header region.
pub const FORMAT_VERSION: u32 = 2;
/// The superblock is one 4 KiB block at byte 0 of the drive.
pub const SUPERBLOCK_SIZE_BYTES: usize = 4096;
/// The region at the start of a drive reserved for the superblock and future headers; the log
/// area starts right after it, so it stays 1 MiB aligned on any device.
pub const HEADER_REGION_BYTES: u64 = 1 << 20;
/// The most drives one node may have. Bounds per-drive tables and loops.
pub const DRIVE_COUNT_MAX: u16 = 256;

const BLOCK_BYTES: u64 = BLOCK_SIZE_BYTES as u64;
/// Where the checksum sits: the last four bytes of the superblock block.
const CHECKSUM_OFFSET: usize = SUPERBLOCK_SIZE_BYTES - 4;

const _: () = assert!(HEADER_REGION_BYTES % BLOCK_BYTES == 0);
const _: () = assert!(SUPERBLOCK_SIZE_BYTES as u64 == BLOCK_BYTES);
const _: () = assert!(SUPERBLOCK_SIZE_BYTES as u64 <= HEADER_REGION_BYTES);
const _: () = assert!(DRIVE_COUNT_MAX % 64 == 0, "drive sets are kept in u64 bitmaps");

/// A node's identity, written into each of its drives so a drive is never mixed up with another
/// node's. Printed as a UUID (8-4-4-4-12 hexadecimal digits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeUuid(pub [u8; 16]);

impl fmt::Display for NodeUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, byte) in self.0.iter().enumerate() {
            if matches!(index, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// The smallest drive: the header region and 32 MiB for the log.
pub const DRIVE_SIZE_BYTES_MIN: u64 = HEADER_REGION_BYTES + (32 << 20);
/// The largest drive the superblock describes (the log may limit a node further).
pub const DRIVE_SIZE_BYTES_MAX: u64 = 1 << 50;

/// Why a superblock was refused. The messages name the problem and what to do; `io` adds the
/// file name in front.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SuperblockError {
    #[error(
        "it holds no Ferrite superblock (never formatted, or formatting was interrupted); if this \
         data directory was being created, remove it and start again"
    )]
    NotFormatted,
    #[error(
        "this data dir was created by an older Ferrite format; move it away or start with a new \
         --data-dir (its drives use format version {found}, this build reads only version \
         {FORMAT_VERSION})"
    )]
    VersionOlder { found: u32 },
    #[error(
        "it uses drive format version {found}, but this build reads only version {FORMAT_VERSION}: \
         run the Ferrite release that wrote it"
    )]
    VersionUnsupported { found: u32 },
    #[error(
        "its superblock checksum does not match (stored {stored:#010x}, computed \
         {computed:#010x}): the superblock is damaged or was torn while being written; restore \
         the drive from a backup"
    )]
    ChecksumMismatch { stored: u32, computed: u32 },
    #[error("its superblock field {field} holds {value}, which is impossible: {reason}")]
    FieldInvalid { field: &'static str, value: u64, reason: &'static str },
    #[error(
        "it belongs to node {found}, not to this node ({expected}): point the data directory at \
         this node's own drives"
    )]
    NodeMismatch { found: NodeUuid, expected: NodeUuid },
    #[error(
        "it records drive index {found} but is in the place of drive {expected}: drive files were \
         renamed or swapped; give them back their names"
    )]
    IndexMismatch { found: u16, expected: u16 },
    #[error(
        "it records {found} drives in its node, but drive 0 records {expected}: drives from \
         different formats are mixed"
    )]
    CountMismatch { found: u16, expected: u16 },
}

/// The decoded, validated superblock of one drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    pub node_uuid: NodeUuid,
    pub drive_index: u16,
    pub drive_count: u16,
    pub drive_size_bytes: u64,
    /// Where the log area starts; always [`HEADER_REGION_BYTES`] in version 2.
    pub data_offset_bytes: u64,
}

impl Superblock {
    /// The superblock for drive `drive_index` of `drive_count` of a node being formatted.
    pub fn new(
        node_uuid: NodeUuid,
        drive_index: u16,
        drive_count: u16,
        drive_size_bytes: u64,
    ) -> Result<Self, SuperblockError> {
        let superblock = Self {
            node_uuid,
            drive_index,
            drive_count,
            drive_size_bytes,
            data_offset_bytes: HEADER_REGION_BYTES,
        };
        superblock.check_fields()?;
        Ok(superblock)
    }

    /// The 4 KiB block written at byte 0 of the drive.
    pub fn encode(&self) -> [u8; SUPERBLOCK_SIZE_BYTES] {
        let mut bytes = [0u8; SUPERBLOCK_SIZE_BYTES];
        bytes[0..16].copy_from_slice(&SUPERBLOCK_MAGIC);
        bytes[16..20].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes[20..22].copy_from_slice(&self.drive_index.to_le_bytes());
        bytes[22..24].copy_from_slice(&self.drive_count.to_le_bytes());
        bytes[24..40].copy_from_slice(&self.node_uuid.0);
        bytes[40..48].copy_from_slice(&self.drive_size_bytes.to_le_bytes());
        bytes[56..64].copy_from_slice(&self.data_offset_bytes.to_le_bytes());
        let checksum = crc32c::crc32c(&bytes[..CHECKSUM_OFFSET]);
        bytes[CHECKSUM_OFFSET..].copy_from_slice(&checksum.to_le_bytes());
        let decoded = Self::decode(&bytes);
        assert_eq!(decoded.as_ref(), Ok(self), "superblock must survive its own round trip");
        bytes
    }

    /// Parses and validates the first [`SUPERBLOCK_SIZE_BYTES`] of a drive. The magic and the
    /// version sit at fixed offsets in every version; the checksum's place is defined by the
    /// version, so they are checked in that order.
    pub fn decode(bytes: &[u8]) -> Result<Self, SuperblockError> {
        let Some(bytes) = bytes.get(..SUPERBLOCK_SIZE_BYTES) else {
            return Err(SuperblockError::NotFormatted);
        };
        if bytes[0..16] != SUPERBLOCK_MAGIC {
            return Err(SuperblockError::NotFormatted);
        }
        let version = read_u32(bytes, 16);
        if version < FORMAT_VERSION {
            return Err(SuperblockError::VersionOlder { found: version });
        }
        if version != FORMAT_VERSION {
            return Err(SuperblockError::VersionUnsupported { found: version });
        }
        let stored = read_u32(bytes, CHECKSUM_OFFSET);
        let computed = crc32c::crc32c(&bytes[..CHECKSUM_OFFSET]);
        if stored != computed {
            return Err(SuperblockError::ChecksumMismatch { stored, computed });
        }
        let mut node_uuid = [0u8; 16];
        node_uuid.copy_from_slice(&bytes[24..40]);
        let superblock = Self {
            node_uuid: NodeUuid(node_uuid),
            drive_index: read_u16(bytes, 20),
            drive_count: read_u16(bytes, 22),
            drive_size_bytes: read_u64(bytes, 40),
            data_offset_bytes: read_u64(bytes, 56),
        };
        let reserved = read_u64(bytes, 48);
        if reserved != 0 {
            return Err(SuperblockError::FieldInvalid {
                field: "reserved",
                value: reserved,
                reason: "bytes 48..56 are zero in format version 2",
            });
        }
        superblock.check_fields()?;
        Ok(superblock)
    }

    /// Checks that this drive is drive `drive_index` of `drive_count` of node `node_uuid`.
    pub fn validate(
        &self,
        node_uuid: NodeUuid,
        drive_index: u16,
        drive_count: u16,
    ) -> Result<(), SuperblockError> {
        if self.node_uuid != node_uuid {
            return Err(SuperblockError::NodeMismatch {
                found: self.node_uuid,
                expected: node_uuid,
            });
        }
        if self.drive_index != drive_index {
            return Err(SuperblockError::IndexMismatch {
                found: self.drive_index,
                expected: drive_index,
            });
        }
        if self.drive_count != drive_count {
            return Err(SuperblockError::CountMismatch {
                found: self.drive_count,
                expected: drive_count,
            });
        }
        Ok(())
    }

    fn check_fields(&self) -> Result<(), SuperblockError> {
        let invalid =
            |field, value, reason| Err(SuperblockError::FieldInvalid { field, value, reason });
        if self.drive_count == 0 || self.drive_count > DRIVE_COUNT_MAX {
            return invalid("drive_count", self.drive_count.into(), "a node has 1 to 256 drives");
        }
        if self.drive_index >= self.drive_count {
            return invalid("drive_index", self.drive_index.into(), "it must be below drive_count");
        }
        if self.data_offset_bytes != HEADER_REGION_BYTES {
            return invalid(
                "data_offset_bytes",
                self.data_offset_bytes,
                "the log area starts at 1 MiB in format version 2",
            );
        }
        if !(DRIVE_SIZE_BYTES_MIN..=DRIVE_SIZE_BYTES_MAX).contains(&self.drive_size_bytes)
            || self.drive_size_bytes % BLOCK_BYTES != 0
        {
            return invalid(
                "drive_size_bytes",
                self.drive_size_bytes,
                "a drive is a multiple of 4096 bytes of at least 33 MiB (the 1 MiB header and \
                 32 MiB of log) and at most 1 PiB",
            );
        }
        Ok(())
    }
}

fn read_u16(bytes: &[u8], offset: usize) -> u16 {
    let mut field = [0u8; 2];
    field.copy_from_slice(&bytes[offset..offset + 2]);
    u16::from_le_bytes(field)
}

fn read_u32(bytes: &[u8], offset: usize) -> u32 {
    let mut field = [0u8; 4];
    field.copy_from_slice(&bytes[offset..offset + 4]);
    u32::from_le_bytes(field)
}

fn read_u64(bytes: &[u8], offset: usize) -> u64 {
    let mut field = [0u8; 8];
    field.copy_from_slice(&bytes[offset..offset + 8]);
    u64::from_le_bytes(field)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE: NodeUuid = NodeUuid([0x11; 16]);
    const DRIVE_SIZE_BYTES: u64 = HEADER_REGION_BYTES + (640 << 20);

    fn sample() -> Superblock {
        Superblock::new(NODE, 2, 4, DRIVE_SIZE_BYTES).unwrap()
    }

    /// Rewrites a field and fixes the checksum, as a buggy or future writer would.
    fn with_field(offset: usize, value: &[u8]) -> [u8; SUPERBLOCK_SIZE_BYTES] {
        let mut bytes = sample().encode();
        bytes[offset..offset + value.len()].copy_from_slice(value);
        let checksum = crc32c::crc32c(&bytes[..CHECKSUM_OFFSET]);
        bytes[CHECKSUM_OFFSET..].copy_from_slice(&checksum.to_le_bytes());
        bytes
    }

    #[test]
    fn layout_is_pinned() {
        let bytes = sample().encode();
        assert_eq!(&bytes[0..16], b"FERRITE\0DRIVE\0\0\0");
        assert_eq!(bytes[16..20], [2, 0, 0, 0]);
        assert_eq!(bytes[20..22], [2, 0]);
        assert_eq!(bytes[22..24], [4, 0]);
        assert_eq!(bytes[24..40], [0x11; 16]);
        assert_eq!(bytes[40..48], DRIVE_SIZE_BYTES.to_le_bytes());
        assert_eq!(bytes[48..56], [0; 8]);
        assert_eq!(bytes[56..64], [0, 0, 16, 0, 0, 0, 0, 0]);
        assert!(bytes[64..CHECKSUM_OFFSET].iter().all(|b| *b == 0));
        assert_eq!(read_u32(&bytes, CHECKSUM_OFFSET), crc32c::crc32c(&bytes[..CHECKSUM_OFFSET]));
    }

    #[test]
    fn round_trip_and_validate() {
        let superblock = Superblock::decode(&sample().encode()).unwrap();
        assert_eq!(superblock, sample());
        assert_eq!(superblock.validate(NODE, 2, 4), Ok(()));
        let other = NodeUuid([0x22; 16]);
        assert_eq!(
            superblock.validate(other, 2, 4),
            Err(SuperblockError::NodeMismatch { found: NODE, expected: other })
        );
        assert_eq!(
            superblock.validate(NODE, 1, 4),
            Err(SuperblockError::IndexMismatch { found: 2, expected: 1 })
        );
        assert_eq!(
            superblock.validate(NODE, 2, 5),
            Err(SuperblockError::CountMismatch { found: 4, expected: 5 })
        );
    }

    #[test]
    fn refuses_damage() {
        let check = |bytes: &[u8], expect: fn(&SuperblockError) -> bool| {
            let error = Superblock::decode(bytes).unwrap_err();
            assert!(expect(&error), "{error:?}");
        };
        check(&[0u8; SUPERBLOCK_SIZE_BYTES], |e| *e == SuperblockError::NotFormatted);
        check(&sample().encode()[..100], |e| *e == SuperblockError::NotFormatted);
        check(&with_field(16, &3u32.to_le_bytes()), |e| {
            *e == SuperblockError::VersionUnsupported { found: 3 }
        });
        // A drive of the skeleton's chunk format (version 1): refused, naming the remedy.
        let old = with_field(16, &1u32.to_le_bytes());
        check(&old, |e| *e == SuperblockError::VersionOlder { found: 1 });
        let message = Superblock::decode(&old).unwrap_err().to_string();
        assert!(
            message.starts_with(
                "this data dir was created by an older Ferrite format; move it away or start \
                 with a new --data-dir"
            ),
            "{message}"
        );
        for flipped_byte in [20, 30, 45, 70, 4000, CHECKSUM_OFFSET + 1] {
            let mut bytes = sample().encode();
            bytes[flipped_byte] ^= 0x40;
            check(&bytes, |e| matches!(e, SuperblockError::ChecksumMismatch { .. }));
        }
        // A superblock torn at a 512-byte sector: the first sector written, the last one not.
        let mut torn = sample().encode();
        torn[SUPERBLOCK_SIZE_BYTES - 512..].fill(0);
        check(&torn, |e| matches!(e, SuperblockError::ChecksumMismatch { .. }));
        let field_invalid = |e: &SuperblockError| matches!(e, SuperblockError::FieldInvalid { .. });
        check(&with_field(22, &0u16.to_le_bytes()), field_invalid);
        check(&with_field(22, &300u16.to_le_bytes()), field_invalid);
        check(&with_field(20, &4u16.to_le_bytes()), field_invalid);
        check(&with_field(40, &(HEADER_REGION_BYTES + 100).to_le_bytes()), field_invalid);
        check(&with_field(40, &(DRIVE_SIZE_BYTES + 512).to_le_bytes()), field_invalid);
        check(&with_field(48, &(64u64 << 20).to_le_bytes()), field_invalid);
        check(&with_field(56, &0u64.to_le_bytes()), field_invalid);
    }

    #[test]
    fn refuses_impossible_formats() {
        assert!(Superblock::new(NODE, 0, 1, DRIVE_SIZE_BYTES_MIN).is_ok());
        assert!(Superblock::new(NODE, 0, 1, DRIVE_SIZE_BYTES_MIN - 4096).is_err());
        assert!(Superblock::new(NODE, 1, 1, DRIVE_SIZE_BYTES).is_err());
        assert!(Superblock::new(NODE, 0, 0, DRIVE_SIZE_BYTES).is_err());
    }

    #[test]
    fn uuid_display() {
        let uuid = NodeUuid([
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ]);
        assert_eq!(uuid.to_string(), "12345678-9abc-def0-0123-456789abcdef");
    }
}
