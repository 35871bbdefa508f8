//! The CUDA backend's configuration and error types; shared by the real backend and the stub
//! that stands in for it when the `cuda` feature is off.

/// How a [`CudaDevice`] is built.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CudaDeviceConfig {
    /// GPU ordinal.
    pub ordinal: usize,
    /// Pool capacity in bytes (device.memory); allocated once, at construction.
    pub capacity_bytes: usize,
    /// Largest random delay (microseconds) before each copy is enqueued on the H2D and D2H
    /// streams; 0 = none. For race stress tests.
    pub copy_jitter_us: u64,
    pub jitter_seed: u64,
}

impl CudaDeviceConfig {
    /// GPU 0, a pool of `capacity_bytes`, no jitter.
    pub fn with_capacity(capacity_bytes: usize) -> Self {
        CudaDeviceConfig { ordinal: 0, capacity_bytes, copy_jitter_us: 0, jitter_seed: 0 }
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
