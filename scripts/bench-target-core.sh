#!/usr/bin/env bash
# The issue's per-core measurement, in one run: 4 KiB random read and write IOPS of a Ferrite
# volume over NVMe/TCP with the target (`ferrite up --data-threads 1`) pinned to ONE core
# (taskset -c TARGET_CPU) and the initiator (`ferrite bench`) on another (INITIATOR_CPU), plus
# 4 KiB QD1 latency; beside fio (io_uring, O_DIRECT, pinned to INITIATOR_CPU) on a raw file of the
# same size on the same filesystem. Repeats everything ROUNDS times, alternating Ferrite and fio
# per workload so they share the machine's noise, and prints a markdown table of medians.
#
# Target cores are measured, not assumed: utime+stime of the `ferrite up` process
# (/proc/PID/stat, all its threads) over a window of RUNTIME seconds that starts RAMP/2 seconds
# into each bench, inside its steady state, divided by the window's wall time. "IOPS per target
# core" is IOPS / target cores. The initiator's cores are measured the same way (if it is at
# 1.00, the initiator and not the target limits the IOPS). fio's cores are its own usr+sys CPU.
# When the drives and not the target limit the IOPS (target cores well below 1), IOPS per target
# core is an extrapolation: the RAM-backed drives (DRIVE_BACKEND=memory) give the like-for-like
# figure. With them the node has no data dir (memory drives are NOT DURABLE; the node keeps its
# metadata in a scratch directory of its own), the drives are DRIVE_SIZE (default 4G) each, and
# fio's raw file goes to /dev/shm (RAM as well, buffered: O_DIRECT means nothing on tmpfs).
#
#   scripts/bench-target-core.sh                     # 1 GiB, QD32 (1 queue x 32), 3 rounds, 10 s
#   ROUNDS=5 RUNTIME=20 QUEUES=2 IODEPTH=16 scripts/bench-target-core.sh
#   DRIVE_BACKEND=memory scripts/bench-target-core.sh  # RAM drives on both sides
#   POLL_US=200 scripts/bench-target-core.sh           # the target busy-polls (up --poll-us)
#
# Each round also times a bare TCP request/response between the two CPUs (scripts/tcp-rtt.py):
# the floor under any QD1 latency over TCP on this machine, with no storage and no NVMe.
#
# Note what the peer is: fio writes without fsync, so its random-write figure is the drive's
# volatile-cache speed, while every Ferrite write is durable when acknowledged (an fdatasync of
# its drive, shared by the writes waiting for it). Other jobs on the machine add noise: look at
# the load averages printed before and after.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
help_if_asked "$@"
cd "$(dirname "$0")/.."
size=${SIZE:-1G}
rounds=${ROUNDS:-3}
runtime=${RUNTIME:-10}
ramp=${RAMP:-2}
queues=${QUEUES:-1}
iodepth=${IODEPTH:-32}
target_cpu=${TARGET_CPU:-0}
initiator_cpu=${INITIATOR_CPU:-1}
drive_backend=${DRIVE_BACKEND:-}
poll_us=${POLL_US:-0}
if [ "$drive_backend" = memory ]; then
    drive_size=${DRIVE_SIZE:-4G}
else
    drive_size=${DRIVE_SIZE:-8G}
fi
ferrite=${FERRITE:-./target/release/ferrite}
if [ "$ramp" -lt 1 ]; then
    echo "RAMP must be at least 1 s: the CPU window starts RAMP/2 s into each bench" >&2
    exit 1
fi
[ -x "$ferrite" ] || cargo build --release --locked --bin ferrite
command -v fio >/dev/null || scripts/deps.sh
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ferrite-core.XXXXXX")
# fio's raw file: beside the drive files, or in RAM for memory drives (set below).
raw="$work/raw.dat"
fio_direct=1

server=""
child=""
cleanup() {
    if [ -n "$child" ] && kill -0 "$child" 2>/dev/null; then
        kill -TERM "$child"; wait "$child" || true
    fi
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"; wait "$server" || true
    fi
    rm -rf "$work"
    [ "$raw" = "$work/raw.dat" ] || rm -f "$raw"
}
trap cleanup EXIT

echo "load before: $(uptime)"
api_port=$(port); nvme_port=$(port)
export FERRITE_API=http://127.0.0.1:$api_port
if [ "$drive_backend" = memory ]; then
    backend_args=(--drive-backend memory)
    raw=$(mktemp /dev/shm/ferrite-core-raw.XXXXXX)
    fio_direct=0
else
    backend_args=(--data-dir "$work/data")
    [ -n "$drive_backend" ] && backend_args+=(--drive-backend "$drive_backend")
fi
taskset -c "$target_cpu" "$ferrite" up --nbd-listen off --data-threads 1 --poll-us "$poll_us" \
    --drives 2 --drive-size "$drive_size" "${backend_args[@]}" \
    --api-listen "127.0.0.1:$api_port" --nvme-listen "127.0.0.1:$nvme_port" >"$work/up.log" 2>&1 &
