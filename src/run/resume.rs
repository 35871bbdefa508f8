//! Resumable training checkpoints: fp32 masters, AdamW moments, the step counters and the
//! config, written atomically (temporary directory, fsync, rename) so that a crash during a
//! save leaves the previous checkpoint intact; `keep` bounds how many stay on disk.
//!
//! A checkpoint is `OUT/checkpoints/step-NNNNNNNN/` holding `params.safetensors`,
//! `exp_avg.safetensors`, `exp_avg_sq.safetensors` (HF tensor names; `moments8.bin` instead under
//! `optimizer.memory: compact`) and `state.json`. The data
//! position and every random choice follow from the step and `train.seed`, so resuming at step
//! N continues bit-identically.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::hf::checkpoint::SaveDtype;
use crate::hf::config::ModelConfig;
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::optim::state::OptimizerMemory;
use crate::optim::state::{OptState, OptimizerState};
use crate::store::TrainState;

/// The masters' file in a checkpoint.
pub const PARAMS: &str = "params.safetensors";
const STATE: &str = "state.json";

/// `state.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CheckpointState {
    pub format: u32,
    /// Optimizer steps run (data and schedule position).
    pub step: u64,
    /// Updates applied (AdamW bias correction).
    pub updates: u64,
    /// The model's HF config.
    pub model: serde_json::Value,
    /// The run's resolved config (YAML).
    pub config: String,
    /// `optimizer.memory` of the run that wrote it: what the moments files hold.
    #[serde(default)]
    pub memory: OptimizerMemory,
    /// Squared gradient norm of each buffer at the last finite step (`lean`/`compact` estimate
    /// the next step's norm from them); empty: none yet.
    #[serde(default)]
    pub last_sq: Vec<f64>,
}

/// Where checkpoints of an output directory live.
pub fn checkpoints_dir(out_dir: &Path) -> PathBuf {
    out_dir.join("checkpoints")
}

fn fsync_dir(dir: &Path) -> Result<()> {
    let f = fs::File::open(dir).with_context(|| format!("cannot open {}", dir.display()))?;
    f.sync_all().with_context(|| format!("cannot sync {}", dir.display()))
}

/// Write a checkpoint of `state` after step `state.step`; keep the newest `keep`. Returns its
/// directory.
pub fn save(
    out_dir: &Path,
    state: &TrainState,
    layout: &ModelLayout,
    model_cfg: &ModelConfig,
    config_yaml: &str,
    keep: usize,
) -> Result<PathBuf> {
    let root = checkpoints_dir(out_dir);
    fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let name = format!("step-{:08}", state.step);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).with_context(|| format!("cannot clear {}", tmp.display()))?;
    }
    fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    state.params.save_safetensors(layout, &tmp.join(PARAMS), SaveDtype::F32)?;
    state.opt.save(&tmp, layout)?;
    let meta = CheckpointState {
        format: 1,
        step: state.step,
        updates: state.updates,
        model: model_cfg.to_hf_json(),
        config: config_yaml.to_string(),
        memory: state.memory(),
        last_sq: state.last_sq.clone(),
    };
    let path = tmp.join(STATE);
    let mut f =
        fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(serde_json::to_string_pretty(&meta)?.as_bytes())?;
    f.sync_all()?;
    fsync_dir(&tmp)?;
    #[cfg(feature = "test-hooks")]
    if let Some(ms) = std::env::var("HORIZON_TEST_SAVE_PAUSE_MS").ok().and_then(|v| v.parse().ok())
    {
        // Test hook (test builds only): widen the window in which a crash lands mid-save.
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    let dst = root.join(&name);
    if dst.exists() {
        fs::remove_dir_all(&dst).with_context(|| format!("cannot replace {}", dst.display()))?;
    }
    fs::rename(&tmp, &dst)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), dst.display()))?;
    fsync_dir(&root)?;
    prune(&root, keep)?;
    Ok(dst)
}

