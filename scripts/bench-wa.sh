#!/usr/bin/env bash
# Write amplification (WA) of the log engine under steady 4 KiB random overwrite, at several
# fills. For each FILL (percent of the node's usable capacity, the `capacity.total_bytes` that
# `ferrite node show --json` reports): a fresh node on small drives, one volume of FILL% of that
# capacity, a sequential fill, then 4 KiB random writes over the whole volume until the host has
# written OVERWRITES times the volume size. The first WARMUP volume sizes of overwrite let GC
# reach its steady state; the rest is the measured steady window.
#
#   scripts/bench-wa.sh                                   # 4 x 1 GiB drives, fills 50 80 90
#   FILLS="80" OVERWRITES=5 WARMUP=2 DRIVES=4 DRIVE_SIZE=2G scripts/bench-wa.sh
#   ERASURE=3+1 scripts/bench-wa.sh                       # parity across the drives
#   (also QUEUES, IODEPTH, CHUNK_S_MAX: the longest single bench run, and FERRITE: a binary)
#
# ERASURE is the node's --erasure-coding, `none` by default: the log's own WA (batch headers, GC
# copies, checkpoints), which issue 4's goal is about. `ferrite up` alone would pick 3+1 on four
# drives; with parity K+M every data block also costs M/K parity blocks, so the WA printed is at
# least (K+M)/K before GC adds anything, and the usable capacity is K/(K+M) of the drives'.
#
# Host and device bytes come from /metrics: host bytes are the sum of
# `ferrite_volume_bytes_total{op="write"}`, device bytes `ferrite_device_bytes_written_total`
# (everything the engine writes: data, batch headers, GC copies, read defragmentation's copies,
# checkpoints, roots; parity with ERASURE). WA of a window = delta device bytes / delta host bytes. Exits non-zero if a node or an I/O
# fails (for example a capacity error at a high fill).
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
only_help_args bench-wa "$@"
cd "$(dirname "$0")/.."
fills=${FILLS:-50 80 90}
drives=${DRIVES:-4}
drive_size=${DRIVE_SIZE:-1G}
erasure=${ERASURE:-none}
overwrites=${OVERWRITES:-3}
warmup=${WARMUP:-1}
chunk_s_max=${CHUNK_S_MAX:-60}
queues=${QUEUES:-4}
iodepth=${IODEPTH:-32}
# FERRITE=path uses that binary as is; otherwise the release build of this tree.
ferrite=${FERRITE:-./target/release/ferrite}
python3 -c "import sys; sys.exit(0 if 0 <= $warmup < $overwrites else 1)" \
    || { echo "need 0 <= WARMUP < OVERWRITES" >&2; exit 2; }
