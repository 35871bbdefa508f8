//! The CUDA backend's configuration and error types; shared by the real backend and the stub
//! that stands in for it when the `cuda` feature is off.

/// Elements per bf16 chunk of a weight upload (16 MiB of bf16): the H2D stream rounds the fp32
/// masters into a page-locked ring of two such chunks, two chunks in flight.
pub const WIRE_CHUNK: usize = 8 << 20;

/// Bytes of page-locked host memory a [`CudaDevice`] holds of its own, besides the staging
/// buffers it is asked for: the bf16 weight upload ring, two chunks of [`WIRE_CHUNK`] bf16,
/// pinned while the device is built. The memory plan counts it (the same whether or not this
/// binary was built with CUDA).
pub const WIRE_RING_BYTES: usize = 2 * WIRE_CHUNK * size_of::<crate::Bf16>();

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
    /// Which kernels attention runs on where the head dim allows either (`device.attention`).
    pub attention: AttentionKernels,
}

impl CudaDeviceConfig {
    /// GPU 0, a pool of `capacity_bytes`, no jitter.
    pub fn with_capacity(capacity_bytes: usize) -> Self {
        CudaDeviceConfig {
            ordinal: 0,
            capacity_bytes,
            copy_jitter_us: 0,
            jitter_seed: 0,
            attention: AttentionKernels::Tensor,
        }
    }
}

/// Which kernels compute attention where the shape allows either (`cuda/attention.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernels {
    /// bf16 operands on the tensor cores, fp32 accumulation, the fastest set the device runs:
    /// `kernels/attention_mma.cu` (mma.sync, softmax in registers), else
    /// `kernels/attention_tc.cu` (wmma) where the former's shared memory does not fit. The
    /// default where the device has tensor cores (sm_80 and later) and D is a multiple of 16 up
    /// to 128.
    Tensor,
    /// The wmma kernels (`kernels/attention_tc.cu`) where [`AttentionKernels::Tensor`] would run
    /// the mma.sync ones: for timing the two sets side by side (`examples/cuda_op_speed`).
    Wmma,
    /// fp32 on the CUDA cores (`kernels/attention.cu`): the reference's arithmetic.
    Fp32,
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

/// Largest head dim the attention kernels hold (`kernels/attention.cu`: MAXU = 8 output dims
/// per lane, 32 lanes).
pub const MAX_HEAD_DIM: usize = 256;
/// Largest grid y and z dimension (attention's grid is (T/8, H, B)).
const MAX_GRID_YZ: usize = 65_535;

/// The sizes of a model and a micro-batch that the CUDA kernels see.
#[derive(Clone, Copy, Debug)]
pub struct KernelShape {
    /// Hidden C, query heads H, kv heads KVH, head dim D, FFN F, vocabulary V.
    pub c: usize,
    pub h: usize,
    pub kvh: usize,
    pub d: usize,
    pub f: usize,
    pub v: usize,
    /// Sequences per micro-batch B and the longest sequence T.
    pub b: usize,
    pub t: usize,
}

/// Refuses, before any device work, a model or batch beyond what the CUDA kernels hold (a
/// launch would otherwise fail mid-run): names the limit, the value and the key to change.
///
/// The head dim limit is attention's; `head_rmsnorm` (a warp per head, lanes striding over D;
/// grid (N, (H + 2 KVH) / 8)) and `geglu` need nothing beyond the checks here, and a sliding
/// window needs none (one of at least T is passed to the kernels as 0, full causal). The
/// cross-entropy kernels, fused and over vocabulary tiles, take a block per row (grid x = the
/// rows of a head chunk, at most the tokens per micro-batch) and ids below `vocab_size`
/// (`v0 + VT <= V`): both are in the int range checked below.
pub fn check_kernel_limits(s: &KernelShape) -> Result<(), CudaError> {
    let fail =
        |msg: String| Err(CudaError(format!("the CUDA kernels cannot run this model: {msg}")));
    if s.d == 0 || s.d > MAX_HEAD_DIM {
        return fail(format!(
            "head_dim {} is outside 1..={MAX_HEAD_DIM}, the most the attention kernel holds \
             (kernels/attention.cu: 8 output dims per lane x 32 lanes)\nhint: use \
             device.backend = cpu for this model",
            s.d
        ));
    }
    if s.kvh == 0 || !s.h.is_multiple_of(s.kvh) {
        return fail(format!(
            "num_attention_heads {} is not a multiple of num_key_value_heads {}",
            s.h, s.kvh
        ));
    }
    if s.h > MAX_GRID_YZ || s.b > MAX_GRID_YZ {
        return fail(format!(
            "the attention grid's y (heads, {}) and z (sequences per micro-batch, {}) must be at \
             most {MAX_GRID_YZ}\nhint: lower train.micro_batch_size",
            s.h, s.b
        ));
    }
    let n = s.b.saturating_mul(s.t);
    let ints = [
        ("tokens per micro-batch (micro_batch_size x max_seq_len)", n),
        ("hidden_size", s.c),
        ("2 x intermediate_size", s.f.saturating_mul(2)),
        ("vocab_size", s.v),
        ("the qkv row ((H + 2 KVH) x D)", (s.h + 2 * s.kvh).saturating_mul(s.d)),
    ];
    for (what, x) in ints {
        if x > i32::MAX as usize {
            return fail(format!(
                "{what} = {x} exceeds the kernels' int range ({})\nhint: lower \
                 train.micro_batch_size or train.max_seq_len",
                i32::MAX
            ));
        }
    }
    Ok(())
}
