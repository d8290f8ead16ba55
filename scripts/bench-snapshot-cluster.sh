#!/usr/bin/env bash
# What a snapshot of a replicated volume costs the hosts writing to it: a 3-node Ferrite cluster
# on this machine (a private etcd, three `ferrite up --cluster-etcd` nodes), a 3-replica volume,
# and 4K random writes over NVMe/TCP to its primary with `ferrite bench` (QUEUES x IODEPTH in
# flight), run ROUNDS times alternately without and with `ferrite snapshot create` every
# EVERY seconds during the run. Each snapshot holds the volume's writes on the primary until
# every write it took completed, snapshots each copy, and ends the hold; the node that took it
# logs `writes_held_ms`. Prints each run's IOPS, p99, p99.9 and max latency, each snapshot's
# command time and hold, and keeps the logs in $OUT.
#
# Usage: scripts/bench-snapshot-cluster.sh        (builds the release binary first)
# Environment (all optional):
#   FERRITE     the ferrite binary                   [target/release/ferrite]
#   SIZE        bytes of the volume written          [1G]
#   RUNTIME     measured seconds per run             [20]
#   ROUNDS      pairs of runs (without, with)        [3]
#   EVERY       seconds between snapshots            [2]
#   QUEUES      NVMe/TCP queues x IODEPTH requests   [4]
#   IODEPTH                                          [32]
#   DRIVE_SIZE  size of each node's two drive files  [3G]
#   OUT         directory for logs and JSON          [a new temporary directory]
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
only_help_args bench-snapshot-cluster.sh "$@"
cd "$(dirname "$0")/.."

FERRITE=${FERRITE:-target/release/ferrite}
SIZE=${SIZE:-1G}
RUNTIME=${RUNTIME:-20}
ROUNDS=${ROUNDS:-3}
EVERY=${EVERY:-2}
QUEUES=${QUEUES:-4}
IODEPTH=${IODEPTH:-32}
DRIVE_SIZE=${DRIVE_SIZE:-3G}
OUT=${OUT:-$(mktemp -d /tmp/ferrite-bench-snapshot-cluster.XXXXXX)}
mkdir -p "$OUT"

if [ "$FERRITE" = target/release/ferrite ]; then
    cargo build --release --locked --bin ferrite >&2
fi
command -v etcd >/dev/null || { echo "etcd is not installed (scripts/deps.sh installs etcd-server)" >&2; exit 1; }
command -v jq >/dev/null || { echo "jq is not installed (apt-get install jq)" >&2; exit 1; }

pids=()
cleanup() {
    stop_pids
    rm -rf "$etcd_dir" "$OUT"/node*/
}
trap cleanup EXIT
# etcd syncs every write: kept in RAM where there is /dev/shm, so a pause of the disk the nodes
# share does not also lapse their leases.
etcd_dir=$(mktemp -d /dev/shm/ferrite-bench-etcd.XXXXXX 2>/dev/null || echo "$OUT/etcd")
start_etcd "$etcd_dir" "$OUT/etcd.log"

declare -A api nvme
for name in node1 node2 node3; do
    api_port=$(port); nvme_port=$(port)
    "$FERRITE" up --data-dir "$OUT/$name" --drives 2 --drive-size "$DRIVE_SIZE" \
        --api-listen "127.0.0.1:$api_port" --nvme-listen "127.0.0.1:$nvme_port" --nbd-listen off \
        --cluster-etcd "http://127.0.0.1:$etcd_port" --node-name "$name" \
        --replication-listen "127.0.0.1:$(port)" >>"$OUT/$name.log" 2>&1 &
    pids+=($!)
    api[$name]=http://127.0.0.1:$api_port
    nvme[$name]=127.0.0.1:$nvme_port
    FERRITE_API=${api[$name]} wait_for_node "$FERRITE"
done
export FERRITE_API=${api[node1]}

volume=snapped
"$FERRITE" volume create "$volume" --size "$SIZE" --replicas 3 --compression off >/dev/null
primary=""
for _ in $(seq 1 600); do
    info=$("$FERRITE" volume show "$volume" --json 2>/dev/null || echo '{}')
    primary=$(jq -r '.replication.primary // empty' <<<"$info")
    # The store names a primary a moment before that node has taken up its term.
    if [ -n "$primary" ] && [ "$(jq '.replication.in_sync | length' <<<"$info")" = 3 ] &&
        [ "$("$FERRITE" volume show "$volume" --json --api "${api[$primary]}" 2>/dev/null |
            jq -r '.replication.local.serving')" = true ]; then
        break
    fi
    primary=""
    sleep 0.1
done
[ -n "$primary" ] || { echo "the volume got no primary with 3 replicas in sync" >&2; exit 1; }
target="nvme+tcp://${nvme[$primary]}/$volume"
echo "primary $primary; 4K random writes, $QUEUES x $IODEPTH in flight, ${RUNTIME}s per run; snapshots every ${EVERY}s"
"$FERRITE" bench --target "$target" --fill --size "$SIZE" --quiet --workloads 4k_randread \
    --runtime 1 --ramp 0 >/dev/null 2>"$OUT/fill.log"

run() {  # label
    "$FERRITE" bench --target "$target" --size "$SIZE" --workloads 4k_randwrite --queues "$QUEUES" \
        --iodepth "$IODEPTH" --runtime "$RUNTIME" --ramp 2 --quiet --json "$OUT/$1.json" \
        >/dev/null 2>"$OUT/$1.log"
    jq -r --arg name "$1" \
        '"\($name): \(.iops | floor) IOPS, p99 \(.lat_p99_us) us, p99.9 \(.lat_p999_us) us, max \(.lat_max_us) us"' \
        "$OUT/$1.json"
}

taken=0
for round in $(seq 1 "$ROUNDS"); do
    run "plain-$round"
    # Snapshots while the writes run: after the ramp, until the run is about to end.
    (
        sleep 3
        end=$((SECONDS + RUNTIME - 2))
        n=0
        while [ "$SECONDS" -lt "$end" ]; do
            n=$((n + 1))
            begin=$(date +%s%N)
            "$FERRITE" snapshot create "$volume" "r$round-s$n" >/dev/null
            echo "snapshot r$round-s$n: command $((($(date +%s%N) - begin) / 1000000)) ms"
            sleep "$EVERY"
        done
    ) >"$OUT/snapshots-$round.txt" &
    snapper=$!
    run "snapshots-$round"
    wait "$snapper"
    cat "$OUT/snapshots-$round.txt"
    taken=$((taken + $(wc -l <"$OUT/snapshots-$round.txt")))
    # The snapshots go, so that every round starts alike.
    for name in $("$FERRITE" snapshot list "$volume" --json | jq -r '.snapshots[].name'); do
        "$FERRITE" snapshot delete "$volume" "$name" >/dev/null
    done
done
echo "writes held per snapshot (ms, as the node that took it logged):"
cat "$OUT"/node*.log | sed 's/\x1b\[[0-9;]*m//g' | grep -o 'writes_held_ms=[0-9]*' | cut -d= -f2 |
    sort -n | awk '{ v[NR] = $1 } END { if (NR) printf "  %d snapshots: min %d, median %d, max %d\n", NR, v[1], v[int((NR + 1) / 2)], v[NR] }'
echo "$taken snapshots taken; logs in $OUT"
