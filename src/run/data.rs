//! A run's data: the training and held-out rows a config names (loaded, tokenised, split, packed),
//! the row length every buffer is sized for, and the order and shape steps take them in.

use std::borrow::Borrow;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};

use crate::data::preference::load_preference;
use crate::data::pretokenized::{Batch, PretokenizedDataset, Row, make_batch};
use crate::data::{
    LoadReport, RowStore, Source, load_alpaca, load_chat, load_pretokenized_rows, load_sharegpt,
    load_text, shuffled_order, split_eval,
};
use crate::engine::exec::MicroBatch;
use crate::model::transformer::Tokens;
use crate::rng::SplitMix64;
use crate::run::config::{DataFormat, RawConfig, RunConfig};
use crate::run::load::load_tokenizer;
use crate::tokenizer::Tokenizer;

/// Row indices of batch `k`: `[k*B, (k+1)*B)` cycling through the data; with `shuffle`, each
/// epoch reads the rows in its own seeded permutation.
pub fn batch_indices(len: usize, k: usize, b: usize, shuffle: bool, seed: u64) -> Vec<usize> {
    let mut out = Vec::with_capacity(b);
    BatchOrder::new(len, b, shuffle, seed).indices(k, &mut out);
    out
}

/// The order batches read rows in ([`batch_indices`]), keeping the current epoch's permutation
/// so that a step costs O(batch), not O(rows).
#[derive(Clone, Debug)]
pub struct BatchOrder {
    len: usize,
    b: usize,
    shuffle: bool,
    seed: u64,
    /// The permutation of epoch `epoch` (shuffling only).
    perm: Vec<usize>,
    epoch: Option<usize>,
}

impl BatchOrder {
    pub fn new(len: usize, b: usize, shuffle: bool, seed: u64) -> Self {
        BatchOrder { len, b, shuffle, seed, perm: Vec::new(), epoch: None }
    }

    /// The row indices of batch `k` into `out` (cleared first).
    pub fn indices(&mut self, k: usize, out: &mut Vec<usize>) {
        out.clear();
        for i in 0..self.b {
            let g = k * self.b + i;
            let (epoch, pos) = (g / self.len, g % self.len);
            if !self.shuffle {
                out.push(pos);
                continue;
            }
            if self.epoch != Some(epoch) {
                self.perm = shuffled_order(self.len, self.seed, epoch as u64);
                self.epoch = Some(epoch);
            }
            out.push(self.perm[pos]);
        }
    }
}

/// The rows a config names (the training part, when a held-out split is configured).
pub fn load_data(raw: &RawConfig, vocab_size: usize) -> Result<PretokenizedDataset> {
    Ok(load_datasets(raw, vocab_size)?.train)
}

/// The training rows, the held-out rows if any, and what loading left out.
pub struct Datasets {
    pub train: PretokenizedDataset,
    /// `data.eval_fraction` of the examples, or the rows of `data.eval_path`.
    pub eval: Option<PretokenizedDataset>,
    /// Records left out under `data.on_error: skip` (or whose prompt alone is too long), over
    /// both files.
    pub skipped_records: usize,
    /// Examples cut at `train.max_seq_len`.
    pub truncated_records: usize,
}

/// Load the training data and the held-out split the config names: split before packing, so
/// that evaluation holds whole examples, then pack each part.
pub fn load_datasets(raw: &RawConfig, vocab_size: usize) -> Result<Datasets> {
    let d = &raw.data;
    let t = &raw.train;
    let path = d.path.clone().unwrap_or_else(|| "synthetic".into());
    let (store, report) = load_rows(raw, d.path.as_deref(), vocab_size)?;
    let (mut skipped, mut truncated) = (report.skipped.len(), report.truncated);
    let store = Arc::new(store);
    let all = |s: &RowStore| (0..s.len() as u32).collect::<Vec<u32>>();
    let pack = d.pack.then_some(t.max_seq_len);
    let (rows, eval) = match &d.eval_path {
        Some(p) => {
            let (eval, r) = load_rows(raw, Some(p), vocab_size)?;
            skipped += r.skipped.len();
            truncated += r.truncated;
            let members = all(&eval);
            let eval = PretokenizedDataset::new(Arc::new(eval), &members, pack, p);
            (all(&store), Some(eval))
        }
        None if d.eval_fraction > 0.0 => {
            let (train, eval) = split_examples(&store, d.eval_fraction, t.seed, raw);
            if eval.is_empty() {
                bail!(
                    "data.eval_fraction {}: {} has too few examples to hold any out\nhint: add data, or give data.eval_path",
                    d.eval_fraction,
                    path.display()
                );
            }
            for (part, rows) in [("training", &train), ("held-out", &eval)] {
                if !rows.iter().any(|&i| store.carries_loss(i as usize)) {
                    bail!(
                        "data.eval_fraction {}: no {part} row of {} carries a loss\nhint: change data.eval_fraction or train.seed, or give data.eval_path",
                        d.eval_fraction,
                        path.display()
                    );
                }
            }
            (train, Some(PretokenizedDataset::new(store.clone(), &eval, pack, &path)))
        }
        None => (all(&store), None),
    };
    if let Some(e) = &eval {
        let what = match d.format {
            DataFormat::Preference => format!("{} pairs", e.len() / 2),
            _ => format!("{} rows", e.len()),
        };
        println!("eval: {what} held out ({})", e.path.display());
    }
    Ok(Datasets {
        train: PretokenizedDataset::new(store, &rows, pack, &path),
        eval,
        skipped_records: skipped,
        truncated_records: truncated,
    })
}

