//! `horizon export SRC --out DIR`: a Hugging Face directory from a resumable checkpoint, a run's
//! output directory (its newest checkpoint) or a HF directory (to change dtype or sharding).
//!
//! With `--merge`, an adapter run's result as a plain HF model: each adapted weight
//! `W + s · B A` (for QLoRA, W is the dequantised NF4 base: the weights the adapters were trained
//! against), every other tensor the base's own; written like any export. SRC is then an adapter
//! directory: an adapter run's `OUT/final/` (or the run directory holding it), or any PEFT LoRA
//! adapter directory. Horizon writes `horizon_adapter.json` beside PEFT's files, saying whether
//! the base was quantised and where it is; for a foreign PEFT directory the base is
//! `base_model_name_or_path` (a local directory) or `--base`.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::adapter::BaseDtype as BaseChoice;
use crate::hf::config::ModelConfig;
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::model::spec::Op;
use crate::run::config::{ByteSize, RawConfig, WeightDtype};
use crate::run::hf_out::{
    ExportOptions, ExportSource, Exported, TokenizerSource, export_model, has_tokenizer,
};
use crate::run::load::{RunModel, adapter_dir, load_adapter_run, note_expert_layout};

/// `horizon export`'s arguments.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A checkpoint (OUT/checkpoints/step-N), a run's output directory, or a HF directory.
    pub source: PathBuf,
    /// The directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Weight type: fp32 (exact) or bf16 (rounded to nearest even).
    #[arg(long, value_enum, default_value = "fp32")]
    pub dtype: WeightDtype,
    /// Largest shard, e.g. 5GB, 500MB (more weights than this are split, with an index).
    #[arg(long, default_value = "5GB")]
    pub max_shard_size: String,
    /// SOURCE is an adapter (an adapter run's output directory or its final/, or a PEFT
    /// adapter directory): write the base with the adapter merged into its weights.
    #[arg(long)]
    pub merge: bool,
    /// With --merge: the base model directory or Hub id (default: the one the adapter names,
    /// a directory or a Hub id in the local Hugging Face cache).
    #[arg(long)]
    pub base: Option<PathBuf>,
    /// A mixture of experts' checkpoint layout: `hub` (one tensor per expert) or `fused`
    /// (transformers 5's 3-D expert tensors). Default: the layout of the source.
    #[arg(long, value_enum)]
    pub layout: Option<ExpertLayout>,
}

/// `horizon export --layout`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    Hub,
    Fused,
}

/// Export (or merge) as `args` say, and print what was written.
pub fn run(args: &Args) -> Result<()> {
    let max_shard_bytes = match ByteSize::parse(&args.max_shard_size) {
        Ok(ByteSize::Bytes(b)) if b > 0 => b,
        Ok(_) => bail!("--max-shard-size must be a positive size such as 5GB"),
        Err(e) => bail!("--max-shard-size: {e}"),
    };
    let opts = ExportOptions {
        dtype: args.dtype.save_dtype(),
        max_shard_bytes,
        fused_experts: args.layout.map(|l| l == ExpertLayout::Fused),
    };
    if args.base.is_some() && !args.merge {
        bail!("--base is for --merge: the base model an adapter is merged into");
    }
    let (src, out) = (&args.source, &args.out);
    let e = match args.merge {
        true => merge_dir(src, args.base.as_deref(), out, opts)?,
        false => export_dir(src, out, opts)?,
    };
    let files = match e.tokenizer_files.is_empty() {
        true => "none".to_string(),
        false => e.tokenizer_files.join(", "),
    };
    println!(
        "exported {} ({} shard(s), {:.1} MB of weights; tokenizer files: {files})",
        out.display(),
        e.shards.len(),
        e.total_bytes as f64 / 1e6,
    );
    Ok(())
}

/// What `horizon export SRC` reads: a resumable checkpoint (`state.json`), a run's output
/// directory (its newest checkpoint), or a HF directory (`config.json`; to change dtype or
/// sharding).
pub fn export_dir(src: &Path, out: &Path, opts: ExportOptions) -> Result<Exported> {
    let (model_cfg, params, source) = load_source(src)?;
    if out.exists() && !out.is_dir() {
        bail!("--out {}: exists and is not a directory", out.display());
    }
    export_model(&model_cfg, &params, out, opts, &source)
}

