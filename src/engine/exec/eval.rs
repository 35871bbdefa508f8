//! The held-out loss on the engine's device: a forward-only pass (loss only; no backward, no
//! update) over prepared micro-batches, between two steps, in the step's own buffers.
//!
//! Data flow of one micro-batch (each op on its queue, ordered by events):
//! `ids, targets -> H2D; embedding rows (host) -> H2D x -> [layer l: H2D weights into slot
//! l % 2 (after the compute that last read it); Compute forward, internals in the scratch] ->
//! head: whole (final norm, per chunk of rows: logits -> cross-entropy) or in vocabulary tiles
//! (per tile: H2D tile, statistics; then the losses) -> D2H losses -> host sum (f64)`.
//!
//! It needs no buffer of its own: micro-batch 0's ids, targets, residual sets, losses and
//! staging, the two weight slots, the layer scratch and the head's scratch are all in the
//! memory plan (`Sizes`), and an eval micro-batch is no larger than a training one. The device
//! is synchronised before and after, so the step's schedule never sees eval's use of them
//! (every step uploads its weights and activations afresh). The reference path's
//! `Transformer::forward_loss` runs the same ops in the same order: on the CPU device the
//! losses are the same bits.

use std::sync::Arc;

use anyhow::{Result, bail};
use horizon_backend::{Backend, DeviceSlice, Event, NormDims, Queue, Views};

use super::*;

/// What an eval pass measured: the summed loss and the loss-carrying positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalOutput {
    pub loss_sum: f64,
    pub num_targets: usize,
}

impl EvalOutput {
    /// Mean loss over the loss-carrying positions.
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.num_targets.max(1) as f64
    }
}

