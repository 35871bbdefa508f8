//! A run's model in the host store: its config (a HF directory's `config.json` with the run's
//! `model:` keys on top), its layout (with the run's adapters), and its weights: loaded from the
//! checkpoint or drawn, and for an adapter run the frozen base (NF4 for QLoRA) and the adapters
//! (PEFT's init, or an `adapter.init` directory). Also the adapter directories a run writes and
//! reads, and the tokenizer a config names.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::adapter::{AdapterConfig, AdapterKind, BaseDtype as BaseChoice, peft};
use crate::hf::checkpoint::NonFinite;
use crate::hf::config::Arch;
use crate::hf::config::ModelConfig;
use crate::hf::hub_cache;
use crate::model::base::FrozenBase;
use crate::model::layout::ModelLayout;
use crate::model::lora::BaseDtype;
use crate::model::lora::{
    ExpertTargets, LoraSpec, ROUTER, adapter_suffix, expert_b_from_peft, expert_b_to_peft,
};
use crate::model::params::ParamStore;
use crate::run::config::{ModelInit, RawConfig};
use crate::tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer};

/// The model description a config names (no weights): a HF directory's `config.json` with
/// the config's own keys on top.
pub fn model_config(raw: &RawConfig) -> Result<ModelConfig> {
    let m = &raw.model;
    let mut json = serde_json::Map::new();
    let mut origin = "config model".to_string();
    if let Some(dir) = &m.path {
        if !dir.is_dir() {
            bail!(
                "model.path {}: no such directory\nhint: point model.path at a Hugging Face model directory (config.json + model.safetensors)",
                dir.display()
            );
        }
        let path = dir.join("config.json");
        let text =
            fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        if let serde_json::Value::Object(o) = v {
            json = o;
        }
        origin = path.display().to_string();
    }
    for (k, v) in &m.hf {
        json.insert(k.clone(), v.clone());
    }
    if let Some(arch) = &m.arch {
        json.insert("model_type".into(), serde_json::Value::String(arch.clone()));
    }
    let mut cfg = ModelConfig::from_json(&serde_json::Value::Object(json), &origin)?;
    if let Some(dir) = &m.path {
        note_expert_layout(&mut cfg, dir)?;
    }
    Ok(cfg)
}

/// Whether the checkpoint in `dir` stores a mixture's experts fused (transformers 5) or one
/// tensor per expert (the Hub): what its exports keep.
pub fn note_expert_layout(cfg: &mut ModelConfig, dir: &Path) -> Result<()> {
    let (layers, c, prefix) = (cfg.num_layers, cfg.hidden_size, cfg.tensor_prefix.clone());
    let Some(moe) = cfg.moe.as_mut() else { return Ok(()) };
    // gpt-oss has only the fused layout; a directory without weights (a plan from config.json
    // alone) keeps the config's default, and a training run's load names what is missing.
    let weights = ["model.safetensors", "model.safetensors.index.json"];
    if moe.arch == Arch::GptOss || !(dir.is_file() || weights.iter().any(|w| dir.join(w).exists()))
    {
        return Ok(());
    }
    let mut ckpt = crate::hf::checkpoint::Checkpoint::open(dir)?;
    moe.fused = crate::hf::moe::read_fused_as_hub(&mut ckpt, moe, (&prefix, layers, c))?;
    Ok(())
}

/// The model a config names, in full (no adapter): loaded from a HF directory, or randomly
/// initialised.
pub fn load_model(raw: &RawConfig) -> Result<(ModelConfig, ParamStore)> {
    let cfg = model_config(raw)?;
    let layout = crate::model::describe(&cfg);
    let m = load_weights(raw, None, cfg, layout)?;
    Ok((m.cfg, m.params))
}

/// A run's model: its layout (the full model, or with the run's adapters), the trained
/// tensors, and an adapter run's frozen base.
pub struct RunModel {
    pub cfg: ModelConfig,
    pub layout: ModelLayout,
    pub params: ParamStore,
    pub base: Option<FrozenBase>,
    /// The frozen base's content hash (`model::base::base_hash`), computed as it was read; `None`
    /// without a base read from `model.path` (full fine-tuning, a random base).
    pub base_hash: Option<String>,
}

