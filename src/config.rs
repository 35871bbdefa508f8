//! The run configuration: one YAML file, read in two stages — [`RawConfig`] (serde, unknown keys
//! refused, every field documented with its default) and [`RunConfig`] (validated and derived).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

/// The YAML file as written by the user. Every key except `model.path` and `data.path` has a
/// default.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Which model to train.
    pub model: ModelSection,
    /// Which data to train on.
    pub data: DataSection,
    /// Length and shape of the run.
    #[serde(default)]
    pub train: TrainSection,
    /// AdamW hyper-parameters and clipping.
    #[serde(default)]
    pub optimizer: OptimizerSection,
    /// Where results go.
    #[serde(default)]
    pub output: OutputSection,
    /// How the step is executed.
    #[serde(default)]
    pub engine: EngineSection,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// A Hugging Face model directory: `config.json` + `model.safetensors` (or shards with
    /// `model.safetensors.index.json`). Relative paths are taken from the working directory.
    pub path: PathBuf,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// JSONL rows `{"input_ids": [...], "labels": [...]}` (labels optional, HF convention:
    /// unshifted, -100 = no loss).
    #[default]
    Pretokenized,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// The JSONL file.
    pub path: PathBuf,
    /// Record format. Default `pretokenized`.
    #[serde(default)]
    pub format: DataFormat,
    /// Shuffle rows each epoch with a permutation drawn from `train.seed`. Default false: batch
    /// k takes rows `[k*B, (k+1)*B)` in file order, cycling.
    #[serde(default)]
    pub shuffle: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// Optimizer steps. Default 100.
    pub steps: usize,
    /// Rows per optimizer step. Default 8.
    pub batch_size: usize,
    /// Longest row accepted; longer rows are refused with their line number. Default 2048.
    pub max_seq_len: usize,
    /// Seed of every random choice (shuffling). Default 0.
    pub seed: u64,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection { steps: 100, batch_size: 8, max_seq_len: 2048, seed: 0 }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSection {
    /// Learning rate (constant). Default 1e-4.
    pub lr: f64,
    /// AdamW betas. Default [0.9, 0.999] (torch's).
    pub betas: [f64; 2],
    /// AdamW epsilon. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay, applied to every parameter. Default 0.01 (torch's).
    pub weight_decay: f64,
    /// Global L2-norm gradient clipping threshold; 0 turns clipping off. Default 1.0.
    pub grad_clip: f64,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        OptimizerSection {
            lr: 1e-4,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            grad_clip: 1.0,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputSection {
    /// Output directory: `metrics.jsonl`, `config.yaml`, `final/`. Default `out`.
    pub dir: PathBuf,
}

impl Default for OutputSection {
    fn default() -> Self {
        OutputSection { dir: PathBuf::from("out") }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// Rows of the LM head + cross-entropy chunk: the (rows, V) logits never exceed this.
    /// Default 256.
    pub head_chunk_rows: usize,
}

impl Default for EngineSection {
    fn default() -> Self {
        EngineSection { head_chunk_rows: 256 }
    }
}

/// The validated configuration a run uses.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub raw: RawConfig,
    /// Where the config came from (for messages).
    pub origin: String,
}

impl RawConfig {
    /// Parse YAML text; `origin` names the file in errors.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self> {
        serde_saphyr::from_str::<RawConfig>(text).map_err(|e| {
            anyhow::anyhow!(
                "{origin}: {e}\nhint: see README.md (Configuration) for every key and its default"
            )
        })
    }

    /// Read and parse a YAML file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    /// Validate and derive.
    pub fn resolve(self, origin: &str) -> Result<RunConfig> {
        let t = &self.train;
        for (key, val) in [
            ("train.steps", t.steps),
            ("train.batch_size", t.batch_size),
            ("train.max_seq_len", t.max_seq_len),
            ("engine.head_chunk_rows", self.engine.head_chunk_rows),
        ] {
            if val == 0 {
                bail!("{origin}: {key} must be at least 1 (got 0)");
            }
        }
        let o = &self.optimizer;
        let positive = |key: &str, v: f64| -> Result<()> {
            if !(v.is_finite() && v > 0.0) {
                bail!("{origin}: {key} must be a positive number (got {v})");
            }
            Ok(())
        };
        positive("optimizer.lr", o.lr)?;
        positive("optimizer.eps", o.eps)?;
        for (i, b) in o.betas.iter().enumerate() {
            if !(0.0..1.0).contains(b) {
                bail!("{origin}: optimizer.betas[{i}] must be in [0, 1) (got {b})");
            }
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            bail!("{origin}: optimizer.weight_decay must be >= 0 (got {})", o.weight_decay);
        }
        if !(o.grad_clip.is_finite() && o.grad_clip >= 0.0) {
            bail!("{origin}: optimizer.grad_clip must be >= 0, 0 = off (got {})", o.grad_clip);
        }
        Ok(RunConfig { raw: self, origin: origin.to_string() })
    }

    /// The config as YAML (printed at start and saved beside the results).
    pub fn to_yaml(&self) -> String {
        serde_saphyr::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_everything_but_paths() {
        let c =
            RawConfig::from_yaml("model: {path: m}\ndata: {path: d.jsonl}\n", "t.yaml").unwrap();
        assert_eq!(c.train.steps, 100);
        assert_eq!(c.optimizer.betas, [0.9, 0.999]);
        assert_eq!(c.data.format, DataFormat::Pretokenized);
        c.resolve("t.yaml").unwrap();
    }

    #[test]
    fn misspelled_key_is_named() {
        let e = RawConfig::from_yaml(
            "model: {path: m}\ndata: {path: d.jsonl}\noptimizer: {lrr: 0.1}\n",
            "t.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("t.yaml") && e.contains("lrr"), "{e}");
    }

    #[test]
    fn zero_sizes_are_refused() {
        let c = RawConfig::from_yaml(
            "model: {path: m}\ndata: {path: d.jsonl}\ntrain: {batch_size: 0}\n",
            "t.yaml",
        )
        .unwrap();
        let e = c.resolve("t.yaml").unwrap_err().to_string();
        assert!(e.contains("train.batch_size"), "{e}");
    }

    #[test]
    fn round_trips_through_yaml() {
        let c =
            RawConfig::from_yaml("model: {path: m}\ndata: {path: d.jsonl}\n", "t.yaml").unwrap();
        let again = RawConfig::from_yaml(&c.to_yaml(), "again").unwrap();
        assert_eq!(again.train.steps, c.train.steps);
        assert_eq!(again.model.path, c.model.path);
    }
}
