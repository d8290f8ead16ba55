//! Hot path. A handle's spare buffers, so forming and writing a batch neither allocates nor
//! zeroes memory once the handle is warm.
//!
//! Every buffer in the pool has the same capacity (a whole batch of data plus its header), so a
//! batch's data and any one drive's share of a batch fit any of them. The pool is per handle
//! (one thread), hence a `RefCell` and no lock.

use std::cell::RefCell;

use types::AlignedBuf;

/// Spare buffers a handle keeps: one per batch that may be queued, one per drive write of the
/// batch being committed, and a few for GC. Buffers beyond it are freed.
pub(super) const SPARE_BUFFERS_MAX: usize = 32;

/// Spare, equally sized, block-aligned buffers.
#[derive(Debug)]
pub(super) struct BufferPool {
    spare: RefCell<Vec<AlignedBuf>>,
    capacity_bytes: usize,
}

impl BufferPool {
    pub(super) fn new(capacity_bytes: usize) -> Self {
        assert!(capacity_bytes > 0);
        Self { spare: RefCell::new(Vec::with_capacity(SPARE_BUFFERS_MAX)), capacity_bytes }
    }

    /// A buffer of length `length_bytes`. Its bytes are whatever a previous user left (zeros
    /// when newly allocated): callers overwrite what they use. Lengths above the pool's size
    /// (checkpoints, whole-segment writes) get a buffer of their own.
    pub(super) fn take(&self, length_bytes: usize) -> AlignedBuf {
        if length_bytes > self.capacity_bytes {
            return AlignedBuf::new(length_bytes);
        }
        let mut buf =
            self.spare.borrow_mut().pop().unwrap_or_else(|| AlignedBuf::new(self.capacity_bytes));
        buf.set_len(length_bytes);
        buf
    }

    /// Returns a buffer for reuse; buffers of another size, or beyond the bound, are freed.
    pub(super) fn give(&self, buf: AlignedBuf) {
        let mut spare = self.spare.borrow_mut();
        if buf.capacity() == self.capacity_bytes && spare.len() < SPARE_BUFFERS_MAX {
            spare.push(buf);
        }
    }

    #[cfg(test)]
    pub(super) fn spare_count(&self) -> usize {
        self.spare.borrow().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_the_pool_stays_bounded() {
        let pool = BufferPool::new(8192);
        let mut first = pool.take(4096);
        assert_eq!(first.len(), 4096);
        first[0] = 7;
        let address = first.as_ptr();
        pool.give(first);
        let again = pool.take(8192);
        assert_eq!(again.as_ptr(), address, "the spare buffer is handed out again");
        assert_eq!(again.len(), 8192);
        pool.give(AlignedBuf::new(4096));
        assert_eq!(pool.spare_count(), 0, "a buffer of another size is not kept");
        let large = pool.take(3 * 4096);
        assert_eq!(large.len(), 3 * 4096, "a larger request gets its own buffer");
        pool.give(large);
        assert_eq!(pool.spare_count(), 0);
        for _ in 0..SPARE_BUFFERS_MAX + 5 {
            pool.give(AlignedBuf::new(8192));
        }
        assert_eq!(pool.spare_count(), SPARE_BUFFERS_MAX);
    }
}
