//! `Sizes`: every buffer the engine allocates, from the model's description and the engine
//! config: the single source of the allocation (`exec.rs`) and of the memory plan
//! (`memory.rs`), which both depend on it rather than on each other.

use horizon_backend::Precision;
use horizon_backend::pool::ALIGN_ELEMS;

use crate::engine::chunking::Chunking;
use crate::engine::head_tiles::{HeadTiling, STATS};
use crate::engine::options::EngineConfig;
use crate::engine::options::{GradWire, WeightPath};
use crate::model::layout::ModelLayout;
use crate::model::spec::Op;
use crate::optim::moments::MomentStorage;
use crate::optim::state::OptimizerMemory;
use crate::store::{HostDtype, host_tensors, tensor_bytes};

/// Sizes (in f32 elements unless said otherwise) of every buffer the engine allocates: the
/// single source for the allocation and for the memory plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    /// One weight slot, in weights: the largest layer (with a quantised base, its weights and
    /// then its packed NF4 words); the head is applied in tiles that fit beside the final
    /// norm, or whole where it fits.
    pub slot: usize,
    /// One of the two expert slots, in weights: the largest chunk of a chunked layer's
    /// experts (`engine.expert_chunk`; 0 when every layer is held whole).
    pub chunk_slot: usize,
    /// Chunks of each chunked layer's experts (1 when every layer is held whole).
    pub expert_chunks: usize,
    /// One of the two gradient accumulators of trained chunks (f32; 0 when the chunked
    /// experts are frozen or none are chunked).
    pub chunk_dw: usize,
    /// One gradient accumulator (f32): the slot in full fine-tuning; in an adapter run the
    /// largest layer's adapters (the frozen head has no gradient).
    pub dw: usize,
    /// The dequantisation workspace of a quantised base, in weights (0 without one).
    pub dequant: usize,
    /// How the LM head's vocabulary is cut into tiles (one tile: applied whole).
    pub head: HeadTiling,
    /// Tiled head: per micro-batch `hf`, `dhf` (N, C), `rstd` (N), softmax stats (N, 3);
    /// 0 when the head is whole (its buffers are then part of the scratch).
    pub head_rows: usize,
    /// Tiled head: the logits chunk (chunk, tile rows) and the `dhf` chunk (chunk, C); 0 when
    /// whole.
    pub head_chunk: usize,
    /// Tiled head: the final norm's gradient accumulator (C); 0 when whole.
    pub dnorm: usize,
    /// The weight slots' format (fp32 on the CPU, bf16 on CUDA).
    pub precision: Precision,
    /// Bytes of the backend's workspace (0 on the CPU): bf16 copies of the largest product's
    /// inputs, the cuBLAS workspace, the bf16 gradient chunk.
    pub workspace_bytes: usize,
    /// `engine.grad_wire`: the format of the host gradient slabs.
    pub grad_wire: GradWire,
    /// One host gradient slab: one layer (the head's gradient goes straight to its own host
    /// buffers).
    pub slab: usize,
    /// `optimizer.memory`.
    pub memory: OptimizerMemory,
    /// Elements of the host gradient buffers kept besides the slabs: the whole model (exact),
    /// or embedding + final norm + untied head (lean, compact).
    pub host_grads: usize,
    /// Host bytes of the optimizer state, in the memory mode's storage.
    pub moment_bytes: usize,
    /// Host bytes of the trained masters (fp32).
    pub master_bytes: usize,
    /// Host bytes of an adapter run's frozen base by dtype ([`BASE_DTYPES`]; 0 in full
    /// fine-tuning).
    pub base_bytes: [usize; 4],
    /// The row length every buffer is sized for (`EngineConfig::seq_len`).
    pub seq_len: usize,
    /// Rows of a micro-batch at the longest row length.
    pub mb_rows: usize,
    /// One residual-stream buffer: (mb_rows, C).
    pub act: usize,
    /// Residual-stream sets per micro-batch.
    pub act_sets: usize,
    pub micro_batches: usize,
    /// Host checkpoint blocks.
    pub blocks: usize,
    pub grad_slabs: usize,
    /// The compute queue's scratch: one layer's internals and gradients for one micro-batch,
    /// the head scratch, the rope tables.
    pub scratch: usize,
    /// Per micro-batch: ids + targets + losses (mb_rows each).
    pub per_mb_small: usize,
    /// A mixture of experts' compute-queue buffers: a micro-batch's row mask (mb_rows), the
    /// pooled load-balancing statistics (2E) and their gradient (E); 0 for a dense model.
    pub moe: usize,
    /// A chunked layer's pass: the internals and gradients each micro-batch after the first
    /// carries from its first part to its last (`Carried`; the first's are the scratch's).
    pub expert_rows: usize,
    /// Buffers of `expert_rows`.
    pub expert_row_buffers: usize,
    /// Kept forward internals, every layer and micro-batch (0 when the backward recomputes).
    pub stash: usize,
    /// Sets of kept internals (layers x micro-batches; 0 when the backward recomputes), each
    /// `act_buffers` buffers.
    pub stash_sets: usize,
    /// Buffers one layer that keeps its internals keeps (of its description's activations).
    pub act_buffers: usize,
    /// Buffers of the compute queue's scratch (internals, gradient scratch, layer output, head
    /// scratch, rope tables).
    pub scratch_buffers: usize,
    /// Parameters of the model.
    pub params: usize,
    /// bf16 elements of the weight image (`WeightPath::Image`; 0 without one).
    pub image: usize,
    /// bf16 elements of the reference copy of the starting weights (`reference_copy`: every
    /// trained element; 0 without one).
    pub reference: usize,
    /// bf16 elements of each of the two weight stages (`WeightPath::Staged`, one per slot: the
    /// largest upload's trained weights, [`stage_elems`]; 0 without them).
    pub stage: usize,
    /// Whether the device page-locks its staging buffers (`BackendKind::pins_staging`).
    pub pins_staging: bool,
    /// Page-locked host bytes the device holds of its own (the CUDA device's bf16 weight
    /// upload ring; 0 on the CPU): `BackendKind::device_pinned_bytes`.
    pub device_pinned: usize,
    /// fp32 gradients the device downloads straight into the host store, page-locked in place
    /// where the device pins (`Device::pin_host`): the final norm's and the head's (the
    /// embedding's when tied), in full fine-tuning; 0 in an adapter run.
    pub pinned_grads: usize,
}

