//! Whether hosts keep the node busy: what the background work on data-path thread 0 (the scrub,
//! a drive's rebuild) slows down for, as Linux md's resync does (`sync_speed_min`/`max`).
//!
//! Hosts are busy while they read and write through the node at [`HOSTS_BUSY_MB_PER_S`] or more
//! (the engine's host bytes, `LogEngine::host_io_bytes`, measured tick by tick; a replica's
//! replicated writes count), and stay so until they have been quiet for [`HOSTS_QUIET_MS`], so
//! that a host pausing between bursts does not get the background work at full rate in each
//! pause.

use std::time::{Duration, Instant};

/// Host I/O through the node (reads and writes, MiB per second over a tick) at or above which
/// hosts count as busy.
pub const HOSTS_BUSY_MB_PER_S: u64 = 1;
/// How long hosts must have been quiet before they no longer count as busy.
pub const HOSTS_QUIET_MS: u64 = 1_000;

/// Follows the engine's host I/O bytes from tick to tick.
#[derive(Debug)]
pub struct HostActivity {
    /// The background tick, the shortest time a host I/O rate is measured over.
    tick: Duration,
    /// The host bytes at the previous sample, and when that was (`None` before the first: the
    /// counts start with the engine, as the caller does).
    seen: Option<(u64, Instant)>,
    /// Until when hosts count as busy.
    busy_until: Option<Instant>,
}

impl HostActivity {
    /// Activity sampled every `tick`.
    pub fn new(tick: Duration) -> Self {
        Self { tick, seen: None, busy_until: None }
    }

    /// Whether hosts keep the node busy at `now`, given the engine's host I/O bytes then: busy
    /// if hosts moved [`HOSTS_BUSY_MB_PER_S`] or more since the previous sample (over at least
    /// one tick's time), or did within the last [`HOSTS_QUIET_MS`].
    pub fn busy(&mut self, host_bytes: u64, now: Instant) -> bool {
        let (seen_bytes, seen_at) = self.seen.unwrap_or((0, now));
        self.seen = Some((host_bytes, now));
        let moved = host_bytes.saturating_sub(seen_bytes);
        let over_ms = now.saturating_duration_since(seen_at).max(self.tick).as_millis();
        let busy_bytes = u128::from(HOSTS_BUSY_MB_PER_S << 20) * over_ms / 1000;
        if u128::from(moved) >= busy_bytes {
            self.busy_until = Some(now + Duration::from_millis(HOSTS_QUIET_MS));
        }
        self.busy_until.is_some_and(|until| now < until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(50);

    #[test]
    fn busy_from_a_mib_per_second_until_a_quiet_second() {
        let mut activity = HostActivity::new(TICK);
        let start = Instant::now();
        // The first sample counts from zero: 52 KiB over one tick is 1 MiB/s.
        assert!(activity.busy(52_429, start));
        // Quiet ticks: still busy for a second after the last busy one.
        let mut now = start;
        let mut bytes = 52_429;
        for _ in 0..19 {
            now += TICK;
            assert!(activity.busy(bytes, now));
        }
        now = start + Duration::from_millis(HOSTS_QUIET_MS);
        assert!(!activity.busy(bytes, now), "a quiet second ends it");
        // Under 1 MiB/s over a tick is not busy.
        bytes += 52_000;
        now += TICK;
        assert!(!activity.busy(bytes, now));
        // The rate is over the time since the previous sample, at least a tick: 100 KiB over
        // two ticks (1 MiB/s) is busy.
        bytes += 104_858;
        now += 2 * TICK;
        assert!(activity.busy(bytes, now));
    }
}
