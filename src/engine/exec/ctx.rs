//! What queued work reaches: the context shared (by reference count) with every closure the
//! executor queues, its handles to host and device buffers, and the grant through which an op
//! reaches them, checked against the op's declaration in the plan.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use horizon_backend::bf16::expand_bf16;
use horizon_backend::{Backend, Bf16, DevBuf, DeviceSlice, HostPtr, HostPtrMut, Views};

use crate::engine::chunking::Chunking;
use crate::engine::head_tiles::HeadTiling;
use crate::engine::phases::PhaseClock;
use crate::engine::plan::{Op, ParamBuf, PlanShape, Res};
use crate::engine::slots::SlotRegions;
use crate::model::base::FrozenBase;
use crate::model::chunks::SlotMap;
use crate::model::layer::{Packed, Weights};
use crate::model::layout::ModelLayout;
use crate::model::transformer::HeadBufs;
use crate::optim::adamw::AdamWConfig;
use crate::optim::adamw8bit::{Moments8, Moments8Mut};
use crate::optim::decay::DecayGroups;
use crate::optim::moments::{AnyMoments, Moments32};
use crate::optim::state::{OptState, OptimizerMemory};
use crate::optim::step::StepStats;

/// A trained buffer's weights as an upload reads them: the fp32 masters (rounded on the way if
/// the slots are bf16), or the buffer's bf16 image.
#[derive(Clone, Copy)]
pub(crate) enum Trained {
    Masters(HostPtr),
    Image(HostPtr<Bf16>),
}

impl Trained {
    pub(super) fn sub(self, r: std::ops::Range<usize>) -> Trained {
        match self {
            Trained::Masters(w) => Trained::Masters(w.sub(r)),
            Trained::Image(w) => Trained::Image(w.sub(r)),
        }
    }
}

/// The compute queue's scratch buffers.
pub(super) struct Scratch {
    /// One layer's internals, as the layer descriptions name them (the widest of each).
    pub(super) acts: Vec<DevBuf>,
    /// The backward program's gradient scratch (the residual gradient is each micro-batch's own
    /// `dres`).
    pub(super) grads: Vec<DevBuf>,
    pub(super) y: DevBuf,
    /// The whole head's scratch (`None` when it is tiled: [`Ctx::tiled`]).
    pub(super) head: Option<HeadBufs<DevBuf>>,
    /// Per rope table: (T, D/2) cos and sin.
    pub(super) ropes: Vec<(DevBuf, DevBuf)>,
    /// A quantised base: the workspace a packed weight is dequantised into before each use
    /// (the largest packed weight, in the backend's precision; empty otherwise).
    pub(super) dequant: DevBuf,
}

/// One micro-batch's internals and gradient scratch in a chunked layer's pass
/// ([`crate::engine::chunking::Carried`]): its own buffers where the pass carries them, the
/// scratch's elsewhere.
pub(super) struct Internals {
    pub(super) acts: Vec<DevBuf>,
    /// The backward program's gradient scratch (as [`Scratch::grads`]).
    pub(super) grads: Vec<DevBuf>,
}

/// The tiled head's device buffers.
pub(super) struct TiledHead {
    pub(super) tiling: HeadTiling,
    /// (chunk, tile rows) logits, then dlogits.
    pub(super) logits: DevBuf,
    /// (chunk, C): a later tile's part of `dhf`, before it is added.
    pub(super) dhf_chunk: DevBuf,
    /// Per micro-batch: (N, C) hf, (N) rstd, (N, 3) stats, (N, C) dhf.
    pub(super) rows: Vec<[DevBuf; 4]>,
    /// (C) the final norm's gradient accumulator.
    pub(super) dnorm: DevBuf,
}

