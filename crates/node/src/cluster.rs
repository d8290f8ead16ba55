//! A node as a member of a cluster (issue 6): joining through etcd, placing replicated
//! volumes, and keeping this node's data path in step with the cluster's volumes.
//!
//! A cluster keeps its state in etcd under `/ferrite/<cluster name>`: the volume records
//! (`meta::EtcdStore`, the same records a single node keeps in its embedded store), and the
//! replication state, members, leases and manager key (`meta::ClusterStore`). Each node keeps
//! its own node record (drives, geometry) in its embedded store: [`ClusterMeta`] is the
//! `MetaStore` the volume service uses on a cluster node, answering node calls from the
//! embedded store and everything else from etcd.
//!
//! Joining: the node registers itself as a member (name, addresses, labels, capacity; etcd
//! gives it a node id), and its replication service (`crate::replicate`) then keeps a lease
//! alive, which is its liveness. Volumes: `volume create --replicas N` on any node places the
//! replicas ([`place`]: live nodes first, distinct failure domains when nodes carry the label,
//! most free space first) and writes the replication state, then the volume record. Every
//! node's reconciler ([`Cluster::reconcile`], a few times a second) serves the volumes whose
//! replication state names it a member and drops those that no longer do (deleted, or moved
//! to another node by a rebuild), and keeps the peers' replication addresses current.

use crate::control::ControlError;
use crate::data_plane::DataPlane;
use crate::metrics::Registry;
use crate::replicate::{ReplicationSetup, ReplicationStatus, VolumeReplication};
use meta::{
    ClusterStore, EmbeddedStore, EtcdStore, MemberRecord, MetaError, MetaStore, NodeRecord,
    SnapshotRecord, VolumeRecord,
};
use replication::{LeaseId, NodeId, VolumeState};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;
use types::{ByteSize, VolumeName};

/// How often the reconciler compares the cluster's volumes with what this node serves.
pub const RECONCILE_INTERVAL_MS: u64 = 250;
/// How often this node refreshes its member record (free space).
const MEMBER_REFRESH_MS: u64 = 5_000;
/// How long one etcd call may take.
const ETCD_TIMEOUT: Duration = Duration::from_secs(3);
/// Replicas of one volume at most.
pub const REPLICAS_MAX: u8 = 3;
/// `volume show` on a node that is not the volume's primary asks the primary how its copies
/// stand for at most this long.
pub const RESYNC_ASK_TIMEOUT_MS: u64 = 1_000;
/// How often a resize asks the volume's members whether they serve the new size yet.
const GROW_POLL_MS: u64 = 100;
/// How long one such question may take.
const GROW_ASK_TIMEOUT_MS: u64 = 1_000;
/// How long a resize of a replicated volume waits for every member to serve the new size.
pub const GROW_WAIT_MS: u64 = 15_000;
/// How long a snapshot of a replicated volume holds the volume's host writes at most while
/// each copy is snapshotted (the copies are taken in well under a second; beyond this the
/// snapshot fails and hosts write again).
pub const SNAPSHOT_HOLD_MS: u64 = 5_000;
/// How long one node is given to answer a step of a snapshot (a hold, one copy's snapshot).
const SNAPSHOT_CALL_TIMEOUT_MS: u64 = SNAPSHOT_HOLD_MS + 2_000;
/// How long the node handling a rollback waits for the volume's primary to rewrite what
/// differs from the snapshot (as long as what changed since it takes to write).
const ROLLBACK_CALL_TIMEOUT_MS: u64 = 30 * 60 * 1_000;
/// How long a node waits to be told to drop its copy of a deleted snapshot.
const SNAPSHOT_DROP_TIMEOUT_MS: u64 = 2_000;
/// How long data no record names (a snapshot copy whose record was deleted while this node
/// was away, or whose taking failed) stays before the reconciler drops it, by default: longer
/// than taking a snapshot or making a clone can last (each step's call is bounded by
/// `SNAPSHOT_CALL_TIMEOUT_MS`), since a copy has no record until every copy is made.
pub const DEFAULT_UNNAMED_DATA_GRACE_S: u64 = 60;
/// The shortest grace `--unnamed-data-grace-s` takes.
pub const UNNAMED_DATA_GRACE_S_MIN: u64 = 10;
/// The label that names a node's failure domain; replicas go to distinct values when nodes
/// carry it.
pub const FAILURE_DOMAIN_LABEL: &str = "zone";
/// The smallest lease; etcd refuses shorter TTLs with its default election timeout.
pub const LEASE_MS_MIN: u64 = 2_000;
pub const DEFAULT_LEASE_MS: u64 = 3_000;
pub const DEFAULT_REBUILD_GRACE_S: u64 = 600;
pub const DEFAULT_RESYNC_MB_PER_S: u64 = 256;
/// How long a starting node waits for etcd to answer, in seconds (`--etcd-wait-s`).
pub const DEFAULT_ETCD_WAIT_S: u64 = 60;
/// How often a starting node tries etcd again while it waits for it.
const ETCD_RETRY_MS: u64 = 1_000;
pub const DEFAULT_CLUSTER_NAME: &str = "ferrite";

/// How a node joins a cluster (`ferrite up --cluster-etcd ...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// etcd endpoints, `http://host:port`.
    pub etcd_endpoints: Vec<String>,
    /// The cluster's name: its keys live under `/ferrite/<name>`.
    pub name: String,
    /// This node's name in the cluster, unique.
    pub node_name: String,
    /// Where this node takes replication traffic from its peers.
    pub replication_listen: SocketAddr,
    /// Placement labels (`zone=a`).
    pub labels: BTreeMap<String, String>,
    /// How long a node's lease lives without renewal: the failure detection time.
    pub lease_ms: u64,
    /// How long a member may be gone before its replicas are rebuilt on another node.
    pub rebuild_grace_s: u64,
    /// The most resync and rebuild copy, per node, in MiB per second.
    pub resync_mb_per_s: u64,
    /// How long joining waits for etcd to answer, retrying every second (a node started
    /// with, or before, its etcd); 0 fails at the first refusal.
    pub etcd_wait_s: u64,
    /// How long data no record names stays before the reconciler drops it
    /// ([`DEFAULT_UNNAMED_DATA_GRACE_S`]).
    pub unnamed_data_grace_s: u64,
}

