//! DPO against TRL 1.16's float64 fixtures (`tests/fixtures/dpo`, from ../shared/fixtures-dpo),
//! on the reference path and the streaming engine (CPU device here; CUDA in
//! `tests/cuda_engine.rs`): every step's loss, grad norm and logged reward metrics, the step-0
//! gradient of every trained tensor, and the trained tensors by update error. The tolerances
//! are the fixtures' README's: max(1e-5, 10x float32 PyTorch's error) on losses and grad norms,
//! max(1e-5, 10x its error) on the metrics, max(1e-3, 10x its update error) per tensor.

mod common;

use std::path::Path;

use common::dpo::{SAME_CHUNKS, assert_loss_and_norm, dir, expected, streamed, trainer};
use common::update_rel_err;
use horizon::hf::checkpoint::read_tensor_f64;
use horizon::model::dpo::{DpoLossKind, DpoObjective};
use horizon::run::config::{BackendKind, RawConfig};
use horizon::run::dpo_reference::PairRows;
use horizon::run::load::PEFT_PREFIX;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};

/// The CPU device with a few MiB.
fn cpu() -> CpuDevice {
    CpuDevice::new(CpuDeviceConfig::with_capacity(8 << 20))
}

/// Our name of a fixture tensor: HF names as they are, PEFT names without PEFT's prefix.
fn ours(name: &str) -> &str {
    name.strip_prefix(PEFT_PREFIX).unwrap_or(name)
}

/// Step 0's loss, grad norm, metrics and every trained tensor's gradient.
#[test]
fn step0_matches_trl() {
    for case in ["dpo_llama_full", "dpo_qwen2_lora"] {
        let e = expected(case);
        let pt = &e["pytorch_fp32"];
        let mut t = trainer(case, "");
        let got = t.step(0).unwrap();
        let want = &e["per_step"][0];
        assert_loss_and_norm(case, (got.loss, got.grad_norm), want, pt);
        let m = got.metrics;
        for (name, v) in [
            ("rewards_chosen", m.rewards_chosen),
            ("rewards_rejected", m.rewards_rejected),
            ("reward_margin", m.reward_margin),
            ("logps_chosen", m.logps_chosen),
            ("logps_rejected", m.logps_rejected),
            ("reward_accuracy", m.reward_accuracy),
        ] {
            let w = want[name].as_f64().unwrap();
            let abs_tol = (10.0 * pt["metrics_max_abs_err"][name].as_f64().unwrap()).max(1e-5);
            assert!((v - w).abs() <= abs_tol, "{case} {name}: {v} vs {w}");
        }
        // The gradients, before the update (step() ran it): the fixture's against ours.
        let grads = read_names(&dir(case).join("step0_grads.safetensors"));
        let max = grads
            .iter()
            .map(|(_, g)| g.iter().fold(0.0f64, |a, x| a.max(x.abs())))
            .fold(0.0, f64::max);
        for (name, want) in &grads {
            let got = t
                .state
                .grads
                .tensor(&t.engine.layout, ours(name))
                .unwrap_or_else(|| panic!("{name}"));
            let err =
                got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / max;
            let tol =
                (10.0 * pt["step0_grad_err_over_model_max_grad"][name].as_f64().unwrap()).max(1e-6);
            assert!(
                err <= tol,
                "{case} step-0 gradient of {name}: {err:.2e} of the largest > {tol:.1e}"
            );
        }
    }
}

/// Every tensor of a safetensors file, by name, as f64.
fn read_names(path: &Path) -> Vec<(String, Vec<f64>)> {
    let bytes = std::fs::read(path).unwrap();
    let names: Vec<String> = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap()
        .names()
        .into_iter()
        .map(String::from)
        .collect();
    names.into_iter().map(|n| (n.clone(), read_tensor_f64(path, &n).unwrap().1)).collect()
}

/// Every step's loss, grad norm and metrics, and the trained tensors after the last step, with
/// the HF Trainer's weight-decay groups (`optimizer.no_decay: hf`: norms and biases undecayed).
#[test]
fn every_step_and_the_trained_tensors_match_trl() {
    for case in ["dpo_llama_full", "dpo_qwen2_lora"] {
        every_step(case);
    }
}

