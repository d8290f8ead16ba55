//! The node's background scrub: runs the engine's scrub (`engine::log::scrub`) on data-path
//! thread 0, paced, so that damage on the drives is found while the data path is otherwise idle
//! rather than when a host happens to read the damaged block.
//!
//! Pacing: the background task calls [`Scrubber::tick`] every background tick; a tick verifies
//! at most the blocks `--scrub-mb-per-s` allows for one tick, in at most
//! [`SCRUB_STEPS_PER_TICK_MAX`] engine steps. The engine's scrub only reads and never takes a
//! handle's pipeline leadership, so host writes never wait for it; its reads share the drives
//! with host I/O at the configured rate and no more. A pass that finishes early waits: a pass
//! starts at most every [`SCRUB_PASS_INTERVAL_MIN_MS`], so a node holding little data does not
//! read it back over and over.
//!
//! The scrub yields to hosts, as Linux md's resync does (`sync_speed_min`/`sync_speed_max`):
//! while hosts keep the node busy ([`crate::activity`]: 1 MiB/s or more of host I/O, until a
//! quiet second), it reads at a [`SCRUB_BUSY_DIVISOR`]th of its rate (at least 1 MiB/s, so a
//! pass still ends under steady load). `ferrite node show` says when it is slowed.
//!
//! While any drive is latched failed the scrub pauses, until the drive is replaced (on a node
//! with erasure coding) or the node restarts: reads of the failed drive's blocks are rebuilt
//! from parity or fail anyway (and are reported as the drive's failure), so nothing scrub could
//! report would be news, and its reads would only slow the degraded node down.
//!
//! The scrub's state is shared with the control plane through [`ScrubStatus`] (a few atomics);
//! the counts and findings live in the engine (`LogStats::scrub_*`,
//! `LogEngine::scrub_findings`).

use crate::activity::HostActivity;
use engine::log::{LogHandle, ScrubCursor};
use engine::Drive;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// `--scrub-mb-per-s` when none is given: a modest share of one drive's bandwidth.
pub const DEFAULT_SCRUB_MB_PER_S: u64 = 32;
/// The highest `--scrub-mb-per-s` accepted.
pub const SCRUB_MB_PER_S_MAX: u64 = 4096;
/// Engine scrub steps one tick takes at most: they cover [`SCRUB_MB_PER_S_MAX`] at the
/// background tick of 50 ms (52,429 blocks, checked at compile time), with room for steps that
/// end early at the engine's bound on batch headers read per step.
pub const SCRUB_STEPS_PER_TICK_MAX: u32 = 16;
/// A scrub pass starts at most this often: a pass that completes sooner waits for the rest.
pub const SCRUB_PASS_INTERVAL_MIN_MS: u64 = 60_000;
/// While hosts are busy the scrub reads at its rate divided by this (at least 1 MiB/s).
pub const SCRUB_BUSY_DIVISOR: u64 = 16;

const BLOCKS_PER_MIB: u64 = (1 << 20) / types::BLOCK_SIZE_BYTES as u64;
/// The most blocks one engine scrub step verifies (the engine's `SCRUB_BLOCKS_PER_STEP_MAX`,
/// which it does not export).
const ENGINE_BLOCKS_PER_STEP_MAX: u64 = 4096;
// The fastest rate fits in the steps one background tick may take.
const _: () = assert!(
    SCRUB_MB_PER_S_MAX * BLOCKS_PER_MIB * crate::nvme::BACKGROUND_TICK_MS / 1000
        <= SCRUB_STEPS_PER_TICK_MAX as u64 * ENGINE_BLOCKS_PER_STEP_MAX
);

/// What the scrub is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScrubPhase {
    /// Not running: `--scrub-mb-per-s 0`, or the data path does not scrub.
    #[default]
    Off,
    /// A pass is under way.
    Running,
    /// A pass completed; the next starts when [`SCRUB_PASS_INTERVAL_MIN_MS`] is over.
    Waiting,
    /// A drive is latched failed: the scrub waits for its replacement or the node's restart.
    Paused,
}

