//! Launchers of `kernels/gate.cu`: the sigmoid row gate `out[r] = sigmoid(gate[r]) * inp[r]`
//! (Qwen2-MoE's shared expert) and its backward. Reference and derivation: `cpu/gate.rs`.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len};
use super::slice::DevSlice;

/// out: (N, C), overwrites. gate: (N). inp: (N, C).
pub(crate) fn sigmoid_gate_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    gate: &DevSlice<f32>,
    inp: &DevSlice<f32>,
    c: usize,
) {
    let op = "sigmoid_gate_forward";
    let n = gate.len();
    expect_len(op, "out", out.len(), n * c);
    expect_len(op, "inp", inp.len(), n * c);
    let (o, g, x, nn, cc) = (out.addr(), gate.addr(), inp.addr(), n as i64, c as i64);
    // SAFETY: argument types match (three pointers, two long longs); one thread per element
    // of out (N, C), reading the same element of inp (N, C) and its row's gate (N), lengths
    // checked.
    unsafe {
        be.launch(
            op,
            (blocks(n * c, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&g), arg(&x), arg(&nn), arg(&cc)],
        );
    }
}

/// dinp: (N, C), overwrites. dgate: (N), overwrites. dout, inp: (N, C). gate: (N).
pub(crate) fn sigmoid_gate_backward(
    be: &CudaBackend,
    dinp: &mut DevSlice<f32>,
    dgate: &mut DevSlice<f32>,
    dout: &DevSlice<f32>,
    gate: &DevSlice<f32>,
    inp: &DevSlice<f32>,
    c: usize,
) {
    let op = "sigmoid_gate_backward";
    let n = gate.len();
    expect_len(op, "dgate", dgate.len(), n);
    expect_len(op, "dinp", dinp.len(), n * c);
    expect_len(op, "dout", dout.len(), n * c);
    expect_len(op, "inp", inp.len(), n * c);
    let (dx, dg, dy, g, x) = (dinp.addr(), dgate.addr(), dout.addr(), gate.addr(), inp.addr());
    let cc = c as i64;
    // SAFETY: argument types match (five pointers, one long long); one block of 256 threads
    // (the kernel's BLOCK) per row r < N, writing row r of dinp (N, C) and dgate[r] (N) and
    // reading row r of dout and inp (N, C) and gate[r], lengths checked.
    unsafe {
        be.launch(
            op,
            (blocks(n, 1), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&dx), arg(&dg), arg(&dy), arg(&g), arg(&x), arg(&cc)],
        );
    }
}
