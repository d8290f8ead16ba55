//! Creating a node's drive files and checking them at startup (docs/format-drive.md).
//!
//! Formatting a drive: truncate the file to zero (dropping any stale bytes), extend it sparse to
//! its size, fsync; write the superblock, fsync; after all drives, fsync the directory. The
//! superblock goes last, so a drive whose formatting was interrupted has no valid superblock and
//! `open_drives` refuses it; the node then formats again only if it was still creating its data
//! directory (it records that the directory is complete after `format_drives` returns).
//!
//! These run on the control-plane thread with blocking std I/O (no ring needed), at startup. The
//! log area after the superblock's header region is formatted by the engine
//! (`engine::log::LogEngine::format`) through the data-path threads' rings.
//!
//! External drives (`ferrite up --drive PATH`) are block devices or existing regular files the
//! operator names: [`format_external_drives`] writes their header region (superblock first
//! block, zeros after) in place without resizing anything, and [`open_external_drives`] finds
//! each drive's index in its superblock, not in its path, so device renumbering (`/dev/loopN`,
//! `/dev/sdX`) between starts does not matter. A block device is sized with the BLKGETSIZE64
//! ioctl, and refused while it is mounted or held exclusively by another program.
//!
//! Replacing a drive (`ferrite drive replace`, or a drive file found missing at start on a node
//! with parity): [`replace_drive_file`] creates the new sparse file next to the old one under a
//! temporary name, writes its superblock and renames it over the old file, so the drive's name
//! always holds a whole drive; [`prepare_external_replacement`] checks and formats a new block
//! device or file in place; [`MemoryDrives::replace`] swaps in a new memory file. The engine
//! then writes the drive's log superblock and rebuilds its contents from the other drives.
//! [`read_log_superblock`] tells a drive whose log was never written (such a replacement, if the
//! node stopped before its rebuild began) from a formatted or damaged one.
//!
//! [`MemoryDrives`] are RAM-backed drives (`ferrite up --drive-backend memory`, NOT DURABLE):
//! anonymous memory files linked into a drive folder under the drive files' names, so the
//! functions above and [`crate::DriveFile`] handle them like drive files.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use std::sync::{Mutex, PoisonError};

use engine::format::{HEADER_REGION_BYTES, SUPERBLOCK_SIZE_BYTES};
use engine::log::format::{LogSuperblock, BLOCK_BYTES as LOG_BLOCK_BYTES, SUPERBLOCK_BLOCK};
use engine::{NodeUuid, Superblock, SuperblockError};

/// Why drive files could not be created or opened. Each message names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum DriveSetupError {
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot open {} for direct I/O (O_DIRECT): {source}; put the data directory on a \
         filesystem that supports it, such as ext4 or xfs (tmpfs does not)",
        path.display()
    )]
    DirectIoUnsupported {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("drive file {}: {source}", path.display())]
    Superblock {
        path: PathBuf,
        #[source]
        source: SuperblockError,
    },
    #[error(
        "no drive file {} found: {} holds no Ferrite drives; was the node started with another \
         data directory?",
        path.display(),
        path.parent().unwrap_or(path).display()
    )]
    NoDrives { path: PathBuf },
    #[error(
        "drive file {} is missing: the node has {expected_count} drives; restore the file, or \
         remove the whole data directory to start over (this destroys every volume)",
        path.display()
    )]
    Missing { path: PathBuf, expected_count: u16 },
    #[error(
        "drive file {} is {actual_bytes} bytes but its superblock records {recorded_bytes}: it \
         was truncated or replaced; restore it from a backup",
        path.display()
    )]
    SizeMismatch { path: PathBuf, recorded_bytes: u64, actual_bytes: u64 },
    #[error(
        "drive {} already belongs to node {found}, not to this node ({expected}); refusing \
         to format over it: remove it by hand (for a device: zero its first 4 KiB) if its data \
         is no longer needed",
        path.display()
    )]
    AlreadyFormatted { path: PathBuf, found: NodeUuid, expected: NodeUuid },
    #[error(
        "--drive {} is neither a block device nor a regular file; give a block device (such as \
         /dev/nvme1n1) or an existing file",
        path.display()
    )]
    NotADrive { path: PathBuf },
    #[error(
        "cannot lay out {:.1} GiB of drive files in {}: its filesystem has {:.1} GiB free; free \
         some space, use fewer or smaller drives, or leave the drive files sparse",
        *needed_bytes as f64 / GIB_F64,
        dir.display(),
        *available_bytes as f64 / GIB_F64
    )]
    NoSpaceToLayOut { dir: PathBuf, needed_bytes: u64, available_bytes: u64 },
    #[error(
        "--drive {} is mounted at {mount_point}; refusing to use it: unmount it first (Ferrite \
         overwrites the whole device)",
        path.display()
    )]
    Mounted { path: PathBuf, mount_point: String },
    #[error(
        "--drive {} is in use by another program (mounted, or held by LVM, md, a filesystem or \
         another ferrite); refusing to use it: release it first",
        path.display()
    )]
    InUse { path: PathBuf },
    #[error(
        "--drive {} holds {size_bytes} bytes, too small: a drive needs at least {min_bytes}",
        path.display()
    )]
    TooSmall { path: PathBuf, size_bytes: u64, min_bytes: u64 },
    #[error(
        "--drive {} belongs to node {found}, not to this node ({expected}): pass this node's \
         own drives with --drive",
        path.display()
    )]
    ForeignDrive { path: PathBuf, found: NodeUuid, expected: NodeUuid },
    #[error(
        "--drive {} and --drive {} both hold drive {index} of this node: the same drive was \
         given twice",
        first.display(),
        second.display()
    )]
    DuplicateDrive { index: u16, first: PathBuf, second: PathBuf },
    #[error(
        "drive {index} of this node's {count} drives is missing: none of the --drive paths \
         given holds it; pass every drive of the node with --drive (in any order)"
    )]
    DriveIndexMissing { index: u16, count: u16 },
    #[error(
        "--drive {} holds {actual_bytes} bytes but its superblock records {recorded_bytes}: it \
         shrank or was replaced; give the device the node was formatted on",
        path.display()
    )]
    DeviceShrank { path: PathBuf, recorded_bytes: u64, actual_bytes: u64 },
    #[error(
        "{} is drive {index} of this node already; give a new drive (a block device or file \
         that is not one of the node's drives)",
        path.display()
    )]
    DriveOfThisNode { path: PathBuf, index: u16 },
    #[error(
        "{} links into {PROC_SELF_FD} but is not a memory drive (the file it names is not in \
         RAM); memory drives exist only inside the process that created them",
        path.display()
    )]
    NotMemoryDrive { path: PathBuf },
}

