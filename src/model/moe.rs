//! Mixture-of-experts layers as `model/layer.rs` runs them: the routing op and the experts op
//! ([`Op::Route`], [`Op::Experts`]), and the model-level load-balancing loss.
//!
//! Data flow of a sparse MLP over N rows (M = N*k (row, choice) pairs):
//! `h (N,C) -> router -> logits (N,E) -> route -> probs, sel, wts (N,k)`; then on the host, once
//! per layer and pass, a stable counting sort of the pairs by expert (`sel` read back; the
//! products need each expert's row count); then expert by expert (in expert order): its rows of
//! `h` gathered, `xs (cnt,C)` -> `[gate; up]` -> `gu (cnt,2I)` -> SwiGLU -> `s (cnt,I)` -> down
//! -> `ys (cnt,C)`, added back weighted: `out[row] += wts[pair] ys` (a row chooses an expert
//! once, so `cnt <= N`: the scratch is O(N), not O(N k)).
//!
//! The backward, expert by expert, recomputes what the forward did not keep (the sort, `xs`,
//! `gu`, `s`) and never needs the experts' outputs: with `dy` = its rows of dout (unweighted),
//! `ds' = dy W_down` gives the routing weights' gradient `dwts = ds' . s` and, scaled by the
//! pair's weight, the SwiGLU's; `W_down`'s gradient is `dy^T (w s)`.
//!
//! Load balancing (HF's `load_balancing_loss_func`, `../shared/fixtures/README.md`): every
//! sparse layer's forward adds its real rows' expert counts and probabilities to the pass's
//! pooled statistics (2E); after the forward, [`AuxLoss`] gives
//! `aux = E sum_e f_e P_e` and, when it is trained, each probability's gradient `g_e` per real
//! row, which every sparse layer's routing backward adds.

use std::ops::Range;

use horizon_backend::cpu::moe_sort;
use horizon_backend::{Backend, DeviceSlice, Dinp, MoeDims};

use crate::model::chunks::SlotMap;
use crate::model::layer::{ExpertChunk, Packed, Slot, Weights, at, grad_at, weight_of};
use crate::model::layout::ModelLayout;
use crate::model::spec::{Act, ExpertLora, LayerSpec, Op};

/// Host scratch of the dispatch sort, sized once ([`MoeHost::new`]) and reused.
#[derive(Debug, Default)]
pub struct MoeHost {
    sel: Vec<f32>,
    order: Vec<f32>,
    pos: Vec<f32>,
    counts: Vec<usize>,
}

impl MoeHost {
    /// Room for `m` (row, choice) pairs over `e` experts.
    pub fn new(m: usize, e: usize) -> Self {
        MoeHost {
            sel: Vec::with_capacity(m),
            order: Vec::with_capacity(m),
            pos: Vec::with_capacity(m),
            counts: Vec::with_capacity(e + 1),
        }
    }

    /// Reads `sel` (M) back and sorts the pairs by expert; uploads `order | pos` into `idx`
    /// (2M).
    fn sort<B: Backend>(&mut self, be: &B, sel: &B::Buf, idx: &mut B::Buf, m: usize, e: usize) {
        self.sel.resize(m, 0.0);
        be.download(&mut self.sel, sel.slice(0..m));
        moe_sort(&self.sel, e, &mut self.counts, &mut self.order, &mut self.pos);
        let (o, p) = idx.slice_mut(0..2 * m).split_at_mut(m);
        be.upload(o, &self.order);
        be.upload(p, &self.pos);
    }

    /// [`MoeHost::segments`] of the experts of `chunk` (all of them without one).
    fn segments_in<'s>(
        &'s self,
        chunk: Option<&'s ExpertChunk>,
    ) -> impl Iterator<Item = (usize, usize, usize)> + 's {
        self.segments().filter(move |(x, _, _)| chunk.is_none_or(|ch| ch.experts.contains(x)))
    }

    /// Each expert's first pair and pair count, in expert order (experts with no pair left out).
    fn segments(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let starts = self.counts.iter().scan(0, |at, &c| {
            let s = *at;
            *at += c;
            Some(s)
        });
        self.counts
            .iter()
            .zip(starts)
            .enumerate()
            .filter(|(_, (c, _))| **c > 0)
            .map(|(e, (&c, s))| (e, s, c))
    }
}

