//! The cluster's replication control state, membership and manager election, kept in etcd.
//!
//! The replication protocol (crate `replication`) is sans-IO: its state machines ask a control
//! store for a volume's state, compare-and-swaps and leases ([`StoreRequest`]) and take its
//! answers ([`StoreReply`]). [`ClusterStore`] is that store on etcd, the real backend of which
//! [`replication::MemStore`] is the in-memory reference: [`ClusterStore::handle`] answers every
//! request as `MemStore::handle` does, with etcd's clock and revisions in place of simulated
//! ones. The same store keeps the cluster's members (who they are, where to reach them, what
//! they hold) and elects the manager.
//!
//! Keys, below the cluster's prefix `P`; the cluster's [`crate::EtcdStore`] may use the same
//! prefix at the same time, for its volume records, under other keys:
//!
//! | key | value |
//! |---|---|
//! | `P/replication/<volume id>` | replication state record ([`crate::record`]) |
//! | `P/leases/<lease id>` | the holder's node id, decimal (`"3"`); attached to the etcd lease |
//! | `P/lease_grants/<node id>` | lease grants record: the node's last grants, by nonce |
//! | `P/members/<name>` | member record |
//! | `P/next_node_id` | the next node id to give, decimal |
//! | `P/manager` | the manager's node id, decimal; attached to the manager's lease |
//!
//! How the protocol's store maps onto etcd:
//! - A volume's version is its key's `mod_revision`. Versions grow with every change, but not by
//!   one as `MemStore`'s do: they are etcd revisions, shared with every other key.
//! - A [`LeaseId`] is an etcd lease id (positive `i64`). A lease is live exactly while its key
//!   `P/leases/<id>` exists: the key is attached to the lease, so etcd deletes it when it
//!   revokes the expired lease. `LeaseId::NONE` (0) is never an etcd lease id, so never live.
//! - A compare-and-swap is one transaction: the volume key's `mod_revision` must equal the
//!   expected version, the key of a lease required live must exist (`create_revision > 0`), the
//!   key of one required not live must not (`create_revision == 0`). When a compare fails, the
//!   same transaction reads those keys, so the reply names the condition that failed at that
//!   revision, checked in `MemStore`'s order: version, then live, then not live.
//! - `Snapshot` reads the volume and every lease key in one read-only transaction: one revision.
//! - `KeepAlive` renews a lease that is live and held by the asking node with one exchange on
//!   etcd's keep-alive stream (a lease already past its TTL is not renewed: etcd answers TTL 0).
//!   Otherwise it grants a lease, idempotently per (node, nonce), as `MemStore` does: the
//!   node's grants record remembers its last [`GRANTS_REMEMBERED_MAX`] nonces and their leases,
//!   and a nonce found there is answered with its lease, live or not. A new grant asks etcd for
//!   a lease (etcd picks the id), then one transaction, guarded by the grants record's
//!   `mod_revision`, records the grant and puts the lease key; a grant that lost that race to a
//!   duplicate is revoked and the duplicate's lease returned. Ids are picked by etcd, not derived
//!   from (node, nonce): a derived id would let a late duplicate of a forgotten grant re-create
//!   an expired lease under its old id, and the protocol needs that an expired lease is never
//!   live again. etcd makes ids of its member id, its start time and a counter,
//!   so it does not reuse them.
//! - The lease TTL is given at connect and rounded up to whole seconds, at least 1 s (etcd's
//!   unit). etcd lengthens it further: a TTL below its minimum (1.5 election timeouts, so 2 s
//!   with default settings) is raised to it, expired leases are revoked by a check every 500 ms,
//!   and a new etcd leader extends every lease. Every one of these makes the store's lease end
//!   later than asked, which is the safe direction: the protocol needs the store's lease to end
//!   no earlier than its holder believes (`replication::Config::lease_ms` at most the TTL).
//!
//! Members get node ids from a counter (from 1, never reused, not even for a name removed and
//! registered again). The manager is whoever created `P/manager`, attached to its lease: the
//! role is free again when that lease expires.
//!
//! Every method is synchronous and bounded by the store's timeout, callable from any thread
//! (inside tokio too), like [`crate::EtcdStore`], whose private-runtime pattern this follows.

use crate::etcd::{
    check_settings, contention, get_one, header_revision, run, start_runtime, CallResult,
    RESPONSE_BYTES_MAX,
};
use crate::record::{
    decode_lease_grants, decode_member, decode_replication_state, encode_lease_grants,
    encode_member, encode_replication_state, is_etcd_lease_id,
};
use crate::{MetaError, CAS_ATTEMPTS_MAX};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, GetResponse, KeyValue, KvClient,
    LeaseClient, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use replication::store::GRANTS_REMEMBERED_MAX;
use replication::{
    CasFailure, LeaseId, LeaseInfo, NodeId, StoreReply, StoreRequest, Versioned, VolumeState,
};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;
use tokio::runtime::Runtime;

/// The longest lease TTL accepted. A lease is a failure detector: hours would keep a dead
/// node's volumes unserved that long.
pub const LEASE_TTL_MAX: Duration = Duration::from_secs(3600);
/// The longest member name; names are `[A-Za-z0-9._-]`, at least one character.
pub const MEMBER_NAME_LENGTH_MAX: usize = 64;
/// The most labels (failure domains: `zone`, `rack`, ...) one member has.
pub const MEMBER_LABELS_MAX: usize = 32;
/// The longest label key or value.
pub const MEMBER_LABEL_LENGTH_MAX: usize = 128;
/// The most NVMe/TCP addresses one member announces.
pub const MEMBER_NVME_ADDRS_MAX: usize = 16;
/// The longest address a member announces (`host:port`, a DNS name or an IPv6 literal).
pub const MEMBER_ADDR_LENGTH_MAX: usize = 256;

/// Node ids start at 1 so that 0 never names a member.
const FIRST_NODE_ID: u32 = 1;

const REPLICATION_DIR: &str = "/replication/";
const LEASES_DIR: &str = "/leases/";
const LEASE_GRANTS_DIR: &str = "/lease_grants/";
const MEMBERS_DIR: &str = "/members/";
const NEXT_NODE_ID_KEY: &str = "/next_node_id";
const MANAGER_KEY: &str = "/manager";

/// One node of the cluster, as it announces itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberRecord {
    /// Unique in the cluster, chosen by the operator: 1 to [`MEMBER_NAME_LENGTH_MAX`]
    /// characters of `[A-Za-z0-9._-]`.
    pub name: String,
    /// Given by [`ClusterStore::register_member`]; the protocol's name for the node.
    pub id: NodeId,
    /// Where other nodes send replication traffic (`host:port`).
    pub replication_addr: String,
    /// Where hosts connect over NVMe/TCP; at most [`MEMBER_NVME_ADDRS_MAX`].
    pub nvme_addrs: Vec<String>,
    /// The node's REST API (`host:port`).
    pub api_addr: String,
    /// The node's NBD server, if it runs one.
    pub nbd_addr: Option<String>,
    /// Failure domains and other placement facts (`zone=a`); at most [`MEMBER_LABELS_MAX`].
    pub labels: BTreeMap<String, String>,
    pub drive_count: u16,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    /// When the node last refreshed this record, by its own clock.
    pub updated_unix_ms: u64,
}

