//! PEFT's LoRA adapter directory, as `peft` saves and loads it: `adapter_config.json` (the keys
//! of PEFT's `LoraConfig`) and `adapter_model.safetensors`, tensors named
//! `base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight`, A (r, in),
//! B (out, r). Reading refuses, by file and key, every variant Horizon does not implement;
//! [`check_against`] holds an `adapter.init` to the run's config and model; [`write`] writes a
//! directory PEFT loads, and [`write_sidecar`] Horizon's note beside it (what PEFT's files do
//! not say: whether the base was quantised, and where it is).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Map, Value, json};

use serde::{Deserialize, Serialize};

use super::config::{AdapterConfig, AdapterKind, TARGETS};
use crate::hf::checkpoint::{SaveDtype, list_tensors, read_tensor_f64, write_safetensors};
use crate::hf::hub_cache;

/// The adapter's configuration file.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The adapter's tensors.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// `peft_version` of the directories [`write`] writes: the PEFT release whose format this is.
pub const PEFT_VERSION: &str = "0.21.2";
const LAYERS_PREFIX: &str = "base_model.model.model.layers.";

/// The module path of a LoRA target inside a decoder layer (`q_proj` -> `self_attn.q_proj`,
/// `gate_proj` -> `mlp.gate_proj`); `None` for a name that is not one of [`TARGETS`].
pub fn module_path(target: &str) -> Option<&'static str> {
    Some(match target {
        "q_proj" => "self_attn.q_proj",
        "k_proj" => "self_attn.k_proj",
        "v_proj" => "self_attn.v_proj",
        "o_proj" => "self_attn.o_proj",
        "gate_proj" => "mlp.gate_proj",
        "up_proj" => "mlp.up_proj",
        "down_proj" => "mlp.down_proj",
        _ => return None,
    })
}

/// PEFT's name of layer `layer`'s `target` A (`b` false) or B (`b` true) tensor.
///
/// # Panics
/// When [`module_path`] does not know `target` (callers check targets first).
pub fn tensor_name(layer: usize, target: &str, b: bool) -> String {
    let path = module_path(target)
        .unwrap_or_else(|| panic!("tensor_name: '{target}' is not a LoRA target"));
    let ab = if b { "lora_B" } else { "lora_A" };
    format!("{LAYERS_PREFIX}{layer}.{path}.{ab}.weight")
}

/// `(layer, target, b)` of a PEFT LoRA tensor name; `None` for any other name.
fn parse_name(name: &str) -> Option<(usize, &'static str, bool)> {
    let (layer, rest) = name.strip_prefix(LAYERS_PREFIX)?.split_once('.')?;
    let layer_no: usize = layer.parse().ok()?;
    if layer_no.to_string() != layer {
        return None;
    }
    let (module, ab) = rest.strip_suffix(".weight")?.rsplit_once('.')?;
    let b = match ab {
        "lora_A" => false,
        "lora_B" => true,
        _ => return None,
    };
    let target = TARGETS.into_iter().find(|t| module_path(t) == Some(module))?;
    Some((layer_no, target, b))
}

/// PEFT's `target_parameters` Horizon trains: a sparse layer's routed experts (transformers 5's
/// fused 3-D parameters), each with one rank-r adapter per expert.
pub const EXPERT_PARAMS: [&str; 2] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];

/// PEFT's `target_parameters` entry of a sparse layer's router (a 2-D parameter: one adapter,
/// tensors `mlp.gate.lora_A.weight` (r, C) and `mlp.gate.lora_B.weight` (E, r)).
pub const ROUTER_PARAM: &str = "mlp.gate.weight";
/// gpt-oss's router parameter (`GptOssTopKRouter.weight`): tensors `mlp.router.lora_{A,B}.weight`.
pub const GPT_OSS_ROUTER_PARAM: &str = "mlp.router.weight";

/// The router parameter of a model whose layers hold `router_weight` (`mlp.router.weight` for
/// gpt-oss, else [`ROUTER_PARAM`]).
pub fn router_param(gpt_oss: bool) -> &'static str {
    if gpt_oss { GPT_OSS_ROUTER_PARAM } else { ROUTER_PARAM }
}

