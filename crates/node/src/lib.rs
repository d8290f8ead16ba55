//! A Ferrite node: wires the metadata store, the data path and the REST API together, and owns
//! the node's sockets, threads and signals.
//!
//! [`Node::start`] brings a node up from a [`NodeConfig`]:
//!
//! 1. Create the data dir and open the embedded metadata store in it (its file lock keeps a
//!    second node off the same data dir).
//! 2. First start (no node record yet): pick a node UUID, format the drives through the
//!    [`DataPathBuilder`] seam, then write the node record. A crash before the record is written
//!    makes the next start a first start again. Later starts: check the configuration against
//!    the recorded drive geometry and kind (files in DATA-DIR/drives, or external drives given
//!    with `--drive`, whose geometry comes from the devices: the smallest one's size), and the
//!    requested erasure coding against the one the drives' log superblocks record.
//! 3. Start the control plane's tokio runtime and bind the REST API socket.
//! 4. Start the data path with every volume and snapshot record (it recovers the log engine,
//!    drops engine data no record names, and serves the volumes), then drop the records of
//!    snapshots and clones whose engine operation never became durable.
//! 5. Serve the API until [`Node::stop`], a [`StopHandle`], or (with
//!    [`NodeConfig::stop_on_signals`]) SIGINT or SIGTERM.
//!
//! Stopping drains the API (in-flight requests finish), then shuts the data path down, then
//! closes the metadata store.
//!
//! With [`DriveBackend::Memory`] (NOT DURABLE) the drives are `io::MemoryDrives` in RAM, and the
//! data dir is replaced by a fresh scratch directory in the system's temporary directory that
//! holds the metadata store and the drives' links and is removed when the node stops: the
//! metadata never outlives the data it describes, so every start is a first start.

pub mod activity;
pub mod cluster;
pub mod config;
pub mod control;
pub mod data_plane;
pub mod http;
pub mod metrics;
mod nbd;
pub mod nvme;
pub mod rebuild;
pub mod replicate;
pub mod scrub;

pub use config::{ConfigError, DriveBackend, NodeConfig};
pub use data_plane::{
    Capacity, DataPathBuilder, DataPathContext, DataPlane, DataPlaneError, DriveSet, DriveStatus,
    ErasureReport, RebuildEnd, RebuildReport, VolumeSpace,
};
/// The erasure coding schemes `NodeConfig::erasure_coding` takes.
pub use engine::erasure::ErasureScheme;

use control::VolumeService;
use meta::{EmbeddedStore, MetaError, MetaStore, NodeRecord};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long the REST API may take to finish in-flight requests when the node stops.
pub const API_SHUTDOWN_TIMEOUT_MS: u64 = 10_000;
/// Threads tokio may start for blocking volume-service calls (metadata commits).
pub const CONTROL_BLOCKING_THREADS_MAX: usize = 4;
/// Names tried for a memory-backed node's scratch directory before giving up (each is random,
/// so a second attempt is already a surprise).
const SCRATCH_DIR_ATTEMPTS_MAX: u32 = 8;
/// The line logged (at WARN) when a node starts on memory drives.
pub const MEMORY_BACKEND_WARNING: &str =
    "drive backend: memory — NOT DURABLE, data is lost when the node stops";

