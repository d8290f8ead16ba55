//! The conformance check of [`ChunkStore`] over any [`Drive`]: concurrent writers against an
//! oracle, with reads, write zeroes, deallocations, flushes, grows while I/O runs, and a deleted
//! volume's chunks reused by a new one (which must read as zeros).
//!
//! Writers never touch the same block concurrently: the volume is cut into regions of
//! [`REGION_BLOCKS`] and writer `w` of `n` owns regions `r` with `r % n == w`. So the oracle is
//! exact: each block holds the last acknowledged mutation. Region size is not a divisor of the
//! chunk size, so some regions straddle a chunk boundary and their owners aim I/O across it.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use types::AlignedBuf;

use super::{block_matches, describe_block, fill_block, join_all, yield_now, LocalBoxFuture, Rng};
use crate::chunk_store::ChunkStore;
use crate::drive::Drive;
use crate::format::CHUNK_SIZE_BYTES;
use crate::layout::{VolumeId, VolumeMap, Volumes};
use crate::local_sync::LocalNotify;
use crate::store::{StoreError, VolumeStore};

const BLOCK_BYTES: u64 = types::BLOCK_SIZE_BYTES as u64;
const CHUNK_BLOCKS: u64 = CHUNK_SIZE_BYTES / BLOCK_BYTES;
/// Blocks per ownership region; deliberately not a divisor of [`CHUNK_BLOCKS`].
const REGION_BLOCKS: u64 = 1000;
/// Blocks per read when verifying a whole volume; not a divisor of [`CHUNK_BLOCKS`] either, so
/// verification reads cross chunk boundaries too.
const VERIFY_READ_BLOCKS: u64 = 250;
/// The first volume id the check uses; the `Volumes` given to it must not hold these ids.
const FIRST_VOLUME_ID: u64 = 1_000_001;

const _: () = assert!(CHUNK_BLOCKS % REGION_BLOCKS != 0);
const _: () = assert!(CHUNK_BLOCKS % VERIFY_READ_BLOCKS != 0);

/// What to run.
#[derive(Debug, Clone)]
pub struct CheckConfig {
    pub seed: u64,
    pub writers_per_volume: usize,
    pub operations_per_writer: u32,
    /// Grows of one volume while the writers of each of the two phases run.
    pub grows_per_phase: u32,
    /// The longest single I/O, in blocks.
    pub io_blocks_max: u64,
}

impl Default for CheckConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            writers_per_volume: 4,
            operations_per_writer: 150,
            grows_per_phase: 2,
            io_blocks_max: 16,
        }
    }
}

impl CheckConfig {
    /// The free chunks the check needs at its peak.
    pub fn chunks_needed(&self) -> u64 {
        let per_grow_phase = (u64::from(self.grows_per_phase) * 5).div_ceil(4) + 1;
        3 + 2 + 2 * per_grow_phase
    }
}

/// What the check did; each backend's test may assert on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckReport {
    pub operations: u64,
    pub writes: u64,
    pub cross_chunk_writes: u64,
    pub reads: u64,
    pub write_zeroes: u64,
    pub deallocates: u64,
    pub flushes: u64,
    pub grows: u64,
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
    let boundaries = (size_blocks - 1) / CHUNK_BLOCKS;
    if boundaries > 0 && rng.chance(1, 3) {
        let boundary = (1 + rng.below(boundaries)) * CHUNK_BLOCKS;
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
                    if range.start / CHUNK_BLOCKS != (range.end - 1) / CHUNK_BLOCKS {
                        report.cross_chunk_writes += 1;
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

/// Creates a volume the way the control plane must: reserve, zero the chunks, publish.
pub async fn create_volume<D: Drive>(
    store: &ChunkStore<D>,
    volumes: &Volumes,
    volume: VolumeId,
    size_bytes: u64,
) -> Arc<VolumeMap> {
    let layout = volumes
        .reserve_create(volume, size_bytes)
        .unwrap_or_else(|error| panic!("create {volume}: {error}"));
    if let Err(error) = store.zero_chunks(volumes.new_chunks(&layout)).await {
        panic!("zeroing the chunks of new {volume} failed: {error}");
    }
    volumes.publish(layout);
    volumes.mapping(volume).expect("published")
}

struct GrowPlan<'a> {
    map: &'a VolumeMap,
    grows: u32,
    /// Writer operations of the phase; grows are spread over them.
    operations_total: u64,
    seed: u64,
}

/// Grows a volume while writers run: reserve, zero the new chunks, publish.
async fn run_grower<D: Drive>(
    store: &ChunkStore<D>,
    volumes: &Volumes,
    plan: GrowPlan<'_>,
    report: &RefCell<CheckReport>,
    progress: &LocalNotify,
) {
    let mut rng = Rng::new(plan.seed);
    let operations_start = report.borrow().operations;
    for grow in 0..u64::from(plan.grows) {
        let threshold =
            operations_start + plan.operations_total * (grow + 1) / (u64::from(plan.grows) + 1);
        while report.borrow().operations < threshold {
            progress.notified().await;
        }
        let add_blocks = 1 + rng.below(CHUNK_BLOCKS * 5 / 4);
        let new_size_bytes = plan.map.size_bytes() + add_blocks * BLOCK_BYTES;
        let volume = plan.map.volume();
        let layout = volumes
            .reserve_grow(volume, new_size_bytes)
            .unwrap_or_else(|error| panic!("grow {volume}: {error}"));
        if let Err(error) = store.zero_chunks(volumes.new_chunks(&layout)).await {
            panic!("zeroing new chunks of {volume} failed: {error}");
        }
        volumes.publish(layout);
        assert_eq!(plan.map.size_bytes(), new_size_bytes, "a grow is visible to existing holders");
        report.borrow_mut().grows += 1;
    }
}

/// What every phase of the check shares.
struct Harness<'a, D> {
    store: &'a ChunkStore<D>,
    volumes: &'a Volumes,
    oracle: &'a Oracle,
    report: &'a RefCell<CheckReport>,
    config: &'a CheckConfig,
}

