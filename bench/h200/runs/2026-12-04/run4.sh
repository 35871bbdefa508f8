#!/bin/bash
# Session 2026-12-04 (3): the 12-layer 7B shape at 32K and 64K tokens a step, where the lent
# profile projects the step compute-bound (from about 29,700 tokens).
set -uo pipefail
R=${OUT:?}
for d in $(python3 -c 'import site,glob; [print(p) for s in site.getsitepackages()+[site.getusersitepackages()] for p in glob.glob(s+"/nvidia/*/lib")]'); do export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
for b in 8 16; do
  sed "s#OUTDIR#$R#" .gpu/q$b.yaml > $R/q$b.yaml
  echo "== $(date +%T) bench q$b: $b x 4096 tokens"
  timeout 170 .gpu/horizon bench --config $R/q$b.yaml --warmup 1 > $R/q$b.log 2>&1 || echo "bench q$b FAILED rc $?"
  grep -E "^(step|bench:|  )" $R/q$b.log | grep -v '^    "' | tail -n 12
  cp $R/q$b/summary.json $R/q$b.summary.json 2>/dev/null
  echo "-- projection on the lent profile"
  .gpu/horizon plan --config $R/q$b.yaml --hardware .gpu/lent.yaml 2>&1 | grep -E "projected step|busy per step|bound|^  (forward|head|backward|step boundary) "
done
echo "== $(date +%T) end"
