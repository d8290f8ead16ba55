#!/usr/bin/env bash
# Builds the runtime spike in release and runs the full comparison: every configuration, every
# runtime, REPS times, alternating runtimes so slow drifts of a shared machine hit all of them.
# Prints the raw runs and a markdown table of medians (min-max).
#
# Environment: REPS (3), WARMUP_S (3), MEASURE_S (10), SERVER_CPU (0), CLIENT_CPU (1),
#              RUNTIMES ("tokio-ct monoio tokio-mt"), CONFIGS ("4x32 1x1").
set -euo pipefail
cd "$(dirname "$0")"

REPS=${REPS:-3}
WARMUP_S=${WARMUP_S:-3}
MEASURE_S=${MEASURE_S:-10}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
RUNTIMES=${RUNTIMES:-"tokio-ct monoio tokio-mt"}
CONFIGS=${CONFIGS:-"4x32 1x1"}

cargo build --release --quiet
BIN=target/release/runtime-spike
WORK=$(mktemp -d)
RESULTS=$WORK/results.tsv
SERVER_PID=""
cleanup() {
    if [[ -n "$SERVER_PID" ]]; then kill "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

run_one() { # runtime config rep
    local runtime=$1 config=$2 rep=$3
    local connections=${config%x*} queue_depth=${config#*x}
    "$BIN" server --runtime "$runtime" --cpu "$SERVER_CPU" >"$WORK/server.out" 2>"$WORK/server.err" &
    SERVER_PID=$!
    local address=""
    for _ in $(seq 100); do
        address=$(awk '/^listening on/ {print $3}' "$WORK/server.out")
        [[ -n "$address" ]] && break
        sleep 0.1
    done
    [[ -n "$address" ]] || { echo "server $runtime did not start" >&2; cat "$WORK/server.err" >&2; exit 1; }
    local figures
    figures=$("$BIN" client --address "$address" --connections "$connections" \
        --queue-depth "$queue_depth" --warmup-s "$WARMUP_S" --measure-s "$MEASURE_S" \
        --server-pid "$SERVER_PID" --cpu "$CLIENT_CPU" 2>/dev/null)
    kill "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
    printf '%s\t%s\t%s\t%s\n' "$runtime" "$config" "$rep" "$figures" | tee -a "$RESULTS"
}

echo "# runtime spike $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(nproc) CPUs, $(uname -r)"
echo "# server on CPU $SERVER_CPU, client on CPU $CLIENT_CPU, warm-up ${WARMUP_S}s, measure ${MEASURE_S}s"
echo -e "# runtime\tconfig\trep\tIOPS\tp50_us\tp99_us\tp99.9_us\tserver_cpu%\tclient_cpu%\tsteal%"
for rep in $(seq "$REPS"); do
    for config in $CONFIGS; do
        for runtime in $RUNTIMES; do
            run_one "$runtime" "$config" "$rep"
        done
    done
done
echo
"$BIN" table "$RESULTS"
