//! Launchers of `kernels/moe.cu`: mixture-of-experts routing (top-k softmax and its backward),
//! the pooled load-balancing statistics, and the dispatch ops (gather into expert order, the
//! weighted combine back, row scaling, row dots, bias dots). Reference, data flow and
//! derivations: `cpu/moe.rs`.
//!
//! Index buffers (`sel`, `order`, `pos`) hold exact small integers as f32; the kernels trust
//! them as the CPU does (`order` and `pos` come from the host's `moe_sort`, `sel` from the
//! routing forward).

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len, int};
use super::slice::DevSlice;
use crate::{Bf16, MoeDims};

/// The sizes every routing kernel takes, as the kernels' ints: `(N, E, k, norm)`.
fn route_ints(op: &str, dims: MoeDims) -> (i32, i32, i32, i32) {
    let MoeDims { n, e, k, norm } = dims;
    assert!(k > 0 && k <= e, "{op}: k = {k} must lie in 1..=E (E = {e})");
    (int(n, "N"), int(e, "E"), int(k, "k"), i32::from(norm))
}

/// probs: (N, E), sel: (N, k), wts: (N, k), all overwrite. logits: (N, E).
pub(crate) fn moe_route_forward(
    be: &CudaBackend,
    probs: &mut DevSlice<f32>,
    sel: &mut DevSlice<f32>,
    wts: &mut DevSlice<f32>,
    logits: &DevSlice<f32>,
    dims: MoeDims,
) {
    let op = "moe_route_forward";
    let MoeDims { n, e, k, .. } = dims;
    expect_len(op, "probs", probs.len(), n * e);
    expect_len(op, "sel", sel.len(), n * k);
    expect_len(op, "wts", wts.len(), n * k);
    expect_len(op, "logits", logits.len(), n * e);
    let (nn, ee, kk, norm) = route_ints(op, dims);
    let (p, s, w, l) = (probs.addr(), sel.addr(), wts.addr(), logits.addr());
    // SAFETY: argument types match (four pointers, four ints); one thread per row, each
    // reading and writing only its own row of the (N, E) and (N, k) buffers, lengths checked.
    unsafe {
        be.launch(
            op,
            (blocks(n, 128), 1, 1),
            (128, 1, 1),
            0,
            &mut [arg(&p), arg(&s), arg(&w), arg(&l), arg(&nn), arg(&ee), arg(&kk), arg(&norm)],
        );
    }
}

/// dlogits: (N, E), overwrites. dwts: (N, k). probs: (N, E), sel: (N, k) as the forward left
/// them. aux: `(g (E), mask (N))`, the load-balancing gradient `dprobs[r, e] += mask[r] g[e]`.
pub(crate) fn moe_route_backward(
    be: &CudaBackend,
    dlogits: &mut DevSlice<f32>,
    dwts: &DevSlice<f32>,
    probs: &DevSlice<f32>,
    sel: &DevSlice<f32>,
    aux: Option<(&DevSlice<f32>, &DevSlice<f32>)>,
    dims: MoeDims,
) {
    let op = "moe_route_backward";
    let MoeDims { n, e, k, .. } = dims;
    expect_len(op, "dlogits", dlogits.len(), n * e);
    expect_len(op, "dwts", dwts.len(), n * k);
    expect_len(op, "probs", probs.len(), n * e);
    expect_len(op, "sel", sel.len(), n * k);
    // Without aux the kernel reads neither g nor mask: probs stands in for both (a launch
    // takes no null pointer).
    let (g, mask, has_aux) = match aux {
        Some((g, mask)) => {
            expect_len(op, "g", g.len(), e);
            expect_len(op, "mask", mask.len(), n);
            (g.addr(), mask.addr(), 1i32)
        }
        None => (probs.addr(), probs.addr(), 0i32),
    };
    let (nn, ee, kk, norm) = route_ints(op, dims);
    let (dl, dw, p, s) = (dlogits.addr(), dwts.addr(), probs.addr(), sel.addr());
    // SAFETY: argument types match (six pointers, five ints); one thread per row, reading its
    // rows of dwts, probs, sel and mask, all of g, and writing its own row of dlogits, lengths
    // checked (g and mask only read when given, and then checked).
    unsafe {
        be.launch(
            op,
            (blocks(n, 128), 1, 1),
            (128, 1, 1),
            0,
            &mut [
                arg(&dl),
                arg(&dw),
                arg(&p),
                arg(&s),
                arg(&g),
                arg(&mask),
                arg(&nn),
                arg(&ee),
                arg(&kk),
                arg(&norm),
                arg(&has_aux),
            ],
        );
    }
}

