#!/usr/bin/env bash
# What fio's nbd engine can drive on this machine, beside what Ferrite serves: the ceiling of
# `make compare-ceph`'s one-copy rows (issue 7).
#
# Alternating rounds, the same fio job as `make compare-ceph` (ioengine=nbd, iodepth 32 x 4
# jobs, direct, random offsets, fresh buffers) against:
#   - ferrite: one `ferrite up` node as compare-ceph starts it (4 sparse drive files, no
#     parity, compression off), a volume written once with 1 MiB writes; every write durable;
#   - null:    nbdkit's null plugin (Debian `nbdkit`, installed with apt when missing), a server
#     that stores nothing: reads return zeros, writes are dropped. What fio reaches against it
#     is about what this client gets on this machine from a server with no storage work to do
#     (nbdkit's own protocol and socket work still takes CPU, shown beside it).
# Each line: IOPS, and the CPU the server and fio took, in cores and in microseconds per I/O
# (CPU time over the ramp and the run, from /proc for the server and getrusage for fio).
#
# Knobs (environment): ROUNDS (2), RUNTIME seconds per workload (15), RAMP seconds (3),
# SIZE_GB of the volume (2), WORKLOADS (4k_randread 4k_randwrite; also 8k_randrw_80_20,
# 16k_randrw_70_30, 32k_randrw_50_50), FERRITE_BIN (target/release/ferrite, built if missing),
# OUT directory for fio's JSON (a temporary one). Needs root only to install nbdkit.
#
#   scripts/bench-nbd-ceiling.sh
#   ROUNDS=3 WORKLOADS=4k_randwrite scripts/bench-nbd-ceiling.sh
set -euo pipefail
source "$(dirname "$0")/bench-lib.sh"
only_help_args bench-nbd-ceiling.sh "$@"

cd "$(dirname "$0")/.."
rounds=${ROUNDS:-2}
runtime=${RUNTIME:-15}
ramp=${RAMP:-3}
size_gb=${SIZE_GB:-2}
workloads=${WORKLOADS:-4k_randread 4k_randwrite}
bin=${FERRITE_BIN:-target/release/ferrite}
for value in "$rounds" "$runtime" "$ramp" "$size_gb"; do
    [[ $value =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS, RUNTIME, RAMP and SIZE_GB must be positive integers" >&2; exit 2; }
done
command -v fio >/dev/null || { echo "fio is missing: apt-get install fio" >&2; exit 1; }
[ -x /usr/bin/time ] || { echo "/usr/bin/time is missing: apt-get install time" >&2; exit 1; }
if ! command -v nbdkit >/dev/null; then
    echo "installing nbdkit with apt" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nbdkit >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nbdkit >/dev/null 2>&1; } ||
        { echo "cannot install nbdkit (apt-get install nbdkit)" >&2; exit 1; }
fi
[ -x "$bin" ] || cargo build --release --locked --bin ferrite >&2

work=$(mktemp -d /var/tmp/bench-nbd-ceiling.XXXXXX)
out=${OUT:-$work/fio}
mkdir -p "$out"
server=""
cleanup() {
    stop_server
    rm -rf "$work"
}
trap cleanup EXIT

fio_args() {
    case $1 in
        4k_randread) echo "--rw=randread --bs=4k" ;;
        4k_randwrite) echo "--rw=randwrite --bs=4k" ;;
        8k_randrw_80_20) echo "--rw=randrw --rwmixread=80 --bs=8k" ;;
        16k_randrw_70_30) echo "--rw=randrw --rwmixread=70 --bs=16k" ;;
        32k_randrw_50_50) echo "--rw=randrw --rwmixread=50 --bs=32k" ;;
        *) echo "unknown workload $1" >&2; exit 2 ;;
    esac
}
for workload in $workloads; do fio_args "$workload" >/dev/null; done

