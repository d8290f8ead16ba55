//! What a replica remembers about writes it applied that may not be on every in-sync replica:
//! the LBA range of each entry whose data reflects a host write beyond the commit point it was
//! told. A new primary collects these lists and overwrites those blocks with its own version,
//! which makes the in-sync replicas identical again after a failover.
//!
//! An entry is resolved (dropped) when the replica learns that the writes it reflects are
//! committed: a commit point of the same epoch at or beyond them, or any commit point of a
//! newer epoch (a primary commits op 1 of its epoch only after it reconciled every in-sync
//! replica, so every older divergence is gone by then). Past `divergence_ranges_max` entries,
//! the divergence is unknown until resolved the same way; a reconciliation then copies the
//! whole volume. After a restart it is what the write intent persisted (crate docs, "Write
//! intent"): its ranges, resolved like entries of the persisted epoch beyond every commit
//! point, or unknown if the intent was.

use std::ops::Range;

use crate::message::{merge_ranges, DivergenceReport};

#[derive(Debug, Clone, PartialEq, Eq)]
struct Mark {
    epoch: u64,
    covers_op: u64,
    lbas: Range<u64>,
}

impl Mark {
    fn resolved_by(&self, commit_epoch: u64, commit_op: u64) -> bool {
        (self.epoch == commit_epoch && self.covers_op <= commit_op)
            || (self.epoch < commit_epoch && commit_op >= 1)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Divergence {
    marks: Vec<Mark>,
    /// Set when marks were lost: the newest (epoch, op) among them.
    lost: Option<(u64, u64)>,
    limit: usize,
}

impl Divergence {
    pub fn known_empty(limit: usize) -> Self {
        assert!(limit > 0);
        Self { marks: Vec::new(), lost: None, limit }
    }

    /// After a restart without a known write intent: anything applied before may be
    /// uncommitted, and nothing is known.
    pub fn after_restart(limit: usize, epoch: u64) -> Self {
        Self { lost: Some((epoch, u64::MAX)), ..Self::known_empty(limit) }
    }

    /// After a restart with a known write intent: every block that may hold an uncommitted
    /// write is in `lbas`. Each range is a mark of `epoch` (the persisted one, the newest this
    /// node applied anything of) beyond every commit point, so only a newer epoch's commit
    /// point resolves it, exactly as `after_restart`'s lost marks.
    pub fn after_restart_known(limit: usize, epoch: u64, lbas: &[Range<u64>]) -> Self {
        if lbas.len() > limit {
            return Self::after_restart(limit, epoch);
        }
        let marks = lbas
            .iter()
            .filter(|range| !range.is_empty())
            .map(|range| Mark { epoch, covers_op: u64::MAX, lbas: range.clone() })
            .collect();
        Self { marks, ..Self::known_empty(limit) }
    }

    /// Whether marks were lost (the report is `Unknown`).
    pub fn is_lost(&self) -> bool {
        self.lost.is_some()
    }

    /// The LBA ranges of the marks kept (overlapping, in no order).
    pub fn ranges(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        self.marks.iter().map(|mark| mark.lbas.clone())
    }

    /// Records an applied entry of `epoch` whose data reflects writes up to `covers_op`.
    pub fn record(&mut self, epoch: u64, covers_op: u64, lbas: Range<u64>) {
        if covers_op == 0 || lbas.is_empty() {
            return;
        }
        if self.marks.len() == self.limit {
            self.lose((epoch, covers_op));
            let newest = self.marks.iter().map(|m| (m.epoch, m.covers_op)).max();
            if let Some(newest) = newest {
                self.lose(newest);
            }
            self.marks.clear();
            return;
        }
        self.marks.push(Mark { epoch, covers_op, lbas });
    }

    fn lose(&mut self, mark: (u64, u64)) {
        self.lost = Some(self.lost.map_or(mark, |lost| lost.max(mark)));
    }

    /// The replica learned that every host write of `epoch` up to `commit_op` is committed.
    pub fn prune(&mut self, epoch: u64, commit_op: u64) {
        self.marks.retain(|mark| !mark.resolved_by(epoch, commit_op));
        if let Some((lost_epoch, lost_op)) = self.lost {
            let mark = Mark { epoch: lost_epoch, covers_op: lost_op, lbas: 0..0 };
            if mark.resolved_by(epoch, commit_op) {
                self.lost = None;
            }
        }
    }

    /// Forgets everything: the caller made this node's blocks the reference (a primary that
    /// reconciled every in-sync replica to itself).
    pub fn clear(&mut self) {
        self.marks.clear();
        self.lost = None;
    }

    pub fn report(&self) -> DivergenceReport {
        if self.lost.is_some() {
            return DivergenceReport::Unknown;
        }
        DivergenceReport::Known(merge_ranges(self.ranges().collect()))
    }
}

#[cfg(test)]
// A list of one LBA range is what these tests mean, not a range collected into a list.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    fn known(ranges: &[Range<u64>]) -> DivergenceReport {
        DivergenceReport::Known(ranges.to_vec())
    }

    #[test]
    fn commit_points_resolve_marks() {
        let mut divergence = Divergence::known_empty(8);
        divergence.record(3, 5, 10..12);
        divergence.record(3, 0, 20..21);
        divergence.record(3, 7, 30..31);
        divergence.record(3, 6, 11..13);
        assert_eq!(divergence.report(), known(&[10..13, 30..31]));
        divergence.prune(3, 6);
        assert_eq!(divergence.report(), known(&[30..31]));
        divergence.prune(4, 0);
        assert_eq!(divergence.report(), known(&[30..31]));
        divergence.prune(4, 1);
        assert_eq!(divergence.report(), known(&[]));
    }

    #[test]
    fn overflow_and_restart_are_unknown_until_a_newer_epoch_commits() {
        let mut divergence = Divergence::known_empty(2);
        divergence.record(3, 5, 0..3);
        divergence.record(3, 5, 4..5);
        assert!(divergence.report() != DivergenceReport::Unknown);
        divergence.record(3, 5, 7..8);
        assert_eq!(divergence.report(), DivergenceReport::Unknown);
        divergence.prune(3, 4);
        assert!(divergence.is_lost());
        divergence.prune(3, 5);
        assert!(!divergence.is_lost());

        let mut restarted = Divergence::after_restart(2, 3);
        restarted.prune(3, 1_000);
        assert!(restarted.is_lost());
        restarted.prune(4, 1);
        assert!(!restarted.is_lost());
    }

    /// The persisted intent's ranges resolve exactly as the lost marks of a restart do.
    #[test]
    fn a_known_restart_lists_the_intent_until_a_newer_epoch_commits() {
        let mut restarted = Divergence::after_restart_known(4, 3, &[0..256, 512..768]);
        assert_eq!(restarted.report(), known(&[0..256, 512..768]));
        restarted.record(3, 9, 300..301);
        assert_eq!(restarted.report(), known(&[0..256, 300..301, 512..768]));
        restarted.prune(3, u64::MAX - 1);
        assert_eq!(restarted.report(), known(&[0..256, 512..768]));
        restarted.prune(4, 1);
        assert_eq!(restarted.report(), known(&[]));
        let too_many = Divergence::after_restart_known(1, 3, &[0..1, 5..6]);
        assert_eq!(too_many.report(), DivergenceReport::Unknown);
    }
}
