//! The host store: the model's optimizer state in host RAM (fp32 masters, gradients, AdamW
//! moments in fp32 or 8-bit), laid out for one `optimizer.memory` mode, which it states. Host RAM
//! is the authoritative store; whatever a device holds is a transient copy.

use crate::model::layout::ModelLayout;
use crate::model::lora::BaseDtype;
use crate::model::params::ParamStore;
use crate::model::spec::Stored;
use crate::optim::adamw::{AdamWConfig, AdamWStep, BufferStep, clip_coefficient, sum_squares};
use crate::optim::decay::DecayGroups;
use crate::optim::moments::Moments;
use crate::optim::state::{AdamW32, OptState, OptimizerMemory, OptimizerState};
use crate::optim::step::update_seed;

/// How a host tensor's elements are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostDtype {
    /// fp32: the trainable masters (and a frozen fp32 base).
    F32,
    /// bf16: a frozen base kept as the checkpoint stores it (adapters train beside it).
    Bf16,
    /// NF4: a QLoRA base's product matrices, 4 bits a value and one fp32 absmax per 64.
    Nf4,
    /// MXFP4: gpt-oss's experts as its checkpoint packs them, 4 bits a value and one byte of
    /// scale per 32 (4.25 bits).
    Mxfp4,
}

impl HostDtype {
    /// Bytes `elems` elements take.
    pub fn bytes(self, elems: usize) -> usize {
        match self {
            HostDtype::F32 => 4 * elems,
            HostDtype::Bf16 => 2 * elems,
            HostDtype::Nf4 => 4 * horizon_backend::nf4::words(elems),
            HostDtype::Mxfp4 => 4 * horizon_backend::mxfp4::words(elems),
        }
    }
}

/// Where a host tensor lives. RAM is the authoritative store; a slower tier (NVMe) would be
/// another variant, read ahead of the layer that needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Ram,
}

/// What the host store holds for one model tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostTensor {
    /// The tensor's HF name.
    pub name: String,
    pub elems: usize,
    pub dtype: HostDtype,
    /// Whether it has a gradient and optimizer state.
    pub trainable: bool,
    pub tier: Tier,
}

