//! Horizon's compute boundary: the [`Backend`] trait, the CPU reference backend and (feature
//! `cuda`) the CUDA backend; without the feature, [`cuda`] is a stub whose constructors say the
//! binary was built without CUDA.
//!
//! This crate knows nothing about models, files or schedules. It offers ops (each a forward and
//! a hand-written backward) over flat fp32 buffers, in the argument order of llm.c: outputs
//! (`&mut`) first, then inputs, then sizes. Weights are the one exception: a backend reads them
//! in its own format ([`Backend::WBuf`], [`Precision`]): fp32 on the CPU, bf16 on CUDA.
//!
//! Shape legend, used in every doc line: `B T C H KVH D F V` = batch, time, hidden, query heads,
//! kv heads, head dim, FFN dim, vocab; `N = B*T` rows; `QKV = (H + 2*KVH)*D`.
//!
//! Gradient convention: every backward says per output whether it **overwrites** or
//! **accumulates (+=)**. Parameter gradients accumulate; activation gradients overwrite, except
//! the residual stream (`rmsnorm_backward`'s `dinp`), which accumulates.

pub mod bf16;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;
pub mod device;
pub mod mxfp4;
pub mod nf4;
pub mod pool;
pub mod precision;
pub mod threads;

pub use bf16::Bf16;
pub use cpu::CpuBackend;
pub use device::{
    DevBuf, Device, DeviceStats, Event, HostPtr, HostPtrMut, HostWork, Kernel, KernelTimer,
    OutOfDeviceMemory, Queue, StagingElem, Views,
};
pub use precision::Precision;

use std::ops::Range;

/// A contiguous run of elements that lives on a backend's device. On the CPU backend it is a
/// plain slice; on the CUDA backend a `cuda::DevSlice`, a view of device memory.
pub trait DeviceSlice {
    /// Number of elements.
    fn len(&self) -> usize;
    /// True when the slice holds no element.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A sub-range view.
    fn slice(&self, r: Range<usize>) -> &Self;
    /// A mutable sub-range view.
    fn slice_mut(&mut self, r: Range<usize>) -> &mut Self;
    /// Two disjoint mutable views, `[0, mid)` and `[mid, len)`.
    fn split_at_mut(&mut self, mid: usize) -> (&mut Self, &mut Self);
}

impl<T> DeviceSlice for [T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
    fn slice(&self, r: Range<usize>) -> &Self {
        &self[r]
    }
    fn slice_mut(&mut self, r: Range<usize>) -> &mut Self {
        &mut self[r]
    }
    fn split_at_mut(&mut self, mid: usize) -> (&mut Self, &mut Self) {
        <[T]>::split_at_mut(self, mid)
    }
}

/// An input gradient a backward writes: overwritten, or accumulated into (+=).
pub enum Dinp<'a, T: ?Sized> {
    /// `dinp = ...`: the previous contents are ignored.
    Write(&'a mut T),
    /// `dinp += ...`: the product is added to what the buffer holds (a LoRA adapter's input
    /// gradient joins the frozen base's).
    Add(&'a mut T),
}

/// gpt-oss's clamped SwiGLU: the gate clamped above at `limit`, the up projection to
/// `[-limit, limit]`, `out = (up + 1) * gate * sigmoid(alpha * gate)` (`swiglu_alpha`,
/// `swiglu_limit`: 1.702 and 7.0 by default).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GluClamp {
    pub alpha: f32,
    pub limit: f32,
}

/// Sizes of one attention call: `B` sequences of `T` positions, `H` query heads sharing `KVH`
/// key/value heads (GQA; `H % KVH == 0`), head dim `D`; the causal window and the score scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub kvh: usize,
    pub d: usize,
    /// Sliding window `W`: query `i` sees keys `j` with `i - W < j <= i` (itself and the `W - 1`
    /// before it, as transformers' `sliding_window`); 0 = full causal attention.
    pub window: usize,
    /// Scale of the scores `s_ij = scale q_i.k_j`: `1/sqrt(D)` for most families, Gemma's
    /// `query_pre_attn_scalar^-1/2`.
    pub scale: f32,
}

