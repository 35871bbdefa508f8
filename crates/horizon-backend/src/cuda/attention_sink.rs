//! Launchers of `kernels/attention_sink.cu`: learned attention sinks (gpt-oss) folded into an
//! attention forward's `out` and `lse`, and the sinks' gradient. Reference and derivation:
//! `cpu/attention_sink.rs`.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len, int};
use super::slice::DevSlice;
use crate::{AttnDims, Bf16};

/// Threads a block of both kernels; must match the kernel's SINK_THREADS.
const THREADS: u32 = 256;

/// Checks the lengths of a sink call; returns the kernels' `(N, T, H, D)`.
fn check(op: &str, dims: AttnDims, out: usize, lse: usize, sinks: usize) -> [i32; 4] {
    expect_len(op, "out", out, dims.n() * dims.h * dims.d);
    expect_len(op, "lse", lse, dims.b * dims.h * dims.t);
    expect_len(op, "sinks", sinks, dims.h);
    [int(dims.n(), "N"), int(dims.t, "T"), int(dims.h, "H"), int(dims.d, "D")]
}

/// out: (N, H*D), in place. lse: (B, H, T), in place (overwritten with lse'). sinks: (H).
pub(crate) fn attention_sink_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    lse: &mut DevSlice<f32>,
    sinks: &DevSlice<Bf16>,
    dims: AttnDims,
) {
    let op = "attention_sink_forward";
    let [n, t, h, d] = check(op, dims, out.len(), lse.len(), sinks.len());
    if dims.n() * dims.h == 0 {
        return;
    }
    let (o, l, s) = (out.addr(), lse.addr(), sinks.addr());
    // SAFETY: argument types match (three pointers, four ints); one thread per (row, head),
    // each reading and writing only its own D columns of out (N, H*D) and its element of lse
    // (B, H, T), reading sinks (H); lengths checked above.
    unsafe {
        be.launch(
            op,
            (blocks(dims.n() * dims.h, THREADS), 1, 1),
            (THREADS, 1, 1),
            0,
            &mut [arg(&o), arg(&l), arg(&s), arg(&n), arg(&t), arg(&h), arg(&d)],
        );
    }
}

/// dsinks: (H), accumulates (+=). dout: (N, H*D). out: (N, H*D), lse: (B, H, T): the
/// sink-adjusted ones. sinks: (H).
pub(crate) fn attention_sink_backward(
    be: &CudaBackend,
    dsinks: &mut DevSlice<f32>,
    dout: &DevSlice<f32>,
    out: &DevSlice<f32>,
    lse: &DevSlice<f32>,
    sinks: &DevSlice<Bf16>,
    dims: AttnDims,
) {
    let op = "attention_sink_backward";
    let [n, t, h, d] = check(op, dims, out.len(), lse.len(), sinks.len());
    expect_len(op, "dout", dout.len(), out.len());
    expect_len(op, "dsinks", dsinks.len(), dims.h);
    if dims.h == 0 {
        return;
    }
    let (ds, dy, o, l, s) = (dsinks.addr(), dout.addr(), out.addr(), lse.addr(), sinks.addr());
    // SAFETY: argument types match (five pointers, four ints); one block per head, reading its
    // columns of dout and out (N, H*D), its rows of lse (B, H, T) and sinks[h], writing only
    // dsinks[h] (H); lengths checked above.
    unsafe {
        be.launch(
            op,
            (dims.h as u32, 1, 1),
            (THREADS, 1, 1),
            0,
            &mut [
                arg(&ds),
                arg(&dy),
                arg(&o),
                arg(&l),
                arg(&s),
                arg(&n),
                arg(&t),
                arg(&h),
                arg(&d),
            ],
        );
    }
}