/// What a sparse layer needs beyond its weights: the host sort's scratch and the pass's
/// load-balancing buffers.
pub struct MoeIo<'a, B: Backend + ?Sized> {
    pub host: &'a mut MoeHost,
    /// (N) 1 on real rows, 0 on padding: the statistics' mask.
    pub mask: Option<&'a B::Buf>,
    /// (2E) the pooled statistics a first forward adds to; `None` in a recompute or decode.
    pub stats: Option<&'a mut B::Buf>,
    /// (E) the load-balancing gradient per real row, when the loss is trained.
    pub grad: Option<&'a B::Buf>,
}

/// [`Op::Route`] forward, adding the rows' statistics when the pass pools them.
pub(crate) fn route_forward<B: Backend>(
    be: &B,
    op: &Op,
    slots: &mut [Slot<'_, B::Buf>],
    moe: Option<&mut MoeIo<'_, B>>,
    n: usize,
) {
    let Op::Route { logits, probs, sel, wts, e, k, norm } = *op else { unreachable!() };
    let dims = MoeDims { n, e, k, norm };
    let [l, p, s, w] = slots.get_disjoint_mut([logits, probs, sel, wts]).expect("distinct");
    be.moe_route_forward(p.w(n * e), s.w(n * k), w.w(n * k), l.r(n * e), dims);
    if let Some(MoeIo { mask: Some(mask), stats: Some(stats), .. }) = moe {
        be.moe_aux_stats(stats, p.r(n * e), s.r(n * k), mask.slice(0..n), dims);
    }
}

/// [`Op::Route`] backward: `dlogits` from `dwts` and, when trained, the load-balancing term.
pub(crate) fn route_backward<B: Backend>(
    be: &B,
    op: &Op,
    (dlogits, dwts): (&mut B::Buf, &B::Buf),
    acts: &[Slot<'_, B::Buf>],
    moe: Option<&MoeIo<'_, B>>,
    n: usize,
) {
    let Op::Route { probs, sel, e, k, norm, .. } = *op else { unreachable!() };
    let aux = moe.and_then(|m| Some((m.grad?, m.mask?.slice(0..n))));
    let (p, s) = (acts[probs].r(n * e), acts[sel].r(n * k));
    be.moe_route_backward(dlogits, dwts, p, s, aux, MoeDims { n, e, k, norm });
}

/// Expert `x`'s gate|up (2I, C) or, with `down`, its down (C, I) matrix: a range of the slot,
/// or (QLoRA) its NF4 tensors dequantised into the workspace.
fn expert_mat<'w, B: Backend>(
    be: &B,
    (slot, packed, map): (&'w B::WBuf, &'w mut Option<Packed<'_, B>>, Option<&SlotMap>),
    op: &Op,
    x: usize,
    down: bool,
) -> &'w B::WBuf {
    let Op::Experts { ref gate_up, down: ref dn, i, c, packed: ref nf4, .. } = *op else {
        unreachable!()
    };
    match nf4 {
        Some(w) => weight_of(be, (slot, packed, map), &w[x][usize::from(down)]),
        None => {
            let (r, len) = if down { (dn, c * i) } else { (gate_up, 2 * i * c) };
            slot.slice(at(map, &(r.start + x * len..r.start + (x + 1) * len)))
        }
    }
}

/// Expert `x`'s adapter of a projection `ic -> oc`: its `A_e` (r, ic) and `B_e` (oc, r) ranges.
fn adapter_ranges(l: &ExpertLora, x: usize, ic: usize, oc: usize) -> (Range<usize>, Range<usize>) {
    let (na, nb) = (l.r * ic, oc * l.r);
    (l.a.start + x * na..l.a.start + (x + 1) * na, l.b.start + x * nb..l.b.start + (x + 1) * nb)
}

/// Expert `x`'s `[gate; up]` bias (2I) or, with `down`, its down bias (C): gpt-oss's, as the
/// slot holds them.
fn expert_bias<'w, B: Backend>(
    (slot, map): (&'w B::WBuf, Option<&SlotMap>),
    op: &Op,
    x: usize,
    down: bool,
) -> Option<&'w B::WBuf> {
    let Op::Experts { ref bias, i, c, .. } = *op else { unreachable!() };
    let [gu, dn] = bias.as_ref()?;
    let (r, len) = if down { (dn, c) } else { (gu, 2 * i) };
    Some(slot.slice(at(map, &(r.start + x * len..r.start + (x + 1) * len))))
}

