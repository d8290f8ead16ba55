//! Erasure coding across a node's drives, end to end on a real `ferrite up`: drive failures that
//! hosts do not notice, `ferrite drive replace` and the rebuild, a drive file lost while the
//! node was down, and the replacements a node refuses.
//!
//! - A node on 3 drive files with `--erasure-coding 2+1`, drives 1 and 2 on small tmpfs mounts
//!   (the node's drive files are links to them). Filling a tmpfs from the test makes the next
//!   write to that drive fail with ENOSPC, a real I/O error: the engine latches the drive, and
//!   every block written before and after still reads back right while writes keep succeeding.
//!   `ferrite drive replace 1` rebuilds drive 1 (as a new file in the data dir); then drive 2
//!   fails the same way and every block still reads right, which needs the rebuilt drive 1.
//! - A node restarted with a drive file deleted starts anyway, puts a new file in its place,
//!   rebuilds it, and serves every block; asking for another erasure coding is refused.
//! - A node on block devices (loop devices) replaces drive 1 by a new device given with
//!   `--path`, rebuilds it, and starts again on the new set of devices with every block intact.
//! - A node on block devices started without one of them serves from parity (the drive shows
//!   failed, with no device), takes writes, rebuilds the device when it comes back at a later
//!   start (its contents are stale by then), takes a new device in its place after another
//!   start without it, and refuses to start without two of its three devices.
//! - A rebuild slows down while a host keeps writing, and says so.
//! - Replacements a node refuses: an unknown drive (404), a node without parity (409), a path
//!   on a node of drive files (400).
//!
//! Needs root for the tmpfs mounts, as CI has; without it the first test fails saying so.

mod common;

use common::{assert_no_error_lines, ferrite, ferrite_ok, free_port, pattern, pattern_mismatch};
use common::{runtime, volume_nqn};
use common::{Node, BLOCK_BYTES, FERRITE};
use initiator::{AlignedBuf, ConnectOptions, Controller, IoQueue};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Each drive: the smallest size the node takes, sparse.
const DRIVE_SIZE: &str = "64M";
/// Each tmpfs holding a failing drive: room for what the test writes before it fills it.
const TMPFS_SIZE: &str = "16m";
/// The test volume, in blocks of 4 KiB (32 MiB).
const VOLUME_BLOCKS: u64 = 8192;
/// Blocks per write command (256 KiB).
const WRITE_BLOCKS: u64 = 64;
/// How long a rebuild may take before the test fails.
const REBUILD_TIMEOUT: Duration = Duration::from_secs(30);

fn path_str(path: &Path) -> &str {
    path.to_str().expect("temp paths are UTF-8")
}

/// A tmpfs mounted on a directory, unmounted on drop.
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).expect("create the mount point");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", path_str(dir)])
            .stdin(Stdio::null())
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "mount -t tmpfs failed ({status}): this test needs root privileges (CI runs it as \
             root)"
        );
        Self { dir: dir.to_owned() }
    }

    /// Fills the tmpfs to the last byte, so the next write to a hole of any file on it fails.
    fn fill(&self) {
        use std::io::Write as _;
        let mut filler =
            std::fs::File::create(self.dir.join("filler")).expect("create the filler file");
        let chunk = vec![0x5au8; 1 << 20];
        loop {
            match filler.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(error) if error.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(error) => panic!("filling the tmpfs failed: {error}"),
            }
        }
        // Whatever is left below a page is of no use to a 4 KiB write.
        let _ = filler.sync_all();
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

fn node_json(api_url: &str) -> serde_json::Value {
    serde_json::from_str(&ferrite_ok(api_url, &["node", "show", "--json"])).expect("node JSON")
}

/// Each drive's state as `node show --json` reports it.
fn drive_states(api_url: &str) -> Vec<String> {
    let node = node_json(api_url);
    node["drives"]
        .as_array()
        .expect("drives array")
        .iter()
        .map(|drive| drive["state"].as_str().expect("state").to_owned())
        .collect()
}

