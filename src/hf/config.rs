//! The model description read from a Hugging Face `config.json` (llama, qwen2, mistral, qwen3,
//! gemma3_text and the language model of a gemma3 checkpoint), validated, and written back for
//! export. What a family's layer *is* lives in `model/families/`; this file only reads keys.
//!
//! Two stages, as everywhere in Horizon: the raw JSON object is kept verbatim in
//! [`ModelConfig::raw`]; [`ModelConfig::from_json`] validates the keys Horizon interprets and
//! derives the sizes. Keys Horizon does not interpret are accepted and ignored (HF configs carry
//! many), and written back unchanged by [`ModelConfig::to_hf_json`].
//!
//! Shape legend: `C` hidden, `H` query heads, `KVH` kv heads, `D` head dim, `F` FFN dim, `V` vocab,
//! `L` decoder layers.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};

pub use crate::hf::moe::MoeConfig;
use crate::hf::moe::parse_moe;

/// Decoder architecture, from `model_type`. Llama, Qwen2 and Mistral are the same pre-norm
/// decoder (they differ in defaults, biases and the window); Qwen3 adds per-head q/k norms;
/// Gemma 3 is its own family (see `model/families/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Mistral,
    Qwen3,
    /// `gemma3_text`, or the `text_config` of a `gemma3` (multimodal) checkpoint.
    Gemma3,
    /// Qwen3's attention with sparse MLPs.
    Qwen3Moe,
    /// Qwen2's attention with sparse MLPs and a shared expert.
    Qwen2Moe,
    /// Mistral's attention with sparse MLPs (`block_sparse_moe`).
    Mixtral,
    /// gpt-oss: q/k/v/o biases, learned attention sinks, alternating sliding and full layers,
    /// YaRN, a biased router and clamped-SwiGLU experts with biases (`model/families/gpt_oss.rs`).
    GptOss,
}

/// What a layer's attention sees (`layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// `full_attention`: every earlier position.
    Full,
    /// `sliding_attention`: the last `sliding_window` positions, with the sliding layers' RoPE.
    Sliding,
}

impl Arch {
    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Mistral => "mistral",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3_text",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::Mixtral => "mixtral",
            Arch::GptOss => "gpt_oss",
        }
    }

    /// The transformers class written to `architectures`.
    pub fn causal_lm_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
            Arch::Qwen2Moe => "Qwen2MoeForCausalLM",
            Arch::Mixtral => "MixtralForCausalLM",
            Arch::GptOss => "GptOssForCausalLM",
        }
    }

    /// transformers' default for `max_position_embeddings` when the key is absent.
    fn default_max_position_embeddings(self) -> usize {
        match self {
            Arch::Llama => 2048,
            Arch::Qwen2 | Arch::Qwen2Moe => 32768,
            Arch::Mistral | Arch::Mixtral => 4096 * 32,
            Arch::Qwen3 | Arch::Qwen3Moe => 32768,
            Arch::Gemma3 | Arch::GptOss => 131072,
        }
    }

    /// A mixture-of-experts family.
    pub fn is_moe(self) -> bool {
        matches!(self, Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::Mixtral | Arch::GptOss)
    }

    /// The attention (and dense MLP) family it shares: Llama-style decoders by their own name,
    /// the sparse families by their dense sibling's.
    pub fn dense(self) -> Arch {
        match self {
            Arch::Qwen3Moe => Arch::Qwen3,
            Arch::Qwen2Moe => Arch::Qwen2,
            Arch::Mixtral => Arch::Mistral,
            a => a,
        }
    }

    /// The config key naming the MLP activation.
    fn act_key(self) -> &'static str {
        if self == Arch::Gemma3 { "hidden_activation" } else { "hidden_act" }
    }
}

/// How the RoPE frequencies are scaled (`rope_type` of `rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeKind {
    /// Plain RoPE: `inv_freq[i] = 1 / theta^(2i/D)`.
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1 frequency-dependent scaling (`_compute_llama3_parameters` in transformers).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN (`_compute_yarn_parameters`; gpt-oss, Qwen's long-context configs): frequencies
    /// ramped between extrapolation and interpolation by `factor` over the dimensions whose
    /// rotations at `original_max_position_embeddings` fall between `beta_slow` and
    /// `beta_fast`, and cos/sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Round the ramp's ends to whole dimensions (transformers' default when the key is
        /// absent; gpt-oss's configs write false).
        truncate: bool,
        attention_factor: f64,
    },
}

/// Rotary position embedding parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// Base of the frequencies (`rope_theta`).
    pub theta: f64,
    /// Frequency scaling.
    pub kind: RopeKind,
}

/// A validated decoder description. Sizes use the legend of the module doc.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture, from `model_type`.
    pub arch: Arch,
    /// C, `hidden_size`.
    pub hidden_size: usize,
    /// L, `num_hidden_layers`.
    pub num_layers: usize,
    /// H, `num_attention_heads`.
    pub num_heads: usize,
    /// KVH, `num_key_value_heads` (defaults to H); divides H.
    pub num_kv_heads: usize,
    /// D, explicit `head_dim` or C / H.
    pub head_dim: usize,
    /// F, `intermediate_size`.
    pub intermediate_size: usize,
    /// Epsilon of every RMSNorm, `rms_norm_eps` (default 1e-6).
    pub rms_norm_eps: f64,
    /// V, `vocab_size`.
    pub vocab_size: usize,
    /// The LM head shares `model.embed_tokens.weight` (`tie_word_embeddings`, default false).
    pub tie_word_embeddings: bool,
    /// q, k and v projections carry biases (always for qwen2; `attention_bias` otherwise).
    pub qkv_bias: bool,
    /// Rotary embedding parameters (of the full-attention layers).
    pub rope: RopeConfig,
    /// The attention of each layer (`layer_types`; every layer full when absent, except as a
    /// family's keys say: Mistral's `sliding_window`, Qwen's `use_sliding_window`, Gemma 3's
    /// `sliding_window_pattern`).
    pub layer_types: Vec<LayerType>,
    /// W of the sliding layers (`sliding_window`); set when some layer slides.
    pub sliding_window: Option<usize>,
    /// RoPE of the sliding layers when it is their own (Gemma 3: `rope_local_base_freq`, or
    /// `rope_parameters.sliding_attention`); `None`: the same as `rope`.
    pub rope_local: Option<RopeConfig>,
    /// Gemma: the attention scale is `query_pre_attn_scalar^-1/2` (else `head_dim^-1/2`).
    pub query_pre_attn_scalar: Option<f64>,
    /// Prefix of every tensor name in the checkpoint: `language_model.` for the text model of a
    /// `gemma3` multimodal checkpoint (whose other tensors are ignored), else empty.
    pub tensor_prefix: String,
    /// `max_position_embeddings` (architecture default when absent).
    pub max_position_embeddings: usize,
    /// `bos_token_id`, if any.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`: HF writes an int or a list; empty when null or absent.
    pub eos_token_id: Vec<u32>,
    /// The sparse MLPs of a mixture-of-experts family; `None` for a dense model.
    pub moe: Option<MoeConfig>,
    /// The checkpoint's `quantization_config`: MXFP4 experts (gpt-oss), or none.
    pub quantization: Option<crate::hf::mxfp4::Mxfp4Config>,
    /// The original JSON object, kept so export can write it back.
    pub raw: Value,
}

