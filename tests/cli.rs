//! The `horizon` binary end to end: `horizon train --config` on each fixture case reproduces the
//! Hugging Face numbers, two runs are bit-identical, and bad input gets a clear one-line error
//! (never a panic).

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use common::*;
use horizon::hf::checkpoint::read_tensor_f64;
use serde_json::Value;

fn horizon(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().expect("run horizon")
}

/// A config for a fixture case, written into `dir`, with overrides of the model and data paths.
fn write_config(
    dir: &Path,
    case: &str,
    model: &Path,
    data: &Path,
    extra: &str,
) -> std::path::PathBuf {
    let path = dir.join("config.yaml");
    fs::write(&path, fixture_yaml(case, model, data, &dir.join("out"), extra)).unwrap();
    path
}

fn fixture_config(dir: &Path, case: &str) -> std::path::PathBuf {
    write_config(dir, case, &case_dir(case).join("model"), &case_dir(case).join("data.jsonl"), "")
}

fn train(config: &Path) -> Output {
    horizon(&["train", "--config", config.to_str().unwrap()])
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Run and expect failure with a message containing every one of `needles`, and no panic.
fn expect_error(config: &Path, needles: &[&str]) {
    let o = train(config);
    let err = stderr(&o);
    assert!(!o.status.success(), "expected failure, got success; stderr: {err}");
    assert!(!err.contains("panicked"), "panicked instead of an error: {err}");
    for n in needles {
        assert!(err.contains(n), "error should mention {n:?}: {err}");
    }
}

#[test]
fn train_reproduces_fixtures() {
    for case in CASES {
        let tmp = tempfile::tempdir().unwrap();
        let o = train(&fixture_config(tmp.path(), case));
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let e = expected(case);
        let metrics: Vec<Value> = fs::read_to_string(tmp.path().join("out/metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let (losses, norms) = (f64s(&e["loss_per_step"]), f64s(&e["grad_norm_per_step"]));
        assert_eq!(metrics.len(), losses.len());
        for (k, m) in metrics.iter().enumerate() {
            assert_eq!(m["step"].as_u64(), Some(k as u64 + 1));
            for key in ["lr", "tokens", "step_s"] {
                assert!(m[key].is_number(), "{case}: metrics line {k} lacks {key}");
            }
            assert_rel(&format!("{case} loss {k}"), m["loss"].as_f64().unwrap(), losses[k], 1e-5);
            assert_rel(
                &format!("{case} grad_norm {k}"),
                m["grad_norm"].as_f64().unwrap(),
                norms[k],
                1e-5,
            );
            // A mixture of experts reports its objective's two parts beside it.
            for key in ["ce_loss", "aux_loss"].into_iter().filter(|_| is_moe(case)) {
                let want = f64s(&e[format!("{key}_per_step").as_str()])[k];
                let got = m[key].as_f64().unwrap_or_else(|| panic!("{case}: no {key}"));
                assert_rel(&format!("{case} {key} {k}"), got, want, 1e-5);
            }
            assert_eq!(m.get("aux_loss").is_some(), is_moe(case), "{case}: {m}");
        }
        // final/ is a HF directory with HF tensor names, compared by the update error.
        let final_dir = tmp.path().join("out/final");
        let cfg: Value =
            serde_json::from_str(&fs::read_to_string(final_dir.join("config.json")).unwrap())
                .unwrap();
        // The exported model_type is the source checkpoint's (`expected.json`'s "arch" names the
        // family: "gemma3" for a gemma3_text model).
        let src: Value = serde_json::from_str(
            &fs::read_to_string(case_dir(case).join("model/config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["model_type"], src["model_type"]);
        let names = e["param_names"].as_array().unwrap();
        for name in names.iter().map(|n| n.as_str().unwrap()) {
            let (_, got) = read_tensor_f64(&final_dir.join("model.safetensors"), name).unwrap();
            let got: Vec<f32> = got.iter().map(|&x| x as f32).collect();
            let init: Vec<f32> = initial(case, name).iter().map(|&x| x as f32).collect();
            let want = tensor(case, "final.safetensors", name);
            let err = update_rel_err(&got, &init, &want);
            let tol = update_tol(e["pytorch_fp32"]["update_rel_l2_err"][name].as_f64().unwrap());
            assert!(err <= tol, "{case} {name}: update error {err:.3e} > {tol:.1e}");
        }
    }
}

#[test]
fn two_runs_are_bit_identical() {
    let case = "qwen2_tied_padded";
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for d in [&a, &b] {
        let o = train(&fixture_config(d.path(), case));
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let wa = fs::read(a.path().join("out/final/model.safetensors")).unwrap();
    let wb = fs::read(b.path().join("out/final/model.safetensors")).unwrap();
    assert!(wa == wb, "two identical runs wrote different weights");
}

#[test]
fn missing_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-model");
    let cfg = write_config(
        tmp.path(),
        "llama_gqa",
        &missing,
        &case_dir("llama_gqa").join("data.jsonl"),
        "",
    );
    expect_error(&cfg, &["no-such-model", "model.path"]);
}

/// A copy of a fixture model directory that the test may damage.
fn model_copy(tmp: &Path, case: &str) -> std::path::PathBuf {
    let dst = tmp.join("model");
    fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "model.safetensors"] {
        fs::copy(case_dir(case).join("model").join(f), dst.join(f)).unwrap();
    }
    dst
}

#[test]
fn truncated_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_copy(tmp.path(), "llama_gqa");
    let file = model.join("model.safetensors");
    let len = fs::metadata(&file).unwrap().len();
    fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(len / 2).unwrap();
    let cfg = write_config(
        tmp.path(),
        "llama_gqa",
        &model,
        &case_dir("llama_gqa").join("data.jsonl"),
        "",
    );
    expect_error(&cfg, &["model.safetensors"]);
}

#[test]
fn misspelled_config_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "llama_gqa",
        &case_dir("llama_gqa").join("model"),
        &case_dir("llama_gqa").join("data.jsonl"),
        "engine: { head_chunk_rowz: 4 }\n",
    );
    expect_error(&cfg, &["head_chunk_rowz", "config.yaml"]);
}

#[test]
fn tensor_missing_from_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_copy(tmp.path(), "llama_gqa");
    // Rewrite the checkpoint without one tensor.
    let file = model.join("model.safetensors");
    let names = horizon::hf::checkpoint::list_tensors(&file).unwrap();
    let dropped = "model.layers.1.mlp.up_proj.weight";
    let kept: Vec<(String, Vec<usize>, Vec<f32>)> = names
        .iter()
        .filter(|n| n.as_str() != dropped)
        .map(|n| {
            let (shape, data) = read_tensor_f64(&file, n).unwrap();
            (n.clone(), shape, data.iter().map(|&x| x as f32).collect())
        })
        .collect();
    let views: Vec<(String, Vec<usize>, &[f32])> =
        kept.iter().map(|(n, s, d)| (n.clone(), s.clone(), d.as_slice())).collect();
    horizon::hf::checkpoint::write_safetensors(
        &file,
        &views,
        horizon::hf::checkpoint::SaveDtype::F32,
    )
    .unwrap();
    let cfg = write_config(
        tmp.path(),
        "llama_gqa",
        &model,
        &case_dir("llama_gqa").join("data.jsonl"),
        "",
    );
    expect_error(&cfg, &[dropped]);
}

#[test]
fn token_or_label_outside_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("bad.jsonl");
    // llama_gqa has a vocabulary of 256.
    fs::write(
        &data,
        "{\"input_ids\": [1, 2, 3], \"labels\": [1, 2, 3]}\n{\"input_ids\": [1, 256, 3]}\n",
    )
    .unwrap();
    let cfg =
        write_config(tmp.path(), "llama_gqa", &case_dir("llama_gqa").join("model"), &data, "");
    expect_error(&cfg, &["bad.jsonl", ":2", "256"]);
    fs::write(&data, "{\"input_ids\": [1, 2, 3], \"labels\": [1, 999, 3]}\n").unwrap();
    expect_error(&cfg, &["bad.jsonl", ":1", "999"]);
}

