//! `--verify`: self-describing block contents and the map of acknowledged writes that lets every
//! read be checked, during a run and afterwards (a crash test reads everything back with
//! [`VerifyMap::check_all`] after the server was killed and restarted).
//!
//! # Block contents
//!
//! Every 4 KiB block the bench writes is built from its LBA and a generation alone:
//!
//! ```text
//! offset  size  field
//!      0     8  magic "FRTBENCH" (little-endian u64 of those bytes)
//!      8     8  LBA: the block's byte offset / 4096, little-endian
//!     16     8  generation, little-endian: (run seed << 32) | per-block write counter
//!     24  4072  payload: xorshift64 words seeded from (LBA, generation)
//! ```
//!
//! A read is therefore checked without storing any data: the header must name the block's own
//! LBA and an acceptable generation, and the payload must be the one that header implies, which
//! catches a block torn between two writes or corrupted in the middle.
//!
//! Runs without `--verify` stamp the header too, with generation 0 and an unchecked random
//! payload (24 bytes per block per write, so the CPU goes to the target). A later verifying run
//! then tells such a block ("an earlier run's data", acceptable before its own first write) from
//! garbage or a misdirected block.
//!
//! # The map
//!
//! [`VerifyMap`] holds one `u32` per block of the region: the number of writes the bench began
//! on that block in this run (its write counter, 28 bits) and how many of the latest ones have an
//! unknown outcome (4 bits, "span"). A block with counter `c` and span `s` may hold the data of
//! writes `c - s ..= c` of this run, where write 0 means "what was there before this run": zeros,
//! or an earlier run's block (valid header, matching LBA). Beginning a write raises both counter
//! and span; a successful completion sets the span to 0, so an acknowledged write is the only
//! acceptable content until the next write begins. A failed write, or one cut off by a crash or
//! a lost connection, leaves its span, so both the old and the new content are accepted - never
//! anything older than the last acknowledged write. The bench never has two I/Os in flight on
//! the same block ([`InFlightBlocks`]), so each block has at most one write in doubt at a time
//! and no read races a write.

use std::path::Path;

use crate::BenchError;

/// The unit of verification: the Ferrite block.
pub const VERIFY_BLOCK_BYTES: usize = types::BLOCK_SIZE_BYTES as usize;
/// The largest region `--verify` accepts: the map takes 4 bytes of RAM per block (256 MiB here).
pub const VERIFY_REGION_BYTES_MAX: u64 = 256 << 30;
/// How many mismatches are kept with their details (all of them are counted).
pub const MISMATCH_EXAMPLES_MAX: usize = 8;

const BLOCK_MAGIC: u64 = u64::from_le_bytes(*b"FRTBENCH");
/// The generation of blocks written without `--verify`; no verifying run uses seed 0.
const UNVERIFIED_GENERATION: u64 = 0;
const HEADER_BYTES: usize = 24;
const COUNTER_BITS: u32 = 28;
const COUNTER_MAX: u32 = (1 << COUNTER_BITS) - 1;
/// A span of this value means "any write of this run, or the earlier content": after this many
/// writes in a row with unknown outcomes the map stops tracking them one by one.
const SPAN_ANY: u32 = 15;

const MAP_FILE_MAGIC: [u8; 8] = *b"FRTVMAP\0";
const MAP_FILE_VERSION: u32 = 1;
const MAP_FILE_HEADER_BYTES: usize = 24;
const MAP_FILE_CHECKSUM_BYTES: usize = 4;

const _: () = assert!((VERIFY_BLOCK_BYTES - HEADER_BYTES) % 8 == 0);
const _: () = assert!(SPAN_ANY == u32::MAX >> COUNTER_BITS);
const _: () = assert!(VERIFY_REGION_BYTES_MAX % VERIFY_BLOCK_BYTES as u64 == 0);

