//! The host queue's dispatcher: gradient accumulation and the embedding's scatter, the step's
//! norm, and the optimizer's updates. One function per op kind; each binds host buffers through
//! the op's grant and calls `optim` for the numerics (`optim::step` for the norm, the clip
//! coefficients and the seeds, `optim::moments` and `optim::adamw` for AdamW).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use horizon_backend::bf16::add_bf16;
use horizon_backend::cpu::add_inplace;
use horizon_backend::{Device, HostPtrMut};

use super::ctx::{Ctx, Grant, MomentHandle, Slabs};
use super::upload::stage_weights;
use super::{Engine, StepData};
use crate::engine::phases::Phase;
use crate::engine::plan::{GradTarget, OpKind, ParamBuf, Res, SlotContent};
use crate::model::transformer::embed_rows_backward;
use crate::optim::adamw::{
    AdamWStep, BufferStep, ROW_TASK, adamw_update_local, clip_coefficient, row_runs, sum_squares,
    sum_squares_rows,
};
use crate::optim::moments::{AnyMoments, Moments};
use crate::optim::step::update_seed;

impl<D: Device> Engine<D>
where
    D::Backend: 'static,
{
    /// Queue `f` on the host queue with the context and the step's data, and add its time to
    /// `phase`.
    fn host_op(
        &self,
        phase: Phase,
        sd: &Arc<StepData>,
        grant: &Grant,
        f: impl FnOnce(&Ctx, &StepData, &Grant) + Send + 'static,
    ) {
        let (ctx, sd, g) = (self.ctx.clone(), sd.clone(), grant.clone());
        let pool = self.host_pool.clone();
        self.dev.host(Box::new(move || {
            let t0 = Instant::now();
            pool.install(|| f(&ctx, &sd, &g));
            if sd.timed {
                ctx.phases.add(phase, t0);
            }
        }));
    }

    /// Submit an op of the host queue (gradient accumulation, norms, optimizer updates). A
    /// frozen embedding (an adapter run) has no gradient to scatter and no update.
    pub(super) fn dispatch_host(&self, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        use Phase::{Gradients, Optimizer};
        let trains_embedding = self.ctx.layout.trains_base();
        let streamed = self.ctx.memory.streams_updates();
        match kind {
            OpKind::AccumulateGrads { slab, what } => {
                self.host_op(Gradients, sd, grant, move |c, _, g| accumulate(c, g, slab, what))
            }
            OpKind::EmbedScatter { m } if trains_embedding => {
                self.host_op(Gradients, sd, grant, move |c, sd, g| embed_scatter(c, sd, g, m))
            }
            OpKind::EmbedScatter { .. } => {}
            OpKind::PoisonGrad { what } => {
                self.host_op(Optimizer, sd, grant, move |c, sd, g| poison(c, sd, g, what))
            }
            OpKind::Measure { what } => {
                self.host_op(Optimizer, sd, grant, move |c, sd, g| measure(c, sd, g, what))
            }
            OpKind::MeasureSlab { slab, layer } => {
                self.host_op(Optimizer, sd, grant, move |c, sd, g| {
                    measure_slab(c, sd, g, slab, layer)
                })
            }
            OpKind::SlabUpdate { slab, layer } => {
                self.host_op(Optimizer, sd, grant, move |c, sd, g| {
                    slab_update(c, sd, g, slab, layer)
                })
            }
            OpKind::GradNorm if streamed => self.host_op(Optimizer, sd, grant, streamed_grad_norm),
            OpKind::GradNorm => self.host_op(Optimizer, sd, grant, exact_grad_norm),
            OpKind::HeldSlabUpdate { slab, layer } => {
                self.host_op(Optimizer, sd, grant, move |c, sd, g| {
                    held_slab_update(c, sd, g, slab, layer)
                })
            }
            OpKind::Update { what } => {
                self.host_op(Optimizer, sd, grant, move |c, sd, g| update(c, sd, g, what))
            }
            OpKind::EmbedUpdate { next } if trains_embedding => {
                self.host_op(Optimizer, sd, grant, move |c, sd, g| embed_update(c, sd, g, next))
            }
            OpKind::EmbedUpdate { .. } => {}
            OpKind::StageWeights { slot, what } => {
                self.host_op(Optimizer, sd, grant, move |c, _, g| stage(c, g, slot, what))
            }
            _ => unreachable!("{kind:?} is not an op of this queue"),
        }
    }
}