/// Why a node could not start or stop cleanly. Messages say what to do.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot create the data dir {}: {source}", path.display())]
    DataDir { path: PathBuf, source: std::io::Error },
    #[error(
        "cannot create a scratch directory {} for the memory-backed node's metadata: {source}; \
         point TMPDIR at a writable directory",
        path.display()
    )]
    ScratchDir { path: PathBuf, source: std::io::Error },
    #[error("cannot read how much RAM is available from /proc/meminfo: {0}")]
    MemoryInfo(std::io::Error),
    #[error("cannot create the memory drives: {0}")]
    MemoryDrives(io::DriveSetupError),
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error(
        "the data dir {} holds a node with {recorded}, but {requested} was asked for; drives \
         cannot change after the first start: drop --drives/--drive-size, or use another \
         --data-dir",
        data_dir.display()
    )]
    DrivesChanged { data_dir: PathBuf, recorded: String, requested: String },
    #[error(
        "the data dir {} holds a node whose drives are formatted with erasure coding {recorded}, \
         but {requested} was asked for; erasure coding cannot change after the first start: \
         drop --erasure-coding, or use another --data-dir",
        data_dir.display()
    )]
    ErasureChanged { data_dir: PathBuf, recorded: ErasureScheme, requested: ErasureScheme },
    #[error("cannot format the drives in {}: {source}", dir.display())]
    FormatDrives { dir: PathBuf, source: DataPlaneError },
    #[error("cannot format the drives given with --drive: {0}")]
    FormatExternalDrives(DataPlaneError),
    #[error(transparent)]
    ExternalDrive(io::DriveSetupError),
    #[error(
        "--drive {} is given twice (as {}): give each drive once",
        canonical.display(),
        given.display()
    )]
    ExternalDriveTwice { canonical: PathBuf, given: PathBuf },
    #[error(
        "--drive cannot be used with --drive-backend memory: memory drives are in RAM; drop \
         --drive, or drop --drive-backend memory to use the given drives"
    )]
    ExternalDrivesWithMemory,
    #[error(
        "--lay-out-drives cannot be used with --drive-backend memory: memory drives are in RAM \
         and need no lay-out; drop one of them"
    )]
    LayOutMemoryDrives,
    #[error(
        "this node's drives are block devices or files given with --drive when it was created \
         (the data dir {} holds no drive files); pass --drive PATH for each of its {count} \
         drives, in any order",
        data_dir.display()
    )]
    ExternalDrivesNeeded { data_dir: PathBuf, count: u16 },
    #[error(
        "this node's drives are files in {}, not block devices: drop --drive, or use another \
         --data-dir for a node on the given drives",
        dir.display()
    )]
    DriveFilesNode { dir: PathBuf },
    #[error("cannot start the data path: {0}")]
    StartDataPath(DataPlaneError),
    #[error("cannot reconcile the metadata with the data path at start: {0}")]
    Reconcile(control::ControlError),
    #[error("cannot start the control plane runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot listen for the REST API on {addr}: {source}; pass another --api-listen, or stop whatever uses it")]
    ApiListen { addr: SocketAddr, source: std::io::Error },
    #[error("cannot watch for SIGINT and SIGTERM: {0}")]
    Signals(std::io::Error),
    #[error("the REST API server failed: {0}")]
    ApiServer(std::io::Error),
    #[error("the REST API did not finish its requests within {API_SHUTDOWN_TIMEOUT_MS} ms")]
    ApiShutdownTimeout,
    #[error("cannot join the cluster: {0}")]
    Cluster(#[from] cluster::ClusterError),
    #[error(
        "--cluster-etcd cannot be used with --drive-backend memory: a cluster member keeps \
         replicas that must survive a restart"
    )]
    ClusterWithMemory,
}

/// Requests a node to stop; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct StopHandle(Arc<watch::Sender<bool>>);

impl StopHandle {
    pub fn stop(&self) {
        self.0.send_replace(true);
    }
}

/// A running node.
pub struct Node {
    runtime: Option<tokio::runtime::Runtime>,
    server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    stop: StopHandle,
    data_plane: Arc<dyn DataPlane>,
    data_plane_running: bool,
    api_addr: SocketAddr,
    nvme_advertised: SocketAddr,
    nvme_serving: bool,
    /// The NBD address clients are told, if NBD is served.
    nbd_advertised: Option<SocketAddr>,
    record: NodeRecord,
    first_start: bool,
    data_dir: PathBuf,
    /// The drives given with `--drive`, as given (empty for drive files).
    external_drives: Vec<PathBuf>,
    /// The cluster reconciler's thread, on a cluster node; joined before the data path stops.
    reconciler: Option<tokio::task::JoinHandle<()>>,
    /// Memory drives and their scratch directory; declared last so they outlive everything
    /// else of the node (dropped after the data path stopped).
    memory: Option<MemoryBacking>,
}