fn every_step(case: &str) {
    let e = expected(case);
    let pt = &e["pytorch_fp32"];
    let mut t = trainer(case, "");
    let init = t.state.params.clone();
    for (k, want) in e["per_step"].as_array().unwrap().iter().enumerate() {
        let got = t.step(k).unwrap();
        assert_loss_and_norm(&format!("{case} step {k}"), (got.loss, got.grad_norm), want, pt);
        let margin = want["reward_margin"].as_f64().unwrap();
        assert!((got.metrics.reward_margin - margin).abs() <= 1e-4, "{case} step {k} margin");
    }
    for (name, want) in read_names(&dir(case).join("final.safetensors")) {
        let got = t.state.params.tensor(&t.engine.layout, ours(&name)).unwrap();
        let start = init.tensor(&t.engine.layout, ours(&name)).unwrap();
        let err = update_rel_err(got, start, &want);
        let tol = (10.0 * pt["update_rel_l2_err"][&name].as_f64().unwrap()).max(1e-3);
        assert!(err <= tol, "{case} {name}: update error {err:.2e} > {tol:.1e}");
    }
}

/// The streamed engine: with the whole batch as one micro-batch, bit for bit the reference path
/// (losses, grad norms, metrics, trained tensors); with micro-batches of one row (K = 1, 2) and
/// of three rows with the head in tiles, within the fixtures' tolerances of TRL.
#[test]
fn streamed_engine_matches_the_reference_path_and_trl() {
    for case in ["dpo_llama_full", "dpo_qwen2_lora"] {
        let e = expected(case);
        let batch = e["batch"].as_u64().unwrap() as usize;
        let mut reference = trainer(case, SAME_CHUNKS);
        let want: Vec<_> = (0..e["steps"].as_u64().unwrap() as usize)
            .map(|s| reference.step(s).unwrap())
            .collect();
        let (got, end) = streamed(cpu(), case, (1, 2 * batch, None), BackendKind::Cpu);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                (g.loss, g.grad_norm, g.metrics),
                (w.loss, w.grad_norm, w.metrics),
                "{case} step {k}"
            );
        }
        assert_eq!(end, reference.state.params, "{case}: the trained tensors");
        let pt = &e["pytorch_fp32"];
        // The head in tiles of 100 vocabulary rows (two passes) in the last.
        for (k, mbs, tile) in [(1, 1, None), (2, 1, None), (2, 3, Some(100))] {
            let (got, _) = streamed(cpu(), case, (k, mbs, tile), BackendKind::Cpu);
            for (s, (g, want)) in got.iter().zip(e["per_step"].as_array().unwrap()).enumerate() {
                let what = format!("{case} K {k} micro-batches of {mbs}: step {s}");
                assert_loss_and_norm(&what, (g.loss, g.grad_norm), want, pt);
            }
        }
    }
}

/// A random-model engine for the benchmark: `adapter` is the YAML line of the adapter (or
/// empty; `# live`: with the live reference's copy), rows of `t` tokens, `rows` a step.
fn bench_engine(
    adapter: &str,
    rows: usize,
    t: usize,
) -> horizon::engine::exec::Engine<horizon_backend::cpu::CpuDevice> {
    use horizon::engine::exec::Engine;
    use horizon::run::load::{RunModel, load_run_model};
    use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};
    let yaml = format!(
        "model: {{ init: random, arch: llama, hidden_size: 512, intermediate_size: 1376, \
         num_hidden_layers: 4, num_attention_heads: 8, num_key_value_heads: 8, vocab_size: 8000 }}\n\
         data: {{ path: unused.jsonl }}\ntrain: {{ batch_size: {rows}, max_seq_len: {t} }}\n{adapter}"
    );
    let cfg = RawConfig::from_yaml(&yaml, "bench").unwrap().resolve("bench").unwrap();
    let RunModel { layout, params, base, .. } =
        load_run_model(&cfg.raw, cfg.adapter.as_ref()).unwrap();
    let live = adapter.contains("live");
    let ecfg = horizon::engine::options::EngineConfig {
        seq_len: t,
        reference_copy: live,
        ..cfg.raw.engine_config()
    };
    let state = horizon::store::TrainState::for_memory(params, &layout, ecfg.memory);
    let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(1 << 30));
    Engine::with_layout(dev, layout, base.map(std::sync::Arc::new), state, ecfg).unwrap()
}

