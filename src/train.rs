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

use crate::config::{ByteSize, DataFormat, ModelInit, OptimizerMemory, RawConfig, RunConfig};
use crate::data::pretokenized::{Batch, PretokenizedDataset, Row, load_pretokenized, make_batch};
use crate::data::{load_alpaca, load_chat, load_text, pack, shuffled_order};
use crate::engine::exec::{Engine, EngineConfig, Sizes, StepParams};
use crate::engine::memory::{MemoryPlan, peak_rss_bytes};
use crate::hf::checkpoint::SaveDtype;
use crate::hf::config::ModelConfig;
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::model::transformer::{Capacity, Transformer};
use crate::optim::adamw::{AdamWConfig, AdamWStep, adamw_update, clip_coefficient, sum_squares};
use crate::optim::adamw8bit::Moments8;
use crate::rng::SplitMix64;
use crate::tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer};
use horizon_backend::Device;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};

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
    /// The update was skipped: the loss or the gradient norm was not finite.
    pub skipped: bool,
}

/// The model's optimizer state in host RAM: masters, gradients, AdamW moments.
pub struct TrainState {
    pub params: ParamStore,
    pub grads: ParamStore,
    pub m: ParamStore,
    pub v: ParamStore,
    /// Optimizer steps run (the data and schedule position), skipped ones included.
    pub step: u64,
    /// Updates applied to the masters (AdamW's bias-correction count): `step` minus the steps
    /// skipped for a non-finite loss or gradient.
    pub updates: u64,
    /// `optimizer.memory: compact`: the 8-bit moments, one per buffer (then `m` and `v` hold
    /// empty buffers).
    pub q8: Option<Vec<Moments8>>,
    /// The last finite global gradient norm: what `lean`/`compact` clip the next step with.
    pub last_norm: Option<f64>,
}

impl TrainState {
    pub fn new(params: ParamStore) -> Self {
        let zeros = || {
            let mut z = params.clone();
            z.fill_zero();
            z
        };
        TrainState {
            grads: zeros(),
            m: zeros(),
            v: zeros(),
            params,
            step: 0,
            updates: 0,
            q8: None,
            last_norm: None,
        }
    }

    /// Fresh state holding only what `mode` keeps: no layer gradients in `lean`/`compact`, 8-bit
    /// moments in `compact`. Allocates nothing it does not keep.
    pub fn for_memory(params: ParamStore, mode: OptimizerMemory) -> Self {
        let empty = ParamStore::empty_like(&params);
        let mut state = TrainState {
            grads: empty.clone(),
            m: empty.clone(),
            v: empty,
            params,
            step: 0,
            updates: 0,
            q8: None,
            last_norm: None,
        };
        state.grads = state.params.zeros_like(mode.streams_updates());
        if mode == OptimizerMemory::Compact {
            state.q8 =
                Some(state.params.buffers().iter().map(|b| Moments8::zeros(b.len())).collect());
        } else {
            state.m = state.params.zeros_like(false);
            state.v = state.params.zeros_like(false);
        }
        state
    }

    /// The memory mode this state is laid out for.
    pub fn memory(&self) -> OptimizerMemory {
        if self.q8.is_some() {
            OptimizerMemory::Compact
        } else if self.grads.layers.iter().all(|l| l.is_empty()) && !self.params.layers.is_empty() {
            OptimizerMemory::Lean
        } else {
            OptimizerMemory::Exact
        }
    }

