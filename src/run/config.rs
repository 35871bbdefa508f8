//! The run configuration: one YAML file, read in two stages — [`RawConfig`] (serde, unknown keys
//! refused, every field documented with its default) and [`RunConfig`] (validated and derived).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::adapter::{AdapterConfig, AdapterSection};
use crate::data::{Columns, OnError};
use crate::engine::options::EngineConfig;
use crate::hf::hub_cache;
use crate::optim::adamw::AdamWConfig;
use crate::optim::lr::{LrSchedule, ScheduleKind};

// The engine's options, parsed here (the engine knows nothing of YAML).
pub use crate::engine::options::{
    BackendKind, GradWire, HostThreads, Recompute, WeightPath, WeightUpload,
};
pub use crate::optim::decay::NoDecay;
pub use crate::optim::state::OptimizerMemory;
pub use crate::run::dpo_config::{DpoSection, Objective, ReferenceMode};

/// The YAML file as written by the user. Every key except `model.path` and `data.path` has a
/// default.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Which model to train.
    pub model: ModelSection,
    /// Which data to train on.
    pub data: DataSection,
    /// Length and shape of the run.
    #[serde(default)]
    pub train: TrainSection,
    /// AdamW hyper-parameters and clipping.
    #[serde(default)]
    pub optimizer: OptimizerSection,
    /// Where results go.
    #[serde(default)]
    pub output: OutputSection,
    /// How the step is executed.
    #[serde(default)]
    pub engine: EngineSection,
    /// The compute device.
    #[serde(default)]
    pub device: DeviceSection,
    /// LoRA / QLoRA fine-tuning instead of full fine-tuning. Default `type: none`.
    #[serde(default, skip_serializing_if = "AdapterSection::is_default")]
    pub adapter: AdapterSection,
    /// Preference training (`train.objective: dpo`): the loss, its beta, the reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo: Option<DpoSection>,
}

/// Which model to train: a Hugging Face directory, or a randomly initialised one described by
/// HF `config.json` keys written here.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct ModelSection {
    /// A Hugging Face model directory: `config.json` + `model.safetensors` (or shards with
    /// `model.safetensors.index.json`). Relative paths are taken from the working directory.
    /// Or a Hub id, `ORG/NAME` (`ORG/NAME@REV`), when no such path exists: its snapshot in the
    /// local Hugging Face cache (docs/models.md); [`RawConfig::resolve`] puts the directory here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// The revision of a Hub id `path`: a branch, tag or commit hash. Default `main`. Cleared
    /// once resolved (the snapshot's directory names its commit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// `random`: initialise the weights HF-style (normal(0, `initializer_range`) matrices, unit
    /// norms, zero biases) instead of loading them. Default: load from `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<ModelInit>,
    /// Seed of the random initialisation. Default 0.
    #[serde(default)]
    pub seed: u64,
    /// `model_type` of a random model (`llama`, `qwen2`, `mistral`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<String>,
    /// Load checkpoint weights that hold NaN or ±inf (with a warning) instead of refusing
    /// them with the tensor and index. Default false.
    #[serde(default)]
    pub allow_non_finite: bool,
    /// Any other key is a HF `config.json` key (`hidden_size`, `num_hidden_layers`, ...),
    /// overriding the directory's `config.json` when there is one.
    #[serde(flatten)]
    pub hf: serde_json::Map<String, serde_json::Value>,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ModelInit {
    Random,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// JSONL rows `{"input_ids": [...], "labels": [...]}` (labels optional, HF convention:
    /// unshifted, -100 = no loss).
    #[default]
    Pretokenized,
    /// Uniformly random tokens, `train.max_seq_len` per row (benchmarks); needs no file.
    Synthetic,
    /// `{"text": ...}`: tokenized, EOS-terminated, cut into `train.max_seq_len` windows.
    Text,
    /// `{"instruction", "input"?, "output"}` in the Alpaca prompt; loss on the output.
    Alpaca,
    /// `{"messages": [{"role", "content"}, ...]}` rendered with the tokenizer's chat template;
    /// loss on assistant turns.
    Chat,
    /// `{"conversations": [{"from": human | gpt | system, "value"}, ...]}` (ShareGPT), trained
    /// as `chat`.
    Sharegpt,
    /// Preference pairs for `train.objective: dpo`, in any form TRL takes: `prompt` / `chosen`
    /// / `rejected` as text or as lists of messages, `chosen` / `rejected` alone (an implicit
    /// prompt), or `prompt_input_ids` / `chosen_input_ids` / `rejected_input_ids`.
    Preference,
}

