//! The linear layer on cuBLAS (`gemm_ex`, fp32 buffers, fp32 accumulation; bf16 tensor cores
//! with `MatmulPrecision::Bf16`), and the bias from `kernels/matmul.cu`.
//!
//! Row-major (R, K) buffers are column-major (K, R) matrices to cuBLAS, so with
//! `Wc` = weight as (IC, OC) col-major, `Xc` = inp as (IC, N), `Yc` = out / dout as (OC, N):
//!   out:     Yc = Wc^T Xc              gemm(T, N, m=OC, n=N,  k=IC)
//!   dinp:    Xc' = Wc Yc               gemm(N, N, m=IC, n=N,  k=OC)
//!   dweight: Wc += Xc Yc^T             gemm(N, T, m=IC, n=OC, k=N, beta=1)

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys};

use super::backend::{arg, blocks, expect_len, int};
use super::slice::DevSlice;
use super::{CudaBackend, MatmulPrecision, check};

/// One fp32 GEMM `C = alpha op(A) op(B) + beta C` on the backend's stream.
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
    let compute = match be.precision() {
        MatmulPrecision::Bf16 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
        MatmulPrecision::Fp32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    let f32t = sys::cudaDataType::CUDA_R_32F;
    let alpha = 1.0f32;
    be.with_blas(|h| {
        // SAFETY: the three matrices are device buffers whose lengths the callers checked
        // against (m, n, k) and the leading dimensions; alpha and beta are host f32 (the
        // handle's default pointer mode) that outlive the call.
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
                f32t,
                int(lda, "lda"),
                b as *const c_void,
                f32t,
                int(ldb, "ldb"),
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                f32t,
                int(ldc, "ldc"),
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check("cublasGemmEx", r);
    });
}

const N: sys::cublasOperation_t = sys::cublasOperation_t::CUBLAS_OP_N;
const T: sys::cublasOperation_t = sys::cublasOperation_t::CUBLAS_OP_T;

/// out: (N, OC), overwrites. inp: (N, IC). weight: (OC, IC). bias: (OC).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    inp: &DevSlice<f32>,
    weight: &DevSlice<f32>,
    bias: Option<&DevSlice<f32>>,
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
        gemm(be, (T, N), (oc, n, ic), (weight.addr(), ic), (inp.addr(), ic), 0.0, (out.addr(), oc));
    }
    if let Some(bias) = bias {
        expect_len("matmul_forward", "bias", bias.len(), oc);
        let (o, b, nn, cc) = (out.addr(), bias.addr(), int(n, "N"), int(oc, "OC"));
        // SAFETY: argument types match; one thread per element of out (N, OC), bias (OC).
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

/// dinp: (N, IC), overwrites (skipped when `None`). dweight: (OC, IC), accumulates (+=).
/// dbias: (OC), accumulates (+=). dout: (N, OC). inp: (N, IC). weight: (OC, IC).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_backward(
    be: &CudaBackend,
    dinp: Option<&mut DevSlice<f32>>,
    dweight: &mut DevSlice<f32>,
    dbias: Option<&mut DevSlice<f32>>,
    dout: &DevSlice<f32>,
    inp: &DevSlice<f32>,
    weight: &DevSlice<f32>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    expect_len("matmul_backward", "dout", dout.len(), n * oc);
    expect_len("matmul_backward", "inp", inp.len(), n * ic);
    expect_len("matmul_backward", "weight", weight.len(), oc * ic);
    expect_len("matmul_backward", "dweight", dweight.len(), oc * ic);
    if let Some(dinp) = dinp {
        expect_len("matmul_backward", "dinp", dinp.len(), n * ic);
        if oc == 0 {
            be.memset0(dinp.addr(), dinp.bytes());
        } else if n > 0 && ic > 0 {
            let (w, dy, dx) = (weight.addr(), dout.addr(), dinp.addr());
            gemm(be, (N, N), (ic, n, oc), (w, ic), (dy, oc), 0.0, (dx, ic));
        }
    }
    if n > 0 && ic > 0 && oc > 0 {
        let (x, dy, dw) = (inp.addr(), dout.addr(), dweight.addr());
        gemm(be, (N, T), (ic, oc, n), (x, ic), (dy, oc), 1.0, (dw, ic));
    }
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
