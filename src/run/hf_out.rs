//! Writing a Hugging Face directory: a model's fp32 masters -> `config.json` (with `dtype` and
//! `torch_dtype` of the weights written), the weights as safetensors (fp32 or bf16, sharded with
//! `model.safetensors.index.json` past a size limit), `generation_config.json` and every
//! tokenizer file of the source (`chat_template.jinja` included), as `transformers` loads them.
//! Training writes `OUT/final/` through [`export_model`], and so does `horizon export`
//! (`run::export`); an adapter run's `OUT/final/` gets the tokenizer files beside the adapter
//! ([`write_tokenizer`]).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::hf::checkpoint::write_safetensors;
use crate::hf::config::{Arch, ModelConfig};
use crate::model::params::ParamStore;
use crate::model::spec::Op;
use crate::run::config::RawConfig;
pub use crate::run::config::{DEFAULT_MAX_SHARD_BYTES, ExportOptions};
use crate::tokenizer::byte::{BOS_ID, EOS_ID, PAD_ID};
use crate::tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer};

/// The tokenizer files of a HF directory that an export carries along when they exist: those
/// `transformers`' tokenizer `save_pretrained` writes (`chat_template.jinja` is where
/// transformers 5 keeps the chat template, which `apply_chat_template` and `horizon generate
/// --chat` read), and a slow tokenizer's vocabulary files. (`generation_config.json` is written
/// by the export itself: see [`SpecialIds`].)
pub const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
];

/// transformers 5's directory of a tokenizer's named chat templates beside the default one
/// (`additional_chat_templates/NAME.jinja`), carried along as a whole.
const CHAT_TEMPLATES_DIR: &str = "additional_chat_templates";

/// Whether `dir` holds any tokenizer file an export would carry ([`TOKENIZER_FILES`]).
pub fn has_tokenizer(dir: &Path) -> bool {
    TOKENIZER_FILES.iter().any(|f| dir.join(f).is_file())
}

/// `generation_config.json`: what `transformers`' `generate` reads its stop id from.
const GENERATION_CONFIG: &str = "generation_config.json";

/// The special-token keys an export writes into `config.json` and `generation_config.json`.
const SPECIAL_KEYS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

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
            (None, Some(p)) if has_tokenizer(p) => TokenizerSource::Dir(p.clone()),
            _ => TokenizerSource::None,
        }
    }
}

/// Where an export's special-token ids and `generation_config.json` come from.
#[derive(Clone, Debug)]
pub struct ExportSource {
    pub tokenizer: TokenizerSource,
    /// The directory of the model trained or exported (`model.path`), whose
    /// `generation_config.json` is carried over; `None` for a model trained from scratch.
    pub model_dir: Option<PathBuf>,
}

impl ExportSource {
    /// A run's sources: its tokenizer ([`TokenizerSource::of_config`]) and `model.path`.
    pub fn of_config(raw: &RawConfig) -> Self {
        ExportSource {
            tokenizer: TokenizerSource::of_config(raw),
            model_dir: raw.model.path.clone(),
        }
    }

    /// No tokenizer, no source directory: the ids are the model config's own.
    pub fn none() -> Self {
        ExportSource { tokenizer: TokenizerSource::None, model_dir: None }
    }
}

/// The special-token ids of an export: each of [`SPECIAL_KEYS`] as the JSON value to write
/// (`null` when unknown; `eos_token_id` may be a list), and the source's
/// `generation_config.json`, all of whose keys are kept.
///
/// `config.json` takes each id from the source model's `config.json` when it has one, else
/// from the source's `generation_config.json`, else from the tokenizer (`<|bos|>`, `<|eos|>`,
/// `<|pad|>` of the byte tokenizer; `tokenizer_config.json`'s tokens of a HF one).
/// `generation_config.json` is the source's with every missing or null id filled the same way.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecialIds {
    /// The values `config.json` gets, in [`SPECIAL_KEYS`] order.
    pub config: [serde_json::Value; 3],
    /// `generation_config.json` as written.
    pub generation: serde_json::Map<String, serde_json::Value>,
}

