//! A model is data: a family describes one decoder layer as its tensors (HF names, shapes, init),
//! its activations (per-row widths, which of them are statistics) and its ops in order
//! ([`LayerBuilder`]). Everything else is derived here, once: the flat buffer layout, the
//! backward program (which gradient buffer each op reads and writes, overwrite or accumulate,
//! and the fewest gradient buffers that serve it), the activation and gradient scratch sizes,
//! and the FLOPs. [`crate::model::transformer`] runs the forward ops and the derived backward
//! on any backend; the reference path and the streaming engine share that code.
//!
//! Gradient buffers are taken before an op's output gradient is released, so no backward op
//! reads and writes one buffer.
//!
//! Data flow of a layer: `X (N,C) -> ops -> Y (N,C)`, every activation an `(N, width)` buffer.
//! The backward walks the ops last to first with the residual gradient (`dres`, (N,C)) holding
//! dL/dY on entry and dL/dX on exit.

use std::ops::Range;

/// How a tensor starts when the model is initialised randomly (`model.init: random`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// normal(0, `model.init_std`): matrices.
    Normal,
    /// 1: norm weights applied as `w`.
    Ones,
    /// 0: biases, and norm weights applied as `(1 + w)` (Gemma).
    Zeros,
    /// uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in the last dimension: a LoRA `A` matrix,
    /// as PEFT initialises it (`kaiming_uniform_(a = sqrt(5))`).
    KaimingUniform,
}

/// Where a tensor of a layer lives on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// In the weight slot, in the backend's precision: `offset` counts weights.
    Slot,
    /// In the packed region, as NF4 words ([`horizon_backend::nf4`]): `offset` counts words;
    /// dequantised into the backend's workspace before each use.
    Nf4,
    /// In the packed region as the checkpoint packs it, MXFP4 ([`horizon_backend::mxfp4`]'s
    /// device form: gpt-oss's experts in an adapter run); dequantised as NF4 is.
    Mxfp4,
}

impl Stored {
    /// In the packed region (NF4 or MXFP4 words).
    pub fn is_packed(self) -> bool {
        self != Stored::Slot
    }
}

/// One named tensor inside a flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// HF name suffix inside a layer (`self_attn.q_proj.weight`), or the full HF name for
    /// model-level tensors.
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub init: Init,
    /// Slot (weights) or packed (NF4 words).
    pub stored: Stored,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Elements this tensor takes in its region: weights in the slot, words when packed.
    pub fn stored_len(&self) -> usize {
        match self.stored {
            Stored::Slot => self.numel(),
            Stored::Nf4 => horizon_backend::nf4::words(self.numel()),
            Stored::Mxfp4 => horizon_backend::mxfp4::words(self.numel()),
        }
    }
    /// Its range in its region (the slot's weights, or the packed region's words).
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.stored_len()
    }
}

/// One packed tensor of a weight: its words in the packed region and where its
/// dequantised values go in the workspace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedPart {
    pub words: Range<usize>,
    /// NF4 or MXFP4.
    pub stored: Stored,
    /// Offset of its first value in the workspace.
    pub at: usize,
    /// Values.
    pub n: usize,
}

/// The weight of a product.
#[derive(Clone, Debug, PartialEq)]
pub enum Weight {
    /// A range of the slot.
    Slot(Range<usize>),
    /// Tensors in the packed region, dequantised side by side into the workspace (a fused
    /// q|k|v of three NF4 tensors is one matrix there).
    Packed(Vec<PackedPart>),
}

impl From<Range<usize>> for Weight {
    fn from(r: Range<usize>) -> Self {
        Weight::Slot(r)
    }
}

impl Weight {
    /// Values of the weight.
    pub fn numel(&self) -> usize {
        match self {
            Weight::Slot(r) => r.len(),
            Weight::Packed(parts) => parts.iter().map(|p| p.n).sum(),
        }
    }
}

/// An activation of a layer, as an index into the layer's activation slots: the layer input,
/// its output, then the layer's own buffers in declaration order.
pub type Act = usize;
/// The layer input `X` (N, C): the residual stream, read only.
pub const X: Act = 0;
/// The layer output `Y` (N, C).
pub const Y: Act = 1;
/// Slots before the layer's own activations.
pub const IO_SLOTS: usize = 2;

/// One activation buffer of a layer: `(N, width)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActSpec {
    pub name: &'static str,
    pub width: usize,
    /// False for saved statistics (`rstd`, `lse`): they carry no gradient.
    pub differentiable: bool,
}

/// The gated MLP activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// `silu(gate) * up` (SwiGLU).
    Silu,
    /// `gelu_tanh(gate) * up` (GeGLU, transformers' `gelu_pytorch_tanh`).
    GeluTanh,
}

