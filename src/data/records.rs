//! The shared half of the dataset formats: the [`OnError`] policy for bad records, the
//! [`LoadReport`] shown in the run summary, the refusal of data without any loss position
//! ([`finish_load`]), field accessors, and [`example_from_spans`], which tokenizes a rendered
//! example and masks the loss outside the spans that should be learned (used by the alpaca
//! format and by the chat formats). The records themselves come from [`super::source`].

use std::ops::Range;
use std::path::Path;

use anyhow::{Result, anyhow, bail};
use serde::Deserialize;
use serde_json::Value;

use super::pretokenized::{IGNORE_INDEX, Row};
pub use super::source::JsonObject;
use super::source::{Loc, Source, json_kind};
use super::store::RowStore;
use crate::tokenizer::Tokenizer;

/// What to do with a record that cannot be used (malformed JSON, missing field, wrong type, text
/// the tokenizer refuses).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Stop with a one-line error `FILE:LINE: <what>` (the default).
    #[default]
    Fail,
    /// Leave the record out and list it in [`LoadReport::skipped`].
    Skip,
}

/// What loading a dataset made of its records; returned beside the rows for the run summary.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Rows produced.
    pub rows: usize,
    /// Records used (a text record may span several rows, several records one row).
    pub records: usize,
    /// Records left out: where, and the reason. Holds the unusable records under
    /// [`OnError::Skip`], and under either policy the examples whose prompt alone does not fit
    /// in `max_seq_len`.
    pub skipped: Vec<(Loc, String)>,
    /// Examples cut at `max_seq_len` (their end, EOS included, is lost).
    pub truncated: usize,
    /// The records whose row has no position that carries a loss (see [`carries_loss`]): kept,
    /// but a batch of only such rows is skipped in training.
    pub no_loss: Vec<Loc>,
}

impl LoadReport {
    /// One line for the run summary, e.g. `12 rows from 40 records, 2 skipped (first: FILE:7:
    /// missing field "output"), 1 truncated`.
    pub fn summary(&self) -> String {
        let mut s = format!("{} rows from {} records", self.rows, self.records);
        if let Some((loc, reason)) = self.skipped.first() {
            s += &format!(", {} skipped (first: {loc}: {reason})", self.skipped.len());
        }
        if self.truncated > 0 {
            s += &format!(", {} truncated", self.truncated);
        }
        if let Some(loc) = self.no_loss.first() {
            s += &format!(", {} without a loss position (first: {loc})", self.no_loss.len());
        }
        s
    }
}

/// What a format makes of one record.
#[derive(Debug)]
pub enum Outcome<T> {
    /// The record is used.
    Keep(T),
    /// The record is well formed but cannot be used (e.g. its prompt alone is longer than
    /// `max_seq_len`): left out under either [`OnError`] policy, with this reason.
    Skip(String),
}

/// Whether `row` has a position that carries a loss: a label other than -100 after the first
/// position (the first token is never predicted).
pub fn carries_loss(row: &Row) -> bool {
    row.labels.iter().skip(1).any(|&l| l != IGNORE_INDEX)
}

/// Close a load: record the counts in the report, and refuse a result with no row, or with no
/// row that carries a loss (naming the file and the rows).
pub fn finish_load(
    source: &Source,
    rows: RowStore,
    mut report: LoadReport,
    truncated: usize,
) -> Result<(RowStore, LoadReport)> {
    report.truncated = truncated;
    if rows.is_empty() {
        return Err(no_rows_error(&source.path, &report));
    }
    if (0..rows.len()).all(|i| !rows.carries_loss(i)) {
        let file = source.path.display();
        let n = rows.len();
        let mut which: Vec<String> = report.no_loss.iter().take(4).map(|l| l.to_string()).collect();
        if report.no_loss.len() > which.len() {
            which.push(format!("and {} more", report.no_loss.len() - which.len()));
        }
        let which =
            if which.is_empty() { String::new() } else { format!(": {}", which.join(", ")) };
        let rows = if n == 1 { "its one row".to_string() } else { format!("any of its {n} rows") };
        bail!(
            "{file}: no position carries a loss in {rows}{which}\nhint: a label of \
             -100 carries no loss, nor does the first position of a row; the alpaca, chat and \
             sharegpt formats learn the responses, which must start within train.max_seq_len \
             (or set data.train_on_prompt)"
        );
    }
    report.rows = rows.len();
    Ok((rows, report))
}

