//! Mixture-of-experts routing, dispatch and scatter-add on the CPU.
//!
//! Data flow of a sparse MLP over N rows, k experts a row, M = N*k (row, choice) pairs:
//! `logits (N,E) -> route -> probs (N,E), sel (N,k), wts (N,k)`; the caller sorts the pairs by
//! expert (a stable counting sort on the host: `order` (M) lists pair indices `r*k + j` expert
//! by expert, `pos` (M) is its inverse); expert by expert, `gather` copies its pairs' input
//! rows, its products run on them, and `scatter_add` adds its outputs back to their rows,
//! weighted (a row chooses an expert at most once: no two adds of one call meet).
//!
//! Expert indices travel in f32 buffers as exact small integers (E < 2^24).
//!
//! Every reduction runs inside one task in a fixed order: results do not depend on the number
//! of threads.

use rayon::prelude::*;

use super::dot;
use crate::MoeDims;

/// The index an f32 buffer holds (an expert, or a pair index).
#[inline]
fn idx(x: f32) -> usize {
    x as usize
}

/// Routing: per row, `probs = softmax(logits)` over the E experts; `sel` the k largest
/// probabilities' experts, largest first (equal probabilities: the lower expert first); `wts`
/// their probabilities, divided by their sum when `dims.norm`.
///
/// probs: (N, E), sel: (N, k), wts: (N, k), all overwrite. logits: (N, E).
pub fn moe_route_forward(
    probs: &mut [f32],
    sel: &mut [f32],
    wts: &mut [f32],
    logits: &[f32],
    dims: MoeDims,
) {
    let MoeDims { n, e, k, norm } = dims;
    assert!(k <= e && k > 0, "moe_route_forward: k must lie in 1..=E");
    assert_eq!(probs.len(), n * e, "moe_route_forward: probs must be (N, E)");
    assert_eq!(logits.len(), n * e, "moe_route_forward: logits must be (N, E)");
    assert_eq!(sel.len(), n * k, "moe_route_forward: sel must be (N, k)");
    assert_eq!(wts.len(), n * k, "moe_route_forward: wts must be (N, k)");
    probs
        .par_chunks_mut(e)
        .zip(logits.par_chunks(e))
        .zip(sel.par_chunks_mut(k).zip(wts.par_chunks_mut(k)))
        .for_each(|((p, l), (s, w))| route_row(p, s, w, l, norm));
}

fn route_row(p: &mut [f32], s: &mut [f32], w: &mut [f32], l: &[f32], norm: bool) {
    let max = l.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut sum = 0.0f32;
    for (p, &x) in p.iter_mut().zip(l) {
        *p = (x - max).exp();
        sum += *p;
    }
    let inv = 1.0 / sum;
    p.iter_mut().for_each(|p| *p *= inv);
    for j in 0..s.len() {
        let mut best: Option<usize> = None;
        for (ex, &pe) in p.iter().enumerate() {
            if s[..j].iter().any(|&c| idx(c) == ex) {
                continue;
            }
            if best.is_none_or(|b| pe > p[b]) {
                best = Some(ex);
            }
        }
        let b = best.expect("k <= E");
        s[j] = b as f32;
        w[j] = p[b];
    }
    if norm {
        let total: f32 = w.iter().sum();
        w.iter_mut().for_each(|x| *x /= total);
    }
}

