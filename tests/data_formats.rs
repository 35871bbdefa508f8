//! The text-based dataset formats end to end: which tokens carry loss (position by position,
//! with a byte-level test tokenizer), packing, the on_error policy, shuffling and the eval split.

use std::io::Write;
use std::ops::Range;

use anyhow::{Result, bail};
use horizon::data::{
    IGNORE_INDEX, LoadReport, OnError, Row, RowStore, Source, alpaca_prompt, example_from_spans,
    load_pretokenized, make_batch, pack, shuffled_order, split_eval,
};
use horizon::tokenizer::Tokenizer;

/// The loaders stream their rows to a spill file; these read them back, for comparison.
fn all_rows(got: Result<(RowStore, LoadReport)>) -> Result<(Vec<Row>, LoadReport)> {
    got.map(|(store, report)| (store.to_rows().unwrap(), report))
}

fn load_alpaca(
    src: &Source,
    tok: &dyn Tokenizer,
    max: usize,
    on_prompt: bool,
    on_error: OnError,
) -> Result<(Vec<Row>, LoadReport)> {
    all_rows(horizon::data::load_alpaca(src, tok, max, on_prompt, on_error))
}

fn load_chat(
    src: &Source,
    tok: &dyn Tokenizer,
    max: usize,
    on_prompt: bool,
    on_error: OnError,
) -> Result<(Vec<Row>, LoadReport)> {
    all_rows(horizon::data::load_chat(src, tok, max, on_prompt, on_error))
}

fn load_sharegpt(
    src: &Source,
    tok: &dyn Tokenizer,
    max: usize,
    on_prompt: bool,
    on_error: OnError,
) -> Result<(Vec<Row>, LoadReport)> {
    all_rows(horizon::data::load_sharegpt(src, tok, max, on_prompt, on_error))
}

fn load_text(
    src: &Source,
    tok: &dyn Tokenizer,
    max: usize,
    on_error: OnError,
) -> Result<(Vec<Row>, LoadReport)> {
    all_rows(horizon::data::load_text(src, tok, max, on_error))
}

fn load_pretokenized_rows(
    src: &Source,
    max: usize,
    vocab: usize,
    on_error: OnError,
) -> Result<(Vec<Row>, LoadReport)> {
    all_rows(horizon::data::load_pretokenized_rows(src, max, vocab, on_error))
}

/// One token per byte: id = byte + 3; PAD = 0, BOS = 1, EOS = 2 (BOS and EOS optional).
struct Bytes {
    bos: Option<u32>,
    eos: Option<u32>,
}

const BYTES: Bytes = Bytes { bos: Some(1), eos: Some(2) };
const BOS: i32 = 1;
const EOS: i32 = 2;
const NO: i32 = IGNORE_INDEX;

impl Tokenizer for Bytes {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode_with_offsets(text)?.0)
    }

    fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<Range<usize>>)> {
        let ids = text.bytes().map(|b| u32::from(b) + 3).collect();
        Ok((ids, (0..text.len()).map(|i| i..i + 1).collect()))
    }

    fn decode(&self, ids: &[u32], _skip_special: bool) -> Result<String> {
        let bytes: Vec<u8> = ids.iter().filter(|&&i| i >= 3).map(|&i| (i - 3) as u8).collect();
        match String::from_utf8(bytes) {
            Ok(s) => Ok(s),
            Err(e) => bail!("{e}"),
        }
    }

    fn vocab_size(&self) -> usize {
        259
    }

    fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    fn pad_id(&self) -> Option<u32> {
        Some(0)
    }

    fn token_to_id(&self, _token: &str) -> Option<u32> {
        None
    }
}

/// The ids of `s` under [`Bytes`].
fn ids(s: &str) -> Vec<i32> {
    s.bytes().map(|b| i32::from(b) + 3).collect()
}

fn write(content: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(content.as_bytes()).unwrap();
    f
}

