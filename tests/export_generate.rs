//! What a run leaves behind and what a person does with it: `horizon export` (fp32 exact, bf16
//! rounded to nearest even, shards + index, tokenizer files), `horizon generate`, the held-out
//! eval loss, `--set` overrides, skipped counts in the summary, and the plot and report.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use horizon::data::pretokenized::{Row, make_batch};
use horizon::hf::config::ModelConfig;
use horizon::model::params::ParamStore;
use horizon::model::transformer::{Capacity, Transformer};
use horizon::run::data::tokens_of;
use horizon_backend::CpuBackend;
use serde_json::Value;

fn horizon(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().expect("run horizon");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "panicked: {err}");
    o
}

fn ok(o: Output) -> String {
    assert!(o.status.success(), "failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: Output) -> String {
    assert!(!o.status.success(), "expected a failure: {}", String::from_utf8_lossy(&o.stdout));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Train fixture case llama_gqa for its steps with a checkpoint at the end; returns the run's
/// output directory.
fn trained_case(tmp: &Path, extra: &str) -> PathBuf {
    let case = "llama_gqa";
    let dir = case_dir(case);
    let out = tmp.join("out");
    let cfg = tmp.join("c.yaml");
    let mut yaml = fixture_yaml(case, &dir.join("model"), &dir.join("data.jsonl"), &out, extra);
    yaml = yaml.replace("max_seq_len: 64 }", "max_seq_len: 64, save_every: 1 }");
    fs::write(&cfg, yaml).unwrap();
    ok(horizon(&["train", "--config", cfg.to_str().unwrap()]));
    out
}

fn loss_of(dir: &Path, rows: &[Row]) -> f64 {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let params = ParamStore::load_hf(&horizon::model::describe(&cfg), dir).unwrap();
    let refs: Vec<&Row> = rows.iter().collect();
    let batch = make_batch(&refs);
    let cap = Capacity { batch: batch.b, seq_len: batch.t, head_chunk_rows: 16 };
    let mut tr = Transformer::new(CpuBackend, &cfg, cap);
    tr.forward_loss(&params, tokens_of(&batch)).unwrap().loss()
}

fn fixture_rows() -> Vec<Row> {
    let path = case_dir("llama_gqa").join("data.jsonl");
    horizon::data::load_pretokenized(&path, 64, 1 << 20).unwrap().to_rows().unwrap()
}

/// bf16 round-to-nearest-even of a finite f32, by bit arithmetic (independent of `half`).
fn bf16_rne(x: f32) -> f32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(rounded)
}

#[test]
fn export_round_trips_fp32_exactly_and_bf16_rounded() {
    let tmp = tempfile::tempdir().unwrap();
    let out = trained_case(tmp.path(), "");
    let final_dir = out.join("final");
    let ckpt =
        fs::read_dir(out.join("checkpoints")).unwrap().flatten().map(|e| e.path()).max().unwrap();
    let cfg = ModelConfig::from_file(&final_dir.join("config.json")).unwrap();
    let layout = horizon::model::describe(&cfg);
    let masters = ParamStore::load_hf(&layout, &ckpt.join("params.safetensors")).unwrap();

    // fp32 from the checkpoint: the masters, bit for bit, and the same loss as final/.
    let fp32 = tmp.path().join("fp32");
    ok(horizon(&["export", ckpt.to_str().unwrap(), "--out", fp32.to_str().unwrap()]));
    let got = ParamStore::load_hf(&layout, &fp32).unwrap();
    for (a, b) in got.buffers().iter().zip(masters.buffers()) {
        assert!(a.iter().zip(b.iter()).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    let rows = fixture_rows();
    let want = loss_of(&final_dir, &rows);
    assert_eq!(loss_of(&fp32, &rows), want, "same loss on a batch after export + reload");

    // bf16 from the run directory (its newest checkpoint), sharded: every value is the
    // nearest-even bf16 of its master, and the loss moves only by bf16 rounding.
    let bf16 = tmp.path().join("bf16");
    let stdout = ok(horizon(&[
        "export",
        out.to_str().unwrap(),
        "--out",
        bf16.to_str().unwrap(),
        "--dtype",
        "bf16",
        "--max-shard-size",
        "20KB",
    ]));
    assert!(stdout.contains("shard(s)"), "{stdout}");
    let index: Value = serde_json::from_str(
        &fs::read_to_string(bf16.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shards: std::collections::BTreeSet<&str> =
        index["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
    assert!(shards.len() > 1, "{index}");
    for s in &shards {
        assert!(bf16.join(s).is_file(), "{s}");
    }
    let cfg_json: Value =
        serde_json::from_str(&fs::read_to_string(bf16.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg_json["torch_dtype"], "bfloat16");
    let got = ParamStore::load_hf(&layout, &bf16).unwrap();
    let mut changed = 0usize;
    for (a, b) in got.buffers().iter().zip(masters.buffers()) {
        for (&x, &y) in a.iter().zip(b.iter()) {
            assert_eq!(x.to_bits(), bf16_rne(y).to_bits(), "{y:e} exported as {x:e}");
            changed += (x != y) as usize;
        }
    }
    assert!(changed > 0, "bf16 export should round some values");
    let l = loss_of(&bf16, &rows);
    assert!((l - want).abs() / want < 1e-2, "bf16 loss {l} vs fp32 {want}");

    // Exporting again into the same directory, unsharded, leaves no stale shard behind.
    ok(horizon(&["export", ckpt.to_str().unwrap(), "--out", bf16.to_str().unwrap()]));
    assert!(!bf16.join("model.safetensors.index.json").exists());
    assert_eq!(loss_of(&bf16, &rows), want);

    // Bad sources are one-line errors naming the path.
    let e = err(horizon(&["export", "/nonexistent/ckpt", "--out", fp32.to_str().unwrap()]));
    assert!(e.contains("/nonexistent/ckpt"), "{e}");
    let e = err(horizon(&["export", tmp.path().to_str().unwrap(), "--out", "x"]));
    assert!(e.contains("neither a checkpoint"), "{e}");
}

#[test]
fn final_export_carries_the_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let tok_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/llama3");
    let extra = "engine: { head_chunk_rows: 16 }\n";
    let case = "llama_gqa";
    let dir = case_dir(case);
    let out = tmp.path().join("out");
    let yaml = fixture_yaml(case, &dir.join("model"), &dir.join("data.jsonl"), &out, extra)
        .replace(
            "format: pretokenized }",
            &format!("format: pretokenized, tokenizer: '{}' }}", tok_dir.display()),
        );
    let cfg = tmp.path().join("c.yaml");
    fs::write(&cfg, yaml).unwrap();
    ok(horizon(&["train", "--config", cfg.to_str().unwrap()]));
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            fs::read(out.join("final").join(f)).unwrap(),
            fs::read(tok_dir.join(f)).unwrap(),
            "{f} copied"
        );
    }
    // The run's plot and report are there.
    let png = fs::read(out.join("training.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let report = fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("final training loss"), "{report}");
}

/// A byte-tokenizer model trained from scratch on text, with a held-out split.
fn byte_text_run(tmp: &Path, extra_train: &str, set: &[&str]) -> (PathBuf, Output) {
    let data = tmp.join("text.jsonl");
    let mut lines = String::new();
    for i in 0..40 {
        lines += &format!("{{\"text\": \"abc {i} abc {i} abc\"}}\n");
    }
    fs::write(&data, lines).unwrap();
    let out = tmp.join("out");
    let yaml = format!(
        "model: {{ init: random, arch: llama, seed: 1, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 259, max_position_embeddings: 64 }}\n\
         data: {{ path: '{}', format: text, tokenizer: byte, eval_fraction: 0.2 }}\n\
         train: {{ steps: 6, batch_size: 4, max_seq_len: 16{extra_train} }}\n\
         optimizer: {{ lr: 0.01 }}\n\
         output: {{ dir: '{}' }}\n",
        data.display(),
        out.display()
    );
    let cfg = tmp.join("c.yaml");
    fs::write(&cfg, yaml).unwrap();
    let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
    for s in set {
        args.extend(["--set", s]);
    }
    let o = horizon(&args);
    (out, o)
}

#[test]
fn eval_loss_is_reported_and_is_the_held_out_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, o) = byte_text_run(tmp.path(), ", eval_every: 2", &[]);
    ok(o);
    let metrics: Vec<Value> = fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let eval_steps: Vec<u64> = metrics
        .iter()
        .filter(|m| m.get("eval_loss").is_some())
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(eval_steps, [2, 4, 6]);
    let summary: Value =
        serde_json::from_str(&fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let last_eval = metrics.last().unwrap()["eval_loss"].as_f64().unwrap();
    assert_eq!(summary["eval_loss"].as_f64().unwrap(), last_eval);
    assert!(summary["eval_rows"].as_u64().unwrap() > 0);

    // The reported number is the loss of the held-out rows under the exported weights.
    let raw = horizon::run::config::RawConfig::from_file(&tmp.path().join("c.yaml")).unwrap();
    let sets = horizon::run::data::load_datasets(&raw, 259).unwrap();
    let eval = sets.eval.unwrap();
    let (eval, train) = (eval.to_rows().unwrap(), sets.train.to_rows().unwrap());
    assert_eq!(eval.len() as u64, summary["eval_rows"].as_u64().unwrap());
    let train_rows = train.len();
    assert!(train_rows > 0 && eval.iter().all(|r| !train.contains(r)));
    let want = loss_of(&out.join("final"), &eval);
    assert!((want - last_eval).abs() <= 1e-9 * want, "eval {last_eval} vs recomputed {want}");
}

#[test]
fn generate_streams_from_an_exported_model() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, o) = byte_text_run(tmp.path(), "", &[]);
    ok(o);
    let model = out.join("final");
    let m = model.to_str().unwrap();
    let greedy =
        ok(horizon(&["generate", "--model", m, "--prompt", "abc", "--max-new-tokens", "6"]));
    assert!(greedy.starts_with("abc"), "{greedy:?}");
    let sample = |seed: &str| {
        ok(horizon(&[
            "generate",
            "--model",
            m,
            "--prompt",
            "abc",
            "--max-new-tokens",
            "6",
            "--temperature",
            "1.0",
            "--top-p",
            "0.9",
            "--seed",
            seed,
        ]))
    };
    assert_eq!(sample("5"), sample("5"), "sampling is a function of the seed");
    let chat = ok(horizon(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "hi",
        "--chat",
        "--max-new-tokens",
        "3",
    ]));
    assert!(!chat.contains("panicked"));
    let e = err(horizon(&["generate", "--model", m, "--prompt", "abc", "--top-p", "0"]));
    assert!(e.contains("--top-p"), "{e}");
    let e = err(horizon(&["generate", "--model", out.to_str().unwrap(), "--prompt", "x"]));
    assert!(e.contains("config.json"), "{e}");
    // Nothing asked: nothing generated, and said so (issue 45); a huge budget runs to the
    // model's length without overflowing.
    let o = horizon(&["generate", "--model", m, "--prompt", "abc", "--max-new-tokens", "0"]);
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(ok(o), "abc", "only the prompt");
    assert!(said.contains("--max-new-tokens 0"), "{said}");
    let huge = usize::MAX.to_string();
    let long =
        ok(horizon(&["generate", "--model", m, "--prompt", "abc", "--max-new-tokens", &huge]));
    assert!(long.starts_with("abc"), "{long:?}");
}

#[test]
fn set_overrides_keys_and_refuses_unknown_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, o) = byte_text_run(tmp.path(), "", &["train.steps=3", "optimizer.lr=0.002"]);
    ok(o);
    let summary: Value =
        serde_json::from_str(&fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["total_steps"], 3);
    let saved = fs::read_to_string(out.join("config.yaml")).unwrap();
    assert!(saved.contains("0.002"), "the saved config holds the override: {saved}");
    let tmp = tempfile::tempdir().unwrap();
    let (_, o) = byte_text_run(tmp.path(), "", &["train.stepz=3"]);
    let e = err(o);
    assert!(e.contains("stepz"), "{e}");
}

