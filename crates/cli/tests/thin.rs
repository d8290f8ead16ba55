//! Thin provisioning end to end, on a node with one small drive: a volume larger than the node
//! is created; writing until the real space runs out gets Capacity Exceeded (SCT 0, SC 0x81)
//! rather than corruption, and everything written before reads back intact; deallocating frees
//! space (`node show` says so) and writes succeed again; the data survives a restart.

mod common;

use common::{
    assert_no_error_lines, ferrite_ok, free_port, pattern, pattern_mismatch, runtime, volume_nqn,
    wait_with_timeout, BLOCK_BYTES, FERRITE, NODE_TIMEOUT,
};
use initiator::{AlignedBuf, ConnectOptions, Controller, IoQueue, LbaRange, Status};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// One drive of 64 MiB: about 50 MiB of capacity after the engine's reserve.
const DRIVE_ARGS: [&str; 4] = ["--drives", "1", "--drive-size", "64M"];
/// Blocks per write: 256 KiB.
const WRITE_BLOCKS: usize = 64;
/// Writes at most before the node must have said it is full (64 MiB, more than the drive).
const WRITES_MAX: u64 = 256;

/// A `ferrite up` with small drives; killed (only this child) when dropped.
struct SmallNode {
    child: Child,
    api_url: String,
    stdout: mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl SmallNode {
    fn start(data_dir: &Path, nvme_port: u16) -> Self {
        let mut child = Command::new(FERRITE)
            .args(["up", "--data-dir"])
            .arg(data_dir)
            .args(["--api-listen", "127.0.0.1:0"])
            .args(["--nvme-listen", &format!("127.0.0.1:{nvme_port}")])
            .args(DRIVE_ARGS)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn `ferrite up`");
        let (sender, stdout) = mpsc::channel();
        let reader = BufReader::new(child.stdout.take().expect("piped stdout"));
        std::thread::spawn(move || {
            for line in reader.lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let mut pipe = child.stderr.take().expect("piped stderr");
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        });
        let mut node = Self { child, api_url: String::new(), stdout, stderr: Some(stderr) };
        let line = node.line_containing("REST API:");
        node.api_url = line.split_whitespace().last().unwrap_or_default().to_owned();
        let client = api::Client::new(&node.api_url).expect("API client");
        let deadline = std::time::Instant::now() + NODE_TIMEOUT;
        while client.health().is_err() {
            assert!(std::time::Instant::now() < deadline, "/healthz never answered");
            std::thread::sleep(Duration::from_millis(50));
        }
        node
    }

    fn line_containing(&mut self, needle: &str) -> String {
        loop {
            match self.stdout.recv_timeout(NODE_TIMEOUT) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    let stderr = self.stderr.take().map(|t| t.join().unwrap_or_default());
                    panic!("`ferrite up` printed no {needle:?}; stderr:\n{stderr:?}");
                }
            }
        }
    }

    /// SIGTERM; requires exit status 0. Returns stderr.
    fn stop_cleanly(mut self) -> String {
        let pid = libc::pid_t::try_from(self.child.id()).expect("PID fits");
        // SAFETY: kill(2) has no memory effects; `pid` is our own child, not yet waited for.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let status = wait_with_timeout(&mut self.child, NODE_TIMEOUT).expect("exit on SIGTERM");
        let stderr = self.stderr.take().map(|t| t.join().unwrap_or_default()).unwrap_or_default();
        assert!(status.success(), "exit status {status}; stderr:\n{stderr}");
        stderr
    }

    fn node_json(&self) -> serde_json::Value {
        let text = ferrite_ok(&self.api_url, &["node", "show", "--json"]);
        serde_json::from_str(&text).expect("node show --json")
    }
}

impl Drop for SmallNode {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
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
    let node = SmallNode::start(&data_dir, nvme_port);
    let before = node.node_json();
    let total = capacity(&before, "total_bytes");
    assert!(total > 16 << 20 && total < 64 << 20, "{before}");
    // Larger than the node: created, using no space.
    ferrite_ok(&node.api_url, &["volume", "create", "big", "--size", "1G"]);
    let created = node.node_json();
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
    let full = node.node_json();
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
    let node = SmallNode::start(&data_dir, nvme_port);
    assert_eq!(capacity(&node.node_json(), "mapped_bytes"), expected_mapped);
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