/// Everything queued work needs, shared by reference count with the closures: what the
/// engine was built for, its buffers on the device and on the host, and the step's running
/// state. Queued work reaches buffers through the accessors below, each checked against the
/// op's [`Grant`].
pub(super) struct Ctx {
    pub(super) layout: ModelLayout,
    /// An adapter run's frozen base, read-only for the engine's whole life (the one host
    /// input no op declares, as the rope tables on the device: nothing ever writes it).
    pub(super) base: Option<Arc<FrozenBase>>,
    /// Bytes of one weight in the slots.
    pub(super) weight_bytes: usize,
    pub(super) shape: PlanShape,
    /// Rows of a head chunk.
    pub(super) head_chunk: usize,
    pub(super) adamw: AdamWConfig,
    /// Per host buffer, the element ranges that take no weight decay (`optimizer.no_decay`).
    pub(super) decay: DecayGroups,
    pub(super) grad_clip: f64,
    /// `optimizer.memory`.
    pub(super) memory: OptimizerMemory,
    /// What each weight slot receives, region by region, for each thing it can hold.
    pub(super) regions: SlotRegions,
    /// Which layers stream their experts in chunks, and where their parts sit in the slots.
    pub(super) chunking: Chunking,
    pub(super) devbufs: DeviceBuffers,
    pub(super) hostbufs: HostBuffers,
    pub(super) step: StepState,
    /// A mixture of experts' load-balancing state (the compute queue's).
    pub(super) moe: Option<Mutex<super::moe::MoeState>>,
    /// Seconds of queue work by phase (shared with the engine's kernel timers).
    pub(super) phases: Arc<PhaseClock>,
    /// Set while a reference pass runs (between two steps, the device idle before and after):
    /// uploads and the embedding gather read the reference copy instead of the masters.
    pub(super) reference_pass: std::sync::atomic::AtomicBool,
}

/// Every device buffer of the engine, allocated once ([`super::alloc::alloc_device`]).
pub(super) struct DeviceBuffers {
    /// The two layer slots, then (experts in chunks) the two expert slots.
    pub(super) slots: Vec<DevBuf>,
    /// The backend's workspace (set on the device once).
    pub(super) workspace: DevBuf,
    /// The layers' two gradient accumulators, then (trained experts in chunks) the chunks' two.
    pub(super) dws: Vec<DevBuf>,
    /// [set][m]
    pub(super) acts: Vec<Vec<DevBuf>>,
    pub(super) dres: Vec<DevBuf>,
    pub(super) ids: Vec<DevBuf>,
    pub(super) targets: Vec<DevBuf>,
    pub(super) losses: Vec<DevBuf>,
    pub(super) scratch: Scratch,
    /// [layer][m]: forward internals kept for the backward (`None` for a layer that recomputes
    /// them).
    pub(super) stash: Vec<Option<Vec<Vec<DevBuf>>>>,
    /// Per micro-batch, its internals in a chunked layer's pass (`Res::ExpertRows`;
    /// micro-batch 0's are the scratch's own; empty without chunked layers).
    pub(super) rows: Vec<Internals>,
    /// The head's buffers when it is applied in tiles.
    pub(super) tiled: Option<TiledHead>,
    /// A mixture of experts' (row mask (N), pooled statistics (2E), their gradient (E)):
    /// the compute queue's alone ([`MoeState`]).
    pub(super) moe: Option<[DevBuf; 3]>,
}

/// Handles to the host buffers queued work touches: the host store (owned by the engine's
/// `TrainState`) and the staging buffers (owned by [`super::alloc::HostOwned`]).
pub(super) struct HostBuffers {
    /// Host store, by `param_index`: masters, gradients, moments (gradients of the layers and
    /// fp32 moments are empty where the memory mode does not keep them).
    pub(super) params: Vec<HostPtrMut>,
    pub(super) grads: Vec<HostPtrMut>,
    /// The optimizer state, by `param_index`, in its storage (fp32 or 8-bit moments).
    pub(super) moments: Vec<MomentHandle>,
    /// Per param buffer, its page-locked bf16 image when it has one (`WeightPath::
    /// Image`): written with the masters by every update, uploaded as it is. Declared
    /// by the plan as part of `Res::Params` (the same writers and readers).
    pub(super) images: Vec<Option<HostPtrMut<Bf16>>>,
    /// Per param buffer, its page-locked bf16 reference copy (`EngineConfig::reference_copy`):
    /// the starting weights, read by reference passes only.
    pub(super) reference: Vec<Option<HostPtrMut<Bf16>>>,
    /// Staged uploads (`WeightPath::Staged`): per weight slot, its page-locked bf16 stage
    /// (`Res::WeightStage`), rounded from the masters by `StageWeights`; empty otherwise.
    pub(super) stages: Vec<HostPtrMut<Bf16>>,
    /// [block][m] checkpoints.
    pub(super) ckpt: Vec<Vec<HostPtrMut>>,
    pub(super) slabs: Slabs,
    /// Per micro-batch: the embedding rows, the residual gradient, the losses.
    pub(super) emb_stage: Vec<HostPtrMut>,
    pub(super) dx_stage: Vec<HostPtrMut>,
    pub(super) loss_host: Vec<HostPtrMut>,
}

