//! The AVX-512 body of the 8-bit AdamW ([`crate::optim::adamw8bit`]): decode, update and
//! stochastic re-encode of one block, 16 elements per instruction. Bit-identical to the scalar
//! body: the same IEEE operations on each element (no FMA), the same code search and the same
//! draws (tested in `adamw8bit`'s tests).
//!
//! Data flow of one block: codes (u8) -> code values from the 256-entry table held in 16
//! registers (each byte of the values by two byte permutes and a blend, 64 codes at a time)
//! -> `* absmax` -> m, sqrt(v) ->
//! fp32 AdamW element update (16 lanes) -> block absmax -> `t = x / absmax` -> bucket of t's
//! bits -> one 16-byte window row per lane, transposed -> compare -> (lo, hi) and their values
//! -> `u * gap < t - lo` with the element's draw (splitmix64 with native 64-bit multiplies, one
//! hash per element for both moments) -> code.
//!
//! What differs from the AVX2 body (`adamw8bit_avx2`): compares give masks, so selections are
//! masked adds and blends instead of blendv; `_mm512_mullo_epi64` replaces the three 32-bit
//! multiplies of each 64-bit one; decode reads the code from registers instead of one scalar
//! load per element; the codes are narrowed to bytes by one `vpmovdb`; each block asks for
//! the next block's cache lines before it starts.

use std::arch::x86_64::*;

use crate::optim::adamw::AdamWStep;
use crate::optim::adamw8bit::{
    BUCKET_BASE, BUCKET_SHIFT, BUCKETS, Code, Draw, Q8Mut, QBLOCK, signed_code, stochastic_code,
    uniform, unsigned_code, update_elems, zero_index,
};
use crate::optim::adamw8bit_avx2::INDEX_HASHES;

const LANES: usize = 16;

/// One block of the 8-bit update (see `adamw8bit::block_scalar`, which this reproduces bit for
/// bit, the same elements held: their count is returned). `scratch` holds the decoded m and
/// sqrt(v).
///
/// # Safety
/// The CPU must support AVX-512 F, DQ, BW and VBMI.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
pub(crate) unsafe fn update_block<const SMALL_LERP: bool, const IMAGE: bool>(
    b: Q8Mut<'_>,
    scratch: &mut [[f32; QBLOCK]; 2],
    s: &AdamWStep,
    grad_scale: f32,
    seed: u64,
) -> usize {
    let (sc, uc) = (signed_code(), unsigned_code());
    let n = b.p.len();
    prefetch_next_block(&b);
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

/// Asks for the cache lines of the block after `b` in the same buffers (masters, gradient,
/// codes; the image too when there is one): a block computes for thousands of cycles between
/// its streaming reads, too long for the hardware prefetcher to run ahead of them.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn prefetch_next_block(b: &Q8Mut<'_>) {
    let lines = |p: *const u8, bytes: usize| {
        for off in (0..bytes).step_by(64) {
            // A prefetch reads nothing architecturally and never faults: past the end of the
            // buffer it is a hint about an address, not an access.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(bytes + off).cast());
        }
    };
    lines(b.p.as_ptr().cast(), 4 * QBLOCK);
    lines(b.g.as_ptr().cast(), 4 * QBLOCK);
    lines(b.mc.as_ptr(), QBLOCK);
    lines(b.vc.as_ptr(), QBLOCK);
    if !b.img.is_empty() {
        lines(b.img.as_ptr().cast(), 2 * QBLOCK);
    }
}

