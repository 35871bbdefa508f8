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
    /// gpt-oss's clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`); `None`: plain SwiGLU.
    pub clamp: Option<horizon_backend::GluClamp>,
}

impl MoeConfig {
    /// The Hub layout's names of a sparse layer: the block prefix and the per-expert gate, up
    /// and down names.
    pub fn hub_names(&self) -> (&'static str, [&'static str; 3]) {
        // gpt-oss has no per-expert layout; these name its experts' pieces inside Horizon.
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
                "{origin}: '{key}' is set: {what} is not supported (Horizon runs Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss routing)"
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
    let top_k = o.size("num_experts_per_tok")?.unwrap_or(match arch {
        Arch::Mixtral => 2,
        Arch::GptOss => 4,
        _ => 8,
    });
    if let Some(k) = o.size("experts_per_token")?.filter(|&k| arch == Arch::GptOss && k != top_k) {
        bail!(
            "{origin}: experts_per_token ({k}) and num_experts_per_tok ({top_k}) disagree; hint: \
             transformers routes with num_experts_per_tok: make them equal"
        );
    }
    if top_k > num_experts {
        bail!(
            "{origin}: num_experts_per_tok ({top_k}) is larger than the number of experts ({num_experts})"
        );
    }
    let expert_size = match arch {
        Arch::Mixtral | Arch::GptOss => dense_f,
        _ => o.required_size("moe_intermediate_size")?,
    };
    // gpt-oss: a softmax over the top k logits, which is the top k probabilities renormalised.
    let norm_topk_prob = match arch {
        Arch::Mixtral | Arch::GptOss => true,
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
    let aux_coef =
        o.float("router_aux_loss_coef")?.unwrap_or(if arch == Arch::GptOss { 0.9 } else { 0.001 });
    if !(aux_coef >= 0.0 && aux_coef.is_finite()) {
        bail!("{origin}: router_aux_loss_coef must be a finite number >= 0, got {aux_coef}");
    }
    let output_router_logits = o.bool("output_router_logits")?.unwrap_or(false);
    let clamp = (arch == Arch::GptOss).then(|| parse_clamp(o)).transpose()?;
    Ok(Some(MoeConfig {
        arch,
        fused: arch == Arch::GptOss,
        num_experts,
        top_k,
        expert_size,
        norm_topk_prob,
        sparse,
        shared_expert,
        aux_coef,
        output_router_logits,
        clamp,
    }))
}

/// gpt-oss's `swiglu_alpha` (default 1.702) and `swiglu_limit` (default 7.0), both positive.
fn parse_clamp(o: &Keys) -> Result<horizon_backend::GluClamp> {
    let alpha = o.float("swiglu_alpha")?.unwrap_or(1.702);
    let limit = o.float("swiglu_limit")?.unwrap_or(7.0);
    for (key, v) in [("swiglu_alpha", alpha), ("swiglu_limit", limit)] {
        if !(v > 0.0 && v.is_finite()) {
            bail!("{}: {key} must be a finite number > 0, got {v}", o.origin);
        }
    }
    Ok(horizon_backend::GluClamp { alpha: alpha as f32, limit: limit as f32 })
}

/// Qwen: layer i is sparse iff it is not in `mlp_only_layers` and `(i + 1) %
/// decoder_sparse_step == 0`; Mixtral: every layer.
fn sparse_layers(o: &Keys, arch: Arch, layers: usize, experts: usize) -> Result<Vec<bool>> {
    let origin = o.origin;
    if matches!(arch, Arch::Mixtral | Arch::GptOss) {
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

/// gpt-oss's experts of layer `l` as Horizon's per-expert pieces: `gate_up_proj` (E, C, 2I) is
/// in-to-out with gate and up interleaved (column 2j gate unit j, 2j+1 up unit j), so expert x's
/// gate (I, C) is the strided view `[j, c] = gate_up_proj[x, c, 2j]`, its up the next column,
/// its down (C, I) `down_proj[x]` (I, C) transposed; the biases likewise. MXFP4 checkpoints
/// (`{proj}_blocks` / `_scales`) read through the same views, decoded as transformers
/// dequantizes them. A tensor whose shape disagrees with the config is named.
fn read_gpt_oss_layer(
    ckpt: &mut Checkpoint,
    moe: &MoeConfig,
    (prefix, l, c): (&str, usize, usize),
) -> Result<()> {
    let (e, i) = (moe.num_experts, moe.expert_size);
    let p = format!("{prefix}model.layers.{l}.mlp.experts");
    let (gu, dn) = (format!("{p}.gate_up_proj"), format!("{p}.down_proj"));
    let packed = ckpt.contains(&format!("{gu}_blocks"));
    for (name, want) in [(&gu, [e, c, 2 * i]), (&dn, [e, i, c])] {
        let got = if packed {
            let q = crate::hf::mxfp4::packed(ckpt, name)?;
            Some(vec![q.experts, q.cols, q.rows])
        } else {
            ckpt.shape(name)
        };
        if got.as_deref() != Some(&want[..]) {
            let what = if packed { "MXFP4 parameter" } else { "tensor" };
            bail!(
                "{}: {what} '{name}' has shape {got:?}, but config.json's {e} experts of {i} (hidden {c}) need {want:?} (in-to-out)\nhint: check num_local_experts, intermediate_size and hidden_size",
                ckpt.source().display()
            );
        }
    }
    let (gub, dnb) = (format!("{gu}_bias"), format!("{dn}_bias"));
    for x in 0..e {
        let name = |s: &str| format!("{p}.{x}.{s}");
        let (g0, d0) = (x * c * 2 * i, x * i * c);
        for (n, src, at, shape, strides) in [
            ("gate_proj.weight", &gu, g0, [i, c], [2, 2 * i]),
            ("up_proj.weight", &gu, g0 + 1, [i, c], [2, 2 * i]),
            ("down_proj.weight", &dn, d0, [c, i], [1, c]),
        ] {
            if packed {
                ckpt.add_mxfp4_view(&name(n), src, at, &shape, &strides)?;
            } else {
                ckpt.add_strided_view(&name(n), src, at, &shape, &strides)?;
            }
        }
        ckpt.add_strided_view(&name("gate_proj.bias"), &gub, x * 2 * i, &[i], &[2])?;
        ckpt.add_strided_view(&name("up_proj.bias"), &gub, x * 2 * i + 1, &[i], &[2])?;
        ckpt.add_view(&name("down_proj.bias"), &dnb, x * c, &[c])?;
    }
    Ok(())
}

/// gpt-oss expert tensor `suffix` of layer `l` (`mlp.experts.{x}.{gate,up,down}_proj.weight`,
/// Horizon's per-expert names) as its MXFP4 checkpoint stores it, without decoding: its rows'
/// blocks and scales (gate: the packed `gate_up_proj`'s even rows, up: its odd rows, down: every
/// row of `down_proj`), the row order of Horizon's (out, in) matrices. `None` for another name.
pub fn gpt_oss_packed(
    ckpt: &Checkpoint,
    prefix: &str,
    l: usize,
    suffix: &str,
) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
    let parsed = suffix
        .strip_prefix("mlp.experts.")
        .and_then(|r| r.strip_suffix(".weight"))
        .and_then(|r| r.split_once('.'))
        .and_then(|(x, p)| Some((x.parse::<usize>().ok()?, p)));
    // The packed parameter, and which of its rows (gate: even, up: odd, down: all).
    let (x, param, parity) = match parsed {
        Some((x, "gate_proj")) => (x, "gate_up_proj", Some(0)),
        Some((x, "up_proj")) => (x, "gate_up_proj", Some(1)),
        Some((x, "down_proj")) => (x, "down_proj", None),
        _ => return Ok(None),
    };
    let p =
        crate::hf::mxfp4::packed(ckpt, &format!("{prefix}model.layers.{l}.mlp.experts.{param}"))?;
    let g = p.cols / horizon_backend::mxfp4::BLOCK;
    let (mut blocks, mut scales) = (Vec::new(), Vec::new());
    for r in (0..p.rows).filter(|&r| parity.is_none_or(|p| r % 2 == p)) {
        let k = x * p.rows + r;
        blocks.extend_from_slice(&p.blocks[k * g * 16..(k + 1) * g * 16]);
        scales.extend_from_slice(&p.scales[k * g..(k + 1) * g]);
    }
    Ok(Some((blocks, scales)))
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
    if moe.arch == Arch::GptOss {
        for l in 0..layers {
            read_gpt_oss_layer(ckpt, moe, (prefix, l, c))?;
        }
        return Ok(true);
    }
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
