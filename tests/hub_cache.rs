//! Hub ids in a config (`model.path`, `data.tokenizer`, `adapter.init`) resolved from a fake
//! Hugging Face cache laid out as `huggingface_hub` lays it out: the cache's root by the
//! environment's precedence, revisions by ref name and by commit, a local directory before a
//! Hub id, and each error's key parts; then `horizon plan` and `horizon train` (LoRA) on a Hub id.
//! The environment is injected (never the test process's own: tests run in parallel).

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::process::Command;

use common::case_dir;
use common::hub::{add_snapshot, as_refs, commit, files_of};
use horizon::run::config::{RawConfig, RunConfig};

const CONFIG: &[u8] = br#"{"model_type": "llama"}"#;

/// An environment of these variables only.
fn env_of(pairs: &[(&str, &Path)]) -> impl Fn(&str) -> Option<String> + use<> {
    let m: HashMap<String, String> =
        pairs.iter().map(|(k, v)| (k.to_string(), v.display().to_string())).collect();
    move |k: &str| m.get(k).cloned()
}

/// `yaml` (a model section's keys, then more sections) resolved with the cache at `root`.
fn resolve(model: &str, more: &str, root: &Path) -> anyhow::Result<RunConfig> {
    let yaml = format!("model: {{ {model} }}\ndata: {{ format: synthetic }}\n{more}");
    RawConfig::from_yaml(&yaml, "t.yaml")?
        .resolve_with_env("t.yaml", &env_of(&[("HF_HUB_CACHE", root)]))
}

fn error(model: &str, more: &str, root: &Path) -> String {
    format!("{:#}", resolve(model, more, root).unwrap_err())
}

#[test]
fn a_hub_id_resolves_to_its_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = add_snapshot(
        tmp.path(),
        "Qwen/Qwen3-0.6B",
        &commit(1),
        &[("config.json", CONFIG.to_vec())],
        &["main"],
    );
    let c = resolve("path: Qwen/Qwen3-0.6B", "", tmp.path()).unwrap();
    assert_eq!(c.raw.model.path.as_deref(), Some(snap.as_path()));
    assert_eq!(c.hub.len(), 1);
    assert_eq!(c.hub[0].key, "model.path");
    assert_eq!(c.hub[0].snapshot.commit, commit(1));
    let line = &c.hub_lines()[0];
    assert!(line.contains("model.path Qwen/Qwen3-0.6B") && line.contains(&commit(1)), "{line}");
    // A resolved config names directories only, and resolves to itself.
    let again =
        c.raw.clone().resolve_with_env("again", &env_of(&[("HF_HUB_CACHE", tmp.path())])).unwrap();
    assert_eq!(again.raw.model.path, c.raw.model.path);
    assert!(again.hub.is_empty());
}

#[test]
fn revisions_by_ref_name_and_by_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let files = [("config.json", CONFIG.to_vec())];
    add_snapshot(tmp.path(), "org/m", &commit(1), &files, &["main"]);
    let v2 = add_snapshot(tmp.path(), "org/m", &commit(2), &files, &["v2", "refs/pr/3"]);
    let dir = |model: &str| resolve(model, "", tmp.path()).unwrap().raw.model.path.unwrap();
    assert!(dir("path: org/m").ends_with(commit(1)));
    assert_eq!(dir("path: org/m, revision: v2"), v2);
    assert_eq!(dir("path: org/m@v2"), v2);
    assert_eq!(dir("path: org/m@refs/pr/3"), v2);
    assert_eq!(dir(&format!("path: org/m, revision: '{}'", commit(2))), v2);
    let e = error("path: org/m@v2, revision: main", "", tmp.path());
    assert!(e.contains("model.path") && e.contains("given twice"), "{e}");
}

#[test]
fn the_cache_root_follows_the_environment() {
    let tmp = tempfile::tempdir().unwrap();
    let (home, xdg, hf_home) =
        (tmp.path().join("home"), tmp.path().join("xdg"), tmp.path().join("hf"));
    let files = [("config.json", CONFIG.to_vec())];
    add_snapshot(&home.join(".cache/huggingface/hub"), "org/m", &commit(1), &files, &["main"]);
    add_snapshot(&xdg.join("huggingface/hub"), "org/m", &commit(2), &files, &["main"]);
    add_snapshot(&hf_home.join("hub"), "org/m", &commit(3), &files, &["main"]);
    let commit_in = |pairs: &[(&str, &Path)]| {
        let raw =
            RawConfig::from_yaml("model: {path: org/m}\ndata: {format: synthetic}\n", "t").unwrap();
        raw.resolve_with_env("t", &env_of(pairs)).map(|c| c.hub[0].snapshot.commit.clone())
    };
    assert_eq!(commit_in(&[("HOME", &home)]).unwrap(), commit(1));
    assert_eq!(commit_in(&[("HOME", &home), ("XDG_CACHE_HOME", &xdg)]).unwrap(), commit(2));
    let hf = [("HOME", home.as_path()), ("XDG_CACHE_HOME", &xdg), ("HF_HOME", &hf_home)];
    assert_eq!(commit_in(&hf).unwrap(), commit(3));
    // HF_HUB_CACHE wins over HF_HOME: here it holds nothing, and the error names it.
    let empty = tmp.path().join("empty");
    let e =
        format!("{:#}", commit_in(&[hf[0], hf[1], hf[2], ("HF_HUB_CACHE", &empty)]).unwrap_err());
    assert!(
        e.contains("not in the local Hugging Face cache")
            && e.contains(&empty.display().to_string()),
        "{e}"
    );
}