impl SpecialIds {
    /// From the model's HF config (`to_hf_json`), the source's `generation_config.json` (an
    /// object, empty when there is none) and the tokenizer's ids (bos, eos, pad).
    pub fn resolve(
        model_json: &serde_json::Value,
        source_generation: serde_json::Map<String, serde_json::Value>,
        tokenizer: [Option<u32>; 3],
    ) -> Self {
        use serde_json::Value;
        let known = |v: Option<&Value>| v.filter(|v| !v.is_null()).cloned();
        let config = std::array::from_fn(|i| {
            let key = SPECIAL_KEYS[i];
            known(model_json.get(key))
                .or_else(|| known(source_generation.get(key)))
                .or_else(|| tokenizer[i].map(Value::from))
                .unwrap_or(Value::Null)
        });
        let mut generation = source_generation;
        for (key, v) in SPECIAL_KEYS.iter().zip(&config) {
            if known(generation.get(*key)).is_none() {
                generation.insert(key.to_string(), v.clone());
            }
        }
        SpecialIds { config, generation }
    }

    /// What [`SpecialIds::resolve`] gives for `model_cfg` and the sources: the source model's
    /// `generation_config.json` (`model_dir`, else the tokenizer's directory), the tokenizer's
    /// ids. A generation config that is not a JSON object is an error naming it.
    fn of_sources(model_cfg: &ModelConfig, source: &ExportSource) -> Result<Self> {
        let tok_dir = match &source.tokenizer {
            TokenizerSource::Dir(d) => Some(d.as_path()),
            _ => None,
        };
        let gen_path = [source.model_dir.as_deref(), tok_dir]
            .into_iter()
            .flatten()
            .map(|d| d.join(GENERATION_CONFIG))
            .find(|p| p.is_file());
        let generation = match &gen_path {
            None => serde_json::Map::new(),
            Some(p) => {
                let text = fs::read_to_string(p)
                    .with_context(|| format!("cannot read {}", p.display()))?;
                match serde_json::from_str::<serde_json::Value>(&text) {
                    Ok(serde_json::Value::Object(o)) => o,
                    _ => bail!("{}: not a JSON object", p.display()),
                }
            }
        };
        let tokenizer = match &source.tokenizer {
            TokenizerSource::Byte => [Some(BOS_ID), Some(EOS_ID), Some(PAD_ID)],
            TokenizerSource::Dir(d) => match HfTokenizer::from_dir(d) {
                Ok(t) => [t.bos_id(), t.eos_id(), t.pad_id()],
                Err(e) => {
                    // The files are still copied; only the ids are unknown.
                    tracing::warn!("no special-token ids from {}: {e:#}", d.display());
                    [None; 3]
                }
            },
            TokenizerSource::None => [None; 3],
        };
        Ok(SpecialIds::resolve(&model_cfg.to_hf_json(), generation, tokenizer))
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

/// Write `params` as a HF directory `dir`, atomically: everything is written into a staging
/// directory beside it ([`Staging`]), which then takes `dir`'s place with the user's other files
/// of `dir` linked in; the earlier weights go with the old directory, so a directory exported
/// twice (say, sharded then not) never mixes the two, and an interrupted export leaves the
/// earlier one as it was. `config.json` and `generation_config.json` carry the special-token
/// ids ([`SpecialIds`]).
pub fn export_model(
    model_cfg: &ModelConfig,
    params: &ParamStore,
    dir: &Path,
    opts: ExportOptions,
    source: &ExportSource,
) -> Result<Exported> {
    // Read before anything is written: the source may be `dir` itself.
    let specials = SpecialIds::of_sources(model_cfg, source)?;
    let staging = Staging::begin(dir)?;
    let mut out = write_export(model_cfg, params, staging.path(), opts, source, &specials)?;
    staging.commit(dir)?;
    for p in &mut out.shards {
        *p = dir.join(p.file_name().expect("a weight file"));
    }
    Ok(out)
}

/// [`export_model`]'s files, into the fresh directory `dir`.
fn write_export(
    model_cfg: &ModelConfig,
    params: &ParamStore,
    dir: &Path,
    opts: ExportOptions,
    source: &ExportSource,
    specials: &SpecialIds,
) -> Result<Exported> {
    let layout = crate::model::describe(model_cfg);
    let mut cfg_json = model_cfg.to_hf_json();
    if let Some(o) = cfg_json.as_object_mut() {
        // What was written, under both keys: transformers 5 reads `dtype`, 4.x `torch_dtype`.
        o.insert("dtype".into(), opts.dtype.torch_dtype().into());
        o.insert("torch_dtype".into(), opts.dtype.torch_dtype().into());
        for (key, v) in SPECIAL_KEYS.iter().zip(&specials.config) {
            o.insert(key.to_string(), v.clone());
        }
    }
    let cfg_path = dir.join("config.json");
    fs::write(&cfg_path, serde_json::to_string_pretty(&cfg_json)?)
        .with_context(|| format!("cannot write {}", cfg_path.display()))?;

    let mut tensors: Vec<Entry> = layout
        .hf_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let data = params.tensor(&layout, &name).expect("the layout names its own tensors");
            (name, shape, Values::Stored(data))
        })
        .collect();
    if let Some(m) = &model_cfg.moe {
        if m.arch == Arch::GptOss && opts.fused_experts == Some(false) {
            bail!(
                "--layout hub: gpt-oss has no per-expert layout (its checkpoints store the \
                 experts fused)\nhint: leave --layout out, or write --layout fused"
            );
        }
        if opts.fused_experts.unwrap_or(m.fused) {
            tensors = fuse_experts(tensors, m, &layout, params);
        }
    } else if opts.fused_experts == Some(true) {
        bail!(
            "--layout fused is for a mixture of experts; {} has no experts",
            model_cfg.arch.model_type()
        );
    }
    let numel = |t: &Entry| t.1.iter().product::<usize>();
    let sizes: Vec<u64> = tensors.iter().map(|t| (numel(t) * opts.dtype.size()) as u64).collect();
    let write = |path: &Path, entries: &[Entry]| {
        write_entries(path, entries, (&layout, params), opts.dtype)
    };
    let shards = plan_shards(&sizes, opts.max_shard_bytes);
    let total_bytes: u64 = sizes.iter().sum();
    let mut files = Vec::new();
    if shards.len() == 1 {
        let path = dir.join("model.safetensors");
        write(&path, &tensors)?;
        test_exit_after_first_file();
        files.push(path);
    } else {
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        for (i, range) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            let path = dir.join(&name);
            write(&path, &tensors[range.clone()])?;
            test_exit_after_first_file();
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
    let mut tokenizer_files = write_tokenizer(dir, &source.tokenizer)?;
    let path = dir.join(GENERATION_CONFIG);
    fs::write(&path, serde_json::to_string_pretty(&specials.generation)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    tokenizer_files.push(GENERATION_CONFIG.to_string());
    Ok(Exported { shards: files, total_bytes, tokenizer_files })
}

/// The Hub layout's per-expert tensors of every sparse layer as transformers 5's fused ones:
/// `mlp.experts.gate_up_proj` (E, 2I, C) and `mlp.experts.down_proj` (E, C, I), each one
/// contiguous run of the layer's buffer (its experts' `[gate; up]`, then their downs), in the
/// place of the layer's first expert tensor of each, and the router as `mlp.gate.weight`; every
/// other tensor as it was, in order.
/// gpt-oss's experts go in as [`gpt_oss_fused`]'s four tensors, made as their file is written.
fn fuse_experts<'a>(
    tensors: Vec<Entry<'a>>,
    m: &crate::hf::config::MoeConfig,
    layout: &crate::model::layout::ModelLayout,
    params: &'a ParamStore,
) -> Vec<Entry<'a>> {
    let (e, i, c) = (m.num_experts, m.expert_size, layout.dims.c);
    let (block, [gate, _, down]) = m.hub_names();
    let mut out = Vec::with_capacity(tensors.len());
    for (name, shape, data) in tensors {
        let parsed = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, rest)| Some((l.parse::<usize>().ok()?, rest)));
        let Some((l, rest)) = parsed else {
            out.push((name, shape, data));
            continue;
        };
        let experts = layout.layer(l).ops.iter().find_map(|op| match op {
            Op::Experts { gate_up, down, .. } => Some((gate_up.clone(), down.clone())),
            _ => None,
        });
        let [router, gu, dn] = crate::hf::moe::fused_names(l);
        let Some((gu_range, dn_range)) = experts else {
            out.push((name, shape, data));
            continue;
        };
        let buf = &params.layers[l];
        let gpt_oss = m.arch == Arch::GptOss;
        if gpt_oss && rest == format!("{block}.experts.0.{gate}.weight") {
            let fused = gpt_oss_fused_shapes(l, (e, i, c)).into_iter().enumerate();
            out.extend(fused.map(|(k, (n, s))| (n, s, Values::GptOss(l, k))));
        } else if !gpt_oss && rest == format!("{block}.gate.weight") {
            out.push((router, shape, data));
        } else if !gpt_oss && rest == format!("{block}.experts.0.{gate}.weight") {
            out.push((gu, vec![e, 2 * i, c], Values::Stored(&buf[gu_range])));
        } else if !gpt_oss && rest == format!("{block}.experts.0.{down}.weight") {
            out.push((dn, vec![e, c, i], Values::Stored(&buf[dn_range])));
        } else if !rest.starts_with(&format!("{block}.experts.")) {
            out.push((name, shape, data));
        }
    }
    out
}

