//! Hugging Face interop: `config.json` parsing, safetensors checkpoints, and Hub ids found in
//! the local Hugging Face cache.

pub mod checkpoint;
pub mod config;
pub mod hub_cache;
pub mod moe;
pub mod mxfp4;

pub use checkpoint::{Checkpoint, SaveDtype, list_tensors, read_tensor_f64, write_safetensors};
pub use config::{Arch, ModelConfig, RopeConfig, RopeKind};
