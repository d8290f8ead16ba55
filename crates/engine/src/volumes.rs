//! The node's volumes as the engine sees them: an id and a provisioned size each. Volumes are
//! thin: creating or growing one reserves no drive space; the log engine maps a block only when
//! it is written, and refuses a write beyond the node's real capacity.
//!
//! Hot path: [`VolumeMap::check_range`] runs on every I/O (two atomic loads); the rest is
//! control plane.
//!
//! Changing a size is two-phase, so the metadata store stays the source of truth: `reserve_*`
//! records the intended size (so two changes of one volume cannot interleave), the caller
//! writes the record to its metadata store, then `publish` makes the size visible to the data
//! path (or `cancel` forgets it if the metadata write failed). At startup `restore` rebuilds
//! everything from the sizes the metadata store holds. Volumes only grow: shrinking would
//! silently drop data beyond the new end.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use types::{BLOCK_SIZE_BYTES, VOLUME_SIZE_BYTES_MAX};

use crate::compress::Compression;
use crate::store::StoreError;

const BLOCK_BYTES: u64 = BLOCK_SIZE_BYTES as u64;

/// A volume's identity inside the engine, assigned by the control plane and never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VolumeId(pub u64);

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "volume {}", self.0)
    }
}

/// A volume's provisioned size. Plain data: what a reservation proposes and a record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeLayout {
    pub volume: VolumeId,
    pub size_bytes: u64,
}

/// Why a volume change was refused. The messages are shown to users as they are.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
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
    #[error("{volume} has a size change in progress; retry when it has finished")]
    ReservationPending { volume: VolumeId },
    #[error("volumes can only be restored once, at startup, before any volume exists")]
    AlreadyRestored,
}

/// What the data path holds per volume: its id, its size (which grows while held) and whether
/// it was deleted. Shared (`Arc`) between the control plane and every data-path thread.
pub struct VolumeMap {
    volume: VolumeId,
    size_bytes: AtomicU64,
    removed: AtomicBool,
    /// `Compression::code` of how new writes are stored (off until set).
    compression: AtomicU8,
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
    fn new(volume: VolumeId, size_bytes: u64) -> Self {
        Self {
            volume,
            size_bytes: AtomicU64::new(size_bytes),
            removed: AtomicBool::new(false),
            compression: AtomicU8::new(Compression::Off.code()),
        }
    }

    /// How new writes to the volume are stored; blocks already written keep their form.
    pub fn compression(&self) -> Compression {
        Compression::from_code(self.compression.load(Ordering::Relaxed)).unwrap_or(Compression::Off)
    }

    pub fn set_compression(&self, compression: Compression) {
        self.compression.store(compression.code(), Ordering::Relaxed);
    }

    /// A map not registered anywhere, for tests and tools that drive a store directly.
    pub fn standalone(volume: VolumeId, size_bytes: u64) -> Arc<Self> {
        Arc::new(Self::new(volume, size_bytes))
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

    /// Checks that `[offset_bytes, offset_bytes + length_bytes)` is block aligned and within
    /// the volume, and that the volume was not deleted.
    pub fn check_range(&self, offset_bytes: u64, length_bytes: u64) -> Result<(), StoreError> {
        if self.is_removed() {
            return Err(StoreError::VolumeRemoved { volume: self.volume });
        }
        if offset_bytes % BLOCK_BYTES != 0 || length_bytes % BLOCK_BYTES != 0 {
            return Err(StoreError::Unaligned { offset_bytes, length_bytes });
        }
        let size_bytes = self.size_bytes();
        match offset_bytes.checked_add(length_bytes) {
            Some(end_bytes) if end_bytes <= size_bytes => Ok(()),
            _ => Err(StoreError::OutOfRange { offset_bytes, length_bytes, size_bytes }),
        }
    }

    fn publish_size(&self, size_bytes: u64) {
        assert!(size_bytes >= self.size_bytes(), "volumes only grow");
        self.size_bytes.store(size_bytes, Ordering::Release);
    }

    /// Marks the map deleted; holders' I/O fails from now on.
    pub fn mark_removed(&self) {
        self.removed.store(true, Ordering::Release);
    }
}

#[derive(Default)]
struct State {
    published: HashMap<VolumeId, Arc<VolumeMap>>,
    pending: HashMap<VolumeId, VolumeLayout>,
}

/// The registry of volumes and their published [`VolumeMap`]s. Used by the control plane
/// (`Send + Sync`, one lock); the data path only holds the maps it hands out.
///
/// Per volume, the caller serialises changes: `reserve_create`/`reserve_grow`, then exactly one
/// of `publish` or `cancel`; `remove` when no I/O is in flight for the volume.
#[derive(Default)]
pub struct Volumes {
    state: Mutex<State>,
}

impl fmt::Debug for Volumes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Volumes").field("provisioned_bytes", &self.provisioned_bytes()).finish()
    }
}