impl DataFormat {
    /// The format's name in the config.
    pub fn name(self) -> &'static str {
        match self {
            DataFormat::Pretokenized => "pretokenized",
            DataFormat::Synthetic => "synthetic",
            DataFormat::Text => "text",
            DataFormat::Alpaca => "alpaca",
            DataFormat::Chat => "chat",
            DataFormat::Sharegpt => "sharegpt",
            DataFormat::Preference => "preference",
        }
    }

    /// The field names `data.columns` may map (none for `synthetic`).
    pub fn fields(self) -> Vec<&'static str> {
        use crate::data::{alpaca, chat, pretokenized, sharegpt, text};
        match self {
            DataFormat::Pretokenized => pretokenized::PRETOKENIZED_FIELDS.all(),
            DataFormat::Synthetic => Vec::new(),
            DataFormat::Text => text::TEXT_FIELDS.all(),
            DataFormat::Alpaca => alpaca::ALPACA_FIELDS.all(),
            DataFormat::Chat => chat::CHAT_FIELDS.all(),
            DataFormat::Sharegpt => sharegpt::SHAREGPT_FIELDS.all(),
            DataFormat::Preference => crate::data::preference::PREFERENCE_FIELDS.all(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// The data (not needed for `synthetic`): a `.jsonl` or `.parquet` file, a directory of
    /// them, or a glob of shards (`data/train-*.parquet`); shards are read in sorted order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Record format. Default `pretokenized`.
    #[serde(default)]
    pub format: DataFormat,
    /// The file's name for a format field, where it differs: `{messages: conversations}`. Keys
    /// are the format's fields (pretokenized: input_ids, labels; text: text; alpaca:
    /// instruction, input, output; chat: messages, role, content; sharegpt: conversations,
    /// from, value). Default: none.
    #[serde(default, skip_serializing_if = "is_empty_columns")]
    pub columns: Columns,
    /// Shuffle rows each epoch with a permutation drawn from `train.seed`. Default false: batch
    /// k takes rows `[k*B, (k+1)*B)` in file order, cycling.
    #[serde(default)]
    pub shuffle: bool,
    /// Tokenizer of the text formats: `byte`, a directory with `tokenizer.json` (and
    /// `tokenizer_config.json`), or a Hub id (`ORG/NAME`, `ORG/NAME@REV`) in the local Hugging
    /// Face cache. Default: `model.path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// Also train on prompt tokens (alpaca, chat). Default false: loss on responses only.
    #[serde(default)]
    pub train_on_prompt: bool,
    /// Pack short examples into rows of up to `train.max_seq_len` tokens (the loss never
    /// crosses an example boundary). Default false.
    #[serde(default)]
    pub pack: bool,
    /// A bad record: `fail` (default) stops with its file and line; `skip` leaves it out and
    /// counts it.
    #[serde(default)]
    pub on_error: OnError,
    /// Hold out this fraction of the examples (chosen from `train.seed`, before packing) for
    /// evaluation. Default 0: no held-out split.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub eval_fraction: f64,
    /// A separate file (or directory, or glob) of evaluation examples, in `format`. Exclusive
    /// with `eval_fraction`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_path: Option<PathBuf>,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

fn is_empty_columns(c: &Columns) -> bool {
    c.0.is_empty()
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// Optimizer steps; default 100 (unless `epochs` is set: one or the other).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// Passes over the training rows instead of `steps`: the run takes
    /// `ceil(epochs x rows / batch_size)` steps (batches cycle through the rows without a
    /// break, so an epoch may end inside a batch; shuffling draws each epoch's own order).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epochs: Option<f64>,
    /// Rows per optimizer step. Default 8.
    pub batch_size: usize,
    /// Rows per micro-batch: the batch is split, every micro-batch passes a layer while its
    /// weights are on the device, and the loss is normalised over the whole batch. Default:
    /// the whole batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub micro_batch_size: Option<usize>,
    /// Longest row accepted; longer rows are refused with their line number. Default 2048.
    pub max_seq_len: usize,
    /// Seed of every random choice (shuffling). Default 0.
    pub seed: u64,
    /// Write a resumable checkpoint every this many steps (and on SIGINT/SIGTERM); 0 = only on
    /// a signal. Default 0.
    pub save_every: usize,
    /// Resumable checkpoints kept in `OUT/checkpoints` (oldest removed first). Default 2.
    pub keep_checkpoints: usize,
    /// Consecutive bad steps after which the run stops: a non-finite loss or gradient norm, or
    /// a gradient too large for the moments (each skipped, nothing written), or updates that
    /// held elements back (a new weight or moment would not have been finite). Default 5.
    pub max_bad_steps: usize,
    /// With a held-out split, report the eval loss every this many steps (and after the last
    /// step); 0 = only after the last step. Default 0.
    pub eval_every: usize,
    /// `sft` (default) or `dpo` (preference pairs, `dpo:`; `batch_size` and
    /// `micro_batch_size` then count pairs, as TRL's).
    pub objective: Objective,
}

/// Optimizer steps of a run that sets neither `train.steps` nor `train.epochs`.
pub const DEFAULT_STEPS: usize = 100;

impl TrainSection {
    /// The run's optimizer steps: `steps`, or the default. A run that sets `epochs` has them
    /// turned into `steps` once its data is loaded ([`TrainSection::resolve_epochs`]).
    pub fn total_steps(&self) -> usize {
        self.steps.unwrap_or(DEFAULT_STEPS)
    }

    /// Optimizer steps an epoch over `rows` training rows takes (a fraction where the batch
    /// does not divide the rows).
    pub fn steps_per_epoch(&self, rows: usize) -> f64 {
        rows as f64 / self.batch_size as f64
    }

    /// With `epochs` set, `steps` becomes `ceil(epochs x rows / batch_size)` (at least 1).
    pub fn resolve_epochs(&mut self, rows: usize) {
        if let Some(e) = self.epochs {
            self.steps = Some(((e * self.steps_per_epoch(rows)).ceil() as usize).max(1));
        }
    }

    /// Rows per micro-batch: `micro_batch_size`, or the whole batch.
    pub fn micro_batch_rows(&self) -> usize {
        self.micro_batch_size.unwrap_or(self.batch_size)
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            steps: None,
            epochs: None,
            batch_size: 8,
            micro_batch_size: None,
            max_seq_len: 2048,
            seed: 0,
            save_every: 0,
            keep_checkpoints: 2,
            max_bad_steps: 5,
            eval_every: 0,
            objective: Objective::Sft,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSection {
    /// Peak learning rate. Default 1e-4.
    pub lr: f64,
    /// `constant`, `cosine` or `linear` (decay to `min_lr` at the last step). Default constant.
    pub schedule: ScheduleKind,
    /// Linear warm-up from 0 over this many steps. Default 0.
    pub warmup_steps: usize,
    /// The floor the decay reaches at the last step. Default 0.
    pub min_lr: f64,
    /// AdamW betas. Default [0.9, 0.999] (torch's).
    pub betas: [f64; 2],
    /// AdamW epsilon. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay, applied to every trained tensor but those `no_decay` exempts.
    /// Default 0.01 (torch's).
    pub weight_decay: f64,
    /// Global L2-norm gradient clipping threshold; 0 turns clipping off. Default 1.0.
    pub grad_clip: f64,
    /// Where the optimizer state lives and how gradients reach it: `exact` (fp32 gradients of
    /// the whole model, exact global-norm clipping, ~16 B/param), `lean` (layers updated as
    /// their gradients complete, all but the last `engine.grad_slabs` clipping by an estimate of
    /// the step's norm, ~12 B/param) or `compact`
    /// (lean with blockwise 8-bit AdamW moments, ~6 B/param). Default exact.
    pub memory: OptimizerMemory,
    /// Which trained tensors take no weight decay: `none` (every tensor decays, as
    /// `torch.optim.AdamW(model.parameters())`) or `hf` (the Hugging Face Trainer's groups, as
    /// TRL, axolotl and LLaMA-Factory runs: biases and norm weights take none). Default none.
    pub no_decay: NoDecay,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        OptimizerSection {
            lr: 1e-4,
            schedule: ScheduleKind::Constant,
            warmup_steps: 0,
            min_lr: 0.0,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            grad_clip: 1.0,
            memory: OptimizerMemory::Exact,
            no_decay: NoDecay::None,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputSection {
    /// Output directory: `metrics.jsonl`, `config.yaml`, `summary.json`, `report.md`,
    /// `training.png`, `checkpoints/`, `final/`. Default `out`.
    pub dir: PathBuf,
    /// Weight type of the exported `final/` directory: `fp32` (default) or `bf16` (rounded to
    /// nearest even).
    pub dtype: WeightDtype,
    /// Split the exported weights into shards of at most this size (with
    /// `model.safetensors.index.json`). Default 5GB, as `transformers`.
    pub max_shard_size: ByteSize,
    /// Write TensorBoard event files into `OUT/tb/` (every `metrics.jsonl` field as a scalar,
    /// the config as text). Default true.
    pub tensorboard: bool,
}

impl Default for OutputSection {
    fn default() -> Self {
        OutputSection {
            dir: PathBuf::from("out"),
            dtype: WeightDtype::Fp32,
            max_shard_size: ByteSize::Bytes(DEFAULT_MAX_SHARD_BYTES),
            tensorboard: true,
        }
    }
}

/// Element type of exported weights.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    #[default]
    Fp32,
    Bf16,
}

impl WeightDtype {
    pub fn save_dtype(self) -> crate::hf::checkpoint::SaveDtype {
        match self {
            WeightDtype::Fp32 => crate::hf::checkpoint::SaveDtype::F32,
            WeightDtype::Bf16 => crate::hf::checkpoint::SaveDtype::Bf16,
        }
    }
}

/// `transformers`' default `max_shard_size` ("5GB").
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// How to write the weights.
#[derive(Clone, Copy, Debug)]
pub struct ExportOptions {
    pub dtype: crate::hf::checkpoint::SaveDtype,
    /// A shard holds at most this many bytes of tensor data (a single larger tensor gets a
    /// shard of its own); everything in one `model.safetensors` when it all fits.
    pub max_shard_bytes: u64,
    /// A mixture of experts' layout: fused (`Some(true)`), one tensor per expert (`Some(false)`),
    /// or the model's own (`None`: the checkpoint the run started from).
    pub fused_experts: Option<bool>,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            dtype: crate::hf::checkpoint::SaveDtype::F32,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            fused_experts: None,
        }
    }
}

impl OutputSection {
    /// The export options of `final/`.
    pub fn export_options(&self) -> ExportOptions {
        ExportOptions {
            dtype: self.dtype.save_dtype(),
            max_shard_bytes: match self.max_shard_size {
                ByteSize::Auto => DEFAULT_MAX_SHARD_BYTES,
                ByteSize::Bytes(b) => b.max(1),
            },
            fused_experts: None,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// Keep a host checkpoint of the residual stream every K layers; backward recomputes each
    /// block of K layers from it. Default 4.
    pub checkpoint_every: usize,
    /// Host slabs that parameter gradients return through. Default 4.
    pub grad_slabs: usize,
    /// Rows of the LM head + cross-entropy chunk: the (rows, V) logits never exceed this.
    /// Default 256.
    pub head_chunk_rows: usize,
    /// Vocabulary rows of one LM-head tile. The head is applied a tile at a time through the
    /// weight slots, which hold the largest decoder layer: by default a tile is as many rows
    /// as fit in a slot beside the final norm, `(largest layer - C) / C`, and a head that fits
    /// in one slot is applied whole. A value here can only make tiles smaller (more of them);
    /// unset by default.
    pub head_tile_rows: Option<usize>,
    /// Experts per chunk of a mixture of experts' sparse layer: the layer's trunk (attention,
    /// router, shared expert, adapters) stays in a weight slot and its routed experts stream
    /// through two slots of their own this many at a time, so device memory does not grow
    /// with the number of experts. Unset (default): whole layers, unless an explicit
    /// `device.memory` does not hold them, when the largest chunk that fits is taken. Only
    /// frozen experts are chunked (LoRA or QLoRA whose targets leave the experts out).
    pub expert_chunk: Option<usize>,
    /// Whether the backward recomputes layer internals: `auto` (default) keeps every layer's
    /// forward internals on the device when an explicit `device.memory` holds that plan, else
    /// recomputes (`device.memory: auto` is the smallest plan, so it recomputes); `always`
    /// recomputes (the device holds one layer's internals); `never` keeps them, or refuses to
    /// start when they do not fit. Keeping implies a checkpoint every layer.
    pub recompute: Recompute,
    /// The format layer gradients cross the device -> host link in: `fp32` (default, exact) or
    /// `bf16` (rounded on the device, half the link bytes and half the host gradient slabs;
    /// the host accumulates in fp32). The final norm's and LM head's gradients, and the
    /// residual gradient of the embedding, always come back fp32.
    pub grad_wire: GradWire,
    /// CUDA: how trained weights reach the device as bf16: `image` (a page-locked bf16 copy
    /// of the masters, rewritten by the optimizer as it updates them: uploads are pure copies,
    /// 2 more host bytes per trained parameter), `round` (rounded inside every upload, on the
    /// host's cores) or `auto` (default: `image` when the host plan fits with it).
    pub weight_upload: WeightUpload,
    /// Threads of the host work of the step (optimizer updates, gradient accumulation, norms),
    /// a pool of their own built once: a whole number of at least 1, or `auto` (default): the
    /// cores the process may run on (`numactl`/`taskset` masks count) less those the device's
    /// queues keep busy, at least 1 (CUDA: all but one, for the dispatch threads; CPU backend,
    /// whose kernels share the cores: half, rounded down).
    pub host_threads: HostThreads,
    /// Pin each worker thread of the engine to one CPU of those the process may run on
    /// (`taskset`/`numactl` masks count): the host threads to the last ones, and on the CPU
    /// backend the kernels' threads to the first ones. Default true: an unpinned pool's
    /// threads, waking, can land beside each other on one core and run at one core's speed
    /// for tens of milliseconds. False leaves them to the scheduler.
    pub pin_threads: bool,
}

impl Default for EngineSection {
    fn default() -> Self {
        EngineSection {
            checkpoint_every: 4,
            grad_slabs: 4,
            head_chunk_rows: 256,
            head_tile_rows: None,
            expert_chunk: None,
            recompute: Recompute::Auto,
            grad_wire: GradWire::Fp32,
            weight_upload: WeightUpload::Auto,
            host_threads: HostThreads::Auto,
            pin_threads: true,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceSection {
    /// `cpu` (default) or `cuda`.
    pub backend: BackendKind,
    /// Device memory budget: bytes (`64MiB`, `2GiB`, `500MB`, `1048576`) or `auto` (exactly
    /// what the plan needs). The run refuses to start when the plan does not fit. Default auto.
    pub memory: ByteSize,
    /// CPU backend: simulated link bandwidth in GB/s for host<->device copies, each direction;
    /// 0 = unthrottled. Default 0.
    pub link_gbps: f64,
    /// CPU backend: how the compute and host queues wait for the other queues, `block` (their
    /// threads sleep), `spin` (they stay awake, as a GPU's engines do) or `auto` (default:
    /// `spin` with a simulated link, `block` without; [`DeviceWait::resolve`]).
    pub wait: DeviceWait,
    /// CUDA backend: which kernels compute attention, `auto` (default: bf16 tensor cores with
    /// fp32 accumulation where the GPU has them and the head dim is a multiple of 16 up to 128,
    /// else fp32) or `fp32` (always the fp32 kernels: the CPU reference's arithmetic, several
    /// times slower). The CPU backend's attention is fp32 either way.
    pub attention: DeviceAttention,
}

impl Default for DeviceSection {
    fn default() -> Self {
        DeviceSection {
            backend: BackendKind::Cpu,
            memory: ByteSize::Auto,
            link_gbps: 0.0,
            wait: DeviceWait::Auto,
            attention: DeviceAttention::Auto,
        }
    }
}

/// `device.attention`: [`horizon_backend::cuda::AttentionKernels`] in the config.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeviceAttention {
    /// The tensor cores where the GPU and the head dim allow (the mma.sync kernels), else the
    /// fp32 kernels.
    #[default]
    Auto,
    /// The tensor cores through the wmma kernels where `auto` would run the mma.sync ones (the
    /// set before them, same precision), else the fp32 kernels.
    Wmma,
    /// The fp32 kernels always.
    Fp32,
}

impl DeviceAttention {
    /// The CUDA device's choice.
    pub fn kernels(self) -> horizon_backend::cuda::AttentionKernels {
        use horizon_backend::cuda::AttentionKernels;
        match self {
            DeviceAttention::Auto => AttentionKernels::Tensor,
            DeviceAttention::Wmma => AttentionKernels::Wmma,
            DeviceAttention::Fp32 => AttentionKernels::Fp32,
        }
    }
}

/// `device.wait`: [`horizon_backend::cpu::WaitMode`] in the config.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeviceWait {
    /// `Spin` where the link is simulated (`device.link_gbps` > 0), else `Block`.
    #[default]
    Auto,
    /// Sleep on the event; the cores are free for the host work meanwhile.
    Block,
    /// The compute queue's kernel threads and the host queue's threads spin while those
    /// queues wait, yielding their cores to any runnable thread.
    Spin,
}

impl DeviceWait {
    /// As written in the config.
    pub fn name(self) -> &'static str {
        match self {
            DeviceWait::Auto => "auto",
            DeviceWait::Block => "block",
            DeviceWait::Spin => "spin",
        }
    }

    /// `Block` or `Spin`: `Auto` spins where the link is simulated (`link_gbps` > 0). A
    /// simulated link stands for a GPU's, whose engines stay awake while they wait; and the
    /// compute queue of a link-bound run waits most of the step, tens of milliseconds at a
    /// time, long enough for an idle virtual CPU to go back to its hypervisor. Sleeping through
    /// those waits on this project's 2-vCPU virtual machine, some runs' kernels took 2-10x
    /// their time now and then (20-104 ms against 4-11, with nothing else running beside
    /// them), never when spinning: `bench/overlap.yaml` at 0.026 GB/s measured 0.71-0.98 of its
    /// compute queue's projection blocking, 0.97-1.01 spinning, at no cost to its step
    /// (bench/validation/LOG.md, 2026-12-04 21:41). Without a simulated link the waits are short, and
    /// blocking leaves the cores to the host work.
    pub fn resolve(self, link_gbps: f64) -> DeviceWait {
        match self {
            DeviceWait::Auto if link_gbps > 0.0 => DeviceWait::Spin,
            DeviceWait::Auto => DeviceWait::Block,
            w => w,
        }
    }

    /// The CPU device's mode with a simulated link of `link_gbps` ([`DeviceWait::resolve`]).
    pub fn mode(self, link_gbps: f64) -> horizon_backend::cpu::WaitMode {
        match self.resolve(link_gbps) {
            DeviceWait::Spin => horizon_backend::cpu::WaitMode::Spin,
            DeviceWait::Block | DeviceWait::Auto => horizon_backend::cpu::WaitMode::Block,
        }
    }
}

/// A byte count written as `64MiB`, `1.5GiB`, `500MB`, `4096`, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ByteSize {
    #[default]
    Auto,
    Bytes(u64),
}

impl ByteSize {
    /// Parse `64MiB`, `2GB`, `4096`, `auto`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("auto") {
            return Ok(ByteSize::Auto);
        }
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let x: f64 = num
            .parse()
            .map_err(|_| format!("'{s}' is not a size (e.g. 64MiB, 2GB, 4096, auto)"))?;
        let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            "kib" => 1024.0,
            "mib" => 1024.0 * 1024.0,
            "gib" => 1024.0 * 1024.0 * 1024.0,
            "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            u => {
                return Err(format!(
                    "'{s}': unknown unit '{u}' (use B, KB, MB, GB, KiB, MiB, GiB)"
                ));
            }
        };
        Ok(ByteSize::Bytes((x * mult).round() as u64))
    }
}

