#!/usr/bin/env bash
# The five standard workloads on a replicated volume with 1, 2 and 3 replicas, on a 3-node
# Ferrite cluster on this machine (a private etcd, three `ferrite up --cluster-etcd` nodes with
# their own data dirs, drives and ports), over NVMe/TCP to the volume's primary with
# `ferrite bench`; then the resync throughput of a replica that was stopped while the volume
# was written. Results go to stdout and to $OUT (JSON lines from `ferrite bench --json`).
#
# Usage: scripts/bench-replication.sh        (builds the release binary first)
# Environment (all optional):
#   FERRITE     the ferrite binary                        [target/release/ferrite]
#   REPLICAS    replica counts to measure                 [1 2 3]
#   SIZE        bytes of each volume used                 [1G]
#   RUNTIME     measured seconds per workload             [10]
#   RAMP        ramp seconds per workload                 [2]
#   QUEUES      NVMe/TCP queues x IODEPTH requests        [4]
#   IODEPTH                                               [32]
#   DRIVE_SIZE  size of each node's two drive files       [3G]
#   RESYNC_SIZE bytes written while a replica is away     [256M]
#   OUT         directory for logs and JSON               [a new temporary directory]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench-lib.sh

FERRITE=${FERRITE:-target/release/ferrite}
REPLICAS=${REPLICAS:-1 2 3}
SIZE=${SIZE:-1G}
RUNTIME=${RUNTIME:-10}
RAMP=${RAMP:-2}
QUEUES=${QUEUES:-4}
IODEPTH=${IODEPTH:-32}
DRIVE_SIZE=${DRIVE_SIZE:-3G}
RESYNC_SIZE=${RESYNC_SIZE:-256M}
OUT=${OUT:-$(mktemp -d /tmp/ferrite-bench-replication.XXXXXX)}
mkdir -p "$OUT"

if [ "$FERRITE" = target/release/ferrite ]; then
    cargo build --release --locked --bin ferrite >&2
fi
command -v etcd >/dev/null || { echo "etcd is not installed (scripts/deps.sh installs etcd-server)" >&2; exit 1; }
# The drive files are sparse, but a log-structured node writes its whole drives over time: six
# drive files must fit, with room to spare, or the machine's disk fills up.
need_gib=$(python3 -c "import sys; s=sys.argv[1].upper(); u={'K':2**10,'M':2**20,'G':2**30,'T':2**40}; b=float(s[:-1])*u[s[-1]] if s[-1] in u else float(s); print(int(6*b/2**30)+4)" "$DRIVE_SIZE")
free_gib=$(df -BG --output=avail "$OUT" | tail -1 | tr -dc 0-9)
if [ "$free_gib" -lt "$need_gib" ]; then
    echo "$OUT has $free_gib GiB free; three nodes of two $DRIVE_SIZE drives need $need_gib GiB: free space or lower DRIVE_SIZE" >&2
    exit 1
fi

pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$OUT/etcd" "$OUT"/node*/
}
trap cleanup EXIT

etcd_port=$(port)
peer_port=$(port)
etcd --name bench --data-dir "$OUT/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "bench=http://127.0.0.1:$peer_port" >"$OUT/etcd.log" 2>&1 &
pids+=($!)

declare -A api nvme pid_of
start_node() {  # name
    local name=$1 api_port nvme_port
    api_port=$(port); nvme_port=$(port)
    "$FERRITE" up --data-dir "$OUT/$name" --drives 2 --drive-size "$DRIVE_SIZE" \
        --api-listen "127.0.0.1:$api_port" --nvme-listen "127.0.0.1:$nvme_port" --nbd-listen off \
        --cluster-etcd "http://127.0.0.1:$etcd_port" --node-name "$name" \
        --replication-listen "127.0.0.1:$(port)" >>"$OUT/$name.log" 2>&1 &
    pid_of[$name]=$!
    pids+=($!)
    api[$name]=http://127.0.0.1:$api_port
    nvme[$name]=127.0.0.1:$nvme_port
    FERRITE_API=${api[$name]} wait_for_node "$FERRITE"
}
for name in node1 node2 node3; do start_node "$name"; done
export FERRITE_API=${api[node1]}
"$FERRITE" cluster status

