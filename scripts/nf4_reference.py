#!/usr/bin/env python3
"""NF4 reference fixtures from bitsandbytes itself, for the Rust quantiser's bit-exact tests
(crates/horizon-backend/tests/nf4.rs).

Quantises with bitsandbytes on the CPU, exactly as QLoRA's base weights are made:
    packed, state = bitsandbytes.functional.quantize_4bit(
        w, blocksize=64, quant_type="nf4", compress_statistics=False)
    deq = bitsandbytes.functional.dequantize_4bit(packed, state)
and saves, per tensor NAME: NAME.w (the fp32 input), NAME.codes (the packed bytes, u8),
NAME.absmax (f32, one per block of 64) and NAME.deq (the fp32 dequantised values), into
  tests/fixtures/nf4/qwen2_weights.safetensors  every q/k/v/o/gate/up/down weight of the
                                                 QLoRA fixture model
  tests/fixtures/nf4/edge_cases.safetensors     synthetic 1-D tensors: a zero block, values
                                                 exactly at code midpoints (and one ulp either
                                                 side) times a power-of-two absmax, negative
                                                 zeros, huge and tiny magnitudes, values whose
                                                 code depends on x*(1/absmax) vs x/absmax,
                                                 partial last blocks (odd and even lengths, an
                                                 all-zero one)

Usage (a venv with torch and bitsandbytes 0.50):
    python scripts/nf4_reference.py MODEL.safetensors OUT_DIR
"""

import json
import sys

import bitsandbytes
import bitsandbytes.functional as F
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nf4(w):
    """bitsandbytes' NF4 of w: packed bytes, absmax, dequantised values."""
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    deq = F.dequantize_4bit(packed, state)
    # The C++ kernel returns an even 1-D tensor as (1, n); the values are in order either way.
    assert deq.dtype == torch.float32 and deq.numel() == w.numel()
    deq = deq.reshape(w.shape)
    return packed.reshape(-1).contiguous(), state.absmax.float().contiguous(), deq.contiguous()


def entries(name, w):
    packed, absmax, deq = nf4(w)
    return {
        f"{name}.w": w.contiguous(),
        f"{name}.codes": packed,
        f"{name}.absmax": absmax,
        f"{name}.deq": deq,
    }


def code_midpoints():
    code = F.get_4bit_type("nf4", device="cpu")
    return ((code[:-1] + code[1:]) / 2).numpy().astype(np.float32)


def edge_cases():
    """Synthetic 1-D tensors, each a case bitsandbytes handles in its own way."""
    mid = code_midpoints()
    rng = np.random.default_rng(16)
    f32 = np.float32

    def block_at_midpoints(scale):
        # absmax = scale (a power of two), so x * (1/scale) is exactly the midpoint.
        b = [scale, -scale]
        for m in mid:
            x = f32(m) * f32(scale)
            b += [x, np.nextafter(x, f32(np.inf)), np.nextafter(x, f32(-np.inf))]
        b += [0.0, -0.0]
        b = np.array(b[:64], dtype=f32)
        return np.pad(b, (0, 64 - len(b)))

    def reciprocal_vs_division(seed):
        # Values whose code depends on how the block is normalised: x * (1/absmax) and
        # x / absmax fall on different sides of a midpoint (or one of them exactly on it).
        r = np.random.default_rng(seed)
        while True:
            a = f32(r.uniform(1.0, 2.0))
            found = [a]
            for m in np.concatenate([mid, -mid]):
                x0 = f32(m) * a
                for k in range(-3, 4):
                    x = f32(x0)
                    for _ in range(abs(k)):
                        x = np.nextafter(x, f32(np.inf) if k > 0 else f32(-np.inf))
                    by_mul, by_div = x * (f32(1) / a), x / a
                    if (by_mul <= m) != (by_div <= m) and abs(x) <= a:
                        found.append(x)
            if len(found) >= 4:
                b = np.array(found[:64], dtype=f32)
                return np.pad(b, (0, 64 - len(b)))

    blocks = [
        reciprocal_vs_division(1),
        reciprocal_vs_division(2),
        reciprocal_vs_division(3),
        np.zeros(64, f32),                                  # zero block: absmax 0
        np.full(64, -0.0, f32),                             # negative zeros only
        block_at_midpoints(4.0),
        block_at_midpoints(0.125),
        block_at_midpoints(2.0**100),
        np.where(rng.random(64) < 0.5, f32(-0.0), rng.standard_normal(64).astype(f32)),
        (rng.standard_normal(64) * 1e38).clip(-3.3e38, 3.3e38).astype(f32),  # 1/absmax subnormal
        (rng.standard_normal(64) * 1e-39).astype(f32),      # absmax below the 1e-38 clamp
        (rng.standard_normal(64) * 1e-44).astype(f32),      # subnormal values
        np.concatenate([[f32(-5.0)], rng.uniform(-5, 5, 63).astype(f32)]),  # negative absmax
        rng.standard_normal(64 * 40).astype(f32) * f32(0.02),  # ordinary weights
        rng.standard_normal(64 * 8).astype(f32) * f32(3.0),
    ]
    body = np.concatenate(blocks)
    partial = block_at_midpoints(8.0)[:37]  # an odd partial block, divided by its absmax
    partial[5] = -0.0
    divided = reciprocal_vs_division(4)[:45]  # a partial block where division matters
    tensors = {
        "full": body,
        "partial_odd": np.concatenate([body, partial]),
        "partial_even": np.concatenate([body, rng.standard_normal(22).astype(f32)]),
        "partial_divided": np.concatenate([body[:64], divided]),
        "partial_zero": np.concatenate([body[:128], np.zeros(9, f32)]),  # absmax clamped to 1e-38
        "short": np.array([0.3, -0.0, 1e-3], f32),
        "one": np.array([-2.5], f32),
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}


def main(model, out):
    meta = {"bitsandbytes": bitsandbytes.__version__, "torch": torch.__version__,
            "call": "quantize_4bit(w, blocksize=64, quant_type='nf4', compress_statistics=False)"}
    weights = {}
    with safe_open(model, "pt") as f:
        for name in f.keys():
            if name.endswith(".weight") and any(t in name for t in TARGETS):
                weights.update(entries(name, f.get_tensor(name).float()))
    save_file(weights, f"{out}/qwen2_weights.safetensors", metadata=meta)
    edges = {}
    for name, w in edge_cases().items():
        edges.update(entries(name, w))
    save_file(edges, f"{out}/edge_cases.safetensors", metadata=meta)
    print(json.dumps({**meta, "weights": len(weights) // 4, "edge_cases": len(edges) // 4}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
