//! The bench end to end against an in-process RAM target, through the public API only (what the
//! CLI and the crash tests see): workloads measure, the mix is right, verification passes on a
//! correct target and catches every kind of corruption, a crash leaves a checkable map, and
//! `run_command` writes its table, JSON and exit status.

mod ram_target;

use std::time::Duration;

use bench::{
    run, run_command, run_verified, BenchArgs, BenchConfig, BenchError, CheckOptions, MismatchKind,
    VerifyMap, WorkloadReport, STANDARD_WORKLOADS,
};
use clap::Parser;
use ram_target::{Fault, RamTarget, INTERNAL_ERROR_STATUS};

const MIB: usize = 1 << 20;

fn base_config(workloads: &[&str]) -> BenchConfig {
    BenchConfig {
        workloads: workloads.iter().map(|name| bench::Workload::from_name(name).unwrap()).collect(),
        queue_count: 2,
        queue_depth: 8,
        ramp: Duration::from_millis(50),
        runtime: Duration::from_millis(300),
        region_size_bytes: None,
        fill: false,
        verify: false,
        seed: Some(42),
        progress: false,
    }
}

fn names() -> Vec<&'static str> {
    STANDARD_WORKLOADS.iter().map(|w| w.name).collect()
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn assert_measured(report: &WorkloadReport) {
    let name = report.workload.name;
    assert!(report.ops() > 100, "{name}: {} ops", report.ops());
    assert!(report.iops() > 0.0 && report.mb_per_s() > 0.0, "{name}");
    let latency = report.latency;
    assert_eq!(latency.count, report.ops(), "{name}");
    assert!(latency.mean_us > 0.0 && latency.p50_us > 0.0, "{name}: {latency:?}");
    assert!(
        latency.p50_us <= latency.p99_us && latency.p99_us <= latency.p999_us,
        "{name}: {latency:?}"
    );
    assert!(latency.p999_us <= latency.max_us, "{name}: {latency:?}");
    assert_eq!(report.errors, 0, "{name}");
    let expected_bytes = report.ops() * u64::from(report.workload.block_size_bytes);
    assert_eq!(report.read_bytes + report.write_bytes, expected_bytes, "{name}");
}

