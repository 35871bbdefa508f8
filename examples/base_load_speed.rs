//! Load time of an adapter run's frozen base, its content hash included (computed in the
//! load's own pass: `model::base::FrozenBase::load_hf`): `cargo run --release --example
//! base_load_speed -- DIR` writes a bf16 Llama of about 340 MB (hidden 1024, 8 layers,
//! vocabulary 32000) into DIR when it holds none, then loads its frozen base once as a LoRA run
//! does (`run::load::load_run_model`) and prints `{"load_s": ..., "base_bytes": ..., "hash":
//! ...}`. Run it several times, interleaved with the build it is compared with: the first run
//! after writing the model reads it from the page cache like the others.

use std::path::Path;
use std::time::Instant;

use horizon::hf::checkpoint::SaveDtype;
use horizon::model::params::ParamStore;
use horizon::run::config::RawConfig;
use horizon::run::load::{load_run_model, model_config};

const SHAPE: &str = "arch: llama, hidden_size: 1024, intermediate_size: 2816, \
                     num_hidden_layers: 8, num_attention_heads: 16, num_key_value_heads: 4, \
                     vocab_size: 32000";

fn main() {
    let dir = std::env::args().nth(1).expect("usage: base_load_speed DIR");
    let dir = Path::new(&dir);
    if !dir.join("model.safetensors").is_file() {
        std::fs::create_dir_all(dir).unwrap();
        let yaml = format!("model: {{ init: random, {SHAPE} }}\ndata: {{ path: unused }}\n");
        let raw = RawConfig::from_yaml(&yaml, "base_load_speed").unwrap();
        let cfg = model_config(&raw).unwrap();
        let layout = horizon::model::describe(&cfg);
        let params = ParamStore::random(&layout, 7, 0.02);
        params.save_safetensors(&layout, &dir.join("model.safetensors"), SaveDtype::Bf16).unwrap();
        let json = serde_json::to_string_pretty(&cfg.to_hf_json()).unwrap();
        std::fs::write(dir.join("config.json"), json).unwrap();
    }
    let yaml = format!(
        "model: {{ path: '{}' }}\ndata: {{ path: unused }}\n\
         adapter: {{ type: lora, r: 8, alpha: 16, targets: [q_proj, v_proj] }}\n",
        dir.display()
    );
    let run = RawConfig::from_yaml(&yaml, "base_load_speed").unwrap().resolve("t").unwrap();
    let t0 = Instant::now();
    let m = load_run_model(&run.raw, run.adapter.as_ref()).unwrap();
    let s = t0.elapsed().as_secs_f64();
    let bytes = m.base.map_or(0, |b| b.bytes());
    let hash = m.base_hash.unwrap_or_default();
    println!("{{\"load_s\": {s:.4}, \"base_bytes\": {bytes}, \"hash\": \"{hash}\"}}");
}
