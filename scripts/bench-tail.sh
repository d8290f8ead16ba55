#!/usr/bin/env bash
# Where a node's write-latency tails come from under a mixed workload that runs the log full.
# A fresh node (4 sparse drive files of DRIVE_SIZE_GB, no erasure coding), one volume of SIZE_GB
# written once sequentially, then fio over NBD: random reads and writes of BS (MIX percent reads), iodepth 32
# x 4 jobs, for RUNTIME seconds, as in `make compare-ceph`'s mixed workloads. The drives hold
# four times the volume, so the log fills and GC starts partway through the run.
#
#   scripts/bench-tail.sh                     # 32 KiB, 50% reads, 30 s
#   BS=16k MIX=70 scripts/bench-tail.sh
#   FERRITE=/path/to/ferrite OUT=/var/tmp/x scripts/bench-tail.sh   # another build; keep results
#   PRE4K=15 scripts/bench-tail.sh            # 15 s of 4 KiB random writes first, as the 4K write
#                                             # workload before the mixed ones in `make compare-ceph`:
#                                             # the volume's blocks end up scattered over the log
#   SIZE_GB=4 DRIVE_SIZE_GB=3 PRE4K=30 scripts/bench-tail.sh   # sized as `make compare-ceph`
#
# Environment: BS (32k), MIX (50), RUNTIME (30 s), PRE4K (0 s), SIZE_GB (2: the volume),
# DRIVE_SIZE_GB (2: each of the 4 drive files), FERRITE (a binary; default: the release build),
# OUT (a directory to keep the results in).
#
# Prints reads/s and writes/s with their p50, p99 and p99.9 (fio's total latency), the largest
# write latency of each second of the run, and per second of the run the segments GC cleaned,
# the blocks it relocated, the segments host writes had to clean themselves (their thread's
# writes waiting meanwhile: background GC behind; 0 from builds without that counter) and the
# checkpoints taken (from /metrics, sampled every 0.1 s), so a latency step can be matched with
# what the node was doing. Needs fio with its nbd engine.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
help_if_asked "$@"
cd "$(dirname "$0")/.."
bs=${BS:-32k}
mix=${MIX:-50}
runtime=${RUNTIME:-30}
pre4k=${PRE4K:-0}
size_gb=${SIZE_GB:-2}
drive_size_gb=${DRIVE_SIZE_GB:-2}
for knob in "$size_gb" "$drive_size_gb"; do
    [[ $knob =~ ^[1-9][0-9]*$ ]] || { echo "bench-tail: SIZE_GB and DRIVE_SIZE_GB are whole GiB, not '$knob'" >&2; exit 2; }
done
[[ $pre4k =~ ^[0-9]+$ ]] || { echo "bench-tail: PRE4K='$pre4k' is not a number of seconds" >&2; exit 2; }
if [[ -n ${FERRITE:-} ]]; then
    ferrite=$FERRITE
else
    cargo build --release --quiet --bin ferrite
    ferrite=target/release/ferrite
fi
keep=${OUT:+1}
out=${OUT:-$(mktemp -d /var/tmp/ferrite-bench-tail-XXXXXX)}
mkdir -p "$out"
api=127.0.0.1:$(port)
nbd=127.0.0.1:$(port)
nvme=127.0.0.1:$(port)
node_pid=
sampler_pid=
cleanup() {
    [[ -n $sampler_pid ]] && kill "$sampler_pid" 2>/dev/null || true
    if [[ -n $node_pid ]]; then
        kill -TERM "$node_pid" 2>/dev/null || true
        wait "$node_pid" 2>/dev/null || true
    fi
    [[ -z $keep ]] && rm -rf "$out"
    return 0
}
trap cleanup EXIT
"$ferrite" up --data-dir "$out/node" --drives 4 --drive-size "${drive_size_gb}G" --erasure-coding none \
    --api-listen "$api" --nbd-listen "$nbd" --nvme-listen "$nvme" >"$out/node.log" 2>&1 &
