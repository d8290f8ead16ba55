//! The NVMe/TCP data path of a node: drives, data-path threads, the acceptor, and the driver that
//! moves bytes between each connection's socket, its `nvmf::target::Queue` and the store.
//!
//! Storage is the log-structured engine (`engine::log`): thread 0 opens it at start (recovery),
//! then every thread gets its own `LogHandle<DriveFile>` over its own `io::Ring` and its own
//! O_DIRECT handles on every drive file. Thread 0 also accepts connections (NVMe/TCP, and NBD
//! for `crate::nbd`) and deals them out round robin over bounded channels; a connection then
//! lives on its thread until it closes (run to completion, no work stealing). Thread 0 also runs
//! the engine's background work: GC paced by free space, periodic checkpoints (bounding
//! recovery), the paced scrub (`crate::scrub`), drive rebuilds (`crate::rebuild`), the control
//! plane's engine operations (deleting volumes and snapshots, taking snapshots, cloning, rolling
//! back, replacing a drive), and a final checkpoint when the node stops cleanly.
//!
//! Replacing a drive: the control plane makes the new drive (a new drive file renamed over the
//! old one's name, a new memory drive, or a checked external device whose path then replaces
//! the old one in the shared [`DrivePaths`]), then thread 0 opens it and calls
//! `LogHandle::begin_replace`. Every other thread reopens its own handle of the drive, on its
//! own ring, by the path in [`DrivePaths`] (each handle's `set_reopen`) before its next I/O there.
//!
//! Per connection, one task owns the socket and the `Queue`. It reads into a fixed buffer,
//! feeds whole PDUs to the queue, starts a storage task for each request the queue hands out,
//! and writes the queue's output with non-blocking writes, so no buffer is copied between the
//! queue and the socket. Storage tasks report back through a small completion list.
//!
//! Deleting a volume fences it first (new I/O is refused), waits for its in-flight I/O to drain,
//! and only then deletes its data in the engine (durably), so a late write can never recreate
//! blocks of a deleted volume. Rolling a volume back fences and drains it the same way, and
//! serves it again once the engine's rollback is durable.

use crate::data_plane::VolumeSpace;
use crate::data_plane::{
    Capacity, DataPathBuilder, DataPathContext, DataPlane, DataPlaneError, DriveSet,
};
use crate::data_plane::{
    DriveStatus, EngineCounters, ErasureReport, HeldWrites, ScrubReport, VolumePath,
};
use crate::metrics::{Registry, VolumeMetrics};
use crate::rebuild::{RebuildStatus, Rebuilder};
use crate::scrub::{ScrubStatus, Scrubber};
use engine::compress::Compression;
use engine::log::index::LayerError;
use engine::log::{LogConfig, LogEngine, LogError, LogHandle};
use engine::{
    DriveError, DriveLatches, DriveOperation, NodeUuid, StoreError, Superblock, VolumeId,
    VolumeLayout, VolumeMap, VolumeStore, Volumes,
};
use io::{DriveFile, Ring};
use meta::{Chunk, HostAccess, SnapshotRecord, VolumeRecord};
use nvmf::target::{
    AnaState, Catalog, Listener, NamespaceInfo, Queue, RequestId, StorageOperation, StorageRequest,
    StorageStatus, SubsystemInfo, Target, TargetConfig,
};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use types::{AlignedBuf, Nqn, VolumeName, LOGICAL_BLOCK_SIZE_BYTES};

/// NVMe/TCP listen addresses (ports, in the discovery log's terms) a node serves at most.
pub const NVME_LISTENERS_MAX: usize = 16;
/// Connections waiting to be picked up by one data-path thread.
const HANDOFF_QUEUE_CONNECTIONS_MAX: usize = 64;
/// Bytes read from a socket at once; holds at least two of the largest PDUs.
const RECEIVE_BUFFER_BYTES: usize = 2 * nvmf::target::PDU_SIZE_MAX as usize;
/// How often a connection checks its keep-alive deadline and pending async events.
const CONNECTION_TICK_MS: u64 = 200;
/// Output chunks (PDU or reply bytes and Read data buffers) one vectored write sends at most.
const OUTPUT_SLICES_MAX: usize = 64;
/// How long deleting a volume waits for its in-flight I/O before giving up.
const REMOVE_DRAIN_TIMEOUT_MS: u64 = 30_000;
/// How long a closing connection keeps reading what the host still sends.
const CLOSE_DRAIN_TIMEOUT_MS: u64 = 500;
/// How much a closing connection reads and discards at most.
const CLOSE_DRAIN_BYTES_MAX: usize = 4 << 20;
/// How long a cluster node that stops cleanly waits for its volumes to step down.
const STEP_DOWN_TIMEOUT_MS: u64 = 5_000;
/// Data-path threads at most.
pub const DATA_THREADS_MAX: usize = 64;
/// How often the background task looks at free space and the checkpoint clock.
pub(crate) const BACKGROUND_TICK_MS: u64 = 50;
/// A checkpoint is taken at least this often while data changes, bounding recovery time.
const CHECKPOINT_INTERVAL_MS: u64 = 30_000;
/// Commands (volume and snapshot operations) queued for the background task.
const COMMANDS_QUEUED_MAX: usize = 16;
/// How long an engine operation (deleting a volume, taking a snapshot, ...) may take to become
/// durable before the control plane gives up waiting.
const ENGINE_OPERATION_TIMEOUT_MS: u64 = 30_000;

/// Builds the NVMe/TCP data path: formats and opens the drives, starts the threads.
#[derive(Debug)]
pub struct NvmeDataPathBuilder {
    data_threads: usize,
    poll: Duration,
    /// The background scrub's rate (0: off).
    scrub_mb_per_s: u64,
    /// The drive rebuild's rate (0: no limit).
    rebuild_mb_per_s: u64,
    /// Read-triggered defragmentation (`LogEngine::set_read_defrag`).
    read_defrag: bool,
}

impl NvmeDataPathBuilder {
    /// `data_threads` of 0 means one per CPU.
    pub fn new(data_threads: usize) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |count| count.get());
        let data_threads = if data_threads == 0 { cpus } else { data_threads };
        Self {
            data_threads: data_threads.clamp(1, DATA_THREADS_MAX),
            poll: Duration::ZERO,
            scrub_mb_per_s: crate::scrub::DEFAULT_SCRUB_MB_PER_S,
            rebuild_mb_per_s: crate::rebuild::DEFAULT_REBUILD_MB_PER_S,
            read_defrag: true,
        }
    }

    /// Whether a multi-block read of blocks scattered over the log has them rewritten back to
    /// back by its thread's defragmenter (on by default).
    pub fn with_read_defrag(mut self, on: bool) -> Self {
        self.read_defrag = on;
        self
    }

    /// Rebuilds a replaced drive writing at most `mb_per_s` MiB per second (see
    /// `crate::rebuild`); 0 sets no limit.
    pub fn with_rebuild(mut self, mb_per_s: u64) -> Self {
        assert!(mb_per_s <= crate::rebuild::REBUILD_MB_PER_S_MAX, "rebuild rate over the maximum");
        self.rebuild_mb_per_s = mb_per_s;
        self
    }

    /// Scrubs at most `mb_per_s` MiB per second in the background (see `crate::scrub`); 0 runs
    /// no scrub.
    pub fn with_scrub(mut self, mb_per_s: u64) -> Self {
        assert!(mb_per_s <= crate::scrub::SCRUB_MB_PER_S_MAX, "scrub rate over the maximum");
        self.scrub_mb_per_s = mb_per_s;
        self
    }

    /// Busy-polls each data-path thread for `poll` after its last received bytes before it
    /// sleeps (see [`Poller`]); zero (the default) never polls.
    pub fn with_poll(mut self, poll: Duration) -> Self {
        assert!(poll <= Duration::from_micros(POLL_US_MAX), "poll window over POLL_US_MAX");
        self.poll = poll;
        self
    }
}

/// The longest busy-poll window a data-path thread may be given.
pub const POLL_US_MAX: u64 = 10_000;

/// Adaptive busy polling of one data-path thread: while bytes keep arriving, the thread does not
/// go to sleep between them but keeps its runtime turning (each turn looks at the sockets and the
/// ring without blocking), and it sleeps only after `window` without new bytes.
///
/// Why: on a virtual machine a sleeping vCPU is halted, and waking it for the next command costs
/// the hypervisor's wake-up (measured here: a TCP round trip between two CPUs of this VM takes
/// about 80-250 us, on one CPU about 30 us). A thread that keeps polling stays awake, as SPDK's
/// reactors do, at the price of a busy core while I/O flows. Idle nodes burn nothing: polling
/// starts only when bytes arrive and stops `window` after the last.
pub(crate) struct Poller {
    window: Duration,
    /// Bumped on every read that brought bytes.
    activity: Cell<u64>,
    /// True while the polling task waits for activity.
    idle: Cell<bool>,
    wake: Notify,
}

impl Poller {
    fn new(window: Duration) -> Self {
        Self { window, activity: Cell::new(0), idle: Cell::new(true), wake: Notify::new() }
    }

    /// Bytes arrived: keep polling (or start again).
    pub(crate) fn touch(&self) {
        if self.window.is_zero() {
            return;
        }
        self.activity.set(self.activity.get().wrapping_add(1));
        if self.idle.get() {
            self.idle.set(false);
            self.wake.notify_one();
        }
    }

    /// The polling task of a thread: spins the runtime while bytes arrived within `window`.
    async fn run(self: Rc<Self>) {
        loop {
            self.wake.notified().await;
            let mut seen = self.activity.get();
            let mut quiet_since = Instant::now();
            // Ends `window` after the last activity: each turn either sees new activity or
            // moves closer to the deadline.
            loop {
                tokio::task::yield_now().await;
                let now_seen = self.activity.get();
                if now_seen != seen {
                    seen = now_seen;
                    quiet_since = Instant::now();
                } else if quiet_since.elapsed() >= self.window {
                    break;
                }
            }
            self.idle.set(true);
        }
    }
}

fn node_uuid(drives: &DriveSet) -> NodeUuid {
    NodeUuid(drives.node_uuid)
}

/// The engine configuration of a node's drives served by `data_threads` threads (the erasure
/// coding is what a first start formats with; an opened log keeps what its drives record).
fn log_config(drives: &DriveSet, data_threads: usize) -> LogConfig {
    let handles_max = u16::try_from(data_threads + BACKGROUND_HANDLES).unwrap_or(u16::MAX);
    LogConfig {
        erasure: drives.erasure,
        ..LogConfig::for_drives(node_uuid(drives), drives.size_bytes, handles_max)
    }
}

/// Engine handles beyond one per data-path thread: thread 0's background GC commits through a
/// handle of its own, so its relocations never hold up that thread's host writes (a handle's
/// commits complete in order, and GC took the host pipeline's lead for each of its commits:
/// in the 32K mix, that thread's writes waited 30-50 ms behind it several times a second).
const BACKGROUND_HANDLES: usize = 1;

/// The path of each drive (index = drive index), shared by every thread: a thread reopening a
/// replaced drive opens what this names. Written only by a replacement of an external drive;
/// a reopen holds the read lock while it opens, so it never sees a path half switched.
type DrivePaths = Arc<RwLock<Vec<PathBuf>>>;

/// How a data-path thread reopens drive `index` on its own `ring` after a replacement: by its
/// current path, as the thread opened it at start.
fn reopen_drive(
    paths: DrivePaths,
    ring: Rc<Ring>,
) -> Box<dyn Fn(u16) -> Result<DriveFile, DriveError>> {
    Box::new(move |index| {
        let paths = paths.read().unwrap_or_else(PoisonError::into_inner);
        let Some(path) = paths.get(usize::from(index)) else {
            return Err(reopen_error(format!("the node has no drive {index}")));
        };
        if *path == crate::rebuild::missing_drive_path() {
            return Err(reopen_error(format!(
                "drive {index} has no device since the start: replace it with `ferrite drive \
                 replace {index} --path NEW`"
            )));
        }
        DriveFile::open(path, &ring).map_err(|error| reopen_error(error.to_string()))
    })
}

fn reopen_error(message: String) -> DriveError {
    DriveError::Io {
        operation: DriveOperation::Read,
        offset_bytes: 0,
        length_bytes: 0,
        source: std::io::Error::other(message),
    }
}

/// Runs `work` on a throwaway current_thread runtime with its own ring, on this thread.
fn with_ring<T>(
    work: impl AsyncFnOnce(&Rc<Ring>) -> Result<T, String>,
) -> Result<T, DataPlaneError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(DataPlaneError::failed)?;
    let local = tokio::task::LocalSet::new();
    local
        .block_on(&runtime, async move {
            let ring = Ring::new().map_err(|error| format!("cannot set up io_uring: {error}"))?;
            let driver = tokio::task::spawn_local(Rc::clone(&ring).run());
            let output = work(&ring).await;
            driver.abort();
            output
        })
        .map_err(DataPlaneError::failed)
}

