//! LoRA and QLoRA against the PEFT fixtures (`tests/fixtures/lora`, from ../shared/fixtures-lora):
//! the adapters' step-0 gradients, every step's loss and adapter-only gradient norm, and the
//! final adapters by update error, on the reference path and on the streaming engine (K in
//! {1, 2}, micro-batches of 1 row and of the whole batch; the whole batch bit-identical to the
//! reference path); the QLoRA case's dequantised base against bitsandbytes' own, bit for bit.

mod common;

use std::path::Path;

use common::lora::*;
use common::{assert_bit_identical, assert_rel, f64s, max_err_over, update_rel_err, update_tol};
use horizon::hf::checkpoint::read_tensor_f64;
use horizon::model::params::ParamStore;
use horizon::run::data::tokens_of;
use horizon::run::load::{RunModel, load_run_model, peft_order};
use horizon::run::reference::ReferenceTrainer;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};

/// The step-0 loss and every adapter gradient, on the reference path.
#[test]
fn reference_step0_adapter_gradients_match_peft() {
    for case in CASES {
        let mut t =
            ReferenceTrainer::new(run_config(case, "engine: { head_chunk_rows: 7 }\n")).unwrap();
        let (batch, _) = t.batch(0).unwrap();
        let out = t
            .engine
            .forward_backward(
                &t.state.params,
                &mut t.state.grads,
                tokens_of(&batch),
                batch.num_targets,
            )
            .unwrap();
        let e = expected(case);
        assert_rel(&format!("{case} step-0 loss"), out.loss(), f64s(&e["loss_per_step"])[0], 1e-5);
        let names = adapter_names(case);
        let refs: Vec<Vec<f64>> =
            names.iter().map(|(p, _)| fixture_tensor(case, "step0_grads.safetensors", p)).collect();
        let model_max = refs.iter().flatten().fold(0.0f64, |a, &x| a.max(x.abs()));
        for ((peft, ours), want) in names.iter().zip(&refs) {
            let layout = &t.engine.layout;
            let got = peft_order(layout, ours, t.state.grads.tensor(layout, ours).unwrap());
            let (err, at) = max_err_over(&got, want, model_max);
            let pt =
                e["pytorch_fp32"]["step0_grad_err_over_model_max_grad"][peft].as_f64().unwrap();
            println!("{case} grad {ours}: err/model_max {err:.2e} (pytorch fp32 {pt:.2e})");
            assert!(err < 1e-5, "{case} grad {ours}: error {err:.3e} at {at} (tol 1e-5)");
        }
    }
}

/// Losses, adapter gradient norms and update errors of `steps` against the fixture.
fn assert_matches(
    case: &str,
    what: &str,
    steps: &[(f64, f64)],
    init: &ParamStore,
    end: &ParamStore,
    layout: &horizon::model::layout::ModelLayout,
) {
    let e = expected(case);
    let (losses, norms) = (f64s(&e["loss_per_step"]), f64s(&e["grad_norm_per_step"]));
    assert_eq!(steps.len(), losses.len());
    for (s, (l, g)) in steps.iter().enumerate() {
        assert_rel(&format!("{case} {what} loss {s}"), *l, losses[s], 1e-5);
        assert_rel(&format!("{case} {what} grad norm {s}"), *g, norms[s], 1e-5);
    }
    for (peft, ours) in adapter_names(case) {
        let want = fixture_tensor(case, "final_adapter.safetensors", &peft);
        let err = update_rel_err(
            &peft_order(layout, &ours, end.tensor(layout, &ours).unwrap()),
            &peft_order(layout, &ours, init.tensor(layout, &ours).unwrap()),
            &want,
        );
        let pt = e["pytorch_fp32"]["update_rel_l2_err"][&peft].as_f64().unwrap();
        let tol = update_tol(pt);
        println!("{case} {what} update {ours}: {err:.2e} (pytorch fp32 {pt:.2e}, tol {tol:.1e})");
        assert!(err <= tol, "{case} {what} {ours}: update error {err:.3e} > {tol:.1e}");
    }
}

/// Per-step (loss, grad norm), initial and final adapters of the reference path.
fn reference(case: &str) -> (Vec<(f64, f64)>, ParamStore, ParamStore) {
    let mut t =
        ReferenceTrainer::new(run_config(case, "engine: { head_chunk_rows: 7 }\n")).unwrap();
    let init = t.state.params.clone();
    let steps = expected(case)["steps"].as_u64().unwrap() as usize;
    let out = (0..steps).map(|k| t.step(k).unwrap()).map(|m| (m.loss, m.grad_norm)).collect();
    (out, init, t.state.params.clone())
}

