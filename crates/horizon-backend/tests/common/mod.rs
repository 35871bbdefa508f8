//! Shared pieces of the op tests: straightforward f64 reference forwards of every op, a
//! central-difference gradient in f64, and small conversions.
//!
//! The references are written for obviousness, not speed: plain loops, full softmax over an
//! explicit score row, no tricks. Each op's f32 forward is checked against its reference, and
//! each f32 backward against finite differences of the reference loss `L = sum(out * R)`.

#![allow(dead_code)] // each test binary uses a different subset

use horizon_backend::AttnDims;

/// f32 -> f64 copy (exact).
pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// `sum_i a[i] * b[i]` in f64.
pub fn dot64(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Central-difference gradient of `f` at `x`: `(f(x + eps e_i) - f(x - eps e_i)) / (2 eps)`.
/// All in f64, so with eps = 1e-5 the error is ~1e-10 relative (truncation eps^2, rounding
/// 1e-16 / eps), far below the f32 error of the analytic backward it is compared with.
pub fn fd_grad(x: &[f64], eps: f64, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            xp[i] = x[i] + eps;
            let lp = f(&xp);
            xp[i] = x[i] - eps;
            let lm = f(&xp);
            xp[i] = x[i];
            (lp - lm) / (2.0 * eps)
        })
        .collect()
}

/// The finite-difference step used by every gradient check.
pub const FD_EPS: f64 = 1e-5;

/// Reference embedding: `out[n, :] = table[ids[n], :]`.
pub fn embedding_ref(ids: &[i32], table: &[f64], c: usize) -> Vec<f64> {
    ids.iter().flat_map(|&id| table[id as usize * c..][..c].iter().copied()).collect()
}

/// Reference RMSNorm `out = x r (w_offset + w)`: returns `(out (N, C), rstd (N))`.
pub fn rmsnorm_ref(
    inp: &[f64],
    weight: &[f64],
    c: usize,
    eps: f64,
    w_offset: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = Vec::with_capacity(inp.len());
    let mut rstd = Vec::new();
    for x in inp.chunks(c) {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / c as f64;
        let r = 1.0 / (ms + eps).sqrt();
        rstd.push(r);
        out.extend(x.iter().zip(weight).map(|(x, w)| x * r * (w_offset + w)));
    }
    (out, rstd)
}

/// Reference per-head RMSNorm of the q and k heads of each fused row (q heads with
/// `weight[0..D]`, k heads with `weight[D..2D]`, v copied): returns
/// `(out (N, QKV), rstd (N, H + KVH))`.
pub fn head_rmsnorm_ref(
    inp: &[f64],
    weight: &[f64],
    dims: AttnDims,
    eps: f64,
    w_offset: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (d, h, heads) = (dims.d, dims.h, dims.h + dims.kvh);
    let mut out = Vec::with_capacity(inp.len());
    let mut rstd = Vec::new();
    for row in inp.chunks(dims.qkv_width()) {
        for j in 0..heads {
            let w = if j < h { &weight[..d] } else { &weight[d..] };
            let (o, r) = rmsnorm_ref(&row[j * d..][..d], w, d, eps, w_offset);
            out.extend(o);
            rstd.extend(r);
        }
        out.extend_from_slice(&row[heads * d..]);
    }
    (out, rstd)
}

/// Reference linear layer: `out[n, o] = sum_i inp[n, i] w[o, i] + bias[o]`.
pub fn matmul_ref(
    inp: &[f64],
    weight: &[f64],
    bias: Option<&[f64]>,
    n: usize,
    ic: usize,
    oc: usize,
) -> Vec<f64> {
    let mut out = vec![0.0; n * oc];
    for r in 0..n {
        for o in 0..oc {
            let s = dot64(&inp[r * ic..][..ic], &weight[o * ic..][..ic]);
            out[r * oc + o] = s + bias.map_or(0.0, |b| b[o]);
        }
    }
    out
}

/// Reference matmul backward (exact formulas, f64): returns `(dinp, dweight, dbias)`.
pub fn matmul_backward_ref(
    dout: &[f64],
    inp: &[f64],
    weight: &[f64],
    n: usize,
    ic: usize,
    oc: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dinp = vec![0.0; n * ic];
    let mut dweight = vec![0.0; oc * ic];
    let mut dbias = vec![0.0; oc];
    for r in 0..n {
        for o in 0..oc {
            let g = dout[r * oc + o];
            dbias[o] += g;
            for i in 0..ic {
                dinp[r * ic + i] += g * weight[o * ic + i];
                dweight[o * ic + i] += g * inp[r * ic + i];
            }
        }
    }
    (dinp, dweight, dbias)
}

