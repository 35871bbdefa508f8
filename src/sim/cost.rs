//! The cost model: how long each op of a plan takes on a [`Hardware`] profile (see
//! docs/projection.md, "The cost model"). Device ops by roofline (or, on `this-cpu`, by this machine's
//! measured kernel times), copies by the link's bandwidth, host ops by a [`HostModel`] (their
//! bytes and the host's rates, or on `this-cpu` the passes themselves timed here).

use horizon_backend::Queue;
use horizon_backend::cpu::GATHER_SERIAL_ELEMS;
use horizon_backend::threads::QueueCpus;

use crate::engine::chunking::Chunking;
use crate::engine::options::EngineConfig;
use crate::engine::options::{GradWire, WeightPath};
use crate::engine::plan::{GradTarget, OpKind, ParamBuf, Res, SlotContent};
use crate::engine::sizes::Sizes;
use crate::model::chunks::ExpertSplit;
use crate::model::layout::ModelLayout;
use crate::model::lora::BaseDtype;
use crate::model::spec::{AttnSpec, LayerSpec, Op, Stored, Weight};
use crate::optim::state::OptimizerMemory;
use crate::sim::des::{Cost, Sharing};
use crate::sim::hardware::{Hardware, Host};

/// How a layer's bf16 weights reach the link (`engine.weight_upload`; docs/invariants.md on
/// images and stages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UploadPath {
    /// fp32 weights as they are (the CPU device).
    Fp32,
    /// Rounded from the fp32 masters inside the upload, on the host, chunk by chunk.
    RoundInUpload,
    /// A bf16 image kept beside the masters, written by the optimizer: a pure copy.
    Image,
    /// Rounded by a host-queue op (`OpKind::StageWeights`) into the slot's stage ahead of the
    /// link: the upload is a pure copy of the stage.
    Staged,
}

impl UploadPath {
    /// The engine's weight path for this upload path.
    pub fn weights(self) -> WeightPath {
        match self {
            UploadPath::Fp32 | UploadPath::RoundInUpload => WeightPath::Masters,
            UploadPath::Image => WeightPath::Image,
            UploadPath::Staged => WeightPath::Staged,
        }
    }
}

/// A device's kernel times.
pub trait DeviceModel {
    /// `out (m, n) = inp (m, k) · w (n, k)ᵀ`.
    fn gemm(&self, m: usize, k: usize, n: usize) -> f64;
    /// Its backward: `dinp (m, k) = dout (m, n) · w`, and with `dweight`
    /// `dw (n, k) += doutᵀ · inp`.
    fn gemm_backward(&self, m: usize, k: usize, n: usize, dweight: bool) -> f64 {
        self.gemm(m, n, k) + if dweight { self.gemm(n, m, k) } else { 0.0 }
    }
    /// Attention of a layer over `b` sequences of `t` positions, forward or backward.
    fn attention(&self, a: &AttnSpec, b: usize, t: usize, backward: bool) -> f64;
    /// An elementwise pass moving `bytes` on the device.
    fn stream(&self, bytes: f64) -> f64;
    /// A gated unit `act(gate) * up` over (n, 2f) -> (n, f), forward or backward.
    fn glu(&self, n: usize, f: usize, backward: bool) -> f64 {
        let bytes = (n * 3 * f) as f64 * ACT_BYTES;
        self.stream(if backward { 2.0 * bytes } else { bytes })
    }
    /// Cross-entropy over (n, v) logits (softmax, loss, logits turned into their gradient).
    fn cross_entropy(&self, n: usize, v: usize) -> f64 {
        self.stream((n * v) as f64 * 2.0 * ACT_BYTES)
    }
    /// Fixed cost of one kernel launch.
    fn launch(&self) -> f64;
    /// Whether the device's kernels run on the host's cores (the CPU device).
    fn on_host(&self) -> bool;
}

