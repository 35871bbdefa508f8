//! `horizon train`: load the model and data, run the steps (forward, backward, exact global-norm
//! clipping, AdamW on the fp32 masters), write `metrics.jsonl` and the final HF directory.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use horizon_backend::CpuBackend;
use serde::Serialize;

use crate::adapter::{AdapterConfig, AdapterKind, BaseDtype as BaseChoice, peft};
use crate::config::{
    BackendKind, ByteSize, DataFormat, ModelInit, RawConfig, RunConfig, WeightPath,
};
use crate::data::pretokenized::{Batch, PretokenizedDataset, Row, make_batch};
use crate::data::{
    LoadReport, Source, carries_loss, load_alpaca, load_chat, load_pretokenized_rows,
    load_sharegpt, load_text, pack, shuffled_order, split_eval,
};
use crate::engine::exec::{Engine, MicroBatch, StepParams};
use crate::engine::memory::{MemoryPlan, gib, peak_rss_bytes};
use crate::engine::options::EngineConfig;
use crate::engine::phases::{PhaseSeconds, StepFlops, step_flops};
use crate::engine::resolve::{Machine, resolve};
use crate::hf::checkpoint::NonFinite;
use crate::hf::config::ModelConfig;
use crate::model::base::FrozenBase;
use crate::model::layout::ModelLayout;
use crate::model::lora::BaseDtype;
use crate::model::lora::{LoraSpec, adapter_suffix};
use crate::model::params::ParamStore;
use crate::model::transformer::{Capacity, Tokens, Transformer};
use crate::optim::adamw::AdamWConfig;
use crate::rng::SplitMix64;
pub use crate::store::TrainState;
pub use crate::summary::Summary;
use crate::tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer};
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};
use horizon_backend::cuda::{CudaDevice, CudaDeviceConfig};
use horizon_backend::{Device, DeviceStats};

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct StepMetrics {
    /// 1-based optimizer step.
    pub step: usize,
    /// Mean loss over the batch's loss-carrying positions.
    pub loss: f64,
    /// Global L2 norm of the gradient, before clipping.
    pub grad_norm: f64,
    /// Learning rate used for this step.
    pub lr: f64,
    /// Tokens (non-padding positions) in the batch.
    pub tokens: usize,
    /// Wall time of the step in seconds.
    pub step_s: f64,
    /// The update was skipped: the loss or the gradient norm was not finite, or (`no_loss`) no
    /// position of the batch carries a loss.
    pub skipped: bool,
    /// No position of the batch carries a loss: nothing ran (`loss` and `grad_norm` are NaN).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub no_loss: bool,
    /// Mean loss over the held-out rows after this step's update, on steps that evaluate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
}

impl StepMetrics {
    /// Step `k` (0-based), skipped because no position of its batch carries a loss.
    fn no_loss(k: usize, lr: f64, tokens: usize, t0: Instant) -> Self {
        StepMetrics {
            step: k + 1,
            loss: f64::NAN,
            grad_norm: f64::NAN,
            lr,
            tokens,
            step_s: t0.elapsed().as_secs_f64(),
            skipped: true,
            no_loss: true,
            eval_loss: None,
        }
    }
}

/// Row indices of batch `k`: `[k*B, (k+1)*B)` cycling through the data; with `shuffle`, each
/// epoch reads the rows in its own seeded permutation.
pub fn batch_indices(len: usize, k: usize, b: usize, shuffle: bool, seed: u64) -> Vec<usize> {
    let mut out = Vec::with_capacity(b);
    BatchOrder::new(len, b, shuffle, seed).indices(k, &mut out);
    out
}

/// The order batches read rows in ([`batch_indices`]), keeping the current epoch's permutation
/// so that a step costs O(batch), not O(rows).
#[derive(Clone, Debug)]
pub struct BatchOrder {
    len: usize,
    b: usize,
    shuffle: bool,
    seed: u64,
    /// The permutation of epoch `epoch` (shuffling only).
    perm: Vec<usize>,
    epoch: Option<usize>,
}

impl BatchOrder {
    pub fn new(len: usize, b: usize, shuffle: bool, seed: u64) -> Self {
        BatchOrder { len, b, shuffle, seed, perm: Vec::new(), epoch: None }
    }

    /// The row indices of batch `k` into `out` (cleared first).
    pub fn indices(&mut self, k: usize, out: &mut Vec<usize>) {
        out.clear();
        for i in 0..self.b {
            let g = k * self.b + i;
            let (epoch, pos) = (g / self.len, g % self.len);
            if !self.shuffle {
                out.push(pos);
                continue;
            }
            if self.epoch != Some(epoch) {
                self.perm = shuffled_order(self.len, self.seed, epoch as u64);
                self.epoch = Some(epoch);
            }
            out.push(self.perm[pos]);
        }
    }
}

/// Everything a run needs, loaded and checked before the first step.
pub struct Trainer {
    pub cfg: RunConfig,
    pub model_cfg: ModelConfig,
    pub data: PretokenizedDataset,
    /// The order batches read `data`'s rows in.
    order: BatchOrder,
    pub state: TrainState,
    pub engine: Transformer<CpuBackend>,
}

impl Trainer {
    /// Load model and data, and allocate every buffer the run needs.
    pub fn new(cfg: RunConfig) -> Result<Self> {
        let raw = &cfg.raw;
        let RunModel { cfg: model_cfg, layout, params, base } =
            load_run_model(raw, cfg.adapter.as_ref())?;
        let data = load_data(raw, model_cfg.vocab_size)?;
        let engine = Transformer::with_layout(
            CpuBackend,
            layout,
            base.map(Arc::new),
            Capacity {
                batch: raw.train.batch_size,
                seq_len: data.rows.iter().map(|r| r.input_ids.len()).max().unwrap_or(1),
                head_chunk_rows: raw.engine.head_chunk_rows,
            },
        );
        let order = batch_order(&cfg, &data);
        Ok(Trainer { state: TrainState::new(params), cfg, model_cfg, data, order, engine })
    }

    /// The batch of optimizer step `k` (0-based), and its count of real (non-padding) tokens.
    pub fn batch(&mut self, k: usize) -> (Batch, usize) {
        let rows = step_rows(&mut self.order, &self.data, k);
        let tokens = rows.iter().map(|r| r.input_ids.len()).sum();
        (make_batch(&rows), tokens)
    }

