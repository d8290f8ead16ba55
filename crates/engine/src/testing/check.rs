//! The conformance check of the log engine over any [`Drive`]: concurrent writers on several
//! handles against an oracle, with reads, write zeroes, deallocations and flushes; background GC
//! steps and checkpoints; clean restarts and crashes (every future in flight abandoned, as
//! kill -9 does), then recovery; and a deleted volume whose blocks must never reappear.
//! `engine` runs it over simulated drives, `io` over io_uring.
//!
//! Writers never touch the same block concurrently: the volume is cut into regions of
//! [`REGION_BLOCKS`] and writer `w` of `n` owns regions `r` with `r % n == w`. So the oracle is
//! exact: each block holds the last acknowledged mutation, or is undetermined if a mutation of
//! it was in flight at a crash (then it must hold zeros or a whole block written for it).

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use types::AlignedBuf;

use super::{block_matches, describe_block, fill_block, join_all, yield_now, LocalBoxFuture, Rng};
use crate::drive::Drive;
use crate::latches::DriveLatches;
use crate::local_sync::LocalNotify;
use crate::log::{LogConfig, LogEngine, LogHandle};
use crate::store::{StoreError, VolumeStore};
use crate::volumes::{VolumeId, VolumeMap};

const BLOCK_BYTES: u64 = types::BLOCK_SIZE_BYTES as u64;
/// A stride writers like to write across (a segment-sized run of some backends): some writes
/// straddle a multiple of it.
const STRIDE_BLOCKS: u64 = 2048;
/// Blocks per ownership region; deliberately not a divisor of [`STRIDE_BLOCKS`].
const REGION_BLOCKS: u64 = 1000;
/// Blocks per read when verifying a whole volume.
const VERIFY_READ_BLOCKS: u64 = 250;
/// Polls of the writers after which a crash round abandons them.
const CRASH_POLLS: u64 = 400;

const _: () = assert!(STRIDE_BLOCKS % REGION_BLOCKS != 0);

/// What to run.
#[derive(Debug, Clone)]
pub struct CheckConfig {
    pub seed: u64,
    /// Handles (data-path threads) the writers are spread over.
    pub handles: usize,
    pub writers_per_volume: usize,
    pub operations_per_writer: u32,
    /// Rounds of writers, each ended by a clean restart or (every other one) a crash.
    pub rounds: u32,
    /// The longest single I/O, in blocks.
    pub io_blocks_max: u64,
    /// Blocks per volume.
    pub volume_blocks: u64,
}

impl Default for CheckConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            handles: 2,
            writers_per_volume: 3,
            operations_per_writer: 120,
            rounds: 4,
            io_blocks_max: 16,
            volume_blocks: 6000,
        }
    }
}

/// What the check did; each backend's test may assert on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckReport {
    pub operations: u64,
    pub writes: u64,
    pub cross_stride_writes: u64,
    pub reads: u64,
    pub write_zeroes: u64,
    pub deallocates: u64,
    pub flushes: u64,
    pub restarts: u64,
    pub crashes: u64,
    pub gc_cleaned: u64,
    /// Zeros the background lay-out wrote over holes of free segments while writers ran.
    pub laid_out_bytes: u64,
    pub failed_operations: u64,
    pub blocks_verified: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct OracleBlock {
    /// The tag of the last acknowledged mutation; 0 for zeros.
    acked: u64,
    /// A mutation was started and has not completed (it was in flight at a crash).
    pending: bool,
    /// A mutation failed: the block may hold the old or the new content, or a mix.
    unknown: bool,
}

/// What every block of every volume must hold. Blocks never mutated are absent (zeros).
#[derive(Default)]
pub struct Oracle {
    blocks: RefCell<BTreeMap<(VolumeId, u64), OracleBlock>>,
    tag_next: Cell<u64>,
}

impl Oracle {
    pub fn new() -> Self {
        Self { blocks: RefCell::new(BTreeMap::new()), tag_next: Cell::new(1) }
    }