#[test]
fn every_workload_runs_and_measures() {
    let mut target = RamTarget::new(8 * MIB, Fault::None);
    let config = BenchConfig { progress: true, ..base_config(&names()) };
    let reports = current_thread().block_on(run(&config, &mut target)).unwrap();
    assert_eq!(reports.len(), 5);
    for (report, workload) in reports.iter().zip(STANDARD_WORKLOADS) {
        assert_eq!(report.workload, workload);
        assert_measured(report);
        assert!(!report.verify && report.verify_mismatches == 0);
    }
    assert_eq!(reports[0].write_ops, 0, "4k_randread only reads");
    assert_eq!(reports[1].read_ops, 0, "4k_randwrite only writes");

    let table = bench::render_table(&reports);
    assert_eq!(table.lines().count(), 7, "{table}");
    for workload in STANDARD_WORKLOADS {
        assert!(table.contains(workload.name), "{table}");
    }
    let mut json = Vec::new();
    bench::write_json_lines(&mut json, "ram", &reports).unwrap();
    let lines: Vec<serde_json::Value> = String::from_utf8(json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    for (line, report) in lines.iter().zip(&reports) {
        assert_eq!(line["workload"], report.workload.name);
        assert_eq!(line["read_ops"], report.read_ops);
        assert!(line["iops"].as_u64().unwrap() > 0);
        assert!(line["lat_p99_us"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn read_write_mix_matches_the_workload() {
    // Requests complete at once here: many I/Os, so the shares are tight.
    let mut target = RamTarget::new(8 * MIB, Fault::None).with_delay_us_max(0);
    let config = BenchConfig {
        queue_depth: 16,
        runtime: Duration::from_millis(500),
        ..base_config(&["8k_randrw_80_20", "16k_randrw_70_30", "32k_randrw_50_50"])
    };
    let reports = current_thread().block_on(run(&config, &mut target)).unwrap();
    for report in &reports {
        assert!(report.ops() > 5000, "{}: {} ops", report.workload, report.ops());
        let read_share = report.read_ops as f64 / report.ops() as f64;
        let expected = f64::from(report.workload.read_percent) / 100.0;
        assert!(
            (read_share - expected).abs() < 0.03,
            "{}: read share {read_share:.3}",
            report.workload
        );
        assert!(
            report.read_latency.count == report.read_ops
                && report.write_latency.count == report.write_ops
        );
    }
}

#[test]
fn verify_passes_on_a_correct_target_and_the_map_reads_back() {
    let region = 4 * MIB as u64;
    let mut target = RamTarget::new(8 * MIB, Fault::None);
    let config = BenchConfig {
        fill: true,
        verify: true,
        region_size_bytes: Some(region),
        ..base_config(&names())
    };
    let runtime = current_thread();
    let mut map = VerifyMap::with_random_seed(region);
    let reports = runtime.block_on(run_verified(&config, &mut target, &mut map)).unwrap();
    for report in &reports {
        assert_measured(report);
        assert!(report.verify);
        assert_eq!(
            report.verify_mismatches, 0,
            "{}: {:?}",
            report.workload, report.mismatch_examples
        );
    }
    // The fill wrote every block; every block's last write was acknowledged.
    assert_eq!(map.written_block_count(), region / 4096);
    assert!((0..map.block_count()).all(|lba| map.acknowledged_generation(lba).is_some()));

    let reads_before = target.read_count();
    let check = runtime.block_on(map.check_all(&mut target, &CheckOptions::default())).unwrap();
    assert!(check.passed(), "{check:?}");
    assert_eq!(check.blocks_checked, region / 4096);
    assert!(target.read_count() - reads_before >= region / u64::from(bench::CHECK_IO_SIZE_BYTES));

    // Verification without a fill: reads of never-written blocks see zeros, which is fine.
    let mut fresh = RamTarget::new(8 * MIB, Fault::None);
    let unfilled = BenchConfig { fill: false, ..config.clone() };
    let reports = runtime.block_on(run(&unfilled, &mut fresh)).unwrap();
    assert!(reports.iter().all(|r| r.verify_mismatches == 0));

    // A plain run then a verifying one on the same data: blocks of the plain run are accepted.
    let mut reused = RamTarget::new(MIB, Fault::None);
    let plain = BenchConfig { verify: false, ..base_config(&["4k_randwrite"]) };
    runtime.block_on(run(&plain, &mut reused)).unwrap();
    let verifying = BenchConfig { verify: true, ..base_config(&["32k_randrw_50_50"]) };
    let reports = runtime.block_on(run(&verifying, &mut reused)).unwrap();
    assert_eq!(reports[0].verify_mismatches, 0, "{:?}", reports[0].mismatch_examples);
}

/// Runs a verifying mixed workload on a small region of a faulty target; returns the report.
fn run_against(fault: Fault) -> WorkloadReport {
    let mut target = RamTarget::new(256 * 1024, fault);
    let config = BenchConfig {
        verify: true,
        runtime: Duration::from_millis(400),
        ..base_config(&["4k_randwrite", "16k_randrw_70_30"])
    };
    let reports = current_thread().block_on(run(&config, &mut target)).unwrap();
    assert_eq!(reports[0].verify_mismatches, 0, "a write-only workload reads nothing");
    reports[1].clone()
}

#[test]
fn verify_catches_misdirected_torn_and_stale_blocks() {
    let report = run_against(Fault::MisdirectedRead { lba: 5 });
    assert!(report.verify_mismatches > 0);
    let example = &report.mismatch_examples[0];
    assert_eq!(example.lba, 5);
    assert!(matches!(example.kind, MismatchKind::WrongLba { found_lba: 6, .. }), "{example}");

    let report = run_against(Fault::TornWrite { lba: 9 });
    assert!(report.verify_mismatches > 0);
    let example = &report.mismatch_examples[0];
    assert_eq!(example.lba, 9);
    // The old half starts at byte 2048 (a byte or two later when old and new bytes agree there).
    assert!(
        matches!(example.kind, MismatchKind::TornPayload { first_bad_byte: 2048..=2055, .. }),
        "{example}"
    );

    let report = run_against(Fault::DroppedWrite { lba: 17 });
    assert!(report.verify_mismatches > 0);
    let example = &report.mismatch_examples[0];
    assert_eq!(example.lba, 17);
    assert!(matches!(example.kind, MismatchKind::WrongGeneration { .. }), "{example}");
    let text = example.to_string();
    assert!(text.contains("block 17") && text.contains("stale data"), "{text}");

    assert!(report.mismatch_examples.len() <= bench::MISMATCH_EXAMPLES_MAX);
}

#[test]
fn failed_writes_are_counted_and_leave_either_generation_acceptable() {
    let mut target = RamTarget::new(256 * 1024, Fault::FailWrites { every: 7 });
    let config = BenchConfig {
        verify: true,
        ..base_config(&["4k_randwrite", "32k_randrw_50_50", "4k_randread"])
    };
    let runtime = current_thread();
    let mut map = VerifyMap::with_random_seed(256 * 1024);
    let reports = runtime.block_on(run_verified(&config, &mut target, &mut map)).unwrap();
    assert!(reports[0].errors > 0 && reports[1].errors > 0);
    assert_eq!(reports[0].first_error_status, Some(INTERNAL_ERROR_STATUS));
    assert_eq!(reports[2].errors, 0, "reads do not fail");
    for report in &reports {
        assert_eq!(
            report.verify_mismatches, 0,
            "{}: {:?}",
            report.workload, report.mismatch_examples
        );
    }
    let check =
        runtime.block_on(map.check_all(&mut target.restart(), &CheckOptions::default())).unwrap();
    assert!(check.passed(), "{check:?}");
}

#[test]
fn a_crash_mid_run_leaves_a_map_that_checks_and_catches_lost_writes() {
    let region = 512 * 1024;
    let mut target = RamTarget::new(region, Fault::Crash { after: 3000 });
    let config = BenchConfig {
        verify: true,
        queue_depth: 16,
        runtime: Duration::from_secs(5),
        ..base_config(&["4k_randwrite"])
    };
    let runtime = current_thread();
    let mut map = VerifyMap::with_random_seed(region as u64);
    let error = runtime.block_on(run_verified(&config, &mut target, &mut map)).unwrap_err();
    assert!(matches!(error, BenchError::QueueFailed { .. }), "{error}");
    assert!(map.written_block_count() > 50);

    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("crash.vmap");
    map.save(&path).unwrap();
    let map = VerifyMap::load(&path).unwrap();
    let mut restarted = target.restart();
    let options = CheckOptions { queue_count: 3, queue_depth: 4, progress: false };
    let check = runtime.block_on(map.check_all(&mut restarted, &options)).unwrap();
    assert!(check.passed(), "{check:?}");
    assert_eq!(check.blocks_checked, map.written_block_count());

    // Lose one acknowledged write and misplace another: the check finds both.
    let acknowledged: Vec<u64> =
        (0..map.block_count()).filter(|lba| map.acknowledged_generation(*lba).is_some()).collect();
    let (lost, misplaced, source) = (acknowledged[0], acknowledged[1], acknowledged[2]);
    restarted.with_data_mut(|data| {
        let block = |lba: u64| lba as usize * 4096..(lba as usize + 1) * 4096;
        data[block(lost)].fill(0);
        data.copy_within(block(source), block(misplaced).start);
    });
    let check = runtime.block_on(map.check_all(&mut restarted, &options)).unwrap();
    assert_eq!(check.mismatches, 2, "{check:?}");
    let kinds: Vec<&MismatchKind> = check.mismatch_examples.iter().map(|m| &m.kind).collect();
    assert!(kinds.contains(&&MismatchKind::Zeros), "{kinds:?}");
    assert!(kinds.iter().any(|kind| matches!(kind, MismatchKind::WrongLba { .. })), "{kinds:?}");
}

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

fn args(line: &str) -> BenchArgs {
    Cli::try_parse_from(line.split_whitespace()).unwrap().args
}

#[test]
fn run_command_writes_json_saves_the_map_and_fails_on_mismatch() {
    let directory = tempfile::tempdir().unwrap();
    let json = directory.path().join("results.jsonl");
    let map = directory.path().join("run.vmap");
    let runtime = current_thread();
    let target_url = "nvme+tcp://127.0.0.1:4420/db-1";

    let mut target = RamTarget::new(2 * MIB, Fault::None);
    let line = format!(
        "bench --target {target_url} --ramp 0 --runtime 1 --workloads 8k_randrw_80_20 --queues 2 \
         --iodepth 4 --size 1M --verify --verify-map {} --json {} --quiet",
        map.display(),
        json.display()
    );
    let reports = runtime.block_on(run_command(&args(&line), &mut target)).unwrap();
    assert_eq!(reports.len(), 1);
    let text = std::fs::read_to_string(&json).unwrap();
    let record: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(record["workload"], "8k_randrw_80_20");
    assert_eq!(record["target"], "nvme+tcp://127.0.0.1:4420/nqn.2024-01.io.ferrite:vol:db-1");
    assert_eq!(record["verify_mismatches"], 0);
    assert_eq!(VerifyMap::load(&map).unwrap().region_size_bytes(), MIB as u64);

    // --check reads the saved map back: fine on the same data, a failure once a block is lost.
    let check_line = format!("bench --target {target_url} --check {} --quiet", map.display());
    let reports = runtime.block_on(run_command(&args(&check_line), &mut target)).unwrap();
    assert!(reports.is_empty());
    let saved = VerifyMap::load(&map).unwrap();
    let lba =
        (0..saved.block_count()).find(|lba| saved.acknowledged_generation(*lba).is_some()).unwrap();
    target.with_data_mut(|data| data[lba as usize * 4096 + 100] ^= 0xff);
    let error = runtime.block_on(run_command(&args(&check_line), &mut target)).unwrap_err();
    assert!(matches!(error, BenchError::VerifyFailed { mismatches: 1 }), "{error}");

    // A corrupting target makes the command fail after writing its results.
    let mut faulty = RamTarget::new(2 * MIB, Fault::TornWrite { lba: 3 });
    let line = format!(
        "bench --target {target_url} --ramp 0 --runtime 1 --workloads 4k_randwrite,4k_randread \
         --size 64K --verify --json {} --quiet",
        json.display()
    );
    let error = runtime.block_on(run_command(&args(&line), &mut faulty)).unwrap_err();
    assert!(matches!(error, BenchError::VerifyFailed { .. }), "{error}");
    assert_eq!(std::fs::read_to_string(&json).unwrap().lines().count(), 2);

    // NBD is parsed but refused.
    let nbd = args("bench --target nbd://127.0.0.1:10809/db-1");
    let error = runtime.block_on(run_command(&nbd, &mut target)).unwrap_err();
    assert!(matches!(error, BenchError::NbdNotSupported));
}
