//! What a run reports at the end (`OUT/summary.json`): read by `horizon bench` and the report,
//! written by the training loop; a plain record, so that neither depends on the other.

use std::time::Instant;

use serde::Serialize;

use crate::engine::phases::{PhaseSeconds, StepFlops};
use crate::model::dpo::DpoMetrics;

/// What a run reports at the end (`OUT/summary.json`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    /// Steps timed (after the warm-up) in this process.
    pub steps: usize,
    /// Optimizer steps the run has taken in all (a resumed run counts the earlier ones).
    pub total_steps: usize,
    /// Steps whose update was skipped for a non-finite loss or gradient norm, or because no
    /// position of their batch carries a loss (this process).
    pub skipped_steps: usize,
    /// Steps whose updates held elements back (a new weight or moment would not have been
    /// finite: those kept their values, the others were updated), this process.
    pub held_steps: usize,
    /// Data records left out by the loaders (`data.on_error: skip`, or a prompt too long).
    pub skipped_records: usize,
    /// Mean loss over the held-out rows after the last step, when there are any.
    pub eval_loss: Option<f64>,
    /// Held-out rows.
    pub eval_rows: usize,
    /// A DPO run's reward metrics at its last step (`rewards_chosen`, ..., as `metrics.jsonl`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_rewards: Option<DpoMetrics>,
    /// A DPO run's held-out reward metrics at its last evaluation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_rewards: Option<DpoMetrics>,
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
    /// Seconds of queue work by phase (compute: forward, recompute, backward, head; host:
    /// embedding, gradients, optimizer).
    pub phase_s: PhaseSeconds,
    /// Seconds the host -> device and device -> host queues spent copying.
    pub h2d_busy_s: f64,
    pub d2h_busy_s: f64,
    /// Seconds the host queue spent running its ops (accumulation, norms, updates), timed steps.
    pub host_busy_s: f64,
    /// Wall seconds the compute queue was not running a kernel.
    pub compute_idle_s: f64,
    /// FLOPs of the timed steps (at the planned row length): every product the schedule ran,
    /// recompute included, and the model's `6 * N * tokens + attention`.
    pub flops: StepFlops,
    /// `flops.schedule / wall_s` and `flops.model / wall_s`, in GFLOP/s.
    pub achieved_gflops: f64,
    pub model_gflops: f64,
    /// `optimizer.memory` of the run.
    pub optimizer_memory: String,
    /// Parameters of the model, and the planned / measured host bytes per parameter.
    pub params: u64,
    pub planned_host_bytes_per_param: f64,
    pub peak_rss_bytes_per_param: f64,
    /// Page-locked host bytes the device holds, and the plan's figure (equal on CUDA; 0 on the
    /// CPU device, which pins nothing).
    pub pinned_bytes: u64,
    pub planned_pinned_bytes: u64,
    /// Threads of the host queue's pool (`engine.host_threads` resolved).
    pub host_threads: usize,
    /// Where bf16 uploads took the trained weights from (`engine.weight_upload` resolved):
    /// masters, image or staged.
    pub weight_upload: String,
    /// How the CPU device's compute and host queues waited (`device.wait` resolved): block or
    /// spin.
    pub device_wait: String,
    /// The step after which a signal (SIGINT, SIGTERM) stopped the run, when one did: its
    /// checkpoint was written, `final/` was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interrupted_at_step: Option<u64>,
}

/// A run stopped by a signal after writing its checkpoint: the process exits `128 + signal`
/// (130 for SIGINT, 143 for SIGTERM), as a shell reports a command the signal killed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interrupted {
    pub signal: i32,
    pub step: u64,
    /// The command that resumes it.
    pub resume: String,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = if self.signal == 2 { "SIGINT" } else { "SIGTERM" };
        write!(f, "interrupted ({name}) after step {}; resume with: {}", self.step, self.resume)
    }
}

impl std::error::Error for Interrupted {}

/// A resumed run that had already taken all its steps: nothing was done (the process exits 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlreadyFinished {
    pub step: u64,
}

impl std::fmt::Display for AlreadyFinished {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the run has taken all its {} steps: nothing to do (raise train.steps to train on)",
            self.step
        )
    }
}

