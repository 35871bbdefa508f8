//! Linear layer on the CPU: `out = inp @ weight^T + bias` and its backward.
//!
//! Data flow: inp (N, IC) x weight (OC, IC) -> out (N, OC).
//!
//! Speed without external crates: every output element is one dot product over contiguous `IC`
//! (8 lanes, autovectorised), four input rows share each weight row load, and tiles keep a block
//! of weight rows hot in cache while a block of input rows sweeps it. Rayon splits work into
//! fixed-size tiles; each output element is summed inside one task in a fixed order, so results
//! do not depend on the thread count.

use rayon::prelude::*;

use super::{axpy, dot, reduce8};

/// Rows of `out` (or `dinp`) per parallel task.
const ROW_TILE: usize = 32;
/// Weight rows swept by one row tile before moving on (keeps them in cache).
const OC_TILE: usize = 64;
/// Input rows per micro-kernel call: each weight row load is shared by `MR` dot products.
const MR: usize = 4;
/// Rows of `dweight` per parallel task in the backward.
const DW_ROWS: usize = 16;
/// Columns of `dweight` summed at once in a stack accumulator (`DW_ROWS * DW_COLS` floats).
const DW_COLS: usize = 64;

/// Four dot products `rows[k] . w` at once, sharing each load of `w`. Per output it performs
/// exactly the additions of [`dot`] (8 lanes, fixed tree, scalar tail), so a row gets the same
/// bits whether it is computed here or by `dot`.
#[inline(always)]
fn dot4(rows: [&[f32]; MR], w: &[f32]) -> [f32; MR] {
    let [a0, a1, a2, a3] = rows;
    let mut acc = [[0.0f32; 8]; MR];
    let lanes = w
        .chunks_exact(8)
        .zip(a0.chunks_exact(8))
        .zip(a1.chunks_exact(8))
        .zip(a2.chunks_exact(8))
        .zip(a3.chunks_exact(8));
    for ((((wv, x0), x1), x2), x3) in lanes {
        for l in 0..8 {
            acc[0][l] += x0[l] * wv[l];
            acc[1][l] += x1[l] * wv[l];
            acc[2][l] += x2[l] * wv[l];
            acc[3][l] += x3[l] * wv[l];
        }
    }
    let main = w.len() - w.len() % 8;
    std::array::from_fn(|k| {
        let mut s = reduce8(acc[k]);
        for (x, y) in rows[k][main..].iter().zip(&w[main..]) {
            s += x * y;
        }
        s
    })
}

/// Linear forward: `out[n, o] = sum_i inp[n, i] * weight[o, i] + bias[o]`.
///
/// out: (N, OC), overwrites.
/// inp: (N, IC).
/// weight: (OC, IC).
/// bias: (OC), or `None` for no bias.
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    assert_eq!(out.len(), n * oc, "matmul_forward: out must be (N, OC)");
    assert_eq!(inp.len(), n * ic, "matmul_forward: inp must be (N, IC)");
    assert_eq!(weight.len(), oc * ic, "matmul_forward: weight must be (OC, IC)");
    if let Some(b) = bias {
        assert_eq!(b.len(), oc, "matmul_forward: bias must be (OC)");
    }
    if n == 0 || oc == 0 {
        return;
    }
    let bias_of = |o: usize| bias.map_or(0.0, |b| b[o]);

    out.par_chunks_mut(ROW_TILE * oc).enumerate().for_each(|(tile, out_tile)| {
        let r0 = tile * ROW_TILE;
        let rows = out_tile.len() / oc;
        for o0 in (0..oc).step_by(OC_TILE) {
            let o1 = (o0 + OC_TILE).min(oc);
            let mut r = 0;
            while r + MR <= rows {
                let a: [&[f32]; MR] = std::array::from_fn(|k| &inp[(r0 + r + k) * ic..][..ic]);
                for o in o0..o1 {
                    let s = dot4(a, &weight[o * ic..][..ic]);
                    for (k, sk) in s.iter().enumerate() {
                        out_tile[(r + k) * oc + o] = sk + bias_of(o);
                    }
                }
                r += MR;
            }
            for r in r..rows {
                let a = &inp[(r0 + r) * ic..][..ic];
                for o in o0..o1 {
                    out_tile[r * oc + o] = dot(a, &weight[o * ic..][..ic]) + bias_of(o);
                }
            }
        }
    });
}

