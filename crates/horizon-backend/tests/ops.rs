//! Op tests for the CPU reference backend: every forward against a plain f64 reference, every
//! backward against central differences of that reference, accumulate/overwrite semantics
//! (parameter gradients double when a backward runs twice), attention causality, GQA, sliding
//! windows and scales, RMSNorm's `(1 + w)`, the per-head norm as the plain norm of each head,
//! and the cross-entropy and activation edge cases; the cross-entropy over vocabulary tiles
//! (stats, grad, loss) composes to the fused op for every tile width; the mixture-of-experts
//! routing (top-k ties to the lower expert) and its backward with and without `norm` and the
//! load-balancing term, the host's stable sort by expert, and the dispatch ops (the
//! down-projection bias dots included); the shared expert's sigmoid gate (both gradients,
//! saturation); gpt-oss's attention sinks (forward against an explicit extra softmax column,
//! the backward chain against finite differences in qkv and the sinks, decode with sinks).
//!
//! Tolerances (criterion of `assert_close`: `|got - want| <= tol * max(1, |want|)`):
//! - `FWD_TOL` = 1e-5: an f32 op against the f64 reference on O(1) data. f32 rounding over the
//!   short sums here is observed at <= 3e-7 (matmul, attention with or without a window,
//!   rmsnorm with or without `(1 + w)`, head_rmsnorm, CE, geglu, the sigmoid gate), <= 7e-7
//!   (swiglu with |gate| up to 4), below 1e-6 (MoE routing, aux statistics, scatter-add, row
//!   dots, bias dots: 3.1e-7), <= 2.7e-7 (attention then the sinks' rescale, out and lse, with
//!   sinks from -30 to +8): a margin of more than 10x.
//! - `GRAD_TOL` = 1e-5: an f32 analytic backward against f64 central differences (step 1e-5,
//!   their own error ~1e-10). The f32 backward is observed within 5e-7 (attention's `dP - dD`,
//!   rmsnorm's and head_rmsnorm's `dout w - x r^2 s / C` cancellations and geglu's `1 - t^2`
//!   included; the MoE routing backward, with and without `norm` and the aux term, below 1e-6;
//!   the sigmoid gate's dinp and its dgate, a row sum of up to 130 products, below 3e-7; the
//!   sink attention's dqkv (attention_backward on the adjusted out and lse) within 2.7e-7 and
//!   its dsinks, a sum over every row, within 1.7e-7).
//! - `TWICE_TOL` = 1e-6: a backward run twice against twice one run, where sums are added
//!   straight into the gradient (embedding rows named by repeated ids). Matmul, rmsnorm and
//!   head_rmsnorm form each sum before adding it once, so for them doubling is checked
//!   bit-exactly; so do the attention sinks' dsinks.
//! - 1e-6: `attention_decode` with sinks against the rows of the forward and the sinks'
//!   rescale (the sink's exp within the row's softmax against `exp(lse - lse')` after it, and
//!   within a window the same sums grouped differently); observed <= 2.4e-7.
//! - 1e-6: the tiled cross-entropy against the fused one; the same f32 exponentials, only the
//!   f64 sums of a row are combined over the tiles (and the running sum is stored as f32).

mod common;

use common::*;
use horizon_backend::cpu::testing::{Rng, assert_close};
use horizon_backend::cpu::*;
use horizon_backend::{AttnDims, Dinp, MoeDims, NormDims};

const FWD_TOL: f64 = 1e-5;
const GRAD_TOL: f64 = 1e-5;
const TWICE_TOL: f64 = 1e-6;

/// Attention shapes covering GQA (3 over 1, 4 over 2), MQA, plain MHA, T = 1, and T over two
/// query blocks of the CPU kernel (64 rows each) with a partial third.
fn attn_dims() -> [AttnDims; 6] {
    [
        AttnDims::new(2, 7, 3, 1, 4),
        AttnDims::new(2, 7, 4, 2, 4),
        AttnDims::new(1, 6, 4, 1, 6),
        AttnDims::new(2, 5, 2, 2, 4),
        AttnDims::new(3, 1, 2, 1, 2),
        AttnDims::new(1, 140, 2, 1, 4),
    ]
}

/// `sum(out * r)` in f64: the scalar loss whose gradient w.r.t. `out` is `r`.
fn proj(out: &[f64], r: &[f32]) -> f64 {
    out.iter().zip(r).map(|(o, &r)| o * f64::from(r)).sum()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

// ---- embedding ----------------------------------------------------------------------------

/// Ids with repeats and with rows of the table left unused (V = 11, ids only from 0..8).
fn embedding_case(rng: &mut Rng) -> (Vec<i32>, Vec<f32>, usize, usize) {
    let (n, v, c) = (14, 11, 12);
    let ids: Vec<i32> = (0..n).map(|_| rng.below(8) as i32).collect();
    (ids, rng.vec(v * c, 1.0), v, c)
}

#[test]
fn embedding_forward_matches_reference() {
    let mut rng = Rng::new(1);
    let (ids, table, _, c) = embedding_case(&mut rng);
    let mut out = vec![f32::NAN; ids.len() * c];
    embedding_forward(&mut out, &ids, &table, c);
    assert_close("embedding out", &out, &embedding_ref(&ids, &to64(&table), c), 0.0);
}

#[test]
fn embedding_backward_matches_fd_and_touches_only_named_rows() {
    let mut rng = Rng::new(2);
    let (ids, table, v, c) = embedding_case(&mut rng);
    let r = rng.vec(ids.len() * c, 1.0);
    let prefill = rng.vec(v * c, 1.0);
    let mut dtable = prefill.clone();
    embedding_backward(&mut dtable, &ids, &r, c);

    let fd = fd_grad(&to64(&table), FD_EPS, |t| proj(&embedding_ref(&ids, t, c), &r));
    let want: Vec<f64> = fd.iter().zip(&prefill).map(|(g, &p)| g + f64::from(p)).collect();
    assert_close("embedding dtable", &dtable, &want, GRAD_TOL);
    for row in 0..v {
        if !ids.contains(&(row as i32)) {
            let (got, was) = (&dtable[row * c..][..c], &prefill[row * c..][..c]);
            assert_eq!(bits(got), bits(was), "dtable row {row} is not named by ids but changed");
        }
    }
}

#[test]
fn embedding_backward_twice_doubles() {
    let mut rng = Rng::new(3);
    let (ids, _, v, c) = embedding_case(&mut rng);
    let dout = rng.vec(ids.len() * c, 1.0);
    let mut once = vec![0.0; v * c];
    embedding_backward(&mut once, &ids, &dout, c);
    let mut twice = vec![0.0; v * c];
    embedding_backward(&mut twice, &ids, &dout, c);
    embedding_backward(&mut twice, &ids, &dout, c);
    let want: Vec<f32> = once.iter().map(|g| 2.0 * g).collect();
    assert_close("embedding dtable twice", &twice, &want, TWICE_TOL);
}

#[test]
#[should_panic(expected = "outside the table")]
fn embedding_rejects_bad_id() {
    let mut out = vec![0.0; 2];
    embedding_forward(&mut out, &[5], &[0.0; 8], 2);
}

// ---- rmsnorm ------------------------------------------------------------------------------

const RMS_EPS: f32 = 1e-5;

#[test]
fn rmsnorm_forward_matches_reference() {
    let mut rng = Rng::new(4);
    for (n, c) in [(14, 12), (5, 70), (3, 1)] {
        let inp = rng.vec(n * c, 2.0);
        let w = rng.vec(c, 1.5);
        let (mut out, mut rstd) = (vec![f32::NAN; n * c], vec![f32::NAN; n]);
        rmsnorm_forward(&mut out, &mut rstd, &inp, &w, NormDims::new(c, RMS_EPS));
        let (want, want_rstd) = rmsnorm_ref(&to64(&inp), &to64(&w), c, f64::from(RMS_EPS), 0.0);
        assert_close(&format!("rmsnorm out N={n} C={c}"), &out, &want, FWD_TOL);
        assert_close(&format!("rmsnorm rstd N={n} C={c}"), &rstd, &want_rstd, FWD_TOL);
    }
}

#[test]
fn rmsnorm_backward_matches_fd_and_accumulates() {
    let mut rng = Rng::new(5);
    for (n, c) in [(14, 12), (3, 70)] {
        let inp = rng.vec(n * c, 2.0);
        let w = rng.vec(c, 1.5);
        let r = rng.vec(n * c, 1.0);
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut out, &mut rstd, &inp, &w, NormDims::new(c, RMS_EPS));
        let pre_dinp = rng.vec(n * c, 1.0);
        let pre_dw = rng.vec(c, 1.0);
        let (mut dinp, mut dw) = (pre_dinp.clone(), pre_dw.clone());
        rmsnorm_backward(&mut dinp, Some(&mut dw), &r, &inp, &w, &rstd, NormDims::new(c, RMS_EPS));

        let (inp64, w64, eps) = (to64(&inp), to64(&w), f64::from(RMS_EPS));
        let fd_x = fd_grad(&inp64, FD_EPS, |x| proj(&rmsnorm_ref(x, &w64, c, eps, 0.0).0, &r));
        let fd_w = fd_grad(&w64, FD_EPS, |w| proj(&rmsnorm_ref(&inp64, w, c, eps, 0.0).0, &r));
        let plus = |g: &[f64], p: &[f32]| -> Vec<f64> {
            g.iter().zip(p).map(|(g, &p)| g + f64::from(p)).collect()
        };
        assert_close(&format!("rmsnorm dinp C={c}"), &dinp, &plus(&fd_x, &pre_dinp), GRAD_TOL);
        assert_close(&format!("rmsnorm dweight C={c}"), &dw, &plus(&fd_w, &pre_dw), GRAD_TOL);
    }
}

#[test]
fn rmsnorm_backward_twice_doubles_dweight_exactly() {
    let mut rng = Rng::new(6);
    let (n, c) = (9, 70);
    let inp = rng.vec(n * c, 2.0);
    let w = rng.vec(c, 1.5);
    let dout = rng.vec(n * c, 1.0);
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut out, &mut rstd, &inp, &w, NormDims::new(c, RMS_EPS));
    let (mut dinp1, mut dw1) = (vec![0.0; n * c], vec![0.0; c]);
    rmsnorm_backward(&mut dinp1, Some(&mut dw1), &dout, &inp, &w, &rstd, NormDims::new(c, RMS_EPS));
    let (mut dinp2, mut dw2) = (vec![0.0; n * c], vec![0.0; c]);
    rmsnorm_backward(&mut dinp2, Some(&mut dw2), &dout, &inp, &w, &rstd, NormDims::new(c, RMS_EPS));
    rmsnorm_backward(&mut dinp2, Some(&mut dw2), &dout, &inp, &w, &rstd, NormDims::new(c, RMS_EPS));
    let double = |x: &[f32]| -> Vec<f32> { x.iter().map(|g| 2.0 * g).collect() };
    assert_eq!(bits(&dw2), bits(&double(&dw1)), "rmsnorm dweight did not double exactly");
    assert_eq!(bits(&dinp2), bits(&double(&dinp1)), "rmsnorm dinp did not double exactly");
}

/// Gemma's norm: `w_offset = 1`, weights near 0 as a trained Gemma checkpoint holds them.
fn gemma_norm(c: usize) -> NormDims {
    NormDims { w_offset: 1.0, ..NormDims::new(c, 1e-6) }
}

#[test]
fn rmsnorm_w_offset_forward_matches_reference() {
    let mut rng = Rng::new(40);
    for (n, c) in [(14, 12), (5, 70), (3, 1)] {
        let norm = gemma_norm(c);
        let inp = rng.vec(n * c, 2.0);
        let w = rng.vec(c, 0.5);
        let (mut out, mut rstd) = (vec![f32::NAN; n * c], vec![f32::NAN; n]);
        rmsnorm_forward(&mut out, &mut rstd, &inp, &w, norm);
        let (want, want_rstd) = rmsnorm_ref(&to64(&inp), &to64(&w), c, f64::from(norm.eps), 1.0);
        assert_close(&format!("rmsnorm (1 + w) out N={n} C={c}"), &out, &want, FWD_TOL);
        assert_close(&format!("rmsnorm (1 + w) rstd N={n} C={c}"), &rstd, &want_rstd, FWD_TOL);
    }
}

