//! The `horizon` binary on the LoRA fixtures: `OUT/final/` is a PEFT adapter directory (PEFT's
//! file layout, config fields and tensor names), a resumed run ends bit-identical to a straight
//! one, `horizon export --merge` writes `W + s B A` (on the dequantised base for QLoRA), and bad
//! adapter input gets a clear error.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use horizon::hf::checkpoint::{list_tensors, read_tensor_f64};
use serde_json::Value;

const CASES: [&str; 2] = ["llama_lora", "qwen2_qlora_nf4"];

fn dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora").join(case)
}

fn expected(case: &str) -> Value {
    serde_json::from_str(&fs::read_to_string(dir(case).join("expected.json")).unwrap()).unwrap()
}

fn horizon(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_horizon")).args(args).output().expect("run horizon")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The case's run config into `tmp/config.yaml`, output in `tmp/out`; `adapter` replaces the
/// case's adapter keys when given, `extra` adds YAML.
fn config(tmp: &Path, case: &str, adapter: Option<&str>, extra: &str) -> PathBuf {
    let e = expected(case);
    let d = dir(case);
    let kind = if e["quant"].is_null() { "lora" } else { "qlora" };
    let mut targets: Vec<&str> =
        e["targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    let params = e.get("target_parameters").and_then(|p| p.as_array());
    targets.extend(params.into_iter().flatten().map(|t| t.as_str().unwrap()));
    let init = d.join("adapter_init");
    let own = format!(
        "type: {kind}, r: {}, alpha: {}, targets: [{}], init: '{}'",
        e["r"],
        e["alpha"],
        targets.join(", "),
        init.display()
    );
    let yaml = format!(
        "model: {{ path: '{}' }}\ndata: {{ path: '{}', format: pretokenized }}\n\
         train: {{ steps: {}, batch_size: {}, max_seq_len: 64 }}\n\
         optimizer: {{ lr: {}, betas: [{}, {}], eps: {}, weight_decay: {}, grad_clip: {} }}\n\
         adapter: {{ {} }}\noutput: {{ dir: '{}' }}\n{extra}",
        d.join("model").display(),
        d.join("data.jsonl").display(),
        e["steps"],
        e["batch"],
        e["lr"],
        e["betas"][0],
        e["betas"][1],
        e["eps"],
        e["weight_decay"],
        e["grad_clip"],
        adapter.unwrap_or(&own),
        tmp.join("out").display(),
    );
    let path = tmp.join("config.yaml");
    fs::write(&path, yaml).unwrap();
    path
}

fn train(cfg: &Path, more: &[&str]) -> Output {
    let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
    args.extend_from_slice(more);
    horizon(&args)
}

#[test]
fn train_writes_a_peft_adapter_directory() {
    for case in CASES {
        let tmp = tempfile::tempdir().unwrap();
        let o = train(&config(tmp.path(), case, None, ""), &[]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let fin = tmp.path().join("out/final");
        let mut files: Vec<String> = fs::read_dir(&fin)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        files.sort();
        assert_eq!(
            files,
            ["adapter_config.json", "adapter_model.safetensors", "horizon_adapter.json"],
            "{case}: PEFT's two files (and Horizon's note)"
        );
        let c: Value =
            serde_json::from_str(&fs::read_to_string(fin.join("adapter_config.json")).unwrap())
                .unwrap();
        let e = expected(case);
        assert_eq!(c["peft_type"], "LORA");
        assert_eq!(c["r"], e["r"]);
        assert_eq!(c["lora_alpha"].as_f64(), e["alpha"].as_f64());
        assert_eq!(c["use_rslora"], false);
        let mut want: Vec<&str> =
            e["targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        let mut got: Vec<&str> =
            c["target_modules"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        want.sort();
        got.sort();
        assert_eq!(got, want, "{case}: target_modules");
        assert_eq!(c["base_model_name_or_path"], dir(case).join("model").display().to_string());
        let mut names = list_tensors(&fin.join("adapter_model.safetensors")).unwrap();
        let mut want: Vec<String> = e["adapter_names"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap().to_string())
            .collect();
        names.sort();
        want.sort();
        assert_eq!(names, want, "{case}: PEFT's tensor names");
    }
}

/// The adapter file's tensors, by name, as f64.
fn adapter_tensors(path: &Path) -> Vec<(String, Vec<f64>)> {
    let mut names = list_tensors(path).unwrap();
    names.sort();
    names.into_iter().map(|n| (n.clone(), read_tensor_f64(path, &n).unwrap().1)).collect()
}

#[test]
fn a_resumed_adapter_run_ends_bit_identical_to_a_straight_one() {
    for case in CASES {
        let straight = tempfile::tempdir().unwrap();
        let o = train(&config(straight.path(), case, None, ""), &[]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let split = tempfile::tempdir().unwrap();
        let first = config(split.path(), case, None, "");
        let yaml = fs::read_to_string(&first)
            .unwrap()
            .replace("train: { steps: 3", "train: { steps: 2, save_every: 2");
        fs::write(&first, yaml).unwrap();
        let o = train(&first, &[]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let again = config(split.path(), case, None, "");
        let o = train(&again, &["--resume", "latest"]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let a = adapter_tensors(&straight.path().join("out/final/adapter_model.safetensors"));
        let b = adapter_tensors(&split.path().join("out/final/adapter_model.safetensors"));
        assert_eq!(a.len(), b.len());
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            let same = x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "{case} {n}: the resumed run differs");
        }
    }
}

#[test]
fn export_merge_writes_the_base_plus_b_a() {
    for case in CASES {
        let tmp = tempfile::tempdir().unwrap();
        let o = train(&config(tmp.path(), case, None, ""), &[]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let merged = tmp.path().join("merged");
        let out = tmp.path().join("out");
        let o = horizon(&[
            "export",
            out.to_str().unwrap(),
            "--merge",
            "--out",
            merged.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let e = expected(case);
        let (r, s) = (
            e["r"].as_u64().unwrap() as usize,
            e["alpha"].as_f64().unwrap() / e["r"].as_f64().unwrap(),
        );
        let adapter = tmp.path().join("out/final/adapter_model.safetensors");
        let nf4 = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/nf4/qwen2_weights.safetensors");
        for layer in 0..2 {
            let module = "self_attn.q_proj";
            let name = format!("model.layers.{layer}.{module}.weight");
            let base = if e["quant"].is_null() {
                read_tensor_f64(&dir(case).join("model/model.safetensors"), &name).unwrap().1
            } else {
                read_tensor_f64(&nf4, &format!("{name}.deq")).unwrap().1
            };
            let pre = format!("base_model.model.model.layers.{layer}.{module}");
            let a = read_tensor_f64(&adapter, &format!("{pre}.lora_A.weight")).unwrap().1;
            let b = read_tensor_f64(&adapter, &format!("{pre}.lora_B.weight")).unwrap().1;
            let (shape, got) = read_tensor_f64(&merged.join("model.safetensors"), &name).unwrap();
            let (out_f, in_f) = (shape[0], shape[1]);
            let scale = base.iter().fold(0f64, |m, x| m.max(x.abs()));
            for o in 0..out_f {
                for i in 0..in_f {
                    let ba: f64 = (0..r).map(|k| b[o * r + k] * a[k * in_f + i]).sum();
                    let want = base[o * in_f + i] + s * ba;
                    let err = (got[o * in_f + i] - want).abs() / scale;
                    assert!(err < 1e-6, "{case} {name}[{o},{i}]: {} vs {want}", got[o * in_f + i]);
                }
            }
        }
        // A tensor no adapter touches is the base's own.
        let name = "model.layers.0.input_layernorm.weight";
        let want = read_tensor_f64(&dir(case).join("model/model.safetensors"), name).unwrap().1;
        assert_eq!(read_tensor_f64(&merged.join("model.safetensors"), name).unwrap().1, want);
    }
}

/// Expect `o` to fail with every one of `needles` in its message, and no panic.
fn expect_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure; stderr: {err}");
    assert!(!err.contains("panicked"), "panicked instead of an error: {err}");
    for n in needles {
        assert!(err.contains(n), "error should mention {n:?}: {err}");
    }
}

#[test]
fn bad_adapter_input_is_a_clear_error() {
    let case = "llama_lora";
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    // A target the model does not have.
    let cfg =
        config(t, case, Some("type: lora, r: 4, alpha: 8, targets: [q_proj, query_key_value]"), "");
    expect_error(&train(&cfg, &[]), &["query_key_value"]);
    // r: 0.
    let cfg = config(t, case, Some("type: lora, r: 0"), "");
    expect_error(&train(&cfg, &[]), &["adapter.r"]);
    // An init adapter of another rank.
    let init = dir(case).join("adapter_init");
    let cfg = config(
        t,
        case,
        Some(&format!("type: lora, r: 8, alpha: 8, init: '{}'", init.display())),
        "",
    );
    expect_error(&train(&cfg, &[]), &["adapter.r is 8", "r 4"]);
    // An init adapter with other targets.
    let cfg = config(
        t,
        case,
        Some(&format!(
            "type: lora, r: 4, alpha: 8, targets: [q_proj, v_proj], init: '{}'",
            init.display()
        )),
        "",
    );
    expect_error(&train(&cfg, &[]), &["target_modules"]);
    // --merge of something that is not an adapter.
    let model = dir(case).join("model");
    let out = t.join("merged");
    let o =
        horizon(&["export", model.to_str().unwrap(), "--merge", "--out", out.to_str().unwrap()]);
    expect_error(&o, &["not an adapter", "--merge"]);
}

/// A Llama-3-70B-shaped model (80 layers, hidden 8192, FFN 28672, 64 / 8 heads, vocabulary
/// 128256) with `adapter.type` `kind`.
fn llama_70b(tmp: &Path, kind: &str) -> PathBuf {
    let yaml = format!(
        "model: {{ init: random, arch: llama, hidden_size: 8192, intermediate_size: 28672, \
         num_hidden_layers: 80, num_attention_heads: 64, num_key_value_heads: 8, \
         vocab_size: 128256, max_position_embeddings: 8192, rope_theta: 500000.0, \
         tie_word_embeddings: false }}\n\
         data: {{ format: synthetic }}\ntrain: {{ steps: 2, batch_size: 1, max_seq_len: 512 }}\n\
         adapter: {{ type: {kind} }}\nengine: {{ checkpoint_every: 8 }}\n\
         output: {{ dir: '{}' }}\n",
        tmp.join("out").display()
    );
    let path = tmp.join(format!("70b-{kind}.yaml"));
    fs::write(&path, yaml).unwrap();
    path
}

#[test]
fn plan_fits_a_70b_llama_in_qlora_on_64_gib_and_in_lora_on_192_gib() {
    let tmp = tempfile::tempdir().unwrap();
    for (kind, host, other) in [("qlora", "64GiB", "lora"), ("lora", "192GiB", "none")] {
        let cfg = llama_70b(tmp.path(), kind);
        let o = horizon(&["plan", "--config", cfg.to_str().unwrap(), "--host-memory", host]);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "{kind} on {host}: {}{out}", stderr(&o));
        assert!(out.trim_end().ends_with("fits"), "{kind} on {host}: {out}");
        let line = |k: &str| {
            out.lines().find(|l| l.trim_start().starts_with(&format!("{k} "))).unwrap().to_string()
        };
        assert!(line(kind).contains("this model (80 layers) fits in"), "{}", line(kind));
        assert!(line(other).contains("does not fit"), "{}", line(other));
        assert!(line(kind).contains("the largest of this shape that fits"), "{}", line(kind));
    }
}

/// A copy of fixture `case`'s base with the byte tokenizer's HF files (the fixtures are
/// pretokenized: ids < 259 are byte-tokenizer ids).
fn base_with_tokenizer(tmp: &Path, case: &str) -> PathBuf {
    let base = tmp.join("base");
    fs::create_dir_all(&base).unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        fs::copy(dir(case).join("model").join(f), base.join(f)).unwrap();
    }
    let (tok, cfg) = horizon::tokenizer::ByteTokenizer::hf_files();
    fs::write(base.join("tokenizer.json"), tok.to_string()).unwrap();
    fs::write(base.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    base
}

/// `horizon generate --adapter` uses the adapter unmerged: its greedy tokens equal the merged
/// model's and, KV-cached, the full recompute's.
#[test]
fn generate_with_an_unmerged_adapter_matches_the_merged_model() {
    use horizon::run::decode::{Decode, Generator};
    for case in CASES {
        let tmp = tempfile::tempdir().unwrap();
        let o = train(&config(tmp.path(), case, None, ""), &[]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let base = base_with_tokenizer(tmp.path(), case);
        let (adapter, merged) = (tmp.path().join("out/final"), tmp.path().join("merged"));
        let o = horizon(&[
            "export",
            adapter.to_str().unwrap(),
            "--merge",
            "--base",
            base.to_str().unwrap(),
            "--out",
            merged.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let prompt: Vec<u32> = vec![22, 252, 108, 15, 30];
        let mut unmerged = Generator::load_with_adapter(&base, &adapter).unwrap();
        unmerged.set_stop_ids(vec![]);
        let kv = unmerged.greedy_ids(&prompt, 24).unwrap();
        unmerged.set_decode(Decode::FullRecompute);
        assert_eq!(unmerged.greedy_ids(&prompt, 24).unwrap(), kv, "{case}: KV cache vs full");
        let mut m = Generator::load(&merged).unwrap();
        m.set_stop_ids(vec![]);
        assert_eq!(m.greedy_ids(&prompt, 24).unwrap(), kv, "{case}: unmerged vs merged");
        let o = horizon(&[
            "generate",
            "--model",
            base.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--prompt",
            "12+34=",
            "--max-new-tokens",
            "8",
        ]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
    }
}

/// The sorted `target_modules` and `target_parameters` of the adapter directory `fin`.
fn written_targets(fin: &Path) -> (Vec<String>, Vec<String>) {
    let c: Value =
        serde_json::from_str(&fs::read_to_string(fin.join("adapter_config.json")).unwrap())
            .unwrap();
    let list = |key: &str| {
        let mut v: Vec<String> =
            c[key].as_array().into_iter().flatten().map(|t| t.as_str().unwrap().into()).collect();
        v.sort();
        v
    };
    (list("target_modules"), list("target_parameters"))
}

/// A mixture of experts through the binary: the adapter directory holds PEFT's expert tensors
/// and `target_parameters`, and `export --merge` adds each expert's `s B_e A_e` (B_e the
/// columns `j E + e` of PEFT's B) to its gate, up and down.
#[test]
fn moe_adapters_are_written_as_peft_and_merge_expert_by_expert() {
    let case = "qwen3_moe_lora";
    let tmp = tempfile::tempdir().unwrap();
    let o = train(&config(tmp.path(), case, None, ""), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let fin = tmp.path().join("out/final");
    let (_, params) = written_targets(&fin);
    assert_eq!(params, ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]);
    let mut names = list_tensors(&fin.join("adapter_model.safetensors")).unwrap();
    let e = expected(case);
    let mut want: Vec<String> =
        e["adapter_names"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().into()).collect();
    names.sort();
    want.sort();
    assert_eq!(names, want);
    let merged = tmp.path().join("merged");
    let out = tmp.path().join("out");
    let o =
        horizon(&["export", out.to_str().unwrap(), "--merge", "--out", merged.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (r, s, experts) = (4, 2.0, 8);
    let adapter = fin.join("adapter_model.safetensors");
    let pre = "base_model.model.model.layers.0.mlp.experts";
    let a = read_tensor_f64(&adapter, &format!("{pre}.base_layer.lora_A.weight")).unwrap().1;
    let b = read_tensor_f64(&adapter, &format!("{pre}.base_layer.lora_B.weight")).unwrap().1;
    let (c_in, i_f) = (32, 24);
    for (x, proj, row0) in [(3, "gate_proj", 0), (5, "up_proj", 24)] {
        let name = format!("model.layers.0.mlp.experts.{x}.{proj}.weight");
        let base = read_tensor_f64(&dir(case).join("model/model.safetensors"), &name).unwrap().1;
        let got = read_tensor_f64(&merged.join("model.safetensors"), &name).unwrap().1;
        let scale = base.iter().fold(0f64, |m, v| m.max(v.abs()));
        for o in 0..i_f {
            for i in 0..c_in {
                let ba: f64 = (0..r)
                    .map(|j| {
                        b[(row0 + o) * experts * r + j * experts + x] * a[(x * r + j) * c_in + i]
                    })
                    .sum();
                let want = base[o * c_in + i] + s * ba;
                let err = (got[o * c_in + i] - want).abs() / scale;
                assert!(err < 1e-6, "{name}[{o},{i}]: {} vs {want}", got[o * c_in + i]);
            }
        }
    }
}

/// A config in `tmp` for two steps of LoRA r 2 (alpha 4) on `targets` over the fixture `fx`'s
/// model and data, into `tmp/out`.
fn two_steps(tmp: &Path, fx: &Path, targets: &str) -> PathBuf {
    let yaml = format!(
        "model: {{ path: '{}' }}\ndata: {{ path: '{}', format: pretokenized }}\n\
         train: {{ steps: 2, batch_size: 2, max_seq_len: 64 }}\noptimizer: {{ lr: 0.01 }}\n\
         adapter: {{ type: lora, r: 2, alpha: 4, targets: [{targets}] }}\n\
         output: {{ dir: '{}' }}\n",
        fx.join("model").display(),
        fx.join("data.jsonl").display(),
        tmp.join("out").display()
    );
    let cfg = tmp.join("config.yaml");
    fs::write(&cfg, yaml).unwrap();
    cfg
}

/// Mixtral with adapters on attention, the router and the experts, from scratch through the
/// binary: PEFT's names (the router as `mlp.gate`, transformers 5's module path, although the
/// checkpoint says `block_sparse_moe.gate`), `target_parameters` naming both, and a merge that
/// adds `s B A` to the router and `s B_e A_e` to each expert's w1, w3 and w2.
#[test]
fn mixtral_router_and_expert_adapters_round_trip_and_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mixtral");
    let o = train(&two_steps(tmp.path(), &fx, "q_proj, router, experts"), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let fin = tmp.path().join("out/final");
    let (modules, params) = written_targets(&fin);
    assert_eq!(params, ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]);
    assert_eq!(modules, ["q_proj"]);
    let adapter = fin.join("adapter_model.safetensors");
    let pre = "base_model.model.model.layers.1.mlp";
    let (ra, a) = read_tensor_f64(&adapter, &format!("{pre}.gate.lora_A.weight")).unwrap();
    let (rb, b) = read_tensor_f64(&adapter, &format!("{pre}.gate.lora_B.weight")).unwrap();
    assert_eq!((ra, rb.clone()), (vec![2, 32], vec![8, 2]));
    assert!(b.iter().any(|&x| x != 0.0), "the router's B trained");
    let merged = tmp.path().join("merged");
    let out = tmp.path().join("out");
    let o =
        horizon(&["export", out.to_str().unwrap(), "--merge", "--out", merged.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let base_file = fx.join("model/model.safetensors");
    let merged_file = merged.join("model.safetensors");
    let check = |name: &str, ba: &dyn Fn(usize, usize) -> f64, (rows, cols): (usize, usize)| {
        let base = read_tensor_f64(&base_file, name).unwrap().1;
        let got = read_tensor_f64(&merged_file, name).unwrap().1;
        let scale = base.iter().fold(0f64, |m, v| m.max(v.abs()));
        for o in 0..rows {
            for i in 0..cols {
                let want = base[o * cols + i] + 2.0 * ba(o, i);
                let err = (got[o * cols + i] - want).abs() / scale;
                assert!(err < 1e-6, "{name}[{o},{i}]: {} vs {want}", got[o * cols + i]);
            }
        }
    };
    let router = |o: usize, i: usize| (0..2).map(|j| b[o * 2 + j] * a[j * 32 + i]).sum::<f64>();
    check("model.layers.1.block_sparse_moe.gate.weight", &router, (8, 32));
    let ea = read_tensor_f64(&adapter, &format!("{pre}.experts.lora_A.weight")).unwrap().1;
    let eb = read_tensor_f64(&adapter, &format!("{pre}.experts.lora_B.weight")).unwrap().1;
    let (x, e, r, i_f) = (6, 8, 2, 24);
    // The down projection (w2: out C = 32, in I = 24), expert 6.
    let down = |o: usize, i: usize| {
        (0..r).map(|j| eb[o * e * r + j * e + x] * ea[(x * r + j) * i_f + i]).sum::<f64>()
    };
    check(&format!("model.layers.1.block_sparse_moe.experts.{x}.w2.weight"), &down, (32, i_f));
}

/// gpt-oss from its MXFP4 checkpoint with adapters on attention and the router, through the
/// binary: PEFT's names (`mlp.router`, `target_parameters` `mlp.router.weight`), and a merge that
/// adds `s B A` to the router and writes the experts as transformers saves a dequantized load:
/// fused, in-to-out, bit for bit `dequantized.safetensors`, without `quantization_config`.
#[test]
fn gpt_oss_router_adapters_round_trip_and_merge_over_the_mxfp4_base() {
    let tmp = tempfile::tempdir().unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt_oss_mxfp4");
    let o = train(&two_steps(tmp.path(), &fx, "q_proj, router"), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let fin = tmp.path().join("out/final");
    assert_eq!(written_targets(&fin), (vec!["q_proj".into()], vec!["mlp.router.weight".into()]));
    let adapter = fin.join("adapter_model.safetensors");
    let pre = "base_model.model.model.layers.1.mlp.router";
    let (_, a) = read_tensor_f64(&adapter, &format!("{pre}.lora_A.weight")).unwrap();
    let (_, b) = read_tensor_f64(&adapter, &format!("{pre}.lora_B.weight")).unwrap();
    assert!(b.iter().any(|&x| x != 0.0), "the router's B trained");
    let (merged, out) = (tmp.path().join("merged"), tmp.path().join("out"));
    let o =
        horizon(&["export", out.to_str().unwrap(), "--merge", "--out", merged.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let merged_file = merged.join("model.safetensors");
    let name = "model.layers.1.mlp.router.weight";
    let base = read_tensor_f64(&fx.join("model/model.safetensors"), name).unwrap().1;
    let got = read_tensor_f64(&merged_file, name).unwrap().1;
    let (e, c, r) = (8, 32, 2);
    let scale = base.iter().fold(0f64, |m, v| m.max(v.abs()));
    for o in 0..e {
        for i in 0..c {
            let ba: f64 = (0..r).map(|k| b[o * r + k] * a[k * c + i]).sum();
            let err = (got[o * c + i] - base[o * c + i] - 2.0 * ba).abs() / scale;
            assert!(err < 1e-6, "{name}[{o},{i}]");
        }
    }
    for proj in ["gate_up_proj", "down_proj"] {
        let name = format!("model.layers.0.mlp.experts.{proj}");
        let want = read_tensor_f64(&fx.join("dequantized.safetensors"), &name).unwrap();
        assert_eq!(read_tensor_f64(&merged_file, &name).unwrap(), want, "{name}");
    }
    let cfg: Value =
        serde_json::from_str(&fs::read_to_string(merged.join("config.json")).unwrap()).unwrap();
    assert!(cfg.get("quantization_config").is_none(), "{cfg}");
}
