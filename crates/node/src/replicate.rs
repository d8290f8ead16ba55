//! The node's side of synchronous replication (issue 6): the wiring of the sans-IO state
//! machines of the `replication` crate to TCP, etcd and the log engine.
//!
//! One task on data-path thread 0, the *service*, owns every replicated volume's
//! `replication::VolumeNode`, the node's `LeaseKeeper` and, while this node holds the manager
//! key in etcd, one `Manager` per volume. Everything reaches it through one bounded inbox
//! ([`Input`]): host commands from the data-path threads (through each volume's
//! [`ReplicaRoute`], which implements `engine::VolumeStore` so the NVMe/TCP and NBD drivers use
//! it like the log), messages from other nodes, control store replies, local storage
//! completions, and the control plane's commands (serve or drop a volume). The service turns
//! the state machines' actions into work:
//!
//! - `Send`: one frame (`replication::wire`, addressed with the volume id and this node's id)
//!   on the peer's outbound link, a task that keeps one TCP connection to the peer's replication
//!   address and drops frames while it cannot connect (the protocol tolerates loss);
//! - `StorageWrite` / `StorageRead`: a task on thread 0's `LogHandle`, counted as I/O of the
//!   volume's catalog handle so deleting the volume fences and drains it like host I/O;
//! - `PersistEpoch`: the epoch file `DATA-DIR/replication/epoch-<volume id>`, replaced
//!   atomically and synced, on a blocking thread;
//! - `PersistIntent`: the write-intent file `DATA-DIR/replication/intent-<volume id>`
//!   (`replication::WriteIntent::to_bytes`), replaced the same way; read back when the volume
//!   is served again after a restart, so a restarted node's return copies only what may differ;
//! - `Store`: a job for the store thread, which runs `meta::ClusterStore` calls against etcd one
//!   at a time and posts the replies back (a lost or failed call is retried by the state
//!   machine's own timeout);
//! - `CompleteHost`: the waiting host command's reply.
//!
//! ANA follows the protocol: after every input the service sets the volume's ANA state on all
//! of this node's NVMe ports to optimized exactly while its `VolumeNode` serves (it is the
//! primary of the current epoch and holds its lease), inaccessible otherwise, so hosts' native
//! multipath moves to the new primary on failover. A host command that reaches a node that
//! does not serve fails with ANA Inaccessible (`StoreError::NotServing`), a path error.

use crate::nvme::VolumeHandle;
use engine::log::LogHandle;
use engine::{StoreError, VolumeMap, VolumeStore};
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use io::DriveFile;
use meta::ClusterStore;
use nvmf::target::{AnaState, Target};
use replication::wire::{Envelope, FrameReader};
use replication::{
    Action, Block, BlockData, Event, HostError, HostOp, HostOpId, HostReply, LeaseKeeper,
    LeaseStatus, Manager, NodeId, StorageOpId, StorageResult, StoreReply, StoreRequest,
    StoreRequestId, VolumeNode,
};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use types::{AlignedBuf, Nqn, VolumeName, LOGICAL_BLOCK_SIZE_BYTES};

/// Pieces one host command is split into at most (an NVMe/TCP or NBD command carries at most
/// a few MiB; a piece is up to `BLOCKS_PER_OP_MAX` blocks), for the capacity of the answer list.
const PIECES_PER_COMMAND_MAX: usize = 16;
/// Inputs waiting for the service at most; senders wait when it is full.
pub(crate) const INBOX_INPUTS_MAX: usize = 4096;
/// Local writes queued while the service takes its inbox before they start anyway (each
/// input asks for a few at most; a task runs them all at once).
const WRITES_QUEUED_MAX: usize = 256;
/// Host commands of one volume waiting for a slot (the state machine takes at most
/// `INFLIGHT_WRITES_MAX` writes and `INFLIGHT_READS_MAX` reads); more are refused as busy.
const WAITING_HOST_COMMANDS_MAX: usize = 1024;
/// The longest a snapshot may hold a replicated volume's host writes
/// (`ServiceCommand::Freeze`): a caller that never ends its hold costs hosts this much.
pub(crate) const FREEZE_MS_MAX: u64 = 10_000;
/// Control store jobs queued for the store thread; beyond, a job is dropped (its state machine
/// retries after its timeout).
const STORE_JOBS_MAX: usize = 256;
/// Lease renewals queued for the lease thread: the keeper has one in flight at a time and
/// sends another only once that one timed out, so two are the most that can wait.
const LEASE_JOBS_MAX: usize = 2;
/// Bytes of frames queued for one peer at most; beyond, frames are dropped (the protocol
/// sends them again). Holds a full stream window of 256 KiB entries.
const LINK_QUEUED_BYTES_MAX: usize = 8 << 20;
/// How long a link waits between connection attempts to an unreachable peer.
const LINK_RECONNECT_MS: u64 = 200;
/// How long one connection attempt to a peer may take.
const LINK_CONNECT_TIMEOUT_MS: u64 = 1_000;
/// How often the service ticks the state machines.
const TICK_MS: u64 = 5;
/// How often a node with a lease tries to become (or confirms it is) the cluster manager.
const CAMPAIGN_INTERVAL_MS: u64 = 1_000;
/// How often the service looks at the scrub's findings for damaged blocks of its volumes.
const DAMAGE_SCAN_INTERVAL_MS: u64 = 1_000;
/// Scrub findings remembered as handed over; the engine keeps at most
/// `engine::log::SCRUB_FINDINGS_MAX` at a time, so this only bounds a long-running node.
const DAMAGE_SEEN_MAX: usize = 4096;
/// How often the published status ([`ReplicationStatus`]) is refreshed.
const STATUS_INTERVAL_MS: u64 = 200;
/// Inbound replication connections served at once.
const INBOUND_CONNECTIONS_MAX: usize = 256;
/// The largest epoch file read at start.
const EPOCH_FILE_BYTES_MAX: u64 = 64;

/// Everything the service needs, made by the node before the data path starts.
pub struct ReplicationSetup {
    pub me: NodeId,
    /// Different at every start of this node (a durable counter, [`next_incarnation`]).
    pub incarnation: u64,
    pub store: Arc<ClusterStore>,
    /// The bound replication listener (`ferrite up --replication-listen`).
    pub listener: std::net::TcpListener,
    /// Where epoch files live: DATA-DIR/replication.
    pub state_dir: PathBuf,
    /// Timing and limits shared by every volume (`volume_blocks` is set per volume).
    pub config: replication::Config,
    /// Peers' replication addresses, kept current by the control plane from etcd.
    pub peers: Arc<RwLock<HashMap<NodeId, SocketAddr>>>,
    /// What the service publishes for the REST API.
    pub status: Arc<ReplicationStatus>,
}

/// One replicated volume's state as this node sees it, for `volume show` and the metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeReplication {
    /// The newest epoch this node knows.
    pub epoch: u64,
    /// This node serves the volume now (primary of `epoch`, with its lease).
    pub serving: bool,
    /// Storage failed here; the volume's replica on this node acknowledges nothing more.
    pub latched: bool,
    pub stats: replication::Stats,
    /// The copies this node makes as the volume's primary.
    pub resync: Vec<replication::ResyncProgress>,
    /// Blocks of the volume as its state machine here knows it.
    pub volume_blocks: u64,
}

/// The service's published state, read by the control plane.
#[derive(Debug, Default)]
pub struct ReplicationStatus {
    volumes: Mutex<BTreeMap<u64, VolumeReplication>>,
    lease: Mutex<Option<(replication::LeaseId, bool)>>,
    manager: Mutex<Option<NodeId>>,
    /// Frames dropped because a peer's link was full or down.
    pub frames_dropped: AtomicU64,
    pub frames_sent: AtomicU64,
    pub frames_received: AtomicU64,
    /// Times this node's lease lapsed (no renewal answered within it) since the process started.
    pub lease_lapses: Arc<AtomicU64>,
    /// Lease renewals that failed (the control store erred or did not answer in time).
    pub lease_renewals_failed: Arc<AtomicU64>,
}

impl ReplicationStatus {
    pub fn volume(&self, id: u64) -> Option<VolumeReplication> {
        self.volumes.lock().unwrap_or_else(PoisonError::into_inner).get(&id).cloned()
    }