/// What the host queue's ops of a step share as they run.
pub(super) struct StepState {
    /// What the step has measured of its gradients, and the last finite step's norms.
    pub(super) stats: Mutex<StepStats>,
    /// Streamed updates: some buffer was updated this step.
    pub(super) applied: AtomicBool,
    /// The step's global gradient norm (f64 bits).
    pub(super) norm: AtomicU64,
    /// The step is skipped: its loss or gradient norm is not finite, or too large for the
    /// moments (`optim::step::fits_moments`).
    pub(super) skip: AtomicBool,
    /// Per step parity, per buffer: the elements the step's updates held (their new master or
    /// moment would not have been finite: `optim::adamw`'s "Held elements"). Added to by the
    /// host queue's updates, cleared when a step of that parity is submitted (every op of the
    /// step two before has finished then), read once the step's updates have run.
    pub(super) held: [Vec<AtomicU64>; 2],
    /// Per embedding row, whether the first part of the embedding's update takes it
    /// ([`OpKind::EmbedUpdate`]); only the host queue touches it, in order.
    pub(super) embed_next: Mutex<Vec<bool>>,
    /// Per embedding row, whether the step's tokens name it (`host::embed_sum_squares`); empty
    /// where every row can have a gradient (a tied head's) or none does (a frozen embedding).
    pub(super) embed_touched: Mutex<Vec<bool>>,
}

impl StepState {
    /// Count `n` elements held by step `step`'s update of buffer `i`.
    pub(super) fn add_held(&self, step: u64, i: usize, n: usize) {
        if n > 0 {
            self.held[(step % 2) as usize][i].fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// Forget what the steps of `step`'s parity held (before `step` runs).
    pub(super) fn clear_held(&self, step: u64) {
        self.held[(step % 2) as usize].iter().for_each(|h| h.store(0, Ordering::Relaxed));
    }

    /// The elements step `step` held, per buffer (in buffer order), once its updates have run
    /// (the caller waited for them: that wait orders these loads after the adds).
    pub(super) fn held(&self, step: u64) -> impl Iterator<Item = u64> + '_ {
        self.held[(step % 2) as usize].iter().map(|h| h.load(Ordering::Relaxed))
    }
}

/// The host gradient slabs, in the format layer gradients cross the link in (`engine.grad_wire`).
pub(super) enum Slabs {
    F32(Vec<HostPtrMut>),
    /// bf16 slabs, and one fp32 layer (streamed updates only; empty otherwise) that the host
    /// queue expands a slab into for its AdamW update (one at a time: the host queue is serial).
    Bf16(Vec<HostPtrMut<Bf16>>, HostPtrMut),
}

impl Slabs {
    /// The first `len` gradients of `slab` as fp32: the slab itself, or (bf16) its expansion
    /// into the one fp32 layer.
    ///
    /// # Safety
    /// Host queue only (the expansion layer is shared by every slab), after the slab's download
    /// and before its next one; the slice must be dropped before the next call.
    pub(super) unsafe fn f32_view(&self, slab: usize, len: usize) -> &[f32] {
        // SAFETY: the caller orders this against the slab's download (see above), and the host
        // queue runs one op at a time, so nothing else reads or writes the expansion layer.
        unsafe {
            match self {
                Slabs::F32(s) => s[slab].as_const().sub(0..len).as_slice(),
                Slabs::Bf16(s, expand) => {
                    let g = expand.sub(0..len).as_mut_slice();
                    expand_bf16(g, s[slab].as_const().sub(0..len).as_slice());
                    g
                }
            }
        }
    }
}

/// One buffer's optimizer state, as the host queue's updates reach it.
#[derive(Clone, Copy)]
pub(super) enum MomentHandle {
    F32 { m: HostPtrMut, v: HostPtrMut },
    Q8(Q8Handle),
}

impl MomentHandle {
    /// Handles to every buffer's state (the state's vectors are never resized while they live).
    pub(super) fn all(opt: &mut OptState) -> Vec<MomentHandle> {
        match opt {
            OptState::F32(s) => {
                s.m.buffers_mut()
                    .into_iter()
                    .zip(s.v.buffers_mut())
                    .map(|(m, v)| MomentHandle::F32 { m: handle(m), v: handle(v) })
                    .collect()
            }
            OptState::Q8(s) => {
                s.buffers.iter_mut().map(|q| MomentHandle::Q8(Q8Handle::new(q))).collect()
            }
        }
    }

