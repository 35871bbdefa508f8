//! Runs a described layer ([`LayerSpec`]) on any backend: its forward ops in order, then its
//! derived backward program. The reference path and the streaming engine both call these two
//! functions; the description decides every buffer an op touches.
//!
//! Activations are passed as [`Slot`]s: slot `X` (the layer input) read-only, `Y` (the output)
//! and the layer's own buffers writable, each viewed at `(N, width)`.

use std::ops::Range;

use horizon_backend::{Backend, DeviceSlice, Dinp, NormDims};

use crate::model::spec::{Act, BwdOp, Glu, LayerSpec, Op};

/// One activation or gradient buffer handed to a layer: read-only or writable.
pub enum Slot<'a, T: ?Sized> {
    R(&'a T),
    W(&'a mut T),
}

impl<T: ?Sized + DeviceSlice> Slot<'_, T> {
    /// The first `len` elements.
    fn r(&self, len: usize) -> &T {
        match self {
            Slot::R(x) => x.slice(0..len),
            Slot::W(x) => x.slice(0..len),
        }
    }

    /// The first `len` elements, writable. A read-only slot here is a bug in the description
    /// (`LayerBuilder::finish` refuses an op that writes the layer input).
    fn w(&mut self, len: usize) -> &mut T {
        match self {
            Slot::W(x) => x.slice_mut(0..len),
            Slot::R(_) => panic!("a layer op writes a read-only buffer"),
        }
    }
}

/// Distinct slots, each exclusively.
fn pick<'s, 'a, T: ?Sized, const K: usize>(
    slots: &'s mut [Slot<'a, T>],
    idx: [usize; K],
) -> [&'s mut Slot<'a, T>; K] {
    slots.get_disjoint_mut(idx).expect("an op's buffers are distinct slots")
}

/// Two disjoint ranges of one buffer (a weight's and its bias's gradients), in either order.
fn two_mut<T: ?Sized + DeviceSlice>(
    buf: &mut T,
    a: Range<usize>,
    b: Option<Range<usize>>,
) -> (&mut T, Option<&mut T>) {
    match b {
        None => (buf.slice_mut(a), None),
        Some(b) if a.end <= b.start => {
            let (lo, hi) = buf.split_at_mut(b.start);
            (lo.slice_mut(a), Some(hi.slice_mut(0..b.len())))
        }
        Some(b) => {
            assert!(b.end <= a.start, "weight and bias ranges overlap");
            let (lo, hi) = buf.split_at_mut(a.start);
            (hi.slice_mut(0..a.len()), Some(lo.slice_mut(b)))
        }
    }
}

/// Sizes of one pass: `b` sequences of `t` positions.
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    pub b: usize,
    pub t: usize,
}

/// One decoder layer forward: `slots[X] -> slots[Y]`, keeping every activation the backward
/// reads in the layer's own slots. `ropes[k]` is rope table k's (cos, sin), (T, D/2).
pub fn layer_forward<B: Backend>(
    be: &B,
    spec: &LayerSpec,
    slots: &mut [Slot<'_, B::Buf>],
    w: &B::WBuf,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
) {
    forward_ops(be, spec, slots, w, ropes, rows, None);
}

/// A layer's KV cache in a decode step: every position's fused q|k|v row so far and the
/// position of the step's first new row.
pub struct KvStep<'a, T: ?Sized> {
    /// (T_max, QKV): rows `0..pos` hold the earlier positions' rows after rope.
    pub cache: &'a mut T,
    /// Positions already in the cache.
    pub pos: usize,
}