/// Elements of the trained buffers the device receives, which a weight image holds: every
/// layer's trained part, and in full fine-tuning the final norm and the head (the embedding
/// when tied; an untied embedding is gathered on the host from the masters).
pub fn image_elems(layout: &ModelLayout) -> usize {
    let d = &layout.dims;
    let layers: usize = (0..d.layers).map(|i| layout.layer(i).train_len()).sum();
    layers + if layout.trains_base() { d.c + d.v * d.c } else { 0 }
}

/// Elements of the largest upload's trained weights, which a weight stage holds: a layer's
/// trained part, or in full fine-tuning the final norm and one tile of the head (`head`).
pub fn stage_elems(layout: &ModelLayout, head: &HeadTiling) -> usize {
    let d = &layout.dims;
    let layers = (0..d.layers).map(|i| layout.layer(i).train_len()).max().unwrap_or(0);
    let head = if layout.trains_base() { d.c + head.rows.min(d.v) * d.c } else { 0 };
    layers.max(head)
}

impl Sizes {
    pub fn new(layout: &ModelLayout, cfg: &EngineConfig) -> Self {
        let d = &layout.dims;
        let mb_rows = cfg.micro_batch_size * cfg.seq_len;
        let chunk = cfg.head_chunk_rows.clamp(1, mb_rows.max(1));
        let n = mb_rows;
        // From the layer descriptions: every activation and gradient buffer, (N, width) each.
        let (act_widths, grad_widths) = (layout.max_act_widths(), layout.max_grad_widths());
        let layer_acts = n * act_widths.iter().sum::<usize>();
        // What a layer that keeps its internals keeps: the values its backward reads and cannot
        // rebuild (`LayerSpec::stashed`); the rest share the scratch.
        let stashed = layout.stashed_acts();
        let kept_widths = || act_widths.iter().zip(&stashed).filter(|(_, s)| **s).map(|(w, _)| w);
        let layer_kept = n * kept_widths().sum::<usize>();
        // When every layer keeps its internals, nothing recomputes into the scratch: it holds
        // only what they do not keep (the executor's `alloc_device`).
        // A chunked layer keeps nothing, and recomputes into the scratch.
        let chunking = Chunking::of(layout, cfg);
        let keepers = chunking.keepers(d.layers, cfg.kept_layers).into_iter().filter(|&k| k);
        let kept_layers = keepers.count();
        let keeps_all = kept_layers == d.layers;
        let scratch_acts = if keeps_all { layer_acts - layer_kept } else { layer_acts };
        let layer_scratch = scratch_acts + n * d.c; // y
        let grad_scratch = n * grad_widths[1..].iter().sum::<usize>();
        let precision = cfg.backend.precision();
        // A slot holds the largest layer, or of a layer whose experts stream in chunks its
        // trunk (`Chunking::layer_slot`).
        let layer_slot = chunking.layer_slot(layout, precision.weight_bytes());
        let head = HeadTiling::for_slot(layout, layer_slot, cfg.head_tile_rows);
        let whole = head.is_whole();
        let head_scratch = if whole { n * d.c * 2 + n + chunk * d.v } else { 0 };
        let rope = layout.rope.len() * 2 * cfg.seq_len * d.d / 2;
        let params = layout.num_params();
        let (trained, frozen): (Vec<_>, Vec<_>) =
            host_tensors(layout).into_iter().partition(|t| t.trainable);
        let vc = d.v * d.c;
        // Embedding, final norm and untied head: trained in full fine-tuning only.
        let model_level =
            if layout.trains_base() { vc + d.c + if layout.tied { 0 } else { vc } } else { 0 };
        let host_grads =
            if cfg.memory.streams_updates() { model_level } else { layout.trained_params() };
        let products = largest_product(layout, cfg, n, (chunk, head.rows));
        let slot = layer_slot.max(d.c + head.rows * d.c);
        let (expert_rows, expert_row_buffers) = carried_rows(layout, cfg, &chunking, n);
        Sizes {
            expert_rows,
            expert_row_buffers,
            slot,
            chunk_slot: chunking.chunk_slot(precision.weight_bytes()),
            expert_chunks: chunking.chunks(),
            chunk_dw: chunking.chunk_grad(),
            // A layer's trained part, or of a chunked layer its trunk's.
            dw: if layout.trains_base() {
                slot
            } else {
                (0..d.layers).map(|i| chunking.layer_grad(layout, i)).max().unwrap_or(0)
            },
            dequant: layout.max_workspace(),
            head,
            head_rows: if whole { 0 } else { n * (2 * d.c + 1 + STATS) },
            head_chunk: if whole { 0 } else { chunk * (head.rows + d.c) },
            dnorm: if whole { 0 } else { d.c },
            precision: cfg.backend.precision(),
            workspace_bytes: cfg.backend.precision().workspace(products).bytes,
            grad_wire: cfg.grad_wire,
            slab: layout.max_train_len(),
            memory: cfg.memory,
            host_grads,
            moment_bytes: cfg.memory.moment_storage().bytes(&layout.buffer_tensors().concat()),
            master_bytes: tensor_bytes(&trained),
            base_bytes: base_bytes(&frozen),
            seq_len: cfg.seq_len,
            mb_rows,
            act: n * d.c,
            act_sets: cfg.checkpoint_every.max(2),
            micro_batches: cfg.micro_batches(),
            blocks: d.layers.div_ceil(cfg.checkpoint_every),
            grad_slabs: cfg.grad_slabs,
            scratch: layer_scratch + grad_scratch + head_scratch + rope,
            per_mb_small: 3 * n,
            moe: layout.moe.as_ref().map_or(0, |m| n + 3 * m.num_experts),
            stash: kept_layers * cfg.micro_batches() * layer_kept,
            stash_sets: kept_layers * cfg.micro_batches(),
            act_buffers: kept_widths().count(),
            scratch_buffers: act_widths.len() - if keeps_all { kept_widths().count() } else { 0 }
                + grad_widths.len()
                + if whole { 4 } else { 2 }
                + 2 * layout.rope.len(),
            params,
            image: if cfg.weight_path() == WeightPath::Image { image_elems(layout) } else { 0 },
            reference: if cfg.reference_copy { tensor_bytes(&trained) / 4 } else { 0 },
            stage: if cfg.weight_path() == WeightPath::Staged {
                stage_elems(layout, &head)
            } else {
                0
            },
            pins_staging: cfg.backend.pins_staging(),
            device_pinned: cfg.backend.device_pinned_bytes(),
            pinned_grads: if layout.trains_base() { d.c + vc } else { 0 },
        }
    }