/// Runs writers on every volume and grows one of them, concurrently.
async fn run_phase<D: Drive>(
    harness: &Harness<'_, D>,
    maps: &[&VolumeMap],
    grown: &VolumeMap,
    seed: u64,
) {
    let Harness { store, volumes, oracle, report, config } = *harness;
    let progress = LocalNotify::new();
    let contexts: Vec<WriterContext<'_, ChunkStore<D>>> = maps
        .iter()
        .map(|map| WriterContext {
            store,
            map,
            oracle,
            report,
            progress: &progress,
            tolerate_errors: false,
            io_blocks_max: config.io_blocks_max,
        })
        .collect();
    let writers = config.writers_per_volume;
    let mut futures: Vec<LocalBoxFuture<'_, ()>> = Vec::new();
    for (volume_index, context) in contexts.iter().enumerate() {
        for writer in 0..writers {
            let writer_seed = seed ^ ((volume_index * writers + writer) as u64).rotate_left(32);
            let operations = config.operations_per_writer;
            futures.push(Box::pin(run_writer(context, writer, writers, writer_seed, operations)));
        }
    }
    let plan = GrowPlan {
        map: grown,
        grows: config.grows_per_phase,
        operations_total: (maps.len() * writers) as u64 * u64::from(config.operations_per_writer),
        seed: seed.rotate_left(17),
    };
    futures.push(Box::pin(run_grower(store, volumes, plan, report, &progress)));
    join_all(futures).await;
}

/// The conformance check of a [`ChunkStore`] over any drive backend. `volumes` describes the
/// store's drives and needs [`CheckConfig::chunks_needed`] free chunks; the check leaves it as
/// it found it. Panics with a description of the first mismatch.
pub async fn check_store<D: Drive>(
    store: &ChunkStore<D>,
    volumes: &Volumes,
    config: &CheckConfig,
) -> CheckReport {
    let capacity_before = volumes.capacity();
    assert!(
        capacity_before.free_chunks >= config.chunks_needed(),
        "check_store needs {} free chunks, the drives have {}",
        config.chunks_needed(),
        capacity_before.free_chunks
    );
    assert!(config.writers_per_volume > 0 && config.io_blocks_max > 0);
    let oracle = Oracle::new();
    let report = RefCell::new(CheckReport::default());
    let (a, b, c) =
        (VolumeId(FIRST_VOLUME_ID), VolumeId(FIRST_VOLUME_ID + 1), VolumeId(FIRST_VOLUME_ID + 2));

    let map_a = create_volume(store, volumes, a, 2 * CHUNK_SIZE_BYTES + 40 * BLOCK_BYTES).await;
    let map_b = create_volume(store, volumes, b, CHUNK_SIZE_BYTES + 1000 * BLOCK_BYTES).await;
    let harness = Harness { store, volumes, oracle: &oracle, report: &report, config };
    run_phase(&harness, &[&map_a, &map_b], &map_a, config.seed).await;
    let mut verified = verify_volume(store, &map_a, &oracle).await;
    verified += verify_volume(store, &map_b, &oracle).await;

    // Delete B and create C on its chunks: C must read as zeros everywhere.
    let chunks_of_b = volumes.layout(b).expect("b exists").chunks;
    volumes.remove(b);
    assert!(map_b.is_removed());
    let (result, _) = store.read(&map_b, 0, AlignedBuf::new(4096)).await;
    assert!(matches!(result, Err(StoreError::VolumeRemoved { .. })), "{result:?}");
    let map_c = create_volume(store, volumes, c, map_b.size_bytes()).await;
    let chunks_of_c = volumes.layout(c).expect("c exists").chunks;
    assert!(
        chunks_of_c.iter().any(|chunk| chunks_of_b.contains(chunk)),
        "the new volume reuses the deleted volume's chunks: {chunks_of_b:?} {chunks_of_c:?}"
    );
    verified += verify_volume(store, &map_c, &oracle).await;

    let phase_seed = config.seed.wrapping_add(0x5eed);
    run_phase(&harness, &[&map_a, &map_c], &map_c, phase_seed).await;
    verified += verify_volume(store, &map_a, &oracle).await;
    verified += verify_volume(store, &map_c, &oracle).await;

    volumes.remove(a);
    volumes.remove(c);
    assert_eq!(volumes.capacity(), capacity_before, "deleting every volume frees every chunk");
    let mut report = report.into_inner();
    report.blocks_verified = verified;
    assert_eq!(report.grows, 2 * u64::from(config.grows_per_phase));
    assert_eq!(report.failed_operations, 0);
    assert!(report.cross_chunk_writes > 0, "no write crossed a chunk boundary: {report:?}");
    assert!(report.write_zeroes > 0 && report.deallocates > 0, "{report:?}");
    report
}
