//! Causal grouped-query attention on the CPU, flash style: no (T, T) score matrix is ever
//! stored; the forward saves only the log-sum-exp of each score row, and the backward
//! recomputes the probabilities from q, k and that lse.
//!
//! Data flow: qkv (N, QKV) after rope -> scores s_ij = scale q_i.k_j (j <= i)
//!   -> online softmax -> out (N, H*D), lse (B, H, T).
//!
//! Query head `h` reads kv head `h / (H/KVH)`; `scale = 1/sqrt(D)`.

use std::marker::PhantomData;

use rayon::prelude::*;

use super::{axpy, dot};
use crate::AttnDims;

/// A mutable buffer shared by parallel tasks that each write a disjoint set of elements.
/// Rayon's safe splitting cannot express "columns of head h of every row of batch b", which is
/// what one attention task owns, so tasks carve their views out of this with `slice_mut`.
struct DisjointMut<'a> {
    ptr: *mut f32,
    len: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: `DisjointMut` is only a raw view of a `&'a mut [f32]` that it borrows for its whole
// life; handing it to other threads is sound because every task promises (see `slice_mut`) to
// touch only elements no other task touches, so no element is ever accessed from two threads.
unsafe impl Send for DisjointMut<'_> {}
// SAFETY: as for `Send`: shared use across threads only ever yields disjoint element ranges.
unsafe impl Sync for DisjointMut<'_> {}

impl<'a> DisjointMut<'a> {
    fn new(buf: &'a mut [f32]) -> Self {
        DisjointMut { ptr: buf.as_mut_ptr(), len: buf.len(), _borrow: PhantomData }
    }

