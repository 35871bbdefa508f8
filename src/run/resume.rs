//! Resumable training checkpoints: fp32 masters, AdamW moments, the step counters and the
//! config, written atomically (temporary directory, fsync, rename) so that a crash during a
//! save leaves the previous checkpoint intact; `keep` bounds how many stay on disk.
//!
//! A checkpoint is `OUT/checkpoints/step-NNNNNNNN/` holding `params.safetensors`,
//! `exp_avg.safetensors`, `exp_avg_sq.safetensors` (HF tensor names; `moments8.bin` instead under
//! `optimizer.memory: compact`) and `state.json`. The data
//! position and every random choice follow from the step and `train.seed`, so resuming at step
//! N continues bit-identically.

use std::collections::BTreeMap;
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
use crate::run::config::RawConfig;
use crate::store::TrainState;

/// The masters' file in a checkpoint.
pub const PARAMS: &str = "params.safetensors";
const STATE: &str = "state.json";
/// `state.json`'s `format`: 2 hashes with [`crate::hash`] (XXH3-64) and records the base's
/// content hash; 1 (earlier checkpoints) hashed with [`WordHash`].
const FORMAT: u32 = 2;

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
    /// Format 1 only: an adapter run's base weights by a sampled fingerprint of their files,
    /// which a resume no longer computes (it says so); kept so that such a state still seals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// An adapter run's frozen base weights by content hash (`model::base::base_hash`: every
    /// byte of every tensor, computed as the run loaded them): a resume over other weights is
    /// refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_hash: Option<String>,
    /// Each data file of the checkpoint with its checksum ([`file_checksum`]), verified before
    /// the checkpoint is used; empty in checkpoints written before they were recorded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub checksums: BTreeMap<String, String>,
    /// A checksum of everything above, as JSON ([`CheckpointState::seal`]): a damaged
    /// `state.json` that still parses is refused, not resumed from.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sealed: String,
}

impl CheckpointState {
    /// The checksum of this state's fields but `sealed`, in their compact JSON, in the hash of
    /// its format.
    fn seal(&self) -> Result<String> {
        let text =
            serde_json::to_string(&CheckpointState { sealed: String::new(), ..self.clone() })?;
        let bytes = text.as_bytes();
        let h = if self.format >= 2 { crate::hash::of(bytes) } else { legacy_hash(bytes) };
        Ok(format!("{}:{h:016x}", bytes.len()))
    }
}

/// Format 1's hash (checkpoints written before [`crate::hash`] became the one hash, verified
/// with it): a 64-bit multiply-xorshift over 8-byte little-endian words, a piece's tail
/// zero-padded.
#[derive(Clone, Copy)]
struct WordHash(u64);

impl WordHash {
    fn new() -> Self {
        WordHash(0x9e37_79b9_7f4a_7c15)
    }

    fn feed(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0 ^ u64::from_le_bytes(w)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            self.0 ^= self.0 >> 31;
        }
    }
}

/// [`WordHash`] of `bytes`.
fn legacy_hash(bytes: &[u8]) -> u64 {
    let mut h = WordHash::new();
    h.feed(bytes);
    h.0
}

/// A checksum of the file at `path`: its length and the [`crate::hash`] of its bytes (in
/// `format` 1, their [`WordHash`]), read in 8 MiB pieces.
pub fn file_checksum(path: &Path, format: u32) -> Result<String> {
    use std::io::Read;
    let mut f = fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    // 8 MiB pieces (a multiple of 8: the words are the whole file's).
    let mut buf = vec![0u8; 8 << 20];
    let (mut h, mut legacy, mut len) = (crate::hash::Stream::new(), WordHash::new(), 0u64);
    loop {
        let mut n = 0;
        while n < buf.len() {
            let k =
                f.read(&mut buf[n..]).with_context(|| format!("cannot read {}", path.display()))?;
            if k == 0 {
                break;
            }
            n += k;
        }
        if n == 0 {
            break;
        }
        len += n as u64;
        if format >= 2 { h.feed(&buf[..n]) } else { legacy.feed(&buf[..n]) }
    }
    let h = if format >= 2 { h.finish() } else { legacy.0 };
    Ok(format!("{len}:{h:016x}"))
}

