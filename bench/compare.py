#!/usr/bin/env python3
"""Horizon vs PyTorch eager on the same shape, interleaved in one run (issue: speed on the CPU
backend). Not run by CI.

    python bench/compare.py [--reps 3] [--recompute auto always] [--steps 3]
        [--horizon target/release/horizon] [--python PYTHON]

Each repetition runs `horizon bench --model llama-58m --json --recompute R` for every R given,
then `bench/torch_baseline.py --json` (the machine's other load hits all alike); at the end it
prints the median tokens/s of each and the ratio of the medians. PYTHON must import torch
(default: the python running this script).
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def last_json(out):
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"no JSON line in:\n{out}")


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    return last_json(p.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--recompute", nargs="+", default=["auto", "always"])
    ap.add_argument("--horizon", default=str(HERE.parent / "target/release/horizon"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--steps", type=int, default=3,
                    help="timed torch steps (horizon: the config's steps less one warm-up)")
    a = ap.parse_args()
    th_cmd = [a.python, str(HERE / "torch_baseline.py"), "--json", "--steps", str(a.steps)]
    hz = {r: [] for r in a.recompute}
    th = []
    for rep in range(a.reps):
        for r in a.recompute:
            h = run([a.horizon, "bench", "--model", "llama-58m", "--json", "--recompute", r])
            hz[r].append(h["tokens_per_s"])
            p = h["phase_s"]
            print(f"rep {rep + 1}: horizon recompute={r}: {h['tokens_per_s']:.1f} tokens/s, "
                  f"{h['achieved_gflops']:.1f} GFLOP/s achieved, {h['model_gflops']:.1f} model; "
                  f"s/step forward {p['forward'] / h['steps']:.2f} recompute "
                  f"{p['recompute'] / h['steps']:.2f} backward {p['backward'] / h['steps']:.2f} "
                  f"head {p['head'] / h['steps']:.2f} optimizer {p['optimizer'] / h['steps']:.2f} "
                  f"idle {h['compute_idle_s'] / h['steps']:.2f}", flush=True)
        t = run(th_cmd)
        th.append(t["tokens_per_s"])
        print(f"rep {rep + 1}: torch {t['torch']}: {t['tokens_per_s']:.1f} tokens/s, "
              f"{t['model_gflops_per_s']:.1f} model GFLOP/s", flush=True)
    mt = statistics.median(th)
    print(f"median of {a.reps}: torch {mt:.1f} tokens/s")
    for r in a.recompute:
        mh = statistics.median(hz[r])
        print(f"median of {a.reps}: horizon recompute={r} {mh:.1f} tokens/s, "
              f"horizon/torch = {mh / mt:.3f}")


if __name__ == "__main__":
    main()
