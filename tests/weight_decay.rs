//! `optimizer.no_decay`: the groups of every fixture family's tensors are the Hugging Face
//! Trainer's (and, for the DPO fixtures, exactly their `expected.json` lists); with `hf` a norm
//! weight with no gradient keeps its value while a matrix decays, on the reference path and on
//! the streamed engine in every memory mode; the engine with `hf` stays bit-identical to the
//! reference path; the plan and `horizon train` print the groups; the key parses and refuses a
//! bad value.

mod common;

use std::collections::BTreeSet;
use std::process::Command;

use common::*;
use horizon::engine::exec::{Engine, StepParams};
use horizon::engine::options::EngineConfig;
use horizon::hf::config::ModelConfig;
use horizon::model::layout::ModelLayout;
use horizon::model::lora::{BaseDtype, LoraSpec};
use horizon::model::params::ParamStore;
use horizon::optim::adamw::AdamWStep;
use horizon::optim::decay::{DecayGroups, NoDecay};
use horizon::run::config::{OptimizerMemory, RawConfig};
use horizon::run::reference::ReferenceTrainer;
use horizon::store::TrainState;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};
use serde_json::Value;

/// The layer tensors the HF rule exempts in the fixture families, written out by hand: norm
/// weights (Llama's two, Gemma 3's four, Qwen3's and Gemma 3's per-head q/k norms), Qwen2's and
/// gpt-oss's q/k/v biases, gpt-oss's o_proj and router biases and its experts' biases (HF's
/// `gate_up_proj_bias` and `down_proj_bias`, per expert here). Every other layer tensor
/// (projections, MoE routers and shared-expert gates, experts, gpt-oss's sinks) decays; of the
/// model-level tensors, only `model.norm.weight` is exempt.
const EXEMPT_LAYER_TENSORS: [&str; 11] = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
    "mlp.router.bias",
];

/// gpt-oss's per-expert biases: `mlp.experts.{x}.{gate,up,down}_proj.bias`.
fn expert_bias(suffix: &str) -> bool {
    let rest = suffix.strip_prefix("mlp.experts.").and_then(|r| r.split_once('.'));
    rest.is_some_and(|(_, p)| ["gate_proj.bias", "up_proj.bias", "down_proj.bias"].contains(&p))
}

fn hand_exempt(name: &str) -> bool {
    name == "model.norm.weight"
        || name.strip_prefix("model.layers.").and_then(|r| r.split_once('.')).is_some_and(
            |(_, suffix)| EXEMPT_LAYER_TENSORS.contains(&suffix) || expert_bias(suffix),
        )
}

/// Each trained tensor of `layout` with whether `groups` exempts it: a tensor must lie wholly
/// inside one of its buffer's exempt ranges or outside all of them.
fn grouped(layout: &ModelLayout, groups: &DecayGroups) -> Vec<(String, usize, bool)> {
    let mut out = Vec::new();
    for (i, tensors) in layout.buffer_tensor_ranges().into_iter().enumerate() {
        for (name, r) in tensors {
            let hit = groups.exempt(i).iter().find(|e| e.start < r.end && r.start < e.end);
            if let Some(e) = hit {
                assert!(e.start <= r.start && r.end <= e.end, "{name} straddles {e:?}");
            }
            out.push((name, r.len(), hit.is_some()));
        }
    }
    out
}

fn model_of(case: &str) -> ModelConfig {
    ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap()
}

