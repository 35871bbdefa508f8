//! The CUDA backend's configuration and error types; shared by the real backend and the stub
//! that stands in for it when the `cuda` feature is off.

/// Precision of the matrix products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPrecision {
    /// bf16 tensor cores with fp32 accumulation (`CUBLAS_COMPUTE_32F_FAST_16BF`): inputs are
    /// rounded to bf16 inside cuBLAS, outputs and accumulators are fp32. The training default.
    Bf16,
    /// Plain fp32 (`CUBLAS_COMPUTE_32F`, no TF32): for parity tests against the CPU backend.
    Fp32,
}

/// How weights cross the host -> device link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireFormat {
    /// Rounded to bf16 on the host (round to nearest even), expanded to fp32 on arrival: half
    /// the link bytes; the device sees bf16-exact weights.
    Bf16,
    /// fp32, exact.
    F32,
}

/// How a [`CudaDevice`] is built.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CudaDeviceConfig {
    /// GPU ordinal.
    pub ordinal: usize,
    /// Pool capacity in bytes (device.memory); allocated once, at construction.
    pub capacity_bytes: usize,
    pub matmul: MatmulPrecision,
    pub weights_wire: WireFormat,
    /// Largest random delay (microseconds) before each copy is enqueued on the H2D and D2H
    /// streams; 0 = none. For race stress tests.
    pub copy_jitter_us: u64,
    pub jitter_seed: u64,
}

impl CudaDeviceConfig {
    /// GPU 0, a pool of `capacity_bytes`, bf16 matmuls and bf16 weights on the wire.
    pub fn with_capacity(capacity_bytes: usize) -> Self {
        CudaDeviceConfig {
            ordinal: 0,
            capacity_bytes,
            matmul: MatmulPrecision::Bf16,
            weights_wire: WireFormat::Bf16,
            copy_jitter_us: 0,
            jitter_seed: 0,
        }
    }
}

/// Why the CUDA backend could not start (or a driver call failed): a message naming the step
/// that failed, with a hint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaError(pub String);

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CudaError {}
