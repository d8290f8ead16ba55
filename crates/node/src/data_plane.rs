//! The seam between the control plane and the data path (drives, chunk allocation, NVMe/TCP).
//!
//! The control plane decides what volumes exist; the data path stores and serves them. They meet
//! here, in two traits:
//!
//! - [`DataPathBuilder`] runs once at start: it formats the drives on the node's first start
//!   (`io::format_drives`), then opens them (`io::open_drives`), rebuilds the chunk allocator
//!   from the volume records, starts the data-path threads and returns the running
//!   [`DataPlane`].
//! - [`DataPlane`] is the running data path as the volume service sees it. Space is reserved in
//!   two phases around the metadata write: `reserve_*` before it, then `publish` once the record
//!   is durable, or `cancel` if the write failed. This follows `engine::Volumes` one to one
//!   (`reserve_create`/`reserve_grow` -> `publish` | `cancel`, `remove`), with records in place of
//!   `VolumeLayout`s: `VolumeLayout { volume: VolumeId(record.id), size_bytes, chunks }`. A crash between the two leaks nothing: the
//!   allocator is rebuilt from the durable records at the next start, and a reservation that
//!   never reached a record is simply not there. A change of who may connect reserves nothing:
//!   `set_host_access` follows the durable record.
//!
//! The NVMe/TCP data path (`crate::nvme`) is the one implementation `Node::start` uses; tests
//! may supply their own builder through `Node::start_with`.

use crate::metrics::Registry;
use meta::{Chunk, VolumeRecord};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// Space on the node's drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// The unit in which drive space is given to volumes; 0 when nothing allocates chunks.
    pub chunk_size_bytes: u64,
}

/// Why the data path refused or failed an operation.
#[derive(Debug, thiserror::Error)]
pub enum DataPlaneError {
    /// The drives have no room: an expected condition, reported to the user as `no_space`.
    #[error("not enough free space: {requested_bytes} bytes requested, {free_bytes} bytes free")]
    NoSpace { requested_bytes: u64, free_bytes: u64 },
    /// Anything else; reported to the user as an internal error.
    #[error(transparent)]
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

impl DataPlaneError {
    pub fn failed(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Failed(error.into())
    }
}

/// The node's drives: where they live, whose they are, and their geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriveSet {
    /// `DATA-DIR/drives`.
    pub dir: PathBuf,
    pub node_uuid: [u8; 16],
    pub count: u16,
    pub size_bytes: u64,
}

/// What the data path needs to start.
pub struct DataPathContext {
    pub drives: DriveSet,
    /// Where to serve NVMe/TCP.
    pub nvme_listen: SocketAddr,
    /// Every volume in the metadata store: the allocator is rebuilt from their chunks and each is
    /// served from the start. The volume service publishes only later changes.
    pub volumes: Vec<VolumeRecord>,
    /// Where to record per-volume I/O metrics; every volume in `volumes` is registered already.
    pub metrics: Arc<Registry>,
}

/// Brings up the data path of a node. Used once, by `Node::start_with`.
pub trait DataPathBuilder: Send {
    /// Creates the node's drives on its first start.
    ///
    /// Called before the node record is written, so if the node crashes in here the next start
    /// is a first start again: formatting must overwrite whatever a partial format left.
    fn format_drives(&mut self, drives: &DriveSet) -> Result<(), DataPlaneError>;

    /// Opens the drives, loads the volumes and starts serving.
    fn start(
        self: Box<Self>,
        context: DataPathContext,
    ) -> Result<Arc<dyn DataPlane>, DataPlaneError>;
}

/// The running data path, as the control plane drives it.
///
/// The volume service calls the mutating methods one at a time (it serialises create, resize and
/// delete), from a blocking thread of the control plane; they may block briefly.
pub trait DataPlane: Send + Sync {
    /// Reserves the chunks of a new volume `id` of `size_bytes` and returns them, in volume
    /// order. They are not yet the volume's: [`DataPlane::publish`] or [`DataPlane::cancel`]
    /// follows. May do I/O (zeroing the chunks a deleted volume left behind); on failure it
    /// keeps nothing reserved.
    fn reserve_create(&self, id: u64, size_bytes: u64) -> Result<Vec<Chunk>, DataPlaneError>;

    /// Reserves what `volume` needs to grow to `size_bytes` (larger than its size) and returns
    /// its complete chunk list after growing: `volume.chunks` followed by the new chunks.
    fn reserve_grow(
        &self,
        volume: &VolumeRecord,
        size_bytes: u64,
    ) -> Result<Vec<Chunk>, DataPlaneError>;

    /// The metadata write of `proposed` failed: give back what its `reserve_*` reserved.
    /// `proposed` is exactly the record built from that reservation (the new volume, or the
    /// volume grown to its new size and chunk list).
    fn cancel(&self, proposed: &VolumeRecord);

    /// The volume's record, created or grown, is durable: serve it as it now is.
    fn publish(&self, volume: &VolumeRecord);

    /// The volume's record is deleted: stop serving it and free its chunks.
    fn remove(&self, volume: &VolumeRecord);

    /// The volume's record with a changed `host_access` is durable: from now on only the hosts
    /// it allows may connect to the volume's subsystem or see it in the discovery log, and
    /// controllers of hosts it no longer allows are disconnected. (Published volumes, and those
    /// the data path starts with, are served with their record's `host_access` already.)
    fn set_host_access(&self, volume: &VolumeRecord);

    fn capacity(&self) -> Capacity;

    /// The address NVMe/TCP is served on, or `None` if this data path serves no I/O.
    fn nvme_addr(&self) -> Option<SocketAddr>;

    /// Stops serving and joins the data-path threads. Called once, when the node stops, after
    /// the REST API stopped.
    fn shutdown(&self);
}