#[test]
fn rmsnorm_w_offset_backward_matches_fd_and_accumulates() {
    let mut rng = Rng::new(41);
    for (n, c) in [(14, 12), (3, 70)] {
        let norm = gemma_norm(c);
        let inp = rng.vec(n * c, 2.0);
        let w = rng.vec(c, 0.5);
        let r = rng.vec(n * c, 1.0);
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut out, &mut rstd, &inp, &w, norm);
        let pre_dinp = rng.vec(n * c, 1.0);
        let pre_dw = rng.vec(c, 1.0);
        let (mut dinp, mut dw) = (pre_dinp.clone(), pre_dw.clone());
        rmsnorm_backward(&mut dinp, Some(&mut dw), &r, &inp, &w, &rstd, norm);

        let (inp64, w64, eps) = (to64(&inp), to64(&w), f64::from(norm.eps));
        let fd_x = fd_grad(&inp64, FD_EPS, |x| proj(&rmsnorm_ref(x, &w64, c, eps, 1.0).0, &r));
        let fd_w = fd_grad(&w64, FD_EPS, |w| proj(&rmsnorm_ref(&inp64, w, c, eps, 1.0).0, &r));
        let plus = |g: &[f64], p: &[f32]| -> Vec<f64> {
            g.iter().zip(p).map(|(g, &p)| g + f64::from(p)).collect()
        };
        let name = format!("rmsnorm (1 + w) C={c}");
        assert_close(&format!("{name} dinp"), &dinp, &plus(&fd_x, &pre_dinp), GRAD_TOL);
        assert_close(&format!("{name} dweight"), &dw, &plus(&fd_w, &pre_dw), GRAD_TOL);
    }
}

#[test]
fn rmsnorm_w_offset_is_the_shifted_weight_exactly() {
    // `w_offset = 1` with weight w computes with the fp32 sum `1 + w`, so it gives the bits of
    // a plain norm whose weight holds `1 + w`; dweight does not depend on the weight at all.
    // Run twice, dweight doubles exactly (its sum is formed first, then added once).
    let mut rng = Rng::new(42);
    let (n, c) = (9, 70);
    let inp = rng.vec(n * c, 2.0);
    let w = rng.vec(c, 0.5);
    let w1: Vec<f32> = w.iter().map(|w| 1.0 + w).collect();
    let dout = rng.vec(n * c, 1.0);
    let run = |w: &[f32], norm: NormDims, times: usize| {
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut out, &mut rstd, &inp, w, norm);
        let (mut dinp, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
        for _ in 0..times {
            rmsnorm_backward(&mut dinp, Some(&mut dw), &dout, &inp, w, &rstd, norm);
        }
        (bits(&out), bits(&rstd), bits(&dinp), dw)
    };
    let plain = NormDims::new(c, 1e-6);
    let (out, rstd, dinp, dw) = run(&w, gemma_norm(c), 1);
    let (out1, rstd1, dinp1, dw1) = run(&w1, plain, 1);
    assert_eq!(out, out1, "rmsnorm (1 + w) out differs from the plain norm of 1 + w");
    assert_eq!(rstd, rstd1, "rmsnorm (1 + w) rstd differs");
    assert_eq!(dinp, dinp1, "rmsnorm (1 + w) dinp differs from the plain norm of 1 + w");
    assert_eq!(bits(&dw), bits(&dw1), "rmsnorm dweight depends on the weight");
    let (_, _, _, dw2) = run(&w, gemma_norm(c), 2);
    let double: Vec<f32> = dw.iter().map(|g| 2.0 * g).collect();
    assert_eq!(bits(&dw2), bits(&double), "rmsnorm (1 + w) dweight did not double exactly");
}

// ---- head_rmsnorm -------------------------------------------------------------------------

/// Per-head norm shapes: GQA with D = 6 (not a power of two, not a multiple of 8), MQA, and
/// D = 32 with more q heads than a model's C / H would suggest (the op never sees C).
fn head_norm_dims() -> [AttnDims; 3] {
    [AttnDims::new(2, 5, 4, 2, 6), AttnDims::new(1, 3, 3, 1, 6), AttnDims::new(1, 3, 4, 2, 32)]
}

/// A plain (Qwen3) and a `(1 + w)` (Gemma 3) head norm over `d`.
fn head_norms(d: usize) -> [NormDims; 2] {
    [NormDims::new(d, 1e-6), NormDims { w_offset: 1.0, ..NormDims::new(d, 1e-6) }]
}

#[test]
fn head_rmsnorm_forward_matches_reference() {
    let mut rng = Rng::new(50);
    for dims in head_norm_dims() {
        for norm in head_norms(dims.d) {
            let heads = dims.h + dims.kvh;
            let inp = rng.vec(dims.n() * dims.qkv_width(), 2.0);
            let w = rng.vec(2 * dims.d, 1.0);
            let (mut out, mut rstd) = (vec![f32::NAN; inp.len()], vec![f32::NAN; dims.n() * heads]);
            head_rmsnorm_forward(&mut out, &mut rstd, &inp, &w, dims, norm);
            let (eps, off) = (f64::from(norm.eps), f64::from(norm.w_offset));
            let (want, want_rstd) = head_rmsnorm_ref(&to64(&inp), &to64(&w), dims, eps, off);
            let name = format!("head_rmsnorm {dims:?} w_offset={}", norm.w_offset);
            assert_close(&format!("{name} out"), &out, &want, FWD_TOL);
            assert_close(&format!("{name} rstd"), &rstd, &want_rstd, FWD_TOL);
            let v0 = heads * dims.d;
            for (o, x) in out.chunks(dims.qkv_width()).zip(inp.chunks(dims.qkv_width())) {
                assert_eq!(bits(&o[v0..]), bits(&x[v0..]), "{name}: v is not copied exactly");
            }
        }
    }
}

#[test]
fn head_rmsnorm_is_rmsnorm_of_each_head_bit_for_bit() {
    // Each head is exactly rmsnorm_forward / rmsnorm_backward of that head alone (same op
    // order), so the per-head norm inherits the plain norm's checks and its bits.
    let mut rng = Rng::new(51);
    for dims in head_norm_dims() {
        for norm in head_norms(dims.d) {
            let (d, h, heads, width) = (dims.d, dims.h, dims.h + dims.kvh, dims.qkv_width());
            let inp = rng.vec(dims.n() * width, 2.0);
            let w = rng.vec(2 * d, 1.0);
            let dout = rng.vec(inp.len(), 1.0);
            let (mut out, mut rstd) = (vec![0.0; inp.len()], vec![0.0; dims.n() * heads]);
            head_rmsnorm_forward(&mut out, &mut rstd, &inp, &w, dims, norm);
            let (mut dinp, mut dw) = (vec![f32::NAN; inp.len()], vec![0.0; 2 * d]);
            head_rmsnorm_backward(&mut dinp, Some(&mut dw), &dout, &inp, &w, &rstd, dims, norm);
            for r in 0..dims.n() {
                for j in 0..heads {
                    let at = r * width + j * d;
                    let (x, dy) = (&inp[at..][..d], &dout[at..][..d]);
                    let wj = if j < h { &w[..d] } else { &w[d..] };
                    let (mut o1, mut r1) = (vec![0.0; d], vec![0.0; 1]);
                    rmsnorm_forward(&mut o1, &mut r1, x, wj, norm);
                    let (mut dx1, mut dw1) = (vec![0.0; d], vec![0.0; d]);
                    rmsnorm_backward(&mut dx1, Some(&mut dw1), dy, x, wj, &r1, norm);
                    let what = format!("{dims:?} w_offset={} row {r} head {j}", norm.w_offset);
                    assert_eq!(bits(&out[at..][..d]), bits(&o1), "out of {what}");
                    assert_eq!(rstd[r * heads + j].to_bits(), r1[0].to_bits(), "rstd of {what}");
                    assert_eq!(bits(&dinp[at..][..d]), bits(&dx1), "dinp of {what}");
                }
            }
        }
    }
}

#[test]
fn head_rmsnorm_backward_matches_fd() {
    let mut rng = Rng::new(52);
    for dims in head_norm_dims() {
        for norm in head_norms(dims.d) {
            let heads = dims.h + dims.kvh;
            let inp = rng.vec(dims.n() * dims.qkv_width(), 2.0);
            let w = rng.vec(2 * dims.d, 1.0);
            let r = rng.vec(inp.len(), 1.0);
            let (mut out, mut rstd) = (vec![0.0; inp.len()], vec![0.0; dims.n() * heads]);
            head_rmsnorm_forward(&mut out, &mut rstd, &inp, &w, dims, norm);
            let mut dinp = vec![f32::NAN; inp.len()]; // overwritten
            let pre_dw = rng.vec(2 * dims.d, 1.0);
            let mut dw = pre_dw.clone();
            head_rmsnorm_backward(&mut dinp, Some(&mut dw), &r, &inp, &w, &rstd, dims, norm);

            let (inp64, w64) = (to64(&inp), to64(&w));
            let (eps, off) = (f64::from(norm.eps), f64::from(norm.w_offset));
            let loss = |x: &[f64], w: &[f64]| proj(&head_rmsnorm_ref(x, w, dims, eps, off).0, &r);
            let fd_x = fd_grad(&inp64, FD_EPS, |x| loss(x, &w64));
            let fd_w = fd_grad(&w64, FD_EPS, |w| loss(&inp64, w));
            let want_dw: Vec<f64> =
                fd_w.iter().zip(&pre_dw).map(|(g, &p)| g + f64::from(p)).collect();
            let name = format!("head_rmsnorm {dims:?} w_offset={}", norm.w_offset);
            assert_close(&format!("{name} dinp"), &dinp, &fd_x, GRAD_TOL);
            assert_close(&format!("{name} dweight"), &dw, &want_dw, GRAD_TOL);
        }
    }
}

#[test]
fn head_rmsnorm_backward_twice_doubles_dweight_exactly() {
    // dweight accumulates a sum formed first (exact doubling); dinp overwrites (same bits).
    let mut rng = Rng::new(53);
    let dims = AttnDims::new(3, 30, 4, 2, 40); // 40 columns per half: three column tiles
    let norm = head_norms(dims.d)[1];
    let heads = dims.h + dims.kvh;
    let inp = rng.vec(dims.n() * dims.qkv_width(), 2.0);
    let w = rng.vec(2 * dims.d, 1.0);
    let dout = rng.vec(inp.len(), 1.0);
    let (mut out, mut rstd) = (vec![0.0; inp.len()], vec![0.0; dims.n() * heads]);
    head_rmsnorm_forward(&mut out, &mut rstd, &inp, &w, dims, norm);
    let (mut dinp1, mut dw1) = (vec![0.0; inp.len()], vec![0.0; 2 * dims.d]);
    head_rmsnorm_backward(&mut dinp1, Some(&mut dw1), &dout, &inp, &w, &rstd, dims, norm);
    let (mut dinp2, mut dw2) = (vec![0.0; inp.len()], vec![0.0; 2 * dims.d]);
    head_rmsnorm_backward(&mut dinp2, Some(&mut dw2), &dout, &inp, &w, &rstd, dims, norm);
    head_rmsnorm_backward(&mut dinp2, Some(&mut dw2), &dout, &inp, &w, &rstd, dims, norm);
    let double: Vec<f32> = dw1.iter().map(|g| 2.0 * g).collect();
    assert_eq!(bits(&dw2), bits(&double), "head_rmsnorm dweight did not double exactly");
    assert_eq!(bits(&dinp2), bits(&dinp1), "head_rmsnorm dinp does not overwrite");
}

// ---- matmul -------------------------------------------------------------------------------

#[test]
fn matmul_forward_matches_reference() {
    let mut rng = Rng::new(7);
    // Small odd shapes, and one that crosses every tile (ROW_TILE 32, OC_TILE 64, MR 4, 8 lanes).
    for (n, ic, oc) in [(14, 12, 10), (1, 3, 1), (37, 70, 45), (67, 9, 130)] {
        let inp = rng.vec(n * ic, 1.0);
        let w = rng.vec(oc * ic, 1.0 / (ic as f32).sqrt());
        let b = rng.vec(oc, 1.0);
        for bias in [None, Some(&b[..])] {
            let mut out = vec![f32::NAN; n * oc];
            matmul_forward(&mut out, &inp, &w, bias, n, ic, oc);
            let b64 = bias.map(to64);
            let want = matmul_ref(&to64(&inp), &to64(&w), b64.as_deref(), n, ic, oc);
            let name = format!("matmul out N={n} IC={ic} OC={oc} bias={}", bias.is_some());
            assert_close(&name, &out, &want, FWD_TOL);
        }
    }
}

