//! `horizon plan --config F`: the memory plan of a run without running it. Host bytes by kind
//! and per parameter, device bytes, then what the machine could hold: for every
//! `optimizer.memory` mode the deepest model of this shape (same layers, more of them) that fits
//! the host's available memory, and for the device budget the largest micro-batch that fits.
//! Errors (exit status 1) when the config as written does not fit, with the numbers. Like
//! `horizon train`, it reads the data to size the buffers for its longest row.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use horizon_backend::threads::{self, Placement};

use crate::adapter::{AdapterConfig, AdapterKind};
use crate::engine::memory::{MemoryPlan, gib, host_available_bytes};
use crate::engine::options::EngineConfig;
use crate::engine::sizes::Sizes;
use crate::hf::config::ModelConfig;
use crate::model::layout::ModelLayout;
use crate::model::lora::BaseDtype;
use crate::model::lora::LoraSpec;
use crate::optim::decay::DecayGroups;
use crate::run::config::{ByteSize, OptimizerMemory, RawConfig, RunConfig};
use crate::run::data::{SeqLen, load_datasets};
use crate::run::dpo_train::reference_line;
use crate::run::load::{model_config, run_layout, split_targets};

/// The plan of `cfg` as run (its own mode), and the report `horizon plan` prints.
pub struct PlanReport {
    pub plan: MemoryPlan,
    pub text: String,
    /// The model the plan is for.
    pub model: ModelConfig,
    /// The row length it is sized for.
    pub seq_len: usize,
}

/// The memory plan of a model / engine configuration on `ecfg.backend` (the CPU backend's pool
/// counts in host RAM).
pub fn plan_for(model: &ModelConfig, ecfg: &EngineConfig, budget: Option<u64>) -> MemoryPlan {
    plan_for_layout(&crate::model::describe(model), ecfg, budget)
}

/// [`plan_for`] of a layout (an adapter run's).
pub fn plan_for_layout(
    layout: &ModelLayout,
    ecfg: &EngineConfig,
    budget: Option<u64>,
) -> MemoryPlan {
    let sizes = Sizes::new(layout, ecfg);
    MemoryPlan::new(&sizes, budget, ecfg.backend.pool_in_host_ram())
}

/// How a model of some depth is laid out: as is, or with an adapter.
pub type LayoutOf<'a> = &'a dyn Fn(&ModelConfig) -> Option<ModelLayout>;

/// The deepest model of `model`'s shape whose host total fits `avail` under `ecfg`: (layers,
/// parameters, host bytes); `None` if not even one layer fits.
pub fn deepest_fit(
    model: &ModelConfig,
    ecfg: &EngineConfig,
    avail: u64,
) -> Option<(usize, u64, u64)> {
    deepest_fit_as(model, &|m| Some(crate::model::describe(m)), ecfg, avail)
}

/// [`deepest_fit`] with each depth laid out by `layout_of`.
pub fn deepest_fit_as(
    model: &ModelConfig,
    layout_of: LayoutOf<'_>,
    ecfg: &EngineConfig,
    avail: u64,
) -> Option<(usize, u64, u64)> {
    let at = |layers: usize| {
        let mut m = model.clone();
        m.num_layers = layers;
        let Some(layout) = layout_of(&m) else { return (0, u64::MAX) };
        let p = plan_for_layout(&layout, ecfg, None);
        (p.params, p.host_total())
    };
    if at(1).1 > avail {
        return None;
    }
    // Each probe costs O(its layers), and a small model fits hundreds of thousands of them:
    // past a few times the model's depth the bytes grow by the same amount per period of
    // layers (their kinds and checkpoint blocks repeat), so two cheap probes place the answer
    // and a few confirm it; else the search over every depth.
    let period = model.num_layers.max(1) * ecfg.checkpoint_every.max(1) * 4;
    extrapolated(&at, period, avail).or_else(|| Some(searched(&at, avail)))
}

/// The largest L with `at(L)` within `avail` (host bytes grow with depth; `at(1)` fits), by
/// doubling then bisection.
fn searched(at: &dyn Fn(usize) -> (u64, u64), avail: u64) -> (usize, u64, u64) {
    let (mut lo, mut hi) = (1usize, 2usize);
    while at(hi).1 <= avail {
        lo = hi;
        hi *= 2;
        if hi > 1 << 24 {
            break;
        }
    }
    bisect(at, (lo, hi), avail)
}

