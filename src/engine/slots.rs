//! What a weight slot holds, region by region: the one description of where each part of an
//! upload comes from, for full fine-tuning and for adapters alike. An upload, a stage's
//! rounding and an evaluation's upload are each one loop over a slot's regions; nothing else
//! branches on whether the base is frozen.
//!
//! | slot holds | full fine-tuning | adapter run (frozen base) |
//! |---|---|---|
//! | layer `i` | its trained weights | the frozen weights (bf16 or fp32), the adapters (trained), the packed NF4 words |
//! | the head (rows `r` of it) | the final norm, rows `r` of the head (both trained) | the same, frozen |
//!
//! A slot's trained regions are what a stage holds (`WeightPath::Staged`), one after the other
//! in the slot's order.

use std::ops::Range;

use crate::engine::chunking::Chunking;
use crate::engine::head_tiles::HeadTiling;
use crate::engine::plan::{ParamBuf, SlotContent};
use crate::model::chunks::SlotMap;
use crate::model::layout::ModelLayout;

/// A frozen base tensor a slot region copies from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrozenTensor {
    /// Layer `i`'s frozen weights.
    Layer(usize),
    FinalNorm,
    /// The LM head (the embedding when tied).
    Head,
}

/// Where a region of a weight slot comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Weights `range` of the trained host buffer `buf` (its masters, its bf16 image, or the
    /// slot's stage).
    Trained { buf: ParamBuf, range: Range<usize> },
    /// Weights `range` of a frozen base tensor, in the base's dtype.
    Frozen { tensor: FrozenTensor, range: Range<usize> },
    /// Words `words` of layer `layer`'s packed NF4 words, into the slot's words region (after
    /// its first `slot_weights` weights; the region's `at` counts words from there).
    Packed { layer: usize, words: Range<usize>, slot_weights: usize },
}

/// One region of a slot: its source, landing at weight `at` of the slot (a packed region at
/// word `at` of the slot's words region, after its weights).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    pub at: usize,
    pub src: Source,
}

impl Region {
    /// The trained weights it carries (0 for frozen and packed regions).
    pub fn trained_len(&self) -> usize {
        match &self.src {
            Source::Trained { range, .. } => range.len(),
            _ => 0,
        }
    }
}

/// The regions of everything a slot can hold in one engine: each layer, and the head whole or
/// in its vocabulary tiles.
#[derive(Clone, Debug)]
pub struct SlotRegions {
    layers: Vec<Vec<Region>>,
    /// One list per head tile (one for a whole head).
    head: Vec<Vec<Region>>,
    /// Per layer, one list per chunk of its experts (none for a layer held whole).
    experts: Vec<Vec<Vec<Region>>>,
}

impl SlotRegions {
    /// The regions of `layout`'s slots, the head in `tiling`'s tiles, its trained weights in
    /// `head_buf` (the embedding when tied).
    pub fn new(
        layout: &ModelLayout,
        head_buf: ParamBuf,
        tiling: &HeadTiling,
        chunking: &Chunking,
    ) -> Self {
        let l = layout.dims.layers;
        let layers = (0..l)
            .map(|i| match chunking.trunk(i) {
                Some(map) => mapped_regions(layout, i, map),
                None => layer_regions(layout, i),
            })
            .collect();
        let experts = (0..l)
            .map(|i| {
                let chunks = chunking.split(i).map_or(&[][..], |s| &s.chunks[..]);
                chunks.iter().map(|map| mapped_regions(layout, i, map)).collect()
            })
            .collect();
        let head =
            (0..tiling.tiles()).map(|k| head_regions(layout, head_buf, tiling.range(k))).collect();
        SlotRegions { layers, head, experts }
    }

    /// What a slot holding `what` receives, in upload order.
    pub fn of(&self, what: SlotContent) -> &[Region] {
        match what {
            SlotContent::Layer(i) => &self.layers[i],
            SlotContent::Head => &self.head[0],
            SlotContent::HeadTile(k) => &self.head[k],
            SlotContent::Experts { layer, chunk } => &self.experts[layer][chunk],
        }
    }
}

