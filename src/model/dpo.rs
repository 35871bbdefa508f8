//! The DPO family's objective on summed completion log-probabilities, exactly as TRL 1.16's
//! `DPOTrainer` computes it (`tests/fixtures/dpo/README.md` states the semantics), with its
//! gradient with respect to each sequence's log-probability.
//!
//! Data flow: per pair, the policy's summed log-probs of chosen and rejected `pc, pr` (from the
//! head's per-position cross-entropy, negated and summed over the completion) and the
//! reference's `rc, rr` ─► the micro-batch's loss (a weighted sum of loss types, each a mean
//! over the pairs, `sft` a token mean) ─► `dL/dpc_i`, `dL/dpr_i`. The head's backward then
//! scales each sequence's cross-entropy gradient by `-dL/dp` of its sequence (since
//! `p = -Σ ce`): a DPO step is an SFT step with one loss weight per row.
//!
//! Derivation, with `cl = pc - rc`, `rl = pr - rr`, `d = cl - rl`, `β` = beta, `e` = label
//! smoothing, `σ` the logistic function and `logσ' (x) = σ(-x)`:
//! - `sigmoid`: `ℓ = -logσ(β d)`, `dℓ/dd = -β σ(-β d)`.
//! - `ipo`: `h = cl / Nc - rl / Nr - 1 / (2β)`, `ℓ = h²`, `dℓ/dpc = 2h / Nc`, `dℓ/dpr = -2h / Nr`.
//! - `robust`: `ℓ = (-(1-e) logσ(β d) + e logσ(-β d)) / (1 - 2e)`,
//!   `dℓ/dd = (-(1-e) β σ(-β d) - e β σ(β d)) / (1 - 2e)`.
//! - `hinge`: `ℓ = relu(1 - β d)`, `dℓ/dd = -β` where `1 - β d > 0`, else 0 (torch's relu).
//! - `dd/dpc = 1`, `dd/dpr = -1`; the per-pair losses are averaged over the `b` pairs, so each
//!   pair's derivative carries `1/b`.
//! - `sft`: `ℓ = -Σ pc_i / Σ Nc_i` over the micro-batch (a token mean), `dℓ/dpc_i = -1 / Σ Nc`.

use anyhow::{Result, bail};

/// One loss type of TRL's `loss_type` list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DpoLossKind {
    Sigmoid,
    Ipo,
    Robust,
    Hinge,
    Sft,
}

impl DpoLossKind {
    /// The kind TRL calls `name`; an error listing the ones Horizon has.
    pub fn parse(name: &str) -> Result<DpoLossKind> {
        Ok(match name {
            "sigmoid" => DpoLossKind::Sigmoid,
            "ipo" => DpoLossKind::Ipo,
            "robust" => DpoLossKind::Robust,
            "hinge" => DpoLossKind::Hinge,
            "sft" => DpoLossKind::Sft,
            other => bail!(
                "dpo.loss: unknown loss type {other:?}\nhint: sigmoid, ipo, robust, hinge or sft"
            ),
        })
    }

    /// Whether TRL 1.16 reads `label_smoothing` for this type.
    pub fn reads_label_smoothing(self) -> bool {
        self == DpoLossKind::Robust
    }
}

/// The objective: weighted loss types, beta, label smoothing.
#[derive(Clone, Debug, PartialEq)]
pub struct DpoObjective {
    pub beta: f64,
    /// Each type with its weight (`dpo.loss` and `dpo.loss_weights`).
    pub losses: Vec<(DpoLossKind, f64)>,
    pub label_smoothing: f64,
}

impl DpoObjective {
    /// Checks the settings as TRL would use them: a positive beta, one weight per type, and
    /// `label_smoothing` in `[0, 0.5)` only where a type reads it.
    pub fn validate(&self) -> Result<()> {
        if !(self.beta.is_finite() && self.beta > 0.0) {
            bail!("dpo.beta must be > 0 (got {})", self.beta);
        }
        if self.losses.is_empty() {
            bail!("dpo.loss is empty\nhint: sigmoid is DPO");
        }
        let e = self.label_smoothing;
        let reads = self.losses.iter().any(|(k, _)| k.reads_label_smoothing());
        if e != 0.0 && !reads {
            bail!(
                "dpo.label_smoothing {e} does nothing with these losses: TRL 1.16 reads it in \
                 `robust` only (it has no cDPO)\nhint: use loss: [robust], or remove \
                 label_smoothing"
            );
        }
        if !(0.0..0.5).contains(&e) {
            bail!("dpo.label_smoothing must be in [0, 0.5) (got {e})");
        }
        Ok(())
    }
}

