//! `horizon plan --hardware`: the projection of a run on a machine, through the library and the
//! binary. The simulator's exact timelines are tested in `sim::des`; here, that the projection
//! of real plans is consistent: the step's windows add up, more tokens per step raise MFU on a
//! link-bound shape and end a host-bound step, the bf16 image takes the rounding off the upload, a run that does not fit
//! is refused, and the profiles resolve (built in, YAML file, `this-cpu`).

use std::process::Command;

use horizon::run::config::{RawConfig, RunConfig};
use horizon::run::projection::projection;
use horizon::sim::cost::UploadPath;

/// A random Llama of hidden `c`, `layers` layers, `tokens` per step in rows of 1024.
fn config(c: usize, layers: usize, batch: usize, extra: &str) -> RunConfig {
    config_vocab(c, layers, batch, 32000, extra)
}

/// [`config`] with a vocabulary of `vocab`.
fn config_vocab(c: usize, layers: usize, batch: usize, vocab: usize, extra: &str) -> RunConfig {
    let yaml = format!(
        "model: {{init: random, arch: llama, hidden_size: {c}, intermediate_size: {f}, \
         num_hidden_layers: {layers}, num_attention_heads: {h}, num_key_value_heads: {h}, \
         vocab_size: {vocab}}}\n\
         data: {{format: synthetic}}\n\
         train: {{steps: 1, batch_size: {batch}, micro_batch_size: 1, max_seq_len: 1024}}\n\
         optimizer: {{memory: lean}}\n\
         engine: {{checkpoint_every: 2, grad_slabs: 2, grad_wire: bf16}}\n{extra}",
        f = c * 8 / 3,
        h = c / 128
    );
    RawConfig::from_yaml(&yaml, "test config").unwrap().resolve("test config").unwrap()
}

/// A hardware profile of `yaml` in a file of a fresh temporary directory (removed when the
/// returned guard drops), and the file's path.
fn profile_file(yaml: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("profile.yaml");
    std::fs::write(&f, yaml).unwrap();
    let path = f.to_str().unwrap().to_string();
    (dir, path)
}

#[test]
fn a_projection_is_consistent() {
    let p = projection(&config(2048, 8, 2, ""), "h200-pcie5").unwrap();
    let c = &p.chosen;
    assert!(p.fits, "{}", p.text);
    assert_eq!(p.upload, UploadPath::Image, "the 1.5 TB host has room for the image");
    let windows: f64 = c.phases.iter().map(|ph| ph.seconds).sum();
    assert!((windows - c.step_s).abs() < 1e-9 * c.step_s.max(1.0), "{windows} vs {}", c.step_s);
    for (q, &b) in c.busy.iter().enumerate() {
        assert!(b >= 0.0 && b <= c.step_s * (1.0 + 1e-9), "queue {q} busy {b} of {}", c.step_s);
    }
    let mfu = c.mfu(989e12);
    assert!(mfu > 0.0 && mfu < 0.8, "{mfu}");
    for word in ["projected step", "busy per step", "forward", "backward", "bound"] {
        assert!(p.text.contains(word), "{word}: {}", p.text);
    }
}

#[test]
fn more_tokens_per_step_move_a_link_bound_run_toward_compute_bound() {
    // A wide model and few tokens: each layer's upload takes longer than its forward.
    let few = projection(&config(4096, 4, 1, ""), "a100-pcie4").unwrap();
    let many = projection(&config(4096, 4, 16, ""), "a100-pcie4").unwrap();
    let fwd = |p: &horizon::sim::Projection| {
        p.phases.iter().find(|ph| ph.name == "forward").cloned().unwrap()
    };
    assert_eq!(fwd(&few.chosen).bound, horizon_backend::Queue::H2D, "{}", few.text);
    assert!(few.text.contains("compute-bound from about"), "{}", few.text);
    assert!(many.chosen.mfu(312e12) > 2.0 * few.chosen.mfu(312e12), "{}\n{}", few.text, many.text);
}