#[test]
fn matmul_rows_do_not_depend_on_tiling() {
    // Each output row must get the same bits whether it sits in a 4-row micro-kernel block or
    // is computed alone (a row alone takes the unpacked one-row path, a decode step's), so
    // results cannot depend on N or on where a row falls in a tile. The second shape has
    // several `k` blocks of 256 and several column tasks; `dinp` is checked the same way.
    let mut rng = Rng::new(8);
    for (n, ic, oc) in [(37, 70, 45), (7, 600, 300), (5, 21, 64)] {
        let inp = rng.vec(n * ic, 1.0);
        let w = rng.vec(oc * ic, 0.2);
        let b = rng.vec(oc, 1.0);
        let dout = rng.vec(n * oc, 1.0);
        let mut out = vec![0.0; n * oc];
        matmul_forward(&mut out, &inp, &w, Some(&b), n, ic, oc);
        let (mut dinp, mut dw) = (vec![0.0; n * ic], vec![0.0; oc * ic]);
        matmul_backward(
            Some(Dinp::Write(&mut dinp)),
            Some(&mut dw),
            None,
            &dout,
            &inp,
            &w,
            n,
            ic,
            oc,
        );
        for r in 0..n {
            let mut row = vec![0.0; oc];
            matmul_forward(&mut row, &inp[r * ic..][..ic], &w, Some(&b), 1, ic, oc);
            assert_eq!(bits(&row), bits(&out[r * oc..][..oc]), "{n}x{ic}x{oc}: row {r} differs");
            let (mut drow, mut dw1) = (vec![0.0; ic], vec![0.0; oc * ic]);
            let (dout_r, inp_r) = (&dout[r * oc..][..oc], &inp[r * ic..][..ic]);
            matmul_backward(
                Some(Dinp::Write(&mut drow)),
                Some(&mut dw1),
                None,
                dout_r,
                inp_r,
                &w,
                1,
                ic,
                oc,
            );
            assert_eq!(bits(&drow), bits(&dinp[r * ic..][..ic]), "{n}x{ic}x{oc}: dinp row {r}");
        }
    }
}

#[test]
fn matmul_backward_matches_fd() {
    let mut rng = Rng::new(9);
    let (n, ic, oc) = (14, 12, 10);
    let inp = rng.vec(n * ic, 1.0);
    let w = rng.vec(oc * ic, 0.5);
    let b = rng.vec(oc, 1.0);
    let r = rng.vec(n * oc, 1.0);
    let mut dinp = vec![f32::NAN; n * ic]; // overwritten, so garbage must not leak through
    let pre_dw = rng.vec(oc * ic, 1.0);
    let pre_db = rng.vec(oc, 1.0);
    let (mut dw, mut db) = (pre_dw.clone(), pre_db.clone());
    matmul_backward(
        Some(Dinp::Write(&mut dinp)),
        Some(&mut dw),
        Some(&mut db),
        &r,
        &inp,
        &w,
        n,
        ic,
        oc,
    );

    let (inp64, w64, b64) = (to64(&inp), to64(&w), to64(&b));
    let loss = |x: &[f64], w: &[f64], b: &[f64]| proj(&matmul_ref(x, w, Some(b), n, ic, oc), &r);
    let fd_x = fd_grad(&inp64, FD_EPS, |x| loss(x, &w64, &b64));
    let fd_w = fd_grad(&w64, FD_EPS, |w| loss(&inp64, w, &b64));
    let fd_b = fd_grad(&b64, FD_EPS, |b| loss(&inp64, &w64, b));
    let plus = |g: &[f64], p: &[f32]| -> Vec<f64> {
        g.iter().zip(p).map(|(g, &p)| g + f64::from(p)).collect()
    };
    assert_close("matmul dinp", &dinp, &fd_x, GRAD_TOL);
    assert_close("matmul dweight", &dw, &plus(&fd_w, &pre_dw), GRAD_TOL);
    assert_close("matmul dbias", &db, &plus(&fd_b, &pre_db), GRAD_TOL);
}

#[test]
fn matmul_backward_matches_reference_across_tiles() {
    // Shapes crossing ROW_TILE (32), DW_ROWS (16) and DW_COLS (64); checked against the exact
    // f64 formulas (the formulas themselves are checked by finite differences above).
    let mut rng = Rng::new(10);
    for (n, ic, oc) in [(37, 70, 45), (67, 130, 17)] {
        let inp = rng.vec(n * ic, 1.0);
        let w = rng.vec(oc * ic, 0.2);
        let dout = rng.vec(n * oc, 1.0);
        let mut dinp = vec![f32::NAN; n * ic];
        let (mut dw, mut db) = (vec![0.0; oc * ic], vec![0.0; oc]);
        matmul_backward(
            Some(Dinp::Write(&mut dinp)),
            Some(&mut dw),
            Some(&mut db),
            &dout,
            &inp,
            &w,
            n,
            ic,
            oc,
        );
        let (rx, rw, rb) = matmul_backward_ref(&to64(&dout), &to64(&inp), &to64(&w), n, ic, oc);
        assert_close(&format!("matmul dinp N={n}"), &dinp, &rx, FWD_TOL);
        assert_close(&format!("matmul dweight N={n}"), &dw, &rw, FWD_TOL);
        assert_close(&format!("matmul dbias N={n}"), &db, &rb, FWD_TOL);
    }
}

#[test]
fn matmul_backward_twice_doubles_exactly() {
    let mut rng = Rng::new(11);
    let (n, ic, oc) = (37, 70, 45);
    let inp = rng.vec(n * ic, 1.0);
    let w = rng.vec(oc * ic, 0.2);
    let dout = rng.vec(n * oc, 1.0);
    let (mut dw1, mut db1) = (vec![0.0; oc * ic], vec![0.0; oc]);
    matmul_backward(None, Some(&mut dw1), Some(&mut db1), &dout, &inp, &w, n, ic, oc);
    let (mut dw2, mut db2) = (vec![0.0; oc * ic], vec![0.0; oc]);
    for _ in 0..2 {
        matmul_backward(None, Some(&mut dw2), Some(&mut db2), &dout, &inp, &w, n, ic, oc);
    }
    let double = |x: &[f32]| -> Vec<f32> { x.iter().map(|g| 2.0 * g).collect() };
    assert_eq!(bits(&dw2), bits(&double(&dw1)), "matmul dweight did not double exactly");
    assert_eq!(bits(&db2), bits(&double(&db1)), "matmul dbias did not double exactly");
    // Without dbias, dweight is the same.
    let mut dw3 = vec![0.0; oc * ic];
    matmul_backward(None, Some(&mut dw3), None, &dout, &inp, &w, n, ic, oc);
    assert_eq!(bits(&dw3), bits(&dw1), "dweight depends on whether dbias is requested");
}

#[test]
fn matmul_backward_add_is_write_plus_the_old_dinp() {
    // Dinp::Add forms the whole product first and adds it once (the gemm's accumulate mode):
    // exactly old + the product added into zeros, and old + Dinp::Write's values where those
    // are one k block (OC <= 256; Write sums longer k in blocks of 256, so there it is close).
    let mut rng = Rng::new(30);
    for (n, ic, oc) in [(37, 70, 45), (7, 600, 300), (1, 21, 64), (6, 17, 256)] {
        let what = format!("{n}x{ic}x{oc}");
        let (inp, w, dout) = (rng.vec(n * ic, 1.0), rng.vec(oc * ic, 0.2), rng.vec(n * oc, 1.0));
        let old = rng.vec(n * ic, 1.0);
        let mut written = vec![f32::NAN; n * ic];
        let dinp = Some(Dinp::Write(&mut written[..]));
        matmul_backward(dinp, None, None, &dout, &inp, &w, n, ic, oc);
        let mut from_zero = vec![0.0; n * ic];
        let dinp = Some(Dinp::Add(&mut from_zero[..]));
        matmul_backward(dinp, None, None, &dout, &inp, &w, n, ic, oc);
        let mut added = old.clone();
        matmul_backward(Some(Dinp::Add(&mut added[..])), None, None, &dout, &inp, &w, n, ic, oc);
        let plus = |p: &[f32]| -> Vec<f32> { old.iter().zip(p).map(|(o, p)| o + p).collect() };
        assert_eq!(bits(&added), bits(&plus(&from_zero)), "{what}: Dinp::Add != old + product");
        if oc <= 256 {
            assert_eq!(bits(&added), bits(&plus(&written)), "{what}: Dinp::Add != old + Write");
        }
        assert_close(&format!("matmul Dinp::Add {what}"), &added, &plus(&written), FWD_TOL);
        let rx = matmul_backward_ref(&to64(&dout), &to64(&inp), &to64(&w), n, ic, oc).0;
        assert_close(&format!("matmul Dinp::Write {what}"), &written, &rx, FWD_TOL);
    }
}

#[test]
fn matmul_backward_without_dweight_writes_no_weight_gradient() {
    // A frozen weight: no dW product, and dinp and dbias exactly as with a dweight.
    let mut rng = Rng::new(31);
    let (n, ic, oc) = (19, 33, 41);
    let (inp, w, dout) = (rng.vec(n * ic, 1.0), rng.vec(oc * ic, 0.2), rng.vec(n * oc, 1.0));
    let (mut dx1, mut db1) = (vec![0.0; n * ic], vec![0.0; oc]);
    let dinp = Some(Dinp::Write(&mut dx1[..]));
    matmul_backward(dinp, None, Some(&mut db1), &dout, &inp, &w, n, ic, oc);
    let (mut dx2, mut dw2, mut db2) = (vec![0.0; n * ic], vec![0.0; oc * ic], vec![0.0; oc]);
    let dinp = Some(Dinp::Write(&mut dx2[..]));
    matmul_backward(dinp, Some(&mut dw2), Some(&mut db2), &dout, &inp, &w, n, ic, oc);
    assert_eq!(bits(&dx1), bits(&dx2), "dinp depends on whether dweight is requested");
    assert_eq!(bits(&db1), bits(&db2), "dbias depends on whether dweight is requested");
}

#[test]
fn rmsnorm_backwards_without_dweight_give_the_same_dinp() {
    let mut rng = Rng::new(32);
    let (n, c) = (9, 70);
    let norm = NormDims::new(c, RMS_EPS);
    let (inp, w, dout) = (rng.vec(n * c, 2.0), rng.vec(c, 1.5), rng.vec(n * c, 1.0));
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut out, &mut rstd, &inp, &w, norm);
    let dx0 = rng.vec(n * c, 1.0);
    let (mut dx1, mut dx2, mut dw) = (dx0.clone(), dx0.clone(), vec![0.0; c]);
    rmsnorm_backward(&mut dx1, None, &dout, &inp, &w, &rstd, norm);
    rmsnorm_backward(&mut dx2, Some(&mut dw), &dout, &inp, &w, &rstd, norm);
    assert_eq!(bits(&dx1), bits(&dx2), "rmsnorm dinp depends on dweight");

    let dims = AttnDims::new(2, 3, 4, 2, 8);
    let (width, heads) = (dims.qkv_width(), dims.h + dims.kvh);
    let hnorm = NormDims::new(dims.d, RMS_EPS);
    let (x, hw, dy) =
        (rng.vec(dims.n() * width, 2.0), rng.vec(2 * dims.d, 1.0), rng.vec(dims.n() * width, 1.0));
    let (mut hout, mut hrstd) = (vec![0.0; x.len()], vec![0.0; dims.n() * heads]);
    head_rmsnorm_forward(&mut hout, &mut hrstd, &x, &hw, dims, hnorm);
    let (mut hx1, mut hx2, mut hdw) =
        (vec![f32::NAN; x.len()], vec![0.0; x.len()], vec![0.0; 2 * dims.d]);
    head_rmsnorm_backward(&mut hx1, None, &dy, &x, &hw, &hrstd, dims, hnorm);
    head_rmsnorm_backward(&mut hx2, Some(&mut hdw), &dy, &x, &hw, &hrstd, dims, hnorm);
    assert_eq!(bits(&hx1), bits(&hx2), "head_rmsnorm dinp depends on dweight");
}

