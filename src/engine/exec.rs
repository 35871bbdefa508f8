//! The executor: allocates every device and host buffer once (sizes from [`Sizes`]), then runs
//! the [`Schedule`]'s operations on a [`Device`]'s queues, step after step. The host store
//! (`TrainState`) is owned here; queued host work reaches it through raw handles built once,
//! and the plan's hazard-checked waits decide who touches what when.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use horizon_backend::bf16::{add_bf16, expand_bf16, round_to_bf16};
use horizon_backend::cpu::add_inplace;
use horizon_backend::threads::{self, Placement};
use horizon_backend::{
    Backend, Bf16, DevBuf, Device, DeviceSlice, Event, HostPtr, HostPtrMut, Kernel, KernelTimer,
    Queue, Views,
};

use crate::engine::head_tiles::{
    HeadTiling, STATS, TileDims, TileRows, tile_finish, tile_grad, tile_stats,
};
use crate::engine::options::{EngineConfig, GradWire, WeightPath};
use crate::engine::phases::{Phase, PhaseClock, PhaseSeconds};
use crate::engine::plan::{
    ActSource, GradTarget, OpKind, ParamBuf, PlanShape, Res, Schedule, SlotContent, Wait,
    keeps_internals,
};
pub use crate::engine::sizes::Sizes;
use crate::engine::trace::{OpMarks, Span};
use crate::hf::config::ModelConfig;
use crate::model::base::{Frozen, FrozenBase, words_as_f32};
use crate::model::layer::{
    Packed, Rows, Slot, Weights, act_slots, grad_slots, layer_backward, layer_forward,
    layer_rebuild,
};
use crate::model::layout::ModelLayout;
use crate::model::spec::LayerSpec;
use crate::model::transformer::{
    HeadBufs, HeadDims, HeadGrads, embed_rows, embed_rows_backward, embed_rows_by,
    embed_rows_frozen, head_forward_backward, rope_tables,
};
use crate::optim::adamw::{
    AdamWConfig, AdamWStep, ROW_TASK, adamw_update_local, clip_coefficient, row_runs, sum_squares,
    sum_squares_rows,
};
use crate::optim::adamw8bit::{Moments8, Moments8Mut};
use crate::optim::moments::{AnyMoments, Moments, Moments32};
use crate::optim::state::OptState;
use crate::optim::state::OptimizerMemory;
use crate::store::TrainState;

mod eval;
pub use eval::EvalOutput;

/// The shape of the plan the engine runs for `layout` under `cfg` (sized by `sizes`).
pub fn plan_shape(layout: &ModelLayout, cfg: &EngineConfig, sizes: &Sizes) -> PlanShape {
    PlanShape {
        layers: layout.dims.layers,
        micro_batches: cfg.micro_batches(),
        checkpoint_every: cfg.checkpoint_every,
        grad_slabs: cfg.grad_slabs,
        tied: layout.tied,
        head_tiles: sizes.head.tiles(),
        kept_layers: cfg.kept_layers,
        streamed: cfg.memory.streams_updates(),
        staged: cfg.weight_path() == WeightPath::Staged,
    }
}

/// A trained buffer's weights as an upload reads them: the fp32 masters (rounded on the way if
/// the slots are bf16), or the buffer's bf16 image.
#[derive(Clone, Copy)]
pub(crate) enum Trained {
    Masters(HostPtr),
    Image(HostPtr<Bf16>),
}

impl Trained {
    fn sub(self, r: std::ops::Range<usize>) -> Trained {
        match self {
            Trained::Masters(w) => Trained::Masters(w.sub(r)),
            Trained::Image(w) => Trained::Image(w.sub(r)),
        }
    }
}

/// The page-locked bf16 images of `params` the engine uploads from (`WeightPath::Image` on a
/// bf16 backend): one per buffer the device receives (not an untied embedding, gathered on
/// the host from the masters; not the empty buffers of an adapter run), each the masters
/// rounded to nearest even.
fn weight_images<D: Device>(
    dev: &D,
    params: &crate::model::params::ParamStore,
    layout: &ModelLayout,
    cfg: &EngineConfig,
) -> Vec<Option<D::Staging<Bf16>>> {
    let on = cfg.weight_path() == WeightPath::Image;
    params
        .buffers()
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let uploaded = i > 0 || layout.tied;
            (on && uploaded && !p.is_empty()).then(|| {
                let mut s = dev.alloc_staging::<Bf16>(p.len());
                round_to_bf16(&mut s, p);
                s
            })
        })
        .collect()
}

/// The compute queue's scratch buffers.
struct Scratch {
    /// One layer's internals, as the layer descriptions name them (the widest of each).
    acts: Vec<DevBuf>,
    /// The backward program's gradient scratch (the residual gradient is each micro-batch's own
    /// `dres`).
    grads: Vec<DevBuf>,
    y: DevBuf,
    /// The whole head's scratch (`None` when it is tiled: [`Ctx::tiled`]).
    head: Option<HeadBufs<DevBuf>>,
    /// Per rope table: (T, D/2) cos and sin.
    ropes: Vec<(DevBuf, DevBuf)>,
    /// A quantised base: the workspace a packed weight is dequantised into before each use
    /// (the largest packed weight, in the backend's precision; empty otherwise).
    dequant: DevBuf,
}

/// The tiled head's device buffers.
struct TiledHead {
    tiling: HeadTiling,
    /// (chunk, tile rows) logits, then dlogits.
    logits: DevBuf,
    /// (chunk, C): a later tile's part of `dhf`, before it is added.
    dhf_chunk: DevBuf,
    /// Per micro-batch: (N, C) hf, (N) rstd, (N, 3) stats, (N, C) dhf.
    rows: Vec<[DevBuf; 4]>,
    /// (C) the final norm's gradient accumulator.
    dnorm: DevBuf,
}

/// Everything queued work needs, shared by reference count with the closures.
struct Ctx {
    layout: ModelLayout,
    /// An adapter run's frozen base, read-only for the engine's whole life (the one host
    /// input no op declares, as the rope tables on the device: nothing ever writes it).
    base: Option<Arc<FrozenBase>>,
    /// Bytes of one weight in the slots.
    weight_bytes: usize,
    shape: PlanShape,
    head_chunk: usize,
    adamw: AdamWConfig,
    grad_clip: f64,
    slots: [DevBuf; 2],
    dws: [DevBuf; 2],
    /// The head's buffers when it is applied in tiles.
    tiled: Option<TiledHead>,
    /// [set][m]
    acts: Vec<Vec<DevBuf>>,
    dres: Vec<DevBuf>,
    ids: Vec<DevBuf>,
    targets: Vec<DevBuf>,
    losses: Vec<DevBuf>,
    scratch: Scratch,
    /// `optimizer.memory`.
    memory: OptimizerMemory,
    /// Host store, by `param_index`: masters, gradients, moments (gradients of the layers and
    /// fp32 moments are empty where the memory mode does not keep them).
    params: Vec<HostPtrMut>,
    /// Per param buffer, its page-locked bf16 image when it has one (`WeightPath::
    /// Image`): written with the masters by every update, uploaded as it is. Declared
    /// by the plan as part of `Res::Params` (the same writers and readers).
    images: Vec<Option<HostPtrMut<Bf16>>>,
    /// Staged uploads (`WeightPath::Staged`): per weight slot, its page-locked bf16 stage
    /// (`Res::WeightStage`), rounded from the masters by `StageWeights`; empty otherwise.
    stages: Vec<HostPtrMut<Bf16>>,
    /// The optimizer state, by `param_index`, in its storage (fp32 or 8-bit moments).
    moments: Vec<MomentHandle>,
    /// Streamed updates: what the step has measured so far, and the last finite step's norms.
    stats: Mutex<StepStats>,
    /// Streamed updates: some buffer was updated this step.
    applied: AtomicBool,
    grads: Vec<HostPtrMut>,
    /// Host buffers: [block][m] checkpoints, gradient slabs, per-micro-batch staging.
    ckpt: Vec<Vec<HostPtrMut>>,
    slabs: Slabs,
    emb_stage: Vec<HostPtrMut>,
    dx_stage: Vec<HostPtrMut>,
    loss_host: Vec<HostPtrMut>,
    /// The step's global gradient norm (f64 bits).
    norm: AtomicU64,
    /// The step is skipped: its loss or gradient norm is not finite.
    skip: AtomicBool,
    /// Per embedding row, whether the first part of the embedding's update takes it
    /// ([`OpKind::EmbedUpdate`]); only the host queue touches it, in order.
    embed_next: Mutex<Vec<bool>>,
    /// Per embedding row, whether the step's tokens name it ([`embed_sum_squares`]); empty
    /// where every row can have a gradient (a tied head's) or none does (a frozen embedding).
    embed_touched: Mutex<Vec<bool>>,
    /// Seconds of queue work by phase (shared with the engine's kernel timers).
    phases: Arc<PhaseClock>,
    /// [layer][m]: forward internals kept for the backward (`None` for a layer that recomputes
    /// them).
    stash: Vec<Option<Vec<Vec<DevBuf>>>>,
}

