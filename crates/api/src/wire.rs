//! Request and response bodies of the REST API, as JSON.
//!
//! Sizes are plain byte counts (`size_bytes`); parsing `10G` is the client's job. UUIDs are
//! lowercase hyphenated strings, times are Unix milliseconds. Fields are only ever added, never
//! renamed, so older clients keep working; unknown fields are ignored when reading.

use serde::{Deserialize, Serialize};

/// `POST /v1/volumes`: a new empty volume of `size_bytes`, or a clone of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateVolume {
    pub name: String,
    /// Required for an empty volume. For a clone it may be omitted, and the clone has the
    /// snapshot's size; given, the node decides whether it may differ from the snapshot's.
    ///
    /// Optional rather than filled in by the client from the snapshot: the client need not
    /// look the snapshot up first, and a clone request sent without a size to a node that
    /// predates clones fails there ("missing field") instead of creating an empty volume,
    /// since that node ignores the `from_snapshot` it does not know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// `VOLUME@SNAPSHOT` ([`snapshot_ref`]): the new volume is a writable clone of that
    /// snapshot, sharing its blocks until they are overwritten. Absent for an empty volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// How the volume's writes are stored: one of [`COMPRESSIONS`]. Absent: [`COMPRESSION_LZ4`]
    /// for an empty volume, and the source volume's setting for a clone. Blocks that do not
    /// shrink are stored raw whatever the setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<String>,
    /// Copies of the volume on distinct nodes of a cluster, 1 to 3 (a single node takes only
    /// 1). Absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u8>,
}

/// [`CreateVolume::compression`] and [`VolumeInfo::compression`]: LZ4, fast; the default.
pub const COMPRESSION_LZ4: &str = "lz4";
/// zstd: more reduction than LZ4 for more CPU per write and read.
pub const COMPRESSION_ZSTD: &str = "zstd";
/// Every block stored raw.
pub const COMPRESSION_OFF: &str = "off";
/// Every compression setting a node accepts, the default first.
pub const COMPRESSIONS: [&str; 3] = [COMPRESSION_LZ4, COMPRESSION_ZSTD, COMPRESSION_OFF];

impl CreateVolume {
    /// A new empty volume.
    pub fn empty(name: impl Into<String>, size_bytes: u64) -> Self {
        Self {
            name: name.into(),
            size_bytes: Some(size_bytes),
            from_snapshot: None,
            compression: None,
            replicas: None,
        }
    }

    /// A clone of snapshot `snapshot` of `volume`, of the snapshot's size.
    pub fn clone_of_snapshot(name: impl Into<String>, volume: &str, snapshot: &str) -> Self {
        Self {
            name: name.into(),
            size_bytes: None,
            from_snapshot: Some(snapshot_ref(volume, snapshot)),
            compression: None,
            replicas: None,
        }
    }

    /// The same request with `replicas` copies on distinct cluster nodes.
    pub fn with_replicas(mut self, replicas: u8) -> Self {
        self.replicas = Some(replicas);
        self
    }

    /// The same request with compression `compression` (one of [`COMPRESSIONS`]).
    pub fn with_compression(mut self, compression: impl Into<String>) -> Self {
        self.compression = Some(compression.into());
        self
    }
}

/// `PUT /v1/volumes/{name}/compression`: how the volume's new writes are stored from now on.
/// Blocks already written keep their form (they are not rewritten).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetCompression {
    /// One of [`COMPRESSIONS`].
    pub compression: String,
}

/// What separates the volume from the snapshot in a snapshot reference, `VOLUME@SNAPSHOT`.
/// Volume and snapshot names never hold it.
pub const SNAPSHOT_REF_SEPARATOR: char = '@';

/// The reference to snapshot `snapshot` of `volume`: `VOLUME@SNAPSHOT`, as in
/// [`CreateVolume::from_snapshot`] and [`VolumeInfo::origin`].
pub fn snapshot_ref(volume: &str, snapshot: &str) -> String {
    format!("{volume}{SNAPSHOT_REF_SEPARATOR}{snapshot}")
}

/// Splits a snapshot reference `VOLUME@SNAPSHOT` into its volume and snapshot; `None` unless
/// there is exactly one separator with text on both sides. The names themselves are not
/// checked here (the node checks them as volume names).
pub fn parse_snapshot_ref(text: &str) -> Option<(&str, &str)> {
    let (volume, snapshot) = text.split_once(SNAPSHOT_REF_SEPARATOR)?;
    let valid =
        !volume.is_empty() && !snapshot.is_empty() && !snapshot.contains(SNAPSHOT_REF_SEPARATOR);
    valid.then_some((volume, snapshot))
}

/// `POST /v1/volumes/{name}/resize`. Volumes only grow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResizeVolume {
    pub size_bytes: u64,
}

/// A volume, as returned by every volume endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeInfo {
    pub name: String,
    pub id: u64,
    pub size_bytes: u64,
    /// The NVMe subsystem NQN that exposes the volume.
    pub nqn: String,
    /// The volume's UUID, also its NVMe namespace UUID.
    pub uuid: String,
    pub created_unix_ms: u64,
    /// The address hosts connect to over NVMe/TCP.
    pub nvme_host: String,
    pub nvme_port: u16,
    /// Whether any host may connect or only the allowed ones (`GET /v1/volumes/{name}/hosts`).
    /// Absent from nodes older than host access control, whose volumes are all open.
    #[serde(default)]
    pub access: AccessMode,
    /// Bytes of the volume written and not deallocated (thin: `size_bytes` is provisioned).
    /// Only `GET /v1/volumes/{name}` (and resize) report it: lists stay stable while data
    /// changes. Absent from older nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mapped_bytes: Option<u64>,
    /// Drive space the volume's mapped blocks take; reported like `mapped_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physical_used_bytes: Option<u64>,
    /// For a clone, the snapshot it was cloned from, `VOLUME@SNAPSHOT` ([`snapshot_ref`]); kept
    /// when that snapshot or its volume is deleted later. Absent for other volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
    /// How many snapshots the volume has. Absent from nodes older than snapshots: none.
    #[serde(default)]
    pub snapshot_count: u32,
    /// How the volume's new writes are stored: one of [`COMPRESSIONS`]. Absent from nodes
    /// older than compression, which store every block raw.
    #[serde(default = "compression_off")]
    pub compression: String,
    /// Bytes of the volume's mapped blocks per byte they take on the drives: above 1 when
    /// compression saves space, 1.0 when it saves none (or nothing is mapped, as in the answers
    /// of create and delete). Absent from older nodes.
    #[serde(default = "no_reduction")]
    pub data_reduction: f64,
    /// On a cluster: where the volume's replicas are and how they stand. Absent on a single
    /// node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<ReplicationInfo>,
    /// The volume's NBD export, `nbd://HOST:PORT/NAME`, when the answering node serves NBD and
    /// the volume is open to every host (NBD clients carry no host NQN). Absent otherwise, and
    /// from older nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_uri: Option<String>,
}

