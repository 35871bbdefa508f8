//! `horizon train --config F`: the run a YAML config describes, on the streaming engine, into
//! its `output.dir` (with no config, `main` runs the built-in default job instead:
//! [`crate::run::default_job`]).

use std::path::PathBuf;

use anyhow::Result;

use crate::run::config::RawConfig;
use crate::run::trainer::run_streaming;

/// `horizon train`'s arguments.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The run configuration (YAML). See docs/configuration.md for every key.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Continue from a checkpoint directory, `latest` (the newest in OUT/checkpoints), or
    /// `latest-sound` (the newest whose files verify, passing over damaged ones).
    #[arg(long)]
    pub resume: Option<String>,
    /// Override a config key: `--set train.steps=200` (repeatable; the value is YAML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Start over in an output.dir that holds another run's checkpoints, removing them
    /// (without it such a run is refused: resume it with --resume latest instead).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
}

/// Train as `config` (with `--set` overrides) says, resuming from `args.resume` if given.
pub fn run(config: &std::path::Path, args: &Args) -> Result<()> {
    let mut cfg =
        RawConfig::from_file_with(config, &args.set)?.resolve(&config.display().to_string())?;
    cfg.overrides = args.set.clone();
    cfg.overwrite = args.overwrite;
    for line in cfg.hub_lines() {
        println!("{line}");
    }
    run_streaming(cfg, true, 0, args.resume.as_deref())?;
    Ok(())
}