/// One decoder layer forward over the `rows.t` new positions `pos..pos + t` of one sequence
/// (`rows.b == 1`), with the layer's KV cache: the ops of [`layer_forward`], except that the
/// attention first appends the new rows' q|k|v (after rope) to the cache, then attends from
/// them over cache rows `0..pos + t` ([`Backend::attention_decode`]; its `lse` slot is not
/// written). Every other op is row by row. `ropes[k]` must be viewed at the new positions:
/// (t, D/2) from row `pos`.
pub fn layer_forward_cached<B: Backend>(
    be: &B,
    spec: &LayerSpec,
    slots: &mut [Slot<'_, B::Buf>],
    w: &B::WBuf,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
    kv: KvStep<'_, B::Buf>,
) {
    assert_eq!(rows.b, 1, "a KV cache holds one sequence");
    forward_ops(be, spec, slots, w, ropes, rows, Some(kv));
}

/// The forward ops of a layer, attention over `kv`'s cache when given.
fn forward_ops<B: Backend>(
    be: &B,
    spec: &LayerSpec,
    slots: &mut [Slot<'_, B::Buf>],
    w: &B::WBuf,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
    mut kv: Option<KvStep<'_, B::Buf>>,
) {
    let n = rows.b * rows.t;
    let len = |a: Act| n * spec.width(a);
    let ad = spec.attn.dims(rows.b, rows.t);
    let norm = |w_offset: f32, c: usize| NormDims { c, eps: spec.eps, w_offset };
    for op in &spec.ops {
        match *op {
            Op::RmsNorm { inp, out, rstd, w: ref r, w_offset } => {
                let [i, o, s] = pick(slots, [inp, out, rstd]);
                let nd = norm(w_offset, spec.c);

                be.rmsnorm_forward(o.w(len(out)), s.w(n), i.r(len(inp)), w.slice(r.clone()), nd);
            }
            Op::HeadNorm { inp, out, rstd, w: ref r, w_offset } => {
                let [i, o, s] = pick(slots, [inp, out, rstd]);
                let nd = norm(w_offset, ad.d);
                let rs = s.w(len(rstd));
                be.head_rmsnorm_forward(
                    o.w(len(out)),
                    rs,
                    i.r(len(inp)),
                    w.slice(r.clone()),
                    ad,
                    nd,
                );
            }
            Op::Linear { inp, out, w: ref r, ref bias, ic, oc } => {
                let [i, o] = pick(slots, [inp, out]);
                let bias = bias.clone().map(|b| w.slice(b));
                be.matmul_forward(o.w(n * oc), i.r(n * ic), w.slice(r.clone()), bias, n, ic, oc);
            }
            Op::Rope { qkv, table } => {
                let [q] = pick(slots, [qkv]);
                let (cos, sin) = ropes[table];
                be.rope_forward(q.w(len(qkv)), cos, sin, ad);
            }
            Op::Attention { qkv, out, lse } => match kv.as_mut() {
                None => {
                    let [q, o, l] = pick(slots, [qkv, out, lse]);
                    be.attention_forward(o.w(len(out)), l.w(len(lse)), q.r(len(qkv)), ad);
                }
                Some(KvStep { cache, pos }) => {
                    let [q, o] = pick(slots, [qkv, out]);
                    let (width, total) = (spec.width(qkv), *pos + n);
                    be.copy(cache.slice_mut(*pos * width..total * width), q.r(len(qkv)));
                    let cd = spec.attn.dims(1, total);
                    be.attention_decode(o.w(len(out)), cache.slice(0..total * width), n, cd);
                }
            },
            Op::Add { a, b, out } => {
                let [x, y, o] = pick(slots, [a, b, out]);
                be.residual_forward(o.w(len(out)), x.r(len(a)), y.r(len(b)));
            }
            Op::Glu { gu, out, act, f } => {
                let [g, o] = pick(slots, [gu, out]);
                match act {
                    Glu::Silu => be.swiglu_forward(o.w(n * f), g.r(n * 2 * f), n, f),
                    Glu::GeluTanh => be.geglu_forward(o.w(n * f), g.r(n * 2 * f), n, f),
                }
            }
        }
    }
}

/// One decoder layer backward, the description's derived program. On entry `grads[DRES]`
/// holds dL/dY; on return it holds dL/dX (overwritten). Parameter gradients accumulate (+=)
/// into `dw` (the layer's len). `acts` are the forward's slots (X and the layer's own).
#[allow(clippy::too_many_arguments)]
pub fn layer_backward<B: Backend>(
    be: &B,
    spec: &LayerSpec,
    grads: &mut [Slot<'_, B::Buf>],
    dw: &mut B::Buf,
    acts: &[Slot<'_, B::Buf>],
    w: &B::WBuf,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
) {
    let n = rows.b * rows.t;
    let len = |a: Act| n * spec.width(a);
    let act = |a: Act| acts[a].r(len(a));
    let ad = spec.attn.dims(rows.b, rows.t);
    for step in &spec.backward {
        match *step {
            BwdOp::Copy { dst, src, width } => {
                let [d, s] = pick(grads, [dst, src]);
                be.copy(d.w(n * width), s.r(n * width));
            }
            BwdOp::Accumulate { dst, src, width } => {
                let [d, s] = pick(grads, [dst, src]);
                be.add_inplace(d.w(n * width), s.r(n * width));
            }
            BwdOp::Zero { dst, width } => be.zero(grads[dst].w(n * width)),
            BwdOp::RmsNorm { op, dinp, dout } => {
                let Op::RmsNorm { inp, rstd, w: ref r, w_offset, .. } = spec.ops[op] else {
                    unreachable!("the program names its op")
                };
                let [gi, go] = pick(grads, [dinp, dout]);
                let nd = NormDims { c: spec.c, eps: spec.eps, w_offset };
                let (dwr, wr) = (dw.slice_mut(r.clone()), w.slice(r.clone()));
                be.rmsnorm_backward(
                    gi.w(len(inp)),
                    Some(dwr),
                    go.r(len(inp)),
                    act(inp),
                    wr,
                    act(rstd),
                    nd,
                );
            }
            BwdOp::HeadNorm { op, dinp, dout } => {
                let Op::HeadNorm { inp, rstd, w: ref r, w_offset, .. } = spec.ops[op] else {
                    unreachable!("the program names its op")
                };
                let [gi, go] = pick(grads, [dinp, dout]);
                let nd = NormDims { c: ad.d, eps: spec.eps, w_offset };
                let (dwr, wr) = (dw.slice_mut(r.clone()), w.slice(r.clone()));
                let (gi, go) = (gi.w(len(inp)), go.r(len(inp)));
                be.head_rmsnorm_backward(gi, Some(dwr), go, act(inp), wr, act(rstd), ad, nd);
            }
            BwdOp::Linear { op, dinp, dout } => {
                let Op::Linear { inp, w: ref r, ref bias, ic, oc, .. } = spec.ops[op] else {
                    unreachable!("the program names its op")
                };
                let [gi, go] = pick(grads, [dinp, dout]);
                let (dweight, dbias) = two_mut(dw, r.clone(), bias.clone());
                let (gi, go) = (gi.w(n * ic), go.r(n * oc));
                be.matmul_backward(
                    Some(Dinp::Write(gi)),
                    Some(dweight),
                    dbias,
                    go,
                    act(inp),
                    w.slice(r.clone()),
                    n,
                    ic,
                    oc,
                );
            }
            BwdOp::Rope { op, dqkv } => {
                let Op::Rope { qkv, table } = spec.ops[op] else {
                    unreachable!("the program names its op")
                };
                let (cos, sin) = ropes[table];
                be.rope_backward(grads[dqkv].w(len(qkv)), cos, sin, ad);
            }
            BwdOp::Attention { op, dqkv, dout } => {
                let Op::Attention { qkv, out, lse } = spec.ops[op] else {
                    unreachable!("the program names its op")
                };
                let [gq, go] = pick(grads, [dqkv, dout]);
                be.attention_backward(
                    gq.w(len(qkv)),
                    go.r(len(out)),
                    act(qkv),
                    act(out),
                    act(lse),
                    ad,
                );
            }
            BwdOp::Glu { op, dgu, dout } => {
                let Op::Glu { gu, act: kind, f, .. } = spec.ops[op] else {
                    unreachable!("the program names its op")
                };
                let [gg, go] = pick(grads, [dgu, dout]);
                let (gg, go) = (gg.w(n * 2 * f), go.r(n * f));
                match kind {
                    Glu::Silu => be.swiglu_backward(gg, go, act(gu), n, f),
                    Glu::GeluTanh => be.geglu_backward(gg, go, act(gu), n, f),
                }
            }
        }
    }
}

/// Gradient slots for `grads` buffers: the residual gradient first.
pub fn grad_slots<'a, T: ?Sized>(
    dres: &'a mut T,
    rest: impl Iterator<Item = &'a mut T>,
) -> Vec<Slot<'a, T>> {
    std::iter::once(Slot::W(dres)).chain(rest.map(Slot::W)).collect()
}

/// Activation slots: the input, the output, then the layer's own buffers.
pub fn act_slots<'a, T: ?Sized>(
    x: &'a T,
    y: Slot<'a, T>,
    own: impl Iterator<Item = &'a mut T>,
) -> Vec<Slot<'a, T>> {
    [Slot::R(x), y].into_iter().chain(own.map(Slot::W)).collect()
}

