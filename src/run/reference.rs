//! The reference trainer: the plain layer-by-layer path (`model::transformer`) on the CPU
//! backend, with exact clipping and AdamW, step by step. The tests hold the streaming engine to
//! it, and it to the Hugging Face fixtures.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use horizon_backend::CpuBackend;

use crate::data::pretokenized::{Batch, PretokenizedDataset, make_batch};
use crate::hf::config::ModelConfig;
use crate::model::params::{ParamStore, buffer_name};
use crate::model::transformer::{Capacity, Transformer};
use crate::optim::decay::DecayGroups;
use crate::run::config::RunConfig;
use crate::run::data::{StepRows, load_data, tokens_of};
use crate::run::load::{RunModel, load_run_model};
use crate::run::summary::{HeldIn, StepMetrics};
use crate::store::TrainState;

/// Everything a run needs, loaded and checked before the first step.
pub struct ReferenceTrainer {
    pub cfg: RunConfig,
    pub model_cfg: ModelConfig,
    pub data: PretokenizedDataset,
    /// Reads each step's rows of `data`, in the run's order.
    rows: StepRows,
    pub state: TrainState,
    pub engine: Transformer<CpuBackend>,
    /// The weight-decay groups of the trained tensors (`optimizer.no_decay`).
    pub decay: DecayGroups,
}

impl ReferenceTrainer {
    /// Load model and data, and allocate every buffer the run needs.
    pub fn new(cfg: RunConfig) -> Result<Self> {
        let raw = &cfg.raw;
        let RunModel { cfg: model_cfg, layout, params, base, .. } =
            load_run_model(raw, cfg.adapter.as_ref())?;
        let data = load_data(raw, model_cfg.vocab_size)?;
        let decay = DecayGroups::new(&layout, raw.optimizer.no_decay);
        let engine = Transformer::with_layout(
            CpuBackend,
            layout,
            base.map(Arc::new),
            Capacity {
                batch: raw.train.batch_size,
                seq_len: data.longest().max(1),
                head_chunk_rows: raw.engine.head_chunk_rows,
            },
        );
        let rows = StepRows::new(&cfg, &data);
        let state = TrainState::new(params);
        Ok(ReferenceTrainer { state, cfg, model_cfg, data, rows, engine, decay })
    }

    /// The batch of optimizer step `k` (0-based), and its count of real (non-padding) tokens.
    pub fn batch(&mut self, k: usize) -> Result<(Batch, usize)> {
        let rows = self.rows.read(&self.data, k)?;
        let tokens = rows.iter().map(|r| r.input_ids.len()).sum();
        Ok((make_batch(&rows.iter().collect::<Vec<_>>()), tokens))
    }

    /// One optimizer step on batch `k`.
    pub fn step(&mut self, k: usize) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let (batch, tokens) = self.batch(k)?;
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
        let adamw = self.cfg.raw.adamw();
        let held = self.state.optimizer_step(&adamw, &self.decay, lr, grad_norm, o.grad_clip);
        let layers = self.state.params.layers.len();
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
            ce_loss: out.aux.map(|_| out.ce_loss()),
            aux_loss: out.aux.map(|(aux, _)| aux),
            epoch: 0.0,
            held: HeldIn::of(held.into_iter(), |i| buffer_name(layers, i)),
            dpo: None,
            eval_dpo: None,
        })
    }

    /// Write the trained model as a HF directory (`config.json` + fp32 `model.safetensors`).
    pub fn export(&self, dir: &Path) -> Result<()> {
        export(&self.model_cfg, &self.state.params, dir)
    }
}

/// Write a model as a HF directory (`config.json` + fp32 `model.safetensors`, no tokenizer).
pub fn export(model_cfg: &ModelConfig, params: &ParamStore, dir: &Path) -> Result<()> {
    crate::run::hf_out::export_model(
        model_cfg,
        params,
        dir,
        crate::run::hf_out::ExportOptions::default(),
        &crate::run::hf_out::ExportSource::none(),
    )
    .map(|_| ())
}
