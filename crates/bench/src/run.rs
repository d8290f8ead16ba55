//! The bench's phases in order - connect, optional fill, each workload with its ramp and measured
//! window - and the reports they produce; also the read-back pass of a saved verify map.

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::engine::{self, OpSource, PhaseCounters, PhaseShared, QueueState, QueueStats};
use crate::progress::{show_progress, ProgressPlan, ProgressStyle};
use crate::target::{BlockQueue, Connector, IO_ALIGNMENT_BYTES, IO_SIZE_BYTES_MAX};
use crate::verify::{
    MapAccess, Mismatch, Verifier, VerifyMap, VERIFY_BLOCK_BYTES, VERIFY_REGION_BYTES_MAX,
};
use crate::{output, BenchError, Workload, STANDARD_WORKLOADS};

/// The most queues one run opens.
pub const QUEUE_COUNT_MAX: u16 = 64;
/// The most requests in flight per queue.
pub const QUEUE_DEPTH_MAX: u16 = 1024;
/// The most workloads one run lists (repeats allowed).
pub const WORKLOADS_MAX: usize = 32;
/// The longest ramp and the longest measured window of one workload.
pub const PHASE_DURATION_MAX: Duration = Duration::from_secs(24 * 3600);
/// The size of each `--fill` write.
pub const FILL_IO_SIZE_BYTES: u32 = 128 * 1024;
/// The largest read of the read-back check.
pub const CHECK_IO_SIZE_BYTES: u32 = IO_SIZE_BYTES_MAX;
/// The most memory the I/O buffers of one run take: queues x depth x the largest I/O.
pub const IN_FLIGHT_BUFFER_BYTES_MAX: u64 = 1 << 30;

const _: () =
    assert!(FILL_IO_SIZE_BYTES <= IO_SIZE_BYTES_MAX && CHECK_IO_SIZE_BYTES <= IO_SIZE_BYTES_MAX);
const _: () = assert!(FILL_IO_SIZE_BYTES % IO_ALIGNMENT_BYTES == 0);

/// Everything a run needs besides the target. `Default` gives the CLI's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchConfig {
    /// Run in this order; repeats allowed.
    pub workloads: Vec<Workload>,
    pub queue_count: u16,
    /// Requests in flight per queue.
    pub queue_depth: u16,
    /// Run before each measured window, not counted.
    pub ramp: Duration,
    /// The measured window of each workload.
    pub runtime: Duration,
    /// Bytes from offset 0 to use; `None` uses the whole namespace (rounded down to 4 KiB).
    pub region_size_bytes: Option<u64>,
    /// Write the whole region sequentially first.
    pub fill: bool,
    /// Write self-checking blocks and check every read (see [`VerifyMap`]).
    pub verify: bool,
    /// Seeds offsets and the read/write choice; `None` picks a random seed.
    pub seed: Option<u64>,
    /// Show the live progress line and per-phase summaries on stderr.
    pub progress: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            workloads: STANDARD_WORKLOADS.to_vec(),
            queue_count: 4,
            queue_depth: 32,
            ramp: Duration::from_secs(2),
            runtime: Duration::from_secs(10),
            region_size_bytes: None,
            fill: false,
            verify: false,
            seed: None,
            progress: true,
        }
    }
}

impl BenchConfig {
    /// Checks the options that do not depend on the target.
    pub fn validate(&self) -> Result<(), BenchError> {
        let invalid = |message: String| Err(BenchError::InvalidConfig(message));
        if self.workloads.is_empty() || self.workloads.len() > WORKLOADS_MAX {
            return invalid(format!("give 1 to {WORKLOADS_MAX} workloads"));
        }
        if !(1..=QUEUE_COUNT_MAX).contains(&self.queue_count) {
            return invalid(format!("--queues must be 1 to {QUEUE_COUNT_MAX}"));
        }
        if !(1..=QUEUE_DEPTH_MAX).contains(&self.queue_depth) {
            return invalid(format!("--iodepth must be 1 to {QUEUE_DEPTH_MAX}"));
        }
        if self.runtime.is_zero()
            || self.runtime > PHASE_DURATION_MAX
            || self.ramp > PHASE_DURATION_MAX
        {
            return invalid(
                "--runtime must be above 0 and --ramp and --runtime at most a day".to_owned(),
            );
        }
        self.validate_buffers(self.largest_io_bytes())?;
        if let Some(size) = self.region_size_bytes {
            if size == 0 || size % u64::from(IO_ALIGNMENT_BYTES) != 0 {
                return invalid(format!("--size {size} must be a positive multiple of 4096 bytes"));
            }
        }
        Ok(())
    }

