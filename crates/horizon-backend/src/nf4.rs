//! NF4, QLoRA's 4-bit base weights, exactly as bitsandbytes 0.50 quantises on the CPU
//! (`quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)`, its
//! `default` backend: `bitsandbytes/backends/default/ops.py`, the `quantize_4bit` kernel; the
//! dequantisation is `dequantize_4bit`, `csrc/cpu_ops.cpp` `dequantizeBlockwise4bitCpu`).
//!
//! Data flow: w (n, row-major, fp32) -> blocks of 64 -> absmax -> scaled -> code index (4 bits)
//! -> two per byte; dequantised `CODE[q] * absmax` (fp32).
//!
//! How a value becomes a code, bit for bit as bitsandbytes does it:
//! - The tensor is flat: block `b` is elements `64b..64b + 64` (a block may straddle rows); the
//!   last block is partial when `n % 64 != 0`.
//! - `absmax` = the largest `|x|` of the block. A full block keeps it as it is (0 for a zero
//!   block); the partial last block stores it clamped to at least `1e-38` (bitsandbytes clamps
//!   that one before storing it).
//! - Full blocks scale by a reciprocal, `x * (1 / max(absmax, 1e-38))` (torch's `1.0 / t` is
//!   `reciprocal(t) * 1.0`, one correctly rounded division); the partial block divides,
//!   `x / max(absmax, 1e-38)`. Either is clamped to `[-1, 1]`.
//! - The code is `torch.bucketize(scaled, mid)` with the 15 midpoints `mid[i] = (CODE[i] +
//!   CODE[i + 1]) / 2` in fp32, `right=False`: the number of midpoints strictly below the
//!   scaled value. A value exactly at a midpoint takes the lower code; `-0.0` and `0.0` both
//!   give code 7 (the value 0.0), so does every element of a zero block (`0 * 1e38`).
//! - Two codes a byte, the first element in the high nibble: `byte = q[2i] << 4 | q[2i + 1]`;
//!   an odd `n` pads its last low nibble with the code of 0.0 (7).
//!
//! NaN and infinite weights are outside the contract (the checkpoint loader refuses them).
//!
//! The device form ([`to_words`]) is the same data as 32-bit words, so it can live in the
//! engine's f32 device pool (each word an f32 element's bits, uploaded bit-preserving):
//! `ceil(n/2)` code bytes, little-endian four to a word (byte `k` is bits `8(k%4)..` of word
//! `k/4`), zero-padded to a whole word, then one word per block holding its absmax's f32 bits.
//! [`words`] is the total.

use rayon::prelude::*;

/// The 16 NF4 values (bitsandbytes' `get_4bit_type("nf4")`, ascending), in bitsandbytes' own
/// digits (more than an f32 holds; each literal rounds to the f32 bitsandbytes' tensor holds).
#[allow(clippy::excessive_precision)]
pub const CODE: [f32; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// Values per block (bitsandbytes' `blocksize=64`).
pub const BLOCK: usize = 64;

/// The clamp bitsandbytes puts under an absmax before dividing by it.
const MIN_ABSMAX: f32 = 1e-38;

/// An NF4 tensor in bitsandbytes' packed form.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4 {
    /// `ceil(n/2)` bytes, two codes each, the first element in the high nibble.
    pub codes: Vec<u8>,
    /// One fp32 absmax per block of [`BLOCK`] (`ceil(n/64)`).
    pub absmax: Vec<f32>,
    /// Number of values.
    pub n: usize,
}

/// The 15 midpoints between neighbouring code values, in fp32 as bitsandbytes forms them.
fn midpoints() -> [f32; 15] {
    std::array::from_fn(|i| (CODE[i] + CODE[i + 1]) / 2.0)
}

/// The code of one scaled value: the number of midpoints strictly below it (`bucketize`,
/// `right=False`).
#[inline]
fn code_of(scaled: f32, mid: &[f32; 15]) -> u8 {
    mid.iter().filter(|&&m| m < scaled).count() as u8
}

/// The codes (one per byte, unpacked) and stored absmax of one block. `full`: a whole block
/// of 64 (scaled by a reciprocal) rather than the partial last one (divided).
fn quantize_block(q: &mut [u8], x: &[f32], full: bool, mid: &[f32; 15]) -> f32 {
    let absmax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let am = absmax.max(MIN_ABSMAX);
    let r = 1.0 / am;
    for (q, &v) in q.iter_mut().zip(x) {
        let s = if full { v * r } else { v / am };
        *q = code_of(s.clamp(-1.0, 1.0), mid);
    }
    if full { absmax } else { am }
}

