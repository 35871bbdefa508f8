//! Datasets and batching.

pub mod pretokenized;

pub use pretokenized::{
    Batch, PretokenizedDataset, Row, batch_rows, load_pretokenized, make_batch,
};