/// Waits until no rebuild runs and the last one finished; returns the node JSON then.
#[track_caller]
fn wait_rebuilt(api_url: &str, drive: u64) -> serde_json::Value {
    let deadline = Instant::now() + REBUILD_TIMEOUT;
    loop {
        let node = node_json(api_url);
        let erasure = &node["erasure"];
        let last = &erasure["last_rebuild"];
        if erasure.get("rebuild").is_none() && last["drive"] == drive {
            assert_eq!(last["finished"], true, "the rebuild failed: {node:#}");
            return node;
        }
        assert!(Instant::now() < deadline, "drive {drive} was not rebuilt in time: {node:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// I/O queues on the test volume (alternated, so both data-path threads serve writes) and what
/// each block should hold: the tag of its last write, or 0 for never written.
struct Workload {
    queues: Vec<IoQueue>,
    _controller: Controller,
    tags: Vec<u64>,
    next: usize,
}

impl Workload {
    async fn connect(address: &str) -> Self {
        let controller = Controller::connect(address, &volume_nqn("db"), ConnectOptions::default())
            .await
            .expect("connect");
        let mut queues = Vec::new();
        for _ in 0..2 {
            queues.push(controller.open_io_queue(8).await.expect("open an I/O queue"));
        }
        Self { queues, _controller: controller, tags: vec![0; VOLUME_BLOCKS as usize], next: 0 }
    }

    fn queue(&mut self) -> &mut IoQueue {
        self.next = (self.next + 1) % self.queues.len();
        &mut self.queues[self.next]
    }

    /// Writes blocks `first..first + blocks` with `tag`; every write must succeed.
    async fn write(&mut self, first: u64, blocks: u64, tag: u64) {
        for lba in (first..first + blocks).step_by(WRITE_BLOCKS as usize) {
            let count = WRITE_BLOCKS.min(first + blocks - lba);
            let buffer = pattern(lba, count as usize, tag);
            if let Err(error) = self.queue().write(lba, buffer).await {
                panic!("the write of blocks {lba}..{} failed: {error}", lba + count);
            }
            for block in lba..lba + count {
                self.tags[block as usize] = tag;
            }
        }
    }

    /// Reads every written block back; each must hold its last write.
    async fn verify(&mut self, context: &str) {
        let mut checked = 0;
        for lba in (0..VOLUME_BLOCKS).step_by(WRITE_BLOCKS as usize) {
            let buffer = AlignedBuf::new(WRITE_BLOCKS as usize * BLOCK_BYTES);
            let data = match self.queue().read(lba, buffer).await {
                Ok(data) => data,
                Err(error) => panic!("{context}: reading blocks {lba}.. failed: {error}"),
            };
            for (index, block) in data.chunks_exact(BLOCK_BYTES).enumerate() {
                let number = lba + index as u64;
                let tag = self.tags[number as usize];
                if tag == 0 {
                    continue;
                }
                if let Some(mismatch) = pattern_mismatch(block, number, tag) {
                    panic!("{context}: {mismatch}");
                }
                checked += 1;
            }
        }
        eprintln!("{context}: {checked} blocks read back intact");
    }
}

/// A node on three drive files, drive 1 and 2 linked into their own tmpfs mounts.
#[test]
fn a_failed_drive_is_rebuilt_and_its_redundancy_restored() {
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("temp dir");
    let first_tmpfs = Tmpfs::mount(&dir.path().join("tmpfs-1"), TMPFS_SIZE);
    let second_tmpfs = Tmpfs::mount(&dir.path().join("tmpfs-2"), TMPFS_SIZE);
    let data_dir = dir.path().join("data");
    let drives_dir = data_dir.join("drives");
    std::fs::create_dir_all(&drives_dir).expect("create the drives folder");
    // The node creates its drive files through these links, on the tmpfs mounts.
    for (index, tmpfs) in [(1, &first_tmpfs), (2, &second_tmpfs)] {
        let name = format!("drive-{index:03}.img");
        std::os::unix::fs::symlink(tmpfs.dir.join(&name), drives_dir.join(&name))
            .expect("link a drive file");
    }
    let args = [
        "--drives",
        "3",
        "--drive-size",
        DRIVE_SIZE,
        "--erasure-coding",
        "2+1",
        "--data-threads",
        "2",
        "--rebuild-mb-per-s",
        "4",
    ];
    let node = Node::start_with_drives(&data_dir, free_port(), &args);
    let api = node.api_url.clone();
    let shown = ferrite_ok(&api, &["node", "show"]);
    assert!(
        shown.contains(
            "erasure coding:  2+1: each stripe survives the loss of 1 drive; 67% of the drive \
             space holds data"
        ),
        "{shown}"
    );
    ferrite_ok(&api, &["volume", "create", "db", "--size", "32M"]);

    let rt = runtime();
    let mut workload = rt.block_on(Workload::connect(&node.nvme_address()));
    rt.block_on(workload.write(0, 2048, 1));

    // Drive 1 fails in the middle of the workload: every write still succeeds.
    first_tmpfs.fill();
    rt.block_on(async {
        workload.write(1024, 2048, 2).await;
        workload.verify("drive 1 failed").await;
    });
    assert_eq!(drive_states(&api), ["ok", "failed", "ok"]);
    let shown = ferrite_ok(&api, &["node", "show"]);
    eprintln!("node show with drive 1 failed:\n{shown}");
    assert!(shown.contains("DEGRADED:        drive 1 ("), "{shown}");
    assert!(shown.contains("`ferrite drive replace 1`"), "{shown}");
    let node_info = node_json(&api);
    let reconstructed = node_info["erasure"]["reconstructed_reads"].as_u64().expect("counter");
    assert!(reconstructed > 0, "no read was rebuilt from parity: {node_info:#}");

    // Replace it: a new drive file in the data dir, rebuilt while hosts keep writing.
    let replaced = ferrite_ok(&api, &["drive", "replace", "1"]);
    assert!(replaced.contains("replaced drive 1 with"), "{replaced}");
    let new_file = drives_dir.join("drive-001.img");
    assert!(!new_file.is_symlink(), "the new drive file replaced the link");
    let shown = ferrite_ok(&api, &["node", "show"]);
    eprintln!("node show while drive 1 is rebuilt:\n{shown}");
    assert!(shown.contains("drive 1:         rebuilding "), "{shown}");
    assert!(shown.contains("rebuild:         drive 1: "), "{shown}");
    // At 4 MiB/s the rebuild's rate while hosts are busy is its rate: under the 16 MiB/s floor.
    assert_eq!(node_json(&api)["erasure"]["rebuild_busy_mb_per_s"], 4);
    rt.block_on(workload.write(3072, 1024, 3));
    let node_info = wait_rebuilt(&api, 1);
    assert_eq!(drive_states(&api), ["ok", "ok", "ok"]);
    assert!(node_info["erasure"]["last_rebuild"]["bytes_written"].as_u64() > Some(0));
    rt.block_on(workload.verify("drive 1 rebuilt"));
    let shown = ferrite_ok(&api, &["node", "show"]);
    assert!(shown.contains("last rebuild:    drive 1 rebuilt: "), "{shown}");
    let metrics = api::Client::new(&api).expect("client").metrics().expect("metrics");
    for line in ["ferrite_erasure_data_shards 2\n", "ferrite_erasure_parity_shards 1\n"] {
        assert!(metrics.contains(line), "{line:?} missing:\n{metrics}");
    }
    assert!(!metrics.contains("ferrite_rebuild_bytes_written_total 0\n"), "{metrics}");

    // Drive 2 fails the same way: only the rebuilt drive 1 can stand in for its cells.
    second_tmpfs.fill();
    rt.block_on(async {
        workload.write(0, 512, 4).await;
        workload.verify("drive 2 failed after drive 1 was rebuilt").await;
    });
    assert_eq!(drive_states(&api), ["ok", "ok", "failed"]);
    let node_info = node_json(&api);
    assert_eq!(node_info["erasure"]["unrecoverable_reads"], 0, "{node_info:#}");
    let stderr = node.stderr_now();
    assert!(stderr.contains("rebuilding drive 1 from the other drives"), "{stderr}");
    assert!(stderr.contains("drive 1 is rebuilt"), "{stderr}");
    assert_no_error_lines(&stderr, &["is latched failed"], "two drive failures and a rebuild");
    drop(workload);
    drop(node);
    eprintln!("erasure: failure, replace, rebuild, second failure in {:?}", started.elapsed());
}

/// A rebuild yields to a host that keeps writing (a quarter of its rate, at least 16 MiB/s:
/// here 16 of 64), says so in `node show`, the REST API and the metrics, and still finishes.
#[test]
fn a_rebuild_slows_down_while_a_host_writes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let args = ["--drives", "3", "--drive-size", DRIVE_SIZE, "--rebuild-mb-per-s", "64"];
    let node = Node::start_with_drives(&dir.path().join("data"), free_port(), &args);
    let api = node.api_url.clone();
    ferrite_ok(&api, &["volume", "create", "db", "--size", "32M"]);
    let rt = runtime();
    let mut workload = rt.block_on(Workload::connect(&node.nvme_address()));
    rt.block_on(workload.write(0, VOLUME_BLOCKS, 1));
    assert_eq!(node_json(&api)["erasure"]["rebuild_busy_mb_per_s"], 16);

    let replaced = ferrite_ok(&api, &["drive", "replace", "1"]);
    assert!(replaced.contains("replaced drive 1 with"), "{replaced}");
    // The host writes 1 MiB between looks: many MiB a second, so the node counts as busy. At
    // 16 MiB/s the drive's share of the 32 MiB written takes about a second; at 64, a quarter.
    let deadline = Instant::now() + REBUILD_TIMEOUT;
    let mut tag = 2;
    let shown = loop {
        rt.block_on(workload.write(0, 256, tag));
        tag += 1;
        let shown = ferrite_ok(&api, &["node", "show"]);
        if shown.contains("slowed to 16 MiB/s while hosts are busy") {
            break shown;
        }
        assert!(shown.contains("rebuild:         drive 1: "), "done before it slowed: {shown}");
        assert!(Instant::now() < deadline, "the rebuild never slowed down: {shown}");
    };
    eprintln!("node show while a host writes:\n{shown}");
    let node_info = node_json(&api);
    let metrics = api::Client::new(&api).expect("client").metrics().expect("metrics");
    // The host's writes may have stopped for a second since `node show`: then neither says so.
    if node_info["erasure"]["rebuild"]["slowed_for_hosts"] == true {
        assert!(metrics.contains("ferrite_rebuild_slowed_for_hosts 1\n"), "{metrics}");
    }
    let node_info = wait_rebuilt(&api, 1);
    assert!(node_info["erasure"].get("rebuild").is_none());
    let metrics = api::Client::new(&api).expect("client").metrics().expect("metrics");
    assert!(metrics.contains("ferrite_rebuild_slowed_for_hosts 0\n"), "{metrics}");
    rt.block_on(workload.verify("drive 1 rebuilt while a host wrote"));
    assert_no_error_lines(&node.stop_cleanly(), &[], "a rebuild slowed for a host");
}

#[test]
fn a_missing_drive_file_is_replaced_and_rebuilt_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let args = ["--drives", "3", "--drive-size", DRIVE_SIZE, "--data-threads", "1"];
    let node = Node::start_with_drives(&data_dir, nvme_port, &args);
    let api = node.api_url.clone();
    let node_info = node_json(&api);
    assert_eq!(node_info["erasure"]["scheme"], "2+1", "the default on 3 drives: {node_info:#}");
    ferrite_ok(&api, &["volume", "create", "db", "--size", "32M"]);
    let rt = runtime();
    let tags = rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.write(0, 1536, 7).await;
        workload.tags
    });
    // A drive file node takes no --path.
    let error = api::Client::new(&api)
        .expect("client")
        .replace_drive(0, Some("/dev/null"))
        .expect_err("a path on a node of drive files");
    assert_eq!(error.code(), Some(api::ErrorCode::InvalidDrive), "{error}");
    assert_no_error_lines(&node.stop_cleanly(), &[], "the first run");

    std::fs::remove_file(data_dir.join("drives").join("drive-002.img")).expect("delete drive 2");
    let node = Node::start_with_drives(&data_dir, nvme_port, &args);
    let api = node.api_url.clone();
    let node_info = wait_rebuilt(&api, 2);
    assert_eq!(drive_states(&api), ["ok", "ok", "ok"], "{node_info:#}");
    let stderr = node.stderr_now();
    assert!(
        stderr.contains("drive 2 was missing: a new empty file takes its place; rebuilding"),
        "{stderr}"
    );
    rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.tags = tags;
        workload.verify("drive 2 rebuilt at start").await;
    });
    assert_no_error_lines(&node.stop_cleanly(), &[], "the run that rebuilt drive 2");

    // The erasure coding is the drives' for good.
    let output = Command::new(FERRITE)
        .args(["up", "--data-dir", path_str(&data_dir), "--api-listen", "127.0.0.1:0"])
        .args(["--nvme-listen", &format!("127.0.0.1:{}", free_port()), "--nbd-listen", "off"])
        .args(["--erasure-coding", "1+1"])
        .stdin(Stdio::null())
        .output()
        .expect("run ferrite up");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "a different erasure coding was accepted: {stderr}");
    assert!(
        stderr.contains("formatted with erasure coding 2+1, but 1+1 was asked for"),
        "{stderr}"
    );
}

