//! The CPU reference backend: [`CpuBackend`] implements [`Backend`] by delegating each method to
//! the plain slice functions of one op file (`<op>_forward` / `<op>_backward`, llm.c style).
//!
//! Every op is fp32, multi-threaded with rayon where it matters, and deterministic: the way work
//! is split never depends on the number of threads, and every reduction runs inside one task in
//! a fixed order, so results are bit-identical for any rayon pool size.

pub mod attention;
pub mod attention_decode;
pub mod attention_sink;
pub mod cols;
pub mod cross_entropy;
pub mod cross_entropy_tile;
pub mod device;
pub mod embedding;
pub mod gate;
pub mod geglu;
pub mod head_rmsnorm;
pub mod matmul;
pub mod moe;
pub mod nf4;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;
pub mod testing;

/// Elements from which [`CpuBackend`]'s `zero` fills in parallel (256 KiB).
const ZERO_PAR_ELEMS: usize = 1 << 16;

pub use attention::{attention_backward, attention_forward};
pub use attention_decode::attention_decode;
pub use attention_sink::{attention_sink_backward, attention_sink_forward};
pub use cols::{add_cols, scaled_cols};
pub use cross_entropy::{IGNORE_INDEX, cross_entropy_forward, cross_entropy_fused};
pub use cross_entropy_tile::{
    cross_entropy_tile_grad, cross_entropy_tile_loss, cross_entropy_tile_stats,
};
pub use device::{CpuDevice, CpuDeviceConfig, WaitMode};
pub use embedding::{
    GATHER_SERIAL_ELEMS, embedding_backward, embedding_forward, embedding_forward_rows,
    gathers_serially,
};
pub use gate::{sigmoid_gate_backward, sigmoid_gate_forward};
pub use geglu::{geglu_backward, geglu_forward};
pub use head_rmsnorm::{head_rmsnorm_backward, head_rmsnorm_forward};
pub use matmul::{matmul_backward, matmul_forward};
pub use moe::{
    moe_aux_stats, moe_bias_dots, moe_gather, moe_route_backward, moe_route_forward, moe_row_dots,
    moe_scale_rows, moe_scatter_add, moe_sort,
};
pub use nf4::dequantize_nf4;
pub use residual::{add_inplace, residual_forward};
pub use rmsnorm::{rmsnorm_backward, rmsnorm_forward};
pub use rope::{rope_backward, rope_forward};
pub use swiglu::{
    clamped_swiglu_backward, clamped_swiglu_forward, swiglu_backward, swiglu_forward,
};

use crate::{AttnDims, Backend, Dinp, MoeDims, NormDims, Precision};

/// The CPU reference backend. Buffers are plain host slices; work runs on the current rayon
/// pool (install a pool around calls to choose the thread count).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    /// A CPU backend using the current rayon pool.
    pub fn new() -> Self {
        CpuBackend
    }
}

