//! `this-cpu`: the CPU device on this machine. Its kernels run on the host's cores, so its
//! "device" costs are the CPU backend's own kernel times, measured here at the shapes the plan
//! uses (each product and attention shape once, the median of a few runs, memoised), and its
//! host work is timed here too ([`HostMeasured`]: each pass the host queue runs, at the plan's
//! sizes, on a pool of the engine's host threads). The link is the CPU device's simulated one
//! (`device.link_gbps`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use horizon_backend::bf16::{Bf16, add_bf16, expand_bf16, round_to_bf16};
use horizon_backend::cpu::add_inplace;
use horizon_backend::threads::{self, Placement, QueueCpus};
use horizon_backend::{Backend, CpuBackend, Dinp, Queue};

use crate::model::layout::ModelLayout;
use crate::model::spec::AttnSpec;
use crate::model::transformer::{embed_rows, embed_rows_backward};
use crate::optim::adamw::{
    AdamWConfig, AdamWStep, BufferStep, ROW_TASK, adamw_update_local, row_runs, sum_squares,
    sum_squares_rows,
};
use crate::optim::adamw8bit::Moments8;
use crate::optim::moments::{Moments, Moments32};
use crate::sim::cost::{DeviceModel, HostModel, HostPass};
use crate::sim::hardware::{Gpu, Hardware, Host, HostRates, Link};

/// An attention shape: heads, kv heads, head dim, window, sequences, positions, backward.
type AttnKey = (usize, usize, usize, usize, usize, usize, bool);

/// One set of a product's operands: its input, weight and output (the output gradient in a
/// backward), and the backward's two gradients; every element written, so every page is mapped
/// before the timing.
struct Operands {
    inp: Vec<f32>,
    w: Vec<f32>,
    out: Vec<f32>,
    dinp: Vec<f32>,
    dw: Vec<f32>,
}

impl Operands {
    fn new(m: usize, k: usize, n: usize) -> Self {
        Operands {
            inp: vec![0.5; m * k],
            w: vec![0.25; n * k],
            out: vec![0.1; m * n],
            dinp: vec![0.01; m * k],
            dw: vec![0.01; n * k],
        }
    }
}

/// The CPU backend's kernels, timed on first use, on a pool placed as the CPU device's
/// kernels' pool is (`engine.pin_threads`).
pub struct CpuMeasured {
    be: CpuBackend,
    kernels: rayon::ThreadPool,
    gemm: RefCell<HashMap<(usize, usize, usize, u8), f64>>,
    attn: RefCell<HashMap<AttnKey, f64>>,
    /// Bytes per second of a parallel elementwise pass.
    stream_bps: f64,
}

/// The median of `t` (its upper median when its length is even).
fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn median_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t0 = Instant::now();
                f();
                t0.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Repetitions of a measurement (after one warm-up run), of which the median counts: this
/// machine's other tenants move single runs by 10-20%.
const REPS: usize = 7;

impl CpuMeasured {
    /// Kernels timed on as many threads as the CPU device's pool, pinned as it pins them when
    /// `pin` (`engine.pin_threads`).
    pub fn new(pin: bool) -> Self {
        let n = 4 << 20;
        let (src, mut dst) = (vec![1.0f32; n], vec![0.0f32; n]);
        let be = CpuBackend::new();
        let threads = rayon::current_num_threads();
        let kernels = threads::pool("horizon-calibrate-kernels", threads, Placement::first(pin))
            .expect("cannot start the calibration's kernel threads");
        let s = kernels.install(|| median_of(REPS, || be.add_inplace(&mut dst, &src)));
        CpuMeasured {
            be,
            kernels,
            gemm: RefCell::default(),
            attn: RefCell::default(),
            stream_bps: 12.0 * n as f64 / s,
        }
    }

    /// [`median_of`] `f` inside the kernels' pool, as the device runs kernels.
    fn timed(&self, f: impl FnMut() + Send) -> f64 {
        self.kernels.install(|| median_of(REPS, f))
    }

    /// `measure()`, memoised under `key`.
    fn memo(&self, key: (usize, usize, usize, u8), measure: impl FnOnce() -> f64) -> f64 {
        if let Some(&s) = self.gemm.borrow().get(&key) {
            return s;
        }
        let s = measure();
        self.gemm.borrow_mut().insert(key, s);
        s
    }