impl MemberRecord {
    /// Checks the record's bounds and name; the error says what is wrong. The id is not
    /// checked: registration assigns it.
    pub fn check(&self) -> Result<(), String> {
        if !member_name_valid(&self.name) {
            return Err(format!(
                "a member name is 1 to {MEMBER_NAME_LENGTH_MAX} characters of A-Z, a-z, 0-9, \
                 '.', '_' and '-'"
            ));
        }
        if self.nvme_addrs.len() > MEMBER_NVME_ADDRS_MAX {
            return Err(format!(
                "{} NVMe/TCP addresses, more than {MEMBER_NVME_ADDRS_MAX}",
                self.nvme_addrs.len()
            ));
        }
        let addrs = [&self.replication_addr, &self.api_addr]
            .into_iter()
            .chain(&self.nvme_addrs)
            .chain(&self.nbd_addr);
        for addr in addrs {
            if addr.is_empty() || addr.len() > MEMBER_ADDR_LENGTH_MAX {
                return Err(format!(
                    "address {addr:?} is empty or longer than {MEMBER_ADDR_LENGTH_MAX} bytes"
                ));
            }
        }
        if self.labels.len() > MEMBER_LABELS_MAX {
            return Err(format!("{} labels, more than {MEMBER_LABELS_MAX}", self.labels.len()));
        }
        for (key, value) in &self.labels {
            if key.is_empty()
                || key.len() > MEMBER_LABEL_LENGTH_MAX
                || value.len() > MEMBER_LABEL_LENGTH_MAX
            {
                return Err(format!(
                    "label {key:?}={value:?}: keys are 1 and values 0 to \
                     {MEMBER_LABEL_LENGTH_MAX} bytes"
                ));
            }
        }
        Ok(())
    }
}

/// Whether `name` is a valid member name (1 to [`MEMBER_NAME_LENGTH_MAX`] of `[A-Za-z0-9._-]`).
pub fn member_name_valid(name: &str) -> bool {
    (1..=MEMBER_NAME_LENGTH_MAX).contains(&name.len())
        && name.bytes().all(|byte| byte.is_ascii_alphanumeric() || b"._-".contains(&byte))
}

/// A cluster's replication control state, members and manager, kept in etcd.
pub struct ClusterStore {
    /// Runs every etcd request; `None` only while the store is dropped.
    runtime: Option<Runtime>,
    kv: KvClient,
    lease: LeaseClient,
    keys: Keys,
    /// The endpoints as given, for error messages.
    endpoints: String,
    timeout: Duration,
    lease_ttl_s: i64,
}

/// The full etcd keys of one cluster's control state.
#[derive(Clone)]
struct Keys {
    prefix: String,
}

impl Keys {
    fn replication_dir(&self) -> String {
        format!("{}{REPLICATION_DIR}", self.prefix)
    }

    fn replication(&self, volume_id: u64) -> String {
        format!("{}{REPLICATION_DIR}{volume_id}", self.prefix)
    }

    fn leases_dir(&self) -> String {
        format!("{}{LEASES_DIR}", self.prefix)
    }

    fn lease(&self, lease: LeaseId) -> String {
        format!("{}{LEASES_DIR}{}", self.prefix, lease.0)
    }

    fn lease_grants(&self, node: NodeId) -> String {
        format!("{}{LEASE_GRANTS_DIR}{}", self.prefix, node.0)
    }

    fn members_dir(&self) -> String {
        format!("{}{MEMBERS_DIR}", self.prefix)
    }

    fn member(&self, name: &str) -> String {
        format!("{}{MEMBERS_DIR}{name}", self.prefix)
    }

    fn next_node_id(&self) -> String {
        format!("{}{NEXT_NODE_ID_KEY}", self.prefix)
    }

    fn manager(&self) -> String {
        format!("{}{MANAGER_KEY}", self.prefix)
    }

    /// A key without the prefix and its slash (`replication/7`), for error messages.
    fn relative(&self, key: &[u8]) -> String {
        let key = key.strip_prefix(self.prefix.as_bytes()).unwrap_or(key);
        let key = key.strip_prefix(b"/").unwrap_or(key);
        String::from_utf8_lossy(key).into_owned()
    }
}

/// Handles to etcd and the settings one call needs.
struct Clients {
    kv: KvClient,
    lease: LeaseClient,
    keys: Keys,
    lease_ttl_s: i64,
}

impl ClusterStore {
    /// Connects to the etcd cluster at `endpoints` and uses the keys below `prefix`, with the
    /// same rules as [`crate::EtcdStore::connect`]. Every call is bounded by `timeout`. Leases
    /// are granted for `lease_ttl` rounded up to whole seconds (at least 1 s, at most
    /// [`LEASE_TTL_MAX`]); see the module comment for how etcd lengthens it.
    pub fn connect(
        endpoints: &[String],
        prefix: &str,
        timeout: Duration,
        lease_ttl: Duration,
    ) -> Result<Self, MetaError> {
        check_settings(endpoints, prefix, timeout)?;
        if lease_ttl.is_zero() || lease_ttl > LEASE_TTL_MAX {
            return Err(MetaError::Config {
                detail: format!(
                    "the lease TTL {} ms must be above zero and at most {} s",
                    lease_ttl.as_millis(),
                    LEASE_TTL_MAX.as_secs()
                ),
            });
        }
        let lease_ttl_s = ttl_seconds(lease_ttl);
        let runtime = start_runtime("meta-cluster")?;
        let keys = Keys { prefix: prefix.to_owned() };
        let endpoints_text = endpoints.join(",");
        let options = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
        let endpoints = endpoints.to_vec();
        let manager_key = keys.manager();
        // As in `EtcdStore::connect`: created in the store's runtime, and a first read proves
        // that etcd answers and has a quorum.
        let (kv, lease) = run(&runtime, timeout, &endpoints_text, async move {
            let client = Client::connect(endpoints, Some(options)).await?;
            let mut kv = client.kv_client().max_decoding_message_size(RESPONSE_BYTES_MAX);
            kv.get(manager_key, None).await?;
            Ok((kv, client.lease_client()))
        })?;
        Ok(Self {
            runtime: Some(runtime),
            kv,
            lease,
            keys,
            endpoints: endpoints_text,
            timeout,
            lease_ttl_s,
        })
    }

    /// The key prefix this store keeps its records under.
    pub fn prefix(&self) -> &str {
        &self.keys.prefix
    }

