//! The decoder-only transformer step, layer by layer, as Horizon runs it: host RAM holds the
//! parameters; each layer's weights are uploaded to the backend for the op that uses them; the
//! forward pass keeps only layer-boundary checkpoints (in host memory); backward walks the
//! layers from last to first, recomputes a layer's internals from its checkpoint and runs the
//! hand-written backward ops. No autograd.
//!
//! What a layer computes is its family's description (`model/families/`), run by
//! `model/layer.rs`; this file owns the buffers of the reference path and the head pass.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use anyhow::{Result, bail};
use horizon_backend::{Backend, CpuBackend, DeviceAlloc, DeviceSlice, Dinp, NormDims};

use crate::hf::config::ModelConfig;
use crate::model::base::{Frozen, FrozenBase, words_as_f32};
use crate::model::layer::{
    Packed, Rows, Slot, Weights, act_slots, grad_slots, layer_backward, layer_forward,
};
use crate::model::layout::{ModelLayout, RopeTable};
use crate::model::moe::{MoeHost, MoeIo, aux_loss};
use crate::model::params::ParamStore;

/// The rows of one pass as the model takes them: `b` rows of `t` positions, right-padded, with
/// each position's next token (shifted targets).
#[derive(Clone, Copy, Debug)]
pub struct Tokens<'a> {
    /// Rows (B).
    pub b: usize,
    /// Positions per row (T).
    pub t: usize,
    /// (B*T) token ids.
    pub ids: &'a [i32],
    /// (B*T) the next token of each position, -100 where no loss is taken.
    pub targets: &'a [i32],
    /// (B*T) 1 on real tokens, 0 on padding.
    pub mask: &'a [f32],
}

impl Tokens<'_> {
    /// Positions that carry a loss (targets other than -100).
    pub fn num_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t != -100).count()
    }
}

/// What one forward+backward pass over a batch produced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PassOutput {
    /// Sum over loss-carrying positions of `-log p(target)`, accumulated in f64.
    pub loss_sum: f64,
    /// Number of loss-carrying positions.
    pub num_targets: usize,
    /// A mixture of experts' load-balancing loss (unscaled), and the coefficient it carries in
    /// the trained objective (0: reported only).
    pub aux: Option<(f64, f64)>,
}

impl PassOutput {
    /// The trained objective as HF reports it: the causal-LM loss (mean over loss-carrying
    /// positions) plus the coefficient times the load-balancing loss.
    pub fn loss(&self) -> f64 {
        self.ce_loss() + self.aux.map_or(0.0, |(aux, coef)| coef * aux)
    }

    /// The causal-LM loss alone.
    pub fn ce_loss(&self) -> f64 {
        self.loss_sum / self.num_targets.max(1) as f64
    }
}

/// Sizes the device workspace is built for.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    /// Largest batch (rows) a pass may carry.
    pub batch: usize,
    /// Largest sequence length.
    pub seq_len: usize,
    /// Rows of the LM head + cross-entropy chunk: the (rows, V) logits never exceed this.
    pub head_chunk_rows: usize,
}

/// The step runner: owns the backend, the device workspace (allocated once, sized by
/// [`Capacity`]) and the host checkpoint buffers.
pub struct Transformer<B: DeviceAlloc> {
    be: B,
    pub layout: ModelLayout,
    cap: Capacity,
    /// Per rope table: (T_max, D/2) cos and sin.
    ropes: Vec<(B::Mem, B::Mem)>,
    /// One layer's weights on the device, (largest layer len), in the backend's precision.
    w: B::WMem,
    /// An adapter run's frozen base (`None`: full fine-tuning, every weight in the masters).
    base: Option<Arc<FrozenBase>>,
    /// A quantised layer's NF4 words, and the workspace a packed weight is dequantised into.
    packed: B::Mem,
    ws: B::WMem,
    /// One layer's parameter gradients on the device, (largest layer's trained part).
    dw: B::Mem,
    /// The layer's own activations, (N, width) each (the widest over the layer kinds).
    acts: Vec<B::Mem>,
    /// (N, C) the residual gradient: of the layer output, then of its input.
    dres: B::Mem,
    /// The gradient scratch of the backward program (after `dres`).
    grads: Vec<B::Mem>,
    /// (N, C) residual stream: input of the current layer.
    x: B::Mem,
    /// (N, C) residual stream: output of the current layer.
    y: B::Mem,
    /// (C) final norm weight, and its gradient.
    norm_w: B::WMem,
    dnorm_w: B::Mem,
    /// (N, C) final norm output, and its gradient.
    hf: B::Mem,
    dhf: B::Mem,
    /// (N) final norm rstd.
    rstd_f: B::Mem,
    /// (V, C) LM head weight, and its gradient.
    head_w: B::WMem,
    dhead_w: B::Mem,
    /// (chunk, V) logits, then dlogits.
    logits: B::Mem,
    /// (N) per-row losses.
    losses: B::Mem,
    /// (N) token ids, (N) shifted targets.
    ids: B::IMem,
    targets: B::IMem,
    /// Host: L+1 layer-boundary checkpoints, each (N, C): inputs of layers 0..L and the last
    /// layer's output.
    ckpt: Vec<Vec<f32>>,
    /// Host scratch: (layer len) gradient download and frozen weights, (V*C) head gradient
    /// and frozen head, (N) losses.
    host_dw: Vec<f32>,
    host_dhead: Vec<f32>,
    host_losses: Vec<f32>,
    /// A mixture of experts' pass buffers (`None`: dense).
    moe: Option<MoeBufs<B>>,
    /// The last forward's load-balancing loss and its trained coefficient.
    aux: Option<(f64, f64)>,
}

