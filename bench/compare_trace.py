#!/usr/bin/env python3
"""A run's ops against their projection, op kind by op kind: the median time of one op and the
seconds a step each kind of op keeps its queue busy, measured (`horizon bench --trace RUN`)
and projected (`horizon plan --hardware this-cpu --trace PLAN`, same config).

    python3 bench/compare_trace.py RUN.json PLAN.json [FIRST_STEP]

The run's steps from FIRST_STEP (default 2: after the first step and one more, as the bench's
warm-up) are compared with the projection's steady step (its third of four).
"""

import json
import statistics
import sys
from collections import defaultdict

QUEUES = {0: "compute", 1: "h2d", 2: "d2h", 3: "host"}


def slices(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X"]


def by_kind(events, steps):
    """(queue, kind) -> durations (us) of its ops in `steps`, and the number of steps."""
    out = defaultdict(list)
    for e in events:
        if e["args"]["step"] in steps:
            out[(QUEUES[e["tid"]], e["name"])].append(e["dur"])
    return out


def main():
    run, plan = slices(sys.argv[1]), slices(sys.argv[2])
    first = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    run_steps = sorted({e["args"]["step"] for e in run if e["args"]["step"] >= first})
    if not run_steps:
        sys.exit(f"{sys.argv[1]}: no step from {first} on")
    measured, projected = by_kind(run, set(run_steps)), by_kind(plan, {2})
    n = len(run_steps)
    print(f"run steps {run_steps[0]}-{run_steps[-1]} against the projection's steady step")
    print(f"{'queue':8s} {'op':18s} {'per step':>8s} {'run us':>9s} {'proj us':>9s} "
          f"{'run ms/step':>11s} {'proj ms/step':>12s} {'proj/run':>8s}")
    totals = defaultdict(lambda: [0.0, 0.0])
    for key in sorted(set(measured) | set(projected)):
        m, p = measured.get(key, []), projected.get(key, [])
        run_ms, proj_ms = sum(m) / n / 1e3, sum(p) / 1e3
        totals[key[0]][0] += run_ms
        totals[key[0]][1] += proj_ms
        ratio = f"{proj_ms / run_ms:8.2f}" if run_ms > 0 else f"{'-':>8s}"
        print(f"{key[0]:8s} {key[1]:18s} {len(m) / n:8.1f} "
              f"{statistics.median(m) if m else 0:9.1f} {statistics.median(p) if p else 0:9.1f} "
              f"{run_ms:11.3f} {proj_ms:12.3f} {ratio}")
    for q, (r, p) in totals.items():
        print(f"{q:8s} {'(all)':18s} {'':8s} {'':9s} {'':9s} {r:11.3f} {p:12.3f} "
              f"{p / r if r else 0:8.2f}")


if __name__ == "__main__":
    main()
