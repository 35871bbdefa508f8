//! The mixture-of-experts keys of a `config.json` (Qwen3-MoE, Qwen2-MoE, Mixtral): which layers
//! are sparse, the experts, the router and the load-balancing loss, with transformers' defaults
//! and clear refusals of what Horizon does not run.

use anyhow::{Result, bail};

use crate::hf::checkpoint::Checkpoint;
use crate::hf::config::{Arch, Keys};

/// A model's sparse MLPs, as `../shared/fixtures/README.md` ("Mixture-of-experts cases") states
/// them.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// The family (its Hub names: Mixtral's `block_sparse_moe.experts.{e}.w1`, Qwen's
    /// `mlp.experts.{e}.gate_proj`).
    pub arch: Arch,
    /// The checkpoint stores the experts fused (transformers 5: `mlp.experts.gate_up_proj`
    /// (E, 2I, C), `mlp.experts.down_proj` (E, C, I)) rather than one tensor per expert; exports
    /// keep the layout the run started from.
    pub fused: bool,
    /// E: routed experts of each sparse layer (`num_experts` or `num_local_experts`).
    pub num_experts: usize,
    /// k: experts chosen per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// I: an expert's intermediate size (`moe_intermediate_size`; Mixtral's
    /// `intermediate_size`).
    pub expert_size: usize,
    /// The k routing weights are divided by their sum (`norm_topk_prob`; always for Mixtral).
    pub norm_topk_prob: bool,
    /// Whether each layer is sparse (a dense layer has the dense SwiGLU MLP).
    pub sparse: Vec<bool>,
    /// Qwen2-MoE's shared expert: its intermediate size (`shared_expert_intermediate_size`).
    pub shared_expert: Option<usize>,
    /// `router_aux_loss_coef`.
    pub aux_coef: f64,
    /// `output_router_logits`: the load-balancing loss joins the trained objective (times the
    /// coefficient); otherwise it is only reported.
    pub output_router_logits: bool,
}

impl MoeConfig {
    /// The Hub layout's names of a sparse layer: the block prefix and the per-expert gate, up
    /// and down names.
    pub fn hub_names(&self) -> (&'static str, [&'static str; 3]) {
        match self.arch {
            Arch::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        }
    }

    /// Whether layer `i` is sparse; past the end (a config made deeper) the pattern repeats.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.sparse[i % self.sparse.len()]
    }

    /// The coefficient the aux loss carries in the trained objective (0 unless
    /// `output_router_logits`).
    pub fn trained_coef(&self) -> f64 {
        if self.output_router_logits { self.aux_coef } else { 0.0 }
    }
}

/// Keys of variants Horizon does not run, each with what it is.
const REFUSED: [(&str, &str); 6] = [
    ("n_group", "DeepSeek's grouped routing"),
    ("topk_group", "DeepSeek's grouped routing"),
    ("kv_lora_rank", "multi-head latent attention (MLA)"),
    ("q_lora_rank", "multi-head latent attention (MLA)"),
    ("n_shared_experts", "DeepSeek's shared experts"),
    ("first_k_dense_replace", "DeepSeek's dense-first layout"),
];

/// The MoE keys of a sparse family's config (`None` for a dense family).
pub(crate) fn parse_moe(
    o: &Keys,
    arch: Arch,
    layers: usize,
    dense_f: usize,
) -> Result<Option<MoeConfig>> {
    if !arch.is_moe() {
        return Ok(None);
    }
    let origin = o.origin;
    for (key, what) in REFUSED {
        if o.get(key).is_some() {
            bail!(
                "{origin}: '{key}' is set: {what} is not supported (Horizon runs Qwen3-MoE, Qwen2-MoE and Mixtral routing)"
            );
        }
    }
    let num_experts = match (o.size("num_experts")?, o.size("num_local_experts")?) {
        (Some(a), Some(b)) if a != b => bail!(
            "{origin}: num_experts ({a}) and num_local_experts ({b}) disagree; hint: keep one"
        ),
        (Some(e), _) | (None, Some(e)) => e,
        (None, None) => bail!(
            "{origin}: missing 'num_experts' (or 'num_local_experts') for {}",
            arch.model_type()
        ),
    };
    let top_k = o.size("num_experts_per_tok")?.unwrap_or(if arch == Arch::Mixtral { 2 } else { 8 });
    if top_k > num_experts {
        bail!(
            "{origin}: num_experts_per_tok ({top_k}) is larger than the number of experts ({num_experts})"
        );
    }
    let expert_size = match arch {
        Arch::Mixtral => dense_f,
        _ => o.required_size("moe_intermediate_size")?,
    };
    let norm_topk_prob = match arch {
        Arch::Mixtral => true,
        Arch::Qwen2Moe => o.bool("norm_topk_prob")?.unwrap_or(false),
        _ => o.bool("norm_topk_prob")?.unwrap_or(true),
    };
    if let Some(j) = o.float("router_jitter_noise")?.filter(|&j| j != 0.0) {
        bail!(
            "{origin}: router_jitter_noise {j} is not supported (routing noise in training); hint: set it to 0"
        );
    }
    let sparse = sparse_layers(o, arch, layers, num_experts)?;
    let shared_expert = match arch {
        Arch::Qwen2Moe => o.size("shared_expert_intermediate_size")?,
        _ => None,
    };
    let aux_coef = o.float("router_aux_loss_coef")?.unwrap_or(0.001);
    if !(aux_coef >= 0.0 && aux_coef.is_finite()) {
        bail!("{origin}: router_aux_loss_coef must be a finite number >= 0, got {aux_coef}");
    }
    let output_router_logits = o.bool("output_router_logits")?.unwrap_or(false);
    Ok(Some(MoeConfig {
        arch,
        fused: false,
        num_experts,
        top_k,
        expert_size,
        norm_topk_prob,
        sparse,
        shared_expert,
        aux_coef,
        output_router_logits,
    }))
}

