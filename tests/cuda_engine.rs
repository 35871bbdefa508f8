//! The streaming engine on the CUDA device (feature `cuda`; on a GPU, or without one under the
//! CUDA test double, `scripts/fakecuda.sh`; never skipped): every fixture case against the HF
//! fixtures (bf16 weights on the device, bf16 products with fp32 accumulation, so within bf16's
//! tolerance), with fp32 and with bf16 gradients on the wire; a race stress test with random
//! delays before every copy on the H2D and D2H streams (under the double, `FAKECUDA_JITTER_US`
//! also delays every operation of every stream); a failed launch that ends a run with an
//! error naming it; and the page-locked bytes the device holds, which are the plan's to the byte.

#![cfg(feature = "cuda")]

mod common;

use common::*;
use horizon::engine::exec::Engine;
use horizon::engine::options::EngineConfig;
use horizon::hf::config::ModelConfig;
use horizon::model::params::ParamStore;
use horizon::run::config::{BackendKind, GradWire};
use horizon::run::data::tokens_of;
use horizon::store::TrainState;
use horizon_backend::Device;
use horizon_backend::cuda::{CudaDevice, CudaDeviceConfig};

const NO_GPU_HINT: &str = "hint: without a GPU, run the CUDA tests under the CUDA test double: \
                           scripts/fakecuda.sh cargo test --features cuda";

/// True when the long race stress is asked for (`HORIZON_CUDA_STRESS=full`): every case, four
/// seeds, and every (K, micro-batch) split; otherwise (CI, under the slow fiber-per-thread
/// double) one split per case and two seeds.
fn full_stress() -> bool {
    std::env::var("HORIZON_CUDA_STRESS").is_ok_and(|v| v == "full")
}

/// A pool of 128 MiB (the fixtures' plan, with the workspace's 32 MiB for cuBLAS and 8 MiB of
/// gradient chunk, needs about 41 MiB).
fn cuda(jitter_us: u64, seed: u64) -> CudaDevice {
    let mut cfg = CudaDeviceConfig::with_capacity(128 << 20);
    cfg.copy_jitter_us = jitter_us;
    cfg.jitter_seed = seed;
    CudaDevice::new(cfg).unwrap_or_else(|e| panic!("{e}\n{NO_GPU_HINT}"))
}

/// Fixture `case`'s engine config on the CUDA backend.
fn cuda_config(case: &str, k: usize, mbs: usize, grad_wire: GradWire) -> EngineConfig {
    EngineConfig { backend: BackendKind::Cuda, grad_wire, ..case_engine_config(case, k, mbs) }
}

/// The fixture's steps on `dev`: per-step (loss, grad norm), the initial and final parameters.
fn streamed<D: Device>(
    dev: D,
    case: &str,
    cfg: EngineConfig,
) -> (Vec<(f64, f64)>, ParamStore, ParamStore)
where
    D::Backend: 'static,
{
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let layout = horizon::model::describe(&model);
    let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let init = params.clone();
    let mut engine = Engine::new(dev, &model, TrainState::new(params), cfg).unwrap();
    let out = run_case_steps(&mut engine, case).into_iter().map(|(l, g, _)| (l, g)).collect();
    (out, init, engine.into_state().params)
}

/// [`streamed`], each step told the next one's token ids (the embedding rows they gather are
/// updated first): the final masters.
fn streamed_ahead<D: Device>(dev: D, case: &str, cfg: EngineConfig) -> ParamStore
where
    D::Backend: 'static,
{
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let layout = horizon::model::describe(&model);
    let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let mut engine = Engine::new(dev, &model, TrainState::new(params), cfg).unwrap();
    run_case_steps_ahead(&mut engine, case, true);
    engine.into_state().params
}

