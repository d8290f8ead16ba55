//! Cluster metadata behind one trait, so the control plane does not care where it is kept.
//!
//! A single node keeps its metadata in an embedded redb file ([`EmbeddedStore`]); a cluster keeps
//! it in etcd ([`EtcdStore`]). Both implement [`MetaStore`], and both must pass the same
//! conformance suite, [`testing::check_store`] and [`testing::check_concurrent_writers`].
//!
//! What is stored: one [`NodeRecord`] (who this node is and how its drives were formatted), one
//! [`VolumeRecord`] per volume, keyed by name, and one [`SnapshotRecord`] per snapshot, keyed by
//! its volume's name and its own (snapshot names are scoped to their volume). Every call is one transaction: it either happens
//! completely and durably or not at all. Every write transaction advances the store's revision, a
//! counter that lets a reader tell whether anything changed.
//!
//! A cluster also keeps its replication control state (the store `replication` asks), its
//! members and its manager in etcd, under the same prefix: [`ClusterStore`].
//!
//! Records are serialised by this crate ([`record`]), each with a format version; a record with a
//! version this build does not know is refused with an error, never guessed at.

pub mod cluster;
mod embedded;
mod etcd;
pub mod record;
pub mod testing;

pub use cluster::{member_name_valid, ClusterStore, MemberRecord};
pub use embedded::{EmbeddedStore, META_FILE_NAME};
pub use etcd::{
    EtcdStore, CAS_ATTEMPTS_MAX, ENDPOINTS_MAX, ETCD_TIMEOUT_DEFAULT, PREFIX_LENGTH_MAX,
};

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use types::{Nqn, VolumeName};

/// The most host NQNs one volume's allowed-hosts list holds. A bound on the record's size (each
/// NQN is at most 223 bytes) and on the work of a Connect; far above the hosts that share a
/// volume in practice.
pub const ALLOWED_HOSTS_MAX: usize = 1024;

/// A chunk of drive space given to a volume: `(drive index, chunk index on that drive)`.
///
/// This is the engine's `ChunkId` as a plain pair, so `meta` does not depend on `engine`.
pub type Chunk = (u16, u32);

/// Everything the cluster remembers about one volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    /// Unique for the life of the store, never reused; allocated by
    /// [`MetaStore::allocate_volume_id`].
    pub id: u64,
    pub name: VolumeName,
    pub size_bytes: u64,
    /// The volume's UUID, also its NVMe namespace UUID.
    pub uuid: [u8; 16],
    pub created_unix_ms: u64,
    /// The engine chunks that hold the volume, in volume order.
    pub chunks: Vec<Chunk>,
    /// Which hosts may connect to the volume's NVMe subsystem.
    pub host_access: HostAccess,
    /// The snapshot this volume was cloned from; `None` for a volume created empty.
    ///
    /// Informative only: the parent volume and its snapshot may be deleted later, and the clone
    /// stays intact (its blocks are shared in the engine, not borrowed from the parent's record).
    pub origin: Option<VolumeOrigin>,
    /// How the volume's new writes are stored. Blocks already written keep the form they were
    /// written in, so changing it needs no rewrite.
    pub compression: Compression,
    /// The ANA states set by hand on the node's NVMe/TCP ports (`ferrite volume set-path`), by
    /// port ID; a port not listed is optimized. At most [`PATH_STATES_MAX`] entries, no port 0.
    pub path_states: BTreeMap<u16, PathState>,
}

/// How many ports a volume record keeps a hand-set ANA state for.
pub const PATH_STATES_MAX: usize = 64;

/// An ANA state set by hand on one port, as the record keeps it: the states an operator may set
/// other than optimized (which is what a port not listed has).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PathState {
    NonOptimized,
    Inaccessible,
}

impl PathState {
    /// The stored form.
    pub const fn name(self) -> &'static str {
        match self {
            PathState::NonOptimized => "non-optimized",
            PathState::Inaccessible => "inaccessible",
        }
    }

    /// The state stored as `name`, if any.
    pub fn from_name(name: &str) -> Option<PathState> {
        [PathState::NonOptimized, PathState::Inaccessible]
            .into_iter()
            .find(|state| state.name() == name)
    }
}

/// How a volume's new writes are stored: the control plane's copy of
/// `engine::compress::Compression` (`meta` does not depend on `engine`; the node converts
/// between the two with exhaustive matches, so a setting added to one and not the other does
/// not compile).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Compression {
    /// Every block is stored raw. Volumes created before compression existed (records before
    /// version 4) have this, since their blocks were written raw.
    Off,
    /// LZ4: fast; the default for new volumes.
    #[default]
    Lz4,
    /// zstd: smaller, slower.
    Zstd,
}

