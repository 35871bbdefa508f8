//! The CUDA backend's stand-in when the `cuda` feature is off: the same names exist, so code
//! above the backend needs no `#[cfg]`, and every constructor returns an error saying the binary
//! was built without CUDA. [`CudaDevice`] and [`CudaBackend`] are uninhabited: no value of them
//! can exist, so their trait methods are unreachable by construction.

#[path = "cuda/config.rs"]
mod config;

pub use config::{
    AttentionKernels, CudaDeviceConfig, CudaError, KernelShape, MAX_HEAD_DIM, WIRE_CHUNK,
    WIRE_RING_BYTES, check_kernel_limits,
};

use std::sync::Arc;

use crate::device::{
    DevBuf, Device, DeviceStats, Event, HostPtr, HostPtrMut, HostWork, Kernel, KernelTimer,
    OutOfDeviceMemory, Queue, StagingElem,
};
use crate::{AttnDims, Backend, Bf16, Dinp, GluClamp, MoeDims, NormDims, Precision};

/// Whether this binary was built with the CUDA backend.
pub const BUILT_WITH_CUDA: bool = false;

fn built_without() -> CudaError {
    CudaError(
        "this binary was built without CUDA\nhint: rebuild with `cargo build --release --features \
         cuda`, or use device.backend = cpu"
            .into(),
    )
}

/// Always fails: this binary was built without CUDA.
pub fn probe() -> Result<(), CudaError> {
    Err(built_without())
}

/// Library checks (the built-without-CUDA answers).
pub mod probe {
    /// Always false without the `cuda` feature.
    pub fn driver_present() -> bool {
        false
    }
    /// Always false without the `cuda` feature.
    pub fn nvrtc_present() -> bool {
        false
    }
}

/// The CUDA backend; cannot exist in a binary built without CUDA.
#[derive(Clone, Copy, Debug)]
pub enum CudaBackend {}

impl CudaBackend {
    /// Always fails: this binary was built without CUDA.
    pub fn new(_ordinal: usize, _workspace_bytes: usize) -> Result<Self, CudaError> {
        Err(built_without())
    }
}

impl crate::DeviceAlloc for CudaBackend {
    type Mem = Vec<f32>;
    type IMem = Vec<i32>;
    type WMem = Vec<Bf16>;
    fn alloc(&self, _: usize) -> Vec<f32> {
        match *self {}
    }
    fn alloc_i32(&self, _: usize) -> Vec<i32> {
        match *self {}
    }
    fn alloc_weights(&self, _: usize) -> Vec<Bf16> {
        match *self {}
    }
}

/// The CUDA device; cannot exist in a binary built without CUDA.
#[derive(Debug)]
pub enum CudaDevice {}

impl CudaDevice {
    /// Always fails: this binary was built without CUDA.
    pub fn new(_cfg: CudaDeviceConfig) -> Result<Self, CudaError> {
        Err(built_without())
    }
}

