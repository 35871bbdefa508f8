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
        /// Print the summary as one JSON object on the last line.
        #[arg(long)]
        json: bool,
        /// Override `engine.recompute`: auto, always or never.
        #[arg(long)]
        recompute: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match try_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn try_main(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train { config, resume } => {
            let Some(path) = config else {
                if resume.is_some() {
                    bail!("--resume needs the run's --config");
                }
                return horizon::default_job::run(&horizon::default_job::default_out());
            };
            let cfg = horizon::config::RawConfig::from_file(&path)?
                .resolve(&path.display().to_string())?;
            horizon::train::run_streaming(cfg, true, 0, resume.as_deref())?;
            Ok(())
        }
        Command::Bench { config, model, warmup, json, recompute } => {
            let mut cfg = match (config, model) {
                (Some(path), _) => horizon::config::RawConfig::from_file(&path)?
                    .resolve(&path.display().to_string())?,
                (None, Some(name)) => horizon::bench::named_config(&name)?,
                (None, None) => bail!("bench needs --config FILE or --model NAME"),
            };
            if let Some(r) = recompute {
                cfg.raw.engine.recompute = horizon::bench::parse_recompute(&r)?;
            }
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
