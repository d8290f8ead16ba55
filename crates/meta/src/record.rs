//! The stored form of metadata records: versioned JSON documents.
//!
//! Each record is one JSON object with a `"version"` field. Decoding reads the version first and
//! refuses a version it does not know, so an older build never misreads a newer record; a newer
//! build keeps a decoder for every version it ever wrote. JSON is chosen over a binary layout
//! because records are few, small and read rarely (at start and per API call), and an operator
//! can read them with redb's tools when something goes wrong.
//!
//! Volume record, version 4 (written by this build): version 3 and `"compression"`, the name
//! of how new writes are stored (`"off"`, `"lz4"` or `"zstd"`):
//! `{"version":4,"id":7,"name":"db-1","size_bytes":1073741824,"uuid":[16 bytes],
//!   "created_unix_ms":1700000000000,"chunks":[[drive,index],...],
//!   "allow_any_host":true,"allowed_hosts":[],
//!   "origin":{"volume":"db-0","snapshot":"nightly","snapshot_id":5},"compression":"lz4"}`
//!
//! A version 4 record may also hold `"paths":[[2,"inaccessible"],[3,"non-optimized"]]`: the
//! ANA states set by hand on the node's NVMe/TCP ports (`ferrite volume set-path`), by port ID,
//! sorted, each port once (not 0), at most [`PATH_STATES_MAX`]; a port not listed is optimized,
//! and the field is left out when none is set. It came without a version bump on purpose: a
//! build that does not know it reads every port optimized, which is how every build before it
//! served them (an ANA state steers hosts between paths; it grants no access).
//!
//! Compression came with a version bump so that a build that knows only version 3 refuses the
//! record rather than serving the volume while silently ignoring its setting. Records of
//! versions 1 to 3 decode as [`Compression::Off`]: their volumes were written before the engine
//! compressed anything, and keeping them off keeps their new writes as they always were (a
//! new volume gets lz4 from the control plane, not from this decoder).
//!
//! Volume record, version 3 (read only; it decodes with compression off): version 4 without
//! `"compression"`.
//!
//! The origin came with a version bump so that a build that knows only version 2 refuses a
//! clone's record rather than serving it as a volume of its own without knowing that its blocks
//! are shared.
//!
//! Volume record, version 2 (read only; it decodes with no origin and compression off):
//! `{"version":2,"id":7,"name":"db-1","size_bytes":1073741824,"uuid":[16 bytes],
//!   "created_unix_ms":1700000000000,"chunks":[[drive,index],...],
//!   "allow_any_host":false,"allowed_hosts":["nqn.2014-08.org.nvmexpress:uuid:...",...]}`
//!
//! `allow_any_host` true is [`HostAccess::Open`] and then `allowed_hosts` is empty; false is
//! [`HostAccess::Restricted`] with the listed NQNs (sorted, at most [`ALLOWED_HOSTS_MAX`]).
//! Host access came with version 2 on purpose rather than as an optional field of version 1: a
//! build that knows only version 1 ignores unknown fields, so it would read a restricted volume
//! as open to every host. With the version bumped it refuses the record instead (fail closed).
//!
//! Volume record, version 1 (read only): version 2 without `allow_any_host` and
//! `allowed_hosts`; it decodes as [`HostAccess::Open`], which is how every volume was served
//! before host access control existed, and with no origin.
//!
//! Snapshot record, version 1 (written by this build), stored under its volume's name and its
//! own; its key is written `VOLUME@SNAPSHOT` in error messages:
//! `{"version":1,"id":9,"volume":"db-1","name":"nightly","size_bytes":1073741824,
//!   "uuid":[16 bytes],"created_unix_ms":1700000000000}`
//!
//! Node record, version 2 (written by this build):
//! `{"version":2,"uuid":[16 bytes],"drive_count":4,"drive_size_bytes":17179869184,
//!   "created_unix_ms":1700000000000,"external_drives":false}`
//!
//! `external_drives` true: the drives are block devices or files given with `ferrite up
//! --drive`; false: drive files in the data directory. It came with a version bump so that a
//! build that knows only version 1 refuses the record rather than looking for drive files that
//! do not exist.
//!
//! Node record, version 1 (read only): version 2 without `external_drives`; it decodes as drive
//! files in the data directory, the only kind of drive before version 2.
//!
//! The cluster store's records ([`crate::cluster`]) follow the same rules.
//!
//! Replication state record, version 1 (written by this build), one volume's
//! [`replication::VolumeState`]; node ids and lease ids as numbers, sets sorted:
//! `{"version":1,"epoch":3,"primary":2,"primary_lease":7587869330866211,"in_sync":[1,2],
//!   "members":[1,2,3]}` (`"primary":null` before the first promotion; `"primary_lease":0` is
//! `LeaseId::NONE`).
//!
//! Member record, version 1 (written by this build), one node of the cluster:
//! `{"version":1,"name":"node-a","id":1,"replication_addr":"10.0.0.1:4480",
//!   "nvme_addrs":["10.0.0.1:4420"],"api_addr":"10.0.0.1:8080","nbd_addr":null,
//!   "labels":{"zone":"a"},"drive_count":4,"capacity_bytes":68719476736,
//!   "free_bytes":34359738368,"updated_unix_ms":1700000000000}`
//!
//! Lease grants record, version 1 (written by this build), the last grants of one node, oldest
//! first, as `[nonce, lease id]` pairs; at most [`replication::store::GRANTS_REMEMBERED_MAX`]:
//! `{"version":1,"grants":[[4294967297,7587869330866211]]}`

use crate::cluster::MemberRecord;
use crate::{
    Chunk, Compression, HostAccess, MetaError, NodeRecord, PathState, SnapshotRecord, VolumeOrigin,
    VolumeRecord, ALLOWED_HOSTS_MAX, PATH_STATES_MAX,
};
use replication::store::GRANTS_REMEMBERED_MAX;
use replication::{LeaseId, NodeId, VolumeState};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use types::{Nqn, VolumeName};

