//! Tests of the ring on real O_DIRECT files (the temp dir is ext4 here), of memory drives, and
//! the engine's conformance check of the log engine (writers on several handles, GC,
//! checkpoints, restarts, crashes that abandon everything in flight, a deleted volume) over
//! `DriveFile`s through io_uring, on drive files and on memory drives.

use std::fs::{File, OpenOptions};
use std::future::Future;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Waker};

use engine::format::HEADER_REGION_BYTES;
use engine::log::LogConfig;
use engine::testing::{check_log_engine, join_all, CheckConfig, LocalBoxFuture};
use engine::{Drive, DriveError, NodeUuid};
use types::AlignedBuf;

use crate::{
    check_lay_out_space, drive_path, format_drives, open_drives, DriveFile, DriveSetupError,
    MemoryDrives, Ring, INFLIGHT_OPS_MAX,
};

const BLOCK: usize = 4096;
/// Bounds the waits for the ring to settle: 1 ms sleeps.
const SETTLE_SLEEPS_MAX: usize = 10_000;

/// Runs a test on a current_thread runtime with a ring and its driver, as a data-path thread does.
fn run_on_ring<F, Fut>(test: F) -> Fut::Output
where
    F: FnOnce(Rc<Ring>) -> Fut,
    Fut: Future,
{
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let ring = Ring::new().unwrap();
        let driver = tokio::task::spawn_local(Rc::clone(&ring).run());
        let output = test(ring).await;
        driver.abort();
        output
    })
}

fn direct_file(dir: &Path, size_bytes: u64) -> Rc<File> {
    let path = dir.join("data");
    File::create(&path).unwrap().set_len(size_bytes).unwrap();
    let file =
        OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(&path).unwrap();
    Rc::new(file)
}

fn pattern(seed: u8, length: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::new(length);
    for (index, byte) in buf.iter_mut().enumerate() {
        *byte = seed.wrapping_add((index / 7) as u8);
    }
    buf
}

async fn settle(ring: &Ring) {
    for _ in 0..SETTLE_SLEEPS_MAX {
        if ring.inflight() == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("{} operations still hold slots", ring.inflight());
}

#[test]
fn reads_writes_syncs_and_punches() {
    let dir = tempfile::tempdir().unwrap();
    let file = direct_file(dir.path(), 1 << 20);
    run_on_ring(|ring| async move {
        let dir = dir;
        let (result, _) = ring.write_at(&file, 4096, pattern(3, 2 * BLOCK)).await;
        assert_eq!(result.unwrap(), 2 * BLOCK);
        ring.fdatasync(&file).await.unwrap();
        let (result, read) = ring.read_at(&file, 4096, AlignedBuf::new(2 * BLOCK)).await;
        assert_eq!(result.unwrap(), 2 * BLOCK);
        assert_eq!(&read[..], &pattern(3, 2 * BLOCK)[..]);
        let blocks_before = file.metadata().unwrap().blocks();
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        ring.fallocate(&file, 4096, 4096, mode).await.unwrap();
        let (result, read) = ring.read_at(&file, 4096, AlignedBuf::new(2 * BLOCK)).await;
        result.unwrap();
        assert!(read[..BLOCK].iter().all(|b| *b == 0), "a punched block reads as zeros");
        assert_eq!(&read[BLOCK..], &pattern(3, 2 * BLOCK)[BLOCK..]);
        let metadata = file.metadata().unwrap();
        assert_eq!(metadata.len(), 1 << 20, "KEEP_SIZE keeps the size");
        assert!(metadata.blocks() < blocks_before, "the hole frees space");
        // Errors come back as errors: writing through a read-only descriptor.
        let read_only = Rc::new(File::open(dir.path().join("data")).unwrap());
        let (result, _) = ring.write_at(&read_only, 0, pattern(1, BLOCK)).await;
        assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::EBADF));
        assert_eq!(ring.inflight(), 0);
    });
}

