//! CUDA vs CPU parity of every op, forward and backward (feature `cuda`; skipped, with the
//! reason printed, where no GPU is present). Inputs are random, sizes odd (not multiples of a
//! warp, a block or a tile), and every device buffer an op writes sits between guard regions
//! whose bits are checked afterwards, so an out-of-bounds write fails the test by name.
//!
//! Tolerances (ARCHITECTURE.md, tolerance table): `|gpu - cpu| <= tol * max(1, |cpu|)` with
//! tol = 1e-5 for elementwise ops and row reductions (fp32, different summation order), 5e-5
//! for fp32 matmuls and attention (sums of up to a few hundred products), 2e-2 for bf16 matmuls
//! (inputs rounded to 8 mantissa bits), bitwise for the bf16 conversions and the embedding
//! scatter-add (same order as the CPU).

#![cfg(feature = "cuda")]

use horizon_backend::cpu::testing::{Rng, assert_close};
use horizon_backend::cuda::{CudaBackend, CudaMem, DevSlice, MatmulPrecision, convert, probe};
use horizon_backend::{AttnDims, Backend, CpuBackend, DeviceAlloc, DeviceSlice};

const GUARD: usize = 37;
/// A NaN with a payload no kernel produces.
const SENTINEL: u32 = 0x7fa5_a5a5;

/// Prints why a test is skipped, past the test harness's output capture.
fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}
/// The GPU backend, or `None` (after printing why) where there is none.
fn gpu(precision: MatmulPrecision) -> Option<CudaBackend> {
    if !probe::driver_present() {
        skip("no CUDA driver on this machine (libcuda.so not found)");
        return None;
    }
    match CudaBackend::new(0, precision) {
        Ok(be) => Some(be),
        Err(e) => {
            skip(&format!("no usable GPU: {e}"));
            None
        }
    }
}

/// A device buffer between two guard regions.
struct Guarded {
    mem: CudaMem<f32>,
    len: usize,
    name: &'static str,
}

impl Guarded {
    fn new(be: &CudaBackend, name: &'static str, data: &[f32]) -> Self {
        let len = data.len();
        let mut host = vec![f32::from_bits(SENTINEL); len + 2 * GUARD];
        host[GUARD..GUARD + len].copy_from_slice(data);
        let mut mem = be.alloc(len + 2 * GUARD);
        be.upload(&mut mem, &host);
        Guarded { mem, len, name }
    }
    fn view(&self) -> &DevSlice<f32> {
        self.mem.slice(GUARD..GUARD + self.len)
    }
    fn view_mut(&mut self) -> &mut DevSlice<f32> {
        self.mem.slice_mut(GUARD..GUARD + self.len)
    }
    /// The buffer's contents, after checking both guard regions are untouched.
    fn read(&self, be: &CudaBackend) -> Vec<f32> {
        let mut host = vec![0.0; self.len + 2 * GUARD];
        be.download(&mut host, &self.mem);
        for (i, g) in host[..GUARD].iter().chain(&host[GUARD + self.len..]).enumerate() {
            assert_eq!(g.to_bits(), SENTINEL, "{}: guard element {i} was overwritten", self.name);
        }
        host[GUARD..GUARD + self.len].to_vec()
    }
}

fn ids_on(be: &CudaBackend, ids: &[i32]) -> CudaMem<i32> {
    let mut mem = be.alloc_i32(ids.len());
    be.upload_i32(&mut mem, ids);
    mem
}

const TOL: f64 = 1e-5;
const TOL_SUM: f64 = 5e-5;

