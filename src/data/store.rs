//! The token store: a dataset's examples spilled to disk as they are read, then read back by
//! index, so that host RAM for data is an index (16 bytes an example), not the tokens.
//!
//! Every loader writes its examples here in file order ([`RowStoreWriter::push`]); the split,
//! packing and shuffling then work on example indices and lengths alone, and a step reads just
//! its own rows ([`RowStore::read_append`], one positioned read each). The Hugging Face
//! `datasets` library does the same with its memory-mapped Arrow cache; we write our own
//! because what is stored is two `i32` lists per example and no crate does this more simply.
//!
//! The file is an anonymous temporary file (`tempfile::tempfile`: in `TMPDIR`, else `/tmp`,
//! unlinked at creation, so nothing is left behind even when the process is killed). Encoding
//! of one example of `n` tokens, little-endian: the `n` ids as `i32`, then either a bitmask of
//! `ceil(n / 8)` bytes (bit `j` set: `labels[j] = -100`, else `labels[j] = ids[j]`), the form
//! of nearly every dataset, or, when some label is neither, the `n` labels as `i32`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

use super::pretokenized::{IGNORE_INDEX, Row};
use super::records::carries_loss;

/// Where one example lies in the file.
#[derive(Clone, Copy, Debug)]
struct Entry {
    offset: u64,
    len: u32,
    flags: u8,
}

/// The labels are the ids, except where the mask says -100.
const MASKED_IDS: u8 = 1;
/// Some position after the first carries a loss ([`carries_loss`]).
const CARRIES_LOSS: u8 = 2;

/// Examples as they are read, spilled to an anonymous file.
pub struct RowStoreWriter {
    out: BufWriter<File>,
    index: Vec<Entry>,
    offset: u64,
    bytes: Vec<u8>,
}

impl RowStoreWriter {
    /// An empty store in the system's temporary directory (`TMPDIR`).
    pub fn new() -> Result<Self> {
        let file = tempfile::tempfile().with_context(|| {
            format!(
                "cannot create the data spill file in {}\nhint: set TMPDIR to a writable \
                 directory on a disk with room for the tokenized data (about 4 bytes a token)",
                std::env::temp_dir().display()
            )
        })?;
        let out = BufWriter::with_capacity(1 << 20, file);
        Ok(RowStoreWriter { out, index: Vec::new(), offset: 0, bytes: Vec::new() })
    }

    /// Appends one example (`input_ids` and `labels` of one length, at most `u32::MAX`).
    pub fn push(&mut self, row: &Row) -> Result<()> {
        let n = row.input_ids.len();
        assert_eq!(n, row.labels.len(), "an example's ids and labels differ in length");
        let len = u32::try_from(n).context("an example of more than 4G tokens")?;
        let masked = row.labels.iter().zip(&row.input_ids).all(|(&l, &i)| l == i || l == -100);
        let flags =
            if masked { MASKED_IDS } else { 0 } | if carries_loss(row) { CARRIES_LOSS } else { 0 };
        self.bytes.clear();
        self.bytes.extend(row.input_ids.iter().flat_map(|x| x.to_le_bytes()));
        if masked {
            let mut mask = vec![0u8; n.div_ceil(8)];
            for (j, _) in row.labels.iter().enumerate().filter(|(_, l)| **l == IGNORE_INDEX) {
                mask[j / 8] |= 1 << (j % 8);
            }
            self.bytes.extend_from_slice(&mask);
        } else {
            self.bytes.extend(row.labels.iter().flat_map(|x| x.to_le_bytes()));
        }
        self.out.write_all(&self.bytes).context(SPILL_WRITE)?;
        self.index.push(Entry { offset: self.offset, len, flags });
        self.offset += self.bytes.len() as u64;
        Ok(())
    }

    /// The store, ready to be read; refused past 4G examples (rows index them by `u32`).
    pub fn finish(self) -> Result<RowStore> {
        if self.index.len() > u32::MAX as usize {
            bail!("a dataset of more than 4G examples\nhint: split it into several runs");
        }
        let file = self.out.into_inner().map_err(|e| e.into_error()).context(SPILL_WRITE)?;
        Ok(RowStore {
            file,
            index: self.index,
            bytes: self.offset,
            scratch: Mutex::new(Vec::new()),
        })
    }
}

const SPILL_WRITE: &str =
    "writing the data spill file\nhint: the temporary directory (TMPDIR) may be full";

/// Examples spilled by a [`RowStoreWriter`], read back by index.
pub struct RowStore {
    file: File,
    index: Vec<Entry>,
    bytes: u64,
    /// The bytes of the last read, kept so that reads do not allocate.
    scratch: Mutex<Vec<u8>>,
}