impl std::error::Error for AlreadyFinished {}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct StepMetrics {
    /// 1-based optimizer step.
    pub step: usize,
    /// The trained objective: the mean loss over the batch's loss-carrying positions, plus a
    /// mixture of experts' load-balancing term times its coefficient when it is trained.
    pub loss: f64,
    /// A mixture of experts' cross-entropy alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ce_loss: Option<f64>,
    /// A mixture of experts' load-balancing loss, unscaled (reported even when untrained).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
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
    /// Epochs over the training rows done after this step (HF Trainer's `epoch`):
    /// `step x batch_size / rows`.
    #[serde(default)]
    pub epoch: f64,
    /// The elements this step's updates held, by buffer: their new master or moment would not
    /// have been finite, so they kept their values (`optim::adamw`'s "Held elements"); the
    /// step's other elements were updated. Absent when none was; a step that held any is a bad
    /// step (it counts toward `train.max_bad_steps`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<HeldIn>,
    /// A DPO step's reward metrics (TRL's `rewards/chosen` ... `logps/rejected`), as fields
    /// of the line: `rewards_chosen`, `rewards_rejected`, `reward_accuracy`, `reward_margin`,
    /// `logps_chosen`, `logps_rejected`.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub dpo: Option<DpoMetrics>,
    /// The held-out pairs' metrics on steps that evaluate a DPO run: the same fields with an
    /// `eval_` prefix.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub eval_dpo: Option<EvalDpo>,
}

/// A DPO run's held-out metrics, serialized as [`DpoMetrics`]' fields with an `eval_` prefix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalDpo(pub DpoMetrics);

impl Serialize for EvalDpo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let named = self.0.named("eval_");
        let mut map = s.serialize_map(Some(named.len()))?;
        for (k, v) in named {
            map.serialize_entry(&k, &v)?;
        }
        map.end()
    }
}

impl Summary {
    /// The run's closing lines on the console (`summary.json` has every figure): steps, losses,
    /// speed, memory against the plan.
    pub fn brief(&self) -> String {
        use crate::engine::memory::gib;
        let mut eval = self.eval_loss.map_or(String::new(), |e| format!(", eval loss {e:.4}"));
        let acc = |d: &DpoMetrics| format!(" (reward accuracy {:.3})", d.reward_accuracy);
        eval += &self.eval_rewards.as_ref().map_or(String::new(), acc);
        let skipped = match self.skipped_steps {
            0 => String::new(),
            n => format!(" ({n} skipped)"),
        };
        format!(
            "done: step {}{skipped}, final loss {:.4}{eval}; {} steps timed in {:.1} s, {:.0} tokens/s\n\
             memory: peak RSS {} (planned {}), peak device {} (planned {})",
            self.total_steps,
            self.final_loss,
            self.steps,
            self.wall_s,
            self.tokens_per_s,
            gib(self.peak_rss_bytes),
            gib(self.planned_host_bytes),
            gib(self.peak_device_bytes),
            gib(self.planned_device_bytes),
        )
    }
}

/// Elements one buffer's update held in a step (a line of `metrics.jsonl`'s `held`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct HeldIn {
    /// The buffer: the HF module it holds (`model.layers.3`, `model.embed_tokens`, ...).
    pub buffer: String,
    pub elements: u64,
}

impl HeldIn {
    /// The buffers of `counts` (elements held per buffer, in buffer order) that held any, named
    /// by `name` (allocates only then).
    pub fn of(counts: impl Iterator<Item = u64>, name: impl Fn(usize) -> String) -> Vec<HeldIn> {
        counts
            .enumerate()
            .filter(|&(_, n)| n > 0)
            .map(|(i, elements)| HeldIn { buffer: name(i), elements })
            .collect()
    }

    /// `held` in words for a warning: `12 in model.layers.3, 1 in lm_head`.
    pub fn words(held: &[HeldIn]) -> String {
        let each: Vec<String> =
            held.iter().map(|h| format!("{} in {}", h.elements, h.buffer)).collect();
        each.join(", ")
    }
}

impl StepMetrics {
    /// Step `k` (0-based), skipped because no position of its batch carries a loss.
    pub fn no_loss(k: usize, lr: f64, tokens: usize, t0: Instant) -> Self {
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
            ce_loss: None,
            aux_loss: None,
            epoch: 0.0,
            held: Vec::new(),
            dpo: None,
            eval_dpo: None,
        }
    }

    /// Step `k` (0-based) with its `(loss, grad_norm)`, its learning rate, its tokens, and
    /// its clock `t0`; nothing skipped, held or evaluated.
    pub fn of_loss(k: usize, loss: (f64, f64), lr: f64, tokens: usize, t0: Instant) -> Self {
        StepMetrics {
            loss: loss.0,
            grad_norm: loss.1,
            skipped: false,
            no_loss: false,
            ..StepMetrics::no_loss(k, lr, tokens, t0)
        }
    }

    /// The step is bad: skipped for a non-finite (or too large) loss or gradient, or some of
    /// its updates held (a step without loss is skipped, but not bad).
    pub fn bad(&self) -> bool {
        (self.skipped && !self.no_loss) || !self.held.is_empty()
    }
}