#[test]
fn empty_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("empty.jsonl");
    fs::write(&data, "\n").unwrap();
    let cfg =
        write_config(tmp.path(), "llama_gqa", &case_dir("llama_gqa").join("model"), &data, "");
    expect_error(&cfg, &["empty.jsonl"]);
}

#[test]
fn resume_without_a_config_is_a_clear_error() {
    // `horizon train` alone runs the built-in default job (tests/default_job.rs); resuming
    // needs the run's config.
    let o = horizon(&["train", "--resume", "latest"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--config"), "{}", stderr(&o));
}

/// A small random model and the Qwen-style fixture tokenizer (500 ids).
fn chat_config(dir: &Path, data: &str, extra_data: &str) -> std::path::PathBuf {
    let data_path = dir.join("chat.jsonl");
    fs::write(&data_path, data).unwrap();
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/qwen2");
    let yaml = format!(
        "model: {{ init: random, arch: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,\n\
         \x20        num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 512 }}\n\
         data: {{ path: '{}', format: chat, tokenizer: '{}'{extra_data} }}\n\
         train: {{ steps: 2, batch_size: 2, max_seq_len: 64 }}\n\
         output: {{ dir: '{}' }}\n",
        data_path.display(),
        tok.display(),
        dir.join("out").display()
    );
    let path = dir.join("config.yaml");
    fs::write(&path, yaml).unwrap();
    path
}

const CHAT: &str = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello there\"}]}\n\
{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, {\"role\": \"user\", \"content\": \"2+2?\"}, {\"role\": \"assistant\", \"content\": \"4\"}]}\n";

#[test]
fn chat_data_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let o = train(&chat_config(tmp.path(), CHAT, ""));
    assert!(o.status.success(), "{}", stderr(&o));
    let metrics = fs::read_to_string(tmp.path().join("out/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2);
}

#[test]
fn wrong_role_in_chat() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = format!(
        "{CHAT}{{\"messages\": [{{\"role\": \"bot\", \"content\": \"x\"}}, {{\"role\": \"assistant\", \"content\": \"y\"}}]}}\n"
    );
    expect_error(&chat_config(tmp.path(), &bad, ""), &["chat.jsonl:3", "bot"]);
}

#[test]
fn chat_template_missing() {
    let tmp = tempfile::tempdir().unwrap();
    // The byte tokenizer has a built-in template; a tokenizer directory without one fails.
    let tokdir = tmp.path().join("tok");
    fs::create_dir_all(&tokdir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizers/qwen2/tokenizer.json");
    fs::copy(src, tokdir.join("tokenizer.json")).unwrap();
    let cfg = chat_config(tmp.path(), CHAT, "");
    let yaml = fs::read_to_string(&cfg).unwrap().replace("tokenizers/qwen2", "NOPE");
    let yaml = yaml.replace(
        &format!("{}", Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/NOPE").display()),
        &tokdir.display().to_string(),
    );
    fs::write(&cfg, yaml).unwrap();
    expect_error(&cfg, &["chat template"]);
}

#[test]
fn output_directory_not_writable() {
    let tmp = tempfile::tempdir().unwrap();
    let blocker = tmp.path().join("file");
    fs::write(&blocker, "not a directory").unwrap();
    let cfg = fixture_config(tmp.path(), "llama_gqa");
    let yaml = fs::read_to_string(&cfg).unwrap().replace(
        &format!("dir: '{}'", tmp.path().join("out").display()),
        &format!("dir: '{}'", blocker.join("out").display()),
    );
    fs::write(&cfg, yaml).unwrap();
    expect_error(&cfg, &["output.dir"]);
}

#[test]
fn resume_from_a_different_model() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = fixture_config(tmp.path(), "llama_gqa");
    let yaml = fs::read_to_string(&cfg)
        .unwrap()
        .replace("max_seq_len: 64 }", "max_seq_len: 64, save_every: 1 }");
    fs::write(&cfg, &yaml).unwrap();
    let o = train(&cfg);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt = tmp.path().join("out/checkpoints/step-00000003");
    assert!(ckpt.is_dir());
    let other = tempfile::tempdir().unwrap();
    let cfg2 = fixture_config(other.path(), "qwen2_tied_padded");
    let o =
        horizon(&["train", "--config", cfg2.to_str().unwrap(), "--resume", ckpt.to_str().unwrap()]);
    let err = stderr(&o);
    assert!(
        !o.status.success() && err.contains("different model") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn a_non_finite_weight_is_refused_and_a_run_whose_every_step_is_skipped_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_copy(tmp.path(), "llama_gqa");
    // One inf in a v_proj weight.
    let file = model.join("model.safetensors");
    let bad = "model.layers.1.self_attn.v_proj.weight";
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = horizon::hf::checkpoint::list_tensors(&file)
        .unwrap()
        .into_iter()
        .map(|n| {
            let (shape, data) = read_tensor_f64(&file, &n).unwrap();
            let mut data: Vec<f32> = data.iter().map(|&x| x as f32).collect();
            if n == bad {
                data[70] = f32::INFINITY;
            }
            (n, shape, data)
        })
        .collect();
    let views: Vec<(String, Vec<usize>, &[f32])> =
        tensors.iter().map(|(n, s, d)| (n.clone(), s.clone(), d.as_slice())).collect();
    let f32s = horizon::hf::checkpoint::SaveDtype::F32;
    horizon::hf::checkpoint::write_safetensors(&file, &views, f32s).unwrap();
    let data = case_dir("llama_gqa").join("data.jsonl");
    let cfg = write_config(tmp.path(), "llama_gqa", &model, &data, "");
    // Loading refuses it, naming the file, the tensor, the index, the value and the way out.
    expect_error(
        &cfg,
        &["model.safetensors", bad, "inf at flat index 70", "[1, 6]", "model.allow_non_finite"],
    );
    // Loaded anyway: every step is skipped, and the run fails without exporting.
    let yaml =
        fs::read_to_string(&cfg).unwrap().replace("model: {", "model: { allow_non_finite: true,");
    fs::write(&cfg, yaml).unwrap();
    expect_error(&cfg, &["every one of the 3 steps", "skipped", "no update was applied"]);
    let out = tmp.path().join("out");
    assert!(!out.join("final").exists(), "the broken weights were exported");
    let summary: Value =
        serde_json::from_str(&fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["skipped_steps"], 3, "{summary}");
}

#[test]
fn a_second_run_into_the_same_output_dir_is_refused_and_the_first_is_unharmed() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let yaml = format!(
        "model: {{ init: random, arch: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,\n\
         \x20        num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 64 }}\n\
         data: {{ format: synthetic }}\n\
         train: {{ steps: 4, batch_size: 2, max_seq_len: 8, save_every: 1 }}\n\
         output: {{ dir: '{}' }}\n",
        out.display()
    );
    let cfg = tmp.path().join("c.yaml");
    fs::write(&cfg, yaml).unwrap();
    // The first run pauses 300 ms in each of its four saves: alive for over a second.
    let mut first = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .env("HORIZON_TEST_SAVE_PAUSE_MS", "300")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    // Its first checkpoint is being written: the lock is held.
    lines
        .find(|l| l.as_ref().unwrap().starts_with("saving checkpoint"))
        .expect("a save line")
        .unwrap();
    let second = horizon(&["train", "--config", cfg.to_str().unwrap(), "--set", "train.steps=2"]);
    let err = stderr(&second);
    assert!(!second.status.success(), "the second run should be refused");
    assert!(!err.contains("panicked"), "{err}");
    let want = format!(
        "output.dir {} is in use by another horizon run (pid {})",
        out.display(),
        first.id()
    );
    assert!(err.contains(&want), "{err}");
    // It wrote nothing there: the first run's config stands, and the first run finishes with
    // every checkpoint and its export.
    for _ in lines.by_ref() {}
    let status = first.wait().unwrap();
    assert!(status.success(), "the first run failed: {status}");
    assert!(fs::read_to_string(out.join("config.yaml")).unwrap().contains("steps: 4"));
    assert!(out.join("checkpoints/step-00000004/state.json").is_file());
    assert!(out.join("final/model.safetensors").is_file());
    // Released on exit: the directory is free again (a new run there starts over when asked:
    // it holds the first run's checkpoints).
    let c = cfg.to_str().unwrap();
    let again = horizon(&["train", "--config", c, "--set", "train.steps=1", "--overwrite"]);
    assert!(again.status.success(), "{}", stderr(&again));
}

/// An interrupted run tells the truth (issue 45): SIGINT (and SIGTERM) finish the step in
/// flight and write a checkpoint, then the run exits 130 (143), writes no `final/`, its
/// `summary.json` and `report.md` say where it stopped, and the resume command it prints
/// carries the run's `--set` overrides. Resuming it runs to the end; resuming the finished run
/// says there is nothing to do and leaves its files as they are.
#[test]
fn an_interrupted_run_says_so_and_exits_with_the_signal() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    for (sig, code) in [("-INT", 130), ("-TERM", 143)] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("elsewhere");
        let yaml = "model: { init: random, arch: llama, hidden_size: 32, intermediate_size: 64, \
                    num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1, \
                    vocab_size: 64 }\ndata: { format: synthetic }\n\
                    train: { steps: 6, batch_size: 2, max_seq_len: 8, save_every: 1 }\n\
                    output: { dir: unused }\n";
        let cfg = tmp.path().join("c.yaml");
        fs::write(&cfg, yaml).unwrap();
        let set = format!("output.dir={}", out.display());
        let args = ["train", "--config", cfg.to_str().unwrap(), "--set", &set];
        let mut run = Command::new(env!("CARGO_BIN_EXE_horizon"))
            .args(args)
            .env("HORIZON_TEST_SAVE_PAUSE_MS", "300")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(run.stdout.take().unwrap()).lines();
        let _ =
            lines.find(|l| l.as_ref().unwrap().starts_with("saving checkpoint")).expect("a save");
        let pid = run.id().to_string();
        assert!(Command::new("kill").args([sig, &pid]).status().unwrap().success());
        let said: Vec<String> = lines.map(|l| l.unwrap()).collect();
        let status = run.wait().unwrap();
        assert_eq!(status.code(), Some(code), "{sig}: {said:?}");
        let resume = said.iter().find(|l| l.contains("--resume latest")).expect("a resume line");
        assert!(resume.contains(&format!("--set {set}")), "{resume}");
        assert!(!out.join("final").exists(), "{sig}: no final/ for an interrupted run");
        let summary: Value =
            serde_json::from_str(&fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
        let at = summary["interrupted_at_step"].as_u64().expect("interrupted_at_step");
        assert!((1..6).contains(&at), "{summary}");
        let report = fs::read_to_string(out.join("report.md")).unwrap();
        assert!(report.contains(&format!("interrupted at step {at}")), "{report}");
        assert!(!report.contains("final eval"), "{report}");
        // Resumed: it runs to the end; resumed again: nothing to do, nothing rewritten.
        let resumed = horizon(&[&args[..], &["--resume", "latest"]].concat());
        assert!(resumed.status.success(), "{}", stderr(&resumed));
        assert!(out.join("final").exists());
        let report = fs::read_to_string(out.join("report.md")).unwrap();
        let again = horizon(&[&args[..], &["--resume", "latest"]].concat());
        assert!(again.status.success(), "{}", stderr(&again));
        let text = String::from_utf8_lossy(&again.stdout);
        assert!(text.contains("nothing to do"), "{text}");
        assert_eq!(fs::read_to_string(out.join("report.md")).unwrap(), report, "report kept");
    }
}

/// A one-layer random Llama on synthetic data into `dir/out`, with `sections` (YAML lines,
/// `train:` among them), written to `dir/c.yaml`.
fn tiny_config(dir: &Path, sections: &str) -> std::path::PathBuf {
    let yaml = format!(
        "model: {{ init: random, arch: llama, hidden_size: 32, intermediate_size: 64, \
         num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 64 }}\n\
         data: {{ format: synthetic }}\n{sections}\noutput: {{ dir: '{}' }}\n",
        dir.join("out").display()
    );
    let cfg = dir.join("c.yaml");
    fs::write(&cfg, yaml).unwrap();
    cfg
}

/// `final/` is never written with a non-finite weight (issue 45): an update that would overflow
/// the masters (a learning rate past f32's range) on the last step is held back, element by
/// element, so no weight goes non-finite; the step is reported bad, and a run none of whose
/// steps trained cleanly writes no `final/`; the run fails. (Before the updates were held, the
/// export's own scan of the weights stopped it, naming the tensor: it still stands behind.)
#[test]
fn final_is_never_written_with_a_non_finite_weight() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let cfg = tiny_config(
        tmp.path(),
        "train: { steps: 1, batch_size: 2, max_seq_len: 8 }\n\
         optimizer: { lr: 1.0e+39, grad_clip: 0.0 }",
    );
    let o = train(&cfg);
    let e = stderr(&o);
    assert!(!o.status.success(), "{e}");
    assert!(e.contains("was not written") && e.contains("after training"), "{e}");
    assert!(!out.join("final").exists());
    let metrics = fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"held\"") && metrics.contains("model.layers.0"), "{metrics}");
}

