//! Hot path. The RAM index: for every 4 KiB block of every volume, where its current version
//! lives in the log and 29 bits of its CRC-32C, in 62 bits of RAM.
//!
//! Snapshots and clones are layers: each [`VolumeIndex`] is a layer named by a label, with an
//! optional parent layer. A lookup that finds nothing in a layer continues in its parent, so a
//! snapshot freezes the volume's layer and gives the volume a new, empty layer on top (O(1)), and
//! a clone is a new layer over a snapshot's. Every block in the log belongs to exactly one layer
//! (the label its batch entry names), so GC and live counts need no reference counts. The
//! [`LayerTable`] says which external id (volume or snapshot) is bound to which layer; it changes
//! only through the log entries of `engine::apply`.
//!
//! A volume's entries sit in a four-level radix tree (256 x 1024 x 1024 x 1024 = 2^38 blocks,
//! the largest volume). Only the root is allocated with the volume; inner tables and leaves
//! (1024 entries, 4 MiB of volume, 7,944 bytes) are allocated when a block under them is first
//! written, so a thin volume costs what it maps. Leaves are never freed while the volume exists
//! (a leaf whose blocks were all deallocated stays).
//!
//! Entries are handed around as `u64` values ([`pack`]) but a leaf stores each in 62 bits, packed
//! back to back in 64-bit words, so that the index with its tables costs less than 8 bytes per
//! mapped block (the design's figure; 8-byte entries alone would already reach it). An entry may
//! straddle two words, so a leaf is a sequence lock: lookups read without writing anything and
//! retry if a writer changed the leaf meanwhile; writers (host installs with a swap, GC with a
//! compare-and-swap against the location it copied from, so a relocated copy never replaces a
//! newer write) take the leaf's version word for the few instructions of the update. Two threads
//! contend only on the same 4 MiB of one volume at the same instant; nothing global is locked.

use std::collections::HashMap;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use arc_swap::ArcSwapOption;

use super::format::VOLUME_BLOCKS_MAX;

/// Entries per leaf, and children per inner table.
pub const LEAF_ENTRIES: usize = 1024;
pub const INNER_FANOUT: usize = 1024;
/// Children of a volume's root table.
pub const ROOT_FANOUT: usize = 256;

const _: () =
    assert!((ROOT_FANOUT * INNER_FANOUT * INNER_FANOUT * LEAF_ENTRIES) as u64 == VOLUME_BLOCKS_MAX);

/// Bits of a tag: an index entry is the 32-bit location plus one and a tag, 62 bits in all.
pub const TAG_BITS: u32 = 30;
/// Bits a leaf stores per entry.
pub const ENTRY_BITS: u32 = 32 + TAG_BITS;
const ENTRY_MASK: u64 = (1 << ENTRY_BITS) - 1;

/// An index entry: 0 is absent (look in the parent layer); [`TOMBSTONE`] reads as zeros and hides
/// the parent layers; otherwise the low half is the location plus one and the high half the
/// block's tag ([`raw_tag`] or [`packed_tag`], [`TAG_BITS`] wide).
pub fn pack(location: u32, tag: u32) -> u64 {
    assert!(location < u32::MAX, "location u32::MAX is never used");
    assert!(tag < 1 << TAG_BITS, "tag {tag:#x} wider than {TAG_BITS} bits");
    (u64::from(tag) << 32) | u64::from(location + 1)
}

/// Live-space units of one position: a raw block takes all of them, a compressed block packed
/// in a slot of `c` cells takes `UNITS_PER_POSITION / c`. Segment live counts are in units.
pub const UNITS_PER_POSITION: u32 = 16;
/// The largest `cells_log2` of a pack slot (16 cells).
pub const CELLS_LOG2_MAX: u8 = 4;
/// The top bit of a tag: set for a block packed in a slot.
const TAG_PACKED: u32 = 1 << (TAG_BITS - 1);
const TAG_RAW_CRC_MASK: u32 = TAG_PACKED - 1;
/// A packed tag: the flag, 2 bits of cell count, 4 of sub-index, then CRC bits.
const TAG_CELLS_SHIFT: u32 = TAG_BITS - 3;
const TAG_SUB_BITS: u32 = 4;
const TAG_SUB_SHIFT: u32 = TAG_CELLS_SHIFT - TAG_SUB_BITS;
const _: () = assert!(crate::compress::PACK_ENTRIES_MAX <= 1 << TAG_SUB_BITS);
const TAG_PACKED_CRC_MASK: u32 = (1 << TAG_SUB_SHIFT) - 1;

/// The tag of a block stored raw: the low 29 bits of its CRC-32C (the full CRC stays in the
/// batch header, which the scrub checks). A corrupt block passes a read's check with
/// probability 2^-29.
pub fn raw_tag(crc: u32) -> u32 {
    crc & TAG_RAW_CRC_MASK
}

/// The tag of a compressed block in a pack slot of `1 << cells_log2` cells at `sub`: the packed
/// flag, the cell count, the sub-index and 23 bits of its CRC-32C (the slot's directory holds
/// the full CRC, which every read checks).
pub fn packed_tag(cells_log2: u8, sub: u8, crc: u32) -> u32 {
    assert!((1..=CELLS_LOG2_MAX).contains(&cells_log2), "pack slots have 2 to 16 cells");
    assert!(u32::from(sub) < 1 << cells_log2, "sub-index {sub} beyond the slot's cells");
    TAG_PACKED
        | (u32::from(cells_log2 - 1) << TAG_CELLS_SHIFT)
        | (u32::from(sub) << TAG_SUB_SHIFT)
        | (crc & TAG_PACKED_CRC_MASK)
}

