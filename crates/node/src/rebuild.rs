//! Drive replacement and rebuild in the node: restoring the redundancy of an erasure-coded node
//! after a drive is lost, in the background, paced, while hosts keep reading and writing.
//!
//! A rebuild starts when a drive is replaced (`ferrite drive replace`, `POST
//! /v1/drives/{index}/replace`, handled by `crate::nvme`), when a start finds a drive file
//! missing on a coded node ([`prepare_drive_files`] puts a new empty file in its place and the
//! [`Rebuilder`] replaces the drive on the first background tick), or when the engine resumes one
//! at open because a crash interrupted it. Whichever way, the [`Rebuilder`] on data-path thread 0
//! sees `LogEngine::rebuild_progress` and calls `LogHandle::rebuild_step` every background tick
//! until the engine reports the drive whole.
//!
//! Pacing: a tick writes at most what `--rebuild-mb-per-s` allows for one tick (0: no limit),
//! in at most [`REBUILD_STEPS_PER_TICK_MAX`] engine steps of at most [`REBUILD_STEP_BYTES_MAX`],
//! and yields to the thread's other tasks between steps, so host I/O on thread 0 keeps going.
//! Steps over segments that need nothing (free ones) write nothing and cost no budget.
//!
//! The rebuild yields to hosts as the scrub does, but less: while hosts keep the node busy
//! ([`crate::activity`]: 1 MiB/s or more of host I/O, until a quiet second) it writes at a
//! [`REBUILD_BUSY_DIVISOR`]th of its rate, at least [`REBUILD_BUSY_MB_PER_S_MIN`] (and at most
//! the rate itself; no limit stays no limit), so the node's redundancy still comes back under
//! steady load while the hosts keep most of the drives. `ferrite node show` says when it is
//! slowed.
//!
//! The rebuild's state is shared with the control plane through [`RebuildStatus`]: when the
//! current rebuild started and how the last one ended. The engine keeps the progress itself.

use crate::activity::HostActivity;
use crate::data_plane::{DataPlaneError, DriveSet, RebuildEnd, RebuildReport};
use engine::log::{LogError, LogHandle, RebuildProgress};
use engine::Drive;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// `--rebuild-mb-per-s` when none is given: most of one drive's write bandwidth, so the node's
/// redundancy comes back within minutes while hosts keep a share.
pub const DEFAULT_REBUILD_MB_PER_S: u64 = 256;
/// The highest `--rebuild-mb-per-s` accepted.
pub const REBUILD_MB_PER_S_MAX: u64 = 65_536;
/// While hosts are busy the rebuild writes at its rate divided by this.
pub const REBUILD_BUSY_DIVISOR: u64 = 4;
/// The least a rebuild writes per second while hosts are busy, in MiB (unless its rate is lower).
pub const REBUILD_BUSY_MB_PER_S_MIN: u64 = 16;
/// Engine rebuild steps one background tick takes at most.
pub const REBUILD_STEPS_PER_TICK_MAX: u32 = 64;
/// The budget of one engine step: the engine restores at most 256 stripe runs per step anyway;
/// this bounds what one step may take of a tick's budget.
pub const REBUILD_STEP_BYTES_MAX: u64 = 4 << 20;
/// Drives waiting to be replaced at start (each a missing drive file); at most every drive.
const PENDING_REPLACEMENTS_MAX: usize = crate::config::DRIVE_COUNT_MAX as usize;
/// Progress is logged each time the share of segments examined passes another step of this
/// many percent.
const PROGRESS_LOG_PERCENT: u32 = 10;

const BYTES_PER_MIB: u64 = 1 << 20;

/// The rebuild's rate while hosts keep the node busy: a [`REBUILD_BUSY_DIVISOR`]th of
/// `rate_mb_per_s`, at least [`REBUILD_BUSY_MB_PER_S_MIN`] and at most the rate itself (0, no
/// limit, stays no limit).
pub fn busy_rate_mb_per_s(rate_mb_per_s: u64) -> u64 {
    if rate_mb_per_s == 0 {
        return 0;
    }
    (rate_mb_per_s / REBUILD_BUSY_DIVISOR).max(REBUILD_BUSY_MB_PER_S_MIN).min(rate_mb_per_s)
}

/// Bytes one tick of `tick` may write at `rate_mb_per_s` (0: no limit, `u64::MAX`).
pub fn bytes_per_tick(rate_mb_per_s: u64, tick: Duration) -> u64 {
    if rate_mb_per_s == 0 {
        return u64::MAX;
    }
    let tick_ms = u64::try_from(tick.as_millis()).unwrap_or(u64::MAX);
    rate_mb_per_s.saturating_mul(BYTES_PER_MIB).saturating_mul(tick_ms).div_ceil(1000).max(1)
}

