//! The model's layout, derived from its family's description: the layer kinds and the kind of
//! each layer (names, shapes and offsets of every flat per-layer buffer: weights, gradients,
//! AdamW moments), and the model-level tensors. The single source for every flat buffer.

use std::ops::Range;

use crate::hf::config::{ModelConfig, MoeConfig};
use crate::model::lora::LoraSpec;
pub use crate::model::spec::TensorSpec;
use crate::model::spec::{IO_SLOTS, Init, LayerSpec};

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

impl Dims {
    /// The sizes of `cfg`.
    pub fn of(cfg: &ModelConfig) -> Self {
        Dims {
            c: cfg.hidden_size,
            h: cfg.num_heads,
            kvh: cfg.num_kv_heads,
            d: cfg.head_dim,
            f: cfg.intermediate_size,
            v: cfg.vocab_size,
            layers: cfg.num_layers,
        }
    }
}

/// The whole model's parameters and structure, from its family's description
/// ([`crate::model::families`]): L decoder layers, each of one of the model's layer kinds
/// ([`LayerSpec`]: its own tensors, ops and attention), plus embedding, final norm and (when
/// untied) the LM head.
#[derive(Clone, Debug)]
pub struct ModelLayout {
    pub dims: Dims,
    /// The distinct layer descriptions (one per layer type the model uses).
    pub kinds: Vec<LayerSpec>,
    /// The kind of each layer.
    pub kind_of: Vec<usize>,
    pub tied: bool,
    pub eps: f32,
    /// RoPE tables' frequencies and scales; `Op::Rope`'s `table` indexes them.
    pub rope: Vec<RopeTable>,
    /// The embedding output is multiplied by this (Gemma: `sqrt(C)`; else 1).
    pub embed_scale: f32,
    /// The final norm applies its weight as `(final_norm_offset + w)` (Gemma: 1).
    pub final_norm_offset: f32,
    /// Prefix of every tensor name in the source checkpoint (`language_model.` for the text
    /// model of a multimodal checkpoint).
    pub prefix: String,
    /// An adapter run's adapters: the base (every tensor of the checkpoint) is frozen and the
    /// layers' adapters alone train. `None`: full fine-tuning.
    pub adapter: Option<LoraSpec>,
    /// A mixture-of-experts model's routing and load-balancing loss (`None`: dense).
    pub moe: Option<MoeConfig>,
    /// The checkpoint packs the routed experts as MXFP4 (gpt-oss): an adapter run keeps them
    /// so as its frozen base; full fine-tuning decodes them into its masters.
    pub mxfp4_experts: bool,
}

/// One RoPE table: its inverse frequencies (D/2) and the factor its cos and sin are multiplied
/// by (YaRN's attention factor; else 1).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub inv_freq: Vec<f32>,
    pub scale: f32,
}

pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";

impl ModelLayout {
    /// A layout from a family's parts (a family's `describe` builds it; callers take the
    /// description of a model from [`crate::model::describe`]).
    pub fn from_parts(
        cfg: &ModelConfig,
        kinds: Vec<LayerSpec>,
        kind_of: Vec<usize>,
        rope: Vec<RopeTable>,
        embed_scale: f32,
        final_norm_offset: f32,
    ) -> Self {
        assert_eq!(kind_of.len(), cfg.num_layers, "one kind per layer");
        ModelLayout {
            dims: Dims::of(cfg),
            kinds,
            kind_of,
            tied: cfg.tie_word_embeddings,
            eps: cfg.rms_norm_eps as f32,
            rope,
            embed_scale,
            final_norm_offset,
            prefix: cfg.tensor_prefix.clone(),
            adapter: None,
            moe: cfg.moe.clone(),
            mxfp4_experts: cfg.quantization.is_some(),
        }
    }

    /// This model with `lora`'s adapters on every layer. The error (for the user) names a
    /// target the layers do not have.
    pub fn with_lora(&self, lora: &LoraSpec) -> Result<ModelLayout, String> {
        let kinds = self
            .kinds
            .iter()
            .map(|k| k.with_lora_in(lora, self.mxfp4_experts))
            .collect::<Result<_, _>>()?;
        Ok(ModelLayout { kinds, adapter: Some(lora.clone()), ..self.clone() })
    }

