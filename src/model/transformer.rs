//! The decoder-only transformer step, layer by layer, as Horizon runs it: host RAM holds the
//! parameters; each layer's weights are uploaded to the backend for the op that uses them; the
//! forward pass keeps only layer-boundary checkpoints (in host memory); backward walks the
//! layers from last to first, recomputes a layer's internals from its checkpoint and runs the
//! hand-written backward ops. No autograd.
//!
//! Data flow of one layer (shapes in the legend of `horizon_backend`):
//! `x (N,C) -> rmsnorm -> h1 -> qkv (N,QKV) -> rope -> attention -> att (N,H*D) -> o_proj -> +x ->
//!  x2 -> rmsnorm -> h2 -> gate|up (N,2F) -> swiglu -> s (N,F) -> down -> +x2 -> y (N,C)`

use std::ops::{Deref, DerefMut};

use anyhow::{Result, bail};
use horizon_backend::{AttnDims, Backend, CpuBackend, DeviceAlloc, DeviceSlice, NormDims};

use crate::data::pretokenized::Batch;
use crate::hf::config::ModelConfig;
use crate::model::layout::{LayerLayout, ModelLayout};
use crate::model::params::ParamStore;

/// What one forward+backward pass over a batch produced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PassOutput {
    /// Sum over loss-carrying positions of `-log p(target)`, accumulated in f64.
    pub loss_sum: f64,
    /// Number of loss-carrying positions.
    pub num_targets: usize,
}

