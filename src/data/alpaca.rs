//! The `alpaca` dataset format: JSONL records `{"instruction": ..., "input"?: ..., "output": ...}`
//! for instruction tuning.
//!
//! Each record becomes one row: `[BOS] prompt output EOS`, the prompt rendered with the Stanford
//! Alpaca template ([`alpaca_prompt`]) and tokenized together with the output. Loss is carried by
//! the output tokens and EOS only, or by every token but BOS with `train_on_prompt`. Masking is
//! [`example_from_spans`](super::records::example_from_spans)'s: the loss span is the output's
//! byte range, so a token straddling the prompt/output boundary carries no loss.

use anyhow::Result;

use super::pretokenized::Row;
use super::records::{
    LoadReport, OnError, Outcome, carries_loss, check_max_seq_len, encode_spans, finish_load,
    masked_labels, opt_str_field, require_eos, str_field,
};
use super::source::{Fields, JsonObject, Loc, Source, read_records_into};
use super::store::{RowStore, RowStoreWriter};
use crate::tokenizer::Tokenizer;

/// The Alpaca prompt for a record with an input.
const PROMPT_INPUT: &str = "Below is an instruction that describes a task, paired with an input \
                            that provides further context. Write a response that appropriately \
                            completes the request.\n\n### Instruction:\n{instruction}\n\n### \
                            Input:\n{input}\n\n### Response:\n";

/// The Alpaca prompt for a record without an input.
const PROMPT_NO_INPUT: &str = "Below is an instruction that describes a task. Write a response \
                               that appropriately completes the request.\n\n### Instruction:\n\
                               {instruction}\n\n### Response:\n";

/// The Alpaca prompt: the template with an input when `input` is present and not empty (as in
/// Stanford Alpaca), the one without otherwise. Ends with `"### Response:\n"`.
pub fn alpaca_prompt(instruction: &str, input: Option<&str>) -> String {
    match input {
        Some(input) if !input.is_empty() => {
            PROMPT_INPUT.replace("{instruction}", instruction).replace("{input}", input)
        }
        _ => PROMPT_NO_INPUT.replace("{instruction}", instruction),
    }
}

/// The fields of an alpaca record.
pub const ALPACA_FIELDS: Fields =
    Fields { required: &["instruction", "output"], optional: &["input"], nested: &[] };

/// Loads an `alpaca` dataset, one row per record (see the module doc).
///
/// A row longer than `max_seq_len` is cut from the end (its EOS is lost) and counted in
/// [`LoadReport::truncated`]; a record whose prompt alone (BOS included) leaves no room for a
/// response token is left out under either policy and listed in [`LoadReport::skipped`].
///
/// Errors: the tokenizer has no EOS, `max_seq_len < 2`, an unusable record under
/// [`OnError::Fail`] (`FILE:LINE: <what>`: malformed JSON, missing or non-string `"instruction"`
/// or `"output"`, an `"input"` that is neither a string nor null, text the tokenizer refuses), no
/// row at all, or no row that carries a loss. The field names are `src.columns`' mapping of
/// these.
pub fn load_alpaca(
    src: &Source,
    tok: &dyn Tokenizer,
    max_seq_len: usize,
    train_on_prompt: bool,
    on_error: OnError,
) -> Result<(RowStore, LoadReport)> {
    check_max_seq_len(max_seq_len)?;
    let eos = require_eos(tok, &src.path, "alpaca", "example")?;
    let mut report = LoadReport::default();
    let (mut truncated, mut no_loss) = (0, Vec::new());
    let cols = &src.columns;
    let mut out = RowStoreWriter::new()?;
    let build = |obj: &JsonObject, loc: &Loc| -> Result<Outcome<Row>> {
        let instruction = str_field(obj, cols.name("instruction"))?;
        let input = opt_str_field(obj, cols.name("input"))?;
        let output = str_field(obj, cols.name("output"))?;
        let prompt = alpaca_prompt(instruction, input);
        let text = prompt.clone() + output;
        let response = prompt.len()..text.len();
        let (mut ids, mut in_span) = encode_spans(tok, &text, &[response], true)?;
        ids.push(eos);
        in_span.push(true);
        // The prompt: every token before the first one of the output (or EOS).
        let prompt_tokens = in_span.iter().position(|&x| x).unwrap_or(in_span.len());
        if prompt_tokens >= max_seq_len {
            return Ok(Outcome::Skip(format!(
                "the prompt is {prompt_tokens} tokens, leaving no room for the response in \
                 max_seq_len = {max_seq_len}"
            )));
        }
        if ids.len() > max_seq_len {
            ids.truncate(max_seq_len);
            truncated += 1;
        }
        let labels = masked_labels(&ids, &in_span, train_on_prompt, tok.bos_id().is_some());
        let row = Row { input_ids: ids, labels };
        if !carries_loss(&row) {
            no_loss.push(loc.clone());
        }
        Ok(Outcome::Keep(row))
    };
    read_records_into(src, &ALPACA_FIELDS, on_error, &mut report, build, |r| out.push(&r))?;
    report.no_loss = no_loss;
    finish_load(src, out.finish()?, report, truncated)
}

#[cfg(test)]
mod tests {
    use super::super::records::test_tokenizer::WordTokenizer;
    use super::*;

    fn write(content: &str) -> tempfile::NamedTempFile {
        crate::data::records::test_tokenizer::write_temp(content)
    }

    fn words(text: &str) -> Vec<i32> {
        text.split_whitespace().map(|w| WordTokenizer::word_id(w) as i32).collect()
    }

