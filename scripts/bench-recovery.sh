#!/usr/bin/env bash
# Recovery time after kill -9: write SIZE into a volume (a sequential fill, then 4K random
# overwrites), SIGKILL the node mid-flight of nothing in particular, restart it on the same data
# dir and time how long until the API answers; prints the engine's own recovery report line
# (seconds, bytes read, blocks recovered). Repeats ROUNDS times on fresh data dirs.
#
#   SIZE=3G ROUNDS=3 scripts/bench-recovery.sh
#   FERRITE_BIN=/path/to/ferrite SIZE=10G ROUNDS=1 scripts/bench-recovery.sh   # another build
#   SIGNAL=TERM scripts/bench-recovery.sh   # a clean stop instead: the node writes a final
#                                           # checkpoint, so the restart times loading it alone
#   ERASURE=none scripts/bench-recovery.sh  # the node's --erasure-coding; by default the node's
#                                           # own choice (3+1 on its four drives); the output
#                                           # names the layout measured
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
help_if_asked "$@"
cd "$(dirname "$0")/.."
size=${SIZE:-3G}
rounds=${ROUNDS:-3}
signal=${SIGNAL:-KILL}
erasure_args=()
[ -z "${ERASURE:-}" ] || erasure_args=(--erasure-coding "$ERASURE")
case "$signal" in KILL | TERM) ;; *) echo "bench-recovery: SIGNAL must be KILL or TERM, not '$signal'" >&2; exit 2 ;; esac
ferrite=${FERRITE_BIN:-./target/release/ferrite}
if [ -z "${FERRITE_BIN:-}" ] && [ ! -x "$ferrite" ]; then cargo build --release --locked --bin ferrite; fi
[ -x "$ferrite" ] || { echo "bench-recovery: $ferrite is not an executable" >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ferrite-recovery.XXXXXX")
server=""
cleanup() {
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"; wait "$server" || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

start() { # data dir
    "$ferrite" up --nbd-listen off --data-dir "$1" --api-listen "127.0.0.1:$api_port" \
        --nvme-listen "127.0.0.1:$nvme_port" "${erasure_args[@]}" >>"$work/up.log" 2>&1 &
    server=$!
    for _ in $(seq 1 1200); do "$ferrite" node show >/dev/null 2>&1 && return 0; sleep 0.05; done
    echo "the node did not answer within 60 s" >&2
    return 1
}

for round in $(seq 1 "$rounds"); do
    api_port=$(port); nvme_port=$(port)
    export FERRITE_API=http://127.0.0.1:$api_port
    data="$work/data-$round"
    start "$data"
    [ "$round" -gt 1 ] || echo "node: $(node_layout "$ferrite")"
    "$ferrite" volume create rec --size "$size" >/dev/null
    target="nvme+tcp://127.0.0.1:$nvme_port/nqn.2024-01.io.ferrite:vol:rec"
    "$ferrite" bench --target "$target" --fill --workloads 4k_randwrite --runtime 5 --ramp 0 \
        --quiet >/dev/null
    "$ferrite" node show --json >"$work/node.json"
    written=$(python3 - "$work/node.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["capacity"]
gib = 2 ** 30
print(f"mapped {c['mapped_bytes'] / gib:.2f} GiB, physically used {c['physical_used_bytes'] / gib:.2f} GiB, "
      f"write amplification {c['write_amplification']:.2f}")
PY
)
    kill -"$signal" "$server"; wait "$server" 2>/dev/null || true
    server=""
    begin=$(date +%s.%N)
    start "$data"
    end=$(date +%s.%N)
    echo "round $round: $size filled + 5 s of 4K random writes; SIG$signal, restart to API ready: $(python3 -c "print(round($end-$begin, 2))") s"
    echo "  before the kill: $written"
    grep "recovered the log" "$work/up.log" | tail -1 | sed 's/^.*INFO //; s/^/  /'
    kill -TERM "$server"; wait "$server" || true
    server=""
    rm -rf "$data"
done
