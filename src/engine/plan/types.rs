//! The plan's vocabulary: the buffers an op can touch ([`Res`], [`ParamBuf`]), what an op does
//! ([`OpKind`]) and on which queue ([`Op`]), and the sizes a plan is built for ([`PlanShape`]).

use std::fmt;

use horizon_backend::Queue;

/// A host parameter-shaped buffer (one of masters, gradients, moments).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ParamBuf {
    Embed,
    Layer(usize),
    FinalNorm,
    /// The untied LM head. A tied head is [`ParamBuf::Embed`].
    Head,
}

/// Every buffer an operation can touch, device and host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Res {
    /// Device weight slot (double-buffered layer weights, or final norm + LM head or a tile of it).
    Slot(usize),
    /// Device parameter-gradient accumulator (double-buffered).
    Dw(usize),
    /// Device residual-stream buffer `set` of micro-batch `m` (layer inputs and outputs).
    Act {
        set: usize,
        m: usize,
    },
    /// Device residual-stream gradient of micro-batch `m`.
    Dres(usize),
    /// Device scratch of the compute queue (one layer's internals, head scratch).
    Scratch,
    /// Device, a chunked layer's pass: micro-batch `m`'s internals and gradients that live
    /// from its first part to its last while the other micro-batches run theirs through each
    /// chunk ([`crate::engine::chunking::Carried`]; micro-batch 0's are the scratch's).
    ExpertRows(usize),
    /// Device token ids and targets of micro-batch `m`.
    Ids(usize),
    /// Device per-row losses of micro-batch `m`.
    Losses(usize),
    /// Device, tiled LM head: micro-batch `m`'s final-norm output `hf` and `rstd`, softmax
    /// statistics (running max, sum, target logit) and `dhf`, alive from the first tile of
    /// pass 1 to the final-norm backward.
    HeadRows(usize),
    /// Device, tiled LM head: the final norm's gradient accumulator (C).
    DnormW,
    /// Host parameters / gradients / AdamW moments of one buffer.
    Params(ParamBuf),
    Grads(ParamBuf),
    Moments(ParamBuf),
    /// Device: layer `layer`'s forward internals for micro-batch `m`, kept for its backward
    /// (`PlanShape::kept_layers`).
    Stash {
        layer: usize,
        m: usize,
    },
    /// Host: the embedding rows the next step gathers, which the first part of the embedding's
    /// update writes ([`OpKind::EmbedUpdate`]). The gather declares reading these rows, not the
    /// whole table (`Params(Embed)`): the update's second part writes only other rows, so the
    /// gather does not wait for it. Every write of the rows a step gathers comes after that
    /// step's gather: through its norm, which waits for the step's forward.
    EmbedNext,
    /// Host checkpoint: input of the first layer of `block`, micro-batch `m`.
    Ckpt {
        block: usize,
        m: usize,
    },
    /// Host gradient slab.
    Slab(usize),
    /// The page-locked bf16 stage of weight slot s (`PlanShape::staged`).
    WeightStage(usize),
    /// Host staging: embedding rows of micro-batch `m`; residual gradient of micro-batch `m`.
    EmbStage(usize),
    DxStage(usize),
    /// Host per-row losses of micro-batch `m`.
    LossHost(usize),
    /// The step's global gradient norm and whether the step is skipped.
    Norm,
    /// Streamed updates (`lean`/`compact`): each buffer's squared gradient norm, this step's
    /// and the last finite step's (from which a layer updated before the norm is known
    /// estimates it), and whether the step has met a non-finite loss or gradient so far.
    StepStats,
}

/// What a weight slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotContent {
    Layer(usize),
    /// Final norm weight followed by the LM head weight.
    Head,
    /// Final norm weight followed by tile `k` of the LM head: vocabulary rows
    /// `k * tile_rows .. min((k + 1) * tile_rows, V)` (a head too large for one slot).
    HeadTile(usize),
    /// Chunk `chunk` of layer `layer`'s routed experts (`PlanShape::chunked`), in one of the
    /// two expert slots; the layer's own slot then holds its trunk.
    Experts {
        layer: usize,
        chunk: usize,
    },
}

/// Where an uploaded residual-stream buffer comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActSource {
    /// The embedding rows gathered on the host.
    Embedding,
    /// A host checkpoint.
    Ckpt(usize),
}

