//! Experts streamed in chunks (issue 44, `engine.expert_chunk`): a sparse layer's frozen routed
//! experts go through two expert slots a chunk at a time while its trunk stays in its layer
//! slot. On the fixtures' mixtures of experts (`qwen3_moe`, whose middle layer is dense,
//! `mixtral`, `gpt_oss` and `gpt_oss_mxfp4`, whose adapter runs keep the experts MXFP4) with LoRA
//! and QLoRA on the attention and the router, every chunking trains
//! exactly as whole layers do, and the device memory it plans does not grow with the number
//! of experts.

mod common;

use common::lora::moe_adapter_run;
use common::{case_dir, case_engine_config};
use horizon::engine::options::EngineConfig;
use horizon::engine::sizes::Sizes;
use horizon::model::params::ParamStore;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};

/// A chunked run (`got`: steps, trained tensors) against the whole-layer one (`want`). A row's
/// k expert outputs are summed in the order the pass meets their experts, and a chunked layer's
/// passes go through its chunks in alternating directions (the resident chunk is reused), so:
/// at top-2 (a sum of two terms onto zero, which commutes) bit for bit; at top-k >= 3 (gpt-oss,
/// top-4) the rounding of a reordered four-term sum, which AdamW's normalised steps carry on
/// (as between float32 and float64: the tolerance table's update errors): losses and norms
/// within the fixtures' 1e-5 relative, each buffer within 1e-5 relative L2 of the other's.
fn same_training(
    case: &str,
    what: &str,
    (got, params): (&[(f64, f64, bool)], &ParamStore),
    (want, want_params): (&[(f64, f64, bool)], &ParamStore),
) {
    let top_k = common::expected(case)["num_experts_per_tok"].as_u64().unwrap();
    if top_k <= 2 {
        let bits = |s: &[(f64, f64, bool)]| {
            s.iter().map(|(l, g, _)| (l.to_bits(), g.to_bits())).collect::<Vec<_>>()
        };
        assert_eq!(bits(got), bits(want), "{what}: losses and norms");
        common::assert_bit_identical(what, params, want_params);
        return;
    }
    for (s, ((l, g, _), (wl, wg, _))) in got.iter().zip(want).enumerate() {
        common::assert_rel(&format!("{what} loss {s}"), *l, *wl, 1e-5);
        common::assert_rel(&format!("{what} grad norm {s}"), *g, *wg, 1e-5);
    }
    for (i, (x, y)) in params.buffers().iter().zip(want_params.buffers()).enumerate() {
        let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|d| d * d).sum::<f64>().sqrt();
        let diff = norm(&mut x.iter().zip(y.iter()).map(|(a, b)| (a - b) as f64));
        let rel = diff / norm(&mut y.iter().map(|&b| b as f64)).max(1e-30);
        assert!(rel <= 1e-5, "{what}: buffer {i} differs by {rel:.2e} (relative L2)");
    }
}

/// [`moe_adapter_run`] on the CPU device.
fn train(case: &str, kind: &str, ecfg: EngineConfig) -> (Vec<(f64, f64, bool)>, ParamStore, usize) {
    moe_adapter_run(CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20)), case, kind, ecfg)
}

/// Every chunking (one expert a chunk: 8 chunks; three: 3 chunks) of the fixtures' sparse
/// layers trains as whole layers do ([`same_training`]: bit for bit at top-2), with LoRA and
/// QLoRA, a checkpoint every 1, 2 or 3 layers, micro-batches of one row and of the whole batch.
#[test]
fn chunked_experts_train_as_whole_layers_bit_for_bit() {
    for case in ["qwen3_moe", "mixtral", "gpt_oss", "gpt_oss_mxfp4"] {
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
                    same_training(case, &what, (&got, &params), (&want, &want_params));
                }
            }
        }
    }
}

/// With every layer asked to keep its internals (`engine.recompute: never`), the sparse layers
/// whose experts stream in chunks keep none (their passes hold each micro-batch's internals
/// apart, and recompute them in the backward): only `qwen3_moe`'s dense middle layer keeps,
/// and training is whole layers' bit for bit.
#[test]
fn chunked_layers_keep_no_internals_when_every_layer_is_asked_to() {
    let case = "qwen3_moe";
    let base =
        EngineConfig { head_tile_rows: Some(16), kept_layers: 3, ..case_engine_config(case, 1, 1) };
    let (want, want_params, _) = train(case, "lora", base);
    let cfg = EngineConfig { expert_chunk: Some(3), ..base };
    let (got, params, chunks) = train(case, "lora", cfg);
    assert!(chunks >= 3);
    assert_eq!(got, want, "losses and norms");
    common::assert_bit_identical("kept layers, experts in chunks", &params, &want_params);
    let model =
        horizon::hf::config::ModelConfig::from_file(&case_dir(case).join("model/config.json"))
            .unwrap();
    let sizes = Sizes::new(&horizon::model::describe(&model), &cfg);
    assert_eq!(sizes.stash_sets, sizes.micro_batches, "the dense layer alone keeps");
}

