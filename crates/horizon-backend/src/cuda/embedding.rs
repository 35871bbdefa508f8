//! Launchers of `kernels/embedding.cu`: the embedding gather and its row scatter-add.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len, int};
use super::slice::DevSlice;

/// out: (N, C), overwrites. ids: (N), each in `0..V`. table: (V, C).
pub(crate) fn embedding_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    ids: &DevSlice<i32>,
    table: &DevSlice<f32>,
    c: usize,
) {
    let n = ids.len();
    expect_len("embedding_forward", "out", out.len(), n * c);
    let (o, i, t, nn, cc) = (out.addr(), ids.addr(), table.addr(), int(n, "N"), int(c, "C"));
    // SAFETY: argument types match the kernel; out is (N, C), ids (N), table holds every row
    // an id names (ids are in 0..V by contract).
    unsafe {
        be.launch(
            "embedding_forward",
            (blocks(n * c, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&i), arg(&t), arg(&nn), arg(&cc)],
        );
    }
}

/// dtable: (V, C), accumulates (+=) into the rows named by `ids`, in row order. dout: (N, C).
pub(crate) fn embedding_backward(
    be: &CudaBackend,
    dtable: &mut DevSlice<f32>,
    ids: &DevSlice<i32>,
    dout: &DevSlice<f32>,
    c: usize,
) {
    let n = ids.len();
    expect_len("embedding_backward", "dout", dout.len(), n * c);
    let (d, i, g, nn, cc) = (dtable.addr(), ids.addr(), dout.addr(), int(n, "N"), int(c, "C"));
    // SAFETY: argument types match; one thread per column of dtable, rows named by ids.
    unsafe {
        be.launch(
            "embedding_backward",
            (blocks(c, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&d), arg(&i), arg(&g), arg(&nn), arg(&cc)],
        );
    }
}
