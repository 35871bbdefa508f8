//! The `horizon` command line: `main` parses arguments and reports errors; the work happens in
//! the library (`horizon::train`, ...).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand};

/// Train and fine-tune LLMs whose state is far larger than accelerator memory.
#[derive(Parser, Debug)]
#[command(name = "horizon", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a model as described by a YAML config.
    Train {
        /// The run configuration (YAML). See README.md for every key.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Continue from a checkpoint directory, or `latest` (the newest in OUT/checkpoints).
        #[arg(long)]
        resume: Option<String>,
        /// Override a config key: `--set train.steps=200` (repeatable; the value is YAML).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Run a config's steps on the streaming engine without exporting, and report throughput,
    /// FLOP rates, time by phase, overlap (wall time over the busier of compute and link) and
    /// memory, after warm-up.
    Bench {
        /// The run configuration (YAML); `data.format: synthetic` needs no data file.
        #[arg(long, short, conflicts_with = "model", required_unless_present = "model")]
        config: Option<PathBuf>,
        /// A named benchmark shape instead of a config: `llama-58m`.
        #[arg(long)]
        model: Option<String>,
        /// Steps excluded from the timings.
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        /// Override a config key: `--set train.steps=20` (repeatable; the value is YAML).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Print the summary as one JSON object on the last line.
        #[arg(long)]
        json: bool,
        /// Override `engine.recompute`: auto, always or never.
        #[arg(long)]
        recompute: Option<String>,
        /// Write when each op ran, in the first 100 steps, to this file as a Chrome trace (open
        /// it in Perfetto or chrome://tracing; compare with `plan --hardware this-cpu --trace`).
        #[arg(long, value_name = "FILE")]
        trace: Option<PathBuf>,
    },
    /// Write a Hugging Face directory (config.json, safetensors shards + index, tokenizer files)
    /// from a checkpoint, a run's output directory (its newest checkpoint) or a HF directory.
    Export {
        /// A checkpoint (OUT/checkpoints/step-N), a run's output directory, or a HF directory.
        source: PathBuf,
        /// The directory to write.
        #[arg(long)]
        out: PathBuf,
        /// Weight type: fp32 (exact) or bf16 (rounded to nearest even).
        #[arg(long, value_enum, default_value = "fp32")]
        dtype: horizon::config::WeightDtype,
        /// Largest shard, e.g. 5GB, 500MB (more weights than this are split, with an index).
        #[arg(long, default_value = "5GB")]
        max_shard_size: String,
        /// SOURCE is an adapter (an adapter run's output directory or its final/, or a PEFT
        /// adapter directory): write the base with the adapter merged into its weights.
        #[arg(long)]
        merge: bool,
        /// With --merge: the base model directory (default: the one the adapter names).
        #[arg(long)]
        base: Option<PathBuf>,
    },
    /// Generate text from a HF model directory (KV cache; CPU backend or a GPU), streaming
    /// tokens as they come.
    Generate {
        /// A HF model directory with its tokenizer (e.g. OUT/final).
        #[arg(long)]
        model: PathBuf,
        /// The prompt.
        #[arg(long)]
        prompt: String,
        /// Render the prompt as a user turn with the tokenizer's chat template.
        #[arg(long)]
        chat: bool,
        /// With --chat: a system message before the user turn.
        #[arg(long)]
        system: Option<String>,
        /// Tokens to generate at most.
        #[arg(long, default_value_t = 128)]
        max_new_tokens: usize,
        /// 0 = greedy; otherwise sample from softmax(logits / temperature).
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        /// Nucleus sampling: keep the most likely tokens up to this probability mass.
        #[arg(long, default_value_t = 1.0)]
        top_p: f64,
        /// Seed of the sampling.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// cpu, or cuda (GPU 0: layers streamed through one bf16 weight slot, the KV cache on
        /// the device; needs a binary built with --features cuda).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// No KV cache: a whole forward of the sequence per token on the CPU (the reference
        /// the cache is checked against; quadratic in the length).
        #[arg(long)]
        full_recompute: bool,
        /// A LoRA adapter over --model (an adapter run's OUT/final, or a PEFT adapter
        /// directory), used unmerged: the base frozen as trained (NF4 for QLoRA).
        #[arg(long)]
        adapter: Option<PathBuf>,
    },
    /// Print a config's memory plan without training: host bytes by kind and per parameter,
    /// device bytes, the deepest model of this shape each optimizer.memory mode fits in the
    /// available memory, the largest micro-batch the device budget fits. Exit status 1 if the
    /// config does not fit.
    Plan {
        /// The run configuration (YAML).
        #[arg(long, short)]
        config: PathBuf,
        /// Plan for a host with this much memory (`64GiB`, `192GB`) instead of this one's
        /// available memory.
        #[arg(long)]
        host_memory: Option<String>,
        /// Also project the run's speed on this machine: a built-in profile (h200-pcie5,
        /// h100-pcie5, a100-pcie4, gh200, this-cpu) or a YAML profile file.
        #[arg(long)]
        hardware: Option<String>,
        /// With --hardware: write the projected steps' timeline, op by op, to this file as a
        /// Chrome trace.
        #[arg(long, value_name = "FILE", requires = "hardware")]
        trace: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match try_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `tracing` events to stderr, at the level `HORIZON_LOG` names (error, warn, info, debug,
/// trace; default info).
fn init_logging() {
    use std::io::IsTerminal;
    let level = match std::env::var("HORIZON_LOG").unwrap_or_default().to_lowercase().as_str() {
        "error" => tracing::Level::ERROR,
        "warn" => tracing::Level::WARN,
        "debug" => tracing::Level::DEBUG,
        "trace" => tracing::Level::TRACE,
        _ => tracing::Level::INFO,
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .with_max_level(level)
        .init();
}

fn try_main(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train { config, resume, set } => {
            let Some(path) = config else {
                if resume.is_some() {
                    bail!("--resume needs the run's --config");
                }
                return horizon::default_job::run(&horizon::default_job::default_out(), &set);
            };
            let cfg = horizon::config::RawConfig::from_file_with(&path, &set)?
                .resolve(&path.display().to_string())?;
            horizon::train::run_streaming(cfg, true, 0, resume.as_deref())?;
            Ok(())
        }
        Command::Plan { config, host_memory, hardware, trace } => {
            let cfg = horizon::config::RawConfig::from_file(&config)?
                .resolve(&config.display().to_string())?;
            let host = match host_memory.as_deref().map(horizon::config::ByteSize::parse) {
                None => None,
                Some(Ok(horizon::config::ByteSize::Bytes(b))) if b > 0 => Some(b),
                Some(Ok(_)) => bail!("--host-memory must be a positive size such as 64GiB"),
                Some(Err(e)) => bail!("--host-memory: {e}"),
            };
            match hardware {
                Some(hw) => horizon::plan_cmd::run_on(&cfg, &hw, trace.as_deref()),
                None => horizon::plan_cmd::run(&cfg, host),
            }
        }
        Command::Export { source, out, dtype, max_shard_size, merge, base } => {
            let max_shard_bytes = match horizon::config::ByteSize::parse(&max_shard_size) {
                Ok(horizon::config::ByteSize::Bytes(b)) if b > 0 => b,
                Ok(_) => bail!("--max-shard-size must be a positive size such as 5GB"),
                Err(e) => bail!("--max-shard-size: {e}"),
            };
            let opts =
                horizon::export::ExportOptions { dtype: dtype.save_dtype(), max_shard_bytes };
            if base.is_some() && !merge {
                bail!("--base is for --merge: the base model an adapter is merged into");
            }
            let e = if merge {
                horizon::merge::merge_dir(&source, base.as_deref(), &out, opts)?
            } else {
                horizon::export::export_dir(&source, &out, opts)?
            };
            println!(
                "exported {} ({} shard(s), {:.1} MB of weights; tokenizer files: {})",
                out.display(),
                e.shards.len(),
                e.total_bytes as f64 / 1e6,
                if e.tokenizer_files.is_empty() {
                    "none".to_string()
                } else {
                    e.tokenizer_files.join(", ")
                }
            );
            Ok(())
        }
        Command::Generate {
            model,
            prompt,
            chat,
            system,
            max_new_tokens,
            temperature,
            top_p,
            seed,
            device,
            full_recompute,
            adapter,
        } => {
            use horizon::engine::options::BackendKind;
            use horizon::generate::Decode;
            use std::io::Write;
            let opts =
                horizon::generate::SampleOptions { max_new_tokens, temperature, top_p, seed };
            let decode = match (device.as_str(), full_recompute) {
                ("cpu", true) => Decode::FullRecompute,
                ("cpu", false) => Decode::KvCache(BackendKind::Cpu),
                ("cuda", false) => Decode::KvCache(BackendKind::Cuda),
                ("cuda", true) => bail!("--full-recompute runs on the CPU only (no --device cuda)"),
                (other, _) => bail!("--device {other}: expected cpu or cuda"),
            };
            let mut g = match &adapter {
                None => horizon::generate::Generator::load(&model)?,
                Some(a) => horizon::generate::Generator::load_with_adapter(&model, a)?,
            };
            g.set_decode(decode);
            let ids = g.prompt_ids(&prompt, chat, system.as_deref())?;
            let mut stdout = std::io::stdout();
            if !chat {
                print!("{prompt}");
            }
            g.generate(&ids, opts, &mut |piece| {
                let _ = write!(stdout, "{piece}");
                let _ = stdout.flush();
            })?;
            println!();
            Ok(())
        }
        Command::Bench { config, model, warmup, json, recompute, set, trace } => {
            let mut cfg = match (config, model) {
                (Some(path), _) => horizon::config::RawConfig::from_file_with(&path, &set)?
                    .resolve(&path.display().to_string())?,
                (None, Some(name)) => horizon::bench::named_config(&name)?,
                (None, None) => bail!("bench needs --config FILE or --model NAME"),
            };
            if let Some(r) = recompute {
                cfg.raw.engine.recompute = horizon::bench::parse_recompute(&r)?;
            }
            cfg.trace = trace;
            let s = horizon::train::run_streaming(cfg, false, warmup, None)?;
            if json {
                println!("{}", serde_json::to_string(&s)?);
            } else {
                println!("{}", horizon::bench::report(&s));
            }
            Ok(())
        }
    }
}
