//! Learning-rate schedules: constant, or linear warm-up then cosine or linear decay to a floor.

use serde::{Deserialize, Serialize};

/// The shape of the learning rate over the run.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// `lr` throughout (after the warm-up, if any).
    #[default]
    Constant,
    /// Warm-up, then half a cosine from `lr` down to `min_lr` at the last step.
    Cosine,
    /// Warm-up, then a straight line from `lr` down to `min_lr` at the last step.
    Linear,
}

/// A schedule over `total` optimizer steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
}

impl LrSchedule {
    /// The learning rate of optimizer step `step` (1-based): during warm-up `lr * step /
    /// warmup`, then the decay, reaching `min_lr` at `total_steps`.
    pub fn lr_at(&self, step: usize) -> f64 {
        let s = step.max(1);
        if s <= self.warmup_steps {
            return self.lr * s as f64 / self.warmup_steps as f64;
        }
        let decay_steps = self.total_steps.saturating_sub(self.warmup_steps);
        let progress = if decay_steps == 0 {
            1.0
        } else {
            ((s - self.warmup_steps) as f64 / decay_steps as f64).min(1.0)
        };
        match self.kind {
            ScheduleKind::Constant => self.lr,
            ScheduleKind::Cosine => {
                self.min_lr
                    + (self.lr - self.min_lr)
                        * 0.5
                        * (1.0 + (std::f64::consts::PI * progress).cos())
            }
            ScheduleKind::Linear => self.lr + (self.min_lr - self.lr) * progress,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: ScheduleKind, warmup: usize) -> LrSchedule {
        LrSchedule { kind, lr: 1e-3, min_lr: 1e-4, warmup_steps: warmup, total_steps: 100 }
    }

    #[test]
    fn constant_is_constant() {
        let s = sched(ScheduleKind::Constant, 0);
        assert!((1..=100).all(|k| s.lr_at(k) == 1e-3));
    }

    #[test]
    fn warmup_is_linear_from_zero() {
        let s = sched(ScheduleKind::Cosine, 10);
        assert!((s.lr_at(1) - 1e-4).abs() < 1e-15);
        assert!((s.lr_at(5) - 5e-4).abs() < 1e-15);
        assert_eq!(s.lr_at(10), 1e-3);
    }

    #[test]
    fn decays_reach_the_floor_at_the_last_step() {
        for kind in [ScheduleKind::Cosine, ScheduleKind::Linear] {
            let s = sched(kind, 10);
            assert!((s.lr_at(100) - 1e-4).abs() < 1e-15, "{kind:?}");
            assert!((s.lr_at(55) - 5.5e-4).abs() < 1e-12, "{kind:?} midpoint: {}", s.lr_at(55));
            let mut prev = f64::INFINITY;
            for k in 10..=100 {
                assert!(s.lr_at(k) <= prev, "{kind:?} not monotone at {k}");
                prev = s.lr_at(k);
            }
        }
    }
}
