//! [`CudaDevice`], the [`Device`] of the CUDA backend: one device pool allocated once, three
//! streams (compute, H2D, D2H) and a host thread, page-locked staging buffers, and weights
//! carried as bf16 over the link into bf16 weight slots.
//!
//! Data flow: every [`Queue`] has a dispatcher thread fed by a channel (as on the CPU device).
//! The compute, H2D and D2H dispatchers turn their tasks into asynchronous work on their
//! stream: kernels, `cuMemcpy*Async`. An [`Event`] recorded on a stream becomes a CUDA event
//! recorded there: the dispatcher *marks* the [`Event`] with it as soon as the record is
//! enqueued, and the stream's completion thread waits for it (`cuEventSynchronize`) and then
//! signals the [`Event`], so the host can wait for it.
//!
//! Waits: a stream queue that waits for an event of another stream waits on the device
//! (`cuStreamWaitEvent` on the marked CUDA event): its dispatcher blocks only until the other
//! dispatcher has *enqueued* the record, never for GPU work, so work is enqueued ahead and no
//! stream idles while a host thread wakes up. Only waits for the host queue's events (host work:
//! the optimizer, accumulation) block a stream dispatcher until the host work is done, and the
//! host queue waits for stream events on the host, where it reads what they produced. No CUDA
//! callback ever blocks (so no driver thread can deadlock). Host work on a stream queue
//! (`host_on`) runs on its dispatcher after the stream has drained.
//!
//! Weights (`upload_weights`) cross the link as bf16 and stay bf16: the H2D dispatcher rounds a
//! chunk of the fp32 masters into a page-locked bf16 ring buffer and copies it straight into the
//! weight slot, two chunks in flight. Gradients may come back as bf16 (`download_bf16`): the D2H
//! stream rounds a chunk of the fp32 accumulator into the workspace's gradient chunk, then
//! copies it to the page-locked host slab; chunk after chunk on the one stream, so the next
//! rounding never overwrites a chunk still being copied.
//!
//! Device memory is the pool alone. The engine hands part of it back as the workspace
//! (`set_workspace`): bf16 copies of product inputs and the cuBLAS workspace for the compute
//! stream, the gradient chunk for the D2H stream.

use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, result as cu, sys};

use super::backend::{CudaBackend, context};
use super::convert::round_on_device;
use super::kernels::Kernels;
use super::pinned::{Pinned, PinnedTally, Registered};
use super::slice::DevSlice;
use super::{CudaDeviceConfig, CudaError, DeviceFault, WIRE_CHUNK, check};
use crate::Bf16;
use crate::bf16::{round_to_bf16, same_len};
use crate::device::{
    DevBuf, Device, DeviceStats, Event, HostPtr, HostPtrMut, HostWork, Kernel, KernelTimer,
    OutOfDeviceMemory, Queue, StagingElem, Views,
};
use crate::pool::{ALIGN_ELEMS, Pool};
use crate::precision::GRAD_WIRE_CHUNK;

/// The CUDA device. Dropping it runs everything already queued, then stops the threads and
/// frees the device memory.
pub struct CudaDevice {
    cfg: CudaDeviceConfig,
    shared: Arc<Shared>,
    pool: Mutex<Pool>,
    queues: [Sender<Task>; 4],
    workers: Vec<JoinHandle<()>>,
    gpu_name: String,
}

