//! Hot path. The RAM index: for every 4 KiB block of every volume, where its current version
//! lives in the log and its CRC-32C, in one atomic 8-byte word.
//!
//! A volume's entries sit in a four-level radix tree (256 x 1024 x 1024 x 1024 = 2^38 blocks,
//! the largest volume). Only the root is allocated with the volume; inner tables and 8 KiB leaves
//! (1024 entries, 4 MiB of volume) are allocated when a block under them is first written, so a
//! thin volume costs what it maps. Lookups are atomic loads; host writes install with a swap,
//! GC with a compare-and-swap against the location it copied from, so a relocated copy never
//! replaces a newer write. Leaves are never freed while the volume exists (a leaf whose blocks
//! were all deallocated stays, 8 KiB per 4 MiB of volume).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use super::format::VOLUME_BLOCKS_MAX;

/// Entries per leaf, and children per inner table.
pub const LEAF_ENTRIES: usize = 1024;
pub const INNER_FANOUT: usize = 1024;
/// Children of a volume's root table.
pub const ROOT_FANOUT: usize = 256;

const _: () =
    assert!((ROOT_FANOUT * INNER_FANOUT * INNER_FANOUT * LEAF_ENTRIES) as u64 == VOLUME_BLOCKS_MAX);

/// An index entry: 0 is unmapped; otherwise the low half is the location plus one and the high
/// half the block's CRC-32C.
pub fn pack(location: u32, crc: u32) -> u64 {
    assert!(location < u32::MAX, "location u32::MAX is never used");
    (u64::from(crc) << 32) | u64::from(location + 1)
}

/// The (location, crc) of a mapped entry.
pub fn unpack(entry: u64) -> Option<(u32, u32)> {
    (entry != 0).then(|| ((entry as u32).wrapping_sub(1), (entry >> 32) as u32))
}

struct Leaf([AtomicU64; LEAF_ENTRIES]);

struct Inner<T>(Box<[OnceLock<Box<T>>]>);

impl<T> Inner<T> {
    fn new(fanout: usize) -> Self {
        Self((0..fanout).map(|_| OnceLock::new()).collect())
    }
}

type Level2 = Inner<Leaf>;
type Level1 = Inner<Level2>;

const LEAF_BYTES: u64 = std::mem::size_of::<Leaf>() as u64;
const INNER_BYTES: u64 = (INNER_FANOUT * std::mem::size_of::<OnceLock<Box<Leaf>>>()) as u64;

/// The entries of one volume.
pub struct VolumeIndex {
    volume: u64,
    root: Inner<Level1>,
    mapped_blocks: AtomicU64,
    allocated_bytes: AtomicU64,
    removed: AtomicBool,
}

impl std::fmt::Debug for VolumeIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeIndex")
            .field("volume", &self.volume)
            .field("mapped_blocks", &self.mapped_blocks())
            .finish()
    }
}

fn split(block: u64) -> [usize; 4] {
    assert!(block < VOLUME_BLOCKS_MAX, "block {block} beyond the largest volume");
    let block = block as usize;
    [
        block / (LEAF_ENTRIES * INNER_FANOUT * INNER_FANOUT),
        block / (LEAF_ENTRIES * INNER_FANOUT) % INNER_FANOUT,
        block / LEAF_ENTRIES % INNER_FANOUT,
        block % LEAF_ENTRIES,
    ]
}

impl VolumeIndex {
    fn new(volume: u64) -> Self {
        let root = Inner::new(ROOT_FANOUT);
        let root_bytes = (ROOT_FANOUT * std::mem::size_of::<OnceLock<Box<Level1>>>()) as u64;
        Self {
            volume,
            root,
            mapped_blocks: AtomicU64::new(0),
            allocated_bytes: AtomicU64::new(std::mem::size_of::<Self>() as u64 + root_bytes),
            removed: AtomicBool::new(false),
        }
    }

    pub fn volume(&self) -> u64 {
        self.volume
    }

    pub fn mapped_blocks(&self) -> u64 {
        self.mapped_blocks.load(Ordering::Relaxed)
    }