impl<D: Device> Engine<D>
where
    D::Backend: 'static,
{
    /// The loss of `mbs` (each at most `micro_batch_size` rows of at most `seq_len` positions)
    /// with the current masters, forward only on the device. Waits for all queued work first
    /// (the optimizer's updates included), and returns with the device idle.
    pub fn eval(&mut self, mbs: Vec<MicroBatch>) -> Result<EvalOutput> {
        if let Some(mb) =
            mbs.iter().find(|mb| mb.b > self.cfg.micro_batch_size || mb.t > self.cfg.seq_len)
        {
            bail!(
                "an eval micro-batch of {}x{} tokens; the engine was planned for {}x{}",
                mb.b,
                mb.t,
                self.cfg.micro_batch_size,
                self.cfg.seq_len
            );
        }
        self.dev.synchronize();
        self.check_device()?;
        let mut out = EvalOutput { loss_sum: 0.0, num_targets: 0 };
        for mb in mbs {
            let n = mb.n();
            let targets = mb.targets.iter().filter(|&&t| t != -100).count();
            if targets == 0 {
                continue;
            }
            let sd = Arc::new(StepData {
                mbs: vec![mb],
                scale: 1.0,
                adam_step: 0,
                lr: 0.0,
                inject_nan: false,
                next_ids: Vec::new(),
            });
            self.eval_micro_batch(&sd);
            self.dev.synchronize();
            self.check_device()?;
            // SAFETY: the download into micro-batch 0's loss staging has finished (the device
            // is idle) and nothing else writes it until the next step's download.
            let losses = unsafe { self.ctx.loss_host[0].as_const().sub(0..n).as_slice() };
            // Summed per head chunk, in f64, as the reference path sums them.
            let mut sum = 0.0f64;
            for chunk in losses.chunks(self.ctx.head_chunk.max(1)) {
                sum += chunk.iter().map(|&x| x as f64).sum::<f64>();
            }
            out.loss_sum += sum;
            out.num_targets += targets;
        }
        Ok(out)
    }

    /// Queue one micro-batch's forward and losses (micro-batch 0's buffers; the device idle).
    fn eval_micro_batch(&self, sd: &Arc<StepData>) {
        let c = &self.ctx;
        let d = c.layout.dims;
        let mb = &sd.mbs[0];
        let (n, nc) = (mb.n(), mb.n() * d.c);
        self.dev.upload_i32(c.ids[0].prefix(n), mb.ids.clone());
        self.dev.upload_i32(c.targets[0].prefix(n), mb.targets.clone());
        {
            // SAFETY: the device is idle (synchronised by the caller), so no queued work reads
            // the staging buffer or the embedding masters while the main thread gathers.
            let (stage, table) = unsafe {
                (
                    c.emb_stage[0].sub(0..nc).as_mut_slice(),
                    c.params[c.param_index(ParamBuf::Embed)].as_const().as_slice(),
                )
            };
            match &c.base {
                None => embed_rows(stage, &mb.ids, table, &c.layout),
                Some(b) => embed_rows_frozen(stage, &mb.ids, &b.embed, &c.layout),
            }
        }
        self.dev.upload(c.acts[0][0].prefix(nc), c.emb_stage[0].as_const().sub(0..nc));
        // The compute event after the last kernel that read each slot.
        let mut slot_free: [Option<Event>; 2] = [None, None];
        let mut slot_use = 0usize;
        // Weights into slot `s` once its last reader is done; the compute queue waits for them.
        let upload = |slot_free: &[Option<Event>; 2], s: usize, what: Upload| {
            if let Some(e) = &slot_free[s] {
                self.dev.wait(Queue::H2D, e);
            }
            match what {
                Upload::Layer(l, trained) => self.upload_layer_from(c.slots[s], l, trained),
                Upload::Head(rows, w) => self.upload_head_from(c.slots[s], rows, w),
            }
            let up = Event::new();
            self.dev.record(Queue::H2D, &up);
            self.dev.wait(Queue::Compute, &up);
        };
        let done = || {
            let e = Event::new();
            self.dev.record(Queue::Compute, &e);
            Some(e)
        };
        let mut src = 0usize;
        for layer in 0..d.layers {
            let s = slot_use % 2;
            slot_use += 1;
            let i = c.param_index(ParamBuf::Layer(layer));
            upload(&slot_free, s, Upload::Layer(layer, c.upload_src(i)));
            let (inp, out) = (c.acts[src][0], c.acts[1 - src][0]);
            let (cc, sdc) = (c.clone(), sd.clone());
            self.dev.launch(Box::new(move |vw: &dyn Views<D::Backend>| {
                let mb = &sdc.mbs[0];
                let nc = mb.n() * cc.layout.dims.c;
                // SAFETY: distinct buffers; the device runs nothing else meanwhile but this
                // pass's own ops, which events order against this kernel.
                unsafe {
                    let own = cc.scratch.acts.iter().map(|&b| vw.buf_mut(b));
                    let y = Slot::W(vw.buf_mut(out.prefix(nc)));
                    let mut slots = act_slots(vw.buf(inp.prefix(nc)), y, own);
                    let spec = cc.layout.layer(layer);
                    let mut w = cc.weights_in(vw, layer, cc.slots[s]);
                    let rows = Rows { b: mb.b, t: mb.t };
                    let ropes = ropes(vw, &cc, mb.t);
                    layer_forward(vw.backend(), spec, &mut slots, &mut w, &ropes, rows);
                }
            }));
            slot_free[s] = done();
            src = 1 - src;
        }
        let x = c.acts[src][0];
        let norm = c.upload_src(c.param_index(ParamBuf::FinalNorm));
        let head = c.upload_src(c.param_index(c.head_param()));
        let tiles = c.tiled.as_ref().map_or(1, |t| t.tiling.tiles());
        for k in 0..tiles {
            let s = slot_use % 2;
            slot_use += 1;
            let rows = c.tiled.as_ref().map_or(0..d.v, |t| t.tiling.range(k));
            upload(&slot_free, s, Upload::Head(rows.clone(), (norm, head)));
            let (cc, last) = (c.clone(), k + 1 == tiles);
            self.dev.launch(Box::new(move |vw: &dyn Views<D::Backend>| {
                let norm = cc.layout.final_norm();
                let w = vw.wbuf(cc.slots[s]);
                let tile_w = w.slice(d.c..d.c + rows.len() * d.c);
                // SAFETY: as for the layers.
                unsafe {
                    let losses = vw.buf_mut(cc.losses[0].prefix(n));
                    let targets = vw.ibuf(cc.targets[0].prefix(n));
                    let x = vw.buf(x.prefix(n * d.c));
                    match (&cc.scratch.head, &cc.tiled) {
                        (Some(h), _) => {
                            let (hf, rstd) = (vw.buf_mut(h.hf), vw.buf_mut(h.rstd));
                            let logits = vw.buf_mut(h.logits);
                            let hd = (n, d.v, cc.head_chunk, norm);
                            head_loss(
                                vw.backend(),
                                losses,
                                hf,
                                rstd,
                                logits,
                                x,
                                w.slice(0..d.c),
                                tile_w,
                                targets,
                                hd,
                            );
                        }
                        (None, Some(t)) => {
                            let td = TileDims {
                                n,
                                chunk: cc.head_chunk,
                                v0: rows.start,
                                vt: rows.len(),
                                norm,
                                scale: 1.0,
                            };
                            let mut tr = tile_rows(vw, t.rows[0]);
                            let x = (k == 0).then_some(x);
                            tile_stats(
                                vw.backend(),
                                &mut tr,
                                vw.buf_mut(t.logits),
                                x,
                                w.slice(0..d.c),
                                tile_w,
                                targets,
                                td,
                            );
                            if last {
                                vw.backend().cross_entropy_tile_loss(
                                    losses,
                                    tr.stats.slice(0..n * STATS),
                                    targets,
                                    n,
                                );
                            }
                        }
                        (None, None) => unreachable!("a head is whole or tiled"),
                    }
                }
            }));
            slot_free[s] = done();
        }
        let losses_ready = slot_free[(slot_use - 1) % 2].take().expect("the head ran");
        self.dev.wait(Queue::D2H, &losses_ready);
        self.dev.download(c.loss_host[0].sub(0..n), c.losses[0].prefix(n));
    }
}

