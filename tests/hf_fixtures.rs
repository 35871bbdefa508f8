//! The whole model against the Hugging Face reference fixtures (tests/fixtures, float64 HF runs):
//! step-0 hidden states, logits, loss and every parameter gradient; the loss and pre-clip
//! gradient norm of every step; every parameter after the last step. Tolerances: see the
//! tolerance table in ARCHITECTURE.md.

mod common;

use common::*;
use horizon::model::layout::ModelLayout;
use horizon::run::config::RawConfig;
use horizon::run::data::tokens_of;
use horizon::run::reference::ReferenceTrainer;

fn trainer(case: &str, head_chunk_rows: usize) -> ReferenceTrainer {
    let yaml = case_yaml(case, &format!("engine: {{ head_chunk_rows: {head_chunk_rows} }}\n"));
    let cfg = RawConfig::from_yaml(&yaml, case).unwrap().resolve(case).unwrap();
    ReferenceTrainer::new(cfg).unwrap()
}

/// Hidden states and logits of the first batch.
fn check_step0_forward(case: &str) {
    let mut t = trainer(case, 7);
    let (batch, _) = t.batch(0).unwrap();
    let (hidden, logits) = t.engine.forward_inspect(&t.state.params, tokens_of(&batch)).unwrap();
    for (i, h) in hidden.iter().enumerate() {
        let want = tensor(case, "step0_logits.safetensors", &format!("hidden_states.{i}"));
        let scale = want.iter().fold(0.0f64, |a, &x| a.max(x.abs()));
        let (err, at) = max_err_over(h, &want, scale);
        println!("{case} hidden_states.{i}: max err / max |h| = {err:.2e} at {at}");
        assert!(
            err < 1e-5,
            "{case} hidden_states.{i}: error {err:.3e} at {at} (tol 1e-5 of max |h|)"
        );
    }
    let want = tensor(case, "step0_logits.safetensors", "logits");
    let scale = want.iter().fold(0.0f64, |a, &x| a.max(x.abs()));
    let (err, at) = max_err_over(&logits, &want, scale);
    println!("{case} logits: max err / max |logit| = {err:.2e} at {at}");
    assert!(err < 1e-5, "{case} logits: error {err:.3e} at {at} (tol 1e-5 of max |logit|)");
}