const SUPPORTED: &str =
    "llama, qwen2, mistral, qwen3, gemma3_text, gemma3, qwen3_moe, qwen2_moe, mixtral, gpt_oss";

impl ModelConfig {
    /// Reads and validates a `config.json`; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading model config {}", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        Self::from_json(&v, &path.display().to_string())
    }

    /// Validates a parsed `config.json` object; `origin` (usually the file path) starts every
    /// error message. A `gemma3` (multimodal) config is read as its `text_config`, whose tensors
    /// carry the prefix `language_model.`.
    pub fn from_json(v: &Value, origin: &str) -> Result<Self> {
        let Some(obj) = v.as_object() else {
            bail!("{origin}: expected a JSON object at the top level");
        };
        if obj.get("model_type").and_then(Value::as_str) == Some("gemma3") {
            let Some(Value::Object(text)) = obj.get("text_config") else {
                bail!(
                    "{origin}: a gemma3 config needs a 'text_config' object (its language model)"
                );
            };
            let mut text = text.clone();
            text.insert("model_type".into(), "gemma3_text".into());
            for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
                if let (false, Some(id)) = (text.contains_key(key), obj.get(key)) {
                    text.insert(key.into(), id.clone());
                }
            }
            let mut cfg = Self::from_json(&Value::Object(text), &format!("{origin}: text_config"))?;
            cfg.tensor_prefix = "language_model.".into();
            return Ok(cfg);
        }
        let o = Keys { obj, origin };
        let model_type = o.str("model_type")?.with_context(|| {
            format!("{origin}: missing key 'model_type' (supported: {SUPPORTED})")
        })?;
        let arch = match model_type {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "mistral" => Arch::Mistral,
            "qwen3" => Arch::Qwen3,
            "gemma3_text" => Arch::Gemma3,
            "qwen3_moe" => Arch::Qwen3Moe,
            "qwen2_moe" => Arch::Qwen2Moe,
            "mixtral" => Arch::Mixtral,
            "gpt_oss" => Arch::GptOss,
            other if other.starts_with("deepseek") => bail!(
                "{origin}: model_type '{other}' is not supported: DeepSeek's multi-head latent \
                 attention (MLA) and grouped routing are not implemented; supported: {SUPPORTED}"
            ),
            other => {
                bail!("{origin}: model_type '{other}' is not supported; supported: {SUPPORTED}")
            }
        };
        let sizes = parse_sizes(&o, arch)?;
        let rms_norm_eps = o.float("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps >= 0.0 && rms_norm_eps.is_finite()) {
            bail!("{origin}: rms_norm_eps must be a finite number >= 0, got {rms_norm_eps}");
        }
        let tie_default = arch == Arch::Gemma3;
        let tie_word_embeddings = o.bool("tie_word_embeddings")?.unwrap_or(tie_default);
        let qkv_bias = parse_family_keys(&o, arch)?;
        let (layer_types, sliding_window) = parse_layer_types(&o, arch, sizes.num_layers)?;
        let rope = parse_rope(&o, "full_attention")?;
        let rope_local = parse_local_rope(&o, arch)?;
        let query_pre_attn_scalar = match arch {
            Arch::Gemma3 => Some(o.float("query_pre_attn_scalar")?.unwrap_or(256.0)),
            _ => None,
        };
        if let Some(q) = query_pre_attn_scalar {
            check_positive(origin, "query_pre_attn_scalar", q)?;
        }
        let bos_token_id = o.token_id("bos_token_id")?;
        let eos_token_id = match obj.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|id| as_token_id(id).with_context(|| bad(origin, "eos_token_id", id)))
                .collect::<Result<_>>()?,
            Some(id) => vec![as_token_id(id).with_context(|| bad(origin, "eos_token_id", id))?],
        };
        let max_position_embeddings =
            o.size("max_position_embeddings")?.unwrap_or(arch.default_max_position_embeddings());
        let moe = parse_moe(&o, arch, sizes.num_layers, sizes.intermediate_size)?;
        let quantization = crate::hf::mxfp4::quantization(v, origin)?;
        if quantization.is_some() && arch != Arch::GptOss {
            bail!(
                "{origin}: quantization_config mxfp4 is read for gpt_oss's experts, not for {}\nhint: load an unquantized checkpoint",
                arch.model_type()
            );
        }
        let Sizes { hidden_size, num_layers, num_heads, num_kv_heads, head_dim, .. } = sizes;
        Ok(ModelConfig {
            arch,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: sizes.intermediate_size,
            rms_norm_eps,
            vocab_size: sizes.vocab_size,
            tie_word_embeddings,
            qkv_bias,
            rope,
            layer_types,
            sliding_window,
            rope_local,
            query_pre_attn_scalar,
            tensor_prefix: String::new(),
            max_position_embeddings,
            bos_token_id,
            eos_token_id,
            moe,
            quantization,
            raw: v.clone(),
        })
    }

    /// `raw` with the derived fields written back, so transformers loads the exported model as
    /// Horizon understood it. The RoPE keys are kept in the layout they were given in.
    pub fn to_hf_json(&self) -> Value {
        let mut obj = self.raw.as_object().cloned().unwrap_or_default();
        // Exports write the experts unpacked (bf16 or fp32), as transformers saves a model it
        // loaded with `Mxfp4Config(dequantize=True)`.
        obj.remove("quantization_config");
        let mut set = |k: &str, v: Value| {
            obj.insert(k.to_string(), v);
        };
        set("model_type", self.arch.model_type().into());
        set("architectures", Value::Array(vec![self.arch.causal_lm_class().into()]));
        set("hidden_size", self.hidden_size.into());
        set("num_hidden_layers", self.num_layers.into());
        set("num_attention_heads", self.num_heads.into());
        set("num_key_value_heads", self.num_kv_heads.into());
        set("head_dim", self.head_dim.into());
        set("intermediate_size", self.intermediate_size.into());
        set("rms_norm_eps", self.rms_norm_eps.into());
        set("vocab_size", self.vocab_size.into());
        set("tie_word_embeddings", self.tie_word_embeddings.into());
        set("max_position_embeddings", self.max_position_embeddings.into());
        let act = if self.arch == Arch::Gemma3 { "gelu_pytorch_tanh" } else { "silu" };
        set(self.arch.act_key(), act.into());
        if self.arch.dense() != Arch::Qwen2 {
            set("attention_bias", self.qkv_bias.into());
        }
        set("bos_token_id", self.bos_token_id.map_or(Value::Null, Value::from));
        let eos_was_list = matches!(self.raw.get("eos_token_id"), Some(Value::Array(_)));
        let eos = match self.eos_token_id.as_slice() {
            [] if !eos_was_list => Value::Null,
            [id] if !eos_was_list => (*id).into(),
            ids => ids.iter().copied().map(Value::from).collect(),
        };
        set("eos_token_id", eos);
        Value::Object(obj)
    }

    /// The attention of layer `i`; past the end of `layer_types` (a config made deeper, as the
    /// planner does), the pattern repeats.
    pub fn layer_type(&self, i: usize) -> LayerType {
        match self.layer_types.len() {
            0 => LayerType::Full,
            n => self.layer_types[i % n],
        }
    }

    /// The factor cos and sin are multiplied by (YaRN's `attention_factor`; 1 for the others),
    /// as transformers multiplies its f32 tables by it.
    pub fn rope_attention_factor_of(rope: &RopeConfig) -> f32 {
        match rope.kind {
            RopeKind::Yarn { attention_factor, .. } => attention_factor as f32,
            _ => 1.0,
        }
    }

    /// RoPE inverse frequencies, length D/2, bit-for-bit as transformers computes them in float32
    /// (`_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
    /// `_compute_llama3_parameters`). torch casts Python scalars to float32 before each op and
    /// `scalar / tensor` is `tensor.reciprocal() * scalar`; both are mirrored here.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        self.rope_inv_freq_of(&self.rope)
    }

    /// [`ModelConfig::rope_inv_freq`] of the given RoPE parameters (a layer type's own).
    pub fn rope_inv_freq_of(&self, rope: &RopeConfig) -> Vec<f32> {
        let d = self.head_dim;
        let theta = rope.theta as f32 as f64;
        let inv_freq = (0..d / 2).map(|i| {
            let exponent = (2 * i) as f32 / d as f32;
            let base_pow = theta.powf(exponent as f64) as f32;
            1.0f32 / base_pow
        });
        match rope.kind {
            RopeKind::Default => inv_freq.collect(),
            RopeKind::Linear { factor } => inv_freq.map(|f| f / factor as f32).collect(),
            RopeKind::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_context_len,
            } => {
                let low_freq_wavelen = (old_context_len / low_freq_factor) as f32;
                let high_freq_wavelen = (old_context_len / high_freq_factor) as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let factor32 = factor as f32;
                let old32 = old_context_len as f32;
                let low32 = low_freq_factor as f32;
                let band = (high_freq_factor - low_freq_factor) as f32;
                inv_freq
                    .map(|f| {
                        let wavelen = (1.0 / f) * two_pi;
                        let f_llama = if wavelen > low_freq_wavelen { f / factor32 } else { f };
                        let smooth = ((1.0 / wavelen) * old32 - low32) / band;
                        let smoothed = (1.0 - smooth) * f_llama / factor32 + smooth * f_llama;
                        // torch: ~(wavelen < high) & ~(wavelen > low); wavelen is never NaN.
                        let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                        if is_medium { smoothed } else { f_llama }
                    })
                    .collect()
            }
            RopeKind::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let (low, high) = yarn_range(
                    d,
                    rope.theta,
                    original_max_position_embeddings,
                    (beta_fast, beta_slow),
                    truncate,
                );
                let span = (high - low) as f32;
                let factor32 = factor as f32;
                (0..d / 2)
                    .map(|i| {
                        // pos_freqs = base ** (arange(0, d, 2) / d), f32; both ends from it.
                        let pos_freq = theta.powf(((2 * i) as f32 / d as f32) as f64) as f32;
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (factor32 * pos_freq);
                        let ramp = ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect()
            }
        }
    }
}