    /// One optimizer step on batch `k`.
    pub fn step(&mut self, k: usize) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let (batch, tokens) = self.batch(k);
        if batch.num_targets == 0 {
            self.state.step += 1;
            return Ok(StepMetrics::no_loss(
                k,
                self.cfg.raw.lr_schedule().lr_at(k + 1),
                tokens,
                t0,
            ));
        }
        let o = &self.cfg.raw.optimizer;
        self.state.grads.fill_zero();
        let out = self.engine.forward_backward(
            &self.state.params,
            &mut self.state.grads,
            tokens_of(&batch),
            batch.num_targets,
        )?;
        let grad_norm = self.state.grad_norm();
        let lr = self.cfg.raw.lr_schedule().lr_at(k + 1);
        self.state.optimizer_step(&adamw_config(&self.cfg.raw), lr, grad_norm, o.grad_clip);
        Ok(StepMetrics {
            step: k + 1,
            loss: out.loss(),
            grad_norm,
            lr,
            tokens,
            step_s: t0.elapsed().as_secs_f64(),
            skipped: false,
            no_loss: false,
            eval_loss: None,
        })
    }

    /// Write the trained model as a HF directory (`config.json` + fp32 `model.safetensors`).
    pub fn export(&self, dir: &Path) -> Result<()> {
        export(&self.model_cfg, &self.state.params, dir)
    }
}

/// Write a model as a HF directory (`config.json` + fp32 `model.safetensors`, no tokenizer).
pub fn export(model_cfg: &ModelConfig, params: &ParamStore, dir: &Path) -> Result<()> {
    crate::export::export_model(
        model_cfg,
        params,
        dir,
        crate::export::ExportOptions::default(),
        &crate::export::ExportSource::none(),
    )
    .map(|_| ())
}

/// The model description a config names (no weights): a HF directory's `config.json` with
/// the config's own keys on top.
pub fn model_config(raw: &RawConfig) -> Result<ModelConfig> {
    let m = &raw.model;
    let mut json = serde_json::Map::new();
    let mut origin = "config model".to_string();
    if let Some(dir) = &m.path {
        if !dir.is_dir() {
            bail!(
                "model.path {}: no such directory\nhint: point model.path at a Hugging Face model directory (config.json + model.safetensors)",
                dir.display()
            );
        }
        let path = dir.join("config.json");
        let text =
            fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        if let serde_json::Value::Object(o) = v {
            json = o;
        }
        origin = path.display().to_string();
    }
    for (k, v) in &m.hf {
        json.insert(k.clone(), v.clone());
    }
    if let Some(arch) = &m.arch {
        json.insert("model_type".into(), serde_json::Value::String(arch.clone()));
    }
    ModelConfig::from_json(&serde_json::Value::Object(json), &origin)
}

/// The model a config names: loaded from a HF directory, or randomly initialised.
pub fn load_model(raw: &RawConfig) -> Result<(ModelConfig, ParamStore)> {
    let model_cfg = model_config(raw)?;
    let layout = crate::model::describe(&model_cfg);
    let params = match (raw.model.init, &raw.model.path) {
        (Some(ModelInit::Random), _) => {
            let std =
                raw.model.hf.get("initializer_range").and_then(|v| v.as_f64()).unwrap_or(0.02);
            ParamStore::random(&layout, raw.model.seed, std as f32)
        }
        (None, Some(dir)) => ParamStore::load_hf_with(
            &layout,
            dir,
            NonFinite::allowed_if(raw.model.allow_non_finite),
        )?,
        (None, None) => bail!("model.path is missing"),
    };
    Ok((model_cfg, params))
}

/// A run's model: its layout (the full model, or with the run's adapters), the trained
/// tensors, and an adapter run's frozen base.
pub struct RunModel {
    pub cfg: ModelConfig,
    pub layout: ModelLayout,
    pub params: ParamStore,
    pub base: Option<FrozenBase>,
}

/// The layout of a run: the model's, with `adapter`'s LoRA on every layer when there is one
/// (its base dtype resolved: `auto` is the checkpoint's). An adapter target the model does
/// not have is an error naming it.
pub fn run_layout(
    raw: &RawConfig,
    model_cfg: &ModelConfig,
    adapter: Option<&AdapterConfig>,
) -> Result<ModelLayout> {
    let full = crate::model::describe(model_cfg);
    let Some(a) = adapter else { return Ok(full) };
    let base = match (a.base_dtype, raw.model.init, &raw.model.path) {
        (BaseChoice::Bf16, ..) => BaseDtype::Bf16,
        (BaseChoice::Fp32, ..) => BaseDtype::F32,
        (BaseChoice::Auto, None, Some(dir)) => checkpoint_dtype(dir)?,
        (BaseChoice::Auto, ..) => BaseDtype::Bf16,
    };
    let lora = LoraSpec {
        r: a.r,
        scale: a.scale(),
        targets: a.targets.clone(),
        nf4: a.kind == AdapterKind::Qlora,
        base,
    };
    full.with_lora(&lora).map_err(|e| {
        anyhow::anyhow!(
            "{e}\nhint: adapter.targets lists the projections to adapt; list only ones this model has"
        )
    })
}

/// Load (or draw) a run's model. In an adapter run the base is frozen in its dtype (quantised
/// to NF4 for `qlora`) and the adapters start from `adapter.init` or as PEFT starts them
/// (A Kaiming-uniform, B zero: step 0 computes the base model).
pub fn load_run_model(raw: &RawConfig, adapter: Option<&AdapterConfig>) -> Result<RunModel> {
    let Some(a) = adapter else {
        let (cfg, params) = load_model(raw)?;
        let layout = crate::model::describe(&cfg);
        return Ok(RunModel { cfg, layout, params, base: None });
    };
    let cfg = model_config(raw)?;
    let layout = run_layout(raw, &cfg, Some(a))?;
    let dtype = layout.adapter.as_ref().expect("an adapter layout").base;
    let std = raw.model.hf.get("initializer_range").and_then(|v| v.as_f64()).unwrap_or(0.02);
    let base = match (raw.model.init, &raw.model.path) {
        (Some(ModelInit::Random), _) => {
            FrozenBase::random(&layout, dtype, raw.model.seed, std as f32)
        }
        (None, Some(dir)) => {
            let nf = NonFinite::allowed_if(raw.model.allow_non_finite);
            FrozenBase::load_hf(&layout, dir, dtype, nf)?
        }
        (None, None) => bail!("model.path is missing"),
    };
    let mut params = ParamStore::random(&layout, raw.model.seed, std as f32);
    if let Some(dir) = &a.init {
        init_from_peft(&layout, a, dir, &mut params)?;
    }
    Ok(RunModel { cfg, layout, params, base: Some(base) })
}

