//! Where records come from, end to end: Parquet files (written here, no fixture), directories
//! and globs of shards, the ShareGPT layout and `data.columns` give the same token ids and loss
//! masks as the equivalent chat JSONL; bad Parquet input and data in which no position carries
//! a loss are clean errors naming the file and the rows; a batch without a loss position in the
//! middle of a run is skipped and counted.

mod parquet_writer;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use horizon::data::{
    Columns, LoadReport, OnError, Row, RowStore, Source, load_alpaca, load_chat,
    load_pretokenized_rows, load_sharegpt, load_text,
};
use horizon::run::config::RawConfig;
use horizon::tokenizer::ByteTokenizer;
use parquet_writer::{Col, write};
use serde_json::{Map, Value, json};

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

/// Conversations of every shape the templates see: a system turn, several turns, a turn with
/// non-ASCII text.
fn conversations() -> Vec<Vec<(&'static str, &'static str)>> {
    vec![
        vec![("user", "hi"), ("assistant", "hello there")],
        vec![("system", "be brief"), ("user", "2+2?"), ("assistant", "4")],
        vec![("user", "a"), ("assistant", "b"), ("user", "grüße"), ("assistant", "¡hola!")],
        vec![("user", "last"), ("assistant", "one")],
        vec![("system", "s"), ("user", "u"), ("assistant", "x y z")],
    ]
}

fn chat_record(turns: &[(&str, &str)], list: &str) -> Map<String, Value> {
    let msgs: Vec<Value> = turns.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
    obj(json!({ list: msgs }))
}

fn sharegpt_record(turns: &[(&str, &str)]) -> Map<String, Value> {
    let from = |r: &str| {
        match r {
            "user" => "human",
            "assistant" => "gpt",
            other => other,
        }
        .to_string()
    };
    let msgs: Vec<Value> =
        turns.iter().map(|(r, c)| json!({"from": from(r), "value": c})).collect();
    obj(json!({ "conversations": msgs, "id": "x" }))
}

fn jsonl(path: &Path, records: &[Map<String, Value>]) {
    let text: String = records.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
    fs::write(path, text).unwrap();
}

fn src(path: &Path, columns: &[(&str, &str)]) -> Source {
    let cols = Columns(columns.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    Source::new(path, &cols)
}

fn rows_of(got: anyhow::Result<(RowStore, LoadReport)>) -> Vec<Row> {
    got.unwrap_or_else(|e| panic!("{e:#}")).0.to_rows().unwrap()
}

#[test]
fn parquet_and_sharegpt_give_the_chat_jsonl_rows() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok = ByteTokenizer::new();
    let convs = conversations();
    let chat: Vec<_> = convs.iter().map(|t| chat_record(t, "messages")).collect();
    let share: Vec<_> = convs.iter().map(|t| sharegpt_record(t)).collect();
    jsonl(&d.join("chat.jsonl"), &chat);
    let load = |s: &Source, sharegpt: bool| {
        let f = if sharegpt { load_sharegpt } else { load_chat };
        rows_of(f(s, &tok, 4096, false, OnError::Fail))
    };
    let want = load(&src(&d.join("chat.jsonl"), &[]), false);
    assert_eq!(want.len(), convs.len());
    assert!(want.iter().all(|r| r.labels.iter().any(|&l| l != -100)));

    // Parquet, list<struct<role, content>>, in row groups of 2.
    let msgs = Col::Structs("messages", &["role", "content"]);
    write(&d.join("chat.parquet"), &[msgs], &chat, 2);
    assert_eq!(load(&src(&d.join("chat.parquet"), &[]), false), want);

    // ShareGPT, as JSONL and as Parquet shards (a directory, and a glob).
    jsonl(&d.join("sharegpt.jsonl"), &share);
    assert_eq!(load(&src(&d.join("sharegpt.jsonl"), &[]), true), want);
    let shards = d.join("shards");
    fs::create_dir(&shards).unwrap();
    let conv = [Col::Structs("conversations", &["from", "value"]), Col::Str("id")];
    // Written out of order: the names decide the order.
    write(&shards.join("train-00001-of-00002.parquet"), &conv, &share[3..], 1);
    write(&shards.join("train-00000-of-00002.parquet"), &conv, &share[..3], 2);
    fs::write(shards.join("README.md"), "not data").unwrap();
    assert_eq!(load(&src(&shards, &[]), true), want);
    assert_eq!(load(&src(&shards.join("train-*.parquet"), &[]), true), want);

    // data.columns: chat messages stored under another name, with other keys inside.
    let renamed: Vec<_> = convs
        .iter()
        .map(|t| {
            let msgs: Vec<Value> =
                t.iter().map(|(r, c)| json!({"speaker": r, "text": c})).collect();
            obj(json!({ "dialog": msgs }))
        })
        .collect();
    write(&d.join("renamed.parquet"), &[Col::Structs("dialog", &["speaker", "text"])], &renamed, 3);
    let cols = [("messages", "dialog"), ("role", "speaker"), ("content", "text")];
    assert_eq!(load(&src(&d.join("renamed.parquet"), &cols), false), want);
}

