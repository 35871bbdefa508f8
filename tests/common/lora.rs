//! The LoRA fixtures (`tests/fixtures/lora`, from ../shared/fixtures-lora): their run configs,
//! names, and a run of a case on the streaming engine of any device.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use horizon::engine::exec::{Engine, StepParams};
use horizon::engine::options::EngineConfig;
use horizon::hf::checkpoint::read_tensor_f64;
use horizon::model::params::ParamStore;
use horizon::run::config::RawConfig;
use horizon::run::load::{PEFT_PREFIX, RunModel, load_run_model};
use horizon::store::TrainState;
use horizon_backend::{Backend, Device};
use serde_json::Value;

use super::f64s;

pub const CASES: [&str; 3] = ["llama_lora", "qwen2_qlora_nf4", "qwen3_moe_lora"];

pub fn dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora").join(case)
}

pub fn expected(case: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir(case).join("expected.json")).unwrap())
        .unwrap()
}

/// A run config of the case: its model, data, hyper-parameters and adapter (`adapter_init`).
pub fn yaml(case: &str, extra: &str) -> String {
    yaml_with(case, "auto", extra)
}

/// [`yaml`] with the frozen base in `base_dtype` (`auto`, `bf16`, `fp32`).
pub fn yaml_with(case: &str, base_dtype: &str, extra: &str) -> String {
    let e = expected(case);
    let d = dir(case);
    let mut targets: Vec<&str> =
        e["targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    // A mixture of experts' adapters on the expert parameters, by PEFT's names.
    let params = e.get("target_parameters").and_then(|p| p.as_array());
    targets.extend(params.into_iter().flatten().map(|t| t.as_str().unwrap()));
    let kind = if e["quant"].is_null() { "lora" } else { "qlora" };
    let betas = f64s(&e["betas"]);
    format!(
        "model: {{ path: '{}' }}\ndata: {{ path: '{}', format: pretokenized }}\n\
         train: {{ steps: {}, batch_size: {}, max_seq_len: 64 }}\n\
         optimizer: {{ lr: {}, betas: [{}, {}], eps: {}, weight_decay: {}, grad_clip: {} }}\n\
         adapter: {{ type: {kind}, r: {}, alpha: {}, rslora: {}, targets: [{}], init: '{}', \
         base_dtype: {base_dtype} }}\n\
         output: {{ dir: unused }}\n{extra}",
        d.join("model").display(),
        d.join("data.jsonl").display(),
        e["steps"],
        e["batch"],
        e["lr"],
        betas[0],
        betas[1],
        e["eps"],
        e["weight_decay"],
        e["grad_clip"],
        e["r"],
        e["alpha"],
        e["rslora"],
        targets.join(", "),
        d.join("adapter_init").display(),
    )
}

pub fn run_config(case: &str, extra: &str) -> horizon::run::config::RunConfig {
    RawConfig::from_yaml(&yaml(case, extra), case).unwrap().resolve(case).unwrap()
}

/// The fixture's adapter names (PEFT's) and ours.
pub fn adapter_names(case: &str) -> Vec<(String, String)> {
    let e = expected(case);
    e["adapter_names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let peft = n.as_str().unwrap().to_string();
            let ours = peft.strip_prefix(PEFT_PREFIX).unwrap().to_string();
            (peft, ours)
        })
        .collect()
}

pub fn fixture_tensor(case: &str, file: &str, name: &str) -> Vec<f64> {
    read_tensor_f64(&dir(case).join(file), name).unwrap().1
}

/// The case on the streaming engine: checkpoint every `k` layers, micro-batches of `mbs` rows.
/// `base_dtype`: the frozen base's (`auto`, `bf16`, `fp32`).
pub fn streamed<D: Device>(dev: D, case: &str, k: usize, mbs: usize, base_dtype: &str) -> Streamed
where
    D::Backend: 'static,
{
    streamed_in(dev, case, (k, mbs), base_dtype, horizon::run::config::OptimizerMemory::Exact)
}

/// [`streamed`] in `optimizer.memory` mode `memory`.
pub fn streamed_in<D: Device>(
    dev: D,
    case: &str,
    (k, mbs): (usize, usize),
    base_dtype: &str,
    memory: horizon::run::config::OptimizerMemory,
) -> Streamed
where
    D::Backend: 'static,
{
    streamed_yaml(dev, case, &yaml_with(case, base_dtype, ""), (k, mbs), memory)
}

