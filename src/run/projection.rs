//! `horizon plan --hardware PROFILE`: the run's plan for that machine (its device memory as the
//! budget, the CUDA backend's bf16 weights on a GPU profile), its memory fit, and the
//! projection of its steady step.

use std::fmt::Write as _;
use std::path::Path;
use std::rc::Rc;

use anyhow::{Result, bail};
use horizon_backend::Queue;

use crate::engine::chunking::Chunking;
use crate::engine::exec::plan_shape;
use crate::engine::memory::gib;
use crate::engine::options::EngineConfig;
use crate::engine::plan::Schedule;
use crate::engine::resolve::{Machine, most_kept, resolve};
use crate::engine::sizes::Sizes;
use crate::run::config::{BackendKind, DeviceAttention, RunConfig, WeightPath};
use crate::run::data::{SeqLen, load_datasets};
use crate::run::load::{model_config, run_layout};
use crate::run::trainer::recompute_words;
use crate::sim::calibrate::{CpuMeasured, HostMeasured, this_cpu};
use crate::sim::cost::{CostModel, DeviceModel, HostByRates, HostModel, UploadPath};
use crate::sim::hardware::{
    BUILT_IN, FLASH_ATTENTION_EFFICIENCY, Gpu, Hardware, Roofline, WMMA_ATTENTION_EFFICIENCY,
    attention_efficiency_at, fp32_attention_efficiency,
};
use crate::sim::{Projection, project};

/// A profile by name: built in, `this-cpu` (the CPU device at `link_gbps`), or a YAML file.
pub fn hardware(name: &str, link_gbps: f64) -> Result<Hardware> {
    if name == "this-cpu" {
        let host = crate::engine::memory::host_available_bytes().unwrap_or(0);
        return Ok(this_cpu(link_gbps, host));
    }
    if let Some(hw) = Hardware::built_in(name) {
        return Ok(hw);
    }
    let path = Path::new(name);
    if path.exists() {
        return Hardware::from_file(path);
    }
    let known: Vec<String> = BUILT_IN.iter().map(|(n, what)| format!("{n} ({what})")).collect();
    bail!(
        "--hardware {name:?}: no such profile or file\nhint: one of {}, or a YAML file (see docs/projection.md)",
        known.join("; ")
    )
}

/// What a projection was made for, and what it found.
pub struct ProjectionRun {
    pub hw: Hardware,
    pub ecfg: EngineConfig,
    pub upload: UploadPath,
    /// The projection of the upload path the plan chose, and (GPU profiles) of the other one.
    pub chosen: Projection,
    pub other: Option<(UploadPath, Projection)>,
    /// Whether the run fits the machine's host and device memory.
    pub fits: bool,
    /// The share of a step's positions that are the data's own tokens, not padding (`None`:
    /// the data could not be read; the tokens/s count padding).
    pub real_fraction: Option<f64>,
    pub text: String,
}

