//! LoRA adapters on disk and in the config: PEFT's directories read (the fixtures in
//! `tests/fixtures/lora/*/adapter_init`, written by PEFT 0.21) and written back bit-exact, every
//! refusal with its message, `adapter.init` checked against a run, PEFT's default init, and the
//! `adapter:` section of the YAML.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use horizon::adapter::peft::{self, PeftAdapter, module_path, tensor_name};
use horizon::adapter::{AdapterConfig, AdapterKind, BaseDtype, TARGETS};
use horizon::model::lora::init_a;
use horizon::run::config::RawConfig;
use serde_json::Value;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/lora")
        .join(case)
        .join("adapter_init")
}

/// (out, in) of each projection of the fixtures' models (their `model/config.json`).
fn llama_shapes(_layer: usize, target: &str) -> Option<(usize, usize)> {
    // hidden 64, 4 heads of 16, 2 kv heads, intermediate 176
    Some(match target {
        "q_proj" | "o_proj" => (64, 64),
        "k_proj" | "v_proj" => (32, 64),
        "gate_proj" | "up_proj" => (176, 64),
        "down_proj" => (64, 176),
        _ => return None,
    })
}

fn qwen2_shapes(_layer: usize, target: &str) -> Option<(usize, usize)> {
    // hidden 128, 4 heads of 32, 2 kv heads, intermediate 256
    Some(match target {
        "q_proj" | "o_proj" => (128, 128),
        "k_proj" | "v_proj" => (64, 128),
        "gate_proj" | "up_proj" => (256, 128),
        "down_proj" => (128, 256),
        _ => return None,
    })
}

fn lora(r: usize, alpha: f64, targets: &[&str], init: Option<&Path>) -> AdapterConfig {
    AdapterConfig {
        kind: AdapterKind::Lora,
        r,
        alpha,
        rslora: false,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        init: init.map(Path::to_path_buf),
        base_dtype: BaseDtype::Auto,
    }
}

fn set(v: &[String]) -> BTreeSet<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn names_follow_peft() {
    assert_eq!(module_path("q_proj"), Some("self_attn.q_proj"));
    assert_eq!(module_path("o_proj"), Some("self_attn.o_proj"));
    assert_eq!(module_path("gate_proj"), Some("mlp.gate_proj"));
    assert_eq!(module_path("down_proj"), Some("mlp.down_proj"));
    assert_eq!(module_path("fc1"), None);
    assert!(TARGETS.iter().all(|t| module_path(t).is_some()));
    assert_eq!(
        tensor_name(3, "v_proj", false),
        "base_model.model.model.layers.3.self_attn.v_proj.lora_A.weight"
    );
    assert_eq!(
        tensor_name(0, "up_proj", true),
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    );
}

#[test]
fn reads_the_llama_fixture() {
    let a = peft::read(&fixture("llama_lora")).unwrap();
    assert_eq!((a.r, a.alpha, a.rslora), (4, 8.0, false));
    assert_eq!(set(&a.targets), TARGETS.into_iter().collect());
    assert_eq!(a.base_model, None);
    assert_eq!(a.tensors.len(), 28);
    assert_eq!(a.layers(), 2);
    for (target, a_shape, b_shape) in [
        ("q_proj", [4, 64], [64, 4]),
        ("k_proj", [4, 64], [32, 4]),
        ("v_proj", [4, 64], [32, 4]),
        ("o_proj", [4, 64], [64, 4]),
        ("gate_proj", [4, 64], [176, 4]),
        ("up_proj", [4, 64], [176, 4]),
        ("down_proj", [4, 176], [64, 4]),
    ] {
        for layer in 0..2 {
            let (sa, va) = &a.tensors[&tensor_name(layer, target, false)];
            let (sb, vb) = &a.tensors[&tensor_name(layer, target, true)];
            assert_eq!((sa.as_slice(), sb.as_slice()), (&a_shape[..], &b_shape[..]), "{target}");
            assert_eq!(va.len(), a_shape.iter().product::<usize>());
            // The fixtures' B is random, not PEFT's zero init.
            assert!(va.iter().chain(vb).any(|&x| x != 0.0) && vb.iter().any(|&x| x != 0.0));
        }
    }
    let cfg = lora(4, 8.0, &TARGETS, Some(&fixture("llama_lora")));
    peft::check_against(&a, &cfg, &trained(&cfg), llama_shapes, &Default::default(), 2).unwrap();
}

