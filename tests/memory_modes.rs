//! `optimizer.memory`: lean without clipping is bit-identical to exact (fixtures, and a random
//! model for 20 steps); a non-finite gradient never reaches masters or moments; compact tracks
//! exact on the default job; compact checkpoints resume bit-identically and are refused across
//! modes; `horizon plan` accounts for each mode and refuses what does not fit.

mod common;

use std::process::Command;

use common::*;
use horizon::engine::exec::Engine;
use horizon::engine::options::EngineConfig;
use horizon::hf::config::ModelConfig;
use horizon::model::params::ParamStore;
use horizon::run::config::{OptimizerMemory, RawConfig};
use horizon::run::trainer::Trainer;
use horizon::store::TrainState;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};

/// A state's fp32 moments (m, v).
fn mv(s: &TrainState) -> (ParamStore, ParamStore) {
    let (_, m, v) = s.clone_params_and_moments();
    (m, v)
}

/// The fixture case's steps on the engine with `grad_clip` 0, in `memory` mode: per-step
/// (loss, grad norm) and the final state.
fn fixture_run(
    case: &str,
    k: usize,
    mbs: usize,
    memory: OptimizerMemory,
) -> (Vec<(f64, f64)>, TrainState) {
    fixture_run_tiled(case, k, mbs, memory, None)
}

/// As [`fixture_run`], with the LM head in tiles of `head_tile_rows` vocabulary rows.
fn fixture_run_tiled(
    case: &str,
    k: usize,
    mbs: usize,
    memory: OptimizerMemory,
    head_tile_rows: Option<usize>,
) -> (Vec<(f64, f64)>, TrainState) {
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let layout = horizon::model::describe(&model);
    let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let cfg =
        EngineConfig { grad_clip: 0.0, memory, head_tile_rows, ..case_engine_config(case, k, mbs) };
    let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20));
    let state = TrainState::for_memory(params, &layout, memory);
    let mut engine = Engine::new(dev, &model, state, cfg).unwrap();
    let out = run_case_steps(&mut engine, case)
        .into_iter()
        .map(|(loss, norm, skipped)| {
            assert!(!skipped);
            (loss, norm)
        })
        .collect();
    (out, engine.into_state())
}

#[test]
fn lean_without_clipping_is_bit_identical_to_exact_on_the_fixtures() {
    for case in CASES {
        for (k, mbs) in [(1, 1), (2, 2), (3, 1)] {
            let (a, sa) = fixture_run(case, k, mbs, OptimizerMemory::Exact);
            let (b, sb) = fixture_run(case, k, mbs, OptimizerMemory::Lean);
            let what = format!("{case} K{k} micro-batch {mbs}");
            assert_eq!(a, b, "{what}: losses and gradient norms");
            assert_bit_identical(&format!("{what}: masters"), &sa.params, &sb.params);
            assert_bit_identical(&format!("{what}: m"), &mv(&sa).0, &mv(&sb).0);
            assert_bit_identical(&format!("{what}: v"), &mv(&sa).1, &mv(&sb).1);
            assert_eq!(sa.updates, sb.updates);
        }
    }
}

/// The same with the LM head in vocabulary tiles: the final norm's and head's gradients are
/// measured once complete (after the last tile), as with a whole head.
#[test]
fn lean_without_clipping_is_bit_identical_to_exact_with_a_tiled_head() {
    for case in CASES {
        for (k, mbs) in [(1, 1), (2, 2), (3, 1)] {
            let run = |memory| fixture_run_tiled(case, k, mbs, memory, Some(37));
            let ((a, sa), (b, sb)) = (run(OptimizerMemory::Exact), run(OptimizerMemory::Lean));
            let what = format!("{case} tiles of 37, K{k} micro-batch {mbs}");
            assert_eq!(a, b, "{what}: losses and gradient norms");
            assert_bit_identical(&format!("{what}: masters"), &sa.params, &sb.params);
            assert_bit_identical(&format!("{what}: m"), &mv(&sa).0, &mv(&sb).0);
            assert_bit_identical(&format!("{what}: v"), &mv(&sa).1, &mv(&sb).1);
            assert_eq!(sa.updates, sb.updates);
        }
    }
}

