#!/usr/bin/env bash
# Installs what Spillway needs from the system when it is missing: the Vulkan loader and Mesa's
# lavapipe driver (a real Vulkan implementation on the CPU, so GPU code runs on any machine), and
# for the test that drives the daemon with a client we did not write: Python's grpcio, and protoc
# with grpc's Python plugin to generate that client from our .proto file.
# Everything the build needs (protoc, glslang) comes from crates.
set -euo pipefail

need=()
ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1' || need+=(libvulkan1)
ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || need+=(mesa-vulkan-drivers)
command -v c++ >/dev/null 2>&1 || need+=(g++)
/usr/bin/python3 -c 'import grpc' >/dev/null 2>&1 || need+=(python3-grpcio)
/usr/bin/python3 -c 'import google.protobuf' >/dev/null 2>&1 || need+=(python3-protobuf)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[[ -x /usr/bin/grpc_python_plugin ]] || need+=(protobuf-compiler-grpc)

if ((${#need[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "spillway setup: missing ${need[*]}; run as root or install them with apt-get" >&2
        exit 1
    fi
    echo "spillway setup: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