/// The rebuilds as the control plane reads them: written by the [`Rebuilder`] on thread 0 once
/// per tick at most, read by API requests.
#[derive(Debug)]
pub struct RebuildStatus {
    rate_mb_per_s: u64,
    /// Whether the rebuild writes at its busy rate now, hosts keeping the node busy.
    slowed: AtomicBool,
    /// Bytes every rebuild of this run wrote (a counter for the metrics).
    bytes_written_total: AtomicU64,
    state: Mutex<StatusState>,
}

#[derive(Debug, Default)]
struct StatusState {
    /// The drive being rebuilt and when its rebuild started (or was first seen).
    running: Option<(u16, Instant)>,
    /// Why the last step of the current rebuild failed, while it retries.
    stalled: Option<String>,
    last: Option<RebuildEnd>,
}

impl RebuildStatus {
    pub fn new(rate_mb_per_s: u64) -> Self {
        assert!(rate_mb_per_s <= REBUILD_MB_PER_S_MAX, "the rebuild rate is validated");
        Self {
            rate_mb_per_s,
            slowed: AtomicBool::new(false),
            bytes_written_total: AtomicU64::new(0),
            state: Mutex::new(StatusState::default()),
        }
    }

    pub fn rate_mb_per_s(&self) -> u64 {
        self.rate_mb_per_s
    }

    /// The most a rebuild writes per second while hosts keep the node busy, in MiB (0: no
    /// limit).
    pub fn busy_rate_mb_per_s(&self) -> u64 {
        busy_rate_mb_per_s(self.rate_mb_per_s)
    }

    /// Whether the rebuild in progress writes at its busy rate now (never when that is its rate).
    pub fn slowed(&self) -> bool {
        self.slowed.load(Ordering::Relaxed)
    }

    pub fn bytes_written_total(&self) -> u64 {
        self.bytes_written_total.load(Ordering::Relaxed)
    }

    /// How the last rebuild of this run ended.
    pub fn last(&self) -> Option<RebuildEnd> {
        self.lock().last.clone()
    }

