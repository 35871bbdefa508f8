//! MXFP4, the 4-bit format gpt-oss's checkpoints store their routed experts in (OCP
//! Microscaling: FP4 E2M1 elements, one E8M0 scale per 32), decoded exactly as transformers 5.25
//! decodes it (`integrations/mxfp4.py`, `convert_moe_packed_tensors`;
//! `tests/fixtures/README.md` states it: "MXFP4 checkpoints").
//!
//! Data flow: `blocks` (E, rows, G, 16) u8 and `scales` (E, rows, G) u8, out-by-in: row `r` of
//! expert `e` is one output of its matrix, cut along its input into G blocks of 32 -> per block
//! 16 bytes -> 32 FP4 codes -> `FP4[code] * 2^(scale - 127)` -> W[e, r, 32g + i].
//!
//! Bit for bit:
//! - byte `b` of block `g` holds input `32g + 2b` in its low nibble and `32g + 2b + 1` in its
//!   high nibble;
//! - a nibble is E2M1 (bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa): codes 0..7
//!   are 0, 0.5, 1, 1.5, 2, 3, 4, 6, codes 8..15 the same negated, code 8 is -0.0;
//! - the scale byte `s` multiplies by `2^(s - 127)` as `ldexp` does, with no special values:
//!   `s = 0` is 2^-127 (subnormal products, exact in f32), `s = 255` is 2^128 (a product of 1 or
//!   more is then +-inf in f32, as transformers' float32 decode gives). For `s <= 252` every
//!   value is finite and exact in f32 and in bf16.
//!
//! Written by hand: no crate decodes MXFP4, and the decode is a table and a power of two.

/// The 16 FP4 E2M1 values by code (code 8 is -0.0, as transformers' table keeps the sign).
pub const FP4: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Values per block.
pub const BLOCK: usize = 32;

/// `2^(s - 127)` applied to `v` exactly as `ldexp(v, s - 127)` rounds it in f32: in two
/// power-of-two steps where one would leave f32's normal exponents (2^-127 is subnormal, 2^128
/// is past the largest power of two).
pub fn scaled(v: f32, s: u8) -> f32 {
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23); // normal exponents only
    match s {
        0 => v * pow2(-126) * 0.5,
        255 => v * pow2(127) * 2.0,
        s => v * pow2(s as i32 - 127),
    }
}

/// One block: 16 bytes and a scale into its 32 values, in input order.
pub fn decode_block(bytes: &[u8], scale: u8, out: &mut [f32]) {
    assert_eq!(
        (bytes.len(), out.len()),
        (BLOCK / 2, BLOCK),
        "an MXFP4 block is 16 bytes, 32 values"
    );
    for (b, &byte) in bytes.iter().enumerate() {
        out[2 * b] = scaled(FP4[(byte & 15) as usize], scale);
        out[2 * b + 1] = scaled(FP4[(byte >> 4) as usize], scale);
    }
}

/// Every block of `blocks` (`n` blocks of 16 bytes) with its scale (`n` bytes), out-by-in as
/// stored: `out[32k..32k + 32]` is block `k`. The shapes must agree (the loader checks them and
/// names the tensors first).
pub fn decode(blocks: &[u8], scales: &[u8], out: &mut [f32]) {
    assert_eq!(blocks.len(), scales.len() * BLOCK / 2, "blocks and scales disagree");
    assert_eq!(out.len(), scales.len() * BLOCK, "the output holds every value");
    let chunks = blocks.chunks_exact(BLOCK / 2).zip(scales).zip(out.chunks_exact_mut(BLOCK));
    for ((bytes, &s), o) in chunks {
        decode_block(bytes, s, o);
    }
}

/// [`decode`] of `e` experts of `rows` rows, each row `cols` inputs (a multiple of 32),
/// transposed as transformers' parameters are: `out[e][c][r]` = W[e, r, c] (in-to-out: gate_up
/// (E, C, 2I), down (E, I, C)).
pub fn decode_transposed(
    blocks: &[u8],
    scales: &[u8],
    (e, rows, cols): (usize, usize, usize),
) -> Vec<f32> {
    assert_eq!(cols % BLOCK, 0, "an MXFP4 row is whole blocks");
    assert_eq!(scales.len(), e * rows * cols / BLOCK, "scales of (E, rows, cols / 32)");
    let mut row = vec![0.0f32; cols];
    let mut out = vec![0.0f32; e * rows * cols];
    let g = cols / BLOCK;
    for x in 0..e {
        for r in 0..rows {
            let k = x * rows + r;
            decode(&blocks[k * g * 16..(k + 1) * g * 16], &scales[k * g..(k + 1) * g], &mut row);
            let m = &mut out[x * rows * cols..(x + 1) * rows * cols];
            for (c, &v) in row.iter().enumerate() {
                m[c * rows + r] = v;
            }
        }
    }
    out
}

