//! An owned, block-aligned byte buffer that moves between the protocol layer and the disk.
//!
//! O_DIRECT needs buffers aligned to the logical block of the device and io_uring needs buffers
//! that stay put while the kernel owns them. `AlignedBuf` is both: a heap allocation aligned to
//! [`BUFFER_ALIGNMENT_BYTES`] whose address never changes. `nvmf` fills it with write data from the
//! socket and `io` hands the same allocation to the kernel, so data is copied only by the kernel.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;

/// Alignment of every buffer: the block size, which satisfies O_DIRECT on any common device.
pub const BUFFER_ALIGNMENT_BYTES: usize = crate::BLOCK_SIZE_BYTES as usize;

/// A heap buffer of fixed capacity, aligned to [`BUFFER_ALIGNMENT_BYTES`], with a length that may
/// be set anywhere within the capacity. New buffers are zeroed.
pub struct AlignedBuf {
    pointer: NonNull<u8>,
    capacity: usize,
    length: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out &[u8], like a Vec<u8>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `capacity` bytes (rounded up to the alignment) and length `capacity`.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1).next_multiple_of(BUFFER_ALIGNMENT_BYTES);
        let layout = Self::layout(capacity);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(pointer) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        Self { pointer, capacity, length: capacity }
    }

    fn layout(capacity: usize) -> Layout {
        Layout::from_size_align(capacity, BUFFER_ALIGNMENT_BYTES).expect("buffer layout is valid")
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.length
    }

    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// Sets the length; the bytes up to it keep whatever they held before.
    pub fn set_len(&mut self, length: usize) {
        assert!(length <= self.capacity, "length {length} over capacity {}", self.capacity);
        self.length = length;
    }

    /// A raw pointer for handing the buffer to the kernel; valid while `self` lives and unmoved
    /// heap memory, even if `self` itself moves.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pointer.as_ptr()
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.pointer.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the allocation holds `capacity >= length` initialised (zeroed at first) bytes.
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.length) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.pointer.as_ptr(), self.length) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this same layout.
        unsafe { alloc::dealloc(self.pointer.as_ptr(), Self::layout(self.capacity)) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("capacity", &self.capacity)
            .field("len", &self.length)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_resizable() {
        let mut buffer = AlignedBuf::new(5000);
        assert_eq!(buffer.capacity(), 8192);
        assert_eq!(buffer.as_ptr() as usize % BUFFER_ALIGNMENT_BYTES, 0);
        assert!(buffer.iter().all(|b| *b == 0));
        buffer[0] = 7;
        buffer.set_len(4096);
        assert_eq!(buffer.len(), 4096);
        assert_eq!(buffer[0], 7);
    }

    #[test]
    #[should_panic(expected = "over capacity")]
    fn length_bounded_by_capacity() {
        AlignedBuf::new(4096).set_len(4097);
    }
}
