//! The device-to-host queue's dispatcher: checkpoints, losses, gradient accumulators into the
//! slabs or straight into the host gradients, the residual gradient.

use std::sync::Arc;

use horizon_backend::Device;

use super::ctx::*;
use super::{Engine, StepData};
use crate::engine::plan::{GradTarget, OpKind, ParamBuf, Res};

impl<D: Device> Engine<D>
where
    D::Backend: 'static,
{
    /// Submit an op of the device-to-host queue (downloads).
    pub(super) fn dispatch_d2h(&self, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        let ctx = &self.ctx;
        let d = ctx.layout.dims;
        match kind {
            OpKind::SaveCkpt { block, m, set } => {
                let nc = sd.mbs[m].n() * d.c;
                let dst = ctx.staging(grant, Res::Ckpt { block, m }, true);
                self.dev.download(
                    dst.sub(0..nc),
                    ctx.dev(grant, Res::Act { set, m }, false).prefix(nc),
                );
            }
            // A frozen head, final norm and embedding have no gradient (an adapter run).
            OpKind::DownloadHeadTileGrads { .. }
            | OpKind::DownloadNormGrads
            | OpKind::DownloadHeadGrads { .. }
            | OpKind::DownloadDres { .. }
                if !ctx.layout.trains_base() => {}
            OpKind::DownloadHeadTileGrads { dw, tile } => {
                let r = ctx.tiled().tiling.range(tile);
                let head = ctx.grads(grant, ctx.head_param(), true);
                let (len, acc) = (r.len() * d.c, ctx.dev(grant, Res::Dw(dw), false));
                self.dev.download(head.sub(r.start * d.c..r.end * d.c), acc.prefix(len));
            }
            OpKind::DownloadNormGrads => {
                let norm = ctx.grads(grant, ParamBuf::FinalNorm, true);
                self.dev.download(norm, ctx.dev(grant, Res::DnormW, false));
            }
            OpKind::DownloadLosses { m } => {
                let (n, host) = (sd.mbs[m].n(), ctx.staging(grant, Res::LossHost(m), true));
                self.dev.download(host.sub(0..n), ctx.dev(grant, Res::Losses(m), false).prefix(n));
            }
            OpKind::DownloadDw { dw, slab, what } => {
                let (len, acc) = (grad_len(ctx, what), ctx.dev(grant, Res::Dw(dw), false));
                match ctx.slabs(grant, slab, true) {
                    Slabs::F32(s) => self.dev.download(s[slab].sub(0..len), acc.prefix(len)),
                    Slabs::Bf16(s, _) => {
                        self.dev.download_bf16(s[slab].sub(0..len), acc.prefix(len))
                    }
                }
            }
            OpKind::DownloadHeadGrads { dw } => {
                let head = ctx.grads(grant, ctx.head_param(), true);
                let norm = ctx.grads(grant, ParamBuf::FinalNorm, true);
                let acc = ctx.dev(grant, Res::Dw(dw), false);
                self.dev.download(norm, acc.sub(0..d.c));
                self.dev.download(head, acc.sub(d.c..d.c + head.len()));
            }
            OpKind::DownloadDres { m } => {
                let nc = sd.mbs[m].n() * d.c;
                let dst = ctx.staging(grant, Res::DxStage(m), true);
                self.dev.download(dst.sub(0..nc), ctx.dev(grant, Res::Dres(m), false).prefix(nc));
            }
            _ => unreachable!("{kind:?} is not an op of this queue"),
        }
    }
}

/// Elements of a gradient download.
fn grad_len(ctx: &Ctx, what: GradTarget) -> usize {
    match what {
        GradTarget::Layer(i) => ctx.chunking.layer_grad(&ctx.layout, i),
        GradTarget::Head => ctx.layout.dims.c + ctx.layout.dims.v * ctx.layout.dims.c,
        GradTarget::Experts { layer, chunk } => {
            ctx.chunking.split(layer).expect("a chunked layer").chunks[chunk].train_len
        }
    }
}
