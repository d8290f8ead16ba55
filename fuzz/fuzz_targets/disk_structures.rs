//! Fuzzes the decoders of what the engine reads back from its drives: the drive superblock, the
//! log superblock, checkpoint roots, batch headers, checkpoint entry and layer-table blocks, and
//! compressed pack slots. Never a panic, whatever the bytes; what decodes re-encodes to the same
//! value where the structure has an encoder.
//!
//! Each input is a change to a valid encoding, not a block of its own: the target builds one valid
//! instance of the structure (with the engine's own encoders), XORs the input onto it, and then
//! stamps the magic and format version and seals each block again (CRC-32C of all but the last four
//! bytes, stored in them; a pack slot's directory checksum likewise), as the engine writes them.
//! An empty input is the valid instance, so even a short run (`scripts/fuzz-smoke.sh`) starts where
//! decoding succeeds and reaches the field checks behind the checksums, which is where a decoder
//! could trust a bad length, count or index.
//!
//! Input: byte 0 picks the structure, bytes 1-3 the geometry (drives, segment size, parity); the
//! rest is XORed onto the structure's blocks.
#![no_main]

use engine::compress::{self, CompressScratch, Compression, PackBuilder};
use engine::erasure::ErasureScheme;
use engine::format::{FORMAT_VERSION, SUPERBLOCK_MAGIC};
use engine::log::format::{
    decode_checkpoint_block, decode_layer_block, encode_layer_block, tag_batch_header, BatchHeader,
    CheckpointBlockWriter, CheckpointEntry, Entry, EntryKind, Geometry, LayerRecordEntry,
    LogSuperblock, Root, BATCH_MAGIC, CHECKPOINT_MAGIC, LAYERS_MAGIC, LOG_FORMAT_VERSION,
    LOG_SUPERBLOCK_MAGIC, ROOT_CONTINUATION_MAGIC, ROOT_MAGIC,
};
use engine::log::index::LAYER_LABEL_BASE;
use engine::{NodeUuid, Superblock};
use libfuzzer_sys::fuzz_target;

const BLOCK: usize = 4096;
const CHECKSUM_AT: usize = BLOCK - 4;
/// At most this many blocks per input (a root spans a few).
const BLOCKS_MAX: usize = 8;

/// Writes `magic` at 0 and the version at `version_at`, then seals the block.
fn stamp(block: &mut [u8], magic: &[u8], version: u32, version_at: usize) {
    block[..magic.len()].copy_from_slice(magic);
    block[version_at..version_at + 4].copy_from_slice(&version.to_le_bytes());
    seal(block);
}

fn seal(block: &mut [u8]) {
    let crc = crc32c::crc32c(&block[..CHECKSUM_AT]);
    block[CHECKSUM_AT..].copy_from_slice(&crc.to_le_bytes());
}

/// The log's batch-header key in every geometry here.
const HEADER_KEY: u128 = 0x6675_7a7a_5f6b_6579_5f66_6f72_5f74_6167;

/// A geometry the engine could have made (drives, segment size and parity from three bytes),
/// or one plain fallback when those make no valid layout.
fn geometry(bytes: [u8; 3]) -> Geometry {
    let drives = 1 + u16::from(bytes[0] % 8);
    let unit_bytes = [64u64 << 10, 1 << 20, 16 << 20][usize::from(bytes[1] % 3)];
    let (data, parity) = [(1, 0), (2, 1), (3, 1), (4, 1), (4, 2)][usize::from(bytes[2] % 5)];
    let scheme = ErasureScheme::new(data, parity).unwrap_or(ErasureScheme::NONE);
    Geometry::coded(drives, 8 << 30, unit_bytes, 1 << 20, scheme)
        .or_else(|_| Geometry::new(drives, 8 << 30, unit_bytes, 1 << 20))
        .expect("a plain geometry of 8 GiB drives is valid")
        .with_header_key(HEADER_KEY)
}

/// The checksum of a pack slot's directory: its first eight bytes and its entries (12 bytes of
/// header, 10 per entry), as docs/format-log-v1.md lays it out.
fn seal_pack(slot: &mut [u8]) {
    let count = usize::from(slot[5]).min(16);
    let end = 12 + 10 * count;
    let crc = crc32c::crc32c_append(crc32c::crc32c(&slot[..8]), &slot[12..end]);
    slot[8..12].copy_from_slice(&crc.to_le_bytes());
}