/// A mixture of experts' buffers for one pass: the dispatch sort's host scratch, the rows' mask,
/// the pooled load-balancing statistics and the gradient every sparse layer's routing adds.
struct MoeBufs<B: DeviceAlloc> {
    host: MoeHost,
    /// (N) 1 on real rows.
    mask: B::Mem,
    /// (2E) pooled over the pass's sparse layers.
    stats: B::Mem,
    /// (E) per real row, when the loss is trained.
    grad: B::Mem,
    host_stats: Vec<f32>,
    host_grad: Vec<f32>,
}

impl<B: DeviceAlloc> MoeBufs<B> {
    fn new(be: &B, layout: &ModelLayout, n: usize) -> Option<Self> {
        let m = layout.moe.as_ref()?;
        let e = m.num_experts;
        Some(MoeBufs {
            host: MoeHost::new(n * m.top_k, e),
            mask: be.alloc(n),
            stats: be.alloc(2 * e),
            grad: be.alloc(e),
            host_stats: vec![0.0; 2 * e],
            host_grad: vec![0.0; e],
        })
    }

    /// The layer's view: statistics pooled (a first forward) or not, the gradient when given.
    fn io(&mut self, n: usize, pool: bool, grad: bool) -> MoeIo<'_, B> {
        MoeIo {
            host: &mut self.host,
            mask: Some(self.mask.slice(0..n)),
            stats: pool.then_some(&mut *self.stats),
            grad: grad.then_some(&*self.grad),
        }
    }

    /// After a forward: the pass's aux loss; the gradient uploaded for the backward.
    fn finish(&mut self, be: &B, layout: &ModelLayout, real_rows: f64) -> (f64, f64) {
        be.download(&mut self.host_stats, &self.stats);
        let out = aux_loss(&self.host_stats, layout, real_rows, &mut self.host_grad);
        be.upload(&mut self.grad, &self.host_grad);
        out
    }
}

/// A buffer's first `len` elements.
pub(crate) fn v<T: ?Sized + DeviceSlice, M: Deref<Target = T>>(m: &M, len: usize) -> &T {
    m.slice(0..len)
}

/// A buffer's first `len` elements, mutably.
pub(crate) fn vm<T: ?Sized + DeviceSlice, M: DerefMut<Target = T>>(
    m: &mut M,
    len: usize,
) -> &mut T {
    m.slice_mut(0..len)
}

impl<B: DeviceAlloc> Transformer<B> {
    /// Allocate the whole workspace once. Nothing is allocated per step afterwards.
    pub fn new(be: B, cfg: &ModelConfig, cap: Capacity) -> Self {
        Self::with_layout(be, crate::model::describe(cfg), None, cap)
    }

