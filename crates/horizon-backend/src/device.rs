//! The device abstraction the streaming engine runs on: a fixed-capacity memory pool, ordered
//! queues that run concurrently (compute, host-to-device copy, device-to-host copy, host work),
//! and events that make one queue wait for a point in another. The CPU backend implements it
//! with worker threads ([`crate::cpu::CpuDevice`]), the CUDA backend with streams
//! (`crate::cuda::CudaDevice`).
//!
//! Memory is addressed by [`DevBuf`] handles (offset + length into the pool), not references:
//! work submitted to a queue runs later, on another thread, and resolves its handles to views
//! only when it runs. Which views may be live at once is the schedule's business; the engine's
//! plan is checked for hazards before it runs (see `horizon::engine::plan`).

use std::ops::Range;
use std::sync::Arc;
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::{Backend, Bf16};

/// What staging memory may hold: plain numbers, zero by default.
pub trait StagingElem: Copy + Default + Send + Sync + 'static {}
impl StagingElem for f32 {}
impl StagingElem for Bf16 {}

/// The ordered queues of a device. Work on one queue runs in submission order; work on
/// different queues runs concurrently unless an [`Event`] orders it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Queue {
    /// Kernels.
    Compute,
    /// Host -> device copies.
    H2D,
    /// Device -> host copies.
    D2H,
    /// Host-side work ordered with the device (gradient accumulation, optimizer updates).
    Host,
}

impl Queue {
    pub const ALL: [Queue; 4] = [Queue::Compute, Queue::H2D, Queue::D2H, Queue::Host];
    /// Index into per-queue arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A region of device memory: `len` 4-byte elements (f32, or i32 where an op wants ids) at
/// element offset `off` of the device pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevBuf {
    pub off: usize,
    pub len: usize,
}

impl DevBuf {
    /// A sub-range (in elements, relative to this buffer).
    #[allow(clippy::should_implement_trait)]
    pub fn sub(self, r: Range<usize>) -> DevBuf {
        assert!(r.start <= r.end && r.end <= self.len, "DevBuf::sub {r:?} out of 0..{}", self.len);
        DevBuf { off: self.off + r.start, len: r.end - r.start }
    }
    /// The first `len` elements.
    pub fn prefix(self, len: usize) -> DevBuf {
        self.sub(0..len)
    }
    /// Size in bytes.
    pub fn bytes(self) -> usize {
        self.len * 4
    }
    /// Element range in the pool.
    pub fn range(self) -> Range<usize> {
        self.off..self.off + self.len
    }
}

/// A host buffer handed to a queue: `len` elements of `T` (f32 unless said otherwise; bf16
/// for gradients that travel as bf16). Built only through `unsafe` constructors whose contract
/// is that the memory stays alive, and is not written by anyone else (for `HostPtr`) or not
/// accessed by anyone else (for `HostPtrMut`), until the queued work that uses it has run.
#[derive(Debug)]
pub struct HostPtr<T = f32> {
    ptr: *const T,
    len: usize,
}

/// A mutable host buffer handed to a queue; see [`HostPtr`].
#[derive(Debug)]
pub struct HostPtrMut<T = f32> {
    ptr: *mut T,
    len: usize,
}

// Copy and Clone by hand: a derive would ask `T: Copy`, which a pointer does not need.
impl<T> Clone for HostPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for HostPtr<T> {}
impl<T> Clone for HostPtrMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for HostPtrMut<T> {}

// SAFETY: a HostPtr is only a promise about memory the constructor's caller keeps alive and
// unwritten until the queued work ran; moving that promise to a worker thread is the point.
// The elements are plain numbers (f32, i32, bf16), sendable by value.
unsafe impl<T: Send> Send for HostPtr<T> {}
// SAFETY: as for HostPtr; the caller promises exclusive access for the queued work.
unsafe impl<T: Send> Send for HostPtrMut<T> {}
// SAFETY: sharing the handle shares no access by itself; every dereference is `unsafe` and
// governed by the constructor's contract (the schedule decides who touches the memory when).
unsafe impl<T: Sync> Sync for HostPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for HostPtrMut<T> {}