/// A pass of host work over a buffer: what a host op runs (see [`HostModel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostPass {
    /// AdamW over fp32 moments (`eight_bit`: 8-bit ones), writing the bf16 image as well with
    /// `image`.
    Update { eight_bit: bool, image: bool },
    /// One part of the embedding's update with fp32 moments (writing the bf16 image as well
    /// with `image`), its gradient zeroed in the same walk: the rows the next step gathers
    /// (`next`: scattered rows, one run each) or the rest (the runs between them). Elements:
    /// the part's rows x C. Row by row, its memory is not streamed as a whole buffer's is.
    UpdateRows { next: bool, image: bool },
    /// A squared norm of fp32 gradients.
    Measure,
    /// The squared norm of an untied embedding's gradient, read from the rows the step's
    /// tokens name (elements: rows x C), row by row.
    MeasureRows,
    /// A gradient slab, as it travelled (fp32, or bf16 with `bf16_slab`), added into the fp32
    /// gradients.
    Accumulate { bf16_slab: bool },
    /// A bf16 slab expanded to fp32.
    Expand,
    /// Zeroing fp32 gradients (a serial fill).
    Zero,
    /// The embedding's scatter-add of staged rows into its gradient (elements: rows x C).
    Scatter,
    /// The embedding gather of rows from the table (elements: rows x C), on the H2D queue's
    /// thread over every core.
    Gather,
    /// Rounding fp32 masters to bf16 inside an upload, over every core.
    Round,
}

/// The host's time for host work.
pub trait HostModel {
    /// Seconds of `pass` over `elems` elements with the host to itself: on the host queue's
    /// pool, except where [`HostPass`] says otherwise.
    fn pass(&self, pass: HostPass, elems: usize) -> f64;
    /// Fixed seconds of handing one op to the host queue's pool, besides its passes.
    fn dispatch(&self) -> f64;
    /// Seconds of copy queue `q`'s memcpy of `bytes` (the CPU device's link copies), on one
    /// thread.
    fn memcpy(&self, q: Queue, bytes: usize) -> f64;
}

/// The rate-based host model (the GPU profiles): a pass over `n` elements takes
/// `n / min(per-core rate x threads, memory GB/s / bytes per element)`; no fixed costs.
pub struct HostByRates<'a> {
    pub host: &'a Host,
    /// Threads of the host queue's pool.
    pub threads: usize,
}

impl HostByRates<'_> {
    /// Seconds of a pass over `elems` at `per_core` elements/s on `threads` threads, moving
    /// `bytes` each, up to the memory bandwidth.
    fn at(&self, elems: f64, per_core: f64, threads: usize, bytes: f64) -> f64 {
        elems / (per_core * threads as f64).min(self.host.mem_gbps * 1e9 / bytes)
    }

    /// A memory-bound pass moving `bytes` per element, at the per-core copy rate.
    fn stream(&self, elems: f64, threads: usize, bytes: f64) -> f64 {
        self.at(elems, self.host.rates.copy_gbps * 1e9 / bytes, threads, bytes)
    }
}

impl HostModel for HostByRates<'_> {
    fn pass(&self, pass: HostPass, elems: usize) -> f64 {
        let (r, e, t) = (&self.host.rates, elems as f64, self.threads);
        match pass {
            HostPass::Update { eight_bit: true, image: false } => self.at(e, r.adamw8bit, t, 16.0),
            HostPass::Update { eight_bit: true, image: true } => {
                self.at(e, r.adamw8bit_image, t, 18.0)
            }
            HostPass::Update { eight_bit: false, image: false } => self.at(e, r.adamw, t, 28.0),
            HostPass::Update { eight_bit: false, image: true } => {
                self.at(e, r.adamw_image, t, 30.0)
            }
            // Rows of thousands of elements (a GPU-sized model's): streamed like a whole buffer.
            HostPass::UpdateRows { image, .. } => {
                let update = HostPass::Update { eight_bit: false, image };
                self.pass(update, elems) + self.pass(HostPass::Zero, elems)
            }
            HostPass::Accumulate { bf16_slab: false } => self.at(e, r.accumulate_f32, t, 12.0),
            HostPass::Accumulate { bf16_slab: true } => self.at(e, r.accumulate_bf16, t, 10.0),
            // Rows of thousands of elements: streamed like a whole buffer.
            HostPass::Measure | HostPass::MeasureRows | HostPass::Expand | HostPass::Zero => {
                self.stream(e, t, 4.0)
            }
            HostPass::Scatter => self.stream(e, t, 12.0),
            HostPass::Gather => {
                let threads = if elems < GATHER_SERIAL_ELEMS { 1 } else { self.host.cores };
                self.stream(e, threads, 8.0)
            }
            HostPass::Round => self.at(e, r.round_bf16, t, 6.0),
        }
    }

    fn dispatch(&self) -> f64 {
        0.0
    }

    fn memcpy(&self, _: Queue, bytes: usize) -> f64 {
        2.0 * bytes as f64 / (self.host.rates.copy_gbps * 1e9)
    }
}

