//! One optimizer step's numerics around AdamW: what the step has measured of its gradients (each
//! buffer's squared norm), the global norm and whether the step is finite, the clip coefficient
//! (by the step's norm, or estimated for a layer updated before that norm is known), the moment
//! correction of the run's first such updates, and the seed of each buffer's update. The
//! executor's host queue calls these in the plan's order; nothing here knows of queues or
//! buffers' memory.
//!
//! How `lean`/`compact` clip (the estimate, and why the first step's moments are rescaled) is
//! written out in docs/configuration.md, "How lean clips".
//!
//! A step is *sound* when its loss and norm are finite and its clipped gradient is small enough
//! that no second moment can overflow ([`MAX_CLIPPED_SQ`]): decided from the norm pass, before
//! the updates it governs, so an unsound step applies none of them. Whatever else would make an
//! element non-finite (a master pushed past `f32::MAX`) is found by the update pass itself,
//! which holds the element (`optim::adamw`'s "Held elements") and counts it.

use crate::optim::adamw::clip_coefficient;

/// The largest squared clipped gradient norm a step's update may see: `f32::MAX / 4` (a norm of
/// about 9.2e18). No element's `g²` exceeds its buffer's squared norm, and `v = β2 v + (1 − β2)
/// g²` stays below the largest `g²` it has averaged, so below this no second moment overflows
/// in f32 (the factor 4 leaves room for rounding and for a `v` a checkpoint brought). At or
/// above it the update is not applied: decided from the norm pass, no pass over the moments.
pub const MAX_CLIPPED_SQ: f64 = f32::MAX as f64 / 4.0;

/// Whether a gradient of squared norm `sq`, clipped by `coef`, fits [`MAX_CLIPPED_SQ`].
pub fn fits_moments(sq: f64, coef: f32) -> bool {
    let c = f64::from(coef);
    sq * c * c < MAX_CLIPPED_SQ
}

/// The seed of buffer `i`'s update at AdamW step `step` (1-based): what drives the stochastic
/// rounding of 8-bit moments. The engine and the reference path take it from here, so their
/// updates are the same bits.
pub fn update_seed(step: u64, i: usize) -> u64 {
    step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64
}

/// What one step has measured of its gradients, by buffer (the order of
/// `ParamStore::buffers`), and the last finite step's measurements.
#[derive(Clone, Debug)]
pub struct StepStats {
    /// Squared L2 norm of each buffer's gradient (valid where `seen`).
    sq: Vec<f64>,
    /// Which buffers' gradients have been measured this step.
    seen: Vec<bool>,
    /// `sq` of the last step whose norm was finite (empty: none yet). A layer updated before
    /// the step's norm is known estimates it from these ([`StepStats::layer_clip_coefficient`]).
    prev_sq: Vec<f64>,
    /// On the run's first update (no `prev_sq`, zero moments), the clip coefficient a layer
    /// was updated with before the norm was known (0: none); the step's end corrects its
    /// moments.
    provisional: Vec<f32>,
    /// The step has met a non-finite loss or gradient, or one too large for the moments
    /// ([`fits_moments`]): no later update is applied.
    poisoned: bool,
    /// The losses have been checked this step.
    loss_checked: bool,
    /// Some buffer has been updated this step.
    applied: bool,
}

/// How a step ended, once every gradient is measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepEnd {
    /// The global gradient norm: every buffer's squared norm, summed in buffer order (the same
    /// number a pass over the whole gradient gives).
    pub norm: f64,
    /// The step's updates are skipped: a loss or the norm is not finite, or the clipped norm
    /// does not fit the moments ([`fits_moments`]).
    pub skip: bool,
    /// The step counts as an update for AdamW's bias correction.
    pub applied: bool,
}

impl StepStats {
    /// Nothing measured yet for `buffers` buffers; `prev_sq` is the last finite step's squared
    /// norms, per buffer (empty: none, as at the start of a run).
    pub fn new(buffers: usize, prev_sq: Vec<f64>) -> Self {
        assert!(prev_sq.is_empty() || prev_sq.len() == buffers, "prev_sq is per buffer");
        StepStats {
            sq: vec![0.0; buffers],
            seen: vec![false; buffers],
            prev_sq,
            provisional: vec![0.0; buffers],
            poisoned: false,
            loss_checked: false,
            applied: false,
        }
    }

    /// The squared norms of the last finite step (what a resumed run estimates from).
    pub fn prev_sq(&self) -> &[f64] {
        &self.prev_sq
    }

