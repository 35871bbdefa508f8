//! Time of every op of one decoder layer on the CUDA backend, forward and backward, at a
//! Qwen2.5-7B layer's shapes and 16K tokens (4 x 4096) by default: `cargo run --release
//! --features cuda --example cuda_op_speed [-- B T C F H KVH D REPS V CHUNK]`. Prints, per op, the
//! median milliseconds of REPS runs (default 5, after one warm-up), its TFLOP/s (products and
//! attention) or GB/s (the rest: the fewest bytes it must read and write), and each op's share
//! of the layer; then the forward's and the backward's sums. This is what `horizon bench`'s
//! per-layer `Forward` and `Backward` ops are made of, so it says which kernel holds a step back
//! on a real GPU (and what the projection's roofline assumes for it). Then the LM head's ops on
//! one chunk of CHUNK rows (default 2048) against a vocabulary tile (V default 152064): the
//! logits product, the tile's statistics and gradient, and the two backward products, per
//! chunk and per tile; for three tiles side by side: V/3 rows, as many as a weight slot (the
//! layer) holds (65,026 at the 7B shape, what the engine cut until 2026-12-04), and that
//! rounded down to a multiple of 128 (65,024, what it cuts now: `HeadTiling`). Without a GPU
//! it runs under the CUDA test double (`scripts/fakecuda.sh`), at small shapes only.
//!
//! Each op is timed as `REPS` runs each followed by a stream synchronize, wall clock: the ops
//! are milliseconds long at the default shapes, so the synchronize's microseconds do not count.
//! Inputs are random (a product on zeros runs faster than on data).

use std::time::Instant;

use horizon_backend::cpu::testing::Rng;
use horizon_backend::cuda::{AttentionKernels, CudaBackend, CudaMem};
use horizon_backend::{
    AttnDims, Backend, Bf16, DeviceAlloc, DeviceSlice, Dinp, NormDims, Precision,
};

/// The layer's shapes.
#[derive(Clone, Copy)]
struct Shape {
    b: usize,
    t: usize,
    c: usize,
    f: usize,
    h: usize,
    kvh: usize,
    d: usize,
}

impl Shape {
    fn n(&self) -> usize {
        self.b * self.t
    }
    fn qkv(&self) -> usize {
        (self.h + 2 * self.kvh) * self.d
    }
    fn attn(&self) -> AttnDims {
        AttnDims::new(self.b, self.t, self.h, self.kvh, self.d)
    }
    /// FLOPs of causal attention's forward over the visible pairs (QK^T and PV).
    fn attn_flops(&self) -> f64 {
        let pairs = (self.t * (self.t + 1) / 2) as f64;
        4.0 * (self.h * self.d) as f64 * self.b as f64 * pairs
    }
}

/// Which sum a timed op counts in: the layer's forward, its backward, or neither (a reference
/// timing beside the layer's own).
#[derive(Clone, Copy, PartialEq)]
enum Part {
    Forward,
    Backward,
    Reference,
}

/// One timed op: its name, the work it does (FLOPs, or bytes for a memory-bound op), and the
/// sum it counts in.
struct Row {
    name: &'static str,
    ms: f64,
    flops: f64,
    bytes: f64,
    part: Part,
}