/// A drive file whose superblock was validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriveInfo {
    pub path: PathBuf,
    pub superblock: Superblock,
}

/// The file of drive `index` in a data directory's drive folder.
pub fn drive_path(dir: &Path, index: u16) -> PathBuf {
    dir.join(format!("drive-{index:03}.img"))
}

fn io_error<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> DriveSetupError + 'a {
    move |source| DriveSetupError::Io { action, path: path.to_owned(), source }
}

/// What a drive file holds at byte 0, and its size.
struct FoundDrive {
    superblock: Result<Superblock, SuperblockError>,
    size_bytes: u64,
}

/// Reads and decodes a drive file's superblock; `Ok(None)` if the file does not exist.
fn read_superblock(path: &Path) -> Result<Option<FoundDrive>, DriveSetupError> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(io_error("open", path)(error)),
    };
    let size_bytes = file.metadata().map_err(io_error("read the size of", path))?.len();
    let mut bytes = Vec::with_capacity(SUPERBLOCK_SIZE_BYTES);
    (&mut file)
        .take(SUPERBLOCK_SIZE_BYTES as u64)
        .read_to_end(&mut bytes)
        .map_err(io_error("read the superblock of", path))?;
    Ok(Some(FoundDrive { superblock: Superblock::decode(&bytes), size_bytes }))
}

fn sync_directory(dir: &Path) -> Result<(), DriveSetupError> {
    File::open(dir)
        .and_then(|directory| directory.sync_all())
        .map_err(io_error("fsync directory", dir))
}

/// Creates `count` sparse drive files of `size_bytes` in `dir` for node `node_uuid`. Call it only
/// while creating a data directory: it re-formats files that hold no valid superblock or one of
/// this same node (an interrupted earlier attempt), and refuses files of another node.
pub fn format_drives(
    dir: &Path,
    node_uuid: NodeUuid,
    count: u16,
    size_bytes: u64,
) -> Result<Vec<DriveInfo>, DriveSetupError> {
    fs::create_dir_all(dir).map_err(io_error("create directory", dir))?;
    let mut drives = Vec::with_capacity(usize::from(count));
    for index in 0..count {
        let path = drive_path(dir, index);
        let superblock = Superblock::new(node_uuid, index, count, size_bytes)
            .map_err(|source| DriveSetupError::Superblock { path: path.clone(), source })?;
        if let Some(FoundDrive { superblock: Ok(existing), .. }) = read_superblock(&path)? {
            if existing.node_uuid != node_uuid {
                return Err(DriveSetupError::AlreadyFormatted {
                    path,
                    found: existing.node_uuid,
                    expected: node_uuid,
                });
            }
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_error("create", &path))?;
        // Drop whatever an earlier attempt left, then extend sparse: the drive reads as zeros.
        file.set_len(0).map_err(io_error("truncate", &path))?;
        file.set_len(size_bytes).map_err(io_error("size", &path))?;
        file.sync_all().map_err(io_error("fsync", &path))?;
        file.write_all_at(&superblock.encode(), 0)
            .map_err(io_error("write the superblock of", &path))?;
        file.sync_all().map_err(io_error("fsync", &path))?;
        drives.push(DriveInfo { path, superblock });
    }
    sync_directory(dir)?;
    Ok(drives)
}

/// The size of each write that lays out a drive file.
const LAY_OUT_WRITE_BYTES: usize = 4 << 20;

/// Writes zeros over a drive file from `from_bytes` (a multiple of 4 KiB) to its end with
/// O_DIRECT and syncs it, so the filesystem allocates every block now instead of on the log's
/// first pass over it (where each allocation adds a metadata update, on a journalled
/// filesystem a journal commit, to the sync of a group commit). fio lays out its files the same way before it measures. Call it on freshly
/// formatted drive files only; the log format may then skip its punch
/// (`engine::log::LogConfig::area_zeroed`).
pub fn lay_out_drive_file(path: &Path, from_bytes: u64) -> Result<(), DriveSetupError> {
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(io_error("open", path))?;
    let size_bytes = file.metadata().map_err(io_error("read the size of", path))?.len();
    let zeros = types::AlignedBuf::new(LAY_OUT_WRITE_BYTES);
    let mut offset = from_bytes;
    while offset < size_bytes {
        // The last write may be shorter; drive sizes are multiples of 4 KiB.
        let length = (size_bytes - offset).min(LAY_OUT_WRITE_BYTES as u64) as usize;
        file.write_all_at(&zeros[..length], offset).map_err(io_error("lay out", path))?;
        offset += length as u64;
    }
    file.sync_all().map_err(io_error("fsync", path))
}

const GIB_F64: f64 = (1u64 << 30) as f64;

/// Refuses to lay out drive files in `dir` (see [`lay_out_drive_file`]) that would write
/// `needed_bytes` in all unless its filesystem has that much free (for unprivileged users, as
/// `df` shows it): a full filesystem stops every process on the machine, not only this one.
pub fn check_lay_out_space(dir: &Path, needed_bytes: u64) -> Result<(), DriveSetupError> {
    let available_bytes = available_bytes(dir)?;
    if needed_bytes > available_bytes {
        return Err(DriveSetupError::NoSpaceToLayOut {
            dir: dir.to_owned(),
            needed_bytes,
            available_bytes,
        });
    }
    Ok(())
}

