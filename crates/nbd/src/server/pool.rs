//! A per-connection pool of aligned data buffers, so that steady-state I/O allocates nothing.
//!
//! Hot path. Buffers come in power-of-two size classes from one block (4 KiB) to the largest
//! payload (32 MiB). A request takes the smallest class that holds its data; the buffer travels to
//! the driver inside the request and comes back with its completion. The pool keeps at most
//! `retained_bytes_max` bytes of idle buffers and at most one connection's worth of requests per
//! class; beyond that a returned buffer is freed. Buffers in flight are bounded by the
//! connection's in-flight limits, not by the pool.

use types::AlignedBuf;

use super::{INFLIGHT_REQUESTS_MAX, PAYLOAD_BYTES_MAX};

/// The smallest buffer size: one block.
const CLASS_BYTES_MIN: usize = types::BLOCK_SIZE_BYTES as usize;
/// Size classes: 4 KiB << 0..=13, up to 32 MiB.
const CLASS_COUNT: usize = 14;

const _: () = assert!(CLASS_BYTES_MIN << (CLASS_COUNT - 1) == PAYLOAD_BYTES_MAX as usize);

pub(crate) struct BufferPool {
    classes: [Vec<AlignedBuf>; CLASS_COUNT],
    retained_bytes: usize,
    retained_bytes_max: usize,
}

impl BufferPool {
    pub(crate) fn new(retained_bytes_max: usize) -> Self {
        Self { classes: std::array::from_fn(|_| Vec::new()), retained_bytes: 0, retained_bytes_max }
    }

    fn class_of(length_bytes: usize) -> usize {
        assert!(length_bytes <= PAYLOAD_BYTES_MAX as usize, "{length_bytes} bytes over the limit");
        let blocks = length_bytes.max(1).div_ceil(CLASS_BYTES_MIN);
        blocks.next_power_of_two().trailing_zeros() as usize
    }

    /// A buffer of exactly `length_bytes` (at most the largest payload); its contents are
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
        if capacity < CLASS_BYTES_MIN
            || capacity > PAYLOAD_BYTES_MAX as usize
            || !capacity.is_power_of_two()
        {
            return;
        }
        let class = Self::class_of(capacity);
        if self.retained_bytes + capacity > self.retained_bytes_max
            || self.classes[class].len() >= INFLIGHT_REQUESTS_MAX
        {
            return;
        }
        self.retained_bytes += capacity;
        self.classes[class].push(buffer);
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
    fn classes_cover_every_length() {
        assert_eq!(BufferPool::class_of(1), 0);
        assert_eq!(BufferPool::class_of(4096), 0);
        assert_eq!(BufferPool::class_of(4097), 1);
        assert_eq!(BufferPool::class_of(PAYLOAD_BYTES_MAX as usize), CLASS_COUNT - 1);
    }

    #[test]
    fn reuses_and_bounds_retained_bytes() {
        let mut pool = BufferPool::new(64 * 1024);
        let buffer = pool.take(12 * 1024);
        assert_eq!(buffer.len(), 12 * 1024);
        assert_eq!(buffer.capacity(), 16 * 1024);
        let address = buffer.as_ptr();
        pool.give(buffer);
        assert_eq!(pool.retained_bytes(), 16 * 1024);
        let again = pool.take(9 * 1024);
        assert_eq!(again.as_ptr(), address);
        assert_eq!(pool.retained_bytes(), 0);
        pool.give(again);
        // 128 KiB does not fit in a 64 KiB pool: freed, not kept.
        pool.give(AlignedBuf::new(128 * 1024));
        assert_eq!(pool.retained_bytes(), 16 * 1024);
        // A size that is not a class is freed too.
        pool.give(AlignedBuf::new(12 * 1024));
        assert_eq!(pool.retained_bytes(), 16 * 1024);
    }
}
