//! `horizon generate`: a quick look at what a model writes, on the CPU backend or a GPU. Greedy
//! decoding or temperature / top-p (nucleus) sampling, streaming text as tokens come.
//!
//! The prompt runs as one step of the KV-cached decoder (`model/kv_cache.rs`), then each new
//! token as one more: one forward of one position per token. On CUDA the layers stream through
//! one weight slot (bf16) with the cache on the device; on the CPU they stay resident. The full
//! recompute (a whole forward of the sequence per token, the reference path) stays available as
//! [`Decode::FullRecompute`], to check the cache against.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use horizon_backend::cuda::{CudaBackend, KernelShape, check_kernel_limits};
use horizon_backend::{CpuBackend, DeviceAlloc, Precision};

use crate::engine::options::BackendKind;
use crate::hf::config::ModelConfig;
use crate::model::base::FrozenBase;
use crate::model::kv_cache::{KvDecoder, Residency};
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::model::spec::Op;
use crate::model::transformer::{Capacity, Tokens, Transformer};
use crate::rng::SplitMix64;
use crate::tokenizer::{HfTokenizer, Message, Tokenizer};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug)]
pub struct SampleOptions {
    /// Tokens to generate at most (generation also stops at an end-of-sequence token).
    pub max_new_tokens: usize,
    /// 0 = greedy (the most likely token); otherwise logits are divided by this.
    pub temperature: f64,
    /// Sample from the smallest set of tokens whose probabilities sum to at least this (1 = all).
    pub top_p: f64,
    /// Seed of the sampling.
    pub seed: u64,
}

impl SampleOptions {
    /// Greedy decoding of at most `max_new_tokens`.
    pub fn greedy(max_new_tokens: usize) -> Self {
        SampleOptions { max_new_tokens, temperature: 0.0, top_p: 1.0, seed: 0 }
    }

    fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            bail!("--temperature must be >= 0, 0 = greedy (got {})", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1] (got {})", self.top_p);
        }
        Ok(())
    }
}

/// What [`Generator::generate_ids`] calls after each new token: the tokenizer and the ids so far.
pub type OnIds<'a> = dyn FnMut(&dyn Tokenizer, &[u32]) -> Result<()> + 'a;

/// How each new token's logits are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decode {
    /// The KV-cached decoder on a backend: the prompt in one step, then one position per token.
    KvCache(BackendKind),
    /// A whole forward of the sequence per token on the CPU reference path (no cache).
    FullRecompute,
}

/// The runner of a [`Decode`] mode, with the sequence length (and, cached, the step length) its
/// buffers hold.
enum Runner {
    None,
    Full(usize, Box<Transformer<CpuBackend>>),
    KvCpu(Box<KvDecoder<CpuBackend>>),
    KvCuda(Box<KvDecoder<CudaBackend>>, usize),
}

/// A model ready to generate: fp32 weights, tokenizer, and a decoder whose buffers are sized for
/// the longest sequence asked for so far.
pub struct Generator {
    model_cfg: ModelConfig,
    /// The model's layout: with an adapter's LoRA when one is used unmerged.
    layout: ModelLayout,
    /// The adapter's frozen base (`None`: every weight in `params`).
    base: Option<Arc<FrozenBase>>,
    params: ParamStore,
    tok: Box<dyn Tokenizer>,
    decode: Decode,
    runner: Runner,
    /// Ids that end generation: the tokenizer's EOS and `generation_config.json`'s.
    stop_ids: Vec<u32>,
    /// (V) scratch for the last position's logits.
    logits: Vec<f32>,
}

impl Generator {
    /// A generator over given weights and tokenizer.
    pub fn new(model_cfg: &ModelConfig, params: ParamStore, tok: Box<dyn Tokenizer>) -> Self {
        let stop_ids = tok.eos_id().into_iter().collect();
        let logits = vec![0.0; model_cfg.vocab_size];
        let decode = Decode::KvCache(BackendKind::Cpu);
        let runner = Runner::None;
        let layout = crate::model::describe(model_cfg);
        let model_cfg = model_cfg.clone();
        Generator { model_cfg, layout, base: None, params, tok, decode, runner, stop_ids, logits }
    }