/// A replicated volume's state ([`VolumeInfo::replication`]), from the cluster's store and
/// the answering node's own view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicationInfo {
    /// Raised by every failover.
    pub epoch: u64,
    /// The node serving the volume (its NVMe/TCP paths are the optimized ones); absent before
    /// the first primary is chosen.
    pub primary: Option<String>,
    /// Every node holding a replica.
    pub members: Vec<String>,
    /// The replicas holding every completed write; the others are resyncing or away.
    pub in_sync: Vec<String>,
    /// What the answering node's replica does, if it holds one.
    pub local: Option<LocalReplica>,
    /// The copies the primary is making to replicas that are not in sync (a returning member's
    /// resync, a new member's rebuild), as the primary reports them. Empty when none runs, or
    /// when the answering node could not ask the primary.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resync: Vec<ResyncProgress>,
}

/// One copy to a replica that is not in sync ([`ReplicationInfo::resync`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResyncProgress {
    /// The node receiving the copy.
    pub node: String,
    /// The whole volume is copied (a new member, or one whose missed writes are unknown);
    /// otherwise only the blocks it missed.
    pub full: bool,
    /// Blocks this copy has had to send so far (those missed at the start and those written
    /// again before they were sent).
    pub blocks_total: u64,
    /// Blocks of those already sent.
    pub blocks_copied: u64,
}

/// `GET /v1/volumes/{name}/resync`: the copies the answering node makes as the volume's
/// primary (empty when it is not the primary or copies nothing).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResyncList {
    pub resync: Vec<ResyncProgress>,
}

impl ResyncProgress {
    /// How far the copy is, 0 to 100.
    pub fn percent(&self) -> f64 {
        if self.blocks_total == 0 {
            return 100.0;
        }
        (self.blocks_copied.min(self.blocks_total) as f64) * 100.0 / self.blocks_total as f64
    }
}

/// The answering node's replica of a volume ([`ReplicationInfo::local`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalReplica {
    pub node: String,
    /// The volume's size as this node serves it (its replication takes writes up to there);
    /// behind the record's for a moment after a resize. 0 from nodes that do not say.
    #[serde(default)]
    pub size_bytes: u64,
    /// The newest epoch this node knows.
    pub epoch: u64,
    /// This node serves the volume now.
    pub serving: bool,
    /// Storage failed under this replica; it acknowledges nothing until the node restarts.
    pub failed: bool,
    pub writes_completed: u64,
    pub replicas_removed: u64,
    pub resyncs_started: u64,
    pub resyncs_completed: u64,
    /// Blocks copied to returning or new replicas.
    pub blocks_resynced: u64,
    /// Blocks pushed to reconcile replicas after a failover.
    pub blocks_pushed: u64,
    /// Host reads whose blocks failed their checksum here and were served from a replica's
    /// copy (read repair).
    #[serde(default)]
    pub reads_repaired: u64,
    /// Blocks rewritten here from a replica's copy after such a read (or after a
    /// reconciliation met them damaged here).
    #[serde(default)]
    pub blocks_repaired: u64,
    /// Host reads failed because no in-sync replica had another copy of a damaged block.
    #[serde(default)]
    pub reads_unrecovered: u64,
    /// Reads this node served, as a replica, to a primary whose copy was damaged.
    #[serde(default)]
    pub peer_reads_served: u64,
    /// Blocks the scrub found damaged here.
    #[serde(default)]
    pub damaged_found: u64,
    /// Blocks known damaged here that a write then replaced (a repair from a replica, a copy
    /// from the primary, or a host write).
    #[serde(default)]
    pub damaged_rewritten: u64,
    /// Blocks this primary sent to replicas whose copies were damaged.
    #[serde(default)]
    pub blocks_sent_for_repair: u64,
    /// Blocks a reconciliation after a failover found damaged here, as the new primary, and
    /// took from another member (written here and pushed to every member before serving).
    #[serde(default)]
    pub reconcile_blocks_repaired: u64,
    /// Reconciliations that stopped this node because no member had a good copy of a block
    /// damaged here.
    #[serde(default)]
    pub reconcile_unrecovered: u64,
    /// Writes this node refused as a replica because their blocks lay beyond its copy of the
    /// volume (its size differs from the primary's) or their length was invalid.
    #[serde(default)]
    pub entries_refused: u64,
    /// Write intents this node persisted as primary only to learn whether its own storage
    /// takes writes while a replica was late (a replica is removed as late only once it does).
    #[serde(default)]
    pub storage_probes: u64,
}

/// `GET /v1/cluster`: the cluster's nodes as the answering node sees them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterInfo {
    pub name: String,
    /// The answering node.
    pub node: String,
    /// The node running the cluster manager (failovers, rebuilds).
    pub manager: Option<String>,
    pub nodes: Vec<ClusterNode>,
    pub volumes: u64,
    /// Volumes with a replica out of sync or a member away.
    pub volumes_degraded: u64,
}

/// One node of [`ClusterInfo`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterNode {
    pub name: String,
    pub id: u32,
    /// Holds a live lease: up and reaching etcd.
    pub live: bool,
    pub replication_addr: String,
    pub nvme_addrs: Vec<String>,
    pub api_addr: String,
    /// The node's NBD server, if it runs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_addr: Option<String>,
    pub labels: std::collections::BTreeMap<String, String>,
    pub drive_count: u16,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    /// Replicas of volumes on this node.
    pub replicas: u64,
    /// Volumes this node is the primary of.
    pub primaries: u64,
}

/// [`VolumeInfo::compression`] of a node that does not report it.
fn compression_off() -> String {
    COMPRESSION_OFF.to_owned()
}

/// A data-reduction ratio a node does not report: nothing saved.
fn no_reduction() -> f64 {
    1.0
}

impl VolumeInfo {
    /// The command a Linux host runs to attach this volume with nvme-cli.
    pub fn nvme_connect_command(&self) -> String {
        format!("nvme connect -t tcp -a {} -s {} -n {}", self.nvme_host, self.nvme_port, self.nqn)
    }
}