impl AttnDims {
    /// Full causal attention with the scale `1/sqrt(D)`.
    pub fn new(b: usize, t: usize, h: usize, kvh: usize, d: usize) -> Self {
        AttnDims { b, t, h, kvh, d, window: 0, scale: 1.0 / (d as f32).sqrt() }
    }
    /// Rows `N = B*T`.
    pub fn n(&self) -> usize {
        self.b * self.t
    }
    /// Width of one fused q|k|v row: `(H + 2*KVH)*D`.
    pub fn qkv_width(&self) -> usize {
        (self.h + 2 * self.kvh) * self.d
    }
}

/// How an RMSNorm applies its weight: row width `C`, `eps`, and `w_offset`: the weight is applied
/// as `(w_offset + w)`: 0 for Llama-style norms, 1 for Gemma's `x * (1 + w)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormDims {
    pub c: usize,
    pub eps: f32,
    pub w_offset: f32,
}

/// Sizes of a mixture-of-experts routing call: N rows, E experts, k chosen per row (M = N*k
/// (row, choice) pairs); `norm`: the k routing weights are divided by their sum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub n: usize,
    pub e: usize,
    pub k: usize,
    pub norm: bool,
}

impl MoeDims {
    /// (row, choice) pairs: `N*k`.
    pub fn m(&self) -> usize {
        self.n * self.k
    }
}

impl NormDims {
    /// `out = inp * rstd * w` over rows of `c`.
    pub fn new(c: usize, eps: f32) -> Self {
        NormDims { c, eps, w_offset: 0.0 }
    }
}

/// The device boundary. Everything a model step computes goes through these methods; the CPU
/// backend is the reference every other backend is checked against.
///
/// Buffers of `f32` are `Self::Buf`, buffers of token ids / targets are `Self::IBuf` (`i32`,
/// `-100` = ignored target), weights (matrices, norm weights, biases) are `Self::WBuf`, in the
/// backend's [`Precision`]. Every op computes in fp32 (products accumulate in fp32); only what a
/// weight holds, and what a product's inputs are rounded to, depends on the precision.
pub trait Backend: Send + Sync {
    /// A device buffer of f32 (unsized view, like `[f32]`).
    type Buf: ?Sized + DeviceSlice;
    /// A device buffer of i32 (token ids, targets).
    type IBuf: ?Sized + DeviceSlice;
    /// A device buffer of weights (`[f32]` on the CPU, bf16 on CUDA); its elements are weights,
    /// so layout offsets index it directly.
    type WBuf: ?Sized + DeviceSlice;
    /// How the backend stores weights and what its products need (the memory plan's source).
    const PRECISION: Precision;

    /// Short name for logs (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    // ---- memory -----------------------------------------------------------------------------