# Waits until VOLUME has every replica in sync and a primary that serves it (the store names a
# primary a moment before that node has taken up its term); prints the primary's name.
wait_in_sync() {  # volume replicas
    for _ in $(seq 1 600); do
        local info primary
        info=$("$FERRITE" volume show "$1" --json 2>/dev/null || true)
        primary=$(jq -r '.replication.primary // empty' <<<"${info:-{\}}")
        if [ -n "$primary" ] && [ "$(jq '.replication.in_sync | length' <<<"$info")" = "$2" ] &&
            [ "$("$FERRITE" volume show "$1" --json --api "${api[$primary]}" 2>/dev/null |
                jq -r '.replication.local.serving')" = true ]; then
            echo "$primary"
            return 0
        fi
        sleep 0.1
    done
    echo "volume $1 did not get a primary with $2 replicas in sync within a minute" >&2
    return 1
}

for replicas in $REPLICAS; do
    volume=bench-r$replicas
    "$FERRITE" volume create "$volume" --size "$SIZE" --replicas "$replicas" --compression off >/dev/null
    primary=$(wait_in_sync "$volume" "$replicas")
    echo "== $replicas replica(s): primary $primary (NVMe/TCP ${nvme[$primary]}) =="
    "$FERRITE" bench --target "nvme+tcp://${nvme[$primary]}/$volume" --fill --queues "$QUEUES" \
        --iodepth "$IODEPTH" --runtime "$RUNTIME" --ramp "$RAMP" --json "$OUT/r$replicas.json" \
        2>"$OUT/bench-r$replicas.log" | tee "$OUT/bench-r$replicas.txt"
    "$FERRITE" volume delete "$volume" >/dev/null
done

# Resync: stop one replica of a 3-replica volume, write part of the volume while it is away,
# start it again and time how long it takes to be back in sync (it copies only what changed).
volume=bench-resync
"$FERRITE" volume create "$volume" --size "$SIZE" --replicas 3 --compression off >/dev/null
primary=$(wait_in_sync "$volume" 3)
away=""
for name in node1 node2 node3; do
    if [ "$name" != "$primary" ] && [ "$name" != node1 ]; then away=$name; break; fi
done
kill -TERM "${pid_of[$away]}"
wait "${pid_of[$away]}" 2>/dev/null || true
for _ in $(seq 1 300); do
    [ "$("$FERRITE" volume show "$volume" --json | jq '.replication.in_sync | length')" = 2 ] && break
    sleep 0.1
done
echo "== resync: $away stopped; writing the first $RESYNC_SIZE of $volume through $primary =="
"$FERRITE" bench --target "nvme+tcp://${nvme[$primary]}/$volume" --fill --size "$RESYNC_SIZE" \
    --workloads 4k_randread --runtime 1 --ramp 0 >/dev/null 2>"$OUT/bench-resync-fill.log"
start_node "$away"
started=$(date +%s.%N)
wait_in_sync "$volume" 3 >/dev/null
ended=$(date +%s.%N)
resynced=$("$FERRITE" volume show "$volume" --json --api "${api[$primary]}" | jq '.replication.local.blocks_resynced')
python3 - "$started" "$ended" "$resynced" <<'EOF'
import sys
start, end, blocks = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
seconds = end - start
mib = blocks * 4096 / 1048576
print(f"resync: {blocks} blocks ({mib:.0f} MiB) in {seconds:.1f} s from the restart: "
      f"{mib / seconds:.0f} MiB/s (start-up included)")
EOF
echo "logs and JSON in $OUT"
