//! The set of blocks a replica is missing, which a primary keeps for each replica that is not
//! in sync: the LBAs written while it was away, bounded; past the bound, or when nothing is
//! known, a cursor over the whole volume (a full copy).

use std::collections::BTreeSet;
use std::ops::Range;

use crate::COPY_SCAN_MAX;

/// What `DirtySet::take` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    Lba(u64),
    /// Blocks remain, but every one examined is blocked for now.
    Blocked,
    Empty,
}

#[derive(Debug, Clone)]
pub(crate) struct DirtySet {
    lbas: BTreeSet<u64>,
    /// `Some(c)`: every LBA from `c` to the end of the volume is dirty too.
    cursor: Option<u64>,
    limit: usize,
    volume_blocks: u64,
}

impl DirtySet {
    pub fn empty(limit: usize, volume_blocks: u64) -> Self {
        assert!(limit > 0 && volume_blocks > 0);
        Self { lbas: BTreeSet::new(), cursor: None, limit, volume_blocks }
    }

    pub fn full(limit: usize, volume_blocks: u64) -> Self {
        Self { cursor: Some(0), ..Self::empty(limit, volume_blocks) }
    }

    pub fn is_empty(&self) -> bool {
        self.lbas.is_empty() && self.cursor.is_none()
    }

    pub fn is_full(&self) -> bool {
        self.cursor == Some(0)
    }

    /// Blocks still to copy.
    pub fn len(&self) -> u64 {
        let beyond_cursor = self.cursor.map_or(0, |cursor| self.volume_blocks - cursor);
        self.lbas.len() as u64 + beyond_cursor
    }

    pub fn volume_blocks(&self) -> u64 {
        self.volume_blocks
    }

    /// The volume grew to `volume_blocks`. A full copy under way goes on to the new end; the
    /// new blocks are dirty only then (elsewhere nothing wrote them yet).
    pub fn grow(&mut self, volume_blocks: u64) {
        assert!(volume_blocks >= self.volume_blocks, "volumes only grow");
        self.volume_blocks = volume_blocks;
    }

    /// Makes every block dirty (a full copy).
    pub fn fill(&mut self) {
        self.lbas.clear();
        self.cursor = Some(0);
    }

    /// Takes out the blocks of `range` listed one by one (those before the cursor of a full
    /// set; the cursor's blocks stay dirty) and returns how many: a host write that the replica
    /// receives live brings them up to date. Costs one lookup per block of `range`.
    pub fn remove_range(&mut self, range: Range<u64>) -> u64 {
        if self.lbas.is_empty() {
            return 0;
        }
        let end = self.cursor.map_or(range.end, |cursor| range.end.min(cursor));
        let mut removed = 0;
        for lba in range.start..end {
            removed += u64::from(self.lbas.remove(&lba));
        }
        removed
    }

    /// Adds `range`. Costs at most `limit` insertions whatever its length (a divergence range
    /// may span much of the volume): past the limit the set becomes full.
    pub fn insert_range(&mut self, range: Range<u64>) {
        assert!(range.end <= self.volume_blocks, "LBAs are checked before they get here");
        // Blocks from the cursor on are dirty already.
        let end = self.cursor.map_or(range.end, |cursor| range.end.min(cursor));
        if end.saturating_sub(range.start) > self.limit as u64 {
            self.fill();
            return;
        }
        for lba in range.start..end {
            self.lbas.insert(lba);
            if self.lbas.len() > self.limit {
                self.fill();
                return;
            }
        }
    }

    /// Removes and returns the next block to copy, skipping those `blocked` says to leave for
    /// later (at most `COPY_SCAN_MAX` examined).
    pub fn take(&mut self, blocked: impl Fn(u64) -> bool) -> Take {
        let found = self.lbas.iter().take(COPY_SCAN_MAX).copied().find(|&lba| !blocked(lba));
        if let Some(lba) = found {
            self.lbas.remove(&lba);
            return Take::Lba(lba);
        }
        if let Some(cursor) = self.cursor {
            assert!(cursor < self.volume_blocks);
            if blocked(cursor) {
                return Take::Blocked;
            }
            self.cursor = (cursor + 1 < self.volume_blocks).then_some(cursor + 1);
            return Take::Lba(cursor);
        }
        if self.lbas.is_empty() {
            Take::Empty
        } else {
            Take::Blocked
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(set: &mut DirtySet) -> Vec<u64> {
        let mut out = Vec::new();
        while let Take::Lba(lba) = set.take(|_| false) {
            out.push(lba);
        }
        out
    }

    #[test]
    fn removal_takes_listed_blocks_only() {
        let mut set = DirtySet::empty(8, 100);
        set.insert_range(10..14);
        assert_eq!(set.remove_range(11..13), 2);
        assert_eq!(set.remove_range(11..13), 0, "gone already");
        assert_eq!(drain(&mut set), vec![10, 13]);
        // A full set's cursor keeps its blocks; those listed before it go.
        let mut full = DirtySet::full(8, 20);
        assert_eq!(full.take(|_| false), Take::Lba(0));
        assert_eq!(full.take(|_| false), Take::Lba(1));
        full.insert_range(0..2);
        assert_eq!(full.remove_range(0..5), 2);
        assert_eq!(full.len(), 18);
        assert_eq!(drain(&mut full), (2..20).collect::<Vec<_>>());
    }

    #[test]
    fn overflow_becomes_full() {
        let mut set = DirtySet::empty(3, 8);
        set.insert_range(1..3);
        set.insert_range(5..7);
        assert!(set.is_full());
        assert_eq!(drain(&mut set), (0..8).collect::<Vec<_>>());
        assert!(set.is_empty());
    }

    #[test]
    fn a_range_longer_than_the_limit_fills_at_once() {
        let mut set = DirtySet::empty(4, 1 << 40);
        set.insert_range(0..(1 << 40));
        assert!(set.is_full());
        assert_eq!(set.len(), 1 << 40);
        set.insert_range(5..(1 << 39));
        assert_eq!(set.len(), 1 << 40);
        let mut set = DirtySet::empty(4, 16);
        set.insert_range(2..6);
        assert_eq!((set.is_full(), set.len()), (false, 4));
    }

    #[test]
    fn blocked_blocks_wait() {
        let mut set = DirtySet::empty(10, 8);
        set.insert_range(2..4);
        assert_eq!(set.take(|lba| lba == 2), Take::Lba(3));
        assert_eq!(set.take(|lba| lba == 2), Take::Blocked);
        assert_eq!(set.take(|_| false), Take::Lba(2));
        assert_eq!(set.take(|_| false), Take::Empty);
    }
}
