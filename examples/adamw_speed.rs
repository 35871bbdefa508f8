//! Host rates of the optimizer pass and its neighbours: `cargo run --release --example
//! adamw_speed [-- MELEMS REPS] [--json]` runs each operation below on one flat buffer of MELEMS
//! million parameters (default 16: about 1.3 GB in all, under a minute on 2 cores), on ONE thread
//! (a 1-thread rayon pool: the per-core rate) and on all threads, interleaved in the same run (every
//! repetition runs every operation on both pools in turn), and prints the median of REPS (default
//! 9; one more run first warms up) as parameters/s and GB/s moved. `--json` prints one JSON object
//! instead: `{"adamw": {"per_core": p/s, "all": p/s, "bytes_per_param": b}, ...}`.
//!
//! Bytes moved per parameter (read + written):
//! - `adamw`: fp32 AdamW (`adamw_update`): param, grad, m, v read, param, m, v written: 28.
//! - `adamw_image`: the same writing the bf16 image (`adamw_update_image`): 28 + 2 = 30.
//! - `adamw8bit_scalar`, `adamw8bit_avx2`, `adamw8bit`: the 8-bit AdamW of `optimizer.memory:
//!   compact` (`adamw8bit_update_with`) on its scalar body, on its AVX2 body (printed only where
//!   the CPU has AVX2) and on the fastest this CPU has (`Kernel::detect`: AVX-512, else AVX2):
//!   param read and written (8), grad read (4), one byte of m and of sqrt(v) read and written
//!   (4): 16 (plus 16 bytes of block scales per 256 parameters, not counted).
//! - `adamw8bit_image`: the fastest 8-bit body writing the bf16 image: 18.
//! - `accumulate_f32`: `acc += x` on fp32 slabs (`cpu::add_inplace`): acc read and written, x
//!   read: 12.
//! - `accumulate_bf16`: `acc += f32(x)` of a bf16 slab into fp32 (`bf16::add_bf16`): 10.
//! - `round_bf16`: fp32 -> bf16 (`bf16::round_to_bf16`): 4 read, 2 written: 6.
//! - `memcpy`: one fp32 slab copied (per core: `HostRates::copy_gbps`; on all threads: about
//!   the memory bandwidth a profile's `host.mem_gbps` wants): 8.

use std::time::Instant;

use horizon::optim::adamw::{AdamWConfig, AdamWStep, adamw_update, adamw_update_image};
use horizon::optim::adamw8bit::{Kernel, Moments8, adamw8bit_update_with};
use horizon_backend::Bf16;
use horizon_backend::bf16::{add_bf16, round_to_bf16};
use horizon_backend::cpu::add_inplace;
use rayon::ThreadPool;
use rayon::prelude::*;

/// One measured operation: its JSON key, bytes moved per parameter, and a run (given the
/// 1-based step).
struct Op<'a> {
    key: &'static str,
    bytes: f64,
    json: bool,
    run: Box<dyn FnMut(u64) + Send + 'a>,
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

fn cfg() -> AdamWConfig {
    AdamWConfig { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
}

fn step(t: u64) -> AdamWStep {
    AdamWStep::new(&cfg(), t, cfg().lr)
}

/// The fp32 AdamW operations, on their own masters and moments.
fn fp32_ops<'a>(n: usize, p0: &[f32], g: &'a [f32]) -> Vec<Op<'a>> {
    let (mut p, mut m, mut v) = (p0.to_vec(), vec![0f32; n], vec![0f32; n]);
    let plain = move |t| {
        adamw_update(&mut p, g, &mut m, &mut v, &step(t), 0.5);
    };
    let (mut p, mut m, mut v) = (p0.to_vec(), vec![0f32; n], vec![0f32; n]);
    let mut img = vec![Bf16(0); n];
    let image = move |t| {
        adamw_update_image(&mut p, &mut img, g, &mut m, &mut v, &step(t), 0.5);
    };
    vec![
        Op { key: "adamw", bytes: 28.0, json: true, run: Box::new(plain) },
        Op { key: "adamw_image", bytes: 30.0, json: true, run: Box::new(image) },
    ]
}

/// The 8-bit AdamW on one body, with or without the image, on its own masters and moments.
fn q8_op<'a>(key: &'static str, kernel: Kernel, image: bool, p0: &[f32], g: &'a [f32]) -> Op<'a> {
    let n = p0.len();
    let (mut p, mut q) = (p0.to_vec(), Moments8::zeros(&[n]));
    let mut img = if image { vec![Bf16(0); n] } else { Vec::new() };
    let run = move |t| {
        let img = image.then_some(img.as_mut_slice());
        adamw8bit_update_with(kernel, &mut p, img, g, q.view_mut(), &step(t), 0.5, t);
    };
    Op { key, bytes: if image { 18.0 } else { 16.0 }, json: true, run: Box::new(run) }
}