/// `AccumulateGrads`: a slab into its layer's host gradient, in fp32 whatever the slab's format:
/// the whole layer's, or a part's (a chunked layer's trunk, a chunk of its trained experts)
/// piece by piece where its map puts them.
fn accumulate(ctx: &Ctx, grant: &Grant, slab: usize, what: GradTarget) {
    let (i, map) = match what {
        GradTarget::Layer(i) => (i, ctx.chunking.trunk(i)),
        GradTarget::Experts { layer, chunk } => {
            (layer, ctx.chunking.split(layer).map(|s| &s.chunks[chunk]))
        }
        GradTarget::Head => unreachable!("the head's gradient has no slab"),
    };
    let g = ctx.grads(grant, ParamBuf::Layer(i), true);
    let whole = [(0..g.len(), 0)];
    let pieces = map.map_or(&whole[..], |m| &m.grads[..]);
    // SAFETY: the schedule orders this after the slab's download and before its next one; the
    // gradients are only touched by the host queue.
    unsafe {
        for (r, at) in pieces {
            let (dst, from) = (g.sub(r.clone()).as_mut_slice(), *at..*at + r.len());
            match ctx.slabs(grant, slab, false) {
                Slabs::F32(s) => add_inplace(dst, s[slab].as_const().sub(from).as_slice()),
                Slabs::Bf16(s, _) => add_bf16(dst, s[slab].as_const().sub(from).as_slice()),
            }
        }
    }
}

/// `EmbedScatter`: micro-batch `m`'s residual gradient scatter-added into the embedding rows
/// its tokens name.
fn embed_scatter(ctx: &Ctx, sd: &StepData, grant: &Grant, m: usize) {
    let nc = sd.mbs[m].n() * ctx.layout.dims.c;
    // SAFETY: ordered after the residual gradient's download (and before the next one); the
    // embedding gradient is only touched by the host queue.
    unsafe {
        embed_rows_backward(
            ctx.grads(grant, ParamBuf::Embed, true).as_mut_slice(),
            &sd.mbs[m].ids,
            ctx.staging(grant, Res::DxStage(m), true).sub(0..nc).as_mut_slice(),
            &ctx.layout,
        );
    }
}

/// `PoisonGrad`: the tests' fault injection, a NaN into buffer `what`'s gradient when the step
/// asks for it.
fn poison(ctx: &Ctx, sd: &StepData, grant: &Grant, what: ParamBuf) {
    if sd.inject_nan {
        // SAFETY: the plan declares this write and orders it after the gradient's last write
        // and before its first read of the step.
        unsafe { ctx.grads(grant, what, true).as_mut_slice()[0] = f32::NAN };
    }
}

/// `Measure`: record the squared norm of buffer `what`'s complete host gradient.
fn measure(ctx: &Ctx, sd: &StepData, grant: &Grant, what: ParamBuf) {
    let mut st = ctx.step.stats.lock().expect("no update panicked");
    // SAFETY: ordered after the gradient is complete and before its update; only the host
    // queue touches the gradients.
    let g = unsafe { ctx.grads(grant, what, false).as_const().as_slice() };
    let sq = match what {
        ParamBuf::Embed => embed_sum_squares(ctx, sd, g),
        _ => sum_squares(g),
    };
    st.record(ctx.param_index(what), sq, || loss_sum(ctx, sd, grant));
}

