//! The cluster metadata store: records kept in etcd, under one key prefix per cluster.
//!
//! Every node of a cluster opens an [`EtcdStore`] on the same etcd and prefix, so the nodes'
//! control planes share one view of the volumes. Records are stored exactly as the embedded
//! store stores them ([`crate::record`]), so both backends read each other's records.
//!
//! Keys, below the cluster's prefix `P` (for example `/ferrite/prod`):
//!
//! | key | value |
//! |---|---|
//! | `P/volumes/<name>` | [`crate::record`] volume record |
//! | `P/snapshots/<volume>/<snapshot>` | [`crate::record`] snapshot record |
//! | `P/node` | [`crate::record`] node record |
//! | `P/next_volume_id` | the next volume id, decimal ASCII (`"8"`) |
//! | `P/revision` | empty; written by every write transaction |
//!
//! Atomicity comes from etcd transactions, so several control planes may write at once:
//! - create puts the volume only if its key has never been created (`create_revision == 0`);
//! - a snapshot is created only if its volume's key exists (`version > 0`) and its own key has
//!   never been created, both compared in the one transaction that puts it;
//! - update and delete read the record, check it, and write only if the key is unchanged since
//!   (`mod_revision` compare), re-reading on a conflict at most [`CAS_ATTEMPTS_MAX`] times;
//! - a volume id is allocated the same way on the counter key, so ids are unique and increase.
//!
//! The store's revision is the etcd revision of the last write transaction under the prefix:
//! each write transaction also puts `P/revision`, so that key's `mod_revision` is the revision
//! the write returned. It is 0 for an empty prefix, does not move on reads, failed writes or id
//! allocations, and, being an etcd revision, is where a future watch of the prefix would start.
//!
//! [`MetaStore`] is synchronous, and callers run it inside tokio (the node's API handlers) as well
//! as outside it. The etcd client is asynchronous, so the store owns a private one-thread tokio
//! runtime: a call spawns its work there and waits on a channel. Waiting on a channel is allowed
//! on any thread, whereas `Runtime::block_on` and `block_in_place` panic inside some runtimes.
//! Every call is bounded by the store's timeout; an etcd that does not answer gives
//! [`MetaError::Unreachable`], never a hang.

use crate::record::{
    decode_node, decode_snapshot, decode_volume, encode_node, encode_snapshot, encode_volume,
};
use crate::{MetaError, MetaStore, NodeRecord, SnapshotRecord, VolumeRecord};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, KvClient, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use std::future::Future;
use std::sync::mpsc;
use std::time::Duration;
use tokio::runtime::Runtime;
use types::VolumeName;

/// The timeout of one store call when the caller has no reason to choose another: long enough
/// for an etcd leader election (about a second with etcd's default settings), short enough that
/// an API request fails while its caller still waits.
pub const ETCD_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);

/// How many times an update, a delete or an id allocation re-reads and retries after another
/// writer changed its key in between. Each lost attempt means another writer succeeded, so this
/// is only reached under sustained contention on one key.
pub const CAS_ATTEMPTS_MAX: u32 = 64;

/// The longest key prefix accepted; far above `/ferrite/<cluster name>`.
pub const PREFIX_LENGTH_MAX: usize = 256;

/// The most endpoints one store is given; a cluster's etcd has 3 or 5 members.
pub const ENDPOINTS_MAX: usize = 16;

/// The largest etcd response the store accepts (the volume list). The gRPC default of 4 MiB
/// would cap the number of volumes at a few thousand; etcd holds 2 GiB by default.
pub(crate) const RESPONSE_BYTES_MAX: usize = 256 << 20;

/// How long past its own timeout a caller waits for the runtime's answer before giving up. The
/// runtime enforces the timeout itself; this only guards against the runtime being gone.
const ANSWER_GRACE: Duration = Duration::from_secs(1);

/// The gRPC status codes that mean etcd did not answer (rather than refused): Cancelled (1),
/// DeadlineExceeded (4), Unavailable (14; also "no leader"). Numbers, because the gRPC crate is
/// not a direct dependency of this one; they are fixed by the gRPC specification.
const GRPC_CODES_UNREACHABLE: [i32; 3] = [1, 4, 14];

/// Volume ids start at 1 so that 0 never names a volume (as in the embedded store).
const FIRST_VOLUME_ID: u64 = 1;

