//! [`CpuDevice`], the [`Device`] of the CPU backend: a fixed-capacity pool in one host
//! allocation, one worker thread per [`Queue`], and an optional simulated host <-> device link
//! (a bandwidth limit and random copy delays), so the streaming engine's memory budget,
//! overlap and event ordering can be exercised and measured without a GPU.
//!
//! Data flow: `alloc` hands out [`DevBuf`] ranges of the arena; `upload` / `launch` / `download`
//! / `host` / `record` / `wait` push a task onto the queue's channel; the queue's thread runs its
//! tasks in order, resolving handles to slices of the arena only when a task runs.

use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::CpuBackend;
use crate::Bf16;
use crate::bf16::same_len;
use crate::device::{
    DevBuf, Device, DeviceStats, Event, HostPtr, HostPtrMut, HostWork, Kernel, KernelTimer,
    OutOfDeviceMemory, Queue, StagingElem, Views,
};

pub use crate::pool::ALIGN_ELEMS;
use crate::pool::Pool;
use crate::threads::{self, Placement};

/// The link simulation sleeps until this close to the end of a copy, then spins: `sleep`
/// overshoots by tens of microseconds.
const SPIN: Duration = Duration::from_micros(100);

/// The longest one spinner of a spinning wait runs before it is sent again.
const SPIN_TURN: Duration = Duration::from_millis(1);

/// How the CPU device is built.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuDeviceConfig {
    /// Pool capacity in bytes (device.memory). Rounded down to a multiple of 64 bytes.
    pub capacity_bytes: usize,
    /// Simulated link bandwidth in GB/s (1e9 bytes per second), each direction; 0 = unthrottled.
    pub link_gbps: f64,
    /// Largest random delay (microseconds) injected before each copy on the H2D and D2H
    /// queues; 0 = none. For race stress tests.
    pub copy_jitter_us: u64,
    /// Seed of the jitter.
    pub jitter_seed: u64,
    /// How the compute and host queues wait for another queue's event (`device.wait`).
    pub wait: WaitMode,
    /// Pin the kernels' threads, each to one CPU from the first of the process's allowed set
    /// (`engine.pin_threads`; [`crate::threads`] says why).
    pub pin_threads: bool,
}

/// How the CPU device's compute and host queues wait for an event of another queue, like CUDA's
/// `cudaDeviceScheduleBlockingSync` against `cudaDeviceScheduleSpin`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WaitMode {
    /// Sleep on the event: the kernels' cores are free for the host queue meanwhile.
    #[default]
    Block,
    /// The compute queue's kernel threads spin until the event is reached, and so do the host
    /// queue's threads while it waits, once the engine has named them
    /// ([`Device::host_threads`]); each yields its core to any other runnable thread. The
    /// copy queues block as before: their spinning threads took the kernels' cores on a
    /// 2-core machine. Why spin: a GPU's engines stay awake while they wait, and a thread
    /// that slept can run slowly for a while after. On the shared virtual machine this project
    /// is built on that was mostly the kernels' unpinned threads waking onto one CPU (a burst
    /// up to 1.6x as long as back to back, `examples/idle_probe`); with the threads pinned
    /// ([`CpuDeviceConfig::pin_threads`], the default) what remains is 1.04-1.24x after 50-200
    /// ms of sleep, which spinning avoids.
    Spin,
}

impl CpuDeviceConfig {
    /// A pool of `capacity_bytes`, an unthrottled link and no jitter.
    pub fn with_capacity(capacity_bytes: usize) -> Self {
        CpuDeviceConfig {
            capacity_bytes,
            link_gbps: 0.0,
            copy_jitter_us: 0,
            jitter_seed: 0,
            wait: WaitMode::Block,
            pin_threads: true,
        }
    }
}

/// The CPU device. Memory is one zeroed host allocation (`calloc`, so pages never touched do not
/// count towards the process's resident memory); each queue is a thread fed by a channel.
///
/// Kernels run on the device's own rayon pool (as many threads as the global one, pinned to
/// the first CPUs unless [`CpuDeviceConfig::pin_threads`] is false), handed to it by the
/// compute queue's thread. A panic inside queued work is a bug: the queue keeps going
/// (still signalling its events, so nothing deadlocks) and the next [`Device::synchronize`]
/// panics with the first message. Dropping the device runs everything already queued, then
/// stops the threads; an event that is waited for but never recorded therefore hangs the
/// drop, as it would hang `synchronize`.
pub struct CpuDevice {
    cfg: CpuDeviceConfig,
    shared: Arc<Shared>,
    pool: Mutex<Pool>,
    /// One channel per queue, indexed by [`Queue::index`].
    queues: [Sender<Task>; 4],
    workers: Vec<JoinHandle<()>>,
}

