//! `scripts/compare-report.py`, which turns `make compare-ceph`'s results into the tables of
//! docs/BENCHMARKS.md, says how much server CPU per I/O each IOPS goal leaves on the machine:
//! the vCPUs over the goal's rate, less what fio took per I/O in Ferrite's run. Checked here on
//! made-up results whose answers are worked out by hand: a goal the server's CPU fits, one it
//! exceeds, and one that fio alone cannot reach on the machine. Also checked: a replicated
//! workload that lost a replica is not judged, and each goal is set beside what the raw disk
//! did with the same fio job; and `scripts/compare-medians.py` takes in runs kept only as the
//! archive compare-ceph.sh leaves (docs/compare-runs/) exactly as it takes their directories.
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

/// One workload's record with one copy: fio's figures from `iops`, CPU seconds over a 10 s run.
fn fio_record(
    dir: &Path,
    side: &str,
    workload: &str,
    iops: f64,
    server_s: f64,
    client_s: f64,
) -> String {
    let cpu = Cpu { server_s, client_s };
    replicated_fio_record(dir, side, 1, workload, iops, cpu, "")
}

struct Cpu {
    server_s: f64,
    client_s: f64,
}

/// One workload's record with `replicas` copies; `extra` is more JSON fields, each preceded by
/// a comma (compare-ceph.sh's `replication` check, say).
fn replicated_fio_record(
    dir: &Path,
    side: &str,
    replicas: u32,
    workload: &str,
    iops: f64,
    Cpu { server_s, client_s }: Cpu,
    extra: &str,
) -> String {
    let json = dir.join(format!("{side}-{replicas}-{workload}.json"));
    std::fs::write(&json, fio_json(iops)).expect("write fio json");
    format!(
        r#"{{"kind": "fio", "side": "{side}", "replicas": {replicas}, "workload": "{workload}", "fio_json": "{}",
        "wall_s": 10.0, "server_cpu_s": {server_s}, "client_cpu_s": {client_s}, "host_busy_cpu_s": {busy}{extra}}}"#,
        json.display(),
        busy = server_s + client_s
    )
    .replace('\n', " ")
}