/// `GET /v1/volumes`: every volume, sorted by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeList {
    pub volumes: Vec<VolumeInfo>,
}

/// `POST /v1/volumes/{name}/snapshots`: take a snapshot of the volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateSnapshot {
    /// The snapshot's name: the same rules as a volume name, unique among the volume's
    /// snapshots.
    pub name: String,
}

/// `POST /v1/cluster/volumes/{name}/freeze` (between cluster nodes, for a snapshot): the
/// volume's serving primary holds its host writes until every write it took completed, for at
/// most `hold_ms`, and answers a [`FreezePoint`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeVolume {
    pub hold_ms: u64,
}

/// Where a held replicated volume stands: the copies of the nodes named hold exactly what the
/// primary's holds (every completed write, none in flight), until the hold ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezePoint {
    /// Names this hold: `POST /v1/cluster/volumes/{name}/thaw` with it ends it.
    pub token: u64,
    /// The epoch the primary serves.
    pub epoch: u64,
    /// The node ids (`ClusterNode::id`) of the replicas alike the primary, the primary not
    /// included.
    pub copies: Vec<u32>,
}

/// `POST /v1/cluster/volumes/{name}/thaw`: ends the hold `token` names. Answers 204 if the
/// primary served the same epoch under the same lease, holding the writes, from the hold to
/// now; `snapshot_unavailable` otherwise (the hold lapsed or the node stopped serving).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThawVolume {
    pub token: u64,
}

/// `POST /v1/cluster/volumes/{name}/rollback` (between cluster nodes, to the volume's
/// primary): roll the volume back to snapshot `snapshot_id` by rewriting what differs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicatedRollback {
    pub snapshot_id: u64,
}

/// `PUT /v1/cluster/snapshots/{id}` (between cluster nodes): take snapshot `id` of this node's
/// copy of `volume` now, under these names; its record is written once every copy has it.
/// `DELETE /v1/cluster/snapshots/{id}`: drop this node's copy of snapshot `id`, if it has one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalSnapshot {
    pub volume: String,
    pub name: String,
    pub size_bytes: u64,
    /// The snapshot's namespace UUID, the same on every node (hosts see one namespace).
    pub uuid: [u8; 16],
    pub created_unix_ms: u64,
}

/// `GET /v1/cluster/snapshots` (between cluster nodes): the snapshots whose copy this node
/// holds, by id, ascending.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldSnapshots {
    pub ids: Vec<u64>,
}

/// `PUT /v1/cluster/clones/{id}` (between cluster nodes): make volume `id` on this node a
/// writable clone of this node's copy of snapshot `snapshot_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalClone {
    pub snapshot_id: u64,
}

/// A snapshot, as returned by every snapshot endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub name: String,
    /// The volume the snapshot was taken of.
    pub volume: String,
    /// Unique among volumes and snapshots, never reused.
    pub id: u64,
    /// The volume's size when the snapshot was taken.
    pub size_bytes: u64,
    pub created_unix_ms: u64,
    /// Bytes of blocks held by this snapshot alone: what deleting it frees (through GC).
    pub exclusive_bytes: u64,
    /// The read-only NVMe subsystem that serves the snapshot to its volume's hosts. Absent from
    /// older nodes and from a deletion's answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nqn: Option<String>,
    /// The snapshot's read-only NBD export, `nbd://HOST:PORT/VOLUME@SNAPSHOT`, when the
    /// answering node serves NBD and the volume is open to every host. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_uri: Option<String>,
    /// On a cluster: the live nodes holding a copy of the snapshot (each serves it), as they
    /// answered when this answer was made. A copy lives on the replicas in sync when the
    /// snapshot was taken. Absent on a single node and from a deletion's answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holders: Option<Vec<String>>,
}

/// `GET /v1/volumes/{name}/snapshots`: the volume's snapshots, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotList {
    pub snapshots: Vec<SnapshotInfo>,
}

/// `POST /v1/volumes/{name}/rollback`: make the volume's contents those of one of its
/// snapshots. Answers the volume's [`VolumeInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackVolume {
    /// The snapshot's name (of this volume, so no `VOLUME@`).
    pub snapshot: String,
}

/// Whether a volume admits any host or only its allowed hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccessMode {
    /// Any host may connect and sees the volume in discovery. Every volume starts open.
    #[default]
    Open,
    /// Only the allowed hosts may connect and see the volume; with none allowed, no host may.
    Restricted,
}

impl AccessMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AccessMode::Open => "open",
            AccessMode::Restricted => "restricted",
        }
    }
}

/// `GET /v1/volumes/{name}/hosts`, and the answer of `PUT` and `DELETE` on
/// `/v1/volumes/{name}/hosts/{host}`: who may connect to a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostAccess {
    pub volume: String,
    /// The volume's subsystem NQN, the one hosts connect to.
    pub nqn: String,
    pub access: AccessMode,
    /// The allowed host NQNs, sorted; always empty when `access` is `open`.
    pub hosts: Vec<String>,
}

/// A volume's Asymmetric Namespace Access state through one NVMe port, as hosts see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AnaState {
    /// The preferred path: hosts send I/O here.
    Optimized,
    /// Served, but hosts prefer an optimized path when there is one.
    NonOptimized,
    /// Not served: I/O fails with a path error and hosts move to another path.
    Inaccessible,
    /// Gone for good (set by the cluster, never by hand).
    PersistentLoss,
    /// Changing (set by the cluster during a failover, never by hand).
    Change,
}

impl AnaState {
    /// The states an operator may set by hand.
    pub const SETTABLE: [AnaState; 3] =
        [AnaState::Optimized, AnaState::NonOptimized, AnaState::Inaccessible];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Optimized => "optimized",
            Self::NonOptimized => "non-optimized",
            Self::Inaccessible => "inaccessible",
            Self::PersistentLoss => "persistent-loss",
            Self::Change => "change",
        }
    }
}

/// One NVMe/TCP path to a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumePath {
    /// The NVMe port ID (the listen address's place in `ferrite up --nvme-listen`, from 1).
    pub port_id: u16,
    /// `HOST:PORT` hosts connect to.
    pub address: String,
    pub ana_state: AnaState,
}

/// `GET /v1/volumes/{name}/paths` and the answer of `PUT /v1/volumes/{name}/paths/{port}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumePaths {
    pub volume: String,
    /// The volume's subsystem NQN, the same on every path.
    pub nqn: String,
    pub paths: Vec<VolumePath>,
}