#[test]
fn skipped_records_and_steps_are_counted_in_the_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("alpaca.jsonl");
    let mut lines = String::new();
    for i in 0..12 {
        lines += &format!("{{\"instruction\": \"say {i}\", \"output\": \"{i}\"}}\n");
    }
    lines += "{\"instruction\": \"no output\"}\nnot json\n";
    fs::write(&data, lines).unwrap();
    let out = tmp.path().join("out");
    let yaml = format!(
        "model: {{ init: random, arch: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 4, vocab_size: 259 }}\n\
         data: {{ path: '{}', format: alpaca, tokenizer: byte, on_error: skip }}\n\
         train: {{ steps: 3, batch_size: 4, max_seq_len: 256 }}\n\
         output: {{ dir: '{}' }}\n",
        data.display(),
        out.display()
    );
    let cfg = tmp.path().join("c.yaml");
    fs::write(&cfg, yaml).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .env("HORIZON_TEST_NAN_STEPS", "1")
        .output()
        .unwrap();
    ok(o);
    let summary: Value =
        serde_json::from_str(&fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["skipped_records"], 2, "{summary}");
    assert_eq!(summary["skipped_steps"], 1, "{summary}");
}

#[test]
fn exports_carry_the_special_token_ids_in_config_and_generation_config() {
    let json =
        |p: &Path| -> Value { serde_json::from_str(&fs::read_to_string(p).unwrap()).unwrap() };
    let ids = |v: &Value| {
        [v["bos_token_id"].clone(), v["eos_token_id"].clone(), v["pad_token_id"].clone()]
    };
    // From scratch with the byte tokenizer: <|bos|>, <|eos|>, <|pad|>.
    let tmp = tempfile::tempdir().unwrap();
    let (out, o) = byte_text_run(tmp.path(), "", &["train.steps=1"]);
    ok(o);
    for f in ["config.json", "generation_config.json"] {
        let v = json(&out.join("final").join(f));
        assert_eq!(ids(&v), [Value::from(256), Value::from(257), Value::from(258)], "{f}: {v}");
    }

    // A HF directory whose config.json has null ids, the Llama 3 fixture tokenizer (BOS 500,
    // EOS 504, no pad) and a generation config with an EOS list and a sampling setting.
    let src = tmp.path().join("src");
    fs::create_dir_all(&src).unwrap();
    let model = case_dir("llama_gqa").join("model");
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/llama3");
    fs::copy(model.join("model.safetensors"), src.join("model.safetensors")).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        fs::copy(tok.join(f), src.join(f)).unwrap();
    }
    let mut cfg = json(&model.join("config.json"));
    cfg["bos_token_id"] = Value::Null;
    cfg["eos_token_id"] = Value::Null;
    fs::write(src.join("config.json"), cfg.to_string()).unwrap();
    fs::write(
        src.join("generation_config.json"),
        r#"{"eos_token_id": [504, 501], "temperature": 0.6}"#,
    )
    .unwrap();
    let exp = tmp.path().join("exp");
    let export = || horizon(&["export", src.to_str().unwrap(), "--out", exp.to_str().unwrap()]);
    ok(export());
    let (c, g) = (json(&exp.join("config.json")), json(&exp.join("generation_config.json")));
    let want = [Value::from(500), serde_json::json!([504, 501]), Value::Null];
    assert_eq!(ids(&c), want, "config.json: the tokenizer's BOS, the generation config's EOS");
    assert_eq!(ids(&g), want, "{g}");
    assert_eq!(g["temperature"], 0.6, "the source's other keys are kept: {g}");

    // The source model's own ids are carried over.
    cfg["bos_token_id"] = 1.into();
    cfg["eos_token_id"] = 2.into();
    fs::write(src.join("config.json"), cfg.to_string()).unwrap();
    ok(export());
    let (c, g) = (json(&exp.join("config.json")), json(&exp.join("generation_config.json")));
    assert_eq!(ids(&c), [Value::from(1), Value::from(2), Value::Null]);
    assert_eq!(ids(&g), [Value::from(1), serde_json::json!([504, 501]), Value::Null]);

    // A generation config that is not a JSON object: an error naming it.
    fs::write(src.join("generation_config.json"), "[1, 2").unwrap();
    let e = err(export());
    assert!(e.contains("generation_config.json") && e.contains("not a JSON object"), "{e}");
}