    /// Record `sq`, buffer `i`'s squared gradient norm, and check the step's summed loss once
    /// (`loss`, called on the first record of a step). Returns whether the step is still
    /// finite: no non-finite loss or gradient met so far.
    pub fn record(&mut self, i: usize, sq: f64, loss: impl FnOnce() -> f64) -> bool {
        self.sq[i] = sq;
        self.seen[i] = true;
        if !self.loss_checked {
            self.loss_checked = true;
            self.poisoned |= !loss().is_finite();
        }
        self.poisoned |= !sq.is_finite();
        !self.poisoned
    }

    /// The clip coefficient of a layer updated before the step's norm is known (`lean`/
    /// `compact`).
    ///
    /// What is known: the squared norms of the gradients measured so far this step (final norm,
    /// untied head, the layers above, this layer), `seen`, and every buffer's at the last finite
    /// step, `prev_sq`. The estimate assumes the measured buffers hold the same share of the
    /// squared norm as at that step: `‖g‖² ≈ ‖g_prev‖² · seen / seen_prev`, and never less than
    /// `seen`, which is part of the step's norm. Without a previous step it is `seen`.
    pub fn layer_clip_coefficient(&self, grad_clip: f64) -> f32 {
        let measured = |sq: &[f64]| -> f64 {
            sq.iter().zip(&self.seen).filter(|(_, s)| **s).map(|(q, _)| q).sum()
        };
        let seen = measured(&self.sq);
        let est = if self.prev_sq.is_empty() {
            seen
        } else {
            let prev: f64 = self.prev_sq.iter().sum();
            let seen_prev = measured(&self.prev_sq);
            if seen_prev > 0.0 { prev * (seen / seen_prev) } else { prev }
        };
        clip_coefficient(est.max(seen).sqrt(), grad_clip)
    }

    /// The coefficient buffer `i` (whose squared norm is recorded) is updated with before the
    /// step's norm is known: 1 without clipping, else [`StepStats::layer_clip_coefficient`]; or
    /// `None`, poisoning the step, when its gradient so clipped does not fit the moments
    /// ([`fits_moments`]). On the run's first update (`first_update`, and no earlier step to
    /// estimate from) the moments were zero, and the coefficient is remembered for the step's
    /// end to correct ([`StepStats::finish_streamed`]).
    pub fn streamed_coefficient(
        &mut self,
        i: usize,
        grad_clip: f64,
        first_update: bool,
    ) -> Option<f32> {
        let coef = if grad_clip <= 0.0 { 1.0 } else { self.layer_clip_coefficient(grad_clip) };
        if !fits_moments(self.sq[i], coef) {
            self.poisoned = true;
            return None;
        }
        if grad_clip > 0.0 && self.prev_sq.is_empty() && first_update {
            self.provisional[i] = coef;
        }
        Some(coef)
    }

    /// A buffer was updated this step.
    pub fn mark_applied(&mut self) {
        self.applied = true;
    }

    /// The step's norm: every buffer's recorded squared norm, summed in buffer order.
    fn norm(&self) -> f64 {
        debug_assert!(self.seen.iter().all(|&s| s), "every gradient is measured");
        self.sq.iter().copied().sum::<f64>().sqrt()
    }

    /// Forget this step's measurements (the last finite step's stay).
    fn reset(&mut self) {
        self.seen.fill(false);
        self.provisional.fill(0.0);
        self.poisoned = false;
        self.loss_checked = false;
        self.applied = false;
    }

    /// The end of a streamed step (`lean`/`compact`), once the last gradient (the embedding's)
    /// is recorded: the norm, and whether the held updates that follow apply. A sound step's
    /// squared norms become the next step's estimate, and each buffer updated provisionally
    /// with a coefficient other than the step's has its moments scaled by `rescale(i, r)`:
    /// `r` = the step's coefficient over the one used.
    pub fn finish_streamed(
        &mut self,
        grad_clip: f64,
        mut rescale: impl FnMut(usize, f32),
    ) -> StepEnd {
        let norm = self.norm();
        let coef = clip_coefficient(norm, grad_clip);
        let sound = norm.is_finite() && !self.poisoned && fits_moments(norm * norm, coef);
        if sound {
            self.prev_sq.clone_from(&self.sq);
            for (i, &used) in self.provisional.iter().enumerate() {
                if used > 0.0 && used != coef {
                    rescale(i, coef / used);
                }
            }
        }
        let end = StepEnd { norm, skip: !sound, applied: self.applied || sound };
        self.reset();
        end
    }