/// Why a saved verify map could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyMapError {
    #[error("the file is {length_bytes} bytes, too short or not a whole map")]
    Length { length_bytes: u64 },
    #[error("the file is not a Ferrite verify map (wrong magic)")]
    Magic,
    #[error("the file has map format version {0}; this build reads version {MAP_FILE_VERSION}")]
    Version(u32),
    #[error("the checksum does not match: the file is damaged")]
    Checksum,
    #[error("the map covers {blocks} blocks, over the limit of {VERIFY_REGION_BYTES_MAX} bytes")]
    TooLarge { blocks: u64 },
    #[error("the map's run seed is zero")]
    SeedZero,
    #[error("block {lba} has an impossible state {state:#010x}")]
    State { lba: u64, state: u32 },
}

/// The generations a block may hold, from the map: writes `counter_low ..= counter_high` of the
/// run with `seed`, where write 0 stands for whatever was there before the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedWrites {
    pub seed: u32,
    pub counter_low: u32,
    pub counter_high: u32,
}

impl ExpectedWrites {
    fn allows_earlier_content(self) -> bool {
        self.counter_low == 0
    }

    fn allows_counter(self, counter: u32) -> bool {
        counter >= self.counter_low.max(1) && counter <= self.counter_high
    }
}

impl std::fmt::Display for ExpectedWrites {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (low, high) = (self.counter_low, self.counter_high);
        if high == 0 {
            write!(f, "never written in this run (zeros or an earlier run's data)")
        } else if low == high {
            write!(
                f,
                "write #{high} of this run (generation {:#018x})",
                generation(self.seed, high)
            )
        } else if low == 0 {
            write!(f, "an earlier run's data or writes #1..#{high} of this run (some cut off)")
        } else {
            write!(f, "one of writes #{low}..#{high} of this run (the later ones cut off)")
        }
    }
}

/// What was wrong with one block read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MismatchKind {
    /// The block reads as zeros although a write to it was acknowledged.
    Zeros,
    /// No block header: neither zeros nor anything the bench wrote.
    NoHeader { first_bytes: [u8; HEADER_BYTES] },
    /// A valid block, but of another LBA: a misdirected read or write.
    WrongLba { found_lba: u64, generation: u64 },
    /// The header is intact but the payload is not the one it implies: a torn or corrupted block.
    TornPayload { generation: u64, first_bad_byte: usize },
    /// A valid block of this LBA, but not an acceptable generation: stale (or future) data.
    WrongGeneration { generation: u64 },
}

/// One block that did not read back as expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub lba: u64,
    pub expected: ExpectedWrites,
    pub kind: MismatchKind,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let byte = self.lba * VERIFY_BLOCK_BYTES as u64;
        write!(f, "block {} (byte offset {byte}): expected {}; ", self.lba, self.expected)?;
        let describe = |generation: u64| {
            let seed = (generation >> 32) as u32;
            if generation == UNVERIFIED_GENERATION {
                "generation 0 (a run without --verify)".to_owned()
            } else if seed == self.expected.seed {
                format!("generation {generation:#018x} (write #{} of this run)", generation as u32)
            } else {
                format!("generation {generation:#018x} (another run's)")
            }
        };
        match &self.kind {
            MismatchKind::Zeros => write!(f, "found zeros: an acknowledged write is lost"),
            MismatchKind::NoHeader { first_bytes } => {
                write!(f, "found no block header, garbage starting with")?;
                first_bytes.iter().try_for_each(|byte| write!(f, " {byte:02x}"))
            }
            MismatchKind::WrongLba { found_lba, generation } => write!(
                f,
                "found the block of LBA {found_lba}, {}: a misdirected read or write",
                describe(*generation)
            ),
            MismatchKind::TornPayload { generation, first_bad_byte } => write!(
                f,
                "found a header of {} but the payload differs from byte {first_bad_byte} on: \
                 a torn or corrupted block",
                describe(*generation)
            ),
            MismatchKind::WrongGeneration { generation } => {
                write!(f, "found {}: stale data", describe(*generation))
            }
        }
    }
}

/// The generation tag written into a block: the run's seed and the block's write counter.
fn generation(seed: u32, counter: u32) -> u64 {
    (u64::from(seed) << 32) | u64::from(counter)
}

