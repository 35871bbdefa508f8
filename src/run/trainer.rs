//! The streaming trainer: a run's model, data and memory plan, the engine on its device, and the
//! step loop that drives it (metrics, evaluation, checkpoints, signals), then the summary and the
//! final export. `horizon train`, `horizon bench` and the default job all run it.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig};
use horizon_backend::cuda::{CudaDevice, CudaDeviceConfig};
use horizon_backend::{Device, DeviceStats};

use crate::data::carries_loss;
use crate::data::pretokenized::PretokenizedDataset;
use crate::engine::exec::{Engine, EvalOutput, MicroBatch, StepParams};
use crate::engine::memory::{MemoryPlan, peak_rss_bytes};
use crate::engine::options::EngineConfig;
use crate::engine::phases::{PhaseSeconds, StepFlops, step_flops};
use crate::engine::resolve::{Machine, resolve};
use crate::hf::config::ModelConfig;
use crate::model::base::FrozenBase;
use crate::model::layout::ModelLayout;
use crate::model::params::{ParamStore, buffer_name};
use crate::run::config::{BackendKind, ByteSize, RawConfig, RunConfig, WeightPath};
use crate::run::data::{SeqLen, StepRows, load_datasets, micro_batches};
use crate::run::dpo_train::DpoRun;
use crate::run::load::{load_weights, model_config, run_layout, write_adapter};
use crate::run::progress::Progress;
use crate::run::summary::Summary;
use crate::run::summary::{AlreadyFinished, Interrupted};
use crate::run::summary::{EvalDpo, HeldIn, StepMetrics};
use crate::run::tensorboard::EventWriter;
use crate::store::TrainState;

/// A run on the streaming engine: the model in host RAM, the CPU device borrowing one layer at
/// a time.
pub struct Trainer<D: Device = CpuDevice> {
    pub cfg: RunConfig,
    pub model_cfg: ModelConfig,
    /// The model's layout, with the run's adapters (`adapter:`) when it has them.
    pub layout: ModelLayout,
    pub data: PretokenizedDataset,
    /// Reads each step's rows of `data`, in the run's order.
    rows: StepRows,
    /// The held-out rows (`data.eval_fraction` / `data.eval_path`).
    pub eval: Option<PretokenizedDataset>,
    /// Records the data loaders left out (`data.on_error: skip`, or prompt too long).
    pub skipped_records: usize,
    pub plan: MemoryPlan,
    pub engine: Engine<D>,
    /// The frozen base's content hash, computed as it was loaded (`RunModel::base_hash`): each
    /// checkpoint records it, and a resume compares it.
    pub base_hash: Option<String>,
    /// Fault injection for tests: steps (0-based) whose gradient gets a NaN.
    pub inject_nan_at: Vec<usize>,
    /// The micro-batches of the batch after the last step's (its index and them): built for
    /// their token ids, which that step took, and used again when that batch's step comes.
    ahead: Option<(usize, Vec<MicroBatch>)>,
    /// A DPO run's objective, reference and pair order (`train.objective: dpo`); `data` then
    /// holds pair `i` as rows `2i` (chosen) and `2i + 1` (rejected).
    pub dpo: Option<DpoRun>,
}

impl Trainer {
    /// Load, plan (refusing what does not fit, before allocating), allocate.
    pub fn new(cfg: RunConfig) -> Result<Self> {
        Self::with_resume(cfg, None)
    }

    /// As [`Trainer::new`], continuing from a resumable checkpoint directory.
    pub fn with_resume(cfg: RunConfig, resume: Option<&Path>) -> Result<Self> {
        Trainer::on_device(cfg, resume, |raw, plan| {
            Ok(CpuDevice::new(CpuDeviceConfig {
                capacity_bytes: plan.device_capacity() as usize,
                link_gbps: raw.device.link_gbps,
                copy_jitter_us: 0,
                jitter_seed: 0,
                wait: raw.device.wait.mode(raw.device.link_gbps),
                pin_threads: raw.engine.pin_threads,
            }))
        })
    }
}

