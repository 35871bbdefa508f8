//! The streaming engine against the reference path and the HF fixtures: every fixture case,
//! checkpoint intervals K in {1, 2, 3}, micro-batches of 1 row and of the whole batch, on the
//! CPU device — unthrottled, and with random delays on its copy queues; the same with the LM
//! head applied in vocabulary tiles (`engine.head_tile_rows`).

mod common;

use common::*;
use horizon::engine::exec::Engine;
use horizon::engine::options::EngineConfig;
use horizon::hf::config::ModelConfig;
use horizon::model::params::ParamStore;
use horizon::run::config::RawConfig;
use horizon::run::data::tokens_of;
use horizon::run::reference::ReferenceTrainer;
use horizon::store::TrainState;
use horizon_backend::Queue;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig, WaitMode};

/// Per-step (loss, grad norm) and the final parameters of the reference path.
fn reference(case: &str) -> (Vec<(f64, f64)>, ParamStore) {
    let yaml = case_yaml(case, "engine: { head_chunk_rows: 7 }\n");
    let cfg = RawConfig::from_yaml(&yaml, case).unwrap().resolve(case).unwrap();
    let mut t = ReferenceTrainer::new(cfg).unwrap();
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
    streamed_with(case, k, 0, mbs, jitter_us, seed)
}

/// As [`streamed`]; `kept` layers (at most the model's depth) keep their internals for their
/// backward (non-zero needs K = 1).
fn streamed_with(
    case: &str,
    k: usize,
    kept: usize,
    mbs: usize,
    jitter_us: u64,
    seed: u64,
) -> (Vec<(f64, f64)>, ParamStore, ParamStore) {
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let kept_layers = kept.min(model.num_layers);
    let cfg = EngineConfig { kept_layers, ..case_engine_config(case, k, mbs) };
    run_engine(case, cfg, jitter_us, seed)
}

/// Run the engine with `cfg` over the fixture's steps, on the CPU device with copy delays of
/// up to `jitter_us` (drawn from `seed`).
fn run_engine(
    case: &str,
    cfg: EngineConfig,
    jitter_us: u64,
    seed: u64,
) -> (Vec<(f64, f64)>, ParamStore, ParamStore) {
    run_engine_waiting(case, cfg, (jitter_us, seed), WaitMode::Block)
}

