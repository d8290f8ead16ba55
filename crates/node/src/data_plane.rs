//! The seam between the control plane and the data path (drives, the log engine, NVMe/TCP).
//!
//! The control plane decides what volumes exist; the data path stores and serves them. They meet
//! here, in two traits:
//!
//! - [`DataPathBuilder`] runs once at start: it formats the drives on the node's first start
//!   (`io::format_drives`, then the log area), then opens them (`io::open_drives`, then
//!   recovery of the log engine), registers the volume records, starts the data-path threads
//!   and returns the running [`DataPlane`].
//! - [`DataPlane`] is the running data path as the volume service sees it. Volumes are thin:
//!   creating or growing one takes no drive space (the records' chunk lists stay empty), and a
//!   write beyond the node's real capacity fails with Capacity Exceeded. Size changes are still
//!   two-phase around the metadata write: `reserve_*` before it, then `publish` once the record
//!   is durable, or `cancel` if the write failed. This follows `engine::Volumes` one to one
//!   (`reserve_create`/`reserve_grow` -> `publish` | `cancel`, `remove`), with records in place of
//!   `VolumeLayout { volume: VolumeId(record.id), size_bytes }`. A crash between the two leaks
//!   nothing: the registry is rebuilt from the durable records at the next start, and the data
//!   of a volume whose record is gone is dropped then. A change of who may connect reserves
//!   nothing: `set_host_access` follows the durable record.
//!
//! The NVMe/TCP data path (`crate::nvme`) is the one implementation `Node::start` uses; tests
//! may supply their own builder through `Node::start_with`.

use crate::metrics::Registry;
use crate::scrub::ScrubPhase;
use engine::erasure::ErasureScheme;
use engine::log::ScrubFinding;
use meta::{Chunk, SnapshotRecord, VolumeRecord};
use nvmf::target::AnaState;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// Space on the node's drives.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Capacity {
    /// What hosts may map in total (the drives' space less the engine's reserve and overhead).
    pub total_bytes: u64,
    /// What hosts may still map: `total_bytes - mapped_bytes`.
    pub free_bytes: u64,
    /// The unit in which drive space is given to volumes; 0 for thin volumes (the log engine).
    pub chunk_size_bytes: u64,
    /// The sum of the volumes' sizes; thin, so it may exceed `total_bytes`.
    pub provisioned_bytes: u64,
    /// Bytes of volume blocks written and not deallocated.
    pub mapped_bytes: u64,
    /// Drive space in use: live data, garbage not yet collected, checkpoints.
    pub physical_used_bytes: u64,
    /// Device bytes written per host byte written (0 before any write).
    pub write_amplification: f64,
    /// Blocks that failed their checksum when read (returned as errors, never as data).
    pub checksum_errors: u64,
    /// Drive space the mapped blocks take: less than `mapped_bytes` when compressed.
    pub mapped_physical_bytes: u64,
    /// Every drive, in index order, and whether it is latched failed.
    pub drives: Vec<DriveStatus>,
    /// The engine's traffic since the node started.
    pub counters: EngineCounters,
    /// The background scrub.
    pub scrub: ScrubReport,
    /// Erasure coding, degraded reads and drive rebuilds.
    pub erasure: ErasureReport,
}

/// The node's erasure coding as the data path reports it (`crate::rebuild`).
#[derive(Debug, Clone, PartialEq)]
pub struct ErasureReport {
    pub scheme: ErasureScheme,
    /// Reads rebuilt from the other drives (their drive failed or could not be read).
    pub reconstructed_reads: u64,
    /// Reads of a block that failed its checksum, rebuilt intact from parity.
    pub repaired_reads: u64,
    /// Reads that could not be served: their stripe lost more than the parity covers.
    pub unrecoverable_reads: u64,
    /// The rebuild pace, in MiB per second (0: no limit).
    pub rebuild_mb_per_s: u64,
    /// The rebuild pace while hosts keep the node busy (0: no limit).
    pub rebuild_busy_mb_per_s: u64,
    /// The rebuild in progress.
    pub rebuild: Option<RebuildReport>,
    /// How the last rebuild of this run ended.
    pub last_rebuild: Option<RebuildEnd>,
    /// Bytes every rebuild of this run wrote, together (a counter).
    pub rebuild_bytes_written_total: u64,
}