    fn next_tag(&self) -> u64 {
        let tag = self.tag_next.get();
        self.tag_next.set(tag + 1);
        tag
    }

    fn update(&self, volume: VolumeId, range: Range<u64>, change: impl Fn(&mut OracleBlock)) {
        let mut blocks = self.blocks.borrow_mut();
        for number in range {
            change(blocks.entry((volume, number)).or_default());
        }
    }

    fn begin(&self, volume: VolumeId, range: Range<u64>) {
        self.update(volume, range, |block| block.pending = true);
    }

    fn ack(&self, volume: VolumeId, range: Range<u64>, tag: u64) {
        self.update(volume, range, |block| {
            block.acked = tag;
            block.pending = false;
        });
    }

    fn fail(&self, volume: VolumeId, range: Range<u64>) {
        self.update(volume, range, |block| {
            block.pending = false;
            block.unknown = true;
        });
    }

    /// The tag a block must hold, or `None` if it is undetermined (a mutation of it failed, or
    /// was in flight when the test stopped).
    pub fn expected(&self, volume: VolumeId, number: u64) -> Option<u64> {
        match self.blocks.borrow().get(&(volume, number)) {
            None => Some(0),
            Some(block) if block.pending || block.unknown => None,
            Some(block) => Some(block.acked),
        }
    }

    /// Every block of a volume that was mutated, with its expected tag if determined.
    pub fn touched(&self, volume: VolumeId) -> Vec<(u64, Option<u64>)> {
        let blocks = self.blocks.borrow();
        let range = (volume, 0)..=(volume, u64::MAX);
        blocks
            .range(range)
            .map(|((_, number), _)| (*number, self.expected(volume, *number)))
            .collect()
    }
}

/// What one writer works on (see [`run_writer`]).
pub struct WriterContext<'a, S> {
    pub store: &'a S,
    pub map: &'a VolumeMap,
    pub oracle: &'a Oracle,
    pub report: &'a RefCell<CheckReport>,
    pub progress: &'a LocalNotify,
    /// With injected faults, failed I/O is expected: its blocks become undetermined.
    pub tolerate_errors: bool,
    pub io_blocks_max: u64,
}

impl<S> WriterContext<'_, S> {
    fn failed(&self, operation: &str, range: &Range<u64>, error: StoreError) {
        assert!(
            self.tolerate_errors,
            "{operation} of blocks {range:?} of {} failed: {error}",
            self.map.volume()
        );
        self.report.borrow_mut().failed_operations += 1;
    }
}

/// A range of blocks owned by `writer`, sometimes across a chunk boundary; `None` if the volume
/// is too small for this writer to own anything.
fn pick_range(
    rng: &mut Rng,
    size_blocks: u64,
    writer: u64,
    writers: u64,
    io_blocks_max: u64,
) -> Option<Range<u64>> {
    if size_blocks == 0 {
        return None;
    }
    let region_of =
        |region: u64| region * REGION_BLOCKS..((region + 1) * REGION_BLOCKS).min(size_blocks);
    let boundaries = (size_blocks - 1) / STRIDE_BLOCKS;
    if boundaries > 0 && rng.chance(1, 3) {
        let boundary = (1 + rng.below(boundaries)) * STRIDE_BLOCKS;
        let region = boundary / REGION_BLOCKS;
        let owned = region_of(region);
        let before = 1 + rng.below(3);
        let after = 1 + rng.below(3);
        if region % writers == writer
            && boundary - before >= owned.start
            && boundary + after <= owned.end
        {
            return Some(boundary - before..boundary + after);
        }
    }
    let regions = size_blocks.div_ceil(REGION_BLOCKS);
    if writer >= regions {
        return None;
    }
    let owned_count = (regions - writer - 1) / writers + 1;
    let owned = region_of(writer + writers * rng.below(owned_count));
    let start = owned.start + rng.below(owned.end - owned.start);
    let length = 1 + rng.below(io_blocks_max.min(owned.end - start));
    Some(start..start + length)
}

