//! Allocation, once per engine: the host queue's threads and where the queues' threads run,
//! every device buffer the plan's sizes list, the host staging buffers, and the context with
//! the handles queued work reaches them through. Nothing is allocated after this.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use horizon_backend::bf16::round_to_bf16;
use horizon_backend::threads::{self, Placement};
use horizon_backend::{Backend, Bf16, DevBuf, Device, Event, HostPtr, KernelTimer, Queue};

use super::ctx::{
    Ctx, DeviceBuffers, Grant, HostBuffers, Internals, MomentHandle, Scratch, Slabs, StepState,
    TiledHead, handle, param_index,
};
use super::upload::{first_uploads, stage_weights};
use super::{Engine, EvalRun, plan_shape};
use crate::engine::chunking::Chunking;
use crate::engine::head_tiles::STATS;
use crate::engine::options::{EngineConfig, GradWire, WeightPath};
use crate::engine::phases::{Phase, PhaseClock};
use crate::engine::plan::{ParamBuf, PlanShape, Schedule};
use crate::engine::sizes::Sizes;
use crate::engine::slots::SlotRegions;
use crate::hf::config::ModelConfig;
use crate::model::base::FrozenBase;
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::model::transformer::{HeadBufs, rope_tables};
use crate::optim::decay::DecayGroups;
use crate::optim::step::StepStats;
use crate::store::TrainState;

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
        validate(&dev, &layout, &cfg)?;
        let sizes = Sizes::new(&layout, &cfg);
        let shape = plan_shape(&layout, &cfg, &sizes);
        // The host queue's threads, before anything is allocated or queued.
        let host_pool = start_host_pool(&dev, &cfg)?;
        let schedule = Schedule::new(shape);
        let chunking = Chunking::of(&layout, &cfg);
        let devbufs = alloc_device(&dev, &layout, &sizes, &cfg, &chunking)?;
        dev.set_workspace(devbufs.workspace);
        let mut state = Box::new(state.into_memory(&layout, cfg.memory));
        let pinned_grads = pin_downloaded_grads(&dev, &mut state, &layout, shape.head_buf());
        let (host, hostbufs) = alloc_host(&dev, &mut state, &layout, &sizes, &cfg, shape);
        let decay = DecayGroups::new(&layout, cfg.no_decay);
        let ctx = Arc::new(Ctx {
            regions: SlotRegions::new(&layout, shape.head_buf(), &sizes.head, &chunking),
            chunking,
            step: StepState::new(&layout, state.params.buffers().len(), state.last_sq.clone()),
            moe: super::moe::MoeState::new(&layout, sizes.mb_rows, sizes.micro_batches),
            weight_bytes: <D::Backend as Backend>::PRECISION.weight_bytes(),
            head_chunk: head_chunk(&cfg, &sizes),
            phases: Arc::new(PhaseClock::default()),
            layout,
            base,
            shape,
            adamw: cfg.adamw,
            decay,
            grad_clip: cfg.grad_clip,
            memory: cfg.memory,
            devbufs,
            hostbufs,
            reference_pass: Default::default(),
        });
        let events = [reached(schedule.len()), reached(schedule.len())];
        let engine = Engine {
            timers: kernel_timers(&ctx.phases),
            grants: [0, 1].map(|k| schedule.ops(k).iter().map(Grant::of).collect()),
            eval: EvalRun::new(shape),
            steps: state.step,
            updates: state.updates,
            ctx,
            pinned_grads,
            state,
            _host: host,
            schedule,
            events,
            cfg,
            sizes,
            host_pool,
            trace: None,
            dev,
        };
        // The ropes' uploads end with a synchronize; the stages are filled on the host.
        engine.upload_ropes();
        engine.fill_stages();
        Ok(engine)
    }

    /// The rope tables, uploaded once (before the first step; only read after).
    fn upload_ropes(&self) {
        let layout = &self.ctx.layout;
        let tables: Vec<(Vec<f32>, Vec<f32>)> =
            layout.rope.iter().map(|f| rope_tables(f, self.cfg.seq_len)).collect();
        for (&(cos_buf, sin_buf), (cos, sin)) in self.ctx.devbufs.scratch.ropes.iter().zip(&tables)
        {
            // SAFETY: the tables live until the synchronize below.
            self.dev.upload(cos_buf, unsafe { HostPtr::new(cos) });
            self.dev.upload(sin_buf, unsafe { HostPtr::new(sin) });
        }
        self.dev.synchronize();
    }

    /// Staged uploads: the stages hold what the step before the first would have staged, the
    /// first upload into each slot (see `plan::build::stage_uploads`).
    fn fill_stages(&self) {
        let ctx = &self.ctx;
        for (slot, what) in first_uploads(self.schedule.ops(0), ctx.hostbufs.stages.len()) {
            // SAFETY: the device is idle and no step has run: nothing else touches the masters
            // or the stages.
            unsafe { self.host_pool.install(|| stage_weights(ctx, slot, what)) };
        }
    }
}