/// YaRN's ramp ends over a head of `d` dimensions (`find_correction_range`, f64 as Python
/// computes them): the dimensions whose rotations over `original` positions are `beta_fast` and
/// `beta_slow`, rounded outward when `truncate`, clamped to `[0, d - 1]`, and 0.001 apart at least.
pub fn yarn_range(
    d: usize,
    theta: f64,
    original: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> (f64, f64) {
    let dim = |rotations: f64| {
        d as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (dim(beta_fast), dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(d as f64 - 1.0));
    if low == high {
        high += 0.001;
    }
    (low, high)
}

/// YaRN's default attention factor (`get_mscale`): `0.1 mscale ln(factor) + 1` for a factor
/// over 1.
fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 { 1.0 } else { 0.1 * mscale * factor.ln() + 1.0 }
}

/// The sizes of a config, with the family's defaults where transformers has them.
struct Sizes {
    hidden_size: usize,
    num_layers: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    intermediate_size: usize,
    vocab_size: usize,
}

fn parse_sizes(o: &Keys, arch: Arch) -> Result<Sizes> {
    let origin = o.origin;
    // Gemma3TextConfig's defaults (published gemma3 `text_config`s omit several keys).
    let gemma = arch == Arch::Gemma3;
    let or_gemma = |key: &str, default: usize| -> Result<usize> {
        match o.size(key)? {
            Some(x) => Ok(x),
            None if gemma => Ok(default),
            None => o.required_size(key),
        }
    };
    let hidden_size = or_gemma("hidden_size", 2304)?;
    let num_layers = or_gemma("num_hidden_layers", 26)?;
    let num_heads = or_gemma("num_attention_heads", 8)?;
    let intermediate_size = or_gemma("intermediate_size", 9216)?;
    let vocab_size = or_gemma("vocab_size", 262_208)?;
    let num_kv_heads = o.size("num_key_value_heads")?.unwrap_or(if gemma { 4 } else { num_heads });
    if num_heads % num_kv_heads != 0 {
        bail!(
            "{origin}: num_attention_heads ({num_heads}) is not a multiple of \
             num_key_value_heads ({num_kv_heads})"
        );
    }
    let head_dim = match o.size("head_dim")? {
        Some(d) => d,
        None if gemma => 256,
        None => {
            if hidden_size % num_heads != 0 {
                bail!(
                    "{origin}: hidden_size ({hidden_size}) is not divisible by \
                     num_attention_heads ({num_heads}); hint: set 'head_dim' explicitly"
                );
            }
            hidden_size / num_heads
        }
    };
    if head_dim % 2 != 0 {
        bail!("{origin}: head_dim {head_dim} is odd; rotary embeddings need an even head_dim");
    }
    Ok(Sizes {
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        vocab_size,
    })
}

/// Keys that change a family's math: accepted values, biases (the return value: q, k and v
/// carry biases), refusals by key and value.
fn parse_family_keys(o: &Keys, arch: Arch) -> Result<bool> {
    let origin = o.origin;
    if o.bool("mlp_bias")? == Some(true) {
        bail!("{origin}: mlp_bias true is not supported (the MLP projections have no biases)");
    }
    let act_key = arch.act_key();
    let default_act = if arch == Arch::Gemma3 { "gelu_pytorch_tanh" } else { "silu" };
    let act = o.str(act_key)?.or(o.str("hidden_act")?).unwrap_or(default_act);
    // transformers maps "swish" to the same SiLU module.
    let ok = match arch {
        Arch::Gemma3 => act == "gelu_pytorch_tanh",
        _ => act == "silu" || act == "swish",
    };
    if !ok {
        bail!("{origin}: {act_key} '{act}' is not supported; supported: {default_act}");
    }
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(v) = o.get(key) {
            bail!("{origin}: {key} {v} is not supported (logit soft-capping is not implemented)");
        }
    }
    if o.bool("use_bidirectional_attention")? == Some(true) {
        bail!(
            "{origin}: use_bidirectional_attention true is not supported (causal attention only)"
        );
    }
    let attention_bias = o.bool("attention_bias")?.unwrap_or(false);
    match arch.dense() {
        Arch::Qwen2 => Ok(o.bool("qkv_bias")?.unwrap_or(true)),
        Arch::Llama | Arch::Mistral => Ok(attention_bias),
        // transformers' GptOssConfig: attention_bias true by default (q, k, v and o).
        Arch::GptOss => Ok(o.bool("attention_bias")?.unwrap_or(true)),
        Arch::Qwen3 | Arch::Gemma3 if attention_bias => bail!(
            "{origin}: attention_bias true is not supported for {} (its projections have no \
             biases)",
            arch.model_type()
        ),
        _ => Ok(false),
    }
}