server=$!
for _ in $(seq 1 100); do "$ferrite" node show >/dev/null 2>&1 && break; sleep 0.1; done
if ! kill -0 "$server" 2>/dev/null; then
    echo "ferrite up did not start:" >&2; cat "$work/up.log" >&2; exit 1
fi
"$ferrite" volume create core --size "$size" >/dev/null
target="nvme+tcp://127.0.0.1:$nvme_port/nqn.2024-01.io.ferrite:vol:core"

echo "filling the volume and the raw file ($size each)"
"$ferrite" bench --target "$target" --fill --workloads 4k_randread --runtime 1 --ramp 0 --quiet >/dev/null
fio --name=fill --filename="$raw" --size="$size" --rw=write --bs=1M --direct="$fio_direct" \
    --ioengine=io_uring --iodepth=16 >/dev/null

clock_ticks=$(getconf CLK_TCK)
# utime + stime of PID, all threads, in clock ticks (fields 14 and 15 of /proc/PID/stat; the
# command name in parentheses may hold spaces, so count from the last ')').
# Prints nothing if PID has ended.
cpu_ticks() { { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null || true; } | awk '{print $12 + $13}'; }
now() { date +%s.%N; }

results="$work/results.tsv"
# ferrite_run ROUND LABEL WORKLOAD QUEUES IODEPTH: one bench on INITIATOR_CPU, with the target's
# and the initiator's CPU sampled over the window RAMP/2 .. RAMP/2 + RUNTIME. A failed bench is
# recorded as such (its error printed) and the run goes on.
ferrite_run() {
    local round=$1 label=$2 workload=$3 q=$4 d=$5
    rm -f "$work/ferrite.json"
    taskset -c "$initiator_cpu" "$ferrite" bench --target "$target" --workloads "$workload" \
        --queues "$q" --iodepth "$d" --runtime "$runtime" --ramp "$ramp" --quiet \
        --json "$work/ferrite.json" >/dev/null 2>"$work/bench.err" &
    child=$!
    sleep "$(python3 -c "print($ramp / 2)")"
    local s0 c0 t0 s1 c1 t1 status=0
    s0=$(cpu_ticks "$server"); c0=$(cpu_ticks "$child"); t0=$(now)
    sleep "$runtime"
    s1=$(cpu_ticks "$server"); c1=$(cpu_ticks "$child"); t1=$(now)
    wait "$child" || status=$?
    child=""
    if [ "$status" -ne 0 ] || [ -z "$c1" ]; then
        echo "  ferrite bench $label failed (exit $status): $(head -c 400 "$work/bench.err")" >&2
        printf '%s\tferrite\t%s\tfailed\n' "$round" "$label" >>"$results"
        return
    fi
    python3 - "$work/ferrite.json" "$round" "$label" "$s0" "$s1" "$c0" "$c1" "$t0" "$t1" \
        "$clock_ticks" >>"$results" <<'PY'
import json, sys
path, round_, label = sys.argv[1:4]
s0, s1, c0, c1, t0, t1, hz = map(float, sys.argv[4:])
r = json.loads(open(path).readline())
target_cores = (s1 - s0) / hz / (t1 - t0)
initiator_cores = (c1 - c0) / hz / (t1 - t0)
print(f"{round_}\tferrite\t{label}\t{r['iops']:.0f}\t{r['lat_mean_us']:.1f}\t{r['lat_p99_us']:.1f}"
      f"\t{target_cores:.3f}\t{initiator_cores:.3f}")
PY
}

# fio_run ROUND LABEL RW QUEUES IODEPTH: fio on INITIATOR_CPU against the raw file.
fio_run() {
    local round=$1 label=$2 rw=$3 q=$4 d=$5
    taskset -c "$initiator_cpu" fio --name="$label" --filename="$raw" --size="$size" \
        --rw="$rw" --bs=4k --direct="$fio_direct" --ioengine=io_uring --iodepth="$d" --numjobs="$q" \
        --group_reporting --time_based --runtime="$runtime" --ramp_time="$ramp" \
        --lat_percentiles=1 --output-format=json >"$work/fio.json"
    python3 - "$work/fio.json" "$round" "$label" >>"$results" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
sides = [job[d] for d in ("read", "write") if job[d]["iops"] > 0]
iops = sum(side["iops"] for side in sides)
mean_us = sum(side["lat_ns"]["mean"] * side["iops"] for side in sides) / iops / 1000
p99_us = max(side["lat_ns"]["percentile"].get("99.000000", 0) for side in sides) / 1000
cores = (job["usr_cpu"] + job["sys_cpu"]) / 100
print(f"{sys.argv[2]}\tfio\t{sys.argv[3]}\t{iops:.0f}\t{mean_us:.1f}\t{p99_us:.1f}\t-\t{cores:.3f}")
PY
}