    /// f32 elements of pool memory one weight slot takes (`slot` weights of the precision).
    pub fn slot_elems(&self) -> usize {
        (self.slot * self.precision.weight_bytes()).div_ceil(4)
    }

    /// f32 elements of pool memory one expert slot takes.
    pub fn chunk_slot_elems(&self) -> usize {
        (self.chunk_slot * self.precision.weight_bytes()).div_ceil(4)
    }

    /// f32 elements of pool memory the dequantisation workspace takes.
    pub fn dequant_elems(&self) -> usize {
        (self.dequant * self.precision.weight_bytes()).div_ceil(4)
    }

    /// f32 elements of pool memory the backend's workspace takes.
    pub fn workspace_elems(&self) -> usize {
        self.workspace_bytes.div_ceil(4)
    }

    /// Device bytes by kind: weight slots, gradient accumulators, activations, scratch, the
    /// backend's workspace, kept internals, (tiled head) its per-micro-batch rows, its chunk
    /// and the final norm's accumulator, and the pool's rounding of every buffer up to its
    /// alignment.
    pub fn device_bytes(&self) -> Vec<(&'static str, usize)> {
        let m = self.micro_batches;
        let tiled = !self.head.is_whole();
        // Buffers `Engine::new` allocates: slots and accumulators, per micro-batch the residual
        // streams, residual gradient, ids, targets, losses (and, tiled, the head's hf, dhf,
        // rstd, stats); the scratch; the workspace; the final norm's accumulator.
        let chunked = self.chunk_slot > 0;
        let buffers = 5
            + 2 * usize::from(chunked)
            + 2 * usize::from(self.chunk_dw > 0)
            + m * (self.act_sets + 4 + if tiled { 4 } else { 0 })
            + self.scratch_buffers
            + usize::from(self.workspace_bytes > 0)
            + usize::from(tiled)
            + self.stash_sets * self.act_buffers
            + self.expert_row_buffers
            + if self.moe > 0 { 3 } else { 0 };
        let slots = match self.precision {
            Precision::F32 => "weight slots (2, fp32)",
            Precision::Bf16 => "weight slots (2, bf16: half the bytes of fp32)",
        };
        let mut lines = vec![
            (slots, 2 * self.slot_elems() * 4),
            ("gradient accumulators (2, fp32)", 2 * self.dw * 4),
            (
                "dequantisation workspace (the largest NF4 or MXFP4 weight)",
                self.dequant_elems() * 4,
            ),
            (
                "activations (residual streams, checkpoint block, gradients, ids)",
                (m * self.act_sets * self.act + m * self.act + m * self.per_mb_small) * 4,
            ),
            (
                if tiled {
                    "workspace (one layer's internals and gradients, rope)"
                } else {
                    "workspace (one layer's internals and gradients, head chunk, rope)"
                },
                self.scratch * 4,
            ),
            (
                "backend workspace (bf16 product and attention inputs, cuBLAS, bf16 gradient chunk)",
                self.workspace_elems() * 4,
            ),
            ("kept layer internals (engine.recompute)", self.stash * 4),
        ];
        if self.moe > 0 {
            lines.push(("mixture of experts: row mask, load-balancing statistics", self.moe * 4));
        }
        if chunked {
            let what = "expert slots (2: a chunk of a layer's experts each, engine.expert_chunk)";
            lines.push((what, 2 * self.chunk_slot_elems() * 4));
            if self.chunk_dw > 0 {
                let what = "expert gradient accumulators (2: a trained chunk's each, fp32)";
                lines.push((what, 2 * self.chunk_dw * 4));
            }
            if self.expert_rows > 0 {
                let what = "later micro-batches' internals across a chunked layer's pass";
                lines.push((what, self.expert_rows * 4));
            }
        }
        if tiled {
            lines.extend([
                (
                    "LM head rows, per micro-batch (hf, dhf: N x C; rstd; stats: N x 3)",
                    m * self.head_rows * 4,
                ),
                ("LM head chunk (logits: chunk x tile rows; dhf: chunk x C)", self.head_chunk * 4),
                ("final norm gradient accumulator (C, fp32)", self.dnorm * 4),
            ]);
        }
        lines.push((
            "alignment (each buffer rounded up to 64 bytes, at most)",
            buffers * ALIGN_ELEMS * 4,
        ));
        lines
    }