/// `v` (a multiple of 32 values, rows of whole blocks) as MXFP4 by the OCP MX v1.0 rule, as
/// `tests/fixtures/make_mxfp4_fixture.py` quantizes: per block the shared exponent
/// `floor(log2(amax)) - 2` clamped to [-127, 127], each value divided by its power of two and
/// rounded to the nearest FP4 value (ties to the even code), saturating at +-6, the sign kept.
/// Values decoded from MXFP4 come back to the same values. Returns (blocks, scales).
pub fn quantize(v: &[f32]) -> (Vec<u8>, Vec<u8>) {
    assert_eq!(v.len() % BLOCK, 0, "MXFP4 holds whole blocks of 32");
    let mut blocks = vec![0u8; v.len() / 2];
    let mut scales = vec![0u8; v.len() / BLOCK];
    for ((x, b), s) in v.chunks_exact(BLOCK).zip(blocks.chunks_exact_mut(16)).zip(&mut scales) {
        let amax = x.iter().fold(0.0f32, |m, y| m.max(y.abs()));
        let e = if amax > 0.0 { (amax.log2().floor() as i32 - 2).clamp(-127, 127) } else { 0 };
        *s = (e + 127) as u8;
        let code = |y: f32| nearest_code(y / scaled(1.0, *s));
        for (k, byte) in b.iter_mut().enumerate() {
            *byte = code(x[2 * k]) | (code(x[2 * k + 1]) << 4);
        }
    }
    (blocks, scales)
}