/// One step of SplitMix64: turns any 64-bit value into a well-mixed one.
fn mix64(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The payload generator's first state for a block; never zero, as xorshift requires.
fn payload_seed(lba: u64, generation: u64) -> u64 {
    mix64(lba ^ mix64(generation)) | 1
}

/// xorshift64: three shifts per 8 bytes, enough to make a torn or shifted payload visible.
fn xorshift64(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

fn le_u64(bytes: &[u8], offset: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[offset..offset + 8]);
    u64::from_le_bytes(word)
}

/// Writes the full content of one block: header and payload.
pub(crate) fn fill_block(block: &mut [u8], lba: u64, generation: u64) {
    assert_eq!(block.len(), VERIFY_BLOCK_BYTES);
    block[0..8].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
    block[8..16].copy_from_slice(&lba.to_le_bytes());
    block[16..24].copy_from_slice(&generation.to_le_bytes());
    let mut state = payload_seed(lba, generation);
    for word in block[HEADER_BYTES..].chunks_exact_mut(8) {
        word.copy_from_slice(&xorshift64(&mut state).to_le_bytes());
    }
}

/// Writes only the header, with generation 0, into each block of a buffer: what runs without
/// `--verify` send, keeping the rest of the buffer as it is.
pub(crate) fn stamp_unverified(buffer: &mut [u8], first_lba: u64) {
    for (index, block) in buffer.chunks_exact_mut(VERIFY_BLOCK_BYTES).enumerate() {
        block[0..8].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
        block[8..16].copy_from_slice(&(first_lba + index as u64).to_le_bytes());
        block[16..24].copy_from_slice(&0u64.to_le_bytes());
    }
}

/// The offset of the first payload byte that differs from what the header implies.
fn first_payload_difference(block: &[u8], lba: u64, generation: u64) -> Option<usize> {
    let mut state = payload_seed(lba, generation);
    for (index, word) in block[HEADER_BYTES..].chunks_exact(8).enumerate() {
        let expected = xorshift64(&mut state).to_le_bytes();
        if word != expected {
            let within = word.iter().zip(expected).position(|(a, b)| *a != b).unwrap_or(0);
            return Some(HEADER_BYTES + index * 8 + within);
        }
    }
    None
}

/// Checks one block read back from `lba` against the generations the map allows.
pub(crate) fn check_block(
    block: &[u8],
    lba: u64,
    expected: ExpectedWrites,
) -> Result<(), MismatchKind> {
    assert_eq!(block.len(), VERIFY_BLOCK_BYTES);
    if le_u64(block, 0) != BLOCK_MAGIC {
        if block.iter().all(|byte| *byte == 0) {
            return if expected.allows_earlier_content() {
                Ok(())
            } else {
                Err(MismatchKind::Zeros)
            };
        }
        let mut first_bytes = [0u8; HEADER_BYTES];
        first_bytes.copy_from_slice(&block[..HEADER_BYTES]);
        return Err(MismatchKind::NoHeader { first_bytes });
    }
    let found_lba = le_u64(block, 8);
    let generation = le_u64(block, 16);
    if found_lba != lba {
        return Err(MismatchKind::WrongLba { found_lba, generation });
    }
    if generation == UNVERIFIED_GENERATION {
        // Written by a run without --verify: the payload is not checkable.
        return if expected.allows_earlier_content() {
            Ok(())
        } else {
            Err(MismatchKind::WrongGeneration { generation })
        };
    }
    if let Some(first_bad_byte) = first_payload_difference(block, lba, generation) {
        return Err(MismatchKind::TornPayload { generation, first_bad_byte });
    }
    let acceptable = if (generation >> 32) as u32 == expected.seed {
        expected.allows_counter(generation as u32)
    } else {
        expected.allows_earlier_content()
    };
    if acceptable {
        Ok(())
    } else {
        Err(MismatchKind::WrongGeneration { generation })
    }
}

/// Per 4 KiB block of the bench region: which writes of this run may be its content. See the
/// module documentation for the encoding and its guarantees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyMap {
    seed: u32,
    states: Vec<u32>,
}

