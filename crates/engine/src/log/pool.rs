//! Hot path. A handle's spare buffers, so that forming and writing batches and reading blocks
//! neither allocate nor zero memory once the handle is warm.
//!
//! Two kinds of buffer. Batch buffers all have one capacity (a whole batch of data plus its
//! header), so a batch's data and any one drive's share of it fit any of them. Small buffers,
//! for reads (one block, or a run of back-to-back blocks) and other short I/O, come in
//! power-of-two classes of 1 to [`SMALL_BLOCKS_MAX`] blocks: a one-block read must not take
//! (and, when the spares run out, allocate and zero) a half-megabyte batch buffer. The pool is
//! per handle (one thread), hence `RefCell`s and no lock.

use std::cell::RefCell;

use types::AlignedBuf;

use super::format::BLOCK_BYTES;

/// Spare batch buffers a handle keeps: one per batch that may be queued, one per drive write of
/// the batch being committed, and a few for GC. Buffers beyond it are freed.
pub(super) const SPARE_BUFFERS_MAX: usize = 32;
/// Blocks of the largest small class: the longest read run.
pub(super) const SMALL_BLOCKS_MAX: usize = super::engine::READ_RUN_BLOCKS_MAX;
/// Small classes: 1, 2, 4, ... [`SMALL_BLOCKS_MAX`] blocks.
const SMALL_CLASSES: usize = SMALL_BLOCKS_MAX.trailing_zeros() as usize + 1;
/// Bytes of spare buffers each small class keeps (1,024 one-block buffers: a full queue of
/// fragmented 32 KiB reads); buffers beyond it are freed.
const SMALL_CLASS_RETAINED_BYTES_MAX: usize = 4 << 20;

const _: () = assert!(SMALL_BLOCKS_MAX.is_power_of_two());
const _: () = assert!(BLOCK_BYTES << (SMALL_CLASSES - 1) == SMALL_BLOCKS_MAX * BLOCK_BYTES);

/// Spare, block-aligned buffers: batch buffers of one capacity and small ones by class.
#[derive(Debug)]
pub(super) struct BufferPool {
    batch: RefCell<Vec<AlignedBuf>>,
    small: RefCell<[Vec<AlignedBuf>; SMALL_CLASSES]>,
    capacity_bytes: usize,
}

/// The small class that holds `length_bytes`, if one does.
fn small_class(length_bytes: usize) -> Option<usize> {
    let blocks = length_bytes.max(1).div_ceil(BLOCK_BYTES);
    (blocks <= SMALL_BLOCKS_MAX).then(|| blocks.next_power_of_two().trailing_zeros() as usize)
}

impl BufferPool {
    /// A pool whose batch buffers hold `capacity_bytes`.
    pub(super) fn new(capacity_bytes: usize) -> Self {
        assert!(capacity_bytes > 0);
        Self {
            batch: RefCell::new(Vec::with_capacity(SPARE_BUFFERS_MAX)),
            small: RefCell::new(std::array::from_fn(|_| Vec::new())),
            capacity_bytes,
        }
    }

    /// A buffer of length `length_bytes`. Its bytes are whatever a previous user left (zeros
    /// when newly allocated): callers overwrite what they use. Up to [`SMALL_BLOCKS_MAX`] blocks
    /// it is a small buffer, up to the batch capacity a batch buffer; longer ones (checkpoints,
    /// whole-segment writes) get a buffer of their own.
    pub(super) fn take(&self, length_bytes: usize) -> AlignedBuf {
        let mut buf = if let Some(class) = small_class(length_bytes) {
            let spare = self.small.borrow_mut()[class].pop();
            spare.unwrap_or_else(|| AlignedBuf::new(BLOCK_BYTES << class))
        } else if length_bytes <= self.capacity_bytes {
            let spare = self.batch.borrow_mut().pop();
            spare.unwrap_or_else(|| AlignedBuf::new(self.capacity_bytes))
        } else {
            return AlignedBuf::new(length_bytes);
        };
        buf.set_len(length_bytes);
        buf
    }