#[test]
fn many_concurrent_operations_wait_for_slots() {
    const OPERATIONS: usize = 1000;
    let dir = tempfile::tempdir().unwrap();
    let file = direct_file(dir.path(), (OPERATIONS * BLOCK) as u64);
    run_on_ring(|ring| async move {
        let tasks: Vec<_> = (0..OPERATIONS)
            .map(|index| {
                let (ring, file) = (Rc::clone(&ring), Rc::clone(&file));
                tokio::task::spawn_local(async move {
                    let offset = (index * BLOCK) as u64;
                    let (result, _) =
                        ring.write_at(&file, offset, pattern(index as u8, BLOCK)).await;
                    assert_eq!(result.unwrap(), BLOCK);
                    assert!(ring.inflight() <= INFLIGHT_OPS_MAX);
                })
            })
            .collect();
        tokio::task::yield_now().await;
        assert!(ring.inflight() <= INFLIGHT_OPS_MAX);
        for task in tasks {
            task.await.unwrap();
        }
        let (result, read) = ring.read_at(&file, 0, AlignedBuf::new(OPERATIONS * BLOCK)).await;
        result.unwrap();
        for (index, block) in read.chunks(BLOCK).enumerate() {
            assert_eq!(block, &pattern(index as u8, BLOCK)[..], "block {index}");
        }
        assert_eq!(ring.inflight(), 0);
    });
}

#[test]
fn dropped_futures_leave_the_ring_consistent() {
    const OPERATIONS: usize = INFLIGHT_OPS_MAX + 150;
    let dir = tempfile::tempdir().unwrap();
    let file = direct_file(dir.path(), 64 << 20);
    run_on_ring(|ring| async move {
        let mut context = Context::from_waker(Waker::noop());
        let mut futures: Vec<LocalBoxFuture<'_, _>> = (0..OPERATIONS)
            .map(|index| {
                let offset = (index * 64 * 1024) as u64;
                let future: LocalBoxFuture<'_, _> =
                    Box::pin(ring.read_at(&file, offset, AlignedBuf::new(64 * 1024)));
                future
            })
            .collect();
        // One poll each: the first INFLIGHT_OPS_MAX are submitted, the rest wait for a slot.
        for future in &mut futures {
            let _ = future.as_mut().poll(&mut context);
        }
        assert_eq!(ring.inflight(), INFLIGHT_OPS_MAX);
        // Keep a few waiting futures, drop everything else: in-flight ones (the kernel still
        // owns their buffers) and waiting ones (some of which were just granted a slot).
        let kept: Vec<LocalBoxFuture<'_, _>> = futures.drain(OPERATIONS - 10..).collect();
        let mut index = 0;
        futures.retain(|_| {
            index += 1;
            index % 2 == 0
        });
        drop(futures);
        let outputs = join_all(kept).await;
        for (result, buf) in outputs {
            assert_eq!(result.unwrap(), 64 * 1024);
            assert!(buf.iter().all(|b| *b == 0));
        }
        settle(&ring).await;
        // The ring still works.
        let (result, _) = ring.write_at(&file, 0, pattern(9, BLOCK)).await;
        result.unwrap();
        let (result, read) = ring.read_at(&file, 0, AlignedBuf::new(BLOCK)).await;
        result.unwrap();
        assert_eq!(&read[..], &pattern(9, BLOCK)[..]);
    });
}

#[test]
fn dropping_the_ring_waits_for_operations_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let file = direct_file(dir.path(), 64 << 20);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let local = tokio::task::LocalSet::new();
    let file_for_test = Rc::clone(&file);
    local.block_on(&runtime, async move {
        let ring = Ring::new().unwrap();
        let mut context = Context::from_waker(Waker::noop());
        for index in 0..64u64 {
            let mut read: Pin<Box<dyn Future<Output = _>>> =
                Box::pin(ring.read_at(&file_for_test, index << 20, AlignedBuf::new(1 << 20)));
            let _ = read.as_mut().poll(&mut context);
        }
        // No driver ever ran: the 64 reads were pushed but never submitted; the drop submits
        // them and waits for every one before freeing their buffers.
        assert_eq!(ring.inflight(), 64);
        drop(ring);
    });
    drop(file);
}