/// Greedy ids of `model` (a fixture's weights, or any), KV cache against full recompute.
fn kv_and_full_ids(
    cfg: &ModelConfig,
    params: &ParamStore,
    prompt: &[u32],
    n: usize,
) -> [Vec<u32>; 2] {
    use horizon::engine::options::BackendKind;
    use horizon::run::decode::{Decode, Generator};
    let tok = Box::new(horizon::tokenizer::ByteTokenizer::new());
    let mut g = Generator::new(cfg, params.clone(), tok);
    g.set_stop_ids(Vec::new());
    [Decode::KvCache(BackendKind::Cpu), Decode::FullRecompute].map(|mode| {
        g.set_decode(mode);
        g.greedy_ids(prompt, n).unwrap()
    })
}

#[test]
fn kv_cache_generates_the_full_recompute_tokens() {
    // Every fixture family (GQA; tied head and padded vocabulary; Qwen3's and Gemma 3's per-head
    // q/k norms; Gemma 3's sliding-window layers, window 8, passed well within 32 tokens) and
    // the default job's model (its shape with room for 32 new tokens), greedy.
    for case in CASES {
        let dir = case_dir(case).join("model");
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let params = ParamStore::load_hf(&horizon::model::describe(&cfg), &dir).unwrap();
        let [kv, full] = kv_and_full_ids(&cfg, &params, &[3, 17, 5, 42, 9], 32);
        assert_eq!(full.len(), 32, "{case}");
        assert_eq!(kv, full, "{case}: KV cache vs full recompute");
    }
    let tmp = tempfile::tempdir().unwrap();
    let yaml = horizon::run::default_job::config_yaml(tmp.path(), 1);
    let set = ["model.max_position_embeddings=64".to_string()];
    let raw = horizon::run::config::RawConfig::from_yaml_with(&yaml, "default job", &set).unwrap();
    let (cfg, params) = horizon::run::load::load_model(&raw).unwrap();
    let prompt: Vec<u32> = "47+38=".bytes().map(u32::from).collect();
    let [kv, full] = kv_and_full_ids(&cfg, &params, &prompt, 32);
    assert_eq!(full.len(), 32);
    assert_eq!(kv, full, "default job model: KV cache vs full recompute");
}

