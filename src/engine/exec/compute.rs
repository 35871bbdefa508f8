//! The compute queue's dispatcher: one kernel launch per op kind (a layer's forward, the head
//! whole or in tiles, a layer's backward with its recompute), each binding its buffers through
//! the op's grant.

use std::sync::Arc;

use horizon_backend::NormDims;
use horizon_backend::{Backend, DevBuf, Device, DeviceSlice, Kernel, Views};

use super::ctx::*;
use super::{Engine, StepData};
use crate::engine::head_tiles::{STATS, TileDims, TileRows, tile_finish, tile_grad, tile_stats};
use crate::engine::phases::Phase;
use crate::engine::plan::{OpKind, Res};
use crate::model::layer::{
    ExpertChunk, Part, Rows, Slot, Weights, act_slots, grad_slots, layer_backward_part,
    layer_forward_part, layer_rebuild,
};
use crate::model::transformer::{HeadBufs, HeadDims, HeadGrads, head_forward_backward};

impl<D: Device> Engine<D>
where
    D::Backend: 'static,
{
    /// Submit an op of the compute queue (kernels).
    pub(super) fn dispatch_compute(&self, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        let ctx = &self.ctx;
        match kind {
            OpKind::Forward { layer, slot, m, src, dst, recompute } => {
                let phase = if recompute { Phase::Recompute } else { Phase::Forward };
                let inp = ctx.dev(grant, Res::Act { set: src, m }, false);
                let at = (layer, slot, m);
                // A chunked layer's forward runs the ops before its experts: no output yet.
                let (out, part) = match ctx.chunking.split(layer) {
                    Some(_) => (ctx.scratch(grant).y, Part::Before),
                    None => (ctx.dev(grant, Res::Act { set: dst, m }, true), Part::Whole),
                };
                self.launch_layer_forward(phase, at, (inp, out), (Some(layer), part), sd, grant);
            }
            OpKind::ForwardExperts { layer, chunk, slot, m, src, first, recompute } => {
                let phase = if recompute { Phase::Recompute } else { Phase::Forward };
                let inp = ctx.dev(grant, Res::Act { set: src, m }, false);
                let out = ctx.scratch(grant).y;
                let part = self.chunk_part(layer, chunk, first);
                self.launch_layer_forward(
                    phase,
                    (layer, slot, m),
                    (inp, out),
                    (None, part),
                    sd,
                    grant,
                );
            }
            OpKind::ForwardEnd { layer, slot, m, src, dst, recompute } => {
                let phase = if recompute { Phase::Recompute } else { Phase::Forward };
                let inp = ctx.dev(grant, Res::Act { set: src, m }, false);
                let out = ctx.dev(grant, Res::Act { set: dst, m }, true);
                let at = (layer, slot, m);
                self.launch_layer_forward(phase, at, (inp, out), (None, Part::After), sd, grant);
            }
            OpKind::ZeroDw { dw } => self.zero(Phase::Backward, Res::Dw(dw), sd, grant),
            OpKind::HeadStats { tile, slot, m, src } => {
                self.launch_head_stats((tile, slot, m, src), sd, grant)
            }
            OpKind::HeadGrad { tile, slot, m, dw, first } => {
                self.launch_head_grad((tile, slot, m, dw), first, sd, grant);
            }
            OpKind::HeadFinish { slot, m, src } => {
                self.launch_head_finish((slot, m, src), sd, grant)
            }
            OpKind::ZeroDnorm => self.zero(Phase::Head, Res::DnormW, sd, grant),
            OpKind::Head { slot, m, src, dw } => {
                self.launch_whole_head((slot, m, src, dw), sd, grant)
            }
            OpKind::HeadLoss { slot, m, src } => self.launch_head_loss((slot, m, src), sd, grant),
            OpKind::TileLosses { m } => self.launch_tile_losses(m, sd, grant),
            OpKind::Backward { layer, slot, m, set, dw } => {
                // A chunked layer's experts recompute in their own chunks' backwards.
                let chunked = ctx.chunking.split(layer).is_some();
                if ctx.devbufs.stash[layer].is_none() {
                    // Rebuild the layer's internals into the scratch first: its own task, so
                    // its time counts as recompute.
                    let inp = ctx.dev(grant, Res::Act { set, m }, false);
                    let at = (layer, slot, m);
                    let out = ctx.scratch(grant).y;
                    let part = if chunked { Part::Trunk } else { Part::Whole };
                    let io = (inp, out);
                    self.launch_layer_forward(Phase::Recompute, at, io, (None, part), sd, grant);
                }
                let part = if chunked { Part::After } else { Part::Whole };
                self.launch_layer_backward((layer, slot, m, set, dw), part, sd, grant);
            }
            OpKind::BackwardExperts { layer, chunk, slot, m, set, dw, first } => {
                let part = self.chunk_part(layer, chunk, first);
                self.launch_layer_backward((layer, slot, m, set, dw), part, sd, grant);
            }
            OpKind::BackwardEnd { layer, slot, m, set, dw } => {
                if ctx.shape.micro_batches > 1 {
                    // The other micro-batches' passes have used the scratch since this one's
                    // recompute: rebuild the internals before the experts (`Carried`).
                    let inp = ctx.dev(grant, Res::Act { set, m }, false);
                    let (at, out) = ((layer, slot, m), ctx.scratch(grant).y);
                    let part = (None, Part::Before);
                    self.launch_layer_forward(Phase::Recompute, at, (inp, out), part, sd, grant);
                }
                self.launch_layer_backward((layer, slot, m, set, dw), Part::Before, sd, grant);
            }
            _ => unreachable!("{kind:?} is not an op of this queue"),
        }
    }

    /// Queue `f` as one compute task with the context, the step's data and the op's grant;
    /// its device time counts to `phase` when the work is a step's.
    fn kernel(
        &self,
        phase: Phase,
        sd: &Arc<StepData>,
        grant: &Grant,
        f: impl FnOnce(&Ctx, &StepData, &Grant, &dyn Views<D::Backend>) + Send + 'static,
    ) {
        let (ctx, step, g) = (self.ctx.clone(), sd.clone(), grant.clone());
        self.launch_phase(phase, sd.timed, Box::new(move |vw| f(&ctx, &step, &g, vw)));
    }

    /// Zero the gradient accumulator `acc` (a `Dw` or the final norm's).
    fn zero(&self, phase: Phase, acc: Res, sd: &Arc<StepData>, grant: &Grant) {
        self.kernel(phase, sd, grant, move |ctx, _, g, vw| {
            let acc = ctx.dev(g, acc, true);
            // SAFETY: the schedule orders this kernel after the accumulator's last download.
            unsafe { vw.backend().zero(vw.buf_mut(acc)) };
        });
    }

    /// Enqueue kernels on the compute queue; their device time counts to `phase` (a compute
    /// phase) when `timed` (a step's work, not an evaluation's).
    fn launch_phase(&self, phase: Phase, timed: bool, k: Kernel<D::Backend>) {
        match timed {
            true => self.dev.launch_timed(k, self.timers[phase as usize].clone()),
            false => self.dev.launch(k),
        }
    }

    /// Chunk `chunk` of layer `layer`'s experts as a part of its pass.
    fn chunk_part(&self, layer: usize, chunk: usize, first: bool) -> Part {
        let split = self.ctx.chunking.split(layer).expect("a chunked layer");
        Part::Experts(ExpertChunk { experts: split.experts_of(chunk), first })
    }

    /// Layer `layer`'s weights in `slot` for `part`: a chunk of its experts from an expert
    /// slot, else what its layer slot holds.
    ///
    /// # Safety
    /// As [`Ctx::layer_weights`].
    unsafe fn part_weights<'v>(
        ctx: &'v Ctx,
        g: &Grant,
        vw: &'v dyn Views<D::Backend>,
        (layer, slot): (usize, usize),
        part: &Part,
    ) -> Weights<'v, D::Backend> {
        // SAFETY: the caller's contract.
        unsafe {
            match part {
                Part::Experts(ch) => {
                    let per = ctx.chunking.split(layer).expect("a chunked layer").per_chunk;
                    ctx.chunk_weights(g, vw, (layer, ch.experts.start / per), slot)
                }
                _ => ctx.layer_weights(g, vw, layer, slot),
            }
        }
    }

    /// A layer's forward (`part` of it) on micro-batch `m`, `inp` -> `out` (prefixes of the
    /// micro-batch's rows), with weights in `slot`; its internals go to the layer's kept
    /// buffers where `kept_of` names a layer that keeps them, else to the scratch.
    fn launch_layer_forward(
        &self,
        phase: Phase,
        (layer, slot, m): (usize, usize, usize),
        (inp, out): (DevBuf, DevBuf),
        (kept_of, part): (Option<usize>, Part),
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        self.kernel(phase, sd, grant, move |ctx, sd, g, vw| {
            let d = ctx.layout.dims;
            let mb = &sd.mbs[m];
            let nc = mb.n() * d.c;
            // SAFETY: the buffers viewed are distinct, and the schedule orders this kernel
            // against every other queue's use of them (the scratch is the compute queue's).
            unsafe {
                let kept = kept_of.and_then(|l| ctx.stash(g, l, m, true));
                let own = match kept {
                    Some(kept) => kept,
                    None => ctx.internals(g, layer, m).0,
                };
                let own = own.iter().map(|&b| vw.buf_mut(b));
                let out = Slot::W(vw.buf_mut(out.prefix(nc)));
                let mut slots = act_slots(vw.buf(inp.prefix(nc)), out, own);
                let spec = ctx.layout.layer(layer);
                let mut w = Self::part_weights(ctx, g, vw, (layer, slot), &part);
                let mut moe = ctx.moe.as_ref().map(|s| s.lock().expect("moe state"));
                if let (Some(st), Some(bufs)) = (moe.as_deref_mut(), ctx.devbufs.moe) {
                    // The routing (in the whole layer, or the part before the experts) pools.
                    let routes = matches!(part, Part::Whole | Part::Before);
                    let pool = phase == Phase::Forward && sd.timed && routes;
                    w.moe = Some(st.forward(vw, bufs, sd, m, pool));
                }
                let rows = Rows { b: mb.b, t: mb.t };
                let ropes = ropes(vw, ctx, mb.t);
                layer_forward_part(vw.backend(), spec, &mut slots, &mut w, &ropes, rows, &part);
            }
        });
    }

    /// Sizes of a tile pass over micro-batch `m`.
    fn tile_dims<'a>(ctx: &Ctx, sd: &'a StepData, tile: usize, m: usize) -> TileDims<'a> {
        let r = ctx.tiled().tiling.range(tile);
        TileDims {
            n: sd.mbs[m].n(),
            chunk: ctx.head_chunk,
            v0: r.start,
            vt: r.len(),
            norm: ctx.layout.final_norm(),
            scale: sd.scale,
            row_scales: sd.row_scales_of(m),
        }
    }

    /// Tiled head, pass 1: micro-batch `m`'s statistics over tile `tile` (in `slot`); tile 0
    /// first runs the final norm of `Act{src}`.
    fn launch_head_stats(
        &self,
        (tile, slot, m, src): (usize, usize, usize, usize),
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        self.kernel(Phase::Head, sd, grant, move |ctx, sd, g, vw| {
            let d = ctx.layout.dims;
            let td = Self::tile_dims(ctx, sd, tile, m);
            let (n, vt) = (td.n, td.vt);
            // SAFETY: the buffers viewed are distinct, and the schedule orders this kernel
            // against every other queue's use of them (the head's rows and chunk are the
            // compute queue's).
            unsafe {
                let x = (tile == 0)
                    .then(|| vw.buf(ctx.dev(g, Res::Act { set: src, m }, false).prefix(n * d.c)));
                let w = vw.wbuf(ctx.dev(g, Res::Slot(slot), false));
                let (targets, scratch) = (ctx.ids(g, m, false).1, ctx.tile_scratch(g));
                tile_stats(
                    vw.backend(),
                    &mut tile_rows(vw, ctx.head_rows(g, m, true)),
                    vw.buf_mut(scratch.logits),
                    x,
                    w.slice(0..d.c),
                    w.slice(d.c..d.c + vt * d.c),
                    vw.ibuf(targets.prefix(n)),
                    td,
                );
            }
        });
    }

    /// Tiled head, pass 2: micro-batch `m`'s dlogits over tile `tile` (in `slot`), its part of
    /// `dhf` (`first`: overwrites) and the tile's gradient into `Dw{dw}`.
    fn launch_head_grad(
        &self,
        (tile, slot, m, dw): (usize, usize, usize, usize),
        first: bool,
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        self.kernel(Phase::Head, sd, grant, move |ctx, sd, g, vw| {
            let d = ctx.layout.dims;
            let td = Self::tile_dims(ctx, sd, tile, m);
            let vtc = td.vt * d.c;
            // SAFETY: as for pass 1; the accumulator is ordered against its downloads.
            unsafe {
                let scratch = ctx.tile_scratch(g);
                tile_grad(
                    vw.backend(),
                    &mut tile_rows(vw, ctx.head_rows(g, m, true)),
                    vw.buf_mut(scratch.logits),
                    vw.buf_mut(scratch.dhf_chunk),
                    ctx.layout
                        .trains_base()
                        .then(|| vw.buf_mut(ctx.dev(g, Res::Dw(dw), true).prefix(vtc))),
                    vw.wbuf(ctx.dev(g, Res::Slot(slot), false)).slice(d.c..d.c + vtc),
                    vw.ibuf(ctx.ids(g, m, false).1.prefix(td.n)),
                    first,
                    td,
                );
            }
        });
    }

    /// Tiled head, after the last tile: micro-batch `m`'s losses and the final norm's
    /// backward (its weight read from `slot`) from `Act{src}`.
    fn launch_head_finish(
        &self,
        (slot, m, src): (usize, usize, usize),
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        self.kernel(Phase::Head, sd, grant, move |ctx, sd, g, vw| {
            let d = ctx.layout.dims;
            let (n, nc) = (sd.mbs[m].n(), sd.mbs[m].n() * d.c);
            // SAFETY: as for pass 1.
            unsafe {
                tile_finish(
                    vw.backend(),
                    &tile_rows(vw, ctx.head_rows(g, m, false)),
                    vw.buf_mut(ctx.dev(g, Res::Losses(m), true).prefix(n)),
                    vw.buf_mut(ctx.dev(g, Res::Dres(m), true).prefix(nc)),
                    ctx.layout.trains_base().then(|| vw.buf_mut(ctx.dev(g, Res::DnormW, true))),
                    vw.buf(ctx.dev(g, Res::Act { set: src, m }, false).prefix(nc)),
                    vw.wbuf(ctx.dev(g, Res::Slot(slot), false)).slice(0..d.c),
                    vw.ibuf(ctx.ids(g, m, false).1.prefix(n)),
                    n,
                    ctx.layout.final_norm(),
                );
            }
        });
    }

    /// The whole head on micro-batch `m`: final norm, LM head and cross-entropy, forward and
    /// backward, from `Act{src}` with the weights in `slot`, gradients into `Dw{dw}`.
    fn launch_whole_head(
        &self,
        (slot, m, src, dw): (usize, usize, usize, usize),
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        self.kernel(Phase::Head, sd, grant, move |ctx, sd, g, vw| {
            let d = ctx.layout.dims;
            let mb = &sd.mbs[m];
            let (n, nc, vc) = (mb.n(), mb.n() * d.c, d.v * d.c);
            let h = ctx.scratch(g).head.as_ref().expect("a whole head has its scratch");
            let (acc, w) = (ctx.dev(g, Res::Dw(dw), true), ctx.dev(g, Res::Slot(slot), false));
            // A frozen head and final norm get no gradient (an adapter run).
            let trains = ctx.layout.trains_base();
            // SAFETY: as for the forward kernel.
            unsafe {
                let mut hb = HeadBufs {
                    hf: vw.buf_mut(h.hf),
                    dhf: vw.buf_mut(h.dhf),
                    rstd: vw.buf_mut(h.rstd),
                    logits: vw.buf_mut(h.logits),
                };
                head_forward_backward(
                    vw.backend(),
                    &mut hb,
                    HeadGrads {
                        losses: vw.buf_mut(ctx.dev(g, Res::Losses(m), true).prefix(n)),
                        dres: vw.buf_mut(ctx.dev(g, Res::Dres(m), true).prefix(nc)),
                        dnorm_w: trains.then(|| vw.buf_mut(acc.sub(0..d.c))),
                        dhead_w: trains.then(|| vw.buf_mut(acc.sub(d.c..d.c + vc))),
                    },
                    vw.buf(ctx.dev(g, Res::Act { set: src, m }, false).prefix(nc)),
                    vw.wbuf(w).slice(0..d.c),
                    vw.wbuf(w).slice(d.c..d.c + vc),
                    vw.ibuf(ctx.ids(g, m, false).1.prefix(n)),
                    HeadDims {
                        n,
                        v: d.v,
                        chunk: ctx.head_chunk,
                        norm: ctx.layout.final_norm(),
                        scale: sd.scale,
                        row_scales: sd.row_scales_of(m),
                    },
                );
            }
        });
    }

    /// An evaluation's whole head on micro-batch `m`, forward only: final norm, then per chunk
    /// of rows the logits and each row's loss, from `Act{src}` with the weights in `slot`.
    fn launch_head_loss(
        &self,
        (slot, m, src): (usize, usize, usize),
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        self.kernel(Phase::Head, sd, grant, move |ctx, sd, g, vw| {
            let d = ctx.layout.dims;
            let n = sd.mbs[m].n();
            let h = ctx.scratch(g).head.as_ref().expect("a whole head has its scratch");
            let w = vw.wbuf(ctx.dev(g, Res::Slot(slot), false));
            // SAFETY: the buffers viewed are distinct, and the plan orders this kernel
            // against every other queue's use of them (the head's scratch is the compute
            // queue's).
            unsafe {
                head_loss(
                    vw.backend(),
                    vw.buf_mut(ctx.dev(g, Res::Losses(m), true).prefix(n)),
                    HeadBufs {
                        hf: vw.buf_mut(h.hf),
                        dhf: vw.buf_mut(h.dhf),
                        rstd: vw.buf_mut(h.rstd),
                        logits: vw.buf_mut(h.logits),
                    },
                    vw.buf(ctx.dev(g, Res::Act { set: src, m }, false).prefix(n * d.c)),
                    (w.slice(0..d.c), w.slice(d.c..d.c + d.v * d.c)),
                    vw.ibuf(ctx.ids(g, m, false).1.prefix(n)),
                    (n, d.v, ctx.head_chunk, ctx.layout.final_norm()),
                );
            }
        });
    }

    /// An evaluation's tiled head, after the last tile's statistics: micro-batch `m`'s losses.
    fn launch_tile_losses(&self, m: usize, sd: &Arc<StepData>, grant: &Grant) {
        self.kernel(Phase::Head, sd, grant, move |ctx, sd, g, vw| {
            let n = sd.mbs[m].n();
            let [_, _, stats, _] = ctx.head_rows(g, m, false);
            // SAFETY: as for the head's other kernels.
            unsafe {
                vw.backend().cross_entropy_tile_loss(
                    vw.buf_mut(ctx.dev(g, Res::Losses(m), true).prefix(n)),
                    vw.buf(stats).slice(0..n * STATS),
                    vw.ibuf(ctx.ids(g, m, false).1.prefix(n)),
                    n,
                );
            }
        });
    }

    /// A layer's backward on micro-batch `m` from its input `Act{set}`, weights in `slot`,
    /// internals kept by its forward or rebuilt just before into the scratch; its weight
    /// gradients accumulate into `Dw{dw}`.
    fn launch_layer_backward(
        &self,
        (layer, slot, m, set, dw): (usize, usize, usize, usize, usize),
        part: Part,
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        self.kernel(Phase::Backward, sd, grant, move |ctx, sd, g, vw| {
            let d = ctx.layout.dims;
            let mb = &sd.mbs[m];
            let nc = mb.n() * d.c;
            let spec = ctx.layout.layer(layer);
            let scratch = ctx.scratch(g);
            // SAFETY: as for the forward kernel; the recompute (if any) was enqueued just
            // before, on this queue.
            unsafe {
                // Kept by this layer's forward (what it did not keep, in the scratch, is
                // rebuilt first), or rebuilt by the recompute just before.
                let kept = ctx.stash(g, layer, m, false);
                let (acts, grads) = ctx.internals(g, layer, m);
                let own = kept.unwrap_or(acts);
                let x = vw.buf(ctx.dev(g, Res::Act { set, m }, false).prefix(nc));
                let y = Slot::R(vw.buf(scratch.y));
                let mut acts = act_slots(x, y, own.iter().map(|&b| vw.buf_mut(b)));
                let mut w = Self::part_weights(ctx, g, vw, (layer, slot), &part);
                let mut moe = ctx.moe.as_ref().map(|s| s.lock().expect("moe state"));
                if let (Some(st), Some(bufs)) = (moe.as_deref_mut(), ctx.devbufs.moe) {
                    w.moe = Some(st.backward(vw, bufs, sd, m, &ctx.layout));
                }
                let rows = Rows { b: mb.b, t: mb.t };
                if kept.is_some() {
                    layer_rebuild(vw.backend(), spec, &mut acts, &mut w, rows);
                }
                let gs = grads.iter().map(|&b| vw.buf_mut(b));
                let mut grads = grad_slots(vw.buf_mut(ctx.dev(g, Res::Dres(m), true)), gs);
                layer_backward_part(
                    vw.backend(),
                    spec,
                    &mut grads,
                    vw.buf_mut(
                        ctx.dev(g, Res::Dw(dw), true)
                            .prefix(w.map.map_or(spec.train_len(), |m| m.train_len)),
                    ),
                    &acts,
                    &mut w,
                    &ropes(vw, ctx, mb.t),
                    rows,
                    &part,
                );
            }
        });
    }
}

