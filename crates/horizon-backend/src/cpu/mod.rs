//! The CPU reference backend: [`CpuBackend`] implements [`Backend`] by delegating each method to
//! the plain slice functions of one op file (`<op>_forward` / `<op>_backward`, llm.c style).
//!
//! Every op is fp32, multi-threaded with rayon where it matters, and deterministic: the way work
//! is split never depends on the number of threads, and every reduction runs inside one task in
//! a fixed order, so results are bit-identical for any rayon pool size.

pub mod attention;
pub mod cross_entropy;
pub mod device;
pub mod embedding;
pub mod matmul;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;
pub mod testing;

pub use attention::{attention_backward, attention_forward};
pub use cross_entropy::{IGNORE_INDEX, cross_entropy_forward, cross_entropy_fused};
pub use device::{CpuDevice, CpuDeviceConfig};
pub use embedding::{embedding_backward, embedding_forward};
pub use matmul::{matmul_backward, matmul_forward};
pub use residual::{add_inplace, residual_forward};
pub use rmsnorm::{rmsnorm_backward, rmsnorm_forward};
pub use rope::{rope_backward, rope_forward};
pub use swiglu::{swiglu_backward, swiglu_forward};

use crate::{AttnDims, Backend, Precision};

/// The CPU reference backend. Buffers are plain host slices; work runs on the current rayon
/// pool (install a pool around calls to choose the thread count).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    /// A CPU backend using the current rayon pool.
    pub fn new() -> Self {
        CpuBackend
    }
}

impl Backend for CpuBackend {
    type Buf = [f32];
    type IBuf = [i32];
    type WBuf = [f32];
    const PRECISION: Precision = Precision::F32;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }

    fn upload_i32(&self, dst: &mut [i32], src: &[i32]) {
        dst.copy_from_slice(src);
    }

    /// Exact: the CPU computes with the fp32 masters themselves.
    fn upload_weights(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }

    fn download(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }

    fn copy(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }

    fn zero(&self, buf: &mut [f32]) {
        buf.fill(0.0);
    }

    fn embedding_forward(&self, out: &mut [f32], ids: &[i32], table: &[f32], c: usize) {
        embedding_forward(out, ids, table, c);
    }

    fn embedding_backward(&self, dtable: &mut [f32], ids: &[i32], dout: &[f32], c: usize) {
        embedding_backward(dtable, ids, dout, c);
    }

    fn rmsnorm_forward(
        &self,
        out: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        c: usize,
        eps: f32,
    ) {
        rmsnorm_forward(out, rstd, inp, weight, c, eps);
    }

    fn rmsnorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        rstd: &[f32],
        c: usize,
    ) {
        rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, c);
    }

    fn matmul_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        matmul_forward(out, inp, weight, bias, n, ic, oc);
    }

    fn matmul_backward(
        &self,
        dinp: Option<&mut [f32]>,
        dweight: &mut [f32],
        dbias: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        matmul_backward(dinp, dweight, dbias, dout, inp, weight, n, ic, oc);
    }

    fn rope_forward(&self, qkv: &mut [f32], cos: &[f32], sin: &[f32], dims: AttnDims) {
        rope_forward(qkv, cos, sin, dims);
    }

    fn rope_backward(&self, dqkv: &mut [f32], cos: &[f32], sin: &[f32], dims: AttnDims) {
        rope_backward(dqkv, cos, sin, dims);
    }

    fn attention_forward(&self, out: &mut [f32], lse: &mut [f32], qkv: &[f32], dims: AttnDims) {
        attention_forward(out, lse, qkv, dims);
    }

    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dout: &[f32],
        qkv: &[f32],
        out: &[f32],
        lse: &[f32],
        dims: AttnDims,
    ) {
        attention_backward(dqkv, dout, qkv, out, lse, dims);
    }

    fn swiglu_forward(&self, out: &mut [f32], gate_up: &[f32], n: usize, f: usize) {
        swiglu_forward(out, gate_up, n, f);
    }

    fn swiglu_backward(
        &self,
        dgate_up: &mut [f32],
        dout: &[f32],
        gate_up: &[f32],
        n: usize,
        f: usize,
    ) {
        swiglu_backward(dgate_up, dout, gate_up, n, f);
    }

    fn residual_forward(&self, out: &mut [f32], a: &[f32], b: &[f32]) {
        residual_forward(out, a, b);
    }

    fn add_inplace(&self, acc: &mut [f32], x: &[f32]) {
        add_inplace(acc, x);
    }

    fn cross_entropy_forward(
        &self,
        losses: &mut [f32],
        logits: &[f32],
        targets: &[i32],
        n: usize,
        v: usize,
    ) {
        cross_entropy_forward(losses, logits, targets, n, v);
    }

    fn cross_entropy_fused(
        &self,
        logits: &mut [f32],
        losses: &mut [f32],
        targets: &[i32],
        n: usize,
        v: usize,
        scale: f32,
    ) {
        cross_entropy_fused(logits, losses, targets, n, v, scale);
    }
}

/// Dot product of two equal-length vectors, summed in 8 lane-wise partial sums (so the compiler
/// can vectorise it) that are then combined in a fixed tree, plus a scalar tail. The order of
/// additions depends only on the length, never on threads.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = reduce8(acc);
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

/// `y += alpha * x`, elementwise.
#[inline]
pub(crate) fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// Sum of 8 lanes in a fixed pairwise tree.
#[inline(always)]
pub(crate) fn reduce8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}
