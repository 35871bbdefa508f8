//! bf16 on the host: the [`Bf16`] element (its 16 bits), the rounding that puts fp32 weights on
//! the wire and into the CUDA device's weight slots, and the host side of bf16 gradients
//! (`engine.grad_wire: bf16`): fp32 accumulation of bf16 values. `kernels/convert.cu` rounds the
//! same way on the GPU (to nearest even, NaN kept quiet), so a value is the same bf16 wherever it
//! was rounded; the CPU device rounds gradients on its simulated wire with [`Bf16::from_f32`].

use rayon::prelude::*;

/// A bf16 value, stored as its 16 bits (the upper half of the f32 it rounds).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// `x` rounded to bf16: round to nearest even; a NaN stays a (quiet) NaN.
    #[inline]
    pub fn from_f32(x: f32) -> Bf16 {
        let u = x.to_bits();
        if (u & 0x7fff_ffff) > 0x7f80_0000 {
            return Bf16(((u >> 16) | 0x40) as u16);
        }
        Bf16((u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16)
    }

    /// The f32 of this bf16 (exact).
    #[inline]
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

/// Elements per parallel task of the functions below: a fixed split, so the result never
/// depends on the thread count (each element is independent anyway).
const TASK: usize = 1 << 16;

/// Panics (a caller's bug) unless a copy's destination and source have the same length.
#[track_caller]
pub(crate) fn same_len(what: &str, a: usize, b: usize) {
    assert_eq!(a, b, "{what}: dst has {a} elements, src {b}");
}

/// `dst[i] = bf16(src[i])`, in parallel.
pub fn round_to_bf16(dst: &mut [Bf16], src: &[f32]) {
    same_len("round_to_bf16", dst.len(), src.len());
    dst.par_chunks_mut(TASK).zip(src.par_chunks(TASK)).for_each(|(d, s)| {
        for (d, &s) in d.iter_mut().zip(s) {
            *d = Bf16::from_f32(s);
        }
    });
}

/// `acc[i] += f32(x[i])`: a bf16 gradient accumulated into an fp32 one. Overwrites nothing
/// else; in parallel (elementwise, so bit-identical for any thread count).
pub fn add_bf16(acc: &mut [f32], x: &[Bf16]) {
    same_len("add_bf16", acc.len(), x.len());
    acc.par_chunks_mut(TASK).zip(x.par_chunks(TASK)).for_each(|(a, x)| {
        for (a, &x) in a.iter_mut().zip(x) {
            *a += x.to_f32();
        }
    });
}

/// `dst[i] = f32(src[i])` (exact), in parallel.
pub fn expand_bf16(dst: &mut [f32], src: &[Bf16]) {
    same_len("expand_bf16", dst.len(), src.len());
    dst.par_chunks_mut(TASK).zip(src.par_chunks(TASK)).for_each(|(d, s)| {
        for (d, &s) in d.iter_mut().zip(s) {
            *d = s.to_f32();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_nearest_even_and_keeps_specials() {
        let r = |x: f32| Bf16::from_f32(x).to_f32();
        assert_eq!(r(1.0), 1.0);
        // 1 + 2^-8 is half-way between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(r(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3 * 2^-8 is half-way between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
        assert_eq!(r(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(r(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 1.0 + 2f32.powi(-7));
        assert_eq!(r(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(r(f32::INFINITY), f32::INFINITY);
        assert!(r(f32::NAN).is_nan());
        // The largest finite f32 rounds up to infinity, as IEEE round-to-nearest does.
        assert_eq!(r(f32::MAX), f32::INFINITY);
        // bf16 keeps 8 significant bits: unit roundoff 2^-8, the largest relative error.
        for i in 1..1000 {
            let x = i as f32 * 0.123_456_7;
            assert!(((r(x) - x) / x).abs() <= 2f32.powi(-8), "{x}");
        }
    }

    #[test]
    fn add_and_expand_are_exact_on_bf16_values() {
        let x: Vec<f32> = (0..200_003).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut b = vec![Bf16::default(); x.len()];
        round_to_bf16(&mut b, &x);
        let mut e = vec![0.0; x.len()];
        expand_bf16(&mut e, &b);
        let mut acc = vec![1.0f32; x.len()];
        add_bf16(&mut acc, &b);
        for i in 0..x.len() {
            assert_eq!(e[i], Bf16::from_f32(x[i]).to_f32());
            assert_eq!(acc[i], 1.0 + e[i]);
        }
    }
}
