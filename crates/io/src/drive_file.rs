//! Hot path. A drive backed by a file opened with O_DIRECT, served through this thread's
//! [`Ring`]: the `engine::Drive` implementation the node uses.
//!
//! Each data-path thread opens its own descriptor of each drive file, so a descriptor and the
//! ring it is used on never cross threads, and each descriptor sees a write-back error once
//! (Linux reports it to every open file description).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use engine::{Drive, DriveError, DriveOperation};
use types::AlignedBuf;

use crate::drives::DriveSetupError;
use crate::ring::Ring;

/// One thread's handle of one drive file.
#[derive(Debug)]
pub struct DriveFile {
    path: PathBuf,
    file: Rc<File>,
    ring: Rc<Ring>,
    size_bytes: u64,
}

impl DriveFile {
    /// Opens a drive file for direct I/O through `ring`. The file's superblock is not read:
    /// [`crate::open_drives`] validated it at startup.
    pub fn open(path: &Path, ring: &Rc<Ring>) -> Result<Self, DriveSetupError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|source| {
                if source.raw_os_error() == Some(libc::EINVAL) {
                    DriveSetupError::DirectIoUnsupported { path: path.to_owned(), source }
                } else {
                    DriveSetupError::Io { action: "open", path: path.to_owned(), source }
                }
            })?;
        let size_bytes = file
            .metadata()
            .map_err(|source| DriveSetupError::Io {
                action: "read the size of",
                path: path.to_owned(),
                source,
            })?
            .len();
        Ok(Self { path: path.to_owned(), file: Rc::new(file), ring: Rc::clone(ring), size_bytes })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(
        &self,
        operation: DriveOperation,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), DriveError> {
        engine::check_request(operation, offset_bytes, length_bytes, self.size_bytes)
    }
}

/// Turns a transfer's outcome into the drive's result: anything short of the whole length fails.
fn transfer_result(
    operation: DriveOperation,
    offset_bytes: u64,
    length_bytes: u64,
    result: std::io::Result<usize>,
) -> Result<(), DriveError> {
    match result {
        Ok(done) if done as u64 == length_bytes => Ok(()),
        Ok(done) => Err(DriveError::ShortTransfer {
            operation,
            offset_bytes,
            length_bytes,
            done_bytes: done as u64,
        }),
        Err(source) => Err(DriveError::Io { operation, offset_bytes, length_bytes, source }),
    }
}

impl Drive for DriveFile {
    async fn read_at(
        &self,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        if let Err(error) = self.check(DriveOperation::Read, offset_bytes, length_bytes) {
            return (Err(error), buf);
        }
        let (result, buf) = self.ring.read_at(&self.file, offset_bytes, buf).await;
        (transfer_result(DriveOperation::Read, offset_bytes, length_bytes, result), buf)
    }

    async fn write_at(
        &self,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        if let Err(error) = self.check(DriveOperation::Write, offset_bytes, length_bytes) {
            return (Err(error), buf);
        }
        let (result, buf) = self.ring.write_at(&self.file, offset_bytes, buf).await;
        (transfer_result(DriveOperation::Write, offset_bytes, length_bytes, result), buf)
    }

    async fn sync(&self) -> Result<(), DriveError> {
        self.ring.fdatasync(&self.file).await.map_err(|source| DriveError::Io {
            operation: DriveOperation::Sync,
            offset_bytes: 0,
            length_bytes: 0,
            source,
        })
    }

    async fn punch_hole(&self, offset_bytes: u64, length_bytes: u64) -> Result<(), DriveError> {
        self.check(DriveOperation::PunchHole, offset_bytes, length_bytes)?;
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        let result = self.ring.fallocate(&self.file, offset_bytes, length_bytes, mode).await;
        result.map_err(|source| DriveError::Io {
            operation: DriveOperation::PunchHole,
            offset_bytes,
            length_bytes,
            source,
        })
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
}
