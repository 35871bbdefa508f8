#!/usr/bin/env python3
"""Does the projection predict a real run? For each case, `horizon plan --hardware this-cpu`
(the CPU device's kernels and host work timed on this machine, the simulated link at the
config's device.link_gbps) against `horizon bench` of the same config (the CPU device running
the same plan for real): steady step time and the busy seconds per step of each queue.

Cases: bench/overlap.yaml at link_gbps 0, 0.05 and 0.026; the same model in optimizer.memory
lean (at 0.05) and compact (at 0). Runs are interleaved (projection, bench, projection, ...)
REPS times; the table shows medians and projected/measured ratios.

    cargo build --release && cargo build --release -p horizon-backend --example idle_probe
    python3 bench/validate_projection.py [REPS] [HORIZON]

Run it on an otherwise idle machine: the bench measures wall time. Before and after the cases
it runs `idle_probe` (when built): kernels after 5-200 ms of sleep, and after 100 ms of other
busy work or of the same kernels, against the same kernels back to back. The projection times
kernels back to back; where the probe shows them slower after a pause or after other work, a
link-bound case's compute queue (which sleeps while it waits for the link) is measured busier
than projected by about that factor, an effect of the machine, not of the plan.
"""

import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
HORIZON = sys.argv[2] if len(sys.argv) > 2 else str(ROOT / "target/release/horizon")
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


def idle_probe(when):
    """Prints `idle_probe`'s lines (kernels after a pause against back to back), if built."""
    if not PROBE.exists():
        print(f"({PROBE.relative_to(ROOT)} not built: no idle probe {when} the cases)")
        return
    out = subprocess.run([str(PROBE)], capture_output=True, text=True, check=True).stdout
    print(f"idle probe, {when} the cases:")
    for line in out.strip().splitlines():
        print(f"    {line}")


def main():
    idle_probe("before")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in CASES:
            cfg = Path(tmp) / "case.yaml"
            config_with(sets, cfg)
            proj, meas = [], []
            for _ in range(REPS):
                proj.append(projection(cfg))
                meas.append(measured(cfg))
            med = lambda xs: statistics.median(xs)
            p_step, m_step = med([p[0] for p in proj]), med([m[0] for m in meas])
            p_busy = {q: med([p[1][q] for p in proj]) for q in QUEUES}
            m_busy = {q: med([m[1][q] for m in meas]) for q in QUEUES}
            rows.append((name, p_step, m_step, p_busy, m_busy))
    print(f"| case | step projected / measured (s) | ratio | " +
          " | ".join(f"{q} busy proj / meas (s)" for q in QUEUES) + " |")
    print("|---" * (3 + len(QUEUES)) + "|")
    worst = 0.0
    for name, ps, ms, pb, mb in rows:
        worst = max(worst, abs(ps / ms - 1))
        cells = []
        for q in QUEUES:
            r = pb[q] / mb[q] if mb[q] > 0 else float("nan")
            cells.append(f"{pb[q]:.3f} / {mb[q]:.3f} ({r:.2f})")
        print(f"| {name} | {ps:.3f} / {ms:.3f} | {ps / ms:.3f} | " + " | ".join(cells) + " |")
    idle_probe("after")
    print(f"\nworst step-time error: {100 * worst:.1f}% (median of {REPS} interleaved runs each)")


if __name__ == "__main__":
    main()