#[test]
fn reads_the_qwen2_fixture() {
    let a = peft::read(&fixture("qwen2_qlora_nf4")).unwrap();
    assert_eq!((a.r, a.alpha, a.rslora), (8, 16.0, false));
    assert_eq!(a.targets, ["q_proj", "v_proj"]);
    assert_eq!(a.tensors.len(), 8);
    for layer in 0..2 {
        assert_eq!(a.tensors[&tensor_name(layer, "q_proj", false)].0, [8, 128]);
        assert_eq!(a.tensors[&tensor_name(layer, "q_proj", true)].0, [128, 8]);
        assert_eq!(a.tensors[&tensor_name(layer, "v_proj", false)].0, [8, 128]);
        assert_eq!(a.tensors[&tensor_name(layer, "v_proj", true)].0, [64, 8]);
    }
    let mut cfg = lora(8, 16.0, &["v_proj", "q_proj"], Some(&fixture("qwen2_qlora_nf4")));
    cfg.kind = AdapterKind::Qlora;
    peft::check_against(&a, &cfg, &trained(&cfg), qwen2_shapes, &Default::default(), 2).unwrap();
}

/// The tensors of `a` in the form `peft::write` takes.
fn tensors_of(a: &PeftAdapter) -> Vec<(String, Vec<usize>, &[f32])> {
    a.tensors.iter().map(|(n, (s, v))| (n.clone(), s.clone(), v.as_slice())).collect()
}

#[test]
fn write_then_read_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    // Values that stress a round trip: tiny, huge, negative zero, a subnormal.
    let targets = ["q_proj", "down_proj"];
    let (inp, out, r) = (6, 5, 3);
    let mut tensors = Vec::new();
    for layer in 0..2 {
        for (i, t) in targets.iter().enumerate() {
            let mut a = vec![0.0f32; r * inp];
            init_a(&mut a, inp, 7, (layer * 2 + i) as u64);
            let b: Vec<f32> = (0..out * r)
                .map(|k| [1e-30, -0.0, f32::MIN_POSITIVE / 8.0, 3.4e38][k % 4])
                .collect();
            tensors.push((tensor_name(layer, t, false), vec![r, inp], a));
            tensors.push((tensor_name(layer, t, true), vec![out, r], b));
        }
    }
    let refs: Vec<(String, Vec<usize>, &[f32])> =
        tensors.iter().map(|(n, s, v)| (n.clone(), s.clone(), v.as_slice())).collect();
    let mut cfg = lora(r, 12.5, &targets, None);
    cfg.rslora = true;
    let dir = tmp.path().join("final");
    peft::write(&dir, &cfg, &trained(&cfg), Some("my/base-model"), &refs).unwrap();
    let back = peft::read(&dir).unwrap();
    assert_eq!((back.r, back.alpha, back.rslora), (3, 12.5, true));
    assert_eq!(back.targets, targets);
    assert_eq!(back.base_model.as_deref(), Some("my/base-model"));
    assert_eq!(back.tensors.len(), tensors.len());
    for (name, shape, values) in &tensors {
        let (s, v) = &back.tensors[name];
        assert_eq!(s, shape, "{name}");
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(v), bits(values), "{name}");
    }
    // Only PEFT's own keys, with PEFT's values.
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(peft::CONFIG_FILE)).unwrap())
            .unwrap();
    for (key, want) in [
        ("peft_type", "\"LORA\""),
        ("task_type", "\"CAUSAL_LM\""),
        ("peft_version", "\"0.21.2\""),
        ("bias", "\"none\""),
        ("r", "3"),
        ("lora_alpha", "12.5"),
        ("use_rslora", "true"),
        ("use_dora", "false"),
        ("fan_in_fan_out", "false"),
        ("lora_dropout", "0.0"),
        ("modules_to_save", "null"),
        ("rank_pattern", "{}"),
    ] {
        assert_eq!(json[key].to_string(), want, "{key}");
    }
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn a_fixture_written_again_reads_back_equal() {
    let tmp = tempfile::tempdir().unwrap();
    let a = peft::read(&fixture("llama_lora")).unwrap();
    let cfg = lora(4, 8.0, &TARGETS, None);
    peft::write(tmp.path(), &cfg, &trained(&cfg), None, &tensors_of(&a)).unwrap();
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join(peft::CONFIG_FILE)).unwrap())
            .unwrap();
    assert_eq!(json["lora_alpha"].to_string(), "8", "an integral alpha is written as PEFT does");
    let mut back = peft::read(tmp.path()).unwrap();
    back.targets.sort();
    let mut want = a.clone();
    want.targets.sort();
    assert_eq!(back, want);
}

