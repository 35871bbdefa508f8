//! The LM head in vocabulary tiles, for a head too large for a weight slot (which holds the
//! largest decoder layer): how the vocabulary is cut ([`HeadTiling`]), and the three passes the
//! engine runs per micro-batch, each on a chunk of rows at a time.
//!
//! Data flow, micro-batch of N rows, tiles W_k (VT_k, C) of the head W (V, C):
//! ```text
//! pass 1, tile k:  [k = 0: x -> rmsnorm -> hf, rstd]  per chunk: logits = hf W_kᵀ -> stats (m, s, t)
//! pass 2, tile k:  per chunk: logits = hf W_kᵀ -> dlogits (in place, from the complete stats)
//!                  dhf (=, first tile of the pass; else +=) dlogits W_k,  dW_k += dlogitsᵀ hf
//! finish:          losses = m + ln s - t;  dres = rmsnorm backward(dhf),  dnorm_w +=
//! ```
//! The (N, V) logits never exist, nor does a head-sized device buffer.

use std::ops::Range;

use horizon_backend::{Backend, DeviceSlice, Dinp, NormDims};

use crate::model::layout::ModelLayout;

/// Values per row of the softmax statistics (`cross_entropy_tile_stats`).
pub const STATS: usize = 3;

/// How the LM head's vocabulary is cut into tiles of `rows` rows (the last one ragged).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadTiling {
    /// Vocabulary rows of a tile.
    pub rows: usize,
    /// V.
    pub vocab: usize,
}

/// Tiles the head does not fit in one slot are cut to a multiple of this many vocabulary rows
/// (where the slot holds that many), so that every product and kernel of a tile but the
/// last (and that one too where V is a multiple of it, as vocabularies mostly are) has rows
/// and leading dimensions that GEMM libraries tile whole and align: a tile's logits are
/// (chunk, VT) with VT their leading dimension. On an H200 the 7B head's 65,026-row tiles
/// ran their ops at 0.36-0.40 of their projection while a 50,688-row tile timed alone ran at
/// it (`examples/cuda_op_speed` now times both beside this rounding's 65,024).
pub const TILE_ROW_MULTIPLE: usize = 128;

impl HeadTiling {
    /// As many rows as fit in a weight slot (the largest layer) beside the final norm,
    /// `(largest layer - C) / C`, at least 1 and at most V, rounded down to a multiple of
    /// [`TILE_ROW_MULTIPLE`] where the head is cut in tiles and the slot holds that many;
    /// `rows` (`engine.head_tile_rows`) can only make tiles smaller.
    pub fn new(layout: &ModelLayout, rows: Option<usize>) -> Self {
        Self::for_slot(layout, layout.max_layer_len(), rows)
    }

    /// [`HeadTiling::new`] for a slot of `slot` weights (a quantised layer's slot also holds
    /// its packed words).
    pub fn for_slot(layout: &ModelLayout, slot: usize, rows: Option<usize>) -> Self {
        let (c, v) = (layout.dims.c, layout.dims.v);
        let mut fit = (slot.saturating_sub(c) / c.max(1)).clamp(1, v.max(1));
        if fit < v && fit >= TILE_ROW_MULTIPLE {
            fit -= fit % TILE_ROW_MULTIPLE;
        }
        HeadTiling { rows: rows.map_or(fit, |r| r.clamp(1, fit)), vocab: v }
    }

    /// Number of tiles: `ceil(V / rows)`.
    pub fn tiles(&self) -> usize {
        self.vocab.div_ceil(self.rows)
    }

    /// The whole head fits in one slot: the engine applies it in one pass (`OpKind::Head`).
    pub fn is_whole(&self) -> bool {
        self.tiles() == 1
    }

    /// The vocabulary ids of tile `k`.
    pub fn range(&self, k: usize) -> Range<usize> {
        let v0 = k * self.rows;
        v0..(v0 + self.rows).min(self.vocab)
    }
}

/// Sizes of one tile pass over one micro-batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileDims<'a> {
    /// Rows of the micro-batch.
    pub n: usize,
    /// Rows per chunk.
    pub chunk: usize,
    /// The tile's first vocabulary id.
    pub v0: usize,
    /// The tile's vocabulary rows VT.
    pub vt: usize,
    /// The final norm: width C, eps, weight offset.
    pub norm: NormDims,
    /// 1 / (loss-carrying positions of the whole batch).
    pub scale: f32,
    /// `Some((t, s))`: sequence `i` (positions `[i*t, (i+1)*t)`) scales its gradient by `s[i]`
    /// instead (DPO); chunks then stop at sequence ends.
    pub row_scales: Option<(usize, &'a [f32])>,
}

