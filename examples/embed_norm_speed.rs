//! The embedding gradient's squared norm, over the whole table (`sum_squares`) against the rows
//! a step's tokens name (`sum_squares_rows`, the same number bit for bit):
//! `cargo run --release --example embed_norm_speed [-- VOCAB HIDDEN TOKENS REPS]` (default
//! Qwen2.5-7B's table, 152064 x 3584 (2.2 GB), and 16384 tokens drawn uniformly; 9 reps). Both
//! run in turn in every repetition; prints their medians, the ratio, and the distinct rows.

use std::time::Instant;

use horizon::optim::adamw::{sum_squares, sum_squares_rows};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args().nth(i).map_or(default, |s| s.parse().expect("VOCAB HIDDEN TOKENS REPS"))
    };
    let (vocab, hidden, tokens, reps) = (arg(1, 152_064), arg(2, 3584), arg(3, 16_384), arg(4, 9));
    let mut rows = vec![false; vocab];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..tokens {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        rows[(x % vocab as u64) as usize] = true;
    }
    let mut g = vec![0.0f32; vocab * hidden];
    for (r, row) in g.chunks_mut(hidden).enumerate() {
        if rows[r] {
            row.iter_mut().enumerate().for_each(|(i, v)| *v = (i % 97) as f32 * 1e-3 - 0.05);
        }
    }
    let (mut whole, mut named) = (Vec::new(), Vec::new());
    for k in 0..=reps {
        let t = Instant::now();
        let a = sum_squares(&g);
        let dt = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let b = sum_squares_rows(&g, hidden, &rows);
        let dr = t.elapsed().as_secs_f64();
        assert_eq!(a.to_bits(), b.to_bits(), "the two sums differ");
        if k > 0 {
            whole.push(dt);
            named.push(dr);
        }
    }
    let (w, n) = (median(whole), median(named));
    let distinct = rows.iter().filter(|&&r| r).count();
    println!(
        "table {vocab} x {hidden} ({:.2} GB), {tokens} tokens, {distinct} distinct rows",
        (vocab * hidden * 4) as f64 / 1e9
    );
    println!("whole table: {:.2} ms; named rows: {:.3} ms; {:.1}x", w * 1e3, n * 1e3, w / n);
}
