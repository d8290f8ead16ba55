//! A verifying workload for failover tests, and a TCP proxy that can stop answering.
//!
//! [`Workload`] keeps several hosts busy on one volume while a test kills, stops or cuts off the
//! node serving it, then proves that no acknowledged write was lost or damaged and measures how
//! long I/O paused. Each worker is one [`MultipathNamespace`] (its own controllers on every
//! path) writing self-checking blocks ([`super::fill_pattern`]: each block holds its LBA and a
//! tag naming the worker and the write's generation) at random places of its own LBA range, and
//! reading blocks back now and then. Per block a worker knows the last acknowledged generation
//! and the generation of a write that failed, timed out or was cut off by the stop, which may or
//! may not have landed; a read must return one of those (zeros before any acknowledged write).
//! A write that fails after the multipath's own retries is counted, kept as uncertain, and
//! issued again with the same data after a short pause until it is acknowledged, so a block has
//! at most one uncertain generation. [`Workload::check_all`] reads the whole range back after
//! [`Workload::stop`].
//!
//! The workload assumes its block range reads zeros when it starts (a new volume) and that
//! nothing else writes there.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use initiator::{ConnectOptions, InitiatorError, MultipathNamespace, Nqn};
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::{fill_pattern, BLOCK_BYTES};

/// Workers (hosts) of one workload at most.
pub const WORKERS_MAX: usize = 16;
/// Blocks one workload covers at most (its model holds a few words per block).
pub const WORKLOAD_BLOCKS_MAX: u64 = 1 << 20;
/// Blocks one read or write covers at most (each is 1 to this many, drawn at random).
pub const IO_BLOCKS_MAX: u64 = 4;
/// Share of I/Os that are reads, in percent.
pub const READ_PERCENT: u32 = 30;
/// Pause before a worker issues again an I/O that failed.
pub const ERROR_PAUSE: Duration = Duration::from_millis(100);
/// Wrong blocks and error messages listed at most (the rest are only counted).
pub const LISTED_MAX: usize = 50;
/// Blocks read per command by [`Workload::check_all`].
pub const CHECK_READ_BLOCKS: u64 = 64;
/// Tries of one read by [`Workload::check_all`] (each riding through failover) before the blocks
/// are listed as unreadable.
pub const CHECK_READ_ATTEMPTS_MAX: u32 = 3;
/// How long [`Workload::start`] waits for the workers to connect, and [`Workload::stop`] for
/// them to end.
pub const WORKLOAD_START_STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Interval of the polls of [`Workload::wait_for_writes`] and of the proxy's idle checks.
pub const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// The environment variable that replays a workload's random choices (the seed is printed).
pub const SEED_VARIABLE: &str = "FERRITE_FAILOVER_SEED";
/// Each worker's tags are `(worker + 1) << TAG_WORKER_SHIFT | generation`.
const TAG_WORKER_SHIFT: u32 = 40;
/// One command at a time per worker: the multipath namespace issues them so.
const QUEUE_DEPTH: u16 = 1;

const _: () = assert!((WORKERS_MAX as u64) < (1 << (64 - TAG_WORKER_SHIFT)));

/// The tag of a worker's write of `generation` (1, 2, ...).
pub fn write_tag(worker: usize, generation: u64) -> u64 {
    assert!(generation > 0 && generation < 1 << TAG_WORKER_SHIFT);
    ((worker as u64 + 1) << TAG_WORKER_SHIFT) | generation
}

