//! Launchers of `kernels/cols.cu`: a column slice of a wider output accumulates a scaled narrow
//! one (`add_cols`), and a scaled copy of a column slice (`scaled_cols`). Reference:
//! `cpu/cols.rs`.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len};
use super::slice::DevSlice;

/// The one launch both ops make: `kernel(out, src, n, wide, col, w, scale)` over the (N, w)
/// slice, one thread per element.
#[allow(clippy::too_many_arguments)]
fn launch_cols(
    be: &CudaBackend,
    kernel: &'static str,
    out: &mut DevSlice<f32>,
    src: &DevSlice<f32>,
    (n, wide, col, w): (usize, usize, usize, usize),
    scale: f32,
) {
    assert!(col + w <= wide, "{kernel}: columns {col}..{} outside a row of {wide}", col + w);
    if n == 0 || w == 0 {
        return;
    }
    let (o, s) = (out.addr(), src.addr());
    let (nn, ww, cc, w_) = (n as i64, wide as i64, col as i64, w as i64);
    // SAFETY: argument types match (two pointers, four long longs, a float); one thread per
    // element of the (N, w) slice, every index inside the (N, wide) and (N, w) buffers whose
    // lengths the callers checked.
    unsafe {
        be.launch(
            kernel,
            (blocks(n * w, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&s), arg(&nn), arg(&ww), arg(&cc), arg(&w_), arg(&scale)],
        );
    }
}

/// out: (N, out_w), accumulates (+=) into columns `col..col + w`. src: (N, w).
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_cols(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    src: &DevSlice<f32>,
    n: usize,
    out_w: usize,
    col: usize,
    w: usize,
    scale: f32,
) {
    expect_len("add_cols", "out", out.len(), n * out_w);
    expect_len("add_cols", "src", src.len(), n * w);
    launch_cols(be, "add_cols", out, src, (n, out_w, col, w), scale);
}

/// out: (N, w), overwrites. src: (N, src_w); columns `col..col + w` are read.
#[allow(clippy::too_many_arguments)]
pub(crate) fn scaled_cols(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    src: &DevSlice<f32>,
    n: usize,
    src_w: usize,
    col: usize,
    w: usize,
    scale: f32,
) {
    expect_len("scaled_cols", "out", out.len(), n * w);
    expect_len("scaled_cols", "src", src.len(), n * src_w);
    launch_cols(be, "scaled_cols", out, src, (n, src_w, col, w), scale);
}