/// A tensor to write: its name, shape and values.
pub type OwnedTensor = (String, Vec<usize>, Vec<f32>);

/// Where a written tensor's values come from: the store, or (gpt-oss) fused expert parameter
/// `k` of layer `l` ([`gpt_oss_fused`]), made only while the file holding it is written, so an
/// export holds at most one file's worth of them beside the store.
#[derive(Clone, Copy)]
enum Values<'a> {
    Stored(&'a [f32]),
    GptOss(usize, usize),
}

/// A tensor to write: its name, shape and where its values come from.
type Entry<'a> = (String, Vec<usize>, Values<'a>);

/// `entries` as one safetensors file at `path`, each gpt-oss layer's fused experts made for it.
fn write_entries(
    path: &Path,
    entries: &[Entry],
    (layout, params): (&crate::model::layout::ModelLayout, &ParamStore),
    dtype: crate::hf::checkpoint::SaveDtype,
) -> Result<()> {
    let mut made: BTreeMap<usize, Vec<OwnedTensor>> = BTreeMap::new();
    for (_, _, v) in entries {
        if let Values::GptOss(l, _) = *v {
            made.entry(l).or_insert_with(|| gpt_oss_fused(layout, &params.layers[l], l));
        }
    }
    let tensors: Vec<(String, Vec<usize>, &[f32])> = entries
        .iter()
        .map(|(n, s, v)| {
            let data = match *v {
                Values::Stored(d) => d,
                Values::GptOss(l, k) => &made[&l][k].2[..],
            };
            (n.clone(), s.clone(), data)
        })
        .collect();
    write_safetensors(path, &tensors, dtype)
}

