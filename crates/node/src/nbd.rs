//! The NBD frontend of a node: every volume open to any host is also an NBD export, served by
//! the same data-path threads, stores and volume fencing as NVMe/TCP.
//!
//! Hot path (the connection driver). The acceptor on thread 0 hands each NBD connection to a
//! data-path thread round robin, over the same bounded channels as NVMe/TCP
//! ([`crate::nvme::Handoff::Nbd`]). Per connection one task owns the socket and the sans-IO
//! [`nbd::server::Connection`]: it feeds the connection the bytes it reads, starts a storage
//! task for each request the connection hands out (on this thread's `LogHandle`), hands the
//! results back, and writes the connection's output with non-blocking vectored writes (a read's
//! data goes out from its own buffer, after its reply header, never copied). The connection
//! bounds what is in flight (`nbd::server::INFLIGHT_REQUESTS_MAX` requests and
//! `INFLIGHT_PAYLOAD_BYTES_MAX` bytes), so the driver holds at most that many storage tasks.
//!
//! Exports. A volume's export name is the volume name, its size the volume's size when the
//! client connects (a volume grown later shows its new size on new connections), and it is
//! writable. Each snapshot of an exported volume is a read-only export named `VOLUME@SNAPSHOT`
//! (as `ferrite volume create --from-snapshot` names it; volume names never contain `@`): the
//! server advertises NBD_FLAG_READ_ONLY and answers writes, trims and zeroings with EPERM. Host
//! access control is per host NQN, which an NBD client cannot present, so a volume restricted
//! to listed hosts is not exported, nor are its snapshots: they are left out of NBD_OPT_LIST,
//! and NBD_OPT_INFO/GO name them with NBD_REP_ERR_POLICY and a message saying why
//! (NBD_OPT_EXPORT_NAME, which cannot be refused, closes the connection). A volume that becomes
//! restricted while NBD clients are connected closes their connections, its snapshots' too, as
//! NVMe/TCP disconnects the controllers of hosts it no longer allows; deleting a snapshot drains
//! its reads, then closes its connections.
//!
//! Durability. A write completes only once durable (group commit), so FUA needs nothing more
//! and FLUSH has nothing left to do; both are still passed on as the store defines them.
//! TRIM deallocates. WRITE_ZEROES deallocates too, also with NBD_CMD_FLAG_NO_HOLE: volumes are
//! thin and the log never overwrites in place, so keeping blocks "allocated" would reserve
//! nothing for later writes, which is what the flag is for; the range reads as zeros either way.
//!
//! Fencing. Every request goes through [`VolumeHandle::begin`]/[`VolumeHandle::end`], so
//! deleting or rolling back a volume drains NBD I/O exactly like NVMe/TCP I/O. A request that
//! finds its volume fenced waits (bounded by [`FENCED_WAIT_MS_MAX`]): a rollback ends and the
//! request goes on, while a deleted volume's requests fail with ESHUTDOWN. A connection whose
//! volume was deleted stops reading, lets its in-flight requests finish with errors, and closes.
//!
//! Replicated volumes. NVMe/TCP answers a command this node cannot serve now (its lease lapsed,
//! another node took over) with an ANA path error, and the host's multipath retries it on a
//! path that serves or once this one does. An NBD client has no second path and takes any error
//! as the end of its I/O (ext4 remounts read-only, a database stops). So a request to a
//! replicated volume that this node served within [`NOT_SERVING_WAIT_MS_MAX`] and refuses as not
//! serving is sent again every [`NOT_SERVING_POLL_MS`] until it is served or that time has
//! passed since it arrived (then EIO): a lease renewal held up by a stalled disk or etcd costs
//! the client that much latency, not an error. A node that never served the volume (a replica's
//! NBD port), or that knows another node serves it now (a failover), refuses at once, as does a
//! volume being deleted.

use crate::metrics::VolumeMetrics;
use crate::nvme::{
    close_gracefully, now_ms, socket_ready, try_write_chunks, Handoff, NodeCatalog, Poller,
    VolumeHandle,
};
use crate::DataPlaneError;
use engine::log::LogHandle;
use engine::{StoreError, VolumeMap, VolumeStore};
use io::DriveFile;
use nbd::server::{Catalog, Connection, ExportInfo, Request, RequestId, RequestKind};
use nbd::wire::Errno;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use types::{AlignedBuf, LOGICAL_BLOCK_SIZE_BYTES};

/// Bytes read from a socket at once. The connection copies write data into its own buffers as
/// it arrives, so this need not hold a whole request.
const RECEIVE_BUFFER_BYTES: usize = 256 * 1024;
/// How often a connection checks its handshake deadline and whether its volume is still
/// exported.
const CONNECTION_TICK_MS: u64 = 200;
/// How long a request waits for its fenced volume (a rollback or a deletion in progress) before
/// it fails with EIO: the control plane's drain timeout plus its engine operation timeout.
pub const FENCED_WAIT_MS_MAX: u64 = 60_000;
/// How often a waiting request looks at its fenced volume again.
const FENCED_POLL_MS: u64 = 2;
/// How long a request to a replicated volume waits, sent again, while this node refuses it as
/// not serving, if this node served the volume within that time (module docs): over three
/// default leases (`--lease-ms` 3000), so a lapse until the next renewal is covered, and well
/// under the Linux NBD client's 30 s request timeout.
pub const NOT_SERVING_WAIT_MS_MAX: u64 = 10_000;
/// How often a request waiting for its volume to be served again is sent again.
const NOT_SERVING_POLL_MS: u64 = 20;
/// Pause after a failed accept (out of descriptors and the like) instead of spinning.
const ACCEPT_RETRY_PAUSE_MS: u64 = 100;
/// What `nbdinfo` shows as a volume's export's description.
const EXPORT_DESCRIPTION: &str = "Ferrite volume";
/// What `nbdinfo` shows as a snapshot's export's description.
const SNAPSHOT_EXPORT_DESCRIPTION: &str = "Ferrite snapshot (read-only)";
/// Between a volume's name and its snapshot's in a snapshot's export name.
const SNAPSHOT_SEPARATOR: char = '@';