/// One forward op. Weight ranges index the layer's flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `out = inp * rstd * (w_offset + w)` per row of C.
    RmsNorm { inp: Act, out: Act, rstd: Act, w: Range<usize>, w_offset: f32 },
    /// Per-head RMSNorm of the q and k parts of a fused qkv row; v copied. `w` = q_norm|k_norm.
    HeadNorm { inp: Act, out: Act, rstd: Act, w: Range<usize>, w_offset: f32 },
    /// `out = inp @ w^T + bias`: (N, ic) -> (N, oc).
    Linear { inp: Act, out: Act, w: Weight, bias: Option<Range<usize>>, ic: usize, oc: usize },
    /// A LoRA adapter on the product that wrote `out` (from `inp`): columns `col..col + w` of
    /// `out` (N, oc) += `scale * (inp a^T) b^T`, with `a` (r, ic), `b` (w, r). `u = inp a^T`
    /// (N, r) is saved for the backward; `tmp` (N, >= w) is scratch.
    #[allow(clippy::enum_variant_names)]
    Lora {
        inp: Act,
        out: Act,
        a: Range<usize>,
        b: Range<usize>,
        col: usize,
        w: usize,
        oc: usize,
        ic: usize,
        r: usize,
        u: Act,
        tmp: Act,
        scale: f32,
    },
    /// Rotary embedding in place on the q and k parts, with the model's rope table `table`.
    Rope { qkv: Act, table: usize },
    /// Causal (windowed) attention as the layer's [`AttnSpec`] says; with `sinks` (H, gpt-oss),
    /// each head's learned logit joins every softmax row as one more column that adds no
    /// value: `out` and `lse` are then the sink attention's.
    Attention { qkv: Act, out: Act, lse: Act, sinks: Option<Range<usize>> },
    /// `out = a + b`.
    Add { a: Act, b: Act, out: Act },
    /// `out = act(gate) * up`, gate_up (N, 2F) -> (N, F).
    Glu { gu: Act, out: Act, act: Glu, f: usize },
    /// `out = sigmoid(gate) * inp` per row: gate (N, 1), inp and out (N, C) (Qwen2-MoE's shared
    /// expert gate).
    SigmoidGate { gate: Act, inp: Act, out: Act, c: usize },
    /// Mixture-of-experts routing: `probs = softmax(logits)` (N, E), the top k experts `sel`
    /// (N, k, f32 indices) and their weights `wts` (N, k), renormalised when `norm`. Adds the
    /// rows' load-balancing statistics to the pass's pooled ones ([`crate::model::moe`]).
    Route { logits: Act, probs: Act, sel: Act, wts: Act, e: usize, k: usize, norm: bool },
    /// The routed experts: each row of `inp` (N, C) through its k experts (SwiGLU of width `i`),
    /// their outputs summed with the routing weights into `out` (N, C). `gate_up` holds the E
    /// experts' `[gate; up]` (2I, C) one after another, `down` their (C, I). Experts run one at
    /// a time on their rows (at most N), so the scratch is O(N): `gu` (N, 2I) and `scratch` =
    /// (xs (N, C), s (N, I), ys (N, C), idx (N, 2k): the pairs' sort); none is kept. `lora`: the adapters of the
    /// gate|up and the down projections (PEFT's `target_parameters`), with their scratch.
    Experts {
        inp: Act,
        sel: Act,
        wts: Act,
        out: Act,
        gu: Act,
        scratch: [Act; 4],
        gate_up: Range<usize>,
        down: Range<usize>,
        e: usize,
        k: usize,
        i: usize,
        c: usize,
        lora: Box<ExpertAdapters>,
        /// QLoRA: the experts' matrices as NF4, per expert its `[gate; up]` and its down as
        /// packed weights (each tensor its own 64-value blocks, as per-expert `Linear4bit`s);
        /// then `gate_up` and `down` are empty.
        packed: Option<Vec<[Weight; 2]>>,
        /// gpt-oss: each expert's `[gate; up]` bias (2I) and down bias (C), the E experts' one
        /// after another. The routing weight scales the whole expert output, down bias included.
        bias: Option<[Range<usize>; 2]>,
        /// gpt-oss's clamped SwiGLU in place of the plain one.
        clamp: Option<horizon_backend::GluClamp>,
    },
}

