//! Which chunks of which drives hold each volume: the allocator the control plane calls, and the
//! lock-free map the data path reads on every I/O.
//!
//! Hot path: [`VolumeMap::pieces`] runs on every I/O (atomic loads only); the rest is control
//! plane.
//!
//! A volume owns whole chunks, allocated when it is created or grown (thick at the node; the drive
//! files stay sparse, so thin at the host). Chunks are taken round-robin across drives so a
//! volume's I/O spreads over them. Volumes only grow: shrinking would destroy data.
//!
//! Changing a layout is two-phase, so the metadata store stays the source of truth: `reserve_*`
//! takes chunks out of the free sets, the caller zeroes the new chunks and writes the layout to
//! its metadata store, then `publish` makes it visible to the data path (or `cancel` gives the
//! chunks back if the metadata write failed). At startup `restore` rebuilds everything from the
//! layouts the metadata store holds.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use types::{ByteSize, BLOCK_SIZE_BYTES, VOLUME_SIZE_BYTES_MAX};

use crate::format::{chunk_offset_bytes, CHUNK_SIZE_BYTES, DRIVE_COUNT_MAX};
use crate::store::StoreError;

/// How many chunk entries one leaf of a [`VolumeMap`] holds (1024 chunks = 64 GiB of volume in
/// an 8 KiB leaf). Leaves are allocated as a volume grows, so a small volume costs little.
pub const MAP_LEAF_CHUNKS: usize = 1024;

const BLOCK_BYTES: u64 = BLOCK_SIZE_BYTES as u64;
/// Set in a map entry that holds a chunk; an entry of zero is unmapped.
const ENTRY_MAPPED: u64 = 1 << 63;

/// A volume's identity inside the engine, assigned by the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VolumeId(pub u64);

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "volume {}", self.0)
    }
}

/// One chunk: chunk `index` of drive `drive`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId {
    pub drive: u16,
    pub index: u32,
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "chunk {} of drive {}", self.index, self.drive)
    }
}

/// Where a volume lives: chunk `i` of the list holds volume bytes
/// `[i * CHUNK_SIZE_BYTES, (i + 1) * CHUNK_SIZE_BYTES)`. Plain data, stored by `meta`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeLayout {
    pub volume: VolumeId,
    pub size_bytes: u64,
    pub chunks: Vec<ChunkId>,
}

impl VolumeLayout {
    /// How many chunks a volume of `size_bytes` owns.
    pub fn chunk_count_for(size_bytes: u64) -> u64 {
        size_bytes.div_ceil(CHUNK_SIZE_BYTES)
    }
}

/// The node's space, in chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub chunk_size_bytes: u64,
    pub total_chunks: u64,
    /// Chunks neither owned by a volume nor reserved for one.
    pub free_chunks: u64,
}

/// Why a layout change was refused. The messages are shown to users as they are.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error(
        "not enough free space: this needs {needed} more chunks of 64 MiB ({}) but only {free} \
         are free ({}); delete volumes or add drives",
        ByteSize(needed * CHUNK_SIZE_BYTES),
        ByteSize(free * CHUNK_SIZE_BYTES)
    )]
    NoSpace { needed: u64, free: u64 },
    #[error("{volume} already exists")]
    VolumeExists { volume: VolumeId },
    #[error("{volume} does not exist")]
    VolumeNotFound { volume: VolumeId },
    #[error(
        "{volume} is {size_bytes} bytes; resizing it to {requested_bytes} bytes would shrink it \
         and destroy data, so it is refused: volumes can only grow"
    )]
    ShrinkRefused { volume: VolumeId, size_bytes: u64, requested_bytes: u64 },
    #[error(
        "size {size_bytes} bytes for {volume} is invalid: it must be a non-zero multiple of 4096 \
         of at most 1 PiB"
    )]
    SizeInvalid { volume: VolumeId, size_bytes: u64 },
    #[error("{volume} has a layout change in progress; retry when it has finished")]
    ReservationPending { volume: VolumeId },
    #[error(
        "the stored layouts give {chunk} to both {first} and {second}: the metadata is corrupt; \
         restore it from a backup"
    )]
    ChunkOwnedTwice { chunk: ChunkId, first: VolumeId, second: VolumeId },
    #[error(
        "the stored layout of {volume} names {chunk}, which this node's drives do not have: the \
         metadata belongs to other drives or is corrupt"
    )]
    ChunkOutOfRange { volume: VolumeId, chunk: ChunkId },
    #[error(
        "the stored layout of {volume} has {chunk_count} chunks for {size_bytes} bytes: the \
         metadata is corrupt; restore it from a backup"
    )]
    LayoutInconsistent { volume: VolumeId, size_bytes: u64, chunk_count: u64 },
    #[error("layouts can only be restored once, at startup, before any volume exists")]
    AlreadyRestored,
}