/// Runs compare-report.py over `records` and gives back the markdown report.
fn report(dir: &Path, records: &[String]) -> String {
    let results = dir.join("results.jsonl");
    std::fs::write(&results, records.join("\n") + "\n").expect("write results");
    let markdown = dir.join("report.md");
    let output = client("python3", "python3")
        .arg(script())
        .arg("--results")
        .arg(&results)
        .arg("--markdown")
        .arg(&markdown)
        .arg("--svg")
        .arg(dir.join("chart.svg"))
        .output()
        .expect("run compare-report.py");
    assert!(
        output.status.success(),
        "compare-report.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::read_to_string(&markdown).expect("read the report")
}

/// The report's first line that starts with `prefix`.
fn line_starting(report: &str, prefix: &str) -> String {
    report
        .lines()
        .find(|line| line.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{report}"))
        .to_string()
}

const META: &str = r#"{"kind": "meta", "host_cpus": 2, "size_gb": 2, "runtime_s": 10, "ramp_s": 0, "iodepth": 32, "numjobs": 4, "commit": "0123456789ab"}"#;

#[test]
fn the_cpu_budget_per_io_is_the_vcpus_over_the_goal_less_fio_per_io() {
    let dir = tempfile::tempdir().expect("temp dir");
    let records = [
        META.to_string(),
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
    let report = report(dir.path(), &records);
    let row = |workload: &str| line_starting(&report, &format!("| one copy | {workload} |"));
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

/// compare-ceph.sh records whether every replica stayed in sync during each of Ferrite's
/// replicated measurements; a workload in which the primary removed one (or failed over, or
/// could not say) is not like for like with Ceph's three copies, so its goals are not judged,
/// while the workloads that kept every copy are.
#[test]
fn a_workload_that_lost_a_replica_from_the_in_sync_set_is_not_judged() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cpu = || Cpu { server_s: 5.0, client_s: 5.0 };
    let in_sync = r#", "replication": {"known": true, "replicas_removed": 0, "epoch_changed": false, "in_sync_at_start": 3, "in_sync_at_end": 3, "primary": "node1"}"#;
    let one_removed = r#", "replication": {"known": true, "replicas_removed": 1, "epoch_changed": false, "in_sync_at_start": 3, "in_sync_at_end": 3, "primary": "node1"}"#;
    let unknown = r#", "replication": {"known": false, "replicas_removed": null, "epoch_changed": null, "in_sync_at_start": null, "in_sync_at_end": null, "primary": "?"}"#;
    // Nothing removed during the run, but a resync from before still under way at its start.
    let resyncing = r#", "replication": {"known": true, "replicas_removed": 0, "epoch_changed": false, "in_sync_at_start": 2, "in_sync_at_end": 3, "primary": "node1"}"#;
    let d = dir.path();
    let records = [
        META.to_string(),
        // Both 40x Ceph's IOPS with the same p99.9 latency: the IOPS goals would be met.
        replicated_fio_record(d, "ferrite", 3, "4k_randwrite", 40_000.0, cpu(), in_sync),
        replicated_fio_record(d, "ceph", 3, "4k_randwrite", 1_000.0, cpu(), ""),
        replicated_fio_record(d, "ferrite", 3, "8k_randrw_80_20", 40_000.0, cpu(), one_removed),
        replicated_fio_record(d, "ceph", 3, "8k_randrw_80_20", 1_000.0, cpu(), ""),
        replicated_fio_record(d, "ferrite", 3, "16k_randrw_70_30", 40_000.0, cpu(), unknown),
        replicated_fio_record(d, "ceph", 3, "16k_randrw_70_30", 1_000.0, cpu(), ""),
        replicated_fio_record(d, "ferrite", 3, "32k_randrw_50_50", 40_000.0, cpu(), resyncing),
        replicated_fio_record(d, "ceph", 3, "32k_randrw_50_50", 1_000.0, cpu(), ""),
    ];
    let report = report(d, &records);
    let row = |workload: &str| line_starting(&report, &format!("| {workload} |"));
    let judged = "| 40.00x | 1.00x | >= 30x: yes | >= 10x: **no** |".to_string();
    let not_judged = |why: &str| format!("| not judged ({why}) | not judged ({why}) |");
    let expected = [
        // The workload that kept every copy is judged.
        ("4k_randwrite", judged),
        ("8k_randrw_80_20", not_judged("the primary removed 1 replica(s) from the in-sync set")),
        ("16k_randrw_70_30", not_judged("whether every replica stayed in sync is unknown")),
        ("32k_randrw_50_50", not_judged("2 of 3 copies in sync at the start")),
    ];
    for (workload, ending) in expected {
        let line = row(workload);
        assert!(line.ends_with(&ending), "{workload}: {line}, expected it to end {ending}");
    }
    let summary = line_starting(&report, "- Three copies:");
    assert!(
        summary.contains("**1 of 4 workloads miss a goal**, **3 of 4 not judged**"),
        "{summary}"
    );
    assert!(
        summary.contains(
            "8k_randrw_80_20 not judged (Ferrite's run: the primary removed 1 replica(s) from \
             the in-sync set; not like for like)"
        ),
        "{summary}"
    );
}

/// A probe of the raw disk (`raw_randread_4k`, `raw_job_WORKLOAD`) as compare-ceph.sh records it.
fn probe_record(dir: &Path, probe: &str, iops: f64) -> String {
    let json = dir.join(format!("{probe}.json"));
    std::fs::write(&json, fio_json(iops)).expect("write fio json");
    format!(
        r#"{{"kind": "probe", "probe": "{probe}", "fio_json": "{}", "wall_s": 10.0, "server_cpu_s": 0, "client_cpu_s": 1.0, "host_busy_cpu_s": 1.0}}"#,
        json.display()
    )
}

/// compare-ceph.sh also runs each workload's exact fio job on the raw disk; the report sets
/// Ferrite's IOPS and each goal beside it, and the goals summary says what share of the raw
/// disk's rate a missed goal asks for.
#[test]
fn each_workload_and_goal_is_set_beside_the_raw_disk_on_the_same_job() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let records = [
        META.to_string(),
        // The 4K reads' job on the raw disk is the random 4K read probe.
        probe_record(d, "raw_randread_4k", 82_000.0),
        probe_record(d, "raw_job_8k_randrw_80_20", 60_000.0),
        probe_record(d, "raw_job_32k_randrw_50_50", 33_600.0),
        // Goal 80,000: 98% of the raw disk's 82,000; Ferrite 85% of it.
        fio_record(d, "ferrite", "4k_randread", 70_000.0, 1.0, 1.0),
        fio_record(d, "ceph", "4k_randread", 8_000.0, 1.0, 1.0),
        // Met (11x): no share in the summary, the table still has it.
        fio_record(d, "ferrite", "8k_randrw_80_20", 55_000.0, 1.0, 1.0),
        fio_record(d, "ceph", "8k_randrw_80_20", 5_000.0, 1.0, 1.0),
        // Goal 35,000: 104% of the raw disk's 33,600; Ferrite 89% of it.
        fio_record(d, "ferrite", "32k_randrw_50_50", 30_000.0, 1.0, 1.0),
        fio_record(d, "ceph", "32k_randrw_50_50", 3_500.0, 1.0, 1.0),
    ];
    let report = report(d, &records);
    let rows: Vec<&str> = report
        .lines()
        .skip_while(|line| !line.starts_with("| workload | raw disk IOPS, this job |"))
        .take_while(|line| line.starts_with('|'))
        .collect();
    assert_eq!(
        rows,
        [
            "| workload | raw disk IOPS, this job | Ferrite one copy IOPS (of raw) | goal, one copy (of raw) |",
            "|---|---:|---:|---:|",
            "| 4k_randread | 82,000 | 70,000 (85%) | 80,000 (98%) |",
            "| 8k_randrw_80_20 | 60,000 | 55,000 (92%) | 50,000 (83%) |",
            "| 32k_randrw_50_50 | 33,600 | 30,000 (89%) | 35,000 (104%) |",
        ],
        "{report}"
    );
    let summary = line_starting(&report, "- One copy:");
    for expected in [
        // For 4K reads the job's rate is the disk bound, which the summary names when the goal
        // lies above it.
        "4k_randread IOPS 8.75x (missed)",
        "8k_randrw_80_20 IOPS 11.00x (met)",
        "32k_randrw_50_50 IOPS 8.57x (missed; the goal is 104% of the raw disk's IOPS on the same job)",
    ] {
        assert!(summary.contains(expected), "{expected:?} not in {summary}");
    }
}

/// A disk stall in Ceph's run that may have set its tail (a third of its p99.9 or more) and is
/// longer than any in Ferrite's run slowed Ceph, not its design: the goals summary says the
/// workload's ratios flatter Ferrite.
#[test]
fn a_stall_in_cephs_run_is_named_beside_the_ratios_it_flatters() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let cpu = || Cpu { server_s: 1.0, client_s: 1.0 };
    let stalled = |ms: u32| format!(r#", "disk_stall_max_ms": {ms}"#);
    // Every run's p99.9 is 9 ms (fio_json): a stall of 3 ms or more may have set it.
    let records = [
        META.to_string(),
        // Ceph stalled 600 ms, Ferrite not at all: named.
        replicated_fio_record(d, "ferrite", 1, "8k_randrw_80_20", 50_000.0, cpu(), &stalled(0)),
        replicated_fio_record(d, "ceph", 1, "8k_randrw_80_20", 4_000.0, cpu(), &stalled(600)),
        // Both stalled, Ferrite longer: not named.
        replicated_fio_record(d, "ferrite", 1, "16k_randrw_70_30", 50_000.0, cpu(), &stalled(700)),
        replicated_fio_record(d, "ceph", 1, "16k_randrw_70_30", 4_000.0, cpu(), &stalled(600)),
        // Ceph's stall too short to have set its tail: not named.
        replicated_fio_record(d, "ferrite", 1, "32k_randrw_50_50", 50_000.0, cpu(), &stalled(0)),
        replicated_fio_record(d, "ceph", 1, "32k_randrw_50_50", 4_000.0, cpu(), &stalled(2)),
    ];
    let summary = line_starting(&report(d, &records), "- One copy:");
    let note = "(Ceph's run met a disk stall of 600 ms: both ratios flatter Ferrite)";
    assert!(
        summary.contains(&format!(
            "8k_randrw_80_20 IOPS 12.50x (met), p99.9 1.00x lower (missed) {note}"
        )),
        "{summary}"
    );
    assert_eq!(summary.matches("Ceph's run met a disk stall").count(), 1, "{summary}");
}

/// One node's /metrics text holding the three write-stage histograms: `host` (the primary's
/// volume write latency), `storage` and each `(replica, histogram)` acknowledgement, each as
/// (count, sum in seconds, count within 10 ms).
fn metrics_text(
    host: (u64, f64, u64),
    storage: (u64, f64, u64),
    acks: &[(&str, (u64, f64, u64))],
) -> String {
    let labels = r#"volume="vol",volume_id="3""#;
    let histogram = |family: &str, labels: &str, (count, sum, within): (u64, f64, u64)| {
        format!(
            "{family}_bucket{{{labels},le=\"0.0025\"}} 0\n{family}_bucket{{{labels},le=\"0.01\"}} \
             {within}\n{family}_bucket{{{labels},le=\"+Inf\"}} {count}\n{family}_sum{{{labels}}} \
             {sum}\n{family}_count{{{labels}}} {count}\n"
        )
    };
    let mut text = String::from("# HELP ferrite_volumes x\nferrite_volumes 1\n");
    text += &histogram("ferrite_volume_latency_seconds", &format!("{labels},op=\"write\""), host);
    text +=
        &histogram("ferrite_volume_latency_seconds", &format!("{labels},op=\"read\""), (9, 9.0, 9));
    text += &histogram("ferrite_replication_storage_write_seconds", labels, storage);
    for (replica, ack) in acks {
        text += &histogram(
            "ferrite_replication_ack_seconds",
            &format!("{labels},replica=\"{replica}\""),
            *ack,
        );
    }
    text
}

#[test]
fn the_replicated_writes_stages_come_from_the_metrics_before_and_after_a_workload() {
    let dir = tempfile::tempdir().expect("temp dir");
    let write = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write metrics");
        path.display().to_string()
    };
    // Between the scrapes the primary answered 1,000 host writes in 3 s (3,000 us each, 50 over
    // 10 ms), wrote them to its log in 1 s, and waited 2.5 s for n2's and 2 s for n3's
    // acknowledgements of 500 entries each; n2 wrote its 500 in 0.5 s; n3 restarted (its counts
    // went down) and is left out.
    let primary = [
        write("p0", metrics_text((100, 1.0, 100), (100, 0.5, 100), &[("n2", (10, 0.1, 10))])),
        write(
            "p1",
            metrics_text(
                (1_100, 4.0, 1_050),
                (1_100, 1.5, 1_100),
                &[("n2", (510, 2.6, 510)), ("n3", (500, 2.0, 500))],
            ),
        ),
    ];
    let n2 = [
        write("a0", metrics_text((0, 0.0, 0), (0, 0.0, 0), &[])),
        write("a1", metrics_text((0, 0.0, 0), (500, 0.5, 500), &[])),
    ];
    let n3 = [
        write("b0", metrics_text((0, 0.0, 0), (900, 1.0, 900), &[])),
        write("b1", metrics_text((0, 0.0, 0), (10, 0.1, 10), &[])),
    ];
    // The primary persisted its write intent 4 times more, 0.2 s in all, one over 10 ms; the
    // replicas' metrics have no persists (n2's none at all, the series absent).
    let intent = |count: u64, sum: f64, within: u64| {
        format!(
            "ferrite_replication_intent_persist_seconds_bucket{{volume=\"vol\",volume_id=\"3\",\
             le=\"0.01\"}} {within}\nferrite_replication_intent_persist_seconds_bucket{{volume=\"vol\",\
             volume_id=\"3\",le=\"+Inf\"}} {count}\nferrite_replication_intent_persist_seconds_sum{{\
             volume=\"vol\",volume_id=\"3\"}} {sum}\nferrite_replication_intent_persist_seconds_count{{\
             volume=\"vol\",volume_id=\"3\"}} {count}\n"
        )
    };
    for (path, extra) in primary.iter().zip([intent(2, 0.01, 2), intent(6, 0.21, 5)]) {
        let mut text = std::fs::read_to_string(path).expect("read metrics");
        text += &extra;
        std::fs::write(path, text).expect("write metrics");
    }
    let output = client("python3", "python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/write-stages.py"))
        .args(["--volume", "vol", "--primary", "n1"])
        .arg(format!("n1={},{}", primary[0], primary[1]))
        .arg(format!("n2={},{}", n2[0], n2[1]))
        .arg(format!("n3={},{}", n3[0], n3[1]))
        .output()
        .expect("run write-stages.py");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stages = String::from_utf8(output.stdout).expect("utf-8");
    let parsed: serde_json::Value = serde_json::from_str(&stages).expect("JSON");
    assert_eq!(parsed["host_write"]["count"], 1_000);
    assert_eq!(parsed["host_write"]["mean_us"], 3_000.0);
    assert_eq!(parsed["host_write"]["over_10ms"], 0.05);
    assert_eq!(parsed["storage_write"]["n1"]["mean_us"], 1_000.0);
    assert_eq!(parsed["storage_write"]["n2"]["mean_us"], 1_000.0);
    assert!(parsed["storage_write"].get("n3").is_none(), "{stages}");
    assert_eq!(parsed["ack"]["n2"]["mean_us"], 5_000.0);
    assert_eq!(parsed["ack"]["n2"]["over_10ms"], 0.0);
    assert_eq!(parsed["ack"]["n3"]["count"], 500);
    assert_eq!(parsed["intent_persist"]["n1"]["count"], 4);
    assert_eq!(parsed["intent_persist"]["n1"]["mean_us"], 50_000.0);
    assert_eq!(parsed["intent_persist"]["n1"]["over_10ms"], 0.25);
    assert!(parsed["intent_persist"].get("n2").is_none(), "{stages}");

    // The report sets them out per workload for the replicated rows.
    let extra = format!(r#", "write_stages": {}"#, stages.trim());
    let cpu = Cpu { server_s: 10.0, client_s: 4.0 };
    let records = [
        META.to_string(),
        replicated_fio_record(dir.path(), "ferrite", 3, "4k_randwrite", 30_000.0, cpu, &extra),
        replicated_fio_record(
            dir.path(),
            "ceph",
            3,
            "4k_randwrite",
            1_000.0,
            Cpu { server_s: 10.0, client_s: 1.0 },
            "",
        ),
    ];
    let report = report(dir.path(), &records);
    assert_eq!(
        line_starting(&report, "| 4k_randwrite | 1,000 |"),
        "| 4k_randwrite | 1,000 | 3,000 (5.0%) | 1,000 (0.0%) | n2 5,000 (0.0%); n3 4,000 (0.0%) \
         | n2 1,000 (0.0%); n3 - | n1 4 x 50,000 (25.0%) |"
    );
}

/// scripts/compare-medians.py run over `runs`.
fn medians_output(runs: &[&Path]) -> std::process::Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/compare-medians.py");
    client("python3", "python3").arg(script).args(runs).output().expect("run compare-medians.py")
}