// A volume's size is whole logical blocks, which NBD's minimum block size divides.
const _: () = assert!(LOGICAL_BLOCK_SIZE_BYTES % nbd::server::BLOCK_BYTES_MIN == 0);

/// Binds the NBD listener. The error says what to pass instead.
pub(crate) fn bind(address: SocketAddr) -> Result<std::net::TcpListener, DataPlaneError> {
    let listener = std::net::TcpListener::bind(address).map_err(|error| {
        if error.kind() == std::io::ErrorKind::AddrInUse {
            DataPlaneError::failed(format!(
                "NBD port {} in use on {}: pass --nbd-listen ADDR or off",
                address.port(),
                address.ip()
            ))
        } else {
            DataPlaneError::failed(format!(
                "cannot listen for NBD on {address}: {error}; pass --nbd-listen ADDR or off"
            ))
        }
    })?;
    listener.set_nonblocking(true).map_err(DataPlaneError::failed)?;
    Ok(listener)
}

/// Accepts NBD connections on thread 0 and deals them out to the data-path threads, taking
/// turns with the NVMe/TCP acceptors (`next` is shared).
pub(crate) async fn accept_loop(
    listener: TcpListener,
    senders: Vec<mpsc::Sender<Handoff>>,
    next: Rc<Cell<usize>>,
    mut stop: watch::Receiver<bool>,
) {
    assert!(!senders.is_empty(), "no data-path thread to hand NBD connections to");
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(error) => {
                tracing::warn!(%error, "accepting an NBD connection failed");
                tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_PAUSE_MS)).await;
                continue;
            }
        };
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%peer, %error, "cannot hand over an NBD connection");
                continue;
            }
        };
        let turn = next.get();
        next.set(turn.wrapping_add(1));
        let sender = &senders[turn % senders.len()];
        if sender.send(Handoff::Nbd { stream }).await.is_err() {
            return;
        }
    }
}

/// The node's volumes as NBD clients see them. Asked during handshakes only, never per I/O.
pub(crate) struct NbdCatalog {
    volumes: Arc<NodeCatalog>,
}

impl NbdCatalog {
    pub(crate) fn new(volumes: Arc<NodeCatalog>) -> Self {
        Self { volumes }
    }
}

/// Whether a served volume is exported over NBD, and why not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exported {
    Yes,
    /// Restricted to listed host NQNs.
    Restricted,
    /// Fenced: being deleted (or rolled back; a new connection may try again).
    Fenced,
}

/// Whether the volume or snapshot served with `handle` is exported over NBD. `access_id` is the
/// id whose host access rules it (a snapshot's volume's), `None` once that volume is gone.
fn exported(volumes: &NodeCatalog, access_id: Option<u64>, handle: &VolumeHandle) -> Exported {
    let Some(access_id) = access_id else {
        // A snapshot whose volume is no longer served: the volume is being deleted.
        return Exported::Fenced;
    };
    if handle.fenced.load(Ordering::Acquire) {
        return Exported::Fenced;
    }
    match volumes.host_access_read().get(&access_id) {
        Some(access) if access.is_open() => Exported::Yes,
        _ => Exported::Restricted,
    }
}

/// The id whose host access rules `handle`, served as `id`: its own for a volume, its volume's
/// for a snapshot (`None` once that volume is no longer served).
fn access_id(volumes: &NodeCatalog, id: u64, handle: &VolumeHandle) -> Option<u64> {
    match handle.snapshot {
        None => Some(id),
        Some(_) => volumes.volume_id(&handle.name),
    }
}

/// The export name of what `handle` serves: `VOLUME`, or `VOLUME@SNAPSHOT`.
fn export_name(handle: &VolumeHandle) -> String {
    match &handle.snapshot {
        None => handle.name.as_str().to_owned(),
        Some(snapshot) => format!("{}{SNAPSHOT_SEPARATOR}{snapshot}", handle.name),
    }
}

fn export_info(handle: &VolumeHandle) -> ExportInfo {
    let size_blocks = handle.size_blocks.load(Ordering::Acquire);
    let read_only = handle.snapshot.is_some();
    ExportInfo {
        name: export_name(handle),
        size_bytes: size_blocks * u64::from(LOGICAL_BLOCK_SIZE_BYTES),
        read_only,
        description: if read_only { SNAPSHOT_EXPORT_DESCRIPTION } else { EXPORT_DESCRIPTION }
            .to_owned(),
    }
}

/// The served volume or snapshot whose export name is `name`, with its id.
fn find(volumes: &NodeCatalog, name: &str) -> Option<(u64, Arc<VolumeHandle>)> {
    let found = match name.split_once(SNAPSHOT_SEPARATOR) {
        None => volumes
            .read()
            .iter()
            .find(|(_, handle)| handle.name.as_str() == name)
            .map(|(id, handle)| (*id, Arc::clone(handle))),
        Some((volume, snapshot)) => volumes
            .snapshots_read()
            .iter()
            .find(|(_, handle)| {
                handle.name.as_str() == volume
                    && handle.snapshot.as_ref().is_some_and(|name| name.as_str() == snapshot)
            })
            .map(|(id, handle)| (*id, Arc::clone(handle))),
    };
    found
}

