//! Determinism: every op gives bit-identical results on a 1-thread and a 3-thread rayon pool,
//! at shapes large enough that the parallel ops split into several tasks.

use horizon_backend::cpu::testing::Rng;
use horizon_backend::cpu::*;
use horizon_backend::{AttnDims, Dinp, NormDims};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `f` on a fresh rayon pool of `threads` threads.
fn on_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("build rayon pool")
        .install(f)
}

/// Runs every op forward and backward once; returns all outputs, concatenated.
fn all_ops() -> Vec<f32> {
    let mut rng = Rng::new(99);
    let mut all = Vec::new();

    // matmul across tiles: 3 row tiles, 3 dweight blocks, 2 column tiles.
    let (n, ic, oc) = (67, 70, 45);
    let inp = rng.vec(n * ic, 1.0);
    let w = rng.vec(oc * ic, 0.2);
    let b = rng.vec(oc, 1.0);
    let mut out = vec![0.0; n * oc];
    matmul_forward(&mut out, &inp, &w, Some(&b), n, ic, oc);
    let (mut dinp, mut dw, mut db) = (vec![0.0; n * ic], vec![0.5; oc * ic], vec![0.5; oc]);
    matmul_backward(
        Some(Dinp::Write(&mut dinp)),
        Some(&mut dw),
        Some(&mut db),
        &out,
        &inp,
        &w,
        n,
        ic,
        oc,
    );
    all.extend(out.iter().chain(&dinp).chain(&dw).chain(&db));

    // rmsnorm with several dweight column tiles.
    let c = 130;
    let x = rng.vec(n * c, 2.0);
    let g = rng.vec(c, 1.0);
    let (mut y, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut y, &mut rstd, &x, &g, NormDims::new(c, 1e-5));
    let (mut dx, mut dg) = (vec![0.25; n * c], vec![0.25; c]);
    rmsnorm_backward(&mut dx, Some(&mut dg), &y, &x, &g, &rstd, NormDims::new(c, 1e-5));
    all.extend(y.iter().chain(&rstd).chain(&dx).chain(&dg));

    // rmsnorm with Gemma's (1 + w).
    let gemma = NormDims { w_offset: 1.0, ..NormDims::new(c, 1e-6) };
    let (mut gy, mut grstd) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut gy, &mut grstd, &x, &g, gemma);
    let (mut gdx, mut gdg) = (vec![0.25; n * c], vec![0.25; c]);
    rmsnorm_backward(&mut gdx, Some(&mut gdg), &y, &x, &g, &grstd, gemma);
    all.extend(gy.iter().chain(&grstd).chain(&gdx).chain(&gdg));

    // embedding with repeated ids.
    let v = 13;
    let ids: Vec<i32> = (0..n).map(|_| rng.below(v) as i32).collect();
    let table = rng.vec(v * c, 1.0);
    let mut e = vec![0.0; n * c];
    embedding_forward(&mut e, &ids, &table, c);
    let mut dtable = vec![0.0; v * c];
    embedding_backward(&mut dtable, &ids, &x, c);
    all.extend(e.iter().chain(&dtable));

    // rope + attention: GQA, 2 batches x 2 kv heads in the backward, 8 (b, h) pairs forward.
    let dims = AttnDims::new(2, 33, 4, 2, 8);
    let mut qkv = rng.vec(dims.n() * dims.qkv_width(), 1.5);
    let cos = rng.vec(dims.t * dims.d / 2, 1.0);
    let sin = rng.vec(dims.t * dims.d / 2, 1.0);
    rope_forward(&mut qkv, &cos, &sin, dims);
    let mut att = vec![0.0; dims.n() * dims.h * dims.d];
    let mut lse = vec![0.0; dims.b * dims.h * dims.t];
    attention_forward(&mut att, &mut lse, &qkv, dims);
    let datt = rng.vec(att.len(), 1.0);
    let mut dqkv = vec![0.0; qkv.len()];
    attention_backward(&mut dqkv, &datt, &qkv, &att, &lse, dims);
    rope_backward(&mut dqkv, &cos, &sin, dims);
    all.extend(qkv.iter().chain(&att).chain(&lse).chain(&dqkv));

    // windowed attention with another scale: T = 150 over three query blocks, the later ones
    // starting their key range inside the sequence.
    let dims = AttnDims { window: 40, scale: 0.3, ..AttnDims::new(2, 150, 4, 2, 8) };
    let wqkv = rng.vec(dims.n() * dims.qkv_width(), 1.5);
    let mut watt = vec![0.0; dims.n() * dims.h * dims.d];
    let mut wlse = vec![0.0; dims.b * dims.h * dims.t];
    attention_forward(&mut watt, &mut wlse, &wqkv, dims);
    let dwatt = rng.vec(watt.len(), 1.0);
    let mut dwqkv = vec![0.0; wqkv.len()];
    attention_backward(&mut dwqkv, &dwatt, &wqkv, &watt, &wlse, dims);
    all.extend(watt.iter().chain(&wlse).chain(&dwqkv));

    // head_rmsnorm (Gemma 3's (1 + w)) on the windowed attention's qkv: 300 rows, D = 8.
    let hnorm = NormDims { w_offset: 1.0, ..NormDims::new(dims.d, 1e-6) };
    let hw = rng.vec(2 * dims.d, 1.0);
    let (mut hq, mut hrstd) = (vec![0.0; wqkv.len()], vec![0.0; dims.n() * (dims.h + dims.kvh)]);
    head_rmsnorm_forward(&mut hq, &mut hrstd, &wqkv, &hw, dims, hnorm);
    let (mut dhq, mut dhw) = (vec![0.0; wqkv.len()], vec![0.5; 2 * dims.d]);
    head_rmsnorm_backward(&mut dhq, Some(&mut dhw), &dwqkv, &wqkv, &hw, &hrstd, dims, hnorm);
    all.extend(hq.iter().chain(&hrstd).chain(&dhq).chain(&dhw));

    // head_rmsnorm with several dweight column tiles per half (D = 40).
    let dims = AttnDims::new(2, 40, 4, 2, 40);
    let hnorm = NormDims::new(dims.d, 1e-6);
    let hx = rng.vec(dims.n() * dims.qkv_width(), 2.0);
    let hw = rng.vec(2 * dims.d, 1.0);
    let (mut hq, mut hrstd) = (vec![0.0; hx.len()], vec![0.0; dims.n() * (dims.h + dims.kvh)]);
    head_rmsnorm_forward(&mut hq, &mut hrstd, &hx, &hw, dims, hnorm);
    let (mut dhq, mut dhw) = (vec![0.0; hx.len()], vec![0.5; 2 * dims.d]);
    head_rmsnorm_backward(&mut dhq, Some(&mut dhw), &hx, &hx, &hw, &hrstd, dims, hnorm);
    all.extend(hq.iter().chain(&hrstd).chain(&dhq).chain(&dhw));

    // swiglu
    let f = 45;
    let gu = rng.vec(n * 2 * f, 3.0);
    let mut h = vec![0.0; n * f];
    swiglu_forward(&mut h, &gu, n, f);
    let mut dgu = vec![0.0; gu.len()];
    swiglu_backward(&mut dgu, &h, &gu, n, f);
    all.extend(h.iter().chain(&dgu));

    // geglu
    let mut gh = vec![0.0; n * f];
    geglu_forward(&mut gh, &gu, n, f);
    let mut dggu = vec![0.0; gu.len()];
    geglu_backward(&mut dggu, &gh, &gu, n, f);
    all.extend(gh.iter().chain(&dggu));

    // sigmoid gate (the shared expert's): one row sum per row.
    let sg = rng.vec(n, 4.0);
    let mut sy = vec![0.0; n * f];
    sigmoid_gate_forward(&mut sy, &sg, &h, f);
    let (mut dsx, mut dsg) = (vec![0.0; n * f], vec![0.0; n]);
    sigmoid_gate_backward(&mut dsx, &mut dsg, &gh, &sg, &h, f);
    all.extend(sy.iter().chain(&dsx).chain(&dsg));

    // cross-entropy
    let vocab = 301;
    let logits = rng.vec(n * vocab, 4.0);
    let targets: Vec<i32> =
        (0..n).map(|i| if i % 5 == 0 { -100 } else { rng.below(vocab) as i32 }).collect();
    let mut losses = vec![0.0; n];
    cross_entropy_forward(&mut losses, &logits, &targets, n, vocab);
    all.extend(&losses);
    let mut dl = logits.clone();
    cross_entropy_fused(&mut dl, &mut losses, &targets, n, vocab, 1.0 / 50.0);
    all.extend(dl.iter().chain(&losses));

    // residual
    let mut r = vec![0.0; y.len()];
    residual_forward(&mut r, &x, &y);
    add_inplace(&mut r, &dx);
    all.extend(&r);
    all
}

#[test]
fn every_op_is_bit_identical_on_1_and_3_threads() {
    let one = on_pool(1, all_ops);
    let three = on_pool(3, all_ops);
    assert!(one.iter().all(|x| x.is_finite()));
    assert_eq!(bits(&one), bits(&three), "results depend on the number of rayon threads");
}