/// The error for a dataset that produced no row, naming the file and why.
pub fn no_rows_error(path: &Path, report: &LoadReport) -> anyhow::Error {
    let file = path.display();
    match report.skipped.first() {
        Some((loc, reason)) => anyhow!(
            "{file}: no rows: all {} records were skipped (first: {loc}: {reason})",
            report.skipped.len()
        ),
        None => anyhow!("{file}: no rows (the file is empty or holds only blank lines)"),
    }
}

/// Checks the `max_seq_len` a text-based format is cut to.
pub fn check_max_seq_len(max_seq_len: usize) -> Result<()> {
    if max_seq_len < 2 {
        bail!("max_seq_len = {max_seq_len} is too short: a row needs at least 2 tokens");
    }
    Ok(())
}

/// The required string field `key` of `obj`.
pub fn str_field<'a>(obj: &'a JsonObject, key: &str) -> Result<&'a str> {
    match obj.get(key) {
        None => bail!("missing field \"{key}\""),
        Some(Value::String(s)) => Ok(s),
        Some(other) => bail!("field \"{key}\" is {}, expected a string", json_kind(other)),
    }
}

/// The optional string field `key` of `obj`: absent and `null` are `None`.
pub fn opt_str_field<'a>(obj: &'a JsonObject, key: &str) -> Result<Option<&'a str>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => bail!("field \"{key}\" is {}, expected a string", json_kind(other)),
    }
}

/// The tokenizer's EOS id as rows hold it, or an error naming the dataset: `format` ends every
/// `unit` (record, example) with EOS.
pub fn require_eos(tok: &dyn Tokenizer, path: &Path, format: &str, unit: &str) -> Result<i32> {
    let Some(eos) = tok.eos_id() else {
        bail!(
            "the tokenizer has no EOS token; the {format} format ends every {unit} with EOS \
             (dataset {})",
            path.display()
        );
    };
    token_i32(eos)
}

/// A tokenizer id as the `i32` rows hold.
pub fn token_i32(id: u32) -> Result<i32> {
    i32::try_from(id).map_err(|_| anyhow!("token id {id} does not fit in i32"))
}

/// `text` tokenized, with BOS in front when `add_bos` and the tokenizer has one, and for each
/// token whether it lies inside one of `loss_spans`.
///
/// A token lies inside the span `s` when its byte range `r` does: `s.start <= r.start`,
/// `r.end <= s.end` and `r.start < s.end` (the last condition only matters for tokens covering
/// no byte). A token straddling a span boundary is outside. BOS is outside.
///
/// Panics if a span is not a range of `text` (a caller bug).
pub fn encode_spans(
    tok: &dyn Tokenizer,
    text: &str,
    loss_spans: &[Range<usize>],
    add_bos: bool,
) -> Result<(Vec<i32>, Vec<bool>)> {
    spans_of_encoded(tok, (text, tok.encode_with_offsets(text)?), loss_spans, add_bos)
}

/// A text's ids and each id's byte range in it (`Tokenizer::encode_with_offsets`).
pub type Encoded = (Vec<u32>, Vec<Range<usize>>);

/// [`encode_spans`] of `text` already encoded (`encoded`).
pub fn spans_of_encoded(
    tok: &dyn Tokenizer,
    (text, (ids, offsets)): (&str, Encoded),
    loss_spans: &[Range<usize>],
    add_bos: bool,
) -> Result<(Vec<i32>, Vec<bool>)> {
    for s in loss_spans {
        assert!(
            s.start <= s.end && s.end <= text.len(),
            "loss span {s:?} is not a byte range of a {}-byte text",
            text.len()
        );
    }
    if ids.len() != offsets.len() {
        bail!("the tokenizer returned {} ids but {} offsets", ids.len(), offsets.len());
    }
    let bos = if add_bos { tok.bos_id() } else { None };
    let mut out_ids = Vec::with_capacity(ids.len() + 1);
    let mut in_span = Vec::with_capacity(ids.len() + 1);
    if let Some(bos) = bos {
        out_ids.push(token_i32(bos)?);
        in_span.push(false);
    }
    for (&id, r) in ids.iter().zip(&offsets) {
        out_ids.push(token_i32(id)?);
        let inside = |s: &Range<usize>| s.start <= r.start && r.end <= s.end && r.start < s.end;
        in_span.push(loss_spans.iter().any(inside));
    }
    Ok((out_ids, in_span))
}

