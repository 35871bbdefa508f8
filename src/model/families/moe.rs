//! The sparse MLP of the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss),
//! as one decoder layer's tensors and ops; the attention around it is the Llama-style family's.
//!
//! `h (N,C) -> router -> logits (N,E) -> route -> wts (N,k) -> experts -> out (N,C)`
//! ([`crate::model::moe`] has the data flow inside the experts op).
//!
//! Buffer order: `router (E,C) | [gate_e; up_e] (2I,C) for e in 0..E | down_e (C,I) for e in
//! 0..E | [Qwen2-MoE: shared gate | up | down | shared_expert_gate (1,C)]`: each expert's
//! gate|up is one matrix, and the fused checkpoint layout's `gate_up_proj` (E, 2I, C) and
//! `down_proj` (E, C, I) are two contiguous ranges.
//!
//! Qwen2-MoE adds a shared expert to every row: `out = experts(h) + sigmoid(w_g . h) S(h)`, S a
//! SwiGLU MLP of `shared_expert_intermediate_size`.
//!
//! gpt-oss: the router has a bias (`mlp.router.weight`, `.bias`), each expert a `[gate; up]` bias
//! (2I) and a down bias (C) after the matrices (`E x 2I`, then `E x C`), and the SwiGLU is clamped.
//! Its checkpoints store the experts fused, in-to-out, gate and up interleaved
//! ([`crate::hf::moe::read_fused_as_hub`] reads them into this order; the names inside Horizon
//! are the per-expert ones below).

use std::ops::Range;

use crate::hf::config::{ModelConfig, MoeConfig};
use crate::model::spec::{Act, Glu, Init, LayerBuilder, Op};

/// A sparse MLP's ranges in the layer's buffer.
pub struct SparseMlp {
    router: Range<usize>,
    router_bias: Option<Range<usize>>,
    gate_up: Range<usize>,
    down: Range<usize>,
    /// Qwen2-MoE's shared expert: its gate|up, its down and its (1, C) gate.
    shared: Option<[Range<usize>; 3]>,
    /// gpt-oss: the experts' `[gate; up]` biases and down biases.
    bias: Option<[Range<usize>; 2]>,
}

/// The sparse MLP's tensors, next in the buffer.
pub fn tensors(b: &mut LayerBuilder, cfg: &ModelConfig, moe: &MoeConfig) -> SparseMlp {
    let (c, e, i) = (cfg.hidden_size, moe.num_experts, moe.expert_size);
    let (block, [gate, up, down]) = moe.hub_names();
    let gpt_oss = moe.arch == crate::hf::config::Arch::GptOss;
    let router_name = if gpt_oss { "router" } else { "gate" };
    let router = b.tensor(&format!("{block}.{router_name}.weight"), &[e, c], Init::Normal);
    let router_bias = gpt_oss.then(|| b.tensor(&format!("{block}.router.bias"), &[e], Init::Zeros));
    let mut gate_up = b.tensor_end()..b.tensor_end();
    for x in 0..e {
        b.tensor(&format!("{block}.experts.{x}.{gate}.weight"), &[i, c], Init::Normal);
        gate_up.end =
            b.tensor(&format!("{block}.experts.{x}.{up}.weight"), &[i, c], Init::Normal).end;
    }
    let mut dn = gate_up.end..gate_up.end;
    for x in 0..e {
        dn.end = b.tensor(&format!("{block}.experts.{x}.{down}.weight"), &[c, i], Init::Normal).end;
    }
    let bias = gpt_oss.then(|| {
        let mut gu = b.tensor_end()..b.tensor_end();
        for x in 0..e {
            b.tensor(&format!("{block}.experts.{x}.{gate}.bias"), &[i], Init::Zeros);
            gu.end = b.tensor(&format!("{block}.experts.{x}.{up}.bias"), &[i], Init::Zeros).end;
        }
        let mut db = gu.end..gu.end;
        for x in 0..e {
            db.end = b.tensor(&format!("{block}.experts.{x}.{down}.bias"), &[c], Init::Zeros).end;
        }
        [gu, db]
    });
    let shared = moe.shared_expert.map(|s| {
        let g = b.tensor("mlp.shared_expert.gate_proj.weight", &[s, c], Init::Normal);
        let u = b.tensor("mlp.shared_expert.up_proj.weight", &[s, c], Init::Normal);
        let d = b.tensor("mlp.shared_expert.down_proj.weight", &[c, s], Init::Normal);
        let gate = b.tensor("mlp.shared_expert_gate.weight", &[1, c], Init::Normal);
        [g.start..u.end, d, gate]
    });
    SparseMlp { router, router_bias, gate_up, down: dn, shared, bias }
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
    let bias = w.router_bias;
    b.op(Op::Linear { inp: h, out: logits, w: w.router.into(), bias, ic: c, oc: e });
    let (probs, sel, wts) =
        (b.stat("router_probs", e), b.stat("experts_sel", k), b.act("experts_wts", k));
    b.op(Op::Route { logits, probs, sel, wts, e, k, norm: moe.norm_topk_prob });
    // One expert's rows at a time: at most N (a row chooses an expert once).
    let gu = b.stat("experts_gu", 2 * i);
    let scratch = [
        b.stat("experts_xs", c),
        b.stat("experts_s", i),
        b.stat("experts_ys", c),
        b.stat("experts_idx", 2 * k),
    ];
    // With a shared expert the routed experts' sum goes to its own buffer first.
    let routed = if w.shared.is_some() { b.act("experts_out", c) } else { out };
    b.op(Op::Experts {
        inp: h,
        sel,
        wts,
        out: routed,
        gu,
        scratch,
        gate_up: w.gate_up,
        down: w.down,
        e,
        k,
        i,
        c,
        lora: Default::default(),
        packed: None,
        bias: w.bias,
        clamp: moe.clamp,
    });
    if let (Some([gu, down, gate]), Some(f)) = (w.shared, moe.shared_expert) {
        let sgu = b.act("shared_gu", 2 * f);
        b.op(Op::Linear { inp: h, out: sgu, w: gu.into(), bias: None, ic: c, oc: 2 * f });
        let ss = b.act("shared_s", f);
        b.op(Op::Glu { gu: sgu, out: ss, act: Glu::Silu, f });
        let sout = b.act("shared_out", c);
        b.op(Op::Linear { inp: ss, out: sout, w: down.into(), bias: None, ic: f, oc: c });
        let sg = b.act("shared_gate", 1);
        b.op(Op::Linear { inp: h, out: sg, w: gate.into(), bias: None, ic: c, oc: 1 });
        let sh = b.act("shared_gated", c);
        b.op(Op::SigmoidGate { gate: sg, inp: sout, out: sh, c });
        b.op(Op::Add { a: routed, b: sh, out });
    }
}