/// A new run into an `output.dir` that holds another run's checkpoints is refused (issue 45:
/// it overwrote their files, and a later `--resume latest` picked the earlier run's), unless
/// `--overwrite` says to start over (the earlier checkpoints removed) or `--resume` to go on.
#[test]
fn a_new_run_over_another_runs_checkpoints_is_refused_unless_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config(
        tmp.path(),
        "train: { steps: 2, batch_size: 2, max_seq_len: 8, save_every: 1 }",
    );
    assert!(train(&cfg).status.success());
    let o = train(&cfg);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("--overwrite") && e.contains("step-00000002"), "{e}");
    let c = cfg.to_str().unwrap();
    let o = horizon(&["train", "--config", c, "--overwrite"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("starting over"));
}

/// `train.epochs` instead of `steps`: the run takes ceil(epochs x rows / batch) steps, says what
/// an epoch is in steps, and logs each step's epoch as HF's Trainer does; both keys set is a
/// clear error.
#[test]
fn epochs_set_the_steps_from_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let third = "{\"messages\": [{\"role\": \"user\", \"content\": \"yes?\"}, {\"role\": \"assistant\", \"content\": \"no\"}]}\n";
    let config = chat_config(tmp.path(), &format!("{CHAT}{third}"), "");
    let yaml = fs::read_to_string(&config).unwrap().replace("steps: 2,", "epochs: 2,");
    fs::write(&config, &yaml).unwrap();
    let o = train(&config);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = "3 training rows in batches of 2: 1.5 steps an epoch; 3 steps = 2 epochs";
    assert!(out.contains(line), "{out}");
    let metrics = fs::read_to_string(tmp.path().join("out/metrics.jsonl")).unwrap();
    let epochs: Vec<f64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["epoch"].as_f64().unwrap())
        .collect();
    let want = [2.0 / 3.0, 4.0 / 3.0, 2.0];
    assert!(epochs.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12), "{epochs:?}");
    assert_eq!(epochs.len(), 3);
    fs::write(&config, yaml.replace("epochs: 2,", "epochs: 2, steps: 5,")).unwrap();
    expect_error(&config, &["train.steps (5) and train.epochs (2) are both set", "hint"]);
    fs::write(&config, yaml.replace("epochs: 2,", "epochs: 0,")).unwrap();
    expect_error(&config, &["train.epochs must be a positive number"]);
}