    /// Returns a buffer for reuse; buffers of another size, or beyond the bounds, are freed.
    pub(super) fn give(&self, buf: AlignedBuf) {
        let capacity = buf.capacity();
        match small_class(capacity) {
            Some(class) if BLOCK_BYTES << class == capacity => {
                let mut small = self.small.borrow_mut();
                if (small[class].len() + 1) * capacity <= SMALL_CLASS_RETAINED_BYTES_MAX {
                    small[class].push(buf);
                }
            }
            _ if capacity == self.capacity_bytes => {
                let mut batch = self.batch.borrow_mut();
                if batch.len() < SPARE_BUFFERS_MAX {
                    batch.push(buf);
                }
            }
            _ => {}
        }
    }

    #[cfg(test)]
    pub(super) fn spare_count(&self) -> usize {
        self.batch.borrow().len() + self.small.borrow().iter().map(Vec::len).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BATCH: usize = 100 * BLOCK_BYTES;

    #[test]
    fn batch_buffers_are_reused_and_the_pool_stays_bounded() {
        let pool = BufferPool::new(BATCH);
        let mut first = pool.take(BATCH);
        assert_eq!(first.len(), BATCH);
        first[0] = 7;
        let address = first.as_ptr();
        pool.give(first);
        let again = pool.take(80 * BLOCK_BYTES);
        assert_eq!(again.as_ptr(), address, "the spare buffer is handed out again");
        assert_eq!(again.len(), 80 * BLOCK_BYTES);
        pool.give(again);
        pool.give(AlignedBuf::new(3 * BLOCK_BYTES));
        assert_eq!(pool.spare_count(), 1, "a buffer of no class is not kept");
        let large = pool.take(BATCH + BLOCK_BYTES);
        assert_eq!(large.len(), BATCH + BLOCK_BYTES, "a larger request gets its own buffer");
        pool.give(large);
        assert_eq!(pool.spare_count(), 1);
        for _ in 0..SPARE_BUFFERS_MAX + 5 {
            pool.give(AlignedBuf::new(BATCH));
        }
        assert_eq!(pool.spare_count(), SPARE_BUFFERS_MAX);
    }

    #[test]
    fn short_buffers_come_from_their_own_classes() {
        let pool = BufferPool::new(BATCH);
        let block = pool.take(BLOCK_BYTES);
        assert_eq!((block.len(), block.capacity()), (BLOCK_BYTES, BLOCK_BYTES));
        let run = pool.take(3 * BLOCK_BYTES);
        assert_eq!((run.len(), run.capacity()), (3 * BLOCK_BYTES, 4 * BLOCK_BYTES));
        let longest = pool.take(SMALL_BLOCKS_MAX * BLOCK_BYTES);
        assert_eq!(longest.capacity(), SMALL_BLOCKS_MAX * BLOCK_BYTES);
        let address = block.as_ptr();
        pool.give(block);
        pool.give(run);
        pool.give(longest);
        assert_eq!(pool.spare_count(), 3);
        assert_eq!(pool.take(BLOCK_BYTES).as_ptr(), address, "the block buffer is reused");
        // Each class keeps a bounded number of bytes.
        for _ in 0..(SMALL_CLASS_RETAINED_BYTES_MAX / BLOCK_BYTES) + 10 {
            pool.give(AlignedBuf::new(BLOCK_BYTES));
        }
        assert_eq!(
            pool.small.borrow()[0].len(),
            SMALL_CLASS_RETAINED_BYTES_MAX / BLOCK_BYTES,
            "one-block spares are bounded"
        );
    }

    #[test]
    fn a_pool_of_block_sized_batches_shares_the_small_class() {
        let pool = BufferPool::new(BLOCK_BYTES);
        let header = pool.take(BLOCK_BYTES);
        let address = header.as_ptr();
        pool.give(header);
        assert_eq!(pool.take(BLOCK_BYTES).as_ptr(), address);
    }
}
