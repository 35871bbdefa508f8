#!/bin/sh
# Runs the executor's tests (make -C crates/fakecuda test-exec):
#   run.sh <folder with libnvrtc.so and test_exec> <folder of the project's .cu kernels>
# Compiled kernels are cached in <folder>/kernel-cache unless FAKECUDA_CACHE_DIR says otherwise.
set -e
out=$1
kernels=$2
FAKECUDA_CACHE_DIR=${FAKECUDA_CACHE_DIR:-$out/kernel-cache}
export FAKECUDA_CACHE_DIR
exec "$out/test_exec" "$out/libnvrtc.so" "$kernels"