/// stats: (2E), accumulates. probs: (N, E). sel: (N, k). mask: (N).
pub(crate) fn moe_aux_stats(
    be: &CudaBackend,
    stats: &mut DevSlice<f32>,
    probs: &DevSlice<f32>,
    sel: &DevSlice<f32>,
    mask: &DevSlice<f32>,
    dims: MoeDims,
) {
    let op = "moe_aux_stats";
    let MoeDims { n, e, k, .. } = dims;
    expect_len(op, "stats", stats.len(), 2 * e);
    expect_len(op, "probs", probs.len(), n * e);
    expect_len(op, "sel", sel.len(), n * k);
    expect_len(op, "mask", mask.len(), n);
    let (nn, ee, kk) = (int(n, "N"), int(e, "E"), int(k, "k"));
    let (st, p, s, m) = (stats.addr(), probs.addr(), sel.addr(), mask.addr());
    // SAFETY: argument types match (four pointers, three ints); one thread per expert, writing
    // only its two elements of stats (2E), reading every row of probs, sel and mask, lengths
    // checked.
    unsafe {
        be.launch(
            op,
            (blocks(e, 64), 1, 1),
            (64, 1, 1),
            0,
            &mut [arg(&st), arg(&p), arg(&s), arg(&m), arg(&nn), arg(&ee), arg(&kk)],
        );
    }
}

/// xs: (M, C), overwrites: `xs[i] = x[order[i] / k]`. x: (N, C). order: (M).
pub(crate) fn moe_gather(
    be: &CudaBackend,
    xs: &mut DevSlice<f32>,
    x: &DevSlice<f32>,
    order: &DevSlice<f32>,
    k: usize,
    c: usize,
) {
    let op = "moe_gather";
    assert!(k > 0, "{op}: k must be at least 1");
    let m = order.len();
    expect_len(op, "xs", xs.len(), m * c);
    if c == 0 {
        return;
    }
    assert!(x.len().is_multiple_of(c), "{op}: x has {} elements, not rows of C = {c}", x.len());
    let (o, xx, ord) = (xs.addr(), x.addr(), order.addr());
    let (mm, kk, cc) = (m as i64, k as i64, c as i64);
    // SAFETY: argument types match (three pointers, three long longs); one thread per element
    // of xs (M, C), lengths checked; the rows of x it reads are those `order` names (pair
    // indices below N*k, the caller's contract, as on the CPU).
    unsafe {
        be.launch(
            op,
            (blocks(m * c, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&xx), arg(&ord), arg(&mm), arg(&kk), arg(&cc)],
        );
    }
}

