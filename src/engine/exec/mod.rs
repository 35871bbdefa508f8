//! The executor: allocates every device and host buffer once (sizes from [`Sizes`]), then runs
//! the [`Schedule`]'s operations on a [`Device`]'s queues, step after step. The host store
//! (`TrainState`) is owned here; queued host work reaches it through raw handles built once,
//! and the plan's hazard-checked waits decide who touches what when.
//!
//! Its rooms: [`ctx`] (what queued work reaches, and the grants), [`alloc`] (every buffer, once),
//! one dispatcher per queue ([`upload`], [`compute`], [`download`], [`host`]), and [`eval`] (the
//! held-out loss).

use alloc::HostOwned;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::{Result, bail};
use ctx::{Ctx, Grant};
use horizon_backend::{Device, Event, KernelTimer, Queue};

use crate::engine::chunking::Chunking;
use crate::engine::options::{EngineConfig, WeightPath};
use crate::engine::phases::PhaseSeconds;
use crate::engine::plan::{Op, OpKind, PlanShape, Schedule, Wait, eval_plan};
use crate::engine::sizes::Sizes;
use crate::engine::trace::{OpMarks, Span};
use crate::model::layout::ModelLayout;
use crate::store::TrainState;

mod alloc;
mod compute;
mod ctx;
mod download;
mod eval;
mod host;
mod moe;
mod upload;

pub use eval::EvalOutput;

/// The shape of the plan the engine runs for `layout` under `cfg` (sized by `sizes`).
pub fn plan_shape(layout: &ModelLayout, cfg: &EngineConfig, sizes: &Sizes) -> PlanShape {
    let chunking = Chunking::of(layout, cfg);
    PlanShape {
        layers: layout.dims.layers,
        micro_batches: cfg.micro_batches(),
        checkpoint_every: cfg.checkpoint_every,
        grad_slabs: cfg.grad_slabs,
        tied: layout.tied,
        head_tiles: sizes.head.tiles(),
        kept_layers: cfg.kept_layers,
        streamed: cfg.memory.streams_updates(),
        staged: cfg.weight_path() == WeightPath::Staged,
        chunked: chunking.layers(),
        chunks_trained: chunking.trained(),
        expert_chunks: sizes.expert_chunks,
    }
}

/// One micro-batch, prepared by the caller (the engine takes token ids and shifted targets,
/// not data records): `b` rows of `t` positions, right-padded.
#[derive(Clone, Debug)]
pub struct MicroBatch {
    pub b: usize,
    pub t: usize,
    /// (B*T) token ids.
    pub ids: Arc<Vec<i32>>,
    /// (B*T) the next token of each position, -100 where no loss is taken.
    pub targets: Arc<Vec<i32>>,
    /// (B*T) 1 on real tokens, 0 on padding (the load-balancing statistics' mask).
    pub mask: Arc<Vec<f32>>,
}

impl MicroBatch {
    pub fn n(&self) -> usize {
        self.b * self.t
    }
}

/// The step being run, shared with its queued work.
pub(super) struct StepData {
    pub(super) mbs: Vec<MicroBatch>,
    /// 1 / (loss-carrying positions of the whole batch).
    pub(super) scale: f32,
    /// Per micro-batch, per row: the scale of that row's cross-entropy gradient in place of
    /// `scale` (DPO: `-dL/dlogp` of the row, [`Engine::step_rows`]).
    pub(super) row_scales: Option<Vec<Vec<f32>>>,
    /// The engine's step index (0-based; an evaluation's: the next step's).
    pub(super) step: u64,
    /// AdamW's step count if this step's update is applied (1-based).
    pub(super) adam_step: u64,
    /// Learning rate of this step.
    pub(super) lr: f64,
    /// Test hook: poison the gradient before its norm is taken.
    pub(super) inject_nan: bool,
    /// The token ids of the next step's micro-batches, when the caller knows them: the
    /// embedding rows they gather are updated first ([`OpKind::EmbedUpdate`]).
    pub(super) next_ids: Vec<Arc<Vec<i32>>>,
    /// Whether its work counts in the phases' time: a step's does, an evaluation's (no step's
    /// work) does not.
    pub(super) timed: bool,
}

