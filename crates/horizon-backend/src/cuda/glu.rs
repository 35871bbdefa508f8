//! Launchers of the gated MLP activations, `kernels/swiglu.cu` (`out = silu(gate) * up`) and
//! `kernels/geglu.cu` (`out = gelu_tanh(gate) * up`), and gpt-oss's clamped SwiGLU (in
//! `kernels/swiglu.cu`, two more arguments): one launcher serves each direction, given the
//! kernel's name. Derivations of the backwards:
//! the kernel files' headers and `cpu/swiglu.rs`, `cpu/geglu.rs`.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len, int};
use super::slice::DevSlice;
use crate::GluClamp;

/// The kernels' trailing arguments: the clamp's `alpha` and `limit` for gpt-oss's clamped
/// SwiGLU, none for the others.
fn clamp_args(c: &Option<GluClamp>) -> Vec<*mut std::ffi::c_void> {
    c.as_ref().map_or_else(Vec::new, |c| vec![arg(&c.alpha), arg(&c.limit)])
}

/// out: (N, F), overwrites. gate_up: (N, 2F). `clamp`: the clamped kernel's parameters.
pub(crate) fn glu_forward(
    be: &CudaBackend,
    kernel: &'static str,
    out: &mut DevSlice<f32>,
    gate_up: &DevSlice<f32>,
    (n, f): (usize, usize),
    clamp: Option<GluClamp>,
) {
    expect_len(kernel, "out", out.len(), n * f);
    expect_len(kernel, "gate_up", gate_up.len(), n * 2 * f);
    let (o, g, nn, ff) = (out.addr(), gate_up.addr(), int(n, "N"), int(f, "F"));
    let mut args = vec![arg(&o), arg(&g), arg(&nn), arg(&ff)];
    args.extend(clamp_args(&clamp));
    // SAFETY: argument types match; one thread per element of out, lengths checked.
    unsafe { be.launch(kernel, (blocks(n * f, 256), 1, 1), (256, 1, 1), 0, &mut args) }
}

/// dgate_up: (N, 2F), overwrites. dout: (N, F). gate_up: (N, 2F). `clamp`: as the forward's.
pub(crate) fn glu_backward(
    be: &CudaBackend,
    kernel: &'static str,
    dgate_up: &mut DevSlice<f32>,
    (dout, gate_up): (&DevSlice<f32>, &DevSlice<f32>),
    (n, f): (usize, usize),
    clamp: Option<GluClamp>,
) {
    expect_len(kernel, "dgate_up", dgate_up.len(), n * 2 * f);
    expect_len(kernel, "dout", dout.len(), n * f);
    expect_len(kernel, "gate_up", gate_up.len(), n * 2 * f);
    let (dg, dy, g) = (dgate_up.addr(), dout.addr(), gate_up.addr());
    let (nn, ff) = (int(n, "N"), int(f, "F"));
    let mut args = vec![arg(&dg), arg(&dy), arg(&g), arg(&nn), arg(&ff)];
    args.extend(clamp_args(&clamp));
    // SAFETY: argument types match; one thread per element of dout, lengths checked.
    unsafe { be.launch(kernel, (blocks(n * f, 256), 1, 1), (256, 1, 1), 0, &mut args) }
}
