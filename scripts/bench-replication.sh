#!/usr/bin/env bash
# The five standard workloads on a replicated volume with 1, 2 and 3 replicas, on a 3-node
# Ferrite cluster on this machine (a private etcd, three `ferrite up --cluster-etcd` nodes with
# their own data dirs, drives and ports), over NVMe/TCP to the volume's primary with
# `ferrite bench`; then three copies, each timed with its throughput: the resync of a replica
# that was stopped while part of the volume was written; the return of a primary killed with
# kill -9 in the middle of writes (its write intent keeps that return incremental); and the
# rebuild of a replica on a fourth node after its node stayed away past the grace period.
# Results go to stdout and to $OUT (JSON lines from `ferrite bench --json`).
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
#   GRACE_S     --rebuild-grace-s of the nodes            [5]
#   UP_ARGS     more `ferrite up` arguments for every node [none]
#   OUT         directory for logs and JSON               [a new temporary directory]
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
help_if_asked "$@"
cd "$(dirname "$0")/.."

FERRITE=${FERRITE:-target/release/ferrite}
REPLICAS=${REPLICAS:-1 2 3}
SIZE=${SIZE:-1G}
RUNTIME=${RUNTIME:-10}
RAMP=${RAMP:-2}
QUEUES=${QUEUES:-4}
IODEPTH=${IODEPTH:-32}
DRIVE_SIZE=${DRIVE_SIZE:-3G}
RESYNC_SIZE=${RESYNC_SIZE:-256M}
GRACE_S=${GRACE_S:-5}
UP_ARGS=${UP_ARGS:-}
OUT=${OUT:-$(mktemp -d /tmp/ferrite-bench-replication.XXXXXX)}
mkdir -p "$OUT"

if [ "$FERRITE" = target/release/ferrite ]; then
    cargo build --release --locked --bin ferrite >&2
fi
command -v etcd >/dev/null || { echo "etcd is not installed (scripts/deps.sh installs etcd-server)" >&2; exit 1; }
# The drive files are sparse, but a log-structured node writes its whole drives over time: six
# drive files (eight with the rebuild's fourth node) must fit, with room to spare, or the
# machine's disk fills up.
need_gib=$(python3 -c "import sys; s=sys.argv[1].upper(); u={'K':2**10,'M':2**20,'G':2**30,'T':2**40}; b=float(s[:-1])*u[s[-1]] if s[-1] in u else float(s); print(int(8*b/2**30)+4)" "$DRIVE_SIZE")
free_gib=$(df -BG --output=avail "$OUT" | tail -1 | tr -dc 0-9)
if [ "$free_gib" -lt "$need_gib" ]; then
    echo "$OUT has $free_gib GiB free; four nodes of two $DRIVE_SIZE drives need $need_gib GiB: free space or lower DRIVE_SIZE" >&2
    exit 1
fi

pids=()
cleanup() {
    stop_pids
    rm -rf "$OUT/etcd" "$OUT"/node*/
}
trap cleanup EXIT
start_etcd "$OUT/etcd" "$OUT/etcd.log"