impl CpuDevice {
    /// Allocates the pool and starts the four queue threads.
    pub fn new(cfg: CpuDeviceConfig) -> Self {
        assert!(
            cfg.link_gbps.is_finite() && cfg.link_gbps >= 0.0,
            "CpuDeviceConfig::link_gbps must be finite and >= 0, got {}",
            cfg.link_gbps
        );
        let len = cfg.capacity_bytes / 4 / ALIGN_ELEMS * ALIGN_ELEMS;
        let placement = Placement::first(cfg.pin_threads);
        let kernels = threads::pool("horizon-cpu-kernels", rayon::current_num_threads(), placement)
            .expect("cannot start the CPU device's kernel threads");
        let shared = Arc::new(Shared {
            arena: Arena::new(len),
            kernels,
            host_threads: Mutex::new(None),
            link_gbps: cfg.link_gbps,
            counters: Mutex::new(Counters::new()),
            first_panic: Mutex::new(None),
        });
        let mut workers = Vec::with_capacity(4);
        let queues = Queue::ALL.map(|q| {
            let (tx, rx) = mpsc::channel();
            let shared = Arc::clone(&shared);
            let jitter = match q {
                Queue::H2D | Queue::D2H => Jitter::new(cfg.copy_jitter_us, cfg.jitter_seed, q),
                Queue::Compute | Queue::Host => Jitter::new(0, 0, q),
            };
            let handle = thread::Builder::new()
                .name(format!("horizon-cpu-{q:?}").to_lowercase())
                .spawn(move || worker(q, &rx, &shared, jitter))
                .expect("cannot start a CPU device queue thread");
            workers.push(handle);
            tx
        });
        CpuDevice { cfg, shared, pool: Mutex::new(Pool::new(len)), queues, workers }
    }

    /// The configuration the device was built with.
    pub fn config(&self) -> &CpuDeviceConfig {
        &self.cfg
    }

    fn submit(&self, q: Queue, task: Task) {
        self.queues[q.index()].send(task).expect("CPU device queue thread is gone");
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().expect("CPU device pool lock poisoned")
    }
}

