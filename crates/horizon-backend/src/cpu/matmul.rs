//! Linear layer on the CPU: `out = inp @ weight^T + bias` and its backward.
//!
//! Data flow: inp (N, IC) x weight (OC, IC) -> out (N, OC).
//!
//! All three products (forward, `dinp`, `dweight`) go through one packed GEMM, [`gemm`]:
//! `C (M, N) = or += A (M, K) . B (K, N)`, with A and B given by strides so transposes cost
//! nothing. B is packed, one block of `KC x NC` at a time, into strips of `NR` columns; a
//! register-blocked micro-kernel (`MR x NR` = 6 x 16, AVX2 + FMA when the CPU has them, a
//! portable loop otherwise) broadcasts A straight from memory. Rayon splits a block's rows into
//! tasks; every output element is one FMA chain over `k` ascending inside one task, and the only
//! blocking of `k` is the fixed `KC`, so results never depend on the number of threads, on
//! `M`, or on where a row falls in a tile.

use std::cell::RefCell;
use std::thread::LocalKey;

use rayon::prelude::*;

use crate::Dinp;

/// Rows of one micro-kernel call.
const MR: usize = 6;
/// Columns of one micro-kernel call (two AVX vectors).
const NR: usize = 16;
/// Depth of one `k` block when C is overwritten: C = p(0..KC), then C += p(KC..2KC), ... A fixed
/// constant, so the order of additions depends on `K` only.
const KC: usize = 256;
/// Inside a micro-kernel, `k` is summed in sub-blocks of this many steps, each one FMA chain in
/// registers, added in order into the tile's running sum: blocked summation, whose rounding
/// error grows like `sqrt(KB + k / KB)` instead of the single chain's `sqrt(k)` (about 2x
/// smaller at the fixtures' k = 64, 4x at k = 4096), for one vector add per 16 FMAs.
const KB: usize = 16;
/// Packed B floats per block (`kc * nc`), 4 MiB: a block stays in L3 while every task streams
/// its strips through L1 (as BLIS does), so A rows are packed again only every 4096 columns.
const B_BLOCK: usize = 1024 * 1024;
/// Columns per packed block at least.
const NC_MIN: usize = 512;
/// Rows of C per task at most.
const MC_MAX: usize = 96;

/// How a product reaches C.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// `C = A.B`: summed in `k` blocks of `KC` (the first block stores, the next ones add).
    Overwrite,
    /// `C += A.B`: the whole `k` sum is formed in registers first, then added once, so calling
    /// twice on a zeroed C gives exactly `2 * (A.B)`.
    Accumulate,
}

/// A read-only matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

thread_local! {
    /// Packed B of the calling thread and packed A of each worker: the buffers a kernel keeps
    /// between calls, grown to the largest block once (nothing is allocated once shapes repeat).
    static PACK_B: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static PACK_A: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `C (M, N) = or += A (M, K) . B (K, N)`; C is row-major with row stride `n`. Rows of C are
/// split into parallel tasks.
fn gemm(c: &mut [f32], a: View, b: View, m: usize, n: usize, k: usize, mode: Mode) {
    debug_assert_eq!(c.len(), m * n);
    gemm_impl(c, n, a, b, m, n, k, mode, true);
}

/// [`gemm`] on the calling thread only, with C's row stride `ldc >= n`: for callers that are
/// themselves one parallel task (attention runs one per head). The same sums in the same order
/// as [`gemm`], so the two give the same bits.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_serial(
    c: &mut [f32],
    ldc: usize,
    a: View,
    b: View,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    let mode = if accumulate { Mode::Accumulate } else { Mode::Overwrite };
    gemm_impl(c, ldc, a, b, m, n, k, mode, false);
}

