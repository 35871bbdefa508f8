//! DPO on the plain reference path (issue 47's first step): the step the streamed engine will
//! be checked against, itself checked against TRL 1.16's float64 fixtures
//! (`tests/dpo_fixtures.rs`).
//!
//! A micro-batch of `m` pairs is one batch of `2m` rows, every chosen sequence then every
//! rejected one (TRL's `DataCollatorForPreference`), right-padded. Its rows' summed completion
//! log-probs come from a forward pass ([`Transformer::row_logps`]); the objective
//! ([`DpoObjective`]) gives the loss and `dL/dlogp` of each row; the forward and backward pass
//! then scales each row's cross-entropy gradient by `-dL/dlogp / G`
//! ([`Transformer::forward_backward_rows`]), `G` micro-batches a step (TRL averages the
//! micro-batch means). The reference's log-probs are computed once, before step 0, with the
//! initial weights (full fine-tuning) or with the adapters off (LoRA: every adapter tensor zero
//! adds exactly nothing), the numbers TRL's reference model gives.

use std::sync::Arc;

use anyhow::{Result, bail};
use horizon_backend::cpu::CpuBackend;

use crate::data::pretokenized::{IGNORE_INDEX, Row, make_batch};
use crate::model::dpo::{DpoMetrics, DpoObjective, PairLogps};
use crate::model::params::ParamStore;
use crate::model::transformer::{Capacity, Transformer};
use crate::optim::decay::DecayGroups;
use crate::run::config::RunConfig;
use crate::run::data::tokens_of;
use crate::run::load::{RunModel, load_run_model};
use crate::store::TrainState;

/// One preference pair as rows: prompt + completion, labels -100 on the prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairRows {
    pub chosen: Row,
    pub rejected: Row,
}

impl PairRows {
    /// The pair of `prompt` and the two completions.
    pub fn new(prompt: &[i32], chosen: &[i32], rejected: &[i32]) -> PairRows {
        let row = |c: &[i32]| Row {
            input_ids: [prompt, c].concat(),
            labels: [vec![IGNORE_INDEX; prompt.len()], c.to_vec()].concat(),
        };
        PairRows { chosen: row(chosen), rejected: row(rejected) }
    }
}

/// Positions of `row` whose log-prob counts (labels past the first that are not -100).
pub fn completion_tokens(row: &Row) -> usize {
    row.labels.iter().skip(1).filter(|&&l| l != IGNORE_INDEX).count()
}

/// What one DPO step logged.
#[derive(Clone, Debug, PartialEq)]
pub struct DpoStep {
    /// The mean of the micro-batches' losses.
    pub loss: f64,
    /// The global L2 norm of the trained tensors' gradient, before clipping.
    pub grad_norm: f64,
    pub metrics: DpoMetrics,
    /// Per pair of the step, in order.
    pub pairs: Vec<PairLogps>,
    /// The update was skipped (a non-finite loss or gradient norm).
    pub skipped: bool,
}

/// DPO on the reference path.
pub struct DpoReference {
    pub cfg: RunConfig,
    pub objective: DpoObjective,
    pub state: TrainState,
    pub engine: Transformer<CpuBackend>,
    /// The weight-decay groups of the trained tensors (`optimizer.no_decay`).
    pub decay: DecayGroups,
    pairs: Vec<PairRows>,
    /// The reference's (chosen, rejected) log-probs of each pair.
    reference: Vec<(f64, f64)>,
    /// Pairs a step, and a micro-batch.
    batch: usize,
    micro: usize,
}

impl DpoReference {
    /// Load the model as `cfg` says, and compute the reference's log-probs of every pair.
    pub fn new(
        cfg: RunConfig,
        objective: DpoObjective,
        pairs: Vec<PairRows>,
        (batch, micro): (usize, usize),
    ) -> Result<DpoReference> {
        objective.validate()?;
        if pairs.is_empty() || micro == 0 || batch % micro != 0 {
            bail!("DPO needs pairs, and a step of whole micro-batches ({batch} pairs by {micro})");
        }
        let raw = &cfg.raw;
        let RunModel { layout, params, base, .. } = load_run_model(raw, cfg.adapter.as_ref())?;
        let longest = pairs
            .iter()
            .flat_map(|p| [p.chosen.input_ids.len(), p.rejected.input_ids.len()])
            .max()
            .unwrap_or(1);
        let cap = Capacity {
            batch: 2 * micro,
            seq_len: longest,
            head_chunk_rows: raw.engine.head_chunk_rows,
        };
        let decay = DecayGroups::new(&layout, raw.optimizer.no_decay);
        let engine = Transformer::with_layout(CpuBackend, layout, base.map(Arc::new), cap);
        let mut t = DpoReference {
            cfg,
            objective,
            state: TrainState::new(params),
            engine,
            decay,
            pairs,
            reference: Vec::new(),
            batch,
            micro,
        };
        t.reference = t.compute_reference()?;
        Ok(t)
    }

    /// The reference's log-probs of every pair, micro-batch by micro-batch: the initial
    /// weights, or, with adapters, none of them (all zero: the base alone, exactly).
    fn compute_reference(&mut self) -> Result<Vec<(f64, f64)>> {
        let no_adapters = match self.engine.layout.trains_base() {
            true => None,
            false => Some(ParamStore::zeros(&self.engine.layout)),
        };
        let params = no_adapters.as_ref().unwrap_or(&self.state.params);
        let mut out = Vec::with_capacity(self.pairs.len());
        for start in (0..self.pairs.len()).step_by(self.micro) {
            let idx: Vec<usize> = (start..(start + self.micro).min(self.pairs.len())).collect();
            let pairs = idx.iter().map(|&i| (&self.pairs[i].chosen, &self.pairs[i].rejected));
            let batch = make_batch(&collated(pairs));
            let logps = self.engine.row_logps(params, tokens_of(&batch))?;
            let m = idx.len();
            out.extend((0..m).map(|i| (logps[i], logps[m + i])));
        }
        Ok(out)
    }

