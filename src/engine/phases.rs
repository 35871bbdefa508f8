//! Where a step's time goes: seconds of queue work by phase (what `horizon bench` prints), and
//! the FLOPs a schedule really performs (recompute included) against the model's own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::engine::plan::{OpKind, Res, Schedule};
use crate::model::layout::ModelLayout;

/// A phase of the step, as the executor times it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Compute: layer forwards before the head.
    Forward,
    /// Compute: layer forwards after the head (block recompute) and the internals every
    /// backward rebuilds before it runs.
    Recompute,
    /// Compute: layer backwards and zeroing the gradient accumulators.
    Backward,
    /// Compute: final norm, LM head and cross-entropy, forward and backward.
    Head,
    /// Host work on the copy queue: gathering embedding rows.
    Embedding,
    /// Host: adding gradient slabs into the host gradients, the embedding scatter-add.
    Gradients,
    /// Host: the global gradient norm and the AdamW updates.
    Optimizer,
}

const PHASES: usize = 7;

/// Nanoseconds of work per phase, added to by the queue threads.
#[derive(Debug, Default)]
pub struct PhaseClock([AtomicU64; PHASES]);

impl PhaseClock {
    /// Adds the time since `since` to `phase`.
    pub fn add(&self, phase: Phase, since: Instant) {
        self.add_duration(phase, since.elapsed());
    }

    /// Adds `d` to `phase` (device time of a kernel task, from the device's events).
    pub fn add_duration(&self, phase: Phase, d: Duration) {
        self.0[phase as usize].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Seconds per phase so far.
    pub fn seconds(&self) -> PhaseSeconds {
        let s = |p: Phase| self.0[p as usize].load(Ordering::Relaxed) as f64 * 1e-9;
        PhaseSeconds {
            forward: s(Phase::Forward),
            recompute: s(Phase::Recompute),
            backward: s(Phase::Backward),
            head: s(Phase::Head),
            embedding: s(Phase::Embedding),
            gradients: s(Phase::Gradients),
            optimizer: s(Phase::Optimizer),
        }
    }
}

/// Seconds of work per phase (see [`Phase`]); the first four are the compute queue's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PhaseSeconds {
    pub forward: f64,
    pub recompute: f64,
    pub backward: f64,
    pub head: f64,
    pub embedding: f64,
    pub gradients: f64,
    pub optimizer: f64,
}

impl PhaseSeconds {
    /// `self - base`, phase by phase.
    pub fn since(&self, base: &PhaseSeconds) -> PhaseSeconds {
        PhaseSeconds {
            forward: self.forward - base.forward,
            recompute: self.recompute - base.recompute,
            backward: self.backward - base.backward,
            head: self.head - base.head,
            embedding: self.embedding - base.embedding,
            gradients: self.gradients - base.gradients,
            optimizer: self.optimizer - base.optimizer,
        }
    }
}

// FLOPs. A multiply-add is 2 FLOPs; elementwise work is not counted. For N = B*T rows:
//   layer forward   = 2*N*IC*OC for each Linear op of the layer's description (Llama: q|k|v, o,
//                     gate|up, down)
//                   + attention: per visible (query, key) pair and head, q.k and p*v, 4*D
//                     -> 4*D*H*B*pairs(T): T(T+1)/2 causal, fewer within a sliding window
//   layer backward  = 2x the forward's products (dinp and dweight of each); attention 2.5x the
//                     forward's (dq, dk, dv, dp, and the scores recomputed from lse)
//   head            = 2*N*C*V forward, 4*N*C*V backward; in T vocabulary tiles, pass 1 runs the
//                     forward (2*N*C*V / T per tile) and pass 2 the forward again (recompute)
//                     and the backward ((2 + 4)*N*C*V / T per tile)
// Model FLOPs per step: 6 * (parameters in matrix products: layers and head, not the embedding
// gather) * tokens, plus the causal attention forward and backward (3x the forward's).

/// FLOPs of one step: what the schedule performs, and the model's own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepFlops {
    /// Every product the schedule runs, forward recompute included.
    pub schedule: f64,
    /// Of which recompute (block recompute and rebuilt internals).
    pub recompute: f64,
    /// `6 * N * tokens + attention`, the usual model FLOPs.
    pub model: f64,
}

/// FLOPs of one step of `schedule`, every micro-batch `b` sequences of `t` positions; each
/// layer's from its description (its products and its attention window).
pub fn step_flops(schedule: &Schedule, layout: &ModelLayout, b: usize, t: usize) -> StepFlops {
    let d = &layout.dims;
    let fwd = |l: usize| {
        let (mat, attn) = layout.layer(l).forward_flops(b, t);
        (mat + attn, 2.0 * mat + 2.5 * attn)
    };
    let head = 6.0 * (b * t * d.c * d.v) as f64;
    let mut f = StepFlops::default();
    let tiles = schedule.shape.head_tiles as f64;
    for op in schedule.ops(2) {
        match op.kind {
            OpKind::Forward { layer, recompute: true, .. } => {
                f.schedule += fwd(layer).0;
                f.recompute += fwd(layer).0;
            }
            OpKind::Forward { layer, recompute: false, .. } => f.schedule += fwd(layer).0,
            // A backward that reads kept internals recomputes nothing.
            OpKind::Backward { layer, .. }
                if op.reads.iter().any(|r| matches!(r, Res::Stash { .. })) =>
            {
                f.schedule += fwd(layer).1;
            }
            OpKind::Backward { layer, .. } => {
                let (fw, bw) = fwd(layer);
                f.schedule += fw + bw;
                f.recompute += fw;
            }
            OpKind::Head { .. } => {
                f.schedule += head;
            }
            OpKind::HeadStats { .. } => f.schedule += head / 3.0 / tiles,
            OpKind::HeadGrad { .. } => {
                f.schedule += head / tiles;
                f.recompute += head / 3.0 / tiles;
            }
            _ => {}
        }
    }
    let micro_batches = schedule
        .ops(2)
        .iter()
        .filter(|op| matches!(op.kind, OpKind::Head { .. } | OpKind::HeadFinish { .. }))
        .count();
    let layers: f64 = (0..d.layers).map(|l| 3.0 * fwd(l).0).sum();
    f.model = micro_batches as f64 * (layers + head);
    f
}

#[cfg(test)]
mod tests {

    #[test]
    fn model_flops_are_six_n_tokens_plus_attention() {
        let cfg = serde_json::json!({"model_type": "llama", "hidden_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 16, "vocab_size": 32});
        let cfg = crate::hf::config::ModelConfig::from_json(&cfg, "test").unwrap();
        let (mat, attn) = crate::model::describe(&cfg).layer(0).forward_flops(2, 3);
        // Matrix parameters of the layer: q 8x8, k and v 4x8 each, o 8x8, gate|up 2x16x8, down.
        let params = 64 + 32 + 32 + 64 + 256 + 128;
        assert_eq!(mat, 2.0 * 6.0 * params as f64);
        // 2 sequences x 6 causal pairs x 2 heads x 4*D.
        assert_eq!(attn, 2.0 * 6.0 * 2.0 * 16.0);
    }
}