/// Routing backward: `dlogits` from the weights' gradient `dwts` and, when `aux` is given as
/// `(g (E), mask (N))`, the load-balancing term's `dprobs[r, e] += mask[r] * g[e]`.
/// With `norm`: `w_j = p_j / S`, so `dp_j = (dw_j - sum_i w_i dw_i) / S`; without, `dp_j = dw_j`.
/// Then the softmax backward: `dlogits = p * (dp - sum_e p_e dp_e)`.
///
/// dlogits: (N, E), overwrites. dwts: (N, k). probs: (N, E), sel: (N, k) as the forward left them.
pub fn moe_route_backward(
    dlogits: &mut [f32],
    dwts: &[f32],
    probs: &[f32],
    sel: &[f32],
    aux: Option<(&[f32], &[f32])>,
    dims: MoeDims,
) {
    let MoeDims { n, e, k, norm } = dims;
    assert_eq!(dlogits.len(), n * e, "moe_route_backward: dlogits must be (N, E)");
    assert_eq!(probs.len(), n * e, "moe_route_backward: probs must be (N, E)");
    assert_eq!(dwts.len(), n * k, "moe_route_backward: dwts must be (N, k)");
    assert_eq!(sel.len(), n * k, "moe_route_backward: sel must be (N, k)");
    if let Some((g, mask)) = aux {
        assert_eq!(g.len(), e, "moe_route_backward: the aux gradient must be (E)");
        assert_eq!(mask.len(), n, "moe_route_backward: mask must be (N)");
    }
    dlogits.par_chunks_mut(e).enumerate().for_each(|(r, dl)| {
        let (p, s, dw) = (&probs[r * e..(r + 1) * e], &sel[r * k..(r + 1) * k], &dwts[r * k..]);
        // dl holds dprobs first.
        match aux {
            Some((g, mask)) => dl.iter_mut().zip(g).for_each(|(d, &g)| *d = mask[r] * g),
            None => dl.fill(0.0),
        }
        let total: f32 = s.iter().map(|&c| p[idx(c)]).sum();
        let wdw: f32 = (0..k).map(|j| p[idx(s[j])] / total * dw[j]).sum();
        for j in 0..k {
            let d = if norm { (dw[j] - wdw) / total } else { dw[j] };
            dl[idx(s[j])] += d;
        }
        let dot: f32 = p.iter().zip(dl.iter()).map(|(p, d)| p * d).sum();
        dl.iter_mut().zip(p).for_each(|(d, &p)| *d = p * (*d - dot));
    });
}

/// The load-balancing statistics, pooled: `stats[e] += sum_r mask[r] [e in sel[r]]` and
/// `stats[E + e] += sum_r mask[r] probs[r, e]`, rows summed in order.
///
/// stats: (2E), accumulates. probs: (N, E). sel: (N, k). mask: (N), 1 on real rows, 0 on padding.
pub fn moe_aux_stats(stats: &mut [f32], probs: &[f32], sel: &[f32], mask: &[f32], dims: MoeDims) {
    let MoeDims { n, e, k, .. } = dims;
    assert_eq!(stats.len(), 2 * e, "moe_aux_stats: stats must be (2E)");
    assert_eq!(probs.len(), n * e, "moe_aux_stats: probs must be (N, E)");
    assert_eq!(sel.len(), n * k, "moe_aux_stats: sel must be (N, k)");
    assert_eq!(mask.len(), n, "moe_aux_stats: mask must be (N)");
    let (counts, psum) = stats.split_at_mut(e);
    counts.par_iter_mut().zip(psum.par_iter_mut()).enumerate().for_each(|(ex, (c, ps))| {
        let (mut cnt, mut sum) = (0.0f32, 0.0f32);
        for r in 0..n {
            if sel[r * k..(r + 1) * k].iter().any(|&s| idx(s) == ex) {
                cnt += mask[r];
            }
            sum += mask[r] * probs[r * e + ex];
        }
        *c += cnt;
        *ps += sum;
    });
}

/// Pairs into expert order: `xs[i] = x[order[i] / k]`, rows of C.
///
/// xs: (M, C), overwrites. x: (N, C). order: (M) pair indices.
pub fn moe_gather(xs: &mut [f32], x: &[f32], order: &[f32], k: usize, c: usize) {
    assert_eq!(xs.len(), order.len() * c, "moe_gather: xs must be (M, C)");
    if c == 0 {
        return;
    }
    xs.par_chunks_mut(c).zip(order.par_iter()).for_each(|(row, &o)| {
        let r = idx(o) / k;
        row.copy_from_slice(&x[r * c..(r + 1) * c]);
    });
}

