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
//! [`MemoryDrives`] are RAM-backed drives (`ferrite up --drive-backend memory`, NOT DURABLE):
//! anonymous memory files linked into a drive folder under the drive files' names, so the
//! functions above and [`crate::DriveFile`] handle them like drive files.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use engine::format::SUPERBLOCK_SIZE_BYTES;
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
        "drive file {} already belongs to node {found}, not to this node ({expected}); refusing \
         to format over it: remove it by hand if its data is no longer needed",
        path.display()
    )]
    AlreadyFormatted { path: PathBuf, found: NodeUuid, expected: NodeUuid },
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

/// Where a process finds its own open descriptors by number; a memory drive's link points here.
const PROC_SELF_FD: &str = "/proc/self/fd";

/// RAM-backed drives for `ferrite up --drive-backend memory`. NOT DURABLE: their bytes are gone
/// when the process ends, however it ends.
///
/// Each drive is an anonymous memory file (memfd_create(2)) extended sparse to its size: RAM is
/// taken only as blocks are written, and given back when the engine punches holes. Its bytes
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

    #[test]
    fn refuses_impossible_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let error =
            message(format_drives(dir.path(), NODE, 1, DRIVE_SIZE_BYTES_MIN - 4096).unwrap_err());
        assert!(error.contains("drive_size_bytes"), "{error}");
    }
}
