//! A sparse layer whose experts stream through the device in chunks (issue 44): the layer's
//! weights split into its *trunk* (everything but the routed experts: norms, attention, router,
//! shared expert, adapters) and chunks of whole experts, each held by a slot of its own. A
//! [`SlotMap`] says where each piece of the layer's slot (its weights) and of its packed NF4
//! words lands in the slot that holds it; the layer ops address weights as the layer's
//! description lays them out and translate through the map, so one description runs whole or
//! chunked.
//!
//! Only frozen experts are chunked (an adapter run without expert adapters: LoRA or QLoRA on
//! the attention, router or shared expert); trained experts keep the whole layer in a slot.

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

/// A sparse layer's expert storage: per expert its gate|up and down pieces, in the slot
/// (`words: false`) or in the packed words.
struct ExpertPieces {
    words: bool,
    gate_up: Vec<Range<usize>>,
    down: Vec<Range<usize>>,
}

/// The pieces of `spec`'s routed experts, when it has them and they are frozen without
/// adapters (the only experts that are chunked).
fn expert_pieces(spec: &LayerSpec) -> Option<ExpertPieces> {
    let op = spec.ops.iter().find(|op| matches!(op, Op::Experts { .. }))?;
    let Op::Experts { ref gate_up, ref down, e, i, c, ref lora, ref packed, .. } = *op else {
        unreachable!()
    };
    if lora.gate_up.is_some() || lora.down.is_some() {
        return None;
    }
    if let Some(w) = packed {
        let span = |w: &Weight| match w {
            Weight::Packed(parts) => parts[0].words.start..parts[parts.len() - 1].words.end,
            Weight::Slot(_) => unreachable!("packed experts are NF4"),
        };
        let gate_up = w.iter().map(|x| span(&x[0])).collect();
        let down = w.iter().map(|x| span(&x[1])).collect();
        return Some(ExpertPieces { words: true, gate_up, down });
    }
    if gate_up.end > spec.frozen || down.end > spec.frozen {
        return None; // trained experts (full fine-tuning)
    }
    let per = |r: &Range<usize>, len: usize| {
        let s = r.start;
        (0..e).map(move |x| s + x * len..s + (x + 1) * len)
    };
    Some(ExpertPieces {
        words: false,
        gate_up: per(gate_up, 2 * i * c).collect(),
        down: per(down, c * i).collect(),
    })
}

/// The union of contiguous `ranges` (each starting where the one before ends).
fn joined(ranges: &[Range<usize>]) -> Range<usize> {
    debug_assert!(
        ranges.windows(2).all(|w| w[0].end == w[1].start),
        "expert pieces are contiguous"
    );
    ranges[0].start..ranges[ranges.len() - 1].end
}

impl ExpertSplit {
    /// `spec`'s experts in chunks of `per_chunk`; `None` for a layer without frozen experts.
    pub fn new(spec: &LayerSpec, per_chunk: usize) -> Option<Self> {
        assert!(per_chunk > 0, "a chunk holds at least one expert");
        let p = expert_pieces(spec)?;
        let e = p.gate_up.len();
        let holes = {
            let mut h = vec![joined(&p.gate_up), joined(&p.down)];
            h.sort_by_key(|r| r.start);
            h
        };
        let (tw, tp) = match p.words {
            true => (complement(0..spec.len, &[]), complement(0..spec.packed, &holes)),
            false => (complement(0..spec.len, &holes), complement(0..spec.packed, &[])),
        };
        let trunk = map_of(tw, tp);
        let chunks = (0..e.div_ceil(per_chunk))
            .map(|k| {
                let xs = k * per_chunk..((k + 1) * per_chunk).min(e);
                let parts = vec![joined(&p.gate_up[xs.clone()]), joined(&p.down[xs])];
                match p.words {
                    true => map_of(vec![], parts),
                    false => map_of(parts, vec![]),
                }
            })
            .collect();
        Some(ExpertSplit { per_chunk, experts: e, trunk, chunks })
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

fn map_of(weights: Vec<Range<usize>>, words: Vec<Range<usize>>) -> SlotMap {
    let (weights, len) = SlotMap::end_to_end(weights);
    let (words, packed) = SlotMap::end_to_end(words);
    SlotMap { weights, words, len, packed }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translation_stays_inside_a_piece_and_complement_cuts_the_holes() {
        let map = map_of(vec![0..10, 20..30], complement(5..9, &[]));
        assert_eq!((map.len, map.packed), (20, 4));
        assert_eq!(map.weight(&(22..25)), 12..15);
        assert_eq!(map.weight(&(0..10)), 0..10);
        assert_eq!(map.word(&(6..8)), 1..3);
        assert!(std::panic::catch_unwind(|| map.weight(&(8..12))).is_err(), "straddles a hole");
        let hole = [10..20, 30..30];
        assert_eq!(complement(0..30, &hole), vec![0..10, 20..30]);
        assert_eq!(complement(0..30, &[0..10, 10..30]), vec![0..0, 10..10, 30..30]);
    }
}
