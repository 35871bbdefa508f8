#!/usr/bin/env python3
"""Does the projection predict a real run? For each case, `horizon plan --hardware this-cpu`
(the CPU device's kernels and host work timed on this machine, the simulated link at the
config's device.link_gbps) against `horizon bench` of the same config (the CPU device running
the same plan for real): steady step time and the busy seconds per step of each queue.

Cases: bench/overlap.yaml at link_gbps 0, 0.05 and 0.026; the same model in optimizer.memory
lean (at 0.05) and compact (at 0). Each case is measured as the config runs by default
(`device.wait: auto`: the queues spin while they wait where the link is simulated, and block
at link 0), blocking (`block`) and spinning (`spin`), or as WAITS says. Projections
and runs alternate (projection, bench with block, projection, bench with spin, ..., REPS
times, and a last projection), so that each run lies between two projections (which do not
depend on device.wait) and is compared with their mean: that cancels a steady drift of the
machine's speed, which moves a single projection by 10-20% within minutes. The tables show
medians, the median of each run's projected/measured ratio, and the lowest and highest ratio.

    cargo build --release && cargo build --release -p horizon-backend --example idle_probe
    python3 bench/validate_projection.py [REPS] [HORIZON] [WAITS, e.g. auto or block,spin]

Run it on an otherwise idle machine: the bench measures wall time. Before and after the cases
it runs `idle_probe` (when built), with its threads pinned as the CPU device pins its kernels'
threads (`engine.pin_threads`, the default) and unpinned: kernels after 5-200 ms of sleep, and
after 100 ms of other work, against the same kernels back to back. The projection times
kernels back to back; where the probe shows them slower after their threads slept, a
link-bound case's compute queue measured with `block` (whose kernel threads sleep while it
waits for the link) is busier than projected by about that factor, an effect of the machine,
not of the plan; `spin` keeps the kernel threads awake, as a GPU's cores are, and measures
what the plan costs.
"""

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
HORIZON = sys.argv[2] if len(sys.argv) > 2 else str(ROOT / "target/release/horizon")
# How the CPU device's queues wait: each is measured, interleaved, against its own projection.
WAITS = sys.argv[3].split(",") if len(sys.argv) > 3 else ["auto", "block", "spin"]
PROBE = ROOT / "target/release/examples/idle_probe"

CASES = [
    ("overlap, link 0", {"device.link_gbps": "0"}),
    ("overlap, link 0.05", {"device.link_gbps": "0.05"}),
    ("overlap, link 0.026", {"device.link_gbps": "0.026"}),
    ("lean, link 0.05", {"device.link_gbps": "0.05", "optimizer.memory": "lean"}),
    ("compact, link 0", {"device.link_gbps": "0", "optimizer.memory": "compact"}),
]
QUEUES = ["compute", "h2d", "d2h", "host"]


def config_with(sets, path):
    """bench/overlap.yaml with `section.key: value` overrides, written to `path`."""
    text = (ROOT / "bench/overlap.yaml").read_text()
    for key, val in sets.items():
        section, name = key.split(".")
        pat = re.compile(rf"^(  {name}:).*$", re.M)
        block = re.search(rf"^{section}:\n((?:  .*\n)*)", text, re.M)
        if block and pat.search(block.group(1)):
            body = pat.sub(rf"\g<1> {val}", block.group(1))
            text = text[: block.start(1)] + body + text[block.end(1):]
        elif block:
            text = text[: block.end(1)] + f"  {name}: {val}\n" + text[block.end(1):]
        else:
            text += f"{section}:\n  {name}: {val}\n"
    path.write_text(text)


def projection(cfg):
    out = subprocess.run([HORIZON, "plan", "--config", str(cfg), "--hardware", "this-cpu"],
                         capture_output=True, text=True, check=True).stdout
    step = float(re.search(r"projected step ([0-9.]+) s", out).group(1))
    busy = {q: float(re.search(rf"{q} ([0-9.]+) s \(", out.split("busy per step:")[1]).group(1))
            for q in QUEUES}
    return step, busy


def measured(cfg):
    out = subprocess.run([HORIZON, "bench", "--config", str(cfg), "--json"],
                         capture_output=True, text=True, check=True).stdout
    s = json.loads(out.strip().splitlines()[-1])
    n = s["steps"]
    busy = {"compute": s["device_compute_s"] / n, "h2d": s["h2d_busy_s"] / n,
            "d2h": s["d2h_busy_s"] / n, "host": s["host_busy_s"] / n}
    return s["wall_s"] / n, busy