    /// Host bytes of the gradient slabs: fp32, or bf16 plus (streamed updates) one fp32 layer
    /// the host expands a slab into for its AdamW update.
    pub fn slab_bytes(&self) -> usize {
        match self.grad_wire {
            GradWire::Fp32 => self.grad_slabs * self.slab * 4,
            GradWire::Bf16 => {
                let expand = if self.memory.streams_updates() { self.slab * 4 } else { 0 };
                self.grad_slabs * self.slab * 2 + expand
            }
        }
    }

    /// Host bytes of the gradient slabs the device's staging holds (the fp32 layer a bf16 slab
    /// is expanded into for a streamed update is ordinary memory, not staging).
    fn slab_staging_bytes(&self) -> usize {
        let elem = match self.grad_wire {
            GradWire::Fp32 => 4,
            GradWire::Bf16 => 2,
        };
        self.grad_slabs * self.slab * elem
    }

    /// Host bytes of the embedding rows, residual gradients and losses staged per micro-batch.
    fn io_staging_bytes(&self) -> usize {
        self.micro_batches * (2 * self.act + self.mb_rows) * 4
    }

    /// Host bytes of the checkpoints.
    fn checkpoint_bytes(&self) -> usize {
        self.blocks * self.micro_batches * self.act * 4
    }