/// One writer: random mutations and verified reads of the blocks it owns.
pub async fn run_writer<S: VolumeStore>(
    context: &WriterContext<'_, S>,
    writer: usize,
    writers: usize,
    seed: u64,
    operations: u32,
) {
    let mut rng = Rng::new(seed);
    let volume = context.map.volume();
    let (store, map, oracle) = (context.store, context.map, context.oracle);
    for _ in 0..operations {
        let size_blocks = map.size_bytes() / BLOCK_BYTES;
        let picked =
            pick_range(&mut rng, size_blocks, writer as u64, writers as u64, context.io_blocks_max);
        if let Some(range) = picked {
            let offset_bytes = range.start * BLOCK_BYTES;
            let length_bytes = (range.end - range.start) * BLOCK_BYTES;
            match rng.below(100) {
                0..60 => {
                    let tag = oracle.next_tag();
                    let mut buf = AlignedBuf::new(length_bytes as usize);
                    for (number, block) in range.clone().zip(buf.chunks_mut(BLOCK_BYTES as usize)) {
                        fill_block(block, volume, number, tag);
                    }
                    oracle.begin(volume, range.clone());
                    let (result, _) = store.write(map, offset_bytes, buf).await;
                    match result {
                        Ok(()) => oracle.ack(volume, range.clone(), tag),
                        Err(error) => {
                            oracle.fail(volume, range.clone());
                            context.failed("write", &range, error);
                        }
                    }
                    let mut report = context.report.borrow_mut();
                    report.writes += 1;
                    if range.start / STRIDE_BLOCKS != (range.end - 1) / STRIDE_BLOCKS {
                        report.cross_stride_writes += 1;
                    }
                }
                60..85 => {
                    let buf = AlignedBuf::new(length_bytes as usize);
                    let (result, buf) = store.read(map, offset_bytes, buf).await;
                    match result {
                        Ok(()) => {
                            for (number, block) in
                                range.clone().zip(buf.chunks(BLOCK_BYTES as usize))
                            {
                                check_block(oracle, volume, number, block);
                            }
                        }
                        Err(error) => context.failed("read", &range, error),
                    }
                    context.report.borrow_mut().reads += 1;
                }
                85..95 => {
                    let deallocate = rng.chance(1, 2);
                    oracle.begin(volume, range.clone());
                    let result = if deallocate {
                        store.deallocate(map, offset_bytes, length_bytes).await
                    } else {
                        store.write_zeroes(map, offset_bytes, length_bytes).await
                    };
                    match result {
                        Ok(()) => oracle.ack(volume, range.clone(), 0),
                        Err(error) => {
                            oracle.fail(volume, range.clone());
                            context.failed("zeroing", &range, error);
                        }
                    }
                    let mut report = context.report.borrow_mut();
                    if deallocate {
                        report.deallocates += 1;
                    } else {
                        report.write_zeroes += 1;
                    }
                }
                _ => {
                    if let Err(error) = store.flush(map).await {
                        context.failed("flush", &range, error);
                    }
                    context.report.borrow_mut().flushes += 1;
                }
            }
        } else {
            yield_now().await;
        }
        context.report.borrow_mut().operations += 1;
        context.progress.notify_all();
    }
}

fn check_block(oracle: &Oracle, volume: VolumeId, number: u64, block: &[u8]) -> bool {
    let Some(tag) = oracle.expected(volume, number) else { return false };
    assert!(
        block_matches(block, volume, number, tag),
        "block {number} of {volume} must hold {}, but holds {}",
        if tag == 0 { "zeros".to_owned() } else { format!("tag {tag}") },
        describe_block(block)
    );
    true
}