    /// [`Transformer::new`] for `layout` (an adapter layout with its frozen `base`).
    pub fn with_layout(
        be: B,
        layout: ModelLayout,
        base: Option<Arc<FrozenBase>>,
        cap: Capacity,
    ) -> Self {
        assert_eq!(base.is_some(), !layout.trains_base(), "an adapter layout has a frozen base");
        let d = layout.dims;
        let n = cap.batch * cap.seq_len;
        let chunk = cap.head_chunk_rows.clamp(1, n.max(1));
        let ropes = layout
            .rope
            .iter()
            .map(|table| {
                let (cos_h, sin_h) = rope_tables(table, cap.seq_len);
                let (mut cos, mut sin) = (be.alloc(cos_h.len()), be.alloc(sin_h.len()));
                be.upload(&mut cos, &cos_h);
                be.upload(&mut sin, &sin_h);
                (cos, sin)
            })
            .collect();
        let acts = layout.max_act_widths().iter().map(|w| be.alloc(n * w)).collect();
        let grads = layout.max_grad_widths()[1..].iter().map(|w| be.alloc(n * w)).collect();
        let layer_len = layout.max_layer_len();
        Transformer {
            w: be.alloc_weights(layer_len),
            packed: be.alloc(layout.max_packed()),
            ws: be.alloc_weights(layout.max_workspace()),
            base,
            dw: be.alloc(layout.max_train_len()),
            dres: be.alloc(n * d.c),
            x: be.alloc(n * d.c),
            y: be.alloc(n * d.c),
            norm_w: be.alloc_weights(d.c),
            dnorm_w: be.alloc(d.c),
            hf: be.alloc(n * d.c),
            dhf: be.alloc(n * d.c),
            rstd_f: be.alloc(n),
            head_w: be.alloc_weights(d.v * d.c),
            dhead_w: be.alloc(d.v * d.c),
            logits: be.alloc(chunk * d.v),
            losses: be.alloc(n),
            ids: be.alloc_i32(n),
            targets: be.alloc_i32(n),
            ckpt: (0..=d.layers).map(|_| vec![0.0; n * d.c]).collect(),
            host_dw: vec![0.0; layer_len.max(d.c)],
            host_dhead: vec![0.0; d.v * d.c],
            host_losses: vec![0.0; n],
            moe: MoeBufs::new(&be, &layout, n),
            aux: None,
            ropes,
            acts,
            grads,
            cap: Capacity { head_chunk_rows: chunk, ..cap },
            layout,
            be,
        }
    }

    /// Layer `l` forward on `rows`: `x -> y`, its internals in `acts`; a sparse layer adds to
    /// the pass's load-balancing statistics when `pool` (not in a recompute).
    fn run_layer_forward(&mut self, l: usize, rows: Rows, pool: bool) {
        let nc = rows.b * rows.t * self.layout.dims.c;
        let ropes = rope_views(&self.ropes, rows.t * self.layout.dims.d / 2);
        let spec = self.layout.layer(l);
        let mut slots = act_slots(
            v(&self.x, nc),
            Slot::W(vm(&mut self.y, nc)),
            self.acts.iter_mut().map(|m| &mut **m),
        );
        let mut w = layer_weights::<B>(spec, &self.w, &self.packed, &mut self.ws);
        w.moe = self.moe.as_mut().map(|m| m.io(rows.b * rows.t, pool, false));
        layer_forward(&self.be, spec, &mut slots, &mut w, &ropes, rows);
    }

    /// Layer `l`'s weights into the slot: the frozen part from the base (fp32, exact), the
    /// trained part from `params`, the packed words as they are.
    fn upload_layer(&mut self, params: &ParamStore, l: usize) {
        let (be, base) = (&self.be, self.base.as_deref());
        let mut w =
            LayerUpload { w: &mut self.w, packed: &mut self.packed, scratch: &mut self.host_dw };
        upload_layer(be, &self.layout, (base, params), l, &mut w);
    }

    /// The final norm and head weights into their buffers (from the base when frozen).
    fn upload_head(&mut self, params: &ParamStore) {
        let (norm, head) = (&mut self.norm_w, &mut self.head_w);
        let m = (self.base.as_deref(), params);
        upload_head(&self.be, &self.layout, m, (norm, head), &mut self.host_dhead);
    }

    fn check_batch(&self, batch: &Tokens<'_>) -> Result<()> {
        if batch.b > self.cap.batch || batch.t > self.cap.seq_len {
            bail!(
                "batch of {}x{} tokens exceeds the workspace capacity {}x{}",
                batch.b,
                batch.t,
                self.cap.batch,
                self.cap.seq_len
            );
        }
        Ok(())
    }

