#!/usr/bin/env python3
"""The lent GPU machine's ceilings, through PyTorch, for a hardware profile of it
(`horizon plan --hardware FILE.yaml`) beside the h200-pcie5 one: pinned host-to-device and
device-to-host bandwidth, cuBLAS bf16 products at a Qwen2.5-7B layer's shapes (16K tokens a
step), PyTorch's own attention (FlashAttention) at 4 x 4096 tokens, and a device-to-device copy.

    python3 bench/gpu_ceilings.py [--json FILE]   # prints a table; writes one JSON object to FILE

Each figure is the median of several timed runs after warm-up, timed with CUDA events.
Random inputs (never zeros: a product on zeros runs faster than on data).
"""

import json
import statistics
import sys

import torch


def timed(fn, reps=10, warmup=3):
    """Median seconds of `fn` over `reps` runs, CUDA events around each."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def link(out):
    for mb in (64, 512):
        n = mb * 2**20
        host = torch.empty(n, dtype=torch.uint8).pin_memory()
        host.random_(0, 255)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        out[f"h2d_{mb}MiB_gbps"] = n / timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9
        out[f"d2h_{mb}MiB_gbps"] = n / timed(lambda: host.copy_(dev, non_blocking=True)) / 1e9
    n = 2 * 2**30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    out["d2d_gbps_read_plus_written"] = 2 * n / timed(lambda: b.copy_(a)) / 1e9


def gemms(out, peak):
    # (name, m, n, k): the products of one Qwen2.5-7B layer's forward at 16384 tokens, recorded
    # in the output (`gemm_layer_shapes`) for bench/lent_profile.py; then a square one.
    tokens, c, f, kv = 16384, 3584, 18944, 512
    layer = {
        "qkv": (tokens, c + 2 * kv, c),
        "o": (tokens, c, c),
        "gate_up": (tokens, 2 * f, c),
        "down": (tokens, c, f),
    }
    out["gemm_layer_shapes"] = layer
    shapes = [(name, *mnk) for name, mnk in layer.items()] + [("square_8192", 8192, 8192, 8192)]
    for name, m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        s = timed(lambda: x @ w.t())
        out[f"gemm_{name}_tflops"] = 2 * m * n * k / s / 1e12
        out[f"gemm_{name}_efficiency"] = 2 * m * n * k / s / 1e12 / peak


def attention(out, peak):
    b, h, t, d = 4, 28, 4096, 128  # Qwen2.5-7B's heads (k and v expanded to all 28)
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flops = 4 * b * h * t * t * d / 2  # causal: half of QK^T and PV
    s = timed(lambda: sdpa(q, k, v, is_causal=True))
    out["sdpa_forward_tflops"] = flops / s / 1e12
    o = sdpa(q, k, v, is_causal=True)
    g = torch.randn_like(o)
    s = timed(lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), g))
    out["sdpa_fwd_bwd_tflops"] = 3.5 * flops / s / 1e12  # backward is 2.5x the forward
    out["sdpa_fwd_bwd_efficiency"] = out["sdpa_fwd_bwd_tflops"] / peak


def main():
    peak = 989.0
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for part in (link, lambda o: gemms(o, peak), lambda o: attention(o, peak)):
        try:
            part(out)
        except Exception as e:  # one failed part must not lose the others
            out.setdefault("errors", []).append(repr(e))
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(out, f)
    for k, v in out.items():
        print(f"  {k:32} {v:.3f}" if isinstance(v, float) else f"  {k:32} {v}")


if __name__ == "__main__":
    main()