/// bf16 weights on the device and bf16 products (fp32 accumulation) meet the fixtures' losses
/// within 2% and gradient norms within 5% (gpt-oss past step 0: 15%, [`bf16_norm_tol`];
/// ARCHITECTURE.md, tolerance table: bf16 keeps 8
/// significant bits, relative rounding up to 2^-8 per weight and per product input), at every
/// K and micro-batch split, with fp32 and with bf16 gradients on the wire.
#[test]
fn bf16_engine_tracks_the_fixtures() {
    for case in CASES {
        let e = expected(case);
        let batch = e["batch"].as_u64().unwrap() as usize;
        let (losses, norms) = (f64s(&e["loss_per_step"]), f64s(&e["grad_norm_per_step"]));
        for (k, mbs) in [(1, batch), (2, 1), (3, batch)] {
            for wire in [GradWire::Fp32, GradWire::Bf16] {
                let (got, init, params) =
                    streamed(cuda(0, 0), case, cuda_config(case, k, mbs, wire));
                let what = format!("{case} K={k} mbs={mbs} grad_wire {wire:?}");
                assert_eq!(got.len(), losses.len(), "{what}: steps");
                for (s, (l, g)) in got.iter().enumerate() {
                    assert_rel(&format!("{what} loss {s}"), *l, losses[s], 2e-2);
                    assert_rel(
                        &format!("{what} grad norm {s}"),
                        *g,
                        norms[s],
                        bf16_norm_tol(case, s),
                    );
                }
                let moved = params.buffers().iter().zip(init.buffers()).any(|(p, q)| *p != q);
                assert!(moved, "{what}: no weight moved");
            }
        }
    }
}

/// Kept internals (one layer's, every layer's; `engine.recompute` with a budget) give the same
/// bits as recomputing them: the backward reads what the forward wrote, and a recompute writes
/// the same, from the same bf16 weights with fixed-order kernels.
#[test]
fn kept_internals_change_no_bit() {
    for case in CASES {
        let batch = expected(case)["batch"].as_u64().unwrap() as usize;
        let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
        let base = cuda_config(case, 1, batch, GradWire::Bf16);
        let (want, _, want_params) = streamed(cuda(0, 0), case, base);
        for kept in [1, model.num_layers] {
            let cfg = EngineConfig { kept_layers: kept, ..base };
            let (got, _, params) = streamed(cuda(0, 0), case, cfg);
            assert_eq!(got, want, "{case} {kept} kept: losses and norms");
            assert_eq!(params, want_params, "{case} {kept} kept: weights");
        }
    }
}

/// A traced run (`horizon bench --trace`: a mark queued before and after every op, each first
/// synchronizing its stream) has a slice for every op of every step, each queue's in order,
/// and changes no bit.
#[test]
fn a_traced_run_marks_every_op_and_changes_no_bit() {
    let case = CASES[0];
    let batch = expected(case)["batch"].as_u64().unwrap() as usize;
    let cfg = cuda_config(case, 2, batch, GradWire::Bf16);
    let (want, _, want_params) = streamed(cuda(0, 0), case, cfg);
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let params =
        ParamStore::load_hf(&horizon::model::describe(&model), &case_dir(case).join("model"));
    let mut engine =
        Engine::new(cuda(0, 0), &model, TrainState::new(params.unwrap()), cfg).unwrap();
    engine.start_trace(want.len());
    let got: Vec<(f64, f64)> =
        run_case_steps(&mut engine, case).into_iter().map(|(l, g, _)| (l, g)).collect();
    let mut spans = engine.trace_spans();
    assert_eq!(spans.len(), want.len() * engine.schedule().len(), "a slice per op and step");
    spans.sort_by_key(|s| (s.queue.index(), s.step, s.op));
    for w in spans.windows(2).filter(|w| w[0].queue == w[1].queue) {
        assert!(w[1].start_s >= w[0].end_s, "{:?} before {:?}", w[0], w[1]);
    }
    assert_eq!(got, want, "losses and norms");
    assert_eq!(engine.into_state().params, want_params, "weights");
}

/// The LM head in vocabulary tiles of 37 rows (7 to 9 tiles: the tile cross-entropy kernels,
/// both passes, the tile gradients into the host head rows) meets the fixtures within the bf16
/// bounds above, and random stream delays do not change a bit of it.
#[test]
fn tiled_head_on_the_gpu_tracks_the_fixtures() {
    for case in CASES {
        let e = expected(case);
        let batch = e["batch"].as_u64().unwrap() as usize;
        let (losses, norms) = (f64s(&e["loss_per_step"]), f64s(&e["grad_norm_per_step"]));
        for mbs in [1, batch] {
            let cfg = EngineConfig {
                head_tile_rows: Some(37),
                ..cuda_config(case, 2, mbs, GradWire::Bf16)
            };
            let (got, _, params) = streamed(cuda(0, 0), case, cfg);
            let what = format!("{case} tiled mbs={mbs}");
            for (s, (l, g)) in got.iter().enumerate() {
                assert_rel(&format!("{what} loss {s}"), *l, losses[s], 2e-2);
                assert_rel(&format!("{what} grad norm {s}"), *g, norms[s], bf16_norm_tol(case, s));
            }
            let (jittered, _, jparams) = streamed(cuda(300, 3), case, cfg);
            assert_eq!(jittered, got, "{what}: delays changed the losses");
            assert_eq!(jparams, params, "{what}: delays changed the weights");
        }
    }
}