/// One rank-r adapter per expert on a 3-D expert parameter (PEFT's `ParamWrapper`): expert e's
/// update is `scale * B_e A_e`, `A_e` (r, in) at `a.start + e*r*in`, `B_e` (out, r) at
/// `b.start + e*out*r` (expert-major; PEFT's file stores B as (out, E*r), rank-major columns:
/// [`crate::model::lora::expert_b_to_peft`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertLora {
    pub a: Range<usize>,
    pub b: Range<usize>,
    pub r: usize,
    pub scale: f32,
}

/// The adapters of a sparse layer's experts and their scratch: `u` (N, 2r) and `t`
/// (N, max(2I, C)).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertAdapters {
    pub gate_up: Option<ExpertLora>,
    pub down: Option<ExpertLora>,
    pub scratch: Option<[Act; 2]>,
}

impl Op {
    /// The activations the op reads in its forward, and those it writes.
    pub(crate) fn forward_io(&self) -> (Vec<Act>, Vec<Act>) {
        match *self {
            Op::RmsNorm { inp, out, rstd, .. } | Op::HeadNorm { inp, out, rstd, .. } => {
                (vec![inp], vec![out, rstd])
            }
            Op::Linear { inp, out, .. } => (vec![inp], vec![out]),
            Op::Rope { qkv, .. } => (vec![qkv], vec![qkv]),
            Op::Attention { qkv, out, lse, .. } => (vec![qkv], vec![out, lse]),
            Op::Add { a, b, out } => (vec![a, b], vec![out]),
            Op::Glu { gu, out, .. } => (vec![gu], vec![out]),
            Op::Lora { inp, out, u, tmp, .. } => (vec![inp, out], vec![out, u, tmp]),
            Op::Route { logits, probs, sel, wts, .. } => (vec![logits], vec![probs, sel, wts]),
            Op::SigmoidGate { gate, inp, out, .. } => (vec![gate, inp], vec![out]),
            // `sel` is read too, as a statistic (it carries no gradient): see `saved`.
            Op::Experts { inp, wts, out, gu, scratch, ref lora, .. } => {
                let extra = lora.scratch.map_or(vec![], |s| s.to_vec());
                (vec![inp, wts], [&[out, gu][..], &scratch, &extra].concat())
            }
        }
    }

    /// The activations the op's backward reads (saved inputs and statistics).
    pub(crate) fn saved(&self) -> Vec<Act> {
        match *self {
            Op::RmsNorm { inp, rstd, .. } | Op::HeadNorm { inp, rstd, .. } => vec![inp, rstd],
            Op::Linear { inp, .. } => vec![inp],
            Op::Rope { .. } | Op::Add { .. } => vec![],
            Op::Attention { qkv, out, lse, .. } => vec![qkv, out, lse],
            Op::Glu { gu, .. } => vec![gu],
            Op::Lora { inp, u, .. } => vec![inp, u],
            Op::Route { probs, sel, .. } => vec![probs, sel],
            Op::SigmoidGate { gate, inp, .. } => vec![gate, inp],
            Op::Experts { inp, sel, wts, .. } => vec![inp, sel, wts],
        }
    }

    /// Forward FLOPs of the matrix products over `n` rows (attention counted apart).
    pub fn matmul_flops(&self, n: usize) -> f64 {
        match *self {
            Op::Linear { ic, oc, .. } => 2.0 * (n * ic * oc) as f64,
            Op::Lora { ic, r, w, .. } => 2.0 * (n * r * (ic + w)) as f64,
            // Active FLOPs: each row through its k experts (and their adapters).
            Op::Experts { k, i, c, ref lora, .. } => {
                let r = |l: &Option<ExpertLora>, ic: usize, oc: usize| {
                    l.as_ref().map_or(0, |l| l.r * (ic + oc))
                };
                let adapters = r(&lora.gate_up, c, 2 * i) + r(&lora.down, i, c);
                2.0 * (n * k * (3 * i * c + adapters)) as f64
            }
            _ => 0.0,
        }
    }

    /// Backward FLOPs of the matrix products over `n` rows: every product's input gradient
    /// (as many as its forward), and its weight gradient only where the weight is trained (a
    /// weight below the layer's `frozen` prefix, or packed NF4, gets none: an adapter run's
    /// base). An adapter's `A` and `B` are trained: twice its forward.
    pub fn matmul_backward_flops(&self, n: usize, frozen: usize) -> f64 {
        let fwd = self.matmul_flops(n);
        match *self {
            Op::Linear { w: Weight::Slot(ref r), .. } if r.start >= frozen => 2.0 * fwd,
            Op::Linear { .. } => fwd,
            Op::Lora { .. } => 2.0 * fwd,
            Op::Experts { k, i, c, ref gate_up, ref packed, .. } => {
                let base = 2.0 * (n * k * 3 * i * c) as f64;
                let trained = packed.is_none() && gate_up.start >= frozen;
                // The adapters' share of `fwd` (zero without) is trained.
                let adapters = fwd - base;
                if trained { 2.0 * fwd } else { base + 2.0 * adapters }
            }
            _ => 0.0,
        }
    }
}