    pub fn volumes(&self) -> BTreeMap<u64, VolumeReplication> {
        self.volumes.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// This node's lease, and whether it is valid by this node's clock.
    pub fn lease(&self) -> Option<(replication::LeaseId, bool)> {
        *self.lease.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cluster manager as this node last saw it.
    pub fn manager(&self) -> Option<NodeId> {
        *self.manager.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Reads, bumps and durably stores this node's incarnation counter (DATA-DIR/replication/
/// incarnation), so every start gets a number no earlier start had.
pub fn next_incarnation(state_dir: &Path) -> std::io::Result<u64> {
    std::fs::create_dir_all(state_dir)?;
    let path = state_dir.join("incarnation");
    let previous = read_counter(&path)?.unwrap_or(0);
    let next = previous + 1;
    if next >= 1 << 32 {
        return Err(std::io::Error::other("the incarnation counter is exhausted"));
    }
    write_counter(state_dir, &path, next)?;
    Ok(next)
}

/// The epoch file of a volume.
fn epoch_path(state_dir: &Path, volume: u64) -> PathBuf {
    state_dir.join(format!("epoch-{volume}"))
}

/// The epoch this node persisted for `volume`: 0 if it never persisted one.
pub(crate) fn persisted_epoch(state_dir: &Path, volume: u64) -> std::io::Result<u64> {
    Ok(read_counter(&epoch_path(state_dir, volume))?.unwrap_or(0))
}

/// Forgets a volume's epoch and write-intent files (the volume's replica on this node was
/// deleted).
pub(crate) fn forget_volume_state(state_dir: &Path, volume: u64) {
    let _ = std::fs::remove_file(epoch_path(state_dir, volume));
    let _ = std::fs::remove_file(intent_path(state_dir, volume));
}

/// The write-intent file of a volume.
fn intent_path(state_dir: &Path, volume: u64) -> PathBuf {
    state_dir.join(format!("intent-{volume}"))
}

/// The write intent this node persisted for `volume`, if any can be read. One that cannot is
/// reported and taken as none: the protocol then treats the replica's divergence as unknown
/// and its return copies the whole volume, which is safe.
fn persisted_intent(state_dir: &Path, volume: u64) -> Option<replication::WriteIntent> {
    use std::io::Read as _;
    let path = intent_path(state_dir, volume);
    let mut bytes = Vec::new();
    let read = std::fs::File::open(&path).and_then(|file| {
        file.take(replication::INTENT_FILE_BYTES_MAX as u64 + 1).read_to_end(&mut bytes)
    });
    match read {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
        Err(error) => {
            tracing::warn!(volume, path = %path.display(), %error, "cannot read the write intent; a return of this replica copies the whole volume");
            return None;
        }
    }
    match replication::WriteIntent::from_bytes(&bytes) {
        Ok(intent) => Some(intent),
        Err(error) => {
            tracing::warn!(volume, path = %path.display(), %error, "the write intent is damaged; a return of this replica copies the whole volume");
            None
        }
    }
}

fn read_counter(path: &Path) -> std::io::Result<Option<u64>> {
    use std::io::Read as _;
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error),
    };
    let mut text = String::new();
    file.take(EPOCH_FILE_BYTES_MAX).read_to_string(&mut text)?;
    let value = text.trim().parse::<u64>().map_err(|_| {
        std::io::Error::other(format!(
            "{} does not hold a number; it is damaged (restore it, or remove this node's \
             replica and let it be rebuilt)",
            path.display()
        ))
    })?;
    Ok(Some(value))
}

/// Replaces `path` with `value` atomically and durably: a temporary file, synced, renamed over
/// it, and the directory synced.
fn write_counter(dir: &Path, path: &Path, value: u64) -> std::io::Result<()> {
    replace_file(dir, path, format!("{value}\n").as_bytes())
}

/// Replaces `path` (in directory `dir`) with `bytes` atomically and durably: a temporary file,
/// synced, renamed over it, and the directory synced.
fn replace_file(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let temporary = path.with_extension("new");
    {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(bytes)?;
        file.sync_all()?;
    }
    std::fs::rename(&temporary, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// What a host command became, for the waiting caller.
type HostResult = Result<HostReply, HostError>;

/// A host command for a replicated volume, from a data-path thread.
pub(crate) struct HostRequest {
    volume: u64,
    op: HostOp,
    reply: oneshot::Sender<HostResult>,
}

/// The control plane's commands to the service.
pub(crate) enum ServiceCommand {
    /// Serve `handle` (a volume of `size_blocks` blocks) as a replicated volume.
    Add { handle: Arc<VolumeHandle>, size_blocks: u64 },
    /// Stop replicating the volume (it is being deleted here); its waiting host commands fail.
    Remove { volume: u64 },
    /// The volume grew to `size_blocks` blocks and its storage here holds them: take commands
    /// and entries up to the new end (`VolumeNode::grow`). Sent before hosts learn the new
    /// size, through the inbox their commands take, so none reaches the state machine first.
    Grow { volume: u64, size_blocks: u64 },
    /// Every replicated volume of the cluster (this node's or not): the ones the manager looks
    /// after while this node holds the manager key.
    ClusterVolumes { volumes: Vec<u64> },
    /// The node is stopping cleanly: every volume it serves steps down (resigns through the
    /// store, so another replica takes over at once instead of after the lease), and `done`
    /// is answered once none is stepping down any more.
    StepDownAll { done: std::sync::mpsc::SyncSender<()> },
    /// Hold the volume's host writes for a snapshot of every copy (this node must serve it as
    /// primary), for at most `hold_ms` (capped at [`FREEZE_MS_MAX`]): `reply` is answered
    /// once every write the state machine took completed (`VolumeNode::quiet_copies`), or
    /// with why not (the node does not serve, another hold is on, the hold ended first).
    Freeze { volume: u64, hold_ms: u64, reply: std::sync::mpsc::SyncSender<Result<Held, String>> },
    /// End the hold `token` names: `reply` says whether it lasted until now in the term it
    /// began in (crate replication's docs, "Snapshots").
    Thaw { volume: u64, token: u64, reply: std::sync::mpsc::SyncSender<Result<(), String>> },
}

/// A replicated volume whose host writes are held, every write taken before completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    /// Names the hold, for `ServiceCommand::Thaw`.
    pub token: u64,
    /// The epoch this node serves the volume in.
    pub epoch: u64,
    /// The replicas whose copies hold exactly what this node's holds.
    pub copies: Vec<NodeId>,
}

/// A hold on a volume's host writes (`ServiceCommand::Freeze`).
struct Freeze {
    token: u64,
    epoch: u64,
    until_ms: u64,
    /// The freeze's caller, until the copies are quiet (or the hold ends first).
    waiting: Option<std::sync::mpsc::SyncSender<Result<Held, String>>>,
}

/// Who asked the control store something.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Origin {
    Keeper,
    Volume(u64),
    Manager(u64),
}

enum StoreJob {
    Request { origin: Origin, volume: u64, id: StoreRequestId, request: StoreRequest },
    Campaign { node: NodeId, lease: replication::LeaseId },
}

/// Which slots of the state machine a host command takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Write,
    Read,
    /// A flush: completes at once, takes no slot.
    Other,
}

impl Class {
    fn of(op: &HostOp) -> Self {
        match op {
            HostOp::Write { .. } | HostOp::Deallocate { .. } => Class::Write,
            HostOp::Read { .. } => Class::Read,
            HostOp::Flush => Class::Other,
        }
    }
}

/// Everything the service reacts to.
pub(crate) enum Input {
    Host(HostRequest),
    Message(Envelope),
    Store {
        origin: Origin,
        id: StoreRequestId,
        reply: StoreReply,
    },
    Manager(NodeId),
    /// Local storage requests of one volume's state machine that finished.
    Storage {
        volume: u64,
        results: Vec<(StorageOpId, StorageResult)>,
    },
    EpochPersisted {
        volume: u64,
        epoch: u64,
    },
    /// `generation` names the state machine that asked ([`Replica::generation`]): versions
    /// restart at 1 in each, so a late completion must not reach one added after it.
    IntentPersisted {
        volume: u64,
        generation: u64,
        version: u64,
    },
    Command(ServiceCommand),
}

/// The way into the service, shared by every data-path thread and the control plane.
#[derive(Clone)]
pub(crate) struct ServiceLink {
    inbox: mpsc::Sender<Input>,
    /// The service's clock: its state machines' times (leases included) are milliseconds
    /// since this instant.
    origin: Instant,
}

impl ServiceLink {
    pub(crate) fn command_blocking(&self, command: ServiceCommand) -> bool {
        self.inbox.blocking_send(Input::Command(command)).is_ok()
    }
}

/// Whether host reads of one replicated volume may be served from local storage on the thread
/// that received them, without a trip through the service: the service opens it while this
/// node serves the volume, up to the end of the lease it serves under, and closes it before it
/// carries out anything an event made of the term's end (a resignation to the store included).
/// A read passes it when it starts and again when its data is back, the two checks the state
/// machine makes of a read it runs itself; so it returns nothing the state machine would not.
pub(crate) struct ServingGate {
    origin: Instant,
    /// Milliseconds since `origin` until which reads may be served here; 0 while closed.
    until_ms: AtomicU64,
    /// The latest `until_ms` it was ever opened to; 0 if never.
    served_until_ms: AtomicU64,
    /// The newest view this node has of the volume names another node primary: it serves the
    /// volume again only if a later epoch names it, so a request is not worth waiting for.
    moved: AtomicBool,
}

impl ServingGate {
    fn new(origin: Instant) -> Self {
        Self {
            origin,
            until_ms: AtomicU64::new(0),
            served_until_ms: AtomicU64::new(0),
            moved: AtomicBool::new(false),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether a read may be served from local storage now.
    pub(crate) fn open(&self) -> bool {
        self.now_ms() < self.until_ms.load(Ordering::Acquire)
    }

    /// Whether this node served the volume at some time in the last `window_ms`, or does now,
    /// and no other node serves it since as far as this node knows.
    pub(crate) fn served_within_ms(&self, window_ms: u64) -> bool {
        let served_until_ms = self.served_until_ms.load(Ordering::Acquire);
        served_until_ms != 0
            && self.now_ms() < served_until_ms.saturating_add(window_ms)
            && !self.moved.load(Ordering::Acquire)
    }

    fn set(&self, until_ms: Option<u64>) {
        self.until_ms.store(until_ms.unwrap_or(0), Ordering::Release);
        if let Some(until_ms) = until_ms {
            self.served_until_ms.fetch_max(until_ms, Ordering::AcqRel);
        }
    }
}

/// A replicated volume as the data path stores to it: every command goes to the service, which
/// runs it through the volume's `VolumeNode` (replicated writes, reads from the primary),
/// except reads the serving gate lets through ([`LocalReads`]).
pub(crate) struct ReplicaRoute {
    pub(crate) volume: u64,
    link: ServiceLink,
    gate: Arc<ServingGate>,
}

impl ReplicaRoute {
    pub(crate) fn new(volume: u64, link: ServiceLink) -> Self {
        let gate = Arc::new(ServingGate::new(link.origin));
        Self { volume, link, gate }
    }

    /// Whether this node served the volume at some time in the last `window_ms`, or does now:
    /// a host command it refuses as not serving may be refused only until its lease is renewed.
    pub(crate) fn served_within_ms(&self, window_ms: u64) -> bool {
        self.gate.served_within_ms(window_ms)
    }

    /// This route's reads, served from `local` (the calling thread's log) while the gate is
    /// open.
    pub(crate) fn with_local<'a>(&'a self, local: &'a LogHandle<DriveFile>) -> LocalReads<'a> {
        LocalReads { route: self, local }
    }

    async fn run(&self, op: HostOp) -> HostResult {
        match self.submit(op).await {
            Ok(answer) => answer.await.unwrap_or(Err(HostError::NotPrimary)),
            Err(error) => Err(error),
        }
    }

    /// Hands one command to the service; its answer comes on the returned receiver. The pieces
    /// of one host command are all submitted before any is awaited, so they run in parallel.
    async fn submit(&self, op: HostOp) -> Result<oneshot::Receiver<HostResult>, HostError> {
        let (reply, answer) = oneshot::channel();
        let request = HostRequest { volume: self.volume, op, reply };
        match self.link.inbox.send(Input::Host(request)).await {
            Ok(()) => Ok(answer),
            Err(_) => Err(HostError::NotPrimary),
        }
    }

    fn error(&self, error: HostError, offset_bytes: u64, length_bytes: u64) -> StoreError {
        let volume = engine::VolumeId(self.volume);
        match error {
            HostError::NotPrimary | HostError::Busy => StoreError::NotServing { volume },
            HostError::OutOfRange { volume_blocks, .. } => StoreError::OutOfRange {
                offset_bytes,
                length_bytes,
                size_bytes: volume_blocks * u64::from(LOGICAL_BLOCK_SIZE_BYTES),
            },
            HostError::BadLength { .. } | HostError::BlockSize { .. } => {
                StoreError::Unaligned { offset_bytes, length_bytes }
            }
            HostError::Damaged { lba, count } => {
                StoreError::Unrecovered { volume, block: lba, count }
            }
        }
    }

    /// The first LBA of a read or write and its pieces of at most `BLOCKS_PER_OP_MAX` blocks;
    /// `None` if the range is not whole blocks.
    fn data_pieces(
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Option<(u64, impl Iterator<Item = (u64, u32)>)> {
        let pieces =
            Self::pieces(offset_bytes, length_bytes, replication::BLOCKS_PER_OP_MAX).ok()?;
        Some((offset_bytes / u64::from(LOGICAL_BLOCK_SIZE_BYTES), pieces))
    }

    /// Splits `[offset, offset + length)` into block ranges of at most `max_blocks`.
    fn pieces(
        offset_bytes: u64,
        length_bytes: u64,
        max_blocks: u32,
    ) -> Result<impl Iterator<Item = (u64, u32)>, (u64, u64)> {
        let block = u64::from(LOGICAL_BLOCK_SIZE_BYTES);
        if offset_bytes % block != 0 || length_bytes % block != 0 || length_bytes == 0 {
            return Err((offset_bytes, length_bytes));
        }
        let first = offset_bytes / block;
        let end = first + length_bytes / block;
        let step = u64::from(max_blocks);
        Ok((first..end).step_by(max_blocks as usize).map(move |lba| {
            let count = (end - lba).min(step);
            (lba, u32::try_from(count).unwrap_or(max_blocks))
        }))
    }
}

impl VolumeStore for ReplicaRoute {
    async fn read(
        &self,
        _volume: &VolumeMap,
        offset_bytes: u64,
        mut buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        let Some((first_lba, pieces)) = Self::data_pieces(offset_bytes, length_bytes) else {
            return (Err(StoreError::Unaligned { offset_bytes, length_bytes }), buf);
        };
        let block = LOGICAL_BLOCK_SIZE_BYTES as usize;
        for (lba, count) in pieces {
            match self.run(HostOp::Read { lba, count }).await {
                Ok(HostReply::Read(blocks)) if blocks.len() == count as usize => {
                    let start = usize::try_from(lba - first_lba).unwrap_or(usize::MAX) * block;
                    for (index, data) in blocks.iter().enumerate() {
                        let target = &mut buf[start + index * block..start + (index + 1) * block];
                        match data {
                            Some(bytes) if bytes.len() == block => target.copy_from_slice(bytes),
                            Some(_) => {
                                let error = StoreError::NotServing {
                                    volume: engine::VolumeId(self.volume),
                                };
                                return (Err(error), buf);
                            }
                            None => target.fill(0),
                        }
                    }
                }
                Ok(_) => {
                    let error = StoreError::NotServing { volume: engine::VolumeId(self.volume) };
                    return (Err(error), buf);
                }
                Err(error) => return (Err(self.error(error, offset_bytes, length_bytes)), buf),
            }
        }
        (Ok(()), buf)
    }

    async fn write(
        &self,
        _volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        let Some((first_lba, pieces)) = Self::data_pieces(offset_bytes, length_bytes) else {
            return (Err(StoreError::Unaligned { offset_bytes, length_bytes }), buf);
        };
        let block = LOGICAL_BLOCK_SIZE_BYTES as usize;
        // The pieces of one command are independent writes (they do not overlap): all are
        // submitted, then awaited, so a large write costs about one replicated round trip.
        let mut answers = Vec::with_capacity(PIECES_PER_COMMAND_MAX);
        let mut outcome = Ok(());
        for (lba, count) in pieces {
            let start = usize::try_from(lba - first_lba).unwrap_or(usize::MAX) * block;
            // One copy per piece, shared by its blocks (and by every replica they go to); each
            // block's checksum is computed here once, for this node's log and every frame.
            let piece = bytes::Bytes::copy_from_slice(&buf[start..start + count as usize * block]);
            let blocks: Vec<Block> = (0..count as usize)
                .map(|i| Block::new(piece.slice(i * block..(i + 1) * block)))
                .collect();
            match self.submit(HostOp::Write { lba, blocks }).await {
                Ok(answer) => answers.push(answer),
                Err(error) => {
                    outcome = Err(error);
                    break;
                }
            }
        }
        for answer in answers {
            let result = answer.await.unwrap_or(Err(HostError::NotPrimary));
            if let (Ok(()), Err(error)) = (&outcome, result) {
                outcome = Err(error);
            }
        }
        match outcome {
            Ok(()) => (Ok(()), buf),
            Err(error) => (Err(self.error(error, offset_bytes, length_bytes)), buf),
        }
    }

    async fn flush(&self, _volume: &VolumeMap) -> Result<(), StoreError> {
        self.run(HostOp::Flush).await.map(|_| ()).map_err(|error| self.error(error, 0, 0))
    }

    async fn write_zeroes(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError> {
        // A thin volume reads deallocated blocks as zeros.
        self.deallocate(volume, offset_bytes, length_bytes).await
    }

    async fn deallocate(
        &self,
        _volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError> {
        let max = replication::DEALLOCATE_BLOCKS_PER_OP_MAX;
        let pieces = Self::pieces(offset_bytes, length_bytes, max).map_err(
            |(offset_bytes, length_bytes)| StoreError::Unaligned { offset_bytes, length_bytes },
        )?;
        for (lba, count) in pieces {
            self.run(HostOp::Deallocate { lba, count })
                .await
                .map_err(|error| self.error(error, offset_bytes, length_bytes))?;
        }
        Ok(())
    }
}

/// A replicated volume's route with the calling thread's log: reads are served from local
/// storage while this node serves the volume (the [`ServingGate`] is open when the read starts
/// and when its data is back), everything else goes through the service. A local read that
/// fails is run again through the service, whose state machine then latches the failure as it
/// would have.
pub(crate) struct LocalReads<'a> {
    route: &'a ReplicaRoute,
    local: &'a LogHandle<DriveFile>,
}

impl VolumeStore for LocalReads<'_> {
    async fn read(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        if !self.route.gate.open() {
            return self.route.read(volume, offset_bytes, buf).await;
        }
        let (result, buf) = self.local.read(volume, offset_bytes, buf).await;
        match result {
            Ok(()) if self.route.gate.open() => (Ok(()), buf),
            Ok(()) => {
                let error = StoreError::NotServing { volume: engine::VolumeId(self.route.volume) };
                (Err(error), buf)
            }
            // Out of range or unaligned: the same answer the service would give.
            Err(error @ (StoreError::OutOfRange { .. } | StoreError::Unaligned { .. })) => {
                (Err(error), buf)
            }
            Err(_) => self.route.read(volume, offset_bytes, buf).await,
        }
    }

    async fn write(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), StoreError>, AlignedBuf) {
        self.route.write(volume, offset_bytes, buf).await
    }

    async fn flush(&self, volume: &VolumeMap) -> Result<(), StoreError> {
        self.route.flush(volume).await
    }

    async fn write_zeroes(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError> {
        self.route.write_zeroes(volume, offset_bytes, length_bytes).await
    }

    async fn deallocate(
        &self,
        volume: &VolumeMap,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), StoreError> {
        self.route.deallocate(volume, offset_bytes, length_bytes).await
    }
}

/// Makes the service's inbox; the receiver goes to [`spawn`].
pub(crate) fn link() -> (ServiceLink, mpsc::Receiver<Input>) {
    let (inbox, receiver) = mpsc::channel(INBOX_INPUTS_MAX);
    (ServiceLink { inbox, origin: Instant::now() }, receiver)
}

/// Controllers one cluster node's target serves at once: its share of the controller IDs.
pub(crate) const CLUSTER_CONTROLLERS_MAX: usize = 1024;
/// Nodes whose controller ID ranges are disjoint; a larger cluster reuses ranges (a host that
/// connects to two nodes with the same range may then see a duplicate ID and refuse one).
pub(crate) const CNTLID_RANGES: u32 = 63;

/// The controller IDs node `node` hands out: a range of its own, so a host connected to one
/// volume through several nodes never sees one ID twice.
pub(crate) fn cntlids_of(node: NodeId) -> std::ops::RangeInclusive<u16> {
    let size = CLUSTER_CONTROLLERS_MAX as u32;
    let slot = node.0.saturating_sub(1) % CNTLID_RANGES;
    let first = u16::try_from(slot * size + 1).unwrap_or(1);
    let last = u16::try_from(slot * size + size).unwrap_or(nvmf::command::CNTLID_MAX);
    first..=last
}

/// What thread 0 needs to start the service.
pub(crate) struct ServiceStart {
    pub(crate) setup: ReplicationSetup,
    pub(crate) link: ServiceLink,
    pub(crate) inbox: mpsc::Receiver<Input>,
    /// The replicated volumes served from the start, with their sizes in blocks.
    pub(crate) volumes: Vec<(Arc<VolumeHandle>, u64)>,
}

/// Starts the service on this (data-path thread 0's) local task set.
pub(crate) fn spawn(
    start: ServiceStart,
    store: Rc<LogHandle<DriveFile>>,
    target: Arc<Target>,
    ports: u16,
    stop: watch::Receiver<bool>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let ServiceStart { setup, link, inbox, volumes } = start;
    let listener = TcpListener::from_std(setup.listener)?;
    tokio::task::spawn_local(accept_loop(listener, link.clone(), stop.clone()));
    let (jobs, job_receiver) = std::sync::mpsc::sync_channel(STORE_JOBS_MAX);
    let cluster = Arc::clone(&setup.store);
    let store_link = link.clone();
    std::thread::Builder::new()
        .name("ferrite-repl-store".to_owned())
        .spawn(move || store_thread(cluster, job_receiver, store_link, StoreThread::Volumes))?;
    // The lease's renewals on a thread of their own, so a slow volume or manager call (a
    // transaction waiting for etcd's disk, up to the store's timeout each) never holds a renewal
    // up until the lease lapses.
    let (lease_jobs, lease_receiver) = std::sync::mpsc::sync_channel(LEASE_JOBS_MAX);
    let cluster = Arc::clone(&setup.store);
    let lease_link = link.clone();
    let lease_thread = StoreThread::Lease {
        timeout: Duration::from_millis(setup.config.store_timeout_ms),
        failed: Arc::clone(&setup.status.lease_renewals_failed),
    };
    std::thread::Builder::new()
        .name("ferrite-repl-lease".to_owned())
        .spawn(move || store_thread(cluster, lease_receiver, lease_link, lease_thread))?;
    let service = Service {
        admitting: false,
        me: setup.me,
        incarnation: setup.incarnation,
        clock: link.origin,
        keeper: LeaseKeeper::new(setup.me, setup.incarnation, &setup.config),
        config: setup.config,
        lease: None,
        volumes: BTreeMap::new(),
        managers: BTreeMap::new(),
        removed: BTreeSet::new(),
        next_generation: 1,
        next_freeze_token: 0,
        cluster_volumes: Vec::new(),
        stepping_down: None,
        manager: None,
        last_campaign_ms: None,
        jobs,
        lease_jobs,
        lease_lapsed_ms: None,
        links: HashMap::new(),
        peers: setup.peers,
        link,
        store,
        target,
        ports,
        state_dir: setup.state_dir,
        status: setup.status,
        actions: Vec::new(),
        stop: stop.clone(),
        writes_queued: Vec::new(),
        now_cached: None,
        damage_scan_ms: None,
        damage_seen: BTreeSet::new(),
    };
    let mut service = service;
    for (handle, size_blocks) in volumes {
        service.add(handle, size_blocks);
    }
    Ok(tokio::task::spawn_local(service.run(inbox, stop)))
}

/// What a store thread runs.
#[derive(Debug)]
enum StoreThread {
    /// The volumes' and the manager's calls and the campaigns; a failed one is retried by its
    /// state machine, and logged at debug.
    Volumes,
    /// The node's lease renewals, each bounded by `timeout` (the keeper's store timeout, after
    /// which it sends a fresh one, so a call stuck on a lost connection holds up no later one);
    /// the first failure after a success is a warning (a lease that is not renewed lapses, and
    /// this node's volumes stop being served here). Failures are counted in `failed`.
    Lease { timeout: Duration, failed: Arc<AtomicU64> },
}

/// Runs the control store calls, one at a time, off the data path.
fn store_thread(
    cluster: Arc<ClusterStore>,
    jobs: std::sync::mpsc::Receiver<StoreJob>,
    link: ServiceLink,
    role: StoreThread,
) {
    // Renewals failed in a row (the lease thread's only).
    let mut failures = 0u64;
    while let Ok(job) = jobs.recv() {
        let input = match job {
            StoreJob::Request { origin, volume, id, request } => {
                let answer = match &role {
                    StoreThread::Volumes => cluster.handle(volume, &request),
                    StoreThread::Lease { timeout, .. } => {
                        cluster.handle_within(volume, &request, *timeout)
                    }
                };
                match answer {
                    Ok(reply) => {
                        if failures > 0 {
                            tracing::info!(failures, "renewed this node's lease again");
                        }
                        failures = 0;
                        Input::Store { origin, id, reply }
                    }
                    Err(error) => {
                        match &role {
                            StoreThread::Lease { failed, .. } => {
                                failures += 1;
                                failed.fetch_add(1, Ordering::Relaxed);
                                if failures == 1 {
                                    tracing::warn!(
                                        %error,
                                        "cannot renew this node's lease in the control store; \
                                         retrying (further failures at debug level until one \
                                         succeeds)"
                                    );
                                } else {
                                    tracing::debug!(failures, %error, "lease renewal failed");
                                }
                            }
                            StoreThread::Volumes => {
                                tracing::debug!(volume, %error, "control store call failed");
                            }
                        }
                        continue;
                    }
                }
            }
            StoreJob::Campaign { node, lease } => match cluster.campaign(node, lease) {
                Ok(holder) => Input::Manager(holder),
                Err(error) => {
                    tracing::debug!(%error, "manager campaign failed");
                    continue;
                }
            },
        };
        if link.inbox.blocking_send(input).is_err() {
            return;
        }
    }
}

/// One replicated volume in the service.
struct Replica {
    node: VolumeNode,
    handle: Arc<VolumeHandle>,
    nqn: Nqn,
    /// Host commands given to the state machine, by id: the slot each took, and its reply.
    pending: HashMap<HostOpId, (Class, oneshot::Sender<HostResult>)>,
    /// Host commands waiting for a slot.
    waiting: VecDeque<HostRequest>,
    writes: usize,
    reads: usize,
    next_host_id: u64,
    /// The ANA state last set on this node's ports.
    ana: Option<AnaState>,
    /// Different for every state machine this process creates (`Service::next_generation`).
    generation: u64,
    /// Lets the data path read local storage while this node serves the volume.
    gate: Arc<ServingGate>,
    /// When each entry in flight to a replica was queued, for its acknowledgement's latency.
    acks: AckClock,
    /// Host writes held for a snapshot: none is given to the state machine meanwhile.
    freeze: Option<Freeze>,
}

/// When each entry in flight to each replica was queued, so that its acknowledgement's
/// latency can be recorded (`ferrite_replication_ack_seconds`, node::metrics). One stream per
/// replica at a time; at most `STREAM_WINDOW_MAX` entries each, the protocol's own bound on
/// entries unacknowledged.
#[derive(Default)]
struct AckClock {
    replicas: HashMap<NodeId, ReplicaAckClock>,
}

struct ReplicaAckClock {
    /// The (epoch, stream) of the entries below: a new stream starts afresh.
    stream: (u64, replication::StreamId),
    /// The newest entry recorded: one sent again keeps its first time.
    last_seq: u64,
    /// (entry, when its frame was queued), oldest first.
    sent: VecDeque<(u64, Instant)>,
    latency: Arc<crate::metrics::Histogram>,
}

impl AckClock {
    /// Entry `seq` of `stream` was queued for replica `to` at `now`.
    fn sent(
        &mut self,
        metrics: &crate::metrics::VolumeMetrics,
        to: NodeId,
        stream: (u64, replication::StreamId),
        seq: u64,
        now: Instant,
    ) {
        let replica = self.replicas.entry(to).or_insert_with(|| ReplicaAckClock {
            stream,
            last_seq: 0,
            sent: VecDeque::with_capacity(replication::STREAM_WINDOW_MAX),
            latency: metrics.replica_ack_latency(to.0),
        });
        if replica.stream != stream {
            replica.stream = stream;
            replica.last_seq = 0;
            replica.sent.clear();
        }
        if seq <= replica.last_seq {
            return;
        }
        replica.last_seq = seq;
        if replica.sent.len() >= replication::STREAM_WINDOW_MAX {
            replica.sent.pop_front();
        }
        replica.sent.push_back((seq, now));
    }

    /// Replica `from` acknowledged every entry of `stream` up to `durable_seq` at `now`.
    fn acked(
        &mut self,
        from: NodeId,
        stream: (u64, replication::StreamId),
        durable_seq: u64,
        now: Instant,
    ) {
        let Some(replica) = self.replicas.get_mut(&from) else { return };
        if replica.stream != stream {
            return;
        }
        while let Some(&(seq, sent)) = replica.sent.front() {
            if seq > durable_seq {
                break;
            }
            replica.sent.pop_front();
            replica.latency.record(crate::metrics::micros(now.saturating_duration_since(sent)));
        }
    }
}

struct Service {
    /// Set while `admit` runs, so the `run_actions` of each command it admits does not call
    /// it again (its own loop goes on until no slot is left).
    admitting: bool,
    me: NodeId,
    incarnation: u64,
    clock: Instant,
    config: replication::Config,
    keeper: LeaseKeeper,
    lease: Option<LeaseStatus>,
    volumes: BTreeMap<u64, Replica>,
    managers: BTreeMap<u64, Manager>,
    /// Volumes this process stopped replicating (`ServiceCommand::Remove`). One added back
    /// gets a fresh incarnation, so no peer takes its new state machine for the one that was
    /// removed (whose streams it would otherwise continue). At most one entry per volume ID.
    removed: BTreeSet<u64>,
    /// The generation of the next `Replica`.
    next_generation: u64,
    /// The token of the last hold on a volume's writes (`ServiceCommand::Freeze`).
    next_freeze_token: u64,
    /// Every replicated volume of the cluster, as the reconciler last saw them.
    cluster_volumes: Vec<u64>,
    manager: Option<NodeId>,
    last_campaign_ms: Option<u64>,
    /// Answered once no volume is stepping down any more (a clean stop).
    stepping_down: Option<std::sync::mpsc::SyncSender<()>>,
    jobs: std::sync::mpsc::SyncSender<StoreJob>,
    /// The lease's renewals, run by a thread of their own.
    lease_jobs: std::sync::mpsc::SyncSender<StoreJob>,
    /// When this node's lease lapsed (its clock), while it holds none valid; logged once per
    /// lapse, and how long the lapse lasted once a renewal answers.
    lease_lapsed_ms: Option<u64>,
    links: HashMap<NodeId, Rc<PeerLink>>,
    peers: Arc<RwLock<HashMap<NodeId, SocketAddr>>>,
    link: ServiceLink,
    store: Rc<LogHandle<DriveFile>>,
    target: Arc<Target>,
    ports: u16,
    state_dir: PathBuf,
    status: Arc<ReplicationStatus>,
    actions: Vec<Action>,
    stop: watch::Receiver<bool>,
    /// Local writes asked for by the inputs being handled, started together after them.
    writes_queued: Vec<QueuedWrite>,
    /// The clock as read when the input being handled arrived, so that handling one input
    /// reads it once (the state machine takes one `now` per event anyway).
    now_cached: Option<u64>,
    /// When the scrub's findings were last looked at, and the block findings already handed
    /// to the volumes' state machines: (volume, block, scrub pass).
    damage_scan_ms: Option<u64>,
    damage_seen: BTreeSet<(u64, u64, u64)>,
}

impl Service {
    fn now_ms(&self) -> u64 {
        self.now_cached.unwrap_or_else(|| self.clock_ms())
    }

    fn clock_ms(&self) -> u64 {
        u64::try_from(self.clock.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    async fn run(mut self, mut inbox: mpsc::Receiver<Input>, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_status_ms = 0u64;
        loop {
            tokio::select! {
                input = inbox.recv() => {
                    let Some(input) = input else { break };
                    self.input(input);
                    // Take what else is queued before the next tick, without waiting.
                    for _ in 0..INBOX_INPUTS_MAX {
                        match inbox.try_recv() {
                            Ok(input) => self.input(input),
                            Err(_) => break,
                        }
                    }
                }
                _ = tick.tick() => {
                    self.tick();
                    self.check_stepped_down();
                    let now = self.now_ms();
                    if now >= last_status_ms + STATUS_INTERVAL_MS {
                        last_status_ms = now;
                        self.publish_status();
                    }
                }
                _ = stop.changed() => break,
            }
            self.start_queued_writes();
        }
        for (_, replica) in std::mem::take(&mut self.volumes) {
            fail_all(replica);
        }
    }

    fn input(&mut self, input: Input) {
        self.now_cached = Some(self.clock_ms());
        self.handle_input(input);
        self.now_cached = None;
    }

    fn handle_input(&mut self, input: Input) {
        let now = self.now_ms();
        match input {
            Input::Host(request) => self.host(request),
            Input::Message(envelope) => {
                self.status.frames_received.fetch_add(1, Ordering::Relaxed);
                let Envelope { volume, sender, message } = envelope;
                if let replication::Message::Ack { epoch, stream, durable_seq } = message {
                    if let Some(replica) = self.volumes.get_mut(&volume) {
                        let now = Instant::now();
                        replica.acks.acked(sender, (epoch, stream), durable_seq, now);
                    }
                }
                self.event(volume, Event::Message { from: sender, message });
            }
            Input::Store { origin, id, reply } => match origin {
                Origin::Keeper => {
                    if let Some(status) = self.keeper.on_reply(id, &reply) {
                        self.lease = Some(status);
                        if let Some(lapsed_ms) = self.lease_lapsed_ms.take() {
                            tracing::info!(
                                lapsed_for_ms = now.saturating_sub(lapsed_ms),
                                "this node holds a valid lease again"
                            );
                        }
                        let volumes: Vec<u64> = self.volumes.keys().copied().collect();
                        for volume in volumes {
                            self.event(volume, Event::Lease(status));
                        }
                    }
                }
                Origin::Volume(volume) => self.event(volume, Event::Store { id, reply }),
                Origin::Manager(volume) => {
                    if let Some(manager) = self.managers.get_mut(&volume) {
                        if let Some(call) = manager.on_reply(now, id, &reply) {
                            self.job(StoreJob::Request {
                                origin: Origin::Manager(volume),
                                volume,
                                id: call.id,
                                request: call.request,
                            });
                        }
                    }
                }
            },
            Input::Manager(holder) => {
                if self.manager != Some(holder) {
                    tracing::info!(manager = %holder, me = %self.me, "cluster manager");
                }
                self.manager = Some(holder);
                *self.status.manager.lock().unwrap_or_else(PoisonError::into_inner) = Some(holder);
                if holder != self.me {
                    self.managers.clear();
                }
            }
            Input::Storage { volume, results } => {
                for (id, result) in results {
                    self.event(volume, Event::Storage { id, result });
                }
            }
            Input::IntentPersisted { volume, generation, version } => {
                if self.volumes.get(&volume).is_some_and(|replica| replica.generation == generation)
                {
                    self.event(volume, Event::IntentPersisted { version });
                }
            }
            Input::EpochPersisted { volume, epoch } => {
                self.event(volume, Event::EpochPersisted { epoch });
            }
            Input::Command(ServiceCommand::Add { handle, size_blocks }) => {
                self.add(handle, size_blocks);
            }
            Input::Command(ServiceCommand::StepDownAll { done }) => {
                let volumes: Vec<u64> = self.volumes.keys().copied().collect();
                for volume in volumes {
                    if let Some(replica) = self.volumes.get_mut(&volume) {
                        if replica.node.serving_epoch(now).is_some() {
                            tracing::info!(
                                volume = %replica.handle.name,
                                "stopping: the primary steps down"
                            );
                        }
                        replica.node.step_down(now, &mut self.actions);
                        self.run_actions(volume);
                    }
                }
                self.stepping_down = Some(done);
                self.check_stepped_down();
            }
            Input::Command(ServiceCommand::ClusterVolumes { volumes }) => {
                self.managers.retain(|volume, _| volumes.contains(volume));
                self.cluster_volumes = volumes;
            }
            Input::Command(ServiceCommand::Grow { volume, size_blocks }) => {
                if let Some(replica) = self.volumes.get_mut(&volume) {
                    if size_blocks > replica.node.volume_blocks() {
                        replica.node.grow(size_blocks);
                        tracing::info!(
                            volume = %replica.handle.name,
                            blocks = size_blocks,
                            "the volume grew: replicating up to its new end"
                        );
                    }
                }
            }
            Input::Command(ServiceCommand::Freeze { volume, hold_ms, reply }) => {
                self.freeze(volume, hold_ms, reply);
            }
            Input::Command(ServiceCommand::Thaw { volume, token, reply }) => {
                let result = self.thaw(volume, token);
                let _ = reply.try_send(result);
            }
            Input::Command(ServiceCommand::Remove { volume }) => {
                if let Some(replica) = self.volumes.remove(&volume) {
                    fail_all(replica);
                }
                self.managers.remove(&volume);
                self.removed.insert(volume);
                self.status.volumes.lock().unwrap_or_else(PoisonError::into_inner).remove(&volume);
            }
        }
    }

    /// Answers a clean stop once no volume is stepping down any more.
    fn check_stepped_down(&mut self) {
        if self.stepping_down.is_none() {
            return;
        }
        if self.volumes.values().any(|replica| replica.node.stepping_down()) {
            return;
        }
        if let Some(done) = self.stepping_down.take() {
            let _ = done.try_send(());
        }
    }

    fn add(&mut self, handle: Arc<VolumeHandle>, size_blocks: u64) {
        let volume = handle.map.volume().0;
        if self.volumes.contains_key(&volume) {
            return;
        }
        let epoch = match persisted_epoch(&self.state_dir, volume) {
            Ok(epoch) => epoch,
            Err(error) => {
                tracing::error!(
                    volume = %handle.name,
                    %error,
                    "cannot read the volume's epoch; its replica here is not served"
                );
                return;
            }
        };
        let incarnation = if self.removed.remove(&volume) {
            // Blocks the service's thread on a small synced file: only when a member that was
            // removed from a volume is added back, which is rare.
            match next_incarnation(&self.state_dir) {
                Ok(incarnation) => incarnation,
                Err(error) => {
                    self.removed.insert(volume);
                    tracing::error!(
                        volume = %handle.name,
                        %error,
                        "cannot take a new incarnation for a volume added back; not served"
                    );
                    return;
                }
            }
        } else {
            self.incarnation
        };
        let Some(gate) = handle.route.as_ref().map(|route| Arc::clone(&route.gate)) else {
            tracing::error!(volume = %handle.name, "a replicated volume without its route");
            return;
        };
        let intent = persisted_intent(&self.state_dir, volume);
        self.next_generation += 1;
        let config = replication::Config { volume_blocks: size_blocks, ..self.config.clone() };
        let node = VolumeNode::new(config, self.me, incarnation, epoch, intent);
        let nqn = handle.name.subsystem_nqn();
        tracing::info!(volume = %handle.name, id = volume, epoch, "replicating volume");
        self.volumes.insert(
            volume,
            Replica {
                node,
                handle,
                nqn,
                pending: HashMap::new(),
                waiting: VecDeque::new(),
                writes: 0,
                reads: 0,
                next_host_id: 1,
                ana: None,
                generation: self.next_generation,
                gate,
                acks: AckClock::default(),
                freeze: None,
            },
        );
        self.set_ana(volume);
        if let Some(status) = self.lease {
            self.event(volume, Event::Lease(status));
        }
    }

    fn event(&mut self, volume: u64, event: Event) {
        let now = self.now_ms();
        let Some(replica) = self.volumes.get_mut(&volume) else { return };
        let reconcile = |stats: &replication::Stats| {
            (stats.reconcile_damaged, stats.reconcile_repaired, stats.reconcile_unrecovered)
        };
        let before = reconcile(replica.node.stats());
        let membership_before = Membership::of(replica.node.stats());
        replica.node.handle(now, event, &mut self.actions);
        let after = reconcile(replica.node.stats());
        if after != before {
            log_reconcile_damage(&replica.handle.name, before, after);
        }
        Membership::of(replica.node.stats()).log_changes(&replica.handle.name, membership_before);
        self.run_actions(volume);
    }

    fn host(&mut self, request: HostRequest) {
        let Some(replica) = self.volumes.get_mut(&request.volume) else {
            let _ = request.reply.send(Err(HostError::NotPrimary));
            return;
        };
        if replica.waiting.len() >= WAITING_HOST_COMMANDS_MAX {
            let _ = request.reply.send(Err(HostError::Busy));
            return;
        }
        replica.waiting.push_back(request);
        let volume = replica.handle.map.volume().0;
        self.admit(volume);
    }

    /// Gives waiting host commands to the state machine while it has slots.
    fn admit(&mut self, volume: u64) {
        if self.admitting {
            return;
        }
        self.admitting = true;
        self.admit_waiting(volume);
        self.admitting = false;
    }

    fn admit_waiting(&mut self, volume: u64) {
        let now = self.now_ms();
        loop {
            let Some(replica) = self.volumes.get_mut(&volume) else { return };
            let Some(front) = replica.waiting.front() else { return };
            let class = Class::of(&front.op);
            let full = match class {
                // A replica being resynced that acknowledges more slowly than the hosts write
                // holds writes back (`VolumeNode::admits_write`) instead of dropping out of the
                // resync; its acknowledgements admit them again (`run_actions`).
                Class::Write => {
                    replica.writes >= replication::INFLIGHT_WRITES_MAX
                        || !replica.node.admits_write()
                        || replica.freeze.is_some()
                }
                Class::Read => replica.reads >= replication::INFLIGHT_READS_MAX,
                Class::Other => false,
            };
            if full {
                return;
            }
            let Some(request) = replica.waiting.pop_front() else { return };
            let id = HostOpId(replica.next_host_id);
            replica.next_host_id += 1;
            match class {
                Class::Write => replica.writes += 1,
                Class::Read => replica.reads += 1,
                Class::Other => {}
            }
            replica.pending.insert(id, (class, request.reply));
            replica.node.handle(now, Event::Host { id, op: request.op }, &mut self.actions);
            self.run_actions(volume);
        }
    }

    fn tick(&mut self) {
        let now = self.now_ms();
        if let Some(call) = self.keeper.tick(now) {
            // A dropped renewal is sent again once the keeper's store timeout passes.
            let _ = self.lease_jobs.try_send(StoreJob::Request {
                origin: Origin::Keeper,
                volume: 0,
                id: call.id,
                request: call.request,
            });
        }
        self.note_lease_lapse(now);
        if self.damage_scan_ms.is_none_or(|last| last + DAMAGE_SCAN_INTERVAL_MS <= now) {
            self.damage_scan_ms = Some(now);
            self.note_scrub_damage();
        }
        let volumes: Vec<u64> = self.volumes.keys().copied().collect();
        for volume in &volumes {
            self.event(*volume, Event::Tick);
        }
        // Campaign for the manager key while holding a valid lease.
        let valid = self.lease.filter(|lease| lease.valid(now));
        if let Some(lease) = valid {
            if self.last_campaign_ms.is_none_or(|last| last + CAMPAIGN_INTERVAL_MS <= now) {
                self.last_campaign_ms = Some(now);
                self.job(StoreJob::Campaign { node: self.me, lease: lease.lease });
            }
        }
        if self.manager == Some(self.me) && valid.is_some() {
            for volume in self.cluster_volumes.clone() {
                let manager =
                    self.managers.entry(volume).or_insert_with(|| Manager::new(&self.config));
                if let Some(call) = manager.tick(now) {
                    self.job(StoreJob::Request {
                        origin: Origin::Manager(volume),
                        volume,
                        id: call.id,
                        request: call.request,
                    });
                }
            }
        }
    }

    /// Hands the blocks the scrub found damaged in a replicated volume to its state machine,
    /// which has them repaired from another copy (`replication` crate docs, "Read repair"):
    /// read from a replica and rewritten on a primary, sent by the primary to a replica. Each
    /// finding once per scrub pass. A volume's blocks are found under its own label; a block
    /// stored before one of the volume's snapshots was taken belongs to the snapshot's layer
    /// and is found under that layer's label, which this does not look at (a host read of it
    /// is still repaired from another copy; the snapshot's copy here stays damaged, and other
    /// nodes' copies serve it).
    fn note_scrub_damage(&mut self) {
        for finding in self.store.engine().scrub_findings() {
            let engine::log::ScrubDamage::Block { label, block } = finding.damage else {
                continue;
            };
            // A volume not served here yet (the scrub's first pass ran at start) is looked at
            // again at the next scan.
            let Some(replica) = self.volumes.get_mut(&label) else { continue };
            if finding.repaired {
                continue;
            }
            let key = (label, block, finding.pass);
            if !self.damage_seen.contains(&key) {
                if replica.node.note_damaged(block) {
                    self.damage_seen.insert(key);
                    tracing::warn!(
                        volume = label,
                        block,
                        "scrub found a damaged block of a replicated volume: repairing it from \
                         another copy"
                    );
                }
            } else if !replica.node.is_damaged(block)
                && self.store.engine().mark_scrub_block_repaired(label, block)
            {
                tracing::info!(volume = label, block, "damaged block replaced from another copy");
            }
        }
        // Findings are at most `SCRUB_FINDINGS_MAX` at a time; older ones are forgotten.
        if self.damage_seen.len() > DAMAGE_SEEN_MAX {
            self.damage_seen.clear();
        }
    }

    /// Warns once when this node's lease lapses: it then serves none of its volumes as
    /// primary, and the cluster manager fails them over once the store's lease expires too.
    fn note_lease_lapse(&mut self, now: u64) {
        let Some(lease) = self.lease else { return };
        if lease.valid(now) || self.lease_lapsed_ms.is_some() {
            return;
        }
        self.lease_lapsed_ms = Some(now);
        self.status.lease_lapses.fetch_add(1, Ordering::Relaxed);
        let primary_of = self.volumes.values().filter(|replica| replica.node.is_primary()).count();
        tracing::warn!(
            last_renewal_sent_ms_ago =
                now.saturating_sub(lease.valid_until_ms.saturating_sub(self.config.lease_ms)),
            lease_ms = self.config.lease_ms,
            primary_of,
            "this node's lease lapsed: the control store answered no renewal sent within the \
             lease; the volumes it is primary of are not served here until a renewal is \
             answered, and the cluster manager fails them over to another node meanwhile"
        );
    }

    fn job(&mut self, job: StoreJob) {
        // A dropped job is retried by its state machine once its timeout passes.
        let _ = self.jobs.try_send(job);
    }

    /// Carries out the actions the volume's state machine returned, then updates its ANA
    /// state and admits waiting host commands into freed slots.
    fn run_actions(&mut self, volume: u64) {
        let mut freed = false;
        // A term that just ended closes the gate before anything it led to is done: a
        // resignation may let another node serve before this lease would expire.
        let now = self.now_ms();
        if let Some(replica) = self.volumes.get(&volume) {
            if replica.node.serving_until(now).is_none() {
                replica.gate.set(None);
            }
        }
        let actions = std::mem::take(&mut self.actions);
        for action in actions {
            match action {
                Action::Send { to, message } => self.send(volume, to, message),
                Action::StorageWrite { id, lba, blocks } => {
                    self.storage(volume, id, StorageWork::Write { lba, blocks });
                }
                Action::StorageRead { id, lba, count } => {
                    self.storage(volume, id, StorageWork::Read { lba, count });
                }
                Action::PersistEpoch { epoch } => self.persist_epoch(volume, epoch),
                Action::PersistIntent { version, intent } => {
                    self.persist_intent(volume, version, &intent);
                }
                Action::Store { id, request } => {
                    self.job(StoreJob::Request {
                        origin: Origin::Volume(volume),
                        volume,
                        id,
                        request,
                    });
                }
                Action::CompleteHost { id, epoch: _, result } => {
                    if let Some(replica) = self.volumes.get_mut(&volume) {
                        if let Some((class, reply)) = replica.pending.remove(&id) {
                            match class {
                                Class::Write => replica.writes -= 1,
                                Class::Read => replica.reads -= 1,
                                Class::Other => {}
                            }
                            freed = true;
                            let _ = reply.send(result);
                        }
                    }
                }
            }
        }
        self.set_ana(volume);
        let thawed = self.check_freeze(volume);
        let waiting = self.volumes.get(&volume).is_some_and(|replica| !replica.waiting.is_empty());
        if freed || waiting || thawed {
            self.admit(volume);
        }
    }

    /// Starts holding the volume's host writes for a snapshot (`ServiceCommand::Freeze`).
    fn freeze(
        &mut self,
        volume: u64,
        hold_ms: u64,
        reply: std::sync::mpsc::SyncSender<Result<Held, String>>,
    ) {
        let now = self.now_ms();
        let Some(replica) = self.volumes.get_mut(&volume) else {
            let _ = reply.try_send(Err("this node holds no replica of the volume".to_owned()));
            return;
        };
        let Some(epoch) = replica.node.serving_epoch(now) else {
            let _ = reply.try_send(Err("this node does not serve the volume now".to_owned()));
            return;
        };
        if replica.freeze.is_some() {
            let text = "another snapshot of the volume is being taken".to_owned();
            let _ = reply.try_send(Err(text));
            return;
        }
        self.next_freeze_token += 1;
        replica.freeze = Some(Freeze {
            token: self.next_freeze_token,
            epoch,
            until_ms: now + hold_ms.min(FREEZE_MS_MAX),
            waiting: Some(reply),
        });
        self.check_freeze(volume);
    }

    /// Ends a hold whose time is up or whose term ended, and answers its caller once every
    /// write taken before it completed. Returns whether it ended the hold (writes may go on).
    fn check_freeze(&mut self, volume: u64) -> bool {
        let now = self.now_ms();
        let Some(replica) = self.volumes.get_mut(&volume) else { return false };
        let Some(freeze) = &mut replica.freeze else { return false };
        let ended = if now >= freeze.until_ms {
            Some("the volume's writes were held for as long as a snapshot may hold them")
        } else if replica.node.serving_epoch(now) != Some(freeze.epoch) {
            Some("this node stopped serving the volume while its writes were held")
        } else {
            None
        };
        if let Some(reason) = ended {
            tracing::warn!(
                volume = %replica.handle.name,
                reason,
                "a snapshot's hold on the volume's writes ended before it was released"
            );
            if let Some(waiting) = replica.freeze.take().and_then(|freeze| freeze.waiting) {
                let _ = waiting.try_send(Err(reason.to_owned()));
            }
            return true;
        }
        if freeze.waiting.is_some() {
            if let Some((epoch, copies)) = replica.node.quiet_copies(now) {
                debug_assert_eq!(epoch, freeze.epoch, "a term serves one epoch");
                if let Some(waiting) = freeze.waiting.take() {
                    let held = Held { token: freeze.token, epoch, copies };
                    let _ = waiting.try_send(Ok(held));
                }
            }
        }
        false
    }

    /// Ends the hold `token` names (`ServiceCommand::Thaw`).
    fn thaw(&mut self, volume: u64, token: u64) -> Result<(), String> {
        // A hold whose time is up or whose term ended is gone before the answer.
        self.check_freeze(volume);
        let now = self.now_ms();
        let Some(replica) = self.volumes.get_mut(&volume) else {
            return Err("this node holds no replica of the volume".to_owned());
        };
        let Some(freeze) = replica.freeze.take_if(|freeze| freeze.token == token) else {
            return Err("the hold on the volume's writes had already ended (its time ran out, \
                        or this node stopped serving the volume)"
                .to_owned());
        };
        let result = if freeze.waiting.is_some() {
            Err("the volume's writes in flight had not completed".to_owned())
        } else {
            debug_assert_eq!(replica.node.serving_epoch(now), Some(freeze.epoch));
            Ok(())
        };
        self.admit(volume);
        result
    }

    /// Publishes whether (and until when) this node serves the volume: the serving gate and
    /// the ANA state of its ports.
    fn set_ana(&mut self, volume: u64) {
        let now = self.now_ms();
        let Some(replica) = self.volumes.get_mut(&volume) else { return };
        let until = replica.node.serving_until(now);
        replica.gate.set(until);
        replica.gate.moved.store(replica.node.primary_elsewhere(), Ordering::Release);
        let state = if until.is_some() { AnaState::Optimized } else { AnaState::Inaccessible };
        if replica.ana == Some(state) {
            return;
        }
        replica.ana = Some(state);
        for port in 1..=self.ports {
            self.target.set_ana_state(&replica.nqn, port, state);
        }
        tracing::info!(
            volume = %replica.handle.name,
            epoch = replica.node.epoch(),
            state = ?state,
            "replicated volume's ANA state on this node"
        );
    }

    fn send(&mut self, volume: u64, to: NodeId, message: replication::Message) {
        if let replication::Message::Append { epoch, stream, seq, .. } = message {
            if let Some(replica) = self.volumes.get_mut(&volume) {
                let metrics = &replica.handle.metrics;
                replica.acks.sent(metrics, to, (epoch, stream), seq, Instant::now());
            }
        }
        let envelope = Envelope { volume, sender: self.me, message };
        let link = self.links.entry(to).or_insert_with(|| {
            let link = Rc::new(PeerLink::default());
            tokio::task::spawn_local(peer_link(
                to,
                Arc::clone(&self.peers),
                Rc::clone(&link),
                Arc::clone(&self.status),
                self.stop.clone(),
            ));
            link
        });
        match link.queue(&envelope) {
            Queued::Appended => {
                self.status.frames_sent.fetch_add(1, Ordering::Relaxed);
                link.ready.notify_one();
            }
            // The frame already queued goes out with the newer acknowledgement instead.
            Queued::Replaced => {}
            Queued::Dropped => {
                self.status.frames_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Runs one local storage request of a volume's state machine, counted as the volume's I/O
    /// (so deleting the volume fences and drains it), and posts its result back to the inbox.
    /// A read runs as a task of its own; writes wait in `writes_queued` until the service has
    /// taken what its inbox holds, then run together ([`Service::start_queued_writes`]).
    fn storage(&mut self, volume: u64, id: StorageOpId, work: StorageWork) {
        let Some(replica) = self.volumes.get(&volume) else { return };
        let (lba, count) = match work {
            StorageWork::Write { lba, blocks } => {
                if self.writes_queued.len() >= WRITES_QUEUED_MAX {
                    self.start_queued_writes();
                }
                self.writes_queued.push(QueuedWrite { volume, id, lba, blocks });
                return;
            }
            StorageWork::Read { lba, count } => (lba, count),
        };
        let handle = Arc::clone(&replica.handle);
        let store = Rc::clone(&self.store);
        let inbox = self.link.inbox.clone();
        tokio::task::spawn_local(async move {
            let result = if handle.begin() {
                let result = read_blocks(&store, &handle.map, lba, count).await;
                handle.end();
                result
            } else {
                StorageResult::Failed
            };
            let _ = inbox.send(Input::Storage { volume, results: vec![(id, result)] }).await;
        });
    }

    /// Starts the writes the inputs just handled asked for: one task per volume runs them all
    /// at once (they join the same log batches as separate tasks would) and posts the results
    /// of those that finished together (a group commit) in one input, instead of a task and an
    /// inbox message per write. A write does not wait for the others of its group.
    fn start_queued_writes(&mut self) {
        while let Some(first) = self.writes_queued.first() {
            let volume = first.volume;
            let (writes, rest): (Vec<QueuedWrite>, Vec<QueuedWrite>) =
                std::mem::take(&mut self.writes_queued)
                    .into_iter()
                    .partition(|write| write.volume == volume);
            self.writes_queued = rest;
            // A volume removed meanwhile took its state machine with it: nobody waits.
            let Some(replica) = self.volumes.get(&volume) else { continue };
            let handle = Arc::clone(&replica.handle);
            let store = Rc::clone(&self.store);
            let inbox = self.link.inbox.clone();
            tokio::task::spawn_local(async move {
                if !handle.begin() {
                    let results = writes.iter().map(|write| (write.id, StorageResult::Failed));
                    let _ = inbox.send(Input::Storage { volume, results: results.collect() }).await;
                    return;
                }
                let map = &handle.map;
                let metrics = &handle.metrics;
                let store = &store;
                let mut running: FuturesUnordered<_> = writes
                    .iter()
                    .map(|write| async move {
                        let started = Instant::now();
                        let result = write_blocks(store, map, write.lba, &write.blocks).await;
                        if result == StorageResult::Written {
                            metrics
                                .record_replicated_write(crate::metrics::micros(started.elapsed()));
                        }
                        (write.id, result)
                    })
                    .collect();
                while let Some(first) = running.next().await {
                    let mut results = vec![first];
                    // The writes that finished with it, without waiting for the others.
                    while let Some(Some(result)) = running.next().now_or_never() {
                        results.push(result);
                    }
                    // Every write runs to its end even if nobody is left to hear of it.
                    let _ = inbox.send(Input::Storage { volume, results }).await;
                }
                handle.end();
            });
        }
    }

    fn persist_intent(&mut self, volume: u64, version: u64, intent: &replication::WriteIntent) {
        let Some((generation, metrics)) = self
            .volumes
            .get(&volume)
            .map(|replica| (replica.generation, Arc::clone(&replica.handle.metrics)))
        else {
            return;
        };
        let dir = self.state_dir.clone();
        let inbox = self.link.inbox.clone();
        let bytes = intent.to_bytes();
        tokio::task::spawn_local(async move {
            let started = Instant::now();
            let written = tokio::task::spawn_blocking(move || {
                replace_file(&dir, &intent_path(&dir, volume), &bytes)
            })
            .await;
            match written {
                Ok(Ok(())) => {
                    metrics.record_intent_persist(crate::metrics::micros(started.elapsed()));
                    let _ =
                        inbox.send(Input::IntentPersisted { volume, generation, version }).await;
                }
                Ok(Err(error)) => {
                    // Never acknowledged: the writes waiting for it stay waiting, as writes
                    // do when the storage fails.
                    tracing::error!(volume, version, %error, "cannot persist the volume's write intent");
                }
                Err(error) => {
                    tracing::error!(volume, version, %error, "write-intent writer failed")
                }
            }
        });
    }

    fn persist_epoch(&mut self, volume: u64, epoch: u64) {
        let dir = self.state_dir.clone();
        let inbox = self.link.inbox.clone();
        tokio::task::spawn_local(async move {
            let written = tokio::task::spawn_blocking(move || {
                write_counter(&dir, &epoch_path(&dir, volume), epoch)
            })
            .await;
            match written {
                Ok(Ok(())) => {
                    let _ = inbox.send(Input::EpochPersisted { volume, epoch }).await;
                }
                Ok(Err(error)) => {
                    // Never acknowledged: the node acts on nothing of this epoch.
                    tracing::error!(volume, epoch, %error, "cannot persist the volume's epoch");
                }
                Err(error) => tracing::error!(volume, epoch, %error, "epoch writer failed"),
            }
        });
    }

    fn publish_status(&mut self) {
        let now = self.now_ms();
        let mut volumes = self.status.volumes.lock().unwrap_or_else(PoisonError::into_inner);
        for (id, replica) in &self.volumes {
            volumes.insert(
                *id,
                VolumeReplication {
                    epoch: replica.node.epoch(),
                    serving: replica.node.serving_epoch(now).is_some(),
                    latched: replica.node.latched(),
                    stats: replica.node.stats().clone(),
                    resync: replica.node.resync_progress(),
                    volume_blocks: replica.node.volume_blocks(),
                },
            );
        }
        drop(volumes);
        *self.status.lease.lock().unwrap_or_else(PoisonError::into_inner) =
            self.lease.map(|lease| (lease.lease, lease.valid(now)));
    }
}

/// A local storage request of a state machine.
enum StorageWork {
    Write { lba: u64, blocks: Vec<BlockData> },
    Read { lba: u64, count: u32 },
}

/// A local write a state machine asked for, waiting for the inbox to be taken.
struct QueuedWrite {
    volume: u64,
    id: StorageOpId,
    lba: u64,
    blocks: Vec<BlockData>,
}

/// The in-sync set as a primary changes it, counted in its `replication::Stats`: replicas it
/// removed (they stopped acknowledging within `ack_timeout_ms`, half the lease), resyncs it
/// started and resynced replicas it added back. Each change is logged, since writes complete
/// on fewer copies in between. Also, as a replica, the entries it refused (which lead its
/// primary to remove it), logged at the first and each time their count doubles.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Membership {
    removed: u64,
    resyncs_started: u64,
    resyncs_completed: u64,
    entries_refused: u64,
}

impl Membership {
    fn of(stats: &replication::Stats) -> Self {
        Self {
            removed: stats.replicas_removed,
            resyncs_started: stats.resyncs_started,
            resyncs_completed: stats.resyncs_completed,
            entries_refused: stats.entries_refused,
        }
    }

    fn log_changes(self, volume: &VolumeName, before: Self) {
        // The first refusal, then each time the count doubles: a primary sends a refused entry
        // again and again until it removes this replica.
        let refused = |count: u64| count.checked_ilog2();
        if refused(self.entries_refused) > refused(before.entries_refused) {
            tracing::warn!(
                %volume,
                refused = self.entries_refused,
                "refused writes from the volume's primary whose blocks lie beyond this replica's \
                 copy of the volume (or whose length is invalid): the volume's size here differs \
                 from the primary's; the primary will remove this replica from the in-sync set \
                 (`ferrite volume show` counts the refusals)"
            );
        }
        if self.removed > before.removed {
            tracing::warn!(
                %volume,
                replicas = self.removed - before.removed,
                "a replica stopped acknowledging writes in time and left the in-sync set: \
                 writes complete on the remaining copies until it has been resynced (`ferrite \
                 volume show` names the copies in sync)"
            );
        }
        if self.resyncs_started > before.resyncs_started {
            tracing::info!(
                %volume,
                resyncs = self.resyncs_started - before.resyncs_started,
                "resyncing a replica that is out of sync (progress: `ferrite volume show`)"
            );
        }
        if self.resyncs_completed > before.resyncs_completed {
            tracing::info!(
                %volume,
                replicas = self.resyncs_completed - before.resyncs_completed,
                "a resynced replica is back in the in-sync set"
            );
        }
    }
}

/// Says what a failover's reconciliation did about blocks damaged on this node, the new
/// primary (`replication` crate docs, "Read repair"); the counters are `(damaged met,
/// repaired from another member, reconciliations stopped with no good copy)`.
fn log_reconcile_damage(volume: &VolumeName, before: (u64, u64, u64), after: (u64, u64, u64)) {
    if after.0 > before.0 {
        tracing::warn!(
            %volume,
            blocks = after.0 - before.0,
            "the reconciliation after a failover met blocks damaged on this node: taking them \
             from another member"
        );
    }
    if after.1 > before.1 {
        tracing::info!(
            %volume,
            blocks = after.1 - before.1,
            "damaged blocks taken from another member and pushed to every member"
        );
    }
    if after.2 > before.2 {
        tracing::error!(
            %volume,
            "no member had a good copy of a block damaged on this node: it stops serving the \
             volume so that another in-sync member can be promoted; check `ferrite node show` \
             for damaged blocks"
        );
    }
}

/// Fails every host command of a volume that is no longer replicated here.
fn fail_all(replica: Replica) {
    replica.gate.set(None);
    for (_, (_, reply)) in replica.pending {
        let _ = reply.send(Err(HostError::NotPrimary));
    }
    for request in replica.waiting {
        let _ = request.reply.send(Err(HostError::NotPrimary));
    }
}

/// Writes `blocks` at `lba`: runs of data are written, runs of `None` deallocated, in order.
async fn write_blocks(
    store: &LogHandle<DriveFile>,
    map: &VolumeMap,
    lba: u64,
    blocks: &[BlockData],
) -> StorageResult {
    let block = LOGICAL_BLOCK_SIZE_BYTES as usize;
    let mut index = 0usize;
    while index < blocks.len() {
        let data = blocks[index].is_some();
        let run = blocks[index..].iter().take_while(|item| item.is_some() == data).count();
        let offset = (lba + index as u64) * block as u64;
        let ok = if data {
            let items = &blocks[index..index + run];
            if !items.iter().all(|item| item.as_ref().is_some_and(|bytes| bytes.len() == block)) {
                return StorageResult::Failed;
            }
            // Each block is copied into the log's batch straight from the message's buffer, with
            // the checksum it came with.
            let run_blocks = items.iter().map(|item| match item {
                Some(block) => (&block[..], block.crc()),
                None => unreachable!("a run of data holds mapped blocks only"),
            });
            store.write_block_list(map, offset, run_blocks).await.is_ok()
        } else {
            store.deallocate(map, offset, (run * block) as u64).await.is_ok()
        };
        if !ok {
            return StorageResult::Failed;
        }
        index += run;
    }
    StorageResult::Written
}

async fn read_blocks(
    store: &LogHandle<DriveFile>,
    map: &VolumeMap,
    lba: u64,
    count: u32,
) -> StorageResult {
    let block = LOGICAL_BLOCK_SIZE_BYTES as usize;
    let length = count as usize * block;
    let mut buf = AlignedBuf::new(length);
    buf.set_len(length);
    let (result, buf) = store.read(map, lba * block as u64, buf).await;
    match result {
        Ok(()) => {}
        // The drive works; this copy of the data does not (crate docs of `replication`, "Read
        // repair"): a primary reads it from a replica, nothing latches.
        Err(StoreError::ChecksumMismatch { .. }) => return StorageResult::Damaged,
        Err(_) => return StorageResult::Failed,
    }
    // A block of zeros reads the same as an unmapped one: copied as unmapped, so a resync or
    // a rebuild keeps the copy thin (and a read of zeros alone copies nothing).
    let zeros = |bytes: &[u8]| bytes.iter().all(|byte| *byte == 0);
    if buf.chunks_exact(block).all(zeros) {
        return StorageResult::Read(vec![None; count as usize]);
    }
    let shared = bytes::Bytes::copy_from_slice(&buf);
    StorageResult::Read(
        shared
            .chunks_exact(block)
            .enumerate()
            .map(|(i, bytes)| {
                (!zeros(bytes)).then(|| Block::new(shared.slice(i * block..(i + 1) * block)))
            })
            .collect(),
    )
}

/// Accepts peers' connections and reads their frames into the inbox.
async fn accept_loop(listener: TcpListener, link: ServiceLink, mut stop: watch::Receiver<bool>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(INBOUND_CONNECTIONS_MAX));
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "replication accept failed");
                        tokio::time::sleep(Duration::from_millis(LINK_RECONNECT_MS)).await;
                        continue;
                    }
                };
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    tracing::warn!(%peer, "too many replication connections; refusing one");
                    continue;
                };
                let link = link.clone();
                let stop = stop.clone();
                tokio::task::spawn_local(async move {
                    read_frames(stream, peer, link, stop).await;
                    drop(slot);
                });
            }
            _ = stop.changed() => return,
        }
    }
}