    /// Host bytes of every buffer the engine takes from `Device::alloc_staging`: checkpoints,
    /// gradient slabs, the embedding rows, residual gradients and losses.
    pub fn staging_bytes(&self) -> usize {
        self.checkpoint_bytes() + self.slab_staging_bytes() + self.io_staging_bytes()
    }

    /// Host bytes of the two weight stages (`WeightPath::Staged`; 0 without them).
    pub fn stage_bytes(&self) -> usize {
        2 * self.stage * 2
    }

    /// Page-locked host bytes once the engine is built: its staging, the weight image, the
    /// gradients the device downloads into in place and the device's own pinned buffers, where
    /// the device pins (CUDA); 0 on the CPU backend, which pins nothing. Every byte is one of
    /// [`Sizes::host_bytes`]' lines already (a part of the host total, not more). Each buffer
    /// is pinned at its exact size, so this is exactly what the CUDA device reports as
    /// `DeviceStats::pinned_bytes`.
    pub fn pinned_bytes(&self) -> usize {
        if self.pins_staging {
            self.staging_bytes()
                + self.device_pinned
                + self.image * 2
                + self.reference * 2
                + self.stage_bytes()
                + self.pinned_grads * 4
        } else {
            0
        }
    }

    /// Host bytes by kind.
    pub fn host_bytes(&self) -> Vec<(&'static str, usize)> {
        let moments = match self.memory.moment_storage() {
            MomentStorage::Q8 => {
                "AdamW moments (8-bit m, sqrt v, a scale per 256; small tensors fp32)"
            }
            MomentStorage::F32 => "AdamW moments (fp32 m, v)",
        };
        let grads = if self.memory.streams_updates() {
            "gradients (fp32: embedding, norm, head; layers via the slabs)"
        } else {
            "gradients (fp32, whole model)"
        };
        let slabs = match (self.grad_wire, self.memory.streams_updates()) {
            (GradWire::Fp32, _) => "gradient slabs (fp32)",
            (GradWire::Bf16, false) => "gradient slabs (bf16, engine.grad_wire)",
            (GradWire::Bf16, true) => "gradient slabs (bf16, engine.grad_wire; + one fp32 layer)",
        };
        let base = BASE_DTYPES.iter().map(|&(_, line)| line);
        let mut lines: Vec<(&'static str, usize)> =
            base.zip(self.base_bytes).filter(|&(_, b)| b > 0).collect();
        lines.extend([
            ("master weights (fp32, the trained tensors)", self.master_bytes),
            (moments, self.moment_bytes),
            (grads, self.host_grads * 4),
            (slabs, self.slab_bytes()),
            ("staging (embedding rows, residual gradients, losses)", self.io_staging_bytes()),
            ("checkpoints", self.checkpoint_bytes()),
        ]);
        if self.image > 0 {
            lines.push(("bf16 weight image (page-locked; engine.weight_upload)", self.image * 2));
        }
        if self.reference > 0 {
            let copy = "DPO reference: the starting weights, bf16 (page-locked; dpo.reference)";
            lines.push((copy, self.reference * 2));
        }
        if self.stage > 0 {
            let stages = "bf16 weight stages (2 of the largest upload, page-locked)";
            lines.push((stages, self.stage_bytes()));
        }
        if self.device_pinned > 0 {
            let ring = "the device's bf16 weight upload ring (2 chunks, page-locked)";
            lines.push((ring, self.device_pinned));
        }
        lines
    }

    pub fn device_total(&self) -> usize {
        self.device_bytes().iter().map(|(_, b)| b).sum()
    }

    pub fn host_total(&self) -> usize {
        self.host_bytes().iter().map(|(_, b)| b).sum()
    }
}

/// The workspace each attention layer's kernels take over `n` rows (the products' share of
/// the workspace, between products): [`Precision::attention_bytes`].
pub(crate) fn attention_bytes(
    layout: &ModelLayout,
    n: usize,
    precision: Precision,
) -> impl Iterator<Item = usize> + '_ {
    layout
        .kinds
        .iter()
        .filter(|k| k.ops.iter().any(|op| matches!(op, Op::Attention { .. })))
        .map(move |k| precision.attention_bytes(n, k.attn.h, k.attn.kvh, k.attn.d))
}

