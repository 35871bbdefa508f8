//! [`CudaBackend`]: the [`Backend`] trait on one CUDA stream. Every op enqueues its kernels (or
//! cuBLAS calls) on the stream and returns; `upload` / `download` wait for their copy. The
//! launchers live one op per file next to this one; this file is the trait's switchboard.
//!
//! Weights are bf16 ([`Precision::Bf16`]); products round their fp32 activation inputs to bf16
//! in the backend's workspace first (see `matmul.rs`). The workspace is device memory the
//! backend is handed (by the device, from its pool, sized by the plan) or, for a standalone
//! backend, allocates once: [`Precision::workspace`] lays it out, and its cuBLAS part becomes
//! the cuBLAS handle's workspace (`cublasSetWorkspace`), so cuBLAS allocates nothing per call.

use std::ffi::c_void;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas;
use cudarc::driver::{CudaContext, CudaStream, result as cu, sys};

use super::kernels::Kernels;
use super::slice::DevSlice;
use super::{AttentionKernels, CudaError, check};
use crate::bf16::round_to_bf16;
use crate::precision::{BLAS_WORKSPACE_BYTES, GRAD_WIRE_CHUNK, WORKSPACE_ALIGN};
use crate::{AttnDims, Backend, Bf16, DeviceAlloc, Dinp, MoeDims, NormDims, Precision};

/// The CUDA backend: a context, the stream its ops run on, the compiled kernels, a cuBLAS handle
/// and the workspace. Cloning shares all of them.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Arc<Kernels>,
    /// `None` for a backend that runs no products (the device's copy streams).
    blas: Option<Mutex<Blas>>,
    /// Where products put their bf16 input copies: (device address, bytes); (0, 0) until a
    /// workspace is handed over. A product holds the lock while it enqueues its conversions
    /// and GEMMs, so two threads' products on this stream cannot interleave in the scratch.
    products: Mutex<(u64, usize)>,
    /// A workspace this backend allocated itself (standalone backends), freed on drop.
    own_workspace: Option<u64>,
    /// Whether the device has bf16 tensor cores (compute capability 8.0 or later).
    tensor_cores: bool,
    /// The kernels attention runs on where the shape allows ([`CudaBackend::set_attention_kernels`]).
    attention: Mutex<AttentionKernels>,
    /// The most dynamic shared memory a block may have (the device's opt-in limit), bytes.
    max_shared: usize,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The handle first: it must not outlive the workspace it was given.
        drop(self.blas.take());
        if let Some(addr) = self.own_workspace {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: allocated in `CudaBackend::new`, freed only here; cuMemFree waits for
            // the work still using it.
            let _ = unsafe { cu::free_sync(addr) };
        }
    }
}

/// Where the parts of a workspace handed to [`CudaBackend::use_workspace`] lie.
pub(crate) struct WorkspaceAddrs {
    /// One chunk of bf16 gradient ([`GRAD_WIRE_CHUNK`] elements), for the device's D2H stream.
    pub(crate) grad_wire: u64,
}

/// A cuBLAS handle bound to the backend's stream. Behind a mutex: a handle must not be used by
/// two threads at once.
pub(crate) struct Blas(pub(crate) cublas::sys::cublasHandle_t);

// SAFETY: the handle is only used under the backend's mutex, one thread at a time; cuBLAS
// handles may move between threads.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `CudaBackend::on_stream`, destroyed only here.
        let _ = unsafe { cublas::result::destroy_handle(self.0) };
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("products", &*self.products()).finish()
    }
}