/// Verifies the checksums `meta` records for the checkpoint at `dir`.
fn verify_files(dir: &Path, meta: &CheckpointState) -> Result<()> {
    for (name, want) in &meta.checksums {
        let path = dir.join(name);
        let got = file_checksum(&path, meta.format)?;
        if &got != want {
            bail!(
                "{}: its content does not match what the checkpoint recorded at save (checksum \
                 {got}, recorded {want}): the checkpoint is damaged",
                path.display()
            );
        }
    }
    Ok(())
}

/// The newest checkpoint older than `dir` beside it whose files verify, if any.
fn newest_sound_before(dir: &Path) -> Option<PathBuf> {
    let root = dir.parent()?;
    let all = list(root).ok()?;
    all.into_iter()
        .rev()
        .filter(|(_, p)| p != dir)
        .find(|(_, p)| read_state(p).is_ok_and(|m| verify_files(p, &m).is_ok()))
        .map(|(_, p)| p)
}

/// Keys of a run's config that change what it computes: a resume must keep them (the others,
/// as `train.steps`, the save cadence, logging, the engine and the device, may change).
const KEPT_ON_RESUME: [&str; 9] = [
    "model",
    "adapter",
    "data",
    "dpo",
    "train.objective",
    "train.batch_size",
    "train.max_seq_len",
    "train.seed",
    "optimizer.memory",
];

/// The keys under [`KEPT_ON_RESUME`] whose values differ between the checkpoint's config
/// (`theirs`, YAML) and this run's, as `key: checkpoint A, this run B` (`model.path` is left to
/// the base's content hash: the same weights may move).
pub fn changed_on_resume(theirs: &str, mine: &RawConfig) -> Result<Vec<String>> {
    let theirs = RawConfig::from_yaml(theirs, "the checkpoint's config")?;
    let (a, b) = (serde_json::to_value(&theirs)?, serde_json::to_value(mine)?);
    let (mut flat_a, mut flat_b) = (BTreeMap::new(), BTreeMap::new());
    for key in KEPT_ON_RESUME {
        let at = |v: &serde_json::Value| key.split('.').fold(v.clone(), |v, k| v[k].clone());
        flatten(key, &at(&a), &mut flat_a);
        flatten(key, &at(&b), &mut flat_b);
    }
    let keys: std::collections::BTreeSet<&String> = flat_a.keys().chain(flat_b.keys()).collect();
    let unset = String::from("unset");
    Ok(keys
        .into_iter()
        .filter(|k| k.as_str() != "model.path")
        .filter_map(|k| {
            let (x, y) = (flat_a.get(k).unwrap_or(&unset), flat_b.get(k).unwrap_or(&unset));
            (x != y).then(|| format!("{k}: checkpoint {x}, this run {y}"))
        })
        .collect())
}

/// `v`'s leaves under dotted `key`, each as its JSON text.
fn flatten(key: &str, v: &serde_json::Value, out: &mut BTreeMap<String, String>) {
    match v {
        serde_json::Value::Object(m) => {
            m.iter().for_each(|(k, x)| flatten(&format!("{key}.{k}"), x, out))
        }
        serde_json::Value::Null => {}
        x => {
            out.insert(key.to_string(), x.to_string());
        }
    }
}

/// The data files of the checkpoint being written in `dir` (everything but its state).
fn data_files(dir: &Path) -> Result<Vec<String>> {
    let mut out: Vec<String> = fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != STATE)
        .collect();
    out.sort();
    Ok(out)
}

/// Where checkpoints of an output directory live.
pub fn checkpoints_dir(out_dir: &Path) -> PathBuf {
    out_dir.join("checkpoints")
}

fn fsync_dir(dir: &Path) -> Result<()> {
    let f = fs::File::open(dir).with_context(|| format!("cannot open {}", dir.display()))?;
    f.sync_all().with_context(|| format!("cannot sync {}", dir.display()))
}