#[test]
fn write_refuses_tensors_that_are_not_the_adapters() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = lora(2, 4.0, &["q_proj"], None);
    let v = [0.0f32; 8];
    for (name, shape, want) in [
        ("lm_head.weight", vec![2, 4], "not a LoRA tensor"),
        (&*tensor_name(0, "v_proj", false), vec![2, 4], "not a LoRA tensor"),
        (&*tensor_name(0, "q_proj", false), vec![4, 2], "lora_A is (r, in)"),
    ] {
        let e =
            peft::write(tmp.path(), &cfg, &trained(&cfg), None, &[(name.to_string(), shape, &v)])
                .unwrap_err()
                .to_string();
        assert!(e.contains(name) && e.contains(want), "{e}");
    }
}

// --- refusals while reading ---------------------------------------------------------------

/// A copy of the llama fixture in a temporary directory, its `adapter_config.json` edited by
/// `edit`.
fn bad_dir(tmp: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> PathBuf {
    let src = fixture("llama_lora");
    let dir = tmp.join("bad");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join(peft::WEIGHTS_FILE), dir.join(peft::WEIGHTS_FILE)).unwrap();
    let text = std::fs::read_to_string(src.join(peft::CONFIG_FILE)).unwrap();
    let Value::Object(mut map) = serde_json::from_str(&text).unwrap() else { unreachable!() };
    edit(&mut map);
    std::fs::write(dir.join(peft::CONFIG_FILE), Value::Object(map).to_string()).unwrap();
    dir
}

fn read_err(dir: &Path) -> String {
    format!("{:#}", peft::read(dir).unwrap_err())
}

#[test]
fn unsupported_configs_are_refused_by_file_and_key() {
    use serde_json::json;
    for (key, value, want) in [
        ("peft_type", json!("IA3"), "only LORA"),
        ("use_dora", json!(true), "DoRA"),
        ("fan_in_fan_out", json!(true), "not supported"),
        ("lora_bias", json!(true), "not supported"),
        ("bias", json!("all"), "only \"none\""),
        ("rank_pattern", json!({"q_proj": 8}), "not supported"),
        ("alpha_pattern", json!({"q_proj": 16}), "not supported"),
        ("modules_to_save", json!(["lm_head"]), "not supported"),
        ("layers_to_transform", json!([0]), "not supported"),
        ("target_modules", json!("q_proj|v_proj"), "only a list of names"),
        ("target_modules", json!(["q_proj", "fc1"]), "fc1"),
        ("target_modules", json!([]), "is empty"),
        ("r", json!(0), "at least 1"),
        ("lora_alpha", json!("eight"), "not a number"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = bad_dir(tmp.path(), |m| {
            m.insert(key.into(), value.clone());
        });
        let e = read_err(&dir);
        let file = dir.join(peft::CONFIG_FILE).display().to_string();
        assert!(e.contains(&file) && e.contains(key) && e.contains(want), "{key}: {e}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = bad_dir(tmp.path(), |m| {
        m.remove("peft_type");
    });
    assert!(read_err(&dir).contains("peft_type is missing"), "{}", read_err(&dir));
}

#[test]
fn missing_files_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let e = read_err(tmp.path());
    assert!(e.contains(&tmp.path().join("adapter_config.json").display().to_string()), "{e}");
    let dir = bad_dir(tmp.path(), |_| {});
    std::fs::remove_file(dir.join(peft::WEIGHTS_FILE)).unwrap();
    let e = read_err(&dir);
    let weights = dir.join("adapter_model.safetensors").display().to_string();
    assert!(e.contains(&format!("{weights}: no such file")), "{e}");
}

