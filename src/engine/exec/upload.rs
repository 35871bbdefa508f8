//! The host-to-device queue's dispatcher: token ids, the embedding rows (gathered by a host
//! function on the copy queue), residual-stream buffers, and weights into the slots, each slot
//! region by region as [`crate::engine::slots`] describes it. Also the host queue's rounding of
//! a slot's trained weights into its stage, which staged uploads copy.

use std::sync::Arc;
use std::time::Instant;

use horizon_backend::bf16::round_to_bf16;
use horizon_backend::{Bf16, DevBuf, Device, HostPtr, Queue};

use super::ctx::{Ctx, Grant, Trained};
use super::{Engine, StepData};
use crate::engine::phases::Phase;
use crate::engine::plan::{ActSource, Op, OpKind, ParamBuf, Res, SlotContent};
use crate::engine::slots::{FrozenTensor, Source};
use crate::model::base::{Frozen, words_as_f32};
use crate::model::transformer::{embed_rows_bf16, embed_rows_by, embed_rows_frozen};

/// Where an upload takes a slot's trained weights from.
#[derive(Clone, Copy)]
pub(super) enum TrainedFrom {
    /// Each buffer's bf16 image where it has one, else its fp32 masters.
    Buffers,
    /// The slot's stage, which holds the trained regions one after the other.
    Stage(HostPtr<Bf16>),
}

impl<D: Device> Engine<D>
where
    D::Backend: 'static,
{
    /// Submit an op of the host-to-device queue (uploads, and the embedding gather that feeds
    /// them).
    pub(super) fn dispatch_h2d(&self, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        let ctx = &self.ctx;
        match kind {
            OpKind::UploadIds { m } => {
                let (n, (ids, targets)) = (sd.mbs[m].n(), ctx.ids(grant, m, true));
                self.dev.upload_i32(ids.prefix(n), sd.mbs[m].ids.clone());
                self.dev.upload_i32(targets.prefix(n), sd.mbs[m].targets.clone());
            }
            OpKind::EmbedGather { m } => self.gather_embedding(m, sd, grant),
            OpKind::UploadAct { m, set, from } => {
                let nc = sd.mbs[m].n() * ctx.layout.dims.c;
                let src = match from {
                    ActSource::Embedding => Res::EmbStage(m),
                    ActSource::Ckpt(block) => Res::Ckpt { block, m },
                };
                let (src, dst) =
                    (ctx.staging(grant, src, false), ctx.dev(grant, Res::Act { set, m }, true));
                self.dev.upload(dst.prefix(nc), src.as_const().sub(0..nc));
            }
            OpKind::UploadWeights { slot, what } => {
                let dst = ctx.dev(grant, Res::Slot(slot), true);
                // The op's declaration says where the trained weights come from: a staged
                // upload reads the slot's stage, any other the buffers themselves.
                let from = match grant.reads(Res::WeightStage(slot)) {
                    true => TrainedFrom::Stage(ctx.stage(grant, slot, false).as_const()),
                    false => TrainedFrom::Buffers,
                };
                self.upload_slot(grant, dst, what, from);
            }
            _ => unreachable!("{kind:?} is not an op of this queue"),
        }
    }

    /// Micro-batch `m`'s embedding rows into its staging buffer, by a host function on the
    /// copy queue (from the masters, or the frozen base's embedding in an adapter run).
    fn gather_embedding(&self, m: usize, sd: &Arc<StepData>, grant: &Grant) {
        grant.check(Res::EmbedNext, false);
        let ctx = &self.ctx;
        let table = ctx.hostbufs.params[ctx.param_index(ParamBuf::Embed)].as_const();
        // A reference pass gathers from the reference copy (decided now, as the op is queued).
        let reference = ctx.reference_copy(ctx.param_index(ParamBuf::Embed));
        let stage = ctx.staging(grant, Res::EmbStage(m), true);
        let (ctx, sd) = (ctx.clone(), sd.clone());
        self.dev.host_on(
            Queue::H2D,
            Box::new(move || {
                let t0 = Instant::now();
                let c = ctx.layout.dims.c;
                let nc = sd.mbs[m].n() * c;
                // SAFETY: the schedule orders this gather after every write of this staging
                // buffer and of the rows it gathers (`Res::EmbedNext`), and before their next
                // uses. It borrows only those rows: the second part of the previous step's
                // update may be writing the others.
                let out = unsafe { stage.sub(0..nc).as_mut_slice() };
                // SAFETY: as above, for each row gathered.
                let row = |r: usize| unsafe { table.sub(r * c..(r + 1) * c).as_slice() };
                let ids = &sd.mbs[m].ids;
                match (&ctx.base, reference) {
                    // SAFETY: the reference copy is written only while the device is idle.
                    (None, Some(r)) => {
                        embed_rows_bf16(out, ids, unsafe { r.as_slice() }, &ctx.layout)
                    }
                    (None, None) => embed_rows_by(out, ids, row, &ctx.layout),
                    (Some(b), _) => embed_rows_frozen(out, ids, &b.embed, &ctx.layout),
                }
                if sd.timed {
                    ctx.phases.add(Phase::Embedding, t0);
                }
            }),
        );
    }

    /// `what`'s weights into slot `dst`, region by region: trained ones `from` the buffers or
    /// the stage, frozen ones from the base as it is stored (bf16 or fp32), packed words as they
    /// are.
    fn upload_slot(&self, grant: &Grant, dst: DevBuf, what: SlotContent, from: TrainedFrom) {
        let ctx = &self.ctx;
        let mut staged = 0;
        for region in ctx.regions.of(what) {
            match &region.src {
                Source::Trained { buf, range } => {
                    let src = match from {
                        TrainedFrom::Buffers => ctx.upload_src(grant, *buf).sub(range.clone()),
                        TrainedFrom::Stage(stage) => {
                            staged += range.len();
                            Trained::Image(stage.sub(staged - range.len()..staged))
                        }
                    };
                    self.upload_trained(dst, region.at, src);
                }
                Source::Frozen { tensor, range } => {
                    self.upload_frozen(dst, region.at, frozen(ctx, *tensor), range.clone())
                }
                Source::Packed { layer, words, slot_weights } => {
                    let base = ctx.base.as_ref().expect("packed words are a frozen base's");
                    // SAFETY: the base lives in the context's Arc for the engine's whole life
                    // and is never written.
                    let all = unsafe { HostPtr::new(words_as_f32(&base.packed[*layer])) };
                    let (at, n) = (region.at, words.len());
                    let into = ctx.words_region(dst, *slot_weights, at + n).sub(at..at + n);
                    self.dev.upload(into, all.sub(words.clone()));
                }
            }
        }
    }

    /// Trained weights `src` into weights `at..` of slot `dst`.
    fn upload_trained(&self, dst: DevBuf, at: usize, src: Trained) {
        match src {
            Trained::Masters(w) => self.dev.upload_weights(dst, at, w),
            Trained::Image(w) => self.dev.upload_weights_bf16_pinned(dst, at, w),
        }
    }

    /// Frozen values `range` of `src` into weights `at..` of slot `dst`, in their dtype.
    fn upload_frozen(&self, dst: DevBuf, at: usize, src: &Frozen, range: std::ops::Range<usize>) {
        // SAFETY (both arms): the base lives in the context's Arc for the engine's whole life
        // and is never written.
        match src {
            Frozen::F32(v) => self.dev.upload_weights(dst, at, unsafe { HostPtr::new(&v[range]) }),
            Frozen::Bf16(v) => {
                self.dev.upload_weights_bf16(dst, at, unsafe { HostPtr::new(&v[range]) })
            }
        }
    }
}