#[test]
fn every_fixture_familys_groups_are_the_hf_trainers() {
    let mut seen = BTreeSet::new();
    for case in CASES {
        let layout = horizon::model::describe(&model_of(case));
        let groups = DecayGroups::new(&layout, NoDecay::Hf);
        let tensors = grouped(&layout, &groups);
        let (mut decayed, mut exempted) = ((0, 0), (0, 0));
        for (name, n, exempt) in &tensors {
            assert_eq!(*exempt, hand_exempt(name), "{case}: {name}");
            let g = if *exempt { &mut exempted } else { &mut decayed };
            *g = (g.0 + 1, g.1 + n);
            if *exempt {
                seen.insert(name.rsplit_once("layers.").map_or(name.as_str(), |x| x.1).to_owned());
            }
        }
        assert_eq!((groups.decayed.tensors, groups.decayed.params), decayed, "{case}");
        assert_eq!((groups.exempted.tensors, groups.exempted.params), exempted, "{case}");
        assert_eq!(decayed.1 + exempted.1, layout.trained_params(), "{case}");
        if is_moe(case) {
            let is_router = |n: &str| n.ends_with(".gate.weight") || n.ends_with(".router.weight");
            let router = tensors.iter().find(|(n, ..)| is_router(n));
            assert!(router.is_some_and(|r| !r.2), "{case}: the router decays");
        }
        // `none`: every tensor decays, no range is exempt.
        let none = DecayGroups::new(&layout, NoDecay::None);
        assert!(grouped(&layout, &none).iter().all(|t| !t.2), "{case}");
        assert_eq!(none.decayed.params, layout.trained_params());
        assert_eq!((none.exempted.tensors, none.exempted.params), (0, 0));
    }
    // The families together exercise every exempt kind: biases, q/k norms, Gemma 3's norms.
    for suffix in ["q_proj.bias", "q_norm.weight", "pre_feedforward_layernorm.weight"] {
        assert!(seen.iter().any(|s| s.ends_with(suffix)), "no fixture exempts {suffix}: {seen:?}");
    }
}

/// A DPO fixture's copied groups file (`tests/fixtures/dpo/CASE/decay_groups.json`).
fn dpo(case: &str) -> (ModelConfig, Value) {
    let dir = case_dir("dpo").join(case);
    let model = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let text = std::fs::read_to_string(dir.join("decay_groups.json")).unwrap();
    (model, serde_json::from_str(&text).unwrap())
}

fn names(v: &Value) -> BTreeSet<String> {
    v.as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_owned()).collect()
}

/// The groups of `layout` (names prefixed by `prefix`, as the fixture's model names them)
/// against the fixture's lists, exactly.
fn assert_dpo_groups(case: &str, layout: &ModelLayout, e: &Value, prefix: &str) {
    let tensors = grouped(layout, &DecayGroups::new(layout, NoDecay::Hf));
    let group = |exempt: bool| -> BTreeSet<String> {
        tensors.iter().filter(|t| t.2 == exempt).map(|t| format!("{prefix}{}", t.0)).collect()
    };
    assert_eq!(group(false), names(&e["weight_decay_params"]), "{case}: decayed");
    assert_eq!(group(true), names(&e["no_weight_decay_params"]), "{case}: exempt");
    assert_eq!(tensors.len(), names(&e["trainable_names"]).len(), "{case}: trained tensors");
}

