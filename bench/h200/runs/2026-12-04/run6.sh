#!/bin/bash
# Session 2026-12-04 (3): is HeadGrad's 3x the compute thread starved of a CPU? host_threads 8.
set -uo pipefail
R=${OUT:?}
for d in $(python3 -c 'import site,glob; [print(p) for s in site.getsitepackages()+[site.getusersitepackages()] for p in glob.glob(s+"/nvidia/*/lib")]'); do export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
sed "s#OUTDIR#$R#" .gpu/q4.yaml > $R/q4.yaml
for ht in 8; do
  echo "== $(date +%T) bench q4 host_threads $ht, traced"
  timeout 120 .gpu/horizon bench --config $R/q4.yaml --warmup 1 --trace $R/q4-ht$ht.json \
    --set engine.host_threads=$ht --set output.dir=$R/q4-ht$ht > $R/q4-ht$ht.log 2>&1 || echo "FAILED rc $?"
  grep -E "^(bench:|  per step)" $R/q4-ht$ht.log
  python3 - $R/q4-ht$ht.json <<'PY'
import json, sys, collections
ev = json.load(open(sys.argv[1]))["traceEvents"]
d = collections.defaultdict(list)
for e in ev:
    if e.get("ph") == "X" and e["args"].get("step", 0) >= 1:
        d[e["name"]].append(e["dur"] / 1000)
for k in ["HeadStats", "HeadGrad", "Forward", "Backward", "DownloadHeadTileGrads", "SlabUpdate"]:
    v = d.get(k, [])
    print(f"{k:24} n {len(v):3}  " + " ".join(f"{x:.1f}" for x in v[:9]))
PY
done
echo "== $(date +%T) end"