/// The rows of `store` split into training and held-out examples (a fraction `f` of them,
/// drawn from `seed`): a preference pair's two rows stay together.
fn split_examples(store: &RowStore, f: f64, seed: u64, raw: &RawConfig) -> (Vec<u32>, Vec<u32>) {
    if raw.data.format != DataFormat::Preference {
        return split_eval((0..store.len() as u32).collect(), f, seed);
    }
    let (train, eval) = split_eval((0..store.len() as u32 / 2).collect(), f, seed);
    let rows = |pairs: Vec<u32>| pairs.into_iter().flat_map(|p| [2 * p, 2 * p + 1]).collect();
    (rows(train), rows(eval))
}

/// The row length a run's buffers are sized for, and where it comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqLen {
    pub len: usize,
    /// For the plan: `the longest row of the data (...)`, or why `train.max_seq_len` was assumed.
    pub why: String,
    /// The training rows' own tokens and their number (`None` when the data was not read): a
    /// step pads every row to `len`, so `tokens / (rows * len)` of its positions are real.
    pub train_tokens: Option<(usize, usize)>,
}

impl SeqLen {
    /// The longest row of the training and held-out rows (after tokenisation and packing: packed
    /// rows are up to `train.max_seq_len` long), at most `train.max_seq_len`. Every buffer the
    /// engine allocates is sized by it, so short rows are not planned at `max_seq_len`.
    pub fn of_data(raw: &RawConfig, sets: &Datasets) -> SeqLen {
        let max = raw.row_limit();
        let train = sets.train.longest();
        let eval = sets.eval.as_ref().map_or(0, PretokenizedDataset::longest);
        let len = train.max(eval).clamp(1, max);
        let packed = if raw.data.pack { "packed " } else { "" };
        let of = if sets.eval.is_some() { "training and eval " } else { "" };
        SeqLen {
            len,
            why: format!("the longest row of the {packed}{of}data ({} {max})", limit_key(raw)),
            train_tokens: Some((sets.train.tokens(), sets.train.len())),
        }
    }

    /// The share of a step's positions that are the data's own tokens, not padding (`None`
    /// when the data was not read).
    pub fn real_fraction(&self) -> Option<f64> {
        let (tokens, rows) = self.train_tokens?;
        Some(tokens as f64 / (rows.max(1) * self.len) as f64)
    }

    /// `train.max_seq_len`, assumed because the data's rows are not known (`why`).
    pub fn assumed(raw: &RawConfig, why: &str) -> SeqLen {
        let (len, key) = (raw.row_limit(), limit_key(raw));
        SeqLen { len, why: format!("{key}, assumed: {why}"), train_tokens: None }
    }
}

/// The key that bounds a run's rows: `dpo.max_length` or `train.max_seq_len`.
fn limit_key(raw: &RawConfig) -> &'static str {
    if raw.dpo().is_some() { "dpo.max_length" } else { "train.max_seq_len" }
}

