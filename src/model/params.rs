//! Host-resident flat parameter buffers: one `Vec<f32>` per decoder layer plus embedding, final
//! norm and LM head. The same type holds master weights, gradients and AdamW moments, all sized
//! from one [`ModelLayout`].

use std::path::Path;

use anyhow::{Context, Result};

use crate::hf::checkpoint::{Checkpoint, NonFinite, SaveDtype, write_safetensors};
use crate::model::layout::{EMBED, FINAL_NORM, LM_HEAD, ModelLayout};
use crate::model::spec::Init;
use crate::rng::SplitMix64;

/// The name of buffer `i` of a model of `layers` layers (the order of [`ParamStore::buffers`]):
/// the HF module it holds, `model.embed_tokens`, `model.layers.{i}`, `model.norm` or `lm_head`.
pub fn buffer_name(layers: usize, i: usize) -> String {
    let module = |tensor: &str| tensor.trim_end_matches(".weight").to_string();
    match i {
        0 => module(EMBED),
        i if i <= layers => ModelLayout::layer_name(i - 1, "").trim_end_matches('.').to_string(),
        i if i == layers + 1 => module(FINAL_NORM),
        _ => module(LM_HEAD),
    }
}

/// A full set of model-shaped fp32 buffers in host RAM.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamStore {
    /// (V, C)
    pub embed: Vec<f32>,
    /// L buffers, each its layer's `LayerSpec::len`.
    pub layers: Vec<Vec<f32>>,
    /// (C)
    pub final_norm: Vec<f32>,
    /// (V, C), `None` when the head is tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
}

impl ParamStore {
    /// All zeros, shaped by `layout`.
    /// (The trained part: in an adapter run the embedding, final norm and head buffers are
    /// empty and each layer's holds its adapters.)
    pub fn zeros(layout: &ModelLayout) -> Self {
        let d = &layout.dims;
        let base = if layout.trains_base() { 1 } else { 0 };
        ParamStore {
            embed: vec![0.0; base * d.v * d.c],
            layers: (0..d.layers).map(|i| vec![0.0; layout.layer(i).train_len()]).collect(),
            final_norm: vec![0.0; base * d.c],
            lm_head: (!layout.tied).then(|| vec![0.0; base * d.v * d.c]),
        }
    }

    /// The same shape with every buffer empty (a store that holds nothing, e.g. fp32 moments
    /// in `optimizer.memory: compact`).
    pub fn empty_like(other: &ParamStore) -> Self {
        ParamStore {
            embed: Vec::new(),
            layers: vec![Vec::new(); other.layers.len()],
            final_norm: Vec::new(),
            lm_head: other.lm_head.as_ref().map(|_| Vec::new()),
        }
    }

    /// Zeros shaped like `self`; with `no_layers`, the decoder layers' buffers are empty
    /// (the host gradients of `optimizer.memory: lean | compact`: embedding, final norm and
    /// head only).
    pub fn zeros_like(&self, no_layers: bool) -> Self {
        ParamStore {
            embed: vec![0.0; self.embed.len()],
            layers: self
                .layers
                .iter()
                .map(|l| if no_layers { Vec::new() } else { vec![0.0; l.len()] })
                .collect(),
            final_norm: vec![0.0; self.final_norm.len()],
            lm_head: self.lm_head.as_ref().map(|h| vec![0.0; h.len()]),
        }
    }

    /// Every buffer, in a fixed order (embedding, layers, final norm, head).
    pub fn buffers(&self) -> Vec<&[f32]> {
        let mut v: Vec<&[f32]> = vec![&self.embed];
        v.extend(self.layers.iter().map(|l| l.as_slice()));
        v.push(&self.final_norm);
        if let Some(h) = &self.lm_head {
            v.push(h);
        }
        v
    }

    /// Every buffer, mutably, in the order of [`ParamStore::buffers`].
    pub fn buffers_mut(&mut self) -> Vec<&mut [f32]> {
        let mut v: Vec<&mut [f32]> = vec![&mut self.embed];
        v.extend(self.layers.iter_mut().map(|l| l.as_mut_slice()));
        v.push(&mut self.final_norm);
        if let Some(h) = &mut self.lm_head {
            v.push(h);
        }
        v
    }

    /// Buffer `i` in the order of [`ParamStore::buffers`] (no allocation).
    pub fn buffer(&self, i: usize) -> &[f32] {
        let l = self.layers.len();
        match i {
            0 => &self.embed,
            i if i <= l => &self.layers[i - 1],
            i if i == l + 1 => &self.final_norm,
            _ => self.lm_head.as_ref().expect("buffer index past the last buffer"),
        }
    }

    /// Buffer `i` in the order of [`ParamStore::buffers`] (no allocation).
    pub fn buffer_mut(&mut self, i: usize) -> &mut [f32] {
        let l = self.layers.len();
        match i {
            0 => &mut self.embed,
            i if i <= l => &mut self.layers[i - 1],
            i if i == l + 1 => &mut self.final_norm,
            _ => self.lm_head.as_mut().expect("buffer index past the last buffer"),
        }
    }

    /// Set every element to zero (no allocation).
    pub fn fill_zero(&mut self) {
        for b in self.buffers_mut() {
            b.fill(0.0);
        }
    }

    /// The slice holding HF tensor `name`, if the layout has it.
    pub fn tensor(&self, layout: &ModelLayout, name: &str) -> Option<&[f32]> {
        match name {
            EMBED | FINAL_NORM | LM_HEAD if !layout.trains_base() => None,
            EMBED => Some(&self.embed),
            FINAL_NORM => Some(&self.final_norm),
            LM_HEAD => self.lm_head.as_deref(),
            _ => {
                let (i, spec) = find_layer_tensor(layout, name)?;
                Some(&self.layers[i][spec])
            }
        }
    }