/// Everything the cost of an op depends on.
pub struct CostModel<'a> {
    pub layout: &'a ModelLayout,
    pub sizes: &'a Sizes,
    pub cfg: &'a EngineConfig,
    pub hw: &'a Hardware,
    pub device: &'a dyn DeviceModel,
    pub host: &'a dyn HostModel,
    pub upload: UploadPath,
    /// Threads of the host pool (the optimizer's).
    pub host_threads: usize,
    /// Which layers stream their experts in chunks under `cfg` (`Chunking::of`; the same for
    /// every variant a projection tries: none changes `expert_chunk` or the memory mode).
    pub chunking: &'a Chunking,
}

/// Bytes per element of activations on the device (fp32 on every backend).
const ACT_BYTES: f64 = 4.0;

impl CostModel<'_> {
    fn rows(&self) -> usize {
        self.sizes.mb_rows
    }

    fn seqs(&self) -> usize {
        self.cfg.micro_batch_size
    }

    /// A layer's forward kernels on one micro-batch.
    pub fn layer_forward(&self, l: &LayerSpec) -> f64 {
        self.ops_forward(l, l.ops.len())
    }

    /// The forward kernels of a layer's first `ops` ops on one micro-batch.
    fn ops_forward(&self, l: &LayerSpec, ops: usize) -> f64 {
        let n = self.rows();
        let d = self.device;
        let products: f64 = l.ops[..ops]
            .iter()
            .map(|op| match *op {
                Op::Linear { ic, oc, ref w, .. } => d.gemm(n, ic, oc) + self.dequant(w),
                Op::Lora { ic, r, w, .. } => d.gemm(n, ic, r) + d.gemm(n, r, w),
                Op::Attention { .. } => d.attention(&l.attn, self.seqs(), self.cfg.seq_len, false),
                Op::Experts { .. } => self.experts(l, op, false),
                _ => 0.0,
            })
            .sum();
        let elementwise: f64 = l.ops[..ops].iter().map(|op| self.elementwise_forward(l, op)).sum();
        products + elementwise + ops as f64 * d.launch()
    }

    /// A layer's backward kernels on one micro-batch (without the recompute of its forward).
    pub fn layer_backward(&self, l: &LayerSpec) -> f64 {
        let n = self.rows();
        let d = self.device;
        let mut t = 0.0;
        for op in &l.ops {
            t += 2.0 * d.launch()
                + match *op {
                    Op::Linear { ic, oc, ref w, .. } => {
                        let dw = matches!(w, Weight::Slot(r) if r.start >= l.frozen);
                        d.gemm_backward(n, ic, oc, dw) + self.dequant(w)
                    }
                    Op::Lora { ic, r, w, .. } => {
                        d.gemm_backward(n, ic, r, true) + d.gemm_backward(n, r, w, true)
                    }
                    Op::Attention { .. } => {
                        d.attention(&l.attn, self.seqs(), self.cfg.seq_len, true)
                    }
                    // Its own kernel, in place of twice the forward's traffic below.
                    Op::Glu { f, .. } => d.glu(n, f, true) - 2.0 * d.glu(n, f, false),
                    Op::Experts { .. } => self.experts(l, op, true),
                    _ => 0.0,
                };
        }
        // Elementwise backwards read the forward's inputs and the output gradient and write
        // the input gradient: twice the forward's traffic.
        t + 2.0 * self.layer_forward_elementwise(l)
    }

    /// What a layer that kept its internals runs before its backward: its rebuild ops
    /// ([`LayerSpec::rebuild_ops`], norms), each a pass over its input and output.
    pub fn layer_rebuild(&self, l: &LayerSpec) -> f64 {
        let ops = l.rebuild_ops().iter();
        ops.map(|&i| self.elementwise_forward(l, &l.ops[i]) + self.device.launch()).sum()
    }

    fn layer_forward_elementwise(&self, l: &LayerSpec) -> f64 {
        l.ops.iter().map(|op| self.elementwise_forward(l, op)).sum()
    }

    /// One op's forward if it is elementwise (its activations' bytes at the stream rate), else
    /// 0.
    fn elementwise_forward(&self, l: &LayerSpec, op: &Op) -> f64 {
        let n = self.rows() as f64;
        let d = self.device;
        let width = |a: usize| l.width(a) as f64;
        match *op {
            Op::RmsNorm { inp, out, .. } | Op::HeadNorm { inp, out, .. } => {
                d.stream(n * (width(inp) + width(out)) * ACT_BYTES)
            }
            Op::Rope { qkv, .. } => d.stream(n * 2.0 * width(qkv) * ACT_BYTES),
            Op::Add { .. } => d.stream(n * 3.0 * l.c as f64 * ACT_BYTES),
            Op::Glu { f, .. } => d.glu(self.rows(), f, false),
            _ => 0.0,
        }
    }

    /// A sparse layer's experts over one micro-batch: the M = N*k (row, choice) pairs spread
    /// evenly over the experts they are expected to reach (`E (1 - (1 - 1/E)^M)`), each active
    /// expert's two products (and their adapters) on its share of the rows, one launch each,
    /// its packed matrices (NF4, MXFP4) dequantised first, and the dispatch's traffic: gather and
    /// combine of (M, C), the SwiGLU of (M, I). The backward: each product's two, the SwiGLU's,
    /// gather and combine again, and the forward's SwiGLU and dequantisation once more.
    fn experts(&self, l: &LayerSpec, op: &Op, backward: bool) -> f64 {
        let Op::Experts { e, k, i, c, ref lora, ref packed, ref gate_up, .. } = *op else {
            unreachable!()
        };
        let (d, m) = (self.device, (self.rows() * k) as f64);
        let active = e as f64 * (1.0 - (1.0 - 1.0 / e as f64).powf(m));
        let rows = (m / active.max(1.0)).ceil() as usize;
        let trained = !gate_up.is_empty() && gate_up.start >= l.frozen;
        let product = |ic, oc, dw| match backward {
            false => d.gemm(rows, ic, oc),
            true => d.gemm_backward(rows, ic, oc, dw),
        };
        let gemm = |ic, oc| product(ic, oc, trained);
        let adapter = |a: &Option<crate::model::spec::ExpertLora>, ic, oc| {
            a.as_ref().map_or(0.0, |a| product(ic, a.r, true) + product(a.r, oc, true))
        };
        let per_expert = gemm(c, 2 * i)
            + gemm(i, c)
            + adapter(&lora.gate_up, c, 2 * i)
            + adapter(&lora.down, i, c)
            + packed.as_ref().map_or(0.0, |w| {
                let bytes = packed_bytes(&w[0][0]);
                d.stream((3 * i * c) as f64 * (bytes + 2.0))
            })
            + 2.0 * d.launch();
        let pairs = m as usize;
        let traffic = d.stream(m * 3.0 * c as f64 * ACT_BYTES) + d.glu(pairs, i, false);
        let glu_back = if backward { d.glu(pairs, i, true) } else { 0.0 };
        active * per_expert + traffic * if backward { 2.0 } else { 1.0 } + glu_back
    }

    /// Dequantising a packed weight into the workspace before its product (bf16 out).
    fn dequant(&self, w: &Weight) -> f64 {
        match w {
            Weight::Slot(_) => 0.0,
            Weight::Packed(_) => self.device.stream(w.numel() as f64 * (packed_bytes(w) + 2.0)),
        }
    }

    /// Vocabulary rows of head tile `t` (the last one ragged).
    fn tile_rows(&self, t: usize) -> usize {
        self.sizes.head.range(t).len()
    }

    /// The LM head on `rows` vocabulary rows: forward product, cross-entropy, and (with
    /// `backward`) its two backward products.
    fn head_part(&self, vrows: usize, forward: bool, backward: bool) -> f64 {
        let (n, c) = (self.rows(), self.layout.dims.c);
        let d = self.device;
        let mut t = 0.0;
        if forward {
            t += d.gemm(n, c, vrows) + d.cross_entropy(n, vrows);
        }
        if backward {
            let dw = self.layout.trains_base();
            t += d.gemm_backward(n, c, vrows, dw);
        }
        t + 2.0 * d.launch()
    }

    fn final_norm(&self) -> f64 {
        let (n, c) = (self.rows() as f64, self.layout.dims.c as f64);
        self.device.stream(n * c * 3.0 * ACT_BYTES) + self.device.launch()
    }

    /// How the ops share the host in the simulation: the host's `contended`, and on the CPU
    /// device the part of the host its copy threads run on, the CPUs the pinned host threads
    /// leave them ([`threads::QueueCpus`], as the engine places them; all, when nothing is
    /// pinned or the host threads take every CPU).
    pub fn sharing(&self) -> Sharing {
        let queue_cpus = match self.device.on_host() {
            true => QueueCpus::beside_host_threads(self.host_threads, self.cfg.pin_threads).others,
            false => Vec::new(),
        };
        let cores = self.hw.host.cores.max(1);
        let queue_share = match queue_cpus.len() {
            0 => 1.0,
            k => (k as f64 / cores as f64).min(1.0),
        };
        Sharing { contended: self.hw.host.contended, queue_share }
    }

    /// Copy queue `q`'s memcpy of `bytes`: its time alone and the share of the host it uses, one
    /// core, which its thread takes as it wakes (see [`Cost::host_first`]).
    fn host_thread(&self, q: Queue, bytes: f64) -> Cost {
        Cost::host_first(self.host.memcpy(q, bytes as usize), 1.0 / self.hw.host.cores as f64)
    }

    /// Host work `s` of the host queue, and the fixed cost of handing it to the pool: on the
    /// engine's own pool of `host_threads` threads, so at most that share of the host's cores.
    fn pool(&self, s: f64) -> Cost {
        let share = (self.host_threads as f64 / self.hw.host.cores as f64).min(1.0);
        Cost::host(s + self.host.dispatch(), share)
    }

    /// Seconds of host pass `p` over `elems` elements.
    fn pass(&self, p: HostPass, elems: usize) -> f64 {
        self.host.pass(p, elems)
    }

    /// A copy of `bytes` over the link in direction `q`: the link's time, and on the CPU device
    /// the queue thread's memcpy.
    fn copy(&self, q: Queue, bytes: f64) -> Cost {
        let link = &self.hw.link;
        let gbps = if q == Queue::H2D { link.h2d_gbps } else { link.d2h_gbps };
        let wire = if gbps > 0.0 { bytes / (gbps * 1e9) + link.latency_us * 1e-6 } else { 0.0 };
        let c = Cost::fixed(wire);
        if self.device.on_host() { c.with_host(self.host_thread(q, bytes)) } else { c }
    }

    /// Kernel work: on the device's own engine, or on the CPU device's share of the host.
    fn kernel(&self, s: f64) -> Cost {
        if self.device.on_host() { Cost::host(s, 1.0) } else { Cost::fixed(s) }
    }

    /// Elements of a host parameter buffer.
    fn buf_len(&self, p: ParamBuf) -> usize {
        let d = &self.layout.dims;
        match p {
            ParamBuf::Embed => d.v * d.c,
            ParamBuf::Layer(i) => self.layout.layer(i).train_len(),
            ParamBuf::FinalNorm => d.c,
            ParamBuf::Head => d.v * d.c,
        }
    }

    /// The squared norm of the embedding's gradient: over the rows the step's tokens name (at
    /// most one per token), or the whole table with a tied head, whose gradient fills it.
    fn embed_norm(&self) -> f64 {
        let d = &self.layout.dims;
        if self.layout.tied {
            self.pass(HostPass::Measure, d.v * d.c)
        } else {
            self.pass(HostPass::MeasureRows, self.tokens_per_step().min(d.v) * d.c)
        }
    }

    /// Tokens of a step: every micro-batch's rows.
    fn tokens_per_step(&self) -> usize {
        self.rows() * self.sizes.micro_batches
    }

    /// Whether buffer `p` is trained (an adapter run trains only the layers' adapters).
    fn trained(&self, p: ParamBuf) -> bool {
        matches!(p, ParamBuf::Layer(_)) || self.layout.trains_base()
    }

    /// One AdamW update of buffer `p`'s `elems` (fp32 or 8-bit moments; with the bf16 image
    /// write if the buffer is uploaded from one: not the embedding, which is gathered on the
    /// host from the fp32 masters).
    fn update(&self, p: ParamBuf, elems: usize) -> f64 {
        let uploaded = p != ParamBuf::Embed || self.layout.tied;
        let image = self.upload == UploadPath::Image && uploaded;
        let eight_bit = self.cfg.memory == OptimizerMemory::Compact;
        self.pass(HostPass::Update { eight_bit, image }, elems)
    }

    /// A host op updating `elems` of buffer `p`, then zeroing their gradient for the next step.
    fn update_op(&self, p: ParamBuf, elems: usize) -> Cost {
        self.pool(self.update(p, elems) + self.pass(HostPass::Zero, elems))
    }

    /// Chunked layer `layer`'s split (a chunk op names only such a layer).
    fn split(&self, layer: usize) -> &ExpertSplit {
        self.chunking.split(layer).expect("a chunk op's layer streams its experts in chunks")
    }

    /// Layer `layer`'s experts (forward, or backward), all of them.
    fn experts_of(&self, layer: usize, backward: bool) -> f64 {
        let l = self.layout.layer(layer);
        let ops = l.ops.iter().filter(|op| matches!(op, Op::Experts { .. }));
        ops.map(|op| self.experts(l, op, backward)).sum()
    }

    /// [`Self::experts_of`] when the layer streams its experts in chunks (their own ops then
    /// run them), else 0.
    fn chunked_experts(&self, layer: usize, backward: bool) -> f64 {
        match self.chunking.split(layer).is_some() {
            true => self.experts_of(layer, backward),
            false => 0.0,
        }
    }

    /// Elements of a gradient download (and its accumulation).
    fn grad_len(&self, what: GradTarget) -> usize {
        let d = &self.layout.dims;
        match what {
            GradTarget::Layer(i) => self.chunking.layer_grad(self.layout, i),
            GradTarget::Head => d.c + d.v * d.c,
            GradTarget::Experts { layer, chunk } => self.split(layer).chunks[chunk].train_len,
        }
    }

    /// Chunk `chunk`'s share of its layer's experts.
    fn chunk_share(&self, layer: usize, chunk: usize) -> f64 {
        let s = self.split(layer);
        s.experts_of(chunk).len() as f64 / s.experts as f64
    }

    /// A layer's weights on the wire (`held`: the weights and packed words its slot holds,
    /// all of it or its trunk), and the host work of getting them there.
    fn upload_layer(&self, l: &LayerSpec, (len, packed): (usize, usize)) -> Cost {
        let wb = self.sizes.precision.weight_bytes() as f64;
        let bytes = len as f64 * wb + packed as f64 * 4.0;
        let c = self.copy(Queue::H2D, bytes);
        let rounded = match self.layout.adapter.as_ref().map(|a| a.base) {
            Some(BaseDtype::Bf16) => l.train_len(),
            _ => len,
        };
        if self.upload == UploadPath::Staged {
            // The stage holds the trained part; an fp32 frozen base is still rounded on the way.
            return self.rounded_in(c, (rounded - l.train_len()) as f64);
        }
        self.with_rounding(c, rounded as f64)
    }

    /// `StageWeights`: rounding `what`'s trained weights into its slot's stage, on the host
    /// queue's pool.
    fn stage(&self, what: SlotContent) -> Cost {
        let d = &self.layout.dims;
        let elems = match what {
            SlotContent::Layer(i) => self.layout.layer(i).train_len(),
            _ if !self.layout.trains_base() => 0,
            SlotContent::Head => d.c + d.v * d.c,
            SlotContent::HeadTile(t) => d.c + self.tile_rows(t) * d.c,
            SlotContent::Experts { .. } => 0,
        };
        self.pool(self.pass(HostPass::Round, elems))
    }

    /// `c` plus the rounding of `elems` fp32 masters to bf16 inside the upload, if the path
    /// does that (on the upload's pool, with the whole host).
    fn with_rounding(&self, c: Cost, elems: f64) -> Cost {
        if self.upload != UploadPath::RoundInUpload {
            return c;
        }
        self.rounded_in(c, elems)
    }

    /// `c` with `elems` rounded inside it.
    fn rounded_in(&self, c: Cost, elems: f64) -> Cost {
        if elems == 0.0 {
            return c;
        }
        c.with_host(Cost::host(self.pass(HostPass::Round, elems as usize), 1.0))
    }

    /// The cost of one op.
    pub fn op(&self, kind: &OpKind, reads: &[Res]) -> Cost {
        let d = &self.layout.dims;
        let (n, act) = (self.rows() as f64, self.sizes.act as f64 * ACT_BYTES);
        let wb = self.sizes.precision.weight_bytes() as f64;
        let grad_b = match self.cfg.grad_wire {
            GradWire::Fp32 => 4.0,
            GradWire::Bf16 => 2.0,
        };
        match *kind {
            OpKind::UploadIds { .. } => self.copy(Queue::H2D, n * 4.0),
            // A gather of the rows (read and write, 8 bytes an element): on the H2D queue's
            // own thread when small, taking its core like a copy; else over every core.
            OpKind::EmbedGather { .. } => {
                let n = self.rows() * d.c;
                let s = self.pass(HostPass::Gather, n);
                if n < GATHER_SERIAL_ELEMS {
                    Cost::host_first(s, 1.0 / self.hw.host.cores as f64)
                } else {
                    Cost::host(s, 1.0)
                }
            }
            OpKind::UploadAct { .. } => self.copy(Queue::H2D, act),
            OpKind::UploadWeights { what, .. } => match what {
                SlotContent::Layer(i) => {
                    let l = self.layout.layer(i);
                    let held = self.chunking.trunk(i).map(|m| (m.len, m.packed));
                    self.upload_layer(l, held.unwrap_or((l.len, l.packed)))
                }
                SlotContent::Experts { layer, chunk } => {
                    let m = &self.split(layer).chunks[chunk];
                    let bytes = m.len as f64 * wb + m.packed as f64 * 4.0;
                    let fp32_base =
                        self.layout.adapter.as_ref().map(|a| a.base) == Some(BaseDtype::F32);
                    let c = self.copy(Queue::H2D, bytes);
                    if fp32_base { self.rounded_in(c, m.len as f64) } else { c }
                }
                SlotContent::Head => {
                    let e = (d.c + d.v * d.c) as f64;
                    let c = self.copy(Queue::H2D, e * wb);
                    if self.layout.trains_base() { self.with_rounding(c, e) } else { c }
                }
                SlotContent::HeadTile(t) => {
                    let e = (self.tile_rows(t) * d.c) as f64;
                    let c = self.copy(Queue::H2D, e * wb);
                    if self.layout.trains_base() { self.with_rounding(c, e) } else { c }
                }
            },
            OpKind::StageWeights { what, .. } => self.stage(what),
            OpKind::SaveCkpt { .. } | OpKind::DownloadDres { .. } => self.copy(Queue::D2H, act),
            OpKind::Forward { layer, .. } => {
                let l = self.layout.layer(layer);
                self.kernel(self.layer_forward(l) - self.chunked_experts(layer, false))
            }
            OpKind::ForwardExperts { layer, chunk, .. } => {
                self.kernel(self.chunk_share(layer, chunk) * self.experts_of(layer, false))
            }
            OpKind::BackwardExperts { layer, chunk, .. } => {
                self.kernel(self.chunk_share(layer, chunk) * self.experts_of(layer, true))
            }
            OpKind::ForwardEnd { .. } => self.kernel(self.device.launch()),
            // With more than one micro-batch, the ops before the experts are recomputed first.
            OpKind::BackwardEnd { layer, .. } => {
                let l = self.layout.layer(layer);
                let x = l.ops.iter().position(|op| matches!(op, Op::Experts { .. }));
                let before = x.expect("a chunked layer has experts");
                let rebuild =
                    if self.cfg.micro_batches() > 1 { self.ops_forward(l, before) } else { 0.0 };
                self.kernel(self.device.launch() + rebuild)
            }
            OpKind::ZeroDw { .. } => self.kernel(self.device.stream(self.sizes.dw as f64 * 4.0)),
            // A host op that writes one element when a test asks it to.
            OpKind::PoisonGrad { .. } => self.pool(0.0),
            OpKind::Head { .. } => {
                let v = d.v;
                self.kernel(2.0 * self.final_norm() + self.head_part(v, true, true))
            }
            OpKind::HeadStats { tile, .. } => {
                self.kernel(self.head_part(self.tile_rows(tile), true, false))
            }
            OpKind::HeadGrad { first, tile, .. } => {
                let norm = if first { self.final_norm() } else { 0.0 };
                self.kernel(norm + self.head_part(self.tile_rows(tile), true, true))
            }
            OpKind::HeadFinish { .. } => self.kernel(self.final_norm()),
            OpKind::ZeroDnorm => self.kernel(self.device.launch()),
            OpKind::Backward { layer, .. } => {
                let l = self.layout.layer(layer);
                let kept = reads.iter().any(|r| matches!(r, Res::Stash { .. }));
                let fwd = if kept { self.layer_rebuild(l) } else { self.layer_forward(l) };
                let experts =
                    self.chunked_experts(layer, false) + self.chunked_experts(layer, true);
                self.kernel(fwd + self.layer_backward(l) - experts)
            }
            OpKind::DownloadLosses { .. } => self.copy(Queue::D2H, n * 4.0),
            OpKind::DownloadDw { what, .. } => {
                let e = self.grad_len(what) as f64;
                let b = if matches!(what, GradTarget::Head) { 4.0 } else { grad_b };
                self.copy(Queue::D2H, e * b)
            }
            OpKind::DownloadHeadGrads { .. } => {
                self.copy(Queue::D2H, (d.c + d.v * d.c) as f64 * 4.0)
            }
            OpKind::DownloadHeadTileGrads { tile, .. } => {
                self.copy(Queue::D2H, (self.tile_rows(tile) * d.c) as f64 * 4.0)
            }
            OpKind::DownloadNormGrads => self.copy(Queue::D2H, d.c as f64 * 4.0),
            OpKind::SlabUpdate { layer, .. } => {
                let e = self.buf_len(ParamBuf::Layer(layer));
                let expand = if self.cfg.grad_wire == GradWire::Bf16 {
                    self.pass(HostPass::Expand, e)
                } else {
                    0.0
                };
                let measure = self.pass(HostPass::Measure, e);
                self.pool(expand + measure + self.update(ParamBuf::Layer(layer), e))
            }
            OpKind::MeasureSlab { layer, .. } => {
                self.pool(self.pass(HostPass::Measure, self.buf_len(ParamBuf::Layer(layer))))
            }
            OpKind::HeldSlabUpdate { layer, .. } => {
                let p = ParamBuf::Layer(layer);
                self.pool(self.update(p, self.buf_len(p)))
            }
            OpKind::Measure { what: ParamBuf::Embed } if self.layout.trains_base() => {
                self.pool(self.embed_norm())
            }
            OpKind::Measure { what } if self.trained(what) => {
                self.pool(self.pass(HostPass::Measure, self.buf_len(what)))
            }
            OpKind::Measure { .. } => self.pool(0.0),
            // The streamed modes measure the embedding's gradient here (its scatters are done).
            OpKind::GradNorm if self.cfg.memory.streams_updates() && self.layout.trains_base() => {
                self.pool(self.embed_norm())
            }
            OpKind::GradNorm => self.pool(0.0),
            OpKind::AccumulateGrads { what, .. } => {
                let e = self.grad_len(what);
                let bf16_slab = self.cfg.grad_wire == GradWire::Bf16;
                self.pool(self.pass(HostPass::Accumulate { bf16_slab }, e))
            }
            OpKind::EmbedScatter { .. } if self.layout.trains_base() => {
                self.pool(self.pass(HostPass::Scatter, self.rows() * d.c))
            }
            // The step's norm sums the squared norms measured as each gradient completed.
            OpKind::Update { what } if self.trained(what) => {
                self.update_op(what, self.buf_len(what))
            }
            OpKind::EmbedUpdate { next } if self.layout.trains_base() => {
                let (v, c) = (d.v, d.c);
                // 8-bit moments update whole blocks: the first part takes every row.
                if self.cfg.memory == OptimizerMemory::Compact {
                    let e = if next { v * c } else { 0 };
                    return self.update_op(ParamBuf::Embed, e);
                }
                // The rows the next step gathers: at most one per token of the step.
                let first = self.tokens_per_step().min(v);
                let rows = if next { first } else { v - first };
                let image = self.upload == UploadPath::Image && self.layout.tied;
                self.pool(self.pass(HostPass::UpdateRows { next, image }, rows * c))
            }
            _ => Cost::default(),
        }
    }
}

