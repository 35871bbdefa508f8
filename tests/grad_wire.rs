//! `engine.grad_wire: bf16` on the CPU device, whose simulated wire rounds each gradient to
//! bf16 as the CUDA device does (`Device::download_bf16`), and the memory plan of bf16 slabs and
//! of the CUDA backend's bf16 weight slots: the first step's loss is bit-identical to fp32's
//! and its gradient norm within bf16's rounding; a random model's losses track fp32's for 30
//! steps, in exact and lean mode; the link carries exactly half the layer-gradient bytes; the
//! plan's slabs and (CUDA) weight slots halve.

use horizon::engine::options::EngineConfig;
use horizon::engine::sizes::Sizes;
use horizon::run::config::{BackendKind, GradWire, OptimizerMemory, RawConfig};
use horizon::run::load::model_config;
use horizon::run::plan::plan_for;
use horizon::run::trainer::Trainer;
use horizon_backend::Device;

const STEPS: usize = 30;

/// A random Llama on synthetic tokens: 5 layers, 2 micro-batches, K = 2, clipping on.
fn yaml(out: &std::path::Path, memory: &str, wire: &str) -> String {
    format!(
        "model: {{ init: random, arch: llama, hidden_size: 64, intermediate_size: 176, num_hidden_layers: 5,\n\
         \x20        num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 300, tie_word_embeddings: false }}\n\
         data: {{ format: synthetic }}\n\
         train: {{ steps: {STEPS}, batch_size: 4, micro_batch_size: 2, max_seq_len: 16 }}\n\
         optimizer: {{ lr: 3.0e-3, grad_clip: 1.0, memory: {memory} }}\n\
         engine: {{ checkpoint_every: 2, grad_slabs: 3, grad_wire: {wire} }}\n\
         output: {{ dir: '{}' }}\n",
        out.display()
    )
}

fn raw(yaml: &str) -> RawConfig {
    RawConfig::from_yaml(yaml, "test").unwrap()
}

/// Per-step (loss, grad norm), the link's device -> host bytes, and one layer's length.
fn run(memory: &str, wire: &str) -> (Vec<(f64, f64)>, u64, usize) {
    let tmp = tempfile::tempdir().unwrap();
    let mut t =
        Trainer::new(raw(&yaml(tmp.path(), memory, wire)).resolve("test").unwrap()).unwrap();
    let metrics = (0..STEPS).map(|k| t.step(k).unwrap()).map(|m| (m.loss, m.grad_norm)).collect();
    t.engine.state();
    let layer = horizon::model::describe(&t.model_cfg).layer(0).len;
    (metrics, t.engine.device().stats().d2h_bytes, layer)
}

#[test]
fn bf16_gradients_track_fp32_and_halve_the_layer_gradient_bytes() {
    for memory in ["exact", "lean"] {
        let (want, d2h_fp32, layer) = run(memory, "fp32");
        let (got, d2h_bf16, _) = run(memory, "bf16");
        // The forward of the first step sees no gradient: the same loss, bit for bit. Its
        // gradient norm sums the same gradients, each layer element rounded to bf16 (relative
        // error at most 2^-8, the head's and the embedding's exact): within 2^-8.
        assert_eq!(got[0].0.to_bits(), want[0].0.to_bits(), "{memory}: step 1 loss");
        let rel = (got[0].1 - want[0].1).abs() / want[0].1;
        assert!(rel <= 2f64.powi(-8), "{memory}: step 1 grad norm off by {rel:.3e}");
        // Later steps update with bf16-rounded gradients; AdamW normalises each element, so the
        // rounding moves the weights little. Observed worst relative loss difference over 30
        // steps: 1.5e-4 (exact), 4.8e-5 (lean).
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            let rel = (g.0 - w.0).abs() / w.0;
            assert!(
                rel <= 1e-3,
                "{memory}: step {} loss {} vs fp32 {} ({rel:.2e})",
                s + 1,
                g.0,
                w.0
            );
        }
        // Every layer's gradient crosses once per step (5 layers): 2 bytes an element, not 4.
        assert_eq!(d2h_fp32 - d2h_bf16, (STEPS * 5 * layer * 2) as u64, "{memory}: link bytes");
    }
}

/// With a slab for every layer, lean holds every bf16 slab until the step's norm (each expanded
/// into the one fp32 layer to be measured, then again to be updated) and is bit-identical to
/// exact with bf16 gradients, clipping on.
#[test]
fn lean_holding_every_bf16_slab_is_exact() {
    let run = |memory: &str| {
        let tmp = tempfile::tempdir().unwrap();
        let y = yaml(tmp.path(), memory, "bf16").replace("grad_slabs: 3", "grad_slabs: 5");
        let mut t = Trainer::new(raw(&y).resolve("test").unwrap()).unwrap();
        let m: Vec<(u64, u64)> = (0..10)
            .map(|k| t.step(k).unwrap())
            .map(|m| (m.loss.to_bits(), m.grad_norm.to_bits()))
            .collect();
        (m, t.engine.into_state().params)
    };
    let (exact, lean) = (run("exact"), run("lean"));
    assert_eq!(exact.0, lean.0, "losses and norms");
    assert!(exact.1 == lean.1, "masters differ");
}