async fn read_frames(
    mut stream: TcpStream,
    peer: SocketAddr,
    link: ServiceLink,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let mut reader = FrameReader::new();
    loop {
        // Read straight into the reader's buffer: the blocks of the frames are slices of it.
        let mut target = reader.read_buffer();
        let read = tokio::select! {
            read = stream.read_buf(&mut target) => read,
            _ = stop.changed() => return,
        };
        match read {
            Ok(0) => return,
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(%peer, %error, "replication connection closed");
                return;
            }
        }
        loop {
            match reader.next_message() {
                Ok(Some(envelope)) => {
                    if link.inbox.send(Input::Message(envelope)).await.is_err() {
                        return;
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(%peer, %error, "bad replication frame; closing the connection");
                    return;
                }
            }
        }
    }
}

/// The frames queued for one peer, shared by the service (which encodes into `queued`) and
/// the peer's link task (which swaps the queue out and writes it), both on thread 0.
#[derive(Default)]
struct PeerLink {
    queued: std::cell::RefCell<LinkQueue>,
    ready: tokio::sync::Notify,
    /// Set while the peer cannot be reached: frames are dropped instead of queued.
    down: std::cell::Cell<bool>,
    /// The acknowledgement that ends `queued`, if the last frame queued is one.
    last_ack: std::cell::Cell<Option<QueuedAck>>,
}

