//! DPO in a run (`train.objective: dpo`, issue 47): the step, the held-out metrics, and the
//! reference's log-probs, on the run's engine.
//!
//! A run's preference data is a row dataset whose pair `i` is rows `2i` (prompt + chosen) and
//! `2i + 1` (prompt + rejected) ([`crate::data::preference`]). A step takes `train.batch_size`
//! pairs in the run's order; each TRL micro-batch of `train.micro_batch_size` pairs is one
//! engine micro-batch, its chosen rows then its rejected ones. The engine gives each row's
//! summed completion log-prob in a forward-only pass ([`Engine::row_logps`]); the objective
//! turns them into the loss and `dL/dlogp`; the step's forward and backward then scales each
//! row's cross-entropy gradient by `-dL/dlogp / G` ([`Engine::step_rows`]), `G` micro-batches a
//! step, as TRL averages them.
//!
//! The reference (`dpo.reference: auto | precomputed`) is computed once, before step 0: a
//! forward-only pass over the training and held-out pairs with the adapters off (LoRA / QLoRA:
//! the frozen base alone) or with the initial weights (full fine-tuning), through the step's
//! own planned buffers. Its two floats a pair stay in host RAM and go into every checkpoint
//! (`dpo_reference.bin`, with a fingerprint of the pairs it was computed over): a resume reads
//! them back, and refuses data that no longer matches, naming the file.

use std::path::Path;

use anyhow::{Context, Result, bail};
use horizon_backend::Device;

use crate::data::pretokenized::{PretokenizedDataset, Row};
use crate::engine::exec::{Engine, StepParams};
use crate::model::dpo::{DpoMetrics, DpoObjective, PairLogps};
use crate::run::config::{RawConfig, ReferenceMode, RunConfig};
use crate::run::data::{BatchOrder, Datasets, micro_batches};
use crate::run::dpo_reference::{
    DpoStep, GroupOut, PairRef, collated, group_objective, group_rows,
};

/// The checkpoint file of the reference's log-probs.
pub const REFERENCE_FILE: &str = "dpo_reference.bin";
const MAGIC: &[u8; 8] = b"HZDPORF1";

/// One optimizer step on `groups` (TRL's micro-batches, each of the same number of pairs) on
/// `engine`: the policy's log-probs, the objective, then the scaled forward and backward.
pub fn engine_step<D: Device>(
    engine: &mut Engine<D>,
    objective: &DpoObjective,
    groups: &[Vec<PairRef>],
    sp: StepParams,
) -> Result<DpoStep>
where
    D::Backend: 'static,
{
    let g = groups.len();
    let rows: Vec<&Row> = groups.iter().flat_map(|p| group_rows(p)).collect();
    let mbs = micro_batches(&rows, engine.config().micro_batch_size);
    let logps = engine.row_logps(mbs.clone())?.concat();
    let mut at = 0;
    let outs: Vec<GroupOut> = groups
        .iter()
        .map(|group| {
            at += 2 * group.len();
            group_objective(objective, group, &logps[at - 2 * group.len()..at], g)
        })
        .collect();
    let scales: Vec<f32> = outs.iter().flat_map(|o| o.scales.iter().copied()).collect();
    let mut at = 0;
    let row_scales = mbs
        .iter()
        .map(|mb| {
            at += mb.b;
            scales[at - mb.b..at].to_vec()
        })
        .collect();
    let out = engine.step_rows(mbs, sp, row_scales)?;
    Ok(DpoStep::of(outs, out.grad_norm, out.skipped))
}

/// Each pair's (chosen, rejected) log-probs with the engine's current weights (`reference`:
/// its reference copy's, [`Engine::reference_row_logps`]), `micro` pairs an engine pass;
/// `done` is told how many pairs are done after each.
pub fn engine_logps<D: Device>(
    engine: &mut Engine<D>,
    pairs: &[(&Row, &Row)],
    (micro, reference): (usize, bool),
    done: &mut dyn FnMut(usize),
) -> Result<Vec<(f64, f64)>>
where
    D::Backend: 'static,
{
    let mut out = Vec::with_capacity(pairs.len());
    for group in pairs.chunks(micro.max(1)) {
        let rows = collated(group.iter().copied());
        let mbs = micro_batches(&rows, engine.config().micro_batch_size);
        let logps = match reference {
            true => engine.reference_row_logps(mbs)?,
            false => engine.row_logps(mbs)?,
        };
        let logps = logps.concat();
        let m = group.len();
        out.extend((0..m).map(|i| (logps[i], logps[m + i])));
        done(out.len());
    }
    Ok(out)
}

