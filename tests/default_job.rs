//! The built-in default job learns: a shortened run of it (the same model, data and schedule
//! shape, fewer steps) cuts the answer loss by more than half; its held-out loss is logged and
//! is the plot's eval series.

#[test]
fn the_default_job_learns() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    horizon::run::default_job::run_with(&out, 120, &[]).unwrap();
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
    // The 1000 held-out problems' loss, every EVAL_EVERY steps and after the last, in the
    // metrics and in what the plot draws.
    let every = horizon::run::default_job::EVAL_EVERY;
    let evals: Vec<(f64, f64)> = metrics
        .iter()
        .filter_map(|m| Some((m["step"].as_f64()?, m["eval_loss"].as_f64()?)))
        .collect();
    assert_eq!(evals.iter().map(|e| e.0 as usize).collect::<Vec<_>>(), [every, 120]);
    let points = horizon::run::plot::read_metrics(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(horizon::run::plot::eval_series(&points), evals);
    assert!(evals[1].1 < 0.6 * first, "the held-out loss did not fall: {evals:?}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["eval_rows"], 1000);
    // The CPU device pins nothing, as planned; its host work has a pool of its own.
    assert_eq!(summary["pinned_bytes"], 0);
    assert_eq!(summary["planned_pinned_bytes"], 0);
    assert!(summary["host_threads"].as_u64().unwrap() >= 1, "{summary}");
    assert_eq!(summary["weight_upload"], "masters");
    assert!(out.join("training.png").is_file());
}