    /// Forward through the decoder layers. Leaves the final-norm output in `hf` and the
    /// checkpoints in `ckpt[0..=L]`.
    fn forward_layers(&mut self, params: &ParamStore, batch: Tokens<'_>) -> Result<()> {
        self.check_batch(&batch)?;
        let d = self.layout.dims;
        let n = batch.b * batch.t;
        let nc = n * d.c;
        let rows = Rows { b: batch.b, t: batch.t };
        // Embedding rows are gathered on the host (only the rows the batch touches travel).
        let m = (self.base.as_deref(), params);
        embed_rows_of(&mut self.ckpt[0][..nc], batch.ids, m, &self.layout);
        self.be.upload_i32(self.ids.slice_mut(0..n), batch.ids);
        self.be.upload_i32(self.targets.slice_mut(0..n), batch.targets);
        self.be.upload(vm(&mut self.x, nc), &self.ckpt[0][..nc]);
        if let Some(m) = self.moe.as_mut() {
            self.be.upload(vm(&mut m.mask, n), batch.mask);
            self.be.zero(&mut m.stats);
        }
        for l in 0..d.layers {
            self.upload_layer(params, l);
            self.run_layer_forward(l, rows, true);
            std::mem::swap(&mut self.x, &mut self.y);
            self.be.download(&mut self.ckpt[l + 1][..nc], v(&self.x, nc));
        }
        let real = batch.mask.iter().map(|&m| m as f64).sum();
        self.aux = self.moe.as_mut().map(|m| m.finish(&self.be, &self.layout, real));
        self.upload_head(params);
        self.be.rmsnorm_forward(
            vm(&mut self.hf, nc),
            vm(&mut self.rstd_f, n),
            v(&self.x, nc),
            &self.norm_w,
            self.layout.final_norm(),
        );
        Ok(())
    }

