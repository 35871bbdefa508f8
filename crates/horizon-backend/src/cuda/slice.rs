//! [`DevSlice`]: a view of device memory that Rust holds like a slice (`&DevSlice<f32>`,
//! `&mut DevSlice<f32>`), so the model code generic over `Backend::Buf` runs unchanged.
//!
//! `&DevSlice<T>` is a fat pointer whose address is the device address and whose length is the
//! element count. Its elements are zero-sized, so the reference covers no host bytes: it is
//! valid for any non-null address, is never dereferenced on the host, and two of them never
//! alias host memory. Sub-views compute their address by integer arithmetic (a zero-sized
//! element would not advance a pointer).

use std::marker::PhantomData;
use std::ops::Range;

use crate::DeviceSlice;

/// `len` elements of `T` (f32 or i32) in device memory.
#[repr(transparent)]
pub struct DevSlice<T> {
    elems: [PhantomData<T>],
}

impl<T> DevSlice<T> {
    /// # Safety
    /// `addr .. addr + len * size_of::<T>()` must lie in device memory that outlives `'a`;
    /// `addr` must be non-zero.
    pub unsafe fn from_raw<'a>(addr: u64, len: usize) -> &'a Self {
        let p = std::ptr::without_provenance::<PhantomData<T>>(addr as usize);
        // SAFETY: a slice of zero-sized elements is valid for any non-null, aligned (align 1)
        // address; `DevSlice<T>` is a transparent wrapper of that slice.
        unsafe { &*(std::ptr::slice_from_raw_parts(p, len) as *const DevSlice<T>) }
    }

    /// # Safety
    /// As [`DevSlice::from_raw`]; in addition no other view of these elements may be used
    /// while the returned one is (the kernels' write contract).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn from_raw_mut<'a>(addr: u64, len: usize) -> &'a mut Self {
        let p = std::ptr::without_provenance_mut::<PhantomData<T>>(addr as usize);
        // SAFETY: as in `from_raw`; zero-sized elements cover no bytes, so the mutable
        // reference aliases nothing on the host.
        unsafe { &mut *(std::ptr::slice_from_raw_parts_mut(p, len) as *mut DevSlice<T>) }
    }

    /// The device address of the first element.
    pub fn addr(&self) -> u64 {
        self.elems.as_ptr().addr() as u64
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.elems.len()
    }

    /// True when the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.elems.is_empty()
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len() * size_of::<T>()
    }

    fn check(&self, r: &Range<usize>) {
        assert!(
            r.start <= r.end && r.end <= self.len(),
            "DevSlice: range {r:?} out of 0..{}",
            self.len()
        );
    }
}

impl<T> DeviceSlice for DevSlice<T> {
    fn len(&self) -> usize {
        self.elems.len()
    }
    fn slice(&self, r: Range<usize>) -> &Self {
        self.check(&r);
        let addr = self.addr() + (r.start * size_of::<T>()) as u64;
        // SAFETY: a sub-range of this view's memory, checked above, for the same lifetime.
        unsafe { DevSlice::from_raw(addr, r.end - r.start) }
    }
    fn slice_mut(&mut self, r: Range<usize>) -> &mut Self {
        self.check(&r);
        let addr = self.addr() + (r.start * size_of::<T>()) as u64;
        // SAFETY: a sub-range of this exclusively borrowed view, checked above.
        unsafe { DevSlice::from_raw_mut(addr, r.end - r.start) }
    }
    fn split_at_mut(&mut self, mid: usize) -> (&mut Self, &mut Self) {
        self.check(&(0..mid));
        let (addr, len) = (self.addr(), self.len());
        let second = addr + (mid * size_of::<T>()) as u64;
        // SAFETY: two disjoint sub-ranges of this exclusively borrowed view.
        unsafe { (DevSlice::from_raw_mut(addr, mid), DevSlice::from_raw_mut(second, len - mid)) }
    }
}