#[test]
fn parquet_text_alpaca_and_pretokenized() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok = ByteTokenizer::new();

    let text: Vec<_> =
        ["one doc", "", "another doc"].iter().map(|t| obj(json!({"text": t}))).collect();
    jsonl(&d.join("t.jsonl"), &text);
    write(&d.join("t.parquet"), &[Col::Str("text")], &text, 2);
    let t = |p: &str| rows_of(load_text(&src(&d.join(p), &[]), &tok, 8, OnError::Fail));
    assert_eq!(t("t.parquet"), t("t.jsonl"));

    let alpaca = vec![
        obj(json!({"instruction": "add", "input": "1 2", "output": "3"})),
        obj(json!({"instruction": "greet", "input": null, "output": "hi"})),
    ];
    jsonl(&d.join("a.jsonl"), &alpaca);
    let cols = [Col::Str("prompt"), Col::Str("input"), Col::Str("response")];
    let renamed: Vec<_> = alpaca
        .iter()
        .map(|r| {
            obj(json!({"prompt": r["instruction"], "input": r["input"], "response": r["output"]}))
        })
        .collect();
    write(&d.join("a.parquet"), &cols, &renamed, 1);
    let a = |p: &str, c: &[(&str, &str)]| {
        rows_of(load_alpaca(&src(&d.join(p), c), &tok, 1024, false, OnError::Fail))
    };
    let map = [("instruction", "prompt"), ("output", "response")];
    assert_eq!(a("a.parquet", &map), a("a.jsonl", &[]));

    let pre = vec![
        obj(json!({"input_ids": [5, 6, 7], "labels": [-100, 6, 7]})),
        obj(json!({"input_ids": [8, 9]})),
    ];
    jsonl(&d.join("p.jsonl"), &pre);
    write(&d.join("p.parquet"), &[Col::Ints("input_ids"), Col::Ints("labels")], &pre, 1);
    let p =
        |f: &str| rows_of(load_pretokenized_rows(&src(&d.join(f), &[]), 16, 100, OnError::Fail));
    assert_eq!(p("p.parquet"), p("p.jsonl"));
    assert_eq!(p("p.parquet")[1], Row { input_ids: vec![8, 9], labels: vec![8, 9] });
}

#[test]
fn bad_parquet_is_a_clean_error_naming_file_row_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok = ByteTokenizer::new();
    let mut share: Vec<_> = conversations().iter().map(|t| sharegpt_record(t)).collect();
    share[3] = sharegpt_record(&[("user", "q"), ("robot", "beep")]);
    let conv = [Col::Structs("conversations", &["from", "value"]), Col::Str("id")];
    let path = d.join("bad.parquet");
    write(&path, &conv, &share, 2);
    let file = path.display().to_string();
    let err = |r: anyhow::Result<(RowStore, LoadReport)>| format!("{:#}", r.unwrap_err());

    // An unknown `from`: the file, the row and its row group, the turn.
    let e = err(load_sharegpt(&src(&path, &[]), &tok, 4096, false, OnError::Fail));
    assert_eq!(
        e,
        format!(
            "{file}: row 3 (row group 1): conversations[1]: unknown \"from\" \"robot\": expected \
             human, user, gpt, assistant, system or tool"
        )
    );
    let (rows, report) = load_sharegpt(&src(&path, &[]), &tok, 4096, false, OnError::Skip).unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(report.skipped[0].0.to_string(), format!("{file}: row 3 (row group 1)"));

    // A column the format needs is missing: named with the file's columns and a hint.
    let e = err(load_chat(&src(&path, &[]), &tok, 4096, false, OnError::Fail));
    assert!(
        e.starts_with(&format!("{file}: no column \"messages\" (the file has: conversations, id)")),
        "{e}"
    );
    assert!(e.contains("data.columns.messages"), "{e}");
    let e = err(load_chat(&src(&path, &[("messages", "convs")]), &tok, 4096, false, OnError::Fail));
    assert!(e.contains("data.columns.messages = convs names no column"), "{e}");

    // A column of the wrong type: the file, the row, the field.
    let e = err(load_text(&src(&path, &[("text", "conversations")]), &tok, 64, OnError::Fail));
    assert_eq!(
        e,
        format!(
            "{file}: row 0 (row group 0): field \"conversations\" is an array, expected a string"
        )
    );

    // Not Parquet at all, and a shard that is not readable, by name.
    let junk = d.join("junk.parquet");
    fs::write(&junk, "{\"text\": \"jsonl in disguise\"}\n").unwrap();
    let e = err(load_text(&src(&junk, &[]), &tok, 64, OnError::Fail));
    assert!(e.starts_with(&format!("{}: not a readable Parquet file", junk.display())), "{e}");
    let e = err(load_text(&src(&d.join("*.parquet"), &[]), &tok, 64, OnError::Fail));
    assert!(e.contains("bad.parquet: no column \"text\""), "{e}");
}