    /// The TTL leases are granted with: the one given at connect, rounded up to whole seconds.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_s.unsigned_abs())
    }

    /// Answers one request of the replication protocol about volume `volume_id`, exactly as
    /// [`replication::MemStore::handle`] does (see the module comment). Fails with
    /// [`MetaError::ReplicationStateMissing`] when a request needs the volume's state and the
    /// store has none.
    pub fn handle(&self, volume_id: u64, request: &StoreRequest) -> Result<StoreReply, MetaError> {
        self.handle_within(volume_id, request, self.timeout)
    }

    /// [`Self::handle`], bounded by `timeout` (at most the store's own) instead of the store's
    /// timeout: for a caller that gives up on an answer sooner, such as a lease keeper that
    /// sends a fresh renewal after its own timeout, so a call stuck on a lost connection does
    /// not hold up the next one.
    pub fn handle_within(
        &self,
        volume_id: u64,
        request: &StoreRequest,
        timeout: Duration,
    ) -> Result<StoreReply, MetaError> {
        let timeout = timeout.min(self.timeout);
        match request.clone() {
            StoreRequest::Get => self.call_within(timeout, move |mut clients| async move {
                let key = clients.keys.replication(volume_id);
                let Some(entry) = get_one(&mut clients.kv, &key).await? else {
                    return Err(MetaError::ReplicationStateMissing { volume_id }.into());
                };
                Ok(StoreReply::Volume(decode_volume_entry(&clients.keys, &entry)?))
            }),
            StoreRequest::Snapshot => self.call_within(timeout, move |clients| async move {
                snapshot(clients, volume_id).await
            }),
            StoreRequest::Cas { expected_version, new, require_live, require_not_live } => {
                let cas = Cas { volume_id, expected_version, new, require_live, require_not_live };
                self.call_within(timeout, move |clients| async move { cas.run(clients).await })
            }
            StoreRequest::KeepAlive { node, lease, nonce } => {
                self.call_within(timeout, move |mut clients| async move {
                    if let Some(lease) = lease {
                        if renew(&mut clients, node, lease).await? {
                            return Ok(StoreReply::Lease { lease });
                        }
                    }
                    let lease = grant(&mut clients, node, nonce).await?;
                    Ok(StoreReply::Lease { lease })
                })
            }
        }
    }

    /// Stores the first replication state of volume `volume_id`; returns its version. Fails
    /// with [`MetaError::ReplicationStateExists`] if the volume has one.
    pub fn create_replication_state(
        &self,
        volume_id: u64,
        initial: &VolumeState,
    ) -> Result<u64, MetaError> {
        let bytes = encode_replication_state(initial);
        self.call(move |mut clients| async move {
            let key = clients.keys.replication(volume_id);
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key.as_str(), bytes, None)]);
            let response = clients.kv.txn(txn).await?;
            if !response.succeeded() {
                return Err(MetaError::ReplicationStateExists { volume_id }.into());
            }
            Ok(header_revision(&response)?)
        })
    }

    /// Deletes volume `volume_id`'s replication state. Fails with
    /// [`MetaError::ReplicationStateMissing`] if it has none.
    pub fn delete_replication_state(&self, volume_id: u64) -> Result<(), MetaError> {
        self.call(move |mut clients| async move {
            let response = clients.kv.delete(clients.keys.replication(volume_id), None).await?;
            if response.deleted() == 0 {
                return Err(MetaError::ReplicationStateMissing { volume_id }.into());
            }
            Ok(())
        })
    }

    /// Every volume's replication state, sorted by volume id.
    pub fn replication_states(&self) -> Result<Vec<(u64, Versioned<VolumeState>)>, MetaError> {
        self.call(|mut clients| async move {
            let dir = clients.keys.replication_dir();
            let response =
                clients.kv.get(dir.as_str(), Some(GetOptions::new().with_prefix())).await?;
            let mut states = Vec::with_capacity(response.kvs().len());
            for entry in response.kvs() {
                let id_text = entry.key().strip_prefix(dir.as_bytes()).unwrap_or(entry.key());
                let volume_id = parse_decimal(&clients.keys.relative(entry.key()), id_text)?;
                states.push((volume_id, decode_volume_entry(&clients.keys, entry)?));
            }
            states.sort_by_key(|(volume_id, _)| *volume_id);
            Ok(states)
        })
    }

    /// Every live lease and its holder, sorted by lease id.
    pub fn live_leases(&self) -> Result<Vec<LeaseInfo>, MetaError> {
        self.call(|mut clients| async move {
            let dir = clients.keys.leases_dir();
            let response = clients.kv.get(dir, Some(GetOptions::new().with_prefix())).await?;
            Ok(decode_leases(&clients.keys, response.kvs())?)
        })
    }

    /// Registers a member, or registers it again (a node restarting, with new addresses): a
    /// name already registered keeps its id, a new name gets the next id (from 1). The record
    /// is stored as given, with that id in place of `record.id`; returns the id.
    pub fn register_member(&self, record: MemberRecord) -> Result<NodeId, MetaError> {
        record.check().map_err(|detail| member_invalid(&record.name, detail))?;
        self.call(move |mut clients| async move {
            let key = clients.keys.member(&record.name);
            for _attempt in 0..CAS_ATTEMPTS_MAX {
                if let Some(entry) = get_one(&mut clients.kv, &key).await? {
                    let id = decode_member(&record.name, entry.value())?.id;
                    let stored = MemberRecord { id, ..record.clone() };
                    let txn = Txn::new()
                        .when([Compare::mod_revision(
                            key.as_str(),
                            CompareOp::Equal,
                            entry.mod_revision(),
                        )])
                        .and_then([TxnOp::put(key.as_str(), encode_member(&stored), None)]);
                    if clients.kv.txn(txn).await?.succeeded() {
                        return Ok(id);
                    }
                    continue;
                }
                let (next, counter_revision) = read_next_node_id(&mut clients).await?;
                let after = next.checked_add(1).ok_or_else(|| MetaError::Backend {
                    detail: "node ids are exhausted".to_owned(),
                })?;
                let id = NodeId(next);
                let stored = MemberRecord { id, ..record.clone() };
                let counter = clients.keys.next_node_id();
                // A key never written, or deleted, has `mod_revision` 0.
                let txn = Txn::new()
                    .when([
                        Compare::mod_revision(key.as_str(), CompareOp::Equal, 0),
                        Compare::mod_revision(counter.as_str(), CompareOp::Equal, counter_revision),
                    ])
                    .and_then([
                        TxnOp::put(counter.as_str(), after.to_string(), None),
                        TxnOp::put(key.as_str(), encode_member(&stored), None),
                    ]);
                if clients.kv.txn(txn).await?.succeeded() {
                    return Ok(id);
                }
            }
            Err(contention(&format!("registering member {:?}", record.name)))
        })
    }

    /// Replaces a member's record (a refresh of its capacity, say). Fails with
    /// [`MetaError::MemberNotFound`] unless a member of this name and this id is registered.
    pub fn update_member(&self, record: &MemberRecord) -> Result<(), MetaError> {
        record.check().map_err(|detail| member_invalid(&record.name, detail))?;
        let record = record.clone();
        self.call(move |mut clients| async move {
            let key = clients.keys.member(&record.name);
            for _attempt in 0..CAS_ATTEMPTS_MAX {
                let current = get_one(&mut clients.kv, &key).await?;
                let current_id = current
                    .as_ref()
                    .map(|entry| decode_member(&record.name, entry.value()))
                    .transpose()?
                    .map(|member| member.id);
                let Some(entry) = current.filter(|_| current_id == Some(record.id)) else {
                    return Err(MetaError::MemberNotFound { name: record.name }.into());
                };
                let txn = Txn::new()
                    .when([Compare::mod_revision(
                        key.as_str(),
                        CompareOp::Equal,
                        entry.mod_revision(),
                    )])
                    .and_then([TxnOp::put(key.as_str(), encode_member(&record), None)]);
                if clients.kv.txn(txn).await?.succeeded() {
                    return Ok(());
                }
            }
            Err(contention(&format!("updating member {:?}", record.name)))
        })
    }

    /// Every member, sorted by name, and whether it holds a live lease, read at one revision.
    pub fn members(&self) -> Result<Vec<(MemberRecord, bool)>, MetaError> {
        self.call(|mut clients| async move {
            let members_dir = clients.keys.members_dir();
            let sorted =
                GetOptions::new().with_prefix().with_sort(SortTarget::Key, SortOrder::Ascend);
            let txn = Txn::new().and_then([
                TxnOp::get(members_dir.as_str(), Some(sorted)),
                TxnOp::get(clients.keys.leases_dir(), Some(GetOptions::new().with_prefix())),
            ]);
            let response = clients.kv.txn(txn).await?;
            let [members, leases] = txn_gets(&response)?;
            let live: BTreeSet<NodeId> =
                decode_leases(&clients.keys, leases.kvs())?.iter().map(|info| info.node).collect();
            let mut records = Vec::with_capacity(members.kvs().len());
            for entry in members.kvs() {
                let name = entry.key().strip_prefix(members_dir.as_bytes()).unwrap_or(entry.key());
                let record = decode_member(&String::from_utf8_lossy(name), entry.value())?;
                let holds_lease = live.contains(&record.id);
                records.push((record, holds_lease));
            }
            records.sort_by(|(a, _), (b, _)| a.name.cmp(&b.name));
            Ok(records)
        })
    }

    /// Forgets a member. Its id is not given again: registering the name anew gives a new id.
    /// Fails with [`MetaError::MemberNotFound`] if no member has this name.
    pub fn remove_member(&self, name: &str) -> Result<(), MetaError> {
        if !member_name_valid(name) {
            return Err(MetaError::MemberNotFound { name: name.to_owned() });
        }
        let name = name.to_owned();
        self.call(move |mut clients| async move {
            let response = clients.kv.delete(clients.keys.member(&name), None).await?;
            if response.deleted() == 0 {
                return Err(MetaError::MemberNotFound { name }.into());
            }
            Ok(())
        })
    }

    /// Campaigns for the manager's role: `node` becomes manager if nobody is, for as long as
    /// `lease` lives. Returns the manager now (`node` if it won or already was). Fails with
    /// [`MetaError::LeaseNotHeld`] if nobody is manager and `lease` is not a live lease of
    /// `node`.
    pub fn campaign(&self, node: NodeId, lease: LeaseId) -> Result<NodeId, MetaError> {
        self.call(move |mut clients| async move {
            let manager = clients.keys.manager();
            if let Some(etcd_lease) = etcd_lease_id(lease) {
                // The lease key names `node` only while the lease lives: the put cannot outlive
                // the check, both being in one transaction.
                let txn = Txn::new()
                    .when([
                        Compare::create_revision(manager.as_str(), CompareOp::Equal, 0),
                        Compare::value(
                            clients.keys.lease(lease),
                            CompareOp::Equal,
                            node_text(node),
                        ),
                    ])
                    .and_then([TxnOp::put(
                        manager.as_str(),
                        node_text(node),
                        Some(PutOptions::new().with_lease(etcd_lease)),
                    )]);
                if clients.kv.txn(txn).await?.succeeded() {
                    return Ok(node);
                }
            }
            match get_one(&mut clients.kv, &manager).await? {
                Some(entry) => Ok(decode_node_id(&clients.keys, &entry)?),
                None => Err(MetaError::LeaseNotHeld { node, lease: lease.0 }.into()),
            }
        })
    }

    /// The manager now, if any.
    pub fn manager(&self) -> Result<Option<NodeId>, MetaError> {
        self.call(|mut clients| async move {
            let entry = get_one(&mut clients.kv, &clients.keys.manager()).await?;
            Ok(entry.map(|entry| decode_node_id(&clients.keys, &entry)).transpose()?)
        })
    }

    /// Runs `operation` on the store's runtime and waits for it, at most the store's timeout.
    fn call<T, F, Fut>(&self, operation: F) -> Result<T, MetaError>
    where
        F: FnOnce(Clients) -> Fut,
        Fut: Future<Output = CallResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        self.call_within(self.timeout, operation)
    }

    /// [`Self::call`], bounded by `timeout` instead of the store's timeout.
    fn call_within<T, F, Fut>(&self, timeout: Duration, operation: F) -> Result<T, MetaError>
    where
        F: FnOnce(Clients) -> Fut,
        Fut: Future<Output = CallResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        let runtime = self.runtime.as_ref().expect("the runtime lives as long as the store");
        let clients = Clients {
            kv: self.kv.clone(),
            lease: self.lease.clone(),
            keys: self.keys.clone(),
            lease_ttl_s: self.lease_ttl_s,
        };
        run(runtime, timeout, &self.endpoints, operation(clients))
    }
}