#[test]
fn reference_training_matches_peft() {
    for case in CASES {
        let (steps, init, end) = reference(case);
        let layout = ReferenceTrainer::new(run_config(case, "")).unwrap().engine.layout;
        assert_matches(case, "reference", &steps, &init, &end, &layout);
    }
}

/// A CPU device of 8 MiB (every case's plan fits).
fn cpu() -> CpuDevice {
    CpuDevice::new(CpuDeviceConfig::with_capacity(8 << 20))
}

#[test]
fn streamed_engine_matches_peft_and_the_reference_path() {
    for case in CASES {
        let (ref_steps, _, ref_end) = reference(case);
        let layout = ReferenceTrainer::new(run_config(case, "")).unwrap().engine.layout;
        let batch = expected(case)["batch"].as_u64().unwrap() as usize;
        for k in [1, 2] {
            let r = streamed(cpu(), case, k, batch, "auto");
            if r.head_tiles == 1 {
                // The whole batch in one micro-batch and the whole head: the reference path's
                // arithmetic in its order.
                for (s, (a, b)) in r.steps.iter().zip(&ref_steps).enumerate() {
                    assert_eq!(a.0.to_bits(), b.0.to_bits(), "{case} K={k} step {s} loss");
                    assert_eq!(a.1.to_bits(), b.1.to_bits(), "{case} K={k} step {s} grad norm");
                }
                assert_bit_identical(&format!("{case} K={k} whole batch"), &r.end, &ref_end);
            } else {
                // A quantised layer's slot is small: the head goes in vocabulary tiles, whose
                // softmax sums combine in another order (the tiled-head row of the tolerance
                // table).
                for (s, (a, b)) in r.steps.iter().zip(&ref_steps).enumerate() {
                    assert_rel(&format!("{case} K={k} step {s} loss vs reference"), a.0, b.0, 1e-6);
                    assert_rel(&format!("{case} K={k} step {s} norm vs reference"), a.1, b.1, 1e-6);
                }
            }
            assert_matches(case, &format!("K={k} B"), &r.steps, &r.init, &r.end, &layout);
            let r = streamed(cpu(), case, k, 1, "auto");
            assert_matches(case, &format!("K={k} mb=1"), &r.steps, &r.init, &r.end, &layout);
        }
    }
}

/// The QLoRA case's base as the run holds it: every quantised product matrix dequantises to
/// bitsandbytes' own values (`tests/fixtures/nf4`, made with bitsandbytes 0.50.2), bit for bit;
/// the rest of the base is the checkpoint's.
#[test]
fn qlora_base_dequantises_to_bitsandbytes_values_bit_for_bit() {
    let case = "qwen2_qlora_nf4";
    let cfg = run_config(case, "");
    let RunModel { layout, base, .. } = load_run_model(&cfg.raw, cfg.adapter.as_ref()).unwrap();
    let base = base.unwrap();
    let bnb =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nf4/qwen2_weights.safetensors");
    let mut packed = 0;
    for i in 0..layout.dims.layers {
        for t in layout.layer(i).frozen_tensors() {
            let name = horizon::model::layout::ModelLayout::layer_name(i, &t.name);
            let got = base.tensor_f32(i, t);
            let want: Vec<f32> = if t.stored == horizon::model::spec::Stored::Nf4 {
                packed += 1;
                read_tensor_f64(&bnb, &format!("{name}.deq"))
                    .unwrap()
                    .1
                    .iter()
                    .map(|&x| x as f32)
                    .collect()
            } else {
                read_tensor_f64(&dir(case).join("model/model.safetensors"), &name)
                    .unwrap()
                    .1
                    .iter()
                    .map(|&x| x as f32)
                    .collect()
            };
            let diff = got.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(diff.is_none(), "{name}: element {diff:?} differs from bitsandbytes'");
        }
    }
    // q, k, v, o, gate, up, down in each of the two layers.
    assert_eq!(packed, 14);
}