/// Each layer's attention, and the window of the sliding ones. `layer_types` decides when
/// present; otherwise Mistral slides everywhere when `sliding_window` is set, Qwen2/Qwen3 from
/// `max_window_layers` on when `use_sliding_window`, Gemma 3 every layer but each
/// `sliding_window_pattern`-th.
fn parse_layer_types(
    o: &Keys,
    arch: Arch,
    layers: usize,
) -> Result<(Vec<LayerType>, Option<usize>)> {
    let origin = o.origin;
    let arch = arch.dense();
    let window = match arch {
        Arch::Qwen2 | Arch::Qwen3 if o.bool("use_sliding_window")? != Some(true) => None,
        Arch::Gemma3 => Some(o.size("sliding_window")?.unwrap_or(4096)),
        Arch::GptOss => Some(o.size("sliding_window")?.unwrap_or(128)),
        _ => o.size("sliding_window")?,
    };
    let types: Vec<LayerType> =
        if let Some(lt) = o.get("layer_types") {
            let Some(list) = lt.as_array() else {
                bail!("{origin}: layer_types must be a list, got {lt}");
            };
            if list.len() != layers {
                bail!(
                    "{origin}: layer_types has {} entries for {layers} layers (num_hidden_layers)",
                    list.len()
                );
            }
            let mut types = Vec::with_capacity(layers);
            for (i, t) in list.iter().enumerate() {
                types.push(match t.as_str() {
                    Some("full_attention") => LayerType::Full,
                    Some("sliding_attention") if window.is_some() => LayerType::Sliding,
                    Some("sliding_attention") => bail!(
                        "{origin}: layer_types[{i}] is {t} but no sliding window is set; hint: set \
                     'sliding_window' (and, for qwen, 'use_sliding_window': true)"
                    ),
                    _ => bail!(
                        "{origin}: layer_types[{i}] is {t}; supported: \"full_attention\", \
                     \"sliding_attention\""
                    ),
                });
            }
            types
        } else {
            match arch {
                Arch::Mistral if window.is_some() => vec![LayerType::Sliding; layers],
                // transformers' GptOssConfig: sliding for even layers, full for odd ones.
                Arch::GptOss => (0..layers)
                    .map(|i| if i % 2 == 0 { LayerType::Sliding } else { LayerType::Full })
                    .collect(),
                Arch::Qwen2 | Arch::Qwen3 if window.is_some() => {
                    let from = o.size("max_window_layers")?.unwrap_or(28);
                    (0..layers)
                        .map(|i| if i >= from { LayerType::Sliding } else { LayerType::Full })
                        .collect()
                }
                Arch::Gemma3 => {
                    let pattern = o.size("sliding_window_pattern")?.unwrap_or(6);
                    (0..layers)
                        .map(|i| {
                            if (i + 1) % pattern == 0 {
                                LayerType::Full
                            } else {
                                LayerType::Sliding
                            }
                        })
                        .collect()
                }
                _ => vec![LayerType::Full; layers],
            }
        };
    let window = window.filter(|_| types.contains(&LayerType::Sliding));
    Ok((types, window))
}

