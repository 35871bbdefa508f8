//! Runs a described layer ([`LayerSpec`]) on any backend: its forward ops in order, then its
//! derived backward program. The reference path and the streaming engine both call these two
//! functions; the description decides every buffer an op touches.
//!
//! Activations are passed as [`Slot`]s: slot `X` (the layer input) read-only, `Y` (the output)
//! and the layer's own buffers writable, each viewed at `(N, width)`.

use std::ops::Range;

use horizon_backend::{Backend, DeviceSlice, Dinp, NormDims};

use crate::model::chunks::SlotMap;
use crate::model::moe::{
    ExpertGrads, MoeIo, experts_backward, experts_forward, route_backward, route_forward,
};
use crate::model::spec::{Act, BwdOp, Glu, LayerSpec, Op, Stored, Weight};

/// One activation or gradient buffer handed to a layer: read-only or writable.
pub enum Slot<'a, T: ?Sized> {
    R(&'a T),
    W(&'a mut T),
}

impl<T: ?Sized + DeviceSlice> Slot<'_, T> {
    /// The first `len` elements.
    pub(crate) fn r(&self, len: usize) -> &T {
        match self {
            Slot::R(x) => x.slice(0..len),
            Slot::W(x) => x.slice(0..len),
        }
    }

    /// The whole buffer, writable.
    pub(crate) fn whole(&mut self) -> &mut T {
        match self {
            Slot::W(x) => x,
            Slot::R(_) => panic!("a layer op writes a read-only buffer"),
        }
    }

    /// The first `len` elements, writable. A read-only slot here is a bug in the description
    /// (`LayerBuilder::finish` refuses an op that writes the layer input).
    pub(crate) fn w(&mut self, len: usize) -> &mut T {
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

/// Two disjoint ranges of one buffer (a weight's and its bias's gradients), in either order;
/// either may be absent (a frozen tensor has no gradient).
pub(crate) fn two_mut<T: ?Sized + DeviceSlice>(
    buf: &mut T,
    a: Option<Range<usize>>,
    b: Option<Range<usize>>,
) -> (Option<&mut T>, Option<&mut T>) {
    match (a, b) {
        (None, None) => (None, None),
        (Some(a), None) => (Some(buf.slice_mut(a)), None),
        (None, Some(b)) => (None, Some(buf.slice_mut(b))),
        (Some(a), Some(b)) if a.end <= b.start => {
            let (lo, hi) = buf.split_at_mut(b.start);
            (Some(lo.slice_mut(a)), Some(hi.slice_mut(0..b.len())))
        }
        (Some(a), Some(b)) => {
            assert!(b.end <= a.start, "weight and bias ranges overlap");
            let (lo, hi) = buf.split_at_mut(a.start);
            (Some(hi.slice_mut(0..a.len())), Some(lo.slice_mut(b)))
        }
    }
}

/// A layer's weights on the device: its slot (the backend's precision) and, for a quantised
/// base, its packed NF4 words with the workspace each packed weight is dequantised into
/// before it is used.
pub struct Weights<'a, B: Backend + ?Sized> {
    pub slot: &'a B::WBuf,
    pub packed: Option<Packed<'a, B>>,
    /// A sparse layer's dispatch scratch and load-balancing buffers (`None` for a dense one).
    pub moe: Option<MoeIo<'a, B>>,
    /// Where the description's weights and words are in `slot` and `packed` when the slot holds
    /// part of a layer (a chunked sparse layer's trunk or expert chunk); `None`: all of it, as
    /// the description lays it out.
    pub map: Option<&'a SlotMap>,
}

/// The packed part of [`Weights`].
pub struct Packed<'a, B: Backend + ?Sized> {
    /// The NF4 words, as f32 bit patterns (`LayerSpec::packed` of them).
    pub words: &'a B::Buf,
    /// At least `LayerSpec::workspace` weights.
    pub ws: &'a mut B::WBuf,
}

impl<'a, B: Backend + ?Sized> Weights<'a, B> {
    /// Weights held in the slot alone (no packed tensor).
    pub fn slot(slot: &'a B::WBuf) -> Self {
        Weights { slot, packed: None, moe: None, map: None }
    }

    /// A product's weight: its slot range, or its packed tensors dequantised into the
    /// workspace.
    fn get(&mut self, be: &B, w: &Weight) -> &B::WBuf {
        weight_of(be, (self.slot, &mut self.packed, self.map), w)
    }
}

/// Where the gradient of trained weights `g` (the description's, `LayerSpec::grad_range`) is in
/// the gradient of a part laid out by `map` (all of the layer: `None`); `None` when frozen.
pub(crate) fn grad_at(map: Option<&SlotMap>, g: Option<Range<usize>>) -> Option<Range<usize>> {
    g.map(|g| map.map_or_else(|| g.clone(), |m| m.grad(&g)))
}

/// Slot weights `r` of the description in a slot laid out by `map` (all of the layer: `None`).
pub(crate) fn at(map: Option<&SlotMap>, r: &Range<usize>) -> Range<usize> {
    map.map_or_else(|| r.clone(), |m| m.weight(r))
}

/// A product's weight `w`: a range of `slot`, or its packed tensors dequantised into the
/// workspace of `packed` (the fields of [`Weights`], borrowed apart from its `moe`).
pub(crate) fn weight_of<'w, B: Backend + ?Sized>(
    be: &B,
    (slot, packed, map): (&'w B::WBuf, &'w mut Option<Packed<'_, B>>, Option<&SlotMap>),
    w: &Weight,
) -> &'w B::WBuf {
    match w {
        Weight::Slot(r) => slot.slice(at(map, r)),
        Weight::Packed(parts) => {
            let p = packed.as_mut().expect("a packed weight comes with its words");
            for part in parts {
                let dst = p.ws.slice_mut(part.at..part.at + part.n);
                let words = map.map_or_else(|| part.words.clone(), |m| m.word(&part.words));
                match part.stored {
                    Stored::Mxfp4 => be.dequantize_mxfp4(dst, p.words.slice(words), part.n),
                    _ => be.dequantize_nf4(dst, p.words.slice(words), part.n),
                }
            }
            p.ws.slice(0..w.numel())
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
    w: &mut Weights<'_, B>,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
) {
    forward_ops(be, spec, slots, w, ropes, rows, None, Select::All);
}

/// A chunk of a sparse layer's experts ([`crate::model::chunks`]): which experts, and whether
/// it is the first of the layer's pass over its chunks (which sorts the rows by expert and
/// overwrites the experts' output, or in the backward their input's gradient).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertChunk {
    pub experts: Range<usize>,
    pub first: bool,
}