#[cfg(test)]
mod tests {
    //! Every described layer against finite differences: the derived backward program is
    //! checked as a whole (the ops are checked one by one in the backend's tests).
    use horizon_backend::CpuBackend;

    use super::*;
    use crate::hf::config::ModelConfig;
    use crate::model::layout::ModelLayout;
    use crate::model::spec::{AttnSpec, Init, LayerBuilder, X, Y};
    use crate::model::transformer::rope_tables;
    use crate::rng::SplitMix64;

    const ROWS: Rows = Rows { b: 2, t: 5 };

    /// Loss `sum(Y * r)` of one forward, in f64.
    fn loss(
        spec: &LayerSpec,
        x: &[f32],
        w: &[f32],
        ropes: &[(Vec<f32>, Vec<f32>)],
        r: &[f32],
    ) -> f64 {
        let n = ROWS.b * ROWS.t;
        let mut y = vec![0.0; n * spec.c];
        let mut own: Vec<Vec<f32>> = spec.acts.iter().map(|a| vec![0.0; n * a.width]).collect();
        let mut slots = act_slots(x, Slot::W(&mut y[..]), own.iter_mut().map(|v| &mut v[..]));
        let views: Vec<(&[f32], &[f32])> = ropes.iter().map(|(c, s)| (&c[..], &s[..])).collect();
        layer_forward(&CpuBackend::new(), spec, &mut slots, w, &views, ROWS);
        y.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum()
    }

