//! Checkpoints that lose nothing: a run killed with SIGKILL mid-training and mid-save resumes
//! to bit-identical weights; a non-finite gradient skips the update (weights untouched) and
//! enough of them in a row stop the run with its last good checkpoint intact.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use common::copy_tree;
use horizon::run::config::RawConfig;
use horizon::run::trainer::Trainer;

fn config(out: &Path, steps: usize, link_gbps: f64, extra: &str) -> String {
    format!(
        "model: {{ init: random, arch: llama, hidden_size: 64, intermediate_size: 176, num_hidden_layers: 4,\n\
         \x20        num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256 }}\n\
         data: {{ format: synthetic, shuffle: true }}\n\
         train: {{ steps: {steps}, batch_size: 2, max_seq_len: 16, save_every: 1, keep_checkpoints: 2, {extra} }}\n\
         optimizer: {{ lr: 1.0e-3, schedule: cosine, warmup_steps: 2 }}\n\
         engine: {{ checkpoint_every: 2 }}\n\
         device: {{ link_gbps: {link_gbps} }}\n\
         output: {{ dir: '{}' }}\n",
        out.display()
    )
}

fn write(dir: &Path, yaml: &str) -> std::path::PathBuf {
    let p = dir.join("c.yaml");
    std::fs::write(&p, yaml).unwrap();
    p
}

/// Run `horizon train`, killing it with SIGKILL right after a stdout line starting with
/// `kill_after` appears (after `delay_ms`). Returns whether it was killed.
fn run_until(cfg: &Path, resume: bool, kill_after: Option<&str>, delay_ms: u64) -> bool {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horizon"));
    cmd.args(["train", "--config", cfg.to_str().unwrap()]);
    if resume {
        cmd.args(["--resume", "latest"]);
    }
    cmd.env("HORIZON_TEST_SAVE_PAUSE_MS", "400").stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let out = child.stdout.take().unwrap();
    let mut killed = false;
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        if let Some(k) = kill_after
            && line.starts_with(k)
        {
            std::thread::sleep(std::time::Duration::from_millis(delay_ms));
            child.kill().unwrap();
            killed = true;
            break;
        }
    }
    let status = child.wait().unwrap();
    assert!(killed || status.success(), "horizon train failed: {status}");
    killed
}

#[test]
fn sigkill_mid_training_and_mid_save_resumes_bit_identically() {
    let steps = 7;
    let base = tempfile::tempdir().unwrap();
    let cfg = write(base.path(), &config(&base.path().join("out"), steps, 0.004, ""));
    run_until(&cfg, false, None, 0);
    let want = std::fs::read(base.path().join("out/final/model.safetensors")).unwrap();

    let run = tempfile::tempdir().unwrap();
    let out = run.path().join("out");
    let cfg = write(run.path(), &config(&out, steps, 0.004, ""));
    // Killed mid-step 3 (after step 2's line, while step 3 computes).
    assert!(run_until(&cfg, false, Some("step     2/"), 30));
    // Killed in the middle of writing step 4's checkpoint: the temporary directory is left
    // behind, the previous checkpoint is intact, and `latest` ignores the partial one.
    assert!(run_until(&cfg, true, Some("saving checkpoint step-00000004"), 150));
    let leftovers: Vec<_> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        .collect();
    assert!(!leftovers.is_empty(), "the kill did not land mid-save");
    assert!(!out.join("checkpoints/step-00000004").exists());
    // Resume to the end.
    run_until(&cfg, true, None, 0);
    let got = std::fs::read(out.join("final/model.safetensors")).unwrap();
    assert!(got == want, "resumed weights differ from the uninterrupted run");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().count() >= steps);
}

#[test]
fn a_nan_gradient_skips_the_update() {
    let tmp = tempfile::tempdir().unwrap();
    let raw = RawConfig::from_yaml(&config(&tmp.path().join("out"), 4, 0.0, ""), "t").unwrap();
    let mut t = Trainer::new(raw.resolve("t").unwrap()).unwrap();
    t.inject_nan_at = vec![1];
    assert!(!t.step(0).unwrap().skipped);
    let before = t.engine.state().clone_params_and_moments();
    let m = t.step(1).unwrap();
    assert!(m.skipped && !m.grad_norm.is_finite(), "{m:?}");
    let after = t.engine.state().clone_params_and_moments();
    assert!(before == after, "a skipped step wrote to the masters or moments");
    assert_eq!(t.engine.state().updates, 1);
    // The next step is normal again.
    assert!(!t.step(2).unwrap().skipped);
    assert_eq!(t.engine.state().updates, 2);
}

