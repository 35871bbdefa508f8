//! The DPO fixtures (`tests/fixtures/dpo`): their pairs, run configs, and runs on the
//! reference path and on the streaming engine of any device.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use horizon::model::dpo::{DpoLossKind, DpoObjective};
use horizon::run::config::{BackendKind, RawConfig};
use horizon::run::dpo_reference::{DpoReference, DpoStep, PairRows};
use horizon_backend::Device;
use serde_json::Value;

use super::f64s;

pub fn dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dpo").join(case)
}

pub fn expected(case: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir(case).join("expected.json")).unwrap())
        .unwrap()
}

/// The case's pairs, from its `data.jsonl` (TRL's tokenization: completions without the prompt).
pub fn pairs(case: &str) -> Vec<PairRows> {
    let text = std::fs::read_to_string(dir(case).join("data.jsonl")).unwrap();
    let ints = |v: &Value| -> Vec<i32> {
        v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap() as i32).collect()
    };
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            PairRows::new(
                &ints(&v["prompt_input_ids"]),
                &ints(&v["chosen_input_ids"]),
                &ints(&v["rejected_input_ids"]),
            )
        })
        .collect()
}

pub fn yaml(case: &str, extra: &str) -> String {
    let e = expected(case);
    let d = dir(case);
    let betas = f64s(&e["betas"]);
    let adapter = match e["method"].as_str().unwrap() {
        "lora" => format!(
            "adapter: {{ type: lora, r: {}, alpha: {}, rslora: {}, targets: [{}], init: '{}' }}\n",
            e["r"],
            e["alpha"],
            e["rslora"],
            e["targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap())
                .collect::<Vec<_>>()
                .join(", "),
            d.join("adapter_init").display()
        ),
        _ => String::new(),
    };
    format!(
        "model: {{ path: '{}' }}\ndata: {{ path: unused.jsonl, format: pretokenized }}\n\
         train: {{ steps: {}, batch_size: {}, max_seq_len: 64 }}\n\
         optimizer: {{ lr: {}, betas: [{}, {}], eps: {}, weight_decay: {}, grad_clip: {}, \
         no_decay: hf }}\n\
         output: {{ dir: unused }}\n{adapter}{extra}",
        d.join("model").display(),
        e["steps"],
        e["batch"],
        e["lr"],
        betas[0],
        betas[1],
        e["eps"],
        e["weight_decay"],
        e["grad_clip"],
    )
}

pub fn trainer(case: &str, extra: &str) -> DpoReference {
    let e = expected(case);
    let cfg = RawConfig::from_yaml(&yaml(case, extra), case).unwrap().resolve(case).unwrap();
    let losses = e["loss_type"]
        .as_array()
        .unwrap()
        .iter()
        .zip(e["loss_weights"].as_array().unwrap())
        .map(|(t, w)| (DpoLossKind::parse(t.as_str().unwrap()).unwrap(), w.as_f64().unwrap()))
        .collect();
    let objective = DpoObjective {
        beta: e["beta"].as_f64().unwrap(),
        losses,
        label_smoothing: e["label_smoothing"].as_f64().unwrap(),
    };
    let sizes =
        (e["batch"].as_u64().unwrap() as usize, e["micro_batch"].as_u64().unwrap() as usize);
    DpoReference::new(cfg, objective, pairs(case), sizes).unwrap()
}

/// The reference path's head in the engine's chunks of 7 rows (`common::engine_config_for`).
pub const SAME_CHUNKS: &str = "engine: { head_chunk_rows: 7 }\n";

/// The case on the streaming engine (CPU device): checkpoint every `k` layers, engine
/// micro-batches of `mbs` rows; the reference's log-probs from the reference path (LoRA:
/// adapters off) or, in full fine-tuning, from the engine's initial weights (checked equal).
pub fn streamed<D: Device>(
    dev: D,
    case: &str,
    (k, mbs, tile): (usize, usize, Option<usize>),
    backend: BackendKind,
) -> (Vec<DpoStep>, horizon::model::params::ParamStore)
where
    D::Backend: 'static,
{
    use horizon::engine::exec::Engine;
    use horizon::run::dpo_streamed::DpoStreamed;
    use horizon::run::load::{RunModel, load_run_model};
    let e = expected(case);
    let reference = trainer(case, SAME_CHUNKS);
    let cfg = reference.cfg.clone();
    let RunModel { layout, params, base, .. } =
        load_run_model(&cfg.raw, cfg.adapter.as_ref()).unwrap();
    let (batch, micro) =
        (e["batch"].as_u64().unwrap() as usize, e["micro_batch"].as_u64().unwrap() as usize);
    let rows = pairs(case);
    let seq_len = rows
        .iter()
        .flat_map(|p| [p.chosen.input_ids.len(), p.rejected.input_ids.len()])
        .max()
        .unwrap();
    let ecfg = horizon::engine::options::EngineConfig {
        batch_size: 2 * batch,
        no_decay: horizon::optim::decay::NoDecay::Hf,
        head_tile_rows: tile,
        backend,
        ..super::engine_config_for(&e, seq_len, k, mbs)
    };
    let state = horizon::store::TrainState::for_memory(params, &layout, ecfg.memory);
    let engine =
        Engine::with_layout(dev, layout, base.map(std::sync::Arc::new), state, ecfg).unwrap();
    let given = match e["method"].as_str().unwrap() {
        "lora" => Some(reference.reference_logps().to_vec()),
        _ => None,
    };
    let mut t =
        DpoStreamed::new(engine, reference.objective.clone(), rows, (batch, micro), given).unwrap();
    if e["method"] == "full" && mbs == 2 * batch && backend == BackendKind::Cpu {
        assert_eq!(t.reference(), reference.reference_logps(), "the engine's initial log-probs");
    }
    let lr = e["lr"].as_f64().unwrap();
    let steps =
        (0..e["steps"].as_u64().unwrap() as usize).map(|s| t.step(s, lr).unwrap()).collect();
    (steps, t.engine.into_state().params)
}

/// `dpo.reference: live`'s copy on `dev()`'s device: a reference pass gives, bit for bit, the
/// log-probs of an engine whose masters are the starting weights rounded to bf16, before and
/// after a step changes the masters.
pub fn live_reference_check<D: Device>(
    dev: impl Fn() -> D,
    backend: BackendKind,
    weights: horizon::engine::options::WeightPath,
) where
    D::Backend: 'static,
{
    use horizon::engine::exec::{Engine, StepParams};
    use horizon::engine::options::EngineConfig;
    use horizon::model::params::ParamStore;
    use horizon::run::config::OptimizerMemory;
    use horizon::run::data::micro_batches;
    use horizon::run::load::{RunModel, load_run_model};
    use horizon::store::TrainState;
    use horizon_backend::bf16::{Bf16, expand_bf16, round_to_bf16};

    let case = "dpo_llama_full";
    let e = expected(case);
    let cfg = RawConfig::from_yaml(&yaml(case, ""), case).unwrap().resolve(case).unwrap();
    let RunModel { layout, params, .. } = load_run_model(&cfg.raw, None).unwrap();
    let pairs = pairs(case);
    let rows: Vec<_> = pairs.iter().flat_map(|p| [&p.chosen, &p.rejected]).collect();
    let seq = rows.iter().map(|r| r.input_ids.len()).max().unwrap();
    let engine = |p: ParamStore, copy: bool| {
        let ecfg = EngineConfig {
            batch_size: 8,
            micro_batch_size: 4,
            reference_copy: copy,
            backend,
            weights,
            ..super::engine_config_for(&e, seq, 1, 4)
        };
        let state = TrainState::for_memory(p, &layout, OptimizerMemory::Exact);
        Engine::with_layout(dev(), layout.clone(), None, state, ecfg).unwrap()
    };
    let mbs = micro_batches(&rows[..8], 4);
    let mut rounded = params.clone();
    for b in rounded.buffers_mut() {
        let mut half = vec![Bf16::default(); b.len()];
        round_to_bf16(&mut half, b);
        expand_bf16(b, &half);
    }
    let want = engine(rounded, false).row_logps(mbs.clone()).unwrap();
    let mut live = engine(params, true);
    assert_eq!(live.reference_row_logps(mbs.clone()).unwrap(), want, "{backend:?} {weights:?}");
    live.step(mbs.clone(), StepParams { lr: 1e-2, inject_nan: false }).unwrap();
    assert_ne!(live.row_logps(mbs.clone()).unwrap(), want, "the step changed the masters");
    assert_eq!(live.reference_row_logps(mbs).unwrap(), want, "a step leaves the copy");
}

/// The case's run config: its data in `data` (a preference file), `out` for the outputs, and
/// `extra` YAML lines.
pub fn config(case: &str, data: &Path, out: &Path, extra: &str) -> String {
    let e = expected(case);
    let losses: Vec<String> =
        e["loss_type"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().into()).collect();
    let dpo = format!(
        "dpo: {{ beta: {}, loss: [{}], loss_weights: {}, label_smoothing: {} }}\n",
        e["beta"],
        losses.join(", "),
        e["loss_weights"],
        e["label_smoothing"]
    );
    let base = yaml(case, &format!("{dpo}{extra}"));
    let train =
        format!("train: {{ steps: {}, batch_size: {}, max_seq_len: 64 }}", e["steps"], e["batch"]);
    assert!(base.contains(&train), "{base}");
    base.replace(
        "data: { path: unused.jsonl, format: pretokenized }",
        &format!("data: {{ path: '{}', format: preference }}", data.display()),
    )
    .replace(
        &train,
        &format!(
            "train: {{ steps: {}, batch_size: {}, micro_batch_size: {}, objective: dpo, \
         save_every: 1 }}",
            e["steps"], e["batch"], e["micro_batch"]
        ),
    )
    .replace("output: { dir: unused }", &format!("output: {{ dir: '{}' }}", out.display()))
}

pub fn run(yaml: &str, resume: Option<&str>) -> anyhow::Result<()> {
    let cfg = RawConfig::from_yaml(yaml, "dpo.yaml")?.resolve("dpo.yaml")?;
    horizon::run::trainer::run_streaming(cfg, true, 0, resume).map(|_| ())
}

/// `OUT/metrics.jsonl`'s lines.
pub fn metrics(out: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// A step's loss and grad norm against the fixture's step `want`, within the README's
/// tolerances: relative error at most max(1e-5, 10x PyTorch fp32's own, `pt`).
pub fn assert_loss_and_norm(what: &str, (loss, grad_norm): (f64, f64), want: &Value, pt: &Value) {
    let checks =
        [("loss", loss, "loss_max_rel_err"), ("grad_norm", grad_norm, "grad_norm_max_rel_err")];
    for (key, got, err) in checks {
        let w = want[key].as_f64().unwrap();
        let tol = (10.0 * pt[err].as_f64().unwrap()).max(1e-5);
        let rel = (got - w).abs() / w.abs().max(1e-12);
        assert!(rel <= tol, "{what} {key}: {got} vs {w} (rel err {rel:.2e} > {tol:.1e})");
    }
}