/// The host gradient slabs, in the format layer gradients cross the link in (`engine.grad_wire`).
enum Slabs {
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
    unsafe fn f32_view(&self, slab: usize, len: usize) -> &[f32] {
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

/// What the streamed updates of one step have seen (host queue only).
struct StepStats {
    /// Squared L2 norm of each buffer's gradient, by `param_index` (valid where `seen`).
    sq: Vec<f64>,
    /// Which buffers' gradients have been measured this step.
    seen: Vec<bool>,
    /// `sq` of the last step whose norm was finite (empty: none yet). A layer updated before
    /// the step's norm is known estimates it from these (see [`layer_clip_coefficient`]).
    prev_sq: Vec<f64>,
    /// On the run's first update (no `prev_sq`, zero moments), the clip coefficient a layer
    /// was updated with before the norm was known (0: none); the norm op corrects its moments.
    provisional: Vec<f32>,
    /// The step has met a non-finite loss or gradient: no later update is applied.
    poisoned: bool,
    /// The losses have been checked this step.
    loss_checked: bool,
    /// Some buffer has been updated this step.
    applied: bool,
}

/// One buffer's optimizer state, as the host queue's updates reach it.
#[derive(Clone, Copy)]
enum MomentHandle {
    F32 { m: HostPtrMut, v: HostPtrMut },
    Q8(Q8Handle),
}

impl MomentHandle {
    /// Handles to every buffer's state (the state's vectors are never resized while they live).
    fn all(opt: &mut OptState) -> Vec<MomentHandle> {
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
    unsafe fn view<'a>(self) -> AnyMoments<'a> {
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
struct Q8Handle {
    tensors: *const usize,
    n_tensors: usize,
    m_codes: *mut u8,
    v_codes: *mut u8,
    len: usize,
    m_absmax: HostPtrMut,
    v_absmax: HostPtrMut,
    m32: HostPtrMut,
    v32: HostPtrMut,
}

// SAFETY: the handle points into vectors the engine owns and never resizes; who touches them
// when is decided by the hazard-checked schedule (only the host queue's updates).
unsafe impl Send for Q8Handle {}
// SAFETY: as above.
unsafe impl Sync for Q8Handle {}

impl Q8Handle {
    fn new(q: &mut Moments8) -> Self {
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
    unsafe fn view<'a>(self) -> Moments8Mut<'a> {
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
struct Grant {
    reads: Arc<[Res]>,
    writes: Arc<[Res]>,
}

impl Grant {
    fn of(op: &crate::engine::plan::Op) -> Self {
        Grant { reads: op.reads.clone().into(), writes: op.writes.clone().into() }
    }

    /// Debug check: the op declares `r` (written when `write`).
    fn check(&self, r: Res, write: bool) {
        let ok = self.writes.contains(&r) || (!write && self.reads.contains(&r));
        debug_assert!(
            ok,
            "an op {} {r:?}, which it does not declare (reads {:?}, writes {:?})",
            if write { "writes" } else { "reads" },
            self.reads,
            self.writes
        );
    }

    /// Debug check: the op may update buffer `p`'s masters and moments.
    fn moments(&self, p: ParamBuf) {
        self.check(Res::Params(p), true);
        self.check(Res::Moments(p), true);
    }
}

impl Ctx {
    /// Host gradient of `p`, as the op's grant allows (`write`: it writes it).
    fn grads(&self, g: &Grant, p: ParamBuf, write: bool) -> HostPtrMut {
        g.check(Res::Grads(p), write);
        self.grads[self.param_index(p)]
    }

    /// Host masters of `p`, as the op's grant allows.
    fn params(&self, g: &Grant, p: ParamBuf, write: bool) -> HostPtrMut {
        g.check(Res::Params(p), write);
        self.params[self.param_index(p)]
    }

    /// Device buffer `r` (a weight slot, accumulator, residual-stream buffer or its gradient,
    /// losses, the final norm's accumulator), as the op's grant allows.
    fn dev(&self, g: &Grant, r: Res, write: bool) -> DevBuf {
        g.check(r, write);
        match r {
            Res::Slot(s) => self.slots[s],
            Res::Dw(i) => self.dws[i],
            Res::Act { set, m } => self.acts[set][m],
            Res::Dres(m) => self.dres[m],
            Res::Losses(m) => self.losses[m],
            Res::DnormW => self.tiled().dnorm,
            _ => unreachable!("{r:?} is not one device buffer"),
        }
    }

    /// Micro-batch `m`'s device token ids and targets, as the op's grant allows.
    fn ids(&self, g: &Grant, m: usize, write: bool) -> (DevBuf, DevBuf) {
        g.check(Res::Ids(m), write);
        (self.ids[m], self.targets[m])
    }

    /// Host staging buffer `r` (a checkpoint, the embedding rows, the residual gradient, the
    /// losses), as the op's grant allows.
    fn staging(&self, g: &Grant, r: Res, write: bool) -> HostPtrMut {
        g.check(r, write);
        match r {
            Res::Ckpt { block, m } => self.ckpt[block][m],
            Res::EmbStage(m) => self.emb_stage[m],
            Res::DxStage(m) => self.dx_stage[m],
            Res::LossHost(m) => self.loss_host[m],
            _ => unreachable!("{r:?} is not a host staging buffer"),
        }
    }

    /// Slot `slot`'s weight stage, as the op's grant allows.
    fn stage(&self, g: &Grant, slot: usize, write: bool) -> HostPtrMut<Bf16> {
        g.check(Res::WeightStage(slot), write);
        self.stages[slot]
    }

    /// The host gradient slabs, for slab `slab`, as the op's grant allows.
    fn slabs(&self, g: &Grant, slab: usize, write: bool) -> &Slabs {
        g.check(Res::Slab(slab), write);
        &self.slabs
    }

    /// The compute queue's scratch (one layer's internals and gradients, the head's scratch),
    /// as the op's grant allows.
    fn scratch(&self, g: &Grant) -> &Scratch {
        g.check(Res::Scratch, true);
        &self.scratch
    }

    /// Layer `layer`'s kept internals for micro-batch `m`, if it keeps them, as the op's grant
    /// allows.
    fn stash(&self, g: &Grant, layer: usize, m: usize, write: bool) -> Option<&[DevBuf]> {
        let kept = self.stash[layer].as_ref().map(|s| s[m].as_slice());
        if kept.is_some() {
            g.check(Res::Stash { layer, m }, write);
        }
        kept
    }

    /// The tiled head's logits and `dhf` chunks (part of the compute queue's scratch), as the
    /// op's grant allows.
    fn tile_scratch(&self, g: &Grant) -> &TiledHead {
        g.check(Res::Scratch, true);
        self.tiled()
    }

    /// The tiled head's rows of micro-batch `m` (hf, rstd, stats, dhf), as the grant allows.
    fn head_rows(&self, g: &Grant, m: usize, write: bool) -> [DevBuf; 4] {
        g.check(Res::HeadRows(m), write);
        self.tiled().rows[m]
    }

    /// The buffer at `param_index` `i`.
    /// Layer `spec`'s packed words in the slot `slot` (after its weights, as the upload put
    /// them).
    fn packed_region(&self, slot: DevBuf, spec: &LayerSpec) -> DevBuf {
        let at = (spec.len * self.weight_bytes).div_ceil(4);
        slot.sub(at..at + spec.packed)
    }

    /// Layer `layer`'s weights in `slot`, as the layer ops read them; the dequantisation
    /// workspace is the compute queue's scratch.
    ///
    /// # Safety
    /// Only inside a compute kernel whose grant holds the slot and the scratch.
    unsafe fn layer_weights<'v, B: Backend + ?Sized>(
        &self,
        g: &Grant,
        vw: &'v dyn Views<B>,
        layer: usize,
        slot: usize,
    ) -> Weights<'v, B> {
        let sb = self.dev(g, Res::Slot(slot), false);
        let _ = self.scratch(g);
        // SAFETY: the caller's contract.
        unsafe { self.weights_in(vw, layer, sb) }
    }

    /// [`Ctx::layer_weights`] in slot buffer `sb`, outside the plan's grants (the eval pass).
    ///
    /// # Safety
    /// Only inside a compute kernel that may read `sb` and write the scratch.
    unsafe fn weights_in<'v, B: Backend + ?Sized>(
        &self,
        vw: &'v dyn Views<B>,
        layer: usize,
        sb: DevBuf,
    ) -> Weights<'v, B> {
        let spec = self.layout.layer(layer);
        let packed = (spec.packed > 0).then(|| Packed {
            words: vw.buf(self.packed_region(sb, spec)),
            // SAFETY: the scratch is the compute queue's, and this kernel's (the caller's
            // contract); nothing else views the workspace while the layer runs.
            ws: unsafe { vw.wbuf_mut(self.scratch.dequant) },
        });
        Weights { slot: vw.wbuf(sb).slice(0..spec.len), packed }
    }

    fn param_buf(&self, i: usize) -> ParamBuf {
        let l = self.layout.dims.layers;
        match i {
            0 => ParamBuf::Embed,
            i if i <= l => ParamBuf::Layer(i - 1),
            i if i == l + 1 => ParamBuf::FinalNorm,
            _ => ParamBuf::Head,
        }
    }

    fn param_index(&self, p: ParamBuf) -> usize {
        param_index(self.layout.dims.layers, p)
    }
    fn head_param(&self) -> ParamBuf {
        self.shape.head_buf()
    }
    /// Buffer `i`'s trained weights for an upload: its image if it has one, else its masters.
    /// The caller must hold (or not need: an idle device) the buffer's `Params` grant.
    fn upload_src(&self, i: usize) -> Trained {
        match self.images[i] {
            Some(img) => Trained::Image(img.as_const()),
            None => Trained::Masters(self.params[i].as_const()),
        }
    }
    fn tiled(&self) -> &TiledHead {
        self.tiled.as_ref().expect("the plan tiles the head only when the engine does")
    }
}

/// One micro-batch, prepared by the caller (the engine takes token ids and shifted targets,
/// not data records): `b` rows of `t` positions, right-padded.
pub struct MicroBatch {
    pub b: usize,
    pub t: usize,
    /// (B*T) token ids.
    pub ids: Arc<Vec<i32>>,
    /// (B*T) the next token of each position, -100 where no loss is taken.
    pub targets: Arc<Vec<i32>>,
}

impl MicroBatch {
    pub fn n(&self) -> usize {
        self.b * self.t
    }
}

/// The step being run, shared with its queued work.
struct StepData {
    mbs: Vec<MicroBatch>,
    /// 1 / (loss-carrying positions of the whole batch).
    scale: f32,
    /// AdamW's step count if this step's update is applied (1-based).
    adam_step: u64,
    /// Learning rate of this step.
    lr: f64,
    /// Test hook: poison the gradient before its norm is taken.
    inject_nan: bool,
    /// The token ids of the next step's micro-batches, when the caller knows them: the
    /// embedding rows they gather are updated first ([`OpKind::EmbedUpdate`]).
    next_ids: Vec<Arc<Vec<i32>>>,
}

/// Per-step inputs besides the rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepParams {
    pub lr: f64,
    /// Write a NaN into the gradient before the norm (fault injection for tests).
    pub inject_nan: bool,
}

/// What one step produced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutput {
    pub loss_sum: f64,
    pub num_targets: usize,
    pub grad_norm: f64,
    /// The update was skipped (non-finite loss or gradient norm): masters and moments untouched.
    pub skipped: bool,
}

impl StepOutput {
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.num_targets.max(1) as f64
    }
}

/// Host buffers the engine owns (the closures reach them through `Ctx`'s handles).
struct HostBuffers<D: Device> {
    _ckpt: Vec<Vec<D::Staging<f32>>>,
    /// The gradient slabs: fp32 or bf16 (the other empty), and the fp32 expansion layer.
    _slabs: Vec<D::Staging<f32>>,
    _slabs_bf16: Vec<D::Staging<Bf16>>,
    _expand: Vec<f32>,
    _emb_stage: Vec<D::Staging<f32>>,
    _dx_stage: Vec<D::Staging<f32>>,
    _loss_host: Vec<D::Staging<f32>>,
    _images: Vec<Option<D::Staging<Bf16>>>,
    _stages: Vec<D::Staging<Bf16>>,
}

/// The streaming engine. Field order matters: the device is dropped first, which runs all
/// queued work to completion before the host buffers that work points into are freed.
pub struct Engine<D: Device> {
    dev: D,
    ctx: Arc<Ctx>,
    /// The registrations of `state`'s gradients that the device downloads into
    /// ([`pin_downloaded_grads`]): dropped before `state`, whose memory they page-lock.
    pinned_grads: Vec<D::HostPin>,
    state: Box<TrainState>,
    _host: HostBuffers<D>,
    /// The backend's workspace (kept allocated for the device's life).
    _workspace: DevBuf,
    schedule: Schedule,
    /// Events of the ops of the current and the previous step (by step parity).
    events: [Vec<Event>; 2],
    cfg: EngineConfig,
    sizes: Sizes,
    /// Steps run so far (skipped ones included).
    steps: u64,
    /// Updates applied so far.
    updates: u64,
    /// One kernel timer per compute phase (indexed by `Phase as usize`), built once so a launch
    /// allocates none.
    timers: [KernelTimer; 4],
    /// Each op's grant, of the first step and of the steady state (by `Schedule::ops`).
    grants: [Vec<Grant>; 2],
    /// The host queue's own threads (`engine.host_threads`): every host op runs inside it, so
    /// the optimizer's and the accumulation's rayon work uses exactly these.
    host_pool: Arc<rayon::ThreadPool>,
    /// The marks of a traced run ([`Engine::start_trace`]) and the engine step it began at.
    trace: Option<(Arc<OpMarks>, u64)>,
}

/// Places the queues' own threads as [`threads::QueueCpus`] says. Handed across CPUs, a host
/// op waited for an idle CPU to wake and its reply for another, 80-90 us on this project's
/// virtual machine against 6-7 on one CPU (`examples/wake_probe`); an unpinned copy thread of
/// the CPU device, woken onto the host thread's CPU, took half of it for its memcpy, and a
/// gradient accumulation beside it 910-960 us against 480-520. The others are the CUDA
/// device's dispatchers, the CPU device's copy threads and its kernels' dispatcher.
///
/// The copy queues' threads also ask for the shortest time slice (`COPY_SLICE_US`): they sleep
/// most of the time and wake for one copy, often on a CPU where a compute thread is running;
/// with the default slice a woken copy could wait for the running thread's slice to end (on
/// the CPU device at link 0, about one copy in ten took 2-14x its median). It trims that
/// tail: in ten interleaved pairs of `bench/overlap.yaml` runs at link 0 the uploads' busy time
/// read 5.14-6.44 ms a step with the short slice against 5.52-7.59 without (medians 6.13 and
/// 6.31), `compact` 5.55-6.32 against 5.76-7.21; in six more pairs (against the binary before
/// the change) the medians were equal (5.86 and 5.87) and the slowest run 6.11 against 6.38.
/// Steps, downloads and the host queue did not move.
fn place_queue_threads<D: Device>(dev: &D, cpus: threads::QueueCpus) {
    if let Some(cpu) = cpus.host {
        dev.host(Box::new(move || {
            threads::pin_current_thread(cpu);
        }));
    }
    for q in [Queue::Compute, Queue::H2D, Queue::D2H] {
        let others = cpus.others.clone();
        dev.host_on(
            q,
            Box::new(move || {
                if !others.is_empty() {
                    threads::restrict_current_thread(&others);
                }
                if q != Queue::Compute {
                    threads::short_slice_current_thread(COPY_SLICE_US);
                }
            }),
        );
    }
}

/// Buffer `p`'s index among a `layers`-layer model's buffers, in the order of
/// `ParamStore::buffers`.
fn param_index(layers: usize, p: ParamBuf) -> usize {
    match p {
        ParamBuf::Embed => 0,
        ParamBuf::Layer(i) => 1 + i,
        ParamBuf::FinalNorm => layers + 1,
        ParamBuf::Head => layers + 2,
    }
}

/// Page-locks the gradients the device downloads straight into the host store, the final
/// norm's and `head`'s (the head, or the embedding when tied), in full fine-tuning: into
/// pageable memory a tile of a 7B head's gradient (932 MB) took 94 ms on an H200, page-locked
/// 18 ms.
fn pin_downloaded_grads<D: Device>(
    dev: &D,
    state: &mut TrainState,
    layout: &ModelLayout,
    head: ParamBuf,
) -> Vec<D::HostPin> {
    if !layout.trains_base() {
        return Vec::new();
    }
    let mut grads = state.grads.buffers_mut();
    [ParamBuf::FinalNorm, head]
        .map(|p| param_index(layout.dims.layers, p))
        .into_iter()
        .map(|i| {
            // SAFETY: the state is boxed and owned by the engine, its gradient buffers never
            // resized while it runs; the registrations are dropped before it (field order, and
            // `into_state`).
            unsafe { dev.pin_host(std::mem::take(&mut grads[i])) }
        })
        .collect()
}

/// The copy queues' threads' time slice: 100 us, the shortest Linux's EEVDF scheduler takes.
const COPY_SLICE_US: u64 = 100;

/// A raw handle to a host buffer that stays where it is for the engine's life.
fn handle<T>(s: &mut [T]) -> HostPtrMut<T> {
    // SAFETY: every buffer handed out here is owned by the engine (boxed state or staging
    // vectors that are never resized) and outlives the device, which is dropped first; who
    // touches it when is decided by the hazard-checked schedule.
    unsafe { HostPtrMut::new(s) }
}

impl<D: Device> Engine<D>
where
    D::Backend: 'static,
{
    /// Allocate every buffer the run needs and take ownership of the host state.
    pub fn new(dev: D, model: &ModelConfig, state: TrainState, cfg: EngineConfig) -> Result<Self> {
        Self::with_layout(dev, crate::model::describe(model), None, state, cfg)
    }

    /// [`Engine::new`] for `layout`: an adapter layout trains `state` (its adapters) beside
    /// the frozen `base`.
    pub fn with_layout(
        dev: D,
        layout: ModelLayout,
        base: Option<Arc<FrozenBase>>,
        state: TrainState,
        cfg: EngineConfig,
    ) -> Result<Self> {
        assert_eq!(base.is_some(), !layout.trains_base(), "an adapter layout has a frozen base");
        if cfg.micro_batch_size == 0
            || cfg.batch_size == 0
            || cfg.checkpoint_every == 0
            || cfg.grad_slabs == 0
        {
            bail!("engine sizes must be at least 1: {cfg:?}");
        }
        let sizes = Sizes::new(&layout, &cfg);
        let shape = plan_shape(&layout, &cfg, &sizes);
        if cfg.kept_layers > 0 && cfg.checkpoint_every != 1 {
            bail!("kept layer internals need checkpoint_every 1: {cfg:?}");
        }
        if cfg.kept_layers > layout.dims.layers {
            bail!(
                "{} kept layers of a {}-layer model: {cfg:?}",
                cfg.kept_layers,
                layout.dims.layers
            );
        }
        let precision = <D::Backend as Backend>::PRECISION;
        if cfg.backend.precision() != precision {
            bail!(
                "the engine was planned for the {:?} backend ({} weights) but the {} device \
                 computes with {} weights",
                cfg.backend,
                cfg.backend.precision().name(),
                dev.name(),
                precision.name()
            );
        }
        // The host queue's threads, before anything is allocated or queued.
        let host_threads = cfg.host_threads.resolve(cfg.backend);
        let placement = Placement::last(host_threads, cfg.pin_threads);
        let host_pool = Arc::new(
            threads::pool("horizon-host", host_threads, placement)
                .with_context(|| format!("cannot start the {host_threads} host threads"))?,
        );
        dev.host_threads(host_pool.clone());
        let queues = threads::QueueCpus::beside_host_threads(host_threads, cfg.pin_threads);
        place_queue_threads(&dev, queues);
        let schedule = Schedule::new(shape);
        let DeviceBuffers {
            slots,
            workspace,
            dws,
            acts,
            dres,
            ids,
            targets,
            losses,
            chunk,
            scratch,
            stash,
            tiled,
        } = alloc_device(&dev, &layout, &sizes, &cfg)?;
        dev.set_workspace(workspace);
        let (n, mbs) = (sizes.mb_rows, sizes.micro_batches);

        // Host staging buffers, allocated once.
        let mut state = Box::new(state.into_memory(&layout, cfg.memory));
        let nbufs = state.params.buffers().len();
        let pinned_grads = pin_downloaded_grads(&dev, &mut state, &layout, shape.head_buf());
        let moments = MomentHandle::all(&mut state.opt);
        let stage = |len: usize| dev.alloc_staging::<f32>(len);
        let mut ckpt: Vec<Vec<D::Staging<f32>>> =
            (0..sizes.blocks).map(|_| (0..mbs).map(|_| stage(sizes.act)).collect()).collect();
        let (n_f32, n_bf16) = match cfg.grad_wire {
            GradWire::Fp32 => (cfg.grad_slabs, 0),
            GradWire::Bf16 => (0, cfg.grad_slabs),
        };
        let mut slabs: Vec<D::Staging<f32>> = (0..n_f32).map(|_| stage(sizes.slab)).collect();
        let mut slabs_bf16: Vec<D::Staging<Bf16>> =
            (0..n_bf16).map(|_| dev.alloc_staging::<Bf16>(sizes.slab)).collect();
        let expand_len = if n_bf16 > 0 && cfg.memory.streams_updates() { sizes.slab } else { 0 };
        let mut expand = vec![0.0f32; expand_len];
        let mut emb_stage: Vec<D::Staging<f32>> = (0..mbs).map(|_| stage(sizes.act)).collect();
        let mut dx_stage: Vec<D::Staging<f32>> = (0..mbs).map(|_| stage(sizes.act)).collect();
        let mut loss_host: Vec<D::Staging<f32>> = (0..mbs).map(|_| stage(n)).collect();
        let mut images = weight_images(&dev, &state.params, &layout, &cfg);
        let n_stages = if shape.staged { 2 } else { 0 };
        let mut stages: Vec<D::Staging<Bf16>> =
            (0..n_stages).map(|_| dev.alloc_staging::<Bf16>(sizes.stage)).collect();
        let bufs = |ps: &mut crate::model::params::ParamStore| -> Vec<HostPtrMut> {
            ps.buffers_mut().into_iter().map(handle).collect()
        };
        let ctx = Ctx {
            layout: layout.clone(),
            base,
            weight_bytes: precision.weight_bytes(),
            shape,
            head_chunk: chunk,
            adamw: cfg.adamw,
            grad_clip: cfg.grad_clip,
            slots,
            dws,
            tiled,
            acts,
            dres,
            ids,
            targets,
            losses,
            scratch,
            memory: cfg.memory,
            moments,
            stats: Mutex::new(StepStats {
                sq: vec![0.0; nbufs],
                seen: vec![false; nbufs],
                prev_sq: {
                    let prev = state.last_sq.clone();
                    assert!(prev.is_empty() || prev.len() == nbufs, "last_sq is per buffer");
                    prev
                },
                provisional: vec![0.0; nbufs],
                poisoned: false,
                loss_checked: false,
                applied: false,
            }),
            applied: AtomicBool::new(false),
            params: bufs(&mut state.params),
            images: images.iter_mut().map(|i| i.as_mut().map(|s| handle(s))).collect(),
            stages: stages.iter_mut().map(|s| handle(s)).collect(),
            grads: bufs(&mut state.grads),
            ckpt: ckpt.iter_mut().map(|b| b.iter_mut().map(|s| handle(s)).collect()).collect(),
            slabs: match cfg.grad_wire {
                GradWire::Fp32 => Slabs::F32(slabs.iter_mut().map(|s| handle(s)).collect()),
                GradWire::Bf16 => Slabs::Bf16(
                    slabs_bf16.iter_mut().map(|s| handle(s)).collect(),
                    handle(&mut expand),
                ),
            },
            emb_stage: emb_stage.iter_mut().map(|s| handle(s)).collect(),
            dx_stage: dx_stage.iter_mut().map(|s| handle(s)).collect(),
            loss_host: loss_host.iter_mut().map(|s| handle(s)).collect(),
            norm: AtomicU64::new(0),
            skip: AtomicBool::new(false),
            embed_next: Mutex::new(vec![
                false;
                if layout.trains_base() { layout.dims.v } else { 0 }
            ]),
            embed_touched: Mutex::new(vec![
                false;
                if layout.trains_base() && !layout.tied {
                    layout.dims.v
                } else {
                    0
                }
            ]),
            phases: Arc::new(PhaseClock::default()),
            stash,
        };
        // The rope tables are uploaded once.
        let tables: Vec<(Vec<f32>, Vec<f32>)> =
            layout.rope.iter().map(|f| rope_tables(f, cfg.seq_len)).collect();
        let table_bufs = ctx.scratch.ropes.clone();
        // Events start reached: "step -1" and "step -2" have nothing pending.
        let reached = || {
            let e = Event::new();
            e.signal();
            e
        };
        let events = [
            (0..schedule.len()).map(|_| reached()).collect(),
            (0..schedule.len()).map(|_| reached()).collect(),
        ];
        let (steps, updates) = (state.step, state.updates);
        let timers = [Phase::Forward, Phase::Recompute, Phase::Backward, Phase::Head].map(|p| {
            debug_assert!((p as usize) < 4, "the compute phases come first");
            let clock = ctx.phases.clone();
            Arc::new(move |d| clock.add_duration(p, d)) as KernelTimer
        });
        let grants = [0, 1].map(|k| schedule.ops(k).iter().map(Grant::of).collect());
        let engine = Engine {
            ctx: Arc::new(ctx),
            pinned_grads,
            state,
            _host: HostBuffers {
                _ckpt: ckpt,
                _slabs: slabs,
                _slabs_bf16: slabs_bf16,
                _expand: expand,
                _emb_stage: emb_stage,
                _dx_stage: dx_stage,
                _loss_host: loss_host,
                _images: images,
                _stages: stages,
            },
            _workspace: workspace,
            schedule,
            events,
            cfg,
            sizes,
            steps,
            updates,
            grants,
            timers,
            host_pool,
            trace: None,
            dev,
        };
        for ((cos_buf, sin_buf), (cos, sin)) in table_bufs.into_iter().zip(&tables) {
            // SAFETY: the tables are kept alive until the synchronize below.
            engine.dev.upload(cos_buf, unsafe { HostPtr::new(cos) });
            engine.dev.upload(sin_buf, unsafe { HostPtr::new(sin) });
        }
        engine.fill_stages();
        engine.dev.synchronize();
        Ok(engine)
    }

    /// Staged uploads: the stages hold what the step before the first would have staged, the
    /// first upload into each slot (see `plan::stage_uploads`).
    fn fill_stages(&self) {
        let c = &self.ctx;
        for (slot, what) in first_uploads(self.schedule.ops(0), c.stages.len()) {
            // SAFETY: the device is idle and no step has run: nothing else touches the masters
            // or the stages.
            unsafe { self.host_pool.install(|| stage_weights(c, slot, what)) };
        }
    }

    /// The schedule the engine runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The buffer sizes the engine allocated.
    pub fn sizes(&self) -> &Sizes {
        &self.sizes
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// An error if device work has failed (a refused launch or copy, a GPU fault): the state
    /// is then not to be trusted, and nothing should be saved from it.
    pub fn check_device(&self) -> Result<()> {
        match self.dev.failure() {
            None => Ok(()),
            Some(msg) => bail!(
                "device work failed: {msg}\nnothing after the failure was saved\nhint: resume \
                 from the last checkpoint with --resume latest"
            ),
        }
    }

    /// Seconds of queue work by phase since the engine started (work still queued not
    /// included: read after [`Engine::state`] for a whole step).
    pub fn phase_seconds(&self) -> PhaseSeconds {
        self.ctx.phases.seconds()
    }

    /// [`Engine::state`], or an error if device work failed: the state to save or export.
    pub fn checked_state(&mut self) -> Result<&TrainState> {
        self.state();
        self.check_device()?;
        Ok(&self.state)
    }

    /// Wait for all queued work (optimizer updates included) and look at the host state.
    pub fn state(&mut self) -> &TrainState {
        self.dev.synchronize();
        self.state.step = self.steps;
        self.state.updates = self.updates;
        self.state.last_sq = self.last_sq();
        &self.state
    }

    /// Wait for all queued work and hand the host state back.
    pub fn into_state(self) -> TrainState {
        self.dev.synchronize();
        let last_sq = self.last_sq();
        let Engine { dev, pinned_grads, state, _host, steps, updates, .. } = self;
        drop(dev);
        drop(pinned_grads);
        drop(_host);
        let mut state = *state;
        state.step = steps;
        state.updates = updates;
        state.last_sq = last_sq;
        state
    }

    /// The squared gradient norms of the last finite step (streamed modes estimate the next
    /// step's norm from them).
    fn last_sq(&self) -> Vec<f64> {
        if self.cfg.memory.streams_updates() {
            self.ctx.stats.lock().expect("no update panicked").prev_sq.clone()
        } else {
            self.state.last_sq.clone()
        }
    }

    /// The configuration the engine was planned for.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Threads of the host queue's pool (`engine.host_threads` resolved): the optimizer and
    /// the gradient accumulation run on exactly these.
    pub fn host_threads(&self) -> usize {
        self.host_pool.current_num_threads()
    }

    /// Trace the next `steps` steps: when each op begins and ends on its queue (see
    /// [`crate::engine::trace`]); [`Engine::trace_spans`] reads them.
    pub fn start_trace(&mut self, steps: usize) {
        self.trace = Some((OpMarks::new(steps, self.schedule.len()), self.steps));
    }

    /// The spans of the traced steps' ops so far (empty without [`Engine::start_trace`]), after
    /// the queued work has finished.
    pub fn trace_spans(&self) -> Vec<Span> {
        let Some((marks, from)) = &self.trace else { return Vec::new() };
        self.dev.synchronize();
        marks.spans(|step| self.schedule.ops(from + step as u64))
    }

    /// Queue a trace mark of op `j` of step `k` on `queue` (its begin or, with `end`, its end),
    /// when the step is traced.
    fn mark(&self, queue: Queue, k: u64, j: usize, end: bool) {
        let Some((marks, from)) = &self.trace else { return };
        let Some(step) = k.checked_sub(*from).map(|s| s as usize) else { return };
        if marks.covers(step) {
            let marks = marks.clone();
            self.dev.host_on(queue, Box::new(move || marks.mark(step, j, end)));
        }
    }

    /// Count a step that runs nothing (its batch carries no loss): masters, moments and the
    /// update count are untouched. Queued work is finished first, so that the next step starts
    /// as it would after a resume (every event of the earlier steps reached).
    pub fn skip_step(&mut self) {
        self.dev.synchronize();
        self.steps += 1;
    }

    /// Run one optimizer step on the step's micro-batches (each at most
    /// `micro_batch_size` rows). Returns when the loss and the gradient norm are known; the
    /// optimizer updates run on, overlapped with the next step's work.
    pub fn step(&mut self, mbs: Vec<MicroBatch>, sp: StepParams) -> Result<StepOutput> {
        self.step_ahead(mbs, sp, Vec::new())
    }

    /// [`Engine::step`], told the token ids of the next step's micro-batches (`next_ids`; empty
    /// when unknown): the embedding rows they gather are updated first, so that the next
    /// forward waits only for those rows, not for the whole embedding. The results are the
    /// same either way.
    pub fn step_ahead(
        &mut self,
        mbs: Vec<MicroBatch>,
        sp: StepParams,
        next_ids: Vec<Arc<Vec<i32>>>,
    ) -> Result<StepOutput> {
        let rows: usize = mbs.iter().map(|mb| mb.b).sum();
        if rows == 0 || rows > self.cfg.batch_size {
            bail!("a step takes 1..={} rows, got {rows}", self.cfg.batch_size);
        }
        if mbs.len() != self.sizes.micro_batches
            || mbs.iter().any(|mb| mb.b > self.cfg.micro_batch_size)
        {
            bail!(
                "a step of {rows} rows in {} micro-batches; the engine was planned for {} of at \
                 most {} rows",
                mbs.len(),
                self.sizes.micro_batches,
                self.cfg.micro_batch_size
            );
        }
        if let Some(mb) = mbs.iter().find(|mb| mb.t > self.cfg.seq_len) {
            bail!(
                "a row of {} tokens exceeds the planned sequence length {}",
                mb.t,
                self.cfg.seq_len
            );
        }
        let num_targets: usize =
            mbs.iter().map(|mb| mb.targets.iter().filter(|&&t| t != -100).count()).sum();
        let k = self.steps;
        let sd = Arc::new(StepData {
            mbs,
            scale: 1.0 / num_targets.max(1) as f32,
            adam_step: self.updates + 1,
            lr: sp.lr,
            inject_nan: sp.inject_nan,
            next_ids,
        });

        // Events of step k-2 are reused: every one of them has been reached.
        let par = (k % 2) as usize;
        for e in &self.events[par] {
            e.wait_host();
            e.reset();
        }
        let n_ops = self.schedule.len();
        for j in 0..n_ops {
            let op = &self.schedule.ops(k)[j];
            for w in self.schedule.waits(k, j) {
                let e = match w {
                    Wait::This(i) => &self.events[par][i],
                    Wait::Prev(i) => &self.events[1 - par][i],
                };
                self.dev.wait(op.queue, e);
            }
            self.mark(op.queue, k, j, false);
            self.dispatch(op.queue, op.kind, &sd, &self.grants[usize::from(k > 0)][j]);
            self.mark(op.queue, k, j, true);
            self.dev.record(op.queue, &self.events[par][j]);
        }
        self.steps += 1;

        // Wait for what the metrics need: the losses and the gradient norm.
        let mut loss_sum = 0.0f64;
        for (j, op) in self.schedule.ops(k).iter().enumerate() {
            match op.kind {
                OpKind::DownloadLosses { .. } | OpKind::GradNorm => self.events[par][j].wait_host(),
                _ => {}
            }
        }
        self.check_device()?;
        for (m, mb) in sd.mbs.iter().enumerate() {
            // SAFETY: the loss download of this micro-batch has finished (waited above) and
            // nothing writes the buffer until the next step's download.
            let losses = unsafe { self.ctx.loss_host[m].as_const().sub(0..mb.n()).as_slice() };
            loss_sum += losses.iter().map(|&x| x as f64).sum::<f64>();
        }
        let grad_norm = f64::from_bits(self.ctx.norm.load(Ordering::Acquire));
        let skipped = self.ctx.skip.load(Ordering::Acquire);
        // Streamed updates ran before the norm was known (the norm op is the step's last):
        // the step counts for AdamW's bias correction if any buffer was updated.
        let applied = if self.cfg.memory.streams_updates() {
            self.ctx.applied.load(Ordering::Acquire)
        } else {
            !skipped
        };
        if applied {
            self.updates += 1;
        }
        Ok(StepOutput { loss_sum, num_targets, grad_norm, skipped })
    }

    /// Queue `f` on the host queue with the context and the step's data, and add its time to
    /// `phase`.
    fn host_op(
        &self,
        phase: Phase,
        sd: &Arc<StepData>,
        grant: &Grant,
        f: impl FnOnce(&Ctx, &StepData, &Grant) + Send + 'static,
    ) {
        let (c, sd, g) = (self.ctx.clone(), sd.clone(), grant.clone());
        let pool = self.host_pool.clone();
        self.dev.host(Box::new(move || {
            let t0 = Instant::now();
            pool.install(|| f(&c, &sd, &g));
            c.phases.add(phase, t0);
        }));
    }

    /// Enqueue kernels on the compute queue; their device time counts to `phase` (a compute
    /// phase).
    fn launch_phase(&self, phase: Phase, k: Kernel<D::Backend>) {
        self.dev.launch_timed(k, self.timers[phase as usize].clone());
    }

    /// A layer's forward on micro-batch `m`, `inp` -> `out` (prefixes of the micro-batch's
    /// rows), with weights in `slot`; its internals go to the layer's kept buffers where
    /// `kept_of` names a layer that keeps them, else to the scratch.
    fn launch_layer_forward(
        &self,
        phase: Phase,
        (layer, slot, m): (usize, usize, usize),
        (inp, out): (DevBuf, DevBuf),
        kept_of: Option<usize>,
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        let (c, sd, d, g) = (self.ctx.clone(), sd.clone(), self.ctx.layout.dims, grant.clone());
        self.launch_phase(
            phase,
            Box::new(move |vw: &dyn Views<D::Backend>| {
                let mb = &sd.mbs[m];
                let nc = mb.n() * d.c;
                // SAFETY: the buffers viewed are distinct, and the schedule orders this kernel
                // against every other queue's use of them (the scratch is the compute queue's).
                unsafe {
                    let kept = kept_of.and_then(|l| c.stash(&g, l, m, true));
                    let own = match kept {
                        Some(kept) => kept,
                        None => &c.scratch(&g).acts,
                    };
                    let own = own.iter().map(|&b| vw.buf_mut(b));
                    let out = Slot::W(vw.buf_mut(out.prefix(nc)));
                    let mut slots = act_slots(vw.buf(inp.prefix(nc)), out, own);
                    let spec = c.layout.layer(layer);
                    let mut w = c.layer_weights(&g, vw, layer, slot);
                    let rows = Rows { b: mb.b, t: mb.t };
                    let ropes = ropes(vw, &c, mb.t);
                    layer_forward(vw.backend(), spec, &mut slots, &mut w, &ropes, rows);
                }
            }),
        );
    }

    /// Sizes of a tile pass over micro-batch `m`.
    fn tile_dims(c: &Ctx, sd: &StepData, tile: usize, m: usize) -> TileDims {
        let r = c.tiled().tiling.range(tile);
        TileDims {
            n: sd.mbs[m].n(),
            chunk: c.head_chunk,
            v0: r.start,
            vt: r.len(),
            norm: c.layout.final_norm(),
            scale: sd.scale,
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
        let (c, sd, d, g) = (self.ctx.clone(), sd.clone(), self.ctx.layout.dims, grant.clone());
        self.launch_phase(
            Phase::Head,
            Box::new(move |vw: &dyn Views<D::Backend>| {
                let td = Self::tile_dims(&c, &sd, tile, m);
                let (n, vt) = (td.n, td.vt);
                // SAFETY: the buffers viewed are distinct, and the schedule orders this kernel
                // against every other queue's use of them (the head's rows and chunk are the
                // compute queue's).
                unsafe {
                    let x = (tile == 0).then(|| {
                        vw.buf(c.dev(&g, Res::Act { set: src, m }, false).prefix(n * d.c))
                    });
                    let w = vw.wbuf(c.dev(&g, Res::Slot(slot), false));
                    let (targets, scratch) = (c.ids(&g, m, false).1, c.tile_scratch(&g));
                    tile_stats(
                        vw.backend(),
                        &mut tile_rows(vw, c.head_rows(&g, m, true)),
                        vw.buf_mut(scratch.logits),
                        x,
                        w.slice(0..d.c),
                        w.slice(d.c..d.c + vt * d.c),
                        vw.ibuf(targets.prefix(n)),
                        td,
                    );
                }
            }),
        );
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
        let (c, sd, d, g) = (self.ctx.clone(), sd.clone(), self.ctx.layout.dims, grant.clone());
        self.launch_phase(
            Phase::Head,
            Box::new(move |vw: &dyn Views<D::Backend>| {
                let td = Self::tile_dims(&c, &sd, tile, m);
                let vtc = td.vt * d.c;
                // SAFETY: as for pass 1; the accumulator is ordered against its downloads.
                unsafe {
                    let scratch = c.tile_scratch(&g);
                    tile_grad(
                        vw.backend(),
                        &mut tile_rows(vw, c.head_rows(&g, m, true)),
                        vw.buf_mut(scratch.logits),
                        vw.buf_mut(scratch.dhf_chunk),
                        c.layout
                            .trains_base()
                            .then(|| vw.buf_mut(c.dev(&g, Res::Dw(dw), true).prefix(vtc))),
                        vw.wbuf(c.dev(&g, Res::Slot(slot), false)).slice(d.c..d.c + vtc),
                        vw.ibuf(c.ids(&g, m, false).1.prefix(td.n)),
                        first,
                        td,
                    );
                }
            }),
        );
    }

    /// Tiled head, after the last tile: micro-batch `m`'s losses and the final norm's
    /// backward (its weight read from `slot`) from `Act{src}`.
    fn launch_head_finish(
        &self,
        (slot, m, src): (usize, usize, usize),
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        let (c, sd, d, g) = (self.ctx.clone(), sd.clone(), self.ctx.layout.dims, grant.clone());
        self.launch_phase(
            Phase::Head,
            Box::new(move |vw: &dyn Views<D::Backend>| {
                let (n, nc) = (sd.mbs[m].n(), sd.mbs[m].n() * d.c);
                // SAFETY: as for pass 1.
                unsafe {
                    tile_finish(
                        vw.backend(),
                        &tile_rows(vw, c.head_rows(&g, m, false)),
                        vw.buf_mut(c.dev(&g, Res::Losses(m), true).prefix(n)),
                        vw.buf_mut(c.dev(&g, Res::Dres(m), true).prefix(nc)),
                        c.layout.trains_base().then(|| vw.buf_mut(c.dev(&g, Res::DnormW, true))),
                        vw.buf(c.dev(&g, Res::Act { set: src, m }, false).prefix(nc)),
                        vw.wbuf(c.dev(&g, Res::Slot(slot), false)).slice(0..d.c),
                        vw.ibuf(c.ids(&g, m, false).1.prefix(n)),
                        n,
                        c.layout.final_norm(),
                    );
                }
            }),
        );
    }

    /// The whole head on micro-batch `m`: final norm, LM head and cross-entropy, forward and
    /// backward, from `Act{src}` with the weights in `slot`, gradients into `Dw{dw}`.
    fn launch_whole_head(
        &self,
        (slot, m, src, dw): (usize, usize, usize, usize),
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        let (c, sd, d, g) = (self.ctx.clone(), sd.clone(), self.ctx.layout.dims, grant.clone());
        self.launch_phase(
            Phase::Head,
            Box::new(move |vw: &dyn Views<D::Backend>| {
                let mb = &sd.mbs[m];
                let (n, nc, vc) = (mb.n(), mb.n() * d.c, d.v * d.c);
                let h = c.scratch(&g).head.as_ref().expect("a whole head has its scratch");
                let (acc, w) = (c.dev(&g, Res::Dw(dw), true), c.dev(&g, Res::Slot(slot), false));
                // A frozen head and final norm get no gradient (an adapter run).
                let trains = c.layout.trains_base();
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
                            losses: vw.buf_mut(c.dev(&g, Res::Losses(m), true).prefix(n)),
                            dres: vw.buf_mut(c.dev(&g, Res::Dres(m), true).prefix(nc)),
                            dnorm_w: trains.then(|| vw.buf_mut(acc.sub(0..d.c))),
                            dhead_w: trains.then(|| vw.buf_mut(acc.sub(d.c..d.c + vc))),
                        },
                        vw.buf(c.dev(&g, Res::Act { set: src, m }, false).prefix(nc)),
                        vw.wbuf(w).slice(0..d.c),
                        vw.wbuf(w).slice(d.c..d.c + vc),
                        vw.ibuf(c.ids(&g, m, false).1.prefix(n)),
                        HeadDims {
                            n,
                            v: d.v,
                            chunk: c.head_chunk,
                            norm: c.layout.final_norm(),
                            scale: sd.scale,
                        },
                    );
                }
            }),
        );
    }