/// The layout of a run: the model's, with `adapter`'s LoRA on every layer when there is one
/// (its base dtype resolved: `auto` is the checkpoint's). An adapter target the model does
/// not have is an error naming it.
pub fn run_layout(
    raw: &RawConfig,
    model_cfg: &ModelConfig,
    adapter: Option<&AdapterConfig>,
) -> Result<ModelLayout> {
    let full = crate::model::describe(model_cfg);
    let Some(a) = adapter else { return Ok(full) };
    let base = match (a.base_dtype, raw.model.init, &raw.model.path) {
        (BaseChoice::Bf16, ..) => BaseDtype::Bf16,
        (BaseChoice::Fp32, ..) => BaseDtype::F32,
        (BaseChoice::Auto, None, Some(dir)) => checkpoint_dtype(dir)?,
        (BaseChoice::Auto, ..) => BaseDtype::Bf16,
    };
    let (targets, experts) = split_targets(a, model_cfg)?;
    let lora = LoraSpec {
        r: a.r,
        scale: a.scale(),
        targets,
        nf4: a.kind == AdapterKind::Qlora,
        base,
        experts,
    };
    full.with_lora(&lora).map_err(|e| {
        anyhow::anyhow!(
            "{e}\nhint: adapter.targets lists the projections to adapt; list only ones this model has"
        )
    })
}

/// The names `adapter.targets` may give the router: Horizon's own and PEFT's parameters.
const ROUTER_NAMES: [&str; 3] = [ROUTER, peft::ROUTER_PARAM, peft::GPT_OSS_ROUTER_PARAM];

/// `adapter.targets` as module targets and expert targets, as PEFT reads them on a mixture of
/// experts: `experts` (or PEFT's `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`) adapts
/// the routed experts; on Qwen3-MoE and Mixtral the per-expert names (`gate_proj` + `up_proj`,
/// `w1` + `w3`: one gate|up adapter of rank 2r and alpha 2 alpha; `down_proj`, `w2`) mean the
/// experts too, and no dense MLP (PEFT's rewrite of `target_modules`).
pub fn split_targets(a: &AdapterConfig, cfg: &ModelConfig) -> Result<(Vec<String>, ExpertTargets)> {
    let scale = |r: usize, alpha: f64| {
        let r = r as f64;
        (if a.rslora { alpha / r.sqrt() } else { alpha / r }) as f32
    };
    let plain = (a.r, scale(a.r, a.alpha));
    let rewrites = matches!(cfg.arch, Arch::Qwen3Moe | Arch::Mixtral);
    let has = |names: &[&str]| a.targets.iter().any(|t| names.contains(&t.as_str()));
    let (gate, up) = (has(&["gate_proj", "w1"]), has(&["up_proj", "w3"]));
    let mut ex = ExpertTargets::default();
    if has(&["experts"]) || has(&["mlp.experts.gate_up_proj", "gate_up_proj"]) {
        ex.gate_up = Some(plain);
    }
    if has(&["experts", "mlp.experts.down_proj"]) || (rewrites && has(&["down_proj", "w2"])) {
        ex.down = Some(plain);
    }
    if rewrites && (gate || up) {
        if gate != up {
            bail!(
                "adapter.targets names one of a sparse layer's gate and up projections without the other\nhint: an expert's gate and up are one fused parameter (PEFT's mlp.experts.gate_up_proj): list both, or `experts`"
            );
        }
        ex.gate_up = Some((2 * a.r, scale(2 * a.r, 2.0 * a.alpha)));
    }
    let router = has(&ROUTER_NAMES);
    if router && !cfg.arch.is_moe() {
        bail!(
            "adapter.targets names the router, but {} is not a mixture of experts",
            cfg.arch.model_type()
        );
    }
    if !cfg.arch.is_moe() && (ex.gate_up.is_some() || ex.down.is_some()) {
        bail!(
            "adapter.targets names the routed experts, but {} is not a mixture of experts",
            cfg.arch.model_type()
        );
    }
    if cfg.arch == Arch::GptOss && (ex.gate_up.is_some() || ex.down.is_some()) {
        bail!(
            "adapter.targets names gpt-oss's routed experts: adapters on its in-to-out, gate/up-interleaved expert parameters are not implemented yet\nhint: adapt the attention (q_proj, k_proj, v_proj, o_proj) and, if you like, the router; the experts stay the frozen base"
        );
    }
    let expert_names: &[&str] = if rewrites {
        &[
            "experts",
            "mlp.experts.gate_up_proj",
            "gate_up_proj",
            "mlp.experts.down_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "w1",
            "w2",
            "w3",
        ]
    } else {
        &["experts", "mlp.experts.gate_up_proj", "gate_up_proj", "mlp.experts.down_proj"]
    };
    let routers = ROUTER_NAMES;
    let mut modules: Vec<String> = a
        .targets
        .iter()
        .filter(|t| !expert_names.contains(&t.as_str()) && !routers.contains(&t.as_str()))
        .cloned()
        .collect();
    if router {
        modules.push(ROUTER.to_string());
    }
    Ok((modules, ex))
}