impl ClusterConfig {
    /// Checks the settings; the error says which to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.etcd_endpoints.is_empty() {
            return Err("--cluster-etcd needs at least one etcd endpoint".to_owned());
        }
        if !meta::member_name_valid(&self.node_name) {
            return Err(format!(
                "--node-name {:?} is not a valid node name: 1 to 64 characters of A-Z a-z 0-9 . _ -",
                self.node_name
            ));
        }
        if !meta::member_name_valid(&self.name) {
            return Err(format!(
                "--cluster-name {:?} is not a valid cluster name: 1 to 64 characters of A-Z a-z \
                 0-9 . _ -",
                self.name
            ));
        }
        if self.lease_ms < LEASE_MS_MIN || self.lease_ms % 1000 != 0 {
            return Err(format!(
                "--lease-ms {} must be whole seconds of at least {LEASE_MS_MIN} ms (etcd leases \
                 count in seconds)",
                self.lease_ms
            ));
        }
        if self.unnamed_data_grace_s < UNNAMED_DATA_GRACE_S_MIN {
            return Err(format!(
                "--unnamed-data-grace-s {} must be at least {UNNAMED_DATA_GRACE_S_MIN}: a \
                 snapshot's copies have no record until all are taken",
                self.unnamed_data_grace_s
            ));
        }
        if self.resync_mb_per_s == 0 {
            return Err("--resync-mb-per-s must be above zero".to_owned());
        }
        Ok(())
    }

    /// The etcd key prefix of the cluster.
    pub fn prefix(&self) -> String {
        format!("/ferrite/{}", self.name)
    }

    /// The replication protocol's timing for this cluster (every node of a cluster should
    /// use the same lease).
    pub fn protocol(&self) -> replication::Config {
        let lease_ms = self.lease_ms;
        let blocks_per_s = self.resync_mb_per_s.saturating_mul(1 << 20) / 4096;
        // The service ticks every 5 ms: 200 ticks a second.
        let copy_blocks_per_tick = u32::try_from((blocks_per_s / 200).max(1)).unwrap_or(u32::MAX);
        replication::Config {
            volume_blocks: 1,
            block_size_bytes: 4096,
            lease_ms,
            keepalive_interval_ms: (lease_ms / 4).max(250),
            store_poll_ms: 250,
            store_timeout_ms: 1_000,
            heartbeat_ms: 100,
            retransmit_ms: 200,
            ack_timeout_ms: (lease_ms / 2).max(1_000),
            hello_interval_ms: 500,
            copy_blocks_per_tick,
            dirty_lbas_max: 1 << 20,
            divergence_ranges_max: 1 << 14,
            // 1 MiB regions; up to 16 GiB of a volume hot at once before a restarted node's
            // return needs a full copy; a region leaves 10 s after its last write. A write to a
            // region that left waits for a persist (a file synced and renamed, tens of ms on a
            // busy disk): with 2 s, random writes of a few thousand per second over a 2 GiB
            // volume made about seven persists a second on every node (docs/BENCHMARKS.md,
            // session 21), in the latency tail of the writes that waited.
            intent_region_blocks: 256,
            intent_regions_max: 1 << 14,
            intent_linger_ms: 10_000,
            grace_ms: self.rebuild_grace_s.saturating_mul(1000),
        }
    }
}

/// Why joining the cluster failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("invalid cluster setting: {0}")]
    Config(String),
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error(
        "cannot listen for replication on {addr}: {source}; pass another --replication-listen"
    )]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("cannot keep the replication state in {}: {source}", path.display())]
    StateDir { path: PathBuf, source: std::io::Error },
    #[error("stopped while waiting for etcd at {endpoints}")]
    StoppedWaiting { endpoints: String },
}

/// A node's membership of a cluster, shared by the REST API and the reconciler.
pub struct Cluster {
    pub config: ClusterConfig,
    pub store: Arc<ClusterStore>,
    pub volumes: Arc<EtcdStore>,
    pub me: NodeId,
    pub peers: Arc<RwLock<HashMap<NodeId, SocketAddr>>>,
    pub status: Arc<ReplicationStatus>,
    member: Mutex<MemberRecord>,
}