/// `(ids, labels)` of `[BOS] prompt output EOS` as the alpaca format should build it.
fn alpaca_want(prompt: &str, output: &str, train_on_prompt: bool) -> (Vec<i32>, Vec<i32>) {
    let input_ids = [vec![BOS], ids(prompt), ids(output), vec![EOS]].concat();
    let prompt_labels = if train_on_prompt { ids(prompt) } else { vec![NO; prompt.len()] };
    let labels = [vec![NO], prompt_labels, ids(output), vec![EOS]].concat();
    (input_ids, labels)
}

const ALPACA: &str = r#"{"instruction": "Sum the numbers.", "input": "2 3", "output": "5"}

{"instruction": "Say hi.", "output": "Hi!"}
{"instruction": "Say hi.", "input": "", "output": "Hey."}
"#;

#[test]
fn alpaca_loss_only_on_the_response() {
    let f = write(ALPACA);
    let with_input = alpaca_prompt("Sum the numbers.", Some("2 3"));
    assert!(with_input.contains("paired with an input") && with_input.contains("### Input:\n2 3"));
    let without = alpaca_prompt("Say hi.", None);
    assert!(!without.contains("Input"));
    for train_on_prompt in [false, true] {
        let (rows, report) =
            load_alpaca(&f.path().into(), &BYTES, 1024, train_on_prompt, OnError::Fail).unwrap();
        assert_eq!(report, LoadReport { rows: 3, records: 3, ..Default::default() });
        let want = [
            alpaca_want(&with_input, "5", train_on_prompt),
            alpaca_want(&without, "Hi!", train_on_prompt),
            alpaca_want(&without, "Hey.", train_on_prompt),
        ];
        for (k, (row, (input_ids, labels))) in rows.iter().zip(&want).enumerate() {
            assert_eq!(&row.input_ids, input_ids, "row {k}");
            assert_eq!(&row.labels, labels, "row {k}, train_on_prompt = {train_on_prompt}");
        }
    }
    // The batch targets: exactly the response and EOS, predicted from the position before.
    let (rows, _) = load_alpaca(&f.path().into(), &BYTES, 1024, false, OnError::Fail).unwrap();
    let batch = make_batch(&[&rows[1]]);
    let t = rows[1].input_ids.len();
    let n_prompt = 1 + without.len();
    let mut want = vec![NO; t];
    want[n_prompt - 1..t - 1].copy_from_slice(&[ids("Hi!"), vec![EOS]].concat());
    assert_eq!(batch.targets, want);
    assert_eq!(batch.num_targets, 4);
}

#[test]
fn alpaca_without_bos_and_truncation() {
    let f = write(ALPACA);
    let tok = Bytes { bos: None, eos: Some(2) };
    let (rows, _) = load_alpaca(&f.path().into(), &tok, 1024, false, OnError::Fail).unwrap();
    let prompt = alpaca_prompt("Say hi.", None);
    assert_eq!(rows[1].input_ids, [ids(&prompt), ids("Hi!"), vec![EOS]].concat());
    assert_eq!(rows[1].labels, [vec![NO; prompt.len()], ids("Hi!"), vec![EOS]].concat());

    // Room for BOS, the short prompt and two response bytes: rows 1 and 2 are cut (losing EOS),
    // row 0's longer prompt does not fit and is skipped under either policy.
    let max = 1 + prompt.len() + 2;
    for on_error in [OnError::Fail, OnError::Skip] {
        let (rows, report) = load_alpaca(&f.path().into(), &BYTES, max, false, on_error).unwrap();
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| r.input_ids.len() == max));
        assert_eq!(rows[0].labels[1 + prompt.len()..], ids("Hi"));
        assert_eq!(rows[1].labels[1 + prompt.len()..], ids("He"));
        assert_eq!(report.truncated, 2);
        assert_eq!(report.skipped.len(), 1);
        assert_eq!(report.skipped[0].0.line(), Some(1));
        assert!(report.skipped[0].1.contains("prompt"), "{:?}", report.skipped);
    }
}