    /// A gpt-oss model (its router is `mlp.router`, its experts fused in-to-out).
    pub fn is_gpt_oss(&self) -> bool {
        self.moe.as_ref().is_some_and(|m| m.arch == crate::hf::config::Arch::GptOss)
    }

    /// True in full fine-tuning: the embedding, final norm and head train too.
    pub fn trains_base(&self) -> bool {
        self.adapter.is_none()
    }

    /// Words of the largest layer's packed (NF4) region.
    pub fn max_packed(&self) -> usize {
        self.kinds.iter().map(|k| k.packed).max().unwrap_or(0)
    }

    /// The largest dequantisation workspace a layer needs (weights).
    pub fn max_workspace(&self) -> usize {
        self.kinds.iter().map(|k| k.workspace).max().unwrap_or(0)
    }

    /// Trained weights of the largest layer (its gradient).
    pub fn max_train_len(&self) -> usize {
        self.kinds.iter().map(|k| k.train_len()).max().unwrap_or(0)
    }

    /// The description of layer `i`.
    pub fn layer(&self, i: usize) -> &LayerSpec {
        &self.kinds[self.kind_of[i]]
    }

    /// Weights of the largest decoder layer.
    pub fn max_layer_len(&self) -> usize {
        self.kinds.iter().map(|k| k.len).max().unwrap_or(0)
    }

    /// Largest width of activation slot `a` over the layer kinds (0 where no kind has it).
    pub fn max_act_widths(&self) -> Vec<usize> {
        max_by_index(self.kinds.iter().map(|k| k.acts.iter().map(|a| a.width).collect()))
    }

    /// Per own activation index, whether a layer of any kind that keeps its internals keeps it
    /// on the device ([`crate::model::spec::LayerSpec::stashed`]); the kept buffers are
    /// allocated by index, at [`ModelLayout::max_act_widths`].
    pub fn stashed_acts(&self) -> Vec<bool> {
        let lists = self.kinds.iter().map(|k| k.stashed().into_iter().map(usize::from).collect());
        let stashed: Vec<bool> = max_by_index(lists).into_iter().map(|x| x > 0).collect();
        // A kind's rebuilt values must not be kept for another kind at the same index: its
        // rebuild would write a kept buffer its backward only reads.
        for k in &self.kinds {
            for a in k.rebuild_ops().iter().flat_map(|&i| k.ops[i].forward_io().1) {
                assert!(!stashed[a - IO_SLOTS], "layer kinds disagree on keeping activation {a}");
            }
        }
        stashed
    }

    /// Largest width of gradient buffer `g` over the layer kinds.
    pub fn max_grad_widths(&self) -> Vec<usize> {
        max_by_index(self.kinds.iter().map(|k| k.grads.clone()))
    }

    /// The final norm's application of its weight.
    pub fn final_norm(&self) -> horizon_backend::NormDims {
        horizon_backend::NormDims {
            c: self.dims.c,
            eps: self.eps,
            w_offset: self.final_norm_offset,
        }
    }

    /// How the final norm's weight starts in a random model.
    pub fn final_norm_init(&self) -> Init {
        if self.final_norm_offset == 0.0 { Init::Ones } else { Init::Zeros }
    }

    /// HF name of a layer tensor.
    pub fn layer_name(i: usize, suffix: &str) -> String {
        format!("model.layers.{i}.{suffix}")
    }

