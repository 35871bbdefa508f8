//! CUDA vs CPU parity of every op, forward and backward, and the CUDA device's bf16 copies
//! (feature `cuda`; on a GPU, or without one under the CUDA test double, `scripts/fakecuda.sh`;
//! never skipped). Inputs are random, sizes odd (not multiples of a warp, a block or a tile), and every device buffer an op
//! writes sits between guard regions whose bits are checked afterwards, so an out-of-bounds
//! write fails the test by name.
//!
//! The GPU stores weights as bf16 and rounds the activations a product takes to bf16. The CPU
//! reference is fed the same bf16-rounded values (weights always; a product's inputs too in the
//! first product comparison), so what remains is fp32 arithmetic in another order; a second
//! comparison against the plain fp32 CPU measures what bf16 costs.
//!
//! Tolerances (ARCHITECTURE.md, tolerance table): `|gpu - cpu| <= tol * max(1, |cpu|)` with
//! tol = 1e-5 for elementwise ops and row reductions (fp32, different summation order), 5e-5
//! for attention (sums of up to a few hundred products), 1e-4 for products against the CPU on
//! the same bf16 inputs (exact products, fp32 tensor-core sums in another order), 2e-2 for
//! products against the fp32 CPU (each input rounded to 8 significant bits, relative error up
//! to 2^-8 each), bitwise for the bf16 roundings, the embedding scatter-add and the MoE
//! gather, scatter-add and row scaling (same order as the CPU; MoE routing choices exact too);
//! attention on the tensor cores, against the CPU on the same bf16-rounded inputs, 1e-2 per
//! element and 3e-3 relative over each output (P and dS rounded to bf16).
//!
//! gpt-oss's attention sinks and the MoE bias dots hold to the same classes (observed under
//! the CUDA test double): the sink ops alone on the CPU's inputs within 1e-5 (the forward's
//! rescale is elementwise: expf and log1pf's last bits, observed exact under glibc) and 5e-5
//! (dsinks, sums over up to 900 rows in a tree: 8.9e-7), and from zero bit-identical run to
//! run; the whole chain (attention, the sinks' rescale, attention_backward, the sinks'
//! backward) at its kernel set's tolerance: fp32 within 5e-5 (dsinks 1.5e-6), the tensor
//! cores within 1e-2 (dsinks 1.1e-3, out 1.3e-3, dqkv 4.1e-3); decode with sinks within 5e-5
//! (5.4e-7); `moe_bias_dots` against the CPU on the bf16-rounded bias within 1e-5 (a warp's
//! fixed tree against the CPU's 8 lanes: 2.3e-6).

#![cfg(feature = "cuda")]

use horizon_backend::cpu::testing::{Rng, assert_close};
use horizon_backend::cuda::convert;
use horizon_backend::cuda::{
    AttentionKernels, CudaBackend, CudaDevice, CudaDeviceConfig, CudaMem, DevSlice,
};
use horizon_backend::nf4;
use horizon_backend::precision::GRAD_WIRE_CHUNK;
use horizon_backend::{
    AttnDims, Backend, Bf16, CpuBackend, DevBuf, Device, DeviceAlloc, DeviceSlice, Dinp, Event,
    HostPtr, HostPtrMut, MoeDims, NormDims, Precision, Queue,
};

const GUARD: usize = 37;
/// A NaN with a payload no kernel produces.
const SENTINEL: u32 = 0x7fa5_a5a5;
/// The same, as bf16 bits.
const SENTINEL_BF16: u16 = 0x7fa5;

/// The GPU backend, with a workspace for products up to 1024 x 1024 x 1024. Without a GPU
/// these tests run under the CUDA test double (`scripts/fakecuda.sh`); they never skip.
fn gpu() -> CudaBackend {
    let ws = Precision::Bf16.workspace(Precision::Bf16.product_bytes(1024, 1024, 1024));
    CudaBackend::new(0, ws.bytes).unwrap_or_else(|e| panic!("{e}\n{NO_GPU_HINT}"))
}

const NO_GPU_HINT: &str = "hint: without a GPU, run the CUDA tests under the CUDA test double: \
                           scripts/fakecuda.sh cargo test --features cuda";

/// A device buffer between two guard regions.
struct Guarded {
    mem: CudaMem<f32>,
    len: usize,
    guard: usize,
    name: &'static str,
}

impl Guarded {
    /// Guards of [`GUARD`] elements: the view starts 4-byte aligned only.
    fn new(be: &CudaBackend, name: &'static str, data: &[f32]) -> Self {
        Self::with_guard(be, name, data, GUARD)
    }
    /// Guards of `guard` elements (a multiple of 4 starts the view 16-byte aligned, which
    /// kernels with 16-byte accesses need).
    fn with_guard(be: &CudaBackend, name: &'static str, data: &[f32], guard: usize) -> Self {
        let len = data.len();
        let mut host = vec![f32::from_bits(SENTINEL); len + 2 * guard];
        host[guard..guard + len].copy_from_slice(data);
        let mut mem = be.alloc(len + 2 * guard);
        be.upload(&mut mem, &host);
        Guarded { mem, len, guard, name }
    }
    fn view(&self) -> &DevSlice<f32> {
        self.mem.slice(self.guard..self.guard + self.len)
    }
    fn view_mut(&mut self) -> &mut DevSlice<f32> {
        self.mem.slice_mut(self.guard..self.guard + self.len)
    }
    /// The buffer's contents, after checking both guard regions are untouched.
    fn read(&self, be: &CudaBackend) -> Vec<f32> {
        let g = self.guard;
        let mut host = vec![0.0; self.len + 2 * g];
        be.download(&mut host, &self.mem);
        for (i, x) in host[..g].iter().chain(&host[g + self.len..]).enumerate() {
            assert_eq!(x.to_bits(), SENTINEL, "{}: guard element {i} was overwritten", self.name);
        }
        host[g..g + self.len].to_vec()
    }
}

fn ids_on(be: &CudaBackend, ids: &[i32]) -> CudaMem<i32> {
    let mut mem = be.alloc_i32(ids.len());
    be.upload_i32(&mut mem, ids);
    mem
}

/// Weights on the device (rounded to bf16 by the upload).
fn weights_on(be: &CudaBackend, w: &[f32]) -> CudaMem<Bf16> {
    let mut mem = be.alloc_weights(w.len());
    be.upload_weights(&mut mem, w);
    mem
}

/// `x` rounded to bf16, as fp32: what the GPU computes with.
fn rounded(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| Bf16::from_f32(v).to_f32()).collect()
}

const TOL: f64 = 1e-5;
const TOL_SUM: f64 = 5e-5;
/// Products against the CPU on the same bf16 inputs.
const TOL_PRODUCT: f64 = 1e-4;
/// Products against the plain fp32 CPU.
const TOL_BF16: f64 = 2e-2;
/// Attention on the tensor cores against the CPU on the same bf16-rounded inputs: P and dS are
/// rounded to bf16 too (relative error up to 2^-9 each) before their products.
const TOL_TENSOR_ATTENTION: f64 = 1e-2;
/// The same, as the relative error of a whole output (out, dq, dk, dv): bf16's rounding of P
/// and dS alone gives 1.2-1.9e-3 on the cases here (under the CUDA test double).
const TOL_TENSOR_NORM: f64 = 3e-3;

#[test]
fn embedding_forward_and_backward() {
    let be = gpu();
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

/// Plain norms (offset 0) and Gemma's `x * (1 + w)` (offset 1); the backward runs twice on the
/// same gradients: dinp and dweight accumulate (+=), so both calls must add.
#[test]
fn rmsnorm_forward_and_backward() {
    let be = gpu();
    let mut rng = Rng::new(2);
    for (n, c, w_offset) in
        [(1, 1, 0.0), (5, 13, 0.0), (5, 13, 1.0), (33, 257, 0.0), (33, 257, 1.0), (7, 3001, 1.0)]
    {
        let norm = NormDims { c, eps: 1e-5, w_offset };
        let what = |t: &str| format!("{t} N={n} C={c} w_offset={w_offset}");
        // The GPU reads the weight as bf16: the CPU gets the same values.
        let (x, w) = (rng.vec(n * c, 2.0), rounded(&rng.vec(c, 1.0)));
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        CpuBackend.rmsnorm_forward(&mut out, &mut rstd, &x, &w, norm);
        let (gx, gw) = (Guarded::new(&be, "inp", &x), weights_on(&be, &w));
        let mut gout = Guarded::new(&be, "out", &vec![0.0; n * c]);
        let mut grstd = Guarded::new(&be, "rstd", &vec![0.0; n]);
        be.rmsnorm_forward(gout.view_mut(), grstd.view_mut(), gx.view(), &gw, norm);
        assert_close(&what("rmsnorm_forward out"), &gout.read(&be), &out, TOL);
        assert_close(&what("rmsnorm_forward rstd"), &grstd.read(&be), &rstd, TOL);

        let dout = rng.vec(n * c, 1.0);
        let (dx0, dw0) = (rng.vec(n * c, 1.0), rng.vec(c, 1.0));
        let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
        let gdout = Guarded::new(&be, "dout", &dout);
        let (mut gdx, mut gdw) =
            (Guarded::new(&be, "dinp", &dx0), Guarded::new(&be, "dweight", &dw0));
        for call in 1..=2 {
            CpuBackend.rmsnorm_backward(&mut dx, Some(&mut dw), &dout, &x, &w, &rstd, norm);
            be.rmsnorm_backward(
                gdx.view_mut(),
                Some(gdw.view_mut()),
                gdout.view(),
                gx.view(),
                &gw,
                grstd.view(),
                norm,
            );
            let dinp = what(&format!("rmsnorm_backward dinp (+=, call {call})"));
            assert_close(&dinp, &gdx.read(&be), &dx, TOL);
            let dweight = what(&format!("rmsnorm_backward dweight (+=, call {call})"));
            assert_close(&dweight, &gdw.read(&be), &dw, TOL_SUM);
        }
    }
}

/// One product's inputs: `inp` (N, IC), `weight` (OC, IC), `bias` (OC), `dout` (N, OC), and
/// the gradients' starting values `dweight0` (OC, IC), `dbias0` (OC).
struct Product<'a> {
    x: &'a [f32],
    w: &'a [f32],
    b: Option<&'a [f32]>,
    dout: &'a [f32],
    dw0: &'a [f32],
    db0: &'a [f32],
    n: usize,
    ic: usize,
    oc: usize,
}

