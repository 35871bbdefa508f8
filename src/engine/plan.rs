//! The step as data: the list of operations of one optimizer step (uploads, forward, checkpoint
//! saves, recompute, backward, gradient downloads and accumulation, optimizer updates), each
//! on a queue, with the resources it reads and writes and the earlier operations it waits for.
//!
//! Waits are derived from the resource accesses ([`Scheduler`]), and checked independently by
//! [`check`], which rejects any plan in which two conflicting accesses on different queues are
//! not ordered by a chain of waits (read-after-write, write-after-read, write-after-write).

use std::collections::HashMap;
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
    /// Host (`lean`/`compact`): clip (by an estimate of the step's norm, see ARCHITECTURE.md)
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
    /// the final norm), else two passes over the tiles (see [`step_ops`]).
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
    /// upload copies the stage (see [`stage_uploads`]).
    pub staged: bool,
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
        keeps_internals(self.layers, self.kept_layers, i)
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

/// Builds the operations of one step, in submission order, without waits.
struct Builder {
    shape: PlanShape,
    ops: Vec<Op>,
    slots: [Option<SlotContent>; 2],
    /// Index of the last op that used each slot (for choosing the slot to overwrite).
    slot_used: [usize; 2],
    next_dw: usize,
    next_slab: usize,
    /// Streamed: (slab, layer) of the layers whose gradients wait in their slabs for the norm.
    held: Vec<(usize, usize)>,
}

impl Builder {
    fn push(&mut self, kind: OpKind, queue: Queue, reads: Vec<Res>, writes: Vec<Res>) {
        self.ops.push(Op { kind, queue, reads, writes, waits: Vec::new() });
    }

    /// The slot holding `what`, uploading it into the least recently used slot if needed.
    fn ensure(&mut self, what: SlotContent) -> usize {
        if let Some(s) = self.slots.iter().position(|c| *c == Some(what)) {
            self.slot_used[s] = self.ops.len();
            return s;
        }
        let s = if self.slots[0].is_none() {
            0
        } else if self.slots[1].is_none() {
            1
        } else if self.slot_used[0] <= self.slot_used[1] {
            0
        } else {
            1
        };
        let reads = match what {
            SlotContent::Layer(i) => vec![Res::Params(ParamBuf::Layer(i))],
            SlotContent::Head | SlotContent::HeadTile(_) => {
                vec![Res::Params(ParamBuf::FinalNorm), Res::Params(self.shape.head_buf())]
            }
        };
        self.push(OpKind::UploadWeights { slot: s, what }, Queue::H2D, reads, vec![Res::Slot(s)]);
        self.slots[s] = Some(what);
        self.slot_used[s] = self.ops.len();
        s
    }

    fn take_dw(&mut self) -> usize {
        let d = self.next_dw;
        self.next_dw = (self.next_dw + 1) % 2;
        d
    }

    fn take_slab(&mut self) -> usize {
        let s = self.next_slab;
        self.next_slab = (self.next_slab + 1) % self.shape.grad_slabs;
        s
    }

    /// Download a gradient accumulator and add it into the host gradients.
    fn return_grads(&mut self, dw: usize, what: GradTarget) {
        let slab = self.take_slab();
        self.push(
            OpKind::DownloadDw { dw, slab, what },
            Queue::D2H,
            vec![Res::Dw(dw)],
            vec![Res::Slab(slab)],
        );
        let GradTarget::Layer(i) = what else { unreachable!("the head's gradient has no slab") };
        if self.shape.streamed {
            // Measuring the slab also checks the step's losses (the first measure does).
            let mut reads = vec![Res::Slab(slab)];
            reads.extend((0..self.shape.micro_batches).map(Res::LossHost));
            if i < self.shape.grad_slabs {
                // Layers i-1..0 come back in other slabs: this one can wait for the step's norm.
                self.push(
                    OpKind::MeasureSlab { slab, layer: i },
                    Queue::Host,
                    reads,
                    vec![Res::StepStats],
                );
                self.held.push((slab, i));
            } else {
                self.push(
                    OpKind::SlabUpdate { slab, layer: i },
                    Queue::Host,
                    reads,
                    vec![
                        Res::Params(ParamBuf::Layer(i)),
                        Res::Moments(ParamBuf::Layer(i)),
                        Res::StepStats,
                    ],
                );
            }
        } else {
            self.push(
                OpKind::AccumulateGrads { slab, what },
                Queue::Host,
                vec![Res::Slab(slab)],
                vec![Res::Grads(ParamBuf::Layer(i))],
            );
            // Complete for the step: its squared norm now, under the backward, so that the
            // step's norm is a sum of recorded numbers and not a pass over every gradient.
            self.measure(ParamBuf::Layer(i));
        }
    }

    /// The tests' fault injection into buffer `p`'s host gradient (see [`OpKind::PoisonGrad`]).
    fn poison(&mut self, p: ParamBuf) {
        self.push(OpKind::PoisonGrad { what: p }, Queue::Host, vec![], vec![Res::Grads(p)]);
    }

    /// Record the squared norm of buffer `p`'s complete host gradient (and check the step's
    /// losses): in streamed modes before any layer is updated; in exact mode as each gradient
    /// completes, the step's norm then summing them.
    fn measure(&mut self, p: ParamBuf) {
        let mut reads = vec![Res::Grads(p)];
        reads.extend((0..self.shape.micro_batches).map(Res::LossHost));
        self.push(OpKind::Measure { what: p }, Queue::Host, reads, vec![Res::StepStats]);
    }

    /// One part of the embedding's update ([`OpKind::EmbedUpdate`]): the first also writes the
    /// rows the next step's gather reads.
    fn update_embed(&mut self, next: bool) {
        let p = ParamBuf::Embed;
        let mut writes = vec![Res::Params(p), Res::Grads(p), Res::Moments(p)];
        if next {
            writes.push(Res::EmbedNext);
        }
        self.push(OpKind::EmbedUpdate { next }, Queue::Host, vec![Res::Norm], writes);
    }

    /// Clip by the step's norm and update buffer `p` from its host gradient.
    fn update(&mut self, p: ParamBuf) {
        self.push(
            OpKind::Update { what: p },
            Queue::Host,
            vec![Res::Norm],
            vec![Res::Params(p), Res::Grads(p), Res::Moments(p)],
        );
    }

    /// Download micro-batch `m`'s losses.
    fn download_losses(&mut self, m: usize) {
        self.push(
            OpKind::DownloadLosses { m },
            Queue::D2H,
            vec![Res::Losses(m)],
            vec![Res::LossHost(m)],
        );
    }

