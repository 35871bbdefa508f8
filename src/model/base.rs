//! The frozen base of an adapter run in host RAM, in its stored form: every tensor the
//! adapters do not train, bf16 or fp32 as the run says (`adapter.base_dtype`), and for QLoRA
//! the decoder's product matrices as NF4 words (`horizon_backend::nf4`: 4 bits per value and
//! one fp32 absmax per 64). It needs no gradient, no moments and no master copy; each layer
//! streams to the device from here as it is stored.
//!
//! Per buffer (embedding, layers, final norm, untied head): the frozen part of the layer's slot
//! (`LayerSpec::frozen` weights, in slot order) and the layer's packed words
//! (`LayerSpec::packed`).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use horizon_backend::{Bf16, CpuBackend, mxfp4, nf4};
use rayon::prelude::*;

use crate::hf::checkpoint::{Checkpoint, NonFinite};
use crate::model::layout::{EMBED, FINAL_NORM, LM_HEAD, ModelLayout};
use crate::model::lora::BaseDtype;
use crate::model::spec::{Init, Stored, TensorSpec};
use crate::rng::SplitMix64;

/// A base's content hash: [`crate::hash`] over each tensor's name and content hash, in name
/// order, as 16 hex digits. It depends on every stored byte, dtype and shape of the tensors,
/// never on where the files are, how the tensors are split into shards, or the thread count.
pub fn base_hash(tensors: &BTreeMap<String, u64>) -> String {
    let mut h = crate::hash::Stream::new();
    for (name, t) in tensors {
        h.feed(name.as_bytes());
        h.feed(&[0]);
        h.feed(&t.to_le_bytes());
    }
    format!("{:016x}", h.finish())
}

/// Frozen values in their dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Frozen {
    F32(Vec<f32>),
    Bf16(Vec<Bf16>),
}

impl Frozen {
    /// `len` zeros of `dtype`.
    pub fn zeros(dtype: BaseDtype, len: usize) -> Self {
        match dtype {
            BaseDtype::F32 => Frozen::F32(vec![0.0; len]),
            BaseDtype::Bf16 => Frozen::Bf16(vec![Bf16(0); len]),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Frozen::F32(v) => v.len(),
            Frozen::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        match self {
            Frozen::F32(v) => v.len() * 4,
            Frozen::Bf16(v) => v.len() * 2,
        }
    }

    /// Elements `at..at + src.len()` from fp32 (rounded to nearest even for bf16).
    pub fn set(&mut self, at: usize, src: &[f32]) {
        match self {
            Frozen::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            Frozen::Bf16(v) => {
                horizon_backend::bf16::round_to_bf16(&mut v[at..at + src.len()], src)
            }
        }
    }

    /// Elements `at..at + out.len()` as fp32 (exact).
    pub fn get(&self, at: usize, out: &mut [f32]) {
        match self {
            Frozen::F32(v) => out.copy_from_slice(&v[at..at + out.len()]),
            Frozen::Bf16(v) => horizon_backend::bf16::expand_bf16(out, &v[at..at + out.len()]),
        }
    }
}

/// The frozen base of an adapter run.
#[derive(Clone, Debug, PartialEq)]
pub struct FrozenBase {
    pub dtype: BaseDtype,
    /// (V, C)
    pub embed: Frozen,
    /// Per layer, the frozen part of its slot.
    pub layers: Vec<Frozen>,
    /// Per layer, its NF4 words (empty without quantisation).
    pub packed: Vec<Vec<u32>>,
    /// (C)
    pub final_norm: Frozen,
    /// (V, C), `None` when the head is tied to the embedding.
    pub lm_head: Option<Frozen>,
}

impl FrozenBase {
    /// Zeros shaped by `layout` (an adapter layout).
    pub fn zeros(layout: &ModelLayout, dtype: BaseDtype) -> Self {
        let d = layout.dims;
        FrozenBase {
            dtype,
            embed: Frozen::zeros(dtype, d.v * d.c),
            layers: (0..d.layers).map(|i| Frozen::zeros(dtype, layout.layer(i).frozen)).collect(),
            packed: (0..d.layers).map(|i| vec![0; layout.layer(i).packed]).collect(),
            final_norm: Frozen::zeros(dtype, d.c),
            lm_head: (!layout.tied).then(|| Frozen::zeros(dtype, d.v * d.c)),
        }
    }