const VOLUMES_DIR: &str = "/volumes/";
const SNAPSHOTS_DIR: &str = "/snapshots/";
const NODE_KEY: &str = "/node";
const NEXT_VOLUME_ID_KEY: &str = "/next_volume_id";
const REVISION_KEY: &str = "/revision";

/// The metadata store of a cluster, kept in etcd.
pub struct EtcdStore {
    /// Runs every etcd request; `None` only while the store is dropped.
    runtime: Option<Runtime>,
    kv: KvClient,
    keys: Keys,
    /// The endpoints as given, for error messages.
    endpoints: String,
    timeout: Duration,
}

/// The full etcd keys of one cluster's records.
#[derive(Clone)]
struct Keys {
    prefix: String,
}

impl Keys {
    fn volumes_dir(&self) -> String {
        format!("{}{VOLUMES_DIR}", self.prefix)
    }

    fn volume(&self, name: &VolumeName) -> String {
        format!("{}{VOLUMES_DIR}{name}", self.prefix)
    }

    fn snapshots_dir(&self) -> String {
        format!("{}{SNAPSHOTS_DIR}", self.prefix)
    }

    /// The directory of one volume's snapshots. It ends with `/`, and volume names hold none,
    /// so it is no prefix of another volume's directory (`db/` of `db-1/`).
    fn volume_snapshots_dir(&self, volume: &VolumeName) -> String {
        format!("{}{SNAPSHOTS_DIR}{volume}/", self.prefix)
    }

    fn snapshot(&self, volume: &VolumeName, name: &VolumeName) -> String {
        format!("{}{SNAPSHOTS_DIR}{volume}/{name}", self.prefix)
    }

    fn node(&self) -> String {
        format!("{}{NODE_KEY}", self.prefix)
    }

    fn next_volume_id(&self) -> String {
        format!("{}{NEXT_VOLUME_ID_KEY}", self.prefix)
    }

    fn revision(&self) -> String {
        format!("{}{REVISION_KEY}", self.prefix)
    }
}

/// An error inside a call: etcd's, mapped to a [`MetaError`] by [`EtcdStore::call`], or ours.
pub(crate) enum CallError {
    Etcd(etcd_client::Error),
    Meta(MetaError),
}

impl From<etcd_client::Error> for CallError {
    fn from(error: etcd_client::Error) -> Self {
        Self::Etcd(error)
    }
}

impl From<MetaError> for CallError {
    fn from(error: MetaError) -> Self {
        Self::Meta(error)
    }
}

pub(crate) type CallResult<T> = Result<T, CallError>;

impl EtcdStore {
    /// Connects to the etcd cluster at `endpoints` (`http://host:port`, or `host:port`) and uses
    /// the keys below `prefix` (`/ferrite/<cluster>`: starts with `/`, does not end with one).
    ///
    /// Checks that etcd answers, so a wrong endpoint fails here with
    /// [`MetaError::Unreachable`] rather than at the first request. Every later call is bounded
    /// by `timeout` ([`ETCD_TIMEOUT_DEFAULT`] unless there is a reason for another).
    pub fn connect(
        endpoints: &[String],
        prefix: &str,
        timeout: Duration,
    ) -> Result<Self, MetaError> {
        check_settings(endpoints, prefix, timeout)?;
        let runtime = start_runtime("meta-etcd")?;
        let keys = Keys { prefix: prefix.to_owned() };
        let endpoints_text = endpoints.join(",");

        // The client's channel starts tasks on the runtime it is created in, so it is created
        // in the store's runtime. The first read proves that etcd answers and has a quorum.
        let options = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
        let endpoints = endpoints.to_vec();
        let revision_key = keys.revision();
        let kv = run(&runtime, timeout, &endpoints_text, async move {
            let client = Client::connect(endpoints, Some(options)).await?;
            let mut kv = client.kv_client().max_decoding_message_size(RESPONSE_BYTES_MAX);
            kv.get(revision_key, None).await?;
            Ok(kv)
        })?;
        Ok(Self { runtime: Some(runtime), kv, keys, endpoints: endpoints_text, timeout })
    }

    /// The key prefix this store keeps its records under.
    pub fn prefix(&self) -> &str {
        &self.keys.prefix
    }

    /// Runs `operation` on the store's runtime with a fresh handle to etcd and the store's keys,
    /// and waits for it, at most the store's timeout.
    fn call<T, F, Fut>(&self, operation: F) -> Result<T, MetaError>
    where
        F: FnOnce(KvClient, Keys) -> Fut,
        Fut: Future<Output = CallResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        let runtime = self.runtime.as_ref().expect("the runtime lives as long as the store");
        let future = operation(self.kv.clone(), self.keys.clone());
        run(runtime, self.timeout, &self.endpoints, future)
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Dropping a runtime waits for its threads, which panics inside another runtime;
            // shutting down in the background does not wait, so a store can be dropped anywhere.
            runtime.shutdown_background();
        }
    }
}