impl StepData {
    /// Micro-batch `m`'s per-row gradient scales, with its row length, when the step has them.
    pub(super) fn row_scales_of(&self, m: usize) -> Option<(usize, &[f32])> {
        self.row_scales.as_ref().map(|s| (self.mbs[m].t, &s[m][..]))
    }
}

/// Per-step inputs besides the rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepParams {
    pub lr: f64,
    /// Write a NaN into the gradient before the norm (fault injection for tests).
    pub inject_nan: bool,
}

/// What one step produced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutput {
    pub loss_sum: f64,
    pub num_targets: usize,
    pub grad_norm: f64,
    /// The update was skipped (non-finite loss or gradient norm, or a gradient too large for
    /// the moments: `optim::step::fits_moments`): masters and moments untouched (in `lean` and
    /// `compact`, those of the layers updated before that was known keep their update).
    pub skipped: bool,
    /// A mixture of experts' load-balancing loss (unscaled) and its trained coefficient.
    pub aux: Option<(f64, f64)>,
}

impl StepOutput {
    /// The trained objective: the mean cross-entropy plus the coefficient times the aux loss.
    pub fn loss(&self) -> f64 {
        self.ce_loss() + self.aux.map_or(0.0, |(aux, coef)| coef * aux)
    }

    /// The mean cross-entropy over the loss-carrying positions.
    pub fn ce_loss(&self) -> f64 {
        self.loss_sum / self.num_targets.max(1) as f64
    }
}

/// The streaming engine. Field order matters: the device is dropped first, which runs all
/// queued work to completion before the host buffers that work points into are freed.
pub struct Engine<D: Device> {
    dev: D,
    ctx: Arc<Ctx>,
    /// The registrations of `state`'s gradients that the device downloads into
    /// ([`pin_downloaded_grads`]): dropped before `state`, whose memory they page-lock.
    pinned_grads: Vec<D::HostPin>,
    state: Box<TrainState>,
    _host: HostOwned<D>,
    schedule: Schedule,
    /// The evaluation plan, its grants and its events (`Engine::eval`).
    eval: EvalRun,
    /// Events of the ops of the current and the previous step (by step parity).
    events: [Vec<Event>; 2],
    cfg: EngineConfig,
    sizes: Sizes,
    /// Steps run so far (skipped ones included).
    steps: u64,
    /// Updates applied so far.
    updates: u64,
    /// One kernel timer per compute phase (indexed by `Phase as usize`), built once so a launch
    /// allocates none.
    timers: [KernelTimer; 4],
    /// Each op's grant, of the first step and of the steady state (by `Schedule::ops`).
    grants: [Vec<Grant>; 2],
    /// The host queue's own threads (`engine.host_threads`): every host op runs inside it, so
    /// the optimizer's and the accumulation's rayon work uses exactly these.
    host_pool: Arc<rayon::ThreadPool>,
    /// The marks of a traced run ([`Engine::start_trace`]) and the engine step it began at.
    trace: Option<(Arc<OpMarks>, u64)>,
}

/// The evaluation plan ([`crate::engine::plan::eval_plan`]) with each op's grant and event,
/// built once with the engine.
struct EvalRun {
    ops: Vec<Op>,
    grants: Vec<Grant>,
    events: Vec<Event>,
}

impl EvalRun {
    fn new(shape: PlanShape) -> Self {
        let ops = eval_plan(shape);
        let grants = ops.iter().map(Grant::of).collect();
        // Reached: the first evaluation waits for no earlier one.
        let events = alloc::reached(ops.len());
        EvalRun { ops, grants, events }
    }
}