// ---- column slices --------------------------------------------------------------------------

#[test]
fn add_cols_and_scaled_cols_match_f64_and_touch_only_their_columns() {
    let mut rng = Rng::new(33);
    for (n, wide, col, w, scale) in
        [(5, 13, 4, 6, 0.37), (1, 8, 0, 8, -2.0), (17, 100, 99, 1, 1.0), (3, 9, 2, 0, 5.0)]
    {
        let what = |t: &str| format!("{t} N={n} wide={wide} col={col} w={w}");
        let (out0, src) = (rng.vec(n * wide, 1.0), rng.vec(n * w, 1.0));
        let mut out = out0.clone();
        add_cols(&mut out, &src, n, wide, col, w, scale);
        let want: Vec<f64> = (0..n * wide)
            .map(|i| {
                let (r, j) = (i / wide, i % wide);
                let add = if (col..col + w).contains(&j) {
                    f64::from(scale) * f64::from(src[r * w + j - col])
                } else {
                    0.0
                };
                f64::from(out0[i]) + add
            })
            .collect();
        assert_close(&what("add_cols"), &out, &want, FWD_TOL);
        for (i, (o, o0)) in out.iter().zip(&out0).enumerate() {
            if !(col..col + w).contains(&(i % wide)) {
                assert_eq!(o.to_bits(), o0.to_bits(), "{}: element {i} moved", what("add_cols"));
            }
        }

        let wsrc = rng.vec(n * wide, 1.0);
        let mut sliced = vec![f32::NAN; n * w];
        scaled_cols(&mut sliced, &wsrc, n, wide, col, w, scale);
        let want: Vec<f64> = (0..n * w)
            .map(|i| f64::from(scale) * f64::from(wsrc[(i / w) * wide + col + i % w]))
            .collect();
        assert_close(&what("scaled_cols"), &sliced, &want, FWD_TOL);
    }
}

#[test]
fn scaled_cols_is_the_transpose_of_add_cols() {
    // <add_cols(0, s), g> = scale <s, g[:, col..col+w]> = <s, scaled_cols(g)>: the gradient of
    // add_cols w.r.t. src is scaled_cols of dout with the same scale.
    let mut rng = Rng::new(34);
    let (n, wide, col, w, scale) = (7, 30, 11, 9, 0.25);
    let (s, g) = (rng.vec(n * w, 1.0), rng.vec(n * wide, 1.0));
    let mut a = vec![0.0; n * wide];
    add_cols(&mut a, &s, n, wide, col, w, scale);
    let mut t = vec![0.0; n * w];
    scaled_cols(&mut t, &g, n, wide, col, w, scale);
    let lhs = dot64(&to64(&a), &to64(&g));
    let rhs = dot64(&to64(&s), &to64(&t));
    assert!((lhs - rhs).abs() <= 1e-5 * lhs.abs().max(1.0), "{lhs} vs {rhs}");
}

// ---- rope ---------------------------------------------------------------------------------

#[test]
fn rope_forward_matches_reference() {
    let mut rng = Rng::new(12);
    for dims in attn_dims() {
        let qkv = rng.vec(dims.n() * dims.qkv_width(), 1.0);
        let (cos, sin) = rope_tables(dims.t, dims.d, 10000.0);
        let mut got = qkv.clone();
        rope_forward(&mut got, &cos, &sin, dims);
        let want = rope_ref(&to64(&qkv), &to64(&cos), &to64(&sin), dims);
        assert_close(&format!("rope {dims:?}"), &got, &want, FWD_TOL);
        // v is untouched, bit for bit.
        let width = dims.qkv_width();
        let v0 = (dims.h + dims.kvh) * dims.d;
        for r in 0..dims.n() {
            let (g, q) =
                (&got[r * width + v0..][..width - v0], &qkv[r * width + v0..][..width - v0]);
            assert_eq!(bits(g), bits(q), "rope changed v of row {r}");
        }
    }
}

#[test]
fn rope_backward_matches_fd() {
    let mut rng = Rng::new(13);
    for dims in attn_dims() {
        let qkv = rng.vec(dims.n() * dims.qkv_width(), 1.0);
        // Tables with large angles, so every pair really rotates.
        let (cos, sin) = rope_tables(dims.t, dims.d, 3.0);
        let r = rng.vec(qkv.len(), 1.0);
        let mut dqkv = r.clone();
        rope_backward(&mut dqkv, &cos, &sin, dims);
        let (c64, s64) = (to64(&cos), to64(&sin));
        let fd = fd_grad(&to64(&qkv), FD_EPS, |x| proj(&rope_ref(x, &c64, &s64, dims), &r));
        assert_close(&format!("rope dqkv {dims:?}"), &dqkv, &fd, GRAD_TOL);
    }
}

// ---- attention ----------------------------------------------------------------------------

fn attention_case(rng: &mut Rng, dims: AttnDims) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let qkv = rng.vec(dims.n() * dims.qkv_width(), 1.5);
    let mut out = vec![f32::NAN; dims.n() * dims.h * dims.d];
    let mut lse = vec![f32::NAN; dims.b * dims.h * dims.t];
    attention_forward(&mut out, &mut lse, &qkv, dims);
    (qkv, out, lse)
}

#[test]
fn attention_forward_matches_reference() {
    let mut rng = Rng::new(14);
    for dims in attn_dims() {
        let (qkv, out, lse) = attention_case(&mut rng, dims);
        let (want_out, want_lse) = attention_ref(&to64(&qkv), dims);
        assert_close(&format!("attention out {dims:?}"), &out, &want_out, FWD_TOL);
        assert_close(&format!("attention lse {dims:?}"), &lse, &want_lse, FWD_TOL);
    }
}

#[test]
fn attention_backward_matches_fd() {
    let mut rng = Rng::new(15);
    for dims in attn_dims() {
        let (qkv, out, lse) = attention_case(&mut rng, dims);
        let r = rng.vec(out.len(), 1.0);
        let mut dqkv = vec![f32::NAN; qkv.len()]; // overwritten
        attention_backward(&mut dqkv, &r, &qkv, &out, &lse, dims);
        let fd = fd_grad(&to64(&qkv), FD_EPS, |x| proj(&attention_ref(x, dims).0, &r));
        assert_close(&format!("attention dqkv {dims:?}"), &dqkv, &fd, GRAD_TOL);
    }
}

#[test]
fn attention_is_causal() {
    let mut rng = Rng::new(16);
    let dims = attn_dims()[0];
    let (t, width, hd) = (dims.t, dims.qkv_width(), dims.h * dims.d);
    let (qkv, out, lse) = attention_case(&mut rng, dims);
    let t0 = 4;
    // Change every q, k, v value of position t0 of batch 0.
    let mut qkv2 = qkv.clone();
    for x in &mut qkv2[t0 * width..][..width] {
        *x += 0.5;
    }
    let mut out2 = vec![0.0; out.len()];
    let mut lse2 = vec![0.0; lse.len()];
    attention_forward(&mut out2, &mut lse2, &qkv2, dims);
    // Earlier positions of batch 0 and all of batch 1 are bit-identical; t0 itself changes.
    assert_eq!(bits(&out2[..t0 * hd]), bits(&out[..t0 * hd]), "earlier outputs changed");
    assert_eq!(bits(&out2[t * hd..]), bits(&out[t * hd..]), "other batch changed");
    assert_ne!(bits(&out2[t0 * hd..][..hd]), bits(&out[t0 * hd..][..hd]));
    for h in 0..dims.h {
        let row = &lse[h * t..][..t0];
        assert_eq!(bits(&lse2[h * t..][..t0]), bits(row), "earlier lse of head {h} changed");
    }
}

#[test]
fn attention_gqa_equals_mha_with_repeated_kv() {
    // GQA with H=4 over KVH=2 must equal plain MHA (KVH=4) after repeating each kv head for its
    // group (heads 0,1 read kv 0; heads 2,3 read kv 1), for out and for dq.
    let mut rng = Rng::new(17);
    let g = AttnDims::new(2, 6, 4, 2, 4);
    let m = AttnDims { kvh: 4, ..g };
    let (qkv, out, lse) = attention_case(&mut rng, g);
    let d = g.d;
    let mut qkv_m = Vec::new();
    for row in qkv.chunks(g.qkv_width()) {
        qkv_m.extend_from_slice(&row[..g.h * d]);
        for part in [g.h, g.h + g.kvh] {
            for h in 0..g.h {
                qkv_m.extend_from_slice(&row[(part + h / 2) * d..][..d]);
            }
        }
    }
    let mut out_m = vec![0.0; out.len()];
    let mut lse_m = vec![0.0; lse.len()];
    attention_forward(&mut out_m, &mut lse_m, &qkv_m, m);
    assert_eq!(bits(&out_m), bits(&out), "GQA out differs from MHA with repeated kv");
    assert_eq!(bits(&lse_m), bits(&lse), "GQA lse differs from MHA with repeated kv");

    let dout = rng.vec(out.len(), 1.0);
    let mut dg = vec![0.0; qkv.len()];
    attention_backward(&mut dg, &dout, &qkv, &out, &lse, g);
    let mut dm = vec![0.0; qkv_m.len()];
    attention_backward(&mut dm, &dout, &qkv_m, &out_m, &lse_m, m);
    for (r, (rg, rm)) in dg.chunks(g.qkv_width()).zip(dm.chunks(m.qkv_width())).enumerate() {
        assert_eq!(bits(&rg[..g.h * d]), bits(&rm[..g.h * d]), "dq of row {r} differs");
        // dk of a GQA kv head is the sum over its group of the MHA heads' dk.
        for part in 0..2 {
            for kv in 0..g.kvh {
                let got = &rg[(g.h + part * g.kvh + kv) * d..][..d];
                let a = &rm[(m.h + part * m.kvh + 2 * kv) * d..][..d];
                let b = &rm[(m.h + part * m.kvh + 2 * kv + 1) * d..][..d];
                let want: Vec<f32> = a.iter().zip(b).map(|(x, y)| x + y).collect();
                assert_close(&format!("GQA dk/dv row {r} kv {kv}"), got, &want, FWD_TOL);
            }
        }
    }
}

#[test]
fn attention_writes_stay_inside_their_buffers() {
    // The attention kernels write through raw views; guard bytes around each buffer catch any
    // write outside it.
    const GUARD: usize = 17;
    const SENTINEL: f32 = -12345.0;
    let mut rng = Rng::new(18);
    let dims = attn_dims()[1];
    let qkv = rng.vec(dims.n() * dims.qkv_width(), 1.0);
    let guarded = |len: usize| vec![SENTINEL; len + 2 * GUARD];
    let (olen, llen) = (dims.n() * dims.h * dims.d, dims.b * dims.h * dims.t);
    let (mut out, mut lse, mut dqkv) = (guarded(olen), guarded(llen), guarded(qkv.len()));
    let dout = rng.vec(olen, 1.0);
    attention_forward(&mut out[GUARD..GUARD + olen], &mut lse[GUARD..GUARD + llen], &qkv, dims);
    attention_backward(
        &mut dqkv[GUARD..GUARD + qkv.len()],
        &dout,
        &qkv,
        &out[GUARD..GUARD + olen],
        &lse[GUARD..GUARD + llen],
        dims,
    );
    for (name, buf) in [("out", &out), ("lse", &lse), ("dqkv", &dqkv)] {
        let len = buf.len() - 2 * GUARD;
        let guards = buf[..GUARD].iter().chain(&buf[GUARD + len..]);
        assert!(guards.into_iter().all(|&x| x == SENTINEL), "{name}: guard bytes overwritten");
        assert!(buf[GUARD..GUARD + len].iter().all(|&x| x != SENTINEL), "{name}: not all written");
    }
}

/// Windowed and rescaled attention shapes: W = 1 (each query sees itself), W = 3 on T = 7 (MQA
/// and GQA), W = 37 on T = 140 (the second and third query blocks start inside the window of
/// earlier keys, so their key range starts past 0), W = 64 = one query block on T = 130 with
/// GQA, and a non-default scale with and without a window.
fn window_dims() -> [AttnDims; 7] {
    let w = |window: usize, d: AttnDims| AttnDims { window, ..d };
    [
        w(1, AttnDims::new(2, 7, 3, 1, 4)),
        w(3, AttnDims::new(2, 7, 3, 1, 4)),
        w(3, AttnDims::new(2, 7, 4, 2, 4)),
        w(37, AttnDims::new(1, 140, 2, 1, 4)),
        w(64, AttnDims::new(1, 130, 4, 2, 4)),
        AttnDims { scale: 0.3, ..AttnDims::new(2, 7, 4, 2, 4) },
        AttnDims { scale: 0.3, window: 5, ..AttnDims::new(1, 70, 2, 1, 6) },
    ]
}