    /// Forward only: the hidden states HF reports (`hidden_states.0..L`, the last one after the
    /// final norm), each (N, C), and the logits (N, V). For tests and inspection.
    pub fn forward_inspect(
        &mut self,
        params: &ParamStore,
        batch: Tokens<'_>,
    ) -> Result<(Vec<Vec<f32>>, Vec<f32>)> {
        self.forward_layers(params, batch)?;
        let d = self.layout.dims;
        let n = batch.b * batch.t;
        let nc = n * d.c;
        let mut hidden: Vec<Vec<f32>> =
            self.ckpt[..d.layers].iter().map(|c| c[..nc].to_vec()).collect();
        let mut hf = vec![0.0; nc];
        self.be.download(&mut hf, v(&self.hf, nc));
        hidden.push(hf);
        let mut logits = vec![0.0; n * d.v];
        let chunk = self.cap.head_chunk_rows;
        for r0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - r0);
            self.head_logits(r0, rows);
            self.be.download(&mut logits[r0 * d.v..(r0 + rows) * d.v], v(&self.logits, rows * d.v));
        }
        Ok((hidden, logits))
    }

    /// A mixture of experts' pooled routing statistics of the last forward (2E: each expert's
    /// count of real (row, choice) pairs over every sparse layer, then its probability sums).
    pub fn pooled_stats(&self) -> Option<&[f32]> {
        self.moe.as_ref().map(|m| &m.host_stats[..])
    }

    /// Forward only: the logits (V) of the batch's last position (generation).
    pub fn last_logits(
        &mut self,
        params: &ParamStore,
        batch: Tokens<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        self.forward_layers(params, batch)?;
        self.head_logits(batch.b * batch.t - 1, 1);
        self.be.download(out, v(&self.logits, self.layout.dims.v));
        Ok(())
    }

    /// Forward only, loss of the batch (evaluation).
    pub fn forward_loss(&mut self, params: &ParamStore, batch: Tokens<'_>) -> Result<PassOutput> {
        self.forward_layers(params, batch)?;
        let n = batch.b * batch.t;
        let chunk = self.cap.head_chunk_rows;
        let mut loss_sum = 0.0f64;
        for r0 in (0..n).step_by(chunk) {
            loss_sum += self.head_losses(r0, chunk.min(n - r0));
        }
        Ok(PassOutput { loss_sum, num_targets: batch.num_targets(), aux: self.aux })
    }

    /// The logits (rows, V) of rows `[r0, r0 + rows)` of the last forward's final-norm output,
    /// into `self.logits`.
    fn head_logits(&mut self, r0: usize, rows: usize) {
        let d = self.layout.dims;
        self.be.matmul_forward(
            vm(&mut self.logits, rows * d.v),
            self.hf.slice(r0 * d.c..(r0 + rows) * d.c),
            &self.head_w,
            None,
            rows,
            d.c,
            d.v,
        );
    }

    /// The head's forward over rows `[r0, r0 + rows)` of the last forward: logits, each row's
    /// cross-entropy into `host_losses[..rows]`; returns their sum in f64.
    fn head_losses(&mut self, r0: usize, rows: usize) -> f64 {
        let d = self.layout.dims;
        self.head_logits(r0, rows);
        self.be.cross_entropy_forward(
            vm(&mut self.losses, rows),
            v(&self.logits, rows * d.v),
            self.targets.slice(r0..r0 + rows),
            rows,
            d.v,
        );
        self.be.download(&mut self.host_losses[..rows], v(&self.losses, rows));
        self.host_losses[..rows].iter().map(|&x| x as f64).sum::<f64>()
    }

    /// One forward and backward pass over `batch`. Parameter gradients **accumulate** (+=) into
    /// `grads`, scaled so that the loss is the mean over `loss_norm` loss-carrying positions
    /// (the whole batch's count; micro-batches pass the full batch's count).
    pub fn forward_backward(
        &mut self,
        params: &ParamStore,
        grads: &mut ParamStore,
        batch: Tokens<'_>,
        loss_norm: usize,
    ) -> Result<PassOutput> {
        let scale = 1.0 / loss_norm.max(1) as f32;
        self.forward_backward_scaled(params, grads, batch, scale, None)
    }

    /// [`Transformer::forward_backward`] of an objective on each row's summed log-probability
    /// (DPO): row `i`'s cross-entropy gradient is scaled by `row_scales[i]` (`-dL/dlogp_i`).
    pub fn forward_backward_rows(
        &mut self,
        params: &ParamStore,
        grads: &mut ParamStore,
        batch: Tokens<'_>,
        row_scales: &[f32],
    ) -> Result<PassOutput> {
        assert_eq!(row_scales.len(), batch.b, "one scale a row");
        self.forward_backward_scaled(params, grads, batch, 0.0, Some(row_scales))
    }

    /// Each row's summed log-probability of its targets (`-Σ` of the per-position
    /// cross-entropy, in f64), forward only.
    pub fn row_logps(&mut self, params: &ParamStore, batch: Tokens<'_>) -> Result<Vec<f64>> {
        self.forward_layers(params, batch)?;
        let chunk = self.cap.head_chunk_rows.max(1);
        let mut out = vec![0.0f64; batch.b];
        for (i, logp) in out.iter_mut().enumerate() {
            for c0 in (0..batch.t).step_by(chunk) {
                *logp -= self.head_losses(i * batch.t + c0, chunk.min(batch.t - c0));
            }
        }
        Ok(out)
    }

    fn forward_backward_scaled(
        &mut self,
        params: &ParamStore,
        grads: &mut ParamStore,
        batch: Tokens<'_>,
        scale: f32,
        row_scales: Option<&[f32]>,
    ) -> Result<PassOutput> {
        self.forward_layers(params, batch)?;
        let d = self.layout.dims;
        let n = batch.b * batch.t;
        let nc = n * d.c;
        let rows = Rows { b: batch.b, t: batch.t };
        let trains_base = self.layout.trains_base();

        // Final norm, LM head and cross-entropy, forward and backward, chunk by chunk.
        self.be.zero(&mut self.dhead_w);
        self.be.zero(&mut self.dnorm_w);
        let mut hb = HeadBufs {
            hf: &mut *self.hf,
            dhf: &mut *self.dhf,
            rstd: &mut *self.rstd_f,
            logits: &mut *self.logits,
        };
        head_forward_backward(
            &self.be,
            &mut hb,
            HeadGrads {
                losses: vm(&mut self.losses, n),
                dres: vm(&mut self.dres, nc),
                dnorm_w: trains_base.then_some(&mut *self.dnorm_w),
                dhead_w: trains_base.then_some(&mut *self.dhead_w),
            },
            v(&self.x, nc),
            &self.norm_w,
            &self.head_w,
            self.targets.slice(0..n),
            HeadDims {
                n,
                v: d.v,
                chunk: self.cap.head_chunk_rows,
                norm: self.layout.final_norm(),
                scale,
                row_scales: row_scales.map(|s| (batch.t, s)),
            },
        );
        self.be.download(&mut self.host_losses[..n], v(&self.losses, n));
        let loss_sum = self.host_losses[..n].iter().map(|&x| x as f64).sum::<f64>();
        if trains_base {
            self.be.download(&mut self.host_dhead, &self.dhead_w);
            let ghead = grads.lm_head.as_deref_mut().unwrap_or(&mut grads.embed);
            add_host(ghead, &self.host_dhead);
            self.be.download(&mut self.host_dw[..d.c], &self.dnorm_w);
            add_host(&mut grads.final_norm, &self.host_dw[..d.c]);
        }

        // Layers, last to first: recompute from the checkpoint, then backward.
        for l in (0..d.layers).rev() {
            let len = params.layers[l].len();
            self.upload_layer(params, l);
            self.be.upload(vm(&mut self.x, nc), &self.ckpt[l][..nc]);
            self.run_layer_forward(l, rows, false);
            self.be.zero(vm(&mut self.dw, len));
            let spec = self.layout.layer(l);
            let ropes = rope_views(&self.ropes, rows.t * d.d / 2);
            let acts = act_slots(
                v(&self.x, nc),
                Slot::R(v(&self.y, nc)),
                self.acts.iter_mut().map(|m| &mut **m),
            );
            let mut gslots =
                grad_slots(vm(&mut self.dres, nc), self.grads.iter_mut().map(|m| &mut **m));
            let mut w = layer_weights::<B>(spec, &self.w, &self.packed, &mut self.ws);
            let trained = self.aux.is_some_and(|(_, coef)| coef > 0.0);
            w.moe = self.moe.as_mut().map(|m| m.io(n, false, trained));
            let dw = vm(&mut self.dw, len);
            layer_backward(&self.be, spec, &mut gslots, dw, &acts, &mut w, &ropes, rows);
            drop((acts, gslots));
            self.be.download(&mut self.host_dw[..len], v(&self.dw, len));
            add_host(&mut grads.layers[l], &self.host_dw[..len]);
        }

        // Embedding backward on the host: scatter-add into the rows the batch touched.
        if trains_base {
            let dx = &mut self.ckpt[0][..nc];
            self.be.download(dx, v(&self.dres, nc));
            embed_rows_backward(&mut grads.embed, batch.ids, dx, &self.layout);
        }

        Ok(PassOutput { loss_sum, num_targets: batch.num_targets(), aux: self.aux })
    }
}