/// A run's DPO: the objective, the reference's log-probs, and the order steps read pairs in.
pub struct DpoRun {
    pub objective: DpoObjective,
    /// The reference's (chosen, rejected) log-probs of each training pair, then of each
    /// held-out pair.
    reference: Vec<(f64, f64)>,
    train_pairs: usize,
    /// The fingerprint of the pairs the reference was computed over ([`fingerprint`]).
    fingerprint: u64,
    order: BatchOrder,
    /// Pairs a TRL micro-batch.
    micro: usize,
    /// `dpo.reference: live`: the reference's log-probs from the engine's reference copy,
    /// step by step (`reference` stays empty).
    live: bool,
    /// A step's pair indices and rows (read into, step after step).
    idx: Vec<usize>,
    rows: Vec<Row>,
}

/// The DPO metrics of the held-out pairs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DpoEval {
    pub loss: f64,
    pub metrics: DpoMetrics,
}

impl DpoRun {
    /// The run's DPO over `train` (and `eval`): the reference read from the checkpoint at
    /// `resume`, or computed now on `engine` (before any step).
    pub fn new<D: Device>(
        cfg: &RunConfig,
        engine: &mut Engine<D>,
        (train, eval): (&PretokenizedDataset, Option<&PretokenizedDataset>),
        resume: Option<&Path>,
    ) -> Result<DpoRun>
    where
        D::Backend: 'static,
    {
        let raw = &cfg.raw;
        let objective = raw.dpo().context("a DPO run without dpo settings")?.objective()?;
        let (t, micro) = (&raw.train, raw.train.micro_batch_rows());
        let train_pairs = train.len() / 2;
        let live = engine.config().reference_copy;
        let fingerprint = if live { 0 } else { fingerprint(train, eval)? };
        let reference = match resume {
            _ if live => Vec::new(),
            Some(dir) => read_reference(&dir.join(REFERENCE_FILE), fingerprint, train, eval)?,
            None => compute_reference(engine, (train, eval), micro, cfg.adapter.is_some())?,
        };
        Ok(DpoRun {
            objective,
            reference,
            train_pairs,
            fingerprint,
            order: BatchOrder::new(train_pairs, t.batch_size, raw.data.shuffle, t.seed),
            micro,
            live,
            idx: Vec::new(),
            rows: Vec::new(),
        })
    }

    /// Training pairs (an epoch).
    pub fn pairs(&self) -> usize {
        self.train_pairs
    }

    /// One optimizer step on the pairs of batch `k`, at `sp`'s learning rate; and the step's
    /// tokens.
    pub fn step<D: Device>(
        &mut self,
        engine: &mut Engine<D>,
        data: &PretokenizedDataset,
        k: usize,
        sp: StepParams,
    ) -> Result<(DpoStep, usize)>
    where
        D::Backend: 'static,
    {
        self.order.indices(k, &mut self.idx);
        let empty = || Row { input_ids: Vec::new(), labels: Vec::new() };
        self.rows.resize_with(2 * self.idx.len(), empty);
        for (j, &p) in self.idx.iter().enumerate() {
            data.read_row(2 * p, &mut self.rows[2 * j])?;
            data.read_row(2 * p + 1, &mut self.rows[2 * j + 1])?;
        }
        let tokens = self.rows.iter().map(|r| r.input_ids.len()).sum();
        let rows: Vec<(&Row, &Row)> = self.rows.chunks(2).map(|p| (&p[0], &p[1])).collect();
        let reference = match self.live {
            true => engine_logps(engine, &rows, (self.micro, true), &mut |_| {})?,
            false => self.idx.iter().map(|&p| self.reference[p]).collect(),
        };
        let pairs: Vec<PairRef> = (rows.iter().zip(reference))
            .map(|(&(chosen, rejected), reference)| PairRef { chosen, rejected, reference })
            .collect();
        let mut pairs = pairs.into_iter();
        let groups: Vec<Vec<PairRef>> = (0..self.idx.len().div_ceil(self.micro))
            .map(|_| pairs.by_ref().take(self.micro).collect())
            .collect();
        Ok((engine_step(engine, &self.objective, &groups, sp)?, tokens))
    }

