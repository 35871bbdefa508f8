//! Hardware profiles for the projection: a GPU (its bf16 peak, HBM, memory), the link to the
//! host (pinned bandwidth each way), and the host (cores, memory bandwidth, memory, and the
//! per-core rates of its host work). Built-in profiles for the machines the paper and its
//! successor report on, a YAML file for any other, and `this-cpu` (see [`crate::sim::calibrate`]).

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::sim::cost::DeviceModel;

/// A machine to project a run on.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    pub name: String,
    /// Where the figures come from.
    #[serde(default)]
    pub about: String,
    pub gpu: Gpu,
    pub link: Link,
    pub host: Host,
}

/// The accelerator.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// Dense bf16 peak, TFLOP/s.
    pub bf16_tflops: f64,
    /// HBM bandwidth, GB/s.
    pub hbm_gbps: f64,
    /// Device memory, GiB.
    pub memory_gib: f64,
    /// Fraction of the peak a large bf16 GEMM reaches (cuBLAS on H100/H200: about 0.75-0.8).
    #[serde(default = "default_gemm_efficiency")]
    pub gemm_efficiency: f64,
    /// A GEMM dimension `x` scales the efficiency by `x / (x + gemm_half_dim)`: skinny products
    /// fall off the peak.
    #[serde(default = "default_gemm_half_dim")]
    pub gemm_half_dim: f64,
    /// Fraction of the bf16 peak the attention kernels reach, forward and backward (the
    /// backward costed as 2.5 forwards), where Horizon's tensor-core kernels take the head dim
    /// (a multiple of 16 up to 128): see [`default_attention_efficiency`]. Other head dims run
    /// on fp32 CUDA cores ([`fp32_attention_efficiency`]).
    #[serde(default = "default_attention_efficiency")]
    pub attention_efficiency: f64,
    /// Fraction of the HBM bandwidth an elementwise kernel reaches.
    #[serde(default = "default_stream_efficiency")]
    pub stream_efficiency: f64,
    /// Launch overhead per kernel, microseconds.
    #[serde(default = "default_launch_us")]
    pub launch_us: f64,
}

fn default_gemm_efficiency() -> f64 {
    0.8
}
fn default_gemm_half_dim() -> f64 {
    96.0
}
/// Horizon's tensor-core attention kernels (`kernels/attention_mma.cu`: FlashAttention-2 style,
/// mma.sync m16n8k16 on bf16 operands with scores, probabilities and accumulators in registers,
/// tiles double-buffered by cp.async, 64-row blocks of 4 warps), as a fraction of a 989 TFLOP/s
/// bf16 peak: measured on the H200 lent on 2026-12-04 (`examples/cuda_op_speed`, a Qwen2.5-7B
/// layer, D = 128, 4 x 4096 tokens, median of 5) at 102.2 TFLOP/s forward and 65.9 backward
/// (the backward counted as 2.5 forwards), 0.074 over both (`bench/lent_profile.py`). The
/// estimate before the measurement was 0.15: the gap to FlashAttention-2's 0.35 and 0.28 is
/// each warp's 16 rows (FlashAttention-2 gives a warp 32, so each key and value fragment read
/// from shared memory serves twice the products) and the backward's split into dq and dk/dv,
/// which computes the scores twice. The wmma kernels before them are at
/// [`WMMA_ATTENTION_EFFICIENCY`]; FlashAttention itself (`wgmma`) at
/// [`FLASH_ATTENTION_EFFICIENCY`].
fn default_attention_efficiency() -> f64 {
    0.074
}

/// Horizon's wmma attention kernels (`kernels/attention_tc.cu`, `device.attention: wmma`), as a
/// fraction of the bf16 peak: measured on the same H200, layer and day as
/// [`default_attention_efficiency`] at 30.8 TFLOP/s forward and 23.2 backward, 0.025 over both
/// (estimated at 0.08 before). Their scores and probabilities pass through shared memory.
pub const WMMA_ATTENTION_EFFICIENCY: f64 = 0.025;

/// Horizon's fp32 attention kernels, for head dims the tensor-core ones do not take, as a
/// fraction of the bf16 peak, measured on the same H200, layer and day as
/// [`default_attention_efficiency`]: the tiled ones (D a multiple of 4 up to 128) at 19.8
/// TFLOP/s forward and 10.3 backward, 0.012 over both (estimated at 0.02 before); the
/// warp-per-row ones (D above 128, or not a multiple of 4) at 4.2 and 4.0, 0.004 (0.0035 with
/// the backward of the morning's run, with which a projection predicted the measured 7B step
/// within 7%).
pub fn fp32_attention_efficiency(d: usize) -> f64 {
    if d.is_multiple_of(4) && d <= 128 { 0.012 } else { 0.004 }
}