/// Bytes a value of packed weight `w` is read from: NF4's half byte and an fp32 absmax per 64,
/// or MXFP4's half byte and a scale byte per 32.
fn packed_bytes(w: &Weight) -> f64 {
    match w {
        Weight::Packed(parts) if parts.first().is_some_and(|p| p.stored == Stored::Mxfp4) => {
            0.5 + 1.0 / 32.0
        }
        _ => 0.5 + 4.0 / 64.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::hardware::HostRates;

    fn host(mem_gbps: f64) -> Host {
        Host { cores: 8, mem_gbps, memory_gib: 64.0, rates: HostRates::default(), contended: 1.0 }
    }

    #[test]
    fn rate_passes_scale_with_threads_up_to_the_memory_bandwidth() {
        let (fast, slow) = (host(f64::INFINITY), host(10.0));
        let r = HostRates::default();
        let n = 1 << 20;
        let update = HostPass::Update { eight_bit: false, image: false };
        let one = HostByRates { host: &fast, threads: 1 }.pass(update, n);
        let four = HostByRates { host: &fast, threads: 4 }.pass(update, n);
        assert!((one - n as f64 / r.adamw).abs() < 1e-12, "{one}");
        assert!((one / four - 4.0).abs() < 1e-9, "{one} vs {four}");
        // 28 bytes an element at 10 GB/s, whatever the threads.
        let capped = HostByRates { host: &slow, threads: 8 }.pass(update, n);
        assert!((capped - n as f64 * 28.0 / 10e9).abs() < 1e-12, "{capped}");
        let by = HostByRates { host: &fast, threads: 2 };
        assert_eq!(by.dispatch(), 0.0, "the rate model has no fixed costs");
        assert!((by.memcpy(Queue::H2D, 1000) - 2000.0 / (r.copy_gbps * 1e9)).abs() < 1e-15);
    }
}
