//! The engine's options: what a run chooses about recomputation, the gradient wire format, the
//! weight uploads, the compute device and the threads of its host work. The engine owns these types;
//! the YAML config (`config.rs`) parses into them and re-exports them, so the engine depends on
//! no config code.

use horizon_backend::Precision;
use serde::{Deserialize, Serialize};

use crate::optim::adamw::AdamWConfig;
use crate::optim::decay::NoDecay;
use crate::optim::state::OptimizerMemory;

/// `engine.recompute`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep the internals when the plan fits with them, else recompute.
    #[default]
    Auto,
    /// Recompute every layer's internals (and each block's inputs) in the backward.
    Always,
    /// Keep every layer's internals from the forward to its backward.
    Never,
}

/// `engine.grad_wire`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GradWire {
    /// fp32, exact.
    #[default]
    Fp32,
    /// bf16 (round to nearest even on the device), accumulated in fp32 on the host.
    Bf16,
}

/// `engine.weight_upload`: how a bf16 device gets a layer's trained weights from the fp32
/// masters (the CPU device always copies fp32).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum WeightUpload {
    /// `image` when the host has room for it (2 bytes per trained parameter), else `round`.
    #[default]
    Auto,
    /// A page-locked bf16 image of the masters, written in the optimizer's pass over them: an
    /// upload is a pure copy.
    Image,
    /// No image: each upload rounds the masters to bf16 on the host, chunk by chunk.
    Round,
    /// No image: the host queue rounds each upload's masters into one of two page-locked bf16
    /// buffers (one per weight slot) ahead of the link, as an op of the plan; the upload is a
    /// pure copy. 2 bytes per parameter of the two largest uploads instead of the image's 2 per
    /// trained parameter. The host queue runs its ops in order, so a stage can wait behind the
    /// optimizer's work (`horizon plan --hardware` shows when): `auto` does not choose it.
    Staged,
}

/// [`WeightUpload`] resolved for the engine: where a bf16 upload's trained weights come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightPath {
    /// The fp32 masters, rounded inside each upload on a bf16 device (copied as they are on the
    /// CPU device).
    #[default]
    Masters,
    /// The page-locked bf16 image the optimizer writes (`WeightUpload::Image`).
    Image,
    /// The page-locked stage of the upload's slot, rounded by a host-queue op of the plan
    /// (`WeightUpload::Staged`).
    Staged,
}

impl WeightPath {
    /// The path's name, as `summary.json` gives it.
    pub fn name(self) -> &'static str {
        match self {
            WeightPath::Masters => "masters",
            WeightPath::Image => "image",
            WeightPath::Staged => "staged",
        }
    }
}

/// The compute device.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The CPU backend: device memory is a pool in host RAM, queues are worker threads; fp32
    /// weights (the reference).
    #[default]
    Cpu,
    /// NVIDIA GPUs (`--features cuda`): bf16 weights on the device, bf16 products with fp32
    /// accumulation.
    Cuda,
}

impl BackendKind {
    /// The backend's precision (its `Backend::PRECISION`; the same whether or not this binary
    /// was built with CUDA, so a plan reads the same everywhere).
    pub fn precision(self) -> horizon_backend::Precision {
        use horizon_backend::Backend;
        match self {
            BackendKind::Cpu => horizon_backend::CpuBackend::PRECISION,
            BackendKind::Cuda => horizon_backend::cuda::CudaBackend::PRECISION,
        }
    }

    /// Whether the device pool lives in host RAM (the CPU backend), counting towards the host.
    pub fn pool_in_host_ram(self) -> bool {
        self == BackendKind::Cpu
    }

    /// Whether the device's staging buffers (`Device::alloc_staging`) are page-locked: on CUDA
    /// they are; the CPU device's are ordinary memory.
    pub fn pins_staging(self) -> bool {
        self == BackendKind::Cuda
    }

    /// Bytes of page-locked host memory the device pins of its own, besides the staging it is
    /// asked for: the CUDA device's bf16 weight upload ring (`cuda::WIRE_RING_BYTES`, the same
    /// whether or not this binary was built with CUDA); none on the CPU.
    pub fn device_pinned_bytes(self) -> usize {
        match self {
            BackendKind::Cpu => 0,
            BackendKind::Cuda => horizon_backend::cuda::WIRE_RING_BYTES,
        }
    }

    /// Threads the device's queues keep busy, which `engine.host_threads: auto` leaves to them:
    /// on CUDA one core for the dispatch threads (they mostly wait on the driver); on the CPU
    /// backend the compute kernels run on rayon's global pool over every core at the same time
    /// as the host work, so they get half the cores (rounded up).
    pub fn queue_threads(self, cores: usize) -> usize {
        match self {
            BackendKind::Cpu => cores.div_ceil(2),
            BackendKind::Cuda => 1,
        }
    }
}

/// `engine.host_threads`: the threads of the engine's host work (the optimizer updates,
/// gradient accumulation, norms: the host queue), a dedicated pool built once per engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostThreads {
    /// The cores the device's queues do not use ([`BackendKind::queue_threads`]), at least 1.
    #[default]
    Auto,
    /// Exactly this many (at least 1: the config refuses 0).
    Count(usize),
}

impl HostThreads {
    /// The thread count on `backend`, on a machine of `std::thread::available_parallelism`
    /// cores (which counts the cores the process may run on: a `numactl --cpunodebind` or
    /// `taskset` mask narrows it).
    pub fn resolve(self, backend: BackendKind) -> usize {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.resolve_for(backend, cores)
    }