/// The volume record version this build writes; it reads every version from 1 up to this.
pub const VOLUME_RECORD_VERSION: u32 = 4;
/// The node record version this build writes; it reads every version from 1 up to this.
pub const NODE_RECORD_VERSION: u32 = 2;
/// The snapshot record version this build writes; it reads every version from 1 up to this.
pub const SNAPSHOT_RECORD_VERSION: u32 = 1;
/// The replication state record version this build writes; it reads every version up to this.
pub const REPLICATION_STATE_RECORD_VERSION: u32 = 1;
/// The member record version this build writes; it reads every version up to this.
pub const MEMBER_RECORD_VERSION: u32 = 1;
/// The lease grants record version this build writes; it reads every version up to this.
pub const LEASE_GRANTS_RECORD_VERSION: u32 = 1;

#[derive(Deserialize)]
struct Envelope {
    version: Option<u64>,
}

/// Volume record version 1, frozen: the decoder of records written before version 2.
#[derive(Deserialize)]
struct VolumeV1 {
    id: u64,
    name: String,
    size_bytes: u64,
    uuid: [u8; 16],
    created_unix_ms: u64,
    chunks: Vec<Chunk>,
}

/// Volume record version 2, frozen: the decoder of records written before version 3.
#[derive(Deserialize)]
struct VolumeV2 {
    id: u64,
    name: String,
    size_bytes: u64,
    uuid: [u8; 16],
    created_unix_ms: u64,
    chunks: Vec<Chunk>,
    allow_any_host: bool,
    allowed_hosts: Vec<String>,
}

/// Volume record version 3, frozen: the decoder of records written before version 4.
#[derive(Deserialize)]
struct VolumeV3 {
    id: u64,
    name: String,
    size_bytes: u64,
    uuid: [u8; 16],
    created_unix_ms: u64,
    chunks: Vec<Chunk>,
    allow_any_host: bool,
    allowed_hosts: Vec<String>,
    #[serde(deserialize_with = "required_option")]
    origin: Option<OriginV3>,
}

#[derive(Serialize, Deserialize)]
struct VolumeV4 {
    version: u32,
    id: u64,
    name: String,
    size_bytes: u64,
    uuid: [u8; 16],
    created_unix_ms: u64,
    chunks: Vec<Chunk>,
    allow_any_host: bool,
    allowed_hosts: Vec<String>,
    /// Always written, `null` when absent; `Option` alone would also accept a missing field,
    /// and a version 3 record without it is corrupt.
    #[serde(deserialize_with = "required_option")]
    origin: Option<OriginV3>,
    /// [`Compression::name`].
    compression: String,
    /// `[[port ID, PathState::name], ...]`, sorted by port; left out when empty (every port
    /// optimized), so records without hand-set states are the bytes they always were.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    paths: Vec<(u16, String)>,
}

#[derive(Serialize, Deserialize)]
struct OriginV3 {
    volume: String,
    snapshot: String,
    snapshot_id: u64,
}

#[derive(Serialize, Deserialize)]
struct SnapshotV1 {
    version: u32,
    id: u64,
    volume: String,
    name: String,
    size_bytes: u64,
    uuid: [u8; 16],
    created_unix_ms: u64,
}