/// The gradient a slab carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradTarget {
    Layer(usize),
    /// Final norm followed by the LM head.
    Head,
    /// Chunk `chunk` of layer `layer`'s trained experts (their gradient, as the chunk's slot
    /// holds them).
    Experts {
        layer: usize,
        chunk: usize,
    },
}

/// One operation of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// H2D (host work on the copy queue): gather the embedding rows of micro-batch `m` into
    /// its staging buffer.
    EmbedGather { m: usize },
    /// H2D: token ids and targets of micro-batch `m`.
    UploadIds { m: usize },
    /// H2D: a residual-stream buffer of micro-batch `m`.
    UploadAct { m: usize, set: usize, from: ActSource },
    /// H2D: weights into a slot.
    UploadWeights { slot: usize, what: SlotContent },
    /// Host: round `what`'s trained weights into the stage of `slot` (`PlanShape::staged`),
    /// for the slot's next upload.
    StageWeights { slot: usize, what: SlotContent },
    /// D2H: the input of a block's first layer, to the host checkpoint.
    SaveCkpt { block: usize, m: usize, set: usize },
    /// Compute: one layer forward of micro-batch `m`, `Act{src}` -> `Act{dst}`; `recompute`:
    /// the backward's block recompute (from a checkpoint), not the step's forward.
    Forward { layer: usize, slot: usize, m: usize, src: usize, dst: usize, recompute: bool },
    /// Compute, a layer whose experts stream in chunks: chunk `chunk` of its experts (in
    /// expert slot `slot`) on micro-batch `m`, after its [`OpKind::Forward`] (which runs the
    /// ops before the experts); `first`: the first chunk of the layer's pass (it sorts the
    /// rows by expert and overwrites the experts' output, which the others add to).
    ForwardExperts {
        layer: usize,
        chunk: usize,
        slot: usize,
        m: usize,
        src: usize,
        first: bool,
        recompute: bool,
    },
    /// Compute, a layer whose experts stream in chunks: the ops after its experts, which
    /// write `Act{dst}`.
    ForwardEnd { layer: usize, slot: usize, m: usize, src: usize, dst: usize, recompute: bool },
    /// Compute, a layer whose experts stream in chunks: the backward of chunk `chunk` of its
    /// experts on micro-batch `m`, between its [`OpKind::Backward`] (the recompute of every op
    /// but the experts, and the backward of the ops after them) and [`OpKind::BackwardEnd`].
    BackwardExperts {
        layer: usize,
        chunk: usize,
        slot: usize,
        m: usize,
        set: usize,
        dw: usize,
        first: bool,
    },
    /// Compute, a layer whose experts stream in chunks: the backward of the ops before its
    /// experts.
    BackwardEnd { layer: usize, slot: usize, m: usize, set: usize, dw: usize },
    /// Compute: zero a gradient accumulator.
    ZeroDw { dw: usize },
    /// Host: fault injection for the tests (`StepParams::inject_nan`): a NaN into element 0 of
    /// buffer `what`'s host gradient, before the first op that measures the step's gradients.
    /// A no-op unless the step asks for it; declared as the write it is.
    PoisonGrad { what: ParamBuf },
    /// Compute: final norm, LM head and cross-entropy of micro-batch `m`, forward and backward.
    Head { slot: usize, m: usize, src: usize, dw: usize },
    /// Compute, tiled head pass 1: for each chunk of rows of micro-batch `m`, the logits of
    /// tile `tile` (resident in `slot`) folded into the rows' softmax statistics; tile 0 first
    /// runs the final norm of `Act{src}` into the micro-batch's `hf`, `rstd`.
    HeadStats { tile: usize, slot: usize, m: usize, src: usize },
    /// Compute, tiled head pass 2: per chunk of rows, the tile's logits again, turned into
    /// dlogits in place (from the complete statistics); `dhf` of the rows gets dlogits · W_tile
    /// (`first`: the first tile of the pass overwrites it, later tiles add), and
    /// `Dw{dw}[0..rows*C] += dlogitsᵀ · hf`.
    HeadGrad { tile: usize, slot: usize, m: usize, dw: usize, first: bool },
    /// Compute, tiled head, after the last tile: micro-batch `m`'s losses from its statistics,
    /// and the final norm's backward (`dhf` -> `dres`, overwrites; `DnormW +=`), the norm
    /// weight read from `slot`.
    HeadFinish { slot: usize, m: usize, src: usize },
    /// Compute, tiled head: zero the final norm's gradient accumulator.
    ZeroDnorm,
    /// Compute: recompute layer internals from `Act{set}`, then the layer's backward.
    Backward { layer: usize, slot: usize, m: usize, set: usize, dw: usize },
    /// D2H: per-row losses of micro-batch `m`.
    DownloadLosses { m: usize },
    /// D2H: a gradient accumulator into a slab.
    DownloadDw { dw: usize, slab: usize, what: GradTarget },
    /// D2H: the final norm's and LM head's gradient accumulator straight into their host
    /// gradient buffers (overwrites: nothing else has written them this step).
    DownloadHeadGrads { dw: usize },
    /// D2H, tiled head: tile `tile`'s gradient (`Dw{dw}`'s first rows) straight into its rows
    /// of the host head gradient (overwrites).
    DownloadHeadTileGrads { dw: usize, tile: usize },
    /// D2H, tiled head: the final norm's gradient accumulator into its host gradient
    /// (overwrites).
    DownloadNormGrads,
    /// Host (`lean`/`compact`): clip (by an estimate of the step's norm, see docs/configuration.md)
    /// and AdamW-update layer `layer` from the slab its gradient came back in, before the
    /// layers below it are back; the gradient is then dropped.
    SlabUpdate { slab: usize, layer: usize },
    /// Host (`lean`/`compact`): record the squared norm of layer `layer`'s gradient, which stays
    /// in its slab until the step's norm is known (no later layer of the step needs the slab).
    MeasureSlab { slab: usize, layer: usize },
    /// Host (`lean`/`compact`): clip (by the step's norm) and AdamW-update layer `layer` from
    /// the slab [`OpKind::MeasureSlab`] left its gradient in.
    HeldSlabUpdate { slab: usize, layer: usize },
    /// Host (`lean`/`compact`): record the squared norm of a complete host gradient (final norm,
    /// untied head) before any layer is updated.
    Measure { what: ParamBuf },
    /// Host: add a slab into the host gradients.
    AccumulateGrads { slab: usize, what: GradTarget },
    /// D2H: the residual gradient of micro-batch `m` (the embedding output's gradient).
    DownloadDres { m: usize },
    /// Host: scatter-add it into the embedding rows micro-batch `m` touched.
    EmbedScatter { m: usize },
    /// Host: the global gradient norm, and whether the step is finite (loss and norm). In
    /// `lean`/`compact` it sums the squared norms recorded so far and the embedding's.
    GradNorm,
    /// Host: clip (by the step's norm) and AdamW-update one buffer from its host gradient
    /// (unless the step is skipped for a non-finite loss or norm), then zero the gradient for
    /// the next step.
    Update { what: ParamBuf },
    /// Host: [`OpKind::Update`] of the embedding in two parts of rows, so that the next step's
    /// gather waits only for the rows it reads: `next` the rows the next step gathers (every
    /// row when the caller did not name them, or with 8-bit moments), then, once the layers
    /// the next forward needs first are updated, every other row.
    EmbedUpdate { next: bool },
    /// Compute, evaluation: final norm, LM head and cross-entropy of micro-batch `m`, forward
    /// only (per chunk of rows: logits, then each row's loss).
    HeadLoss { slot: usize, m: usize, src: usize },
    /// Compute, evaluation with a tiled head: micro-batch `m`'s losses from the statistics its
    /// [`OpKind::HeadStats`] over every tile left.
    TileLosses { m: usize },
}

