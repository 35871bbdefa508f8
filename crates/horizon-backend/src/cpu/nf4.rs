//! NF4 weights to fp32 on the CPU: the device form of [`crate::nf4`] (code words, then one
//! absmax word per block, each an f32 element's bits) to exactly [`crate::nf4::dequantize`]'s
//! values.
//!
//! Data flow: packed words (`nf4::words(n)`) -> code nibble, block absmax -> CODE[q] * absmax.
//! MXFP4 likewise (`mxfp4::words(n)`): code nibble, block scale -> FP4[q] * 2^(scale - 127).

use rayon::prelude::*;

use crate::nf4::{BLOCK, CODE, code_words, words};

/// The code of element `i` from the code words (bytes little-endian in each word; the first
/// element of a byte in its high nibble).
#[inline]
fn code_at(packed: &[f32], i: usize) -> usize {
    let byte = packed[i / 8].to_bits() >> (8 * ((i / 2) % 4));
    (if i.is_multiple_of(2) { (byte >> 4) & 0x0f } else { byte & 0x0f }) as usize
}

/// `out[i] = CODE[q_i] * absmax[i / 64]` in fp32.
///
/// out: (n), overwrites.
/// packed: (`nf4::words(n)`), the device form as f32 bit patterns.
pub fn dequantize_nf4(out: &mut [f32], packed: &[f32], n: usize) {
    assert_eq!(out.len(), n, "dequantize_nf4: out must be (n)");
    assert_eq!(packed.len(), words(n), "dequantize_nf4: packed must be nf4::words(n)");
    let scales = &packed[code_words(n)..];
    out.par_chunks_mut(BLOCK).zip(scales).enumerate().for_each(|(b, (o, am))| {
        let am = f32::from_bits(am.to_bits());
        for (j, o) in o.iter_mut().enumerate() {
            *o = CODE[code_at(packed, b * BLOCK + j)] * am;
        }
    });
}

/// MXFP4 weights to fp32: `out[i] = FP4[code_i] * 2^(scale[i / 32] - 127)`, exactly
/// [`crate::mxfp4::decode`]'s values.
///
/// out: (n), overwrites. packed: (`mxfp4::words(n)`), the device form as f32 bit patterns.
pub fn dequantize_mxfp4(out: &mut [f32], packed: &[f32], n: usize) {
    use crate::mxfp4::{BLOCK, value_at, words};
    assert_eq!(out.len(), n, "dequantize_mxfp4: out must be (n)");
    assert_eq!(packed.len(), words(n), "dequantize_mxfp4: packed must be mxfp4::words(n)");
    let word = |w: usize| packed[w].to_bits();
    out.par_chunks_mut(64 * BLOCK).enumerate().for_each(|(c, o)| {
        for (j, o) in o.iter_mut().enumerate() {
            *o = value_at(word, n, c * 64 * BLOCK + j);
        }
    });
}