/// What a product forward and backward produced.
struct ProductOut {
    out: Vec<f32>,
    dinp: Vec<f32>,
    dweight: Vec<f32>,
    dbias: Vec<f32>,
}

/// The product forward and backward on the GPU.
fn gpu_product(be: &CudaBackend, p: &Product) -> ProductOut {
    let (n, ic, oc) = (p.n, p.ic, p.oc);
    let (gx, gw) = (Guarded::new(be, "inp", p.x), weights_on(be, p.w));
    let gb = p.b.map(|b| weights_on(be, b));
    let mut gout = Guarded::new(be, "out", &vec![0.0; n * oc]);
    be.matmul_forward(gout.view_mut(), gx.view(), &gw, gb.as_deref(), n, ic, oc);
    let gdout = Guarded::new(be, "dout", p.dout);
    let mut gdx = Guarded::new(be, "dinp", &vec![7.0; n * ic]);
    let mut gdw = Guarded::new(be, "dweight", p.dw0);
    let mut gdb = Guarded::new(be, "dbias", p.db0);
    be.matmul_backward(
        Some(Dinp::Write(gdx.view_mut())),
        Some(gdw.view_mut()),
        p.b.is_some().then_some(gdb.view_mut()),
        gdout.view(),
        gx.view(),
        &gw,
        n,
        ic,
        oc,
    );
    ProductOut {
        out: gout.read(be),
        dinp: gdx.read(be),
        dweight: gdw.read(be),
        dbias: gdb.read(be),
    }
}

/// The same product on the CPU, its inputs rounded to bf16 first when `round`. The weight and
/// bias are always rounded (the GPU stores them so); `dbias` always sums the fp32 `dout`, as on
/// the GPU.
fn cpu_product(p: &Product, round: bool) -> ProductOut {
    let (n, ic, oc) = (p.n, p.ic, p.oc);
    let act = |v: &[f32]| if round { rounded(v) } else { v.to_vec() };
    let (x, dout, w) = (act(p.x), act(p.dout), rounded(p.w));
    let b = p.b.map(rounded);
    let mut out = vec![0.0; n * oc];
    CpuBackend.matmul_forward(&mut out, &x, &w, b.as_deref(), n, ic, oc);
    let (mut dinp, mut dweight, mut dbias) = (vec![0.0; n * ic], p.dw0.to_vec(), p.db0.to_vec());
    CpuBackend.matmul_backward(
        Some(Dinp::Write(&mut dinp)),
        Some(&mut dweight),
        None,
        &dout,
        &x,
        &w,
        n,
        ic,
        oc,
    );
    if b.is_some() {
        CpuBackend.matmul_backward(None, None, Some(&mut dbias), p.dout, p.x, &w, n, ic, oc);
    }
    ProductOut { out, dinp, dweight, dbias }
}

#[test]
fn matmul_forward_and_backward() {
    let be = gpu();
    let mut rng = Rng::new(3);
    for (n, ic, oc, bias) in
        [(1, 1, 1, true), (37, 29, 41, true), (65, 130, 7, false), (3, 257, 129, true)]
    {
        let (x, w, b) = (rng.vec(n * ic, 1.0), rng.vec(oc * ic, 0.3), rng.vec(oc, 1.0));
        let dout = rng.vec(n * oc, 1.0);
        let (dw0, db0) = (rng.vec(oc * ic, 1.0), rng.vec(oc, 1.0));
        let b = bias.then_some(&b[..]);
        let p = Product { x: &x, w: &w, b, dout: &dout, dw0: &dw0, db0: &db0, n, ic, oc };
        let got = gpu_product(&be, &p);
        for (round, tol) in [(true, TOL_PRODUCT), (false, TOL_BF16)] {
            let want = cpu_product(&p, round);
            let what = |t: &str| format!("{t} {n}x{ic}x{oc}, CPU inputs rounded: {round}");
            assert_close(&what("matmul_forward out"), &got.out, &want.out, tol);
            assert_close(&what("matmul_backward dinp (overwrites)"), &got.dinp, &want.dinp, tol);
            assert_close(&what("matmul_backward dweight (+=)"), &got.dweight, &want.dweight, tol);
            let dbias = what("matmul_backward dbias (+=, fp32 dout)");
            assert_close(&dbias, &got.dbias, &want.dbias, TOL_SUM);
        }
    }
}

/// `Dinp::Add` (beta = 1) adds the same product `Dinp::Write` writes; `dweight: None` (a frozen
/// weight) runs no dW GEMM and changes nothing but dinp and dbias, which equal the CPU's. All
/// buffers between guards.
#[test]
fn matmul_backward_accumulating_dinp_and_frozen_weight() {
    let be = gpu();
    let mut rng = Rng::new(23);
    for (n, ic, oc) in [(1, 1, 1), (37, 29, 41), (3, 257, 129)] {
        let what = |t: &str| format!("{t} {n}x{ic}x{oc}");
        let (x, w) = (rng.vec(n * ic, 1.0), rounded(&rng.vec(oc * ic, 0.3)));
        let (dout, old, db0) = (rng.vec(n * oc, 1.0), rng.vec(n * ic, 1.0), rng.vec(oc, 1.0));
        let (gx, gw, gdout) =
            (Guarded::new(&be, "inp", &x), weights_on(&be, &w), Guarded::new(&be, "dout", &dout));
        let mut gdx = Guarded::new(&be, "dinp", &old);
        let mut gdb = Guarded::new(&be, "dbias", &db0);
        be.matmul_backward(
            Some(Dinp::Add(gdx.view_mut())),
            None,
            Some(gdb.view_mut()),
            gdout.view(),
            gx.view(),
            &gw,
            n,
            ic,
            oc,
        );
        let (mut dx, mut db) = (old.clone(), db0.clone());
        let rdout = rounded(&dout);
        CpuBackend.matmul_backward(Some(Dinp::Add(&mut dx)), None, None, &rdout, &x, &w, n, ic, oc);
        CpuBackend.matmul_backward(None, None, Some(&mut db), &dout, &x, &w, n, ic, oc);
        assert_close(
            &what("matmul_backward dinp (Dinp::Add, +=)"),
            &gdx.read(&be),
            &dx,
            TOL_PRODUCT,
        );
        assert_close(
            &what("matmul_backward dbias (+=, frozen weight)"),
            &gdb.read(&be),
            &db,
            TOL_SUM,
        );
        // Write then Add from the written values: twice the product.
        let dinp_only = |d: Dinp<'_, DevSlice<f32>>| {
            be.matmul_backward(Some(d), None, None, gdout.view(), gx.view(), &gw, n, ic, oc)
        };
        let mut gdx = Guarded::new(&be, "dinp", &vec![7.0; n * ic]);
        dinp_only(Dinp::Write(gdx.view_mut()));
        let once = gdx.read(&be);
        dinp_only(Dinp::Add(gdx.view_mut()));
        let twice: Vec<f32> = once.iter().map(|v| 2.0 * v).collect();
        assert_close(&what("matmul_backward Write then Add"), &gdx.read(&be), &twice, TOL_PRODUCT);
    }
}

/// The norms' backward without a weight gradient (frozen norm weights) gives the same dinp as
/// with one, and the CPU's.
#[test]
fn norm_backwards_without_dweight() {
    let be = gpu();
    let mut rng = Rng::new(24);
    let (n, c) = (5, 13);
    let norm = NormDims { c, eps: 1e-5, w_offset: 1.0 };
    let (x, w, dout, dx0) =
        (rng.vec(n * c, 2.0), rounded(&rng.vec(c, 1.0)), rng.vec(n * c, 1.0), rng.vec(n * c, 1.0));
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    CpuBackend.rmsnorm_forward(&mut out, &mut rstd, &x, &w, norm);
    let mut dx = dx0.clone();
    CpuBackend.rmsnorm_backward(&mut dx, None, &dout, &x, &w, &rstd, norm);
    let (gx, gw, gdout, grstd) = (
        Guarded::new(&be, "inp", &x),
        weights_on(&be, &w),
        Guarded::new(&be, "dout", &dout),
        Guarded::new(&be, "rstd", &rstd),
    );
    let mut gdx = Guarded::new(&be, "dinp", &dx0);
    be.rmsnorm_backward(gdx.view_mut(), None, gdout.view(), gx.view(), &gw, grstd.view(), norm);
    assert_close("rmsnorm_backward dinp (+=), dweight None", &gdx.read(&be), &dx, TOL);

    let dims = AttnDims::new(2, 5, 4, 2, 16);
    let hnorm = NormDims { c: dims.d, eps: 1e-6, w_offset: 0.0 };
    let (len, heads) = (dims.n() * dims.qkv_width(), dims.h + dims.kvh);
    let (x, w, dout) = (rng.vec(len, 2.0), rounded(&rng.vec(2 * dims.d, 1.0)), rng.vec(len, 1.0));
    let (mut out, mut rstd) = (vec![0.0; len], vec![0.0; dims.n() * heads]);
    CpuBackend.head_rmsnorm_forward(&mut out, &mut rstd, &x, &w, dims, hnorm);
    let mut dx = vec![0.0; len];
    CpuBackend.head_rmsnorm_backward(&mut dx, None, &dout, &x, &w, &rstd, dims, hnorm);
    let (gx, gw, gdout, grstd) = (
        Guarded::new(&be, "inp", &x),
        weights_on(&be, &w),
        Guarded::new(&be, "dout", &dout),
        Guarded::new(&be, "rstd", &rstd),
    );
    let mut gdx = Guarded::new(&be, "dinp", &vec![7.0; len]);
    be.head_rmsnorm_backward(
        gdx.view_mut(),
        None,
        gdout.view(),
        gx.view(),
        &gw,
        grstd.view(),
        dims,
        hnorm,
    );
    assert_close("head_rmsnorm_backward dinp, dweight None", &gdx.read(&be), &dx, TOL);
}