impl Device for CpuDevice {
    type Backend = CpuBackend;
    /// The CPU has no page-locked memory distinct from ordinary memory: staging is a plain
    /// `Vec`.
    type Staging<T: StagingElem> = Vec<T>;

    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn alloc(&self, len: usize) -> Result<DevBuf, OutOfDeviceMemory> {
        let mut pool = self.pool();
        let oom = |pool: &Pool| OutOfDeviceMemory {
            requested_bytes: len.saturating_mul(4),
            in_use_bytes: pool.in_use * 4,
            capacity_bytes: self.shared.arena.len * 4,
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
        let task = match (q, self.cfg.wait) {
            (Queue::Compute | Queue::Host, WaitMode::Spin) => Task::SpinWait(e.clone()),
            _ => Task::Wait(e.clone()),
        };
        self.submit(q, task);
    }

    fn upload(&self, dst: DevBuf, src: HostPtr) {
        same_len("upload", dst.len, src.len());
        self.shared.arena.check(dst);
        self.submit(Queue::H2D, Task::Upload { dst, src });
    }

    /// fp32 weights stay fp32: an exact copy into `dst.sub(at..at + src.len())`.
    fn upload_weights(&self, dst: DevBuf, at: usize, src: HostPtr) {
        self.upload(dst.sub(at..at + src.len()), src);
    }

    /// Expanded to fp32 exactly into `dst.sub(at..at + src.len())`; the simulated wire carries
    /// the bf16 (2 bytes per weight).
    fn upload_weights_bf16(&self, dst: DevBuf, at: usize, src: HostPtr<Bf16>) {
        let dst = dst.sub(at..at + src.len());
        self.shared.arena.check(dst);
        self.submit(Queue::H2D, Task::UploadBf16 { dst, src });
    }

    fn upload_i32(&self, dst: DevBuf, src: Arc<Vec<i32>>) {
        same_len("upload_i32", dst.len, src.len());
        self.shared.arena.check(dst);
        self.submit(Queue::H2D, Task::UploadI32 { dst, src });
    }

    fn download(&self, dst: HostPtrMut, src: DevBuf) {
        same_len("download", dst.len(), src.len);
        self.shared.arena.check(src);
        self.submit(Queue::D2H, Task::Download { dst, src });
    }

    /// The simulated wire carries bf16: each element is rounded (as the CUDA device rounds it)
    /// while it is copied, and the link counts 2 bytes per element.
    fn download_bf16(&self, dst: HostPtrMut<Bf16>, src: DevBuf) {
        same_len("download_bf16", dst.len(), src.len);
        self.shared.arena.check(src);
        self.submit(Queue::D2H, Task::DownloadBf16 { dst, src });
    }

    fn launch(&self, k: Kernel<CpuBackend>) {
        self.submit(Queue::Compute, Task::Kernel(k, None));
    }

    /// Timed by the compute thread around the kernels (which run there).
    fn launch_timed(&self, k: Kernel<CpuBackend>, timer: KernelTimer) {
        self.submit(Queue::Compute, Task::Kernel(k, Some(timer)));
    }

    fn host_threads(&self, pool: Arc<rayon::ThreadPool>) {
        *self.shared.host_threads.lock().expect("CPU device host threads lock poisoned") =
            Some(pool);
    }

    fn host_on(&self, q: Queue, w: HostWork) {
        self.submit(q, Task::Host(w));
    }

    /// Records a fresh event on every queue and waits for all of them; then panics if any
    /// queued work panicked since the last call. Must not be called from queued work.
    fn synchronize(&self) {
        let events = Queue::ALL.map(|q| {
            let e = Event::new();
            self.record(q, &e);
            e
        });
        for e in &events {
            e.wait_host();
        }
        let msg = self.shared.first_panic.lock().expect("CPU device panic lock poisoned").take();
        if let Some(msg) = msg {
            panic!("device work panicked: {msg}");
        }
    }

    fn stats(&self) -> DeviceStats {
        let (in_use, peak) = {
            let pool = self.pool();
            (pool.in_use, pool.peak)
        };
        let c = self.shared.counters();
        let mut link_busy = c.link_busy;
        if c.active_copies > 0 {
            link_busy += c.link_since.elapsed();
        }
        let busy = |q: Queue| c.busy[q.index()].as_secs_f64();
        DeviceStats {
            capacity_bytes: self.shared.arena.len * 4,
            in_use_bytes: in_use * 4,
            peak_bytes: peak * 4,
            h2d_bytes: c.h2d_bytes,
            d2h_bytes: c.d2h_bytes,
            compute_busy_s: busy(Queue::Compute),
            h2d_busy_s: busy(Queue::H2D),
            d2h_busy_s: busy(Queue::D2H),
            host_busy_s: busy(Queue::Host),
            link_busy_s: link_busy.as_secs_f64(),
            // Nothing is page-locked: staging is a plain `Vec` (see `alloc_staging`).
            pinned_bytes: 0,
            pinned_peak_bytes: 0,
        }
    }

    /// A zeroed `Vec`: the CPU has no page-locked memory distinct from ordinary memory.
    fn alloc_staging<T: StagingElem>(&self, len: usize) -> Vec<T> {
        vec![T::default(); len]
    }

    type HostPin = ();
    /// Nothing to page-lock (see `alloc_staging`).
    unsafe fn pin_host(&self, _: &mut [f32]) {}
}

impl Drop for CpuDevice {
    /// Lets every queue finish what was submitted, then stops and joins the threads. Never
    /// panics: a panic message still pending from queued work is dropped.
    fn drop(&mut self) {
        for tx in &self.queues {
            let _ = tx.send(Task::Stop);
        }
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

// ---- the pool ---------------------------------------------------------------------------------

/// The pool's memory: `len` f32 from a 64-byte aligned `base`, inside one zeroed allocation.
/// Shared by every queue thread, which read and write it through raw pointers; which ranges may
/// be accessed at once is the schedule's contract (see [`Views::buf_mut`]).
struct Arena {
    /// The allocation, from `Box::into_raw`; freed on drop.
    alloc: *mut [f32],
    base: *mut f32,
    len: usize,
}

// SAFETY: the arena owns its allocation (no thread-bound state); concurrent access to its
// elements is governed by the Device contract (disjoint or event-ordered ranges), not by Rust
// references held in the struct.
unsafe impl Send for Arena {}
// SAFETY: as for Send: shared `&Arena` only hands out raw-pointer-derived views under the
// Device contract.
unsafe impl Sync for Arena {}

impl Arena {
    fn new(len: usize) -> Self {
        // `vec![0.0; n]` allocates with calloc: untouched pages cost no resident memory.
        let alloc = Box::into_raw(vec![0.0f32; len + ALIGN_ELEMS - 1].into_boxed_slice());
        let first = alloc.cast::<f32>();
        let pad = first.align_offset(ALIGN_ELEMS * 4);
        assert!(pad < ALIGN_ELEMS, "cannot align the device pool");
        // SAFETY: pad + len <= len + ALIGN_ELEMS - 1, the allocation's length, so `base` and
        // `base + len` are in bounds of (or one past) the allocation.
        let base = unsafe { first.add(pad) };
        Arena { alloc, base, len }
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

    /// # Safety
    /// No write to any element of `b` may happen while the returned view is live.
    unsafe fn slice(&self, b: DevBuf) -> &[f32] {
        self.check(b);
        // SAFETY: `b` is in bounds (checked), the memory is initialised (zeroed at creation)
        // and, by the caller's contract, not written while the view lives.
        unsafe { std::slice::from_raw_parts(self.base.add(b.off), b.len) }
    }

    /// # Safety
    /// No other view of any element of `b` may be live while the returned one is.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, b: DevBuf) -> &mut [f32] {
        self.check(b);
        // SAFETY: `b` is in bounds (checked) and initialised; the caller guarantees exclusive
        // access for the view's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(b.off), b.len) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: `alloc` came from `Box::into_raw` in `Arena::new` and is freed only here; the
        // queue threads that used it have been joined (they hold the `Arc<Shared>` until then).
        drop(unsafe { Box::from_raw(self.alloc) });
    }
}

/// What kernels see: slices of the arena.
struct CpuViews<'a> {
    arena: &'a Arena,
    backend: CpuBackend,
}

impl Views<CpuBackend> for CpuViews<'_> {
    fn backend(&self) -> &CpuBackend {
        &self.backend
    }

