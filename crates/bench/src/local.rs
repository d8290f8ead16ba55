//! The bench's in-process target: `ferrite bench --target engine:DIR` drives the log-structured
//! engine in its own process, with no network in between, so the engine's speed can be set
//! beside fio's on the same kind of raw files (issue 4's comparison; `ferrite bench` against a
//! node measures the whole path).
//!
//! [`StoreConnector`] implements [`Connector`] over any [`engine::VolumeStore`]: each queue runs
//! every request as a local task on the current thread and collects the completions, at most
//! the queue depth of them (the bench keeps at most the depth in flight); worker threads take
//! requests and return completions over channels bounded the same way.
//!
//! [`EngineBench`] sets up what a node would: drive files in a fresh directory (laid out with
//! zeros unless asked to stay sparse), the log formatted on them, one handle with its own
//! io_uring ring per thread (this one and worker threads, as a node's data-path threads), the
//! node's background work on this thread (paced GC and periodic checkpoints), and one thin
//! volume; dropping it removes the directory.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::erasure::ErasureScheme;
use engine::log::{LogConfig, LogEngine, LogHandle};
use engine::{DriveLatches, NodeUuid, StoreError, VolumeId, VolumeMap, VolumeStore};
use io::{DriveFile, Ring};
use tokio::sync::{mpsc, Notify};

use crate::run::{QUEUE_COUNT_MAX, QUEUE_DEPTH_MAX};
use crate::target::{BlockQueue, Connector, IoCompletion, IoKind, IoRequest, IoStatus};

/// The background tick of the engine's upkeep, as on a node's thread 0.
const BACKGROUND_TICK: Duration = Duration::from_millis(50);
/// A checkpoint after this long with writes since the last one, as on a node.
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(30);
/// Requests queued for one worker thread: every queue's whole depth, the most the bench keeps in
/// flight.
const WORKER_JOBS_MAX: usize = QUEUE_COUNT_MAX as usize * QUEUE_DEPTH_MAX as usize;
/// The volume's ID inside the bench's private log.
const VOLUME_ID: VolumeId = VolumeId(1);

/// NVMe status codes (SCT 0, generic) for a failed store request, so the bench's error report
/// reads as it does over NVMe/TCP.
const STATUS_INTERNAL_ERROR: u16 = 0x06;
const STATUS_LBA_OUT_OF_RANGE: u16 = 0x80;
const STATUS_CAPACITY_EXCEEDED: u16 = 0x81;
/// SCT 2 (media errors): unrecovered read error.
const STATUS_UNRECOVERED_READ_ERROR: u16 = 0x281;