impl CudaBackend {
    /// A backend on a new stream of GPU `ordinal` with a workspace of `workspace_bytes` (from
    /// `Precision::Bf16.workspace(..)`: enough for the largest product it will run): probes the
    /// libraries, creates the context, compiles the kernels, allocates the workspace. For tests
    /// and tools; the engine gets its backend from [`super::CudaDevice`].
    pub fn new(ordinal: usize, workspace_bytes: usize) -> Result<Self, CudaError> {
        super::probe()?;
        let ctx = context(ordinal)?;
        let stream = ctx.new_stream().map_err(|e| CudaError::driver("creating a stream", e))?;
        let kernels = Arc::new(Kernels::load(&ctx)?);
        let min = Precision::Bf16.workspace(0).bytes;
        if workspace_bytes < min {
            return Err(CudaError(format!(
                "a CUDA backend needs a workspace of at least {min} bytes (cuBLAS, gradient \
                 chunk), got {workspace_bytes}"
            )));
        }
        ctx.bind_to_thread().map_err(|e| CudaError::driver("binding the context", e))?;
        // SAFETY: a plain device allocation; zeroed below.
        let addr = unsafe { cu::malloc_sync(workspace_bytes) }.map_err(|e| {
            CudaError(format!("cannot allocate a {workspace_bytes}-byte workspace: {e:?}"))
        })?;
        // SAFETY: the allocation just made.
        unsafe { cu::memset_d8_sync(addr, 0, workspace_bytes) }
            .map_err(|e| CudaError::driver("zeroing the workspace", e))?;
        // cuMemsetD8 may return before it has run (device memory): finish it before any
        // non-blocking stream can use the memory.
        ctx.synchronize().map_err(|e| CudaError::driver("zeroing the workspace", e))?;
        let be = match Self::build(ctx.clone(), stream, kernels, true, Some(addr)) {
            Ok(be) => be,
            Err(e) => {
                // SAFETY: the allocation above; nothing uses it.
                let _ = unsafe { cu::free_sync(addr) };
                return Err(e);
            }
        };
        // SAFETY: the backend's own allocation, freed only when the backend is dropped; only
        // this backend's stream uses it.
        unsafe { be.use_workspace(addr, workspace_bytes) }?;
        Ok(be)
    }

    /// A backend whose ops run on `stream`; with `blas`, it has a cuBLAS handle on that stream
    /// and can run products once it has a workspace ([`CudaBackend::use_workspace`]).
    pub(crate) fn on_stream(
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        kernels: Arc<Kernels>,
        blas: bool,
    ) -> Result<Self, CudaError> {
        Self::build(ctx, stream, kernels, blas, None)
    }

