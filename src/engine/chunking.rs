//! Which layers the engine holds whole and which as a trunk plus chunks of experts
//! (`engine.expert_chunk`, issue 44): a sparse layer's routed experts stream through two slots
//! of their own, a chunk at a time, so device memory holds the trunk and two chunks whatever
//! the number of experts ([`crate::model::chunks`] says where each piece lands). Trained
//! experts' chunks bring their gradients back through two gradient accumulators of their own,
//! added into the host gradient chunk by chunk (an exact-mode run).

use crate::engine::options::EngineConfig;
use crate::engine::plan::{LayerSet, keeps_internals};
use crate::model::chunks::{ExpertSplit, SlotMap};
use crate::model::layout::ModelLayout;
use crate::model::spec::{Act, BwdOp, DRES, IO_SLOTS, LayerSpec, Op};

/// Which of the compute queue's scratch buffers a chunked layer's pass needs one of per
/// micro-batch. A pass runs every micro-batch through a chunk while it is resident, so what a
/// micro-batch's part of the layer leaves for a later part (before the experts, each chunk,
/// after them) waits while the other micro-batches run theirs: that buffer is carried; the
/// rest (attention's internals, the experts' per-chunk temporaries) is the shared scratch's.
///
/// - Forward: an activation one part writes and a later part reads (the experts' input and
///   routing, their output and the pairs' sort, the residual the part after them adds to).
/// - Backward: what the experts' backward reads of the forward (their input and routing,
///   rebuilt by the recompute at the pass's start: carried by the forward's rule, as the ops
///   before them write them) and any activation the part before the experts reads that the
///   part after writes; each gradient one part writes and a later part reads (the experts'
///   output gradient, their input's and the routing weights', the sort). The part before the experts is recomputed at the pass's end for its backward
///   (with more than one micro-batch), so its internals need not wait.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Carried {
    /// Per own activation (the scratch's `acts`, by index), its width when carried (the
    /// widest of the chunked kinds'), else 0.
    pub acts: Vec<usize>,
    /// Per gradient buffer but the residual's (the scratch's `grads`, by index from 1), its
    /// width when carried, else 0.
    pub grads: Vec<usize>,
}

impl Carried {
    /// What `kinds` (the chunked layer descriptions) carry, over buffers of the widest's
    /// indices (`acts`, `grads` buffers, the residual gradient not counted).
    fn of<'a>(kinds: impl Iterator<Item = &'a LayerSpec>, acts: usize, grads: usize) -> Self {
        let mut c = Carried { acts: vec![0; acts], grads: vec![0; grads] };
        for spec in kinds {
            for a in carried_acts(spec).into_iter().filter(|&a| a >= IO_SLOTS) {
                let w = &mut c.acts[a - IO_SLOTS];
                *w = (*w).max(spec.width(a));
            }
            for g in carried_grads(spec).into_iter().filter(|&g| g != DRES) {
                c.grads[g - 1] = c.grads[g - 1].max(spec.grads[g]);
            }
        }
        c
    }
}

/// The part of a chunked layer op `i` runs in: 0 before the experts op `x`, 1 the experts,
/// 2 after them.
fn part_of(i: usize, x: usize) -> usize {
    match i.cmp(&x) {
        std::cmp::Ordering::Less => 0,
        std::cmp::Ordering::Equal => 1,
        std::cmp::Ordering::Greater => 2,
    }
}

/// The activations a chunked layer's pass carries ([`Carried`]).
fn carried_acts(spec: &LayerSpec) -> Vec<Act> {
    let x = spec.ops.iter().position(|op| matches!(op, Op::Experts { .. })).expect("experts");
    let reads = |op: &Op| [op.forward_io().0, op.saved()].concat();
    let temporaries = expert_temporaries(spec).0;
    let mut out = Vec::new();
    for (i, op) in spec.ops.iter().enumerate() {
        for a in op.forward_io().1 {
            let mut later = spec.ops.iter().enumerate().skip(i + 1);
            let read_later =
                later.any(|(j, o)| part_of(j, x) > part_of(i, x) && reads(o).contains(&a));
            // The experts' output (added to chunk by chunk) and the sort (read by later chunks).
            let across_chunks = i == x && !temporaries.contains(&a);
            // Written after the experts, read by the backward of an op before them.
            let before_reads = spec.ops[..x].iter().any(|o| o.saved().contains(&a));
            if read_later || across_chunks || (i > x && before_reads) {
                out.push(a);
            }
        }
    }
    out
}

/// The gradient buffers a chunked layer's backward pass carries ([`Carried`]): its steps run
/// after the experts' ops first (part 2), the experts' (1), then before them (0).
fn carried_grads(spec: &LayerSpec) -> Vec<usize> {
    let x = spec.backward.iter().position(|b| matches!(b, BwdOp::Experts { .. })).expect("experts");
    // Steps before the experts' belong to the ops after them.
    let part = |j: usize| part_of(x, j);
    let temporaries = expert_temporaries(spec).1;
    let mut out = Vec::new();
    for (i, step) in spec.backward.iter().enumerate() {
        for g in grad_io(step).1 {
            let mut later = spec.backward.iter().enumerate().skip(i + 1);
            let read_later = later.any(|(j, s)| part(j) < part(i) && grad_io(s).0.contains(&g));
            let across_chunks = i == x && !temporaries.contains(&g);
            if read_later || across_chunks {
                out.push(g);
            }
        }
    }
    out
}