/// What an index entry's tag says about its block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tag {
    Raw { crc_bits: u32 },
    Packed { cells_log2: u8, sub: u8, crc_bits: u32 },
}

impl Tag {
    pub fn of(tag: u32) -> Self {
        if tag & TAG_PACKED == 0 {
            Self::Raw { crc_bits: tag }
        } else {
            Self::Packed {
                cells_log2: ((tag >> TAG_CELLS_SHIFT) & 3) as u8 + 1,
                sub: ((tag >> TAG_SUB_SHIFT) & 15) as u8,
                crc_bits: tag & TAG_PACKED_CRC_MASK,
            }
        }
    }

    /// True if a block whose full CRC-32C is `crc` may be the one this tag names.
    pub fn matches(self, crc: u32) -> bool {
        match self {
            Self::Raw { crc_bits } => raw_tag(crc) == crc_bits,
            Self::Packed { crc_bits, .. } => crc & TAG_PACKED_CRC_MASK == crc_bits,
        }
    }

    /// Live-space units the block takes (see [`UNITS_PER_POSITION`]).
    pub fn units(self) -> u32 {
        match self {
            Self::Raw { .. } => UNITS_PER_POSITION,
            Self::Packed { cells_log2, .. } => UNITS_PER_POSITION >> cells_log2,
        }
    }
}

/// Live-space units an entry's block takes (0 for absent entries and tombstones).
pub fn entry_units(entry: u64) -> u32 {
    if is_block(entry) {
        Tag::of((entry >> 32) as u32).units()
    } else {
        0
    }
}

/// The entry of a block trimmed in a layer whose parents may map it: reads as zeros, holds no
/// space. Its low half is 0, which no packed location has.
pub const TOMBSTONE: u64 = ((1 << TAG_BITS) - 1) << 32;
const _: () = assert!(TOMBSTONE & !ENTRY_MASK == 0);

/// True if the entry names a block in the log (not absent, not a tombstone).
pub fn is_block(entry: u64) -> bool {
    entry as u32 != 0
}

/// The (location, crc) of an entry that names a block.
pub fn unpack(entry: u64) -> Option<(u32, u32)> {
    is_block(entry).then(|| ((entry as u32).wrapping_sub(1), (entry >> 32) as u32))
}

/// The longest chain of layers under a volume (its snapshots, and the snapshots its clone
/// source had): a lookup of a block no layer maps visits each once.
pub const LAYER_DEPTH_MAX: usize = 128;

/// Labels the engine gives new layers start here; external ids (volumes and snapshots, from the
/// metadata store's counter) stay below it, so the label of a never-snapshotted volume is its id.
pub const LAYER_LABEL_BASE: u64 = 1 << 62;

/// 64-bit words of a leaf's packed entries.
const LEAF_WORDS: usize = (LEAF_ENTRIES * ENTRY_BITS as usize).div_ceil(64);
const _: () = assert!(LEAF_WORDS * 64 == LEAF_ENTRIES * ENTRY_BITS as usize);
/// Spins before a thread waiting on a leaf yields its core (the writer it waits for may have
/// been preempted inside its few instructions).
const LEAF_SPINS_BEFORE_YIELD: u32 = 64;

/// 1024 entries of [`ENTRY_BITS`] each, entry `i` at bit `i * ENTRY_BITS` of the words (low bits
/// first), and a sequence lock over them: `version` is odd while a writer changes the words.
struct Leaf {
    version: AtomicU64,
    words: [AtomicU64; LEAF_WORDS],
}

fn wait_on_leaf(spins: &mut u32) {
    *spins += 1;
    if *spins < LEAF_SPINS_BEFORE_YIELD {
        std::hint::spin_loop();
    } else {
        *spins = 0;
        std::thread::yield_now();
    }
}

impl Leaf {
    fn new() -> Box<Self> {
        Box::new(Self {
            version: AtomicU64::new(0),
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        })
    }

    /// Where entry `slot` starts: its first word and the bit in it.
    fn place(slot: usize) -> (usize, u32) {
        let bit = slot * ENTRY_BITS as usize;
        (bit / 64, (bit % 64) as u32)
    }

    /// The entry's bits as the words hold them now; consistent only under the lock, or when the
    /// version did not move around the read.
    fn read(&self, slot: usize) -> u64 {
        let (word, shift) = Self::place(slot);
        let low = self.words[word].load(Ordering::Relaxed) >> shift;
        if shift + ENTRY_BITS <= 64 {
            return low & ENTRY_MASK;
        }
        let high = self.words[word + 1].load(Ordering::Relaxed) << (64 - shift);
        (low | high) & ENTRY_MASK
    }

    /// Stores an entry's bits; only under the lock.
    fn write(&self, slot: usize, entry: u64) {
        let (word, shift) = Self::place(slot);
        let low = &self.words[word];
        let kept = low.load(Ordering::Relaxed) & !(ENTRY_MASK << shift);
        low.store(kept | (entry << shift), Ordering::Relaxed);
        if shift + ENTRY_BITS > 64 {
            let high_bits = shift + ENTRY_BITS - 64;
            let high = &self.words[word + 1];
            let kept = high.load(Ordering::Relaxed) & !((1u64 << high_bits) - 1);
            high.store(kept | (entry >> (64 - shift)), Ordering::Relaxed);
        }
    }

    /// The entry of `slot`, as one writer left it: retries while a writer is inside the leaf.
    fn load(&self, slot: usize) -> u64 {
        let mut spins = 0;
        // Ends once no writer entered the leaf during one read: writers hold it for a few
        // instructions.
        loop {
            let before = self.version.load(Ordering::Acquire);
            if before & 1 == 0 {
                let entry = self.read(slot);
                fence(Ordering::Acquire);
                if self.version.load(Ordering::Relaxed) == before {
                    return entry;
                }
            }
            wait_on_leaf(&mut spins);
        }
    }