impl std::fmt::Debug for RowStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RowStore({} examples, {} bytes)", self.index.len(), self.bytes)
    }
}

impl RowStore {
    /// The examples `rows`, spilled.
    pub fn from_rows<'a>(rows: impl IntoIterator<Item = &'a Row>) -> Result<RowStore> {
        let mut w = RowStoreWriter::new()?;
        for r in rows {
            w.push(r)?;
        }
        w.finish()
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Tokens of example `i`.
    pub fn example_len(&self, i: usize) -> usize {
        self.index[i].len as usize
    }

    /// Whether example `i` carries a loss ([`carries_loss`]).
    pub fn carries_loss(&self, i: usize) -> bool {
        self.index[i].flags & CARRIES_LOSS != 0
    }

    /// Bytes on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.bytes
    }

    /// Appends example `i`'s ids and labels to `row`; with `first_ignored`, its first label is
    /// -100 (a packed row's member: see [`pack`](super::pack::pack)).
    pub fn read_append(&self, i: usize, row: &mut Row, first_ignored: bool) -> Result<()> {
        let e = self.index[i];
        let n = e.len as usize;
        let size = if e.flags & MASKED_IDS != 0 { 4 * n + n.div_ceil(8) } else { 8 * n };
        let mut buf = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        buf.resize(size, 0);
        self.file.read_exact_at(&mut buf, e.offset).with_context(|| {
            format!("reading example {i} back from the data spill file (TMPDIR)")
        })?;
        fn ints(b: &[u8]) -> impl Iterator<Item = i32> + '_ {
            b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
        }
        let (ids, rest) = buf.split_at(4 * n);
        let start = row.input_ids.len();
        row.input_ids.extend(ints(ids));
        if e.flags & MASKED_IDS != 0 {
            let masked = |j: usize| rest[j / 8] & (1 << (j % 8)) != 0;
            let ids = &row.input_ids[start..];
            row.labels.extend((0..n).map(|j| if masked(j) { IGNORE_INDEX } else { ids[j] }));
        } else {
            row.labels.extend(ints(rest));
        }
        if first_ignored && n > 0 {
            row.labels[start] = IGNORE_INDEX;
        }
        Ok(())
    }

    /// Example `i` as a row of its own.
    pub fn example(&self, i: usize) -> Result<Row> {
        let mut row = Row { input_ids: Vec::new(), labels: Vec::new() };
        self.read_append(i, &mut row, false)?;
        Ok(row)
    }

    /// Every example, in order (small stores and tests: this holds them all).
    pub fn to_rows(&self) -> Result<Vec<Row>> {
        (0..self.len()).map(|i| self.example(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn random_row(rng: &mut SplitMix64, general: bool) -> Row {
        let n = 1 + rng.below(40) as usize;
        let input_ids: Vec<i32> = (0..n).map(|_| rng.below(1 << 20) as i32).collect();
        let labels = input_ids
            .iter()
            .map(|&id| match rng.below(4) {
                0 => IGNORE_INDEX,
                1 if general => id + 1,
                _ => id,
            })
            .collect();
        Row { input_ids, labels }
    }

    #[test]
    fn examples_read_back_exactly_in_both_encodings() {
        let mut rng = SplitMix64::new(11);
        let rows: Vec<Row> = (0..300).map(|i| random_row(&mut rng, i % 3 == 0)).collect();
        let store = RowStore::from_rows(&rows).unwrap();
        assert_eq!(store.len(), rows.len());
        assert_eq!(store.to_rows().unwrap(), rows);
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(store.example_len(i), r.input_ids.len());
            assert_eq!(store.carries_loss(i), carries_loss(r), "example {i}");
        }
        // Masked examples take 4 bytes a token and a bit; the others 8 bytes a token.
        let want: usize = rows
            .iter()
            .map(|r| {
                let n = r.input_ids.len();
                let masked = r.labels.iter().zip(&r.input_ids).all(|(l, i)| l == i || *l == -100);
                if masked { 4 * n + n.div_ceil(8) } else { 8 * n }
            })
            .sum();
        assert_eq!(store.disk_bytes(), want as u64);
    }

    #[test]
    fn appends_and_masks_a_packed_member() {
        let a = Row { input_ids: vec![5, 6, 7], labels: vec![5, -100, 7] };
        let b = Row { input_ids: vec![8, 9], labels: vec![1, 2] };
        let store = RowStore::from_rows(&[a, b]).unwrap();
        let mut row = Row { input_ids: vec![1], labels: vec![1] };
        store.read_append(0, &mut row, true).unwrap();
        store.read_append(1, &mut row, true).unwrap();
        assert_eq!(row.input_ids, [1, 5, 6, 7, 8, 9]);
        assert_eq!(row.labels, [1, -100, -100, 7, -100, 2]);
    }
}