/// Load (or draw) a run's model. In an adapter run the base is frozen in its dtype (quantised
/// to NF4 for `qlora`) and the adapters start from `adapter.init` or as PEFT starts them
/// (A Kaiming-uniform, B zero: step 0 computes the base model).
pub fn load_run_model(raw: &RawConfig, adapter: Option<&AdapterConfig>) -> Result<RunModel> {
    let cfg = model_config(raw)?;
    let layout = run_layout(raw, &cfg, adapter)?;
    load_weights(raw, adapter, cfg, layout)
}

/// The weights of the model `cfg` and `layout` describe ([`model_config`], [`run_layout`]): a
/// run describes its model once, plans with the description, then loads into it.
pub fn load_weights(
    raw: &RawConfig,
    adapter: Option<&AdapterConfig>,
    cfg: ModelConfig,
    layout: ModelLayout,
) -> Result<RunModel> {
    let m = &raw.model;
    let std = m.hf.get("initializer_range").and_then(|v| v.as_f64()).unwrap_or(0.02) as f32;
    let nf = NonFinite::allowed_if(m.allow_non_finite);
    let Some(a) = adapter else {
        let params = match (m.init, &m.path) {
            (Some(ModelInit::Random), _) => ParamStore::random(&layout, m.seed, std),
            (None, Some(dir)) => ParamStore::load_hf_with(&layout, dir, nf)?,
            (None, None) => bail!("model.path is missing"),
        };
        return Ok(RunModel { cfg, layout, params, base: None, base_hash: None });
    };
    let dtype = layout.adapter.as_ref().expect("an adapter layout").base;
    let (base, base_hash) = match (m.init, &m.path) {
        (Some(ModelInit::Random), _) => (FrozenBase::random(&layout, dtype, m.seed, std), None),
        (None, Some(dir)) => {
            let (base, hash) = FrozenBase::load_hf(&layout, dir, dtype, nf)?;
            (base, Some(hash))
        }
        (None, None) => bail!("model.path is missing"),
    };
    let mut params = ParamStore::random(&layout, m.seed, std);
    if let Some(dir) = &a.init {
        init_from_peft(&layout, a, dir, &mut params)?;
    }
    Ok(RunModel { cfg, layout, params, base: Some(base), base_hash })
}

/// `auto` base dtype: bf16 when the checkpoint stores every tensor as bf16, else fp32 (f16 and
/// f64 convert to fp32 exactly or nearly).
fn checkpoint_dtype(dir: &Path) -> Result<BaseDtype> {
    let ckpt = crate::hf::checkpoint::Checkpoint::open(dir)?;
    let all_bf16 = ckpt.names().iter().all(|n| ckpt.dtype(n) == Some("BF16"));
    Ok(if all_bf16 { BaseDtype::Bf16 } else { BaseDtype::F32 })
}

/// The adapters of `params` from the PEFT adapter directory `dir`, checked against the run
/// (r, alpha, targets, shapes).
fn init_from_peft(
    layout: &ModelLayout,
    a: &AdapterConfig,
    dir: &Path,
    params: &mut ParamStore,
) -> Result<()> {
    let adapter = peft::read(dir)?;
    let shapes = |layer: usize, target: &str| {
        let spec = layout.layer(layer);
        let a_name = adapter_suffix(peft::module_path(target)?, false);
        let b_name = adapter_suffix(peft::module_path(target)?, true);
        let at = spec.tensors.iter().find(|t| t.name == a_name)?;
        let bt = spec.tensors.iter().find(|t| t.name == b_name)?;
        Some((bt.shape[0], at.shape[1]))
    };
    let experts: BTreeMap<String, Vec<usize>> = layout
        .hf_tensors()
        .into_iter()
        .filter(|(n, _)| is_expert_adapter(n))
        .map(|(n, shape)| (format!("{PEFT_PREFIX}{n}"), shape))
        .collect();
    peft::check_against(&adapter, a, &trained_of(layout, a), shapes, &experts, layout.dims.layers)?;
    for (name, (shape, values)) in &adapter.tensors {
        let ours = name.strip_prefix(PEFT_PREFIX).unwrap_or(name);
        let dst = params.tensor_mut(layout, ours).with_context(|| {
            format!("{}: tensor '{name}' is not one the run trains", dir.display())
        })?;
        match expert_b(layout, ours, shape) {
            Some((e, out, r)) => dst.copy_from_slice(&expert_b_from_peft(values, e, out, r)),
            None => dst.copy_from_slice(values),
        }
    }
    Ok(())
}