impl PassOutput {
    /// The HF causal-LM loss: mean over loss-carrying positions.
    pub fn loss(&self) -> f64 {
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

/// Activations of one layer on the device (each sized for the capacity, viewed per pass).
pub(crate) struct LayerActs<M> {
    /// (N, C)
    pub(crate) h1: M,
    /// (N)
    pub(crate) rstd1: M,
    /// (N, QKV), after rope
    pub(crate) qkv: M,
    /// (N, H*D)
    pub(crate) att: M,
    /// (B, H, T)
    pub(crate) lse: M,
    /// (N, C)
    pub(crate) x2: M,
    /// (N, C)
    pub(crate) h2: M,
    /// (N)
    pub(crate) rstd2: M,
    /// (N, 2F)
    pub(crate) gu: M,
    /// (N, F)
    pub(crate) s: M,
    /// (N, C) scratch for the o_proj and down_proj outputs
    pub(crate) tmp: M,
}

/// Gradient scratch of one layer on the device.
pub(crate) struct LayerGrads<M> {
    /// (N, C) gradient of the layer output, then of its input (the residual stream)
    pub(crate) dres: M,
    /// (N, C) gradient of x2
    pub(crate) dx2: M,
    /// (N, C) gradient of a norm output
    pub(crate) dh: M,
    /// (N, QKV)
    pub(crate) dqkv: M,
    /// (N, H*D)
    pub(crate) datt: M,
    /// (N, 2F)
    pub(crate) dgu: M,
    /// (N, F)
    pub(crate) ds: M,
}

/// The step runner: owns the backend, the device workspace (allocated once, sized by
/// [`Capacity`]) and the host checkpoint buffers.
pub struct Transformer<B: DeviceAlloc> {
    be: B,
    pub layout: ModelLayout,
    cap: Capacity,
    /// (T_max, D/2)
    cos: B::Mem,
    /// (T_max, D/2)
    sin: B::Mem,
    /// One layer's weights on the device, (layer len), in the backend's precision.
    w: B::WMem,
    /// One layer's parameter gradients on the device, (layer len).
    dw: B::Mem,
    acts: LayerActs<B::Mem>,
    grads: LayerGrads<B::Mem>,
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
    /// Host scratch: (layer len) gradient download, (V*C) head gradient, (N) losses.
    host_dw: Vec<f32>,
    host_dhead: Vec<f32>,
    host_losses: Vec<f32>,
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
        let layout = ModelLayout::new(cfg);
        let d = layout.dims;
        let n = cap.batch * cap.seq_len;
        let chunk = cap.head_chunk_rows.clamp(1, n.max(1));
        let half = d.d / 2;
        let (cos_h, sin_h) = rope_tables(&cfg.rope_inv_freq(), cap.seq_len);
        let mut cos = be.alloc(cap.seq_len * half);
        let mut sin = be.alloc(cap.seq_len * half);
        be.upload(&mut cos, &cos_h);
        be.upload(&mut sin, &sin_h);
        let acts = LayerActs {
            h1: be.alloc(n * d.c),
            rstd1: be.alloc(n),
            qkv: be.alloc(n * d.qkv()),
            att: be.alloc(n * d.hd()),
            lse: be.alloc(n * d.h),
            x2: be.alloc(n * d.c),
            h2: be.alloc(n * d.c),
            rstd2: be.alloc(n),
            gu: be.alloc(n * 2 * d.f),
            s: be.alloc(n * d.f),
            tmp: be.alloc(n * d.c),
        };
        let grads = LayerGrads {
            dres: be.alloc(n * d.c),
            dx2: be.alloc(n * d.c),
            dh: be.alloc(n * d.c),
            dqkv: be.alloc(n * d.qkv()),
            datt: be.alloc(n * d.hd()),
            dgu: be.alloc(n * 2 * d.f),
            ds: be.alloc(n * d.f),
        };
        Transformer {
            w: be.alloc_weights(layout.layer.len),
            dw: be.alloc(layout.layer.len),
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
            host_dw: vec![0.0; layout.layer.len],
            host_dhead: vec![0.0; d.v * d.c],
            host_losses: vec![0.0; n],
            cos,
            sin,
            acts,
            grads,
            cap: Capacity { head_chunk_rows: chunk, ..cap },
            layout,
            be,
        }
    }

    fn attn_dims(&self, b: usize, t: usize) -> AttnDims {
        let d = &self.layout.dims;
        AttnDims::new(b, t, d.h, d.kvh, d.d)
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
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
    fn forward_layers(&mut self, params: &ParamStore, batch: &Batch) -> Result<()> {
        self.check_batch(batch)?;
        let d = self.layout.dims;
        let n = batch.b * batch.t;
        let nc = n * d.c;
        let ad = self.attn_dims(batch.b, batch.t);
        let eps = self.layout.eps;
        // Embedding rows are gathered on the host (only the rows the batch touches travel).
        CpuBackend.embedding_forward(&mut self.ckpt[0][..nc], &batch.input_ids, &params.embed, d.c);
        self.be.upload_i32(self.ids.slice_mut(0..n), &batch.input_ids);
        self.be.upload_i32(self.targets.slice_mut(0..n), &batch.targets);
        self.be.upload(vm(&mut self.x, nc), &self.ckpt[0][..nc]);
        for l in 0..d.layers {
            self.be.upload_weights(&mut self.w, &params.layers[l]);
            layer_forward(
                &self.be,
                &mut self.acts,
                &self.w,
                &self.layout.layer,
                v(&self.x, nc),
                vm(&mut self.y, nc),
                (v(&self.cos, batch.t * d.d / 2), v(&self.sin, batch.t * d.d / 2)),
                ad,
                d.f,
                eps,
            );
            std::mem::swap(&mut self.x, &mut self.y);
            self.be.download(&mut self.ckpt[l + 1][..nc], v(&self.x, nc));
        }
        self.be.upload_weights(&mut self.norm_w, &params.final_norm);
        self.be.rmsnorm_forward(
            vm(&mut self.hf, nc),
            vm(&mut self.rstd_f, n),
            v(&self.x, nc),
            &self.norm_w,
            NormDims::new(d.c, eps),
        );
        let head = params.lm_head.as_deref().unwrap_or(&params.embed);
        self.be.upload_weights(&mut self.head_w, head);
        Ok(())
    }

    /// Forward only: the hidden states HF reports (`hidden_states.0..L`, the last one after the
    /// final norm), each (N, C), and the logits (N, V). For tests and inspection.
    pub fn forward_inspect(
        &mut self,
        params: &ParamStore,
        batch: &Batch,
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
            self.be.matmul_forward(
                vm(&mut self.logits, rows * d.v),
                self.hf.slice(r0 * d.c..(r0 + rows) * d.c),
                &self.head_w,
                None,
                rows,
                d.c,
                d.v,
            );
            self.be.download(&mut logits[r0 * d.v..(r0 + rows) * d.v], v(&self.logits, rows * d.v));
        }
        Ok((hidden, logits))
    }

    /// Forward only: the logits (V) of the batch's last position (generation).
    pub fn last_logits(
        &mut self,
        params: &ParamStore,
        batch: &Batch,
        out: &mut [f32],
    ) -> Result<()> {
        self.forward_layers(params, batch)?;
        let d = self.layout.dims;
        let r = batch.b * batch.t - 1;
        self.be.matmul_forward(
            vm(&mut self.logits, d.v),
            self.hf.slice(r * d.c..(r + 1) * d.c),
            &self.head_w,
            None,
            1,
            d.c,
            d.v,
        );
        self.be.download(out, v(&self.logits, d.v));
        Ok(())
    }

    /// Forward only, loss of the batch (evaluation).
    pub fn forward_loss(&mut self, params: &ParamStore, batch: &Batch) -> Result<PassOutput> {
        self.forward_layers(params, batch)?;
        let d = self.layout.dims;
        let n = batch.b * batch.t;
        let chunk = self.cap.head_chunk_rows;
        let mut loss_sum = 0.0f64;
        for r0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - r0);
            self.be.matmul_forward(
                vm(&mut self.logits, rows * d.v),
                self.hf.slice(r0 * d.c..(r0 + rows) * d.c),
                &self.head_w,
                None,
                rows,
                d.c,
                d.v,
            );
            self.be.cross_entropy_forward(
                vm(&mut self.losses, rows),
                v(&self.logits, rows * d.v),
                self.targets.slice(r0..r0 + rows),
                rows,
                d.v,
            );
            self.be.download(&mut self.host_losses[..rows], v(&self.losses, rows));
            loss_sum += self.host_losses[..rows].iter().map(|&x| x as f64).sum::<f64>();
        }
        Ok(PassOutput { loss_sum, num_targets: batch.num_targets })
    }

    /// One forward and backward pass over `batch`. Parameter gradients **accumulate** (+=) into
    /// `grads`, scaled so that the loss is the mean over `loss_norm` loss-carrying positions
    /// (the whole batch's count; micro-batches pass the full batch's count).
    pub fn forward_backward(
        &mut self,
        params: &ParamStore,
        grads: &mut ParamStore,
        batch: &Batch,
        loss_norm: usize,
    ) -> Result<PassOutput> {
        self.forward_layers(params, batch)?;
        let d = self.layout.dims;
        let n = batch.b * batch.t;
        let nc = n * d.c;
        let ad = self.attn_dims(batch.b, batch.t);
        let eps = self.layout.eps;
        let scale = 1.0 / loss_norm.max(1) as f32;

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
                dres: vm(&mut self.grads.dres, nc),
                dnorm_w: &mut self.dnorm_w,
                dhead_w: &mut self.dhead_w,
            },
            v(&self.x, nc),
            &self.norm_w,
            &self.head_w,
            self.targets.slice(0..n),
            HeadDims { n, c: d.c, v: d.v, chunk: self.cap.head_chunk_rows, eps, scale },
        );
        self.be.download(&mut self.host_losses[..n], v(&self.losses, n));
        let loss_sum = self.host_losses[..n].iter().map(|&x| x as f64).sum::<f64>();
        self.be.download(&mut self.host_dhead, &self.dhead_w);
        let ghead = grads.lm_head.as_deref_mut().unwrap_or(&mut grads.embed);
        add_host(ghead, &self.host_dhead);
        self.be.download(&mut self.host_dw[..d.c], &self.dnorm_w);
        add_host(&mut grads.final_norm, &self.host_dw[..d.c]);

        // Layers, last to first: recompute from the checkpoint, then backward.
        for l in (0..d.layers).rev() {
            self.be.upload_weights(&mut self.w, &params.layers[l]);
            self.be.upload(vm(&mut self.x, nc), &self.ckpt[l][..nc]);
            let rope = (v(&self.cos, batch.t * d.d / 2), v(&self.sin, batch.t * d.d / 2));
            layer_forward(
                &self.be,
                &mut self.acts,
                &self.w,
                &self.layout.layer,
                v(&self.x, nc),
                vm(&mut self.y, nc),
                rope,
                ad,
                d.f,
                eps,
            );
            self.be.zero(&mut self.dw);
            layer_backward(
                &self.be,
                &mut self.grads,
                &mut self.dw,
                &self.acts,
                &self.w,
                &self.layout.layer,
                v(&self.x, nc),
                rope,
                ad,
                d.f,
            );
            self.be.download(&mut self.host_dw, &self.dw);
            add_host(&mut grads.layers[l], &self.host_dw);
        }

        // Embedding backward on the host: scatter-add into the rows the batch touched.
        let dx = &mut self.ckpt[0][..nc];
        self.be.download(dx, v(&self.grads.dres, nc));
        CpuBackend.embedding_backward(&mut grads.embed, &batch.input_ids, dx, d.c);

        Ok(PassOutput { loss_sum, num_targets: batch.num_targets })
    }
}