impl Default for ErasureReport {
    fn default() -> Self {
        Self {
            scheme: ErasureScheme::NONE,
            reconstructed_reads: 0,
            repaired_reads: 0,
            unrecoverable_reads: 0,
            rebuild_mb_per_s: 0,
            rebuild_busy_mb_per_s: 0,
            rebuild: None,
            last_rebuild: None,
            rebuild_bytes_written_total: 0,
        }
    }
}

/// A drive rebuild in progress.
#[derive(Debug, Clone, PartialEq)]
pub struct RebuildReport {
    pub drive: u16,
    pub segments_done: u32,
    pub segments_total: u32,
    pub bytes_written: u64,
    pub elapsed_seconds: f64,
    /// Why the last step failed (another drive could not be read), while it retries.
    pub stalled: Option<String>,
    /// Whether it writes at the busy pace now, hosts keeping the node busy.
    pub slowed_for_hosts: bool,
}

impl RebuildReport {
    /// Segments examined, in percent of all.
    pub fn percent(&self) -> f64 {
        if self.segments_total == 0 {
            return 0.0;
        }
        f64::from(self.segments_done) * 100.0 / f64::from(self.segments_total)
    }

    /// The average write rate so far.
    pub fn bytes_per_second(&self) -> u64 {
        if self.elapsed_seconds <= 0.0 {
            return 0;
        }
        (self.bytes_written as f64 / self.elapsed_seconds) as u64
    }

    /// Seconds left at the pace the segments were examined so far; `None` before the first.
    pub fn eta_seconds(&self) -> Option<u64> {
        if self.segments_done == 0 {
            return None;
        }
        let left = f64::from(self.segments_total.saturating_sub(self.segments_done));
        Some((self.elapsed_seconds * left / f64::from(self.segments_done)).ceil() as u64)
    }
}

/// How a drive rebuild ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RebuildEnd {
    pub drive: u16,
    /// The drive is whole again; false: the rebuild failed with `error`.
    pub finished: bool,
    pub error: Option<String>,
    pub bytes_written: u64,
    pub seconds: f64,
}

/// Logical bytes per byte they take on the drives; 1.0 when nothing is stored.
pub fn data_reduction(logical_bytes: u64, physical_bytes: u64) -> f64 {
    if physical_bytes == 0 {
        1.0
    } else {
        logical_bytes as f64 / physical_bytes as f64
    }
}

/// The background scrub as the data path reports it (`crate::scrub`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ScrubReport {
    pub phase: ScrubPhase,
    /// The most it reads, in MiB per second (0: off).
    pub rate_mb_per_s: u64,
    /// The most it reads while hosts keep the node busy, and whether it does now.
    pub busy_rate_mb_per_s: u64,
    pub slowed_for_hosts: bool,
    pub passes_completed: u64,
    pub blocks_verified: u64,
    /// Damage found (blocks and header chains, counted in each pass that finds them).
    pub errors: u64,
    /// How far the current pass is, 0 to 100.
    pub pass_progress_percent: f64,
    /// The most recent damage found, oldest first (bounded by the engine).
    pub findings: Vec<ScrubFinding>,
}

