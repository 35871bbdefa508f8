//! The AVX2 body of the 8-bit AdamW ([`crate::optim::adamw8bit`]): decode, update and stochastic
//! re-encode of one block, 8 elements per instruction. Bit-identical to the scalar body: the same
//! IEEE operations on each element (no FMA), the same code search and the same draws (tested in
//! `adamw8bit`'s tests).
//!
//! Data flow of one block: codes (u8) -> gather code values -> `* absmax` -> m, sqrt(v) ->
//! fp32 AdamW element update -> block absmax -> `t = x / absmax` -> bucket of t's bits -> one
//! 16-byte window row per lane, transposed -> compare -> (lo, hi) and their values -> `u * gap <
//! t - lo` with the element's draw (one splitmix64 hash per element gives m's and sqrt(v)'s) ->
//! code.

use std::arch::x86_64::*;

use crate::optim::adamw::AdamWStep;
use crate::optim::adamw8bit::{
    BUCKET_BASE, BUCKET_SHIFT, BUCKETS, Code, Draw, Q8Mut, QBLOCK, signed_code, stochastic_code,
    uniform, unsigned_code, update_elems, zero_index,
};

const LANES: usize = 8;

/// One block of the 8-bit update (see `adamw8bit::block_scalar`, which this reproduces bit for
/// bit, the same elements held: their count is returned). `scratch` holds the decoded m and
/// sqrt(v).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn update_block<const SMALL_LERP: bool, const IMAGE: bool>(
    b: Q8Mut<'_>,
    scratch: &mut [[f32; QBLOCK]; 2],
    s: &AdamWStep,
    grad_scale: f32,
    seed: u64,
) -> usize {
    let (sc, uc) = (signed_code(), unsigned_code());
    let n = b.p.len();
    let [m, v] = scratch;
    let (m, v) = (&mut m[..n], &mut v[..n]);
    decode(m, b.mc, b.ma[0], sc);
    decode(v, b.vc, b.va[0], uc);
    let held = update_elems::<SMALL_LERP, IMAGE>(b.p, b.img, b.g, m, v, s, grad_scale);
    let (am, av) = (absmax(m), absmax(v));
    let usable = |a: f32| a != 0.0 && a.is_finite();
    if usable(am) && usable(av) {
        encode_both(b.mc, b.vc, m, v, (am, av), seed);
        (b.ma[0], b.va[0]) = (am, av);
    } else {
        // A block of zeros (or of non-finite values): one moment at a time.
        b.ma[0] = encode(b.mc, m, sc, seed, Draw::M);
        b.va[0] = encode(b.vc, v, uc, seed, Draw::V);
    }
    held
}

/// [`encode`] of m (signed code, [`Draw::M`]) and sqrt(v) (unsigned code, [`Draw::V`]) in one
/// loop, given their scales `(am, av)`, both finite and non-zero: one hash per element gives
/// both draws.
#[target_feature(enable = "avx2")]
fn encode_both(
    mc: &mut [u8],
    vc: &mut [u8],
    m: &[f32],
    v: &[f32],
    (am, av): (f32, f32),
    seed: u64,
) {
    let (sc, uc) = (signed_code(), unsigned_code());
    let (inv_m, inv_v) = (1.0 / am, 1.0 / av);
    let body = m.len() / LANES * LANES;
    let (im, iv) = (_mm256_set1_ps(inv_m), _mm256_set1_ps(inv_v));
    // First every element's window offset, then the windows read back by scalar loads (a
    // separate pass, so the offsets come from memory, not from lane extracts).
    let mut offsets = [[0u32; QBLOCK]; 2];
    for i in (0..body).step_by(LANES) {
        let r = i..i + LANES;
        store_u32(
            &mut offsets[0][r.clone()],
            window_offsets(_mm256_mul_ps(load(&m[r.clone()]), im)),
        );
        store_u32(&mut offsets[1][r.clone()], window_offsets(_mm256_mul_ps(load(&v[r]), iv)));
    }
    for i in (0..body).step_by(LANES) {
        let r = i..i + LANES;
        let ih = index_hashes(i);
        let (tm, tv) =
            (_mm256_mul_ps(load(&m[r.clone()]), im), _mm256_mul_ps(load(&v[r.clone()]), iv));
        // SAFETY: the offsets are `window_offsets`', inside the windows.
        let (wm, wv) = unsafe {
            (
                windows(&sc.window, &offsets[0][r.clone()]),
                windows(&uc.window, &offsets[1][r.clone()]),
            )
        };
        let h = [hash4(seed, ih[0]), hash4(seed, ih[1])];
        let qm = codes_in_windows(tm, field8(h, Draw::M), wm);
        let qv = codes_in_windows(tv, field8(h, Draw::V), wv);
        mc[r.clone()].copy_from_slice(&low_bytes(qm));
        vc[r].copy_from_slice(&low_bytes(qv));
    }
    for i in body..m.len() {
        mc[i] = stochastic_code(sc, m[i] * inv_m, uniform(seed, i as u64, Draw::M));
        vc[i] = stochastic_code(uc, v[i] * inv_v, uniform(seed, i as u64, Draw::V));
    }
}

