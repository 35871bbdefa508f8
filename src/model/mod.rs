//! The model: families' descriptions (`families/`), what a description is and what is derived
//! from it (`spec.rs`: backward program, sizes, FLOPs), the parameter layout, the host parameter
//! store, the layer-by-layer transformer step that runs any description, and the KV-cached
//! decoder of generation.

pub mod base;
pub mod chunks;
pub mod dpo;
pub mod families;
pub mod kv_cache;
pub mod layer;
pub mod layout;
pub mod lora;
pub mod moe;
pub mod params;
pub mod spec;
pub mod transformer;

pub use families::describe;
