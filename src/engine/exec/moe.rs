//! A mixture of experts in the engine: the compute queue's state of the pass's load balancing.
//!
//! Every sparse layer runs inside one compute kernel, on the compute queue alone, so the
//! buffers here (a micro-batch's row mask, the step's pooled statistics, their gradient) need no
//! plan resource: the queue's order is theirs. A step's first forwards pool the statistics;
//! the first sparse layer backward of the step (every forward of the step is before it in the
//! queue) turns them into the aux loss and its gradient, and zeroes them for the next step.
//! Recomputes and evaluations pool nothing.

use std::sync::Mutex;

use horizon_backend::{Backend, DevBuf, DeviceSlice, Views};

use super::StepData;
use crate::model::layout::ModelLayout;
use crate::model::moe::{MoeHost, MoeIo, aux_loss};

/// The compute queue's host side of a sparse model's passes.
pub(super) struct MoeState {
    /// Per micro-batch, the dispatch sort's host side: a chunked layer's pass sorts each
    /// micro-batch's rows at its first chunk and reads the sort at the others.
    host: Vec<MoeHost>,
    host_stats: Vec<f32>,
    host_grad: Vec<f32>,
    /// Statistics are pooled and not turned into the loss yet.
    pending: bool,
    /// The last finished step's aux loss and its trained coefficient.
    aux: Option<(f64, f64)>,
}

impl MoeState {
    /// Sized for `mbs` micro-batches of `n` rows (`None` for a dense model).
    pub(super) fn new(layout: &ModelLayout, n: usize, mbs: usize) -> Option<Mutex<Self>> {
        let m = layout.moe.as_ref()?;
        let e = m.num_experts;
        Some(Mutex::new(MoeState {
            host: (0..mbs).map(|_| MoeHost::new(n * m.top_k, e)).collect(),
            host_stats: vec![0.0; 2 * e],
            host_grad: vec![0.0; e],
            pending: false,
            aux: None,
        }))
    }

    /// The last finished step's (aux loss, coefficient).
    pub(super) fn aux(&self) -> Option<(f64, f64)> {
        self.aux
    }

    /// A sparse layer's view for a forward over micro-batch `m` of `sd`: its mask uploaded, the
    /// statistics pooled when `pool` (a step's first forward).
    ///
    /// # Safety
    /// Only inside a compute kernel: the buffers are the compute queue's.
    pub(super) unsafe fn forward<'v, B: Backend + ?Sized>(
        &'v mut self,
        vw: &'v dyn Views<B>,
        [mask, stats, _]: [DevBuf; 3],
        sd: &StepData,
        m: usize,
        pool: bool,
    ) -> MoeIo<'v, B> {
        self.pending |= pool;
        MoeIo {
            host: &mut self.host[m],
            // SAFETY: the caller's contract.
            mask: Some(unsafe { upload_mask(vw, mask, sd, m) }),
            // SAFETY: the caller's contract; the statistics are viewed once here.
            stats: pool.then(|| unsafe { vw.buf_mut(stats) }),
            grad: None,
        }
    }

    /// A sparse layer's view for a backward over micro-batch `m`: the step's statistics first
    /// turned into the loss and its gradient when that is still pending.
    ///
    /// # Safety
    /// Only inside a compute kernel: the buffers are the compute queue's.
    pub(super) unsafe fn backward<'v, B: Backend + ?Sized>(
        &'v mut self,
        vw: &'v dyn Views<B>,
        bufs: [DevBuf; 3],
        sd: &StepData,
        m: usize,
        layout: &ModelLayout,
    ) -> MoeIo<'v, B> {
        let [mask, stats, grad] = bufs;
        let be = vw.backend();
        if self.pending {
            // SAFETY: the caller's contract; these views end within this block.
            unsafe {
                be.download(&mut self.host_stats, vw.buf(stats));
                let real = sd.mbs.iter().flat_map(|mb| mb.mask.iter()).map(|&x| x as f64).sum();
                self.aux = Some(aux_loss(&self.host_stats, layout, real, &mut self.host_grad));
                be.upload(vw.buf_mut(grad), &self.host_grad);
                be.zero(vw.buf_mut(stats));
            }
            self.pending = false;
        }
        let trained = self.aux.is_some_and(|(_, coef)| coef > 0.0);
        MoeIo {
            host: &mut self.host[m],
            // SAFETY: the caller's contract.
            mask: Some(unsafe { upload_mask(vw, mask, sd, m) }),
            stats: None,
            grad: trained.then(|| vw.buf(grad)),
        }
    }
}

/// Micro-batch `m`'s row mask uploaded into `mask`, and its view (N).
///
/// # Safety
/// Only inside a compute kernel: the mask is the compute queue's, and no other view of it is
/// live.
unsafe fn upload_mask<'v, B: Backend + ?Sized>(
    vw: &'v dyn Views<B>,
    mask: DevBuf,
    sd: &StepData,
    m: usize,
) -> &'v B::Buf {
    let n = sd.mbs[m].n();
    // SAFETY: the caller's contract; the writable view ends before the returned one.
    unsafe { vw.backend().upload(vw.buf_mut(mask).slice_mut(0..n), &sd.mbs[m].mask[..n]) };
    vw.buf(mask).slice(0..n)
}
