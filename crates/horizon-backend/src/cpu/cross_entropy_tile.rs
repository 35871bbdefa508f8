//! Cross-entropy over vocabulary tiles on the CPU: an LM head too large for one weight slot is
//! applied a tile of `VT` vocabulary rows at a time, so the softmax's statistics are gathered
//! over the tiles (pass 1), then each tile's dlogits is formed from the complete statistics
//! (pass 2), and the losses from the statistics alone.
//!
//! Data flow: for each tile, logits (N, VT) -> stats (N, 3) `(m, s, t)`;
//!            for each tile, logits (N, VT) + stats -> dlogits (N, VT) in place;
//!            stats -> losses (N).
//!
//! Numerics as the fused op (`cross_entropy.rs`): a tile's exponentials are shifted by the
//! tile's max (every term in (0, 1]) and summed in f64; the running sum is rescaled and combined
//! in f64 and stored as f32. The loss is formed in f64 and rounded once.

use super::cross_entropy::{IGNORE_INDEX, max_and_sumexp, row_loss};
use rayon::prelude::*;

// Online log-sum-exp (Milakov & Gimelshein, "Online normalizer calculation for softmax"), per
// row over tiles T_1..T_n of the vocabulary:
//
//   after tiles 1..k:  m_k = max over T_1..T_k of l_j,   s_k = sum over T_1..T_k of exp(l_j - m_k)
//   tile k+1, with its own max mt = max_{j in T} l_j and st = sum_{j in T} exp(l_j - mt):
//     m_{k+1} = max(m_k, mt)
//     s_{k+1} = s_k exp(m_k - m_{k+1}) + sum_{j in T} exp(l_j - m_{k+1})
//             = s_k exp(m_k - m_{k+1}) + st exp(mt - m_{k+1})
//   one of the two factors is exp(0) = 1 and the other is <= 1, so nothing overflows; when the
//   two maxima are equal (both -inf included) the factor is taken as exactly 1.
//   At the end, lse = log sum_j exp(l_j) = m + ln s, and with t = l_target:
//     loss = lse - t = m + ln s - t
//     d loss / d l_j = exp(l_j - lse) - [j == target] = exp(l_j - m) / s - [j == target]
// Implemented exactly as:
//   stats:  (m, s, t) <- (mt, st, l_target or 0)                               (first tile)
//           (m, s, t) <- (m', s exp(m - m') + st exp(mt - m'), l_target if in the tile)
//   grad:   dlogits[r, j] = scale * (exp(l_j - m) * (1 / s) - [j == target - v0])  (in place)
//           dlogits[r, :] = 0                                                   (ignored rows)
//   loss:   m + ln s - t (f64, rounded once); 0 for ignored rows
// which is the fused op's `scale * (exp(x_j - m) * (1 / s) - [j == k])` when one tile spans V.

/// Values per row of the statistics: running max, running sum of exponentials, target logit.
pub const STATS: usize = 3;

/// The column of a row's target inside the tile `v0..v0 + vt`; `None` when it lies outside or
/// is [`IGNORE_INDEX`]; panics on any other negative target.
#[inline]
fn target_in_tile(target: i32, v0: usize, vt: usize, what: &str) -> Option<usize> {
    if target == IGNORE_INDEX {
        return None;
    }
    let k = usize::try_from(target)
        .unwrap_or_else(|_| panic!("{what}: target {target} is neither >= 0 nor {IGNORE_INDEX}"));
    (v0..v0 + vt).contains(&k).then(|| k - v0)
}

/// `exp(m - m_new)` in f64, exactly 1 when the two are equal (so `-inf` maxima give no NaN).
#[inline]
fn rescale(m: f32, m_new: f32) -> f64 {
    if m == m_new { 1.0 } else { (f64::from(m) - f64::from(m_new)).exp() }
}

