//! Thin provisioning end to end, on a node with one small drive: a volume larger than the node
//! is created; writing until the real space runs out gets Capacity Exceeded (SCT 0, SC 0x81)
//! rather than corruption, and everything written before reads back intact; deallocating frees
//! space (`node show` says so) and writes succeed again; the data survives a restart.

mod common;

use common::{
    assert_no_error_lines, ferrite_ok, free_port, pattern, pattern_mismatch, runtime, volume_nqn,
    Node, BLOCK_BYTES,
};
use initiator::{AlignedBuf, ConnectOptions, Controller, IoQueue, LbaRange, Status};
use std::path::Path;

/// One drive of 64 MiB: about 50 MiB of capacity after the engine's reserve.
const DRIVE_ARGS: [&str; 4] = ["--drives", "1", "--drive-size", "64M"];
/// Blocks per write: 256 KiB.
const WRITE_BLOCKS: usize = 64;
/// Writes at most before the node must have said it is full (64 MiB, more than the drive).
const WRITES_MAX: u64 = 256;

/// A `ferrite up` with one small drive, so that a volume can be written until the node is full.
fn start(data_dir: &Path, nvme_port: u16) -> Node {
    Node::start_with_drives(data_dir, nvme_port, &DRIVE_ARGS)
}

fn node_json(node: &Node) -> serde_json::Value {
    let text = ferrite_ok(&node.api_url, &["node", "show", "--json"]);
    serde_json::from_str(&text).expect("node show --json")
}

async fn connect(address: &str) -> (Controller, IoQueue) {
    let controller = Controller::connect(address, &volume_nqn("big"), ConnectOptions::default())
        .await
        .expect("connect");
    let queue = controller.open_io_queue(8).await.expect("open an I/O queue");
    (controller, queue)
}

async fn check(queue: &mut IoQueue, lba: u64, tag: u64, context: &str) {
    let data = queue.read(lba, AlignedBuf::new(WRITE_BLOCKS * BLOCK_BYTES)).await.expect("read");
    if let Some(mismatch) = pattern_mismatch(&data, lba, tag) {
        panic!("{context}: {mismatch}");
    }
}

fn capacity(node: &serde_json::Value, field: &str) -> u64 {
    node["capacity"][field].as_u64().unwrap_or_else(|| panic!("capacity.{field} in {node}"))
}

#[test]
fn thin_volumes_fill_up_cleanly_and_free_space_on_deallocate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let address = format!("127.0.0.1:{nvme_port}");
    let rt = runtime();
    let node = start(&data_dir, nvme_port);
    let before = node_json(&node);
    let total = capacity(&before, "total_bytes");
    assert!(total > 16 << 20 && total < 64 << 20, "{before}");
    // Larger than the node: created, using no space.
    ferrite_ok(&node.api_url, &["volume", "create", "big", "--size", "1G"]);
    let created = node_json(&node);
    assert_eq!(capacity(&created, "provisioned_bytes"), 1 << 30);
    assert_eq!(capacity(&created, "free_bytes"), total);

    let stride = WRITE_BLOCKS as u64;
    let written = rt.block_on(async {
        let (controller, mut queue) = connect(&address).await;
        let mut written = 0;
        loop {
            assert!(written < WRITES_MAX, "wrote {written} x 256 KiB and never got full");
            let lba = written * stride;
            match queue.write(lba, pattern(lba, WRITE_BLOCKS, 1)).await {
                Ok(_) => written += 1,
                Err(error) => {
                    let status = error.status().unwrap_or_else(|| panic!("{error}"));
                    assert!(status.same_code(Status::CAPACITY_EXCEEDED), "{error}");
                    assert_eq!(
                        (status.status_code_type(), status.status_code()),
                        (0, 0x81),
                        "{error}"
                    );
                    break;
                }
            }
        }
        // Everything acknowledged before is intact; the refused range reads as zeros.
        for index in 0..written {
            check(&mut queue, index * stride, 1, "when full").await;
        }
        let refused = queue
            .read(written * stride, AlignedBuf::new(WRITE_BLOCKS * BLOCK_BYTES))
            .await
            .expect("read");
        assert!(refused.iter().all(|byte| *byte == 0), "a refused write left data");
        // Deallocate the first half: space comes back and writes succeed again.
        let freed = written / 2;
        for index in 0..freed {
            let range = LbaRange { lba: index * stride, blocks: WRITE_BLOCKS as u32 };
            queue.deallocate(&[range]).await.expect("deallocate");
        }
        let lba = written * stride;
        queue.write(lba, pattern(lba, WRITE_BLOCKS, 2)).await.expect("write after deallocate");
        drop(queue);
        controller.shutdown().await.expect("shut down");
        written
    });
    let full = node_json(&node);
    let mapped = capacity(&full, "mapped_bytes");
    let expected_mapped = (written - written / 2 + 1) * stride * BLOCK_BYTES as u64;
    assert_eq!(mapped, expected_mapped, "{full}");
    assert_eq!(capacity(&full, "free_bytes"), total - mapped, "{full}");
    // When the write was refused, less than one write's worth was free.
    assert!(total - written * stride * (BLOCK_BYTES as u64) < stride * BLOCK_BYTES as u64);
    let show = ferrite_ok(&node.api_url, &["node", "show"]);
    assert!(show.contains("mapped:") && show.contains("provisioned:"), "{show}");
    let volume: serde_json::Value =
        serde_json::from_str(&ferrite_ok(&node.api_url, &["volume", "show", "big", "--json"]))
            .expect("volume show --json");
    assert_eq!(volume["mapped_bytes"].as_u64(), Some(expected_mapped), "{volume}");
    let shown = ferrite_ok(&node.api_url, &["volume", "show", "big"]);
    assert!(shown.contains(&format!("({expected_mapped} bytes)")), "{shown}");
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "first run");

    // After a restart: the same data, the same space.
    let node = start(&data_dir, nvme_port);
    assert_eq!(capacity(&node_json(&node), "mapped_bytes"), expected_mapped);
    rt.block_on(async {
        let (controller, mut queue) = connect(&address).await;
        for index in 0..written {
            let lba = index * stride;
            if index < written / 2 {
                let data = queue
                    .read(lba, AlignedBuf::new(WRITE_BLOCKS * BLOCK_BYTES))
                    .await
                    .expect("read");
                assert!(data.iter().all(|byte| *byte == 0), "deallocated blocks came back");
            } else {
                check(&mut queue, lba, 1, "after the restart").await;
            }
        }
        check(&mut queue, written * stride, 2, "after the restart").await;
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "second run");
}