/// The sliding layers' own RoPE: `rope_parameters.sliding_attention`, or Gemma 3's
/// `rope_local_base_freq` (default 10000, plain RoPE).
fn parse_local_rope(o: &Keys, arch: Arch) -> Result<Option<RopeConfig>> {
    if let Some(Value::Object(p)) = o.get("rope_parameters")
        && p.contains_key("sliding_attention")
    {
        return parse_rope(o, "sliding_attention").map(Some);
    }
    if arch != Arch::Gemma3 {
        return Ok(None);
    }
    let theta = o.float("rope_local_base_freq")?.unwrap_or(10000.0);
    check_positive(o.origin, "rope_local_base_freq", theta)?;
    Ok(Some(RopeConfig { theta, kind: RopeKind::Default }))
}

/// Parses either RoPE layout: top-level `rope_theta` + `rope_scaling`, or the newer
/// `rope_parameters` object (optionally keyed by layer type: `layer_type`'s entry is used).
fn parse_rope(o: &Keys, layer_type: &str) -> Result<RopeConfig> {
    let origin = o.origin;
    let top_theta = o.float("rope_theta")?;
    let keyed = format!("rope_parameters.{layer_type}.");
    let (params, prefix) = match o.obj.get("rope_parameters").filter(|v| !v.is_null()) {
        Some(Value::Object(p)) => match p.get(layer_type) {
            Some(Value::Object(full)) => (Some(full), keyed.as_str()),
            _ => (Some(p), "rope_parameters."),
        },
        Some(other) => bail!("{origin}: rope_parameters must be an object, got {other}"),
        None => match o.obj.get("rope_scaling").filter(|v| !v.is_null()) {
            Some(Value::Object(p)) => (Some(p), "rope_scaling."),
            Some(other) => bail!("{origin}: rope_scaling must be an object or null, got {other}"),
            None => (None, ""),
        },
    };
    let Some(params) = params else {
        let theta = top_theta.unwrap_or(10000.0);
        check_positive(origin, "rope_theta", theta)?;
        return Ok(RopeConfig { theta, kind: RopeKind::Default });
    };
    let p = Keys { obj: params, origin };
    let theta = p.float("rope_theta")?.or(top_theta).unwrap_or(10000.0);
    check_positive(origin, "rope_theta", theta)?;
    let (type_key, rope_type) = match p.str("rope_type")? {
        Some(t) => ("rope_type", t),
        None => ("type", p.str("type")?.unwrap_or("default")),
    };
    let need = |key: &str| -> Result<f64> {
        let x = p.float(key)?.with_context(|| {
            format!("{origin}: missing key '{prefix}{key}' (required by rope_type '{rope_type}')")
        })?;
        check_positive(origin, &format!("{prefix}{key}"), x)?;
        Ok(x)
    };
    let kind = match rope_type {
        "default" => RopeKind::Default,
        "linear" => RopeKind::Linear { factor: need("factor")? },
        "llama3" => {
            let factor = need("factor")?;
            let low_freq_factor = need("low_freq_factor")?;
            let high_freq_factor = need("high_freq_factor")?;
            let original_max_position_embeddings = need("original_max_position_embeddings")?;
            if high_freq_factor <= low_freq_factor {
                bail!(
                    "{origin}: {prefix}high_freq_factor ({high_freq_factor}) must be greater than \
                     {prefix}low_freq_factor ({low_freq_factor})"
                );
            }
            RopeKind::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }
        }
        "yarn" => parse_yarn(&p, o, prefix, need("factor")?)?,
        other => bail!(
            "{origin}: {prefix}{type_key} '{other}' is not supported; supported: default, linear, \
             llama3, yarn"
        ),
    };
    Ok(RopeConfig { theta, kind })
}

/// YaRN's keys (`p`, under `prefix`), as `_compute_yarn_parameters` reads them:
/// `original_max_position_embeddings` (else the model's `max_position_embeddings`), `beta_fast`
/// 32 and `beta_slow` 1 by default, `truncate` true by default, `attention_factor` else
/// `get_mscale(factor)` (with `mscale` and `mscale_all_dim`, their ratio).
fn parse_yarn(p: &Keys, o: &Keys, prefix: &str, factor: f64) -> Result<RopeKind> {
    let origin = o.origin;
    let positive = |key: &str, x: f64| check_positive(origin, &format!("{prefix}{key}"), x);
    let original = match p.float("original_max_position_embeddings")? {
        Some(x) => x,
        None => o.float("max_position_embeddings")?.with_context(|| {
            format!(
                "{origin}: rope_type 'yarn' needs {prefix}original_max_position_embeddings (or \
                 max_position_embeddings)"
            )
        })?,
    };
    positive("original_max_position_embeddings", original)?;
    let beta_fast = p.float("beta_fast")?.unwrap_or(32.0);
    let beta_slow = p.float("beta_slow")?.unwrap_or(1.0);
    positive("beta_fast", beta_fast)?;
    positive("beta_slow", beta_slow)?;
    let truncate = match p.get("truncate") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => bail!("{origin}: {prefix}truncate must be true or false, got {v}"),
    };
    let attention_factor =
        match (p.float("attention_factor")?, p.float("mscale")?, p.float("mscale_all_dim")?) {
            (Some(a), _, _) => a,
            (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                yarn_mscale(factor, m) / yarn_mscale(factor, all)
            }
            _ => yarn_mscale(factor, 1.0),
        };
    positive("attention_factor", attention_factor)?;
    Ok(RopeKind::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast,
        beta_slow,
        truncate,
        attention_factor,
    })
}

fn check_positive(origin: &str, key: &str, x: f64) -> Result<()> {
    if !(x > 0.0 && x.is_finite()) {
        bail!("{origin}: {key} must be a finite number > 0, got {x}");
    }
    Ok(())
}

fn bad(origin: &str, key: &str, v: &Value) -> String {
    format!("{origin}: {key} must be a non-negative integer token id, got {v}")
}

