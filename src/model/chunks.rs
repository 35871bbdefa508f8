//! A sparse layer whose experts stream through the device in chunks (issue 44): the layer's
//! weights split into its *trunk* (everything but the routed experts: norms, attention, router,
//! shared expert, adapters) and chunks of whole experts, each held by a slot of its own. A
//! [`SlotMap`] says where each piece of the layer's slot (its weights) and of its packed NF4
//! words lands in the slot that holds it; the layer ops address weights as the layer's
//! description lays them out and translate through the map, so one description runs whole or
//! chunked.
//!
//! A chunk holds whole experts: their matrices (frozen, as the base's NF4 words or weights, or
//! trained) and their adapters; its gradient is its trained weights', laid out as the slot
//! holds them ([`SlotMap::grads`]).

use std::ops::Range;

use crate::model::spec::{LayerSpec, Op, Weight};

/// Where a slot's contents come from: pieces of a layer's slot weights and of its packed words,
/// each landing at a position of this slot (weights from 0, words from the slot's words
/// region), in order and without gaps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotMap {
    /// (range of the layer's slot weights, its first weight in this slot).
    pub weights: Vec<(Range<usize>, usize)>,
    /// (range of the layer's packed words, its first word in this slot's words region).
    pub words: Vec<(Range<usize>, usize)>,
    /// Weights of this slot.
    pub len: usize,
    /// Packed words of this slot.
    pub packed: usize,
    /// (range of the layer's trained weights, counted from its first trained one, its first
    /// element in this part's gradient): the gradient of what this slot holds.
    pub grads: Vec<(Range<usize>, usize)>,
    /// Trained weights of this slot: its gradient's length.
    pub train_len: usize,
}

impl SlotMap {
    /// Pieces covering `ranges` (in order), laid end to end from 0.
    fn end_to_end(
        ranges: impl IntoIterator<Item = Range<usize>>,
    ) -> (Vec<(Range<usize>, usize)>, usize) {
        let mut at = 0;
        let pieces = ranges
            .into_iter()
            .filter(|r| !r.is_empty())
            .map(|r| {
                let p = (r.clone(), at);
                at += r.len();
                p
            })
            .collect();
        (pieces, at)
    }

    /// Where the layer's slot weights `r` are in this slot.
    pub fn weight(&self, r: &Range<usize>) -> Range<usize> {
        translate(&self.weights, r)
    }

    /// Where the layer's packed words `r` are in this slot's words region.
    pub fn word(&self, r: &Range<usize>) -> Range<usize> {
        translate(&self.words, r)
    }

    /// Where the gradient of the layer's trained weights `r` (counted from its first trained
    /// weight) is in this part's gradient.
    pub fn grad(&self, r: &Range<usize>) -> Range<usize> {
        translate(&self.grads, r)
    }
}

/// `r` through `pieces`: it must lie inside one of them.
fn translate(pieces: &[(Range<usize>, usize)], r: &Range<usize>) -> Range<usize> {
    let (src, at) = pieces
        .iter()
        .find(|(src, _)| src.start <= r.start && r.end <= src.end)
        .unwrap_or_else(|| panic!("weights {r:?} are not in this slot ({pieces:?})"));
    let start = at + (r.start - src.start);
    start..start + r.len()
}

/// `whole` without `holes` (sorted, disjoint, inside it).
fn complement(whole: Range<usize>, holes: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut at = whole.start;
    for h in holes.iter().filter(|h| !h.is_empty()) {
        out.push(at..h.start);
        at = h.end;
    }
    out.push(at..whole.end);
    out
}

/// How a sparse layer's frozen experts split into chunks of `per_chunk` experts: the trunk's
/// map and each chunk's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertSplit {
    /// Experts per chunk (the last chunk may hold fewer).
    pub per_chunk: usize,
    /// Experts of the layer.
    pub experts: usize,
    pub trunk: SlotMap,
    pub chunks: Vec<SlotMap>,
}

/// A sparse layer's expert storage: groups of per-expert pieces (each group contiguous over
/// the experts, in expert order) in the slot and in the packed words.
struct ExpertPieces {
    experts: usize,
    /// The experts' gate|up and down matrices (full fine-tuning, or a frozen full-precision
    /// base), their biases (gpt-oss), and their adapters' A and B.
    slot: Vec<Vec<Range<usize>>>,
    /// The experts' NF4 gate|up and down (QLoRA).
    words: Vec<Vec<Range<usize>>>,
}

/// Per expert, `len` elements from `r.start`.
fn per_expert(r: &Range<usize>, e: usize, len: usize) -> Vec<Range<usize>> {
    (0..e).map(|x| r.start + x * len..r.start + (x + 1) * len).collect()
}