impl Drop for ClusterStore {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // As in `EtcdStore`: does not wait, so the store can be dropped inside a runtime.
            runtime.shutdown_background();
        }
    }
}

/// `ttl` in whole seconds, rounded up, at least 1.
fn ttl_seconds(ttl: Duration) -> i64 {
    assert!(ttl <= LEASE_TTL_MAX, "the TTL was checked at connect");
    let seconds = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(seconds.max(1)).expect("at most LEASE_TTL_MAX seconds")
}

/// The etcd id of `lease`, if it can be one (etcd's ids are positive `i64`s).
fn etcd_lease_id(lease: LeaseId) -> Option<i64> {
    if is_etcd_lease_id(lease.0) {
        i64::try_from(lease.0).ok()
    } else {
        None
    }
}

/// The stored form of a node id: decimal ASCII.
fn node_text(node: NodeId) -> String {
    node.0.to_string()
}

fn parse_decimal<T: std::str::FromStr>(key: &str, bytes: &[u8]) -> Result<T, MetaError> {
    let corrupt = |detail: String| MetaError::RecordCorrupt { key: key.to_owned(), detail };
    let text = std::str::from_utf8(bytes).map_err(|_| corrupt("it is not text".to_owned()))?;
    // `parse` accepts a leading '+'; the store never writes one.
    if text.starts_with('+') {
        return Err(corrupt(format!("{text:?} is not a decimal number")));
    }
    text.parse().map_err(|_| corrupt(format!("{text:?} is not a decimal number")))
}

/// The node id stored as the value of `entry` (a lease key or the manager key).
fn decode_node_id(keys: &Keys, entry: &KeyValue) -> Result<NodeId, MetaError> {
    parse_decimal(&keys.relative(entry.key()), entry.value()).map(NodeId)
}

fn revision(keys: &Keys, entry: &KeyValue) -> Result<u64, MetaError> {
    u64::try_from(entry.mod_revision()).map_err(|_| MetaError::Backend {
        detail: format!(
            "etcd reported a negative revision {} for {}",
            entry.mod_revision(),
            keys.relative(entry.key())
        ),
    })
}

fn decode_volume_entry(keys: &Keys, entry: &KeyValue) -> Result<Versioned<VolumeState>, MetaError> {
    let value = decode_replication_state(&keys.relative(entry.key()), entry.value())?;
    Ok(Versioned { version: revision(keys, entry)?, value })
}

/// The leases named by lease keys, sorted by lease id.
fn decode_leases(keys: &Keys, entries: &[KeyValue]) -> Result<Vec<LeaseInfo>, MetaError> {
    let dir = keys.leases_dir();
    let mut leases = Vec::with_capacity(entries.len());
    for entry in entries {
        let key = keys.relative(entry.key());
        let id_text = entry.key().strip_prefix(dir.as_bytes()).unwrap_or(entry.key());
        let lease = LeaseId(parse_decimal(&key, id_text)?);
        leases.push(LeaseInfo { lease, node: decode_node_id(keys, entry)? });
    }
    leases.sort_by_key(|info| info.lease);
    Ok(leases)
}

/// The answers of a transaction's reads, which must be exactly `N` gets.
fn txn_gets<const N: usize>(response: &TxnResponse) -> Result<[GetResponse; N], MetaError> {
    let unexpected = |detail: String| MetaError::Backend {
        detail: format!("etcd answered a transaction's reads with {detail}"),
    };
    let mut gets = Vec::with_capacity(N);
    for answer in response.op_responses() {
        match answer {
            TxnOpResponse::Get(get) => gets.push(get),
            other => return Err(unexpected(format!("{other:?}"))),
        }
    }
    let count = gets.len();
    gets.try_into().map_err(|_| unexpected(format!("{count} answers for {N} reads")))
}

async fn snapshot(mut clients: Clients, volume_id: u64) -> CallResult<StoreReply> {
    let txn = Txn::new().and_then([
        TxnOp::get(clients.keys.replication(volume_id), None),
        TxnOp::get(clients.keys.leases_dir(), Some(GetOptions::new().with_prefix())),
    ]);
    let response = clients.kv.txn(txn).await?;
    let [volume, leases] = txn_gets(&response)?;
    let Some(entry) = volume.kvs().first() else {
        return Err(MetaError::ReplicationStateMissing { volume_id }.into());
    };
    Ok(StoreReply::Snapshot {
        volume: decode_volume_entry(&clients.keys, entry)?,
        leases: decode_leases(&clients.keys, leases.kvs())?,
    })
}

