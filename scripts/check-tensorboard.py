#!/usr/bin/env python3
"""Read a run's TensorBoard events (OUT/tb/) with TensorBoard's own reader and print what it
finds: each scalar tag with its steps and last value, and the text tags. Exits 1 when the
directory holds no scalars. Local check only (TensorBoard is not installed in CI):

    python3 -m venv /tmp/tb && /tmp/tb/bin/pip install tensorboard
    /tmp/tb/bin/python scripts/check-tensorboard.py OUT/tb
"""
import sys

from tensorboard.backend.event_processing import event_accumulator


def main(logdir):
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in sorted(tags["scalars"]):
        events = acc.Scalars(tag)
        print(f"{tag}: steps {[e.step for e in events]}, last {events[-1].value:.6g}")
    for tag in sorted(tags["tensors"]):
        t = acc.Tensors(tag)[-1]
        text = t.tensor_proto.string_val[0].decode()
        print(f"text {tag} at step {t.step}: {text.splitlines()[0]!r} ... ({len(text)} chars)")
    return 0 if tags["scalars"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