    fn build(
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        kernels: Arc<Kernels>,
        blas: bool,
        own_workspace: Option<u64>,
    ) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(|e| CudaError::driver("binding the context", e))?;
        let blas = if blas {
            let handle = cublas::result::create_handle()
                .map_err(|e| CudaError(format!("cuBLAS: cannot create a handle: {e:?}")))?;
            let blas = Blas(handle);
            // SAFETY: a live handle and a live stream of the same context. (Setting the stream
            // resets the handle's workspace to cuBLAS's default: `use_workspace` comes after.)
            unsafe { cublas::result::set_stream(handle, stream.cu_stream() as _) }
                .map_err(|e| CudaError(format!("cuBLAS: cannot set the stream: {e:?}")))?;
            Some(Mutex::new(blas))
        } else {
            None
        };
        let (major, _) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("reading the compute capability", e))?;
        let optin = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
        let max_shared = ctx
            .attribute(optin)
            .map_err(|e| CudaError::driver("reading the shared memory per block", e))?;
        let inner = Inner {
            ctx,
            stream,
            kernels,
            blas,
            products: Mutex::new((0, 0)),
            own_workspace,
            tensor_cores: major >= 8,
            attention: Mutex::new(AttentionKernels::Tensor),
            max_shared: max_shared.max(0) as usize,
        };
        Ok(CudaBackend { inner: Arc::new(inner) })
    }

    /// Takes `addr .. addr + bytes` as the workspace, laid out by `Precision::Bf16.workspace`
    /// from `addr` rounded up to 256 bytes: the cuBLAS part becomes the handle's workspace, the
    /// products part this backend's bf16 input copies; returns where the gradient chunk lies
    /// (for the device's D2H stream). Fails when `bytes` cannot hold the fixed parts.
    ///
    /// # Safety
    /// The range must be device memory of this context that stays allocated while the backend
    /// runs, that only this backend's stream uses (the gradient chunk excepted: its user is the
    /// caller), and no product may be in flight on the stream.
    pub(crate) unsafe fn use_workspace(
        &self,
        addr: u64,
        bytes: usize,
    ) -> Result<WorkspaceAddrs, CudaError> {
        let base = addr.next_multiple_of(WORKSPACE_ALIGN as u64);
        let lay = Precision::Bf16.workspace(0);
        let end = addr + bytes as u64;
        let products = base + lay.products.start as u64;
        if end < products {
            return Err(CudaError(format!(
                "a CUDA workspace of {bytes} bytes cannot hold cuBLAS's {BLAS_WORKSPACE_BYTES} \
                 and a {GRAD_WIRE_CHUNK}-element gradient chunk"
            )));
        }
        if let Some(blas) = &self.inner.blas {
            self.inner
                .ctx
                .bind_to_thread()
                .map_err(|e| CudaError::driver("binding the context", e))?;
            let h = blas.lock().expect("cuBLAS handle lock poisoned").0;
            let ws = (base + lay.blas.start as u64) as *mut c_void;
            // SAFETY: a live handle; `ws` is 256-byte aligned device memory of
            // BLAS_WORKSPACE_BYTES that outlives the handle's use of it (caller's contract).
            unsafe { cublas::sys::cublasSetWorkspace_v2(h, ws, lay.blas.len()) }
                .result()
                .map_err(|e| CudaError(format!("cuBLAS: cannot set the workspace: {e:?}")))?;
        }
        *self.inner.products.lock().expect("workspace lock poisoned") =
            (products, (end - products) as usize);
        Ok(WorkspaceAddrs { grad_wire: base + lay.grad_wire.start as u64 })
    }

    /// The products' part of the workspace, (device address, bytes), locked: hold the guard
    /// until the product's last use of it is enqueued.
    pub(crate) fn products(&self) -> MutexGuard<'_, (u64, usize)> {
        self.inner.products.lock().expect("workspace lock poisoned")
    }

    /// Chooses the kernels attention runs on where the shape allows; every clone of this
    /// backend follows. [`AttentionKernels::Tensor`] is the default, and on a device without
    /// bf16 tensor cores means the fp32 kernels.
    pub fn set_attention_kernels(&self, kernels: AttentionKernels) {
        *self.inner.attention.lock().expect("attention choice poisoned") = kernels;
    }

    /// The kernels attention may run on: [`CudaBackend::set_attention_kernels`]'s choice, fp32
    /// where the device has no bf16 tensor cores.
    pub(crate) fn attention_kernels(&self) -> AttentionKernels {
        match *self.inner.attention.lock().expect("attention choice poisoned") {
            _ if !self.inner.tensor_cores => AttentionKernels::Fp32,
            k => k,
        }
    }

    /// The most dynamic shared memory a block may have on this device, bytes.
    pub(crate) fn max_shared(&self) -> usize {
        self.inner.max_shared
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The stream the ops run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Blocks until the stream has run everything enqueued; a failure of queued work (an
    /// illegal address, a lost device) is returned here.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.inner.stream.synchronize().map_err(|e| CudaError::driver("stream synchronize", e))
    }

    /// Enqueue kernel `name` on the stream.
    ///
    /// # Safety
    /// `args` must point to values of exactly the kernel's parameter types, in order; every
    /// device address among them must be valid for what the kernel reads and writes, and
    /// nothing else may use the memory it writes until the launch has run.
    pub(crate) unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &mut [*mut c_void],
    ) {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return;
        }
        let f = self.inner.kernels.get(name);
        // SAFETY: `f` is a loaded function of this context; the arguments are the caller's
        // contract.
        let r =
            unsafe { cu::launch_kernel(f, grid, block, smem, self.inner.stream.cu_stream(), args) };
        check(&format!("launching {name} grid {grid:?} block {block:?} smem {smem}"), r);
    }

    /// Runs `f` with the cuBLAS handle (bound to this backend's stream). Panics on a backend
    /// built without one (a bug: only the compute stream runs products).
    pub(crate) fn with_blas<R>(&self, f: impl FnOnce(cublas::sys::cublasHandle_t) -> R) -> R {
        let blas = self.inner.blas.as_ref().expect("a product on a backend without cuBLAS");
        let blas = blas.lock().expect("cuBLAS handle lock poisoned");
        f(blas.0)
    }

    /// Raises a function's dynamic shared memory limit to `bytes` (needed above 48 KiB), once:
    /// a later call for as many bytes or fewer changes nothing.
    pub(crate) fn allow_shared(&self, name: &str, bytes: u32) {
        let kernels = &self.inner.kernels;
        kernels.allow_shared_once(name, bytes, || {
            // SAFETY: the function is a live function of this context.
            let r = unsafe {
                cu::function::set_function_attribute(
                    kernels.get(name),
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            };
            check(&format!("allowing {bytes} bytes of shared memory for {name}"), r);
        });
    }

    /// `bytes` zero bytes at `addr`, on the stream.
    pub(crate) fn memset0(&self, addr: u64, bytes: usize) {
        if bytes > 0 {
            // SAFETY: the caller passes a device range it may write (a `&mut DevSlice`).
            let r = unsafe { cu::memset_d8_async(addr, 0, bytes, self.inner.stream.cu_stream()) };
            check("memset", r);
        }
    }
}

