//! The worked configs under `configs/`: every one parses (a renamed key breaks this test), and
//! every one that names its model by a Hub id is planned by `horizon plan` against a fake
//! Hugging Face cache whose snapshot holds only the real model's `config.json`
//! (`tests/fixtures/real-shapes/ORG--NAME/config.json`). Their data files are not here: the
//! plan then sizes for `train.max_seq_len` and says why. A CUDA config plans on any build.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::hub::{add_snapshot, commit};
use horizon::hf::hub_cache::HubId;
use horizon::run::config::RawConfig;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `configs/*.yaml`, sorted.
fn configs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(root().join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    v
}

/// The Hub id of a config's `model.path` (none for a local directory or a random model).
fn hub_model(raw: &RawConfig) -> Option<HubId> {
    let p = raw.model.path.as_ref()?.to_str()?;
    if root().join(p).exists() {
        return None;
    }
    HubId::parse(p)
}

#[test]
fn every_worked_config_parses() {
    let all = configs();
    assert!(all.len() >= 12, "{all:?}");
    for path in all {
        RawConfig::from_file(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
    }
}

#[test]
fn every_hub_config_plans_against_its_real_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let mut planned = Vec::new();
    for path in configs() {
        let raw = RawConfig::from_file(&path).unwrap();
        let Some(id) = hub_model(&raw) else { continue };
        let shape = root()
            .join("tests/fixtures/real-shapes")
            .join(id.repo.replace('/', "--"))
            .join("config.json");
        let json = fs::read(&shape).unwrap_or_else(|_| {
            panic!("{}: no {} (the real config.json of {})", path.display(), shape.display(), id)
        });
        let rev = id.revision_or_main();
        add_snapshot(tmp.path(), &id.repo, &commit(1), &[("config.json", json.clone())], &[rev]);
        let o = Command::new(env!("CARGO_BIN_EXE_horizon"))
            .args(["plan", "--config", path.to_str().unwrap(), "--host-memory", "2TiB"])
            .env("HF_HUB_CACHE", tmp.path())
            .current_dir(root())
            .output()
            .unwrap();
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{}:\n{out}\n{err}", path.display());
        let cfg: serde_json::Value = serde_json::from_slice(&json).unwrap();
        let line = format!("model.path {id}: commit {}", commit(1));
        assert!(out.contains(&line), "{}: {line:?} in\n{out}", path.display());
        assert!(out.contains("memory plan (") && out.contains(" parameters)"), "{out}");
        let key = if raw.dpo().is_some() { "dpo.max_length" } else { "train.max_seq_len" };
        assert!(out.contains(&format!("{key}, assumed")), "{}: {out}", path.display());
        if raw.dpo().is_some() {
            assert!(out.contains("DPO reference log-probs"), "{}: {out}", path.display());
        }
        assert!(out.ends_with("fits\n"), "{}: {out}", path.display());
        let layers = cfg["num_hidden_layers"].as_u64().unwrap();
        assert!(out.contains(&format!("this model ({layers} layers)")), "{out}");
        planned.push(path.file_name().unwrap().to_str().unwrap().to_string());
    }
    for want in [
        "gpt-oss-120b-full.yaml",
        "gpt-oss-120b-lora.yaml",
        "gpt-oss-20b-full.yaml",
        "gpt-oss-20b-lora.yaml",
        "llama-3.1-8b-dpo-lora.yaml",
        "llama-3.1-8b-lora.yaml",
        "llama-3.1-8b-qlora.yaml",
        "qwen3-0.6b-chat-sft.yaml",
        "qwen3-0.6b-dpo-full.yaml",
        "qwen3-0.6b-full.yaml",
        "qwen3-32b-qlora.yaml",
    ] {
        assert!(planned.iter().any(|p| p == want), "{want} not planned: {planned:?}");
    }
}

/// The parameter count each real shape plans with is the published model's.
#[test]
fn real_shapes_have_the_published_parameter_counts() {
    for (dir, want) in [
        ("Qwen--Qwen3-0.6B", 596_049_920u64),
        ("Qwen--Qwen3-32B", 32_762_123_264),
        ("meta-llama--Llama-3.1-8B", 8_030_261_248),
        ("openai--gpt-oss-20b", 20_914_757_184),
        ("openai--gpt-oss-120b", 116_829_156_672),
    ] {
        let path = root().join("tests/fixtures/real-shapes").join(dir).join("config.json");
        let cfg = horizon::hf::ModelConfig::from_file(&path).unwrap();
        let got = horizon::model::describe(&cfg).num_params() as u64;
        assert_eq!(got, want, "{dir}");
    }
}
