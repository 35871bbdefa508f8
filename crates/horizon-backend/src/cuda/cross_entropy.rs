//! Launchers of `kernels/cross_entropy.cu`: per-row losses, the fused forward + backward on
//! one LM-head chunk (logits -> dlogits in place), and the same over vocabulary tiles (running
//! stats per tile, dlogits per tile, losses from the stats). Derivation: `cpu/cross_entropy.rs`.
//! A target outside `0..V` (other than -100) is not checked on the device: the engine's data
//! loader refuses such ids before they get here.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len, int};
use super::slice::DevSlice;

/// losses: (N), overwrites. logits: (N, V). targets: (N).
pub(crate) fn cross_entropy_forward(
    be: &CudaBackend,
    losses: &mut DevSlice<f32>,
    logits: &DevSlice<f32>,
    targets: &DevSlice<i32>,
    n: usize,
    v: usize,
) {
    assert!(v > 0, "cross_entropy_forward: V must be positive");
    expect_len("cross_entropy_forward", "losses", losses.len(), n);
    expect_len("cross_entropy_forward", "logits", logits.len(), n * v);
    expect_len("cross_entropy_forward", "targets", targets.len(), n);
    let (l, x, t, nn, vv) =
        (losses.addr(), logits.addr(), targets.addr(), int(n, "N"), int(v, "V"));
    // SAFETY: argument types match; one block per row of (N, V) logits.
    unsafe {
        be.launch(
            "cross_entropy_forward",
            (n as u32, 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&l), arg(&x), arg(&t), arg(&nn), arg(&vv)],
        );
    }
}

/// logits: (N, V), overwritten with `scale * (softmax - onehot)` (0 on ignored rows).
/// losses: (N), overwrites. targets: (N).
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_fused(
    be: &CudaBackend,
    logits: &mut DevSlice<f32>,
    losses: &mut DevSlice<f32>,
    targets: &DevSlice<i32>,
    n: usize,
    v: usize,
    scale: f32,
) {
    assert!(v > 0, "cross_entropy_fused: V must be positive");
    expect_len("cross_entropy_fused", "losses", losses.len(), n);
    expect_len("cross_entropy_fused", "logits", logits.len(), n * v);
    expect_len("cross_entropy_fused", "targets", targets.len(), n);
    let (x, l, t, nn, vv) =
        (logits.addr(), losses.addr(), targets.addr(), int(n, "N"), int(v, "V"));
    // SAFETY: argument types match; one block per row, in place on that row only.
    unsafe {
        be.launch(
            "cross_entropy_fused",
            (n as u32, 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&x), arg(&l), arg(&t), arg(&nn), arg(&vv), arg(&scale)],
        );
    }
}

/// The checks every tile op makes: a non-empty tile whose ids `v0..v0 + VT` fit the kernels'
/// `int`, and (N, VT) logits, (N, 3) stats, (N) targets.
fn expect_tile(
    op: &str,
    logits: usize,
    stats: usize,
    targets: usize,
    n: usize,
    vt: usize,
    v0: usize,
) {
    assert!(vt > 0, "{op}: the tile width VT must be positive");
    int(v0 + vt, "v0 + VT");
    expect_len(op, "logits", logits, n * vt);
    expect_len(op, "stats", stats, n * 3);
    expect_len(op, "targets", targets, n);
}

/// stats: (N, 3) `(m, s, t)`, overwritten with `first`, else updated from this tile.
/// logits: (N, VT), vocabulary ids `v0..v0 + VT`. targets: (N).
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_tile_stats(
    be: &CudaBackend,
    stats: &mut DevSlice<f32>,
    logits: &DevSlice<f32>,
    targets: &DevSlice<i32>,
    n: usize,
    vt: usize,
    v0: usize,
    first: bool,
) {
    let op = "cross_entropy_tile_stats";
    expect_tile(op, logits.len(), stats.len(), targets.len(), n, vt, v0);
    let (st, x, t) = (stats.addr(), logits.addr(), targets.addr());
    let (nn, vv, v00, f) = (int(n, "N"), int(vt, "VT"), int(v0, "v0"), i32::from(first));
    // SAFETY: argument types match; one block per row, writing that row's 3 stats only.
    unsafe {
        be.launch(
            op,
            (n as u32, 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&st), arg(&x), arg(&t), arg(&nn), arg(&vv), arg(&v00), arg(&f)],
        );
    }
}

/// logits: (N, VT), overwritten with `scale * (exp(l - lse) - onehot(target - v0))` (0 on
/// ignored rows). stats: (N, 3), complete over the vocabulary. targets: (N).
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_tile_grad(
    be: &CudaBackend,
    logits: &mut DevSlice<f32>,
    stats: &DevSlice<f32>,
    targets: &DevSlice<i32>,
    n: usize,
    vt: usize,
    v0: usize,
    scale: f32,
) {
    let op = "cross_entropy_tile_grad";
    expect_tile(op, logits.len(), stats.len(), targets.len(), n, vt, v0);
    let (x, st, t) = (logits.addr(), stats.addr(), targets.addr());
    let (nn, vv, v00) = (int(n, "N"), int(vt, "VT"), int(v0, "v0"));
    // SAFETY: argument types match; one block per row, in place on that row only.
    unsafe {
        be.launch(
            op,
            (n as u32, 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&x), arg(&st), arg(&t), arg(&nn), arg(&vv), arg(&v00), arg(&scale)],
        );
    }
}

/// losses: (N), overwrites: `m + ln s - t`, 0 on ignored rows. stats: (N, 3), complete.
/// targets: (N).
pub(crate) fn cross_entropy_tile_loss(
    be: &CudaBackend,
    losses: &mut DevSlice<f32>,
    stats: &DevSlice<f32>,
    targets: &DevSlice<i32>,
    n: usize,
) {
    let op = "cross_entropy_tile_loss";
    expect_len(op, "losses", losses.len(), n);
    expect_len(op, "stats", stats.len(), n * 3);
    expect_len(op, "targets", targets.len(), n);
    let (l, st, t, nn) = (losses.addr(), stats.addr(), targets.addr(), int(n, "N"));
    // SAFETY: argument types match; one thread per row of (N) losses and (N, 3) stats.
    unsafe {
        be.launch(
            op,
            (blocks(n, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&l), arg(&st), arg(&t), arg(&nn)],
        );
    }
}