/// Why the in-process engine could not be set up or kept running.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("cannot create the bench's drive directory in {}: {source}", dir.display())]
    Directory {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set up the drive files: {0}")]
    Drives(#[from] io::DriveSetupError),
    #[error("cannot set up io_uring: {0}")]
    Ring(#[from] io::RingError),
    #[error("the log-structured engine failed: {0}")]
    Log(#[from] engine::log::LogError),
    #[error("cannot start a thread of the bench: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("a thread of the bench ended while it started")]
    WorkerDied,
    #[error("the volume of {size_bytes} bytes does not fit: the drives hold {capacity_bytes} bytes of host data")]
    TooLarge { size_bytes: u64, capacity_bytes: u64 },
}

/// The geometry of the bench's private node.
#[derive(Debug, Clone)]
pub struct EngineSetup {
    /// A fresh directory is made inside this one and removed at the end.
    pub parent_dir: PathBuf,
    pub drive_count: u16,
    pub drive_size_bytes: u64,
    pub erasure: ErasureScheme,
    /// The thin volume the workloads run on.
    pub volume_size_bytes: u64,
    /// Threads with their own engine handle and ring, as a node's data-path threads; queue `i`
    /// runs on thread `i % threads`.
    pub threads: u16,
    /// Write zeros over the drive files before formatting (see [`io::lay_out_drive_file`]),
    /// as fio lays out its file; otherwise they stay sparse.
    pub lay_out: bool,
    /// Read-triggered defragmentation, as a node has it by default
    /// (`LogEngine::set_read_defrag`); every thread runs its handle's defragmenter.
    pub read_defrag: bool,
}

/// The engine with one volume: handles on this thread (with the upkeep task) and on
/// `threads - 1` worker threads. Use it from inside a `LocalSet` on a current_thread runtime.
pub struct EngineBench {
    handle: Rc<LogHandle<DriveFile>>,
    volume: Arc<VolumeMap>,
    ring_driver: tokio::task::JoinHandle<()>,
    upkeep: tokio::task::JoinHandle<()>,
    workers: Vec<Worker>,
    /// Removed when the bench is dropped, with the drive files in it.
    dir: tempfile::TempDir,
}

/// A thread serving requests on its own handle of the engine.
struct Worker {
    /// Dropping it ends the thread's loop.
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A request for a worker thread, with where its completion goes.
struct Job {
    request: IoRequest,
    reply: mpsc::Sender<IoCompletion>,
}

/// Starts a current_thread runtime with its own ring on this thread, as a node's data-path
/// thread does; returns the ring and the task that drives it.
fn start_ring() -> Result<(Rc<Ring>, tokio::task::JoinHandle<()>), LocalError> {
    let ring = Ring::new()?;
    let driver = tokio::task::spawn_local({
        let ring = Rc::clone(&ring);
        async move {
            let Err(error) = ring.run().await;
            // Requests waiting on the ring would never complete: stop rather than hang.
            eprintln!("io_uring failed: {error}; stopping");
            std::process::abort();
        }
    });
    Ok((ring, driver))
}

fn open_files(paths: &[PathBuf], ring: &Rc<Ring>) -> Result<Vec<DriveFile>, LocalError> {
    Ok(paths.iter().map(|path| DriveFile::open(path, ring)).collect::<Result<_, _>>()?)
}

impl EngineBench {
    /// Makes `setup.drive_count` drive files in a fresh directory under `setup.parent_dir`
    /// (laid out if asked), formats and opens the log on them, starts the worker threads and
    /// the upkeep task. Laying out writes every byte of the drives once, so it takes a while:
    /// about a second per GiB here.
    pub async fn start(setup: &EngineSetup) -> Result<EngineBench, LocalError> {
        assert!(setup.threads >= 1, "at least the calling thread serves");
        let dir = tempfile::Builder::new()
            .prefix("ferrite-bench-engine-")
            .tempdir_in(&setup.parent_dir)
            .map_err(|source| LocalError::Directory { dir: setup.parent_dir.clone(), source })?;
        if setup.lay_out {
            let needed = u64::from(setup.drive_count).saturating_mul(setup.drive_size_bytes);
            io::check_lay_out_space(dir.path(), needed)?;
        }
        let node_uuid = NodeUuid(rand::random());
        let infos =
            io::format_drives(dir.path(), node_uuid, setup.drive_count, setup.drive_size_bytes)?;
        let paths: Vec<PathBuf> = infos.into_iter().map(|info| info.path).collect();
        if setup.lay_out {
            for path in &paths {
                io::lay_out_drive_file(path, engine::format::HEADER_REGION_BYTES)?;
            }
        }
        let (ring, ring_driver) = start_ring()?;
        let config = LogConfig {
            erasure: setup.erasure,
            area_zeroed: setup.lay_out,
            // One handle per thread and, as on a node, one for thread 0's background GC.
            ..LogConfig::for_drives(node_uuid, setup.drive_size_bytes, setup.threads + 1)
        };
        let opened = async {
            LogEngine::format(&open_files(&paths, &ring)?, &config).await?;
            let latches = Arc::new(DriveLatches::new(setup.drive_count));
            Ok::<_, LocalError>(LogEngine::open(open_files(&paths, &ring)?, config, latches).await?)
        };
        let (engine, handle, _report) = match opened.await {
            Ok(opened) => opened,
            Err(error) => {
                ring_driver.abort();
                return Err(error);
            }
        };
        engine.set_read_defrag(setup.read_defrag);
        let capacity_bytes = engine.stats().capacity_bytes;
        if setup.volume_size_bytes > capacity_bytes {
            ring_driver.abort();
            return Err(LocalError::TooLarge {
                size_bytes: setup.volume_size_bytes,
                capacity_bytes,
            });
        }
        let volume = VolumeMap::standalone(VOLUME_ID, setup.volume_size_bytes);
        let mut workers = Vec::with_capacity(usize::from(setup.threads - 1));
        for index in 1..setup.threads {
            match Worker::start(index, &engine, &paths, &volume) {
                Ok(worker) => workers.push(worker),
                Err(error) => {
                    ring_driver.abort();
                    return Err(error);
                }
            }
        }
        let gc_handle = match open_files(&paths, &ring) {
            Ok(files) => Rc::new(engine.handle(files)),
            Err(error) => {
                ring_driver.abort();
                return Err(error);
            }
        };
        let handle = Rc::new(handle);
        let upkeep = tokio::task::spawn_local(upkeep(Rc::clone(&handle), gc_handle));
        Ok(EngineBench { handle, volume, ring_driver, upkeep, workers, dir })
    }

    /// A connector whose queues run on this engine's volume, spread over its threads.
    pub fn connector(&self) -> EngineConnector {
        EngineConnector {
            local: StoreConnector::new(Rc::clone(&self.handle), Arc::clone(&self.volume)),
            workers: self.workers.iter().filter_map(|worker| worker.jobs.clone()).collect(),
        }
    }
    /// The engine's counters (write amplification, segments, syncs).
    pub fn engine(&self) -> &Arc<LogEngine> {
        self.handle.engine()
    }

    /// One line of the engine's counters since it was formatted: what the host wrote, what the
    /// drives took (write amplification), the group commits and the syncs.
    pub fn summary(&self) -> String {
        let stats = self.engine().stats();
        let per_batch = |count: u64| count as f64 / stats.host_batches.max(1) as f64;
        format!(
            "engine: host wrote {}, drives took {} (write amplification {:.2}); {} batches of \
             {:.1} blocks, {:.2} drive syncs per batch; {} GC segments cleaned; {} checkpoints; \
             {} blocks rewritten back to back after scattered reads",
            crate::output::format_bytes(stats.host_bytes_written),
            crate::output::format_bytes(stats.device_bytes_written),
            stats.write_amplification,
            crate::output::group_digits(&stats.host_batches.to_string()),
            per_batch(stats.host_batch_blocks),
            per_batch(stats.drive_syncs),
            crate::output::group_digits(&stats.gc_segments_cleaned.to_string()),
            stats.checkpoints,
            crate::output::group_digits(&stats.defrag_relocated_blocks.to_string()),
        )
    }

    /// Where the drive files are (removed on drop).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for EngineBench {
    fn drop(&mut self) {
        self.upkeep.abort();
        for worker in &mut self.workers {
            worker.jobs = None;
            if let Some(thread) = worker.thread.take() {
                // Its requests are done: the bench drops its queues before the engine.
                let _ = thread.join();
            }
        }
        self.ring_driver.abort();
    }
}

impl Worker {
    /// Starts worker thread `index` with its own runtime, ring and handle; returns once the
    /// handle is open.
    fn start(
        index: u16,
        engine: &Arc<LogEngine>,
        paths: &[PathBuf],
        volume: &Arc<VolumeMap>,
    ) -> Result<Worker, LocalError> {
        let (jobs, mut inbox) = mpsc::channel::<Job>(WORKER_JOBS_MAX);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), LocalError>>();
        let engine = Arc::clone(engine);
        let paths = paths.to_vec();
        let volume = Arc::clone(volume);
        let thread = std::thread::Builder::new()
            .name(format!("bench-engine-{index}"))
            .spawn(move || {
                let runtime =
                    match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                        Ok(runtime) => runtime,
                        Err(error) => {
                            let _ = ready_tx.send(Err(LocalError::Runtime(error)));
                            return;
                        }
                    };
                let local = tokio::task::LocalSet::new();
                local.block_on(&runtime, async move {
                    let (ring, driver) = match start_ring() {
                        Ok(started) => started,
                        Err(error) => {
                            let _ = ready_tx.send(Err(error));
                            return;
                        }
                    };
                    let handle = match open_files(&paths, &ring) {
                        Ok(files) => Rc::new(engine.handle(files)),
                        Err(error) => {
                            let _ = ready_tx.send(Err(error));
                            driver.abort();
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    let defragmenter = tokio::task::spawn_local({
                        let handle = Rc::clone(&handle);
                        async move { handle.defragmenter().await }
                    });
                    let mut running = Vec::new();
                    while let Some(Job { request, reply }) = inbox.recv().await {
                        let handle = Rc::clone(&handle);
                        let volume = Arc::clone(&volume);
                        running.retain(|task: &tokio::task::JoinHandle<()>| !task.is_finished());
                        running.push(tokio::task::spawn_local(async move {
                            let completion = serve(&*handle, &volume, request).await;
                            // The queue may be gone (a failed run): nothing waits then.
                            let _ = reply.send(completion).await;
                        }));
                    }
                    for task in running {
                        let _ = task.await;
                    }
                    defragmenter.abort();
                    driver.abort();
                });
            })
            .map_err(LocalError::Runtime)?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Worker { jobs: Some(jobs), thread: Some(thread) }),
            Ok(Err(error)) => {
                let _ = thread.join();
                Err(error)
            }
            Err(_) => {
                let _ = thread.join();
                Err(LocalError::WorkerDied)
            }
        }
    }
}

/// Runs one request on a store and makes its completion.
async fn serve<S: VolumeStore>(store: &S, volume: &VolumeMap, request: IoRequest) -> IoCompletion {
    let IoRequest { tag, kind, offset_bytes, buffer } = request;
    let (result, buffer) = match kind {
        IoKind::Read => store.read(volume, offset_bytes, buffer).await,
        IoKind::Write => store.write(volume, offset_bytes, buffer).await,
    };
    let status = match result {
        Ok(()) => IoStatus::Success,
        Err(error) => IoStatus::Failed { status_code: status_of(&error) },
    };
    IoCompletion { tag, buffer, status }
}

/// What a node's thread 0 does for the engine between host I/O: paced GC steps on a handle
/// of their own (`gc_handle`) and, beside them (as on a node, a checkpoint never holds GC
/// up), a periodic checkpoint and the lay-out of the next free segments; and, as on every
/// data-path thread, the handle's defragmenter. Errors end the
/// upkeep; the host I/O that follows reports them.
async fn upkeep(handle: Rc<LogHandle<DriveFile>>, gc_handle: Rc<LogHandle<DriveFile>>) {
    let collect = async {
        let mut tick = tokio::time::interval(BACKGROUND_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(error) = gc_handle.gc_tick().await {
                eprintln!("garbage collection failed: {error}");
                return;
            }
        }
    };
    let checkpoints = async {
        let mut tick = tokio::time::interval(BACKGROUND_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_checkpoint = Instant::now();
        let mut written_at_checkpoint = 0;
        loop {
            tick.tick().await;
            let written = handle.engine().stats().host_bytes_written;
            if written != written_at_checkpoint && last_checkpoint.elapsed() >= CHECKPOINT_INTERVAL
            {
                if let Err(error) = handle.checkpoint().await {
                    eprintln!("checkpoint failed: {error}");
                    return;
                }
                last_checkpoint = Instant::now();
                written_at_checkpoint = written;
            }
        }
    };
    // The lay-out of the next free segments (sparse drive files only; laid-out ones have no
    // holes left). A failure stops only this loop: writes then allocate as they go.
    let lay_out = async {
        let mut tick = tokio::time::interval(BACKGROUND_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for _ in 0..engine::log::LAY_OUT_AHEAD_SEGMENTS {
                match handle.lay_out_step().await {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(error) => {
                        eprintln!("laying out free segments failed: {error}");
                        return std::future::pending().await;
                    }
                }
            }
        }
    };
    // Each loop returns only on an error, which ends the others too.
    tokio::select! {
        () = collect => {}
        () = checkpoints => {}
        () = lay_out => {}
        () = handle.defragmenter() => {}
    }
}

/// Opens queues on one volume of an in-process store.
pub struct StoreConnector<S> {
    store: Rc<S>,
    volume: Arc<VolumeMap>,
}

impl<S> StoreConnector<S> {
    pub fn new(store: Rc<S>, volume: Arc<VolumeMap>) -> Self {
        StoreConnector { store, volume }
    }
}

/// A request's task ended without an answer (a panic in the store); a failed request is a
/// failed completion, not this.
#[derive(Debug, thiserror::Error)]
#[error("a request on the in-process queue ended without an answer")]
pub struct QueueStopped;

impl<S: VolumeStore + 'static> Connector for StoreConnector<S> {
    type Queue = StoreQueue<S>;
    type Error = QueueStopped;

    async fn connect(
        &mut self,
        queue_count: u16,
        queue_depth: u16,
    ) -> Result<Vec<StoreQueue<S>>, QueueStopped> {
        Ok((0..queue_count)
            .map(|_| StoreQueue {
                store: Rc::clone(&self.store),
                volume: Arc::clone(&self.volume),
                done: Rc::new(Done {
                    completions: RefCell::new(VecDeque::with_capacity(usize::from(queue_depth))),
                    notify: Notify::new(),
                    broken: Cell::new(false),
                }),
            })
            .collect())
    }
}

/// Completions waiting for the bench to take them; at most the queue depth.
struct Done {
    completions: RefCell<VecDeque<IoCompletion>>,
    notify: Notify,
    /// A request's task ended without completing it.
    broken: Cell<bool>,
}

/// One queue: each request is a local task calling the store.
pub struct StoreQueue<S> {
    store: Rc<S>,
    volume: Arc<VolumeMap>,
    done: Rc<Done>,
}

/// Marks the queue broken if a request's task ends without completing it (a panic in the store).
struct Unfinished(Option<Rc<Done>>);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(done) = self.0.take() {
            done.broken.set(true);
            done.notify.notify_one();
        }
    }
}