#[test]
fn consecutive_bad_steps_stop_the_run_with_the_last_checkpoint_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let cfg = write(tmp.path(), &config(&out, 10, 0.0, "max_bad_steps: 3"));
    let o = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .env("HORIZON_TEST_NAN_STEPS", "2,3,4,5")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the run should stop");
    assert!(err.contains("3 consecutive steps") && err.contains("step-00000002"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // The last good checkpoint (after step 2) is intact and resumable.
    assert!(out.join("checkpoints/step-00000002/state.json").is_file());
}

/// Updates that would make a weight or moment non-finite are held back (issue 45: the update
/// wrote NaN into the masters, and the run went on): with a learning rate past f32's range,
/// every element of every step is held. Each step is reported bad in metrics.jsonl, naming
/// each buffer and how many elements it held, a warning says so, and the run stops after
/// `train.max_bad_steps` such steps with no checkpoint taken from them and no `final/`. In
/// every memory mode the masters and moments keep their values, bit for bit, all finite.
#[test]
fn updates_that_would_go_non_finite_are_held_and_stop_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let yaml = config(&out, 10, 0.0, "max_bad_steps: 3").replace("lr: 1.0e-3", "lr: 1.0e+39");
    let cfg = write(tmp.path(), &yaml);
    let o = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    let (err, stdout) = (String::from_utf8_lossy(&o.stderr), String::from_utf8_lossy(&o.stdout));
    assert!(!o.status.success() && !err.contains("panicked"), "{err}");
    assert!(err.contains("3 consecutive steps") && err.contains("held back"), "{err}");
    assert!(stdout.contains("elements held back") && stdout.contains("model.layers.3"), "{stdout}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> =
        metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "{metrics}");
    for l in &lines {
        let held = l["held"].as_array().unwrap_or_else(|| panic!("no held: {l}"));
        let names: Vec<&str> = held.iter().map(|h| h["buffer"].as_str().unwrap()).collect();
        assert!(names.contains(&"model.embed_tokens") && names.contains(&"lm_head"), "{l}");
        assert!(held.iter().all(|h| h["elements"].as_u64().unwrap() > 0), "{l}");
        assert_eq!(l["skipped"], false, "{l}");
    }
    assert!(!out.join("checkpoints").exists() && !out.join("final").exists());
    for memory in ["exact", "lean", "compact"] {
        let yaml = yaml.replace("optimizer: {", &format!("optimizer: {{ memory: {memory},"));
        let raw = RawConfig::from_yaml(&yaml, "t").unwrap();
        let mut t = Trainer::new(raw.resolve("t").unwrap()).unwrap();
        let before = t.engine.state().clone_params_and_moments();
        for k in 0..2 {
            let mut m = t.step(k).unwrap();
            t.settle(&mut m);
            let held: u64 = m.held.iter().map(|h| h.elements).sum();
            assert_eq!(held, t.engine.sizes().params as u64, "{memory}: every element held, {m:?}");
            assert!(!m.skipped && m.loss.is_finite(), "{memory}: {m:?}");
        }
        let after = t.engine.state().clone_params_and_moments();
        assert!(before == after, "{memory}: a held element was written");
        let (p, mo, v) = &after;
        let all = [p, mo, v].into_iter().flat_map(|s| s.buffers().into_iter().flatten());
        assert!(all.copied().all(f32::is_finite), "{memory}");
        // Found in the update pass, after the step's scalars were fixed: the steps count.
        assert_eq!(t.engine.state().updates, 2, "{memory}");
    }
}