/// The largest L in `lo..hi` with `at(L)` within `avail`, given `at(lo)` is and `at(hi)` is
/// not (or `hi` is the search's end): (L, its parameters, its host bytes).
fn bisect(
    at: &dyn Fn(usize) -> (u64, u64),
    (mut lo, mut hi): (usize, usize),
    avail: u64,
) -> (usize, u64, u64) {
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if at(mid).1 <= avail { lo = mid } else { hi = mid }
    }
    let (p, b) = at(lo);
    (lo, p, b)
}

/// [`deepest_fit_as`]'s answer from the bytes a layer adds on average past the model's depth:
/// measured over `period` layers (a multiple of the layer pattern and of the checkpoint
/// blocks, where host bytes step), it lands within a period of the answer, which a bisection
/// of that window confirms (`None`: the bytes did not grow as measured).
fn extrapolated(
    at: &dyn Fn(usize) -> (u64, u64),
    period: usize,
    avail: u64,
) -> Option<(usize, u64, u64)> {
    let (t1, t2) = (at(period).1, at(2 * period).1);
    if t1 > avail || t2 <= t1 {
        return None;
    }
    let per_layer = (t2 - t1) as f64 / period as f64;
    let guess = period + ((avail - t1) as f64 / per_layer) as usize;
    let (lo, hi) = (guess.saturating_sub(period + 1).max(period), guess + period + 1);
    if hi >= 1 << 24 || at(lo).1 > avail || at(hi).1 <= avail {
        return None;
    }
    Some(bisect(at, (lo, hi), avail))
}

/// The largest micro-batch (rows) whose device plan fits `budget`, up to the batch size.
pub fn largest_micro_batch(model: &ModelConfig, ecfg: &EngineConfig, budget: u64) -> usize {
    let fits = |mb: usize| {
        let e = EngineConfig { micro_batch_size: mb, ..*ecfg };
        plan_for(model, &e, Some(budget)).device_total() <= budget
    };
    (1..=ecfg.batch_size).take_while(|&mb| fits(mb)).last().unwrap_or(0)
}

/// Build the report for `cfg`, for a host of `host_memory` bytes (default: this one's
/// available memory).
pub fn report(cfg: &RunConfig, host_memory: Option<u64>) -> Result<PlanReport> {
    let raw = &cfg.raw;
    let model = model_config(raw)?;
    // Sized for the data's longest row, as `horizon train` sizes it; when the data cannot be
    // read (no data.path yet, say), for train.max_seq_len, and the plan says so.
    let (seq_len, reference) = match load_datasets(raw, model.vocab_size) {
        Ok(sets) => (SeqLen::of_data(raw, &sets), reference_line(raw, Some(&sets))),
        Err(e) => {
            let why = format!("the data could not be read ({e:#})");
            (SeqLen::assumed(raw, &why), reference_line(raw, None))
        }
    };
    let ecfg = EngineConfig { seq_len: seq_len.len, ..raw.engine_config() };
    let budget = match raw.device.memory {
        ByteSize::Auto => None,
        ByteSize::Bytes(b) => Some(b),
    };
    let layout = run_layout(raw, &model, cfg.adapter.as_ref())?;
    let plan = plan_for_layout(&layout, &ecfg, budget).sized_for(&seq_len.why);
    let mut plan = plan.with_host(reference);
    if host_memory.is_some() {
        plan.host_available = host_memory;
    }
    let mut t = String::new();
    for line in cfg.hub_lines() {
        writeln!(t, "{line}")?;
    }
    writeln!(t, "optimizer.memory: {}", raw.optimizer.memory.name())?;
    writeln!(t, "{}", decay_line(raw, &layout))?;
    let threads = ecfg.host_threads.resolve(ecfg.backend);
    writeln!(
        t,
        "engine.host_threads: {} -> {threads} thread{} for the host work (optimizer, gradient accumulation, norms), {}",
        ecfg.host_threads,
        if threads == 1 { "" } else { "s" },
        pinning(threads, ecfg.pin_threads)
    )?;
    if let Some(a) = &layout.adapter {
        writeln!(
            t,
            "adapter: LoRA r {} on {}{} ({}); the base frozen in {}{}; {} trained parameters{}",
            a.r,
            a.targets.join(", "),
            expert_words(a.experts),
            if a.nf4 { "qlora" } else { "lora" },
            match a.base {
                BaseDtype::F32 => "fp32",
                BaseDtype::Bf16 => "bf16",
            },
            match (a.nf4, layout.mxfp4_experts) {
                (true, true) => ", its products' matrices NF4, the routed experts MXFP4 as stored",
                (true, false) => ", its products' matrices NF4",
                (false, true) => ", the routed experts MXFP4 as the checkpoint packs them",
                (false, false) => "",
            },
            layout.trained_params(),
            if layout.trained_params() * 100 < layout.num_params() {
                " (optimizer.memory does not matter for adapters this small)"
            } else {
                ", whose masters and moments optimizer.memory holds"
            }
        )?;
    }
    if let Some(line) = moe_line(&layout) {
        writeln!(t, "{line}")?;
    }
    write!(t, "{plan}")?;
    let avail = host_memory.or_else(host_available_bytes);
    by_adapter(&mut t, &model, cfg.adapter.as_ref(), &ecfg, avail)?;
    writeln!(t, "full fine-tuning, by optimizer.memory:")?;
    for mode in OptimizerMemory::ALL {
        let e = EngineConfig { memory: mode, ..ecfg };
        let p = plan_for(&model, &e, budget);
        let mut line = host_line(mode.name(), &p);
        if let Some(a) = avail {
            line += &fit_words(deepest_fit(&model, &e, a), "deepest that fits", a);
        }
        writeln!(t, "{line}")?;
    }
    match budget {
        Some(b) => {
            let mb = largest_micro_batch(&model, &ecfg, b);
            if mb == 0 {
                writeln!(t, "device budget {}: not even a micro-batch of 1 row fits", gib(b))?;
            } else {
                writeln!(
                    t,
                    "device budget {}: the largest micro-batch that fits is {mb} rows (of train.batch_size {}; train.micro_batch_size is {})",
                    gib(b),
                    ecfg.batch_size,
                    ecfg.micro_batch_size
                )?;
            }
        }
        None => writeln!(
            t,
            "device.memory auto: the device pool is sized to the plan ({})",
            gib(plan.device_total())
        )?,
    }
    Ok(PlanReport { plan, text: t, model, seq_len: ecfg.seq_len })
}