impl Node {
    /// Starts a node with this build's data path, on drive files.
    pub fn start(config: NodeConfig) -> Result<Self, NodeError> {
        Self::start_on(config, DriveBackend::File)
    }

    /// Starts a node with this build's data path, on drives held by `backend`. With
    /// [`DriveBackend::Memory`], `config.data_dir` is not used (see the module comment).
    pub fn start_on(config: NodeConfig, backend: DriveBackend) -> Result<Self, NodeError> {
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let data_path = nvme::NvmeDataPathBuilder::new(config.data_threads_resolved(cpus))
            .with_poll(std::time::Duration::from_micros(config.poll_us))
            .with_read_defrag(config.read_defrag.unwrap_or(true))
            .with_scrub(config.scrub_mb_per_s)
            .with_rebuild(config.rebuild_mb_per_s);
        Self::start_with_backend(config, backend, Box::new(data_path))
    }

    /// Starts a node with the given data path, on drive files.
    pub fn start_with(
        config: NodeConfig,
        data_path: Box<dyn DataPathBuilder>,
    ) -> Result<Self, NodeError> {
        Self::start_with_backend(config, DriveBackend::File, data_path)
    }

    /// Starts a node with the given data path, on drives held by `backend`.
    pub fn start_with_backend(
        mut config: NodeConfig,
        backend: DriveBackend,
        mut data_path: Box<dyn DataPathBuilder>,
    ) -> Result<Self, NodeError> {
        config.validate()?;
        if backend == DriveBackend::Memory && !config.drives.is_empty() {
            return Err(NodeError::ExternalDrivesWithMemory);
        }
        if backend == DriveBackend::Memory && config.lay_out_drives {
            return Err(NodeError::LayOutMemoryDrives);
        }
        // Dropped last on every early return, so a failed start leaves no RAM or files behind.
        let memory = match backend {
            DriveBackend::File => None,
            DriveBackend::Memory => {
                config.check_memory_drives(memory_available_bytes()?)?;
                let scratch = ScratchDir::create()?;
                config.data_dir = scratch.path.clone();
                let drives = io::MemoryDrives::create(
                    &config.drives_dir(),
                    config.drive_count.unwrap_or(config::DEFAULT_DRIVE_COUNT),
                    config.drive_size_bytes.unwrap_or(backend.default_drive_size_bytes()),
                )
                .map_err(NodeError::MemoryDrives)?;
                tracing::warn!(scratch_dir = %scratch.path.display(), "{MEMORY_BACKEND_WARNING}");
                Some(MemoryBacking { drives: Arc::new(drives), scratch })
            }
        };
        std::fs::create_dir_all(&config.data_dir)
            .map_err(|source| NodeError::DataDir { path: config.data_dir.clone(), source })?;
        let meta = Arc::new(EmbeddedStore::open_in(&config.data_dir)?);

        let (record, first_start, erasure) = match meta.node()? {
            Some(record) => {
                check_drives(&config, &record)?;
                let erasure = check_erasure(&config, &record)?;
                (record, false, erasure)
            }
            None => {
                let external_drives = !config.drives.is_empty();
                let (drive_count, drive_size_bytes) = if external_drives {
                    external_geometry(&config.drives)?
                } else {
                    (
                        config.drive_count.unwrap_or(config::DEFAULT_DRIVE_COUNT),
                        config.drive_size_bytes.unwrap_or(backend.default_drive_size_bytes()),
                    )
                };
                let record = NodeRecord {
                    uuid: control::new_uuid(),
                    drive_count,
                    drive_size_bytes,
                    created_unix_ms: control::now_unix_ms(),
                    external_drives,
                };
                let (erasure, note) = config::resolve_erasure(config.erasure_coding, drive_count);
                if let Some(note) = note {
                    if config.erasure_coding.is_some() {
                        tracing::warn!("{note}");
                    } else {
                        tracing::info!("{note}");
                    }
                }
                let drives = drive_set(&config, &record, erasure);
                data_path.format_drives(&drives).map_err(|source| {
                    if external_drives {
                        NodeError::FormatExternalDrives(source)
                    } else {
                        NodeError::FormatDrives { dir: drives.dir.clone(), source }
                    }
                })?;
                meta.put_node(&record)?;
                tracing::info!(
                    node_uuid = %api::format_uuid(&record.uuid),
                    drives = record.drive_count,
                    drive_size = %types::ByteSize(record.drive_size_bytes),
                    drive_backend = backend.as_str(),
                    erasure_coding = %erasure,
                    protection = %erasure.protection(),
                    "first start: created the node"
                );
                (record, true, erasure)
            }
        };

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(CONTROL_BLOCKING_THREADS_MAX)
            .thread_name("ferrite-control")
            .enable_all()
            .build()
            .map_err(NodeError::Runtime)?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(config.api_listen))
            .map_err(|source| NodeError::ApiListen { addr: config.api_listen, source })?;
        let api_addr = listener
            .local_addr()
            .map_err(|source| NodeError::ApiListen { addr: config.api_listen, source })?;
        let (stop_sender, stop_receiver) = watch::channel(false);
        let stop = StopHandle(Arc::new(stop_sender));
        if config.stop_on_signals {
            // Registered before the API serves, so a signal can never find the default action.
            let _entered = runtime.enter();
            let signals = StopSignals::install().map_err(NodeError::Signals)?;
            runtime.spawn(signals.forward_to(stop.clone()));
        }

