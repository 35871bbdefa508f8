//! One optimizer step's numerics around AdamW: what the step has measured of its gradients (each
//! buffer's squared norm), the global norm and whether the step is finite, the clip coefficient
//! (by the step's norm, or estimated for a layer updated before that norm is known), the moment
//! correction of the run's first such updates, and the seed of each buffer's update. The
//! executor's host queue calls these in the plan's order; nothing here knows of queues or
//! buffers' memory.
//!
//! How `lean`/`compact` clip (the estimate, and why the first step's moments are rescaled) is
//! written out in docs/configuration.md, "How lean clips".

use crate::optim::adamw::clip_coefficient;

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
    /// The step has met a non-finite loss or gradient: no later update is applied.
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
    /// The step's updates are skipped: a loss or the norm is not finite.
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

    /// The coefficient buffer `i` is updated with before the step's norm is known: 1 without
    /// clipping, else [`StepStats::layer_clip_coefficient`]. On the run's first update
    /// (`first_update`, and no earlier step to estimate from) the moments were zero, and the
    /// coefficient is remembered for the step's end to correct ([`StepStats::finish_streamed`]).
    pub fn streamed_coefficient(&mut self, i: usize, grad_clip: f64, first_update: bool) -> f32 {
        if grad_clip <= 0.0 {
            return 1.0;
        }
        let coef = self.layer_clip_coefficient(grad_clip);
        if self.prev_sq.is_empty() && first_update {
            self.provisional[i] = coef;
        }
        coef
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
    /// is recorded: the norm, and whether the held updates that follow apply. A finite step's
    /// squared norms become the next step's estimate, and each buffer updated provisionally
    /// with a coefficient other than the step's has its moments scaled by `rescale(i, r)`:
    /// `r` = the step's coefficient over the one used.
    pub fn finish_streamed(
        &mut self,
        grad_clip: f64,
        mut rescale: impl FnMut(usize, f32),
    ) -> StepEnd {
        let norm = self.norm();
        let finite = norm.is_finite() && !self.poisoned;
        if finite {
            self.prev_sq.clone_from(&self.sq);
            let coef = clip_coefficient(norm, grad_clip);
            for (i, &used) in self.provisional.iter().enumerate() {
                if used > 0.0 && used != coef {
                    rescale(i, coef / used);
                }
            }
        }
        let end = StepEnd { norm, skip: !finite, applied: self.applied || finite };
        self.reset();
        end
    }

    /// The end of an exact step: the norm from the recorded squared norms, skipped unless it and
    /// the step's summed `loss` are finite. Every update comes after it.
    pub fn finish_exact(&mut self, loss: f64) -> StepEnd {
        let norm = self.norm();
        let skip = !(norm.is_finite() && loss.is_finite());
        self.reset();
        StepEnd { norm, skip, applied: !skip }
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
        let used = st.streamed_coefficient(1, 1.0, true);
        assert_eq!(used, clip_coefficient(3.0, 1.0));
        st.mark_applied();
        st.record(0, 16.0, || 0.0);
        let mut seen = Vec::new();
        let end = st.finish_streamed(1.0, |i, r| seen.push((i, r)));
        assert_eq!(end, StepEnd { norm: 5.0, skip: false, applied: true });
        assert_eq!(seen, [(1, clip_coefficient(5.0, 1.0) / used)]);
        assert_eq!(st.prev_sq(), [16.0, 9.0]);
    }
}
