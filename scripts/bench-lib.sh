# Shell functions the benchmark scripts share; `source "$(dirname "$0")/bench-lib.sh"`.

# A free TCP port on 127.0.0.1 (the kernel picks it).
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits up to a minute until `BINARY node show` answers (FERRITE_API names the node).
wait_for_node() {
    local binary=$1
    for _ in $(seq 1 1200); do
        "$binary" node show >/dev/null 2>&1 && return 0
        sleep 0.05
    done
    echo "the node did not answer within a minute" >&2
    return 1
}

# Stops the node whose PID is in $server (SIGTERM, then waits), if it runs; clears $server.
stop_server() {
    if [ -n "${server:-}" ] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"
        wait "$server" || true
    fi
    server=""
}

# `--help` or `-h` as the first argument: prints the script's header comment (up to
# `set -euo pipefail`) and exits. Usage: help_if_asked "$@"
help_if_asked() {
    case "${1:-}" in
        -h | --help) sed -n '2,/^set -euo pipefail$/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    esac
}

# The command line of a script whose knobs are environment variables: `--help` as above,
# anything else is refused. Usage: only_help_args NAME "$@"
only_help_args() {
    help_if_asked "${2:-}"
    if [ -n "${2:-}" ]; then
        echo "$1: unknown argument $2 (see --help; the knobs are environment variables)" >&2
        exit 2
    fi
}

# One line naming the drives and the erasure coding of the node at $FERRITE_API, as `ferrite node
# show` reports them, so a script's output says which layout it measured. Usage: node_layout FERRITE
node_layout() {
    "$1" node show | sed -n 's/^drives: *\(.*\)$/drives \1/p; s/^erasure coding: *\(.*\)$/erasure coding \1/p' |
        awk 'NR > 1 { printf "; " } { printf "%s", $0 } END { print "" }'
}

# Starts a private single-member etcd in the background, its data in DIR and its output in LOG;
# sets etcd_port (its client port on 127.0.0.1) and appends its PID to the array `pids`.
# Usage: start_etcd DIR LOG
start_etcd() {
    local peer_port
    etcd_port=$(port)
    peer_port=$(port)
    etcd --name bench --data-dir "$1" \
        --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-cluster "bench=http://127.0.0.1:$peer_port" >"$2" 2>&1 &
    pids+=($!)
}

# Stops every process whose PID is in the array `pids`: SIGTERM to all, then waits for each.
stop_pids() {
    local pid
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
