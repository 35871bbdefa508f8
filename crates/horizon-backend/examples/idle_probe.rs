//! Do kernels run slower after the thread has slept? `cargo run --release -p horizon-backend
//! --example idle_probe [-- REPS [LAYERS]]`. Times a burst of matrix products on
//! `bench/overlap.yaml`'s shapes (hidden 256, FFN 704, 2 x 128 tokens; LAYERS layers' forward
//! products, 3 by default) right after the previous burst, after sleeping 5 to 200 ms, and
//! after 100 ms of other work: on the calling thread only (a spin on the clock, a scalar
//! integer loop), the same products, and on every thread of the kernels' pool (a spin, or a
//! wake-up each millisecond), interleaved; prints each median and mean with its ratio to the
//! back-to-back one, and the longest burst.
//!
//! Why it exists: on a shared virtual machine the compute queue of a link-bound CPU-device run
//! (which sleeps while it waits for the simulated link) has been measured up to 1.6x slower
//! than the same kernels back to back. What the rows showed on the 2-vCPU VM this project is
//! built on: after 50 ms or more in which the pool's other thread had nothing to do (sleep, or
//! work on the calling thread alone), a burst runs at about one thread's speed
//! (`RAYON_NUM_THREADS=1` bursts take as long, and show no slowdown after idleness); after
//! the pool's threads spun, it runs at full speed; waking each millisecond does not help. So an
//! idle vCPU comes back slowly, for tens of milliseconds: the reason for `device.wait: spin`.
//! `bench/validate_projection.py` runs this probe beside its cases.
//!
//! With `PIN=1` the pool's threads are pinned, each to its own CPU, as the CPU device's
//! kernels' threads are by default (`engine.pin_threads`). On 2026-12-04 (two runs of 15,
//! interleaved with unpinned ones): unpinned, back to back 13.4-13.5 ms a burst, 1.20-1.22x
//! after 200 ms asleep, 0.63-0.64x after 100 ms of the products; pinned, back to back
//! 8.4 ms, and 0.96-1.24x in every other row (1.00-1.01x after the products). The slow
//! bursts were the pool's two threads on one CPU, which a wake-up causes and tens of
//! milliseconds of running undo.

use std::time::{Duration, Instant};

use horizon_backend::cpu::matmul_forward;
use horizon_backend::cpu::testing::Rng;

/// (N, IC, OC) of one layer's forward products: qkv, o, gate|up, down.
const SHAPES: [(usize, usize, usize); 4] =
    [(256, 256, 768), (256, 256, 256), (256, 256, 1408), (256, 704, 256)];
const PAUSES_MS: [u64; 6] = [0, 5, 25, 50, 100, 200];
/// What the thread does for [`BUSY`] before a burst, in the busy rows.
const BUSY_KINDS: [&str; 6] = [
    "spinning on the clock",
    "a scalar integer loop",
    "the products",
    "spinning on every pool thread",
    "every pool thread waking each ms",
    "spinning on as many threads outside the pool",
];
const BUSY: Duration = Duration::from_millis(100);

struct Operands {
    inp: Vec<f32>,
    w: Vec<f32>,
    out: Vec<f32>,
}

/// The seconds one burst takes.
fn burst(ops: &mut [Operands], layers: usize) -> f64 {
    let t = Instant::now();
    for _ in 0..layers {
        for (o, &(n, ic, oc)) in ops.iter_mut().zip(&SHAPES) {
            matmul_forward(&mut o.out, &o.inp, &o.w, None, n, ic, oc);
        }
    }
    t.elapsed().as_secs_f64()
}

/// [`BUSY`] of work of kind `kind` (an index of [`BUSY_KINDS`]).
fn busy_for(kind: usize, ops: &mut [Operands]) {
    let start = Instant::now();
    let mut x = 1u64;
    while start.elapsed() < BUSY {
        match kind {
            0 => std::hint::spin_loop(),
            1 => (0..1000).for_each(|_| x = x.wrapping_mul(0x5851_f42d_4c95_7f2d).wrapping_add(1)),
            2 => {
                burst(ops, 1);
            }
            3 => {
                rayon::broadcast(|_| {
                    while start.elapsed() < BUSY {
                        std::hint::spin_loop();
                    }
                });
            }
            4 => {
                rayon::broadcast(|_| {
                    while start.elapsed() < BUSY {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                });
            }
            _ => std::thread::scope(|s| {
                for _ in 0..rayon::current_num_threads() {
                    s.spawn(|| {
                        while start.elapsed() < BUSY {
                            std::hint::spin_loop();
                        }
                    });
                }
            }),
        }
    }
    std::hint::black_box(x);
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `t`'s median, mean and largest, in ms, and the median's and mean's ratios to `base`'s:
/// a queue's busy time is a sum, so its rare long bursts count as much as its typical ones.
fn summary(t: Vec<f64>, base: &[f64]) -> String {
    let mean = |t: &[f64]| t.iter().sum::<f64>() / t.len() as f64;
    let (med, avg, max) = (median(t.clone()), mean(&t), t.iter().copied().fold(0.0, f64::max));
    format!(
        "{:.2} ms a burst, {:.2}x back to back (mean {:.2} ms, {:.2}x; longest {:.1} ms)",
        med * 1e3,
        med / median(base.to_vec()),
        avg * 1e3,
        avg / mean(base),
        max * 1e3
    )
}

fn main() {
    // `PIN=1`: the global pool's threads pinned as the CPU device pins its kernels' threads.
    if std::env::var_os("PIN").is_some() {
        use horizon_backend::threads::{Placement, builder};
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        builder("idle-probe", threads, Placement::first(true))
            .build_global()
            .expect("the global pool, before any use");
    }
    let arg = |i: usize, default: usize| {
        std::env::args().nth(i).map_or(default, |s| s.parse().expect("REPS, LAYERS: numbers"))
    };
    // Layers per burst: by default a forward block's worth of products between two waits.
    let (reps, layers) = (arg(1, 30), arg(2, 3));
    let mut rng = Rng::new(1);
    let mut ops: Vec<Operands> = SHAPES
        .iter()
        .map(|&(n, ic, oc)| Operands {
            inp: rng.vec(n * ic, 1.0),
            w: rng.vec(oc * ic, 0.05),
            out: vec![0.0; n * oc],
        })
        .collect();
    burst(&mut ops, layers);
    let mut times = vec![Vec::with_capacity(reps); PAUSES_MS.len()];
    let mut busy = vec![Vec::with_capacity(reps); BUSY_KINDS.len()];
    for _ in 0..reps {
        for (t, &ms) in times.iter_mut().zip(&PAUSES_MS) {
            if ms == 0 {
                burst(&mut ops, layers);
            } else {
                std::thread::sleep(Duration::from_millis(ms));
            }
            t.push(burst(&mut ops, layers));
        }
        for (kind, t) in busy.iter_mut().enumerate() {
            busy_for(kind, &mut ops);
            t.push(burst(&mut ops, layers));
        }
    }
    let base = times[0].clone();
    for (t, ms) in times.into_iter().zip(PAUSES_MS) {
        println!("after {ms:>2} ms idle: {}", summary(t, &base));
    }
    for (t, kind) in busy.into_iter().zip(BUSY_KINDS) {
        println!("after {} ms of {kind}: {}", BUSY.as_millis(), summary(t, &base));
    }
}