    /// # Safety
    /// No other view of these moments may be live.
    pub(super) unsafe fn view<'a>(self) -> AnyMoments<'a> {
        // SAFETY: the caller's exclusivity; the pointers are live (see `all`).
        unsafe {
            match self {
                MomentHandle::F32 { m, v } => {
                    AnyMoments::F32(Moments32 { m: m.as_mut_slice(), v: v.as_mut_slice() })
                }
                MomentHandle::Q8(q) => AnyMoments::Q8(q.view()),
            }
        }
    }
}

/// A raw handle to one buffer's 8-bit moments, owned by the engine's `TrainState`.
#[derive(Clone, Copy)]
pub(super) struct Q8Handle {
    pub(super) tensors: *const usize,
    pub(super) n_tensors: usize,
    pub(super) m_codes: *mut u8,
    pub(super) v_codes: *mut u8,
    pub(super) len: usize,
    pub(super) m_absmax: HostPtrMut,
    pub(super) v_absmax: HostPtrMut,
    pub(super) m32: HostPtrMut,
    pub(super) v32: HostPtrMut,
}

// SAFETY: the handle points into vectors the engine owns and never resizes; who touches them
// when is decided by the hazard-checked schedule (only the host queue's updates).
unsafe impl Send for Q8Handle {}

// SAFETY: as above.
unsafe impl Sync for Q8Handle {}

impl Q8Handle {
    pub(super) fn new(q: &mut Moments8) -> Self {
        Q8Handle {
            tensors: q.tensors.as_ptr(),
            n_tensors: q.tensors.len(),
            m_codes: q.m_codes.as_mut_ptr(),
            v_codes: q.v_codes.as_mut_ptr(),
            len: q.m_codes.len(),
            m_absmax: handle(&mut q.m_absmax),
            v_absmax: handle(&mut q.v_absmax),
            m32: handle(&mut q.m32),
            v32: handle(&mut q.v32),
        }
    }

    /// # Safety
    /// No other view of these moments may be live.
    pub(super) unsafe fn view<'a>(self) -> Moments8Mut<'a> {
        // SAFETY: the pointers come from live vectors of `len` elements (see `new`); the
        // caller guarantees exclusivity.
        unsafe {
            Moments8Mut {
                tensors: std::slice::from_raw_parts(self.tensors, self.n_tensors),
                m_codes: std::slice::from_raw_parts_mut(self.m_codes, self.len),
                v_codes: std::slice::from_raw_parts_mut(self.v_codes, self.len),
                m_absmax: self.m_absmax.as_mut_slice(),
                v_absmax: self.v_absmax.as_mut_slice(),
                m32: self.m32.as_mut_slice(),
                v32: self.v32.as_mut_slice(),
            }
        }
    }
}

/// What one op may touch: its plan declaration, handed to the work the executor queues for it.
/// Host buffers of the parameter shape are reached through it ([`Ctx::grads`], [`Ctx::params`],
/// [`Grant::moments`]), so an op touching anything its declaration does not name fails a debug
/// assertion (every engine test runs them): declaration and binding are one fact.
#[derive(Clone, Debug)]
pub(super) struct Grant {
    pub(super) reads: Arc<[Res]>,
    pub(super) writes: Arc<[Res]>,
}

impl Grant {
    pub(super) fn of(op: &Op) -> Self {
        Grant { reads: op.reads.clone().into(), writes: op.writes.clone().into() }
    }