#[test]
fn embedding_forward_and_backward() {
    let Some(be) = gpu(MatmulPrecision::Fp32) else { return };
    let mut rng = Rng::new(1);
    let (n, c, v) = (37, 67, 23);
    let ids: Vec<i32> = (0..n).map(|_| rng.below(v) as i32).collect();
    let table = rng.vec(v * c, 1.0);
    let mut want = vec![0.0; n * c];
    CpuBackend.embedding_forward(&mut want, &ids, &table, c);
    let (gids, gtable) = (ids_on(&be, &ids), Guarded::new(&be, "table", &table));
    let mut out = Guarded::new(&be, "out", &vec![0.0; n * c]);
    be.embedding_forward(out.view_mut(), &gids, gtable.view(), c);
    assert_close("embedding_forward", &out.read(&be), &want, 0.0);

    let dout = rng.vec(n * c, 1.0);
    let dtable0 = rng.vec(v * c, 1.0);
    let mut want = dtable0.clone();
    CpuBackend.embedding_backward(&mut want, &ids, &dout, c);
    let gdout = Guarded::new(&be, "dout", &dout);
    let mut dtable = Guarded::new(&be, "dtable", &dtable0);
    be.embedding_backward(dtable.view_mut(), &gids, gdout.view(), c);
    assert_close("embedding_backward (+=, row order)", &dtable.read(&be), &want, 0.0);
}

#[test]
fn rmsnorm_forward_and_backward() {
    let Some(be) = gpu(MatmulPrecision::Fp32) else { return };
    let mut rng = Rng::new(2);
    for (n, c) in [(1, 1), (5, 13), (33, 257), (7, 3001)] {
        let (x, w) = (rng.vec(n * c, 2.0), rng.vec(c, 1.0));
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        CpuBackend.rmsnorm_forward(&mut out, &mut rstd, &x, &w, c, 1e-5);
        let (gx, gw) = (Guarded::new(&be, "inp", &x), Guarded::new(&be, "weight", &w));
        let mut gout = Guarded::new(&be, "out", &vec![0.0; n * c]);
        let mut grstd = Guarded::new(&be, "rstd", &vec![0.0; n]);
        be.rmsnorm_forward(gout.view_mut(), grstd.view_mut(), gx.view(), gw.view(), c, 1e-5);
        assert_close("rmsnorm_forward out", &gout.read(&be), &out, TOL);
        assert_close("rmsnorm_forward rstd", &grstd.read(&be), &rstd, TOL);

        let dout = rng.vec(n * c, 1.0);
        let (dx0, dw0) = (rng.vec(n * c, 1.0), rng.vec(c, 1.0));
        let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
        CpuBackend.rmsnorm_backward(&mut dx, &mut dw, &dout, &x, &w, &rstd, c);
        let gdout = Guarded::new(&be, "dout", &dout);
        let (mut gdx, mut gdw) =
            (Guarded::new(&be, "dinp", &dx0), Guarded::new(&be, "dweight", &dw0));
        be.rmsnorm_backward(
            gdx.view_mut(),
            gdw.view_mut(),
            gdout.view(),
            gx.view(),
            gw.view(),
            grstd.view(),
            c,
        );
        assert_close("rmsnorm_backward dinp (+=)", &gdx.read(&be), &dx, TOL);
        assert_close("rmsnorm_backward dweight (+=)", &gdw.read(&be), &dw, TOL_SUM);
    }
}

