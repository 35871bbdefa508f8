//! The `text` dataset format: JSONL records `{"text": "..."}` for plain language modelling.
//!
//! Every record is tokenized (no special tokens added by the tokenizer), preceded by BOS when
//! the tokenizer says plain-text documents start with one ([`Tokenizer::add_bos_token`]: Llama,
//! Mistral; not GPT-2, Qwen2 or the byte tokenizer), and followed by EOS; the records are
//! concatenated in file order into one token stream, which is cut into consecutive windows of
//! `max_seq_len` tokens. Every token carries loss (labels = input_ids). The last, partial window
//! is kept if it holds at least 2 tokens (one target); a single leftover token is dropped. As in
//! Hugging Face's `group_texts`, windows do not overlap, so the first token of each window is
//! never predicted.

use anyhow::{Result, bail};

use super::pretokenized::Row;
use super::records::{
    LoadReport, OnError, Outcome, check_max_seq_len, no_rows_error, require_eos, str_field,
    token_i32,
};
use super::source::{Fields, JsonObject, Loc, Source, read_records_into};
use super::store::{RowStore, RowStoreWriter};
use crate::tokenizer::Tokenizer;

/// The fields of a text record.
pub const TEXT_FIELDS: Fields = Fields { required: &["text"], optional: &[], nested: &[] };

/// Loads a `text` dataset into rows of at most `max_seq_len` tokens (see the module doc).
///
/// Errors: the tokenizer has no EOS, `max_seq_len < 2`, an unusable record under
/// [`OnError::Fail`] (`FILE:LINE: <what>`: malformed JSON, missing or non-string `"text"`, text
/// the tokenizer refuses), or no row at all.
pub fn load_text(
    src: &Source,
    tok: &dyn Tokenizer,
    max_seq_len: usize,
    on_error: OnError,
) -> Result<(RowStore, LoadReport)> {
    check_max_seq_len(max_seq_len)?;
    let path = &src.path;
    let eos = require_eos(tok, path, "text", "record")?;
    let bos = match tok.bos_id() {
        Some(bos) if tok.add_bos_token() => Some(token_i32(bos)?),
        _ => None,
    };
    let mut report = LoadReport::default();
    let key = src.columns.name("text");
    let build = |obj: &JsonObject, _: &Loc| -> Result<Outcome<Vec<i32>>> {
        let text = str_field(obj, key)?;
        let mut ids: Vec<i32> = bos.into_iter().collect();
        for id in tok.encode(text)? {
            ids.push(token_i32(id)?);
        }
        ids.push(eos);
        Ok(Outcome::Keep(ids))
    };
    let mut windows = Windows::new(max_seq_len)?;
    read_records_into(src, &TEXT_FIELDS, on_error, &mut report, build, |d| windows.add(&d))?;
    let (rows, tokens) = windows.finish()?;
    if rows.is_empty() {
        if report.records > 0 {
            bail!(
                "{}: no rows: the text is {tokens} token long, a row needs at least 2",
                path.display(),
            );
        }
        return Err(no_rows_error(path, &report));
    }
    report.rows = rows.len();
    Ok((rows, report))
}

/// The token stream cut into consecutive windows of `max_seq_len` tokens as documents arrive,
/// the last one kept if it has at least 2 tokens; labels = input_ids. Holds one window.
struct Windows {
    out: RowStoreWriter,
    row: Row,
    max_seq_len: usize,
    tokens: usize,
}

impl Windows {
    fn new(max_seq_len: usize) -> Result<Windows> {
        let row = Row { input_ids: Vec::new(), labels: Vec::new() };
        Ok(Windows { out: RowStoreWriter::new()?, row, max_seq_len, tokens: 0 })
    }