impl Backend for CudaBackend {
    type Buf = [f32];
    type IBuf = [i32];
    type WBuf = [Bf16];
    /// As the real backend's: the memory plan of a CUDA run is the same in any build.
    const PRECISION: Precision = Precision::Bf16;
    fn name(&self) -> &'static str {
        match *self {}
    }
    fn upload_weights(&self, _: &mut [Bf16], _: &[f32]) {
        match *self {}
    }
    fn upload(&self, _: &mut [f32], _: &[f32]) {
        match *self {}
    }
    fn upload_i32(&self, _: &mut [i32], _: &[i32]) {
        match *self {}
    }
    fn download(&self, _: &mut [f32], _: &[f32]) {
        match *self {}
    }
    fn copy(&self, _: &mut [f32], _: &[f32]) {
        match *self {}
    }
    fn zero(&self, _: &mut [f32]) {
        match *self {}
    }
    fn embedding_forward(&self, _: &mut [f32], _: &[i32], _: &[f32], _: usize) {
        match *self {}
    }
    fn embedding_backward(&self, _: &mut [f32], _: &[i32], _: &[f32], _: usize) {
        match *self {}
    }
    fn rmsnorm_forward(&self, _: &mut [f32], _: &mut [f32], _: &[f32], _: &[Bf16], _: NormDims) {
        match *self {}
    }
    fn rmsnorm_backward(
        &self,
        _: &mut [f32],
        _: Option<&mut [f32]>,
        _: &[f32],
        _: &[f32],
        _: &[Bf16],
        _: &[f32],
        _: NormDims,
    ) {
        match *self {}
    }
    fn head_rmsnorm_forward(
        &self,
        _: &mut [f32],
        _: &mut [f32],
        _: &[f32],
        _: &[Bf16],
        _: AttnDims,
        _: NormDims,
    ) {
        match *self {}
    }
    fn head_rmsnorm_backward(
        &self,
        _: &mut [f32],
        _: Option<&mut [f32]>,
        _: &[f32],
        _: &[f32],
        _: &[Bf16],
        _: &[f32],
        _: AttnDims,
        _: NormDims,
    ) {
        match *self {}
    }
    fn geglu_forward(&self, _: &mut [f32], _: &[f32], _: usize, _: usize) {
        match *self {}
    }
    fn geglu_backward(&self, _: &mut [f32], _: &[f32], _: &[f32], _: usize, _: usize) {
        match *self {}
    }
    fn matmul_forward(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: &[Bf16],
        _: Option<&[Bf16]>,
        _: usize,
        _: usize,
        _: usize,
    ) {
        match *self {}
    }
    fn matmul_backward(
        &self,
        _: Option<Dinp<'_, [f32]>>,
        _: Option<&mut [f32]>,
        _: Option<&mut [f32]>,
        _: &[f32],
        _: &[f32],
        _: &[Bf16],
        _: usize,
        _: usize,
        _: usize,
    ) {
        match *self {}
    }
    fn rope_forward(&self, _: &mut [f32], _: &[f32], _: &[f32], _: AttnDims) {
        match *self {}
    }
    fn rope_backward(&self, _: &mut [f32], _: &[f32], _: &[f32], _: AttnDims) {
        match *self {}
    }
    fn attention_forward(&self, _: &mut [f32], _: &mut [f32], _: &[f32], _: AttnDims) {
        match *self {}
    }
    fn attention_backward(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: AttnDims,
    ) {
        match *self {}
    }
    fn attention_sink_forward(&self, _: &mut [f32], _: &mut [f32], _: &[Bf16], _: AttnDims) {
        match *self {}
    }
    fn attention_sink_backward(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: &[Bf16],
        _: AttnDims,
    ) {
        match *self {}
    }
    fn attention_decode(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: Option<&[Bf16]>,
        _: usize,
        _: AttnDims,
    ) {
        match *self {}
    }
    fn moe_route_forward(
        &self,
        _: &mut [f32],
        _: &mut [f32],
        _: &mut [f32],
        _: &[f32],
        _: MoeDims,
    ) {
        match *self {}
    }
    fn moe_route_backward(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: Option<(&[f32], &[f32])>,
        _: MoeDims,
    ) {
        match *self {}
    }
    fn moe_aux_stats(&self, _: &mut [f32], _: &[f32], _: &[f32], _: &[f32], _: MoeDims) {
        match *self {}
    }
    fn moe_gather(&self, _: &mut [f32], _: &[f32], _: &[f32], _: usize, _: usize) {
        match *self {}
    }
    fn moe_scatter_add(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: &[f32],
        _: Option<&[f32]>,
        _: usize,
        _: usize,
    ) {
        match *self {}
    }
    fn moe_scale_rows(&self, _: &mut [f32], _: &[f32], _: &[f32], _: usize) {
        match *self {}
    }
    fn moe_row_dots(&self, _: &mut [f32], _: &[f32], _: &[f32], _: &[f32], _: usize) {
        match *self {}
    }
    fn moe_bias_dots(&self, _: &mut [f32], _: &[f32], _: &[Bf16], _: &[f32], _: usize) {
        match *self {}
    }
    fn sigmoid_gate_forward(&self, _: &mut [f32], _: &[f32], _: &[f32], _: usize) {
        match *self {}
    }
    fn sigmoid_gate_backward(
        &self,
        _: &mut [f32],
        _: &mut [f32],
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: usize,
    ) {
        match *self {}
    }
    fn swiglu_forward(&self, _: &mut [f32], _: &[f32], _: usize, _: usize) {
        match *self {}
    }
    fn swiglu_backward(&self, _: &mut [f32], _: &[f32], _: &[f32], _: usize, _: usize) {
        match *self {}
    }
    fn clamped_swiglu_forward(&self, _: &mut [f32], _: &[f32], _: usize, _: usize, _: GluClamp) {
        match *self {}
    }
    fn clamped_swiglu_backward(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: &[f32],
        _: (usize, usize),
        _: GluClamp,
    ) {
        match *self {}
    }
    fn residual_forward(&self, _: &mut [f32], _: &[f32], _: &[f32]) {
        match *self {}
    }
    fn add_inplace(&self, _: &mut [f32], _: &[f32]) {
        match *self {}
    }
    fn cross_entropy_forward(&self, _: &mut [f32], _: &[f32], _: &[i32], _: usize, _: usize) {
        match *self {}
    }
    fn cross_entropy_fused(
        &self,
        _: &mut [f32],
        _: &mut [f32],
        _: &[i32],
        _: usize,
        _: usize,
        _: f32,
    ) {
        match *self {}
    }
    fn cross_entropy_tile_stats(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: &[i32],
        _: usize,
        _: usize,
        _: usize,
        _: bool,
    ) {
        match *self {}
    }
    fn cross_entropy_tile_grad(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: &[i32],
        _: usize,
        _: usize,
        _: usize,
        _: f32,
    ) {
        match *self {}
    }
    fn cross_entropy_tile_loss(&self, _: &mut [f32], _: &[f32], _: &[i32], _: usize) {
        match *self {}
    }
    #[allow(clippy::too_many_arguments)]
    fn add_cols(&self, _: &mut [f32], _: &[f32], _: usize, _: usize, _: usize, _: usize, _: f32) {
        match *self {}
    }
    #[allow(clippy::too_many_arguments)]
    fn scaled_cols(
        &self,
        _: &mut [f32],
        _: &[f32],
        _: usize,
        _: usize,
        _: usize,
        _: usize,
        _: f32,
    ) {
        match *self {}
    }
    fn dequantize_nf4(&self, _: &mut [Bf16], _: &[f32], _: usize) {
        match *self {}
    }
    fn dequantize_mxfp4(&self, _: &mut [Bf16], _: &[f32], _: usize) {
        match *self {}
    }
}

