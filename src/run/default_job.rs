//! The built-in default job (`horizon train` with no arguments): a small Llama learns two-digit
//! addition written as text ("47+38=85"), from scratch, with the byte tokenizer, on the CPU
//! backend, in a few minutes on two cores. Its loss on the 1000 held-out problems is evaluated
//! every [`EVAL_EVERY`] steps (plotted beside the training loss); it ends by showing some of the
//! model's answers to held-out problems and its accuracy on them.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::data::pretokenized::Row;
use crate::model::params::ParamStore;
use crate::rng::SplitMix64;
use crate::run::config::{RawConfig, RunConfig};
use crate::run::decode::{Generator, SampleOptions};
use crate::run::load::model_config;
use crate::run::trainer::run_streaming;
use crate::tokenizer::{ByteTokenizer, Tokenizer};

/// Optimizer steps of the default job: about 2.3 minutes on two cores, after which about 95% of
/// the held-out problems are answered right (1200 steps: under a minute, 20-35%).
pub const STEPS: usize = 3000;

/// Steps between evaluations of the held-out problems' loss (logged as `eval_loss`, plotted).
pub const EVAL_EVERY: usize = 100;

/// The job's config; `OUT` is its output directory.
pub fn config_yaml(out: &Path, steps: usize) -> String {
    format!(
        "# Built-in default job: two-digit addition, a small Llama from scratch, byte tokenizer.\n\
model:\n  init: random\n  arch: llama\n  seed: 0\n  hidden_size: 96\n  intermediate_size: 256\n  num_hidden_layers: 3\n  num_attention_heads: 4\n  num_key_value_heads: 4\n  vocab_size: 259\n  max_position_embeddings: 16\n\
data:\n  path: '{data}'\n  eval_path: '{eval}'\n  format: pretokenized\n  tokenizer: byte\n  shuffle: true\n\
train:\n  steps: {steps}\n  batch_size: 64\n  max_seq_len: 12\n  seed: 0\n  eval_every: {EVAL_EVERY}\n\
optimizer:\n  lr: 3.0e-3\n  schedule: cosine\n  warmup_steps: 40\n  min_lr: 1.0e-4\n  betas: [0.9, 0.98]\n  weight_decay: 0.0\n  grad_clip: 1.0\n\
engine:\n  checkpoint_every: 1\n\
output:\n  dir: '{out}'\n",
        data = out.join("addition-train.jsonl").display(),
        eval = out.join("addition-eval.jsonl").display(),
        out = out.display()
    )
}

/// `(a, b)`: the problem `a+b=`.
pub type Problem = (u32, u32);

/// Every problem `a+b=` with a, b in 0..100, split into train and held-out sets.
fn problems(seed: u64) -> (Vec<Problem>, Vec<Problem>) {
    let mut all: Vec<Problem> = (0..100).flat_map(|a| (0..100).map(move |b| (a, b))).collect();
    let mut rng = SplitMix64::new(seed ^ 0xADD);
    for i in (1..all.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        all.swap(i, j);
    }
    let held_out = all.split_off(all.len() - 1000);
    (all, held_out)
}

/// A problem as text: `47+38=`.
fn prompt_text(a: u32, b: u32) -> String {
    format!("{a}+{b}=")
}

/// Its answer: `85`.
fn answer_text(a: u32, b: u32) -> String {
    format!("{}", a + b)
}

/// One training row: the prompt `a+b=` carries no loss; the answer and EOS do.
fn row(tok: &ByteTokenizer, a: u32, b: u32) -> Result<Row> {
    let prompt = tok.encode(&prompt_text(a, b))?;
    let answer = tok.encode(&answer_text(a, b))?;
    let eos = tok.eos_id().expect("the byte tokenizer has EOS");
    let ids: Vec<i32> = prompt.iter().chain(&answer).chain([&eos]).map(|&t| t as i32).collect();
    let labels =
        ids.iter().enumerate().map(|(i, &t)| if i < prompt.len() { -100 } else { t }).collect();
    Ok(Row { input_ids: ids, labels })
}

/// Write the training data, run the job on the streaming engine, then evaluate.
/// `overrides` are `--set key=value` pairs applied to its config.
pub fn run(out: &Path, overrides: &[String]) -> Result<()> {
    run_with(out, STEPS, overrides).map(|_| ())
}

/// Write the job's data into `out`: the training problems (`addition-train.jsonl`) and the
/// held-out ones, whose loss the run evaluates (`addition-eval.jsonl`), both named by
/// [`config_yaml`]; returns the training and held-out problems.
pub fn write_data(out: &Path) -> Result<(Vec<Problem>, Vec<Problem>)> {
    fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let tok = ByteTokenizer::new();
    let (train, held_out) = problems(0);
    for (name, set) in [("addition-train.jsonl", &train), ("addition-eval.jsonl", &held_out)] {
        let path = out.join(name);
        let mut f = std::io::BufWriter::new(
            fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?,
        );
        for &(a, b) in set {
            let r = row(&tok, a, b)?;
            writeln!(f, "{}", serde_json::json!({"input_ids": r.input_ids, "labels": r.labels}))?;
        }
        f.flush().with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok((train, held_out))
}

/// The default job with `steps` optimizer steps (and `--set` overrides); returns the held-out
/// accuracy.
pub fn run_with(out: &Path, steps: usize, overrides: &[String]) -> Result<f64> {
    let tok = ByteTokenizer::new();
    let (train, held_out) = write_data(out)?;
    let yaml = config_yaml(out, steps);
    let raw = RawConfig::from_yaml_with(&yaml, "built-in default job", overrides)?;
    let cfg = raw.clone().resolve("built-in default job")?;
    println!(
        "Horizon default job: a {}-layer Llama learns two-digit addition from {} examples ({} held out).",
        model_config(&raw)?.num_layers,
        train.len(),
        held_out.len()
    );
    // The built-in job always starts over (it says so when it removes an earlier one's
    // checkpoints).
    let cfg = RunConfig { overwrite: true, ..cfg };
    run_streaming(cfg, true, 0, None)?;
    evaluate(&raw, &raw.output.dir.join("final"), &tok, &held_out)
}

/// Greedy answers to held-out problems with the trained model; prints some and the accuracy.
fn evaluate(
    raw: &RawConfig,
    final_dir: &Path,
    tok: &ByteTokenizer,
    held_out: &[Problem],
) -> Result<f64> {
    let model_cfg = model_config(raw)?;
    let params = ParamStore::load_hf(&crate::model::describe(&model_cfg), final_dir)?;
    let mut g = Generator::new(&model_cfg, params, Box::new(ByteTokenizer::new()));
    let n = 200.min(held_out.len());
    let mut correct = 0;
    println!("\nheld-out problems (greedy answers):");
    for (i, &(a, b)) in held_out[..n].iter().enumerate() {
        let prompt = prompt_text(a, b);
        let answer = g.generate(&tok.encode(&prompt)?, SampleOptions::greedy(5), &mut |_| {})?;
        let ok = answer == answer_text(a, b);
        correct += ok as usize;
        if i < 8 {
            println!("  {prompt}{answer:<4} {}", if ok { "✓" } else { "✗" });
        }
    }
    println!(
        "accuracy on {n} held-out problems: {:.1}% ({correct}/{n}); a model that had not learned would score about 0%",
        100.0 * correct as f64 / n as f64
    );
    Ok(correct as f64 / n as f64)
}

/// Where the default job writes.
pub fn default_out() -> PathBuf {
    PathBuf::from("out/default")
}