impl Catalog for NbdCatalog {
    fn list(&self) -> Vec<ExportInfo> {
        // Lock order: the volumes, then the snapshots, then host access (inside `exported`).
        let served = self.volumes.read();
        let snapshots = self.volumes.snapshots_read();
        let volume_ids: std::collections::HashMap<&types::VolumeName, u64> =
            served.iter().map(|(id, handle)| (&handle.name, *id)).collect();
        let volumes = served
            .iter()
            .filter(|(id, handle)| exported(&self.volumes, Some(**id), handle) == Exported::Yes);
        let snapshots = snapshots.values().filter(|handle| {
            let access_id = volume_ids.get(&handle.name).copied();
            exported(&self.volumes, access_id, handle) == Exported::Yes
        });
        let mut exports: Vec<ExportInfo> = volumes
            .map(|(_, handle)| handle)
            .chain(snapshots)
            .map(|handle| export_info(handle))
            .collect();
        exports.sort_by(|a, b| a.name.cmp(&b.name));
        exports
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        let (id, handle) = find(&self.volumes, name)?;
        let access_id = access_id(&self.volumes, id, &handle);
        (exported(&self.volumes, access_id, &handle) == Exported::Yes).then(|| export_info(&handle))
    }

    fn refusal(&self, name: &str) -> Option<String> {
        let (id, handle) = find(&self.volumes, name)?;
        let volume = &handle.name;
        let exported = exported(&self.volumes, access_id(&self.volumes, id, &handle), &handle);
        match (exported, &handle.snapshot) {
            (Exported::Yes, _) => None,
            (Exported::Restricted, None) => Some(format!(
                "volume {volume} is restricted to NVMe hosts (its host access lists host NQNs, \
                 which NBD clients cannot present), so it is not exported over NBD: attach it \
                 over NVMe/TCP, or open it to every host with `ferrite host allow {volume} any`"
            )),
            (Exported::Restricted, Some(_)) => Some(format!(
                "snapshot {name} is not exported over NBD: its volume {volume} is restricted to \
                 NVMe hosts (its host access lists host NQNs, which NBD clients cannot present), \
                 and a snapshot admits its volume's hosts; attach it over NVMe/TCP as {}, or \
                 open the volume to every host with `ferrite host allow {volume} any`",
                handle.nqn()
            )),
            (Exported::Fenced, None) => Some(format!(
                "volume {volume} is being deleted or rolled back; try again if it still exists"
            )),
            (Exported::Fenced, Some(_)) => Some(format!(
                "snapshot {name} is being deleted, or its volume is; try again if it still exists"
            )),
        }
    }
}

/// A storage result on its way back to the connection task.
struct Completion {
    id: RequestId,
    result: Result<(), Errno>,
    buf: Option<AlignedBuf>,
}

#[derive(Default)]
struct Completions {
    done: RefCell<VecDeque<Completion>>,
    notify: Notify,
}

impl Completions {
    fn push(&self, completion: Completion) {
        self.done.borrow_mut().push_back(completion);
        self.notify.notify_one();
    }
}