        let joined = match &config.cluster {
            Some(_) if backend == DriveBackend::Memory => return Err(NodeError::ClusterWithMemory),
            Some(cluster_config) => Some(cluster::Cluster::join(
                cluster_config.clone(),
                &record,
                &config.data_dir,
                config.api_listen,
                &config.nvme_listen,
                &|| *stop_receiver.borrow(),
            )?),
            None => None,
        };
        // A cluster node serves the cluster's volumes it holds a replica of, and keeps its
        // copies of the cluster's snapshots.
        let (volumes, snapshots) = match &joined {
            Some((cluster, _)) => (cluster.local_volumes()?, cluster.volumes.all_snapshots()?),
            None => (meta.volumes()?, meta.all_snapshots()?),
        };
        let (cluster, replication) = match joined {
            Some((cluster, setup)) => (Some(cluster), Some(setup)),
            None => (None, None),
        };
        let served = volumes.clone();
        let metrics = Arc::new(metrics::Registry::new());
        for volume in &volumes {
            metrics.register_volume(volume.id, &volume.name);
        }
        let context = DataPathContext {
            drives: drive_set(&config, &record, erasure),
            nvme_listen: config.nvme_listen.clone(),
            nbd_listen: config.nbd_listen,
            volumes,
            snapshots,
            metrics: Arc::clone(&metrics),
            memory_drives: memory.as_ref().map(|memory| Arc::clone(&memory.drives)),
            replication,
        };
        let data_plane = data_path.start(context).map_err(NodeError::StartDataPath)?;
        let nvme_serving = data_plane.nvme_addr().is_some();
        let first_listen =
            config.nvme_listen.first().copied().unwrap_or(config::DEFAULT_NVME_LISTEN);
        let nvme_advertised = advertised(data_plane.nvme_addr().unwrap_or(first_listen));
        let nbd_advertised = data_plane.nbd_addr().map(advertised);