#[allow(clippy::too_many_arguments)]
fn gemm_impl(
    c: &mut [f32],
    ldc: usize,
    a: View,
    b: View,
    m: usize,
    n: usize,
    k: usize,
    mode: Mode,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(ldc >= n && c.len() >= (m - 1) * ldc + n, "gemm: C too small");
    if k == 0 {
        if mode == Mode::Overwrite {
            for r in 0..m {
                c[r * ldc..][..n].fill(0.0);
            }
        }
        return;
    }
    let kc_max = match mode {
        Mode::Overwrite => KC.min(k),
        Mode::Accumulate => k,
    };
    if m == 1 {
        return gemv(c, a, b, n, k, kc_max, mode, parallel);
    }
    // Columns per packed block: a multiple of NR, as many as fit the block budget, and at least
    // NC_MIN (an accumulating product's block is all of `k` deep; without the floor its A rows
    // would be packed again for every few columns). NC changes which block a column is in,
    // never the order of its sum.
    let nc = (B_BLOCK / kc_max / NR).max(NC_MIN / NR) * NR;

    let need = kc_max * nc.min(n.div_ceil(NR) * NR);
    with_scratch(&PACK_B, need, |packed| {
        let mut p0 = 0;
        while p0 < k {
            let kc = kc_max.min(k - p0);
            let store = mode == Mode::Overwrite && p0 == 0;
            for j0 in (0..n).step_by(nc) {
                let ncb = nc.min(n - j0);
                let strips = ncb.div_ceil(NR);
                let pb = &mut packed[..strips * NR * kc];
                let pack =
                    |(s, strip): (usize, &mut [f32])| pack_b(strip, b, p0, kc, j0 + s * NR, n);
                if parallel {
                    pb.par_chunks_mut(NR * kc).enumerate().for_each(pack);
                } else {
                    pb.chunks_mut(NR * kc).enumerate().for_each(pack);
                }
                let block = Block { a, pb: &*pb, strips, j0, n, ldc, p0, kc, store };
                if parallel {
                    block.split_rows(c, 0, m);
                } else {
                    for (t, c_rows) in c.chunks_mut(MC_MAX * ldc).enumerate() {
                        let i0 = t * MC_MAX;
                        if i0 < m {
                            block.rows(c_rows, i0, MC_MAX.min(m - i0));
                        }
                    }
                }
            }
            p0 += kc;
        }
    });
}

/// Columns of C per parallel task of [`gemv`].
const GEMV_COLS: usize = 128;

/// [`gemm_impl`] for one row of C (a decode step's product): `C (1, N) = or += A (1, K) . B (K,
/// N)` without packing, B read where it lies. The same sums in the same order as the packed
/// path: `k` in blocks of `kc_max` (the first block stores when overwriting, the next ones add),
/// inside a block sub-blocks of [`KB`], each one FMA chain from 0 added in order into the
/// block's sum. So a row gets the bits it would get inside a larger product.
#[allow(clippy::too_many_arguments)]
fn gemv(
    c: &mut [f32],
    a: View,
    b: View,
    n: usize,
    k: usize,
    kc_max: usize,
    mode: Mode,
    parallel: bool,
) {
    let task = |(t, cols): (usize, &mut [f32])| {
        for (s, strip) in cols.chunks_mut(NR).enumerate() {
            let j0 = t * GEMV_COLS + s * NR;
            #[cfg(target_arch = "x86_64")]
            {
                if avx2_fma() {
                    if b.rs == 1 && strip.len() == NR {
                        // SAFETY: as below; the rows it loads are bounds-checked slices.
                        unsafe { gemv_strip_rows_fma(strip, a, b, j0, k, kc_max, mode) };
                        continue;
                    }
                    // SAFETY: the CPU supports AVX2 and FMA (checked just above); the body
                    // indexes its slices with bounds checks.
                    unsafe { gemv_strip_fma(strip, a, b, j0, k, kc_max, mode) };
                    continue;
                }
            }
            gemv_strip(strip, a, b, j0, k, kc_max, mode);
        }
    };
    let c = &mut c[..n];
    if parallel {
        c.par_chunks_mut(GEMV_COLS).enumerate().for_each(task);
    } else {
        c.chunks_mut(GEMV_COLS).enumerate().for_each(task);
    }
}

/// [`gemv_strip`] compiled for AVX2 + FMA (its `mul_add`s become vector FMAs).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_strip_fma(
    c: &mut [f32],
    a: View,
    b: View,
    j0: usize,
    k: usize,
    kc_max: usize,
    mode: Mode,
) {
    gemv_strip(c, a, b, j0, k, kc_max, mode)
}