    /// The head in one slot: final norm + LM head + cross-entropy, forward and backward, per
    /// micro-batch, then the gradients straight into their host buffers.
    fn whole_head(&mut self) {
        let slot = self.ensure(SlotContent::Head);
        let dw = self.take_dw();
        self.push(OpKind::ZeroDw { dw }, Queue::Compute, vec![], vec![Res::Dw(dw)]);
        let src = self.shape.layers % 2;
        for m in 0..self.shape.micro_batches {
            self.push(
                OpKind::Head { slot, m, src, dw },
                Queue::Compute,
                vec![Res::Slot(slot), Res::Act { set: src, m }, Res::Ids(m)],
                vec![Res::Dw(dw), Res::Dres(m), Res::Losses(m), Res::Scratch],
            );
            self.download_losses(m);
        }
        // The head's gradient goes straight into its host gradient buffers: no slab the size
        // of the LM head is needed.
        self.push(
            OpKind::DownloadHeadGrads { dw },
            Queue::D2H,
            vec![Res::Dw(dw)],
            vec![Res::Grads(ParamBuf::FinalNorm), Res::Grads(self.shape.head_buf())],
        );
    }

    /// The head in vocabulary tiles, each uploaded into a weight slot beside the final norm
    /// (the two slots double-buffer the tiles as they do layers). Pass 1, tiles in order:
    /// every micro-batch's softmax statistics (tile 0 also runs the final norm). Pass 2, tiles
    /// in reverse order (the last two tiles of pass 1 are still resident): the logits again,
    /// dlogits, `dhf` and the tile's weight gradient in one of the two accumulators, which
    /// downloads straight into the tile's rows of the host gradient while the next tile
    /// computes. Then per micro-batch the losses and the final norm's backward (`dres`), and
    /// the final norm's gradient from its own small accumulator.
    fn tiled_head(&mut self) {
        let (tiles, mbs, src) =
            (self.shape.head_tiles, self.shape.micro_batches, self.shape.layers % 2);
        for tile in 0..tiles {
            let slot = self.ensure(SlotContent::HeadTile(tile));
            for m in 0..mbs {
                let mut reads = vec![Res::Slot(slot), Res::Ids(m)];
                if tile == 0 {
                    reads.push(Res::Act { set: src, m });
                }
                self.push(
                    OpKind::HeadStats { tile, slot, m, src },
                    Queue::Compute,
                    reads,
                    vec![Res::HeadRows(m), Res::Scratch],
                );
            }
        }
        for tile in (0..tiles).rev() {
            let slot = self.ensure(SlotContent::HeadTile(tile));
            let dw = self.take_dw();
            self.push(OpKind::ZeroDw { dw }, Queue::Compute, vec![], vec![Res::Dw(dw)]);
            for m in 0..mbs {
                self.push(
                    OpKind::HeadGrad { tile, slot, m, dw, first: tile == tiles - 1 },
                    Queue::Compute,
                    vec![Res::Slot(slot), Res::Ids(m)],
                    vec![Res::HeadRows(m), Res::Dw(dw), Res::Scratch],
                );
            }
            self.push(
                OpKind::DownloadHeadTileGrads { dw, tile },
                Queue::D2H,
                vec![Res::Dw(dw)],
                vec![Res::Grads(self.shape.head_buf())],
            );
        }
        // Tile 0 is the last of pass 2: its slot holds the final norm's weight.
        let slot = self.ensure(SlotContent::HeadTile(0));
        self.push(OpKind::ZeroDnorm, Queue::Compute, vec![], vec![Res::DnormW]);
        for m in 0..mbs {
            self.push(
                OpKind::HeadFinish { slot, m, src },
                Queue::Compute,
                vec![Res::Slot(slot), Res::Act { set: src, m }, Res::Ids(m), Res::HeadRows(m)],
                vec![Res::Losses(m), Res::Dres(m), Res::DnormW],
            );
            self.download_losses(m);
        }
        self.push(
            OpKind::DownloadNormGrads,
            Queue::D2H,
            vec![Res::DnormW],
            vec![Res::Grads(ParamBuf::FinalNorm)],
        );
    }
}

/// The operations of one optimizer step, in submission order, without waits.
pub fn step_ops(shape: PlanShape) -> Vec<Op> {
    let ops = unstaged_ops(shape);
    if shape.staged { stage_uploads(ops) } else { ops }
}

/// Staged uploads: each weight upload copies the page-locked stage of its slot, which a
/// host-queue `StageWeights` op has rounded from the masters, placed in submission order as
/// early as it can run: after the slot's previous upload (the stage's last reader) and after
/// the last write of the weights it rounds. The first upload into a slot in a step is staged
/// by the step before (at the end of its ops, after the optimizer's write of those weights),
/// so a step begins with both stages filled; the engine fills them itself before its first
/// step. The rounding thus runs on the host queue while the link carries the previous upload,
/// and never inside an upload.
fn stage_uploads(ops: Vec<Op>) -> Vec<Op> {
    let uploads: Vec<(usize, usize, SlotContent)> = ops
        .iter()
        .enumerate()
        .filter_map(|(j, op)| match op.kind {
            OpKind::UploadWeights { slot, what } => Some((j, slot, what)),
            _ => None,
        })
        .collect();
    let last_write_before = |reads: &[Res], end: usize| {
        ops[..end].iter().rposition(|op| op.writes.iter().any(|w| reads.contains(w)))
    };
    // (op index the stage follows, the stage op), in the uploads' order.
    let mut stages: Vec<(usize, Op)> = Vec::new();
    for (u, &(j, slot, what)) in uploads.iter().enumerate() {
        let same_slot = |&&(_, s, _): &&(usize, usize, SlotContent)| s == slot;
        let prev = uploads[..u].iter().rfind(same_slot);
        // No earlier upload into this slot: staged by the previous step, after its last one.
        let (after, end) = match prev {
            Some(&(p, ..)) => (p, j),
            None => (uploads.iter().rfind(same_slot).expect("this upload").0, ops.len()),
        };
        let reads = ops[j].reads.clone();
        let after = last_write_before(&reads, end).map_or(after, |w| w.max(after));
        let kind = OpKind::StageWeights { slot, what };
        stages.push((
            after,
            Op {
                kind,
                queue: Queue::Host,
                reads,
                writes: vec![Res::WeightStage(slot)],
                waits: vec![],
            },
        ));
    }
    let mut out = Vec::with_capacity(ops.len() + stages.len());
    for (i, mut op) in ops.into_iter().enumerate() {
        if let OpKind::UploadWeights { slot, .. } = op.kind {
            op.reads = vec![Res::WeightStage(slot)];
        }
        out.push(op);
        // Stable: stages following the same op keep the uploads' order.
        out.extend(stages.iter().filter(|(a, _)| *a == i).map(|(_, s)| s.clone()));
    }
    out
}