/// Checks the settings every etcd-backed store is connected with.
pub(crate) fn check_settings(
    endpoints: &[String],
    prefix: &str,
    timeout: Duration,
) -> Result<(), MetaError> {
    check_prefix(prefix)?;
    if endpoints.is_empty() || endpoints.len() > ENDPOINTS_MAX {
        return Err(MetaError::Config {
            detail: format!(
                "{} etcd endpoints given; give from 1 to {ENDPOINTS_MAX}",
                endpoints.len()
            ),
        });
    }
    if timeout.is_zero() {
        return Err(MetaError::Config { detail: "the etcd timeout is zero".to_owned() });
    }
    Ok(())
}

/// The private runtime an etcd-backed store runs its client on (see the module comment).
pub(crate) fn start_runtime(thread_name: &str) -> Result<Runtime, MetaError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(thread_name)
        .enable_all()
        .build()
        .map_err(|error| MetaError::Backend {
            detail: format!("cannot start the etcd client's runtime: {error}"),
        })
}

/// Runs `future` on `runtime` and waits for its result on this thread, at most `timeout`.
pub(crate) fn run<T: Send + 'static>(
    runtime: &Runtime,
    timeout: Duration,
    endpoints: &str,
    future: impl Future<Output = CallResult<T>> + Send + 'static,
) -> Result<T, MetaError> {
    // One answer, and the task never waits to send it.
    let (sender, receiver) = mpsc::sync_channel(1);
    runtime.spawn(async move {
        let answer = tokio::time::timeout(timeout, future).await;
        // The caller may have stopped waiting; then nobody needs the answer.
        let _ = sender.send(answer);
    });
    let unreachable =
        |detail: String| MetaError::Unreachable { endpoints: endpoints.to_owned(), detail };
    let no_answer = || unreachable(format!("no answer within {} ms", timeout.as_millis()));
    match receiver.recv_timeout(timeout + ANSWER_GRACE) {
        Ok(Ok(Ok(value))) => Ok(value),
        Ok(Ok(Err(CallError::Meta(error)))) => Err(error),
        Ok(Ok(Err(CallError::Etcd(error)))) => Err(from_etcd(error, endpoints)),
        Ok(Err(_elapsed)) => Err(no_answer()),
        Err(mpsc::RecvTimeoutError::Timeout) => Err(no_answer()),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(MetaError::Backend {
            detail: "the etcd client's runtime stopped during a request".to_owned(),
        }),
    }
}

/// Maps an etcd client error: the ones that mean "etcd did not answer" become
/// [`MetaError::Unreachable`], the rest [`MetaError::Backend`].
fn from_etcd(error: etcd_client::Error, endpoints: &str) -> MetaError {
    use etcd_client::Error;
    let unreachable = match &error {
        Error::TransportError(_) | Error::IoError(_) => true,
        Error::GRpcStatus(status) => GRPC_CODES_UNREACHABLE.contains(&i32::from(status.code())),
        _ => false,
    };
    if unreachable {
        MetaError::Unreachable { endpoints: endpoints.to_owned(), detail: error.to_string() }
    } else {
        MetaError::Backend { detail: format!("etcd at {endpoints}: {error}") }
    }
}

pub(crate) fn check_prefix(prefix: &str) -> Result<(), MetaError> {
    let valid = prefix.len() > 1
        && prefix.len() <= PREFIX_LENGTH_MAX
        && prefix.starts_with('/')
        && !prefix.ends_with('/')
        && !prefix.contains("//")
        && prefix.chars().all(|c| c.is_ascii_graphic());
    if valid {
        Ok(())
    } else {
        Err(MetaError::Config {
            detail: format!(
                "etcd key prefix {prefix:?} must start with '/', not end with one, hold no \
                 empty segment or space, and be at most {PREFIX_LENGTH_MAX} bytes \
                 (for example \"/ferrite/prod\")"
            ),
        })
    }
}

/// The one key-value pair a single-key read found, if any.
pub(crate) async fn get_one(kv: &mut KvClient, key: &str) -> CallResult<Option<KeyValue>> {
    let mut response = kv.get(key, None).await?;
    Ok(response.take_kvs().into_iter().next())
}