/// Tensors added to a fixture's: (name, shape), zero-filled.
type Added<'a> = Vec<(&'a str, Vec<usize>)>;

/// The llama fixture's tensors, less `drop`, plus `add`, written over a copy's weights.
fn rewrite_weights(dir: &Path, drop: &str, add: &[(&str, Vec<usize>)]) {
    let a = peft::read(&fixture("llama_lora")).unwrap();
    let zeros = vec![0.0f32; 176 * 4];
    let mut t: Vec<(String, Vec<usize>, &[f32])> =
        tensors_of(&a).into_iter().filter(|(n, _, _)| n != drop).collect();
    for (name, shape) in add {
        t.push((name.to_string(), shape.clone(), &zeros[..shape.iter().product()]));
    }
    let path = dir.join(peft::WEIGHTS_FILE);
    horizon::hf::checkpoint::write_safetensors(&path, &t, horizon::hf::checkpoint::SaveDtype::F32)
        .unwrap();
}

#[test]
fn bad_tensors_are_refused_by_name() {
    let q_b1 = tensor_name(1, "q_proj", true);
    let q_a0 = tensor_name(0, "q_proj", false);
    // (tensor dropped, tensors added, what the message names, what it says)
    let cases: [(&str, Added, &str, &str); 4] = [
        ("", vec![("lm_head.weight", vec![4, 4])], "lm_head.weight", "not the lora_A or lora_B"),
        (
            "",
            vec![("base_model.model.model.layers.0.mlp.fc1.lora_A.weight", vec![4, 4])],
            "fc1",
            "not the lora_A",
        ),
        (&q_b1, vec![], &q_b1, "layer 1's q_proj has no lora_B"),
        (&q_a0, vec![(&q_a0, vec![8, 64])], &q_a0, "has r 4"),
    ];
    for (drop, add, name, want) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let dir = bad_dir(tmp.path(), |_| {});
        rewrite_weights(&dir, drop, &add);
        let e = read_err(&dir);
        let file = dir.join(peft::WEIGHTS_FILE).display().to_string();
        assert!(e.contains(&file) && e.contains(name) && e.contains(want), "{e}");
    }
    // A module the config does not target.
    let tmp = tempfile::tempdir().unwrap();
    let dir = bad_dir(tmp.path(), |m| {
        m.insert("target_modules".into(), serde_json::json!(["q_proj", "k_proj", "v_proj"]));
    });
    let e = read_err(&dir);
    assert!(e.contains("mlp.") && e.contains("(q_proj, k_proj, v_proj in"), "{e}");
}

/// A safetensors file of raw tensors (name, dtype, shape, little-endian bytes).
fn write_raw(path: &Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, dtype, shape, bytes) in tensors {
        let end = offset + bytes.len();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut h = Value::Object(header).to_string().into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(h);
    tensors.iter().for_each(|t| file.extend(&t.3));
    std::fs::write(path, file).unwrap();
}

#[test]
fn bf16_f16_and_f64_tensors_are_read_as_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = bad_dir(tmp.path(), |m| {
        m.insert("r".into(), 1.into());
        m.insert("target_modules".into(), serde_json::json!(["q_proj"]));
    });
    let vals = [0.5f64, -1.25, 3.0, 0.0];
    let enc = |dtype: &str| -> Vec<u8> {
        match dtype {
            "F64" => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
            "BF16" => vals.iter().flat_map(|&x| half::bf16::from_f64(x).to_le_bytes()).collect(),
            _ => vals.iter().flat_map(|&x| half::f16::from_f64(x).to_le_bytes()).collect(),
        }
    };
    write_raw(
        &dir.join(peft::WEIGHTS_FILE),
        &[
            (tensor_name(0, "q_proj", false), "F64", vec![1, 4], enc("F64")),
            (tensor_name(0, "q_proj", true), "BF16", vec![4, 1], enc("BF16")),
            (tensor_name(1, "q_proj", false), "F16", vec![1, 4], enc("F16")),
            (tensor_name(1, "q_proj", true), "F16", vec![4, 1], enc("F16")),
        ],
    );
    let a = peft::read(&dir).unwrap();
    for (_, v) in a.tensors.values() {
        assert_eq!(v, &[0.5, -1.25, 3.0, 0.0]);
    }
}

