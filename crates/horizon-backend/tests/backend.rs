//! Checks that `CpuBackend`'s trait methods pass every argument through to the slice functions
//! unchanged (same bits), by driving each op through a generic `B: Backend`.

use horizon_backend::cpu::testing::Rng;
use horizon_backend::cpu::*;
use horizon_backend::{AttnDims, Backend, CpuBackend, Dinp, NormDims};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// One small step of every op through the trait: returns every output, concatenated.
fn step<B: Backend<Buf = [f32], IBuf = [i32], WBuf = [f32]>>(be: &B, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let dims = AttnDims::new(2, 5, 4, 2, 4);
    let (n, c, v, f) = (dims.n(), 12, 11, 10);
    let mut all = Vec::new();

    let ids: Vec<i32> = (0..n).map(|_| rng.below(v) as i32).collect();
    let table = rng.vec(v * c, 1.0);
    let mut x = vec![0.0; n * c];
    be.embedding_forward(&mut x, &ids, &table, c);
    let mut dtable = vec![0.0; v * c];
    be.embedding_backward(&mut dtable, &ids, &x, c);
    all.extend(&x);
    all.extend(&dtable);

    let w = rng.vec(c, 1.0);
    let (mut y, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    be.rmsnorm_forward(&mut y, &mut rstd, &x, &w, NormDims::new(c, 1e-5));
    let (mut dx, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
    be.rmsnorm_backward(&mut dx, Some(&mut dw), &y, &x, &w, &rstd, NormDims::new(c, 0.0));
    all.extend(y.iter().chain(&rstd).chain(&dx).chain(&dw));

    let width = dims.qkv_width();
    let wq = rng.vec(width * c, 0.3);
    let bq = rng.vec(width, 0.3);
    let mut qkv = vec![0.0; n * width];
    be.matmul_forward(&mut qkv, &y, &wq, Some(&bq), n, c, width);
    let (mut dy, mut dwq, mut dbq) = (vec![0.0; n * c], vec![0.0; width * c], vec![0.0; width]);
    be.matmul_backward(
        Some(Dinp::Write(&mut dy)),
        Some(&mut dwq),
        Some(&mut dbq),
        &qkv,
        &y,
        &wq,
        n,
        c,
        width,
    );
    all.extend(qkv.iter().chain(&dy).chain(&dwq).chain(&dbq));

    let cos = rng.vec(dims.t * dims.d / 2, 1.0);
    let sin = rng.vec(dims.t * dims.d / 2, 1.0);
    be.rope_forward(&mut qkv, &cos, &sin, dims);
    let (mut att, mut lse) = (vec![0.0; n * dims.h * dims.d], vec![0.0; dims.b * dims.h * dims.t]);
    be.attention_forward(&mut att, &mut lse, &qkv, dims);
    let mut dqkv = vec![0.0; qkv.len()];
    be.attention_backward(&mut dqkv, &att, &qkv, &att, &lse, dims);
    be.rope_backward(&mut dqkv, &cos, &sin, dims);
    all.extend(qkv.iter().chain(&att).chain(&lse).chain(&dqkv));

    let gemma = NormDims { w_offset: 1.0, ..NormDims::new(dims.d, 1e-6) };
    let hw = rng.vec(2 * dims.d, 1.0);
    let (mut hq, mut hrstd) = (vec![0.0; qkv.len()], vec![0.0; n * (dims.h + dims.kvh)]);
    be.head_rmsnorm_forward(&mut hq, &mut hrstd, &qkv, &hw, dims, gemma);
    let (mut dhq, mut dhw) = (vec![0.0; qkv.len()], vec![0.0; 2 * dims.d]);
    be.head_rmsnorm_backward(&mut dhq, Some(&mut dhw), &dqkv, &qkv, &hw, &hrstd, dims, gemma);
    all.extend(hq.iter().chain(&hrstd).chain(&dhq).chain(&dhw));

    let local = AttnDims { window: 2, scale: 0.3, ..dims };
    be.attention_forward(&mut att, &mut lse, &hq, local);
    be.attention_backward(&mut dqkv, &att, &hq, &att, &lse, local);
    all.extend(att.iter().chain(&lse).chain(&dqkv));

    let (mut gy, mut grstd) = (vec![0.0; n * c], vec![0.0; n]);
    be.rmsnorm_forward(
        &mut gy,
        &mut grstd,
        &x,
        &w,
        NormDims { w_offset: 1.0, ..NormDims::new(c, 1e-6) },
    );
    let (mut gdx, mut gdw) = (vec![0.0; n * c], vec![0.0; c]);
    be.rmsnorm_backward(
        &mut gdx,
        Some(&mut gdw),
        &gy,
        &x,
        &w,
        &grstd,
        NormDims { w_offset: 1.0, ..NormDims::new(c, 0.0) },
    );
    all.extend(gy.iter().chain(&grstd).chain(&gdx).chain(&gdw));

    let gu = rng.vec(n * 2 * f, 2.0);
    let mut h = vec![0.0; n * f];
    be.swiglu_forward(&mut h, &gu, n, f);
    let mut dgu = vec![0.0; gu.len()];
    be.swiglu_backward(&mut dgu, &h, &gu, n, f);
    all.extend(h.iter().chain(&dgu));

    be.geglu_forward(&mut h, &gu, n, f);
    be.geglu_backward(&mut dgu, &h, &gu, n, f);
    all.extend(h.iter().chain(&dgu));

    let mut r = vec![0.0; n * c];
    be.residual_forward(&mut r, &x, &y);
    be.add_inplace(&mut r, &dx);
    all.extend(&r);

    let logits = rng.vec(n * v, 3.0);
    let targets: Vec<i32> =
        (0..n).map(|i| if i % 4 == 1 { -100 } else { (i % v) as i32 }).collect();
    let mut losses = vec![0.0; n];
    be.cross_entropy_forward(&mut losses, &logits, &targets, n, v);
    all.extend(&losses);
    let mut dl = logits.clone();
    be.cross_entropy_fused(&mut dl, &mut losses, &targets, n, v, 0.1);
    all.extend(dl.iter().chain(&losses));

    let mut dev = vec![0.0; all.len()];
    be.upload(&mut dev, &all);
    let mut copy = vec![1.0; all.len()];
    be.copy(&mut copy, &dev);
    let mut host = vec![0.0; all.len()];
    be.download(&mut host, &copy);
    let mut ids_dev = vec![0; ids.len()];
    be.upload_i32(&mut ids_dev, &ids);
    assert_eq!(ids_dev, ids);
    let mut z = vec![1.0; 5];
    be.zero(&mut z);
    assert_eq!(z, [0.0; 5]);
    // Above the parallel threshold, with a ragged last chunk.
    let mut z = vec![1.0f32; (1 << 17) + 3];
    be.zero(&mut z);
    assert!(z.iter().all(|&x| x == 0.0));
    host
}

/// The same step calling the slice functions directly.
fn step_direct(seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let dims = AttnDims::new(2, 5, 4, 2, 4);
    let (n, c, v, f) = (dims.n(), 12, 11, 10);
    let mut all = Vec::new();

    let ids: Vec<i32> = (0..n).map(|_| rng.below(v) as i32).collect();
    let table = rng.vec(v * c, 1.0);
    let mut x = vec![0.0; n * c];
    embedding_forward(&mut x, &ids, &table, c);
    let mut dtable = vec![0.0; v * c];
    embedding_backward(&mut dtable, &ids, &x, c);
    all.extend(&x);
    all.extend(&dtable);

    let w = rng.vec(c, 1.0);
    let (mut y, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut y, &mut rstd, &x, &w, NormDims::new(c, 1e-5));
    let (mut dx, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
    rmsnorm_backward(&mut dx, Some(&mut dw), &y, &x, &w, &rstd, NormDims::new(c, 0.0));
    all.extend(y.iter().chain(&rstd).chain(&dx).chain(&dw));

    let width = dims.qkv_width();
    let wq = rng.vec(width * c, 0.3);
    let bq = rng.vec(width, 0.3);
    let mut qkv = vec![0.0; n * width];
    matmul_forward(&mut qkv, &y, &wq, Some(&bq), n, c, width);
    let (mut dy, mut dwq, mut dbq) = (vec![0.0; n * c], vec![0.0; width * c], vec![0.0; width]);
    matmul_backward(
        Some(Dinp::Write(&mut dy)),
        Some(&mut dwq),
        Some(&mut dbq),
        &qkv,
        &y,
        &wq,
        n,
        c,
        width,
    );
    all.extend(qkv.iter().chain(&dy).chain(&dwq).chain(&dbq));

    let cos = rng.vec(dims.t * dims.d / 2, 1.0);
    let sin = rng.vec(dims.t * dims.d / 2, 1.0);
    rope_forward(&mut qkv, &cos, &sin, dims);
    let (mut att, mut lse) = (vec![0.0; n * dims.h * dims.d], vec![0.0; dims.b * dims.h * dims.t]);
    attention_forward(&mut att, &mut lse, &qkv, dims);
    let mut dqkv = vec![0.0; qkv.len()];
    attention_backward(&mut dqkv, &att, &qkv, &att, &lse, dims);
    rope_backward(&mut dqkv, &cos, &sin, dims);
    all.extend(qkv.iter().chain(&att).chain(&lse).chain(&dqkv));

    let gemma = NormDims { w_offset: 1.0, ..NormDims::new(dims.d, 1e-6) };
    let hw = rng.vec(2 * dims.d, 1.0);
    let (mut hq, mut hrstd) = (vec![0.0; qkv.len()], vec![0.0; n * (dims.h + dims.kvh)]);
    head_rmsnorm_forward(&mut hq, &mut hrstd, &qkv, &hw, dims, gemma);
    let (mut dhq, mut dhw) = (vec![0.0; qkv.len()], vec![0.0; 2 * dims.d]);
    head_rmsnorm_backward(&mut dhq, Some(&mut dhw), &dqkv, &qkv, &hw, &hrstd, dims, gemma);
    all.extend(hq.iter().chain(&hrstd).chain(&dhq).chain(&dhw));

    let local = AttnDims { window: 2, scale: 0.3, ..dims };
    attention_forward(&mut att, &mut lse, &hq, local);
    attention_backward(&mut dqkv, &att, &hq, &att, &lse, local);
    all.extend(att.iter().chain(&lse).chain(&dqkv));

    let (mut gy, mut grstd) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(
        &mut gy,
        &mut grstd,
        &x,
        &w,
        NormDims { w_offset: 1.0, ..NormDims::new(c, 1e-6) },
    );
    let (mut gdx, mut gdw) = (vec![0.0; n * c], vec![0.0; c]);
    rmsnorm_backward(
        &mut gdx,
        Some(&mut gdw),
        &gy,
        &x,
        &w,
        &grstd,
        NormDims { w_offset: 1.0, ..NormDims::new(c, 0.0) },
    );
    all.extend(gy.iter().chain(&grstd).chain(&gdx).chain(&gdw));

    let gu = rng.vec(n * 2 * f, 2.0);
    let mut h = vec![0.0; n * f];
    swiglu_forward(&mut h, &gu, n, f);
    let mut dgu = vec![0.0; gu.len()];
    swiglu_backward(&mut dgu, &h, &gu, n, f);
    all.extend(h.iter().chain(&dgu));

    geglu_forward(&mut h, &gu, n, f);
    geglu_backward(&mut dgu, &h, &gu, n, f);
    all.extend(h.iter().chain(&dgu));

    let mut r = vec![0.0; n * c];
    residual_forward(&mut r, &x, &y);
    add_inplace(&mut r, &dx);
    all.extend(&r);

    let logits = rng.vec(n * v, 3.0);
    let targets: Vec<i32> =
        (0..n).map(|i| if i % 4 == 1 { -100 } else { (i % v) as i32 }).collect();
    let mut losses = vec![0.0; n];
    cross_entropy_forward(&mut losses, &logits, &targets, n, v);
    all.extend(&losses);
    let mut dl = logits.clone();
    cross_entropy_fused(&mut dl, &mut losses, &targets, n, v, 0.1);
    all.extend(dl.iter().chain(&losses));
    all
}

#[test]
fn trait_methods_match_slice_functions() {
    let be = CpuBackend::new();
    assert_eq!(be.name(), "cpu");
    let via_trait = step(&be, 42);
    let direct = step_direct(42);
    assert!(via_trait.iter().all(|x| x.is_finite()));
    assert_eq!(bits(&via_trait), bits(&direct));
    let _default: CpuBackend = Default::default();
}