/// The next volume id to allocate and the counter key's `mod_revision` (0 when absent).
async fn read_next_volume_id(kv: &mut KvClient, keys: &Keys) -> CallResult<(u64, i64)> {
    let Some(counter) = get_one(kv, &keys.next_volume_id()).await? else {
        return Ok((FIRST_VOLUME_ID, 0));
    };
    let corrupt = |detail: String| MetaError::RecordCorrupt {
        key: NEXT_VOLUME_ID_KEY.trim_start_matches('/').to_owned(),
        detail,
    };
    let text =
        std::str::from_utf8(counter.value()).map_err(|_| corrupt("it is not text".to_owned()))?;
    let next: u64 = text.parse().map_err(|_| corrupt(format!("{text:?} is not a volume id")))?;
    if next < FIRST_VOLUME_ID {
        return Err(corrupt(format!("{next} is below the first volume id")).into());
    }
    Ok((next, counter.mod_revision()))
}

/// Runs a write transaction that also puts the revision key; returns whether its compares held
/// and, if they did, the new revision.
async fn write(
    kv: &mut KvClient,
    keys: &Keys,
    compares: Vec<Compare>,
    mut operations: Vec<TxnOp>,
) -> CallResult<Option<u64>> {
    operations.push(TxnOp::put(keys.revision(), Vec::new(), None));
    let response = kv.txn(Txn::new().when(compares).and_then(operations)).await?;
    if !response.succeeded() {
        return Ok(None);
    }
    Ok(Some(header_revision(&response)?))
}

/// Decodes a snapshot record listed below `snapshots_dir` (`P/snapshots/`), whose key names its
/// volume and itself.
fn decode_snapshot_entry(
    snapshots_dir: &str,
    entry: &KeyValue,
) -> Result<SnapshotRecord, MetaError> {
    let key = entry.key().strip_prefix(snapshots_dir.as_bytes()).unwrap_or(entry.key());
    let key = String::from_utf8_lossy(key);
    let Some((volume, name)) = key.split_once('/') else {
        return Err(MetaError::RecordCorrupt {
            key: key.into_owned(),
            detail: "a snapshot key must name a volume and a snapshot".to_owned(),
        });
    };
    decode_snapshot(volume, name, entry.value())
}

/// Lists the snapshot records below `dir` (all of them, or one volume's), oldest first within a
/// volume, volumes by name.
async fn list_snapshots(
    kv: &mut KvClient,
    keys: &Keys,
    dir: String,
) -> CallResult<Vec<SnapshotRecord>> {
    let options = GetOptions::new().with_prefix().with_sort(SortTarget::Key, SortOrder::Ascend);
    let response = kv.get(dir.as_str(), Some(options)).await?;
    let snapshots_dir = keys.snapshots_dir();
    let mut records = Vec::with_capacity(response.kvs().len());
    for entry in response.kvs() {
        records.push(decode_snapshot_entry(&snapshots_dir, entry)?);
    }
    records.sort_by(|a, b| (&a.volume, a.id).cmp(&(&b.volume, b.id)));
    Ok(records)
}

pub(crate) fn header_revision(response: &TxnResponse) -> Result<u64, MetaError> {
    let revision = response.header().map(|header| header.revision());
    revision.and_then(|revision| u64::try_from(revision).ok()).ok_or_else(|| MetaError::Backend {
        detail: format!("etcd answered a transaction without a valid revision: {revision:?}"),
    })
}

pub(crate) fn contention(what: &str) -> CallError {
    CallError::Meta(MetaError::Backend {
        detail: format!(
            "{what} lost {CAS_ATTEMPTS_MAX} times in a row to concurrent writers; try again"
        ),
    })
}

impl MetaStore for EtcdStore {
    fn revision(&self) -> Result<u64, MetaError> {
        self.call(|mut kv, keys| async move {
            let marker = get_one(&mut kv, &keys.revision()).await?;
            let revision = marker.map_or(0, |marker| marker.mod_revision());
            u64::try_from(revision).map_err(|_| {
                CallError::Meta(MetaError::Backend {
                    detail: format!("etcd reported a negative revision {revision}"),
                })
            })
        })
    }

    fn node(&self) -> Result<Option<NodeRecord>, MetaError> {
        self.call(|mut kv, keys| async move {
            let node = get_one(&mut kv, &keys.node()).await?;
            Ok(node.map(|node| decode_node("node", node.value())).transpose()?)
        })
    }

