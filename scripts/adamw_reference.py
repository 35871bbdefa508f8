#!/usr/bin/env python3
"""Reference values for src/optim/adamw.rs: torch.optim.AdamW emulated in numpy float32.

Emulates `_single_tensor_adam(..., decoupled_weight_decay=True)` (torch.optim.AdamW with
foreach=False, fused=False, amsgrad=False, maximize=False) op by op, each op rounding to float32,
with Python-float scalars computed in float64 and cast to float32 where they meet a tensor:

    grad.mul_(clip_coef)                                    g = grad * f32(clip)
    param.mul_(1 - lr * wd)                                 p = p * f32(1 - lr*wd)
    exp_avg.lerp_(grad, 1 - beta1)                          m = m + w * (g - m)   (|w| < 0.5)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)  v = v * b2 + (f32(1-b2) * g) * g
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)        denom = sqrt(v) / f32(bc2_sqrt) + eps
    param.addcdiv_(exp_avg, denom, value=-step_size)        p = p + (f32(-step_size) * m) / denom

and clip_grad_norm_'s coefficient `(max_norm / (total_norm + 1e-6)).clamp(max=1)` with
`Tensor.__rtruediv__` = `reciprocal() * max_norm` in float32.

numpy never fuses a multiply and an add, so these are the two-rounding formulas. (PyTorch's
vectorised CPU `lerp` uses an FMA; see the module comment of src/optim/adamw.rs.)

Inputs come from an integer hash that tests/adamw.rs reimplements, so the 1<<20 case stores only
samples and checksums. Usage: python3 scripts/adamw_reference.py [OUT_DIR]
(default tests/fixtures/adamw). Needs numpy; the Rust tests do not need Python.
"""

import json
import math
import pathlib
import sys

import numpy as np

F = np.float32
CONFIG = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
# Per step: learning rate (the last one as a schedule would lower it), grad seed and scale, and
# whether the step's gradients are clipped to 0.3 of their norm.
STEPS = [
    {"t": 1, "lr": 1e-3, "grad_seed": 11, "grad_scale_pow2": -3, "clip": False},
    {"t": 2, "lr": 1e-3, "grad_seed": 12, "grad_scale_pow2": -1, "clip": True},
    {"t": 3, "lr": 5e-4, "grad_seed": 13, "grad_scale_pow2": -5, "clip": False},
]
PARAM_SEED = 1
PARAM_SCALE_POW2 = -1


def hash_values(n: int, seed: int, scale_pow2: int) -> np.ndarray:
    """f32 values in [-1, 1) * 2^scale_pow2, exact; same formula as `hash_values` in tests/adamw.rs."""
    x = np.arange(n, dtype=np.uint32) * np.uint32(0x9E3779B1)
    x ^= np.uint32((seed * 0x85EBCA77) & 0xFFFFFFFF)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x2C1B3C6D)
    x ^= x >> np.uint32(12)
    x *= np.uint32(0x297A2D39)
    x ^= x >> np.uint32(15)
    u = (x >> np.uint32(8)).astype(F) * F(2.0**-23) - F(1.0)
    return u * F(2.0**scale_pow2)


def clip_coefficient(total_norm: float, max_norm: float) -> np.float32:
    if max_norm <= 0:
        return F(1.0)
    denom = F(total_norm) + F(1e-6)
    coef = (F(1.0) / denom) * F(max_norm)
    return coef if not coef > F(1.0) else F(1.0)


def adamw_step(p, g_raw, m, v, t, lr, grad_scale):
    c = CONFIG
    g = g_raw * F(grad_scale)
    bias_correction1 = 1 - c["beta1"] ** float(t)
    bias_correction2 = 1 - c["beta2"] ** float(t)
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if c["weight_decay"] != 0:
        p = p * F(1 - lr * c["weight_decay"])
    w = F(1 - c["beta1"])
    if abs(w) < 0.5:
        m = m + w * (g - m)
    else:
        m = g - (g - m) * (F(1.0) - w)
    v = v * F(c["beta2"])
    v = v + (F(1 - c["beta2"]) * g) * g
    denom = np.sqrt(v) / F(bias_correction2_sqrt) + F(c["eps"])
    p = p + (F(-step_size) * m) / denom
    for a in (p, m, v):
        assert a.dtype == np.float32
    return p, m, v


def f64_sum_squares(x: np.ndarray) -> float:
    return math.fsum(float(y) * float(y) for y in x.astype(np.float64))


def floats(x: np.ndarray) -> list:
    return [float(y) for y in x]


def run(n: int, store_arrays: bool) -> dict:
    p = hash_values(n, PARAM_SEED, PARAM_SCALE_POW2)
    grads = [hash_values(n, s["grad_seed"], s["grad_scale_pow2"]) for s in STEPS]
    if n == 22:
        # Exercise eps: a zero gradient, and one whose square underflows to 0 in f32.
        for g in grads:
            g[3] = F(0.0)
            g[5] = F(1e-30)
    case = {"size": n, "config": CONFIG, "param_seed": PARAM_SEED,
            "param_scale_pow2": PARAM_SCALE_POW2}
    if store_arrays:
        case["init_param"] = floats(p)
    m = np.zeros(n, dtype=F)
    v = np.zeros(n, dtype=F)
    sample_idx = sorted({(k * 16411 + 5) % n for k in range(63)} | {n - 1})
    steps = []
    for s, g in zip(STEPS, grads):
        sum_sq = f64_sum_squares(g)
        total_norm = math.sqrt(sum_sq)
        max_norm = 0.3 * total_norm if s["clip"] else 0.0
        coef = clip_coefficient(total_norm, max_norm)
        assert (coef != 1.0) == s["clip"]
        p, m, v = adamw_step(p, g, m, v, s["t"], s["lr"], coef)
        out = dict(s)
        out.update({"grad_sum_squares": sum_sq, "total_norm": total_norm, "max_norm": max_norm,
                    "grad_scale": float(coef)})
        if store_arrays:
            out.update({"grad": floats(g), "param": floats(p), "m": floats(m), "v": floats(v)})
        else:
            out["sample_index"] = sample_idx
            for name, a in (("param", p), ("m", m), ("v", v)):
                out[f"{name}_sample"] = floats(a[sample_idx])
                # Sum of the f32 bit patterns: exact (< 2^52), order-free, catches any bit change.
                out[f"{name}_bits_sum"] = int(a.view(np.uint32).astype(np.uint64).sum())
            out["param_sum_f64"] = math.fsum(float(y) for y in p)
        steps.append(out)
    case["steps"] = steps
    return case


def main() -> None:
    out_dir = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/adamw")
    out_dir.mkdir(parents=True, exist_ok=True)
    for n, store in ((1, True), (7, True), (22, True), (1 << 20, False)):
        path = out_dir / f"size{n}.json"
        path.write_text(json.dumps(run(n, store), indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
