//! Weight-decay groups (`optimizer.no_decay`): which trained tensors take
//! `optimizer.weight_decay` and which take none. `none` decays every tensor, as
//! `torch.optim.AdamW(model.parameters())` does; `hf` forms the Hugging Face Trainer's two
//! parameter groups (what TRL, axolotl and LLaMA-Factory runs use): biases and norm weights
//! take none.
//!
//! The groups are derived once per run from the layout's HF names
//! ([`ModelLayout::buffer_tensor_ranges`]); the optimizer reads, per flat buffer, the element
//! ranges that take no decay ([`DecayGroups::exempt`]) and runs AdamW on them with
//! `decay = 1` ([`crate::optim::adamw::BufferStep`]).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::model::layout::ModelLayout;

/// `optimizer.no_decay`: which trained tensors take no weight decay.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NoDecay {
    /// Every trained tensor decays (`torch.optim.AdamW(model.parameters())`).
    #[default]
    None,
    /// The Hugging Face Trainer's groups: biases and norm weights take none ([`hf_exempt`]).
    Hf,
}

impl NoDecay {
    /// The name used in configs and messages.
    pub fn name(self) -> &'static str {
        match self {
            NoDecay::None => "none",
            NoDecay::Hf => "hf",
        }
    }

    /// Whether the tensor of full HF name `name` takes no weight decay under this rule.
    pub fn exempts(self, name: &str) -> bool {
        match self {
            NoDecay::None => false,
            NoDecay::Hf => hf_exempt(name),
        }
    }
}

/// The Hugging Face Trainer's rule (`Trainer.get_decay_parameter_names`): no decay for a
/// parameter whose lower-cased full name matches `bias`, `layernorm`, `rmsnorm`,
/// `(^|\.)norm($|\.)` or `_norm($|\.)`, or that sits in an `nn.LayerNorm` (no family here has
/// one under another name). The Trainer tests the patterns on each module's name suffixes
/// (`get_parameter_names`), which start after a `.` of the full name: the same as testing the
/// full name. Here: a substring, or a `.`-separated part that is `norm` or ends in `_norm`.
pub fn hf_exempt(name: &str) -> bool {
    let n = name.to_lowercase();
    ["bias", "layernorm", "rmsnorm"].iter().any(|p| n.contains(p))
        || n.split('.').any(|part| part == "norm" || part.ends_with("_norm"))
}

/// A run's weight-decay groups: for each flat buffer (`ParamStore::buffers` order) the element
/// ranges that take no decay, sorted, disjoint, whole tensors (adjacent ones merged); and the
/// size of each group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecayGroups {
    /// The rule the groups were formed by.
    pub rule: NoDecay,
    /// Per buffer, the ranges that take no decay.
    exempt: Vec<Vec<Range<usize>>>,
    /// Trained tensors and parameters that decay.
    pub decayed: Count,
    /// Trained tensors and parameters that take no decay.
    pub exempted: Count,
}

/// Tensors and parameters of a group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count {
    pub tensors: usize,
    pub params: usize,
}

impl Count {
    fn add(&mut self, n: usize) {
        self.tensors += 1;
        self.params += n;
    }
}

impl DecayGroups {
    /// The groups of `layout`'s trained tensors under `rule`.
    pub fn new(layout: &ModelLayout, rule: NoDecay) -> Self {
        let mut g = DecayGroups { rule, ..Default::default() };
        for tensors in layout.buffer_tensor_ranges() {
            let mut ranges: Vec<Range<usize>> = Vec::new();
            for (name, r) in tensors {
                if !rule.exempts(&name) {
                    g.decayed.add(r.len());
                    continue;
                }
                g.exempted.add(r.len());
                match ranges.last_mut() {
                    Some(last) if last.end == r.start => last.end = r.end,
                    _ => ranges.push(r),
                }
            }
            g.exempt.push(ranges);
        }
        g
    }

    /// The element ranges of buffer `i` that take no decay (none past the last buffer).
    pub fn exempt(&self, i: usize) -> &[Range<usize>] {
        self.exempt.get(i).map_or(&[], Vec::as_slice)
    }

    /// The plan's line: `weight decay 0.1 on N tensors (P params), none on M tensors (Q params)
    /// (optimizer.no_decay: hf)`.
    pub fn line(&self, weight_decay: f64) -> String {
        let (d, e) = (self.decayed, self.exempted);
        format!(
            "weight decay {weight_decay} on {} tensors ({} params), none on {} tensors ({} params) (optimizer.no_decay: {})",
            d.tensors,
            d.params,
            e.tensors,
            e.params,
            self.rule.name()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hf_rule_exempts_biases_and_norms_by_name() {
        for name in [
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.3.pre_feedforward_layernorm.weight",
            "model.norm.weight",
            "norm.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm",
            "model.layers.0.self_attn.q_proj.bias",
            "encoder.LayerNorm.weight",
            "h.0.ln_f.RMSNorm.scale",
        ] {
            assert!(hf_exempt(name), "{name} takes no decay");
            assert!(NoDecay::Hf.exempts(name), "{name}");
            assert!(!NoDecay::None.exempts(name), "{name}: none decays everything");
        }
        for name in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.0.mlp.experts.3.down_proj.weight",
            "model.layers.0.self_attn.q_proj.lora_A.weight",
            "model.normalizer.weight",
            "model.enorm.weight",
            "model.norm_x.weight",
        ] {
            assert!(!hf_exempt(name), "{name} decays");
        }
    }

    #[test]
    fn the_line_names_both_groups_and_the_rule() {
        let g = DecayGroups {
            rule: NoDecay::Hf,
            exempt: vec![],
            decayed: Count { tensors: 16, params: 1000 },
            exempted: Count { tensors: 5, params: 80 },
        };
        assert_eq!(
            g.line(0.1),
            "weight decay 0.1 on 16 tensors (1000 params), none on 5 tensors (80 params) (optimizer.no_decay: hf)"
        );
    }
}