    fn put_node(&self, node: &NodeRecord) -> Result<u64, MetaError> {
        let bytes = encode_node(node);
        self.call(|mut kv, keys| async move {
            let put = TxnOp::put(keys.node(), bytes, None);
            let revision = write(&mut kv, &keys, Vec::new(), vec![put]).await?;
            // A transaction without compares always succeeds.
            revision.ok_or_else(|| {
                CallError::Meta(MetaError::Backend {
                    detail: "etcd refused a transaction without conditions".to_owned(),
                })
            })
        })
    }

    fn allocate_volume_id(&self) -> Result<u64, MetaError> {
        self.call(|mut kv, keys| async move {
            let key = keys.next_volume_id();
            for _attempt in 0..CAS_ATTEMPTS_MAX {
                let (id, mod_revision) = read_next_volume_id(&mut kv, &keys).await?;
                let next = id.checked_add(1).ok_or_else(|| MetaError::Backend {
                    detail: "volume ids are exhausted".to_owned(),
                })?;
                // Not a write of metadata: the revision does not move, as in the embedded store.
                let txn = Txn::new()
                    .when([Compare::mod_revision(key.as_str(), CompareOp::Equal, mod_revision)])
                    .and_then([TxnOp::put(key.as_str(), next.to_string(), None)]);
                if kv.txn(txn).await?.succeeded() {
                    return Ok(id);
                }
            }
            Err(contention("allocating a volume id"))
        })
    }

    fn volume(&self, name: &VolumeName) -> Result<Option<VolumeRecord>, MetaError> {
        let name = name.clone();
        self.call(|mut kv, keys| async move {
            let volume = get_one(&mut kv, &keys.volume(&name)).await?;
            Ok(volume.map(|volume| decode_volume(name.as_str(), volume.value())).transpose()?)
        })
    }

    fn volumes(&self) -> Result<Vec<VolumeRecord>, MetaError> {
        self.call(|mut kv, keys| async move {
            let dir = keys.volumes_dir();
            let options =
                GetOptions::new().with_prefix().with_sort(SortTarget::Key, SortOrder::Ascend);
            let response = kv.get(dir.as_str(), Some(options)).await?;
            let mut records = Vec::with_capacity(response.kvs().len());
            // Sorted by key, and every key is the directory and a name, so by name.
            for entry in response.kvs() {
                let name = entry.key().strip_prefix(dir.as_bytes()).unwrap_or(entry.key());
                let name = String::from_utf8_lossy(name);
                records.push(decode_volume(&name, entry.value())?);
            }
            Ok(records)
        })
    }

    fn create_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError> {
        let bytes = encode_volume(record);
        let name = record.name.clone();
        let id = record.id;
        self.call(move |mut kv, keys| async move {
            // The counter only grows, so an id below it now stays below it.
            let (next_id, _) = read_next_volume_id(&mut kv, &keys).await?;
            if !(FIRST_VOLUME_ID..next_id).contains(&id) {
                return Err(CallError::Meta(MetaError::Backend {
                    detail: format!("volume id {id} was not allocated by this store"),
                }));
            }
            let key = keys.volume(&name);
            let absent = Compare::create_revision(key.as_str(), CompareOp::Equal, 0);
            let put = TxnOp::put(key, bytes, None);
            match write(&mut kv, &keys, vec![absent], vec![put]).await? {
                Some(revision) => Ok(revision),
                None => Err(CallError::Meta(MetaError::VolumeExists(name))),
            }
        })
    }