#[test]
fn data_columns_keys_are_checked_against_the_format() {
    let yaml = |data: &str| {
        format!(
            "model: {{ init: random, arch: qwen2, hidden_size: 8, num_hidden_layers: 1, \
             num_attention_heads: 1, num_key_value_heads: 1, intermediate_size: 8, vocab_size: \
             64 }}\ndata: {{ path: x.parquet, {data} }}\n"
        )
    };
    let resolve = |data: &str| RawConfig::from_yaml(&yaml(data), "c.yaml")?.resolve("c.yaml");
    resolve("format: sharegpt, columns: { conversations: conv, from: speaker }").unwrap();
    let err = resolve("format: chat, columns: { conversations: conv }").unwrap_err();
    let err = format!("{err:#}");
    assert!(err.starts_with("c.yaml: data.columns.conversations: not a field of the chat format"));
    assert!(err.contains("(messages, role, content, thinking)"), "{err}");
    let err = format!("{:#}", resolve("format: synthetic, columns: { text: t }").unwrap_err());
    assert!(err.contains("the synthetic format reads no columns"), "{err}");
    assert!(resolve("format: sharegpt, colums: {}").is_err(), "unknown keys stay refused");
}

fn horizon(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().expect("run horizon")
}

/// A tiny random model on pretokenized `data` (batches of one row).
fn pretokenized_config(dir: &Path, data: &str, steps: usize) -> PathBuf {
    let data_path = dir.join("data.jsonl");
    fs::write(&data_path, data).unwrap();
    let yaml = format!(
        "model: {{ init: random, arch: qwen2, hidden_size: 16, intermediate_size: 32, \
         num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 64 }}\n\
         data: {{ path: '{}' }}\n\
         train: {{ steps: {steps}, batch_size: 1, max_seq_len: 16 }}\n\
         output: {{ dir: '{}' }}\n",
        data_path.display(),
        dir.join("out").display()
    );
    let path = dir.join("config.yaml");
    fs::write(&path, yaml).unwrap();
    path
}