#[test]
fn attention_window_and_scale_forward_match_reference() {
    let mut rng = Rng::new(30);
    for dims in window_dims() {
        let (qkv, out, lse) = attention_case(&mut rng, dims);
        let (want_out, want_lse) = attention_ref(&to64(&qkv), dims);
        assert_close(&format!("attention out {dims:?}"), &out, &want_out, FWD_TOL);
        assert_close(&format!("attention lse {dims:?}"), &lse, &want_lse, FWD_TOL);
    }
}

#[test]
fn attention_decode_equals_the_rows_of_the_full_forward() {
    // A KV cache's step: the last T_new query rows over every cached key. Without a window the
    // rows have the full forward's bits (the same products, keys from 0; T = 300 spans two k
    // blocks of the GEMM); within one, the same sums grouped from the row's own window start.
    let mut rng = Rng::new(32);
    let dims = attn_dims().into_iter().chain(window_dims()).chain([AttnDims::new(1, 300, 2, 1, 8)]);
    for dims in dims {
        let (qkv, out, _) = attention_case(&mut rng, dims);
        let hd = dims.h * dims.d;
        for t_new in [1, 3.min(dims.t), dims.t] {
            let mut got = vec![f32::NAN; dims.b * t_new * hd];
            attention_decode(&mut got, &qkv, None, t_new, dims);
            let want: Vec<f32> = (0..dims.b)
                .flat_map(|bi| &out[(bi * dims.t + dims.t - t_new) * hd..(bi + 1) * dims.t * hd])
                .copied()
                .collect();
            let name = format!("attention_decode T_new {t_new} {dims:?}");
            if dims.window == 0 || dims.window >= dims.t {
                assert_eq!(bits(&got), bits(&want), "{name}");
            } else {
                assert_close(&name, &got, &want, 1e-6);
            }
        }
    }
}

#[test]
fn attention_window_and_scale_backward_match_fd() {
    let mut rng = Rng::new(31);
    for dims in window_dims() {
        let (qkv, out, lse) = attention_case(&mut rng, dims);
        let r = rng.vec(out.len(), 1.0);
        let mut dqkv = vec![f32::NAN; qkv.len()]; // overwritten
        attention_backward(&mut dqkv, &r, &qkv, &out, &lse, dims);
        let fd = fd_grad(&to64(&qkv), FD_EPS, |x| proj(&attention_ref(x, dims).0, &r));
        assert_close(&format!("attention dqkv {dims:?}"), &dqkv, &fd, GRAD_TOL);
    }
}

#[test]
fn attention_window_1_returns_own_value_exactly() {
    // With W = 1 every softmax has one term: probability exactly 1, out_i = v_i bit for bit,
    // lse_i = scale q_i.k_i.
    let mut rng = Rng::new(32);
    let dims = AttnDims { window: 1, ..AttnDims::new(2, 70, 4, 2, 4) };
    let (qkv, out, _) = attention_case(&mut rng, dims);
    let (width, d, group) = (dims.qkv_width(), dims.d, dims.h / dims.kvh);
    for r in 0..dims.n() {
        for hi in 0..dims.h {
            let v = &qkv[r * width + (dims.h + dims.kvh + hi / group) * d..][..d];
            let o = &out[r * dims.h * d + hi * d..][..d];
            assert_eq!(bits(o), bits(v), "W = 1: out of row {r} head {hi} is not its v");
        }
    }
}

#[test]
fn attention_window_at_least_t_equals_full_causal_bit_for_bit() {
    let mut rng = Rng::new(33);
    for full in [AttnDims::new(2, 7, 4, 2, 4), AttnDims::new(1, 140, 2, 1, 4)] {
        let qkv = rng.vec(full.n() * full.qkv_width(), 1.5);
        let dout = rng.vec(full.n() * full.h * full.d, 1.0);
        let run = |dims: AttnDims| {
            let mut out = vec![f32::NAN; dout.len()];
            let mut lse = vec![f32::NAN; dims.b * dims.h * dims.t];
            attention_forward(&mut out, &mut lse, &qkv, dims);
            let mut dqkv = vec![f32::NAN; qkv.len()];
            attention_backward(&mut dqkv, &dout, &qkv, &out, &lse, dims);
            [bits(&out), bits(&lse), bits(&dqkv)]
        };
        let want = run(full);
        for window in [full.t, full.t + 1, 1000] {
            let got = run(AttnDims { window, ..full });
            assert!(got == want, "W = {window} differs from W = 0 for {full:?}");
        }
    }
}

#[test]
fn attention_window_ignores_keys_outside_it() {
    // Changing position j's q, k, v must leave every query outside j..j + W bit-identical, in
    // the forward and in the backward (its dq, and the dk, dv of the other positions).
    let mut rng = Rng::new(34);
    let dims = AttnDims { window: 37, ..AttnDims::new(1, 140, 2, 1, 4) };
    let (width, hd, w) = (dims.qkv_width(), dims.h * dims.d, dims.window);
    let (qkv, out, lse) = attention_case(&mut rng, dims);
    let j = 50;
    let mut qkv2 = qkv.clone();
    for x in &mut qkv2[j * width..][..width] {
        *x += 0.5;
    }
    let mut out2 = vec![0.0; out.len()];
    let mut lse2 = vec![0.0; lse.len()];
    attention_forward(&mut out2, &mut lse2, &qkv2, dims);
    assert_eq!(bits(&out2[..j * hd]), bits(&out[..j * hd]), "earlier outputs changed");
    let after = (j + w) * hd;
    assert_eq!(bits(&out2[after..]), bits(&out[after..]), "outputs past the window changed");
    assert_ne!(bits(&out2[(j + w - 1) * hd..][..hd]), bits(&out[(j + w - 1) * hd..][..hd]));

    // Backward with dout zero inside the window of j: nothing may depend on row j at all.
    let mut dout = rng.vec(out.len(), 1.0);
    dout[j * hd..(j + w) * hd].fill(0.0);
    let mut dq1 = vec![0.0; qkv.len()];
    attention_backward(&mut dq1, &dout, &qkv, &out, &lse, dims);
    let mut dq2 = vec![0.0; qkv.len()];
    attention_backward(&mut dq2, &dout, &qkv2, &out2, &lse2, dims);
    assert!(dq1[j * width..][..width].iter().all(|&g| g == 0.0), "row j has a gradient");
    assert_eq!(bits(&dq2), bits(&dq1), "gradients depend on a row no live query sees");
}

// ---- attention sinks (gpt-oss) ------------------------------------------------------------

/// Sink shapes: GQA with B > 1, MQA within a window, a scale other than `1/sqrt(D)` with and
/// without a window, T over two query blocks, T = 1.
fn sink_dims() -> [AttnDims; 6] {
    [
        AttnDims::new(2, 7, 4, 2, 4),
        AttnDims { window: 3, ..AttnDims::new(2, 7, 3, 1, 4) },
        AttnDims { scale: 0.3, ..AttnDims::new(2, 6, 4, 2, 6) },
        AttnDims { scale: 0.7, window: 5, ..AttnDims::new(3, 9, 4, 1, 4) },
        AttnDims { window: 37, ..AttnDims::new(1, 140, 2, 1, 4) },
        AttnDims::new(3, 1, 2, 1, 2),
    ]
}

/// One sink logit per head: random in [-3, 3), then a dominant one (8: most of each row's mass)
/// and a negligible one (-30: the plain softmax within f32).
fn sinks_for(rng: &mut Rng, h: usize) -> Vec<f32> {
    let mut s = rng.vec(h, 3.0);
    s[0] = 8.0;
    if h > 2 {
        s[2] = -30.0;
    }
    s
}

/// `attention_forward` then `attention_sink_forward`: the sink attention's `(out, lse)`.
fn sink_forward(qkv: &[f32], sinks: &[f32], dims: AttnDims) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![f32::NAN; dims.n() * dims.h * dims.d];
    let mut lse = vec![f32::NAN; dims.b * dims.h * dims.t];
    attention_forward(&mut out, &mut lse, qkv, dims);
    attention_sink_forward(&mut out, &mut lse, sinks, dims);
    (out, lse)
}

#[test]
fn attention_sink_forward_matches_the_explicit_extra_column() {
    let mut rng = Rng::new(35);
    for dims in sink_dims() {
        let qkv = rng.vec(dims.n() * dims.qkv_width(), 1.5);
        let sinks = sinks_for(&mut rng, dims.h);
        let (out, lse) = sink_forward(&qkv, &sinks, dims);
        let (want_out, want_lse) = attention_sink_ref(&to64(&qkv), Some(&to64(&sinks)), dims);
        assert_close(&format!("sink attention out {dims:?}"), &out, &want_out, FWD_TOL);
        assert_close(&format!("sink attention lse {dims:?}"), &lse, &want_lse, FWD_TOL);
    }
}

#[test]
fn attention_sink_backward_chain_matches_fd() {
    // attention_backward on the sink-adjusted out and lse gives dqkv; attention_sink_backward
    // adds dsinks (prefilled: it accumulates). Both against central differences of
    // L = sum(out * r) of the explicit reference.
    let mut rng = Rng::new(36);
    for dims in sink_dims() {
        let qkv = rng.vec(dims.n() * dims.qkv_width(), 1.5);
        let sinks = sinks_for(&mut rng, dims.h);
        let (out, lse) = sink_forward(&qkv, &sinks, dims);
        let r = rng.vec(out.len(), 1.0);
        let mut dqkv = vec![f32::NAN; qkv.len()]; // overwritten
        attention_backward(&mut dqkv, &r, &qkv, &out, &lse, dims);
        let prefill = rng.vec(dims.h, 1.0);
        let mut dsinks = prefill.clone();
        attention_sink_backward(&mut dsinks, &r, &out, &lse, &sinks, dims);

        let (q64, s64) = (to64(&qkv), to64(&sinks));
        let fd_q = fd_grad(&q64, FD_EPS, |x| proj(&attention_sink_ref(x, Some(&s64), dims).0, &r));
        assert_close(&format!("sink attention dqkv {dims:?}"), &dqkv, &fd_q, GRAD_TOL);
        let fd_s = fd_grad(&s64, FD_EPS, |s| proj(&attention_sink_ref(&q64, Some(s), dims).0, &r));
        let want: Vec<f64> = fd_s.iter().zip(&prefill).map(|(g, &p)| g + f64::from(p)).collect();
        assert_close(&format!("sink attention dsinks {dims:?}"), &dsinks, &want, GRAD_TOL);
    }
}

#[test]
fn attention_sink_backward_twice_doubles_exactly() {
    let mut rng = Rng::new(37);
    let dims = sink_dims()[3];
    let qkv = rng.vec(dims.n() * dims.qkv_width(), 1.5);
    let sinks = sinks_for(&mut rng, dims.h);
    let (out, lse) = sink_forward(&qkv, &sinks, dims);
    let dout = rng.vec(out.len(), 1.0);
    let mut once = vec![0.0; dims.h];
    attention_sink_backward(&mut once, &dout, &out, &lse, &sinks, dims);
    let mut twice = vec![0.0; dims.h];
    attention_sink_backward(&mut twice, &dout, &out, &lse, &sinks, dims);
    attention_sink_backward(&mut twice, &dout, &out, &lse, &sinks, dims);
    let want: Vec<f32> = once.iter().map(|g| 2.0 * g).collect();
    assert_eq!(bits(&twice), bits(&want), "dsinks of two calls is not twice one call's");
}

