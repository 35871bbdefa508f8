//! Rotary position embedding on the CPU (rotate-half convention of HF Llama), in place on the q
//! and k parts of a fused qkv buffer, and its backward (the inverse rotation).
//!
//! Row layout: qkv (N, QKV), row = `[q (H*D) | k (KVH*D) | v (KVH*D)]`. The first `H + KVH`
//! heads of each row are rotated; v is left alone. For head dim `D` and `j in 0..D/2` the pair
//! `(x1, x2) = (x[j], x[j + D/2])` at position `p` is rotated by the angle whose cosine and sine
//! are `cos[p, j]`, `sin[p, j]` (tables (T, D/2)).

use rayon::prelude::*;

use crate::AttnDims;

/// Checks the shapes shared by forward and backward; returns `(qkv width, D/2)`.
fn check(what: &str, qkv: &[f32], cos: &[f32], sin: &[f32], dims: AttnDims) -> (usize, usize) {
    assert!(dims.d.is_multiple_of(2), "{what}: head dim D = {} must be even", dims.d);
    let half = dims.d / 2;
    let width = dims.qkv_width();
    assert_eq!(qkv.len(), dims.n() * width, "{what}: qkv must be (N, QKV)");
    assert_eq!(cos.len(), dims.t * half, "{what}: cos must be (T, D/2)");
    assert_eq!(sin.len(), dims.t * half, "{what}: sin must be (T, D/2)");
    (width, half)
}

/// Rotates each pair of the q and k heads of every row by `sign * angle` (`sign` = +1 forward,
/// -1 backward): `x1' = x1 cos - sign x2 sin`, `x2' = x2 cos + sign x1 sin`.
fn rotate(qkv: &mut [f32], cos: &[f32], sin: &[f32], dims: AttnDims, width: usize, sign: f32) {
    let (t, d, half) = (dims.t, dims.d, dims.d / 2);
    if width == 0 || half == 0 {
        return;
    }
    let rotated = (dims.h + dims.kvh) * d;
    qkv.par_chunks_mut(width).enumerate().for_each(|(r, row)| {
        let pos = r % t;
        let c = &cos[pos * half..][..half];
        let s = &sin[pos * half..][..half];
        for head in row[..rotated].chunks_exact_mut(d) {
            let (x1, x2) = head.split_at_mut(half);
            for j in 0..half {
                let (a, b) = (x1[j], x2[j]);
                let sn = sign * s[j];
                x1[j] = a * c[j] - b * sn;
                x2[j] = b * c[j] + a * sn;
            }
        }
    });
}

/// RoPE forward, in place: for every q and k head, `x1' = x1 cos - x2 sin`,
/// `x2' = x2 cos + x1 sin`.
///
/// qkv: (N, QKV), updated in place (q and k parts; v untouched).
/// cos, sin: (T, D/2).
pub fn rope_forward(qkv: &mut [f32], cos: &[f32], sin: &[f32], dims: AttnDims) {
    let (width, _) = check("rope_forward", qkv, cos, sin, dims);
    rotate(qkv, cos, sin, dims, width, 1.0);
}

// RoPE backward. Per pair the forward is y = R x with the rotation
//   R = [[c, -s], [s, c]],   y1 = c x1 - s x2,   y2 = s x1 + c x2,
// so dL/dx = R^T dy, and R^T is the rotation by the opposite angle:
//   dx1 =  c dy1 + s dy2
//   dx2 = -s dy1 + c dy2
// Implemented exactly as `rotate` with sign = -1 (sin negated), in place:
//   dx1 = dy1 * c - dy2 * (-s),  dx2 = dy2 * c + dy1 * (-s)       (overwrites dq, dk in place)
// v does not pass through rope, so dv is left as it is.

/// RoPE backward, in place; see the derivation above.
///
/// dqkv: (N, QKV), dq and dk parts overwritten in place by the inverse rotation; dv untouched.
/// cos, sin: (T, D/2).
pub fn rope_backward(dqkv: &mut [f32], cos: &[f32], sin: &[f32], dims: AttnDims) {
    let (width, _) = check("rope_backward", dqkv, cos, sin, dims);
    rotate(dqkv, cos, sin, dims, width, -1.0);
}