fn matmul_case(be: &CudaBackend, tol: f64, seed: u64) {
    let mut rng = Rng::new(seed);
    for (n, ic, oc, bias) in
        [(1, 1, 1, true), (37, 29, 41, true), (65, 130, 7, false), (3, 257, 129, true)]
    {
        let (x, w, b) = (rng.vec(n * ic, 1.0), rng.vec(oc * ic, 0.3), rng.vec(oc, 1.0));
        let mut want = vec![0.0; n * oc];
        CpuBackend.matmul_forward(&mut want, &x, &w, bias.then_some(&b[..]), n, ic, oc);
        let (gx, gw, gb) = (
            Guarded::new(be, "inp", &x),
            Guarded::new(be, "weight", &w),
            Guarded::new(be, "bias", &b),
        );
        let mut gout = Guarded::new(be, "out", &vec![0.0; n * oc]);
        be.matmul_forward(
            gout.view_mut(),
            gx.view(),
            gw.view(),
            bias.then_some(gb.view()),
            n,
            ic,
            oc,
        );
        assert_close(&format!("matmul_forward {n}x{ic}x{oc}"), &gout.read(be), &want, tol);

        let dout = rng.vec(n * oc, 1.0);
        let (dw0, db0) = (rng.vec(oc * ic, 1.0), rng.vec(oc, 1.0));
        let (mut dx, mut dw, mut db) = (vec![0.0; n * ic], dw0.clone(), db0.clone());
        CpuBackend.matmul_backward(
            Some(&mut dx),
            &mut dw,
            bias.then_some(&mut db[..]),
            &dout,
            &x,
            &w,
            n,
            ic,
            oc,
        );
        let gdout = Guarded::new(be, "dout", &dout);
        let mut gdx = Guarded::new(be, "dinp", &vec![7.0; n * ic]);
        let (mut gdw, mut gdb) =
            (Guarded::new(be, "dweight", &dw0), Guarded::new(be, "dbias", &db0));
        be.matmul_backward(
            Some(gdx.view_mut()),
            gdw.view_mut(),
            bias.then_some(gdb.view_mut()),
            gdout.view(),
            gx.view(),
            gw.view(),
            n,
            ic,
            oc,
        );
        assert_close("matmul_backward dinp (overwrites)", &gdx.read(be), &dx, tol);
        assert_close("matmul_backward dweight (+=)", &gdw.read(be), &dw, tol);
        let db_want = if bias { db } else { db0 };
        assert_close("matmul_backward dbias (+=)", &gdb.read(be), &db_want, tol);
    }
}

#[test]
fn matmul_forward_and_backward_fp32() {
    let Some(be) = gpu(MatmulPrecision::Fp32) else { return };
    matmul_case(&be, TOL_SUM, 3);
}

#[test]
fn matmul_forward_and_backward_bf16_tensor_cores() {
    let Some(be) = gpu(MatmulPrecision::Bf16) else { return };
    matmul_case(&be, 2e-2, 4);
}

fn attn_cases() -> Vec<AttnDims> {
    vec![
        AttnDims { b: 1, t: 1, h: 1, kvh: 1, d: 2 },
        AttnDims { b: 2, t: 37, h: 4, kvh: 2, d: 6 },
        AttnDims { b: 1, t: 67, h: 3, kvh: 1, d: 40 },
        AttnDims { b: 3, t: 33, h: 2, kvh: 2, d: 72 },
        AttnDims { b: 1, t: 129, h: 4, kvh: 1, d: 128 },
        AttnDims { b: 1, t: 45, h: 2, kvh: 1, d: 256 },
    ]
}

#[test]
fn rope_forward_and_backward() {
    let Some(be) = gpu(MatmulPrecision::Fp32) else { return };
    let mut rng = Rng::new(5);
    for dims in attn_cases() {
        let (n, width, half) = (dims.n(), dims.qkv_width(), dims.d / 2);
        let (cos, sin) = (rng.vec(dims.t * half, 1.0), rng.vec(dims.t * half, 1.0));
        let qkv = rng.vec(n * width, 1.0);
        let (gc, gs) = (Guarded::new(&be, "cos", &cos), Guarded::new(&be, "sin", &sin));
        for backward in [false, true] {
            let mut want = qkv.clone();
            let mut g = Guarded::new(&be, "qkv", &qkv);
            if backward {
                CpuBackend.rope_backward(&mut want, &cos, &sin, dims);
                be.rope_backward(g.view_mut(), gc.view(), gs.view(), dims);
            } else {
                CpuBackend.rope_forward(&mut want, &cos, &sin, dims);
                be.rope_forward(g.view_mut(), gc.view(), gs.view(), dims);
            }
            assert_close(&format!("rope backward={backward} {dims:?}"), &g.read(&be), &want, TOL);
        }
    }
}

