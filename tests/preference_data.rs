//! The `preference` format (`horizon::data::preference`) against TRL 1.16's tokenization: the
//! conversational rows of `fixtures/dpo/dpo_qwen2_lora` give exactly the ids TRL gave
//! (`data.jsonl`), the pretokenized rows of `dpo_llama_full` load as written, standard text and
//! implicit prompts give hand-computed ids (EOS once, BOS per the tokenizer, the common-prefix
//! split, a token straddling the boundary), truncation keeps the start and drops prompts that
//! reach `max_length`, bad records are clean errors, and Parquet gives the JSONL rows.

mod parquet_writer;

use std::fs;
use std::path::{Path, PathBuf};

use horizon::data::preference::PreferenceReport;
use horizon::data::{Columns, OnError, Row, RowStore, Source, load_preference};
use horizon::tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer};
use parquet_writer::{Col, write};
use serde_json::{Map, Value, json};

const IGNORE: i32 = -100;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dpo").join(case)
}

/// The fixture tokenizer: byte-level BPE, 300 ids, EOS `<|im_end|>` = 2, no BOS, ChatML.
fn qwen_tok() -> HfTokenizer {
    HfTokenizer::from_dir(&fixture("dpo_qwen2_lora/model")).unwrap()
}

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

fn jsonl(path: &Path, records: &[Value]) {
    let text: String = records.iter().map(|r| r.to_string() + "\n").collect();
    fs::write(path, text).unwrap();
}

fn load(
    path: &Path,
    tok: Option<&dyn Tokenizer>,
    max_length: usize,
) -> anyhow::Result<(Vec<Row>, PreferenceReport)> {
    let (rows, rep) = load_preference(&path.into(), tok, max_length, OnError::Fail)?;
    Ok((rows.to_rows()?, rep))
}

/// Records in a temporary JSONL file, loaded.
fn load_records(
    records: &[Value],
    tok: Option<&dyn Tokenizer>,
    max_length: usize,
) -> anyhow::Result<(Vec<Row>, PreferenceReport)> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pref.jsonl");
    jsonl(&path, records);
    load(&path, tok, max_length)
}

/// The one pair of `records`' single row pair as (prompt, chosen, rejected) ids, checking the
/// two rows agree on the prompt and mask exactly it.
fn split_rows(rows: &[Row]) -> Vec<[Vec<i32>; 3]> {
    rows.chunks(2)
        .map(|pair| {
            let parts: Vec<(Vec<i32>, Vec<i32>)> = pair
                .iter()
                .map(|r| {
                    assert_eq!(r.input_ids.len(), r.labels.len());
                    let n = r.labels.iter().take_while(|&&l| l == IGNORE).count();
                    assert_eq!(r.labels[n..], r.input_ids[n..], "completion labels are the ids");
                    (r.input_ids[..n].to_vec(), r.input_ids[n..].to_vec())
                })
                .collect();
            assert_eq!(parts[0].0, parts[1].0, "chosen and rejected share the prompt");
            [parts[0].0.clone(), parts[0].1.clone(), parts[1].1.clone()]
        })
        .collect()
}

/// The (prompt, chosen, rejected) ids of each line of a `data.jsonl`.
fn expected_ids(path: &Path) -> Vec<[Vec<i32>; 3]> {
    let ids = |v: &Value, k: &str| -> Vec<i32> {
        v[k].as_array().unwrap().iter().map(|x| x.as_i64().unwrap() as i32).collect()
    };
    fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"].map(|k| ids(&v, k))
        })
        .collect()
}

#[test]
fn conversations_tokenize_as_trl_did() {
    let tok = qwen_tok();
    let dir = fixture("dpo_qwen2_lora");
    let (rows, rep) = load(&dir.join("data_text.jsonl"), Some(&tok), 1024).unwrap();
    let want = expected_ids(&dir.join("data.jsonl"));
    assert_eq!(rows.len(), 2 * want.len());
    assert_eq!(split_rows(&rows), want);
    // Row 2i is prompt + chosen, row 2i + 1 prompt + rejected.
    for (i, [p, c, r]) in want.iter().enumerate() {
        assert_eq!(rows[2 * i].input_ids, [&p[..], c].concat());
        assert_eq!(rows[2 * i + 1].input_ids, [&p[..], r].concat());
        // The completion ends with the end-of-turn token and the newline after it.
        assert_eq!(c[c.len() - 2..], [2, 201]);
    }
    assert_eq!((rep.conversational, rep.standard, rep.pretokenized), (want.len(), 0, 0));
    assert_eq!((rep.load.records, rep.load.rows, rep.load.truncated), (9, 18, 0));
    assert!(rep.split_moved.is_empty() && rep.same_completions.is_empty());
    assert!(rep.warnings().is_empty());
}