/// What the workload did, as of [`Workload::report`] or [`Workload::stop`].
#[derive(Debug, Clone)]
pub struct Report {
    /// Writes acknowledged (each 1 to [`IO_BLOCKS_MAX`] blocks).
    pub writes_acked: u64,
    /// Blocks read back and checked while running.
    pub reads_checked: u64,
    /// I/Os that failed after the multipath's own retries and were issued again by the worker.
    pub errors_retried: u64,
    /// Commands that failed on a path and were retried on another by the multipath (the sum of
    /// [`MultipathNamespace::failovers`] over the workers).
    pub failovers: u64,
    /// The longest time no I/O completed on any worker (until now, or until the stop).
    pub longest_pause: Duration,
    /// When that pause began, from the start of the workers' I/O.
    pub pause_started_at: Duration,
    /// Time from the start of the workers' I/O until now or the stop.
    pub elapsed: Duration,
    /// Blocks a read returned with content no write could have left (at most [`LISTED_MAX`]
    /// listed, then a line with the count of the others).
    pub wrong_blocks: Vec<String>,
    /// The first [`LISTED_MAX`] errors the workers met.
    pub errors: Vec<String>,
    /// Per worker, the path (index into the workload's paths) its next I/O goes to, as of its
    /// last completed I/O; `None` when it had no usable path.
    pub current_paths: Vec<Option<usize>>,
}

/// What [`Workload::check_all`] found.
#[derive(Debug, Clone)]
pub struct Check {
    /// Blocks read back (the whole range).
    pub blocks_checked: u64,
    /// Blocks the workload wrote or tried to write.
    pub blocks_written: u64,
    /// Blocks whose content no write could have left, and blocks that could not be read (at
    /// most [`LISTED_MAX`] listed, then a line with the count of the others).
    pub wrong_blocks: Vec<String>,
}

/// What a worker knows of one block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct BlockState {
    /// The tag of the last acknowledged write; `None`: never acknowledged (reads zeros).
    acked: Option<u64>,
    /// The tag of a later write that was not acknowledged: it may or may not have landed.
    maybe: Option<u64>,
}

impl BlockState {
    fn touched(&self) -> bool {
        self.acked.is_some() || self.maybe.is_some()
    }
}

/// One worker's blocks: `states[i]` is block `first_lba + i`.
#[derive(Debug)]
struct Model {
    first_lba: u64,
    states: Vec<BlockState>,
}

impl Model {
    fn state(&self, lba: u64) -> BlockState {
        self.states[(lba - self.first_lba) as usize]
    }

    fn state_mut(&mut self, lba: u64) -> &mut BlockState {
        &mut self.states[(lba - self.first_lba) as usize]
    }

    fn end_lba(&self) -> u64 {
        self.first_lba + self.states.len() as u64
    }
}

/// Why a block read back is wrong, or `None` when a write could have left it so.
fn verify_block(lba: u64, bytes: &[u8], state: BlockState) -> Option<String> {
    assert_eq!(bytes.len(), BLOCK_BYTES);
    let expected = match (state.acked, state.maybe) {
        (None, None) => "zeros (never written)".to_owned(),
        (None, Some(maybe)) => format!("zeros or tag {maybe:#x} (unacknowledged)"),
        (Some(acked), None) => format!("tag {acked:#x}"),
        (Some(acked), Some(maybe)) => {
            format!("tag {acked:#x} or {maybe:#x} (unacknowledged)")
        }
    };
    if bytes.iter().all(|byte| *byte == 0) {
        return state.acked.map(|_| format!("block {lba}: reads zeros, expected {expected}"));
    }
    let word =
        |range: Range<usize>| u64::from_le_bytes(bytes[range].try_into().unwrap_or_default());
    let (header_lba, header_tag) = (word(0..8), word(8..16));
    let mut pattern = vec![0u8; BLOCK_BYTES];
    fill_pattern(&mut pattern, lba, header_tag);
    let intact = pattern == bytes;
    let candidate = [state.acked, state.maybe].contains(&Some(header_tag));
    if candidate && intact {
        return None;
    }
    let differing = pattern.iter().zip(bytes).filter(|(a, b)| a != b).count();
    let content = if intact {
        "intact".to_owned()
    } else {
        format!("{differing} bytes differ from that pattern")
    };
    Some(format!(
        "block {lba}: holds header (lba {header_lba}, tag {header_tag:#x}), {content}; expected \
         {expected}"
    ))
}

