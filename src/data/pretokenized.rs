//! Pretokenized datasets (`{"input_ids": [...], "labels": [...]}` per record) and the batches
//! cut from them.
//!
//! Labels follow the Hugging Face convention: aligned with `input_ids` (not shifted), `-100` marks
//! a position that carries no loss, and a row without `labels` is trained on every token. Batch
//! `k` of size `B` is rows `[k*B, (k+1)*B)` in file order (no shuffling), wrapping around into the
//! next epoch; its rows are right-padded with id 0 and label -100 to its longest row, and
//! [`make_batch`] shifts the labels so that `targets[b, t]` is the token predicted at position `t`.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use serde_json::Value;

use super::records::{JsonObject, LoadReport, OnError, Outcome, carries_loss, finish_load};
use super::source::{Fields, Loc, Source, json_kind, read_records_into};
use super::store::{RowStore, RowStoreWriter};

/// The label of a position that carries no loss (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i32 = -100;

/// The id written into padding positions of `input_ids`.
pub const PAD_ID: i32 = 0;

/// One training sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// Token ids, each in `[0, vocab_size)`.
    pub input_ids: Vec<i32>,
    /// One label per token, not shifted: a token id in `[0, vocab_size)` or [`IGNORE_INDEX`].
    pub labels: Vec<i32>,
}

pub use super::dataset::PretokenizedDataset;

/// One batch, row-major, padded to its longest row.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Rows (B).
    pub b: usize,
    /// Positions per row (T): the longest row of the batch.
    pub t: usize,
    /// input_ids: (B*T), padding is [`PAD_ID`].
    pub input_ids: Vec<i32>,
    /// targets: (B*T), already shifted: `targets[b, t] = labels[b, t + 1]`, `targets[b, T-1] =
    /// -100`; padding is -100.
    pub targets: Vec<i32>,
    /// Number of `targets` that are not -100: the loss is a mean over this many positions.
    pub num_targets: usize,
    /// (B*T) 1 on a row's own tokens, 0 on padding (HF's attention mask).
    pub mask: Vec<f32>,
}

/// One record as written; unknown keys are ignored. `i64` so that an id too large for `i32` is
/// reported as out of range rather than as malformed.
struct RawRow {
    input_ids: Option<Vec<i64>>,
    labels: Option<Vec<i64>>,
}

/// The fields of a pretokenized record.
pub const PRETOKENIZED_FIELDS: Fields =
    Fields { required: &["input_ids"], optional: &["labels"], nested: &[] };

/// Reads and validates a pretokenized dataset (JSONL or Parquet, see [`Source`]), failing on the
/// first bad record.
///
/// Every error is one line naming the file and the record (`FILE:LINE`, or the Parquet row):
/// unreadable file, malformed JSON, missing or empty `input_ids`, `labels` of a different
/// length, a row longer than `max_seq_len`, a token id outside `[0, vocab_size)`, a label that
/// is neither -100 nor in `[0, vocab_size)`, a file without any row, or without any row that
/// carries a loss.
pub fn load_pretokenized(
    path: &Path,
    max_seq_len: usize,
    vocab_size: usize,
) -> Result<PretokenizedDataset> {
    let (rows, _) = load_pretokenized_rows(&path.into(), max_seq_len, vocab_size, OnError::Fail)?;
    Ok(PretokenizedDataset::whole(Arc::new(rows), path))
}

/// The rows of a pretokenized dataset under the `on_error` policy (see [`load_pretokenized`]);
/// the field names are `src.columns`' mapping of `input_ids` and `labels`.
pub fn load_pretokenized_rows(
    src: &Source,
    max_seq_len: usize,
    vocab_size: usize,
    on_error: OnError,
) -> Result<(RowStore, LoadReport)> {
    let (ids_key, labels_key) = (src.columns.name("input_ids"), src.columns.name("labels"));
    let mut report = LoadReport::default();
    let mut no_loss = Vec::new();
    let mut out = RowStoreWriter::new()?;
    let build = |obj: &JsonObject, loc: &Loc| {
        let raw = RawRow { input_ids: int_list(obj, ids_key)?, labels: int_list(obj, labels_key)? };
        let row = validate_row(raw, max_seq_len, vocab_size, ids_key, labels_key)?;
        if !carries_loss(&row) {
            no_loss.push(loc.clone());
        }
        Ok(Outcome::Keep(row))
    };
    read_records_into(src, &PRETOKENIZED_FIELDS, on_error, &mut report, build, |r| out.push(&r))?;
    report.no_loss = no_loss;
    finish_load(src, out.finish()?, report, 0)
}

