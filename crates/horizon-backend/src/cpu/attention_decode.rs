//! Attention of a KV cache's new positions on the CPU: the last `T_new` query rows of each
//! sequence against every key before and at them (a decode step of generation, forward only).
//! The reference for the CUDA kernel; tested against the rows of [`super::attention_forward`].
//!
//! Data flow: qkv (B*T, QKV) after rope, the cache of every position so far; for each new row i
//! (`T - T_new <= i < T`): s_ij = scale q_i.k_j (i - W < j <= i) -> softmax -> out (B*T_new,
//! H*D). With sinks, head h's logit `sinks[h]` is one more column of each row's softmax (in
//! its max and its sum; it adds no value): the rows of the forward followed by
//! [`super::attention_sink_forward`], within fp32 rounding (one exp of the sink against a
//! rescale by `exp(lse - lse')`).
//!
//! One parallel task per (b, h); per query row, the scores against the keys it sees are one
//! product (`gemm_serial`, one row: the same sums as a row of the full forward's score block),
//! then the row softmax as the full forward computes it, then `out = P . V` by another product.
//! With no window (or `W >= T`) a row's keys start at 0, as in the full forward, so its output
//! has the full forward's bits; within a window its key range starts at the row's own window,
//! so its sums are grouped differently (within fp32 rounding of the full forward's).

use rayon::prelude::*;

use super::attention::{DisjointMut, SCRATCH, scores, sum};
use super::exp_in_place;
use super::matmul::{View, gemm_serial, with_scratch};
use crate::AttnDims;

/// Attention of the last `t_new` positions of each of `dims.b` sequences of `dims.t` positions.
///
/// out: (B*T_new, H*D), overwrites: row `bi*T_new + r` is query position `T - T_new + r` of
/// sequence `bi`, as row `bi*T + T - T_new + r` of `attention_forward`'s `out`.
/// qkv: (B*T, QKV), row = `[q (H*D) | k (KVH*D) | v (KVH*D)]`, after rope; the q parts of the
/// rows before `T - T_new` are not read. sinks: (H), each head's sink logit, or `None`.
pub fn attention_decode(
    out: &mut [f32],
    qkv: &[f32],
    sinks: Option<&[f32]>,
    t_new: usize,
    dims: AttnDims,
) {
    let AttnDims { b, t, h, kvh, d, window, scale } = dims;
    assert!(kvh > 0 && h % kvh == 0, "attention_decode: H = {h} must be a multiple of KVH = {kvh}");
    assert!(t_new <= t, "attention_decode: {t_new} new positions of {t}");
    assert_eq!(qkv.len(), b * t * dims.qkv_width(), "attention_decode: qkv must be (B*T, QKV)");
    assert_eq!(out.len(), b * t_new * h * d, "attention_decode: out must be (B*T_new, H*D)");
    if let Some(s) = sinks {
        assert_eq!(s.len(), h, "attention_decode: sinks must be (H)");
    }
    let (width, group, hd) = (dims.qkv_width(), h / kvh, h * d);
    let out = DisjointMut::new(out);
    (0..b * h).into_par_iter().for_each(|bh| {
        let (bi, hi) = (bh / h, bh % h);
        let g = hi / group;
        let (q_col, k_col, v_col) = (hi * d, (h + g) * d, (h + kvh + g) * d);
        let sink = sinks.map(|s| s[hi]);
        with_scratch(&SCRATCH, t + d, |scratch| {
            let (p, o) = scratch.split_at_mut(t);
            for r in 0..t_new {
                let i = t - t_new + r;
                let k0 = if window == 0 { 0 } else { (i + 1).saturating_sub(window) };
                let keys = i + 1 - k0;
                let p = &mut p[..keys];
                scores(p, qkv, width, d, q_col, k_col, bi * t + i, 1, bi * t + k0, keys);
                let m = p.iter_mut().fold(sink.unwrap_or(f32::NEG_INFINITY), |m, x| {
                    *x *= scale;
                    m.max(*x)
                });
                p.iter_mut().for_each(|x| *x -= m);
                exp_in_place(p);
                let inv = 1.0 / (sum(p) + sink.map_or(0.0, |s| (s - m).exp()));
                p.iter_mut().for_each(|x| *x *= inv);
                // o (1, d) = P (1, keys) . V (keys, d).
                let a = View { data: p, rs: keys, cs: 1 };
                let v = View { data: &qkv[(bi * t + k0) * width + v_col..], rs: width, cs: 1 };
                gemm_serial(&mut o[..d], d, a, v, 1, d, keys, false);
                // SAFETY: task (bi, hi) is the only one writing head hi's columns of batch bi's
                // rows, and only this one view of them is live at a time.
                let dst = unsafe { out.slice_mut((bi * t_new + r) * hd + hi * d, d) };
                dst.copy_from_slice(&o[..d]);
            }
        });
    });
}