/// What a checkpoint carries beside the state.
#[derive(Clone, Debug, Default)]
pub struct Extras<'a> {
    /// The content hash of an adapter run's frozen base as it was loaded.
    pub base_hash: Option<&'a str>,
    /// The run's own files (DPO's reference log-probs), under the checksums as the state's.
    pub files: Vec<(&'static str, Vec<u8>)>,
}

/// Write a checkpoint of `state` after step `state.step`, with `extras`; keep the newest
/// `keep`. Returns its directory.
pub fn save(
    out_dir: &Path,
    state: &TrainState,
    layout: &ModelLayout,
    model_cfg: &ModelConfig,
    config_yaml: &str,
    keep: usize,
    extras: &Extras,
) -> Result<PathBuf> {
    let base_hash = extras.base_hash;
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
    for (name, bytes) in &extras.files {
        let path = tmp.join(name);
        fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
        fs::File::open(&path)?.sync_all()?;
    }
    let meta = CheckpointState {
        format: FORMAT,
        step: state.step,
        updates: state.updates,
        model: model_cfg.to_hf_json(),
        config: config_yaml.to_string(),
        memory: state.memory(),
        last_sq: state.last_sq.clone(),
        base: None,
        base_hash: base_hash.map(str::to_string),
        checksums: data_files(&tmp)?
            .into_iter()
            .map(|n| Ok((n.clone(), file_checksum(&tmp.join(&n), FORMAT)?)))
            .collect::<Result<_>>()?,
        sealed: String::new(),
    };
    let meta = CheckpointState { sealed: meta.seal()?, ..meta };
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
pub(crate) fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
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
    if arg == "latest-sound" {
        // The newest checkpoint whose files verify, passing over damaged newer ones.
        let root = checkpoints_dir(out_dir);
        for (_, p) in list(&root)?.into_iter().rev() {
            match read_state(&p).and_then(|m| verify_files(&p, &m)) {
                Ok(()) => return Ok(p),
                Err(e) => println!("--resume latest-sound: passing over {}: {e:#}", p.display()),
            }
        }
        bail!("--resume latest-sound: no sound checkpoint in {}", root.display());
    }
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
/// `base_hash` is the content hash of the frozen base this run loaded (an adapter run's), to
/// compare with the checkpoint's.
pub fn load_for(
    dir: &Path,
    model_cfg: &ModelConfig,
    layout: &ModelLayout,
    raw: &RawConfig,
    base_hash: Option<&str>,
) -> Result<TrainState> {
    let mode = raw.optimizer.memory;
    let sound = read_state(dir).and_then(|m| verify_files(dir, &m).map(|()| m));
    let meta = match sound {
        Ok(m) => m,
        Err(e) => {
            return Err(match newest_sound_before(dir) {
                Some(p) => anyhow::anyhow!(
                    "{e:#}\nhint: the newest sound checkpoint is {}: resume it with --resume {} \
                     (or --resume latest-sound)",
                    p.display(),
                    p.display()
                ),
                None => e,
            });
        }
    };
    check_model(dir, &meta, model_cfg)?;
    check_same_run(dir, &meta, raw, base_hash)?;
    if meta.memory.moment_storage() != mode.moment_storage() {
        bail!(
            "--resume {}: the checkpoint holds optimizer.memory {} moments, this run is configured for {}\nhint: resume with optimizer.memory: {} (exact and lean resume each other; compact only compact)",
            dir.display(),
            meta.memory.name(),
            mode.name(),
            meta.memory.name()
        );
    }
    load_with(dir, layout, meta, mode)
}

/// Refuses to resume the checkpoint at `dir` (of `meta`) under a config that changes what the
/// run computes, naming every key that differs and both values; and an adapter run over base
/// weights (of content hash `base_hash`, as this run loaded them) that are not the ones it was
/// trained on.
fn check_same_run(
    dir: &Path,
    meta: &CheckpointState,
    raw: &RawConfig,
    base_hash: Option<&str>,
) -> Result<()> {
    let mut changed = changed_on_resume(&meta.config, raw)?;
    changed.retain(|c| !c.starts_with("optimizer.memory")); // said below, with its hint
    if let (Some(theirs), Some(mine)) = (&meta.base_hash, base_hash)
        && theirs != mine
    {
        changed.push(format!(
            "the base weights (model.path): checkpoint {theirs}, this run {mine} (content hashes)"
        ));
    }
    if meta.base.is_some() && base_hash.is_some() {
        println!(
            "--resume {}: the checkpoint (format {}) recorded its base weights by a sampled \
             fingerprint this version no longer computes: the base is not compared",
            dir.display(),
            meta.format
        );
    }
    if changed.is_empty() {
        return Ok(());
    }
    bail!(
        "--resume {}: this run's config changes what the checkpoint's run computes:\n  {}\n\
         hint: resume with the checkpoint's config (in {}); what may change on resume: \
         train.steps, the save cadence, logging, eval, engine and device settings, the learning \
         rate",
        dir.display(),
        changed.join("\n  "),
        dir.join(STATE).display()
    )
}

/// Refuses a checkpoint (of `meta`, at `dir`) of another model than `model_cfg`, naming the
/// size that differs.
fn check_model(dir: &Path, meta: &CheckpointState, model_cfg: &ModelConfig) -> Result<()> {
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
    Ok(())
}

/// A checkpoint's `state.json`.
pub fn read_state(dir: &Path) -> Result<CheckpointState> {
    let path = dir.join(STATE);
    let text =
        fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let meta: CheckpointState = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a checkpoint state", path.display()))?;
    if !meta.sealed.is_empty() && meta.seal()? != meta.sealed {
        let newer = if meta.format > FORMAT {
            format!(
                " (or written by a newer Horizon: format {}, this one reads {FORMAT})",
                meta.format
            )
        } else {
            String::new()
        };
        bail!(
            "{}: its fields do not match the checksum recorded with them: the checkpoint is \
             damaged{newer}",
            path.display()
        );
    }
    Ok(meta)
}

/// Load a checkpoint for `model_cfg` in the memory mode it was written in; refuses one
/// written for another model.
pub fn load(dir: &Path, model_cfg: &ModelConfig) -> Result<TrainState> {
    let meta = read_state(dir)?;
    verify_files(dir, &meta)?;
    check_model(dir, &meta, model_cfg)?;
    let mode = meta.memory;
    load_with(dir, &crate::model::describe(model_cfg), meta, mode)
}

/// The state of the checkpoint at `dir` (of `meta`, checked by the caller), laid out for `mode`.
fn load_with(
    dir: &Path,
    layout: &ModelLayout,
    meta: CheckpointState,
    mode: OptimizerMemory,
) -> Result<TrainState> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint of format 1 (written when the checksums were [`WordHash`]es) still verifies:
    /// its file checksums and its seal in that hash (the value pinned from an independent
    /// implementation of it), while the same state claiming format 2 does not.
    #[test]
    fn a_format_1_checkpoint_verifies_with_its_own_hash() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        fs::write(&file, b"horizon checkpoint").unwrap();
        assert_eq!(file_checksum(&file, 1).unwrap(), "18:3e9bcdb4f08e2755");
        let two = file_checksum(&file, 2).unwrap();
        assert_eq!(two, format!("18:{:016x}", crate::hash::of(b"horizon checkpoint")));
        let mut meta = CheckpointState {
            format: 1,
            step: 3,
            updates: 3,
            model: serde_json::json!({}),
            config: String::new(),
            memory: OptimizerMemory::default(),
            last_sq: Vec::new(),
            base: Some("0123456789abcdef".into()),
            base_hash: None,
            checksums: [("f".to_string(), "18:3e9bcdb4f08e2755".to_string())].into(),
            sealed: String::new(),
        };
        meta.sealed = meta.seal().unwrap();
        fs::write(dir.path().join(STATE), serde_json::to_string(&meta).unwrap()).unwrap();
        let read = read_state(dir.path()).unwrap();
        verify_files(dir.path(), &read).unwrap();
        let as_two = CheckpointState { format: 2, ..meta };
        fs::write(dir.path().join(STATE), serde_json::to_string(&as_two).unwrap()).unwrap();
        let e = format!("{:#}", read_state(dir.path()).unwrap_err());
        assert!(e.contains("damaged"), "{e}");
    }
}