/// The column-slice ops: elementwise, one rounding each as on the CPU, so bit for bit; the
/// columns outside the slice (and the guards) are untouched.
#[test]
fn add_cols_and_scaled_cols() {
    let be = gpu();
    let mut rng = Rng::new(25);
    for (n, wide, col, w, scale) in
        [(1, 1, 0, 1, 2.0), (37, 100, 33, 29, 0.37), (5, 300, 256, 44, -1.5), (3, 9, 2, 0, 5.0)]
    {
        let what = |t: &str| format!("{t} N={n} wide={wide} col={col} w={w}");
        let (out0, src) = (rng.vec(n * wide, 1.0), rng.vec(n * w, 1.0));
        let mut want = out0.clone();
        CpuBackend.add_cols(&mut want, &src, n, wide, col, w, scale);
        let (mut gout, gsrc) = (Guarded::new(&be, "out", &out0), Guarded::new(&be, "src", &src));
        be.add_cols(gout.view_mut(), gsrc.view(), n, wide, col, w, scale);
        assert_close(&what("add_cols (+=)"), &gout.read(&be), &want, 0.0);

        let wsrc = rng.vec(n * wide, 1.0);
        let mut want = vec![0.0; n * w];
        CpuBackend.scaled_cols(&mut want, &wsrc, n, wide, col, w, scale);
        let (mut gout, gsrc) =
            (Guarded::new(&be, "out", &vec![7.0; n * w]), Guarded::new(&be, "src", &wsrc));
        be.scaled_cols(gout.view_mut(), gsrc.view(), n, wide, col, w, scale);
        assert_close(&what("scaled_cols (overwrites)"), &gout.read(&be), &want, 0.0);
    }
}

/// `dequantize` (one of the backend's dequantize ops) of `packed` into `n` weights between
/// guards: the weights, the guards checked untouched and `packed` unmoved.
fn guarded_dequantize(
    be: &CudaBackend,
    packed: &[f32],
    n: usize,
    dequantize: fn(&CudaBackend, &mut DevSlice<Bf16>, &DevSlice<f32>, usize),
) -> Vec<Bf16> {
    let gpacked = Guarded::new(be, "packed", packed);
    let sentinel = f32::from_bits(u32::from(SENTINEL_BF16) << 16);
    let mut out = weights_on(be, &vec![sentinel; n + 2 * GUARD]);
    dequantize(be, out.slice_mut(GUARD..GUARD + n), gpacked.view(), n);
    let mut got = vec![Bf16(0); n + 2 * GUARD];
    be.download_weights(&mut got, &out);
    let guard = Bf16::from_f32(sentinel);
    let guards = got[..GUARD].iter().chain(&got[GUARD + n..]);
    assert!(guards.into_iter().all(|g| *g == guard), "n = {n}: a guard moved");
    gpacked.read(be);
    got[GUARD..GUARD + n].to_vec()
}

/// MXFP4 to bf16 weights: the CPU's fp32 values (`mxfp4::decode`'s, every one exact in bf16
/// up to scale 252; beyond, rounded) bit for bit, signed zeros and the subnormal scale 0
/// included; the weight guards are untouched.
#[test]
fn dequantize_mxfp4_is_the_cpu_value_in_bf16() {
    use horizon_backend::mxfp4;
    let be = gpu();
    for blocks_n in [1usize, 3, 5, 64] {
        let n = blocks_n * mxfp4::BLOCK;
        let blocks: Vec<u8> = (0..n / 2).map(|b| (b * 73 + 5) as u8).collect();
        let scales: Vec<u8> = (0..blocks_n).map(|k| [0u8, 1, 127, 100, 252, 255][k % 6]).collect();
        let mut words = vec![0u32; mxfp4::words(n)];
        mxfp4::to_words(&blocks, &scales, &mut words);
        let packed: Vec<f32> = words.iter().map(|&u| f32::from_bits(u)).collect();
        let mut cpu = vec![0.0; n];
        CpuBackend.dequantize_mxfp4(&mut cpu, &packed, n);
        let mut want = vec![0.0; n];
        mxfp4::decode(&blocks, &scales, &mut want);
        assert_eq!(
            cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let want: Vec<Bf16> = cpu.iter().map(|&v| Bf16::from_f32(v)).collect();
        let got = guarded_dequantize(&be, &packed, n, CudaBackend::dequantize_mxfp4);
        assert_eq!(got, want, "n = {n}");
    }
}

/// The `gpt_oss_mxfp4` fixture's packed experts, each expert's device form dequantized on the
/// device, are bit for bit what transformers loads (`dequantized.safetensors`, bf16), transposed
/// to Horizon's out-by-in rows.
#[test]
fn dequantize_mxfp4_gives_the_fixture_experts_bit_for_bit() {
    use horizon_backend::mxfp4;
    let be = gpu();
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gpt_oss_mxfp4");
    let (model, deq) = (
        std::fs::read(dir.join("model/model.safetensors")).unwrap(),
        std::fs::read(dir.join("dequantized.safetensors")).unwrap(),
    );
    let (model, deq) = (
        safetensors::SafeTensors::deserialize(&model).unwrap(),
        safetensors::SafeTensors::deserialize(&deq).unwrap(),
    );
    for name in ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    {
        let blocks = model.tensor(&format!("{name}_blocks")).unwrap();
        let scales = model.tensor(&format!("{name}_scales")).unwrap();
        let want = deq.tensor(name).unwrap();
        let [e, rows, g] = scales.shape()[..] else { panic!("{name}: scales") };
        let (cols, n) = (g * 32, rows * g * 32);
        for x in 0..e {
            let b = &blocks.data()[x * n / 2..(x + 1) * n / 2];
            let s = &scales.data()[x * n / 32..(x + 1) * n / 32];
            let mut words = vec![0u32; mxfp4::words(n)];
            mxfp4::to_words(b, s, &mut words);
            let packed: Vec<f32> = words.iter().map(|&u| f32::from_bits(u)).collect();
            let gpacked = Guarded::new(&be, "packed", &packed);
            let mut out = weights_on(&be, &vec![0.0; n]);
            be.dequantize_mxfp4(&mut out, gpacked.view(), n);
            let mut got = vec![Bf16(0); n];
            be.download_weights(&mut got, &out);
            let bf16_at = |c: usize, r: usize| {
                let k = 2 * ((x * cols + c) * rows + r);
                u16::from_le_bytes([want.data()[k], want.data()[k + 1]])
            };
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(got[r * cols + c].0, bf16_at(c, r), "{name} expert {x} [{r}, {c}]");
                }
            }
        }
    }
}

/// NF4 to bf16 weights: the CPU's fp32 values (`nf4::dequantize`'s) rounded to bf16 nearest
/// even, bit for bit, for lengths with partial blocks, odd lengths and a padded last word;
/// the weight guards are untouched.
#[test]
fn dequantize_nf4_is_the_cpu_value_rounded_to_bf16() {
    let be = gpu();
    let mut rng = Rng::new(26);
    for n in [1, 2, 3, 9, 64, 65, 129, 4096 + 37] {
        let mut w = rng.vec(n, 2.0);
        w[0] = -0.0;
        if n > 70 {
            w[64..].iter_mut().take(64).for_each(|v| *v = 0.0); // a zero block
        }
        let q = nf4::quantize(&w);
        let mut words = vec![0u32; nf4::words(n)];
        nf4::to_words(&q, &mut words);
        let packed: Vec<f32> = words.iter().map(|&u| f32::from_bits(u)).collect();
        let mut cpu = vec![0.0; n];
        CpuBackend.dequantize_nf4(&mut cpu, &packed, n);
        let want: Vec<Bf16> = cpu.iter().map(|&v| Bf16::from_f32(v)).collect();
        let got = guarded_dequantize(&be, &packed, n, CudaBackend::dequantize_nf4);
        assert_eq!(got, want, "n = {n}");
    }
}

#[test]
fn a_product_larger_than_the_workspace_is_refused_by_name() {
    let ws = Precision::Bf16.workspace(Precision::Bf16.product_bytes(4, 8, 8));
    let be = CudaBackend::new(0, ws.bytes).unwrap_or_else(|e| panic!("{e}\n{NO_GPU_HINT}"));
    let (n, ic, oc) = (4096, 512, 512);
    let (x, mut out) = (be.alloc(n * ic), be.alloc(n * oc));
    let w = be.alloc_weights(oc * ic);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        be.matmul_forward(&mut out, &x, &w, None, n, ic, oc)
    }));
    let msg = r.expect_err("an oversized product ran").downcast::<String>().unwrap();
    assert!(msg.contains("4096x512x0") && msg.contains("workspace"), "{msg}");
}

fn attn_cases() -> Vec<AttnDims> {
    vec![
        AttnDims::new(1, 1, 1, 1, 2),
        AttnDims::new(2, 37, 4, 2, 6),
        AttnDims::new(1, 67, 3, 1, 40),
        AttnDims::new(3, 33, 2, 2, 72),
        AttnDims::new(1, 129, 4, 1, 128),
        AttnDims::new(2, 70, 4, 2, 64),
        // The tensor cores' other head dims: one 16-column block, an odd count of them.
        AttnDims::new(1, 150, 4, 4, 16),
        AttnDims::new(2, 65, 6, 3, 48),
        AttnDims::new(1, 45, 2, 1, 256),
    ]
}

