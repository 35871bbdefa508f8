//! The optimizer trait: what one host buffer's AdamW state is, whatever its storage. The memory
//! modes are configurations of it (fp32 moments: `exact`, `lean`; 8-bit moments: `compact`), so
//! the executor updates, rescales and sizes a buffer's state through one interface.

use horizon_backend::Bf16;

use crate::optim::adamw::{BufferStep, adamw_update, adamw_update_image};
use crate::optim::adamw8bit::{
    Kernel, Moments8, Moments8Mut, adamw8bit_update_groups, rescale_moments8,
};

/// One buffer's optimizer state, borrowed for an update.
pub trait Moments {
    /// AdamW on the masters `w` (N) with gradient `g` (N) clipped by `coef`, with `step`'s
    /// scalars (its exempt ranges without weight decay). `seed` drives any
    /// stochastic rounding of the state (derived by the caller from the step and the buffer).
    /// `image` (N), if given, is overwritten in the same pass with the bf16 of the updated
    /// masters (`Bf16::from_f32(w[i])`); masters and state are the same with or without it.
    /// Returns the elements held: those whose new master or moment would not be finite keep
    /// their old master and moments (`optim::adamw`'s "Held elements").
    #[must_use = "a held element is an update that did not apply: the step must report it"]
    fn update(
        &mut self,
        w: &mut [f32],
        g: &[f32],
        step: &BufferStep<'_>,
        coef: f32,
        seed: u64,
        image: Option<&mut [Bf16]>,
    ) -> usize;
    /// Scale the state as if its gradients had been multiplied by `r`: `m *= r`, `v *= r²`.
    fn rescale(&mut self, r: f32);
}

/// fp32 moments `m`, `v` (N each).
pub struct Moments32<'a> {
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

impl Moments for Moments32<'_> {
    fn update(
        &mut self,
        w: &mut [f32],
        g: &[f32],
        step: &BufferStep<'_>,
        coef: f32,
        _seed: u64,
        mut image: Option<&mut [Bf16]>,
    ) -> usize {
        let mut held = 0;
        // One run (the whole buffer) unless some tensors take no decay.
        for (r, st) in step.runs(w.len()) {
            let (w, g) = (&mut w[r.clone()], &g[r.clone()]);
            let (m, v) = (&mut self.m[r.clone()], &mut self.v[r.clone()]);
            held += match image.as_deref_mut() {
                Some(image) => adamw_update_image(w, &mut image[r], g, m, v, &st, coef),
                None => adamw_update(w, g, m, v, &st, coef),
            };
        }
        held
    }
    fn rescale(&mut self, r: f32) {
        self.m.iter_mut().for_each(|m| *m *= r);
        self.v.iter_mut().for_each(|v| *v *= r * r);
    }
}

impl Moments for Moments8Mut<'_> {
    fn update(
        &mut self,
        w: &mut [f32],
        g: &[f32],
        step: &BufferStep<'_>,
        coef: f32,
        seed: u64,
        image: Option<&mut [Bf16]>,
    ) -> usize {
        let q = self.reborrow();
        adamw8bit_update_groups(Kernel::detect(), w, image, g, q, step, coef, seed)
    }
    fn rescale(&mut self, r: f32) {
        rescale_moments8(self.reborrow(), r);
    }
}

/// One buffer's state in either storage (what the executor holds per buffer: no allocation to
/// pick the storage at run time).
pub enum AnyMoments<'a> {
    F32(Moments32<'a>),
    Q8(Moments8Mut<'a>),
}

impl Moments for AnyMoments<'_> {
    fn update(
        &mut self,
        w: &mut [f32],
        g: &[f32],
        step: &BufferStep<'_>,
        coef: f32,
        seed: u64,
        image: Option<&mut [Bf16]>,
    ) -> usize {
        match self {
            AnyMoments::F32(m) => m.update(w, g, step, coef, seed, image),
            AnyMoments::Q8(m) => m.update(w, g, step, coef, seed, image),
        }
    }
    fn rescale(&mut self, r: f32) {
        match self {
            AnyMoments::F32(m) => m.rescale(r),
            AnyMoments::Q8(m) => m.rescale(r),
        }
    }
}

/// How a buffer's moments are stored: the host bytes a buffer of `tensors` (element counts)
/// takes, per storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MomentStorage {
    /// fp32 `m` and `v`: 8 bytes per parameter.
    F32,
    /// 8-bit `m` and `sqrt v` with a scale per block; small tensors fp32 ([`Moments8`]).
    Q8,
}

impl MomentStorage {
    pub fn bytes(self, tensors: &[usize]) -> usize {
        match self {
            MomentStorage::F32 => tensors.iter().sum::<usize>() * 8,
            MomentStorage::Q8 => Moments8::bytes(tensors),
        }
    }
}