/// `out[i] = code[q[i]] * absmax`, as `adamw8bit::dequantize_block`.
#[target_feature(enable = "avx2")]
fn decode(out: &mut [f32], q: &[u8], absmax: f32, code: &Code) {
    let body = out.len() / LANES * LANES;
    let a = _mm256_set1_ps(absmax);
    for (o, q) in out[..body].chunks_exact_mut(LANES).zip(q[..body].chunks_exact(LANES)) {
        // Scalar loads: a byte indexes inside `scan` (257 values), so no bounds check remains.
        let c = |l: usize| code.scan[q[l] as usize];
        let c = _mm256_setr_ps(c(0), c(1), c(2), c(3), c(4), c(5), c(6), c(7));
        store(o, _mm256_mul_ps(c, a));
    }
    for (o, &q) in out[body..].iter_mut().zip(&q[body..]) {
        *o = code[q as usize] * absmax;
    }
}

/// Encode one block stochastically, as `adamw8bit::quantize_block_stochastic` (same scale, same
/// codes): returns the scale and writes one code per element.
#[target_feature(enable = "avx2")]
fn encode(codes: &mut [u8], x: &[f32], code: &Code, seed: u64, draw: Draw) -> f32 {
    let absmax = absmax(x);
    if absmax == 0.0 || !absmax.is_finite() {
        codes.fill(zero_index(code));
        return 0.0;
    }
    let inv = 1.0 / absmax;
    let body = x.len() / LANES * LANES;
    let lanes = codes[..body].chunks_exact_mut(LANES).zip(x[..body].chunks_exact(LANES));
    for (k, (q, x)) in lanes.enumerate() {
        let t = _mm256_mul_ps(load(x), _mm256_set1_ps(inv));
        let u = uniform8(seed, index_hashes(k * LANES), draw);
        q.copy_from_slice(&low_bytes(stochastic_codes(code, t, u)));
    }
    for (i, (q, &x)) in codes.iter_mut().zip(x).enumerate().skip(body) {
        *q = stochastic_code(code, x * inv, uniform(seed, i as u64, draw));
    }
    absmax
}

/// The largest `|x|`, skipping NaN: what `x.iter().fold(0, |a, v| a.max(v.abs()))` returns (the
/// maximum of a set does not depend on the order it is taken in).
#[target_feature(enable = "avx2")]
fn absmax(x: &[f32]) -> f32 {
    let body = x.len() / LANES * LANES;
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut acc = _mm256_setzero_ps();
    for c in x[..body].chunks_exact(LANES) {
        // `max_ps` returns its second operand when either is NaN: `acc`, never NaN, as
        // `f32::max` returns the operand that is not NaN.
        acc = _mm256_max_ps(_mm256_and_ps(load(c), magnitude), acc);
    }
    let mut lanes = [0f32; LANES];
    store(&mut lanes, acc);
    let a = lanes.iter().fold(0f32, |a, &l| a.max(l));
    x[body..].iter().fold(a, |a, &v| a.max(v.abs()))
}

