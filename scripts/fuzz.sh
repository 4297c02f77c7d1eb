#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 60) from freshly written seeds, one at a time;
# a crash, a hang (10 s on one input) or an input taking over 2 GB fails the run, and the
# input is left in fuzz/artifacts/<target>/.
#
# Works on the stable toolchain: with no sanitizer (`-s none`) cargo-fuzz passes only stable
# codegen flags (the coverage instrumentation); `-a` keeps debug assertions, so integer
# overflow panics as in tests.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
CARGO_FUZZ_VERSION=0.13.2
if [[ $(cargo fuzz --version 2>/dev/null) != "cargo-fuzz $CARGO_FUZZ_VERSION" ]]; then
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi
fuzz/seed.sh
cd fuzz
targets=(gguf_reader tokenizer chat_template request_validation)
for target in "${targets[@]}"; do
    log=target/fuzz-$target.log
    if ! cargo fuzz run -s none -a "$target" "corpus/$target" -- -max_total_time="$seconds" \
        -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        tail -n 80 "$log"
        echo "fuzz: $target failed; the input is in fuzz/artifacts/$target/" >&2
        exit 1
    fi
    echo "fuzz: $target: $(grep -E '^Done' "$log")," \
        "$(sed -n 's/^stat::new_units_added: *//p' "$log") new inputs"
done
echo "fuzz: ${#targets[@]} passed, 0 failed"
