//! Page-locked host memory (`cuMemHostAlloc` with flags 0: cached, not write-combined, which
//! the CPU could barely read), the device's staging buffers. When the driver cannot pin the
//! memory, the buffer falls back to ordinary memory (copies still work, without overlap).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use cudarc::driver::{CudaContext, result as cu};

/// `len` zeroed elements of `T` in page-locked host memory (or plain memory, see the module):
/// the staging type of [`super::CudaDevice`].
pub struct Pinned<T: Copy + Default> {
    ptr: *mut T,
    len: usize,
    /// `Some` when the memory is page-locked (freed with cuMemFreeHost); `None`: a leaked
    /// `Box<[T]>` freed as such.
    ctx: Option<Arc<CudaContext>>,
}

// SAFETY: the buffer owns its memory like a Box<[T]>; access goes through &self / &mut self.
unsafe impl<T: Copy + Default + Send> Send for Pinned<T> {}
// SAFETY: shared access only hands out `&[T]`.
unsafe impl<T: Copy + Default + Sync> Sync for Pinned<T> {}

impl<T: Copy + Default> Pinned<T> {
    /// Pins `len` elements; falls back to plain memory (with a warning) if the driver refuses.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Self {
        let bytes = len * size_of::<T>();
        if bytes > 0 && ctx.bind_to_thread().is_ok() {
            // SAFETY: a plain allocation of `bytes` bytes, flags 0 (portable to the context,
            // cached); initialised below before any read.
            if let Ok(p) = unsafe { cu::malloc_host(bytes, 0) } {
                let ptr = p.cast::<T>();
                // SAFETY: `ptr` is `len` writable, suitably aligned (page-aligned) elements.
                unsafe { std::slice::from_raw_parts_mut(ptr, len).fill(T::default()) };
                return Pinned { ptr, len, ctx: Some(ctx.clone()) };
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
            Some(ctx) => {
                let _ = ctx.bind_to_thread();
                // SAFETY: allocated by cuMemHostAlloc in `new`, freed only here.
                let _ = unsafe { cu::free_host(self.ptr.cast()) };
            }
            None => {
                let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, self.len);
                // SAFETY: from `Box::into_raw` of a boxed slice of `len` in `new`.
                drop(unsafe { Box::from_raw(slice) });
            }
        }
    }
}