    #[test]
    fn templates() {
        assert_eq!(
            alpaca_prompt("Add.", Some("1 2")),
            "Below is an instruction that describes a task, paired with an input that provides \
             further context. Write a response that appropriately completes the request.\n\n\
             ### Instruction:\nAdd.\n\n### Input:\n1 2\n\n### Response:\n"
        );
        let no_input = "Below is an instruction that describes a task. Write a response that \
                        appropriately completes the request.\n\n### Instruction:\nAdd.\n\n\
                        ### Response:\n";
        assert_eq!(alpaca_prompt("Add.", None), no_input);
        assert_eq!(alpaca_prompt("Add.", Some("")), no_input);
    }

    #[test]
    fn masks_the_prompt() {
        let f = write(
            "{\"instruction\": \"Add.\", \"input\": \"1 2\", \"output\": \"3 .\"}\n\
             {\"instruction\": \"Hi.\", \"input\": null, \"output\": \"Hello\"}\n",
        );
        let tok = WordTokenizer::new();
        for train_on_prompt in [false, true] {
            let (rows, report) =
                load_alpaca(&f.path().into(), &tok, 512, train_on_prompt, OnError::Fail).unwrap();
            let rows = rows.to_rows().unwrap();
            assert_eq!(report.rows, 2);
            for (row, (instruction, input, output)) in
                rows.iter().zip([("Add.", Some("1 2"), "3 ."), ("Hi.", None, "Hello")])
            {
                let prompt = words(&alpaca_prompt(instruction, input));
                let output = words(output);
                let mut ids = vec![1];
                ids.extend(&prompt);
                ids.extend(&output);
                ids.push(2);
                assert_eq!(row.input_ids, ids);
                let mut labels = vec![-100];
                if train_on_prompt {
                    labels.extend(&prompt);
                } else {
                    labels.extend(vec![-100; prompt.len()]);
                }
                labels.extend(&output);
                labels.push(2);
                assert_eq!(row.labels, labels, "train_on_prompt = {train_on_prompt}");
            }
        }
    }

    #[test]
    fn truncates_or_skips() {
        let tok = WordTokenizer::new();
        let prompt_tokens = 1 + words(&alpaca_prompt("Hi.", None)).len();
        let f = write(
            "{\"instruction\": \"Hi.\", \"output\": \"a b c\"}\n\
             {\"instruction\": \"Hi. Hi. Hi.\", \"output\": \"a\"}\n",
        );
        // Room for the prompt and two output tokens of the first record; the second record's
        // prompt is two tokens longer and does not fit.
        let max = prompt_tokens + 2;
        let (rows, report) =
            load_alpaca(&f.path().into(), &tok, max, false, OnError::Fail).unwrap();
        let rows = rows.to_rows().unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].input_ids.len(), max);
        assert_eq!(rows[0].labels[prompt_tokens..], words("a b"));
        assert_eq!(report.truncated, 1);
        assert_eq!(report.skipped.len(), 1);
        assert_eq!(report.skipped[0].0.line(), Some(2));
        assert!(report.skipped[0].1.contains("leaving no room for the response"));
        // A prompt that fills max_seq_len exactly does not fit either.
        let err =
            load_alpaca(&f.path().into(), &tok, prompt_tokens, false, OnError::Fail).unwrap_err();
        assert!(err.to_string().contains("all 2 records were skipped"), "{err}");
        // One token of room: the first output token only, no EOS.
        let (rows, _) =
            load_alpaca(&f.path().into(), &tok, prompt_tokens + 1, false, OnError::Fail).unwrap();
        let rows = rows.to_rows().unwrap();
        assert_eq!(*rows[0].labels.last().unwrap(), words("a")[0]);
    }

    #[test]
    fn wrong_types() {
        let tok = WordTokenizer::new();
        let f = write(
            "{\"instruction\": \"x\", \"output\": \"y\"}\n\
             {\"instruction\": \"x\", \"input\": 3, \"output\": \"y\"}\n\
             {\"instruction\": \"x\"}\n",
        );
        let err = load_alpaca(&f.path().into(), &tok, 512, false, OnError::Fail).unwrap_err();
        let want =
            format!("{}:2: field \"input\" is a number, expected a string", f.path().display());
        assert_eq!(err.to_string(), want);
        let (rows, report) =
            load_alpaca(&f.path().into(), &tok, 512, false, OnError::Skip).unwrap();
        let rows = rows.to_rows().unwrap();
        assert_eq!(rows.len(), 1);
        let skipped: Vec<_> = report.skipped.iter().map(|(l, r)| (l.line(), r.as_str())).collect();
        assert_eq!(
            skipped,
            [
                (Some(2), "field \"input\" is a number, expected a string"),
                (Some(3), "missing field \"output\"")
            ]
        );
    }

    #[test]
    fn without_bos() {
        let f = write("{\"instruction\": \"x\", \"output\": \"y\"}\n");
        let tok = WordTokenizer { bos: None, eos: Some(2), add_bos: false };
        let (rows, _) = load_alpaca(&f.path().into(), &tok, 512, false, OnError::Fail).unwrap();
        let rows = rows.to_rows().unwrap();
        let prompt = words(&alpaca_prompt("x", None));
        assert_eq!(rows[0].input_ids[..prompt.len()], prompt);
        assert_eq!(rows[0].input_ids.len(), prompt.len() + 2);
        assert_eq!(rows[0].labels[prompt.len()..], [words("y")[0], 2]);
    }
}