/// A compare-and-swap of one volume's state (see the module comment).
struct Cas {
    volume_id: u64,
    expected_version: u64,
    new: VolumeState,
    require_live: Option<LeaseId>,
    require_not_live: Option<LeaseId>,
}

impl Cas {
    async fn run(self, mut clients: Clients) -> CallResult<StoreReply> {
        let keys = &clients.keys;
        let key = keys.replication(self.volume_id);
        // A version beyond `i64` is no etcd revision: -1 never equals one, so it mismatches.
        let expected = i64::try_from(self.expected_version).unwrap_or(-1);
        let mut compares = vec![
            // The key exists: a missing key's `mod_revision` 0 must not match version 0.
            Compare::version(key.as_str(), CompareOp::Greater, 0),
            Compare::mod_revision(key.as_str(), CompareOp::Equal, expected),
        ];
        let mut reads = vec![TxnOp::get(key.as_str(), None)];
        let count_only = || Some(GetOptions::new().with_count_only());
        if let Some(lease) = self.require_live {
            compares.push(Compare::create_revision(keys.lease(lease), CompareOp::Greater, 0));
            reads.push(TxnOp::get(keys.lease(lease), count_only()));
        }
        if let Some(lease) = self.require_not_live {
            compares.push(Compare::create_revision(keys.lease(lease), CompareOp::Equal, 0));
            reads.push(TxnOp::get(keys.lease(lease), count_only()));
        }
        let put = TxnOp::put(key.as_str(), encode_replication_state(&self.new), None);
        let txn = Txn::new().when(compares).and_then([put]).or_else(reads);
        let response = clients.kv.txn(txn).await?;
        if response.succeeded() {
            // The put is the transaction's only write, so its revision is the key's new one.
            let version = header_revision(&response)?;
            return Ok(StoreReply::CasDone(Versioned { version, value: self.new }));
        }

        let mut answers = Vec::new();
        for answer in response.op_responses() {
            match answer {
                TxnOpResponse::Get(get) => answers.push(get),
                other => {
                    return Err(MetaError::Backend {
                        detail: format!("etcd answered a failed compare-and-swap with {other:?}"),
                    }
                    .into())
                }
            }
        }
        let mut answers = answers.into_iter();
        let volume = answers.next();
        let Some(entry) = volume.as_ref().and_then(|volume| volume.kvs().first()) else {
            return Err(MetaError::ReplicationStateMissing { volume_id: self.volume_id }.into());
        };
        let current = decode_volume_entry(&clients.keys, entry)?;
        let mut lease_exists = || answers.next().map(|get| get.count() > 0);
        let live_exists = self.require_live.and_then(|_| lease_exists());
        let not_live_exists = self.require_not_live.and_then(|_| lease_exists());
        let reason = if current.version != self.expected_version {
            CasFailure::VersionMismatch
        } else if live_exists == Some(false) {
            CasFailure::LeaseNotLive
        } else if not_live_exists == Some(true) {
            CasFailure::LeaseLive
        } else {
            return Err(MetaError::Backend {
                detail: format!(
                    "etcd refused a compare-and-swap of volume {} whose conditions held",
                    self.volume_id
                ),
            }
            .into());
        };
        Ok(StoreReply::CasFailed { current, reason })
    }
}

/// Renews `lease` if it is live and held by `node`; whether it did.
async fn renew(clients: &mut Clients, node: NodeId, lease: LeaseId) -> CallResult<bool> {
    let Some(etcd_lease) = etcd_lease_id(lease) else {
        return Ok(false);
    };
    let Some(entry) = get_one(&mut clients.kv, &clients.keys.lease(lease)).await? else {
        return Ok(false);
    };
    if entry.lease() != etcd_lease || decode_node_id(&clients.keys, &entry)? != node {
        return Ok(false);
    }
    // One exchange on the keep-alive stream: the client sends one request and reads one
    // answer, and refuses an answer with TTL 0 (expired, or revoked) as "lease not found".
    // Dropping the keeper and the stream ends the stream.
    match clients.lease.keep_alive(etcd_lease).await {
        Ok((_keeper, _stream)) => Ok(true),
        // Not renewed; a new grant is always safe.
        Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(false),
        Err(error) => Err(error.into()),
    }
}

/// Grants `node` a lease for `nonce`, or answers with the lease granted for it before.
async fn grant(clients: &mut Clients, node: NodeId, nonce: u64) -> CallResult<LeaseId> {
    let grants_key = clients.keys.lease_grants(node);
    for _attempt in 0..CAS_ATTEMPTS_MAX {
        let current = get_one(&mut clients.kv, &grants_key).await?;
        let (mut grants, grants_revision) = match &current {
            Some(entry) => (
                decode_lease_grants(&clients.keys.relative(entry.key()), entry.value())?,
                entry.mod_revision(),
            ),
            None => (Vec::new(), 0),
        };
        if let Some(&(_, lease)) = grants.iter().find(|(seen, _)| *seen == nonce) {
            return Ok(lease);
        }
        let granted = clients.lease.grant(clients.lease_ttl_s, None).await?;
        let etcd_lease = granted_lease_id(granted.id(), granted.ttl(), granted.error())?;
        let lease = LeaseId(etcd_lease.unsigned_abs());
        if grants.len() == GRANTS_REMEMBERED_MAX {
            grants.remove(0);
        }
        grants.push((nonce, lease));
        let txn = Txn::new()
            .when([Compare::mod_revision(grants_key.as_str(), CompareOp::Equal, grants_revision)])
            .and_then([
                TxnOp::put(grants_key.as_str(), encode_lease_grants(&grants), None),
                TxnOp::put(
                    clients.keys.lease(lease),
                    node_text(node),
                    Some(PutOptions::new().with_lease(etcd_lease)),
                ),
            ]);
        if clients.kv.txn(txn).await?.succeeded() {
            return Ok(lease);
        }
        // A duplicate request recorded a grant first; the next round finds it. Revoking ours
        // is only tidiness: unused, it expires by itself within its TTL.
        let _ = clients.lease.revoke(etcd_lease).await;
    }
    Err(contention(&format!("granting a lease to node {node}")))
}

/// The next node id to give and the counter key's `mod_revision` (0 when absent).
async fn read_next_node_id(clients: &mut Clients) -> CallResult<(u32, i64)> {
    let Some(counter) = get_one(&mut clients.kv, &clients.keys.next_node_id()).await? else {
        return Ok((FIRST_NODE_ID, 0));
    };
    let key = clients.keys.relative(counter.key());
    let next: u32 = parse_decimal(&key, counter.value())?;
    if next < FIRST_NODE_ID {
        return Err(MetaError::RecordCorrupt {
            key,
            detail: format!("{next} is below the first node id"),
        }
        .into());
    }
    Ok((next, counter.mod_revision()))
}

/// The id of a lease etcd granted, checked.
fn granted_lease_id(id: i64, ttl: i64, error: &str) -> Result<i64, MetaError> {
    if !error.is_empty() || id <= 0 || ttl <= 0 {
        return Err(MetaError::Backend {
            detail: format!("etcd refused a lease grant: id {id}, TTL {ttl} s, error {error:?}"),
        });
    }
    Ok(id)
}