fn medians(runs: &[&Path]) -> String {
    let output = medians_output(runs);
    assert!(
        output.status.success(),
        "compare-medians.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("the medians are text")
}

/// A run directory as compare-ceph.sh leaves it (results.jsonl, fio/): one-copy 4K writes,
/// Ferrite at `iops` against Ceph's 1,000.
fn run_dir(parent: &Path, name: &str, iops: f64) -> PathBuf {
    let run = parent.join(name);
    let fio = run.join("fio");
    std::fs::create_dir_all(&fio).expect("create the run's fio directory");
    let records = [
        META.to_owned(),
        fio_record(&fio, "ferrite", "4k_randwrite", iops, 10.0, 10.0),
        fio_record(&fio, "ceph", "4k_randwrite", 1_000.0, 10.0, 10.0),
    ];
    std::fs::write(run.join("results.jsonl"), records.join("\n") + "\n").expect("write results");
    run
}

/// compare-ceph.sh's run.tar.xz, made the same way.
fn archive(run: &Path) -> PathBuf {
    let archive = run.with_extension("tar.xz");
    let mut tar = client("tar", "tar");
    tar.arg("-C").arg(run).arg("-cJf").arg(&archive).args(["results.jsonl", "fio"]);
    common::run_ok(tar);
    archive
}

#[test]
fn medians_take_in_runs_kept_as_archives_after_their_directories_are_gone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = run_dir(dir.path(), "first", 30_000.0);
    let second = run_dir(dir.path(), "second", 20_000.0);
    let third = run_dir(dir.path(), "third", 24_000.0);
    let from_dirs = medians(&[&first, &second, &third]);
    let row = line_starting(&from_dirs, "| 1 | 4k_randwrite |");
    assert!(row.contains("| 24.00x (20.00-30.00x) |"), "{row}");
    // The first two are kept as archives only; their fio outputs are no longer where the
    // results say they were.
    let kept = [archive(&first), archive(&second)];
    for run in [&first, &second] {
        std::fs::remove_dir_all(run).expect("remove the run directory");
    }
    let from_archives = medians(&[&kept[0], &kept[1], &third]);
    assert_eq!(from_archives, from_dirs);
    // Something that is not an archive is refused by name.
    let bogus = dir.path().join("bogus.tar.xz");
    std::fs::write(&bogus, "not an archive").expect("write");
    let output = medians_output(&[&bogus]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cannot unpack") && stderr.contains("bogus.tar.xz"), "{stderr}");
}