/// One piece of a volume I/O that lies within a single chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub drive: u16,
    pub drive_offset_bytes: u64,
    pub length_bytes: u64,
}

/// What the data path holds per volume: translates volume bytes to drive bytes with a few atomic
/// loads, no lock and no allocation.
///
/// It is shared (`Arc`) between the control plane and every data-path thread, and changes in
/// place: a grow fills the new chunk entries, then publishes the new size with `Release`; a
/// reader loads the size with `Acquire` before looking at entries, so every entry below the size
/// it saw is filled. Entries never change once filled (volumes only grow).
pub struct VolumeMap {
    volume: VolumeId,
    size_bytes: AtomicU64,
    removed: AtomicBool,
    leaves: Box<[OnceLock<Box<[AtomicU64]>>]>,
}

impl fmt::Debug for VolumeMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VolumeMap")
            .field("volume", &self.volume)
            .field("size_bytes", &self.size_bytes())
            .field("removed", &self.is_removed())
            .finish()
    }
}

impl VolumeMap {
    /// An empty map (size 0) able to hold up to `capacity_chunks` chunks.
    fn new(volume: VolumeId, capacity_chunks: u64) -> Self {
        let leaf_count = usize::try_from(capacity_chunks.div_ceil(MAP_LEAF_CHUNKS as u64))
            .expect("chunk count fits in memory");
        Self {
            volume,
            size_bytes: AtomicU64::new(0),
            removed: AtomicBool::new(false),
            leaves: (0..leaf_count).map(|_| OnceLock::new()).collect(),
        }
    }

    pub fn volume(&self) -> VolumeId {
        self.volume
    }

    /// The current size; grows while the map is held.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// True once the volume was deleted; every I/O then fails with `VolumeRemoved`.
    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    /// The chunk holding volume chunk number `chunk_number`, if it is below the size.
    pub fn chunk(&self, chunk_number: u64) -> Option<ChunkId> {
        let size_bytes = self.size_bytes();
        (chunk_number < VolumeLayout::chunk_count_for(size_bytes))
            .then(|| self.mapped_chunk(chunk_number))
    }

    /// Splits the volume range `[offset_bytes, offset_bytes + length_bytes)` into per-chunk
    /// pieces, after checking it is aligned and within the volume.
    pub fn pieces(&self, offset_bytes: u64, length_bytes: u64) -> Result<Pieces<'_>, StoreError> {
        if self.is_removed() {
            return Err(StoreError::VolumeRemoved { volume: self.volume });
        }
        if offset_bytes % BLOCK_BYTES != 0 || length_bytes % BLOCK_BYTES != 0 {
            return Err(StoreError::Unaligned { offset_bytes, length_bytes });
        }
        let size_bytes = self.size_bytes();
        match offset_bytes.checked_add(length_bytes) {
            Some(end_bytes) if end_bytes <= size_bytes => {
                Ok(Pieces { map: self, offset_bytes, end_bytes })
            }
            _ => Err(StoreError::OutOfRange { offset_bytes, length_bytes, size_bytes }),
        }
    }

    /// Reads an entry that must be filled: the caller saw a size covering it.
    fn mapped_chunk(&self, chunk_number: u64) -> ChunkId {
        let entry = usize::try_from(chunk_number)
            .ok()
            .and_then(|number| {
                let leaf = self.leaves.get(number / MAP_LEAF_CHUNKS)?.get()?;
                Some(leaf[number % MAP_LEAF_CHUNKS].load(Ordering::Relaxed))
            })
            .unwrap_or(0);
        // A broken invariant here would send I/O to another volume's data: stop instead.
        assert!(
            entry & ENTRY_MAPPED != 0,
            "chunk {chunk_number} of {} is below the published size but unmapped",
            self.volume
        );
        ChunkId { drive: (entry >> 32) as u16, index: entry as u32 }
    }

    /// Fills entry `chunk_number`. Called only by `Volumes`, under its lock, before the size
    /// that covers the entry is published.
    fn set_chunk(&self, chunk_number: u64, chunk: ChunkId) {
        let number = usize::try_from(chunk_number).expect("chunk number fits in memory");
        let leaf = self.leaves[number / MAP_LEAF_CHUNKS]
            .get_or_init(|| (0..MAP_LEAF_CHUNKS).map(|_| AtomicU64::new(0)).collect());
        let entry = ENTRY_MAPPED | (u64::from(chunk.drive) << 32) | u64::from(chunk.index);
        let previous = leaf[number % MAP_LEAF_CHUNKS].swap(entry, Ordering::Relaxed);
        assert!(previous == 0 || previous == entry, "a mapped chunk entry never changes");
    }

    fn publish_size(&self, size_bytes: u64) {
        assert!(size_bytes >= self.size_bytes(), "volumes only grow");
        self.size_bytes.store(size_bytes, Ordering::Release);
    }
}

