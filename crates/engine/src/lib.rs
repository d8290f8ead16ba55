//! The storage engine: how a node's drives are formatted, how volumes map onto them, and the
//! store every frontend reads and writes through.
//!
//! Sans-IO: the engine is generic over [`Drive`] and never opens a file, spawns a task or reads a
//! clock; `io` implements `Drive` with io_uring, and [`testing`] (feature `testing`) implements it
//! in RAM with crashes and injected faults. The pieces:
//! - [`format`](mod@format): the on-drive format (superblock, chunk geometry), docs/format-drive-v1.md;
//! - [`Volumes`]: the control plane's chunk allocator and the published [`VolumeMap`]s;
//! - [`VolumeStore`]: what frontends call; [`ChunkStore`] implements it with group commit;
//! - [`local_sync`]: the single-threaded wake-up primitive the data path waits on.
//!
//! Today a volume lives in place in the chunks it owns. The log-structured engine will implement
//! the same traits.

mod chunk_store;
mod drive;
pub mod format;
mod layout;
pub mod local_sync;
pub mod log;
mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use chunk_store::{ChunkStore, DriveLatches};
pub use drive::{Drive, DriveError, DriveOperation};
pub use format::{NodeUuid, Superblock, SuperblockError, CHUNK_SIZE_BYTES};
pub use layout::{
    Capacity, ChunkId, EngineError, Piece, Pieces, VolumeId, VolumeLayout, VolumeMap, Volumes,
    MAP_LEAF_CHUNKS,
};
pub use store::{StoreError, VolumeStore};
