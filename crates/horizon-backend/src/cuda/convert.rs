//! Launcher of `kernels/convert.cu`: fp32 -> bf16 on the device, for the inputs of products
//! (`matmul.rs`) and for gradients on their way to the host as bf16 (`device.rs`). It rounds
//! as the host does ([`crate::bf16::Bf16::from_f32`]: to nearest even, NaN kept quiet), so a
//! value is the same bf16 wherever it was rounded.

use super::CudaBackend;
use super::backend::{arg, blocks, expect_len};
use super::slice::DevSlice;
use crate::Bf16;

/// Enqueue `out[i] = bf16(inp[i])` on `be`'s stream. out, inp: (len).
pub fn round_on_device(be: &CudaBackend, out: &mut DevSlice<Bf16>, inp: &DevSlice<f32>) {
    expect_len("round_on_device", "out", out.len(), inp.len());
    let (o, i, len) = (out.addr(), inp.addr(), inp.len() as i64);
    // SAFETY: argument types match (out is bf16 bits, `unsigned short*`); both buffers hold
    // `len` elements; `out` is exclusively borrowed, so nothing else uses it while it runs.
    unsafe {
        be.launch(
            "convert_f32_to_bf16",
            (blocks(inp.len(), 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [arg(&o), arg(&i), arg(&len)],
        );
    }
}
