//! Host-side optimizers.

pub mod adamw;
pub mod adamw8bit;
#[cfg(target_arch = "x86_64")]
mod adamw8bit_avx2;
#[cfg(target_arch = "x86_64")]
mod adamw8bit_avx512;
pub mod decay;
pub mod lr;
pub mod moments;
pub mod state;
pub mod step;

pub use adamw::{
    AdamWConfig, AdamWStep, BufferStep, adamw_update, adamw_update_image, adamw_update_serial,
    adamw_update_serial_image, clip_coefficient, sum_squares,
};
