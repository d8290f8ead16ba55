#!/usr/bin/env bash
# Runs every cargo-fuzz target of fuzz/ for FUZZ_SECONDS seconds each (default 20) and fails on
# the first crash, leak or timeout; the crashing input is left in fuzz/artifacts/<target>/.
# Installs cargo-fuzz when it is missing. Needs the nightly toolchain (fuzz/rust-toolchain.toml).
set -euo pipefail

seconds="${FUZZ_SECONDS:-20}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/fuzz"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz"
    cargo +stable install cargo-fuzz --locked
fi

targets="$(cargo fuzz list)"
if [ -z "$targets" ]; then
    echo "fuzz-smoke: no fuzz targets found" >&2
    exit 1
fi
for target in $targets; do
    echo "fuzz-smoke: $target for ${seconds}s"
    mkdir -p "corpus/$target"
    # -max_len bounds one input (a stream of PDUs); -rss_limit_mb and -timeout catch runaway
    # allocation and loops.
    if ! cargo fuzz run "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 -timeout=10 \
        -print_final_stats=1; then
        echo "fuzz-smoke: $target FAILED; reproduce with: (cd fuzz && cargo fuzz run $target artifacts/$target/<file>)" >&2
        exit 1
    fi
done
echo "fuzz-smoke: all targets ran ${seconds}s without a crash"