/// Experts streamed through the expert slots in chunks (`engine.expert_chunk`: 3 experts a
/// chunk, 3 chunks a sparse layer; full fine-tuning, each chunk's gradient back through its own
/// accumulator) on the GPU track the fixtures within the bounds above, at K 1 and 3 and
/// micro-batches of one row and of the whole batch; random copy-stream delays (the next chunk's
/// upload racing the last one's compute, a chunk's gradient download the next one's zeroing)
/// change no bit.
#[test]
fn chunked_experts_on_the_gpu_track_the_fixtures() {
    for case in CASES.into_iter().filter(|c| is_moe(c)) {
        let e = expected(case);
        let batch = e["batch"].as_u64().unwrap() as usize;
        let (losses, norms) = (f64s(&e["loss_per_step"]), f64s(&e["grad_norm_per_step"]));
        for (k, mbs) in [(1, 1), (3, batch)] {
            let cfg = EngineConfig {
                expert_chunk: Some(3),
                head_tile_rows: Some(37),
                ..cuda_config(case, k, mbs, GradWire::Bf16)
            };
            let (got, _, params) = streamed(cuda(0, 0), case, cfg);
            let what = format!("{case} experts in chunks K={k} mbs={mbs}");
            for (s, (l, g)) in got.iter().enumerate() {
                assert_rel(&format!("{what} loss {s}"), *l, losses[s], 2e-2);
                assert_rel(&format!("{what} grad norm {s}"), *g, norms[s], bf16_norm_tol(case, s));
            }
            let (jittered, _, jparams) = streamed(cuda(300, 5), case, cfg);
            assert_eq!(jittered, got, "{what}: delays changed the losses");
            assert_eq!(jparams, params, "{what}: delays changed the weights");
        }
    }
}

/// Random delays (up to 0.3 ms) before every copy on the H2D and D2H streams change the timing,
/// never the numbers: the GPU kernels have fixed reduction orders, so results are bitwise equal.
#[test]
fn copy_stream_delays_do_not_change_results() {
    for case in CASES {
        let splits: &[(usize, usize)] =
            if full_stress() { &[(1, 1), (2, 1), (3, 2)] } else { &[(2, 1)] };
        for &(k, mbs) in splits {
            let cfg = cuda_config(case, k, mbs, GradWire::Bf16);
            let base = streamed(cuda(0, 0), case, cfg);
            for seed in 1..=if full_stress() { 4 } else { 2 } {
                let got = streamed(cuda(300, seed), case, cfg);
                let what = format!("{case} K={k} mbs={mbs} seed {seed}");
                assert_eq!(got.0, base.0, "{what}: per-step loss and grad norm");
                for (i, (x, y)) in got.2.buffers().iter().zip(base.2.buffers()).enumerate() {
                    let diff = x.iter().zip(y.iter()).position(|(p, q)| p.to_bits() != q.to_bits());
                    assert!(diff.is_none(), "{what}: buffer {i} differs at {diff:?}");
                }
            }
        }
    }
}

/// The CUDA test double's folder on LD_LIBRARY_PATH (it holds a `FAKECUDA` marker), if any.
fn double_on_path() -> bool {
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    path.split(':').any(|d| std::path::Path::new(d).join("FAKECUDA").exists())
}

/// Whether the CUDA test double runs this test; when not (on a GPU), says the test is skipped.
fn under_the_double(why: &str) -> bool {
    if double_on_path() {
        return true;
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: {why} needs the CUDA test double (scripts/fakecuda.sh)"
    );
    false
}