impl Backend for CpuBackend {
    type Buf = [f32];
    type IBuf = [i32];
    type WBuf = [f32];
    const PRECISION: Precision = Precision::F32;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }

    fn upload_i32(&self, dst: &mut [i32], src: &[i32]) {
        dst.copy_from_slice(src);
    }

    /// Exact: the CPU computes with the fp32 masters themselves.
    fn upload_weights(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }

    fn download(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }

    fn copy(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }

    fn zero(&self, buf: &mut [f32]) {
        // Over the pool above 256 KiB: a layer's weight-gradient accumulator (3.2 MB in
        // `bench/overlap.yaml`) took 300-330 us a fill on one thread in traced runs, a tenth of
        // a layer's backward products' share of the step.
        if buf.len() >= ZERO_PAR_ELEMS {
            use rayon::prelude::*;
            buf.par_chunks_mut(ZERO_PAR_ELEMS / 2).for_each(|c| c.fill(0.0));
        } else {
            buf.fill(0.0);
        }
    }

    fn embedding_forward(&self, out: &mut [f32], ids: &[i32], table: &[f32], c: usize) {
        embedding_forward(out, ids, table, c);
    }

    fn embedding_backward(&self, dtable: &mut [f32], ids: &[i32], dout: &[f32], c: usize) {
        embedding_backward(dtable, ids, dout, c);
    }

    fn rmsnorm_forward(
        &self,
        out: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        norm: NormDims,
    ) {
        rmsnorm_forward(out, rstd, inp, weight, norm);
    }

    fn rmsnorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        rstd: &[f32],
        norm: NormDims,
    ) {
        rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, norm);
    }

    fn head_rmsnorm_forward(
        &self,
        out: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        dims: AttnDims,
        norm: NormDims,
    ) {
        head_rmsnorm_forward(out, rstd, inp, weight, dims, norm);
    }

    fn head_rmsnorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        rstd: &[f32],
        dims: AttnDims,
        norm: NormDims,
    ) {
        head_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, dims, norm);
    }

    fn matmul_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        matmul_forward(out, inp, weight, bias, n, ic, oc);
    }

    fn matmul_backward(
        &self,
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
        matmul_backward(dinp, dweight, dbias, dout, inp, weight, n, ic, oc);
    }

    fn rope_forward(&self, qkv: &mut [f32], cos: &[f32], sin: &[f32], dims: AttnDims) {
        rope_forward(qkv, cos, sin, dims);
    }

    fn rope_backward(&self, dqkv: &mut [f32], cos: &[f32], sin: &[f32], dims: AttnDims) {
        rope_backward(dqkv, cos, sin, dims);
    }

    fn attention_forward(&self, out: &mut [f32], lse: &mut [f32], qkv: &[f32], dims: AttnDims) {
        attention_forward(out, lse, qkv, dims);
    }

    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dout: &[f32],
        qkv: &[f32],
        out: &[f32],
        lse: &[f32],
        dims: AttnDims,
    ) {
        attention_backward(dqkv, dout, qkv, out, lse, dims);
    }

    fn attention_sink_forward(
        &self,
        out: &mut [f32],
        lse: &mut [f32],
        sinks: &[f32],
        dims: AttnDims,
    ) {
        attention_sink_forward(out, lse, sinks, dims);
    }

    fn attention_sink_backward(
        &self,
        dsinks: &mut [f32],
        dout: &[f32],
        out: &[f32],
        lse: &[f32],
        sinks: &[f32],
        dims: AttnDims,
    ) {
        attention_sink_backward(dsinks, dout, out, lse, sinks, dims);
    }

    fn attention_decode(
        &self,
        out: &mut [f32],
        qkv: &[f32],
        sinks: Option<&[f32]>,
        t_new: usize,
        dims: AttnDims,
    ) {
        attention_decode(out, qkv, sinks, t_new, dims);
    }

    fn moe_route_forward(
        &self,
        probs: &mut [f32],
        sel: &mut [f32],
        wts: &mut [f32],
        logits: &[f32],
        dims: MoeDims,
    ) {
        moe_route_forward(probs, sel, wts, logits, dims);
    }

    fn moe_route_backward(
        &self,
        dlogits: &mut [f32],
        dwts: &[f32],
        probs: &[f32],
        sel: &[f32],
        aux: Option<(&[f32], &[f32])>,
        dims: MoeDims,
    ) {
        moe_route_backward(dlogits, dwts, probs, sel, aux, dims);
    }

    fn moe_aux_stats(
        &self,
        stats: &mut [f32],
        probs: &[f32],
        sel: &[f32],
        mask: &[f32],
        dims: MoeDims,
    ) {
        moe_aux_stats(stats, probs, sel, mask, dims);
    }

    fn moe_gather(&self, xs: &mut [f32], x: &[f32], order: &[f32], k: usize, c: usize) {
        moe_gather(xs, x, order, k, c);
    }

    fn moe_scatter_add(
        &self,
        out: &mut [f32],
        src: &[f32],
        order: &[f32],
        wts: Option<&[f32]>,
        k: usize,
        c: usize,
    ) {
        moe_scatter_add(out, src, order, wts, k, c);
    }

    fn moe_scale_rows(&self, buf: &mut [f32], wts: &[f32], order: &[f32], w: usize) {
        moe_scale_rows(buf, wts, order, w);
    }

    fn moe_row_dots(&self, out: &mut [f32], a: &[f32], b: &[f32], order: &[f32], w: usize) {
        moe_row_dots(out, a, b, order, w);
    }

    fn moe_bias_dots(&self, out: &mut [f32], dy: &[f32], bias: &[f32], order: &[f32], c: usize) {
        moe_bias_dots(out, dy, bias, order, c);
    }

    fn sigmoid_gate_forward(&self, out: &mut [f32], gate: &[f32], inp: &[f32], c: usize) {
        sigmoid_gate_forward(out, gate, inp, c);
    }

    fn sigmoid_gate_backward(
        &self,
        dinp: &mut [f32],
        dgate: &mut [f32],
        dout: &[f32],
        gate: &[f32],
        inp: &[f32],
        c: usize,
    ) {
        sigmoid_gate_backward(dinp, dgate, dout, gate, inp, c);
    }

    fn swiglu_forward(&self, out: &mut [f32], gate_up: &[f32], n: usize, f: usize) {
        swiglu_forward(out, gate_up, n, f);
    }

    fn swiglu_backward(
        &self,
        dgate_up: &mut [f32],
        dout: &[f32],
        gate_up: &[f32],
        n: usize,
        f: usize,
    ) {
        swiglu_backward(dgate_up, dout, gate_up, n, f);
    }

    fn clamped_swiglu_forward(
        &self,
        out: &mut [f32],
        gate_up: &[f32],
        n: usize,
        f: usize,
        clamp: crate::GluClamp,
    ) {
        clamped_swiglu_forward(out, gate_up, n, f, clamp);
    }

    fn clamped_swiglu_backward(
        &self,
        dgate_up: &mut [f32],
        dout: &[f32],
        gate_up: &[f32],
        nf: (usize, usize),
        clamp: crate::GluClamp,
    ) {
        clamped_swiglu_backward(dgate_up, dout, gate_up, nf, clamp);
    }

    fn geglu_forward(&self, out: &mut [f32], gate_up: &[f32], n: usize, f: usize) {
        geglu_forward(out, gate_up, n, f);
    }

    fn geglu_backward(
        &self,
        dgate_up: &mut [f32],
        dout: &[f32],
        gate_up: &[f32],
        n: usize,
        f: usize,
    ) {
        geglu_backward(dgate_up, dout, gate_up, n, f);
    }

    fn add_cols(
        &self,
        out: &mut [f32],
        src: &[f32],
        n: usize,
        out_w: usize,
        col: usize,
        w: usize,
        scale: f32,
    ) {
        add_cols(out, src, n, out_w, col, w, scale);
    }

    fn scaled_cols(
        &self,
        out: &mut [f32],
        src: &[f32],
        n: usize,
        src_w: usize,
        col: usize,
        w: usize,
        scale: f32,
    ) {
        scaled_cols(out, src, n, src_w, col, w, scale);
    }

    fn dequantize_nf4(&self, out: &mut [f32], packed: &[f32], n: usize) {
        dequantize_nf4(out, packed, n);
    }

    fn dequantize_mxfp4(&self, out: &mut [f32], packed: &[f32], n: usize) {
        nf4::dequantize_mxfp4(out, packed, n);
    }

    fn residual_forward(&self, out: &mut [f32], a: &[f32], b: &[f32]) {
        residual_forward(out, a, b);
    }

    fn add_inplace(&self, acc: &mut [f32], x: &[f32]) {
        add_inplace(acc, x);
    }

    fn cross_entropy_forward(
        &self,
        losses: &mut [f32],
        logits: &[f32],
        targets: &[i32],
        n: usize,
        v: usize,
    ) {
        cross_entropy_forward(losses, logits, targets, n, v);
    }

    fn cross_entropy_fused(
        &self,
        logits: &mut [f32],
        losses: &mut [f32],
        targets: &[i32],
        n: usize,
        v: usize,
        scale: f32,
    ) {
        cross_entropy_fused(logits, losses, targets, n, v, scale);
    }

    fn cross_entropy_tile_stats(
        &self,
        stats: &mut [f32],
        logits: &[f32],
        targets: &[i32],
        n: usize,
        vt: usize,
        v0: usize,
        first: bool,
    ) {
        cross_entropy_tile_stats(stats, logits, targets, n, vt, v0, first);
    }

    fn cross_entropy_tile_grad(
        &self,
        logits: &mut [f32],
        stats: &[f32],
        targets: &[i32],
        n: usize,
        vt: usize,
        v0: usize,
        scale: f32,
    ) {
        cross_entropy_tile_grad(logits, stats, targets, n, vt, v0, scale);
    }

    fn cross_entropy_tile_loss(
        &self,
        losses: &mut [f32],
        stats: &[f32],
        targets: &[i32],
        n: usize,
    ) {
        cross_entropy_tile_loss(losses, stats, targets, n);
    }
}