impl Cluster {
    /// Connects to etcd, binds the replication listener and registers this node. Returns the
    /// cluster and what the data path's replication service needs.
    /// While etcd does not answer it tries again every second for up to
    /// `config.etcd_wait_s`, saying so in the log, unless `stopping` turns true.
    pub fn join(
        config: ClusterConfig,
        node: &NodeRecord,
        data_dir: &std::path::Path,
        api_listen: SocketAddr,
        nvme_listen: &[SocketAddr],
        stopping: &dyn Fn() -> bool,
    ) -> Result<(Arc<Cluster>, ReplicationSetup), ClusterError> {
        config.validate().map_err(ClusterError::Config)?;
        let prefix = config.prefix();
        let lease = Duration::from_millis(config.lease_ms);
        let endpoints = &config.etcd_endpoints;
        let wait = Duration::from_secs(config.etcd_wait_s);
        let store = Arc::new(wait_for_etcd(endpoints, wait, stopping, || {
            ClusterStore::connect(endpoints, &prefix, ETCD_TIMEOUT, lease)
        })?);
        let volumes = Arc::new(wait_for_etcd(endpoints, wait, stopping, || {
            EtcdStore::connect(endpoints, &prefix, ETCD_TIMEOUT)
        })?);
        let listener = std::net::TcpListener::bind(config.replication_listen)
            .map_err(|source| ClusterError::Listen { addr: config.replication_listen, source })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| ClusterError::Listen { addr: config.replication_listen, source })?;
        let bound = listener
            .local_addr()
            .map_err(|source| ClusterError::Listen { addr: config.replication_listen, source })?;
        let record = MemberRecord {
            name: config.node_name.clone(),
            id: NodeId(0),
            replication_addr: crate::advertised(bound).to_string(),
            // As configured; `announce` records the bound addresses once the node serves.
            nvme_addrs: nvme_listen
                .iter()
                .map(|addr| crate::advertised(*addr).to_string())
                .collect(),
            api_addr: crate::advertised(api_listen).to_string(),
            nbd_addr: None,
            labels: config.labels.clone(),
            drive_count: node.drive_count,
            capacity_bytes: node.drive_size_bytes.saturating_mul(u64::from(node.drive_count)),
            free_bytes: node.drive_size_bytes.saturating_mul(u64::from(node.drive_count)),
            updated_unix_ms: crate::control::now_unix_ms(),
        };
        let me = store.register_member(record.clone())?;
        let state_dir = data_dir.join("replication");
        let incarnation = crate::replicate::next_incarnation(&state_dir)
            .map_err(|source| ClusterError::StateDir { path: state_dir.clone(), source })?;
        tracing::info!(
            cluster = %config.name,
            node = %config.node_name,
            id = %me,
            replication = %bound,
            incarnation,
            "joined the cluster"
        );
        let peers = Arc::new(RwLock::new(HashMap::new()));
        let status = Arc::new(ReplicationStatus::default());
        let setup = ReplicationSetup {
            me,
            incarnation,
            store: Arc::clone(&store),
            listener,
            state_dir,
            config: config.protocol(),
            peers: Arc::clone(&peers),
            status: Arc::clone(&status),
        };
        let cluster = Cluster {
            config,
            store,
            volumes,
            me,
            peers,
            status,
            member: Mutex::new(MemberRecord { id: me, ..record }),
        };
        cluster.refresh_peers();
        Ok((Arc::new(cluster), setup))
    }

    /// Every replicated volume's state, by volume id.
    fn states(&self) -> Result<BTreeMap<u64, VolumeState>, MetaError> {
        Ok(self
            .store
            .replication_states()?
            .into_iter()
            .map(|(id, state)| (id, state.value))
            .collect())
    }

    /// The records of the volumes whose state names this node a member, by id.
    fn member_volumes(
        &self,
        states: &BTreeMap<u64, VolumeState>,
    ) -> Result<BTreeMap<u64, VolumeRecord>, MetaError> {
        Ok(self
            .volumes
            .volumes()?
            .into_iter()
            .filter(|record| states.get(&record.id).is_some_and(|s| s.members.contains(&self.me)))
            .map(|record| (record.id, record))
            .collect())
    }

    /// The volumes this node holds a replica of, for the data path's start.
    pub fn local_volumes(&self) -> Result<Vec<VolumeRecord>, MetaError> {
        Ok(self.member_volumes(&self.states()?)?.into_values().collect())
    }

    /// Records the addresses the node serves on, once the data path and the API are up.
    pub fn announce(&self, api: SocketAddr, nvme: &[SocketAddr], nbd: Option<SocketAddr>) {
        let mut member = self.member.lock().unwrap_or_else(PoisonError::into_inner);
        member.api_addr = api.to_string();
        member.nvme_addrs = nvme.iter().map(ToString::to_string).collect();
        member.nbd_addr = nbd.map(|addr| addr.to_string());
        if let Err(error) = self.store.update_member(&member) {
            tracing::warn!(%error, "cannot update this node's member record");
        }
    }

    fn refresh_peers(&self) {
        let Ok(members) = self.store.members() else { return };
        let mut peers = self.peers.write().unwrap_or_else(PoisonError::into_inner);
        for (member, _) in members {
            if let Ok(address) = member.replication_addr.parse::<SocketAddr>() {
                peers.insert(member.id, address);
            }
        }
    }

    /// Names of the nodes, by id.
    pub fn names(&self) -> BTreeMap<NodeId, String> {
        self.store
            .members()
            .map(|members| {
                members.into_iter().map(|(member, _)| (member.id, member.name)).collect()
            })
            .unwrap_or_default()
    }

    /// Creates a replicated volume: places its replicas, writes its replication state, then
    /// its record. Every member's reconciler then serves it.
    pub fn create_volume(
        &self,
        record: &VolumeRecord,
        replicas: u8,
    ) -> Result<Vec<NodeId>, ControlError> {
        let members = self.store.members().map_err(ControlError::Meta)?;
        let placed = place(&members, replicas, record.size_bytes)
            .map_err(|reason| ControlError::Placement { name: record.name.clone(), reason })?;
        self.write_new_volume(record, &placed)?;
        Ok(placed)
    }

    /// Writes a new volume's replication state, with every member in `placed` in sync at
    /// epoch 0 (their copies are alike), then its record; the state goes again if the record
    /// cannot be written.
    fn write_new_volume(
        &self,
        record: &VolumeRecord,
        placed: &[NodeId],
    ) -> Result<(), ControlError> {
        let set: BTreeSet<NodeId> = placed.iter().copied().collect();
        let state = VolumeState {
            epoch: 0,
            primary: None,
            primary_lease: LeaseId::NONE,
            in_sync: set.clone(),
            members: set,
        };
        self.store.create_replication_state(record.id, &state).map_err(ControlError::Meta)?;
        if let Err(error) = self.volumes.create_volume(record) {
            let _ = self.store.delete_replication_state(record.id);
            return Err(ControlError::from_meta_error(error));
        }
        Ok(())
    }

    /// Creates the replicated clone `record` of snapshot `snapshot_id`: places its replicas on
    /// live nodes holding a copy of the snapshot (asked through their API), has each make the
    /// clone of its copy (the copies are alike, so every replica starts in sync), then writes
    /// the replication state and the record. On failure the clones made are dropped again.
    pub fn create_clone(
        &self,
        record: &VolumeRecord,
        snapshot_id: u64,
        replicas: u8,
    ) -> Result<Vec<NodeId>, ControlError> {
        let holders: Vec<(MemberRecord, bool)> = self
            .snapshot_copies()?
            .holders_of(snapshot_id)
            .map(|member| (member.clone(), true))
            .collect();
        let names: Vec<&str> = holders.iter().map(|(member, _)| member.name.as_str()).collect();
        let placed = place(&holders, replicas, record.size_bytes).map_err(|reason| {
            let reason = if holders.len() < usize::from(replicas) {
                format!(
                    "a clone's replicas go to live nodes holding a copy of its snapshot, and {} do ({}): at most {} replicas",
                    holders.len(),
                    names.join(", "),
                    holders.len()
                )
            } else {
                reason
            };
            ControlError::Placement { name: record.name.clone(), reason }
        })?;
        let mut made: Vec<&MemberRecord> = Vec::new();
        for id in &placed {
            let Some((member, _)) = holders.iter().find(|(member, _)| member.id == *id) else {
                unreachable!("placed on a holder");
            };
            let result = member_api(member, SNAPSHOT_CALL_TIMEOUT_MS)
                .and_then(|client| client.make_local_clone(record.id, snapshot_id));
            if let Err(error) = result {
                for made in made {
                    self.drop_snapshot_copy(made, record.id);
                }
                return Err(ControlError::SnapshotUnavailable(format!(
                    "clone {} was not made: node {}: {error}; nothing was kept, try again",
                    record.name, member.name
                )));
            }
            made.push(member);
        }
        if let Err(error) = self.write_new_volume(record, &placed) {
            for made in made {
                self.drop_snapshot_copy(made, record.id);
            }
            return Err(error);
        }
        Ok(placed)
    }

    /// Rolls replicated `volume` back to `snapshot`: the volume's primary rewrites the blocks
    /// that differ through the volume's replication. `Ok(false)` if this node is the primary
    /// (the caller does it here); `Ok(true)` once the primary did.
    pub fn rollback_on_primary(
        &self,
        volume: &VolumeRecord,
        snapshot: &SnapshotRecord,
    ) -> Result<bool, ControlError> {
        let unavailable = |reason: String| {
            ControlError::SnapshotUnavailable(format!(
                "rolling {} back to {} failed: {reason}",
                volume.name,
                api::snapshot_ref(volume.name.as_str(), snapshot.name.as_str())
            ))
        };
        let state = self
            .volume_state(volume.id)
            .ok_or_else(|| unavailable("the volume has no replication state".to_owned()))?;
        let Some(primary) = state.value.primary else {
            return Err(unavailable(
                "the volume has no primary now (a failover?); nothing was changed, try again"
                    .to_owned(),
            ));
        };
        if primary == self.me {
            return Ok(false);
        }
        let members = self.store.members().map_err(ControlError::Meta)?;
        let Some((member, _)) = members.iter().find(|(member, _)| member.id == primary) else {
            return Err(unavailable(format!("its primary, node {primary}, is not a member")));
        };
        member_api(member, ROLLBACK_CALL_TIMEOUT_MS)
            .and_then(|client| client.rollback_replicated(volume.name.as_str(), snapshot.id))
            .map_err(|error| unavailable(format!("its primary, node {}: {error}", member.name)))?;
        Ok(true)
    }

    /// Which live members hold a copy of which snapshots, asked now (each within
    /// `SNAPSHOT_CALL_TIMEOUT_MS`; a member that does not answer counts as holding none).
    pub fn snapshot_copies(&self) -> Result<SnapshotCopies, ControlError> {
        let members = self.store.members().map_err(ControlError::Meta)?;
        let members = members
            .into_iter()
            .filter(|(_, live)| *live)
            .filter_map(|(member, _)| {
                let client = member_api(&member, SNAPSHOT_CALL_TIMEOUT_MS).ok()?;
                let held = client.held_snapshots().ok()?;
                Some((member, held.into_iter().collect()))
            })
            .collect();
        Ok(SnapshotCopies { members, me: self.me })
    }

    /// Refuses a grow of `record` to `size_bytes` that a member holding a replica has no room
    /// for, as its member record last said (each node refreshes it every few seconds). Each
    /// replica needs the growth on its node: volumes are thin, but their size is reserved.
    pub fn check_grow(&self, record: &VolumeRecord, size_bytes: u64) -> Result<(), ControlError> {
        let Some(state) = self.volume_state(record.id) else {
            return Err(ControlError::NotOnCluster(format!(
                "volume {} has no replication state in the cluster",
                record.name
            )));
        };
        let needed = size_bytes - record.size_bytes;
        let members = self.store.members().map_err(ControlError::Meta)?;
        for (member, _) in
            members.iter().filter(|(member, _)| state.value.members.contains(&member.id))
        {
            if member.free_bytes < needed {
                return Err(ControlError::GrowNoSpace {
                    name: record.name.clone(),
                    node: member.name.clone(),
                    requested_bytes: needed,
                    free_bytes: member.free_bytes,
                });
            }
        }
        Ok(())
    }

    /// Waits until every member of volume `name` (id `id`) serves at least `size_bytes`, for
    /// at most `timeout`: asked of each member's API (this node's own answer is its status).
    /// Returns the members still behind, with the size each serves (`None`: it did not
    /// answer).
    pub fn wait_grown(
        &self,
        id: u64,
        name: &str,
        size_bytes: u64,
        timeout: Duration,
    ) -> Vec<(String, Option<u64>)> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let behind = self.members_behind(id, name, size_bytes);
            if behind.is_empty() || std::time::Instant::now() >= deadline {
                return behind;
            }
            std::thread::sleep(Duration::from_millis(GROW_POLL_MS));
        }
    }

    fn members_behind(&self, id: u64, name: &str, size_bytes: u64) -> Vec<(String, Option<u64>)> {
        let Some(state) = self.volume_state(id) else { return Vec::new() };
        let members: Vec<MemberRecord> = match self.store.members() {
            Ok(members) => members.into_iter().map(|(member, _)| member).collect(),
            Err(_) => return vec![("the cluster's member list".to_owned(), None)],
        };
        let mut behind = Vec::new();
        for node in &state.value.members {
            let Some(member) = members.iter().find(|member| member.id == *node) else {
                behind.push((node.to_string(), None));
                continue;
            };
            let served = if *node == self.me {
                self.status
                    .volume(id)
                    .map(|local| local.volume_blocks * u64::from(types::LOGICAL_BLOCK_SIZE_BYTES))
            } else {
                member_api(member, GROW_ASK_TIMEOUT_MS)
                    .and_then(|client| client.volume(name))
                    .ok()
                    .and_then(|info| info.replication)
                    .and_then(|replication| replication.local)
                    .map(|local| local.size_bytes)
            };
            if served.is_none_or(|served| served < size_bytes) {
                behind.push((member.name.clone(), served));
            }
        }
        behind
    }

    /// Deletes a volume's replication state after its record (members then drop their
    /// replicas).
    pub fn forget_volume(&self, id: u64) {
        if let Err(error) = self.store.delete_replication_state(id) {
            tracing::warn!(volume = id, %error, "cannot delete the volume's replication state");
        }
    }

    /// The volume's replication state, if it has one.
    pub fn volume_state(&self, id: u64) -> Option<replication::Versioned<VolumeState>> {
        self.store
            .replication_states()
            .ok()?
            .into_iter()
            .find_map(|(volume, state)| (volume == id).then_some(state))
    }

    /// Keeps the data path serving exactly the volumes this node is a member of, until `stop`.
    /// Runs on a blocking thread.
    pub fn reconcile(
        self: Arc<Self>,
        data_plane: Arc<dyn DataPlane>,
        metrics: Arc<Registry>,
        served: Vec<VolumeRecord>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut served: BTreeMap<u64, VolumeRecord> =
            served.into_iter().map(|record| (record.id, record)).collect();
        let mut last_error = String::new();
        // Volumes that could not grow here, with the last reason said in the log.
        let mut grow_failures: BTreeMap<u64, String> = BTreeMap::new();
        let mut last_member_refresh = std::time::Instant::now();
        // Data no record names, by id: since when it has been seen so.
        let mut unnamed: BTreeMap<u64, std::time::Instant> = BTreeMap::new();
        while !*stop.borrow() {
            let reconciled = self
                .reconcile_once(&*data_plane, &metrics, &mut served, &mut grow_failures)
                .and_then(|()| self.reconcile_snapshots(&*data_plane, &mut unnamed));
            match reconciled {
                Ok(()) => last_error.clear(),
                Err(error) => {
                    let text = error.to_string();
                    if text != last_error {
                        tracing::warn!(error = %text, "cannot reconcile with the cluster");
                        last_error = text;
                    }
                }
            }
            if last_member_refresh.elapsed() >= Duration::from_millis(MEMBER_REFRESH_MS) {
                last_member_refresh = std::time::Instant::now();
                let capacity = data_plane.capacity();
                let mut member = self.member.lock().unwrap_or_else(PoisonError::into_inner);
                member.capacity_bytes = capacity.total_bytes;
                member.free_bytes = capacity.free_bytes;
                member.updated_unix_ms = crate::control::now_unix_ms();
                if let Err(error) = self.store.update_member(&member) {
                    tracing::debug!(%error, "cannot refresh this node's member record");
                }
            }
            std::thread::sleep(Duration::from_millis(RECONCILE_INTERVAL_MS));
        }
    }

    fn reconcile_once(
        &self,
        data_plane: &dyn DataPlane,
        metrics: &Registry,
        served: &mut BTreeMap<u64, VolumeRecord>,
        grow_failures: &mut BTreeMap<u64, String>,
    ) -> Result<(), MetaError> {
        self.refresh_peers();
        let states = self.states()?;
        data_plane.set_cluster_volumes(states.keys().copied().collect());
        let wanted = self.member_volumes(&states)?;
        let gone: Vec<u64> = served.keys().filter(|id| !wanted.contains_key(id)).copied().collect();
        for id in gone {
            grow_failures.remove(&id);
            if let Some(record) = served.remove(&id) {
                tracing::info!(volume = %record.name, id, "no longer a member: dropping the replica");
                data_plane.remove(&record);
                metrics.remove_volume(id);
            }
        }
        for (id, record) in wanted {
            match served.get(&id) {
                None => {
                    if let Err(error) = data_plane.reserve_create(id, record.size_bytes) {
                        tracing::warn!(volume = %record.name, %error, "cannot reserve the replica");
                        continue;
                    }
                    metrics.register_volume(id, &record.name);
                    if let Err(error) = data_plane.publish_replicated(&record) {
                        tracing::warn!(volume = %record.name, %error, "cannot serve the replica");
                        data_plane.cancel(&record);
                        continue;
                    }
                    tracing::info!(volume = %record.name, id, "serving a replica");
                    served.insert(id, record);
                }
                Some(current) => {
                    if current.host_access != record.host_access {
                        data_plane.set_host_access(&record);
                    }
                    if current.compression != record.compression {
                        data_plane.set_compression(&record);
                    }
                    let mut record = record;
                    if record.size_bytes > current.size_bytes {
                        match data_plane.grow_replicated(current, record.size_bytes) {
                            Ok(()) => {
                                grow_failures.remove(&id);
                                tracing::info!(
                                    volume = %record.name,
                                    id,
                                    from = %ByteSize(current.size_bytes),
                                    to = %ByteSize(record.size_bytes),
                                    "the volume grew"
                                );
                            }
                            Err(error) => {
                                // Tried again at the next round; said once per reason.
                                let text = error.to_string();
                                if grow_failures.get(&id) != Some(&text) {
                                    tracing::warn!(
                                        volume = %record.name,
                                        id,
                                        to = %ByteSize(record.size_bytes),
                                        %error,
                                        "cannot grow the volume here; its replica keeps the old size \
                                         until it can (a primary that grew removes it from the \
                                         in-sync set once it misses writes beyond the old end)"
                                    );
                                    grow_failures.insert(id, text);
                                }
                                record.size_bytes = current.size_bytes;
                            }
                        }
                    }
                    served.insert(id, record);
                }
            }
        }
        Ok(())
    }
}