    /// Every trained HF tensor of the model with its shape (what `ParamStore` holds), in a
    /// stable order (embedding, layers, final norm, head): every tensor in full fine-tuning,
    /// the layers' adapters in an adapter run.
    pub fn hf_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let d = &self.dims;
        let base = self.trains_base();
        let mut out = Vec::new();
        if base {
            out.push((EMBED.to_string(), vec![d.v, d.c]));
        }
        for i in 0..d.layers {
            for t in self.layer(i).trained() {
                out.push((Self::layer_name(i, &t.name), t.shape.clone()));
            }
        }
        if base {
            out.push((FINAL_NORM.to_string(), vec![d.c]));
            if !self.tied {
                out.push((LM_HEAD.to_string(), vec![d.v, d.c]));
            }
        }
        out
    }

    /// Every tensor of the base checkpoint with its shape: [`ModelLayout::hf_tensors`] in full
    /// fine-tuning; in an adapter run, every frozen tensor.
    pub fn base_tensors(&self) -> Vec<(String, Vec<usize>)> {
        if self.trains_base() {
            return self.hf_tensors();
        }
        let d = &self.dims;
        let mut out = vec![(EMBED.to_string(), vec![d.v, d.c])];
        for i in 0..d.layers {
            for t in self.layer(i).frozen_tensors() {
                out.push((Self::layer_name(i, &t.name), t.shape.clone()));
            }
        }
        out.push((FINAL_NORM.to_string(), vec![d.c]));
        if !self.tied {
            out.push((LM_HEAD.to_string(), vec![d.v, d.c]));
        }
        out
    }

    /// `f(full HF name, elements in the buffer)` of every trained tensor of each flat buffer, in
    /// `ParamStore::buffers` order (embedding, layers, final norm, untied head) and buffer
    /// order within a layer; a frozen buffer has none. The one walk every per-buffer list
    /// derives from.
    fn per_buffer<T>(&self, f: impl Fn(&dyn Fn() -> String, Range<usize>) -> T) -> Vec<Vec<T>> {
        let d = &self.dims;
        let base = self.trains_base();
        let whole = |name: &str, n: usize| -> Vec<T> {
            if base { vec![f(&|| name.to_string(), 0..n)] } else { vec![] }
        };
        let mut out = vec![whole(EMBED, d.v * d.c)];
        out.extend((0..d.layers).map(|i| {
            let spec = self.layer(i);
            let at = |t: &TensorSpec| t.offset - spec.frozen..t.offset - spec.frozen + t.numel();
            spec.trained().map(|t| f(&|| Self::layer_name(i, &t.name), at(t))).collect()
        }));
        out.push(whole(FINAL_NORM, d.c));
        if !self.tied {
            out.push(whole(LM_HEAD, d.v * d.c));
        }
        out
    }

    /// Every trained tensor of each flat buffer, in `ParamStore::buffers` order: its full HF
    /// name and its elements in the buffer (what the optimizer's weight-decay groups are
    /// derived from, `optim::decay`).
    pub fn buffer_tensor_ranges(&self) -> Vec<Vec<(String, Range<usize>)>> {
        self.per_buffer(|name, r| (name(), r))
    }

    /// Elements of each trained tensor of each flat buffer, in `ParamStore::buffers` order
    /// (embedding, layers, final norm, untied head) and buffer order within a layer; a frozen
    /// buffer has none.
    pub fn buffer_tensors(&self) -> Vec<Vec<usize>> {
        self.per_buffer(|_, r| r.len())
    }

    /// Total parameter count, frozen and trained.
    pub fn num_params(&self) -> usize {
        let d = &self.dims;
        let layers: usize =
            (0..d.layers).flat_map(|i| self.layer(i).tensors.iter().map(|t| t.numel())).sum();
        d.v * d.c * if self.tied { 1 } else { 2 } + layers + d.c
    }

    /// Trained parameters: [`ModelLayout::num_params`] in full fine-tuning, the adapters'
    /// in an adapter run.
    pub fn trained_params(&self) -> usize {
        self.buffer_tensors().iter().flatten().sum()
    }
}

/// The elementwise maximum of lists of different lengths.
fn max_by_index(lists: impl Iterator<Item = Vec<usize>>) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for l in lists {
        if out.len() < l.len() {
            out.resize(l.len(), 0);
        }
        for (o, x) in out.iter_mut().zip(l) {
            *o = (*o).max(x);
        }
    }
    out
}