/// PEFT's `rank_pattern` / `alpha_pattern` key of the gate|up expert parameter (what PEFT adds
/// when it rewrites `gate_proj` + `up_proj` into it: rank 2r, alpha 2 alpha).
pub const GATE_UP_PATTERN: &str = ".*\\.gate_up_proj";

/// `(layer, b)` of an expert adapter tensor name (`...layers.{l}.mlp.experts[.base_layer].
/// lora_{A|B}.weight`); `None` for any other name.
fn parse_expert_name(name: &str) -> Option<(usize, bool)> {
    let (layer, rest) = name.strip_prefix(LAYERS_PREFIX)?.split_once('.')?;
    let layer_no: usize = layer.parse().ok()?;
    let ab = rest
        .strip_prefix("mlp.experts.base_layer.")
        .or_else(|| rest.strip_prefix("mlp.experts."))
        .or_else(|| rest.strip_prefix("mlp.gate."))
        .or_else(|| rest.strip_prefix("mlp.router."))?
        .strip_suffix(".weight")?;
    let b = match ab {
        "lora_A" => false,
        "lora_B" => true,
        _ => return None,
    };
    (layer_no.to_string() == layer).then_some((layer_no, b))
}

/// What a run trains, as PEFT's config says it: the target modules, the expert parameters
/// (`EXPERT_PARAMS` entries) and the gate|up expert adapter's (rank, alpha) where it differs
/// from the others'.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trained {
    pub modules: Vec<String>,
    pub params: Vec<String>,
    pub gate_up_pattern: Option<(usize, f64)>,
}

/// Adapter tensors by PEFT name: (shape, values).
pub type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// A PEFT LoRA adapter, read whole (adapters are small).
#[derive(Clone, Debug, PartialEq)]
pub struct PeftAdapter {
    pub r: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// `use_rslora`.
    pub rslora: bool,
    /// `target_modules`, in the file's order.
    pub targets: Vec<String>,
    /// `target_parameters` (each one of [`EXPERT_PARAMS`]), and the gate|up one's rank and
    /// alpha pattern.
    pub params: Vec<String>,
    pub gate_up_pattern: Option<(usize, f64)>,
    /// `base_model_name_or_path`.
    pub base_model: Option<String>,
    /// `revision`: the base's revision when it is a Hub id.
    pub revision: Option<String>,
    /// PEFT name -> (shape, values); read from F32, BF16, F16 or F64 (rounded to f32).
    pub tensors: Tensors,
}

impl PeftAdapter {
    /// Decoder layers the adapter covers (one past the highest layer index of its tensors).
    pub fn layers(&self) -> usize {
        let layer =
            |n: &String| parse_name(n).map(|(l, _, _)| l).or(parse_expert_name(n).map(|(l, _)| l));
        self.tensors.keys().filter_map(layer).map(|l| l + 1).max().unwrap_or(0)
    }
}

/// Reads the PEFT adapter directory `dir`, refusing what Horizon does not implement (DoRA,
/// `fan_in_fan_out`, biases, per-module ranks or alphas, ...) and any tensor that is not the A
/// or B of a target module, naming the file and the key or tensor.
pub fn read(dir: &Path) -> Result<PeftAdapter> {
    let config = dir.join(CONFIG_FILE);
    let keys = JsonConfig::read(&config)?.lora_keys()?;
    let tensors = read_tensors(&dir.join(WEIGHTS_FILE), &config, &keys)?;
    Ok(PeftAdapter {
        r: keys.r,
        alpha: keys.alpha,
        rslora: keys.rslora,
        targets: keys.targets,
        params: keys.params,
        gate_up_pattern: keys.gate_up_pattern,
        base_model: keys.base_model,
        revision: keys.revision,
        tensors,
    })
}

/// What Horizon uses of `adapter_config.json`.
struct LoraKeys {
    r: usize,
    alpha: f64,
    rslora: bool,
    targets: Vec<String>,
    params: Vec<String>,
    gate_up_pattern: Option<(usize, f64)>,
    base_model: Option<String>,
    revision: Option<String>,
}

/// `adapter_config.json`, parsed; its accessors name the file and key in errors. An absent or
/// `null` key takes PEFT's default.
struct JsonConfig<'a> {
    path: &'a Path,
    map: Map<String, Value>,
}

