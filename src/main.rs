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
    /// overlap (wall time over the busier of compute and link) and memory, after warm-up.
    Bench {
        /// The run configuration (YAML); `data.format: synthetic` needs no data file.
        #[arg(long, short)]
        config: PathBuf,
        /// Steps excluded from the timings.
        #[arg(long, default_value_t = 1)]
        warmup: usize,
    },
    /// Print a config's memory plan without training: host bytes by kind and per parameter,
    /// device bytes, the deepest model of this shape each optimizer.memory mode fits in the
    /// available memory, the largest micro-batch the device budget fits. Exit status 1 if the
    /// config does not fit.
    Plan {
        /// The run configuration (YAML).
        #[arg(long, short)]
        config: PathBuf,
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
        Command::Plan { config } => {
            let cfg = horizon::config::RawConfig::from_file(&config)?
                .resolve(&config.display().to_string())?;
            horizon::engine::plan_cmd::run(&cfg)
        }
        Command::Bench { config, warmup } => {
            let cfg = horizon::config::RawConfig::from_file(&config)?
                .resolve(&config.display().to_string())?;
            let s = horizon::train::run_streaming(cfg, false, warmup, None)?;
            println!(
                "bench: {:.1} tokens/s; wall {:.3} s, device compute {:.3} s, link busy {:.3} s, overlap ratio wall/max(compute, link) = {:.3}; peak RSS {} vs planned host {}; peak device {} vs planned {}",
                s.tokens_per_s,
                s.wall_s,
                s.device_compute_s,
                s.link_busy_s,
                s.overlap_ratio,
                s.peak_rss_bytes,
                s.planned_host_bytes,
                s.peak_device_bytes,
                s.planned_device_bytes
            );
            Ok(())
        }
    }
}