/// [`step_ops`] without staged uploads.
fn unstaged_ops(shape: PlanShape) -> Vec<Op> {
    assert!(shape.layers > 0 && shape.micro_batches > 0 && shape.checkpoint_every > 0);
    assert!(shape.grad_slabs > 0 && shape.head_tiles > 0);
    assert!(shape.kept_layers == 0 || shape.checkpoint_every == 1, "kept internals need K = 1");
    assert!(shape.kept_layers <= shape.layers, "more kept layers than layers");
    // Where a layer forward leaves its internals, and where its backward finds them.
    let internals = |layer: usize, m: usize| {
        if shape.keeps(layer) { Res::Stash { layer, m } } else { Res::Scratch }
    };
    let (l_count, mbs, k) = (shape.layers, shape.micro_batches, shape.checkpoint_every);
    let mut b = Builder {
        shape,
        ops: Vec::new(),
        slots: [None, None],
        slot_used: [0, 0],
        next_dw: 0,
        next_slab: 0,
        held: Vec::new(),
    };
    let embed = Res::EmbedNext;

    // Inputs: token ids, and the embedding rows, gathered by the host-to-device queue itself
    // (as a host function on that queue), so that the next step's forward waits only for the
    // update of those rows, not for the whole optimizer on the host queue.
    for m in 0..mbs {
        b.push(OpKind::UploadIds { m }, Queue::H2D, vec![], vec![Res::Ids(m)]);
        b.push(OpKind::EmbedGather { m }, Queue::H2D, vec![embed], vec![Res::EmbStage(m)]);
        b.push(
            OpKind::UploadAct { m, set: 0, from: ActSource::Embedding },
            Queue::H2D,
            vec![Res::EmbStage(m)],
            vec![Res::Act { set: 0, m }],
        );
    }

    // Forward, layer-major: every micro-batch passes layer i while its weights are resident.
    for i in 0..l_count {
        let slot = b.ensure(SlotContent::Layer(i));
        let (src, dst) = (i % 2, (i + 1) % 2);
        for m in 0..mbs {
            if i % k == 0 {
                b.push(
                    OpKind::SaveCkpt { block: i / k, m, set: src },
                    Queue::D2H,
                    vec![Res::Act { set: src, m }],
                    vec![Res::Ckpt { block: i / k, m }],
                );
            }
            // The scratch also holds the dequantisation workspace of a quantised base.
            let mut writes = vec![Res::Act { set: dst, m }, internals(i, m)];
            if shape.keeps(i) {
                writes.push(Res::Scratch);
            }
            b.push(
                OpKind::Forward { layer: i, slot, m, src, dst, recompute: false },
                Queue::Compute,
                vec![Res::Slot(slot), Res::Act { set: src, m }],
                writes,
            );
        }
    }

    // Final norm + LM head + cross-entropy, forward and backward, per micro-batch.
    if shape.head_tiles == 1 {
        b.whole_head();
    } else {
        b.tiled_head();
    }
    // Complete for the step: every micro-batch has passed the head. The gradients stay in
    // their host buffers until the norm is known; in streamed modes the layer updates estimate
    // the norm from these squared norms onwards.
    if shape.streamed {
        b.poison(ParamBuf::FinalNorm);
    }
    b.measure(ParamBuf::FinalNorm);
    if !shape.tied {
        b.measure(ParamBuf::Head);
    }

    // Backward, block by block from the last: restore the block's checkpoint, recompute the
    // inputs of its layers, then walk its layers backwards, recomputing each layer's internals.
    for block in (0..shape.blocks()).rev() {
        let first = block * k;
        let last = (first + k).min(l_count) - 1;
        // The block's first weights go ahead of its checkpoint on the copy queue: the checkpoint
        // must wait until an earlier backward is done with the buffer it lands in, the weights
        // only until their slot is free, which is earlier.
        b.ensure(SlotContent::Layer(if first < last { first } else { last }));
        // With K = 1 the blocks alternate between the two sets the forward ping-pongs
        // between, so a block's checkpoint lands while the block above it runs its backward
        // from the other set, instead of after it.
        let base = if k == 1 { block % 2 } else { 0 };
        for m in 0..mbs {
            b.push(
                OpKind::UploadAct { m, set: base, from: ActSource::Ckpt(block) },
                Queue::H2D,
                vec![Res::Ckpt { block, m }],
                vec![Res::Act { set: base, m }],
            );
        }
        for i in first..last {
            let slot = b.ensure(SlotContent::Layer(i));
            for m in 0..mbs {
                let (src, dst) = (i - first, i - first + 1);
                b.push(
                    OpKind::Forward { layer: i, slot, m, src, dst, recompute: true },
                    Queue::Compute,
                    vec![Res::Slot(slot), Res::Act { set: src, m }],
                    vec![Res::Act { set: dst, m }, Res::Scratch],
                );
            }
        }
        for i in (first..=last).rev() {
            let slot = b.ensure(SlotContent::Layer(i));
            let dw = b.take_dw();
            b.push(OpKind::ZeroDw { dw }, Queue::Compute, vec![], vec![Res::Dw(dw)]);
            for m in 0..mbs {
                let set = base + i - first;
                let mut reads = vec![Res::Slot(slot), Res::Act { set, m }];
                if shape.keeps(i) {
                    reads.push(internals(i, m));
                }
                b.push(
                    OpKind::Backward { layer: i, slot, m, set, dw },
                    Queue::Compute,
                    reads,
                    vec![Res::Dw(dw), Res::Dres(m), Res::Scratch],
                );
            }
            b.return_grads(dw, GradTarget::Layer(i));
        }
    }

    // Embedding gradient: only the rows the batch touched.
    for m in 0..mbs {
        b.push(OpKind::DownloadDres { m }, Queue::D2H, vec![Res::Dres(m)], vec![Res::DxStage(m)]);
        b.push(
            OpKind::EmbedScatter { m },
            Queue::Host,
            vec![],
            // It scales the staged rows in place (Gemma's embedding scale) before scattering.
            vec![Res::DxStage(m), Res::Grads(ParamBuf::Embed)],
        );
    }

    if shape.streamed {
        // The embedding's gradient is complete once every micro-batch's rows are scattered
        // (with a tied head, the head's part came first). Then the step's norm, from the
        // squared norms recorded so far and the embedding's. On the run's first step it also
        // corrects the moments of the layers updated before the norm was known.
        let mut reads = vec![Res::StepStats, Res::Grads(ParamBuf::Embed)];
        reads.extend((0..mbs).map(Res::LossHost));
        let mut writes = vec![Res::Norm, Res::StepStats];
        writes.extend((shape.grad_slabs..l_count).map(|i| Res::Moments(ParamBuf::Layer(i))));
        b.push(OpKind::GradNorm, Queue::Host, reads, writes);
        // Everything left waits for the norm; in the order the next step needs it.
        b.update_embed(true);
        for (slab, layer) in std::mem::take(&mut b.held).into_iter().rev() {
            b.push(
                OpKind::HeldSlabUpdate { slab, layer },
                Queue::Host,
                vec![Res::Slab(slab), Res::Norm],
                vec![Res::Params(ParamBuf::Layer(layer)), Res::Moments(ParamBuf::Layer(layer))],
            );
        }
        b.update(ParamBuf::FinalNorm);
        if !shape.tied {
            b.update(ParamBuf::Head);
        }
        b.update_embed(false);
        return b.ops;
    }

    // Optimizer: exact global norm (the sum of the squared norms measured as each gradient
    // completed; the embedding's last), then each buffer's update in the order the next step
    // needs them, so the next forward of layer i waits only for layer i's update.
    // The norm op also checks the losses: a non-finite loss or norm skips every update.
    b.poison(ParamBuf::Embed);
    b.measure(ParamBuf::Embed);
    let mut reads = vec![Res::StepStats];
    reads.extend((0..mbs).map(Res::LossHost));
    b.push(OpKind::GradNorm, Queue::Host, reads, vec![Res::Norm, Res::StepStats]);
    for p in shape.param_bufs() {
        if p == ParamBuf::Embed { b.update_embed(true) } else { b.update(p) }
    }
    b.update_embed(false);
    b.ops
}