    /// Replaces the entry of `slot` with `update(old)` if that is `Some`, under the leaf's lock;
    /// returns the old entry. `update` must not panic (it runs with the leaf locked).
    fn update(&self, slot: usize, update: impl FnOnce(u64) -> Option<u64>) -> u64 {
        let mut spins = 0;
        // Ends once the leaf is free: writers hold it for a few instructions.
        let before = loop {
            let version = self.version.load(Ordering::Relaxed);
            if version & 1 == 0
                && self
                    .version
                    .compare_exchange_weak(
                        version,
                        version + 1,
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                break version;
            }
            wait_on_leaf(&mut spins);
        };
        // Readers that see any of the stores below also see the odd version.
        fence(Ordering::Release);
        let old = self.read(slot);
        if let Some(new) = update(old) {
            self.write(slot, new & ENTRY_MASK);
        }
        self.version.store(before + 2, Ordering::Release);
        old
    }

    fn swap(&self, slot: usize, new: u64) -> u64 {
        assert!(new & !ENTRY_MASK == 0, "entry {new:#x} wider than {ENTRY_BITS} bits");
        self.update(slot, |_| Some(new))
    }

    /// Installs `new` if the entry is `expected`; true if it did.
    fn compare_exchange(&self, slot: usize, expected: u64, new: u64) -> bool {
        assert!(new & !ENTRY_MASK == 0, "entry {new:#x} wider than {ENTRY_BITS} bits");
        self.update(slot, |old| (old == expected).then_some(new)) == expected
    }
}

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
    /// The layer below: where a lookup continues when this one has no entry.
    parent: ArcSwapOption<VolumeIndex>,
    root: Inner<Level1>,
    mapped_blocks: AtomicU64,
    /// Live-space units of the mapped blocks (less than 16 per block when compressed).
    mapped_units: AtomicU64,
    allocated_bytes: AtomicU64,
    removed: AtomicBool,
    /// A snapshot's layer: host writes to it are refused.
    frozen: AtomicBool,
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
            parent: ArcSwapOption::empty(),
            root,
            mapped_blocks: AtomicU64::new(0),
            mapped_units: AtomicU64::new(0),
            allocated_bytes: AtomicU64::new(std::mem::size_of::<Self>() as u64 + root_bytes),
            removed: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
        }
    }

    /// The layer's label (for a volume never snapshotted, the volume's id).
    pub fn volume(&self) -> u64 {
        self.volume
    }

    pub fn parent(&self) -> Option<Arc<VolumeIndex>> {
        self.parent.load_full()
    }

    /// Layers under this one.
    pub fn depth(&self) -> usize {
        let mut depth = 0;
        let mut layer = self.parent();
        while let Some(current) = layer {
            depth += 1;
            assert!(depth <= LAYER_DEPTH_MAX + 1, "layer chain longer than LAYER_DEPTH_MAX");
            layer = current.parent();
        }
        depth
    }

    /// The entry a read of `block` sees: this layer's, else the nearest parent's that has one.
    /// A tombstone or 0 reads as zeros.
    pub fn lookup(&self, block: u64) -> u64 {
        let entry = self.get(block);
        if entry != 0 {
            return entry;
        }
        let mut guard = self.parent.load();
        // Bounded: snapshot creation refuses chains deeper than LAYER_DEPTH_MAX.
        while let Some(layer) = guard.as_ref() {
            let entry = layer.get(block);
            if entry != 0 {
                return entry;
            }
            let next = layer.parent.load();
            guard = next;
        }
        0
    }

    pub fn mapped_blocks(&self) -> u64 {
        self.mapped_blocks.load(Ordering::Relaxed)
    }

    /// Live-space units of this layer's blocks: `mapped_blocks * 16 / mapped_units` is its
    /// data-reduction ratio.
    pub fn mapped_units(&self) -> u64 {
        self.mapped_units.load(Ordering::Relaxed)
    }

    /// RAM held by this volume's tables.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes.load(Ordering::Relaxed)
    }

    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    /// True for a snapshot's layer: read-only.
    pub fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::Acquire)
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
            Leaf::new()
        });
        (leaf, d)
    }

    /// The entry of a block (0 if unmapped).
    pub fn get(&self, block: u64) -> u64 {
        self.leaf(block).map_or(0, |(leaf, slot)| leaf.load(slot))
    }

    fn count(&self, old: u64, new: u64) {
        match (is_block(old), is_block(new)) {
            (false, true) => self.mapped_blocks.fetch_add(1, Ordering::Relaxed),
            (true, false) => self.mapped_blocks.fetch_sub(1, Ordering::Relaxed),
            _ => 0,
        };
        let (old_units, new_units) = (u64::from(entry_units(old)), u64::from(entry_units(new)));
        if new_units > old_units {
            self.mapped_units.fetch_add(new_units - old_units, Ordering::Relaxed);
        } else if old_units > new_units {
            self.mapped_units.fetch_sub(old_units - new_units, Ordering::Relaxed);
        }
    }

    /// Installs `entry` only where this layer has no entry; true if it did (a merge moving a
    /// parent's block into its only child never replaces the child's own).
    pub fn insert_if_absent(&self, block: u64, entry: u64) -> bool {
        assert!(entry != 0, "insert_if_absent installs entries");
        let (leaf, slot) = self.leaf_or_create(block);
        let done = leaf.compare_exchange(slot, 0, entry);
        if done {
            self.count(0, entry);
        }
        done
    }

    /// Unmaps a block only if its entry still is `expected`; true if it did.
    pub fn remove_if(&self, block: u64, expected: u64) -> bool {
        let Some((leaf, slot)) = self.leaf(block) else { return false };
        let done = leaf.compare_exchange(slot, expected, 0);
        if done {
            self.count(expected, 0);
        }
        done
    }

    /// Makes blocks `first..first + count` read as zeros, calling `visit(old)` for each block
    /// entry it drops. Without a parent this unmaps; with one, a block some parent maps gets a
    /// tombstone (so the parent's data stays hidden) and the others are unmapped. Costs what this
    /// layer and its parents map in the range, not the range's length.
    pub fn trim(&self, first: u64, count: u64, mut visit: impl FnMut(u64)) {
        let Some(parent) = self.parent() else {
            self.unmap_range(first, count, visit);
            return;
        };
        let end = first.saturating_add(count).min(VOLUME_BLOCKS_MAX);
        let mut layer = Some(parent);
        let mut chunk = Vec::with_capacity(LEAF_ENTRIES);
        while let Some(current) = layer {
            let mut cursor = Some(first);
            // Each round advances the cursor by at least one mapped block of a finite table.
            while let Some(from) = cursor.filter(|from| *from < end) {
                chunk.clear();
                // No more entries than the range has blocks: a short trim costs little.
                let limit = (end - from).min(LEAF_ENTRIES as u64) as usize;
                cursor = current.collect_mapped(from, limit, &mut chunk);
                for &(block, _) in chunk.iter().take_while(|(block, _)| *block < end) {
                    let old = self.swap(block, TOMBSTONE);
                    if is_block(old) {
                        visit(old);
                    }
                }
            }
            layer = current.parent();
        }
        // What is left mapped here and in no parent: unmap it, keeping the tombstones.
        let mut cursor = Some(first);
        while let Some(from) = cursor.filter(|from| *from < end) {
            chunk.clear();
            let limit = (end - from).min(LEAF_ENTRIES as u64) as usize;
            cursor = self.collect_mapped(from, limit, &mut chunk);
            for &(block, entry) in chunk.iter().take_while(|(block, _)| *block < end) {
                if !is_block(entry) {
                    continue;
                }
                let Some((leaf, slot)) = self.leaf(block) else { continue };
                if leaf.compare_exchange(slot, entry, 0) {
                    self.count(entry, 0);
                    visit(entry);
                }
            }
        }
    }

    /// Installs `new` for a block and returns the entry it replaced.
    pub fn swap(&self, block: u64, new: u64) -> u64 {
        let old = if new == 0 {
            match self.leaf(block) {
                Some((leaf, slot)) => leaf.swap(slot, 0),
                None => 0,
            }
        } else {
            let (leaf, slot) = self.leaf_or_create(block);
            leaf.swap(slot, new)
        };
        self.count(old, new);
        old
    }

    /// Installs `new` only if the entry still is `expected` (both mapped).
    pub fn compare_exchange(&self, block: u64, expected: u64, new: u64) -> bool {
        assert!(expected != 0 && new != 0, "compare_exchange moves mapped blocks only");
        let Some((leaf, slot)) = self.leaf(block) else { return false };
        let done = leaf.compare_exchange(slot, expected, new);
        if done {
            self.count(expected, new);
        }
        done
    }

    /// Unmaps blocks `first..first + count` (tombstones too), calling `visit(old)` for each block
    /// entry that was mapped. Skips subtrees that were never allocated, so a huge deallocation of a thin volume
    /// costs what it maps.
    pub fn unmap_range(&self, first: u64, count: u64, mut visit: impl FnMut(u64)) {
        let end = first.saturating_add(count).min(VOLUME_BLOCKS_MAX);
        let mut block = first;
        while block < end {
            let leaf_end = ((block / LEAF_ENTRIES as u64) + 1) * LEAF_ENTRIES as u64;
            let run_end = leaf_end.min(end);
            match self.leaf(block) {
                Some((leaf, slot)) => {
                    for slot in slot..slot + (run_end - block) as usize {
                        let old = leaf.swap(slot, 0);
                        if is_block(old) {
                            self.count(old, 0);
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
                    for offset in slot..LEAF_ENTRIES {
                        if taken == limit {
                            return Some(leaf_base + offset as u64);
                        }
                        let entry = leaf.load(offset);
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
                    for d in 0..LEAF_ENTRIES {
                        let entry = leaf.load(d);
                        if entry != 0 {
                            visit(base + d as u64, entry);
                        }
                    }
                }
            }
        }
    }
}

/// One layer's place in a family of snapshots and clones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRecord {
    pub label: u64,
    /// The layer under it.
    pub parent: Option<u64>,
    /// The volume or snapshot it serves; `None` for a layer kept only for the layers on it.
    pub bound: Option<u64>,
    /// A snapshot's layer: read-only for good.
    pub frozen: bool,
}

/// The layered part of the index: which layer each external id (volume or snapshot) reads and
/// writes, the family tree, and where merged layers went. A volume never snapshotted or cloned
/// has no record here: its id is its label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerTable {
    pub bindings: HashMap<u64, u64>,
    pub layers: HashMap<u64, LayerRecord>,
    /// A merged layer's label -> the layer that took its blocks (batch entries of the log still
    /// name the old label).
    pub aliases: HashMap<u64, u64>,
    pub next_label: u64,
}