    /// Checks that `queue_count x queue_depth` buffers of `buffer_bytes` stay within the limit.
    fn validate_buffers(&self, buffer_bytes: u32) -> Result<(), BenchError> {
        let total_bytes =
            u64::from(self.queue_count) * u64::from(self.queue_depth) * u64::from(buffer_bytes);
        if total_bytes > IN_FLIGHT_BUFFER_BYTES_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "--queues x --iodepth buffers would take {}, over the limit of {}: lower them",
                output::format_bytes(total_bytes),
                output::format_bytes(IN_FLIGHT_BUFFER_BYTES_MAX)
            )));
        }
        Ok(())
    }

    fn largest_io_bytes(&self) -> u32 {
        let workloads = self.workloads.iter().map(|w| w.block_size_bytes).max().unwrap_or(0);
        if self.fill {
            workloads.max(FILL_IO_SIZE_BYTES)
        } else {
            workloads
        }
    }
}

/// Latency of the I/Os completed in a measured window, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl LatencySummary {
    /// Summarises a histogram of nanoseconds.
    pub fn from_histogram_ns(histogram: &Histogram<u64>) -> LatencySummary {
        if histogram.is_empty() {
            return LatencySummary::default();
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        LatencySummary {
            count: histogram.len(),
            mean_us: histogram.mean() / 1000.0,
            p50_us: us(histogram.value_at_quantile(0.50)),
            p99_us: us(histogram.value_at_quantile(0.99)),
            p999_us: us(histogram.value_at_quantile(0.999)),
            max_us: us(histogram.max()),
        }
    }
}

/// The result of one workload.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadReport {
    pub workload: Workload,
    pub queue_count: u16,
    pub queue_depth: u16,
    pub ramp: Duration,
    /// The measured window: ops, bytes and latencies count completions inside it.
    pub measured: Duration,
    pub read_ops: u64,
    pub write_ops: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// All I/Os of the window, reads and writes merged, over all queues.
    pub latency: LatencySummary,
    pub read_latency: LatencySummary,
    pub write_latency: LatencySummary,
    /// Failed commands during the whole workload (ramp and drain included).
    pub errors: u64,
    pub first_error_status: Option<u16>,
    pub verify: bool,
    /// Blocks read back wrong during the whole workload.
    pub verify_mismatches: u64,
    /// The first few mismatches, with details.
    pub mismatch_examples: Vec<Mismatch>,
    /// CPU time this process took (user and system, all its threads) per second of the
    /// measured window and the drain after it: with `--target engine:` the engine and the
    /// bench's own request generator, with a network target the client alone. `None` when the
    /// process's CPU time could not be read.
    pub process_cpu_cores: Option<f64>,
}

impl WorkloadReport {
    pub fn ops(&self) -> u64 {
        self.read_ops + self.write_ops
    }

    pub fn iops(&self) -> f64 {
        per_second(self.ops(), self.measured)
    }

    /// Throughput in MB/s, decimal (10^6 bytes per second), like fio's and the Ceph anchor's.
    pub fn mb_per_s(&self) -> f64 {
        per_second(self.read_bytes + self.write_bytes, self.measured) / 1e6
    }
}

fn per_second(count: u64, window: Duration) -> f64 {
    if window.is_zero() {
        0.0
    } else {
        count as f64 / window.as_secs_f64()
    }
}

/// Options of [`VerifyMap::check_all`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckOptions {
    pub queue_count: u16,
    pub queue_depth: u16,
    pub progress: bool,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions { queue_count: 4, queue_depth: 32, progress: false }
    }
}

/// The result of reading back every block a verify map saw written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    pub blocks_checked: u64,
    pub mismatches: u64,
    pub mismatch_examples: Vec<Mismatch>,
    /// Reads the target failed (their blocks are not checked).
    pub errors: u64,
    pub first_error_status: Option<u16>,
    pub elapsed: Duration,
}