impl<T> HostPtr<T> {
    /// # Safety
    /// `s` must stay alive and unwritten until every queued use of the returned pointer has run.
    pub unsafe fn new(s: &[T]) -> Self {
        HostPtr { ptr: s.as_ptr(), len: s.len() }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A sub-range (in elements).
    #[allow(clippy::should_implement_trait)]
    pub fn sub(self, r: Range<usize>) -> Self {
        assert!(r.start <= r.end && r.end <= self.len, "HostPtr::sub {r:?} out of 0..{}", self.len);
        // SAFETY: in bounds of the original buffer, checked above.
        HostPtr { ptr: unsafe { self.ptr.add(r.start) }, len: r.end - r.start }
    }
    /// # Safety
    /// Only inside queued work, under the constructor's contract.
    pub unsafe fn as_slice<'a>(self) -> &'a [T] {
        // SAFETY: the constructor's caller guarantees the memory is alive and unwritten.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T> HostPtrMut<T> {
    /// # Safety
    /// `s` must stay alive and otherwise unaccessed until every queued use of the returned
    /// pointer has run.
    pub unsafe fn new(s: &mut [T]) -> Self {
        HostPtrMut { ptr: s.as_mut_ptr(), len: s.len() }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A sub-range (in elements).
    #[allow(clippy::should_implement_trait)]
    pub fn sub(self, r: Range<usize>) -> Self {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "HostPtrMut::sub {r:?} out of 0..{}",
            self.len
        );
        // SAFETY: in bounds of the original buffer, checked above.
        HostPtrMut { ptr: unsafe { self.ptr.add(r.start) }, len: r.end - r.start }
    }
    /// The same memory, for reading.
    pub fn as_const(self) -> HostPtr<T> {
        HostPtr { ptr: self.ptr, len: self.len }
    }
    /// # Safety
    /// Only inside queued work, under the constructor's contract.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<'a>(self) -> &'a mut [T] {
        // SAFETY: the constructor's caller guarantees exclusive access while the work runs.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// A point in a queue's stream of work. Recorded once on a queue; any queue (or the host) can
/// wait for it. Cloning shares the same event.
///
/// A device whose queues are streams (CUDA) also *marks* the event when it has enqueued the
/// record on a stream, with its own handle of that record: another stream can then wait for it
/// on the device ([`Event::when_marked`]) instead of on the host.
#[derive(Clone, Debug, Default)]
pub struct Event(Arc<(Mutex<EventState>, Condvar)>);

#[derive(Debug, Default)]
struct EventState {
    /// The recording queue has passed the event.
    done: bool,
    /// The device's handle of the enqueued record (0: none), valid until `done`.
    mark: usize,
}

impl Event {
    pub fn new() -> Self {
        Event::default()
    }
    fn state(&self) -> MutexGuard<'_, EventState> {
        self.0.0.lock().expect("event lock poisoned")
    }
    /// Mark the event as reached (called by the queue that recorded it). Drops the mark.
    pub fn signal(&self) {
        let mut s = self.state();
        s.done = true;
        s.mark = 0;
        self.0.1.notify_all();
    }
    /// Note that the record has been enqueued on a device stream as `handle` (non-zero): valid
    /// until [`Event::signal`], which must come after it.
    pub fn mark(&self, handle: usize) {
        assert_ne!(handle, 0, "an event mark is a non-zero device handle");
        self.state().mark = handle;
        self.0.1.notify_all();
    }
    /// True once the recording queue has passed the event.
    pub fn is_done(&self) -> bool {
        self.state().done
    }
    /// Make the event unreached (and unmarked) again, for reuse. Only once nothing waits for it
    /// any more.
    pub fn reset(&self) {
        let mut s = self.state();
        s.done = false;
        s.mark = 0;
    }
    /// Block the calling thread until the event is reached.
    pub fn wait_host(&self) {
        let mut s = self.state();
        while !s.done {
            s = self.0.1.wait(s).expect("event lock poisoned");
        }
    }
    /// Blocks until the event is reached or marked. Marked but not reached: calls `f` with the
    /// mark, under the event's lock, so the handle cannot be signalled (and recycled) while `f`
    /// runs. Reached: returns without calling `f`.
    pub fn when_marked(&self, f: impl FnOnce(usize)) {
        let mut s = self.state();
        while !s.done {
            if s.mark != 0 {
                return f(s.mark);
            }
            s = self.0.1.wait(s).expect("event lock poisoned");
        }
    }
}

/// Counters a device keeps, for the summary and the benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceStats {
    /// The pool's fixed capacity.
    pub capacity_bytes: usize,
    /// Bytes currently allocated from the pool.
    pub in_use_bytes: usize,
    /// Highest `in_use_bytes` seen.
    pub peak_bytes: usize,
    /// Bytes copied host -> device and device -> host.
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    /// Seconds each queue spent running work (waiting excluded).
    pub compute_busy_s: f64,
    pub h2d_busy_s: f64,
    pub d2h_busy_s: f64,
    pub host_busy_s: f64,
    /// Seconds during which at least one copy queue was moving data.
    pub link_busy_s: f64,
    /// Bytes of page-locked host memory the device holds now: the staging buffers it handed
    /// out ([`Device::alloc_staging`]) and its own (the CUDA device's bf16 weight upload ring,
    /// `cuda::WIRE_RING_BYTES`). 0 on the CPU device, which pins nothing (its staging is
    /// ordinary memory).
    pub pinned_bytes: usize,
    /// Highest `pinned_bytes` seen.
    pub pinned_peak_bytes: usize,
}

/// The device asked for more memory than its pool has left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutOfDeviceMemory {
    pub requested_bytes: usize,
    pub in_use_bytes: usize,
    pub capacity_bytes: usize,
}

