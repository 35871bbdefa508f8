//! Causal grouped-query attention on the CPU, optionally within a sliding window, in tiles: one
//! parallel task per head, and inside it one block of [`QB`] query rows at a time, whose scores
//! against the keys the block can see are one matrix product into a per-thread (QB x T)
//! scratch. No (T, T) matrix is ever stored; the forward saves only the log-sum-exp of each
//! score row, and the backward recomputes the probabilities from q, k and that lse. Every
//! product goes through the packed GEMM on the task's own thread ([`gemm_serial`]), so results
//! do not depend on the number of threads.
//!
//! Data flow: qkv (N, QKV) after rope -> scores s_ij = scale q_i.k_j (i - W < j <= i)
//!   -> softmax -> out (N, H*D), lse (B, H, T).
//!
//! Query head `h` reads kv head `h / (H/KVH)`; `scale = dims.scale`. With a window `W > 0`
//! query `i` sees keys `j` with `i - W < j <= i`; `W = 0` (or `W >= T`) is full causal
//! attention. A block of query rows `i0..=i1` touches only keys `max(0, i0 - W + 1)..=i1`
//! ([`key_range`]): key ranges wholly outside the window are never multiplied, and the partial
//! edges of the block (past the diagonal, before a row's window) are masked to probability 0.

use std::cell::RefCell;
use std::marker::PhantomData;

use rayon::prelude::*;

use super::matmul::{View, gemm_serial, with_scratch};
use super::{dot, exp_in_place};
use crate::AttnDims;

/// Query rows per block: the scores of one block are a (QB, keys) matrix in scratch.
const QB: usize = 64;

thread_local! {
    /// Each worker's attention scratch (score block, probabilities, small outputs, dk and dv
    /// sums), grown to the largest shape once and then reused.
    pub(super) static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A mutable buffer shared by parallel tasks that each write a disjoint set of elements.
/// Rayon's safe splitting cannot express "columns of head h of every row of batch b", which is
/// what one attention task owns, so tasks carve their views out of this with `slice_mut`.
pub(super) struct DisjointMut<'a> {
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
    pub(super) fn new(buf: &'a mut [f32]) -> Self {
        DisjointMut { ptr: buf.as_mut_ptr(), len: buf.len(), _borrow: PhantomData }
    }

    /// The elements `off..off + len`, bounds-checked.
    ///
    /// # Safety
    /// While the returned slice lives, no other slice obtained from this `DisjointMut` (in this
    /// or any other thread) may overlap `off..off + len`.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [f32] {
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
    let AttnDims { b, t, h, kvh, d, .. } = dims;
    assert!(kvh > 0 && h % kvh == 0, "{what}: H = {h} must be a multiple of KVH = {kvh}");
    assert!(dims.scale.is_finite(), "{what}: scale = {} must be finite", dims.scale);
    assert_eq!(qkv.len(), b * t * dims.qkv_width(), "{what}: qkv must be (N, QKV)");
    assert_eq!(out_len, b * t * h * d, "{what}: out must be (N, H*D)");
    assert_eq!(lse_len, b * h * t, "{what}: lse must be (B, H, T)");
    (dims.qkv_width(), h / kvh)
}

/// The keys a block of query rows `i0..i0 + rows` sees under `window` (0 = none): `k0..k1`,
/// with `k0 = max(0, i0 - W + 1)` and `k1 = i0 + rows` (one past its last row). With `W >= T`
/// every `k0` is 0: the very products of full causal attention, so the same bits.
fn key_range(i0: usize, rows: usize, window: usize) -> (usize, usize) {
    let k0 = if window == 0 { 0 } else { (i0 + 1).saturating_sub(window) };
    (k0, i0 + rows)
}

/// The keys query row `i` sees, relative to a block's first key `k0`: `lo..end` (the rest of the
/// block's score row is masked).
fn live_range(i: usize, k0: usize, window: usize) -> (usize, usize) {
    let lo = if window == 0 { 0 } else { (i + 1).saturating_sub(window) };
    (lo.max(k0) - k0, i + 1 - k0)
}

/// `S (rows, keys) = Q_blk . K^T` for query rows `r0..r0 + rows` of head `hi` and keys
/// `k0..k0 + keys` (absolute rows of qkv), into `s` with row stride `keys`.
#[allow(clippy::too_many_arguments)]
pub(super) fn scores(
    s: &mut [f32],
    qkv: &[f32],
    width: usize,
    d: usize,
    q_col: usize,
    k_col: usize,
    r0: usize,
    rows: usize,
    k0: usize,
    keys: usize,
) {
    // A = Q rows (rows, d); B (d, keys): B[c, j] = K[j, c].
    let a = View { data: &qkv[r0 * width + q_col..], rs: width, cs: 1 };
    let b = View { data: &qkv[k0 * width + k_col..], rs: 1, cs: width };
    gemm_serial(s, keys, a, b, rows, keys, d, false);
}

