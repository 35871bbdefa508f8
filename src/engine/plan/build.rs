//! Building the plan's ops: one optimizer step's, in submission order (inputs, forward, head,
//! backward, embedding, optimizer: [`step_ops`], then the staged uploads' rounding placed by
//! [`stage_uploads`]), and an evaluation's forward-only ops ([`eval_ops`]). Waits come later,
//! from the resources each op declares ([`super::hazards::Scheduler`]).

use horizon_backend::Queue;

use super::types::{ActSource, GradTarget, Op, OpKind, ParamBuf, PlanShape, Res, SlotContent};

/// Two weight slots that double-buffer what goes through them: what each holds, and the last
/// op that used it (the least recently used one takes the next upload).
struct SlotPair {
    /// The slots' indices (`Res::Slot`).
    ids: [usize; 2],
    held: [Option<SlotContent>; 2],
    used: [usize; 2],
}

impl SlotPair {
    fn new(ids: [usize; 2]) -> Self {
        SlotPair { ids, held: [None, None], used: [0, 0] }
    }

    /// The pair's slot holding `what`, or the one to upload it into (a free one first, else
    /// the least recently used); whether it holds it.
    fn pick(&self, what: SlotContent) -> (usize, bool) {
        if let Some(s) = self.held.iter().position(|c| *c == Some(what)) {
            return (s, true);
        }
        let s = match self.held {
            [None, _] => 0,
            [_, None] => 1,
            _ => usize::from(self.used[0] > self.used[1]),
        };
        (s, false)
    }
}

/// Builds the operations of one step, in submission order, without waits.
struct Builder {
    shape: PlanShape,
    ops: Vec<Op>,
    /// The layer slots (layers, or of a chunked layer its trunk, and the head).
    slots: SlotPair,
    next_dw: usize,
    next_slab: usize,
    /// Streamed: (slab, layer) of the layers whose gradients wait in their slabs for the norm.
    held: Vec<(usize, usize)>,
    /// The expert slots (chunks of a chunked layer's experts).
    expert_slots: SlotPair,
    /// The direction of the next pass over a layer's chunks: each pass walks them the other
    /// way from the last, so the two chunks still resident are used first.
    chunks_reversed: bool,
    /// The next of the trained chunks' two gradient accumulators.
    next_chunk_dw: usize,
}

/// The weight slots of chunked experts: after the two layer slots.
pub const EXPERT_SLOTS: [usize; 2] = [2, 3];
/// The gradient accumulators of trained chunks: after the layers' two.
pub const EXPERT_DWS: [usize; 2] = [2, 3];

impl Builder {
    fn new(shape: PlanShape) -> Self {
        assert!(shape.layers > 0 && shape.micro_batches > 0 && shape.checkpoint_every > 0);
        assert!(shape.grad_slabs > 0 && shape.head_tiles > 0);
        assert!(shape.kept_layers == 0 || shape.checkpoint_every == 1, "kept internals need K = 1");
        assert!(shape.kept_layers <= shape.layers, "more kept layers than layers");
        Builder {
            shape,
            ops: Vec::new(),
            slots: SlotPair::new([0, 1]),
            next_dw: 0,
            next_slab: 0,
            held: Vec::new(),
            expert_slots: SlotPair::new(EXPERT_SLOTS),
            chunks_reversed: false,
            next_chunk_dw: 0,
        }
    }

    /// The expert slot holding chunk `chunk` of layer `layer` ([`Builder::ensure`]).
    fn ensure_chunk(&mut self, layer: usize, chunk: usize) -> usize {
        self.ensure(SlotContent::Experts { layer, chunk })
    }

    /// The chunks of one pass over a chunked layer, in this pass's order (flipped for the
    /// next), each with whether it is the pass's first.
    fn chunk_order(&mut self) -> Vec<(usize, bool)> {
        let n = self.shape.expert_chunks;
        let order: Vec<usize> = match self.chunks_reversed {
            false => (0..n).collect(),
            true => (0..n).rev().collect(),
        };
        self.chunks_reversed = !self.chunks_reversed;
        order.into_iter().enumerate().map(|(j, k)| (k, j == 0)).collect()
    }