    /// Host bytes it holds.
    pub fn bytes(&self) -> usize {
        let frozen = self.layers.iter().map(Frozen::bytes).sum::<usize>();
        let packed = self.packed.iter().map(|p| p.len() * 4).sum::<usize>();
        self.embed.bytes()
            + frozen
            + packed
            + self.final_norm.bytes()
            + self.lm_head.as_ref().map_or(0, Frozen::bytes)
    }

    /// The base of `layout` from a HF checkpoint: each tensor read (any supported dtype),
    /// kept in `dtype`, the packed ones quantised to NF4 as bitsandbytes does; and its content
    /// hash ([`base_hash`] of each tensor's [`Checkpoint::read_f32_hashed`], computed in the
    /// read's own pass over the bytes: no second read). Missing or misshapen tensors are errors
    /// naming them.
    pub fn load_hf(
        layout: &ModelLayout,
        dir: &Path,
        dtype: BaseDtype,
        non_finite: NonFinite,
    ) -> Result<(Self, String)> {
        let mut ckpt = Checkpoint::open(dir)?;
        if let Some(m) = &layout.moe {
            let d = layout.dims;
            crate::hf::moe::read_fused_as_hub(&mut ckpt, m, (&layout.prefix, d.layers, d.c))?;
        }
        let tensors = layout.base_tensors();
        let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
        let optional: Vec<String> = if layout.tied { vec![LM_HEAD.to_string()] } else { vec![] };
        ckpt.check_names_under(&layout.prefix, &names, &optional)?;
        ckpt.check_shapes_under(&layout.prefix, &tensors)?;
        let mut base = FrozenBase::zeros(layout, dtype);
        let mut hashes = BTreeMap::new();
        let mut read = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let (name, mut v) =
                (format!("{}{name}", layout.prefix), vec![0.0; shape.iter().product()]);
            hashes.insert(name.clone(), ckpt.read_f32_hashed(&name, shape, &mut v, non_finite)?);
            Ok(v)
        };
        let d = layout.dims;
        base.embed.set(0, &read(EMBED, &[d.v, d.c])?);
        base.final_norm.set(0, &read(FINAL_NORM, &[d.c])?);
        if let Some(h) = &mut base.lm_head {
            h.set(0, &read(LM_HEAD, &[d.v, d.c])?);
        }
        let mut packed_hashes = Vec::new();
        for i in 0..d.layers {
            for t in layout.layer(i).frozen_tensors() {
                let name = ModelLayout::layer_name(i, &t.name);
                if t.stored == Stored::Mxfp4 {
                    let packed = crate::hf::moe::gpt_oss_packed(&ckpt, &layout.prefix, i, &t.name)?;
                    let (blocks, scales) = packed.expect("MXFP4 tensors are gpt-oss experts");
                    let tiles = [crate::hash::of(&blocks), crate::hash::of(&scales)];
                    let h = crate::hf::checkpoint::tensor_hash(&name, "MXFP4", &t.shape, &tiles);
                    packed_hashes.push((format!("{}{name}", layout.prefix), h));
                    mxfp4::to_words(&blocks, &scales, &mut base.packed[i][t.range()]);
                    continue;
                }
                let v = read(&name, &t.shape)?;
                base.put(i, t, &v);
            }
        }
        hashes.extend(packed_hashes);
        Ok((base, base_hash(&hashes)))
    }

    /// Layer `i`'s frozen tensor `t` from fp32 values (quantised when it is packed).
    pub fn put(&mut self, i: usize, t: &TensorSpec, v: &[f32]) {
        match t.stored {
            Stored::Slot => self.layers[i].set(t.offset, v),
            Stored::Nf4 => nf4::to_words(&nf4::quantize(v), &mut self.packed[i][t.range()]),
            Stored::Mxfp4 => {
                let (blocks, scales) = mxfp4::quantize(v);
                mxfp4::to_words(&blocks, &scales, &mut self.packed[i][t.range()])
            }
        }
    }