impl VerifyMap {
    /// A map of a region of `region_size_bytes` (a multiple of 4096, at most
    /// [`VERIFY_REGION_BYTES_MAX`]) with no block written yet, for a run tagged `seed` (not 0).
    /// Two runs must not share a seed: a fresh random one is what [`VerifyMap::with_random_seed`]
    /// picks.
    pub fn new(region_size_bytes: u64, seed: u32) -> VerifyMap {
        assert!(seed != 0, "the run seed must not be zero");
        assert!(region_size_bytes % VERIFY_BLOCK_BYTES as u64 == 0, "region not whole blocks");
        assert!(region_size_bytes <= VERIFY_REGION_BYTES_MAX, "region over the verify limit");
        let blocks = usize::try_from(region_size_bytes / VERIFY_BLOCK_BYTES as u64)
            .expect("the verify limit fits in memory");
        VerifyMap { seed, states: vec![0; blocks] }
    }

    pub fn with_random_seed(region_size_bytes: u64) -> VerifyMap {
        Self::new(region_size_bytes, rand::random::<u32>().max(1))
    }

    pub fn seed(&self) -> u32 {
        self.seed
    }

    pub fn block_count(&self) -> u64 {
        self.states.len() as u64
    }

    pub fn region_size_bytes(&self) -> u64 {
        self.block_count() * VERIFY_BLOCK_BYTES as u64
    }

    /// Blocks that at least one write of this run was begun on: what `check_all` reads back.
    pub fn written_block_count(&self) -> u64 {
        self.states.iter().filter(|state| **state != 0).count() as u64
    }

    /// The generation of the block's last acknowledged write, if that write is the only
    /// acceptable content (no later write in doubt).
    pub fn acknowledged_generation(&self, lba: u64) -> Option<u64> {
        let (counter, span) = split(self.state(lba));
        (counter != 0 && span == 0).then(|| generation(self.seed, counter))
    }

    /// What a read of block `lba` may return.
    pub fn expected(&self, lba: u64) -> ExpectedWrites {
        let (counter, span) = split(self.state(lba));
        let counter_low = if span == SPAN_ANY { 0 } else { counter - span };
        ExpectedWrites { seed: self.seed, counter_low, counter_high: counter }
    }

    fn state(&self, lba: u64) -> u32 {
        self.states[usize::try_from(lba).expect("LBA within the map")]
    }

    fn state_mut(&mut self, lba: u64) -> &mut u32 {
        &mut self.states[usize::try_from(lba).expect("LBA within the map")]
    }

    /// Records that a write to `lba` starts; returns the generation to write into the block.
    pub(crate) fn begin_write(&mut self, lba: u64) -> Result<u64, BenchError> {
        let (counter, span) = split(self.state(lba));
        if counter == COUNTER_MAX {
            return Err(BenchError::VerifyCounterExhausted { lba });
        }
        let span = if span + 1 >= SPAN_ANY { SPAN_ANY } else { span + 1 };
        *self.state_mut(lba) = join(counter + 1, span);
        Ok(generation(self.seed, counter + 1))
    }

    /// Records how the write begun last on `lba` ended. A write whose outcome never arrives
    /// (lost connection, crash) simply never gets here and stays in doubt.
    pub(crate) fn finish_write(&mut self, lba: u64, succeeded: bool) {
        let (counter, span) = split(self.state(lba));
        assert!(counter != 0 && span != 0, "block {lba}: no write in progress");
        if succeeded {
            *self.state_mut(lba) = join(counter, 0);
        }
    }