/// One pair's summed completion log-probabilities and completion lengths (tokens, >= 1).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PairLogps {
    pub policy_chosen: f64,
    pub policy_rejected: f64,
    pub ref_chosen: f64,
    pub ref_rejected: f64,
    pub chosen_tokens: usize,
    pub rejected_tokens: usize,
}

/// A micro-batch's loss, the metrics TRL logs for it, and the gradient with respect to each
/// pair's policy log-probs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DpoOutput {
    pub loss: f64,
    /// `dL/d policy_chosen_i`, `dL/d policy_rejected_i`.
    pub dchosen: Vec<f64>,
    pub drejected: Vec<f64>,
    pub metrics: DpoMetrics,
}

/// The means TRL logs (`rewards/chosen` ... `logps/rejected`), as `metrics.jsonl` names them.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct DpoMetrics {
    pub rewards_chosen: f64,
    pub rewards_rejected: f64,
    pub reward_accuracy: f64,
    pub reward_margin: f64,
    pub logps_chosen: f64,
    pub logps_rejected: f64,
}

impl DpoMetrics {
    /// The mean of micro-batches' metrics (TRL logs the mean of each micro-batch's means).
    pub fn mean(parts: &[DpoMetrics]) -> DpoMetrics {
        let n = parts.len().max(1) as f64;
        let sum = |f: fn(&DpoMetrics) -> f64| parts.iter().map(f).sum::<f64>() / n;
        DpoMetrics {
            rewards_chosen: sum(|m| m.rewards_chosen),
            rewards_rejected: sum(|m| m.rewards_rejected),
            reward_accuracy: sum(|m| m.reward_accuracy),
            reward_margin: sum(|m| m.reward_margin),
            logps_chosen: sum(|m| m.logps_chosen),
            logps_rejected: sum(|m| m.logps_rejected),
        }
    }

    /// Each metric as (its `metrics.jsonl` name, TRL's log name, its value).
    pub fn fields(&self) -> [(&'static str, &'static str, f64); 6] {
        [
            ("rewards_chosen", "rewards/chosen", self.rewards_chosen),
            ("rewards_rejected", "rewards/rejected", self.rewards_rejected),
            ("reward_accuracy", "rewards/accuracies", self.reward_accuracy),
            ("reward_margin", "rewards/margins", self.reward_margin),
            ("logps_chosen", "logps/chosen", self.logps_chosen),
            ("logps_rejected", "logps/rejected", self.logps_rejected),
        ]
    }

    /// Each metric under its `metrics.jsonl` name (`rewards_chosen`, ...), with `prefix` before
    /// it.
    pub fn named(&self, prefix: &str) -> Vec<(String, f64)> {
        self.fields().into_iter().map(|(k, _, v)| (format!("{prefix}{k}"), v)).collect()
    }
}

/// `log σ(x)`, stable for large `|x|` (as torch's `logsigmoid`).
fn log_sigmoid(x: f64) -> f64 {
    if x >= 0.0 { -(-x).exp().ln_1p() } else { x - x.exp().ln_1p() }
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 { 1.0 / (1.0 + (-x).exp()) } else { x.exp() / (1.0 + x.exp()) }
}

impl DpoObjective {
    /// The loss of one micro-batch of `pairs` and its gradient (see the module doc).
    pub fn micro_batch(&self, pairs: &[PairLogps]) -> DpoOutput {
        let b = pairs.len().max(1) as f64;
        let mut out = DpoOutput {
            dchosen: vec![0.0; pairs.len()],
            drejected: vec![0.0; pairs.len()],
            ..Default::default()
        };
        let chosen_tokens: usize = pairs.iter().map(|p| p.chosen_tokens).sum();
        for &(kind, weight) in &self.losses {
            if kind == DpoLossKind::Sft {
                let n = chosen_tokens.max(1) as f64;
                out.loss += weight * -pairs.iter().map(|p| p.policy_chosen).sum::<f64>() / n;
                out.dchosen.iter_mut().for_each(|g| *g -= weight / n);
                continue;
            }
            for (i, p) in pairs.iter().enumerate() {
                let (l, gc, gr) = self.pair_loss(kind, p);
                out.loss += weight * l / b;
                out.dchosen[i] += weight * gc / b;
                out.drejected[i] += weight * gr / b;
            }
        }
        out.metrics = self.metrics(pairs);
        out
    }