/// Whether Horizon's tensor-core attention kernels take head dim `d` (`cuda/attention.rs`).
pub fn tensor_core_head_dim(d: usize) -> bool {
    d.is_multiple_of(16) && d <= 128
}

/// The fraction of `gpu`'s peak attention reaches at head dim `d`: the profile's rate where
/// the tensor-core kernels take `d`, or where the profile is at a FlashAttention-class rate
/// (such a kernel takes every head dim); the fp32 kernels' rate otherwise, at most.
pub fn attention_efficiency_at(gpu: &Gpu, d: usize) -> f64 {
    let eff = gpu.attention_efficiency;
    match tensor_core_head_dim(d) || eff >= FLASH_ATTENTION_EFFICIENCY {
        true => eff,
        false => eff.min(fp32_attention_efficiency(d)),
    }
}

/// What a tensor-core attention reaches: PyTorch's FlashAttention (`scaled_dot_product_attention`,
/// bf16, causal, forward and backward, Qwen2.5-7B heads at 4 x 4096) ran at 516-520 TFLOP/s on
/// the H200 lent on 2026-12-04 (`bench/gpu_ceilings.py`), 0.52 of the peak. `horizon plan`
/// projects each GPU run at this rate too, to show what the rest of the plan allows.
pub const FLASH_ATTENTION_EFFICIENCY: f64 = 0.52;
fn default_stream_efficiency() -> f64 {
    0.8
}
fn default_launch_us() -> f64 {
    4.0
}

/// The host link.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Pinned host-to-device bandwidth, GB/s (0: free, as the CPU device at `link_gbps` 0).
    pub h2d_gbps: f64,
    /// Pinned device-to-host bandwidth, GB/s.
    pub d2h_gbps: f64,
    /// Fixed cost per copy, microseconds.
    #[serde(default = "default_latency_us")]
    pub latency_us: f64,
}

fn default_latency_us() -> f64 {
    10.0
}

/// The host.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// Cores the host work can use (the optimizer's pool; `engine.host_threads` caps it).
    pub cores: usize,
    /// Memory bandwidth the host work reaches, GB/s (STREAM-like, not the DIMMs' peak).
    pub mem_gbps: f64,
    /// Host memory, GiB.
    pub memory_gib: f64,
    /// Per-core rates of the host work; by default this machine's (see [`HostRates`]).
    #[serde(default)]
    pub rates: HostRates,
    /// What the host's threads get of what they would share when more of them want the cores
    /// than there are, in (0, 1] ([`crate::sim::des`]): threads taking turns on a core refill
    /// its caches after each switch, and a parallel kernel waits for its slowest thread. 1 (no
    /// loss) unless measured: `this-cpu` measures it, where the CPU device's kernels share the
    /// cores with the host work ([`crate::sim::calibrate::HostMeasured::contended`]).
    #[serde(default = "uncontended")]
    pub contended: f64,
}

fn uncontended() -> f64 {
    1.0
}

/// Per-core rates of the host work, elements per second on one core (and GB/s for plain
/// copies); a pass on `k` cores runs `k` times as fast until it reaches the host's memory
/// bandwidth. The defaults were measured on the development machine (an Intel Xeon at
/// 2.8 GHz, 2 cores) by `cargo run --release --example adamw_speed -- --json`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HostRates {
    /// fp32 AdamW (28 bytes moved per parameter).
    pub adamw: f64,
    /// fp32 AdamW writing the bf16 image too (30 bytes).
    pub adamw_image: f64,
    /// 8-bit AdamW (16 bytes).
    pub adamw8bit: f64,
    /// 8-bit AdamW with the bf16 image (18 bytes).
    pub adamw8bit_image: f64,
    /// `acc += x`, fp32 (12 bytes).
    pub accumulate_f32: f64,
    /// `acc += x` from bf16 (10 bytes).
    pub accumulate_bf16: f64,
    /// fp32 -> bf16 rounding (6 bytes).
    pub round_bf16: f64,
    /// memcpy on one core, GB/s (bytes read + written).
    pub copy_gbps: f64,
}

impl Default for HostRates {
    /// `adamw_speed` on one thread of the development machine (16M parameters, median of 9,
    /// quiet machine, 2026-12-01; the 8-bit rates from the AVX-512 body, 2026-12-02).
    fn default() -> Self {
        HostRates {
            adamw: 376e6,
            adamw_image: 335e6,
            adamw8bit: 188e6,
            adamw8bit_image: 181e6,
            accumulate_f32: 1233e6,
            accumulate_bf16: 1621e6,
            round_bf16: 999e6,
            copy_gbps: 10.5,
        }
    }
}