/// Every step's metrics reach TensorBoard's event file under HF Trainer's tags (read back with
/// the project's reader; `scripts/check-tensorboard.py` reads it with TensorBoard's own), with
/// the config as text; `output.tensorboard: false` writes none.
#[test]
fn a_run_writes_tensorboard_events_unless_asked_not_to() {
    let tmp = tempfile::tempdir().unwrap();
    let o = train(&chat_config(tmp.path(), CHAT, ""));
    assert!(o.status.success(), "{}", stderr(&o));
    let tb = tmp.path().join("out/tb");
    let files: Vec<_> = fs::read_dir(&tb).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].file_name().unwrap().to_str().unwrap().starts_with("events.out.tfevents."));
    let events = horizon::run::tensorboard::read_events(&files[0]).unwrap();
    assert!(events[0].texts[0].1.contains("batch_size: 2"), "{:?}", events[0]);
    let metrics = fs::read_to_string(tmp.path().join("out/metrics.jsonl")).unwrap();
    for (line, e) in metrics.lines().zip(&events[1..]) {
        let m: Value = serde_json::from_str(line).unwrap();
        assert_eq!(e.step, m["step"].as_u64().unwrap());
        let loss = e.scalars.iter().find(|(t, _)| t == "train/loss").unwrap().1;
        assert_eq!(loss, m["loss"].as_f64().unwrap() as f32);
        for tag in ["train/learning_rate", "train/grad_norm", "train/epoch", "train/tokens"] {
            assert!(e.scalars.iter().any(|(t, _)| t == tag), "{tag} at step {}", e.step);
        }
    }
    assert_eq!(events.len(), 1 + metrics.lines().count());
    let off = tempfile::tempdir().unwrap();
    let config = chat_config(off.path(), CHAT, "");
    let yaml =
        fs::read_to_string(&config).unwrap().replace("output: {", "output: { tensorboard: false,");
    fs::write(&config, yaml).unwrap();
    let o = train(&config);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!off.path().join("out/tb").exists());
}