/// A `config.json` whose sizes disagree with its tensors (a vocabulary of 4e9 over small
/// weights) is a clean error naming the tensor and both shapes, in `generate` and `export`,
/// before anything is allocated from the config (it aborted allocating; issue 45).
#[test]
fn config_sizes_that_disagree_with_the_tensors_are_refused_before_allocating() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_tree(&case_dir("llama_gqa").join("model"), &model);
    let mut cfg: Value =
        serde_json::from_str(&fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    cfg["vocab_size"] = 4_000_000_000u64.into();
    fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    let m = model.to_str().unwrap();
    let out = tmp.path().join("out");
    for args in [
        vec!["generate", "--model", m, "--prompt", "hi", "--max-new-tokens", "2"],
        vec!["export", m, "--out", out.to_str().unwrap()],
    ] {
        let o = horizon(&args);
        assert_eq!(o.status.signal(), None, "{}: killed by a signal", args[0]);
        let e = err(o);
        assert!(e.contains("model.embed_tokens.weight"), "{}: {e}", args[0]);
        assert!(e.contains("4000000000"), "{}: both shapes: {e}", args[0]);
    }
}

/// An export over an earlier one is atomic: interrupted after its first file (a test hook
/// kills it there), the earlier export is intact and loads; the next export cleans the stale
/// staging directory, replaces the weights and keeps the user's other files (issue 45).
#[test]
fn an_interrupted_export_leaves_the_previous_one_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = trained_case(tmp.path(), "");
    let ckpt = ckpt.join("checkpoints").read_dir().unwrap().next().unwrap().unwrap().path();
    let out = tmp.path().join("exported");
    let o = out.to_str().unwrap();
    ok(horizon(&["export", ckpt.to_str().unwrap(), "--out", o]));
    fs::write(out.join("NOTES.md"), "mine").unwrap();
    let before = fs::read(out.join("model.safetensors")).unwrap();
    let killed = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["export", ckpt.to_str().unwrap(), "--out", o, "--dtype", "bf16"])
        .env("HORIZON_TEST_EXPORT_EXIT_AFTER_FIRST_FILE", "1")
        .output()
        .unwrap();
    assert!(!killed.status.success(), "the hook stops the export");
    assert!(fs::read(out.join("model.safetensors")).unwrap() == before, "the old weights");
    let listed = || -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert!(listed().iter().any(|n| n.contains("horizon-export")), "staged aside: {:?}", listed());
    ok(horizon(&["export", ckpt.to_str().unwrap(), "--out", o, "--dtype", "bf16"]));
    assert!(
        !listed().iter().any(|n| n.contains("horizon-")),
        "stale staging cleaned: {:?}",
        listed()
    );
    assert!(fs::read(out.join("model.safetensors")).unwrap() != before, "bf16 now");
    assert_eq!(fs::read_to_string(out.join("NOTES.md")).unwrap(), "mine", "the user's file kept");
    let cfg = ModelConfig::from_file(&out.join("config.json")).unwrap();
    ParamStore::load_hf(&horizon::model::describe(&cfg), &out).unwrap();
}