#[test]
fn ring_needs_a_runtime() {
    assert!(matches!(Ring::new(), Err(crate::RingError::NoRuntime)));
}

#[test]
fn drive_file_checks_bounds_and_names_files() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.img");
    run_on_ring(|ring| async move {
        let error = DriveFile::open(&missing, &ring).unwrap_err().to_string();
        assert!(error.contains("absent.img"), "{error}");
        let path = dir.path().join("drive.img");
        File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let drive = DriveFile::open(&path, &ring).unwrap();
        assert!(!drive.is_memory());
        assert_eq!(drive.size_bytes(), 1 << 20);
        let (result, _) = drive.read_at(1 << 20, AlignedBuf::new(BLOCK)).await;
        assert!(matches!(result, Err(DriveError::OutOfBounds { .. })), "{result:?}");
        let (result, _) = drive.write_at((1 << 20) - 4096, pattern(1, BLOCK)).await;
        result.unwrap();
        drive.sync().await.unwrap();
        drive.punch_hole(0, 1 << 20).await.unwrap();
        let (result, read) = drive.read_at((1 << 20) - 4096, AlignedBuf::new(BLOCK)).await;
        result.unwrap();
        assert!(read.iter().all(|b| *b == 0));
        // A durable (RWF_DSYNC) write lands like a plain one and is checked the same way.
        let (result, _) = drive.write_durable_at(8192, pattern(7, 2 * BLOCK)).await;
        result.unwrap();
        let (result, read) = drive.read_at(8192, AlignedBuf::new(2 * BLOCK)).await;
        result.unwrap();
        assert_eq!(&read[..], &pattern(7, 2 * BLOCK)[..]);
        let (result, _) = drive.write_durable_at(1 << 20, pattern(1, BLOCK)).await;
        assert!(matches!(result, Err(DriveError::OutOfBounds { .. })), "{result:?}");
    });
}

/// The stand-in for a drive a node started without: every operation fails, saying why, and
/// nothing is read or written anywhere.
#[test]
fn a_missing_drive_fails_every_operation() {
    run_on_ring(|ring| async move {
        let drive = DriveFile::missing(2, &ring);
        assert!(drive.path().display().to_string().contains("drive 2"));
        let not_found = |error: &DriveError| match error {
            DriveError::Io { source, .. } => {
                source.kind() == std::io::ErrorKind::NotFound
                    && source.to_string().contains("ferrite drive replace")
            }
            _ => false,
        };
        let (result, _) = drive.read_at(0, AlignedBuf::new(BLOCK)).await;
        assert!(result.as_ref().is_err_and(not_found), "{result:?}");
        let (result, _) = drive.write_at(0, pattern(1, BLOCK)).await;
        assert!(result.as_ref().is_err_and(not_found), "{result:?}");
        let (result, _) = drive.write_durable_at(0, pattern(1, BLOCK)).await;
        assert!(result.as_ref().is_err_and(not_found), "{result:?}");
        let result = drive.sync().await;
        assert!(result.as_ref().is_err_and(not_found), "{result:?}");
        let result = drive.punch_hole(0, 4096).await;
        assert!(result.as_ref().is_err_and(not_found), "{result:?}");
        let result = drive.fill_holes(0, 4096).await;
        assert!(result.as_ref().is_err_and(not_found), "{result:?}");
        assert_eq!(ring.inflight(), 0, "nothing reached the ring");
    });
}