    /// A chunked layer's forward of every micro-batch (`Act{src}` -> `Act{dst}`, its trunk in
    /// `slot`): each micro-batch's ops before the experts, then chunk by chunk every
    /// micro-batch through it while it is resident, then each micro-batch's ops after them. A
    /// micro-batch's internals live in its `ExpertRows` from its first op to its last.
    fn chunked_forward(&mut self, (layer, slot): (usize, usize), io: (usize, usize), rc: bool) {
        let (src, dst) = io;
        let act = |m| Res::Act { set: src, m };
        let rows = |m| [Res::Scratch, Res::ExpertRows(m)];
        for m in 0..self.shape.micro_batches {
            let kind = OpKind::Forward { layer, slot, m, src, dst, recompute: rc };
            self.push(kind, Queue::Compute, vec![Res::Slot(slot), act(m)], rows(m).to_vec());
        }
        for (chunk, first) in self.chunk_order() {
            let cs = self.ensure_chunk(layer, chunk);
            for m in 0..self.shape.micro_batches {
                let kind =
                    OpKind::ForwardExperts { layer, chunk, slot: cs, m, src, first, recompute: rc };
                self.push(kind, Queue::Compute, vec![Res::Slot(cs), act(m)], rows(m).to_vec());
            }
        }
        for m in 0..self.shape.micro_batches {
            let kind = OpKind::ForwardEnd { layer, slot, m, src, dst, recompute: rc };
            let writes = [&rows(m)[..], &[Res::Act { set: dst, m }]].concat();
            self.push(kind, Queue::Compute, vec![Res::Slot(slot), act(m)], writes);
        }
    }

    /// A chunked layer's backward of every micro-batch into `Dw{dw}`, from inputs in set
    /// `set`: each micro-batch's recompute of every op but the experts and backward of the ops
    /// after them, then chunk by chunk every micro-batch's backward through it, then each
    /// micro-batch's backward of the ops before them. A trained chunk's gradient goes into an
    /// accumulator of its own, added into the host gradient once every micro-batch is in.
    fn chunked_backward(&mut self, (layer, slot): (usize, usize), set: usize, dw: usize) {
        let mbs = self.shape.micro_batches;
        let reads = |s: usize, m| vec![Res::Slot(s), Res::Act { set, m }];
        let writes = |d: usize, m| vec![Res::Dw(d), Res::Dres(m), Res::Scratch, Res::ExpertRows(m)];
        for m in 0..mbs {
            let start = OpKind::Backward { layer, slot, m, set, dw };
            self.push(start, Queue::Compute, reads(slot, m), writes(dw, m));
        }
        for (chunk, first) in self.chunk_order() {
            let cs = self.ensure_chunk(layer, chunk);
            let cdw = match self.shape.chunks_trained {
                true => {
                    let d = EXPERT_DWS[self.next_chunk_dw];
                    self.next_chunk_dw = 1 - self.next_chunk_dw;
                    self.push(OpKind::ZeroDw { dw: d }, Queue::Compute, vec![], vec![Res::Dw(d)]);
                    d
                }
                false => dw,
            };
            for m in 0..mbs {
                let kind =
                    OpKind::BackwardExperts { layer, chunk, slot: cs, m, set, dw: cdw, first };
                self.push(kind, Queue::Compute, reads(cs, m), writes(cdw, m));
            }
            if self.shape.chunks_trained {
                self.return_chunk_grads(cdw, layer, chunk);
            }
        }
        for m in 0..mbs {
            let end = OpKind::BackwardEnd { layer, slot, m, set, dw };
            self.push(end, Queue::Compute, reads(slot, m), writes(dw, m));
        }
    }

    fn push(&mut self, kind: OpKind, queue: Queue, reads: Vec<Res>, writes: Vec<Res>) {
        self.ops.push(Op { kind, queue, reads, writes, waits: Vec::new() });
    }