impl CheckReport {
    pub fn passed(&self) -> bool {
        self.mismatches == 0 && self.errors == 0
    }
}

/// Runs the configured workloads (after a fill if asked) and returns one report per workload.
/// With `config.verify`, a fresh [`VerifyMap`] with a random seed checks every read; mismatches
/// are counted in the reports, not returned as an error (see [`crate::run_command`] for that).
pub async fn run<C: Connector>(
    config: &BenchConfig,
    connector: &mut C,
) -> Result<Vec<WorkloadReport>, BenchError> {
    run_keeping_map(config, connector, &mut None).await
}

/// [`run`], leaving the verify map (with `config.verify`) in `map_slot` as soon as the region is
/// known, so it survives a failed run.
pub(crate) async fn run_keeping_map<C: Connector>(
    config: &BenchConfig,
    connector: &mut C,
    map_slot: &mut Option<VerifyMap>,
) -> Result<Vec<WorkloadReport>, BenchError> {
    config.validate()?;
    let mut session = Session::connect(connector, config, config.largest_io_bytes()).await?;
    let region_size_bytes = session.region(config.region_size_bytes)?;
    if !config.verify {
        return session.run_phases(config, region_size_bytes, None).await;
    }
    check_verify_region(region_size_bytes)?;
    let map = map_slot.insert(VerifyMap::with_random_seed(region_size_bytes));
    session.run_phases(config, region_size_bytes, Some(MapAccess::Writable(map))).await
}

/// Like [`run`] with verification, on a map the caller keeps: the map records every write begun
/// and acknowledged even when the run fails half way (a killed server), so the caller can save
/// it and later [`VerifyMap::check_all`] against the restarted target. The region is the map's;
/// `config.region_size_bytes`, if set, must match it.
pub async fn run_verified<C: Connector>(
    config: &BenchConfig,
    connector: &mut C,
    map: &mut VerifyMap,
) -> Result<Vec<WorkloadReport>, BenchError> {
    config.validate()?;
    let region_size_bytes = map.region_size_bytes();
    if config.region_size_bytes.is_some_and(|size| size != region_size_bytes) {
        return Err(BenchError::InvalidConfig(format!(
            "--size differs from the verify map's region of {region_size_bytes} bytes"
        )));
    }
    let mut session = Session::connect(connector, config, config.largest_io_bytes()).await?;
    session.region(Some(region_size_bytes))?;
    let config = BenchConfig { verify: true, ..config.clone() };
    session.run_phases(&config, region_size_bytes, Some(MapAccess::Writable(map))).await
}

fn check_verify_region(region_size_bytes: u64) -> Result<(), BenchError> {
    if region_size_bytes > VERIFY_REGION_BYTES_MAX {
        return Err(BenchError::InvalidConfig(format!(
            "--verify keeps 4 bytes of RAM per 4 KiB block and handles at most {} of region; \
             this one is {}: limit it with --size",
            output::format_bytes(VERIFY_REGION_BYTES_MAX),
            output::format_bytes(region_size_bytes)
        )));
    }
    Ok(())
}

impl VerifyMap {
    /// Reads back every block this map saw a write begin on and checks it: the acknowledged
    /// generation must be there (or, for a write whose outcome was never known, the one before
    /// or the one after). Blocks never written in the map's run are not read.
    pub async fn check_all<C: Connector>(
        &self,
        connector: &mut C,
        options: &CheckOptions,
    ) -> Result<CheckReport, BenchError> {
        let config = BenchConfig {
            queue_count: options.queue_count,
            queue_depth: options.queue_depth,
            progress: options.progress,
            ..BenchConfig::default()
        };
        config.validate()?;
        config.validate_buffers(CHECK_IO_SIZE_BYTES)?;
        let mut session = Session::connect(connector, &config, CHECK_IO_SIZE_BYTES).await?;
        session.region(Some(self.region_size_bytes()))?;
        session.check(self).await
    }
}

/// The CPU time this process had taken (user and system, all threads) at an instant.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuMark {
    at: Instant,
    cpu: Duration,
}