/// The rows of one dataset (a JSONL or Parquet file, a directory or a glob of them) in the
/// config's format (`None`: synthetic rows), unpacked.
fn load_rows(
    raw: &RawConfig,
    path: Option<&Path>,
    vocab_size: usize,
) -> Result<(RowStore, LoadReport)> {
    let d = &raw.data;
    let max = raw.train.max_seq_len;
    let path = || path.context("data.path is missing");
    let (rows, report) = match d.format {
        DataFormat::Pretokenized => {
            let src = Source::new(path()?, &d.columns);
            load_pretokenized_rows(&src, max, vocab_size, d.on_error)?
        }
        DataFormat::Synthetic => {
            let t = &raw.train;
            let n = t.batch_size * t.total_steps().min(16);
            let rows = synthetic_rows(n, max, vocab_size, t.seed);
            let report = LoadReport { rows: rows.len(), records: rows.len(), ..Default::default() };
            return Ok((RowStore::from_rows(&rows)?, report));
        }
        DataFormat::Preference => load_pairs(raw, &Source::new(path()?, &d.columns), vocab_size)?,
        DataFormat::Text | DataFormat::Alpaca | DataFormat::Chat | DataFormat::Sharegpt => {
            let tok = load_tokenizer(raw)?;
            tokenizer_fits(tok.as_ref(), vocab_size)?;
            let (p, tok, top) =
                (&Source::new(path()?, &d.columns), tok.as_ref(), d.train_on_prompt);
            match d.format {
                DataFormat::Text => load_text(p, tok, max, d.on_error)?,
                DataFormat::Alpaca => load_alpaca(p, tok, max, top, d.on_error)?,
                DataFormat::Sharegpt => load_sharegpt(p, tok, max, top, d.on_error)?,
                _ => load_chat(p, tok, max, top, d.on_error)?,
            }
        }
    };
    let spilled = rows.disk_bytes() as f64 / (1u64 << 20) as f64;
    println!(
        "data: {}: {} (read from a {spilled:.1} MiB spill file, not held in RAM)",
        path()?.display(),
        report.summary()
    );
    Ok((rows, report))
}

/// An error unless the tokenizer's ids all lie in the model's vocabulary of `vocab` ids.
fn tokenizer_fits(tok: &dyn Tokenizer, vocab: usize) -> Result<()> {
    if tok.vocab_size() > vocab {
        bail!(
            "the tokenizer has {} ids but the model's vocab_size is {vocab}\nhint: the tokenizer \
             and the model must match",
            tok.vocab_size()
        );
    }
    Ok(())
}

/// A `preference` file's pairs as rows (pair `i`: rows `2i`, chosen, and `2i + 1`, rejected),
/// tokenized as TRL's `DPOTrainer` does ([`load_preference`]) and cut at `dpo.max_length`; its
/// report's warnings printed (equal completions, a moved prompt boundary).
fn load_pairs(raw: &RawConfig, src: &Source, vocab: usize) -> Result<(RowStore, LoadReport)> {
    // A tokenizer when the config names one (or the model directory has one): pretokenized
    // pairs need none, and a text record without one is refused by the loader, by line.
    let named = raw.data.tokenizer.is_some()
        || raw.model.path.as_ref().is_some_and(|p| p.join("tokenizer.json").is_file());
    let tok = named.then(|| load_tokenizer(raw)).transpose()?;
    if let Some(t) = &tok {
        tokenizer_fits(t.as_ref(), vocab)?;
    }
    let max = raw.row_limit();
    let (rows, rep) = load_preference(src, tok.as_deref(), max, raw.data.on_error)?;
    for w in rep.warnings() {
        println!("warning: data: {}: {w}", src.path.display());
    }
    if let Some((id, loc)) = &rep.largest_id
        && *id as usize >= vocab
    {
        bail!(
            "{loc}: token id {id} is >= the model's vocab_size {vocab}\nhint: the data was \
             tokenized for another model"
        );
    }
    println!("data: {}: {}", src.path.display(), rep.summary());
    Ok((rows, rep.load))
}

/// `n` rows of `len` uniformly random tokens.
pub fn synthetic_rows(n: usize, len: usize, vocab: usize, seed: u64) -> Vec<Row> {
    let mut rng = SplitMix64::new(seed ^ 0x5DEE_CE66_D1CE_4E5B);
    (0..n)
        .map(|_| {
            let ids: Vec<i32> = (0..len).map(|_| rng.below(vocab as u64) as i32).collect();
            Row { labels: ids.clone(), input_ids: ids }
        })
        .collect()
}

/// Reads the rows of each step in the run's order, into buffers it keeps: a step holds its
/// own rows, never the dataset.
#[derive(Clone, Debug)]
pub struct StepRows {
    order: BatchOrder,
    idx: Vec<usize>,
    rows: Vec<Row>,
}