    /// A layer's backward on micro-batch `m` from its input `Act{set}`, weights in `slot`,
    /// internals kept by its forward or rebuilt just before into the scratch; its weight
    /// gradients accumulate into `Dw{dw}`.
    fn launch_layer_backward(
        &self,
        (layer, slot, m, set, dw): (usize, usize, usize, usize, usize),
        sd: &Arc<StepData>,
        grant: &Grant,
    ) {
        let (c, sd, d, g) = (self.ctx.clone(), sd.clone(), self.ctx.layout.dims, grant.clone());
        self.launch_phase(
            Phase::Backward,
            Box::new(move |vw: &dyn Views<D::Backend>| {
                let mb = &sd.mbs[m];
                let nc = mb.n() * d.c;
                let spec = c.layout.layer(layer);
                let scratch = c.scratch(&g);
                // SAFETY: as for the forward kernel; the recompute (if any) was enqueued just
                // before, on this queue.
                unsafe {
                    // Kept by this layer's forward (what it did not keep, in the scratch, is
                    // rebuilt first), or rebuilt by the recompute just before.
                    let kept = c.stash(&g, layer, m, false);
                    let own = kept.unwrap_or(&scratch.acts);
                    let x = vw.buf(c.dev(&g, Res::Act { set, m }, false).prefix(nc));
                    let y = Slot::R(vw.buf(scratch.y));
                    let mut acts = act_slots(x, y, own.iter().map(|&b| vw.buf_mut(b)));
                    let mut w = c.layer_weights(&g, vw, layer, slot);
                    let rows = Rows { b: mb.b, t: mb.t };
                    if kept.is_some() {
                        layer_rebuild(vw.backend(), spec, &mut acts, &mut w, rows);
                    }
                    let gs = scratch.grads.iter().map(|&b| vw.buf_mut(b));
                    let mut grads = grad_slots(vw.buf_mut(c.dev(&g, Res::Dres(m), true)), gs);
                    layer_backward(
                        vw.backend(),
                        spec,
                        &mut grads,
                        vw.buf_mut(c.dev(&g, Res::Dw(dw), true).prefix(spec.train_len())),
                        &acts,
                        &mut w,
                        &ropes(vw, &c, mb.t),
                        rows,
                    );
                }
            }),
        );
    }