/// Full fine-tuning of fixture `case` on the CPU engine with `ecfg`: per step (loss, grad norm,
/// skipped), the parameters before and after, and the chunks of each chunked layer's experts.
fn full(case: &str, ecfg: EngineConfig) -> (Vec<(f64, f64, bool)>, ParamStore, ParamStore, usize) {
    use horizon::engine::exec::Engine;
    let model =
        horizon::hf::config::ModelConfig::from_file(&case_dir(case).join("model/config.json"))
            .unwrap();
    let layout = horizon::model::describe(&model);
    let init = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20));
    let state = horizon::store::TrainState::new(init.clone());
    let mut e = Engine::new(dev, &model, state, ecfg).unwrap();
    let chunks = e.sizes().expert_chunks;
    let steps = common::run_case_steps(&mut e, case);
    (steps, init, e.into_state().params, chunks)
}

/// Full fine-tuning with the trained experts in chunks (their gradients back through the
/// chunks' own accumulators, added into the host gradient chunk by chunk) is whole-layer
/// training bit for bit, and both match the fixtures (losses, aux losses included, and
/// gradient norms within 1e-5; every tensor's update within the tolerance table), at K 1, 2
/// and 3, micro-batches of one row and of the whole batch, 1 and 3 experts a chunk.
#[test]
fn full_fine_tuning_with_experts_in_chunks_matches_the_fixtures() {
    for case in ["qwen3_moe", "mixtral", "gpt_oss", "gpt_oss_mxfp4"] {
        let batch = common::expected(case)["batch"].as_u64().unwrap() as usize;
        for (k, mbs) in [(1, 1), (2, batch), (3, 1)] {
            let base =
                EngineConfig { head_tile_rows: Some(16), ..case_engine_config(case, k, mbs) };
            let (want, _, want_params, _) = full(case, base);
            for per in [1, 3] {
                let what = format!("{case} full K={k} mbs={mbs}, {per} experts a chunk");
                let (got, init, params, chunks) =
                    full(case, EngineConfig { expert_chunk: Some(per), ..base });
                assert!(chunks >= 3, "{what}: {chunks} chunks");
                same_training(case, &what, (&got, &params), (&want, &want_params));
                let steps: Vec<(f64, f64)> = got.iter().map(|(l, g, _)| (*l, *g)).collect();
                common::assert_matches_fixture(case, &what, &steps, &init, &params);
            }
        }
    }
}

/// The qwen3_moe_lora fixture (PEFT's adapters on the attention and on the experts' gate|up
/// and down, from PEFT's init) with its experts and their adapters in chunks of 3 (3 chunks a
/// sparse layer; the adapters' gradients back chunk by chunk) trains as with whole layers, bit
/// for bit, with the base in fp32 and in NF4 (QLoRA), at K 1 and 2, micro-batches of one row
/// and of the whole batch; and matches PEFT's losses and norms.
#[test]
fn expert_adapters_in_chunks_train_as_whole_layers() {
    use common::lora::{expected, streamed_yaml, yaml};
    use horizon::run::config::OptimizerMemory;
    let case = "qwen3_moe_lora";
    let e = expected(case);
    let batch = e["batch"].as_u64().unwrap() as usize;
    let losses = common::f64s(&e["loss_per_step"]);
    for qlora in [false, true] {
        for (k, mbs) in [(1, batch), (2, 1)] {
            let run = |engine: &str| {
                let mut y = yaml(case, &format!("engine: {{ head_tile_rows: 16{engine} }}\n"));
                if qlora {
                    y = y.replace("type: lora", "type: qlora");
                }
                let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20));
                streamed_yaml(dev, case, &y, (k, mbs), OptimizerMemory::Exact)
            };
            let (want, got) = (run(""), run(", expert_chunk: 3"));
            let what = format!("{case} qlora={qlora} K={k} mbs={mbs}");
            assert_eq!((want.expert_chunks, got.expert_chunks), (1, 3), "{what}: chunks");
            let bits = |s: &[(f64, f64)]| {
                s.iter().map(|(l, g)| (l.to_bits(), g.to_bits())).collect::<Vec<_>>()
            };
            assert_eq!(bits(&got.steps), bits(&want.steps), "{what}: losses and norms");
            common::assert_bit_identical(&what, &got.end, &want.end);
            if !qlora {
                for (s, (l, _)) in got.steps.iter().enumerate() {
                    common::assert_rel(&format!("{what} loss {s}"), *l, losses[s], 1e-5);
                }
            }
        }
    }
}