#[test]
fn rope_forward_and_backward() {
    let be = gpu();
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

/// Attention forward and backward of `dims` on the GPU against the CPU (both the output and the
/// lse; dqkv of the backward, prefilled with 9s to show it overwrites); returns the fp32 GPU
/// kernels' `out`, `lse` and `dqkv`. Each case runs on every kernel set that takes it
/// (`cuda/attention.rs`): with 4-byte aligned buffers (the warp-per-row kernels) and 16-byte
/// aligned ones (the tiled kernels where D is a multiple of 4 up to 128), both in fp32 and held
/// to the CPU alike; then, where D is a multiple of 16 up to 128, on both tensor-core sets
/// (wmma, then the default mma.sync), whose bf16 operands are held to the CPU on bf16-rounded
/// inputs at [`TOL_TENSOR_ATTENTION`].
fn check_attention(be: &CudaBackend, rng: &mut Rng, dims: AttnDims) -> [Vec<f32>; 3] {
    check_attention_sets(be, rng, dims, false)
}

/// [`check_attention`], with gpt-oss's attention sinks when `sinks`: each set's forward is
/// followed by `attention_sink_forward`, and its backward (on the sink-adjusted out and lse) by
/// `attention_sink_backward`, whose dsinks (H) is held to the CPU's at the set's tolerance too.
fn check_attention_sets(
    be: &CudaBackend,
    rng: &mut Rng,
    dims: AttnDims,
    sinks: bool,
) -> [Vec<f32>; 3] {
    let seed = rng.next_u64();
    let aligned = 4 * GUARD.div_ceil(4);
    be.set_attention_kernels(AttentionKernels::Fp32);
    check_attention_with(be, &mut Rng::new(seed), dims, GUARD, None, sinks);
    let fp32 = check_attention_with(be, &mut Rng::new(seed), dims, aligned, None, sinks);
    if dims.d.is_multiple_of(16) && dims.d <= 128 {
        for set in [AttentionKernels::Wmma, AttentionKernels::Tensor] {
            be.set_attention_kernels(set);
            check_attention_with(be, &mut Rng::new(seed), dims, aligned, Some(set), sinks);
        }
    }
    be.set_attention_kernels(AttentionKernels::Tensor);
    fp32
}

/// `x` rounded to bf16 and back.
fn bf16_rounded(x: Vec<f32>) -> Vec<f32> {
    x.into_iter().map(|v| Bf16::from_f32(v).to_f32()).collect()
}

/// One run of [`check_attention_sets`]'s: the inputs rounded to bf16 and the tensor cores'
/// tolerance when `tensor` names the tensor-core set that runs; with random sinks when `sinks`.
fn check_attention_with(
    be: &CudaBackend,
    rng: &mut Rng,
    dims: AttnDims,
    guard: usize,
    tensor: Option<AttentionKernels>,
    sinks: bool,
) -> [Vec<f32>; 3] {
    let (n, width, hd) = (dims.n(), dims.qkv_width(), dims.h * dims.d);
    let (round, tol) = match tensor.is_some() {
        true => (bf16_rounded as fn(Vec<f32>) -> Vec<f32>, TOL_TENSOR_ATTENTION),
        false => ((|x| x) as fn(Vec<f32>) -> Vec<f32>, TOL_SUM),
    };
    let set = tensor.map_or("fp32".to_string(), |k| format!("tensor cores, {k:?}"));
    let set = if sinks { format!("{set}, sinks") } else { set };
    let qkv = round(rng.vec(n * width, 1.0));
    let sink = sinks.then(|| rounded(&rng.vec(dims.h, 3.0)));
    let (mut out, mut lse) = (vec![0.0; n * hd], vec![0.0; dims.b * dims.h * dims.t]);
    CpuBackend.attention_forward(&mut out, &mut lse, &qkv, dims);
    let gqkv = Guarded::with_guard(be, "qkv", &qkv, guard);
    let mut gout = Guarded::with_guard(be, "out", &vec![0.0; n * hd], guard);
    let mut glse = Guarded::with_guard(be, "lse", &vec![0.0; lse.len()], guard);
    be.attention_forward(gout.view_mut(), glse.view_mut(), gqkv.view(), dims);
    let gsink = sink.as_ref().map(|s| weights_on(be, s));
    if let (Some(s), Some(gs)) = (&sink, &gsink) {
        CpuBackend.attention_sink_forward(&mut out, &mut lse, s, dims);
        be.attention_sink_forward(gout.view_mut(), glse.view_mut(), gs, dims);
    }
    let (got_out, got_lse) = (gout.read(be), glse.read(be));
    assert_close(&format!("attention_forward ({set}) out {dims:?}"), &got_out, &out, tol);
    assert_close(&format!("attention_forward ({set}) lse {dims:?}"), &got_lse, &lse, tol);

    let dout = round(rng.vec(n * hd, 1.0));
    let mut dqkv = vec![0.0; n * width];
    CpuBackend.attention_backward(&mut dqkv, &dout, &qkv, &out, &lse, dims);
    let gdout = Guarded::with_guard(be, "dout", &dout, guard);
    let mut gdqkv = Guarded::with_guard(be, "dqkv", &vec![9.0; n * width], guard);
    be.attention_backward(
        gdqkv.view_mut(),
        gdout.view(),
        gqkv.view(),
        gout.view(),
        glse.view(),
        dims,
    );
    let got_dqkv = gdqkv.read(be);
    assert_close(&format!("attention_backward ({set}) dqkv {dims:?}"), &got_dqkv, &dqkv, tol);
    if let (Some(s), Some(gs)) = (&sink, &gsink) {
        let mut dsinks = vec![0.5; dims.h];
        CpuBackend.attention_sink_backward(&mut dsinks, &dout, &out, &lse, s, dims);
        let mut gds = Guarded::new(be, "dsinks", &vec![0.5; dims.h]);
        let (o, l) = (gout.view(), glse.view());
        be.attention_sink_backward(gds.view_mut(), gdout.view(), o, l, gs, dims);
        assert_close(
            &format!("attention_sink_backward ({set}) {dims:?}"),
            &gds.read(be),
            &dsinks,
            tol,
        );
    }
    if tensor.is_some() {
        let (q, kv) = (dims.h * dims.d, dims.kvh * dims.d);
        let part = |x: &[f32], cols: std::ops::Range<usize>| -> Vec<f32> {
            x.chunks(width).flat_map(|row| row[cols.clone()].to_vec()).collect()
        };
        let parts = [("dq", 0..q), ("dk", q..q + kv), ("dv", q + kv..width)];
        assert_norm_close(&format!("attention_forward ({set}) out {dims:?}"), &got_out, &out);
        for (what, cols) in parts {
            let (g, w) = (part(&got_dqkv, cols.clone()), part(&dqkv, cols));
            assert_norm_close(&format!("attention_backward ({set}) {what} {dims:?}"), &g, &w);
        }
    }
    [got_out, got_lse, got_dqkv]
}

/// `||got - want|| / ||want||` within [`TOL_TENSOR_NORM`]: the tensor cores' error over a whole
/// output, which the elementwise bound (absolute below 1) cannot see where the values are small.
fn assert_norm_close(what: &str, got: &[f32], want: &[f32]) {
    let sq = |x: f64| x * x;
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| sq(f64::from(g) - f64::from(w))).sum();
    let norm: f64 = want.iter().map(|&w| sq(f64::from(w))).sum();
    let rel = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
    assert!(rel <= TOL_TENSOR_NORM, "{what}: relative error {rel:.2e} > {TOL_TENSOR_NORM:e}");
}

#[test]
fn attention_forward_and_backward() {
    let be = gpu();
    let mut rng = Rng::new(6);
    for dims in attn_cases() {
        check_attention(&be, &mut rng, dims);
    }
}

/// `dims` with a sliding window `w` and the scale `scale`.
fn windowed(dims: AttnDims, window: usize, scale: f32) -> AttnDims {
    AttnDims { window, scale, ..dims }
}

/// Sliding windows (1: each query sees itself only; 5 on T = 37: several tiles start past key 0
/// and the dk/dv walk stops early; 37 on T = 129 with GQA 4:1 and D = 128: a window longer than a
/// tile, not aligned to one; 70 on T = 200 with GQA 3:1: the tiled kernels' 64-row blocks
/// start past key 0 and stop their dk/dv walk early, across four tiles) and scores scaled other
/// than 1/sqrt(D) (Gemma's `query_pre_attn_scalar^-1/2`), against the CPU; a window of at least
/// T is full causal.
#[test]
fn attention_window_and_scale() {
    let be = gpu();
    let mut rng = Rng::new(12);
    let d6 = AttnDims::new(2, 37, 4, 2, 6);
    let d40 = AttnDims::new(1, 37, 3, 1, 40);
    let d128 = AttnDims::new(1, 129, 4, 1, 128);
    let d32 = AttnDims::new(2, 200, 6, 2, 32);
    let d48 = AttnDims::new(1, 130, 4, 2, 48);
    for dims in [
        d32,
        windowed(d32, 70, d32.scale),
        windowed(d48, 20, d48.scale),
        windowed(d6, 1, d6.scale),
        windowed(d6, 5, d6.scale),
        windowed(d40, 1, d40.scale),
        windowed(d40, 5, d40.scale),
        windowed(d128, 37, d128.scale),
        windowed(d128, 5, 0.0625),
        windowed(d6, 0, 0.8),
        windowed(d40, 0, 0.05),
        windowed(d40, 36, 0.3),
    ] {
        check_attention(&be, &mut rng, dims);
    }
    // W >= T sees every earlier key: the same results as W = 0, bit for bit, and the CPU's.
    for (dims, w) in [(d6, 37), (d40, 38), (d128, 129), (d128, usize::MAX)] {
        let seed = rng.next_u64();
        let full = check_attention(&be, &mut Rng::new(seed), dims);
        let wide = check_attention(&be, &mut Rng::new(seed), windowed(dims, w, dims.scale));
        for (what, (a, b)) in ["out", "lse", "dqkv"].iter().zip(full.iter().zip(&wide)) {
            assert_close(&format!("window {w} >= T = {} {what}", dims.t), b, a, 0.0);
        }
    }
}

/// gpt-oss's attention sinks after every kernel set (`check_attention_sets`): GQA and MQA,
/// sliding windows (not aligned to a tile), scales other than `1/sqrt(D)`, head dims that take
/// the warp-per-row kernels only (6, 256), the tiled fp32 ones (40) and both tensor-core sets
/// (48, 64, 128): out, lse, dqkv and dsinks against the CPU's chain.
#[test]
fn attention_with_sinks_on_every_kernel_set() {
    let be = gpu();
    let mut rng = Rng::new(13);
    for dims in [
        AttnDims::new(2, 37, 4, 2, 6),
        windowed(AttnDims::new(1, 67, 3, 1, 40), 5, 0.3),
        AttnDims::new(2, 70, 4, 2, 64),
        windowed(AttnDims::new(2, 65, 6, 3, 48), 20, 0.2),
        windowed(AttnDims::new(1, 129, 4, 1, 128), 37, 0.0625),
        AttnDims::new(1, 45, 2, 1, 256),
    ] {
        check_attention_sets(&be, &mut rng, dims, true);
    }
}