    /// Host -> device copy. `dst.len() == src.len()`.
    fn upload(&self, dst: &mut Self::Buf, src: &[f32]);
    /// Host -> device copy of i32 data.
    fn upload_i32(&self, dst: &mut Self::IBuf, src: &[i32]);
    /// Host fp32 -> device weights, rounded to the backend's precision (to nearest even; exact
    /// on the CPU). `dst.len() == src.len()`.
    fn upload_weights(&self, dst: &mut Self::WBuf, src: &[f32]);
    /// Device -> host copy. `dst.len() == src.len()`.
    fn download(&self, dst: &mut [f32], src: &Self::Buf);
    /// `dst = src` on the device.
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf);
    /// `buf = 0`.
    fn zero(&self, buf: &mut Self::Buf);

    // ---- ops ----------------------------------------------------------------------------------

    /// Embedding lookup.
    /// out: (N, C), overwrites. ids: (N), each in `0..V`. table: (V, C).
    fn embedding_forward(&self, out: &mut Self::Buf, ids: &Self::IBuf, table: &Self::Buf, c: usize);
    /// dtable: (V, C), accumulates (+=) into the rows named by `ids` only. ids: (N). dout: (N, C).
    fn embedding_backward(
        &self,
        dtable: &mut Self::Buf,
        ids: &Self::IBuf,
        dout: &Self::Buf,
        c: usize,
    );

    /// RMSNorm: `out = inp * rstd * (w_offset + weight)`, `rstd = 1/sqrt(mean(inp^2) + eps)`
    /// per row.
    /// out: (N, C), overwrites. rstd: (N), overwrites. inp: (N, C). weight: (C).
    fn rmsnorm_forward(
        &self,
        out: &mut Self::Buf,
        rstd: &mut Self::Buf,
        inp: &Self::Buf,
        weight: &Self::WBuf,
        norm: NormDims,
    );
    /// dinp: (N, C), accumulates (+=). dweight: (C), accumulates (+=); `None` for a frozen
    /// weight: its gradient is not computed. dout, inp: (N, C). weight: (C). rstd: (N) as saved
    /// by the forward.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dinp: &mut Self::Buf,
        dweight: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        weight: &Self::WBuf,
        rstd: &Self::Buf,
        norm: NormDims,
    );

    /// Per-head RMSNorm of the q and k parts of each fused row (Qwen3's and Gemma 3's
    /// `q_norm`, `k_norm`, before rope): every q head's `D` values are normalised with
    /// `weight[0..D]`, every k head's with `weight[D..2D]`, as [`Backend::rmsnorm_forward`] with
    /// `norm` (`norm.c == D`); the v part is copied.
    /// out: (N, QKV), overwrites. rstd: (N, H + KVH), overwrites: row r's q heads, then its
    /// k heads. inp: (N, QKV). weight: (2D) = `[q_norm (D) | k_norm (D)]`.
    fn head_rmsnorm_forward(
        &self,
        out: &mut Self::Buf,
        rstd: &mut Self::Buf,
        inp: &Self::Buf,
        weight: &Self::WBuf,
        dims: AttnDims,
        norm: NormDims,
    );
    /// dinp: (N, QKV), overwrites (its v part is dout's). dweight: (2D), accumulates (+=);
    /// `None` for frozen norm weights: not computed. dout, inp: (N, QKV). weight: (2D).
    /// rstd: (N, H + KVH) as saved by the forward.
    #[allow(clippy::too_many_arguments)]
    fn head_rmsnorm_backward(
        &self,
        dinp: &mut Self::Buf,
        dweight: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        weight: &Self::WBuf,
        rstd: &Self::Buf,
        dims: AttnDims,
        norm: NormDims,
    );

    /// Linear layer: `out = inp @ weight^T + bias`. With bf16 weights, `inp` is rounded to bf16
    /// for the product (fp32 accumulation).
    /// out: (N, OC), overwrites. inp: (N, IC). weight: (OC, IC). bias: (OC).
    #[allow(clippy::too_many_arguments)]
    fn matmul_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        weight: &Self::WBuf,
        bias: Option<&Self::WBuf>,
        n: usize,
        ic: usize,
        oc: usize,
    );
    /// dinp: (N, IC): `Dinp::Write` overwrites, `Dinp::Add` accumulates (+=); skipped when
    /// `None`. dweight: (OC, IC), accumulates (+=); `None` for a frozen weight: no dW product
    /// at all. dbias: (OC), accumulates (+=). dout: (N, OC). inp: (N, IC). weight: (OC, IC).
    /// With bf16 weights, `dout` and `inp` are rounded to bf16 for the two products (fp32
    /// accumulation, fp32 `dinp` and `dweight`; `inp` only when there is a `dweight`); `dbias`
    /// sums the fp32 `dout`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(
        &self,
        dinp: Option<Dinp<'_, Self::Buf>>,
        dweight: Option<&mut Self::Buf>,
        dbias: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        weight: &Self::WBuf,
        n: usize,
        ic: usize,
        oc: usize,
    );

    /// Rotary embedding (rotate-half convention), in place on the q and k parts of each row.
    /// qkv: (N, QKV), row = `[q (H*D) | k (KVH*D) | v (KVH*D)]`; position of row `r` is `r % T`.
    /// cos, sin: (T, D/2), for pair `(j, j + D/2)` of each head.
    fn rope_forward(&self, qkv: &mut Self::Buf, cos: &Self::Buf, sin: &Self::Buf, dims: AttnDims);
    /// In place on the dq and dk parts of dqkv: (N, QKV) (the inverse rotation); dv untouched.
    fn rope_backward(&self, dqkv: &mut Self::Buf, cos: &Self::Buf, sin: &Self::Buf, dims: AttnDims);

    /// Causal grouped-query attention with scores `dims.scale * q.k`, within `dims.window`
    /// when it is not 0; query head `h` reads kv head `h / (H/KVH)`.
    /// out: (N, H*D), overwrites. lse: (B, H, T), overwrites (log-sum-exp of each score row).
    /// qkv: (N, QKV) after rope.
    fn attention_forward(
        &self,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
        qkv: &Self::Buf,
        dims: AttnDims,
    );
    /// dqkv: (N, QKV), overwrites (dq, dk, dv w.r.t. the post-rope q, k). dout: (N, H*D).
    /// qkv, out, lse: as used and produced by the forward.
    fn attention_backward(
        &self,
        dqkv: &mut Self::Buf,
        dout: &Self::Buf,
        qkv: &Self::Buf,
        out: &Self::Buf,
        lse: &Self::Buf,
        dims: AttnDims,
    );

    /// Learned attention sinks (gpt-oss), as a step after [`Backend::attention_forward`]: head
    /// `h`'s logit `sinks[h]` is one more column of each of its score rows, which takes
    /// probability mass and adds no value ([`cpu::attention_sink`] has the derivation). Per row
    /// `i` and head `h`: `lse'_i = logaddexp(lse_i, sinks[h])`, `out_i *= exp(lse_i - lse'_i)`;
    /// afterwards `out` and `lse` are the sink attention's output and log-sum-exp over the T + 1
    /// columns, and [`Backend::attention_backward`] on them gives its dqkv.
    /// out: (N, H*D), in place. lse: (B, H, T), in place (overwritten with `lse'`); both as the
    /// forward left them. sinks: (H), weights (a layer's `self_attn.sinks`).
    fn attention_sink_forward(
        &self,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
        sinks: &Self::WBuf,
        dims: AttnDims,
    );
    /// The sinks' gradient: `dsinks[h] += -sum_i exp(sinks[h] - lse'_i) (dout_i . out_i)` over
    /// every row `i` (all of B and T; `dout_i`, `out_i` head `h`'s D columns), summed in a fixed
    /// order (deterministic).
    /// dsinks: (H), accumulates (+=). dout: (N, H*D). out: (N, H*D), lse: (B, H, T): the
    /// sink-adjusted ones [`Backend::attention_sink_forward`] left. sinks: (H).
    fn attention_sink_backward(
        &self,
        dsinks: &mut Self::Buf,
        dout: &Self::Buf,
        out: &Self::Buf,
        lse: &Self::Buf,
        sinks: &Self::WBuf,
        dims: AttnDims,
    );

    /// Attention of the last `t_new` positions of each sequence against every key before and at
    /// them, forward only (a KV cache's decode step): rows `T - T_new..T` of
    /// [`Backend::attention_forward`]'s `out` (followed by [`Backend::attention_sink_forward`]
    /// with `sinks`), within `dims.window`, `dims` sizing the whole cache (`dims.t` = T
    /// positions so far).
    /// out: (B*T_new, H*D), overwrites. qkv: (B*T, QKV) after rope: every position's k and v (the
    /// cache), and the new positions' q. sinks: (H), each head's sink logit, or `None`.
    fn attention_decode(
        &self,
        out: &mut Self::Buf,
        qkv: &Self::Buf,
        sinks: Option<&Self::WBuf>,
        t_new: usize,
        dims: AttnDims,
    );

    /// SwiGLU: `out = silu(gate) * up`.
    /// out: (N, F), overwrites. gate_up: (N, 2F), row = `[gate (F) | up (F)]`.
    fn swiglu_forward(&self, out: &mut Self::Buf, gate_up: &Self::Buf, n: usize, f: usize);
    /// dgate_up: (N, 2F), overwrites. dout: (N, F). gate_up: (N, 2F).
    fn swiglu_backward(
        &self,
        dgate_up: &mut Self::Buf,
        dout: &Self::Buf,
        gate_up: &Self::Buf,
        n: usize,
        f: usize,
    );

    /// gpt-oss's clamped SwiGLU ([`GluClamp`]) over a `[gate | up]` row: a clamped entry
    /// passes no gradient.
    /// out: (N, F), overwrites. gate_up: (N, 2F), row = `[gate (F) | up (F)]`.
    fn clamped_swiglu_forward(
        &self,
        out: &mut Self::Buf,
        gate_up: &Self::Buf,
        n: usize,
        f: usize,
        clamp: GluClamp,
    );
    /// dgate_up: (N, 2F), overwrites. dout: (N, F). gate_up: (N, 2F).
    fn clamped_swiglu_backward(
        &self,
        dgate_up: &mut Self::Buf,
        dout: &Self::Buf,
        gate_up: &Self::Buf,
        nf: (usize, usize),
        clamp: GluClamp,
    );

    /// GeGLU (Gemma): `out = gelu_tanh(gate) * up`, with transformers' `gelu_pytorch_tanh`:
    /// `gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    /// out: (N, F), overwrites. gate_up: (N, 2F), row = `[gate (F) | up (F)]`.
    fn geglu_forward(&self, out: &mut Self::Buf, gate_up: &Self::Buf, n: usize, f: usize);
    /// dgate_up: (N, 2F), overwrites. dout: (N, F). gate_up: (N, 2F).
    fn geglu_backward(
        &self,
        dgate_up: &mut Self::Buf,
        dout: &Self::Buf,
        gate_up: &Self::Buf,
        n: usize,
        f: usize,
    );

    /// A column slice of a wider output accumulates a scaled narrow one (LoRA's update of one
    /// target of a fused q|k|v or gate|up output): `out[r*out_w + col + j] += scale *
    /// src[r*w + j]` for `r < N`, `j < w`.
    /// out: (N, out_w), accumulates (+=) into columns `col..col + w`. src: (N, w).
    #[allow(clippy::too_many_arguments)]
    fn add_cols(
        &self,
        out: &mut Self::Buf,
        src: &Self::Buf,
        n: usize,
        out_w: usize,
        col: usize,
        w: usize,
        scale: f32,
    );
    /// A scaled copy of a column slice (the gradient a LoRA target sees):
    /// `out[r*w + j] = scale * src[r*src_w + col + j]`.
    /// out: (N, w), overwrites. src: (N, src_w).
    #[allow(clippy::too_many_arguments)]
    fn scaled_cols(
        &self,
        out: &mut Self::Buf,
        src: &Self::Buf,
        n: usize,
        src_w: usize,
        col: usize,
        w: usize,
        scale: f32,
    );

    /// NF4 weights to the backend's precision (QLoRA's frozen base): `packed` holds the device
    /// form of [`nf4`] (`nf4::words(n)` words, each an f32 buffer element's bits, uploaded
    /// bit-preserving with [`Backend::upload`]); `out[i] = CODE[q_i] * absmax[i / 64]` in fp32,
    /// rounded to the weight precision (exact on the CPU, bf16 nearest even on CUDA).
    /// out: (n), overwrites. packed: (`nf4::words(n)`).
    fn dequantize_nf4(&self, out: &mut Self::WBuf, packed: &Self::Buf, n: usize);
    /// MXFP4 weights (gpt-oss's experts, kept packed as the frozen base) to the backend's
    /// precision: `packed` holds [`mxfp4::words`]`(n)` words of [`mxfp4`]'s device form (uploaded
    /// bit-preserving with [`Backend::upload`]); `out[i] = FP4[code_i] * 2^(scale[i / 32] - 127)`,
    /// exact in fp32 and in bf16 for scales up to 252 (the checkpoint's values bit for bit).
    /// out: (n), overwrites; n a multiple of 32.
    fn dequantize_mxfp4(&self, out: &mut Self::WBuf, packed: &Self::Buf, n: usize);

    // ---- mixture of experts ([`cpu::moe`] has the data flow) -------------------------------

    /// Routing: `probs = softmax(logits)` per row, `sel` its k largest (largest first, ties to
    /// the lower expert) as f32 expert indices, `wts` their probabilities (divided by their sum
    /// when `dims.norm`).
    /// probs: (N, E), sel: (N, k), wts: (N, k), all overwrite. logits: (N, E).
    fn moe_route_forward(
        &self,
        probs: &mut Self::Buf,
        sel: &mut Self::Buf,
        wts: &mut Self::Buf,
        logits: &Self::Buf,
        dims: MoeDims,
    );
    /// dlogits: (N, E), overwrites, from dwts: (N, k) and, with `aux = (g (E), mask (N))`, the
    /// load-balancing gradient `dprobs[r, e] += mask[r] * g[e]`. probs, sel: as the forward
    /// left them.
    fn moe_route_backward(
        &self,
        dlogits: &mut Self::Buf,
        dwts: &Self::Buf,
        probs: &Self::Buf,
        sel: &Self::Buf,
        aux: Option<(&Self::Buf, &Self::Buf)>,
        dims: MoeDims,
    );
    /// The pooled load-balancing statistics: stats (2E), accumulates: `[e] += sum_r mask[r]
    /// [e in sel[r]]`, `[E + e] += sum_r mask[r] probs[r, e]`. mask: (N).
    fn moe_aux_stats(
        &self,
        stats: &mut Self::Buf,
        probs: &Self::Buf,
        sel: &Self::Buf,
        mask: &Self::Buf,
        dims: MoeDims,
    );
    /// xs: (M, C), overwrites: `xs[i] = x[order[i] / k]`. x: (N, C). order: (M) pair indices.
    fn moe_gather(&self, xs: &mut Self::Buf, x: &Self::Buf, order: &Self::Buf, k: usize, c: usize);
    /// One expert's rows added back to their rows of `out`: `out[order[i] / k] += w * src[i]`,
    /// `w = wts[order[i]]` (1 without `wts` (M)), for each of `order`'s pairs. The caller's
    /// contract: `order`'s pairs name distinct rows (an expert's segment: a row chooses an
    /// expert at most once). out: (N, C), accumulates. src: (S, C). order: (S) pair indices.
    fn moe_scatter_add(
        &self,
        out: &mut Self::Buf,
        src: &Self::Buf,
        order: &Self::Buf,
        wts: Option<&Self::Buf>,
        k: usize,
        c: usize,
    );
    /// buf: (M, W), in place: `buf[i] *= wts[order[i]]`. wts: (M). order: (M).
    fn moe_scale_rows(&self, buf: &mut Self::Buf, wts: &Self::Buf, order: &Self::Buf, w: usize);
    /// out: (M) in pair order, its entries `order[i]` overwritten: `out[order[i]] = a[i] . b[i]`.
    /// a, b: (S, W). order: (S) pair indices.
    fn moe_row_dots(
        &self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        order: &Self::Buf,
        w: usize,
    );
    /// The routing weights' gradient share of an expert's down-projection bias (gpt-oss: the
    /// bias is added before the routing weight scales the expert's output, so `dwts` of pair
    /// `p` gains `dy . bias`): `out[order[i]] += dy[i] . bias`, each sum in a fixed order. The
    /// caller's contract: `order`'s pairs are distinct (one expert's segment).
    /// out: (M) in pair order, its entries `order[i]` accumulate (+=). dy: (S, C). bias: (C), a
    /// weight. order: (S) pair indices.
    fn moe_bias_dots(
        &self,
        out: &mut Self::Buf,
        dy: &Self::Buf,
        bias: &Self::WBuf,
        order: &Self::Buf,
        c: usize,
    );
    /// The shared expert's sigmoid gate (Qwen2-MoE), each row scaled by its own logit:
    /// `out[r] = sigmoid(gate[r]) * inp[r]` ([`cpu::gate`] has the derivation).
    /// out: (N, C), overwrites. gate: (N), one logit a row. inp: (N, C).
    fn sigmoid_gate_forward(
        &self,
        out: &mut Self::Buf,
        gate: &Self::Buf,
        inp: &Self::Buf,
        c: usize,
    );
    /// dinp: (N, C), overwrites: `sigmoid(gate[r]) * dout[r]`. dgate: (N), overwrites:
    /// `s (1 - s) * sum_j dout[r, j] inp[r, j]`, s = sigmoid(gate[r]), the sum in a fixed order
    /// (deterministic). dout, inp: (N, C). gate: (N).
    fn sigmoid_gate_backward(
        &self,
        dinp: &mut Self::Buf,
        dgate: &mut Self::Buf,
        dout: &Self::Buf,
        gate: &Self::Buf,
        inp: &Self::Buf,
        c: usize,
    );

    /// Residual add: out = a + b. All of one length; out overwrites.
    fn residual_forward(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf);
    /// acc += x (the residual backward, and gradient accumulation).
    fn add_inplace(&self, acc: &mut Self::Buf, x: &Self::Buf);

    /// Cross-entropy of each row, forward only (evaluation).
    /// losses: (N), overwrites: `-log softmax(logits[r])[targets[r]]`, 0 where `targets[r] == -100`.
    /// logits: (N, V). targets: (N).
    fn cross_entropy_forward(
        &self,
        losses: &mut Self::Buf,
        logits: &Self::Buf,
        targets: &Self::IBuf,
        n: usize,
        v: usize,
    );
    /// Cross-entropy over vocabulary tiles, pass 1 (an LM head too large for one weight slot is
    /// applied a tile of vocabulary rows at a time). `logits`: (N, VT), the logits of vocabulary
    /// ids `v0..v0 + VT` of N rows. `stats`: (N, 3) per row `(m, s, t)`: the running maximum
    /// `m`, the running sum `s` of `exp(l - m)`, and the target's logit `t`. With `first` they
    /// are overwritten from this tile (`t = 0` unless the target is in it), else updated:
    /// `m' = max(m, max_j l_j)`, `s' = s * exp(m - m') + sum_j exp(l_j - m')`, `t = l[target - v0]`
    /// when the target lies in the tile. Rows whose target is -100 are updated like any other.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_tile_stats(
        &self,
        stats: &mut Self::Buf,
        logits: &Self::Buf,
        targets: &Self::IBuf,
        n: usize,
        vt: usize,
        v0: usize,
        first: bool,
    );
    /// Pass 2, in place on one tile: `logits` (N, VT) becomes
    /// `dlogits = scale * (exp(l - lse) - onehot(target - v0))` with `lse = m + ln s` from the
    /// complete `stats` (N, 3); all zero on rows whose target is -100.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_tile_grad(
        &self,
        logits: &mut Self::Buf,
        stats: &Self::Buf,
        targets: &Self::IBuf,
        n: usize,
        vt: usize,
        v0: usize,
        scale: f32,
    );
    /// The per-row losses from complete `stats` (N, 3): `losses` (N), overwrites:
    /// `m + ln s - t`, 0 where the target is -100.
    fn cross_entropy_tile_loss(
        &self,
        losses: &mut Self::Buf,
        stats: &Self::Buf,
        targets: &Self::IBuf,
        n: usize,
    );

    /// Fused cross-entropy forward and backward, in place on one chunk of rows.
    /// logits: (N, V); on return holds `dlogits = scale * (softmax(logits) - onehot(target))`,
    /// all zero on ignored rows. losses: (N), overwrites, as in `cross_entropy_forward`.
    /// `scale` is `1 / (number of loss-carrying positions in the whole batch)`.
    fn cross_entropy_fused(
        &self,
        logits: &mut Self::Buf,
        losses: &mut Self::Buf,
        targets: &Self::IBuf,
        n: usize,
        v: usize,
        scale: f32,
    );
}

/// Owned device memory for a [`Backend`]: the model code asks for its buffers here, once, sized
/// by the plan, and views them as `Backend::Buf` / `Backend::IBuf`.
pub trait DeviceAlloc: Backend {
    /// An owned f32 device buffer.
    type Mem: std::ops::DerefMut<Target = Self::Buf> + Send;
    /// An owned i32 device buffer.
    type IMem: std::ops::DerefMut<Target = Self::IBuf> + Send;
    /// An owned weight buffer.
    type WMem: std::ops::DerefMut<Target = Self::WBuf> + Send;
    /// A zeroed f32 buffer of `len` elements.
    fn alloc(&self, len: usize) -> Self::Mem;
    /// A zeroed i32 buffer of `len` elements.
    fn alloc_i32(&self, len: usize) -> Self::IMem;
    /// A zeroed buffer of `len` weights.
    fn alloc_weights(&self, len: usize) -> Self::WMem;
}

impl DeviceAlloc for CpuBackend {
    type Mem = Vec<f32>;
    type IMem = Vec<i32>;
    type WMem = Vec<f32>;
    fn alloc(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }
    fn alloc_i32(&self, len: usize) -> Vec<i32> {
        vec![0; len]
    }
    fn alloc_weights(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }
}
