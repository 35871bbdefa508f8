//! `horizon train`: load the model and data, run the steps (forward, backward, exact global-norm
//! clipping, AdamW on the fp32 masters), write `metrics.jsonl` and the final HF directory.

use std::fs;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use horizon_backend::CpuBackend;
use serde::Serialize;

use crate::config::RunConfig;
use crate::data::pretokenized::{Batch, PretokenizedDataset, Row, load_pretokenized, make_batch};
use crate::hf::checkpoint::SaveDtype;
use crate::hf::config::ModelConfig;
use crate::model::params::ParamStore;
use crate::model::transformer::{Capacity, Transformer};
use crate::optim::adamw::{AdamWConfig, AdamWStep, adamw_update, clip_coefficient, sum_squares};

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
}

/// The model's optimizer state in host RAM: masters, gradients, AdamW moments.
pub struct TrainState {
    pub params: ParamStore,
    pub grads: ParamStore,
    pub m: ParamStore,
    pub v: ParamStore,
    /// Optimizer steps taken.
    pub step: u64,
}

impl TrainState {
    pub fn new(params: ParamStore) -> Self {
        let zeros = || {
            let mut z = params.clone();
            z.fill_zero();
            z
        };
        TrainState { grads: zeros(), m: zeros(), v: zeros(), params, step: 0 }
    }

    /// Global L2 norm of the gradients, accumulated in f64 in a fixed order.
    pub fn grad_norm(&self) -> f64 {
        self.grads.buffers().iter().map(|b| sum_squares(b)).sum::<f64>().sqrt()
    }

    /// Clip by the global norm (`max_norm` 0 = off) and take one AdamW step on every buffer.
    pub fn optimizer_step(&mut self, cfg: &AdamWConfig, lr: f64, grad_norm: f64, max_norm: f64) {
        self.step += 1;
        let coef = clip_coefficient(grad_norm, max_norm);
        let st = AdamWStep::new(cfg, self.step, lr);
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
    (0..b)
        .map(|i| {
            let g = k * b + i;
            let (epoch, pos) = (g / len, g % len);
            if shuffle { epoch_permutation(len, seed, epoch as u64)[pos] } else { pos }
        })
        .collect()
}

/// Fisher-Yates permutation of `0..len` from a splitmix64 stream seeded by (seed, epoch).
fn epoch_permutation(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut state = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut p: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
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
        let model_dir = &raw.model.path;
        if !model_dir.is_dir() {
            bail!(
                "model.path {}: no such directory\nhint: point model.path at a Hugging Face model directory (config.json + model.safetensors)",
                model_dir.display()
            );
        }
        let model_cfg = ModelConfig::from_file(&model_dir.join("config.json"))?;
        let data = load_pretokenized(&raw.data.path, raw.train.max_seq_len, model_cfg.vocab_size)?;
        let engine = Transformer::new(
            CpuBackend,
            &model_cfg,
            Capacity {
                batch: raw.train.batch_size,
                seq_len: data.rows.iter().map(|r| r.input_ids.len()).max().unwrap_or(1),
                head_chunk_rows: raw.engine.head_chunk_rows,
            },
        );
        let params = ParamStore::load_hf(&engine.layout, model_dir)?;
        Ok(Trainer { state: TrainState::new(params), cfg, model_cfg, data, engine })
    }

    /// The batch of optimizer step `k` (0-based), and its count of real (non-padding) tokens.
    pub fn batch(&self, k: usize) -> (Batch, usize) {
        let t = &self.cfg.raw.train;
        let idx =
            batch_indices(self.data.rows.len(), k, t.batch_size, self.cfg.raw.data.shuffle, t.seed);
        let rows: Vec<&Row> = idx.iter().map(|&i| &self.data.rows[i]).collect();
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
        let acfg = AdamWConfig {
            lr: o.lr,
            beta1: o.betas[0],
            beta2: o.betas[1],
            eps: o.eps,
            weight_decay: o.weight_decay,
        };
        self.state.optimizer_step(&acfg, o.lr, grad_norm, o.grad_clip);
        Ok(StepMetrics {
            step: k + 1,
            loss: out.loss(),
            grad_norm,
            lr: o.lr,
            tokens,
            step_s: t0.elapsed().as_secs_f64(),
        })
    }

    /// Write the trained model as a HF directory (`config.json` + fp32 `model.safetensors`).
    pub fn export(&self, dir: &Path) -> Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let cfg_path = dir.join("config.json");
        let text = serde_json::to_string_pretty(&self.model_cfg.to_hf_json())?;
        fs::write(&cfg_path, text)
            .with_context(|| format!("cannot write {}", cfg_path.display()))?;
        self.state.params.save_safetensors(
            &self.engine.layout,
            &dir.join("model.safetensors"),
            SaveDtype::F32,
        )
    }
}

/// Run a whole training job: steps, metrics, final export. Returns the per-step metrics.
pub fn run(cfg: RunConfig) -> Result<Vec<StepMetrics>> {
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

    let mut trainer = Trainer::new(cfg)?;
    let steps = trainer.cfg.raw.train.steps;
    println!(
        "model: {} layers, hidden {}, {} params; data: {} rows",
        trainer.model_cfg.num_layers,
        trainer.model_cfg.hidden_size,
        trainer.engine.layout.num_params(),
        trainer.data.rows.len()
    );
    let metrics_path = out_dir.join("metrics.jsonl");
    let mut metrics_file = fs::File::create(&metrics_path)
        .with_context(|| format!("cannot create {}", metrics_path.display()))?;
    let mut all = Vec::with_capacity(steps);
    for k in 0..steps {
        let m = trainer.step(k)?;
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
        all.push(m);
    }
    metrics_file.flush()?;
    let final_dir = out_dir.join("final");
    trainer.export(&final_dir)?;
    println!("wrote {} and {}", metrics_path.display(), final_dir.display());
    Ok(all)
}