#[test]
fn the_plan_halves_the_slabs_and_the_cuda_weight_slots() {
    let tmp = tempfile::tempdir().unwrap();
    let r = raw(&yaml(tmp.path(), "exact", "fp32"));
    let model = model_config(&r).unwrap();
    let layout = horizon::model::describe(&model);
    let cpu = r.engine_config();
    let sizes = |e: EngineConfig| Sizes::new(&layout, &e);
    let (fp32, bf16) = (sizes(cpu), sizes(EngineConfig { grad_wire: GradWire::Bf16, ..cpu }));
    assert_eq!(bf16.slab_bytes() * 2, fp32.slab_bytes());
    let lean = |grad_wire| sizes(EngineConfig { grad_wire, memory: OptimizerMemory::Lean, ..cpu });
    // Lean expands one slab at a time into an fp32 layer for its AdamW update.
    assert_eq!(
        lean(GradWire::Bf16).slab_bytes(),
        3 * layout.layer(0).len * 2 + layout.layer(0).len * 4
    );
    assert_eq!(lean(GradWire::Fp32).slab_bytes(), 3 * layout.layer(0).len * 4);

    // The CUDA backend's weight slots are bf16: half the bytes; its products need a workspace
    // (cuBLAS's 32 MiB among it); the CPU's need none.
    let cuda = EngineConfig { backend: BackendKind::Cuda, ..cpu };
    let (c, g) = (sizes(cpu).device_bytes(), sizes(cuda).device_bytes());
    assert!(c[0].0.contains("fp32") && g[0].0.contains("bf16"), "{:?} {:?}", c[0], g[0]);
    assert_eq!(g[0].1 * 2, c[0].1, "weight slots");
    assert_eq!(g[1], c[1], "the gradient accumulators stay fp32");
    let ws =
        |d: &[(&str, usize)]| d.iter().find(|(k, _)| k.contains("backend workspace")).unwrap().1;
    assert_eq!(ws(&c), 0);
    assert!(ws(&g) > 32 << 20, "{g:?}");
    let plan = plan_for(&model, &cuda, None).to_string();
    assert!(plan.contains("weight slots (2, bf16"), "{plan}");
    assert!(!plan.contains("in host RAM"), "a GPU's pool is not host memory:\n{plan}");
    assert!(plan_for(&model, &cpu, None).to_string().contains("in host RAM"));
}

/// The plan's page-locked figure is a part of the host total, counted once: on CUDA the
/// staging `Engine::new` takes (checkpoints, the fp32 or bf16 slabs without a lean run's fp32
/// expansion layer, embedding / residual-gradient / loss staging), the final norm's and the
/// head's gradients (registered in place), plus the device's bf16 upload ring, which is a host
/// line of its own; on the CPU backend nothing is pinned and there is no
/// ring. (That the CUDA device pins exactly this is `cuda_engine`'s test, under the double.)
#[test]
fn the_plan_counts_pinned_memory_once() {
    use horizon_backend::cuda::WIRE_RING_BYTES;
    let tmp = tempfile::tempdir().unwrap();
    let r = raw(&yaml(tmp.path(), "exact", "fp32"));
    let model = model_config(&r).unwrap();
    let layout = horizon::model::describe(&model);
    let cpu = r.engine_config();
    for (memory, wire) in [
        (OptimizerMemory::Exact, GradWire::Fp32),
        (OptimizerMemory::Lean, GradWire::Bf16),
        (OptimizerMemory::Compact, GradWire::Fp32),
    ] {
        let e = EngineConfig { memory, grad_wire: wire, ..cpu };
        let cuda = EngineConfig { backend: BackendKind::Cuda, ..e };
        let (sc, sg) = (Sizes::new(&layout, &e), Sizes::new(&layout, &cuda));
        let what = format!("{memory:?} {wire:?}");
        let line = |s: &Sizes, key: &str| -> usize {
            s.host_bytes().iter().filter(|(k, _)| k.contains(key)).map(|(_, b)| b).sum()
        };
        let slab_elem = if wire == GradWire::Bf16 { 2 } else { 4 };
        let slabs = sg.grad_slabs * sg.slab * slab_elem;
        // The final norm's and the head's gradients, page-locked in place in the host store
        // (an untied head here), a part of the gradients' line.
        let (c, v) = (layout.dims.c, layout.dims.v);
        let grads = (c + v * c) * 4;
        assert!(grads <= line(&sg, "gradients ("), "{what}: pinned gradients outside their line");
        let want = line(&sg, "checkpoints") + line(&sg, "staging (") + slabs + grads;
        let want = want + WIRE_RING_BYTES;
        assert_eq!(sg.pinned_bytes(), want, "{what}");
        assert_eq!(line(&sg, "upload ring"), WIRE_RING_BYTES, "{what}: the ring's host line");
        assert_eq!(sg.host_total(), sc.host_total() + WIRE_RING_BYTES, "{what}: host totals");
        assert!(sg.pinned_bytes() < sg.host_total(), "{what}");
        assert_eq!(sc.pinned_bytes(), 0, "{what}: the CPU device pins nothing");
        assert_eq!(line(&sc, "upload ring"), 0, "{what}: no ring on the CPU");
        let (pc, pg) = (plan_for(&model, &e, None), plan_for(&model, &cuda, None));
        assert_eq!(pg.pinned, sg.pinned_bytes() as u64);
        assert_eq!(pg.host_total(), sg.host_total() as u64, "the pinned line adds nothing");
        assert!(pg.to_string().contains("of which pinned (page-locked)"), "{pg}");
        assert!(pc.to_string().contains("pinned (page-locked): none"), "{pc}");
    }
}

#[test]
fn a_bad_grad_wire_is_refused_by_key() {
    let tmp = tempfile::tempdir().unwrap();
    let e =
        RawConfig::from_yaml(&yaml(tmp.path(), "exact", "fp16"), "t.yaml").unwrap_err().to_string();
    assert!(e.contains("t.yaml") && e.contains("grad_wire") && e.contains("fp16"), "{e}");
}