/// `acc += x` on host buffers.
fn add_host(acc: &mut [f32], x: &[f32]) {
    CpuBackend.add_inplace(acc, x);
}

/// cos/sin tables (T, D/2) exactly as HF computes them: `angle = f32(t) * inv_freq` in f32,
/// then cos/sin of that f32 angle, rounded to f32.
pub fn rope_tables(inv_freq: &[f32], t_max: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0.0f32; t_max * half];
    let mut sin = vec![0.0f32; t_max * half];
    for t in 0..t_max {
        for (j, &f) in inv_freq.iter().enumerate() {
            let angle = (t as f32 * f) as f64;
            cos[t * half + j] = angle.cos() as f32;
            sin[t * half + j] = angle.sin() as f32;
        }
    }
    (cos, sin)
}

/// One decoder layer forward: `x -> y`, keeping every internal the backward needs in `a`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_forward<B: Backend, M: DerefMut<Target = B::Buf>>(
    be: &B,
    a: &mut LayerActs<M>,
    w: &B::WBuf,
    lay: &LayerLayout,
    x: &B::Buf,
    y: &mut B::Buf,
    (cos, sin): (&B::Buf, &B::Buf),
    ad: AttnDims,
    f: usize,
    eps: f32,
) {
    let n = ad.n();
    let c = x.len() / n;
    let (nc, qkv, hd) = (n * c, ad.qkv_width(), ad.h * ad.d);
    be.rmsnorm_forward(
        vm(&mut a.h1, nc),
        vm(&mut a.rstd1, n),
        x,
        w.slice(lay.ln1.clone()),
        NormDims::new(c, eps),
    );
    be.matmul_forward(
        vm(&mut a.qkv, n * qkv),
        v(&a.h1, nc),
        w.slice(lay.wqkv.clone()),
        lay.bqkv.clone().map(|r| w.slice(r)),
        n,
        c,
        qkv,
    );
    be.rope_forward(vm(&mut a.qkv, n * qkv), cos, sin, ad);
    be.attention_forward(vm(&mut a.att, n * hd), vm(&mut a.lse, n * ad.h), v(&a.qkv, n * qkv), ad);
    be.matmul_forward(
        vm(&mut a.tmp, nc),
        v(&a.att, n * hd),
        w.slice(lay.wo.clone()),
        None,
        n,
        hd,
        c,
    );
    be.residual_forward(vm(&mut a.x2, nc), x, v(&a.tmp, nc));
    be.rmsnorm_forward(
        vm(&mut a.h2, nc),
        vm(&mut a.rstd2, n),
        v(&a.x2, nc),
        w.slice(lay.ln2.clone()),
        NormDims::new(c, eps),
    );
    be.matmul_forward(
        vm(&mut a.gu, n * 2 * f),
        v(&a.h2, nc),
        w.slice(lay.wgu.clone()),
        None,
        n,
        c,
        2 * f,
    );
    be.swiglu_forward(vm(&mut a.s, n * f), v(&a.gu, n * 2 * f), n, f);
    be.matmul_forward(
        vm(&mut a.tmp, nc),
        v(&a.s, n * f),
        w.slice(lay.wdown.clone()),
        None,
        n,
        f,
        c,
    );
    be.residual_forward(y, v(&a.x2, nc), v(&a.tmp, nc));
}