/// The storage engine's traffic since the node started: what hosts wrote, what reached the
/// drives, and how well group commit and GC are doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineCounters {
    pub host_bytes_written: u64,
    /// Everything written to the drives: data, batch headers, GC copies, checkpoints.
    pub device_bytes_written: u64,
    /// Host batches made durable and the blocks they carried (their ratio is the group-commit
    /// width).
    pub host_batches: u64,
    pub host_batch_blocks: u64,
    pub drive_syncs: u64,
    pub gc_relocated_blocks: u64,
    pub gc_segments_cleaned: u64,
    /// Of those, segments host writes cleaned themselves for space (background GC behind).
    pub gc_segments_cleaned_inline: u64,
    /// Blocks read-triggered defragmentation rewrote back to back.
    pub defrag_relocated_blocks: u64,
    /// Free segments laid out ahead of the log, and the zeros written over holes for it.
    pub segments_laid_out: u64,
    pub laid_out_bytes: u64,
    pub checkpoints: u64,
    /// Bytes of index checkpoints written (in `device_bytes_written` too).
    pub checkpoint_bytes_written: u64,
}

/// One drive of the node as the data path sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriveStatus {
    pub index: u16,
    /// The drive file, or the block device or file given with `--drive`.
    pub path: PathBuf,
    /// Latched failed after a failed write, sync or punch, or found unusable at start
    /// (`engine::DriveLatches`): no I/O reaches it until it is replaced.
    pub failed: bool,
    /// A replacement whose contents are being rebuilt from the other drives; how far, in whole
    /// percent.
    pub rebuild_percent: Option<u8>,
}

/// One volume's space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VolumeSpace {
    pub provisioned_bytes: u64,
    pub mapped_bytes: u64,
    pub physical_used_bytes: u64,
}

/// Why the data path refused or failed an operation.
#[derive(Debug, thiserror::Error)]
pub enum DataPlaneError {
    /// The drives have no room: an expected condition, reported to the user as `no_space`.
    #[error("not enough free space: {requested_bytes} bytes requested, {free_bytes} bytes free")]
    NoSpace { requested_bytes: u64, free_bytes: u64 },
    /// The request names something the data path does not have (a port, say): the user's
    /// mistake, reported as a bad request.
    #[error("{0}")]
    Invalid(String),
    /// The volume's chain of snapshots is as deep as the engine allows: reported to the user
    /// as `snapshot_limit`.
    #[error("{0}")]
    SnapshotLimit(String),
    /// The node has no drive of this index: reported as `drive_not_found`.
    #[error("this node has no drive {index}: its drives are 0 to {}", count.saturating_sub(1))]
    DriveNotFound { index: u16, count: u16 },
    /// A drive cannot be replaced now; the reason says why (`replace_refused`).
    #[error("drive {index} cannot be replaced: {reason}")]
    ReplaceRefused { index: u16, reason: String },
    /// The new drive given for a replacement is unusable (`invalid_drive`).
    #[error("{0}")]
    InvalidDrive(String),
    /// Anything else; reported to the user as an internal error.
    #[error(transparent)]
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

impl DataPlaneError {
    pub fn failed(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Failed(error.into())
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }
}

/// The node's drives: where they live, whose they are, and their geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriveSet {
    /// `DATA-DIR/drives`.
    pub dir: PathBuf,
    /// External drives (`--drive`), in the order given; empty for drive files in `dir`. On the
    /// first start drive `i` is `external[i]`; later, each drive's index is in its superblock.
    pub external: Vec<PathBuf>,
    pub node_uuid: [u8; 16],
    pub count: u16,
    pub size_bytes: u64,
    /// The erasure coding a first start formats the drives with (later starts keep what the
    /// drives record).
    pub erasure: ErasureScheme,
    /// A first start writes zeros over the drive files before formatting the log
    /// (`NodeConfig::lay_out_drives`).
    pub lay_out: bool,
}

/// One NVMe/TCP path to a volume: a listener of this node and the volume's ANA state there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePath {
    /// The NVMe port ID (the listener's place in `--nvme-listen`, from 1).
    pub port_id: u16,
    pub address: SocketAddr,
    pub state: AnaState,
}