/// A random Llama on synthetic tokens: 5 layers, 2 micro-batches, K = 2, 3 gradient slabs
/// (so in `lean`/`compact` layers 4 and 3 are updated before the norm is known, layers 2..0
/// after), untied head.
fn random_yaml(
    out: &std::path::Path,
    steps: usize,
    clip: f64,
    memory: &str,
    extra: &str,
) -> String {
    random_yaml_slabs(out, steps, clip, memory, extra, 3)
}

fn random_yaml_slabs(
    out: &std::path::Path,
    steps: usize,
    clip: f64,
    memory: &str,
    extra: &str,
    slabs: usize,
) -> String {
    format!(
        "model: {{ init: random, arch: llama, hidden_size: 64, intermediate_size: 176, num_hidden_layers: 5,\n\
         \x20        num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 300, tie_word_embeddings: false }}\n\
         data: {{ format: synthetic }}\n\
         train: {{ steps: {steps}, batch_size: 4, micro_batch_size: 2, max_seq_len: 16{extra} }}\n\
         optimizer: {{ lr: 3.0e-3, grad_clip: {clip}, memory: {memory}, weight_decay: 0.1 }}\n\
         engine: {{ checkpoint_every: 2, grad_slabs: {slabs} }}\n\
         output: {{ dir: '{}' }}\n",
        out.display()
    )
}

fn trainer(yaml: &str) -> Trainer {
    let raw = RawConfig::from_yaml(yaml, "test").unwrap();
    Trainer::new(raw.resolve("test").unwrap()).unwrap()
}

#[test]
fn lean_without_clipping_is_bit_identical_to_exact_on_a_random_model_for_20_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for memory in ["exact", "lean"] {
        let mut t = trainer(&random_yaml(tmp.path(), 20, 0.0, memory, ""));
        let metrics: Vec<(f64, f64)> =
            (0..20).map(|k| t.step(k).unwrap()).map(|m| (m.loss, m.grad_norm)).collect();
        runs.push((metrics, t.engine.into_state()));
    }
    let ((ma, sa), (mb, sb)) = (&runs[0], &runs[1]);
    assert_eq!(ma, mb, "losses and gradient norms");
    assert!(ma.iter().all(|(l, n)| l.is_finite() && n.is_finite()));
    assert_bit_identical("masters", &sa.params, &sb.params);
    assert_bit_identical("m", &mv(sa).0, &mv(sb).0);
    assert_bit_identical("v", &mv(sa).1, &mv(sb).1);
    assert!(sb.grads.layers.iter().all(|l| l.is_empty()), "lean keeps no layer gradients");
}

#[test]
fn lean_without_clipping_is_bit_identical_to_exact_with_a_tiled_head_for_20_steps() {
    // `engine.head_tile_rows: 64` from the config: V = 300 in 5 tiles.
    let tmp = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for memory in ["exact", "lean"] {
        let yaml = random_yaml(tmp.path(), 20, 0.0, memory, "")
            .replace("grad_slabs: 3 }", "grad_slabs: 3, head_tile_rows: 64 }");
        let mut t = trainer(&yaml);
        assert_eq!(t.engine.sizes().head.tiles(), 5);
        let metrics: Vec<(f64, f64)> =
            (0..20).map(|k| t.step(k).unwrap()).map(|m| (m.loss, m.grad_norm)).collect();
        runs.push((metrics, t.engine.into_state()));
    }
    let ((ma, sa), (mb, sb)) = (&runs[0], &runs[1]);
    assert_eq!(ma, mb, "losses and gradient norms");
    assert!(ma.iter().all(|(l, n)| l.is_finite() && n.is_finite()));
    assert_bit_identical("masters", &sa.params, &sb.params);
    assert_bit_identical("m", &mv(sa).0, &mv(sb).0);
    assert_bit_identical("v", &mv(sa).1, &mv(sb).1);
}

