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
        Command::Train { config } => {
            let Some(path) = config else {
                bail!(
                    "no config given\nhint: horizon train --config configs/llama_gqa.yaml (see README.md)"
                );
            };
            let cfg = horizon::config::RawConfig::from_file(&path)?
                .resolve(&path.display().to_string())?;
            horizon::train::run(cfg)?;
            Ok(())
        }
    }
}