/// Keys that must be false, and what `true` would ask for.
const UNSUPPORTED_FLAGS: [(&str, &str); 4] = [
    ("use_dora", "DoRA (weight-decomposed LoRA)"),
    ("fan_in_fan_out", "transposed (Conv1D) base weights"),
    ("lora_bias", "a bias on lora_B"),
    ("use_qalora", "QA-LoRA"),
];

/// Keys that must be empty (`{}`, `[]` or null), and what a value would ask for
/// (`rank_pattern` and `alpha_pattern` may hold the gate|up experts' entry alone).
const UNSUPPORTED_NON_EMPTY: [(&str, &str); 4] = [
    ("rank_pattern", "a different r for some modules"),
    ("alpha_pattern", "a different lora_alpha for some modules"),
    ("modules_to_save", "fully trained modules beside the adapter"),
    ("layers_to_transform", "an adapter on only some layers"),
];

impl<'a> JsonConfig<'a> {
    fn read(path: &'a Path) -> Result<Self> {
        let text = fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read {}\nhint: a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}",
                path.display()
            )
        })?;
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        let Value::Object(map) = value else {
            bail!("{}: not a JSON object", path.display());
        };
        Ok(JsonConfig { path, map })
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn err(&self, key: &str, msg: impl std::fmt::Display) -> anyhow::Error {
        anyhow!("{}: {key} {msg}", self.path.display())
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => {
                v.as_bool().ok_or_else(|| self.err(key, format!("is {v}, not true or false")))
            }
        }
    }

    fn number(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.err(key, format!("is {v}, not a number"))),
        }
    }

    fn string(&self, key: &str) -> Result<Option<String>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.err(key, format!("is {v}, not a string"))),
        }
    }

    fn lora_keys(&self) -> Result<LoraKeys> {
        self.check_supported()?;
        let r = match self.get("r") {
            None => 8,
            Some(v) => v
                .as_u64()
                .filter(|&r| r >= 1)
                .ok_or_else(|| self.err("r", format!("is {v}, not a rank of at least 1")))?
                as usize,
        };
        let alpha = self.number("lora_alpha", 8.0)?;
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(self.err("lora_alpha", format!("is {alpha}, not a positive number")));
        }
        let rslora = self.bool("use_rslora", false)?;
        let params = self.params()?;
        let targets = self.targets(!params.is_empty())?;
        let gate_up_pattern = self.gate_up_pattern(r, alpha)?;
        let base_model = self.string("base_model_name_or_path")?;
        let revision = self.string("revision")?;
        Ok(LoraKeys { r, alpha, rslora, targets, params, gate_up_pattern, base_model, revision })
    }

    /// `target_parameters`: a list of [`EXPERT_PARAMS`] and [`ROUTER_PARAM`] entries (PEFT's
    /// matching: the path equals the entry or ends with `.` + it).
    fn params(&self) -> Result<Vec<String>> {
        let list = match self.get("target_parameters") {
            None => return Ok(Vec::new()),
            Some(Value::Array(a)) => a,
            Some(v) => return Err(self.err("target_parameters", format!("is {v}, not a list"))),
        };
        let mut params = Vec::new();
        for v in list {
            let entry = v.as_str().unwrap_or("");
            let full = EXPERT_PARAMS
                .into_iter()
                .chain([ROUTER_PARAM, GPT_OSS_ROUTER_PARAM])
                .find(|p| !entry.is_empty() && (*p == entry || p.ends_with(&format!(".{entry}"))));
            let Some(full) = full else {
                return Err(self.err(
                    "target_parameters",
                    format!(
                        "names {v}; supported: {} (the routed experts), {ROUTER_PARAM} or {GPT_OSS_ROUTER_PARAM} (the router)",
                        EXPERT_PARAMS.join(", ")
                    ),
                ));
            };
            if !params.iter().any(|p| p == full) {
                params.push(full.to_string());
            }
        }
        Ok(params)
    }

    /// The gate|up experts' `rank_pattern` / `alpha_pattern` entry (the only one accepted).
    fn gate_up_pattern(&self, r: usize, alpha: f64) -> Result<Option<(usize, f64)>> {
        let entry = |key: &str| -> Result<Option<f64>> {
            match self.get(key) {
                None => Ok(None),
                Some(Value::Object(m)) if m.is_empty() => Ok(None),
                Some(Value::Object(m)) if m.len() == 1 && m.contains_key(GATE_UP_PATTERN) => {
                    let v = &m[GATE_UP_PATTERN];
                    v.as_f64().filter(|x| *x > 0.0).map(Some).ok_or_else(|| {
                        self.err(key, format!("gives {GATE_UP_PATTERN} {v}, not a positive number"))
                    })
                }
                Some(v) => Err(self.err(
                    key,
                    format!(
                        "is {v}: a different r or alpha per module is not supported (only \
                         PEFT's {GATE_UP_PATTERN} entry, the gate|up experts')"
                    ),
                )),
            }
        };
        let (rank, a) = (entry("rank_pattern")?, entry("alpha_pattern")?);
        if rank.is_none() && a.is_none() {
            return Ok(None);
        }
        Ok(Some((rank.map_or(r, |x| x as usize), a.unwrap_or(alpha))))
    }

    /// Refuses every variant Horizon does not train.
    fn check_supported(&self) -> Result<()> {
        match self.string("peft_type")? {
            Some(t) if t == "LORA" => {}
            Some(t) => {
                return Err(self.err("peft_type", format!("is \"{t}\"; only LORA is supported")));
            }
            None => return Err(self.err("peft_type", "is missing (not a PEFT adapter config?)")),
        }
        for (key, what) in UNSUPPORTED_FLAGS {
            if self.bool(key, false)? {
                return Err(self.err(key, format!("is true ({what}): not supported")));
            }
        }
        if let Some(bias) = self.string("bias")?.filter(|b| b != "none") {
            return Err(self.err(
                "bias",
                format!("is \"{bias}\": training biases is not supported (only \"none\")"),
            ));
        }
        for (key, what) in UNSUPPORTED_NON_EMPTY {
            if key.ends_with("_pattern") {
                continue; // checked by `gate_up_pattern`
            }
            let empty = match self.get(key) {
                None => true,
                Some(Value::Object(m)) => m.is_empty(),
                Some(Value::Array(a)) => a.is_empty(),
                Some(_) => false,
            };
            if !empty {
                let v = &self.map[key];
                return Err(self.err(key, format!("is {v} ({what}): not supported")));
            }
        }
        Ok(())
    }

    /// `target_modules`; it may be absent or empty when `target_parameters` is not
    /// (`has_params`).
    fn targets(&self, has_params: bool) -> Result<Vec<String>> {
        let known = TARGETS.join(", ");
        let list = match self.get("target_modules") {
            None if has_params => return Ok(Vec::new()),
            None => return Err(self.err("target_modules", "is missing")),
            Some(Value::String(s)) => {
                return Err(self.err(
                    "target_modules",
                    format!("is the pattern \"{s}\": only a list of names is supported ({known})"),
                ));
            }
            Some(Value::Array(a)) => a,
            Some(v) => return Err(self.err("target_modules", format!("is {v}, not a list"))),
        };
        let mut targets = Vec::new();
        for v in list {
            let t = v.as_str().filter(|t| module_path(t).is_some()).ok_or_else(|| {
                self.err("target_modules", format!("names {v}, which is not one of {known}"))
            })?;
            if !targets.iter().any(|x| x == t) {
                targets.push(t.to_string());
            }
        }
        if targets.is_empty() && !has_params {
            return Err(self.err("target_modules", "is empty"));
        }
        Ok(targets)
    }
}

