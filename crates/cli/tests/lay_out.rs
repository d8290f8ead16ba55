//! The lay-out of free segments ahead of the log, on a real `ferrite up` over sparse drive
//! files (the engine's `lay_out` module; its safety is checked by the engine's conformance
//! tests over simulated and real drives):
//!
//! - A fresh node lays out the segments its log takes next: the metrics count them, the drive
//!   files hold the zeros written, and only those: the files stay sparse beyond them.
//! - As a host writes, the lay-out keeps ahead of the log (more segments laid out), and what was
//!   written reads back intact, also after a restart.

mod common;

use common::{
    assert_no_error_lines, ferrite_ok, free_port, metric, pattern, pattern_mismatch, runtime,
    volume_nqn, Node, BLOCK_BYTES,
};
use initiator::{AlignedBuf, ConnectOptions, Controller};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// The segments the engine keeps laid out ahead (`engine::log::LAY_OUT_AHEAD_SEGMENTS`).
const AHEAD: u64 = 3;
/// Two sparse 1 GiB drive files: 2 MiB units, so a segment is 4 MiB.
const NODE_ARGS: [&str; 6] = ["--drives", "2", "--drive-size", "1G", "--erasure-coding", "none"];
/// Written by the host in 1 MiB writes: a dozen segments.
const WRITE_BYTES: u64 = 48 << 20;
const WRITE_BLOCKS_PER_IO: usize = 256;
const TAG: u64 = 0x1A_0017;
const WAIT: Duration = Duration::from_secs(30);

/// A controller of volume `vol` and an I/O queue on it.
async fn open_queue(address: &str) -> (Controller, initiator::IoQueue) {
    let controller = Controller::connect(address, &volume_nqn("vol"), ConnectOptions::default())
        .await
        .expect("connect");
    let queue = controller.open_io_queue(8).await.expect("open an I/O queue");
    (controller, queue)
}

/// (segments laid out, bytes of zeros written) from the node's metrics.
fn laid_out(api: &str) -> (u64, u64) {
    let metrics = api::Client::new(api).expect("client").metrics().expect("metrics");
    (
        metric(&metrics, "ferrite_segments_laid_out_total"),
        metric(&metrics, "ferrite_laid_out_bytes_total"),
    )
}

/// Waits until the node has laid out at least `segments` segments.
fn wait_for_segments(api: &str, segments: u64) -> (u64, u64) {
    let deadline = Instant::now() + WAIT;
    loop {
        let now = laid_out(api);
        if now.0 >= segments {
            return now;
        }
        assert!(Instant::now() < deadline, "{now:?} laid out after {WAIT:?}, not {segments}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Bytes the drive files have blocks for.
fn allocated_bytes(drives: &Path) -> Vec<u64> {
    let mut sizes = Vec::new();
    for entry in std::fs::read_dir(drives).expect("list the drives") {
        let path = entry.expect("drive entry").path();
        if path.extension().is_some_and(|extension| extension == "img") {
            sizes.push(std::fs::metadata(&path).expect("drive metadata").blocks() * 512);
        }
    }
    assert_eq!(sizes.len(), 2, "two drive files in {}", drives.display());
    sizes
}

#[test]
fn free_segments_are_laid_out_ahead_of_the_log_and_the_files_stay_sparse_beyond() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let node = Node::start_with_drives(&data_dir, nvme_port, &NODE_ARGS);
    let api = node.api_url.clone();

    let (segments, bytes) = wait_for_segments(&api, AHEAD);
    // Fresh files: every laid-out segment had holes, a unit on each of the two drives.
    assert!(bytes > 0 && bytes % (2 * BLOCK_BYTES as u64) == 0, "{segments} segments, {bytes}");
    let allocated = allocated_bytes(&data_dir.join("drives"));
    let total: u64 = allocated.iter().sum();
    assert!(total >= bytes, "{bytes} bytes laid out but only {allocated:?} allocated");
    for size in &allocated {
        assert!(*size < 64 << 20, "a drive file is no longer sparse: {allocated:?} allocated");
    }

    // The host writes a dozen segments' worth; the lay-out keeps ahead of the log.
    ferrite_ok(&api, &["volume", "create", "vol", "--size", "256M"]);
    let rt = runtime();
    let address = node.nvme_address();
    let ios = WRITE_BYTES / (WRITE_BLOCKS_PER_IO * BLOCK_BYTES) as u64;
    rt.block_on(async {
        let (controller, mut queue) = open_queue(&address).await;
        for io in 0..ios {
            let lba = io * WRITE_BLOCKS_PER_IO as u64;
            queue.write(lba, pattern(lba, WRITE_BLOCKS_PER_IO, TAG)).await.expect("write");
        }
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    let (after, _) = wait_for_segments(&api, segments + 6);
    assert!(after > segments + 5, "{segments} then {after} segments laid out");
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "first run");

    // After a restart the data is intact.
    let node = Node::start_with_drives(&data_dir, nvme_port, &NODE_ARGS);
    let address = node.nvme_address();
    rt.block_on(async {
        let (controller, mut queue) = open_queue(&address).await;
        for io in 0..ios {
            let lba = io * WRITE_BLOCKS_PER_IO as u64;
            let data = queue
                .read(lba, AlignedBuf::new(WRITE_BLOCKS_PER_IO * BLOCK_BYTES))
                .await
                .expect("read after the restart");
            if let Some(mismatch) = pattern_mismatch(&data, lba, TAG) {
                panic!("after the restart: {mismatch}");
            }
        }
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "second run");
}
