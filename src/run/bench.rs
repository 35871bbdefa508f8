//! `horizon bench`: named benchmark shapes and the report printed after a run on the streaming
//! engine (tokens/s, FLOP rates, time by phase, memory).

use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::run::config::{RawConfig, Recompute, RunConfig};
use crate::run::summary::Summary;
use crate::run::trainer::run_streaming;

/// `horizon bench`'s arguments.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The run configuration (YAML); `data.format: synthetic` needs no data file.
    #[arg(long, short, conflicts_with = "model", required_unless_present = "model")]
    pub config: Option<PathBuf>,
    /// A named benchmark shape instead of a config: `llama-58m`.
    #[arg(long)]
    pub model: Option<String>,
    /// Steps excluded from the timings.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Override a config key: `--set train.steps=20` (repeatable; the value is YAML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Print the summary as one JSON object on the last line.
    #[arg(long)]
    pub json: bool,
    /// Override `engine.recompute`: auto, always or never.
    #[arg(long)]
    pub recompute: Option<String>,
    /// Write when each op ran, in the first 100 steps, to this file as a Chrome trace (open
    /// it in Perfetto or chrome://tracing; compare with `plan --hardware this-cpu --trace`).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
}

/// Run the benchmark `args` name and print its report (or the summary as JSON).
pub fn run(args: &Args) -> Result<()> {
    let mut cfg = match (&args.config, &args.model) {
        (Some(path), _) => {
            RawConfig::from_file_with(path, &args.set)?.resolve(&path.display().to_string())?
        }
        (None, Some(name)) => named_config(name)?,
        (None, None) => bail!("bench needs --config FILE or --model NAME"),
    };
    if let Some(r) = &args.recompute {
        cfg.raw.engine.recompute = parse_recompute(r)?;
    }
    cfg.trace = args.trace.clone();
    // A benchmark's output is its report: it starts over in its directory.
    cfg.overwrite = true;
    let s = run_streaming(cfg, false, args.warmup, None)?;
    match args.json {
        true => println!("{}", serde_json::to_string(&s)?),
        false => println!("{}", report(&s)),
    }
    Ok(())
}

/// Benchmark shapes `horizon bench --model NAME` runs: (name, config, what it is).
pub const NAMED: [(&str, &str, &str); 1] = [(
    "llama-58m",
    include_str!("../../bench/llama-58m.yaml"),
    "Llama, hidden 512, 8 layers, 8 heads, FFN 1408, vocab 32000, 4 x 256 tokens, fp32, AdamW + clipping (bench/torch_baseline.py's shape)",
)];

/// The resolved config of a named shape.
pub fn named_config(name: &str) -> Result<RunConfig> {
    let Some((_, yaml, _)) = NAMED.iter().find(|(n, _, _)| *n == name) else {
        let known: Vec<String> = NAMED.iter().map(|(n, _, what)| format!("{n} ({what})")).collect();
        bail!("no benchmark shape named {name:?}\nhint: one of: {}", known.join(", "));
    };
    let origin = format!("bench shape {name}");
    RawConfig::from_yaml(yaml, &origin)?.resolve(&origin)
}

/// `--recompute auto|always|never`.
pub fn parse_recompute(s: &str) -> Result<Recompute> {
    Ok(match s {
        "auto" => Recompute::Auto,
        "always" => Recompute::Always,
        "never" => Recompute::Never,
        _ => bail!("--recompute {s:?}: expected auto, always or never"),
    })
}

/// The human-readable report of a benchmark run.
pub fn report(s: &Summary) -> String {
    let p = &s.phase_s;
    let per = |x: f64| x / s.steps.max(1) as f64;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut out = String::new();
    out += &format!(
        "bench: {:.1} tokens/s ({} steps, {} tokens, {:.3} s)\n",
        s.tokens_per_s, s.steps, s.tokens, s.wall_s
    );
    out += &format!(
        "  FLOP/s: {:.1} GFLOP/s achieved (schedule, recompute included: {:.1} of {:.1} GFLOP per step), {:.1} GFLOP/s model (6*N*tokens + attention: {:.1} GFLOP per step)\n",
        s.achieved_gflops,
        per(s.flops.recompute) * 1e-9,
        per(s.flops.schedule) * 1e-9,
        s.model_gflops,
        per(s.flops.model) * 1e-9
    );
    out += &format!(
        "  per step (s): forward {:.3}, recompute {:.3}, backward {:.3}, head {:.3}, compute idle {:.3} | optimizer {:.3}, gradients {:.3}, embedding {:.3} (host; host queue busy {:.3}) | transfers h2d {:.3}, d2h {:.3}\n",
        per(p.forward),
        per(p.recompute),
        per(p.backward),
        per(p.head),
        per(s.compute_idle_s),
        per(p.optimizer),
        per(p.gradients),
        per(p.embedding),
        per(s.host_busy_s),
        per(s.h2d_busy_s),
        per(s.d2h_busy_s)
    );
    out += &format!(
        "  overlap ratio wall/max(compute, link) = {:.3}; peak RSS {:.1} MiB (planned host {:.1} MiB); peak device {:.1} MiB (planned {:.1} MiB)",
        s.overlap_ratio,
        mib(s.peak_rss_bytes),
        mib(s.planned_host_bytes),
        mib(s.peak_device_bytes),
        mib(s.planned_device_bytes)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_shapes_resolve() {
        for (name, _, _) in NAMED {
            named_config(name).unwrap();
        }
        let e = named_config("nope").unwrap_err().to_string();
        assert!(e.contains("llama-58m"), "{e}");
    }
}
