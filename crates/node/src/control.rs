//! The volume service: the control plane's rules for creating, growing and deleting volumes.
//!
//! Each mutation validates its input into domain types, then runs in a fixed order against the
//! metadata store and the data plane so that a failure at any step leaves both consistent:
//!
//! - create: check the name is free, allocate an id, reserve (thin data planes reserve no
//!   space), write the record (or cancel the reservation), publish.
//! - resize: read the record, refuse to shrink, reserve, write the grown record (or cancel),
//!   publish.
//! - delete: delete the record, then tell the data plane to free the volume's space. Freed
//!   after the record is gone, so a crash in between leaks the space only until the next start,
//!   when the data plane drops data no record names; the other order could leave a record
//!   naming space already given away.
//! - snapshot: check the volume exists and the name is free, allocate an id, write the
//!   snapshot record, then take the snapshot in the engine; if that fails, delete the record.
//!   A crash in between leaves a record whose id the engine does not hold: the next start drops
//!   it ([`VolumeService::drop_incomplete`]). The other order would leave engine data no record
//!   names, which the next start deletes too, but a record first keeps the two steps in the
//!   same order as a clone's.
//! - clone: like create, with the record's `origin` set, then the engine's clone before
//!   publishing; on failure the record is deleted and the reservation cancelled. A clone record
//!   whose id the engine does not hold at start is dropped the same way. A clone may be larger
//!   than its snapshot (it reads zeros past the snapshot's size), never smaller.
//! - delete a snapshot: delete the record, then the engine's data (like a volume). Deleting a
//!   volume deletes its snapshots first, one by one, then the volume; clones stay intact.
//! - rollback: the snapshot must be the volume's own; the data plane fences and drains the
//!   volume's I/O, rolls it back in the engine, and serves it again. No record changes.
//! - compression: a new volume stores its writes with lz4 unless told otherwise; a clone with its
//!   source volume's setting unless told otherwise. Changing it writes the record, then tells
//!   the data plane; it applies to new writes only (blocks written keep their form).
//! - host access (allow or deny a host, or any host): read the record, write it with the new
//!   [`HostAccess`], then tell the data plane, which refuses and disconnects hosts no longer
//!   allowed. A crash in between is harmless: the data path starts from the records.
//!
//! Host access has two explicit states. A volume starts open (any host may connect). Allowing a
//! host restricts it to the allowed hosts; denying a host removes it from them, and denying the
//! last one leaves the volume restricted to no host rather than silently open. Only allowing
//! "any host" opens it again (and forgets the list); denying "any host" restricts it to none.
//! A single host cannot be denied while the volume is open: an allowed-hosts list cannot say
//! "everyone but this one", and pretending to would leave the host connected.
//!
//! Mutations are serialised by one lock: they are rare, and serialising them makes each
//! reserve-write-publish sequence atomic with respect to the others. Reads do not take it.
//! Every method blocks (metadata commits fsync); the HTTP layer calls them off the runtime.

use crate::data_plane::{Capacity, DataPlane, DataPlaneError, HeldWrites, VolumePath, VolumeSpace};
use crate::metrics::Registry;
use meta::{
    Compression, HostAccess, MetaError, MetaStore, PathState, SnapshotRecord, VolumeOrigin,
    VolumeRecord, ALLOWED_HOSTS_MAX, PATH_STATES_MAX,
};
use nvmf::target::AnaState;
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use types::{ByteSize, InvalidInput, Nqn, VolumeName};

/// How often a long rollback of a replicated volume logs its progress.
const ROLLBACK_PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// Why a volume operation failed. Messages are shown to users as is.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    InvalidName(InvalidInput),
    #[error(transparent)]
    InvalidSize(InvalidInput),
    #[error("volume {0} already exists; pick another name, or delete it first")]
    VolumeExists(VolumeName),
    #[error("volume {0} does not exist")]
    VolumeNotFound(VolumeName),
    #[error(
        "volume {name} is {} and cannot shrink to {}: volumes only grow",
        ByteSize(*current_bytes), ByteSize(*requested_bytes)
    )]
    ShrinkRefused { name: VolumeName, current_bytes: u64, requested_bytes: u64 },
    #[error(
        "not enough free space for volume {name}: it needs {} more and {} is free; delete \
         volumes or start the node with larger drives",
        ByteSize(*requested_bytes), ByteSize(*free_bytes)
    )]
    NoSpace { name: VolumeName, requested_bytes: u64, free_bytes: u64 },
    #[error(
        "not enough free space to grow volume {name}: each of its replicas needs {} more, and \
         node {node} has {} free; free space there or grow by less",
        ByteSize(*requested_bytes), ByteSize(*free_bytes)
    )]
    GrowNoSpace { name: VolumeName, node: String, requested_bytes: u64, free_bytes: u64 },
    #[error(
        "volume {name} is {} in the cluster's record, but {waiting} after {seconds} s; each \
         node grows when it can (see its log), hosts see the new size once the primary serves \
         it, and the same resize again waits once more",
        ByteSize(*size_bytes)
    )]
    GrowPending { name: VolumeName, size_bytes: u64, waiting: String, seconds: u64 },
    #[error(
        "{0}; give the host's NQN (on a Linux host, the contents of /etc/nvme/hostnqn), or `any` \
         for every host"
    )]
    InvalidHost(InvalidInput),
    #[error(
        "volume {0} is open to any host, so one host cannot be denied on its own; instead allow \
         the hosts that may connect (`ferrite host allow {0} HOSTNQN`: the first one restricts \
         the volume to the allowed hosts), or deny every host (`ferrite host deny {0} any`)"
    )]
    HostAccessOpen(VolumeName),
    #[error(
        "volume {0} already allows {ALLOWED_HOSTS_MAX} hosts, the most it can; deny hosts that no \
         longer use it first"
    )]
    TooManyHosts(VolumeName),
    #[error(
        "volume {volume} already has a snapshot named {snapshot}; pick another name, or delete \
         it first (`ferrite snapshot delete {volume} {snapshot}`)"
    )]
    SnapshotExists { volume: VolumeName, snapshot: VolumeName },
    #[error(
        "volume {volume} has no snapshot named {snapshot}; `ferrite snapshot list {volume}` \
         shows its snapshots"
    )]
    SnapshotNotFound { volume: VolumeName, snapshot: VolumeName },
    #[error("cannot take or use a snapshot of volume {volume}: {detail}")]
    SnapshotLimit { volume: VolumeName, detail: String },
    #[error("{0:?} is not a snapshot reference: write VOLUME@SNAPSHOT, for example db@nightly")]
    InvalidSnapshotRef(String),
    #[error(
        "snapshot {snapshot_volume}@{snapshot} belongs to volume {snapshot_volume}, not to \
         {volume}: a volume rolls back only to its own snapshots; to get that snapshot's \
         contents, clone it (`ferrite volume create NEW --from-snapshot \
         {snapshot_volume}@{snapshot}`)"
    )]
    ForeignSnapshot { volume: VolumeName, snapshot_volume: VolumeName, snapshot: VolumeName },
    #[error(
        "a clone of {volume}@{snapshot} cannot be {}: the snapshot is {}, and a clone is at \
         least as large as its snapshot; give a size of {} or more, or none",
        ByteSize(*requested_bytes), ByteSize(*snapshot_bytes), ByteSize(*snapshot_bytes)
    )]
    CloneTooSmall {
        volume: VolumeName,
        snapshot: VolumeName,
        snapshot_bytes: u64,
        requested_bytes: u64,
    },
    #[error("volume {name}: {message}")]
    InvalidPath { name: VolumeName, message: String },
    #[error(
        "unknown compression {0:?}: give lz4 (the default: fast), zstd (smaller, more CPU) or \
         off"
    )]
    InvalidCompression(String),
    #[error("the data path failed on volume {name}: {source}")]
    DataPlane { name: VolumeName, source: DataPlaneError },
    /// The node has no such drive.
    #[error("{0}")]
    DriveNotFound(DataPlaneError),
    /// A drive replacement the engine refuses now (no parity, another rebuild, too many failed).
    #[error("{0}")]
    ReplaceRefused(DataPlaneError),
    /// The new drive given is unusable, or a path was given where none is taken.
    #[error("{0}")]
    InvalidDrive(DataPlaneError),
    #[error("cannot replace drive {index}: {source}")]
    ReplaceDrive { index: u16, source: DataPlaneError },
    #[error(transparent)]
    Meta(MetaError),
    /// Replicas cannot be placed (too few live nodes, a bad count).
    #[error("cannot place volume {name}: {reason}")]
    Placement { name: VolumeName, reason: String },
    /// Something a single node does that a cluster node does not (yet).
    #[error("{0}")]
    NotOnCluster(String),
    /// A snapshot of a replicated volume could not be taken on its copies now; nothing kept.
    #[error("{0}")]
    SnapshotUnavailable(String),
}

impl ControlError {
    pub(crate) fn from_meta_error(error: MetaError) -> Self {
        Self::from_meta(error)
    }

    fn from_meta(error: MetaError) -> Self {
        match error {
            MetaError::VolumeExists(name) => Self::VolumeExists(name),
            MetaError::VolumeNotFound(name) => Self::VolumeNotFound(name),
            MetaError::SnapshotExists { volume, snapshot } => {
                Self::SnapshotExists { volume, snapshot }
            }
            MetaError::SnapshotNotFound { volume, snapshot } => {
                Self::SnapshotNotFound { volume, snapshot }
            }
            other => Self::Meta(other),
        }
    }

    fn from_data_plane(name: &VolumeName, error: DataPlaneError) -> Self {
        match error {
            DataPlaneError::NoSpace { requested_bytes, free_bytes } => {
                Self::NoSpace { name: name.clone(), requested_bytes, free_bytes }
            }
            DataPlaneError::Invalid(message) => Self::InvalidPath { name: name.clone(), message },
            DataPlaneError::SnapshotLimit(detail) => {
                Self::SnapshotLimit { volume: name.clone(), detail }
            }
            source => Self::DataPlane { name: name.clone(), source },
        }
    }
}

/// Creates, grows, deletes and lists volumes. Shared by every API request.
pub struct VolumeService {
    meta: Arc<dyn MetaStore>,
    data_plane: Arc<dyn DataPlane>,
    metrics: Arc<Registry>,
    /// Serialises create, resize and delete (see the module comment).
    mutations: Mutex<()>,
    /// On a cluster node, the cluster: volumes are replicated and placed on members.
    cluster: Option<Arc<crate::cluster::Cluster>>,
}