/// A 2-layer model's run of `steps` steps on the CUDA device in `dir` (its `out` folder), with
/// `device.attention: attention`, a checkpoint every 2 steps; returns its config's path.
fn small_cuda_run(dir: &std::path::Path, steps: usize, attention: &str) -> std::path::PathBuf {
    let cfg = dir.join("run.yaml");
    std::fs::write(
        &cfg,
        format!(
            "model: {{init: random, arch: llama, hidden_size: 64, intermediate_size: 96, \
             num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, \
             vocab_size: 96}}\ndata: {{format: synthetic}}\n\
             train: {{steps: {steps}, batch_size: 2, max_seq_len: 16, save_every: 2}}\n\
             device: {{backend: cuda, memory: auto, attention: {attention}}}\n\
             output: {{dir: {}}}\n",
            dir.join("out").display()
        ),
    )
    .unwrap();
    cfg
}

/// `horizon train --config cfg` (resuming from the latest checkpoint if `resume`), with the
/// double failing the kernel launch `fail` names (`FAKECUDA_FAIL_KERNEL`), if any.
fn horizon_train(cfg: &std::path::Path, resume: bool, fail: Option<&str>) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_horizon"));
    cmd.args(["train", "--config", cfg.to_str().unwrap()]);
    if resume {
        cmd.args(["--resume", "latest"]);
    }
    match fail {
        Some(spec) => cmd.env("FAKECUDA_FAIL_KERNEL", spec),
        None => cmd.env_remove("FAKECUDA_FAIL_KERNEL"),
    };
    cmd.output().expect("run horizon")
}

/// `device.attention` picks the attention kernels: by default the mma.sync ones, so a failure
/// injected into the fp32 tiled or the wmma backward never fires; with `fp32` or `wmma`, those,
/// so it ends the run.
#[test]
fn device_attention_picks_the_attention_kernels() {
    if !under_the_double("fault injection") {
        return;
    }
    let (tiled, wmma) = ("attention_backward_dq_tiled:1", "attention_backward_dq_tc:1");
    let cases = [
        ("auto", tiled, false),
        ("fp32", tiled, true),
        ("auto", wmma, false),
        ("wmma", wmma, true),
    ];
    for (attention, kernel, fails) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = small_cuda_run(tmp.path(), 2, attention);
        let run = horizon_train(&cfg, false, Some(kernel));
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(!run.status.success(), fails, "device.attention: {attention}:\n{err}");
        assert_eq!(err.contains("CUDA_ERROR_LAUNCH_FAILED"), fails, "{attention}:\n{err}");
    }
}

/// A kernel that fails mid-run (the double's fault injection, `FAKECUDA_FAIL_KERNEL`, fails the
/// 5th `attention_backward_dq_mma`: step 3 of a 2-layer model) ends `horizon train` with an error
/// naming the failed CUDA operation, not a panic; the checkpoint of step 2 is intact, and the
/// run resumes from it to the end.
#[test]
fn a_failed_launch_is_an_error_and_the_last_checkpoint_survives() {
    if !under_the_double("fault injection") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let cfg = small_cuda_run(tmp.path(), 5, "auto");
    let horizon = |resume: bool, fail: Option<&str>| horizon_train(&cfg, resume, fail);
    let failed = horizon(false, Some("attention_backward_dq_mma:5"));
    let err = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success(), "the run with a failed kernel succeeded:\n{err}");
    assert!(!err.contains("panicked"), "a panic, not an error:\n{err}");
    assert!(err.contains("device work failed: CUDA"), "no error naming the CUDA failure:\n{err}");
    assert!(err.contains("CUDA_ERROR_LAUNCH_FAILED"), "the error does not say what failed:\n{err}");
    let ckpts = out.join("checkpoints");
    assert!(ckpts.join("step-00000002/state.json").is_file(), "the step-2 checkpoint is gone");
    assert!(!ckpts.join("step-00000004").exists(), "a checkpoint was saved after the failure");
    let resumed = horizon(true, None);
    let text = String::from_utf8_lossy(&resumed.stdout) + String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success(), "resuming from step 2 failed:\n{text}");
    assert!(ckpts.join("step-00000004/state.json").is_file(), "the resumed run saved no step 4");
}

/// Index of the largest logit (the first of equals) and its lead over the runner-up.
fn top(logits: &[f32]) -> (usize, f32) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    (order[0], logits[order[0]] - logits[order[1]])
}