    /// (dX, dW) of `sum(Y * r)` through the derived backward program.
    fn grads(
        spec: &LayerSpec,
        x: &[f32],
        w: &[f32],
        ropes: &[(Vec<f32>, Vec<f32>)],
        r: &[f32],
    ) -> (Vec<f32>, Vec<f32>) {
        let (be, n) = (CpuBackend::new(), ROWS.b * ROWS.t);
        let mut y = vec![0.0; n * spec.c];
        let mut own: Vec<Vec<f32>> = spec.acts.iter().map(|a| vec![0.0; n * a.width]).collect();
        let views: Vec<(&[f32], &[f32])> = ropes.iter().map(|(c, s)| (&c[..], &s[..])).collect();
        let mut slots = act_slots(x, Slot::W(&mut y[..]), own.iter_mut().map(|v| &mut v[..]));
        layer_forward(&be, spec, &mut slots, w, &views, ROWS);
        let mut dres = r.to_vec();
        let mut rest: Vec<Vec<f32>> = spec.grads[1..].iter().map(|&g| vec![0.0; n * g]).collect();
        let mut g = grad_slots(&mut dres[..], rest.iter_mut().map(|v| &mut v[..]));
        let mut dw = vec![0.0; spec.len];
        layer_backward(&be, spec, &mut g, &mut dw[..], &slots, w, &views, ROWS);
        drop(g);
        (dres, dw)
    }