/// On a host with few cores and little memory bandwidth (the lent H200's was 16 cores, 91 GB/s)
/// the optimizer's updates bound the step; the plan says so, with the tokens per step from which
/// compute would bound it instead (host work does not grow with the tokens), and a little past
/// those tokens compute is the busier queue and the host no longer fills the step.
#[test]
fn a_host_bound_step_says_how_many_tokens_make_it_compute_bound() {
    let (_dir, hw) = profile_file(
        "name: thin-host\ngpu: {bf16_tflops: 989, hbm_gbps: 4800, memory_gib: 131}\nlink: {h2d_gbps: 55, d2h_gbps: 55}\nhost: {cores: 8, mem_gbps: 40, memory_gib: 1024}\n",
    );
    let hw = hw.as_str();
    let few = projection(&config(4096, 8, 4, ""), hw).unwrap();
    let line = few.text.lines().find(|l| l.contains("host-bound:")).unwrap_or_else(|| {
        panic!("no host-bound line:\n{}", few.text);
    });
    let need: f64 =
        line.split("about ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(need > 8.0 * 4096.0, "{line}");
    let busy = |p: &horizon::sim::Projection, q: horizon_backend::Queue| p.busy[q.index()];
    let rows = (1.1 * need / 1024.0).ceil() as usize;
    let many = projection(&config(4096, 8, rows, ""), hw).unwrap();
    let (c, h) = (&many.chosen, horizon_backend::Queue::Host);
    assert!(busy(c, horizon_backend::Queue::Compute) > busy(c, h), "{}", many.text);
    assert!(busy(c, h) < 0.95 * c.step_s && !many.text.contains("host-bound"), "{}", many.text);
}

#[test]
fn the_image_takes_the_rounding_off_the_upload() {
    let p = projection(&config(2048, 8, 1, ""), "h200-pcie5").unwrap();
    let (u, round) = p.other.as_ref().unwrap();
    assert_eq!(*u, UploadPath::RoundInUpload);
    // Rounding in the upload is host work beside the link's time: never faster.
    assert!(round.step_s >= p.chosen.step_s * (1.0 - 1e-9), "{}", p.text);
    let mut run = config(2048, 8, 1, "");
    run.raw.engine.weight_upload = horizon::run::config::WeightUpload::Round;
    let p = projection(&run, "h200-pcie5").unwrap();
    assert_eq!(p.upload, UploadPath::RoundInUpload);
}

/// `engine.weight_upload: staged`: the rounding is host-queue work of its own (the plan's
/// `StageWeights` ops) and the upload a pure copy; the host plan holds two stages instead of
/// the image.
#[test]
fn staged_uploads_round_on_the_host_queue_and_copy() {
    let run = |u| {
        let mut run = config(2048, 8, 1, "");
        run.raw.engine.weight_upload = u;
        projection(&run, "h200-pcie5").unwrap()
    };
    use horizon::run::config::WeightUpload;
    let (staged, image, round) =
        (run(WeightUpload::Staged), run(WeightUpload::Image), run(WeightUpload::Round));
    assert_eq!(staged.upload, UploadPath::Staged);
    assert!(staged.text.contains("two bf16 weight stages"), "{}", staged.text);
    let (h2d, host) = (1, 3);
    let [s, i, r] = [&staged, &image, &round].map(|p| p.chosen.busy);
    // The link carries the same bytes, with no host work inside the copies.
    assert!((s[h2d] - i[h2d]).abs() < 1e-9 * i[h2d], "{s:?} vs {i:?}");
    assert!(r[h2d] >= s[h2d] * (1.0 - 1e-9), "{r:?} vs {s:?}");
    // The rounding is the host queue's, not the upload's.
    assert!(s[host] > r[host], "{s:?} vs {r:?}");
}

#[test]
fn profiles_resolve_and_a_run_that_does_not_fit_is_refused() {
    for hw in ["h200-pcie5", "h100-pcie5", "a100-pcie4", "gh200", "this-cpu"] {
        projection(&config(256, 2, 1, ""), hw).unwrap_or_else(|e| panic!("{hw}: {e:#}"));
    }
    let Err(e) = projection(&config(256, 2, 1, ""), "h300") else { panic!("h300 resolved") };
    let e = format!("{e:#}");
    assert!(e.contains("h300") && e.contains("hint") && e.contains("h200-pcie5"), "{e}");
    let dir = std::env::temp_dir().join(format!("horizon-proj-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("tiny.yaml");
    std::fs::write(
        &f,
        "name: tiny\ngpu: {bf16_tflops: 50, hbm_gbps: 300, memory_gib: 0.25}\nlink: {h2d_gbps: 12, d2h_gbps: 12}\nhost: {cores: 4, mem_gbps: 20, memory_gib: 8}\n",
    )
    .unwrap();
    let p = projection(&config(2048, 8, 1, ""), f.to_str().unwrap()).unwrap();
    assert!(!p.fits && p.text.contains("DOES NOT FIT"), "{}", p.text);
    // The binary refuses with exit status 1 and says why.
    let cfg = dir.join("run.yaml");
    std::fs::write(
        &cfg,
        "model: {init: random, arch: llama, hidden_size: 2048, intermediate_size: 5504, num_hidden_layers: 8, num_attention_heads: 16, num_key_value_heads: 16, vocab_size: 32000}\ndata: {format: synthetic}\ntrain: {steps: 1, batch_size: 1, max_seq_len: 1024}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["plan", "--config", cfg.to_str().unwrap(), "--hardware", f.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("does not fit tiny"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["plan", "--config", cfg.to_str().unwrap(), "--hardware", "h200-pcie5"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("projected step"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A GPU projection prices attention at the profile's rate (Horizon's tensor-core kernels by
/// default) and also says what a FlashAttention-class attention would give: a shorter step,
/// and a line naming both rates; a profile whose attention is already that fast gets no such
/// line.
#[test]
fn a_gpu_projection_says_what_a_flash_attention_would_give() {
    let cfg = config(4096, 8, 16, "");
    let p = projection(&cfg, "h200-pcie5").unwrap();
    let what = "FlashAttention-class attention";
    let line = p.text.lines().find(|l| l.contains(what)).unwrap_or_else(|| {
        panic!("no {what} line:\n{}", p.text);
    });
    assert!(line.contains("52%") && line.contains("(7.4%)"), "{line}");
    let step: f64 = line.split("step ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    // (At 1,024 tokens a sequence the step with a FlashAttention-class attention is 0.38 s.)
    assert!(step < p.chosen.step_s, "{step} vs {}: {}", p.chosen.step_s, p.text);
    let (_dir, f) = profile_file(
        "name: fast\ngpu: {bf16_tflops: 989, hbm_gbps: 4800, memory_gib: 131, attention_efficiency: 0.6}\nlink: {h2d_gbps: 55, d2h_gbps: 55}\nhost: {cores: 112, mem_gbps: 430, memory_gib: 1536}\n",
    );
    let fast = projection(&cfg, &f).unwrap();
    assert!(!fast.text.contains(what), "{}", fast.text);
    assert!(fast.chosen.step_s < step, "{} vs {step}", fast.chosen.step_s);
}

/// `device.attention: fp32` is priced at the fp32 kernels' rate (0.012 of the peak for D = 128,
/// the tiled ones), a longer step than the tensor-core kernels' default; `wmma` at the wmma
/// kernels' (0.025), in between.
#[test]
fn fp32_attention_is_projected_at_the_fp32_kernels_rate() {
    let tc = projection(&config(4096, 8, 16, ""), "h200-pcie5").unwrap();
    let fp32 =
        projection(&config(4096, 8, 16, "device: {attention: fp32}\n"), "h200-pcie5").unwrap();
    assert!(
        fp32.chosen.step_s > tc.chosen.step_s,
        "{} vs {}",
        fp32.chosen.step_s,
        tc.chosen.step_s
    );
    assert!(fp32.text.contains("Horizon's kernels (1.2%)"), "{}", fp32.text);
    // The wmma kernels, between the two.
    let wmma =
        projection(&config(4096, 8, 16, "device: {attention: wmma}\n"), "h200-pcie5").unwrap();
    assert!(wmma.text.contains("Horizon's kernels (2.5%)"), "{}", wmma.text);
    assert!(tc.chosen.step_s < wmma.chosen.step_s && wmma.chosen.step_s < fp32.chosen.step_s);
}

/// Each head tile moves its own rows: cut into 8 tiles of 4,000 rows or into 7 of 4,400 and a
/// last of 1,200, the head's gradients (each tile's downloaded once) take the link the same
/// time (the cost model once priced every tile at full size, 3,200 rows more than there are).
/// The uploads differ: the tiles still in the two slots after the first pass are not sent
/// again, and which those are depends on the cut.
#[test]
fn a_ragged_last_head_tile_moves_only_its_own_rows() {
    let dir = std::env::temp_dir().join(format!("horizon-tiles-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("slow-link.yaml");
    std::fs::write(
        &f,
        "name: slow-link\ngpu: {bf16_tflops: 989, hbm_gbps: 4800, memory_gib: 141}\nlink: {h2d_gbps: 0.5, d2h_gbps: 0.5}\nhost: {cores: 64, mem_gbps: 400, memory_gib: 1024}\n",
    )
    .unwrap();
    let busy = |rows| {
        let mut run = config(512, 2, 1, "");
        run.raw.engine.head_tile_rows = Some(rows);
        projection(&run, f.to_str().unwrap()).unwrap().chosen.busy
    };
    let (even, ragged) = (busy(4000), busy(4400));
    std::fs::remove_dir_all(&dir).unwrap();
    let (e, r) = (even[2], ragged[2]);
    assert!((e - r).abs() < 1e-9 * e, "d2h: {e} s with even tiles, {r} s ragged");
}

/// An untied embedding's gradient is non-zero only in the rows the step's tokens name, and its
/// norm reads only those: the step boundary, whose critical path runs through the norm, does
/// not grow with the vocabulary (a pass over the table made it 8.5 ms longer from 32K to 256K
/// rows of 4096 on the H200 host, of 41 ms).
#[test]
fn the_embedding_norm_reads_the_steps_rows_not_the_table() {
    let boundary = |vocab| {
        let p = projection(&config_vocab(4096, 4, 16, vocab, ""), "h200-pcie5").unwrap();
        let b = p.chosen.phases.iter().find(|ph| ph.name == "step boundary").unwrap().seconds;
        (b, p.text)
    };
    let ((small, a), (large, b)) = (boundary(32000), boundary(256_000));
    assert!((large - small).abs() < 1e-4, "{small} s at 32K rows, {large} s at 256K\n{a}\n{b}");
}

/// The ops of a traced step, per queue, in order: (queue track, op index, name).
fn traced_ops(path: &std::path::Path, step: u64) -> Vec<(u64, u64, String)> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut ops: Vec<(u64, u64, String, f64, f64)> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["args"]["step"].as_u64() == Some(step))
        .map(|e| {
            let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
            (
                e["tid"].as_u64().unwrap(),
                e["args"]["op"].as_u64().unwrap(),
                e["name"].to_string(),
                ts,
                dur,
            )
        })
        .collect();
    ops.sort_by_key(|a| (a.0, a.1));
    // Each queue runs its ops one after another, in the schedule's order.
    for w in ops.windows(2).filter(|w| w[0].0 == w[1].0) {
        assert!(
            w[1].3 >= w[0].3 + w[0].4 - 1e-3,
            "{}: {:?} overlaps {:?}",
            path.display(),
            w[0],
            w[1]
        );
    }
    ops.into_iter().map(|(q, j, name, ..)| (q, j, name)).collect()
}

/// `bench --trace` and `plan --hardware this-cpu --trace` of one config: a slice for every op
/// of every step in both, each queue's ops in order without overlap, and the same ops on the
/// same queues in a steady step of each (the run runs the plan the projection simulated).
#[test]
fn a_run_and_its_projection_trace_the_same_ops() {
    let dir = std::env::temp_dir().join(format!("horizon-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("run.yaml");
    std::fs::write(
        &cfg,
        format!(
            "model: {{init: random, arch: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 3, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256}}\ndata: {{format: synthetic}}\ntrain: {{steps: 3, batch_size: 2, micro_batch_size: 1, max_seq_len: 32}}\nengine: {{checkpoint_every: 2, grad_slabs: 2}}\noutput: {{dir: {}}}\n",
            dir.join("out").display()
        ),
    )
    .unwrap();
    let (run, plan) = (dir.join("run.json"), dir.join("plan.json"));
    let horizon = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
        text
    };
    let c = cfg.to_str().unwrap();
    let text = horizon(&["bench", "--config", c, "--trace", run.to_str().unwrap()]);
    assert!(text.contains("trace of the run's steps"), "{text}");
    let text = horizon(&[
        "plan",
        "--config",
        c,
        "--hardware",
        "this-cpu",
        "--trace",
        plan.to_str().unwrap(),
    ]);
    assert!(text.contains("trace of the projected steps"), "{text}");
    let steady = traced_ops(&run, 2);
    assert!(!steady.is_empty());
    for step in 0..3 {
        let n = traced_ops(&run, step).len();
        assert_eq!(n, steady.len(), "run step {step}: every op has a slice");
    }
    assert_eq!(traced_ops(&plan, 2), steady, "the projection's steady step runs the same ops");
    assert_eq!(traced_ops(&plan, 0).len(), steady.len());
    // --trace needs --hardware.
    let out = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["plan", "--config", c, "--trace", plan.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--hardware"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Planning needs the model, the sizes and the projection, never a device: `horizon plan` of a
/// `device.backend: cuda` config answers on any build (CI's has no `cuda` feature), memory plan
/// and `--hardware` alike, with `--set`; running it is what needs the feature, and `horizon
/// train` still refuses it there, pointing at `horizon plan`.
#[test]
fn a_cuda_config_plans_on_a_build_without_cuda() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cuda.yaml");
    std::fs::write(
        &cfg,
        "model: {init: random, arch: llama, hidden_size: 256, intermediate_size: 688, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 2, vocab_size: 1000}\n\
         data: {format: synthetic}\n\
         train: {steps: 1, batch_size: 2, max_seq_len: 128}\n\
         device: {backend: cuda}\n",
    )
    .unwrap();
    let c = cfg.to_str().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let (ok, text) = run(&["plan", "--config", c, "--set", "train.batch_size=4"]);
    assert!(ok && text.contains("fits"), "{text}");
    let (ok, text) = run(&["plan", "--config", c, "--hardware", "h200-pcie5"]);
    assert!(ok && text.contains("projected step") && text.contains("MFU"), "{text}");
    if !horizon_backend::cuda::BUILT_WITH_CUDA {
        let out = dir.path().join("out");
        let set = format!("output.dir={}", out.display());
        let (ok, text) = run(&["train", "--config", c, "--set", &set]);
        assert!(!ok && text.contains("built without CUDA"), "{text}");
        assert!(text.contains("horizon plan") && !out.exists(), "{text}");
    }
}

/// An adapter step computes the frozen base's forward and input gradient but no weight
/// gradient of it: its model FLOPs are `(4 x frozen + 6 x trained matrix parameters) x tokens +
/// attention`, not full fine-tuning's `6 x`, and the plan says what it counts.
#[test]
fn adapter_mfu_counts_no_weight_gradient_of_the_frozen_base() {
    let (c, layers, rows, t, v) = (512usize, 2usize, 2usize, 1024usize, 32000usize);
    let f = c * 8 / 3;
    let tokens = (rows * t) as f64;
    // Per layer: q, k, v, o (C x C each, as many kv heads as heads), gate, up, down.
    let frozen = (layers * (4 * c * c + 3 * c * f) + v * c) as f64;
    let attention = 3.0 * layers as f64 * 4.0 * c as f64 * rows as f64 * (t * (t + 1) / 2) as f64;
    let full = projection(&config_vocab(c, layers, rows, v, ""), "h200-pcie5").unwrap();
    let rel = |got: f64, want: f64| (got - want).abs() / want;
    let want = 6.0 * frozen * tokens + attention;
    assert!(rel(full.chosen.model_flops, want) < 1e-12, "{} vs {want}", full.chosen.model_flops);
    assert!(full.text.contains("6 x matrix parameters x tokens"), "{}", full.text);
    for kind in ["lora", "qlora"] {
        let extra = format!("adapter: {{type: {kind}, r: 8, targets: [q_proj, v_proj]}}\n");
        let p = projection(&config_vocab(c, layers, rows, v, &extra), "h200-pcie5").unwrap();
        let trained = (layers * 2 * 8 * (c + c)) as f64;
        let want = (4.0 * frozen + 6.0 * trained) * tokens + attention;
        let got = p.chosen.model_flops;
        assert!(rel(got, want) < 1e-12, "{kind}: {got} vs {want}\n{}", p.text);
        assert!(p.text.contains("no weight gradient of it"), "{}", p.text);
    }
}

/// The projection's tokens/s are every position of a step (rows padded to the data's longest);
/// beside them, the data's own tokens, from the rows the plan reads anyway; where the data
/// cannot be read, the line says its figure counts padding.
#[test]
fn tokens_per_second_are_given_real_beside_padded() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("rows.jsonl");
    // Rows of 16 and 48 tokens: padded to 48, 2/3 of the positions are real.
    let row = |n: usize| {
        let ids: Vec<String> = (0..n).map(|i| (i % 100 + 1).to_string()).collect();
        format!("{{\"input_ids\": [{}]}}\n", ids.join(", "))
    };
    std::fs::write(&data, row(16) + &row(48)).unwrap();
    let mut cfg = config(256, 2, 2, "");
    cfg.raw.data.format = horizon::run::config::DataFormat::Pretokenized;
    cfg.raw.data.path = Some(data.clone());
    let p = projection(&cfg, "h200-pcie5").unwrap();
    assert_eq!(p.chosen.tokens, 2 * 48);
    assert!((p.real_fraction.unwrap() - 2.0 / 3.0).abs() < 1e-12, "{:?}", p.real_fraction);
    let real = format!("{:.0} real tokens/s", p.chosen.tokens_per_s() * 2.0 / 3.0);
    assert!(p.text.contains(&real) && p.text.contains("66.7% of the positions"), "{}", p.text);
    cfg.raw.data.path = Some(dir.path().join("missing.jsonl"));
    let p = projection(&cfg, "h200-pcie5").unwrap();
    assert!(p.real_fraction.is_none(), "{}", p.text);
    assert!(p.text.contains("tokens/s padded (the data could not be read"), "{}", p.text);
}