/// Eight codes of `adamw8bit::stochastic_code`: `t` scaled values, `u` their draws.
#[target_feature(enable = "avx2")]
fn stochastic_codes(code: &Code, t: __m256, u: __m256) -> __m256i {
    let mut offsets = [0u32; LANES];
    store_u32(&mut offsets, window_offsets(t));
    // SAFETY: the offsets are `window_offsets`', inside the windows.
    codes_in_windows(t, u, unsafe { windows(&code.window, &offsets) })
}

/// The byte offsets in [`Code::window`] of the rows of `t` (`adamw8bit::row`: the bucket of |t|
/// from its bits, plus BUCKETS when t's sign bit is set; 16 bytes a row). All are below
/// `2 * BUCKETS * 16`, inside the window table.
#[target_feature(enable = "avx2")]
fn window_offsets(t: __m256) -> __m256i {
    let bits = _mm256_castps_si256(t);
    let mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fff_ffff));
    let b =
        _mm256_sub_epi32(_mm256_srli_epi32::<BUCKET_SHIFT>(mag), _mm256_set1_epi32(BUCKET_BASE));
    let b = _mm256_min_epi32(_mm256_max_epi32(b, _mm256_setzero_si256()), splat(BUCKETS - 1));
    let neg = _mm256_srai_epi32::<31>(bits);
    let row = _mm256_add_epi32(b, _mm256_and_si256(neg, splat(BUCKETS)));
    _mm256_slli_epi32::<4>(row)
}

/// The codes of `t` with draws `u`, given the windows of their rows (see [`windows`]).
#[target_feature(enable = "avx2")]
fn codes_in_windows(t: __m256, u: __m256, [below, at, above, s]: [__m256; 4]) -> __m256i {
    let s = _mm256_castps_si256(s);
    // `Code::first_at_least`: s, or s + 1 where code[s] < t (compare masks are -1 where true).
    let hi = _mm256_sub_epi32(s, _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(at, t)));
    let hi = _mm256_min_epi32(_mm256_max_epi32(hi, splat(1)), splat(255));
    // hi is s or s + 1 after the clamp too, so (code[hi - 1], code[hi]) is (below, at) or
    // (at, above).
    let at_s = _mm256_castsi256_ps(_mm256_cmpeq_epi32(hi, s));
    let c_lo = _mm256_blendv_ps(at, below, at_s);
    let c_hi = _mm256_blendv_ps(above, at, at_s);
    // `stochastic_code`'s test, u * gap < t - lo.
    let u_gap = _mm256_mul_ps(u, _mm256_sub_ps(c_hi, c_lo));
    let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(u_gap, _mm256_sub_ps(t, c_lo)));
    _mm256_sub_epi32(_mm256_sub_epi32(hi, splat(1)), up)
}