/// The tensors of `path`: each the A or B of a target, its r the config's, every layer up to
/// the highest complete.
fn read_tensors(path: &Path, config: &Path, keys: &LoraKeys) -> Result<Tensors> {
    if !path.is_file() {
        bail!(
            "{}: no such file\nhint: a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}",
            path.display()
        );
    }
    let names = list_tensors(path)?;
    let mut tensors = BTreeMap::new();
    for name in names {
        if !keys.params.is_empty() && parse_expert_name(&name).is_some() {
            // Its shape is checked against the model's experts (`check_against`).
            let (shape, values) = read_tensor_f64(path, &name)?;
            tensors.insert(name, (shape, values.into_iter().map(|x| x as f32).collect()));
            continue;
        }
        let Some((_, _, b)) =
            parse_name(&name).filter(|(_, t, _)| keys.targets.iter().any(|x| x.as_str() == *t))
        else {
            bail!(
                "{}: tensor '{name}' is not the lora_A or lora_B weight of a target module ({} in {})\nhint: PEFT names them like '{}'",
                path.display(),
                keys.targets.join(", "),
                config.display(),
                keys.targets.first().map_or(
                    format!("{LAYERS_PREFIX}0.mlp.experts.lora_A.weight"),
                    |t| tensor_name(0, t, false)
                )
            );
        };
        let (shape, values) = read_tensor_f64(path, &name)?;
        check_rank(&shape, keys.r, b).map_err(|want| {
            anyhow!(
                "{}: tensor '{name}' has shape {shape:?} but {} has r {}: {want}",
                path.display(),
                config.display(),
                keys.r
            )
        })?;
        tensors.insert(name, (shape, values.into_iter().map(|x| x as f32).collect()));
    }
    check_complete(path, &tensors, &keys.targets)?;
    Ok(tensors)
}