/// The names and shapes of layer `l`'s fused gpt-oss expert parameters, in [`gpt_oss_fused`]'s
/// order, for E experts of I over a hidden size C.
fn gpt_oss_fused_shapes(l: usize, (e, i, c): (usize, usize, usize)) -> [(String, Vec<usize>); 4] {
    let p = format!("model.layers.{l}.mlp.experts");
    [
        (format!("{p}.gate_up_proj"), vec![e, c, 2 * i]),
        (format!("{p}.gate_up_proj_bias"), vec![e, 2 * i]),
        (format!("{p}.down_proj"), vec![e, i, c]),
        (format!("{p}.down_proj_bias"), vec![e, c]),
    ]
}

/// Layer `l`'s gpt-oss experts from its buffer `buf` (weights, or their gradients in full
/// fine-tuning: the same layout) as transformers' fused parameters: `gate_up_proj` (E, C, 2I)
/// in-to-out with gate and up interleaved (column 2j gate unit j, 2j+1 up unit j),
/// `gate_up_proj_bias` (E, 2I) likewise, `down_proj` (E, I, C) in-to-out, `down_proj_bias`
/// (E, C): the inverse of what `hf::moe::read_fused_as_hub` reads.
pub fn gpt_oss_fused(
    layout: &crate::model::layout::ModelLayout,
    buf: &[f32],
    l: usize,
) -> Vec<OwnedTensor> {
    let op = layout.layer(l).ops.iter().find(|op| matches!(op, Op::Experts { .. }));
    let Some(Op::Experts { gate_up, down, bias: Some(bias), e, i, c, .. }) = op else {
        return Vec::new();
    };
    let [gb, db] = bias;
    let (e, i, c) = (*e, *i, *c);
    let (wgu, wdn, bgu) = (&buf[gate_up.clone()], &buf[down.clone()], &buf[gb.clone()]);
    let mut gu = vec![0.0; e * c * 2 * i];
    let mut gub = vec![0.0; e * 2 * i];
    let mut dn = vec![0.0; e * i * c];
    for x in 0..e {
        for j in 0..2 * i {
            // Row j of expert x's [gate; up] is gate unit j (j < I) or up unit j - I.
            let col = if j < i { 2 * j } else { 2 * (j - i) + 1 };
            gub[x * 2 * i + col] = bgu[x * 2 * i + j];
            for cc in 0..c {
                gu[(x * c + cc) * 2 * i + col] = wgu[(x * 2 * i + j) * c + cc];
            }
        }
        for cc in 0..c {
            for j in 0..i {
                dn[(x * i + j) * c + cc] = wdn[(x * c + cc) * i + j];
            }
        }
    }
    let values = [gu, gub, dn, buf[db.clone()].to_vec()];
    let shapes = gpt_oss_fused_shapes(l, (e, i, c));
    shapes.into_iter().zip(values).map(|((n, s), v)| (n, s, v)).collect()
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

/// The tests' interruption of an export after its first weight file
/// (`HORIZON_TEST_EXPORT_EXIT_AFTER_FIRST_FILE`, test builds only), as a kill there would.
fn test_exit_after_first_file() {
    #[cfg(feature = "test-hooks")]
    if std::env::var_os("HORIZON_TEST_EXPORT_EXIT_AFTER_FIRST_FILE").is_some() {
        eprintln!("HORIZON_TEST_EXPORT_EXIT_AFTER_FIRST_FILE: stopping the export here");
        std::process::exit(9);
    }
}

/// Whether `name` is a weight file of a HF directory (what an export replaces).
fn is_weight_file(name: &str) -> bool {
    name == "model.safetensors"
        || name == "model.safetensors.index.json"
        || (name.starts_with("model-") && name.ends_with(".safetensors"))
}

/// An export's staging directory, `.NAME.horizon-export-PID` beside the target `NAME` (the
/// same filesystem, so that the swap is a rename): written whole, then swapped in by
/// [`Staging::commit`]: the target renamed aside to `.NAME.horizon-old`, the staging renamed to
/// the target, the old one removed. [`Staging::begin`] first finishes what an interrupted export
/// left: a target renamed aside but not replaced is put back, stale staging directories of
/// processes that are gone are removed.
struct Staging {
    path: PathBuf,
}

impl Staging {
    fn begin(dir: &Path) -> Result<Self> {
        let (parent, name) = split_dir(dir)?;
        fs::create_dir_all(&parent).with_context(|| {
            format!("cannot create {}\nhint: choose a writable output directory", parent.display())
        })?;
        let old = parent.join(format!(".{name}.horizon-old"));
        if old.exists() {
            if dir.exists() {
                fs::remove_dir_all(&old)
            } else {
                fs::rename(&old, dir) // an earlier swap stopped halfway: the old one back
            }
            .with_context(|| format!("cannot tidy {}", old.display()))?;
        }
        let prefix = format!(".{name}.horizon-export-");
        for e in
            fs::read_dir(&parent).with_context(|| format!("cannot list {}", parent.display()))?
        {
            let e = e?;
            let n = e.file_name().to_string_lossy().into_owned();
            let pid = n.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok());
            let alive =
                |p: u32| p == std::process::id() || Path::new(&format!("/proc/{p}")).exists();
            if pid.is_some_and(|p| !alive(p)) {
                fs::remove_dir_all(e.path())
                    .with_context(|| format!("cannot remove the stale {}", e.path().display()))?;
            }
        }
        let path = parent.join(format!("{prefix}{}", std::process::id()));
        if path.exists() {
            fs::remove_dir_all(&path)?;
        }
        fs::create_dir(&path).with_context(|| {
            format!("cannot create {}\nhint: choose a writable output directory", path.display())
        })?;
        Ok(Staging { path })
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// The staging directory in `dir`'s place, with every file of `dir` the export did not
    /// write (and that is not an earlier weight file) linked in.
    fn commit(self, dir: &Path) -> Result<()> {
        let (parent, name) = split_dir(dir)?;
        if dir.exists() {
            for e in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
                let e = e?;
                let n = e.file_name();
                let to = self.path.join(&n);
                if !is_weight_file(&n.to_string_lossy()) && !to.exists() {
                    link_tree(&e.path(), &to)?;
                }
            }
            let old = parent.join(format!(".{name}.horizon-old"));
            fs::rename(dir, &old)
                .with_context(|| format!("cannot move {} aside", dir.display()))?;
            fs::rename(&self.path, dir)
                .with_context(|| format!("cannot move the export into {}", dir.display()))?;
            fs::remove_dir_all(&old).with_context(|| format!("cannot remove {}", old.display()))
        } else {
            fs::rename(&self.path, dir)
                .with_context(|| format!("cannot move the export into {}", dir.display()))
        }
    }
}