/// Dot product of two equal-length vectors, summed in 8 lane-wise partial sums (so the compiler
/// can vectorise it) that are then combined in a fixed tree, plus a scalar tail. The order of
/// additions depends only on the length, never on threads.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = reduce8(acc);
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

/// `x[i] = exp(x[i])` for every element, 8 lanes at a time with AVX2 + FMA when the CPU has
/// them (Cephes' single-precision polynomial: relative error under 2 ulp; arguments below
/// -87, whose exp is under 2^-125, give 0; above 88, +inf; NaN stays NaN), `f32::exp`
/// otherwise.
/// The tail runs through the same vector code, so a value's result does not depend on where
/// it sits in the slice.
pub(crate) fn exp_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let mut chunks = x.chunks_exact_mut(8);
            for c in &mut chunks {
                let c: &mut [f32; 8] = c.try_into().expect("chunks of 8");
                // SAFETY: the CPU supports AVX2 and FMA (checked above).
                unsafe { exp8_avx2(c) };
            }
            let rest = chunks.into_remainder();
            if !rest.is_empty() {
                let mut tail = [0.0f32; 8];
                tail[..rest.len()].copy_from_slice(rest);
                // SAFETY: as above.
                unsafe { exp8_avx2(&mut tail) };
                rest.copy_from_slice(&tail[..rest.len()]);
            }
            return;
        }
    }
    x.iter_mut().for_each(|v| *v = v.exp());
}