    /// The time of `out (m, n) = inp (m, k) w (n, k)ᵀ` (`pass` 0), or of its backward with
    /// (1) or without (2) the weight's gradient, memoised. Each timed run takes the next of
    /// as many operand sets as fill [`COLD_BYTES`], so its operands start out of the cores'
    /// caches, as a step's do (each layer's weights arrive by a copy, from a host store far
    /// larger than the caches). Timed on one set, hot, the compute queue of
    /// `bench/overlap.yaml` read 0.82-0.94 projected/measured (validation of 2026-12-04,
    /// 01:53 UTC, threads pinned); cycled, 0.91-1.02 and 0.93-1.01 in two validations, every
    /// step within 3% (bench/validation/LOG.md, 2026-12-04 01:53).
    fn product(&self, m: usize, k: usize, n: usize, pass: u8) -> f64 {
        if m == 0 || k == 0 || n == 0 {
            return 0.0;
        }
        let key = (m, k, n, pass);
        if let Some(&s) = self.gemm.borrow().get(&key) {
            return s;
        }
        let sets = cold_sets(4 * (2 * m * k + 2 * n * k + m * n));
        let mut b: Vec<Operands> = (0..sets).map(|_| Operands::new(m, k, n)).collect();
        let be = &self.be;
        let mut next = 0;
        let s = self.timed(|| {
            let o = &mut b[next % sets];
            next += 1;
            match pass {
                0 => be.matmul_forward(&mut o.out, &o.inp, &o.w, None, m, k, n),
                _ => {
                    let dw = if pass == 1 { Some(&mut o.dw[..]) } else { None };
                    let dinp = Some(Dinp::Write(&mut o.dinp[..]));
                    be.matmul_backward(dinp, dw, None, &o.out, &o.inp, &o.w, m, k, n)
                }
            }
        });
        self.gemm.borrow_mut().insert(key, s);
        s
    }
}

impl DeviceModel for CpuMeasured {
    fn gemm(&self, m: usize, k: usize, n: usize) -> f64 {
        self.product(m, k, n, 0)
    }

    fn gemm_backward(&self, m: usize, k: usize, n: usize, dweight: bool) -> f64 {
        self.product(m, k, n, if dweight { 1 } else { 2 })
    }

    fn attention(&self, a: &AttnSpec, b: usize, t: usize, bwd: bool) -> f64 {
        let key = (a.h, a.kvh, a.d, a.window, b, t, bwd);
        if let Some(&s) = self.attn.borrow().get(&key) {
            return s;
        }
        let dims = a.dims(b, t);
        let (rows, qkv_w, out_w) = (b * t, (a.h + 2 * a.kvh) * a.d, a.h * a.d);
        let qkv: Vec<f32> = (0..rows * qkv_w).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect();
        let mut out = vec![0.0f32; rows * out_w];
        let mut lse = vec![0.0f32; b * a.h * t];
        let be = &self.be;
        self.kernels.install(|| be.attention_forward(&mut out, &mut lse, &qkv, dims));
        let s = if bwd {
            let dout = vec![0.01f32; rows * out_w];
            let mut dqkv = vec![0.0f32; rows * qkv_w];
            self.timed(|| be.attention_backward(&mut dqkv, &dout, &qkv, &out, &lse, dims))
        } else {
            self.timed(|| be.attention_forward(&mut out, &mut lse, &qkv, dims))
        };
        self.attn.borrow_mut().insert(key, s);
        s
    }

    fn stream(&self, bytes: f64) -> f64 {
        bytes / self.stream_bps
    }

    fn glu(&self, n: usize, f: usize, backward: bool) -> f64 {
        self.memo((n, f, 0, if backward { 4 } else { 3 }), || {
            let gu: Vec<f32> = (0..n * 2 * f).map(|i| (i % 61) as f32 * 0.05 - 1.5).collect();
            let (mut out, mut dgu) = (vec![0.0f32; n * f], vec![0.0f32; n * 2 * f]);
            let be = &self.be;
            if backward {
                self.timed(|| be.swiglu_backward(&mut dgu, &out, &gu, n, f))
            } else {
                self.timed(|| be.swiglu_forward(&mut out, &gu, n, f))
            }
        })
    }

    fn cross_entropy(&self, n: usize, v: usize) -> f64 {
        self.memo((n, v, 0, 5), || {
            let logits: Vec<f32> = (0..n * v).map(|i| (i % 97) as f32 * 0.01).collect();
            let targets: Vec<i32> = (0..n).map(|i| (i % v) as i32).collect();
            let mut losses = vec![0.0f32; n];
            // The forward's softmax and loss; the gradient pass costs about as much again.
            let be = &self.be;
            let s = self.timed(|| be.cross_entropy_forward(&mut losses, &logits, &targets, n, v));
            2.0 * s
        })
    }

    fn launch(&self) -> f64 {
        0.0
    }

    fn on_host(&self) -> bool {
        true
    }
}