/// What the workers share with the test: counters and the pause measurement.
#[derive(Debug)]
struct Progress {
    /// When the workers began their I/O.
    started: Instant,
    /// The last completion, or the start.
    last_completion: Instant,
    longest_pause: Duration,
    pause_started: Instant,
    stopped: Option<Instant>,
    writes_acked: u64,
    reads_checked: u64,
    errors_retried: u64,
    failovers: u64,
    wrong_blocks: Vec<String>,
    wrong_blocks_total: u64,
    errors: Vec<String>,
    current_paths: Vec<Option<usize>>,
}

impl Progress {
    fn new(now: Instant, workers: usize) -> Progress {
        Progress {
            started: now,
            last_completion: now,
            longest_pause: Duration::ZERO,
            pause_started: now,
            stopped: None,
            writes_acked: 0,
            reads_checked: 0,
            errors_retried: 0,
            failovers: 0,
            wrong_blocks: Vec::new(),
            wrong_blocks_total: 0,
            errors: Vec::new(),
            current_paths: vec![None; workers],
        }
    }

    /// An I/O completed now. The time is taken under the lock, so completions are in order.
    fn completed(&mut self) {
        let now = Instant::now();
        self.note_gap(now);
        self.last_completion = now;
    }

    fn note_gap(&mut self, now: Instant) {
        let gap = now.saturating_duration_since(self.last_completion);
        if gap > self.longest_pause {
            self.longest_pause = gap;
            self.pause_started = self.last_completion;
        }
    }

    fn wrong(&mut self, message: String) {
        self.wrong_blocks_total += 1;
        if self.wrong_blocks.len() < LISTED_MAX {
            eprintln!("workload: WRONG {message}");
            self.wrong_blocks.push(message);
        }
    }

    fn error(&mut self, message: String) {
        self.errors_retried += 1;
        if self.errors.len() < LISTED_MAX {
            eprintln!("workload: error, retrying: {message}");
            self.errors.push(message);
        }
    }