#[test]
fn attention_decode_with_sinks_equals_the_rows_of_the_sink_forward() {
    // The sink is one more column of each decoded row's softmax: the rows of attention_forward
    // then attention_sink_forward, within f32 rounding (an exp of the sink against a rescale).
    let mut rng = Rng::new(38);
    for dims in sink_dims().into_iter().chain([AttnDims::new(1, 300, 2, 1, 8)]) {
        let qkv = rng.vec(dims.n() * dims.qkv_width(), 1.5);
        let sinks = sinks_for(&mut rng, dims.h);
        let (out, _) = sink_forward(&qkv, &sinks, dims);
        let hd = dims.h * dims.d;
        for t_new in [1, 3.min(dims.t), dims.t] {
            let mut got = vec![f32::NAN; dims.b * t_new * hd];
            attention_decode(&mut got, &qkv, Some(&sinks), t_new, dims);
            let want: Vec<f32> = (0..dims.b)
                .flat_map(|bi| &out[(bi * dims.t + dims.t - t_new) * hd..(bi + 1) * dims.t * hd])
                .copied()
                .collect();
            assert_close(&format!("decode with sinks T_new {t_new} {dims:?}"), &got, &want, 1e-6);
        }
    }
}

// ---- swiglu -------------------------------------------------------------------------------

#[test]
fn swiglu_forward_matches_reference() {
    let mut rng = Rng::new(19);
    let (n, f) = (14, 10);
    let gate_up = rng.vec(n * 2 * f, 4.0);
    let mut out = vec![f32::NAN; n * f];
    swiglu_forward(&mut out, &gate_up, n, f);
    assert_close("swiglu out", &out, &swiglu_ref(&to64(&gate_up), f), FWD_TOL);
}

#[test]
fn swiglu_backward_matches_fd() {
    let mut rng = Rng::new(20);
    let (n, f) = (14, 10);
    let gate_up = rng.vec(n * 2 * f, 4.0);
    let r = rng.vec(n * f, 1.0);
    let mut dgu = vec![f32::NAN; gate_up.len()]; // overwritten
    swiglu_backward(&mut dgu, &r, &gate_up, n, f);
    let fd = fd_grad(&to64(&gate_up), FD_EPS, |x| proj(&swiglu_ref(x, f), &r));
    assert_close("swiglu dgate_up", &dgu, &fd, GRAD_TOL);
}

#[test]
fn swiglu_saturates_without_nan() {
    let gate_up = [-200.0, 200.0, 3.0, 3.0];
    let mut out = [0.0; 2];
    swiglu_forward(&mut out, &gate_up, 1, 2);
    assert_eq!(out, [-0.0, 600.0]);
    let mut dgu = [0.0; 4];
    swiglu_backward(&mut dgu, &[1.0, 1.0], &gate_up, 1, 2);
    assert!(dgu.iter().all(|x| x.is_finite()), "{dgu:?}");
}

// ---- clamped swiglu (gpt-oss) ---------------------------------------------------------------

/// gpt-oss's clamped SwiGLU in f64: g = min(gate, limit), u = clamp(up, -limit, limit),
/// out = (u + 1) g sigmoid(alpha g).
fn clamped_swiglu_ref(gate_up: &[f64], f: usize, (alpha, limit): (f64, f64)) -> Vec<f64> {
    gate_up
        .chunks(2 * f)
        .flat_map(|row| {
            let (gate, up) = row.split_at(f);
            gate.iter().zip(up).map(move |(&g, &u)| {
                let (g, u) = (g.min(limit), u.clamp(-limit, limit));
                (u + 1.0) * g / (1.0 + (-alpha * g).exp())
            })
        })
        .collect()
}

/// Inputs out to +-4 against a limit of 1.5 (about a third of them clamped), none within 1e-3
/// of a bound (where the finite differences would straddle it).
fn clamped_inputs(rng: &mut Rng, len: usize) -> Vec<f32> {
    let mut v = rng.vec(len, 4.0);
    for x in &mut v {
        if (x.abs() - 1.5).abs() < 1e-3 {
            *x += 0.01;
        }
    }
    v
}

const CLAMP: horizon_backend::GluClamp = horizon_backend::GluClamp { alpha: 1.702, limit: 1.5 };

#[test]
fn clamped_swiglu_forward_matches_reference() {
    let mut rng = Rng::new(91);
    let (n, f) = (14, 10);
    let gate_up = clamped_inputs(&mut rng, n * 2 * f);
    assert!(gate_up.iter().filter(|x| x.abs() > 1.5).count() > n * f / 2, "the clamp is exercised");
    let mut out = vec![f32::NAN; n * f];
    clamped_swiglu_forward(&mut out, &gate_up, n, f, CLAMP);
    let want = clamped_swiglu_ref(&to64(&gate_up), f, (1.702f32 as f64, 1.5));
    assert_close("clamped swiglu out", &out, &want, FWD_TOL);
}

#[test]
fn clamped_swiglu_backward_matches_fd_and_passes_nothing_through_a_clamp() {
    let mut rng = Rng::new(92);
    let (n, f) = (14, 10);
    let gate_up = clamped_inputs(&mut rng, n * 2 * f);
    let r = rng.vec(n * f, 1.0);
    let mut dgu = vec![f32::NAN; gate_up.len()]; // overwritten
    clamped_swiglu_backward(&mut dgu, &r, &gate_up, (n, f), CLAMP);
    let c = (1.702f32 as f64, 1.5);
    let fd = fd_grad(&to64(&gate_up), FD_EPS, |x| proj(&clamped_swiglu_ref(x, f, c), &r));
    assert_close("clamped swiglu dgate_up", &dgu, &fd, GRAD_TOL);
    for (row, drow) in gate_up.chunks(2 * f).zip(dgu.chunks(2 * f)) {
        for j in 0..f {
            assert!(row[j] <= 1.5 || drow[j] == 0.0, "a clamped gate passed a gradient");
            assert!(row[f + j].abs() <= 1.5 || drow[f + j] == 0.0, "a clamped up passed one");
        }
    }
}

// ---- geglu --------------------------------------------------------------------------------

#[test]
fn geglu_forward_matches_reference() {
    let mut rng = Rng::new(60);
    let (n, f) = (14, 10);
    let gate_up = rng.vec(n * 2 * f, 4.0);
    let mut out = vec![f32::NAN; n * f];
    geglu_forward(&mut out, &gate_up, n, f);
    assert_close("geglu out", &out, &geglu_ref(&to64(&gate_up), f), FWD_TOL);
}

#[test]
fn geglu_backward_matches_fd() {
    let mut rng = Rng::new(61);
    let (n, f) = (14, 10);
    let gate_up = rng.vec(n * 2 * f, 4.0);
    let r = rng.vec(n * f, 1.0);
    let mut dgu = vec![f32::NAN; gate_up.len()]; // overwritten
    geglu_backward(&mut dgu, &r, &gate_up, n, f);
    let fd = fd_grad(&to64(&gate_up), FD_EPS, |x| proj(&geglu_ref(x, f), &r));
    assert_close("geglu dgate_up", &dgu, &fd, GRAD_TOL);
}

#[test]
fn geglu_saturates_without_nan() {
    // gelu_tanh(-g) -> -0 and gelu_tanh(g) -> g for large g; cubes up to 1e12 stay finite.
    let gate_up = [-200.0, 200.0, -1e4, 1e4, 3.0, 3.0, 3.0, 3.0];
    let mut out = [0.0; 4];
    geglu_forward(&mut out, &gate_up, 1, 4);
    assert_eq!(out, [-0.0, 600.0, -0.0, 3e4]);
    let mut dgu = [0.0; 8];
    geglu_backward(&mut dgu, &[1.0; 4], &gate_up, 1, 4);
    assert!(dgu.iter().all(|x| x.is_finite()), "{dgu:?}");
    assert_eq!(dgu, [0.0, 3.0, 0.0, 3.0, -0.0, 200.0, -0.0, 1e4]);
}

// ---- residual -----------------------------------------------------------------------------

#[test]
fn residual_and_add_inplace() {
    let mut rng = Rng::new(21);
    let len = 40_000; // more than one parallel chunk
    let (a, b) = (rng.vec(len, 1.0), rng.vec(len, 1.0));
    let mut out = vec![f32::NAN; len];
    residual_forward(&mut out, &a, &b);
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(bits(&out), bits(&want));
    let mut acc = a.clone();
    add_inplace(&mut acc, &b);
    assert_eq!(bits(&acc), bits(&want));
}

// ---- cross-entropy ------------------------------------------------------------------------

/// Rows with targets, two ignored rows, and logits with a large common offset in one row.
fn ce_case(rng: &mut Rng) -> (Vec<f32>, Vec<i32>, usize, usize) {
    let (n, v) = (14, 11);
    let mut logits = rng.vec(n * v, 3.0);
    for x in &mut logits[2 * v..3 * v] {
        *x += 500.0; // softmax is shift-invariant; a naive exp would overflow
    }
    let mut targets: Vec<i32> = (0..n).map(|_| rng.below(v) as i32).collect();
    targets[3] = -100;
    targets[9] = -100;
    (logits, targets, n, v)
}

#[test]
fn cross_entropy_forward_matches_reference() {
    let mut rng = Rng::new(22);
    let (logits, targets, n, v) = ce_case(&mut rng);
    let mut losses = vec![f32::NAN; n];
    cross_entropy_forward(&mut losses, &logits, &targets, n, v);
    assert_close("ce losses", &losses, &cross_entropy_ref(&to64(&logits), &targets, v), FWD_TOL);
    assert_eq!(losses[3], 0.0);
    assert_eq!(losses[9], 0.0);
}

#[test]
fn cross_entropy_fused_matches_forward_and_fd() {
    let mut rng = Rng::new(23);
    let (logits, targets, n, v) = ce_case(&mut rng);
    let counted = targets.iter().filter(|&&t| t != -100).count();
    let scale = 1.0 / counted as f32;
    let mut dlogits = logits.clone();
    let mut losses = vec![f32::NAN; n];
    cross_entropy_fused(&mut dlogits, &mut losses, &targets, n, v, scale);

    // Losses are those of the forward-only op, bit for bit.
    let mut losses_fwd = vec![0.0; n];
    cross_entropy_forward(&mut losses_fwd, &logits, &targets, n, v);
    assert_eq!(bits(&losses), bits(&losses_fwd));

    // dlogits = d(scale * sum of losses) / d logits.
    let fd = fd_grad(&to64(&logits), FD_EPS, |x| {
        f64::from(scale) * cross_entropy_ref(x, &targets, v).iter().sum::<f64>()
    });
    assert_close("ce dlogits", &dlogits, &fd, GRAD_TOL);

    for (r, row) in dlogits.chunks(v).enumerate() {
        if targets[r] == -100 {
            assert!(row.iter().all(|&g| g == 0.0), "ignored row {r} has gradient {row:?}");
        } else {
            let s: f64 = row.iter().map(|&g| f64::from(g)).sum();
            assert!(s.abs() <= 1e-6 * f64::from(scale), "row {r}: gradient sums to {s:e}");
        }
    }
}

#[test]
fn cross_entropy_extreme_logits_stay_finite() {
    let v = 4;
    let logits = vec![1e4, -1e4, 0.0, 30.0, /* row 2 */ -1e30, 1e30, 0.0, 0.0];
    let targets = [1, 0];
    let mut dl = logits.clone();
    let mut losses = [0.0; 2];
    cross_entropy_fused(&mut dl, &mut losses, &targets, 2, v, 1.0);
    assert_close("ce extreme losses", &losses, &[2e4f32, 2e30], 1e-6);
    assert!(dl.iter().all(|g| g.is_finite()), "{dl:?}");
    assert_close("ce extreme dlogits", &dl, &[1.0f32, -1.0, 0.0, 0.0, -1.0, 1.0, 0.0, 0.0], 1e-6);
}

#[test]
#[should_panic(expected = "neither in 0..11")]
fn cross_entropy_rejects_bad_target() {
    let mut losses = [0.0];
    cross_entropy_forward(&mut losses, &[0.0; 11], &[11], 1, 11);
}

// ---- cross-entropy over vocabulary tiles --------------------------------------------------