/// Loss and every parameter's gradient of the first batch.
fn check_step0_grads(case: &str, head_chunk_rows: usize) {
    let mut t = trainer(case, head_chunk_rows);
    let (batch, _) = t.batch(0).unwrap();
    let out = t
        .engine
        .forward_backward(&t.state.params, &mut t.state.grads, tokens_of(&batch), batch.num_targets)
        .unwrap();
    let e = expected(case);
    assert_rel(&format!("{case} step-0 loss"), out.loss(), f64s(&e["loss_per_step"])[0], 1e-5);
    let layout: &ModelLayout = &t.engine.layout;
    let names: Vec<String> = e["param_names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect();
    let refs: Vec<Vec<f64>> =
        names.iter().map(|n| tensor(case, "step0_grads.safetensors", n)).collect();
    let model_max = refs.iter().flatten().fold(0.0f64, |a, &x| a.max(x.abs()));
    for (name, want) in names.iter().zip(&refs) {
        let got = named(layout, &t.state.grads, name);
        let (err, at) = max_err_over(&got, want, model_max);
        let pt = e["pytorch_fp32"]["step0_grad_err_over_model_max_grad"][name].as_f64().unwrap();
        println!("{case} grad {name}: err/model_max {err:.2e} (pytorch fp32 {pt:.2e})");
        assert!(
            err < 1e-5,
            "{case} grad {name}: error {err:.3e} of the largest gradient at {at} (tol 1e-5)"
        );
    }
}

/// Every step's loss and grad norm, and every parameter after the last step.
fn check_training(case: &str) {
    let mut t = trainer(case, 5);
    let e = expected(case);
    let init = t.state.params.clone();
    let losses = f64s(&e["loss_per_step"]);
    let norms = f64s(&e["grad_norm_per_step"]);
    for k in 0..losses.len() {
        let m = t.step(k).unwrap();
        assert_rel(&format!("{case} loss step {k}"), m.loss, losses[k], 1e-5);
        assert_rel(&format!("{case} grad_norm step {k}"), m.grad_norm, norms[k], 1e-5);
        if let Some(aux) = e.get("aux_loss_per_step") {
            let (ce, want_ce) = (m.ce_loss.unwrap(), f64s(&e["ce_loss_per_step"])[k]);
            assert_rel(&format!("{case} ce_loss step {k}"), ce, want_ce, 1e-5);
            assert_rel(
                &format!("{case} aux_loss step {k}"),
                m.aux_loss.unwrap(),
                f64s(aux)[k],
                1e-5,
            );
        }
    }
    let layout = &t.engine.layout;
    for name in param_names(case) {
        let want = tensor(case, "final.safetensors", &name);
        let got = named(layout, &t.state.params, &name);
        let w0 = named(layout, &init, &name);
        let err = update_rel_err(&got, &w0, &want);
        let pt = e["pytorch_fp32"]["update_rel_l2_err"][&name].as_f64().unwrap();
        let tol = update_tol(pt);
        println!("{case} update {name}: rel err {err:.2e} (pytorch fp32 {pt:.2e}, tol {tol:.1e})");
        assert!(
            err <= tol,
            "{case} {name}: update error {err:.3e} > {tol:.1e} (pytorch fp32 {pt:.2e})"
        );
    }
}

#[test]
fn llama_gqa_step0_forward() {
    check_step0_forward("llama_gqa");
}

#[test]
fn qwen2_tied_padded_step0_forward() {
    check_step0_forward("qwen2_tied_padded");
}

#[test]
fn llama_gqa_step0_grads() {
    check_step0_grads("llama_gqa", 256);
    check_step0_grads("llama_gqa", 5);
}

#[test]
fn qwen2_tied_padded_step0_grads() {
    check_step0_grads("qwen2_tied_padded", 256);
    check_step0_grads("qwen2_tied_padded", 5);
}

#[test]
fn llama_gqa_training() {
    check_training("llama_gqa");
}

#[test]
fn qwen2_tied_padded_training() {
    check_training("qwen2_tied_padded");
}

#[test]
fn qwen3_qknorm_step0_forward() {
    check_step0_forward("qwen3_qknorm");
}

#[test]
fn gemma3_sliding_step0_forward() {
    check_step0_forward("gemma3_sliding");
}

#[test]
fn qwen3_qknorm_step0_grads() {
    check_step0_grads("qwen3_qknorm", 256);
    check_step0_grads("qwen3_qknorm", 5);
}

#[test]
fn gemma3_sliding_step0_grads() {
    check_step0_grads("gemma3_sliding", 256);
    check_step0_grads("gemma3_sliding", 5);
}

#[test]
fn qwen3_qknorm_training() {
    check_training("qwen3_qknorm");
}

#[test]
fn gemma3_sliding_training() {
    check_training("gemma3_sliding");
}

/// The head chunking does not change the numbers at all: rows are independent.
#[test]
fn head_chunking_is_exact() {
    for case in CASES {
        let mut a = trainer(case, 1000);
        let mut b = trainer(case, 3);
        let (batch, _) = a.batch(0).unwrap();
        let oa = a
            .engine
            .forward_backward(
                &a.state.params,
                &mut a.state.grads,
                tokens_of(&batch),
                batch.num_targets,
            )
            .unwrap();
        let ob = b
            .engine
            .forward_backward(
                &b.state.params,
                &mut b.state.grads,
                tokens_of(&batch),
                batch.num_targets,
            )
            .unwrap();
        assert_eq!(oa.loss_sum.to_bits(), ob.loss_sum.to_bits(), "{case}");
        // The head gradient sums chunks in a different order; every layer gradient is identical.
        for (ga, gb) in a.state.grads.layers.iter().zip(&b.state.grads.layers) {
            let max = ga.iter().zip(gb).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(max < 1e-6, "{case}: layer gradients differ by {max}");
        }
    }
}

/// A backward run twice doubles the parameter gradients.
#[test]
fn backward_twice_doubles_gradients() {
    for case in CASES {
        let mut t = trainer(case, 256);
        let (batch, _) = t.batch(0).unwrap();
        t.engine
            .forward_backward(
                &t.state.params,
                &mut t.state.grads,
                tokens_of(&batch),
                batch.num_targets,
            )
            .unwrap();
        let once = t.state.grads.clone();
        t.engine
            .forward_backward(
                &t.state.params,
                &mut t.state.grads,
                tokens_of(&batch),
                batch.num_targets,
            )
            .unwrap();
        // The embedding gradient is a scatter-add: a token id repeated in the batch adds its rows
        // one by one, so `(g + a) + b` differs from `2 (a + b)` by rounding. Every other
        // gradient is summed before it is added, and doubles exactly.
        let embed_max = once.embed.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        for (&x, &y) in once.embed.iter().zip(&t.state.grads.embed) {
            assert!((2.0 * x - y).abs() <= 1e-6 * embed_max, "{case}: embedding {y} != 2 * {x}");
        }
        for (a, b) in once.buffers().iter().zip(t.state.grads.buffers()).skip(1) {
            for (&x, &y) in a.iter().zip(b) {
                assert_eq!((2.0 * x).to_bits(), y.to_bits(), "{case}: {y} != 2 * {x}");
            }
        }
    }
}

/// The language model of a `gemma3` multimodal checkpoint: its `text_config`, its tensors under
/// `language_model.`, the vision tower's ignored; the same weights as the text-only fixture.
#[test]
fn gemma3_multimodal_checkpoint_loads_its_language_model() {
    use horizon::hf::checkpoint::{SaveDtype, write_safetensors};
    use horizon::hf::config::ModelConfig;
    use horizon::model::params::ParamStore;
    let case = "gemma3_sliding";
    let text = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let layout = horizon::model::describe(&text);
    let want = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mm = serde_json::json!({
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text.raw,
        "vision_config": {"model_type": "siglip_vision_model"},
    });
    std::fs::write(dir.path().join("config.json"), mm.to_string()).unwrap();
    let vision = vec![0.5f32; 6];
    let mut tensors: Vec<(String, Vec<usize>, &[f32])> = layout
        .hf_tensors()
        .into_iter()
        .map(|(n, shape)| (format!("language_model.{n}"), shape, want.tensor(&layout, &n).unwrap()))
        .collect();
    tensors.push(("vision_tower.patch.weight".into(), vec![2, 3], &vision));
    write_safetensors(&dir.path().join("model.safetensors"), &tensors, SaveDtype::F32).unwrap();
    let cfg = ModelConfig::from_file(&dir.path().join("config.json")).unwrap();
    assert_eq!(cfg.tensor_prefix, "language_model.");
    let mm_layout = horizon::model::describe(&cfg);
    assert_eq!(ParamStore::load_hf(&mm_layout, dir.path()).unwrap(), want);
    // A missing language-model tensor is still named.
    tensors.remove(0);
    write_safetensors(&dir.path().join("model.safetensors"), &tensors, SaveDtype::F32).unwrap();
    let err = format!("{:#}", ParamStore::load_hf(&mm_layout, dir.path()).unwrap_err());
    assert!(err.contains("language_model.model.embed_tokens.weight"), "{err}");
}

#[test]
fn qwen3_moe_step0_forward() {
    check_step0_forward("qwen3_moe");
}

#[test]
fn mixtral_step0_forward() {
    check_step0_forward("mixtral");
}

#[test]
fn qwen3_moe_step0_grads() {
    check_step0_grads("qwen3_moe", 256);
    check_step0_grads("qwen3_moe", 5);
}

#[test]
fn mixtral_step0_grads() {
    check_step0_grads("mixtral", 5);
}

#[test]
fn qwen3_moe_training() {
    check_training("qwen3_moe");
}

#[test]
fn mixtral_training() {
    check_training("mixtral");
}

#[test]
fn gpt_oss_step0_forward() {
    check_step0_forward("gpt_oss");
    check_step0_forward("gpt_oss_mxfp4");
}

#[test]
fn gpt_oss_step0_grads() {
    check_step0_grads("gpt_oss", 5);
    check_step0_grads("gpt_oss_mxfp4", 256);
}

#[test]
fn gpt_oss_training() {
    check_training("gpt_oss");
    check_training("gpt_oss_mxfp4");
}