/// A model's weights on the host: an adapter run's frozen base (or none) and the trained part.
pub(crate) type HostModel<'a> = (Option<&'a FrozenBase>, &'a ParamStore);

/// Where a layer's weights go on a synchronous backend: its slot, its packed words, and a host
/// scratch of at least the frozen part (bf16 expanded to fp32 there).
pub(crate) struct LayerUpload<'a, B: DeviceAlloc> {
    pub w: &'a mut B::WMem,
    pub packed: &'a mut B::Mem,
    pub scratch: &'a mut [f32],
}

/// Layer `l`'s weights into its slot: the frozen part from the base (exactly, as fp32 on the
/// CPU), the trained part from the masters, the packed words as they are.
pub(crate) fn upload_layer<B: DeviceAlloc>(
    be: &B,
    layout: &ModelLayout,
    (base, params): HostModel<'_>,
    l: usize,
    to: &mut LayerUpload<'_, B>,
) {
    let spec = layout.layer(l);
    let (frozen, len) = (spec.frozen, spec.len);
    if let Some(base) = base {
        base.layers[l].get(0, &mut to.scratch[..frozen]);
        be.upload_weights(vm(to.w, frozen), &to.scratch[..frozen]);
        let words = words_as_f32(&base.packed[l]);
        be.upload(vm(to.packed, words.len()), words);
    }
    be.upload_weights(to.w.slice_mut(frozen..len), &params.layers[l]);
}

/// The final norm and LM head weights into `norm_w`, `head_w` (from the base when it is
/// frozen; `scratch`, (V, C), then holds the head as fp32).
pub(crate) fn upload_head<B: DeviceAlloc>(
    be: &B,
    layout: &ModelLayout,
    (base, params): HostModel<'_>,
    (norm_w, head_w): (&mut B::WMem, &mut B::WMem),
    scratch: &mut [f32],
) {
    match base {
        None => {
            be.upload_weights(norm_w, &params.final_norm);
            be.upload_weights(head_w, params.lm_head.as_deref().unwrap_or(&params.embed));
        }
        Some(base) => {
            let (c, vc) = (layout.dims.c, layout.dims.v * layout.dims.c);
            base.final_norm.get(0, &mut scratch[..c]);
            be.upload_weights(norm_w, &scratch[..c]);
            base.lm_head.as_ref().unwrap_or(&base.embed).get(0, &mut scratch[..vc]);
            be.upload_weights(head_w, &scratch[..vc]);
        }
    }
}

