#!/usr/bin/env bash
# A/B of two `ferrite` binaries in one run: each round starts a fresh node from A, then from B
# (same drives, same volume, same workloads over NVMe/TCP with `ferrite bench`), so a change is
# measured against its parent on the same noisy machine minutes apart, not days apart.
#
#   ROUNDS=3 WORKLOADS=4k_randwrite,4k_randread scripts/bench-ab.sh OLD_BINARY NEW_BINARY
#
# Environment: ROUNDS (3), RUNTIME (8 s), RAMP (2 s), SIZE (2G volume, filled first), DRIVES (4),
# DRIVE_SIZE (4G), WORKLOADS (all five), A_ARGS / B_ARGS (extra `ferrite up` arguments for each
# side, e.g. B_ARGS="--erasure-coding none" when only B knows the flag). Prints each round's
# tables and then the median IOPS per workload and side.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
help_if_asked "$@"
if [ $# -ne 2 ] || [ "$1" = "--help" ]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
a=$1
b=$2
rounds=${ROUNDS:-3}
runtime=${RUNTIME:-8}
ramp=${RAMP:-2}
size=${SIZE:-2G}
drives=${DRIVES:-4}
drive_size=${DRIVE_SIZE:-4G}
workloads=${WORKLOADS:-4k_randread,4k_randwrite,8k_randrw_80_20,16k_randrw_70_30,32k_randrw_50_50}
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ferrite-ab.XXXXXX")
server=""
cleanup() {
    stop_server
    rm -rf "$work"
}
trap cleanup EXIT

# run SIDE BINARY EXTRA_ARGS: one node, one bench, JSON lines appended to $work/SIDE.jsonl.
run() {
    local side=$1 binary=$2 extra=$3
    local api_port nvme_port
    api_port=$(port)
    nvme_port=$(port)
    rm -rf "$work/data"
    export FERRITE_API=http://127.0.0.1:$api_port
    # shellcheck disable=SC2086 # extra is a list of arguments
    "$binary" up --nbd-listen off --data-dir "$work/data" --drives "$drives" \
        --drive-size "$drive_size" --api-listen "127.0.0.1:$api_port" \
        --nvme-listen "127.0.0.1:$nvme_port" $extra >>"$work/up-$side.log" 2>&1 &
    server=$!
    wait_for_node "$binary"
    "$binary" volume create ab --size "$size" --compression off >/dev/null
    "$binary" bench --target "nvme+tcp://127.0.0.1:$nvme_port/nqn.2024-01.io.ferrite:vol:ab" \
        --fill --workloads "$workloads" --runtime "$runtime" --ramp "$ramp" --quiet \
        --json "$work/last.jsonl" >"$work/table.txt"
    cat "$work/last.jsonl" >>"$work/$side.jsonl"
    echo "$side ($binary $extra):"
    sed 's/^/    /' "$work/table.txt"
    stop_server
}

echo "A/B $(date -u +%FT%TZ), $(nproc) CPUs: A=$a ${A_ARGS:-} B=$b ${B_ARGS:-}"
for round in $(seq 1 "$rounds"); do
    echo "round $round"
    run A "$a" "${A_ARGS:-}"
    run B "$b" "${B_ARGS:-}"
done
python3 - "$work/A.jsonl" "$work/B.jsonl" <<'EOF'
import json, statistics, sys
def medians(path):
    by = {}
    for line in open(path):
        row = json.loads(line)
        by.setdefault(row["workload"], []).append(row["iops"])
    return {name: statistics.median(values) for name, values in by.items()}
a, b = medians(sys.argv[1]), medians(sys.argv[2])
print("median IOPS   workload           A          B     B/A")
for name in a:
    print(f"              {name:<16} {a[name]:>9,.0f} {b[name]:>9,.0f}   {b[name] / a[name]:.2f}x")
EOF