impl Default for LayerTable {
    fn default() -> Self {
        Self {
            bindings: HashMap::new(),
            layers: HashMap::new(),
            aliases: HashMap::new(),
            next_label: LAYER_LABEL_BASE,
        }
    }
}

/// Why a snapshot, clone or rollback cannot be made. Checked before the operation is logged:
/// applying a logged operation never fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayerError {
    #[error(
        "volume {volume} already stands on {depth} layers of snapshots (the most is \
         {LAYER_DEPTH_MAX}): delete some of its snapshots first"
    )]
    TooDeep { volume: u64, depth: usize },
    #[error("snapshot {snapshot} is unknown to the engine")]
    SnapshotUnknown { snapshot: u64 },
    #[error("id {id} is already in use by a volume or snapshot")]
    IdInUse { id: u64 },
}

/// Every layer's entries, by label, and the [`LayerTable`]. The map of layers takes a lock only
/// to add or remove a layer or when a data-path thread first meets a volume; threads cache the
/// `Arc`s they use and drop the cache when [`Index::generation`] moves.
#[derive(Default)]
pub struct Index {
    volumes: RwLock<HashMap<u64, Arc<VolumeIndex>>>,
    layers: Mutex<LayerTable>,
    /// Advances whenever a binding changes (snapshot, clone, rollback, unbind).
    generation: AtomicU64,
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index").field("volumes", &self.volume_count()).finish()
    }
}