/// [`gemv_strip`] for a full strip of [`NR`] columns whose B columns are contiguous in `k`
/// (`b.rs == 1`: the forward's `B[i, o] = W[o, i]`, each column a row of W). Eight `k` steps
/// of eight columns are loaded as rows and transposed in registers, so each step is one vector
/// FMA per eight columns instead of eight strided scalar loads; the FMAs, their order and the
/// additions are [`gemv_strip`]'s, lane by lane, so the bits are the same.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_strip_rows_fma(
    c: &mut [f32],
    a: View,
    b: View,
    j0: usize,
    k: usize,
    kc_max: usize,
    mode: Mode,
) {
    use std::arch::x86_64::*;
    let rows: [&[f32]; NR] = std::array::from_fn(|j| &b.data[(j0 + j) * b.cs..][..k]);
    let x = |kk: usize| a.data[kk * a.cs];
    let mut p0 = 0;
    while p0 < k {
        let kc = kc_max.min(k - p0);
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut q0 = p0;
        while q0 < p0 + kc {
            let q1 = (q0 + KB).min(p0 + kc);
            let mut part = [_mm256_setzero_ps(); 2];
            let mut kk = q0;
            while kk + 8 <= q1 {
                for (h, part) in part.iter_mut().enumerate() {
                    // SAFETY: each slice has the 8 elements loaded (bounds-checked above).
                    let r: [__m256; 8] = std::array::from_fn(|j| unsafe {
                        _mm256_loadu_ps(rows[h * 8 + j][kk..kk + 8].as_ptr())
                    });
                    for (t, col) in transpose8(r).into_iter().enumerate() {
                        *part = _mm256_fmadd_ps(_mm256_set1_ps(x(kk + t)), col, *part);
                    }
                }
                kk += 8;
            }
            if kk < q1 {
                // The last steps of a short sub-block, lane by lane as in `gemv_strip`.
                let mut p = [0.0f32; NR];
                // SAFETY: `p` holds 16 floats.
                unsafe {
                    _mm256_storeu_ps(p.as_mut_ptr(), part[0]);
                    _mm256_storeu_ps(p.as_mut_ptr().add(8), part[1]);
                }
                for kk in kk..q1 {
                    for (s, row) in p.iter_mut().zip(&rows) {
                        *s = x(kk).mul_add(row[kk], *s);
                    }
                }
                // SAFETY: as above.
                part = unsafe { [_mm256_loadu_ps(p.as_ptr()), _mm256_loadu_ps(p.as_ptr().add(8))] };
            }
            acc = [_mm256_add_ps(acc[0], part[0]), _mm256_add_ps(acc[1], part[1])];
            q0 += KB;
        }
        let mut sum = [0.0f32; NR];
        // SAFETY: `sum` holds 16 floats.
        unsafe {
            _mm256_storeu_ps(sum.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(sum.as_mut_ptr().add(8), acc[1]);
        }
        if mode == Mode::Overwrite && p0 == 0 {
            c.copy_from_slice(&sum);
        } else {
            for (d, s) in c.iter_mut().zip(&sum) {
                *d += s;
            }
        }
        p0 += kc;
    }
}

/// The 8x8 transpose: rows `r[j]` (8 consecutive `k` of column `j`) in, columns out (`out[t]`
/// holds step `t` of the 8 columns).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn transpose8(r: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// C columns `j0..j0 + c.len()` (at most [`NR`]) of a one-row product, in [`gemv`]'s order.
#[inline(always)]
fn gemv_strip(c: &mut [f32], a: View, b: View, j0: usize, k: usize, kc_max: usize, mode: Mode) {
    let nr = c.len();
    let mut p0 = 0;
    while p0 < k {
        let kc = kc_max.min(k - p0);
        let mut acc = [0.0f32; NR];
        let mut q0 = p0;
        while q0 < p0 + kc {
            let mut part = [0.0f32; NR];
            for kk in q0..(q0 + KB).min(p0 + kc) {
                let x = a.data[kk * a.cs];
                let row = kk * b.rs + j0 * b.cs;
                for (j, s) in part.iter_mut().enumerate().take(nr) {
                    *s = x.mul_add(b.data[row + j * b.cs], *s);
                }
            }
            for (s, p) in acc.iter_mut().zip(&part) {
                *s += p;
            }
            q0 += KB;
        }
        if mode == Mode::Overwrite && p0 == 0 {
            c.copy_from_slice(&acc[..nr]);
        } else {
            for (d, x) in c.iter_mut().zip(&acc) {
                *d += x;
            }
        }
        p0 += kc;
    }
}

/// One packed block of B (`kc` rows from `p0`, strips of columns from `j0`) and where it goes.
#[derive(Clone, Copy)]
struct Block<'a> {
    a: View<'a>,
    pb: &'a [f32],
    strips: usize,
    j0: usize,
    n: usize,
    ldc: usize,
    p0: usize,
    kc: usize,
    store: bool,
}

