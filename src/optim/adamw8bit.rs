//! AdamW with blockwise 8-bit moments (`optimizer.memory: compact`), after Dettmers et al.,
//! "8-bit Optimizers via Block-wise Quantization" (2021): each block of [`QBLOCK`] elements
//! stores one fp32 scale (its absolute maximum) and one byte per element, an index into a
//! 256-entry *dynamic* code (a sign, a decimal exponent 10^-6..10^0 and a linear fraction whose
//! resolution grows with the exponent), so small values keep their relative precision.
//!
//! - `m` uses the signed code ([`signed_code`]): `m ≈ code[q] * absmax`.
//! - `v` is stored as `sqrt(v)` in the unsigned code ([`unsigned_code`]): `v ≈ (code[q] *
//!   absmax)²`. Quantising `sqrt(v)` rather than `v` gives it the dynamic range of `m` (both
//!   scale like the gradient), so an element whose `v` would fall below the code's smallest
//!   step (10^-6 of the block maximum, 10^-12 in `v`) does not decode to `v = 0` while its `m`
//!   survives, which would turn `m / (sqrt(v) + eps)` into `m / eps`.
//!
//! One step of a block: decode m and v to fp32, run the fp32 AdamW element update
//! ([`crate::optim::adamw`]'s, the same operations in the same order), re-encode with the
//! block's new absolute maximum, rounding stochastically (unbiased; see
//! [`quantize_block_stochastic`]) with a deterministic seed. Blocks are independent: the
//! result does not depend on the thread count.
//!
//! # Bodies
//!
//! A block runs on one of three bodies ([`Kernel`]): the scalar one here (the reference, and
//! what every CPU runs), the AVX2 one (`adamw8bit_avx2`, 8 lanes) or the AVX-512 one
//! (`adamw8bit_avx512`, 16 lanes: F, DQ, BW and VBMI; native 64-bit multiplies for the draws,
//! the code values decoded from byte tables held in registers, masks for the selections).
//! [`Kernel::detect`] picks the fastest the CPU runs at run time (AVX-512, else AVX2, else
//! scalar). All three are bit-identical: the same IEEE operations per element (no FMA), the same
//! draws and the same code search. The search finds the first code value `>= t` from the bits
//! of `t`: a bucket per 1/128 of a binary octave holds at most one code value, and a table row
//! per bucket and sign ([`Code::window`]) holds the index to start from and the values either
//! side, so one 16-byte load and one compare give both neighbours of `t`. Tests pin every body to
//! a checksum recorded from the original implementation and to each other, over thread counts.
//!
//! [`adamw8bit_update_with`] can also write the bf16 image of the new masters in the same pass
//! (`Bf16::from_f32`), for the fp32 segments too; masters and moments are unchanged by it.

use std::sync::OnceLock;

use horizon_backend::Bf16;
use rayon::iter::Either;
use rayon::prelude::*;

use crate::optim::adamw::{
    AdamWStep, BufferStep, adamw_update, adamw_update_image, held, update_one,
};

/// Elements per quantisation block (one fp32 scale each).
pub const QBLOCK: usize = 256;

/// Blocks per parallel task.
const TASK_BLOCKS: usize = 64;