/// The per-chunk pieces of one I/O, in volume order. See [`VolumeMap::pieces`].
#[derive(Debug)]
pub struct Pieces<'a> {
    map: &'a VolumeMap,
    offset_bytes: u64,
    end_bytes: u64,
}

impl Pieces<'_> {
    /// Volume bytes not yet returned.
    pub fn remaining_bytes(&self) -> u64 {
        self.end_bytes - self.offset_bytes
    }
}

impl Iterator for Pieces<'_> {
    type Item = Piece;

    fn next(&mut self) -> Option<Piece> {
        if self.offset_bytes >= self.end_bytes {
            return None;
        }
        let chunk_number = self.offset_bytes / CHUNK_SIZE_BYTES;
        let within_bytes = self.offset_bytes % CHUNK_SIZE_BYTES;
        let length_bytes =
            (CHUNK_SIZE_BYTES - within_bytes).min(self.end_bytes - self.offset_bytes);
        let chunk = self.map.mapped_chunk(chunk_number);
        self.offset_bytes += length_bytes;
        Some(Piece {
            drive: chunk.drive,
            drive_offset_bytes: chunk_offset_bytes(chunk.index) + within_bytes,
            length_bytes,
        })
    }
}

/// The free chunks of one drive: a bitmap, one bit per chunk, set when free.
struct FreeChunks {
    words: Vec<u64>,
}

impl FreeChunks {
    fn all_free(chunk_count: u32) -> Self {
        let chunk_count = chunk_count as usize;
        let mut words = vec![u64::MAX; chunk_count.div_ceil(64)];
        if chunk_count % 64 != 0 {
            let last = words.len() - 1;
            words[last] = (1u64 << (chunk_count % 64)) - 1;
        }
        Self { words }
    }

    fn take_lowest(&mut self) -> Option<u32> {
        let (word_index, word) = self.words.iter_mut().enumerate().find(|(_, w)| **w != 0)?;
        let bit = word.trailing_zeros();
        *word &= !(1u64 << bit);
        Some(word_index as u32 * 64 + bit)
    }

    /// Takes a given chunk; false if it was not free.
    fn take(&mut self, index: u32) -> bool {
        let (word, bit) = (index as usize / 64, index % 64);
        let was_free = self.words[word] & (1u64 << bit) != 0;
        self.words[word] &= !(1u64 << bit);
        was_free
    }

    fn give_back(&mut self, index: u32) {
        let (word, bit) = (index as usize / 64, index % 64);
        assert!(self.words[word] & (1u64 << bit) == 0, "chunk {index} freed twice");
        self.words[word] |= 1u64 << bit;
    }
}

struct Published {
    layout: VolumeLayout,
    map: Arc<VolumeMap>,
}

struct State {
    free: Vec<FreeChunks>,
    free_chunks: u64,
    published: HashMap<VolumeId, Published>,
    pending: HashMap<VolumeId, VolumeLayout>,
    /// The drive the next new volume starts on, so volumes do not all start on drive 0.
    next_drive: u16,
}