/// Gradient accumulation, rounding, and the memcpy reference.
fn slab_ops<'a>(n: usize, g: &'a [f32]) -> Vec<Op<'a>> {
    let mut acc = vec![0f32; n];
    let f32_acc = move |_| add_inplace(&mut acc, g);
    let mut acc = vec![0f32; n];
    let mut x = vec![Bf16(0); n];
    round_to_bf16(&mut x, g);
    let bf16_acc = move |_| add_bf16(&mut acc, &x);
    let mut dst = vec![Bf16(0); n];
    let round = move |_| round_to_bf16(&mut dst, g);
    let mut copy = vec![0f32; n];
    let memcpy = move |_| {
        copy.par_chunks_mut(1 << 16)
            .zip(g.par_chunks(1 << 16))
            .for_each(|(d, s)| d.copy_from_slice(s))
    };
    vec![
        Op { key: "accumulate_f32", bytes: 12.0, json: true, run: Box::new(f32_acc) },
        Op { key: "accumulate_bf16", bytes: 10.0, json: true, run: Box::new(bf16_acc) },
        Op { key: "round_bf16", bytes: 6.0, json: true, run: Box::new(round) },
        Op { key: "memcpy", bytes: 8.0, json: true, run: Box::new(memcpy) },
    ]
}

/// Median seconds of each op on each pool, interleaved: (per op) [one thread, all threads].
fn measure(ops: &mut [Op<'_>], pools: &[ThreadPool; 2], reps: usize) -> Vec<[f64; 2]> {
    let mut times = vec![[Vec::new(), Vec::new()]; ops.len()];
    for k in 0..=reps {
        for (op, t) in ops.iter_mut().zip(&mut times) {
            for (j, (pool, t)) in pools.iter().zip(t.iter_mut()).enumerate() {
                // Each op's state moves on by one step per run.
                let step = (2 * k + j + 1) as u64;
                let start = Instant::now();
                pool.install(|| (op.run)(step));
                if k > 0 {
                    t.push(start.elapsed().as_secs_f64());
                }
            }
        }
    }
    times.into_iter().map(|[a, b]| [median(a), median(b)]).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let mut nums = args.iter().filter(|a| *a != "--json");
    let melems: f64 = nums.next().map_or(16.0, |s| s.parse().expect("MELEMS: a number"));
    let reps: usize = nums.next().map_or(9, |s| s.parse().expect("REPS: a number"));
    let n = (melems * 1e6) as usize;
    let p0: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3 - 0.5).collect();
    let g: Vec<f32> = (0..n).map(|i| (i % 777) as f32 * 1e-4 - 0.03).collect();
    let threads = rayon::current_num_threads();
    let pool = |t| rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("a rayon pool");
    let pools = [pool(1), pool(threads)];

    let mut ops = fp32_ops(n, &p0, &g);
    ops.push(q8_op("adamw8bit_scalar", Kernel::Scalar, false, &p0, &g));
    if Kernel::Avx2.available() {
        ops.push(q8_op("adamw8bit_avx2", Kernel::Avx2, false, &p0, &g));
    }
    ops.push(q8_op("adamw8bit", Kernel::detect(), false, &p0, &g));
    ops.push(q8_op("adamw8bit_image", Kernel::detect(), true, &p0, &g));
    ops.extend(slab_ops(n, &g));
    let secs = measure(&mut ops, &pools, reps);
    let rate = |s: f64| n as f64 / s;

    if json {
        let obj: serde_json::Map<String, serde_json::Value> = ops
            .iter()
            .zip(&secs)
            .filter(|(op, _)| op.json)
            .map(|(op, s)| {
                let v = serde_json::json!({
                    "per_core": rate(s[0]), "all": rate(s[1]), "bytes_per_param": op.bytes,
                });
                (op.key.to_string(), v)
            })
            .collect();
        println!("{}", serde_json::Value::Object(obj));
        return;
    }
    println!(
        "adamw_speed: {n} parameters, median of {reps}, 1 thread and {threads} threads interleaved; 8-bit body: {:?}",
        Kernel::detect()
    );
    println!(
        "{:<18} {:>7} | {:>12} {:>8} | {:>12} {:>8}",
        "op", "B/param", "1T Mparam/s", "1T GB/s", "all Mparam/s", "all GB/s"
    );
    for (op, s) in ops.iter().zip(&secs) {
        let (a, b) = (rate(s[0]), rate(s[1]));
        let gb = |r: f64| r * op.bytes * 1e-9;
        println!(
            "{:<18} {:>7} | {:>12.1} {:>8.2} | {:>12.1} {:>8.2}",
            op.key,
            op.bytes,
            a * 1e-6,
            gb(a),
            b * 1e-6,
            gb(b)
        );
    }
    let ratio = |key: &str, t: usize| {
        let i = ops.iter().position(|o| o.key == key).expect("an op");
        secs[0][t] / secs[i][t]
    };
    let keys =
        ["adamw8bit_scalar", "adamw8bit_avx2", "adamw8bit", "adamw8bit_image", "adamw_image"];
    for key in keys.into_iter().filter(|k| ops.iter().any(|o| o.key == *k)) {
        println!(
            "{key} / adamw (parameters/s): 1 thread {:.2}, {threads} threads {:.2}",
            ratio(key, 0),
            ratio(key, 1)
        );
    }
}