/// Reads a whole volume and checks every determined block; returns how many were checked.
pub async fn verify_volume<S: VolumeStore>(store: &S, map: &VolumeMap, oracle: &Oracle) -> u64 {
    let size_blocks = map.size_bytes() / BLOCK_BYTES;
    let mut verified = 0;
    let mut start = 0;
    while start < size_blocks {
        let count = VERIFY_READ_BLOCKS.min(size_blocks - start);
        let buf = AlignedBuf::new((count * BLOCK_BYTES) as usize);
        let (result, buf) = store.read(map, start * BLOCK_BYTES, buf).await;
        if let Err(error) = result {
            panic!("verifying read of blocks {start}.. of {} failed: {error}", map.volume());
        }
        for (number, block) in (start..).zip(buf.chunks(BLOCK_BYTES as usize)) {
            verified += u64::from(check_block(oracle, map.volume(), number, block));
        }
        start += count;
    }
    verified
}

/// A node under test: the engine and its handles, each over its own drive handles.
struct Opened<D> {
    engine: Arc<LogEngine>,
    handles: Vec<LogHandle<D>>,
}

async fn open_node<D: Drive>(
    open_drives: &impl Fn() -> Vec<D>,
    config: &LogConfig,
    handles: usize,
) -> Opened<D> {
    let drive_count = u16::try_from(open_drives().len()).expect("at most 256 drives");
    let latches = Arc::new(DriveLatches::new(drive_count));
    let (engine, first, _report) = LogEngine::open(open_drives(), config.clone(), latches)
        .await
        .unwrap_or_else(|error| panic!("recovery failed: {error}"));
    let mut opened = Opened { engine, handles: vec![first] };
    for _ in 1..handles {
        opened.handles.push(opened.engine.handle(open_drives()));
    }
    opened
}