impl Index {
    /// The layer with this label.
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

    /// Forgets a layer; holders of its `Arc` see `is_removed`.
    pub fn remove(&self, volume: u64) -> Option<Arc<VolumeIndex>> {
        let removed = self.volumes.write().unwrap_or_else(|e| e.into_inner()).remove(&volume);
        if let Some(index) = &removed {
            index.removed.store(true, Ordering::Release);
        }
        removed
    }

    /// Every layer, in label order.
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

    fn table(&self) -> std::sync::MutexGuard<'_, LayerTable> {
        self.layers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Advances whenever an external id changes layer; cached resolutions older than it are stale.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The layer a volume or snapshot reads (and a volume writes); with `create`, a plain
    /// volume's layer is created on first use.
    pub fn resolve(&self, id: u64, create: bool) -> Option<Arc<VolumeIndex>> {
        let table = self.table();
        if let Some(label) = table.bindings.get(&id) {
            return self.get(*label);
        }
        if table.layers.contains_key(&id) {
            // The id's own layer now serves another id (it was snapshotted, then deleted).
            return None;
        }
        if create {
            Some(self.get_or_create(id))
        } else {
            self.get(id)
        }
    }

    /// The layer a batch entry's label names now, following merges.
    pub fn resolve_label(&self, label: u64) -> Option<Arc<VolumeIndex>> {
        if let Some(index) = self.get(label) {
            return Some(index);
        }
        let target = *self.table().aliases.get(&label)?;
        self.get(target)
    }

    /// A fresh label for a new layer.
    pub fn allocate_label(&self) -> u64 {
        let mut table = self.table();
        let label = table.next_label;
        table.next_label += 1;
        label
    }

    /// A copy of the table (for a checkpoint).
    pub fn layer_table(&self) -> LayerTable {
        self.table().clone()
    }

