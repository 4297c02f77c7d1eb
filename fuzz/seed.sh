#!/usr/bin/env bash
# Writes the seed corpora of the fuzz targets into DIR/<target>/ (default fuzz/corpus): micro
# versions of the synthetic models as GGUF files, text and token ids of their vocabularies,
# their chat templates, and Generate/Profile requests (see src/bin/seeds.rs).
# The seeds come from the instrumented build, so `cargo fuzz run` reuses it.
set -euo pipefail
cd "$(dirname "$0")"
out=$(realpath -m "${1:-corpus}")
cargo fuzz build -s none -a seeds
"target/$(rustc -vV | sed -n 's/^host: //p')/release/seeds" "$out"
echo "fuzz seeds written to $out"
