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
//! [`MemoryDrives`] are RAM-backed drives (`ferrite up --drive-backend memory`, NOT DURABLE):
//! anonymous memory files linked into a drive folder under the drive files' names, so the
//! functions above and [`crate::DriveFile`] handle them like drive files.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use engine::format::{HEADER_REGION_BYTES, SUPERBLOCK_SIZE_BYTES};
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
        if let Ok(existing) = read_superblock_of(&file, path)? {
            if existing.node_uuid != node_uuid {
                return Err(DriveSetupError::AlreadyFormatted {
                    path: path.clone(),
                    found: existing.node_uuid,
                    expected: node_uuid,
                });
            }
        }
        // One write of the whole header region: the superblock is its first block, so a torn
        // write leaves no valid superblock (its checksum fails) and the drive reads as
        // unformatted, as a half-formatted drive file does.
        let mut header = vec![0u8; HEADER_REGION_BYTES as usize];
        header[..SUPERBLOCK_SIZE_BYTES].copy_from_slice(&superblock.encode());
        file.write_all_at(&header, 0).map_err(io_error("write the superblock of", path))?;
        file.sync_all().map_err(io_error("fsync", path))?;
        drives.push(DriveInfo { path: path.clone(), superblock });
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
    let mut drives = Vec::with_capacity(usize::from(count));
    for (index, slot) in (0..count).zip(slots) {
        let Some(drive) = slot else {
            return Err(DriveSetupError::DriveIndexMissing { index, count });
        };
        drives.push(drive);
    }
    Ok(drives)
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
    /// Drive `index` is `files[index]`, linked as `drive_path(dir, index)`.
    files: Vec<File>,
}

impl MemoryDrives {
    /// Creates `count` memory drives of `size_bytes` each and links them into `dir` (created if
    /// needed), which must hold no drive file yet. They hold no superblock: format them with
    /// [`format_drives`] on `dir`.
    pub fn create(dir: &Path, count: u16, size_bytes: u64) -> Result<Self, DriveSetupError> {
        assert!(count > 0, "a node has at least one drive");
        fs::create_dir_all(dir).map_err(io_error("create directory", dir))?;
        let mut drives =
            Self { dir: dir.to_owned(), files: Vec::with_capacity(usize::from(count)) };
        for index in 0..count {
            let path = drive_path(dir, index);
            let file = memory_file(index).map_err(io_error("create the memory file for", &path))?;
            file.set_len(size_bytes).map_err(io_error("size", &path))?;
            let target = Path::new(PROC_SELF_FD).join(file.as_raw_fd().to_string());
            std::os::unix::fs::symlink(&target, &path)
                .map_err(io_error("link the memory drive", &path))?;
            // Only linked drives are pushed, so dropping `drives` removes only our own links.
            drives.files.push(file);
        }
        Ok(drives)
    }

    /// The drive folder the drives are linked into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn count(&self) -> u16 {
        u16::try_from(self.files.len()).unwrap_or(u16::MAX)
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
    fn refuses_impossible_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let error =
            message(format_drives(dir.path(), NODE, 1, DRIVE_SIZE_BYTES_MIN - 4096).unwrap_err());
        assert!(error.contains("drive_size_bytes"), "{error}");
    }
}