/// `count` loop devices over sparse 64 MiB files in `dir`, detached when dropped.
fn loop_devices(dir: &Path, count: usize) -> Vec<common::LoopDevice> {
    (0..count)
        .map(|index| {
            let backing = dir.join(format!("backing-{index}.img"));
            std::fs::File::create(&backing)
                .and_then(|file| file.set_len(64 << 20))
                .expect("create a sparse backing file");
            common::LoopDevice::attach(&backing)
        })
        .collect()
}

/// `--drive PATH` for each of `devices` picked by `indexes`, in that order.
fn device_args(devices: &[common::LoopDevice], indexes: &[usize]) -> Vec<String> {
    indexes
        .iter()
        .flat_map(|&index| ["--drive".to_owned(), devices[index].path().to_owned()])
        .collect()
}

#[test]
fn a_block_device_is_replaced_by_another() {
    let dir = tempfile::tempdir().expect("temp dir");
    let devices = loop_devices(dir.path(), 4);
    let drive_args = |indexes: &[usize]| device_args(&devices, indexes);
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let mut args = drive_args(&[0, 1, 2]);
    args.extend(["--erasure-coding", "2+1", "--data-threads", "1"].map(str::to_owned));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let node = Node::start_with_drives(&data_dir, nvme_port, &args);
    let api = node.api_url.clone();
    ferrite_ok(&api, &["volume", "create", "db", "--size", "32M"]);
    let rt = runtime();
    let tags = rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.write(0, 1024, 9).await;
        workload.tags
    });
    let client = api::Client::new(&api).expect("client");
    let refused = |path: Option<&str>, expect: &str| {
        let error = client.replace_drive(1, path).expect_err("an unusable new drive");
        assert_eq!(error.code(), Some(api::ErrorCode::InvalidDrive), "{error}");
        assert!(error.to_string().contains(expect), "{error:?} lacks {expect:?}");
    };
    refused(None, "give the new drive with --path");
    refused(Some(devices[2].path()), "is drive 2 of this node already");

    // Drive 1, healthy, is retired for the spare device.
    let replaced = ferrite_ok(&api, &["drive", "replace", "1", "--path", devices[3].path()]);
    assert!(replaced.contains(devices[3].path()), "{replaced}");
    wait_rebuilt(&api, 1);
    let node_info = node_json(&api);
    assert_eq!(node_info["drives"][1]["path"], devices[3].path(), "{node_info:#}");
    assert_no_error_lines(&node.stop_cleanly(), &[], "a device replaced");

    // The next start takes the new set of devices, in any order.
    let mut args = drive_args(&[2, 3, 0]);
    args.extend(["--data-threads", "1"].map(str::to_owned));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let node = Node::start_with_drives(&data_dir, nvme_port, &args);
    assert_eq!(drive_states(&node.api_url), ["ok", "ok", "ok"]);
    rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.tags = tags;
        workload.verify("after a device replacement and a restart").await;
    });
    drop(node);
}