    /// The report as of now (or the stop): a pause still going on counts up to then.
    fn report(&self) -> Report {
        let now = self.stopped.unwrap_or_else(Instant::now);
        let mut progress = Progress {
            wrong_blocks: Vec::new(),
            errors: Vec::new(),
            current_paths: Vec::new(),
            ..*self
        };
        progress.note_gap(now);
        let mut wrong_blocks = self.wrong_blocks.clone();
        let unlisted = self.wrong_blocks_total - wrong_blocks.len() as u64;
        if unlisted > 0 {
            wrong_blocks.push(format!("... and {unlisted} more wrong blocks"));
        }
        Report {
            writes_acked: self.writes_acked,
            reads_checked: self.reads_checked,
            errors_retried: self.errors_retried,
            failovers: self.failovers,
            longest_pause: progress.longest_pause,
            pause_started_at: progress.pause_started.saturating_duration_since(self.started),
            elapsed: now.saturating_duration_since(self.started),
            wrong_blocks,
            errors: self.errors.clone(),
            current_paths: self.current_paths.clone(),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a worker panicked; that panic is the failure to look at.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A verifying workload running on its own thread until [`Workload::stop`]. See the module
/// documentation.
pub struct Workload {
    paths: Vec<String>,
    nqn: Nqn,
    blocks: Range<u64>,
    io_timeout: Duration,
    models: Vec<Arc<Mutex<Model>>>,
    progress: Arc<Mutex<Progress>>,
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// Connects a multipath namespace on `paths` with the workload's timeouts.
async fn connect(
    paths: &[String],
    nqn: &Nqn,
    io_timeout: Duration,
) -> Result<MultipathNamespace, InitiatorError> {
    let mut device =
        MultipathNamespace::connect(paths, nqn, ConnectOptions::default(), QUEUE_DEPTH).await?;
    device.set_io_timeout(io_timeout);
    Ok(device)
}

impl Workload {
    /// Connects `workers` hosts to the subsystem `nqn` through every address of `paths` (each
    /// `IP:PORT`, a port of the subsystem), gives each a disjoint part of `blocks` and starts
    /// them; returns once all are connected. Each host gives up a path whose command takes over
    /// `io_timeout` and rides through a time without usable path for the initiator's default
    /// failover timeout.
    ///
    /// # Panics
    /// On bad arguments, or when a host cannot connect: a workload that cannot start has
    /// nothing to prove.
    pub fn start(
        paths: Vec<String>,
        nqn: Nqn,
        blocks: Range<u64>,
        workers: usize,
        io_timeout: Duration,
    ) -> Workload {
        assert!((1..=WORKERS_MAX).contains(&workers), "{workers} workers");
        let count = blocks.end.saturating_sub(blocks.start);
        assert!(
            count >= workers as u64 * IO_BLOCKS_MAX && count <= WORKLOAD_BLOCKS_MAX,
            "a range of {count} blocks for {workers} workers"
        );
        let seed: u64 = std::env::var(SEED_VARIABLE)
            .ok()
            .map(|text| text.parse().expect("FERRITE_FAILOVER_SEED is a number"))
            .unwrap_or_else(|| rand::rng().random());
        eprintln!("workload: {workers} workers on blocks {blocks:?}; {SEED_VARIABLE}={seed}");

        let share = count / workers as u64;
        let models: Vec<Arc<Mutex<Model>>> = (0..workers as u64)
            .map(|worker| {
                let first_lba = blocks.start + worker * share;
                let end_lba =
                    if worker + 1 == workers as u64 { blocks.end } else { first_lba + share };
                Arc::new(Mutex::new(Model {
                    first_lba,
                    states: vec![BlockState::default(); (end_lba - first_lba) as usize],
                }))
            })
            .collect();
        let progress = Arc::new(Mutex::new(Progress::new(Instant::now(), workers)));
        let (stop, stop_receiver) = watch::channel(false);
        let (ready_sender, ready) = mpsc::sync_channel::<Result<(), String>>(1);
        let thread = {
            let paths = paths.clone();
            let nqn = nqn.clone();
            let models = models.clone();
            let progress = Arc::clone(&progress);
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a tokio runtime");
                runtime.block_on(async move {
                    let mut devices = Vec::with_capacity(models.len());
                    for _ in 0..models.len() {
                        match connect(&paths, &nqn, io_timeout).await {
                            Ok(device) => devices.push(device),
                            Err(error) => {
                                let _ = ready_sender.send(Err(error.to_string()));
                                return;
                            }
                        }
                    }
                    *lock(&progress) = Progress::new(Instant::now(), devices.len());
                    let _ = ready_sender.send(Ok(()));
                    let mut tasks = tokio::task::JoinSet::new();
                    for (worker, (device, model)) in devices.into_iter().zip(models).enumerate() {
                        let worker_seed = seed ^ (worker as u64).wrapping_mul(0x9E37_79B9);
                        tasks.spawn(run_worker(
                            worker,
                            device,
                            model,
                            Arc::clone(&progress),
                            stop_receiver.clone(),
                            worker_seed,
                        ));
                    }
                    while let Some(result) = tasks.join_next().await {
                        match result {
                            Err(error) if error.is_panic() => {
                                std::panic::resume_unwind(error.into_panic())
                            }
                            Err(error) => panic!("a workload worker ended: {error}"),
                            Ok(()) => {}
                        }
                    }
                });
            })
        };
        match ready.recv_timeout(WORKLOAD_START_STOP_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                panic!("a workload host cannot connect to {nqn} on {paths:?}: {error}")
            }
            Err(error) => panic!("the workload did not start: {error}"),
        }
        Workload { paths, nqn, blocks, io_timeout, models, progress, stop, thread: Some(thread) }
    }

    /// What the workload has done so far.
    pub fn report(&self) -> Report {
        lock(&self.progress).report()
    }

    /// Waits until at least `writes` writes are acknowledged in all; `false` if `timeout`
    /// passed first.
    pub fn wait_for_writes(&self, writes: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |report| report.writes_acked >= writes)
    }