    /// RAM held by this volume's tables.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes.load(Ordering::Relaxed)
    }

    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    fn leaf(&self, block: u64) -> Option<(&Leaf, usize)> {
        let [a, b, c, d] = split(block);
        let level1 = self.root.0[a].get()?;
        let level2 = level1.0[b].get()?;
        Some((level2.0[c].get()?, d))
    }

    fn leaf_or_create(&self, block: u64) -> (&Leaf, usize) {
        let [a, b, c, d] = split(block);
        let level1 = self.root.0[a].get_or_init(|| {
            self.allocated_bytes.fetch_add(INNER_BYTES, Ordering::Relaxed);
            Box::new(Inner::new(INNER_FANOUT))
        });
        let level2 = level1.0[b].get_or_init(|| {
            self.allocated_bytes.fetch_add(INNER_BYTES, Ordering::Relaxed);
            Box::new(Inner::new(INNER_FANOUT))
        });
        let leaf = level2.0[c].get_or_init(|| {
            self.allocated_bytes.fetch_add(LEAF_BYTES, Ordering::Relaxed);
            Box::new(Leaf(std::array::from_fn(|_| AtomicU64::new(0))))
        });
        (leaf, d)
    }

    /// The entry of a block (0 if unmapped).
    pub fn get(&self, block: u64) -> u64 {
        self.leaf(block).map_or(0, |(leaf, slot)| leaf.0[slot].load(Ordering::Acquire))
    }

    fn count(&self, old: u64, new: u64) {
        match (old == 0, new == 0) {
            (true, false) => self.mapped_blocks.fetch_add(1, Ordering::Relaxed),
            (false, true) => self.mapped_blocks.fetch_sub(1, Ordering::Relaxed),
            _ => 0,
        };
    }

    /// Installs `new` for a block and returns the entry it replaced.
    pub fn swap(&self, block: u64, new: u64) -> u64 {
        let old = if new == 0 {
            match self.leaf(block) {
                Some((leaf, slot)) => leaf.0[slot].swap(0, Ordering::AcqRel),
                None => 0,
            }
        } else {
            let (leaf, slot) = self.leaf_or_create(block);
            leaf.0[slot].swap(new, Ordering::AcqRel)
        };
        self.count(old, new);
        old
    }

    /// Installs `new` only if the entry still is `expected` (both mapped).
    pub fn compare_exchange(&self, block: u64, expected: u64, new: u64) -> bool {
        assert!(expected != 0 && new != 0, "compare_exchange moves mapped blocks only");
        let Some((leaf, slot)) = self.leaf(block) else { return false };
        leaf.0[slot].compare_exchange(expected, new, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Unmaps blocks `first..first + count`, calling `visit(old)` for each entry that was
    /// mapped. Skips subtrees that were never allocated, so a huge deallocation of a thin volume
    /// costs what it maps.
    pub fn unmap_range(&self, first: u64, count: u64, mut visit: impl FnMut(u64)) {
        let end = first.saturating_add(count).min(VOLUME_BLOCKS_MAX);
        let mut block = first;
        while block < end {
            let leaf_end = ((block / LEAF_ENTRIES as u64) + 1) * LEAF_ENTRIES as u64;
            let run_end = leaf_end.min(end);
            match self.leaf(block) {
                Some((leaf, slot)) => {
                    for entry in &leaf.0[slot..slot + (run_end - block) as usize] {
                        let old = entry.swap(0, Ordering::AcqRel);
                        if old != 0 {
                            self.mapped_blocks.fetch_sub(1, Ordering::Relaxed);
                            visit(old);
                        }
                    }
                    block = run_end;
                }
                None => {
                    // Skip the whole absent subtree at the highest level that is absent.
                    let [a, b, _, _] = split(block);
                    let span = match self.root.0[a].get() {
                        None => (LEAF_ENTRIES * INNER_FANOUT * INNER_FANOUT) as u64,
                        Some(level1) if level1.0[b].get().is_none() => {
                            (LEAF_ENTRIES * INNER_FANOUT) as u64
                        }
                        Some(_) => LEAF_ENTRIES as u64,
                    };
                    block = ((block / span) + 1) * span;
                }
            }
        }
    }

    /// Appends up to `limit` mapped `(block, entry)` pairs at or after block `from`, in block
    /// order; returns where to continue, or `None` when the volume is exhausted. Lets a
    /// checkpoint stream the index without holding it all in a second copy.
    pub fn collect_mapped(
        &self,
        from: u64,
        limit: usize,
        out: &mut Vec<(u64, u64)>,
    ) -> Option<u64> {
        let mut block = from;
        let mut taken = 0;
        while block < VOLUME_BLOCKS_MAX {
            match self.leaf(block) {
                Some((leaf, slot)) => {
                    let leaf_base = block - slot as u64;
                    for (offset, entry) in leaf.0.iter().enumerate().skip(slot) {
                        if taken == limit {
                            return Some(leaf_base + offset as u64);
                        }
                        let entry = entry.load(Ordering::Acquire);
                        if entry != 0 {
                            out.push((leaf_base + offset as u64, entry));
                            taken += 1;
                        }
                    }
                    block = leaf_base + LEAF_ENTRIES as u64;
                }
                None => {
                    let [a, b, _, _] = split(block);
                    let span = match self.root.0[a].get() {
                        None => (LEAF_ENTRIES * INNER_FANOUT * INNER_FANOUT) as u64,
                        Some(level1) if level1.0[b].get().is_none() => {
                            (LEAF_ENTRIES * INNER_FANOUT) as u64
                        }
                        Some(_) => LEAF_ENTRIES as u64,
                    };
                    block = ((block / span) + 1) * span;
                }
            }
        }
        None
    }

    /// Calls `visit(block, entry)` for every mapped block, in block order.
    pub fn for_each_mapped(&self, mut visit: impl FnMut(u64, u64)) {
        for (a, level1) in self.root.0.iter().enumerate() {
            let Some(level1) = level1.get() else { continue };
            for (b, level2) in level1.0.iter().enumerate() {
                let Some(level2) = level2.get() else { continue };
                for (c, leaf) in level2.0.iter().enumerate() {
                    let Some(leaf) = leaf.get() else { continue };
                    let base = (((a * INNER_FANOUT + b) * INNER_FANOUT + c) * LEAF_ENTRIES) as u64;
                    for (d, entry) in leaf.0.iter().enumerate() {
                        let entry = entry.load(Ordering::Acquire);
                        if entry != 0 {
                            visit(base + d as u64, entry);
                        }
                    }
                }
            }
        }
    }
}

/// Every volume's entries. The map of volumes takes a lock only to add or remove a volume or
/// when a data-path thread first meets a volume; threads cache the `Arc`s they use.
#[derive(Default)]
pub struct Index {
    volumes: RwLock<HashMap<u64, Arc<VolumeIndex>>>,
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index").field("volumes", &self.volume_count()).finish()
    }
}

