//! Mixture-of-experts input checks: a config that disagrees with its checkpoint's experts, a
//! missing expert tensor, top-k above the expert count and the variants Horizon does not run
//! are refused with errors that name the key or tensor.

mod common;

use std::path::Path;

use common::*;
use horizon::hf::config::ModelConfig;
use horizon::model::params::ParamStore;

fn config(case: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(case_dir(case).join("model/config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn refused(raw: &serde_json::Value) -> String {
    ModelConfig::from_json(raw, "config.json").unwrap_err().to_string()
}

/// Loading the checkpoint in `dir` as `raw` describes it: the error.
fn load_error(raw: &serde_json::Value, dir: &Path) -> String {
    let cfg = ModelConfig::from_json(raw, "config.json").unwrap();
    let layout = horizon::model::describe(&cfg);
    ParamStore::load_hf(&layout, dir).map(|_| ()).unwrap_err().to_string()
}

#[test]
fn an_expert_count_that_disagrees_with_the_checkpoint_is_refused() {
    let mut raw = config("qwen3_moe");
    raw["num_local_experts"] = 4.into();
    let err = load_error(&raw, &case_dir("qwen3_moe").join("model"));
    assert!(err.contains("unexpected: model.layers.0.mlp.experts.4"), "{err}");
    assert!(err.contains("num_experts or num_local_experts"), "{err}");
    let mut raw = config("mixtral");
    raw["num_local_experts"] = 9.into();
    let err = load_error(&raw, &case_dir("mixtral").join("model"));
    assert!(err.contains("missing: model.layers.0.block_sparse_moe.experts.8.w1.weight"), "{err}");
    // Both keys, disagreeing.
    let mut raw = config("qwen3_moe");
    raw["num_experts"] = 16.into();
    let err = refused(&raw);
    assert!(err.contains("num_experts (16) and num_local_experts (8) disagree"), "{err}");
}

#[test]
fn a_missing_expert_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let src = case_dir("qwen3_moe").join("model");
    let ckpt = horizon::hf::Checkpoint::open(&src).unwrap();
    let gone = "model.layers.2.mlp.experts.5.up_proj.weight";
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = ckpt
        .names()
        .into_iter()
        .filter(|n| n != gone)
        .map(|n| {
            let shape = ckpt.shape(&n).unwrap();
            let mut data = vec![0.0; shape.iter().product()];
            let nf = horizon::hf::checkpoint::NonFinite::Refuse;
            ckpt.read_f32(&n, &shape, &mut data, nf).unwrap();
            (n, shape, data)
        })
        .collect();
    let views: Vec<(String, Vec<usize>, &[f32])> =
        tensors.iter().map(|(n, s, d)| (n.clone(), s.clone(), &d[..])).collect();
    let out = dir.path().join("model.safetensors");
    horizon::hf::write_safetensors(&out, &views, horizon::hf::SaveDtype::F32).unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let err = load_error(&config("qwen3_moe"), dir.path());
    assert!(err.contains(&format!("1 missing: {gone}")), "{err}");
}

#[test]
fn top_k_above_the_expert_count_is_refused() {
    let mut raw = config("mixtral");
    raw["num_experts_per_tok"] = 9.into();
    let err = refused(&raw);
    assert!(
        err.contains("num_experts_per_tok (9) is larger than the number of experts (8)"),
        "{err}"
    );
}

#[test]
fn unsupported_moe_variants_are_named() {
    let mut raw = config("qwen3_moe");
    raw["model_type"] = "deepseek_v3".into();
    let err = refused(&raw);
    assert!(err.contains("multi-head latent attention (MLA)"), "{err}");
    for (key, what) in [
        ("n_group", "grouped routing"),
        ("kv_lora_rank", "multi-head latent attention"),
        ("router_jitter_noise", "routing noise"),
    ] {
        let mut raw = config("qwen3_moe");
        raw[key] = 4.into();
        let err = refused(&raw);
        assert!(err.contains(key) && err.contains(what), "{key}: {err}");
    }
}

#[test]
fn sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step() {
    let moe = |raw: &serde_json::Value| ModelConfig::from_json(raw, "c").unwrap().moe.unwrap();
    let raw = config("qwen3_moe");
    assert_eq!(moe(&raw).sparse, vec![true, false, true]);
    let mut raw = config("qwen3_moe");
    raw["mlp_only_layers"] = serde_json::json!([]);
    raw["decoder_sparse_step"] = 2.into();
    assert_eq!(moe(&raw).sparse, vec![false, true, false]);
    raw["mlp_only_layers"] = serde_json::json!([7]);
    assert!(refused(&raw).contains("mlp_only_layers names layer 7"));
    assert_eq!(moe(&config("mixtral")).sparse, vec![true, true]);
    assert!(moe(&config("mixtral")).norm_topk_prob);
}

/// Qwen2-MoE (no fixture): the qwen3_moe fixture's shape as Qwen2-MoE with a shared expert,
/// randomly initialised; the streamed engine (K = 1 and 2, one micro-batch) gives the reference
/// path's step-0 loss to the bit, and training moves it.
#[test]
fn qwen2_moe_with_a_shared_expert_streams_as_the_reference_computes() {
    use horizon::engine::exec::{Engine, StepParams};
    use horizon::model::transformer::{Capacity, Transformer};
    use horizon::store::TrainState;
    use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};
    let mut raw = config("qwen3_moe");
    raw["model_type"] = "qwen2_moe".into();
    raw["shared_expert_intermediate_size"] = 16.into();
    let model = ModelConfig::from_json(&raw, "qwen2_moe").unwrap();
    let layout = horizon::model::describe(&model);
    assert!(layout.hf_tensors().iter().any(|(n, _)| n.ends_with("mlp.shared_expert_gate.weight")));
    let params = ParamStore::random(&layout, 5, 0.1);
    let rows = case_rows("qwen3_moe");
    let batch = 3;
    let rows: Vec<_> = rows[..batch].iter().collect();
    let b = horizon::data::pretokenized::make_batch(&rows);
    let cap = Capacity { batch, seq_len: 32, head_chunk_rows: 7 };
    let mut t = Transformer::new(horizon_backend::CpuBackend, &model, cap);
    let mut grads = params.clone();
    grads.fill_zero();
    let tokens = horizon::run::data::tokens_of(&b);
    let want = t.forward_backward(&params, &mut grads, tokens, b.num_targets).unwrap().loss();
    for k in [1, 2] {
        let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20));
        let cfg = case_engine_config("qwen3_moe", k, batch);
        let mut e = Engine::new(dev, &model, TrainState::new(params.clone()), cfg).unwrap();
        let mbs = || horizon::run::data::micro_batches(&rows, batch);
        let sp = StepParams { lr: 1e-2, inject_nan: false };
        let out = e.step(mbs(), sp).unwrap();
        assert_eq!(out.loss().to_bits(), want.to_bits(), "K={k}: {} vs {want}", out.loss());
        assert!(out.aux.is_some_and(|(aux, coef)| aux > 0.0 && coef == 0.02), "{:?}", out.aux);
        let next = e.step(mbs(), sp).unwrap().loss();
        assert!(next < want, "K={k}: a step on the same batch lowers the loss: {next} vs {want}");
    }
}