/// A model's `model.safetensors` damaged at random (a seeded loop: truncated, its header's
/// length rewritten, a byte of its header flipped) makes `export` and `generate` fail with a
/// clean error or succeed; never a panic or an abort (issue 45).
#[test]
fn damaged_model_files_are_clean_errors() {
    use std::os::unix::process::ExitStatusExt;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_gqa/model");
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = horizon::rng::SplitMix64::new(0x9e37_79b9_7f4a_7c15);
    let mut next = |n: u64| rng.below(n.max(1));
    for trial in 0..16 {
        let model = tmp.path().join(format!("m{trial}"));
        copy_tree(&src, &model);
        let st = model.join("model.safetensors");
        let mut b = fs::read(&st).unwrap();
        let header = 8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        match next(3) {
            0 => b.truncate(next(b.len() as u64) as usize),
            1 => b[..8].copy_from_slice(&next(u64::MAX).to_le_bytes()),
            _ => {
                let at = 8 + next(header as u64 - 8) as usize;
                b[at] ^= 1 << next(8);
            }
        }
        fs::write(&st, &b).unwrap();
        let m = model.to_str().unwrap();
        let out = tmp.path().join(format!("o{trial}"));
        let args = ["export", m, "--out", out.to_str().unwrap()];
        let o = Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.signal(), None, "trial {trial}: killed: {e}");
        assert!(!e.contains("panicked"), "trial {trial}: {e}");
    }
}

