//! `horizon export`: a model's fp32 masters -> a Hugging Face directory that `transformers`
//! loads: `config.json`, the weights as safetensors (fp32 or bf16, sharded with
//! `model.safetensors.index.json` past a size limit), and the tokenizer files.
//!
//! Training writes `OUT/final/` through [`export_model`]; `horizon export` reads a resumable
//! checkpoint (or a run directory's newest one, or a HF directory) through [`export_dir`].

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::config::RawConfig;
pub use crate::config::{DEFAULT_MAX_SHARD_BYTES, ExportOptions};
use crate::hf::checkpoint::write_safetensors;
use crate::hf::config::ModelConfig;
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::tokenizer::ByteTokenizer;

/// The tokenizer files of a HF directory that an export carries along when they exist.
const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
];

/// Where an export takes its tokenizer from.
#[derive(Clone, Debug)]
pub enum TokenizerSource {
    /// Copy the tokenizer files of this directory.
    Dir(PathBuf),
    /// Write the byte tokenizer as HF files.
    Byte,
    /// None known (a pretokenized dataset without `data.tokenizer`): no tokenizer files.
    None,
}

impl TokenizerSource {
    /// The tokenizer a run's config names: `data.tokenizer`, else `model.path`.
    pub fn of_config(raw: &RawConfig) -> Self {
        match (&raw.data.tokenizer, &raw.model.path) {
            (Some(t), _) if t == "byte" => TokenizerSource::Byte,
            (Some(t), _) => TokenizerSource::Dir(PathBuf::from(t)),
            (None, Some(p)) if p.join("tokenizer.json").is_file() => {
                TokenizerSource::Dir(p.clone())
            }
            _ => TokenizerSource::None,
        }
    }
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct Exported {
    /// The safetensors files, in order.
    pub shards: Vec<PathBuf>,
    /// Tensor bytes written.
    pub total_bytes: u64,
    /// Tokenizer files written or copied.
    pub tokenizer_files: Vec<String>,
}

/// Write `params` as a HF directory `dir`. Earlier weight files in `dir` are removed first, so
/// that a directory exported twice (say, sharded then not) never mixes the two.
pub fn export_model(
    model_cfg: &ModelConfig,
    params: &ParamStore,
    dir: &Path,
    opts: ExportOptions,
    tokenizer: &TokenizerSource,
) -> Result<Exported> {
    fs::create_dir_all(dir).with_context(|| {
        format!("cannot create {}\nhint: choose a writable output directory", dir.display())
    })?;
    let layout = ModelLayout::new(model_cfg);
    let mut cfg_json = model_cfg.to_hf_json();
    if let Some(o) = cfg_json.as_object_mut() {
        o.insert("torch_dtype".into(), opts.dtype.torch_dtype().into());
    }
    let cfg_path = dir.join("config.json");
    fs::write(&cfg_path, serde_json::to_string_pretty(&cfg_json)?)
        .with_context(|| format!("cannot write {}", cfg_path.display()))?;
    remove_old_weights(dir)?;

    let tensors: Vec<(String, Vec<usize>, &[f32])> = layout
        .hf_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let data = params.tensor(&layout, &name).expect("the layout names its own tensors");
            (name, shape, data)
        })
        .collect();
    let sizes: Vec<u64> = tensors.iter().map(|t| (t.2.len() * opts.dtype.size()) as u64).collect();
    let shards = plan_shards(&sizes, opts.max_shard_bytes);
    let total_bytes: u64 = sizes.iter().sum();
    let mut files = Vec::new();
    if shards.len() == 1 {
        let path = dir.join("model.safetensors");
        write_safetensors(&path, &tensors, opts.dtype)?;
        files.push(path);
    } else {
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        for (i, range) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            let path = dir.join(&name);
            write_safetensors(&path, &tensors[range.clone()], opts.dtype)?;
            for t in &tensors[range.clone()] {
                weight_map.insert(t.0.clone(), name.clone().into());
            }
            files.push(path);
        }
        let index = serde_json::json!({
            "metadata": {"total_size": total_bytes},
            "weight_map": weight_map,
        });
        let path = dir.join("model.safetensors.index.json");
        fs::write(&path, serde_json::to_string_pretty(&index)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let tokenizer_files = write_tokenizer(dir, tokenizer)?;
    Ok(Exported { shards: files, total_bytes, tokenizer_files })
}

/// Consecutive groups of tensors (by index) of at most `max` bytes each; a tensor larger than
/// `max` gets a group of its own.
fn plan_shards(sizes: &[u64], max: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && bytes + s > max {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += s;
    }
    out.push(start..sizes.len());
    out
}