/// Causal (windowed) GQA forward. One parallel task per (b, h) pair; per block of [`QB`] query
/// rows: scores against the block's keys ([`key_range`]) by one product, a row softmax (masked
/// past the diagonal and before the row's window) into probabilities, then `out = P . V` by
/// another.
///
/// out: (N, H*D), overwrites.
/// lse: (B, H, T), overwrites: `log sum_j exp(scale q_t.k_j)` over `t - W < j <= t`
/// (`j <= t` when `W = 0`).
/// qkv: (N, QKV), row = `[q (H*D) | k (KVH*D) | v (KVH*D)]`, after rope.
pub fn attention_forward(out: &mut [f32], lse: &mut [f32], qkv: &[f32], dims: AttnDims) {
    let (width, group) = check("attention_forward", dims, qkv, out.len(), lse.len());
    let AttnDims { b, t, h, kvh, d, window, scale } = dims;
    let hd = h * d;
    let qb = QB.min(t);
    let out = DisjointMut::new(out);
    let lse = DisjointMut::new(lse);

    (0..b * h).into_par_iter().for_each(|bh| {
        let (bi, hi) = (bh / h, bh % h);
        let g = hi / group;
        let (q_col, k_col, v_col) = (hi * d, (h + g) * d, (h + kvh + g) * d);
        with_scratch(&SCRATCH, qb * t + qb * d, |scratch| {
            let (p, o) = scratch.split_at_mut(qb * t);
            for i0 in (0..t).step_by(qb) {
                let rows = qb.min(t - i0);
                let (k0, k1) = key_range(i0, rows, window);
                let keys = k1 - k0;
                let r0 = bi * t + i0;
                let p = &mut p[..rows * keys];
                scores(p, qkv, width, d, q_col, k_col, r0, rows, bi * t + k0, keys);
                for (r, row) in p.chunks_exact_mut(keys).enumerate() {
                    let (lo, end) = live_range(i0 + r, k0, window);
                    let (before, rest) = row.split_at_mut(lo);
                    let (live, after) = rest.split_at_mut(end - lo);
                    let mut m = f32::NEG_INFINITY;
                    for x in live.iter_mut() {
                        *x *= scale;
                        m = m.max(*x);
                    }
                    live.iter_mut().for_each(|x| *x -= m);
                    exp_in_place(live);
                    let l: f32 = sum(live);
                    let inv = 1.0 / l;
                    live.iter_mut().for_each(|x| *x *= inv);
                    before.fill(0.0);
                    after.fill(0.0);
                    // SAFETY: element (bi, hi, i0 + r) of lse belongs to task (bi, hi) alone.
                    let lse_i = unsafe { lse.slice_mut((bi * h + hi) * t + i0 + r, 1) };
                    lse_i[0] = m + l.ln();
                }
                // O (rows, d) = P (rows, keys) . V (keys, d).
                let o = &mut o[..rows * d];
                let a = View { data: p, rs: keys, cs: 1 };
                let v = View { data: &qkv[(bi * t + k0) * width + v_col..], rs: width, cs: 1 };
                gemm_serial(o, d, a, v, rows, d, keys, false);
                for (r, o_r) in o.chunks_exact(d).enumerate() {
                    // SAFETY: task (bi, hi) is the only one writing head hi's columns of batch
                    // bi's rows, and only this one view of them is live at a time.
                    let dst = unsafe { out.slice_mut((r0 + r) * hd + hi * d, d) };
                    dst.copy_from_slice(o_r);
                }
            }
        });
    });
}

/// The sum of `x` in 8 lanes combined in a fixed tree (the order depends on the length only).
pub(super) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    chunks.remainder().iter().fold(super::reduce8(acc), |s, v| s + v)
}

// Attention backward, for one query head with query rows q_i, key rows k_j, value rows v_j
// (j visible from i: i - W < j <= i, or j <= i when W = 0), scale = dims.scale:
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
// Implemented as, per (b, kv head g), for each query head h of the group (ascending), each
// block of QB query rows (ascending), with the block's keys k0..k1 (key_range: k1 = the block's
// last row + 1, k0 = max(0, first row - W + 1); keys = k1 - k0):
//   P  = exp(scale Q_blk K^T - lse) (zero where j is not visible from i)   (QB, keys)
//   G  = scale P * (dO_blk V^T - dD)                               (QB, keys)
//   dQ_blk  = G K            (overwrites; each query row is in one block)
//   dK[k0..k1] += G^T Q_blk  dV[k0..k1] += P^T dO_blk   (task-local sums over heads, blocks)
// and dk, dv are written once at the end. One task owns all of kv head g's dk, dv and the dq
// of its query heads, so there are no races and the order of accumulation is fixed.

