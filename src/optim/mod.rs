//! Host-side optimizers.

pub mod adamw;
pub mod adamw8bit;
pub mod moments;
pub mod state;

pub use adamw::{
    AdamWConfig, AdamWStep, adamw_update, adamw_update_serial, clip_coefficient, sum_squares,
};