// --- adapter.init against the run -----------------------------------------------------------

#[test]
fn an_init_adapter_that_does_not_fit_the_run_is_refused() {
    let dir = fixture("llama_lora");
    let a = peft::read(&dir).unwrap();
    let config = dir.join("adapter_config.json").display().to_string();
    let weights = dir.join("adapter_model.safetensors").display().to_string();
    let check = |cfg: AdapterConfig, shapes: fn(usize, &str) -> Option<(usize, usize)>, layers| {
        format!(
            "{:#}",
            peft::check_against(&a, &cfg, &trained(&cfg), shapes, &Default::default(), layers)
                .unwrap_err()
        )
    };
    let e = check(lora(16, 8.0, &TARGETS, Some(&dir)), llama_shapes, 2);
    assert!(
        e.contains(&format!("adapter.r is 16 but {config} has r 4"))
            && e.contains("set adapter.r: 4 or start without adapter.init"),
        "{e}"
    );
    let e = check(lora(4, 32.0, &TARGETS, Some(&dir)), llama_shapes, 2);
    assert!(e.contains("lora_alpha 8") && e.contains("set adapter.alpha: 8"), "{e}");
    let mut rs = lora(4, 8.0, &TARGETS, Some(&dir));
    rs.rslora = true;
    assert!(check(rs, llama_shapes, 2).contains("use_rslora false"));
    let e = check(lora(4, 8.0, &["q_proj", "v_proj"], Some(&dir)), llama_shapes, 2);
    assert!(
        e.contains("adapter.targets is [q_proj, v_proj]") && e.contains("target_modules ["),
        "{e}"
    );
    let e = check(lora(4, 8.0, &TARGETS, Some(&dir)), llama_shapes, 3);
    assert!(e.contains(&weights) && e.contains("2 layers but the model has 3"), "{e}");
    // A wider model: the tensor and both shapes are named.
    let e = check(lora(4, 8.0, &TARGETS, Some(&dir)), qwen2_shapes, 2);
    let q_a0 = tensor_name(0, "q_proj", false);
    assert!(
        e.contains(&weights)
            && e.contains(&q_a0)
            && e.contains("shape [4, 64]")
            && e.contains("needs [4, 128]"),
        "{e}"
    );
    // A model without one of the targets.
    let no_gate = |l: usize, t: &str| if t == "gate_proj" { None } else { llama_shapes(l, t) };
    let cfg = lora(4, 8.0, &TARGETS, Some(&dir));
    let e = format!(
        "{:#}",
        peft::check_against(&a, &cfg, &trained(&cfg), no_gate, &Default::default(), 2).unwrap_err()
    );
    assert!(e.contains("no gate_proj in layer 0"), "{e}");
}

// --- PEFT's default init ---------------------------------------------------------------------

#[test]
fn init_a_is_kaiming_uniform_and_deterministic() {
    let (r, fan_in) = (16, 1024);
    let mut a = vec![0.0f32; r * fan_in];
    init_a(&mut a, fan_in, 42, 3);
    let bound = 1.0 / (fan_in as f64).sqrt();
    assert!(a.iter().all(|&x| (x as f64).abs() <= bound), "within ±1/sqrt(in)");
    let n = a.len() as f64;
    let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    // uniform(-b, b): mean 0, variance b²/3; 16384 draws put both within a few percent.
    assert!(mean.abs() < 0.02 * bound, "mean {mean}");
    assert!((var / (bound * bound / 3.0) - 1.0).abs() < 0.03, "variance {var}");
    let mut again = vec![0.0f32; r * fan_in];
    init_a(&mut again, fan_in, 42, 3);
    assert_eq!(a, again, "same seed and tensor: same values");
    init_a(&mut again, fan_in, 42, 4);
    assert_ne!(a, again, "another tensor: another stream");
    init_a(&mut again, fan_in, 43, 3);
    assert_ne!(a, again, "another seed: another stream");
}

// --- the adapter: section of the config ------------------------------------------------------

const BASE: &str = "model: {path: m}\ndata: {path: d.jsonl}\n";