/// Complete checkpoints under `root`, oldest first.
fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir(root) else { return Ok(out) };
    for e in entries {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(n) = name.strip_prefix("step-").and_then(|n| n.parse::<u64>().ok())
            && e.path().join(STATE).is_file()
        {
            out.push((n, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Remove all but the newest `keep` checkpoints (and leftovers of interrupted saves).
fn prune(root: &Path, keep: usize) -> Result<()> {
    let all = list(root)?;
    for (_, p) in all.iter().take(all.len().saturating_sub(keep.max(1))) {
        fs::remove_dir_all(p).with_context(|| format!("cannot remove {}", p.display()))?;
    }
    for e in fs::read_dir(root)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".tmp-") && !name.ends_with(&format!("-{}", std::process::id())) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
    Ok(())
}

/// The checkpoint `--resume` names: a directory, or `latest` (the newest under `out_dir`).
pub fn resolve(arg: &str, out_dir: &Path) -> Result<PathBuf> {
    if arg == "latest" {
        let root = checkpoints_dir(out_dir);
        let all = list(&root)?;
        let Some((_, p)) = all.last() else {
            bail!(
                "--resume latest: no checkpoint in {}\nhint: set train.save_every, or resume from a directory",
                root.display()
            );
        };
        return Ok(p.clone());
    }
    let p = PathBuf::from(arg);
    if !p.join(STATE).is_file() {
        bail!("--resume {arg}: not a checkpoint directory (no {STATE})");
    }
    Ok(p)
}

/// Load a checkpoint for `model_cfg`, laid out for `optimizer.memory` `mode`. `exact` and
/// `lean` hold the same state and resume each other; `compact` stores 8-bit moments and is
/// refused across modes (decoding would need the fp32 moments' memory, encoding loses bits).
pub fn load_for(
    dir: &Path,
    model_cfg: &ModelConfig,
    layout: &ModelLayout,
    mode: OptimizerMemory,
) -> Result<TrainState> {
    let meta = read_state(dir)?;
    if meta.memory.moment_storage() != mode.moment_storage() {
        bail!(
            "--resume {}: the checkpoint holds optimizer.memory {} moments, this run is configured for {}\nhint: resume with optimizer.memory: {} (exact and lean resume each other; compact only compact)",
            dir.display(),
            meta.memory.name(),
            mode.name(),
            meta.memory.name()
        );
    }
    load_with(dir, model_cfg, layout, meta, mode)
}

/// A checkpoint's `state.json`.
pub fn read_state(dir: &Path) -> Result<CheckpointState> {
    let path = dir.join(STATE);
    let text =
        fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{}: not a checkpoint state", path.display()))
}

/// Load a checkpoint for `model_cfg` in the memory mode it was written in; refuses one
/// written for another model.
pub fn load(dir: &Path, model_cfg: &ModelConfig) -> Result<TrainState> {
    let meta = read_state(dir)?;
    let mode = meta.memory;
    load_with(dir, model_cfg, &crate::model::describe(model_cfg), meta, mode)
}

fn load_with(
    dir: &Path,
    model_cfg: &ModelConfig,
    layout: &ModelLayout,
    meta: CheckpointState,
    mode: OptimizerMemory,
) -> Result<TrainState> {
    let path = dir.join(STATE);
    let theirs = ModelConfig::from_json(&meta.model, &path.display().to_string())?;
    let mine = model_cfg;
    let fields: [(&str, usize, usize); 8] = [
        ("hidden_size", theirs.hidden_size, mine.hidden_size),
        ("num_hidden_layers", theirs.num_layers, mine.num_layers),
        ("num_attention_heads", theirs.num_heads, mine.num_heads),
        ("num_key_value_heads", theirs.num_kv_heads, mine.num_kv_heads),
        ("head_dim", theirs.head_dim, mine.head_dim),
        ("intermediate_size", theirs.intermediate_size, mine.intermediate_size),
        ("vocab_size", theirs.vocab_size, mine.vocab_size),
        (
            "tie_word_embeddings",
            theirs.tie_word_embeddings as usize,
            mine.tie_word_embeddings as usize,
        ),
    ];
    for (key, a, b) in fields {
        if a != b {
            bail!(
                "--resume {}: the checkpoint is of a different model ({key} {a}, this run's model has {b})\nhint: resume with the config the checkpoint was written with",
                dir.display()
            );
        }
    }
    let params = ParamStore::load_hf(layout, &dir.join(PARAMS))?;
    // Only what the checkpoint's mode keeps is allocated, then filled from the files.
    let opt = OptState::load(meta.memory.moment_storage(), dir, layout)?;
    let state = TrainState {
        grads: params.zeros_like(!meta.memory.keeps_layer_grads()),
        params,
        opt,
        step: meta.step,
        updates: meta.updates,
        last_sq: meta.last_sq,
        memory: meta.memory,
    };
    Ok(state.into_memory(layout, mode))
}