/// The projection of `cfg` on profile `name`.
pub fn projection(cfg: &RunConfig, name: &str) -> Result<ProjectionRun> {
    let raw = &cfg.raw;
    let mut hw = hardware(name, raw.device.link_gbps)?;
    let model = model_config(raw)?;
    let seq = match load_datasets(raw, model.vocab_size) {
        Ok(sets) => SeqLen::of_data(raw, &sets),
        Err(e) => SeqLen::assumed(raw, &format!("the data could not be read ({e:#})")),
    };
    let cpu = hw.name == "this-cpu";
    let backend = if cpu { BackendKind::Cpu } else { BackendKind::Cuda };
    let ecfg = EngineConfig { seq_len: seq.len, backend, ..raw.engine_config() };
    // engine.recompute and engine.weight_upload as `horizon train` resolves them, on the
    // profile's device and host memory (the CPU device: device.memory, as train does).
    let layout = run_layout(raw, &model, cfg.adapter.as_ref())?;
    // `device.attention` other than auto runs slower kernels: at most their rate.
    let asked = match raw.device.attention {
        DeviceAttention::Auto => f64::INFINITY,
        DeviceAttention::Wmma => WMMA_ATTENTION_EFFICIENCY,
        DeviceAttention::Fp32 => fp32_attention_efficiency(layout.dims.d),
    };
    hw.gpu.attention_efficiency = hw.gpu.attention_efficiency.min(asked);
    let budget = match (cpu, raw.device.memory) {
        (false, _) => Some(hw.device_bytes()),
        (true, crate::run::config::ByteSize::Bytes(b)) => Some(b),
        (true, crate::run::config::ByteSize::Auto) => None,
    };
    let machine = Machine::new(backend, budget, Some(hw.host_bytes()));
    let ecfg = resolve(&layout, ecfg, raw.engine.recompute, raw.engine.weight_upload, &machine);
    let upload = match (cpu, ecfg.weights) {
        (true, _) => UploadPath::Fp32,
        (false, WeightPath::Masters) => UploadPath::RoundInUpload,
        (false, WeightPath::Image) => UploadPath::Image,
        (false, WeightPath::Staged) => UploadPath::Staged,
    };
    // The engine's sizes and schedule for each way of uploading weights (what the image or
    // the stages take is a line of the host plan; staging adds ops to the schedule).
    let planned = |u: UploadPath| {
        let e = EngineConfig { weights: u.weights(), ..ecfg };
        let sizes = Sizes::new(&layout, &e);
        let schedule = Schedule::new(plan_shape(&layout, &e, &sizes));
        (e, sizes, schedule)
    };
    let (ecfg, sizes, schedule) = planned(upload);
    let image = 2 * crate::engine::sizes::image_elems(&layout) as u64;
    // engine.host_threads as the engine resolves it on the profile's host (this-cpu: on this
    // machine, where the CPU device's kernels share the cores: its host work still gets the
    // whole pool when it runs alone, which the shared-host model accounts for).
    let host_threads = if cpu {
        ecfg.host_threads.resolve(backend).min(hw.host.cores)
    } else {
        ecfg.host_threads.resolve_for(backend, hw.host.cores).min(hw.host.cores)
    };
    let roofline = Roofline(&hw.gpu);
    let (measured, host_measured);
    let (device, host): (&dyn DeviceModel, &dyn HostModel) = if cpu {
        measured = Rc::new(CpuMeasured::new(ecfg.pin_threads));
        host_measured = HostMeasured::new(host_threads, &layout, ecfg.pin_threads)
            .beside(Rc::clone(&measured), sizes.mb_rows);
        hw.host.contended = host_measured.contended();
        (&*measured, &host_measured)
    } else {
        (&roofline, &HostByRates { host: &hw.host, threads: host_threads })
    };
    let tokens = ecfg.batch_size * ecfg.seq_len;
    let chunking = Chunking::of(&layout, &ecfg);
    let base = CostModel {
        layout: &layout,
        sizes: &sizes,
        cfg: &ecfg,
        hw: &hw,
        device,
        host,
        upload,
        host_threads,
        chunking: &chunking,
    };
    let chosen = project(&schedule, &base, tokens);
    let other = match upload {
        UploadPath::Fp32 => None,
        UploadPath::Image => Some(UploadPath::RoundInUpload),
        UploadPath::RoundInUpload | UploadPath::Staged => Some(UploadPath::Image),
    }
    .map(|u| {
        let (e, s, sched) = planned(u);
        let p = project(&sched, &CostModel { sizes: &s, cfg: &e, upload: u, ..base }, tokens);
        (u, p, s.host_total() as u64 <= hw.host_bytes())
    });
    let fits = sizes.host_total() as u64 <= hw.host_bytes()
        && (cpu || sizes.device_total() as u64 <= hw.device_bytes());
    let mut text = String::new();
    fit_lines(&mut text, &hw, &sizes, image, upload, cpu)?;
    writeln!(
        text,
        "  engine.recompute: {:?} -> {} (engine.checkpoint_every: {})",
        raw.engine.recompute,
        recompute_words(ecfg.kept_layers, layout.dims.layers),
        ecfg.checkpoint_every
    )?;
    let real_fraction = seq.real_fraction();
    render(&mut text, &hw, &chosen, cpu, real_fraction)?;
    if let Some(d) = raw.dpo() {
        let live = d.reference == crate::run::config::ReferenceMode::Live;
        writeln!(
            text,
            "  train.objective: dpo: a step also runs forward-only passes over its rows (the \
             policy's log-probs{}), not in these figures: about +{}% of a step's compute",
            if live { ", and the live reference's" } else { "" },
            if live { 67 } else { 33 }
        )?;
    }
    flops_line(&mut text, layout.trains_base())?;
    if !cpu
        && let Some((p, e)) = fastest_fit(&base, &machine, tokens)
        && (e.checkpoint_every, e.kept_layers) != (ecfg.checkpoint_every, ecfg.kept_layers)
        && p.step_s < 0.99 * chosen.step_s
    {
        writeln!(
            text,
            "  fastest plan that fits this machine: engine.checkpoint_every: {}{}: step {:.3} s, {:.0} tokens/s, MFU {:.1}%",
            e.checkpoint_every,
            kept_words(e.kept_layers, layout.dims.layers),
            p.step_s,
            p.tokens_per_s(),
            100.0 * p.mfu(peak(&hw))
        )?;
    }
    if let Some((u, p, fits)) = &other {
        writeln!(
            text,
            "  with weights {} instead: step {:.3} s, {:.0} tokens/s{}{}",
            upload_words(*u),
            p.step_s,
            p.tokens_per_s(),
            if cpu { String::new() } else { format!(", MFU {:.1}%", 100.0 * p.mfu(peak(&hw))) },
            if *fits { "" } else { " (its host plan does not fit this machine)" }
        )?;
    }
    if !cpu && let Some(p) = with_flash_attention(&schedule, &base, tokens) {
        writeln!(
            text,
            "  with a FlashAttention-class attention ({:.0}% of the peak, as PyTorch's on an H200) instead of Horizon's kernels ({:.1}%): step {:.3} s, {:.0} tokens/s, MFU {:.1}%",
            100.0 * FLASH_ATTENTION_EFFICIENCY,
            100.0 * attention_efficiency_at(&hw.gpu, layout.dims.d),
            p.step_s,
            p.tokens_per_s(),
            100.0 * p.mfu(peak(&hw))
        )?;
    }
    let other = other.map(|(u, p, _)| (u, p));
    Ok(ProjectionRun { hw, ecfg, upload, chosen, other, fits, real_fraction, text })
}