/// The primary context of GPU `ordinal`, with errors that say what to do.
pub(crate) fn context(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    let count = cu::init().and_then(|()| cu::device::get_count()).map_err(|e| {
        CudaError(format!(
            "no usable CUDA device: the driver failed to start ({e:?}); use device.backend = cpu"
        ))
    })?;
    if ordinal >= count as usize {
        return Err(CudaError(format!(
            "no CUDA device {ordinal}: the driver sees {count}; use device.backend = cpu"
        )));
    }
    CudaContext::new(ordinal)
        .map_err(|e| CudaError::driver(&format!("creating a context on GPU {ordinal}"), e))
}

/// Pointer to a kernel argument.
pub(crate) fn arg<T>(x: &T) -> *mut c_void {
    (x as *const T).cast_mut().cast()
}

/// A size as the kernels' `int`; a bug if it does not fit.
pub(crate) fn int(x: usize, what: &str) -> i32 {
    i32::try_from(x).unwrap_or_else(|_| panic!("{what} = {x} exceeds the CUDA kernels' int range"))
}

/// Blocks of `block` threads covering `n` elements.
pub(crate) fn blocks(n: usize, block: u32) -> u32 {
    u32::try_from(n.div_ceil(block as usize)).expect("grid larger than 2^32 blocks")
}

/// `assert_eq!` of two lengths, naming the op and the buffer.
#[track_caller]
pub(crate) fn expect_len(op: &str, what: &str, got: usize, want: usize) {
    assert_eq!(got, want, "{op}: {what} has {got} elements, expected {want}");
}

impl Backend for CudaBackend {
    type Buf = DevSlice<f32>;
    type IBuf = DevSlice<i32>;
    type WBuf = DevSlice<Bf16>;
    const PRECISION: Precision = Precision::Bf16;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload(&self, dst: &mut DevSlice<f32>, src: &[f32]) {
        expect_len("upload", "src", src.len(), dst.len());
        copy_htod(self, dst.addr(), src);
    }

    fn upload_i32(&self, dst: &mut DevSlice<i32>, src: &[i32]) {
        expect_len("upload_i32", "src", src.len(), dst.len());
        copy_htod(self, dst.addr(), src);
    }

    /// Rounded to bf16 on the host (as the device's weight uploads are), then copied.
    fn upload_weights(&self, dst: &mut DevSlice<Bf16>, src: &[f32]) {
        expect_len("upload_weights", "src", src.len(), dst.len());
        let mut host = vec![Bf16::default(); src.len()];
        round_to_bf16(&mut host, src);
        copy_htod(self, dst.addr(), &host);
    }

    fn download(&self, dst: &mut [f32], src: &DevSlice<f32>) {
        copy_dtoh(self, dst, src);
    }

    fn copy(&self, dst: &mut DevSlice<f32>, src: &DevSlice<f32>) {
        expect_len("copy", "src", src.len(), dst.len());
        if dst.is_empty() {
            return;
        }
        // SAFETY: both ranges are device memory of `dst.bytes()` bytes; `dst` is exclusive.
        let r = unsafe {
            cu::memcpy_dtod_async(
                dst.addr(),
                src.addr(),
                dst.bytes(),
                self.inner.stream.cu_stream(),
            )
        };
        check("copy", r);
    }

    fn zero(&self, buf: &mut DevSlice<f32>) {
        self.memset0(buf.addr(), buf.bytes());
    }

    fn embedding_forward(
        &self,
        out: &mut DevSlice<f32>,
        ids: &DevSlice<i32>,
        table: &DevSlice<f32>,
        c: usize,
    ) {
        super::embedding::embedding_forward(self, out, ids, table, c);
    }

    fn embedding_backward(
        &self,
        dtable: &mut DevSlice<f32>,
        ids: &DevSlice<i32>,
        dout: &DevSlice<f32>,
        c: usize,
    ) {
        super::embedding::embedding_backward(self, dtable, ids, dout, c);
    }

