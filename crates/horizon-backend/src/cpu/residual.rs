//! Residual add on the CPU (`out = a + b`) and in-place accumulation (`acc += x`), which is
//! also the residual's backward and gradient accumulation.

use rayon::prelude::*;

/// Elements per parallel task: below this, splitting costs more than it saves.
const CHUNK: usize = 1 << 14;

/// Residual forward: `out = a + b`, elementwise.
///
/// out: (len), overwrites.
/// a, b: (len).
pub fn residual_forward(out: &mut [f32], a: &[f32], b: &[f32]) {
    assert_eq!(out.len(), a.len(), "residual_forward: out and a differ in length");
    assert_eq!(out.len(), b.len(), "residual_forward: out and b differ in length");
    out.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK))).for_each(
        |(o, (a, b))| {
            for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        },
    );
}

// Residual backward: out = a + b gives dL/da = dL/db = dout, so the backward of a residual
// branch is `acc += dout` into each input's gradient:
//   acc[i] += x[i]                                                 (accumulates)

/// In-place add: `acc += x`, elementwise.
///
/// acc: (len), accumulates (+=).
/// x: (len).
pub fn add_inplace(acc: &mut [f32], x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "add_inplace: acc and x differ in length");
    acc.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(acc, x)| {
        for (a, x) in acc.iter_mut().zip(x) {
            *a += x;
        }
    });
}