impl TileDims<'_> {
    /// The chunks of positions, each `r0..r1`, and the gradient scale of each.
    fn chunks(&self) -> impl Iterator<Item = (Range<usize>, f32)> + '_ {
        let mut r0 = 0;
        std::iter::from_fn(move || {
            if r0 >= self.n {
                return None;
            }
            let (end, scale) = match self.row_scales {
                None => ((r0 + self.chunk).min(self.n), self.scale),
                Some((t, s)) => ((r0 + self.chunk).min((r0 / t + 1) * t), s[r0 / t]),
            };
            let r = r0..end;
            r0 = end;
            Some((r, scale))
        })
    }
}

/// One micro-batch's buffers that live across the passes.
pub(crate) struct TileRows<'a, B: Backend + ?Sized> {
    /// (N, C) final norm output.
    pub hf: &'a mut B::Buf,
    /// (N) final norm rstd.
    pub rstd: &'a mut B::Buf,
    /// (N, 3) softmax statistics.
    pub stats: &'a mut B::Buf,
    /// (N, C) the gradient of `hf`.
    pub dhf: &'a mut B::Buf,
}

/// Pass 1 on tile `td.v0 .. td.v0 + td.vt`: (tile 0, `x` given) the final norm of `x` into `hf`, `rstd`;
/// then per chunk the tile's logits into `logits` (chunk, VT) and the statistics updated
/// (overwritten on tile 0).
/// x: (N, C). norm_w: (C). tile_w: (VT, C). targets: (N).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile_stats<B: Backend>(
    be: &B,
    rows: &mut TileRows<'_, B>,
    logits: &mut B::Buf,
    x: Option<&B::Buf>,
    norm_w: &B::WBuf,
    tile_w: &B::WBuf,
    targets: &B::IBuf,
    td: TileDims,
) {
    let (c, n, vt, v0) = (td.norm.c, td.n, td.vt, td.v0);
    let first = x.is_some();
    if let Some(x) = x {
        let (hf, rstd) = (rows.hf.slice_mut(0..n * c), rows.rstd.slice_mut(0..n));
        be.rmsnorm_forward(hf, rstd, x, norm_w, td.norm);
    }
    for (r, _) in td.chunks() {
        let k = r.len();
        let l = logits.slice_mut(0..k * vt);
        be.matmul_forward(l, rows.hf.slice(r.start * c..r.end * c), tile_w, None, k, c, vt);
        be.cross_entropy_tile_stats(
            rows.stats.slice_mut(r.start * STATS..r.end * STATS),
            logits.slice(0..k * vt),
            targets.slice(r.clone()),
            k,
            vt,
            v0,
            first,
        );
    }
}

/// Pass 2 on tile `td.v0 .. td.v0 + td.vt`, per chunk: the logits again, turned into dlogits in place; `dhf`
/// of the chunk's rows overwritten (`first`) or added to through `dhf_chunk` (chunk, C) (the
/// product's `dinp` overwrites); `dtile_w` (VT, C) accumulates (+=) dlogitsᵀ hf (`None`: the
/// head is frozen).
/// tile_w: (VT, C). targets: (N).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile_grad<B: Backend>(
    be: &B,
    rows: &mut TileRows<'_, B>,
    logits: &mut B::Buf,
    dhf_chunk: &mut B::Buf,
    mut dtile_w: Option<&mut B::Buf>,
    tile_w: &B::WBuf,
    targets: &B::IBuf,
    first: bool,
    td: TileDims,
) {
    let (c, vt, v0) = (td.norm.c, td.vt, td.v0);
    for (r, scale) in td.chunks() {
        let (k, cr) = (r.len(), r.start * c..r.end * c);
        let hf = rows.hf.slice(cr.clone());
        be.matmul_forward(logits.slice_mut(0..k * vt), hf, tile_w, None, k, c, vt);
        be.cross_entropy_tile_grad(
            logits.slice_mut(0..k * vt),
            rows.stats.slice(r.start * STATS..r.end * STATS),
            targets.slice(r.clone()),
            k,
            vt,
            v0,
            scale,
        );
        let dl = logits.slice(0..k * vt);
        if first {
            let dhf = rows.dhf.slice_mut(cr);
            let dw = dtile_w.as_deref_mut();
            be.matmul_backward(Some(Dinp::Write(dhf)), dw, None, dl, hf, tile_w, k, c, vt);
        } else {
            let scratch = dhf_chunk.slice_mut(0..k * c);
            let (dw, dx) = (dtile_w.as_deref_mut(), Dinp::Write(scratch));
            be.matmul_backward(Some(dx), dw, None, dl, hf, tile_w, k, c, vt);
            be.add_inplace(rows.dhf.slice_mut(cr), dhf_chunk.slice(0..k * c));
        }
    }
}

