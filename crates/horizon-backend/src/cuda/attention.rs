//! Launchers of `kernels/attention.cu`: causal GQA attention within an optional sliding
//! window, with the scores' scale an argument, flash style (the (T x T) scores never exist in
//! global memory), forward and backward (dq, then dk and dv). Derivation: `cpu/attention.rs`.

use super::CudaBackend;
use super::backend::{arg, expect_len, int};
use super::config::MAX_HEAD_DIM;
use super::slice::DevSlice;
use crate::AttnDims;

/// Rows (warps) per block and rows per shared tile; must match the kernel's ROWS and TILE.
pub(super) const ROWS: usize = 8;
pub(super) const TILE: usize = 32;

pub(super) fn check_dims(op: &str, dims: AttnDims) {
    assert!(
        dims.d > 0 && dims.d <= MAX_HEAD_DIM,
        "{op}: head dim D = {} is outside 1..={MAX_HEAD_DIM}, which the CUDA kernels support",
        dims.d
    );
    assert!(
        dims.kvh > 0 && dims.h.is_multiple_of(dims.kvh),
        "{op}: H = {} is not a multiple of KVH = {}",
        dims.h,
        dims.kvh
    );
}

/// The kernels' `window` and `scale` arguments. A window of at least T hides no key: it is
/// passed as 0 (full causal), which also keeps any `usize` window inside the kernels' int.
pub(super) fn window_scale(dims: AttnDims) -> (i32, f32) {
    let w = if dims.window >= dims.t { 0 } else { dims.window };
    (int(w, "window"), dims.scale)
}

/// Dynamic shared memory of a kernel, allowed above 48 KiB where needed.
pub(super) fn shared(be: &CudaBackend, name: &str, floats: usize) -> u32 {
    let bytes = (floats * 4) as u32;
    if bytes > 48 * 1024 {
        be.allow_shared(name, bytes);
    }
    bytes
}

/// out: (N, H*D), overwrites. lse: (B, H, T), overwrites. qkv: (N, QKV) after rope.
pub(crate) fn attention_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    lse: &mut DevSlice<f32>,
    qkv: &DevSlice<f32>,
    dims: AttnDims,
) {
    check_dims("attention_forward", dims);
    expect_len("attention_forward", "qkv", qkv.len(), dims.n() * dims.qkv_width());
    expect_len("attention_forward", "out", out.len(), dims.n() * dims.h * dims.d);
    expect_len("attention_forward", "lse", lse.len(), dims.b * dims.h * dims.t);
    let smem = shared(be, "attention_forward", 2 * TILE * (dims.d + 1) + ROWS * dims.d);
    let (o, l, x) = (out.addr(), lse.addr(), qkv.addr());
    let (t, h, kvh, d) =
        (int(dims.t, "T"), int(dims.h, "H"), int(dims.kvh, "KVH"), int(dims.d, "D"));
    let (w, scale) = window_scale(dims);
    let mut args =
        [arg(&o), arg(&l), arg(&x), arg(&t), arg(&h), arg(&kvh), arg(&d), arg(&w), arg(&scale)];
    // SAFETY: argument types match (pointers, five ints, one float); the grid covers
    // (T/ROWS, H, B) and every index the kernel forms lies inside the buffers whose lengths are
    // checked above (keys and queries outside the window are never read).
    unsafe {
        be.launch(
            "attention_forward",
            (dims.t.div_ceil(ROWS) as u32, dims.h as u32, dims.b as u32),
            (32 * ROWS as u32, 1, 1),
            smem,
            &mut args,
        );
    }
}

/// dqkv: (N, QKV), overwrites. dout: (N, H*D). qkv, out, lse: as the forward used and made.
pub(crate) fn attention_backward(
    be: &CudaBackend,
    dqkv: &mut DevSlice<f32>,
    dout: &DevSlice<f32>,
    qkv: &DevSlice<f32>,
    out: &DevSlice<f32>,
    lse: &DevSlice<f32>,
    dims: AttnDims,
) {
    check_dims("attention_backward", dims);
    expect_len("attention_backward", "qkv", qkv.len(), dims.n() * dims.qkv_width());
    expect_len("attention_backward", "dqkv", dqkv.len(), dims.n() * dims.qkv_width());
    expect_len("attention_backward", "out", out.len(), dims.n() * dims.h * dims.d);
    expect_len("attention_backward", "dout", dout.len(), dims.n() * dims.h * dims.d);
    expect_len("attention_backward", "lse", lse.len(), dims.b * dims.h * dims.t);
    let (dx, dy, x, o, l) = (dqkv.addr(), dout.addr(), qkv.addr(), out.addr(), lse.addr());
    let (t, h, kvh, d) =
        (int(dims.t, "T"), int(dims.h, "H"), int(dims.kvh, "KVH"), int(dims.d, "D"));
    let rows = dims.t.div_ceil(ROWS) as u32;
    let smem_dq = shared(be, "attention_backward_dq", 2 * TILE * (dims.d + 1) + 2 * ROWS * dims.d);
    let smem_dkv = shared(
        be,
        "attention_backward_dkv",
        2 * TILE * (dims.d + 1) + 2 * ROWS * dims.d + 2 * TILE,
    );
    let (w, scale) = window_scale(dims);
    let mut args = [
        arg(&dx),
        arg(&dy),
        arg(&x),
        arg(&o),
        arg(&l),
        arg(&t),
        arg(&h),
        arg(&kvh),
        arg(&d),
        arg(&w),
        arg(&scale),
    ];
    // SAFETY: argument types match both kernels (pointers, five ints, one float); the dq
    // kernel writes only the q part of each row and the dk/dv kernel only the k and v parts, so
    // together they overwrite dqkv; every index lies inside the buffers whose lengths are
    // checked above.
    unsafe {
        be.launch(
            "attention_backward_dq",
            (rows, dims.h as u32, dims.b as u32),
            (32 * ROWS as u32, 1, 1),
            smem_dq,
            &mut args,
        );
        be.launch(
            "attention_backward_dkv",
            (rows, dims.kvh as u32, dims.b as u32),
            (32 * ROWS as u32, 1, 1),
            smem_dkv,
            &mut args,
        );
    }
}
