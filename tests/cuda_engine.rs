//! The streaming engine on the CUDA device (feature `cuda`; skipped, with the reason printed,
//! where no GPU is present): every fixture case against the HF fixtures with fp32 matmuls and
//! fp32 weights on the wire, the default bf16 configuration against the CPU engine, and a race
//! stress test with random delays before every copy on the H2D and D2H streams.

#![cfg(feature = "cuda")]

mod common;

use common::*;
use horizon::engine::exec::Engine;
use horizon::hf::config::ModelConfig;
use horizon::model::layout::ModelLayout;
use horizon::model::params::ParamStore;
use horizon::train::TrainState;
use horizon_backend::Device;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};
use horizon_backend::cuda::{CudaDevice, CudaDeviceConfig, MatmulPrecision, WireFormat, probe};

/// Prints why a test is skipped, past the test harness's output capture.
fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}
/// True when a GPU is usable; otherwise prints why the test is skipped.
fn gpu_present() -> bool {
    if !probe::driver_present() {
        skip("no CUDA driver on this machine (libcuda.so not found)");
        return false;
    }
    match CudaDevice::new(CudaDeviceConfig::with_capacity(1 << 20)) {
        Ok(_) => true,
        Err(e) => {
            skip(&format!("no usable GPU: {e}"));
            false
        }
    }
}

fn cuda(precision: MatmulPrecision, wire: WireFormat, jitter_us: u64, seed: u64) -> CudaDevice {
    let mut cfg = CudaDeviceConfig::with_capacity(64 << 20);
    cfg.matmul = precision;
    cfg.weights_wire = wire;
    cfg.copy_jitter_us = jitter_us;
    cfg.jitter_seed = seed;
    CudaDevice::new(cfg).unwrap_or_else(|e| panic!("{e}"))
}

fn cpu() -> CpuDevice {
    CpuDevice::new(CpuDeviceConfig::with_capacity(64 << 20))
}

/// The fixture's steps on `dev`: per-step (loss, grad norm), the initial and final parameters.
fn streamed<D: Device>(
    dev: D,
    case: &str,
    k: usize,
    mbs: usize,
) -> (Vec<(f64, f64)>, ParamStore, ParamStore)
where
    D::Backend: 'static,
{
    let model = ModelConfig::from_file(&case_dir(case).join("model/config.json")).unwrap();
    let layout = ModelLayout::new(&model);
    let params = ParamStore::load_hf(&layout, &case_dir(case).join("model")).unwrap();
    let init = params.clone();
    let cfg = case_engine_config(case, k, mbs);
    let mut engine = Engine::new(dev, &model, TrainState::new(params), cfg).unwrap();
    let out = run_case_steps(&mut engine, case).into_iter().map(|(l, g, _)| (l, g)).collect();
    (out, init, engine.into_state().params)
}

/// fp32 on the GPU meets the fixtures with the CPU engine's tolerances (ARCHITECTURE.md).
#[test]
fn fp32_engine_matches_the_fixtures() {
    if !gpu_present() {
        return;
    }
    for case in CASES {
        let batch = expected(case)["batch"].as_u64().unwrap() as usize;
        for (k, mbs) in [(1, batch), (2, 1), (3, batch)] {
            let dev = cuda(MatmulPrecision::Fp32, WireFormat::F32, 0, 0);
            let (steps, init, params) = streamed(dev, case, k, mbs);
            assert_matches_fixture(case, &format!("K={k} mbs={mbs}"), &steps, &init, &params);
        }
    }
}

/// The training default (bf16 weights on the wire, bf16 tensor-core matmuls): losses and
/// gradient norms within 2% of the CPU engine's (bf16 keeps 8 mantissa bits).
#[test]
fn bf16_engine_tracks_the_cpu_engine() {
    if !gpu_present() {
        return;
    }
    for case in CASES {
        let batch = expected(case)["batch"].as_u64().unwrap() as usize;
        let (want, _, _) = streamed(cpu(), case, 2, batch);
        let dev = cuda(MatmulPrecision::Bf16, WireFormat::Bf16, 0, 0);
        let (got, _, _) = streamed(dev, case, 2, batch);
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_rel(&format!("{case} bf16 loss {s}"), g.0, w.0, 2e-2);
            assert_rel(&format!("{case} bf16 grad norm {s}"), g.1, w.1, 5e-2);
        }
    }
}

/// Random delays (up to 0.3 ms) before every copy on the H2D and D2H streams change the timing,
/// never the numbers: the GPU kernels have fixed reduction orders, so results are bitwise equal.
#[test]
fn copy_stream_delays_do_not_change_results() {
    if !gpu_present() {
        return;
    }
    for case in CASES {
        for (k, mbs) in [(1, 1), (2, 1), (3, 2)] {
            let base = streamed(cuda(MatmulPrecision::Bf16, WireFormat::Bf16, 0, 0), case, k, mbs);
            for seed in 1..=4 {
                let got = streamed(
                    cuda(MatmulPrecision::Bf16, WireFormat::Bf16, 300, seed),
                    case,
                    k,
                    mbs,
                );
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