/// One training example from pre-rendered text: `text` tokenized (BOS in front when `add_bos`
/// and the tokenizer has one), labels equal to the ids on the tokens whose byte range lies inside
/// one of `loss_spans` (byte ranges of `text`) and -100 elsewhere; with `train_on_prompt` every
/// token but BOS carries loss. See [`encode_spans`] for "inside". No EOS is added: a template
/// that wants one renders it, or the caller pushes it. The row is not cut to any length.
///
/// Panics if a span is not a range of `text` (a caller bug).
pub fn example_from_spans(
    tok: &dyn Tokenizer,
    text: &str,
    loss_spans: &[Range<usize>],
    train_on_prompt: bool,
    add_bos: bool,
) -> Result<Row> {
    let encoded = (text, tok.encode_with_offsets(text)?);
    example_from_encoded(tok, encoded, loss_spans, train_on_prompt, add_bos)
}

/// [`example_from_spans`] of `text` already encoded.
pub fn example_from_encoded(
    tok: &dyn Tokenizer,
    encoded: (&str, Encoded),
    loss_spans: &[Range<usize>],
    train_on_prompt: bool,
    add_bos: bool,
) -> Result<Row> {
    let (input_ids, in_span) = spans_of_encoded(tok, encoded, loss_spans, add_bos)?;
    let has_bos = add_bos && tok.bos_id().is_some();
    let labels = masked_labels(&input_ids, &in_span, train_on_prompt, has_bos);
    Ok(Row { input_ids, labels })
}

/// Labels for `ids`: the id where `in_span` (or everywhere with `train_on_prompt`), -100
/// elsewhere and on BOS (position 0 when `has_bos`). `in_span` may be longer than `ids`.
pub fn masked_labels(
    ids: &[i32],
    in_span: &[bool],
    train_on_prompt: bool,
    has_bos: bool,
) -> Vec<i32> {
    ids.iter()
        .zip(in_span)
        .enumerate()
        .map(|(i, (&id, &inside))| {
            let is_bos = has_bos && i == 0;
            if !is_bos && (inside || train_on_prompt) { id } else { IGNORE_INDEX }
        })
        .collect()
}

/// A tiny tokenizer for the unit tests of the data formats.
#[cfg(test)]
pub(crate) mod test_tokenizer {
    use std::io::Write;
    use std::ops::Range;

    /// A temporary file holding `content` (for loader tests).
    pub(crate) fn write_temp(content: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(content.as_bytes()).unwrap();
        f
    }

    use anyhow::{Result, bail};

    use crate::tokenizer::Tokenizer;

    /// One token per whitespace-separated word; the id of a word is 10 + its byte sum % 1000,
    /// except that the word `"!fail"` makes encoding fail. BOS = 1, EOS = 2 (each optional);
    /// `add_bos` is what [`Tokenizer::add_bos_token`] answers.
    pub struct WordTokenizer {
        pub bos: Option<u32>,
        pub eos: Option<u32>,
        pub add_bos: bool,
    }

    impl WordTokenizer {
        pub fn new() -> Self {
            WordTokenizer { bos: Some(1), eos: Some(2), add_bos: false }
        }

        pub fn word_id(w: &str) -> u32 {
            10 + w.bytes().map(u32::from).sum::<u32>() % 1000
        }
    }

    impl Tokenizer for WordTokenizer {
        fn encode(&self, text: &str) -> Result<Vec<u32>> {
            Ok(self.encode_with_offsets(text)?.0)
        }

        fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<Range<usize>>)> {
            let mut ids = Vec::new();
            let mut offsets = Vec::new();
            let mut start = None;
            for (i, c) in text.char_indices().chain([(text.len(), ' ')]) {
                match (c.is_whitespace(), start) {
                    (true, Some(s)) => {
                        let w = &text[s..i];
                        if w == "!fail" {
                            bail!("cannot encode {w:?}");
                        }
                        ids.push(Self::word_id(w));
                        offsets.push(s..i);
                        start = None;
                    }
                    (false, None) => start = Some(i),
                    _ => {}
                }
            }
            Ok((ids, offsets))
        }

        fn decode(&self, _ids: &[u32], _skip_special: bool) -> Result<String> {
            bail!("WordTokenizer cannot decode")
        }

        fn vocab_size(&self) -> usize {
            1010
        }

        fn bos_id(&self) -> Option<u32> {
            self.bos
        }

        fn eos_id(&self) -> Option<u32> {
            self.eos
        }

        fn pad_id(&self) -> Option<u32> {
            None
        }

        fn token_to_id(&self, _token: &str) -> Option<u32> {
            None
        }

        fn add_bos_token(&self) -> bool {
            self.add_bos
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_tokenizer::WordTokenizer;
    use super::*;
    use crate::data::source::{Fields, read_records};

    fn write(content: &str) -> tempfile::NamedTempFile {
        crate::data::records::test_tokenizer::write_temp(content)
    }

    fn w(word: &str) -> i32 {
        WordTokenizer::word_id(word) as i32
    }

    /// Reads `content` keeping the "a" field of every record.
    fn read(content: &str, on_error: OnError) -> (Result<Vec<String>>, LoadReport, String) {
        let f = write(content);
        let mut report = LoadReport::default();
        let fields = Fields { required: &["a"], optional: &[], nested: &[] };
        let src = Source::from(f.path());
        let got = read_records(&src, &fields, on_error, &mut report, |obj, _| {
            let a = str_field(obj, "a")?;
            if a == "long" {
                return Ok(Outcome::Skip("too long".into()));
            }
            Ok(Outcome::Keep(a.to_string()))
        });
        (got, report, f.path().display().to_string())
    }

    const MIXED: &str = "{\"a\": \"x\"}\n\n{\"a\": 1}\n{\"b\": \"y\"}\n{\"a\": \"y\"\n[1]\n  \r\n\
                         {\"a\": \"long\"}\n{\"a\": \"z\", \"extra\": 3}\r\n";

    #[test]
    fn fail_names_file_and_line() {
        let (got, _, file) = read(MIXED, OnError::Fail);
        let err = format!("{:#}", got.unwrap_err());
        assert_eq!(err, format!("{file}:3: field \"a\" is a number, expected a string"));
    }

    #[test]
    fn skip_lists_every_bad_line() {
        let (got, report, file) = read(MIXED, OnError::Skip);
        assert_eq!(got.unwrap(), vec!["x", "z"]);
        let lines: Vec<Option<usize>> = report.skipped.iter().map(|s| s.0.line()).collect();
        assert_eq!(lines, [3, 4, 5, 6, 8].map(Some));
        assert_eq!(report.skipped[1].1, "missing field \"a\"");
        assert_eq!(report.skipped[2].1, "malformed JSON at column 9: EOF while parsing an object");
        assert!(!report.skipped[2].1.contains("line 1"), "{:?}", report.skipped[2]);
        assert_eq!(report.skipped[3].1, "record is an array, expected a JSON object");
        assert_eq!(report.skipped[4].1, "too long");
        assert_eq!(report.records, 2);
        assert_eq!(
            report.summary(),
            format!(
                "0 rows from 2 records, 5 skipped (first: {file}:3: field \"a\" is a number, \
                 expected a string)"
            )
        );
    }

    #[test]
    fn byte_order_mark_crlf_and_blank_lines() {
        let (got, report, _) =
            read("\u{feff}{\"a\": \"x\"}\r\n\r\n\n{\"a\": \"y\"}\r\n", OnError::Fail);
        assert_eq!(got.unwrap(), vec!["x", "y"]);
        assert!(report.skipped.is_empty());
        // Only at the start of the file: elsewhere it is not JSON.
        let (got, _, file) = read("{\"a\": \"x\"}\n\u{feff}{\"a\": \"y\"}\n", OnError::Fail);
        let err = format!("{:#}", got.unwrap_err());
        assert!(err.starts_with(&format!("{file}:2: malformed JSON")), "{err}");
    }

    #[test]
    fn outcome_skip_is_not_an_error_under_fail() {
        let (got, report, _) = read("{\"a\": \"long\"}\n{\"a\": \"q\"}\n", OnError::Fail);
        assert_eq!(got.unwrap(), vec!["q"]);
        assert_eq!(report.skipped.len(), 1);
        assert_eq!(
            (report.skipped[0].0.line(), report.skipped[0].1.as_str()),
            (Some(1), "too long")
        );
    }

    #[test]
    fn errors_are_one_line() {
        for bad in ["{\"a\": \"x\n", "\u{ff}\n", "{\"a\": [1,\n"] {
            let (got, _, file) = read(bad, OnError::Fail);
            let err = format!("{:#}", got.unwrap_err());
            assert!(err.starts_with(&format!("{file}:1: malformed JSON")), "{err}");
            assert!(!err.contains('\n'), "{err:?}");
        }
    }

    #[test]
    fn missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.jsonl");
        let mut report = LoadReport::default();
        let fields = Fields { required: &[], optional: &[], nested: &[] };
        let src = Source::from(path.as_path());
        let err =
            read_records(&src, &fields, OnError::Skip, &mut report, |_, _| Ok(Outcome::Keep(())))
                .unwrap_err()
                .to_string();
        assert!(err.contains("nope.jsonl") && err.contains("cannot read"), "{err}");
    }