/// A layer's attention: heads, head dim, window (0 = full) and score scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnSpec {
    pub h: usize,
    pub kvh: usize,
    pub d: usize,
    pub window: usize,
    pub scale: f32,
}

impl AttnSpec {
    /// The backend's dims for `b` sequences of `t` positions.
    pub fn dims(&self, b: usize, t: usize) -> horizon_backend::AttnDims {
        horizon_backend::AttnDims {
            window: self.window,
            scale: self.scale,
            ..horizon_backend::AttnDims::new(b, t, self.h, self.kvh, self.d)
        }
    }

    /// Query-key pairs one sequence of `t` positions scores.
    pub fn pairs(&self, t: usize) -> usize {
        match self.window {
            0 => t * (t + 1) / 2,
            w => (0..t).map(|i| (i + 1).min(w)).sum(),
        }
    }
}

/// A gradient buffer of the backward: index 0 is the residual gradient `dres` (the engine's
/// per micro-batch buffer), the others the layer's gradient scratch.
pub type GradBuf = usize;
/// The residual gradient: dL/dY on entry to the backward, dL/dX on exit.
pub const DRES: GradBuf = 0;

/// One step of the derived backward program.
#[derive(Clone, Debug, PartialEq)]
pub enum BwdOp {
    /// `dst = src`.
    Copy { dst: GradBuf, src: GradBuf, width: usize },
    /// `dst += src` (a gradient with a contribution already).
    Accumulate { dst: GradBuf, src: GradBuf, width: usize },
    /// `dst = 0` (before an op that accumulates into a gradient nothing has written yet).
    Zero { dst: GradBuf, width: usize },
    /// RMSNorm backward: `dinp +=`, weight gradient `+=`.
    RmsNorm { op: usize, dinp: GradBuf, dout: GradBuf },
    /// Per-head RMSNorm backward: `dinp =` (overwrites), weight gradient `+=`.
    HeadNorm { op: usize, dinp: GradBuf, dout: GradBuf },
    /// Linear backward: `dinp =` (overwrites; `+=` when `acc`: the input has a later
    /// consumer), weight and bias gradients `+=`.
    Linear { op: usize, dinp: GradBuf, dout: GradBuf, acc: bool },
    /// Inverse rotation in place on `dqkv`.
    Rope { op: usize, dqkv: GradBuf },
    /// Attention backward: `dqkv =` (overwrites).
    Attention { op: usize, dqkv: GradBuf, dout: GradBuf },
    /// Gated activation backward: `dgu =` (overwrites).
    Glu { op: usize, dgu: GradBuf, dout: GradBuf },
    /// LoRA backward, after its product's: `g = scale * dout[:, cols]` (in `g`), `du = g b`
    /// (in `du`), `dinp +=` `du a`; the adapter gradients `+=`.
    Lora { op: usize, dinp: GradBuf, dout: GradBuf, g: GradBuf, du: GradBuf },
    /// Sigmoid gate backward: `dgate =`, `dinp =` (both overwrite).
    SigmoidGate { op: usize, dgate: GradBuf, dinp: GradBuf, dout: GradBuf },
    /// Routing backward: `dlogits =` (overwrites) from `dwts` and the load-balancing term.
    Route { op: usize, dlogits: GradBuf, dwts: GradBuf },
    /// Experts backward: `dinp =` (`+=` when `acc`), `dwts =`, expert weight gradients `+=`.
    /// `t` = scratch (dy|dxs (C), sw (I), ds (I), dgu (2I), xs (C), s (I), idx (2k), for
    /// adapters u|du (2r) and g (max(2I, C)), gu (2I)), each (N, width).
    Experts { op: usize, dinp: GradBuf, acc: bool, dout: GradBuf, dwts: GradBuf, t: [GradBuf; 10] },
}

impl ExpertAdapters {
    /// Widths of the adapters' scratch over N rows: (u|du, t); (0, 0) without adapters.
    pub fn widths(&self, i: usize, c: usize) -> (usize, usize) {
        let r = [&self.gate_up, &self.down].iter().filter_map(|l| l.as_ref()).map(|l| l.r).max();
        r.map_or((0, 0), |r| (2 * r, (2 * i).max(c)))
    }
}