    /// The elements `off..off + len`, bounds-checked.
    ///
    /// # Safety
    /// While the returned slice lives, no other slice obtained from this `DisjointMut` (in this
    /// or any other thread) may overlap `off..off + len`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [f32] {
        assert!(off + len <= self.len, "attention: view {off}+{len} out of {}", self.len);
        // SAFETY: the range is in bounds of the borrowed buffer (asserted above), the buffer is
        // exclusively borrowed for 'a, and the caller guarantees no overlapping live view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

/// Checks the shapes of an attention call; returns `(qkv width, H/KVH)`.
fn check(
    what: &str,
    dims: AttnDims,
    qkv: &[f32],
    out_len: usize,
    lse_len: usize,
) -> (usize, usize) {
    let AttnDims { b, t, h, kvh, d } = dims;
    assert!(kvh > 0 && h % kvh == 0, "{what}: H = {h} must be a multiple of KVH = {kvh}");
    assert_eq!(qkv.len(), b * t * dims.qkv_width(), "{what}: qkv must be (N, QKV)");
    assert_eq!(out_len, b * t * h * d, "{what}: out must be (N, H*D)");
    assert_eq!(lse_len, b * h * t, "{what}: lse must be (B, H, T)");
    (dims.qkv_width(), h / kvh)
}

/// Causal GQA forward. One parallel task per (b, h) pair; for each query position it runs an
/// online softmax over keys `0..=t`, accumulating straight into its output row (no score row,
/// no allocation).
///
/// out: (N, H*D), overwrites.
/// lse: (B, H, T), overwrites: `log sum_j exp(scale q_t.k_j)` over `j <= t`.
/// qkv: (N, QKV), row = `[q (H*D) | k (KVH*D) | v (KVH*D)]`, after rope.
pub fn attention_forward(out: &mut [f32], lse: &mut [f32], qkv: &[f32], dims: AttnDims) {
    let (width, group) = check("attention_forward", dims, qkv, out.len(), lse.len());
    let AttnDims { b, t, h, kvh, d } = dims;
    let scale = 1.0 / (d as f32).sqrt();
    let hd = h * d;
    let out = DisjointMut::new(out);
    let lse = DisjointMut::new(lse);

    (0..b * h).into_par_iter().for_each(|bh| {
        let (bi, hi) = (bh / h, bh % h);
        let g = hi / group;
        for ti in 0..t {
            let row = bi * t + ti;
            let q = &qkv[row * width + hi * d..][..d];
            // SAFETY: task (bi, hi) is the only one writing head hi's columns of batch bi's rows,
            // and only this one view of them is live at a time.
            let o = unsafe { out.slice_mut(row * hd + hi * d, d) };
            o.fill(0.0);
            // Online softmax: m = running max, l = running sum of exp(s - m); o holds
            // sum_j exp(s_j - m) v_j, rescaled whenever m grows.
            let mut m = f32::NEG_INFINITY;
            let mut l = 0.0f32;
            for tj in 0..=ti {
                let kv_row = (bi * t + tj) * width;
                let k = &qkv[kv_row + (h + g) * d..][..d];
                let v = &qkv[kv_row + (h + kvh + g) * d..][..d];
                let s = dot(q, k) * scale;
                if s > m {
                    let c = (m - s).exp();
                    l *= c;
                    o.iter_mut().for_each(|x| *x *= c);
                    m = s;
                }
                let p = (s - m).exp();
                l += p;
                axpy(o, p, v);
            }
            let inv = 1.0 / l;
            o.iter_mut().for_each(|x| *x *= inv);
            // SAFETY: element (bi, hi, ti) of lse belongs to task (bi, hi) alone.
            let lse_i = unsafe { lse.slice_mut((bi * h + hi) * t + ti, 1) };
            lse_i[0] = m + l.ln();
        }
    });
}

// Attention backward, for one query head with query rows q_i, key rows k_j, value rows v_j
// (j <= i), scale = 1/sqrt(D):
//
//   S_ij = scale q_i.k_j,   P_ij = exp(S_ij - lse_i),   out_i = sum_j P_ij v_j
//
//   dL/dv_j  = sum_i P_ij dout_i
//   dP_ij    = dout_i . v_j
//   softmax backward: dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik)
//             and sum_k P_ik dP_ik = dout_i . sum_k P_ik v_k = dout_i . out_i =: dD_i
//   dL/dq_i  = scale sum_j dS_ij k_j
//   dL/dk_j  = scale sum_i dS_ij q_i
//
// With GQA, the query heads of one group share k_j, v_j, so their contributions add up.
// Implemented exactly as, per (b, kv head g), for each query head h of the group (ascending),
// each i (ascending), each j = 0..=i (ascending):
//   P = exp(scale q_i.k_j - lse_i);  dS = P * (dout_i.v_j - dD_i)
//   dq_i += (scale dS) k_j;   dk_j += (scale dS) q_i;   dv_j += P dout_i
// into a dqkv that is zeroed first, so dqkv as a whole is overwritten. One task owns all of
// kv head g's dk, dv and the dq of its query heads, so there are no races and the order of
// accumulation is fixed.

/// Causal GQA backward; see the derivation above.
///
/// dqkv: (N, QKV), overwrites (dq, dk, dv w.r.t. the post-rope q, k and v).
/// dout: (N, H*D).
/// qkv: (N, QKV), as given to the forward.
/// out: (N, H*D), as produced by the forward.
/// lse: (B, H, T), as produced by the forward.
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dims: AttnDims,
) {
    let (width, group) = check("attention_backward", dims, qkv, out.len(), lse.len());
    assert_eq!(dqkv.len(), qkv.len(), "attention_backward: dqkv must be (N, QKV)");
    assert_eq!(dout.len(), out.len(), "attention_backward: dout must be (N, H*D)");
    let AttnDims { b, t, h, kvh, d } = dims;
    let scale = 1.0 / (d as f32).sqrt();
    let hd = h * d;
    dqkv.par_chunks_mut(1 << 14).for_each(|c| c.fill(0.0));
    let dqkv = DisjointMut::new(dqkv);

    (0..b * kvh).into_par_iter().for_each(|bg| {
        let (bi, g) = (bg / kvh, bg % kvh);
        for hi in g * group..(g + 1) * group {
            for ti in 0..t {
                let row = bi * t + ti;
                let q = &qkv[row * width + hi * d..][..d];
                let dy = &dout[row * hd + hi * d..][..d];
                let y = &out[row * hd + hi * d..][..d];
                let lse_i = lse[(bi * h + hi) * t + ti];
                let dd = dot(dy, y);
                // SAFETY: task (bi, g) alone owns the dq columns of query heads in group g for
                // batch bi's rows; dq_i (query head columns) cannot overlap dk_j or dv_j
                // (kv head columns) below.
                let dq = unsafe { dqkv.slice_mut(row * width + hi * d, d) };
                for tj in 0..=ti {
                    let kv_row = (bi * t + tj) * width;
                    let k = &qkv[kv_row + (h + g) * d..][..d];
                    let v = &qkv[kv_row + (h + kvh + g) * d..][..d];
                    let p = (dot(q, k) * scale - lse_i).exp();
                    let ds = p * (dot(dy, v) - dd);
                    axpy(dq, scale * ds, k);
                    // SAFETY: task (bi, g) alone owns kv head g's dk and dv columns of batch
                    // bi's rows; dk_j and dv_j are disjoint from each other and from dq, and
                    // each lives only for this iteration.
                    let dk = unsafe { dqkv.slice_mut(kv_row + (h + g) * d, d) };
                    axpy(dk, scale * ds, q);
                    // SAFETY: as above.
                    let dv = unsafe { dqkv.slice_mut(kv_row + (h + kvh + g) * d, d) };
                    axpy(dv, p, dy);
                }
            }
        }
    });
}