    /// Re-lay the state out for `mode`: `exact` and `lean` hold the same optimizer state (lean
    /// drops the layer gradients, which are zero between steps); `compact` quantises the fp32
    /// moments, and leaving `compact` decodes them.
    pub fn into_memory(mut self, mode: OptimizerMemory) -> Self {
        if self.memory() == mode {
            return self;
        }
        let streamed = mode.streams_updates();
        if self.grads.layers.iter().any(|l| l.is_empty()) != streamed
            || self.params.layers.is_empty()
        {
            self.grads = self.params.zeros_like(streamed);
        }
        match (self.q8.is_some(), mode == OptimizerMemory::Compact) {
            (false, true) => {
                let mut q8 = Vec::new();
                for ((p, m), v) in
                    self.params.buffers().iter().zip(self.m.buffers()).zip(self.v.buffers())
                {
                    let mut q = Moments8::zeros(p.len());
                    q.encode(m, v);
                    q8.push(q);
                }
                self.q8 = Some(q8);
                self.m = ParamStore::empty_like(&self.params);
                self.v = ParamStore::empty_like(&self.params);
            }
            (true, false) => {
                let q8 = self.q8.take().expect("checked");
                self.m = self.params.zeros_like(false);
                self.v = self.params.zeros_like(false);
                for ((q, m), v) in q8.iter().zip(self.m.buffers_mut()).zip(self.v.buffers_mut()) {
                    let (dm, dv) = q.decode();
                    m.copy_from_slice(&dm);
                    v.copy_from_slice(&dv);
                }
            }
            _ => {}
        }
        self
    }

    /// Copies of the masters and both moments (for tests and comparisons).
    pub fn clone_params_and_moments(&self) -> (ParamStore, ParamStore, ParamStore) {
        (self.params.clone(), self.m.clone(), self.v.clone())
    }

    /// Global L2 norm of the gradients, accumulated in f64 in a fixed order.
    pub fn grad_norm(&self) -> f64 {
        self.grads.buffers().iter().map(|b| sum_squares(b)).sum::<f64>().sqrt()
    }

    /// Clip by the global norm (`max_norm` 0 = off) and take one AdamW step on every buffer.
    pub fn optimizer_step(&mut self, cfg: &AdamWConfig, lr: f64, grad_norm: f64, max_norm: f64) {
        self.step += 1;
        self.updates += 1;
        let coef = clip_coefficient(grad_norm, max_norm);
        let st = AdamWStep::new(cfg, self.updates, lr);
        let p = self.params.buffers_mut();
        let g = self.grads.buffers();
        let m = self.m.buffers_mut();
        let v = self.v.buffers_mut();
        for (((p, g), m), v) in p.into_iter().zip(g).zip(m).zip(v) {
            adamw_update(p, g, m, v, &st, coef);
        }
    }
}

/// Row indices of batch `k`: `[k*B, (k+1)*B)` cycling through the data; with `shuffle`, each
/// epoch reads the rows in its own seeded permutation.
pub fn batch_indices(len: usize, k: usize, b: usize, shuffle: bool, seed: u64) -> Vec<usize> {
    let mut perm: Option<(usize, Vec<usize>)> = None;
    (0..b)
        .map(|i| {
            let g = k * b + i;
            let (epoch, pos) = (g / len, g % len);
            if !shuffle {
                return pos;
            }
            if perm.as_ref().is_none_or(|(e, _)| *e != epoch) {
                perm = Some((epoch, shuffled_order(len, seed, epoch as u64)));
            }
            perm.as_ref().expect("set above").1[pos]
        })
        .collect()
}

/// Everything a run needs, loaded and checked before the first step.
pub struct Trainer {
    pub cfg: RunConfig,
    pub model_cfg: ModelConfig,
    pub data: PretokenizedDataset,
    pub state: TrainState,
    pub engine: Transformer<CpuBackend>,
}

impl Trainer {
    /// Load model and data, and allocate every buffer the run needs.
    pub fn new(cfg: RunConfig) -> Result<Self> {
        let raw = &cfg.raw;
        let (model_cfg, params) = load_model(raw)?;
        let data = load_data(raw, model_cfg.vocab_size)?;
        let engine = Transformer::new(
            CpuBackend,
            &model_cfg,
            Capacity {
                batch: raw.train.batch_size,
                seq_len: data.rows.iter().map(|r| r.input_ids.len()).max().unwrap_or(1),
                head_chunk_rows: raw.engine.head_chunk_rows,
            },
        );
        Ok(Trainer { state: TrainState::new(params), cfg, model_cfg, data, engine })
    }

    /// The batch of optimizer step `k` (0-based), and its count of real (non-padding) tokens.
    pub fn batch(&self, k: usize) -> (Batch, usize) {
        let rows = step_rows(&self.cfg, &self.data, k);
        let tokens = rows.iter().map(|r| r.input_ids.len()).sum();
        (make_batch(&rows), tokens)
    }