/// One decoder layer backward. On entry `g.dres` holds dL/dy (N, C); on return it holds dL/dx
/// (overwritten). Parameter gradients accumulate (+=) into `dw` (layer len).
///
/// Derivation (y = x2 + down(swiglu(gu(norm2(x2)))), x2 = x + o(attn(rope(qkv(norm1(x)))))):
/// dL/dx2 = dy + norm2ᵀ(gu ᵀ(swigluᵀ(downᵀ dy))), dL/dx = dx2 + norm1ᵀ(qkvᵀ(ropeᵀ(attnᵀ(oᵀ dx2)))).
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_backward<B: Backend, M: DerefMut<Target = B::Buf>>(
    be: &B,
    g: &mut LayerGrads<M>,
    dw: &mut B::Buf,
    a: &LayerActs<M>,
    w: &B::WBuf,
    lay: &LayerLayout,
    x: &B::Buf,
    (cos, sin): (&B::Buf, &B::Buf),
    ad: AttnDims,
    f: usize,
) {
    let n = ad.n();
    let c = x.len() / n;
    let (nc, qkv, hd) = (n * c, ad.qkv_width(), ad.h * ad.d);
    // y = x2 + m: the residual passes dy to x2 unchanged.
    be.copy(vm(&mut g.dx2, nc), v(&g.dres, nc));
    // m = s @ Wdownᵀ
    be.matmul_backward(
        Some(vm(&mut g.ds, n * f)),
        dw.slice_mut(lay.wdown.clone()),
        None,
        v(&g.dres, nc),
        v(&a.s, n * f),
        w.slice(lay.wdown.clone()),
        n,
        f,
        c,
    );
    be.swiglu_backward(vm(&mut g.dgu, n * 2 * f), v(&g.ds, n * f), v(&a.gu, n * 2 * f), n, f);
    be.matmul_backward(
        Some(vm(&mut g.dh, nc)),
        dw.slice_mut(lay.wgu.clone()),
        None,
        v(&g.dgu, n * 2 * f),
        v(&a.h2, nc),
        w.slice(lay.wgu.clone()),
        n,
        c,
        2 * f,
    );
    be.rmsnorm_backward(
        vm(&mut g.dx2, nc),
        dw.slice_mut(lay.ln2.clone()),
        v(&g.dh, nc),
        v(&a.x2, nc),
        w.slice(lay.ln2.clone()),
        v(&a.rstd2, n),
        NormDims::new(c, 0.0),
    );
    // x2 = x + o: dx starts as dx2.
    be.copy(vm(&mut g.dres, nc), v(&g.dx2, nc));
    be.matmul_backward(
        Some(vm(&mut g.datt, n * hd)),
        dw.slice_mut(lay.wo.clone()),
        None,
        v(&g.dx2, nc),
        v(&a.att, n * hd),
        w.slice(lay.wo.clone()),
        n,
        hd,
        c,
    );
    be.attention_backward(
        vm(&mut g.dqkv, n * qkv),
        v(&g.datt, n * hd),
        v(&a.qkv, n * qkv),
        v(&a.att, n * hd),
        v(&a.lse, n * ad.h),
        ad,
    );
    be.rope_backward(vm(&mut g.dqkv, n * qkv), cos, sin, ad);
    {
        // dW_qkv and db_qkv are disjoint ranges of one buffer: split it once.
        let (dweight, dbias) = match &lay.bqkv {
            Some(rb) => {
                let (lo, hi) = dw.split_at_mut(rb.start);
                (lo.slice_mut(lay.wqkv.clone()), Some(hi.slice_mut(0..rb.len())))
            }
            None => (dw.slice_mut(lay.wqkv.clone()), None),
        };
        be.matmul_backward(
            Some(vm(&mut g.dh, nc)),
            dweight,
            dbias,
            v(&g.dqkv, n * qkv),
            v(&a.h1, nc),
            w.slice(lay.wqkv.clone()),
            n,
            c,
            qkv,
        );
    }
    be.rmsnorm_backward(
        vm(&mut g.dres, nc),
        dw.slice_mut(lay.ln1.clone()),
        v(&g.dh, nc),
        x,
        w.slice(lay.ln1.clone()),
        v(&a.rstd1, n),
        NormDims::new(c, 0.0),
    );
}

