//! Which drives of a node are latched failed, shared by every data-path thread.
//!
//! After a failed write, sync or punch the kernel may already have dropped the dirty pages that
//! failed, so retrying would report success for data that is gone (the fsync lesson). The drive
//! is latched failed for the life of the process instead: every later I/O to it fails at once
//! with `DriveFailed`. A failed read changes nothing on the drive and latches nothing. The one
//! way back is a replacement (coded logs): the new drive is "rebuilding" until every cell of it
//! is restored, then healthy.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::format::DRIVE_COUNT_MAX;

/// Which drives of a node are latched failed. Shared (`Arc`) by the handles of all data-path
/// threads; checked with one relaxed load per I/O.
#[derive(Debug)]
pub struct DriveLatches {
    failed: Box<[AtomicBool]>,
    /// Drives being rebuilt after a replacement: written like healthy drives, but read only
    /// where the rebuild has already restored their cells.
    rebuilding: Box<[AtomicBool]>,
}

impl DriveLatches {
    pub fn new(drive_count: u16) -> Self {
        assert!((1..=DRIVE_COUNT_MAX).contains(&drive_count), "drive count {drive_count}");
        Self {
            failed: (0..drive_count).map(|_| AtomicBool::new(false)).collect(),
            rebuilding: (0..drive_count).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    pub fn drive_count(&self) -> u16 {
        self.failed.len() as u16
    }

    pub fn is_failed(&self, drive: u16) -> bool {
        self.failed[usize::from(drive)].load(Ordering::Relaxed)
    }

    /// Marks a drive failed for the life of the process.
    pub fn latch(&self, drive: u16) {
        self.failed[usize::from(drive)].store(true, Ordering::Relaxed);
    }

    /// A replacement takes a failed drive's place: it is no longer failed but is being rebuilt.
    /// Only the rebuild (`LogHandle::begin_replace`) calls this.
    pub fn start_rebuild(&self, drive: u16) {
        self.rebuilding[usize::from(drive)].store(true, Ordering::SeqCst);
        self.failed[usize::from(drive)].store(false, Ordering::SeqCst);
    }

    /// The rebuild of `drive` finished: it is a healthy drive again.
    pub fn finish_rebuild(&self, drive: u16) {
        self.rebuilding[usize::from(drive)].store(false, Ordering::SeqCst);
    }

    pub fn is_rebuilding(&self, drive: u16) -> bool {
        self.rebuilding[usize::from(drive)].load(Ordering::Relaxed)
    }

    /// The drive being rebuilt, if any.
    pub fn rebuilding_drive(&self) -> Option<u16> {
        (0..self.rebuilding.len() as u16).find(|drive| self.is_rebuilding(*drive))
    }

    /// How many drives are latched failed.
    pub fn failed_count(&self) -> usize {
        self.failed.iter().filter(|failed| failed.load(Ordering::Relaxed)).count()
    }

    pub fn failed_drives(&self) -> Vec<u16> {
        (0..self.failed.len() as u16).filter(|drive| self.is_failed(*drive)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latches_are_per_drive_and_permanent() {
        let latches = DriveLatches::new(3);
        assert!(latches.failed_drives().is_empty());
        latches.latch(1);
        latches.latch(1);
        assert!(latches.is_failed(1) && !latches.is_failed(0));
        assert_eq!(latches.failed_drives(), [1]);
        assert_eq!(latches.drive_count(), 3);
    }
}