    /// One pair's loss of type `kind` and its derivatives by the policy's chosen and rejected
    /// log-probs.
    fn pair_loss(&self, kind: DpoLossKind, p: &PairLogps) -> (f64, f64, f64) {
        let (beta, e) = (self.beta, self.label_smoothing);
        let (cl, rl) = (p.policy_chosen - p.ref_chosen, p.policy_rejected - p.ref_rejected);
        let d = cl - rl;
        let (loss, dd) = match kind {
            DpoLossKind::Sigmoid => (-log_sigmoid(beta * d), -beta * sigmoid(-beta * d)),
            DpoLossKind::Robust => (
                (-(1.0 - e) * log_sigmoid(beta * d) + e * log_sigmoid(-beta * d)) / (1.0 - 2.0 * e),
                (-(1.0 - e) * beta * sigmoid(-beta * d) - e * beta * sigmoid(beta * d))
                    / (1.0 - 2.0 * e),
            ),
            DpoLossKind::Hinge => {
                let z = 1.0 - beta * d;
                (z.max(0.0), if z > 0.0 { -beta } else { 0.0 })
            }
            DpoLossKind::Ipo => {
                let (nc, nr) = (p.chosen_tokens.max(1) as f64, p.rejected_tokens.max(1) as f64);
                let h = cl / nc - rl / nr - 1.0 / (2.0 * beta);
                return (h * h, 2.0 * h / nc, -2.0 * h / nr);
            }
            DpoLossKind::Sft => unreachable!("sft is a token mean over the micro-batch"),
        };
        (loss, dd, -dd)
    }