/// Vector clock: for each queue, how many of its operations happen before (inclusive).
type Vc = [u64; 4];

#[derive(Clone, Copy, Debug)]
struct Access {
    op: usize,
    queue: Queue,
    /// 1-based position of the op on its queue.
    seq: u64,
    vc: Vc,
}

impl Access {
    fn happens_before(&self, vc: &Vc) -> bool {
        vc[self.queue.index()] >= self.seq
    }
}

#[derive(Clone, Debug, Default)]
struct ResState {
    write: Option<Access>,
    /// Latest read on each queue since the last write.
    reads: [Option<Access>; 4],
}

/// Tracks, across the steps of a run, who last touched each resource and what is ordered
/// before what. Feeding it operations in submission order gives each one the waits it needs.
#[derive(Clone, Debug, Default)]
pub struct Scheduler {
    queue_vc: [Vc; 4],
    queue_seq: [u64; 4],
    res: HashMap<Res, ResState>,
    next_op: usize,
}

fn merge(a: &mut Vc, b: &Vc) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = (*x).max(*y);
    }
}

impl Scheduler {
    pub fn new() -> Self {
        Self::default()
    }

    /// The global index the next scheduled op will get.
    pub fn next_op(&self) -> usize {
        self.next_op
    }

    /// The accesses of `op` that conflict with earlier ones, latest first.
    fn conflicts(&self, op: &Op) -> Vec<Access> {
        let mut out = Vec::new();
        for r in op.reads.iter().chain(&op.writes) {
            if let Some(st) = self.res.get(r) {
                out.extend(st.write);
                if op.writes.contains(r) {
                    out.extend(st.reads.iter().flatten().copied());
                }
            }
        }
        out.sort_by_key(|a| std::cmp::Reverse(a.op));
        out
    }

    fn commit(&mut self, op: &Op, vc: Vc, seq: u64) {
        let q = op.queue.index();
        let me = Access { op: self.next_op, queue: op.queue, seq, vc };
        for r in &op.reads {
            if !op.writes.contains(r) {
                self.res.entry(*r).or_default().reads[q] = Some(me);
            }
        }
        for r in &op.writes {
            let st = self.res.entry(*r).or_default();
            st.write = Some(me);
            st.reads = [None; 4];
        }
        self.queue_vc[q] = vc;
        self.queue_seq[q] = seq;
        self.next_op += 1;
    }

    /// Give `op` the waits that order it after every conflicting earlier access (on other
    /// queues; a queue is ordered in itself), and record its accesses.
    pub fn schedule(&mut self, op: &mut Op) {
        let q = op.queue.index();
        let seq = self.queue_seq[q] + 1;
        let mut vc = self.queue_vc[q];
        vc[q] = seq;
        op.waits.clear();
        for a in self.conflicts(op) {
            if !a.happens_before(&vc) {
                op.waits.push(a.op);
                merge(&mut vc, &a.vc);
            }
        }
        op.waits.sort_unstable();
        self.commit(op, vc, seq);
    }
}

/// A hazard the checker found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hazard {
    pub earlier: usize,
    pub later: usize,
    pub res: Res,
    pub what: &'static str,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} hazard on {:?}: op {} is not ordered after op {} (missing wait)",
            self.what, self.res, self.later, self.earlier
        )
    }
}

/// Check a sequence of operations (global indices `base..base + ops.len()`, in submission
/// order) for hazards: every pair of accesses to one resource, at least one a write, on
/// different queues, must be ordered by a chain of waits. Waits must name earlier ops.
pub fn check(ops: &[Op], base: usize) -> Result<(), Hazard> {
    let mut queue_vc = [[0u64; 4]; 4];
    let mut queue_seq = [0u64; 4];
    let mut vcs: Vec<Vc> = Vec::with_capacity(ops.len());
    let mut seqs: Vec<u64> = Vec::with_capacity(ops.len());
    let mut last_write: HashMap<Res, usize> = HashMap::new();
    let mut reads_since: HashMap<Res, Vec<usize>> = HashMap::new();
    for (j, op) in ops.iter().enumerate() {
        let q = op.queue.index();
        let seq = queue_seq[q] + 1;
        let mut vc = queue_vc[q];
        vc[q] = seq;
        for &w in &op.waits {
            if w < base || w >= base + j {
                return Err(Hazard {
                    earlier: w,
                    later: base + j,
                    res: Res::Norm,
                    what: "invalid wait",
                });
            }
            merge(&mut vc, &vcs[w - base]);
        }
        let ordered = |i: usize, vc: &Vc| vc[ops[i].queue.index()] >= seqs[i];
        for r in op.reads.iter().chain(&op.writes) {
            if let Some(&w) = last_write.get(r)
                && !ordered(w, &vc)
            {
                let what =
                    if op.writes.contains(r) { "write-after-write" } else { "read-after-write" };
                return Err(Hazard { earlier: base + w, later: base + j, res: *r, what });
            }
            if op.writes.contains(r) {
                for &rd in reads_since.get(r).map(Vec::as_slice).unwrap_or(&[]) {
                    if !ordered(rd, &vc) {
                        return Err(Hazard {
                            earlier: base + rd,
                            later: base + j,
                            res: *r,
                            what: "write-after-read",
                        });
                    }
                }
            }
        }
        for r in &op.reads {
            if !op.writes.contains(r) {
                reads_since.entry(*r).or_default().push(j);
            }
        }
        for r in &op.writes {
            last_write.insert(*r, j);
            reads_since.remove(r);
        }
        queue_vc[q] = vc;
        queue_seq[q] = seq;
        vcs.push(vc);
        seqs.push(seq);
    }
    Ok(())
}

