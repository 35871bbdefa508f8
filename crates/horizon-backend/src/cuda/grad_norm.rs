//! Launcher of `kernels/grad_norm.cu`: the sum of squares of a device buffer, in f64 with a
//! fixed reduction order. The engine takes the global norm on the host (gradients live there);
//! this is the device-side reduction for a backend that keeps gradients on the GPU.

use super::backend::{arg, int};
use super::slice::DevSlice;
use super::{CudaBackend, check};
use crate::DeviceAlloc;

/// Blocks of the partial sums (each block strides over the buffer; a fixed count keeps the
/// result independent of the buffer's size class).
pub const GRAD_NORM_BLOCKS: usize = 256;

impl CudaBackend {
    /// `sum x^2` over `x`, in f64. `partial` is scratch of `2 * GRAD_NORM_BLOCKS` f32 (read as
    /// that many f64 / 2) that the caller owns; waits for the result.
    pub fn sum_squares(&self, x: &DevSlice<f32>, partial: &mut DevSlice<f32>) -> f64 {
        assert_eq!(
            partial.len(),
            2 * GRAD_NORM_BLOCKS,
            "sum_squares: partial must hold {GRAD_NORM_BLOCKS} f64"
        );
        let (p, xa, len) = (partial.addr(), x.addr(), x.len() as i64);
        let _ = int(GRAD_NORM_BLOCKS, "blocks");
        // SAFETY: argument types match; `partial` holds GRAD_NORM_BLOCKS f64, `x` `len` f32.
        unsafe {
            self.launch(
                "grad_norm_partial",
                (GRAD_NORM_BLOCKS as u32, 1, 1),
                (256, 1, 1),
                0,
                &mut [arg(&p), arg(&xa), arg(&len)],
            );
        }
        let mut host = vec![0.0f32; 2 * GRAD_NORM_BLOCKS];
        crate::Backend::download(self, &mut host, partial);
        check("sum_squares", self.synchronize());
        host.chunks_exact(2)
            .map(|w| f64::from_bits(u64::from(w[0].to_bits()) | (u64::from(w[1].to_bits()) << 32)))
            .sum()
    }

    /// Scratch for [`CudaBackend::sum_squares`].
    pub fn sum_squares_scratch(&self) -> <Self as DeviceAlloc>::Mem {
        self.alloc(2 * GRAD_NORM_BLOCKS)
    }
}