    /// Debug check: the op declares `r` (written when `write`).
    pub(super) fn check(&self, r: Res, write: bool) {
        let ok = self.writes.contains(&r) || (!write && self.reads.contains(&r));
        debug_assert!(
            ok,
            "an op {} {r:?}, which it does not declare (reads {:?}, writes {:?})",
            if write { "writes" } else { "reads" },
            self.reads,
            self.writes
        );
    }

    /// Whether the op declares reading `r` (as a read only).
    pub(super) fn reads(&self, r: Res) -> bool {
        self.reads.contains(&r)
    }

    /// Debug check: the op may update buffer `p`'s masters and moments.
    pub(super) fn moments(&self, p: ParamBuf) {
        self.check(Res::Params(p), true);
        self.check(Res::Moments(p), true);
    }
}

impl Ctx {
    /// Host gradient of `p`, as the op's grant allows (`write`: it writes it).
    pub(super) fn grads(&self, g: &Grant, p: ParamBuf, write: bool) -> HostPtrMut {
        g.check(Res::Grads(p), write);
        self.hostbufs.grads[self.param_index(p)]
    }

    /// Host masters of `p`, as the op's grant allows.
    pub(super) fn params(&self, g: &Grant, p: ParamBuf, write: bool) -> HostPtrMut {
        g.check(Res::Params(p), write);
        self.hostbufs.params[self.param_index(p)]
    }

    /// Device buffer `r` (a weight slot, accumulator, residual-stream buffer or its gradient,
    /// losses, the final norm's accumulator), as the op's grant allows.
    pub(super) fn dev(&self, g: &Grant, r: Res, write: bool) -> DevBuf {
        g.check(r, write);
        match r {
            Res::Slot(s) => self.devbufs.slots[s],
            Res::Dw(i) => self.devbufs.dws[i],
            Res::Act { set, m } => self.devbufs.acts[set][m],
            Res::Dres(m) => self.devbufs.dres[m],
            Res::Losses(m) => self.devbufs.losses[m],
            Res::DnormW => self.tiled().dnorm,
            _ => unreachable!("{r:?} is not one device buffer"),
        }
    }

    /// Micro-batch `m`'s device token ids and targets, as the op's grant allows.
    pub(super) fn ids(&self, g: &Grant, m: usize, write: bool) -> (DevBuf, DevBuf) {
        g.check(Res::Ids(m), write);
        (self.devbufs.ids[m], self.devbufs.targets[m])
    }

    /// Host staging buffer `r` (a checkpoint, the embedding rows, the residual gradient, the
    /// losses), as the op's grant allows.
    pub(super) fn staging(&self, g: &Grant, r: Res, write: bool) -> HostPtrMut {
        g.check(r, write);
        match r {
            Res::Ckpt { block, m } => self.hostbufs.ckpt[block][m],
            Res::EmbStage(m) => self.hostbufs.emb_stage[m],
            Res::DxStage(m) => self.hostbufs.dx_stage[m],
            Res::LossHost(m) => self.hostbufs.loss_host[m],
            _ => unreachable!("{r:?} is not a host staging buffer"),
        }
    }

    /// Slot `slot`'s weight stage, as the op's grant allows.
    pub(super) fn stage(&self, g: &Grant, slot: usize, write: bool) -> HostPtrMut<Bf16> {
        g.check(Res::WeightStage(slot), write);
        self.hostbufs.stages[slot]
    }

    /// The host gradient slabs, for slab `slab`, as the op's grant allows.
    pub(super) fn slabs(&self, g: &Grant, slab: usize, write: bool) -> &Slabs {
        g.check(Res::Slab(slab), write);
        &self.hostbufs.slabs
    }

    /// The compute queue's scratch (one layer's internals and gradients, the head's scratch),
    /// as the op's grant allows.
    pub(super) fn scratch(&self, g: &Grant) -> &Scratch {
        g.check(Res::Scratch, true);
        &self.devbufs.scratch
    }

