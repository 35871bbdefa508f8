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
//                     gate|up, down), 2*N*r*(IC+OC) for each adapter
//                   + attention: per visible (query, key) pair and head, q.k and p*v, 4*D
//                     -> 4*D*H*B*pairs(T): T(T+1)/2 causal, fewer within a sliding window
//   layer backward  = each product's dinp (1x its forward) and, where its weight is trained,
//                     its dweight (1x): 2x the forward in full fine-tuning; an adapter run's
//                     frozen base gets no dweight, its adapters both; attention 2.5x the
//                     forward's (dq, dk, dv, dp, and the scores recomputed from lse)
//   head            = 2*N*C*V forward; backward dh 2*N*C*V, and dW 2*N*C*V when trained; in T
//                     vocabulary tiles, pass 1 runs the forward (/ T per tile) and pass 2 the
//                     forward again (recompute) and the backward (/ T per tile)
// Model FLOPs per step: what the step computes, recompute left out: forward, dinp and the
// trained weights' dweight of every product (6 * matrix parameters * tokens in full
// fine-tuning; 4 * frozen + 6 * trained ones with an adapter), plus the causal attention
// forward and backward (3x the forward's).

/// FLOPs of one step: what the schedule performs, and the model's own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepFlops {
    /// Every product the schedule runs, forward recompute included.
    pub schedule: f64,
    /// Of which recompute (block recompute and rebuilt internals).
    pub recompute: f64,
    /// The model FLOPs: `6 * N * tokens + attention` in full fine-tuning; with an adapter,
    /// `(4 * frozen + 6 * trained matrix parameters) * tokens + attention` (no weight
    /// gradient of the frozen base).
    pub model: f64,
}

/// FLOPs of one step of `schedule`, every micro-batch `b` sequences of `t` positions; each
/// layer's from its description (its products, which of them are trained, its attention
/// window).
pub fn step_flops(schedule: &Schedule, layout: &ModelLayout, b: usize, t: usize) -> StepFlops {
    let d = &layout.dims;
    // (forward, backward) of layer l, attention included.
    let fwd = |l: usize| {
        let spec = layout.layer(l);
        let (mat, attn) = spec.forward_flops(b, t);
        (mat + attn, spec.backward_matmul_flops(b, t) + 2.5 * attn)
    };
    let head_fwd = 2.0 * (b * t * d.c * d.v) as f64;
    let head_bwd = if layout.trains_base() { 2.0 * head_fwd } else { head_fwd };
    let head = head_fwd + head_bwd;
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
            OpKind::HeadStats { .. } => f.schedule += head_fwd / tiles,
            OpKind::HeadGrad { .. } => {
                f.schedule += head / tiles;
                f.recompute += head_fwd / tiles;
            }
            _ => {}
        }
    }
    let micro_batches = schedule
        .ops(2)
        .iter()
        .filter(|op| matches!(op.kind, OpKind::Head { .. } | OpKind::HeadFinish { .. }))
        .count();
    // The model's attention backward counts 2x its forward (the schedule's 2.5x includes the
    // scores' recompute).
    let layers: f64 = (0..d.layers)
        .map(|l| {
            let spec = layout.layer(l);
            let (mat, attn) = spec.forward_flops(b, t);
            mat + spec.backward_matmul_flops(b, t) + 3.0 * attn
        })
        .sum();
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

    /// Full fine-tuning's backward is twice the forward's products (dinp and dweight); an
    /// adapter run's is the base's dinp alone plus twice its adapters', with the base in bf16
    /// or NF4 alike.
    #[test]
    fn an_adapter_run_counts_no_weight_gradient_of_the_frozen_base() {
        use crate::model::lora::{BaseDtype, LoraSpec};
        let cfg = serde_json::json!({"model_type": "llama", "hidden_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 16, "vocab_size": 32});
        let cfg = crate::hf::config::ModelConfig::from_json(&cfg, "test").unwrap();
        let full = crate::model::describe(&cfg);
        let (mat, _) = full.layer(0).forward_flops(2, 3);
        assert_eq!(full.layer(0).backward_matmul_flops(2, 3), 2.0 * mat);
        for nf4 in [false, true] {
            let spec = LoraSpec {
                r: 2,
                scale: 1.0,
                targets: vec!["q_proj".into(), "v_proj".into()],
                nf4,
                base: BaseDtype::Bf16,
                experts: Default::default(),
            };
            let lora = full.with_lora(&spec).unwrap();
            let (with_adapters, _) = lora.layer(0).forward_flops(2, 3);
            // 6 rows through r 2 adapters: q (8 in, 8 out) and v (8 in, 4 out).
            let adapters = 2.0 * 6.0 * (2 * (8 + 8) + 2 * (8 + 4)) as f64;
            assert_eq!(with_adapters, mat + adapters);
            assert_eq!(lora.layer(0).backward_matmul_flops(2, 3), mat + 2.0 * adapters, "{nf4}");
        }
    }
}