impl<D: Device> Engine<D>
where
    D::Backend: 'static,
{
    /// The schedule the engine runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The buffer sizes the engine allocated.
    pub fn sizes(&self) -> &Sizes {
        &self.sizes
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// An error if device work has failed (a refused launch or copy, a GPU fault): the state
    /// is then not to be trusted, and nothing should be saved from it.
    pub fn check_device(&self) -> Result<()> {
        match self.dev.failure() {
            None => Ok(()),
            Some(msg) => bail!(
                "device work failed: {msg}\nnothing after the failure was saved\nhint: resume \
                 from the last checkpoint with --resume latest"
            ),
        }
    }

    /// Seconds of queue work by phase since the engine started (work still queued not
    /// included: read after [`Engine::state`] for a whole step).
    pub fn phase_seconds(&self) -> PhaseSeconds {
        self.ctx.phases.seconds()
    }

    /// [`Engine::state`], or an error if device work failed: the state to save or export.
    pub fn checked_state(&mut self) -> Result<&TrainState> {
        self.state();
        self.check_device()?;
        Ok(&self.state)
    }

    /// Wait for all queued work (optimizer updates included) and look at the host state.
    pub fn state(&mut self) -> &TrainState {
        self.dev.synchronize();
        self.state.step = self.steps;
        self.state.updates = self.updates;
        self.state.last_sq = self.last_sq();
        &self.state
    }

    /// Wait for all queued work and hand the host state back.
    pub fn into_state(self) -> TrainState {
        self.dev.synchronize();
        let last_sq = self.last_sq();
        let Engine { dev, pinned_grads, state, _host, steps, updates, .. } = self;
        drop(dev);
        drop(pinned_grads);
        drop(_host);
        let mut state = *state;
        state.step = steps;
        state.updates = updates;
        state.last_sq = last_sq;
        state
    }

    /// The squared gradient norms of the last finite step (streamed modes estimate the next
    /// step's norm from them).
    fn last_sq(&self) -> Vec<f64> {
        if self.cfg.memory.streams_updates() {
            self.ctx.step.stats.lock().expect("no update panicked").prev_sq().to_vec()
        } else {
            self.state.last_sq.clone()
        }
    }

    /// The configuration the engine was planned for.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Threads of the host queue's pool (`engine.host_threads` resolved): the optimizer and
    /// the gradient accumulation run on exactly these.
    pub fn host_threads(&self) -> usize {
        self.host_pool.current_num_threads()
    }

    /// Trace the next `steps` steps: when each op begins and ends on its queue (see
    /// [`crate::engine::trace`]); [`Engine::trace_spans`] reads them.
    pub fn start_trace(&mut self, steps: usize) {
        self.trace = Some((OpMarks::new(steps, self.schedule.len()), self.steps));
    }

    /// The spans of the traced steps' ops so far (empty without [`Engine::start_trace`]), after
    /// the queued work has finished.
    pub fn trace_spans(&self) -> Vec<Span> {
        let Some((marks, from)) = &self.trace else { return Vec::new() };
        self.dev.synchronize();
        marks.spans(|step| self.schedule.ops(from + step as u64))
    }

    /// Queue a trace mark of op `j` of step `k` on `queue` (its begin or, with `end`, its end),
    /// when the step is traced.
    fn mark(&self, queue: Queue, k: u64, j: usize, end: bool) {
        let Some((marks, from)) = &self.trace else { return };
        let Some(step) = k.checked_sub(*from).map(|s| s as usize) else { return };
        if marks.covers(step) {
            let marks = marks.clone();
            self.dev.host_on(queue, Box::new(move || marks.mark(step, j, end)));
        }
    }

    /// Count a step that runs nothing (its batch carries no loss): masters, moments and the
    /// update count are untouched. Queued work is finished first, so that the next step starts
    /// as it would after a resume (every event of the earlier steps reached).
    pub fn skip_step(&mut self) {
        self.dev.synchronize();
        self.ctx.step.clear_held(self.steps);
        self.steps += 1;
    }

    /// The elements step `k`'s updates held, per buffer (in `ParamStore::buffers` order):
    /// those whose new master or moment would not have been finite kept their old values
    /// (`optim::adamw`'s "Held elements"). Step `k`'s updates run on after [`Engine::step`]
    /// returns, so this waits for the queued work when `k` is the last step taken; the step
    /// before it needs no wait (its updates ran before the last step's norm).
    pub fn held(&mut self, k: u64) -> impl Iterator<Item = u64> + '_ {
        assert!(
            k + 2 >= self.steps && k < self.steps,
            "step {k}'s held elements are gone: the engine is at step {}",
            self.steps
        );
        if k + 1 == self.steps {
            self.dev.synchronize();
        }
        self.ctx.step.held(k)
    }

    /// Run one optimizer step on the step's micro-batches (each at most
    /// `micro_batch_size` rows). Returns when the loss and the gradient norm are known; the
    /// optimizer updates run on, overlapped with the next step's work.
    pub fn step(&mut self, mbs: Vec<MicroBatch>, sp: StepParams) -> Result<StepOutput> {
        self.step_ahead(mbs, sp, Vec::new())
    }

    /// [`Engine::step`], told the token ids of the next step's micro-batches (`next_ids`; empty
    /// when unknown): the embedding rows they gather are updated first, so that the next
    /// forward waits only for those rows, not for the whole embedding. The results are the
    /// same either way.
    pub fn step_ahead(
        &mut self,
        mbs: Vec<MicroBatch>,
        sp: StepParams,
        next_ids: Vec<Arc<Vec<i32>>>,
    ) -> Result<StepOutput> {
        self.step_scaled(mbs, sp, next_ids, None)
    }

    /// [`Engine::step`] of an objective on each row's summed log-probability (DPO): row `i` of
    /// micro-batch `m` scales its cross-entropy gradient by `row_scales[m][i]` (`-dL/dlogp`)
    /// instead of `1 / targets`. The loss the output reports is still the mean cross-entropy.
    pub fn step_rows(
        &mut self,
        mbs: Vec<MicroBatch>,
        sp: StepParams,
        row_scales: Vec<Vec<f32>>,
    ) -> Result<StepOutput> {
        if row_scales.len() != mbs.len() || mbs.iter().zip(&row_scales).any(|(m, s)| s.len() != m.b)
        {
            bail!("step_rows: one scale a row of every micro-batch");
        }
        self.step_scaled(mbs, sp, Vec::new(), Some(row_scales))
    }

    fn step_scaled(
        &mut self,
        mbs: Vec<MicroBatch>,
        sp: StepParams,
        next_ids: Vec<Arc<Vec<i32>>>,
        row_scales: Option<Vec<Vec<f32>>>,
    ) -> Result<StepOutput> {
        self.check_step(&mbs)?;
        let num_targets: usize =
            mbs.iter().map(|mb| mb.targets.iter().filter(|&&t| t != -100).count()).sum();
        let k = self.steps;
        let sd = Arc::new(StepData {
            mbs,
            scale: 1.0 / num_targets.max(1) as f32,
            row_scales,
            step: k,
            adam_step: self.updates + 1,
            lr: sp.lr,
            inject_nan: sp.inject_nan,
            next_ids,
            timed: true,
        });
        self.submit_step(k, &sd);
        self.steps += 1;
        self.step_output(k, &sd, num_targets)
    }

    /// An error unless `mbs` is a step the engine was planned for.
    fn check_step(&self, mbs: &[MicroBatch]) -> Result<()> {
        let rows: usize = mbs.iter().map(|mb| mb.b).sum();
        if rows == 0 || rows > self.cfg.batch_size {
            bail!("a step takes 1..={} rows, got {rows}", self.cfg.batch_size);
        }
        if mbs.len() != self.sizes.micro_batches
            || mbs.iter().any(|mb| mb.b > self.cfg.micro_batch_size)
        {
            bail!(
                "a step of {rows} rows in {} micro-batches; the engine was planned for {} of at \
                 most {} rows",
                mbs.len(),
                self.sizes.micro_batches,
                self.cfg.micro_batch_size
            );
        }
        if let Some(mb) = mbs.iter().find(|mb| mb.t > self.cfg.seq_len) {
            bail!(
                "a row of {} tokens exceeds the planned sequence length {}",
                mb.t,
                self.cfg.seq_len
            );
        }
        Ok(())
    }

    /// Queue step `k`'s ops: each after the events of the ops it waits for (this step's or the
    /// previous one's), through its queue's dispatcher, then its own event.
    fn submit_step(&self, k: u64, sd: &Arc<StepData>) {
        // Events of step k-2 are reused: every one of them has been reached.
        let par = (k % 2) as usize;
        for e in &self.events[par] {
            e.wait_host();
            e.reset();
        }
        // Step k - 2's updates are done: its slot of held counts is step k's.
        self.ctx.step.clear_held(k);
        for (j, op) in self.schedule.ops(k).iter().enumerate() {
            for w in self.schedule.waits(k, j) {
                let e = match w {
                    Wait::This(i) => &self.events[par][i],
                    Wait::Prev(i) => &self.events[1 - par][i],
                };
                self.dev.wait(op.queue, e);
            }
            self.mark(op.queue, k, j, false);
            self.dispatch(op.queue, op.kind, sd, &self.grants[usize::from(k > 0)][j]);
            self.mark(op.queue, k, j, true);
            self.dev.record(op.queue, &self.events[par][j]);
        }
    }

    /// Step `k`'s output, once what it needs is done: the losses and the gradient norm (the
    /// optimizer's updates run on).
    fn step_output(&mut self, k: u64, sd: &StepData, num_targets: usize) -> Result<StepOutput> {
        let par = (k % 2) as usize;
        for (j, op) in self.schedule.ops(k).iter().enumerate() {
            if matches!(op.kind, OpKind::DownloadLosses { .. } | OpKind::GradNorm) {
                self.events[par][j].wait_host();
            }
        }
        self.check_device()?;
        let mut loss_sum = 0.0f64;
        for (m, mb) in sd.mbs.iter().enumerate() {
            // SAFETY: the loss download of this micro-batch has finished (waited above) and
            // nothing writes the buffer until the next step's download.
            let losses =
                unsafe { self.ctx.hostbufs.loss_host[m].as_const().sub(0..mb.n()).as_slice() };
            loss_sum += losses.iter().map(|&x| x as f64).sum::<f64>();
        }
        let grad_norm = f64::from_bits(self.ctx.step.norm.load(Ordering::Acquire));
        let skipped = self.ctx.step.skip.load(Ordering::Acquire);
        // Streamed updates ran before the norm was known (the norm op is the step's last):
        // the step counts for AdamW's bias correction if any buffer was updated.
        let applied = match self.cfg.memory.streams_updates() {
            true => self.ctx.step.applied.load(Ordering::Acquire),
            false => !skipped,
        };
        if applied {
            self.updates += 1;
        }
        let aux = self.ctx.moe.as_ref().and_then(|s| s.lock().expect("moe state").aux());
        Ok(StepOutput { loss_sum, num_targets, grad_norm, skipped, aux })
    }

    /// Submit one operation to its queue.
    fn dispatch(&self, queue: Queue, kind: OpKind, sd: &Arc<StepData>, grant: &Grant) {
        match queue {
            Queue::H2D => self.dispatch_h2d(kind, sd, grant),
            Queue::Compute => self.dispatch_compute(kind, sd, grant),
            Queue::D2H => self.dispatch_d2h(kind, sd, grant),
            Queue::Host => self.dispatch_host(kind, sd, grant),
        }
    }
}