/// What the data path needs to start.
pub struct DataPathContext {
    pub drives: DriveSet,
    /// Where to serve NVMe/TCP: one listener (an NVMe port, ID `i + 1`) per address.
    pub nvme_listen: Vec<SocketAddr>,
    /// Where to serve every volume open to any host as an NBD export; `None` serves no NBD.
    pub nbd_listen: Option<SocketAddr>,
    /// Every volume in the metadata store: each is served from the start, and data of volumes
    /// not among them (deleted just before a crash) is dropped. The volume service publishes only later changes.
    pub volumes: Vec<VolumeRecord>,
    /// Every snapshot in the metadata store: the engine keeps their data too (ids of neither a
    /// volume nor a snapshot are dropped). A single node serves each from the start; a cluster
    /// node (its store names every snapshot of the cluster) serves those whose copy it holds
    /// once its reconciler has seen them.
    pub snapshots: Vec<SnapshotRecord>,
    /// Where to record per-volume I/O metrics; every volume in `volumes` is registered already.
    pub metrics: Arc<Registry>,
    /// The memory drives of a memory-backed node (NOT DURABLE), so a replacement can make a new
    /// one; `None` for drive files and external drives.
    pub memory_drives: Option<Arc<io::MemoryDrives>>,
    /// On a cluster node, what the replication service needs: then every volume in `volumes`
    /// is replicated. `None` on a single node.
    pub replication: Option<crate::replicate::ReplicationSetup>,
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

/// A replicated volume whose host writes this node holds for a snapshot
/// ([`DataPlane::freeze_replicated`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldWrites {
    /// Names the hold, for [`DataPlane::thaw_replicated`].
    pub token: u64,
    /// The epoch this node serves the volume in.
    pub epoch: u64,
    /// The node ids of the replicas whose copies hold exactly what this node's holds.
    pub copies: Vec<u32>,
}

/// The refusal of a data path that serves no snapshots.
fn no_snapshots(volume: &types::VolumeName) -> DataPlaneError {
    DataPlaneError::failed(format!("volume {volume}: this data path serves no snapshots"))
}

/// The running data path, as the control plane drives it.
///
/// The volume service calls the mutating methods one at a time (it serialises create, resize and
/// delete), from a blocking thread of the control plane; they may block briefly.
pub trait DataPlane: Send + Sync {
    /// Reserves a new volume `id` of `size_bytes` and returns its chunks, in volume order
    /// (none for thin volumes). It is not yet served: [`DataPlane::publish`] or
    /// [`DataPlane::cancel`] follows. On failure it keeps nothing reserved.
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

    /// The volume's record is deleted: stop serving it and free its space (durably: its blocks
    /// never reappear, even after a crash).
    fn remove(&self, volume: &VolumeRecord);

    /// Every replicated volume of the cluster (cluster nodes): the replication service's
    /// manager looks after them while this node is the cluster manager.
    fn set_cluster_volumes(&self, _volumes: Vec<u64>) {}

    /// Serves the reserved volume `volume` as a replica of a replicated volume (cluster
    /// nodes): its I/O goes through the replication service, and its paths stay ANA
    /// inaccessible until this node becomes its serving primary.
    fn publish_replicated(&self, volume: &VolumeRecord) -> Result<(), DataPlaneError> {
        Err(DataPlaneError::failed(format!(
            "volume {}: this data path does not replicate",
            volume.name
        )))
    }

    /// The replicated volume `volume`, served here, grew to `size_bytes` in its record (cluster
    /// nodes; the reconciler calls it when it sees the record grow): reserve the space, grow the
    /// volume here, let its replication take writes up to the new end, then tell hosts. On
    /// failure nothing grew here and the reconciler tries again.
    fn grow_replicated(
        &self,
        volume: &VolumeRecord,
        _size_bytes: u64,
    ) -> Result<(), DataPlaneError> {
        Err(DataPlaneError::failed(format!(
            "volume {}: this data path does not replicate",
            volume.name
        )))
    }