impl CudaDevice {
    /// Probes the libraries, opens GPU `cfg.ordinal`, compiles the kernels, allocates the pool
    /// (`cfg.capacity_bytes`), and starts the queues. Every failure is an error that says what
    /// to do; nothing here panics on a missing driver or GPU.
    pub fn new(cfg: CudaDeviceConfig) -> Result<Self, CudaError> {
        super::probe()?;
        let ctx = context(cfg.ordinal)?;
        let gpu_name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
        // The copy streams outrank the compute stream: the D2H stream's kernel (a gradient's
        // rounding to bf16 before its download) then gets multiprocessors as soon as its blocks
        // are ready, instead of waiting behind the blocks of a long backward kernel (measured on
        // an H200: a 7B layer's gradient download took 390 ms beside the backward, 10 ms alone).
        // The compute stream keeps the default, lowest priority.
        ctx.bind_to_thread().map_err(|e| CudaError::driver("binding the context", e))?;
        let (least, greatest) = cu::stream::get_priority_range()
            .map_err(|e| CudaError::driver("querying stream priorities", e))?;
        let stream = |what: &str, priority: i32| -> Result<Arc<CudaStream>, CudaError> {
            ctx.new_stream_with_priority(priority)
                .map_err(|e| CudaError::driver(&format!("creating the {what} stream"), e))
        };
        let streams =
            [stream("compute", least)?, stream("H2D", greatest)?, stream("D2H", greatest)?];
        let kernels = Arc::new(Kernels::load(&ctx)?);
        // Products run on the compute stream only; the D2H stream launches the gradient
        // rounding and needs no cuBLAS handle.
        let compute =
            CudaBackend::on_stream(ctx.clone(), streams[0].clone(), kernels.clone(), true)?;
        compute.set_attention_kernels(cfg.attention);
        let d2h = CudaBackend::on_stream(ctx.clone(), streams[2].clone(), kernels, false)?;
        let len = cfg.capacity_bytes / 4 / ALIGN_ELEMS * ALIGN_ELEMS;
        let (free, total) = cu::mem_get_info().unwrap_or((0, 0));
        let alloc = |bytes: usize, what: &str| -> Result<u64, CudaError> {
            // SAFETY: a plain device allocation, zeroed below.
            let addr = unsafe { cu::malloc_sync(bytes.max(4)) }.map_err(|e| {
                CudaError(format!(
                    "cannot allocate the {what} ({bytes} bytes) on GPU {}: {e:?}; {free} of \
                     {total} bytes are free\nhint: lower device.memory, train.micro_batch_size or \
                     train.max_seq_len",
                    cfg.ordinal
                ))
            })?;
            // SAFETY: the allocation just made, of at least `bytes` bytes.
            unsafe { cu::memset_d8_sync(addr, 0, bytes.max(4)) }
                .map_err(|e| CudaError::driver("zeroing the device pool", e))?;
            // The memset may return before it has run (device memory): finish it before the
            // non-blocking streams use the pool.
            ctx.synchronize().map_err(|e| CudaError::driver("zeroing the device pool", e))?;
            Ok(addr)
        };
        let base = alloc(len * 4, "device pool")?;
        let event_pool = EventPool { ctx: ctx.clone(), free: Mutex::new(Vec::new()) };
        let shared = Arc::new(Shared {
            ctx: ctx.clone(),
            base,
            len,
            grad_wire: Mutex::new(None),
            streams,
            compute,
            d2h,
            events: event_pool,
            pinned: Arc::new(PinnedTally::default()),
            counters: Mutex::new(Counters::default()),
            first_panic: Mutex::new(None),
            failure: Mutex::new(None),
        });
        // The H2D thread's bf16 ring, pinned here so that the device holds it (and counts it)
        // once `new` returns.
        let mut ring_host =
            Some([0, 1].map(|_| Pinned::new(&shared.ctx, &shared.pinned, WIRE_CHUNK)));
        let mut workers = Vec::with_capacity(4);
        let mut senders = Vec::with_capacity(4);
        for q in Queue::ALL {
            let (tx, rx) = mpsc::channel();
            let shared = Arc::clone(&shared);
            let ring_host = if q == Queue::H2D { ring_host.take() } else { None };
            let jitter = match q {
                Queue::H2D | Queue::D2H => Jitter::new(cfg.copy_jitter_us, cfg.jitter_seed, q),
                Queue::Compute | Queue::Host => Jitter::new(0, 0, q),
            };
            let handle = thread::Builder::new()
                .name(format!("horizon-cuda-{q:?}").to_lowercase())
                .spawn(move || dispatcher(q, &rx, &shared, jitter, ring_host))
                .map_err(|e| CudaError(format!("cannot start the {q:?} queue thread: {e}")))?;
            workers.push(handle);
            senders.push(tx);
        }
        let queues: [Sender<Task>; 4] =
            senders.try_into().unwrap_or_else(|_| unreachable!("one sender per queue"));
        Ok(CudaDevice { cfg, shared, pool: Mutex::new(Pool::new(len)), queues, workers, gpu_name })
    }

    /// The configuration the device was built with.
    pub fn config(&self) -> &CudaDeviceConfig {
        &self.cfg
    }

    /// The kernels, on the compute stream (for tools and tests that want to run ops directly).
    pub fn backend(&self) -> &CudaBackend {
        &self.shared.compute
    }

    fn submit(&self, q: Queue, task: Task) {
        self.queues[q.index()].send(task).expect("CUDA device queue thread is gone");
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().expect("CUDA device pool lock poisoned")
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("gpu", &self.gpu_name).field("cfg", &self.cfg).finish()
    }
}

impl Device for CudaDevice {
    type Backend = CudaBackend;
    type Staging<T: StagingElem> = Pinned<T>;

    fn name(&self) -> String {
        format!("cuda:{} ({})", self.cfg.ordinal, self.gpu_name)
    }

    fn alloc(&self, len: usize) -> Result<DevBuf, OutOfDeviceMemory> {
        let mut pool = self.pool();
        let oom = |pool: &Pool| OutOfDeviceMemory {
            requested_bytes: len.saturating_mul(4),
            in_use_bytes: pool.in_use * 4,
            capacity_bytes: self.shared.len * 4,
        };
        if len == 0 {
            return Ok(DevBuf { off: 0, len: 0 });
        }
        let Some(aligned) = len.checked_next_multiple_of(ALIGN_ELEMS) else {
            return Err(oom(&pool));
        };
        match pool.alloc(aligned) {
            Some(off) => Ok(DevBuf { off, len }),
            None => Err(oom(&pool)),
        }
    }

    fn free(&self, b: DevBuf) {
        if b.len > 0 {
            self.pool().free(b);
        }
    }

    fn record(&self, q: Queue, e: &Event) {
        self.submit(q, Task::Signal(e.clone()));
    }

