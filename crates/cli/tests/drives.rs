//! External drives (`ferrite up --drive`) and drive failure, end to end on real block devices:
//! loop devices over sparse files, attached with `losetup` and detached by the test.
//!
//! - A node on two loop devices serves a verified bench, restarts with the devices given in the
//!   other order (drives are found by their superblocks, not their paths) and keeps its data;
//!   it refuses to start without `--drive`, starts without one of the two (its default
//!   erasure coding is a mirror) and serves every block from the other, and another node
//!   refuses its devices.
//! - A real drive failure: one drive is a loop device over a sparse 1 GiB file on a 48 MiB
//!   tmpfs, on a node without parity (`--erasure-coding none`; tests/erasure.rs covers failures
//!   on nodes with parity). Writing more than the tmpfs holds makes the device fail writes with
//!   I/O errors; the engine latches the drive, the node keeps running and reports it (`ferrite node show`, the
//!   REST JSON, `ferrite_drive_failed`), every later write fails, and earlier acknowledged data
//!   reads back intact or fails with an error status, never as wrong data. Without parity, a
//!   start without one of the devices is refused, naming the drive.
//!
//! Both need root (losetup, mount), as CI has; without them the tests fail with a clear message.

mod common;

use common::{ferrite, ferrite_ok, free_port, pattern, pattern_mismatch, runtime, volume_nqn};
use common::{Node, BLOCK_BYTES, FERRITE};
use initiator::{AlignedBuf, ConnectOptions, Controller};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Every loop device's backing file: sparse, so it takes no space until written.
const BACKING_BYTES: u64 = 1 << 30;
/// The tmpfs that makes the failing drive run out of room.
const TMPFS_SIZE: &str = "48m";
/// Written to the failing node in pieces of this size, up to `FILL_BYTES_MAX`: about half goes
/// to the tmpfs-backed drive, so the tmpfs fills well before.
const FILL_IO_BYTES: usize = 1 << 20;
const FILL_BYTES_MAX: u64 = 384 << 20;
/// Acknowledged before the failure, and read back after it.
const EARLY_BYTES: u64 = 4 << 20;
const EARLY_TAG: u64 = 0xEA_217;
const FILL_TAG: u64 = 0xF1_11;

/// Runs a system tool that must succeed; a missing tool fails the test with a clear message.
#[track_caller]
fn run_tool(program: &str, args: &[&str]) -> String {
    let output =
        Command::new(program).args(args).stdin(Stdio::null()).output().unwrap_or_else(|error| {
            panic!(
                "cannot run {program} ({error}): these tests need util-linux's losetup and mount \
                 and root privileges (CI runs them as root on Debian)"
            )
        });
    assert!(
        output.status.success(),
        "{program} {args:?} failed ({}): {}; these tests need root privileges and free loop \
         devices",
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("temp paths are UTF-8")
}

/// A loop device over a sparse backing file, detached (by its own path) on drop.
struct LoopDevice {
    device: PathBuf,
}

impl LoopDevice {
    fn over_sparse_file(backing: &Path) -> Self {
        let file = std::fs::File::create(backing).expect("create the backing file");
        file.set_len(BACKING_BYTES).expect("size the backing file");
        drop(file);
        let device = run_tool("losetup", &["-f", "--show", path_str(backing)]);
        assert!(device.starts_with("/dev/loop"), "losetup printed {device:?}");
        Self { device: PathBuf::from(device) }
    }

    fn path(&self) -> &str {
        path_str(&self.device)
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
    }
}

/// A tmpfs mounted on a directory, unmounted on drop.
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).expect("create the mount point");
        run_tool("mount", &["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", path_str(dir)]);
        Self { dir: dir.to_owned() }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

fn drive_args(devices: &[&LoopDevice]) -> Vec<String> {
    devices.iter().flat_map(|device| ["--drive".to_owned(), device.path().to_owned()]).collect()
}

fn start(data_dir: &Path, nvme_port: u16, devices: &[&LoopDevice]) -> Node {
    let args = drive_args(devices);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Node::start_with_drives(data_dir, nvme_port, &args)
}

/// `ferrite up` that must fail before serving; returns its stderr.
#[track_caller]
fn up_fails(data_dir: &Path, devices: &[&LoopDevice]) -> String {
    let output = Command::new(FERRITE)
        .args(["up", "--data-dir", path_str(data_dir), "--api-listen", "127.0.0.1:0"])
        .args(["--nvme-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--nbd-listen", "off"])
        .args(drive_args(devices))
        .stdin(Stdio::null())
        .output()
        .expect("run ferrite up");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "`ferrite up` started although it should not: {stderr}");
    stderr
}