fn remove_old_weights(dir: &Path) -> Result<()> {
    for e in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let old = name == "model.safetensors"
            || name == "model.safetensors.index.json"
            || (name.starts_with("model-") && name.ends_with(".safetensors"));
        if old {
            fs::remove_file(e.path())
                .with_context(|| format!("cannot remove the old {}", e.path().display()))?;
        }
    }
    Ok(())
}

fn write_tokenizer(dir: &Path, source: &TokenizerSource) -> Result<Vec<String>> {
    let mut written = Vec::new();
    match source {
        TokenizerSource::Dir(src) => {
            if src.canonicalize().ok() == dir.canonicalize().ok() {
                return Ok(written);
            }
            for f in TOKENIZER_FILES {
                let from = src.join(f);
                if from.is_file() {
                    fs::copy(&from, dir.join(f)).with_context(|| {
                        format!("cannot copy {} to {}", from.display(), dir.display())
                    })?;
                    written.push(f.to_string());
                }
            }
            if written.is_empty() {
                bail!(
                    "{}: no tokenizer files (tokenizer.json, ...) to copy into the export\nhint: set data.tokenizer to the directory that holds them",
                    src.display()
                );
            }
        }
        TokenizerSource::Byte => {
            let (tok, cfg) = ByteTokenizer::hf_files();
            for (name, v) in [("tokenizer.json", tok), ("tokenizer_config.json", cfg)] {
                let path = dir.join(name);
                fs::write(&path, serde_json::to_string_pretty(&v)?)
                    .with_context(|| format!("cannot write {}", path.display()))?;
                written.push(name.to_string());
            }
        }
        TokenizerSource::None => {}
    }
    Ok(written)
}

/// What `horizon export SRC` reads: a resumable checkpoint (`state.json`), a run's output
/// directory (its newest checkpoint), or a HF directory (`config.json`; to change dtype or
/// sharding).
pub fn export_dir(src: &Path, out: &Path, opts: ExportOptions) -> Result<Exported> {
    let (model_cfg, params, tokenizer) = load_source(src)?;
    if out.exists() && !out.is_dir() {
        bail!("--out {}: exists and is not a directory", out.display());
    }
    export_model(&model_cfg, &params, out, opts, &tokenizer)
}

fn load_source(src: &Path) -> Result<(ModelConfig, ParamStore, TokenizerSource)> {
    if !src.is_dir() {
        bail!(
            "{}: no such directory\nhint: give a checkpoint (OUT/checkpoints/step-N), a run's output directory, or a HF model directory",
            src.display()
        );
    }
    if src.join("state.json").is_file() {
        let state = crate::resume::read_state(src)?;
        let origin = src.join("state.json").display().to_string();
        let model_cfg = ModelConfig::from_json(&state.model, &origin)?;
        let params =
            ParamStore::load_hf(&ModelLayout::new(&model_cfg), &src.join(crate::resume::PARAMS))?;
        let tokenizer = RawConfig::from_yaml(&state.config, &origin)
            .map(|raw| TokenizerSource::of_config(&raw))
            .unwrap_or(TokenizerSource::None);
        return Ok((model_cfg, params, tokenizer));
    }
    if crate::resume::checkpoints_dir(src).is_dir() {
        let ckpt = crate::resume::resolve("latest", src)?;
        println!("exporting the newest checkpoint, {}", ckpt.display());
        return load_source(&ckpt);
    }
    if src.join("config.json").is_file() {
        let model_cfg = ModelConfig::from_file(&src.join("config.json"))?;
        let params = ParamStore::load_hf(&ModelLayout::new(&model_cfg), src)?;
        let tokenizer = if src.join("tokenizer.json").is_file() {
            TokenizerSource::Dir(src.to_path_buf())
        } else {
            TokenizerSource::None
        };
        return Ok((model_cfg, params, tokenizer));
    }
    bail!(
        "{}: neither a checkpoint (state.json), a run directory (checkpoints/) nor a HF directory (config.json)",
        src.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_group_consecutive_tensors_under_the_limit() {
        assert_eq!(plan_shards(&[4, 4, 4], 100), vec![0..3]);
        assert_eq!(plan_shards(&[4, 4, 4], 8), vec![0..2, 2..3]);
        assert_eq!(plan_shards(&[10, 4, 4], 8), vec![0..1, 1..3]);
        assert_eq!(plan_shards(&[4, 10, 4], 8), vec![0..1, 1..2, 2..3]);
    }
}
