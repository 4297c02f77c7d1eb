#!/usr/bin/env bash
# Runs the CPU kernels' tests and the engine's comparison with llama.cpp's logits on aarch64
# (the NEON kernels), cross-compiled and run under qemu-user. Installs the cross linker, the
# aarch64 C library and qemu with apt-get, and the Rust target with rustup, when missing.
# Not part of CI (the cross build takes several minutes on 2 cores): run it after changing
# `daemon/src/cpu/`.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null 2>&1 || need+=(qemu-user)
if ((${#need[@]})); then
    echo "test-aarch64: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
rustup target list --installed | grep -qx aarch64-unknown-linux-gnu ||
    rustup target add aarch64-unknown-linux-gnu
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
target=(--target aarch64-unknown-linux-gnu)
cargo test "${target[@]}" -p spillway-daemon --lib -- cpu:: quant::
cargo test "${target[@]}" -p spillway-bench --test engine_llama_cpp