impl Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ByteSize::Auto => s.serialize_str("auto"),
            ByteSize::Bytes(b) => s.serialize_u64(*b),
        }
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize::Bytes(n)),
            Raw::S(s) => ByteSize::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

impl RawConfig {
    /// The learning-rate schedule of the run.
    pub fn lr_schedule(&self) -> LrSchedule {
        let o = &self.optimizer;
        LrSchedule {
            kind: o.schedule,
            lr: o.lr,
            min_lr: o.min_lr,
            warmup_steps: o.warmup_steps,
            total_steps: self.train.total_steps(),
        }
    }

    /// The engine configuration the run describes, sized for rows of `train.max_seq_len` (a
    /// run sizes for its data instead: [`crate::run::data::SeqLen::of_data`]).
    pub fn engine_config(&self) -> EngineConfig {
        let t = &self.train;
        EngineConfig {
            batch_size: self.rows_per_step(),
            micro_batch_size: self.rows_per_micro_batch(),
            seq_len: t.max_seq_len,
            checkpoint_every: self.engine.checkpoint_every,
            grad_slabs: self.engine.grad_slabs,
            head_chunk_rows: self.engine.head_chunk_rows,
            head_tile_rows: self.engine.head_tile_rows,
            expert_chunk: self.engine.expert_chunk,
            adamw: self.adamw(),
            no_decay: self.optimizer.no_decay,
            grad_clip: self.optimizer.grad_clip,
            memory: self.optimizer.memory,
            kept_layers: 0,
            backend: self.device.backend,
            grad_wire: self.engine.grad_wire,
            weights: WeightPath::Masters,
            host_threads: self.engine.host_threads,
            pin_threads: self.engine.pin_threads,
            reference_copy: self.dpo().is_some_and(|d| d.reference == ReferenceMode::Live),
        }
    }

