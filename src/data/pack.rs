//! Packing: whole examples concatenated into rows of at most `max_seq_len` tokens, so that short
//! examples do not waste a row each.
//!
//! Greedy first-fit in order: each example, in order, goes to the first row that still has room
//! for it, else starts a new row; inside a row the examples keep their order. Examples are never
//! split.
//!
//! The loss does not cross example boundaries: labels are not shifted (the loss at position `t`
//! predicts `labels[t + 1]`), so setting the label of every example's first token to -100 means
//! no example's first token is predicted from the end of the previous one. Attention, however,
//! does cross them: a packed row is one causal sequence (no block-diagonal mask, no position-id
//! reset), so the tokens of an example attend to the examples before it in the row, as in most
//! trainers' naive packing.

use super::pretokenized::{IGNORE_INDEX, Row};

/// `rows` packed into rows of at most `max_seq_len` tokens (see the module doc); every token is
/// kept, in rows ordered by their first example. Empty rows are dropped.
///
/// Panics if `max_seq_len == 0`, a row is longer than `max_seq_len`, or a row's `input_ids` and
/// `labels` differ in length (caller bugs: every loader cuts its rows to `max_seq_len`).
pub fn pack(rows: Vec<Row>, max_seq_len: usize) -> Vec<Row> {
    assert!(max_seq_len > 0, "max_seq_len must be positive");
    for (i, r) in rows.iter().enumerate() {
        assert!(
            r.input_ids.len() <= max_seq_len,
            "row {i} has {} tokens, more than max_seq_len = {max_seq_len}",
            r.input_ids.len()
        );
        assert_eq!(r.input_ids.len(), r.labels.len(), "row {i}: input_ids and labels differ");
    }
    let lens: Vec<usize> = rows.iter().map(|r| r.input_ids.len()).collect();
    let bins = Bins::of(&lens, max_seq_len);
    let mut rows: Vec<Option<Row>> = rows.into_iter().map(Some).collect();
    (0..bins.len())
        .map(|b| {
            let mut packed = Row { input_ids: Vec::new(), labels: Vec::new() };
            for &i in bins.members(b) {
                let Row { input_ids, mut labels } =
                    rows[i as usize].take().expect("each row packed once");
                labels[0] = IGNORE_INDEX;
                packed.input_ids.extend(input_ids);
                packed.labels.extend(labels);
            }
            packed
        })
        .collect()
}

/// Examples packed per window of this many: the packer's working memory is that of one window.
pub const PACK_WINDOW: usize = 1 << 16;

/// Packed rows as lists of example indices (compressed: bin `b` holds
/// `members[starts[b]..starts[b + 1]]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bins {
    pub members: Vec<u32>,
    pub starts: Vec<u32>,
}

impl Bins {
    /// The examples of lengths `lens` (each `<= cap`) first-fit packed in windows of
    /// [`PACK_WINDOW`] (see the module doc); examples of length 0 are left out.
    pub fn of(lens: &[usize], cap: usize) -> Bins {
        Bins::windowed(lens, cap, PACK_WINDOW)
    }

    fn windowed(lens: &[usize], cap: usize, window: usize) -> Bins {
        let mut bins = Bins { members: Vec::new(), starts: vec![0] };
        for (w, chunk) in lens.chunks(window.max(1)).enumerate() {
            for bin in first_fit(chunk, cap) {
                bins.members.extend(bin.iter().map(|&i| (w * window + i) as u32));
                bins.starts.push(bins.members.len() as u32);
            }
        }
        bins
    }

    /// One bin per example, in order (no packing).
    pub fn singletons(n: usize) -> Bins {
        Bins { members: (0..n as u32).collect(), starts: (0..=n as u32).collect() }
    }

