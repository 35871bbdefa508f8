//! The host store: the model's optimizer state in host RAM (fp32 masters, gradients, AdamW
//! moments in fp32 or 8-bit), laid out for one `optimizer.memory` mode, which it states. Host RAM
//! is the authoritative store; whatever a device holds is a transient copy.

use crate::engine::options::OptimizerMemory;
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::optim::adamw::{AdamWConfig, AdamWStep, adamw_update, clip_coefficient, sum_squares};
use crate::optim::adamw8bit::Moments8;

/// The model's optimizer state in host RAM: masters, gradients, AdamW moments.
pub struct TrainState {
    pub params: ParamStore,
    pub grads: ParamStore,
    pub m: ParamStore,
    pub v: ParamStore,
    /// Optimizer steps run (the data and schedule position), skipped ones included.
    pub step: u64,
    /// Updates applied to the masters (AdamW's bias-correction count): `step` minus the steps
    /// skipped for a non-finite loss or gradient.
    pub updates: u64,
    /// `optimizer.memory: compact`: the 8-bit moments, one per buffer (then `m` and `v` hold
    /// empty buffers).
    pub q8: Option<Vec<Moments8>>,
    /// Squared gradient norm of each buffer at the last step whose norm was finite (empty:
    /// none yet): `lean`/`compact` estimate the next step's norm from them.
    pub last_sq: Vec<f64>,
    /// The memory mode the state is laid out for (what it keeps: layer gradients or not, fp32
    /// or 8-bit moments). Stated, never inferred from which buffers are empty.
    pub memory: OptimizerMemory,
}

impl TrainState {
    pub fn new(params: ParamStore) -> Self {
        let zeros = || {
            let mut z = params.clone();
            z.fill_zero();
            z
        };
        TrainState {
            grads: zeros(),
            m: zeros(),
            v: zeros(),
            params,
            step: 0,
            updates: 0,
            q8: None,
            last_sq: Vec::new(),
            memory: OptimizerMemory::Exact,
        }
    }

    /// Fresh state holding only what `mode` keeps: no layer gradients in `lean`/`compact`, 8-bit
    /// moments in `compact`. Allocates nothing it does not keep.
    pub fn for_memory(params: ParamStore, layout: &ModelLayout, mode: OptimizerMemory) -> Self {
        let empty = ParamStore::empty_like(&params);
        let mut state = TrainState {
            grads: empty.clone(),
            m: empty.clone(),
            v: empty,
            params,
            step: 0,
            updates: 0,
            q8: None,
            last_sq: Vec::new(),
            memory: mode,
        };
        state.grads = state.params.zeros_like(mode.streams_updates());
        if mode == OptimizerMemory::Compact {
            state.q8 = Some(layout.buffer_tensors().iter().map(|t| Moments8::zeros(t)).collect());
        } else {
            state.m = state.params.zeros_like(false);
            state.v = state.params.zeros_like(false);
        }
        state
    }

    /// The memory mode this state is laid out for.
    pub fn memory(&self) -> OptimizerMemory {
        self.memory
    }

    /// Re-lay the state out for `mode`: `exact` and `lean` hold the same optimizer state (lean
    /// drops the layer gradients, which are zero between steps); `compact` quantises the fp32
    /// moments, and leaving `compact` decodes them.
    pub fn into_memory(mut self, layout: &ModelLayout, mode: OptimizerMemory) -> Self {
        if self.memory() == mode {
            return self;
        }
        let streamed = mode.streams_updates();
        if self.grads.layers.iter().any(|l| l.is_empty()) != streamed
            || self.params.layers.is_empty()
        {
            self.grads = self.params.zeros_like(streamed);
        }
        match (self.q8.is_some(), mode == OptimizerMemory::Compact) {
            (false, true) => {
                let mut q8 = Vec::new();
                for ((t, m), v) in
                    layout.buffer_tensors().iter().zip(self.m.buffers()).zip(self.v.buffers())
                {
                    let mut q = Moments8::zeros(t);
                    q.encode(m, v);
                    q8.push(q);
                }
                self.q8 = Some(q8);
                self.m = ParamStore::empty_like(&self.params);
                self.v = ParamStore::empty_like(&self.params);
            }
            (true, false) => {
                let q8 = self.q8.take().expect("checked");
                self.m = self.params.zeros_like(false);
                self.v = self.params.zeros_like(false);
                for ((q, m), v) in q8.iter().zip(self.m.buffers_mut()).zip(self.v.buffers_mut()) {
                    let (dm, dv) = q.decode();
                    m.copy_from_slice(&dm);
                    v.copy_from_slice(&dv);
                }
            }
            _ => {}
        }
        self.memory = mode;
        self
    }

    /// Copies of the masters and both moments (for tests and comparisons).
    pub fn clone_params_and_moments(&self) -> (ParamStore, ParamStore, ParamStore) {
        (self.params.clone(), self.m.clone(), self.v.clone())
    }

    /// Global L2 norm of the gradients, accumulated in f64 in a fixed order.
    pub fn grad_norm(&self) -> f64 {
        self.grads.buffers().iter().map(|b| sum_squares(b)).sum::<f64>().sqrt()
    }

    /// Clip by the global norm (`max_norm` 0 = off) and take one AdamW step on every buffer.
    pub fn optimizer_step(&mut self, cfg: &AdamWConfig, lr: f64, grad_norm: f64, max_norm: f64) {
        self.step += 1;
        self.updates += 1;
        let coef = clip_coefficient(grad_norm, max_norm);
        let st = AdamWStep::new(cfg, self.updates, lr);
        let p = self.params.buffers_mut();
        let g = self.grads.buffers();
        let m = self.m.buffers_mut();
        let v = self.v.buffers_mut();
        for (((p, g), m), v) in p.into_iter().zip(g).zip(m).zip(v) {
            adamw_update(p, g, m, v, &st, coef);
        }
    }
}