#[test]
fn text_windows_and_eos() {
    let f = write("{\"text\": \"abc\"}\n{\"text\": \"de\"}\n\n{\"text\": \"fghij\"}\n");
    // Stream: a b c EOS d e EOS f g h i j EOS = 13 tokens -> 5, 5, 3.
    let stream = [ids("abc"), vec![EOS], ids("de"), vec![EOS], ids("fghij"), vec![EOS]].concat();
    let (rows, report) = load_text(&f.path().into(), &BYTES, 5, OnError::Fail).unwrap();
    assert_eq!(report, LoadReport { rows: 3, records: 3, ..Default::default() });
    let got: Vec<i32> = rows.iter().flat_map(|r| r.input_ids.clone()).collect();
    assert_eq!(got, stream);
    for row in &rows {
        assert!(row.input_ids.len() <= 5);
        assert_eq!(row.labels, row.input_ids, "every token carries loss");
    }
    assert_eq!(rows[2].input_ids, [ids("ij"), vec![EOS]].concat());
    // 13 tokens in windows of 6: the last single token is dropped.
    let (rows, _) = load_text(&f.path().into(), &BYTES, 6, OnError::Fail).unwrap();
    assert_eq!(rows.iter().map(|r| r.input_ids.len()).collect::<Vec<_>>(), vec![6, 6]);
    // No BOS is added even though the tokenizer has one; no EOS is an error.
    assert!(rows.iter().all(|r| !r.input_ids.contains(&BOS)));
    let err = load_text(&f.path().into(), &Bytes { bos: Some(1), eos: None }, 5, OnError::Fail);
    assert!(err.unwrap_err().to_string().contains("no EOS"));
}

/// Lines 2 (malformed JSON), 4 (missing field), 5 (wrong type) and 6 (not an object) are bad;
/// line 3 is blank.
const TEXT_WITH_ERRORS: &str = "{\"text\": \"ok\"}\n{\"text\": \"unterminated}\n\n\
                                {\"txt\": \"typo\"}\n{\"text\": 42}\n\"just a string\"\n\
                                {\"text\": \"fine\"}\n";

#[test]
fn on_error_fail_names_the_first_bad_line() {
    let f = write(TEXT_WITH_ERRORS);
    let err = load_text(&f.path().into(), &BYTES, 8, OnError::Fail).unwrap_err();
    let err = format!("{err:#}");
    let prefix = format!("{}:2: malformed JSON", f.path().display());
    assert!(err.starts_with(&prefix), "{err}");
    assert!(!err.contains('\n'), "{err:?}");

    // The missing field and the wrong type, each first in its file.
    let f = write("{\"text\": \"ok\"}\n\n{\"txt\": \"typo\"}\n");
    let err = load_text(&f.path().into(), &BYTES, 8, OnError::Fail).unwrap_err().to_string();
    assert_eq!(err, format!("{}:3: missing field \"text\"", f.path().display()));
    let f = write("{\"text\": [\"a\"]}\n");
    let err =
        load_alpaca(&f.path().into(), &BYTES, 8, false, OnError::Fail).unwrap_err().to_string();
    assert_eq!(err, format!("{}:1: missing field \"instruction\"", f.path().display()));
    let f = write("{\"instruction\": \"x\", \"output\": {}}\n");
    let err =
        load_alpaca(&f.path().into(), &BYTES, 512, false, OnError::Fail).unwrap_err().to_string();
    let want = "1: field \"output\" is an object, expected a string";
    assert_eq!(err, format!("{}:{want}", f.path().display()));
}