/// The run projected with attention at [`FLASH_ATTENTION_EFFICIENCY`] of the peak, where the
/// profile's attention is slower: the step the rest of the plan allows.
fn with_flash_attention(
    schedule: &Schedule,
    base: &CostModel,
    tokens: usize,
) -> Option<Projection> {
    let gpu = &base.hw.gpu;
    if attention_efficiency_at(gpu, base.layout.dims.d) >= FLASH_ATTENTION_EFFICIENCY {
        return None;
    }
    let fast = Gpu { attention_efficiency: FLASH_ATTENTION_EFFICIENCY, ..gpu.clone() };
    let device = Roofline(&fast);
    Some(project(schedule, &CostModel { device: &device, ..*base }, tokens))
}

/// What `kept` of `layers` layers keeping their internals asks of the config, for the fastest
/// plan's line.
fn kept_words(kept: usize, layers: usize) -> String {
    match kept {
        0 => String::new(),
        k if k == layers => ", engine.recompute: never".to_string(),
        k => format!(
            ", engine.recompute: auto with device.memory: the GPU's ({k} of {layers} layers keep their internals)"
        ),
    }
}

/// The fastest of the checkpoint spacings (and kept internals: every layer's, or as many as
/// the device holds) whose plan fits `machine`, projected under `base`'s model.
fn fastest_fit(
    base: &CostModel<'_>,
    machine: &Machine,
    tokens: usize,
) -> Option<(Projection, EngineConfig)> {
    let (layout, ecfg) = (base.layout, *base.cfg);
    let fits = |e: &EngineConfig| machine.fits(layout, e);
    let speed = |e: &EngineConfig| {
        let s = Sizes::new(layout, e);
        let m = CostModel { sizes: &s, cfg: e, ..*base };
        project(&Schedule::new(plan_shape(layout, e, &s)), &m, tokens)
    };
    [1, 2, 3, 4, 6, 8]
        .into_iter()
        .filter(|&k| k <= layout.dims.layers)
        .map(|k| EngineConfig { checkpoint_every: k, kept_layers: 0, ..ecfg })
        .filter(fits)
        // Already fitted: every layer's internals when they fit, else as many as do.
        .chain(most_kept(layout, ecfg, machine))
        .map(|e| (speed(&e), e))
        .min_by(|a, b| a.0.step_s.total_cmp(&b.0.step_s))
}

