//! Launchers of `kernels/nf4.cu`: NF4 and MXFP4 weights (the device form of [`crate::nf4`], held in an
//! f32 buffer as bit patterns) to bf16 weights. Reference: `cpu/nf4.rs`.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len};
use super::slice::DevSlice;
use crate::Bf16;
use crate::nf4::{code_words, words};

/// out: (n), overwrites: `bf16(CODE[q_i] * absmax[i / 64])`. packed: (`nf4::words(n)`).
pub(crate) fn dequantize_nf4(
    be: &CudaBackend,
    out: &mut DevSlice<Bf16>,
    packed: &DevSlice<f32>,
    n: usize,
) {
    expect_len("dequantize_nf4", "out", out.len(), n);
    expect_len("dequantize_nf4", "packed", packed.len(), words(n));
    if n == 0 {
        return;
    }
    let (o, p, nn, cw) = (out.addr(), packed.addr(), n as i64, code_words(n) as i64);
    // SAFETY: argument types match (bf16 bits out, the packed words as unsigned ints, two long
    // longs); one thread per weight, reading word i/8 of the codes and code_words + i/64 of the
    // scales, both inside `packed` (checked above: words(n) elements).
    unsafe {
        be.launch(
            "dequantize_nf4",
            (blocks(n, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&p), arg(&nn), arg(&cw)],
        );
    }
}

/// out: (n), overwrites: `bf16(FP4[code_i] * 2^(scale[i / 32] - 127))`. packed:
/// (`mxfp4::words(n)`).
pub(crate) fn dequantize_mxfp4(
    be: &CudaBackend,
    out: &mut DevSlice<Bf16>,
    packed: &DevSlice<f32>,
    n: usize,
) {
    expect_len("dequantize_mxfp4", "out", out.len(), n);
    expect_len("dequantize_mxfp4", "packed", packed.len(), crate::mxfp4::words(n));
    if n == 0 {
        return;
    }
    let (o, p, nn) = (out.addr(), packed.addr(), n as i64);
    // SAFETY: argument types match (bf16 bits out, the packed words as unsigned ints, a long
    // long); one thread per weight, reading word i/8 of the codes and n/8 + i/128 of the
    // scales, both inside `packed` (checked above: mxfp4::words(n) elements).
    unsafe {
        be.launch(
            "dequantize_mxfp4",
            (blocks(n, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&p), arg(&nn)],
        );
    }
}