/// The names of the built-in profiles, with what they are.
pub const BUILT_IN: [(&str, &str); 5] = [
    (
        "h200-pcie5",
        "H200 SXM (989 TFLOP/s bf16, 4.8 TB/s, 141 GB), PCIe Gen5 x16, 2-socket DDR5, 1.5 TB",
    ),
    (
        "h100-pcie5",
        "H100 SXM (989 TFLOP/s bf16, 3.35 TB/s, 80 GB), PCIe Gen5 x16, 2-socket DDR5, 1 TB",
    ),
    (
        "a100-pcie4",
        "A100 SXM 80 GB (312 TFLOP/s bf16, 2.0 TB/s), PCIe Gen4 x16, 2-socket DDR4, 1 TB",
    ),
    ("gh200", "GH200 (H100 96 GB HBM3, 4 TB/s), NVLink-C2C to a 72-core Grace with 480 GB LPDDR5X"),
    (
        "this-cpu",
        "the CPU device on this machine: its kernels and host work timed, device.link_gbps",
    ),
];

/// A 2-socket DDR5 server host (Sapphire Rapids / Genoa class): 2 x 56 cores; 2 x 8 channels
/// of DDR5-4800 are 614 GB/s peak, of which STREAM reaches about 70% (430 GB/s) across both
/// sockets.
fn ddr5_host(memory_gib: f64) -> Host {
    Host { cores: 112, mem_gbps: 430.0, memory_gib, rates: HostRates::default(), contended: 1.0 }
}

/// PCIe Gen5 x16: 64 GB/s raw per direction; pinned cudaMemcpyAsync reaches about 55 GB/s
/// (nvbandwidth on H100/H200 HGX systems).
fn pcie5() -> Link {
    Link { h2d_gbps: 55.0, d2h_gbps: 55.0, latency_us: 10.0 }
}

fn gpu(bf16_tflops: f64, hbm_gbps: f64, memory_gib: f64) -> Gpu {
    Gpu {
        bf16_tflops,
        hbm_gbps,
        memory_gib,
        gemm_efficiency: default_gemm_efficiency(),
        gemm_half_dim: default_gemm_half_dim(),
        attention_efficiency: default_attention_efficiency(),
        stream_efficiency: default_stream_efficiency(),
        launch_us: default_launch_us(),
    }
}

impl Hardware {
    /// A built-in profile by name (`this-cpu` is built by [`crate::sim::calibrate`]).
    pub fn built_in(name: &str) -> Option<Hardware> {
        let (gpu, link, host, about) = match name {
            // NVIDIA H200 datasheet: 989 TFLOP/s dense bf16 (1979 with sparsity), 4.8 TB/s
            // HBM3e, 141 GB. The paper's machine: one H200 with 1.5 TB of host RAM.
            "h200-pcie5" => (
                gpu(989.0, 4800.0, 141.0 * 1e9 / GIB),
                pcie5(),
                ddr5_host(1536.0),
                "NVIDIA H200 datasheet; PCIe Gen5 pinned ~55 GB/s (nvbandwidth); 2-socket DDR5 host",
            ),
            // NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB.
            "h100-pcie5" => (
                gpu(989.0, 3350.0, 80.0 * 1e9 / GIB),
                pcie5(),
                ddr5_host(1024.0),
                "NVIDIA H100 SXM5 datasheet; PCIe Gen5 pinned ~55 GB/s; 2-socket DDR5 host",
            ),
            // NVIDIA A100 datasheet: 312 TFLOP/s dense bf16, 2039 GB/s HBM2e, 80 GB; PCIe Gen4
            // x16 is 32 GB/s raw, pinned copies reach about 25 GB/s. Host: 2 x 64-core EPYC
            // 7763, 2 x 8 channels DDR4-3200 (410 GB/s peak, about 290 GB/s STREAM).
            "a100-pcie4" => (
                gpu(312.0, 2039.0, 80.0 * 1e9 / GIB),
                Link { h2d_gbps: 25.0, d2h_gbps: 25.0, latency_us: 10.0 },
                Host {
                    cores: 128,
                    mem_gbps: 290.0,
                    memory_gib: 1024.0,
                    rates: HostRates::default(),
                    contended: 1.0,
                },
                "NVIDIA A100 datasheet; PCIe Gen4 pinned ~25 GB/s; 2-socket EPYC 7763 DDR4 host",
            ),
            // GH200 Grace Hopper (96 GB HBM3 version): H100 compute (989 TFLOP/s dense bf16),
            // 4.0 TB/s; NVLink-C2C 900 GB/s total, of which host-to-device copies measured by
            // others reach about 375 GB/s and device-to-host about 300 GB/s; Grace: 72
            // Neoverse V2 cores, 480 GB LPDDR5X at up to 512 GB/s (about 450 measured).
            "gh200" => (
                gpu(989.0, 4000.0, 96.0 * 1e9 / GIB),
                Link { h2d_gbps: 375.0, d2h_gbps: 300.0, latency_us: 5.0 },
                Host {
                    cores: 72,
                    mem_gbps: 450.0,
                    memory_gib: 480.0,
                    rates: HostRates::default(),
                    contended: 1.0,
                },
                "NVIDIA GH200 datasheet; NVLink-C2C copies ~375 H2D / ~300 D2H GB/s as measured by others",
            ),
            _ => return None,
        };
        Some(Hardware { name: name.to_string(), about: about.to_string(), gpu, link, host })
    }

