//! The KV-cached decoder of `horizon generate`: one forward per new token. Each layer keeps the
//! fused q|k|v rows (after rope) of every position so far on the backend's device; a step runs
//! the new positions only, layer by layer through the same description interpreter as training
//! (`layer_forward_cached`), with each layer's weights uploaded into one weight slot (streamed,
//! as the engine borrows layers) or kept resident, then the final norm and the LM head on the
//! last position.
//!
//! Data flow of a step over positions `pos..pos + t` (one sequence):
//! `ids (t) -> embedding rows (host) -> x (t, C) -> [layer l: upload weights, ops; attention:
//! qkv rows -> cache_l[pos..pos + t], new queries over cache_l[0..pos + t]] -> final norm of the
//! last row -> logits (V)`.
//!
//! The cache stores whole q|k|v rows (the q part unused after its step), so appending is one
//! contiguous copy on any backend: (T_max, QKV) per layer.

use anyhow::{Result, bail};
use horizon_backend::{DeviceAlloc, DeviceSlice};

use crate::hf::config::ModelConfig;
use std::sync::Arc;

use crate::model::base::FrozenBase;
use crate::model::layer::{KvStep, Rows, Slot, act_slots, layer_forward_cached};
use crate::model::layout::ModelLayout;
use crate::model::moe::{MoeHost, MoeIo};
use crate::model::params::ParamStore;
use crate::model::transformer::{
    LayerUpload, embed_rows_of, layer_weights, rope_tables, upload_head, upload_layer, v, vm,
};

/// Where the decoder keeps the layers' weights between steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// One weight slot; every step uploads each layer into it (the device holds one layer).
    Streamed,
    /// Every layer uploaded once, at [`KvDecoder::begin`] (the CPU backend, whose device is
    /// host memory).
    Resident,
}

/// A KV-cached decoder on backend `B`, its buffers allocated once for sequences of up to
/// `max_len` positions and steps of up to `max_step` new positions.
pub struct KvDecoder<B: DeviceAlloc> {
    be: B,
    layout: ModelLayout,
    max_len: usize,
    max_step: usize,
    /// Per rope table: (T_max, D/2) cos and sin.
    ropes: Vec<(B::Mem, B::Mem)>,
    /// An adapter's frozen base (`None`: every weight in the `ParamStore`).
    base: Option<Arc<FrozenBase>>,
    /// One weight slot (largest layer), or one per layer ([`Residency::Resident`]); with each,
    /// its packed NF4 words (QLoRA); the dequantisation workspace.
    slots: Vec<B::WMem>,
    packed: Vec<B::Mem>,
    ws: B::WMem,
    /// Host scratch for frozen weights expanded to fp32 (empty without a base).
    scratch: Vec<f32>,
    /// The layer's own activations, (max_step, width) each.
    acts: Vec<B::Mem>,
    /// (max_step, C) the residual stream: input and output of the current layer.
    x: B::Mem,
    y: B::Mem,
    /// Per layer: (T_max, QKV) the q|k|v rows of every position so far.
    cache: Vec<B::Mem>,
    /// (C) final norm weight, (V, C) LM head weight: uploaded at `begin`.
    norm_w: B::WMem,
    head_w: B::WMem,
    /// (C) final norm output of the last row, (1) its rstd, (V) its logits.
    hf: B::Mem,
    rstd: B::Mem,
    logits: B::Mem,
    /// Host: (max_step, C) the new rows' embeddings.
    host_x: Vec<f32>,
    /// Positions in the cache.
    pos: usize,
    /// A sparse model's dispatch sort scratch.
    moe: MoeHost,
}

impl<B: DeviceAlloc> KvDecoder<B> {
    /// Allocate every buffer once.
    pub fn new(
        be: B,
        cfg: &ModelConfig,
        max_len: usize,
        max_step: usize,
        residency: Residency,
    ) -> Self {
        Self::with_layout(be, crate::model::describe(cfg), None, (max_len, max_step), residency)
    }