    /// The reference's (chosen, rejected) log-probs of every pair.
    pub fn reference_logps(&self) -> &[(f64, f64)] {
        &self.reference
    }

    /// One optimizer step on pairs `[k*B, (k+1)*B)` (cycling through the data).
    pub fn step(&mut self, k: usize) -> Result<DpoStep> {
        let g = self.batch / self.micro;
        self.state.grads.fill_zero();
        let (pairs, reference) = (&self.pairs, &self.reference);
        let pair = |i: usize| {
            let p = i % pairs.len();
            PairRef {
                chosen: &pairs[p].chosen,
                rejected: &pairs[p].rejected,
                reference: reference[p],
            }
        };
        let mut outs = Vec::with_capacity(g);
        for mb in 0..g {
            let first = k * self.batch + mb * self.micro;
            let group: Vec<PairRef> = (first..first + self.micro).map(pair).collect();
            // One batch for both passes: the log-probs, then the scaled forward and backward.
            let batch = make_batch(&group_rows(&group));
            let logps = self.engine.row_logps(&self.state.params, tokens_of(&batch))?;
            let out = group_objective(&self.objective, &group, &logps, g);
            let (p, grads) = (&self.state.params, &mut self.state.grads);
            self.engine.forward_backward_rows(p, grads, tokens_of(&batch), &out.scales)?;
            outs.push(out);
        }
        let grad_norm = self.state.grad_norm();
        let o = &self.cfg.raw.optimizer;
        let lr = self.cfg.raw.lr_schedule().lr_at(k + 1);
        self.state.optimizer_step(&self.cfg.raw.adamw(), &self.decay, lr, grad_norm, o.grad_clip);
        let step = DpoStep::of(outs, grad_norm, false);
        let skipped = !(step.loss.is_finite() && grad_norm.is_finite());
        Ok(DpoStep { skipped, ..step })
    }
}

/// Pairs' rows as TRL's collator lays a micro-batch out: every chosen, then every rejected.
pub fn collated<'a, I>(pairs: I) -> Vec<&'a Row>
where
    I: Iterator<Item = (&'a Row, &'a Row)> + Clone,
{
    pairs.clone().map(|p| p.0).chain(pairs.map(|p| p.1)).collect()
}

/// A pair as a step takes it: its two rows and the reference's log-probs of them.
#[derive(Clone, Copy)]
pub struct PairRef<'a> {
    pub chosen: &'a Row,
    pub rejected: &'a Row,
    pub reference: (f64, f64),
}

impl PairRef<'_> {
    /// The pair with the policy's (chosen, rejected) log-probs.
    pub fn logps(&self, (policy_chosen, policy_rejected): (f64, f64)) -> PairLogps {
        PairLogps {
            policy_chosen,
            policy_rejected,
            ref_chosen: self.reference.0,
            ref_rejected: self.reference.1,
            chosen_tokens: completion_tokens(self.chosen),
            rejected_tokens: completion_tokens(self.rejected),
        }
    }
}

/// A TRL micro-batch's rows ([`collated`]).
pub fn group_rows<'a>(group: &[PairRef<'a>]) -> Vec<&'a Row> {
    collated(group.iter().map(|p| (p.chosen, p.rejected)))
}

/// What one TRL micro-batch of a step of `g` gives: its share of the step's loss, its metrics,
/// its pairs, and each row's gradient scale `-dL/dlogp / g` (chosen rows, then rejected).
pub struct GroupOut {
    pub loss: f64,
    pub metrics: DpoMetrics,
    pub pairs: Vec<PairLogps>,
    pub scales: Vec<f32>,
}

/// The objective of micro-batch `group` of a step of `g`, with its rows' policy log-probs
/// `logps` ([`group_rows`]' order).
pub fn group_objective(
    objective: &DpoObjective,
    group: &[PairRef],
    logps: &[f64],
    g: usize,
) -> GroupOut {
    let m = group.len();
    let pairs: Vec<PairLogps> =
        group.iter().enumerate().map(|(i, p)| p.logps((logps[i], logps[m + i]))).collect();
    let out = objective.micro_batch(&pairs);
    let scale = |d: f64| (-d / g as f64) as f32;
    let scales = out.dchosen.iter().chain(&out.drejected).map(|&d| scale(d)).collect();
    GroupOut { loss: out.loss / g as f64, metrics: out.metrics, pairs, scales }
}

impl DpoStep {
    /// The step of micro-batches `groups`, whose update had `grad_norm` (`skipped`: not applied).
    pub fn of(groups: Vec<GroupOut>, grad_norm: f64, skipped: bool) -> DpoStep {
        let loss = groups.iter().map(|o| o.loss).sum();
        let metrics = DpoMetrics::mean(&groups.iter().map(|o| o.metrics).collect::<Vec<_>>());
        let pairs = groups.into_iter().flat_map(|o| o.pairs).collect();
        DpoStep { loss, grad_norm, metrics, pairs, skipped }
    }
}