    fn wait(&self, q: Queue, e: &Event) {
        self.submit(q, Task::Wait(e.clone()));
    }

    fn upload(&self, dst: DevBuf, src: HostPtr) {
        same_len("upload", dst.len, src.len());
        self.shared.check(dst);
        self.submit(Queue::H2D, Task::Upload { dst, src });
    }

    /// Rounded to bf16 on the host, copied into the bf16 slot: weights `at..at + src.len()`
    /// of `dst` are bytes `2 * at..` of it.
    fn upload_weights(&self, dst: DevBuf, at: usize, src: HostPtr) {
        let end = at.checked_add(src.len()).and_then(|e| e.checked_mul(2));
        assert!(
            end.is_some_and(|e| e <= dst.bytes()),
            "upload_weights: weights {at}..+{} do not fit the {} bf16 of {dst:?}",
            src.len(),
            dst.bytes() / 2
        );
        self.shared.check(dst);
        self.submit(Queue::H2D, Task::UploadWeights { dst, at, src });
    }

    /// Copied as they are into the bf16 slot, through the same page-locked ring as
    /// [`Device::upload_weights`]: weights `at..at + src.len()` of `dst` are bytes `2 * at..`.
    fn upload_weights_bf16(&self, dst: DevBuf, at: usize, src: HostPtr<Bf16>) {
        let end = at.checked_add(src.len()).and_then(|e| e.checked_mul(2));
        assert!(
            end.is_some_and(|e| e <= dst.bytes()),
            "upload_weights_bf16: weights {at}..+{} do not fit the {} bf16 of {dst:?}",
            src.len(),
            dst.bytes() / 2
        );
        self.shared.check(dst);
        self.submit(Queue::H2D, Task::UploadWeightsBf16 { dst, at, src });
    }

    /// Copied straight from the page-locked `src` (no ring, no host work).
    fn upload_weights_bf16_pinned(&self, dst: DevBuf, at: usize, src: HostPtr<Bf16>) {
        let end = at.checked_add(src.len()).and_then(|e| e.checked_mul(2));
        assert!(
            end.is_some_and(|e| e <= dst.bytes()),
            "upload_weights_bf16_pinned: weights {at}..+{} do not fit the {} bf16 of {dst:?}",
            src.len(),
            dst.bytes() / 2
        );
        self.shared.check(dst);
        self.submit(Queue::H2D, Task::UploadPinnedBf16 { dst, at, src });
    }

    fn upload_i32(&self, dst: DevBuf, src: Arc<Vec<i32>>) {
        same_len("upload_i32", dst.len, src.len());
        self.shared.check(dst);
        self.submit(Queue::H2D, Task::UploadI32 { dst, src });
    }

    fn download(&self, dst: HostPtrMut, src: DevBuf) {
        same_len("download", dst.len(), src.len);
        self.shared.check(src);
        self.submit(Queue::D2H, Task::Download { dst, src });
    }

    /// Rounded on the D2H stream, chunk by chunk, into the workspace's gradient chunk, and
    /// copied from there; needs the workspace ([`Device::set_workspace`]).
    fn download_bf16(&self, dst: HostPtrMut<Bf16>, src: DevBuf) {
        same_len("download_bf16", dst.len(), src.len);
        self.shared.check(src);
        self.submit(Queue::D2H, Task::DownloadBf16 { dst, src });
    }

    /// Lays `ws` out with `Precision::Bf16.workspace`: the compute backend takes the products
    /// part and gives the cuBLAS part to its handle (`cublasSetWorkspace`), the D2H stream
    /// keeps the gradient chunk. Panics if `ws` cannot hold the fixed parts (a bug: the plan
    /// sizes it).
    fn set_workspace(&self, ws: DevBuf) {
        if ws.len == 0 {
            return;
        }
        let addr = self.shared.addr(ws);
        // SAFETY: `ws` is pool memory (checked by `addr`) that the engine keeps allocated while
        // the device runs and gives to nothing else; only the compute stream uses the products
        // and cuBLAS parts, only the D2H stream the gradient chunk; the engine hands it over
        // before enqueueing any work, so no product is in flight.
        let parts = unsafe { self.shared.compute.use_workspace(addr, ws.bytes()) };
        let parts = parts.unwrap_or_else(|e| panic!("set_workspace({ws:?}): {e}"));
        *self.shared.grad_wire.lock().expect("CUDA device lock poisoned") = Some(parts.grad_wire);
    }

    fn launch(&self, k: Kernel<CudaBackend>) {
        self.submit(Queue::Compute, Task::Kernel(k, None));
    }

    /// Timed by the CUDA events around the task, read by the compute stream's completion
    /// thread, which calls `timer`.
    fn launch_timed(&self, k: Kernel<CudaBackend>, timer: KernelTimer) {
        self.submit(Queue::Compute, Task::Kernel(k, Some(timer)));
    }

    fn host_on(&self, q: Queue, w: HostWork) {
        self.submit(q, Task::Host(w));
    }