        let service = match &cluster {
            Some(cluster) => {
                let store =
                    cluster::ClusterMeta { local: meta, cluster: Arc::clone(&cluster.volumes) };
                VolumeService::new(
                    Arc::new(store) as Arc<dyn MetaStore>,
                    Arc::clone(&data_plane),
                    Arc::clone(&metrics),
                )
                .with_cluster(Arc::clone(cluster))
            }
            None => VolumeService::new(
                meta as Arc<dyn MetaStore>,
                Arc::clone(&data_plane),
                Arc::clone(&metrics),
            ),
        };
        let service = Arc::new(service);
        if cluster.is_none() {
            if let Err(error) = service.drop_incomplete() {
                data_plane.shutdown();
                return Err(NodeError::Reconcile(error));
            }
        }
        let view = http::NodeView {
            record: record.clone(),
            nvme_advertised,
            nvme_serving,
            nbd_advertised,
            drive_backend: backend,
        };
        let reconciler = cluster.as_ref().map(|cluster| {
            let nvme: Vec<SocketAddr> =
                data_plane.paths_of_node().into_iter().map(advertised).collect();
            cluster.announce(advertised(api_addr), &nvme, nbd_advertised);
            let cluster = Arc::clone(cluster);
            let data_plane = Arc::clone(&data_plane);
            let metrics = Arc::clone(&metrics);
            let stop = stop_receiver.clone();
            runtime.spawn_blocking(move || cluster.reconcile(data_plane, metrics, served, stop))
        });
        let router = http::router(service, metrics, view);
        let server_stop = stop.clone();
        let server = runtime.spawn(async move {
            let result =
                axum::serve(listener, router).with_graceful_shutdown(stopped(stop_receiver)).await;
            // If serving ends on its own (an accept loop failure), the node stops too.
            server_stop.stop();
            result
        });
        tracing::info!(
            api = %api_addr,
            nvme = %nvme_advertised,
            nvme_serving,
            nbd = ?nbd_advertised,
            "node started"
        );