/// [`run_engine`] with the compute and host queues waiting as `wait` says.
fn run_engine_waiting(
    case: &str,
    cfg: EngineConfig,
    (jitter_us, seed): (u64, u64),
    wait: WaitMode,
) -> (Vec<(f64, f64)>, ParamStore, ParamStore) {
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let layout = horizon::model::describe(&model);
    let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let init = params.clone();
    // A device budget of a few MiB: every fixture's plan fits in 4 MiB.
    let dev = CpuDevice::new(CpuDeviceConfig {
        copy_jitter_us: jitter_us,
        jitter_seed: seed,
        wait,
        pin_threads: cfg.pin_threads,
        ..CpuDeviceConfig::with_capacity(4 << 20)
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
        // K = 1, 2, 3 recomputing; K = 1 keeping one, two or every layer's internals (the
        // others recomputing; none recomputing).
        for (k, keep) in [(1, 0), (2, 0), (3, 0), (1, 1), (1, 2), (1, usize::MAX)] {
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

/// Compute and host queues that spin while they wait (`device.wait: spin`) change nothing
/// either, with or without copy delays.
#[test]
fn spinning_waits_do_not_change_results() {
    for case in CASES {
        for (k, mbs) in [(1, 1), (3, 2)] {
            let cfg = || case_engine_config(case, k, mbs);
            let (base, _, base_params) = run_engine(case, cfg(), 0, 0);
            for (jitter, seed) in [(0, 0), (300, 1), (300, 2)] {
                let spin = run_engine_waiting(case, cfg(), (jitter, seed), WaitMode::Spin);
                let what = format!("{case} K={k} mbs={mbs} spin, jitter {jitter} seed {seed}");
                assert_eq!(spin.0, base, "{what}");
                assert_bit_identical(&what, &spin.2, &base_params);
            }
        }
    }
}

/// Telling each step the next one's token ids, so that the embedding rows they gather are
/// updated first and the rest later (`Engine::step_ahead`), changes no bit of the losses, the
/// masters or the moments: in exact, lean and compact mode (8-bit moments take every row in
/// the first part), tied and untied embeddings, one and two micro-batches.
#[test]
fn updating_the_next_steps_embedding_rows_first_changes_no_bit() {
    use horizon::run::config::OptimizerMemory;
    for case in CASES {
        for memory in [OptimizerMemory::Exact, OptimizerMemory::Lean, OptimizerMemory::Compact] {
            for mbs in [1, 2] {
                let run = |ahead: bool| {
                    let model =
                        ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
                    let layout = horizon::model::describe(&model);
                    let params =
                        ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
                    let state = TrainState::for_memory(params, &layout, memory);
                    let cfg = EngineConfig { memory, ..case_engine_config(case, 1, mbs) };
                    let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(4 << 20));
                    let mut engine = Engine::new(dev, &model, state, cfg).unwrap();
                    let steps = run_case_steps_ahead(&mut engine, case, ahead);
                    (steps, engine.into_state().clone_params_and_moments())
                };
                let (want, (wp, wm, wv)) = run(false);
                let (got, (gp, gm, gv)) = run(true);
                let what = format!("{case} {memory:?} mbs={mbs}");
                assert_eq!(got, want, "{what}: losses");
                assert_bit_identical(&format!("{what} masters"), &gp, &wp);
                assert_bit_identical(&format!("{what} m"), &gm, &wm);
                assert_bit_identical(&format!("{what} v"), &gv, &wv);
            }
        }
    }
}

/// Step-0 loss of `model` (the llama_gqa weights) through the reference path and through the
/// engine with K = 1 and 2 (one micro-batch: bit-identical).
fn step0_losses(model: &ModelConfig) -> Vec<f64> {
    step0_losses_of("llama_gqa", model)
}

/// [`step0_losses`] with `case`'s weights and rows.
fn step0_losses_of(case: &str, model: &ModelConfig) -> Vec<f64> {
    use horizon::model::transformer::{Capacity, Transformer};
    let layout = horizon::model::describe(model);
    let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let rows = case_rows(case);
    let batch = expected(case)["batch"].as_u64().unwrap() as usize;
    let rows: Vec<_> = rows[..batch].iter().collect();
    let b = horizon::data::pretokenized::make_batch(&rows);
    let cap = Capacity { batch, seq_len: 32, head_chunk_rows: 7 };
    let mut t = Transformer::new(horizon_backend::CpuBackend, model, cap);
    let mut grads = params.clone();
    grads.fill_zero();
    let mut out =
        vec![t.forward_backward(&params, &mut grads, tokens_of(&b), b.num_targets).unwrap().loss()];
    for k in [1, 2] {
        let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20));
        let cfg = case_engine_config(case, k, batch);
        let mut e = Engine::new(dev, model, TrainState::new(params.clone()), cfg).unwrap();
        let sp = horizon::engine::exec::StepParams { lr: 0.0, inject_nan: false };
        let mbs = horizon::run::data::micro_batches(&rows, e.config().micro_batch_size);
        out.push(e.step(mbs, sp).unwrap().loss());
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

/// Mixtral's `sliding_window` makes every layer a sliding one, through the same windowed
/// kernels: a window as wide as the rows changes nothing, a narrower one changes the loss; the
/// engine equals the reference path.
#[test]
fn mixtral_sliding_window_runs_through_the_windowed_kernels() {
    let path = case_dir("mixtral").join("model/config.json");
    let mut raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    raw["sliding_window"] = serde_json::Value::Null;
    let full = step0_losses_of("mixtral", &ModelConfig::from_json(&raw, "mixtral").unwrap());
    raw["sliding_window"] = 64.into();
    let wide = step0_losses_of("mixtral", &ModelConfig::from_json(&raw, "W=64").unwrap());
    raw["sliding_window"] = 5.into();
    let narrow = ModelConfig::from_json(&raw, "mixtral W=5").unwrap();
    assert_eq!(narrow.layer_types, vec![horizon::hf::config::LayerType::Sliding; 2]);
    let narrow = step0_losses_of("mixtral", &narrow);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&wide), bits(&full), "a window of the whole row is full attention");
    assert!(bits(&narrow).windows(2).all(|w| w[0] == w[1]), "engine == reference: {narrow:?}");
    assert!((narrow[0] - full[0]).abs() > 1e-4, "the window changes the loss: {narrow:?}");
}

/// The engine config of `case` with the LM head in tiles of `rows` vocabulary rows.
fn tiled_config(case: &str, k: usize, mbs: usize, rows: usize) -> EngineConfig {
    EngineConfig { head_tile_rows: Some(rows), ..case_engine_config(case, k, mbs) }
}

/// The LM head in tiles of 37 vocabulary rows (7 to 9 tiles, the last one ragged: V is 256,
/// 300 or 320), two passes over the tiles: the fixtures' losses, norms and updates within the
/// tolerance table, for every K and for micro-batches of one row and of the whole batch, tied
/// heads included. (As with `head_chunk_rows`, the tile size moves the summation order, and the
/// update error of `qwen2_tied_padded`'s layer-2 key bias lies in the noise band the tolerance
/// table describes: 0.53e-3 to 1.84e-3 over tile sizes 1..250, against a bound of 1.73e-3.)
#[test]
fn a_tiled_head_matches_the_fixtures() {
    for case in CASES {
        let batch = expected(case)["batch"].as_u64().unwrap() as usize;
        for k in [1, 2, 3] {
            for mbs in [1, batch] {
                let (steps, init, params) = run_engine(case, tiled_config(case, k, mbs, 37), 0, 0);
                let what = format!("tiles of 37, K={k}, mbs={mbs}");
                assert_matches_fixture(case, &what, &steps, &init, &params);
            }
        }
    }
}

/// A tiled head against the whole head on the engine, first step (before AdamW turns rounding
/// into updates): the same f32 products, only the softmax sums (combined over the tiles) and
/// the order `dhf` adds the tiles in differ, so the loss and the gradient norm agree within
/// 1e-6 relative (observed at most 7.4e-8). Tiles of 1 row (every id its own tile), 37 and 100 (a ragged last tile).
#[test]
fn a_tiled_head_matches_the_whole_head_on_the_first_step() {
    for case in CASES {
        let batch = expected(case)["batch"].as_u64().unwrap() as usize;
        for mbs in [1, batch] {
            let (whole, _, _) = run_engine(case, case_engine_config(case, 1, mbs), 0, 0);
            for rows in [1, 37, 100] {
                let (tiled, _, _) = run_engine(case, tiled_config(case, 1, mbs, rows), 0, 0);
                let what = format!("{case} tiles of {rows}, mbs={mbs}");
                assert_rel(&format!("{what}: loss"), tiled[0].0, whole[0].0, 1e-6);
                assert_rel(&format!("{what}: grad norm"), tiled[0].1, whole[0].1, 1e-6);
            }
        }
    }
}

/// The plan of a tiled head: 3 or more tiles, and weight slots that hold a layer.
#[test]
fn a_forced_tile_size_cuts_the_head_into_tiles() {
    for case in CASES {
        let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
        let layout = horizon::model::describe(&model);
        // 100 rows, or a third of a smaller vocabulary.
        let rows = 100.min(model.vocab_size / 3);
        let sizes = horizon::engine::sizes::Sizes::new(&layout, &tiled_config(case, 1, 1, rows));
        assert!(sizes.head.tiles() >= 3, "{case}: {:?}", sizes.head);
        assert_eq!(sizes.slot, layout.max_layer_len(), "{case}");
        let whole = horizon::engine::sizes::Sizes::new(&layout, &case_engine_config(case, 1, 1));
        assert!(whole.head.is_whole(), "{case}: the fixtures' heads fit in a slot");
    }
}

/// Copy-queue delays never change a tiled head's numbers either.
#[test]
fn copy_queue_delays_do_not_change_a_tiled_head() {
    for case in CASES {
        for (k, mbs) in [(1, 1), (3, 2)] {
            let cfg = tiled_config(case, k, mbs, 37);
            let (base, _, base_params) = run_engine(case, cfg, 0, 0);
            for seed in 1..=4 {
                let (steps, _, params) = run_engine(case, cfg, 300, seed);
                let what = format!("{case} tiled K={k} mbs={mbs} seed {seed}");
                assert_eq!(steps, base, "{what}");
                assert_bit_identical(&what, &params, &base_params);
            }
        }
    }
}

/// Fixture `case`'s config with `extra` (`, key: value` pairs) added to its `engine:`
/// section, resolved.
fn with_engine_keys(case: &str, extra: &str) -> anyhow::Result<horizon::run::config::RunConfig> {
    let yaml = case_yaml(case, &format!("engine: {{ head_chunk_rows: 7{extra} }}\n"));
    RawConfig::from_yaml(&yaml, case).and_then(|r| r.resolve(case))
}

/// Each step's (loss, grad norm) as bits, for exact comparison.
fn step_bits(v: &[(f64, f64)]) -> Vec<(u64, u64)> {
    v.iter().map(|(l, g)| (l.to_bits(), g.to_bits())).collect()
}

/// `engine.host_threads` is parsed (`auto`, a count; 0 and words refused naming the key) and
/// reaches the engine, whose host queue runs on a pool of exactly that many threads.
#[test]
fn host_threads_are_parsed_and_reach_the_engine() {
    use horizon::run::config::{BackendKind, HostThreads};
    let case = "llama_gqa";
    let parse = |extra: &str| with_engine_keys(case, extra);
    let auto = parse("").unwrap();
    assert_eq!(auto.raw.engine.host_threads, HostThreads::Auto);
    let three = parse(", host_threads: 3").unwrap();
    let ecfg = three.raw.engine_config();
    assert_eq!(ecfg.host_threads, HostThreads::Count(3));
    assert_eq!(parse(", host_threads: auto").unwrap().raw.engine.host_threads, HostThreads::Auto);
    for bad in [", host_threads: 0", ", host_threads: many", ", host_threads: -2"] {
        let err = format!("{:#}", parse(bad).unwrap_err());
        assert!(err.contains("engine.host_threads"), "{bad}: the error names no key: {err}");
    }
    // `auto`: the cores the queues leave, never 0.
    for cores in [1, 2, 3, 16] {
        for backend in [BackendKind::Cpu, BackendKind::Cuda] {
            let n = HostThreads::Auto.resolve_for(backend, cores);
            assert!(n >= 1 && n <= cores, "{backend:?} on {cores} cores: {n} host threads");
        }
    }
    assert_eq!(HostThreads::Auto.resolve_for(BackendKind::Cuda, 16), 15);
    assert_eq!(HostThreads::Auto.resolve_for(BackendKind::Cpu, 16), 8);
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let params =
        ParamStore::load_hf(&horizon::model::describe(&model), &case_dir(case).join("model"))
            .unwrap();
    let cfg = EngineConfig { host_threads: ecfg.host_threads, ..case_engine_config(case, 2, 1) };
    let dev = CpuDevice::new(CpuDeviceConfig::with_capacity(4 << 20));
    let engine = Engine::new(dev, &model, TrainState::new(params), cfg).unwrap();
    assert_eq!(engine.host_threads(), 3);
}

/// `engine.pin_threads` is parsed (true by default) and reaches the engine; pinning the
/// kernels' and the host threads (or not) changes where threads run, never the bits.
#[test]
fn pinned_threads_are_configurable_and_change_no_bits() {
    let case = "llama_gqa";
    let parse = |extra: &str| with_engine_keys(case, extra);
    assert!(parse("").unwrap().raw.engine.pin_threads);
    let free = parse(", pin_threads: false").unwrap();
    assert!(!free.raw.engine_config().pin_threads);
    let err = format!("{:#}", parse(", pin_threads: sometimes").unwrap_err());
    assert!(err.contains("pin_threads"), "the error names no key: {err}");
    let run = |pin: bool| {
        let cfg = EngineConfig { pin_threads: pin, ..case_engine_config(case, 2, 1) };
        run_engine(case, cfg, 0, 0)
    };
    let ((pinned, _, p1), (unpinned, _, p2)) = (run(true), run(false));
    assert_eq!(step_bits(&pinned), step_bits(&unpinned), "per-step loss and grad norm");
    assert_bit_identical("pinned vs unpinned", &p1, &p2);
}

/// The calling thread's EEVDF time slice in ns (`se.slice` of /proc/thread-self/sched), where
/// the kernel reports one.
#[cfg(target_os = "linux")]
fn thread_slice_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/sched").ok()?;
    let line = text.lines().find(|l| l.starts_with("se.slice"))?;
    line.split(':').nth(1)?.trim().parse().ok()
}

