#!/usr/bin/env bash
# Runs the workspace tests and ends with one plain line totalling every cargo test binary:
# "tests: N passed, N failed". The exit status is cargo's.
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed;?$/) p += $(i-1); if ($(i) ~ /^failed;?$/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