#[test]
fn lean_with_a_slab_per_layer_clips_exactly() {
    // Every layer's gradient waits in its slab for the step's norm, as the embedding's, the
    // final norm's and the head's do in their host buffers: lean with clipping on is exact.
    let tmp = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for memory in ["exact", "lean"] {
        let mut t = trainer(&random_yaml_slabs(tmp.path(), 12, 0.05, memory, "", 5));
        let metrics: Vec<(f64, f64)> =
            (0..12).map(|k| t.step(k).unwrap()).map(|m| (m.loss, m.grad_norm)).collect();
        assert!(metrics.iter().all(|&(_, n)| n > 0.05), "clipping is active every step");
        runs.push((metrics, t.engine.into_state()));
    }
    let ((ma, sa), (mb, sb)) = (&runs[0], &runs[1]);
    assert_eq!(ma, mb, "losses and gradient norms");
    assert_bit_identical("masters", &sa.params, &sb.params);
    assert_bit_identical("m", &mv(sa).0, &mv(sb).0);
    assert_bit_identical("v", &mv(sa).1, &mv(sb).1);
}

#[test]
fn lean_corrects_the_first_steps_early_layer_updates() {
    // Layers 4 and 3 are updated before the first step's norm exists; the norm op then rescales
    // their moments to the step's clip coefficient, so after step 1 lean matches exact to
    // rounding (the rescale is one more multiplication). The masters need no correction because
    // AdamW's first step, lr * g / (|g| + eps), does not depend on the gradient's scale; eps is
    // made negligible here so that this holds for every element (with eps = 1e-8 the elements
    // whose clipped gradient is below ~1e-7 move by a few % of lr less or more than in exact).
    let tmp = tempfile::tempdir().unwrap();
    let yaml = |memory| {
        random_yaml(tmp.path(), 3, 0.05, memory, "")
            .replace("weight_decay: 0.1", "weight_decay: 0.1, eps: 1.0e-30")
    };
    let init = trainer(&yaml("exact")).engine.into_state().params;
    let mut states = Vec::new();
    for memory in ["exact", "lean"] {
        let mut t = trainer(&yaml(memory));
        let m = t.step(0).unwrap();
        assert!(m.grad_norm > 0.5, "clipping matters: norm {}", m.grad_norm);
        states.push((m.grad_norm, t.engine.into_state()));
    }
    let ((na, sa), (nb, sb)) = (&states[0], &states[1]);
    assert_eq!(na, nb, "the first step's norm");
    assert!(sb.last_sq.len() == sa.params.buffers().len() && sb.updates == 1);
    // Per buffer: the largest difference relative to the largest element (of the update, for
    // the masters).
    let rel = |a: &[f32], b: &[f32], base: Option<&[f32]>| {
        let (mut diff, mut scale) = (0f32, 0f32);
        for (j, (x, y)) in a.iter().zip(b).enumerate() {
            diff = diff.max((x - y).abs());
            scale = scale.max((x - base.map_or(0.0, |b| b[j])).abs());
        }
        diff / scale
    };
    let ((ma, va), (mb, vb)) = (mv(sa), mv(sb));
    for (i, p0) in init.buffers().iter().enumerate() {
        let got = [
            rel(sa.params.buffers()[i], sb.params.buffers()[i], Some(p0)),
            rel(ma.buffers()[i], mb.buffers()[i], None),
            rel(va.buffers()[i], vb.buffers()[i], None),
        ];
        // Layers 2..0, the embedding, final norm and head waited for the norm: bit-identical.
        let streamed = [4, 5].contains(&i);
        let tol = if streamed { 1e-5 } else { 0.0 };
        assert!(got.iter().all(|&r| r <= tol), "buffer {i}: update, m, v differ by {got:?}");
    }
}

