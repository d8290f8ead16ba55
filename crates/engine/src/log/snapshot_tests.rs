//! Snapshots, clones and rollbacks against an oracle: random operations on a few volumes,
//! with GC, checkpoints, clean restarts and power losses between them, every live volume and
//! snapshot read back in full after each step; and a snapshot taken while writes are in flight
//! holds exactly what crash consistency allows.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use types::AlignedBuf;

use super::format::{BLOCK_BYTES, LOG_HEADER_BYTES};
use super::index::LAYER_DEPTH_MAX;
use super::{LogConfig, LogEngine, LogError, LogHandle};
use crate::compress::Compression;
use crate::format::{NodeUuid, HEADER_REGION_BYTES};
use crate::latches::DriveLatches;
use crate::store::VolumeStore;
use crate::testing::{
    block_on, describe_block, fill_block, join_all, LocalBoxFuture, Rng, SimDrive,
};
use crate::volumes::{VolumeId, VolumeMap};

const UUID: NodeUuid = NodeUuid([0x5a; 16]);
const UNIT_BYTES: u64 = 64 << 10;
const DRIVES: u16 = 3;
const BLOCK: u64 = BLOCK_BYTES as u64;
/// Blocks per volume in the model test: small, so every step can read everything back.
const VOLUME_BLOCKS: u64 = 48;
/// The content of every block is `fill_block(.., CONTENT_VOLUME, block, tag)`.
const CONTENT_VOLUME: VolumeId = VolumeId(0);

fn config() -> LogConfig {
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

struct Node {
    drives: Vec<SimDrive>,
    engine: Arc<LogEngine>,
    handle: LogHandle<SimDrive>,
}

impl Node {
    fn format(segments: u64, seed: u64) -> Self {
        let size_bytes = HEADER_REGION_BYTES + LOG_HEADER_BYTES + segments * UNIT_BYTES;
        let drives: Vec<SimDrive> = (0..DRIVES)
            .map(|index| SimDrive::new(index, size_bytes, seed ^ u64::from(index), 3))
            .collect();
        block_on(LogEngine::format(&drives, &config())).unwrap();
        Self::open(drives)
    }

    fn open(drives: Vec<SimDrive>) -> Self {
        let latches = Arc::new(DriveLatches::new(DRIVES));
        let (engine, handle, _) =
            block_on(LogEngine::open(drives.clone(), config(), latches)).unwrap();
        Self { drives, engine, handle }
    }

    fn restart(self, power_loss: bool) -> Self {
        let drives = self.drives.clone();
        drop(self);
        if power_loss {
            for drive in &drives {
                drive.crash();
            }
        }
        Self::open(drives)
    }
}

/// What every live volume and snapshot must read: block -> tag (0 = zeros).
#[derive(Debug, Default, Clone)]
struct Model {
    volumes: BTreeMap<u64, Vec<u64>>,
    /// Snapshot id -> (volume it was taken of, contents).
    snapshots: BTreeMap<u64, (u64, Vec<u64>)>,
    next_id: u64,
    next_tag: u64,
}

impl Model {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        self.next_tag
    }
}

thread_local! {
    /// How the current test's writes are stored.
    static COMPRESSION: std::cell::Cell<Compression> = const { std::cell::Cell::new(Compression::Off) };
}

fn map(id: u64) -> Arc<VolumeMap> {
    let map = VolumeMap::standalone(VolumeId(id), VOLUME_BLOCKS * BLOCK);
    map.set_compression(COMPRESSION.with(|compression| compression.get()));
    map
}

fn verify(node: &Node, id: u64, expected: &[u64], what: &str) {
    let buf = AlignedBuf::new((VOLUME_BLOCKS * BLOCK) as usize);
    let (result, buf) = block_on(node.handle.read(&map(id), 0, buf));
    result.unwrap_or_else(|error| panic!("{what} {id}: read failed: {error}"));
    for (number, (block, tag)) in buf.chunks(BLOCK_BYTES).zip(expected).enumerate() {
        let mut want = [0u8; BLOCK_BYTES];
        fill_block(&mut want, CONTENT_VOLUME, number as u64, *tag);
        assert!(
            block == want,
            "{what} {id} block {number}: expected tag {tag}, found {}",
            describe_block(block)
        );
    }
}