/// The host tensors of a run: the trained ones fp32 masters; an adapter run's frozen base in
/// its dtype (`LoraSpec::base`), its packed matrices NF4. All in RAM.
pub fn host_tensors(layout: &ModelLayout) -> Vec<HostTensor> {
    let tensor = |(name, shape): (String, Vec<usize>), dtype: HostDtype, trainable: bool| {
        HostTensor { name, elems: shape.iter().product(), dtype, trainable, tier: Tier::Ram }
    };
    let trained = layout.hf_tensors().into_iter().map(|t| tensor(t, HostDtype::F32, true));
    let Some(a) = &layout.adapter else { return trained.collect() };
    let base = match a.base {
        BaseDtype::F32 => HostDtype::F32,
        BaseDtype::Bf16 => HostDtype::Bf16,
    };
    let packed: std::collections::HashMap<String, HostDtype> = (0..layout.dims.layers)
        .flat_map(|i| {
            let spec = layout.layer(i);
            spec.tensors
                .iter()
                .filter_map(move |t| {
                    let dtype = match t.stored {
                        Stored::Slot => return None,
                        Stored::Nf4 => HostDtype::Nf4,
                        Stored::Mxfp4 => HostDtype::Mxfp4,
                    };
                    Some((ModelLayout::layer_name(i, &t.name), dtype))
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let frozen = layout.base_tensors().into_iter().map(|t| {
        let dtype = packed.get(&t.0).copied().unwrap_or(base);
        tensor(t, dtype, false)
    });
    trained.chain(frozen).collect()
}

/// Host bytes of the tensors' own elements.
pub fn tensor_bytes(tensors: &[HostTensor]) -> usize {
    tensors.iter().map(|t| t.dtype.bytes(t.elems)).sum()
}

/// The model's training state in host RAM: masters, gradients, optimizer state.
pub struct TrainState {
    pub params: ParamStore,
    pub grads: ParamStore,
    /// The optimizer's state, in the storage the memory mode picks.
    pub opt: OptState,
    /// Optimizer steps run (the data and schedule position), skipped ones included.
    pub step: u64,
    /// Updates applied to the masters (AdamW's bias-correction count): `step` minus the steps
    /// skipped for a non-finite loss or gradient.
    pub updates: u64,
    /// Squared gradient norm of each buffer at the last step whose norm was finite (empty:
    /// none yet): `lean`/`compact` estimate the next step's norm from them.
    pub last_sq: Vec<f64>,
    /// The memory mode the state is laid out for (what it keeps: layer gradients or not, the
    /// moments' storage). Stated, never inferred from which buffers are empty.
    pub memory: OptimizerMemory,
}

impl TrainState {
    /// Fresh `exact` state: zero gradients and fp32 moments.
    pub fn new(params: ParamStore) -> Self {
        let zeros = || params.zeros_like(false);
        TrainState {
            grads: zeros(),
            opt: OptState::F32(AdamW32 { m: zeros(), v: zeros() }),
            params,
            step: 0,
            updates: 0,
            last_sq: Vec::new(),
            memory: OptimizerMemory::Exact,
        }
    }

    /// Fresh state holding only what `mode` keeps: no layer gradients in `lean`/`compact`, 8-bit
    /// moments in `compact`. Allocates nothing it does not keep.
    pub fn for_memory(params: ParamStore, layout: &ModelLayout, mode: OptimizerMemory) -> Self {
        TrainState {
            grads: params.zeros_like(!mode.keeps_layer_grads()),
            opt: OptState::zeros(mode.moment_storage(), layout),
            params,
            step: 0,
            updates: 0,
            last_sq: Vec::new(),
            memory: mode,
        }
    }

    /// The memory mode this state is laid out for.
    pub fn memory(&self) -> OptimizerMemory {
        self.memory
    }

    /// Re-lay the state out for `mode`: `exact` and `lean` hold the same optimizer state (lean
    /// drops the layer gradients, which are zero between steps); `compact` quantises the fp32
    /// moments, and leaving `compact` decodes them.
    pub fn into_memory(mut self, layout: &ModelLayout, mode: OptimizerMemory) -> Self {
        if self.memory == mode {
            return self;
        }
        if self.memory.keeps_layer_grads() != mode.keeps_layer_grads() {
            self.grads = self.params.zeros_like(!mode.keeps_layer_grads());
        }
        self.opt = self.opt.into_storage(mode.moment_storage(), layout);
        self.memory = mode;
        self
    }

    /// Copies of the masters and both moments (fp32; decoded from 8 bits in `compact`; for
    /// tests and comparisons).
    pub fn clone_params_and_moments(&self) -> (ParamStore, ParamStore, ParamStore) {
        let AdamW32 { m, v } = self.opt.fp32_moments(&self.params);
        (self.params.clone(), m, v)
    }

    /// Global L2 norm of the gradients, accumulated in f64 in a fixed order.
    pub fn grad_norm(&self) -> f64 {
        self.grads.buffers().iter().map(|b| sum_squares(b)).sum::<f64>().sqrt()
    }

    /// Clip by the global norm (`max_norm` 0 = off) and take one AdamW step on every buffer,
    /// without weight decay on `decay`'s exempt ranges. Returns the elements each buffer's update held (`optim::adamw`'s "Held elements": their
    /// new master or moment would not have been finite, so they kept their values).
    pub fn optimizer_step(
        &mut self,
        cfg: &AdamWConfig,
        decay: &DecayGroups,
        lr: f64,
        grad_norm: f64,
        max_norm: f64,
    ) -> Vec<u64> {
        self.step += 1;
        self.updates += 1;
        let coef = clip_coefficient(grad_norm, max_norm);
        let st = AdamWStep::new(cfg, self.updates, lr);
        (0..self.grads.buffers().len())
            .map(|i| {
                let seed = update_seed(self.updates, i);
                let g = self.grads.buffer(i);
                let w = self.params.buffer_mut(i);
                let st = BufferStep::new(st, decay.exempt(i));
                self.opt.buffer(i).update(w, g, &st, coef, seed, None) as u64
            })
            .collect()
    }
}