impl<D: Device> Trainer<D>
where
    D::Backend: 'static,
{
    /// As [`Trainer::with_resume`], on the device `make_dev` builds once the memory plan
    /// is known (and checked).
    pub fn on_device(
        mut cfg: RunConfig,
        resume: Option<&Path>,
        make_dev: impl FnOnce(&RawConfig, &MemoryPlan) -> Result<D>,
    ) -> Result<Self> {
        let model_cfg = model_config(&cfg.raw)?;
        let layout = run_layout(&cfg.raw, &model_cfg, cfg.adapter.as_ref())?;
        // The data first: its longest row sizes every buffer of the plan, its rows an epoch.
        let sets = load_datasets(&cfg.raw, model_cfg.vocab_size)?;
        let examples = examples_of(&cfg.raw, sets.train.len());
        cfg.raw.train.resolve_epochs(examples);
        println!("{}", epochs_line(&cfg.raw.train, examples, example_unit(&cfg.raw)));
        let raw = &cfg.raw;
        let reference = crate::run::dpo_train::reference_line(raw, Some(&sets));
        let (ecfg, plan) = plan_run(raw, &layout, &SeqLen::of_data(raw, &sets), reference)?;
        let HostStart { state, base, base_hash } = host_state(&cfg, &model_cfg, &layout, resume)?;
        let dev = make_dev(raw, &plan)?;
        let mut engine = Engine::with_layout(dev, layout.clone(), base, state, ecfg)?;
        let rows = StepRows::new(&cfg, &sets.train);
        if engine.config().reference_copy && resume.is_some() {
            // DPO's live reference is the starting weights; the checkpoint holds trained ones.
            let rm = load_weights(&cfg.raw, None, model_cfg.clone(), layout.clone())?;
            engine.set_reference(&rm.params)?;
        }
        let dpo = match cfg.raw.dpo() {
            Some(_) => {
                let sets = (&sets.train, sets.eval.as_ref());
                Some(DpoRun::new(&cfg, &mut engine, sets, resume)?)
            }
            None => None,
        };
        Ok(Trainer {
            cfg,
            model_cfg,
            layout,
            rows,
            data: sets.train,
            eval: sets.eval,
            skipped_records: sets.skipped_records,
            plan,
            engine,
            base_hash,
            inject_nan_at: Vec::new(),
            ahead: None,
            dpo,
        })
    }

    /// The training examples an epoch goes through: rows, or a DPO run's pairs.
    pub fn examples(&self) -> usize {
        self.dpo.as_ref().map_or(self.data.len(), DpoRun::pairs)
    }

    /// One optimizer step on batch `k` (0-based).
    pub fn step(&mut self, k: usize) -> Result<StepMetrics> {
        if self.dpo.is_some() {
            return self.dpo_step(k);
        }
        let t0 = Instant::now();
        let rows = self.rows.read(&self.data, k)?;
        let tokens = rows.iter().map(|r| r.input_ids.len()).sum();
        let lr = self.cfg.raw.lr_schedule().lr_at(k + 1);
        let inject_nan = self.inject_nan_at.contains(&k);
        if !rows.iter().any(carries_loss) {
            // Nothing to learn from, and nothing to divide the loss by: the step is counted
            // and skipped.
            self.engine.skip_step();
            return Ok(StepMetrics::no_loss(k, lr, tokens, t0));
        }
        let size = self.engine.config().micro_batch_size;
        let mbs = match self.ahead.take() {
            Some((j, mbs)) if j == k => mbs,
            _ => micro_batches(rows, size),
        };
        // The next batch's token ids (padding included): the engine updates the embedding rows
        // they gather first, so that the next forward need not wait for the whole embedding.
        let next = micro_batches(self.rows.read(&self.data, k + 1)?, size);
        let next_ids = next.iter().map(|mb| mb.ids.clone()).collect();
        self.ahead = Some((k + 1, next));
        let out = self.engine.step_ahead(mbs, StepParams { lr, inject_nan }, next_ids)?;
        Ok(StepMetrics {
            step: k + 1,
            loss: out.loss(),
            grad_norm: out.grad_norm,
            lr,
            tokens,
            step_s: t0.elapsed().as_secs_f64(),
            skipped: out.skipped,
            no_loss: false,
            eval_loss: None,
            ce_loss: out.aux.map(|_| out.ce_loss()),
            aux_loss: out.aux.map(|(aux, _)| aux),
            epoch: 0.0,
            held: Vec::new(),
            dpo: None,
            eval_dpo: None,
        })
    }

    /// One DPO step on the pairs of batch `k` ([`DpoRun::step`]).
    fn dpo_step(&mut self, k: usize) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let lr = self.cfg.raw.lr_schedule().lr_at(k + 1);
        let sp = StepParams { lr, inject_nan: self.inject_nan_at.contains(&k) };
        let dpo = self.dpo.as_mut().expect("a DPO run");
        let (out, tokens) = dpo.step(&mut self.engine, &self.data, k, sp)?;
        Ok(StepMetrics {
            dpo: Some(out.metrics),
            skipped: out.skipped,
            ..StepMetrics::of_loss(k, (out.loss, out.grad_norm), lr, tokens, t0)
        })
    }

    /// Evaluates the held-out data into `m` (nothing without a held-out split): the loss, and
    /// a DPO run's reward metrics.
    pub fn evaluate_into(&mut self, m: &mut StepMetrics) -> Result<()> {
        match (&self.dpo, &self.eval) {
            (Some(dpo), Some(eval)) => {
                let e = dpo.evaluate(&mut self.engine, eval)?;
                m.eval_loss = Some(e.loss);
                m.eval_dpo = Some(EvalDpo(e.metrics));
            }
            _ => m.eval_loss = self.evaluate()?,
        }
        Ok(())
    }

    /// Step `m`'s held elements, once its updates have run ([`Engine::held`]: no wait when a
    /// later step has been taken, else a wait for the queued work), by buffer into `m.held`.
    pub fn settle(&mut self, m: &mut StepMetrics) {
        let (k, layers) = (m.step as u64 - 1, self.layout.dims.layers);
        m.held = HeldIn::of(self.engine.held(k), |i| buffer_name(layers, i));
    }

    /// Mean loss over the held-out rows with the current weights (`None` without a held-out
    /// split). Runs forward only, micro-batch by micro-batch, on the run's device through the
    /// engine (`Engine::eval`, in the step's planned buffers), after the queued updates.
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        let Some(eval) = &self.eval else {
            return Ok(None);
        };
        // A micro-batch's rows at a time: the held-out rows are read, not held.
        let size = self.engine.config().micro_batch_size.max(1);
        let mut sum = EvalOutput { loss_sum: 0.0, num_targets: 0 };
        let mut rows = Vec::with_capacity(size);
        for start in (0..eval.len()).step_by(size) {
            rows.clear();
            for r in start..(start + size).min(eval.len()) {
                rows.push(eval.row(r)?);
            }
            let out = self.engine.eval(micro_batches(&rows, size))?;
            sum.loss_sum += out.loss_sum;
            sum.num_targets += out.num_targets;
        }
        Ok(Some(sum.loss()))
    }
}