/// An operation, its queue, what it touches, and the operations it waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    pub kind: OpKind,
    pub queue: Queue,
    pub reads: Vec<Res>,
    pub writes: Vec<Res>,
    /// Earlier operations (global indices) that must have finished first.
    pub waits: Vec<usize>,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} on {:?}", self.kind, self.queue)
    }
}

/// The sizes a plan is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanShape {
    /// Decoder layers L.
    pub layers: usize,
    /// Micro-batches per step M.
    pub micro_batches: usize,
    /// Checkpoint every K layers.
    pub checkpoint_every: usize,
    /// Host gradient slabs.
    pub grad_slabs: usize,
    /// Whether the LM head is tied to the embedding.
    pub tied: bool,
    /// Vocabulary tiles the LM head is applied in: 1 = whole (it fits in a weight slot beside
    /// the final norm), else two passes over the tiles (see [`super::build::step_ops`]).
    pub head_tiles: usize,
    /// Layers whose forward keeps its internals on the device for their backward, which then
    /// recomputes nothing; spread evenly over the depth ([`keeps_internals`]). The others
    /// recompute theirs. `layers` is `engine.recompute: never`, 0 `always`, and `auto` keeps
    /// as many as the device budget holds. Non-zero needs `checkpoint_every == 1`.
    pub kept_layers: usize,
    /// Streamed updates (`optimizer.memory` lean or compact): no whole-model gradient exists;
    /// each layer is updated from its slab as soon as its gradient is complete, except the last
    /// `grad_slabs` layers of the backward, whose slabs are not needed again in the step and
    /// wait for the step's norm.
    pub streamed: bool,
    /// Staged weight uploads (`WeightPath::Staged`): a host-queue op rounds each upload's
    /// trained weights into the page-locked stage of its slot ahead of the link, and the
    /// upload copies the stage (see `build::stage_uploads`).
    pub staged: bool,
    /// Layers whose experts stream through the two expert slots in `expert_chunks` chunks
    /// (their own slot holds their trunk; they never keep their internals).
    pub chunked: LayerSet,
    /// Chunks of each chunked layer's experts.
    pub expert_chunks: usize,
    /// Whether the chunks are trained (full fine-tuning, expert adapters; exact mode only):
    /// each chunk's backward then has a gradient accumulator of its own (`Dw(2)`, `Dw(3)`),
    /// added into the host gradient as it comes back.
    pub chunks_trained: bool,
}

