//! Deterministic, seeded simulation of the replication protocol with network, node, disk and
//! control-plane faults, and the volume growing under them; every run is checked (see
//! `sim/checker.rs`).
//!
//! Each run reports how many resyncs copied the whole volume and how many only what changed
//! (and, of members out of sync since a term started, how many came back incrementally); over
//! `INCREMENTAL_RETURNS_SEEDS_MIN` seeds or more, some must have.
//!
//! `cargo test -p replication --test sim` runs `SEEDS_DEFAULT` seeds. Environment:
//! - `FERRITE_SIM_SEED=N`: run only seed N, print its settings and a trace of the run.
//! - `FERRITE_SIM_SEEDS=K`: run K seeds instead (from `FERRITE_SIM_SEED_START`, default 0).

mod sim {
    pub mod checker;
    pub mod world;
}

use std::time::Instant;

use replication::Stats;
use sim::world::{add_stats, Returns, World};

/// Seeds run by a plain `cargo test`, split over two tests so both cores work.
const SEEDS_DEFAULT: u64 = 1000;

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    match value.parse() {
        Ok(number) => Some(number),
        Err(_) => panic!("{name}={value:?} is not a number"),
    }
}

fn run_seed(seed: u64, trace: bool) -> Result<sim::world::Outcome, String> {
    let run = std::panic::catch_unwind(|| World::new(seed, trace).run());
    let outcome = match run {
        Ok(outcome) => outcome,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()))
                .unwrap_or_default();
            return Err(format!(
                "seed {seed} panicked: {message}\nrerun: FERRITE_SIM_SEED={seed} cargo test -p replication --test sim -- --nocapture"
            ));
        }
    };
    if outcome.violations.is_empty() {
        return Ok(outcome);
    }
    let mut report = format!(
        "seed {seed} failed at {} ms: {}\nrerun: FERRITE_SIM_SEED={seed} cargo test -p replication --test sim -- --nocapture",
        outcome.end_ms,
        outcome.violations.join("\n  ")
    );
    if trace {
        report.push_str("\ntrace (most recent last):\n");
        let shown =
            if std::env::var_os("FERRITE_SIM_PRINT_TRACE").is_some() { usize::MAX } else { 400 };
        let tail = outcome.trace_tail.len().saturating_sub(shown);
        report.push_str(&outcome.trace_tail[tail..].join("\n"));
    }
    Err(report)
}

fn run_range(part: u64, parts: u64) {
    if let Some(seed) = env_u64("FERRITE_SIM_SEED") {
        if part != 0 {
            return;
        }
        let settings = World::new(seed, false).settings().clone();
        println!("seed {seed}: {settings:#?}");
        match run_seed(seed, true) {
            Ok(outcome) if std::env::var_os("FERRITE_SIM_PRINT_TRACE").is_some() => {
                println!("{}", outcome.trace_tail.join("\n"))
            }
            Ok(outcome) => println!(
                "seed {seed} passed: {} writes completed, {} block reads checked, {} faults, \
                 final epoch {}, ended at {} ms\n{}\n{}\n{}\n{:#?}",
                outcome.writes_completed,
                outcome.reads_checked,
                outcome.faults,
                outcome.final_epoch,
                outcome.end_ms,
                describe_moves(outcome.move_ms.clone()),
                describe_resyncs(&outcome.stats),
                describe_restarted(outcome.restarted_returns),
                outcome.stats
            ),
            Err(report) => panic!("{report}"),
        }
        return;
    }
    let count = env_u64("FERRITE_SIM_SEEDS").unwrap_or(SEEDS_DEFAULT);
    let start = env_u64("FERRITE_SIM_SEED_START").unwrap_or(0);
    let begun = Instant::now();
    let (mut writes, mut epochs, mut runs) = (0, 0, 0);
    let mut restarted = Returns::default();
    let mut stats = Stats::default();
    let mut move_ms = Vec::new();
    for seed in (start..start + count).filter(|seed| seed % parts == part) {
        match run_seed(seed, false) {
            Ok(outcome) => {
                writes += outcome.writes_completed;
                add_stats(&mut stats, &outcome.stats);
                epochs += outcome.final_epoch;
                move_ms.extend(outcome.move_ms);
                restarted.incremental += outcome.restarted_returns.incremental;
                restarted.full += outcome.restarted_returns.full;
                runs += 1;
            }
            Err(report) => panic!("{report}"),
        }
    }
    println!(
        "{runs} seeds passed in {:.1} s: {writes} writes completed, {epochs} epochs in all\n{}\n{}\n{}\n{stats:?}",
        begun.elapsed().as_secs_f64(),
        describe_moves(move_ms),
        describe_resyncs(&stats),
        describe_restarted(restarted)
    );
    // Members come back after a failover with their process alive (a partition, a step-down
    // without a stop) in nearly every run: they must not all have been copied in full.
    if runs >= INCREMENTAL_RETURNS_SEEDS_MIN {
        assert!(stats.returns_incremental > 0, "no incremental return: {stats:?}");
        // Old primaries killed and restarted come back too: their persisted write intent
        // must make some of those returns incremental (crate docs, "Write intent").
        assert!(restarted.incremental > 0, "no restarted old primary returned incrementally");
        // Blocks damaged on a primary are read from a replica and rewritten (crate docs, "Read
        // repair"), and replicas serve those reads.
        assert!(
            stats.reads_repaired > 0 && stats.blocks_repaired > 0,
            "no read repaired: {stats:?}"
        );
        assert!(stats.peer_reads_served > 0, "no replica served a repair: {stats:?}");
        // And blocks the scrub found damaged are replaced, on primaries and on replicas.
        assert!(stats.damaged_rewritten > 0, "no scrubbed damage replaced: {stats:?}");
        assert!(stats.blocks_sent_for_repair > 0, "no primary sent a replica a copy: {stats:?}");
    }
}

fn describe_restarted(restarted: Returns) -> String {
    format!(
        "old primaries that came back after a restart (kill -9): {} incremental, {} full",
        restarted.incremental, restarted.full
    )
}

/// Seeds after which at least one member that was out of sync since a term started (the old
/// primary, mostly) must have come back with an incremental resync.
const INCREMENTAL_RETURNS_SEEDS_MIN: u64 = 100;

/// How many resyncs copied the whole volume and how many only what changed.
fn describe_resyncs(stats: &Stats) -> String {
    format!(
        "resyncs: {} started, {} full, {} incremental; of them members out of sync since a term \
         started (the old primary, an unprobed replica): {} incremental, {} full; {} blocks copied",
        stats.resyncs_started,
        stats.resyncs_full,
        stats.resyncs_started - stats.resyncs_full,
        stats.returns_incremental,
        stats.returns_full,
        stats.blocks_resynced
    )
}

/// How long planned moves took, from the step-down to the store's next epoch.
fn describe_moves(mut move_ms: Vec<u64>) -> String {
    move_ms.sort_unstable();
    let Some(&max) = move_ms.last() else {
        return "no planned moves of the primary".into();
    };
    let at = |fraction: f64| move_ms[((move_ms.len() - 1) as f64 * fraction) as usize];
    format!(
        "{} planned moves of the primary, next epoch after (ms): median {}, p90 {}, p99 {}, max {max}",
        move_ms.len(),
        at(0.5),
        at(0.9),
        at(0.99)
    )
}

#[test]
fn sim_seeds_even() {
    run_range(0, 2);
}

#[test]
fn sim_seeds_odd() {
    run_range(1, 2);
}
