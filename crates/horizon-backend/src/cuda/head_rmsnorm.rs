//! Launchers of `kernels/head_rmsnorm.cu`: per-head RMSNorm of the q and k parts of fused qkv
//! rows (the weight bf16, applied as `w_offset + w` in fp32; the rest fp32), the v part copied.
//! Derivation of the backward: the kernel file's header and `cpu/head_rmsnorm.rs` (each head
//! is one RMSNorm row).

use super::CudaBackend;
use super::backend::{arg, expect_len, int};
use super::slice::DevSlice;
use crate::{AttnDims, Bf16, NormDims};

/// Heads (warps) per block; must match the kernel's ROWS.
const ROWS: usize = 8;
/// (row, head) groups of the dweight reduction; must match the kernel's GROUPS.
const GROUPS: u32 = 32;

/// Checks the shapes shared by forward and backward; returns the kernels' (H, KVH, D).
fn check(op: &str, dims: AttnDims, norm: NormDims, weight: usize) -> (i32, i32, i32) {
    assert!(dims.d > 0, "{op}: head dim D must be positive");
    assert_eq!(norm.c, dims.d, "{op}: norm.c = {} must be the head dim D = {}", norm.c, dims.d);
    expect_len(op, "weight", weight, 2 * dims.d);
    (int(dims.h, "H"), int(dims.kvh, "KVH"), int(dims.d, "D"))
}

/// Grid of the forward and dinp kernels: a block per row and per ROWS heads of it.
fn grid(dims: AttnDims) -> (u32, u32, u32) {
    let n = u32::try_from(dims.n()).expect("head_rmsnorm: more than 2^32 rows");
    (n, (dims.h + 2 * dims.kvh).div_ceil(ROWS) as u32, 1)
}

/// out: (N, QKV), overwrites. rstd: (N, H + KVH), overwrites. inp: (N, QKV).
/// weight: (2D) = `[q_norm | k_norm]`.
pub(crate) fn head_rmsnorm_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    rstd: &mut DevSlice<f32>,
    inp: &DevSlice<f32>,
    weight: &DevSlice<Bf16>,
    dims: AttnDims,
    norm: NormDims,
) {
    let op = "head_rmsnorm_forward";
    let (h, kvh, d) = check(op, dims, norm, weight.len());
    expect_len(op, "inp", inp.len(), dims.n() * dims.qkv_width());
    expect_len(op, "out", out.len(), dims.n() * dims.qkv_width());
    expect_len(op, "rstd", rstd.len(), dims.n() * (dims.h + dims.kvh));
    let (o, r, x, w) = (out.addr(), rstd.addr(), inp.addr(), weight.addr());
    let (eps, off) = (norm.eps, norm.w_offset);
    // SAFETY: argument types match (four pointers, three ints, two floats); the grid covers
    // (N, heads / ROWS), each warp one head of one row, inside the buffers checked above.
    unsafe {
        be.launch(
            "head_rmsnorm_forward",
            grid(dims),
            (32 * ROWS as u32, 1, 1),
            0,
            &mut [
                arg(&o),
                arg(&r),
                arg(&x),
                arg(&w),
                arg(&h),
                arg(&kvh),
                arg(&d),
                arg(&eps),
                arg(&off),
            ],
        );
    }
}

/// dinp: (N, QKV), overwrites (its v part is dout's). dweight: (2D), accumulates (+=);
/// `None`: not computed (frozen norm weights). dout, inp: (N, QKV). weight: (2D). rstd: (N, H + KVH) as saved by the forward.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_rmsnorm_backward(
    be: &CudaBackend,
    dinp: &mut DevSlice<f32>,
    dweight: Option<&mut DevSlice<f32>>,
    dout: &DevSlice<f32>,
    inp: &DevSlice<f32>,
    weight: &DevSlice<Bf16>,
    rstd: &DevSlice<f32>,
    dims: AttnDims,
    norm: NormDims,
) {
    let op = "head_rmsnorm_backward";
    let (h, kvh, d) = check(op, dims, norm, weight.len());
    let len = dims.n() * dims.qkv_width();
    expect_len(op, "inp", inp.len(), len);
    expect_len(op, "dout", dout.len(), len);
    expect_len(op, "dinp", dinp.len(), len);
    expect_len(op, "rstd", rstd.len(), dims.n() * (dims.h + dims.kvh));
    let (dx, dy, x, w, r) = (dinp.addr(), dout.addr(), inp.addr(), weight.addr(), rstd.addr());
    let (n, off) = (int(dims.n(), "N"), norm.w_offset);
    // SAFETY: argument types match (five pointers, three ints, a float); a warp per head of
    // each row; every index lies in the buffers checked above.
    unsafe {
        be.launch(
            "head_rmsnorm_backward_dinp",
            grid(dims),
            (32 * ROWS as u32, 1, 1),
            0,
            &mut [
                arg(&dx),
                arg(&dy),
                arg(&x),
                arg(&w),
                arg(&r),
                arg(&h),
                arg(&kvh),
                arg(&d),
                arg(&off),
            ],
        );
    }
    let Some(dweight) = dweight else { return };
    expect_len(op, "dweight", dweight.len(), 2 * dims.d);
    let dw = dweight.addr();
    // SAFETY: argument types match (four pointers, four ints); a block per 32 of the 2D
    // columns; every index lies in the buffers checked above.
    unsafe {
        be.launch(
            "head_rmsnorm_backward_dweight",
            ((2 * dims.d).div_ceil(32) as u32, 1, 1),
            (32, GROUPS, 1),
            0,
            &mut [arg(&dw), arg(&dy), arg(&x), arg(&r), arg(&n), arg(&h), arg(&kvh), arg(&d)],
        );
    }
}