impl Cluster {
    /// Takes `snapshot` of the replicated `volume` on every copy alike the primary's (crate
    /// replication's docs, "Snapshots"): the primary holds the volume's host writes until
    /// every write it took completed, each replica named then snapshots its copy, the primary
    /// its own, and the hold ends; the snapshot stands only if the primary served the same term
    /// holding the writes throughout. Its record is the caller's to write. Returns the names of
    /// the nodes holding a copy, and about how long hosts' writes were held (from asking the
    /// primary to hold them, which includes waiting for the writes in flight, to the end of
    /// the hold, as this node saw it); on failure every copy taken is dropped again.
    pub fn take_snapshot(
        &self,
        volume: &VolumeRecord,
        snapshot: &SnapshotRecord,
    ) -> Result<(Vec<String>, Duration), ControlError> {
        let unavailable = |reason: String| {
            ControlError::SnapshotUnavailable(format!(
                "snapshot {} was not taken: {reason}; nothing was kept, try again",
                api::snapshot_ref(volume.name.as_str(), snapshot.name.as_str())
            ))
        };
        let state = self
            .volume_state(volume.id)
            .ok_or_else(|| unavailable("the volume has no replication state".to_owned()))?;
        let members: BTreeMap<NodeId, MemberRecord> = self
            .store
            .members()
            .map_err(ControlError::Meta)?
            .into_iter()
            .map(|(member, _)| (member.id, member))
            .collect();
        let Some(primary) = state.value.primary.and_then(|primary| members.get(&primary)) else {
            return Err(unavailable("the volume has no primary now (a failover?)".to_owned()));
        };
        let client = |member: &MemberRecord| {
            member_api(member, SNAPSHOT_CALL_TIMEOUT_MS)
                .map_err(|error| format!("node {}: {error}", member.name))
        };
        let name = volume.name.as_str();
        // Writes are held from the moment the primary takes the request.
        let held_at = std::time::Instant::now();
        let held = client(primary)
            .and_then(|api| {
                api.freeze_volume(name, SNAPSHOT_HOLD_MS)
                    .map_err(|error| format!("node {}: {error}", primary.name))
            })
            .map_err(|reason| {
                unavailable(format!("the primary could not hold the volume's writes: {reason}"))
            })?;
        let local = api::LocalSnapshot {
            volume: name.to_owned(),
            name: snapshot.name.to_string(),
            size_bytes: snapshot.size_bytes,
            uuid: snapshot.uuid,
            created_unix_ms: snapshot.created_unix_ms,
        };
        let mut taken: Vec<&MemberRecord> = Vec::new();
        let mut failure = None;
        let copies = held.copies.iter().map(|id| (NodeId(*id), members.get(&NodeId(*id))));
        for (id, member) in copies.chain([(primary.id, Some(primary))]) {
            let Some(member) = member else {
                failure = Some(format!("replica {id} is not a known member"));
                break;
            };
            let result = client(member).and_then(|api| {
                api.take_local_snapshot(snapshot.id, &local)
                    .map_err(|error| format!("node {}: {error}", member.name))
            });
            match result {
                Ok(()) => taken.push(member),
                Err(reason) => {
                    failure = Some(reason);
                    break;
                }
            }
        }
        // Hosts write again in any case; the snapshot stands only if the hold lasted.
        let thawed = client(primary).and_then(|api| {
            api.thaw_volume(name, held.token)
                .map_err(|error| format!("node {}: {error}", primary.name))
        });
        let held = held_at.elapsed();
        if let (None, Err(reason)) = (&failure, thawed) {
            failure = Some(reason);
        }
        if let Some(reason) = failure {
            for member in taken {
                self.drop_snapshot_copy(member, snapshot.id);
            }
            return Err(unavailable(reason));
        }
        Ok((taken.iter().map(|member| member.name.clone()).collect(), held))
    }