/// One decoder layer, described: tensors, activations, ops, and the derived backward.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    /// What kind of layer this is (`full_attention`, `sliding_attention`), for the plan.
    pub kind: &'static str,
    /// Hidden size C (the width of X, Y and the residual gradient).
    pub c: usize,
    /// Every HF tensor of the layer, in buffer order (slot tensors, then packed ones).
    pub tensors: Vec<TensorSpec>,
    /// Weights of the layer's slot (the packed tensors not counted).
    pub len: usize,
    /// The slot's first `frozen` weights are frozen (an adapter run's base); the rest,
    /// `len - frozen`, are trained: the layer's masters, gradients and moments. 0 in full
    /// fine-tuning.
    pub frozen: usize,
    /// Words of the packed (NF4) region; 0 unless the base is quantised.
    pub packed: usize,
    /// Values of the largest packed weight: the dequantisation workspace.
    pub workspace: usize,
    /// The layer's own activations (slots `IO_SLOTS..`).
    pub acts: Vec<ActSpec>,
    pub ops: Vec<Op>,
    pub attn: AttnSpec,
    pub eps: f32,
    /// Widths of the gradient buffers (index [`DRES`] is the residual gradient, width C).
    pub grads: Vec<usize>,
    /// The backward program, derived from `ops`.
    pub backward: Vec<BwdOp>,
    /// The ops a layer that keeps its internals runs again before its backward, derived from
    /// `ops` ([`LayerSpec::rebuild_ops`]).
    rebuild: Vec<usize>,
}

impl LayerSpec {
    /// Width of activation slot `a` (X and Y are C wide).
    pub fn width(&self, a: Act) -> usize {
        if a < IO_SLOTS { self.c } else { self.acts[a - IO_SLOTS].width }
    }

    /// The ops a layer that keeps its internals (`engine.recompute`) runs again just before its
    /// backward, in order, instead of keeping their outputs: each RMSNorm whose output another
    /// op's backward reads. Its input is still there (the layer input X, a value some backward
    /// reads and so kept, or an earlier rebuilt norm's output), and nothing overwrites it in
    /// the forward ([`check_saved`]), so output and `rstd` come back bit for bit: one pass
    /// over (N, C) where keeping them takes (N, C + 1) of device memory. Derived once, with
    /// the backward program.
    pub fn rebuild_ops(&self) -> &[usize] {
        &self.rebuild
    }

    /// Per own activation (slot `IO_SLOTS + i`), whether a layer that keeps its internals keeps
    /// it on the device for its backward: some op's backward reads it and no rebuild op
    /// ([`LayerSpec::rebuild_ops`]) writes it. The others (rebuilt, or read by no backward, as a
    /// product output that only feeds a residual add) live in the compute queue's scratch.
    pub fn stashed(&self) -> Vec<bool> {
        let rebuilt: Vec<Act> =
            self.rebuild.iter().flat_map(|&i| self.ops[i].forward_io().1).collect();
        (0..self.acts.len())
            .map(|i| {
                let a = IO_SLOTS + i;
                !rebuilt.contains(&a) && self.ops.iter().any(|op| op.saved().contains(&a))
            })
            .collect()
    }

    /// Forward FLOPs over `b` sequences of `t` positions: (matrix products, attention).
    pub fn forward_flops(&self, b: usize, t: usize) -> (f64, f64) {
        let mat = self.ops.iter().map(|op| op.matmul_flops(b * t)).sum();
        let a = &self.attn;
        let attn = 4.0 * (a.d * a.h) as f64 * (b * a.pairs(t)) as f64;
        (mat, attn)
    }

    /// Backward FLOPs of the matrix products over `b` sequences of `t` positions: input
    /// gradients everywhere, weight gradients of the trained weights only
    /// ([`Op::matmul_backward_flops`]).
    pub fn backward_matmul_flops(&self, b: usize, t: usize) -> f64 {
        self.ops.iter().map(|op| op.matmul_backward_flops(b * t, self.frozen)).sum()
    }

    /// The range of HF tensor `suffix` in the layer's buffer.
    pub fn tensor(&self, suffix: &str) -> Option<Range<usize>> {
        self.tensors.iter().find(|t| t.name == suffix).map(TensorSpec::range)
    }

    /// Trained weights of the layer (its masters, gradients and moments).
    pub fn train_len(&self) -> usize {
        self.len - self.frozen
    }

    /// The gradient range of slot range `r`: `None` when it is frozen.
    pub fn grad_range(&self, r: &Range<usize>) -> Option<Range<usize>> {
        if r.start >= self.frozen {
            Some(r.start - self.frozen..r.end - self.frozen)
        } else {
            assert!(r.end <= self.frozen, "a weight straddles the frozen boundary");
            None
        }
    }

