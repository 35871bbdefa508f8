//! The model: families' descriptions (`families/`), what a description is and what is derived
//! from it (`spec.rs`: backward program, sizes, FLOPs), the parameter layout, the host parameter
//! store, and the layer-by-layer transformer step that runs any description.

pub mod families;
pub mod layer;
pub mod layout;
pub mod params;
pub mod spec;
pub mod transformer;