    /// Number of bins.
    pub fn len(&self) -> usize {
        self.starts.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The examples of bin `b`, in order.
    pub fn members(&self, b: usize) -> &[u32] {
        &self.members[self.starts[b] as usize..self.starts[b + 1] as usize]
    }
}

/// First-fit bin packing of items of sizes `lens` (each `<= cap`) in order: the items (indices)
/// of each bin, bins in the order they were opened; items of size 0 are left out.
///
/// There are at most `lens.len()` bins, all of capacity `cap` at the start, so the first bin with
/// room for an item is the leftmost of those `n` with enough capacity left, and unopened bins sit
/// to the right of opened ones. A max-tree over the remaining capacities finds it in
/// `O(log n)`.
fn first_fit(lens: &[usize], cap: usize) -> Vec<Vec<usize>> {
    let n = lens.len().max(1);
    let size = n.next_power_of_two();
    // tree[1] is the root, tree[size + b] the capacity left in bin b.
    let mut tree = vec![0; 2 * size];
    tree[size..size + n].fill(cap);
    for i in (1..size).rev() {
        tree[i] = tree[2 * i].max(tree[2 * i + 1]);
    }
    let mut bins: Vec<Vec<usize>> = Vec::new();
    for (item, &len) in lens.iter().enumerate() {
        if len == 0 {
            continue;
        }
        debug_assert!(tree[1] >= len);
        let mut node = 1;
        while node < size {
            node = if tree[2 * node] >= len { 2 * node } else { 2 * node + 1 };
        }
        let bin = node - size;
        tree[node] -= len;
        while node > 1 {
            node /= 2;
            tree[node] = tree[2 * node].max(tree[2 * node + 1]);
        }
        if bin == bins.len() {
            bins.push(Vec::new());
        }
        bins[bin].push(item);
    }
    bins
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of `len` tokens with ids `base, base+1, ...`; every token carries loss.
    fn row(base: i32, len: usize) -> Row {
        let ids: Vec<i32> = (base..base + len as i32).collect();
        Row { input_ids: ids.clone(), labels: ids }
    }

    /// The plain quadratic first-fit, as the reference.
    fn first_fit_reference(lens: &[usize], cap: usize) -> Vec<Vec<usize>> {
        let mut bins: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, &len) in lens.iter().enumerate().filter(|(_, l)| **l > 0) {
            match bins.iter_mut().find(|(used, _)| used + len <= cap) {
                Some((used, items)) => {
                    *used += len;
                    items.push(i);
                }
                None => bins.push((len, vec![i])),
            }
        }
        bins.into_iter().map(|(_, items)| items).collect()
    }

    #[test]
    fn first_fit_matches_reference() {
        let mut rng = crate::rng::SplitMix64::new(7);
        for trial in 0..200 {
            let cap = 1 + rng.below(20) as usize;
            let n = rng.below(40) as usize;
            let lens: Vec<usize> = (0..n).map(|_| rng.below(cap as u64 + 1) as usize).collect();
            assert_eq!(first_fit(&lens, cap), first_fit_reference(&lens, cap), "trial {trial}");
        }
    }

    #[test]
    fn packs_first_fit_and_masks_boundaries() {
        let rows = vec![row(10, 3), row(20, 4), row(30, 2), row(40, 1), row(50, 5)];
        let packed = pack(rows, 6);
        // Bins: [3+2+1], [4], [5].
        let ids: Vec<Vec<i32>> = packed.iter().map(|r| r.input_ids.clone()).collect();
        assert_eq!(
            ids,
            vec![vec![10, 11, 12, 30, 31, 40], vec![20, 21, 22, 23], vec![50, 51, 52, 53, 54]]
        );
        assert_eq!(packed[0].labels, vec![-100, 11, 12, -100, 31, -100]);
        assert_eq!(packed[1].labels, vec![-100, 21, 22, 23]);
        assert_eq!(packed[2].labels, vec![-100, 51, 52, 53, 54]);
    }

    #[test]
    fn keeps_masked_labels() {
        let rows = vec![
            Row { input_ids: vec![1, 2, 3], labels: vec![-100, -100, 3] },
            Row { input_ids: vec![4, 5], labels: vec![4, 5] },
        ];
        let packed = pack(rows, 8);
        assert_eq!(
            packed,
            vec![Row { input_ids: vec![1, 2, 3, 4, 5], labels: vec![-100, -100, 3, -100, 5] }]
        );
    }

    #[test]
    fn windows_pack_each_window_alone_and_one_window_is_plain_first_fit() {
        let mut rng = crate::rng::SplitMix64::new(3);
        let lens: Vec<usize> = (0..50).map(|_| 1 + rng.below(6) as usize).collect();
        let whole = Bins::windowed(&lens, 8, 1000);
        let plain: Vec<Vec<u32>> = first_fit(&lens, 8)
            .into_iter()
            .map(|b| b.into_iter().map(|i| i as u32).collect())
            .collect();
        assert_eq!((0..whole.len()).map(|b| whole.members(b).to_vec()).collect::<Vec<_>>(), plain);
        let windowed = Bins::windowed(&lens, 8, 16);
        for b in 0..windowed.len() {
            let m = windowed.members(b);
            assert!(m.iter().all(|&i| i / 16 == m[0] / 16), "bin {b} crosses a window: {m:?}");
            assert!(m.iter().map(|&i| lens[i as usize]).sum::<usize>() <= 8);
        }
        let mut all = windowed.members.clone();
        all.sort();
        assert_eq!(all, (0..50).collect::<Vec<u32>>(), "every example once");
        assert_eq!(Bins::singletons(3).members(2), [2]);
    }

    #[test]
    fn empty_input() {
        assert!(pack(vec![], 4).is_empty());
        assert!(pack(vec![row(0, 0)], 4).is_empty());
    }

    #[test]
    #[should_panic(expected = "more than max_seq_len")]
    fn row_too_long_panics() {
        pack(vec![row(0, 5)], 4);
    }
}