    /// The held-out pairs' loss and metrics with the current weights (TRL's evaluation: the
    /// mean over micro-batches of `train.micro_batch_size` pairs).
    pub fn evaluate<D: Device>(
        &self,
        engine: &mut Engine<D>,
        eval: &PretokenizedDataset,
    ) -> Result<DpoEval>
    where
        D::Backend: 'static,
    {
        let (n, mut losses, mut metrics) = (eval.len() / 2, Vec::new(), Vec::new());
        for start in (0..n).step_by(self.micro) {
            let idx: Vec<usize> = (start..(start + self.micro).min(n)).collect();
            let rows = idx
                .iter()
                .map(|&p| Ok((eval.row(2 * p)?, eval.row(2 * p + 1)?)))
                .collect::<Result<Vec<_>>>()?;
            let refs: Vec<(&Row, &Row)> = rows.iter().map(|(c, r)| (c, r)).collect();
            let logps = engine_logps(engine, &refs, (self.micro, false), &mut |_| {})?;
            let reference = match self.live {
                true => engine_logps(engine, &refs, (self.micro, true), &mut |_| {})?,
                false => idx.iter().map(|&p| self.reference[self.train_pairs + p]).collect(),
            };
            let pairs: Vec<PairLogps> = (refs.iter().zip(reference).zip(logps))
                .map(|((&(chosen, rejected), reference), l)| {
                    PairRef { chosen, rejected, reference }.logps(l)
                })
                .collect();
            let out = self.objective.micro_batch(&pairs);
            losses.push(out.loss);
            metrics.push(out.metrics);
        }
        let loss = losses.iter().sum::<f64>() / losses.len().max(1) as f64;
        Ok(DpoEval { loss, metrics: DpoMetrics::mean(&metrics) })
    }

    /// The files a checkpoint carries: the reference's log-probs.
    pub fn checkpoint_files(&self) -> Vec<(&'static str, Vec<u8>)> {
        if self.live {
            return Vec::new();
        }
        let mut b = Vec::with_capacity(32 + 16 * self.reference.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&self.fingerprint.to_le_bytes());
        b.extend_from_slice(&(self.train_pairs as u64).to_le_bytes());
        b.extend_from_slice(&(self.reference.len() as u64).to_le_bytes());
        for &(c, r) in &self.reference {
            b.extend_from_slice(&c.to_le_bytes());
            b.extend_from_slice(&r.to_le_bytes());
        }
        vec![(REFERENCE_FILE, b)]
    }
}

/// The reference's log-probs of the training then held-out pairs: the engine's weights with
/// the adapters off (an adapter run) or as they are (the initial weights), before step 0.
fn compute_reference<D: Device>(
    engine: &mut Engine<D>,
    (train, eval): (&PretokenizedDataset, Option<&PretokenizedDataset>),
    micro: usize,
    adapters: bool,
) -> Result<Vec<(f64, f64)>>
where
    D::Backend: 'static,
{
    let total = (train.len() + eval.map_or(0, |e| e.len())) / 2;
    let what = if adapters { "the base (adapters off)" } else { "the initial weights" };
    println!("dpo: the reference's log-probs of {total} pairs, from {what}, before step 0");
    let bar = reference_bar(total);
    let kept = if adapters { Some(engine.adapters_off()?) } else { None };
    let t0 = std::time::Instant::now();
    let mut out = Vec::with_capacity(total);
    for set in std::iter::once(train).chain(eval) {
        // A few hundred pairs at a time: the pass reads the rows, it does not hold them.
        for start in (0..set.len() / 2).step_by(256) {
            let end = (start + 256).min(set.len() / 2);
            let rows = (start..end)
                .map(|p| Ok((set.row(2 * p)?, set.row(2 * p + 1)?)))
                .collect::<Result<Vec<_>>>()?;
            let refs: Vec<(&Row, &Row)> = rows.iter().map(|(c, r)| (c, r)).collect();
            let base = out.len();
            out.extend(engine_logps(engine, &refs, (micro, false), &mut |n| {
                bar.set_position((base + n) as u64)
            })?);
        }
    }
    if let Some(kept) = kept {
        engine.adapters_on(kept)?;
    }
    bar.finish_and_clear();
    println!("dpo: reference done in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(out)
}

/// The reference pass's progress bar (hidden off a terminal).
fn reference_bar(total: usize) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total as u64);
    let style = indicatif::ProgressStyle::with_template(
        "reference {elapsed_precise} [{bar:30.cyan/blue}] {pos}/{len} pairs eta {eta}",
    )
    .expect("the template is valid")
    .progress_chars("=> ");
    bar.set_style(style);
    bar
}