    fn update_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError> {
        let bytes = encode_volume(record);
        let name = record.name.clone();
        let id = record.id;
        self.call(move |mut kv, keys| async move {
            let key = keys.volume(&name);
            for _attempt in 0..CAS_ATTEMPTS_MAX {
                let Some(current) = get_one(&mut kv, &key).await? else {
                    return Err(CallError::Meta(MetaError::VolumeNotFound(name)));
                };
                if decode_volume(name.as_str(), current.value())?.id != id {
                    return Err(CallError::Meta(MetaError::VolumeNotFound(name)));
                }
                let unchanged =
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, current.mod_revision());
                let put = TxnOp::put(key.as_str(), bytes.clone(), None);
                if let Some(revision) = write(&mut kv, &keys, vec![unchanged], vec![put]).await? {
                    return Ok(revision);
                }
            }
            Err(contention(&format!("updating volume {name}")))
        })
    }

    fn delete_volume(&self, name: &VolumeName) -> Result<VolumeRecord, MetaError> {
        let name = name.clone();
        self.call(move |mut kv, keys| async move {
            let key = keys.volume(&name);
            for _attempt in 0..CAS_ATTEMPTS_MAX {
                let Some(current) = get_one(&mut kv, &key).await? else {
                    return Err(CallError::Meta(MetaError::VolumeNotFound(name)));
                };
                let record = decode_volume(name.as_str(), current.value())?;
                let unchanged =
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, current.mod_revision());
                let delete = TxnOp::delete(key.as_str(), None);
                if write(&mut kv, &keys, vec![unchanged], vec![delete]).await?.is_some() {
                    return Ok(record);
                }
            }
            Err(contention(&format!("deleting volume {name}")))
        })
    }

    fn snapshots(&self, volume: &VolumeName) -> Result<Vec<SnapshotRecord>, MetaError> {
        let volume = volume.clone();
        self.call(move |mut kv, keys| async move {
            let dir = keys.volume_snapshots_dir(&volume);
            list_snapshots(&mut kv, &keys, dir).await
        })
    }

    fn all_snapshots(&self) -> Result<Vec<SnapshotRecord>, MetaError> {
        self.call(|mut kv, keys| async move {
            let dir = keys.snapshots_dir();
            list_snapshots(&mut kv, &keys, dir).await
        })
    }

    fn snapshot(
        &self,
        volume: &VolumeName,
        name: &VolumeName,
    ) -> Result<Option<SnapshotRecord>, MetaError> {
        let (volume, name) = (volume.clone(), name.clone());
        self.call(move |mut kv, keys| async move {
            let entry = get_one(&mut kv, &keys.snapshot(&volume, &name)).await?;
            let record = entry
                .map(|entry| decode_snapshot(volume.as_str(), name.as_str(), entry.value()))
                .transpose()?;
            Ok(record)
        })
    }

    fn create_snapshot(&self, record: &SnapshotRecord) -> Result<u64, MetaError> {
        let bytes = encode_snapshot(record);
        let (volume, name, id) = (record.volume.clone(), record.name.clone(), record.id);
        self.call(move |mut kv, keys| async move {
            // The counter only grows, so an id below it now stays below it.
            let (next_id, _) = read_next_volume_id(&mut kv, &keys).await?;
            if !(FIRST_VOLUME_ID..next_id).contains(&id) {
                return Err(CallError::Meta(MetaError::Backend {
                    detail: format!("snapshot id {id} was not allocated by this store"),
                }));
            }
            let volume_key = keys.volume(&volume);
            let key = keys.snapshot(&volume, &name);
            let compares = [
                Compare::version(volume_key.as_str(), CompareOp::Greater, 0),
                Compare::create_revision(key.as_str(), CompareOp::Equal, 0),
            ];
            let operations =
                [TxnOp::put(key, bytes, None), TxnOp::put(keys.revision(), Vec::new(), None)];
            // When a compare fails, the same transaction reads the volume's key, which tells
            // which one failed.
            let txn = Txn::new()
                .when(compares)
                .and_then(operations)
                .or_else([TxnOp::get(volume_key, Some(GetOptions::new().with_count_only()))]);
            let response = kv.txn(txn).await?;
            if response.succeeded() {
                return Ok(header_revision(&response)?);
            }
            let volume_exists = match response.op_responses().first() {
                Some(TxnOpResponse::Get(get)) => get.count() > 0,
                other => {
                    return Err(CallError::Meta(MetaError::Backend {
                        detail: format!("etcd answered a failed transaction with {other:?}"),
                    }))
                }
            };
            Err(CallError::Meta(if volume_exists {
                MetaError::SnapshotExists { volume, snapshot: name }
            } else {
                MetaError::VolumeNotFound(volume)
            }))
        })
    }

    fn delete_snapshot(
        &self,
        volume: &VolumeName,
        name: &VolumeName,
    ) -> Result<SnapshotRecord, MetaError> {
        let (volume, name) = (volume.clone(), name.clone());
        self.call(move |mut kv, keys| async move {
            let key = keys.snapshot(&volume, &name);
            for _attempt in 0..CAS_ATTEMPTS_MAX {
                let Some(current) = get_one(&mut kv, &key).await? else {
                    return Err(CallError::Meta(MetaError::SnapshotNotFound {
                        volume,
                        snapshot: name,
                    }));
                };
                let record = decode_snapshot(volume.as_str(), name.as_str(), current.value())?;
                let unchanged =
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, current.mod_revision());
                let delete = TxnOp::delete(key.as_str(), None);
                if write(&mut kv, &keys, vec![unchanged], vec![delete]).await?.is_some() {
                    return Ok(record);
                }
            }
            Err(contention(&format!("deleting snapshot {volume}@{name}")))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_concurrent_writers, check_store, EtcdServer};
    use crate::HostAccess;
    use std::time::Instant;

    /// Short, so that the unreachable cases finish quickly; ample for a local etcd.
    const TEST_TIMEOUT: Duration = Duration::from_secs(2);

    fn connect(server: &EtcdServer, prefix: &str) -> EtcdStore {
        EtcdStore::connect(&server.endpoints(), prefix, TEST_TIMEOUT).unwrap()
    }

    /// Writes raw bytes under a volume's key, as a foreign or damaged writer would.
    fn put_raw(store: &EtcdStore, name: &str, bytes: &'static [u8]) {
        let name = VolumeName::new(name).unwrap();
        store
            .call(move |mut kv, keys| async move {
                kv.put(keys.volume(&name), bytes, None).await?;
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn conformance() {
        let server = EtcdServer::start();
        let store = connect(&server, "/ferrite/conformance");
        check_store(&store);

        // Another prefix on the same etcd is another, empty, store.
        let other = connect(&server, "/ferrite/conformance-other");
        assert_eq!(other.revision().unwrap(), 0);
        let id = store.allocate_volume_id().unwrap();
        let record = VolumeRecord {
            id,
            name: VolumeName::new("only-here").unwrap(),
            size_bytes: 1 << 20,
            uuid: [1; 16],
            created_unix_ms: 1,
            chunks: vec![(0, 1)],
            host_access: HostAccess::Open,
            origin: None,
            compression: crate::Compression::Zstd,
            path_states: Default::default(),
        };
        store.create_volume(&record).unwrap();
        assert_eq!(other.volumes().unwrap(), vec![]);
        assert_eq!(other.revision().unwrap(), 0);
        assert_eq!(other.allocate_volume_id().unwrap(), FIRST_VOLUME_ID);
    }

    #[test]
    fn concurrent_writers() {
        let server = EtcdServer::start();
        let first = connect(&server, "/ferrite/race");
        let second = connect(&server, "/ferrite/race");
        check_concurrent_writers(&first, &second);
    }

    /// Records are stored in the embedded store's encoding: an old version loads, an unknown
    /// one is refused.
    #[test]
    fn records_are_versioned() {
        let server = EtcdServer::start();
        let store = connect(&server, "/ferrite/versions");
        put_raw(
            &store,
            "old",
            br#"{"version":1,"id":3,"name":"old","size_bytes":1048576,"uuid":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"created_unix_ms":5,"chunks":[[0,0]]}"#,
        );
        let old = store.volume(&VolumeName::new("old").unwrap()).unwrap().unwrap();
        assert_eq!((old.id, old.host_access), (3, HostAccess::Open));

        put_raw(&store, "future", br#"{"version":99}"#);
        let future = VolumeName::new("future").unwrap();
        assert!(matches!(store.volume(&future), Err(MetaError::RecordVersionUnsupported { .. })));
        assert!(matches!(store.volumes(), Err(MetaError::RecordVersionUnsupported { .. })));
        assert!(matches!(
            store.delete_volume(&future),
            Err(MetaError::RecordVersionUnsupported { .. })
        ));

        // Snapshot records too; and a key below the snapshots that names no snapshot.
        store
            .call(|mut kv, keys| async move {
                kv.put(format!("{}old/future", keys.snapshots_dir()), r#"{"version":2}"#, None)
                    .await?;
                Ok(())
            })
            .unwrap();
        let snapshot = VolumeName::new("future").unwrap();
        let old_name = VolumeName::new("old").unwrap();
        let unsupported = |result: Result<(), MetaError>| {
            matches!(result, Err(MetaError::RecordVersionUnsupported { version: 2, .. }))
        };
        assert!(unsupported(store.snapshot(&old_name, &snapshot).map(drop)));
        assert!(unsupported(store.snapshots(&old_name).map(drop)));
        assert!(unsupported(store.delete_snapshot(&old_name, &snapshot).map(drop)));
        store
            .call(|mut kv, keys| async move {
                kv.delete(format!("{}old/future", keys.snapshots_dir()), None).await?;
                kv.put(format!("{}stray", keys.snapshots_dir()), "{}", None).await?;
                Ok(())
            })
            .unwrap();
        assert_eq!(store.snapshots(&old_name).unwrap(), vec![]);
        let error = store.all_snapshots().unwrap_err();
        assert!(
            matches!(&error, MetaError::RecordCorrupt { key, .. } if key == "stray"),
            "{error}"
        );
    }

    /// The node's API handlers call the store from inside tokio, on both kinds of runtime; the
    /// store must neither panic there (calls, drop) nor deadlock. And an etcd that goes away
    /// gives an error within the timeout.
    #[test]
    fn usable_inside_tokio_and_after_etcd_stops() {
        let mut server = EtcdServer::start();
        let endpoints = server.endpoints();
        let use_store = |prefix: &'static str| {
            let endpoints = endpoints.clone();
            async move {
                let store = EtcdStore::connect(&endpoints, prefix, TEST_TIMEOUT).unwrap();
                let before = store.revision().unwrap();
                let node = NodeRecord {
                    uuid: [2; 16],
                    drive_count: 1,
                    drive_size_bytes: 1 << 30,
                    created_unix_ms: 3,
                    external_drives: false,
                };
                assert!(store.put_node(&node).unwrap() > before);
                assert_eq!(store.node().unwrap(), Some(node));
                store
            }
        };
        let current_thread =
            tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        current_thread.block_on(async {
            let store = use_store("/ferrite/current-thread").await;
            drop(store);
        });
        let multi_thread = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let kept = multi_thread.block_on(async {
            let store = use_store("/ferrite/multi-thread").await;
            // On a worker thread, as a spawned API handler would.
            tokio::spawn(async move {
                store.volumes().unwrap();
                store
            })
            .await
            .unwrap()
        });

        server.stop();
        let started = Instant::now();
        let error = current_thread.block_on(async { kept.volumes().unwrap_err() });
        let elapsed = started.elapsed();
        assert!(matches!(error, MetaError::Unreachable { .. }), "{error}");
        assert!(error.to_string().contains(&endpoints[0]), "{error}");
        assert!(elapsed < TEST_TIMEOUT + ANSWER_GRACE, "took {elapsed:?}");
    }

    #[test]
    fn unreachable_etcd_is_a_clear_error_not_a_hang() {
        // A port nothing listens on: bound, then released.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let endpoints = vec![format!("http://127.0.0.1:{port}")];
        let started = Instant::now();
        let error = EtcdStore::connect(&endpoints, "/ferrite/none", TEST_TIMEOUT).err().unwrap();
        let elapsed = started.elapsed();
        assert!(matches!(error, MetaError::Unreachable { .. }), "{error}");
        let message = error.to_string();
        assert!(message.contains(&format!("cannot reach etcd at {}", endpoints[0])), "{message}");
        assert!(message.contains("is etcd running?"), "{message}");
        assert!(elapsed < TEST_TIMEOUT + ANSWER_GRACE, "took {elapsed:?}");

        // A peer that accepts connections and never answers: the timeout ends the wait.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoints = vec![format!("http://{}", silent.local_addr().unwrap())];
        let started = Instant::now();
        let error = EtcdStore::connect(&endpoints, "/ferrite/none", TEST_TIMEOUT).err().unwrap();
        let elapsed = started.elapsed();
        assert!(matches!(error, MetaError::Unreachable { .. }), "{error}");
        assert!(elapsed < TEST_TIMEOUT + ANSWER_GRACE, "took {elapsed:?}");
    }

    #[test]
    fn bad_settings_are_refused() {
        for prefix in [
            "",
            "/",
            "ferrite",
            "/ferrite/",
            "/a//b",
            "/a b",
            &format!("/{}", "a".repeat(PREFIX_LENGTH_MAX)),
        ] {
            assert!(check_prefix(prefix).is_err(), "{prefix:?}");
        }
        for prefix in ["/ferrite", "/ferrite/prod", "/x"] {
            assert!(check_prefix(prefix).is_ok(), "{prefix:?}");
        }
        let error = EtcdStore::connect(&[], "/ferrite/x", TEST_TIMEOUT).err().unwrap();
        assert!(matches!(error, MetaError::Config { .. }), "{error}");
        let endpoints = vec!["http://127.0.0.1:1".to_owned()];
        let error = EtcdStore::connect(&endpoints, "/ferrite/x", Duration::ZERO).err().unwrap();
        assert!(matches!(error, MetaError::Config { .. }), "{error}");
    }
}
