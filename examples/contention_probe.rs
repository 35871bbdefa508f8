//! How host work and the CPU device's kernels slow each other down when they share the cores
//! (what `this-cpu`'s `host.contended` measures): `cargo run --release --example
//! contention_probe [-- M,K,N NAP_US]`. Each host job (an AdamW update of a `bench/overlap.yaml`
//! layer, an accumulation and a squared norm on a one-thread pool on the last CPU, as the engine
//! places its host threads on 2 cores; a memcpy on a thread on CPU 0, as a copy queue's) is
//! timed alone and beside products of M x K x N (default 256,256,704, that layer's up
//! projection) run back to back on a pool over every CPU from a thread on CPU 0 (as the
//! compute queue runs them); then the products are timed alone and beside the job run back to
//! back. NAP_US (default 0) is a sleep before each job, as host work arrives between waits.
//! Prints each side's rate beside the other (its time alone over its time beside).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use horizon::optim::adamw::{AdamWConfig, AdamWStep, BufferStep, sum_squares};
use horizon::optim::moments::{Moments, Moments32};
use horizon_backend::cpu::add_inplace;
use horizon_backend::threads::{self, Placement};
use horizon_backend::{Backend, CpuBackend};

/// Parameters of a `bench/overlap.yaml` layer, about.
const ELEMS: usize = 800 * 1024;
const SETS: usize = 8;
const JOBS: [&str; 4] = ["update", "accumulate", "sum of squares", "memcpy (CPU 0 thread)"];

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

fn args() -> ((usize, usize, usize), u64) {
    let shape = std::env::args().nth(1).map_or((256, 256, 704), |a| {
        let v: Vec<usize> = a.split(',').map(|x| x.parse().expect("M,K,N")).collect();
        (v[0], v[1], v[2])
    });
    let nap = std::env::args().nth(2).map_or(0, |a| a.parse().expect("NAP_US"));
    (shape, nap)
}

fn main() {
    let ((m, k, n), nap) = args();
    let kernels = threads::pool("kernels", 2, Placement::first(true)).expect("kernel pool");
    let host = threads::pool("host", 1, Placement::last(1, true)).expect("host pool");
    let be = CpuBackend::new();
    let cfg = AdamWConfig { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let st = AdamWStep::new(&cfg, 1, cfg.lr);
    let mut sets: Vec<_> = (0..SETS)
        .map(|_| {
            (vec![0.1f32; ELEMS], vec![0.01f32; ELEMS], vec![0.0f32; ELEMS], vec![0.0f32; ELEMS])
        })
        .collect();
    let mut dev = vec![0.0f32; ELEMS];
    // Job `kind` on set `i`: its time in microseconds.
    let mut job = |kind: usize, i: usize| {
        let (p, g, mm, v) = &mut sets[i % SETS];
        std::thread::sleep(Duration::from_micros(nap));
        let t = Instant::now();
        match kind {
            0 => host.install(|| {
                std::hint::black_box(Moments32 { m: mm, v }.update(
                    p,
                    g,
                    &BufferStep::uniform(st),
                    1.0,
                    7,
                    None,
                ));
            }),
            1 => host.install(|| add_inplace(p, g)),
            2 => host.install(|| {
                std::hint::black_box(sum_squares(g));
            }),
            _ => std::thread::scope(|s| {
                s.spawn(|| {
                    threads::restrict_current_thread(&[0]);
                    dev.copy_from_slice(p)
                });
            }),
        }
        t.elapsed().as_secs_f64() * 1e6
    };
    let (a, w) = (vec![0.5f32; m * k], vec![0.25f32; n * k]);
    let product = |o: &mut [f32]| kernels.install(|| be.matmul_forward(o, &a, &w, None, m, k, n));
    let (stop, count) = (AtomicBool::new(false), AtomicUsize::new(0));
    for round in 0..2 {
        for (kind, name) in JOBS.iter().enumerate() {
            let mut o = vec![0.0f32; m * n];
            let t = Instant::now();
            let mut reps = 0;
            while t.elapsed() < Duration::from_millis(300) {
                product(&mut o);
                reps += 1;
            }
            let k_alone = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
            let h_alone = median((0..21).map(|i| job(kind, i)).collect());
            stop.store(false, Ordering::SeqCst);
            count.store(0, Ordering::SeqCst);
            let (h_beside, k_beside) = std::thread::scope(|s| {
                let bg = s.spawn(|| {
                    threads::restrict_current_thread(&[0]);
                    let mut o = vec![0.0f32; m * n];
                    while !stop.load(Ordering::Relaxed) {
                        product(&mut o);
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                });
                std::thread::sleep(Duration::from_millis(20));
                let h = median((0..21).map(|i| job(kind, i)).collect());
                let (c0, t) = (count.load(Ordering::SeqCst), Instant::now());
                let mut i = 0;
                while t.elapsed() < Duration::from_millis(300) {
                    job(kind, i);
                    i += 1;
                }
                let done = count.load(Ordering::SeqCst) - c0;
                let per = t.elapsed().as_secs_f64() * 1e6 / done.max(1) as f64;
                stop.store(true, Ordering::SeqCst);
                bg.join().expect("the products' thread panicked");
                (h, per)
            });
            println!(
                "{round} {name:>22}: {h_alone:6.0} us alone, {h_beside:6.0} beside the products \
                 (rate {:.2}); product {k_alone:5.0} us alone, {k_beside:5.0} beside it (rate {:.2})",
                h_alone / h_beside,
                k_alone / k_beside
            );
        }
    }
}
