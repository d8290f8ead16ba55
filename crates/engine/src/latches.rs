//! Which drives of a node are latched failed, shared by every data-path thread.
//!
//! After a failed write, sync or punch the kernel may already have dropped the dirty pages that
//! failed, so retrying would report success for data that is gone (the fsync lesson). The drive
//! is latched failed for the life of the process instead: every later I/O to it fails at once
//! with `DriveFailed`. A failed read changes nothing on the drive and latches nothing.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::format::DRIVE_COUNT_MAX;

/// Which drives of a node are latched failed. Shared (`Arc`) by the handles of all data-path
/// threads; checked with one relaxed load per I/O.
#[derive(Debug)]
pub struct DriveLatches {
    failed: Box<[AtomicBool]>,
}

impl DriveLatches {
    pub fn new(drive_count: u16) -> Self {
        assert!((1..=DRIVE_COUNT_MAX).contains(&drive_count), "drive count {drive_count}");
        Self { failed: (0..drive_count).map(|_| AtomicBool::new(false)).collect() }
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