impl Block<'_> {
    /// C rows `i0..i0 + rows` in parallel: halved (at whole micro-kernels) until a part has at
    /// most `MC_MAX` rows, so the threads get equal shares whatever `m` is (fixed-size tasks
    /// left one thread up to a task's worth of rows behind: ~11% of a 1024-row product).
    fn split_rows(&self, c_rows: &mut [f32], i0: usize, rows: usize) {
        if rows <= MC_MAX {
            return self.rows(c_rows, i0, rows);
        }
        let half = rows.div_ceil(MR) / 2 * MR;
        let (top, bottom) = c_rows.split_at_mut(half * self.ldc);
        rayon::join(
            || self.split_rows(top, i0, half),
            || self.split_rows(bottom, i0 + half, rows - half),
        );
    }

    /// C rows `i0..i0 + rows` (`c_rows` starts at row `i0`) against every strip of the block:
    /// packs those rows of A, then runs the micro-kernels strip by strip.
    fn rows(&self, c_rows: &mut [f32], i0: usize, rows: usize) {
        let Block { a, pb, strips, j0, n, ldc, p0, kc, store } = *self;
        with_scratch(&PACK_A, rows.div_ceil(MR) * MR * kc, |pa| {
            for (r, panel) in pa.chunks_exact_mut(MR * kc).enumerate() {
                pack_a(panel, a, i0 + r * MR, MR.min(rows - r * MR), p0, kc);
            }
            for s in 0..strips {
                let bs = &pb[s * NR * kc..][..NR * kc];
                let jj = j0 + s * NR;
                let nr = NR.min(n - jj);
                for (r, panel) in pa.chunks_exact(MR * kc).enumerate() {
                    let mr = MR.min(rows - r * MR);
                    let c = &mut c_rows[r * MR * ldc + jj..];
                    micro(Tile { c, ldc, mr, nr, store }, panel, bs, kc);
                }
            }
        });
    }
}

/// Runs `f` on the first `len` floats of this thread's scratch buffer `key`, grown once to the
/// largest size asked for and then reused; a fresh buffer if the thread is already using it (a
/// rayon worker running a nested product while it waits).
pub(crate) fn with_scratch<R>(
    key: &'static LocalKey<RefCell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < len {
                buf.resize(len, 0.0);
            }
            f(&mut buf[..len])
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// Packs A rows `i0..i0+mr`, columns `p0..p0+kc` as `panel[k * MR + r]` (rows past `mr` are
/// zero or a copy of row `i0`: their results are never written).
fn pack_a(panel: &mut [f32], a: View, i0: usize, mr: usize, p0: usize, kc: usize) {
    if a.rs == 1 {
        for (k, dst) in panel.chunks_exact_mut(MR).enumerate() {
            let src = &a.data[i0 + (p0 + k) * a.cs..][..mr];
            if let (Ok(dst), Ok(src)) =
                (<&mut [f32; MR]>::try_from(&mut *dst), <&[f32; MR]>::try_from(src))
            {
                // Whole panels: a fixed-size copy the compiler inlines (no memmove call).
                *dst = *src;
            } else {
                dst[..mr].copy_from_slice(src);
                dst[mr..].fill(0.0);
            }
        }
    } else {
        // Rows past mr read row 0 again (their results are dropped); k outer, so the panel is
        // written in order and each source row is read sequentially.
        let rows: [&[f32]; MR] = std::array::from_fn(|r| {
            let r = if r < mr { r } else { 0 };
            &a.data[(i0 + r) * a.rs + p0 * a.cs..][..(kc - 1) * a.cs + 1]
        });
        for (k, dst) in panel.chunks_exact_mut(MR).enumerate() {
            for (d, row) in dst.iter_mut().zip(&rows) {
                *d = row[k * a.cs];
            }
        }
    }
}