#[test]
fn on_error_skip_counts_and_keeps_line_numbers() {
    let f = write(TEXT_WITH_ERRORS);
    let (rows, report) = load_text(&f.path().into(), &BYTES, 64, OnError::Skip).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].input_ids, [ids("ok"), vec![EOS], ids("fine"), vec![EOS]].concat());
    assert_eq!(report.records, 2);
    let lines: Vec<Option<usize>> = report.skipped.iter().map(|(l, _)| l.line()).collect();
    assert_eq!(lines, [2, 4, 5, 6].map(Some));
    assert!(report.skipped[0].1.starts_with("malformed JSON"));
    assert_eq!(report.skipped[1].1, "missing field \"text\"");
    assert_eq!(report.skipped[2].1, "field \"text\" is a number, expected a string");
    assert_eq!(report.skipped[3].1, "record is a string, expected a JSON object");
    let first = format!("1 rows from 2 records, 4 skipped (first: {}:2:", f.path().display());
    assert!(report.summary().starts_with(&first), "{}", report.summary());
}

#[test]
fn empty_result_names_the_file() {
    for content in ["", "\n \n", "{\"x\": 1}\n"] {
        let f = write(content);
        let file = f.path().display().to_string();
        let err = load_text(&f.path().into(), &BYTES, 8, OnError::Skip).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{file}: no rows")), "{err}");
        let err =
            load_alpaca(&f.path().into(), &BYTES, 8, false, OnError::Skip).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{file}: no rows")), "{err}");
    }
}

#[test]
fn spans_carry_exactly_their_bytes() {
    let text = "<u>hi</u><a>yo</a><u>ok</u><a>no</a>";
    let spans = [12..14, 30..32];
    let row = example_from_spans(&BYTES, text, &spans, false, true).unwrap();
    assert_eq!(row.input_ids, [vec![BOS], ids(text)].concat());
    let mut want = vec![NO; 1 + text.len()];
    for s in &spans {
        for b in s.clone() {
            want[1 + b] = i32::from(text.as_bytes()[b]) + 3;
        }
    }
    assert_eq!(row.labels, want);
    assert_eq!(&text[12..14], "yo");
    let row = example_from_spans(&BYTES, text, &spans, true, true).unwrap();
    assert_eq!(row.labels, [vec![NO], ids(text)].concat());
}

#[test]
fn packing_masks_boundaries_and_keeps_every_token() {
    let f = write(ALPACA);
    let (rows, _) = load_alpaca(&f.path().into(), &BYTES, 1024, false, OnError::Fail).unwrap();
    let lens: Vec<usize> = rows.iter().map(|r| r.input_ids.len()).collect();
    // Room for the two short examples together but not with the long one.
    let max = lens[1] + lens[2];
    assert!(lens[0] + lens[1] > max);
    let packed = pack(rows.clone(), max);
    assert_eq!(packed.len(), 2);
    assert_eq!(packed[0], rows[0].clone());
    let mut second = rows[2].clone();
    second.labels[0] = NO;
    let want = Row {
        input_ids: [rows[1].input_ids.clone(), rows[2].input_ids.clone()].concat(),
        labels: [rows[1].labels.clone(), second.labels].concat(),
    };
    assert_eq!(packed[1], want);
    // The boundary: the last token of example 1 (EOS) does not learn to predict example 2's BOS.
    let batch = make_batch(&[&packed[1]]);
    assert_eq!(batch.targets[lens[1] - 2], EOS);
    assert_eq!(batch.targets[lens[1] - 1], NO);
    let single = |r: &Row| make_batch(&[r]).num_targets;
    assert_eq!(batch.num_targets, single(&rows[1]) + single(&rows[2]));
}