/// The weight-decay groups of `layout`'s trained tensors under `raw`'s optimizer:
/// `weight decay W on N tensors (P params), none on M tensors (Q params) (optimizer.no_decay: R)`.
pub fn decay_line(raw: &RawConfig, layout: &ModelLayout) -> String {
    let o = &raw.optimizer;
    DecayGroups::new(layout, o.no_decay).line(o.weight_decay)
}

/// `  NAME  host BYTES  B/param` of plan `p`.
fn host_line(name: &str, p: &MemoryPlan) -> String {
    let per = p.host_total() as f64 / p.params.max(1) as f64;
    format!("  {name:<8} host {:>14}  {per:>6.2} B/param", gib(p.host_total()))
}

/// `; WHAT AVAIL: L layers, P params (BYTES)` of a deepest fit, or that none fits.
fn fit_words(fit: Option<(usize, u64, u64)>, what: &str, avail: u64) -> String {
    match fit {
        Some((layers, params, bytes)) => format!(
            "; {what} {}: {layers} layers, {:.3}B params ({})",
            gib(avail),
            params as f64 / 1e9,
            gib(bytes)
        ),
        None => format!("; not even one layer fits {}", gib(avail)),
    }
}

/// The adapter (the run's, or r 16 on every projection, a mixture's experts as PEFT rewrites
/// the MLP's names) of each `adapter.type`.
fn adapter_of(
    kind: Option<AdapterKind>,
    run: Option<&AdapterConfig>,
    model: &ModelConfig,
) -> Option<LoraSpec> {
    let kind = kind?;
    let default = AdapterConfig {
        kind,
        r: 16,
        alpha: 32.0,
        rslora: false,
        targets: crate::adapter::config::TARGETS.iter().map(|t| t.to_string()).collect(),
        init: None,
        base_dtype: Default::default(),
    };
    let a = run.unwrap_or(&default);
    let (targets, experts) = split_targets(a, model).ok()?;
    Some(LoraSpec {
        r: a.r,
        scale: a.scale(),
        targets,
        nf4: kind == AdapterKind::Qlora,
        base: BaseDtype::Bf16,
        experts,
    })
}