    /// Central differences at a few coordinates of X and of every tensor of W.
    fn check(name: &str, spec: &LayerSpec, ropes: &[(Vec<f32>, Vec<f32>)]) {
        let n = ROWS.b * ROWS.t;
        let mut rng = SplitMix64::new(7);
        let mut normal = |len: usize, std: f32| {
            let mut v = vec![0.0; len];
            rng.fill_normal(&mut v, std);
            v
        };
        let (x, r) = (normal(n * spec.c, 1.0), normal(n * spec.c, 1.0));
        let mut w = normal(spec.len, 0.3);
        for t in &spec.tensors {
            if t.init == Init::Ones {
                w[t.range()].iter_mut().for_each(|v| *v += 1.0);
            }
        }
        let (dx, dw) = grads(spec, &x, &w, ropes, &r);
        let fd = |x: &[f32], w: &[f32], which: &str, i: usize| {
            let h = 1e-2f32;
            let (mut xp, mut wp, mut xm, mut wm) = (x.to_vec(), w.to_vec(), x.to_vec(), w.to_vec());
            let (p, m) =
                if which == "x" { (&mut xp[i], &mut xm[i]) } else { (&mut wp[i], &mut wm[i]) };
            *p += h;
            *m -= h;
            (loss(spec, &xp, &wp, ropes, &r) - loss(spec, &xm, &wm, ropes, &r)) / (2.0 * h as f64)
        };
        let scale = dx.iter().chain(&dw).fold(0f32, |a, &b| a.max(b.abs())) as f64;
        let mut at: Vec<(&str, usize, f32)> =
            (0..4).map(|k| ("x", (k * 7919) % x.len(), dx[(k * 7919) % x.len()])).collect();
        for t in &spec.tensors {
            for k in [0, t.numel() / 2, t.numel() - 1] {
                at.push(("w", t.offset + k, dw[t.offset + k]));
            }
        }
        for (which, i, got) in at {
            let want = fd(&x, &w, which, i);
            let err = (got as f64 - want).abs();
            assert!(
                err <= 2e-3 * scale + 2e-2 * want.abs(),
                "{name}: d{which}[{i}] = {got}, finite differences {want} (err {err:.3e}, scale {scale:.3e})"
            );
        }
    }

    fn tables(layout: &ModelLayout) -> Vec<(Vec<f32>, Vec<f32>)> {
        layout.rope.iter().map(|f| rope_tables(f, ROWS.t)).collect()
    }

    /// Each fixture family's layer kinds (Llama with GQA, Qwen2 with biases, Qwen3's q/k norm,
    /// Gemma 3's four `(1 + w)` norms, GeGLU and sliding window).
    #[test]
    fn every_family_layer_matches_finite_differences() {
        for case in ["llama_gqa", "qwen2_tied_padded", "qwen3_qknorm", "gemma3_sliding"] {
            let dir = env!("CARGO_MANIFEST_DIR");
            let path = format!("{dir}/tests/fixtures/{case}/model/config.json");
            let cfg = ModelConfig::from_file(std::path::Path::new(&path)).unwrap();
            let mut layout = ModelLayout::new(&cfg);
            for spec in &mut layout.kinds {
                spec.attn.window = spec.attn.window.min(3);
            }
            let ropes = tables(&layout);
            for spec in &layout.kinds {
                check(&format!("{case} {}", spec.kind), spec, &ropes);
            }
        }
    }

    /// A layer whose input feeds two residual adds: the second contribution to dX accumulates
    /// (`BwdOp::Accumulate`) rather than overwriting the first.
    #[test]
    fn an_input_read_by_two_adds_accumulates_its_gradient() {
        let c = 6;
        let mut b = LayerBuilder::new(c);
        let ln = b.tensor("norm.weight", &[c], Init::Ones);
        let wp = b.tensor("proj.weight", &[c, c], Init::Normal);
        let h = b.rmsnorm(X, ("h", "rstd"), ln, 0.0);
        let p = b.act("p", c);
        b.op(Op::Linear { inp: h, out: p, w: wp, bias: None, ic: c, oc: c });
        let s = b.act("s", c);
        b.op(Op::Add { a: X, b: p, out: s });
        b.op(Op::Add { a: X, b: s, out: Y });
        let attn = AttnSpec { h: 1, kvh: 1, d: c, window: 0, scale: 1.0 };
        let spec = b.finish("double_residual", attn, 1e-6);
        assert!(spec.backward.iter().any(|op| matches!(op, BwdOp::Accumulate { .. })));
        check("double residual", &spec, &[]);
    }
}