/// `auto` base dtype: bf16 when the checkpoint stores every tensor as bf16, else fp32 (f16 and
/// f64 convert to fp32 exactly or nearly).
fn checkpoint_dtype(dir: &Path) -> Result<BaseDtype> {
    let ckpt = crate::hf::checkpoint::Checkpoint::open(dir)?;
    let all_bf16 = ckpt.names().iter().all(|n| ckpt.dtype(n) == Some("BF16"));
    Ok(if all_bf16 { BaseDtype::Bf16 } else { BaseDtype::F32 })
}

/// The adapters of `params` from the PEFT adapter directory `dir`, checked against the run
/// (r, alpha, targets, shapes).
fn init_from_peft(
    layout: &ModelLayout,
    a: &AdapterConfig,
    dir: &Path,
    params: &mut ParamStore,
) -> Result<()> {
    let adapter = peft::read(dir)?;
    let shapes = |layer: usize, target: &str| {
        let spec = layout.layer(layer);
        let a_name = adapter_suffix(peft::module_path(target)?, false);
        let b_name = adapter_suffix(peft::module_path(target)?, true);
        let at = spec.tensors.iter().find(|t| t.name == a_name)?;
        let bt = spec.tensors.iter().find(|t| t.name == b_name)?;
        Some((bt.shape[0], at.shape[1]))
    };
    peft::check_against(&adapter, a, shapes, layout.dims.layers)?;
    for (name, (_, values)) in &adapter.tensors {
        let ours = name.strip_prefix(PEFT_PREFIX).unwrap_or(name);
        let dst = params.tensor_mut(layout, ours).with_context(|| {
            format!("{}: tensor '{name}' is not one the run trains", dir.display())
        })?;
        dst.copy_from_slice(values);
    }
    Ok(())
}

/// The adapters of `params` as a PEFT adapter directory `dir` (`adapter_config.json`,
/// `adapter_model.safetensors` with PEFT's names), which `PeftModel.from_pretrained` loads.
pub fn write_adapter(
    layout: &ModelLayout,
    params: &ParamStore,
    a: &AdapterConfig,
    base_model: Option<&str>,
    dir: &Path,
) -> Result<()> {
    let tensors: Vec<(String, Vec<usize>, &[f32])> = layout
        .hf_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let data = params.tensor(layout, &name).expect("the layout names its own tensors");
            (format!("{PEFT_PREFIX}{name}"), shape, data)
        })
        .collect();
    peft::write(dir, a, base_model, &tensors)?;
    peft::write_sidecar(dir, a, base_model.map(Path::new))
}

/// What PEFT puts before a model's own tensor names.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The tokenizer a config names for its text formats.
pub fn load_tokenizer(raw: &RawConfig) -> Result<Box<dyn Tokenizer>> {
    let dir = match (&raw.data.tokenizer, &raw.model.path) {
        (Some(t), _) if t == "byte" => return Ok(Box::new(ByteTokenizer::new())),
        (Some(t), _) => PathBuf::from(t),
        (None, Some(p)) => p.clone(),
        (None, None) => bail!(
            "data.format {:?} needs a tokenizer\nhint: set data.tokenizer to `byte` or to a directory with tokenizer.json",
            raw.data.format
        ),
    };
    Ok(Box::new(HfTokenizer::from_dir(&dir)?))
}

/// The rows a config names (the training part, when a held-out split is configured).
pub fn load_data(raw: &RawConfig, vocab_size: usize) -> Result<PretokenizedDataset> {
    Ok(load_datasets(raw, vocab_size)?.train)
}

/// The training rows, the held-out rows if any, and what loading left out.
pub struct Datasets {
    pub train: PretokenizedDataset,
    /// `data.eval_fraction` of the examples, or the rows of `data.eval_path`.
    pub eval: Option<PretokenizedDataset>,
    /// Records left out under `data.on_error: skip` (or whose prompt alone is too long), over
    /// both files.
    pub skipped_records: usize,
    /// Examples cut at `train.max_seq_len`.
    pub truncated_records: usize,
}

/// Load the training data and the held-out split the config names: split before packing, so
/// that evaluation holds whole examples, then pack each part.
pub fn load_datasets(raw: &RawConfig, vocab_size: usize) -> Result<Datasets> {
    let d = &raw.data;
    let t = &raw.train;
    let path = d.path.clone().unwrap_or_else(|| "synthetic".into());
    let (rows, report) = load_rows(raw, d.path.as_deref(), vocab_size)?;
    let (mut skipped, mut truncated) = (report.skipped.len(), report.truncated);
    let (rows, eval_rows) = match &d.eval_path {
        Some(p) => {
            let (eval, r) = load_rows(raw, Some(p), vocab_size)?;
            skipped += r.skipped.len();
            truncated += r.truncated;
            (rows, Some((eval, p.clone())))
        }
        None if d.eval_fraction > 0.0 => {
            let (train, eval) = split_eval(rows, d.eval_fraction, t.seed);
            if eval.is_empty() {
                bail!(
                    "data.eval_fraction {}: {} has too few examples to hold any out\nhint: add data, or give data.eval_path",
                    d.eval_fraction,
                    path.display()
                );
            }
            for (part, rows) in [("training", &train), ("held-out", &eval)] {
                if !rows.iter().any(carries_loss) {
                    bail!(
                        "data.eval_fraction {}: no {part} row of {} carries a loss\nhint: change data.eval_fraction or train.seed, or give data.eval_path",
                        d.eval_fraction,
                        path.display()
                    );
                }
            }
            (train, Some((eval, path.clone())))
        }
        None => (rows, None),
    };
    let packed = |rows: Vec<Row>| if d.pack { pack(rows, t.max_seq_len) } else { rows };
    let eval = eval_rows.map(|(rows, path)| PretokenizedDataset { rows: packed(rows), path });
    if let Some(e) = &eval {
        println!("eval: {} rows held out ({})", e.rows.len(), e.path.display());
    }
    Ok(Datasets {
        train: PretokenizedDataset { rows: packed(rows), path },
        eval,
        skipped_records: skipped,
        truncated_records: truncated,
    })
}

/// The row length a run's buffers are sized for, and where it comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqLen {
    pub len: usize,
    /// For the plan: `the longest row of the data (...)`, or why `train.max_seq_len` was assumed.
    pub why: String,
}