impl Index {
    pub fn get(&self, volume: u64) -> Option<Arc<VolumeIndex>> {
        self.volumes.read().unwrap_or_else(|e| e.into_inner()).get(&volume).cloned()
    }

    pub fn get_or_create(&self, volume: u64) -> Arc<VolumeIndex> {
        if let Some(index) = self.get(volume) {
            return index;
        }
        let mut volumes = self.volumes.write().unwrap_or_else(|e| e.into_inner());
        Arc::clone(volumes.entry(volume).or_insert_with(|| Arc::new(VolumeIndex::new(volume))))
    }

    /// Forgets a volume; holders of its `Arc` see `is_removed`.
    pub fn remove(&self, volume: u64) -> Option<Arc<VolumeIndex>> {
        let removed = self.volumes.write().unwrap_or_else(|e| e.into_inner()).remove(&volume);
        if let Some(index) = &removed {
            index.removed.store(true, Ordering::Release);
        }
        removed
    }

    /// Every volume, in id order.
    pub fn volumes(&self) -> Vec<Arc<VolumeIndex>> {
        let mut volumes: Vec<_> =
            self.volumes.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        volumes.sort_by_key(|index| index.volume);
        volumes
    }

    pub fn volume_count(&self) -> usize {
        self.volumes.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn mapped_blocks(&self) -> u64 {
        self.volumes().iter().map(|index| index.mapped_blocks()).sum()
    }

    /// RAM held by every volume's tables.
    pub fn allocated_bytes(&self) -> u64 {
        self.volumes().iter().map(|index| index.allocated_bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_pack_location_and_crc() {
        assert_eq!(unpack(0), None);
        assert_eq!(unpack(pack(0, 0)), Some((0, 0)));
        assert_eq!(unpack(pack(u32::MAX - 1, u32::MAX)), Some((u32::MAX - 1, u32::MAX)));
    }

    #[test]
    fn swap_and_compare_exchange_keep_counts() {
        let index = Index::default();
        let volume = index.get_or_create(9);
        assert_eq!(volume.get(5), 0);
        assert_eq!(volume.swap(5, pack(1, 2)), 0);
        assert_eq!(volume.swap(VOLUME_BLOCKS_MAX - 1, pack(3, 4)), 0);
        assert_eq!(volume.mapped_blocks(), 2);
        assert!(!volume.compare_exchange(5, pack(9, 9), pack(7, 2)), "stale expectation");
        assert!(volume.compare_exchange(5, pack(1, 2), pack(7, 2)));
        assert_eq!(volume.get(5), pack(7, 2));
        assert_eq!(volume.swap(5, 0), pack(7, 2));
        assert_eq!(volume.swap(6, 0), 0, "unmapping an unmapped block");
        assert_eq!(volume.mapped_blocks(), 1);
        let mut seen = Vec::new();
        volume.for_each_mapped(|block, entry| seen.push((block, entry)));
        assert_eq!(seen, [(VOLUME_BLOCKS_MAX - 1, pack(3, 4))]);
        volume.swap(2000, pack(5, 5));
        volume.swap(1 << 31, pack(6, 6));
        let mut unmapped = Vec::new();
        volume.unmap_range(1000, VOLUME_BLOCKS_MAX, |old| unmapped.push(old));
        assert_eq!(unmapped, [pack(5, 5), pack(6, 6), pack(3, 4)]);
        assert_eq!(volume.mapped_blocks(), 0);
        let mut chunk = Vec::new();
        assert_eq!(volume.collect_mapped(0, 10, &mut chunk), None);
        assert!(chunk.is_empty());
        for block in [3, 1023, 1024, 5000, 1 << 32] {
            volume.swap(block, pack(block as u32, 0));
        }
        let mut next = Some(0);
        let mut pages = 0;
        while let Some(from) = next {
            next = volume.collect_mapped(from, 2, &mut chunk);
            pages += 1;
        }
        let blocks: Vec<u64> = chunk.iter().map(|(block, _)| *block).collect();
        assert_eq!(blocks, [3, 1023, 1024, 5000, 1 << 32]);
        assert!(pages >= 3);
        let held = index.remove(9).unwrap();
        assert!(held.is_removed());
        assert!(index.get(9).is_none());
    }

    /// The figure the design targets: at most 8 bytes of RAM per mapped block once a volume is
    /// densely written, and a bounded overhead for scattered writes.
    #[test]
    fn ram_per_mapped_block() {
        let index = Index::default();
        let dense = index.get_or_create(1);
        let blocks = 1 << 18; // 1 GiB of volume.
        for block in 0..blocks {
            dense.swap(block, pack(block as u32, 0));
        }
        let dense_bytes = dense.allocated_bytes() as f64 / blocks as f64;
        assert!(dense_bytes <= 8.2, "{dense_bytes} bytes per densely mapped block");
        let sparse = index.get_or_create(2);
        let mut state = 1u64;
        for _ in 0..blocks {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            // Random blocks over a 4 GiB volume: a quarter of each leaf is mapped.
            sparse.swap((state >> 20) % (4 * blocks), pack(1, 1));
        }
        let sparse_bytes = sparse.allocated_bytes() as f64 / sparse.mapped_blocks() as f64;
        assert!(sparse_bytes < 40.0, "{sparse_bytes} bytes per sparsely mapped block");
        println!(
            "RAM per mapped block: {dense_bytes:.3} bytes dense, {sparse_bytes:.2} bytes at 22% \
             random fill"
        );
    }
}
