//! DPO as a user runs it (`train.objective: dpo`, `data.format: preference`, `horizon train`'s
//! `run_streaming`): TRL 1.16's fixtures (`tests/fixtures/dpo`) step by step from
//! `metrics.jsonl` (loss, grad norm, every reward metric), the conversational records through
//! the chat template equal to the pretokenized ones, `final/` written, TensorBoard's tags, a
//! resume that reads the reference back from the checkpoint (bit for bit the uninterrupted
//! run) and refuses changed data naming the file, and the held-out pairs' metrics.

mod common;

use std::path::Path;

use common::dpo::{assert_loss_and_norm, config, dir, expected, metrics, run};
use horizon::run::config::{BackendKind, RawConfig};
use serde_json::Value;

/// `OUT/metrics.jsonl`'s lines without their wall times.
fn untimed(out: &Path) -> Vec<Value> {
    let mut v = metrics(out);
    v.iter_mut().for_each(|l| {
        l.as_object_mut().unwrap().remove("step_s");
    });
    v
}

/// Every logged step against the fixture, within its README's tolerances.
fn assert_steps_match(case: &str, lines: &[Value]) {
    let e = expected(case);
    let pt = &e["pytorch_fp32"];
    let want = e["per_step"].as_array().unwrap();
    assert_eq!(lines.len(), want.len(), "{case}: one line a step");
    for (k, (got, want)) in lines.iter().zip(want).enumerate() {
        let logged = (got["loss"].as_f64().unwrap(), got["grad_norm"].as_f64().unwrap());
        assert_loss_and_norm(&format!("{case} step {k}"), logged, want, pt);
        for key in [
            "rewards_chosen",
            "rewards_rejected",
            "reward_accuracy",
            "reward_margin",
            "logps_chosen",
            "logps_rejected",
        ] {
            let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
            let tol = (10.0 * pt["metrics_max_abs_err"][key].as_f64().unwrap_or(1e-6)).max(1e-4);
            assert!((g - w).abs() <= tol, "{case} step {k} {key}: {g} vs {w}");
        }
    }
}

#[test]
fn dpo_runs_match_trl_from_the_config_to_final() {
    for case in ["dpo_llama_full", "dpo_qwen2_lora"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        run(&config(case, &dir(case).join("data.jsonl"), &out, ""), None).unwrap();
        assert_steps_match(case, &metrics(&out));
        let final_file = match case {
            "dpo_qwen2_lora" => "adapter_config.json",
            _ => "config.json",
        };
        assert!(out.join("final").join(final_file).is_file(), "{case}: final/{final_file}");
        let ckpt = out.join("checkpoints/step-00000003/dpo_reference.bin");
        assert!(ckpt.is_file(), "{case}: the checkpoint keeps the reference");
        let tb = std::fs::read_dir(out.join("tb")).unwrap().next().unwrap().unwrap().path();
        let events = horizon::run::tensorboard::read_events(&tb).unwrap();
        let tags: Vec<&str> =
            events.iter().flat_map(|e| e.scalars.iter().map(|(t, _)| t.as_str())).collect();
        assert!(tags.contains(&"train/rewards/margins"), "{case}: {tags:?}");
    }
}

/// The LoRA case's records as conversations, rendered by the model's chat template: the same
/// steps as its pretokenized records (TRL's tokenization, token for token).
#[test]
fn conversational_records_train_as_their_tokens() {
    let case = "dpo_qwen2_lora";
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("ids"), tmp.path().join("text"));
    run(&config(case, &dir(case).join("data.jsonl"), &a, ""), None).unwrap();
    run(&config(case, &dir(case).join("data_text.jsonl"), &b, ""), None).unwrap();
    assert_eq!(untimed(&a), untimed(&b));
}

/// A run stopped after step 1 and resumed: the reference comes from the checkpoint, and the
/// resumed steps are the uninterrupted run's, bit for bit. Changed data is refused, naming
/// the checkpoint's reference file.
#[test]
fn resume_reads_the_reference_back_and_refuses_changed_data() {
    let case = "dpo_llama_full";
    let tmp = tempfile::tempdir().unwrap();
    // A copy of the data, changed in place below (the path is a key a resume keeps).
    let data = tmp.path().join("pairs.jsonl");
    std::fs::copy(dir(case).join("data.jsonl"), &data).unwrap();
    let whole = tmp.path().join("whole");
    run(&config(case, &data, &whole, ""), None).unwrap();
    let parted = tmp.path().join("parted");
    let first = config(case, &data, &parted, "").replace("steps: 3,", "steps: 1,");
    run(&first, None).unwrap();
    run(&config(case, &data, &parted, ""), Some("latest")).unwrap();
    assert_eq!(untimed(&whole), untimed(&parted));

    // The same file, its pairs in another order: the stored reference no longer matches.
    let text = std::fs::read_to_string(&data).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    std::fs::write(&data, lines[1..].join("\n") + "\n" + lines[0] + "\n").unwrap();
    let more = config(case, &data, &parted, "").replace("steps: 3,", "steps: 5,");
    let err = format!("{:#}", run(&more, Some("latest")).unwrap_err());
    assert!(err.contains("dpo_reference.bin") && err.contains("other data"), "{err}");
}