/// Bytes free for unprivileged users on the filesystem holding `path`.
fn available_bytes(path: &Path) -> Result<u64, DriveSetupError> {
    let file = File::open(path).map_err(io_error("open", path))?;
    // SAFETY: statvfs is plain integers, for which all zeros is a valid value.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `stat` is valid for writes of one statvfs for the call; the descriptor is open.
    let result = unsafe { libc::fstatvfs(file.as_raw_fd(), &mut stat) };
    if result != 0 {
        return Err(io_error("find the free space of", path)(io::Error::last_os_error()));
    }
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Opens the drive files of node `node_uuid` in `dir` and validates every superblock: same node,
/// right index, same drive count, size as recorded.
pub fn open_drives(dir: &Path, node_uuid: NodeUuid) -> Result<Vec<DriveInfo>, DriveSetupError> {
    let first = drive_path(dir, 0);
    let Some(found) = read_superblock(&first)? else {
        return Err(DriveSetupError::NoDrives { path: first });
    };
    let (superblock, size_bytes) = (found.superblock, found.size_bytes);
    let superblock =
        superblock.map_err(|source| DriveSetupError::Superblock { path: first.clone(), source })?;
    let count = superblock.drive_count;
    let mut drives = Vec::with_capacity(usize::from(count));
    drives.push(check_drive(first, superblock, size_bytes, node_uuid, 0, count)?);
    for index in 1..count {
        let path = drive_path(dir, index);
        let Some(found) = read_superblock(&path)? else {
            return Err(DriveSetupError::Missing { path, expected_count: count });
        };
        let size_bytes = found.size_bytes;
        let superblock = found
            .superblock
            .map_err(|source| DriveSetupError::Superblock { path: path.clone(), source })?;
        drives.push(check_drive(path, superblock, size_bytes, node_uuid, index, count)?);
    }
    Ok(drives)
}

fn check_drive(
    path: PathBuf,
    superblock: Superblock,
    actual_bytes: u64,
    node_uuid: NodeUuid,
    index: u16,
    count: u16,
) -> Result<DriveInfo, DriveSetupError> {
    if let Err(source) = superblock.validate(node_uuid, index, count) {
        return Err(DriveSetupError::Superblock { path, source });
    }
    if actual_bytes != superblock.drive_size_bytes {
        return Err(DriveSetupError::SizeMismatch {
            path,
            recorded_bytes: superblock.drive_size_bytes,
            actual_bytes,
        });
    }
    Ok(DriveInfo { path, superblock })
}

/// The name a replacement drive file is created under, next to the drive file it replaces,
/// before it is renamed over it.
fn replacement_path(dir: &Path, index: u16) -> PathBuf {
    dir.join(format!("drive-{index:03}.img.new"))
}

/// Puts a new, empty drive file in place of drive `index` of node `node_uuid` in `dir`: a sparse
/// file of `size_bytes` holding only the drive superblock (its log area reads as zeros), created
/// next to the old file and renamed over it, then the folder is synced. Whatever the old file
/// was (a failed drive, or nothing: a missing file) is gone from the folder afterwards; handles
/// already open on it keep working on the old file until they are closed.
///
/// A crash leaves either the old file or the whole new one under the drive's name (and at most a
/// stale temporary file, which the next replacement removes).
pub fn replace_drive_file(
    dir: &Path,
    node_uuid: NodeUuid,
    index: u16,
    count: u16,
    size_bytes: u64,
) -> Result<DriveInfo, DriveSetupError> {
    let path = drive_path(dir, index);
    let temporary = replacement_path(dir, index);
    let superblock = Superblock::new(node_uuid, index, count, size_bytes)
        .map_err(|source| DriveSetupError::Superblock { path: path.clone(), source })?;
    match fs::remove_file(&temporary) {
        Ok(()) => {}
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(io_error("remove the stale", &temporary)(error)),
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&temporary)
        .map_err(io_error("create", &temporary))?;
    file.set_len(size_bytes).map_err(io_error("size", &temporary))?;
    file.write_all_at(&superblock.encode(), 0)
        .map_err(io_error("write the superblock of", &temporary))?;
    file.sync_all().map_err(io_error("fsync", &temporary))?;
    drop(file);
    fs::rename(&temporary, &path).map_err(io_error("rename the new drive file over", &path))?;
    sync_directory(dir)?;
    Ok(DriveInfo { path, superblock })
}

/// What block 0 of a drive's log area holds: the engine's log superblock
/// (docs/format-log-v1.md), right after the drive's header region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogSuperblockFound {
    /// Only zeros: no log was ever written there. A replacement drive whose rebuild had not
    /// begun looks like this (its drive superblock is written, its log superblock not yet).
    Blank,
    Valid(LogSuperblock),
    /// Neither: damaged, cut short, or not a Ferrite log; the reason says which.
    Invalid(String),
}

/// Reads the log superblock of the drive at `path` (a drive file, a memory drive's link, or an
/// external drive) with plain reads, at startup, before the data path opens the drives.
pub fn read_log_superblock(path: &Path) -> Result<LogSuperblockFound, DriveSetupError> {
    let file = File::open(path).map_err(io_error("open", path))?;
    let offset_bytes = HEADER_REGION_BYTES + SUPERBLOCK_BLOCK * LOG_BLOCK_BYTES as u64;
    let mut block = vec![0u8; LOG_BLOCK_BYTES];
    match file.read_exact_at(&mut block, offset_bytes) {
        Ok(()) => {}
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
            return Ok(LogSuperblockFound::Invalid(
                "the drive ends before its log superblock".to_owned(),
            ));
        }
        Err(error) => return Err(io_error("read the log superblock of", path)(error)),
    }
    if block.iter().all(|byte| *byte == 0) {
        return Ok(LogSuperblockFound::Blank);
    }
    Ok(match LogSuperblock::decode(&block) {
        Ok(superblock) => LogSuperblockFound::Valid(superblock),
        Err(error) => LogSuperblockFound::Invalid(error.to_string()),
    })
}

/// Zeros the log superblock of the drive at `path` and syncs it, so the engine takes the
/// drive as one whose log was never written (`LogSuperblockFound::Blank`) and rebuilds it: for
/// a drive that comes back after the node ran without it, whose cells are stale. The drive's
/// own superblock (node, index) stays, so it is still found as that drive.
pub fn blank_log_superblock(path: &Path) -> Result<(), DriveSetupError> {
    let file = OpenOptions::new().write(true).open(path).map_err(io_error("open", path))?;
    let offset_bytes = HEADER_REGION_BYTES + SUPERBLOCK_BLOCK * LOG_BLOCK_BYTES as u64;
    file.write_all_at(&[0u8; LOG_BLOCK_BYTES], offset_bytes)
        .and_then(|()| file.sync_all())
        .map_err(io_error("clear the log superblock of", path))
}

/// What an external drive path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriveKind {
    BlockDevice,
    File,
}

/// An external drive (`--drive PATH`) as found: what it is and how many bytes it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalDrive {
    pub path: PathBuf,
    pub kind: DriveKind,
    pub size_bytes: u64,
}

/// BLKGETSIZE64, `_IOR(0x12, 114, size_t)` in <linux/fs.h>: a block device's size in bytes.
/// The generic ioctl encoding (direction 2 = read, size 8, type 0x12, number 114) holds on
/// every 64-bit architecture Linux uses the generic layout on (x86_64, aarch64, riscv64).
const BLKGETSIZE64: u64 = 0x8008_1272;

/// The size in bytes of an open block device (BLKGETSIZE64).
fn block_device_size_bytes(file: &File) -> io::Result<u64> {
    let mut size_bytes: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid and aligned for
    // that write for the call; the descriptor is open.
    let result = unsafe {
        libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, std::ptr::from_mut(&mut size_bytes))
    };
    if result != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size_bytes)
}

