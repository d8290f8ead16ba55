//! Fuzzes `replication::wire`, the frames nodes exchange over TCP: `decode` must never panic,
//! never claim more bytes than it was given nor ask for more than `MESSAGE_BYTES_MAX`, and a
//! frame that decodes must encode back to exactly its bytes (volume and sender included). A
//! `FrameReader` fed the same bytes in chunks must yield the same envelopes and stop the same
//! way. The same bytes are also read as a write-intent file (`WriteIntent::from_bytes`, the
//! file a node keeps on its own disk; with bit 0 of the mode its checksum is rewritten first):
//! it must never panic, and a file it accepts must write back to exactly its bytes.
//!
//! The first input byte picks the mode: with bit 0 set, the checksums of every frame in the
//! input (its blocks' too) are rewritten first, so the fuzzer reaches the payload parser instead of spending its
//! time on CRCs; the other bits pick the reader's chunk size.
#![no_main]

use libfuzzer_sys::fuzz_target;
use replication::wire::{self, Envelope, FrameReader, WireError, HEADER_BYTES, MESSAGE_BYTES_MAX};
use replication::WriteIntent;

/// Frames decoded from one input at most: each takes at least a header, so this only bounds
/// pathological inputs.
const FRAMES_PER_INPUT_MAX: usize = 4096;

/// Header offsets of docs/replication-wire.md (version 7).
const PAYLOAD_BYTES_AT: usize = 8;
const PAYLOAD_BYTES_END: usize = 12;
/// Offsets of the write-intent file.
const INTENT_CHECKSUM_AT: usize = 20;
const INTENT_HEADER_BYTES: usize = replication::INTENT_FILE_HEADER_BYTES;
const _: () = assert!(INTENT_CHECKSUM_AT + 4 == INTENT_HEADER_BYTES);

fuzz_target!(|input: &[u8]| {
    let Some((&mode, bytes)) = input.split_first() else { return };
    let mut bytes = bytes.to_vec();
    if mode & 1 != 0 {
        seal_all(&mut bytes);
    }
    let (envelopes, end) = decode_all(&bytes);
    let chunk_bytes = 1 + usize::from(mode >> 1) * 61;
    let (read, read_error) = read_all(&bytes, chunk_bytes);
    assert_eq!(read, envelopes);
    assert_eq!(read_error, end.err());
    let mut file = input[1..].to_vec();
    if mode & 1 != 0 {
        seal_intent(&mut file);
    }
    if let Ok(intent) = WriteIntent::from_bytes(&file) {
        assert_eq!(intent.to_bytes(), file, "the write-intent file is not canonical");
    }
});

/// Rewrites the checksum of a write-intent file (docs/replication-wire.md): CRC-32C of bytes
/// 0..20, then of everything after the 24-byte header.
fn seal_intent(file: &mut [u8]) {
    if file.len() >= INTENT_HEADER_BYTES {
        let head = crc32c::crc32c(&file[..INTENT_CHECKSUM_AT]);
        let checksum = crc32c::crc32c_append(head, &file[INTENT_HEADER_BYTES..]);
        file[INTENT_CHECKSUM_AT..INTENT_HEADER_BYTES].copy_from_slice(&checksum.to_le_bytes());
    }
}

/// Decodes frames one after the other: the envelopes, then how it stopped (`Ok` when the input
/// ended on a frame boundary or inside a frame).
fn decode_all(bytes: &[u8]) -> (Vec<Envelope>, Result<(), WireError>) {
    let mut envelopes = Vec::new();
    let mut offset = 0;
    for _ in 0..FRAMES_PER_INPUT_MAX {
        let rest = &bytes[offset..];
        match wire::decode(rest) {
            Ok((envelope, used)) => {
                assert!(used >= HEADER_BYTES && used <= rest.len() && used <= MESSAGE_BYTES_MAX);
                let mut out = Vec::new();
                let encoded =
                    wire::encode(&envelope, &mut out).expect("a decoded envelope encodes");
                assert_eq!(encoded, used);
                assert_eq!(out, &rest[..used], "the encoding is not canonical");
                envelopes.push(envelope);
                offset += used;
            }
            Err(WireError::Incomplete { needed_bytes }) => {
                assert!(needed_bytes > rest.len() && needed_bytes <= MESSAGE_BYTES_MAX);
                return (envelopes, Ok(()));
            }
            Err(error) => return (envelopes, Err(error)),
        }
    }
    (envelopes, Ok(()))
}

/// Feeds the bytes to a `FrameReader` in chunks: its envelopes and its error, if any.
fn read_all(bytes: &[u8], chunk_bytes: usize) -> (Vec<Envelope>, Option<WireError>) {
    let mut reader = FrameReader::new();
    let mut envelopes = Vec::new();
    let mut offset = 0;
    while offset < bytes.len() && envelopes.len() < FRAMES_PER_INPUT_MAX {
        let end = bytes.len().min(offset + chunk_bytes);
        offset += reader.push(&bytes[offset..end]);
        loop {
            match reader.next_message() {
                Ok(Some(envelope)) => envelopes.push(envelope),
                Ok(None) => break,
                Err(error) => return (envelopes, Some(error)),
            }
        }
    }
    (envelopes, None)
}

/// Rewrites the checksums of every frame, walking the declared payload lengths.
fn seal_all(bytes: &mut [u8]) {
    let mut offset = 0;
    while bytes.len() - offset >= HEADER_BYTES {
        let frame = &mut bytes[offset..];
        let mut length = [0; 4];
        length.copy_from_slice(&frame[PAYLOAD_BYTES_AT..PAYLOAD_BYTES_END]);
        let frame_bytes = HEADER_BYTES.saturating_add(u32::from_le_bytes(length) as usize);
        wire::reseal(frame);
        offset += frame_bytes.min(frame.len());
    }
}