/// `--resume` compares what changes the math with the checkpoint's run (issue 45): a LoRA run
/// resumed with another `adapter.alpha`, as `qlora`, or over base weights that are not the
/// checkpoint's (same shapes, one bit of one value changed, where a sampled fingerprint did not
/// look: the base is compared by the content hash of every byte) is refused, naming each key
/// and both values;
/// the same base weights moved to another directory, and a longer run, resume.
#[test]
fn a_resume_that_changes_the_math_is_refused_naming_what_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_gqa");
    let copy = |to: &Path| copy_tree(&fixture.join("model"), to);
    let (base, moved, other) =
        (tmp.path().join("base"), tmp.path().join("moved"), tmp.path().join("other"));
    copy(&base);
    copy(&moved);
    copy(&other);
    // One weight of `other` changed (its lowest bit): same names, shapes and size, and a byte
    // between the 64 windows of 256 bytes that the sampled fingerprint read, which passed it.
    let st = other.join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let data = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let window = |k: usize| data + (bytes.len() - data - 256) * k / 63;
    let gap = window(10) + 256..window(11);
    assert!(gap.len() > 64, "the fixture is large enough to leave gaps: {gap:?}");
    let at = data + (gap.start + gap.len() / 2 - data) / 4 * 4;
    bytes[at] ^= 1;
    std::fs::write(&st, bytes).unwrap();
    let out = tmp.path().join("out");
    let yaml = |model: &Path, kind: &str, alpha: u32, steps: u32| {
        format!(
            "model: {{ path: '{}' }}\ndata: {{ path: '{}', format: pretokenized }}\n\
             train: {{ steps: {steps}, batch_size: 3, max_seq_len: 64, save_every: 1 }}\n\
             adapter: {{ type: {kind}, r: 4, alpha: {alpha}, targets: [q_proj, v_proj] }}\n\
             output: {{ dir: '{}' }}\n",
            model.display(),
            fixture.join("data.jsonl").display(),
            out.display()
        )
    };
    let train = |y: String, resume: bool| {
        let cfg = write(tmp.path(), &y);
        let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
        if resume {
            args.extend(["--resume", "latest"]);
        }
        Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().unwrap()
    };
    assert!(train(yaml(&base, "lora", 8, 2), false).status.success());
    let refused = |o: std::process::Output, what: &[&str]| {
        let e = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success(), "resumed: {what:?}");
        for w in what {
            assert!(e.contains(w), "{w}: {e}");
        }
    };
    refused(train(yaml(&base, "lora", 16, 3), true), &["adapter.alpha", "8", "16"]);
    refused(train(yaml(&base, "qlora", 8, 3), true), &["adapter.type", "lora", "qlora"]);
    refused(train(yaml(&other, "lora", 8, 3), true), &["base weights", "model.path"]);
    let o = train(yaml(&moved, "lora", 8, 3), true);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// A damaged optimizer state is refused before it is used, naming the file and the place
/// (issue 45), even where no checksum was recorded (a checkpoint of an earlier version): a
/// negative second moment (exact mode), an 8-bit moments file whose tensor count is absurd (it
/// panicked allocating from it) or whose block scale is NaN (compact mode).
#[test]
fn a_damaged_optimizer_state_is_refused_naming_file_and_place() {
    let resume_err = |memory: &str, damage: &dyn Fn(&Path)| -> String {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let yaml = config(&out, 2, 0.0, "").replace(
            "optimizer: { lr: 1.0e-3,",
            &format!("optimizer: {{ memory: {memory}, lr: 1.0e-3,"),
        );
        let cfg = write(tmp.path(), &yaml);
        assert!(!run_until(&cfg, false, None, 0));
        let ckpt = out.join("checkpoints/step-00000002");
        damage(&ckpt);
        // As a checkpoint without checksums (written before they were recorded): its values
        // are checked for what is possible.
        let state = ckpt.join("state.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("checksums");
        o.remove("sealed");
        std::fs::write(&state, v.to_string()).unwrap();
        let more = write(tmp.path(), &yaml.replace("steps: 2,", "steps: 3,"));
        let o = Command::new(env!("CARGO_BIN_EXE_horizon"))
            .args(["train", "--config", more.to_str().unwrap(), "--resume", "latest"])
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success() && !e.contains("panicked"), "{e}");
        e
    };
    let patch = |path: &Path, at: usize, bytes: &[u8]| {
        let mut b = std::fs::read(path).unwrap();
        let at = if at == usize::MAX { b.len() - bytes.len() } else { at };
        b[at..at + bytes.len()].copy_from_slice(bytes);
        std::fs::write(path, b).unwrap();
    };
    let e = resume_err("exact", &|c| {
        let f = c.join("exp_avg_sq.safetensors");
        let b = std::fs::read(&f).unwrap();
        let data = 8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        patch(&f, data, &(-1.0f32).to_le_bytes());
    });
    assert!(
        e.contains("exp_avg_sq.safetensors") && e.contains("never") && e.contains("index"),
        "{e}"
    );
    let e = resume_err("compact", &|c| patch(&c.join("moments8.bin"), 16, &u64::MAX.to_le_bytes()));
    assert!(e.contains("moments8.bin") && e.contains("damaged"), "{e}");
    let e = resume_err("compact", &|c| {
        patch(&c.join("moments8.bin"), usize::MAX, &f32::NAN.to_le_bytes())
    });
    assert!(e.contains("moments8.bin") && e.contains("NaN"), "{e}");
}

