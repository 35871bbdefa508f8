//! DPO on the streaming engine (issue 47): [`DpoReference`](super::dpo_reference)'s step, with
//! the engine's forward-only pass for the policy's log-probs ([`Engine::row_logps`]) and its
//! step with per-row gradient scales ([`Engine::step_rows`]). A step's rows are its pairs'
//! micro-batches (TRL's: `m` pairs, chosen then rejected), cut into the engine's micro-batches
//! of whatever size it was planned for: the objective needs only each row's log-prob, and
//! right-padding changes no real token.

use anyhow::{Result, bail};
use horizon_backend::Device;

use crate::data::pretokenized::Row;
use crate::engine::exec::{Engine, StepParams};
use crate::model::dpo::DpoObjective;
use crate::run::dpo_reference::{DpoStep, PairRef, PairRows};
use crate::run::dpo_train::{engine_logps, engine_step};

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
        let rows: Vec<(&Row, &Row)> = self.pairs.iter().map(|p| (&p.chosen, &p.rejected)).collect();
        engine_logps(&mut self.engine, &rows, (self.micro, false), &mut |_| {})
    }

    /// The reference's log-probs of every pair.
    pub fn reference(&self) -> &[(f64, f64)] {
        &self.reference
    }

    /// One optimizer step on pairs `[k*B, (k+1)*B)` (cycling), at learning rate `lr`.
    pub fn step(&mut self, k: usize, lr: f64) -> Result<DpoStep> {
        let n = self.pairs.len();
        let pair = |i: usize| {
            let p = (k * self.batch + i) % n;
            let rows = &self.pairs[p];
            PairRef { chosen: &rows.chosen, rejected: &rows.rejected, reference: self.reference[p] }
        };
        let groups: Vec<Vec<PairRef>> = (0..self.batch / self.micro)
            .map(|j| (0..self.micro).map(|i| pair(j * self.micro + i)).collect())
            .collect();
        let sp = StepParams { lr, inject_nan: false };
        engine_step(&mut self.engine, &self.objective, &groups, sp)
    }
}