#[test]
fn pretokenized_rows_load_as_written() {
    let dir = fixture("dpo_llama_full");
    let want = expected_ids(&dir.join("data.jsonl"));
    // No tokenizer is needed.
    let (rows, rep) = load(&dir.join("data.jsonl"), None, 1024).unwrap();
    assert_eq!(split_rows(&rows), want);
    for (i, [p, c, r]) in want.iter().enumerate() {
        assert_eq!(rows[2 * i].labels, [vec![IGNORE; p.len()], c.clone()].concat());
        assert_eq!(rows[2 * i + 1].labels, [vec![IGNORE; p.len()], r.clone()].concat());
    }
    assert_eq!((rep.pretokenized, rep.load.records, rep.load.rows), (12, 12, 24));
    assert!(rep.summary().starts_with("12 pairs (24 rows): 12 pretokenized"), "{}", rep.summary());
}

/// The ids of `text` under the byte tokenizer.
fn bytes(text: &str) -> Vec<i32> {
    text.bytes().map(i32::from).collect()
}

#[test]
fn standard_text_through_the_byte_tokenizer() {
    let tok = ByteTokenizer::new();
    const EOS: i32 = 257;
    let records = [
        json!({"prompt": "2+2=", "chosen": "4", "rejected": "5"}),
        // EOS already there: not appended twice.
        json!({"prompt": "Hi", "chosen": " yo<|eos|>", "rejected": " no"}),
        // Implicit prompt: the common prefix, moved back before the space.
        json!({"chosen": "The sky is blue.", "rejected": "The sky is green."}),
        // Implicit prompt, one a prefix of the other: TRL stops one character short.
        json!({"chosen": "ab", "rejected": "abc"}),
    ];
    let (rows, rep) = load_records(&records, Some(&tok), 1024).unwrap();
    let got = split_rows(&rows);
    let eos = |text: &str| [bytes(text), vec![EOS]].concat();
    // No BOS: the byte tokenizer's tokenizer(text) adds none.
    assert_eq!(got[0], [bytes("2+2="), eos("4"), eos("5")]);
    assert_eq!(got[1], [bytes("Hi"), eos(" yo"), eos(" no")]);
    assert_eq!(got[2], [bytes("The sky is"), eos(" blue."), eos(" green.")]);
    assert_eq!(got[3], [bytes("a"), eos("b"), eos("bc")]);
    assert_eq!((rep.standard, rep.implicit_prompt, rep.conversational), (4, 2, 0));
    assert!(rep.split_moved.is_empty());
}

#[test]
fn standard_text_through_the_fixture_tokenizer() {
    let tok = qwen_tok();
    let id = |t: &str| tok.token_to_id(t).unwrap() as i32;
    let (h, el, ello, p, bang, eos) = (id("H"), id("el"), id("ello"), id("p"), id("!"), 2);
    assert_eq!((h, el, ello, eos), (42, 276, 299, id("<|im_end|>")));
    let records = [
        // "Hel" is H + el, but "Hello" is H + ello: the token straddles the boundary, so the
        // completion starts at the first token where prompt and prompt + chosen differ, and the
        // prompt is cut to the common part of both completions: [H].
        json!({"prompt": "Hel", "chosen": "lo", "rejected": "p!"}),
        // No token straddles: the prompt is all of "Hel".
        json!({"prompt": "Hel", "chosen": " a", "rejected": "<|im_end|>"}),
    ];
    let (rows, rep) = load_records(&records, Some(&tok), 1024).unwrap();
    let got = split_rows(&rows);
    assert_eq!(got[0], [vec![h], vec![ello, eos], vec![el, p, bang, eos]]);
    let space_a = id("Ġa");
    assert_eq!(got[1], [vec![h, el], vec![space_a, eos], vec![eos]]);
    assert_eq!(rep.split_moved.len(), 1);
    assert_eq!(rep.split_moved[0].line(), Some(1));
    let warnings = rep.warnings().join("\n");
    assert!(
        warnings.contains("1 pairs have a tokenized prompt that is not a prefix"),
        "{warnings}"
    );
}