/// Which part of a layer a call runs: all of it, or, for a sparse layer whose experts stream
/// through the device in chunks, the ops before its experts op, one chunk of experts, the ops
/// after it, or (the backward's recompute) every op but the experts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Whole,
    Before,
    Experts(ExpertChunk),
    After,
    Trunk,
}

/// The forward ops a call runs.
#[derive(Clone, Copy)]
enum Select<'a> {
    All,
    Only(&'a [usize]),
    /// A part of a layer whose experts op is op `x`.
    Part(&'a Part, usize),
}

impl Select<'_> {
    fn runs(&self, i: usize) -> bool {
        match *self {
            Select::All => true,
            Select::Only(o) => o.contains(&i),
            Select::Part(p, x) => match p {
                Part::Whole => true,
                Part::Before => i < x,
                Part::Experts(_) => i == x,
                Part::After => i > x,
                Part::Trunk => i != x,
            },
        }
    }
}

/// The index of `spec`'s experts op (a sparse layer's).
fn experts_op(spec: &LayerSpec) -> usize {
    spec.ops.iter().position(|op| matches!(op, Op::Experts { .. })).expect("a sparse layer")
}

/// [`layer_forward`] of one part of a layer (`Part::Whole`: all of it). A chunk's weights come
/// through `w.map`.
pub fn layer_forward_part<B: Backend>(
    be: &B,
    spec: &LayerSpec,
    slots: &mut [Slot<'_, B::Buf>],
    w: &mut Weights<'_, B>,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
    part: &Part,
) {
    let sel = match part {
        Part::Whole => Select::All,
        p => Select::Part(p, experts_op(spec)),
    };
    forward_ops(be, spec, slots, w, ropes, rows, None, sel);
}

/// Before the backward of a layer that kept its internals: run its rebuild ops again
/// ([`LayerSpec::rebuild_ops`]), writing the values it did not keep.
pub fn layer_rebuild<B: Backend>(
    be: &B,
    spec: &LayerSpec,
    slots: &mut [Slot<'_, B::Buf>],
    w: &mut Weights<'_, B>,
    rows: Rows,
) {
    forward_ops(be, spec, slots, w, &[], rows, None, Select::Only(spec.rebuild_ops()));
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
    w: &mut Weights<'_, B>,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
    kv: KvStep<'_, B::Buf>,
) {
    assert_eq!(rows.b, 1, "a KV cache holds one sequence");
    forward_ops(be, spec, slots, w, ropes, rows, Some(kv), Select::All);
}

/// The forward ops of a layer (those of `only` when given), attention over `kv`'s cache when
/// given.
#[allow(clippy::too_many_arguments)]
fn forward_ops<B: Backend>(
    be: &B,
    spec: &LayerSpec,
    slots: &mut [Slot<'_, B::Buf>],
    wts: &mut Weights<'_, B>,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
    mut kv: Option<KvStep<'_, B::Buf>>,
    sel: Select<'_>,
) {
    let (w, map) = (wts.slot, wts.map);
    let n = rows.b * rows.t;
    let len = |a: Act| n * spec.width(a);
    let ad = spec.attn.dims(rows.b, rows.t);
    let norm = |w_offset: f32, c: usize| NormDims { c, eps: spec.eps, w_offset };
    let ops = spec.ops.iter().enumerate();
    for (_, op) in ops.filter(|(i, _)| sel.runs(*i)) {
        match *op {
            Op::RmsNorm { inp, out, rstd, w: ref r, w_offset } => {
                let [i, o, s] = pick(slots, [inp, out, rstd]);
                let nd = norm(w_offset, spec.c);

                be.rmsnorm_forward(o.w(len(out)), s.w(n), i.r(len(inp)), w.slice(at(map, r)), nd);
            }
            Op::HeadNorm { inp, out, rstd, w: ref r, w_offset } => {
                let [i, o, s] = pick(slots, [inp, out, rstd]);
                let nd = norm(w_offset, ad.d);
                let rs = s.w(len(rstd));
                be.head_rmsnorm_forward(
                    o.w(len(out)),
                    rs,
                    i.r(len(inp)),
                    w.slice(at(map, r)),
                    ad,
                    nd,
                );
            }
            Op::Linear { inp, out, w: ref r, ref bias, ic, oc } => {
                let [i, o] = pick(slots, [inp, out]);
                let bias = bias.as_ref().map(|b| w.slice(at(map, b)));
                be.matmul_forward(o.w(n * oc), i.r(n * ic), wts.get(be, r), bias, n, ic, oc);
            }
            Op::Lora { inp, out, ref a, ref b, col, w: width, oc, ic, r, u, tmp, scale } => {
                let [i, o, uu, t] = pick(slots, [inp, out, u, tmp]);
                be.matmul_forward(uu.w(n * r), i.r(n * ic), w.slice(at(map, a)), None, n, ic, r);
                let (bw, nw) = (w.slice(at(map, b)), n * width);
                be.matmul_forward(t.w(nw), uu.r(n * r), bw, None, n, r, width);
                be.add_cols(o.w(n * oc), t.r(nw), n, oc, col, width, scale);
            }
            Op::Rope { qkv, table } => {
                let [q] = pick(slots, [qkv]);
                let (cos, sin) = ropes[table];
                be.rope_forward(q.w(len(qkv)), cos, sin, ad);
            }
            Op::Attention { qkv, out, lse, ref sinks } => match kv.as_mut() {
                None => {
                    let [q, o, l] = pick(slots, [qkv, out, lse]);
                    let (o, l) = (o.w(len(out)), l.w(len(lse)));
                    be.attention_forward(o, l, q.r(len(qkv)), ad);
                    if let Some(s) = sinks {
                        be.attention_sink_forward(o, l, w.slice(at(map, s)), ad);
                    }
                }
                Some(KvStep { cache, pos }) => {
                    let [q, o] = pick(slots, [qkv, out]);
                    let (width, total) = (spec.width(qkv), *pos + n);
                    be.copy(cache.slice_mut(*pos * width..total * width), q.r(len(qkv)));
                    let cd = spec.attn.dims(1, total);
                    let sk = sinks.as_ref().map(|s| w.slice(at(map, s)));
                    be.attention_decode(o.w(len(out)), cache.slice(0..total * width), sk, n, cd);
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
            Op::SigmoidGate { gate, inp, out, c } => {
                let [g, i, o] = pick(slots, [gate, inp, out]);
                be.sigmoid_gate_forward(o.w(n * c), g.r(n), i.r(n * c), c);
            }
            Op::Route { .. } => route_forward(be, op, slots, wts.moe.as_mut(), n),
            Op::Experts { .. } => {
                let chunk = match sel {
                    Select::Part(Part::Experts(ch), _) => Some(ch),
                    _ => None,
                };
                experts_forward(be, op, slots, wts, n, chunk)
            }
        }
    }
}

/// One decoder layer backward, the description's derived program. On entry `grads[DRES]`
/// holds dL/dY; on return it holds dL/dX (overwritten). Parameter gradients accumulate (+=)
/// into `dw` (the layer's trained part, `LayerSpec::train_len`: every weight in full
/// fine-tuning, the adapters alone in an adapter run); a frozen weight gets none.
/// `acts` are the forward's slots (X and the layer's own).
#[allow(clippy::too_many_arguments)]
pub fn layer_backward<B: Backend>(
    be: &B,
    spec: &LayerSpec,
    grads: &mut [Slot<'_, B::Buf>],
    dw: &mut B::Buf,
    acts: &[Slot<'_, B::Buf>],
    wts: &mut Weights<'_, B>,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
) {
    layer_backward_part(be, spec, grads, dw, acts, wts, ropes, rows, &Part::Whole);
}

/// The backward program's steps of one part of a layer: `After` the steps before the experts'
/// (the ops after the experts op, walked back), `Experts` that step, `Before` the rest.
fn backward_steps<'s>(spec: &'s LayerSpec, part: &Part) -> &'s [BwdOp] {
    let all = &spec.backward[..];
    let x = || all.iter().position(|s| matches!(s, BwdOp::Experts { .. })).expect("a sparse layer");
    match part {
        Part::Whole => all,
        Part::After => &all[..x()],
        Part::Experts(_) => &all[x()..x() + 1],
        Part::Before => &all[x() + 1..],
        Part::Trunk => unreachable!("the trunk is a forward part"),
    }
}

/// [`layer_backward`] of one part of a layer (`Part::Whole`: all of it): `After`, then each
/// chunk of `Experts` (the first overwriting the experts' input gradient as the whole op
/// would), then `Before`.
#[allow(clippy::too_many_arguments)]
pub fn layer_backward_part<B: Backend>(
    be: &B,
    spec: &LayerSpec,
    grads: &mut [Slot<'_, B::Buf>],
    dw: &mut B::Buf,
    acts: &[Slot<'_, B::Buf>],
    wts: &mut Weights<'_, B>,
    ropes: &[(&B::Buf, &B::Buf)],
    rows: Rows,
    part: &Part,
) {
    let (w, map) = (wts.slot, wts.map);
    let gr = |r: &Range<usize>| grad_at(map, spec.grad_range(r));
    let n = rows.b * rows.t;
    let len = |a: Act| n * spec.width(a);
    let act = |a: Act| acts[a].r(len(a));
    let ad = spec.attn.dims(rows.b, rows.t);
    for step in backward_steps(spec, part) {
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
                let (dwr, wr) = (gr(r).map(|g| dw.slice_mut(g)), w.slice(at(map, r)));
                be.rmsnorm_backward(
                    gi.w(len(inp)),
                    dwr,
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
                let (dwr, wr) = (gr(r).map(|g| dw.slice_mut(g)), w.slice(at(map, r)));
                let (gi, go) = (gi.w(len(inp)), go.r(len(inp)));
                be.head_rmsnorm_backward(gi, dwr, go, act(inp), wr, act(rstd), ad, nd);
            }
            BwdOp::Linear { op, dinp, dout, acc } => {
                let Op::Linear { inp, w: ref r, ref bias, ic, oc, .. } = spec.ops[op] else {
                    unreachable!("the program names its op")
                };
                let [gi, go] = pick(grads, [dinp, dout]);
                let dwr = match r {
                    Weight::Slot(r) => gr(r),
                    Weight::Packed(_) => None,
                };
                let (dweight, dbias) = two_mut(dw, dwr, bias.as_ref().and_then(gr));
                let gi = if acc { Dinp::Add(gi.w(n * ic)) } else { Dinp::Write(gi.w(n * ic)) };
                let (go, wt) = (go.r(n * oc), wts.get(be, r));
                be.matmul_backward(Some(gi), dweight, dbias, go, act(inp), wt, n, ic, oc);
            }
            BwdOp::Lora { op, dinp, dout, g, du } => {
                let Op::Lora { inp, ref a, ref b, col, w: width, oc, ic, r, u, scale, .. } =
                    spec.ops[op]
                else {
                    unreachable!("the program names its op")
                };
                let [gi, go, gg, gu] = pick(grads, [dinp, dout, g, du]);
                let (da, db) = two_mut(dw, gr(a), gr(b));
                let nw = n * width;
                // g = scale * dL/d(out)[:, cols]; du = g b; dinp += du a; db += gᵀ u; da += duᵀ inp.
                be.scaled_cols(gg.w(nw), go.r(n * oc), n, oc, col, width, scale);
                let (wb, wa) = (w.slice(at(map, b)), w.slice(at(map, a)));
                let du = Dinp::Write(gu.w(n * r));
                be.matmul_backward(Some(du), db, None, gg.r(nw), act(u), wb, n, r, width);
                let dx = Dinp::Add(gi.w(n * ic));
                be.matmul_backward(Some(dx), da, None, gu.r(n * r), act(inp), wa, n, ic, r);
            }
            BwdOp::Rope { op, dqkv } => {
                let Op::Rope { qkv, table } = spec.ops[op] else {
                    unreachable!("the program names its op")
                };
                let (cos, sin) = ropes[table];
                be.rope_backward(grads[dqkv].w(len(qkv)), cos, sin, ad);
            }
            BwdOp::Attention { op, dqkv, dout } => {
                let Op::Attention { qkv, out, lse, ref sinks } = spec.ops[op] else {
                    unreachable!("the program names its op")
                };
                let [gq, go] = pick(grads, [dqkv, dout]);
                let go = go.r(len(out));
                be.attention_backward(gq.w(len(qkv)), go, act(qkv), act(out), act(lse), ad);
                // The sink's gradient, from the sink attention's out and lse.
                if let Some((s, g)) = sinks.as_ref().and_then(|s| Some((s, gr(s)?))) {
                    let sw = w.slice(at(map, s));
                    be.attention_sink_backward(dw.slice_mut(g), go, act(out), act(lse), sw, ad);
                }
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
            BwdOp::SigmoidGate { op, dgate, dinp, dout } => {
                let Op::SigmoidGate { gate, inp, c, .. } = spec.ops[op] else { unreachable!() };
                let [gg, gi, go] = pick(grads, [dgate, dinp, dout]);
                let (gg, gi) = (gg.w(n), gi.w(n * c));
                be.sigmoid_gate_backward(gi, gg, go.r(n * c), act(gate), act(inp), c);
            }
            BwdOp::Route { op, dlogits, dwts } => {
                let Op::Route { e, k, .. } = spec.ops[op] else { unreachable!() };
                let [gl, gw] = pick(grads, [dlogits, dwts]);
                let g = (gl.w(n * e), gw.r(n * k));
                route_backward(be, &spec.ops[op], g, acts, wts.moe.as_ref(), n);
            }
            BwdOp::Experts { op, dinp, acc, dout, dwts, t } => {
                let Op::Experts { k, c, .. } = spec.ops[op] else { unreachable!() };
                let [gi, go, gw, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9] = pick(
                    grads,
                    [dinp, dout, dwts, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9]],
                );
                let chunk = match part {
                    Part::Experts(ch) => Some(ch),
                    _ => None,
                };
                // A later chunk adds to what the first wrote.
                let acc = acc || chunk.is_some_and(|ch| !ch.first);
                let gi = if acc { Dinp::Add(gi.w(n * c)) } else { Dinp::Write(gi.w(n * c)) };
                let t = [t0, t1, t2, t3, t4, t5, t6, t7, t8, t9].map(|s| s.whole());
                let g = ExpertGrads { dinp: gi, dout: go.r(n * c), dwts: gw.w(n * k), t };
                experts_backward(be, (spec, &spec.ops[op]), g, dw, acts, wts, (n, chunk));
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

    /// A layer's weights for the tests: its slot, and (quantised) its packed words.
    #[derive(Default)]
    struct TestWeights {
        w: Vec<f32>,
        words: Vec<f32>,
        ws: Vec<f32>,
        host: crate::model::moe::MoeHost,
        /// Part of a layer: where its weights and words are.
        map: Option<SlotMap>,
    }

    impl TestWeights {
        fn view(&mut self) -> Weights<'_, CpuBackend> {
            let packed = (!self.words.is_empty())
                .then(|| Packed { words: &self.words[..], ws: &mut self.ws[..] });
            let host = &mut self.host;
            let moe = Some(MoeIo { host, mask: None, stats: None, grad: None });
            Weights { slot: &self.w[..], packed, moe, map: self.map.as_ref() }
        }

        /// Holds the part of `whole`'s weights and words that `map` lays out.
        fn hold(&mut self, whole: &TestWeights, map: &SlotMap) {
            self.w = vec![0.0; map.len];
            for (r, at) in &map.weights {
                self.w[*at..*at + r.len()].copy_from_slice(&whole.w[r.clone()]);
            }
            self.words = vec![0.0; map.packed];
            for (r, at) in &map.words {
                self.words[*at..*at + r.len()].copy_from_slice(&whole.words[r.clone()]);
            }
            self.ws.resize(whole.ws.len(), 0.0);
            self.map = Some(map.clone());
        }
    }

    /// Loss `sum(Y * r)` of one forward, in f64, and the experts a sparse layer chose (empty
    /// for a dense one).
    fn loss_routed(
        spec: &LayerSpec,
        x: &[f32],
        w: &mut TestWeights,
        ropes: &[(Vec<f32>, Vec<f32>)],
        r: &[f32],
    ) -> (f64, Vec<f32>) {
        let n = ROWS.b * ROWS.t;
        let mut y = vec![0.0; n * spec.c];
        let mut own: Vec<Vec<f32>> = spec.acts.iter().map(|a| vec![0.0; n * a.width]).collect();
        let mut slots = act_slots(x, Slot::W(&mut y[..]), own.iter_mut().map(|v| &mut v[..]));
        let views: Vec<(&[f32], &[f32])> = ropes.iter().map(|(c, s)| (&c[..], &s[..])).collect();
        layer_forward(&CpuBackend::new(), spec, &mut slots, &mut w.view(), &views, ROWS);
        drop(slots);
        let routed = spec.acts.iter().zip(&own).filter(|(a, _)| a.name == "experts_sel");
        let routing = routed.flat_map(|(_, v)| v.clone()).collect();
        (y.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum(), routing)
    }

    /// (dX, dW of the trained part) of `sum(Y * r)` through the derived backward program.
    fn grads(
        spec: &LayerSpec,
        x: &[f32],
        w: &mut TestWeights,
        ropes: &[(Vec<f32>, Vec<f32>)],
        r: &[f32],
    ) -> (Vec<f32>, Vec<f32>) {
        grads_kept(spec, x, w, ropes, r, false)
    }

    /// [`grads`]; with `kept`, as a layer that kept its internals: every value it does not
    /// keep ([`LayerSpec::stashed`]) poisoned (NaN) after the forward, its rebuild ops run again
    /// before the backward.
    fn grads_kept(
        spec: &LayerSpec,
        x: &[f32],
        w: &mut TestWeights,
        ropes: &[(Vec<f32>, Vec<f32>)],
        r: &[f32],
        kept: bool,
    ) -> (Vec<f32>, Vec<f32>) {
        let (be, n) = (CpuBackend::new(), ROWS.b * ROWS.t);
        let mut y = vec![0.0; n * spec.c];
        let mut own: Vec<Vec<f32>> = spec.acts.iter().map(|a| vec![0.0; n * a.width]).collect();
        let views: Vec<(&[f32], &[f32])> = ropes.iter().map(|(c, s)| (&c[..], &s[..])).collect();
        {
            let mut slots = act_slots(x, Slot::W(&mut y[..]), own.iter_mut().map(|v| &mut v[..]));
            layer_forward(&be, spec, &mut slots, &mut w.view(), &views, ROWS);
        }
        if kept {
            for (a, keep) in own.iter_mut().zip(spec.stashed()) {
                if !keep {
                    a.fill(f32::NAN);
                }
            }
        }
        let mut slots = act_slots(x, Slot::W(&mut y[..]), own.iter_mut().map(|v| &mut v[..]));
        if kept {
            layer_rebuild(&be, spec, &mut slots, &mut w.view(), ROWS);
        }
        let mut dres = r.to_vec();
        let mut rest: Vec<Vec<f32>> = spec.grads[1..].iter().map(|&g| vec![0.0; n * g]).collect();
        let mut g = grad_slots(&mut dres[..], rest.iter_mut().map(|v| &mut v[..]));
        let mut dw = vec![0.0; spec.train_len()];
        layer_backward(&be, spec, &mut g, &mut dw[..], &slots, &mut w.view(), &views, ROWS);
        drop(g);
        (dres, dw)
    }

    /// Central differences at a few coordinates of X and of every trained tensor.
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
            if t.init == Init::Ones && t.stored == crate::model::spec::Stored::Slot {
                w[t.range()].iter_mut().for_each(|v| *v += 1.0);
            }
        }
        let mut words = vec![0u32; spec.packed];
        for t in spec.tensors.iter().filter(|t| t.stored == crate::model::spec::Stored::Nf4) {
            let q = horizon_backend::nf4::quantize(&normal(t.numel(), 0.3));
            horizon_backend::nf4::to_words(&q, &mut words[t.range()]);
        }
        let mut tw = TestWeights {
            w,
            words: words.iter().map(|&b| f32::from_bits(b)).collect(),
            ws: vec![0.0; spec.workspace],
            ..Default::default()
        };
        let (dx, dw) = grads(spec, &x, &mut tw, ropes, &r);
        // A sparse layer's routing is piecewise constant: a smaller step, and a coordinate
        // whose step changes the experts chosen is skipped (its loss jumps).
        let sparse = spec.ops.iter().any(|op| matches!(op, Op::Route { .. }));
        let routing = loss_routed(spec, &x, &mut tw, ropes, &r).1;
        let fd = |x: &[f32], tw: &mut TestWeights, which: &str, i: usize| -> Option<f64> {
            let h = if sparse { 1e-3f32 } else { 1e-2 };
            let (mut xp, mut xm) = (x.to_vec(), x.to_vec());
            let w0 = tw.w.clone();
            let at = |xv: &[f32], tw: &mut TestWeights, d: f32| {
                if which == "w" {
                    tw.w[i] = w0[i] + d;
                }
                let (l, routed) = loss_routed(spec, xv, tw, ropes, &r);
                tw.w.copy_from_slice(&w0);
                (l, routed == routing)
            };
            if which == "x" {
                xp[i] += h;
                xm[i] -= h;
            }
            let ((lp, same_p), (lm, same_m)) = (at(&xp, tw, h), at(&xm, tw, -h));
            (same_p && same_m).then(|| (lp - lm) / (2.0 * h as f64))
        };
        let scale = dx.iter().chain(&dw).fold(0f32, |a, &b| a.max(b.abs())) as f64;
        let mut at: Vec<(&str, usize, f32)> =
            (0..4).map(|k| ("x", (k * 7919) % x.len(), dx[(k * 7919) % x.len()])).collect();
        for t in spec.trained() {
            for k in [0, t.numel() / 2, t.numel() - 1] {
                at.push(("w", t.offset + k, dw[t.offset - spec.frozen + k]));
            }
        }
        let total = at.len();
        let mut skipped = 0;
        for (which, i, got) in at {
            let Some(want) = fd(&x, &mut tw, which, i) else {
                skipped += 1;
                continue;
            };
            let err = (got as f64 - want).abs();
            assert!(
                err <= 2e-3 * scale + 2e-2 * want.abs(),
                "{name}: d{which}[{i}] = {got}, finite differences {want} (err {err:.3e}, scale {scale:.3e})"
            );
        }
        assert!(skipped * 4 <= total, "{name}: {skipped} of {total} steps changed the routing");
    }

    fn tables(layout: &ModelLayout) -> Vec<(Vec<f32>, Vec<f32>)> {
        layout.rope.iter().map(|f| rope_tables(f, ROWS.t)).collect()
    }

    /// Each fixture family's layout, its windows cut to 3 (shorter than the test's rows).
    fn fixture_layouts() -> Vec<(&'static str, ModelLayout)> {
        let cases = [
            "llama_gqa",
            "qwen2_tied_padded",
            "qwen3_qknorm",
            "gemma3_sliding",
            "qwen3_moe",
            "mixtral",
            "gpt_oss",
        ];
        cases
            .into_iter()
            .map(|case| {
                let dir = env!("CARGO_MANIFEST_DIR");
                let path = format!("{dir}/tests/fixtures/{case}/model/config.json");
                let cfg = ModelConfig::from_file(std::path::Path::new(&path)).unwrap();
                let mut layout = crate::model::describe(&cfg);
                for spec in &mut layout.kinds {
                    spec.attn.window = spec.attn.window.min(3);
                }
                (case, layout)
            })
            .chain(std::iter::once(("qwen2_moe", qwen2_moe_layout())))
            .collect()
    }

    /// A Qwen2-MoE layout (no fixture: the qwen3_moe fixture's shape as Qwen2-MoE, with q/k/v
    /// biases, raw top-k probabilities and a shared expert of 16).
    fn qwen2_moe_layout() -> ModelLayout {
        let dir = env!("CARGO_MANIFEST_DIR");
        let path = format!("{dir}/tests/fixtures/qwen3_moe/model/config.json");
        let mut raw: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        raw["model_type"] = "qwen2_moe".into();
        raw["shared_expert_intermediate_size"] = 16.into();
        raw["norm_topk_prob"] = serde_json::Value::Null;
        let cfg = ModelConfig::from_json(&raw, "qwen2_moe").unwrap();
        assert!(cfg.qkv_bias && !cfg.moe.as_ref().unwrap().norm_topk_prob);
        crate::model::describe(&cfg)
    }

    /// Each fixture family's layer kinds (Llama with GQA, Qwen2 with biases, Qwen3's q/k norm,
    /// Gemma 3's four `(1 + w)` norms, GeGLU and sliding window).
    #[test]
    fn every_family_layer_matches_finite_differences() {
        for (case, layout) in fixture_layouts() {
            let ropes = tables(&layout);
            for spec in &layout.kinds {
                check(&format!("{case} {}", spec.kind), spec, &ropes);
            }
        }
    }

    /// A layer that keeps its internals keeps only what its backward reads and cannot rebuild:
    /// with everything else poisoned and its rebuild ops (the norms) run again, its backward is
    /// bit-identical, for every family, with and without adapters. In Llama's layer that keeps
    /// q|k|v, the attention's output and statistics, the residual mid-point and gate|up and
    /// their activation: not the two norms' outputs, nor the products that only feed an add.
    #[test]
    fn a_kept_layer_needs_only_what_it_keeps_and_rebuilds() {
        use crate::model::lora::BaseDtype;
        use crate::model::lora::LoraSpec;
        let targets = ["q_proj", "o_proj", "down_proj"].iter().map(|t| t.to_string()).collect();
        let lora = LoraSpec {
            r: 3,
            scale: 1.7,
            targets,
            nf4: false,
            base: BaseDtype::F32,
            experts: Default::default(),
        };
        for (case, layout) in fixture_layouts() {
            let ropes = tables(&layout);
            // A sparse layer's: its attention's and its experts'.
            let adapted = match layout.moe {
                None => layout.with_lora(&lora).unwrap(),
                Some(_) => {
                    let experts = crate::model::lora::ExpertTargets {
                        gate_up: Some((2, 0.8)),
                        down: Some((3, 1.7)),
                    };
                    let targets = ["q_proj", "o_proj"].map(String::from).to_vec();
                    layout.with_lora(&LoraSpec { targets, experts, ..lora.clone() }).unwrap()
                }
            };
            for spec in layout.kinds.iter().chain(&adapted.kinds) {
                let n = ROWS.b * ROWS.t;
                let mut rng = SplitMix64::new(11);
                let mut normal = |len: usize| {
                    let mut v = vec![0.0; len];
                    rng.fill_normal(&mut v, 0.5);
                    v
                };
                let (x, r) = (normal(n * spec.c), normal(n * spec.c));
                let mut tw = TestWeights { w: normal(spec.len), ..Default::default() };
                let want = grads(spec, &x, &mut tw, &ropes, &r);
                let got = grads_kept(spec, &x, &mut tw, &ropes, &r, true);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let what = format!("{case} {} (adapted: {})", spec.kind, spec.frozen > 0);
                assert_eq!((bits(&got.0), bits(&got.1)), (bits(&want.0), bits(&want.1)), "{what}");
            }
            if case == "llama_gqa" {
                let spec = &layout.kinds[0];
                let names = |keep: bool| -> Vec<&str> {
                    let st = spec.stashed();
                    spec.acts
                        .iter()
                        .zip(st)
                        .filter(|(_, s)| *s == keep)
                        .map(|(a, _)| a.name)
                        .collect()
                };
                assert_eq!(names(true), ["qkv", "att", "lse", "x2", "gu", "s"]);
                assert_eq!(names(false), ["h1", "rstd1", "tmp", "h2", "rstd2"]);
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
        b.op(Op::Linear { inp: h, out: p, w: wp.into(), bias: None, ic: c, oc: c });
        let s = b.act("s", c);
        b.op(Op::Add { a: X, b: p, out: s });
        b.op(Op::Add { a: X, b: s, out: Y });
        let attn = AttnSpec { h: 1, kvh: 1, d: c, window: 0, scale: 1.0 };
        let spec = b.finish("double_residual", attn, 1e-6);
        assert!(spec.backward.iter().any(|op| matches!(op, BwdOp::Accumulate { .. })));
        check("double residual", &spec, &[]);
    }

    /// LoRA on every projection of each family's layers (and QLoRA, the base in NF4): the
    /// adapters' gradients and dX against finite differences; the frozen base gets none.
    #[test]
    fn adapted_layers_match_finite_differences() {
        use crate::model::lora::BaseDtype;
        use crate::model::lora::LoraSpec;
        let targets: Vec<String> =
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
                .iter()
                .map(|t| t.to_string())
                .collect();
        // A mixture of experts: attention modules, and the routed experts' parameters (as
        // PEFT's rewrite of gate/up/down: gate|up at another rank and scale).
        let experts =
            crate::model::lora::ExpertTargets { gate_up: Some((2, 0.8)), down: Some((3, 1.7)) };
        let moe_targets: Vec<String> = ["q_proj", "o_proj", "router"].map(String::from).to_vec();
        for (case, layout) in fixture_layouts() {
            let ropes = tables(&layout);
            let sparse = layout.moe.is_some();
            for nf4 in [false, true] {
                let lora = LoraSpec {
                    r: 3,
                    scale: 1.7,
                    targets: if sparse { moe_targets.clone() } else { targets.clone() },
                    nf4,
                    base: BaseDtype::F32,
                    experts: if sparse { experts } else { Default::default() },
                };
                let adapted = layout.with_lora(&lora).unwrap();
                for spec in &adapted.kinds {
                    assert_eq!(spec.train_len(), spec.trained().map(|t| t.numel()).sum::<usize>());
                    assert!(spec.backward.iter().any(|op| matches!(op, BwdOp::Lora { .. })));
                    check(&format!("{case} {} lora nf4={nf4}", spec.kind), spec, &ropes);
                }
            }
        }
    }

    /// A sparse layer whose experts stream in chunks: its trunk (the ops before the experts,
    /// each chunk of experts from a slot of its own, the ops after), forward and backward
    /// (after the backward's recompute of every op but the experts; each part's gradient its
    /// own, added into the layer's by its map), is the whole layer bit for bit, for chunks of
    /// 1, 3 and every expert: trained experts (full fine-tuning), frozen ones under adapters
    /// on the attention and router, in full precision and in NF4, and with expert adapters.
    #[test]
    fn a_chunked_sparse_layer_is_the_whole_layer_bit_for_bit() {
        use crate::model::chunks::ExpertSplit;
        use crate::model::lora::{BaseDtype, LoraSpec};
        let targets = ["q_proj", "o_proj", "router"].map(String::from).to_vec();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let (be, n) = (CpuBackend::new(), ROWS.b * ROWS.t);
        let experts =
            crate::model::lora::ExpertTargets { gate_up: Some((2, 0.8)), down: Some((3, 1.7)) };
        for (case, layout) in fixture_layouts().into_iter().filter(|(_, l)| l.moe.is_some()) {
            let ropes = tables(&layout);
            let views: Vec<(&[f32], &[f32])> =
                ropes.iter().map(|(c, s)| (&c[..], &s[..])).collect();
            let variants = [
                (None, false),
                (Some(Default::default()), false),
                (Some(Default::default()), true),
                (Some(experts), false),
                (Some(experts), true),
            ];
            for (expert_lora, nf4) in variants {
                let adapted = match expert_lora {
                    None => layout.clone(),
                    Some(experts) => {
                        let lora = LoraSpec {
                            r: 2,
                            scale: 1.5,
                            targets: targets.clone(),
                            nf4,
                            base: BaseDtype::F32,
                            experts,
                        };
                        layout.with_lora(&lora).unwrap()
                    }
                };
                let spec = adapted.kinds.iter().find(|s| ExpertSplit::new(s, 1).is_some()).unwrap();
                let mut rng = SplitMix64::new(5);
                let mut normal = |len: usize| {
                    let mut v = vec![0.0; len];
                    rng.fill_normal(&mut v, 0.5);
                    v
                };
                let (x, r) = (normal(n * spec.c), normal(n * spec.c));
                let mut words = vec![0u32; spec.packed];
                for t in spec.tensors.iter().filter(|t| t.stored == crate::model::spec::Stored::Nf4)
                {
                    let q = horizon_backend::nf4::quantize(&normal(t.numel()));
                    horizon_backend::nf4::to_words(&q, &mut words[t.range()]);
                }
                let mut whole = TestWeights {
                    w: normal(spec.len),
                    words: words.iter().map(|&b| f32::from_bits(b)).collect(),
                    ws: vec![0.0; spec.workspace],
                    ..Default::default()
                };
                let want = grads(spec, &x, &mut whole, &ropes, &r);
                let mut y_want = vec![0.0; n * spec.c];
                {
                    let mut own: Vec<Vec<f32>> =
                        spec.acts.iter().map(|a| vec![0.0; n * a.width]).collect();
                    let mut slots = act_slots(
                        &x[..],
                        Slot::W(&mut y_want[..]),
                        own.iter_mut().map(|v| &mut v[..]),
                    );
                    layer_forward(&be, spec, &mut slots, &mut whole.view(), &views, ROWS);
                }
                let e = ExpertSplit::new(spec, 1).unwrap().experts;
                for per in [1, 3, e] {
                    let split = ExpertSplit::new(spec, per).unwrap();
                    let what = format!(
                        "{case} adapters {} nf4={nf4}, {per} experts a chunk",
                        expert_lora.is_some()
                    );
                    let trained =
                        spec.frozen == 0 || expert_lora.is_some_and(|e| e.gate_up.is_some());
                    assert_eq!(split.trained(), trained, "{what}");
                    let mut part = TestWeights::default();
                    let run = |part: &mut TestWeights, slots: &mut [Slot<'_, [f32]>], p: Part| {
                        match &p {
                            Part::Experts(ch) => {
                                part.hold(&whole, &split.chunks[ch.experts.start / per])
                            }
                            _ => part.hold(&whole, &split.trunk),
                        }
                        layer_forward_part(&be, spec, slots, &mut part.view(), &views, ROWS, &p);
                    };
                    let chunks: Vec<Part> = (0..split.chunks.len())
                        .map(|k| {
                            let experts = split.experts_of(k);
                            Part::Experts(ExpertChunk { experts, first: k == 0 })
                        })
                        .collect();
                    let mut y = vec![0.0; n * spec.c];
                    let mut own: Vec<Vec<f32>> =
                        spec.acts.iter().map(|a| vec![0.0; n * a.width]).collect();
                    {
                        let mut slots = act_slots(
                            &x[..],
                            Slot::W(&mut y[..]),
                            own.iter_mut().map(|v| &mut v[..]),
                        );
                        run(&mut part, &mut slots, Part::Before);
                        for ch in chunks.iter().cloned() {
                            run(&mut part, &mut slots, ch);
                        }
                        run(&mut part, &mut slots, Part::After);
                    }
                    assert_eq!(bits(&y), bits(&y_want), "{what}: forward");
                    // The backward's recompute leaves the experts' output as it was: poison it.
                    own.iter_mut().for_each(|a| a.fill(f32::NAN));
                    let mut slots =
                        act_slots(&x[..], Slot::W(&mut y[..]), own.iter_mut().map(|v| &mut v[..]));
                    run(&mut part, &mut slots, Part::Trunk);
                    let mut dres = r.clone();
                    let mut rest: Vec<Vec<f32>> =
                        spec.grads[1..].iter().map(|&g| vec![0.0; n * g]).collect();
                    let mut g = grad_slots(&mut dres[..], rest.iter_mut().map(|v| &mut v[..]));
                    let mut dw = vec![0.0; spec.train_len()];
                    // Each part into a gradient of its own, added into the layer's by its map.
                    let back = |part: &mut TestWeights,
                                g: &mut [Slot<'_, [f32]>],
                                dw: &mut [f32],
                                p: Part| {
                        let map = match &p {
                            Part::Experts(ch) => &split.chunks[ch.experts.start / per],
                            _ => &split.trunk,
                        };
                        part.hold(&whole, map);
                        let mut own = vec![0.0; map.train_len];
                        layer_backward_part(
                            &be,
                            spec,
                            g,
                            &mut own,
                            &slots,
                            &mut part.view(),
                            &views,
                            ROWS,
                            &p,
                        );
                        for (r, at) in &map.grads {
                            for (d, o) in dw[r.clone()].iter_mut().zip(&own[*at..*at + r.len()]) {
                                *d += o;
                            }
                        }
                    };
                    back(&mut part, &mut g, &mut dw, Part::After);
                    for ch in chunks.iter().cloned() {
                        back(&mut part, &mut g, &mut dw, ch);
                    }
                    back(&mut part, &mut g, &mut dw, Part::Before);
                    drop(g);
                    assert_eq!(
                        (bits(&dres), bits(&dw)),
                        (bits(&want.0), bits(&want.1)),
                        "{what}: backward"
                    );
                }
            }
        }
    }

    /// gpt-oss against transformers at step 0 (`tests/fixtures/gpt_oss`, `gpt_oss_mxfp4`): each
    /// layer run on the fixture's own input (`hidden_states.{i}`) gives router logits within
    /// 1e-5 of transformers' (`router_logits.{i}`), chooses on every real row the experts
    /// transformers ranks first, and clamps exactly the entries float64 clamps: for each real
    /// row and chosen expert, the gate (above the limit) and up (beyond +-limit) entries of
    /// `h2 G^T + g` in f64 from this layer's `h2` are those from the fixture's `mlp_input.{i}`.
    #[test]
    fn gpt_oss_layers_route_and_clamp_as_transformers_at_step_0() {
        use crate::hf::checkpoint::read_tensor_f64;
        for case in ["gpt_oss", "gpt_oss_mxfp4"] {
            let dir =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(case);
            let cfg = ModelConfig::from_file(&dir.join("model/config.json")).unwrap();
            let layout = crate::model::describe(&cfg);
            let params =
                crate::model::params::ParamStore::load_hf(&layout, &dir.join("model")).unwrap();
            let fx =
                |name: &str| read_tensor_f64(&dir.join("step0_logits.safetensors"), name).unwrap();
            let bytes = std::fs::read(dir.join("step0_logits.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let m = st.tensor("attention_mask").unwrap();
            let mask: Vec<f64> = m
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64)
                .collect();
            let mask_shape = m.shape().to_vec();
            let rows = Rows { b: mask_shape[0], t: mask_shape[1] };
            let moe = layout.moe.clone().unwrap();
            let (e, k, i_f) = (moe.num_experts, moe.top_k, moe.expert_size);
            let limit = moe.clamp.unwrap().limit as f64;
            let ropes: Vec<_> = layout.rope.iter().map(|f| rope_tables(f, rows.t)).collect();
            let views: Vec<(&[f32], &[f32])> =
                ropes.iter().map(|(c, s)| (&c[..], &s[..])).collect();
            for l in 0..layout.dims.layers {
                let spec = layout.layer(l);
                let n = rows.b * rows.t;
                let x: Vec<f32> =
                    fx(&format!("hidden_states.{l}")).1.iter().map(|&v| v as f32).collect();
                let mut y = vec![0.0; n * spec.c];
                let mut own: Vec<Vec<f32>> =
                    spec.acts.iter().map(|a| vec![0.0; n * a.width]).collect();
                let mut tw = TestWeights {
                    w: params.layers[l].clone(),
                    ws: vec![0.0; spec.workspace],
                    host: crate::model::moe::MoeHost::new(n * k, e),
                    ..Default::default()
                };
                {
                    let mut slots =
                        act_slots(&x[..], Slot::W(&mut y[..]), own.iter_mut().map(|v| &mut v[..]));
                    layer_forward(
                        &CpuBackend::new(),
                        spec,
                        &mut slots,
                        &mut tw.view(),
                        &views,
                        rows,
                    );
                }
                let act = |name: &str| &own[spec.acts.iter().position(|a| a.name == name).unwrap()];
                let (logits, sel, h2) = (act("router_logits"), act("experts_sel"), act("h2"));
                let (_, want) = fx(&format!("router_logits.{l}"));
                let (_, mlp_in) = fx(&format!("mlp_input.{l}"));
                let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
                let (mut clamped, mut entries) = (0, 0);
                for r in (0..n).filter(|&r| mask[r] == 1.0) {
                    for x in 0..e {
                        let err = (logits[r * e + x] as f64 - want[r * e + x]).abs() / scale;
                        assert!(
                            err < 1e-5,
                            "{case} layer {l} row {r}: router logit {x} off by {err:.2e}"
                        );
                    }
                    let mut rank: Vec<usize> = (0..e).collect();
                    rank.sort_by(|&a, &b| want[r * e + b].total_cmp(&want[r * e + a]));
                    let mut ours: Vec<usize> =
                        sel[r * k..(r + 1) * k].iter().map(|&v| v as usize).collect();
                    let mut theirs = rank[..k].to_vec();
                    ours.sort_unstable();
                    theirs.sort_unstable();
                    assert_eq!(ours, theirs, "{case} layer {l} row {r}: experts chosen");
                    for &x in &ours {
                        let pre = |inp: &dyn Fn(usize) -> f64, name: &str, j: usize| -> f64 {
                            let w = params
                                .tensor(
                                    &layout,
                                    &format!("model.layers.{l}.mlp.experts.{x}.{name}.weight"),
                                )
                                .unwrap();
                            let b = params
                                .tensor(
                                    &layout,
                                    &format!("model.layers.{l}.mlp.experts.{x}.{name}.bias"),
                                )
                                .unwrap();
                            (0..spec.c).map(|c| inp(c) * w[j * spec.c + c] as f64).sum::<f64>()
                                + b[j] as f64
                        };
                        let ours_in = |c: usize| h2[r * spec.c + c] as f64;
                        let fx_in = |c: usize| mlp_in[r * spec.c + c];
                        for j in 0..i_f {
                            let gate =
                                |inp: &dyn Fn(usize) -> f64| pre(inp, "gate_proj", j) > limit;
                            let up =
                                |inp: &dyn Fn(usize) -> f64| pre(inp, "up_proj", j).abs() > limit;
                            assert_eq!(
                                gate(&ours_in),
                                gate(&fx_in),
                                "{case} layer {l} row {r} expert {x}: gate {j}"
                            );
                            assert_eq!(
                                up(&ours_in),
                                up(&fx_in),
                                "{case} layer {l} row {r} expert {x}: up {j}"
                            );
                            clamped += usize::from(gate(&fx_in)) + usize::from(up(&fx_in));
                            entries += 2;
                        }
                    }
                }
                assert!(
                    clamped > 0 && clamped < entries,
                    "{case} layer {l}: {clamped} of {entries} clamped"
                );
            }
        }
    }
}