/// [`encode`] of m (signed code, [`Draw::M`]) and sqrt(v) (unsigned code, [`Draw::V`]) in one
/// loop, given their scales `(am, av)`, both finite and non-zero: one hash per element gives
/// both draws.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
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
    let (im, iv) = (_mm512_set1_ps(inv_m), _mm512_set1_ps(inv_v));
    // First every element's window offset and draws, then the windows read back by scalar
    // loads (a separate pass, so the offsets come from memory, not from lane extracts, and the
    // draws' long multiply chains overlap the offsets' arithmetic instead of the searches).
    let mut offsets = [[0u32; QBLOCK]; 2];
    let mut draws = [[0f32; QBLOCK]; 2];
    for i in (0..body).step_by(LANES) {
        let r = i..i + LANES;
        let ih = index_hashes(i);
        let tm = _mm512_mul_ps(load(&m[r.clone()]), im);
        let tv = _mm512_mul_ps(load(&v[r.clone()]), iv);
        store_u32(&mut offsets[0][r.clone()], window_offsets(tm));
        store_u32(&mut offsets[1][r.clone()], window_offsets(tv));
        let h = [hash8(seed, ih[0]), hash8(seed, ih[1])];
        store(&mut draws[0][r.clone()], field16(h, Draw::M));
        store(&mut draws[1][r], field16(h, Draw::V));
    }
    for i in (0..body).step_by(LANES) {
        let r = i..i + LANES;
        let (tm, tv) =
            (_mm512_mul_ps(load(&m[r.clone()]), im), _mm512_mul_ps(load(&v[r.clone()]), iv));
        // SAFETY: the offsets are `window_offsets`', inside the windows.
        let (wm, wv) = unsafe {
            (
                windows(&sc.window, &offsets[0][r.clone()]),
                windows(&uc.window, &offsets[1][r.clone()]),
            )
        };
        let qm = codes_in_windows(tm, load(&draws[0][r.clone()]), wm);
        let qv = codes_in_windows(tv, load(&draws[1][r.clone()]), wv);
        store_bytes(&mut mc[r.clone()], qm);
        store_bytes(&mut vc[r], qv);
    }
    for i in body..m.len() {
        mc[i] = stochastic_code(sc, m[i] * inv_m, uniform(seed, i as u64, Draw::M));
        vc[i] = stochastic_code(uc, v[i] * inv_v, uniform(seed, i as u64, Draw::V));
    }
}

/// Elements per [`decode`] group: one register of codes.
const GROUP: usize = 64;

/// `out[i] = code[q[i]] * absmax`, as `adamw8bit::dequantize_block`, 64 codes at a time: each
/// of the 4 bytes of the code values is a 256-entry byte table in 4 registers, looked up by two
/// 128-entry byte permutes and a blend on the code's top bit; the 4 bytes are then interleaved
/// into f32 lanes.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn decode(out: &mut [f32], q: &[u8], absmax: f32, code: &Code) {
    let body = out.len() / GROUP * GROUP;
    let planes = byte_planes(code);
    // Byte 16 L + 4 j + e goes to lane 4 L + e of output register j (see `interleave`): so the
    // codes are first reordered, the element 16 j + 4 L + e to byte 16 L + 4 j + e.
    // SAFETY: `ORDER` is 64 readable bytes, what an unaligned 64-byte load reads.
    let order = unsafe { _mm512_loadu_si512(ORDER.as_ptr().cast()) };
    let a = _mm512_set1_ps(absmax);
    for (o, q) in out[..body].chunks_exact_mut(GROUP).zip(q[..body].chunks_exact(GROUP)) {
        let q: &[u8; GROUP] = q.try_into().expect("a group");
        // SAFETY: `q` is 64 readable bytes, what an unaligned 64-byte load reads.
        let q = _mm512_permutexvar_epi8(order, unsafe { _mm512_loadu_si512(q.as_ptr().cast()) });
        let top = _mm512_movepi8_mask(q);
        let bytes: [__m512i; 4] = std::array::from_fn(|k| {
            let [p0, p1, p2, p3] = planes[k];
            let lo = _mm512_permutex2var_epi8(p0, q, p1);
            let hi = _mm512_permutex2var_epi8(p2, q, p3);
            _mm512_mask_blend_epi8(top, lo, hi)
        });
        for (j, v) in interleave(bytes).into_iter().enumerate() {
            store(&mut o[j * LANES..][..LANES], _mm512_mul_ps(_mm512_castsi512_ps(v), a));
        }
    }
    for (o, &q) in out[body..].iter_mut().zip(&q[body..]) {
        *o = code[q as usize] * absmax;
    }
}

/// [`decode`]'s reordering of a group of codes: byte `16 L + 4 j + e` takes the code of element
/// `16 j + 4 L + e` (L, j, e in 0..4).
static ORDER: [u8; GROUP] = {
    let mut t = [0u8; GROUP];
    let mut p = 0;
    while p < GROUP {
        let (l, j, e) = (p / 16, p / 4 % 4, p % 4);
        t[p] = (16 * j + 4 * l + e) as u8;
        p += 1;
    }
    t
};

/// [`Code::bytes`] in registers: byte `k` of the 256 code values as four registers of 64.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn byte_planes(code: &Code) -> [[__m512i; 4]; 4] {
    std::array::from_fn(|k| {
        let plane = &code.bytes[k];
        // SAFETY: each quarter of `plane` is 64 readable bytes, what an unaligned load reads.
        std::array::from_fn(|h| unsafe { _mm512_loadu_si512(plane[h * 64..].as_ptr().cast()) })
    })
}

