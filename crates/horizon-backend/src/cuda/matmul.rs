//! The linear layer on cuBLAS with bf16 inputs and fp32 accumulation (`cublasGemmEx`: A and B
//! `CUDA_R_16BF`, C `CUDA_R_32F`, `CUBLAS_COMPUTE_32F`), and the bias from `kernels/matmul.cu`.
//!
//! The weight is bf16 already (the device stores weights as bf16). The fp32 activations that
//! meet it are rounded to bf16 first (`kernels/convert.cu`) into the products part of the
//! backend's workspace: the forward's `inp`; the backward's `dout` (for both products) and `inp`
//! (for `dweight`). The copies and the GEMMs that read them are all on the backend's one stream,
//! in order, so the next product's conversion cannot overwrite a copy a GEMM still reads.
//! Outputs (`out`, `dinp`, `dweight`) are fp32; `dweight` accumulates in fp32 (beta = 1), and
//! so does `dinp` when it is `Dinp::Add`. A frozen weight (`dweight: None`) skips the dW GEMM
//! and the copy of `inp` only it reads.
//!
//! A mixture of experts' products are one `cublasGemmEx` per expert on the stream, not one
//! `cublasGemmGroupedBatchedEx` (cuBLAS 12.5+): under `CUBLAS_COMPUTE_32F` that call pairs bf16
//! A and B only with a bf16 C, so it can neither write these products' fp32 outputs nor
//! accumulate their fp32 weight gradients (beta = 1); rounding every expert's output to bf16
//! would change the numerics the fixtures check.
//!
//! Row-major (R, K) buffers are column-major (K, R) matrices to cuBLAS, so with
//! `Wc` = weight as (IC, OC) col-major, `Xc` = inp as (IC, N), `Yc` = out / dout as (OC, N):
//!   out:     Yc = Wc^T Xc              gemm(T, N, m=OC, n=N,  k=IC)
//!   dinp:    Xc' = Wc Yc               gemm(N, N, m=IC, n=N,  k=OC)
//!   dweight: Wc += Xc Yc^T             gemm(N, T, m=IC, n=OC, k=N, beta=1)

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys};

use super::backend::{arg, blocks, expect_len, int};
use super::convert::round_on_device;
use super::slice::DevSlice;
use super::{CudaBackend, check};
use crate::precision::product_parts;
use crate::{Bf16, Dinp, Precision};

