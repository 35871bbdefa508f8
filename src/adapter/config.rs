//! The `adapter:` section: [`AdapterSection`] as written in the YAML (serde, unknown keys
//! refused, defaults documented), validated into [`AdapterConfig`] (`None` for full
//! fine-tuning).

use std::collections::BTreeSet;
use std::path::PathBuf;

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// Every projection LoRA can target, in a decoder layer's order (the default `targets`).
pub const TARGETS: [&str; 7] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// `adapter.type`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AdapterType {
    /// Full fine-tuning: every weight trains, no adapter.
    #[default]
    None,
    /// LoRA over a frozen base kept as `base_dtype`.
    Lora,
    /// LoRA over a frozen base whose targeted projections are quantised to NF4.
    Qlora,
}

/// The kind of an adapter run (`adapter.type` other than `none`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterKind {
    Lora,
    Qlora,
}

/// `adapter.base_dtype`: how the frozen base is held (for `qlora`, its unquantised parts).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BaseDtype {
    /// As the checkpoint stores it.
    #[default]
    Auto,
    Bf16,
    Fp32,
}

/// The `adapter:` section as written.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdapterSection {
    /// `none` (full fine-tuning), `lora` or `qlora`. Default none.
    #[serde(rename = "type")]
    pub kind: AdapterType,
    /// Rank of A (r, in) and B (out, r). Default 16.
    pub r: usize,
    /// The update is scaled by `alpha / r` (`alpha / sqrt(r)` with `rslora`). Default 32 (2r,
    /// as axolotl and most recipes; PEFT's own default is 8).
    pub alpha: f64,
    /// Rank-stabilised LoRA: scale by `alpha / sqrt(r)`. Default false.
    pub rslora: bool,
    /// Projections to adapt (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
    /// `down_proj`); the model refuses names it does not have. Default all seven.
    pub targets: Vec<String>,
    /// Start from this PEFT adapter directory (`adapter_config.json` +
    /// `adapter_model.safetensors`) instead of PEFT's default init. Relative paths are taken
    /// from the working directory. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init: Option<PathBuf>,
    /// The frozen base's dtype: `auto` (as the checkpoint stores it), `bf16` or `fp32`.
    /// Default auto.
    pub base_dtype: BaseDtype,
}

impl Default for AdapterSection {
    fn default() -> Self {
        AdapterSection {
            kind: AdapterType::None,
            r: 16,
            alpha: 32.0,
            rslora: false,
            targets: TARGETS.iter().map(|t| t.to_string()).collect(),
            init: None,
            base_dtype: BaseDtype::Auto,
        }
    }
}

/// A validated adapter configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterConfig {
    pub kind: AdapterKind,
    pub r: usize,
    pub alpha: f64,
    pub rslora: bool,
    /// Distinct, non-empty, in the config's order.
    pub targets: Vec<String>,
    /// An existing directory.
    pub init: Option<PathBuf>,
    pub base_dtype: BaseDtype,
}

impl AdapterConfig {
    /// The scale `s` of the update: `alpha / r`, or `alpha / sqrt(r)` with `rslora` (in f64,
    /// then rounded to f32).
    pub fn scale(&self) -> f32 {
        let r = self.r as f64;
        let s = if self.rslora { self.alpha / r.sqrt() } else { self.alpha / r };
        s as f32
    }
}

impl AdapterSection {
    /// Whether this is the section of a config without one (full fine-tuning; not printed).
    pub fn is_default(&self) -> bool {
        *self == AdapterSection::default()
    }

    /// Validate: `None` for `type: none`. `origin` names the config file in errors.
    pub fn resolve(&self, origin: &str) -> Result<Option<AdapterConfig>> {
        let kind = match self.kind {
            AdapterType::None => return Ok(None),
            AdapterType::Lora => AdapterKind::Lora,
            AdapterType::Qlora => AdapterKind::Qlora,
        };
        if self.r == 0 {
            bail!("{origin}: adapter.r must be at least 1 (got 0)");
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            bail!("{origin}: adapter.alpha must be a positive number (got {})", self.alpha);
        }
        self.check_targets(origin)?;
        if let Some(dir) = &self.init {
            check_init_dir(dir, origin)?;
        }
        Ok(Some(AdapterConfig {
            kind,
            r: self.r,
            alpha: self.alpha,
            rslora: self.rslora,
            targets: self.targets.clone(),
            init: self.init.clone(),
            base_dtype: self.base_dtype,
        }))
    }

    fn check_targets(&self, origin: &str) -> Result<()> {
        if self.targets.is_empty() {
            bail!(
                "{origin}: adapter.targets is empty\nhint: list the projections to adapt, e.g. [q_proj, v_proj], or leave the key out for all seven ({})",
                TARGETS.join(", ")
            );
        }
        let mut seen = BTreeSet::new();
        for t in &self.targets {
            if !seen.insert(t.as_str()) {
                bail!(
                    "{origin}: adapter.targets names '{t}' twice\nhint: list each projection once"
                );
            }
        }
        Ok(())
    }
}

fn check_init_dir(dir: &std::path::Path, origin: &str) -> Result<()> {
    let hint = "hint: adapter.init is a PEFT adapter directory (adapter_config.json + adapter_model.safetensors); relative paths are taken from the working directory";
    if !dir.exists() {
        bail!("{origin}: adapter.init: {} does not exist\n{hint}", dir.display());
    }
    if !dir.is_dir() {
        bail!("{origin}: adapter.init: {} is not a directory\n{hint}", dir.display());
    }
    Ok(())
}
