//! GeGLU on the CPU (Gemma's MLP): `out = gelu_tanh(gate) * up` over a fused `[gate | up]` row,
//! and its backward. `gelu_tanh` is transformers' `gelu_pytorch_tanh` (PyTorch's
//! `gelu(approximate="tanh")`), in fp32 with PyTorch's order of operations.
//!
//! Data flow: gate_up (N, 2F) -> gelu_tanh(gate) * up -> out (N, F).

use rayon::prelude::*;

/// `sqrt(2/pi)` rounded to fp32 (PyTorch's `kBeta = M_SQRT2 * M_2_SQRTPI * 0.5`).
const BETA: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh approximation (PyTorch's `kKappa`).
const KAPPA: f32 = 0.044_715;

/// `gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, computed as
/// `0.5 * x * (1 + tanh(BETA * (x + KAPPA * (x * x * x))))`.
#[inline]
fn gelu_tanh(x: f32) -> f32 {
    let inner = BETA * (x + KAPPA * (x * x * x));
    0.5 * x * (1.0 + inner.tanh())
}

/// GeGLU forward: `out[n, j] = gelu_tanh(g) * u` with `g = gate_up[n, j]`,
/// `u = gate_up[n, F + j]`.
///
/// out: (N, F), overwrites.
/// gate_up: (N, 2F), row = `[gate (F) | up (F)]`.
pub fn geglu_forward(out: &mut [f32], gate_up: &[f32], n: usize, f: usize) {
    assert_eq!(out.len(), n * f, "geglu_forward: out must be (N, F)");
    assert_eq!(gate_up.len(), n * 2 * f, "geglu_forward: gate_up must be (N, 2F)");
    if f == 0 {
        return;
    }
    out.par_chunks_mut(f).zip(gate_up.par_chunks(2 * f)).for_each(|(o, gu)| {
        let (gate, up) = gu.split_at(f);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = gelu_tanh(g) * u;
        }
    });
}

// GeGLU backward, per element, with b = sqrt(2/pi), k = 0.044715:
//
//   out = gelu_tanh(g) * u,   gelu_tanh(g) = 0.5 g (1 + t),   t = tanh(z),   z = b (g + k g^3)
//   dt/dg = (1 - t^2) dz/dg = (1 - t^2) b (1 + 3 k g^2)
//   d gelu_tanh / dg = 0.5 (1 + t) + 0.5 g dt/dg
//                    = 0.5 (1 + t) + 0.5 g (1 - t^2) b (1 + 3 k g^2)
//   dL/dg = dout * u * d gelu_tanh / dg
//   dL/du = dout * gelu_tanh(g)
//
// Implemented exactly as (g2 = g * g, z = BETA * (g + KAPPA * (g2 * g)), t = tanh(z)):
//   gp                 = 0.5 * (1 + t) + (0.5 * g) * (1 - t * t) * BETA * (1 + 3 * KAPPA * g2)
//   dgate_up[n, j]     = dout * u * gp                                  (overwrites)
//   dgate_up[n, F + j] = dout * (0.5 * g * (1 + t))                     (overwrites)
// (g2 * g is g * g * g, so z and gelu_tanh(g) are the forward's bits.)

/// GeGLU backward; see the derivation above.
///
/// dgate_up: (N, 2F), overwrites.
/// dout: (N, F).
/// gate_up: (N, 2F).
pub fn geglu_backward(dgate_up: &mut [f32], dout: &[f32], gate_up: &[f32], n: usize, f: usize) {
    assert_eq!(dgate_up.len(), n * 2 * f, "geglu_backward: dgate_up must be (N, 2F)");
    assert_eq!(dout.len(), n * f, "geglu_backward: dout must be (N, F)");
    assert_eq!(gate_up.len(), n * 2 * f, "geglu_backward: gate_up must be (N, 2F)");
    if f == 0 {
        return;
    }
    dgate_up.par_chunks_mut(2 * f).zip(dout.par_chunks(f)).zip(gate_up.par_chunks(2 * f)).for_each(
        |((dgu, dy), gu)| {
            let (dgate, dup) = dgu.split_at_mut(f);
            let (gate, up) = gu.split_at(f);
            for ((((dg, du), &dy), &g), &u) in dgate.iter_mut().zip(dup).zip(dy).zip(gate).zip(up) {
                let g2 = g * g;
                let t = (BETA * (g + KAPPA * (g2 * g))).tanh();
                let gp =
                    0.5 * (1.0 + t) + (0.5 * g) * (1.0 - t * t) * BETA * (1.0 + 3.0 * KAPPA * g2);
                *dg = dy * u * gp;
                *du = dy * (0.5 * g * (1.0 + t));
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::{BETA, KAPPA};

    /// The constants are the fp32 roundings of PyTorch's double-precision ones.
    #[test]
    fn constants_are_pytorchs_rounded_to_fp32() {
        let beta = std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5;
        assert_eq!(BETA, beta as f32);
        assert_eq!(KAPPA, 0.044715f64 as f32);
    }
}