/// `PUT /v1/volumes/{name}/paths/{port}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetPathState {
    /// One of [`AnaState::SETTABLE`].
    pub ana_state: AnaState,
}

/// Space on the node's drives.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// The unit in which drive space is given to volumes; 0 for thin volumes.
    pub chunk_size_bytes: u64,
    /// The sum of the volumes' sizes; volumes are thin, so it may exceed `total_bytes`.
    #[serde(default)]
    pub provisioned_bytes: u64,
    /// Bytes of volume blocks written and not deallocated.
    #[serde(default)]
    pub mapped_bytes: u64,
    /// Drive space in use: live data, garbage not yet collected, checkpoints.
    #[serde(default)]
    pub physical_used_bytes: u64,
    /// Device bytes written per host byte written (0 before any write).
    #[serde(default)]
    pub write_amplification: f64,
    /// Blocks that failed their checksum when read since the node started.
    #[serde(default)]
    pub checksum_errors: u64,
    /// Drive space the mapped blocks take: less than `mapped_bytes` when compressed.
    #[serde(default)]
    pub mapped_physical_bytes: u64,
    /// `mapped_bytes / mapped_physical_bytes`, node-wide: 1.0 when compression saves nothing
    /// (or nothing is mapped). Absent from older nodes.
    #[serde(default = "no_reduction")]
    pub data_reduction: f64,
}

/// `GET /v1/node`: the node and its capacity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub node_uuid: String,
    /// The version of the `ferrite` build serving the API.
    pub version: String,
    pub drive_count: u16,
    pub drive_size_bytes: u64,
    /// What holds the drives' bytes: "file" (durable) or "memory" (NOT DURABLE: everything is
    /// lost when the node stops). Nodes that predate the field have file drives.
    #[serde(default = "file_drive_backend")]
    pub drive_backend: String,
    pub created_unix_ms: u64,
    pub nvme_host: String,
    pub nvme_port: u16,
    /// Whether the node serves volumes over NVMe/TCP (false while no data path is attached).
    pub nvme_serving: bool,
    pub volume_count: u64,
    /// The metadata store's revision: it changes whenever any metadata changes.
    pub meta_revision: u64,
    pub capacity: Capacity,
    /// Every drive, in index order, with its state. Nodes that predate the field report none.
    #[serde(default)]
    pub drives: Vec<DriveInfo>,
    /// The background scrub. Absent from nodes older than scrub.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scrub: Option<ScrubInfo>,
    /// Erasure coding across the drives, degraded reads and drive rebuilds. Absent from nodes
    /// older than erasure coding (whose drives hold no parity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub erasure: Option<ErasureInfo>,
}

/// A node's erasure coding, in [`NodeInfo::erasure`]: each stripe of `data_shards` blocks gets
/// `parity_shards` parity blocks, each on its own drive, so the node keeps serving every block
/// with up to `parity_shards` drives lost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErasureInfo {
    /// `k+m`, such as "4+1"; "1+0" for a node without parity (`ferrite up --erasure-coding
    /// none`, or one drive).
    pub scheme: String,
    pub data_shards: u8,
    pub parity_shards: u8,
    /// What the scheme survives, in a sentence.
    pub protection: String,
    /// Reads whose data was rebuilt from the other drives because its drive had failed or
    /// could not be read, since the node started.
    pub reconstructed_reads: u64,
    /// Reads of a block that failed its checksum and was rebuilt intact from parity.
    pub repaired_reads: u64,
    /// Reads that could not be served: their stripe lost more than `parity_shards` cells.
    pub unrecoverable_reads: u64,
    /// The most a rebuild writes per second, in MiB (`ferrite up --rebuild-mb-per-s`; 0: no
    /// limit).
    pub rebuild_mb_per_s: u64,
    /// The most a rebuild writes per second while hosts keep the node busy, in MiB: it yields
    /// to host I/O (0: no limit; absent from nodes before it did).
    #[serde(default)]
    pub rebuild_busy_mb_per_s: u64,
    /// The rebuild in progress, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<RebuildInfo>,
    /// How the last rebuild of this node's run ended, if one ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rebuild: Option<RebuildOutcome>,
}

/// A drive rebuild in progress, in [`ErasureInfo::rebuild`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RebuildInfo {
    /// The drive being rebuilt.
    pub drive: u16,
    /// Log segments examined (restored, or found to need nothing) of the node's total.
    pub segments_done: u32,
    pub segments_total: u32,
    /// `segments_done` in percent of `segments_total`.
    pub percent: f64,
    /// Bytes written to the new drive so far.
    pub bytes_written: u64,
    pub elapsed_seconds: f64,
    /// The average write rate so far, in bytes per second.
    pub bytes_per_second: u64,
    /// A rough estimate of the seconds left, from the segments still to examine; absent until
    /// one was examined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<u64>,
    /// Why the rebuild's last step failed (another drive could not be read); it retries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stalled: Option<String>,
    /// Whether it writes at [`ErasureInfo::rebuild_busy_mb_per_s`] now, hosts keeping the node
    /// busy.
    #[serde(default)]
    pub slowed_for_hosts: bool,
}

/// How a drive rebuild ended, in [`ErasureInfo::last_rebuild`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RebuildOutcome {
    pub drive: u16,
    /// True if the drive is whole again; false if the rebuild failed (see `error`).
    pub finished: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub bytes_written: u64,
    pub seconds: f64,
}

/// `POST /v1/drives/{index}/replace`: the new drive. Drive files and memory drives get a new
/// file made by the node (leave `path` out); a node on block devices or files given with
/// `ferrite up --drive` needs the new device's path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplaceDrive {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// The background scrub of a node, in [`NodeInfo::scrub`]: it reads every live block back and
/// checks it against its checksum, paced (`ferrite up --scrub-mb-per-s`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScrubInfo {
    /// One of [`SCRUB_STATE_RUNNING`], [`SCRUB_STATE_WAITING`], [`SCRUB_STATE_PAUSED`],
    /// [`SCRUB_STATE_OFF`].
    pub state: String,
    /// The most the scrub reads per second, in MiB (0: off).
    pub rate_mb_per_s: u64,
    /// The most it reads per second while hosts keep the node busy, in MiB: it yields to host
    /// I/O (0: off; absent from nodes before it did).
    #[serde(default)]
    pub busy_rate_mb_per_s: u64,
    /// Whether it reads at `busy_rate_mb_per_s` now, hosts keeping the node busy.
    #[serde(default)]
    pub slowed_for_hosts: bool,
    /// Full passes over the node's data since the node started.
    pub passes_completed: u64,
    /// Blocks read back and found intact since the node started.
    pub blocks_verified: u64,
    /// Damage found since the node started (a damaged block counts again in each pass that
    /// finds it).
    pub errors: u64,
    /// How far the current pass is, 0 to 100.
    pub pass_progress_percent: f64,
    /// The most recent damage found, oldest first (a bounded list; `errors` has the total).
    pub findings: Vec<ScrubFindingInfo>,
}