/// A node on block devices started without one of them runs degraded; the device coming back
/// at a later start is rebuilt (its contents are stale); started without it again and given a
/// new device, it rebuilds that one; without two of them it refuses to start.
#[test]
fn a_node_starts_without_a_missing_device_and_rebuilds_it_when_it_comes_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let devices = loop_devices(dir.path(), 4);
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let args_for = |indexes: &[usize], first: bool| -> Vec<String> {
        let mut args = device_args(&devices, indexes);
        if first {
            args.extend(["--erasure-coding", "2+1"].map(str::to_owned));
        }
        args.extend(["--data-threads", "1"].map(str::to_owned));
        args
    };
    let start = |indexes: &[usize], first: bool| {
        let args = args_for(indexes, first);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Node::start_with_drives(&data_dir, nvme_port, &args)
    };
    let marker = data_dir.join("drive-001.missing");
    let node = start(&[0, 1, 2], true);
    ferrite_ok(&node.api_url, &["volume", "create", "db", "--size", "32M"]);
    let rt = runtime();
    let mut tags = rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.write(0, 1024, 11).await;
        workload.tags
    });
    assert_no_error_lines(&node.stop_cleanly(), &[], "the first run");

    // Device 1 is not given: the node serves without it, and takes writes.
    let node = start(&[2, 0], false);
    let api = node.api_url.clone();
    assert_eq!(drive_states(&api), ["ok", "failed", "ok"]);
    assert_eq!(node_json(&api)["drives"][1]["path"], "", "no device stands for drive 1");
    let shown = ferrite_ok(&api, &["node", "show"]);
    assert!(shown.contains("(no device: not among the --drive paths at start)"), "{shown}");
    assert!(shown.contains("DEGRADED:"), "{shown}");
    let stderr = node.stderr_now();
    assert!(
        stderr.contains("drive 1 is not among the --drive paths: the node runs without it"),
        "{stderr}"
    );
    assert!(marker.exists(), "the node records that it ran without drive 1");
    tags = rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.tags = tags;
        workload.verify("drive 1 missing").await;
        workload.write(512, 1024, 12).await;
        workload.verify("drive 1 missing, after writes").await;
        workload.tags
    });
    // Its replacement needs a device.
    let error = api::Client::new(&api)
        .expect("client")
        .replace_drive(1, None)
        .expect_err("a replacement without a path");
    assert_eq!(error.code(), Some(api::ErrorCode::InvalidDrive), "{error}");
    let latched = "drives latched failed during this run";
    assert_no_error_lines(&node.stop_cleanly(), &[latched], "degraded");

    // Device 1 comes back, stale: it is rebuilt before the node trusts it.
    let node = start(&[0, 1, 2], false);
    let api = node.api_url.clone();
    wait_rebuilt(&api, 1);
    assert_eq!(drive_states(&api), ["ok", "ok", "ok"]);
    let stderr = node.stderr_now();
    assert!(stderr.contains("drive 1 is back after the node ran without it"), "{stderr}");
    assert!(!marker.exists(), "drive 1 is rebuilt in place");
    rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.tags = tags.clone();
        workload.verify("drive 1 back and rebuilt").await;
    });
    assert_no_error_lines(&node.stop_cleanly(), &[], "drive 1 rebuilt in place");

    // Without two of the three devices the data is not all there: refused, naming them.
    let output = Command::new(FERRITE)
        .args(["up", "--data-dir", path_str(&data_dir), "--api-listen", "127.0.0.1:0"])
        .args(["--nvme-listen", &format!("127.0.0.1:{}", free_port()), "--nbd-listen", "off"])
        .args(args_for(&[0], false))
        .stdin(Stdio::null())
        .output()
        .expect("run ferrite up");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "a node without two of its drives started: {stderr}");
    assert!(
        stderr.contains("drives [1, 2] of this node's 3 are not among the --drive paths")
            && stderr.contains("survives the loss of 1 drive(s)"),
        "{stderr}"
    );

    // Device 1 gone again, and a new device takes its place.
    let node = start(&[0, 2], false);
    let api = node.api_url.clone();
    rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.tags = tags.clone();
        workload.verify("drive 1 missing again").await;
    });
    let replaced = ferrite_ok(&api, &["drive", "replace", "1", "--path", devices[3].path()]);
    assert!(replaced.contains(devices[3].path()), "{replaced}");
    wait_rebuilt(&api, 1);
    assert_eq!(drive_states(&api), ["ok", "ok", "ok"]);
    assert!(!marker.exists(), "a replaced drive is no longer missing");
    rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.tags = tags.clone();
        workload.verify("drive 1 replaced by a new device").await;
    });
    assert_no_error_lines(&node.stop_cleanly(), &[], "replaced");
    let node = start(&[3, 2, 0], false);
    assert_eq!(drive_states(&node.api_url), ["ok", "ok", "ok"]);
    rt.block_on(async {
        let mut workload = Workload::connect(&node.nvme_address()).await;
        workload.tags = tags;
        workload.verify("drive 1 replaced by a new device, after a restart").await;
    });
    assert_no_error_lines(&node.stop_cleanly(), &[], "the new set of devices");
}