    /// Load a HF directory and a LoRA adapter over it (`OUT/final` of an adapter run, or a
    /// PEFT directory), used as it is: the frozen base (NF4 when the adapter was trained with
    /// QLoRA, the weights it was trained against) with the adapters' products beside it, not
    /// merged.
    pub fn load_with_adapter(dir: &Path, adapter: &Path) -> Result<Self> {
        if !dir.join("config.json").is_file() {
            bail!("--model {}: no config.json, not a Hugging Face model directory", dir.display());
        }
        let auto = crate::adapter::BaseDtype::Auto;
        let (run, _) = crate::run::load::load_adapter_run(adapter, Some(dir), auto)?;
        // The tokenizer the adapter was trained with when its directory carries one (an
        // adapter run's final/ does), else the model's.
        let adapter_dir = crate::run::load::adapter_dir(adapter)?;
        let tok_dir = match adapter_dir.join("tokenizer.json").is_file() {
            true => adapter_dir.as_path(),
            false => dir,
        };
        let tok = HfTokenizer::from_dir(tok_dir).with_context(|| {
            format!("--model {}: no tokenizer (tokenizer.json)", tok_dir.display())
        })?;
        let mut g = Generator::new(&run.cfg, run.params, Box::new(tok));
        g.layout = run.layout;
        g.base = run.base.map(Arc::new);
        g.stop_ids.extend(generation_config_eos(dir)?);
        Ok(g)
    }

    /// Decode with `decode` from now on (default: the KV cache on the CPU).
    pub fn set_decode(&mut self, decode: Decode) {
        if decode != self.decode {
            self.decode = decode;
            self.runner = Runner::None;
        }
    }