    /// Submit one operation to its queue.
    fn dispatch(&self, queue: Queue, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        match queue {
            Queue::H2D => self.dispatch_h2d(kind, sd, grant),
            Queue::Compute => self.dispatch_compute(kind, sd, grant),
            Queue::D2H => self.dispatch_d2h(kind, sd, grant),
            Queue::Host => self.dispatch_host(kind, sd, grant),
        }
    }

    /// Submit an op of the host-to-device queue (uploads, and the embedding gather that feeds them).
    fn dispatch_h2d(&self, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        let c = &self.ctx;
        let d = c.layout.dims;
        match kind {
            OpKind::UploadIds { m } => {
                let (n, (ids, targets)) = (sd.mbs[m].n(), c.ids(grant, m, true));
                self.dev.upload_i32(ids.prefix(n), sd.mbs[m].ids.clone());
                self.dev.upload_i32(targets.prefix(n), sd.mbs[m].targets.clone());
            }
            OpKind::EmbedGather { m } => {
                grant.check(Res::EmbedNext, false);
                let table = c.params[c.param_index(ParamBuf::Embed)].as_const();
                let stage = c.staging(grant, Res::EmbStage(m), true);
                let frozen = c.base.clone();
                let (c, sd) = (c.clone(), sd.clone());
                self.dev.host_on(
                    Queue::H2D,
                    Box::new(move || {
                        let t0 = Instant::now();
                        let nc = sd.mbs[m].n() * d.c;
                        // SAFETY: the schedule orders this gather after every write of this
                        // staging buffer and of the rows it gathers (`Res::EmbedNext`), and
                        // before their next uses. It borrows only those rows: the second part
                        // of the previous step's update may be writing the others.
                        let out = unsafe { stage.sub(0..nc).as_mut_slice() };
                        // SAFETY: as above, for each row gathered.
                        let row =
                            |r: usize| unsafe { table.sub(r * d.c..(r + 1) * d.c).as_slice() };
                        match &frozen {
                            None => embed_rows_by(out, &sd.mbs[m].ids, row, &c.layout),
                            Some(b) => embed_rows_frozen(out, &sd.mbs[m].ids, &b.embed, &c.layout),
                        }
                        c.phases.add(Phase::Embedding, t0);
                    }),
                );
            }
            OpKind::UploadAct { m, set, from } => {
                let nc = sd.mbs[m].n() * d.c;
                let src = match from {
                    ActSource::Embedding => Res::EmbStage(m),
                    ActSource::Ckpt(block) => Res::Ckpt { block, m },
                };
                let (src, dst) =
                    (c.staging(grant, src, false), c.dev(grant, Res::Act { set, m }, true));
                self.dev.upload(dst.prefix(nc), src.as_const().sub(0..nc));
            }
            OpKind::UploadWeights { slot, what } if c.shape.staged => {
                let dst = c.dev(grant, Res::Slot(slot), true);
                self.upload_staged(dst, what, c.stage(grant, slot, false).as_const());
            }
            OpKind::UploadWeights { slot, what } => {
                let dst = c.dev(grant, Res::Slot(slot), true);
                match what {
                    SlotContent::Layer(i) => self.upload_layer(grant, dst, i),
                    head => self.upload_head(grant, dst, head_rows(c, head)),
                }
            }
            _ => unreachable!("{kind:?} is not an op of this queue"),
        }
    }