/// Writes zeros over freshly formatted drive files, past their header region, one after the
/// other, logging each (about a second per GiB on an SSD).
fn lay_out_drive_files(paths: &[PathBuf], size_bytes: u64) -> Result<(), DataPlaneError> {
    let started = std::time::Instant::now();
    let per_drive = size_bytes.saturating_sub(engine::format::HEADER_REGION_BYTES);
    if let Some(dir) = paths.first().and_then(|path| path.parent()) {
        let needed = per_drive.saturating_mul(paths.len() as u64);
        io::check_lay_out_space(dir, needed).map_err(DataPlaneError::failed)?;
    }
    tracing::info!(
        drives = paths.len(),
        drive_size = %types::ByteSize(size_bytes),
        "laying out the drive files (writing zeros over each, once; --lay-out-drives)"
    );
    for (index, path) in paths.iter().enumerate() {
        let drive_started = std::time::Instant::now();
        io::lay_out_drive_file(path, engine::format::HEADER_REGION_BYTES)
            .map_err(DataPlaneError::failed)?;
        tracing::info!(
            drive = index,
            of = paths.len(),
            seconds = drive_started.elapsed().as_secs_f64(),
            path = %path.display(),
            "laid out a drive file"
        );
    }
    tracing::info!(seconds = started.elapsed().as_secs_f64(), "laid out every drive file");
    Ok(())
}