impl State {
    /// Takes `count` chunks round-robin across drives, starting at `drive`. The caller checked
    /// that at least `count` chunks are free.
    fn allocate(&mut self, count: u64, mut drive: u16, chunks: &mut Vec<ChunkId>) {
        assert!(count <= self.free_chunks);
        let drive_count = self.free.len() as u16;
        for _ in 0..count {
            let mut taken = None;
            for _ in 0..drive_count {
                let index = self.free[usize::from(drive)].take_lowest();
                let this_drive = drive;
                drive = (drive + 1) % drive_count;
                if let Some(index) = index {
                    taken = Some(ChunkId { drive: this_drive, index });
                    break;
                }
            }
            chunks.push(taken.expect("free_chunks counts the chunks in the free sets"));
        }
        self.free_chunks -= count;
    }

    fn give_back(&mut self, chunks: &[ChunkId]) {
        for chunk in chunks {
            self.free[usize::from(chunk.drive)].give_back(chunk.index);
        }
        self.free_chunks += chunks.len() as u64;
    }

    fn published_chunk_count(&self, volume: VolumeId) -> usize {
        self.published.get(&volume).map_or(0, |published| published.layout.chunks.len())
    }
}

/// The node's chunk allocator and the registry of published volume layouts. Used by the control
/// plane (`Send + Sync`, one lock); the data path only holds the [`VolumeMap`]s it hands out.
///
/// Per volume, the caller serialises layout changes: `reserve_create`/`reserve_grow`, then exactly
/// one of `publish` or `cancel`; `remove` when no I/O is in flight for the volume.
pub struct Volumes {
    drive_count: u16,
    chunks_per_drive: u32,
    state: Mutex<State>,
}