    fn rmsnorm_forward(
        &self,
        out: &mut DevSlice<f32>,
        rstd: &mut DevSlice<f32>,
        inp: &DevSlice<f32>,
        weight: &DevSlice<Bf16>,
        norm: NormDims,
    ) {
        super::rmsnorm::rmsnorm_forward(self, out, rstd, inp, weight, norm);
    }

    fn rmsnorm_backward(
        &self,
        dinp: &mut DevSlice<f32>,
        dweight: Option<&mut DevSlice<f32>>,
        dout: &DevSlice<f32>,
        inp: &DevSlice<f32>,
        weight: &DevSlice<Bf16>,
        rstd: &DevSlice<f32>,
        norm: NormDims,
    ) {
        super::rmsnorm::rmsnorm_backward(self, dinp, dweight, dout, inp, weight, rstd, norm);
    }

    fn head_rmsnorm_forward(
        &self,
        out: &mut DevSlice<f32>,
        rstd: &mut DevSlice<f32>,
        inp: &DevSlice<f32>,
        weight: &DevSlice<Bf16>,
        dims: AttnDims,
        norm: NormDims,
    ) {
        super::head_rmsnorm::head_rmsnorm_forward(self, out, rstd, inp, weight, dims, norm);
    }

    fn head_rmsnorm_backward(
        &self,
        dinp: &mut DevSlice<f32>,
        dweight: Option<&mut DevSlice<f32>>,
        dout: &DevSlice<f32>,
        inp: &DevSlice<f32>,
        weight: &DevSlice<Bf16>,
        rstd: &DevSlice<f32>,
        dims: AttnDims,
        norm: NormDims,
    ) {
        super::head_rmsnorm::head_rmsnorm_backward(
            self, dinp, dweight, dout, inp, weight, rstd, dims, norm,
        );
    }

    fn geglu_forward(&self, out: &mut DevSlice<f32>, gate_up: &DevSlice<f32>, n: usize, f: usize) {
        super::glu::glu_forward(self, "geglu_forward", out, gate_up, (n, f), None);
    }

    fn geglu_backward(
        &self,
        dgate_up: &mut DevSlice<f32>,
        dout: &DevSlice<f32>,
        gate_up: &DevSlice<f32>,
        n: usize,
        f: usize,
    ) {
        super::glu::glu_backward(self, "geglu_backward", dgate_up, (dout, gate_up), (n, f), None);
    }

    fn matmul_forward(
        &self,
        out: &mut DevSlice<f32>,
        inp: &DevSlice<f32>,
        weight: &DevSlice<Bf16>,
        bias: Option<&DevSlice<Bf16>>,
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        super::matmul::matmul_forward(self, out, inp, weight, bias, n, ic, oc);
    }