    /// Records a fresh event on every queue and waits for all of them; then panics if any
    /// queued work panicked (a bug) since the last call. A failed driver call or a GPU fault is
    /// not a panic but the device's [`Device::failure`]. Must not be called from queued work.
    fn synchronize(&self) {
        let events = Queue::ALL.map(|q| {
            let e = Event::new();
            self.record(q, &e);
            e
        });
        for e in &events {
            e.wait_host();
        }
        let msg = self.shared.first_panic.lock().expect("CUDA device panic lock poisoned").take();
        if let Some(msg) = msg {
            panic!("device work failed: {msg}");
        }
    }

    fn failure(&self) -> Option<String> {
        self.shared.failure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn stats(&self) -> DeviceStats {
        let (in_use, peak) = {
            let pool = self.pool();
            (pool.in_use, pool.peak)
        };
        let c = self.shared.counters();
        let busy = |q: Queue| c.busy[q.index()].as_secs_f64();
        DeviceStats {
            capacity_bytes: self.shared.len * 4,
            in_use_bytes: in_use * 4,
            peak_bytes: peak * 4,
            h2d_bytes: c.h2d_bytes,
            d2h_bytes: c.d2h_bytes,
            compute_busy_s: busy(Queue::Compute),
            h2d_busy_s: busy(Queue::H2D),
            d2h_busy_s: busy(Queue::D2H),
            host_busy_s: busy(Queue::Host),
            // The link is full duplex: it is busy as long as the busier direction.
            link_busy_s: busy(Queue::H2D).max(busy(Queue::D2H)),
            pinned_bytes: self.shared.pinned.live(),
            pinned_peak_bytes: self.shared.pinned.peak(),
        }
    }

    /// Page-locked (flags 0: cached, not write-combined), of exactly `len` elements, zeroed;
    /// counted in [`DeviceStats::pinned_bytes`] while it lives.
    fn alloc_staging<T: StagingElem>(&self, len: usize) -> Pinned<T> {
        Pinned::new(&self.shared.ctx, &self.shared.pinned, len)
    }

    type HostPin = Registered;
    unsafe fn pin_host(&self, buf: &mut [f32]) -> Registered {
        // SAFETY: the caller keeps `buf` allocated, at its address, while the guard lives.
        unsafe { Registered::new(&self.shared.ctx, &self.shared.pinned, buf) }
    }
}

impl Drop for CudaDevice {
    /// Lets every queue finish what was submitted, stops and joins the threads, frees the
    /// device memory. Never panics.
    fn drop(&mut self) {
        for tx in &self.queues {
            let _ = tx.send(Task::Stop);
        }
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
        let s = &self.shared;
        let _ = s.ctx.bind_to_thread();
        // SAFETY: allocated in `new`; every queue has stopped, nothing uses it any more. (The
        // compute backend's cuBLAS handle, which was given part of it as its workspace, runs
        // nothing more; it is destroyed when the last clone of the backend goes.)
        let _ = unsafe { cu::free_sync(s.base) };
    }
}

// ---- shared state -----------------------------------------------------------------------------

/// State the device and its threads share.
struct Shared {
    ctx: Arc<CudaContext>,
    /// The pool: `len` f32 at device address `base`.
    base: u64,
    len: usize,
    /// The workspace's gradient chunk: GRAD_WIRE_CHUNK bf16 at this device address, used by
    /// the D2H stream only (`None` until `set_workspace`).
    grad_wire: Mutex<Option<u64>>,
    /// Compute, H2D, D2H.
    streams: [Arc<CudaStream>; 3],
    /// The kernels on the compute stream (with cuBLAS), and on the D2H stream (the rounding of
    /// bf16 gradients).
    compute: CudaBackend,
    d2h: CudaBackend,
    events: EventPool,
    /// Page-locked bytes held: the staging buffers handed out, the host memory registered by
    /// `pin_host` and the H2D thread's wire ring.
    pinned: Arc<PinnedTally>,
    counters: Mutex<Counters>,
    first_panic: Mutex<Option<String>>,
    /// The first failed driver call or GPU fault (what [`Device::failure`] reports).
    failure: Mutex<Option<String>>,
}

#[derive(Default)]
struct Counters {
    /// Time each queue's work ran (GPU time for the streams, measured by CUDA events).
    busy: [Duration; 4],
    h2d_bytes: u64,
    d2h_bytes: u64,
}

impl Shared {
    fn counters(&self) -> MutexGuard<'_, Counters> {
        self.counters.lock().expect("CUDA device counters lock poisoned")
    }

    /// Panics unless `b` lies inside the pool.
    fn check(&self, b: DevBuf) {
        let end = b.off.checked_add(b.len);
        assert!(
            end.is_some_and(|end| end <= self.len),
            "{b:?} is outside the device pool (0..{} elements)",
            self.len
        );
    }

    fn addr(&self, b: DevBuf) -> u64 {
        self.check(b);
        self.base + (b.off * 4) as u64
    }

    fn stream(&self, q: Queue) -> &Arc<CudaStream> {
        match q {
            Queue::Compute => &self.streams[0],
            Queue::H2D => &self.streams[1],
            Queue::D2H => &self.streams[2],
            Queue::Host => unreachable!("the host queue has no stream"),
        }
    }