/// Held-out pairs (`data.eval_path`): every DPO metric under `eval_`, after the last step.
#[test]
fn held_out_pairs_report_the_dpo_metrics() {
    let case = "dpo_qwen2_lora";
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let data = dir(case).join("data.jsonl");
    let yaml = config(case, &data, &out, "").replace(
        "format: preference }",
        &format!("format: preference, eval_path: '{}' }}", data.display()),
    );
    run(&yaml, None).unwrap();
    let last = metrics(&out).pop().unwrap();
    for key in ["eval_loss", "eval_reward_accuracy", "eval_reward_margin", "eval_logps_chosen"] {
        assert!(last[key].as_f64().is_some_and(f64::is_finite), "{key}: {last}");
    }
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["eval_rewards"]["reward_margin"], last["eval_reward_margin"]);
    assert_eq!(summary["final_rewards"]["reward_accuracy"], last["reward_accuracy"]);
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("final eval reward accuracy, margin"), "{report}");
}

/// `dpo.reference: live`'s copy on the CPU device ([`common::dpo::live_reference_check`]).
#[test]
fn the_live_reference_is_the_starting_weights_in_bf16() {
    use horizon::engine::options::WeightPath;
    use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};
    let dev = || CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20));
    common::dpo::live_reference_check(dev, BackendKind::Cpu, WeightPath::Masters);
}

/// A full fine-tune with `dpo.reference: live`: TRL's steps within the bf16 copy's rounding,
/// no reference file in the checkpoints, and a resume (the copy read again from the model)
/// bit for bit the uninterrupted run.
#[test]
fn a_live_reference_trains_and_resumes() {
    let case = "dpo_llama_full";
    let tmp = tempfile::tempdir().unwrap();
    let data = dir(case).join("data.jsonl");
    let live = |out: &Path| {
        config(case, &data, out, "")
            .replace("label_smoothing: 0.0 }", "label_smoothing: 0.0, reference: live }")
    };
    let whole = tmp.path().join("whole");
    assert!(live(&whole).contains("reference: live"), "{}", live(&whole));
    run(&live(&whole), None).unwrap();
    let e = expected(case);
    for (k, (got, want)) in
        metrics(&whole).iter().zip(e["per_step"].as_array().unwrap()).enumerate()
    {
        for (key, tol) in [("loss", 2e-2), ("grad_norm", 5e-2)] {
            let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
            assert!((g - w).abs() <= tol * w.abs(), "step {k} {key}: {g} vs {w}");
        }
    }
    assert!(!whole.join("checkpoints/step-00000003/dpo_reference.bin").exists());
    let parted = tmp.path().join("parted");
    run(&live(&parted).replace("steps: 3,", "steps: 1,"), None).unwrap();
    run(&live(&parted), Some("latest")).unwrap();
    assert_eq!(untimed(&whole), untimed(&parted));
}

/// `horizon plan` of a DPO run counts its reference: a precomputed reference's two f64 a
/// training and held-out pair, or a live reference's bf16 copy of the trained weights (and
/// nothing per pair).
#[test]
fn the_plan_counts_the_reference() {
    let case = "dpo_llama_full";
    let tmp = tempfile::tempdir().unwrap();
    let data = dir(case).join("data.jsonl");
    let plan = |extra: &str, live: bool| {
        let mut yaml = config(case, &data, &tmp.path().join("out"), extra);
        if live {
            yaml =
                yaml.replace("label_smoothing: 0.0 }", "label_smoothing: 0.0, reference: live }");
        }
        let cfg = RawConfig::from_yaml(&yaml, "dpo.yaml").unwrap().resolve("dpo.yaml").unwrap();
        horizon::run::plan::report(&cfg, Some(1 << 30)).unwrap()
    };
    let pre = plan("", false);
    let line = ("DPO reference log-probs (precomputed, 16 B a pair)", 16 * 12);
    assert!(pre.plan.host.contains(&line), "{}", pre.text);
    assert!(pre.text.contains("DPO reference log-probs"), "{}", pre.text);
    let live = plan("", true);
    let copy = live.plan.host.iter().find(|(k, _)| k.starts_with("DPO reference: the starting"));
    assert_eq!(copy.map(|c| c.1), Some(2 * live.plan.params), "{}", live.text);
    assert!(!live.text.contains("log-probs (precomputed"), "{}", live.text);
    assert_eq!(live.plan.host_total() - pre.plan.host_total(), 2 * live.plan.params - 16 * 12);
}

/// A pair with a token id past the model's vocabulary is refused before anything is planned,
/// naming its file and line.
#[test]
fn an_id_past_the_vocabulary_is_refused_by_line() {
    let case = "dpo_llama_full";
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("pairs.jsonl");
    let text = std::fs::read_to_string(dir(case).join("data.jsonl")).unwrap();
    let mut lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    lines[2]["chosen_input_ids"][0] = serde_json::json!(100_000);
    let text: String = lines.iter().map(|l| l.to_string() + "\n").collect();
    std::fs::write(&data, text).unwrap();
    let err =
        format!("{:#}", run(&config(case, &data, &tmp.path().join("out"), ""), None).unwrap_err());
    assert!(err.contains("pairs.jsonl:3: token id 100000 is >= the model's vocab_size"), "{err}");
}