fn verify_all(node: &Node, model: &Model, step: &str) {
    for (id, blocks) in &model.volumes {
        verify(node, *id, blocks, &format!("after {step}: volume"));
    }
    for (id, (_, blocks)) in &model.snapshots {
        verify(node, *id, blocks, &format!("after {step}: snapshot"));
    }
    // Every block a volume and a snapshot read differently is among the blocks the engine
    // says may differ (what a rollback by copying rewrites), whichever families they are of.
    for (volume, volume_blocks) in &model.volumes {
        for (snapshot, (_, snapshot_blocks)) in &model.snapshots {
            let differing = differing_blocks(node, *volume, *snapshot);
            assert!(differing.windows(2).all(|pair| pair[0] < pair[1]), "{differing:?}");
            for (block, (a, b)) in volume_blocks.iter().zip(snapshot_blocks).enumerate() {
                assert!(
                    a == b || differing.binary_search(&(block as u64)).is_ok(),
                    "after {step}: volume {volume} block {block} (tag {a}) differs from \
                     snapshot {snapshot} (tag {b}) but is not among {differing:?}"
                );
            }
        }
    }
}

/// Every block that may differ between `volume` and `snapshot`, asked a few at a time.
fn differing_blocks(node: &Node, volume: u64, snapshot: u64) -> Vec<u64> {
    let mut all = Vec::new();
    let mut from = Some(0);
    while let Some(start) = from {
        let (blocks, next) = node.engine.blocks_differing(volume, snapshot, start, 3).unwrap();
        assert!(blocks
            .iter()
            .all(|block| *block >= start && next.is_none_or(|next| *block < next)));
        assert!(next.is_none_or(|next| next > start), "no progress from {start}");
        all.extend(blocks);
        from = next;
    }
    all
}

fn write(node: &Node, id: u64, first: u64, tags: &[u64]) {
    let mut buf = AlignedBuf::new(tags.len() * BLOCK_BYTES);
    for ((number, block), tag) in (first..).zip(buf.chunks_mut(BLOCK_BYTES)).zip(tags) {
        fill_block(block, CONTENT_VOLUME, number, *tag);
    }
    let (result, _) = block_on(node.handle.write(&map(id), first * BLOCK, buf));
    result.unwrap();
}

