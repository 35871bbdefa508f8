//! Cross-entropy over the vocabulary on the CPU: per-row losses for evaluation, and the fused
//! forward + backward that turns a chunk of logits into dlogits in place.
//!
//! Data flow: logits (N, V) -> max, log-sum-exp per row -> losses (N) [-> dlogits (N, V)].
//!
//! Numerics: each row subtracts its max before exponentiating (so every term is in (0, 1]), and
//! the sum of the V exponentials is accumulated in f64, so the log-sum-exp is accurate to f32
//! rounding even for V in the hundreds of thousands; the loss `lse - logit[target]` is formed in
//! f64 and rounded once.

use rayon::prelude::*;

/// The target value that marks a position without a loss (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i32 = -100;

/// Returns the target class of a row, `None` for [`IGNORE_INDEX`]; panics on anything else
/// outside `0..v`.
#[inline]
pub(super) fn target_of(target: i32, v: usize, what: &str) -> Option<usize> {
    if target == IGNORE_INDEX {
        return None;
    }
    match usize::try_from(target) {
        Ok(k) if k < v => Some(k),
        _ => panic!("{what}: target {target} is neither in 0..{v} nor {IGNORE_INDEX}"),
    }
}

/// The max of a row, 8 lanes at a time (NaN-ignoring like `f32::max`).
#[inline]
pub(super) fn row_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    chunks
        .remainder()
        .iter()
        .fold(acc.into_iter().fold(f32::NEG_INFINITY, f32::max), |a, &v| a.max(v))
}

/// `x[j] = exp(x[j] - m)` in place, returning `sum_j x[j]` accumulated in f64 in 8 lanes
/// combined in a fixed tree, then the tail: the order depends on the length only.
#[inline]
pub(super) fn exp_shifted_sum(x: &mut [f32], m: f32) -> f64 {
    x.iter_mut().for_each(|v| *v -= m);
    super::exp_in_place(x);
    let mut acc = [0.0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v);
        }
    }
    let s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    chunks.remainder().iter().fold(s, |s, &v| s + f64::from(v))
}

thread_local! {
    /// One row of exponentials for [`cross_entropy_forward`], which must not write its logits.
    static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Max of a row and `sum_j exp(x_j - max)` accumulated in f64, as [`exp_shifted_sum`] forms it
/// (so the forward and the fused pass give the same losses), through a per-thread row buffer.
#[inline]
pub(super) fn max_and_sumexp(x: &[f32]) -> (f32, f64) {
    let m = row_max(x);
    let s = super::matmul::with_scratch(&ROW, x.len(), |row| {
        row.copy_from_slice(x);
        exp_shifted_sum(row, m)
    });
    (m, s)
}

/// The loss of one row: `log sum_j exp(x_j) - x[target] = m + ln(s) - x[target]`.
#[inline]
pub(super) fn row_loss(m: f32, s: f64, x_target: f32) -> f32 {
    (f64::from(m) + s.ln() - f64::from(x_target)) as f32
}

/// Cross-entropy forward only: `losses[r] = -log softmax(logits[r])[targets[r]]`, rows in
/// parallel.
///
/// losses: (N), overwrites; 0 where `targets[r] == -100`.
/// logits: (N, V).
/// targets: (N), each in `0..V` or `-100`.
pub fn cross_entropy_forward(
    losses: &mut [f32],
    logits: &[f32],
    targets: &[i32],
    n: usize,
    v: usize,
) {
    assert!(v > 0, "cross_entropy_forward: V must be positive");
    assert_eq!(losses.len(), n, "cross_entropy_forward: losses must be (N)");
    assert_eq!(logits.len(), n * v, "cross_entropy_forward: logits must be (N, V)");
    assert_eq!(targets.len(), n, "cross_entropy_forward: targets must be (N)");
    losses.par_iter_mut().zip(logits.par_chunks(v)).zip(targets.par_iter()).for_each(
        |((loss, x), &target)| {
            *loss = match target_of(target, v, "cross_entropy_forward") {
                None => 0.0,
                Some(k) => {
                    let (m, s) = max_and_sumexp(x);
                    row_loss(m, s, x[k])
                }
            };
        },
    );
}

// Cross-entropy backward, per row x with target k and p = softmax(x):
//
//   loss = log sum_j exp(x_j) - x_k
//   d loss / d x_j = exp(x_j) / sum exp(x) - [j == k] = p_j - [j == k]
//
// The total loss is `scale * sum_r loss_r` (scale = 1 / number of loss-carrying positions), so
// each row's gradient is scaled by `scale`; ignored rows carry no loss and get zero gradient.
// Implemented exactly as:
//   dlogits[r, j] = scale * (exp(x_j - m) * (1 / s) - [j == k])    (overwrites logits in place;
//                   the exponentials are formed once, in place, and summed)
//   dlogits[r, :] = 0                                              (ignored rows)
// with m = max_j x_j and s = sum_j exp(x_j - m) (f64 sum, rounded to f32 once).

/// Fused cross-entropy forward and backward, in place on one chunk of rows; see the derivation
/// above.
///
/// logits: (N, V); overwritten in place with
///   `dlogits = scale * (softmax(logits) - onehot(target))`, all zero on ignored rows.
/// losses: (N), overwrites, as in [`cross_entropy_forward`].
/// targets: (N), each in `0..V` or `-100`.
pub fn cross_entropy_fused(
    logits: &mut [f32],
    losses: &mut [f32],
    targets: &[i32],
    n: usize,
    v: usize,
    scale: f32,
) {
    assert!(v > 0, "cross_entropy_fused: V must be positive");
    assert_eq!(losses.len(), n, "cross_entropy_fused: losses must be (N)");
    assert_eq!(logits.len(), n * v, "cross_entropy_fused: logits must be (N, V)");
    assert_eq!(targets.len(), n, "cross_entropy_fused: targets must be (N)");
    logits.par_chunks_mut(v).zip(losses.par_iter_mut()).zip(targets.par_iter()).for_each(
        |((x, loss), &target)| {
            let Some(k) = target_of(target, v, "cross_entropy_fused") else {
                *loss = 0.0;
                x.fill(0.0);
                return;
            };
            let m = row_max(x);
            let x_k = x[k];
            let s = exp_shifted_sum(x, m);
            *loss = row_loss(m, s, x_k);
            let inv = (1.0 / s) as f32;
            let e_k = x[k];
            x.iter_mut().for_each(|e| *e = scale * (*e * inv));
            x[k] = scale * (e_k * inv - 1.0);
        },
    );
}
