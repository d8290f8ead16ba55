//! Tests of the log engine over simulated drives: the model test against an oracle with
//! concurrent writers on several handles, restarts and GC; crashes at every Nth drive operation
//! with torn sectors; injected write and sync faults; filling the node and overwriting under GC;
//! and the measured figures (write amplification, recovery time per GiB).
//!
//! Longer soaks: FERRITE_LOG_SOAK=N multiplies rounds and operations.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Instant;

use types::AlignedBuf;

use super::format::{BatchHeader, Entry, EntryKind, Geometry, BLOCK_BYTES, LOG_HEADER_BYTES};
use super::{GcOutcome, LogConfig, LogEngine, LogError, LogHandle, RecoveryReport};
use crate::compress::Compression;
use crate::drive::Drive;
use crate::erasure::ErasureScheme;
use crate::format::{NodeUuid, HEADER_REGION_BYTES};
use crate::latches::DriveLatches;
use crate::local_sync::LocalNotify;
use crate::store::{StoreError, VolumeStore};
use crate::testing::{
    block_matches, block_on, describe_block, fill_block, join_all, run_writer, verify_volume,
    CheckReport, LocalBoxFuture, Oracle, Rng, SimDrive, WriterContext,
};
use crate::volumes::{VolumeId, VolumeMap, Volumes};

const UUID: NodeUuid = NodeUuid([0x42; 16]);
const UNIT_BYTES: u64 = 64 << 10;
const DRIVES: u16 = 3;
pub(super) const BLOCK: u64 = BLOCK_BYTES as u64;

pub(super) fn soak() -> u64 {
    std::env::var("FERRITE_LOG_SOAK").ok().and_then(|value| value.parse().ok()).unwrap_or(1)
}

pub(super) fn config() -> LogConfig {
    LogConfig {
        node_uuid: UUID,
        unit_bytes: UNIT_BYTES,
        area_offset_bytes: HEADER_REGION_BYTES,
        handles_max: 4,
        checkpoint_interval_segments: 4,
        erasure: crate::erasure::ErasureScheme::NONE,
        area_zeroed: false,
        header_key: 0x7465_7374_5f6b_6579_6f66_5f74_6865_6c6f,
    }
}

fn sim_drives(segments: u64, seed: u64, yields_max: u64) -> Vec<SimDrive> {
    sim_drives_n(DRIVES, segments, seed, yields_max)
}

fn sim_drives_n(count: u16, segments: u64, seed: u64, yields_max: u64) -> Vec<SimDrive> {
    let size_bytes = HEADER_REGION_BYTES + LOG_HEADER_BYTES + segments * UNIT_BYTES;
    (0..count)
        .map(|index| {
            SimDrive::new(index, size_bytes, seed.rotate_left(8) ^ u64::from(index), yields_max)
        })
        .collect()
}

/// A node: its drives, the engine and one handle per simulated thread.
pub(super) struct Node {
    pub drives: Vec<SimDrive>,
    pub engine: Arc<LogEngine>,
    pub handles: Vec<LogHandle<SimDrive>>,
    pub report: RecoveryReport,
    /// The drives every handle reopens a replaced drive from.
    current: Rc<RefCell<Vec<SimDrive>>>,
}

impl Node {
    pub fn format(segments: u64, seed: u64, yields_max: u64, threads: usize) -> Self {
        let drives = sim_drives(segments, seed, yields_max);
        block_on(LogEngine::format(&drives, &config())).unwrap();
        Self::open(drives, threads).unwrap()
    }

    /// A node of `drive_count` drives formatted with erasure coding `scheme`.
    pub fn format_coded(
        segments: u64,
        seed: u64,
        yields_max: u64,
        threads: usize,
        drive_count: u16,
        scheme: ErasureScheme,
    ) -> Self {
        let drives = sim_drives_n(drive_count, segments, seed, yields_max);
        let config = LogConfig { erasure: scheme, ..config() };
        block_on(LogEngine::format(&drives, &config)).unwrap();
        let node = Self::open(drives, threads).unwrap();
        assert_eq!(node.engine.geometry().scheme(), scheme);
        node
    }

    pub fn open(drives: Vec<SimDrive>, threads: usize) -> Result<Self, LogError> {
        let latches = Arc::new(DriveLatches::new(drives.len() as u16));
        let (engine, first, report) = block_on(LogEngine::open(drives.clone(), config(), latches))?;
        let mut handles = vec![first];
        for _ in 1..threads {
            handles.push(engine.handle(drives.clone()));
        }
        let current = Rc::new(RefCell::new(drives.clone()));
        for handle in &handles {
            let current = Rc::clone(&current);
            handle.set_reopen(Box::new(move |index| {
                Ok(current.borrow()[usize::from(index)].clone())
            }));
        }
        Ok(Self { drives, engine, handles, report, current })
    }

    /// Puts a new, empty drive in drive `index`'s place and starts its rebuild.
    pub fn replace_drive(&mut self, index: u16, seed: u64) -> Result<(), LogError> {
        let size_bytes = self.drives[0].size_bytes();
        let new = SimDrive::new(index, size_bytes, seed, 0);
        block_on(self.handles[0].begin_replace(index, new.clone()))?;
        // Before any other handle's next I/O, which reopens the drive from here.
        self.current.borrow_mut()[usize::from(index)] = new.clone();
        self.drives[usize::from(index)] = new;
        Ok(())
    }

    /// Runs the rebuild to its end in steps of `budget_bytes`; returns the steps taken.
    pub fn finish_rebuild(&self, budget_bytes: u64) -> u32 {
        let mut steps = 0;
        loop {
            steps += 1;
            assert!(steps < 1_000_000, "the rebuild does not end");
            match block_on(self.handles[0].rebuild_step(budget_bytes)).unwrap() {
                Some(progress) if progress.finished => return steps,
                Some(_) => {}
                None => return steps,
            }
        }
    }

    /// A clean restart: every completed write is durable already.
    pub fn restart(self) -> Self {
        let (drives, threads) = (self.drives.clone(), self.handles.len());
        drop(self);
        Self::open(drives, threads).unwrap()
    }

    /// Where block `block` of `map`'s volume lives now: its drive and byte offset there.
    pub fn place_of(&self, map: &VolumeMap, block: u64) -> (u16, u64) {
        let index = self.engine.index.get(map.volume().0).expect("the volume has an index");
        let (location, _) = super::index::unpack(index.get(block)).expect("the block is mapped");
        let (segment, position) = self.engine.geometry.split(location);
        self.engine.geometry.place(segment, position)
    }

    /// Power loss: unsynced blocks are kept, lost or torn; then recovery.
    pub fn crash(self) -> Self {
        let (drives, threads) = (self.drives.clone(), self.handles.len());
        drop(self);
        for drive in &drives {
            drive.crash();
        }
        Self::open(drives, threads).unwrap()
    }
}

pub(super) fn volume_maps(sizes_blocks: &[u64]) -> (Volumes, Vec<Arc<VolumeMap>>) {
    let volumes = Volumes::new();
    let maps = sizes_blocks
        .iter()
        .enumerate()
        .map(|(index, blocks)| {
            let id = VolumeId(index as u64 + 1);
            let layout = volumes.reserve_create(id, blocks * BLOCK).unwrap();
            volumes.publish(layout);
            volumes.mapping(id).unwrap()
        })
        .collect();
    (volumes, maps)
}

pub(super) fn block_buf(volume: VolumeId, first: u64, count: u64, tag: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::new((count * BLOCK) as usize);
    for (number, block) in (first..).zip(buf.chunks_mut(BLOCK_BYTES)) {
        fill_block(block, volume, number, tag);
    }
    buf
}

/// Polls `future` until it finishes or `stop()` holds after a poll; then drops it (a crash
/// abandons everything in flight). Returns whether it finished.
pub(super) fn run_until<F: Future>(future: F, stop: impl Fn() -> bool, polls_max: u64) -> bool {
    let mut future = pin!(future);
    let mut context = Context::from_waker(Waker::noop());
    for _ in 0..polls_max {
        if future.as_mut().poll(&mut context).is_ready() {
            return true;
        }
        if stop() {
            return false;
        }
    }
    false
}

/// Runs a round's futures to the end, or in a crash round only for a seeded number of polls
/// (the crash then lands in the middle of their I/O).
fn run_round(futures: Vec<LocalBoxFuture<'_, ()>>, crash_round: bool, phase_seed: u64) {
    if crash_round {
        let budget = 2_000 + Rng::new(phase_seed).below(30_000);
        run_until(join_all(futures), || false, budget);
    } else {
        block_on(join_all(futures));
    }
}

/// Writers spread over every handle of the node, on every volume, concurrently.
pub(super) fn writers<'a>(
    node: &'a Node,
    maps: &'a [Arc<VolumeMap>],
    contexts: &'a [Vec<WriterContext<'a, LogHandle<SimDrive>>>],
    writers_per_volume: usize,
    seed: u64,
    operations: u32,
) -> Vec<LocalBoxFuture<'a, ()>> {
    let _ = node;
    let mut futures: Vec<LocalBoxFuture<'a, ()>> = Vec::new();
    for (volume_index, volume_contexts) in contexts.iter().enumerate().take(maps.len()) {
        for (writer, context) in volume_contexts.iter().enumerate().take(writers_per_volume) {
            let writer_seed = seed ^ ((volume_index * 31 + writer) as u64).rotate_left(29);
            futures.push(Box::pin(run_writer(
                context,
                writer,
                writers_per_volume,
                writer_seed,
                operations,
            )));
        }
    }
    futures
}

pub(super) fn contexts<'a>(
    node: &'a Node,
    maps: &'a [Arc<VolumeMap>],
    oracle: &'a Oracle,
    report: &'a RefCell<CheckReport>,
    progress: &'a LocalNotify,
    writers_per_volume: usize,
    tolerate_errors: bool,
) -> Vec<Vec<WriterContext<'a, LogHandle<SimDrive>>>> {
    maps.iter()
        .enumerate()
        .map(|(volume_index, map)| {
            (0..writers_per_volume)
                .map(|writer| WriterContext {
                    store: &node.handles[(volume_index + writer) % node.handles.len()],
                    map,
                    oracle,
                    report,
                    progress,
                    tolerate_errors,
                    io_blocks_max: 24,
                })
                .collect()
        })
        .collect()
}