    /// The trained tensors (in slot order), their ranges relative to the trained part.
    pub fn trained(&self) -> impl Iterator<Item = &TensorSpec> {
        self.tensors.iter().filter(|t| t.stored == Stored::Slot && t.offset >= self.frozen)
    }

    /// The frozen tensors of the slot (in slot order), and the packed ones.
    pub fn frozen_tensors(&self) -> impl Iterator<Item = &TensorSpec> {
        self.tensors.iter().filter(|t| t.stored.is_packed() || t.offset < self.frozen)
    }
}

/// Writes a [`LayerSpec`]: tensors in buffer order, activations, ops.
pub struct LayerBuilder {
    c: usize,
    tensors: Vec<TensorSpec>,
    len: usize,
    acts: Vec<ActSpec>,
    ops: Vec<Op>,
}

impl LayerBuilder {
    /// A layer of hidden size C.
    pub fn new(c: usize) -> Self {
        LayerBuilder { c, tensors: Vec::new(), len: 0, acts: Vec::new(), ops: Vec::new() }
    }

    /// The next tensor of the flat buffer; returns its range.
    /// Where the next tensor starts.
    pub fn tensor_end(&self) -> usize {
        self.len
    }

    pub fn tensor(&mut self, name: &str, shape: &[usize], init: Init) -> Range<usize> {
        let spec = TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            offset: self.len,
            init,
            stored: Stored::Slot,
        };
        self.len += spec.numel();
        let r = spec.range();
        self.tensors.push(spec);
        r
    }

    /// A new activation buffer (N, width).
    pub fn act(&mut self, name: &'static str, width: usize) -> Act {
        self.acts.push(ActSpec { name, width, differentiable: true });
        IO_SLOTS + self.acts.len() - 1
    }

    /// A new saved statistic (N, width): no gradient flows through it.
    pub fn stat(&mut self, name: &'static str, width: usize) -> Act {
        self.acts.push(ActSpec { name, width, differentiable: false });
        IO_SLOTS + self.acts.len() - 1
    }

    pub fn op(&mut self, op: Op) {
        self.ops.push(op);
    }

    /// `out = rmsnorm(inp)` into new buffers named `out`/`rstd`.
    pub fn rmsnorm(
        &mut self,
        inp: Act,
        (out, rstd): (&'static str, &'static str),
        w: Range<usize>,
        w_offset: f32,
    ) -> Act {
        let (o, r) = (self.act(out, self.c), self.stat(rstd, 1));
        self.op(Op::RmsNorm { inp, out: o, rstd: r, w, w_offset });
        o
    }

    /// The finished layer: its backward derived and checked. Panics on a description that
    /// cannot be run (a programmer's bug in a family file).
    pub fn finish(self, kind: &'static str, attn: AttnSpec, eps: f32) -> LayerSpec {
        let mut spec = LayerSpec {
            kind,
            c: self.c,
            tensors: self.tensors,
            len: self.len,
            frozen: 0,
            packed: 0,
            workspace: 0,
            acts: self.acts,
            ops: self.ops,
            attn,
            eps,
            grads: vec![self.c],
            backward: Vec::new(),
            rebuild: Vec::new(),
        };
        spec.derive();
        spec
    }
}

impl LayerSpec {
    /// Check the description and derive its backward program (again, after an edit such as
    /// an adapter's).
    pub(crate) fn derive(&mut self) {
        check_saved(self);
        let (grads, backward) = derive_backward(self, self.c);
        self.grads = grads;
        self.backward = backward;
        self.rebuild = derive_rebuild(&self.ops);
    }
}

/// [`LayerSpec::rebuild_ops`] of `ops`: each RMSNorm whose output another op's backward reads.
fn derive_rebuild(ops: &[Op]) -> Vec<usize> {
    let read_by_others =
        |op: usize, a: Act| ops.iter().enumerate().any(|(j, o)| j != op && o.saved().contains(&a));
    (0..ops.len())
        .filter(|&i| matches!(ops[i], Op::RmsNorm { out, .. } if read_by_others(i, out)))
        .collect()
}

/// Every value a backward reads must still be the one its forward op saw: no later op of the
/// layer may overwrite it (Rope's in-place update counts as the writer its readers see).
fn check_saved(spec: &LayerSpec) {
    for (i, op) in spec.ops.iter().enumerate() {
        for a in op.saved() {
            if let Some(j) =
                (i + 1..spec.ops.len()).find(|&j| spec.ops[j].forward_io().1.contains(&a))
            {
                panic!(
                    "layer {}: op {i} ({op:?}) saves activation {a} for its backward, but op {j} \
                     overwrites it",
                    spec.kind
                );
            }
        }
        let (r, w) = op.forward_io();
        if !matches!(op, Op::Rope { .. } | Op::Lora { .. }) {
            let mut all = [r, w].concat();
            all.sort_unstable();
            assert!(all.windows(2).all(|p| p[0] != p[1]), "op {i} ({op:?}) repeats a buffer");
        }
        assert!(!op.forward_io().1.contains(&X), "op {i} writes the layer input");
    }
}