/// Runs the tiled cross-entropy over `(N, V)` logits cut into column tiles of `width` (the last
/// one ragged): pass 1 folds every tile into the stats (which start as NaN, so `first` must
/// overwrite them), the losses come from the stats, pass 2 turns each tile into its dlogits.
/// Returns `(losses, dlogits (N, V))`.
fn tiled_ce(
    logits: &[f32],
    targets: &[i32],
    n: usize,
    v: usize,
    width: usize,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let tile = |v0: usize, vt: usize| -> Vec<f32> {
        logits.chunks(v).flat_map(|row| row[v0..v0 + vt].to_vec()).collect()
    };
    let mut stats = vec![f32::NAN; n * 3];
    for v0 in (0..v).step_by(width) {
        let vt = width.min(v - v0);
        cross_entropy_tile_stats(&mut stats, &tile(v0, vt), targets, n, vt, v0, v0 == 0);
    }
    let mut losses = vec![f32::NAN; n];
    cross_entropy_tile_loss(&mut losses, &stats, targets, n);
    let mut dlogits = vec![f32::NAN; n * v];
    for v0 in (0..v).step_by(width) {
        let vt = width.min(v - v0);
        let mut x = tile(v0, vt);
        cross_entropy_tile_grad(&mut x, &stats, targets, n, vt, v0, scale);
        for (r, row) in x.chunks(vt).enumerate() {
            dlogits[r * v + v0..][..vt].copy_from_slice(row);
        }
    }
    (losses, dlogits)
}

/// `scale * (softmax(x) - onehot(target))` per row in f64, zero on ignored rows.
fn cross_entropy_grad_ref(logits: &[f64], targets: &[i32], v: usize, scale: f64) -> Vec<f64> {
    logits
        .chunks(v)
        .zip(targets)
        .flat_map(|(x, &k)| {
            if k == -100 {
                return vec![0.0; v];
            }
            let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = x.iter().map(|xi| (xi - m).exp()).sum();
            let mut g: Vec<f64> = x.iter().map(|xi| scale * (xi - m).exp() / s).collect();
            g[k as usize] -= scale;
            g
        })
        .collect()
}

#[test]
fn cross_entropy_tiles_match_reference_and_fused_for_every_width() {
    let mut rng = Rng::new(24);
    let (logits, mut targets, n, v) = ce_case(&mut rng);
    targets[0] = 0; // the first tile's first column
    targets[1] = (v - 1) as i32; // the last (ragged) tile's last column
    let scale = 1.0 / targets.iter().filter(|&&t| t != -100).count() as f32;
    let mut fused = logits.clone();
    let mut fused_losses = vec![0.0; n];
    cross_entropy_fused(&mut fused, &mut fused_losses, &targets, n, v, scale);
    let want_losses = cross_entropy_ref(&to64(&logits), &targets, v);
    let want_grad = cross_entropy_grad_ref(&to64(&logits), &targets, v, f64::from(scale));
    // 1: every id its own tile; 3, 4, 5: ragged last tiles (11 = 3+3+3+2 = 4+4+3 = 5+5+1);
    // 10: a last tile of one column; 11: one tile spanning V.
    for width in [1, 3, 4, 5, 10, 11] {
        let (losses, dlogits) = tiled_ce(&logits, &targets, n, v, width, scale);
        assert_close(&format!("tile {width} losses"), &losses, &want_losses, FWD_TOL);
        assert_close(&format!("tile {width} dlogits"), &dlogits, &want_grad, FWD_TOL);
        // The fused op within fp32 rounding (the tiles' sums are combined in another order).
        assert_close(&format!("tile {width} vs fused losses"), &losses, &fused_losses, 1e-6);
        assert_close(&format!("tile {width} vs fused dlogits"), &dlogits, &fused, 1e-6);
        for r in [3, 9] {
            assert_eq!(losses[r], 0.0, "ignored row {r}");
            assert!(dlogits[r * v..][..v].iter().all(|&g| g == 0.0), "ignored row {r}");
        }
    }
}

#[test]
fn cross_entropy_tiles_compose_over_a_wide_vocabulary() {
    let mut rng = Rng::new(25);
    let (n, v) = (6, 1000);
    let logits = rng.vec(n * v, 8.0);
    let targets: Vec<i32> = vec![0, 36, 37, 999, -100, 555];
    let scale = 0.2;
    let want_losses = cross_entropy_ref(&to64(&logits), &targets, v);
    let want_grad = cross_entropy_grad_ref(&to64(&logits), &targets, v, f64::from(scale));
    for width in [37, 256, 999, 1000] {
        let (losses, dlogits) = tiled_ce(&logits, &targets, n, v, width, scale);
        assert_close(&format!("tile {width} losses"), &losses, &want_losses, FWD_TOL);
        assert_close(&format!("tile {width} dlogits"), &dlogits, &want_grad, FWD_TOL);
    }
}

#[test]
fn cross_entropy_tiles_survive_extreme_logits() {
    // Maxima in different tiles, a tile whose logits are all far below the row's max, and a
    // first tile with a huge max followed by a larger one.
    let v = 4;
    let logits = vec![
        1e4, -1e4, 0.0, 30.0, /* row 2 */ -1e30, 1e30, 0.0, 0.0, /* row 3 */ 88.0, 89.0,
        -1e30, 1e30,
    ];
    let targets = [1, 0, 3];
    for width in [1, 2, 3] {
        let (losses, dl) = tiled_ce(&logits, &targets, 3, v, width, 1.0);
        assert_close(&format!("tile {width} extreme losses"), &losses, &[2e4f32, 2e30, 0.0], 1e-6);
        assert!(dl.iter().all(|g| g.is_finite()), "tile {width}: {dl:?}");
        let want = [1.0f32, -1.0, 0.0, 0.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_close(&format!("tile {width} extreme dlogits"), &dl, &want, 1e-6);
    }
}

#[test]
fn cross_entropy_tile_stats_fold_exactly_as_stated() {
    // One row, two tiles: (m, s, t) after the first is the tile's own; after the second the
    // running sum is rescaled to the new max, and t is the target's logit from its tile.
    let mut stats = [f32::NAN; 3];
    cross_entropy_tile_stats(&mut stats, &[0.0, 1.0], &[2], 1, 2, 0, true);
    assert_eq!(stats[0], 1.0);
    assert_close("s after tile 0", &stats[1..2], &[1.0 + (-1.0f64).exp()], 1e-7);
    assert_eq!(stats[2], 0.0, "the target is not in tile 0");
    cross_entropy_tile_stats(&mut stats, &[3.0, -2.0], &[2], 1, 2, 2, false);
    assert_eq!(stats[0], 3.0);
    let want_s = (1.0 + (-1.0f64).exp()) * (-2.0f64).exp() + 1.0 + (-5.0f64).exp();
    assert_close("s after tile 1", &stats[1..2], &[want_s], 1e-7);
    assert_eq!(stats[2], 3.0);
}

// ---- mixture of experts -------------------------------------------------------------------

/// Routing shapes: top-1, top-2 with and without renormalisation, k = E (every expert), and
/// E = 16 (more experts than a row of the other cases).
const MOE_DIMS: [MoeDims; 5] = [
    MoeDims { n: 7, e: 4, k: 1, norm: false },
    MoeDims { n: 5, e: 8, k: 2, norm: true },
    MoeDims { n: 6, e: 8, k: 2, norm: false },
    MoeDims { n: 3, e: 5, k: 5, norm: true },
    MoeDims { n: 4, e: 16, k: 4, norm: true },
];

/// Reference softmax of each row of E, in f64.
fn softmax_ref(logits: &[f64], e: usize) -> Vec<f64> {
    let mut probs = Vec::with_capacity(logits.len());
    for row in logits.chunks(e) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
        let exps: Vec<f64> = row.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        probs.extend(exps.iter().map(|x| x / sum));
    }
    probs
}

/// Reference top-k of each row: experts by decreasing probability, equal ones by increasing
/// index (a stable sort).
fn topk_ref(probs: &[f64], e: usize, k: usize) -> Vec<usize> {
    let mut sel = Vec::new();
    for row in probs.chunks(e) {
        let mut idx: Vec<usize> = (0..e).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        sel.extend_from_slice(&idx[..k]);
    }
    sel
}

/// Reference routing weights of the experts `sel` (N, k) names: their probabilities, divided
/// by their sum when `norm`.
fn route_wts_ref(probs: &[f64], sel: &[usize], dims: MoeDims) -> Vec<f64> {
    let MoeDims { e, k, norm, .. } = dims;
    let mut wts = Vec::with_capacity(sel.len());
    for (r, s) in sel.chunks(k).enumerate() {
        let w: Vec<f64> = s.iter().map(|&x| probs[r * e + x]).collect();
        let total: f64 = if norm { w.iter().sum() } else { 1.0 };
        wts.extend(w.iter().map(|w| w / total));
    }
    wts
}

fn as_indices(x: &[f32]) -> Vec<usize> {
    x.iter().map(|&v| v as usize).collect()
}

/// Runs the routing forward: `(probs, sel, wts)`, prefilled with NaN (all overwrite).
fn route(logits: &[f32], dims: MoeDims) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (ne, nk) = (dims.n * dims.e, dims.m());
    let (mut probs, mut sel, mut wts) =
        (vec![f32::NAN; ne], vec![f32::NAN; nk], vec![f32::NAN; nk]);
    moe_route_forward(&mut probs, &mut sel, &mut wts, logits, dims);
    (probs, sel, wts)
}

#[test]
fn moe_route_forward_matches_reference() {
    let mut rng = Rng::new(70);
    for dims in MOE_DIMS {
        let what = |t: &str| format!("moe_route {t} {dims:?}");
        let logits = rng.vec(dims.n * dims.e, 3.0);
        let (probs, sel, wts) = route(&logits, dims);
        let want_probs = softmax_ref(&to64(&logits), dims.e);
        let want_sel = topk_ref(&want_probs, dims.e, dims.k);
        assert_close(&what("probs"), &probs, &want_probs, FWD_TOL);
        assert!(sel.iter().all(|&s| s == s.trunc()), "{}: {sel:?}", what("sel not integers"));
        assert_eq!(as_indices(&sel), want_sel, "{}", what("sel"));
        assert_close(&what("wts"), &wts, &route_wts_ref(&want_probs, &want_sel, dims), FWD_TOL);
    }
}

#[test]
fn moe_route_ties_go_to_the_lower_expert() {
    // Experts 1, 2 and 4 tie for first, 0 and 5 for fourth: exactly equal logits give exactly
    // equal probabilities, so only the index decides.
    let logits = [1.0, 3.0, 3.0, -2.0, 3.0, 1.0];
    let dims = MoeDims { n: 1, e: 6, k: 5, norm: false };
    let (probs, sel, wts) = route(&logits, dims);
    assert_eq!(sel, [1.0, 2.0, 4.0, 0.0, 5.0]);
    assert_eq!(wts, [probs[1], probs[2], probs[4], probs[0], probs[5]]);
    // With a uniform row, top-k is the first k experts.
    let (_, sel, wts) = route(&[0.5; 4], MoeDims { n: 1, e: 4, k: 2, norm: true });
    assert_eq!(sel, [0.0, 1.0]);
    assert_eq!(wts, [0.5, 0.5]);
}

/// The reference loss the routing backward differentiates: `L = sum(dwts * wts) +
/// sum_r mask[r] sum_e g[e] probs[r, e]` (the aux term when given), with the experts held at
/// `sel` (top-k is piecewise constant: the step never crosses a tie on these inputs).
fn route_loss_ref(
    logits: &[f64],
    sel: &[usize],
    dwts: &[f32],
    aux: Option<(&[f32], &[f32])>,
    dims: MoeDims,
) -> f64 {
    let probs = softmax_ref(logits, dims.e);
    let mut loss = proj(&route_wts_ref(&probs, sel, dims), dwts);
    if let Some((g, mask)) = aux {
        for (r, row) in probs.chunks(dims.e).enumerate() {
            loss += f64::from(mask[r]) * proj(row, g);
        }
    }
    loss
}

#[test]
fn moe_route_backward_matches_fd() {
    let mut rng = Rng::new(71);
    for dims in MOE_DIMS {
        for (norm, with_aux) in [(false, false), (true, false), (false, true), (true, true)] {
            let dims = MoeDims { norm, ..dims };
            let what = format!("moe_route_backward dlogits {dims:?} aux {with_aux}");
            let logits = rng.vec(dims.n * dims.e, 3.0);
            let (probs, sel, _) = route(&logits, dims);
            let dwts = rng.vec(dims.m(), 1.0);
            let g = rng.vec(dims.e, 1.0);
            let mask: Vec<f32> = (0..dims.n).map(|r| if r % 3 == 1 { 0.0 } else { 1.0 }).collect();
            let aux = with_aux.then_some((&g[..], &mask[..]));
            let mut dlogits = vec![f32::NAN; logits.len()]; // overwritten
            moe_route_backward(&mut dlogits, &dwts, &probs, &sel, aux, dims);
            let sel = as_indices(&sel);
            let loss = |l: &[f64]| route_loss_ref(l, &sel, &dwts, aux, dims);
            assert_close(&what, &dlogits, &fd_grad(&to64(&logits), FD_EPS, loss), GRAD_TOL);
        }
    }
}