    /// Layer `i`'s frozen tensor `t` as fp32 (dequantised when it is packed).
    pub fn tensor_f32(&self, i: usize, t: &TensorSpec) -> Vec<f32> {
        let mut out = vec![0.0; t.numel()];
        match t.stored {
            Stored::Slot => self.layers[i].get(t.offset, &mut out),
            Stored::Nf4 => {
                let words = words_as_f32(&self.packed[i][t.range()]);
                horizon_backend::Backend::dequantize_nf4(&CpuBackend, &mut out, words, t.numel())
            }
            Stored::Mxfp4 => {
                let words = words_as_f32(&self.packed[i][t.range()]);
                horizon_backend::Backend::dequantize_mxfp4(&CpuBackend, &mut out, words, t.numel())
            }
        }
        out
    }

    /// A random base, as `ParamStore::random` initialises a model (normal(0, `std`) matrices,
    /// norm weights by their init), each tensor from its own stream; packed tensors are
    /// drawn in fp32, then quantised.
    pub fn random(layout: &ModelLayout, dtype: BaseDtype, seed: u64, std: f32) -> Self {
        let mut base = FrozenBase::zeros(layout, dtype);
        let d = layout.dims;
        let draw = |n: usize, init: Init, stream: u64| -> Vec<f32> {
            let mut v = vec![0.0; n];
            match init {
                Init::Ones => v.fill(1.0),
                Init::Zeros => {}
                _ => fill_normal_parallel(&mut v, seed ^ stream.wrapping_mul(0x9E37_79B9), std),
            }
            v
        };
        base.embed.set(0, &draw(d.v * d.c, Init::Normal, 1));
        base.final_norm.set(0, &draw(d.c, layout.final_norm_init(), 2));
        if let Some(h) = &mut base.lm_head {
            h.set(0, &draw(d.v * d.c, Init::Normal, 3));
        }
        for i in 0..d.layers {
            let spec = layout.layer(i);
            for (k, t) in spec.frozen_tensors().enumerate() {
                let stream = 1000 + (i * 64 + k) as u64;
                if t.stored == Stored::Mxfp4 {
                    let words = &mut base.packed[i][t.range()];
                    random_mxfp4(words, t.numel(), seed ^ stream.wrapping_mul(0x9E37_79B9), std);
                    continue;
                }
                let v = draw(t.numel(), t.init, stream);
                base.put(i, t, &v);
            }
        }
        base
    }
}

/// A random MXFP4 tensor of `n` values in its device form `words`: uniform random codes, every
/// block's scale the power of two nearest `std / 2.93` (the codes' RMS), so the values have
/// about the standard deviation `std` of `ParamStore::random`'s matrices. Drawn directly (no
/// fp32 values to quantise): a gpt-oss-120b-sized base is 63 GB of codes.
fn random_mxfp4(words: &mut [u32], n: usize, seed: u64, std: f32) {
    let rms = (mxfp4::FP4.iter().map(|v| v * v).sum::<f32>() / 16.0).sqrt();
    let scale = (127.0 + (std / rms).log2().round()).clamp(1.0, 252.0) as u32;
    let (codes, scales) = words.split_at_mut(n / 8);
    codes.par_chunks_mut(1 << 18).enumerate().for_each(|(k, c)| {
        let mut rng = SplitMix64::new(seed ^ (k as u64).wrapping_mul(0xA24B_AED4_963E_E407));
        c.iter_mut().for_each(|w| *w = rng.next_u64() as u32);
    });
    scales.fill(scale * 0x0101_0101);
}

/// normal(0, `std`) in parallel chunks of 1 Mi values, each from its own stream: deterministic
/// whatever the thread count.
fn fill_normal_parallel(out: &mut [f32], seed: u64, std: f32) {
    out.par_chunks_mut(1 << 20).enumerate().for_each(|(k, c)| {
        SplitMix64::new(seed ^ (k as u64).wrapping_mul(0xA24B_AED4_963E_E407)).fill_normal(c, std)
    });
}

/// NF4 words as the f32 bit patterns the device pool holds them in (no copy: an upload moves
/// the bits unchanged).
pub fn words_as_f32(words: &[u32]) -> &[f32] {
    // SAFETY: u32 and f32 have the same size and alignment and every bit pattern is a valid
    // f32; the slice's length and lifetime carry over unchanged.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<f32>(), words.len()) }
}