/// The configuration's sizes and choices the engine can run, on a device of `D`'s precision.
fn validate<D: Device>(dev: &D, layout: &ModelLayout, cfg: &EngineConfig) -> Result<()> {
    if cfg.micro_batch_size == 0
        || cfg.batch_size == 0
        || cfg.checkpoint_every == 0
        || cfg.grad_slabs == 0
    {
        bail!("engine sizes must be at least 1: {cfg:?}");
    }
    if cfg.kept_layers > 0 && cfg.checkpoint_every != 1 {
        bail!("kept layer internals need checkpoint_every 1: {cfg:?}");
    }
    if cfg.kept_layers > layout.dims.layers {
        bail!("{} kept layers of a {}-layer model: {cfg:?}", cfg.kept_layers, layout.dims.layers);
    }
    if cfg.memory.streams_updates() && Chunking::new(layout, cfg.expert_chunk, true).trained() {
        bail!(
            "engine.expert_chunk: trained experts (full fine-tuning, or adapters on the experts) \
             stream in chunks only with optimizer.memory: exact, which adds each chunk's \
             gradient into a whole host gradient; this run's is {:?}\nhint: set \
             optimizer.memory: exact, or leave engine.expert_chunk unset (whole layers)",
            cfg.memory
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
    Ok(())
}

/// The host queue's own pool of `engine.host_threads` (pinned as `engine.pin_threads` says),
/// handed to the device, with the queues' threads placed beside it.
fn start_host_pool<D: Device>(dev: &D, cfg: &EngineConfig) -> Result<Arc<rayon::ThreadPool>> {
    let host_threads = cfg.host_threads.resolve(cfg.backend);
    let placement = Placement::last(host_threads, cfg.pin_threads);
    let host_pool = Arc::new(
        threads::pool("horizon-host", host_threads, placement)
            .with_context(|| format!("cannot start the {host_threads} host threads"))?,
    );
    dev.host_threads(host_pool.clone());
    let queues = threads::QueueCpus::beside_host_threads(host_threads, cfg.pin_threads);
    place_queue_threads(dev, queues);
    Ok(host_pool)
}

/// `n` events, each already reached: "step -1" and "step -2" (or an earlier evaluation) have
/// nothing pending.
pub(super) fn reached(n: usize) -> Vec<Event> {
    (0..n)
        .map(|_| {
            let e = Event::new();
            e.signal();
            e
        })
        .collect()
}

/// One kernel timer per compute phase (indexed by `Phase as usize`), adding to `clock`.
fn kernel_timers(clock: &Arc<PhaseClock>) -> [KernelTimer; 4] {
    [Phase::Forward, Phase::Recompute, Phase::Backward, Phase::Head].map(|p| {
        debug_assert!((p as usize) < 4, "the compute phases come first");
        let clock = clock.clone();
        Arc::new(move |d| clock.add_duration(p, d)) as KernelTimer
    })
}

/// Rows of a head chunk: `engine.head_chunk_rows`, at most a micro-batch's rows.
fn head_chunk(cfg: &EngineConfig, sizes: &Sizes) -> usize {
    cfg.head_chunk_rows.clamp(1, sizes.mb_rows.max(1))
}

impl StepState {
    /// Nothing measured yet of `buffers` buffers; `last_sq` is the last finite step's squared
    /// norms (a resumed run's).
    fn new(layout: &ModelLayout, buffers: usize, last_sq: Vec<f64>) -> Self {
        let v = layout.dims.v;
        let touched = if layout.trains_base() && !layout.tied { v } else { 0 };
        StepState {
            stats: Mutex::new(StepStats::new(buffers, last_sq)),
            applied: AtomicBool::new(false),
            norm: AtomicU64::new(0),
            skip: AtomicBool::new(false),
            held: [(); 2].map(|()| (0..buffers).map(|_| AtomicU64::new(0)).collect()),
            embed_next: Mutex::new(vec![false; if layout.trains_base() { v } else { 0 }]),
            embed_touched: Mutex::new(vec![false; touched]),
        }
    }
}

/// Host buffers the engine owns (the closures reach them through `Ctx`'s handles).
pub(super) struct HostOwned<D: Device> {
    _ckpt: Vec<Vec<D::Staging<f32>>>,
    /// The gradient slabs: fp32 or bf16 (the other empty), and the fp32 expansion layer.
    _slabs: Vec<D::Staging<f32>>,
    _slabs_bf16: Vec<D::Staging<Bf16>>,
    _expand: Vec<f32>,
    _emb_stage: Vec<D::Staging<f32>>,
    _dx_stage: Vec<D::Staging<f32>>,
    _loss_host: Vec<D::Staging<f32>>,
    _images: Vec<Option<D::Staging<Bf16>>>,
    _reference: Vec<Option<D::Staging<Bf16>>>,
    _stages: Vec<D::Staging<Bf16>>,
}

/// The host staging buffers `sizes` lists, and the handles to them and to `state`'s buffers.
fn alloc_host<D: Device>(
    dev: &D,
    state: &mut TrainState,
    layout: &ModelLayout,
    sizes: &Sizes,
    cfg: &EngineConfig,
    shape: PlanShape,
) -> (HostOwned<D>, HostBuffers) {
    let (n, mbs) = (sizes.mb_rows, sizes.micro_batches);
    let stage = |len: usize| dev.alloc_staging::<f32>(len);
    let per_mb = |len: usize| (0..mbs).map(|_| stage(len)).collect::<Vec<_>>();
    let (n_f32, n_bf16) = match cfg.grad_wire {
        GradWire::Fp32 => (cfg.grad_slabs, 0),
        GradWire::Bf16 => (0, cfg.grad_slabs),
    };
    let expand_len = if n_bf16 > 0 && cfg.memory.streams_updates() { sizes.slab } else { 0 };
    let n_stages = if shape.staged { 2 } else { 0 };
    let mut h = HostOwned::<D> {
        _ckpt: (0..sizes.blocks).map(|_| per_mb(sizes.act)).collect(),
        _slabs: (0..n_f32).map(|_| stage(sizes.slab)).collect(),
        _slabs_bf16: (0..n_bf16).map(|_| dev.alloc_staging::<Bf16>(sizes.slab)).collect(),
        _expand: vec![0.0f32; expand_len],
        _emb_stage: per_mb(sizes.act),
        _dx_stage: per_mb(sizes.act),
        _loss_host: per_mb(n),
        _images: weight_images(dev, &state.params, layout, cfg),
        _reference: reference_copy(dev, &state.params, cfg),
        _stages: (0..n_stages).map(|_| dev.alloc_staging::<Bf16>(sizes.stage)).collect(),
    };
    let bufs = |ps: &mut ParamStore| ps.buffers_mut().into_iter().map(handle).collect();
    let handles = |v: &mut Vec<D::Staging<f32>>| v.iter_mut().map(|s| handle(s)).collect();
    let slabs = match cfg.grad_wire {
        GradWire::Fp32 => Slabs::F32(handles(&mut h._slabs)),
        GradWire::Bf16 => Slabs::Bf16(
            h._slabs_bf16.iter_mut().map(|s| handle(s)).collect(),
            handle(&mut h._expand),
        ),
    };
    let b = HostBuffers {
        params: bufs(&mut state.params),
        grads: bufs(&mut state.grads),
        moments: MomentHandle::all(&mut state.opt),
        images: h._images.iter_mut().map(|i| i.as_mut().map(|s| handle(s))).collect(),
        reference: h._reference.iter_mut().map(|i| i.as_mut().map(|s| handle(s))).collect(),
        stages: h._stages.iter_mut().map(|s| handle(s)).collect(),
        ckpt: h._ckpt.iter_mut().map(handles).collect(),
        slabs,
        emb_stage: handles(&mut h._emb_stage),
        dx_stage: handles(&mut h._dx_stage),
        loss_host: handles(&mut h._loss_host),
    };
    (h, b)
}

/// The reference copy (`EngineConfig::reference_copy`): every non-empty buffer of `params`
/// rounded to bf16, page-locked; none without one.
fn reference_copy<D: Device>(
    dev: &D,
    params: &ParamStore,
    cfg: &EngineConfig,
) -> Vec<Option<D::Staging<Bf16>>> {
    let copy = |p: &[f32]| {
        let mut s = dev.alloc_staging::<Bf16>(p.len());
        round_to_bf16(&mut s, p);
        s
    };
    let bufs = params.buffers().into_iter();
    bufs.map(|p| (cfg.reference_copy && !p.is_empty()).then(|| copy(p))).collect()
}

/// The page-locked bf16 images of `params` the engine uploads from (`WeightPath::Image` on a
/// bf16 backend): one per buffer the device receives (not an untied embedding, gathered on
/// the host from the masters; not the empty buffers of an adapter run), each the masters
/// rounded to nearest even.
fn weight_images<D: Device>(
    dev: &D,
    params: &ParamStore,
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

/// Places the queues' own threads as [`threads::QueueCpus`] says: off the host threads' CPUs
/// (a host op handed across CPUs waited for an idle CPU to wake), the copy queues' threads with
/// the shortest time slice (`COPY_SLICE_US`: a woken copy no longer waits out a compute
/// thread's slice). The measurements behind both are in `bench/validation/LOG.md` (2026-12-04,
/// 05:09 and 08:04).
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

/// The copy queues' threads' time slice: 100 us, the shortest Linux's EEVDF scheduler takes.
const COPY_SLICE_US: u64 = 100;

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

/// Device allocations, each failure naming the plan's total.
struct DeviceAlloc<'a, D> {
    dev: &'a D,
    planned: usize,
}

impl<D: Device> DeviceAlloc<'_, D> {
    fn one(&self, len: usize) -> Result<DevBuf> {
        self.dev.alloc(len).with_context(|| {
            format!(
                "the device cannot hold the plan ({} bytes planned)\nhint: raise device.memory, or lower train.micro_batch_size / train.max_seq_len",
                self.planned
            )
        })
    }

    fn many(&self, count: usize, len: usize) -> Result<Vec<DevBuf>> {
        (0..count).map(|_| self.one(len)).collect()
    }
}

/// Allocate every device buffer `sizes` lists; an allocation that fails names the plan's total.
pub(super) fn alloc_device<D: Device>(
    dev: &D,
    layout: &ModelLayout,
    sizes: &Sizes,
    cfg: &EngineConfig,
    chunking: &Chunking,
) -> Result<DeviceBuffers> {
    let a = DeviceAlloc { dev, planned: sizes.device_total() };
    let (n, mbs) = (sizes.mb_rows, sizes.micro_batches);
    // The two layer slots, then (experts in chunks) the two expert slots.
    let expert_slots = if sizes.chunk_slot > 0 { 2 } else { 0 };
    let mut slots = a.many(2, sizes.slot_elems())?;
    slots.extend(a.many(expert_slots, sizes.chunk_slot_elems())?);
    let workspace = a.one(sizes.workspace_elems())?;
    // The layers' two accumulators, then (trained experts in chunks) the chunks' two.
    let mut dws = a.many(2, sizes.dw)?;
    dws.extend(a.many(if sizes.chunk_dw > 0 { 2 } else { 0 }, sizes.chunk_dw)?);
    let acts = (0..sizes.act_sets).map(|_| a.many(mbs, sizes.act)).collect::<Result<_>>()?;
    let dres = a.many(mbs, sizes.act)?;
    let (ids, targets, losses) = (a.many(mbs, n)?, a.many(mbs, n)?, a.many(mbs, n)?);
    let (acts_scratch, stash) = alloc_internals(&a, layout, sizes, cfg, chunking)?;
    let scratch = alloc_scratch(&a, layout, sizes, cfg, acts_scratch)?;
    let rows = alloc_expert_rows(&a, layout, sizes, chunking, &scratch)?;
    let tiled = alloc_tiled(&a, layout, sizes, cfg)?;
    let moe = match &layout.moe {
        Some(m) => Some([a.one(n)?, a.one(2 * m.num_experts)?, a.one(m.num_experts)?]),
        None => None,
    };
    Ok(DeviceBuffers {
        moe,
        slots,
        workspace,
        dws,
        acts,
        dres,
        ids,
        targets,
        losses,
        scratch,
        stash,
        rows,
        tiled,
    })
}

/// Each micro-batch's internals in a chunked layer's pass ([`Internals`]): micro-batch 0's
/// are the scratch's buffers (nothing else runs on the compute queue inside a pass), the
/// others' their own where the pass carries a buffer. Empty without chunked layers.
fn alloc_expert_rows<D: Device>(
    a: &DeviceAlloc<'_, D>,
    layout: &ModelLayout,
    sizes: &Sizes,
    chunking: &Chunking,
    scratch: &Scratch,
) -> Result<Vec<Internals>> {
    if !chunking.any() {
        return Ok(Vec::new());
    }
    let carried = chunking.carried(layout);
    let n = sizes.mb_rows;
    // Carried: its own buffer of the chunked kinds' width; else the scratch's.
    let own = |bufs: &[DevBuf], carried: &[usize]| -> Result<Vec<DevBuf>> {
        let one = |(j, &w): (usize, &usize)| if w > 0 { a.one(n * w) } else { Ok(bufs[j]) };
        carried.iter().enumerate().map(one).collect()
    };
    let mut rows = vec![Internals { acts: scratch.acts.clone(), grads: scratch.grads.clone() }];
    for _ in 1..sizes.micro_batches {
        rows.push(Internals {
            acts: own(&scratch.acts, &carried.acts)?,
            grads: own(&scratch.grads, &carried.grads)?,
        });
    }
    Ok(rows)
}

/// The kept layers' internals per micro-batch (`None` for a layer that recomputes), and the
/// compute queue's scratch copy of each internal (the widest of each over the layers).
#[allow(clippy::type_complexity)]
fn alloc_internals<D: Device>(
    a: &DeviceAlloc<'_, D>,
    layout: &ModelLayout,
    sizes: &Sizes,
    cfg: &EngineConfig,
    chunking: &Chunking,
) -> Result<(Vec<DevBuf>, Vec<Option<Vec<Vec<DevBuf>>>>)> {
    let (n, mbs, layers) = (sizes.mb_rows, sizes.micro_batches, layout.dims.layers);
    let (act_widths, stashed) = (layout.max_act_widths(), layout.stashed_acts());
    // When every layer keeps its internals, no recompute writes the scratch's copies of what
    // they keep: those are not allocated (`Sizes::new`), and the scratch names the first
    // layer's kept buffers instead (nothing reads them through it). A chunked layer keeps
    // nothing, and recomputes into the scratch.
    let keepers = chunking.keepers(layers, cfg.kept_layers);
    let keeps_all = keepers.iter().all(|&k| k);
    let own_scratch = |j: usize, w: usize| match keeps_all && stashed[j] {
        true => Ok(None),
        false => a.one(n * w).map(Some),
    };
    let scratch_or_kept: Vec<Option<DevBuf>> =
        act_widths.iter().enumerate().map(|(j, &w)| own_scratch(j, w)).collect::<Result<_>>()?;
    // A kept layer's own buffers: its own where it keeps the value, else the scratch's.
    let kept_acts = || -> Result<Vec<DevBuf>> {
        let own = |(j, w): (usize, &usize)| match (stashed[j], scratch_or_kept[j]) {
            (false, Some(b)) => Ok(b),
            _ => a.one(n * w),
        };
        act_widths.iter().enumerate().map(own).collect()
    };
    let stash = (0..layers)
        .map(|i| match keepers[i] {
            true => (0..mbs).map(|_| kept_acts()).collect::<Result<Vec<_>>>().map(Some),
            false => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    let first_kept =
        |j: usize| stash[0].as_ref().expect("layer 0 keeps when every layer does")[0][j];
    let acts_scratch = scratch_or_kept
        .iter()
        .enumerate()
        .map(|(j, b)| b.unwrap_or_else(|| first_kept(j)))
        .collect();
    Ok((acts_scratch, stash))
}

/// The compute queue's scratch around one layer's internals `acts`: the backward program's
/// gradients, a layer output, the whole head's buffers (when it is not tiled), the rope tables
/// and the dequantisation workspace.
fn alloc_scratch<D: Device>(
    a: &DeviceAlloc<'_, D>,
    layout: &ModelLayout,
    sizes: &Sizes,
    cfg: &EngineConfig,
    acts: Vec<DevBuf>,
) -> Result<Scratch> {
    let (n, d, chunk) = (sizes.mb_rows, layout.dims, head_chunk(cfg, sizes));
    let widths = &layout.max_grad_widths()[1..];
    let grads = widths.iter().map(|w| a.one(n * w)).collect::<Result<_>>()?;
    let half = d.d / 2;
    Ok(Scratch {
        acts,
        grads,
        y: a.one(n * d.c)?,
        head: match sizes.head.is_whole() {
            true => Some(HeadBufs {
                hf: a.one(n * d.c)?,
                dhf: a.one(n * d.c)?,
                rstd: a.one(n)?,
                logits: a.one(chunk * d.v)?,
            }),
            false => None,
        },
        ropes: (0..layout.rope.len())
            .map(|_| Ok((a.one(cfg.seq_len * half)?, a.one(cfg.seq_len * half)?)))
            .collect::<Result<Vec<_>>>()?,
        dequant: a.one(sizes.dequant_elems())?,
    })
}

/// The tiled head's buffers (`None` for a whole head).
fn alloc_tiled<D: Device>(
    a: &DeviceAlloc<'_, D>,
    layout: &ModelLayout,
    sizes: &Sizes,
    cfg: &EngineConfig,
) -> Result<Option<TiledHead>> {
    if sizes.head.is_whole() {
        return Ok(None);
    }
    let (n, c, chunk) = (sizes.mb_rows, layout.dims.c, head_chunk(cfg, sizes));
    Ok(Some(TiledHead {
        tiling: sizes.head,
        logits: a.one(chunk * sizes.head.rows)?,
        dhf_chunk: a.one(chunk * c)?,
        rows: (0..sizes.micro_batches)
            .map(|_| Ok([a.one(n * c)?, a.one(n)?, a.one(n * STATS)?, a.one(n * c)?]))
            .collect::<Result<Vec<_>>>()?,
        dnorm: a.one(c)?,
    }))
}