/// transformers 5's fused expert layout, read and written: a fixture exported fused holds
/// `mlp.experts.gate_up_proj` (E, 2I, C), `mlp.experts.down_proj` (E, C, I) and the router as
/// `mlp.gate.weight`, no per-expert tensor; it loads to the Hub checkpoint's parameters bit for
/// bit, a run from it knows its layout (and exports it fused again), and it trains to the same
/// losses.
#[test]
fn the_fused_expert_layout_reads_and_writes_as_the_hub_one() {
    use horizon::run::config::RawConfig;
    use horizon::run::load::model_config;
    use horizon::run::reference::{ReferenceTrainer, export};
    for case in ["qwen3_moe", "mixtral"] {
        let hub = case_dir(case).join("model");
        let mut model = ModelConfig::from_file(&hub.join("config.json")).unwrap();
        let layout = horizon::model::describe(&model);
        let params = ParamStore::load_hf(&layout, &hub).unwrap();
        let dir = tempfile::tempdir().unwrap();
        model.moe.as_mut().unwrap().fused = true;
        export(&model, &params, dir.path()).unwrap();
        let ckpt = horizon::hf::Checkpoint::open(dir.path()).unwrap();
        let names = ckpt.names();
        assert!(!names.iter().any(|n| n.contains("experts.0.")), "{case}: {names:?}");
        let l0 = "model.layers.0.mlp";
        assert_eq!(ckpt.shape(&format!("{l0}.experts.gate_up_proj")), Some(vec![8, 48, 32]));
        assert!(ckpt.contains(&format!("{l0}.gate.weight")), "{case}: {names:?}");
        let fused = ParamStore::load_hf(&layout, dir.path()).unwrap();
        assert_bit_identical(&format!("{case} fused"), &fused, &params);
        // A run from it knows its layout, and its export keeps it.
        let yaml = |dir: &std::path::Path| {
            fixture_yaml(case, dir, &case_dir(case).join("data.jsonl"), Path::new("unused"), "")
        };
        let raw = RawConfig::from_yaml(&yaml(dir.path()), case).unwrap();
        assert!(model_config(&raw).unwrap().moe.unwrap().fused, "{case}");
        let raw = RawConfig::from_yaml(&yaml(&hub), case).unwrap();
        assert!(!model_config(&raw).unwrap().moe.unwrap().fused, "{case}");
        let steps = |dir: &std::path::Path| -> Vec<u64> {
            let cfg = RawConfig::from_yaml(&yaml(dir), case).unwrap().resolve(case).unwrap();
            let mut t = ReferenceTrainer::new(cfg).unwrap();
            (0..2).map(|k| t.step(k).unwrap().loss.to_bits()).collect()
        };
        assert_eq!(steps(dir.path()), steps(&hub), "{case}");
    }
}