/// Quantises `w` (row-major, any shape, flattened) as bitsandbytes does; blocks in parallel,
/// the result independent of the thread count.
pub fn quantize(w: &[f32]) -> Nf4 {
    let n = w.len();
    let mid = midpoints();
    let blocks = n.div_ceil(BLOCK);
    let mut absmax = vec![0.0f32; blocks];
    let mut codes = vec![0u8; n.div_ceil(2)];
    codes.par_chunks_mut(BLOCK / 2).zip(absmax.par_iter_mut()).zip(w.par_chunks(BLOCK)).for_each(
        |((bytes, am), x)| {
            let mut q = [7u8; BLOCK];
            *am = quantize_block(&mut q[..x.len()], x, x.len() == BLOCK, &mid);
            for (b, pair) in bytes.iter_mut().zip(q.chunks_exact(2)) {
                *b = (pair[0] << 4) | pair[1];
            }
        },
    );
    Nf4 { codes, absmax, n }
}

/// The code of element `i` of packed bytes.
#[inline]
fn nibble(codes: &[u8], i: usize) -> usize {
    let byte = codes[i / 2];
    (if i.is_multiple_of(2) { byte >> 4 } else { byte & 0x0f }) as usize
}

/// `out[i] = CODE[q_i] * absmax[i / 64]` in fp32, as bitsandbytes' `dequantize_4bit`.
/// out: (n), overwrites.
pub fn dequantize(q: &Nf4, out: &mut [f32]) {
    assert_eq!(out.len(), q.n, "nf4::dequantize: out must hold the tensor's {} values", q.n);
    assert_eq!(q.codes.len(), q.n.div_ceil(2), "nf4::dequantize: codes must be ceil(n/2) bytes");
    assert_eq!(q.absmax.len(), q.n.div_ceil(BLOCK), "nf4::dequantize: one absmax per block");
    out.par_chunks_mut(BLOCK).zip(&q.absmax).enumerate().for_each(|(b, (o, &am))| {
        for (j, o) in o.iter_mut().enumerate() {
            *o = CODE[nibble(&q.codes, b * BLOCK + j)] * am;
        }
    });
}

/// Words of the code bytes of `n` values in the device form: `ceil(n/2)` bytes in whole words.
pub fn code_words(n: usize) -> usize {
    n.div_ceil(2).div_ceil(4)
}

/// Words of the device form of `n` values: the code words, then one absmax word per block.
pub fn words(n: usize) -> usize {
    code_words(n) + n.div_ceil(BLOCK)
}

/// The device form of `q` (see the module doc). out: (`words(q.n)`), overwrites.
pub fn to_words(q: &Nf4, out: &mut [u32]) {
    assert_eq!(out.len(), words(q.n), "nf4::to_words: out must be words(n) = {}", words(q.n));
    let (code, scale) = out.split_at_mut(code_words(q.n));
    for (w, bytes) in code.iter_mut().zip(q.codes.chunks(4)) {
        let mut b = [0u8; 4];
        b[..bytes.len()].copy_from_slice(bytes);
        *w = u32::from_le_bytes(b);
    }
    for (w, am) in scale.iter_mut().zip(&q.absmax) {
        *w = am.to_bits();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_midpoint_takes_the_lower_code_and_zero_is_code_seven() {
        let mid = midpoints();
        for (i, &m) in mid.iter().enumerate() {
            assert_eq!(code_of(m, &mid), i as u8, "midpoint {i}");
            assert_eq!(
                code_of(f32::from_bits(m.to_bits() + 1).max(m.next_up()), &mid),
                i as u8 + 1
            );
        }
        assert_eq!(code_of(0.0, &mid), 7);
        assert_eq!(code_of(-0.0, &mid), 7);
    }

    #[test]
    fn packing_puts_the_first_element_high() {
        let q = quantize(&[1.0, -1.0, 0.0]);
        assert_eq!(q.codes, vec![0xf0, 0x77]);
        assert_eq!(q.absmax, vec![1.0]);
        let mut w = vec![0u32; words(3)];
        to_words(&q, &mut w);
        assert_eq!(w, vec![0x77f0, 1.0f32.to_bits()]);
    }
}