fn node_json(api_url: &str) -> serde_json::Value {
    serde_json::from_str(&ferrite_ok(api_url, &["node", "show", "--json"])).expect("node JSON")
}

/// The drives of `node show --json` as (index, path, state).
fn drives(api_url: &str) -> Vec<(u64, String, String)> {
    let node = node_json(api_url);
    let drives = node["drives"].as_array().expect("drives array").clone();
    drives
        .iter()
        .map(|drive| {
            (
                drive["index"].as_u64().expect("index"),
                drive["path"].as_str().expect("path").to_owned(),
                drive["state"].as_str().expect("state").to_owned(),
            )
        })
        .collect()
}

/// Runs `ferrite bench ARGS` to completion; returns (success, stdout + stderr).
fn bench(args: &[&str]) -> (bool, String) {
    let output =
        Command::new(FERRITE).arg("bench").args(args).stdin(Stdio::null()).output().expect("bench");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn node_on_block_devices_keeps_its_data_across_renamed_devices() {
    let dir = tempfile::tempdir().expect("temp dir");
    let first = LoopDevice::over_sparse_file(&dir.path().join("first.img"));
    let second = LoopDevice::over_sparse_file(&dir.path().join("second.img"));
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let target = format!("nvme+tcp://127.0.0.1:{nvme_port}/{}", volume_nqn("db"));
    let map = dir.path().join("bench.vmap");

    let node = start(&data_dir, nvme_port, &[&first, &second]);
    let expected = vec![
        (0, first.path().to_owned(), "ok".to_owned()),
        (1, second.path().to_owned(), "ok".to_owned()),
    ];
    assert_eq!(drives(&node.api_url), expected);
    let node_info = node_json(&node.api_url);
    assert_eq!(node_info["drive_count"], 2);
    assert_eq!(node_info["drive_size_bytes"], BACKING_BYTES);
    ferrite_ok(&node.api_url, &["volume", "create", "db", "--size", "128M"]);
    let (ok, text) = bench(&[
        "--target",
        &target,
        "--workloads",
        "4k_randwrite",
        "--fill",
        "--verify",
        "--verify-map",
        path_str(&map),
        "--runtime",
        "2",
        "--ramp",
        "0",
        "--size",
        "64M",
        "--quiet",
    ]);
    assert!(ok, "the verified bench failed on block devices:\n{text}");
    let shown = ferrite_ok(&node.api_url, &["node", "show"]);
    assert!(shown.contains(&format!("drive 1:         ok {}", second.path())), "{shown}");
    assert!(!shown.contains("FAILED"), "{shown}");
    node.stop_cleanly();

    // The devices in the other order: each drive is found by its superblock.
    let node = start(&data_dir, nvme_port, &[&second, &first]);
    assert_eq!(drives(&node.api_url), expected, "drive indexes follow the superblocks");
    let (ok, text) = bench(&["--target", &target, "--check", path_str(&map), "--quiet"]);
    assert!(ok && text.contains(" 0 mismatches, 0 read errors"), "data lost:\n{text}");
    node.stop_cleanly();

    let stderr = up_fails(&data_dir, &[]);
    assert!(stderr.contains("pass --drive PATH for each of its 2 drives"), "{stderr}");
    // Without drive 0 the mirror (1+1, the default on two drives) serves from drive 1 alone.
    let node = start(&data_dir, nvme_port, &[&second]);
    let degraded = drives(&node.api_url);
    assert_eq!(degraded[0], (0, String::new(), "failed".to_owned()), "{degraded:?}");
    let (ok, text) = bench(&["--target", &target, "--check", path_str(&map), "--quiet"]);
    assert!(ok && text.contains(" 0 mismatches, 0 read errors"), "data lost:\n{text}");
    node.stop_cleanly();
    let stderr = up_fails(&dir.path().join("other"), &[&first]);
    assert!(stderr.contains("refusing to format over it"), "{stderr}");
    assert!(stderr.contains(first.path()), "{stderr}");
}

#[test]
fn a_failed_drive_is_latched_and_reported_while_the_node_keeps_serving() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Declared before the devices over it: dropped (unmounted) after they are detached.
    let tmpfs = Tmpfs::mount(&dir.path().join("tmpfs"), TMPFS_SIZE);
    let healthy = LoopDevice::over_sparse_file(&dir.path().join("healthy.img"));
    let failing = LoopDevice::over_sparse_file(&tmpfs.dir.join("failing.img"));
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    // No parity: the failure's effect on a node that has none (a coded node keeps writing).
    let mut args = drive_args(&[&healthy, &failing]);
    args.extend(["--erasure-coding".to_owned(), "none".to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let node = Node::start_with_drives(&data_dir, nvme_port, &args);
    ferrite_ok(&node.api_url, &["volume", "create", "db", "--size", "512M"]);

    let rt = runtime();
    let address = node.nvme_address();
    let (early_results, failed_write_lba, later_write) = rt.block_on(async {
        let controller =
            Controller::connect(&address, &volume_nqn("db"), ConnectOptions::default())
                .await
                .expect("connect");
        let mut queue = controller.open_io_queue(4).await.expect("open an I/O queue");
        let early_blocks = EARLY_BYTES / BLOCK_BYTES as u64;
        for lba in (0..early_blocks).step_by(FILL_IO_BYTES / BLOCK_BYTES) {
            let buffer = pattern(lba, FILL_IO_BYTES / BLOCK_BYTES, EARLY_TAG);
            queue.write(lba, buffer).await.expect("an early write, before the tmpfs is full");
        }
        // Fill until the tmpfs-backed drive fails a write.
        let mut failed_write_lba = None;
        for offset in (EARLY_BYTES..FILL_BYTES_MAX).step_by(FILL_IO_BYTES) {
            let lba = offset / BLOCK_BYTES as u64;
            let buffer = pattern(lba, FILL_IO_BYTES / BLOCK_BYTES, FILL_TAG);
            if queue.write(lba, buffer).await.is_err() {
                failed_write_lba = Some(lba);
                break;
            }
        }
        // A write after the latch fails too, even one that is small.
        let later_write = queue.write(0, pattern(0, 1, FILL_TAG)).await;
        // Every early block, one by one: intact, or an error status; never other data.
        let mut results = Vec::new();
        for lba in 0..early_blocks {
            let result = queue.read(lba, AlignedBuf::new(BLOCK_BYTES)).await;
            results.push(result.map(|buffer| pattern_mismatch(&buffer, lba, EARLY_TAG)));
        }
        (results, failed_write_lba, later_write.map(drop))
    });
    let failed_write_lba = failed_write_lba.unwrap_or_else(|| {
        panic!("no write failed although {FILL_BYTES_MAX} bytes went to a {TMPFS_SIZE} tmpfs")
    });
    assert!(later_write.is_err(), "a write succeeded after a drive was latched failed");
    let intact = early_results.iter().filter(|result| matches!(result, Ok(None))).count();
    let errors = early_results.iter().filter(|result| result.is_err()).count();
    let wrong: Vec<&String> =
        early_results.iter().filter_map(|result| result.as_ref().ok()).flatten().collect();
    assert!(wrong.is_empty(), "reads returned wrong data after the failure: {wrong:?}");
    assert!(intact > 0, "no early block on the healthy drive read back");
    assert!(errors > 0, "no read of a block on the failed drive failed");
    eprintln!(
        "drives: the write at LBA {failed_write_lba} failed; early blocks: {intact} intact, \
         {errors} read errors"
    );

    // The node is alive, its API answers, and it says which drive failed.
    api::Client::new(&node.api_url).expect("client").health().expect("the API still answers");
    assert_eq!(
        drives(&node.api_url),
        vec![
            (0, healthy.path().to_owned(), "ok".to_owned()),
            (1, failing.path().to_owned(), "failed".to_owned()),
        ]
    );
    let shown = ferrite_ok(&node.api_url, &["node", "show"]);
    assert!(shown.contains(&format!("drive 1:         failed {}", failing.path())), "{shown}");
    assert!(shown.contains(&format!("drive 1 ({}) failed", failing.path())), "{shown}");
    assert!(shown.contains("Every write, write-zeroes and deallocate"), "{shown}");
    let metrics = api::Client::new(&node.api_url).expect("client").metrics().expect("metrics");
    let line = |index: u16, path: &str| {
        format!("ferrite_drive_failed{{drive=\"{index}\",path=\"{path}\"}}")
    };
    assert!(metrics.contains(&format!("{} 1\n", line(1, failing.path()))), "{metrics}");
    assert!(metrics.contains(&format!("{} 0\n", line(0, healthy.path()))), "{metrics}");
    let output = ferrite(&node.api_url, &["volume", "list"]);
    assert!(output.status.success(), "the control plane stopped answering");
    drop(node);

    // Without parity a start without one of the devices is refused, naming the drive.
    let stderr = up_fails(&data_dir, &[&healthy]);
    assert!(stderr.contains("drive 1 of this node's 2 drives is missing"), "{stderr}");
}