    /// TRL's logged means over `pairs` (a tie is not an accurate reward).
    pub fn metrics(&self, pairs: &[PairLogps]) -> DpoMetrics {
        let n = pairs.len().max(1) as f64;
        let mean = |f: &dyn Fn(&PairLogps) -> f64| pairs.iter().map(f).sum::<f64>() / n;
        let chosen = |p: &PairLogps| self.beta * (p.policy_chosen - p.ref_chosen);
        let rejected = |p: &PairLogps| self.beta * (p.policy_rejected - p.ref_rejected);
        DpoMetrics {
            rewards_chosen: mean(&chosen),
            rewards_rejected: mean(&rejected),
            reward_accuracy: mean(&|p| f64::from(u8::from(chosen(p) > rejected(p)))),
            reward_margin: mean(&|p| chosen(p) - rejected(p)),
            logps_chosen: mean(&|p| p.policy_chosen),
            logps_rejected: mean(&|p| p.policy_rejected),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn objective(beta: f64, losses: &[(DpoLossKind, f64)], e: f64) -> DpoObjective {
        DpoObjective { beta, losses: losses.to_vec(), label_smoothing: e }
    }

    fn pairs() -> Vec<PairLogps> {
        let p = |pc, pr, rc, rr, nc, nr| PairLogps {
            policy_chosen: pc,
            policy_rejected: pr,
            ref_chosen: rc,
            ref_rejected: rr,
            chosen_tokens: nc,
            rejected_tokens: nr,
        };
        vec![
            p(-12.5, -20.0, -13.0, -19.0, 5, 9),
            p(-3.0, -2.5, -3.5, -2.0, 2, 3),
            p(-40.0, -41.0, -39.0, -43.5, 14, 12),
        ]
    }

    /// Every loss type's gradient against central differences of its loss.
    #[test]
    fn gradients_match_finite_differences() {
        use DpoLossKind::*;
        let cases = [
            objective(0.1, &[(Sigmoid, 1.0)], 0.0),
            objective(0.3, &[(Ipo, 1.0)], 0.0),
            objective(0.2, &[(Robust, 1.0)], 0.2),
            objective(0.5, &[(Hinge, 1.0)], 0.0),
            objective(0.1, &[(Sigmoid, 1.0), (Sft, 0.5)], 0.0),
        ];
        for obj in cases {
            let base = pairs();
            let got = obj.micro_batch(&base);
            for i in 0..base.len() {
                for chosen in [true, false] {
                    let at = |h: f64| {
                        let mut p = base.clone();
                        let x = if chosen {
                            &mut p[i].policy_chosen
                        } else {
                            &mut p[i].policy_rejected
                        };
                        *x += h;
                        obj.micro_batch(&p).loss
                    };
                    let fd = (at(1e-5) - at(-1e-5)) / 2e-5;
                    let g = if chosen { got.dchosen[i] } else { got.drejected[i] };
                    assert!((g - fd).abs() < 1e-7, "{obj:?} pair {i} chosen {chosen}: {g} vs {fd}");
                }
            }
        }
    }

    #[test]
    fn hand_values() {
        use DpoLossKind::*;
        let tie = [PairLogps { chosen_tokens: 1, rejected_tokens: 1, ..Default::default() }];
        let out = objective(0.1, &[(Sigmoid, 1.0)], 0.0).micro_batch(&tie);
        assert!((out.loss - std::f64::consts::LN_2).abs() < 1e-15);
        assert_eq!(out.metrics.reward_accuracy, 0.0, "a tie is not an accurate reward");
        // robust with e = 0 is sigmoid; hinge at d = 0 is 1; ipo at d = 0 is (1 / (2 beta))^2.
        let p = pairs();
        let sig = objective(0.2, &[(Sigmoid, 1.0)], 0.0).micro_batch(&p);
        let rob = objective(0.2, &[(Robust, 1.0)], 0.0).micro_batch(&p);
        assert!((sig.loss - rob.loss).abs() < 1e-15);
        assert_eq!(objective(0.5, &[(Hinge, 1.0)], 0.0).micro_batch(&tie).loss, 1.0);
        assert!((objective(0.5, &[(Ipo, 1.0)], 0.0).micro_batch(&tie).loss - 1.0).abs() < 1e-15);
        // sft: the token mean of the chosen completions' negative log-probs.
        let sft = objective(0.1, &[(Sft, 1.0)], 0.0).micro_batch(&p);
        assert!((sft.loss - (12.5 + 3.0 + 40.0) / 21.0).abs() < 1e-15);
    }

    #[test]
    fn label_smoothing_only_where_trl_reads_it() {
        use DpoLossKind::*;
        let err = objective(0.1, &[(Sigmoid, 1.0)], 0.1).validate().unwrap_err().to_string();
        assert!(err.contains("robust") && err.contains("label_smoothing"), "{err}");
        objective(0.1, &[(Robust, 1.0)], 0.1).validate().unwrap();
        assert!(objective(0.0, &[(Sigmoid, 1.0)], 0.0).validate().is_err());
        assert!(DpoLossKind::parse("kto").unwrap_err().to_string().contains("sigmoid, ipo"));
    }

    /// The fixtures' per-pair log-probs give their per-step loss and logged metrics (the
    /// float64 reference computed them with TRL 1.16's rules).
    #[test]
    fn fixture_steps_from_their_log_probs() {
        for case in ["dpo_llama_full", "dpo_qwen2_lora"] {
            let path =
                format!("{}/tests/fixtures/dpo/{case}/expected.json", env!("CARGO_MANIFEST_DIR"));
            let e: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            let types = e["loss_type"].as_array().unwrap();
            let weights = e["loss_weights"].as_array().unwrap();
            let losses = types
                .iter()
                .zip(weights)
                .map(|(t, w)| {
                    (DpoLossKind::parse(t.as_str().unwrap()).unwrap(), w.as_f64().unwrap())
                })
                .collect::<Vec<_>>();
            let obj = objective(
                e["beta"].as_f64().unwrap(),
                &losses,
                e["label_smoothing"].as_f64().unwrap(),
            );
            let mb = e["micro_batch"].as_u64().unwrap() as usize;
            for (k, s) in e["per_step"].as_array().unwrap().iter().enumerate() {
                let col = |key: &str| -> Vec<f64> {
                    s[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
                };
                let (pc, pr, rc, rr) = (
                    col("policy_chosen_logps"),
                    col("policy_rejected_logps"),
                    col("ref_chosen_logps"),
                    col("ref_rejected_logps"),
                );
                let all: Vec<PairLogps> = (0..pc.len())
                    .map(|i| PairLogps {
                        policy_chosen: pc[i],
                        policy_rejected: pr[i],
                        ref_chosen: rc[i],
                        ref_rejected: rr[i],
                        chosen_tokens: 1,
                        rejected_tokens: 1,
                    })
                    .collect();
                let outs: Vec<DpoOutput> = all.chunks(mb).map(|c| obj.micro_batch(c)).collect();
                let loss = outs.iter().map(|o| o.loss).sum::<f64>() / outs.len() as f64;
                let m = DpoMetrics::mean(&outs.iter().map(|o| o.metrics).collect::<Vec<_>>());
                let close = |name: &str, got: f64| {
                    let want = s[name].as_f64().unwrap();
                    assert!(
                        (got - want).abs() <= 1e-12 * want.abs().max(1.0),
                        "{case} step {k} {name}: {got} vs {want}"
                    );
                };
                close("loss", loss);
                close("rewards_chosen", m.rewards_chosen);
                close("rewards_rejected", m.rewards_rejected);
                close("reward_accuracy", m.reward_accuracy);
                close("reward_margin", m.reward_margin);
                close("logps_chosen", m.logps_chosen);
                close("logps_rejected", m.logps_rejected);
            }
        }
    }
}