/// Packs B rows `p0..p0+kc`, columns `j0..j0+NR` as `strip[k * NR + j]` (columns past `n` are
/// zero or a copy of column `j0`: their results are never written).
fn pack_b(strip: &mut [f32], b: View, p0: usize, kc: usize, j0: usize, n: usize) {
    let nr = NR.min(n - j0);
    if b.cs == 1 {
        for (k, row) in strip.chunks_exact_mut(NR).enumerate() {
            let src = &b.data[(p0 + k) * b.rs + j0..][..nr];
            if let (Ok(dst), Ok(src)) =
                (<&mut [f32; NR]>::try_from(&mut *row), <&[f32; NR]>::try_from(src))
            {
                // Whole strips: a fixed-size copy the compiler inlines (no memmove call).
                *dst = *src;
            } else {
                row[..nr].copy_from_slice(src);
                row[nr..].fill(0.0);
            }
        }
    } else {
        // Columns past nr read column 0 again (their results are dropped); k outer, as in
        // `pack_a`.
        let cols: [&[f32]; NR] = std::array::from_fn(|j| {
            let j = if j < nr { j } else { 0 };
            &b.data[(j0 + j) * b.cs + p0 * b.rs..][..(kc - 1) * b.rs + 1]
        });
        for (k, dst) in strip.chunks_exact_mut(NR).enumerate() {
            for (d, col) in dst.iter_mut().zip(&cols) {
                *d = col[k * b.rs];
            }
        }
    }
}

/// Where one micro-kernel's `mr x nr` results go: `c[r * ldc + j]`, stored or added.
struct Tile<'a> {
    c: &'a mut [f32],
    ldc: usize,
    mr: usize,
    nr: usize,
    store: bool,
}

impl Tile<'_> {
    /// Writes (or adds) the valid part of a full `MR x NR` accumulator.
    #[inline(always)]
    fn write(self, acc: &[[f32; NR]; MR]) {
        for (r, acc_r) in acc.iter().enumerate().take(self.mr) {
            let dst = &mut self.c[r * self.ldc..][..self.nr];
            if self.store {
                dst.copy_from_slice(&acc_r[..self.nr]);
            } else {
                for (d, x) in dst.iter_mut().zip(acc_r) {
                    *d += x;
                }
            }
        }
    }
}

/// One `MR x NR` block: `panel (kc, MR) . strip (kc, NR)`, written into `tile`.
#[inline]
fn micro(tile: Tile, panel: &[f32], strip: &[f32], kc: usize) {
    assert!(panel.len() >= kc * MR && strip.len() >= kc * NR);
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma() {
            if tile.mr == MR && tile.nr == NR {
                // A whole tile: the kernel writes C itself, straight from its registers.
                assert!(tile.c.len() >= (MR - 1) * tile.ldc + NR, "micro: C tile out of bounds");
                // SAFETY: the CPU supports AVX2 and FMA (checked just above); the panel holds
                // kc * MR floats and the strip kc * NR (asserted above); C holds MR rows of NR
                // floats at stride ldc (asserted just above), and `tile.c` is borrowed
                // mutably, so nothing else reads or writes them meanwhile.
                unsafe {
                    micro_avx2_to_c(
                        panel.as_ptr(),
                        strip.as_ptr(),
                        kc,
                        tile.c.as_mut_ptr(),
                        tile.ldc,
                        tile.store,
                    )
                };
                return;
            }
            // SAFETY: the CPU supports AVX2 and FMA (checked just above); the panel holds
            // kc * MR floats and the strip kc * NR (asserted above).
            let acc = unsafe { micro_avx2(panel.as_ptr(), strip.as_ptr(), kc) };
            tile.write(&acc);
            return;
        }
    }
    tile.write(&micro_portable(panel, strip, kc));
}

/// The portable micro-kernel: `acc[r][j] = sum_k a[k][r] * b[k][j]`, k ascending, in
/// sub-blocks of [`KB`] as the AVX2 kernel.
fn micro_portable(panel: &[f32], strip: &[f32], kc: usize) -> [[f32; NR]; MR] {
    let mut acc = [[0.0f32; NR]; MR];
    let blocks = panel[..kc * MR].chunks(KB * MR).zip(strip[..kc * NR].chunks(KB * NR));
    for (pa, pb) in blocks {
        let mut part = [[0.0f32; NR]; MR];
        for (a, b) in pa.chunks_exact(MR).zip(pb.chunks_exact(NR)) {
            for (part_r, &x) in part.iter_mut().zip(a) {
                for (s, &bj) in part_r.iter_mut().zip(b) {
                    *s = x.mul_add(bj, *s);
                }
            }
        }
        for (acc_r, part_r) in acc.iter_mut().zip(&part) {
            for (s, p) in acc_r.iter_mut().zip(part_r) {
                *s += p;
            }
        }
    }
    acc
}