        Ok(Self {
            runtime: Some(runtime),
            server: Some(server),
            stop,
            data_plane,
            data_plane_running: true,
            api_addr,
            nvme_advertised,
            nvme_serving,
            nbd_advertised,
            record,
            first_start,
            external_drives: config.drives.clone(),
            data_dir: config.data_dir,
            reconciler,
            memory,
        })
    }

    /// The address the REST API listens on (the real port when configured with port 0).
    pub fn api_addr(&self) -> SocketAddr {
        self.api_addr
    }

    /// The REST API's base URL, for `--api` and `api::Client::new`.
    pub fn api_url(&self) -> String {
        format!("http://{}", advertised(self.api_addr))
    }

    /// The NVMe/TCP address hosts are told to connect to.
    pub fn nvme_addr(&self) -> SocketAddr {
        self.nvme_advertised
    }

    /// Whether the data path serves volumes over NVMe/TCP.
    pub fn nvme_serving(&self) -> bool {
        self.nvme_serving
    }

    /// The NBD address clients are told to connect to (the real port when configured with port
    /// 0), or `None` if NBD is off or the data path serves none.
    pub fn nbd_addr(&self) -> Option<SocketAddr> {
        self.nbd_advertised
    }

    pub fn record(&self) -> &NodeRecord {
        &self.record
    }

    /// The erasure coding the node's drives are formatted with.
    pub fn erasure(&self) -> ErasureScheme {
        self.data_plane.capacity().erasure.scheme
    }

    /// Whether this start created the node (and its drives).
    pub fn first_start(&self) -> bool {
        self.first_start
    }

    /// Where the metadata and the drives are: the configured data dir, or with memory drives
    /// the scratch directory that replaces it.
    pub fn data_dir(&self) -> &Path {
        match &self.memory {
            Some(memory) => &memory.scratch.path,
            None => &self.data_dir,
        }
    }

    /// What holds the drives' bytes; [`DriveBackend::Memory`] is NOT DURABLE.
    pub fn drive_backend(&self) -> DriveBackend {
        match self.memory {
            Some(_) => DriveBackend::Memory,
            None => DriveBackend::File,
        }
    }

    /// The embedded metadata store's file.
    pub fn meta_path(&self) -> PathBuf {
        self.data_dir().join(meta::META_FILE_NAME)
    }

    /// The block devices or files given with `--drive` (empty when the drives are files in
    /// [`Node::drives_dir`]).
    pub fn external_drives(&self) -> &[PathBuf] {
        &self.external_drives
    }

    /// Where the drive files live (with memory drives: their links).
    pub fn drives_dir(&self) -> PathBuf {
        match &self.memory {
            Some(memory) => memory.drives.dir().to_owned(),
            None => self.data_dir.join(config::DRIVES_DIR_NAME),
        }
    }

    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Blocks until the node is asked to stop: by a signal (if configured), a [`StopHandle`],
    /// or the API server failing. Call [`Node::stop`] next.
    pub fn wait_for_stop(&self) {
        let Some(runtime) = &self.runtime else { return };
        let mut receiver = self.stop.0.subscribe();
        runtime.block_on(async move {
            // Only fails if the sender is gone, and `self` holds it.
            let _ = receiver.wait_for(|stopping| *stopping).await;
        });
    }

    /// Stops the node: drains the API, shuts the data path down, closes the metadata store.
    pub fn stop(mut self) -> Result<(), NodeError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), NodeError> {
        self.stop.stop();
        let mut result = Ok(());
        if let (Some(runtime), Some(server)) = (&self.runtime, self.server.take()) {
            let timeout = Duration::from_millis(API_SHUTDOWN_TIMEOUT_MS);
            result = match runtime.block_on(async { tokio::time::timeout(timeout, server).await }) {
                Ok(Ok(Ok(()))) => Ok(()),
                Ok(Ok(Err(error))) => Err(NodeError::ApiServer(error)),
                Ok(Err(join_error)) => Err(NodeError::ApiServer(std::io::Error::other(join_error))),
                Err(_elapsed) => Err(NodeError::ApiShutdownTimeout),
            };
        }
        if let (Some(runtime), Some(reconciler)) = (&self.runtime, self.reconciler.take()) {
            // It sees the stop within one round.
            let _ = runtime.block_on(reconciler);
        }
        if self.data_plane_running {
            self.data_plane_running = false;
            self.data_plane.shutdown();
        }
        if let Some(runtime) = self.runtime.take() {
            // Blocking calls still running hold the metadata store; give them a moment.
            runtime.shutdown_timeout(Duration::from_millis(API_SHUTDOWN_TIMEOUT_MS));
        }
        if result.is_ok() {
            tracing::info!("node stopped");
        }
        result
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.runtime.is_some() {
            if let Err(error) = self.shutdown() {
                tracing::error!(%error, "the node did not stop cleanly");
            }
        }
    }
}

/// What a memory-backed node holds for its life.
struct MemoryBacking {
    /// Declared first: the links go before the folder that holds them. Shared with the data
    /// path, which replaces drives in it; the data path is shut down before this is dropped.
    drives: Arc<io::MemoryDrives>,
    scratch: ScratchDir,
}

/// A memory-backed node's private directory (mode 0700) in the system's temporary directory,
/// removed with everything in it on drop. A node killed with SIGKILL leaves it behind: it holds
/// only the metadata store and the drives' links (the drives' RAM goes with the process).
struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    fn create() -> Result<Self, NodeError> {
        use std::os::unix::fs::DirBuilderExt;
        let parent = std::env::temp_dir();
        let mut last_error = None;
        for _ in 0..SCRATCH_DIR_ATTEMPTS_MAX {
            let suffix: u32 = rand::random();
            let path = parent.join(format!("ferrite-memory-{}-{suffix:08x}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(Self { path }),
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                    last_error = Some((path, error));
                }
                Err(source) => return Err(NodeError::ScratchDir { path, source }),
            }
        }
        let (path, source) = last_error
            .unwrap_or_else(|| (parent, std::io::Error::from(std::io::ErrorKind::AlreadyExists)));
        Err(NodeError::ScratchDir { path, source })
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!(
                path = %self.path.display(),
                %error,
                "cannot remove the memory-backed node's scratch directory; remove it by hand"
            );
        }
    }
}