/// Serves one NBD connection until the client leaves, the protocol ends it, its volume is
/// deleted or closed to NBD, or the node stops.
pub(crate) async fn serve_connection(
    stream: std::net::TcpStream,
    volumes: Arc<NodeCatalog>,
    store: Rc<LogHandle<DriveFile>>,
    poller: Rc<Poller>,
    mut stop: watch::Receiver<bool>,
) {
    let peer = stream.peer_addr().map_or_else(|_| "unknown".to_owned(), |addr| addr.to_string());
    let stream = match stream.set_nonblocking(true).and_then(|()| TcpStream::from_std(stream)) {
        Ok(stream) => stream,
        Err(error) => {
            tracing::warn!(%peer, %error, "cannot serve an NBD connection");
            return;
        }
    };
    let _ = stream.set_nodelay(true);
    let clock = Instant::now();
    let catalog = Arc::new(NbdCatalog::new(Arc::clone(&volumes)));
    let mut connection = Connection::new(catalog, now_ms(clock));
    let completions = Rc::new(Completions::default());
    let mut input = vec![0u8; RECEIVE_BUFFER_BYTES];
    let mut filled = 0usize;
    // The export's volume, found when transmission starts.
    let mut volume: Option<(u64, Arc<VolumeHandle>)> = None;
    // Set once the volume is deleted or closed to NBD: every request fails with it, nothing more
    // is read, and the connection closes when its in-flight requests are answered.
    let mut refusal: Option<Errno> = None;
    // The catalog's change count when the volume was last checked.
    let mut checked_changes = volumes.changes();
    let mut inflight = 0usize;
    let mut tick = tokio::time::interval(Duration::from_millis(CONNECTION_TICK_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut socket_failed = false;

    loop {
        // Hand finished storage work back to the connection.
        loop {
            let Some(done) = completions.done.borrow_mut().pop_front() else { break };
            inflight -= 1;
            connection.complete(done.id, done.result, done.buf);
        }
        // Offer the input, even with no new bytes: completions may have made room.
        if !connection.wants_close() && refusal.is_none() {
            match connection.receive(&input[..filled]) {
                Ok(used) => {
                    input.copy_within(used..filled, 0);
                    filled -= used;
                }
                Err(reason) => {
                    // A client's mistake, not the server's error.
                    tracing::info!(%peer, %reason, "closing NBD connection");
                    filled = 0;
                }
            }
        }
        if volume.is_none() && refusal.is_none() {
            if let Some(export) = connection.export() {
                match find(&volumes, &export.name) {
                    Some(found) => {
                        tracing::debug!(%peer, export = %export.name, "NBD client attached");
                        volume = Some(found);
                    }
                    None => refusal = Some(Errno::Shutdown),
                }
            }
        }
        // Before starting requests: a deletion or access change that completed before they
        // were sent refuses them (one atomic load while nothing changes).
        if let (Some((id, handle)), None) = (&volume, refusal) {
            let changes = volumes.changes();
            if changes != checked_changes {
                checked_changes = changes;
                refusal = still_exported(&volumes, *id, handle);
                log_refusal(&peer, handle, refusal);
            }
        }
        // Start the storage work the connection asks for.
        while let Some(request) = connection.next_request() {
            inflight += 1;
            match (&volume, refusal) {
                (Some((_, handle)), None) => {
                    start_request(request, handle, &volumes, &store, &completions);
                }
                (_, refusal) => {
                    let buf = take_buffer(request.kind);
                    let result = Err(refusal.unwrap_or(Errno::Shutdown));
                    completions.push(Completion { id: request.id, result, buf });
                }
            }
        }
        // Send what is pending, as far as the socket takes it now: reply bytes and read
        // buffers together, in vectored writes.
        while connection.output_len() > 0 {
            match try_write_chunks(&stream, connection.output_chunks()) {
                Ok(0) => {
                    socket_failed = true;
                    break;
                }
                Ok(written) => connection.consume_output(written),
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(error) => {
                    tracing::debug!(%peer, %error, "NBD connection write failed");
                    socket_failed = true;
                    break;
                }
            }
        }
        let output_sent = connection.output_len() == 0;
        if socket_failed
            || (connection.wants_close() && output_sent)
            || (refusal.is_some() && inflight == 0 && output_sent)
        {
            break;
        }
        let want_write = !output_sent;
        let want_read = !connection.wants_close() && refusal.is_none() && filled < input.len();
        let ready = socket_ready(&stream, want_read, want_write);
        tokio::select! {
            biased;
            _ = completions.notify.notified(), if inflight > 0 => continue,
            ready = ready => {
                let ready = match ready {
                    Ok(Some(ready)) => ready,
                    Ok(None) => continue,
                    Err(error) => {
                        tracing::debug!(%peer, %error, "NBD connection failed");
                        break;
                    }
                };
                if ready.is_readable() && want_read {
                    match stream.try_read(&mut input[filled..]) {
                        // The client is gone; its in-flight requests finish into the void.
                        Ok(0) => break,
                        Ok(read) => {
                            poller.touch();
                            filled += read;
                        }
                        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(error) => {
                            tracing::debug!(%peer, %error, "NBD connection read failed");
                            break;
                        }
                    }
                }
            }
            _ = tick.tick() => {
                if connection.handshake_expired(now_ms(clock)) {
                    tracing::info!(%peer, "NBD client chose no export in time: closing");
                    break;
                }
                if let (Some((id, handle)), None) = (&volume, refusal) {
                    checked_changes = volumes.changes();
                    refusal = still_exported(&volumes, *id, handle);
                    log_refusal(&peer, handle, refusal);
                }
            }
            _ = stop.changed() => break,
        }
    }
    close_gracefully(stream).await;
}

fn log_refusal(peer: &str, handle: &VolumeHandle, refusal: Option<Errno>) {
    if let Some(errno) = refusal {
        tracing::info!(
            %peer,
            export = %export_name(handle),
            %errno,
            "closing NBD connection: its volume or snapshot is deleted, or the volume is no \
             longer open to every host"
        );
    }
}

/// None while the connection's volume (or snapshot) is served and open to every host (its
/// volume is); else the error its requests get from now on: ESHUTDOWN once deleted (a snapshot's
/// volume too), EPERM once restricted to listed hosts.
fn still_exported(volumes: &NodeCatalog, id: u64, handle: &Arc<VolumeHandle>) -> Option<Errno> {
    match volumes.get(id) {
        Some(served) if Arc::ptr_eq(&served, handle) => {
            let Some(access_id) = access_id(volumes, id, handle) else {
                return Some(Errno::Shutdown);
            };
            match volumes.host_access_read().get(&access_id) {
                Some(access) if access.is_open() => None,
                _ => Some(Errno::Perm),
            }
        }
        _ => Some(Errno::Shutdown),
    }
}

/// The data buffer a request carries, handed back with its completion for reuse.
fn take_buffer(kind: RequestKind) -> Option<AlignedBuf> {
    match kind {
        RequestKind::Read { buf, .. } => Some(buf),
        RequestKind::Write { data, .. } => Some(data),
        RequestKind::Flush | RequestKind::Trim { .. } | RequestKind::WriteZeroes { .. } => None,
    }
}

/// Starts one request as a task on this thread; its completion goes to `completions`.
fn start_request(
    request: Request,
    handle: &Arc<VolumeHandle>,
    volumes: &Arc<NodeCatalog>,
    store: &Rc<LogHandle<DriveFile>>,
    completions: &Rc<Completions>,
) {
    let handle = Arc::clone(handle);
    let store = Rc::clone(store);
    let completions = Rc::clone(completions);
    let Request { id, kind, .. } = request;
    if handle.begin() {
        tokio::task::spawn_local(run_admitted(id, kind, handle, store, completions));
        return;
    }
    // The volume is fenced: wait for a rollback to end, or fail once it is deleted.
    let volumes = Arc::clone(volumes);
    tokio::task::spawn_local(async move {
        match wait_admission(&handle, &volumes).await {
            Ok(()) => run_admitted(id, kind, handle, store, completions).await,
            Err(errno) => {
                handle.metrics.record_error();
                completions.push(Completion { id, result: Err(errno), buf: take_buffer(kind) });
            }
        }
    });
}

/// Runs a request registered with [`VolumeHandle::begin`], ends it, and reports its completion.
async fn run_admitted(
    id: RequestId,
    kind: RequestKind,
    handle: Arc<VolumeHandle>,
    store: Rc<LogHandle<DriveFile>>,
    completions: Rc<Completions>,
) {
    let started = Instant::now();
    let (result, buf) = match &handle.route {
        Some(route) => {
            let patient = UntilServed {
                store: &route.with_local(&store),
                fenced: &handle.fenced,
                served_recently: || route.served_within_ms(NOT_SERVING_WAIT_MS_MAX),
                started,
            };
            execute(&patient, &handle.map, kind).await
        }
        None => execute(&*store, &handle.map, kind).await,
    };
    let latency_us = crate::metrics::micros(started.elapsed());
    record(&handle.metrics, &result, latency_us);
    handle.end();
    let result = result.map(|_| ()).map_err(|error| errno(&error));
    completions.push(Completion { id, result, buf });
}

/// Registers one I/O on a fenced volume once its fence lifts (a rollback ended): Ok, and the
/// caller must [`VolumeHandle::end`] it. Fails with ESHUTDOWN once the volume is no longer
/// served (deleted), or with EIO if it stays fenced for [`FENCED_WAIT_MS_MAX`].
async fn wait_admission(handle: &Arc<VolumeHandle>, volumes: &NodeCatalog) -> Result<(), Errno> {
    let id = handle.map.volume().0;
    let deadline = Instant::now() + Duration::from_millis(FENCED_WAIT_MS_MAX);
    // Bounded by the deadline.
    loop {
        if handle.begin() {
            return Ok(());
        }
        let served = volumes.get(id).is_some_and(|served| Arc::ptr_eq(&served, handle));
        if !served {
            return Err(Errno::Shutdown);
        }
        if Instant::now() >= deadline {
            return Err(Errno::Io);
        }
        tokio::time::sleep(Duration::from_millis(FENCED_POLL_MS)).await;
    }
}

/// A replicated volume's store as NBD requests use it: a command refused as not serving is sent
/// again while this node served the volume recently, until [`NOT_SERVING_WAIT_MS_MAX`] after
/// the request arrived (module docs).
struct UntilServed<'a, S, F> {
    store: &'a S,
    /// The volume's fence: set while it is deleted (the request then stops waiting).
    fenced: &'a std::sync::atomic::AtomicBool,
    /// Whether this node served the volume within the wait.
    served_recently: F,
    started: Instant,
}

impl<S, F: Fn() -> bool> UntilServed<'_, S, F> {
    /// After an answer: whether to send the command again, once a poll interval has passed.
    async fn again<T>(&self, result: &Result<T, StoreError>) -> bool {
        let waiting = Duration::from_millis(NOT_SERVING_WAIT_MS_MAX);
        let retry = matches!(result, Err(StoreError::NotServing { .. }))
            && self.started.elapsed() < waiting
            && !self.fenced.load(Ordering::SeqCst)
            && (self.served_recently)();
        if retry {
            tokio::time::sleep(Duration::from_millis(NOT_SERVING_POLL_MS)).await;
        }
        retry
    }

    /// Sends `command` (given what it carries, handed back with its answer) until `again` says
    /// no, which it does at the latest NOT_SERVING_WAIT_MS_MAX after the request arrived.
    async fn until_served<B, T, Sent>(
        &self,
        mut carried: B,
        mut command: impl FnMut(B) -> Sent,
    ) -> (Result<T, StoreError>, B)
    where
        Sent: std::future::Future<Output = (Result<T, StoreError>, B)>,
    {
        loop {
            let (result, back) = command(carried).await;
            carried = back;
            if !self.again(&result).await {
                return (result, carried);
            }
        }
    }
}