    /// The map as bytes: a 24-byte header (magic, version, seed, block count), one little-endian
    /// `u32` state per block, and a CRC-32C of everything before it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(
            MAP_FILE_HEADER_BYTES + self.states.len() * 4 + MAP_FILE_CHECKSUM_BYTES,
        );
        bytes.extend_from_slice(&MAP_FILE_MAGIC);
        bytes.extend_from_slice(&MAP_FILE_VERSION.to_le_bytes());
        bytes.extend_from_slice(&self.seed.to_le_bytes());
        bytes.extend_from_slice(&self.block_count().to_le_bytes());
        for state in &self.states {
            bytes.extend_from_slice(&state.to_le_bytes());
        }
        let checksum = crc32c::crc32c(&bytes);
        bytes.extend_from_slice(&checksum.to_le_bytes());
        bytes
    }

    /// Parses what [`VerifyMap::to_bytes`] produced, checking every field.
    pub fn from_bytes(bytes: &[u8]) -> Result<VerifyMap, VerifyMapError> {
        let length_error = VerifyMapError::Length { length_bytes: bytes.len() as u64 };
        if bytes.len() < MAP_FILE_HEADER_BYTES + MAP_FILE_CHECKSUM_BYTES {
            return Err(length_error);
        }
        if bytes[0..8] != MAP_FILE_MAGIC {
            return Err(VerifyMapError::Magic);
        }
        let (body, checksum) = bytes.split_at(bytes.len() - MAP_FILE_CHECKSUM_BYTES);
        let le_u32 = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let version = le_u32(8);
        if version != MAP_FILE_VERSION {
            return Err(VerifyMapError::Version(version));
        }
        let stored = u32::from_le_bytes([checksum[0], checksum[1], checksum[2], checksum[3]]);
        if crc32c::crc32c(body) != stored {
            return Err(VerifyMapError::Checksum);
        }
        let seed = le_u32(12);
        let blocks = le_u64(bytes, 16);
        if blocks > VERIFY_REGION_BYTES_MAX / VERIFY_BLOCK_BYTES as u64 {
            return Err(VerifyMapError::TooLarge { blocks });
        }
        let state_bytes = &body[MAP_FILE_HEADER_BYTES..];
        if state_bytes.len() as u64 != blocks * 4 {
            return Err(length_error);
        }
        if seed == 0 {
            return Err(VerifyMapError::SeedZero);
        }
        let mut states = Vec::with_capacity(state_bytes.len() / 4);
        for (lba, word) in state_bytes.chunks_exact(4).enumerate() {
            let state = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            let (counter, span) = split(state);
            if span != SPAN_ANY && span > counter {
                return Err(VerifyMapError::State { lba: lba as u64, state });
            }
            states.push(state);
        }
        Ok(VerifyMap { seed, states })
    }

    /// Writes the map to `path` atomically (a temporary file beside it, synced, then renamed).
    pub fn save(&self, path: &Path) -> Result<(), BenchError> {
        use std::io::Write;
        let io_error = |source| BenchError::VerifyMapIo { path: path.to_owned(), source };
        let mut temporary = path.as_os_str().to_owned();
        temporary.push(".tmp");
        let temporary = std::path::PathBuf::from(temporary);
        let mut file = std::fs::File::create(&temporary).map_err(io_error)?;
        file.write_all(&self.to_bytes()).map_err(io_error)?;
        file.sync_all().map_err(io_error)?;
        drop(file);
        std::fs::rename(&temporary, path).map_err(io_error)
    }

    /// Reads a map saved by [`VerifyMap::save`].
    pub fn load(path: &Path) -> Result<VerifyMap, BenchError> {
        let io_error = |source| BenchError::VerifyMapIo { path: path.to_owned(), source };
        let length_bytes = std::fs::metadata(path).map_err(io_error)?.len();
        let length_max = MAP_FILE_HEADER_BYTES as u64
            + VERIFY_REGION_BYTES_MAX / VERIFY_BLOCK_BYTES as u64 * 4
            + MAP_FILE_CHECKSUM_BYTES as u64;
        if length_bytes > length_max {
            let source = VerifyMapError::Length { length_bytes };
            return Err(BenchError::VerifyMapInvalid { path: path.to_owned(), source });
        }
        let bytes = std::fs::read(path).map_err(io_error)?;
        VerifyMap::from_bytes(&bytes)
            .map_err(|source| BenchError::VerifyMapInvalid { path: path.to_owned(), source })
    }
}

fn split(state: u32) -> (u32, u32) {
    (state & COUNTER_MAX, state >> COUNTER_BITS)
}

fn join(counter: u32, span: u32) -> u32 {
    debug_assert!(counter <= COUNTER_MAX && span <= SPAN_ANY);
    counter | (span << COUNTER_BITS)
}

/// One bit per block: set while an I/O covering the block is in flight. Lets the bench pick
/// only ranges no other I/O touches, so no read races a write and no two writes race.
#[derive(Debug)]
pub(crate) struct InFlightBlocks {
    words: Vec<u64>,
}

