#!/usr/bin/env bash
# Side by side, in one run: the five standard workloads against a Ferrite volume over NVMe/TCP
# (`ferrite bench`), and fio with io_uring + O_DIRECT on a raw file of the same size on the same
# filesystem (the "local drive" peer). Repeats the pair ROUNDS times, alternating, and prints
# each round's figures and the median ratio per workload. Both sides use QD = IODEPTH x QUEUES.
#
#   scripts/bench-vs-fio.sh            # defaults: 2 GiB, 3 rounds, 10 s per workload
#   SIZE=4G ROUNDS=5 RUNTIME=20 scripts/bench-vs-fio.sh
#   COMPRESSION=off scripts/bench-vs-fio.sh   # the volume's compression (default lz4, as
#                                             # `volume create`); the data is random, so lz4
#                                             # only costs CPU here
#   ERASURE=3+1 scripts/bench-vs-fio.sh       # the node's erasure coding (default none: this
#                                             # measures the log engine itself; the default
#                                             # of `ferrite up` on 4 drives is 3+1)
#
# Note what the peer is: fio writes without fsync, so its random-write figure is the drive's
# volatile-cache speed, while every Ferrite write is durable when acknowledged.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
help_if_asked "$@"
cd "$(dirname "$0")/.."
size=${SIZE:-2G}
rounds=${ROUNDS:-3}
runtime=${RUNTIME:-10}
ramp=${RAMP:-2}
iodepth=${IODEPTH:-32}
queues=${QUEUES:-4}
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ferrite-bench.XXXXXX")
ferrite=./target/release/ferrite
[ -x "$ferrite" ] || cargo build --release --locked --bin ferrite
command -v fio >/dev/null || scripts/deps.sh

server=""
cleanup() {
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"; wait "$server" || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

api_port=$(port); nvme_port=$(port)
export FERRITE_API=http://127.0.0.1:$api_port
"$ferrite" up --nbd-listen off --data-dir "$work/data" --api-listen "127.0.0.1:$api_port" \
    --nvme-listen "127.0.0.1:$nvme_port" --erasure-coding "${ERASURE:-none}" >"$work/up.log" 2>&1 &
server=$!
for _ in $(seq 1 100); do "$ferrite" node show >/dev/null 2>&1 && break; sleep 0.1; done
"$ferrite" volume create bench --size "$size" --compression "${COMPRESSION:-lz4}" >/dev/null
target="nvme+tcp://127.0.0.1:$nvme_port/nqn.2024-01.io.ferrite:vol:bench"

echo "filling the volume and the raw file ($size each)"
"$ferrite" bench --target "$target" --fill --workloads 4k_randread --runtime 1 --ramp 0 --quiet >/dev/null
fio --name=fill --filename="$work/raw.dat" --size="$size" --rw=write --bs=1M --direct=1 \
    --ioengine=io_uring --iodepth=16 >/dev/null

fio_run() { # workload rw bs rwmixread
    fio --name="$1" --filename="$work/raw.dat" --size="$size" --rw="$2" --bs="$3" \
        ${4:+--rwmixread=$4} --direct=1 --ioengine=io_uring --iodepth="$iodepth" \
        --numjobs="$queues" --group_reporting --time_based --runtime="$runtime" \
        --ramp_time="$ramp" --lat_percentiles=1 --output-format=json
}
workloads="4k_randread:randread:4k: 4k_randwrite:randwrite:4k: 8k_randrw_80_20:randrw:8k:80 16k_randrw_70_30:randrw:16k:70 32k_randrw_50_50:randrw:32k:50"
results="$work/results.tsv"
for round in $(seq 1 "$rounds"); do
    "$ferrite" bench --target "$target" --iodepth "$iodepth" --queues "$queues" \
        --runtime "$runtime" --ramp "$ramp" --quiet --json "$work/ferrite.json" >/dev/null
    python3 - "$work/ferrite.json" "$round" >>"$results" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{sys.argv[2]}\tferrite\t{r['workload']}\t{r['iops']:.0f}\t{r['lat_p99_us']:.0f}\t{r['lat_p999_us']:.0f}")
PY
    for spec in $workloads; do
        IFS=: read -r name rw bs mix <<<"$spec"
        fio_run "$name" "$rw" "$bs" "$mix" >"$work/fio.json"
        python3 - "$work/fio.json" "$round" "$name" >>"$results" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
iops = job["read"]["iops"] + job["write"]["iops"]
def pct(key):
    values = [job[d]["lat_ns"]["percentile"].get(key, 0) for d in ("read", "write") if job[d]["iops"] > 0]
    return max(values) / 1000
print(f"{sys.argv[2]}\tfio\t{sys.argv[3]}\t{iops:.0f}\t{pct('99.000000'):.0f}\t{pct('99.900000'):.0f}")
PY
    done
done
python3 - "$results" <<'PY'
import statistics, sys
rows = [line.split("\t") for line in open(sys.argv[1]).read().split("\n") if line]
order = ["4k_randread", "4k_randwrite", "8k_randrw_80_20", "16k_randrw_70_30", "32k_randrw_50_50"]
print("| workload | Ferrite IOPS (median) | fio raw IOPS (median) | ratio (median of per-round ratios) | Ferrite p99.9 us | fio p99.9 us |")
print("|---|---:|---:|---:|---:|---:|")
for w in order:
    f = {r[0]: r for r in rows if r[1] == "ferrite" and r[2] == w}
    g = {r[0]: r for r in rows if r[1] == "fio" and r[2] == w}
    ratios = [float(f[k][3]) / float(g[k][3]) for k in f if k in g and float(g[k][3]) > 0]
    print(f"| {w} | {statistics.median(float(r[3]) for r in f.values()):,.0f} | "
          f"{statistics.median(float(r[3]) for r in g.values()):,.0f} | {statistics.median(ratios):.2f}x | "
          f"{statistics.median(float(r[5]) for r in f.values()):,.0f} | {statistics.median(float(r[5]) for r in g.values()):,.0f} |")
print(f"\nrounds: {len(set(r[0] for r in rows))}; per-round rows:")
for r in rows:
    print("  " + " ".join(r))
PY