/// The optional list of integers `obj[key]` (absent or null: `None`).
fn int_list(obj: &JsonObject, key: &str) -> Result<Option<Vec<i64>>> {
    let items = match obj.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(items)) => items,
        Some(other) => {
            bail!("field \"{key}\" is {}, expected a list of integers", json_kind(other))
        }
    };
    let int = |(j, v): (usize, &Value)| match v.as_i64() {
        Some(x) => Ok(x),
        None => bail!("{key}[{j}] = {v} is not an integer"),
    };
    Ok(Some(items.iter().enumerate().map(int).collect::<Result<_>>()?))
}

/// Checks one parsed row; the error message lacks the `FILE:LINE: ` prefix.
fn validate_row(
    raw: RawRow,
    max_seq_len: usize,
    vocab_size: usize,
    ids_key: &str,
    labels_key: &str,
) -> Result<Row> {
    let Some(input_ids) = raw.input_ids else {
        bail!("row has no \"{ids_key}\" key");
    };
    if input_ids.is_empty() {
        bail!("\"{ids_key}\" is empty");
    }
    if input_ids.len() > max_seq_len {
        bail!(
            "row has {} tokens, more than train.max_seq_len = {max_seq_len}; hint: raise \
             max_seq_len or split the row",
            input_ids.len()
        );
    }
    let vocab = vocab_size as i64;
    if let Some((j, id)) = input_ids.iter().enumerate().find(|&(_, &id)| id < 0 || id >= vocab) {
        bail!(
            "{ids_key}[{j}] = {id} is outside the vocabulary [0, {vocab_size}); hint: was the \
             data tokenized with this model's tokenizer?"
        );
    }
    let labels = match raw.labels {
        None => input_ids.clone(),
        Some(labels) => {
            if labels.len() != input_ids.len() {
                bail!(
                    "\"{ids_key}\" has {} tokens but \"{labels_key}\" has {}; they must be the \
                     same length (labels are not shifted, -100 marks no loss)",
                    input_ids.len(),
                    labels.len()
                );
            }
            let bad =
                |&(_, &l): &(usize, &i64)| l != i64::from(IGNORE_INDEX) && (l < 0 || l >= vocab);
            if let Some((j, l)) = labels.iter().enumerate().find(bad) {
                bail!(
                    "{labels_key}[{j}] = {l} is neither -100 (no loss) nor a token id in [0, \
                     {vocab_size})"
                );
            }
            labels
        }
    };
    // Every value was checked to lie in [-100, vocab_size), and vocab sizes fit in i32.
    let to_i32 = |x: Vec<i64>| -> Result<Vec<i32>> {
        x.into_iter()
            .map(|y| i32::try_from(y).map_err(|_| anyhow!("id {y} does not fit in i32")))
            .collect()
    };
    Ok(Row { input_ids: to_i32(input_ids)?, labels: to_i32(labels)? })
}