/// bitsandbytes' `create_dynamic_map` with 7 exponent bits: for exponent e = 0..6, the
/// midpoints of `linspace(0.1, 1, n_e + 1)` scaled by 10^(e-6), where n_e = 2^e (signed, each
/// with both signs) or 2^(e+1) (unsigned); plus 0 and 1. Sorted ascending, 256 entries.
fn dynamic_code(signed: bool) -> [f32; 256] {
    let mut data: Vec<f64> = Vec::with_capacity(256);
    for e in 0..7 {
        let n = if signed { 1usize << e } else { 1usize << (e + 1) };
        let scale = 10f64.powi(e - 6);
        for j in 0..n {
            let lo = 0.1 + 0.9 * j as f64 / n as f64;
            let hi = 0.1 + 0.9 * (j + 1) as f64 / n as f64;
            let mid = scale * (lo + hi) / 2.0;
            data.push(mid);
            if signed {
                data.push(-mid);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    assert_eq!(data.len(), 256);
    data.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let mut out = [0f32; 256];
    for (o, d) in out.iter_mut().zip(&data) {
        *o = *d as f32;
    }
    out
}

/// Mantissa bits of `|t|` that pick a search bucket: 128 buckets per binary octave. The finest
/// gap between code values (0.9/128 ≈ 0.0070, the unsigned code's top decade) is wider than the
/// widest bucket (1/256 ≈ 0.0039), so a bucket holds at most one value and a search compares
/// one.
const BUCKET_MANT_BITS: u32 = 7;
/// Binary octaves below 1 with their own buckets (2^-24 .. 1, below the smallest code value,
/// 5.5e-7 ≈ 2^-20.8); smaller magnitudes share bucket 0.
const BUCKET_OCTAVES: i32 = 24;
/// Bucket 0, the octaves' buckets, and one for `|t| >= 1` (and anything larger).
pub(crate) const BUCKETS: usize = ((BUCKET_OCTAVES as usize) << BUCKET_MANT_BITS) + 2;
/// `bits(|t|) >> (23 - BUCKET_MANT_BITS)` (biased exponent, then the top mantissa bits) minus
/// this is the bucket of `|t|`, before clamping to `0..BUCKETS`: bucket 1 starts at 2^-24.
pub(crate) const BUCKET_BASE: i32 = ((127 - BUCKET_OCTAVES) << BUCKET_MANT_BITS) - 1;
/// The shift of `bits(|t|)` that leaves the exponent and the bucket's mantissa bits.
pub(crate) const BUCKET_SHIFT: i32 = 23 - BUCKET_MANT_BITS as i32;

/// The search bucket of `|t|` (any f32 bits: NaN and infinity land in the last). For an
/// exponent `e >= -24` it is `((e + 24) << 7) + mant7 + 1`, which is the biased exponent and
/// mantissa bits read as one integer, less [`BUCKET_BASE`]; smaller magnitudes go to 0.
#[inline]
fn bucket(t: f32) -> usize {
    let mag = (t.to_bits() & 0x7fff_ffff) as i32;
    ((mag >> BUCKET_SHIFT) - BUCKET_BASE).clamp(0, BUCKETS as i32 - 1) as usize
}

/// The row of [`Code::window`] for `t`: its bucket, in the second half when t's sign bit is set.
#[inline]
fn row(t: f32) -> usize {
    bucket(t) + (t.to_bits() >> 31) as usize * BUCKETS
}

/// The smallest magnitude of bucket `b` (bucket 0: 0).
fn bucket_floor(b: usize) -> f32 {
    if b == 0 {
        return 0.0;
    }
    let e = ((b - 1) >> BUCKET_MANT_BITS) as i32 - BUCKET_OCTAVES;
    let mant = ((b - 1) & ((1 << BUCKET_MANT_BITS) - 1)) as u32;
    f32::from_bits((((e + 127) as u32) << 23) | (mant << (23 - BUCKET_MANT_BITS)))
}

/// A 256-entry code (ascending values; `Deref`s to them) with a table that finds the first
/// value `>= t` with one compare instead of a branchy binary search (the hot loop of
/// [`quantize_block_stochastic`], once per moment element per step).
pub struct Code {
    /// The 256 values, then +inf.
    pub(crate) scan: [f32; 257],
    /// Per [`row`] of `t` (sign and bucket of `|t|`), the bits of `[code[s - 1], code[s],
    /// code[s + 1], s]` (0 and +inf past the ends), where `s` is the first index whose value can
    /// be `< t` while no earlier one is `>= t`; `s <= 255`. One 16-byte load finds the first
    /// value `>= t` (s or s + 1) and both neighbours of `t` (the AVX2 body loads nothing else).
    pub(crate) window: Box<[[u32; 4]]>,
    /// Byte `k` (little-endian) of the bits of each of the 256 values, per k: the byte tables
    /// the AVX-512 body decodes with.
    pub(crate) bytes: [[u8; 256]; 4],
}

impl std::ops::Deref for Code {
    type Target = [f32; 256];
    fn deref(&self) -> &[f32; 256] {
        self.scan.first_chunk().expect("257 >= 256")
    }
}

impl Code {
    fn new(values: [f32; 256]) -> Code {
        let first_at_least = |x: f32| values.partition_point(|&c| c < x).min(255);
        let first_above = |x: f32| values.partition_point(|&c| c <= x).min(255);
        // t >= 0 in bucket b: floor(b) <= t < floor(b + 1), so the values below t from the
        // first one >= floor(b) on lie in the bucket: one at most. t < 0: -floor(b + 1) < t <=
        // -floor(b): start at the first value above -floor(b + 1) (the last bucket, |t| >= 1,
        // is unbounded: start at 0, which is above every such t).
        let start = |r: usize| match (r / BUCKETS, r % BUCKETS) {
            (0, b) => first_at_least(bucket_floor(b)),
            (_, b) if b + 1 < BUCKETS => first_above(-bucket_floor(b + 1)),
            _ => 0,
        };
        let mut scan = [f32::INFINITY; 257];
        scan[..256].copy_from_slice(&values);
        let at = |i: Option<usize>| i.map_or(0.0, |i| scan[i]).to_bits();
        let window = (0..2 * BUCKETS)
            .map(|r| {
                let s = start(r);
                [at(s.checked_sub(1)), at(Some(s)), at(Some(s + 1)), s as u32]
            })
            .collect();
        let bytes = std::array::from_fn(|k| values.map(|c| (c.to_bits() >> (8 * k)) as u8));
        Code { scan, window, bytes }
    }

    /// `self.partition_point(|&c| c < t)`: the first index whose value is `>= t` (256: none).
    ///
    /// Branch-free: from the row's start `s`, at most one value is below `t` (a bucket holds at
    /// most one), and the values ascend, so the answer is `s`, or `s + 1` if `code[s] < t`.
    #[inline]
    pub fn first_at_least(&self, t: f32) -> usize {
        let [_, at, _, s] = self.window[row(t)];
        s as usize + (f32::from_bits(at) < t) as usize
    }
}

/// The signed dynamic code (for `m`), ascending: -0.993 .. 1.
pub fn signed_code() -> &'static Code {
    static CODE: OnceLock<Code> = OnceLock::new();
    CODE.get_or_init(|| Code::new(dynamic_code(true)))
}

/// The unsigned dynamic code (for `sqrt(v)`), ascending: 0 .. 1.
pub fn unsigned_code() -> &'static Code {
    static CODE: OnceLock<Code> = OnceLock::new();
    CODE.get_or_init(|| Code::new(dynamic_code(false)))
}

/// Index of the code value nearest to `x` (ties to the lower one).
#[inline]
fn nearest(code: &Code, x: f32) -> u8 {
    // First index whose value is >= x, then the closer of it and its predecessor.
    let hi = code.first_at_least(x);
    if hi == 0 {
        return 0;
    }
    if hi == 256 {
        return 255;
    }
    let lo = hi - 1;
    if x - code[lo] <= code[hi] - x { lo as u8 } else { hi as u8 }
}

/// Index of 0 in a code.
pub fn zero_index(code: &[f32; 256]) -> u8 {
    code.iter().position(|&c| c == 0.0).expect("the code holds 0") as u8
}

/// Encode one block: returns its scale (absolute maximum) and writes one code per element.
/// A block of zeros (or of non-finite values, which callers never pass) gets scale 0.
pub fn quantize_block(codes: &mut [u8], x: &[f32], code: &Code) -> f32 {
    debug_assert_eq!(codes.len(), x.len());
    let absmax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    if absmax == 0.0 || !absmax.is_finite() {
        codes.fill(zero_index(code));
        return 0.0;
    }
    let inv = 1.0 / absmax;
    for (q, &v) in codes.iter_mut().zip(x) {
        *q = nearest(code, v * inv);
    }
    absmax
}

/// [`quantize_block`] with stochastic rounding: an element between two codes goes to the upper
/// one with probability proportional to its distance from the lower one, so the encoding is
/// unbiased. Round-to-nearest would freeze a moment whose per-step change is below half a code
/// gap (v decays by beta2 = 0.999 per step, a 0.05% change): its decoded value would never
/// decay. The uniform draws are `draw`'s field of a hash of `seed` and the element's index:
/// deterministic.
pub fn quantize_block_stochastic(
    codes: &mut [u8],
    x: &[f32],
    code: &Code,
    seed: u64,
    draw: Draw,
) -> f32 {
    debug_assert_eq!(codes.len(), x.len());
    let absmax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    if absmax == 0.0 || !absmax.is_finite() {
        codes.fill(zero_index(code));
        return 0.0;
    }
    let inv = 1.0 / absmax;
    for (i, (q, &v)) in codes.iter_mut().zip(x).enumerate() {
        *q = stochastic_code(code, v * inv, uniform(seed, i as u64, draw));
    }
    absmax
}

/// The code of one scaled value `t` with draw `u` in [0, 1): the lower or the upper neighbour
/// of `t` among the code values, the upper with probability `p_hi`, its relative distance from
/// the lower one. `u < p_hi` is tested as `u * gap < t - lo` (a product, not a division: the
/// divider is the SIMD bodies' busiest unit).
#[inline]
pub(crate) fn stochastic_code(code: &Code, t: f32, u: f32) -> u8 {
    // Below the lowest value (hi = 0), t - lo < 0 picks index 0; above the highest (hi = 256),
    // t - lo > gap > u * gap picks 255; NaN compares false and picks lo. Branch-free: the draws
    // are unpredictable.
    let hi = code.first_at_least(t).clamp(1, 255);
    let lo = hi - 1;
    lo as u8 + (u * (code[hi] - code[lo]) < t - code[lo]) as u8
}

/// Which of an element's two draws ([`uniform`]): both come from one hash, so the two moments
/// of a block cost one hash per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Draw {
    /// The draw that re-encodes `m`: the hash's bits 40..64.
    M,
    /// The draw that re-encodes `sqrt(v)`: the hash's bits 16..40.
    V,
}

impl Draw {
    /// The shift that brings the draw's 24 bits to the bottom of the hash.
    pub(crate) const fn shift(self) -> u32 {
        match self {
            Draw::M => 40,
            Draw::V => 16,
        }
    }
}

/// `uniform`'s hash of (seed, index): splitmix64's finaliser.
#[inline]
pub(crate) fn draw_hash(seed: u64, i: u64) -> u64 {
    let mut z = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1) from (seed, index): 24 bits of splitmix64's finaliser, the field
/// `draw` names (disjoint fields of one hash are independent draws).
#[inline]
pub(crate) fn uniform(seed: u64, i: u64, draw: Draw) -> f32 {
    ((draw_hash(seed, i) >> draw.shift()) & 0xff_ffff) as f32 / (1u64 << 24) as f32
}

/// Decode one block into `out`.
pub fn dequantize_block(out: &mut [f32], codes: &[u8], absmax: f32, code: &Code) {
    for (o, &q) in out.iter_mut().zip(codes) {
        *o = code[q as usize] * absmax;
    }
}

/// Tensors with fewer elements than this keep fp32 moments (bitsandbytes' `min_8bit_size`):
/// norm weights and biases, whose few elements each see a large, shared gradient and would
/// otherwise set the scale of a block of matrix elements.
pub const MIN_8BIT_SIZE: usize = 4096;