/// [`streamed_in`] of the run config `yaml` over `case`'s rows and hyper-parameters.
pub fn streamed_yaml<D: Device>(
    dev: D,
    case: &str,
    yaml: &str,
    (k, mbs): (usize, usize),
    memory: horizon::run::config::OptimizerMemory,
) -> Streamed
where
    D::Backend: 'static,
{
    let cfg = RawConfig::from_yaml(yaml, case).unwrap().resolve(case).unwrap();
    let RunModel { layout, params, base, .. } =
        load_run_model(&cfg.raw, cfg.adapter.as_ref()).unwrap();
    let init = params.clone();
    let e = expected(case);
    let rows =
        horizon::data::pretokenized::load_pretokenized(&dir(case).join("data.jsonl"), 64, 100_000)
            .unwrap()
            .to_rows()
            .unwrap();
    let backend = if D::Backend::PRECISION == horizon_backend::Precision::Bf16 {
        horizon::run::config::BackendKind::Cuda
    } else {
        horizon::run::config::BackendKind::Cpu
    };
    let seq_len = rows.iter().map(|r| r.input_ids.len()).max().unwrap();
    // The yaml's `engine.expert_chunk` and `engine.head_tile_rows` (unset: whole layers and
    // the head in as few tiles as fit).
    let (expert_chunk, head_tile_rows) =
        (cfg.raw.engine.expert_chunk, cfg.raw.engine.head_tile_rows);
    let ecfg = EngineConfig {
        backend,
        memory,
        expert_chunk,
        head_tile_rows,
        ..super::engine_config_for(&e, seq_len, k, mbs)
    };
    let state = TrainState::for_memory(params, &layout, memory);
    let mut engine = Engine::with_layout(dev, layout, base.map(Arc::new), state, ecfg).unwrap();
    let (head_tiles, expert_chunks) = (engine.sizes().head.tiles(), engine.sizes().expert_chunks);
    let batch = ecfg.batch_size;
    let lr = e["lr"].as_f64().unwrap();
    let out = (0..e["steps"].as_u64().unwrap() as usize)
        .map(|s| {
            let rs: Vec<_> = rows[s * batch..(s + 1) * batch].iter().collect();
            let mbs = horizon::run::data::micro_batches(&rs, mbs);
            let o = engine.step(mbs, StepParams { lr, inject_nan: false }).unwrap();
            (o.loss(), o.grad_norm)
        })
        .collect();
    Streamed { steps: out, init, end: engine.into_state().params, head_tiles, expert_chunks }
}

/// What a streamed run gives: per-step (loss, grad norm), the adapters before and after, and
/// the tiles its LM head was applied in.
pub struct Streamed {
    pub steps: Vec<(f64, f64)>,
    pub init: ParamStore,
    pub end: ParamStore,
    pub head_tiles: usize,
    /// Chunks of each chunked layer's experts (1: whole layers).
    pub expert_chunks: usize,
}

/// Fixture `case` (a full-model fixture: `qwen3_moe`, `mixtral`) trained with adapters of
/// `kind` (lora, qlora) on its attention and router, the experts frozen, on `dev` with `ecfg`:
/// per step (loss, grad norm, skipped), the trained parameters after, and the chunks of each
/// chunked layer's experts (`engine.expert_chunk`; 1 for whole layers).
pub fn moe_adapter_run<D: Device>(
    dev: D,
    case: &str,
    kind: &str,
    ecfg: EngineConfig,
) -> (Vec<(f64, f64, bool)>, ParamStore, usize)
where
    D::Backend: 'static,
{
    let adapter = format!(
        "adapter: {{ type: {kind}, r: 4, alpha: 8, \
         targets: [q_proj, k_proj, v_proj, o_proj, router], base_dtype: fp32 }}\n"
    );
    let yaml = super::case_yaml(case, &adapter);
    let cfg = RawConfig::from_yaml(&yaml, case).unwrap().resolve(case).unwrap();
    let RunModel { layout, params, base, .. } =
        load_run_model(&cfg.raw, cfg.adapter.as_ref()).unwrap();
    let state = TrainState::new(params);
    let mut e = Engine::with_layout(dev, layout, base.map(Arc::new), state, ecfg).unwrap();
    let chunks = e.sizes().expert_chunks;
    let steps = super::run_case_steps(&mut e, case);
    (steps, e.into_state().params, chunks)
}
