#!/usr/bin/env bash
# The log-structured engine alone beside fio, in one run: the five standard workloads with
# `ferrite bench --target engine:DIR` (the engine inside the bench's own process, on io_uring, no
# network) and fio with io_uring + O_DIRECT on a raw file of the same size on the same
# filesystem, then both at queue depth 1 (4k_randread and 4k_randwrite, one queue of one
# request: the latency of a single I/O). Repeats the set ROUNDS times, alternating, and prints
# the medians: IOPS, p99.9 and CPU cores of each side with the median of the per-round ratios,
# then the QD1 mean and p99 latency of each side, then each round's figures with the engine's
# summary (write amplification, batches, syncs, GC). Both sides use QD = IODEPTH x QUEUES. CPU
# cores are CPU seconds per second of the measured window: the whole `ferrite bench` process
# (engine and request generator) against fio's jobs (fio's usr_cpu + sys_cpu).
#
#   scripts/bench-engine.sh            # defaults: 2 GiB volume, 4 x 4 GiB drives, 3 rounds
#   SIZE=4G ROUNDS=5 RUNTIME=20 scripts/bench-engine.sh
#   ERASURE=3+1 scripts/bench-engine.sh   # parity across the drives (default: the bench's, none)
#   THREADS=2 scripts/bench-engine.sh     # the engine's data-path threads (default: one per CPU)
#
# Environment: ROUNDS (3), RUNTIME (10 s per workload), RAMP (2 s), SIZE (2G: the engine's
# volume and fio's file, both filled first), DRIVE_SIZE (4G per drive file), IODEPTH (32),
# QUEUES (4), THREADS (--threads if set), ERASURE (--erasure-coding if set). Needs the release
# binary (built if missing) and fio (scripts/deps.sh installs it).
#
# Disk: every `ferrite bench` run lays out its 4 drive files first (writes 4 x DRIVE_SIZE of
# zeros, 16 GiB by default, about a second per GiB; two runs per round) and removes them at the
# end; fio's file is written whole before each of fio's two sets per round (see fio_fill()), as
# each engine run fills its volume first. The run refuses to start unless the filesystem of
# ${TMPDIR:-/var/tmp} has SIZE + 4 x DRIVE_SIZE + 1 GiB free.
#
# Before each measured set the script waits until the device has received the discards of the
# files removed before it (see settle()), so neither side runs beside another run's clean-up.
#
# Note what the peer is: fio writes without fsync, so its random-write figure is the drive's
# volatile-cache speed, while every engine write is durable when acknowledged.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
only_help_args bench-engine "$@"
cd "$(dirname "$0")/.."
size=${SIZE:-2G}
drive_size=${DRIVE_SIZE:-4G}
drives=4
rounds=${ROUNDS:-3}
runtime=${RUNTIME:-10}
ramp=${RAMP:-2}
iodepth=${IODEPTH:-32}
queues=${QUEUES:-4}
engine_args=(--drives "$drives" --drive-size "$drive_size")
[ -z "${THREADS:-}" ] || engine_args+=(--threads "$THREADS")
[ -z "${ERASURE:-}" ] || engine_args+=(--erasure-coding "$ERASURE")
ferrite=./target/release/ferrite
[ -x "$ferrite" ] || cargo build --release --locked --bin ferrite
command -v fio >/dev/null || scripts/deps.sh

# Bytes of a size as `ferrite bench` and fio read it (binary units: 2G is 2 GiB).
bytes() {
    python3 - "$1" <<'PY'
import re, sys
m = re.fullmatch(r"(\d+)\s*([kmgtp]?)(i?b)?", sys.argv[1].strip(), re.IGNORECASE)
if not m:
    sys.exit(f"bench-engine: '{sys.argv[1]}' is not a size such as 512M or 4G")
print(int(m[1]) << (10 * "bkmgtp".index((m[2] or "b").lower())))
PY
}
parent=${TMPDIR:-/var/tmp}
size_bytes=$(bytes "$size")
drive_size_bytes=$(bytes "$drive_size")
need_bytes=$((size_bytes + drives * drive_size_bytes + (1 << 30)))
free_bytes=$(($(df -Pk "$parent" | awk 'NR == 2 { print $4 }') * 1024))
if [ "$free_bytes" -lt "$need_bytes" ]; then
    echo "bench-engine: $parent has $((free_bytes >> 20)) MiB free; the raw file ($size), the" \
        "$drives laid-out drive files ($drive_size each) and 1 GiB to spare need" \
        "$((need_bytes >> 20)) MiB: free space, set TMPDIR to a larger filesystem, or lower" \
        "SIZE or DRIVE_SIZE" >&2
    exit 1
fi