impl VolumeService {
    pub fn new(
        meta: Arc<dyn MetaStore>,
        data_plane: Arc<dyn DataPlane>,
        metrics: Arc<Registry>,
    ) -> Self {
        Self { meta, data_plane, metrics, mutations: Mutex::new(()), cluster: None }
    }

    /// The volume service of a cluster node: `meta` must be the cluster's store.
    pub fn with_cluster(mut self, cluster: Arc<crate::cluster::Cluster>) -> Self {
        self.cluster = Some(cluster);
        self
    }

    /// The cluster this node belongs to, if any.
    pub fn cluster(&self) -> Option<&Arc<crate::cluster::Cluster>> {
        self.cluster.as_ref()
    }

    /// Creates an empty volume of `size_bytes` whose writes are stored with `compression` (a
    /// name, see [`parse_compression`]; lz4 when `None`).
    pub fn create(
        &self,
        name: &str,
        size_bytes: u64,
        compression: Option<&str>,
    ) -> Result<VolumeRecord, ControlError> {
        self.create_replicated(name, size_bytes, compression, None)
    }

    /// Creates an empty volume with `replicas` copies on distinct nodes (cluster nodes; a
    /// single node takes only 1). On a cluster every volume is replicated, with 1 replica when
    /// `replicas` is `None`.
    pub fn create_replicated(
        &self,
        name: &str,
        size_bytes: u64,
        compression: Option<&str>,
        replicas: Option<u8>,
    ) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        if self.cluster.is_none() && replicas.is_some_and(|count| count != 1) {
            return Err(ControlError::NotOnCluster(format!(
                "volume {name}: more than one replica needs a cluster; start the nodes with \
                 --cluster-etcd (docs/ARCHITECTURE.md, \"Cluster\")"
            )));
        }
        let size_bytes =
            types::validate_volume_size(size_bytes).map_err(ControlError::InvalidSize)?;
        let compression = compression.map(parse_compression).transpose()?.unwrap_or_default();
        let _serialised = self.lock_mutations();