/// [`ScrubInfo::state`]: a pass is under way.
pub const SCRUB_STATE_RUNNING: &str = "running";
/// [`ScrubInfo::state`]: a pass completed; the next starts when the minimum interval between
/// passes is over.
pub const SCRUB_STATE_WAITING: &str = "waiting";
/// [`ScrubInfo::state`]: a drive is latched failed; the scrub waits for its replacement or the
/// node's restart.
pub const SCRUB_STATE_PAUSED: &str = "paused";
/// [`ScrubInfo::state`]: the node runs no scrub (`--scrub-mb-per-s 0`).
pub const SCRUB_STATE_OFF: &str = "off";

/// One piece of damage the scrub found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubFindingInfo {
    /// [`SCRUB_DAMAGE_BLOCK`], [`SCRUB_DAMAGE_HEADER`], [`SCRUB_DAMAGE_HEADER_CHAIN`] or
    /// [`SCRUB_DAMAGE_PARITY`].
    pub kind: String,
    /// For a damaged block: the volume whose own layer holds it (the volume, or its snapshots
    /// taken since, read it). Absent when the block belongs to a layer made by a snapshot or a
    /// clone; `layer` then says which.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
    /// For a damaged block: the engine's label of the layer that holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u64>,
    /// For a damaged block: its number (in 4 KiB blocks) in that layer's volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<u64>,
    /// For a damaged header, header chain or parity: the log segment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment: Option<u32>,
    /// The drive holding the damage.
    pub drive: u16,
    /// The log location of the damage.
    pub location: u32,
    /// The scrub pass that found it, from 1.
    pub pass: u64,
    /// Whether it was repaired: rebuilt from parity and rewritten (erasure-coded nodes), or, for
    /// a block of a replicated volume, replaced from another replica's copy.
    pub repaired: bool,
}

/// [`ScrubFindingInfo::kind`]: a block failed its checksum; reads of it fail with an error.
pub const SCRUB_DAMAGE_BLOCK: &str = "block";
/// [`ScrubFindingInfo::kind`]: a segment's chain of batch headers is broken, so garbage
/// collection and recovery cannot reach some of its blocks (which may still read fine).
pub const SCRUB_DAMAGE_HEADER_CHAIN: &str = "header_chain";
/// [`ScrubFindingInfo::kind`] (erasure-coded nodes): a batch header did not decode and was
/// rebuilt from parity, so garbage collection and recovery still reach the blocks after it.
pub const SCRUB_DAMAGE_HEADER: &str = "header";
/// `ScrubFindingInfo.kind` of a stripe whose parity did not match its data (erasure-coded nodes).
pub const SCRUB_DAMAGE_PARITY: &str = "parity";

/// One drive of a node, in [`NodeInfo::drives`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriveInfo {
    pub index: u16,
    /// The drive file, or the block device or file given with `ferrite up --drive`; empty for
    /// a drive none of the `--drive` paths held when the node started (a node with parity
    /// starts without up to its parity count of drives; such a drive is failed until replaced).
    pub path: String,
    /// The bytes of the drive the node uses.
    pub size_bytes: u64,
    /// [`DRIVE_STATE_OK`], [`DRIVE_STATE_FAILED`] or [`DRIVE_STATE_REBUILDING`].
    pub state: String,
    /// For a drive being rebuilt: how far, in whole percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild_percent: Option<u8>,
}

/// [`DriveInfo::state`] of a drive in service.
pub const DRIVE_STATE_OK: &str = "ok";
/// [`DriveInfo::state`] of a drive latched failed after a failed write, sync or punch (or whose
/// superblock could not be read at start): no I/O reaches it until it is replaced. On a node
/// with erasure coding `k+m`, up to `m` failed drives change nothing for hosts (reads of their
/// blocks are rebuilt from parity); without parity every write to the node fails (its batches
/// span the drives) and reads of blocks stored on it fail, while reads of blocks on other
/// drives still work.
pub const DRIVE_STATE_FAILED: &str = "failed";
/// [`DriveInfo::state`] of a new drive (`ferrite drive replace`) whose contents are being
/// rebuilt from the other drives: new writes already go to it, and until the rebuild finishes
/// the node's redundancy is not yet whole.
pub const DRIVE_STATE_REBUILDING: &str = "rebuilding";

/// [`NodeInfo::drive_backend`] of a node that does not report it.
fn file_drive_backend() -> String {
    "file".to_owned()
}

/// The body of every error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What happened, to what, and what to do; shown to users as is.
    pub error: String,
    /// A stable [`ErrorCode`] string for scripts.
    pub code: String,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, error: impl Into<String>) -> Self {
        Self { error: error.into(), code: code.as_str().to_owned() }
    }
}

