//! Launchers of `kernels/attention.cu`: causal GQA attention within an optional sliding
//! window, with the scores' scale an argument, flash style (the (T x T) scores never exist in
//! global memory), forward and backward (the rows' `delta = dout . out`, then dq, then dk and
//! dv). Derivation: `cpu/attention.rs`.
//!
//! Three kernel sets compute the same function:
//! - on the tensor cores (`kernels/attention_tc.cu`: bf16 operands, fp32 accumulation, as the
//!   backend's products), where the device has bf16 tensor cores (sm_80 and later), D is a
//!   multiple of 16 up to 128, the buffers are 16-byte aligned (the engine's always are) and
//!   [`CudaBackend::set_attention_kernels`] did not ask for fp32: the default for every family
//!   but Gemma (D = 256);
//! - in fp32, tiled (64-row blocks, 4 x 4 register tiles, as an SGEMM) where D is a multiple of
//!   4 up to 128 and the buffers are 16-byte aligned;
//! - in fp32, one warp per row, otherwise (any D up to 256, any alignment).
//!
//! On an H200 the warp-per-row kernels ran a Qwen2.5-7B layer's attention at 4.2 TFLOP/s forward
//! and 3.3 backward, 92% of the layer's time (`examples/cuda_op_speed`, which times every set).

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

/// Dynamic shared memory of a kernel, `bytes`, allowed above 48 KiB where needed.
pub(super) fn shared(be: &CudaBackend, name: &str, bytes: usize) -> u32 {
    let bytes = bytes as u32;
    if bytes > 48 * 1024 {
        be.allow_shared(name, bytes);
    }
    bytes
}

/// Query rows per block of the tiled forward (its FQ; its key tiles, FK, are as long).
pub(super) const TILED_ROWS: usize = 64;
/// The largest head dim the tiled forward takes (its threads hold 8 output columns each).
pub(super) const TILED_MAX_D: usize = 128;

/// Whether the tiled kernels (`attention_forward_tiled`, ...) can run: D a multiple of 4 up to
/// [`TILED_MAX_D`], and every buffer 16-byte aligned (their loads and stores are 16 bytes; the
/// engine's buffers are 64-byte aligned). Otherwise the warp-per-row kernels run.
fn tiled(dims: AttnDims, addrs: &[u64]) -> bool {
    dims.d.is_multiple_of(4) && dims.d <= TILED_MAX_D && addrs.iter().all(|a| a % 16 == 0)
}

/// The kernel sets of `attention.cu` and `attention_tc.cu`, fastest first.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Set {
    /// `*_tc`: wmma on bf16 tensor cores.
    Tensor,
    /// `*_tiled`: fp32 register tiles.
    Tiled,
    /// The warp-per-row kernels.
    Rows,
}

/// Which kernels run `dims` on buffers at `addrs`: the tensor-core ones where the backend
/// allows them and D is a multiple of 16 up to [`TILED_MAX_D`] (16 x 16 fragments; the
/// tensor-core kernels share the tiled ones' alignment and shared-memory bounds), else
/// [`tiled`]'s choice.
fn kernel_set(be: &CudaBackend, dims: AttnDims, addrs: &[u64]) -> Set {
    match tiled(dims, addrs) {
        true if be.tensor_attention() && dims.d.is_multiple_of(16) => Set::Tensor,
        true => Set::Tiled,
        false => Set::Rows,
    }
}

/// Dynamic shared memory of the tensor-core kernels, in bytes, for head dim `d` (their layout
/// in `kernels/attention_tc.cu`): bf16 tiles of 64 x (D + 8), fp32 score tiles of 64 x 68, bf16
/// P and dS tiles of 64 x 72, fp32 accumulators of 64 x (D + 4), and 64-float statistics.
fn tc_shared_bytes(kernel: &str, d: usize) -> usize {
    let rows = TILED_ROWS;
    let (bf16_tile, scores, probs, acc) =
        (rows * (d + 8) * 2, rows * 68 * 4, rows * 72 * 2, rows * (d + 4) * 4);
    match kernel {
        "attention_forward_tc" => 3 * bf16_tile + scores + acc + probs,
        "attention_backward_dq_tc" => 4 * bf16_tile + 2 * scores + probs,
        _ => 4 * bf16_tile + 2 * scores + 2 * acc + 2 * rows * 4 + 2 * probs,
    }
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
    let (name, rows, threads, bytes) = match kernel_set(be, dims, &[o, x]) {
        Set::Tensor => {
            let name = "attention_forward_tc";
            (name, TILED_ROWS, 128, tc_shared_bytes(name, dims.d))
        }
        Set::Tiled => {
            let f = 3 * TILED_ROWS * dims.d + TILED_ROWS * TILED_ROWS;
            ("attention_forward_tiled", TILED_ROWS, 256, 4 * f)
        }
        Set::Rows => {
            let f = 2 * TILE * (dims.d + 1) + ROWS * dims.d;
            ("attention_forward", ROWS, 32 * ROWS as u32, 4 * f)
        }
    };
    let smem = shared(be, name, bytes);
    let (t, h, kvh, d) =
        (int(dims.t, "T"), int(dims.h, "H"), int(dims.kvh, "KVH"), int(dims.d, "D"));
    let (w, scale) = window_scale(dims);
    let mut args =
        [arg(&o), arg(&l), arg(&x), arg(&t), arg(&h), arg(&kvh), arg(&d), arg(&w), arg(&scale)];
    // SAFETY: argument types match the three kernels (pointers, five ints, one float); the
    // grid covers (T/rows, H, B) and every index the kernel forms lies inside the buffers whose
    // lengths are checked above (keys and queries outside the window are never read); the
    // tiled and tensor-core kernels' 16-byte accesses are aligned (`tiled`).
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
    let set = kernel_set(be, dims, &[dx, dy, x, o]);
    let (dq_name, dkv_name, rows, threads) = match set {
        Set::Tensor => ("attention_backward_dq_tc", "attention_backward_dkv_tc", TILED_ROWS, 128),
        Set::Tiled => {
            ("attention_backward_dq_tiled", "attention_backward_dkv_tiled", TILED_ROWS, 256)
        }
        Set::Rows => ("attention_backward_dq", "attention_backward_dkv", ROWS, 32 * ROWS as u32),
    };
    let (dq_bytes, dkv_bytes) = match set {
        Set::Tensor => (tc_shared_bytes(dq_name, dims.d), tc_shared_bytes(dkv_name, dims.d)),
        Set::Tiled => {
            let (tile, stats) = (TILED_ROWS * dims.d, TILED_ROWS * TILED_ROWS + 2 * TILED_ROWS);
            (4 * (5 * tile + stats), 4 * (6 * tile + stats))
        }
        Set::Rows => {
            let tiles = 2 * TILE * (dims.d + 1) + 2 * ROWS * dims.d;
            (4 * tiles, 4 * (tiles + 2 * TILE))
        }
    };
    let smem_dq = shared(be, dq_name, dq_bytes);
    let smem_dkv = shared(be, dkv_name, dkv_bytes);
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
    // SAFETY: argument types match every set's kernels (pointers, five ints, one float); the dq
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