impl InFlightBlocks {
    pub(crate) fn new(block_count: u64) -> InFlightBlocks {
        let words = usize::try_from(block_count.div_ceil(64)).expect("bounded by the verify limit");
        InFlightBlocks { words: vec![0; words] }
    }

    /// The (word index, mask) pairs covering blocks `first .. first + count`.
    fn segments(first: u64, count: u32) -> impl Iterator<Item = (usize, u64)> {
        let end = first + u64::from(count);
        let mut block = first;
        std::iter::from_fn(move || {
            if block >= end {
                return None;
            }
            let bit = block % 64;
            let bits = (64 - bit).min(end - block);
            let mask = if bits == 64 { u64::MAX } else { ((1u64 << bits) - 1) << bit };
            let word = (block / 64) as usize;
            block += bits;
            Some((word, mask))
        })
    }

    /// Marks the blocks busy if none of them is; returns whether it did.
    pub(crate) fn try_lock(&mut self, first: u64, count: u32) -> bool {
        if Self::segments(first, count).any(|(word, mask)| self.words[word] & mask != 0) {
            return false;
        }
        Self::segments(first, count).for_each(|(word, mask)| self.words[word] |= mask);
        true
    }

    pub(crate) fn unlock(&mut self, first: u64, count: u32) {
        for (word, mask) in Self::segments(first, count) {
            assert!(self.words[word] & mask == mask, "unlocking blocks {first}+{count} not locked");
            self.words[word] &= !mask;
        }
    }
}

/// The map a verifier works on: writable during a run, read-only for a read-back check.
#[derive(Debug)]
pub(crate) enum MapAccess<'m> {
    Writable(&'m mut VerifyMap),
    ReadOnly(&'m VerifyMap),
}

/// The verifier of a run: the map, the in-flight blocks and the mismatches found.
#[derive(Debug)]
pub(crate) struct Verifier<'m> {
    map: MapAccess<'m>,
    in_flight: InFlightBlocks,
    mismatches: u64,
    examples: Vec<Mismatch>,
}