/// `horizon generate --device cuda`: the KV-cached decoder with the layers streamed through one
/// bf16 weight slot and the cache on the device, against the CPU decoder, on every fixture.
/// Teacher-forced on the CPU's greedy tokens: each step's logits within bf16's tolerance (2e-2
/// of the largest |logit|, as the engine's products), and the GPU's greedy token is the CPU's
/// wherever the CPU's lead over the runner-up exceeds twice that. Then the generator's own GPU
/// run gives the GPU's tokens up to the first step where they may differ.
#[test]
fn kv_cache_generation_on_the_gpu_tracks_the_cpu_tokens() {
    use horizon::model::kv_cache::{KvDecoder, Residency};
    use horizon::run::decode::{Decode, Generator};
    use horizon_backend::cuda::CudaBackend;
    use horizon_backend::{CpuBackend, Precision};
    let prompt = [3u32, 17, 5, 42, 9];
    let new = 32;
    // Dense cases only: on an arbitrary prompt a router may hold two experts within the bf16
    // products' rounding of each other, and then the GPU may rightly choose the other one (a
    // different function from there on). The sparse cases' CUDA path is held to the fixtures,
    // whose rows keep every routing margin, and their KV cache to the full recompute on the CPU
    // (tests/export_generate.rs).
    for case in CASES.into_iter().filter(|c| !is_moe(c)) {
        let dir = case_dir(case).join("model");
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let params = ParamStore::load_hf(&horizon::model::describe(&cfg), &dir).unwrap();
        let len = prompt.len() + new;
        let ws = Precision::Bf16.workspace(Precision::Bf16.product_bytes(64, 512, 512));
        let be = CudaBackend::new(0, ws.bytes).unwrap_or_else(|e| panic!("{e}\n{NO_GPU_HINT}"));
        let mut gpu = KvDecoder::new(be, &cfg, len, prompt.len(), Residency::Streamed);
        let mut cpu = KvDecoder::new(CpuBackend, &cfg, len, prompt.len(), Residency::Resident);
        let (mut lc, mut lg) = (vec![0.0f32; cfg.vocab_size], vec![0.0f32; cfg.vocab_size]);
        let mut feed: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        cpu.begin(&params);
        gpu.begin(&params);
        let (mut cpu_ids, mut gpu_ids) = (Vec::new(), Vec::new());
        for step in 0..new {
            cpu.step(&params, &feed, &mut lc).unwrap();
            gpu.step(&params, &feed, &mut lg).unwrap();
            let scale = lc.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let tol = 2e-2 * scale;
            for (i, (g, c)) in lg.iter().zip(&lc).enumerate() {
                assert!((g - c).abs() <= tol, "{case} step {step}: logit {i} {g} vs cpu {c}");
            }
            let ((want, lead), (got, _)) = (top(&lc), top(&lg));
            if lead > 2.0 * tol {
                assert_eq!(got, want, "{case} step {step}: lead {lead} > {}", 2.0 * tol);
            }
            cpu_ids.push(want as u32);
            gpu_ids.push(got as u32);
            feed = vec![want as i32];
        }
        let agree = cpu_ids.iter().zip(&gpu_ids).take_while(|(a, b)| a == b).count();
        let tok = Box::new(horizon::tokenizer::ByteTokenizer::new());
        let mut g = Generator::new(&cfg, params.clone(), tok);
        g.set_stop_ids(Vec::new());
        g.set_decode(Decode::KvCache(BackendKind::Cuda));
        let ids = g.greedy_ids(&prompt, new).unwrap();
        let upto = (agree + 1).min(new);
        assert_eq!(ids[..upto], gpu_ids[..upto], "{case}: generator on the GPU");
        eprintln!("{case}: the GPU's greedy tokens agree with the CPU's for {agree} of {new}");
    }
}

/// The held-out loss on the GPU (`Engine::eval`: forward only, bf16 weights, whole and tiled
/// head) within bf16's tolerance of the CPU reference path's.
#[test]
fn eval_on_the_gpu_tracks_the_reference_loss() {
    use horizon::data::pretokenized::{Row, make_batch};
    use horizon::model::transformer::{Capacity, Transformer};
    use horizon_backend::CpuBackend;
    for case in ["llama_gqa", "gemma3_sliding"] {
        let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
        let params =
            ParamStore::load_hf(&horizon::model::describe(&model), &case_dir(case).join("model"))
                .unwrap();
        let rows = case_rows(case);
        let refs: Vec<&Row> = rows.iter().collect();
        let cfg = cuda_config(case, 2, 2, GradWire::Fp32);
        let cap = Capacity { batch: 2, seq_len: cfg.seq_len, head_chunk_rows: 7 };
        let mut tr = Transformer::new(CpuBackend, &model, cap);
        let (mut want, mut n) = (0.0, 0);
        for chunk in refs.chunks(2) {
            let out = tr.forward_loss(&params, tokens_of(&make_batch(chunk))).unwrap();
            want += out.loss_sum;
            n += out.num_targets;
        }
        for tiles in [None, Some(37)] {
            let ecfg = EngineConfig { head_tile_rows: tiles, ..cfg };
            let mut e =
                Engine::new(cuda(0, 0), &model, TrainState::new(params.clone()), ecfg).unwrap();
            let got = e.eval(horizon::run::data::micro_batches(&refs, 2)).unwrap();
            assert_eq!(got.num_targets, n);
            assert_rel(
                &format!("{case} eval on the GPU, tiles {tiles:?}"),
                got.loss_sum,
                want,
                2e-2,
            );
        }
    }
}