    fn add(&mut self, doc: &[i32]) -> Result<()> {
        self.tokens += doc.len();
        for &id in doc {
            self.row.input_ids.push(id);
            if self.row.input_ids.len() == self.max_seq_len {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        self.row.labels.clone_from(&self.row.input_ids);
        self.out.push(&self.row)?;
        self.row.input_ids.clear();
        Ok(())
    }

    /// The windows, and the stream's length in tokens.
    fn finish(mut self) -> Result<(RowStore, usize)> {
        if self.row.input_ids.len() >= 2 {
            self.flush()?;
        }
        Ok((self.out.finish()?, self.tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::super::records::test_tokenizer::WordTokenizer;
    use super::*;

    fn write(content: &str) -> tempfile::NamedTempFile {
        crate::data::records::test_tokenizer::write_temp(content)
    }

    fn w(word: &str) -> i32 {
        WordTokenizer::word_id(word) as i32
    }

    #[test]
    fn windows_over_the_stream() {
        let f = write("{\"text\": \"a b c\"}\n\n{\"text\": \"d\"}\n{\"text\": \"e f\"}\n");
        let tok = WordTokenizer::new();
        let (rows, report) = load_text(&f.path().into(), &tok, 4, OnError::Fail).unwrap();
        let rows = rows.to_rows().unwrap();
        // Stream: a b c EOS d EOS e f EOS (9 tokens) -> 4 + 4 + 1 (dropped).
        let want = [vec![w("a"), w("b"), w("c"), 2], vec![w("d"), 2, w("e"), w("f")]];
        assert_eq!(rows.len(), 2);
        for (row, want) in rows.iter().zip(&want) {
            assert_eq!(&row.input_ids, want);
            assert_eq!(&row.labels, want);
        }
        assert_eq!(report, LoadReport { rows: 2, records: 3, ..Default::default() });
        // With 5 tokens per window the last window (4 tokens) is kept.
        let (rows, _) = load_text(&f.path().into(), &tok, 5, OnError::Fail).unwrap();
        let rows = rows.to_rows().unwrap();
        assert_eq!(rows[1].input_ids, vec![2, w("e"), w("f"), 2]);
    }

    #[test]
    fn empty_text_is_eos_alone() {
        let f = write("{\"text\": \"\"}\n{\"text\": \"\"}\n");
        let (rows, _) =
            load_text(&f.path().into(), &WordTokenizer::new(), 8, OnError::Fail).unwrap();
        let rows = rows.to_rows().unwrap();
        assert_eq!(rows, vec![Row { input_ids: vec![2, 2], labels: vec![2, 2] }]);
    }

    #[test]
    fn bos_when_documents_start_with_it() {
        let f = write("{\"text\": \"a b\"}\n{\"text\": \"c\"}\n");
        let tok = WordTokenizer { add_bos: true, ..WordTokenizer::new() };
        let (rows, _) = load_text(&f.path().into(), &tok, 16, OnError::Fail).unwrap();
        let rows = rows.to_rows().unwrap();
        let want = vec![1, w("a"), w("b"), 2, 1, w("c"), 2];
        assert_eq!(rows, vec![Row { input_ids: want.clone(), labels: want }]);
        // Without a BOS token there is nothing to add.
        let tok = WordTokenizer { add_bos: true, bos: None, eos: Some(2) };
        let (rows, _) = load_text(&f.path().into(), &tok, 16, OnError::Fail).unwrap();
        let rows = rows.to_rows().unwrap();
        assert_eq!(rows[0].input_ids, vec![w("a"), w("b"), 2, w("c"), 2]);
    }

    #[test]
    fn needs_eos() {
        let f = write("{\"text\": \"a\"}\n");
        let tok = WordTokenizer { bos: Some(1), eos: None, add_bos: false };
        let err = load_text(&f.path().into(), &tok, 8, OnError::Fail).unwrap_err().to_string();
        assert!(err.contains("no EOS"), "{err}");
    }

    #[test]
    fn too_short_for_a_row() {
        let f = write("{\"text\": \"\"}\n");
        let err = load_text(&f.path().into(), &WordTokenizer::new(), 8, OnError::Fail).unwrap_err();
        let err = err.to_string();
        assert!(err.starts_with(&format!("{}: no rows", f.path().display())), "{err}");
    }

    #[test]
    fn all_skipped_or_empty() {
        let tok = WordTokenizer::new();
        let f = write("{\"txt\": \"a\"}\n");
        let err = load_text(&f.path().into(), &tok, 8, OnError::Skip).unwrap_err().to_string();
        let first =
            format!("all 1 records were skipped (first: {}:1: missing field", f.path().display());
        assert!(err.contains(&first), "{err}");
        let f = write("\n\n");
        let err = load_text(&f.path().into(), &tok, 8, OnError::Skip).unwrap_err().to_string();
        assert!(err.contains("empty or holds only blank lines"), "{err}");
    }

    #[test]
    fn tokenizer_error_follows_the_policy() {
        let tok = WordTokenizer::new();
        let f = write("{\"text\": \"a b\"}\n{\"text\": \"x !fail\"}\n{\"text\": \"c\"}\n");
        let err = load_text(&f.path().into(), &tok, 8, OnError::Fail).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}:2: cannot encode", f.path().display())), "{err}");
        let (rows, report) = load_text(&f.path().into(), &tok, 8, OnError::Skip).unwrap();
        let rows = rows.to_rows().unwrap();
        assert_eq!(rows[0].input_ids, vec![w("a"), w("b"), 2, w("c"), 2]);
        assert_eq!(report.skipped.len(), 1);
        assert_eq!(report.skipped[0].0.line(), Some(2));
    }

    #[test]
    fn max_seq_len_below_two() {
        let f = write("{\"text\": \"a b c\"}\n");
        assert!(load_text(&f.path().into(), &WordTokenizer::new(), 1, OnError::Fail).is_err());
    }
}
