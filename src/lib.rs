//! Horizon: train LLMs whose state is far larger than accelerator memory. Library half of the
//! `horizon` binary (the binary is `src/main.rs`).

pub mod config;
pub mod data;
pub mod engine;
pub mod hf;
pub mod model;
pub mod optim;
pub mod rng;
pub mod train;
