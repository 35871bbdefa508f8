//! LoRA and QLoRA adapters: the `adapter:` section of the config ([`config`]), PEFT's on-disk
//! adapter format ([`peft`]), and PEFT's default initialisation of a new adapter ([`init`]).
//!
//! A targeted projection computes `y = x Wᵀ + b + s · (x Aᵀ) Bᵀ`, with A (r, in), B (out, r),
//! and `s` = [`AdapterConfig::scale`]; W and b are frozen, A and B train.

pub mod config;
pub mod init;
pub mod peft;

pub use config::{AdapterConfig, AdapterKind, AdapterSection, AdapterType, BaseDtype, TARGETS};