/// Where an `Ack` frame sits at the end of a link's queue, and what it acknowledges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct QueuedAck {
    volume: u64,
    epoch: u64,
    stream: replication::StreamId,
    durable_seq: u64,
    /// Its first byte in the queue's `head`.
    offset: usize,
}

/// Frames queued for a peer without their block data copied: the bytes the wire encoding
/// makes (headers, fields, block tables), and the blocks' bytes to send between them, shared
/// with the host write or the storage read they came from. One write of the queue sends every
/// piece in order with one vectored write per `LINK_WRITE_SLICES_MAX` pieces.
#[derive(Default)]
struct LinkQueue {
    /// The frames' encoded bytes, block data left out.
    head: Vec<u8>,
    /// Block data, in order: each piece is sent before `head[at..]`.
    data: Vec<(usize, bytes::Bytes)>,
    /// Bytes of `data`.
    data_bytes: usize,
}

/// Pieces (runs of encoded bytes, blocks' bytes) a link hands the kernel in one vectored write.
const LINK_WRITE_SLICES_MAX: usize = 256;

impl LinkQueue {
    /// Bytes the frames queued take on the wire.
    fn len(&self) -> usize {
        self.head.len() + self.data_bytes
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn clear(&mut self) {
        self.head.clear();
        self.data.clear();
        self.data_bytes = 0;
    }

    /// Appends the frame of `envelope`: its encoding, and its blocks' bytes where they lie.
    fn push(&mut self, envelope: &Envelope) -> Result<(), replication::wire::EncodeError> {
        let before = self.head.len();
        let frame_bytes = replication::wire::encode_head(envelope, &mut self.head)?;
        for block in replication::wire::data_blocks(&envelope.message) {
            self.data.push((self.head.len(), block.bytes().clone()));
            self.data_bytes += block.len();
        }
        debug_assert_eq!(
            self.head.len() - before
                + replication::wire::data_blocks(&envelope.message).map(|b| b.len()).sum::<usize>(),
            frame_bytes
        );
        Ok(())
    }

    /// Drops the bytes from `at` of `head` on, which must hold no block data (a frame without
    /// blocks, or what a failed encoding left).
    fn truncate_head(&mut self, at: usize) {
        assert!(self.data.last().is_none_or(|(piece_at, _)| *piece_at <= at));
        self.head.truncate(at);
    }

    /// How many pieces the queue sends: runs of `head` around each block's bytes.
    fn pieces(&self) -> usize {
        2 * self.data.len() + 1
    }

    /// Piece `index` of the bytes to send, in order.
    fn piece(&self, index: usize) -> &[u8] {
        let run = index / 2;
        if index % 2 == 1 {
            return &self.data[run].1;
        }
        let start = if run == 0 { 0 } else { self.data[run - 1].0 };
        let end = self.data.get(run).map_or(self.head.len(), |(at, _)| *at);
        &self.head[start..end]
    }

    /// Writes every piece to `stream`, in order, from where each lies.
    async fn write_to(&self, stream: &mut TcpStream) -> std::io::Result<()> {
        let (mut index, mut offset) = (0, 0);
        let pieces = self.pieces();
        while index < pieces {
            let mut slices = [std::io::IoSlice::new(&[]); LINK_WRITE_SLICES_MAX];
            let mut count = 0;
            let mut next = index;
            while next < pieces && count < LINK_WRITE_SLICES_MAX {
                let piece = self.piece(next);
                let skip = if next == index { offset } else { 0 };
                if piece.len() > skip {
                    slices[count] = std::io::IoSlice::new(&piece[skip..]);
                    count += 1;
                }
                next += 1;
            }
            if count == 0 {
                return Ok(());
            }
            let mut written = stream.write_vectored(&slices[..count]).await?;
            if written == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            // Past the pieces written whole, into the one written in part.
            while written > 0 {
                let left = self.piece(index).len() - offset;
                if written < left {
                    offset += written;
                    written = 0;
                } else {
                    written -= left;
                    index += 1;
                    offset = 0;
                }
            }
            while index < pieces && self.piece(index).len() == offset {
                index += 1;
                offset = 0;
            }
        }
        Ok(())
    }

    /// The bytes on the wire, contiguous (tests).
    #[cfg(test)]
    fn to_bytes(&self) -> Vec<u8> {
        (0..self.pieces()).flat_map(|index| self.piece(index).to_vec()).collect()
    }
}

/// What [`PeerLink::queue`] did with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queued {
    /// Encoded at the end of the queue.
    Appended,
    /// An acknowledgement that took the place of the one ending the queue (same volume, epoch
    /// and stream, not behind it): acknowledgements are cumulative, so the older one says
    /// nothing the newer one does not, and nothing was queued between them.
    Replaced,
    /// The peer is unreachable or the queue full (the protocol sends again), or the message
    /// could not be encoded.
    Dropped,
}

