//! Matrix-product speed of the CPU backend on the shapes of the 58.5M Llama benchmark
//! (hidden 512, FFN 1408, vocab 32000, 4 x 256 tokens): `cargo run --release --example
//! matmul_speed [-- REPS]`. Prints the best GFLOP/s of forward, dinp and dweight per shape, and a 1024^3
//! product. Threads: the global rayon pool (`RAYON_NUM_THREADS`).

use std::time::Instant;

use horizon_backend::Dinp;
use horizon_backend::cpu::testing::Rng;
use horizon_backend::cpu::{matmul_backward, matmul_forward};

/// The shortest of `reps` timed runs of `f`, in seconds (the machine is shared: the minimum is
/// the least disturbed).
fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let reps: usize = std::env::args().nth(1).map_or(5, |s| s.parse().expect("REPS: a number"));
    let mut rng = Rng::new(1);
    // (name, N, IC, OC)
    let shapes = [
        ("1024^3", 1024, 1024, 1024),
        ("qkv", 1024, 512, 1536),
        ("o", 1024, 512, 512),
        ("gate_up", 1024, 512, 2816),
        ("down", 1024, 1408, 512),
        ("head chunk", 256, 512, 32000),
    ];
    println!("{:<12} {:>14} {:>10} {:>10}", "shape", "best fwd GF/s", "dinp+dw", "ms/fwd");
    for (name, n, ic, oc) in shapes {
        let inp = rng.vec(n * ic, 1.0);
        let w = rng.vec(oc * ic, 0.05);
        let mut out = vec![0.0; n * oc];
        let mut dinp = vec![0.0; n * ic];
        let mut dw = vec![0.0; oc * ic];
        let flops = 2.0 * (n * ic * oc) as f64;
        matmul_forward(&mut out, &inp, &w, None, n, ic, oc);
        let fwd = best_of(reps, || matmul_forward(&mut out, &inp, &w, None, n, ic, oc));
        matmul_backward(
            Some(Dinp::Write(&mut dinp)),
            Some(&mut dw),
            None,
            &out,
            &inp,
            &w,
            n,
            ic,
            oc,
        );
        let bwd = best_of(reps, || {
            matmul_backward(
                Some(Dinp::Write(&mut dinp)),
                Some(&mut dw),
                None,
                &out,
                &inp,
                &w,
                n,
                ic,
                oc,
            )
        });
        println!(
            "{name:<12} {:>14.1} {:>10.1} {:>10.2}",
            flops / fwd / 1e9,
            2.0 * flops / bwd / 1e9,
            fwd * 1e3
        );
    }
}