/// The gradient buffers a backward step reads (an accumulation reads what it adds to) and
/// writes.
fn grad_io(step: &BwdOp) -> (Vec<usize>, Vec<usize>) {
    match *step {
        BwdOp::Copy { dst, src, .. } => (vec![src], vec![dst]),
        BwdOp::Accumulate { dst, src, .. } => (vec![src, dst], vec![dst]),
        BwdOp::Zero { dst, .. } => (vec![], vec![dst]),
        BwdOp::RmsNorm { dinp, dout, .. } => (vec![dout, dinp], vec![dinp]),
        BwdOp::HeadNorm { dinp, dout, .. } | BwdOp::Attention { dqkv: dinp, dout, .. } => {
            (vec![dout], vec![dinp])
        }
        BwdOp::Glu { dgu, dout, .. } => (vec![dout], vec![dgu]),
        BwdOp::Linear { dinp, dout, acc, .. } => {
            (if acc { vec![dout, dinp] } else { vec![dout] }, vec![dinp])
        }
        BwdOp::Rope { dqkv, .. } => (vec![dqkv], vec![dqkv]),
        BwdOp::Lora { dinp, dout, g, du, .. } => (vec![dout, dinp], vec![g, du, dinp]),
        BwdOp::SigmoidGate { dgate, dinp, dout, .. } => (vec![dout], vec![dgate, dinp]),
        BwdOp::Route { dlogits, dwts, .. } => (vec![dwts], vec![dlogits]),
        BwdOp::Experts { dinp, acc, dout, dwts, t, .. } => {
            let reads = if acc { vec![dout, dinp] } else { vec![dout] };
            (reads, [&[dinp, dwts][..], &t[..]].concat())
        }
    }
}

/// A sparse layer's experts op's per-chunk temporaries: its activations (gate|up, gathered
/// rows, SwiGLU, outputs, adapter scratch) and its backward's gradient scratch but the sort.
fn expert_temporaries(spec: &LayerSpec) -> (Vec<usize>, Vec<usize>) {
    let fwd = spec.ops.iter().find_map(|op| match *op {
        Op::Experts { gu, scratch: [xs, s, ys, _idx], ref lora, .. } => {
            Some([&[gu, xs, s, ys][..], &lora.scratch.map_or(vec![], |t| t.to_vec())].concat())
        }
        _ => None,
    });
    let bwd = spec.backward.iter().find_map(|b| match *b {
        // t[6] is the sort, which later chunks read.
        BwdOp::Experts { t, .. } => Some([&t[..6], &t[7..]].concat()),
        _ => None,
    });
    (fwd.expect("a chunked layer has experts"), bwd.expect("and their backward"))
}

/// Per layer kind, its split into trunk and expert chunks (`None`: held whole).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chunking {
    kinds: Vec<Option<ExpertSplit>>,
    kind_of: Vec<usize>,
}

impl Chunking {
    /// `layout`'s sparse kinds under `cfg` (`engine.expert_chunk`): in chunks in an exact-mode
    /// run; in a streamed one (`optimizer.memory` lean or compact, whose layers update from a
    /// whole slab) only where the experts are frozen.
    pub fn of(layout: &ModelLayout, cfg: &EngineConfig) -> Self {
        Self::new(layout, cfg.expert_chunk, !cfg.memory.streams_updates())
    }

    /// `layout`'s sparse kinds in chunks of `per_chunk` experts (none without it, and none of
    /// a layer whose chunk would be the whole of its experts), those with trained experts (full
    /// fine-tuning, expert adapters) only with `trained`.
    pub fn new(layout: &ModelLayout, per_chunk: Option<usize>, trained: bool) -> Self {
        let split = |k| {
            let s = ExpertSplit::new(k, per_chunk?)?;
            (s.chunks.len() > 1 && (trained || !s.trained())).then_some(s)
        };
        Chunking {
            kinds: layout.kinds.iter().map(split).collect(),
            kind_of: layout.kind_of.clone(),
        }
    }

    /// Layer `i`'s split, when its experts stream in chunks.
    pub fn split(&self, i: usize) -> Option<&ExpertSplit> {
        self.kinds.get(*self.kind_of.get(i)?)?.as_ref()
    }

    /// Where layer `i`'s weights are in the slot that holds it: `None` for a whole layer.
    pub fn trunk(&self, i: usize) -> Option<&SlotMap> {
        self.split(i).map(|s| &s.trunk)
    }

    /// Whether any layer streams its experts.
    pub fn any(&self) -> bool {
        self.kinds.iter().any(Option::is_some)
    }

    /// Whether chunks carry gradients (trained experts).
    pub fn trained(&self) -> bool {
        self.kinds.iter().flatten().any(ExpertSplit::trained)
    }