impl<S: VolumeStore, F: Fn() -> bool> VolumeStore for UntilServed<'_, S, F> {
    async fn read(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        self.until_served(buf, |buf| self.store.read(volume, offset_bytes, buf)).await
    }

    async fn write(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        self.until_served(buf, |buf| self.store.write(volume, offset_bytes, buf)).await
    }

    async fn flush(&self, volume: &VolumeMap) -> Result<(), StoreError> {
        self.until_served((), |()| async { (self.store.flush(volume).await, ()) }).await.0
    }

    async fn write_zeroes(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError> {
        let zero = |()| async move {
            (self.store.write_zeroes(volume, offset_bytes, length_bytes).await, ())
        };
        self.until_served((), zero).await.0
    }

    async fn deallocate(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError> {
        let deallocate = |()| async move {
            (self.store.deallocate(volume, offset_bytes, length_bytes).await, ())
        };
        self.until_served((), deallocate).await.0
    }
}

/// What a request did, for metrics.
enum Done {
    Read(u64),
    Written(u64),
    Flushed,
    Zeroed(u64),
    Deallocated(u64),
}

async fn execute(
    store: &impl VolumeStore,
    map: &VolumeMap,
    kind: RequestKind,
) -> (Result<Done, StoreError>, Option<AlignedBuf>) {
    match kind {
        RequestKind::Read { offset, buf } => {
            let length = buf.len() as u64;
            let (result, buf) = store.read(map, offset, buf).await;
            (result.map(|()| Done::Read(length)), Some(buf))
        }
        // A write completes only once durable, which is what FUA asks for.
        RequestKind::Write { offset, data, fua: _ } => {
            let length = data.len() as u64;
            let (result, data) = store.write(map, offset, data).await;
            (result.map(|()| Done::Written(length)), Some(data))
        }
        RequestKind::Flush => (store.flush(map).await.map(|()| Done::Flushed), None),
        RequestKind::Trim { offset, length_bytes, fua: _ } => {
            let length = u64::from(length_bytes);
            (store.deallocate(map, offset, length).await.map(|()| Done::Deallocated(length)), None)
        }
        // NO_HOLE is served the same way: see the module comment.
        RequestKind::WriteZeroes { offset, length_bytes, fua: _, no_hole: _ } => {
            let length = u64::from(length_bytes);
            (store.write_zeroes(map, offset, length).await.map(|()| Done::Zeroed(length)), None)
        }
    }
}

fn record(metrics: &VolumeMetrics, result: &Result<Done, StoreError>, latency_us: u64) {
    match result {
        Ok(Done::Read(bytes)) => metrics.record_read(*bytes, latency_us),
        Ok(Done::Written(bytes)) => metrics.record_write(*bytes, latency_us),
        Ok(Done::Flushed) => metrics.record_flush(),
        Ok(Done::Zeroed(bytes)) => metrics.record_write_zeroes(*bytes),
        Ok(Done::Deallocated(bytes)) => metrics.record_deallocate(*bytes),
        Err(_) => metrics.record_error(),
    }
}

/// The error an NBD client sees for a store error.
fn errno(error: &StoreError) -> Errno {
    match error {
        StoreError::OutOfRange { .. } | StoreError::Unaligned { .. } => Errno::Invalid,
        StoreError::VolumeRemoved { .. } => Errno::Shutdown,
        StoreError::CapacityExceeded { .. } => Errno::NoSpace,
        StoreError::ReadOnly { .. } => Errno::Perm,
        // NBD has no second path: after waiting for this node to serve again (`UntilServed`),
        // the client sees an I/O error.
        StoreError::NotServing { .. } => Errno::Io,
        StoreError::ChecksumMismatch { .. }
        | StoreError::Unrecovered { .. }
        | StoreError::DriveFailed { .. }
        | StoreError::Io { .. } => Errno::Io,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::{VolumeId, Volumes};
    use meta::{HostAccess, VolumeRecord};

    const MIB: u64 = 1 << 20;

    fn record(id: u64, name: &str, size_bytes: u64, host_access: HostAccess) -> VolumeRecord {
        VolumeRecord {
            id,
            name: types::VolumeName::new(name).unwrap(),
            size_bytes,
            uuid: [id as u8; 16],
            created_unix_ms: 0,
            chunks: Vec::new(),
            host_access,
            origin: None,
            compression: meta::Compression::default(),
            path_states: Default::default(),
        }
    }

    /// A catalog serving `records`, as the data path does.
    fn serving(records: &[VolumeRecord]) -> Arc<NodeCatalog> {
        let volumes = Volumes::new();
        let layouts = records.iter().map(|record| engine::VolumeLayout {
            volume: VolumeId(record.id),
            size_bytes: record.size_bytes,
        });
        volumes.restore(layouts.collect()).unwrap();
        let catalog = Arc::new(NodeCatalog::default());
        for record in records {
            let map = volumes.mapping(VolumeId(record.id)).unwrap();
            catalog.insert(record, map, Arc::default());
        }
        catalog
    }

    fn host() -> types::Nqn {
        types::Nqn::new("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001")
            .unwrap()
    }

    /// What NBD_OPT_LIST shows: (name, size, read-only) of each export.
    fn listed(catalog: &NbdCatalog) -> Vec<(String, u64, bool)> {
        catalog
            .list()
            .into_iter()
            .map(|export| (export.name, export.size_bytes, export.read_only))
            .collect()
    }

    #[test]
    fn open_volumes_are_exported_and_restricted_ones_say_why() {
        let restricted = HostAccess::Restricted([host()].into());
        let volumes = serving(&[
            record(1, "beta", 64 * MIB, HostAccess::Open),
            record(2, "alpha", 8 * MIB, HostAccess::Open),
            record(3, "locked", 16 * MIB, restricted),
        ]);
        let catalog = NbdCatalog::new(Arc::clone(&volumes));
        let listed = listed(&catalog);
        assert_eq!(
            listed,
            [("alpha".to_owned(), 8 * MIB, false), ("beta".to_owned(), 64 * MIB, false)]
        );
        assert_eq!(catalog.lookup("beta").map(|export| export.size_bytes), Some(64 * MIB));
        assert_eq!(catalog.refusal("beta"), None);
        assert_eq!(catalog.lookup("locked"), None);
        let refusal = catalog.refusal("locked").unwrap();
        assert!(refusal.contains("restricted to NVMe hosts"), "{refusal}");
        assert!(refusal.contains("ferrite host allow locked any"), "{refusal}");
        assert_eq!(catalog.lookup("nope"), None);
        assert_eq!(catalog.refusal("nope"), None);
        assert_eq!(catalog.lookup(""), None);

        // A grown volume shows its new size to new connections.
        volumes.get(1).unwrap().size_blocks.store(128 * MIB / 4096, Ordering::Release);
        assert_eq!(catalog.lookup("beta").map(|export| export.size_bytes), Some(128 * MIB));

        // A fenced volume (being deleted) is neither listed nor looked up.
        volumes.get(2).unwrap().fenced.store(true, Ordering::SeqCst);
        assert_eq!(catalog.lookup("alpha"), None);
        assert!(catalog.refusal("alpha").unwrap().contains("being deleted"));
        assert_eq!(catalog.list().len(), 1);

        // Opening the restricted volume exports it.
        volumes.set_host_access(3, HostAccess::Open);
        assert!(catalog.lookup("locked").is_some());
    }

    fn snapshot(id: u64, volume: &str, name: &str, size_bytes: u64) -> meta::SnapshotRecord {
        meta::SnapshotRecord {
            id,
            volume: types::VolumeName::new(volume).unwrap(),
            name: types::VolumeName::new(name).unwrap(),
            size_bytes,
            uuid: [id as u8; 16],
            created_unix_ms: 0,
        }
    }

    #[test]
    fn snapshots_of_open_volumes_are_read_only_exports() {
        let restricted = HostAccess::Restricted([host()].into());
        let volumes = serving(&[
            record(1, "db", 64 * MIB, HostAccess::Open),
            record(2, "locked", 16 * MIB, restricted),
        ]);
        volumes.insert_snapshot(&snapshot(3, "db", "nightly", 32 * MIB), Arc::default());
        volumes.insert_snapshot(&snapshot(4, "locked", "before", 16 * MIB), Arc::default());
        let catalog = NbdCatalog::new(Arc::clone(&volumes));
        let listed = listed(&catalog);
        assert_eq!(
            listed,
            [("db".to_owned(), 64 * MIB, false), ("db@nightly".to_owned(), 32 * MIB, true)]
        );
        let export = catalog.lookup("db@nightly").unwrap();
        assert!(export.read_only && export.description.contains("snapshot"), "{export:?}");
        assert_eq!(catalog.refusal("db@nightly"), None);
        // Names that are not a served snapshot are unknown, not refused.
        for name in ["db@", "@nightly", "db@other", "nightly@db", "db@nightly@x", "db@nightly "] {
            assert_eq!(catalog.lookup(name), None, "{name}");
            assert_eq!(catalog.refusal(name), None, "{name}");
        }

        // A restricted volume's snapshot is refused with the reason and the NVMe way in.
        assert_eq!(catalog.lookup("locked@before"), None);
        let refusal = catalog.refusal("locked@before").unwrap();
        assert!(refusal.contains("restricted to NVMe hosts"), "{refusal}");
        assert!(refusal.contains("snap:locked:before"), "{refusal}");
        assert!(refusal.contains("ferrite host allow locked any"), "{refusal}");
        volumes.set_host_access(2, HostAccess::Open);
        assert!(catalog.lookup("locked@before").is_some());

        // A connection to a snapshot follows its volume's access, then the snapshot's deletion.
        let nightly = volumes.get(3).unwrap();
        assert_eq!(still_exported(&volumes, 3, &nightly), None);
        volumes.set_host_access(1, HostAccess::Restricted([host()].into()));
        assert_eq!(still_exported(&volumes, 3, &nightly), Some(Errno::Perm));
        assert!(catalog.list().iter().all(|export| !export.name.starts_with("db")));
        volumes.set_host_access(1, HostAccess::Open);
        assert_eq!(still_exported(&volumes, 3, &nightly), None);
        nightly.fenced.store(true, Ordering::SeqCst);
        assert_eq!(catalog.lookup("db@nightly"), None);
        assert!(catalog.refusal("db@nightly").unwrap().contains("being deleted"));
        let changes = volumes.changes();
        volumes.remove_snapshot(3);
        assert!(volumes.changes() > changes, "a snapshot's removal is a change connections see");
        assert_eq!(still_exported(&volumes, 3, &nightly), Some(Errno::Shutdown));
        assert_eq!(catalog.lookup("db@nightly"), None);

        // A snapshot whose volume is gone is not exported.
        let before = volumes.get(4).unwrap();
        volumes.remove(2);
        assert_eq!(still_exported(&volumes, 4, &before), Some(Errno::Shutdown));
        assert_eq!(catalog.lookup("locked@before"), None);
        assert!(catalog.list().iter().all(|export| export.name != "locked@before"));
    }

    #[test]
    fn connections_learn_that_their_volume_went_away() {
        let volumes = serving(&[
            record(1, "gone", 8 * MIB, HostAccess::Open),
            record(2, "closing", 8 * MIB, HostAccess::Open),
        ]);
        let gone = volumes.get(1).unwrap();
        let closing = volumes.get(2).unwrap();
        assert_eq!(still_exported(&volumes, 1, &gone), None);
        volumes.remove(1);
        assert_eq!(still_exported(&volumes, 1, &gone), Some(Errno::Shutdown));
        // Another volume of the same id is not this connection's volume.
        let again = serving(&[record(1, "gone", 8 * MIB, HostAccess::Open)]);
        assert_eq!(still_exported(&again, 1, &gone), Some(Errno::Shutdown));

        volumes.set_host_access(2, HostAccess::Restricted([host()].into()));
        assert_eq!(still_exported(&volumes, 2, &closing), Some(Errno::Perm));
    }

    fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(future)
    }

    #[test]
    fn requests_wait_out_a_fence_and_fail_once_the_volume_is_deleted() {
        let volumes = serving(&[record(1, "vol", 8 * MIB, HostAccess::Open)]);
        let handle = volumes.get(1).unwrap();
        assert!(block_on(wait_admission(&handle, &volumes)).is_ok());
        handle.end();

        // A rollback: fenced for a while, then served again.
        handle.fenced.store(true, Ordering::SeqCst);
        let lifted = {
            let handle = Arc::clone(&handle);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                handle.fenced.store(false, Ordering::SeqCst);
            })
        };
        assert_eq!(block_on(wait_admission(&handle, &volumes)), Ok(()));
        handle.end();
        lifted.join().unwrap();

        // A deletion: fenced, then no longer served.
        handle.fenced.store(true, Ordering::SeqCst);
        let removed = {
            let volumes = Arc::clone(&volumes);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                volumes.remove(1);
            })
        };
        assert_eq!(block_on(wait_admission(&handle, &volumes)), Err(Errno::Shutdown));
        removed.join().unwrap();
    }

    #[test]
    fn store_errors_map_to_errno() {
        let check = |error: StoreError, expect: Errno| assert_eq!(errno(&error), expect);
        check(StoreError::VolumeRemoved { volume: VolumeId(1) }, Errno::Shutdown);
        check(
            StoreError::CapacityExceeded { mapped_blocks: 1, capacity_blocks: 1, needed_blocks: 1 },
            Errno::NoSpace,
        );
        check(
            StoreError::ChecksumMismatch { volume: VolumeId(1), block: 0, drive: 0, location: 0 },
            Errno::Io,
        );
        check(StoreError::DriveFailed { drive: 0 }, Errno::Io);
        check(StoreError::Unaligned { offset_bytes: 1, length_bytes: 1 }, Errno::Invalid);
    }

    #[test]
    fn a_taken_port_says_what_to_pass() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let message = bind(taken.local_addr().unwrap()).unwrap_err().to_string();
        let port = taken.local_addr().unwrap().port();
        assert!(
            message.contains(&format!("NBD port {port} in use"))
                && message.contains("pass --nbd-listen ADDR or off"),
            "{message}"
        );
    }

    /// A store that refuses the first `refusals` commands as not serving, then serves; counts
    /// the commands it was sent.
    struct LapsedLease {
        refusals: u32,
        sent: Cell<u32>,
    }

    impl LapsedLease {
        fn answer(&self) -> Result<(), StoreError> {
            self.sent.set(self.sent.get() + 1);
            if self.sent.get() <= self.refusals {
                return Err(StoreError::NotServing { volume: VolumeId(1) });
            }
            Ok(())
        }
    }

    impl VolumeStore for LapsedLease {
        async fn read(
            &self,
            _: &VolumeMap,
            _: u64,
            buf: AlignedBuf,
        ) -> (Result<(), StoreError>, AlignedBuf) {
            (self.answer(), buf)
        }
        async fn write(
            &self,
            _: &VolumeMap,
            _: u64,
            buf: AlignedBuf,
        ) -> (Result<(), StoreError>, AlignedBuf) {
            (self.answer(), buf)
        }
        async fn flush(&self, _: &VolumeMap) -> Result<(), StoreError> {
            self.answer()
        }
        async fn write_zeroes(&self, _: &VolumeMap, _: u64, _: u64) -> Result<(), StoreError> {
            self.answer()
        }
        async fn deallocate(&self, _: &VolumeMap, _: u64, _: u64) -> Result<(), StoreError> {
            self.answer()
        }
    }

    /// A request to a replicated volume whose node stops serving for a moment (a lease renewal
    /// held up) is sent again until it is served; it fails at once on a node that did not
    /// serve the volume lately, when the volume is being deleted, and once the wait is over.
    #[test]
    fn a_request_waits_for_its_node_to_serve_again_within_the_bound() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let map = VolumeMap::standalone(VolumeId(1), MIB);
        let not_fenced = std::sync::atomic::AtomicBool::new(false);
        let fenced = std::sync::atomic::AtomicBool::new(true);
        let run = |refusals, fence, served_recently, waited_ms| {
            let store = LapsedLease { refusals, sent: Cell::new(0) };
            let patient = UntilServed {
                store: &store,
                fenced: fence,
                served_recently: || served_recently,
                started: Instant::now() - Duration::from_millis(waited_ms),
            };
            let kind = RequestKind::Write { offset: 0, data: AlignedBuf::new(4096), fua: false };
            let (result, buf) = runtime.block_on(execute(&patient, &map, kind));
            assert!(buf.is_some(), "the buffer comes back");
            (result.is_ok(), store.sent.get())
        };
        // Ten refusals (200 ms): served on the eleventh send.
        assert_eq!(run(10, &not_fenced, true, 0), (true, 11));
        // A node that did not serve the volume lately refuses at once, as does a fenced one.
        assert_eq!(run(10, &not_fenced, false, 0), (false, 1));
        assert_eq!(run(10, &fenced, true, 0), (false, 1));
        // A request that has waited its time fails: here with 60 ms of it left, after about
        // three more sends.
        let (served, sent) = run(1_000, &not_fenced, true, NOT_SERVING_WAIT_MS_MAX - 60);
        assert!(!served && (2..=5).contains(&sent), "{sent} sends");
        // Every kind of command waits, a read and a flush too.
        let store = LapsedLease { refusals: 3, sent: Cell::new(0) };
        let patient = UntilServed {
            store: &store,
            fenced: &not_fenced,
            served_recently: || true,
            started: Instant::now(),
        };
        for kind in [
            RequestKind::Read { offset: 0, buf: AlignedBuf::new(4096) },
            RequestKind::Flush,
            RequestKind::Trim { offset: 0, length_bytes: 4096, fua: false },
            RequestKind::WriteZeroes { offset: 0, length_bytes: 4096, fua: false, no_hole: false },
        ] {
            store.sent.set(0);
            let (result, _) = runtime.block_on(execute(&patient, &map, kind));
            assert!(result.is_ok());
            assert_eq!(store.sent.get(), 4);
        }
    }
}