        // Checked first so that a duplicate does not use up an id; the store checks again.
        if self.meta.volume(&name).map_err(ControlError::from_meta)?.is_some() {
            return Err(ControlError::VolumeExists(name));
        }
        let id = self.meta.allocate_volume_id().map_err(ControlError::from_meta)?;
        let mut record = VolumeRecord {
            id,
            name,
            size_bytes,
            uuid: new_uuid(),
            created_unix_ms: now_unix_ms(),
            chunks: Vec::new(),
            host_access: HostAccess::Open,
            origin: None,
            compression,
            path_states: Default::default(),
        };
        if let Some(cluster) = &self.cluster {
            let placed = cluster.create_volume(&record, replicas.unwrap_or(1))?;
            tracing::info!(
                volume = %record.name,
                id,
                size = %ByteSize(size_bytes),
                replicas = ?placed,
                "created replicated volume"
            );
            return Ok(record);
        }
        record.chunks = self
            .data_plane
            .reserve_create(id, size_bytes)
            .map_err(|error| ControlError::from_data_plane(&record.name, error))?;
        if let Err(error) = self.meta.create_volume(&record) {
            self.data_plane.cancel(&record);
            return Err(ControlError::from_meta(error));
        }
        self.metrics.register_volume(id, &record.name);
        self.data_plane.publish(&record);
        tracing::info!(
            volume = %record.name,
            id,
            size = %ByteSize(size_bytes),
            compression = %record.compression,
            "created volume"
        );
        Ok(record)
    }

    pub fn volume(&self, name: &str) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        self.volume_record(&name)
    }

    fn volume_record(&self, name: &VolumeName) -> Result<VolumeRecord, ControlError> {
        match self.meta.volume(name).map_err(ControlError::from_meta)? {
            Some(record) => Ok(record),
            None => Err(ControlError::VolumeNotFound(name.clone())),
        }
    }

    /// Sets how the volume's new writes are stored (a name, see [`parse_compression`]). Blocks
    /// already written keep their form. Setting the current value writes nothing.
    pub fn set_compression(
        &self,
        name: &str,
        compression: &str,
    ) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        let compression = parse_compression(compression)?;
        let _serialised = self.lock_mutations();
        let current = self.volume_record(&name)?;
        if current.compression == compression {
            return Ok(current);
        }
        let changed = VolumeRecord { compression, ..current };
        self.meta.update_volume(&changed).map_err(ControlError::from_meta)?;
        self.data_plane.set_compression(&changed);
        tracing::info!(volume = %changed.name, %compression, "volume compression changed");
        Ok(changed)
    }

    /// Every volume, sorted by name.
    pub fn volumes(&self) -> Result<Vec<VolumeRecord>, ControlError> {
        self.meta.volumes().map_err(ControlError::from_meta)
    }

    /// Grows a volume to `size_bytes`. Asking for its current size changes nothing.
    ///
    /// On a cluster node it writes the grown record to the cluster, where every node holding a
    /// replica sees it and grows its copy (the volume's replication takes writes beyond the old
    /// end once every in-sync replica has), and waits until they all serve the new size
    /// (`GrowPending` after [`crate::cluster::GROW_WAIT_MS`]; asking again waits again).
    pub fn resize(&self, name: &str, size_bytes: u64) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        let size_bytes =
            types::validate_volume_size(size_bytes).map_err(ControlError::InvalidSize)?;
        let serialised = self.lock_mutations();

        let current = match self.meta.volume(&name).map_err(ControlError::from_meta)? {
            Some(record) => record,
            None => return Err(ControlError::VolumeNotFound(name)),
        };
        if size_bytes < current.size_bytes {
            return Err(ControlError::ShrinkRefused {
                name,
                current_bytes: current.size_bytes,
                requested_bytes: size_bytes,
            });
        }
        if let Some(cluster) = &self.cluster {
            let grown = if size_bytes == current.size_bytes {
                current
            } else {
                cluster.check_grow(&current, size_bytes)?;
                let grown = VolumeRecord { size_bytes, ..current.clone() };
                self.meta.update_volume(&grown).map_err(ControlError::from_meta)?;
                tracing::info!(
                    volume = %grown.name,
                    id = grown.id,
                    from = %ByteSize(current.size_bytes),
                    to = %ByteSize(size_bytes),
                    "growing replicated volume"
                );
                grown
            };
            // Other mutations need not wait while the members grow.
            drop(serialised);
            let wait = Duration::from_millis(crate::cluster::GROW_WAIT_MS);
            let behind = cluster.wait_grown(grown.id, grown.name.as_str(), size_bytes, wait);
            if behind.is_empty() {
                return Ok(grown);
            }
            let waiting = behind
                .iter()
                .map(|(node, served)| match served {
                    Some(served) => format!("node {node} serves {}", ByteSize(*served)),
                    None => format!("node {node} did not answer"),
                })
                .collect::<Vec<_>>()
                .join(", ");
            return Err(ControlError::GrowPending {
                name: grown.name,
                size_bytes,
                waiting,
                seconds: wait.as_secs(),
            });
        }
        if size_bytes == current.size_bytes {
            return Ok(current);
        }
        let chunks = self
            .data_plane
            .reserve_grow(&current, size_bytes)
            .map_err(|error| ControlError::from_data_plane(&name, error))?;
        assert!(
            chunks.starts_with(&current.chunks),
            "growing volume {name} must keep its chunks in place"
        );
        let grown = VolumeRecord { size_bytes, chunks, ..current.clone() };
        if let Err(error) = self.meta.update_volume(&grown) {
            self.data_plane.cancel(&grown);
            return Err(ControlError::from_meta(error));
        }
        self.data_plane.publish(&grown);
        tracing::info!(
            volume = %grown.name,
            from = %ByteSize(current.size_bytes),
            to = %ByteSize(size_bytes),
            "grew volume"
        );
        Ok(grown)
    }

    /// Deletes a volume and returns its last record. Its snapshots are deleted first; its
    /// clones stay intact.
    pub fn delete(&self, name: &str) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        let _serialised = self.lock_mutations();
        if self.meta.volume(&name).map_err(ControlError::from_meta)?.is_none() {
            return Err(ControlError::VolumeNotFound(name));
        }
        // Snapshots first: a crash part way leaves the volume with fewer snapshots, never
        // snapshot records of a volume that is gone.
        for snapshot in self.meta.snapshots(&name).map_err(ControlError::from_meta)? {
            self.delete_snapshot_locked(&snapshot.volume, &snapshot.name)?;
        }
        let record = self.meta.delete_volume(&name).map_err(ControlError::from_meta)?;
        if let Some(cluster) = &self.cluster {
            // Every member's reconciler then drops its replica.
            cluster.forget_volume(record.id);
            tracing::info!(volume = %record.name, id = record.id, "deleted replicated volume");
            return Ok(record);
        }
        self.data_plane.remove(&record);
        self.metrics.remove_volume(record.id);
        tracing::info!(volume = %record.name, id = record.id, "deleted volume");
        Ok(record)
    }

    /// Creates volume `name` as a writable clone of the snapshot `from` names
    /// (`VOLUME@SNAPSHOT`), of the snapshot's size or of `size_bytes`, which may not be smaller.
    /// Its writes are stored with `compression`, or when `None` as its source volume's are.
    pub fn create_clone(
        &self,
        name: &str,
        from: &str,
        size_bytes: Option<u64>,
        compression: Option<&str>,
    ) -> Result<VolumeRecord, ControlError> {
        self.create_clone_replicated(name, from, size_bytes, compression, None)
    }

    /// Creates a clone as [`Self::create_clone`] does, with `replicas` copies on a cluster
    /// (1 when `None`), each on a node holding a copy of the snapshot; a single node takes 1.
    pub fn create_clone_replicated(
        &self,
        name: &str,
        from: &str,
        size_bytes: Option<u64>,
        compression: Option<&str>,
        replicas: Option<u8>,
    ) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        if self.cluster.is_none() && replicas.is_some_and(|count| count != 1) {
            return Err(ControlError::NotOnCluster(format!(
                "volume {name}: more than one replica needs a cluster; start the nodes with \
                 --cluster-etcd (docs/ARCHITECTURE.md, \"Cluster\")"
            )));
        }
        let compression = compression.map(parse_compression).transpose()?;
        let Some((volume, snapshot)) = api::parse_snapshot_ref(from) else {
            return Err(ControlError::InvalidSnapshotRef(from.to_owned()));
        };
        let volume = parse_name(volume)?;
        let snapshot = parse_name(snapshot)?;
        let size_bytes = size_bytes
            .map(|size_bytes| {
                types::validate_volume_size(size_bytes).map_err(ControlError::InvalidSize)
            })
            .transpose()?;
        let _serialised = self.lock_mutations();

        if self.meta.volume(&name).map_err(ControlError::from_meta)?.is_some() {
            return Err(ControlError::VolumeExists(name));
        }
        let source = self.snapshot_record(&volume, &snapshot)?;
        let compression = match compression {
            Some(compression) => compression,
            // A snapshot's volume exists as long as the snapshot does (deleting a volume
            // deletes its snapshots first).
            None => self.volume_record(&volume)?.compression,
        };
        let size_bytes = size_bytes.unwrap_or(source.size_bytes);
        if size_bytes < source.size_bytes {
            return Err(ControlError::CloneTooSmall {
                volume,
                snapshot,
                snapshot_bytes: source.size_bytes,
                requested_bytes: size_bytes,
            });
        }
        let id = self.meta.allocate_volume_id().map_err(ControlError::from_meta)?;
        let chunks = match &self.cluster {
            // Each member reserves its own when its reconciler serves the clone.
            Some(_) => Vec::new(),
            None => self
                .data_plane
                .reserve_create(id, size_bytes)
                .map_err(|error| ControlError::from_data_plane(&name, error))?,
        };
        let record = VolumeRecord {
            id,
            name,
            size_bytes,
            uuid: new_uuid(),
            created_unix_ms: now_unix_ms(),
            chunks,
            host_access: HostAccess::Open,
            origin: Some(VolumeOrigin {
                volume: source.volume.clone(),
                snapshot: source.name.clone(),
                snapshot_id: source.id,
            }),
            compression,
            // A clone is a volume of its own: every path starts optimized.
            path_states: Default::default(),
        };
        if let Some(cluster) = &self.cluster {
            let placed = cluster.create_clone(&record, source.id, replicas.unwrap_or(1))?;
            tracing::info!(
                volume = %record.name,
                id,
                origin = %api::snapshot_ref(source.volume.as_str(), source.name.as_str()),
                size = %ByteSize(size_bytes),
                replicas = ?placed,
                "created replicated clone"
            );
            return Ok(record);
        }
        if let Err(error) = self.meta.create_volume(&record) {
            self.data_plane.cancel(&record);
            return Err(ControlError::from_meta(error));
        }
        if let Err(error) = self.data_plane.clone_snapshot(&record, source.id) {
            if let Err(meta_error) = self.meta.delete_volume(&record.name) {
                tracing::warn!(
                    volume = %record.name,
                    error = %meta_error,
                    "could not delete the record of a failed clone; the next start drops it"
                );
            }
            self.data_plane.cancel(&record);
            return Err(ControlError::from_data_plane(&record.name, error));
        }
        self.metrics.register_volume(id, &record.name);
        self.data_plane.publish(&record);
        tracing::info!(
            volume = %record.name,
            id,
            origin = %api::snapshot_ref(source.volume.as_str(), source.name.as_str()),
            size = %ByteSize(size_bytes),
            compression = %record.compression,
            "created clone"
        );
        Ok(record)
    }

    /// Takes snapshot `snapshot` of `volume`: instant and read-only, sharing the volume's blocks.
    pub fn create_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> Result<SnapshotRecord, ControlError> {
        let volume = parse_name(volume)?;
        let snapshot = parse_name(snapshot)?;
        let _serialised = self.lock_mutations();

        let Some(source) = self.meta.volume(&volume).map_err(ControlError::from_meta)? else {
            return Err(ControlError::VolumeNotFound(volume));
        };
        // Checked first so that a duplicate does not use up an id; the store checks again.
        if self.meta.snapshot(&volume, &snapshot).map_err(ControlError::from_meta)?.is_some() {
            return Err(ControlError::SnapshotExists { volume, snapshot });
        }
        let id = self.meta.allocate_volume_id().map_err(ControlError::from_meta)?;
        let record = SnapshotRecord {
            id,
            volume,
            name: snapshot,
            size_bytes: source.size_bytes,
            uuid: new_uuid(),
            created_unix_ms: now_unix_ms(),
        };
        if let Some(cluster) = &self.cluster {
            // Every copy first, the record last: a record names a snapshot every copy took.
            let (holders, held) = cluster.take_snapshot(&source, &record)?;
            if let Err(error) = self.meta.create_snapshot(&record) {
                cluster.drop_snapshot_copies(record.id);
                return Err(ControlError::from_meta(error));
            }
            tracing::info!(
                volume = %record.volume,
                snapshot = %record.name,
                id,
                nodes = %holders.join(", "),
                writes_held_ms = held.as_millis(),
                "took snapshot of every copy"
            );
            return Ok(record);
        }
        self.meta.create_snapshot(&record).map_err(ControlError::from_meta)?;
        if let Err(error) = self.data_plane.snapshot(&source, &record) {
            if let Err(meta_error) = self.meta.delete_snapshot(&record.volume, &record.name) {
                tracing::warn!(
                    volume = %record.volume,
                    snapshot = %record.name,
                    error = %meta_error,
                    "could not delete the record of a failed snapshot; the next start drops it"
                );
            }
            return Err(ControlError::from_data_plane(&record.volume, error));
        }
        tracing::info!(volume = %record.volume, snapshot = %record.name, id, "took snapshot");
        Ok(record)
    }

    /// Holds the replicated volume's host writes on this node, its serving primary, for a
    /// snapshot of every copy (between cluster nodes: `Cluster::take_snapshot`).
    pub fn freeze_volume(&self, volume: &str, hold_ms: u64) -> Result<HeldWrites, ControlError> {
        let record = self.cluster_volume(volume)?;
        self.data_plane
            .freeze_replicated(&record, hold_ms)
            .map_err(|error| ControlError::SnapshotUnavailable(error.to_string()))
    }

    /// Ends the hold `token` names; an error if it did not last until now.
    pub fn thaw_volume(&self, volume: &str, token: u64) -> Result<(), ControlError> {
        let record = self.cluster_volume(volume)?;
        self.data_plane
            .thaw_replicated(&record, token)
            .map_err(|error| ControlError::SnapshotUnavailable(error.to_string()))
    }

    /// Takes snapshot `id` of this node's copy of a replicated volume, under `snapshot`'s
    /// names, and serves it (between cluster nodes, while the volume's primary holds its
    /// writes). Its record is written once every copy has it.
    pub fn take_local_snapshot(
        &self,
        id: u64,
        snapshot: &api::LocalSnapshot,
    ) -> Result<(), ControlError> {
        let volume = self.cluster_volume(&snapshot.volume)?;
        let record = SnapshotRecord {
            id,
            volume: volume.name.clone(),
            name: parse_name(&snapshot.name)?,
            size_bytes: snapshot.size_bytes,
            uuid: snapshot.uuid,
            created_unix_ms: snapshot.created_unix_ms,
        };
        self.data_plane
            .snapshot(&volume, &record)
            .map_err(|error| ControlError::from_data_plane(&volume.name, error))
    }

    /// Drops this node's data of `id`, a snapshot's copy or a clone being made (between
    /// cluster nodes: its record was deleted, or never written). Refused while a record names
    /// it.
    pub fn drop_local_snapshot(&self, id: u64) -> Result<(), ControlError> {
        if self.cluster.is_none() {
            return Err(ControlError::NotOnCluster(
                "this node is not part of a cluster; delete snapshots by name".to_owned(),
            ));
        }
        let snapshots = self.meta.all_snapshots().map_err(ControlError::from_meta)?;
        if let Some(named) = snapshots.iter().find(|snapshot| snapshot.id == id) {
            return Err(ControlError::SnapshotExists {
                volume: named.volume.clone(),
                snapshot: named.name.clone(),
            });
        }
        let volumes = self.meta.volumes().map_err(ControlError::from_meta)?;
        if let Some(named) = volumes.iter().find(|volume| volume.id == id) {
            return Err(ControlError::VolumeExists(named.name.clone()));
        }
        self.data_plane.drop_unnamed(id);
        Ok(())
    }

    /// Whether this node holds a copy of snapshot `id` (before making a clone of it).
    pub fn holds_snapshot(&self, id: u64) -> Result<(), ControlError> {
        let snapshots = self.meta.all_snapshots().map_err(ControlError::from_meta)?;
        let Some(record) = snapshots.into_iter().find(|snapshot| snapshot.id == id) else {
            return Err(ControlError::SnapshotUnavailable(format!(
                "no snapshot record has id {id} (deleted meanwhile?)"
            )));
        };
        if self.data_plane.stored_ids().is_some_and(|ids| ids.contains(&id)) {
            return Ok(());
        }
        Err(ControlError::SnapshotNotFound { volume: record.volume, snapshot: record.name })
    }

    /// The ids of the snapshots this node holds a copy of, ascending (between cluster nodes:
    /// `Cluster::snapshot_copies`).
    pub fn held_snapshots(&self) -> Result<Vec<u64>, ControlError> {
        let snapshots = self.meta.all_snapshots().map_err(ControlError::from_meta)?;
        let Some(stored) = self.data_plane.stored_ids() else { return Ok(Vec::new()) };
        let mut held: Vec<u64> =
            snapshots.iter().map(|snapshot| snapshot.id).filter(|id| stored.contains(id)).collect();
        held.sort_unstable();
        Ok(held)
    }

    /// Where the copies of snapshots are, on a cluster node (`None` on a single node).
    pub fn snapshot_copies(&self) -> Option<Result<crate::cluster::SnapshotCopies, ControlError>> {
        self.cluster.as_ref().map(|cluster| cluster.snapshot_copies())
    }

    /// Makes volume `id` on this node a clone of its copy of snapshot `snapshot_id` (between
    /// cluster nodes, before the clone's record exists: `Cluster::create_clone`).
    pub fn make_local_clone(&self, id: u64, snapshot_id: u64) -> Result<(), ControlError> {
        self.holds_snapshot(snapshot_id)?;
        let volumes = self.meta.volumes().map_err(ControlError::from_meta)?;
        if let Some(named) = volumes.iter().find(|volume| volume.id == id) {
            return Err(ControlError::VolumeExists(named.name.clone()));
        }
        self.data_plane.clone_unnamed(id, snapshot_id).map_err(|error| {
            ControlError::SnapshotUnavailable(format!("cannot make the clone here: {error}"))
        })
    }

    /// The record of a replicated volume, on a cluster node.
    fn cluster_volume(&self, volume: &str) -> Result<VolumeRecord, ControlError> {
        if self.cluster.is_none() {
            return Err(ControlError::NotOnCluster(
                "this node is not part of a cluster; start it with --cluster-etcd to join one"
                    .to_owned(),
            ));
        }
        self.volume_record(&parse_name(volume)?)
    }

    /// The snapshots of `volume`, oldest first.
    pub fn snapshots(&self, volume: &str) -> Result<Vec<SnapshotRecord>, ControlError> {
        let record = self.volume(volume)?;
        self.meta.snapshots(&record.name).map_err(ControlError::from_meta)
    }

    pub fn snapshot(&self, volume: &str, snapshot: &str) -> Result<SnapshotRecord, ControlError> {
        let volume = parse_name(volume)?;
        let snapshot = parse_name(snapshot)?;
        self.snapshot_record(&volume, &snapshot)
    }

    /// Deletes snapshot `snapshot` of `volume` and returns its last record. Its blocks that no
    /// volume, clone or other snapshot reads are freed by GC later.
    pub fn delete_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> Result<SnapshotRecord, ControlError> {
        let volume = parse_name(volume)?;
        let snapshot = parse_name(snapshot)?;
        let _serialised = self.lock_mutations();
        if self.meta.volume(&volume).map_err(ControlError::from_meta)?.is_none() {
            return Err(ControlError::VolumeNotFound(volume));
        }
        self.delete_snapshot_locked(&volume, &snapshot)
    }

    /// Deletes a snapshot's record, then its data; the caller holds the mutation lock.
    fn delete_snapshot_locked(
        &self,
        volume: &VolumeName,
        snapshot: &VolumeName,
    ) -> Result<SnapshotRecord, ControlError> {
        let record =
            self.meta.delete_snapshot(volume, snapshot).map_err(ControlError::from_meta)?;
        match &self.cluster {
            // Each node holding a copy drops it (or, away now, once it sees it unnamed).
            Some(cluster) => cluster.drop_snapshot_copies(record.id),
            None => self.data_plane.remove_snapshot(&record),
        }
        tracing::info!(volume = %record.volume, snapshot = %record.name, id = record.id, "deleted snapshot");
        Ok(record)
    }

    /// Rolls `volume` back to its snapshot `snapshot`: the writes since the snapshot are
    /// dropped. `snapshot` may also be written `VOLUME@SNAPSHOT`, naming this volume.
    pub fn rollback(&self, volume: &str, snapshot: &str) -> Result<VolumeRecord, ControlError> {
        let volume = parse_name(volume)?;
        let snapshot = match api::parse_snapshot_ref(snapshot) {
            Some((snapshot_volume, name)) => {
                let snapshot_volume = parse_name(snapshot_volume)?;
                let name = parse_name(name)?;
                if snapshot_volume != volume {
                    return Err(ControlError::ForeignSnapshot {
                        volume,
                        snapshot_volume,
                        snapshot: name,
                    });
                }
                name
            }
            None => parse_name(snapshot)?,
        };
        if let Some(cluster) = &self.cluster {
            // A replicated volume's primary rewrites what differs, through replication.
            let record = self.volume_record(&volume)?;
            let target = self.snapshot_record(&volume, &snapshot)?;
            if !cluster.rollback_on_primary(&record, &target)? {
                self.rollback_here(&record, &target)?;
            }
            return Ok(record);
        }
        let _serialised = self.lock_mutations();
        let Some(record) = self.meta.volume(&volume).map_err(ControlError::from_meta)? else {
            return Err(ControlError::VolumeNotFound(volume));
        };
        let target = self.snapshot_record(&volume, &snapshot)?;
        self.data_plane
            .rollback(&record, target.id)
            .map_err(|error| ControlError::from_data_plane(&record.name, error))?;
        tracing::info!(volume = %record.name, snapshot = %target.name, "rolled volume back");
        Ok(record)
    }

    /// Rolls replicated `volume`, which this node serves as primary, back to its snapshot
    /// `snapshot_id` (between cluster nodes: `Cluster::rollback_on_primary`).
    pub fn rollback_replicated(&self, volume: &str, snapshot_id: u64) -> Result<(), ControlError> {
        let record = self.cluster_volume(volume)?;
        let snapshots = self.meta.snapshots(&record.name).map_err(ControlError::from_meta)?;
        let Some(target) = snapshots.into_iter().find(|snapshot| snapshot.id == snapshot_id) else {
            return Err(ControlError::SnapshotUnavailable(format!(
                "volume {} has no snapshot with id {snapshot_id} (deleted meanwhile?)",
                record.name
            )));
        };
        self.rollback_here(&record, &target)
    }

    /// Rewrites, as the volume's primary, the blocks of replicated `record` that differ from
    /// snapshot `target` with the snapshot's, through replication, logging progress.
    fn rollback_here(
        &self,
        record: &VolumeRecord,
        target: &SnapshotRecord,
    ) -> Result<(), ControlError> {
        let snapshot = api::snapshot_ref(record.name.as_str(), target.name.as_str());
        if !self.data_plane.stored_ids().is_some_and(|ids| ids.contains(&target.id)) {
            return Err(ControlError::SnapshotUnavailable(format!(
                "rolling {} back to {snapshot} failed: this node, the volume's primary, holds no \
                 copy of the snapshot (copies live on the replicas in sync when it was taken: \
                 `ferrite snapshot show` names them); nothing was changed",
                record.name
            )));
        }
        let started = std::time::Instant::now();
        let mut logged = started;
        let mut progress = |position: u64, blocks: u64| {
            if position == 0 {
                tracing::info!(
                    volume = %record.name,
                    snapshot = %target.name,
                    "rolling a replicated volume back: rewriting the blocks that differ from the \
                     snapshot on every copy in sync, in block order"
                );
            } else if position < blocks && logged.elapsed() >= ROLLBACK_PROGRESS_INTERVAL {
                logged = std::time::Instant::now();
                let percent = position * 100 / blocks.max(1);
                tracing::info!(volume = %record.name, position, blocks, percent, "rolling back");
            }
        };
        let rewritten = self
            .data_plane
            .rollback_replicated(record, target.id, &mut progress)
            .map_err(|error| {
                ControlError::SnapshotUnavailable(format!(
                    "rolling {} back to {snapshot} did not finish: {error}; the volume may hold \
                     some of the snapshot's blocks and not others: run the rollback again",
                    record.name
                ))
            })?;
        tracing::info!(
            volume = %record.name,
            snapshot = %target.name,
            blocks = rewritten,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "rolled a replicated volume back"
        );
        Ok(())
    }

    /// The snapshot record, or why there is none (the volume or the snapshot is missing).
    fn snapshot_record(
        &self,
        volume: &VolumeName,
        snapshot: &VolumeName,
    ) -> Result<SnapshotRecord, ControlError> {
        if let Some(record) =
            self.meta.snapshot(volume, snapshot).map_err(ControlError::from_meta)?
        {
            return Ok(record);
        }
        if self.meta.volume(volume).map_err(ControlError::from_meta)?.is_none() {
            return Err(ControlError::VolumeNotFound(volume.clone()));
        }
        Err(ControlError::SnapshotNotFound { volume: volume.clone(), snapshot: snapshot.clone() })
    }

    /// Bytes that deleting the snapshot would free; 0 if the data path cannot tell.
    pub fn snapshot_exclusive_bytes(&self, snapshot_id: u64) -> u64 {
        self.data_plane.snapshot_exclusive_bytes(snapshot_id).unwrap_or(0)
    }

    /// How many snapshots each volume that has any has.
    pub fn snapshot_counts(&self) -> Result<BTreeMap<VolumeName, u32>, ControlError> {
        let mut counts = BTreeMap::new();
        for snapshot in self.meta.all_snapshots().map_err(ControlError::from_meta)? {
            *counts.entry(snapshot.volume).or_insert(0u32) += 1;
        }
        Ok(counts)
    }

    /// How many snapshots `volume` has.
    pub fn snapshot_count(&self, volume: &VolumeName) -> Result<u32, ControlError> {
        let snapshots = self.meta.snapshots(volume).map_err(ControlError::from_meta)?;
        Ok(u32::try_from(snapshots.len()).unwrap_or(u32::MAX))
    }

    /// Drops the records of snapshots and clones whose engine operation never became durable
    /// (the node crashed between the record and the operation): their ids are not among the
    /// data path's. Called once at start, before the API serves. A data path that cannot tell
    /// which ids it holds drops nothing.
    pub fn drop_incomplete(&self) -> Result<(), ControlError> {
        let Some(stored) = self.data_plane.stored_ids() else {
            return Ok(());
        };
        let stored: HashSet<u64> = stored.into_iter().collect();
        let _serialised = self.lock_mutations();
        for snapshot in self.meta.all_snapshots().map_err(ControlError::from_meta)? {
            if stored.contains(&snapshot.id) {
                continue;
            }
            tracing::warn!(
                volume = %snapshot.volume,
                snapshot = %snapshot.name,
                id = snapshot.id,
                "dropping the record of a snapshot that was never taken (the node stopped \
                 while taking it)"
            );
            self.meta
                .delete_snapshot(&snapshot.volume, &snapshot.name)
                .map_err(ControlError::from_meta)?;
        }
        for volume in self.meta.volumes().map_err(ControlError::from_meta)? {
            if volume.origin.is_none() || stored.contains(&volume.id) {
                continue;
            }
            tracing::warn!(
                volume = %volume.name,
                id = volume.id,
                "dropping the record of a clone that was never made (the node stopped while \
                 cloning)"
            );
            let record = self.meta.delete_volume(&volume.name).map_err(ControlError::from_meta)?;
            self.data_plane.remove(&record);
            self.metrics.remove_volume(record.id);
        }
        Ok(())
    }

    /// Allows the host `hostnqn` to connect to the volume. On an open volume this restricts it
    /// to this one host (connected hosts are disconnected, see [`DataPlane::set_host_access`]);
    /// allowing a host already allowed changes nothing.
    /// The volume's NVMe/TCP paths (one per listen address of the node) and its ANA state on each.
    pub fn paths(&self, name: &str) -> Result<(VolumeRecord, Vec<VolumePath>), ControlError> {
        let record = self.volume(name)?;
        let paths = self.data_plane.paths(&record);
        Ok((record, paths))
    }

    /// Sets the volume's ANA state through port `port_id` (hosts connected there get an ANA
    /// change notice and move their I/O as their multipath policy says), and keeps it in the
    /// volume's record, so a restarted node serves the port in the same state (the data path
    /// applies the record's states when it publishes the volume).
    pub fn set_path_state(
        &self,
        name: &str,
        port_id: u16,
        state: AnaState,
    ) -> Result<Vec<VolumePath>, ControlError> {
        if self.cluster.is_some() {
            return Err(ControlError::NotOnCluster(
                "on a cluster node the control plane sets the ANA states (optimized on the \
                 volume's primary only); they cannot be set by hand"
                    .to_owned(),
            ));
        }
        let name = parse_name(name)?;
        let _serialised = self.lock_mutations();
        let current = match self.meta.volume(&name).map_err(ControlError::from_meta)? {
            Some(record) => record,
            None => return Err(ControlError::VolumeNotFound(name)),
        };
        let mut path_states = current.path_states.clone();
        let kept = path_state_of(state)
            .map_err(|error| ControlError::from_data_plane(&current.name, error))?;
        match kept {
            Some(kept) => {
                if !path_states.contains_key(&port_id) && path_states.len() >= PATH_STATES_MAX {
                    return Err(ControlError::from_data_plane(
                        &current.name,
                        DataPlaneError::invalid(format!(
                            "at most {PATH_STATES_MAX} ports keep a state other than optimized"
                        )),
                    ));
                }
                path_states.insert(port_id, kept);
            }
            None => {
                path_states.remove(&port_id);
            }
        }
        // The data path checks the port and applies the state; only then is it kept. A state
        // kept for a port this node no longer listens on (started with fewer addresses) is
        // cleared by setting it optimized, which asks nothing of the data path.
        let paths = self.data_plane.paths(&current);
        let before = paths.iter().find(|path| path.port_id == port_id).map(|path| path.state);
        let absent_cleared = before.is_none() && kept.is_none();
        if !(absent_cleared && current.path_states.contains_key(&port_id)) {
            self.data_plane
                .set_path_state(&current, port_id, state)
                .map_err(|error| ControlError::from_data_plane(&current.name, error))?;
        }
        if path_states != current.path_states {
            let changed = VolumeRecord { path_states, ..current.clone() };
            if let Err(error) = self.meta.update_volume(&changed) {
                // Not kept: put the port back as it was, so what hosts see matches the record.
                if let Some(before) = before {
                    let _ = self.data_plane.set_path_state(&current, port_id, before);
                }
                return Err(ControlError::from_meta(error));
            }
        }
        Ok(self.data_plane.paths(&current))
    }

    pub fn allow_host(&self, name: &str, hostnqn: &str) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        let host = Nqn::new(hostnqn).map_err(ControlError::InvalidHost)?;
        self.change_host_access(name, |name, access| match access {
            HostAccess::Open => Ok(HostAccess::Restricted([host].into())),
            HostAccess::Restricted(hosts) if hosts.contains(&host) => Ok(access.clone()),
            HostAccess::Restricted(hosts) if hosts.len() >= ALLOWED_HOSTS_MAX => {
                Err(ControlError::TooManyHosts(name.clone()))
            }
            HostAccess::Restricted(hosts) => {
                let mut hosts = hosts.clone();
                hosts.insert(host);
                Ok(HostAccess::Restricted(hosts))
            }
        })
    }

    /// Removes the host `hostnqn` from the volume's allowed hosts and disconnects it. Denying a
    /// host that is not allowed changes nothing; on an open volume it is refused
    /// ([`ControlError::HostAccessOpen`]).
    pub fn deny_host(&self, name: &str, hostnqn: &str) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        let host = Nqn::new(hostnqn).map_err(ControlError::InvalidHost)?;
        self.change_host_access(name, |name, access| match access {
            HostAccess::Open => Err(ControlError::HostAccessOpen(name.clone())),
            HostAccess::Restricted(hosts) => {
                let mut hosts = hosts.clone();
                hosts.remove(&host);
                Ok(HostAccess::Restricted(hosts))
            }
        })
    }

    /// Opens the volume to any host and forgets its allowed hosts.
    pub fn allow_any_host(&self, name: &str) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        self.change_host_access(name, |_, _| Ok(HostAccess::Open))
    }

    /// Restricts the volume to no host at all, disconnecting every host.
    pub fn deny_any_host(&self, name: &str) -> Result<VolumeRecord, ControlError> {
        let name = parse_name(name)?;
        self.change_host_access(name, |_, _| Ok(HostAccess::Restricted(Default::default())))
    }

    /// Writes the host access `change` makes of the volume's current one, then applies it to
    /// the data path. An unchanged access writes nothing.
    fn change_host_access(
        &self,
        name: VolumeName,
        change: impl FnOnce(&VolumeName, &HostAccess) -> Result<HostAccess, ControlError>,
    ) -> Result<VolumeRecord, ControlError> {
        let _serialised = self.lock_mutations();
        let current = match self.meta.volume(&name).map_err(ControlError::from_meta)? {
            Some(record) => record,
            None => return Err(ControlError::VolumeNotFound(name)),
        };
        let host_access = change(&name, &current.host_access)?;
        if host_access == current.host_access {
            return Ok(current);
        }
        let changed = VolumeRecord { host_access, ..current };
        self.meta.update_volume(&changed).map_err(ControlError::from_meta)?;
        self.data_plane.set_host_access(&changed);
        match &changed.host_access {
            HostAccess::Open => tracing::info!(volume = %changed.name, "volume open to any host"),
            HostAccess::Restricted(hosts) => tracing::info!(
                volume = %changed.name,
                hosts = ?hosts.iter().map(Nqn::as_str).collect::<Vec<_>>(),
                "volume restricted to allowed hosts"
            ),
        }
        Ok(changed)
    }

    pub fn capacity(&self) -> Capacity {
        self.data_plane.capacity()
    }

    /// Puts a new drive in place of drive `index` (a new drive file, or the block device or
    /// file at `path` on a node with external drives) and starts rebuilding it.
    pub fn replace_drive(
        &self,
        index: u16,
        path: Option<std::path::PathBuf>,
    ) -> Result<crate::DriveStatus, ControlError> {
        self.data_plane.replace_drive(index, path).map_err(|error| match error {
            DataPlaneError::DriveNotFound { .. } => ControlError::DriveNotFound(error),
            DataPlaneError::ReplaceRefused { .. } => ControlError::ReplaceRefused(error),
            DataPlaneError::InvalidDrive(_) => ControlError::InvalidDrive(error),
            source => ControlError::ReplaceDrive { index, source },
        })
    }

    /// A volume's provisioned, mapped and used space, if the data path serves it.
    pub fn volume_space(&self, id: u64) -> Option<VolumeSpace> {
        self.data_plane.volume_space(id)
    }

    pub fn meta_revision(&self) -> Result<u64, ControlError> {
        self.meta.revision().map_err(ControlError::from_meta)
    }

    fn lock_mutations(&self) -> std::sync::MutexGuard<'_, ()> {
        // The lock guards no data, only ordering; a panic while holding it leaves nothing broken.
        self.mutations.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The record's form of an ANA state set by hand: `Ok(None)` for optimized, which is what a