/// `optimizer.memory: lean` and `compact` take adapters too: lean is exact's arithmetic (two
/// layers, two slabs: every layer gradient waits for the norm) bit for bit; compact (the
/// adapters under 4096 elements keep fp32 moments, the larger ones 8-bit) meets the fixture.
#[test]
fn memory_modes_train_adapters() {
    use horizon::run::config::OptimizerMemory;
    for case in CASES {
        let exact = streamed(cpu(), case, 1, 1, "auto");
        let lean = streamed_in(cpu(), case, (1, 1), "auto", OptimizerMemory::Lean);
        assert_eq!(lean.steps, exact.steps, "{case}: lean losses and norms");
        assert_bit_identical(&format!("{case} lean"), &lean.end, &exact.end);
        let compact = streamed_in(cpu(), case, (1, 1), "auto", OptimizerMemory::Compact);
        let e = expected(case);
        let (losses, norms) = (f64s(&e["loss_per_step"]), f64s(&e["grad_norm_per_step"]));
        for (s, (l, g)) in compact.steps.iter().enumerate() {
            assert_rel(&format!("{case} compact loss {s}"), *l, losses[s], 1e-3);
            assert_rel(&format!("{case} compact grad norm {s}"), *g, norms[s], 1e-2);
        }
    }
}

/// QLoRA on a mixture of experts (no PEFT fixture: transformers quantises only `nn.Linear`s):
/// the qwen3_moe_lora model with its attention and every expert matrix in NF4 (per expert, as
/// per-expert `Linear4bit`s), adapters on attention and experts from PEFT's init. The streamed
/// engine with the whole batch is bit-identical to the reference path; micro-batches of one row
/// agree within the tolerance table.
#[test]
fn qlora_on_a_mixture_of_experts_streams_as_the_reference_computes() {
    let case = "qwen3_moe_lora";
    let yaml = yaml(case, "engine: { head_chunk_rows: 7 }\n").replace("type: lora", "type: qlora");
    let cfg =
        horizon::run::config::RawConfig::from_yaml(&yaml, case).unwrap().resolve(case).unwrap();
    let mut t = ReferenceTrainer::new(cfg).unwrap();
    let packed = t.engine.layout.kinds.iter().map(|k| k.packed).max().unwrap();
    let e = t.engine.layout.moe.as_ref().unwrap().num_experts;
    assert!(packed > e * 3 * 32 * 24 / 8, "the experts are packed: {packed} words");
    let steps = expected(case)["steps"].as_u64().unwrap() as usize;
    let want: Vec<(f64, f64)> =
        (0..steps).map(|k| t.step(k).unwrap()).map(|m| (m.loss, m.grad_norm)).collect();
    let memory = horizon::run::config::OptimizerMemory::Exact;
    let batch = expected(case)["batch"].as_u64().unwrap() as usize;
    let whole = streamed_yaml(cpu(), case, &yaml, (1, batch), memory);
    let bits =
        |v: &[(f64, f64)]| v.iter().map(|(a, b)| (a.to_bits(), b.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&whole.steps), bits(&want), "{:?} vs {want:?}", whole.steps);
    assert_bit_identical("qlora moe", &whole.end, &t.state.params);
    let rows = streamed_yaml(cpu(), case, &yaml, (2, 1), memory);
    for ((l, g), (wl, wg)) in rows.steps.iter().zip(&want) {
        assert_rel("qlora moe mbs=1 loss", *l, *wl, 1e-5);
        assert_rel("qlora moe mbs=1 grad norm", *g, *wg, 1e-4);
    }
}

/// The experts chosen: at step 0 each expert's count of real tokens, summed over the sparse
/// layers, is PyTorch's (`step0_real_tokens_per_expert`); a different expert for one token would
/// move two counts.
#[test]
fn the_step0_routing_counts_are_pytorchs() {
    let case = "qwen3_moe_lora";
    let mut t = ReferenceTrainer::new(run_config(case, "")).unwrap();
    let (batch, _) = t.batch(0).unwrap();
    t.engine.forward_loss(&t.state.params, tokens_of(&batch)).unwrap();
    let stats = t.engine.pooled_stats().unwrap();
    let per_layer = expected(case)["step0_real_tokens_per_expert"].clone();
    let layers: Vec<Vec<f64>> = per_layer.as_array().unwrap().iter().map(f64s).collect();
    let e = layers[0].len();
    let want: Vec<f32> = (0..e).map(|x| layers.iter().map(|l| l[x]).sum::<f64>() as f32).collect();
    assert_eq!(&stats[..e], &want[..]);
}