    /// A profile from a YAML file (the fields of [`Hardware`]; see docs/projection.md).
    pub fn from_file(path: &Path) -> Result<Hardware> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read hardware profile {}", path.display()))?;
        let hw: Hardware = serde_saphyr::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "{}: {e}\nhint: a hardware profile has name, gpu {{bf16_tflops, hbm_gbps, memory_gib}}, link {{h2d_gbps, d2h_gbps}}, host {{cores, mem_gbps, memory_gib}}",
                path.display()
            )
        })?;
        hw.check().with_context(|| format!("hardware profile {}", path.display()))?;
        Ok(hw)
    }

    /// Every figure positive where it must be.
    pub fn check(&self) -> Result<()> {
        let g = &self.gpu;
        for (k, v) in [
            ("gpu.bf16_tflops", g.bf16_tflops),
            ("gpu.hbm_gbps", g.hbm_gbps),
            ("gpu.memory_gib", g.memory_gib),
            ("gpu.gemm_efficiency", g.gemm_efficiency),
            ("gpu.attention_efficiency", g.attention_efficiency),
            ("gpu.stream_efficiency", g.stream_efficiency),
            ("host.mem_gbps", self.host.mem_gbps),
            ("host.memory_gib", self.host.memory_gib),
        ] {
            if !(v.is_finite() && v > 0.0) {
                bail!("{k} must be a positive number, got {v}");
            }
        }
        for (k, v) in [("link.h2d_gbps", self.link.h2d_gbps), ("link.d2h_gbps", self.link.d2h_gbps)]
        {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{k} must be a number >= 0 (0: a free link), got {v}");
            }
        }
        if self.host.cores == 0 {
            bail!("host.cores must be at least 1");
        }
        Ok(())
    }

    /// Device memory in bytes.
    pub fn device_bytes(&self) -> u64 {
        (self.gpu.memory_gib * GIB) as u64
    }

    /// Host memory in bytes.
    pub fn host_bytes(&self) -> u64 {
        (self.host.memory_gib * GIB) as u64
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// The GPU by roofline: a product at the bf16 peak times a shape-dependent efficiency, or at
/// HBM speed if its bytes take longer; attention at a fixed fraction of the peak (the profile's
/// where the tensor-core kernels take the head dim, the fp32 kernels' otherwise); elementwise
/// kernels at a fraction of HBM bandwidth.
pub struct Roofline<'a>(pub &'a Gpu);