    /// Layer `i`'s weights into slot `dst`: in an adapter run the frozen part from the base as
    /// it is stored (bf16 or fp32), the adapters from the masters, then the packed words.
    fn upload_layer(&self, grant: &Grant, dst: DevBuf, i: usize) {
        self.upload_layer_from(dst, i, self.trained(grant, ParamBuf::Layer(i)));
    }

    /// Buffer `p`'s trained weights for an upload: its image if it has one, else its masters.
    fn trained(&self, grant: &Grant, p: ParamBuf) -> Trained {
        let c = &self.ctx;
        grant.check(Res::Params(p), false);
        c.upload_src(c.param_index(p))
    }

    /// Trained weights `src` into weights `at..` of slot `dst`.
    fn upload_trained(&self, dst: DevBuf, at: usize, src: Trained) {
        match src {
            Trained::Masters(w) => self.dev.upload_weights(dst, at, w),
            Trained::Image(w) => self.dev.upload_weights_bf16_pinned(dst, at, w),
        }
    }

    /// [`Engine::upload_layer`] with the layer's trained part at `trained`.
    fn upload_layer_from(&self, dst: DevBuf, i: usize, trained: Trained) {
        let c = &self.ctx;
        let Some(base) = &c.base else { return self.upload_trained(dst, 0, trained) };
        let spec = c.layout.layer(i);
        self.upload_frozen(dst, 0, &base.layers[i], 0..spec.frozen);
        self.upload_trained(dst, spec.frozen, trained);
        if spec.packed > 0 {
            // SAFETY: the base lives in the context's Arc for the engine's whole life and is
            // never written.
            let words = unsafe { HostPtr::new(words_as_f32(&base.packed[i])) };
            self.dev.upload(c.packed_region(dst, spec), words);
        }
    }

