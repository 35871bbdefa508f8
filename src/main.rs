//! The `horizon` command line: `main` parses arguments and reports errors; each verb's work
//! happens in its file of the library's run layer (`horizon::run::train`, ...).

use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand};
use horizon::run;

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
    Train(run::train::Args),
    /// Run a config's steps on the streaming engine without exporting, and report throughput,
    /// FLOP rates, time by phase, overlap (wall time over the busier of compute and link) and
    /// memory, after warm-up.
    Bench(run::bench::Args),
    /// Write a Hugging Face directory (config.json, safetensors shards + index, tokenizer files)
    /// from a checkpoint, a run's output directory (its newest checkpoint) or a HF directory.
    Export(run::export::Args),
    /// Generate text from a HF model directory (KV cache; CPU backend or a GPU), streaming
    /// tokens as they come.
    Generate(run::generate::Args),
    /// Print a config's memory plan without training: host bytes by kind and per parameter,
    /// device bytes, the deepest model of this shape each optimizer.memory mode fits in the
    /// available memory, the largest micro-batch the device budget fits. Exit status 1 if the
    /// config does not fit.
    Plan(run::plan::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match try_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(i) = e.downcast_ref::<run::summary::Interrupted>() {
                eprintln!("{i}");
                return ExitCode::from((128 + i.signal) as u8);
            }
            if let Some(done) = e.downcast_ref::<run::summary::AlreadyFinished>() {
                println!("{done}");
                return ExitCode::SUCCESS;
            }
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

/// Each verb's arguments go to its file in `run/`; with no config, `train` is the default job.
fn try_main(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(args) => match &args.config {
            Some(path) => run::train::run(path, &args),
            None if args.resume.is_some() => bail!("--resume needs the run's --config"),
            None => run::default_job::run(&run::default_job::default_out(), &args.set),
        },
        Command::Bench(args) => run::bench::run(&args),
        Command::Export(args) => run::export::run(&args),
        Command::Generate(args) => run::generate::run(&args),
        Command::Plan(args) => run::plan::run(&args),
    }
}
