//! LoRA and QLoRA on the CUDA device (feature `cuda`; on a GPU, or without one under the CUDA
//! test double, `scripts/fakecuda.sh`; never skipped): both PEFT fixtures within bf16's bounds
//! (as `cuda_engine.rs`: 2% loss, 5% gradient norm), at K 1 and 2 and micro-batches of 1 row
//! and of the whole batch; the fp32 base rounded to bf16 on the wire, a bf16 base copied as it
//! is (`upload_weights_bf16`), and the QLoRA base uploaded as NF4 words and dequantised on the
//! device before each product.

#![cfg(feature = "cuda")]

mod common;

use common::lora::*;
use common::{assert_rel, f64s};
use horizon_backend::cuda::{CudaDevice, CudaDeviceConfig};

fn cuda() -> CudaDevice {
    CudaDevice::new(CudaDeviceConfig::with_capacity(128 << 20)).unwrap_or_else(|e| {
        panic!("{e}\nhint: without a GPU, run under the CUDA test double: scripts/fakecuda.sh cargo test --features cuda")
    })
}

#[test]
fn adapters_on_the_gpu_track_the_peft_fixtures() {
    for case in CASES {
        let e = expected(case);
        let batch = e["batch"].as_u64().unwrap() as usize;
        let (losses, norms) = (f64s(&e["loss_per_step"]), f64s(&e["grad_norm_per_step"]));
        for (k, mbs, base) in [(1, batch, "auto"), (2, 1, "bf16"), (2, batch, "fp32")] {
            let r = streamed(cuda(), case, k, mbs, base);
            let what = format!("{case} K={k} mbs={mbs} base {base}");
            assert_eq!(r.steps.len(), losses.len(), "{what}: steps");
            for (s, (l, g)) in r.steps.iter().enumerate() {
                assert_rel(&format!("{what} loss {s}"), *l, losses[s], 2e-2);
                assert_rel(
                    &format!("{what} grad norm {s}"),
                    *g,
                    norms[s],
                    common::bf16_norm_tol(case, s),
                );
            }
            assert_ne!(r.end, r.init, "{what}: no adapter moved");
        }
    }
}

/// A mixture of experts' frozen experts streamed through the expert slots in chunks
/// (`engine.expert_chunk`: 3 experts a chunk, 3 chunks a sparse layer) on the GPU: LoRA and
/// QLoRA (NF4 expert words uploaded by chunk) on the attention and router of the qwen3_moe
/// fixture train as whole layers do on the GPU, at K 1 and 2, micro-batches of 1 row and of
/// the whole batch, within bf16's bounds of each other.
#[test]
fn chunked_experts_on_the_gpu_train_as_whole_layers() {
    use horizon::engine::options::EngineConfig;
    let case = "qwen3_moe";
    let batch = common::expected(case)["batch"].as_u64().unwrap() as usize;
    for kind in ["lora", "qlora"] {
        for (k, mbs) in [(1, 1), (2, batch)] {
            let base = EngineConfig {
                head_tile_rows: Some(16),
                backend: horizon::run::config::BackendKind::Cuda,
                ..common::case_engine_config(case, k, mbs)
            };
            let (want, _, whole) = moe_adapter_run(cuda(), case, kind, base);
            let cfg = EngineConfig { expert_chunk: Some(3), ..base };
            let (got, _, chunks) = moe_adapter_run(cuda(), case, kind, cfg);
            let what = format!("{case} {kind} K={k} mbs={mbs}");
            assert_eq!((whole, chunks), (1, 3), "{what}: chunks");
            for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_rel(&format!("{what} loss {s}"), g.0, w.0, 1e-3);
                assert_rel(&format!("{what} grad norm {s}"), g.1, w.1, 1e-2);
            }
        }
    }
}

/// The qwen3_moe_lora fixture (adapters on the attention and on the experts) with its experts
/// and their adapters in chunks of 3 on the GPU: each chunk's adapter gradients back through the
/// expert accumulators; PEFT's losses and norms within bf16's bounds, at K 1 and 2.
#[test]
fn expert_adapters_in_chunks_on_the_gpu_track_peft() {
    let case = "qwen3_moe_lora";
    let e = expected(case);
    let batch = e["batch"].as_u64().unwrap() as usize;
    let (losses, norms) = (f64s(&e["loss_per_step"]), f64s(&e["grad_norm_per_step"]));
    for (k, mbs) in [(1, batch), (2, 1)] {
        let y = yaml(case, "engine: { head_tile_rows: 16, expert_chunk: 3 }\n");
        let memory = horizon::run::config::OptimizerMemory::Exact;
        let r = streamed_yaml(cuda(), case, &y, (k, mbs), memory);
        let what = format!("{case} in chunks K={k} mbs={mbs}");
        assert_eq!(r.expert_chunks, 3, "{what}: chunks");
        for (s, (l, g)) in r.steps.iter().enumerate() {
            assert_rel(&format!("{what} loss {s}"), *l, losses[s], 2e-2);
            assert_rel(
                &format!("{what} grad norm {s}"),
                *g,
                norms[s],
                common::bf16_norm_tol(case, s),
            );
        }
    }
}
