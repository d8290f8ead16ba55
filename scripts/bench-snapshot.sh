#!/usr/bin/env bash
# Snapshot creation and deletion time on a volume with BLOCKS mapped 4 KiB blocks (default one
# million, 4 GiB): fills the volume, then times `ferrite snapshot create` ROUNDS times (4K random
# writes between them, so each snapshot holds different data), and `ferrite snapshot list` as
# the floor of one CLI round trip; then 4K random read IOPS through the chain of snapshots
# against the same volume before any snapshot, and the deletion of every snapshot.
#
#   BLOCKS=1048576 ROUNDS=5 scripts/bench-snapshot.sh
#   ERASURE=none scripts/bench-snapshot.sh   # the node's --erasure-coding; by default the node's
#                                            # own choice (3+1 on its four drives); the output
#                                            # names the layout measured
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
help_if_asked "$@"
cd "$(dirname "$0")/.."
blocks=${BLOCKS:-1048576}
rounds=${ROUNDS:-5}
erasure_args=()
[ -z "${ERASURE:-}" ] || erasure_args=(--erasure-coding "$ERASURE")
ferrite=./target/release/ferrite
[ -x "$ferrite" ] || cargo build --release --locked --bin ferrite
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ferrite-snapshot.XXXXXX")
server=""
cleanup() {
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"; wait "$server" || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
# Milliseconds a command takes, wall clock.
timed_ms() {
    local begin end
    begin=$(date +%s%N)
    "$@" >/dev/null
    end=$(date +%s%N)
    echo $(((end - begin) / 1000000))
}

api_port=$(port); nvme_port=$(port)
export FERRITE_API=http://127.0.0.1:$api_port
"$ferrite" up --nbd-listen off --data-dir "$work/data" --api-listen "127.0.0.1:$api_port" \
    --nvme-listen "127.0.0.1:$nvme_port" "${erasure_args[@]}" >>"$work/up.log" 2>&1 &
server=$!
for _ in $(seq 1 1200); do "$ferrite" node show >/dev/null 2>&1 && break; sleep 0.05; done
size=$((blocks * 4096))
"$ferrite" volume create snap --size "$size" >/dev/null
target="nvme+tcp://127.0.0.1:$nvme_port/nqn.2024-01.io.ferrite:vol:snap"
"$ferrite" bench --target "$target" --fill --workloads 4k_randread --runtime 5 --ramp 1 \
    --quiet >"$work/before.txt"
mapped=$("$ferrite" volume show snap --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["mapped_bytes"] // 4096)')
echo "node: $(node_layout "$ferrite")"
echo "volume: $blocks blocks provisioned, $mapped mapped"
for round in $(seq 1 "$rounds"); do
    floor=$(timed_ms "$ferrite" snapshot list snap)
    create=$(timed_ms "$ferrite" snapshot create snap "s$round")
    echo "round $round: snapshot create ${create} ms (a CLI round trip, snapshot list: ${floor} ms)"
    "$ferrite" bench --target "$target" --workloads 4k_randwrite --runtime 2 --ramp 0 \
        --quiet >/dev/null
done
"$ferrite" bench --target "$target" --workloads 4k_randread --runtime 5 --ramp 1 \
    --quiet >"$work/after.txt"
echo "4K random read before any snapshot:"; sed 's/^/  /' "$work/before.txt"
echo "4K random read through $rounds snapshots:"; sed 's/^/  /' "$work/after.txt"
for round in $(seq 1 "$rounds"); do
    delete=$(timed_ms "$ferrite" snapshot delete snap "s$round")
    echo "snapshot delete s$round: ${delete} ms"
done
