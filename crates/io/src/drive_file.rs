//! Hot path. A drive backed by a file opened with O_DIRECT, served through this thread's
//! [`Ring`]: the `engine::Drive` implementation the node uses.
//!
//! Each data-path thread opens its own descriptor of each drive file, so a descriptor and the
//! ring it is used on never cross threads, and each descriptor sees a write-back error once
//! (Linux reports it to every open file description).
//!
//! A memory drive ([`crate::MemoryDrives`], NOT DURABLE) is opened without O_DIRECT (its file
//! is in the page cache and nowhere else) and served inline, not through the ring: each read
//! or write is one pread/pwrite in which the kernel copies between the buffer and RAM, and a
//! sync has nothing to write back. io_uring hands buffered I/O on tmpfs to its worker threads
//! (tmpfs cannot do it without blocking, by io_uring's rules; measured on Linux 6.18), which
//! would add a thread hop to every I/O and charge the target's CPU for it: the very figure
//! memory drives exist to measure. The copies being the kernel's, no two threads ever share
//! the drive's memory in our code.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use engine::{Drive, DriveError, DriveOperation};
use types::AlignedBuf;

use crate::drives::{is_in_memory, is_memory_drive_link, open_drive_size_bytes, DriveSetupError};
use crate::ring::Ring;

/// One thread's handle of one drive file.
#[derive(Debug)]
pub struct DriveFile {
    path: PathBuf,
    /// `None` for a drive that is not there ([`DriveFile::missing`]): every operation fails.
    file: Option<Rc<File>>,
    ring: Rc<Ring>,
    size_bytes: u64,
    /// A memory drive, served inline instead of through `ring` (see the module comment).
    memory: bool,
    /// A block device (`ferrite up --drive`): punching a hole there needs the device's
    /// write-zeroes support, so it falls back to zeroing the range (see `punch_hole`).
    block_device: bool,
}