/// port without a kept state has. The states only the cluster sets are refused.
fn path_state_of(state: AnaState) -> Result<Option<PathState>, DataPlaneError> {
    match state {
        AnaState::Optimized => Ok(None),
        AnaState::NonOptimized => Ok(Some(PathState::NonOptimized)),
        AnaState::Inaccessible => Ok(Some(PathState::Inaccessible)),
        AnaState::PersistentLoss | AnaState::Change => Err(DataPlaneError::invalid(format!(
            "the ANA state {state:?} is set by the cluster only; set optimized, non-optimized \
             or inaccessible"
        ))),
    }
}

fn parse_name(name: &str) -> Result<VolumeName, ControlError> {
    VolumeName::new(name).map_err(ControlError::InvalidName)
}

/// A compression setting by its name (`lz4`, `zstd` or `off`, in any letter case).
pub fn parse_compression(text: &str) -> Result<Compression, ControlError> {
    Compression::from_name(&text.to_ascii_lowercase())
        .ok_or_else(|| ControlError::InvalidCompression(text.to_owned()))
}

/// A random (version 4) UUID.
pub fn new_uuid() -> [u8; 16] {
    let mut uuid: [u8; 16] = rand::random();
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    uuid
}

/// Wall-clock time in Unix milliseconds; 0 if the clock is set before 1970.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data_plane::DataPlane;
    use meta::{Chunk, EmbeddedStore, NodeRecord, SnapshotRecord};
    use std::collections::BTreeSet;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, Ordering};

    const CHUNK_SIZE_BYTES: u64 = 1 << 20;

    /// Test fixture: a data plane that hands out 1 MiB chunks from one drive of `chunk_count`
    /// chunks and remembers what is reserved, published and removed.
    struct FixtureDataPlane {
        state: Mutex<FixtureState>,
        chunk_count: u32,
    }

    #[derive(Default)]
    struct FixtureState {
        free: BTreeSet<u32>,
        reserved: BTreeSet<u32>,
        published: BTreeSet<u64>,
        /// Every `set_host_access`, in order.
        access_changes: Vec<(u64, HostAccess)>,
        /// Ids the fixture "engine" holds: snapshots taken and clones made.
        stored: BTreeSet<u64>,
        /// Every rollback, as `(volume id, snapshot id)`.
        rollbacks: Vec<(u64, u64)>,
        /// While set, snapshot, clone and rollback fail as a too-deep chain.
        refuse_layers: bool,
        /// Every `set_compression`, in order.
        compression_changes: Vec<(u64, Compression)>,
        /// The ANA states of the fixture's two ports other than optimized, by (volume, port).
        path_states: BTreeMap<(u64, u16), AnaState>,
    }

    impl FixtureDataPlane {
        fn new(chunk_count: u32) -> Self {
            let state = FixtureState { free: (0..chunk_count).collect(), ..Default::default() };
            Self { state: Mutex::new(state), chunk_count }
        }

        fn take(&self, size_bytes: u64) -> Result<Vec<Chunk>, DataPlaneError> {
            let mut state = self.state.lock().unwrap();
            let needed = size_bytes.div_ceil(CHUNK_SIZE_BYTES) as usize;
            if needed > state.free.len() {
                return Err(DataPlaneError::NoSpace {
                    requested_bytes: size_bytes,
                    free_bytes: state.free.len() as u64 * CHUNK_SIZE_BYTES,
                });
            }
            let taken: Vec<u32> = state.free.iter().copied().take(needed).collect();
            for index in &taken {
                state.free.remove(index);
                state.reserved.insert(*index);
            }
            Ok(taken.into_iter().map(|index| (0, index)).collect())
        }

        fn free_chunks(&self) -> usize {
            self.state.lock().unwrap().free.len()
        }
    }

    impl DataPlane for FixtureDataPlane {
        fn reserve_create(&self, _id: u64, size_bytes: u64) -> Result<Vec<Chunk>, DataPlaneError> {
            self.take(size_bytes)
        }

        fn reserve_grow(
            &self,
            volume: &VolumeRecord,
            size_bytes: u64,
        ) -> Result<Vec<Chunk>, DataPlaneError> {
            let mut chunks = volume.chunks.clone();
            chunks.extend(self.take(size_bytes - volume.size_bytes)?);
            Ok(chunks)
        }

        fn cancel(&self, proposed: &VolumeRecord) {
            let mut state = self.state.lock().unwrap();
            for (_, index) in &proposed.chunks {
                if state.reserved.remove(index) {
                    state.free.insert(*index);
                } else {
                    assert!(!state.free.contains(index), "cancel of a chunk not reserved");
                }
            }
        }

        fn publish(&self, volume: &VolumeRecord) {
            let mut state = self.state.lock().unwrap();
            for (_, index) in &volume.chunks {
                state.reserved.remove(index);
            }
            state.published.insert(volume.id);
        }

        fn remove(&self, volume: &VolumeRecord) {
            let mut state = self.state.lock().unwrap();
            assert!(state.published.remove(&volume.id), "remove of a volume never published");
            for (_, index) in &volume.chunks {
                state.free.insert(*index);
            }
        }

        fn set_host_access(&self, volume: &VolumeRecord) {
            let mut state = self.state.lock().unwrap();
            assert!(state.published.contains(&volume.id), "host access of an unpublished volume");
            state.access_changes.push((volume.id, volume.host_access.clone()));
        }

        fn set_compression(&self, volume: &VolumeRecord) {
            let mut state = self.state.lock().unwrap();
            assert!(state.published.contains(&volume.id), "compression of an unpublished volume");
            state.compression_changes.push((volume.id, volume.compression));
        }

        fn snapshot(
            &self,
            volume: &VolumeRecord,
            snapshot: &SnapshotRecord,
        ) -> Result<(), DataPlaneError> {
            let snapshot_id = snapshot.id;
            let mut state = self.state.lock().unwrap();
            assert!(state.published.contains(&volume.id), "snapshot of an unpublished volume");
            if state.refuse_layers {
                return Err(DataPlaneError::SnapshotLimit("too deep".to_owned()));
            }
            assert!(state.stored.insert(snapshot_id), "snapshot id reused");
            Ok(())
        }

        fn clone_snapshot(
            &self,
            clone: &VolumeRecord,
            snapshot_id: u64,
        ) -> Result<(), DataPlaneError> {
            let mut state = self.state.lock().unwrap();
            assert!(state.stored.contains(&snapshot_id), "clone of an unknown snapshot");
            if state.refuse_layers {
                return Err(DataPlaneError::SnapshotLimit("too deep".to_owned()));
            }
            state.stored.insert(clone.id);
            Ok(())
        }

        fn rollback(&self, volume: &VolumeRecord, snapshot_id: u64) -> Result<(), DataPlaneError> {
            let mut state = self.state.lock().unwrap();
            assert!(state.stored.contains(&snapshot_id), "rollback to an unknown snapshot");
            state.rollbacks.push((volume.id, snapshot_id));
            Ok(())
        }

        fn remove_snapshot(&self, snapshot: &SnapshotRecord) {
            assert!(self.state.lock().unwrap().stored.remove(&snapshot.id));
        }

        fn stored_ids(&self) -> Option<Vec<u64>> {
            Some(self.state.lock().unwrap().stored.iter().copied().collect())
        }

        fn capacity(&self) -> Capacity {
            Capacity {
                total_bytes: u64::from(self.chunk_count) * CHUNK_SIZE_BYTES,
                free_bytes: self.free_chunks() as u64 * CHUNK_SIZE_BYTES,
                chunk_size_bytes: CHUNK_SIZE_BYTES,
                ..Capacity::default()
            }
        }

        fn nvme_addr(&self) -> Option<SocketAddr> {
            None
        }

        fn paths(&self, volume: &VolumeRecord) -> Vec<VolumePath> {
            let state = self.state.lock().unwrap();
            (1..=2)
                .map(|port_id| VolumePath {
                    port_id,
                    address: SocketAddr::from(([127, 0, 0, 1], 4420 + port_id)),
                    state: state
                        .path_states
                        .get(&(volume.id, port_id))
                        .copied()
                        .unwrap_or(AnaState::Optimized),
                })
                .collect()
        }

        fn set_path_state(
            &self,
            volume: &VolumeRecord,
            port_id: u16,
            state: AnaState,
        ) -> Result<(), DataPlaneError> {
            if !(1..=2).contains(&port_id) {
                return Err(DataPlaneError::invalid(format!("no NVMe/TCP port {port_id}")));
            }
            let mut fixture = self.state.lock().unwrap();
            match state {
                AnaState::Optimized => fixture.path_states.remove(&(volume.id, port_id)),
                other => fixture.path_states.insert((volume.id, port_id), other),
            };
            Ok(())
        }

        fn shutdown(&self) {}
    }

    /// Test fixture: a metadata store whose volume writes fail while `failing` is set.
    struct FlakyStore {
        inner: EmbeddedStore,
        failing: AtomicBool,
    }

    impl FlakyStore {
        fn check(&self) -> Result<(), MetaError> {
            if self.failing.load(Ordering::Relaxed) {
                return Err(MetaError::Backend { detail: "injected failure".to_owned() });
            }
            Ok(())
        }
    }

    impl MetaStore for FlakyStore {
        fn revision(&self) -> Result<u64, MetaError> {
            self.inner.revision()
        }
        fn node(&self) -> Result<Option<NodeRecord>, MetaError> {
            self.inner.node()
        }
        fn put_node(&self, node: &NodeRecord) -> Result<u64, MetaError> {
            self.inner.put_node(node)
        }
        fn allocate_volume_id(&self) -> Result<u64, MetaError> {
            self.inner.allocate_volume_id()
        }
        fn volume(&self, name: &VolumeName) -> Result<Option<VolumeRecord>, MetaError> {
            self.inner.volume(name)
        }
        fn volumes(&self) -> Result<Vec<VolumeRecord>, MetaError> {
            self.inner.volumes()
        }
        fn create_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError> {
            self.check()?;
            self.inner.create_volume(record)
        }
        fn update_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError> {
            self.check()?;
            self.inner.update_volume(record)
        }
        fn delete_volume(&self, name: &VolumeName) -> Result<VolumeRecord, MetaError> {
            self.check()?;
            self.inner.delete_volume(name)
        }
        fn snapshots(&self, volume: &VolumeName) -> Result<Vec<SnapshotRecord>, MetaError> {
            self.inner.snapshots(volume)
        }
        fn all_snapshots(&self) -> Result<Vec<SnapshotRecord>, MetaError> {
            self.inner.all_snapshots()
        }
        fn snapshot(
            &self,
            volume: &VolumeName,
            name: &VolumeName,
        ) -> Result<Option<SnapshotRecord>, MetaError> {
            self.inner.snapshot(volume, name)
        }
        fn create_snapshot(&self, record: &SnapshotRecord) -> Result<u64, MetaError> {
            self.check()?;
            self.inner.create_snapshot(record)
        }
        fn delete_snapshot(
            &self,
            volume: &VolumeName,
            name: &VolumeName,
        ) -> Result<SnapshotRecord, MetaError> {
            self.check()?;
            self.inner.delete_snapshot(volume, name)
        }
    }

    struct Setup {
        service: VolumeService,
        data_plane: Arc<FixtureDataPlane>,
        meta: Arc<FlakyStore>,
        metrics: Arc<Registry>,
        _dir: tempfile::TempDir,
    }

    fn setup(chunk_count: u32) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let meta = Arc::new(FlakyStore {
            inner: EmbeddedStore::open_in(dir.path()).unwrap(),
            failing: AtomicBool::new(false),
        });
        let data_plane = Arc::new(FixtureDataPlane::new(chunk_count));
        let metrics = Arc::new(Registry::new());
        let service = VolumeService::new(meta.clone(), data_plane.clone(), metrics.clone());
        Setup { service, data_plane, meta, metrics, _dir: dir }
    }

    #[test]
    fn create_resize_delete() {
        let setup = setup(16);
        let service = &setup.service;
        let created = service.create("db", 2 << 20, None).unwrap();
        assert_eq!(created.chunks, vec![(0, 0), (0, 1)]);
        assert_eq!(created.uuid[6] >> 4, 4, "a version 4 UUID");
        assert_eq!(service.volume("db").unwrap(), created);
        assert_eq!(setup.data_plane.free_chunks(), 14);

        let grown = service.resize("db", 3 << 20).unwrap();
        assert_eq!(grown.chunks, vec![(0, 0), (0, 1), (0, 2)]);
        assert_eq!(grown.id, created.id);
        assert_eq!(service.volume("db").unwrap(), grown);
        assert_eq!(service.resize("db", 3 << 20).unwrap(), grown, "same size is a no-op");

        let other = service.create("other", 1 << 20, None).unwrap();
        assert!(other.id > created.id);
        let names: Vec<String> =
            service.volumes().unwrap().iter().map(|v| v.name.to_string()).collect();
        assert_eq!(names, ["db", "other"]);

        assert_eq!(service.delete("db").unwrap(), grown);
        assert_eq!(setup.data_plane.free_chunks(), 15);
        assert!(matches!(service.volume("db"), Err(ControlError::VolumeNotFound(_))));
        assert!(!setup.metrics.render(&Default::default()).contains("volume=\"db\""));
        assert!(setup.metrics.render(&Default::default()).contains("volume=\"other\""));
    }

    #[test]
    fn refusals() {
        let setup = setup(4);
        let service = &setup.service;
        service.create("db", 2 << 20, None).unwrap();
        let check = |result: Result<VolumeRecord, ControlError>, expect: &str| {
            let error = result.unwrap_err();
            assert!(error.to_string().contains(expect), "{error} does not contain {expect:?}");
        };
        check(service.create("db", 1 << 20, None), "volume db already exists");
        check(service.create("Bad Name", 1 << 20, None), "invalid volume name");
        check(service.create("x", 4097, None), "invalid volume size 4097 bytes");
        check(service.create("x", 0, None), "invalid volume size");
        check(service.create("x", 3 << 20, None), "needs 3MiB more and 2MiB is free");
        check(service.resize("db", 1 << 20), "volume db is 2MiB and cannot shrink to 1MiB");
        check(service.resize("db", 5 << 20), "needs 3MiB more and 2MiB is free");
        check(service.resize("nope", 8 << 20), "volume nope does not exist");
        check(service.resize("db", (2 << 20) + 1), "invalid volume size");
        check(service.delete("nope"), "volume nope does not exist");
        check(service.volume("nope"), "volume nope does not exist");
        check(service.volume("../x"), "invalid volume name");
        assert_eq!(setup.data_plane.free_chunks(), 2, "refusals reserve nothing");
    }

    #[test]
    fn failed_meta_writes_cancel_reservations() {
        let setup = setup(8);
        let service = &setup.service;
        service.create("db", 1 << 20, None).unwrap();
        setup.meta.failing.store(true, Ordering::Relaxed);
        assert!(matches!(service.create("new", 2 << 20, None), Err(ControlError::Meta(_))));
        assert!(matches!(service.resize("db", 4 << 20), Err(ControlError::Meta(_))));
        assert!(matches!(service.delete("db"), Err(ControlError::Meta(_))));
        assert_eq!(setup.data_plane.free_chunks(), 7, "every reservation was cancelled");
        assert!(setup.data_plane.state.lock().unwrap().reserved.is_empty());

        setup.meta.failing.store(false, Ordering::Relaxed);
        assert_eq!(service.volume("db").unwrap().size_bytes, 1 << 20);
        assert!(matches!(service.volume("new"), Err(ControlError::VolumeNotFound(_))));
        service.create("new", 2 << 20, None).unwrap();
    }

    fn nqn(text: &str) -> Nqn {
        Nqn::new(text).unwrap()
    }

    fn restricted(hosts: &[&str]) -> HostAccess {
        HostAccess::Restricted(hosts.iter().copied().map(nqn).collect())
    }

    #[test]
    fn host_access_open_restricted_and_back() {
        let setup = setup(8);
        let service = &setup.service;
        let created = service.create("db", 1 << 20, None).unwrap();
        assert_eq!(created.host_access, HostAccess::Open, "a new volume is open");
        let changes = || setup.data_plane.state.lock().unwrap().access_changes.clone();

        let record = service.allow_host("db", "nqn.host:a").unwrap();
        assert_eq!(record.host_access, restricted(&["nqn.host:a"]), "the first allow restricts");
        assert_eq!(record.size_bytes, created.size_bytes);
        assert_eq!(record.chunks, created.chunks);
        let record = service.allow_host("db", "nqn.host:b").unwrap();
        assert_eq!(record.host_access, restricted(&["nqn.host:a", "nqn.host:b"]));
        assert_eq!(service.allow_host("db", "nqn.host:b").unwrap(), record, "allowed already");
        assert_eq!(service.volume("db").unwrap(), record, "the change is in the store");

        let record = service.deny_host("db", "nqn.host:a").unwrap();
        assert_eq!(record.host_access, restricted(&["nqn.host:b"]));
        assert_eq!(service.deny_host("db", "nqn.host:a").unwrap(), record, "denied already");
        let record = service.deny_host("db", "nqn.host:b").unwrap();
        assert_eq!(record.host_access, restricted(&[]), "denying the last host opens nothing");

        let record = service.allow_any_host("db").unwrap();
        assert_eq!(record.host_access, HostAccess::Open);
        let record = service.deny_any_host("db").unwrap();
        assert_eq!(record.host_access, restricted(&[]));
        service.allow_host("db", "nqn.host:c").unwrap();
        let record = service.deny_any_host("db").unwrap();
        assert_eq!(record.host_access, restricted(&[]), "deny any forgets the list");

        // A resize keeps the host access.
        assert_eq!(service.resize("db", 2 << 20).unwrap().host_access, restricted(&[]));

        let id = created.id;
        assert_eq!(
            changes(),
            [
                (id, restricted(&["nqn.host:a"])),
                (id, restricted(&["nqn.host:a", "nqn.host:b"])),
                (id, restricted(&["nqn.host:b"])),
                (id, restricted(&[])),
                (id, HostAccess::Open),
                (id, restricted(&[])),
                (id, restricted(&["nqn.host:c"])),
                (id, restricted(&[])),
            ],
            "the data plane hears of every change and of nothing else"
        );
    }

    #[test]
    fn host_access_refusals() {
        let setup = setup(4);
        let service = &setup.service;
        service.create("db", 1 << 20, None).unwrap();
        let check = |result: Result<VolumeRecord, ControlError>, expect: &str| {
            let error = result.unwrap_err();
            assert!(error.to_string().contains(expect), "{error} does not contain {expect:?}");
        };
        check(service.deny_host("db", "nqn.host:a"), "volume db is open to any host");
        check(service.deny_host("db", "nqn.host:a"), "ferrite host deny db any");
        check(service.allow_host("db", "host-a"), "invalid NQN \"host-a\"");
        check(service.allow_host("db", "nqn.a b"), "/etc/nvme/hostnqn");
        check(service.deny_host("db", ""), "invalid NQN");
        check(service.allow_host("nope", "nqn.host:a"), "volume nope does not exist");
        check(service.allow_any_host("nope"), "volume nope does not exist");
        check(service.deny_any_host("Bad"), "invalid volume name");

        // A full list, written straight to the store (one write rather than 1024).
        let hosts = (0..ALLOWED_HOSTS_MAX).map(|index| nqn(&format!("nqn.host:{index}")));
        let full = VolumeRecord {
            host_access: HostAccess::Restricted(hosts.collect()),
            ..service.volume("db").unwrap()
        };
        setup.meta.update_volume(&full).unwrap();
        check(service.allow_host("db", "nqn.host:one-more"), "already allows 1024 hosts");
        assert_eq!(service.allow_host("db", "nqn.host:0").unwrap(), full, "allowed already");
        assert_eq!(
            service.deny_host("db", "nqn.host:0").unwrap().host_access.hosts().count(),
            1023
        );

        setup.meta.failing.store(true, Ordering::Relaxed);
        assert!(matches!(service.deny_any_host("db"), Err(ControlError::Meta(_))));
        assert!(matches!(service.allow_any_host("db"), Err(ControlError::Meta(_))));
        setup.meta.failing.store(false, Ordering::Relaxed);
        let hosts = service.volume("db").unwrap().host_access.hosts().count();
        assert_eq!(hosts, ALLOWED_HOSTS_MAX - 1, "a failed write changes nothing");
        assert_eq!(
            setup.data_plane.state.lock().unwrap().access_changes.len(),
            1,
            "the data plane hears only of durable changes"
        );
    }

    #[test]
    fn snapshots_clones_rollback_and_deletion() {
        let setup = setup(16);
        let service = &setup.service;
        let db = service.create("db", 2 << 20, None).unwrap();
        let s1 = service.create_snapshot("db", "s1").unwrap();
        assert_eq!((s1.volume.as_str(), s1.name.as_str(), s1.size_bytes), ("db", "s1", 2 << 20));
        assert!(s1.id > db.id);
        service.resize("db", 3 << 20).unwrap();
        let s2 = service.create_snapshot("db", "s2").unwrap();
        assert_eq!(s2.size_bytes, 3 << 20, "a snapshot has its volume's size at the time");
        let names: Vec<String> =
            service.snapshots("db").unwrap().iter().map(|s| s.name.to_string()).collect();
        assert_eq!(names, ["s1", "s2"]);
        assert_eq!(service.snapshot("db", "s1").unwrap(), s1);

        let clone = service.create_clone("copy", "db@s1", None, None).unwrap();
        assert_eq!(clone.size_bytes, 2 << 20, "a clone has its snapshot's size");
        let origin = clone.origin.clone().unwrap();
        assert_eq!((origin.volume.as_str(), origin.snapshot.as_str()), ("db", "s1"));
        assert_eq!(origin.snapshot_id, s1.id);
        let big = service.create_clone("big", "db@s1", Some(4 << 20), None).unwrap();
        assert_eq!(big.size_bytes, 4 << 20);
        assert!(setup.data_plane.state.lock().unwrap().published.contains(&clone.id));

        assert_eq!(service.rollback("db", "s1").unwrap().id, db.id);
        assert_eq!(service.rollback("db", "db@s2").unwrap().id, db.id);
        assert_eq!(
            setup.data_plane.state.lock().unwrap().rollbacks,
            [(db.id, s1.id), (db.id, s2.id)]
        );

        assert_eq!(service.snapshot_counts().unwrap().get(&db.name), Some(&2));
        assert_eq!(service.delete_snapshot("db", "s1").unwrap(), s1);
        assert_eq!(service.snapshot_count(&db.name).unwrap(), 1);
        // Deleting the volume deletes its snapshots, not its clones.
        service.delete("db").unwrap();
        assert!(service.meta.all_snapshots().unwrap().is_empty());
        let stored = setup.data_plane.state.lock().unwrap().stored.clone();
        assert_eq!(stored, [clone.id, big.id].into(), "the snapshots' data is deleted");
        assert_eq!(service.volume("copy").unwrap(), clone);
    }

    #[test]
    fn compression_defaults_inheritance_and_changes() {
        let setup = setup(16);
        let service = &setup.service;
        let db = service.create("db", 1 << 20, None).unwrap();
        assert_eq!(db.compression, Compression::Lz4, "lz4 by default");
        let raw = service.create("raw", 1 << 20, Some("OFF")).unwrap();
        assert_eq!(raw.compression, Compression::Off);
        assert_eq!(service.volume("raw").unwrap().compression, Compression::Off, "stored");
        let error = service.create("bad", 1 << 20, Some("gzip")).unwrap_err();
        assert!(matches!(error, ControlError::InvalidCompression(_)), "{error}");
        for allowed in ["lz4", "zstd", "off"] {
            assert!(error.to_string().contains(allowed), "{error} lacks {allowed}");
        }
        assert!(matches!(service.volume("bad"), Err(ControlError::VolumeNotFound(_))));

        // A clone inherits its source volume's setting unless given one.
        service.create_snapshot("raw", "s").unwrap();
        let inherited = service.create_clone("copy", "raw@s", None, None).unwrap();
        assert_eq!(inherited.compression, Compression::Off);
        let given = service.create_clone("copy2", "raw@s", None, Some("zstd")).unwrap();
        assert_eq!(given.compression, Compression::Zstd);
        let error = service.create_clone("copy3", "raw@s", None, Some("lz5")).unwrap_err();
        assert!(matches!(error, ControlError::InvalidCompression(_)), "{error}");

        // Changing it writes the record, then tells the data plane; the same value is a no-op.
        let changed = service.set_compression("db", "zstd").unwrap();
        assert_eq!(changed, VolumeRecord { compression: Compression::Zstd, ..db.clone() });
        assert_eq!(service.volume("db").unwrap(), changed);
        assert_eq!(service.set_compression("db", "zstd").unwrap(), changed);
        assert!(matches!(
            service.set_compression("db", "best").unwrap_err(),
            ControlError::InvalidCompression(_)
        ));
        assert!(matches!(
            service.set_compression("nope", "off").unwrap_err(),
            ControlError::VolumeNotFound(_)
        ));
        setup.meta.failing.store(true, Ordering::Relaxed);
        assert!(matches!(service.set_compression("db", "off"), Err(ControlError::Meta(_))));
        setup.meta.failing.store(false, Ordering::Relaxed);
        assert_eq!(
            setup.data_plane.state.lock().unwrap().compression_changes,
            [(db.id, Compression::Zstd)],
            "the data plane hears only of durable changes"
        );
        // A resize keeps the setting.
        assert_eq!(service.resize("db", 2 << 20).unwrap().compression, Compression::Zstd);
    }

    #[test]
    fn path_states_are_kept_in_the_record() {
        let setup = setup(8);
        let service = &setup.service;
        let db = service.create("db", 1 << 20, None).unwrap();
        assert!(db.path_states.is_empty(), "a new volume is optimized on every port");
        let kept = |service: &VolumeService| service.volume("db").unwrap().path_states;
        let served = |port: u16| {
            let fixture = setup.data_plane.state.lock().unwrap();
            fixture.path_states.get(&(db.id, port)).copied().unwrap_or(AnaState::Optimized)
        };

        let paths = service.set_path_state("db", 2, AnaState::Inaccessible).unwrap();
        assert_eq!(paths[1].state, AnaState::Inaccessible);
        assert_eq!(kept(service), [(2, PathState::Inaccessible)].into());
        service.set_path_state("db", 1, AnaState::NonOptimized).unwrap();
        service.set_path_state("db", 2, AnaState::Optimized).unwrap();
        assert_eq!(kept(service), [(1, PathState::NonOptimized)].into(), "optimized is not kept");
        assert_eq!((served(1), served(2)), (AnaState::NonOptimized, AnaState::Optimized));

        // Refused: a port the node lacks, a state only the cluster sets, an unknown volume.
        let error = service.set_path_state("db", 3, AnaState::Inaccessible).unwrap_err();
        assert!(error.to_string().contains("no NVMe/TCP port 3"), "{error}");
        let error = service.set_path_state("db", 2, AnaState::Change).unwrap_err();
        assert!(error.to_string().contains("set by the cluster only"), "{error}");
        assert!(matches!(
            service.set_path_state("nope", 1, AnaState::Inaccessible),
            Err(ControlError::VolumeNotFound(_))
        ));
        assert_eq!(kept(service), [(1, PathState::NonOptimized)].into());
        assert_eq!(served(2), AnaState::Optimized);

        // A state that cannot be kept is not served either: the port goes back as it was.
        setup.meta.failing.store(true, Ordering::Relaxed);
        assert!(matches!(
            service.set_path_state("db", 2, AnaState::Inaccessible),
            Err(ControlError::Meta(_))
        ));
        setup.meta.failing.store(false, Ordering::Relaxed);
        assert_eq!(served(2), AnaState::Optimized);
        assert_eq!(kept(service), [(1, PathState::NonOptimized)].into());

        // A state kept for a port the node no longer has is cleared by setting it optimized.
        let mut record = service.volume("db").unwrap();
        record.path_states.insert(5, PathState::Inaccessible);
        setup.meta.update_volume(&record).unwrap();
        let error = service.set_path_state("db", 5, AnaState::NonOptimized).unwrap_err();
        assert!(error.to_string().contains("no NVMe/TCP port 5"), "{error}");
        service.set_path_state("db", 5, AnaState::Optimized).unwrap();
        assert_eq!(kept(service), [(1, PathState::NonOptimized)].into());
        assert!(service.set_path_state("db", 5, AnaState::Optimized).is_err(), "nothing kept");

        // Other changes keep the states.
        service.set_compression("db", "zstd").unwrap();
        service.resize("db", 2 << 20).unwrap();
        service.deny_any_host("db").unwrap();
        assert_eq!(kept(service), [(1, PathState::NonOptimized)].into());
    }

    #[test]
    fn snapshot_refusals() {
        let setup = setup(16);
        let service = &setup.service;
        service.create("db", 2 << 20, None).unwrap();
        service.create("other", 1 << 20, None).unwrap();
        service.create_snapshot("db", "s1").unwrap();
        service.create_snapshot("other", "o1").unwrap();
        let check = |error: ControlError, expect: &str| {
            assert!(error.to_string().contains(expect), "{error} does not contain {expect:?}");
        };
        let error = service.create_snapshot("db", "s1").unwrap_err();
        assert!(matches!(error, ControlError::SnapshotExists { .. }), "{error}");
        check(service.create_snapshot("nope", "s1").unwrap_err(), "volume nope does not exist");
        check(service.create_snapshot("db", "Bad").unwrap_err(), "invalid volume name");
        let error = service.snapshot("db", "nope").unwrap_err();
        assert!(matches!(error, ControlError::SnapshotNotFound { .. }), "{error}");
        check(service.delete_snapshot("db", "nope").unwrap_err(), "has no snapshot named nope");
        check(service.rollback("db", "o1").unwrap_err(), "volume db has no snapshot named o1");
        check(service.rollback("db", "other@o1").unwrap_err(), "belongs to volume other");
        check(
            service.create_clone("c", "db", None, None).unwrap_err(),
            "is not a snapshot reference",
        );
        check(
            service.create_clone("c", "db@nope", None, None).unwrap_err(),
            "no snapshot named nope",
        );
        check(
            service.create_clone("db", "db@s1", None, None).unwrap_err(),
            "volume db already exists",
        );
        let error = service.create_clone("c", "db@s1", Some(1 << 20), None).unwrap_err();
        assert!(matches!(error, ControlError::CloneTooSmall { .. }), "{error}");
        check(error, "at least as large as its snapshot");

        // A refusal of the data plane leaves no record behind and reserves nothing.
        let free = setup.data_plane.free_chunks();
        setup.data_plane.state.lock().unwrap().refuse_layers = true;
        let error = service.create_snapshot("db", "s2").unwrap_err();
        assert!(matches!(error, ControlError::SnapshotLimit { .. }), "{error}");
        let error = service.create_clone("c", "db@s1", None, None).unwrap_err();
        assert!(matches!(error, ControlError::SnapshotLimit { .. }), "{error}");
        assert_eq!(service.snapshots("db").unwrap().len(), 1);
        assert!(matches!(service.volume("c"), Err(ControlError::VolumeNotFound(_))));
        assert_eq!(setup.data_plane.free_chunks(), free);
        assert!(setup.data_plane.state.lock().unwrap().reserved.is_empty());
    }

    /// Records whose engine operation never happened (a crash in between) are dropped at start;
    /// complete ones stay.
    #[test]
    fn drop_incomplete_drops_records_the_engine_lacks() {
        let setup = setup(16);
        let service = &setup.service;
        service.create("db", 1 << 20, None).unwrap();
        let kept = service.create_snapshot("db", "kept").unwrap();
        let clone = service.create_clone("copy", "db@kept", None, None).unwrap();
        let lost = service.create_snapshot("db", "lost").unwrap();
        let lost_clone = service.create_clone("lost-copy", "db@lost", None, None).unwrap();
        {
            let mut state = setup.data_plane.state.lock().unwrap();
            state.stored.remove(&lost.id);
            state.stored.remove(&lost_clone.id);
        }
        service.drop_incomplete().unwrap();
        assert_eq!(service.snapshots("db").unwrap(), [kept]);
        assert_eq!(service.volume("copy").unwrap(), clone);
        assert!(matches!(service.volume("lost-copy"), Err(ControlError::VolumeNotFound(_))));
        assert!(service.volume("db").is_ok(), "plain volumes are never dropped");
    }

    #[test]
    fn concurrent_creates_of_one_name_make_one_volume() {
        let setup = setup(64);
        let service = &setup.service;
        let successes = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| scope.spawn(|| service.create("same", 1 << 20, None).is_ok()))
                .collect();
            handles.into_iter().map(|handle| handle.join().unwrap()).filter(|ok| *ok).count()
        });
        assert_eq!(successes, 1);
        assert_eq!(setup.data_plane.free_chunks(), 63);
    }
}