fn peak(hw: &Hardware) -> f64 {
    hw.gpu.bf16_tflops * 1e12
}

fn upload_words(u: UploadPath) -> &'static str {
    match u {
        UploadPath::Fp32 => "fp32, copied as they are (the CPU device)",
        UploadPath::Image => "from a bf16 image the optimizer writes (a pure copy)",
        UploadPath::RoundInUpload => "rounded from the fp32 masters inside each upload",
        UploadPath::Staged => {
            "rounded by the host queue into two bf16 stages ahead of the link (a pure copy)"
        }
    }
}

fn fit_lines(
    t: &mut String,
    hw: &Hardware,
    sizes: &Sizes,
    image: u64,
    upload: UploadPath,
    cpu: bool,
) -> Result<()> {
    writeln!(t, "projection on {} ({})", hw.name, hw.about)?;
    let host = sizes.host_total() as u64;
    let fits = |a: u64, b: u64| if a <= b { "fits" } else { "DOES NOT FIT" };
    writeln!(
        t,
        "  host: {} of {} ({}){}",
        gib(host),
        gib(hw.host_bytes()),
        fits(host, hw.host_bytes()),
        match upload {
            UploadPath::Image => format!("; includes the bf16 weight image, {}", gib(image)),
            UploadPath::RoundInUpload => {
                format!("; without the bf16 weight image ({})", gib(image))
            }
            UploadPath::Staged => format!(
                "; two bf16 weight stages, {}, instead of the bf16 weight image, {}",
                gib(sizes.stage_bytes() as u64),
                gib(image)
            ),
            UploadPath::Fp32 => String::new(),
        }
    )?;
    if !cpu {
        let dev = sizes.device_total() as u64;
        writeln!(
            t,
            "  device: {} of {} ({})",
            gib(dev),
            gib(hw.device_bytes()),
            fits(dev, hw.device_bytes())
        )?;
        // What the device's memory goes to: the planner keeps as many layers' internals as
        // the rest leaves room for.
        for (what, b) in sizes.device_bytes().into_iter().filter(|&(_, b)| b > 0) {
            writeln!(t, "    {:>12}  {what}", gib(b as u64))?;
        }
    }
    writeln!(t, "  weight uploads: {}", upload_words(upload))?;
    if cpu {
        writeln!(
            t,
            "  host threads beside the kernels on the same cores: {:.2} of their speed (measured)",
            hw.host.contended
        )?;
    }
    Ok(())
}

const QUEUE_NAMES: [&str; 4] = ["compute", "h2d", "d2h", "host"];

/// Seconds to at least three significant digits and at least three decimals: a queue busy for
/// 6.42 ms a step reads `0.00642`, not `0.006` (which a validation would compare as 6 ms).
fn secs(s: f64) -> String {
    let decimals = if s > 0.0 && s.is_finite() { 2 - s.log10().floor() as i32 } else { 3 };
    format!("{s:.*}", decimals.clamp(3, 9) as usize)
}

