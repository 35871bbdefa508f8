//! Launchers of `kernels/rmsnorm.cu` (the weight is bf16, applied as `w_offset + w` in fp32;
//! the rest fp32). Derivation of the backward: `cpu/rmsnorm.rs`.

use super::CudaBackend;
use super::backend::{arg, expect_len, int};
use super::slice::DevSlice;
use crate::{Bf16, NormDims};

/// out: (N, C), overwrites. rstd: (N), overwrites. inp: (N, C). weight: (C), applied as
/// `norm.w_offset + weight`.
pub(crate) fn rmsnorm_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    rstd: &mut DevSlice<f32>,
    inp: &DevSlice<f32>,
    weight: &DevSlice<Bf16>,
    norm: NormDims,
) {
    let NormDims { c, eps, w_offset } = norm;
    assert!(c > 0, "rmsnorm_forward: C must be positive");
    let n = inp.len() / c;
    expect_len("rmsnorm_forward", "inp", inp.len(), n * c);
    expect_len("rmsnorm_forward", "out", out.len(), n * c);
    expect_len("rmsnorm_forward", "rstd", rstd.len(), n);
    expect_len("rmsnorm_forward", "weight", weight.len(), c);
    let (o, r, x, w) = (out.addr(), rstd.addr(), inp.addr(), weight.addr());
    let (nn, cc) = (int(n, "N"), int(c, "C"));
    // SAFETY: argument types match (four pointers, two ints, two floats); one block of 256
    // threads per row of (N, C) buffers.
    unsafe {
        be.launch(
            "rmsnorm_forward",
            (n as u32, 1, 1),
            (256, 1, 1),
            0,
            &mut [
                arg(&o),
                arg(&r),
                arg(&x),
                arg(&w),
                arg(&nn),
                arg(&cc),
                arg(&eps),
                arg(&w_offset),
            ],
        );
    }
}

/// dinp: (N, C), accumulates (+=). dweight: (C), accumulates (+=); `None`: not computed (a
/// frozen weight). dout, inp: (N, C). weight: (C). rstd: (N).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rmsnorm_backward(
    be: &CudaBackend,
    dinp: &mut DevSlice<f32>,
    dweight: Option<&mut DevSlice<f32>>,
    dout: &DevSlice<f32>,
    inp: &DevSlice<f32>,
    weight: &DevSlice<Bf16>,
    rstd: &DevSlice<f32>,
    norm: NormDims,
) {
    let NormDims { c, w_offset, .. } = norm;
    assert!(c > 0, "rmsnorm_backward: C must be positive");
    let n = inp.len() / c;
    expect_len("rmsnorm_backward", "inp", inp.len(), n * c);
    expect_len("rmsnorm_backward", "dinp", dinp.len(), n * c);
    expect_len("rmsnorm_backward", "dout", dout.len(), n * c);
    expect_len("rmsnorm_backward", "rstd", rstd.len(), n);
    expect_len("rmsnorm_backward", "weight", weight.len(), c);
    let (dx, dy, x, w, r) = (dinp.addr(), dout.addr(), inp.addr(), weight.addr(), rstd.addr());
    let (nn, cc) = (int(n, "N"), int(c, "C"));
    // SAFETY: argument types match; one block per row of dinp; every buffer has the length
    // checked above.
    unsafe {
        be.launch(
            "rmsnorm_backward_dinp",
            (n as u32, 1, 1),
            (256, 1, 1),
            0,
            &mut [
                arg(&dx),
                arg(&dy),
                arg(&x),
                arg(&w),
                arg(&r),
                arg(&nn),
                arg(&cc),
                arg(&w_offset),
            ],
        );
    }
    let Some(dweight) = dweight else { return };
    expect_len("rmsnorm_backward", "dweight", dweight.len(), c);
    let dw = dweight.addr();
    // SAFETY: argument types match; 32 columns of dweight (C) per block over the (N, C)
    // buffers checked above.
    unsafe {
        be.launch(
            "rmsnorm_backward_dweight",
            (c.div_ceil(32) as u32, 1, 1),
            (32, 8, 1),
            0,
            &mut [arg(&dw), arg(&dy), arg(&x), arg(&r), arg(&nn), arg(&cc)],
        );
    }
}