/// A mixture of experts' line: experts, sparse layers, total and active parameters, and what
/// the experts take of the host store.
fn moe_line(layout: &ModelLayout) -> Option<String> {
    let m = layout.moe.as_ref()?;
    let l = layout.dims.layers;
    let sparse = (0..l).filter(|&i| m.is_sparse(i)).count();
    let c = layout.dims.c;
    let expert = 3 * m.expert_size * c;
    let total = layout.num_params();
    let active = total - sparse * (m.num_experts - m.top_k) * expert;
    Some(format!(
        "mixture of experts: {} experts of {} (top {}) in {sparse} of {l} layers; {:.2}B parameters, {:.2}B active per token ({:.1}%); the routed experts are {:.1}% of the parameters",
        m.num_experts,
        m.expert_size,
        m.top_k,
        total as f64 / 1e9,
        active as f64 / 1e9,
        100.0 * active as f64 / total as f64,
        100.0 * (sparse * m.num_experts * expert) as f64 / total as f64,
    ))
}

/// Per `adapter.type`: host bytes, bytes per parameter, and the deepest model of this shape
/// that fits `avail` (the host's available memory, or `--host-memory`).
fn by_adapter(
    t: &mut String,
    model: &ModelConfig,
    run: Option<&AdapterConfig>,
    ecfg: &EngineConfig,
    avail: Option<u64>,
) -> Result<()> {
    writeln!(t, "by adapter.type (frozen base in bf16; qlora: products' matrices NF4):")?;
    let kinds =
        [("none", None), ("lora", Some(AdapterKind::Lora)), ("qlora", Some(AdapterKind::Qlora))];
    for (name, kind) in kinds {
        let spec = adapter_of(kind, run, model);
        let layout_of = |m: &ModelConfig| -> Option<ModelLayout> {
            let full = crate::model::describe(m);
            match &spec {
                None => Some(full),
                Some(s) => full.with_lora(s).ok(),
            }
        };
        let Some(layout) = layout_of(model) else {
            writeln!(t, "  {name:<6} not applicable (the model has no such target)")?;
            continue;
        };
        let p = plan_for_layout(&layout, ecfg, None);
        let mut line = host_line(name, &p);
        if let Some(a) = avail {
            let fits = if p.host_total() <= a { "fits" } else { "does not fit" };
            write!(line, "; this model ({} layers) {fits} in {}", model.num_layers, gib(a))?;
            let deepest = deepest_fit_as(model, &layout_of, ecfg, a);
            line += &fit_words(deepest, "the largest of this shape that fits", a);
        }
        writeln!(t, "{line}")?;
    }
    Ok(())
}

/// `horizon plan`'s arguments.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The run configuration (YAML).
    #[arg(long, short)]
    pub config: PathBuf,
    /// Plan for a host with this much memory (`64GiB`, `192GB`) instead of this one's
    /// available memory.
    #[arg(long)]
    pub host_memory: Option<String>,
    /// Also project the run's speed on this machine: a built-in profile (h200-pcie5,
    /// h100-pcie5, a100-pcie4, gh200, this-cpu) or a YAML profile file.
    #[arg(long)]
    pub hardware: Option<String>,
    /// With --hardware: write the projected steps' timeline, op by op, to this file as a
    /// Chrome trace.
    #[arg(long, value_name = "FILE", requires = "hardware")]
    pub trace: Option<PathBuf>,
    /// Override a config key: `--set engine.expert_chunk=16` (repeatable; the value is YAML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// `horizon plan` as `args` say: the memory plan, or with `--hardware` the plan and the
/// projection.
pub fn run(args: &Args) -> Result<()> {
    let path = &args.config;
    let cfg = RawConfig::from_file_with(path, &args.set)?.resolve(&path.display().to_string())?;
    let host = match args.host_memory.as_deref().map(ByteSize::parse) {
        None => None,
        Some(Ok(ByteSize::Bytes(b))) if b > 0 => Some(b),
        Some(Ok(_)) => bail!("--host-memory must be a positive size such as 64GiB"),
        Some(Err(e)) => bail!("--host-memory: {e}"),
    };
    match &args.hardware {
        Some(hw) => print_projection(&cfg, hw, args.trace.as_deref()),
        None => print_plan(&cfg, host),
    }
}

