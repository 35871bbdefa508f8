//! The model: parameter layout, host parameter store, and the layer-by-layer transformer step.

pub mod layout;
pub mod params;
pub mod transformer;