/// A set of layer indices (up to [`LayerSet::CAPACITY`]), copyable as the plan's shape is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerSet([u64; 4]);

impl LayerSet {
    /// The deepest model it holds layers of.
    pub const CAPACITY: usize = 256;

    pub fn insert(&mut self, i: usize) {
        assert!(i < Self::CAPACITY, "layer {i}: chunked experts hold at most 256 layers");
        self.0[i / 64] |= 1 << (i % 64);
    }

    pub fn contains(&self, i: usize) -> bool {
        i < Self::CAPACITY && self.0[i / 64] & (1 << (i % 64)) != 0
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }
}

/// Whether layer `i` of `layers` is one of the `kept` layers that keep their internals: the
/// kept layers are spread evenly over the depth (layer `i` keeps when `(i + 1) kept / layers`
/// steps up at it), so the backward alternates layers that recompute (compute-heavier) with
/// layers that do not (whose compute may not cover their uploads).
pub fn keeps_internals(layers: usize, kept: usize, i: usize) -> bool {
    debug_assert!(kept <= layers && i < layers);
    (i + 1) * kept / layers > i * kept / layers
}

impl PlanShape {
    /// Whether layer `i` keeps its internals ([`keeps_internals`]).
    pub fn keeps(&self, i: usize) -> bool {
        keeps_internals(self.layers, self.kept_layers, i) && !self.chunked.contains(i)
    }

    /// Residual-stream buffer sets per micro-batch: the forward ping-pongs between two, the
    /// block recompute keeps the inputs of a block's K layers.
    pub fn act_sets(&self) -> usize {
        self.checkpoint_every.max(2)
    }
    /// Number of checkpoint blocks.
    pub fn blocks(&self) -> usize {
        self.layers.div_ceil(self.checkpoint_every)
    }
    /// The buffer the LM head's parameters live in.
    pub fn head_buf(&self) -> ParamBuf {
        if self.tied { ParamBuf::Embed } else { ParamBuf::Head }
    }
    /// Every host parameter buffer, in the optimizer's (and the gradient norm's) order.
    pub fn param_bufs(&self) -> Vec<ParamBuf> {
        let mut v = vec![ParamBuf::Embed];
        v.extend((0..self.layers).map(ParamBuf::Layer));
        v.push(ParamBuf::FinalNorm);
        if !self.tied {
            v.push(ParamBuf::Head);
        }
        v
    }
}
