//! Per-head RMSNorm on the CPU (Qwen3's and Gemma 3's `q_norm`, `k_norm`, applied before rope):
//! every q head and every k head of a fused qkv row is one RMSNorm row of `D` values, computed
//! by the same row function as `rmsnorm` ([`rmsnorm_row`], [`rmsnorm_row_backward`]), so a
//! head's numbers are exactly those of `rmsnorm_forward` on that head alone.
//!
//! Data flow: inp (N, QKV) = `[q (H*D) | k (KVH*D) | v (KVH*D)]`
//!   -> q heads with weight[0..D], k heads with weight[D..2D], v copied -> out (N, QKV),
//!   rstd (N, H + KVH).

use std::ops::Range;

use rayon::prelude::*;

use super::rmsnorm::{rmsnorm_row, rmsnorm_row_backward};
use crate::{AttnDims, NormDims};

/// Columns of one half of `dweight` per parallel task in the backward (also the stack
/// accumulator size); small because `2D` columns are all there are.
const DW_COLS: usize = 16;

/// Checks the shapes common to the forward and the backward.
fn check(what: &str, inp: &[f32], weight: &[f32], rstd: &[f32], dims: AttnDims, norm: NormDims) {
    let d = dims.d;
    assert!(d > 0, "{what}: D must be positive");
    assert_eq!(norm.c, d, "{what}: norm.c = {} must be the head dim D = {d}", norm.c);
    assert_eq!(weight.len(), 2 * d, "{what}: weight must be (2D) = [q_norm (D) | k_norm (D)]");
    assert_eq!(inp.len(), dims.n() * dims.qkv_width(), "{what}: inp must be (N, QKV)");
    assert_eq!(rstd.len(), dims.n() * (dims.h + dims.kvh), "{what}: rstd must be (N, H + KVH)");
}

/// Per-head RMSNorm forward, rows in parallel: head `j < H` of a row is normalised with
/// `weight[0..D]`, head `j >= H` (a k head) with `weight[D..2D]`, each as
/// `x * rstd * (norm.w_offset + w)`; the v part is copied.
///
/// out: (N, QKV), overwrites.
/// rstd: (N, H + KVH), overwrites: each row's q heads' rstd, then its k heads'.
/// inp: (N, QKV).
/// weight: (2D) = `[q_norm (D) | k_norm (D)]`.
pub fn head_rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    dims: AttnDims,
    norm: NormDims,
) {
    check("head_rmsnorm_forward", inp, weight, rstd, dims, norm);
    assert_eq!(out.len(), inp.len(), "head_rmsnorm_forward: out must be (N, QKV)");
    let (d, h, heads, width) = (dims.d, dims.h, dims.h + dims.kvh, dims.qkv_width());
    if dims.n() == 0 {
        return;
    }
    let (wq, wk) = weight.split_at(d);
    out.par_chunks_mut(width).zip(rstd.par_chunks_mut(heads)).zip(inp.par_chunks(width)).for_each(
        |((o, rs), x)| {
            let (o_qk, o_v) = o.split_at_mut(heads * d);
            let (x_qk, x_v) = x.split_at(heads * d);
            for (j, ((o, x), r)) in
                o_qk.chunks_exact_mut(d).zip(x_qk.chunks_exact(d)).zip(rs).enumerate()
            {
                *r = rmsnorm_row(o, x, if j < h { wq } else { wk }, norm);
            }
            o_v.copy_from_slice(x_v);
        },
    );
}

