//! The CUDA backend (feature `cuda`): [`CudaBackend`] runs every op of the [`crate::Backend`]
//! trait on an NVIDIA GPU, [`CudaDevice`] implements the streaming engine's [`crate::Device`]
//! with one device pool, three streams and page-locked staging memory.
//!
//! Nothing is linked at build time (cudarc's dynamic loading): [`probe`] looks for `libcuda`,
//! `libnvrtc` and `libcublas` first, because cudarc panics when a library it needs is missing.
//! The kernels are `.cu` sources embedded in the binary ([`kernels::SOURCES`], one per op) and
//! compiled once at start by NVRTC for the device's architecture. Weights live on the device as
//! bf16 ([`crate::Precision::Bf16`]); products take bf16 inputs with fp32 accumulation.
//!
//! Layout, one op per file as in `cpu/`: `embedding.rs`, `rmsnorm.rs`, `head_rmsnorm.rs`,
//! `matmul.rs` (cuBLAS), `rope.rs`, `attention.rs`, `attention_decode.rs` (a KV cache's new
//! rows), `attention_sink.rs` (gpt-oss's learned sinks), `glu.rs` (swiglu and geglu), `moe.rs` (mixture-of-experts routing and dispatch),
//! `gate.rs` (the shared expert's sigmoid gate), `residual.rs`, `cross_entropy.rs`,
//! `convert.rs`, `grad_norm.rs` launch `kernels/<op>.cu`; `backend.rs` is the trait impl,
//! `device.rs` the device, `slice.rs` the device views, `pinned.rs` the staging memory,
//! `probe.rs` the library checks.

mod attention;
mod attention_decode;
mod attention_sink;
mod backend;
mod cols;
mod config;
pub mod convert;
mod cross_entropy;
mod device;
mod embedding;
mod gate;
mod glu;
mod grad_norm;
mod head_rmsnorm;
pub mod kernels;
mod matmul;
mod moe;
mod nf4;
mod pinned;
pub mod probe;
mod residual;
mod rmsnorm;
mod rope;
mod slice;

pub use backend::{CudaBackend, CudaMem};
pub use config::{
    AttentionKernels, CudaDeviceConfig, CudaError, KernelShape, MAX_HEAD_DIM, WIRE_CHUNK,
    WIRE_RING_BYTES, check_kernel_limits,
};
pub use device::CudaDevice;
pub use pinned::{Pinned, PinnedTally};
pub use probe::probe;
pub use slice::DevSlice;

/// Whether this binary was built with the CUDA backend.
pub const BUILT_WITH_CUDA: bool = true;

impl CudaError {
    pub(crate) fn driver(what: &str, e: cudarc::driver::DriverError) -> Self {
        CudaError(format!("CUDA driver: {what}: {e:?}"))
    }
}

/// A driver call that failed inside a device queue's work: unwound (without the panic hook's
/// message) to the queue's dispatcher, which keeps it as the device's failure.
pub(crate) struct DeviceFault(pub(crate) String);

thread_local! {
    /// True on the device's queue threads, where a failed driver call is a [`DeviceFault`].
    static ON_DEVICE_QUEUE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as one of the device's queue threads.
pub(crate) fn mark_device_queue_thread() {
    ON_DEVICE_QUEUE.with(|q| q.set(true));
}

/// The value of a driver call, or (on failure) an unwind naming the call: on a device queue
/// thread a [`DeviceFault`] that becomes [`crate::Device::failure`], a run's error; elsewhere
/// (a standalone backend, in tests and tools) a panic with the same message.
#[track_caller]
pub(crate) fn check<T, E: std::fmt::Debug>(what: &str, r: Result<T, E>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => {
            let msg = format!("CUDA: {what} failed: {e:?}");
            if ON_DEVICE_QUEUE.with(|q| q.get()) {
                std::panic::resume_unwind(Box::new(DeviceFault(msg)))
            }
            panic!("{msg}")
        }
    }
}
