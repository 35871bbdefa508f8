//! `horizon export SRC --merge`: an adapter run's result as a plain HF model, each adapted
//! weight `W + s · B A` (for QLoRA, W is the dequantised NF4 base: the weights the adapters were
//! trained against), every other tensor the base's own; written like any export.
//!
//! SRC is an adapter directory: an adapter run's `OUT/final/` (or the run directory holding
//! it), or any PEFT LoRA adapter directory. Horizon writes `horizon_adapter.json` beside PEFT's
//! files, saying whether the base was quantised and where it is; for a foreign PEFT directory
//! the base is `base_model_name_or_path` (a local directory) or `--base`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::adapter::{AdapterConfig, AdapterKind, BaseDtype as BaseChoice, peft};
use crate::config::RawConfig;
use crate::export::{ExportOptions, ExportSource, Exported, TokenizerSource, export_model};
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::model::spec::Op;
use crate::train::{RunModel, load_run_model};

/// The adapter directory `src` names: itself, or a run directory's `final/`.
fn adapter_dir(src: &Path) -> Result<PathBuf> {
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

/// `horizon export SRC --merge --out DIR`.
pub fn merge_dir(
    src: &Path,
    base: Option<&Path>,
    out: &Path,
    opts: ExportOptions,
) -> Result<Exported> {
    let (run, base_dir) = load_adapter_run(src, base, BaseChoice::Fp32)?;
    let merged = merged_params(&run);
    let tokenizer = if base_dir.join("tokenizer.json").is_file() {
        TokenizerSource::Dir(base_dir.clone())
    } else {
        TokenizerSource::None
    };
    let source = ExportSource { tokenizer, model_dir: Some(base_dir) };
    export_model(&run.cfg, &merged, out, opts, &source)
}

/// The base model directory of adapter `src`: `base`, else the one Horizon's note or the
/// adapter's `base_model_name_or_path` names (it must be a local directory).
fn run_base_dir(
    dir: &Path,
    adapter: &peft::PeftAdapter,
    sidecar: Option<&peft::Sidecar>,
    base: Option<&Path>,
) -> Result<PathBuf> {
    base.map(Path::to_path_buf)
        .or_else(|| sidecar.and_then(|s| s.base_model.clone()))
        .or_else(|| adapter.base_model.as_ref().map(PathBuf::from))
        .filter(|p| p.is_dir())
        .with_context(|| {
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
    let a = AdapterConfig {
        kind,
        r: adapter.r,
        alpha: adapter.alpha,
        rslora: adapter.rslora,
        targets: adapter.targets.clone(),
        init: Some(dir.clone()),
        base_dtype,
    };
    let yaml = format!("model: {{ path: '{}' }}\ndata: {{ path: unused }}\n", base_dir.display());
    let raw = RawConfig::from_yaml(&yaml, &dir.display().to_string())?;
    Ok((load_run_model(&raw, Some(&a))?, base_dir))
}

/// The full model's parameters: the base (dequantised where it is NF4), each adapted weight
/// plus `s · B A` (summed in f64, rounded once to fp32).
pub fn merged_params(run: &RunModel) -> ParamStore {
    let full = crate::model::describe(&run.cfg);
    let base = run.base.as_ref().expect("an adapter run has a base");
    let mut out = ParamStore::zeros(&full);
    base.embed.get(0, &mut out.embed);
    base.final_norm.get(0, &mut out.final_norm);
    if let (Some(h), Some(dst)) = (&base.lm_head, out.lm_head.as_mut()) {
        h.get(0, dst);
    }
    for i in 0..full.dims.layers {
        let spec = run.layout.layer(i);
        for t in spec.frozen_tensors() {
            let name = ModelLayout::layer_name(i, &t.name);
            let dst = out.tensor_mut(&full, &name).expect("the base names the model's tensors");
            dst.copy_from_slice(&base.tensor_f32(i, t));
        }
        for op in &spec.ops {
            let Op::Lora { a, b, w, ic, r, scale, .. } = op else { continue };
            let a_w = &run.params.layers[i][a.start - spec.frozen..a.end - spec.frozen];
            let b_w = &run.params.layers[i][b.start - spec.frozen..b.end - spec.frozen];
            let module = target_of(spec, a.start);
            let name = ModelLayout::layer_name(i, &format!("{module}.weight"));
            let dst = out.tensor_mut(&full, &name).expect("an adapted module is a base tensor");
            add_ba(dst, (a_w, b_w), (*w, *ic, *r), *scale);
        }
    }
    out
}

/// The module (`self_attn.q_proj`) whose `A` starts at slot offset `a_start`.
fn target_of(spec: &crate::model::spec::LayerSpec, a_start: usize) -> String {
    let t = spec.tensors.iter().find(|t| t.offset == a_start && t.name.ends_with(".lora_A.weight"));
    t.expect("an adapter's A is a tensor").name.trim_end_matches(".lora_A.weight").to_string()
}

/// `w (out, in) += scale · b (out, r) · a (r, in)`, each element's sum in f64.
fn add_ba(
    w: &mut [f32],
    (a, b): (&[f32], &[f32]),
    (out, inp, r): (usize, usize, usize),
    scale: f32,
) {
    use rayon::prelude::*;
    w.par_chunks_mut(inp).take(out).enumerate().for_each(|(o, row)| {
        for (j, x) in row.iter_mut().enumerate() {
            let s: f64 = (0..r).map(|k| b[o * r + k] as f64 * a[k * inp + j] as f64).sum();
            *x = (*x as f64 + scale as f64 * s) as f32;
        }
    });
}