    /// AdamW's hyper-parameters (the learning rate of a step comes from [`Self::lr_schedule`]).
    pub fn adamw(&self) -> AdamWConfig {
        let o = &self.optimizer;
        AdamWConfig {
            lr: o.lr,
            beta1: o.betas[0],
            beta2: o.betas[1],
            eps: o.eps,
            weight_decay: o.weight_decay,
        }
    }
}

/// The validated configuration a run uses.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub raw: RawConfig,
    /// Where the config came from (for messages).
    pub origin: String,
    /// The validated `adapter:` section; `None` for full fine-tuning (`type: none`).
    pub adapter: Option<AdapterConfig>,
    /// The keys given as Hub ids, and the snapshots `raw` now names instead.
    pub hub: Vec<HubResolved>,
    /// Where to write a trace of the run's ops (`horizon bench --trace`; not a config key).
    pub trace: Option<std::path::PathBuf>,
    /// The command line's `--set` overrides (for the resume command a run prints).
    pub overrides: Vec<String>,
    /// `horizon train --overwrite`: start over in an `output.dir` that holds another run's
    /// checkpoints (they are removed) instead of refusing to.
    pub overwrite: bool,
}

/// A config key given as a Hub id, and the snapshot of the local Hugging Face cache it named.
#[derive(Clone, Debug)]
pub struct HubResolved {
    /// `model.path`, `data.tokenizer` or `adapter.init`.
    pub key: &'static str,
    pub snapshot: hub_cache::Snapshot,
}