/// Views of micro-batch `m`'s tiled-head rows: hf, rstd, stats, dhf.
///
/// # Safety
/// No other view of these buffers may be live.
unsafe fn tile_rows<'a, B: Backend + ?Sized>(
    vw: &'a dyn Views<B>,
    [hf, rstd, stats, dhf]: [DevBuf; 4],
) -> TileRows<'a, B> {
    // SAFETY: four distinct buffers; the caller's exclusivity.
    unsafe {
        TileRows {
            hf: vw.buf_mut(hf),
            rstd: vw.buf_mut(rstd),
            stats: vw.buf_mut(stats),
            dhf: vw.buf_mut(dhf),
        }
    }
}

/// The rope tables' (cos, sin) for sequences of `t` positions.
fn ropes<'a, B: Backend + ?Sized>(
    vw: &'a dyn Views<B>,
    ctx: &Ctx,
    t: usize,
) -> Vec<(&'a B::Buf, &'a B::Buf)> {
    let len = t * ctx.layout.dims.d / 2;
    let table = |&(cos, sin): &(DevBuf, DevBuf)| (vw.buf(cos.prefix(len)), vw.buf(sin.prefix(len)));
    // The rope tables are written once, before the first step, and only read after: no op
    // declares them.
    ctx.devbufs.scratch.ropes.iter().map(table).collect()
}