/// Polls `future` at most `polls_max` times, then drops it (a crash abandons what is in
/// flight); returns whether it finished.
async fn abandon_after<F: std::future::Future>(future: F, polls_max: u64) -> bool {
    let mut future = std::pin::pin!(future);
    let mut polls = 0;
    std::future::poll_fn(|context| {
        polls += 1;
        match future.as_mut().poll(context) {
            std::task::Poll::Ready(_) => std::task::Poll::Ready(true),
            std::task::Poll::Pending if polls >= polls_max => std::task::Poll::Ready(false),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    })
    .await
}

/// Reads every block a round touched: determined blocks must match exactly, undetermined ones
/// must hold zeros or a whole block some write produced for that very block.
async fn verify_all<S: VolumeStore>(store: &S, maps: &[Arc<VolumeMap>], oracle: &Oracle) -> u64 {
    let mut verified = 0;
    for map in maps {
        verified += verify_volume(store, map, oracle).await;
        for (number, expected) in oracle.touched(map.volume()) {
            if expected.is_some() {
                continue;
            }
            let buf = AlignedBuf::new(BLOCK_BYTES as usize);
            let (result, block) = store.read(map, number * BLOCK_BYTES, buf).await;
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

/// The conformance check of the log engine over any drive backend. `open_drives` returns fresh
/// handles on the same drives each time (one set per engine handle, reopened after every
/// restart); the drives are formatted here. Panics with a description of the first mismatch.
pub async fn check_log_engine<D: Drive>(
    open_drives: impl Fn() -> Vec<D>,
    log_config: &LogConfig,
    config: &CheckConfig,
) -> CheckReport {
    assert!(config.handles > 0 && config.writers_per_volume > 0 && config.io_blocks_max > 0);
    if let Err(error) = LogEngine::format(&open_drives(), log_config).await {
        panic!("format failed: {error}");
    }
    let oracle = Oracle::new();
    let report = RefCell::new(CheckReport::default());
    let size_bytes = config.volume_blocks * BLOCK_BYTES;
    let mut maps: Vec<Arc<VolumeMap>> =
        (1..=2).map(|id| VolumeMap::standalone(VolumeId(id), size_bytes)).collect();
    let mut next_id = 3;
    let mut verified = 0;
    let mut node = open_node(&open_drives, log_config, config.handles).await;
    for round in 0..config.rounds {
        let crash = round % 2 == 1;
        let progress = LocalNotify::new();
        let contexts: Vec<WriterContext<'_, LogHandle<D>>> = maps
            .iter()
            .enumerate()
            .flat_map(|(volume_index, map)| {
                let handles = &node.handles;
                let (oracle, report, progress) = (&oracle, &report, &progress);
                (0..config.writers_per_volume).map(move |writer| WriterContext {
                    store: &handles[(volume_index + writer) % handles.len()],
                    map,
                    oracle,
                    report,
                    progress,
                    tolerate_errors: false,
                    io_blocks_max: config.io_blocks_max,
                })
            })
            .collect();
        let writers = config.writers_per_volume;
        let mut futures: Vec<LocalBoxFuture<'_, ()>> = Vec::new();
        for (index, context) in contexts.iter().enumerate() {
            let writer = index % writers;
            let seed = config.seed ^ (u64::from(round) << 40) ^ (index as u64).rotate_left(29);
            futures.push(Box::pin(run_writer(
                context,
                writer,
                writers,
                seed,
                config.operations_per_writer,
            )));
        }
        // Background work alongside the writers, as the node's background task runs it.
        let background = &node.handles[0];
        let report_ref = &report;
        futures.push(Box::pin(async move {
            for step in 0..4 {
                yield_now().await;
                // Lay out the segments writers are about to take, while they take them.
                match background.lay_out_step().await {
                    Ok(Some(bytes)) => report_ref.borrow_mut().laid_out_bytes += bytes,
                    Ok(None) => {}
                    Err(error) => panic!("lay-out step: {error}"),
                }
                if step == 2 {
                    background.checkpoint().await.unwrap_or_else(|e| panic!("checkpoint: {e}"));
                }
                match background.gc_step().await {
                    Ok(crate::log::GcOutcome::Cleaned { .. }) => {
                        report_ref.borrow_mut().gc_cleaned += 1
                    }
                    Ok(_) => {}
                    Err(error) => panic!("gc step: {error}"),
                }
            }
        }));
        if crash {
            abandon_after(join_all(futures), CRASH_POLLS).await;
            report.borrow_mut().crashes += 1;
        } else {
            join_all(futures).await;
            verified += verify_all(&node.handles[0], &maps, &oracle).await;
            report.borrow_mut().restarts += 1;
        }
        drop(contexts);
        if round == 1 {
            // Delete volume 2 durably; its blocks must never come back, even after a crash.
            let deleted = maps.remove(1);
            deleted.mark_removed();
            node.handles[1 % node.handles.len()]
                .delete_volume(deleted.volume().0)
                .await
                .unwrap_or_else(|error| panic!("delete: {error}"));
            maps.push(VolumeMap::standalone(VolumeId(next_id), size_bytes));
            next_id += 1;
        }
        drop(node);
        node = open_node(&open_drives, log_config, config.handles).await;
        verified += verify_all(&node.handles[0], &maps, &oracle).await;
        // The deleted volume reads as zeros under its old id.
        let ghost = VolumeMap::standalone(VolumeId(2), size_bytes);
        let (result, buf) = node.handles[0]
            .read(&ghost, 0, AlignedBuf::new((VERIFY_READ_BLOCKS * BLOCK_BYTES) as usize))
            .await;
        result.unwrap_or_else(|error| panic!("reading the deleted volume: {error}"));
        if round >= 1 {
            let block_bytes = BLOCK_BYTES as usize;
            if let Some(position) = buf.iter().position(|byte| *byte != 0) {
                let at = position / block_bytes * block_bytes;
                panic!(
                    "round {round}: a deleted volume's block came back: {}",
                    describe_block(&buf[at..at + block_bytes])
                );
            }
        }
    }
    let stats = node.engine.stats();
    assert!(stats.failed_drives.is_empty(), "{stats:?}");
    let mut report = report.into_inner();
    report.blocks_verified = verified;
    assert_eq!(report.failed_operations, 0);
    assert!(report.cross_stride_writes > 0, "no write crossed a stride: {report:?}");
    assert!(report.write_zeroes > 0 && report.deallocates > 0, "{report:?}");
    report
}