    /// `what`'s weights into slot `dst`, the trained ones from the slot's stage `stage`
    /// (laid out as [`stage_weights`] writes it).
    fn upload_staged(&self, dst: DevBuf, what: SlotContent, stage: HostPtr<Bf16>) {
        let c = &self.ctx;
        match what {
            SlotContent::Layer(i) => {
                let len = c.layout.layer(i).train_len();
                self.upload_layer_from(dst, i, Trained::Image(stage.sub(0..len)));
            }
            SlotContent::Head | SlotContent::HeadTile(_) => {
                let rows = head_rows(c, what);
                let cc = c.layout.dims.c;
                let norm = Trained::Image(stage.sub(0..cc));
                let head = Trained::Image(stage.sub(cc..cc + rows.len() * cc));
                self.upload_head_rows(dst, rows, (norm, head));
            }
        }
    }

    /// The final norm, then vocabulary rows `rows` of the LM head, into slot `dst`.
    fn upload_head(&self, grant: &Grant, dst: DevBuf, rows: std::ops::Range<usize>) {
        let c = &self.ctx;
        let norm = self.trained(grant, ParamBuf::FinalNorm);
        let head = self.trained(grant, c.head_param());
        self.upload_head_from(dst, rows, (norm, head));
    }

    /// [`Engine::upload_head`] with the trained final norm and head (full fine-tuning) at
    /// `norm`, `head`.
    fn upload_head_from(
        &self,
        dst: DevBuf,
        rows: std::ops::Range<usize>,
        (norm, head): (Trained, Trained),
    ) {
        let cc = self.ctx.layout.dims.c;
        // An adapter run trains neither (both empty): its head is the frozen base's.
        let head_rows =
            if self.ctx.base.is_some() { head } else { head.sub(rows.start * cc..rows.end * cc) };
        self.upload_head_rows(dst, rows, (norm, head_rows))
    }

    /// [`Engine::upload_head_from`] with the trained head's rows `rows` alone at `head_rows`.
    fn upload_head_rows(
        &self,
        dst: DevBuf,
        rows: std::ops::Range<usize>,
        (norm, head_rows): (Trained, Trained),
    ) {
        let (c, cc) = (&self.ctx, self.ctx.layout.dims.c);
        let range = rows.start * cc..rows.end * cc;
        match &c.base {
            None => {
                self.upload_trained(dst, 0, norm);
                self.upload_trained(dst, cc, head_rows);
            }
            Some(base) => {
                self.upload_frozen(dst, 0, &base.final_norm, 0..cc);
                let head = base.lm_head.as_ref().unwrap_or(&base.embed);
                self.upload_frozen(dst, cc, head, range);
            }
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

    /// Submit an op of the compute queue (kernels).
    fn dispatch_compute(&self, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        let c = &self.ctx;
        match kind {
            OpKind::Forward { layer, slot, m, src, dst, recompute } => {
                let phase = if recompute { Phase::Recompute } else { Phase::Forward };
                let inp = c.dev(grant, Res::Act { set: src, m }, false);
                let out = c.dev(grant, Res::Act { set: dst, m }, true);
                let at = (layer, slot, m);
                self.launch_layer_forward(phase, at, (inp, out), Some(layer), sd, grant);
            }
            OpKind::ZeroDw { dw } => {
                let acc = c.dev(grant, Res::Dw(dw), true);
                self.launch_phase(
                    Phase::Backward,
                    Box::new(move |vw: &dyn Views<D::Backend>| {
                        // SAFETY: the schedule orders this kernel after the accumulator's last
                        // download.
                        unsafe { vw.backend().zero(vw.buf_mut(acc)) };
                    }),
                );
            }
            OpKind::HeadStats { tile, slot, m, src } => {
                self.launch_head_stats((tile, slot, m, src), sd, grant)
            }
            OpKind::HeadGrad { tile, slot, m, dw, first } => {
                self.launch_head_grad((tile, slot, m, dw), first, sd, grant);
            }
            OpKind::HeadFinish { slot, m, src } => {
                self.launch_head_finish((slot, m, src), sd, grant)
            }
            OpKind::ZeroDnorm => {
                let acc = c.dev(grant, Res::DnormW, true);
                self.launch_phase(
                    Phase::Head,
                    Box::new(move |vw: &dyn Views<D::Backend>| {
                        // SAFETY: the schedule orders this kernel after the accumulator's last
                        // download.
                        unsafe { vw.backend().zero(vw.buf_mut(acc)) };
                    }),
                );
            }
            OpKind::Head { slot, m, src, dw } => {
                self.launch_whole_head((slot, m, src, dw), sd, grant)
            }
            OpKind::Backward { layer, slot, m, set, dw } => {
                if c.stash[layer].is_none() {
                    // Rebuild the layer's internals into the scratch first: its own task, so
                    // its time counts as recompute.
                    let inp = c.dev(grant, Res::Act { set, m }, false);
                    let at = (layer, slot, m);
                    let out = c.scratch(grant).y;
                    self.launch_layer_forward(Phase::Recompute, at, (inp, out), None, sd, grant);
                }
                self.launch_layer_backward((layer, slot, m, set, dw), sd, grant);
            }
            _ => unreachable!("{kind:?} is not an op of this queue"),
        }
    }

    /// Submit an op of the device-to-host queue (downloads).
    fn dispatch_d2h(&self, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        let c = &self.ctx;
        let d = c.layout.dims;
        match kind {
            OpKind::SaveCkpt { block, m, set } => {
                let nc = sd.mbs[m].n() * d.c;
                let dst = c.staging(grant, Res::Ckpt { block, m }, true);
                self.dev
                    .download(dst.sub(0..nc), c.dev(grant, Res::Act { set, m }, false).prefix(nc));
            }
            // A frozen head, final norm and embedding have no gradient (an adapter run).
            OpKind::DownloadHeadTileGrads { .. }
            | OpKind::DownloadNormGrads
            | OpKind::DownloadHeadGrads { .. }
            | OpKind::DownloadDres { .. }
                if !c.layout.trains_base() => {}
            OpKind::DownloadHeadTileGrads { dw, tile } => {
                let r = c.tiled().tiling.range(tile);
                let head = c.grads(grant, c.head_param(), true);
                let (len, acc) = (r.len() * d.c, c.dev(grant, Res::Dw(dw), false));
                self.dev.download(head.sub(r.start * d.c..r.end * d.c), acc.prefix(len));
            }
            OpKind::DownloadNormGrads => {
                let norm = c.grads(grant, ParamBuf::FinalNorm, true);
                self.dev.download(norm, c.dev(grant, Res::DnormW, false));
            }
            OpKind::DownloadLosses { m } => {
                let (n, host) = (sd.mbs[m].n(), c.staging(grant, Res::LossHost(m), true));
                self.dev.download(host.sub(0..n), c.dev(grant, Res::Losses(m), false).prefix(n));
            }
            OpKind::DownloadDw { dw, slab, what } => {
                let (len, acc) = (grad_len(c, what), c.dev(grant, Res::Dw(dw), false));
                match c.slabs(grant, slab, true) {
                    Slabs::F32(s) => self.dev.download(s[slab].sub(0..len), acc.prefix(len)),
                    Slabs::Bf16(s, _) => {
                        self.dev.download_bf16(s[slab].sub(0..len), acc.prefix(len))
                    }
                }
            }
            OpKind::DownloadHeadGrads { dw } => {
                let head = c.grads(grant, c.head_param(), true);
                let norm = c.grads(grant, ParamBuf::FinalNorm, true);
                let acc = c.dev(grant, Res::Dw(dw), false);
                self.dev.download(norm, acc.sub(0..d.c));
                self.dev.download(head, acc.sub(d.c..d.c + head.len()));
            }
            OpKind::DownloadDres { m } => {
                let nc = sd.mbs[m].n() * d.c;
                let dst = c.staging(grant, Res::DxStage(m), true);
                self.dev.download(dst.sub(0..nc), c.dev(grant, Res::Dres(m), false).prefix(nc));
            }
            _ => unreachable!("{kind:?} is not an op of this queue"),
        }
    }

    /// Submit an op of the host queue (gradient accumulation, norms, optimizer updates).
    fn dispatch_host(&self, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        let c = &self.ctx;
        let d = c.layout.dims;
        match kind {
            OpKind::AccumulateGrads { slab, what } => {
                self.host_op(Phase::Gradients, sd, grant, move |c, _, grant| {
                    // SAFETY: the schedule orders this after the slab's download and before
                    // its next one; the gradients are only touched by the host queue.
                    unsafe {
                        let GradTarget::Layer(i) = what else {
                            unreachable!("the head's gradient has no slab")
                        };
                        let g = c.grads(grant, ParamBuf::Layer(i), true);
                        // fp32 accumulation on the host, whatever the slab's format.
                        match c.slabs(grant, slab, false) {
                            Slabs::F32(s) => add_inplace(
                                g.as_mut_slice(),
                                s[slab].as_const().sub(0..g.len()).as_slice(),
                            ),
                            Slabs::Bf16(s, _) => add_bf16(
                                g.as_mut_slice(),
                                s[slab].as_const().sub(0..g.len()).as_slice(),
                            ),
                        }
                    }
                });
            }
            OpKind::SlabUpdate { slab, layer } => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, sd, grant| {
                    let i = c.param_index(ParamBuf::Layer(layer));
                    let len = c.layout.layer(layer).train_len();
                    // SAFETY: ordered after the slab's download and before its next one; the
                    // layer's masters and moments are ordered against its uploads.
                    unsafe {
                        streamed_update(
                            c,
                            sd,
                            grant,
                            i,
                            c.slabs(grant, slab, false).f32_view(slab, len),
                        );
                    }
                });
            }
            OpKind::MeasureSlab { slab, layer } => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, sd, grant| {
                    let i = c.param_index(ParamBuf::Layer(layer));
                    let len = c.layout.layer(layer).train_len();
                    let mut st = c.stats.lock().expect("no update panicked");
                    // SAFETY: ordered after the slab's download and before its update.
                    unsafe {
                        let g = c.slabs(grant, slab, false).f32_view(slab, len);
                        measure(c, sd, grant, &mut st, i, g);
                    }
                });
            }
            OpKind::HeldSlabUpdate { slab, layer } => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, sd, grant| {
                    let i = c.param_index(ParamBuf::Layer(layer));
                    let len = c.layout.layer(layer).train_len();
                    // SAFETY: ordered after the slab's download and the norm, and before the
                    // slab's next download; the layer's masters and moments are ordered against
                    // its uploads.
                    unsafe {
                        let g = c.slabs(grant, slab, false).f32_view(slab, len);
                        update_after_norm(c, sd, grant, i, g);
                    }
                });
            }
            OpKind::PoisonGrad { what } => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, sd, grant| {
                    if sd.inject_nan {
                        // SAFETY: the plan declares this write and orders it after the
                        // gradient's last write and before its first read of the step.
                        unsafe { c.grads(grant, what, true).as_mut_slice()[0] = f32::NAN };
                    }
                });
            }
            OpKind::Measure { what } => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, sd, grant| {
                    let i = c.param_index(what);
                    let mut st = c.stats.lock().expect("no update panicked");
                    // SAFETY: ordered after the gradient is complete and before its update;
                    // only the host queue touches the gradients.
                    let g = unsafe { c.grads(grant, what, false).as_const().as_slice() };
                    let sq = match what {
                        ParamBuf::Embed => embed_sum_squares(c, sd, g),
                        _ => sum_squares(g),
                    };
                    record(c, sd, grant, &mut st, i, sq);
                });
            }
            // A frozen embedding has no gradient (an adapter run).
            OpKind::EmbedScatter { .. } if !c.layout.trains_base() => {}
            OpKind::EmbedScatter { m } => {
                self.host_op(Phase::Gradients, sd, grant, move |c, sd, grant| {
                    let nc = sd.mbs[m].n() * d.c;
                    // SAFETY: ordered after the residual gradient's download (and before the
                    // next one); the embedding gradient is only touched by the host queue.
                    unsafe {
                        embed_rows_backward(
                            c.grads(grant, ParamBuf::Embed, true).as_mut_slice(),
                            &sd.mbs[m].ids,
                            c.staging(grant, Res::DxStage(m), true).sub(0..nc).as_mut_slice(),
                            &c.layout,
                        );
                    }
                });
            }
            OpKind::GradNorm if c.memory.streams_updates() => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, sd, grant| {
                    let mut guard = c.stats.lock().expect("no update panicked");
                    let st = &mut *guard;
                    let emb = c.param_index(ParamBuf::Embed);
                    // SAFETY: ordered after the embedding's scatters; only the host queue
                    // touches the gradients.
                    let g = unsafe { c.grads(grant, ParamBuf::Embed, false).as_const().as_slice() };
                    record(c, sd, grant, st, emb, embed_sum_squares(c, sd, g));
                    debug_assert!(st.seen.iter().all(|&s| s), "every gradient is measured");
                    // The same sum, in the same order, as the exact mode's norm.
                    let norm = st.sq.iter().copied().sum::<f64>().sqrt();
                    let finite = norm.is_finite() && !st.poisoned;
                    c.skip.store(!finite, Ordering::Release);
                    c.norm.store(norm.to_bits(), Ordering::Release);
                    if finite {
                        st.prev_sq.clone_from(&st.sq);
                        let coef = clip_coefficient(norm, c.grad_clip);
                        for (i, &used) in st.provisional.iter().enumerate() {
                            if used > 0.0 && used != coef {
                                // SAFETY: the schedule orders the norm after the layer's
                                // update and before its next one.
                                unsafe { rescale_moments(c, grant, i, coef / used) };
                            }
                        }
                    }
                    // The held updates that follow apply unless the step is skipped.
                    c.applied.store(st.applied || finite, Ordering::Release);
                    st.seen.fill(false);
                    st.provisional.fill(0.0);
                    st.poisoned = false;
                    st.loss_checked = false;
                    st.applied = false;
                });
            }
            OpKind::GradNorm => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, sd, grant| {
                    let mut guard = c.stats.lock().expect("no update panicked");
                    let st = &mut *guard;
                    debug_assert!(st.seen.iter().all(|&s| s), "every gradient is measured");
                    // Every buffer's squared norm, summed in buffer order: the same number a
                    // pass over the gradients gives. The schedule orders this after every loss
                    // download.
                    let norm = st.sq.iter().copied().sum::<f64>().sqrt();
                    let loss = loss_sum(c, sd, grant);
                    c.skip.store(!(norm.is_finite() && loss.is_finite()), Ordering::Release);
                    c.norm.store(norm.to_bits(), Ordering::Release);
                    st.seen.fill(false);
                    st.poisoned = false;
                    st.loss_checked = false;
                });
            }
            OpKind::StageWeights { slot, what } => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, _, grant| {
                    // SAFETY: the schedule orders this after the stage's last upload and the
                    // weights' last write, and before the slot's next upload.
                    unsafe {
                        grant.check(Res::WeightStage(slot), true);
                        match what {
                            SlotContent::Layer(i) => {
                                grant.check(Res::Params(ParamBuf::Layer(i)), false)
                            }
                            _ => {
                                grant.check(Res::Params(ParamBuf::FinalNorm), false);
                                grant.check(Res::Params(c.head_param()), false)
                            }
                        }
                        stage_weights(c, slot, what)
                    }
                });
            }
            // A frozen embedding has no update (an adapter run).
            OpKind::EmbedUpdate { .. } if !c.layout.trains_base() => {}
            OpKind::EmbedUpdate { next } => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, sd, grant| {
                    let mut pick = c.embed_next.lock().expect("no update panicked");
                    if next {
                        pick_next_rows(c, sd, &mut pick);
                    }
                    // SAFETY: the schedule orders each part after every read of its rows'
                    // parameters in this step (the gather's through the norm) and before
                    // every read in the next; the parts run in order on the host queue.
                    unsafe { update_embed_rows(c, sd, grant, &pick, next) };
                });
            }
            OpKind::Update { what } => {
                self.host_op(Phase::Optimizer, sd, grant, move |c, sd, grant| {
                    let i = c.param_index(what);
                    // SAFETY: the schedule orders this update after every read of these
                    // parameters in this step and before every read in the next.
                    unsafe { update_and_zero(c, sd, grant, i, c.grads(grant, what, true)) };
                });
            }
            _ => unreachable!("{kind:?} is not an op of this queue"),
        }
    }
}