    /// The buffers layer `layer` runs micro-batch `m`'s internals and gradients in, as the
    /// op's grant allows: the compute queue's scratch, or in a chunked layer's pass the
    /// micro-batch's own (`Res::ExpertRows`), which it keeps apart from the others'.
    pub(super) fn internals(&self, g: &Grant, layer: usize, m: usize) -> (&[DevBuf], &[DevBuf]) {
        let scratch = self.scratch(g);
        if self.chunking.split(layer).is_none() {
            return (&scratch.acts, &scratch.grads);
        }
        g.check(Res::ExpertRows(m), true);
        let rows = &self.devbufs.rows[m];
        (&rows.acts, &rows.grads)
    }

    /// Layer `layer`'s kept internals for micro-batch `m`, if it keeps them, as the op's grant
    /// allows.
    pub(super) fn stash(
        &self,
        g: &Grant,
        layer: usize,
        m: usize,
        write: bool,
    ) -> Option<&[DevBuf]> {
        let kept = self.devbufs.stash[layer].as_ref().map(|s| s[m].as_slice());
        if kept.is_some() {
            g.check(Res::Stash { layer, m }, write);
        }
        kept
    }

    /// The tiled head's logits and `dhf` chunks (part of the compute queue's scratch), as the
    /// op's grant allows.
    pub(super) fn tile_scratch(&self, g: &Grant) -> &TiledHead {
        g.check(Res::Scratch, true);
        self.tiled()
    }

    /// The tiled head's rows of micro-batch `m` (hf, rstd, stats, dhf), as the grant allows.
    pub(super) fn head_rows(&self, g: &Grant, m: usize, write: bool) -> [DevBuf; 4] {
        g.check(Res::HeadRows(m), write);
        self.tiled().rows[m]
    }

    /// The words region of a slot holding `weights` weights and `words` packed words (after
    /// its weights, as the upload put them).
    pub(super) fn words_region(&self, slot: DevBuf, weights: usize, words: usize) -> DevBuf {
        let at = (weights * self.weight_bytes).div_ceil(4);
        slot.sub(at..at + words)
    }