qd=$((queues * iodepth))
for round in $(seq 1 "$rounds"); do
    echo "round $round of $rounds"
    ferrite_run "$round" "4k_randread QD$qd" 4k_randread "$queues" "$iodepth"
    fio_run "$round" "4k_randread QD$qd" randread "$queues" "$iodepth"
    ferrite_run "$round" "4k_randwrite QD$qd" 4k_randwrite "$queues" "$iodepth"
    fio_run "$round" "4k_randwrite QD$qd" randwrite "$queues" "$iodepth"
    ferrite_run "$round" "4k_randread QD1" 4k_randread 1 1
    fio_run "$round" "4k_randread QD1" randread 1 1
    ferrite_run "$round" "4k_randwrite QD1" 4k_randwrite 1 1
    fio_run "$round" "4k_randwrite QD1" randwrite 1 1
    # The floor under any QD1 latency over TCP here: a bare request/response round trip between
    # the same two CPUs (scripts/tcp-rtt.py), no storage and no NVMe.
    scripts/tcp-rtt.py --server-cpu "$target_cpu" --client-cpu "$initiator_cpu" --count 5000 \
        | sed -n 's/.*median \([0-9.]*\) us.*/\1/p' >>"$work/rtt.txt"
done

if grep -q " ERROR " "$work/up.log"; then
    echo "warning: the node logged errors:" >&2
    grep " ERROR " "$work/up.log" >&2
fi
echo
echo "target: ferrite up --data-threads 1 --poll-us $poll_us on CPU $target_cpu${drive_backend:+, --drive-backend $drive_backend};" \
    "initiator and fio on CPU $initiator_cpu (fio's file in $(dirname "$raw")); $size, $rounds rounds," \
    "${runtime} s (+${ramp} s ramp) each"
python3 - "$results" "$qd" <<'PY'
import statistics, sys
rows = [line.split("\t") for line in open(sys.argv[1]).read().split("\n") if line]
qd = sys.argv[2]
order = [f"4k_randread QD{qd}", f"4k_randwrite QD{qd}", "4k_randread QD1", "4k_randwrite QD1"]
class Missing:
    """The median of no runs: prints as n/a whatever the format."""
    def __format__(self, spec):
        return "n/a"
def med(values):
    return statistics.median(values) if values else Missing()
print("| workload | Ferrite IOPS | target cores | Ferrite IOPS per target core | initiator cores "
      "| Ferrite mean / p99 us | fio IOPS | fio cores | fio mean / p99 us | Ferrite / fio IOPS |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for w in order:
    failed = sum(1 for r in rows if r[1] == "ferrite" and r[2] == w and r[3] == "failed")
    f = [r for r in rows if r[1] == "ferrite" and r[2] == w and r[3] != "failed"]
    g = [r for r in rows if r[1] == "fio" and r[2] == w]
    per_core = [float(r[3]) / float(r[6]) for r in f if float(r[6]) > 0]
    fio_by_round = {r[0]: float(r[3]) for r in g}
    ratios = [float(r[3]) / fio_by_round[r[0]] for r in f if fio_by_round.get(r[0], 0) > 0]
    ratio = f"{statistics.median(ratios):.2f}x" if ratios else "n/a"
    if failed:
        w += f" ({failed} Ferrite run(s) failed)"
    print(f"| {w} | {med([float(r[3]) for r in f]):,.0f} | {med([float(r[6]) for r in f]):.2f} | "
          f"{med(per_core):,.0f} | {med([float(r[7]) for r in f]):.2f} | "
          f"{med([float(r[4]) for r in f]):,.1f} / {med([float(r[5]) for r in f]):,.1f} | "
          f"{med([float(r[3]) for r in g]):,.0f} | {med([float(r[7]) for r in g]):.2f} | "
          f"{med([float(r[4]) for r in g]):,.1f} / {med([float(r[5]) for r in g]):,.1f} | "
          f"{ratio} |")
print("\nmedians over rounds; per-round rows (round, side, workload, IOPS, mean us, p99 us, "
      "target cores, initiator or fio cores):")
for r in rows:
    print("  " + " ".join(r))
PY
echo
python3 - "$work/rtt.txt" <<'PY'
import statistics, sys
values = [float(v) for v in open(sys.argv[1]).read().split()]
if values:
    print(f"TCP loopback round trip CPU to CPU (4 KiB answer, no storage; the floor under QD1 "
          f"latency over TCP): median {statistics.median(values):.1f} us over {len(values)} rounds")
PY
echo
echo "load after: $(uptime)"
if grep -q $'\tferrite\t.*\tfailed$' "$results"; then
    echo "some Ferrite runs failed: their errors are printed above" >&2
    exit 1
fi