impl StepRows {
    /// The reader of `data` in the order `cfg` gives.
    pub fn new(cfg: &RunConfig, data: &PretokenizedDataset) -> StepRows {
        let t = &cfg.raw.train;
        let order = BatchOrder::new(data.len(), t.batch_size, cfg.raw.data.shuffle, t.seed);
        StepRows { order, idx: Vec::new(), rows: Vec::new() }
    }

    /// The rows of optimizer step `k` (valid until the next call).
    pub fn read(&mut self, data: &PretokenizedDataset, k: usize) -> Result<&[Row]> {
        self.order.indices(k, &mut self.idx);
        let empty = || Row { input_ids: Vec::new(), labels: Vec::new() };
        self.rows.resize_with(self.idx.len(), empty);
        for (&i, row) in self.idx.iter().zip(&mut self.rows) {
            data.read_row(i, row)?;
        }
        Ok(&self.rows)
    }
}

/// A step's rows as the engine takes them: micro-batches of at most `size` rows, each
/// right-padded with shifted targets.
pub fn micro_batches<R: Borrow<Row>>(rows: &[R], size: usize) -> Vec<MicroBatch> {
    rows.chunks(size.max(1))
        .map(|chunk| {
            let b = make_batch(&chunk.iter().map(Borrow::borrow).collect::<Vec<_>>());
            let (ids, targets, mask) =
                (Arc::new(b.input_ids), Arc::new(b.targets), Arc::new(b.mask));
            MicroBatch { b: b.b, t: b.t, ids, targets, mask }
        })
        .collect()
}

/// A data batch as the model takes it: its rows' token ids and shifted targets.
pub fn tokens_of(batch: &Batch) -> Tokens<'_> {
    Tokens {
        b: batch.b,
        t: batch.t,
        ids: &batch.input_ids,
        targets: &batch.targets,
        mask: &batch.mask,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_order_visits_each_row_once_per_epoch_and_matches_a_fresh_order() {
        let (len, b) = (10, 4);
        let mut order = BatchOrder::new(len, b, true, 7);
        let mut seen = Vec::new();
        let mut idx = Vec::new();
        for k in 0..5 {
            order.indices(k, &mut idx);
            assert_eq!(idx, batch_indices(len, k, b, true, 7), "batch {k}");
            seen.extend_from_slice(&idx);
        }
        for epoch in seen.chunks(len) {
            let mut e = epoch.to_vec();
            e.sort();
            assert_eq!(e, (0..len).collect::<Vec<_>>());
        }
        assert_ne!(seen[..len], seen[len..], "each epoch has its own permutation");
        let mut plain = BatchOrder::new(len, b, false, 7);
        plain.indices(2, &mut idx);
        assert_eq!(idx, [8, 9, 0, 1]);
    }
}

#[cfg(test)]
mod step_rows_tests {
    use super::*;
    use crate::run::config::RawConfig;

    /// A step reads from the spill file exactly the rows the seeded order names, packed as
    /// packing in memory packs them, epoch after epoch.
    #[test]
    fn steps_read_the_rows_the_seeded_order_names() {
        let rows: Vec<Row> = (0..23)
            .map(|i| {
                let ids: Vec<i32> = (0..1 + i % 5).map(|j| i * 10 + j).collect();
                Row { labels: ids.clone(), input_ids: ids }
            })
            .collect();
        let yaml = "model: { init: random, arch: llama, hidden_size: 8, intermediate_size: 16, \
                    num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2, \
                    vocab_size: 300 }\ndata: { path: x.jsonl, shuffle: true, pack: true }\n\
                    train: { batch_size: 3, max_seq_len: 8, seed: 5 }\n";
        let cfg = RawConfig::from_yaml(yaml, "t").unwrap().resolve("t").unwrap();
        let store = Arc::new(RowStore::from_rows(&rows).unwrap());
        let all: Vec<u32> = (0..rows.len() as u32).collect();
        let data = PretokenizedDataset::new(store, &all, Some(8), Path::new("x.jsonl"));
        let packed = crate::data::pack(rows.clone(), 8);
        let mut reader = StepRows::new(&cfg, &data);
        for k in 0..20 {
            let want: Vec<Row> = batch_indices(packed.len(), k, 3, true, 5)
                .into_iter()
                .map(|i| packed[i].clone())
                .collect();
            assert_eq!(reader.read(&data, k).unwrap(), want, "step {k}");
        }
    }
}