impl DeviceModel for Roofline<'_> {
    fn gemm(&self, m: usize, k: usize, n: usize) -> f64 {
        let g = self.0;
        let f = |x: usize| x as f64 / (x as f64 + g.gemm_half_dim);
        let eff = g.gemm_efficiency * f(m) * f(k) * f(n);
        let flops = 2.0 * (m * k) as f64 * n as f64;
        // bf16 operands (the input rounded to bf16 first: read fp32, write bf16), fp32 out.
        let (mk, nk, mn) = ((m * k) as f64, (n * k) as f64, (m * n) as f64);
        let bytes = mk * 2.0 + nk * 2.0 + mn * 4.0;
        let round = self.stream(mk * 6.0);
        (flops / (g.bf16_tflops * 1e12 * eff)).max(bytes / (g.hbm_gbps * 1e9)) + round
    }

    fn attention(&self, a: &crate::model::spec::AttnSpec, b: usize, t: usize, bwd: bool) -> f64 {
        let flops = 4.0 * (a.d * a.h) as f64 * (b * a.pairs(t)) as f64;
        let flops = if bwd { 2.5 * flops } else { flops };
        flops / (self.0.bf16_tflops * 1e12 * attention_efficiency_at(self.0, a.d))
    }

    fn stream(&self, bytes: f64) -> f64 {
        bytes / (self.0.hbm_gbps * 1e9 * self.0.stream_efficiency)
    }

    fn launch(&self) -> f64 {
        self.0.launch_us * 1e-6
    }

    fn on_host(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention of the same FLOPs costs the profile's rate where the tensor-core kernels take
    /// the head dim (D = 128) and the fp32 kernels' where they do not: D = 256 (Gemma) runs one
    /// warp per row, D = 100 the tiled kernels.
    #[test]
    fn attention_is_priced_by_the_kernels_that_take_its_head_dim() {
        let gpu = Hardware::built_in("h200-pcie5").unwrap().gpu;
        let spec = |h, d| crate::model::spec::AttnSpec { h, kvh: h, d, window: 0, scale: 1.0 };
        let s = |h, d| Roofline(&gpu).attention(&spec(h, d), 2, 512, false);
        let (tc, rows, tiled) = (s(8, 128), s(4, 256), s(8, 100));
        let ratio = |x: f64| x / tc;
        assert!((ratio(rows) - gpu.attention_efficiency / 0.004).abs() < 1e-9, "{rows} vs {tc}");
        let tiled_ratio = gpu.attention_efficiency / 0.012 * 100.0 / 128.0;
        assert!((ratio(tiled) - tiled_ratio).abs() < 1e-9, "{tiled} vs {tc}");
        assert!(
            tensor_core_head_dim(64) && !tensor_core_head_dim(72) && !tensor_core_head_dim(256)
        );
        // A FlashAttention-class profile takes every head dim at its rate.
        let flash = Gpu { attention_efficiency: FLASH_ATTENTION_EFFICIENCY, ..gpu.clone() };
        let f = |h, d| Roofline(&flash).attention(&spec(h, d), 2, 512, false);
        assert!((f(4, 256) / f(8, 128) - 1.0).abs() < 1e-9, "{} vs {}", f(4, 256), f(8, 128));
    }

    #[test]
    fn built_in_profiles_resolve_and_check() {
        for (name, _) in BUILT_IN {
            if name == "this-cpu" {
                continue;
            }
            let hw = Hardware::built_in(name).unwrap();
            hw.check().unwrap();
        }
        assert!(Hardware::built_in("nope").is_none());
    }

    #[test]
    fn a_yaml_profile_reads_and_bad_fields_are_named() {
        let dir = std::env::temp_dir().join(format!("horizon-hw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("box.yaml");
        std::fs::write(
            &p,
            "name: box\ngpu: {bf16_tflops: 100, hbm_gbps: 1000, memory_gib: 24}\nlink: {h2d_gbps: 12, d2h_gbps: 12}\nhost: {cores: 8, mem_gbps: 50, memory_gib: 64}\n",
        )
        .unwrap();
        let hw = Hardware::from_file(&p).unwrap();
        assert_eq!(hw.gpu.gemm_efficiency, 0.8);
        assert_eq!(hw.host.rates, HostRates::default());
        std::fs::write(&p, "name: box\ngpu: {bf16_tflops: -1, hbm_gbps: 1000, memory_gib: 24}\nlink: {h2d_gbps: 12, d2h_gbps: 12}\nhost: {cores: 8, mem_gbps: 50, memory_gib: 64}\n").unwrap();
        let e = format!("{:#}", Hardware::from_file(&p).unwrap_err());
        assert!(e.contains("gpu.bf16_tflops") && e.contains("box.yaml"), "{e}");
        std::fs::write(&p, "name: box\ngpu: {tflops: 1}\n").unwrap();
        let e = format!("{:#}", Hardware::from_file(&p).unwrap_err());
        assert!(e.contains("box.yaml") && e.contains("hint"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_roofline_is_compute_bound_for_big_products_and_memory_bound_for_skinny_ones() {
        let hw = Hardware::built_in("h200-pcie5").unwrap();
        let r = Roofline(&hw.gpu);
        // 16K x 3584 x 3584: about 0.65 of the peak (the input rounded to bf16 first).
        let (m, k, n) = (16384, 3584, 3584);
        let t = r.gemm(m, k, n);
        let frac = 2.0 * (m * k * n) as f64 / t / 989e12;
        assert!(frac > 0.6 && frac < 0.8, "{frac}");
        // A rank-16 adapter product is nowhere near the peak.
        let t = r.gemm(16384, 3584, 16);
        let frac = 2.0 * (16384 * 3584 * 16) as f64 / t / 989e12;
        assert!(frac < 0.1, "{frac}");
    }
}