/// After the last tile: the losses (N) from the statistics (overwrites), and the final norm's
/// backward: `dres` (N, C) overwritten, `dnorm_w` (C) accumulates (+=).
/// x: (N, C), the norm's input. norm_w: (C). targets: (N).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile_finish<B: Backend>(
    be: &B,
    rows: &TileRows<'_, B>,
    losses: &mut B::Buf,
    dres: &mut B::Buf,
    dnorm_w: Option<&mut B::Buf>,
    x: &B::Buf,
    norm_w: &B::WBuf,
    targets: &B::IBuf,
    n: usize,
    norm: NormDims,
) {
    let nc = n * norm.c;
    be.cross_entropy_tile_loss(losses, rows.stats.slice(0..n * STATS), targets, n);
    be.zero(&mut *dres);
    let (dhf, rstd) = (rows.dhf.slice(0..nc), rows.rstd.slice(0..n));
    be.rmsnorm_backward(dres, dnorm_w, dhf, x, norm_w, rstd, norm);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(layers_big: bool) -> ModelLayout {
        let cfg = serde_json::json!({"model_type": "llama", "hidden_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": if layers_big { 64 } else { 8 }, "vocab_size": 100});
        crate::model::describe(&crate::hf::config::ModelConfig::from_json(&cfg, "test").unwrap())
    }

    #[test]
    fn tiles_fill_the_slot_and_only_shrink() {
        let l = layout(false);
        let fit = (l.max_layer_len() - 8) / 8;
        assert!(fit < 100, "the head must not fit: {fit}");
        let t = HeadTiling::new(&l, None);
        assert_eq!((t.rows, t.tiles()), (fit, 100usize.div_ceil(fit)));
        assert!(8 + t.rows * 8 <= l.max_layer_len());
        assert_eq!(HeadTiling::new(&l, Some(37)).tiles(), 3);
        assert_eq!(HeadTiling::new(&l, Some(37)).range(2), 74..100);
        assert_eq!(HeadTiling::new(&l, Some(10_000)).rows, fit, "never larger than the slot");
        assert_eq!(HeadTiling::new(&l, Some(0)).rows, 1);
        let big = layout(true);
        assert!(big.max_layer_len() >= 8 + 100 * 8);
        assert!(HeadTiling::new(&big, None).is_whole());
        assert!(!HeadTiling::new(&big, Some(99)).is_whole());
    }

    /// Qwen2.5-7B's head (152,064 rows) beside its largest layer (233,057,792 weights): 65,026
    /// rows would fit a slot, and tiles are cut at 65,024 (508 x 128), the last 22,016 (172 x
    /// 128); a head that fits whole stays whole, and a slot under 128 rows is not rounded.
    #[test]
    fn tiles_are_cut_at_a_multiple_of_128_rows() {
        let cfg = serde_json::json!({"model_type": "qwen2", "hidden_size": 3584,
            "num_hidden_layers": 1, "num_attention_heads": 28, "num_key_value_heads": 4,
            "intermediate_size": 18944, "vocab_size": 152064});
        let l =
            crate::model::describe(&crate::hf::config::ModelConfig::from_json(&cfg, "q").unwrap());
        assert_eq!(l.max_layer_len(), 233_057_792);
        let t = HeadTiling::new(&l, None);
        assert_eq!((t.rows, t.tiles(), t.range(2)), (65_024, 3, 130_048..152_064));
        assert_eq!(HeadTiling::new(&l, Some(65_025)).rows, 65_024, "never above the cut");
        assert_eq!(HeadTiling::new(&l, Some(1000)).rows, 1000, "asked rows stay as asked");
        let whole = HeadTiling::for_slot(&l, 3584 * 152_064 + 3584, None);
        assert!(whole.is_whole(), "{}", whole.rows);
        let small = HeadTiling::for_slot(&l, 3584 * 101, None);
        assert_eq!(small.rows, 100);
    }
}