    fn buf(&self, b: DevBuf) -> &[f32] {
        // SAFETY: the Device contract: no `buf_mut` view or copy writes `b` while work that
        // reads it runs (the plan's events order them).
        unsafe { self.arena.slice(b) }
    }

    fn ibuf(&self, b: DevBuf) -> &[i32] {
        let f = self.buf(b);
        // SAFETY: f32 and i32 have the same size and alignment and every bit pattern is a valid
        // i32, so the same bytes viewed as i32 are a valid, equally long, read-only slice.
        unsafe { std::slice::from_raw_parts(f.as_ptr().cast::<i32>(), f.len()) }
    }

    /// fp32 weights: the same view as [`Views::buf`].
    fn wbuf(&self, b: DevBuf) -> &[f32] {
        self.buf(b)
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn buf_mut(&self, b: DevBuf) -> &mut [f32] {
        // SAFETY: forwarded: the caller guarantees no other view of `b` is live.
        unsafe { self.arena.slice_mut(b) }
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn wbuf_mut(&self, b: DevBuf) -> &mut [f32] {
        // SAFETY: forwarded: the caller guarantees no other view of `b` is live.
        unsafe { self.arena.slice_mut(b) }
    }
}

// ---- the queues -------------------------------------------------------------------------------

/// One unit of queued work. `SpinWait` is a compute- or host-queue wait under
/// [`WaitMode::Spin`].
enum Task {
    Kernel(Kernel<CpuBackend>, Option<KernelTimer>),
    Host(HostWork),
    Upload { dst: DevBuf, src: HostPtr },
    UploadBf16 { dst: DevBuf, src: HostPtr<Bf16> },
    UploadI32 { dst: DevBuf, src: Arc<Vec<i32>> },
    Download { dst: HostPtrMut, src: DevBuf },
    DownloadBf16 { dst: HostPtrMut<Bf16>, src: DevBuf },
    Signal(Event),
    Wait(Event),
    SpinWait(Event),
    Stop,
}

/// State the device and its queue threads share.
struct Shared {
    arena: Arena,
    /// The kernels' own pool, as many threads as the global one: only the compute queue hands
    /// it work, so a spinning wait on it ([`WaitMode::Spin`]) can never sit inside another
    /// queue's job (the copies' bf16 passes and the gather run on the global pool).
    kernels: rayon::ThreadPool,
    /// The host queue's threads ([`Device::host_threads`]), kept spinning while it waits.
    host_threads: Mutex<Option<Arc<rayon::ThreadPool>>>,
    link_gbps: f64,
    counters: Mutex<Counters>,
    /// The first panic message from queued work since the last `synchronize`.
    first_panic: Mutex<Option<String>>,
}

struct Counters {
    /// Time each queue spent running tasks (not waiting on events), by [`Queue::index`].
    busy: [Duration; 4],
    h2d_bytes: u64,
    d2h_bytes: u64,
    /// Copies in progress, on either copy queue.
    active_copies: usize,
    /// When `active_copies` last went 0 -> 1.
    link_since: Instant,
    /// Total of the closed intervals with `active_copies > 0`.
    link_busy: Duration,
}

impl Counters {
    fn new() -> Self {
        Counters {
            busy: [Duration::ZERO; 4],
            h2d_bytes: 0,
            d2h_bytes: 0,
            active_copies: 0,
            link_since: Instant::now(),
            link_busy: Duration::ZERO,
        }
    }
}

impl Shared {
    fn counters(&self) -> MutexGuard<'_, Counters> {
        self.counters.lock().expect("CPU device counters lock poisoned")
    }

    fn run(&self, q: Queue, task: Task) {
        match task {
            Task::Kernel(k, timer) => {
                let t0 = Instant::now();
                self.kernels.install(|| k(&CpuViews { arena: &self.arena, backend: CpuBackend }));
                if let Some(timer) = timer {
                    timer(t0.elapsed());
                }
            }
            Task::Host(w) => w(),
            Task::Upload { dst, src } => self.copy(Queue::H2D, dst.bytes(), || {
                // SAFETY: `upload`'s caller keeps `src` alive and unwritten until this runs
                // (HostPtr's contract); the schedule guarantees no other view of `dst` is live.
                unsafe { self.arena.slice_mut(dst).copy_from_slice(src.as_slice()) }
            }),
            Task::UploadBf16 { dst, src } => self.copy(Queue::H2D, dst.len * 2, || {
                // SAFETY: as for Upload.
                unsafe { crate::bf16::expand_bf16(self.arena.slice_mut(dst), src.as_slice()) }
            }),
            Task::UploadI32 { dst, src } => self.copy(Queue::H2D, dst.bytes(), || {
                // SAFETY: the schedule guarantees no other view of `dst` is live.
                let dst = unsafe { self.arena.slice_mut(dst) };
                for (d, s) in dst.iter_mut().zip(src.iter()) {
                    *d = f32::from_bits(*s as u32);
                }
            }),
            Task::Download { dst, src } => self.copy(Queue::D2H, src.bytes(), || {
                // SAFETY: `download`'s caller gives this work exclusive use of `dst` until it
                // has run (HostPtrMut's contract); the schedule guarantees nothing writes `src`.
                unsafe { dst.as_mut_slice().copy_from_slice(self.arena.slice(src)) }
            }),
            Task::DownloadBf16 { dst, src } => self.copy(Queue::D2H, src.len * 2, || {
                // SAFETY: as for Download.
                unsafe { crate::bf16::round_to_bf16(dst.as_mut_slice(), self.arena.slice(src)) }
            }),
            Task::Signal(e) => e.signal(),
            Task::Wait(e) => e.wait_host(),
            Task::SpinWait(e) => self.spin_wait(q, &e),
            Task::Stop => unreachable!("Stop is handled by the worker loop"),
        }
    }

    /// Waits for `e` with the threads that run queue `q`'s work spinning ([`WaitMode::Spin`]):
    /// the kernels' pool for the compute queue, the registered host threads for the host queue
    /// (none registered: an ordinary wait). Each spinner yields its core to any other runnable
    /// thread, and returns after [`SPIN_TURN`] to be sent again: a pool that other code also
    /// uses (the host threads) never holds that code's job behind a spinner for longer.
    fn spin_wait(&self, q: Queue, e: &Event) {
        let host = match q {
            Queue::Host => self.host_threads.lock().expect("host threads lock poisoned").clone(),
            _ => None,
        };
        let pool = match (q, &host) {
            (Queue::Compute, _) => &self.kernels,
            (_, Some(pool)) => pool,
            (_, None) => return e.wait_host(),
        };
        while !e.is_done() {
            pool.broadcast(|_| {
                let turn = Instant::now();
                while !e.is_done() && turn.elapsed() < SPIN_TURN {
                    std::hint::spin_loop();
                    thread::yield_now();
                }
            });
        }
    }

    /// Runs the memcpy `f` of `bytes` on copy queue `q` as a simulated link transfer: the link
    /// counts as busy from start to end, and the copy lasts at least `bytes / bandwidth`.
    fn copy(&self, q: Queue, bytes: usize, f: impl FnOnce()) {
        let link = LinkUse::begin(self);
        f();
        if self.link_gbps > 0.0 {
            let until = link.start + Duration::from_secs_f64(bytes as f64 / (self.link_gbps * 1e9));
            loop {
                let now = Instant::now();
                if now >= until {
                    break;
                }
                if until - now > SPIN {
                    thread::sleep(until - now - SPIN);
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        drop(link);
        let mut c = self.counters();
        match q {
            Queue::H2D => c.h2d_bytes += bytes as u64,
            _ => c.d2h_bytes += bytes as u64,
        }
    }
}

/// One copy in progress, for `link_busy`. Ends on drop, so a panicking copy still ends it.
/// Both instants are taken under the counters' lock, so the union of intervals is exact.
struct LinkUse<'a> {
    shared: &'a Shared,
    start: Instant,
}

impl<'a> LinkUse<'a> {
    fn begin(shared: &'a Shared) -> Self {
        let mut c = shared.counters();
        let start = Instant::now();
        if c.active_copies == 0 {
            c.link_since = start;
        }
        c.active_copies += 1;
        LinkUse { shared, start }
    }
}

impl Drop for LinkUse<'_> {
    fn drop(&mut self) {
        // Not `counters()`: never panic in drop (possibly while unwinding).
        let mut c = match self.shared.counters.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        c.active_copies -= 1;
        if c.active_copies == 0 {
            let since = c.link_since;
            c.link_busy += since.elapsed();
        }
    }
}

/// The random delay before each copy: uniform in `0..=max_us` microseconds, from splitmix64.
struct Jitter {
    max_us: u64,
    state: u64,
}

impl Jitter {
    fn new(max_us: u64, seed: u64, q: Queue) -> Self {
        let stream = (q.index() as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03);
        Jitter { max_us, state: seed ^ stream }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn delay(&mut self) {
        if self.max_us > 0 {
            let us = self.next_u64() % (self.max_us + 1);
            thread::sleep(Duration::from_micros(us));
        }
    }
}

/// A queue's thread: runs tasks in order until `Stop`. Panics in tasks are caught and kept for
/// `synchronize`; the queue carries on.
fn worker(q: Queue, rx: &Receiver<Task>, shared: &Shared, mut jitter: Jitter) {
    for task in rx {
        let counts_busy = match &task {
            Task::Stop => break,
            Task::Signal(_) | Task::Wait(_) | Task::SpinWait(_) => false,
            Task::Upload { .. }
            | Task::UploadBf16 { .. }
            | Task::UploadI32 { .. }
            | Task::Download { .. }
            | Task::DownloadBf16 { .. } => {
                jitter.delay();
                true
            }
            Task::Kernel(..) | Task::Host(_) => true,
        };
        let start = Instant::now();
        let result = panic::catch_unwind(AssertUnwindSafe(|| shared.run(q, task)));
        if counts_busy {
            let took = start.elapsed();
            shared.counters().busy[q.index()] += took;
        }
        if let Err(payload) = result {
            let msg = if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "(a non-string panic payload)".to_string()
            };
            let mut first = match shared.first_panic.lock() {
                Ok(first) => first,
                Err(poisoned) => poisoned.into_inner(),
            };
            first.get_or_insert_with(|| format!("{msg} (on the {q:?} queue)"));
        }
    }
}