/// RAM the kernel expects to be available for new work without swapping (MemAvailable).
fn memory_available_bytes() -> Result<u64, NodeError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(NodeError::MemoryInfo)?;
    parse_mem_available(&text).ok_or_else(|| {
        NodeError::MemoryInfo(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "no readable \"MemAvailable: N kB\" line",
        ))
    })
}

/// The MemAvailable line of /proc/meminfo, in bytes.
fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let rest = meminfo.lines().find_map(|line| line.strip_prefix("MemAvailable:"))?;
    let mut words = rest.split_whitespace();
    let kibibytes: u64 = words.next()?.parse().ok()?;
    if words.next() != Some("kB") {
        return None;
    }
    kibibytes.checked_mul(1024)
}

fn drive_set(config: &NodeConfig, record: &NodeRecord, erasure: ErasureScheme) -> DriveSet {
    DriveSet {
        dir: config.drives_dir(),
        external: config.drives.clone(),
        node_uuid: record.uuid,
        count: record.drive_count,
        size_bytes: record.drive_size_bytes,
        erasure,
        lay_out: config.lay_out_drives,
    }
}

/// The erasure coding the node's drives record in their log superblocks (the first drive that
/// holds a readable one says), or `None` if none does (the data path then reports the drives).
fn recorded_erasure(config: &NodeConfig, record: &NodeRecord) -> Option<ErasureScheme> {
    let paths: Vec<PathBuf> = if record.external_drives {
        config.drives.clone()
    } else {
        let dir = config.drives_dir();
        (0..record.drive_count).map(|index| io::drive_path(&dir, index)).collect()
    };
    paths.iter().find_map(|path| match io::read_log_superblock(path) {
        Ok(io::LogSuperblockFound::Valid(superblock)) => Some(superblock.geometry.scheme()),
        _ => None,
    })
}

/// On a later start: the erasure coding the node has, refusing a request for another one
/// (resolved for the drive count as a first start would).
fn check_erasure(config: &NodeConfig, record: &NodeRecord) -> Result<ErasureScheme, NodeError> {
    let recorded = recorded_erasure(config, record);
    let requested = config
        .erasure_coding
        .map(|requested| config::resolve_erasure(Some(requested), record.drive_count).0);
    match (recorded, requested) {
        (Some(recorded), Some(requested)) if recorded != requested => {
            Err(NodeError::ErasureChanged {
                data_dir: config.data_dir.clone(),
                recorded,
                requested,
            })
        }
        (Some(recorded), _) => Ok(recorded),
        (None, requested) => {
            Ok(requested.unwrap_or_else(|| config::resolve_erasure(None, record.drive_count).0))
        }
    }
}

/// The geometry of a new node on external drives: as many drives as given, each used up to
/// the smallest one's size (whole MiB, at most `DRIVE_SIZE_BYTES_MAX`). Refuses a drive given
/// twice (under any name), one that is not a block device or file, mounted or in use, and a
/// smallest drive below `DRIVE_SIZE_BYTES_MIN`.
fn external_geometry(paths: &[PathBuf]) -> Result<(u16, u64), NodeError> {
    let mut seen: Vec<PathBuf> = Vec::with_capacity(paths.len());
    let mut smallest: Option<io::ExternalDrive> = None;
    for path in paths {
        let drive = io::probe_external_drive(path).map_err(NodeError::ExternalDrive)?;
        let canonical = std::fs::canonicalize(path).map_err(|source| {
            NodeError::ExternalDrive(io::DriveSetupError::Io {
                action: "resolve",
                path: path.clone(),
                source,
            })
        })?;
        if seen.contains(&canonical) {
            return Err(NodeError::ExternalDriveTwice { canonical, given: path.clone() });
        }
        seen.push(canonical);
        if smallest.as_ref().is_none_or(|small| drive.size_bytes < small.size_bytes) {
            smallest = Some(drive);
        }
    }
    let count = u16::try_from(paths.len()).map_err(|_| ConfigError::DrivePathCount(paths.len()))?;
    let Some(smallest) = smallest else {
        unreachable!("external drives are only looked at when some are given")
    };
    let usable_bytes = smallest.size_bytes.min(config::DRIVE_SIZE_BYTES_MAX);
    let size_bytes = usable_bytes - usable_bytes % config::DRIVE_SIZE_ALIGNMENT_BYTES;
    if size_bytes < config::DRIVE_SIZE_BYTES_MIN {
        return Err(NodeError::ExternalDrive(io::DriveSetupError::TooSmall {
            path: smallest.path,
            size_bytes: smallest.size_bytes,
            min_bytes: config::DRIVE_SIZE_BYTES_MIN,
        }));
    }
    Ok((count, size_bytes))
}