/// One GEMM `C = op(A) op(B) + beta C` on the backend's stream: A and B bf16 at device
/// addresses `a`, `b`; C fp32 at `c`; fp32 accumulation.
#[allow(clippy::too_many_arguments)]
fn gemm(
    be: &CudaBackend,
    (ta, tb): (sys::cublasOperation_t, sys::cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    (a, lda): (u64, usize),
    (b, ldb): (u64, usize),
    beta: f32,
    (c, ldc): (u64, usize),
) {
    let bf16 = sys::cudaDataType::CUDA_R_16BF;
    let alpha = 1.0f32;
    be.with_blas(|h| {
        // SAFETY: A and B are bf16 and C fp32 device buffers whose lengths the callers checked
        // against (m, n, k) and the leading dimensions; alpha and beta are host f32, the scalar
        // type of CUBLAS_COMPUTE_32F (the handle's default pointer mode), and outlive the call.
        let r = unsafe {
            blas::gemm_ex(
                h,
                ta,
                tb,
                int(m, "gemm m"),
                int(n, "gemm n"),
                int(k, "gemm k"),
                (&alpha as *const f32).cast::<c_void>(),
                a as *const c_void,
                bf16,
                int(lda, "lda"),
                b as *const c_void,
                bf16,
                int(ldb, "ldb"),
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                sys::cudaDataType::CUDA_R_32F,
                int(ldc, "ldc"),
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check("cublasGemmEx", r);
    });
}

const N: sys::cublasOperation_t = sys::cublasOperation_t::CUBLAS_OP_N;
const T: sys::cublasOperation_t = sys::cublasOperation_t::CUBLAS_OP_T;

/// The workspace's products part `(addr, bytes)` as `(dout, inp)` bf16 views for a product
/// of these sizes. Panics (a bug: the plan sizes the workspace for the run's largest product)
/// when it is too small.
///
/// # Safety
/// The views alias the workspace: use them only in work enqueued on the backend's stream, while
/// holding the backend's products lock (so one product's conversions and GEMMs are enqueued
/// before the next product's).
unsafe fn scratch<'a>(
    (addr, bytes): (u64, usize),
    n: usize,
    ic: usize,
    oc: usize,
) -> (&'a mut DevSlice<Bf16>, &'a mut DevSlice<Bf16>) {
    let need = Precision::Bf16.product_bytes(n, ic, oc);
    assert!(
        addr != 0 && need <= bytes,
        "a {n}x{ic}x{oc} product needs {need} bytes of workspace for its bf16 inputs; the \
         backend has {bytes} (the plan sizes the workspace for the largest product)"
    );
    let (dout, inp) = product_parts(n, ic, oc);
    // SAFETY: both ranges lie inside the products part (checked above) and are disjoint; the
    // caller keeps their use on the stream, one product at a time.
    unsafe {
        (
            DevSlice::from_raw_mut(addr + dout.start as u64, n * oc),
            DevSlice::from_raw_mut(addr + inp.start as u64, n * ic),
        )
    }
}

/// out: (N, OC), overwrites. inp: (N, IC), rounded to bf16 for the product. weight: (OC, IC).
/// bias: (OC).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    inp: &DevSlice<f32>,
    weight: &DevSlice<Bf16>,
    bias: Option<&DevSlice<Bf16>>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    expect_len("matmul_forward", "out", out.len(), n * oc);
    expect_len("matmul_forward", "inp", inp.len(), n * ic);
    expect_len("matmul_forward", "weight", weight.len(), oc * ic);
    if n == 0 || oc == 0 {
        return;
    }
    if ic == 0 {
        be.memset0(out.addr(), out.bytes());
    } else {
        let ws = be.products();
        // The forward has no dout to copy: its inp copy starts the scratch (the parts of a
        // product with OC = 0), which the backward's share of the same sizes covers.
        // SAFETY: on this stream, under the products lock (`ws`, held to the GEMM).
        let (_, xb) = unsafe { scratch(*ws, n, ic, 0) };
        round_on_device(be, xb, inp);
        let (w, x, y) = (weight.addr(), xb.addr(), out.addr());
        gemm(be, (T, N), (oc, n, ic), (w, ic), (x, ic), 0.0, (y, oc));
        drop(ws);
    }
    if let Some(bias) = bias {
        expect_len("matmul_forward", "bias", bias.len(), oc);
        let (o, b, nn, cc) = (out.addr(), bias.addr(), int(n, "N"), int(oc, "OC"));
        // SAFETY: argument types match (bias is bf16 bits); one thread per element of out
        // (N, OC), bias (OC).
        unsafe {
            be.launch(
                "matmul_bias_forward",
                (blocks(n * oc, 256), 1, 1),
                (256, 1, 1),
                0,
                &mut [arg(&o), arg(&b), arg(&nn), arg(&cc)],
            );
        }
    }
}

/// dinp: (N, IC): `Dinp::Write` overwrites (beta = 0), `Dinp::Add` accumulates (+=, beta = 1);
/// skipped when `None`. dweight: (OC, IC), accumulates (+=); `None` (a frozen weight): no dW
/// product and no bf16 copy of `inp`. dbias: (OC), accumulates (+=), from the fp32 dout.
/// dout: (N, OC) and inp: (N, IC), rounded to bf16 for the products that read them.
/// weight: (OC, IC).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_backward(
    be: &CudaBackend,
    dinp: Option<Dinp<'_, DevSlice<f32>>>,
    dweight: Option<&mut DevSlice<f32>>,
    dbias: Option<&mut DevSlice<f32>>,
    dout: &DevSlice<f32>,
    inp: &DevSlice<f32>,
    weight: &DevSlice<Bf16>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    let op = "matmul_backward";
    expect_len(op, "dout", dout.len(), n * oc);
    expect_len(op, "inp", inp.len(), n * ic);
    expect_len(op, "weight", weight.len(), oc * ic);
    let (dinp, beta) = match dinp {
        Some(Dinp::Write(d)) => (Some(d), 0.0),
        Some(Dinp::Add(d)) => (Some(d), 1.0),
        None => (None, 0.0),
    };
    if let Some(d) = &dinp {
        expect_len(op, "dinp", d.len(), n * ic);
    }
    if let Some(d) = &dweight {
        expect_len(op, "dweight", d.len(), oc * ic);
    }
    // Held until both GEMMs are enqueued: no other product can use the scratch meanwhile.
    let ws = be.products();
    let products = n > 0 && ic > 0 && oc > 0 && (dinp.is_some() || dweight.is_some());
    // The bf16 copies of dout (for either product) and of inp (for dW only): their addresses.
    let copies = products.then(|| {
        // SAFETY: on this stream, under the products lock (`ws`): the conversions here and the
        // GEMMs below that read them are enqueued before anything else can use the scratch.
        let (dyb, xb) = unsafe { scratch(*ws, n, ic, oc) };
        round_on_device(be, dyb, dout);
        if dweight.is_some() {
            round_on_device(be, xb, inp);
        }
        (dyb.addr(), xb.addr())
    });
    if let Some(dinp) = dinp {
        if oc == 0 && beta == 0.0 {
            be.memset0(dinp.addr(), dinp.bytes());
        } else if let Some((dy, _)) = copies {
            let (w, dx) = (weight.addr(), dinp.addr());
            gemm(be, (N, N), (ic, n, oc), (w, ic), (dy, oc), beta, (dx, ic));
        }
    }
    if let (Some(dweight), Some((dy, x))) = (dweight, copies) {
        gemm(be, (N, T), (ic, oc, n), (x, ic), (dy, oc), 1.0, (dweight.addr(), ic));
    }
    drop(ws);
    if let Some(dbias) = dbias {
        expect_len("matmul_backward", "dbias", dbias.len(), oc);
        let (db, dy, nn, cc) = (dbias.addr(), dout.addr(), int(n, "N"), int(oc, "OC"));
        // SAFETY: argument types match; 32 columns of dbias (OC) per block over dout (N, OC).
        unsafe {
            be.launch(
                "matmul_bias_backward",
                (oc.div_ceil(32) as u32, 1, 1),
                (32, 8, 1),
                0,
                &mut [arg(&db), arg(&dy), arg(&nn), arg(&cc)],
            );
        }
    }
}
