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

use crate::config::OptimizerMemory;
use crate::hf::checkpoint::SaveDtype;
use crate::hf::config::ModelConfig;
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::optim::adamw8bit::Moments8;
use crate::train::TrainState;

/// The masters' file in a checkpoint.
pub const PARAMS: &str = "params.safetensors";
const EXP_AVG: &str = "exp_avg.safetensors";
const EXP_AVG_SQ: &str = "exp_avg_sq.safetensors";
const STATE: &str = "state.json";
/// `optimizer.memory: compact`: the 8-bit moments, instead of the two fp32 moment files.
const MOMENTS8: &str = "moments8.bin";
const MOMENTS8_MAGIC: &[u8; 8] = b"HZNQ8v2\0";
/// The first layout: blocks of 256 across tensor boundaries, `sqrt(v)` (no longer read).
const MOMENTS8_MAGIC_V1: &[u8; 8] = b"HZNQ8v1\0";

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
    let layout = ModelLayout::new(model_cfg);
    state.params.save_safetensors(&layout, &tmp.join(PARAMS), SaveDtype::F32)?;
    match &state.q8 {
        Some(q8) => save_moments8(&tmp.join(MOMENTS8), q8)?,
        None => {
            state.m.save_safetensors(&layout, &tmp.join(EXP_AVG), SaveDtype::F32)?;
            state.v.save_safetensors(&layout, &tmp.join(EXP_AVG_SQ), SaveDtype::F32)?;
        }
    }
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

/// `moments8.bin` (little-endian): magic, buffer count (u64), then per buffer its tensor count
/// and each tensor's length (u64), the codes of m and of v (one byte per element of the 8-bit
/// tensors), the fp32 block scales of m and of v, and the fp32 m and v of the small tensors
/// (see [`Moments8`]).
fn save_moments8(path: &Path, q8: &[Moments8]) -> Result<()> {
    let f = fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    w.write_all(MOMENTS8_MAGIC)?;
    w.write_all(&(q8.len() as u64).to_le_bytes())?;
    for q in q8 {
        w.write_all(&(q.tensors.len() as u64).to_le_bytes())?;
        for &n in &q.tensors {
            w.write_all(&(n as u64).to_le_bytes())?;
        }
        w.write_all(&q.m_codes)?;
        w.write_all(&q.v_codes)?;
        for x in q.m_absmax.iter().chain(&q.v_absmax).chain(&q.m32).chain(&q.v32) {
            w.write_all(&x.to_le_bytes())?;
        }
    }
    let f = w.into_inner().map_err(|e| e.into_error())?;
    f.sync_all().with_context(|| format!("cannot sync {}", path.display()))
}

/// Read `moments8.bin`, checking it against the tensors of the model's buffers.
fn load_moments8(path: &Path, tensors: &[Vec<usize>]) -> Result<Vec<Moments8>> {
    use std::io::Read;
    let bad = |what: &str| anyhow::anyhow!("{}: {what}; the checkpoint is damaged", path.display());
    let f = fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut r = std::io::BufReader::new(f);
    let mut u64buf = [0u8; 8];
    r.read_exact(&mut u64buf).map_err(|_| bad("truncated"))?;
    if &u64buf == MOMENTS8_MAGIC_V1 {
        bail!(
            "{}: 8-bit moments in an older layout (blocks across tensors, no fp32 small tensors)\nhint: resume with the Horizon version that wrote it, or start the run again",
            path.display()
        );
    }
    if &u64buf != MOMENTS8_MAGIC {
        return Err(bad("not an 8-bit moments file"));
    }
    let mut read_u64 = |r: &mut std::io::BufReader<fs::File>| -> Result<u64> {
        r.read_exact(&mut u64buf).map_err(|_| bad("truncated"))?;
        Ok(u64::from_le_bytes(u64buf))
    };
    if read_u64(&mut r)? != tensors.len() as u64 {
        return Err(bad("wrong number of buffers for this model"));
    }
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        let mut theirs = vec![0usize; read_u64(&mut r)? as usize];
        for n in theirs.iter_mut() {
            *n = read_u64(&mut r)? as usize;
        }
        if &theirs != t {
            return Err(bad("a buffer's tensors do not match this model"));
        }
        let mut q = Moments8::zeros(t);
        r.read_exact(&mut q.m_codes).map_err(|_| bad("truncated"))?;
        r.read_exact(&mut q.v_codes).map_err(|_| bad("truncated"))?;
        let mut b4 = [0u8; 4];
        for x in q
            .m_absmax
            .iter_mut()
            .chain(q.v_absmax.iter_mut())
            .chain(q.m32.iter_mut())
            .chain(q.v32.iter_mut())
        {
            r.read_exact(&mut b4).map_err(|_| bad("truncated"))?;
            *x = f32::from_le_bytes(b4);
        }
        out.push(q);
    }
    Ok(out)
}

/// Load a checkpoint for `model_cfg`, laid out for `optimizer.memory` `mode`. `exact` and
/// `lean` hold the same state and resume each other; `compact` stores 8-bit moments and is
/// refused across modes (decoding would need the fp32 moments' memory, encoding loses bits).
pub fn load_for(dir: &Path, model_cfg: &ModelConfig, mode: OptimizerMemory) -> Result<TrainState> {
    let meta = read_state(dir)?;
    if (meta.memory == OptimizerMemory::Compact) != (mode == OptimizerMemory::Compact) {
        bail!(
            "--resume {}: the checkpoint holds optimizer.memory {} moments, this run is configured for {}\nhint: resume with optimizer.memory: {} (exact and lean resume each other; compact only compact)",
            dir.display(),
            meta.memory.name(),
            mode.name(),
            meta.memory.name()
        );
    }
    load_with(dir, model_cfg, meta, mode)
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
    load_with(dir, model_cfg, meta, mode)
}

fn load_with(
    dir: &Path,
    model_cfg: &ModelConfig,
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
    let layout = ModelLayout::new(model_cfg);
    let params = ParamStore::load_hf(&layout, &dir.join(PARAMS))?;
    // Allocate only what `mode` keeps: fresh zeros are filled from the files, never doubled.
    let (m, v, q8) = if meta.memory == OptimizerMemory::Compact {
        let q8 = load_moments8(&dir.join(MOMENTS8), &layout.buffer_tensors())?;
        (ParamStore::empty_like(&params), ParamStore::empty_like(&params), Some(q8))
    } else {
        let m = ParamStore::load_hf(&layout, &dir.join(EXP_AVG))?;
        let v = ParamStore::load_hf(&layout, &dir.join(EXP_AVG_SQ))?;
        (m, v, None)
    };
    let grads = params.zeros_like(meta.memory.streams_updates());
    let state = TrainState {
        params,
        grads,
        m,
        v,
        step: meta.step,
        updates: meta.updates,
        q8,
        last_sq: meta.last_sq,
        memory: meta.memory,
    };
    Ok(state.into_memory(&layout, mode))
}