impl std::fmt::Display for OutOfDeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device memory exhausted: {} bytes requested, {} of {} in use",
            self.requested_bytes, self.in_use_bytes, self.capacity_bytes
        )
    }
}

impl std::error::Error for OutOfDeviceMemory {}

/// Resolves [`DevBuf`] handles to views while queued work runs.
pub trait Views<B: Backend + ?Sized> {
    /// The kernels.
    fn backend(&self) -> &B;
    /// A read view of `b` as f32.
    fn buf(&self, b: DevBuf) -> &B::Buf;
    /// A read view of `b` as i32.
    fn ibuf(&self, b: DevBuf) -> &B::IBuf;
    /// A read view of `b` as weights in the backend's precision: `b.bytes() /
    /// B::PRECISION.weight_bytes()` of them (a slot written by [`Device::upload_weights`]).
    fn wbuf(&self, b: DevBuf) -> &B::WBuf;
    /// A write view of `b` as f32.
    ///
    /// # Safety
    /// No other view of any element of `b` may be live while the returned one is, on this or
    /// any queue (the plan's hazard check and the events it names guarantee it across queues;
    /// within one piece of work the caller passes disjoint buffers).
    #[allow(clippy::mut_from_ref)]
    unsafe fn buf_mut(&self, b: DevBuf) -> &mut B::Buf;
    /// A write view of `b` as weights in the backend's precision (a workspace a kernel writes
    /// weights into: a dequantised NF4 matrix).
    ///
    /// # Safety
    /// As [`Views::buf_mut`].
    #[allow(clippy::mut_from_ref)]
    unsafe fn wbuf_mut(&self, b: DevBuf) -> &mut B::WBuf;
}

/// Work for the compute queue: given the views, run kernels.
pub type Kernel<B> = Box<dyn for<'a> FnOnce(&'a dyn Views<B>) + Send>;
/// Work for the host queue.
pub type HostWork = Box<dyn FnOnce() + Send>;
/// Told how long a kernel task ran on the device, once that is known. Shared, so a caller can
/// build its timers once and clone them per launch without allocating.
pub type KernelTimer = Arc<dyn Fn(std::time::Duration) + Send + Sync>;

/// A device: memory pool, queues, events. Every method only *enqueues*; nothing waits unless
/// it says so.
///
/// Copies and kernels on different queues are ordered only by events: a download is not
/// ordered after an earlier launch unless the download queue waits for an event the compute
/// queue recorded. The engine's plan names every such wait and is hazard-checked (see
/// `horizon::engine::plan`); that check is what keeps `upload`, `download`, `launch` and
/// `free` sound. Never call `synchronize` from queued work (it would wait for itself).
pub trait Device: Send + Sync {
    /// The kernels this device runs.
    type Backend: Backend;

