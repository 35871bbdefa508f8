//! Launcher of `kernels/rope.cu` (forward: sign +1; backward, the inverse rotation: sign -1).
//! Derivation: `cpu/rope.rs`.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len, int};
use super::slice::DevSlice;
use crate::AttnDims;

/// qkv: (N, QKV), in place on the q and k heads. cos, sin: (T, D/2).
pub(crate) fn rope_rotate(
    be: &CudaBackend,
    op: &str,
    qkv: &mut DevSlice<f32>,
    cos: &DevSlice<f32>,
    sin: &DevSlice<f32>,
    dims: AttnDims,
    sign: f32,
) {
    assert!(dims.d.is_multiple_of(2), "{op}: head dim D = {} must be even", dims.d);
    let (width, half) = (dims.qkv_width(), dims.d / 2);
    expect_len(op, "qkv", qkv.len(), dims.n() * width);
    expect_len(op, "cos", cos.len(), dims.t * half);
    expect_len(op, "sin", sin.len(), dims.t * half);
    let heads = dims.h + dims.kvh;
    let total = dims.n() * heads * half;
    let (x, c, s) = (qkv.addr(), cos.addr(), sin.addr());
    let (n, t, hh, d, w) = (
        int(dims.n(), "N"),
        int(dims.t, "T"),
        int(heads, "H+KVH"),
        int(dims.d, "D"),
        int(width, "QKV"),
    );
    // SAFETY: argument types match; one thread per (row, rotated head, pair) inside qkv, the
    // tables are (T, D/2).
    unsafe {
        be.launch(
            "rope_rotate",
            (blocks(total, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [
                arg(&x),
                arg(&c),
                arg(&s),
                arg(&n),
                arg(&t),
                arg(&hh),
                arg(&d),
                arg(&w),
                arg(&sign),
            ],
        );
    }
}