    #[test]
    fn optional_field() {
        let obj: JsonObject =
            serde_json::from_str("{\"a\": null, \"b\": \"s\", \"c\": []}").unwrap();
        assert_eq!(opt_str_field(&obj, "a").unwrap(), None);
        assert_eq!(opt_str_field(&obj, "b").unwrap(), Some("s"));
        assert_eq!(opt_str_field(&obj, "z").unwrap(), None);
        let err = opt_str_field(&obj, "c").unwrap_err().to_string();
        assert_eq!(err, "field \"c\" is an array, expected a string");
        let err = str_field(&obj, "a").unwrap_err().to_string();
        assert_eq!(err, "field \"a\" is null, expected a string");
    }

    #[test]
    fn spans_mask_by_byte_range() {
        let tok = WordTokenizer::new();
        // Bytes: "ab" 0..2, "cd" 3..5, "ef" 6..8, "gh" 9..11.
        let text = "ab cd ef gh";
        // 1..5 straddles "ab": only "cd" is inside; 9..11 covers "gh" exactly.
        let row = example_from_spans(&tok, text, &[1..5, 9..11], false, true).unwrap();
        assert_eq!(row.input_ids, vec![1, w("ab"), w("cd"), w("ef"), w("gh")]);
        assert_eq!(row.labels, vec![-100, -100, w("cd"), -100, w("gh")]);
        // Whitespace around a word does not matter; an empty span holds nothing.
        let row = example_from_spans(&tok, text, &[5..9, 2..2], false, false).unwrap();
        assert_eq!(row.labels, vec![-100, -100, w("ef"), -100]);
        // train_on_prompt: everything but BOS.
        let row = example_from_spans(&tok, text, &[], true, true).unwrap();
        assert_eq!(row.labels, vec![-100, w("ab"), w("cd"), w("ef"), w("gh")]);
        // No BOS in the tokenizer: add_bos adds nothing.
        let tok = WordTokenizer { bos: None, eos: Some(2), add_bos: false };
        let all = 0..11;
        let row = example_from_spans(&tok, text, &[all], false, true).unwrap();
        assert_eq!(row.labels, row.input_ids);
        assert_eq!(row.input_ids.len(), 4);
    }

    #[test]
    fn tokenizer_errors_propagate() {
        let tok = WordTokenizer::new();
        let err = example_from_spans(&tok, "a !fail", &[], false, true).unwrap_err();
        assert!(err.to_string().contains("cannot encode"), "{err}");
    }

    #[test]
    #[should_panic(expected = "not a byte range")]
    fn span_outside_text_panics() {
        let tok = WordTokenizer::new();
        let past_the_end = 1..3;
        let _ = example_from_spans(&tok, "ab", &[past_the_end], false, true);
    }
}