/// Node record version 1, frozen: the decoder of records written before version 2.
#[derive(Deserialize)]
struct NodeV1 {
    uuid: [u8; 16],
    drive_count: u16,
    drive_size_bytes: u64,
    created_unix_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct NodeV2 {
    version: u32,
    uuid: [u8; 16],
    drive_count: u16,
    drive_size_bytes: u64,
    created_unix_ms: u64,
    external_drives: bool,
}

pub fn encode_volume(record: &VolumeRecord) -> Vec<u8> {
    assert!(
        record.host_access.hosts().count() <= ALLOWED_HOSTS_MAX,
        "volume {} allows more than {ALLOWED_HOSTS_MAX} hosts",
        record.name
    );
    let stored = VolumeV4 {
        version: VOLUME_RECORD_VERSION,
        id: record.id,
        name: record.name.as_str().to_owned(),
        size_bytes: record.size_bytes,
        uuid: record.uuid,
        created_unix_ms: record.created_unix_ms,
        chunks: record.chunks.clone(),
        allow_any_host: record.host_access.is_open(),
        allowed_hosts: record.host_access.hosts().map(|nqn| nqn.as_str().to_owned()).collect(),
        origin: record.origin.as_ref().map(|origin| OriginV3 {
            volume: origin.volume.as_str().to_owned(),
            snapshot: origin.snapshot.as_str().to_owned(),
            snapshot_id: origin.snapshot_id,
        }),
        compression: record.compression.name().to_owned(),
        paths: record
            .path_states
            .iter()
            .map(|(port, state)| (*port, state.name().to_owned()))
            .collect(),
    };
    // Serialising plain integers, strings and vectors into memory cannot fail.
    serde_json::to_vec(&stored).expect("a volume record always serialises")
}

/// Decodes a volume record read from the store under `key` (the volume's name).
pub fn decode_volume(key: &str, bytes: &[u8]) -> Result<VolumeRecord, MetaError> {
    let record = match check_version(key, bytes, VOLUME_RECORD_VERSION)? {
        1 => {
            let stored: VolumeV1 =
                serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
            VolumeRecord {
                id: stored.id,
                name: decode_name(key, &stored.name)?,
                size_bytes: stored.size_bytes,
                uuid: stored.uuid,
                created_unix_ms: stored.created_unix_ms,
                chunks: stored.chunks,
                host_access: HostAccess::Open,
                origin: None,
                compression: Compression::Off,
                path_states: BTreeMap::new(),
            }
        }
        2 => {
            let stored: VolumeV2 =
                serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
            VolumeRecord {
                id: stored.id,
                name: decode_name(key, &stored.name)?,
                size_bytes: stored.size_bytes,
                uuid: stored.uuid,
                created_unix_ms: stored.created_unix_ms,
                chunks: stored.chunks,
                host_access: decode_host_access(key, stored.allow_any_host, &stored.allowed_hosts)?,
                origin: None,
                compression: Compression::Off,
                path_states: BTreeMap::new(),
            }
        }
        3 => {
            let stored: VolumeV3 =
                serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
            VolumeRecord {
                id: stored.id,
                name: decode_name(key, &stored.name)?,
                size_bytes: stored.size_bytes,
                uuid: stored.uuid,
                created_unix_ms: stored.created_unix_ms,
                chunks: stored.chunks,
                host_access: decode_host_access(key, stored.allow_any_host, &stored.allowed_hosts)?,
                origin: stored.origin.map(|origin| decode_origin(key, origin)).transpose()?,
                compression: Compression::Off,
                path_states: BTreeMap::new(),
            }
        }
        _ => {
            let stored: VolumeV4 =
                serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
            let compression = Compression::from_name(&stored.compression).ok_or_else(|| {
                corrupt(key, format!("it names an unknown compression {:?}", stored.compression))
            })?;
            VolumeRecord {
                id: stored.id,
                name: decode_name(key, &stored.name)?,
                size_bytes: stored.size_bytes,
                uuid: stored.uuid,
                created_unix_ms: stored.created_unix_ms,
                chunks: stored.chunks,
                host_access: decode_host_access(key, stored.allow_any_host, &stored.allowed_hosts)?,
                origin: stored.origin.map(|origin| decode_origin(key, origin)).transpose()?,
                compression,
                path_states: decode_path_states(key, stored.paths)?,
            }
        }
    };
    Ok(record)
}

fn decode_path_states(
    key: &str,
    stored: Vec<(u16, String)>,
) -> Result<BTreeMap<u16, PathState>, MetaError> {
    if stored.len() > PATH_STATES_MAX {
        return Err(corrupt(key, format!("it lists {} path states", stored.len())));
    }
    let mut states = BTreeMap::new();
    for (port, name) in stored {
        let state = PathState::from_name(&name)
            .ok_or_else(|| corrupt(key, format!("it names an unknown path state {name:?}")))?;
        if port == 0 || states.insert(port, state).is_some() {
            return Err(corrupt(key, format!("it lists port {port} wrongly (0, or twice)")));
        }
    }
    Ok(states)
}

fn decode_origin(key: &str, stored: OriginV3) -> Result<VolumeOrigin, MetaError> {
    let parse = |name: &str| VolumeName::new(name).map_err(|error| corrupt(key, error));
    Ok(VolumeOrigin {
        volume: parse(&stored.volume)?,
        snapshot: parse(&stored.snapshot)?,
        snapshot_id: stored.snapshot_id,
    })
}

/// The key of a snapshot record in error messages: `VOLUME@SNAPSHOT`, the form users write.
pub fn snapshot_key(volume: &VolumeName, name: &VolumeName) -> String {
    format!("{volume}@{name}")
}

pub fn encode_snapshot(record: &SnapshotRecord) -> Vec<u8> {
    let stored = SnapshotV1 {
        version: SNAPSHOT_RECORD_VERSION,
        id: record.id,
        volume: record.volume.as_str().to_owned(),
        name: record.name.as_str().to_owned(),
        size_bytes: record.size_bytes,
        uuid: record.uuid,
        created_unix_ms: record.created_unix_ms,
    };
    serde_json::to_vec(&stored).expect("a snapshot record always serialises")
}

/// Decodes a snapshot record read from the store under the key of snapshot `name` of `volume`
/// (either may be unvalidated text from a key, so both are checked against the record).
pub fn decode_snapshot(
    volume: &str,
    name: &str,
    bytes: &[u8],
) -> Result<SnapshotRecord, MetaError> {
    let key = format!("{volume}@{name}");
    // Only one version so far; `check_version` refuses any other.
    check_version(&key, bytes, SNAPSHOT_RECORD_VERSION)?;
    let stored: SnapshotV1 = serde_json::from_slice(bytes).map_err(|error| corrupt(&key, error))?;
    let record_volume = VolumeName::new(&stored.volume).map_err(|error| corrupt(&key, error))?;
    let record_name = VolumeName::new(&stored.name).map_err(|error| corrupt(&key, error))?;
    if record_volume.as_str() != volume || record_name.as_str() != name {
        return Err(corrupt(&key, format!("it names snapshot {record_volume}@{record_name}")));
    }
    Ok(SnapshotRecord {
        id: stored.id,
        volume: record_volume,
        name: record_name,
        size_bytes: stored.size_bytes,
        uuid: stored.uuid,
        created_unix_ms: stored.created_unix_ms,
    })
}

/// Deserialises an `Option` field that must be present, though it may be `null`.
fn required_option<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer)
}

fn decode_name(key: &str, stored: &str) -> Result<VolumeName, MetaError> {
    let name = VolumeName::new(stored).map_err(|error| corrupt(key, error))?;
    if name.as_str() != key {
        return Err(corrupt(key, format!("it names volume {name:?}")));
    }
    Ok(name)
}

fn decode_host_access(
    key: &str,
    allow_any_host: bool,
    allowed_hosts: &[String],
) -> Result<HostAccess, MetaError> {
    if allowed_hosts.len() > ALLOWED_HOSTS_MAX {
        return Err(corrupt(
            key,
            format!("it allows {} hosts, more than {ALLOWED_HOSTS_MAX}", allowed_hosts.len()),
        ));
    }
    let mut hosts = BTreeSet::new();
    for host in allowed_hosts {
        let nqn = Nqn::new(host).map_err(|error| corrupt(key, error))?;
        if !hosts.insert(nqn) {
            return Err(corrupt(key, format!("it allows host {host:?} twice")));
        }
    }
    match (allow_any_host, hosts.is_empty()) {
        (true, true) => Ok(HostAccess::Open),
        (true, false) => Err(corrupt(key, "it allows any host and also lists hosts")),
        (false, _) => Ok(HostAccess::Restricted(hosts)),
    }
}

pub fn encode_node(record: &NodeRecord) -> Vec<u8> {
    let stored = NodeV2 {
        version: NODE_RECORD_VERSION,
        uuid: record.uuid,
        drive_count: record.drive_count,
        drive_size_bytes: record.drive_size_bytes,
        created_unix_ms: record.created_unix_ms,
        external_drives: record.external_drives,
    };
    serde_json::to_vec(&stored).expect("a node record always serialises")
}

