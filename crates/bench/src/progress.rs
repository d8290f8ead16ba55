//! The live progress line on stderr while a phase runs, so a ten-second-per-workload run shows it
//! is alive and roughly how fast: rewritten in place on a terminal, one line per second when
//! stderr is a file or a pipe (logs stay readable).

use std::convert::Infallible;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use crate::engine::PhaseCounters;
use crate::output::{format_bytes, format_count};

const TERMINAL_PERIOD: Duration = Duration::from_millis(500);
const LINES_PERIOD: Duration = Duration::from_secs(1);

/// Where progress goes: nowhere, a terminal (rewritten line) or a log (one line per period).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProgressStyle {
    Off,
    Terminal,
    Lines,
}

impl ProgressStyle {
    pub(crate) fn detect(enabled: bool) -> ProgressStyle {
        match (enabled, std::io::stderr().is_terminal()) {
            (false, _) => ProgressStyle::Off,
            (true, true) => ProgressStyle::Terminal,
            (true, false) => ProgressStyle::Lines,
        }
    }

    /// Prints a finished line (a phase summary), first clearing a progress line in place.
    pub(crate) fn finish(self, line: &str) {
        match self {
            ProgressStyle::Off => {}
            ProgressStyle::Terminal => eprintln!("\r{line}\x1b[K"),
            ProgressStyle::Lines => eprintln!("{line}"),
        }
    }

    fn show(self, line: &str) {
        match self {
            ProgressStyle::Off => {}
            ProgressStyle::Terminal => eprint!("\r{line}\x1b[K"),
            ProgressStyle::Lines => eprintln!("{line}"),
        }
    }
}

/// What a phase's progress is measured against.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ProgressPlan {
    /// A workload: a ramp, then the measured window.
    Timed { start: Instant, ramp_end: Instant, end: Instant },
    /// The fill or the read-back check: a number of bytes to move.
    Sized { start: Instant, total_bytes: u64 },
}

/// Prints the progress line periodically; never finishes (the caller drops it with the phase).
pub(crate) async fn show_progress(
    style: ProgressStyle,
    label: &str,
    plan: ProgressPlan,
    counters: &PhaseCounters,
) -> Infallible {
    let period = if style == ProgressStyle::Terminal { TERMINAL_PERIOD } else { LINES_PERIOD };
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        ticker.tick().await;
        style.show(&progress_line(label, plan, counters, Instant::now()));
        counters.progress_lines.set(counters.progress_lines.get() + 1);
    }
}

fn per_second(count: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
    }
}

pub(crate) fn progress_line(
    label: &str,
    plan: ProgressPlan,
    counters: &PhaseCounters,
    now: Instant,
) -> String {
    let mut line = match plan {
        ProgressPlan::Timed { start, ramp_end, .. } if now < ramp_end => {
            let elapsed = now - start;
            format!(
                "{label}: ramp {:.0}s/{:.0}s  {} IOPS",
                elapsed.as_secs_f64(),
                (ramp_end - start).as_secs_f64(),
                format_count(per_second(counters.completed_ops.get(), elapsed)),
            )
        }
        ProgressPlan::Timed { ramp_end, end, .. } => {
            let elapsed = now.min(end) - ramp_end;
            format!(
                "{label}: {:.0}s/{:.0}s  {} IOPS  {:.1} MB/s",
                elapsed.as_secs_f64(),
                (end - ramp_end).as_secs_f64(),
                format_count(per_second(counters.measured_ops.get(), elapsed)),
                per_second(counters.measured_bytes.get(), elapsed) / 1e6,
            )
        }
        ProgressPlan::Sized { start, total_bytes } => {
            let done = counters.completed_bytes.get();
            let percent =
                if total_bytes == 0 { 100.0 } else { done as f64 * 100.0 / total_bytes as f64 };
            format!(
                "{label}: {} of {} ({percent:.0}%)  {:.1} MB/s",
                format_bytes(done),
                format_bytes(total_bytes),
                per_second(done, now - start) / 1e6,
            )
        }
    };
    let errors = counters.errors.get();
    if errors > 0 {
        line.push_str(&format!("  errors {errors}"));
    }
    let mismatches = counters.mismatches.get();
    if mismatches > 0 {
        line.push_str(&format!("  VERIFY MISMATCHES {mismatches}"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_show_phase_rate_and_trouble() {
        let counters = PhaseCounters::default();
        let start = Instant::now();
        let plan = ProgressPlan::Timed {
            start,
            ramp_end: start + Duration::from_secs(2),
            end: start + Duration::from_secs(12),
        };
        counters.completed_ops.set(1000);
        let line = progress_line("4k_randread", plan, &counters, start + Duration::from_secs(1));
        assert_eq!(line, "4k_randread: ramp 1s/2s  1,000 IOPS");
        counters.measured_ops.set(30_000);
        counters.measured_bytes.set(30_000 * 4096);
        counters.errors.set(2);
        counters.mismatches.set(1);
        let line = progress_line("4k_randread", plan, &counters, start + Duration::from_secs(5));
        assert_eq!(
            line,
            "4k_randread: 3s/10s  10,000 IOPS  41.0 MB/s  errors 2  VERIFY MISMATCHES 1"
        );

        let counters = PhaseCounters::default();
        counters.completed_bytes.set(512 << 20);
        let plan = ProgressPlan::Sized { start, total_bytes: 1 << 30 };
        let line = progress_line("fill", plan, &counters, start + Duration::from_secs(2));
        assert_eq!(line, "fill: 512.0 MiB of 1.0 GiB (50%)  268.4 MB/s");
    }
}