impl<S: VolumeStore + 'static> BlockQueue for StoreQueue<S> {
    type Error = QueueStopped;

    fn size_bytes(&self) -> u64 {
        self.volume.size_bytes()
    }

    fn submit(&mut self, request: IoRequest) -> Result<(), QueueStopped> {
        let store = Rc::clone(&self.store);
        let volume = Arc::clone(&self.volume);
        let done = Rc::clone(&self.done);
        tokio::task::spawn_local(async move {
            let mut unfinished = Unfinished(Some(done));
            let completion = serve(&*store, &volume, request).await;
            if let Some(done) = unfinished.0.take() {
                done.completions.borrow_mut().push_back(completion);
                done.notify.notify_one();
            }
        });
        Ok(())
    }

    async fn next_completion(&mut self) -> Result<IoCompletion, QueueStopped> {
        loop {
            if let Some(completion) = self.done.completions.borrow_mut().pop_front() {
                return Ok(completion);
            }
            if self.done.broken.get() {
                return Err(QueueStopped);
            }
            self.done.notify.notified().await;
        }
    }
}

/// The NVMe status a target would answer for a failed store request.
fn status_of(error: &StoreError) -> u16 {
    match error {
        StoreError::OutOfRange { .. } => STATUS_LBA_OUT_OF_RANGE,
        StoreError::CapacityExceeded { .. } => STATUS_CAPACITY_EXCEEDED,
        StoreError::ChecksumMismatch { .. } | StoreError::Unrecovered { .. } => {
            STATUS_UNRECOVERED_READ_ERROR
        }
        _ => STATUS_INTERNAL_ERROR,
    }
}