/// Layer `layer`'s gradient in slab `slab`, as fp32.
///
/// # Safety
/// Host queue only, after the slab's download and before its next one; the slice must be
/// dropped before the next call (see [`Slabs::f32_view`]).
unsafe fn slab_gradient<'a>(ctx: &'a Ctx, grant: &Grant, slab: usize, layer: usize) -> &'a [f32] {
    let len = ctx.layout.layer(layer).train_len();
    // SAFETY: the caller's contract.
    unsafe { ctx.slabs(grant, slab, false).f32_view(slab, len) }
}

/// `MeasureSlab`: record the squared norm of layer `layer`'s gradient, which stays in its slab
/// until the step's norm is known.
fn measure_slab(ctx: &Ctx, sd: &StepData, grant: &Grant, slab: usize, layer: usize) {
    let mut st = ctx.step.stats.lock().expect("no update panicked");
    // SAFETY: ordered after the slab's download and before its update.
    let g = unsafe { slab_gradient(ctx, grant, slab, layer) };
    let i = ctx.param_index(ParamBuf::Layer(layer));
    st.record(i, sum_squares(g), || loss_sum(ctx, sd, grant));
}

/// `SlabUpdate`: a streamed update (`lean`/`compact`) of layer `layer` from its complete
/// gradient, before the layers below it are back: record `|g|²`, then, unless the step has met
/// a non-finite loss or gradient (this one's included) or this gradient so clipped is too large
/// for the moments, clip by the estimated norm
/// ([`crate::optim::step::StepStats::streamed_coefficient`]) and apply AdamW. A non-finite
/// value never reaches masters or moments; buffers updated before it was met keep their update.
fn slab_update(ctx: &Ctx, sd: &StepData, grant: &Grant, slab: usize, layer: usize) {
    let i = ctx.param_index(ParamBuf::Layer(layer));
    let mut st = ctx.step.stats.lock().expect("no update panicked");
    // SAFETY: ordered after the slab's download and before its next one; the layer's masters
    // and moments are ordered against its uploads.
    unsafe {
        let g = slab_gradient(ctx, grant, slab, layer);
        if !st.record(i, sum_squares(g), || loss_sum(ctx, sd, grant)) {
            return;
        }
        let Some(coef) = st.streamed_coefficient(i, ctx.grad_clip, sd.adam_step == 1) else {
            return;
        };
        apply_update(ctx, sd, grant, i, g, coef);
    }
    st.mark_applied();
}

/// `GradNorm` of a streamed step: the embedding's squared norm recorded last, then the step's
/// end ([`crate::optim::step::StepStats::finish_streamed`]), whose moment corrections of the
/// run's first updates are applied here.
fn streamed_grad_norm(ctx: &Ctx, sd: &StepData, grant: &Grant) {
    let mut st = ctx.step.stats.lock().expect("no update panicked");
    // SAFETY: ordered after the embedding's scatters; only the host queue touches the gradients.
    let g = unsafe { ctx.grads(grant, ParamBuf::Embed, false).as_const().as_slice() };
    let emb = ctx.param_index(ParamBuf::Embed);
    st.record(emb, embed_sum_squares(ctx, sd, g), || loss_sum(ctx, sd, grant));
    let end = st.finish_streamed(ctx.grad_clip, |i, r| {
        // SAFETY: the schedule orders the norm after the layer's update and before its next.
        unsafe { rescale_moments(ctx, grant, i, r) }
    });
    ctx.step.skip.store(end.skip, Ordering::Release);
    ctx.step.norm.store(end.norm.to_bits(), Ordering::Release);
    // The held updates that follow apply unless the step is skipped.
    ctx.step.applied.store(end.applied, Ordering::Release);
}