/// The `this-cpu` profile: the CPU device's link at `link_gbps` (0: free), this machine's
/// cores. Its `gpu` figures and host rates are unused (the device model is [`CpuMeasured`],
/// the host model [`HostMeasured`]).
pub fn this_cpu(link_gbps: f64, host_memory_bytes: u64) -> Hardware {
    let cores = rayon::current_num_threads();
    Hardware {
        name: "this-cpu".to_string(),
        about: "the CPU device on this machine: its kernels and host work timed now".to_string(),
        gpu: Gpu {
            bf16_tflops: 1.0,
            hbm_gbps: 1.0,
            memory_gib: host_memory_bytes as f64 / (1u64 << 30) as f64,
            gemm_efficiency: 1.0,
            gemm_half_dim: 0.0,
            attention_efficiency: 1.0,
            stream_efficiency: 1.0,
            launch_us: 0.0,
        },
        link: Link { h2d_gbps: link_gbps, d2h_gbps: link_gbps, latency_us: 0.0 },
        host: Host {
            cores,
            // The measured times already include this machine's bandwidth limit.
            mem_gbps: f64::INFINITY,
            memory_gib: host_memory_bytes as f64 / (1u64 << 30) as f64,
            rates: HostRates::default(),
            // Measured with the pools (`HostMeasured::contended`).
            contended: 1.0,
        },
    }
}

/// Bytes of buffers a host pass is timed over, in turn, so that each run finds its data out of
/// the cache, as the engine's passes do (a step cycles through all of the host's state):
/// more than the last-level cache of the machines this runs on.
const COLD_BYTES: usize = 128 << 20;

/// The host's work timed on this machine (see the module): each pass at the sizes the plan
/// asks for, on a pool of the engine's host threads, over buffers cycled so that each run
/// starts cold; memoised. What bench counts as a host op's busy time is the host queue's
/// `pool.install` of its passes: the passes, and handing them to the pool, measured apart
/// ([`HostModel::dispatch`]) because one op can run several passes.
pub struct HostMeasured {
    pool: rayon::ThreadPool,
    layout: ModelLayout,
    memo: RefCell<HashMap<(HostPass, usize), f64>>,
    copies: RefCell<HashMap<(Queue, usize), f64>>,
    /// The host's and the device's arenas copies are timed between ([`time_memcpy`]), made on
    /// first use.
    arenas: RefCell<(Vec<f32>, Vec<f32>)>,
    dispatch_s: f64,
    /// Where the engine's queue threads run beside this pool's threads.
    queues: QueueCpus,
    /// The CPU device's kernels, which the copies and [`HostMeasured::contended`] are timed
    /// beside ([`HostMeasured::beside`]); none: copies are timed alone.
    beside: Option<Beside>,
}

/// The CPU device's kernels as [`HostMeasured`] times work beside them.
struct Beside {
    device: Rc<CpuMeasured>,
    /// The product they run back to back: a layer's up projection on a micro-batch's rows.
    shape: (usize, usize, usize),
}

