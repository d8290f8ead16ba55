//! `scripts/compare-report.py`, which turns `make compare-ceph`'s results into the tables of
//! docs/BENCHMARKS.md, says how much server CPU per I/O each IOPS goal leaves on the machine:
//! the vCPUs over the goal's rate, less what fio took per I/O in Ferrite's run. Checked here on
//! made-up results whose answers are worked out by hand: a goal the server's CPU fits, one it
//! exceeds, and one that fio alone cannot reach on the machine.
//!
//! Needs `python3` (`scripts/deps.sh` installs it); fails without it: nothing is skipped.

mod common;

use common::client;
use std::path::{Path, PathBuf};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/compare-report.py")
}

/// fio's JSON output as compare-report.py reads it: the mixed (read and write) figures of one
/// group-reported job.
fn fio_json(iops: f64) -> String {
    format!(
        r#"{{"jobs": [{{"mixed": {{"iops": {iops}, "bw_bytes": {bw}, "lat_ns": {{"mean": 2000000.0,
        "percentile": {{"99.000000": 5000000, "99.900000": 9000000}}}}}}, "usr_cpu": 10.0,
        "sys_cpu": 5.0, "error": 0}}]}}"#,
        bw = iops * 4096.0
    )
}

/// One workload's record: fio's figures from `iops`, CPU seconds over a 10 s run.
fn fio_record(
    dir: &Path,
    side: &str,
    workload: &str,
    iops: f64,
    server_s: f64,
    client_s: f64,
) -> String {
    let json = dir.join(format!("{side}-{workload}.json"));
    std::fs::write(&json, fio_json(iops)).expect("write fio json");
    format!(
        r#"{{"kind": "fio", "side": "{side}", "replicas": 1, "workload": "{workload}", "fio_json": "{}",
        "wall_s": 10.0, "server_cpu_s": {server_s}, "client_cpu_s": {client_s}, "host_busy_cpu_s": {busy}}}"#,
        json.display(),
        busy = server_s + client_s
    )
    .replace('\n', " ")
}

#[test]
fn the_cpu_budget_per_io_is_the_vcpus_over_the_goal_less_fio_per_io() {
    let dir = tempfile::tempdir().expect("temp dir");
    let records = [
        r#"{"kind": "meta", "host_cpus": 2, "size_gb": 2, "runtime_s": 10, "ramp_s": 0, "iodepth": 32, "numjobs": 4, "commit": "0123456789ab"}"#.to_string(),
        // Reads: goal 10 x 6,000 = 60,000/s; 2 cores / 60,000 = 33.3 us per I/O; fio 0.6 cores
        // for 60,000/s = 10 us; 23.3 us left; the server took 0.3 cores = 5 us: within.
        fio_record(dir.path(), "ferrite", "4k_randread", 60_000.0, 3.0, 6.0),
        fio_record(dir.path(), "ceph", "4k_randread", 6_000.0, 12.0, 3.0),
        // Writes: goal 30 x 4,000 = 120,000/s; 16.67 us per I/O; fio 0.8 cores for 50,000/s =
        // 16 us; 0.67 us left; the server took 0.5 cores = 10 us: 15x over.
        fio_record(dir.path(), "ferrite", "4k_randwrite", 50_000.0, 5.0, 8.0),
        fio_record(dir.path(), "ceph", "4k_randwrite", 4_000.0, 16.0, 2.0),
        // The 8K mix: goal 10 x 8,000 = 80,000/s; 25 us per I/O; fio 1.2 cores for 40,000/s =
        // 30 us: more than the machine has per I/O at the goal.
        fio_record(dir.path(), "ferrite", "8k_randrw_80_20", 40_000.0, 4.0, 12.0),
        fio_record(dir.path(), "ceph", "8k_randrw_80_20", 8_000.0, 16.0, 2.0),
    ];
    let results = dir.path().join("results.jsonl");
    std::fs::write(&results, records.join("\n") + "\n").expect("write results");
    let markdown = dir.path().join("report.md");
    let output = client("python3", "python3")
        .arg(script())
        .arg("--results")
        .arg(&results)
        .arg("--markdown")
        .arg(&markdown)
        .arg("--svg")
        .arg(dir.path().join("chart.svg"))
        .output()
        .expect("run compare-report.py");
    assert!(
        output.status.success(),
        "compare-report.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report = std::fs::read_to_string(&markdown).expect("read the report");
    let row = |workload: &str| {
        report
            .lines()
            .find(|line| line.starts_with(&format!("| one copy | {workload} |")))
            .unwrap_or_else(|| panic!("no CPU budget row for {workload} in:\n{report}"))
            .to_string()
    };
    assert_eq!(
        row("4k_randread"),
        "| one copy | 4k_randread | 60,000 | 10.0 | 23.3 | 5.0 | 200.0 | yes |"
    );
    assert_eq!(
        row("4k_randwrite"),
        "| one copy | 4k_randwrite | 120,000 | 16.0 | 0.7 | 10.0 | 400.0 | **no**: 15.00x over |"
    );
    assert_eq!(
        row("8k_randrw_80_20"),
        "| one copy | 8k_randrw_80_20 | 80,000 | 30.0 | -5.0 | 10.0 | 200.0 | \
         **no**: fio alone needs more than the machine |"
    );
    // The goals summary names the budget beside each missed IOPS goal whose server exceeded it.
    assert!(
        report.contains(
            "8k_randrw_80_20 IOPS 5.00x (missed; at the goal fio alone would need more CPU than the machine has)"
        ),
        "the goals summary does not say fio alone exceeds the machine:\n{report}"
    );
    assert!(
        report.contains(
            "4k_randwrite IOPS 12.50x (missed; at the goal the CPUs leave the server 0.7 us per I/O, it took 10.0)"
        ),
        "the goals summary does not name the CPU budget:\n{report}"
    );
}