/// Pads `rows` into one batch and shifts the labels into next-token targets.
///
/// `T` is the longest row; shorter rows are right-padded with id [`PAD_ID`] and label -100 (no
/// attention mask is needed: causal attention never looks right). Then
/// `targets[b, t] = labels[b, t + 1]` for `t < T - 1` and `targets[b, T - 1] = -100`.
/// Panics on an empty slice (a caller bug).
pub fn make_batch(rows: &[&Row]) -> Batch {
    assert!(!rows.is_empty(), "make_batch needs at least one row");
    let b = rows.len();
    let t = rows.iter().map(|r| r.input_ids.len()).max().unwrap_or(0);
    let mut input_ids = vec![PAD_ID; b * t];
    let mut targets = vec![IGNORE_INDEX; b * t];
    let mut mask = vec![0.0; b * t];
    for (i, row) in rows.iter().enumerate() {
        let n = row.input_ids.len();
        mask[i * t..i * t + n].fill(1.0);
        assert_eq!(n, row.labels.len(), "row {i}: input_ids and labels lengths differ");
        input_ids[i * t..i * t + n].copy_from_slice(&row.input_ids);
        // Position p predicts label p + 1; positions from n - 1 on have no next label.
        if n > 1 {
            targets[i * t..i * t + n - 1].copy_from_slice(&row.labels[1..]);
        }
    }
    let num_targets = targets.iter().filter(|&&x| x != IGNORE_INDEX).count();
    Batch { b, t, input_ids, targets, num_targets, mask }
}