/// What the projection's model FLOPs (its MFU) count.
fn flops_line(t: &mut String, trains_base: bool) -> Result<()> {
    let products = if trains_base {
        "6 x matrix parameters x tokens (forward, input and weight gradients)"
    } else {
        "(4 x frozen + 6 x trained matrix parameters) x tokens (the frozen base's forward and \
         input gradient, no weight gradient of it; the adapters' forward and both gradients)"
    };
    writeln!(
        t,
        "  model FLOPs (MFU): what the step computes, {products} + attention (3x its forward), \
         over every position, padding included; recompute not counted"
    )?;
    Ok(())
}

/// The tokens of a step and their rate: every position (padded), and the data's own tokens
/// where the data was read.
fn tokens_words(p: &Projection, real: Option<f64>) -> String {
    let padded = format!("{} tokens per step: {:.0} tokens/s", p.tokens, p.tokens_per_s());
    match real {
        Some(f) if f >= 0.9995 => {
            format!("{padded} (no padding: every row is as long as the longest)")
        }
        Some(f) => format!(
            "{padded} padded, {:.0} real tokens/s ({:.1}% of the positions are the data's tokens, the rest padding)",
            f * p.tokens_per_s(),
            100.0 * f
        ),
        None => {
            format!("{padded} padded (the data could not be read: how many are padding is unknown)")
        }
    }
}

fn render(
    t: &mut String,
    hw: &Hardware,
    p: &Projection,
    cpu: bool,
    real: Option<f64>,
) -> Result<()> {
    let mfu = if cpu {
        format!("{:.1} GFLOP/s model", p.model_flops / p.step_s * 1e-9)
    } else {
        format!("MFU {:.1}% of {:.0} TFLOP/s", 100.0 * p.mfu(peak(hw)), hw.gpu.bf16_tflops)
    };
    writeln!(
        t,
        "  projected step {} s (first step {} s), {}, {mfu}",
        secs(p.step_s),
        secs(p.first_step_s),
        tokens_words(p, real)
    )?;
    let busy: Vec<String> = (0..4)
        .map(|q| {
            let share = 100.0 * p.busy[q] / p.step_s;
            format!("{} {} s ({share:.0}%)", QUEUE_NAMES[q], secs(p.busy[q]))
        })
        .collect();
    writeln!(t, "  busy per step: {}", busy.join(", "))?;
    writeln!(t, "  {:<14} {:>9}  bound (critical path)", "phase", "time")?;
    for ph in &p.phases {
        if ph.seconds <= 0.0 {
            continue;
        }
        let q = ph.bound.index();
        writeln!(
            t,
            "  {:<14} {:>7.3} s  {} {:.0}% ({})",
            ph.name,
            ph.seconds,
            QUEUE_NAMES[q],
            100.0 * ph.bound_s / ph.seconds,
            ph.top_op
        )?;
        let link = matches!(ph.bound, Queue::H2D | Queue::D2H);
        let compute = ph.busy[Queue::Compute.index()];
        if link && compute > 0.0 {
            let need = p.tokens as f64 * ph.busy[q] / compute;
            writeln!(
                t,
                "  {:<14} link-bound: compute-bound from about {:.0} tokens per step",
                "", need
            )?;
        }
    }
    // The host's work (optimizer updates, roundings) does not grow with the tokens a step, its
    // compute does; host work moves between phases as they stretch, so this is said of the
    // whole step, not of a phase.
    let (host, compute) = (p.busy[Queue::Host.index()], p.busy[Queue::Compute.index()]);
    if host >= 0.95 * p.step_s && compute > 0.0 && host > compute {
        writeln!(
            t,
            "  host-bound: the host's {} s a step do not grow with the tokens; compute would \
             bound the step from about {:.0} tokens per step (train.batch_size)",
            secs(host),
            p.tokens as f64 * host / compute
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::secs;

    #[test]
    fn seconds_keep_three_significant_digits() {
        assert_eq!(secs(1.4364), "1.436");
        assert_eq!(secs(0.4201), "0.420");
        assert_eq!(secs(0.006_424), "0.00642");
        assert_eq!(secs(0.000_031_25), "0.0000313");
        assert_eq!(secs(0.0), "0.000");
        assert_eq!(secs(12.5), "12.500");
    }
}