fn run_model(seed: u64, steps: u32) {
    let mut rng = Rng::new(seed);
    let mut node = Node::format(160, seed);
    let mut model = Model::default();
    for _ in 0..2 {
        let id = model.id();
        model.volumes.insert(id, vec![0; VOLUME_BLOCKS as usize]);
    }
    for step in 0..steps {
        let volumes: Vec<u64> = model.volumes.keys().copied().collect();
        let snapshots: Vec<u64> = model.snapshots.keys().copied().collect();
        let volume = volumes[rng.below(volumes.len() as u64) as usize];
        let choice = rng.below(100);
        let label = match choice {
            0..=39 => {
                let first = rng.below(VOLUME_BLOCKS);
                let count = 1 + rng.below((VOLUME_BLOCKS - first).min(8));
                let tags: Vec<u64> = (0..count).map(|_| model.tag()).collect();
                write(&node, volume, first, &tags);
                let blocks = model.volumes.get_mut(&volume).unwrap();
                blocks[first as usize..(first + count) as usize].copy_from_slice(&tags);
                "write"
            }
            40..=49 => {
                let first = rng.below(VOLUME_BLOCKS);
                let count = 1 + rng.below(VOLUME_BLOCKS - first);
                block_on(node.handle.deallocate(&map(volume), first * BLOCK, count * BLOCK))
                    .unwrap();
                let blocks = model.volumes.get_mut(&volume).unwrap();
                blocks[first as usize..(first + count) as usize].fill(0);
                "trim"
            }
            50..=61 if model.snapshots.len() < 12 => {
                let snapshot = model.id();
                block_on(node.handle.snapshot_volume(volume, snapshot)).unwrap();
                let contents = model.volumes[&volume].clone();
                model.snapshots.insert(snapshot, (volume, contents));
                "snapshot"
            }
            62..=67 if !snapshots.is_empty() && model.volumes.len() < 6 => {
                let source = snapshots[rng.below(snapshots.len() as u64) as usize];
                let clone = model.id();
                block_on(node.handle.clone_volume(clone, source)).unwrap();
                let contents = model.snapshots[&source].1.clone();
                model.volumes.insert(clone, contents);
                "clone"
            }
            68..=72 => {
                let own: Vec<u64> = model
                    .snapshots
                    .iter()
                    .filter(|(_, (of, _))| *of == volume)
                    .map(|(id, _)| *id)
                    .collect();
                if own.is_empty() {
                    continue;
                }
                let target = own[rng.below(own.len() as u64) as usize];
                block_on(node.handle.rollback_volume(volume, target)).unwrap();
                let contents = model.snapshots[&target].1.clone();
                model.volumes.insert(volume, contents);
                "rollback"
            }
            73..=81 if !snapshots.is_empty() => {
                let snapshot = snapshots[rng.below(snapshots.len() as u64) as usize];
                block_on(node.handle.delete_volume(snapshot)).unwrap();
                model.snapshots.remove(&snapshot);
                "delete snapshot"
            }
            82..=84 if model.volumes.len() > 1 => {
                block_on(node.handle.delete_volume(volume)).unwrap();
                model.volumes.remove(&volume);
                "delete volume"
            }
            85..=89 => {
                for _ in 0..4 {
                    block_on(node.handle.gc_step()).unwrap();
                }
                "gc"
            }
            90..=93 => {
                block_on(node.handle.checkpoint()).unwrap();
                "checkpoint"
            }
            94..=96 => {
                node = node.restart(false);
                "restart"
            }
            97..=99 => {
                node = node.restart(true);
                "power loss"
            }
            _ => continue,
        };
        verify_all(&node, &model, &format!("step {step} ({label}, seed {seed:#x})"));
        if let Some(snapshot) = model.snapshots.keys().next() {
            // Snapshots stay read-only whatever restored them (checkpoint or replay).
            let mut buf = AlignedBuf::new(BLOCK_BYTES);
            fill_block(&mut buf, CONTENT_VOLUME, 0, 1);
            let (refused, _) = block_on(node.handle.write(&map(*snapshot), 0, buf));
            assert!(refused.is_err(), "step {step} ({label}): snapshot {snapshot} took a write");
        }
        let mapped: u64 = node.engine.stats().mapped_bytes / BLOCK;
        let stored: usize = model
            .volumes
            .values()
            .chain(model.snapshots.values().map(|(_, blocks)| blocks))
            .map(|blocks| blocks.iter().filter(|tag| **tag != 0).count())
            .sum();
        // Blocks of a layer kept only for several layers on it may be hidden by all of them:
        // garbage that GC drops when it cleans their segments, so only checked without such
        // layers.
        let hidden = node.engine.index.has_hidden_layers();
        assert!(
            hidden || mapped <= stored as u64,
            "step {step} ({label}, seed {seed:#x}): {mapped} blocks mapped but the model holds \
             only {stored} nonzero blocks (blocks shared by snapshots count once in the \
             engine); layers {:?}, mapped per layer {:?}",
            node.engine.index.layer_table(),
            node.engine
                .index
                .volumes()
                .iter()
                .map(|layer| (layer.volume(), layer.mapped_blocks()))
                .collect::<Vec<_>>()
        );
    }
    // Deleting everything frees everything.
    for snapshot in model.snapshots.keys() {
        block_on(node.handle.delete_volume(*snapshot)).unwrap();
    }
    for volume in model.volumes.keys() {
        block_on(node.handle.delete_volume(*volume)).unwrap();
    }
    assert_eq!(node.engine.stats().mapped_bytes, 0, "seed {seed:#x}: space leaked");
    let node = node.restart(true);
    assert_eq!(node.engine.stats().mapped_bytes, 0, "seed {seed:#x}: space leaked after recovery");
    assert!(node.engine.volume_ids().is_empty(), "seed {seed:#x}: ids left after deletion");
}