/// The f32 bits of 64 lanes from their 4 bytes (`bytes[k]` holds byte k of each), as four
/// registers: in each 128-bit quarter L, register j holds the bytes at positions 4 j..4 j + 4.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn interleave([b0, b1, b2, b3]: [__m512i; 4]) -> [__m512i; 4] {
    let (w01_lo, w01_hi) = (_mm512_unpacklo_epi8(b0, b1), _mm512_unpackhi_epi8(b0, b1));
    let (w23_lo, w23_hi) = (_mm512_unpacklo_epi8(b2, b3), _mm512_unpackhi_epi8(b2, b3));
    [
        _mm512_unpacklo_epi16(w01_lo, w23_lo),
        _mm512_unpackhi_epi16(w01_lo, w23_lo),
        _mm512_unpacklo_epi16(w01_hi, w23_hi),
        _mm512_unpackhi_epi16(w01_hi, w23_hi),
    ]
}

/// Encode one block stochastically, as `adamw8bit::quantize_block_stochastic` (same scale, same
/// codes): returns the scale and writes one code per element.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
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
        let t = _mm512_mul_ps(load(x), _mm512_set1_ps(inv));
        let u = uniform16(seed, index_hashes(k * LANES), draw);
        store_bytes(q, stochastic_codes(code, t, u));
    }
    for (i, (q, &x)) in codes.iter_mut().zip(x).enumerate().skip(body) {
        *q = stochastic_code(code, x * inv, uniform(seed, i as u64, draw));
    }
    absmax
}

/// The largest `|x|`, skipping NaN: what `x.iter().fold(0, |a, v| a.max(v.abs()))` returns (the
/// maximum of a set does not depend on the order it is taken in).
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn absmax(x: &[f32]) -> f32 {
    let body = x.len() / LANES * LANES;
    let mut acc = _mm512_setzero_ps();
    for c in x[..body].chunks_exact(LANES) {
        // `max_ps` returns its second operand when either is NaN: `acc`, never NaN, as
        // `f32::max` returns the operand that is not NaN.
        acc = _mm512_max_ps(_mm512_abs_ps(load(c)), acc);
    }
    let mut lanes = [0f32; LANES];
    store(&mut lanes, acc);
    let a = lanes.iter().fold(0f32, |a, &l| a.max(l));
    x[body..].iter().fold(a, |a, &v| a.max(v.abs()))
}

/// Sixteen codes of `adamw8bit::stochastic_code`: `t` scaled values, `u` their draws.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn stochastic_codes(code: &Code, t: __m512, u: __m512) -> __m512i {
    let mut offsets = [0u32; LANES];
    store_u32(&mut offsets, window_offsets(t));
    // SAFETY: the offsets are `window_offsets`', inside the windows.
    codes_in_windows(t, u, unsafe { windows(&code.window, &offsets) })
}

/// The byte offsets in [`Code::window`] of the rows of `t` (`adamw8bit::row`: the bucket of |t|
/// from its bits, plus BUCKETS when t's sign bit is set; 16 bytes a row). All are below
/// `2 * BUCKETS * 16`, inside the window table.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn window_offsets(t: __m512) -> __m512i {
    let bits = _mm512_castps_si512(t);
    let mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fff_ffff));
    let b =
        _mm512_sub_epi32(_mm512_srli_epi32::<{ BUCKET_SHIFT as u32 }>(mag), splat_i(BUCKET_BASE));
    let b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), splat(BUCKETS - 1));
    let neg = _mm512_movepi32_mask(bits);
    let row = _mm512_mask_add_epi32(b, neg, b, splat(BUCKETS));
    _mm512_slli_epi32::<4>(row)
}

/// The codes of `t` with draws `u`, given the windows of their rows (see [`windows`]).
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn codes_in_windows(t: __m512, u: __m512, [below, at, above, s]: [__m512; 4]) -> __m512i {
    let s = _mm512_castps_si512(s);
    let one = splat(1);
    // `Code::first_at_least`: s, or s + 1 where code[s] < t.
    let hi = _mm512_mask_add_epi32(s, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(at, t), s, one);
    let hi = _mm512_min_epi32(_mm512_max_epi32(hi, one), splat(255));
    // hi is s or s + 1 after the clamp too, so (code[hi - 1], code[hi]) is (below, at) or
    // (at, above).
    let at_s = _mm512_cmpeq_epi32_mask(hi, s);
    let c_lo = _mm512_mask_blend_ps(at_s, at, below);
    let c_hi = _mm512_mask_blend_ps(at_s, above, at);
    // `stochastic_code`'s test, u * gap < t - lo.
    let u_gap = _mm512_mul_ps(u, _mm512_sub_ps(c_hi, c_lo));
    let up = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(u_gap, _mm512_sub_ps(t, c_lo));
    let lo = _mm512_sub_epi32(hi, one);
    _mm512_mask_add_epi32(lo, up, lo, one)
}