impl ScrubPhase {
    const ALL: [ScrubPhase; 4] =
        [ScrubPhase::Off, ScrubPhase::Running, ScrubPhase::Waiting, ScrubPhase::Paused];

    /// The name the API and `ferrite node show` use.
    pub fn as_str(self) -> &'static str {
        match self {
            ScrubPhase::Off => api::SCRUB_STATE_OFF,
            ScrubPhase::Running => api::SCRUB_STATE_RUNNING,
            ScrubPhase::Waiting => api::SCRUB_STATE_WAITING,
            ScrubPhase::Paused => api::SCRUB_STATE_PAUSED,
        }
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(code: u8) -> Self {
        Self::ALL.into_iter().find(|phase| phase.code() == code).unwrap_or_default()
    }
}

/// The scrub's state as the control plane reads it: written by the [`Scrubber`] on thread 0,
/// read by API requests. Relaxed atomics: each value is a report, not a synchronisation point.
#[derive(Debug)]
pub struct ScrubStatus {
    rate_mb_per_s: u64,
    phase: AtomicU8,
    /// Whether the scrub reads at its busy rate now, hosts keeping the node busy.
    slowed: AtomicBool,
    /// The segment the current pass verifies, of `segments_total`.
    segment: AtomicU32,
    segments_total: AtomicU32,
}

impl ScrubStatus {
    /// The status of a scrub reading at most `rate_mb_per_s` MiB per second (0: off).
    pub fn new(rate_mb_per_s: u64) -> Self {
        assert!(rate_mb_per_s <= SCRUB_MB_PER_S_MAX, "the scrub rate is validated by the config");
        Self {
            rate_mb_per_s,
            phase: AtomicU8::new(ScrubPhase::Off.code()),
            slowed: AtomicBool::new(false),
            segment: AtomicU32::new(0),
            segments_total: AtomicU32::new(0),
        }
    }

    pub fn rate_mb_per_s(&self) -> u64 {
        self.rate_mb_per_s
    }

    /// The most the scrub reads per second while hosts keep the node busy, in MiB (0: off).
    pub fn busy_rate_mb_per_s(&self) -> u64 {
        busy_rate_mb_per_s(self.rate_mb_per_s)
    }

    /// Whether the scrub reads at its busy rate now.
    pub fn slowed(&self) -> bool {
        self.slowed.load(Ordering::Relaxed)
    }

    pub fn phase(&self) -> ScrubPhase {
        ScrubPhase::from_code(self.phase.load(Ordering::Relaxed))
    }

    /// How far the current pass is, 0 to 100 (100 while waiting for the next pass).
    pub fn pass_progress_percent(&self) -> f64 {
        if self.phase() == ScrubPhase::Waiting {
            return 100.0;
        }
        let total = self.segments_total.load(Ordering::Relaxed);
        if total == 0 {
            return 0.0;
        }
        let segment = self.segment.load(Ordering::Relaxed).min(total);
        f64::from(segment) * 100.0 / f64::from(total)
    }

    fn set_phase(&self, phase: ScrubPhase) {
        self.phase.store(phase.code(), Ordering::Relaxed);
    }
}

/// The scrub's rate while hosts keep the node busy: a [`SCRUB_BUSY_DIVISOR`]th of `rate_mb_per_s`,
/// at least 1 MiB/s and at most the rate itself (0 stays off).
pub fn busy_rate_mb_per_s(rate_mb_per_s: u64) -> u64 {
    (rate_mb_per_s / SCRUB_BUSY_DIVISOR).max(1).min(rate_mb_per_s)
}