    /// Keeps `msg` as the device's failure unless one came first.
    fn note_failure(&self, q: Queue, msg: String) {
        keep_first(&self.failure, q, msg);
    }

    /// Keeps `msg` as the panic `synchronize` reports unless one came first.
    fn note_panic(&self, q: Queue, msg: String) {
        keep_first(&self.first_panic, q, msg);
    }
}

/// Stores `msg`, naming queue `q`, in `slot` if it is empty (also after a panic poisoned it).
fn keep_first(slot: &Mutex<Option<String>>, q: Queue, msg: String) {
    let mut first = slot.lock().unwrap_or_else(|p| p.into_inner());
    first.get_or_insert_with(|| format!("{msg} (on the {q:?} queue)"));
}

/// Recycled CUDA events (blocking sync, timing enabled), so the step loop creates none after
/// the first steps.
struct EventPool {
    ctx: Arc<CudaContext>,
    free: Mutex<Vec<usize>>,
}

impl EventPool {
    fn get(&self) -> sys::CUevent {
        if let Some(e) = self.free.lock().expect("CUDA event pool lock poisoned").pop() {
            return e as sys::CUevent;
        }
        check("binding the context", self.ctx.bind_to_thread());
        check("cuEventCreate", cu::event::create(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
    }

    fn put(&self, e: sys::CUevent) {
        self.free.lock().expect("CUDA event pool lock poisoned").push(e as usize);
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let free = match self.free.get_mut() {
            Ok(v) => std::mem::take(v),
            Err(p) => std::mem::take(p.into_inner()),
        };
        for e in free {
            // SAFETY: created by `get`, no longer recorded anywhere (every queue has stopped).
            let _ = unsafe { cu::event::destroy(e as sys::CUevent) };
        }
    }
}

/// What kernels see: views of the pool.
struct CudaViews<'a> {
    shared: &'a Shared,
}

impl Views<CudaBackend> for CudaViews<'_> {
    fn backend(&self) -> &CudaBackend {
        &self.shared.compute
    }

    fn buf(&self, b: DevBuf) -> &DevSlice<f32> {
        // SAFETY: inside the pool (checked by `addr`), which outlives the device's threads.
        unsafe { DevSlice::from_raw(self.shared.addr(b), b.len) }
    }

    fn ibuf(&self, b: DevBuf) -> &DevSlice<i32> {
        // SAFETY: as above; i32 and f32 have the same size.
        unsafe { DevSlice::from_raw(self.shared.addr(b), b.len) }
    }