/// The [`Code::window`] rows at byte offsets `offsets` (8 lanes), as four vectors: `code[s -
/// 1]`, `code[s]`, `code[s + 1]` and `s` of each lane. One 16-byte load per lane, then a 4x4
/// transpose in each 128-bit half.
///
/// # Safety
/// Every offset must be that of a row of `window` (16 times an index inside it).
#[target_feature(enable = "avx2")]
unsafe fn windows(window: &[[u32; 4]], offsets: &[u32]) -> [__m256; 4] {
    let o: &[u32; LANES] = offsets.try_into().expect("a lane group");
    let base = window.as_ptr().cast::<u8>();
    // SAFETY: the caller keeps every offset on a row of `window`; 16 bytes, read unaligned.
    let w = |l: usize| unsafe { _mm_loadu_ps(base.add(o[l] as usize).cast()) };
    // Lane l in the low half, lane l + 4 in the high half.
    let a = _mm256_set_m128(w(4), w(0));
    let b = _mm256_set_m128(w(5), w(1));
    let c = _mm256_set_m128(w(6), w(2));
    let d = _mm256_set_m128(w(7), w(3));
    let (ab_lo, ab_hi) = (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    let (cd_lo, cd_hi) = (_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    let pd = _mm256_castps_pd;
    let ps = _mm256_castpd_ps;
    [
        ps(_mm256_unpacklo_pd(pd(ab_lo), pd(cd_lo))),
        ps(_mm256_unpackhi_pd(pd(ab_lo), pd(cd_lo))),
        ps(_mm256_unpacklo_pd(pd(ab_hi), pd(cd_hi))),
        ps(_mm256_unpackhi_pd(pd(ab_hi), pd(cd_hi))),
    ]
}

/// Stores 8 lanes. (AVX2's gather instructions are slower than scalar loads of stored offsets
/// on CPUs with the gather-data-sampling microcode fix: 4.8 against 1 cycle per element
/// measured on this project's Xeon; so offsets go through memory.)
#[target_feature(enable = "avx2")]
fn store_u32(out: &mut [u32], v: __m256i) {
    let out: &mut [u32; LANES] = out.try_into().expect("a lane group");
    // SAFETY: `out` is 32 writable bytes, what an unaligned store writes.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
}

/// `i * 0x9E37_79B9_7F4A_7C15` (wrapping) for the indices of a block: the first step of
/// [`uniform`]'s hash, the same for every block and both moments.
pub(crate) static INDEX_HASHES: [u64; QBLOCK] = {
    let mut t = [0u64; QBLOCK];
    let mut i = 0;
    while i < QBLOCK {
        t[i] = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        i += 1;
    }
    t
};

/// [`INDEX_HASHES`] of the lane group `i0..i0 + 8` (i0 a multiple of 8 inside a block), as two
/// vectors of four 64-bit lanes.
#[target_feature(enable = "avx2")]
fn index_hashes(i0: usize) -> [__m256i; 2] {
    let h: &[u64; LANES] = INDEX_HASHES[i0..i0 + LANES].try_into().expect("a lane group");
    // SAFETY: `h` is 8 readable u64 (64 bytes), what the two unaligned loads read.
    unsafe { [_mm256_loadu_si256(h.as_ptr().cast()), _mm256_loadu_si256(h[4..].as_ptr().cast())] }
}

/// Draws `uniform(seed, i, draw)` for the 8 lanes whose index hashes are `ih`.
#[target_feature(enable = "avx2")]
fn uniform8(seed: u64, ih: [__m256i; 2], draw: Draw) -> __m256 {
    field8([hash4(seed, ih[0]), hash4(seed, ih[1])], draw)
}

/// The draws `draw` of 8 lanes from their hashes `h` ([`hash4`] of lanes 0..4 and 4..8).
#[target_feature(enable = "avx2")]
fn field8(h: [__m256i; 2], draw: Draw) -> __m256 {
    let (lo, hi) = match draw {
        Draw::M => (_mm256_srli_epi64::<40>(h[0]), _mm256_srli_epi64::<40>(h[1])),
        Draw::V => (_mm256_srli_epi64::<16>(h[0]), _mm256_srli_epi64::<16>(h[1])),
    };
    // The low 32 bits of each 64-bit lane: [l0 l1 h0 h1 | l2 l3 h2 h3], then the 64-bit pairs
    // reordered to lane order, then the field's 24 bits.
    let d = _mm256_shuffle_ps::<0b10_00_10_00>(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi));
    let d = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_castps_si256(d));
    let d = _mm256_and_si256(d, _mm256_set1_epi32(0xff_ffff));
    // Exact: an integer below 2^24 converts exactly, and the product by 2^-24 is exact, as is
    // the scalar division by 2^24.
    _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(1.0 / 16_777_216.0))
}

