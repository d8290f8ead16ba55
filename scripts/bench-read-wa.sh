#!/usr/bin/env bash
# What reads make the log write: the write amplification (WA) of each mixed workload on one node,
# and how much of it read defragmentation adds. A fresh node (sparse drive files, no parity,
# as `make compare-ceph` runs it), one volume, a sequential fill, then 4 KiB random writes
# (which scatter every range a later read covers over many batches), then the three mixed
# workloads in the standard order, each a `ferrite bench` run of its own over NVMe/TCP, with the
# node's /metrics read before and after each. Per workload it prints the host's reads and writes,
# what the drives took and why: host data and batch headers, GC copies, read defragmentation's
# copies (blocks a scattered read found and the engine appended back to back), checkpoints.
#
#   scripts/bench-read-wa.sh                       # read defragmentation on (the default)
#   DEFRAG=off scripts/bench-read-wa.sh            # the same with `--read-defrag off`
#   SIZE_GB=4 RUNTIME=30 scripts/bench-read-wa.sh
#
# Environment: DEFRAG (on), SIZE_GB (2: the volume; the node gets 4 drive files of that size),
# RUNTIME (15 s per workload) and RAMP (3 s; both counted: the metrics cover the whole run),
# FERRITE (a binary; default: the release build of this tree, built if missing).
#
# Columns: `host read`/`host wrote` are the volume's bytes (ferrite_volume_bytes_total);
# `drives took` is ferrite_device_bytes_written_total; `WA` = drives took / host wrote;
# `defrag` is ferrite_defrag_relocated_blocks_total in bytes and `per read` the same over the
# host's reads (the share of read bytes written again); `gc` is
# ferrite_gc_relocated_blocks_total in bytes. The rest of what the drives took is batch
# headers and checkpoints.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
only_help_args bench-read-wa "$@"
cd "$(dirname "$0")/.."
defrag=${DEFRAG:-on}
size_gb=${SIZE_GB:-2}
runtime=${RUNTIME:-15}
ramp=${RAMP:-3}
case "$defrag" in on | off) ;; *) echo "bench-read-wa: DEFRAG is on or off, not $defrag" >&2; exit 2 ;; esac
ferrite=${FERRITE:-./target/release/ferrite}
[ -n "${FERRITE:-}" ] || [ -x "$ferrite" ] || cargo build --release --locked --bin ferrite
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ferrite-read-wa.XXXXXX")
server=""
cleanup() {
    stop_server
    rm -rf "$work"
}
trap cleanup EXIT
alive() { kill -0 "$server" 2>/dev/null || { echo "bench-read-wa: the node exited; its log:" >&2; tail -20 "$work/up.log" >&2; exit 1; }; }

# Prints the counters this script uses, one "name value" per line, from the node's /metrics.
scrape() {
    curl -fsS "$FERRITE_API/metrics" | python3 -c '
import sys
want = {"ferrite_device_bytes_written_total", "ferrite_defrag_relocated_blocks_total",
        "ferrite_gc_relocated_blocks_total"}
got = {"read": 0, "write": 0}
for line in sys.stdin:
    name = line.split("{")[0].split(" ")[0]
    if name in want:
        got[name] = int(float(line.split()[-1]))
    elif name == "ferrite_volume_bytes_total":
        for op in ("read", "write"):
            if f"op=\"{op}\"" in line:
                got[op] += int(float(line.split()[-1]))
missing = want - got.keys()
if missing:
    sys.exit(f"bench-read-wa: /metrics lacks {sorted(missing)}")
for name, value in got.items():
    print(name, value)'
}

api_port=$(port); nvme_port=$(port)
export FERRITE_API=http://127.0.0.1:$api_port
"$ferrite" up --nbd-listen off --data-dir "$work/data" --drives 4 --drive-size "${size_gb}G" \
    --erasure-coding none --read-defrag "$defrag" --api-listen "127.0.0.1:$api_port" \
    --nvme-listen "127.0.0.1:$nvme_port" >"$work/up.log" 2>&1 &
server=$!
wait_for_node "$ferrite" || { alive; exit 1; }
"$ferrite" volume create rwa --size "${size_gb}G" >/dev/null
target="nvme+tcp://127.0.0.1:$nvme_port/rwa"
echo "bench-read-wa: one node, 4 x ${size_gb} GiB sparse drives, no parity, read defragmentation" \
    "$defrag; a ${size_gb} GiB volume filled, then each workload ${ramp} s + ${runtime} s" >&2
"$ferrite" bench --target "$target" --fill --workloads 4k_randwrite --runtime "$runtime" \
    --ramp "$ramp" --quiet >"$work/bench.out" 2>>"$work/bench.err" \
    || { alive; echo "bench-read-wa: the fill or the 4K writes failed:" >&2; tail -5 "$work/bench.err" >&2; exit 1; }
printf '%-17s %9s %10s %11s %6s %10s %8s %9s %9s\n' workload IOPS "host read" "host wrote" WA \
    "drives took" defrag "per read" gc
for workload in 8k_randrw_80_20 16k_randrw_70_30 32k_randrw_50_50; do
    before=$(scrape)
    "$ferrite" bench --target "$target" --workloads "$workload" --runtime "$runtime" \
        --ramp "$ramp" --quiet --json "$work/$workload.json" >"$work/bench.out" 2>>"$work/bench.err" \
        || { alive; echo "bench-read-wa: $workload failed:" >&2; tail -5 "$work/bench.err" >&2; exit 1; }
    after=$(scrape)
    python3 - "$workload" "$work/$workload.json" <<PY
import json, sys
before = dict(line.split() for line in """$before""".splitlines())
after = dict(line.split() for line in """$after""".splitlines())
d = {name: int(after[name]) - int(before[name]) for name in after}
gib = lambda n: f"{n / (1 << 30):.2f} GiB"
iops = json.load(open(sys.argv[2]))["iops"]
wrote, read = d["write"], d["read"]
defrag = d["ferrite_defrag_relocated_blocks_total"] * 4096
gc = d["ferrite_gc_relocated_blocks_total"] * 4096
took = d["ferrite_device_bytes_written_total"]
wa = f"{took / wrote:.2f}" if wrote else "-"
per_read = f"{defrag / read:.3f}" if read else "-"
print(f"{sys.argv[1]:<17} {iops:>9,.0f} {gib(read):>10} {gib(wrote):>11} {wa:>6} {gib(took):>11} "
      f"{gib(defrag):>8} {per_read:>9} {gib(gc):>9}")
PY
done