impl Compression {
    /// Every setting, in the order users see them listed.
    pub const ALL: [Compression; 3] = [Compression::Lz4, Compression::Zstd, Compression::Off];

    /// The name users type and see (`--compression lz4`), also the stored form.
    pub const fn name(self) -> &'static str {
        match self {
            Compression::Off => "off",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        }
    }

    /// The setting named `name` (exactly, lowercase), if any.
    pub fn from_name(name: &str) -> Option<Compression> {
        Compression::ALL.into_iter().find(|compression| compression.name() == name)
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a clone came from: a snapshot of another volume, as it was when the clone was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeOrigin {
    /// The volume the snapshot was taken of.
    pub volume: VolumeName,
    /// The snapshot's name.
    pub snapshot: VolumeName,
    /// The snapshot's id ([`SnapshotRecord::id`]), which tells it apart from a later snapshot
    /// of the same name.
    pub snapshot_id: u64,
}

/// A read-only point-in-time image of a volume. The data lives in the engine; this is the
/// control plane's memory of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRecord {
    /// Allocated by [`MetaStore::allocate_volume_id`], so that ids are unique across volumes and
    /// snapshots and never reused.
    pub id: u64,
    /// The volume the snapshot was taken of.
    pub volume: VolumeName,
    /// The snapshot's name, unique among the snapshots of its volume; the same naming rules as
    /// a volume's.
    pub name: VolumeName,
    /// The volume's size when the snapshot was taken.
    pub size_bytes: u64,
    /// The NVMe namespace UUID under which the snapshot is exported read-only.
    pub uuid: [u8; 16],
    pub created_unix_ms: u64,
}

/// Which hosts may connect to a volume's NVMe subsystem (and see it in the discovery log).
///
/// Two explicit states rather than "an empty list means anyone", so that removing the last
/// allowed host can never silently open a volume to every host.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum HostAccess {
    /// Any host may connect. A new volume starts here, and so does every volume written before
    /// host access control existed (record version 1).
    #[default]
    Open,
    /// Only the listed host NQNs may connect; an empty list admits no host. Holds at most
    /// [`ALLOWED_HOSTS_MAX`] NQNs.
    Restricted(BTreeSet<Nqn>),
}

impl HostAccess {
    /// Whether the host `hostnqn` may connect.
    pub fn allows(&self, hostnqn: &Nqn) -> bool {
        match self {
            HostAccess::Open => true,
            HostAccess::Restricted(hosts) => hosts.contains(hostnqn),
        }
    }

    /// The allowed host NQNs, sorted; empty when the volume is open.
    pub fn hosts(&self) -> impl Iterator<Item = &Nqn> {
        let hosts = match self {
            HostAccess::Open => None,
            HostAccess::Restricted(hosts) => Some(hosts),
        };
        hosts.into_iter().flatten()
    }

    pub fn is_open(&self) -> bool {
        matches!(self, HostAccess::Open)
    }
}

/// Who this node is. Written once, on the node's first start, after its drives are formatted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRecord {
    pub uuid: [u8; 16],
    pub drive_count: u16,
    pub drive_size_bytes: u64,
    pub created_unix_ms: u64,
    /// The drives are block devices or files the operator named (`ferrite up --drive`), found
    /// by their superblocks; false: drive files in the data directory.
    pub external_drives: bool,
}