/// Reads every block a test touched: determined blocks must match exactly (checked by
/// `verify_volume`), undetermined ones must hold zeros or a whole block some write produced
/// for this very block, never a torn or foreign one.
pub(super) fn verify_all(node: &Node, maps: &[Arc<VolumeMap>], oracle: &Oracle) -> u64 {
    let handle = &node.handles[0];
    let mut verified = 0;
    for map in maps {
        verified += block_on(verify_volume(handle, map, oracle));
        for (number, expected) in oracle.touched(map.volume()) {
            if expected.is_some() {
                continue;
            }
            let (result, block) =
                block_on(handle.read(map, number * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
            result.unwrap_or_else(|error| panic!("read of undetermined block {number}: {error}"));
            let described = describe_block(&block);
            assert!(
                described == "zeros"
                    || described.contains(&format!("block {number} of {}", map.volume())),
                "undetermined block {number} of {} holds {described}",
                map.volume()
            );
        }
    }
    verified
}

#[test]
fn write_read_trim_and_restart() {
    let node = Node::format(64, 1, 2, 1);
    let (_volumes, maps) = volume_maps(&[100_000]);
    let map = &maps[0];
    let volume = map.volume();
    let handle = &node.handles[0];
    let (result, _) = block_on(handle.write(map, 10 * BLOCK, block_buf(volume, 10, 70, 7)));
    result.unwrap();
    let (result, _) = block_on(handle.write(map, 20 * BLOCK, block_buf(volume, 20, 1, 8)));
    result.unwrap();
    block_on(handle.deallocate(map, 30 * BLOCK, 5 * BLOCK)).unwrap();
    block_on(handle.write_zeroes(map, 40 * BLOCK, 2 * BLOCK)).unwrap();
    let check = |node: &Node| {
        let (result, buf) =
            block_on(node.handles[0].read(map, 0, AlignedBuf::new(100 * BLOCK_BYTES)));
        result.unwrap();
        for (number, block) in (0..100u64).zip(buf.chunks(BLOCK_BYTES)) {
            let tag = match number {
                20 => 8,
                30..35 | 40..42 => 0,
                10..80 => 7,
                _ => 0,
            };
            assert!(
                block_matches(block, volume, number, tag),
                "block {number}: {}",
                describe_block(block)
            );
        }
        let stats = node.engine.volume_stats(map);
        assert_eq!(stats.mapped_bytes, (70 - 7) * BLOCK, "thin: only written blocks are mapped");
        assert_eq!(stats.provisioned_bytes, 100_000 * BLOCK);
    };
    check(&node);
    let node = node.restart();
    check(&node);
    assert_eq!(node.report.mapped_blocks, 63);
    let node = node.crash();
    check(&node);
    // Out of range and unaligned requests are refused.
    let (result, _) =
        block_on(node.handles[0].write(map, 100_000 * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
    assert!(result.is_err());
    let (result, _) = block_on(node.handles[0].read(map, 512, AlignedBuf::new(BLOCK_BYTES)));
    assert!(result.is_err());
}

#[test]
fn a_corrupt_block_is_an_error_never_garbage() {
    let node = Node::format(32, 2, 0, 1);
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let handle = &node.handles[0];
    let (result, _) = block_on(handle.write(map, 0, block_buf(map.volume(), 0, 4, 3)));
    result.unwrap();
    // Damage block 2 where it lives on the drive.
    let (drive, offset_bytes) = node.place_of(map, 2);
    let mut bad = AlignedBuf::new(BLOCK_BYTES);
    bad.fill(0x5a);
    block_on(node.drives[usize::from(drive)].write_at(offset_bytes, bad)).0.unwrap();
    let (result, _) = block_on(handle.read_blocks(map, 0, AlignedBuf::new(4 * BLOCK_BYTES)));
    assert!(matches!(result, Err(LogError::ChecksumMismatch { block: 2, .. })), "{result:?}");
    assert_eq!(node.engine.stats().checksum_errors, 1);
    let (result, _) = block_on(handle.read(map, 3 * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
    assert!(result.is_ok(), "other blocks still read");
}

/// Drive reads the node's drives have served so far.
fn drive_reads(node: &Node) -> u64 {
    drive_reads_of(&node.drives)
}

fn drive_reads_of(drives: &[SimDrive]) -> u64 {
    drives.iter().map(|drive| drive.stats().reads).sum()
}

#[test]
fn multi_block_reads_take_back_to_back_blocks_in_one_drive_read() {
    let node = Node::format(32, 4, 3, 1);
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let volume = map.volume();
    let handle = &node.handles[0];
    let read = |first: u64, count: u64| {
        let (result, buf) = block_on(handle.read_blocks(
            map,
            first * BLOCK,
            AlignedBuf::new((count * BLOCK) as usize),
        ));
        result.unwrap();
        buf
    };
    let (result, _) = block_on(handle.write(map, 0, block_buf(volume, 0, 16, 1)));
    result.unwrap();
    let before = drive_reads(&node);
    assert_eq!(&read(0, 16)[..], &block_buf(volume, 0, 16, 1)[..]);
    let runs_read = drive_reads(&node) - before;
    // One batch holds the 16 blocks back to back; at most a chunk boundary splits them.
    assert!(runs_read <= 2, "16 blocks written together took {runs_read} drive reads");
    // Block 5 rewritten on its own breaks the run in three; unmapped blocks after read as zeros.
    let (result, _) = block_on(handle.write(map, 5 * BLOCK, block_buf(volume, 5, 1, 2)));
    result.unwrap();
    let mut expected = block_buf(volume, 0, 20, 1);
    expected[5 * BLOCK_BYTES..6 * BLOCK_BYTES].copy_from_slice(&block_buf(volume, 5, 1, 2));
    expected[16 * BLOCK_BYTES..].fill(0);
    let before = drive_reads(&node);
    assert_eq!(&read(0, 20)[..], &expected[..]);
    let runs_read = drive_reads(&node) - before;
    assert!((3..=4).contains(&runs_read), "three runs took {runs_read} drive reads");
    // A run starting mid-way and a single unmapped block between mapped ones.
    block_on(handle.deallocate(map, 9 * BLOCK, BLOCK)).unwrap();
    expected[9 * BLOCK_BYTES..10 * BLOCK_BYTES].fill(0);
    assert_eq!(&read(3, 12)[..], &expected[3 * BLOCK_BYTES..15 * BLOCK_BYTES]);
}

/// Blocks handed over one buffer each (as a replica receives them) are written as one buffer's
/// are: back to back, so the range reads in one drive read, and durably, so they survive a
/// power loss. An empty list writes nothing; a list past the volume's end is refused.
#[test]
fn a_list_of_block_buffers_writes_as_one_buffer_would() {
    let node = Node::format(32, 5, 3, 1);
    let (_volumes, maps) = volume_maps(&[64]);
    let map = &maps[0];
    let volume = map.volume();
    let expected = block_buf(volume, 8, 12, 3);
    let buffers: Vec<Vec<u8>> = expected.chunks(BLOCK_BYTES).map(<[u8]>::to_vec).collect();
    let handle = &node.handles[0];
    block_on(handle.write_block_list(
        map,
        8 * BLOCK,
        buffers.iter().map(|block| (&block[..], crc32c::crc32c(block))),
    ))
    .unwrap();
    block_on(handle.write_block_list(map, 0, std::iter::empty())).unwrap();
    let past_end = block_on(handle.write_block_list(
        map,
        60 * BLOCK,
        buffers.iter().map(|block| (&block[..], crc32c::crc32c(block))),
    ));
    assert!(
        matches!(past_end, Err(LogError::Request(StoreError::OutOfRange { .. }))),
        "{past_end:?}"
    );
    let node = node.restart();
    let before = drive_reads(&node);
    let (result, buf) =
        block_on(node.handles[0].read_blocks(map, 8 * BLOCK, AlignedBuf::new(12 * BLOCK_BYTES)));
    result.unwrap();
    assert_eq!(&buf[..], &expected[..]);
    let runs_read = drive_reads(&node) - before;
    assert!(runs_read <= 2, "12 blocks written together took {runs_read} drive reads");
    let (result, buf) =
        block_on(node.handles[0].read_blocks(map, 0, AlignedBuf::new(8 * BLOCK_BYTES)));
    result.unwrap();
    assert!(buf.iter().all(|byte| *byte == 0), "the empty list wrote something");
}

#[test]
fn each_write_lands_back_to_back_while_many_writers_wait() {
    // Segments of 1 MiB per drive (256 positions, chunks of 128), so segment switches are rare.
    const UNIT: u64 = 1 << 20;
    const WRITERS: u64 = 256;
    const WRITES: u64 = 4;
    const BLOCKS: u64 = 8;
    let config = LogConfig { unit_bytes: UNIT, ..config() };
    let size_bytes = HEADER_REGION_BYTES + LOG_HEADER_BYTES + 40 * UNIT;
    let drives: Vec<SimDrive> = (0..DRIVES)
        .map(|index| SimDrive::new(index, size_bytes, 11 ^ u64::from(index), 3))
        .collect();
    block_on(LogEngine::format(&drives, &config)).unwrap();
    let latches = Arc::new(DriveLatches::new(DRIVES));
    let (_engine, handle, _) = block_on(LogEngine::open(drives.clone(), config, latches)).unwrap();
    let (_volumes, maps) = volume_maps(&[WRITERS * WRITES * BLOCKS]);
    let map = &maps[0];
    let volume = map.volume();
    // 256 writers of 8 blocks at once keep the batch queue full (8 batches of at most 126 data
    // blocks), so most of them wait for their turn; each range is written once.
    let futures: Vec<LocalBoxFuture<'_, ()>> = (0..WRITERS)
        .map(|writer| {
            let handle = &handle;
            Box::pin(async move {
                for write in 0..WRITES {
                    let first = (write * WRITERS + writer) * BLOCKS;
                    let data = block_buf(volume, first, BLOCKS, 1);
                    let (result, _) = handle.write(map, first * BLOCK, data).await;
                    result.unwrap();
                }
            }) as LocalBoxFuture<'_, ()>
        })
        .collect();
    block_on(join_all(futures));
    let mut split = 0;
    for range in 0..WRITERS * WRITES {
        let first = range * BLOCKS;
        let before = drive_reads_of(&drives);
        let (result, buf) = block_on(handle.read_blocks(
            map,
            first * BLOCK,
            AlignedBuf::new((BLOCKS * BLOCK) as usize),
        ));
        result.unwrap();
        assert_eq!(&buf[..], &block_buf(volume, first, BLOCKS, 1)[..]);
        let runs_read = drive_reads_of(&drives) - before;
        // A batch, chunk or segment boundary may cut a write once (rarely twice); interleaved
        // with the other writers' blocks it would take up to eight drive reads.
        assert!(runs_read <= 3, "blocks {first}.. written together took {runs_read} drive reads");
        split += u64::from(runs_read > 1);
    }
    assert!(split <= WRITERS * WRITES / 4, "{split} of {} writes were cut", WRITERS * WRITES);
}

#[test]
fn drives_of_another_node_or_format_are_refused() {
    let drives = sim_drives(16, 3, 0);
    assert!(matches!(
        Node::open(drives.clone(), 1),
        Err(LogError::SuperblockInvalid { drive: 0, .. })
    ));
    block_on(LogEngine::format(&drives, &config())).unwrap();
    let other = LogConfig { node_uuid: NodeUuid([1; 16]), ..config() };
    let result =
        block_on(LogEngine::open(drives.clone(), other, Arc::new(DriveLatches::new(DRIVES))));
    assert!(matches!(result, Err(LogError::NodeMismatch { .. })));
    let swapped = vec![drives[1].clone(), drives[0].clone(), drives[2].clone()];
    assert!(matches!(Node::open(swapped, 1), Err(LogError::DriveMismatch { drive: 0, found: 1 })));
    assert!(Node::open(drives, 1).is_ok());
}

/// The model test: several handles (threads) write, trim and read concurrently against the
/// oracle, across clean restarts and crashes, with a log small enough that GC and checkpoints
/// run throughout. The log holds the volumes' 7,000 blocks with a little room to spare, so
/// longer soaks (which map more of them) never fill the node.
#[test]
fn model_with_concurrent_handles_restarts_crashes_and_gc() {
    for seed in 0..3 * soak() {
        let mut node = Node::format(200, seed, 3, 3);
        let (_volumes, maps) = volume_maps(&[4000, 3000]);
        // Uncompressed, LZ4 and zstd in turn: packed blocks go through the same model.
        let compression = Compression::ALL[(seed % 3) as usize];
        for map in &maps {
            map.set_compression(compression);
        }
        let oracle = Oracle::new();
        let mut total = CheckReport::default();
        let (mut cleaned, mut checkpoints) = (0, 0);
        for round in 0..4u64 {
            let report = RefCell::new(CheckReport::default());
            let progress = LocalNotify::new();
            let phase_seed = seed * 1000 + round;
            let crash_round = round % 2 == 1;
            {
                let contexts = contexts(&node, &maps, &oracle, &report, &progress, 3, false);
                let futures = writers(&node, &maps, &contexts, 3, phase_seed, 120 * soak() as u32);
                run_round(futures, crash_round, phase_seed);
            }
            let stats = node.engine.stats();
            cleaned += stats.gc_segments_cleaned;
            checkpoints += stats.checkpoints;
            node = if crash_round { node.crash() } else { node.restart() };
            let verified = verify_all(&node, &maps, &oracle);
            assert!(verified > 0);
            let report = report.into_inner();
            total.writes += report.writes;
            total.deallocates += report.deallocates;
            total.write_zeroes += report.write_zeroes;
            total.reads += report.reads;
        }
        let stats = node.engine.stats();
        assert!(total.writes > 300 && total.deallocates > 0 && total.write_zeroes > 0, "{total:?}");
        assert!(cleaned > 0 && checkpoints > 0, "GC cleaned {cleaned}, {checkpoints} checkpoints");
        if compression == Compression::Off {
            assert_eq!(stats.mapped_physical_bytes, stats.mapped_bytes);
        } else {
            // Four fifths of the test's blocks compress (see fill_block).
            assert!(stats.data_reduction > 1.3, "{compression}: {stats:?}");
        }
        assert!(stats.failed_drives.is_empty());
        let _ = stats;
    }
}

#[test]
fn scattered_reads_are_rewritten_back_to_back() {
    let node = Node::format(64, 5, 3, 1);
    node.engine.set_read_defrag(true);
    let (_volumes, maps) = volume_maps(&[1000]);
    let (map, handle) = (&maps[0], &node.handles[0]);
    let volume = map.volume();
    let read = |first: u64, count: u64| {
        let before = drive_reads(&node);
        let buf = AlignedBuf::new((count * BLOCK) as usize);
        let (result, buf) = block_on(handle.read_blocks(map, first * BLOCK, buf));
        result.unwrap();
        (buf, drive_reads(&node) - before)
    };
    // Blocks 0..8 written one at a time between writes elsewhere: eight places in the log.
    for block in 0..8 {
        for (first, tag) in [(block, 1), (500 + block, 9)] {
            let (result, _) =
                block_on(handle.write(map, first * BLOCK, block_buf(volume, first, 1, tag)));
            result.unwrap();
        }
    }
    let expected = block_buf(volume, 0, 8, 1);
    let (buf, runs) = read(0, 8);
    assert_eq!(&buf[..], &expected[..]);
    assert_eq!(runs, 8, "scattered blocks take a drive read each");
    // The read queued the range; the defragmenter writes it back to back.
    assert_eq!(block_on(handle.defrag_step()), Some(8));
    assert_eq!(block_on(handle.defrag_step()), None);
    let (buf, runs) = read(0, 8);
    assert_eq!(&buf[..], &expected[..]);
    assert!(runs <= 2, "a rewritten range took {runs} drive reads");
    assert_eq!(node.engine.stats().defrag_relocated_blocks, 8);
    // A contiguous range queues nothing.
    assert_eq!(block_on(handle.defrag_step()), None);

    // A range written over between the read and its rewrite is left to the newer write.
    let (_, runs) = read(500, 8);
    assert_eq!(runs, 8);
    let (result, _) = block_on(handle.write(map, 503 * BLOCK, block_buf(volume, 503, 1, 10)));
    result.unwrap();
    assert_eq!(block_on(handle.defrag_step()), Some(0));
    let mut expected = block_buf(volume, 500, 8, 9);
    expected[3 * BLOCK_BYTES..4 * BLOCK_BYTES].copy_from_slice(&block_buf(volume, 503, 1, 10));
    // Off: nothing is queued. On again: the range as it is now is rewritten.
    node.engine.set_read_defrag(false);
    assert_eq!(&read(500, 8).0[..], &expected[..]);
    assert_eq!(block_on(handle.defrag_step()), None);
    node.engine.set_read_defrag(true);
    assert_eq!(&read(500, 8).0[..], &expected[..]);
    assert_eq!(block_on(handle.defrag_step()), Some(8));
    assert!(read(500, 8).1 <= 2);
    // After a power loss, both ranges read what was written last.
    let node = node.crash();
    let (result, buf) =
        block_on(node.handles[0].read_blocks(map, 0, AlignedBuf::new(8 * BLOCK_BYTES)));
    result.unwrap();
    assert_eq!(&buf[..], &block_buf(volume, 0, 8, 1)[..]);
    let (result, buf) =
        block_on(node.handles[0].read_blocks(map, 500 * BLOCK, AlignedBuf::new(8 * BLOCK_BYTES)));
    result.unwrap();
    assert_eq!(&buf[..], &expected[..]);
}

/// The model test with read-triggered defragmentation: writers, trims and multi-block reads on
/// two handles while each handle's defragmenter rewrites what the reads queue, across clean
/// restarts and crashes; every completed write must survive, none may be undone by a rewrite.
#[test]
fn model_with_read_defragmentation_restarts_and_crashes() {
    for seed in 0..2 * soak() {
        let mut node = Node::format(400, 100 + seed, 3, 2);
        let (_volumes, maps) = volume_maps(&[1500, 1000]);
        for map in &maps {
            map.set_compression(Compression::Off);
        }
        let oracle = Oracle::new();
        let mut rewritten = 0;
        for round in 0..4u64 {
            node.engine.set_read_defrag(true);
            let report = RefCell::new(CheckReport::default());
            let progress = LocalNotify::new();
            let phase_seed = seed * 1000 + round;
            let crash_round = round % 2 == 1;
            {
                let contexts = contexts(&node, &maps, &oracle, &report, &progress, 3, false);
                let mut futures =
                    writers(&node, &maps, &contexts, 3, phase_seed, 150 * soak() as u32);
                let writers_left = Rc::new(std::cell::Cell::new(futures.len()));
                futures = futures
                    .into_iter()
                    .map(|writer| {
                        let left = Rc::clone(&writers_left);
                        Box::pin(async move {
                            writer.await;
                            left.set(left.get() - 1);
                        }) as LocalBoxFuture<'_, ()>
                    })
                    .collect();
                for handle in &node.handles {
                    let left = Rc::clone(&writers_left);
                    futures.push(Box::pin(async move {
                        while left.get() > 0 {
                            if handle.defrag_step().await.is_none() {
                                crate::join::yield_now().await;
                            }
                        }
                    }));
                }
                run_round(futures, crash_round, phase_seed);
            }
            rewritten += node.engine.stats().defrag_relocated_blocks;
            node = if crash_round { node.crash() } else { node.restart() };
            assert!(verify_all(&node, &maps, &oracle) > 0);
        }
        assert!(rewritten > 0, "no range was rewritten");
    }
}

/// GC under steady overwrite at high fill, with every block verified, then the distinct
/// capacity error when the node is truly full; nothing is corrupted along the way.
#[test]
fn gc_keeps_up_at_high_fill_and_capacity_is_enforced() {
    let node = Node::format(128, 9, 1, 1);
    let capacity = node.engine.capacity_blocks();
    let (_volumes, maps) = volume_maps(&[capacity * 2, capacity * 2]);
    let map = &maps[0];
    let volume = map.volume();
    let handle = &node.handles[0];
    let fill = capacity * 85 / 100;
    let mut tags = vec![0u64; fill as usize];
    let mut tag = 1;
    let mut first = 0;
    while first < fill {
        let count = 32.min(fill - first);
        let (result, _) =
            block_on(handle.write(map, first * BLOCK, block_buf(volume, first, count, tag)));
        result.unwrap();
        tags[first as usize..(first + count) as usize].fill(tag);
        tag += 1;
        first += count;
    }
    let host_before = node.engine.stats().host_bytes_written;
    let device_before = node.engine.stats().device_bytes_written;
    let mut rng = Rng::new(5);
    let overwrites = fill * 3 * soak();
    let mut written = 0;
    while written < overwrites {
        let count = 1 + rng.below(8);
        let start = rng.below(fill - count);
        let (result, _) =
            block_on(handle.write(map, start * BLOCK, block_buf(volume, start, count, tag)));
        result.unwrap_or_else(|error| panic!("overwrite at {start} with {} mapped: {error}", fill));
        tags[start as usize..(start + count) as usize].fill(tag);
        tag += 1;
        written += count;
    }
    let stats = node.engine.stats();
    let amplification = (stats.device_bytes_written - device_before) as f64
        / (stats.host_bytes_written - host_before) as f64;
    assert!(stats.gc_segments_cleaned > 10, "{stats:?}");
    assert!(amplification < 12.0, "write amplification {amplification}");
    println!(
        "GC at 85% of capacity ({} blocks, {:.0}% of raw): write amplification {amplification:.2} \
         under random overwrite, {} segments cleaned, {} blocks relocated, {} checkpoints",
        fill,
        100.0 * fill as f64 / node.engine.geometry.location_count() as f64,
        stats.gc_segments_cleaned,
        stats.gc_relocated_blocks,
        stats.checkpoints
    );
    // Fill the rest through another volume: the write that does not fit fails cleanly.
    let other = &maps[1];
    let mut block = 0;
    let error = loop {
        let (result, _) =
            block_on(handle.write(other, block * BLOCK, block_buf(other.volume(), block, 16, 1)));
        match result {
            Ok(()) => block += 16,
            Err(error) => break error,
        }
        assert!(block <= capacity, "wrote past the capacity");
    };
    assert!(error.to_string().contains("node is full"), "{error}");
    let direct = block_on(handle.write_blocks(
        other,
        block * BLOCK,
        &block_buf(other.volume(), block, 16, 1),
    ));
    assert!(matches!(direct, Err(LogError::CapacityExceeded { .. })), "{direct:?}");
    // Deallocating makes room again, and every block still holds its last write.
    block_on(handle.deallocate(other, 0, block * BLOCK)).unwrap();
    let (result, _) = block_on(handle.write(other, 0, block_buf(other.volume(), 0, 16, 2)));
    result.unwrap();
    let node = node.restart();
    let (result, buf) =
        block_on(node.handles[0].read(map, 0, AlignedBuf::new((fill * BLOCK) as usize)));
    result.unwrap();
    for (number, block) in (0..fill).zip(buf.chunks(BLOCK_BYTES)) {
        assert!(
            block_matches(block, volume, number, tags[number as usize]),
            "block {number}: {}",
            describe_block(block)
        );
    }
}

/// GC moves compressed blocks between pack slots under steady overwrite of a compressed volume
/// filled past the physical capacity's worth of raw blocks: every block verified after a
/// power loss, and the capacity counts drive space, not logical blocks.
#[test]
fn gc_repacks_compressed_blocks_under_overwrite() {
    for compression in [Compression::Lz4, Compression::Zstd] {
        let node = Node::format(128, 21, 1, 1);
        let capacity = node.engine.capacity_blocks();
        let (_volumes, maps) = volume_maps(&[capacity * 3]);
        let map = &maps[0];
        map.set_compression(compression);
        let volume = map.volume();
        let handle = &node.handles[0];
        // More logical blocks than the node holds raw: only compression makes them fit.
        let fill = capacity * 11 / 10;
        let mut tags = vec![0u64; fill as usize];
        // Tags that compress (never a multiple of 5, see fill_block).
        let mut tag = 1;
        let mut next_tag = || {
            tag += if tag % 5 == 4 { 2 } else { 1 };
            tag
        };
        let mut first = 0;
        while first < fill {
            let count = 32.min(fill - first);
            let t = next_tag();
            let (result, _) =
                block_on(handle.write(map, first * BLOCK, block_buf(volume, first, count, t)));
            result.unwrap_or_else(|error| panic!("{compression}: fill at {first}: {error}"));
            tags[first as usize..(first + count) as usize].fill(t);
            first += count;
        }
        let mut rng = Rng::new(77);
        let mut written = 0;
        while written < fill * 3 {
            let count = 1 + rng.below(8);
            let start = rng.below(fill - count);
            let t = next_tag();
            let (result, _) =
                block_on(handle.write(map, start * BLOCK, block_buf(volume, start, count, t)));
            result.unwrap_or_else(|error| panic!("{compression}: overwrite at {start}: {error}"));
            tags[start as usize..(start + count) as usize].fill(t);
            written += count;
        }
        let stats = node.engine.stats();
        assert!(stats.gc_segments_cleaned > 10, "{compression}: {stats:?}");
        assert!(stats.gc_relocated_blocks > 0, "{compression}: {stats:?}");
        assert!(stats.data_reduction > 1.5, "{compression}: {stats:?}");
        let node = node.crash();
        let (result, buf) =
            block_on(node.handles[0].read(map, 0, AlignedBuf::new((fill * BLOCK) as usize)));
        result.unwrap();
        for (number, block) in (0..fill).zip(buf.chunks(BLOCK_BYTES)) {
            assert!(
                block_matches(block, volume, number, tags[number as usize]),
                "{compression}: block {number}: {}",
                describe_block(block)
            );
        }
        let recovered = node.engine.stats();
        assert_eq!(recovered.mapped_physical_bytes, stats.mapped_physical_bytes);
    }
}

/// Crash at every Nth drive operation (write or sync, across drives) during concurrent writes
/// and trims with GC and checkpoints running; after recovery every acknowledged mutation is
/// intact and no block is torn.
#[test]
fn crash_at_every_nth_drive_operation() {
    let step = 7;
    let operations_max = 600 * soak();
    let mut n = 3;
    while n < operations_max {
        let node = Node::format(48, n, 2, 2);
        let (_volumes, maps) = volume_maps(&[1500]);
        maps[0].set_compression(Compression::ALL[(n % 3) as usize]);
        let oracle = Oracle::new();
        let report = RefCell::new(CheckReport::default());
        let progress = LocalNotify::new();
        let start: u64 = node.drives.iter().map(|d| d.stats().writes + d.stats().syncs).sum();
        {
            let contexts = contexts(&node, &maps, &oracle, &report, &progress, 2, false);
            let futures = writers(&node, &maps, &contexts, 2, n, 200);
            let drives = node.drives.clone();
            let stop = move || {
                let done: u64 = drives.iter().map(|d| d.stats().writes + d.stats().syncs).sum();
                done >= start + n
            };
            run_until(join_all(futures), stop, 50_000_000);
        }
        let node = node.crash();
        verify_all(&node, &maps, &oracle);
        // The recovered node keeps working and recovers again.
        let report2 = RefCell::new(CheckReport::default());
        {
            let contexts = contexts(&node, &maps, &oracle, &report2, &progress, 2, false);
            block_on(join_all(writers(&node, &maps, &contexts, 2, n + 1, 30)));
        }
        let node = node.crash();
        verify_all(&node, &maps, &oracle);
        n += step;
    }
}

/// Up to `COMMITS_IN_FLIGHT_MAX` single-block batches of one handle in flight on held drives,
/// then a crash that keeps, drops or tears each of their blocks: a torn batch has whole ones
/// behind it. Recovery takes a failing batch as a tear only while fewer than
/// `UNFINISHED_BATCHES_MAX` batches follow it; were that bound below the batches that can be in
/// flight, a torn batch would be kept and its blocks would read as errors here.
#[test]
fn a_crash_among_batches_in_flight_drops_the_torn_ones_and_those_behind() {
    let writes = super::engine::COMMITS_IN_FLIGHT_MAX as u64 + 2;
    let mut dropped = 0;
    for seed in 0..120 * soak() {
        let node = Node::format(48, seed, 0, 1);
        let (_volumes, maps) = volume_maps(&[100]);
        let map = &maps[0];
        let handle = &node.handles[0];
        let (result, _) = block_on(handle.write(map, 0, block_buf(map.volume(), 0, writes, 1)));
        result.unwrap();
        for drive in &node.drives {
            drive.hold_writes();
        }
        {
            // Each write is polled until it waits, so each is a batch of its own.
            let mut futures: Vec<LocalBoxFuture<'_, ()>> = Vec::new();
            for number in 0..writes {
                let buf = block_buf(map.volume(), number, 1, 2);
                let mut future: LocalBoxFuture<'_, ()> = Box::pin(async move {
                    let (result, _) = handle.write(map, number * BLOCK, buf).await;
                    result.unwrap();
                });
                assert!(!run_until(future.as_mut(), || false, 20), "no write completes");
                futures.push(future);
            }
        }
        let node = node.crash();
        assert_eq!(node.report.batches_damaged, 0, "{:?}", node.report);
        dropped += node.report.batches_dropped;
        for number in 0..writes {
            let buf = AlignedBuf::new(BLOCK_BYTES);
            let (result, buf) = block_on(node.handles[0].read(map, number * BLOCK, buf));
            result.unwrap_or_else(|error| panic!("seed {seed}, block {number}: {error}"));
            let old = block_matches(&buf, map.volume(), number, 1);
            assert!(old || block_matches(&buf, map.volume(), number, 2), "seed {seed} {number}");
        }
    }
    assert!(dropped > 0, "no torn batch had whole ones behind it");
}

/// A drive failing its Nth write or sync is latched, the engine keeps reading what it can, and
/// no acknowledged write is lost after a restart.
#[test]
fn injected_faults_latch_and_lose_no_acknowledged_write() {
    for round in 0..12u64 {
        let node = Node::format(64, round, 2, 2);
        let (_volumes, maps) = volume_maps(&[2000]);
        let victim = &node.drives[(round % u64::from(DRIVES)) as usize];
        if round % 2 == 0 {
            victim.fail_write_after(1 + round * 5);
        } else {
            victim.fail_sync_after(1 + round * 3);
        }
        let oracle = Oracle::new();
        let report = RefCell::new(CheckReport::default());
        let progress = LocalNotify::new();
        {
            let contexts = contexts(&node, &maps, &oracle, &report, &progress, 2, true);
            block_on(join_all(writers(&node, &maps, &contexts, 2, round, 150)));
        }
        let failed = node.engine.stats().failed_drives;
        assert_eq!(failed, [(round % u64::from(DRIVES)) as u16], "round {round}");
        assert!(report.borrow().failed_operations > 0);
        // Writes now fail with the latch, clearly.
        let result = block_on(node.handles[0].write_blocks(
            &maps[0],
            0,
            &block_buf(maps[0].volume(), 0, 1, 99),
        ));
        assert!(matches!(result, Err(LogError::DriveFailed { .. })), "{result:?}");
        // Restart (the drive is replaced by a healthy one holding the same bytes), then crash.
        let node = node.crash();
        verify_all(&node, &maps, &oracle);
    }
}

/// Recovery reads a bounded amount: measured per GiB written, with and without a checkpoint
/// covering most of it.
#[test]
fn recovery_time_per_gib_written() {
    let segments = 1200;
    let node = Node::format(segments, 4, 0, 1);
    let capacity = node.engine.capacity_blocks();
    let (_volumes, maps) = volume_maps(&[capacity]);
    let map = &maps[0];
    let handle = &node.handles[0];
    let mut rng = Rng::new(1);
    let mut written_blocks = 0;
    let target = capacity * 2 * soak().min(4);
    while written_blocks < target {
        let count = 1 + rng.below(32);
        let start = rng.below(capacity * 8 / 10 - count);
        let (result, _) = block_on(handle.write(
            map,
            start * BLOCK,
            block_buf(map.volume(), start, count, 1 + written_blocks),
        ));
        result.unwrap();
        written_blocks += count;
    }
    let gib = (written_blocks * BLOCK) as f64 / (1u64 << 30) as f64;
    let mapped = node.engine.stats().mapped_bytes;
    let ram = node.engine.stats().index_ram_bytes as f64 / (mapped / BLOCK) as f64;
    let drives = node.drives.clone();
    drop(node);
    for drive in &drives {
        drive.crash();
    }
    let started = Instant::now();
    let node = Node::open(drives, 1).unwrap();
    let seconds = started.elapsed().as_secs_f64();
    let report = node.report;
    assert_eq!(report.mapped_blocks * BLOCK, mapped);
    let read_fraction = report.bytes_read as f64 / (written_blocks * BLOCK) as f64;
    assert!(
        read_fraction < 0.6,
        "recovery read {read_fraction:.2} of the bytes written: {report:?}"
    );
    println!(
        "recovery after {:.3} GiB written ({} MiB mapped): {seconds:.3} s on SimDrive = {:.2} s/GiB \
         written; read {:.1} MiB ({:.0}% of written): {report:?}; index RAM {ram:.2} bytes per \
         mapped block",
        gib,
        mapped >> 20,
        seconds / gib,
        report.bytes_read as f64 / (1 << 20) as f64,
        100.0 * read_fraction,
    );
}

/// Opens the log on `drives` with `config` (a test's own, where `Node` takes the default one):
/// recovery of whatever the drives hold.
fn open_drives(
    drives: &[SimDrive],
    config: &LogConfig,
) -> (Arc<LogEngine>, LogHandle<SimDrive>, RecoveryReport) {
    let latches = Arc::new(DriveLatches::new(drives.len() as u16));
    block_on(LogEngine::open(drives.to_vec(), config.clone(), latches)).unwrap()
}

#[test]
fn recovery_walks_a_segment_from_a_few_large_reads() {
    // No checkpoint while writing, so recovery replays every segment written.
    let config = LogConfig { checkpoint_interval_segments: 1_000, ..config() };
    let drives = sim_drives(64, 5, 0);
    block_on(LogEngine::format(&drives, &config)).unwrap();
    let open = || open_drives(&drives, &config);
    let (volumes, maps) = volume_maps(&[10_000]);
    let map = &maps[0];
    let (engine, handle, _) = open();
    let writes = 300u64;
    // Each write waits for the one before: one batch each, many per segment.
    for number in 0..writes {
        let buf = block_buf(map.volume(), number, 1, 3);
        let (result, _) = block_on(handle.write(map, number * BLOCK, buf));
        result.unwrap();
    }
    drop((handle, engine));
    for drive in &drives {
        drive.crash();
    }
    let before = drive_reads_of(&drives);
    let (_engine, handle, report) = open();
    let walked = report.batches_replayed + report.batches_skipped;
    let segments = u64::from(report.segments_replayed);
    assert!(walked >= writes && segments >= 4, "{report:?}");
    // Besides one read per segment probed: the roots and the checkpoint, and per replayed
    // segment one window (a read per drive run) and the read that finds where its log ends;
    // not a read per batch header and another per batch's data.
    let reads = drive_reads_of(&drives) - before - u64::from(report.segments_probed);
    assert!(reads <= 24 + 6 * segments, "{reads} reads to walk {walked} batches: {report:?}");
    let (result, buf) = block_on(handle.read(map, 0, AlignedBuf::new(300 * BLOCK_BYTES)));
    result.unwrap();
    for (number, block) in (0..writes).zip(buf.chunks(BLOCK_BYTES)) {
        assert!(block_matches(block, map.volume(), number, 3), "block {number}");
    }
    drop(volumes);
}

#[test]
fn recovery_needs_only_the_positions_the_log_holds() {
    let node = Node::format(64, 6, 0, 1);
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let (result, _) = block_on(node.handles[0].write(map, 0, block_buf(map.volume(), 0, 3, 9)));
    result.unwrap();
    // The rest of that segment, on another drive, cannot be read: recovery's wide read of the
    // segment fails there, and it reads only what the batch holds instead.
    let index = node.engine.index.get(map.volume().0).expect("the volume has an index");
    let (location, _) = super::index::unpack(index.get(0)).expect("block 0 is mapped");
    let (segment, _) = node.engine.geometry.split(location);
    let (drive, _) = node.place_of(map, 0);
    let start = node.engine.geometry.row_offset_bytes(segment, 0);
    let other = (drive + 1) % DRIVES;
    node.drives[usize::from(other)].fail_reads_in(start..start + UNIT_BYTES);
    let node = node.crash();
    assert!(node.report.segments_replayed >= 1, "{:?}", node.report);
    let (result, buf) = block_on(node.handles[0].read(map, 0, AlignedBuf::new(3 * BLOCK_BYTES)));
    result.unwrap();
    for (number, block) in (0..3).zip(buf.chunks(BLOCK_BYTES)) {
        assert!(block_matches(block, map.volume(), number, 9), "block {number}");
    }
}

#[test]
fn background_gc_step_and_checkpoint() {
    let node = Node::format(48, 6, 1, 1);
    let handle = &node.handles[0];
    assert_eq!(block_on(handle.gc_step()).unwrap(), GcOutcome::Idle);
    let (_volumes, maps) = volume_maps(&[500]);
    for round in 0..60u64 {
        let (result, _) =
            block_on(handle.write(&maps[0], 0, block_buf(maps[0].volume(), 0, 40, round + 1)));
        result.unwrap();
    }
    block_on(handle.checkpoint()).unwrap();
    let mut cleaned = 0;
    for _ in 0..20 {
        if let GcOutcome::Cleaned { .. } = block_on(handle.gc_step()).unwrap() {
            cleaned += 1;
        }
    }
    assert!(cleaned > 0 || node.engine.stats().gc_segments_cleaned > 0);
    let node = node.restart();
    let (result, buf) =
        block_on(node.handles[0].read(&maps[0], 0, AlignedBuf::new(40 * BLOCK_BYTES)));
    result.unwrap();
    for (number, block) in (0..40).zip(buf.chunks(BLOCK_BYTES)) {
        assert!(block_matches(block, maps[0].volume(), number, 60));
    }
}

/// Read defragmentation goes on once the log has wrapped: from then on background GC holds free
/// space at the threshold where it works (the reserve plus its headroom), and a rule that
/// waited for more than that never rewrote a range again. Below the threshold (GC behind the
/// writes) a scattered read queues nothing, so the space stays the host writes'.
#[test]
fn scattered_reads_are_rewritten_while_gc_holds_free_space_at_its_threshold() {
    let node = Node::format(48, 22, 2, 1);
    node.engine.set_read_defrag(true);
    let handle = &node.handles[0];
    let (_volumes, maps) = volume_maps(&[4_000]);
    let map = &maps[0];
    let volume = map.volume();
    let threshold = node.engine.reserve_segments + handle.gc_headroom_segments();
    let write = |block: u64, tag: u64| {
        let (result, _) =
            block_on(handle.write(map, block * BLOCK, block_buf(volume, block, 1, tag)));
        result.unwrap();
    };
    // Overwrites until background GC is due: the log has wrapped.
    let mut round = 0u64;
    while node.engine.segments.free_count() > threshold {
        write(1_000 + round % 2_000, round);
        round += 1;
        assert!(round < 100_000, "the log never filled");
    }
    block_on(handle.checkpoint()).unwrap();
    // GC's steady state: it cleans while free space is at or below its threshold.
    let mut steps = 0;
    while node.engine.segments.free_count() <= threshold {
        block_on(handle.gc_step()).unwrap();
        steps += 1;
        assert!(steps < 50, "GC never got above its threshold");
    }
    // Blocks 0..8 written one at a time between writes elsewhere: eight places in the log.
    for block in 0..8 {
        write(block, 1);
        write(3_500 + block, 1);
    }
    let read = |first: u64| {
        let (result, buf) =
            block_on(handle.read_blocks(map, first * BLOCK, AlignedBuf::new(8 * BLOCK_BYTES)));
        result.unwrap();
        buf
    };
    let free = node.engine.segments.free_count();
    assert!(free >= threshold && free <= threshold + 2, "free {free}, threshold {threshold}");
    assert_eq!(&read(0)[..], &block_buf(volume, 0, 8, 1)[..]);
    assert_eq!(block_on(handle.defrag_step()), Some(8), "a range rewritten at GC's threshold");
    // Overwrites without GC until free space falls below the threshold: nothing is queued.
    for block in 0..8 {
        write(3_000 + block, 2);
        write(3_500 + block, 2);
    }
    while node.engine.segments.free_count() >= threshold {
        write(1_000 + round % 2_000, round);
        round += 1;
        assert!(round < 200_000, "free space never fell below the threshold");
    }
    assert!(node.engine.segments.free_count() > node.engine.reserve_segments);
    assert_eq!(&read(3_000)[..], &block_buf(volume, 3_000, 8, 2)[..]);
    assert_eq!(block_on(handle.defrag_step()), None, "nothing queued while GC is behind");
}

/// A background GC step reads its victim without the handle's pipeline: a host write on the
/// same handle, started once the step is under way, completes before the step does (before,
/// the step led the pipeline throughout and the write waited for the whole segment).
#[test]
fn host_writes_go_on_while_a_background_gc_step_reads_its_victim() {
    let node = Node::format(48, 21, 2, 1);
    let handle = &node.handles[0];
    let (_volumes, maps) = volume_maps(&[4_000]);
    let map = &maps[0];
    let volume = map.volume();
    let threshold = node.engine.reserve_segments + handle.gc_headroom_segments();
    // One-block batches, half of them cold blocks that stay live: every segment holds many
    // headers and live blocks, so cleaning one takes many reads.
    let mut round = 0u64;
    while node.engine.segments.free_count() > threshold {
        for block in [1_000 + round, round % 50] {
            let (result, _) =
                block_on(handle.write(map, block * BLOCK, block_buf(volume, block, 1, 1)));
            result.unwrap();
        }
        round += 1;
        assert!(round < 2_000, "the log never filled");
    }
    // Every sealed segment below the checkpoint's floor is a candidate.
    block_on(handle.checkpoint()).unwrap();
    let step_done = std::cell::Cell::new(false);
    let write_first = std::cell::Cell::new(false);
    let outcome = std::cell::Cell::new(None);
    let work: Vec<LocalBoxFuture<'_, ()>> = vec![
        Box::pin(async {
            outcome.set(Some(handle.gc_step().await.unwrap()));
            step_done.set(true);
        }),
        Box::pin(async {
            // Let the step claim its victim and start reading it.
            for _ in 0..4 {
                crate::testing::yield_now().await;
            }
            let (result, _) = handle.write(map, 10 * BLOCK, block_buf(volume, 10, 1, 9)).await;
            result.unwrap();
            write_first.set(!step_done.get());
        }),
    ];
    block_on(join_all(work));
    let Some(GcOutcome::Cleaned { relocated_blocks, .. }) = outcome.get() else {
        panic!("the step cleaned nothing: {:?}", outcome.get());
    };
    assert!(relocated_blocks > 0, "the victim held live blocks");
    assert!(write_first.get(), "the host write waited for the GC step");
    let (result, buf) = block_on(handle.read(map, 10 * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
    result.unwrap();
    assert!(block_matches(&buf, volume, 10, 9), "{}", describe_block(&buf));
}

/// Writes blocks 0..7680 of `map` (tag 1): a checkpoint of many blocks (505 entries per block
/// of consecutive ones), so one started is still streaming the index after a few yields.
fn map_blocks_for_a_long_checkpoint(handle: &LogHandle<SimDrive>, map: &VolumeMap) {
    let volume = map.volume();
    for chunk in 0..30u64 {
        let (result, _) = block_on(handle.write(
            map,
            chunk * 256 * BLOCK,
            block_buf(volume, chunk * 256, 256, 1),
        ));
        result.unwrap();
    }
}

/// Takes a checkpoint of `handle` beside `work`, which starts once the checkpoint has had a
/// few turns (with [`map_blocks_for_a_long_checkpoint`], while it streams the index);
/// `checkpoint_done` is set when the checkpoint ends.
fn beside_a_checkpoint<'a>(
    handle: &'a LogHandle<SimDrive>,
    checkpoint_done: &'a std::cell::Cell<bool>,
    work: LocalBoxFuture<'a, ()>,
) {
    let tasks: Vec<LocalBoxFuture<'a, ()>> = vec![
        Box::pin(async move {
            handle.checkpoint().await.unwrap();
            checkpoint_done.set(true);
        }),
        Box::pin(async move {
            for _ in 0..4 {
                crate::testing::yield_now().await;
            }
            work.await;
        }),
    ];
    block_on(join_all(tasks));
}

/// A checkpoint gives its handle's pipeline back once its LSN floor is fixed: a host write on
/// the same handle, started once the checkpoint is under way, completes before the index has
/// streamed out; and the write is found after a crash (replayed over that checkpoint).
#[test]
fn host_writes_go_on_while_a_checkpoint_streams_the_index() {
    let node = Node::format(240, 23, 2, 1);
    let handle = &node.handles[0];
    let (_volumes, maps) = volume_maps(&[20_000]);
    let map = &maps[0];
    let volume = map.volume();
    map_blocks_for_a_long_checkpoint(handle, map);
    let checkpoint_done = std::cell::Cell::new(false);
    let write_first = std::cell::Cell::new(false);
    beside_a_checkpoint(
        handle,
        &checkpoint_done,
        Box::pin(async {
            let (result, _) = handle.write(map, 7 * BLOCK, block_buf(volume, 7, 1, 9)).await;
            result.unwrap();
            write_first.set(!checkpoint_done.get());
        }),
    );
    assert!(write_first.get(), "the host write waited for the whole checkpoint");
    let node = node.crash();
    let (result, buf) =
        block_on(node.handles[0].read(map, 7 * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
    result.unwrap();
    assert!(block_matches(&buf, volume, 7, 9), "{}", describe_block(&buf));
}

/// A checkpoint stores a volume's consecutive blocks in runs, 8 bytes each (24 in format
/// version 5: 46 blocks for these 7,680 entries), and a crash recovers every one of them.
#[test]
fn a_checkpoint_takes_8_bytes_per_block_of_a_densely_written_volume() {
    let node = Node::format(240, 31, 2, 1);
    let handle = &node.handles[0];
    let (_volumes, maps) = volume_maps(&[20_000]);
    let map = &maps[0];
    map_blocks_for_a_long_checkpoint(handle, map);
    let before = node.engine.stats().checkpoint_bytes_written;
    block_on(handle.checkpoint()).unwrap();
    let blocks = (node.engine.stats().checkpoint_bytes_written - before) / BLOCK;
    // 7,680 entries in blocks of 505, and the layer table's block.
    assert_eq!(blocks, 7680u64.div_ceil(505) + 1);
    let node = node.crash();
    for block in [0, 504, 505, 7679] {
        let (result, buf) =
            block_on(node.handles[0].read(map, block * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
        result.unwrap();
        assert!(block_matches(&buf, map.volume(), block, 1), "{}", describe_block(&buf));
    }
}

/// A due checkpoint sends commits down the group path only until one starts: while it streams
/// the index none counts as due, so commits go pipelined again instead of one group at a time;
/// writes made meanwhile are found after a crash.
#[test]
fn commits_pipeline_again_while_a_due_checkpoint_streams_the_index() {
    let node = Node::format(240, 29, 2, 1);
    let handle = &node.handles[0];
    let (_volumes, maps) = volume_maps(&[20_000]);
    let map = &maps[0];
    let volume = map.volume();
    map_blocks_for_a_long_checkpoint(handle, map);
    // As many segments sealed since the last checkpoint as make the next one due.
    node.engine
        .sealed_since_checkpoint
        .store(node.engine.geometry().segment_count, Ordering::Release);
    assert!(handle.checkpoint_due());
    let checkpoint_done = std::cell::Cell::new(false);
    let due_while_streaming = std::cell::Cell::new(None);
    beside_a_checkpoint(
        handle,
        &checkpoint_done,
        Box::pin(async {
            if !checkpoint_done.get() {
                due_while_streaming.set(Some(handle.checkpoint_due()));
            }
            let writes = (0..8u64).map(|number| -> LocalBoxFuture<'_, ()> {
                Box::pin(async move {
                    let block = 3000 + number;
                    let (result, _) =
                        handle.write(map, block * BLOCK, block_buf(volume, block, 1, 5)).await;
                    result.unwrap();
                })
            });
            join_all(writes.collect()).await;
        }),
    );
    assert_eq!(
        due_while_streaming.get(),
        Some(false),
        "a checkpoint under way still counted as due (None: it ended before the writers came)"
    );
    assert!(!handle.checkpoint_due(), "the checkpoint did not take the sealed count off");
    let node = node.crash();
    for number in 0..8u64 {
        let block = 3000 + number;
        let (result, buf) =
            block_on(node.handles[0].read(map, block * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
        result.unwrap();
        assert!(block_matches(&buf, volume, block, 5), "{}", describe_block(&buf));
    }
}

#[test]
fn deleted_volumes_stay_deleted_after_recovery() {
    let node = Node::format(48, 8, 1, 1);
    let (_volumes, maps) = volume_maps(&[100, 100]);
    let handle = &node.handles[0];
    for map in &maps {
        let (result, _) = block_on(handle.write(map, 0, block_buf(map.volume(), 0, 10, 5)));
        result.unwrap();
    }
    block_on(handle.delete_volume(maps[0].volume().0)).unwrap();
    assert_eq!(node.engine.stats().mapped_bytes, 10 * BLOCK);
    let node = node.crash();
    assert_eq!(node.engine.stats().mapped_bytes, 10 * BLOCK);
    let (result, buf) = block_on(node.handles[0].read(&maps[0], 0, AlignedBuf::new(BLOCK_BYTES)));
    result.unwrap();
    assert!(buf.iter().all(|b| *b == 0));
}

/// A node of four 1 TiB drives (8 MiB units: 131,071 segments of 32 MiB) starts: its
/// checkpoint, sized for the worst case, needs 777 segments, more than one root block lists.
#[test]
fn a_node_of_four_1_tib_drives_fits_its_checkpoint_in_the_root() {
    let size_bytes = 1u64 << 40;
    let config = LogConfig::for_drives(NodeUuid([9; 16]), size_bytes, 64);
    let geometry = super::format::Geometry::coded(
        4,
        size_bytes,
        config.unit_bytes,
        config.area_offset_bytes,
        ErasureScheme::NONE,
    )
    .unwrap();
    assert_eq!(geometry.unit_bytes(), 8 << 20);
    let engine = LogEngine::new(geometry, config, Arc::new(DriveLatches::new(4)));
    if let Err(error) = engine {
        panic!("a 4 x 1 TiB node is refused: {error}");
    }
}

#[test]
fn conformance_over_simulated_drives() {
    let drives = sim_drives(256, 11, 3);
    let log_config = LogConfig { handles_max: 3, ..config() };
    let check = crate::testing::CheckConfig { seed: 11, volume_blocks: 2500, ..Default::default() };
    let report = block_on(crate::testing::check_log_engine(|| drives.clone(), &log_config, &check));
    assert!(report.blocks_verified > 1000, "{report:?}");
    assert_eq!((report.restarts, report.crashes), (2, 2), "{report:?}");
    // Free segments were laid out while the writers took segments: zeros went into holes and
    // no write of theirs was lost to them (the verification above).
    assert!(report.laid_out_bytes > 0, "{report:?}");
    let zeroed: u64 = drives.iter().map(|drive| drive.stats().blocks_laid_out).sum();
    assert_eq!(zeroed * BLOCK, report.laid_out_bytes, "{report:?}");
}

/// On a log without parity a batch ends where its stripe chunk ends, so each is one O_DSYNC
/// write to one drive: concurrent single-block writers, round after round, cost one drive
/// write (and flush) per batch, not two for the batches that would straddle two drives.
#[test]
fn batches_end_at_stripe_chunk_boundaries() {
    const WRITERS: u64 = 24;
    const ROUNDS: u64 = 40;
    let node = Node::format(64, 13, 3, 1);
    let (_volumes, maps) = volume_maps(&[4_000]);
    let map = &maps[0];
    let volume = map.volume();
    let handle = &node.handles[0];
    for round in 0..ROUNDS {
        let writes: Vec<LocalBoxFuture<'_, ()>> = (0..WRITERS)
            .map(|number| -> LocalBoxFuture<'_, ()> {
                Box::pin(async move {
                    let block = (round * WRITERS + number) * 3 % 4_000;
                    let buf = block_buf(volume, block, 1, 1 + round);
                    let (result, _) = handle.write(map, block * BLOCK, buf).await;
                    result.unwrap();
                })
            })
            .collect();
        block_on(join_all(writes));
    }
    let stats = node.engine.stats();
    assert_eq!(stats.host_batch_blocks, WRITERS * ROUNDS);
    // Pipelined batches take one drive write each; only a batch that opens a segment or one
    // placed after a segment switch moved it may still take two (crossing chunks, these
    // writers took 163 writes for 80 batches).
    assert!(
        stats.drive_syncs * 10 <= stats.host_batches * 12,
        "{} drive writes for {} batches",
        stats.drive_syncs,
        stats.host_batches
    );
    for round_block in [0, 3, 3 * (WRITERS * ROUNDS - 1) % 4_000] {
        let (result, buf) =
            block_on(handle.read(map, round_block * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
        result.unwrap();
        assert!(!buf.iter().all(|byte| *byte == 0), "block {round_block} was written");
    }
}

#[test]
fn concurrent_writes_share_group_commits_and_single_block_reads_verify() {
    const WRITERS: u64 = 64;
    let node = Node::format(64, 11, 3, 1);
    let (_volumes, maps) = volume_maps(&[1_000]);
    let map = &maps[0];
    let volume = map.volume();
    let handle = &node.handles[0];
    let writes: Vec<LocalBoxFuture<'_, ()>> = (0..WRITERS)
        .map(|number| -> LocalBoxFuture<'_, ()> {
            Box::pin(async move {
                let buf = block_buf(volume, number * 3, 1, 5);
                let (result, _) = handle.write(map, number * 3 * BLOCK, buf).await;
                result.unwrap();
            })
        })
        .collect();
    block_on(join_all(writes));
    let stats = node.engine.stats();
    assert_eq!(stats.host_batch_blocks, WRITERS, "every write went through a batch");
    assert!(
        stats.host_batches * 4 <= WRITERS,
        "{} batches for {WRITERS} concurrent writes: group commit did not group",
        stats.host_batches
    );
    assert!(stats.drive_syncs >= stats.host_batches);
    for number in 0..WRITERS {
        for (block, tag) in [(number * 3, 5), (number * 3 + 1, 0)] {
            let (result, buf) =
                block_on(handle.read(map, block * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
            result.unwrap();
            assert!(
                block_matches(&buf, volume, block, tag),
                "block {block}: {}",
                describe_block(&buf)
            );
        }
    }
}

/// On a log without parity a handle has several batches in flight at once, and they are
/// installed in LSN order whatever order their writes complete in: in each round, writers of one
/// block arrive one after another while the earlier ones' batches are still being written, and
/// the block is left with the last one's data (seeds reorder the drives' completions).
#[test]
fn pipelined_batches_install_in_order_whatever_order_their_writes_complete() {
    const ROUNDS: u64 = 40;
    const WRITERS: u64 = 4;
    let mut pipelined_seeds = 0;
    for seed in 0..8u64 {
        let node = Node::format(64, seed, 12, 1);
        let (_volumes, maps) = volume_maps(&[64]);
        let map = &maps[0];
        let volume = map.volume();
        let handle = &node.handles[0];
        let read = |handle: &LogHandle<SimDrive>, block: u64| {
            let (result, buf) =
                block_on(handle.read(map, block * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
            result.unwrap();
            buf
        };
        for round in 0..ROUNDS {
            // Writer `number` arrives after `2 * number` yields, then writes a block of its own.
            let tag = |number: u64| round * WRITERS + number + 1;
            let writes: Vec<LocalBoxFuture<'_, ()>> = (0..WRITERS)
                .map(|number| -> LocalBoxFuture<'_, ()> {
                    Box::pin(async move {
                        for _ in 0..number * 2 {
                            crate::join::yield_now().await;
                        }
                        let shared = block_buf(volume, 0, 1, tag(number));
                        handle.write(map, 0, shared).await.0.unwrap();
                        let own = block_buf(volume, 1 + number, 1, tag(number));
                        handle.write(map, (1 + number) * BLOCK, own).await.0.unwrap();
                    })
                })
                .collect();
            block_on(join_all(writes));
            let last = read(handle, 0);
            assert!(
                block_matches(&last, volume, 0, tag(WRITERS - 1)),
                "seed {seed} round {round}: block 0 holds {}, not the last writer's",
                describe_block(&last)
            );
            for number in 0..WRITERS {
                assert!(block_matches(&read(handle, 1 + number), volume, 1 + number, tag(number)));
            }
        }
        let peak = node.drives.iter().map(|drive| drive.stats().mutations_in_flight_peak).max();
        if peak.unwrap_or(0) >= 2 {
            pipelined_seeds += 1;
        }
        // And the same after recovery.
        let node = node.crash();
        let last = read(&node.handles[0], 0);
        assert!(block_matches(&last, volume, 0, ROUNDS * WRITERS), "seed {seed} after a crash");
    }
    assert_eq!(
        pipelined_seeds, 8,
        "batches were in flight together in {pipelined_seeds} of 8 seeds"
    );
}

/// Writers larger than the batch queue take turns (first come, first served) while batches are
/// in flight, and none of them spins: a writer whose turn has not come waits to be woken. The
/// body runs on its own thread so a spin fails the test instead of hanging it.
#[test]
fn writers_beyond_a_full_batch_queue_wait_their_turn() {
    const WRITERS: u64 = 32;
    const BLOCKS: u64 = 100;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for seed in 0..8u64 {
            let node = Node::format(512, seed, 30, 1);
            let (_volumes, maps) = volume_maps(&[WRITERS * BLOCKS]);
            let map = &maps[0];
            let volume = map.volume();
            let handle = &node.handles[0];
            for round in 0..3u64 {
                let writes: Vec<LocalBoxFuture<'_, ()>> = (0..WRITERS)
                    .map(|number| -> LocalBoxFuture<'_, ()> {
                        Box::pin(async move {
                            let first = number * BLOCKS;
                            let buf = block_buf(volume, first, BLOCKS, round + 1);
                            handle.write(map, first * BLOCK, buf).await.0.unwrap();
                        })
                    })
                    .collect();
                block_on(join_all(writes));
            }
            for block in 0..WRITERS * BLOCKS {
                let (result, buf) =
                    block_on(handle.read(map, block * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
                result.unwrap();
                assert!(block_matches(&buf, volume, block, 3), "seed {seed} block {block}");
            }
        }
        let _ = done_tx.send(());
    });
    done_rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the writers finish (a writer spinning on the full queue never lets them)");
}

/// A one-thread node (drives yielding up to `yields_max` times per operation) with one volume
/// of 64 blocks whose block 63 was written, so the host stream's segment is open and the next
/// batches go pipelined.
fn pipelining_node(seed: u64, yields_max: u64) -> (Node, Volumes, Vec<Arc<VolumeMap>>) {
    let node = Node::format(64, seed, yields_max, 1);
    let (volumes, maps) = volume_maps(&[64]);
    let volume = maps[0].volume();
    let buf = block_buf(volume, 63, 1, 2);
    block_on(node.handles[0].write(&maps[0], 63 * BLOCK, buf)).0.unwrap();
    (node, volumes, maps)
}

/// Writers that arrive together while a batch is in flight share the next batch (one drive
/// write and one flush), as the writes of one replication frame or one socket read do: the
/// leader lets the other ready writers join before it takes the batch. Without that, each of
/// them took a batch of its own, up to the pipeline's depth.
#[test]
fn writers_arriving_together_beside_a_batch_in_flight_share_one_batch() {
    const WRITERS: u64 = 16;
    for seed in 0..6u64 {
        let (node, _volumes, maps) = pipelining_node(seed, 8);
        let map = &maps[0];
        let volume = map.volume();
        let handle = &node.handles[0];
        let before = node.engine.stats().host_batches;
        let writes: Vec<LocalBoxFuture<'_, ()>> = (0..=WRITERS)
            .map(|number| -> LocalBoxFuture<'_, ()> {
                Box::pin(async move {
                    // Writer 0 goes first; the others arrive together one poll later.
                    if number > 0 {
                        crate::join::yield_now().await;
                    }
                    let buf = block_buf(volume, number, 1, 3);
                    handle.write(map, number * BLOCK, buf).await.0.unwrap();
                })
            })
            .collect();
        block_on(join_all(writes));
        let batches = node.engine.stats().host_batches - before;
        // Writer 0's batch, then one for the rest (or, if writer 0's was durable before they
        // came, the first of them alone and one for the others).
        assert!(
            batches <= 3,
            "seed {seed}: {batches} batches for a first writer and {WRITERS} arriving together"
        );
        for number in 0..=WRITERS {
            let (result, buf) =
                block_on(handle.read(map, number * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
            result.unwrap();
            assert!(block_matches(&buf, volume, number, 3), "seed {seed} block {number}");
        }
    }
}

/// A batch that grows, beside a batch in flight, to the size of that batch goes at once: the
/// leader waiting for it is woken by the writer whose block makes it worth sending, not only
/// when the batch in flight completes. Before, it waited out every write in flight, so under a
/// fixed queue depth a thread alternated between forming a batch and writing one (the engine
/// alone, 4K random writes: 0.04 batches in flight when one was issued).
#[test]
fn a_queued_batch_grown_to_the_size_of_the_one_in_flight_goes_beside_it() {
    const FIRST_BLOCKS: u64 = 8;
    for seed in 0..4u64 {
        let (node, _volumes, maps) = pipelining_node(seed, 4);
        let map = &maps[0];
        let volume = map.volume();
        let handle = &node.handles[0];
        let peak = || node.drives.iter().map(|drive| drive.stats().mutations_in_flight_peak).max();
        assert_eq!(peak(), Some(1), "seed {seed}: one write at a time so far");
        for drive in &node.drives {
            drive.hold_writes();
        }
        let overlapped = Cell::new(false);
        let mut tasks: Vec<LocalBoxFuture<'_, ()>> = Vec::new();
        // A batch of FIRST_BLOCKS blocks, held in flight.
        tasks.push(Box::pin(async move {
            let buf = block_buf(volume, 0, FIRST_BLOCKS, 3);
            handle.write(map, 0, buf).await.0.unwrap();
        }));
        // Then as many single blocks, arriving one after the other while it is held.
        for number in 0..FIRST_BLOCKS {
            tasks.push(Box::pin(async move {
                for _ in 0..4 * (number + 1) {
                    crate::join::yield_now().await;
                }
                let block = 32 + number;
                handle.write(map, block * BLOCK, block_buf(volume, block, 1, 3)).await.0.unwrap();
            }));
        }
        // Watches for a second write in flight, then lets the drives complete everything.
        let overlapped = &overlapped;
        let drives = &node.drives;
        tasks.push(Box::pin(async move {
            for _ in 0..1000 {
                if peak() >= Some(2) {
                    overlapped.set(true);
                    break;
                }
                crate::join::yield_now().await;
            }
            for drive in drives {
                drive.release_writes();
            }
        }));
        block_on(join_all(tasks));
        assert!(
            overlapped.get(),
            "seed {seed}: the second batch waited for the first one's write to complete"
        );
        let read = |first: u64, count: u64| {
            let (result, buf) = block_on(handle.read(
                map,
                first * BLOCK,
                AlignedBuf::new(count as usize * BLOCK_BYTES),
            ));
            result.unwrap();
            buf
        };
        let first = read(0, FIRST_BLOCKS);
        for (index, block) in first.chunks(BLOCK_BYTES).enumerate() {
            assert!(block_matches(block, volume, index as u64, 3), "seed {seed} block {index}");
        }
        for number in 0..FIRST_BLOCKS {
            let block = 32 + number;
            assert!(block_matches(&read(block, 1), volume, block, 3), "seed {seed} block {block}");
        }
    }
}

/// Writes blocks `0..writes` one batch each (each write waits for the one before), damages
/// block `damaged` where it lives, restarts without a checkpoint between, and returns the
/// recovery's report and each block's read.
fn damage_a_replayed_batch(
    writes: u64,
    damaged: u64,
    scheme: ErasureScheme,
) -> (RecoveryReport, Vec<Result<bool, StoreError>>) {
    let config = LogConfig { checkpoint_interval_segments: 1_000, erasure: scheme, ..config() };
    let drive_count = if scheme == ErasureScheme::NONE { DRIVES } else { 4 };
    let drives = sim_drives_n(drive_count, 64, 8, 0);
    block_on(LogEngine::format(&drives, &config)).unwrap();
    let open = || open_drives(&drives, &config);
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let (engine, handle, _) = open();
    for number in 0..writes {
        let buf = block_buf(map.volume(), number, 1, 4);
        let (result, _) = block_on(handle.write(map, number * BLOCK, buf));
        result.unwrap();
    }
    let index = engine.index.get(map.volume().0).expect("the volume has an index");
    let (location, _) = super::index::unpack(index.get(damaged)).expect("the block is mapped");
    let (segment, position) = engine.geometry.split(location);
    // On a coded log also the stripe's padding cell after the block (a batch of one block is
    // its header, the block and a zero block), so that parity cannot rebuild the block.
    let cells = if engine.geometry.is_coded() { 2 } else { 1 };
    for cell in 0..cells {
        let (drive, offset_bytes) = engine.geometry.place(segment, position + cell);
        let mut bad = AlignedBuf::new(BLOCK_BYTES);
        bad.fill(0x5a);
        block_on(drives[usize::from(drive)].write_at(offset_bytes, bad)).0.unwrap();
    }
    drop((index, handle, engine));
    let (engine, handle, report) = open();
    assert_eq!(report.segments_replayed, 1, "{report:?}");
    let reads = (0..writes)
        .map(|number| {
            let buf = AlignedBuf::new(BLOCK_BYTES);
            let (result, buf) = block_on(handle.read(map, number * BLOCK, buf));
            result.map(|()| block_matches(&buf, map.volume(), number, 4))
        })
        .collect();
    let damaged_reads =
        u64::from(damaged < writes - super::recovery::UNFINISHED_BATCHES_MAX as u64);
    assert_eq!(engine.stats().checksum_errors, damaged_reads);
    (report, reads)
}

#[test]
fn a_block_damaged_in_a_replayed_segment_loses_only_itself() {
    // Bit rot in an acknowledged batch that eight batches follow: it cannot have been in
    // flight at the crash, so the batch is kept (its damaged block reads as an error, never
    // as its older contents) and the batches behind it are replayed.
    let writes = 12;
    let damaged = writes - 1 - super::recovery::UNFINISHED_BATCHES_MAX as u64;
    // The same on a coded log where the stripe cannot rebuild the block.
    for scheme in [ErasureScheme::NONE, ErasureScheme::new(3, 1).unwrap()] {
        let (report, reads) = damage_a_replayed_batch(writes, damaged, scheme);
        assert_eq!((report.batches_damaged, report.batches_torn), (1, 0), "{report:?}");
        for (number, read) in (0..writes).zip(reads) {
            if number == damaged {
                assert!(matches!(read, Err(StoreError::ChecksumMismatch { .. })), "{read:?}");
            } else {
                assert!(matches!(read, Ok(true)), "block {number}: {read:?}; {report:?}");
            }
        }
        // With one batch fewer behind it, the crash may have torn it (the batches behind it
        // in flight with it): it is dropped with them, as a tear is.
        let (report, reads) = damage_a_replayed_batch(writes, damaged + 1, scheme);
        assert_eq!((report.batches_damaged, report.batches_torn), (0, 1), "{report:?}");
        for (number, read) in (0..writes).zip(reads) {
            let kept = number <= damaged;
            assert!(matches!(read, Ok(matched) if matched == kept), "block {number}: {read:?}");
        }
    }
}

/// Writes blocks `0..4` of a volume one batch each, then, as a host could have left it in an
/// earlier use of the segment, puts a block shaped as the next batch header of the open
/// segment (the segment's current sequence, the next position and LSN, mapping block 0 to new
/// data) and that data right after the last batch, tagged with `key_of` the log's geometry;
/// restarts, and says whether block 0 then reads as the planted data.
fn plant_a_header_after_the_last_batch(key_of: fn(&Geometry) -> Geometry) -> bool {
    let config = LogConfig { checkpoint_interval_segments: 1_000, ..config() };
    let drives = sim_drives(64, 8, 0);
    block_on(LogEngine::format(&drives, &config)).unwrap();
    let open = || open_drives(&drives, &config);
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let (engine, handle, _) = open();
    for number in 0..4 {
        let (result, _) =
            block_on(handle.write(map, number * BLOCK, block_buf(map.volume(), number, 1, 4)));
        result.unwrap();
    }
    let geometry = engine.geometry;
    let index = engine.index.get(map.volume().0).expect("the volume has an index");
    let label = index.volume();
    let (location, _) = super::index::unpack(index.get(3)).expect("block 3 is mapped");
    let (segment, position) = geometry.split(location);
    // The last batch: its header right before its one block.
    let (drive, offset_bytes) = geometry.place(segment, position - 1);
    let (result, block) =
        block_on(drives[usize::from(drive)].read_at(offset_bytes, AlignedBuf::new(BLOCK_BYTES)));
    result.unwrap();
    let last = BatchHeader::decode(&block, &geometry, segment, position - 1).unwrap();
    let planted_data = block_buf(map.volume(), 0, 1, 99);
    let planted = BatchHeader {
        segment,
        segment_seq: last.segment_seq,
        position: position + 1,
        lsn: last.lsn + 1,
        entries: vec![Entry {
            volume: label,
            block: 0,
            kind: EntryKind::Data { crc: crc32c::crc32c(&planted_data) },
        }],
    };
    let mut header = AlignedBuf::new(BLOCK_BYTES);
    header.copy_from_slice(&planted.encode(&key_of(&geometry)));
    for (offset, bytes) in [(1, header), (2, planted_data)] {
        let (drive, offset_bytes) = geometry.place(segment, position + offset);
        block_on(drives[usize::from(drive)].write_at(offset_bytes, bytes)).0.unwrap();
    }
    drop((index, handle, engine));
    let (_engine, handle, report) = open();
    assert_eq!(report.segments_replayed, 1, "{report:?}");
    for number in 1..4 {
        let (result, buf) =
            block_on(handle.read(map, number * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
        result.unwrap();
        assert!(block_matches(&buf, map.volume(), number, 4), "block {number}");
    }
    let (result, buf) = block_on(handle.read(map, 0, AlignedBuf::new(BLOCK_BYTES)));
    result.unwrap();
    let replayed = block_matches(&buf, map.volume(), 0, 99);
    assert!(replayed || block_matches(&buf, map.volume(), 0, 4), "block 0 is one or the other");
    replayed
}

#[test]
fn a_header_shaped_block_without_the_logs_key_is_never_replayed() {
    // Made by anyone who knows the format but not this log's key (a host's data left in a
    // reused segment): recovery ends the segment's chain at it.
    let other_key = |geometry: &Geometry| geometry.with_header_key(!geometry.header_key);
    assert!(!plant_a_header_after_the_last_batch(other_key));
    // The same block tagged with the log's key is replayed: the plant is where recovery looks.
    assert!(plant_a_header_after_the_last_batch(|geometry| *geometry));
}