/// The gate|up activation of `cnt` rows: SwiGLU, or gpt-oss's clamped one.
fn glu_forward<B: Backend>(be: &B, op: &Op, s: &mut B::Buf, gu: &B::Buf, cnt: usize) {
    let Op::Experts { i, clamp, .. } = *op else { unreachable!() };
    match clamp {
        Some(cl) => be.clamped_swiglu_forward(s, gu, cnt, i, cl),
        None => be.swiglu_forward(s, gu, cnt, i),
    }
}

/// The backward of [`glu_forward`]: dgu (cnt, 2I) from ds (cnt, I) and the saved gu.
fn glu_backward<B: Backend>(
    be: &B,
    op: &Op,
    dgu: &mut B::Buf,
    ds: &B::Buf,
    gu: &B::Buf,
    cnt: usize,
) {
    let Op::Experts { i, clamp, .. } = *op else { unreachable!() };
    match clamp {
        Some(cl) => be.clamped_swiglu_backward(dgu, ds, gu, (cnt, i), cl),
        None => be.swiglu_backward(dgu, ds, gu, cnt, i),
    }
}

/// One expert's rows through a projection `ic -> oc`: `out = inp W^T (+ bias)`, plus its
/// adapter's `scale (inp A_e^T) B_e^T` (through the scratch `u`, `t`) when it has one.
#[allow(clippy::too_many_arguments)]
fn project<B: Backend>(
    be: &B,
    (out, inp): (&mut B::Buf, &B::Buf),
    (w, bias): (&B::WBuf, Option<&B::WBuf>),
    adapter: Option<(&B::WBuf, &B::WBuf, &ExpertLora)>,
    scratch: Option<(&mut B::Buf, &mut B::Buf)>,
    cnt: usize,
    ic: usize,
    oc: usize,
) {
    be.matmul_forward(out, inp, w, bias, cnt, ic, oc);
    if let (Some((a, b, l)), Some((u, t))) = (adapter, scratch) {
        let (u, t) = (u.slice_mut(0..cnt * l.r), t.slice_mut(0..cnt * oc));
        be.matmul_forward(u, inp, a, None, cnt, ic, l.r);
        be.matmul_forward(t, u, b, None, cnt, l.r, oc);
        be.add_cols(out, t, cnt, oc, 0, oc, l.scale);
    }
}