    /// The region as bf16 weights: two per f32 element of `b`.
    fn wbuf(&self, b: DevBuf) -> &DevSlice<Bf16> {
        // SAFETY: as above; `b.len` f32 are `2 * b.len` bf16.
        unsafe { DevSlice::from_raw(self.shared.addr(b), 2 * b.len) }
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn buf_mut(&self, b: DevBuf) -> &mut DevSlice<f32> {
        // SAFETY: inside the pool; exclusivity is the caller's contract (Views::buf_mut).
        unsafe { DevSlice::from_raw_mut(self.shared.addr(b), b.len) }
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn wbuf_mut(&self, b: DevBuf) -> &mut DevSlice<Bf16> {
        // SAFETY: inside the pool, `b.len` f32 are `2 * b.len` bf16; exclusivity is the
        // caller's contract (Views::wbuf_mut).
        unsafe { DevSlice::from_raw_mut(self.shared.addr(b), 2 * b.len) }
    }
}

// ---- the queues -------------------------------------------------------------------------------

/// One unit of queued work.
enum Task {
    Kernel(Kernel<CudaBackend>, Option<KernelTimer>),
    Host(HostWork),
    Upload { dst: DevBuf, src: HostPtr },
    UploadWeights { dst: DevBuf, at: usize, src: HostPtr },
    UploadWeightsBf16 { dst: DevBuf, at: usize, src: HostPtr<Bf16> },
    UploadPinnedBf16 { dst: DevBuf, at: usize, src: HostPtr<Bf16> },
    UploadI32 { dst: DevBuf, src: Arc<Vec<i32>> },
    Download { dst: HostPtrMut, src: DevBuf },
    DownloadBf16 { dst: HostPtrMut<Bf16>, src: DevBuf },
    Signal(Event),
    Wait(Event),
    Stop,
}

/// What a stream's completion thread waits for, in stream order.
enum Done {
    /// Signal the event once the CUDA event is reached.
    Signal(sys::CUevent, Event),
    /// Add the GPU time between two CUDA events around `what` to a queue's busy time (and tell
    /// the timer).
    Busy {
        q: Queue,
        what: &'static str,
        start: sys::CUevent,
        end: sys::CUevent,
        timer: Option<KernelTimer>,
    },
    Stop,
}

// SAFETY: CUDA events are handles usable from any thread of the process.
unsafe impl Send for Done {}

/// The random delay before each copy is enqueued: uniform in `0..=max_us` microseconds.
struct Jitter {
    max_us: u64,
    state: u64,
}

impl Jitter {
    fn new(max_us: u64, seed: u64, q: Queue) -> Self {
        let stream = (q.index() as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03);
        Jitter { max_us, state: seed ^ stream }
    }

    fn delay(&mut self) {
        if self.max_us == 0 {
            return;
        }
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        thread::sleep(Duration::from_micros((z ^ (z >> 31)) % (self.max_us + 1)));
    }
}

/// The bf16 ring of the H2D dispatcher: two page-locked chunks and the events of their copies.
struct WireRing {
    host: [Pinned<Bf16>; 2],
    copied: [sys::CUevent; 2],
    next: usize,
}

/// A queue's dispatcher thread: runs (host queue) or enqueues (stream queues) its tasks in
/// order until `Stop`. A failed driver call in a task ends that task and becomes the device's
/// failure ([`Device::failure`]); other panics in tasks (bugs) are kept for `synchronize`.
/// The H2D queue gets the page-locked chunks of its bf16 ring (`ring_host`).
fn dispatcher(
    q: Queue,
    rx: &Receiver<Task>,
    shared: &Arc<Shared>,
    mut jitter: Jitter,
    ring_host: Option<[Pinned<Bf16>; 2]>,
) {
    super::mark_device_queue_thread();
    if let Err(e) = shared.ctx.bind_to_thread() {
        shared.note_failure(q, format!("CUDA: cannot bind the context: {e:?}"));
    }
    let (done_tx, completer) = if q == Queue::Host {
        (None, None)
    } else {
        let (tx, done_rx) = mpsc::channel::<Done>();
        let shared = Arc::clone(shared);
        let handle = thread::Builder::new()
            .name(format!("horizon-cuda-{q:?}-done").to_lowercase())
            .spawn(move || completer(q, &done_rx, &shared))
            .expect("cannot start a CUDA completion thread");
        (Some(tx), Some(handle))
    };
    let mut ring = ring_host.map(|host| WireRing {
        host,
        copied: [shared.events.get(), shared.events.get()],
        next: 0,
    });
    for task in rx {
        if matches!(task, Task::Stop) {
            break;
        }
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            run(q, task, shared, done_tx.as_ref(), &mut jitter, ring.as_mut());
        }));
        if let Err(payload) = result {
            if let Some(DeviceFault(msg)) = payload.downcast_ref::<DeviceFault>() {
                shared.note_failure(q, msg.clone());
                continue;
            }
            let msg = if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "(a non-string panic payload)".to_string()
            };
            shared.note_panic(q, msg);
        }
    }
    if let Some(tx) = done_tx {
        let _ = tx.send(Done::Stop);
    }
    if let Some(h) = completer {
        let _ = h.join();
    }
    if let Some(ring) = ring {
        for e in ring.copied {
            // SAFETY: the ring's events; the stream has drained (the completer waited for all).
            let _ = unsafe { cu::event::synchronize(e) };
            shared.events.put(e);
        }
    }
}