/// `engine.weight_upload: image`: the optimizer writes a page-locked bf16 image of every
/// uploaded buffer and the uploads copy it as it is; `staged`: the host queue rounds each
/// upload's weights into its slot's page-locked stage ahead of the upload, which copies it.
/// Both hold the masters rounded to nearest even, what the rounding inside each upload
/// produces, so the run is bit-identical to one with neither: losses, norms and final masters,
/// in exact and lean mode, whole and tiled head, tied and untied embeddings (the fixture cases).
#[test]
fn the_weight_image_changes_no_bit() {
    use horizon::run::config::{OptimizerMemory, WeightPath};
    for case in CASES {
        for (memory, tiles) in [(OptimizerMemory::Exact, None), (OptimizerMemory::Lean, Some(37))] {
            let base = EngineConfig {
                memory,
                head_tile_rows: tiles,
                ..cuda_config(case, 2, 1, GradWire::Bf16)
            };
            let (want, _, want_params) = streamed(cuda(0, 0), case, base);
            for weights in [WeightPath::Image, WeightPath::Staged] {
                let cfg = EngineConfig { weights, ..base };
                let (got, _, got_params) = streamed(cuda(0, 0), case, cfg);
                let what = format!("{case} {memory:?} {weights:?}");
                assert_eq!(got, want, "{what}: changed the losses");
                assert_eq!(got_params, want_params, "{what}: changed the weights");
            }
            // The image of a tied embedding written in two parts of rows, as the trainer does.
            let cfg = EngineConfig { weights: WeightPath::Image, ..base };
            let got_params = streamed_ahead(cuda(0, 0), case, cfg);
            assert_eq!(got_params, want_params, "{case} {memory:?} image, updated ahead");
        }
    }
}

/// A function the CUDA test double exports (`crates/fakecuda/src/driver_api.h`), where the
/// loaded driver is the double; `None` on a real driver.
fn double_fn(name: &std::ffi::CStr) -> Option<*mut std::ffi::c_void> {
    use std::ffi::{c_char, c_int, c_void};
    unsafe extern "C" {
        fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void;
    }
    const RTLD_LAZY: c_int = 1;
    const RTLD_NOLOAD: c_int = 4;
    for lib in [c"libcuda.so", c"libcuda.so.1"] {
        // SAFETY: RTLD_NOLOAD opens nothing new: a handle to the library cudarc loaded, or null.
        let h = unsafe { dlopen(lib.as_ptr(), RTLD_LAZY | RTLD_NOLOAD) };
        if h.is_null() {
            continue;
        }
        // SAFETY: `h` is a live handle; the name is a NUL-terminated string.
        let f = unsafe { dlsym(h, name.as_ptr()) };
        return (!f.is_null()).then_some(f);
    }
    None
}

/// The driver's own count of the page-locked bytes this thread asked for and are still live,
/// where the driver is the CUDA test double (`fakecuda_host_alloc_bytes`: the bytes each
/// `cuMemHostAlloc` asked for and each `cuMemHostRegister` range; other tests run on other
/// threads); `None` on a real driver.
fn driver_pinned_bytes() -> Option<usize> {
    let f = double_fn(c"fakecuda_host_alloc_bytes")?;
    // SAFETY: the double exports `size_t fakecuda_host_alloc_bytes(int mine, size_t* count)`;
    // a null `count` is allowed.
    let f: unsafe extern "C" fn(std::ffi::c_int, *mut usize) -> usize =
        unsafe { std::mem::transmute(f) };
    // SAFETY: as above.
    Some(unsafe { f(1, std::ptr::null_mut()) })
}