/// [`embed_rows`] from the masters, or from the frozen base when there is one.
pub(crate) fn embed_rows_of(out: &mut [f32], ids: &[i32], m: HostModel<'_>, layout: &ModelLayout) {
    match m {
        (None, params) => embed_rows(out, ids, &params.embed, layout),
        (Some(base), _) => embed_rows_frozen(out, ids, &base.embed, layout),
    }
}

/// A layer's weights: its slot, and its packed words with the workspace when it has any.
pub(crate) fn layer_weights<'a, B: DeviceAlloc>(
    spec: &crate::model::spec::LayerSpec,
    w: &'a B::WMem,
    packed: &'a B::Mem,
    ws: &'a mut B::WMem,
) -> Weights<'a, B> {
    let slot = v(w, spec.len);
    let packed = (spec.packed > 0).then(|| Packed { words: v(packed, spec.packed), ws: &mut **ws });
    Weights { slot, packed, moe: None, map: None }
}

/// `acc += x` on host buffers.
fn add_host(acc: &mut [f32], x: &[f32]) {
    CpuBackend.add_inplace(acc, x);
}

/// Every rope table's (cos, sin), each viewed at its first `len` elements ((T, D/2) for `T`
/// positions).
fn rope_views<T: ?Sized + DeviceSlice, M: Deref<Target = T>>(
    tables: &[(M, M)],
    len: usize,
) -> Vec<(&T, &T)> {
    tables.iter().map(|(c, s)| (v(c, len), v(s, len))).collect()
}

/// cos/sin tables (T, D/2) exactly as HF computes them: `angle = f32(t) * inv_freq` in f32,
/// then cos/sin of that f32 angle, rounded to f32, times the table's scale in f32 (YaRN's
/// attention factor; a scale of 1 changes no bit).
pub fn rope_tables(table: &RopeTable, t_max: usize) -> (Vec<f32>, Vec<f32>) {
    let (inv_freq, scale) = (&table.inv_freq, table.scale);
    let half = inv_freq.len();
    let mut cos = vec![0.0f32; t_max * half];
    let mut sin = vec![0.0f32; t_max * half];
    for t in 0..t_max {
        for (j, &f) in inv_freq.iter().enumerate() {
            let angle = (t as f32 * f) as f64;
            cos[t * half + j] = angle.cos() as f32 * scale;
            sin[t * half + j] = angle.sin() as f32 * scale;
        }
    }
    (cos, sin)
}

/// The embedding rows of `ids`, times the model's embedding scale (Gemma: `sqrt(C)`, in fp32 as
/// transformers multiplies them). out: (N, C), overwrites.
pub fn embed_rows(out: &mut [f32], ids: &[i32], table: &[f32], layout: &ModelLayout) {
    let c = layout.dims.c;
    embed_rows_by(out, ids, |r| &table[r * c..][..c], layout);
}

/// [`embed_rows`] from a table reached one row at a time (`row(r)`: row `r`'s C elements), for
/// a caller that may borrow only the rows it gathers.
pub fn embed_rows_by<'a>(
    out: &mut [f32],
    ids: &[i32],
    row: impl Fn(usize) -> &'a [f32] + Sync,
    layout: &ModelLayout,
) {
    horizon_backend::cpu::embedding_forward_rows(out, ids, layout.dims.v, layout.dims.c, row);
    scale_embedded(out, layout);
}

/// Gathered embedding rows times the model's embedding scale, in place.
fn scale_embedded(out: &mut [f32], layout: &ModelLayout) {
    if layout.embed_scale != 1.0 {
        out.iter_mut().for_each(|x| *x *= layout.embed_scale);
    }
}

/// [`embed_rows`] from a frozen table (bf16 rows expanded exactly).
pub fn embed_rows_frozen(out: &mut [f32], ids: &[i32], table: &Frozen, layout: &ModelLayout) {
    let c = layout.dims.c;
    for (row, &id) in out.chunks_exact_mut(c).zip(ids) {
        table.get(id as usize * c, row);
    }
    scale_embedded(out, layout);
}

/// [`embed_rows_frozen`] of a bf16 `table` (V, C): DPO's live reference copy.
pub fn embed_rows_bf16(
    out: &mut [f32],
    ids: &[i32],
    table: &[horizon_backend::bf16::Bf16],
    layout: &ModelLayout,
) {
    let c = layout.dims.c;
    for (row, &id) in out.chunks_exact_mut(c).zip(ids) {
        let at = id as usize * c;
        horizon_backend::bf16::expand_bf16(row, &table[at..at + c]);
    }
    scale_embedded(out, layout);
}