/// Trained experts in chunks need the exact optimizer, which adds each chunk's gradient into a
/// whole host gradient: a streamed mode with `engine.expert_chunk` set says so.
#[test]
fn trained_experts_in_chunks_with_a_streamed_optimizer_are_refused() {
    use horizon::run::config::OptimizerMemory;
    let cfg = EngineConfig {
        expert_chunk: Some(2),
        memory: OptimizerMemory::Lean,
        ..case_engine_config("qwen3_moe", 1, 1)
    };
    let model = horizon::hf::config::ModelConfig::from_file(
        &case_dir("qwen3_moe").join("model/config.json"),
    )
    .unwrap();
    let layout = horizon::model::describe(&model);
    let params = ParamStore::random(&layout, 1, 0.02);
    let state = horizon::store::TrainState::for_memory(params, &layout, OptimizerMemory::Lean);
    let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20));
    let err = horizon::engine::exec::Engine::new(dev, &model, state, cfg).err().unwrap();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("engine.expert_chunk") && msg.contains("optimizer.memory: exact"),
        "{msg}"
    );
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

/// A device budget of a few MiB that whole layers exceed: `engine.expert_chunk` unset, the
/// plan takes the largest chunks that fit (here at least three a layer), the engine runs in a
/// device pool of exactly that budget, and trains as whole layers do, bit for bit.
#[test]
fn a_small_device_budget_streams_the_experts_in_chunks() {
    use horizon::engine::exec::{Engine, StepParams};
    use horizon::engine::options::{Recompute, WeightUpload};
    use horizon::engine::resolve::{Machine, resolve};
    let mut raw: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(case_dir("qwen3_moe").join("model/config.json")).unwrap(),
    )
    .unwrap();
    raw["hidden_size"] = 64.into();
    raw["moe_intermediate_size"] = 64.into();
    raw["num_experts"] = 32.into();
    raw["num_local_experts"] = 32.into();
    raw["mlp_only_layers"] = serde_json::json!([]);
    let model = horizon::hf::config::ModelConfig::from_json(&raw, "qwen3_moe").unwrap();
    let layout = horizon::model::describe(&model);
    let base = EngineConfig { head_tile_rows: Some(16), ..case_engine_config("qwen3_moe", 1, 3) };
    let need = |per: Option<usize>| {
        Sizes::new(&layout, &EngineConfig { expert_chunk: per, ..base }).device_total() as u64
    };
    let budget = need(Some(10));
    assert!(need(None) > budget && budget < 8 << 20, "whole {} vs budget {budget}", need(None));
    let machine = Machine {
        device_budget: Some(budget),
        host_bytes: None,
        pool_in_host_ram: true,
        bf16: false,
    };
    let ecfg = resolve(&layout, base, Recompute::Always, WeightUpload::Round, &machine);
    let per = ecfg.expert_chunk.expect("chunks under the budget");
    assert!((10..=11).contains(&per), "the largest chunk that fits: {per}");
    let params = ParamStore::random(&layout, 3, 0.05);
    let rows = common::case_rows("qwen3_moe");
    let run = |cfg: EngineConfig, capacity: usize| {
        let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(capacity));
        let state = horizon::store::TrainState::new(params.clone());
        let mut e = Engine::new(dev, &model, state, cfg).unwrap();
        let chunks = e.sizes().expert_chunks;
        let losses: Vec<u64> = (0..2)
            .map(|s| {
                let rs: Vec<_> = rows[3 * s..3 * s + 3].iter().collect();
                let mbs = horizon::run::data::micro_batches(&rs, 3);
                e.step(mbs, StepParams { lr: 1e-2, inject_nan: false }).unwrap().loss().to_bits()
            })
            .collect();
        (losses, e.into_state().params, chunks)
    };
    let (got, params_got, chunks) = run(ecfg, budget as usize);
    assert!(chunks >= 3, "{chunks} chunks a layer");
    let (want, params_want, _) = run(base, 64 << 20);
    assert_eq!(got, want, "losses");
    common::assert_bit_identical("a few MiB", &params_got, &params_want);
}