/// The test double's count of the copies so far, in this process, whose host side was
/// pageable (`fakecuda_pageable_copies`); `None` on a real driver.
fn driver_pageable_copies() -> Option<usize> {
    let f = double_fn(c"fakecuda_pageable_copies")?;
    // SAFETY: the double exports `size_t fakecuda_pageable_copies(void)`.
    let f: unsafe extern "C" fn() -> usize = unsafe { std::mem::transmute(f) };
    // SAFETY: as above.
    Some(unsafe { f() })
}

/// Copies between the device and pageable host memory run at a fraction of the link's rate on
/// a real GPU, and synchronously: the driver stages them through its own buffer (a 7B head's
/// gradient tiles, downloaded into the host store, took 94 ms each on an H200 and 18 ms
/// page-locked). So every copy of a step goes to or from page-locked memory: the staging, the
/// weight image and ring, and the final norm's and head's gradients, registered in place.
/// Whole and tiled heads, tied and untied, on the test double's count. Runs alone in a child
/// process (the count is the process's; other tests copy too); only the token ids and targets
/// of each micro-batch (a few bytes, uploaded from their own vectors by the H2D queue) still
/// cross from pageable memory.
#[test]
fn a_step_copies_nothing_through_pageable_memory() {
    const ALONE: &str = "HORIZON_TEST_ALONE";
    if !under_the_double("counts pageable copies in the test double") {
        return;
    }
    if std::env::var_os(ALONE).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "a_step_copies_nothing_through_pageable_memory", "--nocapture"])
            .env(ALONE, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    for (case, tiles) in
        [("llama_gqa", None), ("llama_gqa", Some(37)), ("qwen2_tied_padded", Some(64))]
    {
        let cfg = EngineConfig {
            head_tile_rows: tiles,
            weights: horizon::run::config::WeightPath::Image,
            ..cuda_config(case, 1, 1, GradWire::Bf16)
        };
        let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
        let layout = horizon::model::describe(&model);
        let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
        let mut engine = Engine::new(cuda(0, 0), &model, TrainState::new(params), cfg).unwrap();
        let before = driver_pageable_copies().expect("the double counts pageable copies");
        let steps = run_case_steps(&mut engine, case).len();
        let micro_batches = steps * cfg.batch_size.div_ceil(cfg.micro_batch_size);
        let pageable = driver_pageable_copies().unwrap() - before;
        // The token ids and the targets of each micro-batch (two in all before the gradients
        // were registered: the final norm's and the head's, each step).
        assert!(
            pageable <= 2 * micro_batches,
            "{case} tiles {tiles:?}: {pageable} pageable copies in {steps} steps"
        );
    }
}

/// The page-locked host memory of an engine on the CUDA device is exactly the plan's figure
/// (`horizon plan`'s "of which pinned" line): the checkpoints, the gradient slabs (fp32 or bf16;
/// a lean run's fp32 expansion layer is plain memory), the embedding, residual-gradient and
/// loss staging, and the device's bf16 weight upload ring, each pinned at its exact size (the
/// device and the engine pin on the thread that builds them). The step loop pins nothing more,
/// and the test double's driver counts the same bytes, none left once the engine is dropped.
#[test]
fn pinned_host_memory_is_the_plans_figure() {
    use horizon::run::config::{OptimizerMemory, WeightPath};
    use horizon::run::plan::plan_for;
    use horizon_backend::cuda::WIRE_RING_BYTES;
    let case = "llama_gqa";
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let layout = horizon::model::describe(&model);
    let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let driver = || {
        let d = driver_pinned_bytes();
        assert!(d.is_some() || !double_on_path(), "the double has no fakecuda_host_alloc_bytes");
        d
    };
    let configs = [
        (2, 1, GradWire::Fp32, OptimizerMemory::Exact, WeightPath::Masters),
        (1, 2, GradWire::Bf16, OptimizerMemory::Exact, WeightPath::Masters),
        (3, 1, GradWire::Bf16, OptimizerMemory::Lean, WeightPath::Masters),
        // With the bf16 weight image, or the two weight stages: page-locked too.
        (2, 1, GradWire::Bf16, OptimizerMemory::Lean, WeightPath::Image),
        (1, 1, GradWire::Bf16, OptimizerMemory::Exact, WeightPath::Staged),
    ];
    for (i, (k, mbs, wire, memory, weights)) in configs.into_iter().enumerate() {
        let cfg = EngineConfig { memory, weights, ..cuda_config(case, k, mbs, wire) };
        let what = format!("K={k} mbs={mbs} grad_wire {wire:?} {memory:?} {weights:?}");
        let plan = plan_for(&model, &cfg, None);
        let staging = plan.pinned as usize - WIRE_RING_BYTES;
        assert!(staging > 0 && plan.pinned as u64 <= plan.host_total(), "{what}: {plan}");
        let mut engine =
            Engine::new(cuda(0, 0), &model, TrainState::new(params.clone()), cfg).unwrap();
        assert_eq!(engine.sizes().pinned_bytes() as u64, plan.pinned, "{what}: sizes vs plan");
        let stats = engine.device().stats();
        assert_eq!(stats.pinned_bytes as u64, plan.pinned, "{what}: device vs plan");
        if let Some(driver) = driver() {
            assert_eq!(driver as u64, plan.pinned, "{what}: the driver's count vs plan");
        }
        if i == 0 {
            run_case_steps(&mut engine, case);
            let after = engine.device().stats();
            assert_eq!(after.pinned_bytes as u64, plan.pinned, "{what}: after the steps");
            assert_eq!(after.pinned_peak_bytes as u64, plan.pinned, "{what}: peak");
        }
        drop(engine);
        if let Some(driver) = driver() {
            assert_eq!(driver, 0, "{what}: page-locked memory left after the engine is gone");
        }
    }
}