    /// The rebuild in progress as reported, from the engine's `progress`, at `now`.
    pub fn report(&self, progress: Option<RebuildProgress>, now: Instant) -> Option<RebuildReport> {
        let progress = progress?;
        let state = self.lock();
        let started = match state.running {
            Some((drive, started)) if drive == progress.drive => Some(started),
            _ => None,
        };
        let stalled = state.stalled.clone();
        drop(state);
        let elapsed =
            started.map_or(0.0, |started| now.saturating_duration_since(started).as_secs_f64());
        Some(RebuildReport {
            drive: progress.drive,
            segments_done: progress.segments_done,
            segments_total: progress.segments_total,
            bytes_written: progress.bytes_written,
            elapsed_seconds: elapsed,
            stalled,
            slowed_for_hosts: self.slowed(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StatusState> {
        // Plain values; a panicking holder cannot leave them half written.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The rebuild under way, as the [`Rebuilder`] follows it.
struct Current {
    drive: u16,
    started: Instant,
    /// The engine's bytes written for this rebuild at the last step.
    bytes_seen: u64,
    /// The last multiple of [`PROGRESS_LOG_PERCENT`] logged.
    logged_percent: u32,
    /// Whether a step's failure was logged (once per rebuild).
    stall_logged: bool,
}

/// Drives rebuilds on data-path thread 0: starts the replacements a start left pending, and
/// steps the engine's rebuild at the configured pace. Lives in the background task.
pub struct Rebuilder {
    status: std::sync::Arc<RebuildStatus>,
    bytes_per_tick: u64,
    /// A tick's share while hosts keep the node busy.
    busy_bytes_per_tick: u64,
    /// Whether hosts keep the node busy.
    hosts: HostActivity,
    /// Drives to replace as soon as no rebuild runs (missing drive files found at start).
    pending: VecDeque<u16>,
    current: Option<Current>,
}

impl Rebuilder {
    /// A rebuilder reporting to `status`, ticked every `tick`, that first replaces the drives
    /// in `pending`, one at a time.
    pub fn new(status: std::sync::Arc<RebuildStatus>, tick: Duration, pending: Vec<u16>) -> Self {
        assert!(pending.len() <= PENDING_REPLACEMENTS_MAX, "more pending drives than drives");
        let bytes_per_tick = bytes_per_tick(status.rate_mb_per_s(), tick);
        let busy_bytes_per_tick = self::bytes_per_tick(status.busy_rate_mb_per_s(), tick);
        let hosts = HostActivity::new(tick);
        Self {
            status,
            bytes_per_tick,
            busy_bytes_per_tick,
            hosts,
            pending: pending.into(),
            current: None,
        }
    }

    /// One tick's share of the rebuild at time `now`. `open` opens this thread's handle of a
    /// drive (for pending replacements).
    pub async fn tick<D: Drive>(
        &mut self,
        store: &LogHandle<D>,
        open: &dyn Fn(u16) -> Result<D, String>,
        now: Instant,
    ) {
        // Sampled every tick, rebuilding or not, so a rebuild that starts knows how busy hosts
        // are.
        let busy = self.hosts.busy(store.engine().host_io_bytes(), now);
        let progress = store.engine().rebuild_progress();
        match (&self.current, progress) {
            (Some(current), Some(progress)) if current.drive == progress.drive => {}
            (_, Some(progress)) => self.begin(progress, now),
            (_, None) => {
                self.current = None;
                self.status.slowed.store(false, Ordering::Relaxed);
                if !self.start_pending(store, open).await {
                    return;
                }
                match store.engine().rebuild_progress() {
                    Some(progress) => self.begin(progress, now),
                    None => return,
                }
            }
        }
        let Some(mut current) = self.current.take() else { return };
        // Slowed only where the busy share is smaller (a low rate is its own busy rate).
        let slowed = busy && self.busy_bytes_per_tick < self.bytes_per_tick;
        self.status.slowed.store(slowed, Ordering::Relaxed);
        let mut budget = if slowed { self.busy_bytes_per_tick } else { self.bytes_per_tick };
        for step in 0..REBUILD_STEPS_PER_TICK_MAX {
            if step > 0 {
                // Host I/O on this thread gets its turn between steps.
                tokio::task::yield_now().await;
            }
            match store.rebuild_step(budget.min(REBUILD_STEP_BYTES_MAX)).await {
                Ok(None) => return,
                Ok(Some(progress)) => {
                    let written = progress.bytes_written.saturating_sub(current.bytes_seen);
                    current.bytes_seen = progress.bytes_written;
                    self.status.bytes_written_total.fetch_add(written, Ordering::Relaxed);
                    budget = budget.saturating_sub(written);
                    if progress.finished {
                        self.finish(&current, &progress, now);
                        return;
                    }
                    log_progress(&mut current, &progress);
                    if budget == 0 {
                        break;
                    }
                }
                Err(error) => {
                    if store.engine().latches().is_failed(current.drive) {
                        // The new drive failed: the engine ends the rebuild at its next step
                        // (which only reports that).
                        let _ = store.rebuild_step(0).await;
                        self.fail(&current, &error, now);
                        return;
                    }
                    // Something else could not be read: the rebuild goes on from the same
                    // place next tick.
                    if !current.stall_logged {
                        current.stall_logged = true;
                        tracing::error!(
                            drive = current.drive,
                            %error,
                            "the rebuild of drive {} is stalled; it retries every tick",
                            current.drive
                        );
                    }
                    self.status.lock().stalled = Some(error.to_string());
                    break;
                }
            }
        }
        self.current = Some(current);
    }

    /// Starts following the engine's rebuild of `progress.drive`.
    fn begin(&mut self, progress: RebuildProgress, now: Instant) {
        tracing::info!(
            drive = progress.drive,
            segments = progress.segments_total,
            rate_mb_per_s = self.status.rate_mb_per_s(),
            busy_rate_mb_per_s = self.status.busy_rate_mb_per_s(),
            "rebuilding drive {} from the other drives",
            progress.drive
        );
        let mut state = self.status.lock();
        state.running = Some((progress.drive, now));
        state.stalled = None;
        drop(state);
        self.current = Some(Current {
            drive: progress.drive,
            started: now,
            bytes_seen: progress.bytes_written,
            logged_percent: 0,
            stall_logged: false,
        });
    }

    /// Replaces the next pending drive; whether a rebuild started.
    async fn start_pending<D: Drive>(
        &mut self,
        store: &LogHandle<D>,
        open: &dyn Fn(u16) -> Result<D, String>,
    ) -> bool {
        let Some(drive) = self.pending.pop_front() else { return false };
        let new = match open(drive) {
            Ok(new) => new,
            Err(error) => {
                tracing::error!(
                    drive,
                    %error,
                    "cannot open the new drive {drive} to rebuild it; replace it with \
                     `ferrite drive replace {drive}`"
                );
                return false;
            }
        };
        match store.begin_replace(drive, new).await {
            Ok(()) => true,
            Err(error) => {
                tracing::error!(
                    drive,
                    %error,
                    "cannot start rebuilding drive {drive}; it stays failed: replace it with \
                     `ferrite drive replace {drive}` once the reason is dealt with"
                );
                false
            }
        }
    }

    fn finish(&mut self, current: &Current, progress: &RebuildProgress, now: Instant) {
        self.status.slowed.store(false, Ordering::Relaxed);
        let seconds = now.saturating_duration_since(current.started).as_secs_f64();
        let mib = progress.bytes_written as f64 / BYTES_PER_MIB as f64;
        let mib_per_s = if seconds > 0.0 { mib / seconds } else { 0.0 };
        tracing::info!(
            drive = progress.drive,
            mib_written = format!("{mib:.1}"),
            seconds = format!("{seconds:.1}"),
            mib_per_s = format!("{mib_per_s:.1}"),
            "drive {} is rebuilt: the node's redundancy is whole again",
            progress.drive
        );
        let mut state = self.status.lock();
        state.running = None;
        state.stalled = None;
        state.last = Some(RebuildEnd {
            drive: progress.drive,
            finished: true,
            error: None,
            bytes_written: progress.bytes_written,
            seconds,
        });
    }

    fn fail(&mut self, current: &Current, error: &LogError, now: Instant) {
        self.status.slowed.store(false, Ordering::Relaxed);
        let seconds = now.saturating_duration_since(current.started).as_secs_f64();
        tracing::error!(
            drive = current.drive,
            %error,
            "the rebuild of drive {} failed; the drive is latched failed again: check it, then \
             replace it with `ferrite drive replace {}`",
            current.drive,
            current.drive
        );
        let mut state = self.status.lock();
        state.running = None;
        state.stalled = None;
        state.last = Some(RebuildEnd {
            drive: current.drive,
            finished: false,
            error: Some(error.to_string()),
            bytes_written: current.bytes_seen,
            seconds,
        });
    }
}

/// Logs the rebuild's progress each time it passes another [`PROGRESS_LOG_PERCENT`].
fn log_progress(current: &mut Current, progress: &RebuildProgress) {
    if progress.segments_total == 0 {
        return;
    }
    let percent =
        u32::try_from(u64::from(progress.segments_done) * 100 / u64::from(progress.segments_total))
            .unwrap_or(100);
    let step = percent / PROGRESS_LOG_PERCENT * PROGRESS_LOG_PERCENT;
    if step > current.logged_percent && step < 100 {
        current.logged_percent = step;
        tracing::info!(
            drive = progress.drive,
            segments_done = progress.segments_done,
            segments_total = progress.segments_total,
            mib_written = progress.bytes_written / BYTES_PER_MIB,
            "rebuilding drive {}: {step}% of the log examined",
            progress.drive
        );
    }
}

/// At start, before the drives are opened: the drive files of a node with parity that need a
/// new drive. A missing file gets a new empty one in its place (a drive superblock and nothing
/// else, so the engine finds no log on it and opens degraded); a file whose log was never
/// written (a replacement the node stopped before rebuilding) is kept. Both are returned, for
/// the [`Rebuilder`] to replace and rebuild.
///
/// Without parity, or when more drives are missing than the parity covers, nothing is created:
/// opening the drives then fails naming the missing one. External drives are
/// [`prepare_external_drives`]' to check.
pub fn prepare_drive_files(drives: &DriveSet) -> Result<Vec<u16>, DataPlaneError> {
    if !drives.external.is_empty() {
        return Ok(Vec::new());
    }
    let mut missing = Vec::new();
    let mut blank = Vec::new();
    let mut scheme = None;
    for index in 0..drives.count {
        let path = io::drive_path(&drives.dir, index);
        match std::fs::metadata(&path) {
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                missing.push(index);
                continue;
            }
            // Opening the drives reports it.
            Err(_) => continue,
        }
        match io::read_log_superblock(&path) {
            Ok(io::LogSuperblockFound::Valid(superblock)) => {
                scheme.get_or_insert(superblock.geometry.scheme());
            }
            Ok(io::LogSuperblockFound::Blank) => blank.push(index),
            // The engine judges (and reports) a damaged log superblock.
            Ok(io::LogSuperblockFound::Invalid(_)) | Err(_) => {}
        }
    }
    if missing.is_empty() && blank.is_empty() {
        return Ok(Vec::new());
    }
    let Some(scheme) = scheme.filter(|scheme| scheme.parity_shards() > 0) else {
        return Ok(Vec::new());
    };
    let lost = missing.len() + blank.len();
    if lost > usize::from(scheme.parity_shards()) {
        let mut all: Vec<u16> = missing.iter().chain(&blank).copied().collect();
        all.sort_unstable();
        return Err(DataPlaneError::failed(format!(
            "drives {all:?} of {} are missing or hold no log, but erasure coding {scheme} \
             survives the loss of {} drive(s): restore the drive files",
            drives.dir.display(),
            scheme.parity_shards()
        )));
    }
    for &index in &missing {
        io::replace_drive_file(
            &drives.dir,
            engine::NodeUuid(drives.node_uuid),
            index,
            drives.count,
            drives.size_bytes,
        )
        .map_err(DataPlaneError::failed)?;
        tracing::warn!(
            drive = index,
            "drive {index} was missing: a new empty file takes its place; rebuilding"
        );
    }
    for &index in &blank {
        tracing::warn!(
            drive = index,
            "drive {index} holds no log (a replacement whose rebuild had not begun); rebuilding"
        );
    }
    let mut replacements: Vec<u16> = missing.into_iter().chain(blank).collect();
    replacements.sort_unstable();
    Ok(replacements)
}

/// The external drives (`--drive`) a start found, by index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalDrives {
    /// Each drive's path; empty for a drive none of the paths holds (see [`missing_drive_path`]).
    pub paths: Vec<std::path::PathBuf>,
    /// Drives to rebuild in place: whose log was never written (a replacement the node stopped
    /// before rebuilding), or that come back after the node ran without them.
    pub replacements: Vec<u16>,
}

/// The path a drive none of the `--drive` paths held at start has until it is replaced.
pub fn missing_drive_path() -> std::path::PathBuf {
    std::path::PathBuf::new()
}

/// The file in DATA-DIR that records that the node started without external drive `index`: a
/// drive that comes back later holds stale cells (every write since skipped it), so it is
/// rebuilt, never trusted.
fn missing_marker(drives: &DriveSet, index: u16) -> std::path::PathBuf {
    let data_dir = drives.dir.parent().unwrap_or(&drives.dir);
    data_dir.join(format!("drive-{index:03}.missing"))
}

/// Writes the marker of a missing drive durably (the file, then its directory).
fn mark_missing(drives: &DriveSet, index: u16) -> Result<(), DataPlaneError> {
    let path = missing_marker(drives, index);
    let text = format!(
        "Drive {index} of this node was not among its --drive paths at a start, and the node \
         ran without it. If it comes back, its contents are stale: the node rebuilds it. \
         `ferrite drive replace {index} --path NEW` puts a new drive in its place and removes \
         this file.\n"
    );
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&path)?;
        std::io::Write::write_all(&mut file, text.as_bytes())?;
        file.sync_all()?;
        std::fs::File::open(path.parent().unwrap_or(std::path::Path::new(".")))?.sync_all()
    };
    write().map_err(|error| {
        DataPlaneError::failed(format!(
            "cannot record that drive {index} is missing in {}: {error}",
            path.display()
        ))
    })
}

/// Forgets that drive `index` was missing (it was replaced, or is being rebuilt in place).
pub fn forget_missing(drives: &DriveSet, index: u16) {
    let path = missing_marker(drives, index);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            tracing::warn!(drive = index, %error, path = %path.display(), "cannot remove the record of a missing drive")
        }
    }
}