/// The sink ops alone on the same inputs as the CPU (any out and lse; sinks from -30 to +8):
/// the forward in place within `TOL` (expf and log1pf's last bits), out and lse between
/// guards; the backward accumulates (prefilled, then run twice) within `TOL_SUM` (sums over up
/// to 900 rows in another order), and from zero two runs agree bit for bit (no atomics).
#[test]
fn attention_sink_ops_match_the_cpu() {
    let be = gpu();
    let mut rng = Rng::new(15);
    for dims in [
        AttnDims::new(1, 1, 1, 1, 2),
        AttnDims::new(2, 37, 4, 2, 6),
        AttnDims::new(3, 300, 5, 1, 64),
    ] {
        let (n, hd, what) = (dims.n(), dims.h * dims.d, format!("{dims:?}"));
        let (out0, lse0) = (rng.vec(n * hd, 1.0), rng.vec(dims.b * dims.h * dims.t, 4.0));
        let mut sinks = rounded(&rng.vec(dims.h, 3.0));
        sinks[0] = 8.0;
        if dims.h > 2 {
            sinks[2] = -30.0;
        }
        let (mut out, mut lse) = (out0.clone(), lse0.clone());
        CpuBackend.attention_sink_forward(&mut out, &mut lse, &sinks, dims);
        let (mut gout, mut glse) =
            (Guarded::new(&be, "out", &out0), Guarded::new(&be, "lse", &lse0));
        let gs = weights_on(&be, &sinks);
        be.attention_sink_forward(gout.view_mut(), glse.view_mut(), &gs, dims);
        assert_close(&format!("attention_sink_forward out {what}"), &gout.read(&be), &out, TOL);
        assert_close(&format!("attention_sink_forward lse {what}"), &glse.read(&be), &lse, TOL);

        let dout = rng.vec(n * hd, 1.0);
        let gdout = Guarded::new(&be, "dout", &dout);
        let prefill = rng.vec(dims.h, 1.0);
        let mut dsinks = prefill.clone();
        let mut gds = Guarded::new(&be, "dsinks", &prefill);
        let mut zero = [
            Guarded::new(&be, "dsinks 0", &vec![0.0; dims.h]),
            Guarded::new(&be, "dsinks 1", &vec![0.0; dims.h]),
        ];
        for _ in 0..2 {
            CpuBackend.attention_sink_backward(&mut dsinks, &dout, &out, &lse, &sinks, dims);
            be.attention_sink_backward(
                gds.view_mut(),
                gdout.view(),
                gout.view(),
                glse.view(),
                &gs,
                dims,
            );
        }
        for z in &mut zero {
            be.attention_sink_backward(
                z.view_mut(),
                gdout.view(),
                gout.view(),
                glse.view(),
                &gs,
                dims,
            );
        }
        assert_close(
            &format!("attention_sink_backward twice {what}"),
            &gds.read(&be),
            &dsinks,
            TOL_SUM,
        );
        let [a, b] = zero.map(|z| z.read(&be));
        assert_close(&format!("attention_sink_backward run to run {what}"), &a, &b, 0.0);
    }
}

/// A KV cache's decode step: the last T_new query rows over every cached key (1, a few, all of
/// T; with GQA, head dims up to 256, sliding windows shorter than T and not aligned to a tile;
/// without and with attention sinks), against the CPU reference; `out` between guards.
#[test]
fn attention_decode_matches_cpu() {
    let be = gpu();
    let mut rng = Rng::new(14);
    let d6 = AttnDims::new(2, 37, 4, 2, 6);
    let d128 = AttnDims::new(1, 129, 4, 1, 128);
    let cases = attn_cases().into_iter().chain([
        windowed(d6, 5, d6.scale),
        windowed(d128, 37, 0.0625),
        windowed(d6, 1, 0.8),
    ]);
    for dims in cases {
        let qkv = rng.vec(dims.n() * dims.qkv_width(), 1.5);
        let xd = Guarded::new(&be, "qkv", &qkv);
        let sinks = rounded(&rng.vec(dims.h, 3.0));
        let gsinks = weights_on(&be, &sinks);
        for (t_new, with) in
            [1, 9.min(dims.t), dims.t].into_iter().flat_map(|t| [(t, false), (t, true)])
        {
            let len = dims.b * t_new * dims.h * dims.d;
            let mut want = vec![0.0; len];
            let s = with.then_some(&sinks[..]);
            CpuBackend.attention_decode(&mut want, &qkv, s, t_new, dims);
            let mut out = Guarded::new(&be, "out", &vec![f32::NAN; len]);
            be.attention_decode(out.view_mut(), xd.view(), with.then_some(&*gsinks), t_new, dims);
            assert_close(
                &format!("attention_decode {t_new} of {dims:?}, sinks {with}"),
                &out.read(&be),
                &want,
                5e-5,
            );
        }
    }
}

/// Per-head q/k norms of fused qkv rows (GQA, D = 16, 32, 72, 128, 256; w_offset 0 and 1): out
/// (the v part copied) and rstd overwrite; the backward runs twice: dinp overwrites (prefilled
/// with 7s, and the same after both calls), dweight accumulates (+=) over both. The dweight
/// reduction has one fixed order: from zero, two runs agree bit for bit.
#[test]
fn head_rmsnorm_forward_and_backward() {
    let be = gpu();
    let mut rng = Rng::new(13);
    for (dims, w_offset) in [
        (AttnDims::new(2, 5, 4, 2, 16), 0.0),
        (AttnDims::new(1, 7, 3, 1, 32), 1.0),
        (AttnDims::new(1, 3, 2, 2, 72), 1.0),
        (AttnDims::new(1, 9, 8, 2, 128), 0.0),
        (AttnDims::new(3, 11, 16, 4, 128), 1.0),
        (AttnDims::new(1, 3, 2, 1, 256), 1.0),
    ] {
        let norm = NormDims { c: dims.d, eps: 1e-6, w_offset };
        let (n, width, heads) = (dims.n(), dims.qkv_width(), dims.h + dims.kvh);
        let what = |t: &str| format!("{t} {dims:?} w_offset={w_offset}");
        let (x, w) = (rng.vec(n * width, 2.0), rounded(&rng.vec(2 * dims.d, 1.0)));
        let (mut out, mut rstd) = (vec![0.0; n * width], vec![0.0; n * heads]);
        CpuBackend.head_rmsnorm_forward(&mut out, &mut rstd, &x, &w, dims, norm);
        let (gx, gw) = (Guarded::new(&be, "inp", &x), weights_on(&be, &w));
        let mut gout = Guarded::new(&be, "out", &vec![3.0; n * width]);
        let mut grstd = Guarded::new(&be, "rstd", &vec![3.0; n * heads]);
        be.head_rmsnorm_forward(gout.view_mut(), grstd.view_mut(), gx.view(), &gw, dims, norm);
        assert_close(&what("head_rmsnorm_forward out"), &gout.read(&be), &out, TOL);
        assert_close(&what("head_rmsnorm_forward rstd"), &grstd.read(&be), &rstd, TOL);

        let dout = rng.vec(n * width, 1.0);
        let dw0 = rng.vec(2 * dims.d, 1.0);
        let (mut dx, mut dw) = (vec![0.0; n * width], dw0.clone());
        let gdout = Guarded::new(&be, "dout", &dout);
        let mut gdx = Guarded::new(&be, "dinp", &vec![7.0; n * width]);
        let mut gdw = Guarded::new(&be, "dweight", &dw0);
        for call in 1..=2 {
            CpuBackend.head_rmsnorm_backward(
                &mut dx,
                Some(&mut dw),
                &dout,
                &x,
                &w,
                &rstd,
                dims,
                norm,
            );
            be.head_rmsnorm_backward(
                gdx.view_mut(),
                Some(gdw.view_mut()),
                gdout.view(),
                gx.view(),
                &gw,
                grstd.view(),
                dims,
                norm,
            );
            let dinp = what(&format!("head_rmsnorm_backward dinp (overwrites, call {call})"));
            assert_close(&dinp, &gdx.read(&be), &dx, TOL);
            let dweight = what(&format!("head_rmsnorm_backward dweight (+=, call {call})"));
            assert_close(&dweight, &gdw.read(&be), &dw, TOL_SUM);
        }
        let runs: Vec<Vec<f32>> = (0..2)
            .map(|_| {
                let mut gdw = Guarded::new(&be, "dweight", &vec![0.0; 2 * dims.d]);
                be.head_rmsnorm_backward(
                    gdx.view_mut(),
                    Some(gdw.view_mut()),
                    gdout.view(),
                    gx.view(),
                    &gw,
                    grstd.view(),
                    dims,
                    norm,
                );
                gdw.read(&be)
            })
            .collect();
        assert_close(&what("head_rmsnorm_backward dweight, run twice"), &runs[1], &runs[0], 0.0);
    }
}

/// GeGLU with gates out to +-6, where tanh saturates: out and dgate_up (prefilled with 5s)
/// overwrite.
#[test]
fn geglu_forward_and_backward() {
    let be = gpu();
    let mut rng = Rng::new(14);
    for (n, f) in [(1, 1), (37, 131), (5, 1001)] {
        let gu = rng.vec(n * 2 * f, 6.0);
        let mut want = vec![0.0; n * f];
        CpuBackend.geglu_forward(&mut want, &gu, n, f);
        let ggu = Guarded::new(&be, "gate_up", &gu);
        let mut gout = Guarded::new(&be, "out", &vec![0.0; n * f]);
        be.geglu_forward(gout.view_mut(), ggu.view(), n, f);
        assert_close(&format!("geglu_forward {n}x{f}"), &gout.read(&be), &want, TOL);

        let dout = rng.vec(n * f, 1.0);
        let mut dgu = vec![0.0; n * 2 * f];
        CpuBackend.geglu_backward(&mut dgu, &dout, &gu, n, f);
        let gdout = Guarded::new(&be, "dout", &dout);
        let mut gdgu = Guarded::new(&be, "dgate_up", &vec![5.0; n * 2 * f]);
        be.geglu_backward(gdgu.view_mut(), gdout.view(), ggu.view(), n, f);
        let what = format!("geglu_backward (overwrites) {n}x{f}");
        assert_close(&what, &gdgu.read(&be), &dgu, TOL);
    }
}