/// Median seconds of `reps` runs of `f`, each followed by a synchronize, after one warm-up.
fn time(be: &CudaBackend, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    be.synchronize().expect("synchronize");
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            be.synchronize().expect("synchronize");
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// A device buffer of `len` random values in `[-scale, scale)`, uploaded in chunks (one host
/// chunk of random values repeated: the values need not be independent, only not constant).
fn random(be: &CudaBackend, rng: &mut Rng, len: usize, scale: f32) -> CudaMem<f32> {
    const CHUNK: usize = 1 << 22;
    let host = rng.vec(CHUNK.min(len), scale);
    let mut mem = be.alloc(len);
    let mut at = 0;
    while at < len {
        let k = (len - at).min(CHUNK);
        be.upload(mem.slice_mut(at..at + k), &host[..k]);
        at += k;
    }
    mem
}

fn weights(be: &CudaBackend, rng: &mut Rng, len: usize) -> CudaMem<Bf16> {
    let host = rng.vec(len, 0.02);
    let mut mem = be.alloc_weights(len);
    be.upload_weights(&mut mem, &host);
    mem
}

/// The arguments `B T C F H KVH D REPS V CHUNK`, each defaulted: the layer's shape, the
/// repetitions, and the LM head's vocabulary and rows per chunk.
fn parse() -> (Shape, usize, (usize, usize)) {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("arguments: B T C F H KVH D REPS V CHUNK, each a whole number"))
        .collect();
    let get = |i: usize, d: usize| a.get(i).copied().unwrap_or(d);
    let s = Shape {
        b: get(0, 4),
        t: get(1, 4096),
        c: get(2, 3584),
        f: get(3, 18944),
        h: get(4, 28),
        kvh: get(5, 4),
        d: get(6, 128),
    };
    (s, get(7, 5), (get(8, 152064), get(9, 2048)))
}

fn main() {
    let (s, reps, (v, chunk)) = parse();
    let (n, c, f, qkv) = (s.n(), s.c, s.f, s.qkv());
    // The engine's slot holds the largest layer: q, k, v (with biases, as Qwen2's), o, the
    // three MLP products and the two norms; a tile is as many vocabulary rows as fit beside
    // the final norm, rounded down to 128 (`horizon::engine::head_tiles::HeadTiling`).
    let layer_len = c * qkv + qkv + s.h * s.d * c + 3 * c * f + 2 * c;
    let fit = ((layer_len - c) / c).clamp(1, v);
    let tiles = [v.div_ceil(3), fit, if fit >= 128 { fit - fit % 128 } else { fit }];
    let vt = tiles.into_iter().max().unwrap_or(1);
    let largest = Precision::Bf16
        .product_bytes(n, f.max(c), (2 * f).max(qkv))
        .max(Precision::Bf16.product_bytes(chunk, c, vt))
        .max(Precision::Bf16.attention_bytes(n, s.h, s.kvh, s.d));
    let be = CudaBackend::new(0, Precision::Bf16.workspace(largest).bytes)
        .unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let mut rng = Rng::new(17);
    println!(
        "cuda_op_speed: B {} T {} C {c} F {f} H {} KVH {} D {}: N {n} rows; median of {reps}",
        s.b, s.t, s.h, s.kvh, s.d
    );
    let rows = layer(&be, &mut rng, s, reps);
    report(&rows);
    for vt in tiles {
        head(&be, &mut rng, s, (vt, chunk), reps);
    }
    cublas_alone(&be, &mut rng, s, reps);
}

