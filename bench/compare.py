#!/usr/bin/env python3
"""Horizon vs PyTorch eager on the same shape, interleaved in one run (issue: speed on the CPU
backend). Not run by CI.

    python bench/compare.py [--reps 3] [--horizon target/release/horizon]
        [--python PYTHON] [--horizon-args "--recompute always"]

Runs `horizon bench --model llama-58m --json` and `bench/torch_baseline.py --json` alternately
--reps times each (the machine's other load hits both alike), then prints the median tokens/s of
each and their ratio. PYTHON must import torch (default: the python running this script).
"""
import argparse
import json
import shlex
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
    ap.add_argument("--horizon", default=str(HERE.parent / "target/release/horizon"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--horizon-args", default="", help="extra arguments to horizon bench")
    ap.add_argument("--steps", type=int, default=4, help="timed steps on each side")
    a = ap.parse_args()
    hz_cmd = [a.horizon, "bench", "--model", "llama-58m", "--json", *shlex.split(a.horizon_args)]
    th_cmd = [a.python, str(HERE / "torch_baseline.py"), "--json", "--steps", str(a.steps)]
    hz, th = [], []
    for r in range(a.reps):
        h = run(hz_cmd)
        t = run(th_cmd)
        hz.append(h["tokens_per_s"])
        th.append(t["tokens_per_s"])
        print(f"rep {r + 1}: horizon {h['tokens_per_s']:.1f} tokens/s "
              f"({h['achieved_gflops']:.1f} GFLOP/s achieved, {h['model_gflops']:.1f} model), "
              f"torch {t['tokens_per_s']:.1f} tokens/s ({t['model_gflops_per_s']:.1f} model GFLOP/s), "
              f"ratio {h['tokens_per_s'] / t['tokens_per_s']:.3f}", flush=True)
    mh, mt = statistics.median(hz), statistics.median(th)
    print(f"median of {a.reps}: horizon {mh:.1f} tokens/s, torch {mt:.1f} tokens/s, "
          f"horizon/torch = {mh / mt:.3f}")


if __name__ == "__main__":
    main()