impl SeqLen {
    /// The longest row of the training and held-out rows (after tokenisation and packing: packed
    /// rows are up to `train.max_seq_len` long), at most `train.max_seq_len`. Every buffer the
    /// engine allocates is sized by it, so short rows are not planned at `max_seq_len`.
    pub fn of_data(raw: &RawConfig, sets: &Datasets) -> SeqLen {
        let max = raw.train.max_seq_len;
        let longest = |d: &PretokenizedDataset| d.rows.iter().map(|r| r.input_ids.len()).max();
        let train = longest(&sets.train).unwrap_or(0);
        let eval = sets.eval.as_ref().and_then(longest).unwrap_or(0);
        let len = train.max(eval).clamp(1, max);
        let packed = if raw.data.pack { "packed " } else { "" };
        let of = if sets.eval.is_some() { "training and eval " } else { "" };
        SeqLen {
            len,
            why: format!("the longest row of the {packed}{of}data (train.max_seq_len {max})"),
        }
    }

    /// `train.max_seq_len`, assumed because the data's rows are not known (`why`).
    pub fn assumed(raw: &RawConfig, why: &str) -> SeqLen {
        let len = raw.train.max_seq_len;
        SeqLen { len, why: format!("train.max_seq_len, assumed: {why}") }
    }
}

/// The rows of one dataset (a JSONL or Parquet file, a directory or a glob of them) in the
/// config's format (`None`: synthetic rows), unpacked.
fn load_rows(
    raw: &RawConfig,
    path: Option<&Path>,
    vocab_size: usize,
) -> Result<(Vec<Row>, LoadReport)> {
    let d = &raw.data;
    let max = raw.train.max_seq_len;
    let path = || path.context("data.path is missing");
    let (rows, report) = match d.format {
        DataFormat::Pretokenized => {
            let src = Source::new(path()?, &d.columns);
            load_pretokenized_rows(&src, max, vocab_size, d.on_error)?
        }
        DataFormat::Synthetic => {
            let t = &raw.train;
            let n = t.batch_size * t.steps.min(16);
            let rows = synthetic_rows(n, max, vocab_size, t.seed);
            let report = LoadReport { rows: rows.len(), records: rows.len(), ..Default::default() };
            return Ok((rows, report));
        }
        DataFormat::Text | DataFormat::Alpaca | DataFormat::Chat | DataFormat::Sharegpt => {
            let tok = load_tokenizer(raw)?;
            if tok.vocab_size() > vocab_size {
                bail!(
                    "the tokenizer has {} ids but the model's vocab_size is {vocab_size}\nhint: the tokenizer and the model must match",
                    tok.vocab_size()
                );
            }
            let (p, tok, top) =
                (&Source::new(path()?, &d.columns), tok.as_ref(), d.train_on_prompt);
            match d.format {
                DataFormat::Text => load_text(p, tok, max, d.on_error)?,
                DataFormat::Alpaca => load_alpaca(p, tok, max, top, d.on_error)?,
                DataFormat::Sharegpt => load_sharegpt(p, tok, max, top, d.on_error)?,
                _ => load_chat(p, tok, max, top, d.on_error)?,
            }
        }
    };
    println!("data: {}: {}", path()?.display(), report.summary());
    Ok((rows, report))
}

/// `n` rows of `len` uniformly random tokens.
pub fn synthetic_rows(n: usize, len: usize, vocab: usize, seed: u64) -> Vec<Row> {
    let mut rng = SplitMix64::new(seed ^ 0x5DEE_CE66_D1CE_4E5B);
    (0..n)
        .map(|_| {
            let ids: Vec<i32> = (0..len).map(|_| rng.below(vocab as u64) as i32).collect();
            Row { labels: ids.clone(), input_ids: ids }
        })
        .collect()
}

/// The rows of optimizer step `k`.
pub fn step_rows<'a>(
    order: &mut BatchOrder,
    data: &'a PretokenizedDataset,
    k: usize,
) -> Vec<&'a Row> {
    let mut idx = Vec::new();
    order.indices(k, &mut idx);
    idx.iter().map(|&i| &data.rows[i]).collect()
}

/// The batch order a config and dataset give.
fn batch_order(cfg: &RunConfig, data: &PretokenizedDataset) -> BatchOrder {
    let t = &cfg.raw.train;
    BatchOrder::new(data.rows.len(), t.batch_size, cfg.raw.data.shuffle, t.seed)
}

/// A run on the streaming engine: the model in host RAM, the CPU device borrowing one layer at
/// a time.
pub struct StreamTrainer<D: Device = CpuDevice> {
    pub cfg: RunConfig,
    pub model_cfg: ModelConfig,
    /// The model's layout, with the run's adapters (`adapter:`) when it has them.
    pub layout: ModelLayout,
    pub data: PretokenizedDataset,
    /// The order batches read `data`'s rows in.
    order: BatchOrder,
    /// The held-out rows (`data.eval_fraction` / `data.eval_path`).
    pub eval: Option<PretokenizedDataset>,
    /// Records the data loaders left out (`data.on_error: skip`, or prompt too long).
    pub skipped_records: usize,
    pub plan: MemoryPlan,
    pub engine: Engine<D>,
    /// Fault injection for tests: steps (0-based) whose gradient gets a NaN.
    pub inject_nan_at: Vec<usize>,
    /// The micro-batches of the batch after the last step's (its index and them): built for
    /// their token ids, which that step took, and used again when that batch's step comes.
    ahead: Option<(usize, Vec<MicroBatch>)>,
}

impl StreamTrainer {
    /// Load, plan (refusing what does not fit, before allocating), allocate.
    pub fn new(cfg: RunConfig) -> Result<Self> {
        Self::with_resume(cfg, None)
    }

    /// As [`StreamTrainer::new`], continuing from a resumable checkpoint directory.
    pub fn with_resume(cfg: RunConfig, resume: Option<&Path>) -> Result<Self> {
        StreamTrainer::on_device(cfg, resume, |raw, plan| {
            Ok(CpuDevice::new(CpuDeviceConfig {
                capacity_bytes: plan.device_capacity() as usize,
                link_gbps: raw.device.link_gbps,
                copy_jitter_us: 0,
                jitter_seed: 0,
                wait: raw.device.wait.mode(raw.device.link_gbps),
                pin_threads: raw.engine.pin_threads,
            }))
        })
    }
}