#[test]
fn the_dpo_fixtures_groups_are_exactly_their_expected_lists() {
    let (model, e) = dpo("dpo_llama_full");
    let layout = horizon::model::describe(&model);
    assert_dpo_groups("dpo_llama_full", &layout, &e, "");

    let (model, e) = dpo("dpo_qwen2_lora");
    let r = e["r"].as_u64().unwrap() as usize;
    let lora = LoraSpec {
        r,
        scale: e["alpha"].as_f64().unwrap() as f32 / r as f32,
        targets: e["targets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().into())
            .collect(),
        nf4: false,
        base: BaseDtype::F32,
        experts: Default::default(),
    };
    let layout = horizon::model::describe(&model).with_lora(&lora).unwrap();
    // PEFT's names: the model under `base_model.model.`; its frozen biases are not trained.
    assert_dpo_groups("dpo_qwen2_lora", &layout, &e, "base_model.model.");
    assert!(names(&e["no_weight_decay_params"]).is_empty());
}

const CASE: &str = "llama_gqa";
const LN: &str = "model.layers.0.input_layernorm.weight";
const Q: &str = "model.layers.0.self_attn.q_proj.weight";

/// `llama_gqa`'s weights with layer 0's k and v projections zeroed: then q·kᵀ = 0 and
/// att = P·v = 0 whatever layer 0's input norm and q projection hold, so their gradients are
/// exactly zero (dq = dS·k = 0, dh1 = dq·Wq + dk·Wk + dv·Wv = 0) while q_proj is not zero.
fn zeroed_kv(layout: &ModelLayout) -> ParamStore {
    let mut p = ParamStore::load_hf(layout, &case_dir(CASE).join("model")).unwrap();
    for t in ["k_proj", "v_proj"] {
        p.tensor_mut(layout, &format!("model.layers.0.self_attn.{t}.weight")).unwrap().fill(0.0);
    }
    p
}

/// `1 - lr * weight_decay` of the case's first step.
fn case_decay() -> f32 {
    let ecfg = case_engine_config(CASE, 1, 1);
    AdamWStep::new(&ecfg.adamw, 1, ecfg.adamw.lr).decay
}

/// After one step from `init` with zero gradients on `LN` and `Q`: under `hf`, `LN` is unchanged
/// and `Q` is `Q · decay`; under `none` both are multiplied by `decay`. Bit for bit.
fn assert_one_step(
    what: &str,
    rule: NoDecay,
    layout: &ModelLayout,
    init: &ParamStore,
    p: &ParamStore,
) {
    let d = case_decay();
    assert_ne!(d, 1.0);
    let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
    let times = |x: &[f32], s: f32| x.iter().map(|y| (y * s).to_bits()).collect::<Vec<_>>();
    let (ln0, q0) = (init.tensor(layout, LN).unwrap(), init.tensor(layout, Q).unwrap());
    let ln_want = if rule == NoDecay::Hf { bits(ln0) } else { times(ln0, d) };
    assert_eq!(bits(p.tensor(layout, LN).unwrap()), ln_want, "{what} {rule:?}: {LN}");
    assert_eq!(bits(p.tensor(layout, Q).unwrap()), times(q0, d), "{what} {rule:?}: {Q}");
    assert!(q0.iter().any(|&x| x * d != x), "{what}: the decay of {Q} shows");
}

/// The reference path (`ReferenceTrainer`) on `case`'s config with `optimizer.no_decay: rule`.
fn reference_trainer(case: &str, rule: NoDecay) -> ReferenceTrainer {
    let yaml = case_yaml(case, "engine: { head_chunk_rows: 7 }\n");
    let mut raw = RawConfig::from_yaml(&yaml, case).unwrap();
    raw.optimizer.no_decay = rule;
    ReferenceTrainer::new(raw.resolve(case).unwrap()).unwrap()
}

#[test]
fn a_norm_weight_without_gradient_keeps_its_value_on_the_reference_path() {
    for rule in [NoDecay::Hf, NoDecay::None] {
        let mut t = reference_trainer(CASE, rule);
        let layout = horizon::model::describe(&model_of(CASE));
        t.state.params = zeroed_kv(&layout);
        let init = t.state.params.clone();
        t.step(0).unwrap();
        assert_one_step("reference", rule, &layout, &init, &t.state.params);
    }
}

#[test]
fn a_norm_weight_without_gradient_keeps_its_value_on_the_engine_in_every_memory_mode() {
    let model = model_of(CASE);
    let layout = horizon::model::describe(&model);
    let e = expected(CASE);
    let batch = e["batch"].as_u64().unwrap() as usize;
    let rows = case_rows(CASE);
    for memory in OptimizerMemory::ALL {
        for rule in [NoDecay::Hf, NoDecay::None] {
            let init = zeroed_kv(&layout);
            let cfg = EngineConfig { memory, no_decay: rule, ..case_engine_config(CASE, 1, 2) };
            let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20));
            let state = TrainState::for_memory(init.clone(), &layout, memory);
            let mut engine = Engine::new(dev, &model, state, cfg).unwrap();
            let mbs = horizon::run::data::micro_batches(&rows[..batch], 2);
            let sp = StepParams { lr: cfg.adamw.lr, inject_nan: false };
            let o = engine.step_ahead(mbs, sp, Vec::new()).unwrap();
            assert!(!o.skipped);
            let what = format!("engine {}", memory.name());
            assert_one_step(&what, rule, &layout, &init, &engine.into_state().params);
        }
    }
}