/// The engine configuration `raw` resolves to on this machine for `layout` and rows of
/// `seq_len`, and its memory plan: printed, and refused before anything is allocated when it
/// does not fit (or the CUDA kernels cannot run the model).
fn plan_run(
    raw: &RawConfig,
    layout: &ModelLayout,
    seq_len: &SeqLen,
    host_line: Option<(&'static str, u64)>,
) -> Result<(EngineConfig, MemoryPlan)> {
    let ecfg = EngineConfig { seq_len: seq_len.len, ..raw.engine_config() };
    let budget = match raw.device.memory {
        ByteSize::Auto => None,
        ByteSize::Bytes(b) => Some(b),
    };
    let host = crate::engine::memory::host_available_bytes();
    let machine = Machine::new(raw.device.backend, budget, host);
    let (recompute, upload) = (raw.engine.recompute, raw.engine.weight_upload);
    let ecfg = resolve(layout, ecfg, recompute, upload, &machine);
    let plan = machine.plan(layout, &ecfg).sized_for(&seq_len.why).with_host(host_line);
    let upload_words = match ecfg.weights {
        WeightPath::Image => {
            "a page-locked bf16 image of the trained weights, written by the optimizer"
        }
        WeightPath::Staged => {
            "two page-locked bf16 stages, rounded from the masters by the host queue ahead of each upload"
        }
        WeightPath::Masters => {
            "the fp32 masters, rounded inside each upload when the device is bf16"
        }
    };
    println!("engine.weight_upload: {:?} -> {upload_words}", raw.engine.weight_upload);
    println!(
        "engine.recompute: {:?} -> {}",
        raw.engine.recompute,
        recompute_words(ecfg.kept_layers, layout.dims.layers)
    );
    println!("{}", crate::run::plan::decay_line(raw, layout));
    print!("{plan}");
    plan.check()?;
    if raw.device.backend == BackendKind::Cuda {
        cuda_kernel_limits(layout, raw, ecfg.seq_len)?;
    }
    Ok((ecfg, plan))
}

/// What a run starts from in host RAM.
struct HostStart {
    state: TrainState,
    /// An adapter run's frozen base, and its content hash (`RunModel::base_hash`).
    base: Option<Arc<FrozenBase>>,
    base_hash: Option<String>,
}

/// The host state a run starts from, in the described model: a resumed full fine-tuning run
/// reads everything from its checkpoint; otherwise the weights are loaded (an adapter run
/// reloads its frozen base from `model.path` even when resuming its adapters, and the resume
/// compares the content hash that load computed with the one the checkpoint recorded).
fn host_state(
    cfg: &RunConfig,
    model_cfg: &ModelConfig,
    layout: &ModelLayout,
    resume: Option<&Path>,
) -> Result<HostStart> {
    let mode = cfg.raw.optimizer.memory;
    let resumed = |dir, hash| crate::run::resume::load_for(dir, model_cfg, layout, &cfg.raw, hash);
    if let (Some(dir), None) = (resume, &cfg.adapter) {
        return Ok(HostStart { state: resumed(dir, None)?, base: None, base_hash: None });
    }
    let rm = load_weights(&cfg.raw, cfg.adapter.as_ref(), model_cfg.clone(), layout.clone())?;
    let state = match resume {
        Some(dir) => resumed(dir, rm.base_hash.as_deref())?,
        None => TrainState::for_memory(rm.params, layout, mode),
    };
    Ok(HostStart { state, base: rm.base.map(Arc::new), base_hash: rm.base_hash })
}

/// What the resolved `engine.recompute` does, for the start-up line: `kept` of `layers` layers
/// keep their internals.
pub(crate) fn recompute_words(kept: usize, layers: usize) -> String {
    match kept {
        0 => "the backward recomputes each block's inputs and each layer's internals".to_string(),
        k if k == layers => {
            "every layer's internals kept for its backward (no recompute)".to_string()
        }
        k => format!(
            "{k} of {layers} layers keep their internals for their backward (spread evenly, K = 1); the others recompute theirs"
        ),
    }
}

/// Run a job on the streaming engine: steps, `metrics.jsonl`, `summary.json`, and (unless
/// `export` is false, as for benchmarks) the final HF directory. `warmup` steps are excluded
/// from the summary's timings.
pub fn run_streaming(
    cfg: RunConfig,
    export_final: bool,
    warmup: usize,
    resume: Option<&str>,
) -> Result<Summary> {
    cfg.check_device_built()?;
    let out_dir = cfg.raw.output.dir.clone();
    fs::create_dir_all(&out_dir).with_context(|| {
        format!(
            "output.dir {}: cannot create the directory\nhint: choose a writable output.dir",
            out_dir.display()
        )
    })?;
    // Held until this function returns (the OS releases it if the process dies first): a
    // second run into the same directory is refused before it writes anything there.
    let _lock = crate::run::lock::RunLock::acquire(&out_dir)?;
    let yaml = cfg.raw.to_yaml();
    println!("# resolved config ({})\n{yaml}", cfg.origin);
    fs::write(out_dir.join("config.yaml"), &yaml)
        .with_context(|| format!("output.dir {}: cannot write config.yaml", out_dir.display()))?;

    if resume.is_none() {
        earlier_checkpoints(&out_dir, cfg.overwrite)?;
    }
    let resume_dir = resume.map(|r| crate::run::resume::resolve(r, &out_dir)).transpose()?;
    match cfg.raw.device.backend {
        BackendKind::Cpu => {
            let tr = Trainer::with_resume(cfg, resume_dir.as_deref())?;
            drive(tr, out_dir, yaml, resume_dir, export_final, warmup)
        }
        BackendKind::Cuda => {
            let tr = Trainer::on_device(cfg, resume_dir.as_deref(), cuda_device)?;
            drive(tr, out_dir, yaml, resume_dir, export_final, warmup)
        }
    }
}

/// A new run into `out_dir`, which may hold another run's checkpoints: refused (they would
/// be mixed with this run's, and a later `--resume latest` could pick theirs), or with
/// `overwrite` removed first, saying so.
fn earlier_checkpoints(out_dir: &Path, overwrite: bool) -> Result<()> {
    let root = crate::run::resume::checkpoints_dir(out_dir);
    let found = crate::run::resume::list(&root)?;
    let Some((_, latest)) = found.last() else { return Ok(()) };
    if !overwrite {
        bail!(
            "output.dir {} holds another run's checkpoints (the latest {})\nhint: resume \
             that run with --resume latest, start over with --overwrite (its checkpoints are \
             removed), or choose another output.dir",
            out_dir.display(),
            latest.display()
        );
    }
    println!(
        "starting over: removing {} checkpoints of an earlier run in {}",
        found.len(),
        root.display()
    );
    fs::remove_dir_all(&root).with_context(|| format!("cannot remove {}", root.display()))
}

/// Refuses a model the CUDA kernels cannot run (a head dim over the attention kernel's limit,
/// sizes beyond its int range) when the plan is made, naming the limit and the value; rows
/// are at most `seq_len` long.
pub fn cuda_kernel_limits(layout: &ModelLayout, raw: &RawConfig, seq_len: usize) -> Result<()> {
    let d = &layout.dims;
    let shape = horizon_backend::cuda::KernelShape {
        c: d.c,
        h: d.h,
        kvh: d.kvh,
        d: d.d,
        f: d.f,
        v: d.v,
        b: raw.rows_per_micro_batch(),
        t: seq_len,
    };
    horizon_backend::cuda::check_kernel_limits(&shape).context("device.backend = cuda")?;
    Ok(())
}

/// The CUDA device of a run (`device.backend: cuda`): GPU 0, a pool of the plan's device bytes,
/// bf16 weights on the wire and in the slots, bf16 tensor-core matmuls with fp32 accumulation,
/// attention on the kernels `device.attention` picks. In a binary built without the `cuda`
/// feature this is an error saying so.
fn cuda_device(raw: &RawConfig, plan: &MemoryPlan) -> Result<CudaDevice> {
    let mut cfg = CudaDeviceConfig::with_capacity(plan.device_capacity() as usize);
    cfg.attention = raw.device.attention.kernels();
    CudaDevice::new(cfg).context("device.backend = cuda")
}

/// The training examples of a run with `rows` training rows: rows, or a DPO run's pairs (two
/// rows each).
fn examples_of(raw: &RawConfig, rows: usize) -> usize {
    if raw.dpo().is_some() { rows / 2 } else { rows }
}

/// What a run's training examples are called ([`examples_of`]).
fn example_unit(raw: &RawConfig) -> &'static str {
    if raw.dpo().is_some() { "pairs" } else { "rows" }
}

