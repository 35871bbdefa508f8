//! Horizon: train LLMs whose state is far larger than accelerator memory. Library half of the
//! `horizon` binary (the binary is `src/main.rs`).
//!
//! The modules are layers, and every import points down (`layering` keeps it so):
//! `run` (the verbs and what they share) -> `sim` (the model of a machine) -> `engine` (the step
//! as a plan, and its executor) -> `store` (the host state) -> `optim` -> `model` -> `data`,
//! `adapter` -> `hf`, `tokenizer`, `rng`, and the backend crate below them all.

pub mod adapter;
pub mod data;
pub mod engine;
pub mod hf;
pub mod model;
pub mod optim;
pub mod rng;
pub mod run;
pub mod sim;
pub mod store;
pub mod tokenizer;
