//! The held-out loss on the engine (`Engine::eval`: forward only on the run's device, in the
//! step's planned buffers) against the reference path's `Transformer::forward_loss`, on every
//! fixture: bit for bit with the whole head, within 1e-6 with the head in vocabulary tiles; and
//! an eval between two steps changes nothing the steps compute.

mod common;

use common::*;
use horizon::data::pretokenized::{Row, make_batch};
use horizon::engine::exec::{Engine, MicroBatch, StepParams};
use horizon::engine::options::EngineConfig;
use horizon::hf::config::ModelConfig;
use horizon::model::params::ParamStore;
use horizon::model::transformer::{Capacity, Transformer};
use horizon::run::data::micro_batches;
use horizon::run::data::tokens_of;
use horizon::store::TrainState;
use horizon_backend::CpuBackend;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};

fn model(case: &str) -> (ModelConfig, ParamStore) {
    let cfg = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let params =
        ParamStore::load_hf(&horizon::model::describe(&cfg), &case_dir(case).join("model"))
            .unwrap();
    (cfg, params)
}

fn engine(cfg: &ModelConfig, params: ParamStore, ecfg: EngineConfig) -> Engine<CpuDevice> {
    let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(4 << 20));
    Engine::new(dev, cfg, TrainState::new(params), ecfg).unwrap()
}

/// The reference loss sum and targets of `rows` in micro-batches of `mbs`.
fn reference(
    cfg: &ModelConfig,
    params: &ParamStore,
    rows: &[Row],
    mbs: usize,
    seq: usize,
) -> (f64, usize) {
    let cap = Capacity { batch: mbs, seq_len: seq, head_chunk_rows: 7 };
    let mut tr = Transformer::new(CpuBackend, cfg, cap);
    let (mut sum, mut n) = (0.0, 0);
    for chunk in rows.chunks(mbs) {
        let refs: Vec<&Row> = chunk.iter().collect();
        let out = tr.forward_loss(params, tokens_of(&make_batch(&refs))).unwrap();
        sum += out.loss_sum;
        n += out.num_targets;
    }
    (sum, n)
}

fn eval_mbs(rows: &[Row], mbs: usize) -> Vec<MicroBatch> {
    let refs: Vec<&Row> = rows.iter().collect();
    micro_batches(&refs, mbs)
}

#[test]
fn engine_eval_equals_the_reference_forward_loss() {
    for case in CASES {
        let (cfg, params) = model(case);
        let rows = case_rows(case);
        for mbs in [1, 2] {
            let ecfg = case_engine_config(case, 2, mbs);
            let (want, targets) = reference(&cfg, &params, &rows, mbs, ecfg.seq_len);
            let mut e = engine(&cfg, params.clone(), ecfg);
            let got = e.eval(eval_mbs(&rows, mbs)).unwrap();
            assert_eq!(got.num_targets, targets, "{case}");
            assert_eq!(
                got.loss_sum.to_bits(),
                want.to_bits(),
                "{case} mbs {mbs}: {} vs {want}",
                got.loss_sum
            );
            // The LM head in vocabulary tiles of 37 rows: the same logits, the softmax sums
            // combined over tiles.
            let tiled = EngineConfig { head_tile_rows: Some(37), ..ecfg };
            let mut e = engine(&cfg, params.clone(), tiled);
            assert!(e.sizes().head.tiles() > 1, "{case}: a tiled head");
            let got = e.eval(eval_mbs(&rows, mbs)).unwrap();
            assert_rel(&format!("{case} tiled eval"), got.loss_sum, want, 1e-6);
        }
    }
}

/// Also with every layer keeping its internals, where the eval borrows the first layer's kept
/// buffers as its scratch.
#[test]
fn eval_between_steps_changes_nothing_the_steps_compute() {
    let case = "llama_gqa";
    let (cfg, _) = model(case);
    let base = case_engine_config(case, 2, expected(case)["batch"].as_u64().unwrap() as usize);
    let all_kept = EngineConfig { checkpoint_every: 1, kept_layers: cfg.num_layers, ..base };
    for ecfg in [base, all_kept] {
        eval_between_steps(case, ecfg);
    }
}

fn eval_between_steps(case: &str, ecfg: EngineConfig) {
    let (cfg, params) = model(case);
    let rows = case_rows(case);
    let batch: Vec<&Row> = rows.iter().take(ecfg.batch_size).collect();
    let step = |e: &mut Engine<CpuDevice>| {
        let mbs = micro_batches(&batch, ecfg.micro_batch_size);
        e.step(mbs, StepParams { lr: 1e-2, inject_nan: false }).unwrap()
    };
    let mut plain = engine(&cfg, params.clone(), ecfg);
    let mut evaluated = engine(&cfg, params, ecfg);
    let (a0, b0) = (step(&mut plain), step(&mut evaluated));
    assert_eq!(a0, b0);
    // After the first update: the eval sees the updated masters (the queued updates first).
    let after = evaluated.eval(eval_mbs(&rows, 2)).unwrap();
    let (want, _) = reference(&cfg, &plain.state().params.clone(), &rows, 2, ecfg.seq_len);
    assert_eq!(after.loss_sum.to_bits(), want.to_bits());
    assert_eq!(step(&mut plain), step(&mut evaluated), "the step after an eval");
}