    /// Tells every member to drop its copy of snapshot `id` (its record is gone, or was never
    /// written). A member that does not answer drops it itself once its reconciler has seen
    /// it unnamed for `unnamed_data_grace_s`.
    pub fn drop_snapshot_copies(&self, id: u64) {
        let members = match self.store.members() {
            Ok(members) => members,
            Err(error) => {
                tracing::warn!(id, %error, "cannot list the members to drop a snapshot's copies; \
                                            each drops its own later");
                return;
            }
        };
        for (member, _) in members {
            self.drop_snapshot_copy(&member, id);
        }
    }

    fn drop_snapshot_copy(&self, member: &MemberRecord, id: u64) {
        let dropped = member_api(member, SNAPSHOT_DROP_TIMEOUT_MS)
            .and_then(|client| client.drop_local_snapshot(id));
        if let Err(error) = dropped {
            tracing::warn!(
                node = %member.name,
                id,
                %error,
                "cannot tell the node to drop its copy of a snapshot; it drops it itself later"
            );
        }
    }

    /// Serves the snapshots whose copies this node holds, and drops data no record names once
    /// it has stayed unnamed for `unnamed_data_grace_s` (`unnamed`: since when each such id
    /// has been seen).
    fn reconcile_snapshots(
        &self,
        data_plane: &dyn DataPlane,
        unnamed: &mut BTreeMap<u64, std::time::Instant>,
    ) -> Result<(), MetaError> {
        let Some(stored) = data_plane.stored_ids() else { return Ok(()) };
        let stored: BTreeSet<u64> = stored.into_iter().collect();
        let volumes: BTreeMap<VolumeName, u64> =
            self.volumes.volumes()?.into_iter().map(|record| (record.name, record.id)).collect();
        let snapshots = self.volumes.all_snapshots()?;
        for snapshot in snapshots.iter().filter(|snapshot| stored.contains(&snapshot.id)) {
            if let Some(&volume_id) = volumes.get(&snapshot.volume) {
                data_plane.publish_snapshot(volume_id, snapshot);
            }
        }
        let named: BTreeSet<u64> =
            volumes.values().copied().chain(snapshots.iter().map(|snapshot| snapshot.id)).collect();
        let now = std::time::Instant::now();
        unnamed.retain(|id, _| stored.contains(id) && !named.contains(id));
        for &id in stored.difference(&named) {
            let since = *unnamed.entry(id).or_insert(now);
            if now.duration_since(since) >= Duration::from_secs(self.config.unnamed_data_grace_s) {
                data_plane.drop_unnamed(id);
                unnamed.remove(&id);
            }
        }
        Ok(())
    }
}