# The block device under $parent, for settle(); empty if sysfs does not show one.
device_stat=""
device=$(df -P "$parent" | awk 'NR == 2 { print $1 }')
if [ -b "$device" ] && [ -r "/sys/class/block/$(basename "$(readlink -f "$device")")/stat" ]; then
    device_stat="/sys/class/block/$(basename "$(readlink -f "$device")")/stat"
fi

# Waits until the device has taken the discards of the files removed before. Each `ferrite
# bench` removes its drive files (16 GiB by default) at the end; on a filesystem mounted with
# `discard` (this machine's root) that sends the device discards it may take seconds to finish
# (a journal delays them further), and a read workload started meanwhile shares the device with
# them (measured once: the engine's 4K random reads 69K beside them, 70-76K in three runs
# without). So syncfs first, then the device's discarded-sector count must stay unchanged for
# 2 s (at most 120 s).
settle() {
    sync -f "$parent"
    [ -n "$device_stat" ] || { sleep 2; return; }
    local last now quiet=0
    last=$(awk '{ print $14 }' "$device_stat")
    for _ in $(seq 1 120); do
        sleep 1
        now=$(awk '{ print $14 }' "$device_stat")
        if [ "$now" = "$last" ]; then
            quiet=$((quiet + 1))
            [ "$quiet" -lt 2 ] || return 0
        else
            quiet=0
        fi
        last=$now
    done
    echo "bench-engine: the device still discarded after 120 s; going on" >&2
}

work=$(mktemp -d "$parent/ferrite-bench-engine.XXXXXX")
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

# One `ferrite bench` on a fresh engine: ROUND LABEL [extra args...]. Appends its rows to the
# results and the engine's summary line (stderr) to the summaries; shows stderr if it fails.
engine_run() {
    local round=$1 label=$2
    shift 2
    if ! "$ferrite" bench --target "engine:$work" --size "$size" "${engine_args[@]}" --fill \
        --runtime "$runtime" --ramp "$ramp" --quiet --json "$work/ferrite.json" "$@" \
        >/dev/null 2>"$work/ferrite.err"; then
        cat "$work/ferrite.err" >&2
        echo "bench-engine: ferrite bench failed in round $round ($label)" >&2
        exit 1
    fi
    settle
    printf '%s\t%s\t%s\n' "$round" "$label" "$(grep '^engine:' "$work/ferrite.err" | tail -n 1)" \
        >>"$work/summaries.tsv"
    python3 - "$work/ferrite.json" "$round" "$label" >>"$results" <<'PY'
import json, sys
prefix = "qd1_" if sys.argv[3] == "qd1" else ""
for line in open(sys.argv[1]):
    r = json.loads(line)
    cores = r.get("process_cpu_cores")
    print(f"{sys.argv[2]}\tferrite\t{prefix}{r['workload']}\t{r['iops']:.0f}\t{r['lat_mean_us']:.1f}"
          f"\t{r['lat_p99_us']:.1f}\t{r['lat_p999_us']:.1f}\t{'' if cores is None else cores}")
PY
}

fio_run() { # workload rw bs rwmixread numjobs iodepth
    fio --name="$1" --filename="$work/raw.dat" --size="$size" --rw="$2" --bs="$3" \
        ${4:+--rwmixread=$4} --direct=1 --ioengine=io_uring --iodepth="$6" \
        --numjobs="$5" --group_reporting --time_based --runtime="$runtime" \
        --ramp_time="$ramp" --lat_percentiles=1 --output-format=json
}
fio_row() { # round workload: one row from $work/fio.json
    python3 - "$work/fio.json" "$1" "$2" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
sides = [job[d] for d in ("read", "write") if job[d]["iops"] > 0]
iops = sum(s["iops"] for s in sides)
mean = sum(s["lat_ns"]["mean"] * s["iops"] for s in sides) / iops / 1000
def pct(key):
    return max(s["lat_ns"]["percentile"].get(key, 0) for s in sides) / 1000
# usr_cpu and sys_cpu are percentages of the jobs' summed runtime (job_runtime, ms): cores over
# the measured window are their sum times that runtime over the window.
runtime_s = sum(s["runtime"] for s in sides) / len(sides) / 1000
cores = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000 / runtime_s if runtime_s else 0
print(f"{sys.argv[2]}\tfio\t{sys.argv[3]}\t{iops:.0f}\t{mean:.1f}\t{pct('99.000000'):.1f}\t{pct('99.900000'):.1f}\t{cores:.2f}")
PY
}