    fn matmul_backward(
        &self,
        dinp: Option<Dinp<'_, DevSlice<f32>>>,
        dweight: Option<&mut DevSlice<f32>>,
        dbias: Option<&mut DevSlice<f32>>,
        dout: &DevSlice<f32>,
        inp: &DevSlice<f32>,
        weight: &DevSlice<Bf16>,
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        super::matmul::matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, n, ic, oc);
    }

    fn rope_forward(
        &self,
        qkv: &mut DevSlice<f32>,
        cos: &DevSlice<f32>,
        sin: &DevSlice<f32>,
        dims: AttnDims,
    ) {
        super::rope::rope_rotate(self, "rope_forward", qkv, cos, sin, dims, 1.0);
    }

    fn rope_backward(
        &self,
        dqkv: &mut DevSlice<f32>,
        cos: &DevSlice<f32>,
        sin: &DevSlice<f32>,
        dims: AttnDims,
    ) {
        super::rope::rope_rotate(self, "rope_backward", dqkv, cos, sin, dims, -1.0);
    }

    fn attention_forward(
        &self,
        out: &mut DevSlice<f32>,
        lse: &mut DevSlice<f32>,
        qkv: &DevSlice<f32>,
        dims: AttnDims,
    ) {
        super::attention::attention_forward(self, out, lse, qkv, dims);
    }

    fn attention_backward(
        &self,
        dqkv: &mut DevSlice<f32>,
        dout: &DevSlice<f32>,
        qkv: &DevSlice<f32>,
        out: &DevSlice<f32>,
        lse: &DevSlice<f32>,
        dims: AttnDims,
    ) {
        super::attention::attention_backward(self, dqkv, dout, qkv, out, lse, dims);
    }

    fn attention_sink_forward(
        &self,
        out: &mut DevSlice<f32>,
        lse: &mut DevSlice<f32>,
        sinks: &DevSlice<Bf16>,
        dims: AttnDims,
    ) {
        super::attention_sink::attention_sink_forward(self, out, lse, sinks, dims);
    }

    fn attention_sink_backward(
        &self,
        dsinks: &mut DevSlice<f32>,
        dout: &DevSlice<f32>,
        out: &DevSlice<f32>,
        lse: &DevSlice<f32>,
        sinks: &DevSlice<Bf16>,
        dims: AttnDims,
    ) {
        super::attention_sink::attention_sink_backward(self, dsinks, dout, out, lse, sinks, dims);
    }

    fn attention_decode(
        &self,
        out: &mut DevSlice<f32>,
        qkv: &DevSlice<f32>,
        sinks: Option<&DevSlice<Bf16>>,
        t_new: usize,
        dims: AttnDims,
    ) {
        super::attention_decode::attention_decode(self, out, qkv, sinks, t_new, dims);
    }

    fn moe_route_forward(
        &self,
        probs: &mut DevSlice<f32>,
        sel: &mut DevSlice<f32>,
        wts: &mut DevSlice<f32>,
        logits: &DevSlice<f32>,
        dims: MoeDims,
    ) {
        super::moe::moe_route_forward(self, probs, sel, wts, logits, dims);
    }

    fn moe_route_backward(
        &self,
        dlogits: &mut DevSlice<f32>,
        dwts: &DevSlice<f32>,
        probs: &DevSlice<f32>,
        sel: &DevSlice<f32>,
        aux: Option<(&DevSlice<f32>, &DevSlice<f32>)>,
        dims: MoeDims,
    ) {
        super::moe::moe_route_backward(self, dlogits, dwts, probs, sel, aux, dims);
    }

    fn moe_aux_stats(
        &self,
        stats: &mut DevSlice<f32>,
        probs: &DevSlice<f32>,
        sel: &DevSlice<f32>,
        mask: &DevSlice<f32>,
        dims: MoeDims,
    ) {
        super::moe::moe_aux_stats(self, stats, probs, sel, mask, dims);
    }

    fn moe_gather(
        &self,
        xs: &mut DevSlice<f32>,
        x: &DevSlice<f32>,
        order: &DevSlice<f32>,
        k: usize,
        c: usize,
    ) {
        super::moe::moe_gather(self, xs, x, order, k, c);
    }

    fn moe_scatter_add(
        &self,
        out: &mut DevSlice<f32>,
        src: &DevSlice<f32>,
        order: &DevSlice<f32>,
        wts: Option<&DevSlice<f32>>,
        k: usize,
        c: usize,
    ) {
        super::moe::moe_scatter_add(self, out, src, order, wts, k, c);
    }

    fn moe_scale_rows(
        &self,
        buf: &mut DevSlice<f32>,
        wts: &DevSlice<f32>,
        order: &DevSlice<f32>,
        w: usize,
    ) {
        super::moe::moe_scale_rows(self, buf, wts, order, w);
    }

    fn moe_row_dots(
        &self,
        out: &mut DevSlice<f32>,
        a: &DevSlice<f32>,
        b: &DevSlice<f32>,
        order: &DevSlice<f32>,
        w: usize,
    ) {
        super::moe::moe_row_dots(self, out, a, b, order, w);
    }

    fn moe_bias_dots(
        &self,
        out: &mut DevSlice<f32>,
        dy: &DevSlice<f32>,
        bias: &DevSlice<Bf16>,
        order: &DevSlice<f32>,
        c: usize,
    ) {
        super::moe::moe_bias_dots(self, out, dy, bias, order, c);
    }

    fn sigmoid_gate_forward(
        &self,
        out: &mut DevSlice<f32>,
        gate: &DevSlice<f32>,
        inp: &DevSlice<f32>,
        c: usize,
    ) {
        super::gate::sigmoid_gate_forward(self, out, gate, inp, c);
    }

    fn sigmoid_gate_backward(
        &self,
        dinp: &mut DevSlice<f32>,
        dgate: &mut DevSlice<f32>,
        dout: &DevSlice<f32>,
        gate: &DevSlice<f32>,
        inp: &DevSlice<f32>,
        c: usize,
    ) {
        super::gate::sigmoid_gate_backward(self, dinp, dgate, dout, gate, inp, c);
    }

    fn swiglu_forward(&self, out: &mut DevSlice<f32>, gate_up: &DevSlice<f32>, n: usize, f: usize) {
        super::glu::glu_forward(self, "swiglu_forward", out, gate_up, (n, f), None);
    }

    fn swiglu_backward(
        &self,
        dgate_up: &mut DevSlice<f32>,
        dout: &DevSlice<f32>,
        gate_up: &DevSlice<f32>,
        n: usize,
        f: usize,
    ) {
        super::glu::glu_backward(self, "swiglu_backward", dgate_up, (dout, gate_up), (n, f), None);
    }

    fn clamped_swiglu_forward(
        &self,
        out: &mut DevSlice<f32>,
        gate_up: &DevSlice<f32>,
        n: usize,
        f: usize,
        clamp: crate::GluClamp,
    ) {
        super::glu::glu_forward(self, "clamped_swiglu_forward", out, gate_up, (n, f), Some(clamp));
    }

    fn clamped_swiglu_backward(
        &self,
        dgate_up: &mut DevSlice<f32>,
        dout: &DevSlice<f32>,
        gate_up: &DevSlice<f32>,
        nf: (usize, usize),
        clamp: crate::GluClamp,
    ) {
        let kernel = "clamped_swiglu_backward";
        super::glu::glu_backward(self, kernel, dgate_up, (dout, gate_up), nf, Some(clamp));
    }

    fn add_cols(
        &self,
        out: &mut DevSlice<f32>,
        src: &DevSlice<f32>,
        n: usize,
        out_w: usize,
        col: usize,
        w: usize,
        scale: f32,
    ) {
        super::cols::add_cols(self, out, src, n, out_w, col, w, scale);
    }

    fn scaled_cols(
        &self,
        out: &mut DevSlice<f32>,
        src: &DevSlice<f32>,
        n: usize,
        src_w: usize,
        col: usize,
        w: usize,
        scale: f32,
    ) {
        super::cols::scaled_cols(self, out, src, n, src_w, col, w, scale);
    }

    fn dequantize_nf4(&self, out: &mut DevSlice<Bf16>, packed: &DevSlice<f32>, n: usize) {
        super::nf4::dequantize_nf4(self, out, packed, n);
    }

    fn dequantize_mxfp4(&self, out: &mut DevSlice<Bf16>, packed: &DevSlice<f32>, n: usize) {
        super::nf4::dequantize_mxfp4(self, out, packed, n);
    }

    fn residual_forward(&self, out: &mut DevSlice<f32>, a: &DevSlice<f32>, b: &DevSlice<f32>) {
        super::residual::residual_forward(self, out, a, b);
    }

    fn add_inplace(&self, acc: &mut DevSlice<f32>, x: &DevSlice<f32>) {
        super::residual::add_inplace(self, acc, x);
    }

    fn cross_entropy_forward(
        &self,
        losses: &mut DevSlice<f32>,
        logits: &DevSlice<f32>,
        targets: &DevSlice<i32>,
        n: usize,
        v: usize,
    ) {
        super::cross_entropy::cross_entropy_forward(self, losses, logits, targets, n, v);
    }

    fn cross_entropy_fused(
        &self,
        logits: &mut DevSlice<f32>,
        losses: &mut DevSlice<f32>,
        targets: &DevSlice<i32>,
        n: usize,
        v: usize,
        scale: f32,
    ) {
        super::cross_entropy::cross_entropy_fused(self, logits, losses, targets, n, v, scale);
    }

    fn cross_entropy_tile_stats(
        &self,
        stats: &mut DevSlice<f32>,
        logits: &DevSlice<f32>,
        targets: &DevSlice<i32>,
        n: usize,
        vt: usize,
        v0: usize,
        first: bool,
    ) {
        super::cross_entropy::cross_entropy_tile_stats(
            self, stats, logits, targets, n, vt, v0, first,
        );
    }

    fn cross_entropy_tile_grad(
        &self,
        logits: &mut DevSlice<f32>,
        stats: &DevSlice<f32>,
        targets: &DevSlice<i32>,
        n: usize,
        vt: usize,
        v0: usize,
        scale: f32,
    ) {
        super::cross_entropy::cross_entropy_tile_grad(
            self, logits, stats, targets, n, vt, v0, scale,
        );
    }

    fn cross_entropy_tile_loss(
        &self,
        losses: &mut DevSlice<f32>,
        stats: &DevSlice<f32>,
        targets: &DevSlice<i32>,
        n: usize,
    ) {
        super::cross_entropy::cross_entropy_tile_loss(self, losses, stats, targets, n);
    }
}

