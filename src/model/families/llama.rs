//! The Llama-style pre-norm decoder: Llama, Qwen2 (q/k/v biases), Mistral (its sliding window is
//! a layer type), Qwen3, which adds a per-head RMSNorm of q and k before RoPE, and gpt-oss's
//! attention (q/k/v/o biases, a learned sink per head) around its sparse MLP.
//!
//! One layer: `x (N,C) -> rmsnorm -> h1 -> qkv (N,QKV) -> [qwen3: per-head q/k norm] -> rope ->
//! attention -> att (N,H*D) -> o_proj -> +x -> x2 -> rmsnorm -> h2 -> gate|up (N,2F) -> swiglu ->
//! s (N,F) -> down -> +x2 -> y (N,C)`.
//!
//! Buffer order: `ln1 | q | k | v | [bq | bk | bv] | [q_norm | k_norm] | o | [bo | sinks] | ln2 |
//! gate | up | down` (or the sparse MLP's tensors), so the fused products read one contiguous
//! matrix (`wqkv`, `bqkv`, `wgu`) and the two head norms one `(2D)` vector.

use crate::hf::config::{Arch, LayerType, ModelConfig};
use std::ops::Range;

use crate::model::families::{kinds_by, moe, rope_tables, type_name};
use crate::model::layout::{Dims, ModelLayout};
use crate::model::spec::{AttnSpec, Glu, Init, LayerBuilder, LayerSpec, Op, X, Y};

/// The model: one layer kind per layer type (full, sliding) and MLP (dense, sparse), plain
/// embedding and final norm.
pub fn describe(cfg: &ModelConfig) -> ModelLayout {
    let (rope, table_of) = rope_tables(cfg);
    let sparse = |i: usize| cfg.moe.as_ref().is_some_and(|m| m.is_sparse(i));
    let key = |i: usize| (cfg.layer_type(i), sparse(i));
    let (kinds, kind_of) = kinds_by(cfg, key, |i| layer(cfg, i, table_of(cfg.layer_type(i))));
    ModelLayout::from_parts(cfg, kinds, kind_of, rope, 1.0, 0.0)
}

