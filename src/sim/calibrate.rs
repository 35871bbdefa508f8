//! `this-cpu`: the CPU device on this machine. Its kernels run on the host's cores, so its
//! "device" costs are the CPU backend's own kernel times, measured here at the shapes the plan
//! uses (each product and attention shape once, the median of a few runs, memoised), and its
//! host rates are measured here too (a few million elements each). The link is the CPU
//! device's simulated one (`device.link_gbps`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Instant;

use horizon_backend::bf16::{Bf16, add_bf16, round_to_bf16};
use horizon_backend::{Backend, CpuBackend, Dinp};

use crate::model::spec::AttnSpec;
use crate::optim::adamw::{AdamWConfig, AdamWStep, adamw_update};
use crate::optim::adamw8bit::{Moments8, adamw8bit_update};
use crate::sim::cost::DeviceModel;
use crate::sim::hardware::{Gpu, Hardware, Host, HostRates, Link};

/// An attention shape: heads, kv heads, head dim, window, sequences, positions, backward.
type AttnKey = (usize, usize, usize, usize, usize, usize, bool);

/// The CPU backend's kernels, timed on first use.
pub struct CpuMeasured {
    be: CpuBackend,
    gemm: RefCell<HashMap<(usize, usize, usize, u8), f64>>,
    attn: RefCell<HashMap<AttnKey, f64>>,
    /// Bytes per second of a parallel elementwise pass.
    stream_bps: f64,
}

fn median_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[reps / 2]
}

/// Repetitions of a measurement (after one warm-up run), of which the median counts: this
/// machine's other tenants move single runs by 10-20%.
const REPS: usize = 7;

impl CpuMeasured {
    pub fn new() -> Self {
        let n = 4 << 20;
        let (src, mut dst) = (vec![1.0f32; n], vec![0.0f32; n]);
        let be = CpuBackend::new();
        let s = median_of(REPS, || be.add_inplace(&mut dst, &src));
        CpuMeasured {
            be,
            gemm: RefCell::default(),
            attn: RefCell::default(),
            stream_bps: 12.0 * n as f64 / s,
        }
    }

    /// The time of `out (m, n) = inp (m, k) w (n, k)ᵀ` (`pass` 0), or of its backward with
    /// (1) or without (2) the weight's gradient, memoised.
    /// `measure()`, memoised under `key`.
    fn memo(&self, key: (usize, usize, usize, u8), measure: impl FnOnce() -> f64) -> f64 {
        if let Some(&s) = self.gemm.borrow().get(&key) {
            return s;
        }
        let s = measure();
        self.gemm.borrow_mut().insert(key, s);
        s
    }

    fn product(&self, m: usize, k: usize, n: usize, pass: u8) -> f64 {
        if m == 0 || k == 0 || n == 0 {
            return 0.0;
        }
        let key = (m, k, n, pass);
        if let Some(&s) = self.gemm.borrow().get(&key) {
            return s;
        }
        let (inp, w) = (vec![0.5f32; m * k], vec![0.25f32; n * k]);
        let s = if pass == 0 {
            let mut out = vec![0.0f32; m * n];
            median_of(REPS, || self.be.matmul_forward(&mut out, &inp, &w, None, m, k, n))
        } else {
            let dout = vec![0.1f32; m * n];
            let (mut dinp, mut dw) = (vec![0.0f32; m * k], vec![0.0f32; n * k]);
            median_of(REPS, || {
                let dw = if pass == 1 { Some(&mut dw[..]) } else { None };
                let dinp = Some(Dinp::Write(&mut dinp[..]));
                self.be.matmul_backward(dinp, dw, None, &dout, &inp, &w, m, k, n)
            })
        };
        self.gemm.borrow_mut().insert(key, s);
        s
    }
}