/// True when the CPU has AVX2 and FMA (detected once, then cached by std).
#[cfg(target_arch = "x86_64")]
#[inline]
fn avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// The AVX2 micro-kernel: 12 accumulators (6 rows x 2 vectors of 8), one FMA per element per
/// `k`, `k` ascending; every [`KB`] steps the accumulators are added into the running sum.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `a` must hold `kc * MR` floats and `b` `kc * NR`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_avx2(a: *const f32, b: *const f32, kc: usize) -> [[f32; NR]; MR] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's guarantees are this function's (see above).
    let sum = unsafe { micro_avx2_sum(a, b, kc) };
    let mut out = [[0.0f32; NR]; MR];
    for (o, s) in out.iter_mut().zip(&sum) {
        // SAFETY: `o` holds NR = 16 floats, two vectors of 8.
        unsafe {
            _mm256_storeu_ps(o.as_mut_ptr(), s[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), s[1]);
        }
    }
    out
}

/// [`micro_avx2`] for a whole `MR x NR` tile of C at `c` (row stride `ldc`): stores the sums
/// (`store`) or adds them to C, element by element as [`Tile::write`] does, so both paths give
/// the same bits.
///
/// # Safety
/// As [`micro_avx2`]; and `c` must be valid for reads and writes of `MR` rows of `NR` floats at
/// stride `ldc`, with no other access to them meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_avx2_to_c(
    a: *const f32,
    b: *const f32,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    store: bool,
) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's guarantees cover the kernel's reads and these C accesses.
    unsafe {
        // The tile's rows are far apart in C (and usually out of cache): start fetching them
        // now, so the loads and stores at the end do not wait on memory.
        for r in 0..MR {
            let cr = c.add(r * ldc) as *const i8;
            _mm_prefetch::<_MM_HINT_T0>(cr);
            _mm_prefetch::<_MM_HINT_T0>(cr.add(60));
        }
        let sum = micro_avx2_sum(a, b, kc);
        for (r, s) in sum.iter().enumerate() {
            let cr = c.add(r * ldc);
            if store {
                _mm256_storeu_ps(cr, s[0]);
                _mm256_storeu_ps(cr.add(8), s[1]);
            } else {
                _mm256_storeu_ps(cr, _mm256_add_ps(_mm256_loadu_ps(cr), s[0]));
                _mm256_storeu_ps(cr.add(8), _mm256_add_ps(_mm256_loadu_ps(cr.add(8)), s[1]));
            }
        }
    }
}

/// The AVX2 kernel's sums, in registers: `[row][half]`.
///
/// # Safety
/// As [`micro_avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn micro_avx2_sum(
    a: *const f32,
    b: *const f32,
    kc: usize,
) -> [[std::arch::x86_64::__m256; 2]; MR] {
    use std::arch::x86_64::*;
    // SAFETY (whole body): the caller guarantees the reads below are in bounds (see above).
    unsafe {
        let mut sum = [[_mm256_setzero_ps(); 2]; MR];
        let mut k0 = 0;
        while k0 < kc {
            let mut c = [[_mm256_setzero_ps(); 2]; MR];
            for k in k0..(k0 + KB).min(kc) {
                let pb = b.add(k * NR);
                let b0 = _mm256_loadu_ps(pb);
                let b1 = _mm256_loadu_ps(pb.add(8));
                for (r, cr) in c.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*a.add(k * MR + r));
                    cr[0] = _mm256_fmadd_ps(x, b0, cr[0]);
                    cr[1] = _mm256_fmadd_ps(x, b1, cr[1]);
                }
            }
            for (s, cr) in sum.iter_mut().zip(&c) {
                s[0] = _mm256_add_ps(s[0], cr[0]);
                s[1] = _mm256_add_ps(s[1], cr[1]);
            }
            k0 += KB;
        }
        sum
    }
}
/// Linear forward: `out[n, o] = sum_i inp[n, i] * weight[o, i] + bias[o]`.
///
/// out: (N, OC), overwrites.
/// inp: (N, IC).
/// weight: (OC, IC).
/// bias: (OC), or `None` for no bias.
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    assert_eq!(out.len(), n * oc, "matmul_forward: out must be (N, OC)");
    assert_eq!(inp.len(), n * ic, "matmul_forward: inp must be (N, IC)");
    assert_eq!(weight.len(), oc * ic, "matmul_forward: weight must be (OC, IC)");
    if let Some(b) = bias {
        assert_eq!(b.len(), oc, "matmul_forward: bias must be (OC)");
    }
    if n == 0 || oc == 0 {
        return;
    }
    // A = inp (N, IC) row-major; B[i, o] = weight[o, i].
    let a = View { data: inp, rs: ic, cs: 1 };
    let b = View { data: weight, rs: 1, cs: ic };
    gemm(out, a, b, n, oc, ic, Mode::Overwrite);
    if let Some(bias) = bias {
        out.par_chunks_mut(oc).for_each(|row| {
            for (o, b) in row.iter_mut().zip(bias) {
                *o += b;
            }
        });
    }
}

