//! The segment table: what each segment is used for, its sequence number, and how many live
//! blocks it holds (the GC's live-byte accounting). Shared by every data-path thread: counters
//! are atomics updated on every install; the free list takes a lock only when a segment is
//! allocated or freed (once per segment, not per I/O).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

/// What a segment holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentState {
    Free = 0,
    /// A thread is appending batches to it.
    Open = 1,
    /// Full (or abandoned by recovery); immutable until GC frees it.
    Sealed = 2,
    /// Holds blocks of the current (or the next) checkpoint.
    Checkpoint = 3,
    /// GC is relocating its live blocks.
    Cleaning = 4,
}

impl SegmentState {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Free,
            1 => Self::Open,
            2 => Self::Sealed,
            3 => Self::Checkpoint,
            4 => Self::Cleaning,
            other => unreachable!("segment state {other} is never stored"),
        }
    }
}

#[derive(Debug)]
pub struct SegmentTable {
    states: Box<[AtomicU8]>,
    /// The sequence number given when the segment was last opened for batches.
    seqs: Box<[AtomicU64]>,
    live_blocks: Box<[AtomicU32]>,
    /// The highest LSN of a batch in the segment: its age for GC.
    lsn_max: Box<[AtomicU64]>,
    /// Free segments, highest index first, so allocation takes the lowest.
    free: Mutex<Vec<u32>>,
    free_count: AtomicU32,
    /// Coded logs: the end (in positions) of the last write completed in the segment since it
    /// was allocated; a drive rebuild copies stripes below it.
    written: Box<[AtomicU32]>,
    /// Coded logs: whether every cell of the segment is valid on a drive being rebuilt (it was
    /// allocated, or rebuilt, since the rebuild started).
    rebuilt: Box<[AtomicBool]>,
    /// A segment a drive rebuild is copying, which allocation skips (`NONE_PINNED` if none), so
    /// the rebuild never writes a stale cell into a segment reused meanwhile.
    pinned: AtomicU32,
    /// A free segment being laid out (`Drive::fill_holes`), which allocation skips
    /// (`NONE_PINNED` if none): a write landing in one of its holes meanwhile could be
    /// overwritten with zeros.
    laying_out: AtomicU32,
    /// Whether the segment's unit on every drive is known to have no holes (laid out, or found
    /// so), in this run: the lay-out skips it. Never cleared: nothing punches a hole after the
    /// log is formatted.
    laid_out: Box<[AtomicBool]>,
    /// One bit per position, set where a batch header was written since the segment was
    /// allocated in this run (`header_words` words per segment), so GC reads a victim's headers
    /// side by side instead of walking their chain one read at a time.
    headers: Box<[AtomicU64]>,
    header_words: usize,
    /// Whether `headers` lists every batch of the segment: false for segments recovery found
    /// (GC walks their chain), true once allocated in this run.
    headers_known: Box<[AtomicBool]>,
}

/// [`SegmentTable`]'s `pinned` when no segment is.
const NONE_PINNED: u32 = u32::MAX;