/// Decoder layer `layer_index` (its type and MLP), rotating with rope table `table`.
pub fn layer(cfg: &ModelConfig, layer_index: usize, table: usize) -> LayerSpec {
    let t = cfg.layer_type(layer_index);
    let d = Dims::of(cfg);
    let (c, hd, kvd, f) = (d.c, d.h * d.d, d.kvh * d.d, d.f);
    let qkv_w = d.qkv();
    let mut b = LayerBuilder::new(c);
    let ln1 = b.tensor("input_layernorm.weight", &[c], Init::Ones);
    let q = b.tensor("self_attn.q_proj.weight", &[hd, c], Init::Normal);
    b.tensor("self_attn.k_proj.weight", &[kvd, c], Init::Normal);
    let v = b.tensor("self_attn.v_proj.weight", &[kvd, c], Init::Normal);
    let bias = cfg.qkv_bias.then(|| {
        let bq = b.tensor("self_attn.q_proj.bias", &[hd], Init::Zeros);
        b.tensor("self_attn.k_proj.bias", &[kvd], Init::Zeros);
        let bv = b.tensor("self_attn.v_proj.bias", &[kvd], Init::Zeros);
        bq.start..bv.end
    });
    let qk_norm = (cfg.arch.dense() == Arch::Qwen3).then(|| {
        let qn = b.tensor("self_attn.q_norm.weight", &[d.d], Init::Ones);
        let kn = b.tensor("self_attn.k_norm.weight", &[d.d], Init::Ones);
        qn.start..kn.end
    });
    let wo = b.tensor("self_attn.o_proj.weight", &[c, hd], Init::Normal);
    let (bo, sinks) = match cfg.arch {
        Arch::GptOss => (
            cfg.qkv_bias.then(|| b.tensor("self_attn.o_proj.bias", &[c], Init::Zeros)),
            Some(b.tensor("self_attn.sinks", &[d.h], Init::Zeros)),
        ),
        _ => (None, None),
    };
    let ln2 = b.tensor("post_attention_layernorm.weight", &[c], Init::Ones);
    let sparse = cfg.moe.as_ref().filter(|m| m.is_sparse(layer_index));
    let mlp = match sparse {
        Some(m) => Mlp::Sparse(moe::tensors(&mut b, cfg, m)),
        None => Mlp::Dense(
            b.tensor("mlp.gate_proj.weight", &[f, c], Init::Normal),
            b.tensor("mlp.up_proj.weight", &[f, c], Init::Normal),
            b.tensor("mlp.down_proj.weight", &[c, f], Init::Normal),
        ),
    };

    let h1 = b.rmsnorm(X, ("h1", "rstd1"), ln1, 0.0);
    let qkv = match qk_norm {
        None => {
            let qkv = b.act("qkv", qkv_w);
            b.op(Op::Linear {
                inp: h1,
                out: qkv,
                w: (q.start..v.end).into(),
                bias,
                ic: c,
                oc: qkv_w,
            });
            qkv
        }
        Some(w) => {
            let raw = b.act("qkv_raw", qkv_w);
            b.op(Op::Linear {
                inp: h1,
                out: raw,
                w: (q.start..v.end).into(),
                bias,
                ic: c,
                oc: qkv_w,
            });
            let (qkv, rstd) = (b.act("qkv", qkv_w), b.stat("rstd_qk", d.h + d.kvh));
            b.op(Op::HeadNorm { inp: raw, out: qkv, rstd, w, w_offset: 0.0 });
            qkv
        }
    };
    b.op(Op::Rope { qkv, table });
    let (att, lse) = (b.act("att", hd), b.stat("lse", d.h));
    b.op(Op::Attention { qkv, out: att, lse, sinks });
    // One scratch serves the o_proj and down_proj outputs: no backward reads either.
    let tmp = b.act("tmp", c);
    b.op(Op::Linear { inp: att, out: tmp, w: wo.into(), bias: bo, ic: hd, oc: c });
    let x2 = b.act("x2", c);
    b.op(Op::Add { a: X, b: tmp, out: x2 });
    let h2 = b.rmsnorm(x2, ("h2", "rstd2"), ln2, 0.0);
    match mlp {
        Mlp::Dense(gate, up, wdown) => {
            let gu = b.act("gu", 2 * f);
            let wgu = (gate.start..up.end).into();
            b.op(Op::Linear { inp: h2, out: gu, w: wgu, bias: None, ic: c, oc: 2 * f });
            let s = b.act("s", f);
            b.op(Op::Glu { gu, out: s, act: Glu::Silu, f });
            b.op(Op::Linear { inp: s, out: tmp, w: wdown.into(), bias: None, ic: f, oc: c });
        }
        Mlp::Sparse(w) => moe::ops(&mut b, cfg, sparse.expect("sparse"), w, h2, tmp),
    }
    b.op(Op::Add { a: x2, b: tmp, out: Y });
    let kind = if sparse.is_some() { sparse_name(t) } else { type_name(t) };
    b.finish(kind, attn_spec(cfg, t), cfg.rms_norm_eps as f32)
}

/// A layer's MLP: dense (gate, up, down) or sparse.
enum Mlp {
    Dense(Range<usize>, Range<usize>, Range<usize>),
    Sparse(moe::SparseMlp),
}

/// The plan's name of a sparse layer of type `t`.
fn sparse_name(t: LayerType) -> &'static str {
    match t {
        LayerType::Full => "full_attention_moe",
        LayerType::Sliding => "sliding_attention_moe",
    }
}

/// Heads, window and scale of a layer of type `t`.
pub fn attn_spec(cfg: &ModelConfig, t: LayerType) -> AttnSpec {
    let window = match t {
        LayerType::Full => 0,
        LayerType::Sliding => cfg.sliding_window.expect("a sliding layer has a window"),
    };
    let scale = match cfg.query_pre_attn_scalar {
        Some(q) => (q.powf(-0.5)) as f32,
        None => 1.0 / (cfg.head_dim as f32).sqrt(),
    };
    AttnSpec { h: cfg.num_heads, kvh: cfg.num_kv_heads, d: cfg.head_dim, window, scale }
}
