//! The held-out loss on the engine's device: the evaluation plan (`plan::eval_plan`: forward
//! only, loss only; no backward, no update) run micro-batch by micro-batch between two steps, by
//! the same dispatchers as a step, in the step's own buffers, its waits derived and checked as
//! a step's are.
//!
//! It needs no buffer of its own: micro-batch 0's ids, targets, residual sets, losses and
//! staging, the two weight slots, the layer scratch and the head's scratch are all in the
//! memory plan (`Sizes`), and an eval micro-batch is no larger than a training one. The device
//! is synchronised before and after, so the step's schedule never sees eval's use of them
//! (every step uploads its weights and activations afresh; the stages that staged uploads copy
//! are left alone). The reference path's `Transformer::forward_loss` runs the same ops in the
//! same order: on the CPU device the losses are the same bits.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::{Result, bail};
use horizon_backend::Device;
use horizon_backend::bf16::round_to_bf16;

use super::{Engine, MicroBatch, StepData};
use crate::model::params::ParamStore;

/// What an eval pass measured: the summed loss and the loss-carrying positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalOutput {
    pub loss_sum: f64,
    pub num_targets: usize,
}

impl EvalOutput {
    /// Mean loss over the loss-carrying positions.
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.num_targets.max(1) as f64
    }
}