#[test]
fn data_without_a_loss_position_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // Row 1: all -100; row 2: only the first label, which nothing predicts.
    let data = "{\"input_ids\": [1, 2, 3], \"labels\": [-100, -100, -100]}\n\n\
                {\"input_ids\": [4, 5], \"labels\": [4, -100]}\n";
    let cfg = pretokenized_config(tmp.path(), data, 2);
    let o = horizon(&["train", "--config", cfg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "trained on data without loss: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let file = tmp.path().join("data.jsonl").display().to_string();
    let want =
        format!("{file}: no position carries a loss in any of its 2 rows: {file}:1, {file}:3");
    assert!(err.contains(&want), "{err}");
}

#[test]
fn a_batch_without_a_loss_position_is_skipped_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let data = "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5, 6], \"labels\": [-100, -100, -100]}\n\
                {\"input_ids\": [7, 8, 9]}\n";
    let cfg = pretokenized_config(tmp.path(), data, 3);
    let o = horizon(&["train", "--config", cfg.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("1 without a loss position"), "{out}");
    let metrics = fs::read_to_string(tmp.path().join("out/metrics.jsonl")).unwrap();
    let steps: Vec<Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(steps.len(), 3);
    assert_eq!(steps[1]["no_loss"], true, "{}", steps[1]);
    assert_eq!(steps[1]["skipped"], true);
    assert!(steps[1]["loss"].is_null(), "{}", steps[1]);
    for s in [&steps[0], &steps[2]] {
        assert!(s["loss"].as_f64().unwrap().is_finite() && s.get("no_loss").is_none(), "{s}");
    }
    let summary: Value =
        serde_json::from_str(&fs::read_to_string(tmp.path().join("out/summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["skipped_steps"], 1, "{summary}");
    assert_eq!(summary["total_steps"], 3, "{summary}");
    assert!(summary["final_loss"].as_f64().unwrap().is_finite(), "{summary}");
}

/// A shard that cannot be read (a dangling symlink, as a Hub snapshot with a blob missing) fails
/// the load naming it, instead of the run training on the rest; `data.on_error: skip` skips it,
/// listed with the reason among the skipped records (issue 45).
#[test]
fn an_unreadable_shard_is_an_error_naming_it_or_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    fs::create_dir(&shards).unwrap();
    let recs: Vec<_> = conversations().iter().map(|t| chat_record(t, "messages")).collect();
    jsonl(&shards.join("train-00000-of-00002.jsonl"), &recs);
    let missing = dir.path().join("blobs/0123abcd");
    std::os::unix::fs::symlink(&missing, shards.join("train-00001-of-00002.jsonl")).unwrap();
    let tok = ByteTokenizer::new();
    for source in [src(&shards, &[]), src(&shards.join("train-*.jsonl"), &[])] {
        let err = load_chat(&source, &tok, 4096, false, OnError::Fail).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("train-00001-of-00002.jsonl"), "{msg}");
        assert!(msg.contains("on_error: skip"), "the hint names the way out: {msg}");
        let (rows, report) = load_chat(&source, &tok, 4096, false, OnError::Skip).unwrap();
        assert_eq!(rows.len(), recs.len(), "the readable shard's records");
        assert_eq!(report.skipped.len(), 1, "the unreadable shard, counted");
        assert!(report.skipped[0].0.file.ends_with("train-00001-of-00002.jsonl"));
        assert!(report.skipped[0].1.contains("cannot read"), "{:?}", report.skipped[0]);
    }
}

/// A pretokenized Parquet file of `rows` rows of `len` tokens (ids from a seeded stream), in row
/// groups of 1,000 rows, written a group at a time.
fn pretokenized_parquet(path: &Path, rows: usize, len: usize) {
    let mut w = parquet_writer::Writer::create(path, &[Col::Ints("input_ids")]);
    let mut x = 12345u64;
    for start in (0..rows).step_by(1000) {
        let group: Vec<Map<String, Value>> = (start..(start + 1000).min(rows))
            .map(|_| {
                let ids: Vec<u64> = (0..len)
                    .map(|_| {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        (x >> 33) % 1000
                    })
                    .collect();
                obj(json!({ "input_ids": ids }))
            })
            .collect();
        w.row_group(&group);
    }
    w.close();
}

/// The data's share of host RAM, measured (issue 46): peak RSS of the same short run over a
/// 100K-token and a 10M-token pretokenized Parquet file. Data streams from a spill file, so the
/// two peaks differ by the index (~30 bytes a row), not the tokens (8 bytes each when held).
/// `cargo test --release --test data_sources -- --ignored --nocapture data_rss`; set
/// HORIZON_BIN to measure another build of the binary.
#[test]
#[ignore = "a benchmark: writes ~60 MB and runs two short trainings"]
fn data_rss_is_bounded_by_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let bin = std::env::var("HORIZON_BIN").unwrap_or(env!("CARGO_BIN_EXE_horizon").to_string());
    let mut peaks = Vec::new();
    for tokens in [100_000usize, 10_000_000] {
        let data = dir.path().join(format!("{tokens}.parquet"));
        pretokenized_parquet(&data, tokens / 500, 500);
        let out = dir.path().join(format!("out-{tokens}"));
        let yaml = format!(
            "model: {{ init: random, arch: llama, hidden_size: 64, intermediate_size: 128, \
             num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 4, \
             vocab_size: 1000 }}\n\
             data: {{ format: pretokenized, path: '{}', shuffle: true }}\n\
             train: {{ steps: 4, batch_size: 4, max_seq_len: 512 }}\n\
             output: {{ dir: '{}', tensorboard: false }}\n",
            data.display(),
            out.display()
        );
        let cfg = dir.path().join(format!("{tokens}.yaml"));
        fs::write(&cfg, yaml).unwrap();
        let t0 = std::time::Instant::now();
        let run = Command::new(&bin).args(["train", "--config"]).arg(&cfg).output().unwrap();
        let secs = t0.elapsed().as_secs_f64();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        let summary: Value =
            serde_json::from_str(&fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
        let peak = summary["peak_rss_bytes"].as_u64().unwrap();
        println!(
            "{tokens:>10} tokens: peak RSS {:.1} MiB, run {secs:.1} s",
            peak as f64 / 1048576.0
        );
        peaks.push(peak);
    }
    let grew = peaks[1].saturating_sub(peaks[0]) as f64 / 1048576.0;
    println!("10M - 100K tokens: {grew:+.1} MiB (held whole, the tokens alone would be 76 MiB)");
    assert!(grew < 16.0, "the data's RAM grew {grew:.1} MiB from 100K to 10M tokens");
}