impl PeerLink {
    /// Encodes a message into the queue; its blocks' bytes stay where they are until the link
    /// writes them. A replica completes the writes of a batch together and acknowledges each
    /// one; those acknowledgements reach the queue back to back, and only the last is kept.
    fn queue(&self, envelope: &Envelope) -> Queued {
        let mut queued = self.queued.borrow_mut();
        if self.down.get() || queued.len() >= LINK_QUEUED_BYTES_MAX {
            return Queued::Dropped;
        }
        let ack = match envelope.message {
            replication::Message::Ack { epoch, stream, durable_seq } => Some(QueuedAck {
                volume: envelope.volume,
                epoch,
                stream,
                durable_seq,
                offset: queued.len(),
            }),
            _ => None,
        };
        // Whatever is queued now, the frame ending the queue will not be this acknowledgement
        // unless it is replaced below.
        let replaced = match (ack, self.last_ack.take()) {
            (Some(new), Some(old))
                if (new.volume, new.epoch, new.stream) == (old.volume, old.epoch, old.stream)
                    && new.durable_seq >= old.durable_seq =>
            {
                assert!(old.offset < queued.head.len(), "the acknowledgement ends the queue");
                Some(old.offset)
            }
            _ => None,
        };
        let before = replaced.unwrap_or(queued.head.len());
        queued.truncate_head(before);
        if let Err(error) = queued.push(envelope) {
            queued.truncate_head(before);
            tracing::error!(%error, "cannot encode a replication message");
            return Queued::Dropped;
        }
        self.last_ack.set(ack.map(|ack| QueuedAck { offset: before, ..ack }));
        if replaced.is_some() {
            Queued::Replaced
        } else {
            Queued::Appended
        }
    }