/// Why a metadata operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("volume {0} already exists")]
    VolumeExists(VolumeName),
    #[error("volume {0} does not exist")]
    VolumeNotFound(VolumeName),
    #[error("volume {volume} already has a snapshot named {snapshot}")]
    SnapshotExists { volume: VolumeName, snapshot: VolumeName },
    #[error("volume {volume} has no snapshot named {snapshot}")]
    SnapshotNotFound { volume: VolumeName, snapshot: VolumeName },
    #[error(
        "the metadata store {} is in use by another process; is another `ferrite up` running \
         on this data dir?",
        path.display()
    )]
    InUse { path: PathBuf },
    #[error("cannot open the metadata store {}: {detail}", path.display())]
    Open { path: PathBuf, detail: String },
    #[error("metadata store failed: {detail}")]
    Backend { detail: String },
    /// etcd did not answer: not running, not reachable, or without a quorum.
    #[error("cannot reach etcd at {endpoints}: is etcd running? ({detail})")]
    Unreachable { endpoints: String, detail: String },
    /// The store's settings are unusable (an etcd key prefix or endpoint list, say).
    #[error("invalid metadata store setting: {detail}")]
    Config { detail: String },
    /// The cluster store holds no replication state for the volume (never created, or deleted).
    #[error("volume {volume_id} has no replication state in the cluster store")]
    ReplicationStateMissing { volume_id: u64 },
    #[error("volume {volume_id} already has a replication state in the cluster store")]
    ReplicationStateExists { volume_id: u64 },
    #[error("no cluster member named {name:?} (with this id) is registered")]
    MemberNotFound { name: String },
    #[error("cluster member {name:?} is invalid: {detail}")]
    MemberInvalid { name: String, detail: String },
    /// A campaign for the manager's role with a lease the node does not hold (expired, never
    /// granted, or another node's); the node must renew its lease first.
    #[error("node {node} does not hold a live lease {lease}; renew its lease and try again")]
    LeaseNotHeld { node: replication::NodeId, lease: u64 },
    #[error("metadata record {key:?} is corrupt: {detail}")]
    RecordCorrupt { key: String, detail: String },
    #[error(
        "metadata record {key:?} has format version {version}, but this build reads versions \
         up to {supported}; run a newer ferrite"
    )]
    RecordVersionUnsupported { key: String, version: u64, supported: u32 },
}

/// The store of cluster metadata. Every method is one transaction, durable when it returns `Ok`.
///
/// Writers return the store's revision after their transaction. Readers see a consistent
/// snapshot. Implementations serialise writers; callers that need read-then-write consistency
/// across calls (the volume service) serialise themselves.
pub trait MetaStore: Send + Sync {
    /// The revision of the last committed write transaction; 0 for an empty store.
    fn revision(&self) -> Result<u64, MetaError>;

    /// This node's record, or `None` before the node's first start completed.
    fn node(&self) -> Result<Option<NodeRecord>, MetaError>;

    /// Writes this node's record, replacing any previous one.
    fn put_node(&self, node: &NodeRecord) -> Result<u64, MetaError>;

    /// Allocates a volume id in its own transaction: every call returns a larger id than any
    /// call before it, across restarts. An id whose volume was never created is simply skipped.
    fn allocate_volume_id(&self) -> Result<u64, MetaError>;

    /// The volume named `name`, if any.
    fn volume(&self, name: &VolumeName) -> Result<Option<VolumeRecord>, MetaError>;

    /// Every volume, sorted by name.
    fn volumes(&self) -> Result<Vec<VolumeRecord>, MetaError>;

    /// Stores a new volume. Fails with [`MetaError::VolumeExists`] if the name is taken.
    ///
    /// The record's id must come from [`MetaStore::allocate_volume_id`] on this store.
    fn create_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError>;

    /// Replaces an existing volume's record. Fails with [`MetaError::VolumeNotFound`] unless a
    /// volume with this name and this id exists (a volume deleted and created again under the
    /// same name is a different volume).
    fn update_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError>;

    /// Deletes a volume and returns its last record. Fails with [`MetaError::VolumeNotFound`].
    ///
    /// The volume's snapshot records are left alone: the control plane deletes them first.
    fn delete_volume(&self, name: &VolumeName) -> Result<VolumeRecord, MetaError>;

    /// The snapshots of `volume`, oldest first (by id, which increases with creation). Empty
    /// when the volume has none or does not exist.
    fn snapshots(&self, volume: &VolumeName) -> Result<Vec<SnapshotRecord>, MetaError>;

    /// Every snapshot of every volume, sorted by volume name, then oldest first.
    fn all_snapshots(&self) -> Result<Vec<SnapshotRecord>, MetaError>;

    /// The snapshot `name` of `volume`, if any.
    fn snapshot(
        &self,
        volume: &VolumeName,
        name: &VolumeName,
    ) -> Result<Option<SnapshotRecord>, MetaError>;

    /// Stores a new snapshot of `record.volume`. Fails, in the same transaction, with
    /// [`MetaError::VolumeNotFound`] if that volume does not exist and with
    /// [`MetaError::SnapshotExists`] if it already has a snapshot of this name.
    ///
    /// The record's id must come from [`MetaStore::allocate_volume_id`] on this store.
    fn create_snapshot(&self, record: &SnapshotRecord) -> Result<u64, MetaError>;

    /// Deletes a snapshot and returns its last record. Fails with
    /// [`MetaError::SnapshotNotFound`].
    fn delete_snapshot(
        &self,
        volume: &VolumeName,
        name: &VolumeName,
    ) -> Result<SnapshotRecord, MetaError>;
}
