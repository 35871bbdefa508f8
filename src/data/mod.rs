//! Datasets and batching.
//!
//! Formats: `pretokenized` (ids and labels as written), `text` (plain language modelling) and
//! `alpaca` (instruction tuning); the shared JSONL reading, error policy and loss masking live in
//! `records`. Every format produces [`Row`]s of at most `max_seq_len` tokens, which may then be
//! split ([`split_eval`]), packed ([`pack`]) and shuffled ([`shuffled_order`]).

pub mod alpaca;
pub mod chat;
pub mod pack;
pub mod pretokenized;
pub mod records;
pub mod split;
pub mod text;

pub use alpaca::{alpaca_prompt, load_alpaca};
pub use chat::load_chat;
pub use pack::pack;
pub use pretokenized::{
    Batch, IGNORE_INDEX, PretokenizedDataset, Row, batch_rows, load_pretokenized, make_batch,
};
pub use records::{JsonObject, LoadReport, OnError, Outcome, example_from_spans, read_jsonl};
pub use split::{shuffled_order, split_eval};
pub use text::load_text;