impl DriveFile {
    /// Opens a drive file for direct I/O through `ring`, or a memory drive's link for inline
    /// buffered I/O. The file's superblock is not read: [`crate::open_drives`] validated it at startup.
    pub fn open(path: &Path, ring: &Rc<Ring>) -> Result<Self, DriveSetupError> {
        let memory = is_memory_drive_link(path);
        let mut options = OpenOptions::new();
        options.read(true).write(true);
        if !memory {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = options.open(path).map_err(|source| {
            if !memory && source.raw_os_error() == Some(libc::EINVAL) {
                DriveSetupError::DirectIoUnsupported { path: path.to_owned(), source }
            } else {
                DriveSetupError::Io { action: "open", path: path.to_owned(), source }
            }
        })?;
        if memory && !is_in_memory(&file, path)? {
            return Err(DriveSetupError::NotMemoryDrive { path: path.to_owned() });
        }
        let block_device = {
            use std::os::unix::fs::FileTypeExt;
            file.metadata()
                .map_err(|source| DriveSetupError::Io {
                    action: "find the type of",
                    path: path.to_owned(),
                    source,
                })?
                .file_type()
                .is_block_device()
        };
        // A block device's length in its metadata is 0: its size comes from BLKGETSIZE64.
        let size_bytes = open_drive_size_bytes(&file, path)?;
        if memory {
            // Take the drive's RAM now (idempotent: later opens find it allocated), so no write
            // pays for tmpfs page allocation: measured, first-touch allocation cost more CPU
            // than the rest of the write path. Formatting is done by now, and nothing punches
            // holes afterwards.
            fallocate_now(&file, 0, size_bytes, 0).map_err(|source| DriveSetupError::Io {
                action: "reserve the RAM of",
                path: path.to_owned(),
                source,
            })?;
        }
        Ok(Self {
            path: path.to_owned(),
            file: Some(Rc::new(file)),
            ring: Rc::clone(ring),
            size_bytes,
            memory,
            block_device,
        })
    }

    /// Stands in for drive `index` of a node with parity that started without it (none of its
    /// `--drive` paths held it): every operation fails, so the engine latches the drive failed
    /// when it opens the log and serves its data from parity until it is replaced.
    pub fn missing(index: u16, ring: &Rc<Ring>) -> Self {
        Self {
            path: PathBuf::from(format!("(drive {index}: no device)")),
            file: None,
            ring: Rc::clone(ring),
            size_bytes: 0,
            memory: false,
            block_device: false,
        }
    }

    /// The open file, or the error every operation of a missing drive gets.
    fn file(
        &self,
        operation: DriveOperation,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<&Rc<File>, DriveError> {
        self.file.as_ref().ok_or_else(|| DriveError::Io {
            operation,
            offset_bytes,
            length_bytes,
            source: io::Error::new(
                io::ErrorKind::NotFound,
                "the drive was not found when the node started (none of its --drive paths holds \
                 it); replace it with `ferrite drive replace`",
            ),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this is a memory drive (NOT DURABLE).
    pub fn is_memory(&self) -> bool {
        self.memory
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

/// fallocate(2) on this thread, for a memory drive (tmpfs frees the pages at once).
fn fallocate_now(file: &File, offset_bytes: u64, length_bytes: u64, mode: i32) -> io::Result<()> {
    // `check_request` bounded both by the drive's size, which fits a file offset.
    let offset = libc::off_t::try_from(offset_bytes).map_err(io::Error::other)?;
    let length = libc::off_t::try_from(length_bytes).map_err(io::Error::other)?;
    // SAFETY: fallocate takes an open descriptor and integers; it shares no memory with us.
    let result = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset, length) };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The zero writes [`DriveFile::fill_holes`] issues, one at a time: small enough that the
/// log's own writes to the drive never queue long behind one (measured, session 16: with 1 MiB
/// writes on every drive at once, 4 KiB write p99.9 went from 4-5 ms to 13-14 ms; 64 KiB writes
/// cost more CPU per byte).
const FILL_WRITE_BYTES: usize = 256 << 10;

/// The holes of `file` in `start..end`, as byte ranges rounded inwards to whole blocks (a
/// filesystem with blocks under 4 KiB may report finer ones; what is left is a few partial
/// blocks the filesystem allocates on first write, as before).
fn hole_ranges(file: &File, start: u64, end: u64) -> io::Result<Vec<(u64, u64)>> {
    let block = u64::from(types::BLOCK_SIZE_BYTES);
    let seek = |from: u64, whence: i32| -> io::Result<Option<u64>> {
        let from = libc::off_t::try_from(from).map_err(io::Error::other)?;
        // SAFETY: lseek takes an open descriptor and integers; it shares no memory with us.
        let at = unsafe { libc::lseek(file.as_raw_fd(), from, whence) };
        if at >= 0 {
            return Ok(Some(at as u64));
        }
        let error = io::Error::last_os_error();
        // ENXIO: no hole (or no data) at or after `from` before the end of the file.
        if error.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(error)
        }
    };
    let mut holes = Vec::new();
    let mut at = start;
    // Each turn moves `at` past a hole and the data after it, so the loop ends within
    // (end - start) / block turns.
    while at < end {
        let Some(hole) = seek(at, libc::SEEK_HOLE)? else { break };
        if hole >= end {
            break;
        }
        let data = seek(hole, libc::SEEK_DATA)?.unwrap_or(end).min(end);
        let (first, last) = (hole.next_multiple_of(block), data / block * block);
        if first < last {
            holes.push((first, last));
        }
        if data <= at {
            break; // a filesystem that contradicts itself: stop rather than loop
        }
        at = data;
    }
    Ok(holes)
}

impl Drive for DriveFile {
    async fn read_at(
        &self,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        let file = match self.file(DriveOperation::Read, offset_bytes, length_bytes) {
            Ok(file) => file,
            Err(error) => return (Err(error), buf),
        };
        if let Err(error) = self.check(DriveOperation::Read, offset_bytes, length_bytes) {
            return (Err(error), buf);
        }
        if self.memory {
            let mut buf = buf;
            let result = file.read_exact_at(&mut buf, offset_bytes).map(|()| buf.len());
            return (
                transfer_result(DriveOperation::Read, offset_bytes, length_bytes, result),
                buf,
            );
        }
        let (result, buf) = self.ring.read_at(file, offset_bytes, buf).await;
        (transfer_result(DriveOperation::Read, offset_bytes, length_bytes, result), buf)
    }

    async fn write_at(
        &self,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        let file = match self.file(DriveOperation::Write, offset_bytes, length_bytes) {
            Ok(file) => file,
            Err(error) => return (Err(error), buf),
        };
        if let Err(error) = self.check(DriveOperation::Write, offset_bytes, length_bytes) {
            return (Err(error), buf);
        }
        if self.memory {
            let result = file.write_all_at(&buf, offset_bytes).map(|()| buf.len());
            return (
                transfer_result(DriveOperation::Write, offset_bytes, length_bytes, result),
                buf,
            );
        }
        let (result, buf) = self.ring.write_at(file, offset_bytes, buf).await;
        (transfer_result(DriveOperation::Write, offset_bytes, length_bytes, result), buf)
    }

    async fn write_durable_at(
        &self,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf) {
        if self.memory {
            // RAM is the medium: a completed write is all there is (see `sync`).
            return self.write_at(offset_bytes, buf).await;
        }
        let length_bytes = buf.len() as u64;
        let file = match self.file(DriveOperation::Write, offset_bytes, length_bytes) {
            Ok(file) => file,
            Err(error) => return (Err(error), buf),
        };
        if let Err(error) = self.check(DriveOperation::Write, offset_bytes, length_bytes) {
            return (Err(error), buf);
        }
        let (result, buf) = self.ring.write_dsync_at(file, offset_bytes, buf).await;
        (transfer_result(DriveOperation::Write, offset_bytes, length_bytes, result), buf)
    }

    async fn sync(&self) -> Result<(), DriveError> {
        let file = self.file(DriveOperation::Sync, 0, 0)?;
        if self.memory {
            // RAM is the medium: a completed write is all there is (fdatasync on tmpfs does
            // nothing either).
            return Ok(());
        }
        self.ring.fdatasync(file).await.map_err(|source| DriveError::Io {
            operation: DriveOperation::Sync,
            offset_bytes: 0,
            length_bytes: 0,
            source,
        })
    }

    async fn punch_hole(&self, offset_bytes: u64, length_bytes: u64) -> Result<(), DriveError> {
        let file = self.file(DriveOperation::PunchHole, offset_bytes, length_bytes)?;
        self.check(DriveOperation::PunchHole, offset_bytes, length_bytes)?;
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        let mut result = if self.memory {
            fallocate_now(file, offset_bytes, length_bytes, mode)
        } else {
            self.ring.fallocate(file, offset_bytes, length_bytes, mode).await
        };
        if self.block_device
            && result.as_ref().is_err_and(|error| error.raw_os_error() == Some(libc::EOPNOTSUPP))
        {
            // The device cannot zero a range without writing it (no write-zeroes offload), so
            // the kernel refused the punch before touching anything: nothing was lost, and
            // zeroing the range (which the kernel may do by writing zeros) gives the same
            // promise, that the range reads as zeros.
            let zero = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
            result = self.ring.fallocate(file, offset_bytes, length_bytes, zero).await;
        }
        result.map_err(|source| DriveError::Io {
            operation: DriveOperation::PunchHole,
            offset_bytes,
            length_bytes,
            source,
        })
    }

    /// Finds the holes with SEEK_HOLE and SEEK_DATA (on ext4 and XFS a range fallocate left
    /// unwritten counts as a hole too), allocates each with one fallocate (so the filesystem
    /// gives it a few large extents at once, not one per write) and writes zeros over it with
    /// direct writes of 256 KiB, one at a time (which turns the unwritten extents written),
    /// then one fdatasync. A memory drive took all its RAM at open and a block device has no
    /// holes: nothing to do for either.
    async fn fill_holes(&self, offset_bytes: u64, length_bytes: u64) -> Result<u64, DriveError> {
        let file = self.file(DriveOperation::LayOut, offset_bytes, length_bytes)?;
        self.check(DriveOperation::LayOut, offset_bytes, length_bytes)?;
        if self.memory || self.block_device || length_bytes == 0 {
            return Ok(0);
        }
        let failed = |source| DriveError::Io {
            operation: DriveOperation::LayOut,
            offset_bytes,
            length_bytes,
            source,
        };
        let holes = hole_ranges(file, offset_bytes, offset_bytes + length_bytes).map_err(failed)?;
        let Some(largest) = holes.iter().map(|(start, end)| end - start).max() else {
            return Ok(0);
        };
        let mut zeros = AlignedBuf::new((largest as usize).min(FILL_WRITE_BYTES));
        let mut written = 0;
        for (start, end) in holes {
            self.ring.fallocate(file, start, end - start, 0).await.map_err(failed)?;
            let mut at = start;
            while at < end {
                let length = (end - at).min(zeros.capacity() as u64);
                zeros.set_len(length as usize);
                let (result, buf) = self.ring.write_at(file, at, zeros).await;
                zeros = buf;
                transfer_result(DriveOperation::LayOut, at, length, result)?;
                at += length;
                written += length;
            }
        }
        self.ring.fdatasync(file).await.map_err(failed)?;
        Ok(written)
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
}