/// What an epoch is in steps: `400 training rows in batches of 8: 50 steps an epoch; 100
/// steps = 2 epochs`.
fn epochs_line(t: &crate::run::config::TrainSection, rows: usize, unit: &str) -> String {
    let (per, steps) = (t.steps_per_epoch(rows), t.total_steps());
    let fmt = |x: f64| {
        let s = format!("{x:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    };
    format!(
        "{rows} training {unit} in batches of {}: {} steps an epoch; {steps} steps = {} epochs",
        t.batch_size,
        fmt(per),
        fmt(steps as f64 / per.max(f64::MIN_POSITIVE))
    )
}

/// The step loop of [`run_streaming`], on any device: the steps from the state's step on, each
/// logged and checked, checkpoints when due or signalled; then the summary and the final export.
fn drive<D: Device>(
    mut tr: Trainer<D>,
    out_dir: PathBuf,
    yaml: String,
    resume_dir: Option<PathBuf>,
    export_final: bool,
    warmup: usize,
) -> Result<Summary>
where
    D::Backend: 'static,
{
    let steps = tr.cfg.raw.train.total_steps();
    let start = tr.engine.state().step as usize;
    if let Some(d) = &resume_dir {
        println!("resuming from {} at step {start}", d.display());
    }
    // A finished run resumed: its metrics, summary, report and final/ stay as they are.
    if start >= steps {
        return Err(AlreadyFinished { step: start as u64 }.into());
    }
    let mut lp = StepLoop::start(&mut tr, &out_dir, start, resume_dir)?;
    for k in start..steps {
        if k == (start + warmup).min(steps - 1) && k > start {
            // The warm-up's last step is logged before the timings start (it waits for its
            // updates, which the restart waits for anyway): it must not count as timed.
            if let Some(mut prev) = lp.pending.take() {
                tr.settle(&mut prev);
                lp.record(&tr, &prev, (start, steps))?;
            }
            lp.restart_timing(&mut tr);
        }
        let mut m = tr.step(k)?;
        m.epoch = (k + 1) as f64 / tr.cfg.raw.train.steps_per_epoch(tr.examples());
        // A step's updates run on beside the next step, so what they held is known once that
        // step has run (the step before's: no wait), or by waiting where something needs it
        // now: a checkpoint, a signal, the end.
        if let Some(mut prev) = lp.pending.take() {
            tr.settle(&mut prev);
            lp.record(&tr, &prev, (start, steps))?;
        }
        let last = k + 1 == steps;
        let every = tr.cfg.raw.train.eval_every;
        if tr.eval.is_some() && ((every > 0 && (k + 1).is_multiple_of(every)) || last) {
            tr.evaluate_into(&mut m)?;
            if let Some(e) = m.eval_loss {
                tracing::info!(step = m.step, eval_loss = e, "evaluated the held-out rows");
            }
        }
        let signalled = lp.stop.load(Ordering::Relaxed) != 0;
        if !(last || signalled || save_due(&tr.cfg, k)) {
            lp.pending = Some(m);
            continue;
        }
        tr.settle(&mut m);
        lp.record(&tr, &m, (start, steps))?;
        if lp.checkpoint(&mut tr, &m, signalled, (&out_dir, &yaml))? {
            break;
        }
    }
    lp.finish(tr, &out_dir, export_final)
}

/// Whether a checkpoint is due after step `k` (0-based): every `train.save_every` steps.
fn save_due(cfg: &RunConfig, k: usize) -> bool {
    let every = cfg.raw.train.save_every;
    every > 0 && (k + 1).is_multiple_of(every)
}

/// What the step loop keeps between steps.
struct StepLoop {
    metrics_path: PathBuf,
    metrics: fs::File,
    /// `OUT/tb/`'s events file (`output.tensorboard`).
    tb: Option<EventWriter>,
    progress: Progress,
    /// Set to the signal's number by SIGINT / SIGTERM: finish the step in flight, write a
    /// checkpoint, stop.
    stop: Arc<AtomicUsize>,
    /// The step after which a signal stopped the run.
    interrupted: Option<u64>,
    last_ckpt: Option<PathBuf>,
    /// Consecutive bad steps ([`StepMetrics::bad`]).
    bad_run: usize,
    /// The last step taken, logged once its held elements are known ([`Trainer::settle`]).
    pending: Option<StepMetrics>,
    tally: Tally,
    /// Steps run by this process.
    ran: usize,
    /// The device's counters and the phases' seconds when the timings started (after the
    /// warm-up), and the clock started then; the run's own clock, for the ETA.
    base: (DeviceStats, PhaseSeconds),
    t0: Instant,
    run_t0: Instant,
}

impl StepLoop {
    /// Signals caught, the metrics file opened (appended to on a resume), the progress shown,
    /// a trace started if asked for.
    fn start<D: Device>(
        tr: &mut Trainer<D>,
        out_dir: &Path,
        start: usize,
        resume_dir: Option<PathBuf>,
    ) -> Result<Self>
    where
        D::Backend: 'static,
    {
        let stop = Arc::new(AtomicUsize::new(0));
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_hook::flag::register_usize(sig, stop.clone(), sig as usize)
                .context("cannot install the signal handler")?;
        }
        // Test hook (test builds only): steps (0-based) whose gradient gets a NaN (exercises
        // the non-finite path).
        #[cfg(feature = "test-hooks")]
        if let Ok(v) = std::env::var("HORIZON_TEST_NAN_STEPS") {
            tr.inject_nan_at = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        }
        announce(tr);
        let steps = tr.cfg.raw.train.total_steps();
        let metrics_path = out_dir.join("metrics.jsonl");
        let metrics = fs::OpenOptions::new()
            .create(true)
            .append(start > 0)
            .write(true)
            .truncate(start == 0)
            .open(&metrics_path)
            .with_context(|| format!("cannot create {}", metrics_path.display()))?;
        let progress = Progress::new(start, steps);
        let tb = match tr.cfg.raw.output.tensorboard {
            true => {
                let mut w = EventWriter::create(&out_dir.join("tb"))?;
                w.text(start as u64, "config", &tr.cfg.raw.to_yaml())?;
                Some(w)
            }
            false => None,
        };
        if tr.cfg.trace.is_some() {
            tr.engine.start_trace((steps - start).min(crate::engine::trace::MAX_STEPS));
        }
        Ok(StepLoop {
            metrics_path,
            metrics,
            tb,
            progress,
            stop,
            interrupted: None,
            last_ckpt: resume_dir,
            bad_run: 0,
            pending: None,
            tally: Tally { last_loss: f64::NAN, ..Tally::default() },
            ran: 0,
            base: (tr.engine.device().stats(), tr.engine.phase_seconds()),
            t0: Instant::now(),
            run_t0: Instant::now(),
        })
    }

    /// Timings start after the warm-up, once its queued work is done.
    fn restart_timing<D: Device>(&mut self, tr: &mut Trainer<D>)
    where
        D::Backend: 'static,
    {
        tr.engine.state();
        self.base = (tr.engine.device().stats(), tr.engine.phase_seconds());
        self.t0 = Instant::now();
        self.tally.tokens = 0;
        self.tally.timed_steps = 0;
    }

    /// Step `m`'s metrics logged and shown; a step without loss or a bad one ([`StepMetrics::
    /// bad`]) counted, and the run stopped after `train.max_bad_steps` bad ones in a row.
    fn record<D: Device>(
        &mut self,
        tr: &Trainer<D>,
        m: &StepMetrics,
        (start, steps): (usize, usize),
    ) -> Result<()>
    where
        D::Backend: 'static,
    {
        let k = m.step - 1;
        self.ran += 1;
        if m.eval_loss.is_some() {
            self.tally.eval_loss = m.eval_loss;
            self.tally.rewards.1 = m.eval_dpo.map(|e| e.0).or(self.tally.rewards.1);
        }
        self.tally.rewards.0 = m.dpo.or(self.tally.rewards.0);
        writeln!(self.metrics, "{}", serde_json::to_string(m)?)
            .with_context(|| format!("cannot write {}", self.metrics_path.display()))?;
        if let Some(tb) = &mut self.tb {
            tb.step(m)?;
        }
        let per_step = self.run_t0.elapsed().as_secs_f64() / (k + 1 - start) as f64;
        // Steps to the end of the epoch this step is in, when the run takes more than one.
        let per_epoch = tr.cfg.raw.train.steps_per_epoch(tr.examples());
        let epoch_end = (m.epoch.ceil() * per_epoch).ceil().min(steps as f64);
        let epoch_eta = (steps as f64 > per_epoch).then(|| per_step * (epoch_end - (k + 1) as f64));
        self.progress.step(m, steps, (per_step * (steps - k - 1) as f64, epoch_eta));
        self.tally.tokens += m.tokens;
        self.tally.timed_steps += 1;
        if m.no_loss {
            self.tally.skipped_steps += 1;
            let line =
                format!("step {}: no position of the batch carries a loss; step skipped", m.step);
            self.progress.println(&line);
        } else if m.bad() {
            self.bad_run += 1;
            self.tally.skipped_steps += usize::from(m.skipped);
            self.tally.held_steps += usize::from(!m.skipped);
            let words = bad_step_words(m, tr.plan.params);
            self.progress.println(&format!("warning: {words} ({} bad in a row)", self.bad_run));
            let most = tr.cfg.raw.train.max_bad_steps;
            if self.bad_run >= most {
                let last = self.last_ckpt.as_ref();
                let last = last.map_or("none".to_string(), |p| p.display().to_string());
                bail!(
                    "stopping: {} consecutive steps with a non-finite loss or gradient norm, a gradient too large for the moments, or updates held back (train.max_bad_steps = {most}); last good checkpoint: {last}\nhint: lower optimizer.lr, set optimizer.grad_clip, or check the data of those steps; {} says what each step met",
                    self.bad_run,
                    self.metrics_path.display()
                );
            }
        } else {
            self.bad_run = 0;
        }
        if !m.no_loss {
            self.tally.last_loss = m.loss;
        }
        Ok(())
    }

    /// A checkpoint after step `m` when one is due (only after good steps: the last one stays
    /// the last good state) or a signal asked for one (`signalled`); true when the run is to
    /// stop. `m` is settled ([`Trainer::settle`]).
    fn checkpoint<D: Device>(
        &mut self,
        tr: &mut Trainer<D>,
        m: &StepMetrics,
        signalled: bool,
        (out_dir, yaml): (&Path, &str),
    ) -> Result<bool>
    where
        D::Backend: 'static,
    {
        let k = m.step - 1;
        let good = !m.skipped && m.held.is_empty();
        if (save_due(&tr.cfg, k) && good) || signalled {
            let keep = tr.cfg.raw.train.keep_checkpoints;
            let state = tr.engine.checked_state()?;
            self.progress.println(&format!("saving checkpoint step-{:08}", state.step));
            let (layout, model) = (&tr.layout, &tr.model_cfg);
            let extras = crate::run::resume::Extras {
                base_hash: tr.base_hash.as_deref(),
                files: tr.dpo.as_ref().map(|d| d.checkpoint_files()).unwrap_or_default(),
            };
            let dir = crate::run::resume::save(out_dir, state, layout, model, yaml, keep, &extras)?;
            tracing::info!(dir = %dir.display(), "checkpoint written");
            self.last_ckpt = Some(dir);
        }
        if signalled {
            self.progress.finish();
            self.interrupted = Some(k as u64 + 1);
            println!("interrupted after step {}; resume with: {}", k + 1, resume_command(&tr.cfg));
        }
        Ok(signalled)
    }

    /// After the last step: `summary.json` (printed too), the trace, and the final export,
    /// unless every step was skipped (then nothing was learnt, and nothing is exported).
    fn finish<D: Device>(
        mut self,
        mut tr: Trainer<D>,
        out_dir: &Path,
        export_final: bool,
    ) -> Result<Summary>
    where
        D::Backend: 'static,
    {
        self.progress.finish();
        self.metrics.flush()?;
        self.tally.state_step = tr.engine.checked_state()?.step;
        let mut summary = summarize(&mut tr, &self.tally, (&self.base.0, &self.base.1), self.t0);
        summary.interrupted_at_step = self.interrupted;
        let summary_path = out_dir.join("summary.json");
        fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("cannot write {}", summary_path.display()))?;
        println!("{}", summary.brief());
        if let Some(path) = &tr.cfg.trace {
            crate::engine::trace::write_chrome(path, "bench", &tr.engine.trace_spans())?;
            println!("trace of the run's steps: {}", path.display());
        }
        // No step trained cleanly: nothing was applied (or only what bad updates left), and
        // exporting it as this run's result would pass a broken model on. metrics.jsonl and
        // summary.json stay.
        let (ran, skipped, held) = (self.ran, self.tally.skipped_steps, self.tally.held_steps);
        if ran > 0 && skipped == ran {
            bail!(
                "every one of the {ran} steps of this run was skipped (a non-finite loss or gradient norm): no update was applied, so {} was not written\nhint: check the model's weights and the data, or lower optimizer.lr; {} has the losses",
                out_dir.join("final").display(),
                self.metrics_path.display()
            );
        }
        if ran > 0 && skipped + held == ran {
            bail!(
                "every one of the {ran} steps of this run was bad ({skipped} skipped, {held} held back updates that would have made a weight or moment non-finite): {} was not written after training\nhint: lower optimizer.lr, set optimizer.grad_clip; {} says what each step held",
                out_dir.join("final").display(),
                self.metrics_path.display()
            );
        }
        if let Some(step) = self.interrupted {
            // No final/: the run is not finished. The report says where it stopped.
            crate::run::plot::write_report(out_dir, &tr.cfg.origin, &summary, None)?;
            let signal = self.stop.load(Ordering::Relaxed) as i32;
            return Err(Interrupted { signal, step, resume: resume_command(&tr.cfg) }.into());
        }
        if export_final {
            let paths = (self.metrics_path.as_path(), summary_path.as_path());
            write_final(&mut tr, out_dir, &summary, paths, self.tally.state_step)?;
        }
        Ok(summary)
    }
}