fn load_source(src: &Path) -> Result<(ModelConfig, ParamStore, ExportSource)> {
    if !src.is_dir() {
        bail!(
            "{}: no such directory\nhint: give a checkpoint (OUT/checkpoints/step-N), a run's output directory, or a HF model directory",
            src.display()
        );
    }
    if src.join("adapter_config.json").is_file() || src.join("final/adapter_config.json").is_file()
    {
        bail!(
            "{}: an adapter run (a PEFT adapter, not a model)\nhint: add --merge to write the base with the adapter merged in",
            src.display()
        );
    }
    if src.join("state.json").is_file() {
        let state = crate::run::resume::read_state(src)?;
        let origin = src.join("state.json").display().to_string();
        if RawConfig::from_yaml(&state.config, &origin)
            .and_then(|raw| raw.resolve(&origin))
            .is_ok_and(|c| c.adapter.is_some())
        {
            bail!(
                "{}: a checkpoint of an adapter run\nhint: export the run's final/ with --merge",
                src.display()
            );
        }
        let mut model_cfg = ModelConfig::from_json(&state.model, &origin)?;
        // A mixture's experts keep the layout of the checkpoint the run started from.
        let start = RawConfig::from_yaml(&state.config, &origin).ok().and_then(|r| r.model.path);
        if let Some(dir) = start.filter(|d| d.is_dir()) {
            note_expert_layout(&mut model_cfg, &dir)?;
        }
        let params = ParamStore::load_hf(
            &crate::model::describe(&model_cfg),
            &src.join(crate::run::resume::PARAMS),
        )?;
        let source = RawConfig::from_yaml(&state.config, &origin)
            .map(|raw| ExportSource::of_config(&raw))
            .unwrap_or_else(|_| ExportSource::none());
        return Ok((model_cfg, params, source));
    }
    if crate::run::resume::checkpoints_dir(src).is_dir() {
        let ckpt = crate::run::resume::resolve("latest", src)?;
        println!("exporting the newest checkpoint, {}", ckpt.display());
        return load_source(&ckpt);
    }
    if src.join("config.json").is_file() {
        let mut model_cfg = ModelConfig::from_file(&src.join("config.json"))?;
        note_expert_layout(&mut model_cfg, src)?;
        let params = ParamStore::load_hf(&crate::model::describe(&model_cfg), src)?;
        let tokenizer = if has_tokenizer(src) {
            TokenizerSource::Dir(src.to_path_buf())
        } else {
            TokenizerSource::None
        };
        return Ok((model_cfg, params, ExportSource { tokenizer, model_dir: Some(src.into()) }));
    }
    bail!(
        "{}: neither a checkpoint (state.json), a run directory (checkpoints/) nor a HF directory (config.json)",
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
    // The tokenizer the adapter was trained with (an adapter run's final/ carries it), else
    // the base's; the generation config is the base model's.
    let adapter = adapter_dir(src)?;
    let tokenizer = match [adapter, base_dir.clone()].into_iter().find(|d| has_tokenizer(d)) {
        Some(d) => TokenizerSource::Dir(d),
        None => TokenizerSource::None,
    };
    let source = ExportSource { tokenizer, model_dir: Some(base_dir) };
    export_model(&run.cfg, &merged, out, opts, &source)
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
        merge_experts(run, &full, i, &mut out);
        for op in &spec.ops {
            let Op::Lora { a, b, w, ic, r, scale, .. } = op else { continue };
            let a_w = &run.params.layers[i][a.start - spec.frozen..a.end - spec.frozen];
            let b_w = &run.params.layers[i][b.start - spec.frozen..b.end - spec.frozen];
            let mut module = target_of(spec, a.start);
            if let Some(m) = run.cfg.moe.as_ref().filter(|_| module == "mlp.gate") {
                // The router's adapter carries PEFT's module path; the weight, its family's.
                module = format!("{}.gate", m.hub_names().0);
            }
            let name = ModelLayout::layer_name(i, &format!("{module}.weight"));
            let dst = out.tensor_mut(&full, &name).expect("an adapted module is a base tensor");
            add_ba(dst, (a_w, b_w), (*w, *ic, *r), *scale);
        }
    }
    out
}

/// Layer `i`'s expert adapters into the full model's experts: `W_e += s B_e A_e` for each expert
/// of each adapted expert parameter.
fn merge_experts(run: &RunModel, full: &ModelLayout, i: usize, out: &mut ParamStore) {
    let spec = run.layout.layer(i);
    let Some(Op::Experts { e, i: f, c, lora, .. }) =
        spec.ops.iter().find(|op| matches!(op, Op::Experts { .. }))
    else {
        return;
    };
    let Some(Op::Experts { gate_up, down, .. }) =
        full.layer(i).ops.iter().find(|op| matches!(op, Op::Experts { .. }))
    else {
        unreachable!("the full model has the adapted model's experts")
    };
    let trained = |r: &std::ops::Range<usize>| r.start - spec.frozen..r.end - spec.frozen;
    let adapters = [(&lora.gate_up, gate_up, *c, 2 * f), (&lora.down, down, *f, *c)];
    for (adapter, w, ic, oc) in adapters {
        let Some(l) = adapter else { continue };
        let (a, b) = (&run.params.layers[i][trained(&l.a)], &run.params.layers[i][trained(&l.b)]);
        for x in 0..*e {
            let dst = &mut out.layers[i][w.start + x * oc * ic..w.start + (x + 1) * oc * ic];
            let (ax, bx) =
                (&a[x * l.r * ic..(x + 1) * l.r * ic], &b[x * oc * l.r..(x + 1) * oc * l.r]);
            add_ba(dst, (ax, bx), (oc, ic, l.r), l.scale);
        }
    }
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