impl RunConfig {
    /// One line per key given as a Hub id: the id, its commit and the directory used.
    pub fn hub_lines(&self) -> Vec<String> {
        let line = |h: &HubResolved| {
            let s = &h.snapshot;
            format!(
                "{} {}: commit {} in the local Hugging Face cache ({})",
                h.key,
                s.id,
                s.commit,
                s.dir.display()
            )
        };
        self.hub.iter().map(line).collect()
    }

    /// Whether this binary can run on the config's device: `device.backend: cuda` needs a
    /// binary built with the `cuda` feature to run, not to be planned (`horizon plan` plans any
    /// backend on any build), so [`RawConfig::resolve`] accepts it and the run checks here.
    pub fn check_device_built(&self) -> Result<()> {
        if self.raw.device.backend == BackendKind::Cuda && !horizon_backend::cuda::BUILT_WITH_CUDA {
            bail!(
                "{}: device.backend = cuda: this binary was built without CUDA\nhint: rebuild with `cargo build --release --features cuda`, use device.backend = cpu, or plan the run with `horizon plan` (it needs no GPU)",
                self.origin
            );
        }
        Ok(())
    }
}

impl RawConfig {
    /// Parse YAML text; `origin` names the file in errors.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self> {
        serde_saphyr::from_str::<RawConfig>(text).map_err(|e| {
            anyhow::anyhow!(
                "{origin}: {e}\nhint: see docs/configuration.md for every key and its default"
            )
        })
    }

    /// Read and parse a YAML file.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_file_with(path, &[])
    }

    /// Read and parse a YAML file, then apply command-line `--set key=value` overrides.
    pub fn from_file_with(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        Self::from_yaml_with(&text, &path.display().to_string(), overrides)
    }

    /// Parse YAML text with `--set` overrides applied: each is `dotted.key=value`, the value
    /// read as YAML (`train.steps=200`, `optimizer.betas=[0.9, 0.95]`, `data.path=x.jsonl`).
    /// A key that does not exist is refused by name, as in the file.
    pub fn from_yaml_with(text: &str, origin: &str, overrides: &[String]) -> Result<Self> {
        if overrides.is_empty() {
            return Self::from_yaml(text, origin);
        }
        let mut doc: serde_json::Value = if text.trim().is_empty() {
            serde_json::Value::Object(Default::default())
        } else {
            serde_saphyr::from_str(text).map_err(|e| anyhow::anyhow!("{origin}: {e}"))?
        };
        for o in overrides {
            apply_override(&mut doc, o)?;
        }
        let yaml = serde_saphyr::to_string(&doc)
            .map_err(|e| anyhow::anyhow!("{origin}: cannot apply --set overrides: {e}"))?;
        Self::from_yaml(&yaml, &format!("{origin} (with --set {})", overrides.join(" ")))
    }

    /// Validate and derive, Hub ids looked up in the process's environment
    /// ([`Self::resolve_with_env`]).
    pub fn resolve(self, origin: &str) -> Result<RunConfig> {
        self.resolve_with_env(origin, &hub_cache::process_env)
    }

    /// Validate and derive. A Hub id in `model.path`, `data.tokenizer` or `adapter.init` is
    /// replaced by its snapshot directory in the Hugging Face cache that `env` names (and
    /// `model.revision` cleared), so that every command sees a directory and a resolved config
    /// resolves to itself; [`RunConfig::hub`] keeps the ids.
    pub fn resolve_with_env(mut self, origin: &str, env: hub_cache::Env) -> Result<RunConfig> {
        let hub = self.resolve_hub_ids(origin, env)?;
        let t = &self.train;
        for (key, val) in [
            ("train.steps", t.total_steps()),
            ("train.batch_size", t.batch_size),
            ("train.max_seq_len", t.max_seq_len),
            ("engine.head_chunk_rows", self.engine.head_chunk_rows),
            ("engine.head_tile_rows", self.engine.head_tile_rows.unwrap_or(1)),
            ("engine.expert_chunk", self.engine.expert_chunk.unwrap_or(1)),
            ("engine.checkpoint_every", self.engine.checkpoint_every),
            ("engine.grad_slabs", self.engine.grad_slabs),
            ("engine.host_threads", self.engine.host_threads.count().unwrap_or(1)),
            ("train.micro_batch_size", t.micro_batch_size.unwrap_or(1)),
        ] {
            if val == 0 {
                bail!("{origin}: {key} must be at least 1 (got 0)");
            }
        }
        let o = &self.optimizer;
        let positive = |key: &str, v: f64| -> Result<()> {
            if !(v.is_finite() && v > 0.0) {
                bail!("{origin}: {key} must be a positive number (got {v})");
            }
            Ok(())
        };
        if let Some(e) = t.epochs {
            if let Some(s) = t.steps {
                bail!(
                    "{origin}: train.steps ({s}) and train.epochs ({e}) are both set: a run \
                     takes one or the other\nhint: remove one of them"
                );
            }
            positive("train.epochs", e)?;
        }
        positive("optimizer.lr", o.lr)?;
        positive("optimizer.eps", o.eps)?;
        for (i, b) in o.betas.iter().enumerate() {
            if !(0.0..1.0).contains(b) {
                bail!("{origin}: optimizer.betas[{i}] must be in [0, 1) (got {b})");
            }
        }
        if !(o.min_lr.is_finite() && o.min_lr >= 0.0 && o.min_lr <= o.lr) {
            bail!("{origin}: optimizer.min_lr must be in [0, optimizer.lr] (got {})", o.min_lr);
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            bail!("{origin}: optimizer.weight_decay must be >= 0 (got {})", o.weight_decay);
        }
        if !(o.grad_clip.is_finite() && o.grad_clip >= 0.0) {
            bail!("{origin}: optimizer.grad_clip must be >= 0, 0 = off (got {})", o.grad_clip);
        }
        if let Some(mbs) = t.micro_batch_size
            && mbs > t.batch_size
        {
            bail!(
                "{origin}: train.micro_batch_size ({mbs}) is larger than train.batch_size ({})",
                t.batch_size
            );
        }
        if !(self.device.link_gbps.is_finite() && self.device.link_gbps >= 0.0) {
            bail!(
                "{origin}: device.link_gbps must be >= 0, 0 = unthrottled (got {})",
                self.device.link_gbps
            );
        }
        if self.device.backend == BackendKind::Cuda && self.device.wait == DeviceWait::Spin {
            bail!(
                "{origin}: device.wait = spin is the CPU device's\nhint: leave device.wait out with device.backend = cuda (the CUDA driver picks how the host waits)"
            );
        }
        match (&self.model.path, self.model.init) {
            (None, None) => bail!(
                "{origin}: model.path is missing\nhint: give model.path (a HF directory), or model.init: random with HF config keys"
            ),
            (None, Some(ModelInit::Random))
                if self.model.arch.is_none() && !self.model.hf.contains_key("model_type") =>
            {
                bail!("{origin}: a random model needs model.arch (llama, qwen2 or mistral)")
            }
            _ => {}
        }
        let d = &self.data;
        if !(d.eval_fraction.is_finite() && (0.0..1.0).contains(&d.eval_fraction)) {
            bail!("{origin}: data.eval_fraction must be in [0, 1) (got {})", d.eval_fraction);
        }
        if d.eval_fraction > 0.0 && d.eval_path.is_some() {
            bail!(
                "{origin}: data.eval_fraction and data.eval_path are both set\nhint: hold out a fraction of data.path, or give a separate eval file, not both"
            );
        }
        if t.eval_every > 0 && d.eval_fraction == 0.0 && d.eval_path.is_none() {
            bail!(
                "{origin}: train.eval_every is set but there is no held-out data\nhint: set data.eval_fraction (e.g. 0.05) or data.eval_path"
            );
        }
        if self.data.format != DataFormat::Synthetic && self.data.path.is_none() {
            bail!(
                "{origin}: data.path is missing\nhint: give data.path (a JSONL or Parquet file, a directory or a glob of them), or data.format: synthetic for a benchmark"
            );
        }
        let f = self.data.format;
        self.data
            .columns
            .check(f.name(), &f.fields())
            .map_err(|e| anyhow::anyhow!("{origin}: {e}"))?;
        self.check_objective(origin)?;
        let adapter = self.adapter.resolve(origin)?;
        Ok(RunConfig {
            raw: self,
            origin: origin.to_string(),
            adapter,
            hub,
            trace: None,
            overrides: Vec::new(),
            overwrite: false,
        })
    }

    /// Replace each Hub id of `model.path`, `data.tokenizer` and `adapter.init` by its
    /// snapshot directory (each must hold `config.json`, `tokenizer.json`,
    /// `adapter_config.json` respectively); `model.revision` applies to `model.path`.
    fn resolve_hub_ids(&mut self, origin: &str, env: hub_cache::Env) -> Result<Vec<HubResolved>> {
        let at = |e: anyhow::Error| anyhow::anyhow!("{origin}: {e}");
        let mut found = Vec::new();
        let mut lookup = |key: &'static str, value: &Path, rev: Option<&str>, needs: &str| {
            let Some(text) = value.to_str() else { return Ok(None) };
            let snap = hub_cache::resolve_value(key, text, rev, needs, env).map_err(at)?;
            Ok::<_, anyhow::Error>(snap.map(|s| {
                let dir = s.dir.clone();
                found.push(HubResolved { key, snapshot: s });
                dir
            }))
        };
        let revision = self.model.revision.take();
        match &self.model.path {
            Some(p) => match lookup("model.path", p, revision.as_deref(), "config.json")? {
                Some(dir) => self.model.path = Some(dir),
                None if revision.is_some() => bail!(
                    "{origin}: model.revision is set, but model.path {} is a local path, not a Hub id\nhint: remove model.revision, or name the model by its Hub id (ORG/NAME)",
                    p.display()
                ),
                None => {}
            },
            None if revision.is_some() => bail!(
                "{origin}: model.revision is set without model.path\nhint: model.revision picks the revision of a Hub id model.path"
            ),
            None => {}
        }
        if let Some(t) = self.data.tokenizer.clone().filter(|t| t != "byte")
            && let Some(dir) = lookup("data.tokenizer", Path::new(&t), None, "tokenizer.json")?
        {
            self.data.tokenizer = Some(dir.display().to_string());
        }
        if let Some(init) = self.adapter.init.clone()
            && let Some(dir) = lookup("adapter.init", &init, None, "adapter_config.json")?
        {
            self.adapter.init = Some(dir);
        }
        Ok(found)
    }

    /// The config as YAML (printed at start and saved beside the results).
    pub fn to_yaml(&self) -> String {
        serde_saphyr::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

/// Apply one `dotted.key=value` override to a parsed config document.
fn apply_override(doc: &mut serde_json::Value, o: &str) -> Result<()> {
    let hint = "hint: write --set section.key=value, e.g. --set train.steps=200";
    let Some((key, val)) = o.split_once('=') else {
        bail!("--set {o}: no '=' in the override\n{hint}");
    };
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if key.is_empty() || parts.iter().any(|p| p.is_empty()) {
        bail!("--set {o}: '{key}' is not a dotted key\n{hint}");
    }
    let value: serde_json::Value = if val.trim().is_empty() {
        serde_json::Value::Null
    } else {
        serde_saphyr::from_str(val).unwrap_or_else(|_| serde_json::Value::String(val.to_string()))
    };
    let mut node = doc;
    for (i, part) in parts.iter().enumerate() {
        let serde_json::Value::Object(map) = node else {
            bail!("--set {o}: '{}' is not a section\n{hint}", parts[..i].join("."));
        };
        if i + 1 == parts.len() {
            map.insert(part.to_string(), value);
            return Ok(());
        }
        node = map
            .entry(part.to_string())
            .or_insert_with(|| serde_json::Value::Object(Default::default()));
    }
    unreachable!("the loop returns at the last part")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_overrides_any_key_and_refuses_unknown_ones() {
        let yaml = "model: {path: m}\ndata: {path: d.jsonl}\ntrain: {steps: 5}\n";
        let c = RawConfig::from_yaml_with(
            yaml,
            "t.yaml",
            &[
                "train.steps=200".into(),
                "optimizer.betas=[0.9, 0.95]".into(),
                "model.hidden_size=64".into(),
                "data.path=other.jsonl".into(),
                "output.dir=runs/a".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.train.steps, Some(200));
        assert_eq!(c.optimizer.betas, [0.9, 0.95]);
        assert_eq!(c.model.hf["hidden_size"], 64);
        assert_eq!(c.data.path.as_deref(), Some(Path::new("other.jsonl")));
        assert_eq!(c.output.dir, Path::new("runs/a"));
        let e = RawConfig::from_yaml_with(yaml, "t.yaml", &["train.stepz=3".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("stepz") && e.contains("t.yaml"), "{e}");
        let e = RawConfig::from_yaml_with(yaml, "t.yaml", &["train.steps".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no '='"), "{e}");
        let e = RawConfig::from_yaml_with(yaml, "t.yaml", &["train.steps.x=1".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.steps") && e.contains("not a section"), "{e}");
    }

    #[test]
    fn eval_keys_are_checked() {
        let base = "model: {path: m}\ndata: {path: d.jsonl";
        let ok = RawConfig::from_yaml(
            &format!("{base}, eval_fraction: 0.1}}\ntrain: {{eval_every: 5}}\n"),
            "t",
        )
        .unwrap();
        ok.resolve("t").unwrap();
        for (extra, want) in [
            (", eval_fraction: 1.5}\n", "data.eval_fraction"),
            (", eval_fraction: 0.1, eval_path: e.jsonl}\n", "both set"),
            ("}\ntrain: {eval_every: 5}\n", "train.eval_every"),
        ] {
            let e = RawConfig::from_yaml(&format!("{base}{extra}"), "t")
                .unwrap()
                .resolve("t")
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn defaults_fill_everything_but_paths() {
        let c =
            RawConfig::from_yaml("model: {path: m}\ndata: {path: d.jsonl}\n", "t.yaml").unwrap();
        assert_eq!(c.train.total_steps(), 100);
        assert_eq!(c.optimizer.betas, [0.9, 0.999]);
        assert_eq!(c.data.format, DataFormat::Pretokenized);
        c.resolve("t.yaml").unwrap();
    }

    #[test]
    fn misspelled_key_is_named() {
        let e = RawConfig::from_yaml(
            "model: {path: m}\ndata: {path: d.jsonl}\noptimizer: {lrr: 0.1}\n",
            "t.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("t.yaml") && e.contains("lrr"), "{e}");
    }

    #[test]
    fn zero_sizes_are_refused() {
        let c = RawConfig::from_yaml(
            "model: {path: m}\ndata: {path: d.jsonl}\ntrain: {batch_size: 0}\n",
            "t.yaml",
        )
        .unwrap();
        let e = c.resolve("t.yaml").unwrap_err().to_string();
        assert!(e.contains("train.batch_size"), "{e}");
    }

    #[test]
    fn device_wait_is_the_cpu_devices() {
        let yaml =
            |dev: &str| format!("model: {{path: m}}\ndata: {{path: d.jsonl}}\ndevice: {dev}\n");
        use horizon_backend::cpu::WaitMode;
        let c = RawConfig::from_yaml(&yaml("{wait: spin}"), "t.yaml").unwrap();
        assert_eq!(c.device.wait.mode(0.0), WaitMode::Spin);
        assert_eq!(c.device.wait.name(), "spin");
        c.resolve("t.yaml").unwrap();
        let c = RawConfig::from_yaml(&yaml("{wait: block, link_gbps: 0.05}"), "t.yaml").unwrap();
        assert_eq!(c.device.wait.mode(c.device.link_gbps), WaitMode::Block);
        // By default the queues spin where the link is simulated, and only there.
        let c = RawConfig::from_yaml(&yaml("{}"), "t.yaml").unwrap();
        assert_eq!(c.device.wait, DeviceWait::Auto);
        assert_eq!(c.device.wait.mode(0.0), WaitMode::Block);
        assert_eq!(c.device.wait.mode(0.05), WaitMode::Spin);
        assert_eq!(c.device.wait.resolve(0.026).name(), "spin");
        let c = RawConfig::from_yaml(&yaml("{backend: cuda, wait: auto}"), "t.yaml").unwrap();
        assert_eq!(c.device.wait, DeviceWait::Auto);
        let c = RawConfig::from_yaml(&yaml("{backend: cuda, wait: spin}"), "t.yaml").unwrap();
        let e = c.resolve("t.yaml").unwrap_err().to_string();
        assert!(e.contains("device.wait") && e.contains("hint"), "{e}");
        assert!(RawConfig::from_yaml(&yaml("{wait: nap}"), "t.yaml").is_err());
    }

    #[test]
    fn device_attention_picks_the_cuda_kernels() {
        use horizon_backend::cuda::AttentionKernels;
        let yaml =
            |dev: &str| format!("model: {{path: m}}\ndata: {{path: d.jsonl}}\ndevice: {dev}\n");
        let c = RawConfig::from_yaml(&yaml("{}"), "t.yaml").unwrap();
        assert_eq!(c.device.attention.kernels(), AttentionKernels::Tensor);
        let c = RawConfig::from_yaml(&yaml("{attention: wmma}"), "t.yaml").unwrap();
        assert_eq!(c.device.attention.kernels(), AttentionKernels::Wmma);
        let c = RawConfig::from_yaml(&yaml("{attention: fp32}"), "t.yaml").unwrap();
        assert_eq!(c.device.attention.kernels(), AttentionKernels::Fp32);
        c.resolve("t.yaml").unwrap();
        let e = RawConfig::from_yaml(&yaml("{attention: bf16}"), "t.yaml").unwrap_err();
        let e = format!("{e:#}");
        assert!(e.contains("attention") && e.contains("fp32"), "{e}");
    }

    #[test]
    fn round_trips_through_yaml() {
        let c =
            RawConfig::from_yaml("model: {path: m}\ndata: {path: d.jsonl}\n", "t.yaml").unwrap();
        let again = RawConfig::from_yaml(&c.to_yaml(), "again").unwrap();
        assert_eq!(again.train.steps, c.train.steps);
        assert_eq!(again.model.path, c.model.path);
    }
}

#[cfg(test)]
mod size_tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(ByteSize::parse("64MiB"), Ok(ByteSize::Bytes(64 << 20)));
        assert_eq!(ByteSize::parse("2GB"), Ok(ByteSize::Bytes(2_000_000_000)));
        assert_eq!(ByteSize::parse("1.5GiB"), Ok(ByteSize::Bytes(3 << 29)));
        assert_eq!(ByteSize::parse("4096"), Ok(ByteSize::Bytes(4096)));
        assert_eq!(ByteSize::parse("auto"), Ok(ByteSize::Auto));
        assert!(ByteSize::parse("64 parsecs").is_err());
        let c = RawConfig::from_yaml(
            "model: {path: m}\ndata: {path: d.jsonl}\ndevice: {memory: 8MiB, link_gbps: 12}\n",
            "t.yaml",
        )
        .unwrap();
        assert_eq!(c.device.memory, ByteSize::Bytes(8 << 20));
        let e = RawConfig::from_yaml(
            "model: {path: m}\ndata: {path: d.jsonl}\ndevice: {memory: lots}\n",
            "t.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("lots"), "{e}");
    }

    #[test]
    fn random_models_need_no_path() {
        let c = RawConfig::from_yaml(
            "model: {init: random, arch: llama, hidden_size: 64, num_hidden_layers: 2}\ndata: {format: synthetic}\n",
            "t.yaml",
        )
        .unwrap();
        assert_eq!(c.model.hf["hidden_size"], 64);
        c.resolve("t.yaml").unwrap();
        let e = RawConfig::from_yaml("model: {}\ndata: {format: synthetic}\n", "t.yaml")
            .unwrap()
            .resolve("t.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.path"), "{e}");
    }
}