/// Blocks needed for `n` elements.
pub fn blocks(n: usize) -> usize {
    n.div_ceil(QBLOCK)
}

/// Where one tensor's moments live inside a [`Moments8`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The tensor's elements in the flat buffer.
    pub start: usize,
    pub len: usize,
    pub store: Store,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// 8-bit: codes from `code`, scales from `block` (blocks start at the tensor's start).
    Q8 { code: usize, block: usize },
    /// fp32, from `at` in `m32` / `v32`.
    F32 { at: usize },
}

/// The segments of a buffer made of tensors of `tensors` elements (in buffer order).
pub fn segments(tensors: &[usize]) -> impl Iterator<Item = Segment> + '_ {
    let (mut start, mut code, mut block, mut at) = (0, 0, 0, 0);
    tensors.iter().map(move |&len| {
        let store = if len >= MIN_8BIT_SIZE {
            let s = Store::Q8 { code, block };
            code += len;
            block += blocks(len);
            s
        } else {
            let s = Store::F32 { at };
            at += len;
            s
        };
        let seg = Segment { start, len, store };
        start += len;
        seg
    })
}

/// Sizes of a buffer's moments: (8-bit elements, blocks, fp32 elements).
fn sizes(tensors: &[usize]) -> (usize, usize, usize) {
    segments(tensors).fold((0, 0, 0), |(n8, nb, n32), s| match s.store {
        Store::Q8 { .. } => (n8 + s.len, nb + blocks(s.len), n32),
        Store::F32 { .. } => (n8, nb, n32 + s.len),
    })
}

/// The AdamW moments of one flat parameter buffer: 8-bit per tensor of at least
/// [`MIN_8BIT_SIZE`] elements, fp32 for the smaller ones.
#[derive(Clone, Debug, PartialEq)]
pub struct Moments8 {
    /// Elements of each tensor of the buffer, in buffer order (the layout's).
    pub tensors: Vec<usize>,
    /// (N8) codes of `m` (signed code), of the 8-bit tensors in buffer order.
    pub m_codes: Vec<u8>,
    /// (N8) codes of `sqrt(v)` (unsigned code).
    pub v_codes: Vec<u8>,
    /// (blocks) scales of `m` and of `sqrt(v)`; each tensor's blocks start at its start.
    pub m_absmax: Vec<f32>,
    pub v_absmax: Vec<f32>,
    /// (N32) fp32 `m` and `v` of the small tensors, in buffer order.
    pub m32: Vec<f32>,
    pub v32: Vec<f32>,
}

impl Moments8 {
    /// Zero moments for a buffer of tensors of `tensors` elements.
    pub fn zeros(tensors: &[usize]) -> Self {
        let (n8, nb, n32) = sizes(tensors);
        Moments8 {
            tensors: tensors.to_vec(),
            m_codes: vec![zero_index(signed_code()); n8],
            v_codes: vec![zero_index(unsigned_code()); n8],
            m_absmax: vec![0.0; nb],
            v_absmax: vec![0.0; nb],
            m32: vec![0.0; n32],
            v32: vec![0.0; n32],
        }
    }

    /// Elements of the buffer.
    pub fn len(&self) -> usize {
        self.tensors.iter().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Host bytes of the moments of a buffer of tensors of `tensors` elements.
    pub fn bytes(tensors: &[usize]) -> usize {
        let (n8, nb, n32) = sizes(tensors);
        2 * n8 + 2 * 4 * nb + 2 * 4 * n32
    }

    /// Decoded copies of m and v (for tests and inspection; allocates).
    pub fn decode(&self) -> (Vec<f32>, Vec<f32>) {
        let n = self.len();
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        for seg in segments(&self.tensors) {
            let r = seg.start..seg.start + seg.len;
            let (m, v) = (&mut m[r.clone()], &mut v[r]);
            match seg.store {
                Store::F32 { at } => {
                    m.copy_from_slice(&self.m32[at..at + seg.len]);
                    v.copy_from_slice(&self.v32[at..at + seg.len]);
                }
                Store::Q8 { code, block } => {
                    for (b, (mb, vb)) in m.chunks_mut(QBLOCK).zip(v.chunks_mut(QBLOCK)).enumerate()
                    {
                        let c = code + b * QBLOCK..code + b * QBLOCK + mb.len();
                        dequantize_block(
                            mb,
                            &self.m_codes[c.clone()],
                            self.m_absmax[block + b],
                            signed_code(),
                        );
                        dequantize_block(
                            vb,
                            &self.v_codes[c],
                            self.v_absmax[block + b],
                            unsigned_code(),
                        );
                        vb.iter_mut().for_each(|x| *x *= *x);
                    }
                }
            }
        }
        (m, v)
    }

    /// Encode fp32 moments `m` and `v` (the buffer's length), rounding to the nearest code.
    pub fn encode(&mut self, m: &[f32], v: &[f32]) {
        assert!(m.len() == self.len() && v.len() == self.len(), "Moments8::encode: lengths differ");
        let mut s = [0f32; QBLOCK];
        for seg in segments(&self.tensors) {
            let r = seg.start..seg.start + seg.len;
            let (m, v) = (&m[r.clone()], &v[r]);
            match seg.store {
                Store::F32 { at } => {
                    self.m32[at..at + seg.len].copy_from_slice(m);
                    self.v32[at..at + seg.len].copy_from_slice(v);
                }
                Store::Q8 { code, block } => {
                    for (b, (mb, vb)) in m.chunks(QBLOCK).zip(v.chunks(QBLOCK)).enumerate() {
                        let c = code + b * QBLOCK..code + b * QBLOCK + mb.len();
                        self.m_absmax[block + b] =
                            quantize_block(&mut self.m_codes[c.clone()], mb, signed_code());
                        for (si, &vi) in s.iter_mut().zip(vb) {
                            *si = vi.sqrt();
                        }
                        self.v_absmax[block + b] =
                            quantize_block(&mut self.v_codes[c], &s[..vb.len()], unsigned_code());
                    }
                }
            }
        }
    }

    /// Mutable views for [`adamw8bit_update`].
    pub fn view_mut(&mut self) -> Moments8Mut<'_> {
        Moments8Mut {
            tensors: &self.tensors,
            m_codes: &mut self.m_codes,
            v_codes: &mut self.v_codes,
            m_absmax: &mut self.m_absmax,
            v_absmax: &mut self.v_absmax,
            m32: &mut self.m32,
            v32: &mut self.v32,
        }
    }
}

/// Borrowed moments of one buffer (see [`Moments8`]).
pub struct Moments8Mut<'a> {
    pub tensors: &'a [usize],
    pub m_codes: &'a mut [u8],
    pub v_codes: &'a mut [u8],
    pub m_absmax: &'a mut [f32],
    pub v_absmax: &'a mut [f32],
    pub m32: &'a mut [f32],
    pub v32: &'a mut [f32],
}

/// Which body runs the 8-bit blocks. All give bit-identical results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust, one element at a time: the reference, and what every CPU runs.
    Scalar,
    /// 8 elements per instruction with AVX2 (x86-64 CPUs that have it).
    Avx2,
    /// 16 elements per instruction with AVX-512 F, DQ, BW and VBMI (x86-64 CPUs that have them).
    Avx512,
}

impl Kernel {
    /// The fastest body this CPU runs.
    pub fn detect() -> Kernel {
        [Kernel::Avx512, Kernel::Avx2].into_iter().find(|k| k.available()).unwrap_or(Kernel::Scalar)
    }

    /// Whether this CPU runs this body.
    pub fn available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vbmi")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Avx2 | Kernel::Avx512 => false,
        }
    }
}