// Linear backward.
//
// Forward: out[n,o] = sum_i inp[n,i] w[o,i] + b[o]. With dout = dL/dout:
//   dL/dinp[n,i] = sum_o dout[n,o] * d out[n,o]/d inp[n,i] = sum_o dout[n,o] w[o,i]
//   dL/dw[o,i]   = sum_n dout[n,o] inp[n,i]
//   dL/db[o]     = sum_n dout[n,o]
// Implemented exactly as:
//   dinp[n,i]  =  sum_{o ascending} dout[n,o] * w[o,i]           (overwrites)
//   dw[o,i]   +=  (sum_{n ascending} dout[n,o] * inp[n,i])       (accumulates: the sum is formed
//                                                                  first, then added once)
//   db[o]     +=  (sum_{n ascending} dout[n,o])                   (accumulates, likewise)
// Forming each sum before adding it means calling the backward twice doubles dw and db exactly.

/// Linear backward; see the derivation above.
///
/// dinp: (N, IC), overwrites; skipped when `None`.
/// dweight: (OC, IC), accumulates (+=).
/// dbias: (OC), accumulates (+=); skipped when `None`.
/// dout: (N, OC).
/// inp: (N, IC).
/// weight: (OC, IC).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: Option<&mut [f32]>,
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
) {
    assert_eq!(dweight.len(), oc * ic, "matmul_backward: dweight must be (OC, IC)");
    assert_eq!(dout.len(), n * oc, "matmul_backward: dout must be (N, OC)");
    assert_eq!(inp.len(), n * ic, "matmul_backward: inp must be (N, IC)");
    assert_eq!(weight.len(), oc * ic, "matmul_backward: weight must be (OC, IC)");

    // dinp = dout @ weight: each row of dinp is a sum of weight rows, o ascending. A row tile
    // of dinp stays in cache while the weight rows stream past it once.
    if let Some(dinp) = dinp {
        assert_eq!(dinp.len(), n * ic, "matmul_backward: dinp must be (N, IC)");
        if ic > 0 {
            dinp.par_chunks_mut(ROW_TILE * ic).enumerate().for_each(|(tile, dinp_tile)| {
                let r0 = tile * ROW_TILE;
                dinp_tile.fill(0.0);
                for o in 0..oc {
                    let w = &weight[o * ic..][..ic];
                    for (r, drow) in dinp_tile.chunks_exact_mut(ic).enumerate() {
                        axpy(drow, dout[(r0 + r) * oc + o], w);
                    }
                }
            });
        }
    }

    // dweight += dout^T @ inp: parallel over blocks of DW_ROWS output rows; each block sums
    // over all N (ascending) into a stack accumulator of DW_COLS columns, then adds it once.
    if ic > 0 {
        dweight.par_chunks_mut(DW_ROWS * ic).enumerate().for_each(|(blk, dw)| {
            let o0 = blk * DW_ROWS;
            let orows = dw.len() / ic;
            for i0 in (0..ic).step_by(DW_COLS) {
                let i1 = (i0 + DW_COLS).min(ic);
                let width = i1 - i0;
                let mut acc = [[0.0f32; DW_COLS]; DW_ROWS];
                for r in 0..n {
                    let x = &inp[r * ic + i0..r * ic + i1];
                    let g = &dout[r * oc + o0..][..orows];
                    for (acc_k, &gk) in acc.iter_mut().zip(g) {
                        axpy(&mut acc_k[..width], gk, x);
                    }
                }
                for (k, acc_k) in acc.iter().enumerate().take(orows) {
                    for (d, a) in dw[k * ic + i0..k * ic + i1].iter_mut().zip(acc_k) {
                        *d += a;
                    }
                }
            }
        });
    }

    // dbias += column sums of dout, each summed over N ascending by one task, in f64: a bias
    // gradient is often a small sum of large cancelling terms (the key bias under RoPE), and
    // the sum is N times cheaper than the products above.
    if let Some(dbias) = dbias {
        assert_eq!(dbias.len(), oc, "matmul_backward: dbias must be (OC)");
        dbias.par_iter_mut().enumerate().for_each(|(o, db)| {
            let mut s = 0.0f64;
            for r in 0..n {
                s += dout[r * oc + o] as f64;
            }
            *db += s as f32;
        });
    }
}