impl<'a> Moments8Mut<'a> {
    /// The same view for a shorter borrow.
    pub fn reborrow(&mut self) -> Moments8Mut<'_> {
        Moments8Mut {
            tensors: self.tensors,
            m_codes: self.m_codes,
            v_codes: self.v_codes,
            m_absmax: self.m_absmax,
            v_absmax: self.v_absmax,
            m32: self.m32,
            v32: self.v32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::adamw::{AdamWConfig, AdamWStep};
    use crate::optim::adamw8bit::adamw8bit_update;

    /// Through the trait, each storage runs exactly its own update and rescale.
    #[test]
    fn the_trait_runs_each_storage_exactly() {
        let cfg = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let st = AdamWStep::new(&cfg, 1, 1e-2);
        let tensors = [300usize, 7];
        let n: usize = tensors.iter().sum();
        let g: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.01).sin()).collect();
        let (mut w1, mut w2) = (w0.clone(), w0.clone());
        let (mut m1, mut v1, mut m2, mut v2) =
            (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        adamw_update(&mut w1, &g, &mut m1, &mut v1, &st, 0.5);
        let mut s = Moments32 { m: &mut m2, v: &mut v2 };
        assert_eq!(s.update(&mut w2, &g, &BufferStep::uniform(st), 0.5, 0, None), 0);
        s.rescale(0.5);
        assert_eq!((w1, m1.iter().map(|m| m * 0.5).collect::<Vec<_>>()), (w2, m2));
        let (mut qa, mut qb) = (Moments8::zeros(&tensors), Moments8::zeros(&tensors));
        let (mut wa, mut wb) = (w0.clone(), w0);
        adamw8bit_update(&mut wa, &g, qa.view_mut(), &st, 0.5, 9);
        assert_eq!(qb.view_mut().update(&mut wb, &g, &BufferStep::uniform(st), 0.5, 9, None), 0);
        assert_eq!(wa, wb);
        assert_eq!(qa.decode(), qb.decode());
        assert_eq!(MomentStorage::F32.bytes(&tensors), n * 8);
        assert_eq!(MomentStorage::Q8.bytes(&tensors), Moments8::bytes(&tensors));
    }

    /// Buffer `tensors` (a 300- and a 7-element tensor, then one of 8-bit size) with `exempt`
    /// taking no decay, updated by `storage` from the same start: masters, m, v, image.
    fn grouped(
        storage: MomentStorage,
        st: &BufferStep<'_>,
        g: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<Bf16>) {
        let tensors = [300usize, 7, 5000];
        let n: usize = tensors.iter().sum();
        let mut w: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32 * 0.01).sin()).collect();
        let mut img = vec![Bf16::default(); n];
        match storage {
            MomentStorage::F32 => {
                let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
                let mut s = Moments32 { m: &mut m, v: &mut v };
                assert_eq!(s.update(&mut w, g, st, 0.5, 3, Some(&mut img)), 0);
                (w, m, v, img)
            }
            MomentStorage::Q8 => {
                let mut q = Moments8::zeros(&tensors);
                assert_eq!(q.view_mut().update(&mut w, g, st, 0.5, 3, Some(&mut img)), 0);
                let (m, v) = q.decode();
                (w, m, v, img)
            }
        }
    }

    /// A buffer with no-decay ranges is updated, per element, exactly as a whole-buffer update
    /// with the group's scalars; a tensor with no gradient and no decay keeps its value, one
    /// that decays is multiplied by `1 - lr * weight_decay`.
    // Lists of one range are what is meant: one exempt stretch.
    #[allow(clippy::single_range_in_vec_init)]
    #[test]
    fn exempt_ranges_take_no_decay_in_either_storage() {
        let cfg = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let st = AdamWStep::new(&cfg, 1, 1e-2);
        let n = 5307;
        let g: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
        for storage in [MomentStorage::F32, MomentStorage::Q8] {
            // The 7-element and the 8-bit tensor exempt (one merged range).
            let exempt = [300..n];
            let got = grouped(storage, &BufferStep::new(st, &exempt), &g);
            let all = grouped(storage, &BufferStep::uniform(st), &g);
            let none = grouped(storage, &BufferStep::uniform(st.without_decay()), &g);
            for (what, x, a, b) in [
                ("masters", &got.0, &all.0, &none.0),
                ("m", &got.1, &all.1, &none.1),
                ("v", &got.2, &all.2, &none.2),
            ] {
                assert_eq!(bits(&x[..300]), bits(&a[..300]), "{storage:?} {what}: decayed part");
                assert_eq!(bits(&x[300..]), bits(&b[300..]), "{storage:?} {what}: exempt part");
            }
            assert_eq!(got.3[..300], all.3[..300], "{storage:?} image");
            assert_eq!(got.3[300..], none.3[300..], "{storage:?} image");
            assert_ne!(bits(&got.0[300..]), bits(&all.0[300..]), "{storage:?}: decay matters");

            let zero = vec![0.0; n];
            let (w, ..) = grouped(storage, &BufferStep::new(st, &[300..307]), &zero);
            let w0: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32 * 0.01).sin()).collect();
            assert_eq!(bits(&w[300..307]), bits(&w0[300..307]), "{storage:?}: exempt unchanged");
            let decayed: Vec<f32> = w0.iter().map(|&x| x * st.decay).collect();
            assert_eq!(bits(&w[..300]), bits(&decayed[..300]), "{storage:?}: decayed");
            assert_eq!(bits(&w[307..]), bits(&decayed[307..]), "{storage:?}: decayed");
            assert_ne!(st.decay, 1.0);
        }
    }
}
