//! A dataset as a run reads it: examples in a [`RowStore`] on disk, rows as lists of examples
//! (one each, or several when packed), read one row at a time in the order steps ask for.
//!
//! Host RAM holds the index only: 16 bytes an example in the store, 12 a row here; a step reads
//! its rows into buffers it reuses ([`PretokenizedDataset::read_row`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;

use super::pack::Bins;
use super::pretokenized::{IGNORE_INDEX, Row};
use super::store::RowStore;

/// The rows of a dataset, each read from the store on demand.
#[derive(Debug, Clone)]
pub struct PretokenizedDataset {
    /// The file (or directory, or glob) the examples came from.
    pub path: PathBuf,
    store: Arc<RowStore>,
    bins: Bins,
    /// Tokens of each row.
    lens: Vec<u32>,
    /// Rows are packed: every member's first label is -100 ([`super::pack::pack`]).
    packed: bool,
}

impl PretokenizedDataset {
    /// The examples `members` of `store` (in that order), one row each, or packed into rows of
    /// at most `max_seq_len` tokens ([`Bins::of`]).
    pub fn new(
        store: Arc<RowStore>,
        members: &[u32],
        pack: Option<usize>,
        path: &Path,
    ) -> PretokenizedDataset {
        let bins = match pack {
            Some(cap) => {
                let lens: Vec<usize> =
                    members.iter().map(|&i| store.example_len(i as usize)).collect();
                let mut bins = Bins::of(&lens, cap);
                for m in &mut bins.members {
                    *m = members[*m as usize];
                }
                bins
            }
            None => {
                Bins { members: members.to_vec(), starts: (0..=members.len() as u32).collect() }
            }
        };
        let row_len = |b: usize| -> u32 {
            bins.members(b).iter().map(|&i| store.example_len(i as usize) as u32).sum()
        };
        let lens = (0..bins.len()).map(row_len).collect();
        PretokenizedDataset { path: path.to_path_buf(), store, bins, lens, packed: pack.is_some() }
    }

    /// Every example of `store`, one row each.
    pub fn whole(store: Arc<RowStore>, path: &Path) -> PretokenizedDataset {
        let all: Vec<u32> = (0..store.len() as u32).collect();
        PretokenizedDataset::new(store, &all, None, path)
    }

    /// `rows` as a dataset (spilled like any other).
    pub fn from_rows(rows: &[Row], path: &Path) -> Result<PretokenizedDataset> {
        Ok(PretokenizedDataset::whole(Arc::new(RowStore::from_rows(rows)?), path))
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    /// Tokens of row `r`.
    pub fn row_len(&self, r: usize) -> usize {
        self.lens[r] as usize
    }

    /// The longest row's tokens (0 when empty).
    pub fn longest(&self) -> usize {
        self.lens.iter().max().map_or(0, |&n| n as usize)
    }

    /// Tokens over all rows.
    pub fn tokens(&self) -> usize {
        self.lens.iter().map(|&n| n as usize).sum()
    }

    /// Row `r` into `out` (cleared first; its buffers are reused).
    pub fn read_row(&self, r: usize, out: &mut Row) -> Result<()> {
        out.input_ids.clear();
        out.labels.clear();
        for &i in self.bins.members(r) {
            self.store.read_append(i as usize, out, self.packed)?;
        }
        debug_assert!(!self.packed || out.labels.first().is_none_or(|&l| l == IGNORE_INDEX));
        Ok(())
    }

    /// Row `r`, newly allocated.
    pub fn row(&self, r: usize) -> Result<Row> {
        let mut row = Row { input_ids: Vec::new(), labels: Vec::new() };
        self.read_row(r, &mut row)?;
        Ok(row)
    }

    /// Every row, in order (small datasets and tests: this holds them all).
    pub fn to_rows(&self) -> Result<Vec<Row>> {
        (0..self.len()).map(|r| self.row(r)).collect()
    }

    /// The store the rows are read from.
    pub fn store(&self) -> &RowStore {
        &self.store
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::pack::pack;
    use crate::rng::SplitMix64;

    fn rows(n: usize, seed: u64) -> Vec<Row> {
        let mut rng = SplitMix64::new(seed);
        (0..n)
            .map(|_| {
                let len = 1 + rng.below(12) as usize;
                let ids: Vec<i32> = (0..len).map(|_| rng.below(100) as i32).collect();
                let labels = ids.iter().map(|&i| if i % 5 == 0 { -100 } else { i }).collect();
                Row { input_ids: ids, labels }
            })
            .collect()
    }

    #[test]
    fn packed_rows_read_from_the_store_equal_packing_in_memory() {
        let rows = rows(500, 4);
        let store = Arc::new(RowStore::from_rows(&rows).unwrap());
        let all: Vec<u32> = (0..rows.len() as u32).collect();
        let ds = PretokenizedDataset::new(store.clone(), &all, Some(16), Path::new("x"));
        let want = pack(rows.clone(), 16);
        assert_eq!(ds.to_rows().unwrap(), want);
        assert_eq!(ds.len(), want.len());
        assert_eq!(ds.tokens(), rows.iter().map(|r| r.input_ids.len()).sum::<usize>());
        assert_eq!(ds.longest(), want.iter().map(|r| r.input_ids.len()).max().unwrap());
        // A subset (an eval split) packs alone, and unpacked rows are the examples themselves.
        let odd: Vec<u32> = all.iter().copied().filter(|i| i % 2 == 1).collect();
        let sub = PretokenizedDataset::new(store.clone(), &odd, Some(16), Path::new("x"));
        let odd_rows: Vec<Row> = odd.iter().map(|&i| rows[i as usize].clone()).collect();
        assert_eq!(sub.to_rows().unwrap(), pack(odd_rows.clone(), 16));
        let plain = PretokenizedDataset::new(store, &odd, None, Path::new("x"));
        assert_eq!(plain.to_rows().unwrap(), odd_rows);
        let mut buf = Row { input_ids: vec![0; 99], labels: vec![0; 99] };
        plain.read_row(3, &mut buf).unwrap();
        assert_eq!(buf, odd_rows[3], "read_row clears its buffer first");
    }
}
