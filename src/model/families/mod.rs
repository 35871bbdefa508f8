//! Model families: each file describes what a decoder layer of its family is (tensors, ops,
//! per-layer variation) and the model-level pieces around it; everything else is derived from
//! that description (`model/spec.rs`, `model/layout.rs`).
//!
//! | family | file | model_type |
//! |---|---|---|
//! | Llama-style pre-norm decoder | `llama.rs` | llama, qwen2, mistral, qwen3 (+ per-head q/k norm) |
//! | Gemma 3 | `gemma3.rs` | gemma3_text, gemma3 (its language model) |
//! | the sparse MLP of the mixture-of-experts families (in `llama.rs`'s layers) | `moe.rs` | qwen3_moe, qwen2_moe, mixtral |

pub mod gemma3;
pub mod llama;
pub mod moe;

use crate::hf::config::{Arch, LayerType, ModelConfig, RopeConfig};
use crate::model::layout::{ModelLayout, RopeTable};
use crate::model::spec::LayerSpec;

/// The description of `cfg`'s model.
pub fn describe(cfg: &ModelConfig) -> ModelLayout {
    match cfg.arch {
        Arch::Gemma3 => gemma3::describe(cfg),
        _ => llama::describe(cfg),
    }
}

/// The RoPE tables a model needs (table 0: full-attention layers; table 1: the sliding layers'
/// own, when they have one) and the table of each layer type.
pub fn rope_tables(cfg: &ModelConfig) -> (Vec<RopeTable>, impl Fn(LayerType) -> usize) {
    let table = |r: &RopeConfig| RopeTable {
        inv_freq: cfg.rope_inv_freq_of(r),
        scale: ModelConfig::rope_attention_factor_of(r),
    };
    let mut tables = vec![table(&cfg.rope)];
    let local = cfg.rope_local.as_ref().map(table);
    let has_local = local.is_some();
    tables.extend(local);
    (tables, move |t| usize::from(t == LayerType::Sliding && has_local))
}

/// One layer spec per layer type the model uses, and each layer's kind: the per-layer variation
/// (`layer_types`) as data.
pub fn kinds_by_type(
    cfg: &ModelConfig,
    mut build: impl FnMut(LayerType) -> LayerSpec,
) -> (Vec<LayerSpec>, Vec<usize>) {
    kinds_by(cfg, |i| cfg.layer_type(i), |i| build(cfg.layer_type(i)))
}

/// One layer spec per distinct `key` of the layers (built from the first layer with it), and
/// each layer's kind.
pub fn kinds_by<K: PartialEq>(
    cfg: &ModelConfig,
    key: impl Fn(usize) -> K,
    mut build: impl FnMut(usize) -> LayerSpec,
) -> (Vec<LayerSpec>, Vec<usize>) {
    let mut keys: Vec<K> = Vec::new();
    let mut kinds = Vec::new();
    let kind_of = (0..cfg.num_layers)
        .map(|i| match keys.iter().position(|u| *u == key(i)) {
            Some(k) => k,
            None => {
                keys.push(key(i));
                kinds.push(build(i));
                kinds.len() - 1
            }
        })
        .collect();
    (kinds, kind_of)
}

/// The name of a layer type in the plan.
pub fn type_name(t: LayerType) -> &'static str {
    match t {
        LayerType::Full => "full_attention",
        LayerType::Sliding => "sliding_attention",
    }
}

/// The layout of the test fixture's small Llama (grouped-query attention), for unit tests.
#[cfg(test)]
pub(crate) fn fixture_layout() -> ModelLayout {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llama_gqa/model/config.json");
    describe(&ModelConfig::from_file(std::path::Path::new(path)).expect("the fixture"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(case: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(case)
            .join("model/config.json")
    }

    #[test]
    fn num_params_counts_fixture_tensors() {
        // llama_gqa: V*C + L*(attn + mlp + norms) + C + untied head.
        let num_params = |c: &ModelConfig| describe(c).num_params();
        let c = ModelConfig::from_file(&fixture("llama_gqa")).unwrap();
        let layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 176 + 2 * 64;
        assert_eq!(num_params(&c), 2 * 256 * 64 + 2 * layer + 64);
        // qwen2: tied, with q/k/v biases.
        let c = ModelConfig::from_file(&fixture("qwen2_tied_padded")).unwrap();
        let layer = 64 * 64 + 2 * 64 * 16 + 64 * 64 + (64 + 2 * 16) + 3 * 64 * 128 + 2 * 64;
        assert_eq!(num_params(&c), 320 * 64 + 3 * layer + 64);
        // And every family's description agrees with the element count of its checkpoint.
        for case in ["llama_gqa", "qwen2_tied_padded", "qwen3_qknorm", "gemma3_sliding"] {
            let c = ModelConfig::from_file(&fixture(case)).unwrap();
            let dir = fixture(case).parent().unwrap().to_path_buf();
            let ckpt = crate::hf::checkpoint::Checkpoint::open(&dir).unwrap();
            let numel: usize =
                ckpt.names().iter().map(|n| ckpt.shape(n).unwrap().iter().product::<usize>()).sum();
            assert_eq!(num_params(&c), numel, "{case}");
        }
    }

    /// A YaRN model's table carries its attention factor, and its cos/sin are the plain
    /// tables times it; every other model's scale is 1 and changes no bit.
    #[test]
    fn yarn_tables_carry_the_attention_factor() {
        let mut c = ModelConfig::from_file(&fixture("llama_gqa")).unwrap();
        let plain = describe(&c).rope[0].clone();
        assert_eq!(plain.scale, 1.0);
        c.rope.kind = crate::hf::config::RopeKind::Yarn {
            factor: 8.0,
            original_max_position_embeddings: 64.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: false,
            attention_factor: 1.25,
        };
        let yarn = describe(&c).rope[0].clone();
        assert_eq!(yarn.scale, 1.25);
        let t = |table: &RopeTable| crate::model::transformer::rope_tables(table, 9);
        let (cos, sin) = t(&yarn);
        let unscaled = t(&RopeTable { scale: 1.0, ..yarn.clone() });
        assert_eq!(cos, unscaled.0.iter().map(|x| x * 1.25).collect::<Vec<_>>());
        assert_eq!(sin, unscaled.1.iter().map(|x| x * 1.25).collect::<Vec<_>>());
    }
}