    /// Waits until `done` holds of the report; `false` if `timeout` passed first.
    pub fn wait_until(&self, timeout: Duration, mut done: impl FnMut(&Report) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        while !done(&self.report()) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        true
    }

    /// Blocks with an acknowledged write and no uncertain one (for tests that change a block
    /// behind the workload's back).
    pub fn acknowledged_blocks(&self) -> Vec<u64> {
        let mut blocks = Vec::new();
        for model in &self.models {
            let model = lock(model);
            let settled = |lba: &u64| {
                let state = model.state(*lba);
                state.acked.is_some() && state.maybe.is_none()
            };
            blocks.extend((model.first_lba..model.end_lba()).filter(settled));
        }
        blocks
    }

    /// Stops the workers (an I/O in flight is abandoned and its write counted as uncertain)
    /// and returns the final report; a pause going on at the stop counts up to it.
    ///
    /// # Panics
    /// When a worker panicked, or the workers do not end within
    /// [`WORKLOAD_START_STOP_TIMEOUT`].
    pub fn stop(&mut self) -> Report {
        let Some(thread) = self.thread.take() else {
            return self.report();
        };
        lock(&self.progress).stopped = Some(Instant::now());
        let _ = self.stop.send(true);
        let deadline = Instant::now() + WORKLOAD_START_STOP_TIMEOUT;
        while !thread.is_finished() {
            assert!(Instant::now() < deadline, "the workload did not stop");
            std::thread::sleep(POLL_INTERVAL);
        }
        if let Err(panic) = thread.join() {
            std::panic::resume_unwind(panic);
        }
        let report = self.report();
        eprintln!("workload: stopped: {report:?}");
        report
    }

    /// After [`Workload::stop`]: reads every block of the range back through a new multipath
    /// host and checks each holds what the workload's writes could have left there (the last
    /// acknowledged generation or the uncertain one; zeros where nothing was acknowledged).
    pub fn check_all(&self) -> Check {
        assert!(self.thread.is_none(), "check_all runs after stop");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let mut wrong = Vec::new();
        let mut wrong_total = 0u64;
        let mut note = |message: String| {
            wrong_total += 1;
            if wrong.len() < LISTED_MAX {
                eprintln!("check: WRONG {message}");
                wrong.push(message);
            }
        };
        let mut blocks_checked = 0;
        let mut blocks_written = 0;
        runtime.block_on(async {
            let mut device = connect(&self.paths, &self.nqn, self.io_timeout)
                .await
                .unwrap_or_else(|error| panic!("check_all cannot connect: {error}"));
            for model in &self.models {
                // A copy: the workers are gone, but no lock is held across the reads.
                let model = {
                    let model = lock(model);
                    Model { first_lba: model.first_lba, states: model.states.clone() }
                };
                blocks_written += model.states.iter().filter(|state| state.touched()).count();
                let mut lba = model.first_lba;
                while lba < model.end_lba() {
                    let count = CHECK_READ_BLOCKS.min(model.end_lba() - lba);
                    let length = count as usize * BLOCK_BYTES;
                    let mut last_error = None;
                    let mut data = None;
                    for _ in 0..CHECK_READ_ATTEMPTS_MAX {
                        match device.read(lba, length).await {
                            Ok(read) => {
                                data = Some(read);
                                break;
                            }
                            Err(error) => {
                                last_error = Some(error);
                                tokio::time::sleep(ERROR_PAUSE).await;
                            }
                        }
                    }
                    match data {
                        Some(data) => {
                            for (index, bytes) in data.chunks_exact(BLOCK_BYTES).enumerate() {
                                let block = lba + index as u64;
                                if let Some(message) =
                                    verify_block(block, bytes, model.state(block))
                                {
                                    note(message);
                                }
                            }
                        }
                        None => note(format!(
                            "blocks {lba}..{}: unreadable: {}",
                            lba + count,
                            last_error.map_or_else(String::new, |error| error.to_string())
                        )),
                    }
                    blocks_checked += count;
                    lba += count;
                }
            }
        });
        let unlisted = wrong_total - wrong.len() as u64;
        if unlisted > 0 {
            wrong.push(format!("... and {unlisted} more wrong blocks"));
        }
        assert_eq!(blocks_checked, self.blocks.end - self.blocks.start);
        Check { blocks_checked, blocks_written: blocks_written as u64, wrong_blocks: wrong }
    }
}