/// The embedding's backward: `dtable[ids] += dx * scale`, in place of `dx` (N, C), which it
/// scales first.
pub fn embed_rows_backward(dtable: &mut [f32], ids: &[i32], dx: &mut [f32], layout: &ModelLayout) {
    if layout.embed_scale != 1.0 {
        dx.iter_mut().for_each(|x| *x *= layout.embed_scale);
    }
    CpuBackend.embedding_backward(dtable, ids, dx, layout.dims.c);
}

/// Sizes of one head pass: `n` rows, chunks of `chunk` rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadDims<'a> {
    pub n: usize,
    pub v: usize,
    pub chunk: usize,
    /// The final norm: width C, eps, weight offset.
    pub norm: NormDims,
    /// 1 / (loss-carrying positions of the whole batch).
    pub scale: f32,
    /// `Some((t, s))`: sequence `i` (positions `[i*t, (i+1)*t)`) scales its cross-entropy
    /// gradient by `s[i]` instead of `scale` (DPO: `-dL/dlogp_i`); chunks then stop at
    /// sequence ends.
    pub row_scales: Option<(usize, &'a [f32])>,
}

/// Scratch of the head pass.
pub(crate) struct HeadBufs<M> {
    /// (N, C) final norm output.
    pub hf: M,
    /// (N, C) its gradient.
    pub dhf: M,
    /// (N) final norm rstd.
    pub rstd: M,
    /// (chunk, V) logits, then dlogits.
    pub logits: M,
}

/// Outputs of the head pass.
pub(crate) struct HeadGrads<'a, B: Backend + ?Sized> {
    /// (N) per-row losses, overwrites.
    pub losses: &'a mut B::Buf,
    /// (N, C) dL/d(last layer output), overwrites.
    pub dres: &'a mut B::Buf,
    /// (C) accumulates (+=); `None`: the final norm is frozen.
    pub dnorm_w: Option<&'a mut B::Buf>,
    /// (V, C) accumulates (+=); `None`: the head is frozen.
    pub dhead_w: Option<&'a mut B::Buf>,
}

/// Final norm, LM head and cross-entropy of one micro-batch, forward and backward:
/// `x (N,C) -> rmsnorm -> hf -> [per chunk of rows: logits = hf Wᵀ -> fused CE -> dlogits ->
///  dhf rows, dW +=] -> rmsnorm backward -> dres`. The (N, V) logits never exist at once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_forward_backward<B: Backend, M: DerefMut<Target = B::Buf>>(
    be: &B,
    hb: &mut HeadBufs<M>,
    out: HeadGrads<'_, B>,
    x: &B::Buf,
    norm_w: &B::WBuf,
    head_w: &B::WBuf,
    targets: &B::IBuf,
    hd: HeadDims,
) {
    let HeadDims { n, v: vocab, chunk, norm, scale, row_scales } = hd;
    let HeadGrads { losses, dres, dnorm_w, mut dhead_w } = out;
    let c = norm.c;
    let nc = n * c;
    be.rmsnorm_forward(vm(&mut hb.hf, nc), vm(&mut hb.rstd, n), x, norm_w, norm);
    let mut r0 = 0;
    while r0 < n {
        let (rows, scale) = match row_scales {
            None => (chunk.min(n - r0), scale),
            Some((t, s)) => (chunk.min(t - r0 % t), s[r0 / t]),
        };
        let hf_rows = r0 * c..(r0 + rows) * c;
        be.matmul_forward(
            vm(&mut hb.logits, rows * vocab),
            hb.hf.slice(hf_rows.clone()),
            head_w,
            None,
            rows,
            c,
            vocab,
        );
        be.cross_entropy_fused(
            vm(&mut hb.logits, rows * vocab),
            losses.slice_mut(r0..r0 + rows),
            targets.slice(r0..r0 + rows),
            rows,
            vocab,
            scale,
        );
        be.matmul_backward(
            Some(Dinp::Write(hb.dhf.slice_mut(hf_rows.clone()))),
            dhead_w.as_deref_mut(),
            None,
            v(&hb.logits, rows * vocab),
            hb.hf.slice(hf_rows),
            head_w,
            rows,
            c,
            vocab,
        );
        r0 += rows;
    }
    // The final norm's backward starts the residual-stream gradient.
    be.zero(&mut *dres);
    be.rmsnorm_backward(dres, dnorm_w, v(&hb.dhf, nc), x, norm_w, v(&hb.rstd, n), norm);
}