#[test]
fn a_local_directory_wins_over_a_hub_id() {
    let tmp = tempfile::tempdir().unwrap();
    // `tests/fixtures` exists (tests run in the package root) and reads as a Hub id.
    add_snapshot(
        tmp.path(),
        "tests/fixtures",
        &commit(1),
        &[("config.json", CONFIG.to_vec())],
        &["main"],
    );
    let c = resolve("path: tests/fixtures", "", tmp.path()).unwrap();
    assert_eq!(c.raw.model.path.as_deref(), Some(Path::new("tests/fixtures")));
    assert!(c.hub.is_empty());
    let e = error("path: tests/fixtures, revision: v1", "", tmp.path());
    assert!(e.contains("model.revision") && e.contains("local path") && e.contains("hint:"), "{e}");
    // Neither a path nor a Hub id: left for loading to refuse, as before.
    let c = resolve("path: no-such-model", "", tmp.path()).unwrap();
    assert_eq!(c.raw.model.path.as_deref(), Some(Path::new("no-such-model")));
}

#[test]
fn a_missing_repo_says_how_to_download_it() {
    let tmp = tempfile::tempdir().unwrap();
    let e = error("path: Qwen/Qwen3-8B", "", tmp.path());
    for want in [
        "t.yaml: model.path Qwen/Qwen3-8B: not in the local Hugging Face cache",
        &tmp.path().display().to_string(),
        "hint: run `hf download Qwen/Qwen3-8B`",
        "HF_HUB_CACHE / HF_HOME",
    ] {
        assert!(e.contains(want), "{want:?} in {e}");
    }
    let e = error("path: Qwen/Qwen3-8B, revision: v1", "", tmp.path());
    assert!(e.contains("`hf download Qwen/Qwen3-8B --revision v1`"), "{e}");
}

#[test]
fn a_missing_revision_names_the_refs_there() {
    let tmp = tempfile::tempdir().unwrap();
    add_snapshot(
        tmp.path(),
        "org/m",
        &commit(1),
        &[("config.json", CONFIG.to_vec())],
        &["main", "v1"],
    );
    let e = error("path: org/m, revision: v9", "", tmp.path());
    for want in [
        "model.path org/m@v9",
        "revision v9",
        "refs: main, v1",
        &commit(1),
        "hf download org/m --revision v9",
    ] {
        assert!(e.contains(want), "{want:?} in {e}");
    }
    // A ref whose snapshot is gone.
    fs::write(tmp.path().join("models--org--m/refs/v2"), commit(7)).unwrap();
    let e = error("path: org/m@v2", "", tmp.path());
    assert!(e.contains("refs/v2 names commit") && e.contains("snapshot is missing"), "{e}");
}

#[test]
fn a_link_without_its_blob_is_not_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let files = [("config.json", CONFIG.to_vec()), ("model.safetensors", b"weights".to_vec())];
    add_snapshot(tmp.path(), "org/m", &commit(1), &files, &["main"]);
    let blobs = tmp.path().join("models--org--m/blobs");
    let weights = fs::read_dir(&blobs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| fs::read(p).unwrap() == b"weights")
        .unwrap();
    fs::remove_file(weights).unwrap();
    let e = error("path: org/m", "", tmp.path());
    assert!(
        e.contains("model.safetensors") && e.contains("no blob") && e.contains("hf download org/m"),
        "{e}"
    );
    // A snapshot without the file the key needs.
    add_snapshot(tmp.path(), "org/n", &commit(1), &[("README.md", b"#".to_vec())], &["main"]);
    let e = error("path: org/n", "", tmp.path());
    assert!(e.contains("model.path org/n") && e.contains("has no config.json"), "{e}");
}

