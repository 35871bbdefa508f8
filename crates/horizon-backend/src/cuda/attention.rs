//! Launchers of `kernels/attention.cu`: causal GQA attention within an optional sliding
//! window, with the scores' scale an argument, flash style (the (T x T) scores never exist in
//! global memory), forward and backward (the rows' `delta = dout . out`, then dq, then dk and
//! dv). Derivation: `cpu/attention.rs`.
//!
//! Four kernel sets compute the same function:
//! - on the tensor cores, FlashAttention-2 style (`kernels/attention_mma.cu`: mma.sync with
//!   scores, probabilities and accumulators in registers; bf16 operands, fp32 accumulation, as
//!   the backend's products), where the device has bf16 tensor cores (sm_80 and later), D is a
//!   multiple of 16 up to 128, the buffers are 16-byte aligned (the engine's always are) and
//!   [`CudaBackend::set_attention_kernels`] asked for neither fp32 nor wmma: the default for
//!   every family but Gemma (D = 256);
//! - on the tensor cores through wmma (`kernels/attention_tc.cu`: the same precision, scores
//!   and probabilities in shared memory), on the same conditions, where asked for
//!   ([`AttentionKernels::Wmma`], to time the two sets side by side);
//! - in fp32, tiled (64-row blocks, 4 x 4 register tiles, as an SGEMM) where D is a multiple of
//!   4 up to 128 and the buffers are 16-byte aligned;
//! - in fp32, one warp per row, otherwise (any D up to 256, any alignment).
//!
//! Each pass (forward, dq, dk/dv) takes the fastest of these whose shared memory fits the
//! device's limit a block (`choose`).
//!
//! On an H200 the warp-per-row kernels ran a Qwen2.5-7B layer's attention at 4.2 TFLOP/s forward
//! and 3.3 backward, 92% of the layer's time (`examples/cuda_op_speed`, which times every set).
//! Neither tensor-core set has run on a GPU yet.

use super::CudaBackend;
use super::backend::{arg, expect_len, int};
use super::config::{AttentionKernels, MAX_HEAD_DIM};
use super::convert::round_on_device;
use super::slice::DevSlice;
use crate::precision::attention_parts;
use crate::{AttnDims, Bf16, Precision};

/// Rows (warps) per block and rows per shared tile; must match the kernel's ROWS and TILE.
pub(super) const ROWS: usize = 8;
pub(super) const TILE: usize = 32;

pub(super) fn check_dims(op: &str, dims: AttnDims) {
    assert!(
        dims.d > 0 && dims.d <= MAX_HEAD_DIM,
        "{op}: head dim D = {} is outside 1..={MAX_HEAD_DIM}, which the CUDA kernels support",
        dims.d
    );
    assert!(
        dims.kvh > 0 && dims.h.is_multiple_of(dims.kvh),
        "{op}: H = {} is not a multiple of KVH = {}",
        dims.h,
        dims.kvh
    );
}

/// The kernels' `window` and `scale` arguments. A window of at least T hides no key: it is
/// passed as 0 (full causal), which also keeps any `usize` window inside the kernels' int.
pub(super) fn window_scale(dims: AttnDims) -> (i32, f32) {
    let w = if dims.window >= dims.t { 0 } else { dims.window };
    (int(w, "window"), dims.scale)
}

/// Dynamic shared memory of a kernel, `bytes`, allowed above 48 KiB where needed.
pub(super) fn shared(be: &CudaBackend, name: &str, bytes: usize) -> u32 {
    let bytes = bytes as u32;
    if bytes > 48 * 1024 {
        be.allow_shared(name, bytes);
    }
    bytes
}

/// Query rows per block of the tiled forward (its FQ; its key tiles, FK, are as long).
pub(super) const TILED_ROWS: usize = 64;
/// The largest head dim the tiled forward takes (its threads hold 8 output columns each).
pub(super) const TILED_MAX_D: usize = 128;
/// Rows of the mma.sync backward's walked tiles; must match `attention_mma.cu`'s MMA_DQ_KT and
/// MMA_QT.
const MMA_TILE: usize = 32;

/// The kernel sets of `attention_mma.cu`, `attention_tc.cu` and `attention.cu`, fastest first.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Set {
    /// `*_mma`: mma.sync on bf16 tensor cores, FlashAttention-2 style.
    Mma,
    /// `*_tc`: wmma on bf16 tensor cores.
    Wmma,
    /// `*_tiled`: fp32 register tiles.
    Tiled,
    /// The warp-per-row kernels.
    Rows,
}