    /// Holds the replicated volume's host writes on this node, its serving primary (cluster
    /// nodes), for a snapshot of every copy: answers once every write taken before completed,
    /// with the replicas whose copies then hold exactly what this node's holds. The hold lasts
    /// until [`DataPlane::thaw_replicated`] or `hold_ms` (at most 10 s), whichever comes first.
    fn freeze_replicated(
        &self,
        volume: &VolumeRecord,
        _hold_ms: u64,
    ) -> Result<HeldWrites, DataPlaneError> {
        Err(DataPlaneError::failed(format!(
            "volume {}: this data path does not replicate",
            volume.name
        )))
    }

    /// Ends the hold `token` names: `Ok` if it lasted until now, in the term it began in (so
    /// every copy snapshotted meanwhile is the same point in time).
    fn thaw_replicated(&self, volume: &VolumeRecord, _token: u64) -> Result<(), DataPlaneError> {
        Err(DataPlaneError::failed(format!(
            "volume {}: this data path does not replicate",
            volume.name
        )))
    }

    /// Serves snapshot `snapshot` of the volume `volume_id`, whose data this node holds
    /// (cluster nodes: the reconciler serves each snapshot the node's engine holds a copy of).
    /// Does nothing if it is served already.
    fn publish_snapshot(&self, _volume_id: u64, _snapshot: &SnapshotRecord) {}

    /// Drops this node's data of `id` (a snapshot or volume no record names any more: a
    /// cluster node's copy of a snapshot deleted while it was away, or one whose taking failed),
    /// and stops serving it.
    fn drop_unnamed(&self, _id: u64) {}

    /// Makes volume `id`, which no record names yet, a clone of snapshot `snapshot_id` here,
    /// durably (cluster nodes: every member of a new clone makes its copy before the clone's
    /// record is written; the reconciler then serves it as any replica).
    fn clone_unnamed(&self, id: u64, snapshot_id: u64) -> Result<(), DataPlaneError> {
        let _ = (id, snapshot_id);
        Err(DataPlaneError::failed("this data path serves no snapshots"))
    }

    /// The volume's record with a changed `host_access` is durable: from now on only the hosts
    /// it allows may connect to the volume's subsystem or see it in the discovery log, and
    /// controllers of hosts it no longer allows are disconnected. (Published volumes, and those
    /// the data path starts with, are served with their record's `host_access` already.)
    fn set_host_access(&self, volume: &VolumeRecord);

    /// The volume's record with a changed `compression` is durable: store the volume's new
    /// writes that way from now on (blocks already written keep their form). Published
    /// volumes, and those the data path starts with, get their record's setting already.
    fn set_compression(&self, _volume: &VolumeRecord) {}

    /// Takes snapshot `snapshot` (its record is durable) of the served `volume`, durably, and
    /// serves it read-only over NVMe/TCP. Instant; the volume's I/O goes on (the snapshot holds
    /// every write completed before the call).
    fn snapshot(
        &self,
        volume: &VolumeRecord,
        snapshot: &SnapshotRecord,
    ) -> Result<(), DataPlaneError> {
        let _ = snapshot;
        Err(no_snapshots(&volume.name))
    }

    /// Makes the reserved, not yet published volume `clone` (its record is durable) a writable
    /// clone of snapshot `snapshot_id`, durably. [`DataPlane::publish`] follows, or on failure
    /// [`DataPlane::cancel`].
    fn clone_snapshot(&self, clone: &VolumeRecord, snapshot_id: u64) -> Result<(), DataPlaneError> {
        let _ = snapshot_id;
        Err(no_snapshots(&clone.name))
    }

