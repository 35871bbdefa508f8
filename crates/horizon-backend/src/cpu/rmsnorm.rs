//! RMSNorm on the CPU: `out = inp * rstd * (w_offset + weight)` with
//! `rstd = 1/sqrt(mean(inp^2) + eps)` per row, and its backward. `w_offset` is 0 for Llama-style
//! norms and 1 for Gemma's `x * (1 + w)`; the sum `w_offset + w` is formed in fp32, as
//! transformers does.
//!
//! Data flow: inp (N, C) -> rstd (N) -> out (N, C).
//!
//! The per-row work is [`rmsnorm_row`] and [`rmsnorm_row_backward`], which the per-head norm
//! (`head_rmsnorm`) runs on each head, so the two ops compute a row the same way.

use rayon::prelude::*;

use super::dot;
use crate::NormDims;

/// Columns of `dweight` per parallel task in the backward (also the stack accumulator size).
const DW_COLS: usize = 64;

/// The weight as applied: `w_offset + w` in fp32; `w` itself when the offset is 0, so that the
/// plain norm keeps its bits even for a `-0.0` weight (`0.0 + -0.0` is `+0.0`).
#[inline(always)]
fn applied(w: f32, w_offset: f32) -> f32 {
    if w_offset == 0.0 { w } else { w_offset + w }
}

/// One row of the forward: `out = x * rstd * (w_offset + weight)`; returns `rstd`.
/// out, x, weight: (C) with `C = x.len()`.
#[inline]
pub(crate) fn rmsnorm_row(out: &mut [f32], x: &[f32], weight: &[f32], norm: NormDims) -> f32 {
    debug_assert!(out.len() == x.len() && weight.len() == x.len());
    let ms = dot(x, x) / x.len() as f32;
    let rs = 1.0 / (ms + norm.eps).sqrt();
    for ((o, x), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = x * rs * applied(w, norm.w_offset);
    }
    rs
}

/// RMSNorm forward, rows in parallel.
///
/// out: (N, C), overwrites.
/// rstd: (N), overwrites; saved for the backward.
/// inp: (N, C).
/// weight: (C), applied as `(norm.w_offset + weight)`.
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    norm: NormDims,
) {
    let c = norm.c;
    assert!(c > 0, "rmsnorm_forward: C must be positive");
    assert_eq!(weight.len(), c, "rmsnorm_forward: weight must be (C)");
    assert_eq!(inp.len() % c, 0, "rmsnorm_forward: inp must be (N, C)");
    let n = inp.len() / c;
    assert_eq!(out.len(), n * c, "rmsnorm_forward: out must be (N, C)");
    assert_eq!(rstd.len(), n, "rmsnorm_forward: rstd must be (N)");
    out.par_chunks_mut(c)
        .zip(rstd.par_iter_mut())
        .zip(inp.par_chunks(c))
        .for_each(|((o, r), x)| *r = rmsnorm_row(o, x, weight, norm));
}

// RMSNorm backward, for one row x (C values) with r = rstd = (mean(x^2) + eps)^(-1/2) and the
// applied weight a_i = w_offset + w_i:
//
//   out_i = x_i * r * a_i
//   d r / d x_k = -1/2 (mean(x^2) + eps)^(-3/2) * 2 x_k / C = -r^3 x_k / C
//
//   dL/dx_k = sum_i dout_i * d out_i / d x_k
//           = dout_k a_k r + sum_i dout_i a_i x_i * (-r^3 x_k / C)
//           = r * (dout_k a_k - x_k * r^2 * s / C),   with s = sum_i dout_i a_i x_i
//   dL/dw_i = dL/da_i (w_offset is a constant) = sum_n dout[n,i] x[n,i] r[n]
//
// Implemented exactly as:
//   s          = sum_i (dout_i * a_i) * x_i                        (per row, i ascending)
//   dinp[n,k] += r * (dout_k * a_k - x_k * (r * r * s / C))        (accumulates: residual stream)
//   dw[i]     += (sum_{n ascending} (dout[n,i] * x[n,i]) * r[n])   (accumulates: the sum is
//                                                                    formed first, added once)
// with a_k = w_k when w_offset is 0 (see `applied`).

/// One row of the backward's `dinp`: `dx (+)= r * (dy * a - x * (r * r * s / C))` as derived
/// above; accumulates (+=) when `ACC`, overwrites otherwise.
/// dx, dy, x, weight: (C) with `C = x.len()`. r: the row's rstd.
#[inline]
pub(crate) fn rmsnorm_row_backward<const ACC: bool>(
    dx: &mut [f32],
    dy: &[f32],
    x: &[f32],
    weight: &[f32],
    r: f32,
    w_offset: f32,
) {
    debug_assert!(dx.len() == x.len() && dy.len() == x.len() && weight.len() == x.len());
    let mut s = 0.0f32;
    for ((dy, &w), x) in dy.iter().zip(weight).zip(x) {
        s += dy * applied(w, w_offset) * x;
    }
    let k = r * r * s / x.len() as f32;
    for (((dx, dy), &w), x) in dx.iter_mut().zip(dy).zip(weight).zip(x) {
        let g = r * (dy * applied(w, w_offset) - x * k);
        if ACC {
            *dx += g;
        } else {
            *dx = g;
        }
    }
}

/// RMSNorm backward; see the derivation above.
///
/// dinp: (N, C), accumulates (+=).
/// dweight: (C), accumulates (+=); `None` for a frozen weight: not computed.
/// dout: (N, C).
/// inp: (N, C).
/// weight: (C).
/// rstd: (N), as saved by the forward.
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dweight: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    norm: NormDims,
) {
    let c = norm.c;
    assert!(c > 0, "rmsnorm_backward: C must be positive");
    assert_eq!(weight.len(), c, "rmsnorm_backward: weight must be (C)");
    assert_eq!(inp.len() % c, 0, "rmsnorm_backward: inp must be (N, C)");
    let n = inp.len() / c;
    assert_eq!(dinp.len(), n * c, "rmsnorm_backward: dinp must be (N, C)");
    assert_eq!(dout.len(), n * c, "rmsnorm_backward: dout must be (N, C)");
    assert_eq!(rstd.len(), n, "rmsnorm_backward: rstd must be (N)");

    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c))
        .zip(rstd.par_iter())
        .for_each(|(((dx, dy), x), &r)| {
            rmsnorm_row_backward::<true>(dx, dy, x, weight, r, norm.w_offset)
        });

    let Some(dweight) = dweight else { return };
    assert_eq!(dweight.len(), c, "rmsnorm_backward: dweight must be (C)");
    dweight.par_chunks_mut(DW_COLS).enumerate().for_each(|(tile, dw)| {
        let c0 = tile * DW_COLS;
        let width = dw.len();
        let mut acc = [0.0f32; DW_COLS];
        for (row, &r) in rstd.iter().enumerate() {
            let dy = &dout[row * c + c0..][..width];
            let x = &inp[row * c + c0..][..width];
            for ((a, dy), x) in acc.iter_mut().zip(dy).zip(x) {
                *a += dy * x * r;
            }
        }
        for (d, a) in dw.iter_mut().zip(&acc) {
            *d += a;
        }
    });
}