#[test]
fn fill_holes_allocates_the_holes_of_a_range_and_keeps_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("drive.img");
    let size: u64 = 8 << 20;
    File::create(&path).unwrap().set_len(size).unwrap();
    let allocated = |path: &Path| std::fs::metadata(path).unwrap().blocks() * 512;
    run_on_ring(|ring| async move {
        let drive = DriveFile::open(&path, &ring).unwrap();
        // Data at 1 MiB + 8 KiB (two blocks); the rest of the file is a hole.
        let (result, _) = drive.write_at((1 << 20) + 8192, pattern(3, 2 * BLOCK)).await;
        result.unwrap();
        drive.sync().await.unwrap();
        let before = allocated(&path);
        assert!(before < (64 << 10), "{before} bytes allocated in a sparse file");
        // Lay out 1 MiB .. 4 MiB: everything but the two data blocks is a hole.
        let written = drive.fill_holes(1 << 20, 3 << 20).await.unwrap();
        assert_eq!(written, (3 << 20) - 2 * BLOCK as u64);
        assert!(allocated(&path) >= before + written, "the holes now have blocks");
        let (result, read) = drive.read_at((1 << 20) + 8192, AlignedBuf::new(2 * BLOCK)).await;
        result.unwrap();
        assert_eq!(&read[..], &pattern(3, 2 * BLOCK)[..], "the data was not touched");
        let (result, read) = drive.read_at(1 << 20, AlignedBuf::new(8192)).await;
        result.unwrap();
        assert!(read.iter().all(|byte| *byte == 0));
        // Done once: the range has no holes left. Outside it the file is still sparse.
        assert_eq!(drive.fill_holes(1 << 20, 3 << 20).await.unwrap(), 0);
        assert!(allocated(&path) < before + written + (1 << 20));
        assert!(matches!(
            drive.fill_holes(size - 4096, 8192).await,
            Err(DriveError::OutOfBounds { .. })
        ));
    });
}

#[test]
fn log_engine_conformance_over_io_uring() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeUuid([0x5a; 16]);
    let drive_size_bytes = HEADER_REGION_BYTES + (96 << 20);
    format_drives(dir.path(), node, 3, drive_size_bytes).unwrap();
    let infos = open_drives(dir.path(), node).unwrap();
    run_on_ring(|ring| async move {
        let open = || -> Vec<DriveFile> {
            infos.iter().map(|info| DriveFile::open(&info.path, &ring).unwrap()).collect()
        };
        let log_config = LogConfig::for_drives(node, drive_size_bytes, 3);
        assert_eq!(log_config.unit_bytes, 256 << 10, "small drives get small units");
        let config = CheckConfig { seed: 7, volume_blocks: 4000, ..CheckConfig::default() };
        let report = check_log_engine(open, &log_config, &config).await;
        assert!(report.blocks_verified > 1000, "{report:?}");
        // The sparse drive files had their next segments laid out while writers ran.
        assert!(report.laid_out_bytes > 0, "{report:?}");
        assert_eq!((report.restarts, report.crashes), (2, 2), "{report:?}");
        settle(&ring).await;
    });
}

#[test]
fn memory_drives_format_open_serve_and_vanish() {
    let dir = tempfile::tempdir().unwrap();
    let drives_dir = dir.path().join("drives");
    let node = NodeUuid([0x3c; 16]);
    let size_bytes = HEADER_REGION_BYTES + (64 << 20);
    let memory = MemoryDrives::create(&drives_dir, 2, size_bytes).unwrap();
    assert_eq!((memory.dir(), memory.count()), (drives_dir.as_path(), 2));
    format_drives(&drives_dir, node, 2, size_bytes).unwrap();
    let infos = open_drives(&drives_dir, node).unwrap();
    assert_eq!(infos.len(), 2);
    // fs::metadata follows the link to the memory file: its size, and the RAM it holds.
    let ram_bytes = |index: u16| fs_blocks(&drive_path(&drives_dir, index)) * 512;
    assert_eq!(std::fs::metadata(&infos[1].path).unwrap().len(), size_bytes);
    assert!(ram_bytes(1) <= 64 << 10, "memory drives are sparse: {}", ram_bytes(1));
    run_on_ring(|ring| async move {
        let drive = DriveFile::open(&infos[1].path, &ring).unwrap();
        assert!(drive.is_memory());
        assert_eq!(drive.size_bytes(), size_bytes);
        let offset = HEADER_REGION_BYTES + (1 << 20);
        let (result, _) = drive.write_at(offset, pattern(5, 64 * BLOCK)).await;
        result.unwrap();
        drive.sync().await.unwrap();
        // Another thread's handle (its own descriptor) sees the same bytes.
        let other = DriveFile::open(&infos[1].path, &ring).unwrap();
        let (result, read) = other.read_at(offset, AlignedBuf::new(64 * BLOCK)).await;
        result.unwrap();
        assert_eq!(&read[..], &pattern(5, 64 * BLOCK)[..]);
        assert!(ram_bytes(1) >= (64 * BLOCK) as u64);
        let held = ram_bytes(1);
        other.punch_hole(offset, (64 * BLOCK) as u64).await.unwrap();
        assert!(ram_bytes(1) < held, "a hole gives the RAM back");
        let (result, read) = drive.read_at(offset, AlignedBuf::new(BLOCK)).await;
        result.unwrap();
        assert!(read.iter().all(|b| *b == 0));
        let (result, _) = drive.read_at(size_bytes, AlignedBuf::new(BLOCK)).await;
        assert!(matches!(result, Err(DriveError::OutOfBounds { .. })), "{result:?}");
        assert_eq!(ring.inflight(), 0, "memory drives are served inline, not by the ring");
    });
    // A second set cannot be linked over the first.
    let error = MemoryDrives::create(&drives_dir, 1, size_bytes).unwrap_err().to_string();
    assert!(error.contains("drive-000.img"), "{error}");
    drop(memory);
    assert!(!drive_path(&drives_dir, 0).exists() && !drive_path(&drives_dir, 1).is_symlink());
    let error = open_drives(&drives_dir, node).unwrap_err().to_string();
    assert!(error.contains("holds no Ferrite drives"), "{error}");
}