/// What transformers 5.25.0 writes for a causal LM and its fast tokenizer,
/// `model.save_pretrained(d)` then `tokenizer.save_pretrained(d)` (modeling_utils.py: the
/// config, the generation config of a model that can generate, the weights; the tokenizer:
/// `tests/fixtures/tokenizers/qwen2-transformers5`, no `special_tokens_map.json` since v5).
const TRANSFORMERS_MODEL_FILES: [&str; 6] = [
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

/// An adapter run's `OUT/final/`: PEFT's `save_pretrained` of a LoRA adapter
/// (`adapter_config.json`, `adapter_model.safetensors`; its `README.md` model card is not
/// written), the tokenizer TRL's and axolotl's trainers save beside it, and Horizon's
/// `horizon_adapter.json`.
const ADAPTER_FILES: [&str; 6] = [
    "adapter_config.json",
    "adapter_model.safetensors",
    "chat_template.jinja",
    "horizon_adapter.json",
    "tokenizer.json",
    "tokenizer_config.json",
];

fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    names
}

/// `horizon generate --chat` on `model` (with `adapter`): the export's chat template renders.
fn chats(model: &Path, adapter: Option<&Path>) {
    let mut args = vec!["generate", "--model", model.to_str().unwrap()];
    if let Some(a) = adapter {
        args.extend(["--adapter", a.to_str().unwrap()]);
    }
    args.extend(["--prompt", "hi", "--chat", "--max-new-tokens", "3"]);
    ok(horizon(&args));
}