impl CudaBackend {
    /// The bf16 bits of device weights (tests, tools).
    pub fn download_weights(&self, dst: &mut [Bf16], src: &DevSlice<Bf16>) {
        copy_dtoh(self, dst, src);
    }
}

/// Device -> host copy on the backend's stream, waited for.
fn copy_dtoh<T>(be: &CudaBackend, dst: &mut [T], src: &DevSlice<T>) {
    expect_len("download", "dst", dst.len(), src.len());
    if dst.is_empty() {
        return;
    }
    be.inner.ctx.bind_to_thread().expect("binding the CUDA context");
    // SAFETY: `src` is device memory of `dst.len()` elements of T; `dst` is borrowed until the
    // stream synchronize below, after which the copy has finished.
    let r = unsafe { cu::memcpy_dtoh_async(dst, src.addr(), be.inner.stream.cu_stream()) };
    check("download", r);
    check("download: synchronize", be.synchronize());
}

/// Host -> device copy on the backend's stream, waited for.
fn copy_htod<T>(be: &CudaBackend, dst: u64, src: &[T]) {
    if src.is_empty() {
        return;
    }
    be.inner.ctx.bind_to_thread().expect("binding the CUDA context");
    // SAFETY: `dst` is a device range of `size_of_val(src)` bytes (a `&mut DevSlice` of equal
    // length); `src` stays borrowed until the synchronize below.
    let r = unsafe { cu::memcpy_htod_async(dst, src, be.inner.stream.cu_stream()) };
    check("upload", r);
    check("upload: synchronize", be.synchronize());
}