/// Blocks one tick of `tick` may verify at `rate_mb_per_s` (at least one when not off).
pub fn blocks_per_tick(rate_mb_per_s: u64, tick: Duration) -> u32 {
    let tick_ms = u64::try_from(tick.as_millis()).unwrap_or(u64::MAX);
    let blocks =
        rate_mb_per_s.saturating_mul(BLOCKS_PER_MIB).saturating_mul(tick_ms).div_ceil(1000);
    u32::try_from(blocks).unwrap_or(u32::MAX)
}

/// The scrub of one node: its cursor, its pace and what it has logged. Lives in the background
/// task of data-path thread 0.
pub struct Scrubber {
    status: std::sync::Arc<ScrubStatus>,
    blocks_per_tick: u32,
    /// The share of a tick while hosts keep the node busy.
    busy_blocks_per_tick: u32,
    /// Whether hosts keep the node busy.
    hosts: HostActivity,
    cursor: ScrubCursor,
    /// When the current pass started (`None` before the first).
    pass_started: Option<Instant>,
    /// Set after a completed pass: the next one starts then.
    next_pass_at: Option<Instant>,
    /// Whether the pause for a failed drive was logged (once per pause).
    paused_logged: bool,
    /// The pass in which a read error was last logged (one line per pass at most).
    read_error_logged_pass: Option<u64>,
}

impl Scrubber {
    /// A scrubber that reports to `status`, ticked every `tick`, over a log of `segments_total`
    /// segments.
    pub fn new(status: std::sync::Arc<ScrubStatus>, tick: Duration, segments_total: u32) -> Self {
        let blocks_per_tick = blocks_per_tick(status.rate_mb_per_s(), tick);
        let busy_blocks_per_tick = self::blocks_per_tick(status.busy_rate_mb_per_s(), tick);
        status.segments_total.store(segments_total, Ordering::Relaxed);
        status.segment.store(0, Ordering::Relaxed);
        let phase = if blocks_per_tick == 0 { ScrubPhase::Off } else { ScrubPhase::Running };
        status.set_phase(phase);
        Self {
            status,
            blocks_per_tick,
            busy_blocks_per_tick,
            hosts: HostActivity::new(tick),
            cursor: ScrubCursor::new(),
            pass_started: None,
            next_pass_at: None,
            paused_logged: false,
            read_error_logged_pass: None,
        }
    }

