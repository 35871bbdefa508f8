//! CPU AdamW at memory speed? `cargo run --release --example adamw_speed [-- MELEMS REPS]`
//! updates one flat buffer of MELEMS million parameters (default 58.5, the benchmark Llama) with
//! `adamw_update`, and copies the same number of bytes with a parallel memcpy, interleaved in the
//! same run; prints GB/s moved by each (median of REPS) and the ratio.
//!
//! Bytes moved per parameter: AdamW reads param, grad, m, v and writes param, m, v: 28 bytes.
//! The memcpy copies 14 bytes per parameter (14 read + 14 written = 28 moved), over the same
//! rayon pool in chunks of the same size.
//!
//! Then the 8-bit AdamW of `optimizer.memory: compact` (`adamw8bit_update`) on the same buffer:
//! parameters per second, against the fp32 update's (16 bytes moved per parameter: param read
//! and written, grad read, one byte of m and of sqrt(v) read and written).

use std::time::Instant;

use horizon::optim::adamw::{ADAMW_CHUNK, AdamWConfig, AdamWStep, adamw_update};
use horizon::optim::adamw8bit::{Moments8, adamw8bit_update};
use rayon::prelude::*;

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let melems: f64 = args.next().map_or(58.5, |s| s.parse().expect("MELEMS: a number"));
    let reps: usize = args.next().map_or(9, |s| s.parse().expect("REPS: a number"));
    let n = (melems * 1e6) as usize;
    let mut p: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3 - 0.5).collect();
    let g: Vec<f32> = (0..n).map(|i| (i % 777) as f32 * 1e-4 - 0.03).collect();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    // The memcpy: 14 bytes per parameter = 3.5 f32.
    let words = n * 7 / 2;
    let src: Vec<f32> = (0..words).map(|i| i as f32).collect();
    let mut dst = vec![0.0f32; words];
    let cfg = AdamWConfig { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let moved = 28.0 * n as f64;
    let (mut t_adam, mut t_copy) = (Vec::new(), Vec::new());
    for k in 0..reps + 1 {
        let step = AdamWStep::new(&cfg, k as u64 + 1, cfg.lr);
        let t = Instant::now();
        adamw_update(&mut p, &g, &mut m, &mut v, &step, 0.5);
        let a = t.elapsed().as_secs_f64();
        let t = Instant::now();
        dst.par_chunks_mut(ADAMW_CHUNK)
            .zip(src.par_chunks(ADAMW_CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
        let c = t.elapsed().as_secs_f64();
        if k > 0 {
            t_adam.push(a);
            t_copy.push(c);
        }
    }
    let (a, c) = (median(t_adam), median(t_copy));
    println!(
        "adamw: {n} parameters, {} threads: AdamW {:.2} GB/s, memcpy {:.2} GB/s (28 bytes moved per parameter each), AdamW/memcpy = {:.2} (median of {reps}; checksum {:.3})",
        rayon::current_num_threads(),
        moved / a * 1e-9,
        moved / c * 1e-9,
        c / a,
        p.iter().take(1000).sum::<f32>() + dst[words - 1]
    );

    let mut q = Moments8::zeros(&[n]);
    let mut t_q8 = Vec::new();
    for k in 0..reps + 1 {
        let step = AdamWStep::new(&cfg, k as u64 + 1, cfg.lr);
        let t = Instant::now();
        adamw8bit_update(&mut p, &g, q.view_mut(), &step, 0.5, k as u64);
        if k > 0 {
            t_q8.push(t.elapsed().as_secs_f64());
        }
    }
    let q8 = median(t_q8);
    println!(
        "adamw8bit: {:.1} M parameters/s ({:.2} GB/s at 16 bytes), fp32 AdamW {:.1} M parameters/s: 8-bit/fp32 = {:.2} (median of {reps}; checksum {:.3})",
        n as f64 / q8 * 1e-6,
        16.0 * n as f64 / q8 * 1e-9,
        n as f64 / a * 1e-6,
        a / q8,
        p.iter().take(1000).sum::<f32>()
    );
}
