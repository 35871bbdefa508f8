//! The model description read from a Hugging Face `config.json` (llama, qwen2, mistral), validated,
//! and written back for export.
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

/// Decoder architecture, from `model_type`. All three are the same pre-norm decoder (RMSNorm,
/// rotate-half RoPE, grouped-query attention, SwiGLU MLP); they differ only in defaults and biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Mistral,
}

impl Arch {
    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Mistral => "mistral",
        }
    }

    /// The transformers class written to `architectures`.
    pub fn causal_lm_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
        }
    }

    /// transformers' default for `max_position_embeddings` when the key is absent.
    fn default_max_position_embeddings(self) -> usize {
        match self {
            Arch::Llama => 2048,
            Arch::Qwen2 => 32768,
            Arch::Mistral => 4096 * 32,
        }
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
    /// Rotary embedding parameters.
    pub rope: RopeConfig,
    /// `max_position_embeddings` (architecture default when absent).
    pub max_position_embeddings: usize,
    /// `bos_token_id`, if any.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`: HF writes an int or a list; empty when null or absent.
    pub eos_token_id: Vec<u32>,
    /// The original JSON object, kept so export can write it back.
    pub raw: Value,
}

const SUPPORTED: &str = "llama, qwen2, mistral";

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
    /// error message.
    pub fn from_json(v: &Value, origin: &str) -> Result<Self> {
        let Some(obj) = v.as_object() else {
            bail!("{origin}: expected a JSON object at the top level");
        };
        let o = Keys { obj, origin };

        let model_type = o.str("model_type")?.with_context(|| {
            format!("{origin}: missing key 'model_type' (supported: {SUPPORTED})")
        })?;
        let arch = match model_type {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "mistral" => Arch::Mistral,
            other => {
                bail!("{origin}: model_type '{other}' is not supported; supported: {SUPPORTED}")
            }
        };

        let hidden_size = o.required_size("hidden_size")?;
        let num_layers = o.required_size("num_hidden_layers")?;
        let num_heads = o.required_size("num_attention_heads")?;
        let intermediate_size = o.required_size("intermediate_size")?;
        let vocab_size = o.required_size("vocab_size")?;
        let num_kv_heads = o.size("num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads % num_kv_heads != 0 {
            bail!(
                "{origin}: num_attention_heads ({num_heads}) is not a multiple of \
                 num_key_value_heads ({num_kv_heads})"
            );
        }
        let head_dim = match o.size("head_dim")? {
            Some(d) => d,
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
        let max_position_embeddings =
            o.size("max_position_embeddings")?.unwrap_or(arch.default_max_position_embeddings());

        let rms_norm_eps = o.float("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps >= 0.0 && rms_norm_eps.is_finite()) {
            bail!("{origin}: rms_norm_eps must be a finite number >= 0, got {rms_norm_eps}");
        }
        let tie_word_embeddings = o.bool("tie_word_embeddings")?.unwrap_or(false);

        let qkv_bias = match arch {
            Arch::Qwen2 => true,
            Arch::Llama | Arch::Mistral => o.bool("attention_bias")?.unwrap_or(false),
        };
        if o.bool("mlp_bias")? == Some(true) {
            bail!("{origin}: mlp_bias true is not supported (the MLP projections have no biases)");
        }
        let act = o.str("hidden_act")?.unwrap_or("silu");
        // transformers maps "swish" to the same SiLU module.
        if act != "silu" && act != "swish" {
            bail!("{origin}: hidden_act '{act}' is not supported; supported: silu");
        }

        match arch {
            Arch::Mistral => {
                if let Some(w) = obj.get("sliding_window").filter(|w| !w.is_null()) {
                    bail!(
                        "{origin}: sliding_window {w} is not supported (only full causal \
                         attention); hint: set \"sliding_window\": null if the model was trained \
                         without a window"
                    );
                }
            }
            Arch::Qwen2 => {
                if o.bool("use_sliding_window")? == Some(true) {
                    bail!(
                        "{origin}: use_sliding_window true is not supported (only full causal \
                         attention)"
                    );
                }
            }
            Arch::Llama => {}
        }
        if let Some(lt) = obj.get("layer_types").filter(|v| !v.is_null()) {
            let Some(list) = lt.as_array() else {
                bail!("{origin}: layer_types must be a list, got {lt}");
            };
            if let Some((i, t)) =
                list.iter().enumerate().find(|(_, t)| t.as_str() != Some("full_attention"))
            {
                bail!(
                    "{origin}: layer_types[{i}] is {t}; only \"full_attention\" layers are \
                     supported"
                );
            }
        }

        let rope = parse_rope(&o)?;
        let bos_token_id = o.token_id("bos_token_id")?;
        let eos_token_id = match obj.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|id| as_token_id(id).with_context(|| bad(origin, "eos_token_id", id)))
                .collect::<Result<_>>()?,
            Some(id) => vec![as_token_id(id).with_context(|| bad(origin, "eos_token_id", id))?],
        };

        Ok(ModelConfig {
            arch,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            rms_norm_eps,
            vocab_size,
            tie_word_embeddings,
            qkv_bias,
            rope,
            max_position_embeddings,
            bos_token_id,
            eos_token_id,
            raw: v.clone(),
        })
    }

    /// `raw` with the derived fields written back, so transformers loads the exported model as
    /// Horizon understood it. The RoPE keys are kept in the layout they were given in.
    pub fn to_hf_json(&self) -> Value {
        let mut obj = self.raw.as_object().cloned().unwrap_or_default();
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
        set("hidden_act", "silu".into());
        if self.arch != Arch::Qwen2 {
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

    /// RoPE inverse frequencies, length D/2, bit-for-bit as transformers computes them in float32
    /// (`_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
    /// `_compute_llama3_parameters`). torch casts Python scalars to float32 before each op and
    /// `scalar / tensor` is `tensor.reciprocal() * scalar`; both are mirrored here.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let theta = self.rope.theta as f32 as f64;
        let inv_freq = (0..d / 2).map(|i| {
            let exponent = (2 * i) as f32 / d as f32;
            let base_pow = theta.powf(exponent as f64) as f32;
            1.0f32 / base_pow
        });
        match self.rope.kind {
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
        }
    }

    /// Number of parameters, counting a tied embedding once.
    pub fn num_params(&self) -> usize {
        let (c, h, kvh, d, f, v) = (
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.vocab_size,
        );
        let attn = c * h * d + 2 * c * kvh * d + h * d * c;
        let bias = if self.qkv_bias { h * d + 2 * kvh * d } else { 0 };
        let layer = attn + bias + 3 * c * f + 2 * c;
        let lm_head = if self.tie_word_embeddings { 0 } else { v * c };
        v * c + self.num_layers * layer + c + lm_head
    }
}