/// The size of an open drive: BLKGETSIZE64 for a block device, the file's length otherwise.
pub(crate) fn open_drive_size_bytes(file: &File, path: &Path) -> Result<u64, DriveSetupError> {
    use std::os::unix::fs::FileTypeExt;
    let metadata = file.metadata().map_err(io_error("read the size of", path))?;
    if metadata.file_type().is_block_device() {
        block_device_size_bytes(file).map_err(io_error("read the size (BLKGETSIZE64) of", path))
    } else {
        Ok(metadata.len())
    }
}

/// Where the block device `rdev` is mounted, from /proc/self/mountinfo (its third field is the
/// mounted device's `major:minor`); `None` if it is not, or the table cannot be read.
fn mount_point_of(rdev: u64) -> Option<String> {
    // The kernel's encoding of dev_t (glibc's gnu_dev_major / gnu_dev_minor).
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
    let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
    let wanted = format!("{major}:{minor}");
    let table = fs::read_to_string("/proc/self/mountinfo").ok()?;
    table.lines().find_map(|line| {
        let mut fields = line.split(' ');
        let device = fields.nth(2)?;
        let _root = fields.next()?;
        let mount_point = fields.next()?;
        (device == wanted).then(|| mount_point.to_owned())
    })
}

/// Opens an external drive. A block device is opened exclusively (O_EXCL) first, which the
/// kernel refuses while the device is mounted or claimed by another holder; that exclusive
/// descriptor is what is returned when `write` is false, so nothing else can claim the device
/// while it is read. Regular files are opened plainly.
fn open_external(path: &Path, write: bool) -> Result<(File, DriveKind), DriveSetupError> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
    let metadata = fs::metadata(path).map_err(io_error("find", path))?;
    let kind = if metadata.file_type().is_block_device() {
        DriveKind::BlockDevice
    } else if metadata.is_file() {
        DriveKind::File
    } else {
        return Err(DriveSetupError::NotADrive { path: path.to_owned() });
    };
    let mut options = OpenOptions::new();
    options.read(true).write(write);
    if kind == DriveKind::BlockDevice {
        options.custom_flags(libc::O_EXCL);
    }
    match options.open(path) {
        Ok(file) => Ok((file, kind)),
        Err(error)
            if kind == DriveKind::BlockDevice && error.raw_os_error() == Some(libc::EBUSY) =>
        {
            Err(match mount_point_of(metadata.rdev()) {
                Some(mount_point) => {
                    DriveSetupError::Mounted { path: path.to_owned(), mount_point }
                }
                None => DriveSetupError::InUse { path: path.to_owned() },
            })
        }
        Err(error) => Err(io_error("open", path)(error)),
    }
}

/// Finds what `path` names and how large it is: a block device (BLKGETSIZE64) or a regular
/// file (its length). Refuses anything else, and a device that is mounted or in use.
pub fn probe_external_drive(path: &Path) -> Result<ExternalDrive, DriveSetupError> {
    let (file, kind) = open_external(path, false)?;
    let size_bytes = open_drive_size_bytes(&file, path)?;
    Ok(ExternalDrive { path: path.to_owned(), kind, size_bytes })
}

/// Reads and decodes the superblock of an open external drive.
fn read_superblock_of(
    file: &File,
    path: &Path,
) -> Result<Result<Superblock, SuperblockError>, DriveSetupError> {
    let mut bytes = vec![0u8; SUPERBLOCK_SIZE_BYTES];
    match file.read_exact_at(&mut bytes, 0) {
        Ok(()) => Ok(Superblock::decode(&bytes)),
        // Shorter than a superblock: certainly not formatted.
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
            Ok(Err(SuperblockError::NotFormatted))
        }
        Err(error) => Err(io_error("read the superblock of", path)(error)),
    }
}

/// Formats external drives (`--drive`, in the order given: the i-th path becomes drive i) for
/// node `node_uuid`, each using its first `size_bytes` (at most its size). Call it only while
/// creating a node, like [`format_drives`]: it re-formats drives that hold no valid superblock
/// or one of this same node, and refuses drives of another node. Nothing is truncated or
/// resized: the header region (superblock, then zeros to 1 MiB) is written in place and synced.
pub fn format_external_drives(
    paths: &[PathBuf],
    node_uuid: NodeUuid,
    size_bytes: u64,
) -> Result<Vec<DriveInfo>, DriveSetupError> {
    let count = u16::try_from(paths.len()).unwrap_or(u16::MAX);
    let mut drives = Vec::with_capacity(paths.len());
    for (index, path) in (0..count).zip(paths) {
        let superblock = Superblock::new(node_uuid, index, count, size_bytes)
            .map_err(|source| DriveSetupError::Superblock { path: path.clone(), source })?;
        let (file, _kind) = open_external(path, true)?;
        let actual_bytes = open_drive_size_bytes(&file, path)?;
        if actual_bytes < size_bytes {
            return Err(DriveSetupError::TooSmall {
                path: path.clone(),
                size_bytes: actual_bytes,
                min_bytes: size_bytes,
            });
        }
        drives.push(write_external_superblock(&file, path, node_uuid, superblock)?);
    }
    Ok(drives)
}

/// Opens the external drives of node `node_uuid`, which has `count` drives, from `paths` given
/// in any order: each drive's index comes from its superblock. Returns them in index order.
/// Refuses a path that holds no drive of this node, a drive given twice, a missing index, and
/// a device smaller than its superblock records.
pub fn open_external_drives(
    paths: &[PathBuf],
    node_uuid: NodeUuid,
    count: u16,
) -> Result<Vec<DriveInfo>, DriveSetupError> {
    let slots = open_external_drives_found(paths, node_uuid, count)?;
    let mut drives = Vec::with_capacity(usize::from(count));
    for (index, slot) in (0..count).zip(slots) {
        let Some(drive) = slot else {
            return Err(DriveSetupError::DriveIndexMissing { index, count });
        };
        drives.push(drive);
    }
    Ok(drives)
}