fn member_invalid(name: &str, detail: String) -> MetaError {
    MetaError::MemberInvalid { name: name.to_owned(), detail }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::EtcdServer;
    use crate::{EtcdStore, MetaStore};
    use replication::MemStore;
    use std::sync::Barrier;
    use std::time::Instant;

    const TEST_TIMEOUT: Duration = Duration::from_secs(5);
    /// Asked of etcd; it grants its minimum instead (2 s with default settings).
    const TEST_LEASE_TTL: Duration = Duration::from_secs(1);
    /// The longest wait for etcd to revoke expired leases: its minimum TTL plus its 500 ms
    /// revocation check, with room for a loaded machine.
    const EXPIRY_WAIT_MAX: Duration = Duration::from_secs(10);
    const POLL_INTERVAL: Duration = Duration::from_millis(100);
    const VOLUME_ID: u64 = 7;
    const MEM_LEASE_MS: u64 = 1000;
    const A: NodeId = NodeId(1);
    const B: NodeId = NodeId(2);

    fn connect(server: &EtcdServer, prefix: &str) -> ClusterStore {
        ClusterStore::connect(&server.endpoints(), prefix, TEST_TIMEOUT, TEST_LEASE_TTL).unwrap()
    }

    fn state(epoch: u64, primary: Option<NodeId>, primary_lease: LeaseId) -> VolumeState {
        VolumeState {
            epoch,
            primary,
            primary_lease,
            in_sync: [A, B].into(),
            members: [A, B, NodeId(3)].into(),
        }
    }

    /// A control store under the conformance script.
    trait Backend {
        fn handle(&mut self, request: &StoreRequest) -> StoreReply;
        /// Returns once every lease has expired.
        fn expire_leases(&mut self);
    }

    struct Mem {
        store: MemStore,
        now_ms: u64,
    }

    impl Backend for Mem {
        fn handle(&mut self, request: &StoreRequest) -> StoreReply {
            self.now_ms += 1;
            self.store.handle(self.now_ms, request)
        }

        fn expire_leases(&mut self) {
            self.now_ms += MEM_LEASE_MS;
        }
    }

    struct Etcd<'a>(&'a ClusterStore);

    impl Backend for Etcd<'_> {
        fn handle(&mut self, request: &StoreRequest) -> StoreReply {
            self.0.handle(VOLUME_ID, request).unwrap()
        }

        fn expire_leases(&mut self) {
            wait_until("every lease expired", || self.0.live_leases().unwrap().is_empty());
        }
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let started = Instant::now();
        while !done() {
            assert!(started.elapsed() < EXPIRY_WAIT_MAX, "{what}: not within {EXPIRY_WAIT_MAX:?}");
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// A reply with versions and lease ids replaced by the order they were first seen in, so
    /// that two backends' transcripts compare equal exactly when their kinds, states, reasons
    /// and the identity relations of versions and leases are the same.
    #[derive(Debug, PartialEq, Eq)]
    enum Normalised {
        Volume(usize, VolumeState),
        Snapshot(usize, VolumeState, BTreeSet<(usize, NodeId)>),
        CasDone(usize, VolumeState),
        CasFailed(usize, VolumeState, CasFailure),
        Lease(usize),
    }

    #[derive(Default)]
    struct Transcript {
        versions: Vec<u64>,
        leases: Vec<LeaseId>,
        replies: Vec<Normalised>,
    }

    impl Transcript {
        fn version(&mut self, version: u64) -> usize {
            if let Some(index) = self.versions.iter().position(|&seen| seen == version) {
                return index;
            }
            assert!(
                self.versions.iter().all(|&seen| seen < version),
                "a new version {version} is above every earlier one {:?}",
                self.versions
            );
            self.versions.push(version);
            self.versions.len() - 1
        }

        fn lease(&mut self, lease: LeaseId) -> usize {
            if let Some(index) = self.leases.iter().position(|&seen| seen == lease) {
                return index;
            }
            self.leases.push(lease);
            self.leases.len() - 1
        }

        fn volume(&mut self, volume: &Versioned<VolumeState>) -> (usize, VolumeState) {
            let lease = self.lease(volume.value.primary_lease);
            let value =
                VolumeState { primary_lease: LeaseId(lease as u64), ..volume.value.clone() };
            (self.version(volume.version), value)
        }

        /// Records `reply` and returns it.
        fn step(&mut self, backend: &mut dyn Backend, request: StoreRequest) -> StoreReply {
            let reply = backend.handle(&request);
            let normalised = match &reply {
                StoreReply::Volume(volume) => {
                    let (version, value) = self.volume(volume);
                    Normalised::Volume(version, value)
                }
                StoreReply::Snapshot { volume, leases } => {
                    let (version, value) = self.volume(volume);
                    let leases =
                        leases.iter().map(|info| (self.lease(info.lease), info.node)).collect();
                    Normalised::Snapshot(version, value, leases)
                }
                StoreReply::CasDone(volume) => {
                    let (version, value) = self.volume(volume);
                    Normalised::CasDone(version, value)
                }
                StoreReply::CasFailed { current, reason } => {
                    let (version, value) = self.volume(current);
                    Normalised::CasFailed(version, value, *reason)
                }
                StoreReply::Lease { lease } => Normalised::Lease(self.lease(*lease)),
            };
            self.replies.push(normalised);
            reply
        }
    }

    fn lease_of(reply: StoreReply) -> LeaseId {
        match reply {
            StoreReply::Lease { lease } => lease,
            other => panic!("a keepalive answers with a lease, not {other:?}"),
        }
    }

    fn version_of(reply: StoreReply) -> u64 {
        match reply {
            StoreReply::Volume(volume) | StoreReply::CasDone(volume) => volume.version,
            other => panic!("expected the volume, got {other:?}"),
        }
    }

    fn cas(
        expected_version: u64,
        new: VolumeState,
        require_live: Option<LeaseId>,
        require_not_live: Option<LeaseId>,
    ) -> StoreRequest {
        StoreRequest::Cas { expected_version, new, require_live, require_not_live }
    }

    fn keep_alive(node: NodeId, lease: Option<LeaseId>, nonce: u64) -> StoreRequest {
        StoreRequest::KeepAlive { node, lease, nonce }
    }

    /// The scripted sequence both backends run; the volume starts as `state(0, None, NONE)`.
    fn script(backend: &mut dyn Backend) -> Vec<Normalised> {
        let mut t = Transcript::default();
        let v0 = version_of(t.step(backend, StoreRequest::Get));

        // Grants: a duplicate gets the same lease, another node a different one.
        let la = lease_of(t.step(backend, keep_alive(A, None, 1)));
        assert_eq!(lease_of(t.step(backend, keep_alive(A, None, 1))), la);
        let lb = lease_of(t.step(backend, keep_alive(B, None, 1)));
        assert_ne!(la, lb);
        assert_ne!(la, LeaseId::NONE);

        // Each condition fails alone, and the first failing one is named.
        let s1 = state(1, Some(A), la);
        let never_granted = LeaseId(999_999);
        for wrong in [v0 + 1000, u64::MAX, 0] {
            t.step(backend, cas(wrong, s1.clone(), None, None));
        }
        t.step(backend, cas(v0, s1.clone(), Some(LeaseId::NONE), None));
        t.step(backend, cas(v0, s1.clone(), Some(never_granted), None));
        t.step(backend, cas(v0, s1.clone(), Some(la), Some(lb)));
        t.step(backend, cas(v0 + 1000, s1.clone(), Some(LeaseId::NONE), Some(lb)));
        t.step(backend, cas(v0, s1.clone(), Some(LeaseId::NONE), Some(lb)));
        t.step(backend, cas(v0, s1.clone(), Some(lb), Some(lb)));
        t.step(backend, StoreRequest::Get);

        // Success, then the old version is stale.
        let v1 = version_of(t.step(backend, cas(v0, s1.clone(), Some(la), Some(LeaseId::NONE))));
        assert!(v1 > v0);
        t.step(backend, StoreRequest::Get);
        t.step(backend, cas(v0, state(2, Some(B), lb), Some(lb), None));
        t.step(backend, StoreRequest::Snapshot);

        // Renewal keeps the lease; renewing another node's lease grants a new one.
        assert_eq!(lease_of(t.step(backend, keep_alive(A, Some(la), 2))), la);
        let la2 = lease_of(t.step(backend, keep_alive(A, Some(lb), 3)));
        assert!(![la, lb].contains(&la2));
        t.step(backend, StoreRequest::Snapshot);

        // After expiry: nothing is live, and a renewal grants a new lease, never the old one.
        backend.expire_leases();
        t.step(backend, StoreRequest::Snapshot);
        t.step(backend, cas(v1, state(2, Some(B), lb), Some(lb), None));
        t.step(backend, cas(v1, state(2, Some(B), lb), None, Some(la)));
        t.step(backend, StoreRequest::Get);
        let la3 = lease_of(t.step(backend, keep_alive(A, Some(la), 4)));
        assert!(![la, lb, la2].contains(&la3));
        // A late duplicate of the first grant gets its lease back, still expired.
        assert_eq!(lease_of(t.step(backend, keep_alive(A, None, 1))), la);
        t.step(backend, StoreRequest::Snapshot);
        t.replies
    }

    #[test]
    fn handles_requests_as_mem_store_does() {
        let initial = state(0, None, LeaseId::NONE);
        let mut mem = Mem { store: MemStore::new(initial.clone(), MEM_LEASE_MS), now_ms: 0 };
        let expected = script(&mut mem);

        let server = EtcdServer::start();
        let store = connect(&server, "/ferrite/conformance");
        let version = store.create_replication_state(VOLUME_ID, &initial).unwrap();
        let actual = script(&mut Etcd(&store));
        for (index, (mem_reply, etcd_reply)) in expected.iter().zip(&actual).enumerate() {
            assert_eq!(mem_reply, etcd_reply, "reply {index}");
        }
        assert_eq!(expected.len(), actual.len());

        // The other calls on the same state.
        let states = store.replication_states().unwrap();
        assert_eq!(states.len(), 1);
        assert!(states[0].1.version > version);
        assert!(matches!(
            store.create_replication_state(VOLUME_ID, &initial),
            Err(MetaError::ReplicationStateExists { volume_id: VOLUME_ID })
        ));
        store.delete_replication_state(VOLUME_ID).unwrap();
        for request in
            [StoreRequest::Get, StoreRequest::Snapshot, cas(0, initial.clone(), None, None)]
        {
            let error = store.handle(VOLUME_ID, &request).unwrap_err();
            assert!(matches!(error, MetaError::ReplicationStateMissing { volume_id: VOLUME_ID }));
        }
        assert!(matches!(
            store.delete_replication_state(VOLUME_ID),
            Err(MetaError::ReplicationStateMissing { .. })
        ));
    }

    /// Two writers CAS from the same version at once: exactly one wins each round, and the
    /// loser is told the winner's state.
    #[test]
    fn concurrent_cas_has_one_winner_per_version() {
        const ROUNDS: u64 = 8;
        let server = EtcdServer::start();
        let stores = [connect(&server, "/ferrite/race"), connect(&server, "/ferrite/race")];
        let initial = state(0, None, LeaseId::NONE);
        let mut version = stores[0].create_replication_state(VOLUME_ID, &initial).unwrap();
        let barrier = Barrier::new(2);
        for round in 1..=ROUNDS {
            let replies: Vec<StoreReply> = std::thread::scope(|scope| {
                let writers: Vec<_> = [A, B]
                    .into_iter()
                    .zip(&stores)
                    .map(|(node, store)| {
                        let barrier = &barrier;
                        scope.spawn(move || {
                            let new = state(round, Some(node), LeaseId::NONE);
                            barrier.wait();
                            store.handle(VOLUME_ID, &cas(version, new, None, None)).unwrap()
                        })
                    })
                    .collect();
                writers.into_iter().map(|writer| writer.join().unwrap()).collect()
            });
            let winners: Vec<_> = replies
                .iter()
                .filter_map(|reply| match reply {
                    StoreReply::CasDone(done) => Some(done.clone()),
                    _ => None,
                })
                .collect();
            assert_eq!(winners.len(), 1, "round {round}: {replies:?}");
            let winner = &winners[0];
            assert!(winner.version > version);
            for reply in &replies {
                if let StoreReply::CasFailed { current, reason } = reply {
                    assert_eq!((current, *reason), (winner, CasFailure::VersionMismatch));
                }
            }
            assert_eq!(
                stores[1].handle(VOLUME_ID, &StoreRequest::Get).unwrap(),
                StoreReply::Volume(winner.clone())
            );
            version = winner.version;
        }

        // Duplicated grant requests racing each other get one lease; the loser's is revoked.
        for nonce in 1..=ROUNDS {
            let leases: Vec<LeaseId> = std::thread::scope(|scope| {
                let requesters: Vec<_> = stores
                    .iter()
                    .map(|store| {
                        let barrier = &barrier;
                        scope.spawn(move || {
                            barrier.wait();
                            lease_of(store.handle(0, &keep_alive(A, None, nonce)).unwrap())
                        })
                    })
                    .collect();
                requesters.into_iter().map(|requester| requester.join().unwrap()).collect()
            });
            assert_eq!(leases[0], leases[1], "nonce {nonce}");
        }
        let live = stores[0].live_leases().unwrap();
        assert_eq!(live.len() as u64, ROUNDS, "{live:?}");

        // The volume records of an EtcdStore on the same prefix are not disturbed.
        let volumes =
            EtcdStore::connect(&server.endpoints(), "/ferrite/race", TEST_TIMEOUT).unwrap();
        assert_eq!(volumes.revision().unwrap(), 0);
        assert_eq!(volumes.volumes().unwrap(), vec![]);
    }

    fn member(name: &str) -> MemberRecord {
        MemberRecord {
            name: name.to_owned(),
            id: NodeId(0),
            replication_addr: format!("{name}:4480"),
            nvme_addrs: vec![format!("{name}:4420")],
            api_addr: format!("{name}:8080"),
            nbd_addr: None,
            labels: [("zone".to_owned(), "a".to_owned())].into(),
            drive_count: 4,
            capacity_bytes: 64 << 30,
            free_bytes: 32 << 30,
            updated_unix_ms: 1_700_000_000_000,
        }
    }

    fn liveness(store: &ClusterStore) -> Vec<(String, NodeId, bool)> {
        let members = store.members().unwrap();
        members.into_iter().map(|(record, live)| (record.name, record.id, live)).collect()
    }

    #[test]
    fn members_and_manager() {
        let server = EtcdServer::start();
        let store = connect(&server, "/ferrite/members");
        let alpha = store.register_member(member("alpha")).unwrap();
        assert_eq!(alpha, NodeId(1));
        let moved = MemberRecord { api_addr: "elsewhere:8080".to_owned(), ..member("alpha") };
        assert_eq!(store.register_member(moved).unwrap(), alpha, "a known name keeps its id");
        let beta = store.register_member(member("beta")).unwrap();
        assert_eq!(beta, NodeId(2));
        let refreshed = MemberRecord { id: beta, free_bytes: 1 << 30, ..member("beta") };
        store.update_member(&refreshed).unwrap();
        let members = store.members().unwrap();
        assert_eq!(members[0].0.api_addr, "elsewhere:8080");
        assert_eq!(members[1], (refreshed, false));
        assert_eq!(
            liveness(&store),
            vec![("alpha".into(), alpha, false), ("beta".into(), beta, false)]
        );

        for name in ["", "a/b", "a b", &"a".repeat(MEMBER_NAME_LENGTH_MAX + 1)] {
            let error = store.register_member(member(name)).unwrap_err();
            assert!(matches!(error, MetaError::MemberInvalid { .. }), "{name:?}: {error}");
        }
        let unknown = MemberRecord { id: NodeId(9), ..member("gamma") };
        assert!(matches!(store.update_member(&unknown), Err(MetaError::MemberNotFound { .. })));
        let wrong_id = MemberRecord { id: NodeId(9), ..member("beta") };
        assert!(matches!(store.update_member(&wrong_id), Err(MetaError::MemberNotFound { .. })));

        // Liveness follows the leases; the manager's role goes to a holder of a live lease.
        let la = lease_of(store.handle(0, &keep_alive(alpha, None, 1)).unwrap());
        let lb = lease_of(store.handle(0, &keep_alive(beta, None, 1)).unwrap());
        assert_eq!(
            liveness(&store),
            vec![("alpha".into(), alpha, true), ("beta".into(), beta, true)]
        );
        assert_eq!(store.manager().unwrap(), None);
        for lease in [la, LeaseId::NONE, LeaseId(u64::MAX)] {
            let error = store.campaign(beta, lease).unwrap_err();
            assert!(matches!(error, MetaError::LeaseNotHeld { .. }), "{lease:?}: {error}");
        }
        assert_eq!(store.campaign(alpha, la).unwrap(), alpha);
        assert_eq!(store.campaign(beta, lb).unwrap(), alpha);
        assert_eq!(store.campaign(alpha, la).unwrap(), alpha);
        assert_eq!(store.manager().unwrap(), Some(alpha));

        // Alpha's lease expires while beta renews its own: beta can take over.
        let mut nonce = 2;
        wait_until("alpha's lease expired", || {
            let renewed = lease_of(store.handle(0, &keep_alive(beta, Some(lb), nonce)).unwrap());
            assert_eq!(renewed, lb, "a live lease is renewed");
            nonce += 1;
            liveness(&store) == vec![("alpha".into(), alpha, false), ("beta".into(), beta, true)]
        });
        assert_eq!(store.manager().unwrap(), None);
        assert_eq!(store.campaign(beta, lb).unwrap(), beta);
        assert_eq!(store.campaign(alpha, la).unwrap(), beta);

        // Removal forgets the member; its name registered again gets a new id.
        store.remove_member("beta").unwrap();
        assert!(matches!(store.remove_member("beta"), Err(MetaError::MemberNotFound { .. })));
        assert!(matches!(store.remove_member("a/b"), Err(MetaError::MemberNotFound { .. })));
        assert_eq!(liveness(&store), vec![("alpha".into(), alpha, false)]);
        assert_eq!(store.register_member(member("beta")).unwrap(), NodeId(3));
    }

    #[test]
    fn stored_records_are_checked() {
        let server = EtcdServer::start();
        let store = connect(&server, "/ferrite/records");
        let put = |key: &'static str, value: &'static str| {
            store
                .call(move |mut clients| async move {
                    let key = format!("{}/{key}", clients.keys.prefix);
                    clients.kv.put(key, value, None).await?;
                    Ok(())
                })
                .unwrap();
        };
        put("replication/5", r#"{"version":9}"#);
        let error = store.handle(5, &StoreRequest::Get).unwrap_err();
        assert!(
            matches!(&error, MetaError::RecordVersionUnsupported { key, version: 9, .. } if key == "replication/5"),
            "{error}"
        );
        assert!(matches!(
            store.replication_states(),
            Err(MetaError::RecordVersionUnsupported { .. })
        ));
        put("replication/5", "{");
        assert!(matches!(
            store.handle(5, &StoreRequest::Get),
            Err(MetaError::RecordCorrupt { .. })
        ));
        put("replication/5", r#"{"version":1}"#);
        assert!(matches!(store.replication_states(), Err(MetaError::RecordCorrupt { .. })));
        put(
            "replication/5",
            r#"{"version":1,"epoch":1,"primary":null,"primary_lease":0,"in_sync":[],"members":[1,1]}"#,
        );
        assert!(matches!(
            store.handle(5, &StoreRequest::Get),
            Err(MetaError::RecordCorrupt { .. })
        ));
        put(
            "replication/5",
            r#"{"version":1,"epoch":1,"primary":null,"primary_lease":0,"in_sync":[],"members":[1]}"#,
        );
        assert_eq!(store.replication_states().unwrap().len(), 1);
        put(
            "replication/x",
            r#"{"version":1,"epoch":1,"primary":null,"primary_lease":0,"in_sync":[],"members":[1]}"#,
        );
        let error = store.replication_states().unwrap_err();
        assert!(
            matches!(&error, MetaError::RecordCorrupt { key, .. } if key == "replication/x"),
            "{error}"
        );
        put("members/alpha", r#"{"version":2}"#);
        assert!(matches!(store.members(), Err(MetaError::RecordVersionUnsupported { .. })));
        put("leases/12", "not a node");
        assert!(matches!(store.live_leases(), Err(MetaError::RecordCorrupt { .. })));
        assert!(matches!(store.members(), Err(MetaError::RecordCorrupt { .. })));
        put("leases/12", "+3");
        assert!(matches!(store.live_leases(), Err(MetaError::RecordCorrupt { .. })));
    }

    /// A call given a shorter bound than the store's gives up at that bound while etcd hangs,
    /// and the store serves again once etcd answers.
    #[test]
    fn a_call_bounded_below_the_store_timeout_gives_up_at_its_bound() {
        let server = EtcdServer::start();
        let store = connect(&server, "/ferrite/bounded");
        let renewal = keep_alive(A, None, 1);
        let Ok(StoreReply::Lease { lease }) = store.handle(VOLUME_ID, &renewal) else {
            panic!("a lease granted");
        };
        server.pause();
        let started = Instant::now();
        let error = store
            .handle_within(VOLUME_ID, &keep_alive(A, Some(lease), 2), Duration::from_millis(200))
            .unwrap_err();
        let waited = started.elapsed();
        server.resume();
        assert!(matches!(error, MetaError::Unreachable { .. }), "{error}");
        assert!(waited < TEST_TIMEOUT, "gave up after {waited:?}, not at its own bound");
        let reply = store.handle(VOLUME_ID, &keep_alive(A, Some(lease), 3)).unwrap();
        assert!(matches!(reply, StoreReply::Lease { .. }), "{reply:?}");
    }

    #[test]
    fn bad_settings_are_refused() {
        let endpoints = vec!["http://127.0.0.1:1".to_owned()];
        for (prefix, ttl) in [
            ("/ferrite/x", Duration::ZERO),
            ("/ferrite/x", LEASE_TTL_MAX + Duration::from_secs(1)),
            ("ferrite", Duration::from_secs(1)),
        ] {
            let error = ClusterStore::connect(&endpoints, prefix, TEST_TIMEOUT, ttl).err().unwrap();
            assert!(matches!(error, MetaError::Config { .. }), "{prefix} {ttl:?}: {error}");
        }
        assert_eq!(ttl_seconds(Duration::from_millis(1)), 1);
        assert_eq!(ttl_seconds(Duration::from_millis(1000)), 1);
        assert_eq!(ttl_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(ttl_seconds(Duration::from_secs(10)), 10);
    }

    #[test]
    fn member_names() {
        for name in ["a", "node-1", "Node_2.zone", &"x".repeat(MEMBER_NAME_LENGTH_MAX)] {
            assert!(member_name_valid(name), "{name:?}");
        }
        for name in ["", "a b", "a/b", "ü", &"x".repeat(MEMBER_NAME_LENGTH_MAX + 1)] {
            assert!(!member_name_valid(name), "{name:?}");
        }
        let mut record = member("alpha");
        assert_eq!(record.check(), Ok(()));
        record.nvme_addrs = vec!["a:1".to_owned(); MEMBER_NVME_ADDRS_MAX + 1];
        assert!(record.check().is_err());
        record = MemberRecord { api_addr: String::new(), ..member("alpha") };
        assert!(record.check().is_err());
        record = member("alpha");
        record.labels.insert(String::new(), "x".to_owned());
        assert!(record.check().is_err());
    }
}
