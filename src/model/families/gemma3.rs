//! Gemma 3 (text): every RMSNorm applied as `x * (1 + w)` (weights start at 0); four norms per
//! layer (input, post-attention, pre- and post-feedforward); per-head q/k norm before RoPE;
//! GeGLU with tanh GELU; embeddings scaled by `sqrt(C)`; scores scaled by
//! `query_pre_attn_scalar^-1/2`; sliding-window layers with their own RoPE base beside full
//! layers (`layer_types`). Written as its difference from the Llama layer.
//!
//! One layer: `x -> norm -> h1 -> qkv_raw -> q/k norm -> qkv -> rope -> attention -> att ->
//! o_proj -> o -> post-attention norm -> po -> +x -> x2 -> pre-FF norm -> h2 -> gate|up -> geglu
//! -> s -> down -> m -> post-FF norm -> pm -> +x2 -> y`.

use crate::hf::config::{LayerType, ModelConfig};
use crate::model::families::llama::attn_spec;
use crate::model::families::{kinds_by_type, rope_tables, type_name};
use crate::model::layout::{Dims, ModelLayout};
use crate::model::spec::{Glu, Init, LayerBuilder, LayerSpec, Op, X, Y};

/// Gemma's norms add 1 to their weight.
const W_OFFSET: f32 = 1.0;

pub fn describe(cfg: &ModelConfig) -> ModelLayout {
    let (rope, table_of) = rope_tables(cfg);
    let (kinds, kind_of) = kinds_by_type(cfg, |t| layer(cfg, t, table_of(t)));
    // transformers: `embed * tensor(hidden_size ** 0.5)` in the weights' dtype.
    let embed_scale = (cfg.hidden_size as f64).sqrt() as f32;
    ModelLayout::from_parts(cfg, kinds, kind_of, rope, embed_scale, W_OFFSET)
}

/// One Gemma 3 decoder layer of type `t`, in HF's tensor order.
pub fn layer(cfg: &ModelConfig, t: LayerType, table: usize) -> LayerSpec {
    let d = Dims::of(cfg);
    let (c, hd, kvd, f) = (d.c, d.h * d.d, d.kvh * d.d, d.f);
    let qkv_w = d.qkv();
    let mut b = LayerBuilder::new(c);
    let q = b.tensor("self_attn.q_proj.weight", &[hd, c], Init::Normal);
    b.tensor("self_attn.k_proj.weight", &[kvd, c], Init::Normal);
    let v = b.tensor("self_attn.v_proj.weight", &[kvd, c], Init::Normal);
    let qn = b.tensor("self_attn.q_norm.weight", &[d.d], Init::Zeros);
    let kn = b.tensor("self_attn.k_norm.weight", &[d.d], Init::Zeros);
    let wo = b.tensor("self_attn.o_proj.weight", &[c, hd], Init::Normal);
    let gate = b.tensor("mlp.gate_proj.weight", &[f, c], Init::Normal);
    let up = b.tensor("mlp.up_proj.weight", &[f, c], Init::Normal);
    let wdown = b.tensor("mlp.down_proj.weight", &[c, f], Init::Normal);
    let ln_in = b.tensor("input_layernorm.weight", &[c], Init::Zeros);
    let ln_post_attn = b.tensor("post_attention_layernorm.weight", &[c], Init::Zeros);
    let ln_pre_ff = b.tensor("pre_feedforward_layernorm.weight", &[c], Init::Zeros);
    let ln_post_ff = b.tensor("post_feedforward_layernorm.weight", &[c], Init::Zeros);

    let h1 = b.rmsnorm(X, ("h1", "rstd1"), ln_in, W_OFFSET);
    let raw = b.act("qkv_raw", qkv_w);
    b.op(Op::Linear {
        inp: h1,
        out: raw,
        w: (q.start..v.end).into(),
        bias: None,
        ic: c,
        oc: qkv_w,
    });
    let (qkv, rstd_qk) = (b.act("qkv", qkv_w), b.stat("rstd_qk", d.h + d.kvh));
    b.op(Op::HeadNorm {
        inp: raw,
        out: qkv,
        rstd: rstd_qk,
        w: qn.start..kn.end,
        w_offset: W_OFFSET,
    });
    b.op(Op::Rope { qkv, table });
    let (att, lse) = (b.act("att", hd), b.stat("lse", d.h));
    b.op(Op::Attention { qkv, out: att, lse, sinks: None });
    let o = b.act("o", c);
    b.op(Op::Linear { inp: att, out: o, w: wo.into(), bias: None, ic: hd, oc: c });
    let po = b.rmsnorm(o, ("po", "rstd_po"), ln_post_attn, W_OFFSET);
    let x2 = b.act("x2", c);
    b.op(Op::Add { a: X, b: po, out: x2 });
    let h2 = b.rmsnorm(x2, ("h2", "rstd2"), ln_pre_ff, W_OFFSET);
    let gu = b.act("gu", 2 * f);
    b.op(Op::Linear {
        inp: h2,
        out: gu,
        w: (gate.start..up.end).into(),
        bias: None,
        ic: c,
        oc: 2 * f,
    });
    let s = b.act("s", f);
    b.op(Op::Glu { gu, out: s, act: Glu::GeluTanh, f });
    let m = b.act("m", c);
    b.op(Op::Linear { inp: s, out: m, w: wdown.into(), bias: None, ic: f, oc: c });
    let pm = b.rmsnorm(m, ("pm", "rstd_pm"), ln_post_ff, W_OFFSET);
    b.op(Op::Add { a: x2, b: pm, out: Y });
    b.finish(type_name(t), attn_spec(cfg, t), cfg.rms_norm_eps as f32)
}