/// Fixture `case`'s model directory copied into `dir`, its tensor `name` replaced by zeros of
/// `dtype` and `shape` (the stored bytes as they are otherwise).
fn with_tensor(case: &str, dir: &Path, (name, dtype, shape): (&str, safetensors::Dtype, &[usize])) {
    use safetensors::tensor::TensorView;
    let src = case_dir(case).join("model");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let zeros = vec![0u8; shape.iter().product::<usize>() * dtype.bitsize() / 8];
    let mut views: Vec<(String, TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| n != name).collect();
    views.push((name.to_string(), TensorView::new(dtype, shape.to_vec(), &zeros).unwrap()));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
}

/// gpt-oss's bad inputs, each named: an MXFP4 pair whose blocks and scales disagree in shape
/// (both tensors), a `quantization_config` method Horizon does not read, and a sink tensor of
/// the wrong length.
#[test]
fn gpt_oss_bad_inputs_are_named() {
    use safetensors::Dtype;
    let dir = tempfile::tempdir().unwrap();
    let scales = "model.layers.1.mlp.experts.down_proj_scales";
    with_tensor("gpt_oss_mxfp4", dir.path(), (scales, Dtype::U8, &[8, 32, 3]));
    let err = load_error(&config("gpt_oss_mxfp4"), dir.path());
    let blocks = "model.layers.1.mlp.experts.down_proj_blocks";
    assert!(
        err.contains(&format!("{blocks} [8, 32, 2, 16] and {scales} [8, 32, 3] disagree")),
        "{err}"
    );

    let mut raw = config("gpt_oss_mxfp4");
    raw["quantization_config"]["quant_method"] = "awq".into();
    let err = refused(&raw);
    assert!(err.contains("quantization_config.quant_method 'awq' is not read"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let sinks = "model.layers.2.self_attn.sinks";
    with_tensor("gpt_oss", dir.path(), (sinks, Dtype::BF16, &[3]));
    let err = load_error(&config("gpt_oss"), dir.path());
    assert!(err.contains(sinks) && err.contains("[3]") && err.contains("[4]"), "{err}");
}

/// gpt-oss exported in shards (each shard's fused experts made as it is written) loads back
/// bit for bit, from bf16 and from MXFP4; `--layout hub` is refused (gpt-oss has none).
#[test]
fn gpt_oss_exports_in_shards_and_refuses_a_hub_layout() {
    let horizon = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().unwrap()
    };
    for case in ["gpt_oss", "gpt_oss_mxfp4"] {
        let src = case_dir(case).join("model");
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
        let run = horizon(&["export", s, "--out", o, "--max-shard-size", "100KB"]);
        assert!(run.status.success(), "{case}: {}", String::from_utf8_lossy(&run.stderr));
        assert!(out.join("model.safetensors.index.json").exists(), "{case}: shards");
        let cfg = ModelConfig::from_file(&src.join("config.json")).unwrap();
        let layout = horizon::model::describe(&cfg);
        let (want, got) =
            (ParamStore::load_hf(&layout, &src).unwrap(), ParamStore::load_hf(&layout, &out));
        assert_bit_identical(case, &got.unwrap(), &want);
        let hub = tmp.path().join("hub");
        let run = horizon(&["export", s, "--out", hub.to_str().unwrap(), "--layout", "hub"]);
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success() && err.contains("gpt-oss has no per-expert layout"), "{err}");
    }
}