/// The plan's host line of a precomputed reference (`dpo.reference: auto | precomputed`): two
/// f64 a pair, training and held-out. (A live reference's copy is the engine's own line.)
/// `sets`: `None` when the data could not be read (the line says it is not counted).
pub fn reference_line(raw: &RawConfig, sets: Option<&Datasets>) -> Option<(&'static str, u64)> {
    let d = raw.dpo()?;
    if d.reference == ReferenceMode::Live {
        return None;
    }
    let Some(sets) = sets else {
        return Some(("DPO reference log-probs (16 B a pair; the data unread, not counted)", 0));
    };
    let pairs = (sets.train.len() + sets.eval.as_ref().map_or(0, |e| e.len())) / 2;
    Some(("DPO reference log-probs (precomputed, 16 B a pair)", 16 * pairs as u64))
}

/// A fingerprint of the training and held-out pairs, in order: every row's ids and labels.
pub fn fingerprint(train: &PretokenizedDataset, eval: Option<&PretokenizedDataset>) -> Result<u64> {
    let mut h = crate::hash::Stream::new();
    let mut row = Row { input_ids: Vec::new(), labels: Vec::new() };
    for (tag, set) in [(0u8, Some(train)), (1u8, eval)] {
        let Some(set) = set else { continue };
        h.feed(&[tag]);
        h.feed(&(set.len() as u64).to_le_bytes());
        for r in 0..set.len() {
            set.read_row(r, &mut row)?;
            h.feed(&(row.input_ids.len() as u64).to_le_bytes());
            row.input_ids.iter().for_each(|t| h.feed(&t.to_le_bytes()));
            row.labels.iter().for_each(|t| h.feed(&t.to_le_bytes()));
        }
    }
    Ok(h.finish())
}

/// The reference's log-probs a checkpoint holds at `path`, refused unless they were computed
/// over the pairs this run reads (`fingerprint`).
fn read_reference(
    path: &Path,
    fingerprint: u64,
    train: &PretokenizedDataset,
    eval: Option<&PretokenizedDataset>,
) -> Result<Vec<(f64, f64)>> {
    let b = std::fs::read(path).with_context(|| {
        format!(
            "cannot read {}: a DPO run's checkpoint holds its reference log-probs\nhint: \
             resume from a checkpoint this DPO run wrote",
            path.display()
        )
    })?;
    let word = |i: usize| u64::from_le_bytes(b[8 + 8 * i..16 + 8 * i].try_into().unwrap());
    if b.len() < 32 || &b[..8] != MAGIC || b.len() as u64 != 32 + 16 * word(2) {
        bail!("{}: not a reference file of this version, or cut short", path.display());
    }
    let pairs = (train.len() + eval.map_or(0, |e| e.len())) / 2;
    if word(0) != fingerprint || word(2) as usize != pairs {
        bail!(
            "{}: the reference log-probs were computed over other data ({} pairs, fingerprint \
             {:016x}; this run reads {pairs} pairs, fingerprint {fingerprint:016x})\nhint: \
             resume with the data the run started with (data.path, data.eval_path, \
             dpo.max_length, the tokenizer), or start over with --overwrite",
            path.display(),
            word(2),
            word(0)
        );
    }
    let f = |i: usize| f64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    Ok((0..pairs).map(|p| (f(32 + 16 * p), f(40 + 16 * p))).collect())
}