impl Cluster {
    /// The copies this node makes as the primary of volume `id`, for the API.
    pub fn local_resync(&self, id: u64) -> Vec<api::ResyncProgress> {
        let Some(local) = self.status.volume(id) else { return Vec::new() };
        if local.resync.is_empty() {
            return Vec::new();
        }
        let names = self.names();
        resync_info(&local.resync, &names)
    }

    /// The copies the primary of volume `name` makes, as it answers them: this node's
    /// own when it serves the volume, else asked of the primary's API (at most
    /// [`RESYNC_ASK_TIMEOUT_MS`]; nothing when it cannot be asked).
    fn primary_resync(
        &self,
        local: Option<&VolumeReplication>,
        name: &str,
        primary: Option<NodeId>,
        members: &[MemberRecord],
        names: &BTreeMap<NodeId, String>,
    ) -> Vec<api::ResyncProgress> {
        if let Some(local) = local.filter(|local| local.serving) {
            return resync_info(&local.resync, names);
        }
        let Some(primary) = primary.filter(|primary| *primary != self.me) else {
            return Vec::new();
        };
        let Some(member) = members.iter().find(|member| member.id == primary) else {
            return Vec::new();
        };
        let asked =
            member_api(member, RESYNC_ASK_TIMEOUT_MS).and_then(|client| client.volume_resync(name));
        match asked {
            Ok(resync) => resync,
            Err(error) => {
                tracing::debug!(volume = name, primary = %member.name, %error, "cannot ask the primary how its copies stand");
                Vec::new()
            }
        }
    }