    /// One optimizer step on batch `k`.
    pub fn step(&mut self, k: usize) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let (batch, tokens) = self.batch(k);
        let o = &self.cfg.raw.optimizer;
        self.state.grads.fill_zero();
        let out = self.engine.forward_backward(
            &self.state.params,
            &mut self.state.grads,
            &batch,
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
        })
    }

    /// Write the trained model as a HF directory (`config.json` + fp32 `model.safetensors`).
    pub fn export(&self, dir: &Path) -> Result<()> {
        export(&self.model_cfg, &self.state.params, dir)
    }
}

/// Write a model as a HF directory (`config.json` + fp32 `model.safetensors`).
pub fn export(model_cfg: &ModelConfig, params: &ParamStore, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let cfg_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&model_cfg.to_hf_json())?;
    fs::write(&cfg_path, text).with_context(|| format!("cannot write {}", cfg_path.display()))?;
    params.save_safetensors(
        &ModelLayout::new(model_cfg),
        &dir.join("model.safetensors"),
        SaveDtype::F32,
    )
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
    let layout = ModelLayout::new(&model_cfg);
    let params = match (raw.model.init, &raw.model.path) {
        (Some(ModelInit::Random), _) => {
            let std =
                raw.model.hf.get("initializer_range").and_then(|v| v.as_f64()).unwrap_or(0.02);
            ParamStore::random(&layout, raw.model.seed, std as f32)
        }
        (None, Some(dir)) => ParamStore::load_hf(&layout, dir)?,
        (None, None) => bail!("model.path is missing"),
    };
    Ok((model_cfg, params))
}

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

/// The rows a config names.
pub fn load_data(raw: &RawConfig, vocab_size: usize) -> Result<PretokenizedDataset> {
    let d = &raw.data;
    let max = raw.train.max_seq_len;
    let path = || d.path.as_deref().context("data.path is missing");
    let (rows, report) = match d.format {
        DataFormat::Pretokenized => return load_pretokenized(path()?, max, vocab_size),
        DataFormat::Synthetic => {
            let t = &raw.train;
            let n = t.batch_size * t.steps.min(16);
            return Ok(PretokenizedDataset {
                rows: synthetic_rows(n, max, vocab_size, t.seed),
                path: "synthetic".into(),
            });
        }
        DataFormat::Text | DataFormat::Alpaca | DataFormat::Chat => {
            let tok = load_tokenizer(raw)?;
            if tok.vocab_size() > vocab_size {
                bail!(
                    "the tokenizer has {} ids but the model's vocab_size is {vocab_size}\nhint: the tokenizer and the model must match",
                    tok.vocab_size()
                );
            }
            let p = path()?;
            match d.format {
                DataFormat::Text => load_text(p, tok.as_ref(), max, d.on_error)?,
                DataFormat::Alpaca => {
                    load_alpaca(p, tok.as_ref(), max, d.train_on_prompt, d.on_error)?
                }
                _ => load_chat(p, tok.as_ref(), max, d.train_on_prompt, d.on_error)?,
            }
        }
    };
    println!("data: {}", report.summary());
    let rows = if d.pack { pack(rows, max) } else { rows };
    Ok(PretokenizedDataset { rows, path: path()?.to_path_buf() })
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
pub fn step_rows<'a>(cfg: &RunConfig, data: &'a PretokenizedDataset, k: usize) -> Vec<&'a Row> {
    let t = &cfg.raw.train;
    batch_indices(data.rows.len(), k, t.batch_size, cfg.raw.data.shuffle, t.seed)
        .iter()
        .map(|&i| &data.rows[i])
        .collect()
}

/// What a run reports at the end (`OUT/summary.json`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    pub steps: usize,
    pub tokens: usize,
    pub wall_s: f64,
    pub tokens_per_s: f64,
    pub peak_rss_bytes: u64,
    pub planned_host_bytes: u64,
    pub peak_device_bytes: u64,
    pub planned_device_bytes: u64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub device_compute_s: f64,
    pub link_busy_s: f64,
    /// `wall_s / max(device_compute_s, link_busy_s)`: 1.0 is perfect overlap.
    pub overlap_ratio: f64,
    pub final_loss: f64,
    /// `optimizer.memory` of the run.
    pub optimizer_memory: String,
    /// Parameters of the model, and the planned / measured host bytes per parameter.
    pub params: u64,
    pub planned_host_bytes_per_param: f64,
    pub peak_rss_bytes_per_param: f64,
}

