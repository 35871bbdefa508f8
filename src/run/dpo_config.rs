//! The `dpo:` section and `train.objective` (issue 47): what a preference run trains, and the
//! checks a config gets before anything loads.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use crate::adapter::AdapterType;
use crate::model::dpo::{DpoLossKind, DpoObjective};
use crate::run::config::{DataFormat, RawConfig};

/// What a run trains. Default `sft`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Supervised fine-tuning: the mean cross-entropy of the loss-carrying positions.
    #[default]
    Sft,
    /// Direct preference optimization and its relatives (`dpo:`), on `data.format: preference`.
    Dpo,
}

/// Where the reference's log-probabilities come from.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ReferenceMode {
    /// `precomputed`: with LoRA/QLoRA the adapters are off (the frozen base, exactly the model
    /// PEFT's `disable_adapter` gives), in full fine-tuning the initial weights.
    #[default]
    Auto,
    /// One forward-only pass over the data before step 0 (adapters off, or the initial
    /// weights), two floats a pair kept in host RAM and saved with every checkpoint.
    Precomputed,
    /// Full fine-tuning: the initial weights kept as a bf16 copy in host RAM (2 B a
    /// parameter, page-locked) and streamed through the device for each step's pairs, beside
    /// the policy: no pass before step 0, nothing stored per pair, one more forward a step.
    Live,
}