impl<D: Device> StreamTrainer<D>
where
    D::Backend: 'static,
{
    /// As [`StreamTrainer::with_resume`], on the device `make_dev` builds once the memory plan
    /// is known (and checked).
    pub fn on_device(
        cfg: RunConfig,
        resume: Option<&Path>,
        make_dev: impl FnOnce(&RawConfig, &MemoryPlan) -> Result<D>,
    ) -> Result<Self> {
        let raw = &cfg.raw;
        let model_cfg = model_config(raw)?;
        let layout = run_layout(raw, &model_cfg, cfg.adapter.as_ref())?;
        // The data first: its longest row sizes every buffer of the plan.
        let sets = load_datasets(raw, model_cfg.vocab_size)?;
        let seq_len = SeqLen::of_data(raw, &sets);
        let ecfg = EngineConfig { seq_len: seq_len.len, ..engine_config(raw) };
        let budget = match raw.device.memory {
            ByteSize::Auto => None,
            ByteSize::Bytes(b) => Some(b),
        };
        let host = crate::engine::memory::host_available_bytes();
        let machine = Machine::new(raw.device.backend, budget, host);
        let (recompute, upload) = (raw.engine.recompute, raw.engine.weight_upload);
        let ecfg = resolve(&layout, ecfg, recompute, upload, &machine);
        let plan = machine.plan(&layout, &ecfg).sized_for(&seq_len.why);
        println!(
            "engine.weight_upload: {:?} -> {}",
            raw.engine.weight_upload,
            match ecfg.weights {
                WeightPath::Image => {
                    "a page-locked bf16 image of the trained weights, written by the optimizer"
                }
                WeightPath::Staged => {
                    "two page-locked bf16 stages, rounded from the masters by the host queue ahead of each upload"
                }
                WeightPath::Masters => {
                    "the fp32 masters, rounded inside each upload when the device is bf16"
                }
            }
        );
        println!(
            "engine.recompute: {:?} -> {}",
            raw.engine.recompute,
            recompute_words(ecfg.kept_layers, layout.dims.layers)
        );
        print!("{plan}");
        plan.check()?;
        if raw.device.backend == BackendKind::Cuda {
            cuda_kernel_limits(&layout, raw, ecfg.seq_len)?;
        }
        let mode = raw.optimizer.memory;
        // A resumed full fine-tuning run reads everything from the checkpoint; an adapter run
        // reloads its frozen base from model.path.
        let (state, base) = match (resume, &cfg.adapter) {
            (Some(dir), None) => (crate::resume::load_for(dir, &model_cfg, &layout, mode)?, None),
            (resume, adapter) => {
                let rm = load_run_model(raw, adapter.as_ref())?;
                let state = match resume {
                    Some(dir) => crate::resume::load_for(dir, &model_cfg, &layout, mode)?,
                    None => TrainState::for_memory(rm.params, &layout, mode),
                };
                (state, rm.base.map(Arc::new))
            }
        };
        let dev = make_dev(raw, &plan)?;
        let engine = Engine::with_layout(dev, layout.clone(), base, state, ecfg)?;
        let order = batch_order(&cfg, &sets.train);
        Ok(StreamTrainer {
            cfg,
            model_cfg,
            layout,
            order,
            data: sets.train,
            eval: sets.eval,
            skipped_records: sets.skipped_records,
            plan,
            engine,
            inject_nan_at: Vec::new(),
            ahead: None,
        })
    }

    /// One optimizer step on batch `k` (0-based).
    pub fn step(&mut self, k: usize) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let rows = step_rows(&mut self.order, &self.data, k);
        let tokens = rows.iter().map(|r| r.input_ids.len()).sum();
        let lr = self.cfg.raw.lr_schedule().lr_at(k + 1);
        let inject_nan = self.inject_nan_at.contains(&k);
        if !rows.iter().any(|r| carries_loss(r)) {
            // Nothing to learn from, and nothing to divide the loss by: the step is counted
            // and skipped.
            self.engine.skip_step();
            return Ok(StepMetrics::no_loss(k, lr, tokens, t0));
        }
        let size = self.engine.config().micro_batch_size;
        let mbs = match self.ahead.take() {
            Some((j, mbs)) if j == k => mbs,
            _ => micro_batches(&rows, size),
        };
        // The next batch's token ids (padding included): the engine updates the embedding rows
        // they gather first, so that the next forward need not wait for the whole embedding.
        let next = micro_batches(&step_rows(&mut self.order, &self.data, k + 1), size);
        let next_ids = next.iter().map(|mb| mb.ids.clone()).collect();
        self.ahead = Some((k + 1, next));
        let out = self.engine.step_ahead(mbs, StepParams { lr, inject_nan }, next_ids)?;
        Ok(StepMetrics {
            step: k + 1,
            loss: out.loss(),
            grad_norm: out.grad_norm,
            lr,
            tokens,
            step_s: t0.elapsed().as_secs_f64(),
            skipped: out.skipped,
            no_loss: false,
            eval_loss: None,
        })
    }

    /// Mean loss over the held-out rows with the current weights (`None` without a held-out
    /// split). Runs forward only, micro-batch by micro-batch, on the run's device through the
    /// engine (`Engine::eval`, in the step's planned buffers), after the queued updates.
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        let Some(eval) = &self.eval else {
            return Ok(None);
        };
        let rows: Vec<&Row> = eval.rows.iter().collect();
        let mbs = micro_batches(&rows, self.engine.config().micro_batch_size);
        Ok(Some(self.engine.eval(mbs)?.loss()))
    }
}

/// What the resolved `engine.recompute` does, for the start-up line: `kept` of `layers` layers
/// keep their internals.
pub(crate) fn recompute_words(kept: usize, layers: usize) -> String {
    match kept {
        0 => "the backward recomputes each block's inputs and each layer's internals".to_string(),
        k if k == layers => {
            "every layer's internals kept for its backward (no recompute)".to_string()
        }
        k => format!(
            "{k} of {layers} layers keep their internals for their backward (spread evenly, K = 1); the others recompute theirs"
        ),
    }
}

/// The engine configuration a run config describes, sized for rows of `train.max_seq_len`
/// (a run sizes for its data instead: [`SeqLen::of_data`]).
pub fn engine_config(raw: &RawConfig) -> EngineConfig {
    let t = &raw.train;
    EngineConfig {
        batch_size: t.batch_size,
        micro_batch_size: t.micro_batch_rows(),
        seq_len: t.max_seq_len,
        checkpoint_every: raw.engine.checkpoint_every,
        grad_slabs: raw.engine.grad_slabs,
        head_chunk_rows: raw.engine.head_chunk_rows,
        head_tile_rows: raw.engine.head_tile_rows,
        adamw: adamw_config(raw),
        grad_clip: raw.optimizer.grad_clip,
        memory: raw.optimizer.memory,
        kept_layers: 0,
        backend: raw.device.backend,
        grad_wire: raw.engine.grad_wire,
        weights: WeightPath::Masters,
        host_threads: raw.engine.host_threads,
        pin_threads: raw.engine.pin_threads,
    }
}

