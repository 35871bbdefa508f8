//! `engine.recompute` and `engine.weight_upload` turned into the engine's settings for one
//! machine. One rule for `horizon train` (on this machine) and `horizon plan --hardware` (on
//! the profile's), so that a projection plans the run that would run.

use crate::engine::chunking::Chunking;
use crate::engine::memory::MemoryPlan;
use crate::engine::options::EngineConfig;
use crate::engine::options::Recompute;
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
///   every layer, no block recompute); `auto` keeps as many layers' internals as an explicit
///   device budget holds ([`most_kept`]; the others recompute theirs), none under
///   `device.memory: auto` (the smallest plan, which recomputes).
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
    let base = EngineConfig { weights: WeightPath::Masters, ..base };
    let base = chunk_experts(layout, base, m);
    let e = match recompute {
        Recompute::Always => keeping(base, 0),
        Recompute::Never => keeping(base, layout.dims.layers),
        Recompute::Auto if m.device_budget.is_some() => {
            most_kept(layout, base, m).unwrap_or(keeping(base, 0))
        }
        Recompute::Auto => keeping(base, 0),
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

/// `base` with `engine.expert_chunk` resolved: as it is when set or without an explicit device
/// budget; else whole layers when their plan fits the budget, or the largest chunks of frozen
/// experts whose plan does (a binary search: the plan grows with the chunk), or the smallest
/// (one expert a chunk, which the plan's check then refuses) when none does.
pub fn chunk_experts(layout: &ModelLayout, base: EngineConfig, m: &Machine) -> EngineConfig {
    let experts = layout.moe.as_ref().map_or(0, |moe| moe.num_experts);
    if base.expert_chunk.is_some() || m.device_budget.is_none() || m.fits(layout, &base) {
        return base;
    }
    let with = |k: usize| EngineConfig { expert_chunk: Some(k), ..base };
    if experts < 2 || !Chunking::of(layout, &with(1)).any() {
        return base; // nothing to chunk: the plan's check says what does not fit
    }
    // `lo` experts a chunk fit (or nothing does); `hi` do not.
    let (mut lo, mut hi) = (1, experts);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if m.fits(layout, &with(mid)) { lo = mid } else { hi = mid }
    }
    with(lo)
}

/// `base` with `kept` layers keeping their internals: a checkpoint every layer when any does,
/// else `base`'s spacing.
pub fn keeping(base: EngineConfig, kept: usize) -> EngineConfig {
    let checkpoint_every = if kept > 0 { 1 } else { base.checkpoint_every };
    EngineConfig { kept_layers: kept, checkpoint_every, ..base }
}

/// `base` keeping the most layers' internals whose plan fits `m` (at least one), or `None`
/// when not even one layer's do. The plan grows with every kept layer (the last one kept
/// drops the scratch's copy of what layers keep, one micro-batch's worth, so it grows less but
/// does not shrink), so a binary search.
pub fn most_kept(layout: &ModelLayout, base: EngineConfig, m: &Machine) -> Option<EngineConfig> {
    let fits = |kept: usize| m.fits(layout, &keeping(base, kept));
    if !fits(1) {
        return None;
    }
    // `lo` layers fit; `hi` do not (one more than the model has, as a sentinel).
    let (mut lo, mut hi) = (1, layout.dims.layers + 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) { lo = mid } else { hi = mid }
    }
    Some(keeping(base, lo))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::families::fixture_layout;

    fn base() -> EngineConfig {
        EngineConfig::small(BackendKind::Cuda)
    }

    /// The plan's device and host totals of `e`.
    fn totals(l: &ModelLayout, e: &EngineConfig) -> (u64, u64) {
        let s = Sizes::new(l, e);
        (s.device_total() as u64, s.host_total() as u64)
    }

    #[test]
    fn auto_keeps_as_many_layers_internals_as_an_explicit_budget_holds() {
        let l = fixture_layout();
        let gpu = |budget, host| Machine {
            device_budget: budget,
            host_bytes: host,
            pool_in_host_ram: false,
            bf16: true,
        };
        let r = |m: &Machine| resolve(&l, base(), Recompute::Auto, WeightUpload::Round, m);
        let layers = l.dims.layers;
        let kept = resolve(&l, base(), Recompute::Never, WeightUpload::Round, &gpu(None, None));
        assert!(kept.kept_layers == layers && kept.checkpoint_every == 1);
        let need = |kept: usize| totals(&l, &keeping(base(), kept)).0;
        assert_eq!(r(&gpu(Some(need(layers)), None)).kept_layers, layers, "all fit");
        // Each budget just below what n layers need keeps n - 1 of them, at K = 1.
        for n in 2..=layers {
            let e = r(&gpu(Some(need(n) - 1), None));
            assert_eq!((e.kept_layers, e.checkpoint_every), (n - 1, 1), "one byte short of {n}");
            assert_eq!(r(&gpu(Some(need(n)), None)).kept_layers, n);
        }
        let none = r(&gpu(Some(need(1) - 1), None));
        assert_eq!((none.kept_layers, none.checkpoint_every), (0, 2), "not even one layer");
        assert_eq!(r(&gpu(None, None)).kept_layers, 0, "device.memory: auto");
        let always = resolve(&l, base(), Recompute::Always, WeightUpload::Round, &gpu(None, None));
        assert_eq!((always.kept_layers, always.checkpoint_every), (0, 2));
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