/// The forward products as cuBLAS runs them without the backend around it (no rounding of the
/// input, no bias), bf16 inputs with fp32 accumulation, writing fp32 (as the backend) and
/// writing bf16: how much of a product's time is cuBLAS's own.
fn cublas_alone(be: &CudaBackend, rng: &mut Rng, s: Shape, reps: usize) {
    use cudarc::cublas::{result as blas, sys};
    use std::ffi::c_void;
    let (n, c, f, qkv) = (s.n(), s.c, s.f, s.qkv());
    let blas = cudarc::cublas::CudaBlas::new(be.stream().clone()).expect("a cuBLAS handle");
    println!(
        "cuBLAS alone (gemm_ex, bf16 x bf16, fp32 accumulation, TN as the backend's forward):"
    );
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>10}",
        "product", "fp32 out", "TFLOP/s", "bf16 out", "TFLOP/s"
    );
    for (name, ic, oc) in
        [("qkv", c, qkv), ("o", s.h * s.d, c), ("gate_up", c, 2 * f), ("down", f, c)]
    {
        let (w, x) = (weights(be, rng, oc * ic), weights(be, rng, n * ic));
        let (y32, y16) = (be.alloc(n * oc), be.alloc_weights(n * oc));
        let run = |out: u64, ty: sys::cudaDataType| {
            let (alpha, beta) = (1.0f32, 0.0f32);
            let i = |v: usize| v as i32;
            // SAFETY: w (oc, ic) and x (n, ic) are bf16 device buffers, out holds n * oc
            // elements of `ty`; alpha and beta are host f32 (CUBLAS_COMPUTE_32F) and outlive
            // the call.
            let r = unsafe {
                blas::gemm_ex(
                    *blas.handle(),
                    sys::cublasOperation_t::CUBLAS_OP_T,
                    sys::cublasOperation_t::CUBLAS_OP_N,
                    i(oc),
                    i(n),
                    i(ic),
                    (&alpha as *const f32).cast::<c_void>(),
                    w.addr() as *const c_void,
                    sys::cudaDataType::CUDA_R_16BF,
                    i(ic),
                    x.addr() as *const c_void,
                    sys::cudaDataType::CUDA_R_16BF,
                    i(ic),
                    (&beta as *const f32).cast::<c_void>(),
                    out as *mut c_void,
                    ty,
                    i(oc),
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            r.is_ok()
        };
        let fl = 2.0 * (n * ic * oc) as f64;
        let mut line = format!("{name:<22}");
        for ty in [sys::cudaDataType::CUDA_R_32F, sys::cudaDataType::CUDA_R_16BF] {
            let out = if ty == sys::cudaDataType::CUDA_R_32F { y32.addr() } else { y16.addr() };
            // A type the library refuses (the CUDA test double: fp32 out only) prints "-".
            if run(out, ty) {
                let t = time(be, reps, || assert!(run(out, ty), "cublasGemmEx failed"));
                line += &format!(" {:>10.3} {:>10.1}", t * 1e3, fl / t * 1e-12);
            } else {
                line += &format!(" {:>10} {:>10}", "-", "-");
            }
        }
        println!("{line}");
    }
}

/// Times every op of one layer, forward then backward, on buffers shaped as the engine's.
fn layer(be: &CudaBackend, rng: &mut Rng, s: Shape, reps: usize) -> Vec<Row> {
    let (n, c, f, qkv, hd) = (s.n(), s.c, s.f, s.qkv(), s.h * s.d);
    let norm = NormDims::new(c, 1e-6);
    let dims = s.attn();
    let x = random(be, rng, n * c, 1.0);
    let (wn, wqkv, bqkv) = (weights(be, rng, c), weights(be, rng, qkv * c), weights(be, rng, qkv));
    let (wo, wgu, wd) =
        (weights(be, rng, c * hd), weights(be, rng, 2 * f * c), weights(be, rng, c * f));
    let (mut xn, mut rstd) = (be.alloc(n * c), be.alloc(n));
    let mut q = random(be, rng, n * qkv, 1.0);
    let (cos, sin) = (random(be, rng, s.t * s.d / 2, 1.0), random(be, rng, s.t * s.d / 2, 1.0));
    let (mut att, mut lse) = (be.alloc(n * hd), be.alloc(s.b * s.h * s.t));
    let (mut o, mut gu, mut sw, mut y) =
        (be.alloc(n * c), random(be, rng, n * 2 * f, 1.0), be.alloc(n * f), be.alloc(n * c));
    let fl = |m: usize, k: usize, nn: usize| 2.0 * (m * k * nn) as f64;
    let b4 = |elems: usize| 4.0 * elems as f64;
    let mut rows = Vec::new();
    let mut push =
        |name, ms, flops, bytes, part| rows.push(Row { name, ms: ms * 1e3, flops, bytes, part });
    let (fwd, bwd_, reference) = (Part::Forward, Part::Backward, Part::Reference);
    // ---- forward
    push(
        "rmsnorm",
        time(be, reps, || be.rmsnorm_forward(&mut xn, &mut rstd, &x, &wn, norm)),
        0.0,
        b4(2 * n * c),
        fwd,
    );
    push(
        "qkv product",
        time(be, reps, || be.matmul_forward(&mut q, &xn, &wqkv, Some(&bqkv), n, c, qkv)),
        fl(n, c, qkv),
        0.0,
        fwd,
    );
    push(
        "rope",
        time(be, reps, || be.rope_forward(&mut q, &cos, &sin, dims)),
        0.0,
        b4(2 * n * (s.h + s.kvh) * s.d),
        fwd,
    );
    push(
        "attention",
        time(be, reps, || be.attention_forward(&mut att, &mut lse, &q, dims)),
        s.attn_flops(),
        0.0,
        fwd,
    );
    push(
        "o product",
        time(be, reps, || be.matmul_forward(&mut o, &att, &wo, None, n, hd, c)),
        fl(n, hd, c),
        0.0,
        fwd,
    );
    push(
        "residual",
        time(be, reps, || be.residual_forward(&mut y, &x, &o)),
        0.0,
        b4(3 * n * c),
        fwd,
    );
    push(
        "gate_up product",
        time(be, reps, || be.matmul_forward(&mut gu, &xn, &wgu, None, n, c, 2 * f)),
        fl(n, c, 2 * f),
        0.0,
        fwd,
    );
    push(
        "swiglu",
        time(be, reps, || be.swiglu_forward(&mut sw, &gu, n, f)),
        0.0,
        b4(3 * n * f),
        fwd,
    );
    push(
        "down product",
        time(be, reps, || be.matmul_forward(&mut y, &sw, &wd, None, n, f, c)),
        fl(n, f, c),
        0.0,
        fwd,
    );
    // ---- backward (the engine's order: down, swiglu, gate_up, o, attention, rope, qkv, norm)
    let dy = random(be, rng, n * c, 1e-3);
    let (mut dsw, mut dgu, mut dx) = (be.alloc(n * f), be.alloc(n * 2 * f), be.alloc(n * c));
    let (mut dwd, mut dwgu, mut dwo) = (be.alloc(c * f), be.alloc(2 * f * c), be.alloc(c * hd));
    let (mut dwqkv, mut dbqkv, mut dwn) = (be.alloc(qkv * c), be.alloc(qkv), be.alloc(c));
    let (mut datt, mut dq) = (be.alloc(n * hd), be.alloc(n * qkv));
    let bwd = |m, k, nn| 2.0 * fl(m, k, nn);
    push(
        "down product bwd",
        time(be, reps, || {
            be.matmul_backward(
                Some(Dinp::Write(&mut dsw)),
                Some(&mut dwd),
                None,
                &dy,
                &sw,
                &wd,
                n,
                f,
                c,
            )
        }),
        bwd(n, f, c),
        0.0,
        bwd_,
    );
    push(
        "swiglu bwd",
        time(be, reps, || be.swiglu_backward(&mut dgu, &dsw, &gu, n, f)),
        0.0,
        b4(5 * n * f),
        bwd_,
    );
    push(
        "gate_up product bwd",
        time(be, reps, || {
            be.matmul_backward(
                Some(Dinp::Write(&mut dx)),
                Some(&mut dwgu),
                None,
                &dgu,
                &xn,
                &wgu,
                n,
                c,
                2 * f,
            )
        }),
        bwd(n, c, 2 * f),
        0.0,
        bwd_,
    );
    push(
        "o product bwd",
        time(be, reps, || {
            be.matmul_backward(
                Some(Dinp::Write(&mut datt)),
                Some(&mut dwo),
                None,
                &dy,
                &att,
                &wo,
                n,
                hd,
                c,
            )
        }),
        bwd(n, hd, c),
        0.0,
        bwd_,
    );
    push(
        "attention bwd",
        time(be, reps, || be.attention_backward(&mut dq, &datt, &q, &att, &lse, dims)),
        2.5 * s.attn_flops(),
        0.0,
        bwd_,
    );
    push(
        "rope bwd",
        time(be, reps, || be.rope_backward(&mut dq, &cos, &sin, dims)),
        0.0,
        b4(2 * n * (s.h + s.kvh) * s.d),
        bwd_,
    );
    push(
        "qkv product bwd",
        time(be, reps, || {
            be.matmul_backward(
                Some(Dinp::Add(&mut dx)),
                Some(&mut dwqkv),
                Some(&mut dbqkv),
                &dq,
                &xn,
                &wqkv,
                n,
                c,
                qkv,
            )
        }),
        bwd(n, c, qkv),
        0.0,
        bwd_,
    );
    // The wmma kernels (the tensor-core set before the mma.sync one), on the same buffers; the
    // fp32 tiled kernels, which run where the tensor-core ones cannot (D not a multiple of 16,
    // or a device before sm_80) or are not wanted; then the warp-per-row kernels, which run
    // where neither can (here: buffers offset by one element, so not 16-byte aligned), on the
    // same inputs.
    for (kernels, [forward, backward]) in [
        (AttentionKernels::Wmma, ["attention wmma", "attention bwd wmma"]),
        (AttentionKernels::Fp32, ["attention fp32 tiled", "attention bwd fp32 tiled"]),
    ] {
        be.set_attention_kernels(kernels);
        let t = time(be, reps, || be.attention_forward(&mut att, &mut lse, &q, dims));
        push(forward, t, s.attn_flops(), 0.0, reference);
        let t = time(be, reps, || be.attention_backward(&mut dq, &datt, &q, &att, &lse, dims));
        push(backward, t, 2.5 * s.attn_flops(), 0.0, reference);
    }
    let off = |m: &CudaMem<f32>, len: usize| {
        let mut o = be.alloc(len + 1);
        be.copy(o.slice_mut(1..len + 1), m);
        o
    };
    let (q1, mut att1, mut lse1) =
        (off(&q, n * qkv), be.alloc(n * hd + 1), be.alloc(s.b * s.h * s.t + 1));
    let (datt1, mut dq1) = (off(&datt, n * hd), be.alloc(n * qkv + 1));
    let lse_len = s.b * s.h * s.t;
    push(
        "attention rowwise",
        time(be, reps, || {
            be.attention_forward(
                att1.slice_mut(1..n * hd + 1),
                lse1.slice_mut(1..lse_len + 1),
                q1.slice(1..n * qkv + 1),
                dims,
            )
        }),
        s.attn_flops(),
        0.0,
        reference,
    );
    push(
        "attention bwd rowwise",
        time(be, reps, || {
            be.attention_backward(
                dq1.slice_mut(1..n * qkv + 1),
                datt1.slice(1..n * hd + 1),
                q1.slice(1..n * qkv + 1),
                att1.slice(1..n * hd + 1),
                lse1.slice(1..lse_len + 1),
                dims,
            )
        }),
        2.5 * s.attn_flops(),
        0.0,
        reference,
    );
    be.set_attention_kernels(AttentionKernels::Tensor);
    push(
        "rmsnorm bwd",
        time(be, reps, || be.rmsnorm_backward(&mut o, Some(&mut dwn), &dx, &x, &wn, &rstd, norm)),
        0.0,
        b4(4 * n * c),
        bwd_,
    );
    rows
}

/// The LM head's ops on one chunk of rows against one vocabulary tile, as the engine's
/// HeadStats (product, statistics) and HeadGrad (product, gradient, two backward products) run
/// them; the chunk's times scaled to the whole step's rows give a tile's.
fn head(be: &CudaBackend, rng: &mut Rng, s: Shape, (vt, chunk): (usize, usize), reps: usize) {
    let c = s.c;
    let chunks = s.n().div_ceil(chunk);
    println!(
        "LM head: a {vt}-row vocabulary tile, chunks of {chunk} rows ({chunks} chunks a tile):"
    );
    let hf = random(be, rng, chunk * c, 1.0);
    let w = weights(be, rng, vt * c);
    let mut logits = be.alloc(chunk * vt);
    let mut stats = be.alloc(chunk * 3);
    let mut targets = be.alloc_i32(chunk);
    let ids: Vec<i32> = (0..chunk).map(|_| rng.below(vt) as i32).collect();
    be.upload_i32(&mut targets, &ids);
    let (mut dhf, mut dw) = (be.alloc(chunk * c), be.alloc(vt * c));
    let fl = 2.0 * (chunk * c * vt) as f64;
    let pass = 4.0 * (chunk * vt) as f64;
    let rows: [(&str, f64, f64, f64); 4] = [
        (
            "logits product",
            time(be, reps, || be.matmul_forward(&mut logits, &hf, &w, None, chunk, c, vt)),
            fl,
            0.0,
        ),
        (
            "tile stats",
            time(be, reps, || {
                be.cross_entropy_tile_stats(&mut stats, &logits, &targets, chunk, vt, 0, true)
            }),
            0.0,
            pass,
        ),
        (
            "tile grad",
            time(be, reps, || {
                be.cross_entropy_tile_grad(&mut logits, &stats, &targets, chunk, vt, 0, 1e-4)
            }),
            0.0,
            2.0 * pass,
        ),
        (
            "head products bwd",
            time(be, reps, || {
                be.matmul_backward(
                    Some(Dinp::Add(&mut dhf)),
                    Some(&mut dw),
                    None,
                    &logits,
                    &hf,
                    &w,
                    chunk,
                    c,
                    vt,
                )
            }),
            2.0 * fl,
            0.0,
        ),
    ];
    println!("{:<22} {:>10} {:>10} {:>9} {:>12}", "op", "ms/chunk", "TFLOP/s", "GB/s", "ms/tile");
    for (name, t, flops, bytes) in rows {
        let tf = if flops > 0.0 { format!("{:.1}", flops / t * 1e-12) } else { "-".into() };
        let gb = if bytes > 0.0 { format!("{:.0}", bytes / t * 1e-9) } else { "-".into() };
        println!("{name:<22} {:>10.3} {tf:>10} {gb:>9} {:>12.3}", t * 1e3, t * 1e3 * chunks as f64);
    }
}

fn report(rows: &[Row]) {
    let total: f64 = rows.iter().filter(|r| r.part != Part::Reference).map(|r| r.ms).sum();
    println!("{:<22} {:>10} {:>10} {:>9} {:>7}", "op", "ms", "TFLOP/s", "GB/s", "share");
    for r in rows {
        let tf = if r.flops > 0.0 { format!("{:.1}", r.flops / r.ms * 1e-9) } else { "-".into() };
        let gb = if r.bytes > 0.0 { format!("{:.0}", r.bytes / r.ms * 1e-6) } else { "-".into() };
        let share = if r.part == Part::Reference {
            "(ref)".to_string()
        } else {
            format!("{:.1}%", 100.0 * r.ms / total)
        };
        println!("{:<22} {:>10.3} {:>10} {:>9} {:>7}", r.name, r.ms, tf, gb, share);
    }
    for (label, which) in [("forward", Part::Forward), ("backward", Part::Backward)] {
        let part: Vec<&Row> = rows.iter().filter(|r| r.part == which).collect();
        let ms: f64 = part.iter().map(|r| r.ms).sum();
        let flops: f64 = part.iter().map(|r| r.flops).sum();
        println!(
            "{label:<22} {ms:>10.3} {:>10.1}   (FLOPs of products and attention over the sum)",
            flops / ms * 1e-9
        );
    }
}