#[test]
fn packing_many_examples() {
    // Examples of lengths 1..=9 with distinct ids, every token carrying loss.
    let mut next = 3;
    let rows: Vec<Row> = (0..60)
        .map(|k: i32| {
            let len = 1 + (k * 7) % 9;
            let ids: Vec<i32> = (next..next + len).collect();
            next += len;
            Row { input_ids: ids.clone(), labels: ids }
        })
        .collect();
    let max = 12;
    let packed = pack(rows.clone(), max);
    assert!(packed.iter().all(|r| r.input_ids.len() <= max && r.labels.len() == r.input_ids.len()));
    let total: usize = packed.iter().map(|r| r.input_ids.len()).sum();
    assert_eq!(total, rows.iter().map(|r| r.input_ids.len()).sum::<usize>());
    // Each example appears once, whole and contiguous, with only its first label masked.
    for (k, ex) in rows.iter().enumerate() {
        let first = ex.input_ids[0];
        let (r, p) = packed
            .iter()
            .enumerate()
            .find_map(|(r, row)| row.input_ids.iter().position(|&x| x == first).map(|p| (r, p)))
            .unwrap_or_else(|| panic!("example {k} lost"));
        let n = ex.input_ids.len();
        assert_eq!(packed[r].input_ids[p..p + n], ex.input_ids, "example {k}");
        assert_eq!(packed[r].labels[p], NO, "example {k}");
        assert_eq!(packed[r].labels[p + 1..p + n], ex.input_ids[1..], "example {k}");
    }
    let masked: usize = packed.iter().flat_map(|r| &r.labels).filter(|&&l| l == NO).count();
    assert_eq!(masked, rows.len());
    // First fit leaves fewer rows than one per example.
    assert!(packed.len() < rows.len() / 2, "{} rows", packed.len());
}

#[test]
fn shuffling_is_reproducible() {
    let a = shuffled_order(1000, 1234, 3);
    assert_eq!(a, shuffled_order(1000, 1234, 3));
    assert_ne!(a, shuffled_order(1000, 1234, 4));
    assert_ne!(a, shuffled_order(1000, 4321, 3));
    let mut sorted = a.clone();
    sorted.sort();
    assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    // A fixed value, so that a change of the generator (and of every run's data order) is seen.
    assert_eq!(shuffled_order(6, 0, 0), SHUFFLE_6_0_0);
}

/// `shuffled_order(6, 0, 0)` as first computed.
const SHUFFLE_6_0_0: [usize; 6] = [2, 1, 5, 4, 0, 3];

#[test]
fn eval_split_is_deterministic_and_disjoint() {
    let rows: Vec<Row> =
        (0..40).map(|i| Row { input_ids: vec![i, i + 1], labels: vec![i, i + 1] }).collect();
    let (train, eval) = split_eval(rows.clone(), 0.25, 11);
    assert_eq!((train.len(), eval.len()), (30, 10));
    assert_eq!(split_eval(rows.clone(), 0.25, 11), (train.clone(), eval.clone()));
    assert_ne!(split_eval(rows.clone(), 0.25, 12).1, eval);
    let key = |r: &Row| r.input_ids[0];
    let mut all: Vec<i32> = train.iter().chain(&eval).map(key).collect();
    all.sort();
    assert_eq!(all, (0..40).collect::<Vec<_>>(), "disjoint and complete");
    let (train, eval) = split_eval(rows[..2].to_vec(), 0.01, 11);
    assert_eq!((train.len(), eval.len()), (1, 1));
    let (train, eval) = split_eval(rows[..2].to_vec(), 0.0, 11);
    assert_eq!((train.len(), eval.len()), (2, 0));
}

#[test]
fn byte_order_mark_crlf_and_blank_lines_are_accepted() {
    // As a Windows editor saves it: a UTF-8 byte-order mark, CRLF line ends, blank lines.
    let plain = ALPACA.replace("\r\n", "\n");
    let windows = format!("\u{feff}{}", plain.replace('\n', "\r\n"));
    let (a, b) = (write(&plain), write(&windows));
    let load = |f: &tempfile::NamedTempFile| {
        load_alpaca(&f.path().into(), &BYTES, 1024, false, OnError::Fail).unwrap()
    };
    assert_eq!(load(&b), load(&a));
    let f = write("\u{feff}{\"text\": \"abc\"}\r\n");
    let (rows, _) = load_text(&f.path().into(), &BYTES, 8, OnError::Fail).unwrap();
    assert_eq!(rows[0].input_ids, [ids("abc"), vec![EOS]].concat());
    let f = write("\u{feff}{\"input_ids\": [5, 6]}\r\n");
    assert_eq!(load_pretokenized(f.path(), 8, 100).unwrap().row(0).unwrap().input_ids, [5, 6]);
    // Elsewhere than at the very start, it is an error naming the line.
    let f = write("{\"text\": \"abc\"}\n\u{feff}{\"text\": \"d\"}\n");
    let err = load_text(&f.path().into(), &BYTES, 8, OnError::Fail).unwrap_err().to_string();
    assert!(err.starts_with(&format!("{}:2: malformed JSON", f.path().display())), "{err}");
}