/// Waits until `stop` is set; the branch of a `select!` that ends a worker.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // An error means the workload is gone: stop as well.
    let _ = stop.wait_for(|stop| *stop).await;
}

/// One worker: random reads and writes on its model's blocks until the stop. Every write's
/// blocks are marked uncertain before it is issued, so a write abandoned at any moment is
/// accounted for.
async fn run_worker(
    worker: usize,
    mut device: MultipathNamespace,
    model: Arc<Mutex<Model>>,
    progress: Arc<Mutex<Progress>>,
    mut stop: watch::Receiver<bool>,
    seed: u64,
) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (first_lba, end_lba) = {
        let model = lock(&model);
        (model.first_lba, model.end_lba())
    };
    let mut generation = 0u64;
    let mut failovers_seen = 0u64;
    let mut data = vec![0u8; IO_BLOCKS_MAX as usize * BLOCK_BYTES];
    while !*stop.borrow() {
        let lba = rng.random_range(first_lba..end_lba);
        let count = rng.random_range(1..=IO_BLOCKS_MAX).min(end_lba - lba);
        let length = count as usize * BLOCK_BYTES;
        let read = rng.random_ratio(READ_PERCENT, 100);
        let tag = if read {
            None
        } else {
            generation += 1;
            let tag = write_tag(worker, generation);
            fill_pattern(&mut data[..length], lba, tag);
            let mut model = lock(&model);
            for block in lba..lba + count {
                let state = model.state_mut(block);
                assert_eq!(state.maybe, None, "block {block}: an earlier write still pending");
                state.maybe = Some(tag);
            }
            Some(tag)
        };
        // The I/O, issued again after each failure until it succeeds or the workload stops.
        loop {
            let result = match tag {
                None => tokio::select! {
                    result = device.read(lba, length) => result.map(Some),
                    () = stopped(&mut stop) => return,
                },
                Some(_) => tokio::select! {
                    result = device.write(lba, &data[..length]) => result.map(|()| None),
                    () = stopped(&mut stop) => return,
                },
            };
            let failovers = device.failovers();
            let failed = {
                let mut progress_now = lock(&progress);
                progress_now.failovers += failovers - failovers_seen;
                failovers_seen = failovers;
                progress_now.current_paths[worker] = device.current_path();
                match result {
                    Ok(read) => {
                        progress_now.completed();
                        let mut model = lock(&model);
                        if let Some(tag) = tag {
                            for block in lba..lba + count {
                                *model.state_mut(block) =
                                    BlockState { acked: Some(tag), maybe: None };
                            }
                            progress_now.writes_acked += 1;
                        }
                        if let Some(read) = read {
                            for (index, bytes) in read.chunks_exact(BLOCK_BYTES).enumerate() {
                                let block = lba + index as u64;
                                if let Some(message) =
                                    verify_block(block, bytes, model.state(block))
                                {
                                    progress_now.wrong(message);
                                }
                            }
                            progress_now.reads_checked += count;
                        }
                        false
                    }
                    Err(error) => {
                        let what = if tag.is_some() { "write" } else { "read" };
                        progress_now.error(format!(
                            "worker {worker}: {what} of blocks {lba}..{}: {error}",
                            lba + count
                        ));
                        true
                    }
                }
            };
            if !failed {
                break;
            }
            tokio::select! {
                () = tokio::time::sleep(ERROR_PAUSE) => {}
                () = stopped(&mut stop) => return,
            }
        }
    }
}

// ----- A path that stops answering -----

/// Bytes a proxy moves per read.
const PROXY_BUFFER_BYTES: usize = 64 * 1024;
/// A connection accepted while the proxy is stalled never forwards anything.
const EPOCH_NEVER: u64 = u64::MAX;

