//! The streaming engine against the reference path and the HF fixtures: every fixture case,
//! checkpoint intervals K in {1, 2, 3}, micro-batches of 1 row and of the whole batch, on the
//! CPU device — unthrottled, and with random delays on its copy queues.

mod common;

use common::*;
use horizon::config::RawConfig;
use horizon::engine::exec::{Engine, EngineConfig};
use horizon::hf::config::ModelConfig;
use horizon::model::layout::ModelLayout;
use horizon::model::params::ParamStore;
use horizon::train::{TrainState, Trainer};
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};

/// Per-step (loss, grad norm) and the final parameters of the reference path.
fn reference(case: &str) -> (Vec<(f64, f64)>, ParamStore) {
    let yaml = case_yaml(case, "engine: { head_chunk_rows: 7 }\n");
    let cfg = RawConfig::from_yaml(&yaml, case).unwrap().resolve(case).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    let steps = expected(case)["steps"].as_u64().unwrap() as usize;
    let out = (0..steps).map(|k| t.step(k).unwrap()).map(|m| (m.loss, m.grad_norm)).collect();
    (out, t.state.params.clone())
}

/// Run the engine over the fixture's steps; returns per-step (loss, grad norm), the initial and
/// the final parameters.
fn streamed(
    case: &str,
    k: usize,
    mbs: usize,
    jitter_us: u64,
    seed: u64,
) -> (Vec<(f64, f64)>, ParamStore, ParamStore) {
    streamed_with(case, k, false, mbs, jitter_us, seed)
}

/// As [`streamed`]; `keep` keeps every layer's internals for its backward (needs K = 1).
fn streamed_with(
    case: &str,
    k: usize,
    keep: bool,
    mbs: usize,
    jitter_us: u64,
    seed: u64,
) -> (Vec<(f64, f64)>, ParamStore, ParamStore) {
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let layout = ModelLayout::new(&model);
    let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let init = params.clone();
    let cfg = EngineConfig { keep_internals: keep, ..case_engine_config(case, k, mbs) };
    let dev = CpuDevice::new(CpuDeviceConfig {
        capacity_bytes: 64 << 20,
        link_gbps: 0.0,
        copy_jitter_us: jitter_us,
        jitter_seed: seed,
    });
    let mut engine = Engine::new(dev, &model, TrainState::new(params), cfg).unwrap();
    let out = run_case_steps(&mut engine, case).into_iter().map(|(l, g, _)| (l, g)).collect();
    let state = engine.into_state();
    (out, init, state.params)
}

/// One micro-batch per step: the order of arithmetic is the reference path's, so every
/// number is bit-identical, whatever K.
#[test]
fn whole_batch_is_bit_identical_to_the_reference_path() {
    for case in CASES {
        let (ref_steps, ref_params) = reference(case);
        let batch = expected(case)["batch"].as_u64().unwrap() as usize;
        // K = 1, 2, 3 recomputing; K = 1 keeping every layer's internals (no recompute).
        for (k, keep) in [(1, false), (2, false), (3, false), (1, true)] {
            let (steps, _, params) = streamed_with(case, k, keep, batch, 0, 0);
            for (s, (a, b)) in steps.iter().zip(&ref_steps).enumerate() {
                assert_eq!(
                    a.0.to_bits(),
                    b.0.to_bits(),
                    "{case} K={k} keep={keep} step {s} loss {} vs {}",
                    a.0,
                    b.0
                );
                assert_eq!(
                    a.1.to_bits(),
                    b.1.to_bits(),
                    "{case} K={k} keep={keep} step {s} grad norm {} vs {}",
                    a.1,
                    b.1
                );
            }
            assert_bit_identical(&format!("{case} K={k} keep={keep}"), &params, &ref_params);
        }
    }
}

/// Micro-batches of one row: gradients are summed in another order, so the numbers agree with
/// the HF reference within the tolerance table.
#[test]
fn micro_batches_match_the_fixtures() {
    for case in CASES {
        for k in [1, 2, 3] {
            let (steps, init, params) = streamed(case, k, 1, 0, 0);
            assert_matches_fixture(case, &format!("K={k}"), &steps, &init, &params);
        }
    }
}

/// Random delays on the copy queues change the timing, never the numbers: a stress test run
/// many times, with delays up to 0.3 ms before every copy.
#[test]
fn copy_queue_delays_do_not_change_results() {
    for case in CASES {
        for (k, mbs) in [(1, 1), (2, 1), (3, 2)] {
            let (base, _, base_params) = streamed(case, k, mbs, 0, 0);
            for seed in 1..=8 {
                let (steps, _, params) = streamed(case, k, mbs, 300, seed);
                let what = format!("{case} K={k} mbs={mbs} seed {seed}");
                assert_eq!(steps, base, "{what}");
                assert_bit_identical(&what, &params, &base_params);
            }
        }
    }
}

/// Step-0 loss of `model` (the llama_gqa weights) through the reference path and through the
/// engine with K = 1 and 2 (one micro-batch: bit-identical).
fn step0_losses(model: &ModelConfig) -> Vec<f64> {
    use horizon::model::transformer::{Capacity, Transformer};
    let case = "llama_gqa";
    let layout = ModelLayout::new(model);
    let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let rows = case_rows(case);
    let batch = expected(case)["batch"].as_u64().unwrap() as usize;
    let rows: Vec<_> = rows[..batch].iter().collect();
    let b = horizon::data::pretokenized::make_batch(&rows);
    let cap = Capacity { batch, seq_len: 32, head_chunk_rows: 7 };
    let mut t = Transformer::new(horizon_backend::CpuBackend, model, cap);
    let mut grads = params.clone();
    grads.fill_zero();
    let mut out = vec![t.forward_backward(&params, &mut grads, &b, b.num_targets).unwrap().loss()];
    for k in [1, 2] {
        let dev = CpuDevice::new(CpuDeviceConfig {
            capacity_bytes: 64 << 20,
            link_gbps: 0.0,
            copy_jitter_us: 0,
            jitter_seed: 0,
        });
        let cfg = case_engine_config(case, k, batch);
        let mut e = Engine::new(dev, model, TrainState::new(params.clone()), cfg).unwrap();
        let sp = horizon::engine::exec::StepParams { lr: 0.0, inject_nan: false };
        out.push(e.step(&rows, sp).unwrap().loss());
    }
    out
}

/// Mistral's sliding window is a layer type: the same weights as Llama, a window as wide as the
/// rows changes nothing, a narrower one changes the loss; the engine equals the reference path.
#[test]
fn mistral_sliding_window_runs_through_the_windowed_kernels() {
    let mut raw: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(case_dir("llama_gqa").join("model/config.json")).unwrap(),
    )
    .unwrap();
    let llama = step0_losses(&ModelConfig::from_json(&raw, "llama").unwrap());
    raw["model_type"] = "mistral".into();
    raw["sliding_window"] = 64.into();
    let wide = step0_losses(&ModelConfig::from_json(&raw, "mistral W=64").unwrap());
    raw["sliding_window"] = 5.into();
    let narrow = ModelConfig::from_json(&raw, "mistral W=5").unwrap();
    assert_eq!(narrow.layer_types, vec![horizon::hf::config::LayerType::Sliding; 2]);
    let narrow = step0_losses(&narrow);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&wide), bits(&llama), "a window of the whole row is full attention");
    assert!(bits(&narrow).windows(2).all(|w| w[0] == w[1]), "engine == reference: {narrow:?}");
    assert!((narrow[0] - llama[0]).abs() > 1e-4, "the window changes the loss: {narrow:?}");
}