#[test]
fn moe_aux_stats_accumulate_counts_and_probability_sums() {
    let mut rng = Rng::new(72);
    for dims in MOE_DIMS {
        let MoeDims { n, e, k, .. } = dims;
        let (probs, sel, _) = route(&rng.vec(n * e, 3.0), dims);
        let mask: Vec<f32> = (0..n).map(|r| if r % 4 == 2 { 0.0 } else { 1.0 }).collect();
        let prefill = rng.vec(2 * e, 1.0);
        let mut stats = prefill.clone();
        moe_aux_stats(&mut stats, &probs, &sel, &mask, dims);
        let mut want = to64(&prefill);
        for r in 0..n {
            let m = f64::from(mask[r]);
            for &s in &sel[r * k..(r + 1) * k] {
                want[s as usize] += m;
            }
            for x in 0..e {
                want[e + x] += m * f64::from(probs[r * e + x]);
            }
        }
        assert_close(&format!("moe_aux_stats (+=) {dims:?}"), &stats, &want, FWD_TOL);
    }
}

#[test]
fn moe_sort_is_a_stable_counting_sort_by_expert() {
    // N = 4 rows, k = 2, E = 5: pair p = r*k + j chose sel[p]; expert 4 is chosen by none.
    let sel = [2.0, 0.0, 1.0, 2.0, 2.0, 3.0, 0.0, 1.0];
    // Junk in the buffers: moe_sort reuses them.
    let (mut counts, mut order, mut pos) = (vec![9; 7], vec![-1.0; 3], vec![5.0; 11]);
    moe_sort(&sel, 5, &mut counts, &mut order, &mut pos);
    assert_eq!(counts, [2, 2, 3, 1, 0]);
    assert_eq!(order, [1.0, 6.0, 2.0, 7.0, 0.0, 3.0, 4.0, 5.0]);
    assert_eq!(pos, [4.0, 0.0, 2.0, 5.0, 6.0, 7.0, 1.0, 3.0]);

    // Random selections: pos inverts order, each expert's segment holds its pairs in order.
    let mut rng = Rng::new(73);
    let dims = MoeDims { n: 23, e: 6, k: 3, norm: false };
    let (_, sel, _) = route(&rng.vec(dims.n * dims.e, 3.0), dims);
    moe_sort(&sel, dims.e, &mut counts, &mut order, &mut pos);
    assert_eq!(counts.iter().sum::<usize>(), dims.m());
    let mut start = 0;
    for (x, &cnt) in counts.iter().enumerate() {
        let seg = as_indices(&order[start..start + cnt]);
        assert!(seg.iter().all(|&p| sel[p] as usize == x), "expert {x}'s segment: {seg:?}");
        assert!(seg.windows(2).all(|w| w[0] < w[1]), "expert {x}'s segment is not stable");
        start += cnt;
    }
    for (i, &p) in order.iter().enumerate() {
        assert_eq!(pos[p as usize], i as f32, "pos is not the inverse of order at {i}");
    }
}

/// A dispatch case: N rows of C, routed top-k over E, sorted by expert.
struct Dispatch {
    x: Vec<f32>,
    wts: Vec<f32>,
    order: Vec<f32>,
    pos: Vec<f32>,
    counts: Vec<usize>,
}

fn dispatch_case(rng: &mut Rng, dims: MoeDims, c: usize) -> Dispatch {
    let (_, sel, wts) = route(&rng.vec(dims.n * dims.e, 3.0), dims);
    let (mut counts, mut order, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    moe_sort(&sel, dims.e, &mut counts, &mut order, &mut pos);
    Dispatch { x: rng.vec(dims.n * c, 1.0), wts, order, pos, counts }
}

/// `(first, count)` of each expert's run of the sorted pairs, from `moe_sort`'s counts.
fn segments(counts: &[usize]) -> Vec<(usize, usize)> {
    let mut at = 0;
    counts
        .iter()
        .map(|&c| {
            at += c;
            (at - c, c)
        })
        .collect()
}

#[test]
fn moe_gather_and_scatter_add_match_naive_loops() {
    let mut rng = Rng::new(74);
    for (dims, c) in [(MOE_DIMS[1], 7), (MOE_DIMS[4], 13), (MOE_DIMS[0], 1)] {
        let MoeDims { n, k, .. } = dims;
        let m = dims.m();
        let Dispatch { x, wts, order, pos, counts } = dispatch_case(&mut rng, dims, c);
        let mut xs = vec![f32::NAN; m * c];
        moe_gather(&mut xs, &x, &order, k, c);
        let mut want = Vec::new();
        for &p in &order {
            want.extend_from_slice(&x[(p as usize / k) * c..][..c]);
        }
        assert_eq!(bits(&xs), bits(&want), "moe_gather {dims:?} C={c}");

        let src = rng.vec(m * c, 1.0);
        let prefill = rng.vec(n * c, 1.0);
        for weighted in [false, true] {
            let w = weighted.then_some(&wts[..]);
            let mut out = prefill.clone();
            // Expert by expert (each call's pairs name distinct rows), as the experts op does.
            for (at, cnt) in segments(&counts) {
                let ord = &order[at..at + cnt];
                moe_scatter_add(&mut out, &src[at * c..(at + cnt) * c], ord, w, k, c);
            }
            let mut want = to64(&prefill);
            for r in 0..n {
                for j in 0..k {
                    let (at, wj) = (pos[r * k + j] as usize, w.map_or(1.0, |w| w[r * k + j]));
                    for col in 0..c {
                        want[r * c + col] += f64::from(wj) * f64::from(src[at * c + col]);
                    }
                }
            }
            let what = format!("moe_scatter_add {dims:?} C={c} wts {weighted}");
            assert_close(&what, &out, &want, FWD_TOL);
        }
    }
}

#[test]
fn moe_scale_rows_and_row_dots_match_naive_loops() {
    let mut rng = Rng::new(75);
    for (dims, w) in [(MOE_DIMS[1], 9), (MOE_DIMS[4], 70), (MOE_DIMS[0], 1)] {
        let m = dims.m();
        let Dispatch { wts, order, pos, counts, .. } = dispatch_case(&mut rng, dims, 1);
        let buf0 = rng.vec(m * w, 1.0);
        let mut buf = buf0.clone();
        moe_scale_rows(&mut buf, &wts, &order, w);
        let want: Vec<f32> = (0..m * w).map(|i| buf0[i] * wts[order[i / w] as usize]).collect();
        assert_eq!(bits(&buf), bits(&want), "moe_scale_rows {dims:?} W={w}");

        let (a, b) = (rng.vec(m * w, 1.0), rng.vec(m * w, 1.0));
        let mut out = vec![f32::NAN; m];
        for (at, cnt) in segments(&counts) {
            let (ax, bx) = (&a[at * w..(at + cnt) * w], &b[at * w..(at + cnt) * w]);
            moe_row_dots(&mut out, ax, bx, &order[at..at + cnt], w);
        }
        let want: Vec<f64> = pos
            .iter()
            .map(|&p| dot64(&to64(&a[p as usize * w..][..w]), &to64(&b[p as usize * w..][..w])))
            .collect();
        assert_close(&format!("moe_row_dots {dims:?} W={w}"), &out, &want, FWD_TOL);
    }
}

#[test]
fn moe_bias_dots_accumulate_into_pair_order() {
    // An expert's down-projection bias dotted with each of its pairs' dy, added (+=) to the
    // pair's entry of a prefilled out, expert by expert; the last expert's call is left out, so
    // its pairs' entries must stay as they were.
    let mut rng = Rng::new(76);
    for (dims, c) in [(MOE_DIMS[1], 9), (MOE_DIMS[4], 70), (MOE_DIMS[0], 1)] {
        let m = dims.m();
        let Dispatch { order, counts, .. } = dispatch_case(&mut rng, dims, 1);
        let dy = rng.vec(m * c, 1.0);
        let biases: Vec<Vec<f32>> = (0..dims.e).map(|_| rng.vec(c, 1.0)).collect();
        let prefill = rng.vec(m, 1.0);
        let mut out = prefill.clone();
        for ((at, cnt), bias) in segments(&counts[..dims.e - 1]).into_iter().zip(&biases) {
            moe_bias_dots(&mut out, &dy[at * c..(at + cnt) * c], bias, &order[at..at + cnt], c);
        }
        let mut want = to64(&prefill);
        for ((at, cnt), bias) in segments(&counts[..dims.e - 1]).into_iter().zip(&biases) {
            for i in at..at + cnt {
                want[order[i] as usize] += dot64(&to64(&dy[i * c..][..c]), &to64(bias));
            }
        }
        assert_close(&format!("moe_bias_dots {dims:?} C={c}"), &out, &want, FWD_TOL);
    }
}

// ---- sigmoid gate (the shared expert's) ---------------------------------------------------

/// Rows of C: one, a few below a SIMD width, many with a width that is no multiple of 8.
const GATE_SHAPES: [(usize, usize); 4] = [(1, 1), (3, 5), (9, 37), (4, 130)];

/// Reference sigmoid gate: `out[r, j] = sigmoid(gate[r]) * inp[r, j]`.
fn sigmoid_gate_ref(gate: &[f64], inp: &[f64], c: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(inp.len());
    for (x, &g) in inp.chunks(c).zip(gate) {
        let s = 1.0 / (1.0 + (-g).exp());
        out.extend(x.iter().map(|x| s * x));
    }
    out
}

#[test]
fn sigmoid_gate_forward_matches_reference() {
    let mut rng = Rng::new(76);
    for (n, c) in GATE_SHAPES {
        let (gate, inp) = (rng.vec(n, 4.0), rng.vec(n * c, 1.0));
        let mut out = vec![f32::NAN; n * c]; // overwritten
        sigmoid_gate_forward(&mut out, &gate, &inp, c);
        let want = sigmoid_gate_ref(&to64(&gate), &to64(&inp), c);
        assert_close(&format!("sigmoid_gate out N={n} C={c}"), &out, &want, FWD_TOL);
    }
}

/// Both gradients against central differences of the reference loss `sum(out * R)`: dinp
/// over every element of inp, dgate over every row's logit (gates out to +-4, where
/// `s (1 - s)` is small); both overwrite (prefilled with NaN).
#[test]
fn sigmoid_gate_backward_matches_fd() {
    let mut rng = Rng::new(77);
    for (n, c) in GATE_SHAPES {
        let (gate, inp, r) = (rng.vec(n, 4.0), rng.vec(n * c, 1.0), rng.vec(n * c, 1.0));
        let (mut dinp, mut dgate) = (vec![f32::NAN; n * c], vec![f32::NAN; n]);
        sigmoid_gate_backward(&mut dinp, &mut dgate, &r, &gate, &inp, c);
        let (gate64, inp64) = (to64(&gate), to64(&inp));
        let fd_inp = fd_grad(&inp64, FD_EPS, |x| proj(&sigmoid_gate_ref(&gate64, x, c), &r));
        let fd_gate = fd_grad(&gate64, FD_EPS, |g| proj(&sigmoid_gate_ref(g, &inp64, c), &r));
        assert_close(&format!("sigmoid_gate dinp N={n} C={c}"), &dinp, &fd_inp, GRAD_TOL);
        assert_close(&format!("sigmoid_gate dgate N={n} C={c}"), &dgate, &fd_gate, GRAD_TOL);
    }
}

#[test]
fn sigmoid_gate_saturates_without_nan() {
    let (gate, inp) = ([-200.0, 200.0], [3.0, -2.0, 3.0, -2.0]);
    let mut out = [f32::NAN; 4];
    sigmoid_gate_forward(&mut out, &gate, &inp, 2);
    assert_eq!(out, [0.0, -0.0, 3.0, -2.0]);
    let (mut dinp, mut dgate) = ([f32::NAN; 4], [f32::NAN; 2]);
    sigmoid_gate_backward(&mut dinp, &mut dgate, &[1.0; 4], &gate, &inp, 2);
    assert_eq!(dinp, [0.0, 0.0, 1.0, 1.0]);
    assert_eq!(dgate, [0.0, 0.0]);
}