pub fn decode_node(key: &str, bytes: &[u8]) -> Result<NodeRecord, MetaError> {
    let record = match check_version(key, bytes, NODE_RECORD_VERSION)? {
        1 => {
            let stored: NodeV1 =
                serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
            NodeRecord {
                uuid: stored.uuid,
                drive_count: stored.drive_count,
                drive_size_bytes: stored.drive_size_bytes,
                created_unix_ms: stored.created_unix_ms,
                external_drives: false,
            }
        }
        _ => {
            let stored: NodeV2 =
                serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
            NodeRecord {
                uuid: stored.uuid,
                drive_count: stored.drive_count,
                drive_size_bytes: stored.drive_size_bytes,
                created_unix_ms: stored.created_unix_ms,
                external_drives: stored.external_drives,
            }
        }
    };
    Ok(record)
}

#[derive(Serialize, Deserialize)]
struct ReplicationStateV1 {
    version: u32,
    epoch: u64,
    #[serde(deserialize_with = "required_option")]
    primary: Option<u32>,
    primary_lease: u64,
    in_sync: Vec<u32>,
    members: Vec<u32>,
}

pub fn encode_replication_state(state: &VolumeState) -> Vec<u8> {
    let stored = ReplicationStateV1 {
        version: REPLICATION_STATE_RECORD_VERSION,
        epoch: state.epoch,
        primary: state.primary.map(|node| node.0),
        primary_lease: state.primary_lease.0,
        in_sync: state.in_sync.iter().map(|node| node.0).collect(),
        members: state.members.iter().map(|node| node.0).collect(),
    };
    serde_json::to_vec(&stored).expect("a replication state record always serialises")
}

/// Decodes a replication state record read from the store under `key` (`replication/<id>`).
pub fn decode_replication_state(key: &str, bytes: &[u8]) -> Result<VolumeState, MetaError> {
    // Only one version so far; `check_version` refuses any other.
    check_version(key, bytes, REPLICATION_STATE_RECORD_VERSION)?;
    let stored: ReplicationStateV1 =
        serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
    let node_set = |what: &str, nodes: &[u32]| {
        let mut set = BTreeSet::new();
        for &node in nodes {
            if !set.insert(NodeId(node)) {
                return Err(corrupt(key, format!("it lists node {node} twice in {what}")));
            }
        }
        Ok(set)
    };
    Ok(VolumeState {
        epoch: stored.epoch,
        primary: stored.primary.map(NodeId),
        primary_lease: LeaseId(stored.primary_lease),
        in_sync: node_set("in_sync", &stored.in_sync)?,
        members: node_set("members", &stored.members)?,
    })
}

#[derive(Serialize, Deserialize)]
struct MemberV1 {
    version: u32,
    name: String,
    id: u32,
    replication_addr: String,
    nvme_addrs: Vec<String>,
    api_addr: String,
    #[serde(deserialize_with = "required_option")]
    nbd_addr: Option<String>,
    labels: BTreeMap<String, String>,
    drive_count: u16,
    capacity_bytes: u64,
    free_bytes: u64,
    updated_unix_ms: u64,
}

/// Encodes a member record; the caller checked it ([`MemberRecord::check`]).
pub fn encode_member(record: &MemberRecord) -> Vec<u8> {
    assert!(record.check().is_ok(), "member {:?} is checked before it is stored", record.name);
    let stored = MemberV1 {
        version: MEMBER_RECORD_VERSION,
        name: record.name.clone(),
        id: record.id.0,
        replication_addr: record.replication_addr.clone(),
        nvme_addrs: record.nvme_addrs.clone(),
        api_addr: record.api_addr.clone(),
        nbd_addr: record.nbd_addr.clone(),
        labels: record.labels.clone(),
        drive_count: record.drive_count,
        capacity_bytes: record.capacity_bytes,
        free_bytes: record.free_bytes,
        updated_unix_ms: record.updated_unix_ms,
    };
    serde_json::to_vec(&stored).expect("a member record always serialises")
}

/// Decodes a member record read from the store under the key of member `name` (unvalidated
/// text from a key, checked against the record).
pub fn decode_member(name: &str, bytes: &[u8]) -> Result<MemberRecord, MetaError> {
    check_version(name, bytes, MEMBER_RECORD_VERSION)?;
    let stored: MemberV1 = serde_json::from_slice(bytes).map_err(|error| corrupt(name, error))?;
    let record = MemberRecord {
        name: stored.name,
        id: NodeId(stored.id),
        replication_addr: stored.replication_addr,
        nvme_addrs: stored.nvme_addrs,
        api_addr: stored.api_addr,
        nbd_addr: stored.nbd_addr,
        labels: stored.labels,
        drive_count: stored.drive_count,
        capacity_bytes: stored.capacity_bytes,
        free_bytes: stored.free_bytes,
        updated_unix_ms: stored.updated_unix_ms,
    };
    record.check().map_err(|detail| corrupt(name, detail))?;
    if record.name != name {
        return Err(corrupt(name, format!("it names member {:?}", record.name)));
    }
    Ok(record)
}

#[derive(Serialize, Deserialize)]
struct LeaseGrantsV1 {
    version: u32,
    grants: Vec<(u64, u64)>,
}

/// Encodes a node's last lease grants, `(nonce, lease)`, oldest first.
pub fn encode_lease_grants(grants: &[(u64, LeaseId)]) -> Vec<u8> {
    assert!(grants.len() <= GRANTS_REMEMBERED_MAX, "{} grants remembered", grants.len());
    let stored = LeaseGrantsV1 {
        version: LEASE_GRANTS_RECORD_VERSION,
        grants: grants.iter().map(|&(nonce, lease)| (nonce, lease.0)).collect(),
    };
    serde_json::to_vec(&stored).expect("a lease grants record always serialises")
}