/// `adamw8bit::draw_hash` of 4 lanes, from each 64-bit lane's index hash `ih`.
#[target_feature(enable = "avx2")]
fn hash4(seed: u64, ih: __m256i) -> __m256i {
    let mut z = _mm256_xor_si256(_mm256_set1_epi64x(seed as i64), ih);
    z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64::<30>(z)), 0xBF58_476D_1CE4_E5B9);
    z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64::<27>(z)), 0x94D0_49BB_1331_11EB);
    _mm256_xor_si256(z, _mm256_srli_epi64::<31>(z))
}

/// `a * k` (wrapping) on 64-bit lanes from AVX2's 32x32->64 multiplies:
/// `a_lo * k_lo + ((a_hi * k_lo + a_lo * k_hi) << 32)`.
#[target_feature(enable = "avx2")]
fn mul64(a: __m256i, k: u64) -> __m256i {
    let k_lo = _mm256_set1_epi64x((k & 0xffff_ffff) as i64);
    let k_hi = _mm256_set1_epi64x((k >> 32) as i64);
    let low = _mm256_mul_epu32(a, k_lo);
    let a_hi = _mm256_srli_epi64::<32>(a);
    let cross = _mm256_add_epi64(_mm256_mul_epu32(a_hi, k_lo), _mm256_mul_epu32(a, k_hi));
    _mm256_add_epi64(low, _mm256_slli_epi64::<32>(cross))
}

/// The low byte of each 32-bit lane (each in 0..=255), in lane order.
#[target_feature(enable = "avx2")]
fn low_bytes(v: __m256i) -> [u8; LANES] {
    let words = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let bytes = _mm_packus_epi16(words, words);
    _mm_cvtsi128_si64(bytes).to_le_bytes()
}

#[target_feature(enable = "avx2")]
fn splat(x: usize) -> __m256i {
    _mm256_set1_epi32(x as i32)
}

#[target_feature(enable = "avx2")]
fn load(x: &[f32]) -> __m256 {
    let x: &[f32; LANES] = x.try_into().expect("a lane group");
    // SAFETY: `x` is 8 readable f32, what an unaligned load reads.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

#[target_feature(enable = "avx2")]
fn store(out: &mut [f32], v: __m256) {
    let out: &mut [f32; LANES] = out.try_into().expect("a lane group");
    // SAFETY: `out` is 8 writable f32, what an unaligned store writes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::adamw8bit::check_encoder_on_edge_values;

    fn avx2() -> bool {
        let ok = std::arch::is_x86_feature_detected!("avx2");
        if !ok {
            eprintln!("skipped: this CPU has no AVX2");
        }
        ok
    }

    /// The encoder on the inputs that stress it (`check_encoder_on_edge_values`).
    #[test]
    fn encode_matches_the_scalar_encoder_on_edge_values() {
        if !avx2() {
            return;
        }
        // SAFETY: AVX2 was detected above.
        check_encoder_on_edge_values(LANES, |q, x, code, seed, draw| unsafe {
            encode(q, x, code, seed, draw)
        });
    }

    #[test]
    fn draws_match_the_scalar_draws() {
        if !avx2() {
            return;
        }
        for (seed, draw) in [0, 1, u64::MAX, 0x1234_5678_9abc_def0]
            .into_iter()
            .flat_map(|s| [(s, Draw::M), (s, Draw::V)])
        {
            for i0 in (0..QBLOCK).step_by(LANES) {
                let mut got = [0f32; LANES];
                // SAFETY: AVX2 was detected above.
                unsafe { store(&mut got, uniform8(seed, index_hashes(i0), draw)) };
                let want: Vec<f32> =
                    (0..LANES).map(|l| uniform(seed, (i0 + l) as u64, draw)).collect();
                assert_eq!(
                    got.map(f32::to_bits).to_vec(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }
}