declare -A api nvme pid_of
start_node() {  # name
    local name=$1 api_port nvme_port
    api_port=$(port); nvme_port=$(port)
    "$FERRITE" up --data-dir "$OUT/$name" --drives 2 --drive-size "$DRIVE_SIZE" \
        --api-listen "127.0.0.1:$api_port" --nvme-listen "127.0.0.1:$nvme_port" --nbd-listen off \
        --cluster-etcd "http://127.0.0.1:$etcd_port" --node-name "$name" \
        --replication-listen "127.0.0.1:$(port)" --rebuild-grace-s "$GRACE_S" \
        ${UP_ARGS} >>"$OUT/$name.log" 2>&1 &
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

# Writes the first SIZE bytes of VOLUME sequentially through its primary NODE.
fill() {  # volume node size
    "$FERRITE" bench --target "nvme+tcp://${nvme[$2]}/$1" --fill --size "$3" --quiet \
        --workloads 4k_randread --runtime 1 --ramp 0 >/dev/null 2>"$OUT/fill-$1.log"
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
fill "$volume" "$primary" "$RESYNC_SIZE"
start_node "$away"
started=$(date +%s.%N)
wait_in_sync "$volume" 3 >/dev/null
ended=$(date +%s.%N)
resynced=$("$FERRITE" volume show "$volume" --json --api "${api[$primary]}" | jq '.replication.local.blocks_resynced')
rate() {  # what started ended blocks
    python3 - "$@" <<'EOF'
import sys
what, start, end, blocks = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
seconds = end - start
mib = blocks * 4096 / 1048576
print(f"{what}: {blocks} blocks ({mib:.0f} MiB) in {seconds:.1f} s: {mib / seconds:.0f} MiB/s")
EOF
}
rate "resync (from the restart, start-up included)" "$started" "$ended" "$resynced"
"$FERRITE" volume delete "$volume" >/dev/null

# The return of a killed primary: kill -9 the primary of a 3-replica volume while it takes
# random writes to its first RESYNC_SIZE, let another replica take over, restart the old
# primary and time its copy. Its write intent says which regions it may have written without
# the others, so it copies those and what was written while it was away, not the volume.
volume=bench-return
"$FERRITE" volume create "$volume" --size "$SIZE" --replicas 3 --compression off >/dev/null
primary=$(wait_in_sync "$volume" 3)
fill "$volume" "$primary" "$SIZE"
echo "== return: kill -9 of $primary during random writes to the first $RESYNC_SIZE =="
"$FERRITE" bench --target "nvme+tcp://${nvme[$primary]}/$volume" --size "$RESYNC_SIZE" --quiet \
    --workloads 4k_randwrite --runtime 20 --ramp 0 >/dev/null 2>"$OUT/bench-return-writes.log" &
writer=$!
sleep 3
kill -KILL "${pid_of[$primary]}"
wait "${pid_of[$primary]}" 2>/dev/null || true
wait "$writer" 2>/dev/null || true  # its only path is gone: it fails, as a host without multipath
killed=$primary
export FERRITE_API=${api[node1]}
if [ "$killed" = node1 ]; then export FERRITE_API=${api[node2]}; fi
primary=$(wait_in_sync "$volume" 2)
echo "   $primary took over; restarting $killed"
start_node "$killed"
started=$(date +%s.%N)
full="" total="?"
for _ in $(seq 1 1200); do
    info=$("$FERRITE" volume show "$volume" --json --api "${api[$primary]}")
    copy=$(jq -c --arg n "$killed" '[.replication.resync[]? | select(.node == $n)][0] // empty' <<<"$info")
    if [ -n "$copy" ]; then
        full=$(jq -r '.full' <<<"$copy")
        total=$(jq -r '.blocks_total' <<<"$copy")
    fi
    [ "$(jq '.replication.in_sync | length' <<<"$info")" = 3 ] && break
    sleep 0.1
done
ended=$(date +%s.%N)
resynced=$(jq '.replication.local.blocks_resynced' <<<"$info")
echo "   copy to $killed: full copy: ${full:-not seen}, blocks_total $total of $(( $(numfmt --from=iec "$SIZE") / 4096 )) in the volume"
rate "return of the killed primary (from the restart, start-up included)" "$started" "$ended" "$resynced"
export FERRITE_API=${api[$primary]}
"$FERRITE" volume delete "$volume" >/dev/null

# Rebuild: a fourth node joins; one replica's node stops for good; after the grace period the
# manager puts a new replica on the fourth node, which is copied the whole volume.
volume=bench-rebuild
"$FERRITE" volume create "$volume" --size "$SIZE" --replicas 3 --compression off >/dev/null
primary=$(wait_in_sync "$volume" 3)
fill "$volume" "$primary" "$SIZE"
start_node node4
export FERRITE_API=${api[$primary]}
gone=""
for name in node1 node2 node3; do
    if [ "$name" != "$primary" ]; then gone=$name; break; fi
done
echo "== rebuild: $gone stops for good; node4 is the spare; grace ${GRACE_S} s =="
kill -KILL "${pid_of[$gone]}"
wait "${pid_of[$gone]}" 2>/dev/null || true
before=$("$FERRITE" volume show "$volume" --json | jq '.replication.local.blocks_resynced')
started=""
for _ in $(seq 1 3000); do
    info=$("$FERRITE" volume show "$volume" --json)
    if [ -z "$started" ] && jq -e '.replication.members | index("node4")' <<<"$info" >/dev/null; then
        started=$(date +%s.%N)
    fi
    if [ -n "$started" ] && [ "$(jq '.replication.in_sync | length' <<<"$info")" = 3 ]; then break; fi
    sleep 0.1
done
ended=$(date +%s.%N)
after=$(jq '.replication.local.blocks_resynced' <<<"$info")
rate "rebuild on node4 (from its placement)" "${started:-$ended}" "$ended" "$((after - before))"
echo "logs and JSON in $OUT"