/// A kernel of attention: the forward, the backward's dq, or its dk and dv.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pass {
    Forward,
    Dq,
    Dkv,
}

/// One kernel to launch: its set, name, rows a block, threads a block, dynamic shared bytes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Launch {
    set: Set,
    name: &'static str,
    rows: usize,
    threads: u32,
    smem: usize,
}

impl Set {
    /// This set's kernel for `pass` at head dim `d`, with its shared memory (the layouts in
    /// the kernels' files).
    fn launch(self, pass: Pass, d: usize) -> Launch {
        let pick = |names: [&'static str; 3]| names[pass as usize];
        match self {
            // bf16 tiles of (D + 8) columns, double-buffered where a block walks them: the
            // forward's key and value tiles of 64 rows; dq's block of queries and dout (64
            // rows each) and key and value tiles of 32; dk/dv's block of keys and values and
            // query and dout tiles of 32, with the query tile's lse and delta. Scores and
            // accumulators are in registers.
            Set::Mma => {
                let (tile, half) = (TILED_ROWS * (d + 8) * 2, MMA_TILE * (d + 8) * 2);
                let smem = match pass {
                    Pass::Forward => 4 * tile,
                    Pass::Dq => 2 * tile + 4 * half,
                    Pass::Dkv => 2 * tile + 4 * half + 4 * MMA_TILE * 4,
                };
                let name = pick([
                    "attention_forward_mma",
                    "attention_backward_dq_mma",
                    "attention_backward_dkv_mma",
                ]);
                Launch { set: self, name, rows: TILED_ROWS, threads: 128, smem }
            }
            // bf16 tiles of 64 x (D + 8), fp32 score tiles of 64 x 68, bf16 P and dS tiles of
            // 64 x 72, fp32 accumulators of 64 x (D + 4), 64-float statistics.
            Set::Wmma => {
                let r = TILED_ROWS;
                let (tile, scores, probs, acc) =
                    (r * (d + 8) * 2, r * 68 * 4, r * 72 * 2, r * (d + 4) * 4);
                let smem = match pass {
                    Pass::Forward => 2 * tile + scores + acc + probs,
                    Pass::Dq => 2 * tile + 2 * scores + probs,
                    Pass::Dkv => 4 * tile + scores + 2 * acc + 2 * r * 4 + probs,
                };
                let name = pick([
                    "attention_forward_tc",
                    "attention_backward_dq_tc",
                    "attention_backward_dkv_tc",
                ]);
                Launch { set: self, name, rows: r, threads: 128, smem }
            }
            Set::Tiled => {
                let (tile, stats) = (TILED_ROWS * d, TILED_ROWS * TILED_ROWS + 2 * TILED_ROWS);
                let floats = match pass {
                    Pass::Forward => 3 * tile + TILED_ROWS * TILED_ROWS,
                    Pass::Dq => 5 * tile + stats,
                    Pass::Dkv => 6 * tile + stats,
                };
                let name = pick([
                    "attention_forward_tiled",
                    "attention_backward_dq_tiled",
                    "attention_backward_dkv_tiled",
                ]);
                Launch { set: self, name, rows: TILED_ROWS, threads: 256, smem: 4 * floats }
            }
            Set::Rows => {
                let tiles = 2 * TILE * (d + 1);
                let floats = match pass {
                    Pass::Forward => tiles + ROWS * d,
                    Pass::Dq => tiles + 2 * ROWS * d,
                    Pass::Dkv => tiles + 2 * ROWS * d + 2 * TILE,
                };
                let name =
                    pick(["attention_forward", "attention_backward_dq", "attention_backward_dkv"]);
                Launch { set: self, name, rows: ROWS, threads: 32 * ROWS as u32, smem: 4 * floats }
            }
        }
    }
}

/// The kernel that runs `pass` at head dim `d`: the fastest set that takes it and whose
/// shared memory fits `max_shared` bytes a block (the device's opt-in limit: 227 KiB on
/// sm_90, 163 on sm_80, 99 on sm_86 and sm_89). The tensor-core kernels take D a multiple of 16
/// up to [`TILED_MAX_D`] where `kernels` is not fp32 (the mma.sync set unless it is wmma); they
/// and the tiled ones need `aligned` buffers (16-byte loads; the engine's are 64-byte aligned).
/// The warp-per-row kernels take any D up to 256, and run when nothing else fits (a launch
/// beyond the limit then fails, naming it). The passes choose apart: on an sm_86 or sm_89 GPU
/// at D = 128 with wmma asked for, the forward and dq run on the tensor cores and dk/dv, whose
/// tiles need 160 KiB, one warp per row.
fn choose(
    pass: Pass,
    d: usize,
    kernels: AttentionKernels,
    aligned: bool,
    max_shared: usize,
) -> Launch {
    let tiled = aligned && d.is_multiple_of(4) && d <= TILED_MAX_D;
    let tensor = tiled && d.is_multiple_of(16);
    [
        (Set::Mma, tensor && kernels == AttentionKernels::Tensor),
        (Set::Wmma, tensor && kernels != AttentionKernels::Fp32),
        (Set::Tiled, tiled),
    ]
    .into_iter()
    .filter(|&(_, takes)| takes)
    .map(|(set, _)| set.launch(pass, d))
    .find(|l| l.smem <= max_shared)
    .unwrap_or_else(|| Set::Rows.launch(pass, d))
}

/// [`choose`] on `be`'s device for buffers at `addrs`.
fn kernel(be: &CudaBackend, pass: Pass, dims: AttnDims, addrs: &[u64]) -> Launch {
    let aligned = addrs.iter().all(|a| a % 16 == 0);
    choose(pass, dims.d, be.attention_kernels(), aligned, be.max_shared())
}

/// out: (N, H*D), overwrites. lse: (B, H, T), overwrites. qkv: (N, QKV) after rope.
pub(crate) fn attention_forward(
    be: &CudaBackend,
    out: &mut DevSlice<f32>,
    lse: &mut DevSlice<f32>,
    qkv: &DevSlice<f32>,
    dims: AttnDims,
) {
    check_dims("attention_forward", dims);
    expect_len("attention_forward", "qkv", qkv.len(), dims.n() * dims.qkv_width());
    expect_len("attention_forward", "out", out.len(), dims.n() * dims.h * dims.d);
    expect_len("attention_forward", "lse", lse.len(), dims.b * dims.h * dims.t);
    let (o, l) = (out.addr(), lse.addr());
    let k = kernel(be, Pass::Forward, dims, &[o, qkv.addr()]);
    let smem = shared(be, k.name, k.smem);
    let (t, h, kvh, d) =
        (int(dims.t, "T"), int(dims.h, "H"), int(dims.kvh, "KVH"), int(dims.d, "D"));
    let (w, scale) = window_scale(dims);
    // The mma.sync kernels read q, k and v as bf16, rounded once into the workspace (held to
    // the end: no product can use it while the kernel reads it).
    let ws = be.products();
    // SAFETY: the workspace lock is held until the kernel is enqueued.
    let x = if k.set == Set::Mma {
        unsafe { rounded(be, &ws, Some(qkv), None, dims).0 }
    } else {
        qkv.addr()
    };
    let mut args =
        [arg(&o), arg(&l), arg(&x), arg(&t), arg(&h), arg(&kvh), arg(&d), arg(&w), arg(&scale)];
    // SAFETY: argument types match every set's forward (pointers, five ints, one float; the
    // mma.sync kernel's qkv is the bf16 copy, of the same length); the grid covers (T/rows, H,
    // B) and every index the kernel forms lies inside the buffers whose lengths are checked
    // above (keys and queries outside the window are never read); 16-byte accesses are aligned
    // (`choose`; the workspace's parts on 256 bytes).
    unsafe {
        be.launch(
            k.name,
            (dims.t.div_ceil(k.rows) as u32, dims.h as u32, dims.b as u32),
            (k.threads, 1, 1),
            smem,
            &mut args,
        );
    }
    drop(ws);
}

/// Attention's share of the workspace `ws` (held locked by the caller) for `dims`: the device
/// addresses of `qkv` and `dout` rounded there to bf16 on the stream (each where given), and of
/// the backward's `delta` (N H fp32); [`attention_parts`]. Panics if the workspace is too small (a
/// bug: the plan sizes it for every attention layer, [`Precision::attention_bytes`]).
///
/// # Safety
/// Use the addresses only in work enqueued on `be`'s stream while `ws` stays locked.
unsafe fn rounded(
    be: &CudaBackend,
    ws: &(u64, usize),
    qkv: Option<&DevSlice<f32>>,
    dout: Option<&DevSlice<f32>>,
    dims: AttnDims,
) -> (u64, u64, u64) {
    let (n, h, kvh, d) = (dims.n(), dims.h, dims.kvh, dims.d);
    let need = Precision::Bf16.attention_bytes(n, h, kvh, d);
    assert!(
        ws.0 != 0 && need <= ws.1,
        "attention over {n} rows needs {need} bytes of workspace (bf16 q, k, v and dout, row \
         sums); the backend has {} (the plan sizes the workspace for every attention layer)",
        ws.1
    );
    let (xr, dyr, deltar) = attention_parts(n, h, kvh, d);
    let at = |r: &std::ops::Range<usize>| ws.0 + r.start as u64;
    // SAFETY (below): the ranges lie inside the workspace (checked above) and are disjoint;
    // the caller holds its lock and keeps their use on the stream.
    for (x, r) in [(qkv, &xr), (dout, &dyr)] {
        if let Some(x) = x {
            // SAFETY: see above.
            round_on_device(be, unsafe { DevSlice::<Bf16>::from_raw_mut(at(r), x.len()) }, x);
        }
    }
    (at(&xr), at(&dyr), at(&deltar))
}

/// dqkv: (N, QKV), overwrites. dout: (N, H*D). qkv, out, lse: as the forward used and made.
pub(crate) fn attention_backward(
    be: &CudaBackend,
    dqkv: &mut DevSlice<f32>,
    dout: &DevSlice<f32>,
    qkv: &DevSlice<f32>,
    out: &DevSlice<f32>,
    lse: &DevSlice<f32>,
    dims: AttnDims,
) {
    check_dims("attention_backward", dims);
    expect_len("attention_backward", "qkv", qkv.len(), dims.n() * dims.qkv_width());
    expect_len("attention_backward", "dqkv", dqkv.len(), dims.n() * dims.qkv_width());
    expect_len("attention_backward", "out", out.len(), dims.n() * dims.h * dims.d);
    expect_len("attention_backward", "dout", dout.len(), dims.n() * dims.h * dims.d);
    expect_len("attention_backward", "lse", lse.len(), dims.b * dims.h * dims.t);
    // delta (B, H, T) = dout . out per row and head, once, and (for the mma.sync kernels) q,
    // k, v and dout in bf16, in the products part of the workspace (held to the end: no
    // product can use it while the kernels read it).
    let ws = be.products();
    let (dx, dy, x, o, l) = (dqkv.addr(), dout.addr(), qkv.addr(), out.addr(), lse.addr());
    let addrs = [dx, dy, x, o];
    let (dq, dkv) = (kernel(be, Pass::Dq, dims, &addrs), kernel(be, Pass::Dkv, dims, &addrs));
    let mma = [dq, dkv].map(|k| k.set == Set::Mma);
    // SAFETY: the workspace lock is held until the kernels are enqueued.
    let any = mma.contains(&true);
    let (x16, dy16, delta) =
        unsafe { rounded(be, &ws, any.then_some(qkv), any.then_some(dout), dims) };
    let (n, t, h, kvh, d) = (
        int(dims.n(), "N"),
        int(dims.t, "T"),
        int(dims.h, "H"),
        int(dims.kvh, "KVH"),
        int(dims.d, "D"),
    );
    let mut delta_args = [arg(&delta), arg(&dy), arg(&o), arg(&n), arg(&t), arg(&h), arg(&d)];
    // SAFETY: argument types match (three pointers, four ints); one warp per (row, head) of
    // dout and out (N, H*D), writing delta (B, H, T), which fits the workspace (checked above).
    unsafe {
        be.launch(
            "attention_delta",
            ((dims.n() * dims.h).div_ceil(ROWS) as u32, 1, 1),
            (32 * ROWS as u32, 1, 1),
            0,
            &mut delta_args,
        );
    }
    let (smem_dq, smem_dkv) = (shared(be, dq.name, dq.smem), shared(be, dkv.name, dkv.smem));
    let (w, scale) = window_scale(dims);
    // The mma.sync kernels take dout and qkv in bf16, the others in fp32.
    let inputs = |mma: bool| if mma { (dy16, x16) } else { (dy, x) };
    let ((dy_q, x_q), (dy_kv, x_kv)) = (inputs(mma[0]), inputs(mma[1]));
    let args = |dy: &u64, x: &u64| {
        [
            arg(&dx),
            arg(dy),
            arg(x),
            arg(&delta),
            arg(&l),
            arg(&t),
            arg(&h),
            arg(&kvh),
            arg(&d),
            arg(&w),
            arg(&scale),
        ]
    };
    // SAFETY: argument types match every set's kernels (pointers, five ints, one float); the dq
    // kernel writes only the q part of each row and the dk/dv kernel only the k and v parts, so
    // together they overwrite dqkv; every index lies inside the buffers whose lengths are
    // checked above.
    unsafe {
        be.launch(
            dq.name,
            (dims.t.div_ceil(dq.rows) as u32, dims.h as u32, dims.b as u32),
            (dq.threads, 1, 1),
            smem_dq,
            &mut args(&dy_q, &x_q),
        );
        be.launch(
            dkv.name,
            (dims.t.div_ceil(dkv.rows) as u32, dims.kvh as u32, dims.b as u32),
            (dkv.threads, 1, 1),
            smem_dkv,
            &mut args(&dy_kv, &x_kv),
        );
    }
    drop(ws);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opt-in shared memory a block: sm_90 (H100, H200), sm_80 (A100), sm_86 and sm_89.
    const SM90: usize = 232_448;
    const SM80: usize = 166_912;
    const SM86: usize = 101_376;

    fn names(d: usize, k: AttentionKernels, aligned: bool, max: usize) -> [&'static str; 3] {
        [Pass::Forward, Pass::Dq, Pass::Dkv].map(|p| choose(p, d, k, aligned, max).name)
    }

    /// Each pass takes the fastest kernel that takes its head dim and fits the device's shared
    /// memory, and every kernel chosen fits (or is the warp-per-row fallback).
    #[test]
    fn each_pass_runs_the_fastest_kernel_that_fits() {
        use AttentionKernels::{Fp32, Tensor, Wmma};
        let mma =
            ["attention_forward_mma", "attention_backward_dq_mma", "attention_backward_dkv_mma"];
        let tc = ["attention_forward_tc", "attention_backward_dq_tc", "attention_backward_dkv_tc"];
        // The mma.sync kernels fit every device's limit at every head dim they take (68, 68
        // and 68.5 KiB at D = 128).
        for max in [SM90, SM80, SM86] {
            for d in [16, 64, 128] {
                assert_eq!(names(d, Tensor, true, max), mma);
            }
        }
        assert_eq!(names(128, Wmma, true, SM90), tc);
        // A100 (163 KiB): every wmma kernel fits at D = 128 (dk/dv: 160 KiB).
        assert_eq!(names(128, Wmma, true, SM80), tc);
        assert_eq!(names(64, Wmma, true, SM80), tc);
        // sm_86 / sm_89 (99 KiB): at D = 128 the wmma forward (93 KiB) and dq (77) fit, dk/dv
        // does not, nor does the tiled one (209); at D = 64 all three fit.
        let sm86 = ["attention_forward_tc", "attention_backward_dq_tc", "attention_backward_dkv"];
        assert_eq!(names(128, Wmma, true, SM86), sm86);
        assert_eq!(names(64, Wmma, true, SM86), tc);
        let rows = ["attention_forward", "attention_backward_dq", "attention_backward_dkv"];
        // fp32 asked for (or no tensor cores); D not a multiple of 16; unaligned; Gemma's 256.
        let tiled = [
            "attention_forward_tiled",
            "attention_backward_dq_tiled",
            "attention_backward_dkv_tiled",
        ];
        assert_eq!(names(128, Fp32, true, SM90), tiled);
        assert_eq!(names(72, Tensor, true, SM90), tiled);
        assert_eq!(names(128, Tensor, false, SM90), rows);
        assert_eq!(names(256, Tensor, true, SM90), rows);
        for d in [16, 32, 40, 64, 72, 96, 128, 256] {
            for max in [SM90, SM80, SM86] {
                for p in [Pass::Forward, Pass::Dq, Pass::Dkv] {
                    for k in [Tensor, Wmma, Fp32] {
                        let l = choose(p, d, k, true, max);
                        assert!(l.smem <= max || l.set == Set::Rows, "{l:?}");
                    }
                }
            }
        }
    }
}