    /// [`HostThreads::resolve`] on a machine of `cores` cores.
    pub fn resolve_for(self, backend: BackendKind, cores: usize) -> usize {
        match self {
            HostThreads::Count(n) => n.max(1),
            HostThreads::Auto => cores.saturating_sub(backend.queue_threads(cores)).max(1),
        }
    }

    /// The count as written (`None`: `auto`).
    pub fn count(self) -> Option<usize> {
        match self {
            HostThreads::Auto => None,
            HostThreads::Count(n) => Some(n),
        }
    }
}

/// As written in a config: `auto`, or the count.
impl std::fmt::Display for HostThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostThreads::Auto => f.write_str("auto"),
            HostThreads::Count(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for HostThreads {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            HostThreads::Auto => s.serialize_str("auto"),
            HostThreads::Count(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for HostThreads {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            I(i64),
            F(f64),
            S(String),
        }
        let bad = |what: &str| {
            serde::de::Error::custom(format!(
                "engine.host_threads: {what} is not a thread count (a whole number of at least \
                 1, or auto)"
            ))
        };
        match Raw::deserialize(d).map_err(|_| bad("this value"))? {
            Raw::N(n) => {
                usize::try_from(n).map(HostThreads::Count).map_err(|_| bad(&n.to_string()))
            }
            Raw::I(n) => Err(bad(&n.to_string())),
            Raw::F(x) => Err(bad(&x.to_string())),
            Raw::S(s) if s.trim().eq_ignore_ascii_case("auto") => Ok(HostThreads::Auto),
            Raw::S(s) => match s.trim().parse::<usize>() {
                Ok(n) => Ok(HostThreads::Count(n)),
                Err(_) => Err(bad(&format!("'{s}'"))),
            },
        }
    }
}

/// How the engine runs a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineConfig {
    /// Rows per optimizer step.
    pub batch_size: usize,
    /// Rows per micro-batch (`batch_size` when not splitting).
    pub micro_batch_size: usize,
    /// Longest row.
    pub seq_len: usize,
    /// A host checkpoint every K layers.
    pub checkpoint_every: usize,
    /// Host gradient slabs.
    pub grad_slabs: usize,
    /// Rows per LM-head chunk.
    pub head_chunk_rows: usize,
    /// `engine.head_tile_rows`: vocabulary rows per LM-head tile, at most what fits in a weight
    /// slot ([`HeadTiling::new`](crate::engine::head_tiles::HeadTiling::new)); `None`: as many as fit.
    pub head_tile_rows: Option<usize>,
    /// `engine.expert_chunk` resolved: a sparse layer with frozen experts is held as its trunk
    /// in a weight slot and its experts in chunks of this many, streamed through two slots of
    /// their own ([`crate::engine::chunking`]); `None`: whole layers.
    pub expert_chunk: Option<usize>,
    /// AdamW and clipping (the learning rate comes with each step, from the schedule).
    pub adamw: AdamWConfig,
    /// `optimizer.no_decay`: which trained tensors take no weight decay.
    pub no_decay: NoDecay,
    pub grad_clip: f64,
    /// Layers whose forward internals stay on the device for their backward instead of being
    /// recomputed (`engine.recompute` resolved: 0 recomputes all, the model's depth none),
    /// spread evenly over the depth (`plan::keeps_internals`); non-zero needs
    /// `checkpoint_every == 1`.
    pub kept_layers: usize,
    /// `optimizer.memory`: exact, lean or compact.
    pub memory: OptimizerMemory,
    /// `device.backend`: its precision (`Backend::PRECISION`) sets the format of the weight
    /// slots and the workspace its products need. Must match the device the engine runs on.
    pub backend: BackendKind,
    /// `engine.grad_wire`: the format layer gradients cross the link in.
    pub grad_wire: GradWire,
    /// `engine.weight_upload` resolved (bf16 backends only; the CPU device copies the masters):
    /// upload from the masters, from a page-locked bf16 image of every uploaded trained buffer
    /// written by the optimizer, or from the stage of the slot, rounded by a host-queue op.
    pub weights: WeightPath,
    /// `engine.host_threads`: the threads of the host queue's work (its own pool, built once).
    pub host_threads: HostThreads,
    /// `engine.pin_threads`: the host pool's threads each pinned to one of the last CPUs.
    pub pin_threads: bool,
    /// Keep a page-locked bf16 copy of the weights the engine starts from, which a reference
    /// pass uploads instead of the masters (DPO's `dpo.reference: live`).
    pub reference_copy: bool,
}

impl EngineConfig {
    pub fn micro_batches(&self) -> usize {
        self.batch_size.div_ceil(self.micro_batch_size)
    }
    /// The weight path the engine takes: `weights` on a bf16 backend; the CPU device copies
    /// the fp32 masters whatever the path.
    pub fn weight_path(&self) -> WeightPath {
        match self.backend.precision() {
            Precision::Bf16 => self.weights,
            _ => WeightPath::Masters,
        }
    }
}

#[cfg(test)]
impl EngineConfig {
    /// A small configuration for unit tests on `backend`: steps of 2 rows in micro-batches of 1,
    /// rows of 16 positions, a checkpoint every 2 layers, clipping at 1.
    pub(crate) fn small(backend: BackendKind) -> Self {
        EngineConfig {
            batch_size: 2,
            micro_batch_size: 1,
            seq_len: 16,
            checkpoint_every: 2,
            grad_slabs: 2,
            head_chunk_rows: 64,
            head_tile_rows: None,
            expert_chunk: None,
            adamw: AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
            no_decay: NoDecay::None,
            grad_clip: 1.0,
            kept_layers: 0,
            memory: Default::default(),
            backend,
            grad_wire: Default::default(),
            weights: WeightPath::Masters,
            host_threads: Default::default(),
            pin_threads: true,
            reference_copy: false,
        }
    }
}