/// [`Op::Experts`] forward.
pub(crate) fn experts_forward<B: Backend>(
    be: &B,
    op: &Op,
    slots: &mut [Slot<'_, B::Buf>],
    wts: &mut Weights<'_, B>,
    n: usize,
    chunk: Option<&ExpertChunk>,
) {
    let Op::Experts { inp, sel, wts: rw, out, gu, scratch, ref lora, .. } = *op else {
        unreachable!()
    };
    let [xs, s, ys, idx] = scratch;
    let io = [inp, sel, rw, out, gu, xs, s, ys, idx];
    match lora.scratch {
        None => {
            let b = slots.get_disjoint_mut(io).expect("distinct");
            experts_forward_in(be, op, b, None, wts, (n, chunk));
        }
        Some([u, t]) => {
            let idx = [io[0], io[1], io[2], io[3], io[4], io[5], io[6], io[7], io[8], u, t];
            let [b0, b1, b2, b3, b4, b5, b6, b7, b8, u, t] =
                slots.get_disjoint_mut(idx).expect("distinct");
            let b = [b0, b1, b2, b3, b4, b5, b6, b7, b8];
            experts_forward_in(be, op, b, Some((u.whole(), t.whole())), wts, (n, chunk));
        }
    }
}

/// [`experts_forward`] over its slots (inp, sel, wts, out, gu, xs, s, ys, idx) and the
/// adapters' scratch.
fn experts_forward_in<'o, B: Backend>(
    be: &B,
    op: &'o Op,
    [h, sl, w, o, g, xs, s, ys, idx]: [&mut Slot<'_, B::Buf>; 9],
    mut scratch: Option<(&mut B::Buf, &mut B::Buf)>,
    wts: &mut Weights<'_, B>,
    (n, chunk): (usize, Option<&ExpertChunk>),
) {
    let Op::Experts { e, k, i, c, ref lora, .. } = *op else { unreachable!() };
    let m = n * k;
    let host = &mut *wts.moe.as_mut().expect("a sparse layer runs with its MoeIo").host;
    let first = chunk.is_none_or(|ch| ch.first);
    if first {
        host.sort(be, sl.r(m), idx.w(2 * m), m, e);
    }
    let order = idx.r(2 * m).slice(0..m);
    let (slot, packed, map) = (wts.slot, &mut wts.packed, wts.map);
    let adapter = |l: Option<&'o ExpertLora>, x, ic, oc| {
        l.map(|l| {
            let (a, b) = adapter_ranges(l, x, ic, oc);
            (slot.slice(at(map, &a)), slot.slice(at(map, &b)), l)
        })
    };
    let out = o.w(n * c);
    if first {
        be.zero(out);
    }
    // Expert by expert: its rows gathered, through gate|up, SwiGLU and down, added back.
    for (x, pos, cnt) in host.segments_in(chunk) {
        let ord = order.slice(pos..pos + cnt);
        let (xs, g) = (xs.w(cnt * c), g.w(cnt * 2 * i));
        be.moe_gather(xs, h.r(n * c), ord, k, c);
        let wgu = expert_mat(be, (slot, &mut *packed, map), op, x, false);
        let sc = scratch.as_mut().map(|(u, t)| (&mut **u, &mut **t));
        let gate_up = adapter(lora.gate_up.as_ref(), x, c, 2 * i);
        let bgu = expert_bias::<B>((slot, map), op, x, false);
        project(be, (&mut *g, &*xs), (wgu, bgu), gate_up, sc, cnt, c, 2 * i);
        let (s, ys) = (s.w(cnt * i), ys.w(cnt * c));
        glu_forward(be, op, s, g, cnt);
        let wd = (
            expert_mat(be, (slot, &mut *packed, map), op, x, true),
            expert_bias::<B>((slot, map), op, x, true),
        );
        let sc = scratch.as_mut().map(|(u, t)| (&mut **u, &mut **t));
        project(be, (&mut *ys, &*s), wd, adapter(lora.down.as_ref(), x, i, c), sc, cnt, i, c);
        be.moe_scatter_add(out, ys, ord, Some(w.r(m)), k, c);
    }
}

/// The gradient buffers of [`Op::Experts`]' backward (`BwdOp::Experts`): `dinp` (N, C),
/// `dout` (N, C), `dwts` (N, k) and the scratch `t`, each at most N rows (one expert's).
pub(crate) struct ExpertGrads<'g, T: ?Sized> {
    pub dinp: Dinp<'g, T>,
    pub dout: &'g T,
    pub dwts: &'g mut T,
    /// dy|dxs, sw, ds, dgu, xs, s, idx, u|du, g, gu.
    pub t: [&'g mut T; 10],
}

