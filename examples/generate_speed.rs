//! KV cache against full recompute: `cargo run --release --example generate_speed [-- NEW REPS]`
//! generates NEW tokens (default 256) greedily from an 8-token prompt with the random
//! `llama-58m` (the shape of `bench/llama-58m.yaml`) on the CPU backend, REPS times (default 3)
//! each way, interleaved (full recompute, then KV cache, per repetition); prints the median
//! seconds and tokens/s of each, the ratio, and whether both gave the same tokens.

use std::time::Instant;

use horizon::engine::options::BackendKind;
use horizon::run::decode::{Decode, Generator};
use horizon::tokenizer::ByteTokenizer;

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let new: usize = args.next().map_or(256, |s| s.parse().expect("NEW: a number"));
    let reps: usize = args.next().map_or(3, |s| s.parse().expect("REPS: a number"));
    let cfg = horizon::run::bench::named_config("llama-58m")?;
    let (model_cfg, params) = horizon::run::load::load_model(&cfg.raw)?;
    let mut g = Generator::new(&model_cfg, params, Box::new(ByteTokenizer::new()));
    g.set_stop_ids(Vec::new());
    let prompt: Vec<u32> = (0..8).map(|i| 100 + 37 * i).collect();
    let (mut full_s, mut kv_s) = (Vec::new(), Vec::new());
    let mut same = true;
    for rep in 0..reps {
        let mut ids = Vec::new();
        for (mode, times) in
            [(Decode::FullRecompute, &mut full_s), (Decode::KvCache(BackendKind::Cpu), &mut kv_s)]
        {
            g.set_decode(mode);
            let t0 = Instant::now();
            ids.push(g.greedy_ids(&prompt, new)?);
            times.push(t0.elapsed().as_secs_f64());
            assert_eq!(ids.last().map(Vec::len), Some(new));
        }
        same &= ids[0] == ids[1];
        println!("rep {rep}: full recompute {:.2} s, KV cache {:.2} s", full_s[rep], kv_s[rep]);
    }
    let (f, k) = (median(full_s), median(kv_s));
    println!(
        "{new} new tokens, median of {reps}: full recompute {f:.2} s ({:.1} tok/s), KV cache \
         {k:.2} s ({:.1} tok/s): {:.1}x; same tokens: {same}",
        new as f64 / f,
        new as f64 / k,
        f / k
    );
    Ok(())
}