    /// Takes every queued frame out (into `into`, which must be empty) for the link to write.
    fn take_queued(&self, into: &mut LinkQueue) {
        assert!(into.is_empty(), "the link's write buffer is taken empty");
        std::mem::swap(into, &mut *self.queued.borrow_mut());
        self.last_ack.set(None);
    }

    /// Drops every queued frame (the peer is unreachable: they would be stale).
    fn clear(&self) {
        self.queued.borrow_mut().clear();
        self.last_ack.set(None);
    }
}

/// Keeps one connection to `peer` and writes the frames queued for it, gathered into large
/// writes; drops what is queued while the peer cannot be reached (the protocol sends again).
async fn peer_link(
    peer: NodeId,
    peers: Arc<RwLock<HashMap<NodeId, SocketAddr>>>,
    link: Rc<PeerLink>,
    status: Arc<ReplicationStatus>,
    mut stop: watch::Receiver<bool>,
) {
    let mut writing = LinkQueue::default();
    loop {
        if *stop.borrow() {
            return;
        }
        let address = peers.read().unwrap_or_else(PoisonError::into_inner).get(&peer).copied();
        let connected = match address {
            Some(address) => tokio::time::timeout(
                Duration::from_millis(LINK_CONNECT_TIMEOUT_MS),
                TcpStream::connect(address),
            )
            .await
            .ok()
            .and_then(Result::ok),
            None => None,
        };
        let Some(mut stream) = connected else {
            // Unreachable: what is queued would be stale by the time it arrives.
            link.down.set(true);
            link.clear();
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(LINK_RECONNECT_MS)) => {}
                _ = stop.changed() => return,
            }
            continue;
        };
        link.down.set(false);
        let _ = stream.set_nodelay(true);
        loop {
            if link.queued.borrow().is_empty() {
                tokio::select! {
                    _ = link.ready.notified() => {}
                    _ = stop.changed() => return,
                }
                continue;
            }
            writing.clear();
            link.take_queued(&mut writing);
            if let Err(error) = writing.write_to(&mut stream).await {
                tracing::debug!(%peer, %error, "replication link broke; reconnecting");
                status.frames_dropped.fetch_add(1, Ordering::Relaxed);
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use replication::{Message, StreamId};

    fn ack(volume: u64, epoch: u64, stream: u64, durable_seq: u64) -> Envelope {
        let message = Message::Ack { epoch, stream: StreamId(stream), durable_seq };
        Envelope { volume, sender: NodeId(2), message }
    }

    /// Every frame the link would write now, decoded.
    fn frames(link: &PeerLink) -> Vec<Envelope> {
        let bytes = link.queued.borrow().to_bytes();
        let mut reader = FrameReader::new();
        assert_eq!(reader.push(&bytes), bytes.len());
        let mut envelopes = Vec::new();
        while let Some(envelope) = reader.next_message().expect("the queue holds whole frames") {
            envelopes.push(envelope);
        }
        assert_eq!(reader.buffered_bytes(), 0);
        envelopes
    }

    fn heartbeat(commit_op: u64) -> Envelope {
        let message =
            Message::Heartbeat { epoch: 3, stream: StreamId(1), incarnation: 5, commit_op };
        Envelope { volume: 7, sender: NodeId(2), message }
    }

    fn write(lba: u64, blocks: u8, seed: u8) -> Envelope {
        let blocks = (0..blocks)
            .map(|i| {
                let byte = seed.wrapping_add(i);
                Some(replication::Block::from(vec![byte; LOGICAL_BLOCK_SIZE_BYTES as usize]))
            })
            .collect();
        let entry =
            replication::Entry { kind: replication::EntryKind::Write { op: lba }, lba, blocks };
        let message = Message::Append {
            epoch: 3,
            stream: StreamId(1),
            incarnation: 5,
            seq: lba,
            commit_op: 0,
            entry,
        };
        Envelope { volume: 7, sender: NodeId(2), message }
    }

    /// The queue holds the frames' encodings and the blocks' own bytes (not copies), and a
    /// link writes them to a socket as the frames they are, in order, through as many partial
    /// vectored writes as the socket takes: here about 12 MiB of 4K-32K writes, heartbeats and
    /// an acknowledgement, through loopback while the reader lags.
    #[test]
    fn a_link_sends_frames_with_the_blocks_bytes_from_where_they_lie() {
        let mut queue = LinkQueue::default();
        let mut sent = Vec::new();
        for index in 0..400u64 {
            let envelope = write(index * 8, 1 + (index % 8) as u8, index as u8);
            queue.push(&envelope).unwrap();
            sent.push(envelope);
            if index % 7 == 0 {
                let heartbeat = heartbeat(index);
                queue.push(&heartbeat).unwrap();
                sent.push(heartbeat);
            }
        }
        queue.push(&ack(7, 3, 1, 9)).unwrap();
        sent.push(ack(7, 3, 1, 9));
        // Every block is queued as a reference to the sender's bytes.
        let Message::Append { entry, .. } = &sent[0].message else { unreachable!() };
        let first = entry.blocks[0].as_ref().unwrap();
        assert!(queue.data.iter().any(|(_, bytes)| bytes.as_ptr() == first.as_ptr()));
        let mut expected = Vec::new();
        for envelope in &sent {
            replication::wire::encode(envelope, &mut expected).unwrap();
        }
        assert_eq!(queue.to_bytes(), expected);
        assert_eq!(queue.len(), expected.len());

        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let received = runtime.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = listener.local_addr().unwrap();
            let reader = tokio::spawn(async move {
                let (mut stream, _) = listener.accept().await.unwrap();
                let mut reader = FrameReader::new();
                let mut received = Vec::new();
                loop {
                    // Read slowly at first, so the writer meets a full socket.
                    if received.len() < 50 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    let read = stream.read_buf(&mut reader.read_buffer()).await.unwrap();
                    while let Some(envelope) = reader.next_message().unwrap() {
                        received.push(envelope);
                    }
                    if read == 0 {
                        return received;
                    }
                }
            });
            let mut stream = TcpStream::connect(address).await.unwrap();
            queue.write_to(&mut stream).await.unwrap();
            drop(stream);
            reader.await.unwrap()
        });
        assert_eq!(received.len(), sent.len());
        assert!(received == sent, "the frames arrived changed");
    }

    #[test]
    fn each_entry_is_timed_from_its_first_send_to_the_acknowledgement_that_covers_it() {
        let metrics = crate::metrics::VolumeMetrics::default();
        let mut clock = AckClock::default();
        let (replica, other) = (NodeId(2), NodeId(3));
        let stream = (4, StreamId(9));
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        for seq in 1..=3 {
            clock.sent(&metrics, replica, stream, seq, at(seq));
        }
        // Sent again after a loss: timed from the first send.
        clock.sent(&metrics, replica, stream, 2, at(50));
        let latency = metrics.replica_ack_latency(2);
        let (before, _) = latency.snapshot();
        assert_eq!(before[before.len() - 1], 0);
        // Another replica's, another stream's or an older epoch's acknowledgement times nothing.
        clock.acked(other, stream, 3, at(10));
        clock.acked(replica, (3, StreamId(9)), 3, at(10));
        clock.acked(replica, (4, StreamId(8)), 3, at(10));
        assert_eq!(latency.count(), 0);
        // One cumulative acknowledgement covers entries 1 and 2: 9 and 8 ms.
        clock.acked(replica, stream, 2, at(10));
        assert_eq!(latency.count(), 2);
        assert_eq!(latency.snapshot().1, 17_000);
        clock.acked(replica, stream, 2, at(20));
        assert_eq!(latency.count(), 2, "an entry is timed once");
        // A new stream (the replica back after a resync) forgets the old one's entries.
        let next = (5, StreamId(1));
        clock.sent(&metrics, replica, next, 1, at(30));
        clock.acked(replica, stream, 3, at(31));
        assert_eq!(latency.count(), 2);
        clock.acked(replica, next, 1, at(32));
        assert_eq!(latency.count(), 3);
        assert_eq!(latency.snapshot().1, 19_000);
        // At most a stream window of entries is kept: the oldest beyond it are not timed.
        let window = replication::STREAM_WINDOW_MAX as u64;
        for seq in 2..=window + 11 {
            clock.sent(&metrics, replica, next, seq, at(40));
        }
        clock.acked(replica, next, window + 11, at(41));
        assert_eq!(latency.count(), 3 + window);
    }

    #[test]
    fn back_to_back_acknowledgements_of_one_stream_leave_only_the_newest_queued() {
        let link = PeerLink::default();
        assert_eq!(link.queue(&ack(7, 3, 1, 10)), Queued::Appended);
        for seq in 11..=18 {
            assert_eq!(link.queue(&ack(7, 3, 1, seq)), Queued::Replaced);
        }
        assert_eq!(frames(&link), [ack(7, 3, 1, 18)]);
        // A repeat of the same point replaces too; an older one does not.
        assert_eq!(link.queue(&ack(7, 3, 1, 18)), Queued::Replaced);
        assert_eq!(link.queue(&ack(7, 3, 1, 17)), Queued::Appended);
        assert_eq!(frames(&link), [ack(7, 3, 1, 18), ack(7, 3, 1, 17)]);
    }

    #[test]
    fn acknowledgements_are_not_merged_across_other_frames_streams_epochs_or_a_taken_queue() {
        let link = PeerLink::default();
        let heartbeat = heartbeat(9);
        let sent = [
            ack(7, 3, 1, 10),
            heartbeat.clone(),
            ack(7, 3, 1, 11),
            ack(8, 3, 1, 12),
            ack(8, 4, 1, 13),
            ack(8, 4, 2, 14),
        ];
        for envelope in &sent {
            assert_eq!(link.queue(envelope), Queued::Appended);
        }
        assert_eq!(frames(&link), sent);

        // Once the link took the queue out to write it, a newer acknowledgement is a new frame:
        // the one taken is on its way.
        let mut writing = LinkQueue::default();
        link.take_queued(&mut writing);
        assert!(link.queued.borrow().is_empty());
        assert_eq!(link.queue(&ack(8, 4, 2, 15)), Queued::Appended);
        assert_eq!(frames(&link), [ack(8, 4, 2, 15)]);

        // Nothing is queued while the peer is down.
        link.down.set(true);
        assert_eq!(link.queue(&ack(8, 4, 2, 16)), Queued::Dropped);
        assert_eq!(frames(&link), [ack(8, 4, 2, 15)]);
    }
}