/// `horizon plan`: print the report; an error (with the numbers) when the config does not fit.
pub fn print_plan(cfg: &RunConfig, host_memory: Option<u64>) -> Result<()> {
    let r = report(cfg, host_memory)?;
    print!("{}", r.text);
    r.plan.check()?;
    if cfg.raw.device.backend == crate::run::config::BackendKind::Cuda {
        crate::run::trainer::cuda_kernel_limits(
            &crate::model::describe(&r.model),
            &cfg.raw,
            r.seq_len,
        )?;
    }
    println!("fits");
    Ok(())
}

/// `horizon plan --hardware PROFILE`: the plan and the projection on that machine; an error
/// when the run does not fit it. With `trace`, the projected timeline of the plan's chosen
/// path is written there as a Chrome trace ([`crate::engine::trace`]).
pub fn print_projection(cfg: &RunConfig, profile: &str, trace: Option<&Path>) -> Result<()> {
    let p = crate::run::projection::projection(cfg, profile)?;
    print!("{}", p.text);
    if let Some(path) = trace {
        crate::engine::trace::write_chrome(path, "projection", &p.chosen.spans)?;
        println!("trace of the projected steps: {}", path.display());
    }
    if !p.fits {
        bail!(
            "the run does not fit {}: see the host and device lines above\nhint: use optimizer.memory: lean or compact, a smaller train.micro_batch_size, or engine.checkpoint_every",
            p.hw.name
        );
    }
    Ok(())
}

/// Where `threads` host threads run: the CPUs they are pinned to (`engine.pin_threads`).
fn pinning(threads: usize, pin: bool) -> String {
    let cpus = threads::cpus_of(threads, Placement::last(threads, pin));
    match (cpus.first(), cpus.last()) {
        (Some(a), Some(b)) if a == b => format!("pinned to CPU {a} (engine.pin_threads)"),
        (Some(a), Some(b)) if cpus.windows(2).all(|w| w[1] == w[0] + 1) => {
            format!("pinned to CPUs {a}-{b} (engine.pin_threads)")
        }
        (Some(_), Some(_)) => format!("pinned to CPUs {cpus:?} (engine.pin_threads)"),
        _ if pin => "unpinned (this system cannot pin threads)".to_string(),
        _ => "unpinned (engine.pin_threads: false)".to_string(),
    }
}

/// The experts' adapters of an adapter line (empty without).
fn expert_words(e: crate::model::lora::ExpertTargets) -> String {
    let part = |name: &str, t: Option<(usize, f32)>| t.map(|(r, _)| format!("{name} (r {r})"));
    let parts: Vec<String> = [part("experts' gate|up", e.gate_up), part("experts' down", e.down)]
        .into_iter()
        .flatten()
        .collect();
    if parts.is_empty() { String::new() } else { format!(" and the {}", parts.join(", ")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The extrapolated deepest fit is the search's, for dense, windowed and sparse fixture
    /// models in each memory mode: confirmed, or not tried (a model shallower than two periods;
    /// the MoE case's sparse layers, which do not repeat with its depth).
    #[test]
    fn the_extrapolated_deepest_fit_is_the_searched_one() {
        for case in ["llama_gqa", "gemma3_sliding", "qwen3_moe"] {
            let path =
                format!("{}/tests/fixtures/{case}/model/config.json", env!("CARGO_MANIFEST_DIR"));
            let model = ModelConfig::from_file(Path::new(&path)).unwrap();
            for memory in OptimizerMemory::ALL {
                let cpu = crate::run::config::BackendKind::Cpu;
                let ecfg = EngineConfig { memory, ..EngineConfig::small(cpu) };
                let at = |layers: usize| {
                    let mut m = model.clone();
                    m.num_layers = layers;
                    let p = plan_for(&m, &ecfg, None);
                    (p.params, p.host_total())
                };
                for avail in [at(7).1 + 5, 48 << 20, 300 << 20] {
                    let want = searched(&at, avail);
                    let period = model.num_layers * ecfg.checkpoint_every * 4;
                    let got = extrapolated(&at, period, avail);
                    assert!(got.is_none() || got == Some(want), "{case} {memory:?} {avail}");
                    let deep = want.0 >= 2 * period;
                    assert!(got.is_some() || !deep || case == "qwen3_moe", "{case} {memory:?}");
                    assert_eq!(deepest_fit(&model, &ecfg, avail), Some(want));
                }
            }
        }
    }
}