# fio's file written whole, as `ferrite bench --fill` writes the engine's volume before each
# of its sets, so both sides read data written just before. With the file written once at the
# start, fio's first 4K read round (minutes and two engine runs after that write) was an outlier
# in three sessions here: 30.1K, 12.7K, 9.9K against 74-98K in the others; why was not found.
fio_fill() {
    fio --name=fill --filename="$work/raw.dat" --size="$size" --rw=write --bs=1M --direct=1 \
        --ioengine=io_uring --iodepth=16 >/dev/null
    settle
}

echo "each round writes the raw file ($size) before each fio set; each engine run lays out" \
    "$drives x $drive_size" >&2

workloads="4k_randread:randread:4k: 4k_randwrite:randwrite:4k: 8k_randrw_80_20:randrw:8k:80 16k_randrw_70_30:randrw:16k:70 32k_randrw_50_50:randrw:32k:50"
qd1_workloads="qd1_4k_randread:randread:4k: qd1_4k_randwrite:randwrite:4k:"
results="$work/results.tsv"
: >"$results"
: >"$work/summaries.tsv"
for round in $(seq 1 "$rounds"); do
    echo "round $round/$rounds: engine, engine QD1, fio, fio QD1" >&2
    engine_run "$round" standard --iodepth "$iodepth" --queues "$queues"
    engine_run "$round" qd1 --iodepth 1 --queues 1 --workloads 4k_randread,4k_randwrite
    fio_fill
    for spec in $workloads; do
        IFS=: read -r name rw bs mix <<<"$spec"
        fio_run "$name" "$rw" "$bs" "$mix" "$queues" "$iodepth" >"$work/fio.json"
        fio_row "$round" "$name" >>"$results"
    done
    fio_fill
    for spec in $qd1_workloads; do
        IFS=: read -r name rw bs mix <<<"$spec"
        fio_run "$name" "$rw" "$bs" "$mix" 1 1 >"$work/fio.json"
        fio_row "$round" "$name" >>"$results"
    done
done
python3 - "$results" "$work/summaries.tsv" "$iodepth" "$queues" <<'PY'
import statistics, sys
rows = [line.split("\t") for line in open(sys.argv[1]).read().split("\n") if line]
summaries = [line.split("\t", 2) for line in open(sys.argv[2]).read().split("\n") if line]
def median(side, workload, column):
    return statistics.median(float(r[column]) for r in rows if r[1] == side and r[2] == workload)
order = ["4k_randread", "4k_randwrite", "8k_randrw_80_20", "16k_randrw_70_30", "32k_randrw_50_50"]
print(f"QD {int(sys.argv[3]) * int(sys.argv[4])} ({sys.argv[4]} queues x {sys.argv[3]}):\n")
def cores(side, workload):
    values = [float(r[7]) for r in rows if r[1] == side and r[2] == workload and len(r) > 7 and r[7]]
    return f"{statistics.median(values):.2f}" if values else "-"
print("| workload | engine IOPS (median) | fio raw IOPS (median) | ratio (median of per-round ratios) | engine p99.9 us | fio p99.9 us | engine CPU cores | fio CPU cores |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for w in order:
    f = {r[0]: r for r in rows if r[1] == "ferrite" and r[2] == w}
    g = {r[0]: r for r in rows if r[1] == "fio" and r[2] == w}
    ratios = [float(f[k][3]) / float(g[k][3]) for k in f if k in g and float(g[k][3]) > 0]
    print(f"| {w} | {median('ferrite', w, 3):,.0f} | {median('fio', w, 3):,.0f} | "
          f"{statistics.median(ratios):.2f}x | {median('ferrite', w, 6):,.0f} | {median('fio', w, 6):,.0f} | "
          f"{cores('ferrite', w)} | {cores('fio', w)} |")
print("\nCPU cores: CPU seconds per second of the measured window, all threads: the engine's are the")
print("whole `ferrite bench` process (the engine and the bench's request generator), fio's its jobs'.")
print("\nQD1 (1 queue x 1), latency in microseconds (medians):\n")
print("| workload | engine mean | fio mean | engine p99 | fio p99 |")
print("|---|---:|---:|---:|---:|")
for w in ["qd1_4k_randread", "qd1_4k_randwrite"]:
    print(f"| {w[4:]} | {median('ferrite', w, 4):,.1f} | {median('fio', w, 4):,.1f} | "
          f"{median('ferrite', w, 5):,.1f} | {median('fio', w, 5):,.1f} |")
rounds = sorted(set(r[0] for r in rows), key=int)
print(f"\nrounds: {len(rounds)}; per-round rows (round side workload IOPS mean_us p99_us p99.9_us CPU_cores):")
for n in rounds:
    for r in rows:
        if r[0] == n:
            print("  " + " ".join(r))
    for s in summaries:
        if s[0] == n:
            print(f"  {n} {s[1]}: {s[2]}")
PY