/// The gradient buffers' bookkeeping while the backward is derived.
struct GradAlloc {
    widths: Vec<usize>,
    /// Activations (by slot) whose gradient each buffer holds now.
    holders: Vec<usize>,
    /// The buffer holding each activation's gradient so far.
    of: Vec<Option<GradBuf>>,
}

impl GradAlloc {
    /// A buffer for a gradient of `width`: a free one of that width (the earliest freed) or a
    /// new one. `DRES` is reserved for the layer input's gradient.
    fn take(&mut self, width: usize, a: Act) -> GradBuf {
        let g = if a == X {
            assert_eq!(self.holders[DRES], 0, "dres still holds a live gradient when dL/dX starts");
            DRES
        } else {
            match (1..self.widths.len()).find(|&g| self.holders[g] == 0 && self.widths[g] == width)
            {
                Some(g) => g,
                None => {
                    self.widths.push(width);
                    self.holders.push(0);
                    self.widths.len() - 1
                }
            }
        };
        self.hold(a, g);
        g
    }

    /// A scratch buffer of `width` for one backward op; [`GradAlloc::free`] it after.
    fn temp(&mut self, width: usize) -> GradBuf {
        let g = match (1..self.widths.len())
            .find(|&g| self.holders[g] == 0 && self.widths[g] >= width)
        {
            Some(g) => g,
            None => {
                self.widths.push(width);
                self.holders.push(0);
                self.widths.len() - 1
            }
        };
        self.holders[g] += 1;
        g
    }

    fn free(&mut self, g: GradBuf) {
        self.holders[g] -= 1;
    }

    fn hold(&mut self, a: Act, g: GradBuf) {
        self.of[a] = Some(g);
        self.holders[g] += 1;
    }

    /// `a`'s value is produced here: its gradient is complete and, once read, dead.
    fn release(&mut self, a: Act) {
        if let Some(g) = self.of[a].take() {
            self.holders[g] -= 1;
        }
    }
}

