//! Launchers of `kernels/cross_entropy.cu`: per-row losses, and the fused forward + backward
//! on one LM-head chunk (logits -> dlogits in place). Derivation: `cpu/cross_entropy.rs`.
//! A target outside `0..V` (other than -100) is not checked on the device: the engine's data
//! loader refuses such ids before they get here.

use super::CudaBackend;
use super::backend::{arg, expect_len, int};
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
