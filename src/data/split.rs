//! Deterministic shuffling and the held-out evaluation split, both drawn from
//! [`SplitMix64`] so that a run is reproduced by its seed.
//!
//! Intended order: load, [`split_eval`] (so that evaluation holds whole examples), then
//! [`pack`](super::pack::pack) each part if packing, then visit the training rows in
//! [`shuffled_order`] of each epoch.

use crate::rng::SplitMix64;

/// Separates the eval split's random stream from the shuffling streams of every epoch
/// (ASCII "evalsplt").
const SPLIT_STREAM: u64 = 0x6576_616c_7370_6c74;

/// A generator for the stream `(seed, stream)`: every pair gets a distinct, well mixed starting
/// state (splitmix's output function is a bijection, so `stream -> state` is one to one for a
/// fixed `seed`). Plain `seed + stream` would not do: it would give each stream the tail of its
/// neighbour's.
fn generator(seed: u64, stream: u64) -> SplitMix64 {
    let key = SplitMix64::new(seed).next_u64();
    SplitMix64::new(SplitMix64::new(key ^ stream).next_u64())
}

/// A permutation of `0..len` (Fisher-Yates), a function of `(seed, epoch)` only: the order in
/// which epoch `epoch` visits the rows.
pub fn shuffled_order(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    permutation(len, &mut generator(seed, epoch))
}

fn permutation(len: usize, rng: &mut SplitMix64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// `rows` (examples, or their indices) split into `(train, eval)`, each in the original order.
///
/// The eval part is `round(len * eval_fraction)` rows chosen at random from `seed` (a stream of
/// its own, distinct from [`shuffled_order`]'s), at least 1 when `eval_fraction > 0` and there
/// are at least 2 rows, and never all of them. With `eval_fraction <= 0` (or NaN) or fewer than
/// 2 rows, eval is empty.
pub fn split_eval<T>(rows: Vec<T>, eval_fraction: f64, seed: u64) -> (Vec<T>, Vec<T>) {
    let len = rows.len();
    if eval_fraction.is_nan() || eval_fraction <= 0.0 || len < 2 {
        return (rows, Vec::new());
    }
    let n_eval = ((len as f64 * eval_fraction).round() as usize).clamp(1, len - 1);
    let order = permutation(len, &mut generator(seed, SPLIT_STREAM));
    let mut is_eval = vec![false; len];
    for &i in &order[..n_eval] {
        is_eval[i] = true;
    }
    let (mut train, mut eval) = (Vec::with_capacity(len - n_eval), Vec::with_capacity(n_eval));
    for (row, e) in rows.into_iter().zip(is_eval) {
        if e { eval.push(row) } else { train.push(row) }
    }
    (train, eval)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::pretokenized::Row;

    fn rows(n: i32) -> Vec<Row> {
        (0..n).map(|i| Row { input_ids: vec![i, i], labels: vec![i, i] }).collect()
    }

    fn ids(rows: &[Row]) -> Vec<i32> {
        rows.iter().map(|r| r.input_ids[0]).collect()
    }

    #[test]
    fn shuffle_is_a_reproducible_permutation() {
        let a = shuffled_order(100, 42, 0);
        assert_eq!(a, shuffled_order(100, 42, 0));
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(a, (0..100).collect::<Vec<_>>());
        assert_ne!(a, shuffled_order(100, 42, 1));
        assert_ne!(a, shuffled_order(100, 43, 0));
        assert!(shuffled_order(0, 1, 0).is_empty());
        assert_eq!(shuffled_order(1, 1, 0), vec![0]);
    }

    #[test]
    fn shuffle_is_roughly_uniform() {
        // Where element 0 lands, over 4000 epochs of a 4-element shuffle: ~1000 per slot.
        let mut counts = [0; 4];
        for epoch in 0..4000 {
            let order = shuffled_order(4, 9, epoch);
            counts[order.iter().position(|&x| x == 0).unwrap()] += 1;
        }
        assert!(counts.iter().all(|&c| (850..1150).contains(&c)), "{counts:?}");
    }

    #[test]
    fn split_sizes() {
        let size = |n, f| split_eval(rows(n), f, 0).1.len();
        assert_eq!(size(100, 0.1), 10);
        assert_eq!(size(10, 0.01), 1);
        assert_eq!(size(2, 0.01), 1);
        assert_eq!(size(10, 1.0), 9);
        assert_eq!(size(10, 0.0), 0);
        assert_eq!(size(10, -1.0), 0);
        assert_eq!(size(10, f64::NAN), 0);
        assert_eq!(size(1, 0.5), 0);
        assert_eq!(size(0, 0.5), 0);
    }

    #[test]
    fn split_is_deterministic_and_disjoint() {
        let (train, eval) = split_eval(rows(50), 0.2, 5);
        let (train2, eval2) = split_eval(rows(50), 0.2, 5);
        assert_eq!((&train, &eval), (&train2, &eval2));
        let (_, eval3) = split_eval(rows(50), 0.2, 6);
        assert_ne!(eval, eval3);
        let (t, e) = (ids(&train), ids(&eval));
        assert!(t.is_sorted() && e.is_sorted());
        let mut all = [t, e].concat();
        all.sort();
        assert_eq!(all, (0..50).collect::<Vec<_>>());
    }
}