/// The vocabulary rows a head upload carries.
fn head_rows(c: &Ctx, what: SlotContent) -> std::ops::Range<usize> {
    match what {
        SlotContent::HeadTile(k) => c.tiled().tiling.range(k),
        _ => 0..c.layout.dims.v,
    }
}

/// Rounds `what`'s trained weights into slot `slot`'s stage: a layer's trained part, or the
/// final norm then the slot's rows of the head (nothing of a frozen head).
///
/// # Safety
/// Nothing else may touch the stage, and nothing may write those weights, meanwhile.
unsafe fn stage_weights(c: &Ctx, slot: usize, what: SlotContent) {
    let stage = c.stages[slot];
    let l = c.layout.dims.layers;
    // SAFETY: the caller's exclusivity.
    unsafe {
        let stage = stage.as_mut_slice();
        match what {
            SlotContent::Layer(i) => {
                let w = c.params[1 + i].as_const().as_slice();
                round_to_bf16(&mut stage[..w.len()], w);
            }
            _ if c.base.is_some() => {}
            SlotContent::Head | SlotContent::HeadTile(_) => {
                let cc = c.layout.dims.c;
                let rows = head_rows(c, what);
                let norm = c.params[l + 1].as_const().as_slice();
                let head = c.params[c.param_index(c.head_param())].as_const().as_slice();
                let (n, h) = stage.split_at_mut(cc);
                round_to_bf16(n, norm);
                round_to_bf16(&mut h[..rows.len() * cc], &head[rows.start * cc..rows.end * cc]);
            }
        }
    }
}

/// The first weight upload into each of the `slots` weight slots in `ops`, as (slot, what).
fn first_uploads(ops: &[crate::engine::plan::Op], slots: usize) -> Vec<(usize, SlotContent)> {
    (0..slots)
        .filter_map(|s| {
            ops.iter().find_map(|op| match op.kind {
                OpKind::UploadWeights { slot, what } if slot == s => Some((s, what)),
                _ => None,
            })
        })
        .collect()
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

/// Elements of a gradient download.
fn grad_len(c: &Ctx, what: GradTarget) -> usize {
    match what {
        GradTarget::Layer(i) => c.layout.layer(i).train_len(),
        GradTarget::Head => c.layout.dims.c + c.layout.dims.v * c.layout.dims.c,
    }
}

/// AdamW on buffer `i` with gradient `g` (clip coefficient `coef`), on fp32 or 8-bit moments.
///
/// # Safety
/// The schedule must give the caller exclusive use of buffer `i`'s masters and moments.
unsafe fn apply_update(c: &Ctx, sd: &StepData, grant: &Grant, i: usize, g: &[f32], coef: f32) {
    grant.moments(c.param_buf(i));
    let st = AdamWStep::new(&c.adamw, sd.adam_step, sd.lr);
    let seed = sd.adam_step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64;
    // SAFETY: the caller's exclusivity (the image is part of the buffer's `Params`): the
    // masters and their image are written in the one pass.
    unsafe {
        let image = c.images[i].map(|img| img.as_mut_slice());
        moments_of(c, i).update(c.params[i].as_mut_slice(), g, &st, coef, seed, image)
    }
}

/// Buffer `i`'s optimizer state, in its storage.
///
/// # Safety
/// The caller must have exclusive use of buffer `i`'s moments while the value lives.
unsafe fn moments_of<'a>(c: &'a Ctx, i: usize) -> AnyMoments<'a> {
    // SAFETY: the caller's exclusivity.
    unsafe { c.moments[i].view() }
}

/// The step's summed loss, from the host loss buffers (downloaded before any caller runs).
fn loss_sum(c: &Ctx, sd: &StepData, g: &Grant) -> f64 {
    sd.mbs
        .iter()
        .enumerate()
        .map(|(m, mb)| {
            // SAFETY: every caller is ordered after the loss downloads of the step.
            let host = c.staging(g, Res::LossHost(m), false);
            // SAFETY: every caller is ordered after the loss downloads of the step.
            let l = unsafe { host.as_const().sub(0..mb.n()).as_slice() };
            l.iter().map(|&x| x as f64).sum::<f64>()
        })
        .sum()
}

/// Streamed modes: record buffer `i`'s squared gradient norm for the step, and check the
/// step's losses once. Returns whether the step is still finite (no non-finite loss or
/// gradient met so far).
fn measure(c: &Ctx, sd: &StepData, grant: &Grant, st: &mut StepStats, i: usize, g: &[f32]) -> bool {
    record(c, sd, grant, st, i, sum_squares(g))
}

/// Record `sq`, buffer `i`'s squared gradient norm, as [`measure`] does.
fn record(c: &Ctx, sd: &StepData, grant: &Grant, st: &mut StepStats, i: usize, sq: f64) -> bool {
    st.sq[i] = sq;
    st.seen[i] = true;
    if !st.loss_checked {
        st.loss_checked = true;
        st.poisoned |= !loss_sum(c, sd, grant).is_finite();
    }
    st.poisoned |= !sq.is_finite();
    !st.poisoned
}

/// The squared norm of the embedding's complete gradient `g`, bit for bit [`sum_squares`]`(g)`.
/// Untied, only the rows the step's tokens name are ever non-zero (the scatters write them; each
/// update zeroes every row), and the fault hook's first element: it reads just those rows,
/// a pass over at most one row per token instead of the whole table.
fn embed_sum_squares(c: &Ctx, sd: &StepData, g: &[f32]) -> f64 {
    let mut rows = c.embed_touched.lock().expect("no update panicked");
    if rows.is_empty() {
        return sum_squares(g);
    }
    rows.fill(false);
    mark_named_rows(&mut rows, sd.mbs.iter().flat_map(|mb| mb.ids.iter()));
    // `OpKind::PoisonGrad` writes the first element.
    rows[0] |= sd.inject_nan;
    let sq = sum_squares_rows(g, c.layout.dims.c, &rows);
    debug_assert_eq!(sq.to_bits(), sum_squares(g).to_bits(), "an unnamed row has a gradient");
    sq
}

/// The clip coefficient of a layer updated before the step's norm is known (`lean`/`compact`).
///
/// What is known: the squared norms of the gradients measured so far this step (final norm,
/// untied head, the layers above, this layer), `seen`, and every buffer's at the last finite
/// step, `prev_sq`. The estimate assumes the measured buffers hold the same share of the
/// squared norm as at that step: `‖g‖² ≈ ‖g_prev‖² · seen / seen_prev`, and never less than
/// `seen`, which is part of the step's norm. Without a previous step it is `seen`.
fn layer_clip_coefficient(st: &StepStats, grad_clip: f64) -> f32 {
    let seen: f64 = st.sq.iter().zip(&st.seen).filter(|(_, s)| **s).map(|(q, _)| q).sum();
    let est = if st.prev_sq.is_empty() {
        seen
    } else {
        let prev: f64 = st.prev_sq.iter().sum();
        let seen_prev: f64 =
            st.prev_sq.iter().zip(&st.seen).filter(|(_, s)| **s).map(|(q, _)| q).sum();
        if seen_prev > 0.0 { prev * (seen / seen_prev) } else { prev }
    };
    clip_coefficient(est.max(seen).sqrt(), grad_clip)
}

