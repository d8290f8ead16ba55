#!/usr/bin/env bash
# Erasure coding across a node's drives (issue 5): the five standard workloads over NVMe/TCP on
# the same six drive files with no parity, 4+1 and 4+2, one node per scheme, in one run; then the
# rebuild throughput of a replaced drive under 4+1 and 4+2 (a drive of a filled volume is
# replaced with `ferrite drive replace` and timed until `node show` reports it healthy).
#
#   ROUNDS=3 RUNTIME=10 SIZE=2G scripts/bench-erasure.sh
#
# Environment: ROUNDS (1), RUNTIME (10 s per workload), RAMP (2 s), SIZE (2G: the volume, filled
# first), DRIVE_SIZE (4G per drive file, sparse), SCHEMES ("none 4+1 4+2"), REBUILD_SCHEMES
# ("4+1 4+2"), REBUILD_RATE (MB/s passed to --rebuild-mb-per-s; 0 = unlimited), OUT (a file the
# tables are appended to; default only stdout). Needs the release binary (built if missing).
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
help_if_asked "$@"
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-1}
runtime=${RUNTIME:-10}
ramp=${RAMP:-2}
size=${SIZE:-2G}
drive_size=${DRIVE_SIZE:-4G}
schemes=${SCHEMES:-"none 4+1 4+2"}
rebuild_schemes=${REBUILD_SCHEMES:-"4+1 4+2"}
rebuild_rate=${REBUILD_RATE:-0}
out=${OUT:-/dev/null}
ferrite=./target/release/ferrite
[ -x "$ferrite" ] || cargo build --release --locked --bin ferrite
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ferrite-erasure.XXXXXX")
server=""
cleanup() {
    stop_server
    rm -rf "$work"
}
trap cleanup EXIT
say() { echo "$@" | tee -a "$out"; }

# Starts a node with six drive files and erasure coding $1 in a fresh data dir; sets $target.
start_node() {
    local scheme=$1
    local api_port nvme_port
    api_port=$(port)
    nvme_port=$(port)
    rm -rf "$work/data"
    export FERRITE_API=http://127.0.0.1:$api_port
    "$ferrite" up --nbd-listen off --data-dir "$work/data" --drives 6 --drive-size "$drive_size" \
        --erasure-coding "$scheme" --rebuild-mb-per-s "$rebuild_rate" \
        --api-listen "127.0.0.1:$api_port" --nvme-listen "127.0.0.1:$nvme_port" \
        >>"$work/up.log" 2>&1 &
    server=$!
    wait_for_node "$ferrite"
    "$ferrite" volume create bench --size "$size" --compression off >/dev/null
    target="nvme+tcp://127.0.0.1:$nvme_port/nqn.2024-01.io.ferrite:vol:bench"
}

say "## erasure coding: five workloads ($(date -u +%FT%TZ), $(git rev-parse --short HEAD), $(nproc) CPUs)"
say "command: ROUNDS=$rounds RUNTIME=$runtime RAMP=$ramp SIZE=$size DRIVE_SIZE=$drive_size scripts/bench-erasure.sh"
for round in $(seq 1 "$rounds"); do
    for scheme in $schemes; do
        start_node "$scheme"
        "$ferrite" bench --target "$target" --fill --runtime "$runtime" --ramp "$ramp" \
            --quiet >"$work/bench.txt"
        say "round $round, erasure coding $scheme:"
        sed 's/^/    /' "$work/bench.txt" | tee -a "$out"
        stop_server
    done
done

say "## erasure coding: rebuild of a replaced drive (volume of $size filled)"
for scheme in $rebuild_schemes; do
    start_node "$scheme"
    "$ferrite" bench --target "$target" --fill --workloads 4k_randread --runtime 1 --ramp 0 \
        --quiet >/dev/null
    "$ferrite" drive replace 2 >/dev/null
    outcome=""
    for _ in $(seq 1 36000); do
        outcome=$("$ferrite" node show --json | python3 -c '
import json, sys
last = (json.load(sys.stdin).get("erasure") or {}).get("last_rebuild")
if last:
    mib = last["bytes_written"] / 1048576
    rate = mib / last["seconds"] if last["seconds"] > 0 else 0
    state = "finished" if last["finished"] else "FAILED: %s" % last.get("error")
    print("%s, %.0f MiB written in %.1f s: %.0f MiB/s" % (state, mib, last["seconds"], rate))')
        [ -n "$outcome" ] && break
        sleep 0.1
    done
    say "erasure coding $scheme, drive 2 of 6 replaced and rebuilt (volume of $size filled, rate limit ${rebuild_rate:-0} MiB/s): ${outcome:-did not finish}"
    stop_server
done