/// Trained tensor `name`'s values (`data`) in PEFT's file order: an expert adapter's B
/// reordered, every other tensor as it is.
pub fn peft_order(layout: &ModelLayout, name: &str, data: &[f32]) -> Vec<f32> {
    let shape = layout.hf_tensors().into_iter().find(|(n, _)| n == name).map(|(_, s)| s);
    match shape.and_then(|s| expert_b(layout, name, &s)) {
        Some((e, out, r)) => expert_b_to_peft(data, e, out, r),
        None => data.to_vec(),
    }
}

/// Whether `name` is an adapter tensor of a sparse layer's experts.
fn is_expert_adapter(name: &str) -> bool {
    let router = name.contains(".mlp.gate.") || name.contains(".mlp.router.");
    (name.contains(".mlp.experts.") || router) && name.contains(".lora_")
}

/// `(E, out, r)` of an expert adapter's B of shape (out, E*r): PEFT stores its columns
/// rank-major, Horizon expert-major ([`expert_b_to_peft`]); `None` for any other tensor.
fn expert_b(layout: &ModelLayout, name: &str, shape: &[usize]) -> Option<(usize, usize, usize)> {
    let e = layout.moe.as_ref()?.num_experts;
    (is_expert_adapter(name) && name.contains(".mlp.experts.") && name.ends_with("lora_B.weight"))
        .then(|| (e, shape[0], shape[1] / e))
}

/// What the run's adapters are, as PEFT's config says it.
pub fn trained_of(layout: &ModelLayout, a: &AdapterConfig) -> peft::Trained {
    let lora = layout.adapter.as_ref().expect("an adapter layout");
    let ex = lora.experts;
    let router = lora.targets.iter().any(|t| t == ROUTER);
    let params = [ex.gate_up.is_some(), ex.down.is_some(), router]
        .into_iter()
        .zip(peft::EXPERT_PARAMS.into_iter().chain([peft::router_param(layout.is_gpt_oss())]))
        .filter(|(on, _)| *on)
        .map(|(_, p)| p.to_string())
        .collect();
    let gate_up_pattern =
        ex.gate_up.filter(|&(r, _)| r != a.r).map(|(r, _)| (r, a.alpha * r as f64 / a.r as f64));
    let modules = lora.targets.iter().filter(|t| *t != ROUTER).cloned().collect();
    peft::Trained { modules, params, gate_up_pattern }
}

/// The adapters of `params` as a PEFT adapter directory `dir` (`adapter_config.json`,
/// `adapter_model.safetensors` with PEFT's names), which `PeftModel.from_pretrained` loads.
pub fn write_adapter(
    layout: &ModelLayout,
    params: &ParamStore,
    a: &AdapterConfig,
    base_model: Option<&str>,
    dir: &Path,
) -> Result<()> {
    let owned: Vec<(String, Vec<usize>, Vec<f32>)> = layout
        .hf_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let data = params.tensor(layout, &name).expect("the layout names its own tensors");
            let data = match expert_b(layout, &name, &shape) {
                Some((e, out, r)) => expert_b_to_peft(data, e, out, r),
                None => data.to_vec(),
            };
            (format!("{PEFT_PREFIX}{name}"), shape, data)
        })
        .collect();
    let tensors: Vec<(String, Vec<usize>, &[f32])> =
        owned.iter().map(|(n, s, d)| (n.clone(), s.clone(), &d[..])).collect();
    peft::write(dir, a, &trained_of(layout, a), base_model, &tensors)?;
    peft::write_sidecar(dir, a, base_model.map(Path::new))
}

/// What PEFT puts before a model's own tensor names.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The tokenizer a config names for its text formats.
pub fn load_tokenizer(raw: &RawConfig) -> Result<Box<dyn Tokenizer>> {
    let dir = match (&raw.data.tokenizer, &raw.model.path) {
        (Some(t), _) if t == "byte" => return Ok(Box::new(ByteTokenizer::new())),
        (Some(t), _) => PathBuf::from(t),
        (None, Some(p)) => p.clone(),
        (None, None) => bail!(
            "data.format {:?} needs a tokenizer\nhint: set data.tokenizer to `byte` or to a directory with tokenizer.json",
            raw.data.format
        ),
    };
    Ok(Box::new(HfTokenizer::from_dir(&dir)?))
}

