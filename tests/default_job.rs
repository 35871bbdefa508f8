//! The built-in default job learns: a shortened run of it (the same model, data and schedule
//! shape, fewer steps) cuts the answer loss by more than half.

#[test]
fn the_default_job_learns() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    horizon::default_job::run_with(&out, 120, &[]).unwrap();
    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(metrics.len(), 120);
    let loss = |i: usize| metrics[i]["loss"].as_f64().unwrap();
    let first = loss(0);
    let last = (110..120).map(loss).sum::<f64>() / 10.0;
    assert!(first > 4.0, "an untrained model is near ln(259) = 5.56: {first}");
    assert!(last < 0.5 * first, "the loss did not halve: {first} -> {last}");
    assert!(out.join("final/model.safetensors").is_file());
}
