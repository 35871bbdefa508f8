//! The sigmoid row gate on the CPU (Qwen2-MoE's shared expert): each row of `inp` scaled by
//! the sigmoid of its own logit, and its backward.
//!
//! Data flow: gate (N) (a (1, C) linear layer's output), inp (N, C) -> sigmoid(gate[r]) * inp[r]
//! -> out (N, C).
//!
//! Each row is one task and its sum runs in order: results do not depend on the number of
//! threads.

use rayon::prelude::*;

/// `1 / (1 + exp(-g))`; saturates cleanly to 0 or 1 for large `|g|` (exp(-g) overflows to
/// +inf, giving 0).
#[inline]
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

/// Sigmoid gate forward: `out[r, j] = sigmoid(gate[r]) * inp[r, j]`.
///
/// out: (N, C), overwrites. gate: (N). inp: (N, C).
pub fn sigmoid_gate_forward(out: &mut [f32], gate: &[f32], inp: &[f32], c: usize) {
    let n = gate.len();
    assert_eq!(out.len(), n * c, "sigmoid_gate_forward: out must be (N, C)");
    assert_eq!(inp.len(), n * c, "sigmoid_gate_forward: inp must be (N, C)");
    if c == 0 {
        return;
    }
    out.par_chunks_mut(c).zip(inp.par_chunks(c)).zip(gate.par_iter()).for_each(|((o, x), &g)| {
        let s = sigmoid(g);
        o.iter_mut().zip(x).for_each(|(o, &x)| *o = s * x);
    });
}

// Sigmoid gate backward, per row r with s = sigmoid(g), g = gate[r]:
//
//   out[r, j] = s * inp[r, j],   s' = s (1 - s)
//   dL/dinp[r, j] = dout[r, j] * s
//   dL/dg         = sum_j dout[r, j] * d out[r, j] / d g = s (1 - s) * sum_j dout[r, j] inp[r, j]
//
// Implemented exactly as (the dot summed in f32 over j = 0..C in order):
//   dinp[r, j] = s * dout[r, j]                                   (overwrites)
//   dgate[r]   = (s * (1 - s)) * sum_j dout[r, j] * inp[r, j]     (overwrites)

/// Sigmoid gate backward; see the derivation above.
///
/// dinp: (N, C), overwrites. dgate: (N), overwrites. dout: (N, C). gate: (N). inp: (N, C).
pub fn sigmoid_gate_backward(
    dinp: &mut [f32],
    dgate: &mut [f32],
    dout: &[f32],
    gate: &[f32],
    inp: &[f32],
    c: usize,
) {
    let n = gate.len();
    assert_eq!(dgate.len(), n, "sigmoid_gate_backward: dgate must be (N)");
    assert_eq!(dinp.len(), n * c, "sigmoid_gate_backward: dinp must be (N, C)");
    assert_eq!(dout.len(), n * c, "sigmoid_gate_backward: dout must be (N, C)");
    assert_eq!(inp.len(), n * c, "sigmoid_gate_backward: inp must be (N, C)");
    if c == 0 {
        // Rows of no element: an empty sum.
        dgate.fill(0.0);
        return;
    }
    dinp.par_chunks_mut(c)
        .zip(dgate.par_iter_mut())
        .zip(dout.par_chunks(c).zip(inp.par_chunks(c)))
        .zip(gate.par_iter())
        .for_each(|(((dx, dg), (dy, x)), &g)| {
            let s = sigmoid(g);
            let mut dot = 0.0f32;
            for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
                *dx = s * dy;
                dot += dy * x;
            }
            *dg = (s * (1.0 - s)) * dot;
        });
}