/// The FP4 code nearest `y` (ties to the even code), saturating at +-6; the sign kept.
fn nearest_code(y: f32) -> u8 {
    let a = y.abs();
    let mut best = 0u8;
    for c in 1..8u8 {
        let (d, db) = ((FP4[c as usize] - a).abs(), (FP4[best as usize] - a).abs());
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    if y.is_sign_negative() { best | 8 } else { best }
}

/// Words of the device form of `n` values (a multiple of 32): the `n / 2` code bytes (value
/// `i` in byte `i / 2`, low nibble for even `i`, as the checkpoint stores them), then the
/// `n / 32` scale bytes padded to a whole word, each four bytes little-endian in one 32-bit word
/// (an f32 buffer element's bits on a device, as NF4's device form).
pub fn words(n: usize) -> usize {
    assert_eq!(n % BLOCK, 0, "MXFP4 holds whole blocks of 32");
    n / 8 + (n / BLOCK).div_ceil(4)
}

/// The device form ([`words`]) of a tensor's blocks (`n / 2` bytes, rows of whole blocks in
/// order) and scales (`n / 32` bytes). out: (`words(n)`), overwrites.
pub fn to_words(blocks: &[u8], scales: &[u8], out: &mut [u32]) {
    assert_eq!(blocks.len(), scales.len() * BLOCK / 2, "blocks and scales disagree");
    let n = scales.len() * BLOCK;
    assert_eq!(out.len(), words(n), "the device form of {n} values is words(n) words");
    let (codes, sc) = out.split_at_mut(n / 8);
    let pack = |bytes: &[u8], dst: &mut [u32]| {
        for (w, b) in dst.iter_mut().zip(bytes.chunks(4)) {
            let mut four = [0u8; 4];
            four[..b.len()].copy_from_slice(b);
            *w = u32::from_le_bytes(four);
        }
    };
    pack(blocks, codes);
    pack(scales, sc);
}

/// Value `i` of the device form of `n` values, whose word `w` is `word(w)`:
/// `FP4[code] * 2^(scale - 127)`.
#[inline]
pub fn value_at(word: impl Fn(usize) -> u32, n: usize, i: usize) -> f32 {
    let code = (word(i / 8) >> (8 * ((i / 2) % 4) + 4 * (i % 2))) & 15;
    let k = i / BLOCK;
    let scale = (word(n / 8 + k / 4) >> (8 * (k % 4))) & 0xff;
    scaled(FP4[code as usize], scale as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device form decodes to what the checkpoint's bytes decode to, every value.
    #[test]
    fn the_device_form_decodes_as_the_blocks() {
        let blocks: Vec<u8> = (0..4 * 16).map(|b| (b * 37 + 11) as u8).collect();
        let scales = [0u8, 127, 130, 252];
        let mut want = vec![0.0f32; 128];
        decode(&blocks, &scales, &mut want);
        let mut w = vec![0u32; words(128)];
        to_words(&blocks, &scales, &mut w);
        for (i, x) in want.iter().enumerate() {
            assert_eq!(value_at(|k| w[k], 128, i).to_bits(), x.to_bits(), "value {i}");
        }
    }

    /// Quantizing what MXFP4 decodes to gives back the same values (here with scales 100 to
    /// 140 and every code).
    #[test]
    fn decoded_values_quantize_back_to_themselves() {
        let blocks: Vec<u8> = (0..40 * 16).map(|b| (b * 29 + 3) as u8).collect();
        let scales: Vec<u8> = (0..40).map(|k| 100 + k as u8).collect();
        let mut v = vec![0.0f32; 40 * 32];
        decode(&blocks, &scales, &mut v);
        let (b2, s2) = quantize(&v);
        let mut back = vec![0.0f32; v.len()];
        decode(&b2, &s2, &mut back);
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    /// The table is E2M1 read field by field (sign, exponent with bias 1, mantissa).
    #[test]
    fn the_table_is_e2m1_by_its_fields() {
        for code in 0u8..16 {
            let (sign, exp, man) = (code >> 3, (code >> 1) & 3, code & 1);
            let mag = match exp {
                0 => 0.5 * man as f32,
                e => (1.0 + 0.5 * man as f32) * 2f32.powi(e as i32 - 1),
            };
            let want = if sign == 1 { -mag } else { mag };
            assert_eq!(FP4[code as usize].to_bits(), want.to_bits(), "code {code}");
        }
    }

    /// The scale is `ldexp` in f32 at both ends: 2^-127 subnormal, 2^128 overflowing.
    #[test]
    fn scales_are_ldexp_at_both_ends() {
        assert_eq!(scaled(1.0, 127), 1.0);
        assert_eq!(scaled(1.5, 128), 3.0);
        assert_eq!(scaled(0.5, 0), f32::from_bits(1 << 21)); // 2^-128
        assert_eq!(scaled(6.0, 0), 3.0 * 2f32.powi(-126));
        assert_eq!(scaled(0.5, 255), 2f32.powi(127));
        assert_eq!(scaled(1.0, 255), f32::INFINITY);
        assert_eq!(scaled(-0.0, 200).to_bits(), (-0.0f32).to_bits());
    }

    /// The low nibble is the first input of its pair.
    #[test]
    fn nibbles_are_low_first() {
        let mut bytes = [0u8; 16];
        bytes[0] = 0x71; // inputs 0 and 1: codes 1 (0.5), 7 (6)
        bytes[15] = 0x8F; // inputs 30 and 31: codes 15 (-6), 8 (-0)
        let mut out = [1.0f32; 32];
        decode_block(&bytes, 128, &mut out);
        assert_eq!((out[0], out[1], out[30]), (1.0, 12.0, -12.0));
        assert_eq!(out[31].to_bits(), (-0.0f32).to_bits());
        assert!(out[2..30].iter().all(|&v| v == 0.0));
    }

    /// Transposed as transformers' parameters: `out[e][c][r]`.
    #[test]
    fn transposed_is_in_to_out() {
        let (e, rows, cols) = (2, 3, 64);
        let blocks: Vec<u8> = (0..e * rows * cols / 2).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<u8> = (0..e * rows * cols / 32).map(|i| 120 + i as u8).collect();
        let mut plain = vec![0.0f32; e * rows * cols];
        decode(&blocks, &scales, &mut plain);
        let t = decode_transposed(&blocks, &scales, (e, rows, cols));
        for x in 0..e {
            for r in 0..rows {
                for c in 0..cols {
                    let (a, b) = (plain[(x * rows + r) * cols + c], t[(x * cols + c) * rows + r]);
                    assert_eq!(a.to_bits(), b.to_bits());
                }
            }
        }
    }
}
