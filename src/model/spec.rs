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
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
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
    Linear { inp: Act, out: Act, w: Range<usize>, bias: Option<Range<usize>>, ic: usize, oc: usize },
    /// Rotary embedding in place on the q and k parts, with the model's rope table `table`.
    Rope { qkv: Act, table: usize },
    /// Causal (windowed) attention as the layer's [`AttnSpec`] says.
    Attention { qkv: Act, out: Act, lse: Act },
    /// `out = a + b`.
    Add { a: Act, b: Act, out: Act },
    /// `out = act(gate) * up`, gate_up (N, 2F) -> (N, F).
    Glu { gu: Act, out: Act, act: Glu, f: usize },
}

impl Op {
    /// The activations the op reads in its forward, and those it writes.
    fn forward_io(&self) -> (Vec<Act>, Vec<Act>) {
        match *self {
            Op::RmsNorm { inp, out, rstd, .. } | Op::HeadNorm { inp, out, rstd, .. } => {
                (vec![inp], vec![out, rstd])
            }
            Op::Linear { inp, out, .. } => (vec![inp], vec![out]),
            Op::Rope { qkv, .. } => (vec![qkv], vec![qkv]),
            Op::Attention { qkv, out, lse } => (vec![qkv], vec![out, lse]),
            Op::Add { a, b, out } => (vec![a, b], vec![out]),
            Op::Glu { gu, out, .. } => (vec![gu], vec![out]),
        }
    }

    /// The activations the op's backward reads (saved inputs and statistics).
    fn saved(&self) -> Vec<Act> {
        match *self {
            Op::RmsNorm { inp, rstd, .. } | Op::HeadNorm { inp, rstd, .. } => vec![inp, rstd],
            Op::Linear { inp, .. } => vec![inp],
            Op::Rope { .. } | Op::Add { .. } => vec![],
            Op::Attention { qkv, out, lse } => vec![qkv, out, lse],
            Op::Glu { gu, .. } => vec![gu],
        }
    }

    /// Forward FLOPs of the matrix products over `n` rows (attention counted apart).
    pub fn matmul_flops(&self, n: usize) -> f64 {
        match *self {
            Op::Linear { ic, oc, .. } => 2.0 * (n * ic * oc) as f64,
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
    /// Linear backward: `dinp =` (overwrites), weight and bias gradients `+=`.
    Linear { op: usize, dinp: GradBuf, dout: GradBuf },
    /// Inverse rotation in place on `dqkv`.
    Rope { op: usize, dqkv: GradBuf },
    /// Attention backward: `dqkv =` (overwrites).
    Attention { op: usize, dqkv: GradBuf, dout: GradBuf },
    /// Gated activation backward: `dgu =` (overwrites).
    Glu { op: usize, dgu: GradBuf, dout: GradBuf },
}

/// One decoder layer, described: tensors, activations, ops, and the derived backward.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    /// What kind of layer this is (`full_attention`, `sliding_attention`), for the plan.
    pub kind: &'static str,
    /// Hidden size C (the width of X, Y and the residual gradient).
    pub c: usize,
    /// Every HF tensor of the layer, in buffer order.
    pub tensors: Vec<TensorSpec>,
    /// Total weights of one layer.
    pub len: usize,
    /// The layer's own activations (slots `IO_SLOTS..`).
    pub acts: Vec<ActSpec>,
    pub ops: Vec<Op>,
    pub attn: AttnSpec,
    pub eps: f32,
    /// Widths of the gradient buffers (index [`DRES`] is the residual gradient, width C).
    pub grads: Vec<usize>,
    /// The backward program, derived from `ops`.
    pub backward: Vec<BwdOp>,
}

impl LayerSpec {
    /// Width of activation slot `a` (X and Y are C wide).
    pub fn width(&self, a: Act) -> usize {
        if a < IO_SLOTS { self.c } else { self.acts[a - IO_SLOTS].width }
    }

    /// Forward FLOPs over `b` sequences of `t` positions: (matrix products, attention).
    pub fn forward_flops(&self, b: usize, t: usize) -> (f64, f64) {
        let mat = self.ops.iter().map(|op| op.matmul_flops(b * t)).sum();
        let a = &self.attn;
        let attn = 4.0 * (a.d * a.h) as f64 * (b * a.pairs(t)) as f64;
        (mat, attn)
    }

    /// The range of HF tensor `suffix` in the layer's buffer.
    pub fn tensor(&self, suffix: &str) -> Option<Range<usize>> {
        self.tensors.iter().find(|t| t.name == suffix).map(TensorSpec::range)
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
    pub fn tensor(&mut self, name: &str, shape: &[usize], init: Init) -> Range<usize> {
        let spec =
            TensorSpec { name: name.to_string(), shape: shape.to_vec(), offset: self.len, init };
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
            acts: self.acts,
            ops: self.ops,
            attn,
            eps,
            grads: vec![self.c],
            backward: Vec::new(),
        };
        check_saved(&spec);
        let (grads, backward) = derive_backward(&spec, self.c);
        spec.grads = grads;
        spec.backward = backward;
        spec
    }
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
        if !matches!(op, Op::Rope { .. }) {
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
                let dinp = fresh(&mut ga, inp);
                ga.release(out);
                prog.push(BwdOp::Linear { op: i, dinp, dout: g });
            }
            Op::Rope { qkv, .. } => {
                let g = dout(&ga, qkv);
                prog.push(BwdOp::Rope { op: i, dqkv: g });
            }
            Op::Attention { qkv, out, lse } => {
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
        }
        for a in op.forward_io().0 {
            assert!(differentiable(a), "op {i} reads statistic {a} as an input");
        }
    }
    assert_eq!(ga.of[X], Some(DRES), "the layer input's gradient ends in dres");
    (ga.widths, prog)
}