impl CpuMark {
    /// Now; `None` if the kernel does not say.
    pub(crate) fn now() -> Option<CpuMark> {
        // SAFETY: rusage is plain integers, for which all zeros is a valid value.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `usage` is valid for writes of one rusage for the call.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
            return None;
        }
        let time = |t: libc::timeval| -> Option<Duration> {
            let micros = u32::try_from(t.tv_usec).ok().filter(|micros| *micros < 1_000_000)?;
            Some(Duration::new(u64::try_from(t.tv_sec).ok()?, micros * 1000))
        };
        let cpu = time(usage.ru_utime)? + time(usage.ru_stime)?;
        Some(CpuMark { at: Instant::now(), cpu })
    }

    /// CPU seconds per wall second from `earlier` to this mark (0 over no time).
    pub(crate) fn cores_since(&self, earlier: CpuMark) -> f64 {
        let wall = self.at.saturating_duration_since(earlier.at).as_secs_f64();
        let cpu = self.cpu.saturating_sub(earlier.cpu).as_secs_f64();
        if wall > 0.0 {
            cpu / wall
        } else {
            0.0
        }
    }
}

/// Open queues and their slot tables, for the length of one run.
struct Session<Q: BlockQueue> {
    queues: Vec<Q>,
    states: Vec<QueueState>,
    namespace_size_bytes: u64,
    style: ProgressStyle,
    seed: u64,
}

impl<Q: BlockQueue> Session<Q> {
    /// Opens the queues and gives each slot a buffer of `buffer_bytes`.
    async fn connect<C: Connector<Queue = Q>>(
        connector: &mut C,
        config: &BenchConfig,
        buffer_bytes: u32,
    ) -> Result<Session<Q>, BenchError> {
        let (queue_count, queue_depth) = (config.queue_count, config.queue_depth);
        let queues = connector
            .connect(queue_count, queue_depth)
            .await
            .map_err(|error| BenchError::Connect(Box::new(error)))?;
        if queues.len() != usize::from(queue_count) {
            return Err(BenchError::QueueContract {
                queue: 0,
                problem: format!("asked for {queue_count} queues, got {}", queues.len()),
            });
        }
        let namespace_size_bytes = queues.first().map_or(0, BlockQueue::size_bytes);
        if let Some(index) =
            queues.iter().position(|queue| queue.size_bytes() != namespace_size_bytes)
        {
            return Err(BenchError::QueueContract {
                queue: index as u16,
                problem: "queues of one connection report different namespace sizes".to_owned(),
            });
        }
        let seed = config.seed.unwrap_or_else(rand::random);
        let states = (0..queue_count)
            .map(|index| {
                QueueState::new(
                    queue_depth,
                    buffer_bytes,
                    seed ^ u64::from(index).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                )
            })
            .collect();
        let style = ProgressStyle::detect(config.progress);
        Ok(Session { queues, states, namespace_size_bytes, style, seed })
    }

    /// The region to use: the asked size, which must fit, or the whole namespace.
    fn region(&self, asked_bytes: Option<u64>) -> Result<u64, BenchError> {
        let whole = self.namespace_size_bytes / u64::from(IO_ALIGNMENT_BYTES)
            * u64::from(IO_ALIGNMENT_BYTES);
        match asked_bytes {
            Some(size) if size > self.namespace_size_bytes => {
                Err(BenchError::InvalidConfig(format!(
                    "the region of {} is larger than the namespace ({}): lower --size",
                    output::format_bytes(size),
                    output::format_bytes(self.namespace_size_bytes)
                )))
            }
            Some(size) => Ok(size),
            None if whole == 0 => Err(BenchError::InvalidConfig(format!(
                "the namespace is only {} bytes, less than one 4 KiB block",
                self.namespace_size_bytes
            ))),
            None => Ok(whole),
        }
    }