    /// Short name for logs.
    fn name(&self) -> String;
    /// Take `len` elements from the pool. Fails when the pool's capacity would be exceeded.
    fn alloc(&self, len: usize) -> Result<DevBuf, OutOfDeviceMemory>;
    /// Return a buffer to the pool. Call only after every queued use of it has run.
    fn free(&self, b: DevBuf);
    /// Enqueue a signal of `e` on queue `q`: `e` is reached when `q` has run all work submitted
    /// before.
    fn record(&self, q: Queue, e: &Event);
    /// Enqueue a wait: work submitted to `q` afterwards runs only once `e` is reached.
    fn wait(&self, q: Queue, e: &Event);
    /// Enqueue a host -> device copy on [`Queue::H2D`]. `dst.len == src.len()`.
    fn upload(&self, dst: DevBuf, src: HostPtr);
    /// Enqueue a host -> device copy of fp32 *weights* on [`Queue::H2D`], into weights
    /// `at .. at + src.len()` of the weight region `dst` (counted in weights of the backend's
    /// precision, as [`Views::wbuf`] sees `dst`). The CUDA device rounds them to bf16 on the
    /// host and copies the bf16 (half the link bytes, half the slot); the CPU device copies
    /// them exactly.
    fn upload_weights(&self, dst: DevBuf, at: usize, src: HostPtr);
    /// [`Device::upload_weights`] of weights that are bf16 on the host already (frozen base
    /// weights kept as bf16), with the same `dst`/`at` convention: the CUDA device copies the
    /// bf16 as they are (half the link bytes of fp32, no rounding); the CPU device expands them
    /// to fp32 exactly.
    fn upload_weights_bf16(&self, dst: DevBuf, at: usize, src: HostPtr<Bf16>);
    /// [`Device::upload_weights_bf16`] from page-locked memory of this device's
    /// [`Device::alloc_staging`] (a bf16 image of the masters): the CUDA device copies straight
    /// from it, a pure DMA with no host work. The default is `upload_weights_bf16`.
    fn upload_weights_bf16_pinned(&self, dst: DevBuf, at: usize, src: HostPtr<Bf16>) {
        self.upload_weights_bf16(dst, at, src)
    }
    /// Enqueue an i32 host -> device copy on [`Queue::H2D`].
    fn upload_i32(&self, dst: DevBuf, src: Arc<Vec<i32>>);
    /// Enqueue a device -> host copy on [`Queue::D2H`]. `dst.len() == src.len`.
    fn download(&self, dst: HostPtrMut, src: DevBuf);
    /// Enqueue a device -> host copy of fp32 `src` as bf16 on [`Queue::D2H`] (rounded to nearest
    /// even on the device: half the link bytes). `dst.len() == src.len`. For gradients
    /// (`engine.grad_wire: bf16`); the host accumulates them in fp32.
    fn download_bf16(&self, dst: HostPtrMut<Bf16>, src: DevBuf);
    /// Hand the backend its workspace (device memory its ops use besides their arguments:
    /// bf16 copies of product inputs, the cuBLAS workspace, the bf16 gradient chunk), laid out
    /// by `Precision::workspace`. Call once, before any work that uses it; `ws` must stay
    /// allocated while the device runs. The default ignores it (the CPU needs none).
    fn set_workspace(&self, ws: DevBuf) {
        let _ = ws;
    }
    /// Enqueue kernels on [`Queue::Compute`].
    fn launch(&self, k: Kernel<Self::Backend>);
    /// [`Device::launch`], and `timer` is told how long the kernels ran: device time between
    /// events on a GPU (the closure only enqueues there), the closure's own time on the CPU.
    fn launch_timed(&self, k: Kernel<Self::Backend>, timer: KernelTimer);
    /// Enqueue host work on queue `q`, ordered with that queue's other work (on CUDA, a host
    /// function launched on the stream).
    fn host_on(&self, q: Queue, w: HostWork);
    /// Enqueue host work on [`Queue::Host`].
    fn host(&self, w: HostWork) {
        self.host_on(Queue::Host, w);
    }
    /// The threads that run [`Queue::Host`]'s work (the engine's host pool): a device whose
    /// waits spin keeps them spinning while that queue waits, so they are as awake for its
    /// next op as they were when their work was timed (the CPU device under
    /// `WaitMode::Spin`). Others ignore it.
    fn host_threads(&self, _pool: Arc<rayon::ThreadPool>) {}
    /// Block until every queue has run everything submitted so far. Panics if queued work
    /// panicked (a bug); a *device failure* is not a panic: see [`Device::failure`].
    fn synchronize(&self);
    /// The first failure of queued device work so far, naming the operation (a launch or copy
    /// the driver refused, a fault on the GPU), or `None`. Once there is one, the results of
    /// later work are meaningless: the caller stops and saves nothing. The CPU device has none.
    fn failure(&self) -> Option<String> {
        None
    }
    /// Counters so far.
    fn stats(&self) -> DeviceStats;

    /// Host staging memory of `T` (f32, or bf16 for gradients): page-locked where the device
    /// has it, plain memory otherwise.
    type Staging<T: StagingElem>: std::ops::DerefMut<Target = [T]> + Send + Sync;
    /// A zeroed staging buffer of `len` elements.
    fn alloc_staging<T: StagingElem>(&self, len: usize) -> Self::Staging<T>;

    /// Host memory allocated elsewhere (not staging) that the device copies to or from,
    /// page-locked while this guard lives where the device pins ([`Device::pin_host`]).
    type HostPin: Send + Sync;
    /// Page-locks `buf` for the device's copies until the returned guard is dropped (CUDA:
    /// `cuMemHostRegister`, counted in [`DeviceStats::pinned_bytes`]): a copy to or from
    /// pageable memory runs at a fraction of the link's rate, staged by the driver (a 7B
    /// head's gradient tile: 94 ms on an H200, 18 page-locked). Plain memory where the driver
    /// refuses (with a warning), and on devices that pin nothing (the CPU device).
    ///
    /// # Safety
    /// `buf` must stay allocated, at the same address, until the guard is dropped.
    unsafe fn pin_host(&self, buf: &mut [f32]) -> Self::HostPin;
}
