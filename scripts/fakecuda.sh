#!/usr/bin/env bash
# Runs a command with the CUDA test double (crates/fakecuda) in place of NVIDIA's libraries:
# builds it if needed (g++ only), puts it first on LD_LIBRARY_PATH, where cudarc finds
# libcuda.so, libnvrtc.so, libcublas.so and libcublasLt.so, and runs the command. The CUDA
# backend's code is unchanged: kernels are compiled by g++ and run on the CPU, every CUDA
# thread a fiber.
#
# Usage:
#   scripts/fakecuda.sh cargo test --features cuda             # every CUDA test, no GPU
#   scripts/fakecuda.sh --asan cargo test --features cuda ...  # double and kernels under ASan
#   HORIZON_CUDA_STRESS=full scripts/fakecuda.sh cargo test --features cuda --test cuda_engine
# Environment (read by the double): FAKECUDA_SEED (block and fiber order), FAKECUDA_JITTER_US
# (random delay before every stream operation), FAKECUDA_MEMORY_BYTES (device memory),
# FAKECUDA_CACHE_DIR (compiled kernels); see crates/fakecuda/README.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/target/fakecuda"
ASAN=0
if [[ "${1:-}" == "--asan" ]]; then
    ASAN=1
    OUT="$ROOT/target/fakecuda-asan"
    shift
fi
make --quiet -C "$ROOT/crates/fakecuda" OUT="$OUT" ASAN="$ASAN" >&2
export LD_LIBRARY_PATH="$OUT${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ $ASAN == 1 ]]; then
    # The Rust binaries are not instrumented: the ASan runtime must come first.
    export LD_PRELOAD="$(${CXX:-g++} -print-file-name=libasan.so)${LD_PRELOAD:+:$LD_PRELOAD}"
    export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0}"
fi
[[ $# -gt 0 ]] || { echo "usage: scripts/fakecuda.sh [--asan] COMMAND..." >&2; exit 2; }
exec "$@"
