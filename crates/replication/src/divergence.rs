//! What a replica remembers about writes it applied that may not be on every in-sync replica:
//! the LBA of each entry whose data reflects a host write beyond the commit point it was told.
//! A new primary collects these lists and overwrites those blocks with its own version, which
//! makes the in-sync replicas identical again after a failover.
//!
//! An entry is resolved (dropped) when the replica learns that the writes it reflects are
//! committed: a commit point of the same epoch at or beyond them, or any commit point of a
//! newer epoch (a primary commits op 1 of its epoch only after it reconciled every in-sync
//! replica, so every older divergence is gone by then). Past `divergence_lbas_max` entries,
//! and after a restart (the list lives in memory), the divergence is unknown until resolved
//! the same way; a reconciliation then copies the whole volume.

use std::ops::Range;

use crate::message::DivergenceReport;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mark {
    epoch: u64,
    covers_op: u64,
    lba: u64,
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

    /// After a restart: anything applied before may be uncommitted, and nothing is known.
    pub fn after_restart(limit: usize, epoch: u64) -> Self {
        Self { lost: Some((epoch, u64::MAX)), ..Self::known_empty(limit) }
    }

    #[cfg(test)]
    pub fn is_known(&self) -> bool {
        self.lost.is_none()
    }

    /// Records an applied entry of `epoch` whose data reflects writes up to `covers_op`.
    pub fn record(&mut self, epoch: u64, covers_op: u64, lbas: Range<u64>) {
        if covers_op == 0 {
            return;
        }
        for lba in lbas {
            if self.marks.len() == self.limit {
                self.lose((epoch, covers_op));
                let newest = self.marks.iter().map(|m| (m.epoch, m.covers_op)).max();
                if let Some(newest) = newest {
                    self.lose(newest);
                }
                self.marks.clear();
                return;
            }
            self.marks.push(Mark { epoch, covers_op, lba });
        }
    }

    fn lose(&mut self, mark: (u64, u64)) {
        self.lost = Some(self.lost.map_or(mark, |lost| lost.max(mark)));
    }

    /// The replica learned that every host write of `epoch` up to `commit_op` is committed.
    pub fn prune(&mut self, epoch: u64, commit_op: u64) {
        self.marks.retain(|mark| !mark.resolved_by(epoch, commit_op));
        if let Some((lost_epoch, lost_op)) = self.lost {
            let mark = Mark { epoch: lost_epoch, covers_op: lost_op, lba: 0 };
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
        let mut lbas: Vec<u64> = self.marks.iter().map(|mark| mark.lba).collect();
        lbas.sort_unstable();
        lbas.dedup();
        DivergenceReport::Known(lbas)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_points_resolve_marks() {
        let mut divergence = Divergence::known_empty(8);
        divergence.record(3, 5, 10..12);
        divergence.record(3, 0, 20..21);
        divergence.record(3, 7, 30..31);
        assert_eq!(divergence.report(), DivergenceReport::Known(vec![10, 11, 30]));
        divergence.prune(3, 6);
        assert_eq!(divergence.report(), DivergenceReport::Known(vec![30]));
        divergence.prune(4, 0);
        assert_eq!(divergence.report(), DivergenceReport::Known(vec![30]));
        divergence.prune(4, 1);
        assert_eq!(divergence.report(), DivergenceReport::Known(vec![]));
    }

    #[test]
    fn overflow_and_restart_are_unknown_until_a_newer_epoch_commits() {
        let mut divergence = Divergence::known_empty(2);
        divergence.record(3, 5, 0..3);
        assert_eq!(divergence.report(), DivergenceReport::Unknown);
        divergence.prune(3, 4);
        assert!(!divergence.is_known());
        divergence.prune(3, 5);
        assert!(divergence.is_known());

        let mut restarted = Divergence::after_restart(2, 3);
        restarted.prune(3, 1_000);
        assert!(!restarted.is_known());
        restarted.prune(4, 1);
        assert!(restarted.is_known());
    }
}
