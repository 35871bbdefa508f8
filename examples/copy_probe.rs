//! What the CPU device's copy at link 0 costs, as `this-cpu` times it
//! (`cargo run --release --example copy_probe`): a 3.2 MB memcpy (a `bench/overlap.yaml`
//! layer) on a thread on CPU 0 (where a copy queue's thread runs beside a one-thread host pool
//! on 2 cores), each after a 1 ms sleep, from windows cycled over 128 MiB. Prints, each round,
//! the median and mean in µs of 21 copies:
//! - an upload alone, and beside products (a layer's up projection) on a 2-thread pool pinned
//!   to both CPUs, as the CPU device's kernels run;
//! - an upload whose destination was not read lately, or read just before by CPU 0, by CPU 1,
//!   or half by each (as a 2-thread kernel reads the weights of the slot the upload reuses);
//! - a download whose source was not written lately, or written just before by CPU 0, by
//!   CPU 1, or half by each (as a 2-thread kernel writes its output).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use horizon_backend::threads::{self, Placement};
use horizon_backend::{Backend, CpuBackend};

const N: usize = 800 * 1024;
const HOST: usize = 128 << 20;
const COPIES: usize = 21;
/// Which CPUs touch a copy's device side before it: none, CPU 0, CPU 1, both (a half each).
const CPUS: [&[usize]; 4] = [&[], &[0], &[1], &[0, 1]];

fn stats(mut x: Vec<f64>) -> String {
    x.sort_by(f64::total_cmp);
    format!("{:.0}/{:.0}", x[x.len() / 2], x.iter().sum::<f64>() / x.len() as f64)
}

/// `f` on a new thread pinned to `cpu`.
fn on_cpu<T: Send>(cpu: usize, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            threads::pin_current_thread(cpu);
            f()
        })
        .join()
        .expect("a probe thread panicked")
    })
}

/// The µs of a copy of `src` into `dst` on a thread on CPU 0 with the copy queues' short time
/// slice, after a 1 ms sleep.
fn copy(dst: &mut [f32], src: &[f32]) -> f64 {
    on_cpu(0, || {
        threads::short_slice_current_thread(100);
        std::thread::sleep(Duration::from_millis(1));
        let t0 = Instant::now();
        dst.copy_from_slice(src);
        t0.elapsed().as_secs_f64() * 1e6
    })
}

fn main() {
    let kernels = threads::pool("kernels", 2, Placement::first(true)).expect("kernel pool");
    let be = CpuBackend::new();
    let (m, k, n) = (256, 256, 704);
    let mut host: Vec<f32> = (0..HOST / 4).map(|i| (i % 1000) as f32).collect();
    let mut dev = vec![0.0f32; 5 * N];
    let windows = host.len() / N;
    let uploads = |dev: &mut [f32], host: &[f32], salt: usize| -> Vec<f64> {
        let h = |i: usize| (salt * 31 + i * 7) % windows * N;
        (0..COPIES).map(|i| copy(&mut dev[i % 5 * N..][..N], &host[h(i)..][..N])).collect()
    };
    for round in 0..4 {
        let alone = uploads(&mut dev, &host, 2 * round);
        let stop = AtomicBool::new(false);
        let beside = std::thread::scope(|s| {
            s.spawn(|| {
                threads::pin_current_thread(0);
                let (a, w, mut o) = (vec![0.5f32; m * k], vec![0.25f32; n * k], vec![0.0; m * n]);
                while !stop.load(Ordering::Relaxed) {
                    kernels.install(|| be.matmul_forward(&mut o, &a, &w, None, m, k, n));
                }
            });
            std::thread::sleep(Duration::from_millis(5));
            let t = uploads(&mut dev, &host, 2 * round + 1);
            stop.store(true, Ordering::Relaxed);
            t
        });
        print!("{round}: upload alone {}, beside products {}", stats(alone), stats(beside));
        print!("; upload, its destination read by");
        for readers in CPUS {
            let t = (0..COPIES).map(|i| {
                let part = N / readers.len().max(1);
                for (c, &cpu) in dev[i % 5 * N..][..N].chunks(part).zip(readers) {
                    on_cpu(cpu, || std::hint::black_box(c.iter().sum::<f32>()));
                }
                let h = (round * 13 + i * 7) % windows * N;
                copy(&mut dev[i % 5 * N..][..N], &host[h..][..N])
            });
            print!(" {:?} {}", readers, stats(t.collect()));
        }
        print!("; download, its source written by");
        for writers in CPUS {
            let t = (0..COPIES).map(|i| {
                let src = &mut dev[i % 5 * N..][..N];
                let part = N / writers.len().max(1);
                for (c, &cpu) in src.chunks_mut(part).zip(writers) {
                    on_cpu(cpu, || c.fill(i as f32));
                }
                let h = (round * 17 + i * 7) % windows * N;
                copy(&mut host[h..][..N], &dev[i % 5 * N..][..N])
            });
            print!(" {:?} {}", writers, stats(t.collect()));
        }
        println!(" (median/mean µs)");
    }
}