/// gpt-oss's clamped SwiGLU, inputs out to +-4 against a limit of 1.5: out and dgate_up
/// (prefilled with 5s) overwrite.
#[test]
fn clamped_swiglu_forward_and_backward() {
    let be = gpu();
    let mut rng = Rng::new(93);
    let clamp = horizon_backend::GluClamp { alpha: 1.702, limit: 1.5 };
    for (n, f) in [(1, 1), (37, 131)] {
        let gu = rng.vec(n * 2 * f, 4.0);
        let mut want = vec![0.0; n * f];
        CpuBackend.clamped_swiglu_forward(&mut want, &gu, n, f, clamp);
        let ggu = Guarded::new(&be, "gate_up", &gu);
        let mut gout = Guarded::new(&be, "out", &vec![0.0; n * f]);
        be.clamped_swiglu_forward(gout.view_mut(), ggu.view(), n, f, clamp);
        assert_close(&format!("clamped_swiglu_forward {n}x{f}"), &gout.read(&be), &want, TOL);

        let dout = rng.vec(n * f, 1.0);
        let mut dgu = vec![0.0; n * 2 * f];
        CpuBackend.clamped_swiglu_backward(&mut dgu, &dout, &gu, (n, f), clamp);
        let gdout = Guarded::new(&be, "dout", &dout);
        let mut gdgu = Guarded::new(&be, "dgate_up", &vec![5.0; n * 2 * f]);
        be.clamped_swiglu_backward(gdgu.view_mut(), gdout.view(), ggu.view(), (n, f), clamp);
        let what = format!("clamped_swiglu_backward (overwrites) {n}x{f}");
        assert_close(&what, &gdgu.read(&be), &dgu, TOL);
    }
}

#[test]
fn swiglu_residual_and_add() {
    let be = gpu();
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
    let be = gpu();
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

/// Logits (N, V) and targets (N) for the vocabulary-tile tests, tiled by `widths`. Rows cycle
/// through four kinds, so the running max matters: small logits; uniform in [-80, 80) (a sum of
/// plain exponentials would overflow fp32); -80 in the first tile and a +80 spike in the last
/// (the max jumps late, the first tiles' sum scales to 0); 80 plus small noise everywhere.
/// Targets fall in every tile in turn; every fifth row is -100.
fn tiled_case(rng: &mut Rng, n: usize, widths: &[usize]) -> (Vec<f32>, Vec<i32>) {
    let v: usize = widths.iter().sum();
    let starts: Vec<usize> =
        widths.iter().scan(0, |at, &w| Some(std::mem::replace(at, *at + w))).collect();
    let mut logits = Vec::with_capacity(n * v);
    for r in 0..n {
        let mut row: Vec<f32> = match r % 4 {
            0 => rng.vec(v, 4.0),
            1 => rng.vec(v, 80.0),
            2 => rng.vec(v, 4.0),
            _ => rng.vec(v, 4.0).iter().map(|x| 80.0 + x).collect(),
        };
        if r % 4 == 2 {
            row[..widths[0]].iter_mut().for_each(|x| *x -= 80.0);
            let last = widths.len() - 1;
            row[starts[last] + rng.below(widths[last])] = 80.0;
        }
        logits.extend(row);
    }
    let targets = (0..n)
        .map(|r| {
            let t = r % widths.len();
            if r % 5 == 4 { -100 } else { (starts[t] + rng.below(widths[t])) as i32 }
        })
        .collect();
    (logits, targets)
}

/// Columns `v0..v0 + vt` of the (N, V) logits: what an LM-head tile produces, (N, VT).
fn tile_of(logits: &[f32], v: usize, v0: usize, vt: usize) -> Vec<f32> {
    logits.chunks(v).flat_map(|row| &row[v0..v0 + vt]).copied().collect()
}

/// Column `c` of (N, 3) stats.
fn stat(stats: &[f32], c: usize) -> Vec<f32> {
    stats.chunks(3).map(|s| s[c]).collect()
}

/// The (N, V) shapes and tile widths of the vocabulary-tile tests: a single tile of one id,
/// tiles of one id, a ragged last tile, and tiles of more than a block's 256 threads.
const TILINGS: [(usize, &[usize]); 5] = [
    (1, &[1]),
    (6, &[1, 1, 1, 1, 1, 1, 1, 1, 1]),
    (9, &[7, 7, 7, 7, 3]),
    (17, &[1, 1031, 7, 1500, 333]),
    (5, &[4096, 4096, 1811]),
];

/// Each tile op against the CPU, given the same inputs at every call (the CPU's stats so far),
/// so no error carries over: the stats over a sequence of tiles (`first` on the first, over
/// NaN stats it must not read), then dlogits per tile and the losses from the complete stats.
/// `m` (a max) and `t` (a copy) are bitwise; `s`, dlogits and losses at `TOL` (fp32 exp,
/// double sums in another order).
#[test]
fn cross_entropy_tiles_match_the_cpu() {
    let be = gpu();
    let mut rng = Rng::new(12);
    let scale = 1.0 / 7.0;
    for (n, widths) in TILINGS {
        let v: usize = widths.iter().sum();
        let (logits, targets) = tiled_case(&mut rng, n, widths);
        let gt = ids_on(&be, &targets);
        let mut stats = vec![f32::NAN; n * 3];
        let mut v0 = 0;
        for (i, &vt) in widths.iter().enumerate() {
            let what =
                |t: &str| format!("cross_entropy_tile_stats {t} N={n} V={v} tile {i} ({v0}+{vt})");
            let tile = tile_of(&logits, v, v0, vt);
            let first = i == 0;
            let gtile = Guarded::new(&be, "logits tile", &tile);
            let mut gstats = Guarded::new(&be, "stats", &stats);
            be.cross_entropy_tile_stats(gstats.view_mut(), gtile.view(), &gt, n, vt, v0, first);
            CpuBackend.cross_entropy_tile_stats(&mut stats, &tile, &targets, n, vt, v0, first);
            assert!(stats.iter().all(|x| x.is_finite()), "{}: CPU stats {stats:?}", what(""));
            let got = gstats.read(&be);
            assert_close(&what("m"), &stat(&got, 0), &stat(&stats, 0), 0.0);
            assert_close(&what("s"), &stat(&got, 1), &stat(&stats, 1), TOL);
            assert_close(&what("t"), &stat(&got, 2), &stat(&stats, 2), 0.0);
            v0 += vt;
        }

        let gstats = Guarded::new(&be, "stats", &stats);
        let mut want = vec![1.0; n];
        CpuBackend.cross_entropy_tile_loss(&mut want, &stats, &targets, n);
        let mut gloss = Guarded::new(&be, "losses", &vec![1.0; n]);
        be.cross_entropy_tile_loss(gloss.view_mut(), gstats.view(), &gt, n);
        assert_close(&format!("cross_entropy_tile_loss N={n} V={v}"), &gloss.read(&be), &want, TOL);

        let mut v0 = 0;
        for (i, &vt) in widths.iter().enumerate() {
            let mut want = tile_of(&logits, v, v0, vt);
            let mut gtile = Guarded::new(&be, "logits tile -> dlogits", &want);
            CpuBackend.cross_entropy_tile_grad(&mut want, &stats, &targets, n, vt, v0, scale);
            be.cross_entropy_tile_grad(gtile.view_mut(), gstats.view(), &gt, n, vt, v0, scale);
            let what = format!("cross_entropy_tile_grad N={n} V={v} tile {i} ({v0}+{vt})");
            assert_close(&what, &gtile.read(&be), &want, TOL);
            v0 += vt;
        }
    }
}

/// The tile ops composed on the GPU (stats over every tile, the losses, dlogits per tile)
/// reproduce the fused kernel on the whole (N, V) logits, within `TOL`: the same fp32
/// exponentials, but `s` is rounded to fp32 once per tile (K tiles: about K * 6e-8 relative,
/// at most 9 here) and summed in another order.
#[test]
fn cross_entropy_tiles_compose_to_the_fused_kernel() {
    let be = gpu();
    let mut rng = Rng::new(13);
    let scale = 1.0 / 11.0;
    for (n, widths) in TILINGS {
        let v: usize = widths.iter().sum();
        let (logits, targets) = tiled_case(&mut rng, n, widths);
        let gt = ids_on(&be, &targets);
        let mut gdl = Guarded::new(&be, "logits -> dlogits", &logits);
        let mut gl = Guarded::new(&be, "losses", &vec![1.0; n]);
        be.cross_entropy_fused(gdl.view_mut(), gl.view_mut(), &gt, n, v, scale);
        let (dlogits, losses) = (gdl.read(&be), gl.read(&be));

        let mut gstats = Guarded::new(&be, "stats", &vec![f32::NAN; n * 3]);
        let mut tiles = Vec::new();
        let mut v0 = 0;
        for (i, &vt) in widths.iter().enumerate() {
            let gtile = Guarded::new(&be, "logits tile", &tile_of(&logits, v, v0, vt));
            be.cross_entropy_tile_stats(gstats.view_mut(), gtile.view(), &gt, n, vt, v0, i == 0);
            tiles.push((v0, vt, gtile));
            v0 += vt;
        }
        let mut gloss = Guarded::new(&be, "losses", &vec![1.0; n]);
        be.cross_entropy_tile_loss(gloss.view_mut(), gstats.view(), &gt, n);
        let what = |t: &str| format!("tiles vs cross_entropy_fused: {t} N={n} V={v}");
        assert_close(&what("losses"), &gloss.read(&be), &losses, TOL);
        for (v0, vt, gtile) in &mut tiles {
            be.cross_entropy_tile_grad(gtile.view_mut(), gstats.view(), &gt, n, *vt, *v0, scale);
            let want = tile_of(&dlogits, v, *v0, *vt);
            assert_close(&what(&format!("dlogits {v0}+{vt}")), &gtile.read(&be), &want, TOL);
        }
    }
}

/// Routing shapes: one expert, top-2 of 8 renormalised, top-6 of 64, k = E, and top-8 of 128
/// over more rows than a block of the kernels.
const MOE_CASES: [MoeDims; 5] = [
    MoeDims { n: 1, e: 1, k: 1, norm: false },
    MoeDims { n: 37, e: 8, k: 2, norm: true },
    MoeDims { n: 13, e: 64, k: 6, norm: false },
    MoeDims { n: 5, e: 3, k: 3, norm: true },
    MoeDims { n: 133, e: 128, k: 8, norm: true },
];

/// The routing forward on the CPU: `(probs, sel, wts)`.
fn cpu_route(logits: &[f32], dims: MoeDims) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut probs, mut sel, mut wts) =
        (vec![0.0; dims.n * dims.e], vec![0.0; dims.m()], vec![0.0; dims.m()]);
    CpuBackend.moe_route_forward(&mut probs, &mut sel, &mut wts, logits, dims);
    (probs, sel, wts)
}