/// What bad step `m` met, in words: a skipped step's cause, or the elements its updates held
/// (of the model's `params` trained elements).
fn bad_step_words(m: &StepMetrics, params: u64) -> String {
    if !m.held.is_empty() {
        let n: u64 = m.held.iter().map(|h| h.elements).sum();
        return format!(
            "step {}: {n} of {params} elements held back, their new weight or moment would not have been finite ({}): they kept their values, the rest of the step's update applied",
            m.step,
            HeldIn::words(&m.held)
        );
    }
    if m.loss.is_finite() && m.grad_norm.is_finite() {
        return format!(
            "step {}: gradient norm {:.3e} too large for fp32 second moments (a clipped norm of {:.1e} or more); update skipped",
            m.step,
            m.grad_norm,
            crate::optim::step::MAX_CLIPPED_SQ.sqrt()
        );
    }
    format!("step {}: non-finite loss or gradient norm; update skipped", m.step)
}

/// The run's start-up line: the model, the data, the micro-batches, the host threads.
fn announce<D: Device>(tr: &Trainer<D>)
where
    D::Backend: 'static,
{
    println!(
        "model: {} layers, hidden {}, {} params; data: {} {}; {} micro-batch(es) per step, checkpoint every {} layers; host threads: {} (engine.host_threads: {})",
        tr.model_cfg.num_layers,
        tr.model_cfg.hidden_size,
        tr.engine.sizes().params,
        tr.examples(),
        example_unit(&tr.cfg.raw),
        tr.engine.sizes().micro_batches,
        tr.cfg.raw.engine.checkpoint_every,
        tr.engine.host_threads(),
        tr.cfg.raw.engine.host_threads
    );
}

