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
//! Layout, one op per file as in `cpu/`: `embedding.rs`, `rmsnorm.rs`, `matmul.rs` (cuBLAS),
//! `rope.rs`, `attention.rs`, `swiglu.rs`, `residual.rs`, `cross_entropy.rs`, `convert.rs`,
//! `grad_norm.rs` launch `kernels/<op>.cu`; `backend.rs` is the trait impl, `device.rs` the
//! device, `slice.rs` the device views, `pinned.rs` the staging memory, `probe.rs` the library
//! checks.

mod attention;
mod backend;
mod config;
pub mod convert;
mod cross_entropy;
mod device;
mod embedding;
mod grad_norm;
pub mod kernels;
mod matmul;
mod pinned;
pub mod probe;
mod residual;
mod rmsnorm;
mod rope;
mod slice;
mod swiglu;

pub use backend::{CudaBackend, CudaMem};
pub use config::{CudaDeviceConfig, CudaError};
pub use device::CudaDevice;
pub use pinned::Pinned;
pub use probe::probe;
pub use slice::DevSlice;

/// Whether this binary was built with the CUDA backend.
pub const BUILT_WITH_CUDA: bool = true;

impl CudaError {
    pub(crate) fn driver(what: &str, e: cudarc::driver::DriverError) -> Self {
        CudaError(format!("CUDA driver: {what}: {e:?}"))
    }
}

/// Panics with the failing driver call: for calls that only fail on a bug (bad arguments) or a
/// lost device, inside queued work (the device reports the panic at its next synchronize).
#[track_caller]
pub(crate) fn check<T, E: std::fmt::Debug>(what: &str, r: Result<T, E>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("CUDA: {what} failed: {e:?}"),
    }
}