/// Routing on the GPU against the CPU: probs and wts within `TOL` (expf may differ in its last
/// bits), the same experts chosen in the same order (ties included: every third row repeats
/// its largest logit at another expert), all three overwritten (prefilled with 5s). The
/// backward, from the CPU's probs and sel, with and without `norm` and the aux term, overwrites
/// dlogits; the aux statistics accumulate.
#[test]
fn moe_route_and_aux_stats_match_the_cpu() {
    let be = gpu();
    let mut rng = Rng::new(27);
    for dims in MOE_CASES {
        let MoeDims { n, e, .. } = dims;
        let what = |t: &str| format!("{t} {dims:?}");
        let mut logits = rng.vec(n * e, 3.0);
        for row in logits.chunks_mut(e).step_by(3) {
            let (top, _) = row
                .iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
            let other = (top + e / 2) % e;
            row[other] = row[top];
        }
        let (probs, sel, wts) = cpu_route(&logits, dims);
        let glogits = Guarded::new(&be, "logits", &logits);
        let mut gprobs = Guarded::new(&be, "probs", &vec![5.0; n * e]);
        let mut gsel = Guarded::new(&be, "sel", &vec![5.0; dims.m()]);
        let mut gwts = Guarded::new(&be, "wts", &vec![5.0; dims.m()]);
        be.moe_route_forward(
            gprobs.view_mut(),
            gsel.view_mut(),
            gwts.view_mut(),
            glogits.view(),
            dims,
        );
        assert_close(&what("moe_route_forward probs"), &gprobs.read(&be), &probs, TOL);
        assert_close(&what("moe_route_forward sel"), &gsel.read(&be), &sel, 0.0);
        assert_close(&what("moe_route_forward wts"), &gwts.read(&be), &wts, TOL);

        let (gprobs, gsel) = (Guarded::new(&be, "probs", &probs), Guarded::new(&be, "sel", &sel));
        let dwts = rng.vec(dims.m(), 1.0);
        let g = rng.vec(e, 1.0);
        let mask: Vec<f32> = (0..n).map(|r| if r % 4 == 3 { 0.0 } else { 1.0 }).collect();
        let (gdwts, gg, gmask) = (
            Guarded::new(&be, "dwts", &dwts),
            Guarded::new(&be, "g", &g),
            Guarded::new(&be, "mask", &mask),
        );
        for (norm, with_aux) in [(false, false), (true, false), (false, true), (true, true)] {
            let dims = MoeDims { norm, ..dims };
            let mut dlogits = vec![0.0; n * e];
            let aux = with_aux.then_some((&g[..], &mask[..]));
            CpuBackend.moe_route_backward(&mut dlogits, &dwts, &probs, &sel, aux, dims);
            let mut gdl = Guarded::new(&be, "dlogits", &vec![5.0; n * e]);
            let gaux = with_aux.then_some((gg.view(), gmask.view()));
            be.moe_route_backward(
                gdl.view_mut(),
                gdwts.view(),
                gprobs.view(),
                gsel.view(),
                gaux,
                dims,
            );
            let what = format!("moe_route_backward (overwrites) {dims:?} aux {with_aux}");
            assert_close(&what, &gdl.read(&be), &dlogits, TOL);
        }

        let stats0 = rng.vec(2 * e, 1.0);
        let mut stats = stats0.clone();
        CpuBackend.moe_aux_stats(&mut stats, &probs, &sel, &mask, dims);
        let mut gstats = Guarded::new(&be, "stats", &stats0);
        be.moe_aux_stats(gstats.view_mut(), gprobs.view(), gsel.view(), gmask.view(), dims);
        assert_close(&what("moe_aux_stats (+=)"), &gstats.read(&be), &stats, TOL);
    }
}

/// The dispatch ops on a routed, sorted case: gather, scatter_add expert by expert (with and
/// without weights) and scale_rows compute as the CPU does, in the same order, so bit for bit;
/// the row dots sum in another order (a warp's lanes, then a tree): `TOL`.
#[test]
fn moe_dispatch_ops_match_the_cpu() {
    let be = gpu();
    let mut rng = Rng::new(28);
    for (dims, c, w) in [
        (MOE_CASES[0], 1, 1),
        (MOE_CASES[1], 67, 131),
        (MOE_CASES[2], 33, 45),
        (MOE_CASES[4], 5, 300),
    ] {
        let MoeDims { n, k, .. } = dims;
        let m = dims.m();
        let what = |t: &str| format!("{t} {dims:?} C={c} W={w}");
        let (_, sel, wts) = cpu_route(&rng.vec(n * dims.e, 3.0), dims);
        let (mut counts, mut order, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        horizon_backend::cpu::moe_sort(&sel, dims.e, &mut counts, &mut order, &mut pos);
        let (gorder, gwts) = (Guarded::new(&be, "order", &order), Guarded::new(&be, "wts", &wts));

        let x = rng.vec(n * c, 1.0);
        let mut xs = vec![0.0; m * c];
        CpuBackend.moe_gather(&mut xs, &x, &order, k, c);
        let gx = Guarded::new(&be, "x", &x);
        let mut gxs = Guarded::new(&be, "xs", &vec![5.0; m * c]);
        be.moe_gather(gxs.view_mut(), gx.view(), gorder.view(), k, c);
        assert_close(&what("moe_gather (overwrites)"), &gxs.read(&be), &xs, 0.0);

        let src = rng.vec(m * c, 1.0);
        let out0 = rng.vec(n * c, 1.0);
        let gsrc = Guarded::new(&be, "src", &src);
        // Expert by expert, as the experts op calls them (each call's pairs: distinct rows).
        let mut segments = Vec::new();
        counts.iter().fold(0, |at, &cnt| {
            segments.push((at, cnt));
            at + cnt
        });
        for weighted in [false, true] {
            let mut out = out0.clone();
            let mut gout = Guarded::new(&be, "out", &out0);
            for &(at, cnt) in &segments {
                let cw = weighted.then_some(&wts[..]);
                let (o, sr) = (&order[at..at + cnt], &src[at * c..(at + cnt) * c]);
                CpuBackend.moe_scatter_add(&mut out, sr, o, cw, k, c);
                let gw = weighted.then_some(gwts.view());
                let (go, gs) =
                    (gorder.view().slice(at..at + cnt), gsrc.view().slice(at * c..(at + cnt) * c));
                be.moe_scatter_add(gout.view_mut(), gs, go, gw, k, c);
            }
            let t = format!("moe_scatter_add wts {weighted}");
            assert_close(&what(&t), &gout.read(&be), &out, 0.0);
        }

        let buf0 = rng.vec(m * w, 1.0);
        let mut buf = buf0.clone();
        CpuBackend.moe_scale_rows(&mut buf, &wts, &order, w);
        let mut gbuf = Guarded::new(&be, "buf", &buf0);
        be.moe_scale_rows(gbuf.view_mut(), gwts.view(), gorder.view(), w);
        assert_close(&what("moe_scale_rows (in place)"), &gbuf.read(&be), &buf, 0.0);

        let (a, b) = (rng.vec(m * w, 1.0), rng.vec(m * w, 1.0));
        let mut dots = vec![0.0; m];
        let (ga, gb) = (Guarded::new(&be, "a", &a), Guarded::new(&be, "b", &b));
        let mut gdots = Guarded::new(&be, "dots", &vec![5.0; m]);
        for &(at, cnt) in &segments {
            let (ax, bx, o) =
                (&a[at * w..(at + cnt) * w], &b[at * w..(at + cnt) * w], &order[at..at + cnt]);
            CpuBackend.moe_row_dots(&mut dots, ax, bx, o, w);
            let (gax, gbx) =
                (ga.view().slice(at * w..(at + cnt) * w), gb.view().slice(at * w..(at + cnt) * w));
            be.moe_row_dots(gdots.view_mut(), gax, gbx, gorder.view().slice(at..at + cnt), w);
        }
        assert_close(&what("moe_row_dots (overwrites)"), &gdots.read(&be), &dots, TOL);

        // The down-projection bias (a bf16 weight on the GPU: the CPU takes it rounded) dotted
        // with each pair's row of dy (W wide), added into pair order (prefilled: accumulates).
        let dy = rng.vec(m * w, 1.0);
        let biases: Vec<Vec<f32>> = counts.iter().map(|_| rng.vec(w, 1.0)).collect();
        let gdy = Guarded::new(&be, "dy", &dy);
        let out0 = rng.vec(m, 1.0);
        let (mut bdots, mut gbdots) = (out0.clone(), Guarded::new(&be, "bias dots", &out0));
        for (&(at, cnt), bias) in segments.iter().zip(&biases) {
            let (y, o) = (&dy[at * w..(at + cnt) * w], &order[at..at + cnt]);
            CpuBackend.moe_bias_dots(&mut bdots, y, &rounded(bias), o, w);
            let gb = weights_on(&be, bias);
            let (gy, go) =
                (gdy.view().slice(at * w..(at + cnt) * w), gorder.view().slice(at..at + cnt));
            be.moe_bias_dots(gbdots.view_mut(), gy, &gb, go, w);
        }
        assert_close(&what("moe_bias_dots (accumulates)"), &gbdots.read(&be), &bdots, TOL);
    }
}

/// The shared expert's sigmoid gate on the GPU against the CPU, gates out to +-8 and rows
/// narrower and wider than the backward's block of 256: out, dinp and dgate overwrite
/// (prefilled with 5s), within `TOL` (expf's last bits; dgate's row sum in the block's fixed
/// shape, not the CPU's column order); a second backward is bit-identical (no atomics).
#[test]
fn sigmoid_gate_forward_and_backward() {
    let be = gpu();
    let mut rng = Rng::new(29);
    for (n, c) in [(1, 1), (37, 131), (5, 1001), (3, 256)] {
        let what = |t: &str| format!("{t} N={n} C={c}");
        let (gate, inp) = (rng.vec(n, 8.0), rng.vec(n * c, 1.0));
        let mut out = vec![0.0; n * c];
        CpuBackend.sigmoid_gate_forward(&mut out, &gate, &inp, c);
        let (ggate, ginp) = (Guarded::new(&be, "gate", &gate), Guarded::new(&be, "inp", &inp));
        let mut gout = Guarded::new(&be, "out", &vec![5.0; n * c]);
        be.sigmoid_gate_forward(gout.view_mut(), ggate.view(), ginp.view(), c);
        assert_close(&what("sigmoid_gate_forward (overwrites)"), &gout.read(&be), &out, TOL);

        let dout = rng.vec(n * c, 1.0);
        let (mut dinp, mut dgate) = (vec![0.0; n * c], vec![0.0; n]);
        CpuBackend.sigmoid_gate_backward(&mut dinp, &mut dgate, &dout, &gate, &inp, c);
        let gdout = Guarded::new(&be, "dout", &dout);
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut gdinp = Guarded::new(&be, "dinp", &vec![5.0; n * c]);
            let mut gdgate = Guarded::new(&be, "dgate", &vec![5.0; n]);
            be.sigmoid_gate_backward(
                gdinp.view_mut(),
                gdgate.view_mut(),
                gdout.view(),
                ggate.view(),
                ginp.view(),
                c,
            );
            runs.push((gdinp.read(&be), gdgate.read(&be)));
        }
        let (gdinp, gdgate) = &runs[0];
        assert_close(&what("sigmoid_gate_backward dinp (overwrites)"), gdinp, &dinp, TOL);
        assert_close(&what("sigmoid_gate_backward dgate (overwrites)"), gdgate, &dgate, TOL);
        assert_close(&what("sigmoid_gate_backward dinp, again"), &runs[1].0, gdinp, 0.0);
        assert_close(&what("sigmoid_gate_backward dgate, again"), &runs[1].1, gdgate, 0.0);
    }
}