#[test]
fn snapshots_clones_and_rollbacks_match_the_model_across_restarts() {
    let seeds: u64 = std::env::var("FERRITE_SNAPSHOT_SEEDS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(12);
    for seed in 0..seeds {
        // Off, LZ4 and zstd in turn: packed blocks are shared and merged like raw ones.
        COMPRESSION.with(|compression| compression.set(Compression::ALL[(seed % 3) as usize]));
        run_model(0x5eed_0000 + seed, 260);
    }
}

#[test]
fn snapshot_space_is_shared_and_freed_through_deletion() {
    let node = Node::format(160, 7);
    let tags: Vec<u64> = (1..=VOLUME_BLOCKS).collect();
    write(&node, 1, 0, &tags);
    let mapped = |node: &Node| node.engine.stats().mapped_bytes / BLOCK;
    assert_eq!(mapped(&node), VOLUME_BLOCKS);
    block_on(node.handle.snapshot_volume(1, 2)).unwrap();
    assert_eq!(mapped(&node), VOLUME_BLOCKS, "a snapshot takes no space of its own");
    assert_eq!(node.engine.snapshot_exclusive_bytes(2), 0, "nothing overwritten yet");
    // Overwrite half: the snapshot now holds those old blocks alone.
    let half = VOLUME_BLOCKS / 2;
    let new_tags: Vec<u64> = (1000..1000 + half).collect();
    write(&node, 1, 0, &new_tags);
    assert_eq!(mapped(&node), VOLUME_BLOCKS + half);
    assert_eq!(node.engine.snapshot_exclusive_bytes(2), half * BLOCK);
    // What may differ between the volume and its snapshot is what was written since, only.
    let since: Vec<u64> = (0..half).collect();
    assert_eq!(differing_blocks(&node, 1, 2), since);
    assert_eq!(node.engine.blocks_differing(1, 2, 0, 5).unwrap(), ((0..5).collect(), Some(5)));
    assert_eq!(node.engine.blocks_differing(1, 2, 20, 5).unwrap(), ((20..half).collect(), None));
    assert!(node.engine.blocks_differing(1, 99, 0, 5).is_err(), "no snapshot 99");
    // A clone shares everything until written.
    block_on(node.handle.clone_volume(3, 2)).unwrap();
    assert_eq!(mapped(&node), VOLUME_BLOCKS + half);
    assert_eq!(node.engine.snapshot_exclusive_bytes(2), 0, "the clone reads all of it");
    // Deleting the snapshot keeps its blocks for the clone; deleting the clone frees them.
    block_on(node.handle.delete_volume(2)).unwrap();
    assert_eq!(mapped(&node), VOLUME_BLOCKS + half);
    let mut expected = tags.clone();
    verify(&node, 3, &expected, "clone after its snapshot was deleted");
    block_on(node.handle.delete_volume(3)).unwrap();
    assert_eq!(mapped(&node), VOLUME_BLOCKS, "the old half is garbage now");
    expected[..half as usize].copy_from_slice(&new_tags);
    verify(&node, 1, &expected, "volume");
    // GC can reclaim the freed blocks' segments.
    let node = node.restart(true);
    assert_eq!(mapped(&node), VOLUME_BLOCKS);
    verify(&node, 1, &expected, "volume after power loss");
}

/// A snapshot deleted while a clone and the volume both stand on it is kept for them; blocks
/// both have overwritten are garbage, and GC drops them instead of moving them.
#[test]
fn gc_drops_blocks_no_layer_can_read() {
    let mut node = Node::format(160, 11);
    let tags: Vec<u64> = (1..=VOLUME_BLOCKS).collect();
    write(&node, 1, 0, &tags);
    block_on(node.handle.snapshot_volume(1, 2)).unwrap();
    block_on(node.handle.clone_volume(3, 2)).unwrap();
    block_on(node.handle.delete_volume(2)).unwrap();
    assert!(node.engine.index.has_hidden_layers());
    // Both overwrite the first half: those original blocks are unreachable now.
    let half = VOLUME_BLOCKS / 2;
    let volume_tags: Vec<u64> = (1000..1000 + half).collect();
    let clone_tags: Vec<u64> = (2000..2000 + half).collect();
    write(&node, 1, 0, &volume_tags);
    write(&node, 3, 0, &clone_tags);
    let mapped = |node: &Node| node.engine.stats().mapped_bytes / BLOCK;
    assert_eq!(mapped(&node), VOLUME_BLOCKS + 2 * half);
    // Fill the log with churn on another volume so GC runs over the old segments.
    for round in 0..40u64 {
        let churn: Vec<u64> =
            (0..VOLUME_BLOCKS).map(|block| 10_000 + round * 100 + block).collect();
        write(&node, 9, 0, &churn);
        block_on(node.handle.gc_step()).unwrap();
        if round % 8 == 7 {
            block_on(node.handle.checkpoint()).unwrap();
        }
    }
    for _ in 0..200 {
        if mapped(&node) == 2 * VOLUME_BLOCKS + 2 * half - half {
            break;
        }
        block_on(node.handle.gc_step()).unwrap();
        block_on(node.handle.checkpoint()).unwrap();
    }
    // Volume 9 holds VOLUME_BLOCKS; 1 and 3 their own halves; the hidden layer the unwritten
    // half they share.
    assert_eq!(mapped(&node), VOLUME_BLOCKS + 2 * half + (VOLUME_BLOCKS - half));
    let mut expected = tags.clone();
    expected[..half as usize].copy_from_slice(&volume_tags);
    verify(&node, 1, &expected, "volume");
    expected[..half as usize].copy_from_slice(&clone_tags);
    verify(&node, 3, &expected, "clone");
    node = node.restart(true);
    verify(&node, 3, &expected, "clone after power loss");
    assert_eq!(mapped(&node), VOLUME_BLOCKS + 2 * half + (VOLUME_BLOCKS - half));
}

#[test]
fn snapshot_chains_are_bounded_and_bad_requests_refused() {
    let node = Node::format(160, 9);
    write(&node, 1, 0, &[5]);
    let mut next = 10;
    for _ in 0..LAYER_DEPTH_MAX - 1 {
        block_on(node.handle.snapshot_volume(1, next)).unwrap();
        next += 1;
    }
    let refused = block_on(node.handle.snapshot_volume(1, next)).unwrap_err();
    assert!(matches!(refused, LogError::Layer(_)), "{refused}");
    assert!(refused.to_string().contains("delete some of its snapshots"), "{refused}");
    // Reads through the whole chain still find the block written before it.
    verify(
        &node,
        1,
        &[5].iter().copied().chain([0; VOLUME_BLOCKS as usize - 1]).collect::<Vec<_>>(),
        "deep volume",
    );
    let unknown = block_on(node.handle.clone_volume(500, 499)).unwrap_err();
    assert!(unknown.to_string().contains("unknown"), "{unknown}");
    let in_use = block_on(node.handle.snapshot_volume(1, 10)).unwrap_err();
    assert!(in_use.to_string().contains("in use"), "{in_use}");
    let clone_over_volume = block_on(node.handle.clone_volume(1, 10)).unwrap_err();
    assert!(clone_over_volume.to_string().contains("in use"), "{clone_over_volume}");
    // Snapshots are read-only, across a restart too.
    let mut buf = AlignedBuf::new(BLOCK_BYTES);
    fill_block(&mut buf, CONTENT_VOLUME, 0, 99);
    let (refused, _) = block_on(node.handle.write(&map(10), 0, buf));
    assert!(refused.unwrap_err().to_string().contains("read-only"));
    let trimmed = block_on(node.handle.deallocate(&map(10), 0, BLOCK));
    assert!(trimmed.unwrap_err().to_string().contains("read-only"));
    let node = node.restart(true);
    let mut buf = AlignedBuf::new(BLOCK_BYTES);
    fill_block(&mut buf, CONTENT_VOLUME, 0, 99);
    let (refused, _) = block_on(node.handle.write(&map(10), 0, buf));
    assert!(refused.unwrap_err().to_string().contains("read-only"), "after recovery");
    // The volume itself stays writable.
    write(&node, 1, 1, &[6]);
}

/// Writers keep overwriting while a snapshot is taken: the snapshot holds, for each block, the
/// last write completed before the snapshot call began, or a write in flight during it; never
/// a write that began after it returned.
#[test]
fn a_snapshot_during_writes_is_crash_consistent() {
    for seed in 0..6u64 {
        let node = Node::format(200, 100 + seed);
        // Per block: tags completed, in order; tags started.
        let completed: RefCell<Vec<Vec<u64>>> = RefCell::new(vec![vec![0]; VOLUME_BLOCKS as usize]);
        let snapshot_window: RefCell<Option<(Vec<u64>, u64)>> = RefCell::new(None);
        let next_tag = RefCell::new(1u64);
        let taken = RefCell::new(false);
        let mut futures: Vec<LocalBoxFuture<'_, ()>> = Vec::new();
        for writer in 0..4u64 {
            let (node, completed, next_tag, taken) = (&node, &completed, &next_tag, &taken);
            futures.push(Box::pin(async move {
                let mut rng = Rng::new(seed * 31 + writer);
                for _ in 0..120 {
                    // Each block has one writer, so completion order is write order.
                    let block = rng.below(VOLUME_BLOCKS / 4) * 4 + writer;
                    let tag = {
                        let mut next = next_tag.borrow_mut();
                        *next += 1;
                        *next
                    };
                    let mut buf = AlignedBuf::new(BLOCK_BYTES);
                    fill_block(&mut buf, CONTENT_VOLUME, block, tag);
                    let (result, _) = node.handle.write(&map(1), block * BLOCK, buf).await;
                    result.unwrap();
                    completed.borrow_mut()[block as usize].push(tag);
                    if *taken.borrow() && rng.below(4) == 0 {
                        crate::join::yield_now().await;
                    }
                }
            }));
        }
        {
            let (node, completed, next_tag, window, taken) =
                (&node, &completed, &next_tag, &snapshot_window, &taken);
            futures.push(Box::pin(async move {
                for _ in 0..40 {
                    crate::join::yield_now().await;
                }
                // What had completed when the snapshot began, and the first tag handed out
                // after it returned.
                let before: Vec<u64> =
                    completed.borrow().iter().map(|tags| *tags.last().unwrap()).collect();
                node.handle.snapshot_volume(1, 2).await.unwrap();
                *taken.borrow_mut() = true;
                *window.borrow_mut() = Some((before, *next_tag.borrow() + 1));
            }));
        }
        block_on(join_all(futures));
        let (before, first_after) = snapshot_window.borrow().clone().expect("snapshot taken");
        let buf = AlignedBuf::new((VOLUME_BLOCKS * BLOCK) as usize);
        let (result, buf) = block_on(node.handle.read(&map(2), 0, buf));
        result.unwrap();
        let completed = completed.borrow();
        for (number, block) in buf.chunks(BLOCK_BYTES).enumerate() {
            let history = &completed[number];
            let floor = before[number];
            let floor_at = history.iter().position(|tag| *tag == floor).unwrap();
            let allowed: Vec<u64> = history[floor_at..]
                .iter()
                .copied()
                .filter(|tag| *tag == floor || *tag < first_after)
                .collect();
            let matched = allowed.iter().any(|tag| {
                let mut want = [0u8; BLOCK_BYTES];
                fill_block(&mut want, CONTENT_VOLUME, number as u64, *tag);
                block == want
            });
            assert!(
                matched,
                "seed {seed} block {number}: snapshot holds {} but only tags {allowed:?} are \
                 allowed (completed before: {floor})",
                describe_block(block)
            );
        }
        // The volume itself holds the last completed write of every block.
        let last: Vec<u64> = completed.iter().map(|tags| *tags.last().unwrap()).collect();
        verify(&node, 1, &last, "volume after the writers");
    }
}