node_pid=$!
for _ in $(seq 1 150); do
    "$ferrite" node show --api "http://$api" >/dev/null 2>&1 && break
    kill -0 "$node_pid" 2>/dev/null || { tail -20 "$out/node.log"; exit 1; }
    sleep 0.2
done
"$ferrite" volume create tail --size "${size_gb}G" --compression off --api "http://$api" >/dev/null
fio --name=fill --ioengine=nbd --uri="nbd://$nbd/tail" --rw=write --bs=1M --iodepth=8 --size="${size_gb}G" \
    --direct=1 --output="$out/fill.txt" >/dev/null
if [[ $pre4k -gt 0 ]]; then
    fio --name=pre4k --ioengine=nbd --uri="nbd://$nbd/tail" --rw=randwrite --bs=4k --iodepth=32 \
        --numjobs=4 --size="${size_gb}G" --direct=1 --norandommap --randrepeat=0 --refill_buffers \
        --group_reporting --time_based --runtime="$pre4k" --output="$out/pre4k.txt" >/dev/null
fi
(
    while kill -0 "$node_pid" 2>/dev/null; do
        echo "T $(date +%s.%N)"
        curl -s "http://$api/metrics" | grep -E '^ferrite_(checkpoints_total|gc_segments_cleaned_total|gc_segments_cleaned_inline_total|gc_relocated_blocks_total) ' || true
        sleep 0.1
    done >"$out/metrics.txt"
) &
sampler_pid=$!
date +%s.%N >"$out/start"
fio --name=mix --ioengine=nbd --uri="nbd://$nbd/tail" --rw=randrw --rwmixread="$mix" --bs="$bs" \
    --iodepth=32 --numjobs=4 --size="${size_gb}G" --direct=1 --norandommap --randrepeat=0 --refill_buffers \
    --group_reporting --time_based --runtime="$runtime" --lat_percentiles=1 \
    --write_lat_log="$out/lat" --log_avg_msec=100 --log_max_value=1 \
    --output-format=json --output="$out/mix.json" >/dev/null
python3 - "$out" <<'EOF'
import collections, glob, json, sys
out = sys.argv[1]
job = json.load(open(f"{out}/mix.json"))["jobs"][0]
for kind in ("read", "write"):
    p = job[kind]["lat_ns"]["percentile"]
    ms = {q: p[key] / 1e6 for q, key in (("p50", "50.000000"), ("p99", "99.000000"), ("p99.9", "99.900000"))}
    print(f"{kind}s/s {job[kind]['iops']:.0f}  " + "  ".join(f"{q} {v:.1f} ms" for q, v in ms.items()))
worst = collections.defaultdict(int)
for path in glob.glob(f"{out}/lat_lat.*.log"):
    for line in open(path):
        msec, value, direction, *_ = [field.strip() for field in line.split(",")]
        if direction == "1":
            worst[int(msec) // 1000] = max(worst[int(msec) // 1000], int(value))
print("largest write latency per second, ms:", " ".join(str(round(worst[s] / 1e6)) for s in sorted(worst)))
start = float(open(f"{out}/start").read())
per_second = {}
for line in open(f"{out}/metrics.txt"):
    if line.startswith("T "):
        now = int(float(line.split()[1]) - start)
        per_second.setdefault(now, {})
    elif per_second:
        name, value = line.split()
        per_second[now][name.removeprefix("ferrite_")] = float(value)
names = ("gc_segments_cleaned_total", "gc_relocated_blocks_total", "gc_segments_cleaned_inline_total", "checkpoints_total")
print("second: GC segments cleaned, blocks relocated, segments host writes cleaned inline, checkpoints taken")
previous = first = None
for second in sorted(per_second):
    sample = per_second[second]
    if "checkpoints_total" not in sample:
        continue  # a scrape cut short
    if previous is not None and second >= 0:
        print(f"{second:4d}: " + " ".join(f"{sample.get(n, 0) - previous.get(n, 0):.0f}" for n in names))
    if second >= 0 and first is None:
        first = previous if previous is not None else sample
    previous = sample
if first is not None and previous is not None:
    print("during the mix: " + ", ".join(f"{n} {previous.get(n, 0) - first.get(n, 0):.0f}" for n in names))
EOF