    /// Layer `layer`'s weights in `slot`, as the layer ops read them; the dequantisation
    /// workspace is the compute queue's scratch.
    ///
    /// # Safety
    /// Only inside a compute kernel whose grant holds the slot and the scratch.
    pub(super) unsafe fn layer_weights<'v, B: Backend + ?Sized>(
        &'v self,
        g: &Grant,
        vw: &'v dyn Views<B>,
        layer: usize,
        slot: usize,
    ) -> Weights<'v, B> {
        // SAFETY: the caller's contract.
        unsafe { self.mapped_weights(g, vw, slot, self.chunking.trunk(layer), layer) }
    }

    /// Chunk `chunk` of layer `layer`'s experts in expert slot `slot`, as the layer ops read
    /// them.
    ///
    /// # Safety
    /// As [`Ctx::layer_weights`].
    pub(super) unsafe fn chunk_weights<'v, B: Backend + ?Sized>(
        &'v self,
        g: &Grant,
        vw: &'v dyn Views<B>,
        (layer, chunk): (usize, usize),
        slot: usize,
    ) -> Weights<'v, B> {
        let split = self.chunking.split(layer).expect("a chunked layer");
        // SAFETY: the caller's contract.
        unsafe { self.mapped_weights(g, vw, slot, Some(&split.chunks[chunk]), layer) }
    }

    /// The weights in `slot` laid out by `map` (`None`: the whole of layer `layer`).
    ///
    /// # Safety
    /// As [`Ctx::layer_weights`].
    unsafe fn mapped_weights<'v, B: Backend + ?Sized>(
        &'v self,
        g: &Grant,
        vw: &'v dyn Views<B>,
        slot: usize,
        map: Option<&'v SlotMap>,
        layer: usize,
    ) -> Weights<'v, B> {
        let sb = self.dev(g, Res::Slot(slot), false);
        let dequant = self.scratch(g).dequant;
        let spec = self.layout.layer(layer);
        let (len, words) = map.map_or((spec.len, spec.packed), |m| (m.len, m.packed));
        let packed = (words > 0).then(|| Packed {
            words: vw.buf(self.words_region(sb, len, words)),
            // SAFETY: the scratch is the compute queue's, and this kernel's (the caller's
            // contract); nothing else views the workspace while the layer runs.
            ws: unsafe { vw.wbuf_mut(dequant) },
        });
        Weights { slot: vw.wbuf(sb).slice(0..len), packed, moe: None, map }
    }

    /// The buffer at `param_index` `i`.
    pub(super) fn param_buf(&self, i: usize) -> ParamBuf {
        let l = self.layout.dims.layers;
        match i {
            0 => ParamBuf::Embed,
            i if i <= l => ParamBuf::Layer(i - 1),
            i if i == l + 1 => ParamBuf::FinalNorm,
            _ => ParamBuf::Head,
        }
    }

    pub(super) fn param_index(&self, p: ParamBuf) -> usize {
        param_index(self.layout.dims.layers, p)
    }
    pub(super) fn head_param(&self) -> ParamBuf {
        self.shape.head_buf()
    }
    /// Buffer `p`'s trained weights for an upload, as the op's grant allows: its image if it
    /// has one, else its masters.
    pub(super) fn upload_src(&self, g: &Grant, p: ParamBuf) -> Trained {
        g.check(Res::Params(p), false);
        let i = self.param_index(p);
        if let Some(r) = self.reference_copy(i) {
            return Trained::Image(r);
        }
        match self.hostbufs.images[i] {
            Some(img) => Trained::Image(img.as_const()),
            None => Trained::Masters(self.hostbufs.params[i].as_const()),
        }
    }
    /// Buffer `i`'s reference copy while a reference pass runs.
    pub(super) fn reference_copy(&self, i: usize) -> Option<HostPtr<Bf16>> {
        let on = self.reference_pass.load(std::sync::atomic::Ordering::Acquire);
        if !on {
            return None;
        }
        let copy = self.hostbufs.reference[i].expect("a reference pass needs the copy");
        Some(copy.as_const())
    }
    pub(super) fn tiled(&self) -> &TiledHead {
        self.devbufs.tiled.as_ref().expect("the plan tiles the head only when the engine does")
    }
}

/// Buffer `p`'s index among a `layers`-layer model's buffers, in the order of
/// `ParamStore::buffers`.
pub(super) fn param_index(layers: usize, p: ParamBuf) -> usize {
    match p {
        ParamBuf::Embed => 0,
        ParamBuf::Layer(i) => 1 + i,
        ParamBuf::FinalNorm => layers + 1,
        ParamBuf::Head => layers + 2,
    }
}

/// A raw handle to a host buffer that stays where it is for the engine's life.
pub(super) fn handle<T>(s: &mut [T]) -> HostPtrMut<T> {
    // SAFETY: every buffer handed out here is owned by the engine (boxed state or staging
    // vectors that are never resized) and outlives the device, which is dropped first; who
    // touches it when is decided by the hazard-checked schedule.
    unsafe { HostPtrMut::new(s) }
}

/// The binding's assertions exist only in debug builds.
#[cfg(all(test, debug_assertions))]
mod tests {
    use super::*;

    /// An op that touches what its declaration does not name fails the binding's assertion.
    #[test]
    fn touching_an_undeclared_resource_is_caught() {
        let g = Grant {
            reads: vec![Res::Grads(ParamBuf::Embed)].into(),
            writes: vec![Res::Norm].into(),
        };
        g.check(Res::Grads(ParamBuf::Embed), false);
        g.check(Res::Norm, true);
        let write = std::panic::catch_unwind(|| g.check(Res::Grads(ParamBuf::Embed), true));
        assert!(write.is_err(), "a read-only gradient written");
        let other = std::panic::catch_unwind(|| g.check(Res::Grads(ParamBuf::FinalNorm), false));
        assert!(other.is_err(), "an undeclared gradient read");
        let moments = std::panic::catch_unwind(|| g.moments(ParamBuf::Layer(0)));
        assert!(moments.is_err(), "an undeclared update");
    }
}
