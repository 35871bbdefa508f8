//! `horizon generate`: text from a HF model directory (and optionally a LoRA adapter over it),
//! streamed to stdout token by token as the [`Generator`] decodes it.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::engine::options::BackendKind;
use crate::hf::hub_cache::local_path;
use crate::run::decode::{Decode, Generator, SampleOptions};

/// `horizon generate`'s arguments.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A HF model directory with its tokenizer (e.g. OUT/final), or a Hub id (ORG/NAME) in the
    /// local Hugging Face cache.
    #[arg(long)]
    pub model: PathBuf,
    /// The prompt.
    #[arg(long)]
    pub prompt: String,
    /// Render the prompt as a user turn with the tokenizer's chat template.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: a system message before the user turn.
    #[arg(long)]
    pub system: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// 0 = greedy; otherwise sample from softmax(logits / temperature).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// cpu, or cuda (GPU 0: layers streamed through one bf16 weight slot, the KV cache on
    /// the device; needs a binary built with --features cuda).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// No KV cache: a whole forward of the sequence per token on the CPU (the reference
    /// the cache is checked against; quadratic in the length).
    #[arg(long)]
    pub full_recompute: bool,
    /// A LoRA adapter over --model (an adapter run's OUT/final, or a PEFT adapter
    /// directory), used unmerged: the base frozen as trained (NF4 for QLoRA).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
}

/// Generate as `args` say, printing the prompt (unless `--chat`) and each piece as it comes.
pub fn run(args: &Args) -> Result<()> {
    let opts = SampleOptions {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
    };
    let decode = match (args.device.as_str(), args.full_recompute) {
        ("cpu", true) => Decode::FullRecompute,
        ("cpu", false) => Decode::KvCache(BackendKind::Cpu),
        ("cuda", false) => Decode::KvCache(BackendKind::Cuda),
        ("cuda", true) => bail!("--full-recompute runs on the CPU only (no --device cuda)"),
        (other, _) => bail!("--device {other}: expected cpu or cuda"),
    };
    // A model (and an adapter) may be named by Hub id, from the local Hugging Face cache.
    let model = local_path("--model", &args.model, "config.json")?;
    let mut g = match &args.adapter {
        None => Generator::load(&model)?,
        Some(a) => {
            let adapter = local_path("--adapter", a, "adapter_config.json")?;
            Generator::load_with_adapter(&model, &adapter)?
        }
    };
    g.set_decode(decode);
    let ids = g.prompt_ids(&args.prompt, args.chat, args.system.as_deref())?;
    let mut stdout = std::io::stdout();
    if !args.chat {
        print!("{}", args.prompt);
    }
    if args.max_new_tokens == 0 {
        eprintln!("nothing generated: --max-new-tokens 0");
        return Ok(());
    }
    let mut printed = 0;
    g.generate(&ids, opts, &mut |piece| {
        printed += piece.len();
        let _ = write!(stdout, "{piece}");
        let _ = stdout.flush();
    })?;
    println!();
    if printed == 0 {
        // Silence would read as a hang or a crash.
        eprintln!(
            "nothing generated: the model's first token ended the sequence (an EOS id of its \
             generation_config.json or config.json), or decoded to no text"
        );
    }
    Ok(())
}