/// The rows of batch `k` of size `b`: row indices `(k*b + i) % len` for `i` in `0..b`, i.e. file
/// order, cycling through the dataset in epochs. Panics if `b == 0`.
pub fn batch_rows(ds: &PretokenizedDataset, k: usize, b: usize) -> Result<Vec<Row>> {
    assert!(b > 0, "batch size must be positive");
    let len = ds.len();
    // (k*b + i) % len without overflow for huge k.
    let start = ((k % len) * (b % len)) % len;
    (0..b).map(|i| ds.row((start + i % len) % len)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(content: &str) -> tempfile::NamedTempFile {
        crate::data::records::test_tokenizer::write_temp(content)
    }

    fn load(content: &str) -> Result<PretokenizedDataset> {
        let f = write(content);
        load_pretokenized(f.path(), 8, 100)
    }

    /// Loads `content`, expects an error, checks it names the file (and line) and contains
    /// `want`, and that it is one line.
    fn load_err(content: &str, line: Option<usize>, want: &str) {
        let f = write(content);
        let err = format!("{:#}", load_pretokenized(f.path(), 8, 100).unwrap_err());
        let prefix = match line {
            Some(l) => format!("{}:{l}: ", f.path().display()),
            None => format!("{}", f.path().display()),
        };
        assert!(err.contains(&prefix), "error {err:?} does not name {prefix:?}");
        assert!(err.contains(want), "error {err:?} does not contain {want:?}");
        assert!(!err.contains('\n'), "error {err:?} spans several lines");
    }

    fn row(ids: &[i32], labels: &[i32]) -> Row {
        Row { input_ids: ids.to_vec(), labels: labels.to_vec() }
    }

    #[test]
    fn loads_rows_with_and_without_labels() {
        let ds = load(
            "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n\n  \r\n\
             {\"input_ids\": [4, 5], \"extra\": {\"a\": 1}}\r\n\
             {\"input_ids\": [99], \"labels\": null}",
        )
        .unwrap();
        assert_eq!(
            ds.to_rows().unwrap(),
            vec![row(&[1, 2, 3], &[-100, 2, 3]), row(&[4, 5], &[4, 5]), row(&[99], &[99])]
        );
    }

    #[test]
    fn missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.jsonl");
        let err = format!("{:#}", load_pretokenized(&path, 8, 100).unwrap_err());
        assert!(err.contains("nope.jsonl") && err.contains("cannot read"), "{err}");
    }

    #[test]
    fn malformed_json() {
        load_err("{\"input_ids\": [1]}\n{\"input_ids\": [1, 2\n", Some(2), "malformed JSON");
        load_err("[1, 2]\n", Some(1), "record is an array, expected a JSON object");
        load_err("{\"input_ids\": [1.5]}\n", Some(1), "input_ids[0] = 1.5 is not an integer");
        load_err("{\"input_ids\": 3}\n", Some(1), "expected a list of integers");
        load_err("\u{ff}\n", Some(1), "malformed JSON");
    }

    #[test]
    fn missing_input_ids() {
        load_err("\n{\"labels\": [1]}\n", Some(2), "no \"input_ids\"");
    }

    #[test]
    fn empty_input_ids() {
        load_err("{\"input_ids\": []}\n", Some(1), "\"input_ids\" is empty");
    }

    #[test]
    fn length_mismatch() {
        load_err(
            "{\"input_ids\": [1, 2], \"labels\": [1]}\n",
            Some(1),
            "\"input_ids\" has 2 tokens but \"labels\" has 1",
        );
    }

    #[test]
    fn row_too_long() {
        let f = write(
            "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8]}\n{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9]}\n",
        );
        let err = format!("{:#}", load_pretokenized(f.path(), 8, 100).unwrap_err());
        let want = format!(
            "{}:2: row has 9 tokens, more than train.max_seq_len = 8; hint: raise max_seq_len or \
             split the row",
            f.path().display()
        );
        assert_eq!(err, want);
    }

    #[test]
    fn token_out_of_vocab() {
        load_err(
            "{\"input_ids\": [1, 100]}\n",
            Some(1),
            "input_ids[1] = 100 is outside the vocabulary [0, 100)",
        );
        load_err("{\"input_ids\": [-1]}\n", Some(1), "input_ids[0] = -1");
        load_err("{\"input_ids\": [-100]}\n", Some(1), "input_ids[0] = -100");
        load_err("{\"input_ids\": [5000000000]}\n", Some(1), "input_ids[0] = 5000000000");
    }

    #[test]
    fn label_out_of_vocab() {
        load_err(
            "{\"input_ids\": [1, 2], \"labels\": [-100, 100]}\n",
            Some(1),
            "labels[1] = 100 is neither -100",
        );
        load_err("{\"input_ids\": [1, 2], \"labels\": [-1, 2]}\n", Some(1), "labels[0] = -1");
    }

    #[test]
    fn empty_dataset() {
        load_err("", None, "no rows");
        load_err("\n  \n\r\n", None, "no rows");
    }

    #[test]
    fn make_batch_pads_and_shifts() {
        let a = row(&[1, 2, 3, 4], &[-100, -100, 3, 4]);
        let b = row(&[5, 6], &[5, 6]);
        let c = row(&[7], &[7]);
        let batch = make_batch(&[&a, &b, &c]);
        assert_eq!((batch.b, batch.t), (3, 4));
        #[rustfmt::skip]
        assert_eq!(batch.input_ids, vec![
            1, 2, 3, 4,
            5, 6, 0, 0,
            7, 0, 0, 0,
        ]);
        #[rustfmt::skip]
        assert_eq!(batch.targets, vec![
            -100, 3, 4, -100,
            6, -100, -100, -100,
            -100, -100, -100, -100,
        ]);
        assert_eq!(batch.num_targets, 3);
    }

    #[test]
    fn batch_rows_cycles_in_file_order() {
        let rows: Vec<Row> = (0..5).map(|i| row(&[i], &[i])).collect();
        let ds = PretokenizedDataset::from_rows(&rows, Path::new("x.jsonl")).unwrap();
        let ids = |k, b| {
            batch_rows(&ds, k, b).unwrap().iter().map(|r| r.input_ids[0]).collect::<Vec<_>>()
        };
        assert_eq!(ids(0, 2), vec![0, 1]);
        assert_eq!(ids(1, 2), vec![2, 3]);
        assert_eq!(ids(2, 2), vec![4, 0]);
        assert_eq!(ids(3, 2), vec![1, 2]);
        assert_eq!(ids(0, 7), vec![0, 1, 2, 3, 4, 0, 1]);
        assert_eq!(ids(1, 7), vec![2, 3, 4, 0, 1, 2, 3]);
        for k in 0..20 {
            for b in 1..9 {
                let want: Vec<i32> = (0..b).map(|i| ((k * b + i) % 5) as i32).collect();
                assert_eq!(ids(k, b), want, "k = {k}, b = {b}");
            }
        }
        assert_eq!(ids(usize::MAX, 3).len(), 3);
    }
}
