//! [`Precision`]: the number formats a backend computes in, and the device bytes they imply. The
//! memory plan sizes the weight slots and the backend's workspace from it before any device
//! exists, and the CUDA backend carves its workspace with the same [`WorkspaceLayout`]: one
//! source for both.

use std::ops::Range;

/// Alignment of the workspace's parts (cuBLAS wants its workspace on 256 bytes).
pub const WORKSPACE_ALIGN: usize = 256;

/// The cuBLAS workspace (`cublasSetWorkspace`): 32 MiB, NVIDIA's recommendation for Hopper.
pub const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Elements per chunk of a bf16 gradient download (`Device::download_bf16`): the device rounds
/// one chunk into a bf16 buffer of the workspace, then copies it to the host.
pub const GRAD_WIRE_CHUNK: usize = 4 << 20;

/// How a backend stores the weights it computes with, and so what its products need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// fp32 weights and fp32 products: the CPU backend, the reference. No workspace.
    F32,
    /// bf16 weights on the device; every matrix product takes bf16 inputs with fp32
    /// accumulation and fp32 output (cuBLAS `gemm_ex`, `CUBLAS_COMPUTE_32F`), so the fp32
    /// activations that meet a weight are first rounded to bf16 in a workspace: the CUDA
    /// backend. Norm weights and biases are bf16 too (the kernels read them as bf16).
    Bf16,
}

impl Precision {
    /// `fp32` / `bf16`, for the plan and logs.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    }

    /// Bytes of one weight element on the device.
    pub const fn weight_bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 => 2,
        }
    }

    /// Workspace bytes one product `(N, IC) x (OC, IC)^T` needs for its bf16 input copies: the
    /// backward's `dout` (N, OC) and `inp` (N, IC), each rounded up to [`WORKSPACE_ALIGN`]; the
    /// forward's `inp` fits in the same space. 0 for [`Precision::F32`].
    pub fn product_bytes(self, n: usize, ic: usize, oc: usize) -> usize {
        match self {
            Precision::F32 => 0,
            Precision::Bf16 => {
                let (dout, inp) = product_parts(n, ic, oc);
                inp.end.max(dout.end)
            }
        }
    }

    /// Workspace bytes attention over `n` rows needs ([`attention_parts`]): bf16 copies of
    /// `qkv` (N, (H + 2 KVH) D) and `dout` (N, H D), which the tensor-core kernels read, and
    /// the backward's row sums `delta` (N H, fp32). 0 for [`Precision::F32`].
    pub fn attention_bytes(self, n: usize, h: usize, kvh: usize, d: usize) -> usize {
        match self {
            Precision::F32 => 0,
            Precision::Bf16 => attention_parts(n, h, kvh, d).2.end,
        }
    }

    /// The device workspace of a backend whose largest product needs `product_bytes` (the
    /// largest [`Precision::product_bytes`] of the run): nothing for [`Precision::F32`].
    pub fn workspace(self, product_bytes: usize) -> WorkspaceLayout {
        match self {
            Precision::F32 => {
                WorkspaceLayout { blas: 0..0, grad_wire: 0..0, products: 0..0, bytes: 0 }
            }
            Precision::Bf16 => {
                let blas = 0..BLAS_WORKSPACE_BYTES;
                let grad_wire = blas.end..blas.end + align(GRAD_WIRE_CHUNK * 2);
                let products = grad_wire.end..grad_wire.end + align(product_bytes);
                // The pool aligns buffers to 64 bytes only: room to move the start to 256.
                let bytes = products.end + WORKSPACE_ALIGN;
                WorkspaceLayout { blas, grad_wire, products, bytes }
            }
        }
    }
}

/// Where each part of a backend's device workspace lies, in bytes from its start rounded up to
/// [`WORKSPACE_ALIGN`] (a buffer of `bytes` always holds them all after that rounding).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceLayout {
    /// The cuBLAS workspace.
    pub blas: Range<usize>,
    /// One chunk of a bf16 gradient on its way to the host (the D2H stream's).
    pub grad_wire: Range<usize>,
    /// bf16 copies of the inputs of one product at a time (the compute stream's).
    pub products: Range<usize>,
    /// Bytes to allocate.
    pub bytes: usize,
}

/// `x` rounded up to [`WORKSPACE_ALIGN`].
pub const fn align(x: usize) -> usize {
    x.next_multiple_of(WORKSPACE_ALIGN)
}

/// Byte ranges, inside a product's share of the workspace, of the bf16 copies of `dout`
/// (N, OC) and of `inp` (N, IC). The forward, which has no `dout`, puts `inp` at 0.
pub fn product_parts(n: usize, ic: usize, oc: usize) -> (Range<usize>, Range<usize>) {
    let dout = 0..align(2 * n * oc);
    let inp = dout.end..dout.end + align(2 * n * ic);
    (dout, inp)
}

/// Byte ranges, inside the products' share of the workspace, of attention's bf16 `qkv`
/// (N, (H + 2 KVH) D), bf16 `dout` (N, H D) and fp32 `delta` (N H). The forward uses only the
/// first.
pub fn attention_parts(
    n: usize,
    h: usize,
    kvh: usize,
    d: usize,
) -> (Range<usize>, Range<usize>, Range<usize>) {
    let qkv = 0..align(2 * n * (h + 2 * kvh) * d);
    let dout = qkv.end..qkv.end + align(2 * n * h * d);
    let delta = dout.end..dout.end + align(4 * n * h);
    (qkv, dout, delta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_parts_are_aligned_and_disjoint() {
        assert_eq!(Precision::F32.workspace(123).bytes, 0);
        assert_eq!(Precision::F32.product_bytes(7, 9, 11), 0);
        let p = Precision::Bf16.product_bytes(7, 9, 11);
        assert_eq!(p, 256 + 256);
        let w = Precision::Bf16.workspace(p);
        for r in [&w.blas, &w.grad_wire, &w.products] {
            assert_eq!(r.start % WORKSPACE_ALIGN, 0, "{w:?}");
        }
        assert!(w.blas.end <= w.grad_wire.start && w.grad_wire.end <= w.products.start);
        assert!(w.products.len() >= p && w.grad_wire.len() >= 2 * GRAD_WIRE_CHUNK);
        assert_eq!(w.bytes, w.products.end + WORKSPACE_ALIGN);
        let (dout, inp) = product_parts(1000, 333, 77);
        assert!(dout.len() >= 2 * 1000 * 77 && inp.len() >= 2 * 1000 * 333);
        assert!(dout.end <= inp.start && inp.start % WORKSPACE_ALIGN == 0);
        let (qkv, dout, delta) = attention_parts(100, 7, 1, 16);
        assert!(qkv.len() >= 2 * 100 * 9 * 16 && dout.len() >= 2 * 100 * 7 * 16);
        assert!(qkv.end <= dout.start && dout.end <= delta.start && delta.len() >= 4 * 700);
        for r in [&qkv, &dout, &delta] {
            assert_eq!(r.start % WORKSPACE_ALIGN, 0);
        }
        assert_eq!(Precision::Bf16.attention_bytes(100, 7, 1, 16), delta.end);
        assert_eq!(Precision::F32.attention_bytes(100, 7, 1, 16), 0);
    }
}
