//! Learned attention sinks (gpt-oss) on the CPU, as a step after attention: head h's logit
//! `sink_h` is one more column of every score row, which takes probability mass and adds no
//! value. The attention kernels are untouched: the sink rescales what they produced.
//!
//! Data flow: attention_forward -> out (N, H*D), lse (B, H, T) -> sink_forward (in place)
//!   -> out, lse of the T + 1 columns; backward: attention_backward on those (dqkv) and
//!   sink_backward (dsinks (H)).
//!
//! Forward, one row i of head h, scores s_ij over its visible keys, lse_i = log sum_j exp(s_ij):
//!
//!   lse'_i = log(exp(lse_i) + exp(sink_h)) = m + log1p(exp(-|lse_i - sink_h|)), m = max of the two
//!   P'_ij  = exp(s_ij - lse'_i) = P_ij exp(lse_i - lse'_i),   P'_i,sink = exp(sink_h - lse'_i)
//!   out'_i = sum_j P'_ij v_j = exp(lse_i - lse'_i) out_i
//!
//! Backward, L a function of out'. The softmax over the T + 1 columns has the usual backward,
//! with dP'_ij = dout_i . v_j for the keys and dP'_i,sink = 0 (the sink has no value):
//!
//!   delta_i = sum_k P'_ik dP'_ik = dout_i . sum_j P'_ij v_j = dout_i . out'_i
//!   dS_ij   = P'_ij (dout_i . v_j - delta_i)      (keys: attention_backward's formula, with
//!                                                    P' = exp(s - lse') and delta = dout . out')
//!   dS_i,sink = P'_i,sink (0 - delta_i)
//!
//! so attention_backward given out' and lse' computes dq, dk, dv of the sink attention, and
//!
//!   dsink_h = sum_i dS_i,sink = - sum_i exp(sink_h - lse'_i) (dout_i . out'_i)
//!
//! over every row i of every sequence: what [`attention_sink_backward`] adds to `dsinks[h]`.

use rayon::prelude::*;

use super::attention::DisjointMut;
use super::dot;
use crate::AttnDims;

/// Checks the shapes of a sink call.
fn check(what: &str, dims: AttnDims, out_len: usize, lse_len: usize, sinks_len: usize) {
    let AttnDims { b, t, h, d, .. } = dims;
    assert_eq!(out_len, b * t * h * d, "{what}: out must be (N, H*D)");
    assert_eq!(lse_len, b * h * t, "{what}: lse must be (B, H, T)");
    assert_eq!(sinks_len, h, "{what}: sinks must be (H)");
}

/// `log(exp(a) + exp(b))`, without overflow: the larger plus `log1p` of the smaller's share.
pub(super) fn logaddexp(a: f32, b: f32) -> f32 {
    a.max(b) + (-(a - b).abs()).exp().ln_1p()
}

/// The sinks folded into an attention forward's results, in place: per row i and head h,
/// `lse'_i = logaddexp(lse_i, sinks[h])`, `out_i *= exp(lse_i - lse'_i)`. One parallel task per
/// (b, h) pair, as the attention forward.
///
/// out: (N, H*D), in place. lse: (B, H, T), in place (overwritten with lse'). sinks: (H).
pub fn attention_sink_forward(out: &mut [f32], lse: &mut [f32], sinks: &[f32], dims: AttnDims) {
    check("attention_sink_forward", dims, out.len(), lse.len(), sinks.len());
    let AttnDims { t, h, d, .. } = dims;
    if t == 0 {
        return;
    }
    let out = DisjointMut::new(out);
    lse.par_chunks_mut(t).enumerate().for_each(|(bh, lse_bh)| {
        let (bi, hi) = (bh / h, bh % h);
        for (i, l) in lse_bh.iter_mut().enumerate() {
            let l2 = logaddexp(*l, sinks[hi]);
            let f = (*l - l2).exp();
            *l = l2;
            // SAFETY: head hi's columns of batch bi's rows belong to task (bi, hi) alone, and
            // only this one view of them is live at a time.
            let o = unsafe { out.slice_mut((bi * t + i) * h * d + hi * d, d) };
            o.iter_mut().for_each(|x| *x *= f);
        }
    });
}

/// The sinks' gradient (derivation above): `dsinks[h] += - sum_i exp(sinks[h] - lse'_i)
/// (dout_i . out_i)`, rows i of every sequence summed in order, one parallel task per head.
///
/// dsinks: (H), accumulates (+=). dout: (N, H*D). out: (N, H*D) and lse: (B, H, T), the
/// sink-adjusted ones [`attention_sink_forward`] left. sinks: (H).
pub fn attention_sink_backward(
    dsinks: &mut [f32],
    dout: &[f32],
    out: &[f32],
    lse: &[f32],
    sinks: &[f32],
    dims: AttnDims,
) {
    check("attention_sink_backward", dims, out.len(), lse.len(), sinks.len());
    assert_eq!(dout.len(), out.len(), "attention_sink_backward: dout must be (N, H*D)");
    assert_eq!(dsinks.len(), dims.h, "attention_sink_backward: dsinks must be (H)");
    let AttnDims { b, t, h, d, .. } = dims;
    let hd = h * d;
    dsinks.par_iter_mut().enumerate().for_each(|(hi, ds)| {
        let mut acc = 0.0f32;
        for bi in 0..b {
            for i in 0..t {
                let at = (bi * t + i) * hd + hi * d;
                let p = (sinks[hi] - lse[(bi * h + hi) * t + i]).exp();
                acc += p * dot(&dout[at..at + d], &out[at..at + d]);
            }
        }
        *ds -= acc;
    });
}