/// `Err(what the shape should be)` unless a 2-D A has r rows or a 2-D B r columns.
fn check_rank(shape: &[usize], r: usize, b: bool) -> std::result::Result<(), &'static str> {
    match (shape, b) {
        ([rows, _], false) if *rows == r => Ok(()),
        ([_, cols], true) if *cols == r => Ok(()),
        (_, false) => Err("lora_A is (r, in)"),
        (_, true) => Err("lora_B is (out, r)"),
    }
}

/// Every target of every layer up to the highest one present has both its A and its B.
fn check_complete(path: &Path, tensors: &Tensors, targets: &[String]) -> Result<()> {
    if tensors.is_empty() {
        bail!("{}: holds no LoRA tensors", path.display());
    }
    let layers = tensors.keys().filter_map(|n| parse_name(n)).map(|(l, _, _)| l + 1).max();
    let Some(layers) = layers else {
        return Ok(()); // expert adapters alone
    };
    for layer in 0..layers {
        for t in targets {
            for (b, ab) in [(false, "lora_A"), (true, "lora_B")] {
                let name = tensor_name(layer, t, b);
                if !tensors.contains_key(&name) {
                    bail!(
                        "{}: layer {layer}'s {t} has no {ab} (no tensor '{name}')\nhint: every target module of every layer needs both lora_A and lora_B",
                        path.display()
                    );
                }
            }
        }
    }
    Ok(())
}

/// Checks an `adapter.init` adapter against the run: its r, lora_alpha, use_rslora, targets and
/// expert parameters against `cfg` and `want`, its layers against `layers`, every module
/// tensor's shape against `shapes(layer, target)` = the model's `(out, in)` for that projection
/// (`None`: the model has no such projection), and its expert tensors against `experts` (PEFT
/// name -> shape, every one the run trains).
pub fn check_against(
    adapter: &PeftAdapter,
    cfg: &AdapterConfig,
    want: &Trained,
    shapes: impl Fn(usize, &str) -> Option<(usize, usize)>,
    experts: &BTreeMap<String, Vec<usize>>,
    layers: usize,
) -> Result<()> {
    let dir = cfg.init.as_deref().unwrap_or(Path::new(""));
    check_hyper(adapter, cfg, want, &dir.join(CONFIG_FILE))?;
    let weights = dir.join(WEIGHTS_FILE);
    let base = match &adapter.base_model {
        Some(b) if !b.is_empty() => format!(" ({b})"),
        _ => String::new(),
    };
    let hint = format!(
        "hint: the adapter was made for a different base model{base}; use that model, or start without adapter.init"
    );
    if adapter.layers() != layers {
        bail!(
            "{}: LoRA tensors for {} layers but the model has {layers}\n{hint}",
            weights.display(),
            adapter.layers()
        );
    }
    let mut expected = BTreeSet::new();
    for layer in 0..layers {
        for t in &want.modules {
            let Some((out, inp)) = shapes(layer, t) else {
                bail!(
                    "adapter.targets names '{t}' but the model has no {t} in layer {layer}\nhint: list only projections this model has"
                );
            };
            for (b, shape) in [(false, [cfg.r, inp]), (true, [out, cfg.r])] {
                let name = tensor_name(layer, t, b);
                check_shape(adapter, &name, &shape, &weights, &hint)?;
                expected.insert(name);
            }
        }
    }
    for (name, shape) in experts {
        check_shape(adapter, name, shape, &weights, &hint)?;
        expected.insert(name.clone());
    }
    if let Some(extra) = adapter.tensors.keys().find(|n| !expected.contains(*n)) {
        bail!("{}: tensor '{extra}' is not one the run trains", weights.display());
    }
    Ok(())
}

