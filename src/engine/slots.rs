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

use crate::engine::head_tiles::HeadTiling;
use crate::engine::plan::{ParamBuf, SlotContent};
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
    /// Layer `layer`'s packed NF4 words, after the slot's weights.
    Packed { layer: usize },
}

/// One region of a slot: its source, landing at weight `at` of the slot (a packed region lands
/// after the layer's weights, wherever its description puts it).
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
}

impl SlotRegions {
    /// The regions of `layout`'s slots, the head in `tiling`'s tiles, its trained weights in
    /// `head_buf` (the embedding when tied).
    pub fn new(layout: &ModelLayout, head_buf: ParamBuf, tiling: &HeadTiling) -> Self {
        let layers = (0..layout.dims.layers).map(|i| layer_regions(layout, i)).collect();
        let head =
            (0..tiling.tiles()).map(|k| head_regions(layout, head_buf, tiling.range(k))).collect();
        SlotRegions { layers, head }
    }

    /// What a slot holding `what` receives, in upload order.
    pub fn of(&self, what: SlotContent) -> &[Region] {
        match what {
            SlotContent::Layer(i) => &self.layers[i],
            SlotContent::Head => &self.head[0],
            SlotContent::HeadTile(k) => &self.head[k],
        }
    }
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
        out.push(Region { at: spec.len, src: Source::Packed { layer: i } });
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
        let r = SlotRegions::new(&full, ParamBuf::Head, &tiling);
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
        let r = SlotRegions::new(&adapted, ParamBuf::Head, &tiling);
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
        assert_eq!(layer[2].src, Source::Packed { layer: 0 });
        assert!(r.of(SlotContent::HeadTile(0)).iter().all(|g| g.trained_len() == 0));
    }
}