/// Sizes of one head pass: `n` rows, chunks of `chunk` rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadDims {
    pub n: usize,
    pub c: usize,
    pub v: usize,
    pub chunk: usize,
    pub eps: f32,
    /// 1 / (loss-carrying positions of the whole batch).
    pub scale: f32,
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
    /// (C) accumulates (+=).
    pub dnorm_w: &'a mut B::Buf,
    /// (V, C) accumulates (+=).
    pub dhead_w: &'a mut B::Buf,
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
    let HeadDims { n, c, v: vocab, chunk, eps, scale } = hd;
    let nc = n * c;
    be.rmsnorm_forward(vm(&mut hb.hf, nc), vm(&mut hb.rstd, n), x, norm_w, NormDims::new(c, eps));
    for r0 in (0..n).step_by(chunk) {
        let rows = chunk.min(n - r0);
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
            out.losses.slice_mut(r0..r0 + rows),
            targets.slice(r0..r0 + rows),
            rows,
            vocab,
            scale,
        );
        be.matmul_backward(
            Some(hb.dhf.slice_mut(hf_rows.clone())),
            &mut *out.dhead_w,
            None,
            v(&hb.logits, rows * vocab),
            hb.hf.slice(hf_rows),
            head_w,
            rows,
            c,
            vocab,
        );
    }
    // The final norm's backward starts the residual-stream gradient.
    be.zero(&mut *out.dres);
    be.rmsnorm_backward(
        out.dres,
        out.dnorm_w,
        v(&hb.dhf, nc),
        x,
        norm_w,
        v(&hb.rstd, n),
        NormDims::new(c, 0.0),
    );
}