/// out: (N, C), accumulates: `out[order[i] / k] += wts[order[i]] * src[i]` (w = 1 without
/// wts). src: (S, C). order: (S), pairs of distinct rows. wts: (M).
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_scatter_add(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    src: &DevSlice<f32>,
    order: &DevSlice<f32>,
    wts: Option<&DevSlice<f32>>,
    k: usize,
    c: usize,
) {
    let op = "moe_scatter_add";
    assert!(k > 0, "{op}: k must be at least 1");
    let s = order.len();
    expect_len(op, "src", src.len(), s * c);
    assert!(c == 0 || out.len().is_multiple_of(c), "{op}: out is not rows of C = {c}");
    // Without wts the kernel does not read it: order stands in (a launch takes no null pointer).
    let (w, has_wts) = match wts {
        Some(w) => (w.addr(), 1i32),
        None => (order.addr(), 0i32),
    };
    let (o, sr, od) = (out.addr(), src.addr(), order.addr());
    let (ss, kk, cc) = (s as i64, k as i64, c as i64);
    // SAFETY: argument types match (four pointers, three long longs, an int); one thread per
    // element of src (S, C), adding into the row of out (N, C) its pair names (a pair index
    // below M = N k, from `moe_sort`, so a row below N), rows distinct (the caller's
    // contract: one expert's pairs), lengths checked.
    unsafe {
        be.launch(
            op,
            (blocks(s * c, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [
                arg(&o),
                arg(&sr),
                arg(&od),
                arg(&w),
                arg(&ss),
                arg(&kk),
                arg(&cc),
                arg(&has_wts),
            ],
        );
    }
}

/// buf: (M, W), in place: `buf[i] *= wts[order[i]]`. wts: (M). order: (M).
pub(crate) fn moe_scale_rows(
    be: &CudaBackend,
    buf: &mut DevSlice<f32>,
    wts: &DevSlice<f32>,
    order: &DevSlice<f32>,
    w: usize,
) {
    let op = "moe_scale_rows";
    let m = order.len();
    expect_len(op, "buf", buf.len(), m * w);
    let (b, ws, ord, mm, ww) = (buf.addr(), wts.addr(), order.addr(), m as i64, w as i64);
    // SAFETY: argument types match (three pointers, two long longs); one thread per element
    // of buf (M, W), lengths checked; the elements of wts it reads are those `order` names
    // (pair indices, the caller's contract, as on the CPU).
    unsafe {
        be.launch(
            op,
            (blocks(m * w, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&b), arg(&ws), arg(&ord), arg(&mm), arg(&ww)],
        );
    }
}

/// out: (M), its entries `order[i]` overwritten with `a[i] . b[i]`. a, b: (S, W). order: (S).
pub(crate) fn moe_row_dots(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    a: &DevSlice<f32>,
    b: &DevSlice<f32>,
    order: &DevSlice<f32>,
    w: usize,
) {
    let op = "moe_row_dots";
    let s = order.len();
    expect_len(op, "a", a.len(), s * w);
    expect_len(op, "b", b.len(), s * w);
    let (o, aa, bb, od, ss, ww) =
        (out.addr(), a.addr(), b.addr(), order.addr(), s as i64, w as i64);
    // SAFETY: argument types match (four pointers, two long longs); one warp per pair (blocks
    // of 8 whole warps), each reading its rows of a and b (S, W) and writing the element of out
    // (M) its pair index names (below M, from `moe_sort`), lengths checked.
    unsafe {
        be.launch(
            op,
            (blocks(s, 8), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&aa), arg(&bb), arg(&od), arg(&ss), arg(&ww)],
        );
    }
}

/// out: (M), its entries `order[i]` accumulate (+=) `dy[i] . bias`. dy: (S, C). bias: (C), bf16.
/// order: (S).
pub(crate) fn moe_bias_dots(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    dy: &DevSlice<f32>,
    bias: &DevSlice<Bf16>,
    order: &DevSlice<f32>,
    c: usize,
) {
    let op = "moe_bias_dots";
    let s = order.len();
    expect_len(op, "dy", dy.len(), s * c);
    expect_len(op, "bias", bias.len(), c);
    if s == 0 {
        return;
    }
    let (o, y, b, od, ss, cc) =
        (out.addr(), dy.addr(), bias.addr(), order.addr(), s as i64, c as i64);
    // SAFETY: argument types match (four pointers, bias as bf16 bits; two long longs); one warp
    // per pair (blocks of 8 whole warps), each reading its row of dy (S, C) and all of bias (C)
    // and adding into the element of out (M) its pair index names (below M, from `moe_sort`;
    // distinct within a call), lengths checked.
    unsafe {
        be.launch(
            op,
            (blocks(s, 8), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&y), arg(&b), arg(&od), arg(&ss), arg(&cc)],
        );
    }
}