/// Valid instances, one per structure, for `geometry`.
fn base(kind: u8, geometry: &Geometry) -> Vec<u8> {
    let uuid = NodeUuid([0x5a; 16]);
    match kind {
        0 => Superblock::new(uuid, 1, 4, 8 << 30).expect("a valid drive").encode().to_vec(),
        1 => LogSuperblock {
            node_uuid: uuid,
            drive_index: 0,
            geometry: *geometry,
            rebuilding: false,
        }
        .encode()
        .to_vec(),
        2 => Root {
            checkpoint_id: 7,
            lsn_floor: 100,
            segment_seq_floor: 3,
            lsn_next: 120,
            segment_seq_next: 5,
            entry_count: 300,
            entry_blocks: 2,
            layer_record_count: 3,
            segments: vec![1],
            open_seqs: vec![4, 5],
        }
        .encode(),
        3 => {
            let entry = |block, kind| Entry { volume: 9, block, kind };
            BatchHeader {
                segment: 1,
                segment_seq: 4,
                position: 0,
                lsn: 110,
                entries: vec![
                    entry(10, EntryKind::Data { crc: 0x1234 }),
                    entry(11, EntryKind::Relocated { crc: 0x5678, from: 77 }),
                    entry(20, EntryKind::Trim { count: 8 }),
                    entry(30, EntryKind::Packed { crc: 1, cells_log2: 2, sub: 0, opens: true }),
                    entry(31, EntryKind::Packed { crc: 2, cells_log2: 2, sub: 1, opens: false }),
                    entry(0, EntryKind::Snapshot { snapshot: 12, layer: LAYER_LABEL_BASE + 1 }),
                    entry(0, EntryKind::Dropped { tag: 3, location: 55 }),
                ],
            }
            .encode(geometry)
            .to_vec()
        }
        4 => {
            let mut block = vec![0u8; BLOCK];
            let mut writer = CheckpointBlockWriter::new(&mut block);
            for block in [5, 6, 7, 40] {
                let entry =
                    CheckpointEntry { volume: 9, block, location: 100 + block as u32, tag: 1 };
                assert!(writer.push(&entry));
            }
            writer.finish(7, 0);
            block
        }
        5 => encode_layer_block(
            7,
            2,
            &[
                LayerRecordEntry::Layer { label: 1, parent: None, bound: Some(9), frozen: false },
                LayerRecordEntry::Layer {
                    label: 2,
                    parent: Some(1),
                    bound: Some(12),
                    frozen: true,
                },
                LayerRecordEntry::Binding { id: 13, label: 2 },
                LayerRecordEntry::Alias { from: 3, to: 1 },
                LayerRecordEntry::NextLabel { label: 4 },
            ],
        )
        .to_vec(),
        _ => {
            let mut scratch = CompressScratch::new();
            let mut builder = PackBuilder::new();
            for (algorithm, fill) in [(Compression::Lz4, 0x11u8), (Compression::Zstd, 0x22)] {
                let mut block = [fill; BLOCK];
                block[100..108].copy_from_slice(b"ferrite!");
                let crc = crc32c::crc32c(&block);
                let compressed = compress::compress_block(algorithm, &block, &mut scratch)
                    .expect("a repetitive block compresses");
                builder.try_add(algorithm, compressed, crc).expect("room in an empty slot");
            }
            let mut slot = [0u8; BLOCK];
            builder.finish(&mut slot);
            slot.to_vec()
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let kind = data[0] % 7;
    let geometry = geometry([data[1], data[2], data[3]]);
    let change = &data[4..];
    let mut bytes = base(kind, &geometry);
    let blocks = bytes.len().max(change.len()).div_ceil(BLOCK).min(BLOCKS_MAX);
    bytes.resize(blocks * BLOCK, 0);
    for (byte, flip) in bytes.iter_mut().zip(change) {
        *byte ^= flip;
    }
    let first = 0..BLOCK;

    match kind {
        0 => {
            stamp(&mut bytes[first], &SUPERBLOCK_MAGIC, FORMAT_VERSION, 16);
            if let Ok(superblock) = Superblock::decode(&bytes) {
                assert_eq!(Superblock::decode(&superblock.encode()), Ok(superblock));
            }
        }
        1 => {
            stamp(&mut bytes[first.clone()], &LOG_SUPERBLOCK_MAGIC, LOG_FORMAT_VERSION, 16);
            if let Ok(superblock) = LogSuperblock::decode(&bytes[first]) {
                assert_eq!(LogSuperblock::decode(&superblock.encode()), Ok(superblock));
            }
        }
        2 => {
            stamp(&mut bytes[first], &ROOT_MAGIC, LOG_FORMAT_VERSION, 8);
            for block in bytes[BLOCK..].chunks_exact_mut(BLOCK) {
                stamp(block, &ROOT_CONTINUATION_MAGIC, LOG_FORMAT_VERSION, 8);
            }
            if let Ok(root) = Root::decode(&bytes, &geometry) {
                assert_eq!(Root::decode(&root.encode(), &geometry), Ok(root));
            }
        }
        3 => {
            stamp(&mut bytes[first.clone()], &BATCH_MAGIC, LOG_FORMAT_VERSION, 8);
            tag_batch_header(&mut bytes[first.clone()], &geometry);
            if let Ok(header) = BatchHeader::decode(&bytes[first], &geometry, 1, 0) {
                let again = header.encode(&geometry);
                assert_eq!(BatchHeader::decode(&again, &geometry, 1, 0), Ok(header));
            }
        }
        4 => {
            stamp(&mut bytes[first.clone()], &CHECKPOINT_MAGIC, LOG_FORMAT_VERSION, 8);
            let mut entries = Vec::new();
            let _ = decode_checkpoint_block(&bytes[first], &geometry, 7, 0, &mut entries);
        }
        5 => {
            stamp(&mut bytes[first.clone()], &LAYERS_MAGIC, LOG_FORMAT_VERSION, 8);
            let mut records = Vec::new();
            if decode_layer_block(&bytes[first], 7, 2, &mut records).is_ok() {
                let mut again = Vec::new();
                assert!(decode_layer_block(&encode_layer_block(7, 2, &records), 7, 2, &mut again)
                    .is_ok());
                assert_eq!(again, records);
            }
        }
        _ => {
            seal_pack(&mut bytes[first.clone()]);
            let slot: &compress::Block = bytes[first].try_into().expect("one block");
            if let Ok(entries) = compress::pack_entries(slot) {
                let mut out = [0u8; BLOCK];
                let mut scratch = CompressScratch::new();
                for sub in 0..entries.len() {
                    let _ = compress::unpack(slot, sub as u8, &mut out, &mut scratch);
                }
            }
        }
    }
});