impl<D: Device> Engine<D>
where
    D::Backend: 'static,
{
    /// The loss of `mbs` (each at most `micro_batch_size` rows of at most `seq_len` positions)
    /// with the current masters, forward only on the device. Waits for all queued work first
    /// (the optimizer's updates included), and returns with the device idle.
    pub fn eval(&mut self, mbs: Vec<MicroBatch>) -> Result<EvalOutput> {
        self.check_eval(&mbs)?;
        let mut out = EvalOutput { loss_sum: 0.0, num_targets: 0 };
        for mb in mbs {
            let targets = mb.targets.iter().filter(|&&t| t != -100).count();
            if targets == 0 {
                continue;
            }
            // Summed per head chunk, in f64, as the reference path sums them.
            let chunk = self.ctx.head_chunk.max(1);
            let losses = self.eval_losses(mb)?;
            out.loss_sum +=
                losses.chunks(chunk).map(|c| c.iter().map(|&x| x as f64).sum::<f64>()).sum::<f64>();
            out.num_targets += targets;
        }
        Ok(out)
    }

    /// Each row's summed log-probability of its targets (`-Σ` of its positions' cross-entropy,
    /// in f64, per head chunk as the reference path's `row_logps`), per micro-batch, with the
    /// current masters; forward only, as [`Engine::eval`].
    pub fn row_logps(&mut self, mbs: Vec<MicroBatch>) -> Result<Vec<Vec<f64>>> {
        self.check_eval(&mbs)?;
        let chunk = self.ctx.head_chunk.max(1);
        let mut out = Vec::with_capacity(mbs.len());
        for mb in mbs {
            let t = mb.t;
            let losses = self.eval_losses(mb)?;
            let row = |r: &[f32]| -> f64 {
                -r.chunks(chunk).map(|c| c.iter().map(|&x| x as f64).sum::<f64>()).sum::<f64>()
            };
            out.push(losses.chunks(t).map(row).collect());
        }
        Ok(out)
    }

    /// As [`Engine::row_logps`], with the reference copy (`EngineConfig::reference_copy`: the
    /// starting weights in bf16, DPO's `dpo.reference: live`) uploaded in place of the masters.
    pub fn reference_row_logps(&mut self, mbs: Vec<MicroBatch>) -> Result<Vec<Vec<f64>>> {
        assert!(self.cfg.reference_copy, "a reference pass without the reference copy");
        self.dev.synchronize();
        self.ctx.reference_pass.store(true, Ordering::Release);
        let out = self.row_logps(mbs);
        self.dev.synchronize();
        self.ctx.reference_pass.store(false, Ordering::Release);
        out
    }

    /// Rounds `params` (the model's layout) into the reference copy: a resumed run's starting
    /// weights, read again from the model. Between steps.
    pub fn set_reference(&mut self, params: &ParamStore) -> Result<()> {
        assert!(self.cfg.reference_copy, "set_reference without the reference copy");
        self.dev.synchronize();
        self.check_device()?;
        for (copy, p) in self.ctx.hostbufs.reference.iter().zip(params.buffers()) {
            if let Some(copy) = *copy {
                assert_eq!(copy.len(), p.len(), "the reference's buffers are the model's");
                // SAFETY: the device is idle and no host op runs: nothing reads the copy.
                unsafe { round_to_bf16(copy.as_mut_slice(), p) };
            }
        }
        Ok(())
    }

    /// Turns an adapter run's adapters off: every trained tensor zero (adds exactly nothing to
    /// the frozen base: the model PEFT's `disable_adapter` gives, DPO's reference), until
    /// [`Engine::adapters_on`] puts back the masters this returns. Between steps only.
    pub fn adapters_off(&mut self) -> Result<Vec<Vec<f32>>> {
        assert!(!self.ctx.layout.trains_base(), "adapters_off on a run without adapters");
        self.dev.synchronize();
        self.check_device()?;
        let kept = self.state.params.buffers().iter().map(|b| b.to_vec()).collect();
        self.state.params.fill_zero();
        self.refresh_images();
        Ok(kept)
    }

    /// Puts back the masters [`Engine::adapters_off`] kept, bit for bit (their bf16 images
    /// too, so the stages staged before stay right).
    pub fn adapters_on(&mut self, kept: Vec<Vec<f32>>) -> Result<()> {
        self.dev.synchronize();
        self.check_device()?;
        for (b, k) in self.state.params.buffers_mut().into_iter().zip(&kept) {
            b.copy_from_slice(k);
        }
        self.refresh_images();
        Ok(())
    }

    /// The bf16 images (`WeightPath::Image`) rounded again from the masters.
    fn refresh_images(&mut self) {
        let images = &self.ctx.hostbufs.images;
        for (img, p) in images.iter().zip(self.state.params.buffers()) {
            if let Some(img) = *img {
                // SAFETY: the device is idle (synchronised by the caller) and no host op runs:
                // nothing else reads or writes the images.
                unsafe { round_to_bf16(img.as_mut_slice(), p) };
            }
        }
    }

    /// An error unless every micro-batch fits the plan; then waits for the queued work.
    fn check_eval(&mut self, mbs: &[MicroBatch]) -> Result<()> {
        if let Some(mb) =
            mbs.iter().find(|mb| mb.b > self.cfg.micro_batch_size || mb.t > self.cfg.seq_len)
        {
            bail!(
                "an eval micro-batch of {}x{} tokens; the engine was planned for {}x{}",
                mb.b,
                mb.t,
                self.cfg.micro_batch_size,
                self.cfg.seq_len
            );
        }
        self.dev.synchronize();
        self.check_device()
    }

    /// Micro-batch `mb`'s per-position losses (N), forward only; the device idle after.
    fn eval_losses(&mut self, mb: MicroBatch) -> Result<&[f32]> {
        let n = mb.n();
        let sd = Arc::new(StepData {
            mbs: vec![mb],
            scale: 1.0,
            row_scales: None,
            step: self.steps,
            adam_step: 0,
            lr: 0.0,
            inject_nan: false,
            next_ids: Vec::new(),
            timed: false,
        });
        self.run_eval_plan(&sd);
        self.dev.synchronize();
        self.check_device()?;
        // SAFETY: the download into micro-batch 0's loss staging has finished (the device is
        // idle) and nothing else writes it until the next step's or evaluation's download.
        Ok(unsafe { self.ctx.hostbufs.loss_host[0].as_const().sub(0..n).as_slice() })
    }

    /// Queue the evaluation plan on micro-batch `sd` (the device idle): each op after the
    /// events of the ops it waits for, through the step's dispatchers, then its own event.
    fn run_eval_plan(&self, sd: &Arc<StepData>) {
        for e in &self.eval.events {
            e.wait_host();
            e.reset();
        }
        for (j, op) in self.eval.ops.iter().enumerate() {
            for &w in &op.waits {
                self.dev.wait(op.queue, &self.eval.events[w]);
            }
            self.dispatch(op.queue, op.kind, sd, &self.eval.grants[j]);
            self.dev.record(op.queue, &self.eval.events[j]);
        }
    }
}