/// Pass 1: fold one tile of logits into the per-row statistics; see the derivation above.
///
/// stats: (N, 3) `(m, s, t)`, overwritten from this tile when `first`, else updated.
/// logits: (N, VT), the logits of vocabulary ids `v0..v0 + VT`.
/// targets: (N), each `>= 0` or `-100` (ignored rows are updated like any other).
pub fn cross_entropy_tile_stats(
    stats: &mut [f32],
    logits: &[f32],
    targets: &[i32],
    n: usize,
    vt: usize,
    v0: usize,
    first: bool,
) {
    assert!(vt > 0, "cross_entropy_tile_stats: VT must be positive");
    assert_eq!(stats.len(), n * STATS, "cross_entropy_tile_stats: stats must be (N, 3)");
    assert_eq!(logits.len(), n * vt, "cross_entropy_tile_stats: logits must be (N, VT)");
    assert_eq!(targets.len(), n, "cross_entropy_tile_stats: targets must be (N)");
    stats.par_chunks_mut(STATS).zip(logits.par_chunks(vt)).zip(targets.par_iter()).for_each(
        |((st, x), &target)| {
            let (mt, sum_t) = max_and_sumexp(x);
            let k = target_in_tile(target, v0, vt, "cross_entropy_tile_stats");
            if first {
                st[0] = mt;
                st[1] = sum_t as f32;
                st[2] = k.map_or(0.0, |k| x[k]);
                return;
            }
            let m_new = st[0].max(mt);
            let s = f64::from(st[1]) * rescale(st[0], m_new) + sum_t * rescale(mt, m_new);
            st[0] = m_new;
            st[1] = s as f32;
            if let Some(k) = k {
                st[2] = x[k];
            }
        },
    );
}

/// Pass 2, in place on one tile; see the derivation above.
///
/// logits: (N, VT), the logits of ids `v0..v0 + VT`; overwritten with
///   `dlogits = scale * (exp(l - lse) - onehot(target - v0))`, all zero on ignored rows.
/// stats: (N, 3), complete (every tile folded in).
/// targets: (N), each `>= 0` or `-100`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_tile_grad(
    logits: &mut [f32],
    stats: &[f32],
    targets: &[i32],
    n: usize,
    vt: usize,
    v0: usize,
    scale: f32,
) {
    assert!(vt > 0, "cross_entropy_tile_grad: VT must be positive");
    assert_eq!(stats.len(), n * STATS, "cross_entropy_tile_grad: stats must be (N, 3)");
    assert_eq!(logits.len(), n * vt, "cross_entropy_tile_grad: logits must be (N, VT)");
    assert_eq!(targets.len(), n, "cross_entropy_tile_grad: targets must be (N)");
    logits.par_chunks_mut(vt).zip(stats.par_chunks(STATS)).zip(targets.par_iter()).for_each(
        |((x, st), &target)| {
            if target == IGNORE_INDEX {
                x.fill(0.0);
                return;
            }
            let k = target_in_tile(target, v0, vt, "cross_entropy_tile_grad");
            let (m, inv) = (st[0], (1.0 / f64::from(st[1])) as f32);
            x.iter_mut().for_each(|v| *v -= m);
            super::exp_in_place(x);
            let e_k = k.map(|k| x[k]);
            x.iter_mut().for_each(|e| *e = scale * (*e * inv));
            if let (Some(k), Some(e_k)) = (k, e_k) {
                x[k] = scale * (e_k * inv - 1.0);
            }
        },
    );
}

/// The per-row losses from complete statistics; see the derivation above.
///
/// losses: (N), overwrites: `m + ln s - t`, 0 where the target is -100.
/// stats: (N, 3), complete. targets: (N).
pub fn cross_entropy_tile_loss(losses: &mut [f32], stats: &[f32], targets: &[i32], n: usize) {
    assert_eq!(losses.len(), n, "cross_entropy_tile_loss: losses must be (N)");
    assert_eq!(stats.len(), n * STATS, "cross_entropy_tile_loss: stats must be (N, 3)");
    assert_eq!(targets.len(), n, "cross_entropy_tile_loss: targets must be (N)");
    losses.par_iter_mut().zip(stats.par_chunks(STATS)).zip(targets.par_iter()).for_each(
        |((loss, st), &target)| {
            *loss =
                if target == IGNORE_INDEX { 0.0 } else { row_loss(st[0], f64::from(st[1]), st[2]) };
        },
    );
}
