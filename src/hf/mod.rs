//! Hugging Face interop: `config.json` parsing and safetensors checkpoints.

pub mod checkpoint;
pub mod config;
pub mod moe;

pub use checkpoint::{Checkpoint, SaveDtype, list_tensors, read_tensor_f64, write_safetensors};
pub use config::{Arch, ModelConfig, RopeConfig, RopeKind};