/// An expert adapter's backward over `cnt` rows of a projection `ic -> oc` whose output
/// gradient is `dout` and input `inp`: `g = scale dout`, `du = g B_e`, `dinp += du A_e`,
/// `dB_e += g^T u`, `dA_e += du^T inp` with `u = inp A_e^T` (recomputed; with `u_in`, `u`
/// from that input instead: the down projection's weighted rows).
struct AdapterGrad<'a, T: ?Sized> {
    dinp: &'a mut T,
    dout: &'a T,
    inp: &'a T,
    u_in: &'a T,
}

#[allow(clippy::too_many_arguments)]
fn adapter_backward<B: Backend>(
    be: &B,
    g: AdapterGrad<'_, B::Buf>,
    (a, b, l): (&B::WBuf, &B::WBuf, &ExpertLora),
    (da, db): (Option<&mut B::Buf>, Option<&mut B::Buf>),
    (ubuf, gbuf): (&mut B::Buf, &mut B::Buf),
    cnt: usize,
    ic: usize,
    oc: usize,
) {
    let r = l.r;
    let (u, du) = ubuf.slice_mut(0..2 * cnt * r).split_at_mut(cnt * r);
    let gg = gbuf.slice_mut(0..cnt * oc);
    be.matmul_forward(u, g.u_in, a, None, cnt, ic, r);
    be.scaled_cols(gg, g.dout, cnt, oc, 0, oc, l.scale);
    be.matmul_backward(Some(Dinp::Write(du)), db, None, gg, u, b, cnt, r, oc);
    be.matmul_backward(Some(Dinp::Add(g.dinp)), da, None, du, g.inp, a, cnt, ic, r);
}

/// [`Op::Experts`] backward: `dinp` (written or added), `dwts` (written), and the expert
/// weights' (or their adapters') gradients added into `dw` (absent when they are frozen).
/// Expert by expert, its forward recomputed from its gathered rows first.
pub(crate) fn experts_backward<B: Backend>(
    be: &B,
    (spec, op): (&LayerSpec, &Op),
    g: ExpertGrads<'_, B::Buf>,
    dw: &mut B::Buf,
    acts: &[Slot<'_, B::Buf>],
    wts: &mut Weights<'_, B>,
    (n, chunk): (usize, Option<&ExpertChunk>),
) {
    let Op::Experts { inp, sel, wts: rw, e, k, c, .. } = *op else { unreachable!() };
    let m = n * k;
    let act = |a: Act, w: usize| acts[a].r(n * w);
    let [dy, sw, ds, dgu, xs, s, idx, ubuf, gbuf, gu] = g.t;
    let host = &mut *wts.moe.as_mut().expect("a sparse layer runs with its MoeIo").host;
    if chunk.is_none_or(|ch| ch.first) {
        host.sort(be, act(sel, k), idx, m, e);
    }
    let order = idx.slice(0..m);
    let dinp = match g.dinp {
        Dinp::Write(d) => {
            be.zero(d);
            d
        }
        Dinp::Add(d) => d,
    };
    let (w, h) = (act(rw, k), act(inp, c));
    let ws = (wts.slot, &mut wts.packed, wts.map);
    let mut bufs = ExpertBufs { dy, sw, ds, dgu, xs, s, gu, u: ubuf, t: gbuf };
    for (x, pos, cnt) in host.segments_in(chunk) {
        let ord = order.slice(pos..pos + cnt);
        let seg = Segment { x, cnt, ord, w, h, dout: g.dout };
        expert_backward(
            be,
            (spec, op),
            seg,
            &mut bufs,
            (&mut *dinp, &mut *g.dwts, &mut *dw),
            (ws.0, &mut *ws.1, ws.2),
        );
    }
}

/// One expert's pairs in a backward: its index, its pairs' count and indices, the routing
/// weights (M), the layer input (N, C) and the output's gradient (N, C).
struct Segment<'a, T: ?Sized> {
    x: usize,
    cnt: usize,
    ord: &'a T,
    w: &'a T,
    h: &'a T,
    dout: &'a T,
}

/// The scratch of one expert's backward, each at least N rows.
struct ExpertBufs<'a, T: ?Sized> {
    dy: &'a mut T,
    sw: &'a mut T,
    ds: &'a mut T,
    dgu: &'a mut T,
    xs: &'a mut T,
    s: &'a mut T,
    gu: &'a mut T,
    u: &'a mut T,
    t: &'a mut T,
}