    /// One tick's share of the scrub, at time `now`: at most the paced number of blocks, or the
    /// busy share while hosts keep the node busy.
    pub async fn tick<D: Drive>(&mut self, store: &LogHandle<D>, now: Instant) {
        if self.blocks_per_tick == 0 {
            return;
        }
        // Sampled every tick, reading or not, so a pass that resumes knows how busy hosts are.
        let busy = self.hosts.busy(store.engine().host_io_bytes(), now);
        self.status.slowed.store(false, Ordering::Relaxed);
        let failed = store.engine().latches().failed_drives();
        if !failed.is_empty() {
            if !self.paused_logged {
                self.paused_logged = true;
                tracing::warn!(
                    drives = ?failed,
                    "scrub paused while a drive is latched failed; it resumes once the drive is \
                     replaced (`ferrite drive replace`) or the node restarts"
                );
            }
            self.status.set_phase(ScrubPhase::Paused);
            return;
        }
        if self.paused_logged {
            self.paused_logged = false;
            tracing::info!("scrub resumed: no drive is latched failed");
        }
        if let Some(start_at) = self.next_pass_at {
            if now < start_at {
                self.status.set_phase(ScrubPhase::Waiting);
                return;
            }
            self.next_pass_at = None;
            self.pass_started = None;
        }
        let pass_started = *self.pass_started.get_or_insert(now);
        self.status.set_phase(ScrubPhase::Running);
        self.status.slowed.store(busy, Ordering::Relaxed);
        let mut blocks_left = if busy { self.busy_blocks_per_tick } else { self.blocks_per_tick };
        for _ in 0..SCRUB_STEPS_PER_TICK_MAX {
            let pass = self.cursor.passes_completed() + 1;
            let result = store.scrub_step(&mut self.cursor, blocks_left).await;
            self.status.segment.store(self.cursor.segment(), Ordering::Relaxed);
            let progress = match result {
                Ok(progress) => progress,
                Err(error) => {
                    // The cursor moved past what could not be read; the next tick goes on.
                    if self.read_error_logged_pass != Some(pass) {
                        self.read_error_logged_pass = Some(pass);
                        tracing::warn!(
                            pass,
                            %error,
                            "scrub could not read part of the log and skipped it"
                        );
                    }
                    return;
                }
            };
            if progress.blocks_damaged > 0
                || progress.chains_damaged > 0
                || progress.headers_damaged > 0
            {
                tracing::error!(
                    pass,
                    blocks = progress.blocks_damaged,
                    headers = progress.headers_damaged,
                    header_chains = progress.chains_damaged,
                    "scrub found damaged data on the drives; `ferrite node show` lists it"
                );
            }
            if progress.pass_completed {
                let interval = Duration::from_millis(SCRUB_PASS_INTERVAL_MIN_MS);
                self.next_pass_at = Some(pass_started + interval);
                tracing::info!(
                    pass,
                    seconds = now.saturating_duration_since(pass_started).as_secs_f64(),
                    "scrub pass completed"
                );
                if now < pass_started + interval {
                    self.status.set_phase(ScrubPhase::Waiting);
                }
                return;
            }
            let checked = progress.blocks_verified + progress.blocks_damaged;
            blocks_left = blocks_left.saturating_sub(checked);
            if blocks_left == 0 {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::format::{NodeUuid, HEADER_REGION_BYTES};
    use engine::log::format::LOG_HEADER_BYTES;
    use engine::log::{LogConfig, LogEngine, ScrubDamage};
    use engine::testing::{block_on, fill_block, SimDrive};
    use engine::{DriveLatches, VolumeId, VolumeMap, Volumes};
    use std::sync::Arc;
    use types::AlignedBuf;

    const BLOCK: u64 = types::BLOCK_SIZE_BYTES as u64;
    const DRIVES: u16 = 2;
    const SEGMENTS: u64 = 32;
    const VOLUME: VolumeId = VolumeId(1);
    const TICK: Duration = Duration::from_millis(50);

    fn config() -> LogConfig {
        LogConfig {
            unit_bytes: 64 << 10,
            handles_max: 1,
            checkpoint_interval_segments: 4,
            ..LogConfig::new(NodeUuid([0x5c; 16]))
        }
    }

    /// An engine over simulated drives with one volume of `blocks` blocks written, all in
    /// sealed segments (reopened after the writes, as a restarted node is).
    struct Fixture {
        drives: Vec<SimDrive>,
        engine: Arc<LogEngine>,
        handle: LogHandle<SimDrive>,
        map: Arc<VolumeMap>,
    }

    impl Fixture {
        fn written(blocks: u64) -> Self {
            let size_bytes =
                HEADER_REGION_BYTES + LOG_HEADER_BYTES + SEGMENTS * config().unit_bytes;
            let drives: Vec<SimDrive> =
                (0..DRIVES).map(|index| SimDrive::new(index, size_bytes, 7, 1)).collect();
            block_on(LogEngine::format(&drives, &config())).unwrap();
            let volumes = Volumes::new();
            volumes.publish(volumes.reserve_create(VOLUME, 1024 * BLOCK).unwrap());
            let map: Arc<VolumeMap> = volumes.mapping(VOLUME).unwrap();
            let (engine, handle) = Self::open(&drives);
            for first in (0..blocks).step_by(16) {
                let count = 16.min(blocks - first);
                let mut buf = AlignedBuf::new((count * BLOCK) as usize);
                for (number, block) in (first..).zip(buf.chunks_mut(BLOCK as usize)) {
                    fill_block(block, VOLUME, number, 3);
                }
                block_on(handle.write_blocks(&map, first * BLOCK, &buf)).unwrap();
            }
            drop(handle);
            drop(engine);
            let (engine, handle) = Self::open(&drives);
            Self { drives, engine, handle, map }
        }

        fn open(drives: &[SimDrive]) -> (Arc<LogEngine>, LogHandle<SimDrive>) {
            let latches = Arc::new(DriveLatches::new(DRIVES));
            let (engine, handle, _) =
                block_on(LogEngine::open(drives.to_vec(), config(), latches)).unwrap();
            (engine, handle)
        }

        fn scrubber(&self, rate_mb_per_s: u64) -> (Scrubber, Arc<ScrubStatus>) {
            let status = Arc::new(ScrubStatus::new(rate_mb_per_s));
            let segments = self.engine.geometry().segment_count;
            (Scrubber::new(Arc::clone(&status), TICK, segments), status)
        }

        fn verified(&self) -> u64 {
            self.engine.stats().scrub_blocks_verified
        }

        /// A host reads `blocks` blocks of the volume from its start.
        fn host_read(&self, blocks: u64) {
            let buf = AlignedBuf::new((blocks * BLOCK) as usize);
            let (result, _) = block_on(self.handle.read_blocks(&self.map, 0, buf));
            result.unwrap();
        }
    }

    #[test]
    fn busy_rates_are_a_sixteenth_at_least_one_mib() {
        assert_eq!(busy_rate_mb_per_s(0), 0);
        assert_eq!(busy_rate_mb_per_s(1), 1);
        assert_eq!(busy_rate_mb_per_s(8), 1);
        assert_eq!(busy_rate_mb_per_s(DEFAULT_SCRUB_MB_PER_S), 2);
        assert_eq!(busy_rate_mb_per_s(SCRUB_MB_PER_S_MAX), 256);
    }

    #[test]
    fn host_io_slows_the_scrub_until_hosts_have_been_quiet() {
        let fixture = Fixture::written(300);
        // 16 MiB/s: 205 blocks per tick of 50 ms; 1 MiB/s (13 blocks) while hosts are busy.
        let (mut scrubber, status) = fixture.scrubber(16);
        assert_eq!(status.busy_rate_mb_per_s(), 1);
        let start = Instant::now();
        // 256 KiB read within a tick: 5 MiB/s, busy.
        fixture.host_read(64);
        block_on(scrubber.tick(&fixture.handle, start));
        assert_eq!(fixture.verified(), 13, "a busy tick verifies the busy share");
        assert!(status.slowed());
        // Hosts quiet, but not for long enough yet.
        let mut now = start;
        for _ in 0..3 {
            now += TICK;
            block_on(scrubber.tick(&fixture.handle, now));
        }
        assert_eq!(fixture.verified(), 4 * 13);
        assert!(status.slowed());
        // A trickle of host I/O (4 KiB in a tick: 80 KiB/s) does not count as busy.
        now = start + Duration::from_millis(crate::activity::HOSTS_QUIET_MS);
        fixture.host_read(1);
        block_on(scrubber.tick(&fixture.handle, now));
        assert!(!status.slowed());
        assert_eq!(fixture.verified(), 4 * 13 + 205, "quiet hosts: the full rate again");
        // Busy again: slowed at once.
        fixture.host_read(64);
        now += TICK;
        block_on(scrubber.tick(&fixture.handle, now));
        assert!(status.slowed());
        assert_eq!(fixture.verified(), 4 * 13 + 205 + 13);
        assert_eq!(status.phase(), ScrubPhase::Running);
    }

    #[test]
    fn rates_become_blocks_per_tick() {
        let check = |mb_per_s, expect| assert_eq!(blocks_per_tick(mb_per_s, TICK), expect);
        check(0, 0);
        check(1, 13);
        check(32, 410);
        check(SCRUB_MB_PER_S_MAX, 52_429);
    }

    #[test]
    fn ticks_are_paced_and_passes_wait_for_their_interval() {
        let fixture = Fixture::written(300);
        // 1 MiB/s: 13 blocks per tick of 50 ms.
        let (mut scrubber, status) = fixture.scrubber(1);
        assert_eq!(status.phase(), ScrubPhase::Running);
        let start = Instant::now();
        let mut now = start;
        let mut ticks = 0;
        while fixture.engine.stats().scrub_passes == 0 {
            let before = fixture.verified();
            block_on(scrubber.tick(&fixture.handle, now));
            assert!(fixture.verified() - before <= 13, "a tick verifies at most its share");
            ticks += 1;
            assert!(ticks < 1000, "no pass completed");
            now += TICK;
        }
        assert_eq!(fixture.verified(), 300, "a pass verifies every live block once");
        assert!(ticks >= 300 / 13, "{ticks} ticks: faster than the rate allows");
        assert_eq!(status.phase(), ScrubPhase::Waiting);
        assert_eq!(status.pass_progress_percent(), 100.0);

        // Nothing more until the interval since the pass started is over.
        let next_pass = start + Duration::from_millis(SCRUB_PASS_INTERVAL_MIN_MS);
        block_on(scrubber.tick(&fixture.handle, next_pass - TICK));
        assert_eq!(fixture.verified(), 300);
        block_on(scrubber.tick(&fixture.handle, next_pass));
        assert_eq!(status.phase(), ScrubPhase::Running);
        assert_eq!(fixture.verified(), 313, "the second pass started");
        assert_eq!(fixture.engine.stats().scrub_errors, 0);
    }

    #[test]
    fn damage_is_found_and_failed_drives_pause_the_scrub() {
        let fixture = Fixture::written(64);
        // Damage block 5 of the volume behind the engine's back.
        let entry = fixture.engine.lookup(VOLUME.0, 5);
        let (location, _) = engine::log::index::unpack(entry).unwrap();
        let geometry = fixture.engine.geometry();
        let (segment, position) = geometry.split(location);
        let (drive, offset_bytes) = geometry.place(segment, position);
        let mut garbage = AlignedBuf::new(BLOCK as usize);
        garbage.fill(0xa5);
        let (result, _) =
            block_on(fixture.drives[usize::from(drive)].write_at(offset_bytes, garbage));
        result.unwrap();

        let (mut scrubber, status) = fixture.scrubber(SCRUB_MB_PER_S_MAX);
        block_on(scrubber.tick(&fixture.handle, Instant::now()));
        let stats = fixture.engine.stats();
        assert_eq!(
            (stats.scrub_passes, stats.scrub_errors, stats.scrub_blocks_verified),
            (1, 1, 63)
        );
        let findings = fixture.engine.scrub_findings();
        assert_eq!(findings.len(), 1);
        assert_eq!(findings[0].damage, ScrubDamage::Block { label: VOLUME.0, block: 5 });
        assert_eq!(findings[0].drive, drive);

        // A latched drive pauses the scrub; nothing is read.
        fixture.engine.latches().latch(1);
        let later = Instant::now() + Duration::from_millis(2 * SCRUB_PASS_INTERVAL_MIN_MS);
        block_on(scrubber.tick(&fixture.handle, later));
        assert_eq!(status.phase(), ScrubPhase::Paused);
        assert_eq!(fixture.engine.stats().scrub_blocks_verified, 63);
    }

    #[test]
    fn off_does_nothing() {
        let fixture = Fixture::written(16);
        let (mut scrubber, status) = fixture.scrubber(0);
        block_on(scrubber.tick(&fixture.handle, Instant::now()));
        assert_eq!(status.phase(), ScrubPhase::Off);
        assert_eq!(status.phase().as_str(), "off");
        assert_eq!(fixture.verified(), 0);
    }
}