/// Causal (windowed) GQA backward; see the derivation above.
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
    let AttnDims { b, t, h, kvh, d, window, scale } = dims;
    let hd = h * d;
    let qb = QB.min(t);
    dqkv.par_chunks_mut(1 << 14).for_each(|c| c.fill(0.0));
    let dqkv = DisjointMut::new(dqkv);

    (0..b * kvh).into_par_iter().for_each(|bg| {
        let (bi, g) = (bg / kvh, bg % kvh);
        let (k_col, v_col) = ((h + g) * d, (h + kvh + g) * d);
        let kv0 = bi * t;
        let len = 2 * qb * t + qb * d + 2 * t * d;
        with_scratch(&SCRATCH, len, |scratch| {
            let (p, rest) = scratch.split_at_mut(qb * t);
            let (gs, rest) = rest.split_at_mut(qb * t);
            let (dq, rest) = rest.split_at_mut(qb * d);
            let (dk, dv) = rest.split_at_mut(t * d);
            dk.fill(0.0);
            dv.fill(0.0);
            for hi in g * group..(g + 1) * group {
                let q_col = hi * d;
                for i0 in (0..t).step_by(qb) {
                    let rows = qb.min(t - i0);
                    let (k0, k1) = key_range(i0, rows, window);
                    let keys = k1 - k0;
                    let r0 = bi * t + i0;
                    let p = &mut p[..rows * keys];
                    let gs = &mut gs[..rows * keys];
                    scores(p, qkv, width, d, q_col, k_col, r0, rows, kv0 + k0, keys);
                    // dP (rows, keys) = dO_blk (rows, d) . V^T (d, keys).
                    let a = View { data: &dout[r0 * hd + q_col..], rs: hd, cs: 1 };
                    let vt = View { data: &qkv[(kv0 + k0) * width + v_col..], rs: 1, cs: width };
                    gemm_serial(gs, keys, a, vt, rows, keys, d, false);
                    for (r, (p_r, g_r)) in
                        p.chunks_exact_mut(keys).zip(gs.chunks_exact_mut(keys)).enumerate()
                    {
                        let row = r0 + r;
                        let lse_i = lse[(bi * h + hi) * t + i0 + r];
                        let dd = dot(&dout[row * hd + q_col..][..d], &out[row * hd + q_col..][..d]);
                        let (lo, end) = live_range(i0 + r, k0, window);
                        let (p_before, p_rest) = p_r.split_at_mut(lo);
                        let (p_live, p_after) = p_rest.split_at_mut(end - lo);
                        p_live.iter_mut().for_each(|x| *x = *x * scale - lse_i);
                        exp_in_place(p_live);
                        p_before.fill(0.0);
                        p_after.fill(0.0);
                        for (gv, pv) in g_r.iter_mut().zip(p_r.iter()) {
                            *gv = scale * (pv * (*gv - dd));
                        }
                    }
                    // dQ_blk (rows, d) = G (rows, keys) . K (keys, d).
                    let dq = &mut dq[..rows * d];
                    let ga = View { data: gs, rs: keys, cs: 1 };
                    let kb = View { data: &qkv[(kv0 + k0) * width + k_col..], rs: width, cs: 1 };
                    gemm_serial(dq, d, ga, kb, rows, d, keys, false);
                    for (r, dq_r) in dq.chunks_exact(d).enumerate() {
                        // SAFETY: task (bi, g) alone owns the dq columns of the query heads in
                        // group g for batch bi's rows; only this one view is live.
                        let dst = unsafe { dqkv.slice_mut((r0 + r) * width + q_col, d) };
                        dst.copy_from_slice(dq_r);
                    }
                    // dK (keys, d) += G^T (keys, rows) . Q_blk (rows, d).
                    let gt = View { data: gs, rs: 1, cs: keys };
                    let qa = View { data: &qkv[r0 * width + q_col..], rs: width, cs: 1 };
                    gemm_serial(&mut dk[k0 * d..k1 * d], d, gt, qa, keys, d, rows, true);
                    // dV (keys, d) += P^T (keys, rows) . dO_blk (rows, d).
                    let pt = View { data: p, rs: 1, cs: keys };
                    let doa = View { data: &dout[r0 * hd + q_col..], rs: hd, cs: 1 };
                    gemm_serial(&mut dv[k0 * d..k1 * d], d, pt, doa, keys, d, rows, true);
                }
            }
            for j in 0..t {
                let row = kv0 + j;
                // SAFETY: task (bi, g) alone owns kv head g's dk and dv columns of batch bi's
                // rows; the two views are disjoint and each lives only for its copy.
                unsafe { dqkv.slice_mut(row * width + k_col, d) }
                    .copy_from_slice(&dk[j * d..][..d]);
                // SAFETY: as above.
                unsafe { dqkv.slice_mut(row * width + v_col, d) }
                    .copy_from_slice(&dv[j * d..][..d]);
            }
        });
    });
}
