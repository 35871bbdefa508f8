//! Launchers of `kernels/attention.cu`: causal GQA attention within an optional sliding
//! window, with the scores' scale an argument, flash style (the (T x T) scores never exist in
//! global memory), forward and backward (the rows' `delta = dout . out`, then dq, then dk and
//! dv). Derivation: `cpu/attention.rs`.
//!
//! Two kernel sets compute the same function in fp32: the tiled kernels (64-row blocks, 4 x 4
//! register tiles, as an SGEMM) where D is a multiple of 4 up to 128 and the buffers are 16-byte
//! aligned (the engine's always are), and the warp-per-row kernels otherwise (any D up to 256,
//! any alignment). On an H200 the warp-per-row kernels ran a Qwen2.5-7B layer's attention at
//! 4.2 TFLOP/s forward and 3.3 backward (`examples/cuda_op_speed`, which times both sets).

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

/// Query rows per block of the tiled forward (its FQ; its key tiles, FK, are as long).
pub(super) const TILED_ROWS: usize = 64;
/// The largest head dim the tiled forward takes (its threads hold 8 output columns each).
pub(super) const TILED_MAX_D: usize = 128;

/// Whether the tiled forward (`attention_forward_tiled`) can run: D a multiple of 4 up to
/// [`TILED_MAX_D`], and every buffer 16-byte aligned (its loads and stores are 16 bytes; the
/// engine's buffers are 64-byte aligned). Otherwise the warp-per-row kernel runs.
fn tiled(dims: AttnDims, addrs: &[u64]) -> bool {
    dims.d.is_multiple_of(4) && dims.d <= TILED_MAX_D && addrs.iter().all(|a| a % 16 == 0)
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
    let (o, l, x) = (out.addr(), lse.addr(), qkv.addr());
    let fast = tiled(dims, &[o, x]);
    let (name, rows, threads, floats) = if fast {
        let f = 3 * TILED_ROWS * dims.d + TILED_ROWS * TILED_ROWS;
        ("attention_forward_tiled", TILED_ROWS, 256, f)
    } else {
        let f = 2 * TILE * (dims.d + 1) + ROWS * dims.d;
        ("attention_forward", ROWS, 32 * ROWS as u32, f)
    };
    let smem = shared(be, name, floats);
    let (t, h, kvh, d) =
        (int(dims.t, "T"), int(dims.h, "H"), int(dims.kvh, "KVH"), int(dims.d, "D"));
    let (w, scale) = window_scale(dims);
    let mut args =
        [arg(&o), arg(&l), arg(&x), arg(&t), arg(&h), arg(&kvh), arg(&d), arg(&w), arg(&scale)];
    // SAFETY: argument types match both kernels (pointers, five ints, one float); the grid
    // covers (T/rows, H, B) and every index the kernel forms lies inside the buffers whose
    // lengths are checked above (keys and queries outside the window are never read); the
    // tiled kernel's 16-byte accesses are aligned (`tiled`).
    unsafe {
        be.launch(
            name,
            (dims.t.div_ceil(rows) as u32, dims.h as u32, dims.b as u32),
            (threads, 1, 1),
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
    // delta (B, H, T) = dout . out per row and head, once, in the products part of the
    // workspace (held to the end: no product can use it while the kernels read it).
    let ws = be.products();
    let delta_bytes = dims.b * dims.h * dims.t * 4;
    assert!(
        ws.0 != 0 && delta_bytes <= ws.1,
        "attention_backward needs {delta_bytes} bytes of workspace for its row sums; the \
         backend has {} (the plan sizes the workspace for the largest product, which is larger)",
        ws.1
    );
    let delta = ws.0;
    let (dx, dy, x, o, l) = (dqkv.addr(), dout.addr(), qkv.addr(), out.addr(), lse.addr());
    let (n, t, h, kvh, d) = (
        int(dims.n(), "N"),
        int(dims.t, "T"),
        int(dims.h, "H"),
        int(dims.kvh, "KVH"),
        int(dims.d, "D"),
    );
    let mut delta_args = [arg(&delta), arg(&dy), arg(&o), arg(&n), arg(&t), arg(&h), arg(&d)];
    // SAFETY: argument types match (three pointers, four ints); one warp per (row, head) of
    // dout and out (N, H*D), writing delta (B, H, T), which fits the workspace (checked above).
    unsafe {
        be.launch(
            "attention_delta",
            ((dims.n() * dims.h).div_ceil(ROWS) as u32, 1, 1),
            (32 * ROWS as u32, 1, 1),
            0,
            &mut delta_args,
        );
    }
    let fast = tiled(dims, &[dx, dy, x, o]);
    let (dq_name, dkv_name, rows, threads) = if fast {
        ("attention_backward_dq_tiled", "attention_backward_dkv_tiled", TILED_ROWS, 256)
    } else {
        ("attention_backward_dq", "attention_backward_dkv", ROWS, 32 * ROWS as u32)
    };
    let (dq_floats, dkv_floats) = if fast {
        let (tile, stats) = (TILED_ROWS * dims.d, TILED_ROWS * TILED_ROWS + 2 * TILED_ROWS);
        (5 * tile + stats, 6 * tile + stats)
    } else {
        let tiles = 2 * TILE * (dims.d + 1) + 2 * ROWS * dims.d;
        (tiles, tiles + 2 * TILE)
    };
    let smem_dq = shared(be, dq_name, dq_floats);
    let smem_dkv = shared(be, dkv_name, dkv_floats);
    let rows = dims.t.div_ceil(rows) as u32;
    let (w, scale) = window_scale(dims);
    let mut args = [
        arg(&dx),
        arg(&dy),
        arg(&x),
        arg(&delta),
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
            dq_name,
            (rows, dims.h as u32, dims.b as u32),
            (threads, 1, 1),
            smem_dq,
            &mut args,
        );
        be.launch(
            dkv_name,
            (rows, dims.kvh as u32, dims.b as u32),
            (threads, 1, 1),
            smem_dkv,
            &mut args,
        );
    }
    drop(ws);
}
