//! Launcher of `kernels/attention_decode.cu`: the last `T_new` query rows of each sequence
//! against the cached keys and values before and at them (a decode step of generation), within
//! an optional sliding window, with optional attention sinks, forward only. Reference:
//! `cpu/attention_decode.rs`.

use super::CudaBackend;
use super::attention::{ROWS, TILE, check_dims, shared, window_scale};
use super::backend::{arg, expect_len, int};
use super::slice::DevSlice;
use crate::{AttnDims, Bf16};

/// out: (B*T_new, H*D), overwrites. qkv: (B*T, QKV) after rope, the cache. sinks: (H), or
/// `None`.
pub(crate) fn attention_decode(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    qkv: &DevSlice<f32>,
    sinks: Option<&DevSlice<Bf16>>,
    t_new: usize,
    dims: AttnDims,
) {
    check_dims("attention_decode", dims);
    assert!(t_new <= dims.t, "attention_decode: {t_new} new positions of {}", dims.t);
    expect_len("attention_decode", "qkv", qkv.len(), dims.n() * dims.qkv_width());
    expect_len("attention_decode", "out", out.len(), dims.b * t_new * dims.h * dims.d);
    if let Some(s) = sinks {
        expect_len("attention_decode", "sinks", s.len(), dims.h);
    }
    if t_new == 0 {
        return;
    }
    let smem = shared(be, "attention_decode", 4 * (2 * TILE * (dims.d + 1) + ROWS * dims.d));
    // Without sinks the kernel does not read them: qkv stands in (a launch takes no null
    // pointer).
    let (o, x) = (out.addr(), qkv.addr());
    let (s, has_sinks) = sinks.map_or((x, 0i32), |s| (s.addr(), 1));
    let (t, tn, h, kvh, d) = (
        int(dims.t, "T"),
        int(t_new, "T_new"),
        int(dims.h, "H"),
        int(dims.kvh, "KVH"),
        int(dims.d, "D"),
    );
    let (w, scale) = window_scale(dims);
    let mut args = [
        arg(&o),
        arg(&x),
        arg(&s),
        arg(&has_sinks),
        arg(&t),
        arg(&tn),
        arg(&h),
        arg(&kvh),
        arg(&d),
        arg(&w),
        arg(&scale),
    ];
    // SAFETY: argument types match (three pointers, seven ints, one float); the grid covers
    // (T_new/ROWS, H, B) and every index the kernel forms lies inside the buffers whose lengths
    // are checked above (rows past T_new and keys outside the window are never read; sinks
    // only with has_sinks, at a head below H).
    unsafe {
        be.launch(
            "attention_decode",
            (t_new.div_ceil(ROWS) as u32, dims.h as u32, dims.b as u32),
            (32 * ROWS as u32, 1, 1),
            smem,
            &mut args,
        );
    }
}
