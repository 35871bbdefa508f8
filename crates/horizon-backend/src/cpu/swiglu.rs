//! SwiGLU on the CPU: `out = silu(gate) * up` over a fused `[gate | up]` row, and its backward.
//!
//! Data flow: gate_up (N, 2F) -> silu(gate) * up -> out (N, F).

use rayon::prelude::*;

use crate::GluClamp;

/// `x[j] = sigmoid(x[j]) = 1 / (1 + exp(-x[j]))` in place, the exponentials 8 at a time;
/// saturates cleanly to 0 or 1 for large `|x|` (exp(-x) overflows to +inf, giving 0).
#[inline]
fn sigmoid_in_place(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = -*v);
    super::exp_in_place(x);
    x.iter_mut().for_each(|v| *v = 1.0 / (1.0 + *v));
}

/// SwiGLU forward: `out[n, j] = silu(g) * u` with `g = gate_up[n, j]`, `u = gate_up[n, F + j]`,
/// `silu(g) = g * sigmoid(g)`.
///
/// out: (N, F), overwrites.
/// gate_up: (N, 2F), row = `[gate (F) | up (F)]`.
pub fn swiglu_forward(out: &mut [f32], gate_up: &[f32], n: usize, f: usize) {
    assert_eq!(out.len(), n * f, "swiglu_forward: out must be (N, F)");
    assert_eq!(gate_up.len(), n * 2 * f, "swiglu_forward: gate_up must be (N, 2F)");
    if f == 0 {
        return;
    }
    out.par_chunks_mut(f).zip(gate_up.par_chunks(2 * f)).for_each(|(o, gu)| {
        let (gate, up) = gu.split_at(f);
        o.copy_from_slice(gate);
        sigmoid_in_place(o);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = g * *o * u;
        }
    });
}

// SwiGLU backward, per element with s = sigmoid(g):
//
//   out = silu(g) * u,   silu(g) = g s,   s' = s (1 - s)
//   d silu / d g = s + g s (1 - s) = s (1 + g (1 - s))
//   dL/dg = dout * u * s (1 + g (1 - s))
//   dL/du = dout * g s
//
// Implemented exactly as:
//   dgate_up[n, j]     = dout * u * (s * (1 + g * (1 - s)))        (overwrites)
//   dgate_up[n, F + j] = dout * (g * s)                            (overwrites)

/// SwiGLU backward; see the derivation above.
///
/// dgate_up: (N, 2F), overwrites.
/// dout: (N, F).
/// gate_up: (N, 2F).
pub fn swiglu_backward(dgate_up: &mut [f32], dout: &[f32], gate_up: &[f32], n: usize, f: usize) {
    assert_eq!(dgate_up.len(), n * 2 * f, "swiglu_backward: dgate_up must be (N, 2F)");
    assert_eq!(dout.len(), n * f, "swiglu_backward: dout must be (N, F)");
    assert_eq!(gate_up.len(), n * 2 * f, "swiglu_backward: gate_up must be (N, 2F)");
    if f == 0 {
        return;
    }
    dgate_up.par_chunks_mut(2 * f).zip(dout.par_chunks(f)).zip(gate_up.par_chunks(2 * f)).for_each(
        |((dgu, dy), gu)| {
            let (dgate, dup) = dgu.split_at_mut(f);
            let (gate, up) = gu.split_at(f);
            dgate.copy_from_slice(gate);
            sigmoid_in_place(dgate);
            for ((((dg, du), &dy), &g), &u) in dgate.iter_mut().zip(dup).zip(dy).zip(gate).zip(up) {
                let s = *dg;
                *dg = dy * u * (s * (1.0 + g * (1.0 - s)));
                *du = dy * (g * s);
            }
        },
    );
}

// gpt-oss's clamped SwiGLU, per element, with c = clamp, g = min(gate, limit),
// u = clamp(up, -limit, limit), s = sigmoid(alpha g):
//
//   out = (u + 1) g s
//   d(g s)/dg = s + g alpha s (1 - s) = s (1 + alpha g (1 - s))
//   dL/dgate = dout (u + 1) s (1 + alpha g (1 - s))   where gate <= limit, else 0
//   dL/dup   = dout g s                               where -limit <= up <= limit, else 0
//
// (torch's clamp passes the gradient at the bounds themselves.) Scalar sigmoid here: the
// experts' rows are short and this op is a small part of a sparse layer.

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// gpt-oss's clamped SwiGLU forward; see the derivation above.
///
/// out: (N, F), overwrites. gate_up: (N, 2F), row = `[gate (F) | up (F)]`.
pub fn clamped_swiglu_forward(out: &mut [f32], gate_up: &[f32], n: usize, f: usize, c: GluClamp) {
    assert_eq!(out.len(), n * f, "clamped_swiglu_forward: out must be (N, F)");
    assert_eq!(gate_up.len(), n * 2 * f, "clamped_swiglu_forward: gate_up must be (N, 2F)");
    if f == 0 {
        return;
    }
    out.par_chunks_mut(f).zip(gate_up.par_chunks(2 * f)).for_each(|(o, gu)| {
        let (gate, up) = gu.split_at(f);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            let (g, u) = (g.min(c.limit), u.clamp(-c.limit, c.limit));
            *o = (u + 1.0) * (g * sigmoid(c.alpha * g));
        }
    });
}

/// gpt-oss's clamped SwiGLU backward; see the derivation above.
///
/// dgate_up: (N, 2F), overwrites. dout: (N, F). gate_up: (N, 2F).
pub fn clamped_swiglu_backward(
    dgate_up: &mut [f32],
    dout: &[f32],
    gate_up: &[f32],
    (n, f): (usize, usize),
    c: GluClamp,
) {
    assert_eq!(dgate_up.len(), n * 2 * f, "clamped_swiglu_backward: dgate_up must be (N, 2F)");
    assert_eq!(dout.len(), n * f, "clamped_swiglu_backward: dout must be (N, F)");
    assert_eq!(gate_up.len(), n * 2 * f, "clamped_swiglu_backward: gate_up must be (N, 2F)");
    if f == 0 {
        return;
    }
    let rows =
        dgate_up.par_chunks_mut(2 * f).zip(dout.par_chunks(f)).zip(gate_up.par_chunks(2 * f));
    rows.for_each(|((dgu, dy), gu)| {
        let (dgate, dup) = dgu.split_at_mut(f);
        let (gate, up) = gu.split_at(f);
        for ((((dg, du), &dy), &g0), &u0) in dgate.iter_mut().zip(dup).zip(dy).zip(gate).zip(up) {
            let (g, u) = (g0.min(c.limit), u0.clamp(-c.limit, c.limit));
            let s = sigmoid(c.alpha * g);
            let g_open = if g0 <= c.limit { 1.0 } else { 0.0 };
            let u_open = if (-c.limit..=c.limit).contains(&u0) { 1.0 } else { 0.0 };
            *dg = g_open * (dy * (u + 1.0) * (s * (1.0 + c.alpha * g * (1.0 - s))));
            *du = u_open * (dy * (g * s));
        }
    });
}