/// `GradNorm` of an exact step: the norm from every recorded squared norm, and whether the
/// step's losses and norm are finite. Ordered after every loss download.
fn exact_grad_norm(ctx: &Ctx, sd: &StepData, grant: &Grant) {
    let mut st = ctx.step.stats.lock().expect("no update panicked");
    let end = st.finish_exact(loss_sum(ctx, sd, grant), ctx.grad_clip);
    ctx.step.skip.store(end.skip, Ordering::Release);
    ctx.step.norm.store(end.norm.to_bits(), Ordering::Release);
}

/// `HeldSlabUpdate`: layer `layer`'s update from the slab its gradient waited in, clipped by the
/// step's norm.
fn held_slab_update(ctx: &Ctx, sd: &StepData, grant: &Grant, slab: usize, layer: usize) {
    let i = ctx.param_index(ParamBuf::Layer(layer));
    // SAFETY: ordered after the slab's download and the norm, and before the slab's next
    // download; the layer's masters and moments are ordered against its uploads.
    unsafe { update_after_norm(ctx, sd, grant, i, slab_gradient(ctx, grant, slab, layer)) };
}

/// `Update`: buffer `what`'s update from its host gradient, clipped by the step's norm, then
/// the gradient zeroed.
fn update(ctx: &Ctx, sd: &StepData, grant: &Grant, what: ParamBuf) {
    let i = ctx.param_index(what);
    // SAFETY: the schedule orders this update after every read of these parameters in this step
    // and before every read in the next.
    unsafe { update_and_zero(ctx, sd, grant, i, ctx.grads(grant, what, true)) };
}

/// `EmbedUpdate`: one part of the embedding's update (`next`: the rows the next step gathers).
fn embed_update(ctx: &Ctx, sd: &StepData, grant: &Grant, next: bool) {
    let mut pick = ctx.step.embed_next.lock().expect("no update panicked");
    if next {
        pick_next_rows(ctx, sd, &mut pick);
    }
    // SAFETY: the schedule orders each part after every read of its rows' parameters in this
    // step (the gather's through the norm) and before every read in the next; the parts run in
    // order on the host queue.
    unsafe { update_embed_rows(ctx, sd, grant, &pick, next) };
}

/// `StageWeights`: `what`'s trained weights rounded into slot `slot`'s stage.
fn stage(ctx: &Ctx, grant: &Grant, slot: usize, what: SlotContent) {
    grant.check(Res::WeightStage(slot), true);
    match what {
        SlotContent::Layer(i) => grant.check(Res::Params(ParamBuf::Layer(i)), false),
        _ => {
            grant.check(Res::Params(ParamBuf::FinalNorm), false);
            grant.check(Res::Params(ctx.head_param()), false)
        }
    }
    // SAFETY: the schedule orders this after the stage's last upload and the weights' last
    // write, and before the slot's next upload.
    unsafe { stage_weights(ctx, slot, what) }
}

/// AdamW on buffer `i` with gradient `g` (clip coefficient `coef`), on fp32 or 8-bit moments;
/// the elements it held are counted for the step ([`super::ctx::StepState::add_held`]).
///
/// # Safety
/// The schedule must give the caller exclusive use of buffer `i`'s masters and moments.
unsafe fn apply_update(ctx: &Ctx, sd: &StepData, grant: &Grant, i: usize, g: &[f32], coef: f32) {
    grant.moments(ctx.param_buf(i));
    let st = buffer_step(ctx, sd, i);
    let seed = update_seed(sd.adam_step, i);
    // SAFETY: the caller's exclusivity (the image is part of the buffer's `Params`): the
    // masters and their image are written in the one pass.
    unsafe {
        let image = ctx.hostbufs.images[i].map(|img| img.as_mut_slice());
        let w = ctx.hostbufs.params[i].as_mut_slice();
        let held = moments_of(ctx, i).update(w, g, &st, coef, seed, image);
        ctx.step.add_held(sd.step, i, held);
    }
}

/// Buffer `i`'s update scalars for the step: its no-decay ranges without weight decay.
fn buffer_step<'a>(ctx: &'a Ctx, sd: &StepData, i: usize) -> BufferStep<'a> {
    BufferStep::new(AdamWStep::new(&ctx.adamw, sd.adam_step, sd.lr), ctx.decay.exempt(i))
}