    /// Makes the served `volume` read what its snapshot `snapshot_id` holds, durably: its I/O
    /// is fenced and drained first and served again after.
    fn rollback(&self, volume: &VolumeRecord, snapshot_id: u64) -> Result<(), DataPlaneError> {
        let _ = snapshot_id;
        Err(no_snapshots(&volume.name))
    }

    /// Makes the replicated `volume`, which this node serves as primary, read what its
    /// snapshot `snapshot_id` holds here, by rewriting through its replication (as host writes
    /// and trims, so every copy in sync gets each) the blocks that may differ, in block order;
    /// `progress(position, volume_blocks)` after each piece. Returns the blocks rewritten. Not atomic: interrupted, the
    /// volume holds some of the snapshot's blocks, and running it again finishes it.
    fn rollback_replicated(
        &self,
        volume: &VolumeRecord,
        snapshot_id: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<u64, DataPlaneError> {
        let _ = (snapshot_id, progress);
        Err(no_snapshots(&volume.name))
    }

    /// The snapshot's record is deleted: free its data (durably; blocks clones or the volume
    /// still read stay). Failures are logged: the data is then dropped at the next start.
    fn remove_snapshot(&self, _snapshot: &SnapshotRecord) {}

    /// Bytes that deleting snapshot `snapshot_id` would free; `None` if the data path cannot
    /// tell.
    fn snapshot_exclusive_bytes(&self, _snapshot_id: u64) -> Option<u64> {
        None
    }

    /// The ids of the volumes and snapshots whose data the engine holds (a volume never written
    /// and never snapshotted may be missing), or `None` if the data path cannot tell. Read at
    /// start to find records whose data operation never became durable.
    fn stored_ids(&self) -> Option<Vec<u64>> {
        None
    }

    /// Space on the drives, and the state of each drive (`Capacity::drives`).
    fn capacity(&self) -> Capacity;

    /// A served volume's space, or `None` if the data path does not know it.
    fn volume_space(&self, _id: u64) -> Option<VolumeSpace> {
        None
    }

    /// The address NVMe/TCP is served on (the first, if several), or `None` if this data path
    /// serves no I/O.
    fn nvme_addr(&self) -> Option<SocketAddr>;

    /// Every address NVMe/TCP is served on, in port order.
    fn paths_of_node(&self) -> Vec<SocketAddr> {
        self.nvme_addr().into_iter().collect()
    }

    /// The address NBD is served on, or `None` if this data path serves no NBD.
    fn nbd_addr(&self) -> Option<SocketAddr> {
        None
    }

    /// The paths to a served volume: one per NVMe/TCP listener, with the volume's ANA state
    /// through it.
    fn paths(&self, _volume: &VolumeRecord) -> Vec<VolumePath> {
        Vec::new()
    }

    /// Sets the volume's ANA state through port `port_id`; connected hosts get an ANA change
    /// notice. The control plane keeps it in the volume's record
    /// (`VolumeRecord::path_states`), which the data path applies when it starts.
    fn set_path_state(
        &self,
        volume: &VolumeRecord,
        _port_id: u16,
        _state: AnaState,
    ) -> Result<(), DataPlaneError> {
        Err(DataPlaneError::failed(format!(
            "volume {}: this data path has no NVMe/TCP ports",
            volume.name
        )))
    }

    /// Puts a new drive in place of drive `index` and starts rebuilding it from the other
    /// drives (erasure-coded nodes only): a new drive file (or memory drive) made by the data
    /// path, or the block device or file at `path` on a node with external drives. Returns the
    /// new drive's status. Blocks until the engine switched to the new drive.
    fn replace_drive(
        &self,
        index: u16,
        _path: Option<PathBuf>,
    ) -> Result<DriveStatus, DataPlaneError> {
        Err(DataPlaneError::ReplaceRefused {
            index,
            reason: "this data path cannot replace drives".to_owned(),
        })
    }

    /// Stops serving and joins the data-path threads. Called once, when the node stops, after
    /// the REST API stopped.
    fn shutdown(&self);
}
