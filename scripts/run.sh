#!/usr/bin/env bash
# `make run`: start a single-node Ferrite cluster, create a volume, run the five standard
# workloads against it over NVMe/TCP (with every byte read verified), print the table, then keep
# serving until Ctrl-C and say how to connect.
set -euo pipefail
cd "$(dirname "$0")/.."
ferrite=./target/release/ferrite
data_dir=${DATA_DIR:-./ferrite-data}
volume=${VOLUME:-demo}
volume_size=${VOLUME_SIZE:-2G}
api=${FERRITE_API:-http://127.0.0.1:8080}
export FERRITE_API=$api

"$ferrite" up --data-dir "$data_dir" &
server=$!
stop() {
    if kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
    fi
}
trap stop EXIT
trap 'stop; exit 130' INT TERM

# Wait for this node's API; if our `ferrite up` exits first (ports or data dir in use), stop
# here rather than talk to whatever else answers on the API address.
ready=false
for _ in $(seq 1 300); do
    if ! kill -0 "$server" 2>/dev/null; then
        echo "run: ferrite up exited; see its message above" >&2
        exit 1
    fi
    if "$ferrite" node show >/dev/null 2>&1; then
        ready=true
        break
    fi
    sleep 0.1
done
if ! $ready || ! kill -0 "$server" 2>/dev/null; then
    echo "run: ferrite up did not become ready; see its messages above" >&2
    exit 1
fi

if ! "$ferrite" volume show "$volume" >/dev/null 2>&1; then
    "$ferrite" volume create "$volume" --size "$volume_size"
fi
nqn=$("$ferrite" volume show "$volume" --json | sed -n 's/.*"nqn": *"\([^"]*\)".*/\1/p')
nvme_address=${NVME_ADDRESS:-127.0.0.1:4420}

echo
echo "== the five standard workloads on volume '$volume' over NVMe/TCP (--verify: every read checked) =="
"$ferrite" bench --target "nvme+tcp://$nvme_address/$nqn" --fill --verify --runtime "${BENCH_RUNTIME:-10}"

echo
echo "Ferrite is serving. Connect a Linux host with:"
"$ferrite" volume show "$volume" | grep 'nvme connect' || true
echo "or an NBD client (qemu-img, nbdcopy, nbdfuse) to:"
"$ferrite" volume show "$volume" | grep '^nbd:' || true
echo "Snapshots (\`$ferrite snapshot create $volume NAME\`) are read-only NBD exports $volume@NAME."
echo "Stop with Ctrl-C."
wait "$server"