/// One expert's backward: recompute its gate|up and SwiGLU from its gathered rows; down:
/// `ds' = dy W_d` (unweighted), `dW_d += dy^T (w s)`, its adapter joining `ds'`; `dwts = ds' . s`;
/// gate|up through the weighted `ds`; its rows' input gradient added into `dinp`.
#[allow(clippy::too_many_arguments)]
fn expert_backward<'o, B: Backend>(
    be: &B,
    (spec, op): (&LayerSpec, &'o Op),
    seg: Segment<'_, B::Buf>,
    b: &mut ExpertBufs<'_, B::Buf>,
    (dinp, dwts, dw): (&mut B::Buf, &mut B::Buf, &mut B::Buf),
    (slot, packed, map): (&B::WBuf, &mut Option<Packed<'_, B>>, Option<&SlotMap>),
) {
    let Op::Experts { ref gate_up, ref down, k, i, c, ref lora, ref bias, .. } = *op else {
        unreachable!()
    };
    let Segment { x, cnt, ord, w, h, dout } = seg;
    let part = |r: &Range<usize>, len: usize| r.start + x * len..r.start + (x + 1) * len;
    let (xs, gu, s) =
        (b.xs.slice_mut(0..cnt * c), b.gu.slice_mut(0..cnt * 2 * i), b.s.slice_mut(0..cnt * i));
    let (dy, sw, ds) =
        (b.dy.slice_mut(0..cnt * c), b.sw.slice_mut(0..cnt * i), b.ds.slice_mut(0..cnt * i));
    let dgu = b.dgu.slice_mut(0..cnt * 2 * i);
    let adapter = |l: Option<&'o ExpertLora>, ic, oc| {
        l.map(|l| {
            let (ra, rb) = adapter_ranges(l, x, ic, oc);
            (ra, rb, l)
        })
    };
    be.moe_gather(xs, h, ord, k, c);
    let gate = adapter(lora.gate_up.as_ref(), c, 2 * i);
    let wgu = expert_mat(be, (slot, &mut *packed, map), op, x, false);
    let fwd =
        gate.as_ref().map(|(ra, rb, l)| (slot.slice(at(map, ra)), slot.slice(at(map, rb)), *l));
    let wgu = (wgu, expert_bias::<B>((slot, map), op, x, false));
    project(be, (&mut *gu, &*xs), wgu, fwd, Some((&mut *b.u, &mut *b.t)), cnt, c, 2 * i);
    glu_forward(be, op, s, gu, cnt);
    be.moe_gather(dy, dout, ord, k, c);
    be.copy(sw, s);
    be.moe_scale_rows(sw, w, ord, i);
    let wd = expert_mat(be, (slot, &mut *packed, map), op, x, true);
    // An expert matrix's gradient, where it is trained (NF4 experts have empty ranges).
    let grad_of = |r: &Range<usize>, len| {
        let g = (!r.is_empty()).then(|| part(r, len)).and_then(|p| spec.grad_range(&p));
        grad_at(map, g)
    };
    let ddw = grad_of(down, c * i).map(|g| dw.slice_mut(g));
    be.matmul_backward(Some(Dinp::Write(&mut *ds)), ddw, None, dy, sw, wd, cnt, i, c);
    if let Some((ra, rb, l)) = adapter(lora.down.as_ref(), i, c) {
        let ag = AdapterGrad { dinp: &mut *ds, dout: dy, inp: sw, u_in: sw };
        let grads = two_grads((spec, map), dw, &ra, &rb);
        let ws = (slot.slice(at(map, &ra)), slot.slice(at(map, &rb)), l);
        adapter_backward(be, ag, ws, grads, (&mut *b.u, &mut *b.t), cnt, i, c);
    }
    be.moe_row_dots(dwts, ds, s, ord, i);
    let bias = bias.as_ref().map(|[gu, dn]| (part(gu, 2 * i), part(dn, c)));
    if let Some((_, dn)) = &bias {
        // gpt-oss: the weight scales the down bias too, `dwts += dy . d`, `dd += sum w dy`.
        be.moe_bias_dots(dwts, dy, slot.slice(at(map, dn)), ord, c);
        if let Some(g) = grad_at(map, spec.grad_range(dn)) {
            be.moe_scale_rows(dy, w, ord, c);
            be.matmul_backward(None, None, Some(dw.slice_mut(g)), dy, sw, wd, cnt, i, c);
        }
    }
    be.moe_scale_rows(ds, w, ord, i);
    glu_backward(be, op, dgu, ds, gu, cnt);
    let dxs = dy;
    let wgu = expert_mat(be, (slot, &mut *packed, map), op, x, false);
    let dgw = grad_of(gate_up, 2 * i * c);
    let dgb = bias.and_then(|(gu, _)| grad_at(map, spec.grad_range(&gu)));
    let (dgw, dgb) = crate::model::layer::two_mut(dw, dgw, dgb);
    be.matmul_backward(Some(Dinp::Write(&mut *dxs)), dgw, dgb, dgu, xs, wgu, cnt, c, 2 * i);
    if let Some((ra, rb, l)) = gate {
        let ag = AdapterGrad { dinp: &mut *dxs, dout: dgu, inp: xs, u_in: xs };
        let grads = two_grads((spec, map), dw, &ra, &rb);
        let ws = (slot.slice(at(map, &ra)), slot.slice(at(map, &rb)), l);
        adapter_backward(be, ag, ws, grads, (&mut *b.u, &mut *b.t), cnt, c, 2 * i);
    }
    be.moe_scatter_add(dinp, dxs, ord, None, k, c);
}