fn adamw_config(raw: &RawConfig) -> AdamWConfig {
    let o = &raw.optimizer;
    AdamWConfig {
        lr: o.lr,
        beta1: o.betas[0],
        beta2: o.betas[1],
        eps: o.eps,
        weight_decay: o.weight_decay,
    }
}

/// Run a job on the streaming engine: steps, `metrics.jsonl`, `summary.json`, and (unless
/// `export` is false, as for benchmarks) the final HF directory. `warmup` steps are excluded
/// from the summary's timings.
pub fn run_streaming(
    cfg: RunConfig,
    export_final: bool,
    warmup: usize,
    resume: Option<&str>,
) -> Result<Summary> {
    let out_dir = cfg.raw.output.dir.clone();
    fs::create_dir_all(&out_dir).with_context(|| {
        format!(
            "output.dir {}: cannot create the directory\nhint: choose a writable output.dir",
            out_dir.display()
        )
    })?;
    // Held until this function returns (the OS releases it if the process dies first): a
    // second run into the same directory is refused before it writes anything there.
    let _lock = crate::run_lock::RunLock::acquire(&out_dir)?;
    let yaml = cfg.raw.to_yaml();
    println!("# resolved config ({})\n{yaml}", cfg.origin);
    fs::write(out_dir.join("config.yaml"), &yaml)
        .with_context(|| format!("output.dir {}: cannot write config.yaml", out_dir.display()))?;

    let resume_dir = resume.map(|r| crate::resume::resolve(r, &out_dir)).transpose()?;
    match cfg.raw.device.backend {
        BackendKind::Cpu => {
            let tr = StreamTrainer::with_resume(cfg, resume_dir.as_deref())?;
            drive(tr, out_dir, yaml, resume_dir, export_final, warmup)
        }
        BackendKind::Cuda => {
            let tr = StreamTrainer::on_device(cfg, resume_dir.as_deref(), cuda_device)?;
            drive(tr, out_dir, yaml, resume_dir, export_final, warmup)
        }
    }
}

/// Refuses a model the CUDA kernels cannot run (a head dim over the attention kernel's limit,
/// sizes beyond its int range) when the plan is made, naming the limit and the value; rows
/// are at most `seq_len` long.
pub fn cuda_kernel_limits(layout: &ModelLayout, raw: &RawConfig, seq_len: usize) -> Result<()> {
    let d = &layout.dims;
    let shape = horizon_backend::cuda::KernelShape {
        c: d.c,
        h: d.h,
        kvh: d.kvh,
        d: d.d,
        f: d.f,
        v: d.v,
        b: raw.train.micro_batch_rows(),
        t: seq_len,
    };
    horizon_backend::cuda::check_kernel_limits(&shape).context("device.backend = cuda")?;
    Ok(())
}

/// The CUDA device of a run (`device.backend: cuda`): GPU 0, a pool of the plan's device bytes,
/// bf16 weights on the wire and in the slots, bf16 tensor-core matmuls with fp32 accumulation,
/// attention on the kernels `device.attention` picks. In a binary built without the `cuda`
/// feature this is an error saying so.
fn cuda_device(raw: &RawConfig, plan: &MemoryPlan) -> Result<CudaDevice> {
    let mut cfg = CudaDeviceConfig::with_capacity(plan.device_capacity() as usize);
    cfg.attention = raw.device.attention.kernels();
    CudaDevice::new(cfg).context("device.backend = cuda")
}