fn check_drives(config: &NodeConfig, record: &NodeRecord) -> Result<(), NodeError> {
    if record.external_drives && config.drives.is_empty() {
        return Err(NodeError::ExternalDrivesNeeded {
            data_dir: config.data_dir.clone(),
            count: record.drive_count,
        });
    }
    if !record.external_drives && !config.drives.is_empty() {
        return Err(NodeError::DriveFilesNode { dir: config.drives_dir() });
    }
    let count = config.drive_count.unwrap_or(record.drive_count);
    let size_bytes = config.drive_size_bytes.unwrap_or(record.drive_size_bytes);
    if count == record.drive_count && size_bytes == record.drive_size_bytes {
        return Ok(());
    }
    let describe =
        |count: u16, size_bytes: u64| format!("{count} drives of {}", types::ByteSize(size_bytes));
    Err(NodeError::DrivesChanged {
        data_dir: config.data_dir.clone(),
        recorded: describe(record.drive_count, record.drive_size_bytes),
        requested: describe(count, size_bytes),
    })
}

/// The address to tell clients: a wildcard listen address is advertised as loopback, the one
/// address certain to reach a single-node cluster from its own host.
pub(crate) fn advertised(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        let loopback = match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        };
        SocketAddr::new(loopback, addr.port())
    } else {
        addr
    }
}

async fn stopped(mut receiver: watch::Receiver<bool>) {
    // Only fails if every sender is gone, which also means stop.
    let _ = receiver.wait_for(|stopping| *stopping).await;
}

/// SIGINT and SIGTERM, registered with tokio.
struct StopSignals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Must run inside the runtime. Replaces the default action (exit) of both signals.
    fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    async fn forward_to(mut self, stop: StopHandle) {
        let name = tokio::select! {
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.terminate.recv() => "SIGTERM",
        };
        tracing::info!(signal = name, "stopping");
        stop.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_addresses_are_advertised_as_loopback() {
        let check = |listen: &str, expect: &str| {
            assert_eq!(advertised(listen.parse().unwrap()).to_string(), expect);
        };
        check("0.0.0.0:4420", "127.0.0.1:4420");
        check("[::]:4420", "[::1]:4420");
        check("10.0.0.5:4420", "10.0.0.5:4420");
    }

    #[test]
    fn reads_mem_available() {
        let check = |text: &str, expect: Option<u64>| assert_eq!(parse_mem_available(text), expect);
        check("MemTotal:       24684096 kB\nMemAvailable:   24202052 kB\n", Some(24202052 * 1024));
        check("MemTotal:       24684096 kB\n", None);
        check("MemAvailable: lots kB\n", None);
        check("MemAvailable: 12 MB\n", None);
        check("MemAvailable: 18446744073709551615 kB\n", None);
    }

    #[test]
    fn scratch_dirs_are_private_and_removed() {
        use std::os::unix::fs::PermissionsExt;
        let scratch = ScratchDir::create().unwrap();
        let other = ScratchDir::create().unwrap();
        assert_ne!(scratch.path, other.path);
        let mode = std::fs::metadata(&scratch.path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(scratch.path.join("meta.redb"), b"x").unwrap();
        let path = scratch.path.clone();
        drop(scratch);
        assert!(!path.exists());
    }
}
