#!/usr/bin/env python3
"""Medians over several runs of scripts/compare-ceph.sh, as a markdown table.

One run of compare-ceph.sh measures Ferrite and Ceph one after the other on a shared, noisy
machine, so one run's ratio can be off by tens of percent. This script reads the results.jsonl
of several runs (each run's COMPARE_OUT_DIR), takes each run's own ratio per workload (Ferrite's
IOPS over Ceph's, Ceph's p99.9 over Ferrite's: both sides of a ratio always come from one run),
and prints, per replica count and workload, the median IOPS of each side, the median ratios and
the runs' range of each ratio, the median server CPU per I/O each IOPS goal leaves beside
Ferrite's, and the median of pgbench's TPS and its ratio. It reuses compare-report.py's
parsers, so it reads exactly what the tables of one run are made of. A run whose Ferrite side
lost a replica from the in-sync set during a workload is left out of that workload's medians
(compare-report.py's `replication_lost`: not like for like).

    scripts/compare-medians.py OUT_DIR_1 OUT_DIR_2 OUT_DIR_3 [...]

Each argument is a run's COMPARE_OUT_DIR or the archive compare-ceph.sh leaves in it,
run.tar.xz (results.jsonl with the fio and pgbench outputs it names), such as the runs kept in
docs/compare-runs/: medians over runs of earlier sessions, whose directories are gone.
"""

import importlib.util
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

def load_report_module():
    path = Path(__file__).with_name("compare-report.py")
    spec = importlib.util.spec_from_file_location("compare_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spread(values):
    return f"{min(values):.2f}-{max(values):.2f}x"


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    report = load_report_module()
    runs = []
    with tempfile.TemporaryDirectory(prefix="compare-medians-") as unpacked:
        for index, argument in enumerate(argv[1:]):
            directory = Path(argument)
            if directory.is_file():
                directory = Path(unpacked) / str(index)
                try:
                    with tarfile.open(argument) as archive:
                        # Regular files under the directory only, where Python can say so.
                        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                        archive.extractall(directory, **safe)
                except (OSError, tarfile.TarError) as error:
                    sys.exit(f"compare-medians: cannot unpack {argument}: {error}")
            results = directory / "results.jsonl"
            if not results.is_file():
                sys.exit(f"compare-medians: {results} does not exist (give each run's "
                         "COMPARE_OUT_DIR or its run.tar.xz)")
            meta, _fills, fios, pgbenches, _not_run, _disk_bound = report.load_results(results)
            runs.append((meta, fios, pgbenches))
    dates = ", ".join(meta.get("date_utc", "?") for meta, _, _ in runs)
    print(f"Medians of {len(runs)} runs ({dates}); each ratio is taken within one run.\n")
    print("| copies | workload | Ferrite IOPS | Ceph IOPS | IOPS Ferrite/Ceph (range) | "
          "p99.9 Ceph/Ferrite (range) | goals met (IOPS, p99.9) |")
    print("|---|---|---:|---:|---:|---:|---|")
    replica_counts = sorted({key[1] for _, fios, _ in runs for key in fios})
    for replicas, workload in [(r, w) for r in replica_counts for w in report.WORKLOADS]:
        # A run in which a replica left the in-sync set is not like for like: left out.
        pairs = [(fios[("ferrite", replicas, workload)], fios[("ceph", replicas, workload)])
                 for _, fios, _ in runs
                 if ("ferrite", replicas, workload) in fios and ("ceph", replicas, workload) in fios
                 and not report.replication_lost(fios[("ferrite", replicas, workload)])]
        if not pairs:
            continue
        iops_ratios = [f["iops"] / c["iops"] for f, c in pairs if c["iops"] > 0]
        p999_ratios = [c["lat_p999_us"] / f["lat_p999_us"] for f, c in pairs if f["lat_p999_us"] > 0]
        if not iops_ratios or not p999_ratios:
            continue
        iops_goal = report.IOPS_RATIO_GOAL[workload]
        iops_median, p999_median = statistics.median(iops_ratios), statistics.median(p999_ratios)
        met = (f"{'yes' if iops_median >= iops_goal else '**no**'} (>= {iops_goal:.0f}x), "
               f"{'yes' if p999_median >= report.P999_RATIO_GOAL else '**no**'}")
        print(f"| {replicas} | {workload} | {statistics.median(f['iops'] for f, _ in pairs):,.0f} | "
              f"{statistics.median(c['iops'] for _, c in pairs):,.0f} | {iops_median:.2f}x "
              f"({spread(iops_ratios)}) | {p999_median:.2f}x ({spread(p999_ratios)}) | {met} |")
    print("\nThe server CPU per I/O each IOPS goal leaves once fio took its share (compare-report.py's "
          "\"What the CPUs allow\"), medians of the runs' own figures:\n")
    print("| copies | workload | fio CPU us per I/O | left for the server, us per I/O | "
          "Ferrite server CPU us per I/O | Ferrite's server over it (range) |")
    print("|---|---|---:|---:|---:|---:|")
    for replicas, workload in [(r, w) for r in replica_counts for w in report.WORKLOADS]:
        budgets = [b for b in (report.cpu_budget(replicas, workload, fios, meta.get("host_cpus"))
                               for meta, fios, _ in runs) if b is not None]
        if not budgets:
            continue
        over = [server / left if left > 0 else float("inf") for _, _, left, server, _ in budgets]
        print(f"| {replicas} | {workload} | {statistics.median(b[1] for b in budgets):.1f} | "
              f"{statistics.median(b[2] for b in budgets):.1f} | {statistics.median(b[3] for b in budgets):.1f} | "
              f"{statistics.median(over):.2f}x ({spread(over)}) |")
    print("\n| copies | Ferrite TPS | Ceph TPS | TPS Ferrite/Ceph (range) |")
    print("|---|---:|---:|---:|")
    for replicas in sorted({key[1] for _, _, pgbenches in runs for key in pgbenches}):
        pairs = [(p[("ferrite", replicas)]["tps"], p[("ceph", replicas)]["tps"])
                 for _, _, p in runs
                 if p.get(("ferrite", replicas), {}).get("tps") and p.get(("ceph", replicas), {}).get("tps")]
        if not pairs:
            continue
        ratios = [f / c for f, c in pairs]
        print(f"| {replicas} | {statistics.median(f for f, _ in pairs):,.1f} | "
              f"{statistics.median(c for _, c in pairs):,.1f} | {statistics.median(ratios):.2f}x "
              f"({spread(ratios)}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