/// A streamed update (`lean`/`compact`) of layer buffer `i` from its complete gradient `g`,
/// before the layers below it are back: record `|g|²`, then, unless the step has met a
/// non-finite loss or gradient (this buffer's included), clip by the estimated norm
/// ([`layer_clip_coefficient`]) and apply AdamW. A non-finite value never reaches masters or
/// moments; buffers updated before it was met keep their update (see ARCHITECTURE.md,
/// "Streamed updates").
///
/// # Safety
/// As [`apply_update`].
unsafe fn streamed_update(c: &Ctx, sd: &StepData, grant: &Grant, i: usize, g: &[f32]) {
    let mut st = c.stats.lock().expect("no update panicked");
    if !measure(c, sd, grant, &mut st, i, g) {
        return;
    }
    let coef = if c.grad_clip <= 0.0 {
        1.0
    } else {
        let coef = layer_clip_coefficient(&st, c.grad_clip);
        if st.prev_sq.is_empty() && sd.adam_step == 1 {
            // The moments were zero: the norm op rescales them to the step's coefficient.
            st.provisional[i] = coef;
        }
        coef
    };
    // SAFETY: the caller's exclusivity.
    unsafe { apply_update(c, sd, grant, i, g, coef) };
    st.applied = true;
}

/// Buffer `i`'s update once the step's norm is known: clipped by it, unless the step is skipped.
///
/// # Safety
/// As [`apply_update`], and ordered after the step's norm op.
unsafe fn update_after_norm(c: &Ctx, sd: &StepData, grant: &Grant, i: usize, g: &[f32]) {
    if let Some(coef) = norm_clip(c) {
        // SAFETY: the caller's exclusivity.
        unsafe { apply_update(c, sd, grant, i, g, coef) };
    }
}

/// [`update_after_norm`], then the gradient zeroed for the next step (a host gradient buffer's
/// whole update).
///
/// # Safety
/// As [`update_after_norm`], with exclusive use of the gradient `g`.
unsafe fn update_and_zero(c: &Ctx, sd: &StepData, grant: &Grant, i: usize, g: HostPtrMut) {
    // SAFETY: the caller's exclusivity.
    unsafe {
        let g = g.as_mut_slice();
        update_after_norm(c, sd, grant, i, g);
        g.fill(0.0);
    }
}

/// The clip coefficient of the step's norm, or `None` when the step is skipped. Read once the
/// step's norm op has run.
fn norm_clip(c: &Ctx) -> Option<f32> {
    let norm = f64::from_bits(c.norm.load(Ordering::Acquire));
    (!c.skip.load(Ordering::Acquire)).then(|| clip_coefficient(norm, c.grad_clip))
}

/// Mark the embedding rows the first part of its update takes: those the next step gathers,
/// or every row when the caller did not name them or the moments are 8-bit (whose blocks and
/// stochastic rounding span rows).
fn pick_next_rows(c: &Ctx, sd: &StepData, pick: &mut [bool]) {
    let i = c.param_index(ParamBuf::Embed);
    let all = sd.next_ids.is_empty() || matches!(c.moments[i], MomentHandle::Q8(_));
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
unsafe fn update_embed_rows(c: &Ctx, sd: &StepData, grant: &Grant, pick: &[bool], want: bool) {
    use rayon::prelude::*;
    let i = c.param_index(ParamBuf::Embed);
    grant.moments(ParamBuf::Embed);
    let (p, g) = (c.params(grant, ParamBuf::Embed, true), c.grads(grant, ParamBuf::Embed, true));
    let MomentHandle::F32 { m, v } = c.moments[i] else {
        // 8-bit moments: the first part takes every row (`pick_next_rows`).
        if pick.contains(&want) {
            // SAFETY: the caller's exclusivity, over every row.
            unsafe { update_and_zero(c, sd, grant, i, g) };
        }
        return;
    };
    let coef = norm_clip(c);
    let st = AdamWStep::new(&c.adamw, sd.adam_step, sd.lr);
    let (cc, img) = (c.layout.dims.c, c.images[i]);
    pick.par_chunks(ROW_TASK).enumerate().for_each(|(t, rows)| {
        for run in row_runs(rows, want) {
            let e = (t * ROW_TASK + run.start) * cc..(t * ROW_TASK + run.end) * cc;
            // SAFETY: the caller's exclusivity over these rows; each task borrows its own.
            unsafe {
                let g = g.sub(e.clone()).as_mut_slice();
                if let Some(coef) = coef {
                    let (p, m, v) = (p.sub(e.clone()), m.sub(e.clone()), v.sub(e.clone()));
                    let img = img.map(|x| x.sub(e.clone()).as_mut_slice());
                    let (p, m, v) = (p.as_mut_slice(), m.as_mut_slice(), v.as_mut_slice());
                    adamw_update_local(p, img, g, m, v, &st, coef);
                }
                g.fill(0.0);
            }
        }
    });
}

/// Scale buffer `i`'s moments as if its gradient had been multiplied by `r`: `m *= r`,
/// `v *= r²`. Used on the run's first update, whose moments hold that one gradient only, so the
/// result is what clipping by `r` times the coefficient used would have stored. (The masters
/// need no correction: AdamW's first step, `lr · m̂ / (sqrt(v̂) + eps)`, does not depend on the
/// gradient's scale while `|g| >> eps`.)
///
/// # Safety
/// The schedule must give the caller exclusive use of buffer `i`'s moments.
unsafe fn rescale_moments(c: &Ctx, grant: &Grant, i: usize, r: f32) {
    grant.check(Res::Moments(c.param_buf(i)), true);
    // SAFETY: the caller's exclusivity.
    unsafe { moments_of(c, i).rescale(r) }
}

/// The rope tables' (cos, sin) for sequences of `t` positions.
fn ropes<'a, B: Backend + ?Sized>(
    vw: &'a dyn Views<B>,
    c: &Ctx,
    t: usize,
) -> Vec<(&'a B::Buf, &'a B::Buf)> {
    let len = t * c.layout.dims.d / 2;
    let table = |&(cos, sin): &(DevBuf, DevBuf)| (vw.buf(cos.prefix(len)), vw.buf(sin.prefix(len)));
    // The rope tables are written once, before the first step, and only read after: no op
    // declares them.
    c.scratch.ropes.iter().map(table).collect()
}

/// Every device buffer of the engine, allocated once.
struct DeviceBuffers {
    slots: [DevBuf; 2],
    workspace: DevBuf,
    dws: [DevBuf; 2],
    acts: Vec<Vec<DevBuf>>,
    dres: Vec<DevBuf>,
    ids: Vec<DevBuf>,
    targets: Vec<DevBuf>,
    losses: Vec<DevBuf>,
    /// Rows of a head chunk.
    chunk: usize,
    scratch: Scratch,
    stash: Vec<Option<Vec<Vec<DevBuf>>>>,
    tiled: Option<TiledHead>,
}

/// Allocate every device buffer `sizes` lists; an allocation that fails names the plan's total.
fn alloc_device<D: Device>(
    dev: &D,
    layout: &ModelLayout,
    sizes: &Sizes,
    cfg: &EngineConfig,
) -> Result<DeviceBuffers> {
    let alloc = |len: usize| -> Result<DevBuf> {
        dev.alloc(len).with_context(|| {
            format!(
                "the device cannot hold the plan ({} bytes planned)\nhint: raise device.memory, or lower train.micro_batch_size / train.max_seq_len",
                sizes.device_total()
            )
        })
    };
    let (n, mbs, d) = (sizes.mb_rows, sizes.micro_batches, layout.dims);
    let slots = [alloc(sizes.slot_elems())?, alloc(sizes.slot_elems())?];
    let workspace = alloc(sizes.workspace_elems())?;
    let dws = [alloc(sizes.dw)?, alloc(sizes.dw)?];
    let acts = (0..sizes.act_sets)
        .map(|_| (0..mbs).map(|_| alloc(sizes.act)).collect::<Result<Vec<_>>>())
        .collect::<Result<Vec<_>>>()?;
    let per_mb = |len: usize| (0..mbs).map(|_| alloc(len)).collect::<Result<Vec<_>>>();
    let dres = per_mb(sizes.act)?;
    let ids = per_mb(n)?;
    let targets = per_mb(n)?;
    let losses = per_mb(n)?;
    let chunk = cfg.head_chunk_rows.clamp(1, n.max(1));
    let (act_widths, stashed) = (layout.max_act_widths(), layout.stashed_acts());
    // When every layer keeps its internals, no recompute writes the scratch's copies of what
    // they keep: those are not allocated (`Sizes::new`), and `Engine::eval`, with the device
    // idle, borrows the first layer's kept buffers instead.
    let keeps_all = cfg.kept_layers == d.layers;
    let own_scratch = |j: usize, w: usize| match keeps_all && stashed[j] {
        true => Ok(None),
        false => alloc(n * w).map(Some),
    };
    let scratch_or_kept: Vec<Option<DevBuf>> =
        act_widths.iter().enumerate().map(|(j, &w)| own_scratch(j, w)).collect::<Result<_>>()?;
    // A kept layer's own buffers: its own where it keeps the value, else the scratch's.
    let kept_acts = || -> Result<Vec<DevBuf>> {
        let own = |(j, w): (usize, &usize)| match (stashed[j], scratch_or_kept[j]) {
            (false, Some(b)) => Ok(b),
            _ => alloc(n * w),
        };
        act_widths.iter().enumerate().map(own).collect()
    };
    let stash = (0..d.layers)
        .map(|i| match keeps_internals(d.layers, cfg.kept_layers, i) {
            true => (0..mbs).map(|_| kept_acts()).collect::<Result<Vec<_>>>().map(Some),
            false => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    let first_kept =
        |j: usize| stash[0].as_ref().expect("layer 0 keeps when every layer does")[0][j];
    let acts_scratch: Vec<DevBuf> = scratch_or_kept
        .iter()
        .enumerate()
        .map(|(j, b)| b.unwrap_or_else(|| first_kept(j)))
        .collect();
    let grads_scratch =
        layout.max_grad_widths()[1..].iter().map(|w| alloc(n * w)).collect::<Result<Vec<_>>>()?;
    let half = d.d / 2;
    let scratch = Scratch {
        acts: acts_scratch,
        grads: grads_scratch,
        y: alloc(n * d.c)?,
        head: match sizes.head.is_whole() {
            true => Some(HeadBufs {
                hf: alloc(n * d.c)?,
                dhf: alloc(n * d.c)?,
                rstd: alloc(n)?,
                logits: alloc(chunk * d.v)?,
            }),
            false => None,
        },
        ropes: (0..layout.rope.len())
            .map(|_| Ok((alloc(cfg.seq_len * half)?, alloc(cfg.seq_len * half)?)))
            .collect::<Result<Vec<_>>>()?,
        dequant: alloc(sizes.dequant_elems())?,
    };

    let tiled = match sizes.head.is_whole() {
        true => None,
        false => Some(TiledHead {
            tiling: sizes.head,
            logits: alloc(chunk * sizes.head.rows)?,
            dhf_chunk: alloc(chunk * d.c)?,
            rows: (0..mbs)
                .map(|_| Ok([alloc(n * d.c)?, alloc(n)?, alloc(n * STATS)?, alloc(n * d.c)?]))
                .collect::<Result<Vec<_>>>()?,
            dnorm: alloc(d.c)?,
        }),
    };
    Ok(DeviceBuffers {
        slots,
        workspace,
        dws,
        acts,
        dres,
        ids,
        targets,
        losses,
        chunk,
        scratch,
        stash,
        tiled,
    })
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