fn as_token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

/// Typed access to the keys of one JSON object; `null` reads as absent.
pub(crate) struct Keys<'a> {
    obj: &'a Map<String, Value>,
    pub(crate) origin: &'a str,
}

impl<'a> Keys<'a> {
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn size(&self, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = v.as_u64().and_then(|n| usize::try_from(n).ok()).with_context(|| {
            format!("{}: {key} must be a positive integer, got {v}", self.origin)
        })?;
        if n == 0 {
            bail!("{}: {key} must be a positive integer, got 0", self.origin);
        }
        Ok(Some(n))
    }

    pub(crate) fn required_size(&self, key: &str) -> Result<usize> {
        self.size(key)?.with_context(|| format!("{}: missing required key '{key}'", self.origin))
    }

    pub(crate) fn float(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let x = v
            .as_f64()
            .with_context(|| format!("{}: {key} must be a number, got {v}", self.origin))?;
        Ok(Some(x))
    }

    pub(crate) fn bool(&self, key: &str) -> Result<Option<bool>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let b = v
            .as_bool()
            .with_context(|| format!("{}: {key} must be true or false, got {v}", self.origin))?;
        Ok(Some(b))
    }

    pub(crate) fn str(&self, key: &str) -> Result<Option<&'a str>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let s = v
            .as_str()
            .with_context(|| format!("{}: {key} must be a string, got {v}", self.origin))?;
        Ok(Some(s))
    }

    fn token_id(&self, key: &str) -> Result<Option<u32>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        as_token_id(v).map(Some).with_context(|| bad(self.origin, key, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixture(case: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(case)
            .join("model/config.json")
    }

    /// A minimal valid llama config to mutate in refusal tests.
    fn base() -> Value {
        json!({
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 176,
            "vocab_size": 256,
            "rope_theta": 10000.0,
            "rope_scaling": null
        })
    }

    fn parse(v: &Value) -> Result<ModelConfig> {
        ModelConfig::from_json(v, "config.json")
    }

    fn err_of(v: &Value) -> String {
        format!("{:#}", parse(v).expect_err("config should be refused"))
    }

    #[test]
    fn llama_fixture_parses() {
        let c = ModelConfig::from_file(&fixture("llama_gqa")).unwrap();
        assert_eq!(c.arch, Arch::Llama);
        assert_eq!((c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads), (64, 2, 4, 2));
        assert_eq!((c.head_dim, c.intermediate_size, c.vocab_size), (16, 176, 256));
        assert!(!c.tie_word_embeddings);
        assert!(!c.qkv_bias);
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert_eq!(c.rope, RopeConfig { theta: 10000.0, kind: RopeKind::Default });
        assert_eq!(c.max_position_embeddings, 128);
        assert_eq!(c.bos_token_id, Some(1));
        assert_eq!(c.eos_token_id, vec![2]);
    }

    #[test]
    fn qwen2_fixture_parses() {
        let c = ModelConfig::from_file(&fixture("qwen2_tied_padded")).unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers), (4, 1, 16, 3));
        assert!(c.tie_word_embeddings);
        assert!(c.qkv_bias);
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.bos_token_id, None);
        assert!(c.eos_token_id.is_empty());
    }

    #[test]
    fn both_rope_layouts_agree() {
        let scaling = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let mut old = base();
        old["rope_theta"] = json!(500000.0);
        old["rope_scaling"] = scaling.clone();
        let mut new = base();
        new.as_object_mut().unwrap().remove("rope_theta");
        new.as_object_mut().unwrap().remove("rope_scaling");
        let mut params = scaling;
        params["rope_theta"] = json!(500000.0);
        new["rope_parameters"] = params;
        let (a, b) = (parse(&old).unwrap(), parse(&new).unwrap());
        assert_eq!(a.rope, b.rope);
        assert_eq!(a.rope_inv_freq(), b.rope_inv_freq());
        // Legacy `type` key.
        let mut legacy = base();
        legacy["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
        assert_eq!(parse(&legacy).unwrap().rope.kind, RopeKind::Linear { factor: 2.0 });
        // Default layout on the fixtures matches the top-level layout.
        let fixture_cfg = ModelConfig::from_file(&fixture("llama_gqa")).unwrap();
        let mut top = fixture_cfg.raw.clone();
        top.as_object_mut().unwrap().remove("rope_parameters");
        top["rope_theta"] = json!(10000.0);
        assert_eq!(parse(&top).unwrap().rope_inv_freq(), fixture_cfg.rope_inv_freq());
    }

    #[test]
    fn default_rope_matches_definition() {
        let c = parse(&base()).unwrap();
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), 8);
        assert_eq!(f[0], 1.0);
        // 10000^(-2/16) = 0.31622776601683794 rounded to f32.
        assert_eq!(f[1], 0.316_227_76_f32);
    }

    #[test]
    fn linear_rope_divides_by_factor() {
        let plain = parse(&base()).unwrap().rope_inv_freq();
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "linear", "factor": 4.0});
        let lin = parse(&v).unwrap().rope_inv_freq();
        assert_eq!(lin.len(), plain.len());
        for (l, p) in lin.iter().zip(&plain) {
            assert_eq!(*l, p / 4.0);
        }
        // From the python mirror below: [0.25, 0.07905694097280502, 0.02500000037252903].
        assert_eq!(&lin[..3], &[0.25, 0.079_056_94, 0.025]);
    }

    /// Reference values from a plain-python mirror of transformers' `_compute_llama3_parameters`
    /// that rounds every intermediate to float32 with `struct.pack('<f', x)` (as torch does on a
    /// float32 tensor with python-scalar operands, `scalar / t` as `t.reciprocal() * scalar`),
    /// for Llama 3.1's theta 5e5, D 128, factor 8, low 1, high 4, original context 8192. Indices
    /// 0 and 20 are high frequency (unchanged), 29..=34 medium (smoothed), 35.. low (divided).
    /// gpt-oss's YaRN (head dim 16, theta 150000, factor 8 over 256 positions, no truncation),
    /// with the numbers `../shared/fixtures/README.md` states (ramp ends 0.162 and 2.488, ramp
    /// 0, 0.36, 0.79, 1, attention factor 1.2079), against the formula in f64; and the
    /// defaults: truncation on, betas 32 and 1, the original length from max_position_embeddings.
    #[test]
    fn yarn_rope_matches_its_definition() {
        let mut v = base();
        v["rope_theta"] = json!(150000.0);
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 256});
        let c = parse(&v).unwrap();
        let (low, high) = yarn_range(16, 150000.0, 256.0, (32.0, 1.0), false);
        assert!((low - 0.162).abs() < 1e-3 && (high - 2.488).abs() < 1e-3, "{low} {high}");
        let attention = ModelConfig::rope_attention_factor_of(&c.rope);
        assert!((attention as f64 - 1.2079).abs() < 1e-4, "{attention}");
        let f = c.rope_inv_freq();
        for (i, &got) in f.iter().enumerate() {
            let pos = 150000f64.powf(2.0 * i as f64 / 16.0);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let want = (1.0 / (8.0 * pos)) * ramp + (1.0 / pos) * (1.0 - ramp);
            assert!((got as f64 - want).abs() <= 1e-6 * want, "inv_freq[{i}] {got} vs {want}");
        }
        assert_eq!(f[0], 1.0, "ramp 0: extrapolation exactly");
        let pos3 = 150000f64.powf((6.0f32 / 16.0) as f64) as f32;
        assert_eq!(f[3], 1.0 / (8.0 * pos3), "ramp 1: interpolation exactly");
        // The defaults: truncation on (the ends floored and ceiled), betas 32 and 1, the
        // original length from max_position_embeddings; neither is refused by name.
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let e = format!("{:#}", parse(&v).unwrap_err());
        assert!(e.contains("rope_scaling.original_max_position_embeddings"), "{e}");
        v["max_position_embeddings"] = json!(128);
        let d = parse(&v).unwrap();
        let RopeKind::Yarn {
            truncate, beta_fast, beta_slow, original_max_position_embeddings, ..
        } = d.rope.kind
        else {
            panic!("{:?}", d.rope.kind)
        };
        let got = (truncate, beta_fast, beta_slow, original_max_position_embeddings);
        assert_eq!(got, (true, 32.0, 1.0, 128.0));
        assert_eq!(yarn_range(16, 150000.0, 128.0, (32.0, 1.0), true), (0.0, 3.0));
        // Explicit attention_factor; a bad truncate is refused by name.
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5});
        assert_eq!(ModelConfig::rope_attention_factor_of(&parse(&v).unwrap().rope), 1.5);
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0, "truncate": "no"});
        let e = format!("{:#}", parse(&v).unwrap_err());
        assert!(e.contains("rope_scaling.truncate"), "{e}");
    }

    #[test]
    fn llama3_rope_matches_reference() {
        let mut v = base();
        v["hidden_size"] = json!(512);
        v["head_dim"] = json!(128);
        v["rope_theta"] = json!(500000.0);
        v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let f = parse(&v).unwrap().rope_inv_freq();
        assert_eq!(f.len(), 64);
        let want: [(usize, u32); 9] = [
            (0, 0x3f80_0000),
            (20, 0x3c87_a9c3),
            (29, 0x3b0d_fd06),
            (30, 0x3ab3_d11d),
            (33, 0x39a3_f108),
            (34, 0x393b_2dd2),
            (35, 0x38c8_6886),
            (40, 0x380f_c8f8),
            (63, 0x34a4_c2ff),
        ];
        for (i, bits) in want {
            assert_eq!(
                f[i].to_bits(),
                bits,
                "inv_freq[{i}] = {} want {}",
                f[i],
                f32::from_bits(bits)
            );
        }
    }

    #[test]
    fn to_hf_json_round_trips() {
        let c = ModelConfig::from_file(&fixture("qwen2_tied_padded")).unwrap();
        let out = c.to_hf_json();
        assert_eq!(out["architectures"], json!(["Qwen2ForCausalLM"]));
        assert_eq!(out["head_dim"], json!(16));
        assert_eq!(out["rope_parameters"], c.raw["rope_parameters"]);
        assert!(out.get("rope_theta").is_none(), "rope layout must be kept as given");
        assert_eq!(out["eos_token_id"], Value::Null);
        let again = parse(&out).unwrap();
        assert_eq!(
            ModelConfig { raw: Value::Null, ..again },
            ModelConfig { raw: Value::Null, ..c }
        );
        let mut v = base();
        v["eos_token_id"] = json!([2, 7]);
        assert_eq!(parse(&v).unwrap().to_hf_json()["eos_token_id"], json!([2, 7]));
    }

    #[test]
    fn refusals_name_key_and_value() {
        type Mutate = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Mutate, &str)> = vec![
            (
                "model_type",
                Box::new(|v| v["model_type"] = json!("gpt2")),
                "config.json: model_type 'gpt2' is not supported; supported: llama, qwen2, mistral",
            ),
            (
                "dynamic",
                Box::new(|v| v["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 4.0})),
                "rope_scaling.rope_type 'dynamic' is not supported",
            ),
            (
                "dynamic in rope_parameters",
                Box::new(|v| v["rope_parameters"] = json!({"rope_type": "dynamic", "factor": 2.0})),
                "rope_parameters.rope_type 'dynamic' is not supported",
            ),
            (
                "gelu",
                Box::new(|v| v["hidden_act"] = json!("gelu")),
                "hidden_act 'gelu' is not supported",
            ),
            (
                "softcapping",
                Box::new(|v| v["final_logit_softcapping"] = json!(30.0)),
                "final_logit_softcapping 30.0 is not supported",
            ),
            (
                "gemma activation",
                Box::new(|v| {
                    v["model_type"] = json!("gemma3_text");
                    v["hidden_activation"] = json!("gelu");
                }),
                "hidden_activation 'gelu' is not supported",
            ),
            (
                "qwen3 bias",
                Box::new(|v| {
                    v["model_type"] = json!("qwen3");
                    v["attention_bias"] = json!(true);
                }),
                "attention_bias true is not supported for qwen3",
            ),
            (
                "layer_types length",
                Box::new(|v| v["layer_types"] = json!(["full_attention"])),
                "layer_types has 1 entries for 2 layers",
            ),
            (
                "gemma3 without text_config",
                Box::new(|v| v["model_type"] = json!("gemma3")),
                "a gemma3 config needs a 'text_config' object",
            ),
            (
                "missing key",
                Box::new(|v| {
                    v.as_object_mut().unwrap().remove("intermediate_size");
                }),
                "missing required key 'intermediate_size'",
            ),
            (
                "zero size",
                Box::new(|v| v["vocab_size"] = json!(0)),
                "vocab_size must be a positive integer, got 0",
            ),
            (
                "kv heads",
                Box::new(|v| v["num_key_value_heads"] = json!(3)),
                "num_attention_heads (4) is not a multiple of num_key_value_heads (3)",
            ),
            (
                "head_dim",
                Box::new(|v| {
                    v["num_attention_heads"] = json!(3);
                    v["num_key_value_heads"] = json!(1);
                }),
                "hidden_size (64) is not divisible by num_attention_heads (3)",
            ),
            ("mlp_bias", Box::new(|v| v["mlp_bias"] = json!(true)), "mlp_bias"),
            (
                "layer_types",
                Box::new(|v| v["layer_types"] = json!(["full_attention", "sliding_attention"])),
                "layer_types[1] is \"sliding_attention\"",
            ),
            (
                "llama3 missing key",
                Box::new(|v| v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0})),
                "missing key 'rope_scaling.low_freq_factor'",
            ),
            ("wrong type", Box::new(|v| v["hidden_size"] = json!("64")), "hidden_size must be"),
        ];
        for (what, mutate, want) in cases {
            let mut v = base();
            mutate(&mut v);
            let msg = err_of(&v);
            assert!(msg.contains(want), "{what}: got {msg:?}, want it to contain {want:?}");
        }
    }

    #[test]
    fn accepted_variants() {
        // head_dim explicit and null; mistral without a window; qwen2 ignores attention_bias.
        let mut v = base();
        v["head_dim"] = Value::Null;
        assert_eq!(parse(&v).unwrap().head_dim, 16);
        v["head_dim"] = json!(32);
        assert_eq!(parse(&v).unwrap().head_dim, 32);
        let mut v = base();
        v["model_type"] = json!("mistral");
        v["sliding_window"] = Value::Null;
        assert_eq!(parse(&v).unwrap().arch, Arch::Mistral);
        let mut v = base();
        v["model_type"] = json!("qwen2");
        assert!(parse(&v).unwrap().qkv_bias);
        let mut v = base();
        v.as_object_mut().unwrap().remove("num_key_value_heads");
        assert_eq!(parse(&v).unwrap().num_kv_heads, 4);
    }

    #[test]
    fn sliding_windows_by_family() {
        // Mistral: every layer slides when sliding_window is set.
        let mut v = base();
        v["model_type"] = json!("mistral");
        v["sliding_window"] = json!(4096);
        let c = parse(&v).unwrap();
        assert_eq!(c.layer_types, vec![LayerType::Sliding; 2]);
        assert_eq!(c.sliding_window, Some(4096));
        // Qwen2: from max_window_layers on, only with use_sliding_window.
        let mut v = base();
        v["model_type"] = json!("qwen2");
        v["sliding_window"] = json!(64);
        assert_eq!(parse(&v).unwrap().layer_types, vec![LayerType::Full; 2]);
        assert_eq!(parse(&v).unwrap().sliding_window, None);
        v["use_sliding_window"] = json!(true);
        v["max_window_layers"] = json!(1);
        assert_eq!(parse(&v).unwrap().layer_types, vec![LayerType::Full, LayerType::Sliding]);
        // layer_types decides where present.
        let mut v = base();
        v["sliding_window"] = json!(8);
        v["layer_types"] = json!(["sliding_attention", "full_attention"]);
        assert_eq!(parse(&v).unwrap().layer_types, vec![LayerType::Sliding, LayerType::Full]);
    }

    #[test]
    fn gemma3_layouts_agree() {
        // The fixture's layer_types + rope_parameters per type, and the older layout of
        // published checkpoints: sliding_window_pattern + rope_theta + rope_local_base_freq.
        let new = ModelConfig::from_file(&fixture("gemma3_sliding")).unwrap();
        assert_eq!(new.arch, Arch::Gemma3);
        assert!(new.tie_word_embeddings);
        assert_eq!(new.query_pre_attn_scalar, Some(16.0));
        let mut old = new.raw.clone();
        let o = old.as_object_mut().unwrap();
        for k in ["layer_types", "rope_parameters", "_sliding_window_pattern"] {
            o.remove(k);
        }
        o.insert("sliding_window_pattern".into(), json!(3));
        o.insert("rope_theta".into(), json!(1e6));
        o.insert("rope_local_base_freq".into(), json!(1e4));
        let old = parse(&old).unwrap();
        assert_eq!(old.layer_types, new.layer_types);
        assert_eq!(old.rope, new.rope);
        assert_eq!(old.rope_local, new.rope_local);
        assert_eq!(new.rope_local.unwrap().theta, 1e4);
        assert_eq!(new.rope.theta, 1e6);
        // Inside a multimodal gemma3 config: the text_config, tensors under language_model.
        let mm = json!({"model_type": "gemma3", "text_config": new.raw.clone(), "eos_token_id": 1});
        let mm = parse(&mm).unwrap();
        assert_eq!(mm.tensor_prefix, "language_model.");
        assert_eq!(mm.layer_types, new.layer_types);
        assert_eq!(mm.to_hf_json()["hidden_activation"], json!("gelu_pytorch_tanh"));
    }

    #[test]
    fn qwen3_fixture_parses() {
        let c = ModelConfig::from_file(&fixture("qwen3_qknorm")).unwrap();
        assert_eq!(c.arch, Arch::Qwen3);
        assert_eq!((c.head_dim, c.num_heads, c.hidden_size), (32, 4, 64));
        assert!(!c.qkv_bias && !c.tie_word_embeddings);
        assert_eq!(c.layer_types, vec![LayerType::Full; 3]);
    }

    #[test]
    fn from_file_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let msg = format!("{:#}", ModelConfig::from_file(&path).unwrap_err());
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        std::fs::write(&path, "{not json").unwrap();
        let msg = format!("{:#}", ModelConfig::from_file(&path).unwrap_err());
        assert!(msg.contains(&path.display().to_string()) && msg.contains("JSON"), "{msg}");
    }
}