/// Runs one task of queue `q`.
fn run(
    q: Queue,
    task: Task,
    shared: &Shared,
    done: Option<&Sender<Done>>,
    jitter: &mut Jitter,
    ring: Option<&mut WireRing>,
) {
    let send = |d: Done| {
        done.expect("a stream queue has a completion thread")
            .send(d)
            .expect("CUDA completion thread is gone");
    };
    // Busy time of stream work: CUDA events around it, read by the completion thread.
    let timed = |what: &'static str, work: &mut dyn FnMut(), timer: Option<KernelTimer>| {
        let stream = shared.stream(q).cu_stream();
        let (start, end) = (shared.events.get(), shared.events.get());
        // SAFETY: live events and stream of this context.
        check("cuEventRecord", unsafe { cu::event::record(start, stream) });
        work();
        // SAFETY: as above.
        check("cuEventRecord", unsafe { cu::event::record(end, stream) });
        send(Done::Busy { q, what, start, end, timer });
    };
    match task {
        Task::Stop => unreachable!("Stop is handled by the dispatcher"),
        Task::Wait(e) if q == Queue::Host => e.wait_host(),
        Task::Wait(e) => wait_on_stream(shared.stream(q).cu_stream(), &e),
        Task::Signal(e) => {
            if q == Queue::Host {
                e.signal();
            } else {
                let ev = shared.events.get();
                // SAFETY: a live event and stream of this context.
                check("cuEventRecord", unsafe {
                    cu::event::record(ev, shared.stream(q).cu_stream())
                });
                // Streams waiting for `e` can now wait for `ev` on the device; the completer
                // signals `e` (dropping the mark) before `ev` goes back to the pool.
                e.mark(ev as usize);
                send(Done::Signal(ev, e));
            }
        }
        Task::Host(w) => {
            if q != Queue::Host {
                check("stream synchronize", shared.stream(q).synchronize());
            }
            let start = Instant::now();
            w();
            shared.counters().busy[q.index()] += start.elapsed();
        }
        Task::Kernel(k, timer) => {
            let mut k = Some(k);
            let mut work = || {
                if let Some(k) = k.take() {
                    k(&CudaViews { shared });
                }
            };
            timed("kernels", &mut work, timer);
        }
        Task::Upload { dst, src } => {
            jitter.delay();
            let stream = shared.stream(q).cu_stream();
            timed(
                "an upload",
                &mut || {
                    // SAFETY: `dst` is inside the pool (checked at submission); `src` stays alive
                    // and unwritten until this queue's next event is reached (HostPtr's contract),
                    // which is after the copy.
                    let s = unsafe { src.as_slice() };
                    if !s.is_empty() {
                        // SAFETY: as above.
                        let r = unsafe { cu::memcpy_htod_async(shared.addr(dst), s, stream) };
                        check("cuMemcpyHtoDAsync", r);
                    }
                },
                None,
            );
            shared.counters().h2d_bytes += dst.bytes() as u64;
        }
        Task::UploadWeights { dst, at, src } => {
            jitter.delay();
            let ring = ring.expect("weights are uploaded on the H2D queue, which has the ring");
            let addr = shared.addr(dst) + (2 * at) as u64;
            let fill = round_to_bf16;
            timed("a weight upload", &mut || upload_bf16(shared, ring, addr, src, fill), None);
            shared.counters().h2d_bytes += (2 * src.len()) as u64;
        }
        Task::UploadWeightsBf16 { dst, at, src } => {
            jitter.delay();
            let ring = ring.expect("weights are uploaded on the H2D queue, which has the ring");
            let addr = shared.addr(dst) + (2 * at) as u64;
            let fill = <[Bf16]>::copy_from_slice;
            timed("a bf16 weight upload", &mut || upload_bf16(shared, ring, addr, src, fill), None);
            shared.counters().h2d_bytes += (2 * src.len()) as u64;
        }
        Task::UploadPinnedBf16 { dst, at, src } => {
            jitter.delay();
            let stream = shared.stream(q).cu_stream();
            let addr = shared.addr(dst) + (2 * at) as u64;
            let direct = &mut || {
                // SAFETY: `src` is page-locked staging of this device, alive and unwritten until
                // this queue's next event (HostPtr's contract), which is after the copy; `addr`
                // holds `src.len()` bf16 of the slot (checked at submission).
                let s = unsafe { src.as_slice() };
                if !s.is_empty() {
                    // SAFETY: as above.
                    let r = unsafe { cu::memcpy_htod_async(addr, s, stream) };
                    check("cuMemcpyHtoDAsync", r);
                }
            };
            timed("a pinned bf16 weight upload", direct, None);
            shared.counters().h2d_bytes += (2 * src.len()) as u64;
        }
        Task::UploadI32 { dst, src } => {
            jitter.delay();
            let stream = shared.stream(q).cu_stream();
            timed(
                "an i32 upload",
                &mut || {
                    if !src.is_empty() {
                        // SAFETY: `dst` is inside the pool; `src` is pageable, so the call returns
                        // only once the driver has staged it, and the Arc may go afterwards.
                        let r =
                            unsafe { cu::memcpy_htod_async(shared.addr(dst), &src[..], stream) };
                        check("cuMemcpyHtoDAsync", r);
                    }
                },
                None,
            );
            shared.counters().h2d_bytes += dst.bytes() as u64;
        }
        Task::Download { dst, src } => {
            jitter.delay();
            let stream = shared.stream(q).cu_stream();
            timed(
                "a download",
                &mut || {
                    // SAFETY: `download`'s caller gives this queue exclusive use of `dst` until its
                    // next event is reached, which is after the copy (HostPtrMut's contract).
                    let d = unsafe { dst.as_mut_slice() };
                    if !d.is_empty() {
                        // SAFETY: as above; `src` is inside the pool.
                        let r = unsafe { cu::memcpy_dtoh_async(d, shared.addr(src), stream) };
                        check("cuMemcpyDtoHAsync", r);
                    }
                },
                None,
            );
            shared.counters().d2h_bytes += src.bytes() as u64;
        }
        Task::DownloadBf16 { dst, src } => {
            jitter.delay();
            timed("a bf16 gradient download", &mut || download_bf16(shared, dst, src), None);
            shared.counters().d2h_bytes += (2 * src.len) as u64;
        }
    }
}