/// Reference rotate-half RoPE on the q and k heads of each row.
pub fn rope_ref(qkv: &[f64], cos: &[f64], sin: &[f64], dims: AttnDims) -> Vec<f64> {
    let (d, half, width) = (dims.d, dims.d / 2, dims.qkv_width());
    let mut out = qkv.to_vec();
    for r in 0..dims.n() {
        let pos = r % dims.t;
        for head in 0..dims.h + dims.kvh {
            let base = r * width + head * d;
            for j in 0..half {
                let (x1, x2) = (qkv[base + j], qkv[base + j + half]);
                let (c, s) = (cos[pos * half + j], sin[pos * half + j]);
                out[base + j] = x1 * c - x2 * s;
                out[base + j + half] = x2 * c + x1 * s;
            }
        }
    }
    out
}

/// Cos and sin tables (T, D/2) for RoPE with base `theta`, as f32 (what the op is given).
pub fn rope_tables(t: usize, d: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = d / 2;
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for p in 0..t {
        for j in 0..half {
            let freq = theta.powf(-2.0 * j as f64 / d as f64);
            let a = p as f64 * freq;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}

/// Reference causal GQA with `dims.scale` and `dims.window`: explicit score row over the keys
/// `i - W < j <= i` (`j <= i` when `W = 0`), full softmax over them. Returns
/// `(out (N, H*D), lse (B, H, T))`.
pub fn attention_ref(qkv: &[f64], dims: AttnDims) -> (Vec<f64>, Vec<f64>) {
    attention_sink_ref(qkv, None, dims)
}

/// [`attention_ref`] with gpt-oss's learned sinks (H) when given: head h's `sinks[h]` is one
/// more column of every score row, in the softmax's max and sum, then dropped (no value). `lse`
/// is over all T + 1 columns.
pub fn attention_sink_ref(
    qkv: &[f64],
    sinks: Option<&[f64]>,
    dims: AttnDims,
) -> (Vec<f64>, Vec<f64>) {
    let AttnDims { b, t, h, kvh, d, window, .. } = dims;
    let width = dims.qkv_width();
    let scale = f64::from(dims.scale);
    let group = h / kvh;
    let mut out = vec![0.0; b * t * h * d];
    let mut lse = vec![0.0; b * h * t];
    for bi in 0..b {
        for hi in 0..h {
            let g = hi / group;
            for i in 0..t {
                let q = &qkv[(bi * t + i) * width + hi * d..][..d];
                let first = if window == 0 { 0 } else { (i + 1).saturating_sub(window) };
                let mut scores: Vec<f64> = (first..=i)
                    .map(|j| {
                        let k = &qkv[(bi * t + j) * width + (h + g) * d..][..d];
                        dot64(q, k) * scale
                    })
                    .collect();
                // The sink column, last: `zip` below pairs the keys only, so it adds no value.
                scores.extend(sinks.map(|s| s[hi]));
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                lse[(bi * h + hi) * t + i] = m + z.ln();
                for (j, s) in (first..=i).zip(&scores) {
                    let p = (s - m).exp() / z;
                    let v = &qkv[(bi * t + j) * width + (h + kvh + g) * d..][..d];
                    for e in 0..d {
                        out[(bi * t + i) * h * d + hi * d + e] += p * v[e];
                    }
                }
            }
        }
    }
    (out, lse)
}

/// Reference SwiGLU: `out = g sigmoid(g) u`.
pub fn swiglu_ref(gate_up: &[f64], f: usize) -> Vec<f64> {
    gate_up
        .chunks(2 * f)
        .flat_map(|row| {
            let (gate, up) = row.split_at(f);
            gate.iter().zip(up).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect::<Vec<_>>()
        })
        .collect()
}

/// Reference GeGLU: `out = gelu_tanh(g) u`, `gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`.
pub fn geglu_ref(gate_up: &[f64], f: usize) -> Vec<f64> {
    let b = (2.0 / std::f64::consts::PI).sqrt();
    gate_up
        .chunks(2 * f)
        .flat_map(|row| {
            let (gate, up) = row.split_at(f);
            gate.iter()
                .zip(up)
                .map(|(&g, &u)| 0.5 * g * (1.0 + (b * (g + 0.044715 * g * g * g)).tanh()) * u)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Reference cross-entropy losses (0 for target -100).
pub fn cross_entropy_ref(logits: &[f64], targets: &[i32], v: usize) -> Vec<f64> {
    logits
        .chunks(v)
        .zip(targets)
        .map(|(x, &k)| {
            if k == -100 {
                return 0.0;
            }
            let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + x.iter().map(|xi| (xi - m).exp()).sum::<f64>().ln();
            lse - x[k as usize]
        })
        .collect()
}
