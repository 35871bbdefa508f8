//! The parameter layout: names, shapes and offsets of one decoder layer's flat buffer, and of
//! the model-level tensors. The single source for every flat per-layer buffer (weights,
//! gradients, AdamW moments).

use std::ops::Range;

use crate::hf::config::ModelConfig;

/// Sizes of the model, in the shape legend `C H KVH D F V`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Hidden size C.
    pub c: usize,
    /// Query heads H.
    pub h: usize,
    /// Key/value heads KVH.
    pub kvh: usize,
    /// Head dim D.
    pub d: usize,
    /// FFN dim F.
    pub f: usize,
    /// Vocabulary V.
    pub v: usize,
    /// Decoder layers L.
    pub layers: usize,
}

impl Dims {
    /// Width of the fused q|k|v projection output: `(H + 2*KVH)*D`.
    pub fn qkv(&self) -> usize {
        (self.h + 2 * self.kvh) * self.d
    }
    /// Width of the attention output: `H*D`.
    pub fn hd(&self) -> usize {
        self.h * self.d
    }
}

/// One named tensor inside a flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// HF name suffix inside a layer (`self_attn.q_proj.weight`), or the full HF name for
    /// model-level tensors.
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// Where each part of one decoder layer lives in its flat buffer. The order is chosen so that
/// fused products read one contiguous matrix:
///
/// `ln1 (C) | q (H*D, C) | k (KVH*D, C) | v (KVH*D, C) | [bq (H*D) | bk | bv] | o (C, H*D) |
///  ln2 (C) | gate (F, C) | up (F, C) | down (C, F)`
///
/// so `wqkv` is one `(QKV, C)` matrix, `bqkv` one `(QKV)` vector and `wgu` one `(2F, C)` matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    pub ln1: Range<usize>,
    pub wqkv: Range<usize>,
    pub bqkv: Option<Range<usize>>,
    pub wo: Range<usize>,
    pub ln2: Range<usize>,
    pub wgu: Range<usize>,
    pub wdown: Range<usize>,
    /// Total f32 elements of one layer.
    pub len: usize,
    /// Every HF tensor of the layer, in buffer order.
    pub tensors: Vec<TensorSpec>,
}

impl LayerLayout {
    pub fn new(d: &Dims, qkv_bias: bool) -> Self {
        let (c, hd, kvd, f) = (d.c, d.h * d.d, d.kvh * d.d, d.f);
        let mut tensors = Vec::new();
        let mut off = 0usize;
        let mut push = |name: &str, shape: Vec<usize>| {
            let spec = TensorSpec { name: name.to_string(), shape, offset: off };
            off += spec.numel();
            let r = spec.range();
            tensors.push(spec);
            r
        };
        let ln1 = push("input_layernorm.weight", vec![c]);
        let q = push("self_attn.q_proj.weight", vec![hd, c]);
        push("self_attn.k_proj.weight", vec![kvd, c]);
        let v = push("self_attn.v_proj.weight", vec![kvd, c]);
        let bqkv = qkv_bias.then(|| {
            let bq = push("self_attn.q_proj.bias", vec![hd]);
            push("self_attn.k_proj.bias", vec![kvd]);
            let bv = push("self_attn.v_proj.bias", vec![kvd]);
            bq.start..bv.end
        });
        let wo = push("self_attn.o_proj.weight", vec![c, hd]);
        let ln2 = push("post_attention_layernorm.weight", vec![c]);
        let gate = push("mlp.gate_proj.weight", vec![f, c]);
        let up = push("mlp.up_proj.weight", vec![f, c]);
        let wdown = push("mlp.down_proj.weight", vec![c, f]);
        LayerLayout {
            ln1,
            wqkv: q.start..v.end,
            bqkv,
            wo,
            ln2,
            wgu: gate.start..up.end,
            wdown,
            len: off,
            tensors,
        }
    }
}

/// The whole model's parameters: L decoder layers of one [`LayerLayout`], plus embedding,
/// final norm and (when untied) the LM head.
#[derive(Clone, Debug)]
pub struct ModelLayout {
    pub dims: Dims,
    pub layer: LayerLayout,
    pub tied: bool,
    pub eps: f32,
}

pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";

impl ModelLayout {
    pub fn new(cfg: &ModelConfig) -> Self {
        let dims = Dims {
            c: cfg.hidden_size,
            h: cfg.num_heads,
            kvh: cfg.num_kv_heads,
            d: cfg.head_dim,
            f: cfg.intermediate_size,
            v: cfg.vocab_size,
            layers: cfg.num_layers,
        };
        ModelLayout {
            dims,
            layer: LayerLayout::new(&dims, cfg.qkv_bias),
            tied: cfg.tie_word_embeddings,
            eps: cfg.rms_norm_eps as f32,
        }
    }

    /// HF name of a layer tensor.
    pub fn layer_name(i: usize, suffix: &str) -> String {
        format!("model.layers.{i}.{suffix}")
    }

    /// Every HF tensor of the model with its shape, in a stable order (embedding, layers, final
    /// norm, head).
    pub fn hf_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let d = &self.dims;
        let mut out = vec![(EMBED.to_string(), vec![d.v, d.c])];
        for i in 0..d.layers {
            for t in &self.layer.tensors {
                out.push((Self::layer_name(i, &t.name), t.shape.clone()));
            }
        }
        out.push((FINAL_NORM.to_string(), vec![d.c]));
        if !self.tied {
            out.push((LM_HEAD.to_string(), vec![d.v, d.c]));
        }
        out
    }

    /// Elements of each tensor of each flat buffer, in `ParamStore::buffers` order (embedding,
    /// layers, final norm, untied head) and buffer order within a layer.
    pub fn buffer_tensors(&self) -> Vec<Vec<usize>> {
        let d = &self.dims;
        let layer: Vec<usize> = self.layer.tensors.iter().map(|t| t.numel()).collect();
        let mut out = vec![vec![d.v * d.c]];
        out.extend((0..d.layers).map(|_| layer.clone()));
        out.push(vec![d.c]);
        if !self.tied {
            out.push(vec![d.v * d.c]);
        }
        out
    }

    /// Total parameter count.
    pub fn num_params(&self) -> usize {
        let d = &self.dims;
        d.v * d.c * if self.tied { 1 } else { 2 } + d.layers * self.layer.len + d.c
    }
}