[ -n "${FERRITE:-}" ] || cargo build --release --locked --bin ferrite
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ferrite-wa.XXXXXX")
server=""
cleanup() {
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"; wait "$server" || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# Prints "HOST_BYTES DEVICE_BYTES" from the node's /metrics.
scrape() {
    curl -fsS "$FERRITE_API/metrics" | python3 -c '
import sys
host, device = 0, None
for line in sys.stdin:
    if line.startswith("ferrite_volume_bytes_total{") and "op=\"write\"" in line:
        host += int(line.split()[-1])
    elif line.startswith("ferrite_device_bytes_written_total "):
        device = int(line.split()[-1])
if device is None:
    sys.exit("ferrite_device_bytes_written_total is missing from /metrics")
print(host, device)'
}
ratio() { python3 -c "import sys; d = $3 - $1; print(f'{($4 - $2) / d:.3f}' if d > 0 else 'n/a')"; }
alive() { kill -0 "$server" 2>/dev/null || { echo "the node (pid $server) died; see its log:" >&2; tail -20 "$work/up.log" >&2; return 1; }; }

# Overwrites until the host has written TARGET_BYTES since HOST0; appends "write_ops runtime_s"
# of each run to $2. Runs of at most chunk_s_max seconds, sized from the rate seen so far.
overwrite_until() { # target_bytes ops_file
    local target=$1 ops=$2 run_s host device snap
    while :; do
        snap=$(scrape); read -r host device <<<"$snap"
        [ $((host - host0)) -ge "$target" ] && return 0
        run_s=$(python3 -c "
left = $target - ($host - $host0)
print(int(min($chunk_s_max, max(3, left / $rate_bps + 1))) if $rate_bps > 0 else 3)")
        "$ferrite" bench --target "$nvme_target" --workloads 4k_randwrite --ramp 0 \
            --runtime "$run_s" --queues "$queues" --iodepth "$iodepth" --quiet \
            --json "$work/run.json" >/dev/null 2>>"$work/bench.err" \
            || { alive; echo "the bench failed at fill $fill%:" >&2; tail -5 "$work/bench.err" >&2; return 1; }
        alive
        python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).readline()); print(r["write_ops"], r["runtime_s"])' \
            "$work/run.json" >>"$ops"
        snap=$(scrape); read -r host2 device2 <<<"$snap"
        echo "  fill $fill%: overwritten $(python3 -c "print(f'{($host2 - $host0) / $vol_bytes:.2f}')") x the volume, WA of the last ${run_s} s $(ratio "$host" "$device" "$host2" "$device2")" >&2
        rate_bps=$(( (host2 - host) / run_s ))
    done
}
iops() { python3 -c 'import sys
ops = secs = 0
for line in open(sys.argv[1]):
    o, s = line.split(); ops += int(o); secs += float(s)
print(round(ops / secs) if secs else 0)' "$1"; }

table="$work/table.txt"
printf '%5s %10s %10s %10s %10s %10s %10s\n' fill% volume steady_WA overwr_WA cumul_WA steady_IOPS \
    overwr_IOPS >"$table"
for fill in $fills; do
    api_port=$(port); nvme_port=$(port)
    export FERRITE_API=http://127.0.0.1:$api_port
    data="$work/data-$fill"
    : >"$work/up.log"
    "$ferrite" up --nbd-listen off --data-dir "$data" --drives "$drives" --drive-size "$drive_size" \
        --erasure-coding "$erasure" --api-listen "127.0.0.1:$api_port" --nvme-listen "127.0.0.1:$nvme_port" >>"$work/up.log" 2>&1 &
    server=$!
    for _ in $(seq 1 600); do "$ferrite" node show >/dev/null 2>&1 && break; alive; sleep 0.1; done
    capacity=$("$ferrite" node show --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["capacity"]["total_bytes"])')
    # FILL% of the usable capacity, in whole MiB (volume sizes are multiples of 4 KiB, >= 1 MiB).
    vol_bytes=$(python3 -c "print($capacity * $fill // 100 // (1 << 20) * (1 << 20))")
    "$ferrite" volume create wa --size "$vol_bytes" >/dev/null
    nvme_target="nvme+tcp://127.0.0.1:$nvme_port/nqn.2024-01.io.ferrite:vol:wa"
    echo "fill $fill%: $drives x $drive_size drives, erasure coding $erasure, usable capacity $capacity bytes, volume $vol_bytes bytes" >&2
    "$ferrite" bench --target "$nvme_target" --fill --workloads 4k_randread --runtime 1 --ramp 0 \
        --quiet >/dev/null 2>>"$work/bench.err" \
        || { alive; echo "the sequential fill failed at fill $fill%:" >&2; tail -5 "$work/bench.err" >&2; exit 1; }
    rate_bps=0
    snap=$(scrape); read -r host0 device0 <<<"$snap"
    : >"$work/ops-warmup"; : >"$work/ops-steady"
    overwrite_until $((warmup * vol_bytes)) "$work/ops-warmup"
    snap=$(scrape); read -r host1 device1 <<<"$snap"
    overwrite_until $((overwrites * vol_bytes)) "$work/ops-steady"
    snap=$(scrape); read -r host2 device2 <<<"$snap"
    cat "$work/ops-warmup" "$work/ops-steady" >"$work/ops-all"
    printf '%5s %9sM %10s %10s %10s %10s %10s\n' "$fill" $((vol_bytes >> 20)) \
        "$(ratio "$host1" "$device1" "$host2" "$device2")" \
        "$(ratio "$host0" "$device0" "$host2" "$device2")" "$(ratio 0 0 "$host2" "$device2")" \
        "$(iops "$work/ops-steady")" "$(iops "$work/ops-all")" >>"$table"
    errors=$(grep -c ' ERROR ' "$work/up.log" || true)
    [ "$errors" -eq 0 ] || { echo "the node logged $errors ERROR lines at fill $fill%:" >&2; grep ' ERROR ' "$work/up.log" | head -5 >&2; exit 1; }
    kill -TERM "$server"; wait "$server" || true
    server=""
    rm -rf "$data"
done
echo "WA = device bytes / host bytes; steady: after ${warmup}x the volume of overwrite up to ${overwrites}x;"
echo "overwr: the whole overwrite phase; cumul: since the node started (fill included). 4 KiB random"
echo "writes, QD $queues x $iodepth, $drives x $drive_size drives, erasure coding $erasure."
cat "$table"