/// The whole head, forward only: `x (N, C) -> final norm -> hf -> [per chunk of rows: logits =
/// hf Wᵀ -> cross-entropy] -> losses (N)`, as `Transformer::forward_loss` computes it.
/// `hd` = (N, V, chunk rows, the final norm); `hb.dhf` is not used.
fn head_loss<B: Backend + ?Sized>(
    be: &B,
    losses: &mut B::Buf,
    hb: HeadBufs<&mut B::Buf>,
    x: &B::Buf,
    (norm_w, head_w): (&B::WBuf, &B::WBuf),
    targets: &B::IBuf,
    (n, v, chunk, norm): (usize, usize, usize, NormDims),
) {
    let c = norm.c;
    let (hf, rstd, logits) = (hb.hf, hb.rstd, hb.logits);
    be.rmsnorm_forward(hf.slice_mut(0..n * c), rstd.slice_mut(0..n), x, norm_w, norm);
    for r0 in (0..n).step_by(chunk.max(1)) {
        let rows = chunk.min(n - r0);
        let l = logits.slice_mut(0..rows * v);
        be.matmul_forward(l, hf.slice(r0 * c..(r0 + rows) * c), head_w, None, rows, c, v);
        let (l, t) = (logits.slice(0..rows * v), targets.slice(r0..r0 + rows));
        be.cross_entropy_forward(losses.slice_mut(r0..r0 + rows), l, t, rows, v);
    }
}