/// A run on the streaming engine: the model in host RAM, the CPU device borrowing one layer at
/// a time.
pub struct StreamTrainer {
    pub cfg: RunConfig,
    pub model_cfg: ModelConfig,
    pub data: PretokenizedDataset,
    pub plan: MemoryPlan,
    pub engine: Engine<CpuDevice>,
    /// Fault injection for tests: steps (0-based) whose gradient gets a NaN.
    pub inject_nan_at: Vec<usize>,
}

impl StreamTrainer {
    /// Load, plan (refusing what does not fit, before allocating), allocate.
    pub fn new(cfg: RunConfig) -> Result<Self> {
        Self::with_resume(cfg, None)
    }

    /// As [`StreamTrainer::new`], continuing from a resumable checkpoint directory.
    pub fn with_resume(cfg: RunConfig, resume: Option<&Path>) -> Result<Self> {
        let raw = &cfg.raw;
        let model_cfg = model_config(raw)?;
        let layout = ModelLayout::new(&model_cfg);
        let ecfg = engine_config(raw);
        let sizes = Sizes::new(&layout, &ecfg);
        let budget = match raw.device.memory {
            ByteSize::Auto => None,
            ByteSize::Bytes(b) => Some(b),
        };
        let plan = MemoryPlan::new(&sizes, budget, true);
        print!("{plan}");
        plan.check()?;
        let state = match resume {
            Some(dir) => crate::resume::load_for(dir, &model_cfg, raw.optimizer.memory)?,
            None => TrainState::for_memory(load_model(raw)?.1, raw.optimizer.memory),
        };
        let data = load_data(raw, model_cfg.vocab_size)?;
        let dev = CpuDevice::new(CpuDeviceConfig {
            capacity_bytes: plan.device_capacity() as usize,
            link_gbps: raw.device.link_gbps,
            copy_jitter_us: 0,
            jitter_seed: 0,
        });
        let engine = Engine::new(dev, &model_cfg, state, ecfg)?;
        Ok(StreamTrainer { cfg, model_cfg, data, plan, engine, inject_nan_at: Vec::new() })
    }

    /// One optimizer step on batch `k` (0-based).
    pub fn step(&mut self, k: usize) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let rows = step_rows(&self.cfg, &self.data, k);
        let tokens = rows.iter().map(|r| r.input_ids.len()).sum();
        let lr = self.cfg.raw.lr_schedule().lr_at(k + 1);
        let inject_nan = self.inject_nan_at.contains(&k);
        let out = self.engine.step(&rows, StepParams { lr, inject_nan })?;
        Ok(StepMetrics {
            step: k + 1,
            loss: out.loss(),
            grad_norm: out.grad_norm,
            lr,
            tokens,
            step_s: t0.elapsed().as_secs_f64(),
            skipped: out.skipped,
        })
    }
}

