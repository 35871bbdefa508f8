#!/bin/bash
# Session 2026-12-04 (3): the head's gradients page-locked in place (no pageable D2H).
set -uo pipefail
R=${OUT:?}
for d in $(python3 -c 'import site,glob; [print(p) for s in site.getsitepackages()+[site.getusersitepackages()] for p in glob.glob(s+"/nvidia/*/lib")]'); do export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
echo "== $(date +%T) gpu-check"
LENT_PROFILE=.gpu/lent.yaml OP_SPEED_RUN=0 BENCHES=qwen7b-shape LAYERS_7B=12 GRAD_WIRE=bf16 \
  DEVICE_MEMORY=120GiB TRACE=1 TEST_TIMEOUT=150 BENCH_TIMEOUT=150 OUT=$R/gc \
  bash .gpu/gpu-check.sh > $R/log.txt 2>&1
grep -E "^test .*(FAILED|SKIPPED)|test result|FAILED" $R/log.txt
sed -n '/== bench/,$p' $R/log.txt
for b in 8; do
  sed "s#OUTDIR#$R#" .gpu/q$b.yaml > $R/q$b.yaml
  echo "== $(date +%T) bench q$b: $b x 4096 tokens"
  timeout 170 .gpu/horizon bench --config $R/q$b.yaml --warmup 1 > $R/q$b.log 2>&1 || echo "bench q$b FAILED rc $?"
  grep -E "^(bench:|  )" $R/q$b.log | grep -v '^    "' | tail -n 6
  cp $R/q$b/summary.json $R/q$b.summary.json 2>/dev/null
done
echo "== $(date +%T) end"
