//! Launchers of `kernels/residual.cu`: the residual add and in-place accumulation.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len};
use super::slice::DevSlice;

/// out = a + b; all of one length; out overwrites.
pub(crate) fn residual_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    a: &DevSlice<f32>,
    b: &DevSlice<f32>,
) {
    expect_len("residual_forward", "a", a.len(), out.len());
    expect_len("residual_forward", "b", b.len(), out.len());
    let (o, x, y, len) = (out.addr(), a.addr(), b.addr(), out.len() as i64);
    // SAFETY: argument types match; one thread per element of three equal-length buffers.
    unsafe {
        be.launch(
            "residual_forward",
            (blocks(out.len(), 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&x), arg(&y), arg(&len)],
        );
    }
}

/// acc += x.
pub(crate) fn add_inplace(be: &CudaBackend, acc: &mut DevSlice<f32>, x: &DevSlice<f32>) {
    expect_len("add_inplace", "x", x.len(), acc.len());
    let (a, b, len) = (acc.addr(), x.addr(), acc.len() as i64);
    // SAFETY: argument types match; one thread per element of two equal-length buffers.
    unsafe {
        be.launch(
            "add_inplace",
            (blocks(acc.len(), 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&a), arg(&b), arg(&len)],
        );
    }
}