/// The frozen base's tensor `t`.
fn frozen(ctx: &Ctx, t: FrozenTensor) -> &Frozen {
    let base = ctx.base.as_ref().expect("frozen regions are an adapter run's");
    match t {
        FrozenTensor::Layer(i) => &base.layers[i],
        FrozenTensor::FinalNorm => &base.final_norm,
        FrozenTensor::Head => base.lm_head.as_ref().unwrap_or(&base.embed),
    }
}

/// Rounds `what`'s trained weights into slot `slot`'s stage, its trained regions one after the
/// other (nothing of a frozen head).
///
/// # Safety
/// Nothing else may touch the stage, and nothing may write those weights, meanwhile.
pub(super) unsafe fn stage_weights(ctx: &Ctx, slot: usize, what: SlotContent) {
    // SAFETY: the caller's exclusivity.
    let stage = unsafe { ctx.hostbufs.stages[slot].as_mut_slice() };
    let mut at = 0;
    for region in ctx.regions.of(what) {
        if let Source::Trained { buf, range } = &region.src {
            // SAFETY: the caller's exclusivity: nothing writes these weights meanwhile.
            let w = unsafe { ctx.hostbufs.params[ctx.param_index(*buf)].as_const().as_slice() };
            round_to_bf16(&mut stage[at..at + range.len()], &w[range.clone()]);
            at += range.len();
        }
    }
}

/// The first weight upload into each of the `slots` weight slots in `ops`, as (slot, what).
pub(super) fn first_uploads(ops: &[Op], slots: usize) -> Vec<(usize, SlotContent)> {
    (0..slots)
        .filter_map(|s| {
            ops.iter().find_map(|op| match op.kind {
                OpKind::UploadWeights { slot, what } if slot == s => Some((s, what)),
                _ => None,
            })
        })
        .collect()
}