/// The step loop of [`run_streaming`], on any device.
fn drive<D: Device>(
    mut tr: StreamTrainer<D>,
    out_dir: PathBuf,
    yaml: String,
    resume_dir: Option<PathBuf>,
    export_final: bool,
    warmup: usize,
) -> Result<Summary>
where
    D::Backend: 'static,
{
    let steps = tr.cfg.raw.train.steps;
    let start = tr.engine.state().step as usize;
    if let Some(d) = &resume_dir {
        println!("resuming from {} at step {start}", d.display());
    }
    // SIGINT / SIGTERM: finish the step in flight, write a checkpoint, stop.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())
            .context("cannot install the signal handler")?;
    }
    let t = tr.cfg.raw.train.clone();
    let mut last_ckpt: Option<PathBuf> = resume_dir.clone();
    let mut bad_run = 0usize;
    // Test hook (test builds only): steps (0-based) whose gradient gets a NaN (exercises the
    // non-finite path).
    #[cfg(feature = "test-hooks")]
    if let Ok(v) = std::env::var("HORIZON_TEST_NAN_STEPS") {
        tr.inject_nan_at = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
    }
    println!(
        "model: {} layers, hidden {}, {} params; data: {} rows; {} micro-batch(es) per step, checkpoint every {} layers; host threads: {} (engine.host_threads: {})",
        tr.model_cfg.num_layers,
        tr.model_cfg.hidden_size,
        tr.engine.sizes().params,
        tr.data.rows.len(),
        tr.engine.sizes().micro_batches,
        tr.cfg.raw.engine.checkpoint_every,
        tr.engine.host_threads(),
        tr.cfg.raw.engine.host_threads
    );
    let metrics_path = out_dir.join("metrics.jsonl");
    let mut metrics_file = fs::OpenOptions::new()
        .create(true)
        .append(start > 0)
        .write(true)
        .truncate(start == 0)
        .open(&metrics_path)
        .with_context(|| format!("cannot create {}", metrics_path.display()))?;
    let mut progress = Progress::new(start, steps);
    if tr.cfg.trace.is_some() {
        tr.engine.start_trace((steps - start).min(crate::engine::trace::MAX_STEPS));
    }
    let mut base = tr.engine.device().stats();
    let mut base_phases = tr.engine.phase_seconds();
    let mut t0 = Instant::now();
    let run_t0 = Instant::now();
    let (mut tokens, mut timed_steps, mut last_loss) = (0usize, 0usize, f64::NAN);
    let (mut skipped_steps, mut eval_loss, mut ran) = (0usize, None, 0usize);
    for k in start..steps {
        if k == (start + warmup).min(steps - 1) && k > start {
            // Timings start after the warm-up, once its queued work is done.
            tr.engine.state();
            base = tr.engine.device().stats();
            base_phases = tr.engine.phase_seconds();
            t0 = Instant::now();
            tokens = 0;
            timed_steps = 0;
        }
        let mut m = tr.step(k)?;
        ran += 1;
        let last = k + 1 == steps;
        if tr.eval.is_some() && ((t.eval_every > 0 && (k + 1) % t.eval_every == 0) || last) {
            m.eval_loss = tr.evaluate()?;
            eval_loss = m.eval_loss;
            if let Some(e) = m.eval_loss {
                tracing::info!(step = m.step, eval_loss = e, "evaluated the held-out rows");
            }
        }
        writeln!(metrics_file, "{}", serde_json::to_string(&m)?)
            .with_context(|| format!("cannot write {}", metrics_path.display()))?;
        let eta = run_t0.elapsed().as_secs_f64() / (k + 1 - start) as f64 * (steps - k - 1) as f64;
        progress.step(&m, steps, eta);
        tokens += m.tokens;
        timed_steps += 1;
        if m.no_loss {
            skipped_steps += 1;
            progress.println(&format!(
                "step {}: no position of the batch carries a loss; step skipped",
                m.step
            ));
        } else if m.skipped {
            bad_run += 1;
            skipped_steps += 1;
            progress.println(&format!(
                "step {}: non-finite loss or gradient norm; update skipped ({bad_run} in a row)",
                m.step
            ));
            if bad_run >= t.max_bad_steps {
                let last =
                    last_ckpt.as_ref().map_or("none".to_string(), |p| p.display().to_string());
                bail!(
                    "stopping: {bad_run} consecutive steps with a non-finite loss or gradient norm (train.max_bad_steps = {}); last good checkpoint: {last}\nhint: lower optimizer.lr, or check the data of those steps",
                    t.max_bad_steps
                );
            }
        } else {
            bad_run = 0;
        }
        if !m.no_loss {
            last_loss = m.loss;
        }
        let signalled = stop.load(Ordering::Relaxed);
        // Periodic checkpoints only after good steps: the last one stays the last good state.
        if (t.save_every > 0 && (k + 1) % t.save_every == 0 && !m.skipped) || signalled {
            let state = tr.engine.checked_state()?;
            progress.println(&format!("saving checkpoint step-{:08}", state.step));
            let dir = crate::resume::save(
                &out_dir,
                state,
                &tr.layout,
                &tr.model_cfg,
                &yaml,
                t.keep_checkpoints,
            )?;
            tracing::info!(dir = %dir.display(), "checkpoint written");
            last_ckpt = Some(dir);
        }
        if signalled {
            progress.finish();
            println!(
                "interrupted after step {}; resume with: horizon train --config {} --resume latest",
                k + 1,
                tr.cfg.origin
            );
            break;
        }
    }
    progress.finish();
    metrics_file.flush()?;
    let state_step = tr.engine.checked_state()?.step;
    let tally = Tally { tokens, timed_steps, skipped_steps, eval_loss, last_loss, state_step };
    let summary = summarize(&mut tr, &tally, (&base, &base_phases), t0);
    let summary_path = out_dir.join("summary.json");
    fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("cannot write {}", summary_path.display()))?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    if let Some(path) = &tr.cfg.trace {
        crate::engine::trace::write_chrome(path, "bench", &tr.engine.trace_spans())?;
        println!("trace of the run's steps: {}", path.display());
    }
    // Nothing was applied: the weights are the ones the run started from, and exporting them
    // as this run's result would pass a broken model on. metrics.jsonl and summary.json stay.
    if ran > 0 && skipped_steps == ran {
        bail!(
            "every one of the {ran} steps of this run was skipped (a non-finite loss or gradient norm): no update was applied, so {} was not written\nhint: check the model's weights and the data, or lower optimizer.lr; {} has the losses",
            out_dir.join("final").display(),
            metrics_path.display()
        );
    }
    if export_final {
        write_final(&mut tr, &out_dir, &summary, &metrics_path, &summary_path, state_step)?;
    }
    Ok(summary)
}

/// What the step loop counted, for the summary.
struct Tally {
    tokens: usize,
    timed_steps: usize,
    skipped_steps: usize,
    eval_loss: Option<f64>,
    last_loss: f64,
    state_step: u64,
}

/// The run's summary: the timed steps' throughput, FLOPs and memory against the device's
/// counters at the end of the warm-up (`base`) and the clock started then (`t0`).
fn summarize<D: Device>(
    tr: &mut StreamTrainer<D>,
    tally: &Tally,
    (base, base_phases): (&DeviceStats, &PhaseSeconds),
    t0: Instant,
) -> Summary
where
    D::Backend: 'static,
{
    let Tally { tokens, timed_steps, skipped_steps, eval_loss, last_loss, state_step } = *tally;
    let wall_s = t0.elapsed().as_secs_f64();
    let st = tr.engine.device().stats();
    let compute = st.compute_busy_s - base.compute_busy_s;
    let link = st.link_busy_s - base.link_busy_s;
    let per_step = step_flops(
        tr.engine.schedule(),
        &tr.layout,
        tr.cfg.raw.train.micro_batch_rows(),
        tr.engine.config().seq_len,
    );
    let k = timed_steps as f64;
    let flops = StepFlops {
        schedule: per_step.schedule * k,
        recompute: per_step.recompute * k,
        model: per_step.model * k,
    };
    Summary {
        steps: timed_steps,
        total_steps: state_step as usize,
        skipped_steps,
        skipped_records: tr.skipped_records,
        eval_loss,
        eval_rows: tr.eval.as_ref().map_or(0, |e| e.rows.len()),
        tokens,
        wall_s,
        tokens_per_s: tokens as f64 / wall_s.max(1e-9),
        peak_rss_bytes: peak_rss_bytes().unwrap_or(0),
        planned_host_bytes: tr.plan.host_total(),
        peak_device_bytes: st.peak_bytes as u64,
        planned_device_bytes: tr.plan.device_total(),
        h2d_bytes: st.h2d_bytes - base.h2d_bytes,
        d2h_bytes: st.d2h_bytes - base.d2h_bytes,
        device_compute_s: compute,
        link_busy_s: link,
        overlap_ratio: wall_s / compute.max(link).max(1e-9),
        final_loss: last_loss,
        phase_s: tr.engine.phase_seconds().since(base_phases),
        h2d_busy_s: st.h2d_busy_s - base.h2d_busy_s,
        d2h_busy_s: st.d2h_busy_s - base.d2h_busy_s,
        host_busy_s: st.host_busy_s - base.host_busy_s,
        compute_idle_s: (wall_s - compute).max(0.0),
        flops,
        achieved_gflops: flops.schedule / wall_s.max(1e-9) * 1e-9,
        model_gflops: flops.model / wall_s.max(1e-9) * 1e-9,
        optimizer_memory: tr.cfg.raw.optimizer.memory.name().to_string(),
        params: tr.plan.params,
        planned_host_bytes_per_param: tr.plan.host_total() as f64 / tr.plan.params.max(1) as f64,
        peak_rss_bytes_per_param: peak_rss_bytes().unwrap_or(0) as f64
            / tr.plan.params.max(1) as f64,
        pinned_bytes: st.pinned_bytes as u64,
        planned_pinned_bytes: tr.plan.pinned,
        host_threads: tr.engine.host_threads(),
        weight_upload: tr.engine.config().weight_path().name().to_string(),
        device_wait: tr.cfg.raw.device.wait.resolve(tr.cfg.raw.device.link_gbps).name().to_string(),
    }
}