/// DPO's live reference (`dpo.reference: live`) on the CUDA device, uploaded from the masters'
/// path and beside a weight image: the starting weights in bf16, bit for bit.
#[test]
fn dpo_live_reference_on_the_cuda_engine() {
    use horizon::run::config::WeightPath;
    for weights in [WeightPath::Masters, WeightPath::Image] {
        common::dpo::live_reference_check(|| cuda(0, 0), BackendKind::Cuda, weights);
    }
}

/// A DPO run from its config on the CUDA device (`device.backend: cuda`, `run_streaming`): the
/// LoRA case's reference with the adapters off through a weight image, then its steps within
/// the bf16 tolerances; `final/` a PEFT adapter.
#[test]
fn a_dpo_run_on_the_cuda_device_tracks_the_fixture() {
    let case = "dpo_qwen2_lora";
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let data = common::dpo::dir(case).join("data.jsonl");
    let extra = "device: { backend: cuda }\nengine: { weight_upload: image }\n";
    common::dpo::run(&common::dpo::config(case, &data, &out, extra), None).unwrap();
    let e = common::dpo::expected(case);
    let lines = common::dpo::metrics(&out);
    assert_eq!(lines.len(), e["per_step"].as_array().unwrap().len());
    for (k, (got, want)) in lines.iter().zip(e["per_step"].as_array().unwrap()).enumerate() {
        for (key, tol) in [("loss", 2e-2), ("grad_norm", 5e-2)] {
            let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
            assert_rel(&format!("step {k} {key}"), g, w, tol);
        }
    }
    assert!(out.join("final/adapter_config.json").is_file());
}

/// DPO (issue 47) on the CUDA device: each DPO fixture's steps (loss, grad norm) within the
/// bf16 tolerances, with the whole batch as one micro-batch and with micro-batches of one row.
#[test]
fn dpo_on_the_cuda_engine_tracks_the_fixtures() {
    for case in ["dpo_llama_full", "dpo_qwen2_lora"] {
        let e = common::dpo::expected(case);
        let batch = e["batch"].as_u64().unwrap() as usize;
        for (k, mbs) in [(1, 2 * batch), (2, 1)] {
            let (got, _) =
                common::dpo::streamed(cuda(0, 0), case, (k, mbs, None), BackendKind::Cuda);
            for (s, (g, want)) in got.iter().zip(e["per_step"].as_array().unwrap()).enumerate() {
                let what = format!("{case} K={k} mbs={mbs} step {s}");
                assert_rel(&format!("{what} loss"), g.loss, want["loss"].as_f64().unwrap(), 2e-2);
                let norm = want["grad_norm"].as_f64().unwrap();
                assert_rel(&format!("{what} grad norm"), g.grad_norm, norm, 5e-2);
            }
        }
    }
}