/// The adapter holds tensor `name` with shape `want`.
fn check_shape(
    adapter: &PeftAdapter,
    name: &str,
    want: &[usize],
    weights: &Path,
    hint: &str,
) -> Result<()> {
    let got = adapter.tensors.get(name).map(|(s, _)| s.as_slice());
    if got != Some(want) {
        let got = got.map_or("no such tensor".to_string(), |s| format!("shape {s:?}"));
        bail!(
            "{}: tensor '{name}' has {got} but the model needs {want:?}\n{hint}",
            weights.display()
        );
    }
    Ok(())
}

/// r, lora_alpha, use_rslora, the targets and the expert parameters (as sets) of `adapter`
/// against the run's.
fn check_hyper(
    adapter: &PeftAdapter,
    cfg: &AdapterConfig,
    want: &Trained,
    config: &Path,
) -> Result<()> {
    let src = config.display();
    let hint = "or start without adapter.init";
    if adapter.r != cfg.r {
        bail!(
            "adapter.r is {} but {src} has r {}\nhint: set adapter.r: {} {hint}",
            cfg.r,
            adapter.r,
            adapter.r
        );
    }
    if adapter.alpha != cfg.alpha {
        bail!(
            "adapter.alpha is {} but {src} has lora_alpha {}\nhint: set adapter.alpha: {} {hint}",
            cfg.alpha,
            adapter.alpha,
            adapter.alpha
        );
    }
    if adapter.rslora != cfg.rslora {
        bail!(
            "adapter.rslora is {} but {src} has use_rslora {}\nhint: set adapter.rslora: {} {hint}",
            cfg.rslora,
            adapter.rslora,
            adapter.rslora
        );
    }
    if let Some(t) = want.modules.iter().find(|t| module_path(t).is_none()) {
        bail!("adapter.targets names '{t}', which is not a LoRA target ({})", TARGETS.join(", "));
    }
    let set = |v: &[String]| -> BTreeSet<String> { v.iter().cloned().collect() };
    if set(&want.modules) != set(&adapter.targets) || set(&want.params) != set(&adapter.params) {
        let got: Vec<String> = set(&adapter.targets).into_iter().collect();
        bail!(
            "adapter.targets is [{}] but {src} has target_modules [{}] and target_parameters [{}]\nhint: set adapter.targets: [{}] (`experts` for both expert parameters) {hint}",
            cfg.targets.join(", "),
            got.join(", "),
            adapter.params.join(", "),
            got.iter()
                .cloned()
                .chain(adapter.params.iter().cloned())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if want.gate_up_pattern != adapter.gate_up_pattern {
        bail!(
            "{src}: the gate|up experts' rank and alpha ({:?}) differ from the run's ({:?})\nhint: PEFT gives them 2r and 2 alpha when gate_proj and up_proj are targeted: list gate_proj and up_proj, or `experts` for r and alpha {hint}",
            adapter.gate_up_pattern,
            want.gate_up_pattern
        );
    }
    Ok(())
}

/// Writes a PEFT adapter directory: `adapter_model.safetensors` (F32, `tensors` in the given
/// order, each a LoRA A or B of `cfg.targets` with rank `cfg.r`) and `adapter_config.json` with
/// PEFT's keys, each file atomically (a temporary sibling, fsync, rename); the weights first, so
/// a directory with a config always has its weights. `dir` is created if needed.
pub fn write(
    dir: &Path,
    cfg: &AdapterConfig,
    trained: &Trained,
    base_model: Option<&str>,
    tensors: &[(String, Vec<usize>, &[f32])],
) -> Result<()> {
    for (name, shape, _) in tensors {
        if !trained.params.is_empty() && parse_expert_name(name).is_some() {
            continue;
        }
        let Some((_, t, b)) =
            parse_name(name).filter(|(_, t, _)| trained.modules.iter().any(|x| x.as_str() == *t))
        else {
            bail!(
                "writing {}: '{name}' is not a LoRA tensor of adapter.targets ({})",
                dir.display(),
                trained.modules.join(", ")
            );
        };
        check_rank(shape, cfg.r, b).map_err(|want| {
            anyhow!(
                "writing {}: {t} tensor '{name}' has shape {shape:?} but r is {}: {want}",
                dir.display(),
                cfg.r
            )
        })?;
    }
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_safetensors(&dir.join(WEIGHTS_FILE), tensors, SaveDtype::F32)?;
    let mut text = serde_json::to_string_pretty(&peft_config(cfg, trained, base_model))?;
    text.push('\n');
    write_atomic(&dir.join(CONFIG_FILE), text.as_bytes())?;
    let d = fs::File::open(dir).with_context(|| format!("cannot open {}", dir.display()))?;
    d.sync_all().with_context(|| format!("cannot sync {}", dir.display()))
}

/// `adapter_config.json`: PEFT's own keys only, so that `PeftModel.from_pretrained` loads it.
fn peft_config(cfg: &AdapterConfig, trained: &Trained, base_model: Option<&str>) -> Value {
    // PEFT writes an integral lora_alpha as an integer.
    let number = |x: f64| {
        if x.fract() == 0.0 && x.abs() < 2f64.powi(53) { json!(x as i64) } else { json!(x) }
    };
    let alpha = number(cfg.alpha);
    let (mut ranks, mut alphas) = (Map::new(), Map::new());
    if let Some((r, a)) = trained.gate_up_pattern {
        ranks.insert(GATE_UP_PATTERN.into(), json!(r));
        alphas.insert(GATE_UP_PATTERN.into(), number(a));
    }
    let params = (!trained.params.is_empty()).then(|| trained.params.clone());
    // A base in the Hugging Face cache is named as PEFT names it: its Hub id and commit.
    let hub = base_model.and_then(|b| hub_cache::id_of_snapshot_dir(Path::new(b)));
    let (base_model, revision) = match hub {
        Some((repo, commit)) => (Some(repo), Some(commit)),
        None => (base_model.map(str::to_string), None),
    };
    json!({
        "alpha_pattern": alphas,
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": alpha,
        "lora_bias": false,
        "lora_dropout": 0.0,
        "modules_to_save": null,
        "peft_type": "LORA",
        "peft_version": PEFT_VERSION,
        "r": cfg.r,
        "rank_pattern": ranks,
        "revision": revision,
        "target_modules": trained.modules,
        "target_parameters": params,
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": cfg.rslora,
    })
}

/// Writes `bytes` to a temporary sibling of `path`, syncs it and renames it over `path`.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| -> std::io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })()
    .with_context(|| format!("writing {}", tmp.display()));
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, path).with_context(|| {
        let _ = fs::remove_file(&tmp);
        format!("renaming {} to {}", tmp.display(), path.display())
    })
}

/// Horizon's note beside a PEFT adapter's files.
pub const SIDECAR: &str = "horizon_adapter.json";

/// What PEFT's files do not say about an adapter run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Sidecar {
    /// `lora` or `qlora`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The base model directory (`model.path`), when the run had one.
    pub base_model: Option<PathBuf>,
}

/// Write the sidecar of an adapter run into `dir`.
pub fn write_sidecar(dir: &Path, a: &AdapterConfig, base: Option<&Path>) -> Result<()> {
    let kind = match a.kind {
        AdapterKind::Lora => "lora",
        AdapterKind::Qlora => "qlora",
    };
    let s = Sidecar { kind: kind.into(), base_model: base.map(Path::to_path_buf) };
    let path = dir.join(SIDECAR);
    fs::write(&path, serde_json::to_string_pretty(&s)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Horizon's note in adapter directory `dir`, if it has one.
pub fn read_sidecar(dir: &Path) -> Result<Option<Sidecar>> {
    let path = dir.join(SIDECAR);
    match fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .with_context(|| format!("{}: not a Horizon adapter note", path.display())),
        Err(_) => Ok(None),
    }
}