/// The median time of `f` over `sets` buffers in turn (each run on the next), after one
/// untimed run on every set (which also maps their pages: a fresh `vec!` of zeros is not).
fn median_cycling<S>(sets: &mut [S], mut f: impl FnMut(&mut S)) -> f64 {
    sets.iter_mut().for_each(&mut f);
    median(
        (0..REPS)
            .map(|k| {
                let s = &mut sets[k % sets.len()];
                let t0 = Instant::now();
                f(s);
                t0.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// How many buffer sets of `bytes` each make [`COLD_BYTES`], at most [`MAX_COLD_SETS`].
fn cold_sets(bytes: usize) -> usize {
    COLD_BYTES.div_ceil(bytes.max(1)).clamp(1, MAX_COLD_SETS)
}

/// The most buffer sets a pass is cycled over: enough that sets of 32 KiB and up fill
/// [`COLD_BYTES`] (smaller ones cycle through less, 4 MiB at 1 KiB, but such an op's cost is
/// mostly handing it to the pool), and not millions of tiny allocations. Fewer sets leave the
/// cycle in the cache: with at most 8, `bench/overlap.yaml`'s squared norms (3.2 MB a layer,
/// 26 MB cycled) summed 3.3-4.3 ms a step on the 2-core validation machine, against 5.0-5.7
/// over 128 MiB (three projections of each, interleaved).
const MAX_COLD_SETS: usize = 4096;

/// Values in -0.5..0.5, distinct per set, so no pass meets only zeros.
fn filled(n: usize, salt: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + salt) % 1000) as f32 * 1e-3 - 0.5).collect()
}

impl HostMeasured {
    /// A pool of `threads` host threads placed as the engine places its own (`pin`:
    /// `engine.pin_threads`), and the cost of handing it one op from outside.
    pub fn new(threads: usize, layout: &ModelLayout, pin: bool) -> Self {
        let placement = Placement::last(threads, pin);
        let pool = threads::pool("horizon-calibrate-host", threads, placement)
            .expect("cannot start the calibration's host threads");
        let queues = QueueCpus::beside_host_threads(threads, pin);
        let host_queue: Vec<usize> = queues.host.into_iter().collect();
        let dispatch_s = on_thread(&host_queue, || dispatch_time(&pool));
        HostMeasured {
            queues,
            pool,
            layout: layout.clone(),
            memo: RefCell::default(),
            copies: RefCell::default(),
            arenas: RefCell::default(),
            dispatch_s,
            beside: None,
        }
    }

    /// `f`, run inside the pool from this thread (as the host queue does), timed there.
    fn on_pool(&self, f: impl FnOnce() -> f64 + Send) -> f64 {
        self.pool.install(f)
    }

    /// `f`, run on a thread placed as the engine places the copy queues' threads (on the CPUs
    /// the host threads leave, when pinned).
    fn on_copy_thread(&self, f: impl FnOnce() -> f64 + Send) -> f64 {
        on_thread(&self.queues.others, f)
    }

    /// Seconds of `pass` over `n` elements, measured.
    fn measure(&self, pass: HostPass, n: usize) -> f64 {
        match pass {
            HostPass::Update { eight_bit, image } => {
                self.on_pool(|| time_update(n, eight_bit, image))
            }
            HostPass::UpdateRows { next, image } => {
                let layout = &self.layout;
                self.on_pool(|| time_update_rows(layout, n, next, image))
            }
            HostPass::Measure => self.on_pool(|| {
                let mut g: Vec<Vec<f32>> = (0..cold_sets(4 * n)).map(|k| filled(n, k)).collect();
                median_cycling(&mut g, |g| {
                    std::hint::black_box(sum_squares(g));
                })
            }),
            HostPass::MeasureRows => {
                let layout = &self.layout;
                self.on_pool(|| time_measure_rows(layout, n))
            }
            HostPass::Accumulate { bf16_slab } => self.on_pool(|| time_accumulate(n, bf16_slab)),
            HostPass::Expand => self.on_pool(|| {
                let sets = cold_sets(6 * n);
                let mut b: Vec<_> =
                    (0..sets).map(|_| (vec![0.0f32; n], vec![Bf16(0x3f80); n])).collect();
                median_cycling(&mut b, |(g, h)| expand_bf16(g, h))
            }),
            HostPass::Zero => self.on_pool(|| {
                let mut g: Vec<Vec<f32>> = (0..cold_sets(4 * n)).map(|k| filled(n, k)).collect();
                median_cycling(&mut g, |g| g.fill(0.0))
            }),
            HostPass::Scatter => {
                let layout = &self.layout;
                self.on_pool(|| time_scatter(layout, n))
            }
            // On the H2D queue's thread, over the global pool: not on the host pool.
            HostPass::Gather => {
                let layout = &self.layout;
                self.on_copy_thread(|| time_gather(layout, n))
            }
            HostPass::Round => self.on_pool(|| {
                let sets = cold_sets(6 * n);
                let mut b: Vec<_> = (0..sets).map(|k| (filled(n, k), vec![Bf16(0); n])).collect();
                median_cycling(&mut b, |(g, h)| round_to_bf16(h, g))
            }),
        }
    }
}

impl HostMeasured {
    /// Times the copies, and [`HostMeasured::contended`], beside `device`'s kernels running a
    /// layer's up projection on `rows` rows back to back, as the CPU device's copies and host
    /// work run beside its kernels: a copy thread shares its CPU with a kernel thread, and
    /// takes it when it wakes but not always for the whole copy. Timed alone, the copies of
    /// `bench/overlap.yaml` at link 0 were projected at 0.81-0.82 of the runs' uploads and
    /// 0.85 of their downloads (medians of 20 and 24 interleaved runs, `block` and `spin`,
    /// `overlap` and `compact`); timed beside the kernels, 0.88-0.90 and 0.85-0.87.
    pub fn beside(self, device: Rc<CpuMeasured>, rows: usize) -> Self {
        let shape = (rows.max(1), self.layout.dims.c, self.layout.dims.f);
        HostMeasured { beside: Some(Beside { device, shape }), ..self }
    }

    /// What the pool's threads keep of their speed beside the CPU device's kernels, which run
    /// on every core ([`Host::contended`]): an AdamW pass over a layer's trained elements (at
    /// most [`CONTENDED_MAX_ELEMS`]) on the pool, over buffers cycled cold, each after a
    /// [`CONTENDED_NAP`] sleep (the host queue's work arrives between its waits), alone and
    /// while the kernels of [`HostMeasured::beside`] run (entered from a thread placed as the
    /// compute queue's), in turn [`CONTENDED_ROUNDS`] times; the median pass alone over the
    /// median beside, at most 1 (1 with no kernels to time it beside).
    ///
    /// On the 2-core validation machine (`examples/contention_probe`, a layer of
    /// `bench/overlap.yaml`) an update ran at 0.85-0.95 of its speed alone beside those
    /// products, and at 0.67-0.72 beside products of 512 x 512 x 1024; in its runs the layers'
    /// updates that overlapped kernels took 1.08-1.16x those that did not.
    pub fn contended(&self) -> f64 {
        let Some(Beside { device, shape }) = &self.beside else { return 1.0 };
        let n = (0..self.layout.dims.layers)
            .map(|i| self.layout.layer(i).train_len())
            .max()
            .unwrap_or(0)
            .clamp(1 << 12, CONTENDED_MAX_ELEMS);
        let st = timed_step();
        let mut sets: Vec<_> = (0..cold_sets(16 * n))
            .map(|k| (filled(n, k), filled(n, k + 1), filled(n, k + 2), filled(n, k + 3)))
            .collect();
        let (count, mut next) = (sets.len(), 0);
        let mut pass = || {
            let (p, g, m, v) = &mut sets[next % count];
            next += 1;
            std::thread::sleep(CONTENDED_NAP);
            self.on_pool(|| {
                let t0 = Instant::now();
                // Timed, not used: nothing is held in a calibration's finite data.
                let _held = Moments32 { m, v }.update(p, g, &BufferStep::uniform(st), 1.0, 7, None);
                t0.elapsed().as_secs_f64()
            })
        };
        pass();
        let (mut alone, mut beside) = (Vec::new(), Vec::new());
        for _ in 0..CONTENDED_ROUNDS {
            alone.extend((0..REPS).map(|_| pass()));
            beside.extend(device.beside_products(&self.queues.others, *shape, || {
                (0..REPS).map(|_| pass()).collect::<Vec<f64>>()
            }));
        }
        (median(alone) / median(beside)).min(1.0)
    }
}

impl CpuMeasured {
    /// `f`'s result, run while the kernel pool runs products of `(m, k, n)` back to back,
    /// entered from a thread on `cpus` (as the compute queue's thread is placed).
    fn beside_products<T>(
        &self,
        cpus: &[usize],
        (m, k, n): (usize, usize, usize),
        f: impl FnOnce() -> T,
    ) -> T {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = AtomicBool::new(false);
        let (be, kernels) = (&self.be, &self.kernels);
        std::thread::scope(|s| {
            s.spawn(|| {
                threads::restrict_current_thread(cpus);
                let mut o = Operands::new(m, k, n);
                while !stop.load(Ordering::Relaxed) {
                    kernels.install(|| be.matmul_forward(&mut o.out, &o.inp, &o.w, None, m, k, n));
                }
            });
            // Let the kernels get going before `f` starts.
            std::thread::sleep(Duration::from_millis(5));
            let out = f();
            stop.store(true, Ordering::Relaxed);
            out
        })
    }
}

/// The most elements [`HostMeasured::contended`]'s AdamW pass runs over (16 MB of buffers).
const CONTENDED_MAX_ELEMS: usize = 1 << 20;

/// How long [`HostMeasured::contended`] sleeps before each pass.
const CONTENDED_NAP: Duration = Duration::from_millis(1);

/// Rounds of [`HostMeasured::contended`], each timing the pass alone and beside the kernels.
const CONTENDED_ROUNDS: usize = 3;

/// `f`, run on a thread of its own restricted to `cpus` (empty: anywhere).
fn on_thread(cpus: &[usize], f: impl FnOnce() -> f64 + Send) -> f64 {
    let run = move || {
        threads::restrict_current_thread(cpus);
        f()
    };
    std::thread::scope(|s| s.spawn(run).join().expect("a calibration thread panicked"))
}

/// What handing one op to `pool` costs beyond its work, from the calling thread (placed as the
/// engine places the host queue's: beside the pool's first thread, when pinned): the median of
/// several, each after the pool has gone idle (its workers asleep, as between the host queue's
/// ops), each op 200 us of spinning so that the reply, too, finds its thread asleep. Handed
/// across CPUs of this project's virtual machine it costs 80-90 us, on one 6-7
/// (`examples/wake_probe`).
fn dispatch_time(pool: &rayon::ThreadPool) -> f64 {
    const WORK: Duration = Duration::from_micros(200);
    median(
        (0..4 * REPS)
            .map(|_| {
                std::thread::sleep(Duration::from_millis(2));
                let t0 = Instant::now();
                pool.install(|| {
                    let w = Instant::now();
                    while w.elapsed() < WORK {
                        std::hint::spin_loop();
                    }
                });
                t0.elapsed().saturating_sub(WORK).as_secs_f64()
            })
            .collect(),
    )
}

/// The first step of a typical AdamW: the hyperparameters every timed update runs with (they
/// do not change its speed).
fn timed_step() -> AdamWStep {
    let cfg = AdamWConfig { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    AdamWStep::new(&cfg, 1, cfg.lr)
}

/// AdamW over `n` elements as the host queue runs it (the engine's [`Moments`]).
fn time_update(n: usize, eight_bit: bool, image: bool) -> f64 {
    let st = timed_step();
    let per_elem = if eight_bit { 10 } else { 16 } + if image { 2 } else { 0 };
    let sets = cold_sets(per_elem * n);
    let img = |_| if image { vec![Bf16(0); n] } else { Vec::new() };
    if eight_bit {
        let mut b: Vec<_> = (0..sets)
            .map(|k| (filled(n, k), filled(n, k + 1), Moments8::zeros(&[n]), img(k)))
            .collect();
        median_cycling(&mut b, |(p, g, q, i)| {
            let _held =
                q.view_mut().update(p, g, &BufferStep::uniform(st), 1.0, 7, image_of(i, image));
        })
    } else {
        let mut b: Vec<_> = (0..sets)
            .map(|k| (filled(n, k), filled(n, k + 1), vec![0.0f32; n], vec![0.0f32; n], img(k)))
            .collect();
        median_cycling(&mut b, |(p, g, m, v, i)| {
            let _held = Moments32 { m, v }.update(
                p,
                g,
                &BufferStep::uniform(st),
                1.0,
                7,
                image_of(i, image),
            );
        })
    }
}

/// One part of the embedding's update over `n` elements (its rows x C), as the engine walks it
/// ([`row_runs`] over tasks of [`ROW_TASK`] rows): the next step's rows, `n / C` of them at
/// random (`next`), or the rest of the table around such rows. On the validation's model (4,096
/// rows of 256) the ~480 rows of the next step took 0.6-1 ms in runs, 1.5 us a row, where a
/// whole-table pass's share of them is 0.17 ms: rows of 1 KB come cold from memory one by one.
fn time_update_rows(layout: &ModelLayout, n: usize, next: bool, image: bool) -> f64 {
    use rayon::prelude::*;
    let (v, c) = (layout.dims.v, layout.dims.c.max(1));
    let wanted = if next { n / c } else { v.saturating_sub(n / c) };
    let pick = random_rows(v, wanted);
    let st = timed_step();
    let len = v * c;
    let mut sets: Vec<_> = (0..cold_sets(18 * len))
        .map(|k| {
            (
                filled(len, k),
                filled(len, k + 1),
                vec![0.0f32; len],
                vec![0.0f32; len],
                vec![Bf16(0); len],
            )
        })
        .collect();
    median_cycling(&mut sets, |(p, g, m, vv, img)| {
        let t = ROW_TASK * c;
        pick.par_chunks(ROW_TASK)
            .zip(p.par_chunks_mut(t).zip(g.par_chunks_mut(t)))
            .zip(m.par_chunks_mut(t).zip(vv.par_chunks_mut(t)).zip(img.par_chunks_mut(t)))
            .for_each(|((rows, (p, g)), ((m, vv), img))| {
                for run in row_runs(rows, next) {
                    let e = run.start * c..run.end * c;
                    let img = image_of(&mut img[e.clone()], image);
                    let (p, m, vv) = (&mut p[e.clone()], &mut m[e.clone()], &mut vv[e.clone()]);
                    adamw_update_local(p, img, &g[e.clone()], m, vv, &st, 1.0);
                    g[e].fill(0.0);
                }
            })
    })
}

/// `wanted` of `v` rows (all of them at most), picked at random, always the same.
fn random_rows(v: usize, wanted: usize) -> Vec<bool> {
    let mut pick = vec![false; v];
    let (mut state, mut picked) = (0x9e37_79b9_7f4a_7c15u64, 0);
    while picked < wanted.min(v) {
        state =
            state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let r = (state >> 33) as usize % v;
        picked += usize::from(!pick[r]);
        pick[r] = true;
    }
    pick
}

/// The embedding gradient's squared norm from `n / C` of its rows, at random, over a cold
/// table, as the engine reads it (`sum_squares_rows`).
fn time_measure_rows(layout: &ModelLayout, n: usize) -> f64 {
    let (v, c) = (layout.dims.v, layout.dims.c.max(1));
    let pick = random_rows(v, n / c);
    let len = v * c;
    let mut g: Vec<Vec<f32>> = (0..cold_sets(4 * len)).map(|k| filled(len, k)).collect();
    median_cycling(&mut g, |g| {
        std::hint::black_box(sum_squares_rows(g, c, &pick));
    })
}

/// The image argument of an update: `i` when it writes one.
fn image_of(i: &mut [Bf16], image: bool) -> Option<&mut [Bf16]> {
    if image { Some(i) } else { None }
}

/// A slab of `n` elements, fp32 or bf16 as it travelled, added into fp32 gradients.
fn time_accumulate(n: usize, bf16_slab: bool) -> f64 {
    match bf16_slab {
        false => {
            let mut b: Vec<_> =
                (0..cold_sets(8 * n)).map(|k| (filled(n, k), filled(n, k + 1))).collect();
            median_cycling(&mut b, |(acc, g)| add_inplace(acc, g))
        }
        true => {
            let mut b: Vec<_> =
                (0..cold_sets(6 * n)).map(|k| (filled(n, k), vec![Bf16(0x3c00); n])).collect();
            median_cycling(&mut b, |(acc, g)| add_bf16(acc, g))
        }
    }
}

/// Staged ids of `rows` rows over a vocabulary of `v`: spread over the table.
fn ids(rows: usize, v: usize) -> Vec<i32> {
    (0..rows).map(|i| ((i * 2_654_435_761) % v) as i32).collect()
}

/// The embedding's scatter-add of `n` staged elements (rows x C) into its gradient.
fn time_scatter(layout: &ModelLayout, n: usize) -> f64 {
    let (c, v) = (layout.dims.c, layout.dims.v);
    let ids = ids(n / c, v);
    let sets = cold_sets(4 * (v * c + 2 * n));
    let mut b: Vec<_> = (0..sets).map(|k| (vec![0.0f32; v * c], filled(n / c * c, k))).collect();
    median_cycling(&mut b, |(table, dx)| embed_rows_backward(table, &ids, dx, layout))
}

/// The embedding gather of `n` elements (rows x C) from the table, on this thread.
fn time_gather(layout: &ModelLayout, n: usize) -> f64 {
    let (c, v) = (layout.dims.c, layout.dims.v);
    let ids = ids(n / c, v);
    let sets = cold_sets(4 * (v * c + n));
    let mut b: Vec<_> = (0..sets).map(|k| (filled(v * c, k), vec![0.0f32; n / c * c])).collect();
    median_cycling(&mut b, |(table, out)| embed_rows(out, &ids, table, layout))
}

/// Copy queue `q`'s memcpy of `bytes`, on this thread, between the two `arenas`: the host's
/// (an upload's source, a download's destination) of [`COLD_BYTES`], whose windows it cycles
/// through, as a step cycles through the host's state; and the device's, of an eighth of that,
/// as the device's few buffers of a size are used again and again (in the shared last-level
/// cache, not the copying core's own). Each timed copy follows a [`COPY_NAP`] sleep, as a copy
/// queue's thread sleeps before each copy, and the result is the mean of [`COPY_REPS`] runs,
/// not their median: a queue's busy time is the sum of its copies, and some wait for their
/// core. With `kernels` (the CPU device's kernel pool, kept running products meanwhile:
/// [`HostMeasured::beside`]), each copy's device side is first touched on that pool, as the
/// kernels touched it in a run. The measurements behind each choice: `bench/validation/LOG.md`
/// (2026-12-04, 20:28 and the rounds before it).
fn time_memcpy(
    arenas: &mut (Vec<f32>, Vec<f32>),
    q: Queue,
    bytes: usize,
    kernels: Option<&rayon::ThreadPool>,
) -> f64 {
    let n = bytes.div_ceil(4);
    let (host, dev) = arenas;
    // Made on first use, and again for a copy larger than they are (elements, 4 bytes each).
    let (host_len, dev_len) = ((COLD_BYTES / 4).max(n), (COLD_BYTES / 8 / 4).max(2 * n));
    if host.len() < host_len {
        *host = filled(host_len, 1);
    }
    if dev.len() < dev_len {
        *dev = filled(dev_len, 2);
    }
    let (hw, dw) = (host.len() / n, dev.len() / n);
    let mut copy = |k: usize, nap: bool| {
        let (h, d) = ((k % hw) * n..(k % hw + 1) * n, (k % dw) * n..(k % dw + 1) * n);
        if nap {
            std::thread::sleep(COPY_NAP);
            match (q, kernels) {
                (Queue::D2H, Some(pool)) => write_on(pool, &mut dev[d.clone()], k as f32),
                (_, Some(pool)) => read_on(pool, &dev[d.clone()]),
                (_, None) => {}
            }
        }
        let t0 = Instant::now();
        match q {
            Queue::D2H => host[h].copy_from_slice(&dev[d]),
            _ => dev[d].copy_from_slice(&host[h]),
        }
        t0.elapsed().as_secs_f64()
    };
    (0..2 * hw).for_each(|k| {
        copy(k, false);
    });
    (0..COPY_REPS).map(|k| copy(k, true)).sum::<f64>() / COPY_REPS as f64
}

/// Writes `v` over `buf` on `pool`'s threads, each a part, as a kernel writes its output.
fn write_on(pool: &rayon::ThreadPool, buf: &mut [f32], v: f32) {
    use rayon::prelude::*;
    let part = buf.len().div_ceil(pool.current_num_threads()).max(1);
    pool.install(|| buf.par_chunks_mut(part).for_each(|c| c.fill(v)));
}

/// Reads `buf` on `pool`'s threads, each a part, as a kernel reads its operands.
fn read_on(pool: &rayon::ThreadPool, buf: &[f32]) {
    use rayon::prelude::*;
    let part = buf.len().div_ceil(pool.current_num_threads()).max(1);
    let sum: f32 = pool.install(|| buf.par_chunks(part).map(|c| c.iter().sum::<f32>()).sum());
    std::hint::black_box(sum);
}

/// Timed runs of a copy: more than a pass's [`REPS`], since a copy takes a millisecond at most.
const COPY_REPS: usize = 21;

/// How long [`time_memcpy`]'s thread sleeps before each timed copy: long enough for its core to
/// go idle, as it does between a run's copies (which come milliseconds apart), and short enough
/// that the timed copies of each size add a few tens of milliseconds to a projection.
const COPY_NAP: Duration = Duration::from_millis(1);

impl HostModel for HostMeasured {
    fn pass(&self, pass: HostPass, elems: usize) -> f64 {
        if elems == 0 {
            return 0.0;
        }
        if let Some(&s) = self.memo.borrow().get(&(pass, elems)) {
            return s;
        }
        let s = self.measure(pass, elems);
        self.memo.borrow_mut().insert((pass, elems), s);
        s
    }

    fn dispatch(&self) -> f64 {
        self.dispatch_s
    }

    fn memcpy(&self, q: Queue, bytes: usize) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        if let Some(&s) = self.copies.borrow().get(&(q, bytes)) {
            return s;
        }
        let mut arenas = self.arenas.borrow_mut();
        let arenas = &mut *arenas;
        let kernels = self.beside.as_ref().map(|b| &b.device.kernels);
        let time = move || self.on_copy_thread(move || time_memcpy(arenas, q, bytes, kernels));
        let s = match &self.beside {
            Some(b) => b.device.beside_products(&self.queues.others, b.shape, time),
            None => time(),
        };
        self.copies.borrow_mut().insert((q, bytes), s);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_passes_are_timed_once_and_grow_with_size() {
        let layout = crate::model::families::fixture_layout();
        let h = HostMeasured::new(2, &layout, true);
        assert!(h.dispatch() > 0.0 && h.dispatch() < 0.01, "{}", h.dispatch());
        let update = HostPass::Update { eight_bit: false, image: false };
        let (small, big) = (h.pass(update, 1 << 12), h.pass(update, 1 << 20));
        assert!(small > 0.0 && big > small, "{small} vs {big}");
        assert_eq!(h.pass(update, 1 << 20), big, "memoised");
        assert_eq!(h.pass(HostPass::Measure, 0), 0.0);
        let passes = [HostPass::Measure, HostPass::MeasureRows, HostPass::Zero, HostPass::Scatter];
        for p in passes.into_iter().chain([HostPass::Gather]) {
            assert!(h.pass(p, 64 * layout.dims.c) > 0.0, "{p:?}");
        }
        let (big, small) = (h.memcpy(Queue::H2D, 1 << 22), h.memcpy(Queue::D2H, 1 << 10));
        assert!(big > small, "a bigger copy takes longer: {small} vs {big}");
    }

    #[test]
    fn host_threads_and_copies_are_timed_beside_the_kernels() {
        let layout = crate::model::families::fixture_layout();
        let h = HostMeasured::new(1, &layout, true);
        assert_eq!(h.contended(), 1.0, "nothing to time it beside");
        let h = h.beside(Rc::new(CpuMeasured::new(true)), 64);
        let c = h.contended();
        assert!(c > 0.0 && c <= 1.0, "{c}");
        let (big, small) = (h.memcpy(Queue::D2H, 1 << 22), h.memcpy(Queue::H2D, 1 << 10));
        assert!(big > small, "copies beside the kernels: {small} vs {big}");
    }
}
