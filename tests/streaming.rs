//! Streaming-engine properties on the CPU device: device memory does not grow with depth, a
//! model whose weights are 10x the device budget trains, a plan that does not fit is refused
//! before anything is allocated, `summary.json` reports what it should, and a Qwen3-8B-shaped
//! model plans no head-sized device buffer.

use std::process::Command;

use horizon::run::config::RawConfig;
use horizon::run::trainer::Trainer;
use horizon_backend::Device;

/// A small random Llama of `layers` layers.
fn config(layers: usize, memory: &str, out: &std::path::Path) -> String {
    format!(
        "model: {{ init: random, arch: llama, hidden_size: 64, intermediate_size: 176, num_hidden_layers: {layers},\n\
         \x20        num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256 }}\n\
         data: {{ format: synthetic }}\n\
         train: {{ steps: 2, batch_size: 2, micro_batch_size: 1, max_seq_len: 16 }}\n\
         engine: {{ checkpoint_every: 2, grad_slabs: 2 }}\n\
         device: {{ memory: {memory} }}\n\
         output: {{ dir: '{}' }}\n",
        out.display()
    )
}

fn trainer(layers: usize, memory: &str) -> anyhow::Result<Trainer> {
    let tmp = tempfile::tempdir().unwrap();
    let raw = RawConfig::from_yaml(&config(layers, memory, tmp.path()), "test")?;
    Trainer::new(raw.resolve("test")?)
}

#[test]
fn device_memory_does_not_grow_with_depth() {
    let mut peaks = Vec::new();
    for layers in [4, 32] {
        let mut t = trainer(layers, "auto").unwrap();
        for k in 0..2 {
            let m = t.step(k).unwrap();
            assert!(m.loss.is_finite());
        }
        t.engine.state();
        let st = t.engine.device().stats();
        let planned = t.plan.device_total();
        assert!(
            st.peak_bytes as u64 <= planned,
            "{layers} layers: peak {} > planned {planned}",
            st.peak_bytes
        );
        peaks.push(st.peak_bytes as f64);
    }
    let rel = (peaks[0] - peaks[1]).abs() / peaks[0];
    assert!(
        rel <= 0.01,
        "peak device bytes of 4 and 32 layers differ by {:.2}%: {peaks:?}",
        rel * 100.0
    );
}

#[test]
fn a_model_ten_times_the_device_budget_trains() {
    let probe = trainer(64, "auto").unwrap();
    let budget = probe.plan.device_total();
    let weights = probe.engine.sizes().params as u64 * 4;
    assert!(weights >= 10 * budget, "weights {weights} B are not 10x the device budget {budget} B");
    drop(probe);
    let mut t = trainer(64, &budget.to_string()).unwrap();
    let first = t.step(0).unwrap().loss;
    let second = t.step(1).unwrap().loss;
    assert!(first.is_finite() && second.is_finite());
    t.engine.state();
    assert!(t.engine.device().stats().peak_bytes as u64 <= budget);
}

#[test]
fn a_plan_that_does_not_fit_is_refused_before_allocating() {
    let err = trainer(4, "64KiB").err().expect("must refuse").to_string();
    assert!(err.contains("device.memory"), "{err}");
    assert!(err.contains("GiB"), "the refusal gives the numbers: {err}");
}

#[test]
fn train_writes_a_summary() {
    let (_tmp, s) = run_summary(&["train"], 4);
    for key in [
        "steps",
        "tokens",
        "wall_s",
        "tokens_per_s",
        "peak_rss_bytes",
        "planned_host_bytes",
        "peak_device_bytes",
        "planned_device_bytes",
        "h2d_bytes",
        "d2h_bytes",
        "device_compute_s",
        "link_busy_s",
    ] {
        assert!(s[key].is_number(), "summary.json lacks {key}: {s}");
    }
    assert_eq!(s["steps"], 2);
    assert!(s["peak_device_bytes"].as_u64() <= s["planned_device_bytes"].as_u64());
    assert!(s["h2d_bytes"].as_u64().unwrap() > 0 && s["d2h_bytes"].as_u64().unwrap() > 0);
}

/// `bench/qwen3-8b-shape.yaml` on the CUDA backend's precision (planning needs no GPU): the
/// LM head (V x C = 622M parameters, 3.2x a layer) is applied in vocabulary tiles, so no device
/// line is head-sized; the weight slots are exactly two bf16 layers, the accumulators two fp32
/// layers, and the total is one layer's weights and gradients plus activations and the head's
/// per-row buffers, whatever the depth.
#[test]
fn a_qwen3_8b_shape_plans_no_head_sized_device_buffer() {
    use horizon::run::config::BackendKind;
    use horizon::run::load::model_config;
    use horizon::run::plan::plan_for;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/qwen3-8b-shape.yaml");
    let raw = RawConfig::from_yaml(&std::fs::read_to_string(path).unwrap(), path).unwrap();
    let (model, ecfg) = (model_config(&raw).unwrap(), raw.engine_config());
    assert_eq!(ecfg.backend, BackendKind::Cuda);
    let layout = horizon::model::describe(&model);
    let (c, v, layer) = (layout.dims.c, layout.dims.v, layout.max_layer_len());
    assert_eq!((c, v, layout.dims.layers, layout.tied), (4096, 151936, 36, false));
    assert!(v * c > 3 * layer, "the head is 3.2x a layer");
    let plan = plan_for(&model, &ecfg, None);
    println!("{plan}");
    // Every device buffer is smaller than the head in bf16: a line of two (slots,
    // accumulators) per buffer, any other line as a whole.
    let head_bf16 = (v * c * 2) as u64;
    for (what, bytes) in &plan.device {
        let per_buffer = if what.contains("(2,") { bytes / 2 } else { *bytes };
        assert!(per_buffer < head_bf16, "{what}: {per_buffer} B is head-sized ({head_bf16} B)");
    }
    let line = |key: &str| plan.device.iter().find(|(k, _)| k.contains(key)).unwrap().1;
    assert_eq!(line("weight slots (2, bf16"), 2 * layer as u64 * 2);
    assert_eq!(line("gradient accumulators"), 2 * layer as u64 * 4);
    assert!(plan.head.tiles() >= 4 && plan.head.rows * c + c <= layer, "{:?}", plan.head);
    assert!(plan.to_string().contains(&format!(
        "{} tiles of {} vocabulary rows",
        plan.head.tiles(),
        plan.head.rows
    )));
    // O(one layer + activations): beside the two layers' weights and gradients, only what
    // scales with the rows (activations, one layer's internals, the head's per-row buffers and
    // chunk) and the backend's fixed workspace; nothing grows with the depth.
    let mut deeper = model.clone();
    deeper.num_layers = 72;
    assert_eq!(plan_for(&deeper, &ecfg, None).device_total(), plan.device_total());
    // Less than what the slots and accumulators alone took when sized by norm + whole head
    // (2 x bf16 + 2 x fp32 = 12 B per element: 7.5 GB).
    assert!(plan.device_total() < 12 * (c + v * c) as u64, "{plan}");
}