fn resolve(adapter: &str) -> anyhow::Result<horizon::run::config::RunConfig> {
    RawConfig::from_yaml(&format!("{BASE}adapter: {adapter}\n"), "t.yaml")?.resolve("t.yaml")
}

#[test]
fn config_defaults() {
    let c = RawConfig::from_yaml(BASE, "t.yaml").unwrap();
    assert!(!c.to_yaml().contains("adapter"), "full fine-tuning prints no adapter section");
    assert_eq!(c.resolve("t.yaml").unwrap().adapter, None);
    let a = resolve("{type: lora}").unwrap().adapter.unwrap();
    assert_eq!(
        a,
        AdapterConfig {
            kind: AdapterKind::Lora,
            r: 16,
            alpha: 32.0,
            rslora: false,
            targets: TARGETS.iter().map(|t| t.to_string()).collect(),
            init: None,
            base_dtype: BaseDtype::Auto,
        }
    );
    assert_eq!(a.scale(), 2.0);
    assert_eq!(resolve("{type: none, r: 8}").unwrap().adapter, None);
}

#[test]
fn config_keys_parse() {
    let tmp = tempfile::tempdir().unwrap();
    let init = tmp.path().display();
    let yaml = format!(
        "{{type: qlora, r: 8, alpha: 16, rslora: true, targets: [q_proj, v_proj, my_proj], init: '{init}', base_dtype: bf16}}"
    );
    let run = resolve(&yaml).unwrap();
    let a = run.adapter.clone().unwrap();
    assert_eq!((a.kind, a.r, a.alpha, a.rslora), (AdapterKind::Qlora, 8, 16.0, true));
    assert_eq!(a.targets, ["q_proj", "v_proj", "my_proj"], "the model judges target names");
    assert_eq!(a.init.as_deref(), Some(tmp.path()));
    assert_eq!(a.base_dtype, BaseDtype::Bf16);
    let again =
        RawConfig::from_yaml(&run.raw.to_yaml(), "again").unwrap().resolve("again").unwrap();
    assert_eq!(again.adapter, run.adapter, "the printed config reads back the same");
    let fp32 = resolve("{type: lora, base_dtype: fp32}").unwrap().adapter.unwrap();
    assert_eq!(fp32.base_dtype, BaseDtype::Fp32);
}

#[test]
fn config_errors_name_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("f");
    std::fs::write(&file, "").unwrap();
    let missing = tmp.path().join("nowhere");
    for (adapter, want) in [
        ("{type: lora, r: 0}".to_string(), "adapter.r must be at least 1".to_string()),
        ("{type: lora, targets: []}".into(), "adapter.targets is empty".into()),
        ("{type: lora, targets: [q_proj, v_proj, q_proj]}".into(), "'q_proj' twice".into()),
        ("{type: lora, alpha: 0}".into(), "adapter.alpha must be a positive number".into()),
        (
            format!("{{type: lora, init: '{}'}}", missing.display()),
            format!("{} does not exist", missing.display()),
        ),
        (
            format!("{{type: lora, init: '{}'}}", file.display()),
            format!("{} is not a directory", file.display()),
        ),
        ("{type: lora, rank: 8}".into(), "rank".into()),
        ("{type: ia3}".into(), "ia3".into()),
        ("{type: lora, base_dtype: fp8}".into(), "fp8".into()),
    ] {
        let e = format!("{:#}", resolve(&adapter).unwrap_err());
        assert!(e.contains("t.yaml") && e.contains(&want), "{adapter}: {e}");
    }
}

#[test]
fn scale_with_and_without_rslora() {
    let mut a = lora(8, 16.0, &["q_proj"], None);
    assert_eq!(a.scale(), 2.0);
    a.rslora = true;
    assert_eq!(a.scale(), (16.0f64 / 8.0f64.sqrt()) as f32);
    let mut b = lora(16, 32.0, &["q_proj"], None);
    b.rslora = true;
    assert_eq!(b.scale(), 8.0);
}

/// The run's adapters as PEFT names them: `cfg`'s target modules, no expert parameters.
fn trained(cfg: &horizon::adapter::config::AdapterConfig) -> peft::Trained {
    peft::Trained { modules: cfg.targets.clone(), ..Default::default() }
}