    /// Load a HF directory (`config.json`, safetensors, `tokenizer.json`).
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.join("config.json").is_file() {
            bail!(
                "--model {}: no config.json, not a Hugging Face model directory\nhint: point --model at OUT/final or at a directory written by `horizon export`",
                dir.display()
            );
        }
        let model_cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let params = ParamStore::load_hf(&crate::model::describe(&model_cfg), dir)?;
        let tok = HfTokenizer::from_dir(dir).with_context(|| {
            format!(
                "--model {}: no tokenizer\nhint: export with `horizon export` (it writes the tokenizer files), or copy tokenizer.json into the directory",
                dir.display()
            )
        })?;
        let mut g = Generator::new(&model_cfg, params, Box::new(tok));
        g.stop_ids.extend(generation_config_eos(dir)?);
        Ok(g)
    }

    /// Replace the ids that end generation (by default the tokenizer's EOS and
    /// `generation_config.json`'s).
    pub fn set_stop_ids(&mut self, ids: Vec<u32>) {
        self.stop_ids = ids;
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &dyn Tokenizer {
        self.tok.as_ref()
    }

    /// The longest sequence (prompt + generated) the model takes.
    pub fn max_len(&self) -> usize {
        self.model_cfg.max_position_embeddings.max(1)
    }

    /// The ids of `prompt`: as plain text (with BOS when the tokenizer adds one), or as one user
    /// turn (after an optional system turn) rendered with the chat template, ready for the
    /// assistant's answer.
    pub fn prompt_ids(&self, prompt: &str, chat: bool, system: Option<&str>) -> Result<Vec<u32>> {
        if !chat {
            let mut ids: Vec<u32> = Vec::new();
            if self.tok.add_bos_token() {
                ids.extend(self.tok.bos_id());
            }
            ids.extend(self.tok.encode(prompt)?);
            return Ok(ids);
        }
        let Some(template) = self.tok.chat() else {
            bail!(
                "--chat: the tokenizer has no chat template\nhint: add chat_template to tokenizer_config.json, or drop --chat"
            );
        };
        let mut msgs = Vec::new();
        if let Some(s) = system {
            msgs.push(Message::new("system", s));
        }
        msgs.push(Message::new("user", prompt));
        self.tok.encode(&template.render(&msgs, true)?)
    }

    /// Continue `ids`; `on_text` receives the text as it grows (decoded pieces, never a split
    /// UTF-8 character). Returns the generated text.
    pub fn generate(
        &mut self,
        ids: &[u32],
        opts: SampleOptions,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<String> {
        let mut shown = 0usize;
        let new_ids = self.generate_ids(ids, opts, &mut |tok, new_ids| {
            let text = tok.decode(new_ids, true)?;
            // Hold back a trailing replacement character: the rest of its bytes may follow.
            let ready = text.trim_end_matches('\u{FFFD}');
            if ready.len() > shown && text.is_char_boundary(shown) {
                on_text(&ready[shown..]);
                shown = ready.len();
            }
            Ok(())
        })?;
        let text = self.tok.decode(&new_ids, true)?;
        if text.len() > shown && text.is_char_boundary(shown) {
            on_text(&text[shown..]);
        }
        Ok(text)
    }

    /// Continue `ids`; `on_ids` sees the tokenizer and the generated ids after each new one.
    /// Returns them (a stop id ends generation and is not returned).
    pub fn generate_ids(
        &mut self,
        ids: &[u32],
        opts: SampleOptions,
        on_ids: &mut OnIds<'_>,
    ) -> Result<Vec<u32>> {
        opts.check()?;
        if ids.is_empty() {
            bail!("the prompt is empty (no tokens to continue)");
        }
        if opts.max_new_tokens == 0 {
            return Ok(Vec::new());
        }
        let max_len = ids.len().saturating_add(opts.max_new_tokens).min(self.max_len());
        if ids.len() >= max_len {
            bail!(
                "the prompt has {} tokens; the model takes at most {} in all\nhint: shorten the prompt",
                ids.len(),
                self.max_len()
            );
        }
        self.prepare(max_len, ids.len())?;
        let vocab = self.logits.len();
        let mut seq: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let mut new_ids: Vec<u32> = Vec::new();
        let mut rng = SplitMix64::new(opts.seed);
        let mut order: Vec<usize> = Vec::with_capacity(vocab);
        while new_ids.len() < opts.max_new_tokens && seq.len() < max_len {
            // The cache holds every position but the last `fresh` (the whole prompt at first).
            let fresh = &seq[if new_ids.is_empty() { 0 } else { seq.len() - 1 }..];
            let (params, logits) = (&self.params, &mut self.logits);
            match &mut self.runner {
                Runner::Full(_, tr) => {
                    let t = seq.len();
                    let (targets, mask) = (vec![-100; t], vec![1.0; t]);
                    let tokens = Tokens { b: 1, t, ids: &seq, targets: &targets, mask: &mask };
                    tr.last_logits(params, tokens, logits)?;
                }
                Runner::KvCpu(kv) => kv.step(params, fresh, logits)?,
                Runner::KvCuda(kv, _) => kv.step(params, fresh, logits)?,
                Runner::None => unreachable!("prepared above"),
            }
            let next = sample(&mut self.logits, &opts, &mut rng, &mut order) as u32;
            if self.stop_ids.contains(&next) {
                break;
            }
            new_ids.push(next);
            seq.push(next as i32);
            on_ids(self.tok.as_ref(), &new_ids)?;
        }
        Ok(new_ids)
    }

    /// Greedy continuation of `ids` by up to `max_new_tokens` ids, without decoding text (for
    /// comparing decode modes).
    pub fn greedy_ids(&mut self, ids: &[u32], max_new_tokens: usize) -> Result<Vec<u32>> {
        self.generate_ids(ids, SampleOptions::greedy(max_new_tokens), &mut |_, _| Ok(()))
    }

    /// A runner for sequences of `max_len` positions whose first step has `prompt` positions,
    /// reusing the current one where it is large enough; a cached runner starts a new sequence.
    fn prepare(&mut self, max_len: usize, prompt: usize) -> Result<()> {
        let cfg = &self.model_cfg;
        let fits = match &self.runner {
            Runner::None => false,
            Runner::Full(cap, _) => *cap >= max_len,
            Runner::KvCpu(kv) => kv.max_len() >= max_len && kv.max_step() >= prompt,
            Runner::KvCuda(kv, _) => kv.max_len() >= max_len && kv.max_step() >= prompt,
        };
        if !fits {
            self.runner = match self.decode {
                Decode::FullRecompute => {
                    let cap = Capacity { batch: 1, seq_len: max_len, head_chunk_rows: 1 };
                    let (layout, base) = (self.layout.clone(), self.base.clone());
                    let t = Transformer::with_layout(CpuBackend, layout, base, cap);
                    Runner::Full(max_len, Box::new(t))
                }
                Decode::KvCache(BackendKind::Cpu) => {
                    let (layout, base) = (self.layout.clone(), self.base.clone());
                    let sizes = (max_len, prompt);
                    let kv = KvDecoder::with_layout(
                        CpuBackend,
                        layout,
                        base,
                        sizes,
                        Residency::Resident,
                    );
                    Runner::KvCpu(Box::new(kv))
                }
                Decode::KvCache(BackendKind::Cuda) => {
                    let layout = crate::model::describe(cfg);
                    let d = &layout.dims;
                    let (c, h, kvh, hd, f, v) = (d.c, d.h, d.kvh, d.d, d.f, d.v);
                    let shape = KernelShape { c, h, kvh, d: hd, f, v, b: 1, t: max_len };
                    check_kernel_limits(&shape).context("--device cuda")?;
                    let ws = Precision::Bf16.workspace(decode_product_bytes(&layout, prompt));
                    // Reuse the GPU context and compiled kernels when the workspace still fits.
                    let old = match std::mem::replace(&mut self.runner, Runner::None) {
                        Runner::KvCuda(kv, bytes) if bytes >= ws.bytes => Some(*kv),
                        _ => None,
                    };
                    let make = || CudaBackend::new(0, ws.bytes).map_err(|e| anyhow::anyhow!("{e}"));
                    let model = (self.layout.clone(), self.base.clone());
                    let kv = rebuilt(old, make, model, (max_len, prompt), Residency::Streamed)?;
                    Runner::KvCuda(Box::new(kv), ws.bytes)
                }
            };
        }
        match &mut self.runner {
            Runner::KvCpu(kv) => kv.begin(&self.params),
            Runner::KvCuda(kv, _) => kv.begin(&self.params),
            Runner::Full(..) | Runner::None => {}
        }
        Ok(())
    }
}

/// A decoder of the given sizes on `old`'s backend, or on a new one from `make`.
fn rebuilt<B: DeviceAlloc>(
    old: Option<KvDecoder<B>>,
    make: impl FnOnce() -> Result<B>,
    (layout, base): (ModelLayout, Option<Arc<FrozenBase>>),
    sizes: (usize, usize),
    residency: Residency,
) -> Result<KvDecoder<B>> {
    let be = match old {
        Some(kv) => kv.into_backend(),
        None => make()?,
    };
    Ok(KvDecoder::with_layout(be, layout, base, sizes, residency))
}

/// The largest bf16 product workspace a decode step of `rows` positions needs: the layers'
/// products and attention over `rows`, the head's product over one row.
fn decode_product_bytes(layout: &ModelLayout, rows: usize) -> usize {
    let d = layout.dims;
    let layers = layout.kinds.iter().flat_map(|k| &k.ops).flat_map(|op| match *op {
        Op::Linear { ic, oc, .. } => vec![Precision::Bf16.product_bytes(rows, ic, oc)],
        Op::Experts { i, c, .. } => [(c, 2 * i), (i, c)]
            .map(|(ic, oc)| Precision::Bf16.product_bytes(rows, ic, oc))
            .to_vec(),
        _ => vec![],
    });
    let attention = crate::engine::sizes::attention_bytes(layout, rows, Precision::Bf16);
    layers.chain([Precision::Bf16.product_bytes(1, d.c, d.v)]).chain(attention).max().unwrap_or(0)
}

/// `eos_token_id` of a HF directory's `generation_config.json` (a number or a list), if any.
fn generation_config_eos(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", path.display()))?;
    Ok(match &v["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_u64().map(|x| x as u32).into_iter().collect(),
        serde_json::Value::Array(a) => {
            a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()
        }
        _ => Vec::new(),
    })
}

/// The next token from `logits` (V), which it overwrites: greedy at temperature 0 (the first
/// maximum), else softmax(logits / temperature) restricted to the top-p nucleus. `order` is
/// scratch.
pub fn sample(
    logits: &mut [f32],
    opts: &SampleOptions,
    rng: &mut SplitMix64,
    order: &mut Vec<usize>,
) -> usize {
    let argmax = logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |m, (i, &x)| if x > m.1 { (i, x) } else { m })
        .0;
    if opts.temperature == 0.0 {
        return argmax;
    }
    let max = logits[argmax] as f64;
    let mut total = 0.0f64;
    for x in logits.iter_mut() {
        let p = ((*x as f64 - max) / opts.temperature).exp();
        *x = p as f32;
        total += p;
    }
    order.clear();
    order.extend(0..logits.len());
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    // The nucleus: the most likely tokens until their mass reaches top_p.
    let (mut kept, mut mass) = (0usize, 0.0f64);
    for &i in order.iter() {
        kept += 1;
        mass += logits[i] as f64 / total;
        if mass >= opts.top_p {
            break;
        }
    }
    let nucleus = &order[..kept];
    let sum: f64 = nucleus.iter().map(|&i| logits[i] as f64).sum();
    let mut u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * sum;
    for &i in nucleus {
        u -= logits[i] as f64;
        if u < 0.0 {
            return i;
        }
    }
    *nucleus.last().expect("the nucleus holds at least one token")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut l = vec![0.1, 3.0, -1.0, 3.0];
        let mut order = Vec::new();
        let got = sample(&mut l, &SampleOptions::greedy(1), &mut SplitMix64::new(0), &mut order);
        assert_eq!(got, 1);
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities about 0.64, 0.24, 0.09, 0.03: top_p 0.8 keeps the first two.
        let base = [2.0f32, 1.0, 0.0, -1.0];
        let opts = SampleOptions { max_new_tokens: 1, temperature: 1.0, top_p: 0.8, seed: 0 };
        let mut rng = SplitMix64::new(7);
        let mut counts = [0usize; 4];
        let mut order = Vec::new();
        for _ in 0..4000 {
            let mut l = base.to_vec();
            counts[sample(&mut l, &opts, &mut rng, &mut order)] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
        // Renormalised: 0.64 / 0.88 = 0.73 of the draws are token 0.
        let f0 = counts[0] as f64 / 4000.0;
        assert!((f0 - 0.731).abs() < 0.03, "{counts:?}");
        // top_p 1 samples everything, in proportion.
        let all = SampleOptions { top_p: 1.0, ..opts };
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            let mut l = base.to_vec();
            counts[sample(&mut l, &all, &mut rng, &mut order)] += 1;
        }
        assert!(counts.iter().all(|&c| c > 0), "{counts:?}");
    }
}