/// Decodes a node's lease grants read from the store under `key` (`lease_grants/<node id>`).
pub fn decode_lease_grants(key: &str, bytes: &[u8]) -> Result<Vec<(u64, LeaseId)>, MetaError> {
    check_version(key, bytes, LEASE_GRANTS_RECORD_VERSION)?;
    let stored: LeaseGrantsV1 =
        serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
    if stored.grants.len() > GRANTS_REMEMBERED_MAX {
        return Err(corrupt(
            key,
            format!("it holds {} grants, more than {GRANTS_REMEMBERED_MAX}", stored.grants.len()),
        ));
    }
    // Every lease id came from etcd, which hands out ids from 1 to i64::MAX.
    if let Some((_, lease)) = stored.grants.iter().find(|(_, lease)| !is_etcd_lease_id(*lease)) {
        return Err(corrupt(key, format!("{lease} is not an etcd lease id")));
    }
    Ok(stored.grants.into_iter().map(|(nonce, lease)| (nonce, LeaseId(lease))).collect())
}

/// Whether `lease` can be the id of an etcd lease (a positive `i64`).
pub(crate) fn is_etcd_lease_id(lease: u64) -> bool {
    lease > 0 && i64::try_from(lease).is_ok()
}

/// Reads the record's version: one from 1 to `newest`, or an error.
fn check_version(key: &str, bytes: &[u8], newest: u32) -> Result<u32, MetaError> {
    let envelope: Envelope = serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
    match envelope.version {
        Some(version) if (1..=u64::from(newest)).contains(&version) => {
            // In range 1..=newest, so it fits.
            Ok(u32::try_from(version).unwrap_or(newest))
        }
        Some(version) => Err(MetaError::RecordVersionUnsupported {
            key: key.to_owned(),
            version,
            supported: newest,
        }),
        None => Err(corrupt(key, "it has no format version")),
    }
}