#[test]
fn a_nan_gradient_never_reaches_masters_or_moments_in_streamed_modes() {
    for memory in ["lean", "compact"] {
        let tmp = tempfile::tempdir().unwrap();
        let mut t = trainer(&random_yaml(tmp.path(), 4, 0.0, memory, ""));
        t.inject_nan_at = vec![1];
        assert!(!t.step(0).unwrap().skipped);
        let snap = |t: &mut Trainer| {
            let s = t.engine.state();
            (s.params.clone(), s.opt.clone(), s.last_sq.clone())
        };
        let before = snap(&mut t);
        let m = t.step(1).unwrap();
        assert!(m.skipped && !m.grad_norm.is_finite(), "{memory}: {m:?}");
        // The poisoned gradient is the first one measured: nothing is written, and the norms
        // the next step estimates from stay the last finite step's.
        assert!(before == snap(&mut t), "{memory}: a skipped step wrote state");
        assert_eq!(t.engine.state().updates, 1);
        let m = t.step(2).unwrap();
        assert!(!m.skipped && m.loss.is_finite(), "{memory}: {m:?}");
        assert_eq!(t.engine.state().updates, 2);
    }
}

#[test]
fn compact_resumes_bit_identically_and_is_refused_across_modes() {
    let tmp = tempfile::tempdir().unwrap();
    let yaml = random_yaml(&tmp.path().join("a"), 4, 1.0, "compact", "");
    let mut straight = trainer(&yaml);
    for k in 0..4 {
        straight.step(k).unwrap();
    }
    let want = straight.engine.into_state();

    let mut first = trainer(&yaml);
    for k in 0..2 {
        first.step(k).unwrap();
    }
    let model_cfg = first.model_cfg.clone();
    let dir = horizon::run::resume::save(
        tmp.path(),
        first.engine.state(),
        &first.layout,
        &model_cfg,
        &yaml,
        2,
        &Default::default(),
    )
    .unwrap();
    assert!(dir.join("moments8.bin").is_file());
    drop(first);
    let raw = RawConfig::from_yaml(&yaml, "test").unwrap().resolve("test").unwrap();
    let mut resumed = Trainer::with_resume(raw, Some(&dir)).unwrap();
    for k in 2..4 {
        resumed.step(k).unwrap();
    }
    let got = resumed.engine.into_state();
    assert_bit_identical("masters", &want.params, &got.params);
    assert!(want.opt == got.opt, "8-bit moments differ after resume");

    let lean = random_yaml(&tmp.path().join("b"), 4, 1.0, "lean", "");
    let raw = RawConfig::from_yaml(&lean, "test").unwrap().resolve("test").unwrap();
    let err = Trainer::with_resume(raw, Some(&dir)).err().expect("refused").to_string();
    assert!(err.contains("compact") && err.contains("hint"), "{err}");

    // A `moments8.bin` of the first layout (blocks across tensors) is refused with a hint.
    let path = dir.join("moments8.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..8].copy_from_slice(b"HZNQ8v1\0");
    std::fs::write(&path, bytes).unwrap();
    // That layout's checkpoints recorded no checksums.
    let state = dir.join("state.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    v.as_object_mut().unwrap().retain(|k, _| k != "checksums" && k != "sealed");
    std::fs::write(&state, v.to_string()).unwrap();
    let raw = RawConfig::from_yaml(&yaml, "test").unwrap().resolve("test").unwrap();
    let err = Trainer::with_resume(raw, Some(&dir)).err().expect("refused");
    let err = format!("{err:#}");
    assert!(err.contains("moments8.bin") && err.contains("older layout"), "{err}");
}

#[test]
fn lean_and_exact_resume_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let exact = random_yaml(&tmp.path().join("a"), 4, 0.0, "exact", "");
    let mut straight = trainer(&exact);
    for k in 0..4 {
        straight.step(k).unwrap();
    }
    let want = straight.engine.into_state();
    let mut first = trainer(&exact);
    for k in 0..2 {
        first.step(k).unwrap();
    }
    let model_cfg = first.model_cfg.clone();
    let dir = horizon::run::resume::save(
        tmp.path(),
        first.engine.state(),
        &first.layout,
        &model_cfg,
        &exact,
        2,
        &Default::default(),
    )
    .unwrap();
    drop(first);
    let lean = random_yaml(&tmp.path().join("b"), 4, 0.0, "lean", "");
    let raw = RawConfig::from_yaml(&lean, "test").unwrap().resolve("test").unwrap();
    let mut resumed = Trainer::with_resume(raw, Some(&dir)).unwrap();
    for k in 2..4 {
        resumed.step(k).unwrap();
    }
    assert_bit_identical("masters", &want.params, &resumed.engine.into_state().params);
}

/// Mean of the last 10 logged losses of the default job (one step's loss depends on its batch)
/// with `steps` optimizer steps, `optimizer.memory: memory`, and model and data seed `seed`.
fn default_job_final_loss(steps: usize, memory: &str, seed: u64) -> f64 {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    horizon::run::default_job::write_data(&out).unwrap();
    let yaml = horizon::run::default_job::config_yaml(&out, steps);
    assert_eq!(yaml.matches("  seed: 0\n").count(), 2, "the default job's config changed shape");
    let yaml = yaml
        .replace("  seed: 0\n", &format!("  seed: {seed}\n"))
        .replace("  grad_clip: 1.0\n", &format!("  grad_clip: 1.0\n  memory: {memory}\n"));
    assert!(yaml.contains("memory: "), "the default job's config changed shape");
    let cfg = RawConfig::from_yaml(&yaml, "t").unwrap().resolve("t").unwrap();
    horizon::run::trainer::run_streaming(cfg, false, 0, None).unwrap();
    let losses: Vec<f64> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(losses.len(), steps);
    losses[steps - 10..].iter().sum::<f64>() / 10.0
}

/// The acceptance: compact's final loss on the default job within 2% of exact's.
///
/// Past ~120 steps the default job is chaotic under fp32 rounding: two exact runs whose only
/// difference is the summation order of some products end 6.7% apart at 300 steps and 2.3% at
/// 1000, so a 2% bound there tests luck, not the optimizer. At 120 steps (the whole cosine
/// schedule, 40 warm-up steps) exact runs agree far closer, and the bound means something; three
/// model/data seeds guard against one lucky seed. Each seed must be within 2%, and their mean
/// within 1%. Observed: -0.59%, +0.60%, +0.26% (mean +0.09%). `HORIZON_TEST_STEPS` and
/// `HORIZON_TEST_SEEDS` (a count) rerun it at other lengths and with more seeds.
#[test]
fn compact_on_the_default_job_is_within_two_percent_of_exact() {
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (steps, seeds) = (env("HORIZON_TEST_STEPS", 120), env("HORIZON_TEST_SEEDS", 3));
    let (mut sum_exact, mut sum_compact) = (0.0, 0.0);
    let mut worst = (0.0f64, 0);
    for seed in 0..seeds as u64 {
        let exact = default_job_final_loss(steps, "exact", seed);
        let compact = default_job_final_loss(steps, "compact", seed);
        let rel = (compact - exact) / exact;
        eprintln!(
            "default job, {steps} steps, seed {seed}: exact {exact:.5}, compact {compact:.5} ({:+.2}%)",
            rel * 100.0
        );
        if rel.abs() > worst.0.abs() {
            worst = (rel, seed);
        }
        sum_exact += exact;
        sum_compact += compact;
    }
    let mean_rel = (sum_compact - sum_exact) / sum_exact;
    eprintln!("mean over {seeds} seeds: compact {:+.2}% of exact", mean_rel * 100.0);
    assert!(worst.0.abs() <= 0.02, "seed {}: compact {:+.2}% of exact", worst.1, worst.0 * 100.0);
    assert!(mean_rel.abs() <= 0.01, "mean over seeds: compact {:+.2}% of exact", mean_rel * 100.0);
}

fn plan_yaml(layers: usize, memory: &str, device: &str) -> String {
    format!(
        "model: {{ init: random, arch: llama, hidden_size: 256, intermediate_size: 688, num_hidden_layers: {layers},\n\
         \x20        num_attention_heads: 4, num_key_value_heads: 4, vocab_size: 1000 }}\n\
         data: {{ format: synthetic }}\n\
         train: {{ steps: 1, batch_size: 8, micro_batch_size: 2, max_seq_len: 64 }}\n\
         optimizer: {{ memory: {memory} }}\n\
         engine: {{ checkpoint_every: 4, grad_slabs: 2 }}\n\
         device: {{ memory: {device} }}\n"
    )
}

#[test]
fn plan_bytes_per_parameter_by_mode() {
    use horizon::run::plan::{deepest_fit, largest_micro_batch, plan_for};
    let mut per_param = Vec::new();
    for memory in ["exact", "lean", "compact"] {
        let raw = RawConfig::from_yaml(&plan_yaml(48, memory, "auto"), "t").unwrap();
        let model = horizon::run::load::model_config(&raw).unwrap();
        let ecfg = raw.engine_config();
        let plan = plan_for(&model, &ecfg, None);
        let host: u64 = plan.host.iter().map(|(_, b)| b).sum();
        per_param.push(host as f64 / plan.params as f64);
        // The deepest fit is exact: one more layer would not fit.
        let avail = plan.host_total() * 3;
        let (layers, _, bytes) = deepest_fit(&model, &ecfg, avail).unwrap();
        assert!(bytes <= avail && layers > 48, "{memory}: {layers} layers, {bytes} B");
        let mut deeper = model.clone();
        deeper.num_layers = layers + 1;
        assert!(plan_for(&deeper, &ecfg, None).host_total() > avail);
        // The largest micro-batch for a budget: fits, and one row more does not.
        let budget = plan.device_total();
        assert_eq!(largest_micro_batch(&model, &ecfg, budget), 2);
        assert!(largest_micro_batch(&model, &ecfg, budget * 4) > 2);
    }
    // Host bytes without staging and checkpoints, per parameter: ~16, ~12 (+ embedding and
    // head gradients), ~6.
    let [exact, lean, compact] = per_param[..] else { unreachable!() };
    assert!(exact > 16.0 && exact < 16.5, "exact {exact}");
    assert!(lean > 12.0 && lean < 12.6, "lean {lean}");
    assert!(compact > 6.0 && compact < 6.6, "compact {compact}");
}

#[test]
fn horizon_plan_reports_and_refuses() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |yaml: &str| {
        let cfg = tmp.path().join("c.yaml");
        std::fs::write(&cfg, yaml).unwrap();
        Command::new(env!("CARGO_BIN_EXE_horizon"))
            .args(["plan", "--config", cfg.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let o = run(&plan_yaml(8, "lean", "auto"));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    let threads = "engine.host_threads: auto -> ";
    let pinned = "of which pinned (page-locked): none";
    for want in
        ["B/param", "exact", "lean", "compact", "deepest that fits", "fits", threads, pinned]
    {
        assert!(out.contains(want), "plan output lacks {want:?}:\n{out}");
    }
    // A device budget too small: refused, with the numbers and the largest micro-batch.
    let o = run(&plan_yaml(8, "lean", "1MiB"));
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(!o.status.success());
    assert!(err.contains("device.memory") && err.contains("GiB"), "{err}");
    assert!(out.contains("not even a micro-batch of 1 row fits"), "{out}");
    // A model larger than the host: refused by `plan`, and by `train` before allocating.
    let huge = plan_yaml(8, "compact", "auto").replace("hidden_size: 256", "hidden_size: 65536");
    let o = run(&huge);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("host memory"), "{err}");
    let raw = RawConfig::from_yaml(&huge, "t").unwrap().resolve("t").unwrap();
    let err = Trainer::new(raw).err().expect("refused").to_string();
    assert!(err.contains("host memory") && err.contains("GiB"), "{err}");
}
