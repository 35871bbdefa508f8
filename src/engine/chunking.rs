//! Which layers the engine holds whole and which as a trunk plus chunks of experts
//! (`engine.expert_chunk`, issue 44): a sparse layer's routed experts stream through two slots
//! of their own, a chunk at a time, so device memory holds the trunk and two chunks whatever
//! the number of experts ([`crate::model::chunks`] says where each piece lands). Trained
//! experts' chunks bring their gradients back through two gradient accumulators of their own,
//! added into the host gradient chunk by chunk (an exact-mode run).

use crate::engine::options::EngineConfig;
use crate::engine::plan::LayerSet;
use crate::model::chunks::{ExpertSplit, SlotMap};
use crate::model::layout::ModelLayout;

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