/// With `engine.pin_threads`, the thread that runs the host queue's work (and hands it to the
/// host pool) is pinned to the CPU of the pool's first thread, the last allowed one, and the
/// other queues' threads run on the CPUs the host thread leaves; without it, every queue's
/// thread runs anywhere the process may. Either way the copy queues' threads run with the
/// shortest time slice where the kernel takes one (Linux 6.12 and later).
#[cfg(target_os = "linux")]
#[test]
fn the_host_queue_thread_runs_beside_its_pool() {
    use horizon_backend::Device;
    use horizon_backend::threads::{allowed_cpus, short_slice_current_thread};
    // Whether this kernel keeps a thread's own slice (older ones take the call and ignore it).
    let custom_slices = std::thread::spawn(|| {
        short_slice_current_thread(100) && thread_slice_ns() == Some(100_000)
    })
    .join()
    .unwrap();
    let case = "llama_gqa";
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let params =
        ParamStore::load_hf(&horizon::model::describe(&model), &case_dir(case).join("model"));
    let params = params.unwrap();
    let all = allowed_cpus();
    for pin in [true, false] {
        let cfg = EngineConfig {
            pin_threads: pin,
            host_threads: horizon::run::config::HostThreads::Count(1),
            ..case_engine_config(case, 2, 1)
        };
        let dev = CpuDevice::new(CpuDeviceConfig {
            pin_threads: pin,
            ..CpuDeviceConfig::with_capacity(4 << 20)
        });
        let engine = Engine::new(dev, &model, TrainState::new(params.clone()), cfg).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        for q in Queue::ALL {
            let tx = tx.clone();
            let probe = move || tx.send((q, allowed_cpus(), thread_slice_ns())).unwrap();
            engine.device().host_on(q, Box::new(probe));
        }
        engine.device().synchronize();
        let masks: Vec<_> = rx.try_iter().collect();
        assert_eq!(masks.len(), Queue::ALL.len(), "every queue ran its probe");
        for (q, mask, slice) in masks {
            if custom_slices && matches!(q, Queue::H2D | Queue::D2H) {
                assert_eq!(slice, Some(100_000), "pin_threads {pin}: the {q:?} thread's slice");
            }
            let want = match (pin, q) {
                (false, _) => all.clone(),
                (true, Queue::Host) => vec![*all.last().unwrap()],
                // Off the host thread's CPU, where there is another.
                (true, _) if all.len() > 1 => all[..all.len() - 1].to_vec(),
                (true, _) => all.clone(),
            };
            assert_eq!(mask, want, "pin_threads {pin}: the {q:?} queue thread's CPUs");
        }
    }
}

/// The host work (AdamW, the 8-bit moments' update, gradient accumulation, norms) gives the
/// same bits on 1 host thread as on 2: its parallel parts split at fixed chunk boundaries and
/// reduce in a fixed order.
#[test]
fn host_thread_count_does_not_change_results() {
    use horizon::run::config::{HostThreads, OptimizerMemory};
    for case in CASES {
        for memory in [OptimizerMemory::Exact, OptimizerMemory::Compact] {
            let run = |n: usize| {
                let cfg = EngineConfig {
                    host_threads: HostThreads::Count(n),
                    memory,
                    ..case_engine_config(case, 2, 1)
                };
                run_engine(case, cfg, 0, 0)
            };
            let ((one, _, p1), (two, _, p2)) = (run(1), run(2));
            let what = format!("{case} {memory:?} host_threads 1 vs 2");
            assert_eq!(step_bits(&one), step_bits(&two), "{what}: per-step loss and grad norm");
            assert_bit_identical(&what, &p1, &p2);
        }
    }
}