/// The engine configuration a run config describes.
pub fn engine_config(raw: &RawConfig) -> EngineConfig {
    let t = &raw.train;
    EngineConfig {
        batch_size: t.batch_size,
        micro_batch_size: t.micro_batch_size.unwrap_or(t.batch_size),
        seq_len: t.max_seq_len,
        checkpoint_every: raw.engine.checkpoint_every,
        grad_slabs: raw.engine.grad_slabs,
        head_chunk_rows: raw.engine.head_chunk_rows,
        adamw: adamw_config(raw),
        grad_clip: raw.optimizer.grad_clip,
        memory: raw.optimizer.memory,
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
    let yaml = cfg.raw.to_yaml();
    println!("# resolved config ({})\n{yaml}", cfg.origin);
    fs::write(out_dir.join("config.yaml"), &yaml)
        .with_context(|| format!("output.dir {}: cannot write config.yaml", out_dir.display()))?;

    let resume_dir = resume.map(|r| crate::resume::resolve(r, &out_dir)).transpose()?;
    let mut tr = StreamTrainer::with_resume(cfg, resume_dir.as_deref())?;
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
    // Test hook: steps (0-based) whose gradient gets a NaN (exercises the non-finite path).
    if let Ok(v) = std::env::var("HORIZON_TEST_NAN_STEPS") {
        tr.inject_nan_at = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
    }
    println!(
        "model: {} layers, hidden {}, {} params; data: {} rows; {} micro-batch(es) per step, checkpoint every {} layers",
        tr.model_cfg.num_layers,
        tr.model_cfg.hidden_size,
        tr.engine.sizes().params,
        tr.data.rows.len(),
        tr.engine.sizes().micro_batches,
        tr.cfg.raw.engine.checkpoint_every
    );
    let metrics_path = out_dir.join("metrics.jsonl");
    let mut metrics_file = fs::OpenOptions::new()
        .create(true)
        .append(start > 0)
        .write(true)
        .truncate(start == 0)
        .open(&metrics_path)
        .with_context(|| format!("cannot create {}", metrics_path.display()))?;
    let mut base = tr.engine.device().stats();
    let mut t0 = Instant::now();
    let (mut tokens, mut timed_steps, mut last_loss) = (0usize, 0usize, f64::NAN);
    for k in start..steps {
        if k == (start + warmup).min(steps - 1) && k > start {
            // Timings start after the warm-up, once its queued work is done.
            tr.engine.state();
            base = tr.engine.device().stats();
            t0 = Instant::now();
            tokens = 0;
            timed_steps = 0;
        }
        let m = tr.step(k)?;
        writeln!(metrics_file, "{}", serde_json::to_string(&m)?)
            .with_context(|| format!("cannot write {}", metrics_path.display()))?;
        println!(
            "step {:>5}/{steps}  loss {:.6}  grad_norm {:.4}  lr {:.3e}  {:.0} tok/s",
            m.step,
            m.loss,
            m.grad_norm,
            m.lr,
            m.tokens as f64 / m.step_s.max(1e-9)
        );
        std::io::stdout().flush()?;
        tokens += m.tokens;
        timed_steps += 1;
        last_loss = m.loss;
        if m.skipped {
            bad_run += 1;
            eprintln!(
                "step {}: non-finite loss or gradient norm; update skipped ({bad_run} in a row)",
                m.step
            );
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
        let signalled = stop.load(Ordering::Relaxed);
        // Periodic checkpoints only after good steps: the last one stays the last good state.
        if (t.save_every > 0 && (k + 1) % t.save_every == 0 && !m.skipped) || signalled {
            let state = tr.engine.state();
            println!("saving checkpoint step-{:08}", state.step);
            std::io::stdout().flush()?;
            let dir =
                crate::resume::save(&out_dir, state, &tr.model_cfg, &yaml, t.keep_checkpoints)?;
            println!("checkpoint: {}", dir.display());
            last_ckpt = Some(dir);
        }
        if signalled {
            println!(
                "interrupted after step {}; resume with: horizon train --config {} --resume latest",
                k + 1,
                tr.cfg.origin
            );
            break;
        }
    }
    metrics_file.flush()?;
    let state_step = tr.engine.state().step;
    debug_assert_eq!(state_step as usize, steps);
    let wall_s = t0.elapsed().as_secs_f64();
    let st = tr.engine.device().stats();
    let compute = st.compute_busy_s - base.compute_busy_s;
    let link = st.link_busy_s - base.link_busy_s;
    let summary = Summary {
        steps: timed_steps,
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
        optimizer_memory: tr.cfg.raw.optimizer.memory.name().to_string(),
        params: tr.plan.params,
        planned_host_bytes_per_param: tr.plan.host_total() as f64 / tr.plan.params.max(1) as f64,
        peak_rss_bytes_per_param: peak_rss_bytes().unwrap_or(0) as f64
            / tr.plan.params.max(1) as f64,
    };
    let summary_path = out_dir.join("summary.json");
    fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("cannot write {}", summary_path.display()))?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    if export_final {
        let final_dir = out_dir.join("final");
        let params = &tr.engine.state().params;
        export(&tr.model_cfg, params, &final_dir)?;
        println!(
            "wrote {}, {} and {}",
            metrics_path.display(),
            summary_path.display(),
            final_dir.display()
        );
    }
    Ok(summary)
}