    /// The end of an exact step: the norm from the recorded squared norms, skipped unless it and
    /// the step's summed `loss` are finite and the gradient clipped by `grad_clip` fits the
    /// moments ([`fits_moments`]). Every update comes after it.
    pub fn finish_exact(&mut self, loss: f64, grad_clip: f64) -> StepEnd {
        let norm = self.norm();
        let coef = clip_coefficient(norm, grad_clip);
        let sound = norm.is_finite() && loss.is_finite() && fits_moments(norm * norm, coef);
        self.reset();
        StepEnd { norm, skip: !sound, applied: sound }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer measured before the norm estimates it from the share its buffers held at the
    /// last finite step; without one it takes what is measured.
    #[test]
    fn the_estimate_scales_the_last_steps_norm_by_the_measured_share() {
        let mut st = StepStats::new(3, Vec::new());
        st.record(2, 4.0, || 0.0);
        // Nothing earlier: the estimate is the measured part, ‖g‖ = 2.
        assert_eq!(st.layer_clip_coefficient(1.0), clip_coefficient(2.0, 1.0));
        let mut st = StepStats::new(3, vec![1.0, 1.0, 2.0]);
        st.record(2, 8.0, || 0.0);
        // The measured buffer held half the norm last step: 8 / (2/4) = 16, ‖g‖ ≈ 4.
        assert_eq!(st.layer_clip_coefficient(1.0), clip_coefficient(4.0, 1.0));
    }

    /// A non-finite loss or gradient poisons the step; the step's end skips it, corrects no
    /// moment, keeps the last finite norms, and the next step starts clean.
    #[test]
    fn a_poisoned_step_is_skipped_and_the_next_starts_clean() {
        let mut st = StepStats::new(2, vec![1.0, 1.0]);
        assert!(!st.record(0, 1.0, || f64::NAN));
        st.record(1, 1.0, || unreachable!("the losses are checked once a step"));
        let end = st.finish_streamed(1.0, |_, _| panic!("no rescale in a skipped step"));
        assert!(end.skip && !end.applied);
        assert_eq!(st.prev_sq(), [1.0, 1.0]);
        assert!(st.record(0, 1.0, || 0.0), "a new step checks its own losses");
    }

    /// The run's first streamed update clips provisionally; the step's end rescales its moments
    /// by the step's coefficient over the one used.
    #[test]
    fn the_first_provisional_update_is_corrected_at_the_end() {
        let mut st = StepStats::new(2, Vec::new());
        st.record(1, 9.0, || 0.0);
        let used = st.streamed_coefficient(1, 1.0, true).unwrap();
        assert_eq!(used, clip_coefficient(3.0, 1.0));
        st.mark_applied();
        st.record(0, 16.0, || 0.0);
        let mut seen = Vec::new();
        let end = st.finish_streamed(1.0, |i, r| seen.push((i, r)));
        assert_eq!(end, StepEnd { norm: 5.0, skip: false, applied: true });
        assert_eq!(seen, [(1, clip_coefficient(5.0, 1.0) / used)]);
        assert_eq!(st.prev_sq(), [16.0, 9.0]);
    }

    /// A gradient whose clipped squared norm reaches `MAX_CLIPPED_SQ` could overflow a second
    /// moment: the step is unsound and skipped, decided from the norm alone (a finite norm, a
    /// finite loss). Clipping brings the same gradient within bounds.
    #[test]
    fn a_gradient_too_large_for_the_moments_skips_the_step() {
        let huge = MAX_CLIPPED_SQ * 1.5;
        let mut st = StepStats::new(2, Vec::new());
        st.record(0, huge, || 0.0);
        st.record(1, 1.0, || 0.0);
        let end = st.finish_exact(0.0, 0.0);
        assert!(end.skip && !end.applied && end.norm.is_finite(), "{end:?}");
        st.record(0, huge, || 0.0);
        st.record(1, 1.0, || 0.0);
        assert!(!st.finish_exact(0.0, 1.0).skip, "clipped to norm 1, it fits");
        // Streamed: the layer's own update is refused before it runs, and the step ends skipped;
        // the last sound step's norms stay the estimate.
        let mut st = StepStats::new(2, vec![1.0, 1.0]);
        assert!(st.record(1, huge, || 0.0));
        assert_eq!(st.streamed_coefficient(1, 0.0, false), None);
        assert!(!st.record(0, 1.0, || 0.0), "poisoned");
        let end = st.finish_streamed(0.0, |_, _| panic!("no rescale in a skipped step"));
        assert!(end.skip && !end.applied, "{end:?}");
        assert_eq!(st.prev_sq(), [1.0, 1.0]);
        assert!(fits_moments(MAX_CLIPPED_SQ * 0.99, 1.0) && !fits_moments(MAX_CLIPPED_SQ, 1.0));
    }
}