#[test]
fn the_engine_with_hf_groups_is_bit_identical_to_the_reference_path() {
    for case in CASES {
        let mut t = reference_trainer(case, NoDecay::Hf);
        let steps = expected(case)["steps"].as_u64().unwrap() as usize;
        for k in 0..steps {
            t.step(k).unwrap();
        }
        let model = model_of(case);
        let layout = horizon::model::describe(&model);
        let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
        let batch = expected(case)["batch"].as_u64().unwrap() as usize;
        let cfg = EngineConfig { no_decay: NoDecay::Hf, ..case_engine_config(case, 1, batch) };
        let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(4 << 20));
        let mut engine = Engine::new(dev, &model, TrainState::new(params), cfg).unwrap();
        run_case_steps(&mut engine, case);
        let got = engine.into_state().params;
        assert_bit_identical(&format!("{case} hf"), &got, &t.state.params);
        // The groups changed the result (the comparison is not of two `none` runs).
        let mut plain = reference_trainer(case, NoDecay::None);
        for k in 0..steps {
            plain.step(k).unwrap();
        }
        assert_ne!(got, plain.state.params, "{case}: hf and none end the same");
    }
}

/// A random Llama (5 layers, C 64, F 176, V 300, untied) on synthetic tokens, with
/// `optimizer.no_decay` `rule` (unset when empty) and weight decay 0.1, writing into `out`.
fn random_yaml(rule: &str, out: &std::path::Path) -> String {
    let no_decay = if rule.is_empty() { String::new() } else { format!(", no_decay: {rule}") };
    format!(
        "model: {{ init: random, arch: llama, hidden_size: 64, intermediate_size: 176, num_hidden_layers: 5,\n\
         \x20        num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 300, tie_word_embeddings: false }}\n\
         data: {{ format: synthetic }}\n\
         train: {{ steps: 1, batch_size: 2, max_seq_len: 16 }}\n\
         optimizer: {{ weight_decay: 0.1{no_decay} }}\n\
         output: {{ dir: '{}' }}\n",
        out.display()
    )
}

/// The line of the random model: embedding and head (300 × 64 each) and per layer q 64 × 64,
/// k and v 32 × 64, o 64 × 64, gate, up and down 176 × 64 decay; the layers' two norms and the
/// final norm (64 each) do not under `hf`.
const HF_LINE: &str = "weight decay 0.1 on 37 tensors (268800 params), none on 11 tensors (704 params) (optimizer.no_decay: hf)";
const NONE_LINE: &str = "weight decay 0.1 on 48 tensors (269504 params), none on 0 tensors (0 params) (optimizer.no_decay: none)";

#[test]
fn the_plan_and_train_print_the_groups() {
    let tmp = tempfile::tempdir().unwrap();
    // A host of 1 GiB: the plan's deepest fits of this tiny shape stay quick to find.
    for (rule, line) in [("hf", HF_LINE), ("none", NONE_LINE), ("", NONE_LINE)] {
        let raw = RawConfig::from_yaml(&random_yaml(rule, tmp.path()), "t").unwrap();
        let report = horizon::run::plan::report(&raw.resolve("t").unwrap(), Some(1 << 30));
        let text = report.unwrap().text;
        assert!(text.lines().any(|l| l == line), "plan lacks {line:?}:\n{text}");
    }
    let cfg = tmp.path().join("c.yaml");
    std::fs::write(&cfg, random_yaml("hf", &tmp.path().join("out"))).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.lines().any(|l| l == HF_LINE), "train lacks the line:\n{out}");
}

#[test]
fn the_key_parses_defaults_to_none_and_refuses_other_values() {
    let parse = |y: &str| {
        RawConfig::from_yaml(&format!("model: {{ path: m }}\ndata: {{ path: d }}\n{y}"), "c.yaml")
    };
    assert_eq!(parse("optimizer: { no_decay: hf }\n").unwrap().optimizer.no_decay, NoDecay::Hf);
    assert_eq!(parse("optimizer: { no_decay: none }\n").unwrap().optimizer.no_decay, NoDecay::None);
    assert_eq!(parse("optimizer: { lr: 0.1 }\n").unwrap().optimizer.no_decay, NoDecay::None);
    let err = format!("{:#}", parse("optimizer: { no_decay: norms }\n").unwrap_err());
    for want in ["c.yaml", "no_decay", "norms", "hf", "none", "hint: see docs/configuration.md"] {
        assert!(err.contains(want), "error lacks {want:?}: {err}");
    }
}