    /// A volume's replication as the API reports it.
    pub fn replication_info(&self, id: u64, volume: &str) -> Option<api::ReplicationInfo> {
        let state = self.volume_state(id)?.value;
        let members: Vec<MemberRecord> = self
            .store
            .members()
            .map(|members| members.into_iter().map(|(member, _)| member).collect())
            .unwrap_or_default();
        let names: BTreeMap<NodeId, String> =
            members.iter().map(|member| (member.id, member.name.clone())).collect();
        let name = |node: &NodeId| names.get(node).cloned().unwrap_or_else(|| node.to_string());
        let local_status = self.status.volume(id);
        let local = local_status.as_ref().map(|local| api::LocalReplica {
            node: self.config.node_name.clone(),
            size_bytes: local.volume_blocks * u64::from(types::LOGICAL_BLOCK_SIZE_BYTES),
            epoch: local.epoch,
            serving: local.serving,
            failed: local.latched,
            writes_completed: local.stats.writes_completed,
            replicas_removed: local.stats.replicas_removed,
            resyncs_started: local.stats.resyncs_started,
            resyncs_completed: local.stats.resyncs_completed,
            blocks_resynced: local.stats.blocks_resynced,
            blocks_pushed: local.stats.blocks_pushed,
            reads_repaired: local.stats.reads_repaired,
            blocks_repaired: local.stats.blocks_repaired,
            reads_unrecovered: local.stats.reads_unrecovered,
            peer_reads_served: local.stats.peer_reads_served,
            damaged_found: local.stats.damaged_noted,
            damaged_rewritten: local.stats.damaged_rewritten,
            blocks_sent_for_repair: local.stats.blocks_sent_for_repair,
            reconcile_blocks_repaired: local.stats.reconcile_repaired,
            reconcile_unrecovered: local.stats.reconcile_unrecovered,
            entries_refused: local.stats.entries_refused,
            storage_probes: local.stats.storage_probes,
        });
        Some(api::ReplicationInfo {
            epoch: state.epoch,
            primary: state.primary.as_ref().map(name),
            members: state.members.iter().map(name).collect(),
            in_sync: state.in_sync.iter().map(name).collect(),
            local,
            resync: self.primary_resync(
                local_status.as_ref(),
                volume,
                state.primary,
                &members,
                &names,
            ),
        })
    }

    /// The cluster's nodes, for `GET /v1/cluster`.
    pub fn info(&self) -> Result<api::ClusterInfo, MetaError> {
        let members = self.store.members()?;
        let states = self.store.replication_states()?;
        let live: BTreeSet<NodeId> =
            members.iter().filter(|(_, live)| *live).map(|(member, _)| member.id).collect();
        let nodes = members
            .iter()
            .map(|(member, is_live)| api::ClusterNode {
                name: member.name.clone(),
                id: member.id.0,
                live: *is_live,
                replication_addr: member.replication_addr.clone(),
                nvme_addrs: member.nvme_addrs.clone(),
                api_addr: member.api_addr.clone(),
                nbd_addr: member.nbd_addr.clone(),
                labels: member.labels.clone(),
                drive_count: member.drive_count,
                capacity_bytes: member.capacity_bytes,
                free_bytes: member.free_bytes,
                replicas: states
                    .iter()
                    .filter(|(_, state)| state.value.members.contains(&member.id))
                    .count() as u64,
                primaries: states
                    .iter()
                    .filter(|(_, state)| state.value.primary == Some(member.id))
                    .count() as u64,
            })
            .collect();
        let degraded = states
            .iter()
            .filter(|(_, state)| {
                state.value.in_sync.len() < state.value.members.len()
                    || state.value.members.iter().any(|member| !live.contains(member))
            })
            .count() as u64;
        let manager = self.store.manager()?.map(|id| {
            members
                .iter()
                .find(|(member, _)| member.id == id)
                .map_or_else(|| id.to_string(), |(member, _)| member.name.clone())
        });
        Ok(api::ClusterInfo {
            name: self.config.name.clone(),
            node: self.config.node_name.clone(),
            manager,
            nodes,
            volumes: states.len() as u64,
            volumes_degraded: degraded,
        })
    }
}

/// A client of `member`'s REST API whose calls give up after `timeout_ms`.
/// The live members and the snapshots each holds a copy of (`Cluster::snapshot_copies`).
pub struct SnapshotCopies {
    members: Vec<(MemberRecord, BTreeSet<u64>)>,
    me: NodeId,
}

impl SnapshotCopies {
    /// The members holding a copy of snapshot `id`, by node id.
    pub fn holders_of(&self, id: u64) -> impl Iterator<Item = &MemberRecord> {
        self.members.iter().filter(move |(_, held)| held.contains(&id)).map(|(member, _)| member)
    }

    /// Whether this node holds a copy of snapshot `id`.
    pub fn held_here(&self, id: u64) -> bool {
        self.holders_of(id).any(|member| member.id == self.me)
    }
}

fn member_api(member: &MemberRecord, timeout_ms: u64) -> Result<api::Client, api::ClientError> {
    api::Client::with_timeout_ms(&format!("http://{}", member.api_addr), timeout_ms)
}

/// Chooses `replicas` nodes for a volume: live members only, distinct failure domains (the
/// `zone` label) while there are enough of them, most free space first, ties by id.
pub fn place(
    members: &[(MemberRecord, bool)],
    replicas: u8,
    size_bytes: u64,
) -> Result<Vec<NodeId>, String> {
    if replicas == 0 || replicas > REPLICAS_MAX {
        return Err(format!("--replicas must be 1 to {REPLICAS_MAX}, not {replicas}"));
    }
    let mut live: Vec<&MemberRecord> =
        members.iter().filter(|(_, live)| *live).map(|(member, _)| member).collect();
    if live.len() < usize::from(replicas) {
        return Err(format!(
            "{replicas} replicas need {replicas} live nodes, and {} of {} are live; start more \
             nodes (`ferrite node list` shows them) or ask for fewer replicas",
            live.len(),
            members.len()
        ));
    }
    live.sort_by(|a, b| b.free_bytes.cmp(&a.free_bytes).then(a.id.cmp(&b.id)));
    let _ = size_bytes; // thin: any node can hold any size; free space only orders them
    let mut chosen: Vec<NodeId> = Vec::new();
    let mut domains: BTreeSet<Option<&String>> = BTreeSet::new();
    // First pass: one node per failure domain; second: fill up with the rest.
    for member in &live {
        let domain = member.labels.get(FAILURE_DOMAIN_LABEL);
        if chosen.len() < usize::from(replicas) && (domain.is_none() || domains.insert(domain)) {
            chosen.push(member.id);
        }
    }
    for member in &live {
        if chosen.len() < usize::from(replicas) && !chosen.contains(&member.id) {
            chosen.push(member.id);
        }
    }
    Ok(chosen)
}