/// The plans a run executes: the first step's (from an idle device), then the steady state
/// every later step repeats. Waits in `steady` that point before its own first op name ops
/// of the previous step (`index - ops.len()` in the previous step's numbering).
#[derive(Clone, Debug)]
pub struct Schedule {
    pub shape: PlanShape,
    pub first: Vec<Op>,
    pub steady: Vec<Op>,
}

/// A wait of an op of step k: on an op of the same step, or of step k-1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    This(usize),
    Prev(usize),
}

impl Schedule {
    /// Build and schedule three consecutive steps; the third must repeat the second.
    pub fn new(shape: PlanShape) -> Self {
        let ops = step_ops(shape);
        let n = ops.len();
        let mut sched = Scheduler::new();
        let mut steps: Vec<Vec<Op>> = Vec::new();
        for _ in 0..3 {
            let mut step = ops.clone();
            for op in &mut step {
                sched.schedule(op);
            }
            steps.push(step);
        }
        let rebase = |step: &[Op], base: usize| -> Vec<Op> {
            step.iter()
                .map(|op| Op {
                    waits: op.waits.iter().map(|w| w + n - base).collect(),
                    ..op.clone()
                })
                .collect()
        };
        let steady = rebase(&steps[1], n);
        assert_eq!(steady, rebase(&steps[2], 2 * n), "the schedule must reach a steady state");
        Schedule { shape, first: steps.swap_remove(0), steady }
    }

    /// Ops per step.
    pub fn len(&self) -> usize {
        self.first.len()
    }

    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// The ops of step `k` (0-based).
    pub fn ops(&self, k: u64) -> &[Op] {
        if k == 0 { &self.first } else { &self.steady }
    }