/// Opens this thread's handle of each drive; a drive missing since the start
/// (`rebuild::missing_drive_path`) gets a stand-in whose every operation fails.
fn open_drive_files(paths: &[PathBuf], ring: &Rc<Ring>) -> Result<Vec<DriveFile>, String> {
    (0u16..)
        .zip(paths)
        .map(|(index, path)| {
            if *path == crate::rebuild::missing_drive_path() {
                Ok(DriveFile::missing(index, ring))
            } else {
                DriveFile::open(path, ring)
            }
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| error.to_string())
}

impl DataPathBuilder for NvmeDataPathBuilder {
    fn format_drives(&mut self, drives: &DriveSet) -> Result<(), DataPlaneError> {
        let infos = if drives.external.is_empty() {
            io::format_drives(&drives.dir, node_uuid(drives), drives.count, drives.size_bytes)
        } else {
            io::format_external_drives(&drives.external, node_uuid(drives), drives.size_bytes)
        }
        .map_err(DataPlaneError::failed)?;
        let paths: Vec<PathBuf> = infos.into_iter().map(|info| info.path).collect();
        let mut config = log_config(drives, self.data_threads);
        if drives.lay_out && drives.external.is_empty() {
            lay_out_drive_files(&paths, drives.size_bytes)?;
            // Zeros everywhere: the log format need not punch its area.
            config.area_zeroed = true;
        }
        with_ring(async |ring| {
            let files = open_drive_files(&paths, ring)?;
            let geometry = LogEngine::format(&files, &config)
                .await
                .map_err(|error| format!("cannot format the log: {error}"))?;
            tracing::info!(
                segments = geometry.segment_count,
                segment_size = %types::ByteSize(geometry.segment_bytes()),
                "formatted the drives for the log-structured engine"
            );
            Ok(())
        })
    }

    fn start(
        self: Box<Self>,
        context: DataPathContext,
    ) -> Result<Arc<dyn DataPlane>, DataPlaneError> {
        let drives = &context.drives;
        let (drive_paths, replacements) = if drives.external.is_empty() {
            let replacements = crate::rebuild::prepare_drive_files(drives)?;
            let infos =
                io::open_drives(&drives.dir, node_uuid(drives)).map_err(DataPlaneError::failed)?;
            (infos.into_iter().map(|info| info.path).collect::<Vec<PathBuf>>(), replacements)
        } else {
            let found = crate::rebuild::prepare_external_drives(drives)?;
            (found.paths, found.replacements)
        };
        let drive_count = u16::try_from(drive_paths.len()).map_err(DataPlaneError::failed)?;
        let volumes = Arc::new(Volumes::new());
        volumes
            .restore(context.volumes.iter().map(layout_of).collect())
            .map_err(DataPlaneError::failed)?;

        let mut context = context;
        let replication = context.replication.take().map(|setup| {
            let (link, inbox) = crate::replicate::link();
            (setup, link, inbox)
        });
        let catalog = Arc::new(NodeCatalog::default());
        // On a cluster node every volume is replicated: its I/O goes through the service.
        let mut replicated = Vec::new();
        for record in &context.volumes {
            let map = volumes.mapping(VolumeId(record.id)).ok_or_else(|| {
                DataPlaneError::failed(format!("volume {} missing after restore", record.name))
            })?;
            let route = replication
                .as_ref()
                .map(|(_, link, _)| crate::replicate::ReplicaRoute::new(record.id, link.clone()));
            let handle =
                catalog.insert_routed(record, map, context.metrics.volume(record.id), route);
            if handle.route.is_some() {
                replicated.push((handle, record.size_bytes / u64::from(LOGICAL_BLOCK_SIZE_BYTES)));
            }
        }
        // A cluster node holds copies of some of the cluster's snapshots only: its reconciler
        // serves those its engine holds, once it has recovered.
        for snapshot in context.snapshots.iter().filter(|_| replication.is_none()) {
            if let Some(volume) = context.volumes.iter().find(|v| v.name == snapshot.volume) {
                catalog.insert_snapshot(snapshot, context.metrics.volume(volume.id));
            }
        }

        if context.nvme_listen.is_empty() || context.nvme_listen.len() > NVME_LISTENERS_MAX {
            return Err(DataPlaneError::failed(format!(
                "serve NVMe/TCP on 1 to {NVME_LISTENERS_MAX} addresses (got {})",
                context.nvme_listen.len()
            )));
        }
        // Port IDs are 1, 2, ... in the order the addresses were given.
        let mut listeners = Vec::with_capacity(context.nvme_listen.len());
        let mut nvme_addrs = Vec::with_capacity(context.nvme_listen.len());
        for (port_id, address) in (1u16..).zip(&context.nvme_listen) {
            let listener = std::net::TcpListener::bind(address).map_err(|error| {
                DataPlaneError::failed(format!(
                    "cannot listen for NVMe/TCP on {address}: {error}; pass --nvme-listen with \
                     a free address"
                ))
            })?;
            listener.set_nonblocking(true).map_err(DataPlaneError::failed)?;
            let bound = listener.local_addr().map_err(DataPlaneError::failed)?;
            if nvme_addrs.contains(&bound) {
                return Err(DataPlaneError::failed(format!(
                    "--nvme-listen {bound} is given twice"
                )));
            }
            nvme_addrs.push(bound);
            listeners.push((listener, port_id));
        }
        let target_config = TargetConfig {
            listeners: (1u16..)
                .zip(&nvme_addrs)
                .map(|(port_id, address)| Listener {
                    traddr: advertised_ip(*address),
                    trsvcid: address.port().to_string(),
                    port_id,
                })
                .collect(),
            ..TargetConfig::default()
        };
        let target_config = match &replication {
            // Each node of a cluster hands out its own controller IDs: hosts connect to one
            // subsystem through several nodes.
            Some((setup, _, _)) => TargetConfig {
                cntlids: crate::replicate::cntlids_of(setup.me),
                controllers_max: crate::replicate::CLUSTER_CONTROLLERS_MAX,
                ..target_config
            },
            None => target_config,
        };
        let target = Arc::new(Target::new(target_config, Arc::clone(&catalog) as Arc<dyn Catalog>));
        // A replica is never offered as an optimized path: the service sets a volume optimized
        // only while this node serves it.
        for (handle, _) in &replicated {
            for port_id in (1u16..).take(nvme_addrs.len()) {
                target.set_ana_state(&handle.name.subsystem_nqn(), port_id, AnaState::Inaccessible);
            }
        }
        if replication.is_none() {
            for record in &context.volumes {
                restore_path_states(&target, &nvme_addrs, record);
            }
        }
        let mut nbd_listener = context.nbd_listen.map(crate::nbd::bind).transpose()?;
        let nbd_addr = match &nbd_listener {
            Some(listener) => Some(listener.local_addr().map_err(DataPlaneError::failed)?),
            None => None,
        };

        let shared = Arc::new(ThreadShared {
            target: Arc::clone(&target),
            catalog: Arc::clone(&catalog),
            drive_paths: Arc::new(RwLock::new(drive_paths)),
            drives: context.drives.clone(),
            memory_drives: context.memory_drives.clone(),
            replacements,
            latches: Arc::new(DriveLatches::new(drive_count)),
            scrub: Arc::new(ScrubStatus::new(self.scrub_mb_per_s)),
            rebuild: Arc::new(RebuildStatus::new(self.rebuild_mb_per_s)),
            read_defrag: self.read_defrag,
            log_config: log_config(&context.drives, self.data_threads),
            known_ids: context
                .volumes
                .iter()
                .map(|record| record.id)
                .chain(context.snapshots.iter().map(|record| record.id))
                .collect(),
            replication: replication.as_ref().map(|(_, link, _)| link.clone()),
        });
        let state_dir = replication.as_ref().map(|(setup, _, _)| setup.state_dir.clone());
        let mut replication = replication.map(|(setup, link, inbox)| {
            crate::replicate::ServiceStart { setup, link, inbox, volumes: replicated }
        });
        let (stop_sender, stop_receiver) = watch::channel(false);
        let (command_sender, command_receiver) = mpsc::channel(COMMANDS_QUEUED_MAX);
        let mut senders = Vec::with_capacity(self.data_threads);
        let mut receivers = Vec::with_capacity(self.data_threads);
        for _ in 0..self.data_threads {
            let (sender, receiver) = mpsc::channel(HANDOFF_QUEUE_CONNECTIONS_MAX);
            senders.push(sender);
            receivers.push(receiver);
        }
        let (ready_sender, ready_receiver) = std::sync::mpsc::channel();
        let mut threads = Vec::with_capacity(self.data_threads);
        let mut listeners = Some(listeners);
        let mut commands = Some(command_receiver);
        let mut engine: Option<Arc<LogEngine>> = None;
        // Thread 0 first: it recovers the engine, which the other threads then share.
        for (index, receiver) in receivers.into_iter().enumerate() {
            let thread = DataThread {
                index,
                shared: Arc::clone(&shared),
                connections: receiver,
                stop: stop_receiver.clone(),
                acceptor: listeners.take().map(|listeners| (listeners, senders.clone())),
                nbd_listener: nbd_listener.take(),
                engine: engine.clone(),
                commands: commands.take(),
                replication: replication.take(),
                ports: u16::try_from(nvme_addrs.len()).unwrap_or(u16::MAX),
                poll: self.poll,
            };
            let ready = ready_sender.clone();
            let handle = std::thread::Builder::new()
                .name(format!("ferrite-data-{index}"))
                .spawn(move || thread.run(ready))
                .map_err(DataPlaneError::failed)?;
            threads.push(handle);
            match ready_receiver.recv() {
                Ok(Ok(opened)) => engine = Some(opened),
                Ok(Err(message)) => {
                    let _ = stop_sender.send(true);
                    return Err(DataPlaneError::failed(message));
                }
                Err(_) => {
                    let _ = stop_sender.send(true);
                    return Err(DataPlaneError::failed("a data-path thread died while starting"));
                }
            }
        }
        drop(senders);
        let Some(engine) = engine else {
            return Err(DataPlaneError::failed("no data-path thread started"));
        };
        tracing::info!(
            nvme = ?nvme_addrs,
            nbd = ?nbd_addr,
            threads = threads.len(),
            drives = drive_count,
            "serving NVMe/TCP"
        );
        Ok(Arc::new(NvmeDataPlane {
            volumes,
            engine,
            commands: command_sender,
            catalog,
            target,
            shared,
            nvme_addrs,
            nbd_addr,
            stop: stop_sender,
            threads: Mutex::new(threads),
            metrics: context.metrics,
            replacing: Mutex::new(()),
            state_dir,
        }))
    }
}

/// The address hosts are told to connect to: a wildcard listen address is advertised as loopback.
fn advertised_ip(addr: SocketAddr) -> String {
    if addr.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else {
        addr.ip().to_string()
    }
}

/// The engine's form of a volume record's compression setting.
fn engine_compression(compression: meta::Compression) -> Compression {
    match compression {
        meta::Compression::Off => Compression::Off,
        meta::Compression::Lz4 => Compression::Lz4,
        meta::Compression::Zstd => Compression::Zstd,
    }
}

/// Serves the volume's ports in the ANA states its record keeps (set by hand with `ferrite
/// volume set-path` before a restart). A kept port this node no longer has (started with fewer
/// `--nvme-listen` addresses) is left out, with a warning; the record keeps it, so the state
/// comes back with the port.
fn restore_path_states(target: &Target, nvme_addrs: &[SocketAddr], record: &VolumeRecord) {
    for (&port_id, &state) in &record.path_states {
        let Some(address) = nvme_addrs.get(usize::from(port_id).wrapping_sub(1)) else {
            tracing::warn!(
                volume = %record.name,
                port = port_id,
                ports = nvme_addrs.len(),
                state = state.name(),
                "the volume keeps an ANA state for an NVMe port this node does not have now; \
                 not applied"
            );
            continue;
        };
        let state = match state {
            meta::PathState::NonOptimized => AnaState::NonOptimized,
            meta::PathState::Inaccessible => AnaState::Inaccessible,
        };
        target.set_ana_state(&record.name.subsystem_nqn(), port_id, state);
        tracing::info!(volume = %record.name, port = port_id, %address, ?state, "ANA state restored");
    }
}

fn layout_of(record: &VolumeRecord) -> VolumeLayout {
    VolumeLayout { volume: VolumeId(record.id), size_bytes: record.size_bytes }
}

/// What the I/O path needs of a volume, shared by every connection to it (NVMe/TCP and NBD).
pub(crate) struct VolumeHandle {
    pub(crate) name: VolumeName,
    /// For a snapshot's handle, the snapshot's name (`name` is its volume's): served read-only
    /// under [`VolumeName::snapshot_nqn`].
    pub(crate) snapshot: Option<VolumeName>,
    pub(crate) map: Arc<VolumeMap>,
    pub(crate) metrics: Arc<VolumeMetrics>,
    pub(crate) size_blocks: Arc<AtomicU64>,
    uuid: [u8; 16],
    /// Set when the volume is being deleted: new I/O is refused.
    pub(crate) fenced: AtomicBool,
    /// Storage operations started and not finished.
    inflight: AtomicU64,
    /// For a replicated volume (cluster mode), the way to its replication service: host I/O
    /// goes through it instead of straight to the log.
    pub(crate) route: Option<crate::replicate::ReplicaRoute>,
}

impl VolumeHandle {
    /// The NQN of the subsystem serving this volume or snapshot.
    pub(crate) fn nqn(&self) -> Nqn {
        match &self.snapshot {
            Some(snapshot) => self.name.snapshot_nqn(snapshot),
            None => self.name.subsystem_nqn(),
        }
    }

    /// Registers one I/O; false (and nothing registered) if the volume is fenced.
    pub(crate) fn begin(&self) -> bool {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        if self.fenced.load(Ordering::SeqCst) {
            self.inflight.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    pub(crate) fn end(&self) {
        let before = self.inflight.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "volume I/O count went below zero");
    }
}

/// The node's volumes as the NVMe/TCP target sees them: by subsystem NQN and by volume id, and
/// which hosts may connect to each.
#[derive(Default)]
pub(crate) struct NodeCatalog {
    volumes: RwLock<HashMap<u64, Arc<VolumeHandle>>>,
    /// Snapshots, served read-only over NVMe/TCP and NBD, by snapshot id. Their hosts are their
    /// volume's. Lock order: `volumes`, then `snapshots`, then `host_access`.
    snapshots: RwLock<HashMap<u64, Arc<VolumeHandle>>>,
    /// Each volume's host access, by volume id. Kept apart from [`VolumeHandle`] because only
    /// Connect and the discovery log read it, never the I/O path. Lock order: `volumes` first.
    host_access: RwLock<HashMap<u64, HostAccess>>,
    /// Bumped after every removal (of a volume or a snapshot) and host access change, so NBD
    /// connections (`crate::nbd`) notice at their next request that their export may have gone,
    /// without a lock per I/O.
    changes: AtomicU64,
}

impl NodeCatalog {
    /// How many removals and host access changes happened so far.
    pub(crate) fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    pub(crate) fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<u64, Arc<VolumeHandle>>> {
        self.volumes.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<u64, Arc<VolumeHandle>>> {
        self.volumes.write().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn host_access_read(
        &self,
    ) -> std::sync::RwLockReadGuard<'_, HashMap<u64, HostAccess>> {
        self.host_access.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn host_access_write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<u64, HostAccess>> {
        self.host_access.write().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn insert(
        &self,
        record: &VolumeRecord,
        map: Arc<VolumeMap>,
        metrics: Arc<VolumeMetrics>,
    ) -> Arc<VolumeHandle> {
        self.insert_routed(record, map, metrics, None)
    }

    /// Serves `record`; with a `route`, as a replicated volume whose I/O goes through it.
    pub(crate) fn insert_routed(
        &self,
        record: &VolumeRecord,
        map: Arc<VolumeMap>,
        metrics: Arc<VolumeMetrics>,
        route: Option<crate::replicate::ReplicaRoute>,
    ) -> Arc<VolumeHandle> {
        // Before the volume is served, so that its first write is stored as its record says.
        map.set_compression(engine_compression(record.compression));
        let handle = VolumeHandle {
            name: record.name.clone(),
            snapshot: None,
            size_blocks: Arc::new(AtomicU64::new(
                record.size_bytes / u64::from(LOGICAL_BLOCK_SIZE_BYTES),
            )),
            map,
            metrics,
            uuid: record.uuid,
            fenced: AtomicBool::new(false),
            inflight: AtomicU64::new(0),
            route,
        };
        let handle = Arc::new(handle);
        // Host access first, so the volume is never served without it.
        self.host_access_write().insert(record.id, record.host_access.clone());
        self.write().insert(record.id, Arc::clone(&handle));
        handle
    }

    /// Serves snapshot `record` read-only; its I/O is counted in its volume's `metrics`.
    pub(crate) fn insert_snapshot(&self, record: &SnapshotRecord, metrics: Arc<VolumeMetrics>) {
        let map = VolumeMap::standalone(VolumeId(record.id), record.size_bytes);
        let handle = VolumeHandle {
            name: record.volume.clone(),
            snapshot: Some(record.name.clone()),
            size_blocks: Arc::new(AtomicU64::new(
                record.size_bytes / u64::from(LOGICAL_BLOCK_SIZE_BYTES),
            )),
            map,
            metrics,
            uuid: record.uuid,
            fenced: AtomicBool::new(false),
            inflight: AtomicU64::new(0),
            route: None,
        };
        self.snapshots
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(record.id, Arc::new(handle));
    }

    /// Stops serving a snapshot.
    pub(crate) fn remove_snapshot(&self, id: u64) -> Option<Arc<VolumeHandle>> {
        let removed = self.snapshots.write().unwrap_or_else(|e| e.into_inner()).remove(&id);
        self.changes.fetch_add(1, Ordering::AcqRel);
        removed
    }

    pub(crate) fn snapshots_read(
        &self,
    ) -> std::sync::RwLockReadGuard<'_, HashMap<u64, Arc<VolumeHandle>>> {
        self.snapshots.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets a volume: its handle and its host access.
    pub(crate) fn remove(&self, id: u64) {
        self.write().remove(&id);
        self.host_access_write().remove(&id);
        self.changes.fetch_add(1, Ordering::AcqRel);
    }

    /// Replaces a served volume's host access and returns the one it had, or `None` (and keeps
    /// nothing) if the volume is not served.
    pub(crate) fn set_host_access(&self, id: u64, access: HostAccess) -> Option<HostAccess> {
        let served = self.read().contains_key(&id);
        let mut host_access = self.host_access_write();
        if !served {
            return None;
        }
        let before = host_access.insert(id, access);
        self.changes.fetch_add(1, Ordering::AcqRel);
        before
    }

    pub(crate) fn get(&self, id: u64) -> Option<Arc<VolumeHandle>> {
        self.read().get(&id).cloned().or_else(|| self.snapshots_read().get(&id).cloned())
    }

    /// The id of the served volume named `name`.
    pub(crate) fn volume_id(&self, name: &VolumeName) -> Option<u64> {
        self.read().iter().find_map(|(id, handle)| (handle.name == *name).then_some(*id))
    }
}

impl Catalog for NodeCatalog {
    fn subsystems(&self) -> Vec<SubsystemInfo> {
        let mut subsystems: Vec<SubsystemInfo> = self
            .read()
            .values()
            .chain(self.snapshots_read().values())
            .filter(|handle| !handle.fenced.load(Ordering::Acquire))
            .map(|handle| SubsystemInfo { nqn: handle.nqn() })
            .collect();
        subsystems.sort_by(|a, b| a.nqn.cmp(&b.nqn));
        subsystems
    }

    fn namespace(&self, subnqn: &Nqn) -> Option<NamespaceInfo> {
        let volumes = self.read();
        let snapshots = self.snapshots_read();
        let (id, handle) = match subnqn.snapshot_names() {
            Some((volume, snapshot)) => snapshots.iter().find(|(_, handle)| {
                handle.name == volume && handle.snapshot.as_ref() == Some(&snapshot)
            }),
            None => {
                let name = subnqn.volume_name()?;
                volumes.iter().find(|(_, handle)| handle.name == name)
            }
        }?;
        if handle.fenced.load(Ordering::Acquire) {
            return None;
        }
        let uuid = handle.uuid;
        let mut eui64 = [0u8; 8];
        eui64.copy_from_slice(&uuid[..8]);
        Some(NamespaceInfo {
            volume: *id,
            size_blocks: Arc::clone(&handle.size_blocks),
            block_size_bytes: LOGICAL_BLOCK_SIZE_BYTES,
            nguid: uuid,
            uuid,
            eui64,
            serial_number: serial_number(&uuid),
            read_only: handle.snapshot.is_some(),
        })
    }

    /// Called on Connect and per subsystem of a discovery log read. A host is allowed by the
    /// volume's [`HostAccess`]; an NQN that names no served volume allows no host.
    fn host_allowed(&self, subnqn: &Nqn, hostnqn: &Nqn) -> bool {
        if let Some((volume, snapshot)) = subnqn.snapshot_names() {
            // A snapshot's hosts are its volume's.
            let served = self.snapshots_read().values().any(|handle| {
                handle.name == volume
                    && handle.snapshot.as_ref() == Some(&snapshot)
                    && !handle.fenced.load(Ordering::Acquire)
            });
            let Some(id) = self.volume_id(&volume).filter(|_| served) else { return false };
            return self.host_access_read().get(&id).is_some_and(|access| access.allows(hostnqn));
        }
        let Some(name) = subnqn.volume_name() else {
            return false;
        };
        let volumes = self.read();
        let Some(id) = volumes.iter().find_map(|(id, handle)| {
            (handle.name == name && !handle.fenced.load(Ordering::Acquire)).then_some(*id)
        }) else {
            return false;
        };
        self.host_access_read().get(&id).is_some_and(|access| access.allows(hostnqn))
    }
}

/// Waits until the socket can take what the connection driver wants to do: read when
/// `want_read`, write when `want_write`; `Ok(None)` never comes (neither wanted: wait forever, for
/// the driver's other `select!` arm). Shared by the NVMe/TCP and NBD drivers.
pub(crate) async fn socket_ready(
    stream: &tokio::net::TcpStream,
    want_read: bool,
    want_write: bool,
) -> std::io::Result<Option<tokio::io::Ready>> {
    let interest = match (want_read, want_write) {
        (true, true) => Interest::READABLE | Interest::WRITABLE,
        (true, false) => Interest::READABLE,
        (false, true) => Interest::WRITABLE,
        (false, false) => return std::future::pending().await,
    };
    stream.ready(interest).await.map(Some)
}

/// Identify Controller SN: 20 ASCII characters, unique per subsystem.
fn serial_number(uuid: &[u8; 16]) -> String {
    uuid[..10].iter().map(|byte| format!("{byte:02x}")).collect()
}

/// What every data-path thread shares.
struct ThreadShared {
    target: Arc<Target>,
    catalog: Arc<NodeCatalog>,
    drive_paths: DrivePaths,
    /// Where the drives live and their geometry, for making replacements.
    drives: DriveSet,
    /// The memory drives of a memory-backed node, for making replacements.
    memory_drives: Option<Arc<io::MemoryDrives>>,
    /// Drives whose files were missing (or never rebuilt) at start: thread 0's rebuilder
    /// replaces them first.
    replacements: Vec<u16>,
    latches: Arc<DriveLatches>,
    /// The background scrub's state, written by thread 0's scrubber, read by the control plane.
    scrub: Arc<ScrubStatus>,
    /// The drive rebuilds' state, written by thread 0's rebuilder, read by the control plane.
    rebuild: Arc<RebuildStatus>,
    /// Read-triggered defragmentation on (set on the engine by thread 0 when it opens it).
    read_defrag: bool,
    log_config: LogConfig,
    /// The volume and snapshot ids the metadata store held at start: the engine's data of any
    /// other id (deleted just before a crash) is dropped once recovery is done.
    known_ids: std::collections::HashSet<u64>,
    /// The replication service's inbox, on a cluster node.
    replication: Option<crate::replicate::ServiceLink>,
}

/// Work the control plane hands to the background task on thread 0: one engine operation on
/// volumes and snapshots, and where to report its outcome.
struct Command {
    operation: EngineOperation,
    done: std::sync::mpsc::SyncSender<Result<(), DataPlaneError>>,
}

/// The engine operations the control plane asks for, each durable when reported done.
#[derive(Debug, Clone)]
enum EngineOperation {
    /// Deletes a fenced, drained volume's data, or a snapshot's.
    Delete {
        id: u64,
    },
    Snapshot {
        volume: u64,
        snapshot: u64,
    },
    Clone {
        volume: u64,
        snapshot: u64,
    },
    /// Of a fenced, drained volume.
    Rollback {
        volume: u64,
        snapshot: u64,
    },
    /// Puts the new drive at drive `drive`'s path (made ready by the control plane) in its
    /// place and starts its rebuild.
    Replace {
        drive: u16,
    },
    /// Rewrites replicated volume `volume`'s blocks `runs` (first block, count; at most
    /// `ROLLBACK_BLOCKS_PER_OPERATION` in all) with what snapshot `snapshot` holds here,
    /// through the volume's replication: written where the snapshot maps a block, trimmed
    /// where it does not.
    CopyFromSnapshot {
        volume: u64,
        snapshot: u64,
        runs: BlockRuns,
    },
}

/// Runs of blocks (first block, count), shown by their number and total in messages.
#[derive(Clone)]
struct BlockRuns(Vec<(u64, u32)>);

impl std::fmt::Debug for BlockRuns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let blocks: u64 = self.0.iter().map(|(_, count)| u64::from(*count)).sum();
        write!(f, "{} runs of {blocks} blocks in all", self.0.len())
    }
}

impl EngineOperation {
    /// Runs the operation on thread 0's `store`, whose drives are opened on `ring`.
    async fn run(
        self,
        store: &LogHandle<DriveFile>,
        ring: &Rc<Ring>,
        shared: &ThreadShared,
    ) -> Result<(), DataPlaneError> {
        let result = match self {
            Self::Delete { id } => store.delete_volume(id).await,
            Self::Snapshot { volume, snapshot } => store.snapshot_volume(volume, snapshot).await,
            Self::Clone { volume, snapshot } => store.clone_volume(volume, snapshot).await,
            Self::Rollback { volume, snapshot } => store.rollback_volume(volume, snapshot).await,
            Self::Replace { drive } => {
                let path = drive_path_of(shared, drive)?;
                let new = DriveFile::open(&path, ring).map_err(|error| {
                    DataPlaneError::InvalidDrive(format!("cannot open the new drive: {error}"))
                })?;
                store.begin_replace(drive, new).await
            }
            Self::CopyFromSnapshot { volume, snapshot, runs } => {
                return copy_from_snapshot(store, shared, volume, snapshot, &runs.0).await;
            }
        };
        result.map_err(|error| match error {
            LogError::Layer(refusal @ LayerError::TooDeep { .. }) => {
                DataPlaneError::SnapshotLimit(refusal.to_string())
            }
            LogError::ReplaceRefused { drive, reason } => {
                DataPlaneError::ReplaceRefused { index: drive, reason }
            }
            other => DataPlaneError::failed(other.to_string()),
        })
    }
}

/// Blocks one `EngineOperation::CopyFromSnapshot` rewrites at most: a rollback of a replicated
/// volume goes piece by piece, so thread 0's other background work runs between pieces.
const ROLLBACK_BLOCKS_PER_OPERATION: u64 = 1024;

/// `EngineOperation::CopyFromSnapshot`: each run's blocks are read from the snapshot (on this
/// thread's log) and written, or trimmed where the snapshot maps none, through the volume's
/// replication route, all runs at once.
async fn copy_from_snapshot(
    store: &LogHandle<DriveFile>,
    shared: &ThreadShared,
    volume: u64,
    snapshot: u64,
    runs: &[(u64, u32)],
) -> Result<(), DataPlaneError> {
    let handle = shared
        .catalog
        .get(volume)
        .filter(|handle| handle.snapshot.is_none() && handle.route.is_some())
        .ok_or_else(|| DataPlaneError::failed("the volume is not served here as replicated"))?;
    let Some(route) = handle.route.as_ref() else { unreachable!("filtered above") };
    let engine = store.engine();
    let block = u64::from(types::LOGICAL_BLOCK_SIZE_BYTES);
    let size_bytes = handle.map.size_bytes();
    let snapshot_map = VolumeMap::standalone(VolumeId(snapshot), size_bytes);
    // Each run splits into pieces the snapshot maps (read and written) and pieces it does
    // not (trimmed).
    let mut pieces: Vec<(u64, u64, bool)> = Vec::new();
    for &(first, count) in runs {
        for lba in first..first + u64::from(count) {
            let mapped = engine::log::index::is_block(engine.lookup(snapshot, lba));
            match pieces.last_mut() {
                Some((start, length, kind)) if *kind == mapped && *start + *length == lba => {
                    *length += 1;
                }
                _ => pieces.push((lba, 1, mapped)),
            }
        }
    }
    let (volume_map, snapshot_map) = (&handle.map, &snapshot_map);
    let copies = pieces.into_iter().map(|(lba, count, mapped)| async move {
        let (offset, length) = (lba * block, count * block);
        if !mapped {
            let trimmed = route.deallocate(volume_map, offset, length).await;
            return trimmed.map_err(|error| format!("trimming blocks {lba}+{count}: {error}"));
        }
        let buf = AlignedBuf::new(usize::try_from(length).unwrap_or(usize::MAX));
        let (read, buf) = store.read_blocks(snapshot_map, offset, buf).await;
        read.map_err(|error| format!("reading the snapshot's blocks {lba}+{count}: {error}"))?;
        let (written, _) = route.write(volume_map, offset, buf).await;
        written.map_err(|error| format!("writing blocks {lba}+{count}: {error}"))
    });
    for result in futures_util::future::join_all(copies).await {
        result.map_err(DataPlaneError::failed)?;
    }
    Ok(())
}

/// The current path of drive `index`.
fn drive_path_of(shared: &ThreadShared, index: u16) -> Result<PathBuf, DataPlaneError> {
    let paths = shared.drive_paths.read().unwrap_or_else(PoisonError::into_inner);
    paths.get(usize::from(index)).cloned().ok_or(DataPlaneError::DriveNotFound {
        index,
        count: u16::try_from(paths.len()).unwrap_or(u16::MAX),
    })
}

struct DataThread {
    index: usize,
    shared: Arc<ThreadShared>,
    connections: mpsc::Receiver<Handoff>,
    stop: watch::Receiver<bool>,
    /// Thread 0 accepts connections and deals them out to every thread (itself included).
    acceptor: Option<Acceptor>,
    /// Thread 0's NBD listener (`crate::nbd`), dealt out with the NVMe/TCP connections.
    nbd_listener: Option<std::net::TcpListener>,
    /// The engine, for threads other than 0 (thread 0 opens it).
    engine: Option<Arc<LogEngine>>,
    /// Thread 0 runs the background work and the control plane's commands.
    commands: Option<mpsc::Receiver<Command>>,
    /// Thread 0 of a cluster node runs the replication service.
    replication: Option<crate::replicate::ServiceStart>,
    /// NVMe ports of the node, whose ANA states the replication service sets.
    ports: u16,
    /// The busy-poll window (zero: never poll).
    poll: Duration,
}

impl DataThread {
    fn run(self, ready: std::sync::mpsc::Sender<Result<Arc<LogEngine>, String>>) {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(runtime) => runtime,
            Err(error) => {
                let _ = ready.send(Err(format!("cannot start a data-path runtime: {error}")));
                return;
            }
        };
        let local = tokio::task::LocalSet::new();
        local.block_on(&runtime, self.serve(ready));
    }

    async fn serve(mut self, ready: std::sync::mpsc::Sender<Result<Arc<LogEngine>, String>>) {
        let ring = match Ring::new() {
            Ok(ring) => ring,
            Err(error) => {
                let _ = ready.send(Err(format!("cannot set up io_uring: {error}")));
                return;
            }
        };
        let ring_for_driver = Rc::clone(&ring);
        let index = self.index;
        tokio::task::spawn_local(async move {
            let Err(error) = ring_for_driver.run().await;
            // Operations waiting on this ring would never complete: stop rather than hang.
            tracing::error!(thread = index, %error, "io_uring failed; stopping the node");
            std::process::abort();
        });
        let store = match self.open_store(&ring).await {
            Ok(store) => Rc::new(store),
            Err(message) => {
                let _ = ready.send(Err(message));
                return;
            }
        };
        let background = match self.commands.take() {
            None => None,
            Some(commands) => {
                // Background GC commits through a handle of its own (BACKGROUND_HANDLES).
                let gc_store = match self.take_handle(&ring, store.engine()) {
                    Ok(gc_store) => Rc::new(gc_store),
                    Err(message) => {
                        let _ = ready.send(Err(message));
                        return;
                    }
                };
                Some(tokio::task::spawn_local(background(
                    Rc::clone(&store),
                    gc_store,
                    commands,
                    Arc::clone(&self.shared),
                    Rc::clone(&ring),
                    self.stop.clone(),
                )))
            }
        };
        let replication = match self.replication.take() {
            Some(start) => match crate::replicate::spawn(
                start,
                Rc::clone(&store),
                Arc::clone(&self.shared.target),
                self.ports,
                self.stop.clone(),
            ) {
                Ok(task) => Some(task),
                Err(error) => {
                    let _ =
                        ready.send(Err(format!("cannot start the replication service: {error}")));
                    return;
                }
            },
            None => None,
        };
        if let Some((listeners, senders)) = self.acceptor.take() {
            // One accept loop per listener; they deal connections out from one shared turn.
            let next = Rc::new(std::cell::Cell::new(0usize));
            for (listener, port_id) in listeners {
                match TcpListener::from_std(listener) {
                    Ok(listener) => {
                        tokio::task::spawn_local(accept_loop(
                            listener,
                            port_id,
                            senders.clone(),
                            Rc::clone(&next),
                            self.stop.clone(),
                        ));
                    }
                    Err(error) => {
                        let _ =
                            ready.send(Err(format!("cannot watch the NVMe/TCP listener: {error}")));
                        return;
                    }
                }
            }
            if let Some(listener) = self.nbd_listener.take() {
                match TcpListener::from_std(listener) {
                    Ok(listener) => {
                        tokio::task::spawn_local(crate::nbd::accept_loop(
                            listener,
                            senders.clone(),
                            Rc::clone(&next),
                            self.stop.clone(),
                        ));
                    }
                    Err(error) => {
                        let _ = ready.send(Err(format!("cannot watch the NBD listener: {error}")));
                        return;
                    }
                }
            }
        }
        // This thread's defragmenter: rewrites the scattered ranges its reads find.
        {
            let store = Rc::clone(&store);
            let mut stop = self.stop.clone();
            tokio::task::spawn_local(async move {
                tokio::select! {
                    () = store.defragmenter() => {}
                    _ = stop.changed() => {}
                }
            });
        }
        let poller = Rc::new(Poller::new(self.poll));
        if !self.poll.is_zero() {
            tokio::task::spawn_local(Rc::clone(&poller).run());
        }
        let _ = ready.send(Ok(Arc::clone(store.engine())));
        drop(ready);
        loop {
            tokio::select! {
                connection = self.connections.recv() => {
                    let Some(connection) = connection else { break };
                    let shared = Arc::clone(&self.shared);
                    let store = Rc::clone(&store);
                    let stop = self.stop.clone();
                    let poller = Rc::clone(&poller);
                    tokio::task::spawn_local(async move {
                        match connection {
                            Handoff::Nvme { stream, port_id } => {
                                serve_connection(stream, port_id, shared, store, poller, stop)
                                    .await;
                            }
                            Handoff::Nbd { stream } => {
                                let catalog = Arc::clone(&shared.catalog);
                                crate::nbd::serve_connection(stream, catalog, store, poller, stop)
                                    .await;
                            }
                        }
                    });
                }
                _ = self.stop.changed() => break,
            }
        }
        if let Some(replication) = replication {
            if let Err(error) = replication.await {
                tracing::error!(%error, "the replication service failed");
            }
        }
        if let Some(background) = background {
            // It sees the stop too, takes the final checkpoint and returns.
            if let Err(error) = background.await {
                tracing::error!(%error, "the background task failed");
            }
        }
    }

    /// A handle on the open `engine` over drive files of its own, opened on `ring`, which
    /// reopens a replaced drive's file on that ring: another thread's store, or thread 0's
    /// handle for background GC ([`BACKGROUND_HANDLES`]).
    fn take_handle(
        &self,
        ring: &Rc<Ring>,
        engine: &Arc<LogEngine>,
    ) -> Result<LogHandle<DriveFile>, String> {
        let paths = self.shared.drive_paths.read().unwrap_or_else(PoisonError::into_inner).clone();
        let handle = engine.handle(open_drive_files(&paths, ring)?);
        handle.set_reopen(reopen_drive(Arc::clone(&self.shared.drive_paths), Rc::clone(ring)));
        Ok(handle)
    }

    /// Thread 0 opens the engine (recovery); the others take a handle on it. Each over this
    /// thread's own drive files.
    async fn open_store(&self, ring: &Rc<Ring>) -> Result<LogHandle<DriveFile>, String> {
        if let Some(engine) = &self.engine {
            return self.take_handle(ring, engine);
        }
        let paths = self.shared.drive_paths.read().unwrap_or_else(PoisonError::into_inner).clone();
        let drives = open_drive_files(&paths, ring)?;
        let reopen = reopen_drive(Arc::clone(&self.shared.drive_paths), Rc::clone(ring));
        let started = Instant::now();
        let latches = Arc::clone(&self.shared.latches);
        let (_engine, handle, report) =
            LogEngine::open(drives, self.shared.log_config.clone(), latches)
                .await
                .map_err(|error| format!("cannot open the log: {error}"))?;
        handle.set_reopen(reopen);
        handle.engine().set_read_defrag(self.shared.read_defrag);
        let geometry = handle.engine().geometry();
        if report.drives_unusable > 0 {
            tracing::warn!(
                drives = ?handle.engine().latches().failed_drives(),
                erasure_coding = %geometry.scheme(),
                "opened the log without drives whose superblock could not be read: they are \
                 latched failed and their data is rebuilt from parity on every read"
            );
        }
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            bytes_read = report.bytes_read,
            blocks_recovered = report.mapped_blocks,
            checkpoint = report.checkpoint_id,
            segments_replayed = report.segments_replayed,
            batches_replayed = report.batches_replayed,
            batches_torn = report.batches_torn,
            batches_dropped = report.batches_dropped,
            batches_damaged = report.batches_damaged,
            blocks_repaired = report.blocks_repaired,
            erasure_coding = %geometry.scheme(),
            "recovered the log"
        );
        if report.batches_damaged > 0 {
            tracing::warn!(
                batches_damaged = report.batches_damaged,
                erasure_coding = %geometry.scheme(),
                "recovery found batches whose data fails its checksums although they were durable \
                 before the stop: the drives damaged blocks after they were written; those \
                 blocks read as errors (unrecovered read error to the host) and the rest was \
                 recovered; the scrub reports where they are"
            );
        }
        for volume in handle.engine().volume_ids() {
            if self.shared.known_ids.contains(&volume) {
                continue;
            }
            tracing::info!(
                volume,
                "dropping the data of a volume or snapshot deleted before the last stop"
            );
            handle
                .delete_volume(volume)
                .await
                .map_err(|error| format!("cannot drop deleted volume {volume}: {error}"))?;
        }
        Ok(handle)
    }
}

/// The engine's background work, on thread 0: paced GC (in a task of its own, on `gc_store`,
/// the engine handle kept for it), periodic
/// checkpoints, volume deletions and the other engine operations, the paced scrub
/// (`crate::scrub`), drive rebuilds (`crate::rebuild`), and a final checkpoint when the node
/// stops.
async fn background(
    store: Rc<LogHandle<DriveFile>>,
    gc_store: Rc<LogHandle<DriveFile>>,
    mut commands: mpsc::Receiver<Command>,
    shared: Arc<ThreadShared>,
    ring: Rc<Ring>,
    mut stop: watch::Receiver<bool>,
) {
    let tick_period = Duration::from_millis(BACKGROUND_TICK_MS);
    let mut tick = tokio::time::interval(tick_period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let segments_total = store.engine().geometry().segment_count;
    let mut scrubber = Scrubber::new(Arc::clone(&shared.scrub), tick_period, segments_total);
    let mut rebuilder =
        Rebuilder::new(Arc::clone(&shared.rebuild), tick_period, shared.replacements.clone());
    let open_drive = |index: u16| -> Result<DriveFile, String> {
        let path = drive_path_of(&shared, index).map_err(|error| error.to_string())?;
        DriveFile::open(&path, &ring).map_err(|error| error.to_string())
    };
    let mut last_checkpoint = Instant::now();
    let mut written_at_checkpoint = store.engine().stats().host_bytes_written;
    // GC has a task of its own: a checkpoint, a scrub step or a command here never holds it up
    // while host writes use up the free segments. And a handle of its own (`gc_store`): its
    // commits never wait for this thread's host batches in flight, nor host writes for them.
    let gc_quit = Rc::new(Cell::new(false));
    let gc = tokio::task::spawn_local(collect_garbage(gc_store, stop.clone(), Rc::clone(&gc_quit)));
    // And so has the lay-out of the drive files' next free segments.
    let lay_out = tokio::task::spawn_local(lay_out_ahead(
        Rc::clone(&store),
        stop.clone(),
        Rc::clone(&gc_quit),
    ));
    // Drives latched at open were reported by the open (their superblock was unreadable).
    let mut failed_seen: Vec<u16> = store.engine().latches().failed_drives();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            command = commands.recv() => {
                match command {
                    Some(Command { operation, done }) => {
                        let _ = done.send(operation.run(&store, &ring, &shared).await);
                    }
                    None => break,
                }
                continue;
            }
            _ = stop.changed() => break,
        }
        let stats = store.engine().stats();
        report_failed_drives(&stats, &mut failed_seen);
        let written = stats.host_bytes_written;
        let interval = Duration::from_millis(CHECKPOINT_INTERVAL_MS);
        if written != written_at_checkpoint && last_checkpoint.elapsed() >= interval {
            match store.checkpoint().await {
                Ok(()) => {
                    last_checkpoint = Instant::now();
                    written_at_checkpoint = written;
                }
                Err(error) => tracing::warn!(%error, "periodic checkpoint failed"),
            }
        }
        scrubber.tick(&store, Instant::now()).await;
        rebuilder.tick(&store, &open_drive, Instant::now()).await;
    }
    // The loop also ends when the command channel closes: GC ends at its next tick then, and
    // never in the middle of a step (an abandoned victim would stay out of use until restart).
    gc_quit.set(true);
    if let Err(error) = gc.await {
        tracing::error!(%error, "the garbage collection task failed");
    }
    if let Err(error) = lay_out.await {
        tracing::error!(%error, "the lay-out task failed");
    }
    // A clean stop: a checkpoint now makes the next start read little. A coded log writes one
    // with up to its parity count of drives failed.
    let parity = usize::from(store.engine().geometry().parity_shards);
    if store.engine().latches().failed_drives().len() <= parity {
        match store.checkpoint().await {
            Ok(()) => tracing::info!("took the final checkpoint"),
            Err(error) => tracing::warn!(%error, "the final checkpoint failed"),
        }
    }
}