/// [`open_external_drives`], with `None` for each index none of `paths` holds (a node with
/// parity may start without as many drives as its parity covers; the caller decides).
pub fn open_external_drives_found(
    paths: &[PathBuf],
    node_uuid: NodeUuid,
    count: u16,
) -> Result<Vec<Option<DriveInfo>>, DriveSetupError> {
    let mut slots: Vec<Option<DriveInfo>> = vec![None; usize::from(count)];
    for path in paths {
        let (file, _kind) = open_external(path, false)?;
        let actual_bytes = open_drive_size_bytes(&file, path)?;
        let superblock = read_superblock_of(&file, path)?
            .map_err(|source| DriveSetupError::Superblock { path: path.clone(), source })?;
        if superblock.node_uuid != node_uuid {
            return Err(DriveSetupError::ForeignDrive {
                path: path.clone(),
                found: superblock.node_uuid,
                expected: node_uuid,
            });
        }
        let index = superblock.drive_index;
        if let Err(source) = superblock.validate(node_uuid, index, count) {
            return Err(DriveSetupError::Superblock { path: path.clone(), source });
        }
        if actual_bytes < superblock.drive_size_bytes {
            return Err(DriveSetupError::DeviceShrank {
                path: path.clone(),
                recorded_bytes: superblock.drive_size_bytes,
                actual_bytes,
            });
        }
        // `validate` checked index < count.
        let slot = &mut slots[usize::from(index)];
        if let Some(first) = slot {
            return Err(DriveSetupError::DuplicateDrive {
                index,
                first: first.path.clone(),
                second: path.clone(),
            });
        }
        *slot = Some(DriveInfo { path: path.clone(), superblock });
    }
    Ok(slots)
}

/// Whether two paths name the same drive: the same block device (by device number, whatever
/// node in /dev names it) or the same file.
fn same_drive(first: &fs::Metadata, second: &fs::Metadata) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    if first.file_type().is_block_device() && second.file_type().is_block_device() {
        first.rdev() == second.rdev()
    } else {
        first.dev() == second.dev() && first.ino() == second.ino()
    }
}

/// Checks and formats the block device or file at `path` as the new drive `index` of node
/// `node_uuid` (which has `count` drives of `size_bytes` and whose current drives are
/// `current`, in index order): it must be a block device or regular file, not mounted or in use,
/// at least `size_bytes` large, not one of the node's other drives, and not another node's
/// drive. Its header region is then written in place (superblock first block, zeros after) and
/// synced, as [`format_external_drives`] does; its log area is the engine's to write.
pub fn prepare_external_replacement(
    path: &Path,
    node_uuid: NodeUuid,
    index: u16,
    count: u16,
    size_bytes: u64,
    current: &[PathBuf],
) -> Result<DriveInfo, DriveSetupError> {
    let superblock = Superblock::new(node_uuid, index, count, size_bytes)
        .map_err(|source| DriveSetupError::Superblock { path: path.to_owned(), source })?;
    let probed = probe_external_drive(path)?;
    if probed.size_bytes < size_bytes {
        return Err(DriveSetupError::TooSmall {
            path: path.to_owned(),
            size_bytes: probed.size_bytes,
            min_bytes: size_bytes,
        });
    }
    let metadata = fs::metadata(path).map_err(io_error("find", path))?;
    for (other, other_path) in (0u16..).zip(current) {
        if other == index {
            // The drive being replaced may take itself back (a drive that came back).
            continue;
        }
        if fs::metadata(other_path).is_ok_and(|found| same_drive(&found, &metadata)) {
            return Err(DriveSetupError::DriveOfThisNode { path: path.to_owned(), index: other });
        }
    }
    let (file, _kind) = open_external(path, true)?;
    write_external_superblock(&file, path, node_uuid, superblock)
}

/// Where a process finds its own open descriptors by number; a memory drive's link points here.
const PROC_SELF_FD: &str = "/proc/self/fd";

/// RAM-backed drives for `ferrite up --drive-backend memory`. NOT DURABLE: their bytes are gone
/// when the process ends, however it ends.
///
/// Each drive is an anonymous memory file (memfd_create(2)) extended sparse to its size; its RAM
/// is taken in full when the data path opens it ([`crate::DriveFile::open`] fallocates it), as
/// SPDK's malloc bdev does, so no I/O pays for page allocation. Its bytes
/// live as long as some descriptor of it is open: this value holds one per drive, and each
/// data-path thread opens its own. Each drive is linked into the drive folder under its drive
/// file name (`drive-000.img -> /proc/self/fd/N`), so [`format_drives`], [`open_drives`] and
/// [`crate::DriveFile::open`] find memory drives as they find drive files; only `DriveFile::open`
/// tells them apart: it opens them without O_DIRECT (the page cache is the medium itself) and
/// serves them with the kernel's copies inline rather than through the ring.
///
/// A link means something only inside this process and only while this value lives, so
/// dropping it removes the links before it closes the descriptors: no later open through a
/// stale link can reach another file that reuses a descriptor number.
#[derive(Debug)]
pub struct MemoryDrives {
    dir: PathBuf,
    size_bytes: u64,
    /// Drive `index` is `files[index]`, linked as `drive_path(dir, index)`. Behind a lock only
    /// so that [`MemoryDrives::replace`] can swap one; nothing on the data path takes it.
    files: Mutex<Vec<File>>,
}

impl MemoryDrives {
    /// Creates `count` memory drives of `size_bytes` each and links them into `dir` (created if
    /// needed), which must hold no drive file yet. They hold no superblock: format them with
    /// [`format_drives`] on `dir`.
    pub fn create(dir: &Path, count: u16, size_bytes: u64) -> Result<Self, DriveSetupError> {
        assert!(count > 0, "a node has at least one drive");
        fs::create_dir_all(dir).map_err(io_error("create directory", dir))?;
        let drives = Self {
            dir: dir.to_owned(),
            size_bytes,
            files: Mutex::new(Vec::with_capacity(usize::from(count))),
        };
        for index in 0..count {
            let path = drive_path(dir, index);
            let file = memory_file(index).map_err(io_error("create the memory file for", &path))?;
            file.set_len(size_bytes).map_err(io_error("size", &path))?;
            let target = Path::new(PROC_SELF_FD).join(file.as_raw_fd().to_string());
            std::os::unix::fs::symlink(&target, &path)
                .map_err(io_error("link the memory drive", &path))?;
            // Only linked drives are pushed, so dropping `drives` removes only our own links.
            drives.lock_files().push(file);
        }
        Ok(drives)
    }