    /// Mutable slice of HF tensor `name`.
    pub fn tensor_mut(&mut self, layout: &ModelLayout, name: &str) -> Option<&mut [f32]> {
        match name {
            EMBED | FINAL_NORM | LM_HEAD if !layout.trains_base() => None,
            EMBED => Some(&mut self.embed),
            FINAL_NORM => Some(&mut self.final_norm),
            LM_HEAD => self.lm_head.as_deref_mut(),
            _ => {
                let (i, spec) = find_layer_tensor(layout, name)?;
                Some(&mut self.layers[i][spec])
            }
        }
    }

    /// Load fp32 master weights from a HF checkpoint directory. Missing, unexpected or wrongly
    /// shaped tensors are errors naming the tensor and file. With tied embeddings a stored
    /// `lm_head.weight` is accepted and ignored (HF writes it for some tied models). A NaN or
    /// ±inf value is an error naming the tensor, its index and the value.
    pub fn load_hf(layout: &ModelLayout, dir: &Path) -> Result<Self> {
        Self::load_hf_with(layout, dir, NonFinite::Refuse)
    }

    /// [`ParamStore::load_hf`], with what to do about a NaN or ±inf weight
    /// (`model.allow_non_finite`; `load_hf` refuses one, naming the tensor and the index).
    pub fn load_hf_with(layout: &ModelLayout, dir: &Path, non_finite: NonFinite) -> Result<Self> {
        let mut ckpt = Checkpoint::open(dir)?;
        if let Some(m) = &layout.moe {
            let d = layout.dims;
            crate::hf::moe::read_fused_as_hub(&mut ckpt, m, (&layout.prefix, d.layers, d.c))?;
        }
        let tensors = layout.hf_tensors();
        let expected: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
        let optional: Vec<String> = if layout.tied { vec![LM_HEAD.to_string()] } else { vec![] };
        ckpt.check_names_under(&layout.prefix, &expected, &optional)?;
        ckpt.check_shapes_under(&layout.prefix, &tensors)?;
        let mut store = ParamStore::zeros(layout);
        for (name, shape) in &tensors {
            let dst = store.tensor_mut(layout, name).expect("layout names its own tensors");
            ckpt.read_f32(&format!("{}{name}", layout.prefix), shape, dst, non_finite)?;
        }
        Ok(store)
    }

    /// Write every tensor under its HF name as one safetensors file.
    pub fn save_safetensors(
        &self,
        layout: &ModelLayout,
        path: &Path,
        dtype: SaveDtype,
    ) -> Result<()> {
        let tensors: Vec<(String, Vec<usize>, &[f32])> = layout
            .hf_tensors()
            .into_iter()
            .map(|(name, shape)| {
                let data = self.tensor(layout, &name).expect("layout names its own tensors");
                (name, shape, data)
            })
            .collect();
        write_safetensors(path, &tensors, dtype)
            .with_context(|| format!("writing weights to {}", path.display()))
    }
}

/// Parse `model.layers.{i}.{suffix}` into the layer index and the range in its flat buffer
/// (the layer's trained part; `None` for a frozen tensor).
fn find_layer_tensor(layout: &ModelLayout, name: &str) -> Option<(usize, std::ops::Range<usize>)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (idx, suffix) = rest.split_once('.')?;
    let i: usize = idx.parse().ok()?;
    if i >= layout.dims.layers {
        return None;
    }
    let spec = layout.layer(i);
    let t = spec.trained().find(|t| t.name == suffix)?;
    Some((i, t.offset - spec.frozen..t.offset - spec.frozen + t.numel()))
}

impl ParamStore {
    /// A randomly initialised model, as HF initialises one: every tensor as its description's
    /// `Init` says (matrices from normal(0, `std`), norm weights 1, or 0 where the norm adds 1,
    /// biases 0). Deterministic in `seed`, and independent of the thread count (each buffer has
    /// its own stream).
    pub fn random(layout: &ModelLayout, seed: u64, std: f32) -> Self {
        use rayon::prelude::*;
        let mut store = ParamStore::zeros(layout);
        let mut bufs = store.buffers_mut();
        bufs.par_iter_mut().enumerate().for_each(|(i, buf)| {
            let mut rng = SplitMix64::new(seed ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407));
            rng.fill_normal(buf, std);
        });
        drop(bufs);
        // A LoRA A: PEFT's init, one stream per (layer, tensor).
        let fill = |buf: &mut [f32], t: &crate::model::spec::TensorSpec, stream: u64| match t.init {
            Init::Normal => {}
            Init::Ones => buf.fill(1.0),
            Init::Zeros => buf.fill(0.0),
            Init::KaimingUniform => crate::model::lora::init_a(buf, t.shape[1], seed, stream),
        };
        if layout.trains_base() {
            match layout.final_norm_init() {
                Init::Ones => store.final_norm.fill(1.0),
                _ => store.final_norm.fill(0.0),
            }
        }
        for (i, l) in store.layers.iter_mut().enumerate() {
            let spec = layout.layer(i);
            for (k, t) in spec.trained().enumerate() {
                let r = t.offset - spec.frozen..t.offset - spec.frozen + t.numel();
                fill(&mut l[r], t, (i * 1024 + k) as u64);
            }
        }
        store
    }
}