/// What a DPO step costs against an SFT step over the same rows (a live reference's step: its
/// reference pass and the step, as `DpoRun` takes them), and the precomputed reference pass
/// against an epoch (issue 47's benchmark): medians of interleaved runs on the CPU device. `cargo test --release --test dpo_fixtures -- --ignored --nocapture dpo_cost`.
#[test]
#[ignore = "a benchmark"]
fn dpo_cost_against_sft() {
    use horizon::run::dpo_streamed::DpoStreamed;
    use std::time::Instant;
    let (pairs_n, batch, t) = (16, 4, 128);
    let mut x = 7u64;
    let mut tok = |n: usize| -> Vec<i32> {
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) % 8000) as i32
            })
            .collect()
    };
    let pairs: Vec<PairRows> =
        (0..pairs_n).map(|_| PairRows::new(&tok(64), &tok(64), &tok(64))).collect();
    let objective =
        DpoObjective { beta: 0.1, losses: vec![(DpoLossKind::Sigmoid, 1.0)], label_smoothing: 0.0 };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let variants = [
        ("LoRA r 16", "adapter: { type: lora, r: 16 }\n"),
        ("full", ""),
        ("full, live reference", "# live\n"),
    ];
    for (name, adapter) in variants {
        let sft_rows: Vec<&horizon::data::Row> =
            pairs[..batch].iter().flat_map(|p| [&p.chosen, &p.rejected]).collect();
        let mut sft = bench_engine(adapter, 2 * batch, t);
        let mut dpo = DpoStreamed::new(
            bench_engine(adapter, 2 * batch, t),
            objective.clone(),
            pairs.clone(),
            (batch, batch),
            Some(vec![(0.0, 0.0); pairs_n]),
        )
        .unwrap();
        let (mut s_times, mut d_times) = (Vec::new(), Vec::new());
        for k in 0..6 {
            let mbs = horizon::run::data::micro_batches(&sft_rows, 2 * batch);
            let t0 = Instant::now();
            sft.step(mbs, horizon::engine::exec::StepParams { lr: 1e-4, inject_nan: false })
                .unwrap();
            sft.eval(Vec::new()).unwrap(); // waits for the step's queued updates
            s_times.push(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            if adapter.contains("live") {
                let mbs = horizon::run::data::micro_batches(&sft_rows, 2 * batch);
                dpo.engine.reference_row_logps(mbs).unwrap();
            }
            dpo.step(k % (pairs_n / batch), 1e-4).unwrap();
            dpo.engine.eval(Vec::new()).unwrap();
            d_times.push(t0.elapsed().as_secs_f64());
        }
        let (s, d) = (median(s_times[1..].to_vec()), median(d_times[1..].to_vec()));
        println!(
            "{name}: SFT step {s:.3} s, DPO step {d:.3} s: {:.2}x (median of 5, rows of {t}, {} rows a step)",
            d / s,
            2 * batch
        );
        // The precomputed reference pass (full fine-tuning) against an epoch of DPO steps.
        if adapter.is_empty() {
            let t0 = Instant::now();
            let _ = DpoStreamed::new(
                bench_engine(adapter, 2 * batch, t),
                objective.clone(),
                pairs.clone(),
                (batch, batch),
                None,
            )
            .unwrap();
            let pass = t0.elapsed().as_secs_f64();
            let epoch = d * (pairs_n / batch) as f64;
            println!(
                "precomputed reference pass {pass:.3} s (engine set-up included) vs an epoch of {} DPO steps {epoch:.3} s: {:.2}x",
                pairs_n / batch,
                pass / epoch
            );
        }
    }
}