/// One AdamW step on a flat buffer with [`Moments8`] moments, on the fastest body this CPU runs
/// ([`Kernel::detect`]) and without an image: [`adamw8bit_update_with`].
pub fn adamw8bit_update(
    param: &mut [f32],
    grad: &[f32],
    q: Moments8Mut<'_>,
    step: &AdamWStep,
    grad_scale: f32,
    seed: u64,
) -> usize {
    adamw8bit_update_with(Kernel::detect(), param, None, grad, q, step, grad_scale, seed)
}

/// One AdamW step on a flat buffer with [`Moments8`] moments.
///
/// - `kernel`: the body that runs the 8-bit blocks (panics if this CPU cannot run it).
/// - `param`: (N) fp32 master weights, updated in place.
/// - `image`: (N) if given, overwritten in the same pass: `image[i] = Bf16::from_f32(param[i])`
///   of the updated masters. Masters and moments are the same with and without it.
/// - `grad`: (N) gradient before clipping (`grad_scale` is the clip coefficient).
/// - `q`: the buffer's moments: the 8-bit tensors are decoded, updated and re-encoded block by
///   block; the small tensors take [`adamw_update`]'s fp32 step.
///
/// Every element goes through the fp32 update of [`crate::optim::adamw`]; only the storage of
/// m and v between steps is 8-bit. `seed` drives the stochastic rounding of the re-encoding
/// (the caller derives it from the step and the buffer, so runs and resumes are reproducible).
/// Returns the elements held (an element whose new master or moment would not be finite keeps
/// its master and its old moments: [`crate::optim::adamw`]'s "Held elements"). The result and
/// the count depend on neither the kernel nor the thread count.
#[allow(clippy::too_many_arguments)]
pub fn adamw8bit_update_with(
    kernel: Kernel,
    param: &mut [f32],
    image: Option<&mut [Bf16]>,
    grad: &[f32],
    q: Moments8Mut<'_>,
    step: &AdamWStep,
    grad_scale: f32,
    seed: u64,
) -> usize {
    let step = BufferStep::uniform(*step);
    adamw8bit_update_groups(kernel, param, image, grad, q, &step, grad_scale, seed)
}

/// [`adamw8bit_update_with`] with each tensor's scalars from `step` (those of its exempt ranges
/// without weight decay: [`BufferStep::of`]).
#[allow(clippy::too_many_arguments)]
pub fn adamw8bit_update_groups(
    kernel: Kernel,
    param: &mut [f32],
    mut image: Option<&mut [Bf16]>,
    grad: &[f32],
    q: Moments8Mut<'_>,
    step: &BufferStep<'_>,
    grad_scale: f32,
    seed: u64,
) -> usize {
    assert!(kernel.available(), "adamw8bit_update: this CPU cannot run the {kernel:?} body");
    check_sizes(param, image.as_deref(), grad, &q);
    let mut held = 0;
    for (t, seg) in segments(q.tensors).enumerate() {
        let r = seg.start..seg.start + seg.len;
        let step = &step.of(r.clone());
        let (p, g) = (&mut param[r.clone()], &grad[r.clone()]);
        let img = image.as_deref_mut().map(|i| &mut i[r]);
        match seg.store {
            Store::F32 { at } => {
                let (m, v) = (&mut q.m32[at..at + seg.len], &mut q.v32[at..at + seg.len]);
                held += match img {
                    Some(img) => adamw_update_image(p, img, g, m, v, step, grad_scale),
                    None => adamw_update(p, g, m, v, step, grad_scale),
                };
            }
            Store::Q8 { code, block } => {
                let (c, bl) = (code..code + seg.len, block..block + blocks(seg.len));
                let seg = Q8Mut {
                    p,
                    img: &mut [],
                    g,
                    mc: &mut q.m_codes[c.clone()],
                    vc: &mut q.v_codes[c],
                    ma: &mut q.m_absmax[bl.clone()],
                    va: &mut q.v_absmax[bl],
                };
                let seed = seed ^ (t as u64).wrapping_mul(0x8EBC_6AF0_9C88_C6E3);
                held += update_segment(kernel, seg, img, step, grad_scale, seed);
            }
        }
    }
    held
}

/// Panics (a caller's bug) unless the buffers and the moments agree in size.
fn check_sizes(param: &[f32], image: Option<&[Bf16]>, grad: &[f32], q: &Moments8Mut<'_>) {
    let n: usize = q.tensors.iter().sum();
    assert!(
        param.len() == n && grad.len() == n && image.is_none_or(|i| i.len() == n),
        "adamw8bit_update: lengths differ: param {}, grad {}, image {:?}, moments {n}",
        param.len(),
        grad.len(),
        image.map(<[Bf16]>::len),
    );
    let (n8, nb, n32) = sizes(q.tensors);
    assert!(q.m_codes.len() == n8 && q.v_codes.len() == n8 && q.m32.len() == n32);
    assert!(q.m_absmax.len() == nb && q.v_absmax.len() == nb && q.v32.len() == n32);
}

/// One 8-bit tensor, or one task of it, or one block: the masters, their image, the gradient
/// and the moments' codes and scales over the same elements.
pub(crate) struct Q8Mut<'a> {
    /// (n) fp32 masters, updated in place.
    pub p: &'a mut [f32],
    /// (n) bf16 image of the updated masters, overwritten; empty when none is written.
    pub img: &'a mut [Bf16],
    /// (n) gradient before clipping.
    pub g: &'a [f32],
    /// (n) codes of m and of sqrt(v).
    pub mc: &'a mut [u8],
    pub vc: &'a mut [u8],
    /// (blocks) scales of m and of sqrt(v).
    pub ma: &'a mut [f32],
    pub va: &'a mut [f32],
}

impl Q8Mut<'_> {
    /// Block `b` (the image only if `IMAGE`).
    fn block<const IMAGE: bool>(&mut self, b: usize) -> Q8Mut<'_> {
        let r = b * QBLOCK..((b + 1) * QBLOCK).min(self.p.len());
        Q8Mut {
            p: &mut self.p[r.clone()],
            img: if IMAGE { &mut self.img[r.clone()] } else { &mut [] },
            g: &self.g[r.clone()],
            mc: &mut self.mc[r.clone()],
            vc: &mut self.vc[r],
            ma: &mut self.ma[b..b + 1],
            va: &mut self.va[b..b + 1],
        }
    }
}