/// The background tick of thread 0's tasks: every [`BACKGROUND_TICK_MS`] (a late tick is
/// delayed, not bunched), until the node stops or `quit` is set.
struct BackgroundTicks {
    tick: tokio::time::Interval,
    stop: watch::Receiver<bool>,
    quit: Rc<Cell<bool>>,
}

impl BackgroundTicks {
    fn new(stop: watch::Receiver<bool>, quit: Rc<Cell<bool>>) -> Self {
        let mut tick = tokio::time::interval(Duration::from_millis(BACKGROUND_TICK_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        BackgroundTicks { tick, stop, quit }
    }

    /// Waits for the next tick; false once the task is to end instead.
    async fn next(&mut self) -> bool {
        tokio::select! {
            _ = self.tick.tick() => {}
            _ = self.stop.changed() => return false,
        }
        !self.quit.get()
    }
}

/// Thread 0's paced GC (see `LogHandle::gc_tick`), every background tick until the node stops
/// or `quit` is set. A failure is logged once; the next tick tries again (a drive may have been
/// replaced).
async fn collect_garbage(
    store: Rc<LogHandle<DriveFile>>,
    stop: watch::Receiver<bool>,
    quit: Rc<Cell<bool>>,
) {
    let mut ticks = BackgroundTicks::new(stop, quit);
    let mut failed_logged = false;
    while ticks.next().await {
        match store.gc_tick().await {
            Ok(()) => failed_logged = false,
            Err(error) if !failed_logged => {
                tracing::error!(%error, "garbage collection failed");
                failed_logged = true;
            }
            Err(_) => {}
        }
    }
}

/// Thread 0's lay-out of free segments ahead of the log (see `LogHandle::lay_out_step`):
/// every background tick, as many steps as find work, so the segments the log takes next are
/// laid out before it writes there. Ends when the node stops or `quit` is set, never in the
/// middle of a step (the segment it lays out is withheld from allocation until the step ends).
/// After a failure (a full filesystem, say) it says so and waits [`LAY_OUT_RETRY`].
async fn lay_out_ahead(
    store: Rc<LogHandle<DriveFile>>,
    stop: watch::Receiver<bool>,
    quit: Rc<Cell<bool>>,
) {
    let mut ticks = BackgroundTicks::new(stop, Rc::clone(&quit));
    let mut paused_until: Option<Instant> = None;
    while ticks.next().await {
        if paused_until.is_some_and(|until| Instant::now() < until) {
            continue;
        }
        paused_until = None;
        // Bounded: each step withholds a segment among the next few allocation hands out and
        // marks it laid out, so a tick finds at most that many to do.
        for _ in 0..engine::log::LAY_OUT_AHEAD_SEGMENTS {
            match store.lay_out_step().await {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(
                        %error,
                        retry_in_s = LAY_OUT_RETRY.as_secs(),
                        "cannot lay out the next free segments of the drive files: the log's \
                         first writes there make the filesystem allocate blocks on the write \
                         path (slower, and a full filesystem fails them)"
                    );
                    paused_until = Some(Instant::now() + LAY_OUT_RETRY);
                    break;
                }
            }
            if quit.get() {
                break;
            }
        }
    }
}

/// How long the lay-out task waits after a failure.
const LAY_OUT_RETRY: Duration = Duration::from_secs(60);

/// Logs each drive that became latched failed since the last call (`seen` holds the failed
/// drives already reported; a replaced drive leaves it).
fn report_failed_drives(stats: &engine::log::LogStats, seen: &mut Vec<u16>) {
    seen.retain(|drive| stats.failed_drives.contains(drive));
    for &drive in &stats.failed_drives {
        if seen.contains(&drive) {
            continue;
        }
        seen.push(drive);
        let scheme = stats.erasure;
        let failed = stats.failed_drives.len();
        let parity = usize::from(scheme.parity_shards());
        if parity == 0 {
            tracing::error!(
                drive,
                "drive {drive} is latched failed after an I/O error: no I/O reaches it; this node \
                 has no parity, so writes fail and reads of its blocks fail"
            );
        } else if failed <= parity {
            tracing::error!(
                drive,
                erasure_coding = %scheme,
                "drive {drive} is latched failed after an I/O error: hosts see no difference \
                 (its blocks are rebuilt from parity), but replace it (`ferrite drive replace \
                 {drive}`) to restore the redundancy"
            );
        } else {
            tracing::error!(
                drive,
                erasure_coding = %scheme,
                failed_drives = ?stats.failed_drives,
                "drive {drive} is latched failed after an I/O error: more drives failed than \
                 erasure coding {scheme} covers; writes fail and reads of stripes that lost too \
                 much fail"
            );
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    port_id: u16,
    senders: Vec<mpsc::Sender<Handoff>>,
    next: Rc<std::cell::Cell<usize>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(error) => {
                // Out of descriptors and the like: wait a little instead of spinning.
                tracing::warn!(%error, "accepting an NVMe/TCP connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%peer, %error, "cannot hand over an NVMe/TCP connection");
                continue;
            }
        };
        let turn = next.get();
        next.set(turn.wrapping_add(1));
        let sender = &senders[turn % senders.len()];
        if sender.send(Handoff::Nvme { stream, port_id }).await.is_err() {
            return;
        }
    }
}

/// Thread 0's listeners (each with its port ID) and the channels to every data-path thread.
type Acceptor = (Vec<(std::net::TcpListener, u16)>, Vec<mpsc::Sender<Handoff>>);

/// A connection handed to a data-path thread.
pub(crate) enum Handoff {
    /// An NVMe/TCP connection, with the port ID of the listener that accepted it (its controller
    /// reports that port's ANA state).
    Nvme { stream: std::net::TcpStream, port_id: u16 },
    /// An NBD connection (`crate::nbd`).
    Nbd { stream: std::net::TcpStream },
}

/// A storage result on its way back to the connection task.
struct Completion {
    id: RequestId,
    result: Result<(), StorageStatus>,
    buf: Option<AlignedBuf>,
}

#[derive(Default)]
struct Completions {
    done: RefCell<VecDeque<Completion>>,
    notify: Notify,
}

pub(crate) fn now_ms(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

async fn serve_connection(
    stream: std::net::TcpStream,
    port_id: u16,
    shared: Arc<ThreadShared>,
    store: Rc<LogHandle<DriveFile>>,
    poller: Rc<Poller>,
    mut stop: watch::Receiver<bool>,
) {
    let peer = stream.peer_addr().map_or_else(|_| "unknown".to_owned(), |addr| addr.to_string());
    let stream = match stream.set_nonblocking(true).and_then(|()| TcpStream::from_std(stream)) {
        Ok(stream) => stream,
        Err(error) => {
            tracing::warn!(%peer, %error, "cannot serve an NVMe/TCP connection");
            return;
        }
    };
    let _ = stream.set_nodelay(true);
    let clock = Instant::now();
    let mut queue = Queue::new_on_port(Arc::clone(&shared.target), peer.clone(), port_id, 0);
    let completions = Rc::new(Completions::default());
    let mut input = vec![0u8; RECEIVE_BUFFER_BYTES];
    let mut filled = 0usize;
    let mut volume: Option<Arc<VolumeHandle>> = None;
    let mut inflight = 0usize;
    let mut tick = tokio::time::interval(Duration::from_millis(CONNECTION_TICK_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut closing = false;

    loop {
        // Hand finished storage work back to the queue.
        loop {
            let Some(done) = completions.done.borrow_mut().pop_front() else { break };
            inflight -= 1;
            queue.complete(done.id, done.result, done.buf);
        }
        // Start the storage work the queue asks for.
        while let Some(request) = queue.next_request() {
            inflight += 1;
            start_request(request, &shared, &store, &completions, &mut volume);
        }
        // Send what is pending, as far as the socket takes it now: PDU bytes and Read data
        // buffers together, in vectored writes.
        while queue.output_len() > 0 {
            match try_write_chunks(&stream, queue.output_chunks()) {
                Ok(0) => {
                    closing = true;
                    break;
                }
                Ok(written) => queue.consume_output(written),
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(error) => {
                    tracing::debug!(%peer, %error, "NVMe/TCP connection write failed");
                    closing = true;
                    break;
                }
            }
        }
        if closing || (queue.wants_close() && queue.output_len() == 0) {
            break;
        }
        let want_write = queue.output_len() > 0;
        let want_read = !queue.wants_close() && filled < input.len();
        let ready = socket_ready(&stream, want_read, want_write);
        tokio::select! {
            biased;
            _ = completions.notify.notified(), if inflight > 0 => continue,
            ready = ready => {
                let ready = match ready {
                    Ok(Some(ready)) => ready,
                    Ok(None) => continue,
                    Err(error) => {
                        tracing::debug!(%peer, %error, "NVMe/TCP connection failed");
                        break;
                    }
                };
                if ready.is_readable() && want_read {
                    match stream.try_read(&mut input[filled..]) {
                        Ok(0) => break,
                        Ok(read) => {
                            poller.touch();
                            filled += read;
                            match queue.receive(&input[..filled], now_ms(clock)) {
                                Ok(consumed) => {
                                    input.copy_within(consumed..filled, 0);
                                    filled -= consumed;
                                }
                                Err(reason) => {
                                    tracing::warn!(%peer, %reason, "closing NVMe/TCP connection");
                                    filled = 0;
                                }
                            }
                        }
                        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(error) => {
                            tracing::debug!(%peer, %error, "NVMe/TCP connection read failed");
                            break;
                        }
                    }
                }
            }
            _ = tick.tick() => {
                let now = now_ms(clock);
                queue.poll(now);
                if queue.keep_alive_expired(now) {
                    tracing::warn!(%peer, "keep-alive timeout: closing the controller's queue");
                    break;
                }
            }
            _ = stop.changed() => break,
        }
    }
    close_gracefully(stream).await;
    // Storage tasks still running hold their own references; their completions are dropped
    // with the queue, which only recycles buffers after termination.
}

/// Ends a connection with a FIN rather than a reset: half-closes it, then reads and discards
/// what the host still sends for a bounded time, so that unread input does not make the kernel
/// answer with RST.
pub(crate) async fn close_gracefully(mut stream: TcpStream) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let _ = stream.shutdown().await;
    let drain = async {
        let mut discard = [0u8; 4096];
        let mut remaining = CLOSE_DRAIN_BYTES_MAX;
        while remaining > 0 {
            match stream.read(&mut discard).await {
                Ok(0) | Err(_) => break,
                Ok(read) => remaining = remaining.saturating_sub(read),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(CLOSE_DRAIN_TIMEOUT_MS), drain).await;
}

/// Starts one storage request as a task on this thread; its completion goes to `completions`.
fn start_request(
    request: StorageRequest,
    shared: &Arc<ThreadShared>,
    store: &Rc<LogHandle<DriveFile>>,
    completions: &Rc<Completions>,
    cached: &mut Option<Arc<VolumeHandle>>,
) {
    let handle = match cached {
        Some(handle) if handle.map.volume() == VolumeId(request.volume) => Arc::clone(handle),
        _ => match shared.catalog.get(request.volume) {
            Some(handle) => {
                *cached = Some(Arc::clone(&handle));
                handle
            }
            None => {
                let buf = take_buffer(request.operation);
                completions.done.borrow_mut().push_back(Completion {
                    id: request.id,
                    result: Err(StorageStatus::NotReady),
                    buf,
                });
                return;
            }
        },
    };
    if !handle.begin() {
        let buf = take_buffer(request.operation);
        completions.done.borrow_mut().push_back(Completion {
            id: request.id,
            result: Err(StorageStatus::NotReady),
            buf,
        });
        return;
    }
    let store = Rc::clone(store);
    let completions = Rc::clone(completions);
    tokio::task::spawn_local(async move {
        let started = Instant::now();
        let id = request.id;
        let (result, buf) = match &handle.route {
            Some(route) => execute(&route.with_local(&store), &handle, request.operation).await,
            None => execute(&*store, &handle, request.operation).await,
        };
        let latency_us = crate::metrics::micros(started.elapsed());
        record(&handle.metrics, &result, latency_us);
        handle.end();
        let result = result.map(|_| ()).map_err(|error| storage_status(&error));
        completions.done.borrow_mut().push_back(Completion { id, result, buf });
        completions.notify.notify_one();
    });
}

fn take_buffer(operation: StorageOperation) -> Option<AlignedBuf> {
    match operation {
        StorageOperation::Read { buf, .. } | StorageOperation::Write { buf, .. } => Some(buf),
        StorageOperation::Deallocate { ranges } => Some(ranges.into_buf()),
        StorageOperation::Flush | StorageOperation::WriteZeroes { .. } => None,
    }
}

/// What an operation did, for metrics.
enum Done {
    Read(u64),
    Written(u64),
    Flushed,
    Zeroed(u64),
    Deallocated(u64),
}

async fn execute(
    store: &impl VolumeStore,
    handle: &VolumeHandle,
    operation: StorageOperation,
) -> (Result<Done, StoreError>, Option<AlignedBuf>) {
    let block = u64::from(LOGICAL_BLOCK_SIZE_BYTES);
    let map = &*handle.map;
    match operation {
        StorageOperation::Read { lba, blocks, buf } => {
            let (result, buf) = store.read(map, lba * block, buf).await;
            (result.map(|()| Done::Read(u64::from(blocks) * block)), Some(buf))
        }
        StorageOperation::Write { lba, blocks, buf } => {
            let (result, buf) = store.write(map, lba * block, buf).await;
            (result.map(|()| Done::Written(u64::from(blocks) * block)), Some(buf))
        }
        StorageOperation::Flush => (store.flush(map).await.map(|()| Done::Flushed), None),
        StorageOperation::WriteZeroes { lba, blocks } => {
            let length = u64::from(blocks) * block;
            (
                store.write_zeroes(map, lba * block, length).await.map(|()| Done::Zeroed(length)),
                None,
            )
        }
        StorageOperation::Deallocate { ranges } => {
            let mut outcome = Ok(0u64);
            for (lba, blocks) in ranges.iter() {
                let length = u64::from(blocks) * block;
                match store.deallocate(map, lba * block, length).await {
                    Ok(()) => outcome = outcome.map(|total| total + length),
                    Err(error) => {
                        outcome = Err(error);
                        break;
                    }
                }
            }
            (outcome.map(Done::Deallocated), Some(ranges.into_buf()))
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

fn storage_status(error: &StoreError) -> StorageStatus {
    match error {
        StoreError::OutOfRange { .. } | StoreError::Unaligned { .. } => {
            StorageStatus::LbaOutOfRange
        }
        StoreError::VolumeRemoved { .. } => StorageStatus::NotReady,
        StoreError::CapacityExceeded { .. } => StorageStatus::CapacityExceeded,
        StoreError::ChecksumMismatch { .. } | StoreError::Unrecovered { .. } => {
            StorageStatus::UnrecoveredReadError
        }
        StoreError::ReadOnly { .. } => StorageStatus::WriteProtected,
        StoreError::NotServing { .. } => StorageStatus::PathInaccessible,
        StoreError::DriveFailed { .. } | StoreError::Io { .. } => StorageStatus::Internal,
    }
}

/// The running data path as the control plane sees it.
struct NvmeDataPlane {
    volumes: Arc<Volumes>,
    engine: Arc<LogEngine>,
    commands: mpsc::Sender<Command>,
    catalog: Arc<NodeCatalog>,
    target: Arc<Target>,
    shared: Arc<ThreadShared>,
    /// The bound NVMe/TCP addresses; port ID `i + 1` is `nvme_addrs[i]`.
    nvme_addrs: Vec<SocketAddr>,
    /// The bound NBD address, if NBD is served.
    nbd_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    metrics: Arc<Registry>,
    /// Serialises drive replacements: one at a time, from making the drive to the switch.
    replacing: Mutex<()>,
    /// Where a cluster node keeps its volumes' epoch files; `None` off a cluster.
    state_dir: Option<PathBuf>,
}

impl NvmeDataPlane {
    /// Refuses a replacement the engine would refuse, before any drive is touched.
    fn check_replace(&self, index: u16) -> Result<(), DataPlaneError> {
        let refuse = |reason: String| Err(DataPlaneError::ReplaceRefused { index, reason });
        let geometry = self.engine.geometry();
        if !geometry.is_coded() {
            return refuse(
                "this node's drives hold no parity (erasure coding none), so a lost drive's data \
                 cannot be rebuilt; restore the node's volumes from a replica or a backup"
                    .to_owned(),
            );
        }
        let latches = self.engine.latches();
        if let Some(rebuilding) = latches.rebuilding_drive() {
            return refuse(format!(
                "drive {rebuilding} is being rebuilt; replace one drive at a time, once its \
                 rebuild finished (`ferrite node show`)"
            ));
        }
        let others: Vec<u16> =
            latches.failed_drives().into_iter().filter(|other| *other != index).collect();
        if others.len() + 1 > usize::from(geometry.parity_shards) {
            return refuse(format!(
                "drives {others:?} are failed too, and erasure coding {} survives the loss of {} \
                 drive(s): taking drive {index} out as well would lose data; replace the failed \
                 drives first",
                geometry.scheme(),
                geometry.parity_shards
            ));
        }
        Ok(())
    }

    /// Makes the new drive `index` ready (formatted with its drive superblock, at the path the
    /// threads will reopen) and returns its path.
    fn make_replacement(
        &self,
        index: u16,
        path: Option<PathBuf>,
    ) -> Result<PathBuf, DataPlaneError> {
        let drives = &self.shared.drives;
        let uuid = node_uuid(drives);
        match (drives.external.is_empty(), path) {
            (true, Some(path)) => Err(DataPlaneError::InvalidDrive(format!(
                "this node's drives are files the node makes itself (in {}), so a replacement \
                 takes no path: leave --path {} out",
                drives.dir.display(),
                path.display()
            ))),
            (true, None) => {
                let info = match &self.shared.memory_drives {
                    Some(memory) => {
                        let superblock =
                            Superblock::new(uuid, index, drives.count, drives.size_bytes)
                                .map_err(DataPlaneError::failed)?;
                        memory.replace(&superblock)
                    }
                    None => io::replace_drive_file(
                        &drives.dir,
                        uuid,
                        index,
                        drives.count,
                        drives.size_bytes,
                    ),
                }
                .map_err(DataPlaneError::failed)?;
                Ok(info.path)
            }
            (false, None) => Err(DataPlaneError::InvalidDrive(
                "this node's drives are block devices or files given with --drive: give the new \
                 drive with --path PATH"
                    .to_owned(),
            )),
            (false, Some(path)) => {
                let current =
                    self.shared.drive_paths.read().unwrap_or_else(PoisonError::into_inner).clone();
                io::prepare_external_replacement(
                    &path,
                    uuid,
                    index,
                    drives.count,
                    drives.size_bytes,
                    &current,
                )
                .map_err(|error| {
                    DataPlaneError::InvalidDrive(format!(
                        "cannot use {} as the new drive {index}: {error}",
                        path.display()
                    ))
                })?;
                Ok(path)
            }
        }
    }

    /// Runs an engine operation through thread 0 and waits until it is durable.
    fn run(&self, operation: EngineOperation) -> Result<(), DataPlaneError> {
        let what = format!("{operation:?}");
        let (done, result) = std::sync::mpsc::sync_channel(1);
        self.commands
            .blocking_send(Command { operation, done })
            .map_err(|_| DataPlaneError::failed("the data path is stopping"))?;
        match result.recv_timeout(Duration::from_millis(ENGINE_OPERATION_TIMEOUT_MS)) {
            Ok(outcome) => outcome,
            Err(_) => Err(DataPlaneError::failed(format!(
                "the engine did not finish {what} within {ENGINE_OPERATION_TIMEOUT_MS} ms"
            ))),
        }
    }

    /// Deletes a volume's data in the engine and waits until it is durable.
    fn delete_data(&self, id: u64) -> Result<(), DataPlaneError> {
        self.run(EngineOperation::Delete { id })
    }

    /// Stops serving snapshot `id` (hosts reading it are drained and disconnected first),
    /// then deletes its data.
    fn drop_snapshot_data(&self, id: u64) -> Result<(), DataPlaneError> {
        if let Some(handle) = self.catalog.get(id).filter(|handle| handle.snapshot.is_some()) {
            let drained = self.fence_and_drain(&handle);
            self.target.disconnect_subsystem(&handle.nqn());
            self.catalog.remove_snapshot(id);
            self.target.notify_subsystems_changed();
            drained.map_err(|error| {
                DataPlaneError::failed(format!("the snapshot's reads did not drain: {error}"))
            })?;
        }
        self.delete_data(id)
    }

    /// Fences a served volume (new I/O is refused) and waits for its in-flight I/O to drain.
    /// On a timeout the volume stays fenced and the error says so; the caller unfences.
    fn fence_and_drain(&self, handle: &VolumeHandle) -> Result<(), DataPlaneError> {
        handle.fenced.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_millis(REMOVE_DRAIN_TIMEOUT_MS);
        while handle.inflight.load(Ordering::SeqCst) > 0 {
            if Instant::now() > deadline {
                return Err(DataPlaneError::failed(format!(
                    "the in-flight I/O of volume {} did not drain within \
                     {REMOVE_DRAIN_TIMEOUT_MS} ms",
                    handle.name
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

impl DataPlane for NvmeDataPlane {
    fn reserve_create(&self, id: u64, size_bytes: u64) -> Result<Vec<Chunk>, DataPlaneError> {
        // Thin: nothing is reserved on the drives, only the intent is recorded.
        self.volumes.reserve_create(VolumeId(id), size_bytes).map_err(DataPlaneError::failed)?;
        Ok(Vec::new())
    }

    fn reserve_grow(
        &self,
        volume: &VolumeRecord,
        size_bytes: u64,
    ) -> Result<Vec<Chunk>, DataPlaneError> {
        self.volumes
            .reserve_grow(VolumeId(volume.id), size_bytes)
            .map_err(DataPlaneError::failed)?;
        Ok(volume.chunks.clone())
    }

    fn cancel(&self, proposed: &VolumeRecord) {
        self.volumes.cancel(&layout_of(proposed));
    }

    fn publish(&self, volume: &VolumeRecord) {
        self.volumes.publish(layout_of(volume));
        match self.catalog.get(volume.id) {
            Some(handle) => {
                // A resize: the map grew in place; tell connected hosts the new size.
                handle.size_blocks.store(
                    volume.size_bytes / u64::from(LOGICAL_BLOCK_SIZE_BYTES),
                    Ordering::Release,
                );
                self.target.notify_namespace_changed(&volume.name.subsystem_nqn());
            }
            None => {
                let Some(map) = self.volumes.mapping(VolumeId(volume.id)) else {
                    tracing::error!(volume = %volume.name, "published volume has no mapping");
                    return;
                };
                self.catalog.insert(volume, map, self.metrics.volume(volume.id));
                self.target.notify_subsystems_changed();
            }
        }
    }

    fn remove(&self, volume: &VolumeRecord) {
        if let Some(handle) = self.catalog.get(volume.id) {
            if handle.route.is_some() {
                if let Some(link) = &self.shared.replication {
                    link.command_blocking(crate::replicate::ServiceCommand::Remove {
                        volume: volume.id,
                    });
                }
            }
            handle.fenced.store(true, Ordering::SeqCst);
            self.target.disconnect_subsystem(&volume.name.subsystem_nqn());
            let deadline = Instant::now() + Duration::from_millis(REMOVE_DRAIN_TIMEOUT_MS);
            while handle.inflight.load(Ordering::SeqCst) > 0 {
                if Instant::now() > deadline {
                    tracing::error!(
                        volume = %volume.name,
                        "in-flight I/O did not drain; the volume's data is dropped at the next \
                         start"
                    );
                    self.catalog.remove(volume.id);
                    self.volumes.remove(VolumeId(volume.id));
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            self.catalog.remove(volume.id);
        }
        self.volumes.remove(VolumeId(volume.id));
        // A volume created later under the same name starts with every path optimized.
        self.target.forget_ana_states(&volume.name.subsystem_nqn());
        self.target.notify_subsystems_changed();
        if let Err(error) = self.delete_data(volume.id) {
            tracing::error!(
                volume = %volume.name,
                %error,
                "could not delete the volume's data now; it is dropped at the next start"
            );
        }
        if let Some(dir) = &self.state_dir {
            crate::replicate::forget_volume_state(dir, volume.id);
        }
    }

    fn set_cluster_volumes(&self, volumes: Vec<u64>) {
        if let Some(link) = &self.shared.replication {
            link.command_blocking(crate::replicate::ServiceCommand::ClusterVolumes { volumes });
        }
    }

    fn publish_replicated(&self, volume: &VolumeRecord) -> Result<(), DataPlaneError> {
        let Some(link) = &self.shared.replication else {
            return Err(DataPlaneError::failed("this node is not part of a cluster"));
        };
        if self.catalog.get(volume.id).is_some() {
            return Ok(());
        }
        self.volumes.publish(layout_of(volume));
        let Some(map) = self.volumes.mapping(VolumeId(volume.id)) else {
            return Err(DataPlaneError::failed(format!(
                "volume {} has no mapping after publishing",
                volume.name
            )));
        };
        for port_id in (1u16..).take(self.nvme_addrs.len()) {
            self.target.set_ana_state(
                &volume.name.subsystem_nqn(),
                port_id,
                AnaState::Inaccessible,
            );
        }
        let route = crate::replicate::ReplicaRoute::new(volume.id, link.clone());
        let handle =
            self.catalog.insert_routed(volume, map, self.metrics.volume(volume.id), Some(route));
        let size_blocks = volume.size_bytes / u64::from(LOGICAL_BLOCK_SIZE_BYTES);
        if !link.command_blocking(crate::replicate::ServiceCommand::Add { handle, size_blocks }) {
            return Err(DataPlaneError::failed("the replication service has stopped"));
        }
        self.target.notify_subsystems_changed();
        Ok(())
    }

    fn grow_replicated(
        &self,
        volume: &VolumeRecord,
        size_bytes: u64,
    ) -> Result<(), DataPlaneError> {
        let Some(link) = &self.shared.replication else {
            return Err(DataPlaneError::failed("this node is not part of a cluster"));
        };
        let Some(handle) = self.catalog.get(volume.id) else {
            return Err(DataPlaneError::failed(format!("volume {} is not served", volume.name)));
        };
        assert!(size_bytes > volume.size_bytes, "the reconciler grows only");
        self.volumes
            .reserve_grow(VolumeId(volume.id), size_bytes)
            .map_err(DataPlaneError::failed)?;
        let grown = VolumeRecord { size_bytes, ..volume.clone() };
        // The map grows in place: every block beyond the old end reads as unmapped.
        self.volumes.publish(layout_of(&grown));
        let size_blocks = size_bytes / u64::from(LOGICAL_BLOCK_SIZE_BYTES);
        let command = crate::replicate::ServiceCommand::Grow { volume: volume.id, size_blocks };
        if !link.command_blocking(command) {
            return Err(DataPlaneError::failed("the replication service has stopped"));
        }
        // Hosts learn the size last: their commands reach the replication service after it.
        handle.size_blocks.store(size_blocks, Ordering::Release);
        self.target.notify_namespace_changed(&volume.name.subsystem_nqn());
        Ok(())
    }

    fn snapshot(
        &self,
        volume: &VolumeRecord,
        snapshot: &SnapshotRecord,
    ) -> Result<(), DataPlaneError> {
        self.run(EngineOperation::Snapshot { volume: volume.id, snapshot: snapshot.id })?;
        self.catalog.insert_snapshot(snapshot, self.metrics.volume(volume.id));
        self.target.notify_subsystems_changed();
        Ok(())
    }

    fn clone_snapshot(&self, clone: &VolumeRecord, snapshot_id: u64) -> Result<(), DataPlaneError> {
        self.run(EngineOperation::Clone { volume: clone.id, snapshot: snapshot_id })
    }

    fn rollback(&self, volume: &VolumeRecord, snapshot_id: u64) -> Result<(), DataPlaneError> {
        let Some(handle) = self.catalog.get(volume.id) else {
            return Err(DataPlaneError::failed(format!("volume {} is not served", volume.name)));
        };
        // Fenced so that no write lands while the volume changes layers, as for a deletion;
        // served again whatever the outcome.
        let result = self.fence_and_drain(&handle).and_then(|()| {
            self.run(EngineOperation::Rollback { volume: volume.id, snapshot: snapshot_id })
        });
        handle.fenced.store(false, Ordering::SeqCst);
        result
    }

    fn rollback_replicated(
        &self,
        volume: &VolumeRecord,
        snapshot_id: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<u64, DataPlaneError> {
        if self.catalog.get(volume.id).is_none_or(|handle| handle.route.is_none()) {
            return Err(DataPlaneError::failed(format!(
                "volume {} is not served here as a replicated volume",
                volume.name
            )));
        }
        // A piece at a time, in block order: the engine is asked for the next blocks that may
        // differ, which are rewritten before it is asked again.
        let volume_blocks = volume.size_bytes / u64::from(types::LOGICAL_BLOCK_SIZE_BYTES);
        let limit = usize::try_from(ROLLBACK_BLOCKS_PER_OPERATION).unwrap_or(usize::MAX);
        let mut rewritten = 0u64;
        let mut from = Some(0u64);
        progress(0, volume_blocks);
        while let Some(start) = from {
            let (blocks, next) = self
                .engine
                .blocks_differing(volume.id, snapshot_id, start, limit)
                .map_err(|error| DataPlaneError::failed(error.to_string()))?;
            for piece in blocks.chunks(limit) {
                let mut runs: Vec<(u64, u32)> = Vec::new();
                for &lba in piece {
                    match runs.last_mut() {
                        Some((first, count)) if *first + u64::from(*count) == lba => *count += 1,
                        _ => runs.push((lba, 1)),
                    }
                }
                let runs = BlockRuns(runs);
                let operation = EngineOperation::CopyFromSnapshot {
                    volume: volume.id,
                    snapshot: snapshot_id,
                    runs,
                };
                self.run(operation)?;
                rewritten += piece.len() as u64;
            }
            assert!(next.is_none_or(|next| next > start), "the engine's cursor moves on");
            from = next;
            progress(from.unwrap_or(volume_blocks).min(volume_blocks), volume_blocks);
        }
        Ok(rewritten)
    }

    fn remove_snapshot(&self, snapshot: &SnapshotRecord) {
        if let Err(error) = self.drop_snapshot_data(snapshot.id) {
            tracing::error!(
                volume = %snapshot.volume,
                snapshot = %snapshot.name,
                %error,
                "could not delete the snapshot's data now; it is dropped at the next start"
            );
        }
    }

    fn freeze_replicated(
        &self,
        volume: &VolumeRecord,
        hold_ms: u64,
    ) -> Result<HeldWrites, DataPlaneError> {
        let Some(link) = &self.shared.replication else {
            return Err(DataPlaneError::failed("this node is not part of a cluster"));
        };
        let hold_ms = hold_ms.min(crate::replicate::FREEZE_MS_MAX);
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        let command =
            crate::replicate::ServiceCommand::Freeze { volume: volume.id, hold_ms, reply };
        if !link.command_blocking(command) {
            return Err(DataPlaneError::failed("the replication service has stopped"));
        }
        // The service answers within the hold, at the latest when it ends.
        match answer.recv_timeout(Duration::from_millis(hold_ms + 1_000)) {
            Ok(Ok(held)) => Ok(HeldWrites {
                token: held.token,
                epoch: held.epoch,
                copies: held.copies.iter().map(|node| node.0).collect(),
            }),
            Ok(Err(reason)) => Err(DataPlaneError::failed(reason)),
            Err(_) => Err(DataPlaneError::failed("the replication service did not answer")),
        }
    }

    fn thaw_replicated(&self, volume: &VolumeRecord, token: u64) -> Result<(), DataPlaneError> {
        let Some(link) = &self.shared.replication else {
            return Err(DataPlaneError::failed("this node is not part of a cluster"));
        };
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        let command = crate::replicate::ServiceCommand::Thaw { volume: volume.id, token, reply };
        if !link.command_blocking(command) {
            return Err(DataPlaneError::failed("the replication service has stopped"));
        }
        match answer.recv_timeout(Duration::from_millis(ENGINE_OPERATION_TIMEOUT_MS)) {
            Ok(result) => result.map_err(DataPlaneError::failed),
            Err(_) => Err(DataPlaneError::failed("the replication service did not answer")),
        }
    }

    fn publish_snapshot(&self, volume_id: u64, snapshot: &SnapshotRecord) {
        if self.catalog.get(snapshot.id).is_some() {
            return;
        }
        self.catalog.insert_snapshot(snapshot, self.metrics.volume(volume_id));
        self.target.notify_subsystems_changed();
    }

    fn clone_unnamed(&self, id: u64, snapshot_id: u64) -> Result<(), DataPlaneError> {
        self.run(EngineOperation::Clone { volume: id, snapshot: snapshot_id })
    }

    fn drop_unnamed(&self, id: u64) {
        if !self.engine.volume_ids().contains(&id) {
            return;
        }
        if self.catalog.get(id).is_some_and(|handle| handle.snapshot.is_none()) {
            tracing::error!(id, "a served volume has no record; its data is kept");
            return;
        }
        match self.drop_snapshot_data(id) {
            Ok(()) => tracing::info!(
                id,
                "dropped data no record names (a snapshot deleted, or \
                                          one whose taking failed)"
            ),
            Err(error) => tracing::warn!(id, %error, "cannot drop data no record names"),
        }
    }

    fn snapshot_exclusive_bytes(&self, snapshot_id: u64) -> Option<u64> {
        Some(self.engine.snapshot_exclusive_bytes(snapshot_id))
    }

    fn stored_ids(&self) -> Option<Vec<u64>> {
        Some(self.engine.volume_ids())
    }

    fn set_host_access(&self, volume: &VolumeRecord) {
        let subnqn = volume.name.subsystem_nqn();
        let new = &volume.host_access;
        // The catalog first, so no new Connect of a host no longer allowed succeeds; then the
        // controllers such hosts hold.
        match self.catalog.set_host_access(volume.id, new.clone()) {
            None => {
                tracing::error!(
                    volume = %volume.name,
                    "host access changed on a volume not served"
                );
                return;
            }
            Some(HostAccess::Restricted(before)) => {
                for host in before.iter().filter(|host| !new.allows(host)) {
                    let closed = self.target.disconnect_host(&subnqn, host);
                    if closed > 0 {
                        tracing::info!(
                            volume = %volume.name,
                            host = %host,
                            controllers = closed,
                            "disconnected a denied host"
                        );
                    }
                }
            }
            Some(HostAccess::Open) if !new.is_open() => {
                // Which hosts are connected is the target's to know and it offers no list, so
                // every controller goes: hosts still allowed reconnect.
                self.target.disconnect_subsystem(&subnqn);
                tracing::info!(
                    volume = %volume.name,
                    "disconnected every host of a volume no longer open"
                );
            }
            Some(HostAccess::Open) => {}
        }
        // Hosts see the subsystem appear in or leave their discovery log.
        self.target.notify_subsystems_changed();
    }

    fn replace_drive(
        &self,
        index: u16,
        path: Option<PathBuf>,
    ) -> Result<DriveStatus, DataPlaneError> {
        let _serialised = self.replacing.lock().unwrap_or_else(PoisonError::into_inner);
        let count = self.shared.drives.count;
        if index >= count {
            return Err(DataPlaneError::DriveNotFound { index, count });
        }
        self.check_replace(index)?;
        let new_path = self.make_replacement(index, path)?;
        let old_path = {
            let mut paths = self.shared.drive_paths.write().unwrap_or_else(PoisonError::into_inner);
            std::mem::replace(&mut paths[usize::from(index)], new_path.clone())
        };
        if let Err(error) = self.run(EngineOperation::Replace { drive: index }) {
            if old_path != new_path {
                self.shared.drive_paths.write().unwrap_or_else(PoisonError::into_inner)
                    [usize::from(index)] = old_path;
            }
            tracing::warn!(drive = index, %error, "drive replacement refused");
            return Err(error);
        }
        if !self.shared.drives.external.is_empty() {
            // A drive missing since a start is replaced: the new one is rebuilt now.
            crate::rebuild::forget_missing(&self.shared.drives, index);
        }
        tracing::info!(
            drive = index,
            path = %new_path.display(),
            "replaced drive {index}: rebuilding it from the other drives"
        );
        Ok(DriveStatus { index, path: new_path, failed: false, rebuild_percent: Some(0) })
    }

    fn capacity(&self) -> Capacity {
        let stats = self.engine.stats();
        let progress = self.engine.rebuild_progress();
        let rebuild_percent = progress.map_or(0, |progress| {
            let total = u64::from(progress.segments_total.max(1));
            u8::try_from(u64::from(progress.segments_done) * 100 / total).unwrap_or(100)
        });
        let rebuild = &self.shared.rebuild;
        let erasure = ErasureReport {
            scheme: stats.erasure,
            reconstructed_reads: stats.reconstructed_reads,
            repaired_reads: stats.repaired_reads,
            unrecoverable_reads: stats.unrecoverable_reads,
            rebuild_mb_per_s: rebuild.rate_mb_per_s(),
            rebuild_busy_mb_per_s: rebuild.busy_rate_mb_per_s(),
            rebuild: rebuild.report(progress, Instant::now()),
            last_rebuild: rebuild.last(),
            rebuild_bytes_written_total: rebuild.bytes_written_total(),
        };
        let paths = self.shared.drive_paths.read().unwrap_or_else(PoisonError::into_inner).clone();
        Capacity {
            total_bytes: stats.capacity_bytes,
            free_bytes: stats.free_bytes,
            chunk_size_bytes: 0,
            provisioned_bytes: self.volumes.provisioned_bytes(),
            mapped_bytes: stats.mapped_bytes,
            physical_used_bytes: stats.physical_used_bytes,
            write_amplification: stats.write_amplification,
            checksum_errors: stats.checksum_errors,
            mapped_physical_bytes: stats.mapped_physical_bytes,
            scrub: ScrubReport {
                phase: self.shared.scrub.phase(),
                rate_mb_per_s: self.shared.scrub.rate_mb_per_s(),
                busy_rate_mb_per_s: self.shared.scrub.busy_rate_mb_per_s(),
                slowed_for_hosts: self.shared.scrub.slowed(),
                passes_completed: stats.scrub_passes,
                blocks_verified: stats.scrub_blocks_verified,
                errors: stats.scrub_errors,
                pass_progress_percent: self.shared.scrub.pass_progress_percent(),
                findings: self.engine.scrub_findings(),
            },
            counters: EngineCounters {
                host_bytes_written: stats.host_bytes_written,
                device_bytes_written: stats.device_bytes_written,
                host_batches: stats.host_batches,
                host_batch_blocks: stats.host_batch_blocks,
                drive_syncs: stats.drive_syncs,
                gc_relocated_blocks: stats.gc_relocated_blocks,
                defrag_relocated_blocks: stats.defrag_relocated_blocks,
                segments_laid_out: stats.segments_laid_out,
                laid_out_bytes: stats.laid_out_bytes,
                gc_segments_cleaned: stats.gc_segments_cleaned,
                gc_segments_cleaned_inline: stats.gc_segments_cleaned_inline,
                checkpoints: stats.checkpoints,
                checkpoint_bytes_written: stats.checkpoint_bytes_written,
            },
            drives: (0u16..)
                .zip(paths)
                .map(|(index, path)| DriveStatus {
                    index,
                    path,
                    failed: stats.failed_drives.contains(&index),
                    rebuild_percent: (stats.rebuilding_drive == Some(index))
                        .then_some(rebuild_percent),
                })
                .collect(),
            erasure,
        }
    }

    fn set_compression(&self, volume: &VolumeRecord) {
        match self.volumes.mapping(VolumeId(volume.id)) {
            Some(map) => map.set_compression(engine_compression(volume.compression)),
            None => {
                tracing::error!(volume = %volume.name, "compression changed on a volume not served")
            }
        }
    }

    fn volume_space(&self, id: u64) -> Option<VolumeSpace> {
        let map = self.volumes.mapping(VolumeId(id))?;
        let stats = self.engine.volume_stats(&map);
        Some(VolumeSpace {
            provisioned_bytes: stats.provisioned_bytes,
            mapped_bytes: stats.mapped_bytes,
            physical_used_bytes: stats.physical_used_bytes,
        })
    }

    fn nvme_addr(&self) -> Option<SocketAddr> {
        self.nvme_addrs.first().copied()
    }

    fn paths_of_node(&self) -> Vec<SocketAddr> {
        self.nvme_addrs.clone()
    }

    fn nbd_addr(&self) -> Option<SocketAddr> {
        self.nbd_addr
    }

    fn paths(&self, volume: &VolumeRecord) -> Vec<VolumePath> {
        let subnqn = volume.name.subsystem_nqn();
        (1u16..)
            .zip(&self.nvme_addrs)
            .map(|(port_id, address)| VolumePath {
                port_id,
                address: *address,
                state: self.target.ana_state(&subnqn, port_id),
            })
            .collect()
    }

    fn set_path_state(
        &self,
        volume: &VolumeRecord,
        port_id: u16,
        state: AnaState,
    ) -> Result<(), DataPlaneError> {
        if port_id == 0 || usize::from(port_id) > self.nvme_addrs.len() {
            return Err(DataPlaneError::invalid(format!(
                "this node has no NVMe/TCP port {port_id}; its ports are 1 to {}",
                self.nvme_addrs.len()
            )));
        }
        if self.catalog.get(volume.id).is_none() {
            return Err(DataPlaneError::failed(format!("volume {} is not served", volume.name)));
        }
        self.target.set_ana_state(&volume.name.subsystem_nqn(), port_id, state);
        tracing::info!(
            volume = %volume.name,
            port = port_id,
            address = %self.nvme_addrs[usize::from(port_id) - 1],
            state = ?state,
            "ANA state changed"
        );
        Ok(())
    }

    fn shutdown(&self) {
        if let Some(link) = &self.shared.replication {
            // A clean stop is a planned move: the volumes this node serves go to another
            // replica now rather than when this node's lease runs out.
            let (done, stepped_down) = std::sync::mpsc::sync_channel(1);
            if link.command_blocking(crate::replicate::ServiceCommand::StepDownAll { done }) {
                let wait = Duration::from_millis(STEP_DOWN_TIMEOUT_MS);
                if stepped_down.recv_timeout(wait).is_err() {
                    tracing::warn!(
                        "the volumes this node serves did not all step down within \
                         {STEP_DOWN_TIMEOUT_MS} ms; the others take over when its lease expires"
                    );
                }
            }
        }
        let _ = self.stop.send(true);
        let threads =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(PoisonError::into_inner));
        for thread in threads {
            if thread.join().is_err() {
                tracing::error!("a data-path thread panicked");
            }
        }
        let failed = self.shared.latches.failed_drives();
        if !failed.is_empty() {
            tracing::error!(drives = ?failed, "drives latched failed during this run");
        }
    }
}

/// Writes the first chunks of a connection's output (up to [`OUTPUT_SLICES_MAX`]) with one
/// non-blocking vectored write; returns how many bytes the socket took.
pub(crate) fn try_write_chunks<'a>(
    stream: &TcpStream,
    chunks: impl Iterator<Item = &'a [u8]>,
) -> std::io::Result<usize> {
    let mut slices = [IoSlice::new(&[]); OUTPUT_SLICES_MAX];
    let mut count = 0;
    for (slice, chunk) in slices.iter_mut().zip(chunks) {
        *slice = IoSlice::new(chunk);
        count += 1;
    }
    stream.try_write_vectored(&slices[..count])
}