/// One expert's rows added back: `out[order[i] / k] += w * src[i]`, `w = wts[order[i]]` (1
/// without `wts`). `order`'s pairs name distinct rows (an expert's segment), so the order of
/// the adds within a call does not matter; across calls (experts) it is the callers'.
///
/// out: (N, C), accumulates. src: (S, C). order: (S). wts: (M) in pair order.
pub fn moe_scatter_add(
    out: &mut [f32],
    src: &[f32],
    order: &[f32],
    wts: Option<&[f32]>,
    k: usize,
    c: usize,
) {
    assert_eq!(src.len(), order.len() * c, "moe_scatter_add: src must be (S, C)");
    for (row, &o) in src.chunks_exact(c.max(1)).zip(order) {
        let p = idx(o);
        let w = wts.map_or(1.0, |w| w[p]);
        let r = p / k;
        for (x, &s) in out[r * c..(r + 1) * c].iter_mut().zip(row) {
            *x += w * s;
        }
    }
}

/// Rows scaled by their pair's weight, in place: `buf[i] *= wts[order[i]]`, rows of W.
///
/// buf: (M, W). wts: (M) in pair order. order: (M).
pub fn moe_scale_rows(buf: &mut [f32], wts: &[f32], order: &[f32], w: usize) {
    assert_eq!(buf.len(), order.len() * w, "moe_scale_rows: buf must be (M, W)");
    if w == 0 {
        return;
    }
    buf.par_chunks_mut(w).zip(order.par_iter()).for_each(|(row, &o)| {
        let s = wts[idx(o)];
        row.iter_mut().for_each(|x| *x *= s);
    });
}

/// Row dot products into pair order: `out[order[i]] = a[i] . b[i]`, rows of W (the routing
/// weights' gradient of one expert's pairs).
///
/// out: (M), the entries `order` names overwritten. a, b: (S, W). order: (S).
pub fn moe_row_dots(out: &mut [f32], a: &[f32], b: &[f32], order: &[f32], w: usize) {
    let s = order.len();
    assert!(a.len() == s * w && b.len() == s * w, "moe_row_dots: a and b must be (S, W)");
    for (i, &o) in order.iter().enumerate() {
        let (x, y) = (&a[i * w..(i + 1) * w], &b[i * w..(i + 1) * w]);
        out[idx(o)] = x.iter().zip(y).map(|(x, y)| x * y).sum();
    }
}

/// An expert's down-projection bias dotted with its pairs' output gradient, added into pair
/// order: `out[order[i]] += dy[i] . bias`, rows of C (the bias's share of the routing weights'
/// gradient, gpt-oss). `order`'s pairs are distinct (an expert's segment).
///
/// out: (M), the entries `order` names accumulate (+=). dy: (S, C). bias: (C). order: (S).
pub fn moe_bias_dots(out: &mut [f32], dy: &[f32], bias: &[f32], order: &[f32], c: usize) {
    assert_eq!(dy.len(), order.len() * c, "moe_bias_dots: dy must be (S, C)");
    assert_eq!(bias.len(), c, "moe_bias_dots: bias must be (C)");
    for (i, &o) in order.iter().enumerate() {
        out[idx(o)] += dot(&dy[i * c..(i + 1) * c], bias);
    }
}

/// The host side of dispatch: a stable counting sort of the (row, choice) pairs by expert.
/// `counts[e]` pairs chose expert e; `order` (M) lists pair indices expert by expert, each
/// expert's in pair order; `pos` (M) is its inverse (where pair p sits in `order`). Reuses the
/// buffers' capacity.
pub fn moe_sort(
    sel: &[f32],
    e: usize,
    counts: &mut Vec<usize>,
    order: &mut Vec<f32>,
    pos: &mut Vec<f32>,
) {
    counts.clear();
    counts.resize(e + 1, 0);
    for &s in sel {
        counts[idx(s) + 1] += 1;
    }
    for i in 0..e {
        counts[i + 1] += counts[i];
    }
    // counts[i] is expert i's first place now: fill, advancing it to the place after its last.
    order.clear();
    order.resize(sel.len(), 0.0);
    pos.clear();
    pos.resize(sel.len(), 0.0);
    for (p, &s) in sel.iter().enumerate() {
        let at = &mut counts[idx(s)];
        order[*at] = p as f32;
        pos[p] = *at as f32;
        *at += 1;
    }
    // Ends to sizes.
    for i in (1..e).rev() {
        counts[i] -= counts[i - 1];
    }
    counts.truncate(e);
}