/// One 8-bit tensor, in parallel tasks of [`TASK_BLOCKS`] blocks (a fixed split: each task's
/// seed is derived from its index, so the thread count does not matter). Returns the elements
/// held.
fn update_segment(
    kernel: Kernel,
    seg: Q8Mut<'_>,
    image: Option<&mut [Bf16]>,
    s: &AdamWStep,
    grad_scale: f32,
    seed: u64,
) -> usize {
    let task = TASK_BLOCKS * QBLOCK;
    let images = match image {
        Some(i) => Either::Left(i.par_chunks_mut(task).map(Some)),
        None => Either::Right(
            rayon::iter::repeat_n((), seg.ma.len().div_ceil(TASK_BLOCKS)).map(|()| None),
        ),
    };
    seg.p
        .par_chunks_mut(task)
        .zip(seg.g.par_chunks(task))
        .zip(seg.mc.par_chunks_mut(task))
        .zip(seg.vc.par_chunks_mut(task))
        .zip(seg.ma.par_chunks_mut(TASK_BLOCKS))
        .zip(seg.va.par_chunks_mut(TASK_BLOCKS))
        .zip(images)
        .enumerate()
        .map(|(t, ((((((p, g), mc), vc), ma), va), img))| {
            let seed = seed ^ (t as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            let image = img.is_some();
            let task = Q8Mut { p, img: img.unwrap_or_default(), g, mc, vc, ma, va };
            match (s.lerp_weight_small(), image) {
                (true, false) => update_task::<true, false>(kernel, task, s, grad_scale, seed),
                (true, true) => update_task::<true, true>(kernel, task, s, grad_scale, seed),
                (false, false) => update_task::<false, false>(kernel, task, s, grad_scale, seed),
                (false, true) => update_task::<false, true>(kernel, task, s, grad_scale, seed),
            }
        })
        .sum()
}

/// Scale the moments as if their gradients had been multiplied by `r`: `m *= r`, `v *= r²`.
/// Exact in the 8-bit codes: only the block scales change.
pub fn rescale_moments8(q: Moments8Mut<'_>, r: f32) {
    q.m_absmax.iter_mut().for_each(|a| *a *= r);
    // `sqrt(v)` is stored.
    q.v_absmax.iter_mut().for_each(|a| *a *= r);
    q.m32.iter_mut().for_each(|m| *m *= r);
    q.v32.iter_mut().for_each(|v| *v *= r * r);
}

/// One task: its blocks in order, each with its own seed. Returns the elements held.
fn update_task<const SMALL_LERP: bool, const IMAGE: bool>(
    kernel: Kernel,
    mut task: Q8Mut<'_>,
    s: &AdamWStep,
    grad_scale: f32,
    seed: u64,
) -> usize {
    let mut scratch = [[0f32; QBLOCK]; 2];
    let mut held = 0;
    for b in 0..task.ma.len() {
        let block = task.block::<IMAGE>(b);
        let bs = seed ^ (b as u64).wrapping_mul(0xA076_1D64_78BD_642F);
        held += match kernel {
            Kernel::Scalar => {
                block_scalar::<SMALL_LERP, IMAGE>(block, &mut scratch, s, grad_scale, bs)
            }
            simd => block_simd::<SMALL_LERP, IMAGE>(simd, block, &mut scratch, s, grad_scale, bs),
        };
    }
    held
}

/// One block: decode m and sqrt(v) into `scratch`, the fp32 update, re-encode (both with the
/// block's seed: m with each element's [`Draw::M`], sqrt(v) with its [`Draw::V`]). Returns the
/// elements held ([`update_elems`]).
fn block_scalar<const SMALL_LERP: bool, const IMAGE: bool>(
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
    dequantize_block(m, b.mc, b.ma[0], sc);
    dequantize_block(v, b.vc, b.va[0], uc);
    let held = update_elems::<SMALL_LERP, IMAGE>(b.p, b.img, b.g, m, v, s, grad_scale);
    b.ma[0] = quantize_block_stochastic(b.mc, m, sc, seed, Draw::M);
    b.va[0] = quantize_block_stochastic(b.vc, v, uc, seed, Draw::V);
    held
}

/// [`block_scalar`] on a SIMD body (`Kernel::Avx2` or `Kernel::Avx512`).
fn block_simd<const SMALL_LERP: bool, const IMAGE: bool>(
    kernel: Kernel,
    b: Q8Mut<'_>,
    scratch: &mut [[f32; QBLOCK]; 2],
    s: &AdamWStep,
    grad_scale: f32,
    seed: u64,
) -> usize {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `adamw8bit_update_with` refuses a kernel this CPU lacks (`Kernel::available`).
    unsafe {
        use crate::optim::{adamw8bit_avx2 as avx2, adamw8bit_avx512 as avx512};
        match kernel {
            Kernel::Avx2 => {
                avx2::update_block::<SMALL_LERP, IMAGE>(b, scratch, s, grad_scale, seed)
            }
            Kernel::Avx512 => {
                avx512::update_block::<SMALL_LERP, IMAGE>(b, scratch, s, grad_scale, seed)
            }
            Kernel::Scalar => unreachable!("the scalar body is block_scalar"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (scratch, s, grad_scale, seed);
        unreachable!("adamw8bit_update_with refuses {kernel:?} off x86-64 ({})", b.p.len());
    }
}

/// The fp32 AdamW element update of one block's decoded moments (`v` holds sqrt(v) in and out):
/// `v² -> update_one -> sqrt` (AdamW's update with a product by the reciprocal of the bias
/// correction for one of its divisions), and with `IMAGE` `img = bf16(p)`. An element whose
/// new master, m or v would not be finite is held ([`crate::optim::adamw`]'s "Held
/// elements"): its master and its decoded m and sqrt(v) stay as they were (the block is
/// re-encoded with them). Returns the elements held. Inlined into each body, so the AVX2
/// body's copy is vectorised with AVX2; the same IEEE operations, the same elements held,
/// either way.
#[inline(always)]
pub(crate) fn update_elems<const SMALL_LERP: bool, const IMAGE: bool>(
    p: &mut [f32],
    img: &mut [Bf16],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWStep,
    grad_scale: f32,
) -> usize {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let img = if IMAGE { &mut img[..n] } else { img };
    let mut count = 0u32;
    for i in 0..n {
        let (pi, mi, vi) =
            update_one::<SMALL_LERP, true>(p[i], g[i], m[i], v[i] * v[i], s, grad_scale);
        // The old sqrt(v) is kept as it is: sqrt(v[i]²) would not give it back where v[i]²
        // underflows.
        let h = held(pi, mi, vi);
        p[i] = keep_if(h, p[i], pi);
        m[i] = keep_if(h, m[i], mi);
        v[i] = keep_if(h, v[i], vi.sqrt());
        count += u32::from(h);
        if IMAGE {
            img[i] = Bf16::from_f32(p[i]);
        }
    }
    count as usize
}

/// `old` where `keep`, else `new`: a select on the bits (and, and-not, or), which the scalar
/// body's baseline x86-64 build (SSE2, no blend) vectorises; with an `if` its loop ran 2.6x
/// slower, with this 1.35x (the element update alone, against no test at all).
#[inline(always)]
fn keep_if(keep: bool, old: f32, new: f32) -> f32 {
    let mask = u32::from(keep).wrapping_neg();
    f32::from_bits((old.to_bits() & mask) | (new.to_bits() & !mask))
}

/// A SIMD encoder of `lanes` lanes against the scalar [`quantize_block_stochastic`] on the
/// inputs that stress it: code values and their neighbours (`t` hits the table exactly: the
/// block maximum is 1), midpoints, signed zeros, infinities, values below the smallest step,
/// NaN (skipped by the maximum), and partial lane groups. For the bodies' tests.
/// Each value of `code`, its negation, its neighbours in f32 and the midpoints between
/// consecutive values: the inputs at which a code search can go wrong. For the tests.
#[cfg(test)]
pub(crate) fn code_neighbourhood(code: &Code) -> Vec<f32> {
    let mut x = Vec::with_capacity(5 * code.len());
    for (i, &c) in code.iter().enumerate() {
        x.extend([c, -c, f32::from_bits(c.to_bits() + 1)]);
        if c != 0.0 {
            x.push(f32::from_bits(c.to_bits() - 1));
        }
        if i > 0 {
            x.push((c + code[i - 1]) / 2.0);
        }
    }
    x
}

#[cfg(test)]
pub(crate) fn check_encoder_on_edge_values(
    lanes: usize,
    encode: impl Fn(&mut [u8], &[f32], &Code, u64, Draw) -> f32,
) {
    for (code, draw) in [(signed_code(), Draw::M), (unsigned_code(), Draw::V)] {
        let mut x: Vec<f32> = vec![1.0, 0.0, -0.0, 1e-30, -1e-30, f32::NAN, -f32::NAN];
        x.extend([f32::INFINITY, 2.0, -2.0, f32::MIN_POSITIVE, -f32::MIN_POSITIVE]);
        x.extend(code_neighbourhood(code));
        for len in [1, lanes - 1, lanes, lanes + 1, 100, QBLOCK - 1, QBLOCK] {
            for chunk in x.chunks(len) {
                let mut x = chunk.to_vec();
                x[0] = 1.0; // the block's maximum: t is x itself
                let (mut want, mut got) = (vec![0u8; x.len()], vec![0u8; x.len()]);
                let a = quantize_block_stochastic(&mut want, &x, code, 77, draw);
                let b = encode(&mut got, &x, code, 77, draw);
                assert_eq!(a.to_bits(), b.to_bits(), "absmax, len {len}");
                assert_eq!(got, want, "codes, len {len}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::adamw::{AdamWConfig, adamw_update_serial};
    use crate::rng::SplitMix64;

    #[test]
    fn codes_are_sorted_and_span_the_range() {
        for (code, lo) in [(signed_code(), -1.0f32), (unsigned_code(), 0.0)] {
            assert!(code.windows(2).all(|w| w[0] < w[1]), "strictly ascending");
            assert_eq!(code[255], 1.0);
            assert!(code[0] >= lo && code[0] < lo + 0.01, "{}", code[0]);
            assert_eq!(code[zero_index(code) as usize], 0.0);
        }
        // The smallest non-zero magnitude is 0.55e-6 of the block maximum.
        let sc = signed_code();
        let z = zero_index(sc) as usize;
        assert!((sc[z + 1] - 0.55e-6).abs() < 1e-9, "{}", sc[z + 1]);
    }

    /// The bucket table finds what a binary search finds, for every kind of input.
    #[test]
    fn first_at_least_is_a_binary_search() {
        let mut rng = SplitMix64::new(13);
        for code in [signed_code(), unsigned_code()] {
            let mut ts: Vec<f32> = vec![0.0, -0.0, 1.0, -1.0, 1.0 + f32::EPSILON, 2.0, -2.0];
            ts.extend([f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE, 1e-30, -1e-30]);
            ts.extend(code_neighbourhood(code));
            let mut x = vec![0f32; 200_000];
            rng.fill_normal(&mut x, 1.0);
            for (i, v) in x.iter().enumerate() {
                // Magnitudes over eight decades.
                ts.push((v * 10f32.powi(-((i % 9) as i32))).clamp(-1.0, 1.0));
            }
            for t in ts {
                let want = code.partition_point(|&c| c < t);
                assert_eq!(code.first_at_least(t), want, "t = {t:e}");
            }
            let steps = (0..BUCKETS)
                .map(|b| {
                    let (lo, hi) = (bucket_floor(b), bucket_floor((b + 1).min(BUCKETS - 1)));
                    let n = |sign: f32| {
                        code.iter().filter(|&&c| (sign * c) >= lo && (sign * c) < hi).count()
                    };
                    n(1.0).max(n(-1.0))
                })
                .max();
            assert!(steps <= Some(2), "a bucket holds {steps:?} values");
        }
        assert!(signed_code().first_at_least(f32::NAN) <= 256, "NaN stays in bounds");
    }

    /// Round-trip error: at most half the gap between neighbouring codes, relative to the
    /// block maximum (0.7% of it for values in the top decade); signs are kept.
    #[test]
    fn round_trip_error_bounds() {
        let mut rng = SplitMix64::new(7);
        for code in [signed_code(), unsigned_code()] {
            let signed = code[0] < 0.0;
            let n = 1000;
            let mut x = vec![0f32; n];
            rng.fill_normal(&mut x, 1.0);
            for (i, v) in x.iter_mut().enumerate() {
                // Magnitudes over six decades.
                *v *= 10f32.powi(-((i % 7) as i32));
                if !signed {
                    *v = v.abs();
                }
            }
            let mut codes = vec![0u8; n];
            let absmax = quantize_block(&mut codes, &x, code);
            let mut y = vec![0f32; n];
            dequantize_block(&mut y, &codes, absmax, code);
            for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
                let t = a / absmax;
                let k = code.partition_point(|&c| c < t).clamp(1, 255);
                let gap = code[k] - code[k - 1];
                let err = (a - b).abs() / absmax;
                assert!(err <= gap / 2.0 * 1.0001 + 1e-7, "{i}: {a} -> {b}, gap {gap}");
                // The top decade (0.1..1 of the maximum) has the finest steps: 0.9/64 of
                // the maximum (signed), 0.9/128 (unsigned).
                if a.abs() >= 0.1 * absmax {
                    let top = if signed { 0.9 / 64.0 } else { 0.9 / 128.0 };
                    assert!(err <= top / 2.0 * 1.0001, "{i}: {a} -> {b}");
                }
                assert!(a.signum() == b.signum() || b == 0.0, "{i}: sign of {a} -> {b}");
            }
            // The maximum itself is exact (positive) or within the signed code's asymmetry.
            let imax = x.iter().position(|&v| v.abs() == absmax).unwrap();
            assert!((y[imax] - x[imax]).abs() <= 0.0071 * absmax);
        }
    }

    #[test]
    fn zeros_and_block_edges() {
        // All zeros: scale 0, decodes to exact zeros.
        let mut codes = vec![7u8; QBLOCK];
        let absmax = quantize_block(&mut codes, &[0.0; QBLOCK], signed_code());
        assert_eq!(absmax, 0.0);
        let mut y = vec![1f32; QBLOCK];
        dequantize_block(&mut y, &codes, absmax, signed_code());
        assert!(y.iter().all(|&v| v == 0.0));
        // A zero inside a block stays exactly zero.
        let x = [0.5f32, 0.0, -0.25, 1e-9];
        let mut c = [0u8; 4];
        let a = quantize_block(&mut c, &x, signed_code());
        let mut y = [9f32; 4];
        dequantize_block(&mut y, &c, a, signed_code());
        assert_eq!(y[1], 0.0);
        assert_eq!(y[3], 0.0, "below the smallest code step");
        // Blocks are independent: a huge value in block 1 does not disturb block 0, and a
        // partial last block (n not a multiple of QBLOCK) works. (At least MIN_8BIT_SIZE
        // elements: a smaller tensor keeps fp32 moments.)
        let n = 16 * QBLOCK + 37;
        let mut p = vec![0f32; n];
        let mut g = vec![1e-3f32; n];
        g[QBLOCK + 5] = 1e3;
        let mut q = Moments8::zeros(&[n]);
        assert_eq!(q.m_absmax.len(), 17);
        let cfg = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        adamw8bit_update(&mut p, &g, q.view_mut(), &AdamWStep::new(&cfg, 1, 1e-3), 1.0, 1);
        let (m, v) = q.decode();
        for i in (0..QBLOCK).chain(2 * QBLOCK..n) {
            assert!((m[i] - 1e-4).abs() <= 1e-4 * 0.01, "m[{i}] = {}", m[i]);
            assert!((v[i] - 1e-9).abs() <= 1e-9 * 0.02, "v[{i}] = {}", v[i]);
        }
        // Step 1 of Adam moves every parameter by about lr.
        assert!(p.iter().all(|&x| (x + 1e-3).abs() < 2e-5), "{:?}", &p[..4]);
    }

    /// Over many steps the 8-bit update tracks the fp32 one.
    #[test]
    fn tracks_fp32_adamw() {
        let n = 3 * QBLOCK + 11;
        let mut rng = SplitMix64::new(3);
        let mut p32 = vec![0f32; n];
        rng.fill_normal(&mut p32, 0.02);
        let mut p8 = p32.clone();
        let p0 = p32.clone();
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let mut q = Moments8::zeros(&[n]);
        let cfg = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
        let mut g = vec![0f32; n];
        for t in 1..=50 {
            rng.fill_normal(&mut g, 1.0);
            for (gi, pi) in g.iter_mut().zip(&p32) {
                *gi = 0.1 * *gi + pi; // a pull towards 0 plus noise
            }
            let st = AdamWStep::new(&cfg, t, cfg.lr);
            adamw_update_serial(&mut p32, &g, &mut m, &mut v, &st, 1.0);
            adamw8bit_update(&mut p8, &g, q.view_mut(), &st, 1.0, t);
        }
        let (mut num, mut den) = (0f64, 0f64);
        for i in 0..n {
            let d32 = (p32[i] - p0[i]) as f64;
            let d8 = (p8[i] - p0[i]) as f64;
            num += (d8 - d32) * (d8 - d32);
            den += d32 * d32;
        }
        let rel = (num / den).sqrt();
        assert!(rel < 0.05, "8-bit updates differ from fp32 by {rel:.4} (relative)");
    }

    /// Each tensor of a buffer is quantised on its own: small tensors keep fp32 moments and take
    /// exactly the fp32 AdamW step; a large tensor's blocks start at its start, so a huge
    /// gradient in a norm weight does not set the scale of matrix elements.
    #[test]
    fn small_tensors_keep_fp32_moments_and_blocks_start_at_each_tensor() {
        let tensors = [96, 5000, 96, 300];
        let n: usize = tensors.iter().sum();
        let segs: Vec<Segment> = segments(&tensors).collect();
        assert_eq!(
            segs[1],
            Segment { start: 96, len: 5000, store: Store::Q8 { code: 0, block: 0 } }
        );
        assert_eq!(segs[2], Segment { start: 5096, len: 96, store: Store::F32 { at: 96 } });
        assert_eq!(segs[3].store, Store::F32 { at: 192 });
        let mut q = Moments8::zeros(&tensors);
        assert_eq!((q.m_codes.len(), q.m_absmax.len(), q.m32.len()), (5000, 20, 492));
        assert_eq!(Moments8::bytes(&tensors), 2 * 5000 + 2 * 4 * 20 + 2 * 4 * 492);

        let mut rng = SplitMix64::new(11);
        let mut g = vec![0f32; n];
        rng.fill_normal(&mut g, 1e-3);
        g[..96].iter_mut().for_each(|x| *x *= 1e4); // a norm weight's large, shared gradient
        let mut p = vec![0f32; n];
        rng.fill_normal(&mut p, 0.02);
        let (mut p32, mut m32, mut v32) = (p.clone(), vec![0f32; n], vec![0f32; n]);
        let cfg = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        for t in 1..=3 {
            let st = AdamWStep::new(&cfg, t, 1e-3);
            adamw8bit_update(&mut p, &g, q.view_mut(), &st, 0.5, t);
            adamw_update_serial(&mut p32, &g, &mut m32, &mut v32, &st, 0.5);
        }
        let (m, v) = q.decode();
        for r in [0..96, 5096..n] {
            assert!(p[r.clone()] == p32[r.clone()], "small tensors: fp32 AdamW, bit for bit");
            assert!(m[r.clone()] == m32[r.clone()] && v[r.clone()] == v32[r]);
        }
        // The large tensor's first block is scaled by its own moments, not the norm weight's.
        let want = m32[96..96 + QBLOCK].iter().fold(0f32, |a, &x| a.max(x.abs()));
        assert!((q.m_absmax[0] - want).abs() <= 0.02 * want, "{} vs {want}", q.m_absmax[0]);
        // encode / decode round trip: small tensors exact.
        let mut q2 = Moments8::zeros(&tensors);
        q2.encode(&m32, &v32);
        let (m2, v2) = q2.decode();
        assert!(m2[..96] == m32[..96] && v2[5096..] == v32[5096..]);
    }

    /// FNV-1a over the bytes of everything an update writes.
    fn checksum(p: &[f32], q: &Moments8) -> u64 {
        let words = p.iter().chain(&q.m_absmax).chain(&q.v_absmax).chain(&q.m32).chain(&q.v32);
        let bytes = words
            .flat_map(|x| x.to_bits().to_le_bytes())
            .chain(q.m_codes.iter().chain(&q.v_codes).copied());
        bytes
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    }

    /// The 8-bit update's results are pinned: a checksum of its outputs on a buffer of awkward
    /// tensors (partial blocks, fp32 segments, both lerp formulas) over three steps, recorded
    /// from the scalar body when both moments' draws came to share one hash and the rounding
    /// test and the bias correction became products (before, it was recorded from the original
    /// quantiser before the AVX2 body existed). Every body must reproduce it bit for bit.
    #[test]
    fn outputs_match_the_recorded_checksum() {
        let tensors = [5000, 96, 4096 + 3 * QBLOCK + 77, 300, 70_001];
        let n: usize = tensors.iter().sum();
        let mut rng = SplitMix64::new(21);
        let mut p = vec![0f32; n];
        rng.fill_normal(&mut p, 0.02);
        let mut g = vec![0f32; n];
        let grads: Vec<Vec<f32>> = (0..6)
            .map(|_| {
                rng.fill_normal(&mut g, 1e-2);
                g.clone()
            })
            .collect();
        for kernel in
            [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512].into_iter().filter(|k| k.available())
        {
            let mut sums = Vec::new();
            for (beta1, grads) in [0.9, 0.3].into_iter().zip(grads.chunks(3)) {
                let (mut p, mut q) = (p.clone(), Moments8::zeros(&tensors));
                let cfg =
                    AdamWConfig { lr: 1e-3, beta1, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
                for (t, g) in (1..=3).zip(grads) {
                    let st = AdamWStep::new(&cfg, t, 1e-3);
                    adamw8bit_update_with(kernel, &mut p, None, g, q.view_mut(), &st, 0.7, 100 + t);
                }
                sums.push(checksum(&p, &q));
            }
            assert_eq!(sums, [0x50a7_90f2_2ee6_3f73, 0x6ed9_4d6c_781b_91b9], "{kernel:?}");
        }
    }

    /// Every bucket of every code holds at most one value: what `Code::first_at_least`'s single
    /// compare relies on.
    #[test]
    fn a_bucket_holds_at_most_one_value() {
        for code in [signed_code(), unsigned_code()] {
            for b in 0..BUCKETS - 1 {
                let (lo, hi) = (bucket_floor(b), bucket_floor(b + 1));
                for sign in [1.0f32, -1.0] {
                    let n = code.iter().filter(|&&c| sign * c >= lo && sign * c < hi).count();
                    assert!(n <= 1, "bucket {b} (sign {sign}) holds {n} values");
                }
            }
        }
    }

    /// A buffer of awkward tensors: exact blocks, a partial last block of one element, a
    /// partial block mid-task, several tasks with a partial last one, fp32 segments between.
    const AWKWARD: [usize; 7] = [4096, 96, 4097, 300, 4096 + 3 * QBLOCK + 77, 7, 70_001];

    /// Three steps of the 8-bit update from a fixed start on `threads` threads, with the given
    /// kernel and with or without the image. Gradients include exact zeros, a block that is all
    /// zero (scale 0 after step 1), tiny and huge values, so every encoder branch runs.
    fn run_q8(
        kernel: Kernel,
        image: bool,
        threads: usize,
        beta1: f64,
    ) -> (Vec<f32>, Moments8, Vec<Bf16>) {
        let n: usize = AWKWARD.iter().sum();
        let mut rng = SplitMix64::new(31);
        let mut p = vec![0f32; n];
        rng.fill_normal(&mut p, 0.02);
        let mut q = Moments8::zeros(&AWKWARD);
        let mut img = vec![Bf16(0xdead); if image { n } else { 0 }];
        let cfg = AdamWConfig { lr: 1e-3, beta1, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let mut g = vec![0f32; n];
        for t in 1..=3u64 {
            rng.fill_normal(&mut g, 1e-2);
            for (i, x) in g.iter_mut().enumerate() {
                match i % 37 {
                    0 => *x = 0.0,
                    1 => *x *= 1e-6,
                    2 => *x *= 1e3,
                    _ => {}
                }
            }
            g[96 + QBLOCK..96 + 2 * QBLOCK].fill(0.0); // one block of the 4097 tensor: all zero
            let st = AdamWStep::new(&cfg, t, 1e-3);
            let im = image.then_some(img.as_mut_slice());
            pool.install(|| {
                adamw8bit_update_with(kernel, &mut p, im, &g, q.view_mut(), &st, 0.7, 50 + t)
            });
        }
        (p, q, img)
    }

    fn f32_bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Asserts two runs' masters and moments are bit-identical, naming the first difference.
    fn assert_same(
        what: &str,
        a: &(Vec<f32>, Moments8, Vec<Bf16>),
        b: &(Vec<f32>, Moments8, Vec<Bf16>),
    ) {
        let first = |x: &[u32], y: &[u32]| x.iter().zip(y).position(|(x, y)| x != y);
        let (qa, qb) = (&a.1, &b.1);
        for (name, x, y) in [
            ("param", f32_bits(&a.0), f32_bits(&b.0)),
            ("m_absmax", f32_bits(&qa.m_absmax), f32_bits(&qb.m_absmax)),
            ("v_absmax", f32_bits(&qa.v_absmax), f32_bits(&qb.v_absmax)),
            ("m32", f32_bits(&qa.m32), f32_bits(&qb.m32)),
            ("v32", f32_bits(&qa.v32), f32_bits(&qb.v32)),
        ] {
            assert!(x == y, "{what}: {name} differs first at {:?}", first(&x, &y));
        }
        let widen = |c: &[u8]| c.iter().map(|&c| u32::from(c)).collect::<Vec<_>>();
        for (name, x, y) in
            [("m_codes", &qa.m_codes, &qb.m_codes), ("v_codes", &qa.v_codes, &qb.v_codes)]
        {
            let (x, y) = (widen(x), widen(y));
            assert!(x == y, "{what}: {name} differs first at {:?}", first(&x, &y));
        }
    }

    /// The AVX2 and AVX-512 bodies are bit-identical to the scalar one (every code, scale and master), on one
    /// thread and on three, with and without the image; the image is exactly bf16(masters).
    #[test]
    fn kernels_threads_and_image_are_bit_identical() {
        let kernels: Vec<Kernel> = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512]
            .into_iter()
            .filter(|k| k.available())
            .collect();
        if kernels.len() < 2 {
            eprintln!("this CPU has no AVX2: only the scalar body is checked");
        }
        if kernels.len() < 3 {
            eprintln!("this CPU lacks AVX-512 F, DQ, BW or VBMI: its body is not checked");
        }
        for beta1 in [0.9, 0.3] {
            let want = run_q8(Kernel::Scalar, false, 1, beta1);
            for &kernel in &kernels {
                for threads in [1, 3] {
                    for image in [false, true] {
                        let got = run_q8(kernel, image, threads, beta1);
                        let what =
                            format!("{kernel:?}, {threads} threads, image {image}, beta1 {beta1}");
                        assert_same(&what, &got, &want);
                        if image {
                            let rounded: Vec<Bf16> =
                                got.0.iter().map(|&x| Bf16::from_f32(x)).collect();
                            assert!(got.2 == rounded, "{what}: image != bf16(masters)");
                        }
                    }
                }
            }
        }
    }

    /// An element whose new master or moment would not be finite is held on every body
    /// (scalar, AVX2, AVX-512) and thread count, with the same bits and the same count: its
    /// master keeps its value, its block is re-encoded with its old moments, and every master,
    /// scale and decoded moment stays finite; in the 8-bit tensors (whole and partial blocks)
    /// and the fp32 small ones alike. A master at f32::MAX pushed outward by a large lr, a
    /// gradient whose square overflows v with no clipping, an infinite step.
    #[test]
    fn an_element_that_would_go_non_finite_is_held_on_every_body() {
        let kernels: Vec<Kernel> = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512]
            .into_iter()
            .filter(|k| k.available())
            .collect();
        let n: usize = AWKWARD.iter().sum();
        for case in 0..3 {
            let mut rng = SplitMix64::new(41);
            let (mut p0, mut g) = (vec![0f32; n], vec![0f32; n]);
            rng.fill_normal(&mut p0, 0.02);
            rng.fill_normal(&mut g, 1e-2);
            let (lr, must): (f64, Vec<usize>) = match case {
                0 => {
                    (0..n).step_by(5).for_each(|i| (p0[i], g[i]) = (f32::MAX, -0.5));
                    (1e33, (0..n).step_by(5).collect())
                }
                1 => {
                    (0..n).step_by(7).for_each(|i| g[i] = 1e21);
                    (1e-3, (0..n).step_by(7).collect())
                }
                _ => (1e39, (0..n).collect()),
            };
            let cfg = AdamWConfig { lr, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
            let st = AdamWStep::new(&cfg, 1, lr);
            let run = |kernel: Kernel, threads: usize, image: bool| {
                let (mut p, mut q) = (p0.clone(), Moments8::zeros(&AWKWARD));
                let mut img = vec![Bf16(0xdead); if image { n } else { 0 }];
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let im = image.then_some(img.as_mut_slice());
                let held = pool.install(|| {
                    adamw8bit_update_with(kernel, &mut p, im, &g, q.view_mut(), &st, 1.0, 7)
                });
                (held, (p, q, img))
            };
            let (want, reference) = run(Kernel::Scalar, 1, false);
            assert_eq!(want, must.len(), "case {case}: every such element, and only those");
            let (p, q) = (&reference.0, &reference.1);
            assert!(must.iter().all(|&i| p[i].to_bits() == p0[i].to_bits()), "case {case}");
            let (m, v) = q.decode();
            let scales = q.m_absmax.iter().chain(&q.v_absmax);
            assert!(p.iter().chain(&m).chain(&v).chain(scales).all(|x| x.is_finite()));
            for &kernel in &kernels {
                for (threads, image) in [(1, true), (3, false), (3, true)] {
                    let (held, got) = run(kernel, threads, image);
                    let what = format!("case {case}, {kernel:?}, {threads} threads, image {image}");
                    assert_eq!(held, want, "{what}: held count");
                    assert_same(&what, &got, &reference);
                    if image {
                        let rounded: Vec<Bf16> = got.0.iter().map(|&x| Bf16::from_f32(x)).collect();
                        assert!(got.2 == rounded, "{what}: image != bf16(masters)");
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn image_length_mismatch_panics() {
        let mut q = Moments8::zeros(&[4096]);
        let st = AdamWStep::new(
            &AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 },
            1,
            1e-3,
        );
        let mut img = vec![Bf16(0); 10];
        let (mut p, g) = (vec![0f32; 4096], vec![0f32; 4096]);
        adamw8bit_update_with(
            Kernel::Scalar,
            &mut p,
            Some(&mut img),
            &g,
            q.view_mut(),
            &st,
            1.0,
            0,
        );
    }

    #[test]
    fn thread_count_does_not_change_the_result() {
        let n = 5 * TASK_BLOCKS * QBLOCK + 3;
        let mut rng = SplitMix64::new(5);
        let mut g = vec![0f32; n];
        rng.fill_normal(&mut g, 1.0);
        let cfg = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let st = AdamWStep::new(&cfg, 1, 1e-3);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut p = vec![0.5f32; n];
            let mut q = Moments8::zeros(&[n]);
            pool.install(|| adamw8bit_update(&mut p, &g, q.view_mut(), &st, 0.7, 9));
            (p, q)
        };
        assert!(run(1) == run(3));
    }
}
