//! `engine.recompute` and `engine.weight_upload` turned into the engine's settings for one
//! machine. One rule for `horizon train` (on this machine) and `horizon plan --hardware` (on
//! the profile's), so that a projection plans the run that would run.

use crate::config::Recompute;
use crate::engine::exec::EngineConfig;
use crate::engine::memory::MemoryPlan;
use crate::engine::options::{BackendKind, WeightPath, WeightUpload};
use crate::engine::sizes::Sizes;
use crate::model::layout::ModelLayout;

/// What the settings are resolved against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Machine {
    /// The device memory a plan may use (`None`: `device.memory: auto`, the smallest plan).
    pub device_budget: Option<u64>,
    /// The host memory a plan may use (`None`: unknown, not checked).
    pub host_bytes: Option<u64>,
    /// Whether the device pool lives in host RAM (the CPU backend).
    pub pool_in_host_ram: bool,
    /// Whether the device computes in bf16, where the weight image and stages apply.
    pub bf16: bool,
}

impl Machine {
    /// `backend`'s machine with these memories.
    pub fn new(backend: BackendKind, device_budget: Option<u64>, host_bytes: Option<u64>) -> Self {
        Machine {
            device_budget,
            host_bytes,
            pool_in_host_ram: backend.pool_in_host_ram(),
            bf16: backend.precision() == horizon_backend::Precision::Bf16,
        }
    }

    /// The memory plan of `e` on this machine.
    pub fn plan(&self, layout: &ModelLayout, e: &EngineConfig) -> MemoryPlan {
        let mut plan =
            MemoryPlan::new(&Sizes::new(layout, e), self.device_budget, self.pool_in_host_ram);
        plan.host_available = self.host_bytes;
        plan
    }

    /// Whether `e`'s plan fits the device budget and the host memory.
    pub fn fits(&self, layout: &ModelLayout, e: &EngineConfig) -> bool {
        self.plan(layout, e).check().is_ok()
    }
}

/// `base` with `recompute` and `upload` resolved on `m`:
/// - `engine.recompute`: `always` recomputes, `never` keeps each layer's internals (a checkpoint
///   every layer, no block recompute); `auto` keeps them when an explicit device budget holds
///   that plan (`device.memory: auto` is the smallest plan, which recomputes).
/// - `engine.weight_upload` on a bf16 device: `round` uploads from the fp32 masters, `image`
///   and `staged` as asked, `auto` the image when the plan fits with it, else the masters. A
///   device that computes in fp32 always takes the masters.
pub fn resolve(
    layout: &ModelLayout,
    base: EngineConfig,
    recompute: Recompute,
    upload: WeightUpload,
    m: &Machine,
) -> EngineConfig {
    let keep = |keep: bool| EngineConfig {
        keep_internals: keep,
        checkpoint_every: if keep { 1 } else { base.checkpoint_every },
        weights: WeightPath::Masters,
        ..base
    };
    let e = match recompute {
        Recompute::Always => keep(false),
        Recompute::Never => keep(true),
        Recompute::Auto => {
            let kept = keep(true);
            if m.device_budget.is_some() && m.fits(layout, &kept) { kept } else { keep(false) }
        }
    };
    let with = |weights: WeightPath| EngineConfig { weights, ..e };
    match (m.bf16, upload) {
        (false, _) | (true, WeightUpload::Round) => e,
        (true, WeightUpload::Image) => with(WeightPath::Image),
        (true, WeightUpload::Staged) => with(WeightPath::Staged),
        (true, WeightUpload::Auto) if m.fits(layout, &with(WeightPath::Image)) => {
            with(WeightPath::Image)
        }
        (true, WeightUpload::Auto) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layout::fixture_layout;

    fn base() -> EngineConfig {
        EngineConfig {
            batch_size: 2,
            micro_batch_size: 1,
            seq_len: 16,
            checkpoint_every: 2,
            grad_slabs: 2,
            head_chunk_rows: 64,
            head_tile_rows: None,
            adamw: crate::optim::adamw::AdamWConfig {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
            grad_clip: 1.0,
            keep_internals: false,
            memory: Default::default(),
            backend: BackendKind::Cuda,
            grad_wire: Default::default(),
            weights: WeightPath::Masters,
            host_threads: Default::default(),
        }
    }

    /// The plan's device and host totals of `e`.
    fn totals(l: &ModelLayout, e: &EngineConfig) -> (u64, u64) {
        let s = Sizes::new(l, e);
        (s.device_total() as u64, s.host_total() as u64)
    }

    #[test]
    fn auto_keeps_internals_only_when_an_explicit_budget_holds_them() {
        let l = fixture_layout();
        let gpu = |budget, host| Machine {
            device_budget: budget,
            host_bytes: host,
            pool_in_host_ram: false,
            bf16: true,
        };
        let r = |m: &Machine| resolve(&l, base(), Recompute::Auto, WeightUpload::Round, m);
        let kept = resolve(&l, base(), Recompute::Never, WeightUpload::Round, &gpu(None, None));
        assert!(kept.keep_internals && kept.checkpoint_every == 1);
        let (need, _) = totals(&l, &kept);
        assert!(r(&gpu(Some(need), None)).keep_internals, "a budget that holds the plan");
        assert!(!r(&gpu(Some(need - 1), None)).keep_internals, "one byte short");
        assert!(!r(&gpu(None, None)).keep_internals, "device.memory: auto");
        let always = resolve(&l, base(), Recompute::Always, WeightUpload::Round, &gpu(None, None));
        assert_eq!((always.keep_internals, always.checkpoint_every), (false, 2));
    }

    #[test]
    fn auto_takes_the_image_when_the_host_holds_it() {
        let l = fixture_layout();
        let m = |host, bf16: bool| Machine {
            device_budget: None,
            host_bytes: host,
            pool_in_host_ram: !bf16,
            bf16,
        };
        let r = |u, m: &Machine| resolve(&l, base(), Recompute::Always, u, m).weights;
        let image = EngineConfig { weights: WeightPath::Image, ..base() };
        let (_, need) = totals(&l, &image);
        assert_eq!(r(WeightUpload::Auto, &m(Some(need), true)), WeightPath::Image);
        assert_eq!(r(WeightUpload::Auto, &m(Some(need - 1), true)), WeightPath::Masters);
        assert_eq!(r(WeightUpload::Auto, &m(None, true)), WeightPath::Image);
        assert_eq!(r(WeightUpload::Staged, &m(Some(1), true)), WeightPath::Staged);
        assert_eq!(r(WeightUpload::Image, &m(Some(1), true)), WeightPath::Image, "as asked");
        assert_eq!(r(WeightUpload::Round, &m(None, true)), WeightPath::Masters);
        for u in [WeightUpload::Auto, WeightUpload::Image, WeightUpload::Staged] {
            assert_eq!(r(u, &m(None, false)), WeightPath::Masters, "fp32 device: {u:?}");
        }
    }
}