fn fs_blocks(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks()
}

#[test]
fn a_memory_drive_link_must_reach_a_memory_file() {
    // A link into /proc/self/fd that names a file on disk is refused, not served without
    // O_DIRECT as if it were a memory drive.
    let dir = tempfile::tempdir().unwrap();
    let on_disk = File::create(dir.path().join("disk.img")).unwrap();
    on_disk.set_len(1 << 20).unwrap();
    let link = dir.path().join("drive-000.img");
    let target = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&on_disk));
    std::os::unix::fs::symlink(target, &link).unwrap();
    run_on_ring(|ring| async move {
        let error = DriveFile::open(&link, &ring).unwrap_err();
        assert!(matches!(error, DriveSetupError::NotMemoryDrive { .. }), "{error:?}");
        assert!(error.to_string().contains("drive-000.img"), "{error}");
    });
    drop(on_disk);
}

#[test]
fn log_engine_conformance_over_memory_drives() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeUuid([0x6b; 16]);
    let drive_size_bytes = HEADER_REGION_BYTES + (96 << 20);
    let memory = MemoryDrives::create(dir.path(), 3, drive_size_bytes).unwrap();
    format_drives(dir.path(), node, 3, drive_size_bytes).unwrap();
    let infos = open_drives(dir.path(), node).unwrap();
    run_on_ring(|ring| async move {
        let open = || -> Vec<DriveFile> {
            infos.iter().map(|info| DriveFile::open(&info.path, &ring).unwrap()).collect()
        };
        let log_config = LogConfig::for_drives(node, drive_size_bytes, 3);
        let config = CheckConfig { seed: 11, volume_blocks: 4000, ..CheckConfig::default() };
        let report = check_log_engine(open, &log_config, &config).await;
        assert!(report.blocks_verified > 1000, "{report:?}");
        assert_eq!(report.laid_out_bytes, 0, "memory drives have no holes to fill: {report:?}");
        assert_eq!((report.restarts, report.crashes), (2, 2), "{report:?}");
        settle(&ring).await;
    });
    drop(memory);
}

#[test]
fn laying_out_more_than_the_filesystem_holds_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    check_lay_out_space(dir.path(), 0).unwrap();
    let error = check_lay_out_space(dir.path(), u64::MAX).unwrap_err();
    assert!(matches!(error, DriveSetupError::NoSpaceToLayOut { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains("free some space") && message.contains(" free;"), "{message}");
    assert!(check_lay_out_space(&dir.path().join("missing"), 0).is_err());
}
