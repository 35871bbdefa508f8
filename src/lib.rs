//! Horizon: train LLMs whose state is far larger than accelerator memory. Library half of the
//! `horizon` binary (the binary is `src/main.rs`).

pub mod adapter;
pub mod bench;
pub mod config;
pub mod data;
pub mod default_job;
pub mod engine;
pub mod export;
pub mod generate;
pub mod hf;
pub mod merge;
pub mod model;
pub mod optim;
pub mod plan_cmd;
pub mod report;
pub mod resume;
pub mod rng;
pub mod run_lock;
pub mod schedule;
pub mod sim;
pub mod store;
pub mod summary;
pub mod tokenizer;
pub mod train;
