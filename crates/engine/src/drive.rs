//! The storage interface the engine is generic over: one drive, addressed in bytes.
//!
//! `io` implements it with io_uring over O_DIRECT files; `testing` implements it in RAM, with a
//! durable image kept apart from the written one and with injected faults. Buffers are owned and
//! handed back with the result, as io_uring needs: the drive owns the memory while the kernel
//! may touch it. Each data-path thread owns its own drive handles, so nothing here is `Send`.

use std::fmt;

use types::AlignedBuf;

/// What a drive was doing when it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriveOperation {
    Read,
    Write,
    Sync,
    PunchHole,
    LayOut,
}

impl fmt::Display for DriveOperation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Sync => "sync",
            Self::PunchHole => "punch hole",
            Self::LayOut => "lay out",
        })
    }
}

/// A failed drive operation. The caller decides what it means (the chunk store latches the drive
/// after a failed write, sync or punch).
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error("{operation} of {length_bytes} bytes at byte {offset_bytes} failed: {source}")]
    Io {
        operation: DriveOperation,
        offset_bytes: u64,
        length_bytes: u64,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{operation} of {length_bytes} bytes at byte {offset_bytes} moved only {done_bytes} bytes"
    )]
    ShortTransfer {
        operation: DriveOperation,
        offset_bytes: u64,
        length_bytes: u64,
        done_bytes: u64,
    },
    #[error(
        "{operation} of {length_bytes} bytes at byte {offset_bytes} lies outside the drive \
         ({size_bytes} bytes)"
    )]
    OutOfBounds { operation: DriveOperation, offset_bytes: u64, length_bytes: u64, size_bytes: u64 },
}

/// Checks one request against a drive, for every `Drive` implementation: offsets and lengths
/// are block aligned (a programmer error otherwise: the engine only issues such I/O, and O_DIRECT
/// needs it), and the range lies inside the drive (an error the caller sees).
pub fn check_request(
    operation: DriveOperation,
    offset_bytes: u64,
    length_bytes: u64,
    size_bytes: u64,
) -> Result<(), DriveError> {
    let block_bytes = u64::from(types::BLOCK_SIZE_BYTES);
    assert!(
        offset_bytes % block_bytes == 0 && length_bytes % block_bytes == 0,
        "{operation} of {length_bytes} bytes at {offset_bytes} is not block aligned"
    );
    if offset_bytes.checked_add(length_bytes).is_none_or(|end| end > size_bytes) {
        return Err(DriveError::OutOfBounds { operation, offset_bytes, length_bytes, size_bytes });
    }
    Ok(())
}

/// One drive, used by one data-path thread. Offsets and lengths are multiples of
/// [`types::BLOCK_SIZE_BYTES`]; implementations may assert it.
///
/// Durability: data written by `write_at` is durable once a `sync` that started after the write
/// completed has returned `Ok`; data written by `write_durable_at` is durable when it returns
/// `Ok`. A hole punched by `punch_hole` reads as zeros at once and is durable under the first
/// rule.
#[allow(async_fn_in_trait)] // Single-threaded by design: futures never cross threads.
pub trait Drive {
    /// Fills all of `buf` (its `len()`) from the drive at `offset_bytes`.
    async fn read_at(
        &self,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf);
    /// Writes all of `buf` (its `len()`) to the drive at `offset_bytes`.
    async fn write_at(
        &self,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf);
    /// Makes every write and punch completed before this call durable (fdatasync).
    async fn sync(&self) -> Result<(), DriveError>;
    /// Writes all of `buf` at `offset_bytes` and completes only once that write is durable
    /// (O_DSYNC on a file: the kernel flushes right after the write, with no round trip to the
    /// caller in between). Says nothing about other writes. By default a `write_at` then a
    /// `sync`, which is at least as strong.
    async fn write_durable_at(
        &self,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf) {
        let (result, buf) = self.write_at(offset_bytes, buf).await;
        match result {
            Ok(()) => (self.sync().await, buf),
            Err(error) => (Err(error), buf),
        }
    }
    /// Deallocates a range; it reads as zeros afterwards.
    async fn punch_hole(&self, offset_bytes: u64, length_bytes: u64) -> Result<(), DriveError>;
    /// Lays out a range: gives every hole in it (a part of a sparse file with no blocks behind
    /// it, which reads as zeros) blocks of its own by writing zeros over it, durably, and
    /// returns the bytes written. What the range reads as does not change. A later write there
    /// then overwrites blocks in place instead of making the filesystem allocate them (and, for
    /// a durable write, commit its journal) on the write's path.
    ///
    /// The caller makes sure nothing writes to the range meanwhile: a write landing in a hole
    /// after it was found could be overwritten with zeros. By default nothing is done: a device
    /// has no holes.
    async fn fill_holes(&self, offset_bytes: u64, length_bytes: u64) -> Result<u64, DriveError> {
        check_request(DriveOperation::LayOut, offset_bytes, length_bytes, self.size_bytes())?;
        Ok(0)
    }
    fn size_bytes(&self) -> u64;
}