/// The metadata store of a cluster node: this node's record in its embedded store, volumes
/// and snapshots in etcd.
pub struct ClusterMeta {
    pub local: Arc<EmbeddedStore>,
    pub cluster: Arc<EtcdStore>,
}

impl MetaStore for ClusterMeta {
    fn revision(&self) -> Result<u64, MetaError> {
        self.cluster.revision()
    }
    fn node(&self) -> Result<Option<NodeRecord>, MetaError> {
        self.local.node()
    }
    fn put_node(&self, node: &NodeRecord) -> Result<u64, MetaError> {
        self.local.put_node(node)
    }
    fn allocate_volume_id(&self) -> Result<u64, MetaError> {
        self.cluster.allocate_volume_id()
    }
    fn volume(&self, name: &VolumeName) -> Result<Option<VolumeRecord>, MetaError> {
        self.cluster.volume(name)
    }
    fn volumes(&self) -> Result<Vec<VolumeRecord>, MetaError> {
        self.cluster.volumes()
    }
    fn create_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError> {
        self.cluster.create_volume(record)
    }
    fn update_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError> {
        self.cluster.update_volume(record)
    }
    fn delete_volume(&self, name: &VolumeName) -> Result<VolumeRecord, MetaError> {
        self.cluster.delete_volume(name)
    }
    fn snapshots(&self, volume: &VolumeName) -> Result<Vec<SnapshotRecord>, MetaError> {
        self.cluster.snapshots(volume)
    }
    fn all_snapshots(&self) -> Result<Vec<SnapshotRecord>, MetaError> {
        self.cluster.all_snapshots()
    }
    fn snapshot(
        &self,
        volume: &VolumeName,
        name: &VolumeName,
    ) -> Result<Option<SnapshotRecord>, MetaError> {
        self.cluster.snapshot(volume, name)
    }
    fn create_snapshot(&self, record: &SnapshotRecord) -> Result<u64, MetaError> {
        self.cluster.create_snapshot(record)
    }
    fn delete_snapshot(
        &self,
        volume: &VolumeName,
        name: &VolumeName,
    ) -> Result<SnapshotRecord, MetaError> {
        self.cluster.delete_snapshot(volume, name)
    }
}

/// `connect()`, tried again every [`ETCD_RETRY_MS`] while it finds etcd unreachable, for up to
/// `wait` after the first try; other errors end it at once.
fn wait_for_etcd<T>(
    endpoints: &[String],
    wait: Duration,
    stopping: &dyn Fn() -> bool,
    mut connect: impl FnMut() -> Result<T, MetaError>,
) -> Result<T, ClusterError> {
    let deadline = std::time::Instant::now() + wait;
    let mut attempts = 0u64;
    loop {
        attempts += 1;
        match connect() {
            Ok(connected) => {
                if attempts > 1 {
                    tracing::info!(endpoints = %endpoints.join(","), attempts, "etcd answers");
                }
                return Ok(connected);
            }
            Err(error @ MetaError::Unreachable { .. }) => {
                if std::time::Instant::now() >= deadline {
                    return Err(error.into());
                }
                if attempts == 1 {
                    tracing::warn!(
                        %error,
                        wait_s = wait.as_secs(),
                        "etcd does not answer yet; trying again every second until it does or the wait \
                         ends (--etcd-wait-s)"
                    );
                }
            }
            Err(error) => return Err(error.into()),
        }
        let pause = Duration::from_millis(ETCD_RETRY_MS);
        let resume = std::time::Instant::now() + pause;
        while std::time::Instant::now() < resume {
            if stopping() {
                return Err(ClusterError::StoppedWaiting { endpoints: endpoints.join(",") });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The protocol's view of a primary's copies, with node names for the API.
fn resync_info(
    resync: &[replication::ResyncProgress],
    names: &BTreeMap<NodeId, String>,
) -> Vec<api::ResyncProgress> {
    resync
        .iter()
        .map(|copy| api::ResyncProgress {
            node: names.get(&copy.peer).cloned().unwrap_or_else(|| copy.peer.to_string()),
            full: copy.full,
            blocks_total: copy.blocks_total,
            blocks_copied: copy.blocks_copied,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u32, free: u64, zone: Option<&str>) -> MemberRecord {
        MemberRecord {
            name: format!("n{id}"),
            id: NodeId(id),
            replication_addr: "127.0.0.1:1".to_owned(),
            nvme_addrs: Vec::new(),
            api_addr: String::new(),
            nbd_addr: None,
            labels: zone
                .map(|zone| BTreeMap::from([(FAILURE_DOMAIN_LABEL.to_owned(), zone.to_owned())]))
                .unwrap_or_default(),
            drive_count: 1,
            capacity_bytes: 100,
            free_bytes: free,
            updated_unix_ms: 0,
        }
    }

    #[test]
    fn placement_prefers_free_space_live_nodes_and_distinct_zones() {
        let members = vec![
            (member(1, 10, None), true),
            (member(2, 50, None), true),
            (member(3, 90, None), false),
            (member(4, 30, None), true),
        ];
        assert_eq!(place(&members, 2, 1).unwrap(), vec![NodeId(2), NodeId(4)]);
        assert!(place(&members, 3, 1).is_ok());
        let error = place(&members[..2], 3, 1).unwrap_err();
        assert!(error.contains("3 replicas need 3 live nodes"), "{error}");
        assert!(place(&members, 0, 1).is_err() && place(&members, 4, 1).is_err());

        let zoned = vec![
            (member(1, 90, Some("a")), true),
            (member(2, 80, Some("a")), true),
            (member(3, 10, Some("b")), true),
        ];
        // Zone b first despite its space: one replica per zone while zones last.
        assert_eq!(place(&zoned, 2, 1).unwrap(), vec![NodeId(1), NodeId(3)]);
        assert_eq!(place(&zoned, 3, 1).unwrap(), vec![NodeId(1), NodeId(3), NodeId(2)]);
    }
}