/// Qwen: layer i is sparse iff it is not in `mlp_only_layers` and `(i + 1) %
/// decoder_sparse_step == 0`; Mixtral: every layer.
fn sparse_layers(o: &Keys, arch: Arch, layers: usize, experts: usize) -> Result<Vec<bool>> {
    let origin = o.origin;
    if arch == Arch::Mixtral {
        return Ok(vec![true; layers]);
    }
    let step = o.size("decoder_sparse_step")?.unwrap_or(1);
    let mut only = Vec::new();
    if let Some(v) = o.get("mlp_only_layers") {
        let list = v.as_array().filter(|l| l.iter().all(|x| x.as_u64().is_some()));
        let Some(list) = list else {
            bail!("{origin}: mlp_only_layers must be a list of layer indices, got {v}");
        };
        for x in list {
            let i = x.as_u64().unwrap_or(0) as usize;
            if i >= layers {
                bail!(
                    "{origin}: mlp_only_layers names layer {i}, but the model has {layers} layers"
                );
            }
            only.push(i);
        }
    }
    Ok((0..layers).map(|i| experts > 0 && !only.contains(&i) && (i + 1) % step == 0).collect())
}

/// transformers 5's fused names of sparse layer `l`'s tensors: (router, gate_up, down). Mixtral's
/// are also found under `block_sparse_moe.` ([`fused_sources`]).
pub fn fused_names(l: usize) -> [String; 3] {
    let p = format!("model.layers.{l}.mlp");
    [
        format!("{p}.gate.weight"),
        format!("{p}.experts.gate_up_proj"),
        format!("{p}.experts.down_proj"),
    ]
}

/// Where a checkpoint stores sparse layer `l`'s fused tensors, if it does: (router, gate_up,
/// down) as named in `ckpt` under `prefix`.
fn fused_sources(ckpt: &Checkpoint, prefix: &str, l: usize) -> Option<[String; 3]> {
    let blocks = [format!("model.layers.{l}.mlp"), format!("model.layers.{l}.block_sparse_moe")];
    for b in &blocks {
        let gu = format!("{prefix}{b}.experts.gate_up_proj");
        if ckpt.contains(&gu) {
            let router =
                [format!("{prefix}{b}.gate.weight"), format!("{prefix}{}.gate.weight", blocks[0])]
                    .into_iter()
                    .find(|r| ckpt.contains(r))?;
            return Some([router, gu, format!("{prefix}{b}.experts.down_proj")]);
        }
    }
    None
}

/// A fused checkpoint read as the Hub layout: every sparse layer's fused expert tensors become
/// per-expert views under the Hub names (expert e's gate and up are rows `0..I` and `I..2I` of
/// `gate_up_proj[e]`, its down `down_proj[e]`), the router under the Hub name. Returns whether
/// the checkpoint is fused; an error names a fused tensor whose expert count or shape
/// disagrees with the config.
pub fn read_fused_as_hub(
    ckpt: &mut Checkpoint,
    moe: &MoeConfig,
    (prefix, layers, c): (&str, usize, usize),
) -> Result<bool> {
    let (e, i) = (moe.num_experts, moe.expert_size);
    let (block, [gate, up, down]) = moe.hub_names();
    let mut fused = false;
    for l in (0..layers).filter(|&l| moe.is_sparse(l)) {
        let Some([router, gu, dn]) = fused_sources(ckpt, prefix, l) else { continue };
        fused = true;
        for (name, want) in [(&gu, [e, 2 * i, c]), (&dn, [e, c, i])] {
            let got = ckpt.shape(name).unwrap_or_default();
            if got != want {
                bail!(
                    "{}: tensor '{name}' has shape {got:?}, but config.json's {e} experts of {i} (hidden {c}) need {want:?}\nhint: check num_experts (or num_local_experts) and moe_intermediate_size",
                    ckpt.source().display()
                );
            }
        }
        let hub = |s: &str| format!("{prefix}model.layers.{l}.{block}.{s}");
        ckpt.add_view(&hub("gate.weight"), &router, 0, &[e, c])?;
        for x in 0..e {
            ckpt.add_view(
                &hub(&format!("experts.{x}.{gate}.weight")),
                &gu,
                x * 2 * i * c,
                &[i, c],
            )?;
            ckpt.add_view(
                &hub(&format!("experts.{x}.{up}.weight")),
                &gu,
                (2 * x + 1) * i * c,
                &[i, c],
            )?;
            ckpt.add_view(&hub(&format!("experts.{x}.{down}.weight")), &dn, x * c * i, &[c, i])?;
        }
    }
    Ok(fused)
}
