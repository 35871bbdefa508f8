//! DPO on the streaming engine (issue 47): [`DpoReference`](super::dpo_reference)'s step, with
//! the engine's forward-only pass for the policy's log-probs ([`Engine::row_logps`]) and its
//! step with per-row gradient scales ([`Engine::step_rows`]). A step's rows are its pairs'
//! micro-batches (TRL's: `m` pairs, chosen then rejected), cut into the engine's micro-batches
//! of whatever size it was planned for: the objective needs only each row's log-prob, and
//! right-padding changes no real token.

use anyhow::{Result, bail};
use horizon_backend::Device;

use crate::data::pretokenized::Row;
use crate::engine::exec::{Engine, MicroBatch, StepParams};
use crate::model::dpo::{DpoMetrics, DpoObjective};
use crate::run::data::micro_batches;
use crate::run::dpo_reference::{DpoStep, PairRows, pair_logps, rows};

/// DPO on the streaming engine.
pub struct DpoStreamed<D: Device> {
    pub engine: Engine<D>,
    objective: DpoObjective,
    pairs: Vec<PairRows>,
    /// The reference's (chosen, rejected) log-probs of each pair.
    reference: Vec<(f64, f64)>,
    /// Pairs a step, and a micro-batch (TRL's).
    batch: usize,
    micro: usize,
}

impl<D: Device> DpoStreamed<D>
where
    D::Backend: 'static,
{
    /// DPO over `pairs` on `engine` (planned for `2 * batch` rows a step). `reference`: the
    /// reference's log-probs of every pair, or `None` to compute them now with the engine's
    /// weights (full fine-tuning: the initial weights are the reference).
    pub fn new(
        engine: Engine<D>,
        objective: DpoObjective,
        pairs: Vec<PairRows>,
        (batch, micro): (usize, usize),
        reference: Option<Vec<(f64, f64)>>,
    ) -> Result<Self> {
        objective.validate()?;
        if pairs.is_empty() || micro == 0 || batch % micro != 0 {
            bail!("DPO needs pairs, and a step of whole micro-batches ({batch} pairs by {micro})");
        }
        let mut t = DpoStreamed { engine, objective, pairs, reference: Vec::new(), batch, micro };
        t.reference = match reference {
            Some(r) if r.len() == t.pairs.len() => r,
            Some(r) => bail!("{} reference log-probs for {} pairs", r.len(), t.pairs.len()),
            None => t.reference_now()?,
        };
        Ok(t)
    }

    /// The reference's log-probs: the engine's current weights over every pair.
    fn reference_now(&mut self) -> Result<Vec<(f64, f64)>> {
        let mut out = Vec::with_capacity(self.pairs.len());
        for start in (0..self.pairs.len()).step_by(self.micro) {
            let idx: Vec<usize> = (start..(start + self.micro).min(self.pairs.len())).collect();
            let logps = self.logps(&self.micro_batches(std::slice::from_ref(&idx)))?;
            let m = idx.len();
            out.extend((0..m).map(|i| (logps[i], logps[m + i])));
        }
        Ok(out)
    }

    /// The reference's log-probs of every pair.
    pub fn reference(&self) -> &[(f64, f64)] {
        &self.reference
    }

    /// The engine's micro-batches of the pairs `groups` (each a TRL micro-batch): every group's
    /// chosen rows, then its rejected ones, group after group.
    fn micro_batches(&self, groups: &[Vec<usize>]) -> Vec<MicroBatch> {
        let rows: Vec<&Row> = groups.iter().flat_map(|g| rows(&self.pairs, g)).collect();
        micro_batches(&rows, self.engine.config().micro_batch_size)
    }

    /// Each row's log-prob with the current weights, in row order.
    fn logps(&mut self, mbs: &[MicroBatch]) -> Result<Vec<f64>> {
        Ok(self.engine.row_logps(mbs.to_vec())?.concat())
    }

    /// One optimizer step on pairs `[k*B, (k+1)*B)` (cycling), at learning rate `lr`.
    pub fn step(&mut self, k: usize, lr: f64) -> Result<DpoStep> {
        let g = self.batch / self.micro;
        let n = self.pairs.len();
        let groups: Vec<Vec<usize>> = (0..g)
            .map(|j| (0..self.micro).map(|i| (k * self.batch + j * self.micro + i) % n).collect())
            .collect();
        let mbs = self.micro_batches(&groups);
        let logps = self.logps(&mbs)?;
        let (mut loss, mut metrics, mut all, mut scales) =
            (0.0, Vec::new(), Vec::new(), Vec::new());
        for (j, idx) in groups.iter().enumerate() {
            let rows = &logps[j * 2 * self.micro..(j + 1) * 2 * self.micro];
            let pairs = pair_logps(&self.pairs, &self.reference, idx, rows);
            let out = self.objective.micro_batch(&pairs);
            let scale = |d: f64| (-d / g as f64) as f32;
            scales.extend(out.dchosen.iter().chain(&out.drejected).map(|&d| scale(d)));
            loss += out.loss / g as f64;
            metrics.push(out.metrics);
            all.extend(pairs);
        }
        let mut at = 0;
        let row_scales = mbs
            .iter()
            .map(|mb| {
                at += mb.b;
                scales[at - mb.b..at].to_vec()
            })
            .collect();
        let out = self.engine.step_rows(mbs, StepParams { lr, inject_nan: false }, row_scales)?;
        let metrics = DpoMetrics::mean(&metrics);
        Ok(DpoStep { loss, grad_norm: out.grad_norm, metrics, pairs: all })
    }
}