// Per-head RMSNorm backward. Each head is an RMSNorm row (see rmsnorm.rs for the derivation):
// with r = its rstd, a_i = w_offset + w_i (w = the q or the k half of the weight),
//
//   dL/dx_k = r * (dout_k a_k - x_k * r^2 * s / D),   s = sum_i dout_i a_i x_i
//   dL/dw_i = sum over rows n and heads j of that half of dout[n,j,i] x[n,j,i] r[n,j]
//   dL/dv   = dout's v part (the copy's gradient)
//
// Implemented exactly as:
//   dinp[n, head j]   = rmsnorm's row backward, overwriting          (per head; rows in parallel)
//   dinp[n, v part]   = dout[n, v part]                              (overwrites)
//   dw_q[i] += (sum_{n asc} sum_{j in 0..H asc} (dout[n,j,i] * x[n,j,i]) * r[n,j])
//   dw_k[i] += (sum_{n asc} sum_{j in H..H+KVH asc} (dout[n,j,i] * x[n,j,i]) * r[n,j])
//                                    (accumulates: each sum is formed first, then added once;
//                                     one task per DW_COLS columns, so the order is fixed)

/// Per-head RMSNorm backward; see the derivation above.
///
/// dinp: (N, QKV), overwrites (its v part is dout's).
/// dweight: (2D), accumulates (+=); `None` for frozen norm weights: not computed.
/// dout: (N, QKV).
/// inp: (N, QKV).
/// weight: (2D).
/// rstd: (N, H + KVH), as saved by the forward.
#[allow(clippy::too_many_arguments)]
pub fn head_rmsnorm_backward(
    dinp: &mut [f32],
    dweight: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    dims: AttnDims,
    norm: NormDims,
) {
    check("head_rmsnorm_backward", inp, weight, rstd, dims, norm);
    assert_eq!(dinp.len(), inp.len(), "head_rmsnorm_backward: dinp must be (N, QKV)");
    assert_eq!(dout.len(), inp.len(), "head_rmsnorm_backward: dout must be (N, QKV)");
    if let Some(dw) = &dweight {
        assert_eq!(dw.len(), 2 * dims.d, "head_rmsnorm_backward: dweight must be (2D)");
    }
    let (d, h, heads, width) = (dims.d, dims.h, dims.h + dims.kvh, dims.qkv_width());
    if dims.n() == 0 {
        return;
    }
    let (wq, wk) = weight.split_at(d);
    dinp.par_chunks_mut(width)
        .zip(dout.par_chunks(width))
        .zip(inp.par_chunks(width))
        .zip(rstd.par_chunks(heads))
        .for_each(|(((dx, dy), x), rs)| {
            let (dx_qk, dx_v) = dx.split_at_mut(heads * d);
            let (dy_qk, dy_v) = dy.split_at(heads * d);
            for (j, (((dx, dy), x), &r)) in dx_qk
                .chunks_exact_mut(d)
                .zip(dy_qk.chunks_exact(d))
                .zip(x.chunks_exact(d))
                .zip(rs)
                .enumerate()
            {
                let w = if j < h { wq } else { wk };
                rmsnorm_row_backward::<false>(dx, dy, x, w, r, norm.w_offset);
            }
            dx_v.copy_from_slice(dy_v);
        });

    let Some(dweight) = dweight else { return };
    let (dwq, dwk) = dweight.split_at_mut(d);
    let half = |dw: &mut [f32], heads_of: Range<usize>| {
        dw.par_chunks_mut(DW_COLS).enumerate().for_each(|(tile, dw)| {
            let c0 = tile * DW_COLS;
            let cols = dw.len();
            let mut acc = [0.0f32; DW_COLS];
            for (row, rs) in rstd.chunks_exact(heads).enumerate() {
                for j in heads_of.clone() {
                    let r = rs[j];
                    let off = row * width + j * d + c0;
                    let (dy, x) = (&dout[off..][..cols], &inp[off..][..cols]);
                    for ((a, dy), x) in acc.iter_mut().zip(dy).zip(x) {
                        *a += dy * x * r;
                    }
                }
            }
            for (d, a) in dw.iter_mut().zip(&acc) {
                *d += a;
            }
        });
    };
    rayon::join(|| half(dwq, 0..h), || half(dwk, h..heads));
}