    fn lock_files(&self) -> std::sync::MutexGuard<'_, Vec<File>> {
        // A swap either happened or not; a panicking holder leaves no half state.
        self.files.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts a new, empty memory drive in place of drive `index`, holding `superblock` (of that
    /// index): a new memory file linked under the drive's name (the link is replaced
    /// atomically). The old drive's RAM is freed once every handle open on it is closed.
    pub fn replace(&self, superblock: &Superblock) -> Result<DriveInfo, DriveSetupError> {
        let index = superblock.drive_index;
        assert!(index < self.count(), "memory drive {index} does not exist");
        let path = drive_path(&self.dir, index);
        let temporary = replacement_path(&self.dir, index);
        let file = memory_file(index).map_err(io_error("create the memory file for", &path))?;
        file.set_len(self.size_bytes).map_err(io_error("size", &path))?;
        file.write_all_at(&superblock.encode(), 0)
            .map_err(io_error("write the superblock of", &path))?;
        let target = Path::new(PROC_SELF_FD).join(file.as_raw_fd().to_string());
        match fs::remove_file(&temporary) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(io_error("remove the stale", &temporary)(error)),
        }
        let mut files = self.lock_files();
        std::os::unix::fs::symlink(&target, &temporary)
            .map_err(io_error("link the memory drive", &temporary))?;
        fs::rename(&temporary, &path).map_err(io_error("rename the new link over", &path))?;
        // The old file's descriptor closes here; the link already names the new one.
        files[usize::from(index)] = file;
        Ok(DriveInfo { path, superblock: *superblock })
    }

    /// The drive folder the drives are linked into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn count(&self) -> u16 {
        u16::try_from(self.lock_files().len()).unwrap_or(u16::MAX)
    }
}

impl Drop for MemoryDrives {
    fn drop(&mut self) {
        for index in 0..self.count() {
            // Nothing to hand an error to. A link left behind is harmless: `DriveFile::open`
            // refuses it unless it reaches a memory file (`NotMemoryDrive`), and the node
            // removes its whole scratch folder next.
            let _ = fs::remove_file(drive_path(&self.dir, index));
        }
        // The descriptors close after the links are gone (`files` drops next).
    }
}