/// At start, before the drives are opened: finds each external drive by the index in its
/// superblock. On a node with parity, a drive none of the paths holds is left out (the engine
/// opens without it, latched failed, and serves its data from parity) as long as the parity
/// covers every drive lost or to be rebuilt, and that is recorded in DATA-DIR, so that if the
/// drive comes back at a later start its stale contents are rebuilt (its log superblock is
/// cleared first, so the engine never reads them). Without parity, or with more drives lost
/// than it covers, a missing drive is an error naming it.
pub fn prepare_external_drives(drives: &DriveSet) -> Result<ExternalDrives, DataPlaneError> {
    let found = io::open_external_drives_found(
        &drives.external,
        engine::NodeUuid(drives.node_uuid),
        drives.count,
    )
    .map_err(DataPlaneError::failed)?;
    let mut missing = Vec::new();
    let mut blank = Vec::new();
    let mut returning = Vec::new();
    let mut scheme = None;
    for (index, slot) in (0u16..).zip(&found) {
        let Some(info) = slot else {
            missing.push(index);
            continue;
        };
        match io::read_log_superblock(&info.path) {
            Ok(io::LogSuperblockFound::Valid(superblock)) => {
                scheme.get_or_insert(superblock.geometry.scheme());
                if missing_marker(drives, index).exists() {
                    returning.push(index);
                }
            }
            Ok(io::LogSuperblockFound::Blank) => blank.push(index),
            // The engine judges (and reports) a damaged log superblock.
            Ok(io::LogSuperblockFound::Invalid(_)) | Err(_) => {}
        }
    }
    let parity = scheme.map_or(0, |scheme| usize::from(scheme.parity_shards()));
    let lost = missing.len() + blank.len() + returning.len();
    if let Some(&first) = missing.first() {
        if parity == 0 {
            return Err(DataPlaneError::failed(io::DriveSetupError::DriveIndexMissing {
                index: first,
                count: drives.count,
            }));
        }
        if lost > parity {
            let scheme = scheme.map_or_else(String::new, |scheme| scheme.to_string());
            return Err(DataPlaneError::failed(format!(
                "drives {missing:?} of this node's {} are not among the --drive paths, and \
                 drives {:?} must be rebuilt, but erasure coding {scheme} survives the loss of \
                 {parity} drive(s): pass every drive of the node with --drive (in any order)",
                drives.count,
                blank.iter().chain(&returning).collect::<Vec<_>>()
            )));
        }
    }
    if !returning.is_empty() && lost > parity {
        return Err(DataPlaneError::failed(format!(
            "drives {returning:?} come back after the node ran without them, so their contents \
             are stale and must be rebuilt, but with drives {:?} lost as well that is more \
             than the {parity} drive(s) the erasure coding covers: pass every drive of the node \
             with --drive",
            missing.iter().chain(&blank).collect::<Vec<_>>()
        )));
    }
    for &index in &missing {
        mark_missing(drives, index)?;
        tracing::warn!(
            drive = index,
            "drive {index} is not among the --drive paths: the node runs without it, serving \
             its data from parity; replace it with `ferrite drive replace {index} --path NEW`"
        );
    }
    for &index in &returning {
        let Some(info) = &found[usize::from(index)] else { continue };
        io::blank_log_superblock(&info.path).map_err(DataPlaneError::failed)?;
        forget_missing(drives, index);
        tracing::warn!(
            drive = index,
            path = %info.path.display(),
            "drive {index} is back after the node ran without it: its contents are stale; \
             rebuilding it"
        );
    }
    let paths = found
        .into_iter()
        .map(|slot| slot.map_or_else(missing_drive_path, |info| info.path))
        .collect();
    let mut replacements: Vec<u16> = blank.into_iter().chain(returning).collect();
    replacements.sort_unstable();
    Ok(ExternalDrives { paths, replacements })
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::erasure::ErasureScheme;
    use engine::format::{NodeUuid, HEADER_REGION_BYTES};
    use engine::log::format::LOG_HEADER_BYTES;
    use engine::log::{LogConfig, LogEngine};
    use engine::testing::{block_matches, block_on, fill_block, SimDrive};
    use engine::{DriveLatches, VolumeId, VolumeMap, Volumes};
    use std::sync::Arc;
    use types::AlignedBuf;

    const BLOCK: u64 = types::BLOCK_SIZE_BYTES as u64;
    const DRIVES: u16 = 3;
    const SEGMENTS: u64 = 24;
    const UNIT_BYTES: u64 = 256 << 10;
    const VOLUME: VolumeId = VolumeId(1);
    const TICK: Duration = Duration::from_millis(50);
    const BLOCKS: u64 = 512;

    fn config() -> LogConfig {
        LogConfig {
            unit_bytes: UNIT_BYTES,
            handles_max: 2,
            checkpoint_interval_segments: 4,
            erasure: ErasureScheme::new(2, 1).unwrap(),
            ..LogConfig::new(NodeUuid([0x7e; 16]))
        }
    }

    fn new_drive(index: u16) -> SimDrive {
        SimDrive::new(index, HEADER_REGION_BYTES + LOG_HEADER_BYTES + SEGMENTS * UNIT_BYTES, 9, 1)
    }

    struct Fixture {
        engine: Arc<LogEngine>,
        handle: LogHandle<SimDrive>,
        map: Arc<VolumeMap>,
    }

    impl Fixture {
        /// A 2+1 engine over three simulated drives with `BLOCKS` blocks written.
        fn written() -> Self {
            let drives: Vec<SimDrive> = (0..DRIVES).map(new_drive).collect();
            block_on(LogEngine::format(&drives, &config())).unwrap();
            let latches = Arc::new(DriveLatches::new(DRIVES));
            let (engine, handle, _) = block_on(LogEngine::open(drives, config(), latches)).unwrap();
            let volumes = Volumes::new();
            volumes.publish(volumes.reserve_create(VOLUME, 4096 * BLOCK).unwrap());
            let map = volumes.mapping(VOLUME).unwrap();
            let fixture = Self { engine, handle, map };
            fixture.write(0, BLOCKS);
            fixture
        }

        /// Writes blocks `first..first + count` (a multiple of 32) with generation 5.
        fn write(&self, first: u64, count: u64) {
            for first in (first..first + count).step_by(32) {
                let mut buf = AlignedBuf::new((32 * BLOCK) as usize);
                for (number, block) in (first..).zip(buf.chunks_mut(BLOCK as usize)) {
                    fill_block(block, VOLUME, number, 5);
                }
                block_on(self.handle.write_blocks(&self.map, first * BLOCK, &buf)).unwrap();
            }
        }

        /// A host reads `blocks` blocks.
        fn host_read(&self, blocks: u64) {
            let buf = AlignedBuf::new((blocks * BLOCK) as usize);
            let (result, _) = block_on(self.handle.read_blocks(&self.map, 0, buf));
            result.unwrap();
        }

        fn all_read_back(&self) -> bool {
            let buf = AlignedBuf::new((BLOCKS * BLOCK) as usize);
            let (result, buf) = block_on(self.handle.read_blocks(&self.map, 0, buf));
            if result.is_err() {
                return false;
            }
            (0..BLOCKS)
                .zip(buf.chunks(BLOCK as usize))
                .all(|(number, block)| block_matches(block, VOLUME, number, 5))
        }
    }

    fn no_open(_drive: u16) -> Result<SimDrive, String> {
        Err("no drive to open".to_owned())
    }

    #[test]
    fn rates_become_bytes_per_tick() {
        assert_eq!(bytes_per_tick(0, TICK), u64::MAX, "0 sets no limit");
        assert_eq!(bytes_per_tick(1, TICK), 52_429);
        assert_eq!(bytes_per_tick(DEFAULT_REBUILD_MB_PER_S, TICK), 13_421_773);
        assert!(bytes_per_tick(REBUILD_MB_PER_S_MAX, TICK) < u64::MAX);
    }

    #[test]
    fn a_replaced_drive_is_rebuilt_at_the_pace_asked() {
        let fixture = Fixture::written();
        fixture.engine.latches().latch(1);
        assert!(fixture.all_read_back(), "reads rebuild the failed drive's cells");
        block_on(fixture.handle.begin_replace(1, new_drive(1))).unwrap();

        // 1 MiB/s: 52 KiB per tick.
        let status = Arc::new(RebuildStatus::new(1));
        let mut rebuilder = Rebuilder::new(Arc::clone(&status), TICK, Vec::new());
        let start = Instant::now();
        let mut now = start;
        let mut ticks = 0;
        while fixture.engine.rebuild_progress().is_some() {
            let before = status.bytes_written_total();
            block_on(rebuilder.tick(&fixture.handle, &no_open, now));
            let written = status.bytes_written_total() - before;
            // A step restores at least one stripe run, so a tick may go past its share by one.
            assert!(written <= 52_429 + 256 * BLOCK, "tick wrote {written} bytes");
            if let Some(report) = status.report(fixture.engine.rebuild_progress(), now) {
                assert_eq!(report.drive, 1);
                assert!(report.segments_done <= report.segments_total);
            }
            ticks += 1;
            assert!(ticks < 10_000, "the rebuild never finished");
            now += TICK;
        }
        let last = status.last().expect("the rebuild's end is reported");
        assert!(last.finished && last.error.is_none(), "{last:?}");
        assert_eq!(last.drive, 1);
        assert!(last.bytes_written > 0);
        assert_eq!(status.bytes_written_total(), last.bytes_written);
        assert!(ticks > 1, "paced over several ticks");
        assert!(!fixture.engine.latches().is_rebuilding(1));
        assert!(fixture.engine.latches().failed_drives().is_empty());
        // The rebuilt drive carries its share: losing another drive loses nothing.
        fixture.engine.latches().latch(2);
        assert!(fixture.all_read_back(), "data survives a second loss after the rebuild");
    }

    #[test]
    fn busy_rates_are_a_quarter_at_least_16_mib() {
        assert_eq!(busy_rate_mb_per_s(0), 0, "no limit stays no limit");
        assert_eq!(busy_rate_mb_per_s(4), 4);
        assert_eq!(busy_rate_mb_per_s(16), 16);
        assert_eq!(busy_rate_mb_per_s(40), 16);
        assert_eq!(busy_rate_mb_per_s(DEFAULT_REBUILD_MB_PER_S), 64);
        assert_eq!(busy_rate_mb_per_s(REBUILD_MB_PER_S_MAX), 16_384);
    }

    #[test]
    fn host_io_slows_the_rebuild_until_hosts_have_been_quiet() {
        let fixture = Fixture::written();
        fixture.write(BLOCKS, 512);
        fixture.engine.latches().latch(1);
        block_on(fixture.handle.begin_replace(1, new_drive(1))).unwrap();
        // Ticks of 10 ms, so that the small log takes several: at 64 MiB/s 671,089 bytes per
        // tick, at 16 MiB/s (167,773) while hosts are busy.
        let short_tick = Duration::from_millis(10);
        let status = Arc::new(RebuildStatus::new(64));
        assert_eq!(status.busy_rate_mb_per_s(), 16);
        let mut rebuilder = Rebuilder::new(Arc::clone(&status), short_tick, Vec::new());
        let tick = |rebuilder: &mut Rebuilder, now| {
            let before = status.bytes_written_total();
            block_on(rebuilder.tick(&fixture.handle, &no_open, now));
            status.bytes_written_total() - before
        };
        // A tick may go past its share by the last stripe a step restores (a block here).
        let busy_share = 167_773 + BLOCK;
        let start = Instant::now();
        let mut now = start;
        for _ in 0..3 {
            // 256 KiB read within a tick: 25 MiB/s, busy.
            fixture.host_read(64);
            let written = tick(&mut rebuilder, now);
            assert!(written > 0 && written <= busy_share, "a busy tick wrote {written} bytes");
            assert!(status.slowed());
            let report = status.report(fixture.engine.rebuild_progress(), now).unwrap();
            assert!(report.slowed_for_hosts);
            now += short_tick;
        }
        // Quiet, but not for a second yet: still the busy share.
        let written = tick(&mut rebuilder, now);
        assert!(written <= busy_share && status.slowed(), "{written}");
        // Quiet for a second: the full share.
        now = start + 2 * short_tick + Duration::from_millis(crate::activity::HOSTS_QUIET_MS);
        let written = tick(&mut rebuilder, now);
        assert!(written > busy_share, "a quiet tick wrote only {written} bytes");
        assert!(!status.slowed());
        let mut ticks = 0;
        while fixture.engine.rebuild_progress().is_some() {
            now += short_tick;
            fixture.host_read(64);
            tick(&mut rebuilder, now);
            ticks += 1;
            assert!(ticks < 10_000, "the rebuild never finished");
        }
        assert!(status.last().is_some_and(|last| last.finished));
        assert!(!status.slowed(), "a finished rebuild is not slowed");
        fixture.engine.latches().latch(2);
        assert!(fixture.all_read_back(), "data survives a second loss after the rebuild");
    }

    #[test]
    fn pending_replacements_start_one_at_a_time() {
        let fixture = Fixture::written();
        fixture.engine.latches().latch(0);
        let status = Arc::new(RebuildStatus::new(0));
        let mut rebuilder = Rebuilder::new(Arc::clone(&status), TICK, vec![0]);
        let opened = std::cell::Cell::new(0);
        let open = |drive: u16| {
            opened.set(opened.get() + 1);
            Ok(new_drive(drive))
        };
        let mut now = Instant::now();
        block_on(rebuilder.tick(&fixture.handle, &open, now));
        assert_eq!(opened.get(), 1);
        let mut ticks = 0;
        while fixture.engine.rebuild_progress().is_some() {
            now += TICK;
            block_on(rebuilder.tick(&fixture.handle, &open, now));
            ticks += 1;
            assert!(ticks < 1000, "the rebuild never finished");
        }
        assert_eq!(opened.get(), 1, "nothing else was pending");
        assert!(status.last().is_some_and(|last| last.finished));
        fixture.engine.latches().latch(1);
        assert!(fixture.all_read_back());
    }

    #[test]
    fn a_failed_rebuild_is_reported() {
        let fixture = Fixture::written();
        fixture.engine.latches().latch(2);
        let failing = new_drive(2);
        block_on(fixture.handle.begin_replace(2, failing.clone())).unwrap();
        failing.fail_all();
        let status = Arc::new(RebuildStatus::new(0));
        let mut rebuilder = Rebuilder::new(Arc::clone(&status), TICK, Vec::new());
        let mut now = Instant::now();
        for _ in 0..100 {
            if status.last().is_some() {
                break;
            }
            block_on(rebuilder.tick(&fixture.handle, &no_open, now));
            now += TICK;
        }
        let last = status.last().expect("the failure is reported");
        assert!(!last.finished);
        assert!(last.error.is_some_and(|error| error.contains("drive 2")));
        assert!(fixture.engine.rebuild_progress().is_none());
    }
}
