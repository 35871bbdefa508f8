//! LoRA and QLoRA adapters: the `adapter:` section of the config ([`config`]) and PEFT's on-disk
//! adapter format with Horizon's note beside it ([`peft`]). A new adapter's initialisation is
//! part of the layer description ([`crate::model::lora::init_a`]).
//!
//! A targeted projection computes `y = x Wᵀ + b + s · (x Aᵀ) Bᵀ`, with A (r, in), B (out, r),
//! and `s` = [`AdapterConfig::scale`]; W and b are frozen, A and B train.

pub mod config;
pub mod peft;

pub use config::{AdapterConfig, AdapterKind, AdapterSection, AdapterType, BaseDtype, TARGETS};
