#!/usr/bin/env python3
"""A hardware profile (`horizon plan --hardware FILE.yaml`) of the machine this runs on, from its
measured ceilings: the GPU's and the link's from `bench/gpu_ceilings.py --json`, the host's from
`adamw_speed --json` (per-core rates, and the all-threads memcpy as the memory bandwidth).

    python3 bench/lent_profile.py CEILINGS.json HOST_RATES.json CORES MEMORY_GIB [OP_SPEED.txt] > lent.yaml

The GPU's peak stays the datasheet's (989 TFLOP/s bf16, 4.8 TB/s for an H200); what was
measured sets the GEMM efficiency (cuBLAS at a 7B layer's shapes, the shape factor of the
roofline divided out), the link's bandwidth each way, and the host. The attention efficiency is
Horizon's own kernels' where `examples/cuda_op_speed`'s output is given (its first table's
`attention` and `attention bwd` rows: the kernels a run uses, over both passes), else the
built-in estimate: PyTorch's FlashAttention is not Horizon's kernel (its figure is printed for
comparison only).
"""

import json
import statistics
import sys

HALF_DIM = 96.0  # sim::hardware default_gemm_half_dim


def shape_factor(dims):
    out = 1.0
    for x in dims:
        out *= x / (x + HALF_DIM)
    return out


def attention_efficiency(path, peak_tflops=989.0):
    """Horizon's attention over forward and backward, as a fraction of the peak, from the first
    table of `cuda_op_speed`'s output (`op ms TFLOP/s ...` rows); None without both rows."""
    rows = {}
    for line in open(path):
        if line.startswith("cuda_op_speed:") and rows:
            break  # the next table (another shape)
        parts = line.split()
        name = " ".join(parts[:-4]) if len(parts) >= 5 else ""
        if name in ("attention", "attention bwd"):
            rows[name] = (float(parts[-4]), float(parts[-3]))  # ms, TFLOP/s
    if len(rows) < 2:
        return None
    ms = sum(m for m, _ in rows.values())
    return sum(m * tf for m, tf in rows.values()) / ms / peak_tflops


def main():
    ceil = json.load(open(sys.argv[1]))
    rates = json.load(open(sys.argv[2]))
    cores, memory_gib = int(sys.argv[3]), float(sys.argv[4])
    # The layer's products as gpu_ceilings.py timed them: {name: (m, n, k)}.
    shapes = ceil.get("gemm_layer_shapes", {})
    effs = [
        ceil[f"gemm_{k}_efficiency"] / shape_factor(dims)
        for k, dims in shapes.items()
        if f"gemm_{k}_efficiency" in ceil
    ]
    gemm = min(1.0, statistics.median(effs)) if effs else 0.8
    per = lambda k: rates[k]["per_core"]  # noqa: E731
    copy = rates["memcpy"]
    lines = [
        "name: lent-h200",
        f"about: measured on the lent machine ({ceil.get('device', '?')}, {cores} CPUs) by "
        "gpu_ceilings.py and adamw_speed; peaks from the H200 datasheet",
        "gpu:",
        "  bf16_tflops: 989.0",
        "  hbm_gbps: 4800.0",
        "  memory_gib: 131.3",
        f"  gemm_efficiency: {gemm:.3f}",
    ]
    attention = attention_efficiency(sys.argv[5]) if len(sys.argv) > 5 else None
    if attention is not None:
        lines.append(f"  attention_efficiency: {attention:.4f}")
    lines += [
        "link:",
        f"  h2d_gbps: {ceil['h2d_512MiB_gbps']:.1f}",
        f"  d2h_gbps: {ceil['d2h_512MiB_gbps']:.1f}",
        "host:",
        f"  cores: {cores}",
        f"  mem_gbps: {copy['all'] * copy['bytes_per_param'] / 1e9:.1f}",
        f"  memory_gib: {memory_gib:.1f}",
        "  rates:",
    ]
    for key in ("adamw", "adamw_image", "adamw8bit", "adamw8bit_image", "accumulate_f32",
                "accumulate_bf16", "round_bf16"):
        lines.append(f"    {key}: {per(key):.4g}")
    lines.append(f"    copy_gbps: {copy['per_core'] * copy['bytes_per_param'] / 1e9:.2f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