// Linear backward.
//
// Forward: out[n,o] = sum_i inp[n,i] w[o,i] + b[o]. With dout = dL/dout:
//   dL/dinp[n,i] = sum_o dout[n,o] * d out[n,o]/d inp[n,i] = sum_o dout[n,o] w[o,i]
//   dL/dw[o,i]   = sum_n dout[n,o] inp[n,i]
//   dL/db[o]     = sum_n dout[n,o]
// Implemented exactly as:
//   dinp[n,i]  =  sum_{o ascending} dout[n,o] * w[o,i]           (Dinp::Write: overwrites;
//                                                                  blocks of KC)
//   dinp[n,i] +=  (sum_{o ascending} dout[n,o] * w[o,i])         (Dinp::Add: accumulates, the
//                                                                  sum formed first)
//   dw[o,i]   +=  (sum_{n ascending} dout[n,o] * inp[n,i])       (accumulates: the sum is formed
//                                                                  first, then added once)
//   db[o]     +=  (sum_{n ascending} dout[n,o])                   (accumulates, likewise)
// Forming each sum before adding it means calling the backward twice doubles dw and db exactly.
// A frozen weight (`dweight: None`) skips the dw product entirely.

/// Linear backward; see the derivation above.
///
/// dinp: (N, IC): `Dinp::Write` overwrites, `Dinp::Add` accumulates (+=); skipped when `None`.
/// dweight: (OC, IC), accumulates (+=); skipped when `None` (a frozen weight).
/// dbias: (OC), accumulates (+=); skipped when `None`.
/// dout: (N, OC).
/// inp: (N, IC).
/// weight: (OC, IC).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: Option<Dinp<'_, [f32]>>,
    dweight: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
) {
    assert_eq!(dout.len(), n * oc, "matmul_backward: dout must be (N, OC)");
    assert_eq!(inp.len(), n * ic, "matmul_backward: inp must be (N, IC)");
    assert_eq!(weight.len(), oc * ic, "matmul_backward: weight must be (OC, IC)");

    // dinp (N, IC) = or += dout (N, OC) . weight (OC, IC).
    if let Some(dinp) = dinp {
        let (dinp, mode) = match dinp {
            Dinp::Write(d) => (d, Mode::Overwrite),
            Dinp::Add(d) => (d, Mode::Accumulate),
        };
        assert_eq!(dinp.len(), n * ic, "matmul_backward: dinp must be (N, IC)");
        let a = View { data: dout, rs: oc, cs: 1 };
        let b = View { data: weight, rs: ic, cs: 1 };
        gemm(dinp, a, b, n, ic, oc, mode);
    }

    // dweight (OC, IC) += dout^T (OC, N) . inp (N, IC).
    if let Some(dweight) = dweight {
        assert_eq!(dweight.len(), oc * ic, "matmul_backward: dweight must be (OC, IC)");
        let a = View { data: dout, rs: 1, cs: oc };
        let b = View { data: inp, rs: ic, cs: 1 };
        gemm(dweight, a, b, oc, ic, n, Mode::Accumulate);
    }

    // dbias += column sums of dout, each summed over N ascending by one task, in f64: a bias
    // gradient is often a small sum of large cancelling terms (the key bias under RoPE), and
    // the sum is N times cheaper than the products above.
    if let Some(dbias) = dbias {
        assert_eq!(dbias.len(), oc, "matmul_backward: dbias must be (OC)");
        dbias.par_iter_mut().enumerate().for_each(|(o, db)| {
            let mut s = 0.0f64;
            for r in 0..n {
                s += dout[r * oc + o] as f64;
            }
            *db += s as f32;
        });
    }
}