/// The [`Code::window`] rows at byte offsets `offsets` (16 lanes), as four vectors: `code[s -
/// 1]`, `code[s]`, `code[s + 1]` and `s` of each lane. One 16-byte load per lane, then a 4x4
/// transpose in each 128-bit quarter.
///
/// # Safety
/// Every offset must be that of a row of `window` (16 times an index inside it).
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
unsafe fn windows(window: &[[u32; 4]], offsets: &[u32]) -> [__m512; 4] {
    let o: &[u32; LANES] = offsets.try_into().expect("a lane group");
    let base = window.as_ptr().cast::<u8>();
    // SAFETY: the caller keeps every offset on a row of `window`; 16 bytes, read unaligned.
    let w = |l: usize| unsafe { _mm_loadu_ps(base.add(o[l] as usize).cast()) };
    // Lanes l, l + 4, l + 8, l + 12 in the four quarters.
    let rows = |l: usize| {
        let r = _mm512_castps128_ps512(w(l));
        let r = _mm512_insertf32x4::<1>(r, w(l + 4));
        let r = _mm512_insertf32x4::<2>(r, w(l + 8));
        _mm512_insertf32x4::<3>(r, w(l + 12))
    };
    let (a, b, c, d) = (rows(0), rows(1), rows(2), rows(3));
    let (ab_lo, ab_hi) = (_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    let (cd_lo, cd_hi) = (_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    let pd = _mm512_castps_pd;
    let ps = _mm512_castpd_ps;
    [
        ps(_mm512_unpacklo_pd(pd(ab_lo), pd(cd_lo))),
        ps(_mm512_unpackhi_pd(pd(ab_lo), pd(cd_lo))),
        ps(_mm512_unpacklo_pd(pd(ab_hi), pd(cd_hi))),
        ps(_mm512_unpackhi_pd(pd(ab_hi), pd(cd_hi))),
    ]
}

/// Stores 16 lanes (offsets go through memory: see `adamw8bit_avx2::store_u32`).
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn store_u32(out: &mut [u32], v: __m512i) {
    let out: &mut [u32; LANES] = out.try_into().expect("a lane group");
    // SAFETY: `out` is 64 writable bytes, what an unaligned store writes.
    unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), v) };
}

/// [`INDEX_HASHES`] of the lane group `i0..i0 + 16` (i0 a multiple of 16 inside a block), as two
/// vectors of eight 64-bit lanes.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn index_hashes(i0: usize) -> [__m512i; 2] {
    let h: &[u64; LANES] = INDEX_HASHES[i0..i0 + LANES].try_into().expect("a lane group");
    // SAFETY: `h` is 16 readable u64 (128 bytes), what the two unaligned loads read.
    unsafe { [_mm512_loadu_si512(h.as_ptr().cast()), _mm512_loadu_si512(h[8..].as_ptr().cast())] }
}

/// Draws `uniform(seed, i, draw)` for the 16 lanes whose index hashes are `ih`.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn uniform16(seed: u64, ih: [__m512i; 2], draw: Draw) -> __m512 {
    field16([hash8(seed, ih[0]), hash8(seed, ih[1])], draw)
}

/// The draws `draw` of 16 lanes from their hashes `h` ([`hash8`] of lanes 0..8 and 8..16).
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn field16(h: [__m512i; 2], draw: Draw) -> __m512 {
    let d = match draw {
        // Bits 40..64: the high 32 bits of each 64-bit lane (the odd 32-bit lanes of h[0], then
        // those of h[1]), shifted down by 8.
        Draw::M => {
            let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            _mm512_srli_epi32::<8>(_mm512_permutex2var_epi32(h[0], odd, h[1]))
        }
        // Bits 16..40: the low 32 bits of each lane shifted down by 16 (the even 32-bit lanes),
        // less their top 8 bits.
        Draw::V => {
            let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let (lo, hi) = (_mm512_srli_epi64::<16>(h[0]), _mm512_srli_epi64::<16>(h[1]));
            _mm512_and_si512(_mm512_permutex2var_epi32(lo, even, hi), splat(0xff_ffff))
        }
    };
    // Exact: an integer below 2^24 converts exactly, and the product by 2^-24 is exact, as is
    // the scalar division by 2^24.
    _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(1.0 / 16_777_216.0))
}