/// The adapter directory `src` names: itself, or a run directory's `final/`.
pub fn adapter_dir(src: &Path) -> Result<PathBuf> {
    for d in [src.to_path_buf(), src.join("final")] {
        if d.join("adapter_config.json").is_file() {
            return Ok(d);
        }
    }
    if src.join("config.json").is_file() || src.join("final/config.json").is_file() {
        bail!(
            "{}: a model, not an adapter: --merge needs an adapter run's OUT/final (or a PEFT adapter directory)\nhint: export without --merge to convert a model",
            src.display()
        );
    }
    bail!(
        "{}: no adapter_config.json here or in final/\nhint: --merge needs an adapter run's output directory, its final/, or a PEFT adapter directory",
        src.display()
    )
}

/// The key an adapter names its base by (PEFT's).
const BASE_KEY: &str = "base_model_name_or_path";

/// The base model directory of adapter `src`: `base` (a directory or a Hub id), else the
/// directory Horizon's note names, else the adapter's `base_model_name_or_path` (a directory,
/// or a Hub id in the local Hugging Face cache, at its `revision`).
fn run_base_dir(
    dir: &Path,
    adapter: &peft::PeftAdapter,
    sidecar: Option<&peft::Sidecar>,
    base: Option<&Path>,
) -> Result<PathBuf> {
    let named = match (base, sidecar.and_then(|s| s.base_model.clone())) {
        (Some(b), _) => Some(hub_cache::local_path("--base", b, "config.json")?),
        (None, Some(p)) if p.is_dir() => Some(p),
        // PEFT's name: a directory, or a Hub id (with its revision) in the local cache.
        _ => match adapter.base_model.as_deref() {
            Some(b) => {
                let (rev, env) = (adapter.revision.as_deref(), &hub_cache::process_env);
                let hub = hub_cache::resolve_value(BASE_KEY, b, rev, "config.json", env)?;
                Some(hub.map_or_else(|| PathBuf::from(b), |s| s.dir))
            }
            None => None,
        },
    };
    named.filter(|p| p.is_dir()).with_context(|| {
            format!(
                "{}: the base model is not a local directory ({})\nhint: pass --base DIR, the model the adapter was trained on",
                dir.display(),
                adapter.base_model.as_deref().unwrap_or("not named")
            )
        })
}

/// The model of adapter `src` over its base (`base`, or the one it names): the base frozen in
/// `base_dtype` (NF4 where the adapter was trained with QLoRA), the adapters from the
/// directory; and the base's directory.
pub fn load_adapter_run(
    src: &Path,
    base: Option<&Path>,
    base_dtype: BaseChoice,
) -> Result<(RunModel, PathBuf)> {
    let dir = adapter_dir(src)?;
    let adapter = peft::read(&dir)?;
    let sidecar = peft::read_sidecar(&dir)?;
    let base_dir = run_base_dir(&dir, &adapter, sidecar.as_ref(), base)?;
    let kind = match sidecar.as_ref().map(|s| s.kind.as_str()) {
        Some("qlora") => AdapterKind::Qlora,
        _ => AdapterKind::Lora,
    };
    // Expert parameters as the run's targets name them: PEFT's own names at r, or (its
    // rewrite, rank 2r) the gate and up projections.
    let mut targets = adapter.targets.clone();
    for p in &adapter.params {
        match (p.ends_with("gate_up_proj"), adapter.gate_up_pattern) {
            _ if p == peft::ROUTER_PARAM || p == peft::GPT_OSS_ROUTER_PARAM => {
                targets.push(ROUTER.into())
            }
            (true, Some(_)) => targets.extend(["gate_proj".into(), "up_proj".into()]),
            _ => targets.push(p.clone()),
        }
    }
    let a = AdapterConfig {
        kind,
        r: adapter.r,
        alpha: adapter.alpha,
        rslora: adapter.rslora,
        targets,
        init: Some(dir.clone()),
        base_dtype,
    };
    let yaml = format!("model: {{ path: '{}' }}\ndata: {{ path: unused }}\n", base_dir.display());
    let raw = RawConfig::from_yaml(&yaml, &dir.display().to_string())?;
    Ok((load_run_model(&raw, Some(&a))?, base_dir))
}