impl fmt::Debug for Volumes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Volumes")
            .field("drive_count", &self.drive_count)
            .field("chunks_per_drive", &self.chunks_per_drive)
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl Volumes {
    /// A node with `drive_count` drives of `chunks_per_drive` chunks each, all free.
    pub fn new(drive_count: u16, chunks_per_drive: u32) -> Self {
        assert!((1..=DRIVE_COUNT_MAX).contains(&drive_count), "drive count {drive_count}");
        assert!(chunks_per_drive > 0, "a drive holds at least one chunk");
        let state = State {
            free: (0..drive_count).map(|_| FreeChunks::all_free(chunks_per_drive)).collect(),
            free_chunks: u64::from(drive_count) * u64::from(chunks_per_drive),
            published: HashMap::new(),
            pending: HashMap::new(),
            next_drive: 0,
        };
        Self { drive_count, chunks_per_drive, state: Mutex::new(state) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock is a bug that may have left the state half changed.
        self.state.lock().expect("volumes lock poisoned by an earlier panic")
    }

    fn total_chunks(&self) -> u64 {
        u64::from(self.drive_count) * u64::from(self.chunks_per_drive)
    }

    fn check_size(volume: VolumeId, size_bytes: u64) -> Result<(), EngineError> {
        if size_bytes == 0 || size_bytes % BLOCK_BYTES != 0 || size_bytes > VOLUME_SIZE_BYTES_MAX {
            return Err(EngineError::SizeInvalid { volume, size_bytes });
        }
        Ok(())
    }

    /// Rebuilds the state from the layouts the metadata store holds. Checks them all before
    /// changing anything: every chunk exists and has one owner, sizes match chunk counts.
    pub fn restore(&self, layouts: Vec<VolumeLayout>) -> Result<(), EngineError> {
        let mut state = self.lock();
        if !state.published.is_empty() || !state.pending.is_empty() {
            return Err(EngineError::AlreadyRestored);
        }
        let mut owners: HashMap<ChunkId, VolumeId> = HashMap::new();
        let mut seen = HashSet::new();
        for layout in &layouts {
            let volume = layout.volume;
            Self::check_size(volume, layout.size_bytes)?;
            if !seen.insert(volume) {
                return Err(EngineError::VolumeExists { volume });
            }
            let chunk_count = layout.chunks.len() as u64;
            if chunk_count != VolumeLayout::chunk_count_for(layout.size_bytes) {
                return Err(EngineError::LayoutInconsistent {
                    volume,
                    size_bytes: layout.size_bytes,
                    chunk_count,
                });
            }
            for &chunk in &layout.chunks {
                if chunk.drive >= self.drive_count || chunk.index >= self.chunks_per_drive {
                    return Err(EngineError::ChunkOutOfRange { volume, chunk });
                }
                if let Some(first) = owners.insert(chunk, volume) {
                    return Err(EngineError::ChunkOwnedTwice { chunk, first, second: volume });
                }
            }
        }
        for layout in layouts {
            for chunk in &layout.chunks {
                let was_free = state.free[usize::from(chunk.drive)].take(chunk.index);
                assert!(was_free, "checked above: each chunk has one owner");
            }
            state.free_chunks -= layout.chunks.len() as u64;
            let map = Arc::new(VolumeMap::new(layout.volume, self.total_chunks()));
            for (number, chunk) in layout.chunks.iter().enumerate() {
                map.set_chunk(number as u64, *chunk);
            }
            map.publish_size(layout.size_bytes);
            state.published.insert(layout.volume, Published { layout, map });
        }
        state.next_drive = (state.published.len() % usize::from(self.drive_count)) as u16;
        Ok(())
    }

    /// Reserves the chunks of a new volume. They are not visible until `publish`. They may hold
    /// a deleted volume's data: zero them (`ChunkStore::zero_chunks`) before publishing.
    pub fn reserve_create(
        &self,
        volume: VolumeId,
        size_bytes: u64,
    ) -> Result<VolumeLayout, EngineError> {
        Self::check_size(volume, size_bytes)?;
        let mut state = self.lock();
        if state.published.contains_key(&volume) || state.pending.contains_key(&volume) {
            return Err(EngineError::VolumeExists { volume });
        }
        let needed = VolumeLayout::chunk_count_for(size_bytes);
        if needed > state.free_chunks {
            return Err(EngineError::NoSpace { needed, free: state.free_chunks });
        }
        let mut chunks = Vec::with_capacity(needed as usize);
        let start = state.next_drive;
        state.allocate(needed, start, &mut chunks);
        state.next_drive = (start + 1) % self.drive_count;
        let layout = VolumeLayout { volume, size_bytes, chunks };
        state.pending.insert(volume, layout.clone());
        Ok(layout)
    }

    /// Reserves the chunks a volume needs to grow to `new_size_bytes`; refuses to shrink. The new
    /// chunks continue the round-robin after the volume's last chunk.
    pub fn reserve_grow(
        &self,
        volume: VolumeId,
        new_size_bytes: u64,
    ) -> Result<VolumeLayout, EngineError> {
        Self::check_size(volume, new_size_bytes)?;
        let mut state = self.lock();
        if state.pending.contains_key(&volume) {
            return Err(EngineError::ReservationPending { volume });
        }
        let Some(published) = state.published.get(&volume) else {
            return Err(EngineError::VolumeNotFound { volume });
        };
        let size_bytes = published.layout.size_bytes;
        if new_size_bytes < size_bytes {
            return Err(EngineError::ShrinkRefused {
                volume,
                size_bytes,
                requested_bytes: new_size_bytes,
            });
        }
        let mut chunks = published.layout.chunks.clone();
        let needed = VolumeLayout::chunk_count_for(new_size_bytes) - chunks.len() as u64;
        if needed > state.free_chunks {
            return Err(EngineError::NoSpace { needed, free: state.free_chunks });
        }
        let start = chunks.last().map_or(0, |last| (last.drive + 1) % self.drive_count);
        state.allocate(needed, start, &mut chunks);
        let layout = VolumeLayout { volume, size_bytes: new_size_bytes, chunks };
        state.pending.insert(volume, layout.clone());
        Ok(layout)
    }

    /// The chunks of a reserved layout that the volume does not own yet: the ones to zero
    /// before publishing.
    pub fn new_chunks<'a>(&self, layout: &'a VolumeLayout) -> &'a [ChunkId] {
        let published = self.lock().published_chunk_count(layout.volume);
        &layout.chunks[published.min(layout.chunks.len())..]
    }

    /// Gives back the chunks of a reservation whose metadata write failed.
    pub fn cancel(&self, layout: &VolumeLayout) {
        let mut state = self.lock();
        let pending = state.pending.remove(&layout.volume);
        assert_eq!(pending.as_ref(), Some(layout), "cancel of a layout that is not reserved");
        let published = state.published_chunk_count(layout.volume);
        state.give_back(&layout.chunks[published..]);
    }

    /// Makes a reserved layout visible to the data path. A grow becomes visible to holders of
    /// the volume's existing map: its new entries are filled before its size is published.
    pub fn publish(&self, layout: VolumeLayout) {
        let mut state = self.lock();
        let pending = state.pending.remove(&layout.volume);
        assert_eq!(pending.as_ref(), Some(&layout), "publish of a layout that is not reserved");
        let total_chunks = self.total_chunks();
        let published = state.published.entry(layout.volume).or_insert_with(|| Published {
            layout: VolumeLayout { volume: layout.volume, size_bytes: 0, chunks: Vec::new() },
            map: Arc::new(VolumeMap::new(layout.volume, total_chunks)),
        });
        let first_new = published.layout.chunks.len();
        for (number, chunk) in layout.chunks.iter().enumerate().skip(first_new) {
            published.map.set_chunk(number as u64, *chunk);
        }
        published.map.publish_size(layout.size_bytes);
        published.layout = layout;
    }

    /// Deletes a volume and frees its chunks (and those of a pending reservation). The caller
    /// makes sure no I/O to it is in flight (the namespace is detached and its queues drained):
    /// the chunks may be given to another volume at once. Holders of its map see `is_removed`.
    pub fn remove(&self, volume: VolumeId) {
        let mut state = self.lock();
        let published_count = state.published_chunk_count(volume);
        if let Some(pending) = state.pending.remove(&volume) {
            state.give_back(&pending.chunks[published_count..]);
        }
        if let Some(published) = state.published.remove(&volume) {
            published.map.removed.store(true, Ordering::Release);
            state.give_back(&published.layout.chunks);
        }
    }

    pub fn capacity(&self) -> Capacity {
        Capacity {
            chunk_size_bytes: CHUNK_SIZE_BYTES,
            total_chunks: self.total_chunks(),
            free_chunks: self.lock().free_chunks,
        }
    }

    /// The map the data path uses for a published volume.
    pub fn mapping(&self, volume: VolumeId) -> Option<Arc<VolumeMap>> {
        self.lock().published.get(&volume).map(|published| Arc::clone(&published.map))
    }

    /// The published layout of a volume.
    pub fn layout(&self, volume: VolumeId) -> Option<VolumeLayout> {
        self.lock().published.get(&volume).map(|published| published.layout.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: u64 = CHUNK_SIZE_BYTES;
    const V1: VolumeId = VolumeId(1);
    const V2: VolumeId = VolumeId(2);

    fn create(volumes: &Volumes, volume: VolumeId, size_bytes: u64) -> Arc<VolumeMap> {
        let layout = volumes.reserve_create(volume, size_bytes).unwrap();
        volumes.publish(layout);
        volumes.mapping(volume).unwrap()
    }

    #[test]
    fn send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Volumes>();
        check::<VolumeMap>();
    }

    #[test]
    fn create_spreads_round_robin_and_counts_space() {
        let volumes = Volumes::new(3, 4);
        assert_eq!(
            volumes.capacity(),
            Capacity { chunk_size_bytes: CHUNK, total_chunks: 12, free_chunks: 12 }
        );
        let layout = volumes.reserve_create(V1, 4 * CHUNK + 4096).unwrap();
        let drives: Vec<u16> = layout.chunks.iter().map(|c| c.drive).collect();
        assert_eq!(drives, [0, 1, 2, 0, 1]);
        assert_eq!(volumes.capacity().free_chunks, 7, "reserved chunks are not free");
        assert!(volumes.mapping(V1).is_none(), "not visible before publish");
        volumes.publish(layout);
        // The next volume starts on the next drive.
        let second = volumes.reserve_create(V2, CHUNK).unwrap();
        assert_eq!(second.chunks, [ChunkId { drive: 1, index: 2 }]);
    }

    #[test]
    fn refusals_have_clear_messages() {
        let volumes = Volumes::new(2, 2);
        let error = volumes.reserve_create(V1, 5 * CHUNK).unwrap_err();
        assert_eq!(error, EngineError::NoSpace { needed: 5, free: 4 });
        assert!(error.to_string().contains("320MiB"), "{error}");
        assert!(error.to_string().contains("delete volumes or add drives"), "{error}");
        assert!(matches!(volumes.reserve_create(V1, 4095), Err(EngineError::SizeInvalid { .. })));
        assert!(matches!(volumes.reserve_create(V1, 0), Err(EngineError::SizeInvalid { .. })));
        create(&volumes, V1, 2 * CHUNK);
        assert_eq!(
            volumes.reserve_create(V1, CHUNK),
            Err(EngineError::VolumeExists { volume: V1 })
        );
        let shrink = volumes.reserve_grow(V1, CHUNK).unwrap_err();
        assert_eq!(
            shrink,
            EngineError::ShrinkRefused {
                volume: V1,
                size_bytes: 2 * CHUNK,
                requested_bytes: CHUNK
            }
        );
        assert!(shrink.to_string().contains("destroy data"), "{shrink}");
        assert_eq!(
            volumes.reserve_grow(V2, CHUNK),
            Err(EngineError::VolumeNotFound { volume: V2 })
        );
        assert_eq!(
            volumes.reserve_grow(V1, 5 * CHUNK),
            Err(EngineError::NoSpace { needed: 3, free: 2 })
        );
        let pending = volumes.reserve_grow(V1, 3 * CHUNK).unwrap();
        assert_eq!(
            volumes.reserve_grow(V1, 3 * CHUNK),
            Err(EngineError::ReservationPending { volume: V1 })
        );
        volumes.cancel(&pending);
        assert_eq!(volumes.capacity().free_chunks, 2, "cancel gives the chunks back");
        assert_eq!(volumes.layout(V1).unwrap().size_bytes, 2 * CHUNK);
    }

    #[test]
    fn grow_is_visible_to_existing_holders() {
        let volumes = Volumes::new(2, 8);
        let map = create(&volumes, V1, CHUNK + 8192);
        assert!(map.pieces(CHUNK, 8192).is_ok());
        assert!(matches!(map.pieces(CHUNK, 12288), Err(StoreError::OutOfRange { .. })));
        // Growing within the last chunk takes no chunk.
        let layout = volumes.reserve_grow(V1, 2 * CHUNK).unwrap();
        assert_eq!(volumes.new_chunks(&layout), []);
        volumes.publish(layout);
        assert_eq!(volumes.capacity().free_chunks, 14);
        let layout = volumes.reserve_grow(V1, 3 * CHUNK + 4096).unwrap();
        assert_eq!(volumes.new_chunks(&layout).len(), 2);
        assert_eq!(map.size_bytes(), 2 * CHUNK, "not visible before publish");
        volumes.publish(layout.clone());
        assert_eq!(map.size_bytes(), 3 * CHUNK + 4096);
        assert_eq!(map.chunk(3), Some(layout.chunks[3]));
        assert_eq!(map.chunk(4), None);
        // Round-robin continues after the last chunk.
        let drives: Vec<u16> = layout.chunks.iter().map(|c| c.drive).collect();
        assert_eq!(drives, [0, 1, 0, 1]);
    }

    #[test]
    fn pieces_split_at_chunk_boundaries() {
        let volumes = Volumes::new(2, 4);
        let map = create(&volumes, V1, 3 * CHUNK);
        let layout = volumes.layout(V1).unwrap();
        let pieces: Vec<Piece> = map.pieces(CHUNK - 8192, CHUNK + 12288).unwrap().collect();
        assert_eq!(
            pieces,
            [
                Piece {
                    drive: layout.chunks[0].drive,
                    drive_offset_bytes: chunk_offset_bytes(layout.chunks[0].index) + CHUNK - 8192,
                    length_bytes: 8192,
                },
                Piece {
                    drive: layout.chunks[1].drive,
                    drive_offset_bytes: chunk_offset_bytes(layout.chunks[1].index),
                    length_bytes: CHUNK,
                },
                Piece {
                    drive: layout.chunks[2].drive,
                    drive_offset_bytes: chunk_offset_bytes(layout.chunks[2].index),
                    length_bytes: 4096,
                },
            ]
        );
        assert!(matches!(map.pieces(512, 4096), Err(StoreError::Unaligned { .. })));
        assert!(matches!(map.pieces(0, 100), Err(StoreError::Unaligned { .. })));
        assert!(matches!(map.pieces(u64::MAX - 4095, 8192), Err(StoreError::OutOfRange { .. })));
        assert_eq!(map.pieces(4096, 0).unwrap().count(), 0);
    }

    #[test]
    fn remove_frees_chunks_and_fences_holders() {
        let volumes = Volumes::new(2, 2);
        let map = create(&volumes, V1, 3 * CHUNK);
        let pending = volumes.reserve_grow(V1, 4 * CHUNK).unwrap();
        assert_eq!(volumes.capacity().free_chunks, 0);
        volumes.remove(V1);
        assert_eq!(volumes.capacity().free_chunks, 4);
        assert!(volumes.mapping(V1).is_none());
        assert!(matches!(map.pieces(0, 4096), Err(StoreError::VolumeRemoved { volume: V1 })));
        drop(pending);
        // The chunks are reusable.
        create(&volumes, V2, 4 * CHUNK);
        assert_eq!(volumes.capacity().free_chunks, 0);
        volumes.remove(VolumeId(99));
    }

    #[test]
    fn restore_checks_layouts() {
        let layout = |volume, size_bytes, chunks: &[(u16, u32)]| VolumeLayout {
            volume,
            size_bytes,
            chunks: chunks.iter().map(|&(drive, index)| ChunkId { drive, index }).collect(),
        };
        let check = |layouts: Vec<VolumeLayout>, expect: Result<(), EngineError>| {
            let volumes = Volumes::new(2, 3);
            assert_eq!(volumes.restore(layouts), expect);
            if expect.is_err() {
                assert_eq!(volumes.capacity().free_chunks, 6, "nothing applied on error");
            }
        };
        check(vec![layout(V1, CHUNK, &[(0, 0)]), layout(V2, 2 * CHUNK, &[(1, 0), (0, 2)])], Ok(()));
        check(
            vec![layout(V1, CHUNK, &[(0, 0)]), layout(V2, CHUNK, &[(0, 0)])],
            Err(EngineError::ChunkOwnedTwice {
                chunk: ChunkId { drive: 0, index: 0 },
                first: V1,
                second: V2,
            }),
        );
        check(
            vec![layout(V1, CHUNK, &[(2, 0)])],
            Err(EngineError::ChunkOutOfRange { volume: V1, chunk: ChunkId { drive: 2, index: 0 } }),
        );
        check(
            vec![layout(V1, CHUNK, &[(0, 3)])],
            Err(EngineError::ChunkOutOfRange { volume: V1, chunk: ChunkId { drive: 0, index: 3 } }),
        );
        check(
            vec![layout(V1, CHUNK + 4096, &[(0, 0)])],
            Err(EngineError::LayoutInconsistent {
                volume: V1,
                size_bytes: CHUNK + 4096,
                chunk_count: 1,
            }),
        );
        check(
            vec![layout(V1, CHUNK, &[(0, 0)]), layout(V1, CHUNK, &[(0, 1)])],
            Err(EngineError::VolumeExists { volume: V1 }),
        );
        let volumes = Volumes::new(2, 3);
        volumes.restore(vec![layout(V1, 2 * CHUNK, &[(0, 0), (1, 0)])]).unwrap();
        assert_eq!(volumes.capacity().free_chunks, 4);
        assert_eq!(volumes.mapping(V1).unwrap().chunk(1), Some(ChunkId { drive: 1, index: 0 }));
        assert_eq!(volumes.restore(vec![]), Err(EngineError::AlreadyRestored));
        // Allocation after a restore skips owned chunks.
        let next = volumes.reserve_create(V2, 4 * CHUNK).unwrap();
        assert!(next.chunks.iter().all(|c| c.index != 0), "{next:?}");
    }

    #[test]
    fn free_bitmap() {
        let mut free = FreeChunks::all_free(70);
        for expected in 0..70 {
            assert_eq!(free.take_lowest(), Some(expected));
        }
        assert_eq!(free.take_lowest(), None);
        free.give_back(65);
        assert!(free.take(65));
        assert!(!free.take(65));
    }
}