#[test]
fn replacements_that_cannot_be_done_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let args = ["--drives", "2", "--drive-size", DRIVE_SIZE, "--erasure-coding", "none"];
    let node = Node::start_with_drives(&dir.path().join("data"), free_port(), &args);
    let client = api::Client::new(&node.api_url).expect("client");
    let check = |index: u16, code: api::ErrorCode, status: u16, expect: &str| {
        let error = client.replace_drive(index, None).expect_err("a refused replacement");
        match &error {
            api::ClientError::Api { status: got, .. } => assert_eq!(*got, status, "{error}"),
            other => panic!("not an API error: {other}"),
        }
        assert_eq!(error.code(), Some(code), "{error}");
        assert!(error.to_string().contains(expect), "{error:?} lacks {expect:?}");
    };
    check(5, api::ErrorCode::DriveNotFound, 404, "no drive 5: its drives are 0 to 1");
    check(0, api::ErrorCode::ReplaceRefused, 409, "hold no parity");
    let output = ferrite(&node.api_url, &["drive", "replace", "1"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("drive 1 cannot be replaced"), "{stderr}");
    let shown = ferrite_ok(&node.api_url, &["node", "show"]);
    assert!(shown.contains("erasure coding:  none (1+0): blocks are not protected"), "{shown}");
    assert_eq!(drive_states(&node.api_url), ["ok", "ok"], "nothing was touched");
}