/// One loss type or a list of them (`loss: sigmoid` or `loss: [sigmoid, sft]`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn names(&self) -> Vec<&str> {
        match self {
            OneOrMany::One(s) => vec![s.as_str()],
            OneOrMany::Many(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

/// TRL 1.16's `DPOConfig`, the keys Horizon reads (`tests/fixtures/dpo/README.md`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DpoSection {
    /// The strength of the pull toward the reference (TRL's `beta`). Default 0.1.
    pub beta: f64,
    /// `sigmoid` (DPO), `ipo`, `robust`, `hinge`, `sft`; several are summed with
    /// `loss_weights`. Default `[sigmoid]`.
    pub loss: OneOrMany,
    /// One weight per loss type. Default 1.0 each.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_weights: Option<Vec<f64>>,
    /// Read by `robust` only, as in TRL 1.16 (an error with any other loss). Default 0.
    pub label_smoothing: f64,
    /// `auto`, `precomputed` or `live`. Default `auto`.
    pub reference: ReferenceMode,
    /// TRL's `max_length`: each sequence keeps its first `max_length` tokens, and a pair whose
    /// prompt alone reaches it is left out. Default 1024.
    pub max_length: usize,
}

impl Default for DpoSection {
    fn default() -> Self {
        DpoSection {
            beta: 0.1,
            loss: OneOrMany::Many(vec!["sigmoid".into()]),
            loss_weights: None,
            label_smoothing: 0.0,
            reference: ReferenceMode::Auto,
            max_length: 1024,
        }
    }
}

impl DpoSection {
    /// The objective the section describes, checked as TRL would use it.
    pub fn objective(&self) -> Result<DpoObjective> {
        let names = self.loss.names();
        let weights = match &self.loss_weights {
            None => vec![1.0; names.len()],
            Some(w) if w.len() == names.len() => w.clone(),
            Some(w) => bail!(
                "dpo.loss_weights has {} weights for {} loss types\nhint: one weight per entry \
                 of dpo.loss, in its order",
                w.len(),
                names.len()
            ),
        };
        if let Some(w) = weights.iter().find(|w| !w.is_finite()) {
            bail!("dpo.loss_weights: {w} is not a finite number");
        }
        let losses = names
            .iter()
            .zip(weights)
            .map(|(n, w)| Ok((DpoLossKind::parse(n)?, w)))
            .collect::<Result<Vec<_>>>()?;
        let o = DpoObjective { beta: self.beta, losses, label_smoothing: self.label_smoothing };
        o.validate()?;
        Ok(o)
    }
}

impl RawConfig {
    /// The run's `dpo:` section (its defaults when the run trains DPO without one); `None` for
    /// SFT.
    pub fn dpo(&self) -> Option<DpoSection> {
        (self.train.objective == Objective::Dpo).then(|| self.dpo.clone().unwrap_or_default())
    }

    /// Rows a step's sequences fill: a DPO step's pairs give two each.
    pub fn rows_per_step(&self) -> usize {
        self.train.batch_size * self.rows_per_example()
    }

    /// Rows per micro-batch ([`crate::run::config::TrainSection::micro_batch_rows`], two per
    /// pair for DPO).
    pub fn rows_per_micro_batch(&self) -> usize {
        self.train.micro_batch_rows() * self.rows_per_example()
    }

    fn rows_per_example(&self) -> usize {
        match self.train.objective {
            Objective::Sft => 1,
            Objective::Dpo => 2,
        }
    }

    /// The longest sequence a run admits: `dpo.max_length` for DPO, else `train.max_seq_len`.
    pub fn row_limit(&self) -> usize {
        self.dpo().map_or(self.train.max_seq_len, |d| d.max_length)
    }

    /// The checks of `train.objective` and `dpo:` against the rest of the config.
    pub(crate) fn check_objective(&self, origin: &str) -> Result<()> {
        let dpo = self.train.objective == Objective::Dpo;
        let preference = self.data.format == DataFormat::Preference;
        if dpo && !preference {
            bail!(
                "{origin}: train.objective is dpo but data.format is {}\nhint: DPO trains on \
                 pairs: data.format: preference (prompt / chosen / rejected records)",
                self.data.format.name()
            );
        }
        if preference && !dpo {
            bail!(
                "{origin}: data.format is preference but train.objective is sft\nhint: set \
                 train.objective: dpo to train on preference pairs"
            );
        }
        if self.dpo.is_some() && !dpo {
            bail!(
                "{origin}: a dpo: section is set but train.objective is sft\nhint: set \
                 train.objective: dpo, or remove the dpo: section"
            );
        }
        let Some(d) = self.dpo() else { return Ok(()) };
        let at = |e: anyhow::Error| anyhow::anyhow!("{origin}: {e:#}");
        d.objective().map_err(at)?;
        if d.max_length < 2 {
            bail!("{origin}: dpo.max_length must be at least 2 (got {})", d.max_length);
        }
        let (b, m) = (self.train.batch_size, self.train.micro_batch_rows());
        if b % m != 0 {
            bail!(
                "{origin}: train.batch_size {b} is not a multiple of train.micro_batch_size {m}: \
                 a DPO step averages whole micro-batches of pairs, as TRL's gradient \
                 accumulation\nhint: make batch_size a multiple of micro_batch_size"
            );
        }
        if self.data.train_on_prompt {
            bail!(
                "{origin}: data.train_on_prompt with train.objective: dpo\nhint: DPO scores \
                 the completions only, as TRL; remove data.train_on_prompt"
            );
        }
        if self.data.pack {
            bail!(
                "{origin}: data.pack with train.objective: dpo\nhint: DPO scores whole \
                 sequences one per row; remove data.pack"
            );
        }
        if d.reference == ReferenceMode::Live && self.adapter.kind != AdapterType::None {
            bail!(
                "{origin}: dpo.reference: live is for full fine-tuning\nhint: with an adapter \
                 the reference is the frozen base itself (adapters off): use auto"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Result<crate::run::config::RunConfig> {
        let yaml = format!(
            "model: {{ init: random, arch: llama, hidden_size: 8, intermediate_size: 16, \
             num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2, \
             vocab_size: 300 }}\n{extra}"
        );
        RawConfig::from_yaml(&yaml, "t.yaml")?.resolve("t.yaml")
    }

    const PREF: &str = "data: { path: p.jsonl, format: preference }\n";

    #[test]
    fn a_dpo_run_reads_its_section_and_doubles_its_rows() {
        let c = cfg(&format!(
            "{PREF}train: {{ objective: dpo, batch_size: 4, micro_batch_size: 2 }}\n\
             dpo: {{ beta: 0.2, loss: [sigmoid, sft], loss_weights: [1.0, 0.5] }}\n"
        ))
        .unwrap();
        let o = c.raw.dpo().unwrap().objective().unwrap();
        assert_eq!(o.beta, 0.2);
        assert_eq!(o.losses, vec![(DpoLossKind::Sigmoid, 1.0), (DpoLossKind::Sft, 0.5)]);
        assert_eq!((c.raw.rows_per_step(), c.raw.rows_per_micro_batch()), (8, 4));
        assert_eq!(c.raw.row_limit(), 1024);
        let d = cfg(&format!("{PREF}train: {{ objective: dpo }}\ndpo: {{ loss: ipo }}\n")).unwrap();
        assert_eq!(d.raw.dpo().unwrap().objective().unwrap().losses[0].0, DpoLossKind::Ipo);
        let sft = cfg("data: { path: d.jsonl }\n").unwrap();
        assert_eq!((sft.raw.dpo(), sft.raw.rows_per_step()), (None, 8));
    }

    #[test]
    fn mismatched_objective_data_and_settings_are_refused_by_key() {
        let err = |extra: &str| format!("{:#}", cfg(extra).unwrap_err());
        let e = err("data: { path: p.jsonl }\ntrain: { objective: dpo }\n");
        assert!(e.contains("data.format: preference"), "{e}");
        let e = err(PREF);
        assert!(e.contains("train.objective: dpo"), "{e}");
        let e = err("data: { path: d.jsonl }\ndpo: { beta: 0.1 }\n");
        assert!(e.contains("dpo: section is set"), "{e}");
        let dpo = |d: &str| err(&format!("{PREF}train: {{ objective: dpo }}\ndpo: {d}\n"));
        let e = dpo("{ label_smoothing: 0.1 }");
        assert!(e.contains("label_smoothing") && e.contains("robust"), "{e}");
        let e = dpo("{ loss: [sigmoid, ipo], loss_weights: [1.0] }");
        assert!(e.contains("dpo.loss_weights has 1 weights for 2"), "{e}");
        let e = dpo("{ loss: [kto] }");
        assert!(e.contains("unknown loss type \"kto\""), "{e}");
        let e = dpo("{ beta: 0 }");
        assert!(e.contains("dpo.beta"), "{e}");
        let e = err(&format!(
            "{PREF}train: {{ objective: dpo }}\ndpo: {{ reference: live }}\n\
             adapter: {{ type: lora, r: 2, alpha: 4, targets: [q_proj] }}\n"
        ));
        assert!(e.contains("live is for full fine-tuning"), "{e}");
        let e = err(&format!(
            "{PREF}train: {{ objective: dpo, batch_size: 5, micro_batch_size: 2 }}\n"
        ));
        assert!(e.contains("not a multiple"), "{e}");
        let e = dpo("{ max_length: 1 }");
        assert!(e.contains("dpo.max_length"), "{e}");
        let e = err(
            "data: { path: p.jsonl, format: preference, pack: true }\ntrain: { objective: dpo }\n",
        );
        assert!(e.contains("data.pack"), "{e}");
        let robust = cfg(&format!(
            "{PREF}train: {{ objective: dpo }}\ndpo: {{ loss: robust, label_smoothing: 0.1 }}\n"
        ));
        assert!(robust.is_ok(), "{:?}", robust.err());
    }
}