/// Walk the ops last to first: each op's output gradients are complete when it is reached (every
/// reader of its outputs comes later in the forward); its input gradients are written (first
/// contribution) or accumulated. `Add` passes its output gradient to `b` without a copy. Returns
/// the gradient buffer widths and the program.
fn derive_backward(spec: &LayerSpec, c: usize) -> (Vec<usize>, Vec<BwdOp>) {
    let slots = IO_SLOTS + spec.acts.len();
    let mut ga = GradAlloc { widths: vec![c], holders: vec![0], of: vec![None; slots] };
    ga.hold(Y, DRES);
    let mut prog = Vec::new();
    let width = |a: Act| spec.width(a);
    let differentiable = |a: Act| a < IO_SLOTS || spec.acts[a - IO_SLOTS].differentiable;
    for (i, op) in spec.ops.iter().enumerate().rev() {
        // Gradients of this op's outputs (none: the output is unused, an error in the spec).
        let dout = |ga: &GradAlloc, a: Act| {
            ga.of[a].unwrap_or_else(|| panic!("op {i} ({op:?}): output {a} is never used"))
        };
        // An input gradient the op overwrites: the input must have no other contribution.
        let fresh = |ga: &mut GradAlloc, a: Act| {
            assert!(
                ga.of[a].is_none(),
                "op {i}: input {a} has two consumers and this op overwrites"
            );
            ga.take(width(a), a)
        };
        match *op {
            Op::Add { a, b, out } if a == X && dout(&ga, out) == DRES && ga.of[X].is_none() => {
                // The residual gradient stays in dres as X's; `b` gets a copy.
                ga.release(out);
                ga.hold(X, DRES);
                assert!(ga.of[b].is_none(), "op {i}: input {b} of an Add has two consumers");
                let dst = ga.take(width(b), b);
                prog.push(BwdOp::Copy { dst, src: DRES, width: width(b) });
            }
            Op::Add { a, b, out } => {
                let g = dout(&ga, out);
                match ga.of[a] {
                    Some(dst) => prog.push(BwdOp::Accumulate { dst, src: g, width: width(a) }),
                    None => {
                        let dst = ga.take(width(a), a);
                        prog.push(BwdOp::Copy { dst, src: g, width: width(a) });
                    }
                }
                assert!(ga.of[b].is_none(), "op {i}: input {b} of an Add has two consumers");
                ga.release(out);
                ga.hold(b, g);
            }
            Op::RmsNorm { inp, out, rstd, .. } => {
                let g = dout(&ga, out);
                let dinp = match ga.of[inp] {
                    Some(d) => d,
                    None => {
                        let d = ga.take(width(inp), inp);
                        prog.push(BwdOp::Zero { dst: d, width: width(inp) });
                        d
                    }
                };
                prog.push(BwdOp::RmsNorm { op: i, dinp, dout: g });
                ga.release(out);
                ga.release(rstd);
            }
            Op::HeadNorm { inp, out, rstd, .. } => {
                let g = dout(&ga, out);
                let dinp = fresh(&mut ga, inp);
                prog.push(BwdOp::HeadNorm { op: i, dinp, dout: g });
                ga.release(out);
                ga.release(rstd);
            }
            Op::Linear { inp, out, .. } => {
                let g = dout(&ga, out);
                let (dinp, acc) = write_or_add(&mut ga, inp, width(inp));
                prog.push(BwdOp::Linear { op: i, dinp, dout: g, acc });
                // The product's adapters follow it in the forward; their backward follows its
                // own, accumulating into the dinp it wrote, while `out`'s gradient is alive.
                for j in (i + 1..spec.ops.len()).take_while(|&j| is_lora_of(&spec.ops[j], out)) {
                    let Op::Lora { w, r, .. } = spec.ops[j] else { unreachable!() };
                    let (gs, du) = (ga.temp(w), ga.temp(r));
                    prog.push(BwdOp::Lora { op: j, dinp, dout: g, g: gs, du });
                    ga.free(gs);
                    ga.free(du);
                }
                ga.release(out);
            }
            // Emitted with its product's backward (above).
            Op::Lora { .. } => {}
            Op::Rope { qkv, .. } => {
                let g = dout(&ga, qkv);
                prog.push(BwdOp::Rope { op: i, dqkv: g });
            }
            Op::Attention { qkv, out, lse, .. } => {
                let g = dout(&ga, out);
                let dqkv = fresh(&mut ga, qkv);
                ga.release(out);
                ga.release(lse);
                prog.push(BwdOp::Attention { op: i, dqkv, dout: g });
            }
            Op::Glu { gu, out, .. } => {
                let g = dout(&ga, out);
                let dgu = fresh(&mut ga, gu);
                ga.release(out);
                prog.push(BwdOp::Glu { op: i, dgu, dout: g });
            }
            Op::SigmoidGate { gate, inp, out, .. } => {
                let g = dout(&ga, out);
                let dgate = fresh(&mut ga, gate);
                let dinp = fresh(&mut ga, inp);
                prog.push(BwdOp::SigmoidGate { op: i, dgate, dinp, dout: g });
                ga.release(out);
            }
            Op::Route { logits, probs, sel, wts, .. } => {
                let g = dout(&ga, wts);
                let dlogits = fresh(&mut ga, logits);
                prog.push(BwdOp::Route { op: i, dlogits, dwts: g });
                ga.release(wts);
                ga.release(probs);
                ga.release(sel);
            }
            Op::Experts { inp, wts, out, gu, k, i: f, c: cw, ref lora, .. } => {
                let g = dout(&ga, out);
                let dwts = fresh(&mut ga, wts);
                let (dinp, acc) = write_or_add(&mut ga, inp, width(inp));
                let (u, t) = lora.widths(f, cw);
                let widths = [cw, f, f, 2 * f, cw, f, 2 * k, u, t, 2 * f];
                let t = widths.map(|w| ga.temp(w));
                prog.push(BwdOp::Experts { op: i, dinp, acc, dout: g, dwts, t });
                t.iter().for_each(|&b| ga.free(b));
                ga.release(out);
                ga.release(gu);
            }
        }
        for a in op.forward_io().0 {
            assert!(differentiable(a), "op {i} reads statistic {a} as an input");
        }
    }
    assert_eq!(ga.of[X], Some(DRES), "the layer input's gradient ends in dres");
    (ga.widths, prog)
}

/// The gradient buffer of an input an op writes or, when a later consumer already contributed,
/// adds to: (buffer, accumulate).
fn write_or_add(ga: &mut GradAlloc, a: Act, width: usize) -> (GradBuf, bool) {
    match ga.of[a] {
        Some(g) => (g, true),
        None => (ga.take(width, a), false),
    }
}

/// True when `op` is an adapter on the product that wrote `out`.
fn is_lora_of(op: &Op, out: Act) -> bool {
    matches!(*op, Op::Lora { out: o, .. } if o == out)
}