impl Device for CudaDevice {
    type Backend = CudaBackend;
    /// Never allocated: no `CudaDevice` exists without the feature (so it pins nothing, and
    /// `stats` cannot be called).
    type Staging<T: StagingElem> = Vec<T>;
    fn name(&self) -> String {
        match *self {}
    }
    fn alloc(&self, _: usize) -> Result<DevBuf, OutOfDeviceMemory> {
        match *self {}
    }
    fn free(&self, _: DevBuf) {
        match *self {}
    }
    fn record(&self, _: Queue, _: &Event) {
        match *self {}
    }
    fn wait(&self, _: Queue, _: &Event) {
        match *self {}
    }
    fn upload(&self, _: DevBuf, _: HostPtr) {
        match *self {}
    }
    fn upload_weights(&self, _: DevBuf, _: usize, _: HostPtr) {
        match *self {}
    }
    fn upload_weights_bf16(&self, _: DevBuf, _: usize, _: HostPtr<Bf16>) {
        match *self {}
    }
    fn upload_i32(&self, _: DevBuf, _: Arc<Vec<i32>>) {
        match *self {}
    }
    fn download(&self, _: HostPtrMut, _: DevBuf) {
        match *self {}
    }
    fn download_bf16(&self, _: HostPtrMut<Bf16>, _: DevBuf) {
        match *self {}
    }
    fn launch(&self, _: Kernel<CudaBackend>) {
        match *self {}
    }
    fn launch_timed(&self, _: Kernel<CudaBackend>, _: KernelTimer) {
        match *self {}
    }
    fn host_on(&self, _: Queue, _: HostWork) {
        match *self {}
    }
    fn synchronize(&self) {
        match *self {}
    }
    fn stats(&self) -> DeviceStats {
        match *self {}
    }
    fn alloc_staging<T: StagingElem>(&self, _: usize) -> Vec<T> {
        match *self {}
    }
    type HostPin = ();
    unsafe fn pin_host(&self, _: &mut [f32]) {
        match *self {}
    }
}
