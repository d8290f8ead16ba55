//! The Ferrite REST API: its paths, its request and response bodies, and a blocking client.
//!
//! This is the only crate that defines what goes over HTTP. The node's server (`node::http`)
//! answers with these types; the CLI, tests and later the CSI driver call it through [`Client`].
//! Keeping both sides on one set of types means they cannot drift apart.
//!
//! Errors travel as [`ErrorBody`] with a stable [`ErrorCode`] string that scripts may match on;
//! the `error` text is for humans and may change.

mod client;
mod format;
mod wire;

pub use client::{Client, ClientError, REQUEST_TIMEOUT_MS, RESPONSE_SIZE_BYTES_MAX};
pub use format::{format_uuid, rfc3339_utc};
pub use wire::*;

/// The paths the node serves. `{name}` is a volume name, `{snapshot}` a snapshot name (of that
/// volume) and `{host}` a host NQN or [`ANY_HOST`](crate::ANY_HOST), each percent-encoded as one
/// path segment (NQNs hold `:`).
pub mod paths {
    pub const VOLUMES: &str = "/v1/volumes";
    pub const VOLUME: &str = "/v1/volumes/{name}";
    pub const VOLUME_RESIZE: &str = "/v1/volumes/{name}/resize";
    /// `GET`: the volume's [`HostAccess`](crate::HostAccess).
    pub const VOLUME_HOSTS: &str = "/v1/volumes/{name}/hosts";
    /// `PUT`: allow the host; `DELETE`: deny it. Both answer the new
    /// [`HostAccess`](crate::HostAccess).
    pub const VOLUME_HOST: &str = "/v1/volumes/{name}/hosts/{host}";
    /// `GET`: the volume's [`VolumePaths`](crate::VolumePaths), one per NVMe/TCP port.
    pub const VOLUME_PATHS: &str = "/v1/volumes/{name}/paths";
    /// `PUT` with a [`SetPathState`](crate::SetPathState): sets the volume's ANA state through
    /// NVMe port `{port}` (its ID); answers the new [`VolumePaths`](crate::VolumePaths).
    pub const VOLUME_PATH: &str = "/v1/volumes/{name}/paths/{port}";
    /// `GET`: the volume's [`SnapshotList`](crate::SnapshotList), oldest first; `POST` with a
    /// [`CreateSnapshot`](crate::CreateSnapshot): takes a snapshot, answers its
    /// [`SnapshotInfo`](crate::SnapshotInfo).
    pub const VOLUME_SNAPSHOTS: &str = "/v1/volumes/{name}/snapshots";
    /// `GET`: the snapshot's [`SnapshotInfo`](crate::SnapshotInfo); `DELETE`: deletes it and
    /// answers what it was.
    pub const VOLUME_SNAPSHOT: &str = "/v1/volumes/{name}/snapshots/{snapshot}";
    /// `PUT` with a [`SetCompression`](crate::SetCompression): how the volume's new writes are
    /// stored; answers the volume's [`VolumeInfo`](crate::VolumeInfo).
    pub const VOLUME_COMPRESSION: &str = "/v1/volumes/{name}/compression";
    /// `POST` with a [`RollbackVolume`](crate::RollbackVolume): rolls the volume back to one
    /// of its snapshots; answers the volume's [`VolumeInfo`](crate::VolumeInfo).
    pub const VOLUME_ROLLBACK: &str = "/v1/volumes/{name}/rollback";
    /// `GET` (cluster nodes): the [`ResyncList`](crate::ResyncList) of the copies this node
    /// makes as the volume's primary, without asking any other node (`volume show` on another
    /// node asks the primary here).
    pub const VOLUME_RESYNC: &str = "/v1/volumes/{name}/resync";
    /// `POST` with a [`FreezeVolume`](crate::FreezeVolume), between cluster nodes: the
    /// volume's serving primary holds its host writes for a snapshot of every copy; answers a
    /// [`FreezePoint`](crate::FreezePoint).
    pub const CLUSTER_VOLUME_FREEZE: &str = "/v1/cluster/volumes/{name}/freeze";
    /// `POST` with a [`ThawVolume`](crate::ThawVolume): ends that hold (204), or says it
    /// lapsed (`snapshot_unavailable`).
    pub const CLUSTER_VOLUME_THAW: &str = "/v1/cluster/volumes/{name}/thaw";
    /// `POST` with a [`ReplicatedRollback`](crate::ReplicatedRollback), to the volume's
    /// primary: rewrites, through the volume's replication, the blocks that differ from the
    /// snapshot, so every copy reads as it (204, once every block is rewritten).
    pub const CLUSTER_VOLUME_ROLLBACK: &str = "/v1/cluster/volumes/{name}/rollback";
    /// `PUT` with a [`LocalSnapshot`](crate::LocalSnapshot), between cluster nodes: takes
    /// snapshot `{id}` of this node's copy of the volume (204); `DELETE`: drops this node's
    /// data of `{id}` (a snapshot's copy, or a clone being made) if no record names it (204).
    pub const CLUSTER_SNAPSHOT: &str = "/v1/cluster/snapshots/{id}";
    /// `GET`, between cluster nodes: the ids of the snapshots this node holds a copy of, as
    /// a [`HeldSnapshots`](crate::HeldSnapshots).
    pub const CLUSTER_SNAPSHOTS: &str = "/v1/cluster/snapshots";
    /// `PUT` with a [`LocalClone`](crate::LocalClone), between cluster nodes: makes volume
    /// `{id}` here a clone of this node's copy of a snapshot, before the clone's record exists
    /// (204). Dropped like a snapshot's copy if the clone is not made everywhere.
    pub const CLUSTER_CLONE: &str = "/v1/cluster/clones/{id}";
    pub const NODE: &str = "/v1/node";
    /// The cluster's nodes (cluster nodes only).
    pub const CLUSTER: &str = "/v1/cluster";
    /// `POST` with a [`ReplaceDrive`](crate::ReplaceDrive): puts a new drive in place of drive
    /// `{index}` (a failed one, usually) and starts rebuilding it from the other drives;
    /// answers the new drive's [`DriveInfo`](crate::DriveInfo). Nodes with erasure coding only.
    pub const DRIVE_REPLACE: &str = "/v1/drives/{index}/replace";
    pub const METRICS: &str = "/metrics";
    pub const HEALTHZ: &str = "/healthz";
}

/// The `{host}` of [`paths::VOLUME_HOST`] that stands for every host: `PUT` opens the volume to
/// any host (and clears its list), `DELETE` restricts it to no host at all. Never an NQN, since
/// NQNs start with `nqn.`.
pub const ANY_HOST: &str = "any";

/// The API URL the CLI uses when neither `--api` nor `FERRITE_API` is given.
pub const DEFAULT_API_URL: &str = "http://127.0.0.1:8080";
