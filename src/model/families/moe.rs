//! The sparse MLP of the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral), as one
//! decoder layer's tensors and ops; the attention around it is the Llama-style family's.
//!
//! `h (N,C) -> router -> logits (N,E) -> route -> wts (N,k) -> experts -> out (N,C)`
//! ([`crate::model::moe`] has the data flow inside the experts op).
//!
//! Buffer order: `router (E,C) | [gate_e; up_e] (2I,C) for e in 0..E | down_e (C,I) for e in
//! 0..E`: each expert's gate|up is one matrix, and the fused checkpoint layout's
//! `gate_up_proj` (E, 2I, C) and `down_proj` (E, C, I) are two contiguous ranges.

use std::ops::Range;

use crate::hf::config::{Arch, ModelConfig, MoeConfig};
use crate::model::spec::{Act, Init, LayerBuilder, Op};

/// A sparse MLP's ranges in the layer's buffer.
pub struct SparseMlp {
    router: Range<usize>,
    gate_up: Range<usize>,
    down: Range<usize>,
}

/// The HF names of a family's sparse MLP (Hub layout): the block prefix, and the per-expert
/// gate, up and down names.
fn names(arch: Arch) -> (&'static str, [&'static str; 3]) {
    match arch {
        Arch::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    }
}

/// The sparse MLP's tensors, next in the buffer.
pub fn tensors(b: &mut LayerBuilder, cfg: &ModelConfig, moe: &MoeConfig) -> SparseMlp {
    let (c, e, i) = (cfg.hidden_size, moe.num_experts, moe.expert_size);
    let (block, [gate, up, down]) = names(cfg.arch);
    let router = b.tensor(&format!("{block}.gate.weight"), &[e, c], Init::Normal);
    let mut gate_up = router.end..router.end;
    for x in 0..e {
        b.tensor(&format!("{block}.experts.{x}.{gate}.weight"), &[i, c], Init::Normal);
        gate_up.end =
            b.tensor(&format!("{block}.experts.{x}.{up}.weight"), &[i, c], Init::Normal).end;
    }
    let mut dn = gate_up.end..gate_up.end;
    for x in 0..e {
        dn.end = b.tensor(&format!("{block}.experts.{x}.{down}.weight"), &[c, i], Init::Normal).end;
    }
    SparseMlp { router, gate_up, down: dn }
}

/// The sparse MLP's ops from `h` (N, C) into `out` (N, C).
pub fn ops(
    b: &mut LayerBuilder,
    cfg: &ModelConfig,
    moe: &MoeConfig,
    w: SparseMlp,
    h: Act,
    out: Act,
) {
    let (c, e, k, i) = (cfg.hidden_size, moe.num_experts, moe.top_k, moe.expert_size);
    let logits = b.act("router_logits", e);
    b.op(Op::Linear { inp: h, out: logits, w: w.router.into(), bias: None, ic: c, oc: e });
    let (probs, sel, wts) =
        (b.stat("router_probs", e), b.stat("experts_sel", k), b.act("experts_wts", k));
    b.op(Op::Route { logits, probs, sel, wts, e, k, norm: moe.norm_topk_prob });
    let gu = b.stat("experts_gu", 2 * k * i);
    let scratch = [
        b.stat("experts_xs", k * c),
        b.stat("experts_s", k * i),
        b.stat("experts_ys", k * c),
        b.stat("experts_idx", 2 * k),
    ];
    b.op(Op::Experts {
        inp: h,
        sel,
        wts,
        out,
        gu,
        scratch,
        gate_up: w.gate_up,
        down: w.down,
        e,
        k,
        i,
        c,
        lora: Default::default(),
    });
}