/// Owned device memory of `len` elements of `T` (cuMemAlloc), freed on drop. What
/// [`DeviceAlloc`] hands out; the engine uses the [`super::CudaDevice`] pool instead.
pub struct CudaMem<T> {
    ctx: Arc<CudaContext>,
    addr: u64,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T> CudaMem<T> {
    fn new(be: &CudaBackend, len: usize) -> Self {
        be.inner.ctx.bind_to_thread().expect("binding the CUDA context");
        let bytes = (len * size_of::<T>()).max(1);
        // SAFETY: a plain allocation; zeroed below before anyone reads it.
        let addr = unsafe { cu::malloc_sync(bytes) }
            .unwrap_or_else(|e| panic!("cannot allocate {bytes} bytes of device memory: {e:?}"));
        // SAFETY: the fresh allocation of `bytes` bytes.
        check("zeroing new device memory", unsafe { cu::memset_d8_sync(addr, 0, bytes) });
        // The memset may return before it has run: finish it before a stream uses the memory.
        check("zeroing new device memory", be.inner.ctx.synchronize());
        CudaMem { ctx: be.inner.ctx.clone(), addr, len, _t: std::marker::PhantomData }
    }
}

// SAFETY: owned device memory; nothing thread-bound.
unsafe impl<T> Send for CudaMem<T> {}

impl<T> Deref for CudaMem<T> {
    type Target = DevSlice<T>;
    fn deref(&self) -> &DevSlice<T> {
        // SAFETY: the allocation lives as long as `self`.
        unsafe { DevSlice::from_raw(self.addr, self.len) }
    }
}

impl<T> DerefMut for CudaMem<T> {
    fn deref_mut(&mut self) -> &mut DevSlice<T> {
        // SAFETY: as above, borrowed exclusively through `self`.
        unsafe { DevSlice::from_raw_mut(self.addr, self.len) }
    }
}

impl<T> Drop for CudaMem<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated in `new`, freed only here; cuMemFree waits for pending work on it.
        let _ = unsafe { cu::free_sync(self.addr) };
    }
}

impl DeviceAlloc for CudaBackend {
    type Mem = CudaMem<f32>;
    type IMem = CudaMem<i32>;
    type WMem = CudaMem<Bf16>;
    fn alloc(&self, len: usize) -> CudaMem<f32> {
        CudaMem::new(self, len)
    }
    fn alloc_i32(&self, len: usize) -> CudaMem<i32> {
        CudaMem::new(self, len)
    }
    fn alloc_weights(&self, len: usize) -> CudaMem<Bf16> {
        CudaMem::new(self, len)
    }
}