/// A wait of `stream` for `e`, on the device: once the queue that records `e` has enqueued its
/// CUDA event (a host wait for an *enqueue*, not for GPU work), `cuStreamWaitEvent` orders the
/// stream's later work after it, and the dispatcher goes on enqueueing. An event already
/// reached needs no wait; an event of the host queue is waited for on the host, since no CUDA
/// event stands for host work.
fn wait_on_stream(stream: sys::CUstream, e: &Event) {
    e.when_marked(|mark| {
        // SAFETY: `mark` is a live CUDA event of this context, recorded and not yet recycled:
        // the completer signals `e` (under the lock `when_marked` holds) before putting it back.
        let r = unsafe {
            cu::stream::wait_event(
                stream,
                mark as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        };
        check("cuStreamWaitEvent", r);
    });
}

/// A weight upload as bf16 into the `src.len()` bf16 at device address `dst` (inside a weight
/// slot, checked at submission): per chunk, `fill` the page-locked ring from the host weights
/// (round the fp32 masters, or copy bf16 ones; once the ring slot's previous copy has
/// finished) and copy it into the slot.
fn upload_bf16<T>(
    shared: &Shared,
    ring: &mut WireRing,
    dst: u64,
    src: HostPtr<T>,
    fill: fn(&mut [Bf16], &[T]),
) {
    let stream = shared.stream(Queue::H2D).cu_stream();
    let mut off = 0;
    while off < src.len() {
        let len = WIRE_CHUNK.min(src.len() - off);
        let slot = ring.next;
        ring.next = 1 - ring.next;
        // SAFETY: the event of this ring slot's last copy (or never recorded: returns at once).
        check("cuEventSynchronize", unsafe { cu::event::synchronize(ring.copied[slot]) });
        // SAFETY: HostPtr's contract: `src` is alive and unwritten until this queue's next event.
        let s = unsafe { src.sub(off..off + len).as_slice() };
        let host = &mut ring.host[slot][..len];
        fill(host, s);
        // SAFETY: `dst + 2 * off` holds `len` bf16 of the slot (checked at submission); the
        // host chunk is page-locked and not touched again until `copied[slot]` is reached.
        unsafe {
            let at = dst + (2 * off) as u64;
            check("cuMemcpyHtoDAsync", cu::memcpy_htod_async(at, &*host, stream));
            check("cuEventRecord", cu::event::record(ring.copied[slot], stream));
        }
        off += len;
    }
}

/// A gradient download as bf16: per chunk of `src` (fp32, in the pool), round it on the D2H
/// stream into the workspace's gradient chunk and copy that into `dst`. Both steps of every
/// chunk are on the one stream, in order: a chunk is rounded only after the previous chunk's
/// copy out of the same buffer has run (write after read), and copied only after its rounding
/// (read after write).
fn download_bf16(shared: &Shared, dst: HostPtrMut<Bf16>, src: DevBuf) {
    let stream = shared.stream(Queue::D2H).cu_stream();
    let wire = shared.grad_wire.lock().expect("CUDA device lock poisoned").unwrap_or_else(|| {
        panic!("download_bf16 of {src:?} before set_workspace: the device has no gradient chunk")
    });
    let mut off = 0;
    while off < src.len {
        let len = GRAD_WIRE_CHUNK.min(src.len - off);
        // SAFETY: the gradient chunk holds GRAD_WIRE_CHUNK >= len bf16 and only this stream
        // uses it; `src` lies in the pool (checked at submission) and the schedule orders this
        // download after the writes of `src` and before the next ones.
        let (wire_chunk, grad) = unsafe {
            (
                DevSlice::<Bf16>::from_raw_mut(wire, len),
                DevSlice::<f32>::from_raw(shared.addr(src.sub(off..off + len)), len),
            )
        };
        round_on_device(&shared.d2h, wire_chunk, grad);
        // SAFETY: `download_bf16`'s caller gives this queue exclusive use of `dst` until its
        // next event is reached, which is after this copy (HostPtrMut's contract).
        let d = unsafe { dst.sub(off..off + len).as_mut_slice() };
        // SAFETY: `wire` holds the `len` bf16 just rounded (same stream, ordered before).
        check("cuMemcpyDtoHAsync", unsafe { cu::memcpy_dtoh_async(d, wire, stream) });
        off += len;
    }
}

/// A stream's completion thread: waits for each CUDA event in stream order, then signals the
/// host event or adds the busy time. A failed wait (a GPU fault) is reported to `synchronize`
/// and the event is still signalled, so nothing deadlocks.
fn completer(q: Queue, rx: &Receiver<Done>, shared: &Shared) {
    let _ = shared.ctx.bind_to_thread();
    for d in rx {
        match d {
            Done::Stop => break,
            Done::Signal(ev, e) => {
                // SAFETY: a live event recorded by the dispatcher.
                if let Err(err) = unsafe { cu::event::synchronize(ev) } {
                    shared.note_failure(q, format!("CUDA: the GPU failed: {err:?}"));
                }
                // Signal first: that drops the mark, so no stream can wait for `ev` once it is
                // back in the pool and recorded for something else.
                e.signal();
                shared.events.put(ev);
            }
            Done::Busy { q: bq, what, start, end, timer } => {
                // SAFETY: live events recorded by the dispatcher, start before end.
                let ms = unsafe {
                    cu::event::synchronize(end).and_then(|()| cu::event::elapsed(start, end))
                };
                match ms {
                    Ok(ms) => {
                        let d = Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
                        shared.counters().busy[bq.index()] += d;
                        if let Some(timer) = timer {
                            timer(d);
                        }
                    }
                    Err(err) => shared.note_failure(
                        q,
                        format!(
                            "CUDA: the GPU failed running {what} on the {bq:?} stream: {err:?}"
                        ),
                    ),
                }
                shared.events.put(start);
                shared.events.put(end);
            }
        }
    }
}