/// What the proxy's connections share with the test.
#[derive(Debug)]
struct ProxyState {
    stalled: AtomicBool,
    /// Counts the stalls: a connection open across one never forwards again.
    epoch: AtomicU64,
    shutdown: AtomicBool,
}

impl ProxyState {
    /// Whether a connection accepted in `epoch` may no longer forward.
    fn doomed(&self, epoch: u64) -> bool {
        self.stalled.load(Ordering::SeqCst) || self.epoch.load(Ordering::SeqCst) != epoch
    }
}

/// A TCP proxy on 127.0.0.1 in front of one NVMe/TCP port, that a test can make stop answering
/// as a network partition or a stopped node does: while stalled, its connections forward
/// nothing in either direction (what the host sends is held, never delivered) and new ones are
/// accepted and forward nothing either. When the stall ends, those connections are closed
/// (whatever they held is dropped) and new connections work again. Runs on its own thread until
/// dropped.
pub struct StallingProxy {
    address: SocketAddr,
    state: Arc<ProxyState>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StallingProxy {
    /// Starts a proxy to `target` (`IP:PORT`).
    pub fn start(target: &str) -> StallingProxy {
        let target: SocketAddr = target.parse().expect("the proxy target is IP:PORT");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener.set_nonblocking(true).expect("a non-blocking listener");
        let address = listener.local_addr().expect("a bound listener has an address");
        let state = Arc::new(ProxyState {
            stalled: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
        });
        let shared = Arc::clone(&state);
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime");
            runtime.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("a tokio listener");
                let mut connections = tokio::task::JoinSet::new();
                while !shared.shutdown.load(Ordering::SeqCst) {
                    while connections.try_join_next().is_some() {}
                    let accepted =
                        tokio::time::timeout(POLL_INTERVAL * 10, listener.accept()).await;
                    let Ok(Ok((host, _))) = accepted else { continue };
                    let epoch = if shared.stalled.load(Ordering::SeqCst) {
                        EPOCH_NEVER
                    } else {
                        shared.epoch.load(Ordering::SeqCst)
                    };
                    let Ok(node) = TcpStream::connect(target).await else { continue };
                    let _ = (host.set_nodelay(true), node.set_nodelay(true));
                    let (host_read, host_write) = host.into_split();
                    let (node_read, node_write) = node.into_split();
                    connections.spawn(pump(host_read, node_write, Arc::clone(&shared), epoch));
                    connections.spawn(pump(node_read, host_write, Arc::clone(&shared), epoch));
                }
            });
        });
        StallingProxy { address, state, thread: Some(thread) }
    }

    /// The address hosts connect to, `127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        self.address.to_string()
    }

    /// From now on nothing passes (see the type's documentation).
    pub fn stall(&self) {
        self.state.epoch.fetch_add(1, Ordering::SeqCst);
        self.state.stalled.store(true, Ordering::SeqCst);
    }

    /// Ends the stall: the connections it caught close, new ones work.
    pub fn resume(&self) {
        self.state.stalled.store(false, Ordering::SeqCst);
    }
}

impl Drop for StallingProxy {
    fn drop(&mut self) {
        self.state.shutdown.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Moves bytes one way until either side closes, the stall that caught the connection ends, or
/// the proxy shuts down.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, state: Arc<ProxyState>, epoch: u64) {
    let mut buffer = vec![0u8; PROXY_BUFFER_BYTES];
    while !state.shutdown.load(Ordering::SeqCst) {
        if state.doomed(epoch) {
            if !state.stalled.load(Ordering::SeqCst) {
                return;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
            continue;
        }
        let read = match tokio::time::timeout(POLL_INTERVAL, from.read(&mut buffer)).await {
            Err(_) => continue,
            Ok(Ok(0) | Err(_)) => return,
            Ok(Ok(read)) => read,
        };
        // Bytes read as the stall began are lost in the partition.
        if state.doomed(epoch) {
            continue;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}