impl Default for CpuMeasured {
    fn default() -> Self {
        Self::new()
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
        self.be.attention_forward(&mut out, &mut lse, &qkv, dims);
        let s = if bwd {
            let dout = vec![0.01f32; rows * out_w];
            let mut dqkv = vec![0.0f32; rows * qkv_w];
            median_of(REPS, || self.be.attention_backward(&mut dqkv, &dout, &qkv, &out, &lse, dims))
        } else {
            median_of(REPS, || self.be.attention_forward(&mut out, &mut lse, &qkv, dims))
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
            if backward {
                median_of(REPS, || self.be.swiglu_backward(&mut dgu, &out, &gu, n, f))
            } else {
                median_of(REPS, || self.be.swiglu_forward(&mut out, &gu, n, f))
            }
        })
    }

    fn cross_entropy(&self, n: usize, v: usize) -> f64 {
        self.memo((n, v, 0, 5), || {
            let logits: Vec<f32> = (0..n * v).map(|i| (i % 97) as f32 * 0.01).collect();
            let targets: Vec<i32> = (0..n).map(|i| (i % v) as i32).collect();
            let mut losses = vec![0.0f32; n];
            // The forward's softmax and loss; the gradient pass costs about as much again.
            let s = median_of(REPS, || {
                self.be.cross_entropy_forward(&mut losses, &logits, &targets, n, v)
            });
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

/// This machine's host rates per core, measured on a pool of `threads` threads (the engine's
/// host pool, `engine.host_threads`) and divided by them.
pub fn measure_host_rates(threads: usize) -> HostRates {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a host pool");
    pool.install(|| host_rates_here(threads))
}

fn host_rates_here(threads: usize) -> HostRates {
    let n = 4 << 20;
    let mut p: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3 - 0.5).collect();
    let g: Vec<f32> = (0..n).map(|i| (i % 777) as f32 * 1e-4 - 0.03).collect();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let cfg = AdamWConfig { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let st = AdamWStep::new(&cfg, 1, cfg.lr);
    let per = |s: f64| n as f64 / s / threads as f64;
    let adamw = per(median_of(REPS, || adamw_update(&mut p, &g, &mut m, &mut v, &st, 1.0)));
    let mut q = Moments8::zeros(&[n]);
    let adamw8bit =
        per(median_of(REPS, || adamw8bit_update(&mut p, &g, q.view_mut(), &st, 1.0, 7)));
    let mut acc = vec![0.0f32; n];
    let be = CpuBackend::new();
    let accumulate_f32 = per(median_of(REPS, || be.add_inplace(&mut acc, &g)));
    let mut h = vec![Bf16(0); n];
    let round_bf16 = per(median_of(REPS, || round_to_bf16(&mut h, &g)));
    let accumulate_bf16 = per(median_of(REPS, || add_bf16(&mut acc, &h)));
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a 1-thread pool");
    let copy_gbps = one.install(|| {
        let s = median_of(REPS, || acc.copy_from_slice(&g));
        8.0 * n as f64 / s * 1e-9
    });
    HostRates {
        adamw,
        adamw_image: adamw,
        adamw8bit,
        adamw8bit_image: adamw8bit,
        accumulate_f32,
        accumulate_bf16,
        round_bf16,
        copy_gbps,
    }
}

/// The `this-cpu` profile: the CPU device's link at `link_gbps` (0: free), this machine's
/// cores and host rates (on `host_threads` threads). Its `gpu` figures are unused (the device
/// model is [`CpuMeasured`]).
pub fn this_cpu(link_gbps: f64, host_memory_bytes: u64, host_threads: usize) -> Hardware {
    let cores = rayon::current_num_threads();
    Hardware {
        name: "this-cpu".to_string(),
        about: "the CPU device on this machine: kernel and host rates measured now".to_string(),
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
            // The measured rates already include this machine's bandwidth limit.
            mem_gbps: f64::INFINITY,
            memory_gib: host_memory_bytes as f64 / (1u64 << 30) as f64,
            rates: measure_host_rates(host_threads),
        },
    }
}
