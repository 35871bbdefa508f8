#!/bin/bash
# Session 2026-12-04 (2): tensor-core attention on the H200.
set -uo pipefail
R=${OUT:?}
for d in $(python3 -c 'import site,glob; [print(p) for s in site.getsitepackages()+[site.getusersitepackages()] for p in glob.glob(s+"/nvidia/*/lib")]'); do export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
echo "== $(date +%T) cuda_op_speed 7B 4x4096"
timeout 90 .gpu/cuda_op_speed 2>&1 | tee $R/op_speed.txt
echo "== $(date +%T) lent profile"
RUNS=bench/h200/runs/2026-12-04
python3 .gpu/lent_profile.py $RUNS/ceilings.json $RUNS/host_rates.json 16 125.8 $R/op_speed.txt > $R/lent.yaml
cat $R/lent.yaml
echo "== $(date +%T) gpu-check"
LENT_PROFILE=$R/lent.yaml OP_SPEED_RUN=0 BENCHES=qwen7b-shape LAYERS_7B=12 GRAD_WIRE=bf16 \
  DEVICE_MEMORY=120GiB TRACE=1 TEST_TIMEOUT=150 BENCH_TIMEOUT=150 OUT=$R/gc \
  bash .gpu/gpu-check.sh 2>&1 | tee $R/log.txt
echo "== $(date +%T) end"