#[test]
fn no_loss_position_is_refused_naming_file_and_rows() {
    // Every label -100, or only the first one set (nothing predicts position 0).
    let f = write(
        "{\"input_ids\": [5, 6, 7], \"labels\": [-100, -100, -100]}\n\n\
         {\"input_ids\": [8, 9], \"labels\": [8, -100]}\n",
    );
    let err = load_pretokenized(f.path(), 8, 100).unwrap_err().to_string();
    let file = f.path().display();
    assert!(
        err.starts_with(&format!(
            "{file}: no position carries a loss in any of its 2 rows: {file}:1, {file}:3\nhint:"
        )),
        "{err}"
    );
    // Chat examples cut at max_seq_len before their assistant turn.
    let tok = horizon::tokenizer::ByteTokenizer::new();
    let long = "x".repeat(64);
    let f = write(&format!(
        "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{long}\"}}, {{\"role\": \"assistant\", \"content\": \"ok\"}}]}}\n"
    ));
    let err = load_chat(&f.path().into(), &tok, 32, false, OnError::Fail).unwrap_err().to_string();
    let want = format!(
        "{}: no position carries a loss in its one row: {}:1",
        f.path().display(),
        f.path().display()
    );
    assert!(err.starts_with(&want), "{err}");
    // Some rows without loss are kept and counted.
    let f = write("{\"input_ids\": [5, 6], \"labels\": [-100, -100]}\n{\"input_ids\": [7, 8]}\n");
    let (rows, report) = load_pretokenized_rows(&f.path().into(), 8, 100, OnError::Fail).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(report.no_loss.iter().map(|l| l.line()).collect::<Vec<_>>(), [Some(1)]);
    assert!(report.summary().ends_with(&format!(
        "1 without a loss position (first: {file}:1)",
        file = f.path().display()
    )));
}

#[test]
fn sharegpt_roles_map_to_chat_roles() {
    let tok = horizon::tokenizer::ByteTokenizer::new();
    let chat = write(
        "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": \"u\"}, {\"role\": \"assistant\", \"content\": \"a\"}]}\n",
    );
    let share = write(
        "{\"conversations\": [{\"from\": \"system\", \"value\": \"s\"}, {\"from\": \"user\", \"value\": \"u\"}, {\"from\": \"assistant\", \"value\": \"a\"}]}\n\
         {\"conversations\": [{\"from\": \"human\", \"value\": \"u\"}, {\"from\": \"gpt\", \"value\": \"a\"}, {\"from\": \"narrator\", \"value\": \"?\"}]}\n",
    );
    let want = load_chat(&chat.path().into(), &tok, 512, false, OnError::Fail).unwrap().0;
    let (rows, report) =
        load_sharegpt(&share.path().into(), &tok, 512, false, OnError::Skip).unwrap();
    assert_eq!(rows, want);
    assert_eq!(report.skipped.len(), 1);
    let err = load_sharegpt(&share.path().into(), &tok, 512, false, OnError::Fail).unwrap_err();
    let want =
        format!("{}:2: conversations[2]: unknown \"from\" \"narrator\"", share.path().display());
    assert!(err.to_string().starts_with(&want), "{err}");
}