/// Buffer `i`'s optimizer state, in its storage.
///
/// # Safety
/// The caller must have exclusive use of buffer `i`'s moments while the value lives.
unsafe fn moments_of(ctx: &Ctx, i: usize) -> AnyMoments<'_> {
    // SAFETY: the caller's exclusivity.
    unsafe { ctx.hostbufs.moments[i].view() }
}

/// The step's summed loss, from the host loss buffers (downloaded before any caller runs).
fn loss_sum(ctx: &Ctx, sd: &StepData, g: &Grant) -> f64 {
    sd.mbs
        .iter()
        .enumerate()
        .map(|(m, mb)| {
            let host = ctx.staging(g, Res::LossHost(m), false);
            // SAFETY: every caller is ordered after the loss downloads of the step.
            let l = unsafe { host.as_const().sub(0..mb.n()).as_slice() };
            l.iter().map(|&x| x as f64).sum::<f64>()
        })
        .sum()
}

/// The squared norm of the embedding's complete gradient `g`, bit for bit [`sum_squares`]`(g)`.
/// Untied, only the rows the step's tokens name are ever non-zero (the scatters write them; each
/// update zeroes every row), and the fault hook's first element: it reads just those rows,
/// a pass over at most one row per token instead of the whole table.
fn embed_sum_squares(ctx: &Ctx, sd: &StepData, g: &[f32]) -> f64 {
    let mut rows = ctx.step.embed_touched.lock().expect("no update panicked");
    if rows.is_empty() {
        return sum_squares(g);
    }
    rows.fill(false);
    mark_named_rows(&mut rows, sd.mbs.iter().flat_map(|mb| mb.ids.iter()));
    // `OpKind::PoisonGrad` writes the first element.
    rows[0] |= sd.inject_nan;
    let sq = sum_squares_rows(g, ctx.layout.dims.c, &rows);
    debug_assert_eq!(sq.to_bits(), sum_squares(g).to_bits(), "an unnamed row has a gradient");
    sq
}

/// Buffer `i`'s update once the step's norm is known: clipped by it, unless the step is skipped.
///
/// # Safety
/// As [`apply_update`], and ordered after the step's norm op.
unsafe fn update_after_norm(ctx: &Ctx, sd: &StepData, grant: &Grant, i: usize, g: &[f32]) {
    if let Some(coef) = norm_clip(ctx) {
        // SAFETY: the caller's exclusivity.
        unsafe { apply_update(ctx, sd, grant, i, g, coef) };
    }
}

/// [`update_after_norm`], then the gradient zeroed for the next step (a host gradient buffer's
/// whole update).
///
/// # Safety
/// As [`update_after_norm`], with exclusive use of the gradient `g`.
unsafe fn update_and_zero(ctx: &Ctx, sd: &StepData, grant: &Grant, i: usize, g: HostPtrMut) {
    // SAFETY: the caller's exclusivity.
    unsafe {
        let g = g.as_mut_slice();
        update_after_norm(ctx, sd, grant, i, g);
        g.fill(0.0);
    }
}

/// The clip coefficient of the step's norm, or `None` when the step is skipped. Read once the
/// step's norm op has run.
fn norm_clip(ctx: &Ctx) -> Option<f32> {
    let norm = f64::from_bits(ctx.step.norm.load(Ordering::Acquire));
    (!ctx.step.skip.load(Ordering::Acquire)).then(|| clip_coefficient(norm, ctx.grad_clip))
}