# Starts the side's server; sets $server (its PID) and $uri.
start_side() {
    local side=$1 nbd
    nbd=$(port)
    case $side in
        ferrite)
            local api data
            api=$(port)
            data=$work/ferrite
            rm -rf "$data"
            "$bin" up --data-dir "$data" --drives 4 --drive-size "$((size_gb + 1))G" \
                --erasure-coding none --api-listen "127.0.0.1:$api" --nvme-listen "127.0.0.1:$(port)" \
                --nbd-listen "127.0.0.1:$nbd" >"$work/ferrite.log" 2>&1 &
            server=$!
            export FERRITE_API=http://127.0.0.1:$api
            wait_for_node "$bin"
            "$bin" volume create v --size "${size_gb}G" --compression off >/dev/null
            uri=nbd://127.0.0.1:$nbd/v
            fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=16 \
                --size="${size_gb}G" --output-format=terse >/dev/null
            ;;
        null)
            nbdkit --foreground --exit-with-parent -i 127.0.0.1 -p "$nbd" null "${size_gb}G" &
            server=$!
            uri=nbd://127.0.0.1:$nbd/
            for _ in $(seq 1 200); do
                nbdinfo --size "$uri" >/dev/null 2>&1 && break
                sleep 0.05
            done
            ;;
    esac
}

server_cpu_ticks() { awk '{print $14 + $15}' "/proc/$server/stat"; }

results=$work/results.txt
: >"$results"
for round in $(seq 1 "$rounds"); do
    for side in ferrite null; do
        start_side "$side"
        for workload in $workloads; do
            json=$out/$side-$workload-$round.json
            before=$(server_cpu_ticks)
            # shellcheck disable=SC2046 # the workload's fio arguments are words
            fio_cpu=$( { /usr/bin/time -f '%U %S' fio --name="$workload" --ioengine=nbd --uri="$uri" \
                $(fio_args "$workload") --iodepth=32 --numjobs=4 --size="${size_gb}G" --direct=1 \
                --norandommap --randrepeat=0 --refill_buffers --time_based --runtime="$runtime" \
                --ramp_time="$ramp" --group_reporting --output-format=json --output="$json" \
                >/dev/null; } 2>&1 | tail -1)
            after=$(server_cpu_ticks)
            python3 - "$json" "$before" "$after" "$fio_cpu" "$((runtime + ramp))" "$side" "$round" \
                >>"$results" <<'PY'
import json, sys
path, before, after, fio_cpu, seconds, side, round_ = sys.argv[1:]
job = json.load(open(path))["jobs"][0]
iops = job["read"]["iops"] + job["write"]["iops"]
seconds = float(seconds)
server = (int(after) - int(before)) / 100 / seconds
fio = sum(float(part) for part in fio_cpu.split()) / seconds
print(side, job["jobname"], round_, f"{iops:.0f}", f"{server:.3f}", f"{fio:.3f}")
PY
            tail -1 "$results" | awk '{printf "round %s %-8s %-17s %8d IOPS  server %.2f cores  fio %.2f cores\n", $3, $1, $2, $4, $5, $6}' >&2
        done
        stop_server
    done
done

python3 - "$results" "$rounds" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
print(f"medians of {sys.argv[2]} rounds; us per I/O = CPU cores / IOPS")
print()
print("| workload | Ferrite IOPS | nbdkit null IOPS | Ferrite/null | Ferrite server us/IO | null server us/IO | fio us/IO vs Ferrite | fio us/IO vs null |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
workloads = list(dict.fromkeys(row[1] for row in rows))
for workload in workloads:
    def med(side, column):
        return statistics.median(float(r[column]) for r in rows if r[0] == side and r[1] == workload)
    def per_io(side, column):
        return statistics.median(
            float(r[column]) / float(r[3]) * 1e6 for r in rows if r[0] == side and r[1] == workload
        )
    ferrite, null = med("ferrite", 3), med("null", 3)
    print(f"| {workload} | {ferrite:,.0f} | {null:,.0f} | {ferrite / null:.2f}x | "
          f"{per_io('ferrite', 4):.1f} | {per_io('null', 4):.1f} | "
          f"{per_io('ferrite', 5):.1f} | {per_io('null', 5):.1f} |")
PY
