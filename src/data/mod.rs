//! Datasets and batching.
//!
//! Records come from JSONL or Parquet files ([`source`], [`parquet`]: one file, a directory or a
//! glob of shards) as JSON objects, whatever the file type. Formats: `pretokenized` (ids and
//! labels as written), `text` (plain language modelling), `alpaca` (instruction tuning), `chat`
//! and `sharegpt` (conversations in the model's chat template), `preference` (prompt, chosen and
//! rejected, tokenized as TRL's DPO trainer does: [`preference`]); the error policy, the load
//! report and loss masking live in `records`. Every format produces [`Row`]s of at most
//! `max_seq_len` tokens, which may then be split ([`split_eval`]), packed ([`pack`]) and
//! shuffled ([`shuffled_order`]).

pub mod alpaca;
pub mod chat;
pub mod dataset;
pub mod pack;
pub mod parquet;
pub mod preference;
pub mod pretokenized;
pub mod records;
pub mod sharegpt;
pub mod source;
pub mod split;
pub mod store;
pub mod text;

pub use alpaca::{alpaca_prompt, load_alpaca};
pub use chat::load_chat;
pub use pack::pack;
pub use preference::{PreferenceReport, load_preference};
pub use pretokenized::{
    Batch, IGNORE_INDEX, PretokenizedDataset, Row, batch_rows, load_pretokenized,
    load_pretokenized_rows, make_batch,
};
pub use records::{JsonObject, LoadReport, OnError, Outcome, carries_loss, example_from_spans};
pub use sharegpt::load_sharegpt;
pub use source::{At, Columns, Fields, Loc, Source, read_records, read_records_into};
pub use split::{shuffled_order, split_eval};
pub use store::{RowStore, RowStoreWriter};
pub use text::load_text;
