//! A per-queue pool of aligned data buffers, so that steady-state I/O allocates nothing.
//!
//! Hot path. Buffers come in power-of-two size classes from 4 KiB to the largest transfer
//! (1 MiB). A command takes the smallest class that holds its data; the buffer travels to the
//! driver inside a storage request and comes back with its completion. The pool keeps at most
//! `retained_bytes_max` bytes of idle buffers and at most one queue's worth per class; beyond that
//! a returned buffer is freed. Buffers in flight are bounded by the queue depth, not by the pool.

use types::AlignedBuf;

use super::{QUEUE_ENTRIES_MAX, TRANSFER_BYTES_MAX};

/// The smallest buffer size.
const CLASS_BYTES_MIN: usize = 4096;
/// Size classes: 4 KiB << 0..=8, up to 1 MiB.
const CLASS_COUNT: usize = 9;

const _: () = assert!(CLASS_BYTES_MIN << (CLASS_COUNT - 1) == TRANSFER_BYTES_MAX as usize);

pub(crate) struct BufferPool {
    classes: [Vec<AlignedBuf>; CLASS_COUNT],
    retained_bytes: usize,
    retained_bytes_max: usize,
}

impl BufferPool {
    pub(crate) fn new(retained_bytes_max: usize) -> Self {
        Self {
            classes: std::array::from_fn(|_| Vec::with_capacity(usize::from(QUEUE_ENTRIES_MAX))),
            retained_bytes: 0,
            retained_bytes_max,
        }
    }

    fn class_of(length_bytes: usize) -> usize {
        assert!(length_bytes <= TRANSFER_BYTES_MAX as usize, "{length_bytes} bytes over the limit");
        let blocks = length_bytes.max(1).div_ceil(CLASS_BYTES_MIN);
        blocks.next_power_of_two().trailing_zeros() as usize
    }

    /// A buffer of exactly `length_bytes` (at most the largest transfer); its contents are
    /// whatever a previous user left, or zeros.
    pub(crate) fn take(&mut self, length_bytes: usize) -> AlignedBuf {
        let class = Self::class_of(length_bytes);
        let mut buffer = match self.classes[class].pop() {
            Some(buffer) => {
                self.retained_bytes -= buffer.capacity();
                buffer
            }
            None => AlignedBuf::new(CLASS_BYTES_MIN << class),
        };
        buffer.set_len(length_bytes);
        buffer
    }

    /// Returns a buffer to the pool, or frees it if the pool is full or the buffer is not one of
    /// the pool's sizes.
    pub(crate) fn give(&mut self, buffer: AlignedBuf) {
        let capacity = buffer.capacity();
        if capacity < CLASS_BYTES_MIN || !capacity.is_power_of_two() {
            return;
        }
        let class = (capacity / CLASS_BYTES_MIN).trailing_zeros() as usize;
        if class >= CLASS_COUNT {
            return;
        }
        let list = &mut self.classes[class];
        if list.len() < list.capacity() && self.retained_bytes + capacity <= self.retained_bytes_max
        {
            self.retained_bytes += capacity;
            list.push(buffer);
        }
    }

    #[cfg(test)]
    pub(crate) fn retained_bytes(&self) -> usize {
        self.retained_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_and_reuse() {
        assert_eq!(BufferPool::class_of(0), 0);
        assert_eq!(BufferPool::class_of(4096), 0);
        assert_eq!(BufferPool::class_of(4097), 1);
        assert_eq!(BufferPool::class_of(1 << 20), 8);
        let mut pool = BufferPool::new(64 << 10);
        let buffer = pool.take(12288);
        assert_eq!((buffer.len(), buffer.capacity()), (12288, 16384));
        let address = buffer.as_ptr();
        pool.give(buffer);
        assert_eq!(pool.retained_bytes(), 16384);
        let again = pool.take(9000);
        assert_eq!(again.as_ptr(), address, "the same allocation comes back");
        assert_eq!(pool.retained_bytes(), 0);
        // Over the retention bound: freed, not kept.
        pool.give(AlignedBuf::new(1 << 20));
        assert_eq!(pool.retained_bytes(), 0);
        // Odd sizes are not the pool's.
        pool.give(AlignedBuf::new(12288));
        assert_eq!(pool.retained_bytes(), 0);
    }
}