/// What the step loop counted, for the summary.
#[derive(Default)]
struct Tally {
    tokens: usize,
    timed_steps: usize,
    skipped_steps: usize,
    /// Bad steps that were not skipped: their updates held elements back.
    held_steps: usize,
    eval_loss: Option<f64>,
    last_loss: f64,
    state_step: u64,
    /// A DPO run's last step's and last evaluation's reward metrics.
    rewards: (Option<crate::model::dpo::DpoMetrics>, Option<crate::model::dpo::DpoMetrics>),
}

/// The run's summary: the timed steps' throughput, FLOPs and memory against the device's
/// counters at the end of the warm-up (`base`) and the clock started then (`t0`).
fn summarize<D: Device>(
    tr: &mut Trainer<D>,
    tally: &Tally,
    (base, base_phases): (&DeviceStats, &PhaseSeconds),
    t0: Instant,
) -> Summary
where
    D::Backend: 'static,
{
    let Tally {
        tokens,
        timed_steps,
        skipped_steps,
        held_steps,
        eval_loss,
        last_loss,
        state_step,
        rewards: (final_rewards, eval_rewards),
    } = *tally;
    let wall_s = t0.elapsed().as_secs_f64();
    let st = tr.engine.device().stats();
    let compute = st.compute_busy_s - base.compute_busy_s;
    let link = st.link_busy_s - base.link_busy_s;
    let per_step = step_flops(
        tr.engine.schedule(),
        &tr.layout,
        tr.cfg.raw.rows_per_micro_batch(),
        tr.engine.config().seq_len,
    );
    let k = timed_steps as f64;
    let flops = StepFlops {
        schedule: per_step.schedule * k,
        recompute: per_step.recompute * k,
        model: per_step.model * k,
    };
    Summary {
        steps: timed_steps,
        total_steps: state_step as usize,
        skipped_steps,
        held_steps,
        skipped_records: tr.skipped_records,
        eval_loss,
        eval_rows: tr.eval.as_ref().map_or(0, |e| e.len()),
        final_rewards,
        eval_rewards,
        tokens,
        wall_s,
        tokens_per_s: tokens as f64 / wall_s.max(1e-9),
        peak_rss_bytes: peak_rss_bytes().unwrap_or(0),
        planned_host_bytes: tr.plan.host_total(),
        peak_device_bytes: st.peak_bytes as u64,
        planned_device_bytes: tr.plan.device_total(),
        h2d_bytes: st.h2d_bytes - base.h2d_bytes,
        d2h_bytes: st.d2h_bytes - base.d2h_bytes,
        device_compute_s: compute,
        link_busy_s: link,
        overlap_ratio: wall_s / compute.max(link).max(1e-9),
        final_loss: last_loss,
        phase_s: tr.engine.phase_seconds().since(base_phases),
        h2d_busy_s: st.h2d_busy_s - base.h2d_busy_s,
        d2h_busy_s: st.d2h_busy_s - base.d2h_busy_s,
        host_busy_s: st.host_busy_s - base.host_busy_s,
        compute_idle_s: (wall_s - compute).max(0.0),
        flops,
        achieved_gflops: flops.schedule / wall_s.max(1e-9) * 1e-9,
        model_gflops: flops.model / wall_s.max(1e-9) * 1e-9,
        optimizer_memory: tr.cfg.raw.optimizer.memory.name().to_string(),
        params: tr.plan.params,
        planned_host_bytes_per_param: tr.plan.host_total() as f64 / tr.plan.params.max(1) as f64,
        peak_rss_bytes_per_param: peak_rss_bytes().unwrap_or(0) as f64
            / tr.plan.params.max(1) as f64,
        pinned_bytes: st.pinned_bytes as u64,
        planned_pinned_bytes: tr.plan.pinned,
        host_threads: tr.engine.host_threads(),
        weight_upload: tr.engine.config().weight_path().name().to_string(),
        device_wait: tr.cfg.raw.device.wait.resolve(tr.cfg.raw.device.link_gbps).name().to_string(),
        interrupted_at_step: None,
    }
}