#[test]
fn tokenizer_and_adapter_init_take_hub_ids() {
    let tmp = tempfile::tempdir().unwrap();
    add_snapshot(tmp.path(), "org/m", &commit(1), &[("config.json", CONFIG.to_vec())], &["main"]);
    let tok = add_snapshot(
        tmp.path(),
        "org/tok",
        &commit(2),
        &[("tokenizer.json", b"{}".to_vec())],
        &["v1"],
    );
    let ada = add_snapshot(
        tmp.path(),
        "org/ada",
        &commit(3),
        &[("adapter_config.json", b"{}".to_vec())],
        &["main"],
    );
    let yaml = "model: {path: org/m}\ndata: {format: text, path: d.jsonl, tokenizer: org/tok@v1}\nadapter: {type: lora, init: org/ada}\n";
    let env = env_of(&[("HF_HUB_CACHE", tmp.path())]);
    let c = RawConfig::from_yaml(yaml, "t").unwrap().resolve_with_env("t", &env).unwrap();
    assert_eq!(c.raw.data.tokenizer.as_deref(), Some(tok.to_str().unwrap()));
    assert_eq!(c.adapter.as_ref().unwrap().init.as_deref(), Some(ada.as_path()));
    let keys: Vec<&str> = c.hub.iter().map(|h| h.key).collect();
    assert_eq!(keys, ["model.path", "data.tokenizer", "adapter.init"]);
    let e = error("path: org/m", "adapter: { type: lora, init: org/none }\n", tmp.path());
    assert!(e.contains("adapter.init org/none: not in the local Hugging Face cache"), "{e}");
    let yaml = "model: {path: org/m}\ndata: {format: text, path: d.jsonl, tokenizer: org/m}\n";
    let e = format!(
        "{:#}",
        RawConfig::from_yaml(yaml, "t").unwrap().resolve_with_env("t", &env).unwrap_err()
    );
    assert!(e.contains("data.tokenizer org/m") && e.contains("has no tokenizer.json"), "{e}");
}

fn horizon_in_cache(args: &[&str], cache: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_horizon"))
        .args(args)
        .env("HF_HUB_CACHE", cache)
        .output()
        .expect("run horizon")
}

#[test]
fn plan_takes_a_hub_id() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let files = files_of(&case_dir("llama_gqa").join("model"));
    add_snapshot(&cache, "org/llama-gqa", &commit(4), &as_refs(&files), &["main"]);
    let cfg = tmp.path().join("c.yaml");
    fs::write(
        &cfg,
        "model: {path: org/llama-gqa}\ndata: {format: synthetic}\ntrain: {max_seq_len: 32}\n",
    )
    .unwrap();
    let o = horizon_in_cache(&["plan", "--config", cfg.to_str().unwrap()], &cache);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("model.path org/llama-gqa: commit") && out.contains("fits"), "{out}");
    let o =
        horizon_in_cache(&["plan", "--config", cfg.to_str().unwrap()], &tmp.path().join("none"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("hf download org/llama-gqa")
            && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn an_adapter_trained_on_a_hub_id_names_it_as_peft_does() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let d = case_dir("llama_gqa");
    let snap = add_snapshot(
        &cache,
        "org/llama-gqa",
        &commit(5),
        &as_refs(&files_of(&d.join("model"))),
        &["main"],
    );
    let cfg = tmp.path().join("c.yaml");
    let yaml = format!(
        "model: {{path: org/llama-gqa}}\ndata: {{path: '{}'}}\ntrain: {{steps: 1, batch_size: 2, max_seq_len: 64}}\nadapter: {{type: lora, r: 4}}\noutput: {{dir: '{}'}}\n",
        d.join("data.jsonl").display(),
        tmp.path().join("out").display()
    );
    fs::write(&cfg, yaml).unwrap();
    let o = horizon_in_cache(&["train", "--config", cfg.to_str().unwrap()], &cache);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let fin = tmp.path().join("out/final");
    let c: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(fin.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(c["base_model_name_or_path"], "org/llama-gqa");
    assert_eq!(c["revision"], commit(5));
    // Horizon's own note keeps the directory, for `horizon export --merge`.
    let note = horizon::adapter::peft::read_sidecar(&fin).unwrap().unwrap();
    assert_eq!(note.base_model.as_deref(), Some(snap.as_path()));
    // Without the note, `--merge` finds the base by PEFT's Hub id (and revision) in the
    // cache, as `--base org/llama-gqa` does; `generate --model` takes a Hub id too.
    fs::remove_file(fin.join("horizon_adapter.json")).unwrap();
    for extra in [&[][..], &["--base", "org/llama-gqa"][..]] {
        let out = tmp.path().join(format!("merged{}", extra.len()));
        let mut args =
            vec!["export", fin.to_str().unwrap(), "--merge", "--out", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = horizon_in_cache(&args, &cache);
        assert!(o.status.success(), "{:?}: {}", extra, String::from_utf8_lossy(&o.stderr));
        assert!(out.join("model.safetensors").is_file());
    }
    let empty = tmp.path().join("empty-cache");
    let o = horizon_in_cache(&["export", fin.to_str().unwrap(), "--merge", "--out", "x"], &empty);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("not in the local Hugging Face cache")
            && err.contains("hf download org/llama-gqa"),
        "{err}"
    );
    let o = horizon_in_cache(&["generate", "--model", "org/nope", "--prompt", "hi"], &cache);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("--model org/nope")
            && err.contains("hf download org/nope"),
        "{err}"
    );
}