/// Mark the embedding rows the first part of its update takes: those the next step gathers,
/// or every row when the caller did not name them or the moments are 8-bit (whose blocks and
/// stochastic rounding span rows).
fn pick_next_rows(ctx: &Ctx, sd: &StepData, pick: &mut [bool]) {
    let i = ctx.param_index(ParamBuf::Embed);
    let all = sd.next_ids.is_empty() || matches!(ctx.hostbufs.moments[i], MomentHandle::Q8(_));
    pick.fill(all);
    mark_named_rows(pick, sd.next_ids.iter().flat_map(|ids| ids.iter()));
}

/// Mark the embedding rows `ids` name; an id outside the table is left for the gather to
/// report.
fn mark_named_rows<'a>(rows: &mut [bool], ids: impl Iterator<Item = &'a i32>) {
    for &id in ids {
        if let Some(r) = usize::try_from(id).ok().and_then(|r| rows.get_mut(r)) {
            *r = true;
        }
    }
}

/// One part of the embedding's update: AdamW (unless the step is skipped) on each run of rows
/// whose `pick` is `want`, then their gradient zeroed. Each element goes through the same
/// update as in [`apply_update`]'s whole-buffer pass, so the two parts end bit-identical to it.
///
/// # Safety
/// The schedule must give the caller exclusive use of those rows' masters, image, gradient and
/// moments. Nothing else of the buffer is borrowed.
unsafe fn update_embed_rows(ctx: &Ctx, sd: &StepData, grant: &Grant, pick: &[bool], want: bool) {
    use rayon::prelude::*;
    let i = ctx.param_index(ParamBuf::Embed);
    grant.moments(ParamBuf::Embed);
    let (p, g) =
        (ctx.params(grant, ParamBuf::Embed, true), ctx.grads(grant, ParamBuf::Embed, true));
    let MomentHandle::F32 { m, v } = ctx.hostbufs.moments[i] else {
        // 8-bit moments: the first part takes every row (`pick_next_rows`).
        if pick.contains(&want) {
            // SAFETY: the caller's exclusivity, over every row.
            unsafe { update_and_zero(ctx, sd, grant, i, g) };
        }
        return;
    };
    let coef = norm_clip(ctx);
    // The embedding is one tensor: one group.
    let st = buffer_step(ctx, sd, i).of(0..p.len());
    let (c, img) = (ctx.layout.dims.c, ctx.hostbufs.images[i]);
    let held = pick.par_chunks(ROW_TASK).enumerate().map(|(t, rows)| {
        let mut held = 0;
        for run in row_runs(rows, want) {
            let e = (t * ROW_TASK + run.start) * c..(t * ROW_TASK + run.end) * c;
            // SAFETY: the caller's exclusivity over these rows; each task borrows its own.
            unsafe {
                let g = g.sub(e.clone()).as_mut_slice();
                if let Some(coef) = coef {
                    let (p, m, v) = (p.sub(e.clone()), m.sub(e.clone()), v.sub(e.clone()));
                    let img = img.map(|x| x.sub(e.clone()).as_mut_slice());
                    let (p, m, v) = (p.as_mut_slice(), m.as_mut_slice(), v.as_mut_slice());
                    held += adamw_update_local(p, img, g, m, v, &st, coef);
                }
                g.fill(0.0);
            }
        }
        held
    });
    ctx.step.add_held(sd.step, i, held.sum());
}

/// Scale buffer `i`'s moments as if its gradient had been multiplied by `r`: `m *= r`,
/// `v *= r²`. Used on the run's first update, whose moments hold that one gradient only, so the
/// result is what clipping by `r` times the coefficient used would have stored. (The masters
/// need no correction: AdamW's first step, `lr · m̂ / (sqrt(v̂) + eps)`, does not depend on the
/// gradient's scale while `|g| >> eps`.)
///
/// # Safety
/// The schedule must give the caller exclusive use of buffer `i`'s moments.
unsafe fn rescale_moments(ctx: &Ctx, grant: &Grant, i: usize, r: f32) {
    grant.check(Res::Moments(ctx.param_buf(i)), true);
    // SAFETY: the caller's exclusivity.
    unsafe { moments_of(ctx, i).rescale(r) }
}