def bracket(before, after):
    """The mean of two projections (step, {queue: busy})."""
    return ((before[0] + after[0]) / 2, {q: (before[1][q] + after[1][q]) / 2 for q in QUEUES})


def idle_probe(when):
    """Prints `idle_probe`'s lines (kernels after a pause against back to back), if built."""
    if not PROBE.exists():
        print(f"({PROBE.relative_to(ROOT)} not built: no idle probe {when} the cases)")
        return
    # Pinned as the CPU device's kernels are by default (engine.pin_threads), then unpinned.
    for pin, how in ((True, "pinned"), (False, "unpinned")):
        env = {**os.environ, "PIN": "1"} if pin else {k: v for k, v in os.environ.items() if k != "PIN"}
        out = subprocess.run([str(PROBE)], capture_output=True, text=True, check=True, env=env)
        print(f"idle probe, {how}, {when} the cases:")
        for line in out.stdout.strip().splitlines():
            print(f"    {line}")


def secs(x):
    """Seconds to three significant digits, at least three decimals (as `horizon plan` prints)."""
    if x <= 0 or x != x:
        return f"{x:.3f}"
    return f"{x:.{min(9, max(3, 2 - math.floor(math.log10(x))))}f}"


def spread(ratios):
    """The lowest and highest of the runs' ratios: how far the machine moved one run."""
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def table(rows, title):
    """Prints one markdown table; a row is (name, [(projected, measured)] for each rep, where
    either is (step, {queue: busy})). Values are medians; a ratio is the median of each run's
    ratio to the mean of the projections made just before and just after it (this machine's
    speed drifts by 10-20% within minutes, more than within one run), then the lowest and
    highest of those ratios. Returns the worst step-time and busy-time errors."""
    med = statistics.median
    print(f"\n{title}\n")
    print(f"| case | step projected / measured (s) | ratio | " +
          " | ".join(f"{q} busy proj / meas (s)" for q in QUEUES) + " |")
    print("|---" * (3 + len(QUEUES)) + "|")
    worst_step, worst_busy = 0.0, 0.0
    for name, pairs in rows:
        ps, ms = med([p[0] for p, _ in pairs]), med([m[0] for _, m in pairs])
        rs = [p[0] / m[0] for p, m in pairs]
        r = med(rs)
        worst_step = max(worst_step, abs(r - 1))
        cells = []
        for q in QUEUES:
            pq, mq = med([p[1][q] for p, _ in pairs]), med([m[1][q] for _, m in pairs])
            rqs = [p[1][q] / m[1][q] if m[1][q] > 0 else float("nan") for p, m in pairs]
            rq = med(rqs)
            worst_busy = max(worst_busy, abs(rq - 1))
            cells.append(f"{secs(pq)} / {secs(mq)} ({rq:.2f}, {spread(rqs)})")
        print(f"| {name} | {secs(ps)} / {secs(ms)} | {r:.3f} ({spread(rs)}) | " +
              " | ".join(cells) + " |")
    return worst_step, worst_busy


def main():
    idle_probe("before")
    rows = {wait: [] for wait in WAITS}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in CASES:
            cfgs = {}
            for wait in WAITS:
                cfgs[wait] = Path(tmp) / f"case-{wait}.yaml"
                config_with({**sets, "device.wait": wait}, cfgs[wait])
            # Projection, run, projection, run, ..., projection: each run lies between two
            # projections (the projection does not depend on device.wait), and is compared
            # with their mean, which cancels a steady drift of the machine's speed.
            timeline = []
            for _ in range(REPS):
                for wait in WAITS:
                    timeline.append(projection(cfgs[wait]))
                    timeline.append((wait, measured(cfgs[wait])))
            timeline.append(projection(cfgs[WAITS[-1]]))
            pairs = {wait: [] for wait in WAITS}
            for k in range(1, len(timeline), 2):
                wait, run = timeline[k]
                pairs[wait].append((bracket(timeline[k - 1], timeline[k + 1]), run))
            for wait in WAITS:
                rows[wait].append((name, pairs[wait]))
    worst = {wait: table(rows[wait], f"device.wait: {wait}") for wait in WAITS}
    idle_probe("after")
    print()
    for wait, (step, busy) in worst.items():
        print(f"device.wait: {wait}: worst step-time error {100 * step:.1f}%, worst busy-time "
              f"error {100 * busy:.1f}% (medians of {REPS} interleaved pairs each)")


if __name__ == "__main__":
    main()