#[test]
fn attention_forward_and_backward() {
    let Some(be) = gpu(MatmulPrecision::Fp32) else { return };
    let mut rng = Rng::new(6);
    for dims in attn_cases() {
        let (n, width, hd) = (dims.n(), dims.qkv_width(), dims.h * dims.d);
        let qkv = rng.vec(n * width, 1.0);
        let (mut out, mut lse) = (vec![0.0; n * hd], vec![0.0; dims.b * dims.h * dims.t]);
        CpuBackend.attention_forward(&mut out, &mut lse, &qkv, dims);
        let gqkv = Guarded::new(&be, "qkv", &qkv);
        let mut gout = Guarded::new(&be, "out", &vec![0.0; n * hd]);
        let mut glse = Guarded::new(&be, "lse", &vec![0.0; lse.len()]);
        be.attention_forward(gout.view_mut(), glse.view_mut(), gqkv.view(), dims);
        assert_close(&format!("attention_forward out {dims:?}"), &gout.read(&be), &out, TOL_SUM);
        assert_close(&format!("attention_forward lse {dims:?}"), &glse.read(&be), &lse, TOL_SUM);

        let dout = rng.vec(n * hd, 1.0);
        let mut dqkv = vec![0.0; n * width];
        CpuBackend.attention_backward(&mut dqkv, &dout, &qkv, &out, &lse, dims);
        let gdout = Guarded::new(&be, "dout", &dout);
        let mut gdqkv = Guarded::new(&be, "dqkv", &vec![9.0; n * width]);
        be.attention_backward(
            gdqkv.view_mut(),
            gdout.view(),
            gqkv.view(),
            gout.view(),
            glse.view(),
            dims,
        );
        assert_close(
            &format!("attention_backward dqkv {dims:?}"),
            &gdqkv.read(&be),
            &dqkv,
            TOL_SUM,
        );
    }
}

#[test]
fn swiglu_residual_and_add() {
    let Some(be) = gpu(MatmulPrecision::Fp32) else { return };
    let mut rng = Rng::new(7);
    let (n, f) = (37, 131);
    let gu = rng.vec(n * 2 * f, 3.0);
    let mut want = vec![0.0; n * f];
    CpuBackend.swiglu_forward(&mut want, &gu, n, f);
    let ggu = Guarded::new(&be, "gate_up", &gu);
    let mut gout = Guarded::new(&be, "out", &vec![0.0; n * f]);
    be.swiglu_forward(gout.view_mut(), ggu.view(), n, f);
    assert_close("swiglu_forward", &gout.read(&be), &want, TOL);

    let dout = rng.vec(n * f, 1.0);
    let mut dgu = vec![0.0; n * 2 * f];
    CpuBackend.swiglu_backward(&mut dgu, &dout, &gu, n, f);
    let gdout = Guarded::new(&be, "dout", &dout);
    let mut gdgu = Guarded::new(&be, "dgate_up", &vec![5.0; n * 2 * f]);
    be.swiglu_backward(gdgu.view_mut(), gdout.view(), ggu.view(), n, f);
    assert_close("swiglu_backward (overwrites)", &gdgu.read(&be), &dgu, TOL);

    let (a, b) = (rng.vec(1001, 1.0), rng.vec(1001, 1.0));
    let mut want = vec![0.0; 1001];
    CpuBackend.residual_forward(&mut want, &a, &b);
    let (ga, gb) = (Guarded::new(&be, "a", &a), Guarded::new(&be, "b", &b));
    let mut gout = Guarded::new(&be, "out", &vec![0.0; 1001]);
    be.residual_forward(gout.view_mut(), ga.view(), gb.view());
    assert_close("residual_forward", &gout.read(&be), &want, 0.0);
    let mut want2 = a.clone();
    CpuBackend.add_inplace(&mut want2, &b);
    let mut gacc = Guarded::new(&be, "acc", &a);
    be.add_inplace(gacc.view_mut(), gb.view());
    assert_close("add_inplace", &gacc.read(&be), &want2, 0.0);

    let mut gz = Guarded::new(&be, "zeroed", &a);
    be.zero(gz.view_mut());
    assert_close("zero", &gz.read(&be), &vec![0.0f32; 1001], 0.0);
    let mut gc = Guarded::new(&be, "copy dst", &b);
    be.copy(gc.view_mut(), ga.view());
    assert_close("copy", &gc.read(&be), &a, 0.0);
}