/// The example: a 4-layer, hidden-96 Llama whose rows are at most 48 tokens, in
/// micro-batches of 2, with `train.max_seq_len: 2048`. Sized for 2048-token rows its device
/// plan was 53 MiB and `device.memory: 16MiB` was refused; sized for the data's 48 it fits.
#[test]
fn the_plan_is_sized_for_the_longest_row_of_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("rows.jsonl");
    let rows: String = [12usize, 48, 30, 7]
        .iter()
        .map(|&n| {
            let ids: Vec<String> = (0..n).map(|i| ((i * 7) % 259).to_string()).collect();
            format!("{{\"input_ids\": [{}]}}\n", ids.join(", "))
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let yaml = |data: &std::path::Path, memory: &str| {
        format!(
            "model: {{ init: random, arch: llama, hidden_size: 96, intermediate_size: 256, num_hidden_layers: 4,\n\
             \x20        num_attention_heads: 4, num_key_value_heads: 4, vocab_size: 259 }}\n\
             data: {{ path: '{}', format: pretokenized }}\n\
             train: {{ steps: 1, batch_size: 4, micro_batch_size: 2, max_seq_len: 2048 }}\n\
             device: {{ memory: {memory} }}\n\
             output: {{ dir: '{}' }}\n",
            data.display(),
            tmp.path().join("out").display()
        )
    };
    let plan = |yaml: &str| {
        let cfg = tmp.path().join("c.yaml");
        std::fs::write(&cfg, yaml).unwrap();
        Command::new(env!("CARGO_BIN_EXE_horizon"))
            .args(["plan", "--config", cfg.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let o = plan(&yaml(&data, "16MiB"));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains(
            "sized for rows of 48 tokens: the longest row of the data (train.max_seq_len 2048)"
        ),
        "{out}"
    );
    // `horizon train` plans the same and runs in that budget.
    let raw = RawConfig::from_yaml(&yaml(&data, "16MiB"), "t").unwrap().resolve("t").unwrap();
    let mut t = Trainer::new(raw).unwrap();
    assert_eq!(t.engine.config().seq_len, 48);
    assert!(t.plan.device_total() <= 16 << 20, "{}", t.plan);
    assert!(t.step(0).unwrap().loss.is_finite());
    // Without readable data the plan says it assumed train.max_seq_len, and refuses the
    // budget with the numbers (exit 1, no panic).
    let o = plan(&yaml(&tmp.path().join("missing.jsonl"), "16MiB"));
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(!o.status.success() && !err.contains("panicked"), "{out}{err}");
    assert!(out.contains("sized for rows of 2048 tokens: train.max_seq_len, assumed"), "{out}");
    assert!(out.contains("missing.jsonl"), "the plan names the data it could not read: {out}");
    assert!(err.contains("device.memory") && err.contains("GiB"), "{err}");
}

/// `horizon bench` times the steps after its warm-up only: with 3 steps and the default
/// warm-up of 1, `summary.json` counts 2 timed steps and their tokens (the warm-up step, logged
/// one step late, was once counted among them, doubling the reported speed of a 2-step bench).
#[test]
fn the_warm_up_step_is_not_timed() {
    let (tmp, s) = run_summary(&["bench", "--set", "train.steps=3"], 3);
    assert_eq!(s["steps"], 2, "{s}");
    assert_eq!(s["total_steps"], 3, "{s}");
    let metrics = std::fs::read_to_string(tmp.path().join("out/metrics.jsonl")).unwrap();
    let tokens: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(s["tokens"].as_u64().unwrap(), tokens[1..].iter().sum::<u64>(), "{s}");
}

/// `horizon VERB ARGS --config C` on [`config`] of `layers` layers in a fresh directory, which
/// must succeed: the directory (`out/` holds the run) and its `summary.json`.
fn run_summary(verb_args: &[&str], layers: usize) -> (tempfile::TempDir, serde_json::Value) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("c.yaml");
    std::fs::write(&cfg, config(layers, "auto", &tmp.path().join("out"))).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(verb_args)
        .args(["--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let summary = std::fs::read_to_string(tmp.path().join("out/summary.json")).unwrap();
    (tmp, serde_json::from_str(&summary).unwrap())
}