impl Volumes {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock is a bug that may have left the state half changed.
        self.state.lock().expect("volumes lock poisoned by an earlier panic")
    }

    fn check_size(volume: VolumeId, size_bytes: u64) -> Result<(), EngineError> {
        if size_bytes == 0 || size_bytes % BLOCK_BYTES != 0 || size_bytes > VOLUME_SIZE_BYTES_MAX {
            return Err(EngineError::SizeInvalid { volume, size_bytes });
        }
        Ok(())
    }

    /// Rebuilds the registry from the sizes the metadata store holds; checks them all first.
    pub fn restore(&self, layouts: Vec<VolumeLayout>) -> Result<(), EngineError> {
        let mut state = self.lock();
        if !state.published.is_empty() || !state.pending.is_empty() {
            return Err(EngineError::AlreadyRestored);
        }
        let mut seen = HashSet::new();
        for layout in &layouts {
            Self::check_size(layout.volume, layout.size_bytes)?;
            if !seen.insert(layout.volume) {
                return Err(EngineError::VolumeExists { volume: layout.volume });
            }
        }
        for layout in layouts {
            let map = Arc::new(VolumeMap::new(layout.volume, layout.size_bytes));
            state.published.insert(layout.volume, map);
        }
        Ok(())
    }

    /// Proposes a new volume; it is not visible until `publish`. Takes no drive space.
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
        let layout = VolumeLayout { volume, size_bytes };
        state.pending.insert(volume, layout);
        Ok(layout)
    }

    /// Proposes growing a volume to `new_size_bytes`; refuses to shrink.
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
        let Some(map) = state.published.get(&volume) else {
            return Err(EngineError::VolumeNotFound { volume });
        };
        let size_bytes = map.size_bytes();
        if new_size_bytes < size_bytes {
            return Err(EngineError::ShrinkRefused {
                volume,
                size_bytes,
                requested_bytes: new_size_bytes,
            });
        }
        let layout = VolumeLayout { volume, size_bytes: new_size_bytes };
        state.pending.insert(volume, layout);
        Ok(layout)
    }

    /// Forgets a reservation whose metadata write failed.
    pub fn cancel(&self, layout: &VolumeLayout) {
        let pending = self.lock().pending.remove(&layout.volume);
        assert_eq!(pending.as_ref(), Some(layout), "cancel of a layout that is not reserved");
    }

    /// Makes a reserved size visible to the data path; a grow is seen by existing holders.
    pub fn publish(&self, layout: VolumeLayout) {
        let mut state = self.lock();
        let pending = state.pending.remove(&layout.volume);
        assert_eq!(pending.as_ref(), Some(&layout), "publish of a layout that is not reserved");
        match state.published.get(&layout.volume) {
            Some(map) => map.publish_size(layout.size_bytes),
            None => {
                let map = Arc::new(VolumeMap::new(layout.volume, layout.size_bytes));
                state.published.insert(layout.volume, map);
            }
        }
    }

    /// Forgets a volume (and a pending reservation of it). Holders of its map see
    /// `is_removed`. Its data is dropped by the store (`LogHandle::delete_volume`).
    pub fn remove(&self, volume: VolumeId) {
        let mut state = self.lock();
        state.pending.remove(&volume);
        if let Some(map) = state.published.remove(&volume) {
            map.mark_removed();
        }
    }

    /// The map the data path uses for a published volume.
    pub fn mapping(&self, volume: VolumeId) -> Option<Arc<VolumeMap>> {
        self.lock().published.get(&volume).map(Arc::clone)
    }

    /// The sum of the published volumes' sizes (thin: may exceed the node's capacity).
    pub fn provisioned_bytes(&self) -> u64 {
        self.lock().published.values().map(|map| map.size_bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: VolumeId = VolumeId(1);
    const V2: VolumeId = VolumeId(2);
    const GIB: u64 = 1 << 30;

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
    fn thin_volumes_take_no_space_and_count_provisioned() {
        let volumes = Volumes::new();
        let layout = volumes.reserve_create(V1, 1 << 50).unwrap();
        assert!(volumes.mapping(V1).is_none(), "not visible before publish");
        assert_eq!(volumes.provisioned_bytes(), 0);
        volumes.publish(layout);
        create(&volumes, V2, GIB);
        assert_eq!(volumes.provisioned_bytes(), (1 << 50) + GIB);
    }

    #[test]
    fn refusals_have_clear_messages() {
        let volumes = Volumes::new();
        assert!(matches!(volumes.reserve_create(V1, 4095), Err(EngineError::SizeInvalid { .. })));
        assert!(matches!(volumes.reserve_create(V1, 0), Err(EngineError::SizeInvalid { .. })));
        let too_big = VOLUME_SIZE_BYTES_MAX + 4096;
        assert!(matches!(
            volumes.reserve_create(V1, too_big),
            Err(EngineError::SizeInvalid { .. })
        ));
        create(&volumes, V1, 2 * GIB);
        assert_eq!(volumes.reserve_create(V1, GIB), Err(EngineError::VolumeExists { volume: V1 }));
        let shrink = volumes.reserve_grow(V1, GIB).unwrap_err();
        assert_eq!(
            shrink,
            EngineError::ShrinkRefused { volume: V1, size_bytes: 2 * GIB, requested_bytes: GIB }
        );
        assert!(shrink.to_string().contains("destroy data"), "{shrink}");
        assert_eq!(volumes.reserve_grow(V2, GIB), Err(EngineError::VolumeNotFound { volume: V2 }));
        let pending = volumes.reserve_grow(V1, 3 * GIB).unwrap();
        assert_eq!(
            volumes.reserve_grow(V1, 3 * GIB),
            Err(EngineError::ReservationPending { volume: V1 })
        );
        volumes.cancel(&pending);
        assert_eq!(volumes.mapping(V1).unwrap().size_bytes(), 2 * GIB);
    }

    #[test]
    fn grow_is_visible_to_existing_holders_and_ranges_are_checked() {
        let volumes = Volumes::new();
        let map = create(&volumes, V1, 8192);
        assert!(map.check_range(4096, 4096).is_ok());
        assert!(matches!(map.check_range(4096, 8192), Err(StoreError::OutOfRange { .. })));
        assert!(matches!(map.check_range(512, 4096), Err(StoreError::Unaligned { .. })));
        assert!(matches!(map.check_range(0, 100), Err(StoreError::Unaligned { .. })));
        assert!(matches!(
            map.check_range(u64::MAX - 4095, 8192),
            Err(StoreError::OutOfRange { .. })
        ));
        let layout = volumes.reserve_grow(V1, 3 * 4096).unwrap();
        assert_eq!(map.size_bytes(), 8192, "not visible before publish");
        volumes.publish(layout);
        assert!(map.check_range(8192, 4096).is_ok());
    }

    #[test]
    fn remove_fences_holders() {
        let volumes = Volumes::new();
        let map = create(&volumes, V1, GIB);
        let _pending = volumes.reserve_grow(V1, 2 * GIB).unwrap();
        volumes.remove(V1);
        assert!(volumes.mapping(V1).is_none());
        assert!(matches!(map.check_range(0, 4096), Err(StoreError::VolumeRemoved { volume: V1 })));
        assert_eq!(volumes.provisioned_bytes(), 0);
        volumes.remove(VolumeId(99));
        create(&volumes, V1, GIB);
    }

    #[test]
    fn restore_checks_sizes() {
        let layout = |volume, size_bytes| VolumeLayout { volume, size_bytes };
        let volumes = Volumes::new();
        assert!(matches!(
            volumes.restore(vec![layout(V1, 4097)]),
            Err(EngineError::SizeInvalid { .. })
        ));
        assert_eq!(
            volumes.restore(vec![layout(V1, GIB), layout(V1, GIB)]),
            Err(EngineError::VolumeExists { volume: V1 })
        );
        assert!(volumes.mapping(V1).is_none(), "nothing applied on error");
        volumes.restore(vec![layout(V1, GIB), layout(V2, 2 * GIB)]).unwrap();
        assert_eq!(volumes.mapping(V2).unwrap().size_bytes(), 2 * GIB);
        assert_eq!(volumes.restore(vec![]), Err(EngineError::AlreadyRestored));
    }
}