    /// Installs a checkpoint's table: creates every layer it names and links the parents.
    pub fn load_layers(&self, loaded: LayerTable) {
        let mut table = self.table();
        for record in loaded.layers.values() {
            let layer = self.get_or_create(record.label);
            let parent = record.parent.map(|parent| self.get_or_create(parent));
            layer.parent.store(parent);
            layer.frozen.store(record.frozen, Ordering::Release);
        }
        *table = loaded;
        table.next_label = table.next_label.max(LAYER_LABEL_BASE);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The volumes and snapshots (external ids) the index holds.
    pub fn bound_ids(&self) -> Vec<u64> {
        let table = self.table();
        let mut ids: Vec<u64> = table.bindings.keys().copied().collect();
        for label in self.volumes.read().unwrap_or_else(|e| e.into_inner()).keys() {
            if *label < LAYER_LABEL_BASE && !table.layers.contains_key(label) {
                ids.push(*label);
            }
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// True if `id` is bound to a layer as a snapshot or volume of a family.
    pub fn is_bound(&self, id: u64) -> bool {
        self.table().bindings.contains_key(&id)
    }

    /// Whether `volume` may take another snapshot.
    pub fn check_snapshot(&self, volume: u64, snapshot: u64) -> Result<(), LayerError> {
        if self.table().bindings.contains_key(&snapshot) || self.get(snapshot).is_some() {
            return Err(LayerError::IdInUse { id: snapshot });
        }
        let depth = self.resolve(volume, false).map_or(0, |top| top.depth());
        if depth + 1 >= LAYER_DEPTH_MAX {
            return Err(LayerError::TooDeep { volume, depth });
        }
        Ok(())
    }

    /// The blocks at or after `from` that may read differently in volume `volume` than in
    /// snapshot `snapshot`, ascending, at most about `limit` of them (a few more for a chain of
    /// several layers), and where to continue (`None`: no more). They are the blocks with an
    /// entry (data or a trim) in a layer of either chain above the lowest layer both chains
    /// share. A volume never written reads as an empty chain.
    pub fn blocks_differing(
        &self,
        volume: u64,
        snapshot: u64,
        from: u64,
        limit: usize,
    ) -> Result<(Vec<u64>, Option<u64>), LayerError> {
        assert!(limit > 0);
        let Some(snapshot_top) = self.resolve(snapshot, false) else {
            return Err(LayerError::SnapshotUnknown { snapshot });
        };
        let chain = |top: Option<Arc<VolumeIndex>>| {
            let mut layers = Vec::new();
            let mut layer = top;
            while let Some(current) = layer {
                assert!(layers.len() <= LAYER_DEPTH_MAX + 1, "layer chain too long");
                layer = current.parent();
                layers.push(current);
            }
            layers
        };
        let volume_chain = chain(self.resolve(volume, false));
        let snapshot_chain = chain(Some(snapshot_top));
        let shared = |layer: &Arc<VolumeIndex>, other: &[Arc<VolumeIndex>]| {
            other.iter().any(|candidate| Arc::ptr_eq(candidate, layer))
        };
        // Each layer gives up to `limit` blocks from `from`; a layer that had more says where
        // it stopped, and only blocks below the lowest such point are complete.
        let mut blocks = Vec::new();
        let mut entries = Vec::new();
        let mut next: Option<u64> = None;
        for (layers, other) in [(&volume_chain, &snapshot_chain), (&snapshot_chain, &volume_chain)]
        {
            for layer in layers.iter().take_while(|layer| !shared(layer, other)) {
                entries.clear();
                if let Some(stop) = layer.collect_mapped(from, limit, &mut entries) {
                    next = Some(next.map_or(stop, |next| next.min(stop)));
                }
                blocks.extend(entries.iter().map(|(block, _)| *block));
            }
        }
        if let Some(next) = next {
            blocks.retain(|block| *block < next);
        }
        blocks.sort_unstable();
        blocks.dedup();
        Ok((blocks, next))
    }

    /// Whether `volume` may be created as a clone of (or rolled back to) `snapshot`.
    pub fn check_layer_on(&self, volume: u64, snapshot: u64) -> Result<(), LayerError> {
        let Some(label) = self.table().bindings.get(&snapshot).copied() else {
            return Err(LayerError::SnapshotUnknown { snapshot });
        };
        let depth = self.get(label).map_or(0, |layer| layer.depth());
        if depth + 1 >= LAYER_DEPTH_MAX {
            return Err(LayerError::TooDeep { volume, depth });
        }
        Ok(())
    }

    /// A new empty layer `label` on `parent`, serving `bound`.
    fn add_layer(&self, table: &mut LayerTable, label: u64, parent: u64, bound: u64) {
        assert!(label >= LAYER_LABEL_BASE, "engine labels are above LAYER_LABEL_BASE");
        let parent_index = self.get_or_create(parent);
        let layer = self.get_or_create(label);
        layer.parent.store(Some(parent_index));
        table.layers.insert(
            label,
            LayerRecord { label, parent: Some(parent), bound: Some(bound), frozen: false },
        );
        table.bindings.insert(bound, label);
        table.next_label = table.next_label.max(label + 1);
    }

    /// Makes sure a plain volume's own layer has a record before it joins a family.
    fn adopt(&self, table: &mut LayerTable, volume: u64) -> u64 {
        if let Some(label) = table.bindings.get(&volume) {
            return *label;
        }
        let layer = self.get_or_create(volume);
        let parent = layer.parent().map(|parent| parent.volume());
        table.layers.insert(
            volume,
            LayerRecord { label: volume, parent, bound: Some(volume), frozen: false },
        );
        table.bindings.insert(volume, volume);
        volume
    }

    /// Snapshot `snapshot` of `volume`: the volume's layer is frozen and now serves the
    /// snapshot; the volume continues in a new empty layer `label` on it. False if already done
    /// (replay over a checkpoint that holds it).
    pub fn snapshot(&self, volume: u64, snapshot: u64, label: u64) -> bool {
        let mut table = self.table();
        if table.bindings.contains_key(&snapshot) || table.layers.contains_key(&label) {
            return false;
        }
        let top = self.adopt(&mut table, volume);
        if let Some(record) = table.layers.get_mut(&top) {
            record.bound = Some(snapshot);
            record.frozen = true;
        }
        if let Some(layer) = self.get(top) {
            layer.frozen.store(true, Ordering::Release);
        }
        table.bindings.insert(snapshot, top);
        self.add_layer(&mut table, label, top, volume);
        self.generation.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Volume `volume` as a new empty layer `label` on snapshot `snapshot`'s layer.
    pub fn clone_from(&self, volume: u64, snapshot: u64, label: u64) -> bool {
        let mut table = self.table();
        if table.bindings.contains_key(&volume) || table.layers.contains_key(&label) {
            return false;
        }
        let Some(base) = table.bindings.get(&snapshot).copied() else { return false };
        self.add_layer(&mut table, label, base, volume);
        self.generation.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Volume `volume` continues in a new empty layer `label` on snapshot `snapshot`'s layer;
    /// its previous layer is released (`visit` gets every block entry that dies).
    pub fn rollback(&self, volume: u64, snapshot: u64, label: u64, visit: impl FnMut(u64)) -> bool {
        let mut table = self.table();
        if table.layers.contains_key(&label) {
            return false;
        }
        let Some(base) = table.bindings.get(&snapshot).copied() else { return false };
        let old = self.adopt(&mut table, volume);
        if let Some(record) = table.layers.get_mut(&old) {
            record.bound = None;
        }
        self.add_layer(&mut table, label, base, volume);
        self.release(&mut table, old, visit);
        self.generation.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// The volume or snapshot `id` is deleted; its layer is freed, merged into its only child,
    /// or kept for its children. `visit` gets every block entry that dies. False if unknown.
    pub fn unbind(&self, id: u64, mut visit: impl FnMut(u64)) -> bool {
        let mut table = self.table();
        match table.bindings.remove(&id) {
            Some(label) => {
                if let Some(record) = table.layers.get_mut(&label) {
                    record.bound = None;
                }
                self.release(&mut table, label, visit);
            }
            None => {
                if table.layers.contains_key(&id) {
                    return false;
                }
                let Some(index) = self.remove(id) else { return false };
                index.for_each_mapped(|_, entry| {
                    if is_block(entry) {
                        visit(entry);
                    }
                });
            }
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Frees or merges an unbound layer, and then its parents as they lose their reasons to
    /// stay. Bounded by the chain's depth.
    fn release(&self, table: &mut LayerTable, label: u64, mut visit: impl FnMut(u64)) {
        let mut current = label;
        for _ in 0..=LAYER_DEPTH_MAX {
            let Some(record) = table.layers.get(&current).copied() else { return };
            if record.bound.is_some() {
                return;
            }
            let children: Vec<u64> = table
                .layers
                .values()
                .filter(|child| child.parent == Some(current))
                .map(|child| child.label)
                .collect();
            match children[..] {
                [] => {
                    table.layers.remove(&current);
                    table.aliases.retain(|_, target| *target != current);
                    if let Some(index) = self.remove(current) {
                        index.for_each_mapped(|_, entry| {
                            if is_block(entry) {
                                visit(entry);
                            }
                        });
                    }
                    match record.parent {
                        Some(parent) => current = parent,
                        None => return,
                    }
                }
                [child] => {
                    self.merge(table, record, child, &mut visit);
                    return;
                }
                _ => return,
            }
        }
    }

    /// Moves an unbound layer's entries into its only child where the child has none (the
    /// others die), then takes the layer out of the chain.
    fn merge(
        &self,
        table: &mut LayerTable,
        record: LayerRecord,
        child: u64,
        visit: &mut impl FnMut(u64),
    ) {
        let child_index = self.get_or_create(child);
        if let Some(index) = self.get(record.label) {
            index.for_each_mapped(|block, entry| {
                if !child_index.insert_if_absent(block, entry) && is_block(entry) {
                    visit(entry);
                }
            });
        }
        child_index.parent.store(record.parent.map(|parent| self.get_or_create(parent)));
        if let Some(child_record) = table.layers.get_mut(&child) {
            child_record.parent = record.parent;
        }
        table.layers.remove(&record.label);
        self.remove(record.label);
        for target in table.aliases.values_mut() {
            if *target == record.label {
                *target = child;
            }
        }
        table.aliases.insert(record.label, child);
    }

    /// True if `label` is a layer kept only for the layers on it (no volume or snapshot reads
    /// it directly) and every one of them has its own entry for `block`: no read can reach the
    /// layer's block, so GC may drop it instead of moving it.
    pub fn is_hidden_block(&self, label: u64, block: u64) -> bool {
        let table = self.table();
        let Some(record) = table.layers.get(&label) else { return false };
        if record.bound.is_some() {
            return false;
        }
        let children: Vec<u64> = table
            .layers
            .values()
            .filter(|child| child.parent == Some(label))
            .map(|child| child.label)
            .collect();
        drop(table);
        children.len() >= 2
            && children
                .iter()
                .all(|child| self.get(*child).is_some_and(|layer| layer.get(block) != 0))
    }

    /// Up to `limit` blocks that no read can reach: `(label, block, entry)` of blocks in layers
    /// kept only for several layers on them, all of which have their own entry for the block.
    /// Costs one pass over those layers' entries.
    pub fn unreachable_blocks(&self, limit: usize) -> Vec<(u64, u64, u64)> {
        let table = self.table();
        let hidden: Vec<(u64, Vec<u64>)> = table
            .layers
            .values()
            .filter(|layer| layer.bound.is_none())
            .map(|layer| {
                let children = table
                    .layers
                    .values()
                    .filter(|child| child.parent == Some(layer.label))
                    .map(|child| child.label)
                    .collect();
                (layer.label, children)
            })
            .collect();
        drop(table);
        let mut found = Vec::new();
        let mut chunk = Vec::with_capacity(LEAF_ENTRIES);
        for (label, children) in hidden {
            let (Some(layer), children) = (
                self.get(label),
                children.iter().filter_map(|child| self.get(*child)).collect::<Vec<_>>(),
            ) else {
                continue;
            };
            if children.len() < 2 {
                continue;
            }
            let mut cursor = Some(0);
            while let Some(from) = cursor {
                chunk.clear();
                cursor = layer.collect_mapped(from, LEAF_ENTRIES, &mut chunk);
                for &(block, entry) in &chunk {
                    if is_block(entry) && children.iter().all(|child| child.get(block) != 0) {
                        found.push((label, block, entry));
                        if found.len() == limit {
                            return found;
                        }
                    }
                }
            }
        }
        found
    }

    /// True if some layer serves no volume or snapshot directly.
    pub fn has_hidden_layers(&self) -> bool {
        self.table().layers.values().any(|layer| layer.bound.is_none())
    }

    /// Blocks only `id`'s layer holds that no layer on it still reads: what deleting the
    /// snapshot would free.
    pub fn exclusive_blocks(&self, id: u64) -> u64 {
        let table = self.table();
        let Some(label) = table.bindings.get(&id).copied() else {
            return self.get(id).map_or(0, |index| index.mapped_blocks());
        };
        let Some(layer) = self.get(label) else { return 0 };
        let children: Vec<Arc<VolumeIndex>> = table
            .layers
            .values()
            .filter(|child| child.parent == Some(label))
            .filter_map(|child| self.get(child.label))
            .collect();
        drop(table);
        let mut exclusive = 0;
        layer.for_each_mapped(|block, entry| {
            if is_block(entry) && children.iter().all(|child| child.get(block) != 0) {
                exclusive += 1;
            }
        });
        exclusive
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_pack_location_and_crc() {
        assert_eq!(unpack(0), None);
        assert_eq!(unpack(pack(0, 0)), Some((0, 0)));
        let widest = (1 << TAG_BITS) - 1;
        assert_eq!(unpack(pack(u32::MAX - 1, widest)), Some((u32::MAX - 1, widest)));
        assert!(pack(u32::MAX - 1, widest) <= ENTRY_MASK);
        assert!(!is_block(TOMBSTONE));
    }

    #[test]
    fn tags_keep_29_crc_bits_raw_and_23_packed() {
        let crc = 0xdead_beef;
        let raw = raw_tag(crc);
        assert_eq!(raw, crc & ((1 << 29) - 1));
        assert_eq!(Tag::of(raw), Tag::Raw { crc_bits: raw });
        assert!(Tag::of(raw).matches(crc));
        assert!(Tag::of(raw).matches(crc ^ (1 << 31)), "bits above 29 are not kept");
        assert!(!Tag::of(raw).matches(crc ^ 1));
        assert_eq!(Tag::of(raw).units(), UNITS_PER_POSITION);
        for cells_log2 in 1..=CELLS_LOG2_MAX {
            for sub in 0..1u8 << cells_log2 {
                let tag = packed_tag(cells_log2, sub, crc);
                assert!(tag < 1 << TAG_BITS);
                assert_eq!(
                    Tag::of(tag),
                    Tag::Packed { cells_log2, sub, crc_bits: crc & ((1 << 23) - 1) }
                );
                assert!(Tag::of(tag).matches(crc));
                assert!(!Tag::of(tag).matches(crc ^ 4));
                assert_eq!(Tag::of(tag).units(), UNITS_PER_POSITION >> cells_log2);
            }
        }
    }

    #[test]
    #[should_panic(expected = "wider than")]
    fn a_tag_wider_than_an_entry_holds_is_refused() {
        pack(1, 1 << TAG_BITS);
    }

    /// Entries straddle words: every slot keeps its own bits, whatever its neighbours hold.
    #[test]
    fn packed_leaf_slots_keep_their_own_bits() {
        let leaf = Leaf::new();
        let value = |slot: usize, round: u64| {
            let mixed = (slot as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ round;
            mixed & ENTRY_MASK
        };
        for round in [0, u64::MAX, 0x5555_5555_5555_5555] {
            for slot in 0..LEAF_ENTRIES {
                leaf.swap(slot, value(slot, round));
            }
            for slot in 0..LEAF_ENTRIES {
                assert_eq!(leaf.load(slot), value(slot, round), "slot {slot}");
            }
        }
        for slot in (0..LEAF_ENTRIES).step_by(2) {
            assert_eq!(leaf.swap(slot, 0), value(slot, 0x5555_5555_5555_5555));
        }
        for slot in 0..LEAF_ENTRIES {
            let expected = if slot % 2 == 0 { 0 } else { value(slot, 0x5555_5555_5555_5555) };
            assert_eq!(leaf.load(slot), expected, "slot {slot}");
        }
        assert!(!leaf.compare_exchange(1, 7, 9), "stale expectation");
        assert!(leaf.compare_exchange(0, 0, ENTRY_MASK));
        assert_eq!(leaf.load(0), ENTRY_MASK);
        assert_eq!(leaf.load(1), value(1, 0x5555_5555_5555_5555), "the neighbour is untouched");
    }

    /// Writers on neighbouring slots of one leaf, and readers beside them: a reader never sees an
    /// entry half written (each written entry's tag is a function of its location), and no
    /// writer's update is lost.
    #[test]
    fn concurrent_writers_and_readers_of_one_leaf_see_whole_entries() {
        const WRITERS: usize = 3;
        const ROUNDS: u32 = 300_000;
        let start = std::sync::Barrier::new(WRITERS + 1);
        let writing = std::sync::atomic::AtomicUsize::new(WRITERS);
        let index = Index::default();
        let volume = index.get_or_create(1);
        let entry_of = |location: u32| pack(location, location.wrapping_mul(2_654_435_761) >> 2);
        let whole = |entry: u64| match unpack(entry) {
            None => entry == 0,
            Some((location, tag)) => entry_of(location) == entry && tag < 1 << TAG_BITS,
        };
        std::thread::scope(|scope| {
            for writer in 0..WRITERS {
                let (volume, start, writing) = (&volume, &start, &writing);
                scope.spawn(move || {
                    start.wait();
                    for round in 0..ROUNDS {
                        // Slots of one writer interleave with the others' (same words).
                        let block = u64::from(round % 64) * WRITERS as u64 + writer as u64;
                        let location = round * WRITERS as u32 + writer as u32;
                        volume.swap(block, entry_of(location));
                        let current = volume.get(block);
                        assert_eq!(current, entry_of(location), "own write lost at {block}");
                        assert!(volume.compare_exchange(block, current, entry_of(location + 1)));
                    }
                    writing.fetch_sub(1, Ordering::Release);
                });
            }
            let (volume, start, writing) = (&volume, &start, &writing);
            scope.spawn(move || {
                start.wait();
                let mut block = 0;
                // Ends when the writers do.
                while writing.load(Ordering::Acquire) > 0 {
                    block = (block + 1) % (64 * WRITERS as u64);
                    let entry = volume.get(block);
                    assert!(whole(entry), "torn entry {entry:#x} at block {block}");
                }
            });
        });
        assert_eq!(volume.mapped_blocks(), 64 * WRITERS as u64);
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
        assert!(dense_bytes <= 7.95, "{dense_bytes} bytes per densely mapped block");
        // The tables above the leaves are amortised over more blocks as a volume grows: one
        // inner table (16 KiB) per 4 GiB of volume. The leaves alone cost 7.758 bytes per block.
        let large = index.get_or_create(3);
        let large_blocks = 1u64 << 20; // 4 GiB of volume.
        for block in 0..large_blocks {
            large.swap(block, pack(block as u32, 0));
        }
        let large_bytes = large.allocated_bytes() as f64 / large_blocks as f64;
        assert!(large_bytes <= 7.8, "{large_bytes} bytes per densely mapped block at 4 GiB");
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
            "RAM per mapped block: {dense_bytes:.3} bytes dense (1 GiB volume), {large_bytes:.3} \
             bytes dense (4 GiB volume), {sparse_bytes:.2} bytes at 22% random fill"
        );
    }
}
