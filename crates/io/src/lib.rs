//! Where Ferrite talks to the kernel about storage: io_uring rings, O_DIRECT drive files, and the
//! creation and checking of a node's drive files. Linux only.
//!
//! - [`Ring`]: one io_uring per data-path thread, driven from that thread's tokio
//!   current_thread runtime; batched submission, eventfd completions, cancel-safe buffers.
//! - [`DriveFile`]: `engine::Drive` over an O_DIRECT file through a `Ring`.
//! - [`format_drives`] / [`open_drives`]: the drive files of a node's data directory (the
//!   superblock; the engine formats the log area behind it).
//! - [`format_external_drives`] / [`open_external_drives`]: block devices or existing files
//!   given with `ferrite up --drive`, identified by their superblocks, not their paths.
//! - [`replace_drive_file`] / [`prepare_external_replacement`] / [`MemoryDrives::replace`]: a
//!   new drive in a failed or missing one's place (the engine rebuilds its contents);
//!   [`read_log_superblock`] reads a drive's log superblock at startup.
//! - [`MemoryDrives`]: RAM-backed drives (memfd), NOT DURABLE, linked into a drive folder so
//!   the functions above and `DriveFile` serve them like drive files.
//!
//! The engine decides what to read and write; this crate only moves the bytes.

mod drive_file;
mod drives;
mod ring;

pub use drive_file::DriveFile;
pub use drives::{
    blank_log_superblock, check_lay_out_space, drive_path, format_drives, format_external_drives,
    lay_out_drive_file, open_drives, open_external_drives, open_external_drives_found,
    prepare_external_replacement, probe_external_drive, read_log_superblock, replace_drive_file,
    DriveInfo, DriveKind, DriveSetupError, ExternalDrive, LogSuperblockFound, MemoryDrives,
};
pub use ring::{Ring, RingError, INFLIGHT_OPS_MAX, RING_ENTRIES};

#[cfg(test)]
mod tests;