/// `dir`'s parent (`.` for a bare name) and its name.
fn split_dir(dir: &Path) -> Result<(PathBuf, String)> {
    let name = dir
        .file_name()
        .with_context(|| format!("{}: an export needs a directory name", dir.display()))?
        .to_string_lossy()
        .into_owned();
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// `from` (a file, link or directory tree) at `to`, files hard-linked (copied where a link is
/// refused).
fn link_tree(from: &Path, to: &Path) -> Result<()> {
    let meta = fs::symlink_metadata(from)?;
    if meta.file_type().is_symlink() {
        std::os::unix::fs::symlink(fs::read_link(from)?, to)?;
    } else if meta.is_dir() {
        fs::create_dir(to)?;
        for e in fs::read_dir(from)? {
            let e = e?;
            link_tree(&e.path(), &to.join(e.file_name()))?;
        }
    } else if fs::hard_link(from, to).is_err() {
        fs::copy(from, to).with_context(|| format!("cannot carry over {}", from.display()))?;
    }
    Ok(())
}

/// The tokenizer files of `source` into `dir` (which exists): each of [`TOKENIZER_FILES`] the
/// source directory has, and its [`CHAT_TEMPLATES_DIR`]; or the byte tokenizer's files. Returns
/// their names. A source directory without any is an error naming it.
pub fn write_tokenizer(dir: &Path, source: &TokenizerSource) -> Result<Vec<String>> {
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
            let templates = src.join(CHAT_TEMPLATES_DIR);
            if templates.is_dir() && !written.is_empty() {
                copy_dir(&templates, &dir.join(CHAT_TEMPLATES_DIR))?;
                written.push(format!("{CHAT_TEMPLATES_DIR}/"));
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

/// The files of directory `from` (one level: transformers writes no deeper) copied into `to`.
fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to).with_context(|| format!("cannot create {}", to.display()))?;
    for e in fs::read_dir(from).with_context(|| format!("cannot list {}", from.display()))? {
        let e = e?;
        if e.path().is_file() {
            fs::copy(e.path(), to.join(e.file_name())).with_context(|| {
                format!("cannot copy {} to {}", e.path().display(), to.display())
            })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn special_ids_come_from_the_model_then_its_generation_config_then_the_tokenizer() {
        let byte = [Some(BOS_ID), Some(EOS_ID), Some(PAD_ID)];
        // A model from scratch (ids null) with the byte tokenizer: the tokenizer's ids.
        let model = json!({"bos_token_id": null, "eos_token_id": null});
        let s = SpecialIds::resolve(&model, serde_json::Map::new(), byte);
        assert_eq!(s.config, [json!(256), json!(257), json!(258)]);
        assert_eq!(
            serde_json::Value::Object(s.generation),
            json!({"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258})
        );
        // The source model's own ids win; its generation config keeps every key (an eos list,
        // sampling settings) and gets only what it lacks.
        let model = json!({"bos_token_id": 1, "eos_token_id": 2});
        let source_gen = json!({"eos_token_id": [2, 7], "temperature": 0.6, "pad_token_id": null});
        let serde_json::Value::Object(source_gen) = source_gen else { unreachable!() };
        let s = SpecialIds::resolve(&model, source_gen, [Some(500), Some(504), None]);
        assert_eq!(s.config, [json!(1), json!(2), serde_json::Value::Null]);
        assert_eq!(
            serde_json::Value::Object(s.generation),
            json!({"bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": null, "temperature": 0.6})
        );
        // A config without ids takes the generation config's before the tokenizer's.
        let source_gen = json!({"eos_token_id": [2, 7]});
        let serde_json::Value::Object(source_gen) = source_gen else { unreachable!() };
        let s = SpecialIds::resolve(&json!({}), source_gen, [Some(500), Some(504), None]);
        assert_eq!(s.config, [json!(500), json!([2, 7]), serde_json::Value::Null]);
    }

    #[test]
    fn shards_group_consecutive_tensors_under_the_limit() {
        assert_eq!(plan_shards(&[4, 4, 4], 100), vec![0..3]);
        assert_eq!(plan_shards(&[4, 4, 4], 8), vec![0..2, 2..3]);
        assert_eq!(plan_shards(&[10, 4, 4], 8), vec![0..1, 1..3]);
        assert_eq!(plan_shards(&[4, 10, 4], 8), vec![0..1, 1..2, 2..3]);
    }
}