/// The queues of an [`EngineBench`]: queue `i` runs on thread `i % threads` (thread 0 is the
/// bench's own).
pub struct EngineConnector {
    local: StoreConnector<LogHandle<DriveFile>>,
    workers: Vec<mpsc::Sender<Job>>,
}

/// A queue of an [`EngineBench`], on the bench's thread or on a worker thread.
pub enum EngineQueue {
    Local(StoreQueue<LogHandle<DriveFile>>),
    Remote(RemoteQueue),
}

/// A queue whose requests run on a worker thread; completions come back over a channel of the
/// queue's depth.
pub struct RemoteQueue {
    size_bytes: u64,
    jobs: mpsc::Sender<Job>,
    reply: mpsc::Sender<IoCompletion>,
    completions: mpsc::Receiver<IoCompletion>,
}

impl Connector for EngineConnector {
    type Queue = EngineQueue;
    type Error = QueueStopped;

    async fn connect(
        &mut self,
        queue_count: u16,
        queue_depth: u16,
    ) -> Result<Vec<EngineQueue>, QueueStopped> {
        let threads = self.workers.len() + 1;
        let mut local = self.local.connect(queue_count, queue_depth).await?.into_iter();
        let size_bytes = self.local.volume.size_bytes();
        let mut queues = Vec::with_capacity(usize::from(queue_count));
        for index in 0..usize::from(queue_count) {
            let queue = match index % threads {
                0 => EngineQueue::Local(local.next().ok_or(QueueStopped)?),
                thread => {
                    let (reply, completions) = mpsc::channel(usize::from(queue_depth));
                    EngineQueue::Remote(RemoteQueue {
                        size_bytes,
                        jobs: self.workers[thread - 1].clone(),
                        reply,
                        completions,
                    })
                }
            };
            queues.push(queue);
        }
        Ok(queues)
    }
}

impl BlockQueue for EngineQueue {
    type Error = QueueStopped;

    fn size_bytes(&self) -> u64 {
        match self {
            EngineQueue::Local(queue) => queue.size_bytes(),
            EngineQueue::Remote(queue) => queue.size_bytes,
        }
    }

    fn submit(&mut self, request: IoRequest) -> Result<(), QueueStopped> {
        match self {
            EngineQueue::Local(queue) => queue.submit(request),
            EngineQueue::Remote(queue) => queue
                .jobs
                // Never full: at most the queues' depths are in flight (the bench's contract).
                .try_send(Job { request, reply: queue.reply.clone() })
                .map_err(|_| QueueStopped),
        }
    }

    async fn next_completion(&mut self) -> Result<IoCompletion, QueueStopped> {
        match self {
            EngineQueue::Local(queue) => queue.next_completion().await,
            EngineQueue::Remote(queue) => queue.completions.recv().await.ok_or(QueueStopped),
        }
    }
}