/// The pieces of `spec`'s routed experts, when it has them.
fn expert_pieces(spec: &LayerSpec) -> Option<ExpertPieces> {
    let op = spec.ops.iter().find(|op| matches!(op, Op::Experts { .. }))?;
    let Op::Experts { ref gate_up, ref down, e, i, c, ref lora, ref packed, ref bias, .. } = *op
    else {
        unreachable!()
    };
    let (mut slot, mut words) = (Vec::new(), Vec::new());
    match packed {
        Some(w) => {
            let span = |w: &Weight| match w {
                Weight::Packed(parts) => parts[0].words.start..parts[parts.len() - 1].words.end,
                Weight::Slot(_) => unreachable!("packed experts are NF4"),
            };
            words.push(w.iter().map(|x| span(&x[0])).collect());
            words.push(w.iter().map(|x| span(&x[1])).collect());
        }
        None => {
            slot.push(per_expert(gate_up, e, 2 * i * c));
            slot.push(per_expert(down, e, c * i));
        }
    }
    if let Some([gu, dn]) = bias {
        slot.push(per_expert(gu, e, 2 * i));
        slot.push(per_expert(dn, e, c));
    }
    for (l, ic, oc) in [(&lora.gate_up, c, 2 * i), (&lora.down, i, c)] {
        if let Some(l) = l {
            slot.push(per_expert(&l.a, e, l.r * ic));
            slot.push(per_expert(&l.b, e, oc * l.r));
        }
    }
    Some(ExpertPieces { experts: e, slot, words })
}

/// The union of contiguous `ranges` (each starting where the one before ends).
fn joined(ranges: &[Range<usize>]) -> Range<usize> {
    debug_assert!(
        ranges.windows(2).all(|w| w[0].end == w[1].start),
        "expert pieces are contiguous"
    );
    ranges[0].start..ranges[ranges.len() - 1].end
}

/// Each group's pieces of experts `xs`, joined.
fn chunk_of(groups: &[Vec<Range<usize>>], xs: Range<usize>) -> Vec<Range<usize>> {
    groups.iter().map(|g| joined(&g[xs.clone()])).collect()
}

/// `whole` without every group's pieces.
fn trunk_of(whole: Range<usize>, groups: &[Vec<Range<usize>>]) -> Vec<Range<usize>> {
    let mut holes: Vec<Range<usize>> = groups.iter().map(|g| joined(g)).collect();
    holes.sort_by_key(|r| r.start);
    complement(whole, &holes)
}

impl ExpertSplit {
    /// `spec`'s routed experts (their matrices, frozen or trained, and their adapters) in
    /// chunks of `per_chunk`; `None` for a layer without experts.
    pub fn new(spec: &LayerSpec, per_chunk: usize) -> Option<Self> {
        assert!(per_chunk > 0, "a chunk holds at least one expert");
        let p = expert_pieces(spec)?;
        let e = p.experts;
        let frozen = spec.frozen;
        let trunk =
            map_of(trunk_of(0..spec.len, &p.slot), trunk_of(0..spec.packed, &p.words), frozen);
        let chunks = (0..e.div_ceil(per_chunk))
            .map(|k| {
                let xs = k * per_chunk..((k + 1) * per_chunk).min(e);
                map_of(chunk_of(&p.slot, xs.clone()), chunk_of(&p.words, xs), frozen)
            })
            .collect();
        Some(ExpertSplit { per_chunk, experts: e, trunk, chunks })
    }

    /// Whether the experts carry trained weights (full fine-tuning, or expert adapters): their
    /// chunks then have gradients of their own.
    pub fn trained(&self) -> bool {
        self.chunks.iter().any(|c| c.train_len > 0)
    }

    /// The experts of chunk `k`.
    pub fn experts_of(&self, k: usize) -> Range<usize> {
        k * self.per_chunk..((k + 1) * self.per_chunk).min(self.experts)
    }

    /// Weights and words of the largest chunk.
    pub fn largest_chunk(&self) -> (usize, usize) {
        (
            self.chunks.iter().map(|c| c.len).max().unwrap_or(0),
            self.chunks.iter().map(|c| c.packed).max().unwrap_or(0),
        )
    }
}

/// The map of a slot holding `weights` of a layer's slot and `words` of its packed words, its
/// gradient laid out as its trained weights (those past `frozen`) come, in order.
fn map_of(weights: Vec<Range<usize>>, words: Vec<Range<usize>>, frozen: usize) -> SlotMap {
    let trained = weights.iter().map(|r| r.start.max(frozen) - frozen..r.end.max(frozen) - frozen);
    let (grads, train_len) = SlotMap::end_to_end(trained.collect::<Vec<_>>());
    let (weights, len) = SlotMap::end_to_end(weights);
    let (words, packed) = SlotMap::end_to_end(words);
    SlotMap { weights, words, grads, len, packed, train_len }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translation_stays_inside_a_piece_and_complement_cuts_the_holes() {
        let map = map_of(vec![0..10, 20..30], complement(5..9, &[]), 8);
        assert_eq!((map.len, map.packed, map.train_len), (20, 4, 12));
        assert_eq!(map.grad(&(13..16)), 3..6, "weights 21..24: trained 13..16");
        assert_eq!(map.weight(&(22..25)), 12..15);
        assert_eq!(map.weight(&(0..10)), 0..10);
        assert_eq!(map.word(&(6..8)), 1..3);
        assert!(std::panic::catch_unwind(|| map.weight(&(8..12))).is_err(), "straddles a hole");
        let hole = [10..20, 30..30];
        assert_eq!(complement(0..30, &hole), vec![0..10, 20..30]);
        assert_eq!(complement(0..30, &[0..10, 10..30]), vec![0..0, 10..10, 30..30]);
    }
}
