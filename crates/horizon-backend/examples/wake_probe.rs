//! What handing work to a pinned pool thread costs, by where the handing thread runs: the
//! median extra time of `pool.install` over the work itself (0, 200 and 1000 us of spinning),
//! each after 2 ms asleep (the machine idle, as between a link-bound run's host ops), with the
//! caller unpinned, pinned to the pool thread's CPU, and pinned to another CPU.
//!
//!     cargo run --release -p horizon-backend --example wake_probe
//!
//! On this project's 2-vCPU virtual machine: 6 us on the same CPU, 80-90 us across CPUs (each
//! hand-off wakes an idle CPU, and so does the reply), 14-57 us unpinned. Why the engine runs
//! the host queue's thread beside its pool's first thread.

use std::time::{Duration, Instant};

use horizon_backend::threads::{self, Placement};

fn spin(us: u64) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_micros(us) {
        std::hint::spin_loop();
    }
}

const RUNS: usize = 41;
const WORK_US: [u64; 3] = [0, 200, 1000];

fn main() {
    let cpus = threads::allowed_cpus();
    let (Some(&first), Some(&last)) = (cpus.first(), cpus.last()) else {
        eprintln!("this system cannot pin threads");
        return;
    };
    let pool = threads::pool("probe", 1, Placement::last(1, true)).expect("a pool of one thread");
    for (caller, cpu) in [("unpinned", None), ("same CPU", Some(last)), ("other CPU", Some(first))]
    {
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let medians = std::thread::scope(|s| {
            let pool = &pool;
            let probe = s.spawn(move || {
                if let Some(cpu) = cpu {
                    threads::pin_current_thread(cpu);
                }
                WORK_US.map(|w| {
                    let mut t: Vec<f64> = (0..RUNS)
                        .map(|_| {
                            wait.recv().expect("the sleeper sends one go per run");
                            let t0 = Instant::now();
                            pool.install(|| spin(w));
                            t0.elapsed().as_secs_f64() * 1e6 - w as f64
                        })
                        .collect();
                    t.sort_by(f64::total_cmp);
                    t[RUNS / 2]
                })
            });
            for _ in 0..RUNS * WORK_US.len() {
                std::thread::sleep(Duration::from_millis(2));
                go.send(()).expect("the probe waits for every run");
            }
            probe.join().expect("the probe thread")
        });
        let cells: Vec<String> =
            WORK_US.iter().zip(medians).map(|(w, m)| format!("{w} us work: +{m:.0} us")).collect();
        println!("{caller:>9}: {}", cells.join(", "));
    }
}
