//! Experts streamed in chunks (issue 44, `engine.expert_chunk`): a sparse layer's frozen routed
//! experts go through two expert slots a chunk at a time while its trunk stays in its layer
//! slot. On the fixtures' mixtures of experts (`qwen3_moe`, whose middle layer is dense, and
//! `mixtral`) with LoRA and QLoRA on the attention and the router, every chunking trains
//! exactly as whole layers do, and the device memory it plans does not grow with the number
//! of experts.

mod common;

use common::lora::moe_adapter_run;
use common::{case_dir, case_engine_config};
use horizon::engine::options::EngineConfig;
use horizon::engine::sizes::Sizes;
use horizon::model::params::ParamStore;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};

/// [`moe_adapter_run`] on the CPU device.
fn train(case: &str, kind: &str, ecfg: EngineConfig) -> (Vec<(f64, f64, bool)>, ParamStore, usize) {
    moe_adapter_run(CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20)), case, kind, ecfg)
}

/// Every chunking (one expert a chunk: 8 chunks; three: 3 chunks) of the fixtures' sparse
/// layers trains bit for bit as whole layers do, with LoRA and QLoRA, a checkpoint every 1, 2
/// or 3 layers, micro-batches of one row and of the whole batch.
#[test]
fn chunked_experts_train_as_whole_layers_bit_for_bit() {
    for case in ["qwen3_moe", "mixtral"] {
        let batch = common::expected(case)["batch"].as_u64().unwrap() as usize;
        for kind in ["lora", "qlora"] {
            for (k, mbs) in [(1, 1), (2, batch), (3, 1), (1, batch)] {
                // The head's tiles follow the layer slot, which a trunk makes smaller: hold them.
                let tiles = Some(16);
                let base =
                    EngineConfig { head_tile_rows: tiles, ..case_engine_config(case, k, mbs) };
                let (want, want_params, whole) = train(case, kind, base);
                assert_eq!(whole, 1, "{case}: whole layers by default");
                for per in [1, 3] {
                    let what = format!("{case} {kind} K={k} mbs={mbs}, {per} experts a chunk");
                    let cfg = EngineConfig { expert_chunk: Some(per), ..base };
                    let (got, params, chunks) = train(case, kind, cfg);
                    assert!(chunks >= 3, "{what}: {chunks} chunks");
                    let bits = |s: &[(f64, f64, bool)]| {
                        s.iter().map(|(l, g, _)| (l.to_bits(), g.to_bits())).collect::<Vec<_>>()
                    };
                    assert_eq!(bits(&got), bits(&want), "{what}: losses and norms");
                    common::assert_bit_identical(&what, &params, &want_params);
                }
            }
        }
    }
}

/// The qwen3_moe fixture's layout with `experts` experts (each as the fixture's) and QLoRA on
/// its attention: the device bytes its plan needs with `per` experts a chunk.
fn planned_device_bytes(experts: usize, per: Option<usize>) -> usize {
    let mut raw: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(case_dir("qwen3_moe").join("model/config.json")).unwrap(),
    )
    .unwrap();
    raw["num_experts"] = experts.into();
    raw["num_local_experts"] = experts.into();
    raw["vocab_size"] = 64.into();
    let model = horizon::hf::config::ModelConfig::from_json(&raw, "qwen3_moe").unwrap();
    let layout = horizon::model::describe(&model);
    let lora = horizon::model::lora::LoraSpec {
        r: 4,
        scale: 2.0,
        targets: ["q_proj", "o_proj"].map(String::from).to_vec(),
        nf4: true,
        base: horizon::model::lora::BaseDtype::Bf16,
        experts: Default::default(),
    };
    let layout = layout.with_lora(&lora).unwrap();
    let ecfg = EngineConfig { expert_chunk: per, ..case_engine_config("qwen3_moe", 1, 3) };
    Sizes::new(&layout, &ecfg).device_total()
}

/// With the chunk held at 4 experts, the planned device memory of 64, 128 and 256 experts is
/// the same but for what grows with the expert count by design (the router's weights, its
/// logits and probabilities, the load-balancing statistics): within 1% here, where the router
/// is a small part of a layer; held whole, the layer slots grow with the experts.
#[test]
fn device_memory_does_not_grow_with_the_number_of_experts() {
    let chunked: Vec<usize> = [64, 128, 256].map(|e| planned_device_bytes(e, Some(4))).to_vec();
    let whole: Vec<usize> = [64, 128, 256].map(|e| planned_device_bytes(e, None)).to_vec();
    let ratio = chunked[2] as f64 / chunked[0] as f64;
    assert!(whole[2] as f64 / whole[0] as f64 > 1.5, "whole layers grow: {whole:?}");
    // The router (E x C) and its (N x E) buffers are a larger share of this tiny layer than of
    // a real one: bound what they add, and the rest is flat.
    let router = |e: usize| e * 32 * 4 + 3 * 32 * e * 4 * 3;
    let flat = (chunked[2] - router(256)) as f64 / (chunked[0] - router(64)) as f64;
    assert!(flat <= 1.01, "chunked: {chunked:?} (ratio {ratio:.3}, without the router {flat:.4})");
}