/// The bytes of the largest product a step runs (its workspace): the layers' products on `n`
/// rows (an expert takes each row at most once: at most N rows a product), the head's on a
/// chunk of `chunk` rows by `head_rows` vocabulary rows, and attention's.
fn largest_product(
    layout: &ModelLayout,
    cfg: &EngineConfig,
    n: usize,
    (chunk, head_rows): (usize, usize),
) -> usize {
    let precision = cfg.backend.precision();
    layout
        .kinds
        .iter()
        .flat_map(|k| k.ops.iter())
        .flat_map(|op| match *op {
            Op::Linear { ic, oc, .. } => vec![(n, ic, oc)],
            Op::Experts { i, c, .. } => vec![(n, c, 2 * i), (n, i, c)],
            _ => vec![],
        })
        .chain(std::iter::once((chunk, layout.dims.c, head_rows)))
        .map(|(n, ic, oc)| precision.product_bytes(n, ic, oc))
        .chain(attention_bytes(layout, n, precision))
        .max()
        .unwrap_or(0)
}

/// The elements and buffers of what the micro-batches after the first carry of a chunked
/// layer's pass between its parts (each its own copy): `(elements, buffers)`.
fn carried_rows(
    layout: &ModelLayout,
    cfg: &EngineConfig,
    chunking: &Chunking,
    n: usize,
) -> (usize, usize) {
    let carried = chunking.carried(layout);
    let widths = || carried.acts.iter().chain(&carried.grads).filter(|&&w| w > 0);
    let later_mbs = if chunking.any() { cfg.micro_batches() - 1 } else { 0 };
    (later_mbs * n * widths().sum::<usize>(), later_mbs * widths().count())
}

/// The frozen base's dtypes, each with its line in the host plan.
const BASE_DTYPES: [(HostDtype, &str); 4] = [
    (HostDtype::F32, "frozen base, fp32"),
    (HostDtype::Bf16, "frozen base, bf16"),
    (HostDtype::Nf4, "frozen base, NF4 (4 bits a value + an fp32 absmax per 64)"),
    (
        HostDtype::Mxfp4,
        "frozen base, MXFP4 (4 bits a value + a scale byte per 32: gpt-oss's experts)",
    ),
];

/// Host bytes of the frozen tensors by dtype, in [`BASE_DTYPES`]' order.
fn base_bytes(frozen: &[crate::store::HostTensor]) -> [usize; 4] {
    BASE_DTYPES.map(|(d, _)| {
        tensor_bytes(&frozen.iter().filter(|t| t.dtype == d).cloned().collect::<Vec<_>>())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CUDA backend's workspace holds attention's bf16 q, k, v and dout and its row sums
    /// for every attention layer, also where they outgrow every product's inputs (H D above
    /// C, as in Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024).
    #[test]
    fn the_workspace_holds_attention_where_it_outgrows_the_products() {
        let cfg = serde_json::json!({"model_type": "qwen3", "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
            "head_dim": 32, "intermediate_size": 64, "vocab_size": 16});
        let layout = crate::model::describe(
            &crate::hf::config::ModelConfig::from_json(&cfg, "test").unwrap(),
        );
        // Steps of 2 rows of up to 64 positions, on the CUDA backend.
        let ecfg = EngineConfig {
            micro_batch_size: 2,
            seq_len: 64,
            ..EngineConfig::small(crate::engine::options::BackendKind::Cuda)
        };
        assert_eq!(ecfg.backend.precision(), Precision::Bf16);
        let s = Sizes::new(&layout, &ecfg);
        let (n, p) = (s.mb_rows, Precision::Bf16);
        let attention = p.attention_bytes(n, 8, 8, 32);
        // The layer's largest products: qkv (64 -> 768) and o (256 -> 64).
        let products = p.product_bytes(n, 64, 768).max(p.product_bytes(n, 256, 64));
        assert!(attention > products, "H D = 256 outgrows C = 64: {attention} vs {products}");
        assert!(s.workspace_bytes >= p.workspace(attention).bytes, "{}", s.workspace_bytes);
    }
}