impl SegmentTable {
    /// A table where every segment (of `positions_per_segment` positions) is free.
    pub fn new(segment_count: u32, positions_per_segment: u32) -> Self {
        let count = segment_count as usize;
        let header_words = (positions_per_segment as usize).div_ceil(64);
        Self {
            headers: (0..count * header_words).map(|_| AtomicU64::new(0)).collect(),
            header_words,
            headers_known: (0..count).map(|_| AtomicBool::new(false)).collect(),
            states: (0..count).map(|_| AtomicU8::new(SegmentState::Free as u8)).collect(),
            seqs: (0..count).map(|_| AtomicU64::new(0)).collect(),
            live_blocks: (0..count).map(|_| AtomicU32::new(0)).collect(),
            lsn_max: (0..count).map(|_| AtomicU64::new(0)).collect(),
            free: Mutex::new((0..segment_count).rev().collect()),
            free_count: AtomicU32::new(segment_count),
            written: (0..count).map(|_| AtomicU32::new(0)).collect(),
            rebuilt: (0..count).map(|_| AtomicBool::new(true)).collect(),
            pinned: AtomicU32::new(NONE_PINNED),
            laying_out: AtomicU32::new(NONE_PINNED),
            laid_out: (0..count).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    pub fn count(&self) -> u32 {
        self.states.len() as u32
    }

    pub fn state(&self, segment: u32) -> SegmentState {
        SegmentState::from_u8(self.states[segment as usize].load(Ordering::Acquire))
    }

    pub fn set_state(&self, segment: u32, state: SegmentState) {
        assert!(state != SegmentState::Free, "segments become free through release");
        self.states[segment as usize].store(state as u8, Ordering::Release);
    }

    /// Moves a sealed segment to [`SegmentState::Cleaning`]; false if it is no longer sealed (GC
    /// on another thread claimed it first), so two collectors never clean one victim.
    pub fn claim_for_cleaning(&self, segment: u32) -> bool {
        self.states[segment as usize]
            .compare_exchange(
                SegmentState::Sealed as u8,
                SegmentState::Cleaning as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    pub fn seq(&self, segment: u32) -> u64 {
        self.seqs[segment as usize].load(Ordering::Acquire)
    }

    pub fn set_seq(&self, segment: u32, seq: u64) {
        self.seqs[segment as usize].store(seq, Ordering::Release);
    }

    /// Live-space units in the segment (`index::UNITS_PER_POSITION` per raw block).
    pub fn live_units(&self, segment: u32) -> u32 {
        self.live_blocks[segment as usize].load(Ordering::Acquire)
    }

    pub fn add_live(&self, segment: u32, units: u32) {
        self.live_blocks[segment as usize].fetch_add(units, Ordering::AcqRel);
    }

    pub fn remove_live(&self, segment: u32, units: u32) {
        let before = self.live_blocks[segment as usize].fetch_sub(units, Ordering::AcqRel);
        assert!(before >= units, "segment {segment} live count went below zero");
    }

    pub fn lsn_max(&self, segment: u32) -> u64 {
        self.lsn_max[segment as usize].load(Ordering::Acquire)
    }

    pub fn note_lsn(&self, segment: u32, lsn: u64) {
        self.lsn_max[segment as usize].fetch_max(lsn, Ordering::AcqRel);
    }

    pub fn free_count(&self) -> u32 {
        self.free_count.load(Ordering::Acquire)
    }

    /// Takes the lowest free segment for `state`, if more than `keep_free` are free.
    pub fn allocate(&self, state: SegmentState, keep_free: u32) -> Option<u32> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() as u32 <= keep_free {
            return None;
        }
        let pinned = self.pinned.load(Ordering::Acquire);
        let laying_out = self.laying_out.load(Ordering::Acquire);
        let at =
            free.iter().rposition(|candidate| *candidate != pinned && *candidate != laying_out)?;
        let segment = free.remove(at);
        self.free_count.store(free.len() as u32, Ordering::Release);
        self.written[segment as usize].store(0, Ordering::Release);
        self.rebuilt[segment as usize].store(true, Ordering::Release);
        assert_eq!(self.state(segment), SegmentState::Free);
        assert_eq!(self.live_units(segment), 0, "a free segment holds no live block");
        self.lsn_max[segment as usize].store(0, Ordering::Release);
        for word in self.header_words_of(segment) {
            word.store(0, Ordering::Release);
        }
        self.headers_known[segment as usize].store(true, Ordering::Release);
        self.states[segment as usize].store(state as u8, Ordering::Release);
        Some(segment)
    }

    fn header_words_of(&self, segment: u32) -> &[AtomicU64] {
        let first = segment as usize * self.header_words;
        &self.headers[first..first + self.header_words]
    }

    /// Records that a batch header was written at `position` of `segment`.
    pub fn note_header(&self, segment: u32, position: u32) {
        let words = self.header_words_of(segment);
        let word = position as usize / 64;
        assert!(word < words.len(), "position {position} beyond segment {segment}");
        words[word].fetch_or(1 << (position % 64), Ordering::AcqRel);
    }

    /// The positions of the batch headers written to `segment`, in order; None if they are not
    /// known (the segment was found by recovery).
    pub fn header_positions(&self, segment: u32) -> Option<Vec<u32>> {
        if !self.headers_known[segment as usize].load(Ordering::Acquire) {
            return None;
        }
        let mut positions = Vec::new();
        for (index, word) in self.header_words_of(segment).iter().enumerate() {
            let mut bits = word.load(Ordering::Acquire);
            // One iteration per set bit: at most 64.
            while bits != 0 {
                positions.push(index as u32 * 64 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
        Some(positions)
    }

    /// The end of the last write completed in the segment (coded logs).
    pub fn written(&self, segment: u32) -> u32 {
        self.written[segment as usize].load(Ordering::Acquire)
    }

    pub fn note_written(&self, segment: u32, end: u32) {
        self.written[segment as usize].fetch_max(end, Ordering::AcqRel);
    }

    pub fn is_rebuilt(&self, segment: u32) -> bool {
        self.rebuilt[segment as usize].load(Ordering::Acquire)
    }

    pub fn set_rebuilt(&self, segment: u32, rebuilt: bool) {
        self.rebuilt[segment as usize].store(rebuilt, Ordering::Release);
    }

    /// Marks every segment as not yet rebuilt (a drive rebuild starts).
    pub fn clear_rebuilt(&self) {
        for flag in self.rebuilt.iter() {
            flag.store(false, Ordering::Release);
        }
    }

    /// Keeps `segment` from being allocated until [`SegmentTable::unpin`]; false if another
    /// segment is pinned already (one at a time: a rebuild's or a scrub repair's).
    pub fn try_pin(&self, segment: u32) -> bool {
        assert!(segment != NONE_PINNED);
        self.pinned
            .compare_exchange(NONE_PINNED, segment, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    pub fn unpin(&self) {
        self.pinned.store(NONE_PINNED, Ordering::Release);
    }

    /// Picks a free segment to lay out and keeps allocation from taking it until
    /// [`SegmentTable::end_lay_out`]: the first of the next `ahead` segments allocation will
    /// hand out (the lowest free ones) not known to be laid out. None if all of them are, if
    /// no more than `keep_free` segments are free (one withheld must not make a writer run
    /// out), or if a lay-out is under way already (one at a time).
    pub fn begin_lay_out(&self, ahead: usize, keep_free: u32) -> Option<u32> {
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() as u32 <= keep_free || self.laying_out.load(Ordering::Acquire) != NONE_PINNED
        {
            return None;
        }
        let pinned = self.pinned.load(Ordering::Acquire);
        let segment = free.iter().rev().take(ahead).copied().find(|candidate| {
            *candidate != pinned && !self.laid_out[*candidate as usize].load(Ordering::Acquire)
        })?;
        self.laying_out.store(segment, Ordering::Release);
        Some(segment)
    }

    /// Ends the lay-out [`SegmentTable::begin_lay_out`] began; `laid_out` if it succeeded.
    pub fn end_lay_out(&self, segment: u32, laid_out: bool) {
        assert_eq!(self.laying_out.load(Ordering::Acquire), segment, "not being laid out");
        assert_eq!(self.state(segment), SegmentState::Free, "allocated while laid out");
        self.laid_out[segment as usize].store(laid_out, Ordering::Release);
        self.laying_out.store(NONE_PINNED, Ordering::Release);
    }

    /// Gives a segment back to the free list.
    pub fn release(&self, segment: u32) {
        assert_eq!(self.live_units(segment), 0, "segment {segment} still holds live blocks");
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        assert!(self.state(segment) != SegmentState::Free, "segment {segment} freed twice");
        self.states[segment as usize].store(SegmentState::Free as u8, Ordering::Release);
        // Keep the list sorted (highest first) so allocation stays deterministic.
        let at = free.partition_point(|other| *other > segment);
        free.insert(at, segment);
        self.free_count.store(free.len() as u32, Ordering::Release);
    }

    /// Recovery: marks a segment in use (it must be free) without going through `allocate`.
    pub fn claim(&self, segment: u32, state: SegmentState) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let Some(at) = free.iter().position(|other| *other == segment) else {
            panic!("segment {segment} claimed twice");
        };
        free.remove(at);
        self.free_count.store(free.len() as u32, Ordering::Release);
        self.headers_known[segment as usize].store(false, Ordering::Release);
        self.states[segment as usize].store(state as u8, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_positions_are_known_only_for_segments_allocated_in_this_run() {
        let table = SegmentTable::new(3, 130);
        let segment = table.allocate(SegmentState::Open, 0).unwrap();
        for position in [0, 5, 63, 64, 129] {
            table.note_header(segment, position);
        }
        assert_eq!(table.header_positions(segment), Some(vec![0, 5, 63, 64, 129]));
        table.claim(2, SegmentState::Sealed);
        assert_eq!(table.header_positions(2), None, "recovery's segments are walked");
        table.set_state(segment, SegmentState::Sealed);
        assert!(table.claim_for_cleaning(segment));
        assert!(!table.claim_for_cleaning(segment), "a victim is claimed once");
        table.release(segment);
        assert_eq!(table.allocate(SegmentState::Open, 0), Some(segment));
        assert_eq!(table.header_positions(segment), Some(vec![]), "reuse starts empty");
    }

    #[test]
    fn allocation_keeps_a_reserve_and_reuses_lowest() {
        let table = SegmentTable::new(4, 128);
        assert_eq!(table.allocate(SegmentState::Open, 0), Some(0));
        assert_eq!(table.allocate(SegmentState::Open, 2), Some(1));
        assert_eq!(table.allocate(SegmentState::Open, 2), None, "the reserve is kept");
        assert_eq!(table.allocate(SegmentState::Checkpoint, 0), Some(2));
        table.claim(3, SegmentState::Sealed);
        assert_eq!(table.free_count(), 0);
        table.add_live(1, 16);
        table.remove_live(1, 16);
        table.release(1);
        table.release(0);
        assert!(table.try_pin(0));
        assert!(!table.try_pin(1), "one segment is pinned at a time");
        assert_eq!(table.allocate(SegmentState::Open, 0), Some(1), "a pinned segment is skipped");
        table.unpin();
        assert_eq!(table.allocate(SegmentState::Open, 0), Some(0));
        table.note_written(0, 8);
        table.note_written(0, 4);
        assert_eq!(table.written(0), 8);
    }
}