/// Eight `exp`s in place; see [`exp_in_place`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8_avx2(v: &mut [f32; 8]) {
    use std::arch::x86_64::*;
    // SAFETY (whole body): `v` holds exactly 8 floats; the rest is register arithmetic.
    unsafe {
        let x0 = _mm256_loadu_ps(v.as_ptr());
        let x = _mm256_min_ps(_mm256_max_ps(x0, _mm256_set1_ps(-87.0)), _mm256_set1_ps(88.0));
        // n = round(x / ln 2); r = x - n ln 2 in two parts (Cody-Waite).
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        // exp(r) on |r| <= ln2/2: 1 + r + r^2 (1/2 + r/6 + ...), Cephes' coefficients.
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_199_9e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666_666_5e-1));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        // 2^n by building the exponent bits (n in -126..=127 after the clamp).
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
        // Below the clamp the true value is under 2^-125: flush to 0. Above it: +inf. NaN
        // stays NaN.
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x0, _mm256_set1_ps(-87.0));
        let y = _mm256_andnot_ps(under, y);
        let over = _mm256_cmp_ps::<_CMP_GT_OQ>(x0, _mm256_set1_ps(88.0));
        let y = _mm256_blendv_ps(y, _mm256_set1_ps(f32::INFINITY), over);
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x0, x0);
        _mm256_storeu_ps(v.as_mut_ptr(), _mm256_blendv_ps(y, x0, nan));
    }
}

/// Sum of 8 lanes in a fixed pairwise tree.
#[inline(always)]
pub(crate) fn reduce8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

#[cfg(test)]
mod tests {
    use super::exp_in_place;

    /// The vector exp against f64's on a dense sweep of the softmax range and beyond, at
    /// every slice position (tails included), and its special values.
    #[test]
    fn exp_in_place_is_within_two_ulp_of_f64() {
        let xs: Vec<f32> = (0..200_001).map(|i| -100.0 + i as f32 * 0.000_94).collect();
        for len in [1, 7, 8, 9, 200_001] {
            let mut y = xs[..len].to_vec();
            exp_in_place(&mut y);
            for (&x, &y) in xs.iter().zip(&y) {
                let want = (x as f64).exp();
                if x < -87.0 {
                    assert!(y == 0.0 || (y as f64 - want).abs() <= 2e-38, "exp({x}) = {y}");
                } else if x > 88.0 {
                    assert_eq!(y, f32::INFINITY, "exp({x})");
                } else {
                    let ulp = want * f64::from(f32::EPSILON);
                    assert!((y as f64 - want).abs() <= 2.0 * ulp, "exp({x}) = {y}, want {want}");
                }
            }
        }
        let mut v = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, 1.0, -1.0, 1e-30];
        exp_in_place(&mut v);
        assert!(v[0].is_nan());
        assert_eq!(&v[1..6], &[0.0, f32::INFINITY, 1.0, 1.0, std::f32::consts::E]);
        assert!((v[6] as f64 - (-1.0f64).exp()).abs() < 1e-7 && v[7] == 1.0);
    }
}