/// Part of layer `i` (a chunked layer's trunk or expert chunk) laid out by `map`: each piece of
/// its weights from the frozen base or the trained buffer (a piece is cut where the frozen part
/// ends), each piece of its packed words as it is.
fn mapped_regions(layout: &ModelLayout, i: usize, map: &SlotMap) -> Vec<Region> {
    let frozen = layout.layer(i).frozen;
    let mut out = Vec::new();
    for (r, at) in &map.weights {
        let cut = frozen.clamp(r.start, r.end);
        if cut > r.start {
            let src = Source::Frozen { tensor: FrozenTensor::Layer(i), range: r.start..cut };
            out.push(Region { at: *at, src });
        }
        if r.end > cut {
            let range = cut - frozen..r.end - frozen;
            let src = Source::Trained { buf: ParamBuf::Layer(i), range };
            out.push(Region { at: at + (cut - r.start), src });
        }
    }
    for (r, at) in &map.words {
        let src = Source::Packed { layer: i, words: r.clone(), slot_weights: map.len };
        out.push(Region { at: *at, src });
    }
    out
}

/// Layer `i`: in full fine-tuning its trained weights; with adapters the frozen part, then the
/// adapters, then the packed words.
fn layer_regions(layout: &ModelLayout, i: usize) -> Vec<Region> {
    let spec = layout.layer(i);
    let trained = Source::Trained { buf: ParamBuf::Layer(i), range: 0..spec.train_len() };
    if layout.trains_base() {
        return vec![Region { at: 0, src: trained }];
    }
    let mut out = vec![
        Region {
            at: 0,
            src: Source::Frozen { tensor: FrozenTensor::Layer(i), range: 0..spec.frozen },
        },
        Region { at: spec.frozen, src: trained },
    ];
    if spec.packed > 0 {
        let src = Source::Packed { layer: i, words: 0..spec.packed, slot_weights: spec.len };
        out.push(Region { at: 0, src });
    }
    out
}

/// The final norm, then vocabulary rows `rows` of the head: trained in full fine-tuning, the
/// frozen base's in an adapter run.
fn head_regions(layout: &ModelLayout, head_buf: ParamBuf, rows: Range<usize>) -> Vec<Region> {
    let c = layout.dims.c;
    let range = rows.start * c..rows.end * c;
    let (norm, head) = match layout.trains_base() {
        true => (
            Source::Trained { buf: ParamBuf::FinalNorm, range: 0..c },
            Source::Trained { buf: head_buf, range },
        ),
        false => (
            Source::Frozen { tensor: FrozenTensor::FinalNorm, range: 0..c },
            Source::Frozen { tensor: FrozenTensor::Head, range },
        ),
    };
    vec![Region { at: 0, src: norm }, Region { at: c, src: head }]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::{BaseDtype, LoraSpec};

    /// Full fine-tuning uploads only trained weights; an adapter run's layer is its frozen part,
    /// its adapters right after, and (QLoRA) its packed words; its head is wholly frozen. The
    /// trained regions of a slot are what its stage holds.
    #[test]
    fn a_slot_is_trained_weights_in_full_fine_tuning_and_mostly_frozen_with_adapters() {
        let full = crate::model::families::fixture_layout();
        let tiling = HeadTiling::new(&full, Some(100));
        let r = SlotRegions::new(&full, ParamBuf::Head, &tiling, &Chunking::default());
        let l0 = full.layer(0).len;
        assert_eq!(
            r.of(SlotContent::Layer(0)),
            [Region { at: 0, src: Source::Trained { buf: ParamBuf::Layer(0), range: 0..l0 } }]
        );
        let c = full.dims.c;
        let tile1 = r.of(SlotContent::HeadTile(1));
        assert_eq!(tile1[1].src, Source::Trained { buf: ParamBuf::Head, range: 100 * c..200 * c });
        assert_eq!(tile1.iter().map(Region::trained_len).sum::<usize>(), c + 100 * c);

        let targets = vec!["q_proj".to_string(), "down_proj".to_string()];
        let lora = LoraSpec {
            r: 2,
            scale: 1.0,
            targets,
            nf4: true,
            base: BaseDtype::Bf16,
            experts: Default::default(),
        };
        let adapted = full.with_lora(&lora).unwrap();
        let r = SlotRegions::new(&adapted, ParamBuf::Head, &tiling, &Chunking::default());
        let spec = adapted.layer(0);
        let layer = r.of(SlotContent::Layer(0));
        assert_eq!(layer.len(), 3, "frozen, adapters, packed words");
        assert_eq!(
            layer[1],
            Region {
                at: spec.frozen,
                src: Source::Trained { buf: ParamBuf::Layer(0), range: 0..spec.train_len() }
            }
        );
        let words = 0..spec.packed;
        assert_eq!(layer[2].src, Source::Packed { layer: 0, words, slot_weights: spec.len });
        assert!(r.of(SlotContent::HeadTile(0)).iter().all(|g| g.trained_len() == 0));
    }
}