    async fn run_phases(
        &mut self,
        config: &BenchConfig,
        region_size_bytes: u64,
        map: Option<MapAccess<'_>>,
    ) -> Result<Vec<WorkloadReport>, BenchError> {
        if let Some(workload) =
            config.workloads.iter().find(|w| u64::from(w.block_size_bytes) > region_size_bytes)
        {
            return Err(BenchError::InvalidConfig(format!(
                "the region of {region_size_bytes} bytes is smaller than one {workload} I/O"
            )));
        }
        let verifier = map.map(|map| RefCell::new(Verifier::new(map)));
        self.style.finish(&format!(
            "bench: {} queues x depth {}, region {}, seed {}{}",
            config.queue_count,
            config.queue_depth,
            output::format_bytes(region_size_bytes),
            self.seed,
            if verifier.is_some() { ", verifying every read" } else { "" }
        ));
        if config.fill {
            self.fill(region_size_bytes, verifier.as_ref()).await?;
        }
        let mut reports = Vec::with_capacity(config.workloads.len());
        for (index, workload) in config.workloads.iter().enumerate() {
            let label = format!("[{}/{}] {workload}", index + 1, config.workloads.len());
            let report = self
                .workload(config, *workload, region_size_bytes, verifier.as_ref(), &label)
                .await?;
            self.style.finish(&format!("{label}: {}", output::summary_line(&report)));
            reports.push(report);
        }
        Ok(reports)
    }

    /// Runs one phase. With `cpu_mark`, the process's CPU time is read at its instant (the
    /// end of a workload's ramp) into its cell.
    async fn phase(
        &mut self,
        stats: &mut [QueueStats],
        source: &OpSource,
        shared: &PhaseShared<'_, '_>,
        label: &str,
        plan: ProgressPlan,
        cpu_mark: Option<(Instant, &Cell<Option<CpuMark>>)>,
    ) -> Result<(), BenchError> {
        let work = engine::drive_all(&mut self.queues, &mut self.states, stats, source, shared);
        // The timers are polled first and outside tokio's cooperative budget: busy queues use
        // the whole budget on every poll, and a timer polled after them would never fire.
        let mark = tokio::task::coop::unconstrained(async move {
            if let Some((at, cell)) = cpu_mark {
                tokio::time::sleep_until(at.into()).await;
                cell.set(CpuMark::now());
            }
            std::future::pending::<Infallible>().await
        });
        if self.style == ProgressStyle::Off {
            return tokio::select! {
                biased;
                never = mark => match never {},
                result = work => result,
            };
        }
        let progress = tokio::task::coop::unconstrained(show_progress(
            self.style,
            label,
            plan,
            &shared.counters,
        ));
        tokio::select! {
            biased;
            never = progress => match never {},
            never = mark => match never {},
            result = work => result,
        }
    }

    async fn fill(
        &mut self,
        region_size_bytes: u64,
        verifier: Option<&RefCell<Verifier<'_>>>,
    ) -> Result<(), BenchError> {
        let start = Instant::now();
        let shared =
            PhaseShared { verifier, cursor: Cell::new(0), counters: PhaseCounters::default() };
        let source = OpSource::Fill { region_size_bytes, io_size_bytes: FILL_IO_SIZE_BYTES };
        let mut stats: Vec<QueueStats> = self.queues.iter().map(|_| QueueStats::new()).collect();
        let plan = ProgressPlan::Sized { start, total_bytes: region_size_bytes };
        self.phase(&mut stats, &source, &shared, "fill", plan, None).await?;
        let elapsed = start.elapsed();
        let errors: u64 = stats.iter().map(|s| s.errors).sum();
        if errors > 0 {
            let first_status = stats.iter().find_map(|s| s.first_error_status).unwrap_or(0);
            return Err(BenchError::FillFailed { errors, first_status });
        }
        self.style.finish(&format!(
            "fill: {} in {:.1} s, {:.1} MB/s",
            output::format_bytes(region_size_bytes),
            elapsed.as_secs_f64(),
            per_second(region_size_bytes, elapsed) / 1e6
        ));
        Ok(())
    }