/// `config.json`'s `dtype` and `torch_dtype` (transformers 5 reads the first, 4.x the second).
fn dtypes(dir: &Path) -> (Value, Value) {
    let c: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    (c["dtype"].clone(), c["torch_dtype"].clone())
}

/// Every kind of export carries the source's tokenizer and generation files, as transformers
/// writes them (the chat template in `chat_template.jinja`), so that each chats: a full
/// fine-tune's `OUT/final/`, `horizon export` of its run in bf16, a LoRA run's `OUT/final/`
/// (the adapter with the tokenizer beside it), and `horizon export --merge` of it; and
/// `config.json` says the dtype written under both keys.
#[test]
fn every_export_chats_and_carries_the_files_transformers_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tok = tmp.path().join("tokenizer");
    copy_tree(&root.join("tests/fixtures/tokenizers/qwen2-transformers5"), &tok);
    let generation = r#"{"eos_token_id": [502, 500], "temperature": 0.7}"#;
    fs::write(tok.join("generation_config.json"), generation).unwrap();
    let data = tmp.path().join("chat.jsonl");
    fs::write(
        &data,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello there\"}]}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"2+2?\"}, {\"role\": \"assistant\", \"content\": \"4\"}]}\n",
    )
    .unwrap();
    let train = |name: &str, model: &str, extra: &str, adapter: &str| {
        let out = tmp.path().join(name);
        let cfg = tmp.path().join(format!("{name}.yaml"));
        let yaml = format!(
            "model: {model}\n\
             data: {{ path: '{}', format: chat{extra} }}\n\
             train: {{ steps: 2, batch_size: 2, max_seq_len: 64, save_every: 2 }}\n\
             output: {{ dir: '{}' }}\n{adapter}",
            data.display(),
            out.display()
        );
        fs::write(&cfg, yaml).unwrap();
        ok(horizon(&["train", "--config", cfg.to_str().unwrap()]));
        out
    };
    let random = "{ init: random, arch: qwen2, hidden_size: 32, intermediate_size: 64, \
                  num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 512 }";
    let full = train("full", random, &format!(", tokenizer: '{}'", tok.display()), "");
    let final_dir = full.join("final");
    assert_eq!(file_names(&final_dir), TRANSFORMERS_MODEL_FILES, "full fine-tune's final/");
    assert_eq!(dtypes(&final_dir), (Value::from("float32"), Value::from("float32")));
    let generation: Value = serde_json::from_str(
        &fs::read_to_string(final_dir.join("generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (generation["eos_token_id"].clone(), generation["temperature"].clone()),
        (json_list(), 0.7.into())
    );
    chats(&final_dir, None);

    let bf16 = tmp.path().join("bf16");
    ok(horizon(&[
        "export",
        full.to_str().unwrap(),
        "--out",
        bf16.to_str().unwrap(),
        "--dtype",
        "bf16",
    ]));
    assert_eq!(file_names(&bf16), TRANSFORMERS_MODEL_FILES, "horizon export");
    assert_eq!(dtypes(&bf16), (Value::from("bfloat16"), Value::from("bfloat16")));
    chats(&bf16, None);

    let base = format!("{{ path: '{}' }}", final_dir.display());
    // The base's own tokenizer (model.path): the one final/ carries.
    let lora_run = train("lora", &base, "", "adapter: { type: lora, r: 4 }\n");
    let lora = lora_run.join("final");
    assert_eq!(file_names(&lora), ADAPTER_FILES, "an adapter run's final/");
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        assert_eq!(fs::read(lora.join(f)).unwrap(), fs::read(tok.join(f)).unwrap(), "{f}");
    }
    chats(&final_dir, Some(&lora));

    let merged = tmp.path().join("merged");
    ok(horizon(&[
        "export",
        lora_run.to_str().unwrap(),
        "--merge",
        "--out",
        merged.to_str().unwrap(),
    ]));
    assert_eq!(file_names(&merged), TRANSFORMERS_MODEL_FILES, "horizon export --merge");
    assert_eq!(dtypes(&merged), (Value::from("float32"), Value::from("float32")));
    chats(&merged, None);
}

/// The generation config's EOS list as the fixture's source wrote it.
fn json_list() -> Value {
    serde_json::json!([502, 500])
}