fn corrupt(key: &str, detail: impl std::fmt::Display) -> MetaError {
    MetaError::RecordCorrupt { key: key.to_owned(), detail: detail.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nqn(text: &str) -> Nqn {
        Nqn::new(text).unwrap()
    }

    fn volume() -> VolumeRecord {
        VolumeRecord {
            id: 7,
            name: VolumeName::new("db-1").unwrap(),
            size_bytes: 1 << 30,
            uuid: [9; 16],
            created_unix_ms: 1_700_000_000_000,
            chunks: vec![(0, 1), (3, 4_000_000_000)],
            host_access: HostAccess::Open,
            origin: None,
            compression: Compression::Lz4,
            path_states: Default::default(),
        }
    }

    /// [`volume`] as a record of a version before compression decodes: off.
    fn uncompressed_volume() -> VolumeRecord {
        VolumeRecord { compression: Compression::Off, ..volume() }
    }

    #[test]
    fn volume_round_trip() {
        let record = volume();
        assert_eq!(decode_volume("db-1", &encode_volume(&record)).unwrap(), record);
        for hosts in [vec![], vec!["nqn.b:host", "nqn.a:host"]] {
            let host_access = HostAccess::Restricted(hosts.into_iter().map(nqn).collect());
            let record = VolumeRecord { host_access, ..volume() };
            assert_eq!(decode_volume("db-1", &encode_volume(&record)).unwrap(), record);
        }
        for compression in Compression::ALL {
            let record = VolumeRecord { compression, ..volume() };
            assert_eq!(decode_volume("db-1", &encode_volume(&record)).unwrap(), record);
        }
    }

    fn origin() -> VolumeOrigin {
        VolumeOrigin {
            volume: VolumeName::new("db-0").unwrap(),
            snapshot: VolumeName::new("nightly").unwrap(),
            snapshot_id: 5,
        }
    }

    fn snapshot() -> SnapshotRecord {
        SnapshotRecord {
            id: 9,
            volume: VolumeName::new("db-1").unwrap(),
            name: VolumeName::new("nightly").unwrap(),
            size_bytes: 1 << 30,
            uuid: [4; 16],
            created_unix_ms: 1_700_000_000_001,
        }
    }

    #[test]
    fn clone_round_trip() {
        let record = VolumeRecord { origin: Some(origin()), ..volume() };
        let bytes = encode_volume(&record);
        assert_eq!(decode_volume("db-1", &bytes).unwrap(), record);
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            value["origin"],
            serde_json::json!({"volume": "db-0", "snapshot": "nightly", "snapshot_id": 5})
        );
    }

    #[test]
    fn volume_version_4_layout() {
        let hosts = [nqn("nqn.b:host"), nqn("nqn.a:host")].into_iter().collect();
        let record = VolumeRecord { host_access: HostAccess::Restricted(hosts), ..volume() };
        let value: serde_json::Value = serde_json::from_slice(&encode_volume(&record)).unwrap();
        assert_eq!(value["version"], 4);
        assert_eq!(value["compression"], "lz4");
        assert_eq!(value["origin"], serde_json::Value::Null);
        assert!(value.as_object().unwrap().contains_key("origin"), "origin is always written");
        assert_eq!(value["allow_any_host"], false);
        assert_eq!(value["allowed_hosts"], serde_json::json!(["nqn.a:host", "nqn.b:host"]));
        let open: serde_json::Value = serde_json::from_slice(&encode_volume(&volume())).unwrap();
        assert_eq!(open["allow_any_host"], true);
        assert_eq!(open["allowed_hosts"], serde_json::json!([]));
    }

    /// A record exactly as version 1 builds wrote it loads, open to any host.
    #[test]
    fn version_1_volume_records_load_as_open() {
        let bytes = br#"{"version":1,"id":7,"name":"db-1","size_bytes":1073741824,"uuid":[9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9],"created_unix_ms":1700000000000,"chunks":[[0,1],[3,4000000000]]}"#;
        assert_eq!(decode_volume("db-1", bytes).unwrap(), uncompressed_volume());
        let bad_name = br#"{"version":1,"id":7,"name":"db-2","size_bytes":1,"uuid":[9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9],"created_unix_ms":1,"chunks":[]}"#;
        assert!(matches!(decode_volume("db-1", bad_name), Err(MetaError::RecordCorrupt { .. })));
    }

    /// A record exactly as version 2 builds wrote it loads, with no origin.
    #[test]
    fn version_2_volume_records_load_without_origin() {
        let bytes = br#"{"version":2,"id":7,"name":"db-1","size_bytes":1073741824,"uuid":[9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9],"created_unix_ms":1700000000000,"chunks":[[0,1],[3,4000000000]],"allow_any_host":false,"allowed_hosts":["nqn.a:host"]}"#;
        let expected = VolumeRecord {
            host_access: HostAccess::Restricted([nqn("nqn.a:host")].into()),
            ..uncompressed_volume()
        };
        assert_eq!(decode_volume("db-1", bytes).unwrap(), expected);
        // Version 2 knows no origin: one written into it is not read (and never was written).
        let mut value: serde_json::Value = serde_json::from_slice(bytes).unwrap();
        value["origin"] = serde_json::json!({"volume": "db-0", "snapshot": "s", "snapshot_id": 1});
        let decoded = decode_volume("db-1", &serde_json::to_vec(&value).unwrap()).unwrap();
        assert_eq!(decoded.origin, None);
    }

    /// A record exactly as version 3 builds wrote it loads with compression off: its volume's
    /// blocks were all written raw. A compression field written into it is not read.
    #[test]
    fn version_3_volume_records_load_uncompressed() {
        let bytes = br#"{"version":3,"id":7,"name":"db-1","size_bytes":1073741824,"uuid":[9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9],"created_unix_ms":1700000000000,"chunks":[[0,1],[3,4000000000]],"allow_any_host":true,"allowed_hosts":[],"origin":{"volume":"db-0","snapshot":"nightly","snapshot_id":5}}"#;
        let expected = VolumeRecord { origin: Some(origin()), ..uncompressed_volume() };
        assert_eq!(decode_volume("db-1", bytes).unwrap(), expected);
        let mut value: serde_json::Value = serde_json::from_slice(bytes).unwrap();
        value["compression"] = "zstd".into();
        let decoded = decode_volume("db-1", &serde_json::to_vec(&value).unwrap()).unwrap();
        assert_eq!(decoded.compression, Compression::Off);
    }

    /// Hand-set path states round-trip; a record without any is the bytes version 4 records
    /// always were (no `paths` field), so a build that knows no path states reads it alike.
    #[test]
    fn path_states_round_trip_and_layout() {
        let path_states = [(2, PathState::Inaccessible), (1, PathState::NonOptimized)].into();
        let record = VolumeRecord { path_states, ..volume() };
        let bytes = encode_volume(&record);
        assert_eq!(decode_volume("db-1", &bytes).unwrap(), record);
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(value["paths"], serde_json::json!([[1, "non-optimized"], [2, "inaccessible"]]));
        let plain: serde_json::Value = serde_json::from_slice(&encode_volume(&volume())).unwrap();
        assert!(!plain.as_object().unwrap().contains_key("paths"), "{plain}");
        for state in [PathState::NonOptimized, PathState::Inaccessible] {
            assert_eq!(PathState::from_name(state.name()), Some(state));
        }
        assert_eq!(PathState::from_name("optimized"), None, "optimized is not stored");
        assert_eq!(PathState::from_name("change"), None);
    }

    #[test]
    fn compression_names() {
        for compression in Compression::ALL {
            assert_eq!(Compression::from_name(compression.name()), Some(compression));
            assert_eq!(compression.to_string(), compression.name());
        }
        assert_eq!(Compression::default(), Compression::Lz4, "new volumes compress with lz4");
        assert_eq!(Compression::from_name("gzip"), None);
        assert_eq!(Compression::from_name(""), None);
    }

    #[test]
    fn snapshot_round_trip_and_layout() {
        let record = snapshot();
        let bytes = encode_snapshot(&record);
        assert_eq!(decode_snapshot("db-1", "nightly", &bytes).unwrap(), record);
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(value["version"], 1);
        assert_eq!(value["volume"], "db-1");
        assert_eq!(value["name"], "nightly");
        assert_eq!(value["size_bytes"], 1u64 << 30);
        assert_eq!(value["created_unix_ms"], 1_700_000_000_001u64);
        let exact = br#"{"version":1,"id":9,"volume":"db-1","name":"nightly","size_bytes":1073741824,"uuid":[4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4],"created_unix_ms":1700000000001}"#;
        assert_eq!(decode_snapshot("db-1", "nightly", exact).unwrap(), record);
        assert_eq!(
            snapshot_key(&record.volume, &record.name),
            "db-1@nightly",
            "the key users see in errors"
        );
    }

    #[test]
    fn corrupt_or_unknown_snapshot_records_are_refused() {
        let bytes = encode_snapshot(&snapshot());
        let check = |volume: &str, name: &str, bytes: &[u8]| {
            let error = decode_snapshot(volume, name, bytes).unwrap_err();
            assert!(matches!(error, MetaError::RecordCorrupt { .. }), "{volume}@{name}: {error}");
            assert!(error.to_string().contains(&format!("{volume}@{name}")), "{error}");
        };
        check("db-2", "nightly", &bytes);
        check("db-1", "weekly", &bytes);
        check("db-1", "nightly", b"");
        check("db-1", "nightly", br#"{"version":1,"id":9}"#);
        let mut value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        value["name"] = "Not A Name".into();
        check("db-1", "Not A Name", &serde_json::to_vec(&value).unwrap());
        value["name"] = "nightly".into();
        value["uuid"] = serde_json::json!([1, 2]);
        check("db-1", "nightly", &serde_json::to_vec(&value).unwrap());
        value["uuid"] = serde_json::to_value([4u8; 16]).unwrap();
        for version in [0, 2] {
            value["version"] = version.into();
            let bytes = serde_json::to_vec(&value).unwrap();
            assert!(matches!(
                decode_snapshot("db-1", "nightly", &bytes),
                Err(MetaError::RecordVersionUnsupported { supported: 1, .. })
            ));
        }
    }

    #[test]
    fn node_round_trip() {
        for external_drives in [false, true] {
            let record = NodeRecord {
                uuid: [1; 16],
                drive_count: 4,
                drive_size_bytes: 16 << 30,
                created_unix_ms: 5,
                external_drives,
            };
            let bytes = encode_node(&record);
            assert_eq!(decode_node("node", &bytes).unwrap(), record);
            let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(value["version"], 2);
            assert_eq!(value["external_drives"], external_drives);
        }
    }

    /// A node record exactly as version 1 builds wrote it loads, with drive files.
    #[test]
    fn version_1_node_records_load_with_drive_files() {
        let bytes = br#"{"version":1,"uuid":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"drive_count":4,"drive_size_bytes":17179869184,"created_unix_ms":5}"#;
        let expected = NodeRecord {
            uuid: [1; 16],
            drive_count: 4,
            drive_size_bytes: 16 << 30,
            created_unix_ms: 5,
            external_drives: false,
        };
        assert_eq!(decode_node("node", bytes).unwrap(), expected);
        let missing = br#"{"version":2,"uuid":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"drive_count":4,"drive_size_bytes":1,"created_unix_ms":5}"#;
        assert!(matches!(decode_node("node", missing), Err(MetaError::RecordCorrupt { .. })));
    }

    #[test]
    fn unknown_version_is_refused() {
        let mut value: serde_json::Value =
            serde_json::from_slice(&encode_volume(&volume())).unwrap();
        for version in [0, 5] {
            value["version"] = version.into();
            let bytes = serde_json::to_vec(&value).unwrap();
            let error = decode_volume("db-1", &bytes).unwrap_err();
            assert!(
                matches!(error, MetaError::RecordVersionUnsupported { supported: 4, .. }),
                "{error}"
            );
            assert!(error.to_string().contains(&format!("format version {version}")), "{error}");
        }
        value["version"] = 3.into();
        let bytes = serde_json::to_vec(&value).unwrap();
        assert!(matches!(
            decode_node("node", &bytes),
            Err(MetaError::RecordVersionUnsupported { version: 3, supported: 2, .. })
        ));
    }

    #[test]
    fn corrupt_records_are_refused() {
        let check = |key: &str, bytes: &[u8]| {
            let error = decode_volume(key, bytes).unwrap_err();
            assert!(matches!(error, MetaError::RecordCorrupt { .. }), "{key}: {error}");
        };
        check("db-1", b"");
        check("db-1", b"not json");
        check("db-1", br#"{"id":7}"#);
        check("db-1", br#"{"version":1,"id":7}"#);
        check("db-1", br#"{"version":2,"id":7}"#);
        check("db-1", br#"{"version":3,"id":7}"#);
        check("db-1", br#"{"version":4,"id":7}"#);
        check("db-2", &encode_volume(&volume()));
        let mut value: serde_json::Value =
            serde_json::from_slice(&encode_volume(&volume())).unwrap();
        value["name"] = "Not A Name".into();
        check("Not A Name", &serde_json::to_vec(&value).unwrap());
        value["name"] = "db-1".into();
        value["uuid"] = serde_json::json!([1, 2, 3]);
        check("db-1", &serde_json::to_vec(&value).unwrap());
        value["uuid"] = serde_json::to_value([9u8; 16]).unwrap();
        let mut check_hosts = |allow_any_host: bool, hosts: serde_json::Value| {
            value["allow_any_host"] = allow_any_host.into();
            value["allowed_hosts"] = hosts;
            check("db-1", &serde_json::to_vec(&value).unwrap());
        };
        check_hosts(true, serde_json::json!(["nqn.a:host"]));
        check_hosts(false, serde_json::json!(["not an nqn"]));
        check_hosts(false, serde_json::json!(["nqn.a:host", "nqn.a:host"]));
        check_hosts(false, serde_json::json!("nqn.a:host"));
        let too_many: Vec<String> =
            (0..=ALLOWED_HOSTS_MAX).map(|index| format!("nqn.host:{index}")).collect();
        check_hosts(false, serde_json::json!(too_many));

        // Version 4 always names a known compression.
        let mut value: serde_json::Value =
            serde_json::from_slice(&encode_volume(&volume())).unwrap();
        for compression in
            [serde_json::json!("gzip"), serde_json::json!("LZ4"), serde_json::json!(1)]
        {
            value["compression"] = compression;
            check("db-1", &serde_json::to_vec(&value).unwrap());
        }
        value.as_object_mut().unwrap().remove("compression");
        check("db-1", &serde_json::to_vec(&value).unwrap());

        // Version 4 always holds an origin, `null` or a valid one.
        let mut value: serde_json::Value =
            serde_json::from_slice(&encode_volume(&volume())).unwrap();
        value.as_object_mut().unwrap().remove("origin");
        check("db-1", &serde_json::to_vec(&value).unwrap());
        for origin in [
            serde_json::json!({"volume": "Bad Name", "snapshot": "s", "snapshot_id": 1}),
            serde_json::json!({"volume": "db-0", "snapshot": "", "snapshot_id": 1}),
            serde_json::json!({"volume": "db-0", "snapshot": "s"}),
            serde_json::json!("db-0@s"),
        ] {
            value["origin"] = origin;
            check("db-1", &serde_json::to_vec(&value).unwrap());
        }

        // Path states name a port other than 0 once each, with a state that may be set by hand.
        let mut value: serde_json::Value =
            serde_json::from_slice(&encode_volume(&volume())).unwrap();
        let too_many: Vec<(usize, &str)> =
            (1..=PATH_STATES_MAX + 1).map(|port| (port, "inaccessible")).collect();
        for paths in [
            serde_json::json!([[0, "inaccessible"]]),
            serde_json::json!([[1, "inaccessible"], [1, "non-optimized"]]),
            serde_json::json!([[1, "optimized"]]),
            serde_json::json!([[1, "change"]]),
            serde_json::json!([[70000, "inaccessible"]]),
            serde_json::json!([["1", "inaccessible"]]),
            serde_json::json!({"1": "inaccessible"}),
            serde_json::json!(too_many),
        ] {
            value["paths"] = paths;
            check("db-1", &serde_json::to_vec(&value).unwrap());
        }
    }

    fn replication_state() -> VolumeState {
        VolumeState {
            epoch: 3,
            primary: Some(NodeId(2)),
            primary_lease: LeaseId(7_587_869_330_866_211),
            in_sync: [NodeId(1), NodeId(2)].into(),
            members: [NodeId(1), NodeId(2), NodeId(3)].into(),
        }
    }

    #[test]
    fn replication_state_round_trip_and_layout() {
        let state = replication_state();
        let bytes = encode_replication_state(&state);
        assert_eq!(decode_replication_state("replication/7", &bytes).unwrap(), state);
        let exact = br#"{"version":1,"epoch":3,"primary":2,"primary_lease":7587869330866211,"in_sync":[1,2],"members":[1,2,3]}"#;
        assert_eq!(bytes, exact);
        let fresh = VolumeState {
            epoch: 0,
            primary: None,
            primary_lease: LeaseId::NONE,
            in_sync: BTreeSet::new(),
            members: BTreeSet::new(),
        };
        let bytes = encode_replication_state(&fresh);
        assert_eq!(decode_replication_state("replication/7", &bytes).unwrap(), fresh);

        let check = |bytes: &[u8]| {
            let error = decode_replication_state("replication/7", bytes).unwrap_err();
            assert!(matches!(error, MetaError::RecordCorrupt { .. }), "{error}");
        };
        check(b"");
        check(br#"{"version":1,"epoch":3}"#);
        check(br#"{"version":1,"epoch":3,"primary_lease":0,"in_sync":[],"members":[]}"#);
        check(br#"{"version":1,"epoch":3,"primary":null,"primary_lease":0,"in_sync":[1,1],"members":[]}"#);
        check(br#"{"version":1,"epoch":-1,"primary":null,"primary_lease":0,"in_sync":[],"members":[]}"#);
        assert!(matches!(
            decode_replication_state("replication/7", br#"{"version":2}"#),
            Err(MetaError::RecordVersionUnsupported { version: 2, supported: 1, .. })
        ));
    }

    fn member() -> MemberRecord {
        MemberRecord {
            name: "node-a".to_owned(),
            id: NodeId(1),
            replication_addr: "10.0.0.1:4480".to_owned(),
            nvme_addrs: vec!["10.0.0.1:4420".to_owned()],
            api_addr: "10.0.0.1:8080".to_owned(),
            nbd_addr: None,
            labels: [("zone".to_owned(), "a".to_owned())].into(),
            drive_count: 4,
            capacity_bytes: 64 << 30,
            free_bytes: 32 << 30,
            updated_unix_ms: 1_700_000_000_000,
        }
    }

    #[test]
    fn member_round_trip_and_layout() {
        let record = member();
        let bytes = encode_member(&record);
        assert_eq!(decode_member("node-a", &bytes).unwrap(), record);
        let exact = br#"{"version":1,"name":"node-a","id":1,"replication_addr":"10.0.0.1:4480","nvme_addrs":["10.0.0.1:4420"],"api_addr":"10.0.0.1:8080","nbd_addr":null,"labels":{"zone":"a"},"drive_count":4,"capacity_bytes":68719476736,"free_bytes":34359738368,"updated_unix_ms":1700000000000}"#;
        assert_eq!(bytes, exact);
        let with_nbd = MemberRecord { nbd_addr: Some("10.0.0.1:10809".to_owned()), ..member() };
        assert_eq!(decode_member("node-a", &encode_member(&with_nbd)).unwrap(), with_nbd);

        let check = |name: &str, bytes: &[u8]| {
            let error = decode_member(name, bytes).unwrap_err();
            assert!(matches!(error, MetaError::RecordCorrupt { .. }), "{name}: {error}");
        };
        check("node-b", &bytes);
        check("node-a", b"{}");
        let mut value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        value.as_object_mut().unwrap().remove("nbd_addr");
        check("node-a", &serde_json::to_vec(&value).unwrap());
        value["nbd_addr"] = serde_json::Value::Null;
        value["name"] = "bad name".into();
        check("bad name", &serde_json::to_vec(&value).unwrap());
        value["name"] = "node-a".into();
        value["api_addr"] = "".into();
        check("node-a", &serde_json::to_vec(&value).unwrap());
        value["api_addr"] = "10.0.0.1:8080".into();
        value["version"] = 2.into();
        assert!(matches!(
            decode_member("node-a", &serde_json::to_vec(&value).unwrap()),
            Err(MetaError::RecordVersionUnsupported { version: 2, supported: 1, .. })
        ));
    }

    #[test]
    fn lease_grants_round_trip_and_bounds() {
        let grants: Vec<(u64, LeaseId)> = (0..GRANTS_REMEMBERED_MAX as u64)
            .map(|index| ((1 << 32) | index, LeaseId(7_587_869_330_866_211 + index)))
            .collect();
        let bytes = encode_lease_grants(&grants);
        assert_eq!(decode_lease_grants("lease_grants/1", &bytes).unwrap(), grants);
        assert_eq!(
            encode_lease_grants(&grants[..1]),
            br#"{"version":1,"grants":[[4294967296,7587869330866211]]}"#
        );

        let check = |bytes: &[u8]| {
            let error = decode_lease_grants("lease_grants/1", bytes).unwrap_err();
            assert!(matches!(error, MetaError::RecordCorrupt { .. }), "{error}");
        };
        check(br#"{"version":1}"#);
        check(br#"{"version":1,"grants":[[1,0]]}"#);
        check(br#"{"version":1,"grants":[[1,9223372036854775808]]}"#);
        let too_many: Vec<(u64, u64)> =
            (0..=GRANTS_REMEMBERED_MAX as u64).map(|index| (index, index + 1)).collect();
        check(&serde_json::to_vec(&serde_json::json!({"version": 1, "grants": too_many})).unwrap());
        assert!(matches!(
            decode_lease_grants("lease_grants/1", br#"{"version":3,"grants":[]}"#),
            Err(MetaError::RecordVersionUnsupported { version: 3, .. })
        ));
    }
}