#[test]
fn bf16_roundings_match_the_host_bit_for_bit() {
    let be = gpu();
    let mut rng = Rng::new(9);
    let mut x = rng.vec(4099, 100.0);
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0 + f32::EPSILON,
        1.0 + 2f32.powi(-8),
        3.389_531_4e38,
    ]);
    let want: Vec<Bf16> = x.iter().map(|&v| Bf16::from_f32(v)).collect();
    let len = x.len();
    // The device kernel, between guards. The guards are uploaded as weights, whose rounding
    // quiets the signalling NaN (0x7fa5 becomes 0x7fe5): they must still hold that afterwards.
    let gx = Guarded::new(&be, "inp", &x);
    let sentinel = f32::from_bits(u32::from(SENTINEL_BF16) << 16);
    let guard = Bf16::from_f32(sentinel).0;
    assert!(guard != SENTINEL_BF16 && (guard & 0x7fc0) == 0x7fc0, "{guard:#06x}: a quiet NaN");
    let mut out = weights_on(&be, &vec![sentinel; len + 2 * GUARD]);
    convert::round_on_device(&be, out.slice_mut(GUARD..GUARD + len), gx.view());
    let mut got = vec![Bf16(0); len + 2 * GUARD];
    be.download_weights(&mut got, &out);
    for (i, g) in got[..GUARD].iter().chain(&got[GUARD + len..]).enumerate() {
        assert_eq!(g.0, guard, "round_on_device: guard element {i} was overwritten");
    }
    assert_eq!(&got[GUARD..GUARD + len], &want[..], "the device's bf16 rounding differs");
    // The backend's weight upload.
    let w = weights_on(&be, &x);
    let mut got = vec![Bf16(0); len];
    be.download_weights(&mut got, &w);
    assert_eq!(got, want, "upload_weights rounds as the host does");
}

/// The bf16 weight upload and the bf16 gradient download of the CUDA device, over more than
/// one chunk of each (8M weights, 4M gradients per chunk), land exactly where and as they
/// should: the slot holds `Bf16::from_f32` of every weight, at its offset, and nothing else
/// moves; the host receives `Bf16::from_f32` of every gradient; the link counts 2 bytes each.
#[test]
fn cuda_device_carries_bf16_weights_and_gradients_exactly() {
    let ws = Precision::Bf16.workspace(Precision::Bf16.product_bytes(64, 64, 64));
    let dev = CudaDevice::new(CudaDeviceConfig::with_capacity((96 << 20) + ws.bytes))
        .unwrap_or_else(|e| panic!("{e}\n{NO_GPU_HINT}"));
    let workspace = dev.alloc(ws.bytes.div_ceil(4)).unwrap();
    dev.set_workspace(workspace);
    let mut rng = Rng::new(11);
    // 8M + 5 weights at offset 3 of a slot of 4M + 5 f32 elements (8M + 10 bf16).
    let (at, nw): (usize, usize) = (3, (8 << 20) + 5);
    let slot = dev.alloc((nw + at).div_ceil(2) + 1).unwrap();
    let before = vec![f32::from_bits(0x7fa5_7fa5); slot.len];
    let w = rng.vec(nw, 2.0);
    let mut words = vec![0.0f32; slot.len];
    // The download is on the D2H queue, which runs concurrently with the H2D queue: it waits
    // for an event recorded after the uploads.
    let uploaded = Event::new();
    // SAFETY: the host buffers outlive the synchronize below, which runs every copy.
    unsafe {
        dev.upload(slot, HostPtr::new(&before));
        dev.upload_weights(slot, at, HostPtr::new(&w));
        dev.record(Queue::H2D, &uploaded);
        dev.wait(Queue::D2H, &uploaded);
        dev.download(HostPtrMut::new(&mut words), slot);
    }
    dev.synchronize();
    // Little-endian: f32 element k holds bf16 2k in its low half, 2k + 1 in its high half.
    let bits: Vec<u16> =
        words.iter().flat_map(|f| [f.to_bits() as u16, (f.to_bits() >> 16) as u16]).collect();
    for (i, b) in bits.iter().enumerate() {
        let want = if (at..at + nw).contains(&i) { Bf16::from_f32(w[i - at]).0 } else { 0x7fa5 };
        assert_eq!(*b, want, "slot bf16 {i}");
    }
    // Gradients: one chunk and a bit, from an odd offset of the pool.
    let ng = GRAD_WIRE_CHUNK + 37;
    let g = rng.vec(ng, 3.0);
    let buf: DevBuf = dev.alloc(ng + 1).unwrap().sub(1..ng + 1);
    let mut out = vec![Bf16(0); ng];
    let d2h = dev.stats().d2h_bytes;
    // SAFETY: as above.
    unsafe {
        dev.upload(buf, HostPtr::new(&g));
        dev.synchronize();
        dev.download_bf16(HostPtrMut::new(&mut out), buf);
    }
    dev.synchronize();
    assert_eq!(dev.stats().d2h_bytes - d2h, 2 * ng as u64);
    let bad = out.iter().zip(&g).position(|(o, g)| *o != Bf16::from_f32(*g));
    assert!(bad.is_none(), "bf16 gradient element {bad:?} differs from the host rounding");
}

/// Frozen bf16 weights reach the slot as they are (no rounding, 2 bytes each on the link),
/// over more than one chunk of the page-locked ring, at an odd offset; nothing else moves.
#[test]
fn cuda_device_copies_bf16_weights_as_they_are() {
    let dev = CudaDevice::new(CudaDeviceConfig::with_capacity(64 << 20))
        .unwrap_or_else(|e| panic!("{e}\n{NO_GPU_HINT}"));
    let mut rng = Rng::new(12);
    let (at, nw): (usize, usize) = (5, (8 << 20) + 3);
    let slot = dev.alloc((nw + at).div_ceil(2) + 1).unwrap();
    let before = vec![f32::from_bits(0x7fa5_7fa5); slot.len];
    let w: Vec<Bf16> = rng.vec(nw, 2.0).iter().map(|&x| Bf16::from_f32(x)).collect();
    let mut words = vec![0.0f32; slot.len];
    let uploaded = Event::new();
    let h2d = dev.stats().h2d_bytes;
    // SAFETY: the host buffers outlive the synchronize below, which runs every copy.
    unsafe {
        dev.upload(slot, HostPtr::new(&before));
        dev.upload_weights_bf16(slot, at, HostPtr::new(&w));
        dev.record(Queue::H2D, &uploaded);
        dev.wait(Queue::D2H, &uploaded);
        dev.download(HostPtrMut::new(&mut words), slot);
    }
    dev.synchronize();
    assert_eq!(dev.stats().h2d_bytes - h2d, (4 * slot.len + 2 * nw) as u64);
    let bits: Vec<u16> =
        words.iter().flat_map(|f| [f.to_bits() as u16, (f.to_bits() >> 16) as u16]).collect();
    for (i, b) in bits.iter().enumerate() {
        let want = if (at..at + nw).contains(&i) { w[i - at].0 } else { 0x7fa5 };
        assert_eq!(*b, want, "slot bf16 {i}");
    }
}

#[test]
fn sum_squares_matches_f64() {
    let be = gpu();
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

/// Where the CUDA test double is on the library path (its build folder holds a `FAKECUDA`
/// marker), the GPU tests above ran on it: the driver is found, a backend and a device start,
/// and the device is the double. Nothing here can pass by skipping.
#[test]
fn the_cuda_test_double_runs_the_gpu_tests_when_on_the_library_path() {
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let double = path.split(':').find(|d| std::path::Path::new(d).join("FAKECUDA").exists());
    let Some(dir) = double else {
        // On a real GPU: the other tests ran on it (none of them can skip).
        assert!(horizon_backend::cuda::probe::driver_present(), "{NO_GPU_HINT}");
        return;
    };
    assert!(horizon_backend::cuda::probe::driver_present(), "{dir}: libcuda.so not loadable");
    let _ = gpu();
    let dev = CudaDevice::new(CudaDeviceConfig::with_capacity(1 << 20)).expect("a device");
    assert!(dev.name().contains("fakecuda"), "{dir} is on LD_LIBRARY_PATH, but {}", dev.name());
}
