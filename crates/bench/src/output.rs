//! How results leave the bench: the table people read, the JSON lines scripts read (the same
//! fields as the Ceph anchor's `results.jsonl`, so the two compare line by line) and the number
//! formats they share.

use std::io::Write;

use serde::Serialize;

use crate::run::{LatencySummary, WorkloadReport};

/// `1234567.4` as `1,234,567`.
pub(crate) fn format_count(value: f64) -> String {
    group_digits(&format!("{:.0}", value.max(0.0)))
}

/// A run of decimal digits with thousands separators: `29952` as `29,952`.
pub fn group_digits(digits: &str) -> String {
    let mut grouped = String::with_capacity(digits.len() + digits.len() / 3);
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    grouped
}

/// A byte count in binary units with one decimal: `512.0 MiB`, `10.0 GiB`.
pub(crate) fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u32); 5] =
        [("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
    for (unit, shift) in UNITS {
        if bytes >= 1 << shift {
            return format!("{:.1} {unit}", bytes as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{bytes} B")
}

/// A latency with three significant digits in the unit that suits it: `8.25 us`, `45.3 us`,
/// `812 us`, `1.23 ms`, `12.3 ms`, `2.50 s`.
pub fn format_latency_us(us: f64) -> String {
    let (value, unit) = if us < 1000.0 {
        (us, "us")
    } else if us < 1_000_000.0 {
        (us / 1000.0, "ms")
    } else {
        (us / 1_000_000.0, "s")
    };
    if value < 10.0 {
        format!("{value:.2} {unit}")
    } else if value < 100.0 {
        format!("{value:.1} {unit}")
    } else {
        format!("{value:.0} {unit}")
    }
}

/// One line per workload for stderr as each finishes.
pub(crate) fn summary_line(report: &WorkloadReport) -> String {
    let mut line = format!(
        "{} IOPS, {:.1} MB/s, mean {}, p99 {}, p99.9 {}",
        format_count(report.iops()),
        report.mb_per_s(),
        format_latency_us(report.latency.mean_us),
        format_latency_us(report.latency.p99_us),
        format_latency_us(report.latency.p999_us),
    );
    if let Some(cores) = report.process_cpu_cores {
        line.push_str(&format!(", this process {cores:.2} CPU cores"));
    }
    if report.errors > 0 {
        line.push_str(&format!(", {} errors", report.errors));
    }
    if report.verify_mismatches > 0 {
        line.push_str(&format!(", {} VERIFY MISMATCHES", report.verify_mismatches));
    }
    line
}

/// The end-of-run table: workload | IOPS | MB/s | mean | p50 | p99 | p99.9, latencies of every
/// I/O completed in the measured window (all queues, reads and writes merged). Columns for errors
/// and verify mismatches appear when any row has some.
pub fn render_table(reports: &[WorkloadReport]) -> String {
    let with_errors = reports.iter().any(|r| r.errors > 0);
    let with_verify = reports.iter().any(|r| r.verify);
    let mut header: Vec<String> =
        ["workload", "IOPS", "MB/s", "mean", "p50", "p99", "p99.9"].map(str::to_owned).to_vec();
    if with_errors {
        header.push("errors".to_owned());
    }
    if with_verify {
        header.push("mismatches".to_owned());
    }
    let mut rows = vec![header];
    for report in reports {
        let latency = &report.latency;
        let mut row = vec![
            report.workload.name.to_owned(),
            format_count(report.iops()),
            format!("{:.1}", report.mb_per_s()),
            format_latency_us(latency.mean_us),
            format_latency_us(latency.p50_us),
            format_latency_us(latency.p99_us),
            format_latency_us(latency.p999_us),
        ];
        if with_errors {
            row.push(report.errors.to_string());
        }
        if with_verify {
            row.push(report.verify_mismatches.to_string());
        }
        rows.push(row);
    }
    let columns = rows[0].len();
    let widths: Vec<usize> =
        (0..columns).map(|c| rows.iter().map(|row| row[c].len()).max().unwrap_or(0)).collect();
    let mut table = String::new();
    for (index, row) in rows.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if c == 0 {
                    format!("{cell:<width$}", width = widths[c])
                } else {
                    format!("{cell:>width$}", width = widths[c])
                }
            })
            .collect();
        table.push_str(cells.join(" | ").trim_end());
        table.push('\n');
        if index == 0 {
            let rule: Vec<String> = widths.iter().map(|width| "-".repeat(*width)).collect();
            table.push_str(&rule.join("-|-"));
            table.push('\n');
        }
    }
    table
}

fn round1(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

/// One JSON line: the Ceph anchor's field names where they exist (`iops`, `lat_*_us`), with
/// throughput named for its unit (`mb_per_s`, 10^6 bytes per second).
#[derive(Serialize)]
struct JsonRecord<'a> {
    target: &'a str,
    workload: &'a str,
    block_size_bytes: u32,
    read_percent: u8,
    queues: u16,
    iodepth: u16,
    ramp_s: f64,
    runtime_s: f64,
    iops: u64,
    mb_per_s: f64,
    lat_mean_us: f64,
    lat_p50_us: f64,
    lat_p99_us: f64,
    lat_p999_us: f64,
    lat_max_us: f64,
    read_ops: u64,
    write_ops: u64,
    read_lat_mean_us: Option<f64>,
    read_lat_p99_us: Option<f64>,
    write_lat_mean_us: Option<f64>,
    write_lat_p99_us: Option<f64>,
    errors: u64,
    verify: bool,
    verify_mismatches: u64,
    /// [`WorkloadReport::process_cpu_cores`], to two decimals.
    process_cpu_cores: Option<f64>,
}

/// One report as a JSON object on one line (no newline). `target` names what was measured
/// (the URL), as the Ceph anchor's `target` field does.
pub fn json_line(target: &str, report: &WorkloadReport) -> String {
    let side = |latency: &LatencySummary, pick: fn(&LatencySummary) -> f64| {
        (latency.count > 0).then(|| round1(pick(latency)))
    };
    let record = JsonRecord {
        target,
        workload: report.workload.name,
        block_size_bytes: report.workload.block_size_bytes,
        read_percent: report.workload.read_percent,
        queues: report.queue_count,
        iodepth: report.queue_depth,
        ramp_s: report.ramp.as_secs_f64(),
        runtime_s: report.measured.as_secs_f64(),
        iops: report.iops().round() as u64,
        mb_per_s: round1(report.mb_per_s()),
        lat_mean_us: round1(report.latency.mean_us),
        lat_p50_us: round1(report.latency.p50_us),
        lat_p99_us: round1(report.latency.p99_us),
        lat_p999_us: round1(report.latency.p999_us),
        lat_max_us: round1(report.latency.max_us),
        read_ops: report.read_ops,
        write_ops: report.write_ops,
        read_lat_mean_us: side(&report.read_latency, |l| l.mean_us),
        read_lat_p99_us: side(&report.read_latency, |l| l.p99_us),
        write_lat_mean_us: side(&report.write_latency, |l| l.mean_us),
        write_lat_p99_us: side(&report.write_latency, |l| l.p99_us),
        errors: report.errors,
        verify: report.verify,
        verify_mismatches: report.verify_mismatches,
        process_cpu_cores: report.process_cpu_cores.map(|cores| (cores * 100.0).round() / 100.0),
    };
    serde_json::to_string(&record).expect("a record of numbers and strings serialises")
}

/// Writes one JSON line per report.
pub fn write_json_lines<W: Write>(
    out: &mut W,
    target: &str,
    reports: &[WorkloadReport],
) -> std::io::Result<()> {
    for report in reports {
        writeln!(out, "{}", json_line(target, report))?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Workload, STANDARD_WORKLOADS};
    use std::time::Duration;

    fn report(workload: Workload, read_ops: u64, write_ops: u64) -> WorkloadReport {
        let bytes = u64::from(workload.block_size_bytes);
        let latency = LatencySummary {
            count: read_ops + write_ops,
            mean_us: 245.26,
            p50_us: 230.0,
            p99_us: 1234.0,
            p999_us: 2_500_000.0,
            max_us: 3e6,
        };
        WorkloadReport {
            workload,
            queue_count: 4,
            queue_depth: 32,
            ramp: Duration::from_secs(2),
            measured: Duration::from_secs(10),
            read_ops,
            write_ops,
            read_bytes: read_ops * bytes,
            write_bytes: write_ops * bytes,
            latency,
            read_latency: if read_ops > 0 { latency } else { LatencySummary::default() },
            write_latency: if write_ops > 0 { latency } else { LatencySummary::default() },
            errors: 0,
            first_error_status: None,
            verify: false,
            verify_mismatches: 0,
            mismatch_examples: Vec::new(),
            process_cpu_cores: Some(0.934),
        }
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(format_count(0.0), "0");
        assert_eq!(format_count(999.4), "999");
        assert_eq!(format_count(1000.0), "1,000");
        assert_eq!(format_count(1_234_567.0), "1,234,567");
        assert_eq!(format_latency_us(8.254), "8.25 us");
        assert_eq!(format_latency_us(45.31), "45.3 us");
        assert_eq!(format_latency_us(812.0), "812 us");
        assert_eq!(format_latency_us(1234.0), "1.23 ms");
        assert_eq!(format_latency_us(12_345.0), "12.3 ms");
        assert_eq!(format_latency_us(2_500_000.0), "2.50 s");
        assert_eq!(format_bytes(4096), "4.0 KiB");
        assert_eq!(format_bytes(10 << 30), "10.0 GiB");
        assert_eq!(format_bytes(100), "100 B");
    }

    #[test]
    fn table_lines_up_and_shows_trouble_columns_only_when_needed() {
        let reports = vec![
            report(STANDARD_WORKLOADS[0], 1_234_560, 0),
            report(STANDARD_WORKLOADS[4], 50_000, 50_000),
        ];
        let table = render_table(&reports);
        let expected = "\
workload         |    IOPS |  MB/s |    mean |    p50 |     p99 |   p99.9
-----------------|---------|-------|---------|--------|---------|--------
4k_randread      | 123,456 | 505.7 | 245 us | 230 us | 1.23 ms | 2.50 s
32k_randrw_50_50 |  10,000 | 327.7 | 245 us | 230 us | 1.23 ms | 2.50 s
";
        // Column widths follow the longest cell; compare modulo that padding.
        let squash =
            |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ").replace('-', "");
        assert_eq!(squash(&table), squash(expected), "\n{table}");
        let widths: Vec<usize> = table.lines().map(str::len).collect();
        assert!(widths.windows(2).all(|pair| pair[0] == pair[1]), "aligned:\n{table}");

        let mut failing = reports.clone();
        failing[1].errors = 3;
        failing[1].verify = true;
        failing[1].verify_mismatches = 2;
        let table = render_table(&failing);
        let header = table.lines().next().unwrap();
        assert!(header.ends_with("| errors | mismatches"), "{table}");
        assert!(table.lines().nth(3).unwrap().ends_with("|      3 |          2"), "{table}");
    }

    #[test]
    fn json_lines_carry_the_anchor_fields() {
        let reports = vec![
            report(STANDARD_WORKLOADS[0], 1_234_560, 0),
            report(STANDARD_WORKLOADS[2], 80_000, 20_000),
        ];
        let mut out = Vec::new();
        write_json_lines(&mut out, "nvme+tcp://127.0.0.1:4420/db", &reports).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<serde_json::Value> =
            text.lines().map(|line| serde_json::from_str(line).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        let first = &lines[0];
        assert_eq!(first["workload"], "4k_randread");
        assert_eq!(first["target"], "nvme+tcp://127.0.0.1:4420/db");
        assert_eq!(first["iops"], 123_456);
        assert_eq!(first["mb_per_s"], 505.7);
        assert_eq!(first["lat_mean_us"], 245.3);
        assert_eq!(first["lat_p999_us"], 2_500_000.0);
        assert_eq!(first["read_ops"], 1_234_560);
        assert_eq!(first["write_ops"], 0);
        assert!(first["write_lat_p99_us"].is_null());
        assert_eq!(first["errors"], 0);
        assert_eq!(first["verify_mismatches"], 0);
        assert_eq!(first["process_cpu_cores"], 0.93);
        assert_eq!(lines[1]["read_percent"], 80);
        assert_eq!(lines[1]["write_lat_p99_us"], 1234.0);
        for field in
            ["lat_p50_us", "lat_p99_us", "queues", "iodepth", "ramp_s", "runtime_s", "verify"]
        {
            assert!(!first[field].is_null(), "{field}");
        }
    }
}
