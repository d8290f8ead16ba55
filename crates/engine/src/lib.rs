//! The storage engine: how a node's drives are formatted, which volumes exist, and the store
//! every frontend reads and writes through.
//!
//! Sans-IO: the engine is generic over [`Drive`] and never opens a file, spawns a task or reads a
//! clock; `io` implements `Drive` with io_uring, and [`testing`] (feature `testing`) implements it
//! in RAM with crashes and injected faults. The pieces:
//! - [`format`](mod@format): the drive superblock, docs/format-drive.md;
//! - [`log`]: the log-structured engine ([`log::LogEngine`], one [`log::LogHandle`] per
//!   data-path thread), docs/format-log-v1.md; it implements [`VolumeStore`];
//! - [`Volumes`]: the control plane's registry of thin volumes and their [`VolumeMap`]s;
//! - [`DriveLatches`]: drives latched failed, shared by every thread;
//! - [`local_sync`]: the single-threaded wake-up primitive the data path waits on.

pub mod compress;
mod drive;
pub mod erasure;
pub mod format;
pub mod join;
mod latches;
pub mod local_sync;
pub mod log;
mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod volumes;

pub use drive::{check_request, Drive, DriveError, DriveOperation};
pub use format::{NodeUuid, Superblock, SuperblockError};
pub use latches::DriveLatches;
pub use store::{StoreError, VolumeStore};
pub use volumes::{EngineError, VolumeId, VolumeLayout, VolumeMap, Volumes};