/// Checkpoint files damaged at random (a seeded loop: truncated, a byte flipped, the
/// safetensors header's length rewritten) give a clean error naming the damage (and the newest
/// sound checkpoint to resume instead), or a resume bit-identical to the uninterrupted run;
/// never a panic, an abort, or training on damaged state (issue 45).
#[test]
fn damaged_checkpoints_are_clean_errors_or_identical_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let config = |out: &Path, steps: usize| {
        config(out, steps, 0.0, "").replace("keep_checkpoints: 2", "keep_checkpoints: 3")
    };
    let run = |out: &Path, steps: usize, resume: bool| {
        let cfg = write(out.parent().unwrap(), &config(out, steps));
        let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
        if resume {
            args.extend(["--resume", "latest"]);
        }
        Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().unwrap()
    };
    // The run of 3 steps, whose last checkpoint and final/ each trial's copy drops: resuming
    // its step-2 checkpoint ends where it did.
    let base = tmp.path().join("base/out");
    std::fs::create_dir_all(base.parent().unwrap()).unwrap();
    assert!(run(&base, 3, false).status.success());
    let want = std::fs::read(base.join("final/model.safetensors")).unwrap();
    let fresh = |out: &Path| {
        copy_tree(&base, out);
        std::fs::remove_dir_all(out.join("checkpoints/step-00000003")).unwrap();
        std::fs::remove_dir_all(out.join("final")).unwrap();
    };
    let files =
        ["params.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors", "state.json"];
    let mut rng = horizon::rng::SplitMix64::new(0x2545_f491_4f6c_dd1d);
    let mut next = |n: u64| rng.below(n.max(1));
    let (mut refused, mut resumed) = (0, 0);
    for trial in 0..24 {
        let out = tmp.path().join(format!("t{trial}/out"));
        fresh(&out);
        let file = out.join("checkpoints/step-00000002").join(files[next(4) as usize]);
        let mut b = std::fs::read(&file).unwrap();
        let kind = next(3);
        match kind {
            0 => b.truncate(next(b.len() as u64) as usize),
            1 => {
                let at = next(b.len() as u64) as usize;
                b[at] ^= 1 << next(8);
            }
            _ => b[..8].copy_from_slice(&(next(u64::MAX)).to_le_bytes()),
        }
        std::fs::write(&file, &b).unwrap();
        let o = run(&out, 3, true);
        let e = String::from_utf8_lossy(&o.stderr).to_string();
        let what = format!("trial {trial}: {} damaged ({kind})", file.display());
        assert!(o.status.code().is_some() && !e.contains("panicked"), "{what}: {e}");
        if o.status.success() {
            let got = std::fs::read(out.join("final/model.safetensors")).unwrap();
            assert!(got == want, "{what}: resumed, but not to the uninterrupted run's weights");
            resumed += 1;
        } else {
            refused += 1;
        }
    }
    assert!(refused > 0, "{refused} refused, {resumed} resumed");
    // With the newest damaged, `--resume latest-sound` takes the one before and ends where the
    // uninterrupted run does.
    let out = tmp.path().join("sound/out");
    fresh(&out);
    let st = out.join("checkpoints/step-00000002/params.safetensors");
    let mut b = std::fs::read(&st).unwrap();
    let n = b.len();
    b[n - 1] ^= 1;
    std::fs::write(&st, b).unwrap();
    let cfg = write(out.parent().unwrap(), &config(&out, 3));
    let o = Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(["train", "--config", cfg.to_str().unwrap(), "--resume", "latest-sound"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("passing over"));
    assert!(std::fs::read(out.join("final/model.safetensors")).unwrap() == want);
}
