//! Column slices of row-major matrices on the CPU: LoRA's per-target update of a fused
//! `q|k|v` or `gate|up` output (`add_cols`) and the gradient slice a target sees
//! (`scaled_cols`). Neither has a backward of its own: each is the other's transpose
//! (`add_cols`' gradient w.r.t. `src` is `scaled_cols` of `dout` with the same scale).
//!
//! Data flow: src (N, w) -> scale -> columns col..col+w of out (N, out_w).

use rayon::prelude::*;

/// `out[r*out_w + col + j] += scale * src[r*w + j]` for `r < n`, `j < w`.
///
/// out: (N, out_w), accumulates (+=) into columns `col..col + w`; the rest untouched.
/// src: (N, w).
pub fn add_cols(
    out: &mut [f32],
    src: &[f32],
    n: usize,
    out_w: usize,
    col: usize,
    w: usize,
    scale: f32,
) {
    assert!(col + w <= out_w, "add_cols: columns {col}..{} outside a row of {out_w}", col + w);
    assert_eq!(out.len(), n * out_w, "add_cols: out must be (N, out_w)");
    assert_eq!(src.len(), n * w, "add_cols: src must be (N, w)");
    if n == 0 || w == 0 {
        return;
    }
    out.par_chunks_mut(out_w).zip(src.par_chunks(w)).for_each(|(o, s)| {
        for (o, s) in o[col..col + w].iter_mut().zip(s) {
            *o += scale * s;
        }
    });
}

/// `out[r*w + j] = scale * src[r*src_w + col + j]` for `r < n`, `j < w`.
///
/// out: (N, w), overwrites.
/// src: (N, src_w).
pub fn scaled_cols(
    out: &mut [f32],
    src: &[f32],
    n: usize,
    src_w: usize,
    col: usize,
    w: usize,
    scale: f32,
) {
    assert!(col + w <= src_w, "scaled_cols: columns {col}..{} outside a row of {src_w}", col + w);
    assert_eq!(out.len(), n * w, "scaled_cols: out must be (N, w)");
    assert_eq!(src.len(), n * src_w, "scaled_cols: src must be (N, src_w)");
    if n == 0 || w == 0 {
        return;
    }
    out.par_chunks_mut(w).zip(src.par_chunks(src_w)).for_each(|(o, s)| {
        for (o, s) in o.iter_mut().zip(&s[col..col + w]) {
            *o = scale * s;
        }
    });
}