    async fn workload(
        &mut self,
        config: &BenchConfig,
        workload: Workload,
        region_size_bytes: u64,
        verifier: Option<&RefCell<Verifier<'_>>>,
        label: &str,
    ) -> Result<WorkloadReport, BenchError> {
        let start = Instant::now();
        let ramp_end = start + config.ramp;
        let end = ramp_end + config.runtime;
        let slot_count = region_size_bytes / u64::from(workload.block_size_bytes);
        let source = OpSource::Random { workload, slot_count, ramp_end, end };
        let shared =
            PhaseShared { verifier, cursor: Cell::new(0), counters: PhaseCounters::default() };
        let mut stats: Vec<QueueStats> = self.queues.iter().map(|_| QueueStats::new()).collect();
        let plan = ProgressPlan::Timed { start, ramp_end, end };
        let at_ramp_end = Cell::new(None);
        self.phase(&mut stats, &source, &shared, label, plan, Some((ramp_end, &at_ramp_end)))
            .await?;
        let process_cpu_cores =
            at_ramp_end.get().zip(CpuMark::now()).map(|(from, to)| to.cores_since(from));

        let (verify_mismatches, mismatch_examples) =
            verifier.map(|v| v.borrow_mut().take_mismatches()).unwrap_or_default();
        let mut read_latency_ns = engine::latency_histogram();
        let mut write_latency_ns = engine::latency_histogram();
        for queue in &stats {
            read_latency_ns.add(&queue.read_latency_ns).expect("histograms share bounds");
            write_latency_ns.add(&queue.write_latency_ns).expect("histograms share bounds");
        }
        let mut all_latency_ns = read_latency_ns.clone();
        all_latency_ns.add(&write_latency_ns).expect("histograms share bounds");
        Ok(WorkloadReport {
            workload,
            queue_count: config.queue_count,
            queue_depth: config.queue_depth,
            ramp: config.ramp,
            measured: config.runtime,
            read_ops: read_latency_ns.len(),
            write_ops: write_latency_ns.len(),
            read_bytes: stats.iter().map(|s| s.read_bytes).sum(),
            write_bytes: stats.iter().map(|s| s.write_bytes).sum(),
            latency: LatencySummary::from_histogram_ns(&all_latency_ns),
            read_latency: LatencySummary::from_histogram_ns(&read_latency_ns),
            write_latency: LatencySummary::from_histogram_ns(&write_latency_ns),
            errors: stats.iter().map(|s| s.errors).sum(),
            first_error_status: stats.iter().find_map(|s| s.first_error_status),
            verify: verifier.is_some(),
            verify_mismatches,
            mismatch_examples,
            process_cpu_cores,
        })
    }