    /// Waits of op `j` of step `k`, split into this step's and the previous step's.
    pub fn waits(&self, k: u64, j: usize) -> impl Iterator<Item = Wait> + '_ {
        // The first step's waits are its own op indices; the steady state's are shifted by
        // one step (see `new`).
        let (n, first) = (self.len(), k == 0);
        self.ops(k)[j].waits.iter().map(move |&w| {
            if first {
                Wait::This(w)
            } else if w >= n {
                Wait::This(w - n)
            } else {
                Wait::Prev(w)
            }
        })
    }

    /// The ops of `steps` consecutive steps with global wait indices, for the checker.
    pub fn unrolled(&self, steps: usize) -> Vec<Op> {
        let n = self.len();
        let mut out = self.first.clone();
        for s in 1..steps {
            out.extend(self.steady.iter().map(|op| Op {
                waits: op.waits.iter().map(|w| w + (s - 1) * n).collect(),
                ..op.clone()
            }));
        }
        out
    }

    /// Weight uploads per layer per step (steady state).
    pub fn uploads_per_layer(&self) -> Vec<usize> {
        let mut c = vec![0; self.shape.layers];
        for op in &self.steady {
            if let OpKind::UploadWeights { what: SlotContent::Layer(i), .. } = op.kind {
                c[i] += 1;
            }
        }
        c
    }

    /// A text timeline of one steady step: each op with its queue and waits.
    pub fn timeline(&self) -> String {
        let n = self.len();
        let mut s = String::new();
        for (j, op) in self.steady.iter().enumerate() {
            let waits: Vec<String> = op
                .waits
                .iter()
                .map(|&w| if w >= n { format!("{}", w - n) } else { format!("prev.{w}") })
                .collect();
            let q = format!("{:?}", op.queue);
            s.push_str(&format!("{j:>4} {q:<8} {:?}", op.kind));
            if !waits.is_empty() {
                s.push_str(&format!("  waits [{}]", waits.join(", ")));
            }
            s.push('\n');
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(layers: usize, mbs: usize, k: usize) -> PlanShape {
        PlanShape {
            layers,
            micro_batches: mbs,
            checkpoint_every: k,
            grad_slabs: 2,
            tied: false,
            head_tiles: 1,
            kept_layers: 0,
            streamed: false,
            staged: false,
        }
    }

    #[test]
    fn generated_plans_are_hazard_free() {
        for layers in [1, 2, 3, 4, 7] {
            for mbs in [1, 2, 3] {
                for k in [1, 2, 3, 4] {
                    for tied in [false, true] {
                        for (streamed, staged) in
                            [(false, false), (true, false), (false, true), (true, true)]
                        {
                            let s = Schedule::new(PlanShape {
                                tied,
                                streamed,
                                staged,
                                ..shape(layers, mbs, k)
                            });
                            check(&s.unrolled(3), 0).unwrap_or_else(|h| {
                                panic!("L{layers} M{mbs} K{k} tied {tied} streamed {streamed} staged {staged}: {h}")
                            });
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn kept_internals_are_hazard_free_and_recompute_nothing() {
        for layers in [1, 3, 4] {
            for mbs in [1, 2] {
                let s = Schedule::new(PlanShape { kept_layers: layers, ..shape(layers, mbs, 1) });
                check(&s.unrolled(3), 0).unwrap_or_else(|h| panic!("L{layers} M{mbs}: {h}"));
                let ops = s.ops(2);
                let head = ops.iter().position(|o| matches!(o.kind, OpKind::Head { .. }));
                let after = &ops[head.unwrap()..];
                assert!(!after.iter().any(|o| matches!(o.kind, OpKind::Forward { .. })));
                let kept = |o: &Op| o.reads.iter().any(|r| matches!(r, Res::Stash { .. }));
                let backwards = after.iter().filter(|o| kept(o)).count();
                assert_eq!(backwards, layers * mbs, "every backward reads kept internals");
            }
        }
    }

    /// Some layers keep their internals, the others recompute: the plans are hazard-free, and
    /// exactly the kept layers' backwards read kept internals, the kept layers spread evenly.
    #[test]
    fn partly_kept_internals_are_hazard_free_and_read_where_kept() {
        for layers in [1, 2, 3, 5, 7] {
            for kept in 0..=layers {
                let which: Vec<usize> =
                    (0..layers).filter(|&i| keeps_internals(layers, kept, i)).collect();
                assert_eq!(which.len(), kept, "L{layers} kept {kept}: {which:?}");
                // Evenly: between two kept layers (and before the first) at most
                // ceil(L / kept) layers.
                if kept > 0 {
                    let most = layers.div_ceil(kept);
                    let gaps = which.iter().scan(None, |prev: &mut Option<usize>, &i| {
                        let gap = prev.map_or(i + 1, |p| i - p);
                        *prev = Some(i);
                        Some(gap)
                    });
                    assert!(gaps.into_iter().all(|g| g <= most), "L{layers} {which:?}");
                }
                for (mbs, streamed, staged) in
                    [(1, false, false), (2, true, false), (2, false, true)]
                {
                    let shape =
                        PlanShape { kept_layers: kept, streamed, staged, ..shape(layers, mbs, 1) };
                    let s = Schedule::new(shape);
                    check(&s.unrolled(3), 0).unwrap_or_else(|h| {
                        panic!("L{layers} kept {kept} M{mbs} streamed {streamed}: {h}")
                    });
                    for op in s.ops(2) {
                        if let OpKind::Backward { layer, .. } = op.kind {
                            let reads = op.reads.iter().any(|r| matches!(r, Res::Stash { .. }));
                            assert_eq!(reads, shape.keeps(layer), "L{layers} kept {kept}: {op}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_wait_is_needed() {
        // Removing any single wait from an unrolled two-step plan must be caught: the
        // derivation adds a wait only where the ops are not yet ordered.
        for streamed in [false, true] {
            for staged in [false, true] {
                let s = Schedule::new(PlanShape { streamed, staged, ..shape(4, 2, 2) });
                every_wait_is_needed_in(s);
            }
        }
    }

    /// Staged uploads: every upload copies its slot's stage, which one `StageWeights` of the
    /// same weights, on the host queue, filled after the slot's previous upload; the first
    /// uploads of a step are staged by the step before, after the optimizer wrote them.
    #[test]
    fn staged_uploads_copy_a_stage_filled_ahead() {
        for (streamed, tiles, keep) in [(false, 1, false), (true, 1, false), (false, 3, true)] {
            let k = if keep { 1 } else { 2 };
            let shape = PlanShape {
                streamed,
                staged: true,
                head_tiles: tiles,
                kept_layers: if keep { 4 } else { 0 },
                ..shape(4, 2, k)
            };
            let s = Schedule::new(shape);
            let ops = s.unrolled(3);
            let n = s.len();
            let kinds = |f: fn(&OpKind) -> bool| ops[n..].iter().filter(|o| f(&o.kind)).count();
            let stages = kinds(|k| matches!(k, OpKind::StageWeights { .. }));
            assert_eq!(stages, kinds(|k| matches!(k, OpKind::UploadWeights { .. })));
            for (j, op) in ops.iter().enumerate().skip(n) {
                let OpKind::UploadWeights { slot, what } = op.kind else { continue };
                assert_eq!(op.reads, vec![Res::WeightStage(slot)], "{op}");
                let stage =
                    ops[..j].iter().rposition(|o| o.writes.contains(&Res::WeightStage(slot)));
                let st = &ops[stage.expect("a stage before every upload")];
                assert_eq!(st.kind, OpKind::StageWeights { slot, what }, "{op}");
                assert_eq!(st.queue, Queue::Host);
                let uploads_between = ops[stage.unwrap()..j]
                    .iter()
                    .filter(
                        |o| matches!(o.kind, OpKind::UploadWeights { slot: s, .. } if s == slot),
                    )
                    .count();
                assert_eq!(uploads_between, 0, "the stage of {op} is not overwritten first");
            }
            // The next step's first stage (of layer 0) follows layer 0's last write.
            let first = s.steady.iter().position(|o| {
                matches!(o.kind, OpKind::StageWeights { what: SlotContent::Layer(0), .. })
            });
            let last_write =
                s.steady.iter().rposition(|o| o.writes.contains(&Res::Params(ParamBuf::Layer(0))));
            let wrap = s.steady.iter().rposition(|o| {
                matches!(o.kind, OpKind::StageWeights { what: SlotContent::Layer(0), .. })
            });
            assert!(first.is_some() && wrap.unwrap() > last_write.unwrap());
        }
    }

    #[test]
    fn streamed_updates_keep_no_layer_gradient() {
        // lean/compact: no op touches a host layer gradient. With 2 slabs, layers 3 and 2 are
        // updated from their slabs right after the slabs arrive, before the layers below them
        // are back; layers 1 and 0 (whose slabs no later layer of the step needs) and the host
        // buffers are updated after the norm.
        for tied in [false, true] {
            let s = Schedule::new(PlanShape { tied, streamed: true, ..shape(4, 2, 2) });
            for op in &s.steady {
                for r in op.reads.iter().chain(&op.writes) {
                    assert!(!matches!(r, Res::Grads(ParamBuf::Layer(_))), "{op} touches {r:?}");
                }
            }
            let pos = |f: &dyn Fn(&OpKind) -> bool| s.steady.iter().position(|op| f(&op.kind));
            let upd = |i| pos(&|k| matches!(k, OpKind::SlabUpdate { layer, .. } if *layer == i));
            let held =
                |i| pos(&|k| matches!(k, OpKind::HeldSlabUpdate { layer, .. } if *layer == i));
            let bwd0 = pos(&|k| matches!(k, OpKind::Backward { layer: 0, .. })).unwrap();
            let norm = pos(&|k| *k == OpKind::GradNorm).unwrap();
            assert!(upd(3).unwrap() < bwd0 && upd(2).unwrap() < bwd0, "streamed before layer 0");
            assert!(upd(1).is_none() && upd(0).is_none());
            assert!(held(0).unwrap() > norm && held(1).unwrap() > held(0).unwrap());
            for p in s.shape.param_bufs().into_iter().filter(|p| !matches!(p, ParamBuf::Layer(_))) {
                let kind = match p {
                    ParamBuf::Embed => OpKind::EmbedUpdate { next: true },
                    p => OpKind::Update { what: p },
                };
                assert!(pos(&|k| *k == kind).unwrap() > norm, "{p:?}");
            }
            // The embedding's other rows last, after the layers the next forward needs first.
            let rest = pos(&|k| *k == OpKind::EmbedUpdate { next: false }).unwrap();
            assert!(rest > held(1).unwrap() && rest == s.steady.len() - 1);
            // The next step's uploads wait for the updates of their own layer only.
            for (j, op) in s.steady.iter().enumerate() {
                if let OpKind::UploadWeights { what: SlotContent::Layer(i), .. } = op.kind {
                    for w in s.waits(1, j) {
                        if let Wait::Prev(p) = w {
                            assert!(
                                matches!(s.first[p].kind,
                                    OpKind::SlabUpdate { layer, .. } | OpKind::HeldSlabUpdate { layer, .. }
                                    if layer == i),
                                "{op} waits for {}",
                                s.first[p]
                            );
                        }
                    }
                }
            }
        }
    }

    fn every_wait_is_needed_in(s: Schedule) {
        let ops = s.unrolled(2);
        let mut rejected = 0;
        let mut total = 0;
        for j in 0..ops.len() {
            for w in 0..ops[j].waits.len() {
                total += 1;
                let mut broken = ops.clone();
                broken[j].waits.remove(w);
                if check(&broken, 0).is_err() {
                    rejected += 1;
                }
            }
        }
        assert!(total > 0);
        assert_eq!(rejected, total, "{} of {total} waits were redundant", total - rejected);
    }

    #[test]
    fn checker_rejects_missing_waits() {
        use Queue::*;
        let op = |queue, reads: Vec<Res>, writes: Vec<Res>, waits: Vec<usize>| Op {
            kind: OpKind::GradNorm,
            queue,
            reads,
            writes,
            waits,
        };
        // Upload into a slot, compute reads it without waiting: read-after-write.
        let raw = vec![
            op(H2D, vec![], vec![Res::Slot(0)], vec![]),
            op(Compute, vec![Res::Slot(0)], vec![], vec![]),
        ];
        assert_eq!(check(&raw, 0).unwrap_err().what, "read-after-write");
        // Compute reads the slot, the next upload overwrites it without waiting: write-after-read.
        let war = vec![
            op(H2D, vec![], vec![Res::Slot(0)], vec![]),
            op(Compute, vec![Res::Slot(0)], vec![], vec![0]),
            op(H2D, vec![], vec![Res::Slot(0)], vec![]),
        ];
        assert_eq!(check(&war, 0).unwrap_err().what, "write-after-read");
        let mut fixed = war.clone();
        fixed[2].waits.push(1);
        check(&fixed, 0).unwrap();
        // Ordering through a chain of waits across a third queue counts.
        let chain = vec![
            op(H2D, vec![], vec![Res::Slot(0)], vec![]),
            op(Host, vec![], vec![Res::Norm], vec![0]),
            op(Compute, vec![Res::Slot(0), Res::Norm], vec![], vec![1]),
        ];
        check(&chain, 0).unwrap();
        // A wait on a later op is invalid.
        let bad = vec![op(H2D, vec![], vec![], vec![1]), op(H2D, vec![], vec![], vec![])];
        assert!(check(&bad, 0).is_err());
    }

    #[test]
    fn removing_a_slot_wait_from_a_real_plan_is_caught() {
        let s = Schedule::new(shape(4, 1, 2));
        let mut ops = s.unrolled(2);
        let j = ops
            .iter()
            .position(|op| matches!(op.kind, OpKind::Forward { .. }) && !op.waits.is_empty())
            .expect("a forward that waits for its upload");
        ops[j].waits.clear();
        assert!(check(&ops, 0).is_err());
    }

    #[test]
    fn uploads_per_layer() {
        // K = 1: each layer is uploaded for the forward and once more for its recompute and
        // backward; the last layer is still resident from the forward when its backward runs.
        let s = Schedule::new(shape(4, 2, 1));
        assert_eq!(s.uploads_per_layer(), vec![2, 2, 2, 1]);
        // K = 2: a block's first layer is uploaded for the recompute and stays for its backward;
        // its last layer is uploaded for backward only.
        let s = Schedule::new(shape(4, 2, 2));
        assert_eq!(s.uploads_per_layer(), vec![2, 2, 2, 2]);
        // K = 4: the middle layers of a block are recomputed, then uploaded once more for
        // backward, except the one still resident when the backward reaches it.
        let s = Schedule::new(shape(8, 1, 4));
        assert_eq!(s.uploads_per_layer(), vec![3, 3, 2, 2, 3, 3, 2, 2]);
    }

    #[test]
    fn with_k1_a_checkpoint_lands_during_the_backward_above_it() {
        for kept in [0, 4] {
            let s = Schedule::new(PlanShape { kept_layers: kept, ..shape(4, 2, 1) });
            let ops = &s.steady;
            // Whether op `a` of the steady step is ordered before op `b`: through waits within
            // the step or the queues' order.
            let before = |a: usize, b: usize| {
                let mut stack = vec![b];
                let mut seen = vec![false; ops.len()];
                while let Some(j) = stack.pop() {
                    let prev_on_queue = (0..j).rev().find(|&i| ops[i].queue == ops[j].queue);
                    let waits = s.waits(1, j).filter_map(|w| match w {
                        Wait::This(i) => Some(i),
                        Wait::Prev(_) => None,
                    });
                    for i in waits.chain(prev_on_queue) {
                        if i == a {
                            return true;
                        }
                        if !std::mem::replace(&mut seen[i], true) {
                            stack.push(i);
                        }
                    }
                }
                false
            };
            let pos = |f: &dyn Fn(&OpKind) -> bool| ops.iter().position(|op| f(&op.kind)).unwrap();
            for block in 0..3 {
                let upload = pos(
                    &|k| matches!(k, OpKind::UploadAct { m: 0, from: ActSource::Ckpt(b), .. } if *b == block),
                );
                let above = pos(
                    &|k| matches!(k, OpKind::Backward { layer, m: 0, .. } if *layer == block + 1),
                );
                assert!(!before(above, upload), "kept {kept}, block {block}");
            }
        }
    }

    #[test]
    fn the_next_forward_waits_only_for_its_own_update() {
        let s = Schedule::new(shape(4, 2, 2));
        let update_of = |p: ParamBuf| {
            let kind = match p {
                ParamBuf::Embed => OpKind::EmbedUpdate { next: true },
                p => OpKind::Update { what: p },
            };
            s.first.iter().position(|op| op.kind == kind).unwrap()
        };
        for (j, op) in s.steady.iter().enumerate() {
            let prev: Vec<usize> = s
                .waits(1, j)
                .filter_map(|w| if let Wait::Prev(i) = w { Some(i) } else { None })
                .collect();
            match op.kind {
                OpKind::UploadWeights { what: SlotContent::Layer(i), .. } if !prev.is_empty() => {
                    assert_eq!(prev, vec![update_of(ParamBuf::Layer(i))], "{op}");
                }
                OpKind::EmbedGather { m: 0 } => assert_eq!(prev, vec![update_of(ParamBuf::Embed)]),
                _ => {}
            }
        }
        // Layer 0's first upload of a step waits for layer 0's update of the previous step.
        let j = s
            .steady
            .iter()
            .position(|op| {
                matches!(op.kind, OpKind::UploadWeights { what: SlotContent::Layer(0), .. })
            })
            .unwrap();
        assert!(s.waits(1, j).any(|w| w == Wait::Prev(update_of(ParamBuf::Layer(0)))));
    }

    #[test]
    fn tiled_heads_are_hazard_free() {
        for layers in [1, 2, 4] {
            for mbs in [1, 2, 3] {
                for k in [1, 2, 3] {
                    for tiles in [2, 3, 5] {
                        for (tied, streamed, keep) in [
                            (false, false, false),
                            (true, false, false),
                            (false, true, false),
                            (true, true, false),
                            (false, false, true),
                        ] {
                            if keep && k != 1 {
                                continue;
                            }
                            for staged in [false, true] {
                                let s = Schedule::new(PlanShape {
                                    tied,
                                    streamed,
                                    kept_layers: if keep { layers } else { 0 },
                                    head_tiles: tiles,
                                    staged,
                                    ..shape(layers, mbs, k)
                                });
                                check(&s.unrolled(3), 0).unwrap_or_else(|h| {
                                    panic!(
                                        "L{layers} M{mbs} K{k} tiles {tiles} tied {tied} \
                                         streamed {streamed} keep {keep} staged {staged}: {h}"
                                    )
                                });
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_wait_of_a_tiled_head_is_needed() {
        for (tiles, streamed, tied) in [(2, false, false), (3, true, false), (4, false, true)] {
            every_wait_is_needed_in(Schedule::new(PlanShape {
                streamed,
                tied,
                head_tiles: tiles,
                ..shape(4, 2, 2)
            }));
        }
    }

    #[test]
    fn a_tiled_head_passes_each_tile_twice_and_uploads_each_at_most_twice() {
        for tiles in [2, 3, 5] {
            let s = Schedule::new(PlanShape { head_tiles: tiles, ..shape(3, 2, 1) });
            let ops = s.ops(2);
            let count = |f: &dyn Fn(&OpKind) -> bool| ops.iter().filter(|o| f(&o.kind)).count();
            for t in 0..tiles {
                let uploads = count(
                    &|k| matches!(k, OpKind::UploadWeights { what: SlotContent::HeadTile(x), .. } if *x == t),
                );
                // The last two tiles of pass 1 are still resident when pass 2 starts with them.
                assert_eq!(uploads, if t + 2 >= tiles { 1 } else { 2 }, "tiles {tiles}, tile {t}");
                let stats = count(&|k| matches!(k, OpKind::HeadStats { tile, .. } if *tile == t));
                let grads = count(&|k| matches!(k, OpKind::HeadGrad { tile, .. } if *tile == t));
                assert_eq!((stats, grads), (2, 2), "every micro-batch, both passes");
                let down = count(
                    &|k| matches!(k, OpKind::DownloadHeadTileGrads { tile, .. } if *tile == t),
                );
                assert_eq!(down, 1);
            }
            // Only the first tile of pass 2 (the last tile) overwrites dhf.
            let firsts: Vec<usize> = ops
                .iter()
                .filter_map(|o| match o.kind {
                    OpKind::HeadGrad { tile, first: true, .. } => Some(tile),
                    _ => None,
                })
                .collect();
            assert_eq!(firsts, vec![tiles - 1, tiles - 1]);
            assert_eq!(
                count(&|k| matches!(k, OpKind::Head { .. } | OpKind::DownloadHeadGrads { .. })),
                0
            );
            assert_eq!(count(&|k| matches!(k, OpKind::HeadFinish { .. })), 2);
            assert_eq!(count(&|k| *k == OpKind::DownloadNormGrads), 1);
            // Pass 2 starts after every micro-batch's statistics are complete.
            let last_stats =
                ops.iter().rposition(|o| matches!(o.kind, OpKind::HeadStats { .. })).unwrap();
            let first_grad =
                ops.iter().position(|o| matches!(o.kind, OpKind::HeadGrad { .. })).unwrap();
            assert!(last_stats < first_grad);
        }
    }

    #[test]
    fn micro_batches_do_not_multiply_uploads() {
        for mbs in [1, 2, 4] {
            let s = Schedule::new(shape(4, mbs, 2));
            assert_eq!(s.uploads_per_layer(), vec![2, 2, 2, 2], "M = {mbs}");
        }
    }
}

#[cfg(test)]
mod doc_tests {
    use super::*;

    /// docs/schedule.md shows the steady-state timeline of one step for 4 layers, K = 2, one
    /// micro-batch, in exact and in streamed (`lean`/`compact`) mode; this keeps both true.
    #[test]
    fn schedule_md_shows_the_current_timeline() {
        for streamed in [false, true] {
            schedule_md_shows(streamed);
        }
    }

    fn schedule_md_shows(streamed: bool) {
        let s = Schedule::new(PlanShape {
            layers: 4,
            micro_batches: 1,
            checkpoint_every: 2,
            grad_slabs: 2,
            tied: false,
            head_tiles: 1,
            kept_layers: 0,
            streamed,
            staged: false,
        });
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/schedule.md"))
            .unwrap();
        let timeline = s.timeline();
        if std::env::var_os("HORIZON_PRINT_TIMELINE").is_some() {
            println!("streamed {streamed}:\n{timeline}");
        }
        assert!(
            doc.contains(&timeline),
            "docs/schedule.md's timeline is stale; regenerate it with\n\
             HORIZON_PRINT_TIMELINE=1 cargo test --lib schedule_md -- --nocapture\n{timeline}"
        );
    }
}