    /// [`KvDecoder::new`] for `layout` (an adapter's, over its frozen `base`).
    pub fn with_layout(
        be: B,
        layout: ModelLayout,
        base: Option<Arc<FrozenBase>>,
        (max_len, max_step): (usize, usize),
        residency: Residency,
    ) -> Self {
        let d = layout.dims;
        let layout_moe = layout.moe.as_ref().map(|m| (m.top_k, m.num_experts));
        let (max_len, max_step) = (max_len.max(1), max_step.clamp(1, max_len.max(1)));
        let ropes = layout
            .rope
            .iter()
            .map(|table| {
                let (cos_h, sin_h) = rope_tables(table, max_len);
                let (mut cos, mut sin) = (be.alloc(cos_h.len()), be.alloc(sin_h.len()));
                be.upload(&mut cos, &cos_h);
                be.upload(&mut sin, &sin_h);
                (cos, sin)
            })
            .collect();
        let (slots, packed) = match residency {
            Residency::Streamed => (
                vec![be.alloc_weights(layout.max_layer_len())],
                vec![be.alloc(layout.max_packed())],
            ),
            Residency::Resident => (0..d.layers)
                .map(|l| (be.alloc_weights(layout.layer(l).len), be.alloc(layout.layer(l).packed)))
                .unzip(),
        };
        let scratch = if base.is_some() {
            vec![0.0; (d.v * d.c).max(layout.max_layer_len())]
        } else {
            vec![]
        };
        let acts = layout.max_act_widths().iter().map(|w| be.alloc(max_step * w)).collect();
        let cache = (0..d.layers).map(|_| be.alloc(max_len * d.qkv())).collect();
        KvDecoder {
            ws: be.alloc_weights(layout.max_workspace()),
            base,
            packed,
            scratch,
            slots,
            acts,
            cache,
            x: be.alloc(max_step * d.c),
            y: be.alloc(max_step * d.c),
            norm_w: be.alloc_weights(d.c),
            head_w: be.alloc_weights(d.v * d.c),
            hf: be.alloc(d.c),
            rstd: be.alloc(1),
            logits: be.alloc(d.v),
            host_x: vec![0.0; max_step * d.c],
            ropes,
            layout,
            max_len,
            max_step,
            pos: 0,
            moe: match &layout_moe {
                Some((k, e)) => MoeHost::new(max_step * k, *e),
                None => MoeHost::default(),
            },
            be,
        }
    }

    /// The longest sequence the cache holds.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The most new positions one step takes.
    pub fn max_step(&self) -> usize {
        self.max_step
    }

    /// The backend, for a decoder of other sizes.
    pub fn into_backend(self) -> B {
        self.be
    }

    /// Start a new sequence with `params`: empty the cache, upload the final norm and the head
    /// (and, resident, every layer).
    pub fn begin(&mut self, params: &ParamStore) {
        self.pos = 0;
        let m = (self.base.as_deref(), params);
        let heads = (&mut self.norm_w, &mut self.head_w);
        upload_head(&self.be, &self.layout, m, heads, &mut self.scratch);
        if self.slots.len() > 1 {
            for l in 0..self.slots.len() {
                self.upload(params, l, l);
            }
        }
    }

    /// Layer `l`'s weights into slot `slot`.
    fn upload(&mut self, params: &ParamStore, l: usize, slot: usize) {
        let (w, packed) = (&mut self.slots[slot], &mut self.packed[slot]);
        let mut to = LayerUpload { w, packed, scratch: &mut self.scratch };
        upload_layer(&self.be, &self.layout, (self.base.as_deref(), params), l, &mut to);
    }

    /// Run the positions of `ids` (appended to the sequence, at most `max_step` at a time) and
    /// write the logits (V) of the last one into `out`. `params` must be those of `begin`.
    pub fn step(&mut self, params: &ParamStore, ids: &[i32], out: &mut [f32]) -> Result<()> {
        let (d, t, pos) = (self.layout.dims, ids.len(), self.pos);
        if t == 0 || t > self.max_step || pos + t > self.max_len {
            bail!(
                "a decode step of {t} positions after {pos}: the decoder holds at most {} per \
                 step and {} in all",
                self.max_step,
                self.max_len
            );
        }
        let nc = t * d.c;
        embed_rows_of(&mut self.host_x[..nc], ids, (self.base.as_deref(), params), &self.layout);
        self.be.upload(vm(&mut self.x, nc), &self.host_x[..nc]);
        let half = d.d / 2;
        for l in 0..d.layers {
            let slot = if self.slots.len() > 1 {
                l
            } else {
                self.upload(params, l, 0);
                0
            };
            let spec = self.layout.layer(l);
            let ropes: Vec<(&B::Buf, &B::Buf)> = self
                .ropes
                .iter()
                .map(|(c, s)| {
                    let r = pos * half..(pos + t) * half;
                    (c.slice(r.clone()), s.slice(r))
                })
                .collect();
            let mut slots = act_slots(
                v(&self.x, nc),
                Slot::W(vm(&mut self.y, nc)),
                self.acts.iter_mut().map(|m| &mut **m),
            );
            let kv = KvStep { cache: &mut *self.cache[l], pos };
            let mut w =
                layer_weights::<B>(spec, &self.slots[slot], &self.packed[slot], &mut self.ws);
            let host = &mut self.moe;
            w.moe = Some(MoeIo { host, mask: None, stats: None, grad: None });
            layer_forward_cached(&self.be, spec, &mut slots, &mut w, &ropes, Rows { b: 1, t }, kv);
            drop(slots);
            std::mem::swap(&mut self.x, &mut self.y);
        }
        self.be.rmsnorm_forward(
            &mut self.hf,
            &mut self.rstd,
            self.x.slice((t - 1) * d.c..t * d.c),
            &self.norm_w,
            self.layout.final_norm(),
        );
        self.be.matmul_forward(&mut self.logits, &self.hf, &self.head_w, None, 1, d.c, d.v);
        self.be.download(out, &self.logits);
        self.pos += t;
        Ok(())
    }
}