impl<'m> Verifier<'m> {
    pub(crate) fn new(map: MapAccess<'m>) -> Verifier<'m> {
        let block_count = match &map {
            MapAccess::Writable(map) => map.block_count(),
            MapAccess::ReadOnly(map) => map.block_count(),
        };
        Verifier {
            map,
            in_flight: InFlightBlocks::new(block_count),
            mismatches: 0,
            examples: Vec::new(),
        }
    }

    pub(crate) fn map(&self) -> &VerifyMap {
        match &self.map {
            MapAccess::Writable(map) => map,
            MapAccess::ReadOnly(map) => map,
        }
    }

    fn map_mut(&mut self) -> &mut VerifyMap {
        match &mut self.map {
            MapAccess::Writable(map) => map,
            MapAccess::ReadOnly(_) => panic!("a read-only verify pass issued a write"),
        }
    }

    pub(crate) fn try_lock(&mut self, first_lba: u64, blocks: u32) -> bool {
        self.in_flight.try_lock(first_lba, blocks)
    }

    pub(crate) fn unlock(&mut self, first_lba: u64, blocks: u32) {
        self.in_flight.unlock(first_lba, blocks);
    }

    /// Fills `buffer` with the blocks of a write starting at `first_lba` and records the write
    /// as begun on each.
    pub(crate) fn prepare_write(
        &mut self,
        buffer: &mut [u8],
        first_lba: u64,
    ) -> Result<(), BenchError> {
        for (index, block) in buffer.chunks_exact_mut(VERIFY_BLOCK_BYTES).enumerate() {
            let lba = first_lba + index as u64;
            let generation = self.map_mut().begin_write(lba)?;
            fill_block(block, lba, generation);
        }
        Ok(())
    }

    pub(crate) fn finish_write(&mut self, first_lba: u64, blocks: u32, succeeded: bool) {
        for lba in first_lba..first_lba + u64::from(blocks) {
            self.map_mut().finish_write(lba, succeeded);
        }
    }

    /// Checks every block of a completed read; returns how many were wrong.
    pub(crate) fn check_read(&mut self, buffer: &[u8], first_lba: u64) -> u64 {
        let mut wrong = 0;
        for (index, block) in buffer.chunks_exact(VERIFY_BLOCK_BYTES).enumerate() {
            let lba = first_lba + index as u64;
            let expected = self.map().expected(lba);
            if let Err(kind) = check_block(block, lba, expected) {
                wrong += 1;
                if self.examples.len() < MISMATCH_EXAMPLES_MAX {
                    self.examples.push(Mismatch { lba, expected, kind });
                }
            }
        }
        self.mismatches += wrong;
        wrong
    }

    /// The mismatches found since the last call, and their first few details.
    pub(crate) fn take_mismatches(&mut self) -> (u64, Vec<Mismatch>) {
        (std::mem::take(&mut self.mismatches), std::mem::take(&mut self.examples))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: u32 = 0x5eed_0001;

    fn block(lba: u64, generation: u64) -> Vec<u8> {
        let mut block = vec![0u8; VERIFY_BLOCK_BYTES];
        fill_block(&mut block, lba, generation);
        block
    }

    fn expect(counter_low: u32, counter_high: u32) -> ExpectedWrites {
        ExpectedWrites { seed: SEED, counter_low, counter_high }
    }

    #[test]
    fn written_blocks_check_against_their_generation() {
        let good = block(7, generation(SEED, 3));
        assert_eq!(check_block(&good, 7, expect(3, 3)), Ok(()));
        assert_eq!(check_block(&good, 7, expect(2, 4)), Ok(()));
        assert_eq!(
            check_block(&good, 7, expect(4, 4)),
            Err(MismatchKind::WrongGeneration { generation: generation(SEED, 3) })
        );
        assert_eq!(
            check_block(&good, 8, expect(3, 3)),
            Err(MismatchKind::WrongLba { found_lba: 7, generation: generation(SEED, 3) })
        );
        // Never written in this run: this run's data cannot be there.
        assert!(check_block(&good, 7, expect(0, 0)).is_err());
    }

    #[test]
    fn zeros_and_earlier_runs_are_fine_only_before_the_first_acknowledged_write() {
        let zeros = vec![0u8; VERIFY_BLOCK_BYTES];
        let earlier_run = block(7, generation(SEED + 1, 40));
        for content in [&zeros, &earlier_run] {
            assert_eq!(check_block(content, 7, expect(0, 0)), Ok(()));
            assert_eq!(check_block(content, 7, expect(0, 2)), Ok(()), "first writes in doubt");
            assert!(check_block(content, 7, expect(1, 1)).is_err());
        }
        assert_eq!(check_block(&zeros, 7, expect(1, 1)), Err(MismatchKind::Zeros));
        // An earlier run's block of another LBA is still wrong.
        let misplaced = block(9, generation(SEED + 1, 40));
        assert!(matches!(
            check_block(&misplaced, 7, expect(0, 0)),
            Err(MismatchKind::WrongLba { .. })
        ));
    }

    #[test]
    fn blocks_of_unverified_runs_count_as_earlier_content() {
        let mut unverified = block(7, generation(SEED, 9));
        stamp_unverified(&mut unverified, 7);
        assert_eq!(check_block(&unverified, 7, expect(0, 0)), Ok(()));
        assert_eq!(
            check_block(&unverified, 7, expect(1, 1)),
            Err(MismatchKind::WrongGeneration { generation: 0 })
        );
        assert!(matches!(
            check_block(&unverified, 6, expect(0, 0)),
            Err(MismatchKind::WrongLba { .. })
        ));
    }

    #[test]
    fn torn_and_garbage_blocks_are_caught() {
        let old = block(7, generation(SEED, 1));
        let mut torn = block(7, generation(SEED, 2));
        torn[2048..].copy_from_slice(&old[2048..]);
        assert_eq!(
            check_block(&torn, 7, expect(1, 2)),
            Err(MismatchKind::TornPayload {
                generation: generation(SEED, 2),
                first_bad_byte: 2048
            })
        );
        let mut flipped = block(7, generation(SEED, 2));
        flipped[4095] ^= 1;
        assert!(matches!(
            check_block(&flipped, 7, expect(2, 2)),
            Err(MismatchKind::TornPayload { first_bad_byte: 4095, .. })
        ));
        let mut garbage = vec![0u8; VERIFY_BLOCK_BYTES];
        garbage[100] = 1;
        assert!(matches!(
            check_block(&garbage, 7, expect(0, 0)),
            Err(MismatchKind::NoHeader { .. })
        ));
    }

    #[test]
    fn map_tracks_acknowledged_and_doubtful_writes() {
        let mut map = VerifyMap::new(16 * 4096, SEED);
        assert_eq!(map.expected(3), expect(0, 0));
        let first = map.begin_write(3).unwrap();
        assert_eq!(first, generation(SEED, 1));
        assert_eq!(map.expected(3), expect(0, 1), "in flight: old or new");
        map.finish_write(3, true);
        assert_eq!(map.expected(3), expect(1, 1));
        assert_eq!(map.acknowledged_generation(3), Some(first));

        // A failed write and one cut off by a crash: old or either new one, never older.
        map.begin_write(3).unwrap();
        map.finish_write(3, false);
        map.begin_write(3).unwrap();
        assert_eq!(map.expected(3), expect(1, 3));
        assert_eq!(map.acknowledged_generation(3), None);
        map.finish_write(3, true);
        assert_eq!(map.expected(3), expect(3, 3));
        assert_eq!(map.written_block_count(), 1);

        // After many writes in doubt the map accepts anything of this run or before it.
        for _ in 0..20 {
            map.begin_write(5).unwrap();
            map.finish_write(5, false);
        }
        assert_eq!(map.expected(5), expect(0, 20));
    }

    #[test]
    fn map_bytes_round_trip_and_damage_is_refused() {
        let mut map = VerifyMap::new(64 * 4096, SEED);
        for lba in [0, 5, 63] {
            map.begin_write(lba).unwrap();
            map.finish_write(lba, lba != 5);
        }
        let bytes = map.to_bytes();
        assert_eq!(VerifyMap::from_bytes(&bytes), Ok(map.clone()));

        let mut damaged = bytes.clone();
        damaged[30] ^= 0x40;
        assert_eq!(VerifyMap::from_bytes(&damaged), Err(VerifyMapError::Checksum));
        assert!(VerifyMap::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        assert!(matches!(VerifyMap::from_bytes(&bytes[..10]), Err(VerifyMapError::Length { .. })));
        let mut other = bytes.clone();
        other[0] = b'X';
        assert_eq!(VerifyMap::from_bytes(&other), Err(VerifyMapError::Magic));

        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("run.vmap");
        map.save(&path).unwrap();
        assert_eq!(VerifyMap::load(&path).unwrap(), map);
        std::fs::write(&path, &damaged).unwrap();
        let error = VerifyMap::load(&path).unwrap_err().to_string();
        assert!(error.contains("run.vmap"), "{error}");
    }

    #[test]
    fn in_flight_blocks_refuse_overlaps() {
        let mut in_flight = InFlightBlocks::new(200);
        assert!(in_flight.try_lock(60, 8), "across a word boundary");
        assert!(!in_flight.try_lock(67, 1));
        assert!(!in_flight.try_lock(56, 5));
        assert!(in_flight.try_lock(68, 64));
        assert!(in_flight.try_lock(0, 60));
        in_flight.unlock(60, 8);
        assert!(in_flight.try_lock(64, 4));
        assert!(!in_flight.try_lock(130, 3), "68..132 still held");
        assert!(in_flight.try_lock(132, 68));
    }

    #[test]
    fn mismatch_messages_name_block_expectation_and_finding() {
        let mismatch = Mismatch {
            lba: 2,
            expected: expect(5, 5),
            kind: MismatchKind::WrongGeneration { generation: generation(SEED, 4) },
        };
        let text = mismatch.to_string();
        assert!(text.contains("block 2 (byte offset 8192)"), "{text}");
        assert!(text.contains("expected write #5 of this run"), "{text}");
        assert!(text.contains("write #4 of this run): stale data"), "{text}");
    }
}