    /// Elements of the largest chunk's gradient (0 when the chunked experts are frozen).
    pub fn chunk_grad(&self) -> usize {
        self.kinds.iter().flatten().flat_map(|s| &s.chunks).map(|c| c.train_len).max().unwrap_or(0)
    }

    /// Elements of layer `i`'s gradient as its slot's part of it comes back: its trunk's, or
    /// the whole layer's.
    pub fn layer_grad(&self, layout: &ModelLayout, i: usize) -> usize {
        self.trunk(i).map_or(layout.layer(i).train_len(), |m| m.train_len)
    }

    /// The chunks of each chunked layer (every chunked kind has the same experts), 1 without.
    pub fn chunks(&self) -> usize {
        self.kinds.iter().flatten().map(|s| s.chunks.len()).max().unwrap_or(1)
    }

    /// The chunked layers.
    pub fn layers(&self) -> LayerSet {
        let mut set = LayerSet::default();
        for i in (0..self.kind_of.len()).filter(|&i| self.split(i).is_some()) {
            set.insert(i);
        }
        set
    }

    /// Per layer of `layers`, whether it keeps its internals when `kept` layers are asked to
    /// ([`keeps_internals`]): a chunked layer never does (as `PlanShape::keeps` says).
    pub fn keepers(&self, layers: usize, kept: usize) -> Vec<bool> {
        (0..layers).map(|i| keeps_internals(layers, kept, i) && self.split(i).is_none()).collect()
    }

    /// The scratch buffers a chunked layer's pass needs per micro-batch ([`Carried`]); none
    /// without chunks.
    pub fn carried(&self, layout: &ModelLayout) -> Carried {
        let chunked = layout.kinds.iter().zip(&self.kinds).filter(|(_, s)| s.is_some());
        let grads = layout.max_grad_widths().len().saturating_sub(1);
        Carried::of(chunked.map(|(k, _)| k), layout.max_act_widths().len(), grads)
    }

    /// Weights of the slot a layer of kind `k` needs (`layout.kinds[k]`): whole, or its trunk;
    /// its weights in `weight_bytes` each, then its packed words from the next 4-byte boundary.
    pub fn layer_slot(&self, layout: &ModelLayout, weight_bytes: usize) -> usize {
        let held = |k: usize| match &self.kinds[k] {
            Some(s) => (s.trunk.len, s.trunk.packed),
            None => (layout.kinds[k].len, layout.kinds[k].packed),
        };
        (0..layout.kinds.len()).map(|k| slot_weights(held(k), weight_bytes)).max().unwrap_or(0)
    }

    /// Weights of an expert chunk's slot (the largest chunk; 0 without chunks), laid out as a
    /// layer's slot.
    pub fn chunk_slot(&self, weight_bytes: usize) -> usize {
        let chunks = self.kinds.iter().flatten();
        chunks.map(|s| slot_weights(s.largest_chunk(), weight_bytes)).max().unwrap_or(0)
    }
}

/// Weights (of `weight_bytes` each) a slot takes for `len` weights, then `packed` words (4
/// bytes each) from the next 4-byte boundary.
fn slot_weights((len, packed): (usize, usize), weight_bytes: usize) -> usize {
    (((len * weight_bytes).div_ceil(4) + packed) * 4).div_ceil(weight_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::config::ModelConfig;

    fn sparse_kind(case: &str) -> LayerSpec {
        let dir = env!("CARGO_MANIFEST_DIR");
        let path = format!("{dir}/tests/fixtures/{case}/model/config.json");
        let layout = crate::model::describe(&ModelConfig::from_file(path.as_ref()).unwrap());
        layout
            .kinds
            .into_iter()
            .find(|k| k.ops.iter().any(|op| matches!(op, Op::Experts { .. })))
            .unwrap()
    }

    /// A pass carries, per micro-batch, the experts' input, routing, output and sort and the
    /// residual the part after them adds to; the attention's internals and the experts'
    /// temporaries stay in the shared scratch.
    #[test]
    fn a_pass_carries_what_crosses_its_parts_and_no_more() {
        for case in ["qwen3_moe", "mixtral"] {
            let spec = sparse_kind(case);
            let c = Carried::of(std::iter::once(&spec), spec.acts.len(), spec.grads.len() - 1);
            let names: Vec<&str> = (0..spec.acts.len())
                .filter(|&j| c.acts[j] > 0)
                .map(|j| spec.acts[j].name)
                .collect();
            let grads = c.grads.iter().filter(|&&g| g > 0).count();
            // `tmp`: the experts' output; `x2`: the residual after attention; `h2`: its norm.
            let want = ["tmp", "x2", "h2", "experts_sel", "experts_wts", "experts_idx"];
            assert_eq!(names, want, "{case}");
            // The experts' output, input and routing weights' gradients, and the sort.
            assert_eq!(grads, 4, "{case}");
            let width: usize = c.acts.iter().sum();
            let all: usize = spec.acts.iter().map(|a| a.width).sum();
            assert!(width * 3 < all, "{case}: {width} of {all} carried");
        }
    }
}
