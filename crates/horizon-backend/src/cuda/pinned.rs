//! Page-locked host memory (`cuMemHostAlloc` with flags 0: cached, not write-combined, which
//! the CPU could barely read), the device's staging buffers. When the driver cannot pin the
//! memory, the buffer falls back to ordinary memory (copies still work, without overlap).
//!
//! Every buffer is pinned at its exact size, `len * size_of::<T>()` bytes: no size classes, no
//! rounding up (page-locked memory is taken from the machine's RAM for good, and the plan counts
//! it to the byte). Each one is counted in its device's [`PinnedTally`] while it lives, as is
//! each range of memory allocated elsewhere and page-locked in place ([`Registered`]:
//! `cuMemHostRegister`).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::{CudaContext, result as cu};

/// `len` zeroed elements of `T` in page-locked host memory (or plain memory, see the module):
/// the staging type of [`super::CudaDevice`].
pub struct Pinned<T: Copy + Default> {
    ptr: *mut T,
    len: usize,
    /// `Some` when the memory is page-locked (freed with cuMemFreeHost, and counted in the
    /// tally until then); `None`: a leaked `Box<[T]>` freed as such.
    ctx: Option<(Arc<CudaContext>, Arc<PinnedTally>)>,
}

/// Bytes of page-locked memory a device holds: live now, and the most live at once.
#[derive(Debug, Default)]
pub struct PinnedTally {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl PinnedTally {
    /// Bytes pinned now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    /// The most bytes pinned at once so far.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Acquire)
    }

    fn add(&self, bytes: usize) {
        let now = self.live.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(now, Ordering::AcqRel);
    }

    fn sub(&self, bytes: usize) {
        self.live.fetch_sub(bytes, Ordering::AcqRel);
    }
}

// SAFETY: the buffer owns its memory like a Box<[T]>; access goes through &self / &mut self.
unsafe impl<T: Copy + Default + Send> Send for Pinned<T> {}
// SAFETY: shared access only hands out `&[T]`.
unsafe impl<T: Copy + Default + Sync> Sync for Pinned<T> {}

impl<T: Copy + Default> Pinned<T> {
    /// Pins exactly `len` elements, counted in `tally`; falls back to plain memory (with a
    /// warning, not counted) if the driver refuses.
    pub fn new(ctx: &Arc<CudaContext>, tally: &Arc<PinnedTally>, len: usize) -> Self {
        let bytes = len * size_of::<T>();
        if bytes > 0 && ctx.bind_to_thread().is_ok() {
            // SAFETY: a plain allocation of `bytes` bytes, flags 0 (portable to the context,
            // cached); initialised below before any read.
            if let Ok(p) = unsafe { cu::malloc_host(bytes, 0) } {
                let ptr = p.cast::<T>();
                // SAFETY: `ptr` is `len` writable, suitably aligned (page-aligned) elements.
                unsafe { std::slice::from_raw_parts_mut(ptr, len).fill(T::default()) };
                tally.add(bytes);
                return Pinned { ptr, len, ctx: Some((ctx.clone(), tally.clone())) };
            }
            eprintln!(
                "warning: cannot page-lock {bytes} bytes of host staging memory; using plain \
                 memory (transfers will not overlap)"
            );
        }
        let b = vec![T::default(); len].into_boxed_slice();
        Pinned { ptr: Box::into_raw(b).cast::<T>(), len, ctx: None }
    }

    /// True when the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.ctx.is_some()
    }
}

impl<T: Copy + Default> Deref for Pinned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements for the buffer's life.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: Copy + Default> DerefMut for Pinned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, borrowed exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy + Default> Drop for Pinned<T> {
    fn drop(&mut self) {
        match &self.ctx {
            Some((ctx, tally)) => {
                let _ = ctx.bind_to_thread();
                // SAFETY: allocated by cuMemHostAlloc in `new`, freed only here.
                let _ = unsafe { cu::free_host(self.ptr.cast()) };
                tally.sub(self.len * size_of::<T>());
            }
            None => {
                let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, self.len);
                // SAFETY: from `Box::into_raw` of a boxed slice of `len` in `new`.
                drop(unsafe { Box::from_raw(slice) });
            }
        }
    }
}

/// Host memory allocated elsewhere, page-locked in place (`cuMemHostRegister`, flags 0) while
/// this guard lives and counted in the device's [`PinnedTally`] at its exact size; the
/// registration of [`crate::Device::pin_host`]. When the driver refuses, the memory stays
/// pageable (with a warning, not counted): copies still work, at the pageable rate.
pub struct Registered {
    ptr: *mut std::ffi::c_void,
    bytes: usize,
    ctx: Option<(Arc<CudaContext>, Arc<PinnedTally>)>,
}

// SAFETY: the guard holds only the address to unregister; it never reads or writes the memory.
unsafe impl Send for Registered {}
// SAFETY: as above; `&Registered` exposes nothing.
unsafe impl Sync for Registered {}

impl Registered {
    /// # Safety
    /// `buf` must stay allocated, at its address, until the guard is dropped.
    pub unsafe fn new(ctx: &Arc<CudaContext>, tally: &Arc<PinnedTally>, buf: &mut [f32]) -> Self {
        let (ptr, bytes) = (buf.as_mut_ptr().cast::<std::ffi::c_void>(), size_of_val(buf));
        let mut pinned = None;
        if bytes > 0 && ctx.bind_to_thread().is_ok() {
            // SAFETY: `buf` is `bytes` bytes of live host memory that the caller keeps in place
            // while the guard lives; flags 0 (portable to the context, not mapped).
            let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr, bytes, 0) };
            if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                tally.add(bytes);
                pinned = Some((ctx.clone(), tally.clone()));
            } else {
                eprintln!(
                    "warning: cannot page-lock {bytes} bytes of host memory ({r:?}); its \
                     copies run at the pageable rate"
                );
            }
        }
        Registered { ptr, bytes, ctx: pinned }
    }

    /// True when the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.ctx.is_some()
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some((ctx, tally)) = &self.ctx {
            let _ = ctx.bind_to_thread();
            // SAFETY: registered in `new` at this address, unregistered only here, while the
            // memory is still allocated (the caller's contract).
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr) };
            tally.sub(self.bytes);
        }
    }
}