/// The whole head, forward only: `x (N, C) -> final norm -> hf -> [per chunk of rows: logits =
/// hf Wᵀ -> cross-entropy] -> losses (N)`, as `Transformer::forward_loss`.
/// `hd` = (N, V, chunk rows, the final norm).
#[allow(clippy::too_many_arguments)]
fn head_loss<B: Backend + ?Sized>(
    be: &B,
    losses: &mut B::Buf,
    hf: &mut B::Buf,
    rstd: &mut B::Buf,
    logits: &mut B::Buf,
    x: &B::Buf,
    norm_w: &B::WBuf,
    head_w: &B::WBuf,
    targets: &B::IBuf,
    (n, v, chunk, norm): (usize, usize, usize, NormDims),
) {
    let c = norm.c;
    be.rmsnorm_forward(hf.slice_mut(0..n * c), rstd.slice_mut(0..n), x, norm_w, norm);
    for r0 in (0..n).step_by(chunk.max(1)) {
        let rows = chunk.min(n - r0);
        let l = logits.slice_mut(0..rows * v);
        be.matmul_forward(l, hf.slice(r0 * c..(r0 + rows) * c), head_w, None, rows, c, v);
        let (l, t) = (logits.slice(0..rows * v), targets.slice(r0..r0 + rows));
        be.cross_entropy_forward(losses.slice_mut(r0..r0 + rows), l, t, rows, v);
    }
}

/// What the eval pass uploads into a slot.
enum Upload {
    /// Layer `l`, its trained part at the pointer.
    Layer(usize, Trained),
    /// The final norm and head rows (the trained norm and head in full fine-tuning).
    Head(std::ops::Range<usize>, (Trained, Trained)),
}