/// Parses either RoPE layout: top-level `rope_theta` + `rope_scaling`, or the newer
/// `rope_parameters` object (optionally keyed by layer type, of which `full_attention` is used).
fn parse_rope(o: &Keys) -> Result<RopeConfig> {
    let origin = o.origin;
    let top_theta = o.float("rope_theta")?;
    let (params, prefix) = match o.obj.get("rope_parameters").filter(|v| !v.is_null()) {
        Some(Value::Object(p)) => match p.get("full_attention") {
            Some(Value::Object(full)) => (Some(full), "rope_parameters.full_attention."),
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
        other => bail!(
            "{origin}: {prefix}{type_key} '{other}' is not supported; supported: default, linear, \
             llama3"
        ),
    };
    Ok(RopeConfig { theta, kind })
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
struct Keys<'a> {
    obj: &'a Map<String, Value>,
    origin: &'a str,
}

impl<'a> Keys<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn size(&self, key: &str) -> Result<Option<usize>> {
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

    fn required_size(&self, key: &str) -> Result<usize> {
        self.size(key)?.with_context(|| format!("{}: missing required key '{key}'", self.origin))
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let x = v
            .as_f64()
            .with_context(|| format!("{}: {key} must be a number, got {v}", self.origin))?;
        Ok(Some(x))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let b = v
            .as_bool()
            .with_context(|| format!("{}: {key} must be true or false, got {v}", self.origin))?;
        Ok(Some(b))
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
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
    fn num_params_counts_fixture_tensors() {
        // llama_gqa: V*C + L*(attn + mlp + norms) + C + untied head.
        let c = ModelConfig::from_file(&fixture("llama_gqa")).unwrap();
        let layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 176 + 2 * 64;
        assert_eq!(c.num_params(), 2 * 256 * 64 + 2 * layer + 64);
        // qwen2: tied, with q/k/v biases.
        let c = ModelConfig::from_file(&fixture("qwen2_tied_padded")).unwrap();
        let layer = 64 * 64 + 2 * 64 * 16 + 64 * 64 + (64 + 2 * 16) + 3 * 64 * 128 + 2 * 64;
        assert_eq!(c.num_params(), 320 * 64 + 3 * layer + 64);
        // And both agree with the element count of the fixture checkpoints.
        for case in ["llama_gqa", "qwen2_tied_padded"] {
            let c = ModelConfig::from_file(&fixture(case)).unwrap();
            let dir = fixture(case).parent().unwrap().to_path_buf();
            let ckpt = crate::hf::checkpoint::Checkpoint::open(&dir).unwrap();
            let numel: usize =
                ckpt.names().iter().map(|n| ckpt.shape(n).unwrap().iter().product::<usize>()).sum();
            assert_eq!(c.num_params(), numel, "{case}");
        }
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
                "yarn",
                Box::new(|v| v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0})),
                "rope_scaling.rope_type 'yarn' is not supported",
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
                "mistral sliding window",
                Box::new(|v| {
                    v["model_type"] = json!("mistral");
                    v["sliding_window"] = json!(4096);
                }),
                "sliding_window 4096 is not supported",
            ),
            (
                "qwen2 sliding window",
                Box::new(|v| {
                    v["model_type"] = json!("qwen2");
                    v["use_sliding_window"] = json!(true);
                }),
                "use_sliding_window true is not supported",
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