    /// The slot holding `what` (an expert chunk in the expert slots, anything else in the
    /// layer slots), uploading it into the least recently used slot of its pair if needed.
    fn ensure(&mut self, what: SlotContent) -> usize {
        let experts = matches!(what, SlotContent::Experts { .. });
        let pair = if experts { &self.expert_slots } else { &self.slots };
        let (s, held) = pair.pick(what);
        let slot = pair.ids[s];
        if !held {
            let reads = match what {
                SlotContent::Layer(i) => vec![Res::Params(ParamBuf::Layer(i))],
                SlotContent::Head | SlotContent::HeadTile(_) => {
                    vec![Res::Params(ParamBuf::FinalNorm), Res::Params(self.shape.head_buf())]
                }
                // Trained experts are read from the layer's buffer, which its update writes;
                // frozen ones from the base, which nothing writes.
                SlotContent::Experts { layer, .. } => match self.shape.chunks_trained {
                    true => vec![Res::Params(ParamBuf::Layer(layer))],
                    false => vec![],
                },
            };
            let upload = OpKind::UploadWeights { slot, what };
            self.push(upload, Queue::H2D, reads, vec![Res::Slot(slot)]);
        }
        let now = self.ops.len();
        let pair = if experts { &mut self.expert_slots } else { &mut self.slots };
        (pair.held[s], pair.used[s]) = (Some(what), now);
        slot
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

    /// A trained chunk's gradient accumulator down into a slab and added into its layer's host
    /// gradient (exact mode: the layer's gradient is measured once its trunk's is in).
    fn return_chunk_grads(&mut self, dw: usize, layer: usize, chunk: usize) {
        assert!(!self.shape.streamed, "trained chunks need a whole host gradient");
        let slab = self.take_slab();
        let what = GradTarget::Experts { layer, chunk };
        let download = OpKind::DownloadDw { dw, slab, what };
        self.push(download, Queue::D2H, vec![Res::Dw(dw)], vec![Res::Slab(slab)]);
        let grads = vec![Res::Grads(ParamBuf::Layer(layer))];
        self.push(
            OpKind::AccumulateGrads { slab, what },
            Queue::Host,
            vec![Res::Slab(slab)],
            grads,
        );
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

    /// Tiled head, pass 1 for tile `tile` (uploaded into a slot if it is not resident): every
    /// micro-batch's softmax statistics over it (tile 0 also runs the final norm).
    fn head_stats(&mut self, tile: usize) {
        let (mbs, src) = (self.shape.micro_batches, self.shape.layers % 2);
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
            self.head_stats(tile);
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

    /// Where layer `layer`'s forward leaves its internals for micro-batch `m`, and where its
    /// backward finds them: its kept buffers, or the compute queue's scratch.
    fn internals(&self, layer: usize, m: usize) -> Res {
        if self.shape.keeps(layer) { Res::Stash { layer, m } } else { Res::Scratch }
    }

    /// Inputs: token ids, and the embedding rows, gathered by the host-to-device queue itself
    /// (as a host function on that queue), so that the next step's forward waits only for the
    /// update of those rows, not for the whole optimizer on the host queue.
    fn inputs(&mut self) {
        for m in 0..self.shape.micro_batches {
            self.push(OpKind::UploadIds { m }, Queue::H2D, vec![], vec![Res::Ids(m)]);
            let (gather, stage) = (OpKind::EmbedGather { m }, Res::EmbStage(m));
            self.push(gather, Queue::H2D, vec![Res::EmbedNext], vec![stage]);
            self.push(
                OpKind::UploadAct { m, set: 0, from: ActSource::Embedding },
                Queue::H2D,
                vec![Res::EmbStage(m)],
                vec![Res::Act { set: 0, m }],
            );
        }
    }

    /// Forward, layer-major: every micro-batch passes layer i while its weights are resident;
    /// with `checkpoints`, each block's input goes to its host checkpoint on the way.
    fn forward(&mut self, checkpoints: bool) {
        let k = self.shape.checkpoint_every;
        for i in 0..self.shape.layers {
            let slot = self.ensure(SlotContent::Layer(i));
            let (src, dst) = (i % 2, (i + 1) % 2);
            let chunked = self.shape.chunked.contains(i);
            for m in 0..self.shape.micro_batches {
                if checkpoints && i % k == 0 {
                    self.push(
                        OpKind::SaveCkpt { block: i / k, m, set: src },
                        Queue::D2H,
                        vec![Res::Act { set: src, m }],
                        vec![Res::Ckpt { block: i / k, m }],
                    );
                }
                if chunked {
                    continue;
                }
                // The scratch also holds the dequantisation workspace of a quantised base.
                let mut writes = vec![Res::Act { set: dst, m }, self.internals(i, m)];
                if self.shape.keeps(i) {
                    writes.push(Res::Scratch);
                }
                self.push(
                    OpKind::Forward { layer: i, slot, m, src, dst, recompute: false },
                    Queue::Compute,
                    vec![Res::Slot(slot), Res::Act { set: src, m }],
                    writes,
                );
            }
            if chunked {
                self.chunked_forward((i, slot), (src, dst), false);
            }
        }
    }

    /// Final norm + LM head + cross-entropy, forward and backward, per micro-batch. Then the
    /// head's gradients are complete for the step: they stay in their host buffers until the
    /// norm is known; in streamed modes the layer updates estimate the norm from these squared
    /// norms onwards.
    fn head(&mut self) {
        if self.shape.head_tiles == 1 {
            self.whole_head();
        } else {
            self.tiled_head();
        }
        if self.shape.streamed {
            self.poison(ParamBuf::FinalNorm);
        }
        self.measure(ParamBuf::FinalNorm);
        if !self.shape.tied {
            self.measure(ParamBuf::Head);
        }
    }

    /// Backward, block by block from the last: restore the block's checkpoint, recompute the
    /// inputs of its layers, then walk its layers backwards, recomputing each layer's
    /// internals (or reading them where it kept them), each layer's gradient returned to the
    /// host as soon as it is complete.
    fn backward(&mut self) {
        for block in (0..self.shape.blocks()).rev() {
            let k = self.shape.checkpoint_every;
            let first = block * k;
            let last = (first + k).min(self.shape.layers) - 1;
            // The block's first weights go ahead of its checkpoint on the copy queue: the
            // checkpoint must wait until an earlier backward is done with the buffer it lands
            // in, the weights only until their slot is free, which is earlier.
            self.ensure(SlotContent::Layer(if first < last { first } else { last }));
            // With K = 1 the blocks alternate between the two sets the forward ping-pongs
            // between, so a block's checkpoint lands while the block above it runs its backward
            // from the other set, instead of after it.
            let base = if k == 1 { block % 2 } else { 0 };
            for m in 0..self.shape.micro_batches {
                self.push(
                    OpKind::UploadAct { m, set: base, from: ActSource::Ckpt(block) },
                    Queue::H2D,
                    vec![Res::Ckpt { block, m }],
                    vec![Res::Act { set: base, m }],
                );
            }
            self.recompute_block(first, last);
            for i in (first..=last).rev() {
                self.layer_backward(i, base + i - first);
            }
        }
    }

    /// The block recompute: layers `first..last` forward again from the block's checkpoint,
    /// each input into its own set, internals into the scratch.
    fn recompute_block(&mut self, first: usize, last: usize) {
        for i in first..last {
            let slot = self.ensure(SlotContent::Layer(i));
            let (src, dst) = (i - first, i - first + 1);
            if self.shape.chunked.contains(i) {
                self.chunked_forward((i, slot), (src, dst), true);
                continue;
            }
            for m in 0..self.shape.micro_batches {
                self.push(
                    OpKind::Forward { layer: i, slot, m, src, dst, recompute: true },
                    Queue::Compute,
                    vec![Res::Slot(slot), Res::Act { set: src, m }],
                    vec![Res::Act { set: dst, m }, Res::Scratch],
                );
            }
        }
    }

    /// Layer `i`'s backward for every micro-batch, from its input in set `set`, into a fresh
    /// gradient accumulator, then the gradient back to the host.
    fn layer_backward(&mut self, i: usize, set: usize) {
        let slot = self.ensure(SlotContent::Layer(i));
        let dw = self.take_dw();
        self.push(OpKind::ZeroDw { dw }, Queue::Compute, vec![], vec![Res::Dw(dw)]);
        if self.shape.chunked.contains(i) {
            self.chunked_backward((i, slot), set, dw);
            return self.return_grads(dw, GradTarget::Layer(i));
        }
        for m in 0..self.shape.micro_batches {
            let mut reads = vec![Res::Slot(slot), Res::Act { set, m }];
            if self.shape.keeps(i) {
                reads.push(self.internals(i, m));
            }
            self.push(
                OpKind::Backward { layer: i, slot, m, set, dw },
                Queue::Compute,
                reads,
                vec![Res::Dw(dw), Res::Dres(m), Res::Scratch],
            );
        }
        self.return_grads(dw, GradTarget::Layer(i));
    }

    /// The embedding's gradient: only the rows the batch touched, scattered on the host.
    fn embedding(&mut self) {
        for m in 0..self.shape.micro_batches {
            let (download, dx) = (OpKind::DownloadDres { m }, Res::DxStage(m));
            self.push(download, Queue::D2H, vec![Res::Dres(m)], vec![dx]);
            self.push(
                OpKind::EmbedScatter { m },
                Queue::Host,
                vec![],
                // It scales the staged rows in place (Gemma's embedding scale) first.
                vec![Res::DxStage(m), Res::Grads(ParamBuf::Embed)],
            );
        }
    }

    /// The streamed optimizer's end of the step (`lean`/`compact`). The embedding's gradient is
    /// complete once every micro-batch's rows are scattered (with a tied head, the head's part
    /// came first). Then the step's norm, from the squared norms recorded so far and the
    /// embedding's; on the run's first step it also corrects the moments of the layers updated
    /// before the norm was known. Everything left waits for the norm, in the order the next
    /// step needs it.
    fn streamed_optimizer(&mut self) {
        let (mbs, layers) = (self.shape.micro_batches, self.shape.layers);
        let mut reads = vec![Res::StepStats, Res::Grads(ParamBuf::Embed)];
        reads.extend((0..mbs).map(Res::LossHost));
        let mut writes = vec![Res::Norm, Res::StepStats];
        writes.extend((self.shape.grad_slabs..layers).map(|i| Res::Moments(ParamBuf::Layer(i))));
        self.push(OpKind::GradNorm, Queue::Host, reads, writes);
        self.update_embed(true);
        for (slab, layer) in std::mem::take(&mut self.held).into_iter().rev() {
            let p = ParamBuf::Layer(layer);
            self.push(
                OpKind::HeldSlabUpdate { slab, layer },
                Queue::Host,
                vec![Res::Slab(slab), Res::Norm],
                vec![Res::Params(p), Res::Moments(p)],
            );
        }
        self.update(ParamBuf::FinalNorm);
        if !self.shape.tied {
            self.update(ParamBuf::Head);
        }
        self.update_embed(false);
    }

    /// The exact optimizer: the global norm (the sum of the squared norms measured as each
    /// gradient completed; the embedding's last), then each buffer's update in the order the
    /// next step needs them, so the next forward of layer i waits only for layer i's update.
    /// The norm op also checks the losses: a non-finite loss or norm skips every update.
    fn exact_optimizer(&mut self) {
        self.poison(ParamBuf::Embed);
        self.measure(ParamBuf::Embed);
        let mut reads = vec![Res::StepStats];
        reads.extend((0..self.shape.micro_batches).map(Res::LossHost));
        self.push(OpKind::GradNorm, Queue::Host, reads, vec![Res::Norm, Res::StepStats]);
        for p in self.shape.param_bufs() {
            if p == ParamBuf::Embed { self.update_embed(true) } else { self.update(p) }
        }
        self.update_embed(false);
    }

    /// An evaluation's head: micro-batch 0's losses, forward only (whole, or tile by tile: the
    /// statistics of each tile, then the losses), and their download.
    fn eval_head(&mut self) {
        let src = self.shape.layers % 2;
        let m = 0;
        if self.shape.head_tiles == 1 {
            let slot = self.ensure(SlotContent::Head);
            self.push(
                OpKind::HeadLoss { slot, m, src },
                Queue::Compute,
                vec![Res::Slot(slot), Res::Act { set: src, m }, Res::Ids(m)],
                vec![Res::Losses(m), Res::Scratch],
            );
        } else {
            for tile in 0..self.shape.head_tiles {
                self.head_stats(tile);
            }
            let reads = vec![Res::HeadRows(m), Res::Ids(m)];
            self.push(OpKind::TileLosses { m }, Queue::Compute, reads, vec![Res::Losses(m)]);
        }
        self.download_losses(m);
    }
}

/// The operations of one optimizer step, in submission order, without waits.
pub fn step_ops(shape: PlanShape) -> Vec<Op> {
    let mut b = Builder::new(shape);
    b.inputs();
    b.forward(true);
    b.head();
    b.backward();
    b.embedding();
    if shape.streamed {
        b.streamed_optimizer();
    } else {
        b.exact_optimizer();
    }
    if shape.staged { stage_uploads(b.ops) } else { b.ops }
}

/// The forward-only operations of an evaluation of one micro-batch (micro-batch 0's buffers),
/// without waits: its inputs, every layer's forward (the weights through the two slots, as in a
/// step, from the masters or images: never the stages, which hold the next step's first
/// uploads), the head's losses, and the losses down. No checkpoint, gradient or update.
pub fn eval_ops(shape: PlanShape) -> Vec<Op> {
    let mut b = Builder::new(PlanShape { micro_batches: 1, staged: false, ..shape });
    b.inputs();
    b.forward(false);
    b.eval_head();
    b.ops
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
            // Expert chunks are frozen: nothing to round.
            OpKind::UploadWeights { what: SlotContent::Experts { .. }, .. } => None,
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
        if let OpKind::UploadWeights { slot, what } = op.kind
            && !matches!(what, SlotContent::Experts { .. })
        {
            op.reads = vec![Res::WeightStage(slot)];
        }
        out.push(op);
        // Stable: stages following the same op keep the uploads' order.
        out.extend(stages.iter().filter(|(a, _)| *a == i).map(|(_, s)| s.clone()));
    }
    out
}