#[test]
fn cross_entropy_forward_and_fused() {
    let Some(be) = gpu(MatmulPrecision::Fp32) else { return };
    let mut rng = Rng::new(8);
    for (n, v) in [(1, 1), (9, 37), (17, 1003), (5, 50_021)] {
        let logits = rng.vec(n * v, 4.0);
        let targets: Vec<i32> =
            (0..n).map(|r| if r % 4 == 3 { -100 } else { rng.below(v) as i32 }).collect();
        let mut losses = vec![0.0; n];
        CpuBackend.cross_entropy_forward(&mut losses, &logits, &targets, n, v);
        let (gl, gt) = (Guarded::new(&be, "logits", &logits), ids_on(&be, &targets));
        let mut gloss = Guarded::new(&be, "losses", &vec![1.0; n]);
        be.cross_entropy_forward(gloss.view_mut(), gl.view(), &gt, n, v);
        assert_close(&format!("cross_entropy_forward {n}x{v}"), &gloss.read(&be), &losses, TOL);

        let scale = 1.0 / 7.0;
        let (mut dl, mut l2) = (logits.clone(), vec![0.0; n]);
        CpuBackend.cross_entropy_fused(&mut dl, &mut l2, &targets, n, v, scale);
        let mut gdl = Guarded::new(&be, "logits -> dlogits", &logits);
        let mut gl2 = Guarded::new(&be, "losses", &vec![1.0; n]);
        be.cross_entropy_fused(gdl.view_mut(), gl2.view_mut(), &gt, n, v, scale);
        assert_close(&format!("cross_entropy_fused dlogits {n}x{v}"), &gdl.read(&be), &dl, TOL);
        assert_close(&format!("cross_entropy_fused losses {n}x{v}"), &gl2.read(&be), &l2, TOL);
    }
}

#[test]
fn bf16_conversions_match_the_host_rounding_bit_for_bit() {
    let Some(be) = gpu(MatmulPrecision::Fp32) else { return };
    let mut rng = Rng::new(9);
    let mut x = rng.vec(4099, 100.0);
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0 + f32::EPSILON,
        3.389_531_4e38,
    ]);
    let want: Vec<f32> = x.iter().map(|&v| convert::bf16_to_f32(convert::f32_to_bf16(v))).collect();
    let gx = Guarded::new(&be, "inp", &x);
    // bf16 scratch: (len + 1) / 2 f32 hold len bf16.
    let scratch = Guarded::new(&be, "bf16 scratch", &vec![0.0; x.len().div_ceil(2)]);
    let mut back = Guarded::new(&be, "expanded", &vec![0.0; x.len()]);
    // SAFETY: the scratch holds x.len() bf16; both launches are on the backend's stream, in
    // order, and the reads below synchronise.
    unsafe {
        convert::round_on_device(&be, scratch.view().addr(), gx.view());
        convert::expand_on_device(&be, back.view_mut(), scratch.view().addr());
    }
    let got = back.read(&be);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want), "device bf16 rounding differs from the host's");
    scratch.read(&be);
}

#[test]
fn sum_squares_matches_f64() {
    let Some(be) = gpu(MatmulPrecision::Fp32) else { return };
    let mut rng = Rng::new(10);
    for len in [1, 255, 100_003] {
        let x = rng.vec(len, 3.0);
        let want: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let gx = Guarded::new(&be, "x", &x);
        let mut scratch = be.sum_squares_scratch();
        let got = be.sum_squares(gx.view(), &mut scratch);
        assert!((got - want).abs() <= 1e-12 * want.max(1.0), "sum_squares({len}): {got} vs {want}");
    }
}
