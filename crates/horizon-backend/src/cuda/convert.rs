//! fp32 <-> bf16: the host rounding that puts weights on the wire as bf16, and the launchers of
//! `kernels/convert.cu` that expand them on arrival. Host and device round the same way (to
//! nearest even, NaN kept quiet), so a weight is the same bf16 wherever it was rounded.

use rayon::prelude::*;

use super::CudaBackend;
use super::backend::{arg, blocks};
use super::slice::DevSlice;

/// `x` rounded to bf16 (round to nearest even), as its 16 bits.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// The f32 of bf16 bits `h` (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// `dst[i] = bf16(src[i])`, in parallel (fixed chunks; the result does not depend on the split).
pub fn round_to_bf16(dst: &mut [u16], src: &[f32]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "round_to_bf16: dst has {} elements, src {}",
        dst.len(),
        src.len()
    );
    dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| {
        for (d, &s) in d.iter_mut().zip(s) {
            *d = f32_to_bf16(s);
        }
    });
}

/// Enqueue `out[i] = f32(inp[i])` on `be`'s stream, `inp` being `len` bf16 at device address
/// `inp`.
///
/// # Safety
/// `inp` must be `len` readable bf16 of device memory, not written until the launch has run.
pub(crate) unsafe fn expand_bf16(be: &CudaBackend, out: &mut DevSlice<f32>, inp: u64) {
    let (o, len) = (out.addr(), out.len() as i64);
    // SAFETY: argument types match; `out` has `len` f32, `inp` `len` bf16 (caller).
    unsafe {
        be.launch(
            "convert_bf16_to_f32",
            (blocks(out.len(), 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&inp), arg(&len)],
        );
    }
}

/// Enqueue `out[i] = bf16(inp[i])` on `be`'s stream into `inp.len()` bf16 at device address
/// `out`.
///
/// # Safety
/// `out` must be `inp.len()` writable bf16 of device memory that nothing else uses until the
/// launch has run.
pub unsafe fn round_on_device(be: &CudaBackend, out: u64, inp: &DevSlice<f32>) {
    let (i, len) = (inp.addr(), inp.len() as i64);
    // SAFETY: argument types match; sizes are the caller's contract.
    unsafe {
        be.launch(
            "convert_f32_to_bf16",
            (blocks(inp.len(), 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&out), arg(&i), arg(&len)],
        );
    }
}

/// Enqueue `out = f32(bf16 at inp)` (public face of [`expand_bf16`] for the tests).
///
/// # Safety
/// As [`expand_bf16`].
pub unsafe fn expand_on_device(be: &CudaBackend, out: &mut DevSlice<f32>, inp: u64) {
    // SAFETY: forwarded contract.
    unsafe { expand_bf16(be, out, inp) }
}