/// Refuses to write `final` from weights with a NaN or an infinity (a bad update the step's
/// checks did not see), naming the tensor and the index: one pass over the trained weights.
fn refuse_non_finite(layout: &ModelLayout, params: &ParamStore, final_dir: &Path) -> Result<()> {
    for (name, _) in layout.hf_tensors() {
        let Some(t) = params.tensor(layout, &name) else { continue };
        if let Some(i) = t.iter().position(|x| !x.is_finite()) {
            bail!(
                "{name}[{i}] is {} after training: {} was not written\nhint: the checkpoints \
                 under checkpoints/ hold earlier weights; lower optimizer.lr",
                t[i],
                final_dir.display()
            );
        }
    }
    Ok(())
}

/// The command that resumes the run of `cfg`: its config and `--set` overrides.
fn resume_command(cfg: &RunConfig) -> String {
    let mut c = format!("horizon train --config {}", cfg.origin);
    for o in &cfg.overrides {
        c += &format!(" --set {o}");
    }
    c + " --resume latest"
}

/// `OUT/training.png`, `OUT/report.md` and the exported `OUT/final/`.
fn write_final<D: Device>(
    tr: &mut Trainer<D>,
    out_dir: &Path,
    summary: &Summary,
    (metrics_path, summary_path): (&Path, &Path),
    state_step: u64,
) -> Result<()>
where
    D::Backend: 'static,
{
    let plot_path = out_dir.join("training.png");
    let title = format!("{} ({} steps)", tr.cfg.origin, state_step);
    // The plot is a convenience: failing to draw it does not fail the run.
    let plotted = crate::run::plot::read_metrics(metrics_path)
        .and_then(|pts| crate::run::plot::plot(&pts, &plot_path, &title));
    if let Err(e) = &plotted {
        eprintln!("warning: no plot: {e:#}");
    }
    let report = crate::run::plot::write_report(
        out_dir,
        &tr.cfg.origin,
        summary,
        plotted.is_ok().then_some(plot_path.as_path()),
    )?;
    // Where everything is: the files written, the plot when it was drawn, the event files.
    let mut wrote = vec![metrics_path.display().to_string(), summary_path.display().to_string()];
    wrote.push(report.display().to_string());
    if plotted.is_ok() {
        wrote.push(plot_path.display().to_string());
    }
    if tr.cfg.raw.output.tensorboard {
        wrote.push(format!("{}/ (tensorboard --logdir)", out_dir.join("tb").display()));
    }
    let wrote = wrote.join(", ");
    let final_dir = out_dir.join("final");
    refuse_non_finite(&tr.layout, &tr.engine.state().params, &final_dir)?;
    if let Some(a) = tr.cfg.adapter.clone() {
        let base = tr.cfg.raw.model.path.as_ref().map(|p| p.display().to_string());
        // The tokenizer the run trained with beside the adapter, as TRL's and axolotl's
        // trainers save it (PEFT's save_pretrained alone writes none): first, so that a
        // directory with adapter_config.json always has it.
        fs::create_dir_all(&final_dir)
            .with_context(|| format!("cannot create {}", final_dir.display()))?;
        let source = crate::run::hf_out::TokenizerSource::of_config(&tr.cfg.raw);
        crate::run::hf_out::write_tokenizer(&final_dir, &source)?;
        write_adapter(&tr.layout, &tr.engine.state().params, &a, base.as_deref(), &final_dir)?;
        println!("wrote {wrote} and {} (a PEFT adapter)", final_dir.display());
        return Ok(());
    }
    let params = &tr.engine.state().params;
    let raw = &tr.cfg.raw;
    let exported = crate::run::hf_out::export_model(
        &tr.model_cfg,
        params,
        &final_dir,
        raw.output.export_options(),
        &crate::run::hf_out::ExportSource::of_config(raw),
    )?;
    tracing::info!(
        shards = exported.shards.len(),
        bytes = exported.total_bytes,
        tokenizer_files = exported.tokenizer_files.len(),
        "exported final/"
    );
    println!("wrote {wrote} and {}", final_dir.display());
    Ok(())
}
