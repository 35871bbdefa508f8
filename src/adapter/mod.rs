//! LoRA and QLoRA adapters: the `adapter:` section of the config ([`config`]).
//!
//! A targeted projection computes `y = x Wᵀ + b + s · (x Aᵀ) Bᵀ`, with A (r, in), B (out, r),
//! and `s` = [`AdapterConfig::scale`]; W and b are frozen, A and B train.

pub mod config;

pub use config::{AdapterConfig, AdapterKind, AdapterSection, AdapterType, BaseDtype, TARGETS};