/// A new anonymous memory file, closed on exec (a child never holds a node's RAM).
fn memory_file(index: u16) -> io::Result<File> {
    // The name shows in /proc/PID/fd and /proc/PID/maps, for whoever looks at the process.
    let name = format!("ferrite-drive-{index:03}\0");
    // SAFETY: `name` is NUL-terminated and outlives the call, which only reads it; the call
    // returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr().cast(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create: open, and owned by nothing else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Whether `path` is a memory drive's link (see [`MemoryDrives`]). `DriveFile::open` then opens
/// it without O_DIRECT, checks with [`is_in_memory`] that it reached a memory file, and serves
/// it inline.
pub(crate) fn is_memory_drive_link(path: &Path) -> bool {
    fs::read_link(path).is_ok_and(|target| target.starts_with(PROC_SELF_FD))
}

/// Whether an open file lives in RAM (on tmpfs, where memory files live too).
pub(crate) fn is_in_memory(file: &File, path: &Path) -> Result<bool, DriveSetupError> {
    // SAFETY: statfs is plain integers, for which all zeros is a valid value.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `stat` is valid for writes of one statfs for the call; the descriptor is open.
    let result = unsafe { libc::fstatfs(file.as_raw_fd(), &mut stat) };
    if result != 0 {
        return Err(io_error("find the filesystem of", path)(io::Error::last_os_error()));
    }
    Ok(stat.f_type == libc::TMPFS_MAGIC)
}

/// Writes `superblock` to an external drive (refusing a drive another node formatted): one
/// write of the whole header region, the superblock its first block, so a torn write leaves no
/// valid superblock (its checksum fails) and the drive reads as unformatted, as a
/// half-formatted drive file does.
fn write_external_superblock(
    file: &File,
    path: &Path,
    node_uuid: NodeUuid,
    superblock: Superblock,
) -> Result<DriveInfo, DriveSetupError> {
    if let Ok(existing) = read_superblock_of(file, path)? {
        if existing.node_uuid != node_uuid {
            return Err(DriveSetupError::AlreadyFormatted {
                path: path.to_owned(),
                found: existing.node_uuid,
                expected: node_uuid,
            });
        }
    }
    let mut header = vec![0u8; HEADER_REGION_BYTES as usize];
    header[..SUPERBLOCK_SIZE_BYTES].copy_from_slice(&superblock.encode());
    file.write_all_at(&header, 0).map_err(io_error("write the superblock of", path))?;
    file.sync_all().map_err(io_error("fsync", path))?;
    Ok(DriveInfo { path: path.to_owned(), superblock })
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::format::{DRIVE_SIZE_BYTES_MIN, HEADER_REGION_BYTES};

    const NODE: NodeUuid = NodeUuid([0xab; 16]);
    const OTHER: NodeUuid = NodeUuid([0xcd; 16]);
    const SIZE_BYTES: u64 = HEADER_REGION_BYTES + (192 << 20);

    fn formatted() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        format_drives(dir.path(), NODE, 3, SIZE_BYTES).unwrap();
        dir
    }

    fn message(error: DriveSetupError) -> String {
        error.to_string()
    }

    #[test]
    fn format_then_open() {
        let dir = formatted();
        let drives = open_drives(dir.path(), NODE).unwrap();
        assert_eq!(drives.len(), 3);
        for (index, drive) in drives.iter().enumerate() {
            assert_eq!(drive.path, drive_path(dir.path(), index as u16));
            assert_eq!(drive.superblock.drive_index, index as u16);
            assert_eq!(drive.superblock.drive_size_bytes, SIZE_BYTES);
            let metadata = fs::metadata(&drive.path).unwrap();
            assert_eq!(metadata.len(), SIZE_BYTES);
            use std::os::unix::fs::MetadataExt;
            assert!(metadata.blocks() * 512 < 1 << 20, "drive files are sparse");
        }
    }

    #[test]
    fn refuses_another_nodes_drives() {
        let dir = formatted();
        let error = message(open_drives(dir.path(), OTHER).unwrap_err());
        assert!(error.contains("drive-000.img"), "{error}");
        assert!(error.contains("belongs to node abababab-"), "{error}");
        let error = message(format_drives(dir.path(), OTHER, 3, SIZE_BYTES).unwrap_err());
        assert!(error.contains("refusing to format"), "{error}");
        // The same node may format again (an interrupted first start).
        format_drives(dir.path(), NODE, 3, SIZE_BYTES).unwrap();
    }

    #[test]
    fn refuses_damaged_or_missing_drives() {
        let check = |damage: &dyn Fn(&Path), expect: &[&str]| {
            let dir = formatted();
            damage(dir.path());
            let error = message(open_drives(dir.path(), NODE).unwrap_err());
            for part in expect {
                assert!(error.contains(part), "{error:?} lacks {part:?}");
            }
        };
        let write_at = |path: PathBuf, offset: u64, bytes: &[u8]| {
            let file = OpenOptions::new().write(true).open(path).unwrap();
            file.write_all_at(bytes, offset).unwrap();
        };
        check(&|dir| write_at(drive_path(dir, 1), 100, &[1]), &["drive-001.img", "checksum"]);
        check(&|dir| write_at(drive_path(dir, 2), 0, &[0; 4096]), &["drive-002.img", "no Ferrite"]);
        check(
            &|dir| {
                let mut bytes = [0u8; 4096];
                File::open(drive_path(dir, 1)).unwrap().read_exact_at(&mut bytes, 0).unwrap();
                bytes[16] = 9;
                let checksum = crc32c::crc32c(&bytes[..4092]);
                bytes[4092..].copy_from_slice(&checksum.to_le_bytes());
                write_at(drive_path(dir, 1), 0, &bytes);
            },
            &["drive-001.img", "version 9"],
        );
        // A data dir of the skeleton's chunk format (drive format version 1).
        check(
            &|dir| {
                let mut bytes = [0u8; 4096];
                File::open(drive_path(dir, 0)).unwrap().read_exact_at(&mut bytes, 0).unwrap();
                bytes[16] = 1;
                let checksum = crc32c::crc32c(&bytes[..4092]);
                bytes[4092..].copy_from_slice(&checksum.to_le_bytes());
                write_at(drive_path(dir, 0), 0, &bytes);
            },
            &[
                "drive-000.img",
                "this data dir was created by an older Ferrite format; move it away or start \
                 with a new --data-dir",
            ],
        );
        check(&|dir| fs::remove_file(drive_path(dir, 2)).unwrap(), &["drive-002.img", "missing"]);
        check(
            &|dir| fs::rename(drive_path(dir, 2), drive_path(dir, 1)).unwrap(),
            &["drive-001.img", "index 2"],
        );
        check(
            &|dir| {
                let file = OpenOptions::new().write(true).open(drive_path(dir, 1)).unwrap();
                file.set_len(SIZE_BYTES - 4096).unwrap();
            },
            &["drive-001.img", "truncated"],
        );
        let empty = tempfile::tempdir().unwrap();
        let error = message(open_drives(empty.path(), NODE).unwrap_err());
        assert!(error.contains("holds no Ferrite drives"), "{error}");
    }

    #[test]
    fn reformats_a_half_formatted_drive() {
        let dir = tempfile::tempdir().unwrap();
        // An interrupted format: the file exists, sized, with stale bytes and no superblock.
        let path = drive_path(dir.path(), 0);
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        file.set_len(SIZE_BYTES).unwrap();
        file.write_all_at(&[7; 4096], HEADER_REGION_BYTES).unwrap();
        assert!(open_drives(dir.path(), NODE).is_err());
        format_drives(dir.path(), NODE, 1, SIZE_BYTES).unwrap();
        let mut bytes = [1u8; 4096];
        file.read_exact_at(&mut bytes, HEADER_REGION_BYTES).unwrap();
        assert_eq!(bytes, [0; 4096], "stale bytes are dropped");
        assert_eq!(open_drives(dir.path(), NODE).unwrap().len(), 1);
    }

    /// External drives as regular files (block devices are covered by the cli's tests on loop
    /// devices, which need root): found by superblock in any order, checked as a set.
    #[test]
    fn external_drives_are_found_by_their_superblocks() {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> =
            (0..3).map(|index| dir.path().join(format!("d{index}"))).collect();
        for (index, path) in paths.iter().enumerate() {
            // The last one is larger: drives use the size given, not their own.
            let extra = if index == 2 { 8 << 20 } else { 0 };
            File::create(path).unwrap().set_len(SIZE_BYTES + extra).unwrap();
            // Stale bytes in the header region are overwritten by zeros.
            OpenOptions::new().write(true).open(path).unwrap().write_all_at(&[9; 8], 8192).unwrap();
        }
        let probed = probe_external_drive(&paths[2]).unwrap();
        assert_eq!((probed.kind, probed.size_bytes), (DriveKind::File, SIZE_BYTES + (8 << 20)));
        let formatted = format_external_drives(&paths, NODE, SIZE_BYTES).unwrap();
        assert_eq!(formatted.len(), 3);
        let mut bytes = [1u8; 8];
        File::open(&paths[0]).unwrap().read_exact_at(&mut bytes, 8192).unwrap();
        assert_eq!(bytes, [0; 8]);
        assert_eq!(fs::metadata(&paths[2]).unwrap().len(), SIZE_BYTES + (8 << 20), "not resized");

        let reversed: Vec<PathBuf> = paths.iter().rev().cloned().collect();
        let opened = open_external_drives(&reversed, NODE, 3).unwrap();
        let opened_paths: Vec<&PathBuf> = opened.iter().map(|drive| &drive.path).collect();
        assert_eq!(opened_paths, paths.iter().collect::<Vec<_>>(), "in index order");

        // Without drive 1: an error for a caller that needs every drive, a gap for one that
        // may start without it.
        let found =
            open_external_drives_found(&[paths[2].clone(), paths[0].clone()], NODE, 3).unwrap();
        let found: Vec<Option<&PathBuf>> =
            found.iter().map(|slot| slot.as_ref().map(|drive| &drive.path)).collect();
        assert_eq!(found, [Some(&paths[0]), None, Some(&paths[2])]);

        let check = |given: &[PathBuf], node: NodeUuid, expect: &str| {
            let error = message(open_external_drives(given, node, 3).unwrap_err());
            assert!(error.contains(expect), "{error:?} lacks {expect:?}");
        };
        check(&paths[..2], NODE, "drive 2 of this node's 3 drives is missing");
        check(&paths[1..], NODE, "drive 0 of this node's 3 drives is missing");
        check(&[paths[0].clone(), paths[1].clone(), paths[0].clone()], NODE, "given twice");
        check(&paths, OTHER, "belongs to node abababab-");
        check(&[dir.path().to_owned()], NODE, "neither a block device nor a regular file");
        check(&[dir.path().join("absent")], NODE, "absent");
        let error = message(format_external_drives(&paths, OTHER, SIZE_BYTES).unwrap_err());
        assert!(error.contains("refusing to format over it"), "{error}");
        let error =
            message(format_external_drives(&paths, NODE, SIZE_BYTES + (4 << 20)).unwrap_err());
        assert!(error.contains("too small"), "{error}");
        // Shrunk below what its superblock records.
        OpenOptions::new().write(true).open(&paths[1]).unwrap().set_len(SIZE_BYTES - 4096).unwrap();
        check(&paths, NODE, "shrank");
    }

    #[test]
    fn a_replaced_drive_file_is_new_and_whole() {
        let dir = formatted();
        let old = drive_path(dir.path(), 1);
        OpenOptions::new()
            .write(true)
            .open(&old)
            .unwrap()
            .write_all_at(&[7; 4096], 1 << 20)
            .unwrap();
        // A stale temporary file of an earlier attempt is replaced too.
        fs::write(replacement_path(dir.path(), 1), b"stale").unwrap();
        let replaced = replace_drive_file(dir.path(), NODE, 1, 3, SIZE_BYTES).unwrap();
        assert_eq!(replaced.path, old);
        assert_eq!(replaced.superblock.drive_index, 1);
        assert!(!replacement_path(dir.path(), 1).exists());
        let mut bytes = [1u8; 4096];
        File::open(&old).unwrap().read_exact_at(&mut bytes, 1 << 20).unwrap();
        assert_eq!(bytes, [0; 4096], "the new file holds nothing of the old one");
        assert_eq!(read_log_superblock(&old).unwrap(), LogSuperblockFound::Blank);
        assert_eq!(open_drives(dir.path(), NODE).unwrap().len(), 3, "valid as drive 1");
        // A missing file gets one too.
        fs::remove_file(drive_path(dir.path(), 2)).unwrap();
        replace_drive_file(dir.path(), NODE, 2, 3, SIZE_BYTES).unwrap();
        assert_eq!(open_drives(dir.path(), NODE).unwrap().len(), 3);
    }

    #[test]
    fn log_superblocks_are_told_apart() {
        use engine::erasure::ErasureScheme;
        use engine::log::format::Geometry;
        let dir = formatted();
        let path = drive_path(dir.path(), 0);
        assert_eq!(read_log_superblock(&path).unwrap(), LogSuperblockFound::Blank);
        let scheme = ErasureScheme::new(2, 1).unwrap();
        let geometry =
            Geometry::coded(3, SIZE_BYTES, 1 << 20, HEADER_REGION_BYTES, scheme).unwrap();
        let superblock =
            LogSuperblock { node_uuid: NODE, drive_index: 0, geometry, rebuilding: false };
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&superblock.encode(), HEADER_REGION_BYTES).unwrap();
        let LogSuperblockFound::Valid(found) = read_log_superblock(&path).unwrap() else {
            panic!("the log superblock written is not found");
        };
        assert_eq!(found.geometry.scheme(), scheme);
        file.write_all_at(&[1], HEADER_REGION_BYTES + 100).unwrap();
        let found = read_log_superblock(&path).unwrap();
        assert!(
            matches!(&found, LogSuperblockFound::Invalid(reason) if reason.contains("checksum"))
        );
        let short = dir.path().join("short");
        File::create(&short).unwrap().set_len(HEADER_REGION_BYTES).unwrap();
        assert!(matches!(read_log_superblock(&short).unwrap(), LogSuperblockFound::Invalid(_)));

        // A drive back after the node ran without it: its log is forgotten, its drive
        // superblock kept.
        file.write_all_at(&superblock.encode(), HEADER_REGION_BYTES).unwrap();
        assert!(matches!(read_log_superblock(&path).unwrap(), LogSuperblockFound::Valid(_)));
        blank_log_superblock(&path).unwrap();
        assert_eq!(read_log_superblock(&path).unwrap(), LogSuperblockFound::Blank);
        assert_eq!(open_drives(dir.path(), NODE).unwrap().len(), 3, "still drive 0 of the node");
    }

    #[test]
    fn external_replacements_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> =
            (0..3).map(|index| dir.path().join(format!("d{index}"))).collect();
        for path in &paths {
            File::create(path).unwrap().set_len(SIZE_BYTES).unwrap();
        }
        format_external_drives(&paths, NODE, SIZE_BYTES).unwrap();
        let check = |path: &Path, expect: &str| {
            let error = message(
                prepare_external_replacement(path, NODE, 1, 3, SIZE_BYTES, &paths).unwrap_err(),
            );
            assert!(error.contains(expect), "{error:?} lacks {expect:?}");
        };
        check(&paths[0], "is drive 0 of this node already");
        let link = dir.path().join("link-to-d2");
        std::os::unix::fs::symlink(&paths[2], &link).unwrap();
        check(&link, "is drive 2 of this node already");
        let small = dir.path().join("small");
        File::create(&small).unwrap().set_len(SIZE_BYTES - (1 << 20)).unwrap();
        check(&small, "too small");
        check(dir.path(), "neither a block device nor a regular file");
        let foreign = dir.path().join("foreign");
        File::create(&foreign).unwrap().set_len(SIZE_BYTES).unwrap();
        format_external_drives(std::slice::from_ref(&foreign), OTHER, SIZE_BYTES).unwrap();
        check(&foreign, "refusing to format over it");

        let new = dir.path().join("new");
        File::create(&new).unwrap().set_len(SIZE_BYTES + (4 << 20)).unwrap();
        let info = prepare_external_replacement(&new, NODE, 1, 3, SIZE_BYTES, &paths).unwrap();
        assert_eq!(info.superblock.drive_index, 1);
        let mut current = paths.clone();
        current[1] = new.clone();
        let opened = open_external_drives(&current, NODE, 3).unwrap();
        assert_eq!(opened[1].path, new);
        // The drive being replaced may be given back as its own replacement.
        prepare_external_replacement(&new, NODE, 1, 3, SIZE_BYTES, &current).unwrap();
    }

    #[test]
    fn memory_drives_are_replaced_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let drives = MemoryDrives::create(&dir.path().join("drives"), 2, SIZE_BYTES).unwrap();
        format_drives(drives.dir(), NODE, 2, SIZE_BYTES).unwrap();
        let path = drive_path(drives.dir(), 1);
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&[5; 4096], 1 << 20)
            .unwrap();
        let superblock = Superblock::new(NODE, 1, 2, SIZE_BYTES).unwrap();
        let info = drives.replace(&superblock).unwrap();
        assert_eq!(info.path, path);
        assert!(is_memory_drive_link(&path));
        let mut bytes = [1u8; 4096];
        File::open(&path).unwrap().read_exact_at(&mut bytes, 1 << 20).unwrap();
        assert_eq!(bytes, [0; 4096]);
        assert_eq!(open_drives(drives.dir(), NODE).unwrap().len(), 2);
        assert_eq!(drives.count(), 2);
    }

    #[test]
    fn refuses_impossible_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let error =
            message(format_drives(dir.path(), NODE, 1, DRIVE_SIZE_BYTES_MIN - 4096).unwrap_err());
        assert!(error.contains("drive_size_bytes"), "{error}");
    }
}