#[test]
fn bos_as_the_tokenizer_adds_it() {
    // The Llama 3 fixture: its post-processor adds BOS, so tokenizer(text) starts with it.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/llama3");
    let tok = HfTokenizer::from_dir(&dir).unwrap();
    let bos = tok.token_to_id("<|begin_of_text|>").unwrap();
    let eos = tok.token_to_id("<|eot_id|>").unwrap();
    let plain = |t: &str| tok.encode(t).unwrap();
    assert_eq!(tok.encode_with_special_tokens("Hi there").unwrap()[0], bos);
    let records = [json!({"prompt": "Hi", "chosen": " there", "rejected": " you"})];
    let (rows, _) = load_records(&records, Some(&tok), 1024).unwrap();
    let i32s = |v: Vec<u32>| v.into_iter().map(|x| x as i32).collect::<Vec<_>>();
    let got = split_rows(&rows);
    assert_eq!(got[0][0], i32s([vec![bos], plain("Hi")].concat()));
    assert_eq!(got[0][1], i32s([plain(" there"), vec![eos]].concat()));
    assert_eq!(got[0][2], i32s([plain(" you"), vec![eos]].concat()));

    // A config that names add_bos_token / add_eos_token makes transformers 5 rebuild the
    // post-processor from them (each false unless set): here no BOS, and EOS after every text.
    // The prompt's own EOS is then no prefix of prompt + completion: the split drops it.
    let d = tempfile::tempdir().unwrap();
    fs::copy(dir.join("tokenizer.json"), d.path().join("tokenizer.json")).unwrap();
    let mut cfg: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    cfg["add_eos_token"] = json!(true);
    fs::write(d.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let tok = HfTokenizer::from_dir(d.path()).unwrap();
    assert_eq!(tok.encode_with_special_tokens("Hi").unwrap(), [plain("Hi"), vec![eos]].concat());
    let (rows, rep) = load_records(&records, Some(&tok), 1024).unwrap();
    let got = split_rows(&rows);
    assert_eq!(got[0][0], i32s(plain("Hi")));
    assert_eq!(got[0][1], i32s([plain(" there"), vec![eos, eos]].concat()));
    assert_eq!(rep.split_moved.len(), 1);
}

#[test]
fn implicit_conversations_split_after_the_common_messages() {
    let tok = qwen_tok();
    let (user, a, b) = (
        json!({"role": "user", "content": "Name a fruit."}),
        json!({"role": "assistant", "content": "Apple."}),
        json!({"role": "assistant", "content": "A car."}),
    );
    let explicit = json!({"prompt": [user], "chosen": [a], "rejected": [b]});
    let implicit = json!({"chosen": [user, a], "rejected": [user, b]});
    let (rows, rep) = load_records(&[explicit, implicit], Some(&tok), 1024).unwrap();
    assert_eq!(rows[0], rows[2]);
    assert_eq!(rows[1], rows[3]);
    assert_eq!((rep.conversational, rep.implicit_prompt), (2, 1));
    // The prompt ends with the generation prompt, "<|im_start|>assistant\n".
    let [p, c, _] = &split_rows(&rows)[0];
    assert_eq!(p[p.len() - 3..], [1, 266, 201]);
    assert_eq!(c[c.len() - 2..], [2, 201]);
}

#[test]
fn truncation_keeps_the_start_and_drops_long_prompts() {
    let records = [
        json!({"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5, 6, 7], "rejected_input_ids": [8]}),
        // The prompt alone reaches max_length: dropped, under either policy.
        json!({"prompt_input_ids": [1, 2, 3, 4, 5], "chosen_input_ids": [6], "rejected_input_ids": [7]}),
        // One short of it: one completion token each is left.
        json!({"prompt_input_ids": [1, 2, 3, 4], "chosen_input_ids": [9, 9], "rejected_input_ids": [8, 8, 8]}),
    ];
    let (rows, rep) = load_records(&records, None, 5).unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(
        rows[0],
        Row { input_ids: vec![1, 2, 3, 4, 5], labels: vec![IGNORE, IGNORE, IGNORE, 4, 5] }
    );
    assert_eq!(
        rows[1],
        Row { input_ids: vec![1, 2, 3, 8], labels: vec![IGNORE, IGNORE, IGNORE, 8] }
    );
    assert_eq!(rows[2].labels, [IGNORE, IGNORE, IGNORE, IGNORE, 9]);
    assert_eq!(rows[3].input_ids, [1, 2, 3, 4, 8]);
    assert_eq!(rep.load.truncated, 3);
    assert_eq!(rep.load.records, 2);
    assert_eq!(rep.load.skipped.len(), 1);
    let (loc, reason) = &rep.load.skipped[0];
    assert_eq!(loc.line(), Some(2));
    assert_eq!(reason, "the prompt alone has 5 tokens, reaching dpo.max_length = 5");
    let summary = rep.summary();
    assert!(summary.contains("1 skipped (first: ") && summary.contains("3 sequences truncated"));

    // Every prompt too long: no rows, naming why.
    let err = load_records(&records[1..2], None, 5).unwrap_err().to_string();
    assert!(err.contains("all 1 records were skipped") && err.contains("reaching"), "{err}");
    let err = load_records(&records, None, 1).unwrap_err().to_string();
    assert!(err.starts_with("dpo.max_length = 1 is too short"), "{err}");
}

/// The error loading `records` (one per line) with `tok`.
fn error(records: &[Value], tok: Option<&dyn Tokenizer>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    jsonl(&path, records);
    let err = load(&path, tok, 1024).unwrap_err().to_string();
    let file = path.display().to_string();
    err.strip_prefix(&file).unwrap_or_else(|| panic!("{err:?} does not name {file}")).to_string()
}

#[test]
fn bad_records_name_the_line_and_the_field() {
    let tok = ByteTokenizer::new();
    let t: Option<&dyn Tokenizer> = Some(&tok);
    let good = json!({"prompt": "a", "chosen": "b", "rejected": "c"});
    let err = error(&[good.clone(), json!({"prompt": "a", "chosen": "b"})], t);
    assert!(err.starts_with(":2: missing field \"rejected\" (a preference record has"), "{err}");
    let err = error(&[json!({"prompt_input_ids": [1], "chosen_input_ids": [2]})], None);
    assert_eq!(err, ":1: missing field \"rejected_input_ids\"");
    let err = error(&[json!({"prompt": "a", "chosen": 3, "rejected": "c"})], t);
    assert_eq!(err, ":1: field \"chosen\" is a number, expected a string or a list of messages");
    let msgs = json!([{"role": "assistant", "content": "x"}]);
    let err = error(&[json!({"prompt": "a", "chosen": msgs, "rejected": msgs})], t);
    assert!(err.starts_with(":1: field \"prompt\" is a string but \"chosen\" is a list"), "{err}");
    let err = error(&[json!({"chosen": [{"role": "user"}], "rejected": msgs})], t);
    assert_eq!(err, ":1: chosen[0]: missing field \"content\"");
    let err = error(
        &[json!({"prompt_input_ids": [1, -4], "chosen_input_ids": [2], "rejected_input_ids": [3]})],
        None,
    );
    assert_eq!(err, ":1: prompt_input_ids[1] = -4 is not a token id (an integer >= 0)");
    let tools = json!({"prompt": msgs, "chosen": msgs, "rejected": msgs, "tools": [{"name": "f"}]});
    let err = error(&[tools], t);
    assert!(err.starts_with(":1: field \"tools\" is not supported"), "{err}");
    // A text record without a tokenizer.
    let err = error(&[good], None);
    assert!(err.starts_with(":1: a standard-text record needs a tokenizer"), "{err}");
    // An implicit prompt cannot come from an empty string.
    let err = error(&[json!({"chosen": "", "rejected": "x"})], t);
    assert!(
        err.starts_with(":1: field \"chosen\" is empty, so no prompt can be extracted"),
        "{err}"
    );
}

#[test]
fn empty_completions_fail_or_are_skipped() {
    let tok = qwen_tok();
    let user = json!([{"role": "user", "content": "Hi"}]);
    let records = [
        json!({"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": []}),
        // No message: prompt + [] renders shorter than the prompt with its generation prompt.
        json!({"prompt": user, "chosen": [], "rejected": [{"role": "assistant", "content": "x"}]}),
        json!({"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]}),
    ];
    let err = error(&records, Some(&tok));
    assert_eq!(err, ":1: the rejected completion is empty (no token after the prompt)");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.jsonl");
    jsonl(&path, &records);
    let (rows, rep) =
        load_preference(&path.as_path().into(), Some(&tok), 64, OnError::Skip).unwrap();
    assert_eq!(rows.len(), 2);
    let skipped: Vec<_> = rep.load.skipped.iter().map(|(l, r)| (l.line(), r.as_str())).collect();
    assert_eq!(
        skipped,
        [
            (Some(1), "the rejected completion is empty (no token after the prompt)"),
            (Some(2), "the chosen completion is empty (no token after the prompt)"),
        ]
    );
    assert_eq!(rep.pretokenized, 1);
    assert_eq!(rep.conversational, 0, "a skipped record is not counted in its form");
}

#[test]
fn equal_completions_are_kept_and_counted() {
    let tok = ByteTokenizer::new();
    let records = [
        json!({"prompt": "q", "chosen": "same", "rejected": "same"}),
        json!({"prompt": "q", "chosen": "a", "rejected": "b"}),
        json!({"prompt": "q", "chosen": "x<|eos|>", "rejected": "x"}),
    ];
    let (rows, rep) = load_records(&records, Some(&tok), 1024).unwrap();
    assert_eq!(rows.len(), 6);
    let lines: Vec<_> = rep.same_completions.iter().map(|l| l.line()).collect();
    assert_eq!(lines, [Some(1), Some(3)]);
    let warnings = rep.warnings();
    assert_eq!(warnings.len(), 1);
    assert!(warnings[0].starts_with("2 pairs have a chosen equal to their rejected"));
}

/// Columns of a Parquet file for `records`.
fn pref_cols() -> Vec<Col> {
    vec![
        Col::Structs("prompt", &["role", "content"]),
        Col::Structs("chosen", &["role", "content"]),
        Col::Structs("rejected", &["role", "content"]),
    ]
}

#[test]
fn parquet_gives_the_jsonl_rows() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok = qwen_tok();
    let text = fixture("dpo_qwen2_lora/data_text.jsonl");
    let (want, _) = load(&text, Some(&tok), 1024).unwrap();
    let records: Vec<Map<String, Value>> = fs::read_to_string(&text)
        .unwrap()
        .lines()
        .map(|l| obj(serde_json::from_str(l).unwrap()))
        .collect();
    write(&d.join("chat.parquet"), &pref_cols(), &records, 4);
    let (got, _) = load(&d.join("chat.parquet"), Some(&tok), 1024).unwrap();
    assert_eq!(got, want);

    // Standard text with data.columns renames, a null prompt (implicit) and pretokenized rows.
    let records = [
        json!({"q": "Hel", "good": "lo", "bad": "p!"}),
        json!({"q": null, "good": "The sky is blue.", "bad": "The sky is green."}),
        json!({"p_ids": [5, 6], "c_ids": [7], "r_ids": [8, 9]}),
    ];
    jsonl(&d.join("mixed.jsonl"), &records);
    let maps: Vec<_> = records.iter().map(|r| obj(r.clone())).collect();
    let cols = [Col::Str("q"), Col::Str("good"), Col::Str("bad")];
    let cols = [&cols[..], &[Col::Ints("p_ids"), Col::Ints("c_ids"), Col::Ints("r_ids")]].concat();
    write(&d.join("mixed.parquet"), &cols, &maps, 2);
    let renames = [
        ("prompt", "q"),
        ("chosen", "good"),
        ("rejected", "bad"),
        ("prompt_input_ids", "p_ids"),
        ("chosen_input_ids", "c_ids"),
        ("rejected_input_ids", "r_ids"),
    ];
    let columns = Columns(renames.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    let rows = |p: &Path| -> (Vec<Row>, PreferenceReport) {
        let (store, rep): (RowStore, _) =
            load_preference(&Source::new(p, &columns), Some(&tok), 1024, OnError::Fail).unwrap();
        (store.to_rows().unwrap(), rep)
    };
    let (want, rep) = rows(&d.join("mixed.jsonl"));
    assert_eq!((rep.standard, rep.implicit_prompt, rep.pretokenized), (2, 1, 1));
    assert_eq!(split_rows(&want)[2], [vec![5, 6], vec![7], vec![8, 9]]);
    assert_eq!(rows(&d.join("mixed.parquet")).0, want);
}