/// The gradients of two disjoint trained ranges (an adapter's A and B) of `dw`.
fn two_grads<'d, T: ?Sized + DeviceSlice>(
    (spec, map): (&LayerSpec, Option<&SlotMap>),
    dw: &'d mut T,
    a: &Range<usize>,
    b: &Range<usize>,
) -> (Option<&'d mut T>, Option<&'d mut T>) {
    let (ga, gb) = (grad_at(map, spec.grad_range(a)), grad_at(map, spec.grad_range(b)));
    crate::model::layer::two_mut(dw, ga, gb)
}

/// HF's load-balancing loss from a pass's pooled statistics (`stats` (2E): real rows' expert
/// counts, then their probability sums, over every sparse layer of `layout`): `aux = E sum_e
/// f_e P_e` with `f_e = counts_e / (L_s N)`, `P_e = psum_e / (L_s N)`, `N` the real rows, `L_s`
/// the sparse layers. Writes into `grad` (E) the gradient of `coef * aux` (`coef` the trained
/// coefficient: 0 unless `output_router_logits`) with respect to one real row's probability of
/// expert e in one sparse layer: `coef E f_e / (L_s N)` (only P carries gradient). Returns
/// (aux, coef); aux is 0 when the pass has no real row.
pub fn aux_loss(
    stats: &[f32],
    layout: &ModelLayout,
    real_rows: f64,
    grad: &mut [f32],
) -> (f64, f64) {
    let moe = layout.moe.as_ref().expect("a sparse model");
    let coef = moe.trained_coef();
    let sparse = (0..layout.dims.layers).filter(|&i| moe.is_sparse(i)).count();
    let e = stats.len() / 2;
    let denom = sparse as f64 * real_rows;
    if denom == 0.0 {
        grad.fill(0.0);
        return (0.0, coef);
    }
    let (counts, psum) = stats.split_at(e);
    let f = |x: usize| counts[x] as f64 / denom;
    let aux = e as f64 * (0..e).map(|x| f(x) * psum[x] as f64 / denom).sum::<f64>();
    for (x, g) in grad.iter_mut().enumerate() {
        *g = (coef * e as f64 * f(x) / denom) as f32;
    }
    (aux, coef)
}
