//! RMSNorm on the CPU: `out = inp * rstd * weight` with `rstd = 1/sqrt(mean(inp^2) + eps)` per
//! row, and its backward.
//!
//! Data flow: inp (N, C) -> rstd (N) -> out (N, C).

use rayon::prelude::*;

use super::dot;

/// Columns of `dweight` per parallel task in the backward (also the stack accumulator size).
const DW_COLS: usize = 64;

/// RMSNorm forward, rows in parallel.
///
/// out: (N, C), overwrites.
/// rstd: (N), overwrites; saved for the backward.
/// inp: (N, C).
/// weight: (C).
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    c: usize,
    eps: f32,
) {
    assert!(c > 0, "rmsnorm_forward: C must be positive");
    assert_eq!(weight.len(), c, "rmsnorm_forward: weight must be (C)");
    assert_eq!(inp.len() % c, 0, "rmsnorm_forward: inp must be (N, C)");
    let n = inp.len() / c;
    assert_eq!(out.len(), n * c, "rmsnorm_forward: out must be (N, C)");
    assert_eq!(rstd.len(), n, "rmsnorm_forward: rstd must be (N)");
    out.par_chunks_mut(c).zip(rstd.par_iter_mut()).zip(inp.par_chunks(c)).for_each(
        |((o, r), x)| {
            let ms = dot(x, x) / c as f32;
            let rs = 1.0 / (ms + eps).sqrt();
            *r = rs;
            for ((o, x), w) in o.iter_mut().zip(x).zip(weight) {
                *o = x * rs * w;
            }
        },
    );
}

// RMSNorm backward, for one row x (C values) with r = rstd = (mean(x^2) + eps)^(-1/2):
//
//   out_i = x_i * r * w_i
//   d r / d x_k = -1/2 (mean(x^2) + eps)^(-3/2) * 2 x_k / C = -r^3 x_k / C
//
//   dL/dx_k = sum_i dout_i * d out_i / d x_k
//           = dout_k w_k r + sum_i dout_i w_i x_i * (-r^3 x_k / C)
//           = r * (dout_k w_k - x_k * r^2 * s / C),   with s = sum_i dout_i w_i x_i
//   dL/dw_i = sum_n dout[n,i] x[n,i] r[n]
//
// Implemented exactly as:
//   s          = sum_i (dout_i * w_i) * x_i                        (per row, i ascending)
//   dinp[n,k] += r * (dout_k * w_k - x_k * (r * r * s / C))        (accumulates: residual stream)
//   dw[i]     += (sum_{n ascending} (dout[n,i] * x[n,i]) * r[n])   (accumulates: the sum is
//                                                                    formed first, added once)

/// RMSNorm backward; see the derivation above.
///
/// dinp: (N, C), accumulates (+=).
/// dweight: (C), accumulates (+=).
/// dout: (N, C).
/// inp: (N, C).
/// weight: (C).
/// rstd: (N), as saved by the forward.
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    c: usize,
) {
    assert!(c > 0, "rmsnorm_backward: C must be positive");
    assert_eq!(weight.len(), c, "rmsnorm_backward: weight must be (C)");
    assert_eq!(dweight.len(), c, "rmsnorm_backward: dweight must be (C)");
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
            let mut s = 0.0f32;
            for ((dy, w), x) in dy.iter().zip(weight).zip(x) {
                s += dy * w * x;
            }
            let k = r * r * s / c as f32;
            for (((dx, dy), w), x) in dx.iter_mut().zip(dy).zip(weight).zip(x) {
                *dx += r * (dy * w - x * k);
            }
        });

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