    async fn check(&mut self, map: &VerifyMap) -> Result<CheckReport, BenchError> {
        let start = Instant::now();
        let verifier = RefCell::new(Verifier::new(MapAccess::ReadOnly(map)));
        let blocks_checked = map.written_block_count();
        let shared = PhaseShared {
            verifier: Some(&verifier),
            cursor: Cell::new(0),
            counters: PhaseCounters::default(),
        };
        let source = OpSource::WrittenBlocks { io_size_bytes: CHECK_IO_SIZE_BYTES };
        let mut stats: Vec<QueueStats> = self.queues.iter().map(|_| QueueStats::new()).collect();
        let plan =
            ProgressPlan::Sized { start, total_bytes: blocks_checked * VERIFY_BLOCK_BYTES as u64 };
        self.phase(&mut stats, &source, &shared, "check", plan, None).await?;
        let (mismatches, mismatch_examples) = verifier.borrow_mut().take_mismatches();
        let report = CheckReport {
            blocks_checked,
            mismatches,
            mismatch_examples,
            errors: stats.iter().map(|s| s.errors).sum(),
            first_error_status: stats.iter().find_map(|s| s.first_error_status),
            elapsed: start.elapsed(),
        };
        self.style.finish(&format!(
            "check: {} blocks read back in {:.1} s: {} mismatches, {} read errors",
            report.blocks_checked,
            report.elapsed.as_secs_f64(),
            report.mismatches,
            report.errors
        ));
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::{IoCompletion, IoKind, IoRequest, IoStatus};
    use std::collections::VecDeque;

    /// A queue over a RAM namespace whose requests complete the moment they are submitted: its
    /// `next_completion` never waits, the hardest case for fairness within the bench's task.
    struct InstantQueue {
        data: Vec<u8>,
        done: VecDeque<IoCompletion>,
    }

    impl BlockQueue for InstantQueue {
        type Error = std::io::Error;

        fn size_bytes(&self) -> u64 {
            self.data.len() as u64
        }

        fn submit(&mut self, mut request: IoRequest) -> Result<(), Self::Error> {
            let range =
                request.offset_bytes as usize..request.offset_bytes as usize + request.buffer.len();
            match request.kind {
                IoKind::Read => request.buffer.copy_from_slice(&self.data[range]),
                IoKind::Write => self.data[range].copy_from_slice(&request.buffer),
            }
            let completion = IoCompletion {
                tag: request.tag,
                buffer: request.buffer,
                status: IoStatus::Success,
            };
            self.done.push_back(completion);
            Ok(())
        }

        async fn next_completion(&mut self) -> Result<IoCompletion, Self::Error> {
            self.done.pop_front().ok_or_else(|| std::io::Error::other("nothing in flight"))
        }
    }

    struct InstantConnector;

    impl Connector for InstantConnector {
        type Queue = InstantQueue;
        type Error = std::io::Error;

        async fn connect(
            &mut self,
            queue_count: u16,
            _depth: u16,
        ) -> Result<Vec<InstantQueue>, Self::Error> {
            Ok((0..queue_count)
                .map(|_| InstantQueue { data: vec![0; 1 << 20], done: VecDeque::new() })
                .collect())
        }
    }

    #[test]
    fn the_progress_line_keeps_up_with_queues_that_never_wait() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let config = BenchConfig {
                queue_count: 2,
                queue_depth: 4,
                progress: false,
                ..BenchConfig::default()
            };
            let mut session = Session::connect(&mut InstantConnector, &config, 4096).await.unwrap();
            session.style = ProgressStyle::Lines;
            let start = Instant::now();
            let source = OpSource::Random {
                workload: STANDARD_WORKLOADS[0],
                slot_count: 256,
                ramp_end: start,
                end: start + Duration::from_millis(2300),
            };
            let shared = PhaseShared {
                verifier: None,
                cursor: Cell::new(0),
                counters: PhaseCounters::default(),
            };
            let mut stats: Vec<QueueStats> = (0..2).map(|_| QueueStats::new()).collect();
            let plan = ProgressPlan::Timed {
                start,
                ramp_end: start,
                end: start + Duration::from_millis(2300),
            };
            session.phase(&mut stats, &source, &shared, "test", plan, None).await.unwrap();
            assert!(shared.counters.measured_ops.get() > 1000);
            let lines = shared.counters.progress_lines.get();
            assert!((2..=3).contains(&lines), "one line per second, got {lines}");
        });
    }

    /// The instant queues keep the bench's thread busy through the whole window: the process
    /// took CPU, and never more than the machine's CPUs can give per second.
    #[test]
    fn a_workload_reports_the_cpu_the_process_took_in_its_window() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let reports = runtime.block_on(async {
            let config = BenchConfig {
                workloads: vec![STANDARD_WORKLOADS[1]],
                queue_count: 2,
                queue_depth: 4,
                ramp: Duration::from_millis(300),
                runtime: Duration::from_millis(700),
                progress: false,
                ..BenchConfig::default()
            };
            run(&config, &mut InstantConnector).await.unwrap()
        });
        let cores = reports[0].process_cpu_cores.expect("getrusage works on Linux");
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        assert!(cores > 0.05 && cores <= cpus + 0.5, "{cores} cores on {cpus} CPUs");
        assert!(output::summary_line(&reports[0]).contains("CPU cores"));
    }

    #[test]
    fn options_are_bounded() {
        let check = |config: BenchConfig, part: &str| {
            let message = config.validate().unwrap_err().to_string();
            assert!(message.contains(part), "{message}");
        };
        let base = BenchConfig::default();
        assert!(base.validate().is_ok());
        check(BenchConfig { workloads: Vec::new(), ..base.clone() }, "workloads");
        check(BenchConfig { queue_count: 0, ..base.clone() }, "--queues");
        check(BenchConfig { queue_depth: 1025, ..base.clone() }, "--iodepth");
        check(BenchConfig { runtime: Duration::ZERO, ..base.clone() }, "--runtime");
        check(BenchConfig { region_size_bytes: Some(5000), ..base.clone() }, "multiple of 4096");
        check(BenchConfig { queue_count: 64, queue_depth: 1024, ..base.clone() }, "lower them");
    }
}