/// The stable error codes of the API, with the HTTP status each is sent with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// 409: a volume with this name exists.
    VolumeExists,
    /// 404: no volume has this name.
    VolumeNotFound,
    /// 400: the size is not a multiple of 4 KiB between 1 MiB and 1 PiB.
    InvalidSize,
    /// 400: the name is not a valid volume name.
    InvalidName,
    /// 507: the drives have no room for the request.
    NoSpace,
    /// 409: a resize asked for a smaller size; volumes only grow.
    ShrinkRefused,
    /// 400: the body is not the JSON the endpoint expects.
    InvalidRequest,
    /// 413: the body is larger than the server accepts.
    RequestTooLarge,
    /// 404: no such endpoint.
    NotFound,
    /// 405: the endpoint does not take this method.
    MethodNotAllowed,
    /// 503: too many requests in flight; retry.
    Busy,
    /// 500: the node failed; the message says how.
    Internal,
    /// 400: the host is neither a valid NQN nor `any`.
    InvalidNqn,
    /// 409: a host cannot be denied on its own while the volume is open to any host.
    HostAccessOpen,
    /// 409: the volume's allowed-hosts list is full.
    TooManyHosts,
    /// 404: the volume has no snapshot of this name.
    SnapshotNotFound,
    /// 409: the volume already has a snapshot of this name.
    SnapshotExists,
    /// 409: the volume has as many snapshots, or its clone chain is as deep, as allowed.
    SnapshotLimit,
    /// 409: the operation is refused while hosts are connected to the volume (a rollback,
    /// say); disconnect them first.
    VolumeBusy,
    /// 404: the node has no drive of this index.
    DriveNotFound,
    /// 409: the drive cannot be replaced now (no parity, another rebuild running, too many
    /// drives failed); the message says why.
    ReplaceRefused,
    /// 400: the new drive given is unusable (missing, mounted or in use, too small, another
    /// node's or one of this node's drives), or a path was given where none is taken.
    InvalidDrive,
    /// 503: the cluster cannot place the volume's replicas now (too few live nodes).
    PlacementFailed,
    /// 409: the operation is not available here (a cluster node does not do it, or a single
    /// node cannot); the message says what instead.
    NotSupported,
    /// 503: a replicated volume's record has its new size, but a node holding a replica has
    /// not grown yet (the message names it); the same resize again waits once more.
    ResizePending,
    /// 503: a snapshot of a replicated volume could not be taken on its copies now (the
    /// primary changed or a replica did not answer while the volume's writes were held; the
    /// message says which); nothing was kept, and taking it again may succeed.
    SnapshotUnavailable,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 26] = [
        Self::VolumeExists,
        Self::VolumeNotFound,
        Self::InvalidSize,
        Self::InvalidName,
        Self::NoSpace,
        Self::ShrinkRefused,
        Self::InvalidRequest,
        Self::RequestTooLarge,
        Self::NotFound,
        Self::MethodNotAllowed,
        Self::Busy,
        Self::Internal,
        Self::InvalidNqn,
        Self::HostAccessOpen,
        Self::TooManyHosts,
        Self::SnapshotNotFound,
        Self::SnapshotExists,
        Self::SnapshotLimit,
        Self::VolumeBusy,
        Self::DriveNotFound,
        Self::ReplaceRefused,
        Self::InvalidDrive,
        Self::PlacementFailed,
        Self::NotSupported,
        Self::ResizePending,
        Self::SnapshotUnavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::VolumeExists => "volume_exists",
            Self::VolumeNotFound => "volume_not_found",
            Self::InvalidSize => "invalid_size",
            Self::InvalidName => "invalid_name",
            Self::NoSpace => "no_space",
            Self::ShrinkRefused => "shrink_refused",
            Self::InvalidRequest => "invalid_request",
            Self::RequestTooLarge => "request_too_large",
            Self::NotFound => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::Busy => "busy",
            Self::Internal => "internal",
            Self::InvalidNqn => "invalid_nqn",
            Self::HostAccessOpen => "host_access_open",
            Self::TooManyHosts => "too_many_hosts",
            Self::SnapshotNotFound => "snapshot_not_found",
            Self::SnapshotExists => "snapshot_exists",
            Self::SnapshotLimit => "snapshot_limit",
            Self::VolumeBusy => "volume_busy",
            Self::DriveNotFound => "drive_not_found",
            Self::ReplaceRefused => "replace_refused",
            Self::InvalidDrive => "invalid_drive",
            Self::PlacementFailed => "placement_failed",
            Self::NotSupported => "not_supported",
            Self::ResizePending => "resize_pending",
            Self::SnapshotUnavailable => "snapshot_unavailable",
        }
    }

    pub fn http_status(self) -> u16 {
        match self {
            Self::VolumeExists
            | Self::ShrinkRefused
            | Self::HostAccessOpen
            | Self::TooManyHosts
            | Self::SnapshotExists
            | Self::SnapshotLimit
            | Self::VolumeBusy
            | Self::ReplaceRefused
            | Self::NotSupported => 409,
            Self::VolumeNotFound
            | Self::NotFound
            | Self::SnapshotNotFound
            | Self::DriveNotFound => 404,
            Self::InvalidSize
            | Self::InvalidName
            | Self::InvalidRequest
            | Self::InvalidNqn
            | Self::InvalidDrive => 400,
            Self::NoSpace => 507,
            Self::RequestTooLarge => 413,
            Self::MethodNotAllowed => 405,
            Self::Busy
            | Self::PlacementFailed
            | Self::ResizePending
            | Self::SnapshotUnavailable => 503,
            Self::Internal => 500,
        }
    }

    pub fn parse(code: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|known| known.as_str() == code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_are_stable_and_distinct() {
        let codes: Vec<&str> = ErrorCode::ALL.iter().map(|code| code.as_str()).collect();
        assert_eq!(
            codes,
            [
                "volume_exists",
                "volume_not_found",
                "invalid_size",
                "invalid_name",
                "no_space",
                "shrink_refused",
                "invalid_request",
                "request_too_large",
                "not_found",
                "method_not_allowed",
                "busy",
                "internal",
                "invalid_nqn",
                "host_access_open",
                "too_many_hosts",
                "snapshot_not_found",
                "snapshot_exists",
                "snapshot_limit",
                "volume_busy",
                "drive_not_found",
                "replace_refused",
                "invalid_drive",
                "placement_failed",
                "not_supported",
                "resize_pending",
                "snapshot_unavailable"
            ]
        );
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
            assert!((400..600).contains(&code.http_status()));
        }
        assert_eq!(ErrorCode::parse("nope"), None);
    }

    #[test]
    fn connect_command() {
        let info = VolumeInfo {
            name: "db".to_owned(),
            id: 1,
            size_bytes: 1 << 30,
            nqn: "nqn.2024-01.io.ferrite:vol:db".to_owned(),
            uuid: "00000000-0000-4000-8000-000000000000".to_owned(),
            created_unix_ms: 0,
            nvme_host: "127.0.0.1".to_owned(),
            nvme_port: 4420,
            access: AccessMode::Restricted,
            mapped_bytes: Some(8192),
            physical_used_bytes: None,
            origin: None,
            snapshot_count: 0,
            compression: COMPRESSION_ZSTD.to_owned(),
            data_reduction: 2.5,
            replication: None,
            nbd_uri: None,
        };
        assert_eq!(
            info.nvme_connect_command(),
            "nvme connect -t tcp -a 127.0.0.1 -s 4420 -n nqn.2024-01.io.ferrite:vol:db"
        );
        let mut json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["size_bytes"], 1u64 << 30);
        assert_eq!(json["access"], "restricted");
        assert_eq!(serde_json::from_value::<VolumeInfo>(json.clone()).unwrap(), info);
        // A node older than host access control sends no `access`: its volumes are open.
        json.as_object_mut().unwrap().remove("access");
        let old = serde_json::from_value::<VolumeInfo>(json).unwrap();
        assert_eq!(old.access, AccessMode::Open);
    }

    #[test]
    fn volume_info_snapshot_fields() {
        let json = serde_json::json!({
            "name": "copy", "id": 9, "size_bytes": 1u64 << 20,
            "nqn": "nqn.2024-01.io.ferrite:vol:copy",
            "uuid": "00000000-0000-4000-8000-000000000000", "created_unix_ms": 5,
            "nvme_host": "127.0.0.1", "nvme_port": 4420,
        });
        // A node older than snapshots sends neither field.
        let old: VolumeInfo = serde_json::from_value(json.clone()).unwrap();
        assert_eq!((old.origin.as_deref(), old.snapshot_count), (None, 0));
        // Nor compression: its volumes are stored raw.
        assert_eq!((old.compression.as_str(), old.data_reduction), (COMPRESSION_OFF, 1.0));
        let out = serde_json::to_value(&old).unwrap();
        assert!(out.get("origin").is_none(), "no origin is not sent: {out}");
        assert_eq!(out["snapshot_count"], 0);

        let clone =
            VolumeInfo { origin: Some(snapshot_ref("db", "nightly")), snapshot_count: 3, ..old };
        let out = serde_json::to_value(&clone).unwrap();
        assert_eq!(out["origin"], "db@nightly");
        assert_eq!(out["snapshot_count"], 3);
        assert_eq!(serde_json::from_value::<VolumeInfo>(out).unwrap(), clone);
    }

    #[test]
    fn create_volume_json() {
        // Exactly what older clients send.
        let old: CreateVolume =
            serde_json::from_str(r#"{"name":"db","size_bytes":1048576}"#).unwrap();
        assert_eq!(old, CreateVolume::empty("db", 1 << 20));
        assert_eq!(
            serde_json::to_value(&old).unwrap(),
            serde_json::json!({"name": "db", "size_bytes": 1048576}),
            "an empty volume's request is what older nodes accept"
        );

        let clone = CreateVolume::clone_of_snapshot("copy", "db", "nightly");
        let json = serde_json::to_value(&clone).unwrap();
        assert_eq!(json, serde_json::json!({"name": "copy", "from_snapshot": "db@nightly"}));
        assert_eq!(serde_json::from_value::<CreateVolume>(json).unwrap(), clone);
        let sized: CreateVolume = serde_json::from_str(
            r#"{"name":"copy","size_bytes":2097152,"from_snapshot":"db@nightly"}"#,
        )
        .unwrap();
        assert_eq!(sized.size_bytes, Some(2 << 20));
        assert_eq!(sized.from_snapshot.as_deref(), Some("db@nightly"));
        let neither: CreateVolume = serde_json::from_str(r#"{"name":"db"}"#).unwrap();
        assert_eq!((neither.size_bytes, neither.from_snapshot), (None, None));
        assert_eq!(neither.compression, None, "absent: the node's default");

        let zstd = CreateVolume::empty("db", 1 << 20).with_compression(COMPRESSION_ZSTD);
        let json = serde_json::to_value(&zstd).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"name": "db", "size_bytes": 1048576, "compression": "zstd"})
        );
        assert_eq!(serde_json::from_value::<CreateVolume>(json).unwrap(), zstd);
        assert_eq!(COMPRESSIONS[0], COMPRESSION_LZ4, "the default is listed first");

        let set: SetCompression = serde_json::from_str(r#"{"compression":"off"}"#).unwrap();
        assert_eq!(set.compression, COMPRESSION_OFF);
        assert!(serde_json::from_str::<SetCompression>("{}").is_err());
        assert!(serde_json::from_str::<SetCompression>(r#"{"compression":"off","x":1}"#).is_err());
    }

    #[test]
    fn node_info_reduction_and_scrub() {
        let capacity = Capacity {
            total_bytes: 1 << 30,
            free_bytes: 1 << 29,
            chunk_size_bytes: 0,
            provisioned_bytes: 0,
            mapped_bytes: 8192,
            physical_used_bytes: 1 << 20,
            write_amplification: 1.0,
            checksum_errors: 0,
            mapped_physical_bytes: 2048,
            data_reduction: 4.0,
        };
        let mut json = serde_json::to_value(capacity).unwrap();
        assert_eq!(json["data_reduction"], 4.0);
        // An older node sends neither: nothing is compressed.
        json.as_object_mut().unwrap().remove("data_reduction");
        json.as_object_mut().unwrap().remove("mapped_physical_bytes");
        let old: Capacity = serde_json::from_value(json).unwrap();
        assert_eq!((old.mapped_physical_bytes, old.data_reduction), (0, 1.0));

        let scrub = ScrubInfo {
            state: SCRUB_STATE_RUNNING.to_owned(),
            rate_mb_per_s: 32,
            busy_rate_mb_per_s: 2,
            slowed_for_hosts: true,
            passes_completed: 2,
            blocks_verified: 1000,
            errors: 1,
            pass_progress_percent: 12.5,
            findings: vec![ScrubFindingInfo {
                kind: SCRUB_DAMAGE_BLOCK.to_owned(),
                volume: Some("db".to_owned()),
                layer: Some(7),
                block: Some(42),
                segment: None,
                drive: 1,
                location: 9000,
                pass: 2,
                repaired: false,
            }],
        };
        let json = serde_json::to_value(&scrub).unwrap();
        assert!(json["findings"][0].get("segment").is_none(), "{json}");
        assert_eq!(json["findings"][0]["volume"], "db");
        assert_eq!(serde_json::from_value::<ScrubInfo>(json.clone()).unwrap(), scrub);
        // An older node sends neither busy field: a scrub that never slowed down.
        let mut old = json;
        old.as_object_mut().unwrap().remove("busy_rate_mb_per_s");
        old.as_object_mut().unwrap().remove("slowed_for_hosts");
        let old: ScrubInfo = serde_json::from_value(old).unwrap();
        assert_eq!((old.busy_rate_mb_per_s, old.slowed_for_hosts), (0, false));
    }

    #[test]
    fn erasure_and_replace_json() {
        let erasure = ErasureInfo {
            scheme: "2+1".to_owned(),
            data_shards: 2,
            parity_shards: 1,
            protection: "each stripe survives the loss of 1 drive".to_owned(),
            reconstructed_reads: 5,
            repaired_reads: 1,
            unrecoverable_reads: 0,
            rebuild_mb_per_s: 256,
            rebuild_busy_mb_per_s: 64,
            rebuild: Some(RebuildInfo {
                drive: 1,
                segments_done: 10,
                segments_total: 40,
                percent: 25.0,
                bytes_written: 1 << 20,
                elapsed_seconds: 0.5,
                bytes_per_second: 2 << 20,
                eta_seconds: None,
                stalled: None,
                slowed_for_hosts: true,
            }),
            last_rebuild: None,
        };
        let json = serde_json::to_value(&erasure).unwrap();
        assert!(json.get("last_rebuild").is_none(), "{json}");
        assert!(json["rebuild"].get("eta_seconds").is_none(), "{json}");
        assert_eq!(serde_json::from_value::<ErasureInfo>(json.clone()).unwrap(), erasure);
        // An older node sends neither busy field: a rebuild that never slowed down.
        let mut old = json;
        old.as_object_mut().unwrap().remove("rebuild_busy_mb_per_s");
        old["rebuild"].as_object_mut().unwrap().remove("slowed_for_hosts");
        let old: ErasureInfo = serde_json::from_value(old).unwrap();
        let slowed = old.rebuild.map(|rebuild| rebuild.slowed_for_hosts);
        assert_eq!((old.rebuild_busy_mb_per_s, slowed), (0, Some(false)));

        let drive: DriveInfo =
            serde_json::from_str(r#"{"index":1,"path":"/d","size_bytes":4096,"state":"failed"}"#)
                .unwrap();
        assert_eq!(drive.rebuild_percent, None, "older nodes send no rebuild_percent");
        assert!(serde_json::to_value(&drive).unwrap().get("rebuild_percent").is_none());

        assert_eq!(serde_json::to_string(&ReplaceDrive::default()).unwrap(), "{}");
        let with_path: ReplaceDrive = serde_json::from_str(r#"{"path":"/dev/sdc"}"#).unwrap();
        assert_eq!(with_path.path.as_deref(), Some("/dev/sdc"));
        assert!(serde_json::from_str::<ReplaceDrive>(r#"{"device":"/dev/sdc"}"#).is_err());
        assert_eq!(ErrorCode::DriveNotFound.http_status(), 404);
        assert_eq!(ErrorCode::ReplaceRefused.http_status(), 409);
        assert_eq!(ErrorCode::InvalidDrive.http_status(), 400);
    }

    #[test]
    fn snapshot_refs() {
        let check = |text: &str, expect: Option<(&str, &str)>| {
            assert_eq!(parse_snapshot_ref(text), expect, "{text:?}");
        };
        check("db@nightly", Some(("db", "nightly")));
        check(&snapshot_ref("db-1", "s_2"), Some(("db-1", "s_2")));
        check("db", None);
        check("@nightly", None);
        check("db@", None);
        check("db@a@b", None);
        check("", None);
    }

    #[test]
    fn snapshot_json() {
        let info = SnapshotInfo {
            name: "nightly".to_owned(),
            volume: "db".to_owned(),
            id: 12,
            size_bytes: 1 << 30,
            created_unix_ms: 1_700_000_000_000,
            exclusive_bytes: 8192,
            nqn: None,
            nbd_uri: None,
            holders: None,
        };
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "name": "nightly", "volume": "db", "id": 12, "size_bytes": 1u64 << 30,
                "created_unix_ms": 1_700_000_000_000u64, "exclusive_bytes": 8192,
            })
        );
        assert_eq!(serde_json::from_value::<SnapshotInfo>(json).unwrap(), info);
        let served = SnapshotInfo {
            nqn: Some("nqn.2024-01.io.ferrite:snap:db:nightly".to_owned()),
            nbd_uri: Some("nbd://127.0.0.1:10809/db@nightly".to_owned()),
            holders: Some(vec!["node-a".to_owned(), "node-c".to_owned()]),
            ..info.clone()
        };
        let json = serde_json::to_value(&served).unwrap();
        assert_eq!(json["nbd_uri"], "nbd://127.0.0.1:10809/db@nightly");
        assert_eq!(json["holders"], serde_json::json!(["node-a", "node-c"]));
        assert_eq!(serde_json::from_value::<SnapshotInfo>(json).unwrap(), served);
        let list = SnapshotList { snapshots: vec![info] };
        let text = serde_json::to_string(&list).unwrap();
        assert_eq!(serde_json::from_str::<SnapshotList>(&text).unwrap(), list);

        let create: CreateSnapshot = serde_json::from_str(r#"{"name":"s1"}"#).unwrap();
        assert_eq!(create, CreateSnapshot { name: "s1".to_owned() });
        let rollback = RollbackVolume { snapshot: "s1".to_owned() };
        assert_eq!(serde_json::to_string(&rollback).unwrap(), r#"{"snapshot":"s1"}"#);
        assert!(serde_json::from_str::<RollbackVolume>("{}").is_err());
        assert!(serde_json::from_str::<CreateSnapshot>("{}").is_err());
    }

    #[test]
    fn snapshot_error_statuses() {
        assert_eq!(ErrorCode::SnapshotNotFound.http_status(), 404);
        for code in [ErrorCode::SnapshotExists, ErrorCode::SnapshotLimit, ErrorCode::VolumeBusy] {
            assert_eq!(code.http_status(), 409, "{code:?}");
        }
    }

    #[test]
    fn host_access_json() {
        let access = HostAccess {
            volume: "db".to_owned(),
            nqn: "nqn.2024-01.io.ferrite:vol:db".to_owned(),
            access: AccessMode::Open,
            hosts: vec![],
        };
        let json = serde_json::to_value(&access).unwrap();
        assert_eq!(json["access"], "open");
        assert_eq!(serde_json::from_value::<HostAccess>(json).unwrap(), access);
        let restricted: HostAccess = serde_json::from_str(
            r#"{"volume":"db","nqn":"n","access":"restricted","hosts":["nqn.h:1"]}"#,
        )
        .unwrap();
        assert_eq!(restricted.access, AccessMode::Restricted);
        assert_eq!(AccessMode::Restricted.as_str(), "restricted");
        assert!(serde_json::from_str::<AccessMode>(r#""closed""#).is_err());
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let body: ErrorBody =
            serde_json::from_str(r#"{"error":"x","code":"internal","added_later":1}"#).unwrap();
        assert_eq!(body, ErrorBody::new(ErrorCode::Internal, "x"));
    }
}