/// `adamw8bit::draw_hash` of 8 lanes, from each 64-bit lane's index hash `ih`.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn hash8(seed: u64, ih: __m512i) -> __m512i {
    let k = |k: u64| _mm512_set1_epi64(k as i64);
    let mut z = _mm512_xor_si512(k(seed), ih);
    z = _mm512_mullo_epi64(
        _mm512_xor_si512(z, _mm512_srli_epi64::<30>(z)),
        k(0xBF58_476D_1CE4_E5B9),
    );
    z = _mm512_mullo_epi64(
        _mm512_xor_si512(z, _mm512_srli_epi64::<27>(z)),
        k(0x94D0_49BB_1331_11EB),
    );
    _mm512_xor_si512(z, _mm512_srli_epi64::<31>(z))
}

/// Stores the low byte of each 32-bit lane (each in 0..=255), in lane order.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn store_bytes(out: &mut [u8], v: __m512i) {
    let out: &mut [u8; LANES] = out.try_into().expect("a lane group");
    // SAFETY: `out` is 16 writable bytes, what an unaligned 16-byte store writes.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(v)) };
}

#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn splat(x: usize) -> __m512i {
    _mm512_set1_epi32(x as i32)
}

#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn splat_i(x: i32) -> __m512i {
    _mm512_set1_epi32(x)
}

#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn load(x: &[f32]) -> __m512 {
    let x: &[f32; LANES] = x.try_into().expect("a lane group");
    // SAFETY: `x` is 16 readable f32, what an unaligned load reads.
    unsafe { _mm512_loadu_ps(x.as_ptr()) }
}

#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
fn store(out: &mut [f32], v: __m512) {
    let out: &mut [f32; LANES] = out.try_into().expect("a lane group");
    // SAFETY: `out` is 16 writable f32, what an unaligned store writes.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::adamw8bit::{check_encoder_on_edge_values, dequantize_block};

    fn avx512() -> bool {
        let ok = crate::optim::adamw8bit::Kernel::Avx512.available();
        if !ok {
            eprintln!("skipped: this CPU lacks AVX-512 F, DQ, BW or VBMI");
        }
        ok
    }

    /// The encoder on the inputs that stress it (`check_encoder_on_edge_values`).
    #[test]
    fn encode_matches_the_scalar_encoder_on_edge_values() {
        if !avx512() {
            return;
        }
        // SAFETY: AVX-512 F, DQ, BW and VBMI were detected above.
        check_encoder_on_edge_values(LANES, |q, x, code, seed, draw| unsafe {
            encode(q, x, code, seed, draw)
        });
    }

    /// Every code index decodes to the scalar decoder's value, at every lane and partial length.
    #[test]
    fn decode_matches_the_scalar_decoder_for_every_index() {
        if !avx512() {
            return;
        }
        let q: Vec<u8> = (0..QBLOCK).map(|i| (i * 167 % 256) as u8).collect();
        for code in [signed_code(), unsigned_code()] {
            for absmax in [1.0f32, 3.7e-5, 0.0] {
                for len in [1, 15, 16, 17, 63, 64, 65, 200, QBLOCK - 1, QBLOCK] {
                    let (mut want, mut got) = (vec![0f32; len], vec![9f32; len]);
                    dequantize_block(&mut want, &q[..len], absmax, code);
                    // SAFETY: AVX-512 F, DQ, BW and VBMI were detected above.
                    unsafe { decode(&mut got, &q[..len], absmax, code) };
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "len {len}, absmax {absmax}");
                }
            }
        }
    }

    #[test]
    fn draws_match_the_scalar_draws() {
        if !avx512() {
            return;
        }
        for (seed, draw) in [0, 1, u64::MAX, 0x1234_5678_9abc_def0]
            .into_iter()
            .flat_map(|s| [(s, Draw::M), (s, Draw::V)])
        {
            for i0 in (0..QBLOCK).step_by(LANES) {
                let mut got = [0f32; LANES];
                // SAFETY: AVX-512 F, DQ, BW and VBMI were detected above.
                unsafe { store(&mut got, uniform16(seed, index_hashes(i0), draw)) };
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