/// `OUT/training.png`, `OUT/report.md` and the exported `OUT/final/`.
fn write_final<D: Device>(
    tr: &mut StreamTrainer<D>,
    out_dir: &Path,
    summary: &Summary,
    metrics_path: &Path,
    summary_path: &Path,
    state_step: u64,
) -> Result<()>
where
    D::Backend: 'static,
{
    let plot_path = out_dir.join("training.png");
    let title = format!("{} ({} steps)", tr.cfg.origin, state_step);
    // The plot is a convenience: failing to draw it does not fail the run.
    let plotted = crate::report::read_metrics(metrics_path)
        .and_then(|pts| crate::report::plot(&pts, &plot_path, &title));
    if let Err(e) = &plotted {
        eprintln!("warning: no plot: {e:#}");
    }
    let report = crate::report::write_report(
        out_dir,
        &tr.cfg.origin,
        summary,
        plotted.is_ok().then_some(plot_path.as_path()),
    )?;
    let final_dir = out_dir.join("final");
    if let Some(a) = tr.cfg.adapter.clone() {
        let base = tr.cfg.raw.model.path.as_ref().map(|p| p.display().to_string());
        write_adapter(&tr.layout, &tr.engine.state().params, &a, base.as_deref(), &final_dir)?;
        println!(
            "wrote {}, {}, {} and {} (a PEFT adapter)",
            metrics_path.display(),
            summary_path.display(),
            report.display(),
            final_dir.display()
        );
        return Ok(());
    }
    let params = &tr.engine.state().params;
    let raw = &tr.cfg.raw;
    let exported = crate::export::export_model(
        &tr.model_cfg,
        params,
        &final_dir,
        raw.output.export_options(),
        &crate::export::ExportSource::of_config(raw),
    )?;
    tracing::info!(
        shards = exported.shards.len(),
        bytes = exported.total_bytes,
        tokenizer_files = exported.tokenizer_files.len(),
        "exported final/"
    );
    println!(
        "wrote {}, {}, {} and {}",
        metrics_path.display(),
        summary_path.display(),
        report.display(),
        final_dir.display()
    );
    Ok(())
}

/// What a person watching a run sees: on a terminal, a progress bar (loss, tokens/s, peak
/// memory, ETA) with a step line every few percent; otherwise (a log file, a pipe) one line per
/// step.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    /// On a terminal, print a step line every this many steps.
    every: usize,
}

impl Progress {
    fn new(start: usize, steps: usize) -> Self {
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() {
            return Progress { bar: None, every: 1 };
        }
        let bar = indicatif::ProgressBar::new(steps as u64);
        let style = indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30.cyan/blue}] {pos}/{len} {msg} eta {eta}",
        )
        .expect("the template is valid")
        .progress_chars("=> ");
        bar.set_style(style);
        bar.set_position(start as u64);
        Progress { bar: Some(bar), every: steps.div_ceil(25).max(1) }
    }

    fn step(&mut self, m: &StepMetrics, steps: usize, eta_s: f64) {
        let tps = m.tokens as f64 / m.step_s.max(1e-9);
        let rss = peak_rss_bytes().map_or(String::new(), |b| format!("  peak RSS {}", gib(b)));
        let eval = m.eval_loss.map_or(String::new(), |e| format!("  eval_loss {e:.6}"));
        let line = format!(
            "step {:>5}/{steps}  loss {:.6}  grad_norm {:.4}  lr {:.3e}  {:.0} tok/s{eval}  eta {}{rss}",
            m.step,
            m.loss,
            m.grad_norm,
            m.lr,
            tps,
            hms(eta_s)
        );
        match &self.bar {
            Some(bar) => {
                bar.set_message(format!("loss {:.4}  {tps:.0} tok/s{rss}", m.loss));
                bar.inc(1);
                if m.step.is_multiple_of(self.every) || m.step == steps || m.eval_loss.is_some() {
                    bar.println(line);
                }
            }
            None => {
                println!("{line}");
                let _ = std::io::stdout().flush();
            }
        }
    }

    fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => {
                println!("{line}");
                let _ = std::io::stdout().flush();
            }
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// `1h02m03s`, `4m05s`, `6s`.
fn hms(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, sec) => format!("{h}h{m:02}m{sec:02}s"),
    }
}

/// A step's rows as the engine takes them: micro-batches of at most `size` rows, each
/// right-padded with shifted targets.
pub fn micro_batches(rows: &[&Row], size: usize) -> Vec<MicroBatch> {
    rows.chunks(size.max(1))
        .map(|chunk| {
            let b = make_batch(chunk);
            MicroBatch { b: b.b, t: b.t, ids: Arc::new(b.input_ids), targets: Arc::new(b.targets) }
        })
        .collect()
}

/// A data batch as the model takes it: its rows' token ids and shifted targets.
pub fn tokens_of(batch: &Batch) -> Tokens<'_> {
    Tokens { b: batch.b, t: batch.t, ids: &batch.input_ids, targets: &batch.targets }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_order_visits_each_row_once_per_epoch_and_matches_a_fresh_order() {
        let (len, b) = (10, 4);
        let mut order = BatchOrder::new(len, b, true, 7);
        let mut seen = Vec::new();
        let mut idx = Vec::new();
        for k in 0..5 {
            order.indices(k, &mut idx);
            assert_eq!(idx, batch_indices(len, k, b, true, 7), "batch {k}");
            seen.extend_from_slice(&idx);
        }
        for epoch in seen.chunks(len) {
            let mut e = epoch.to_vec();
            e.sort();
            assert_eq!(e, (0..len).collect::<Vec<_>>());
        }
        assert_ne!(seen[..len], seen[len..], "each epoch has its own permutation");
        let mut plain = BatchOrder::new(len, b, false, 7);
        plain.indices(2, &mut idx);
        assert_eq!(idx, [8, 9, 0, 1]);
    }
}
