//! `scripts/disk-stall.py`, which `make compare-ceph` runs beside every workload so that a
//! latency tail can be told apart from a pause of the disk under both systems, finds a pause it
//! is shown and only that: ext4 on a loop device over an nbdfuse file of a Ferrite volume is
//! written with direct synchronous writes while the node is stopped (SIGSTOP) for a while, so
//! the loop device holds a request and completes none; the watcher must report a stall of about
//! that length on that loop device, and none while the same writes run unpaused or while the
//! device has nothing to do.
//!
//! Needs root (losetup, mount), /dev/fuse, `nbdfuse` (libnbd-bin), `dd` and `python3`
//! (`scripts/deps.sh` installs them); fails without them: nothing is skipped.

mod common;

use common::{
    client, ferrite_ok, free_port, require_root_and_fuse, run_ok, ChildGuard, FuseFile, LoopDevice,
    Mount, Node,
};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// How long the node is stopped.
const PAUSE: Duration = Duration::from_millis(1_200);
/// The watcher samples every 50 ms, so it may see a pause up to a sample shorter than it was; a
/// loaded machine may let the pause run longer than asked and resume the node late.
const PAUSE_SHORTER_MS: u64 = 150;
const PAUSE_LONGER_MS: u64 = 1_500;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/disk-stall.py")
}

/// Sends SIGCONT to the node when dropped, so a failed assertion never leaves it stopped.
struct Stopped(libc::pid_t);

impl Stopped {
    fn stop(pid: libc::pid_t) -> Stopped {
        // SAFETY: signals a process this test started and still holds.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0, "SIGSTOP the node");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

/// Runs the watcher on `mount_dir` for a second, while `dd` writes there if `write` names a
/// file, calling `meanwhile` halfway, and returns the watcher's report.
fn watch(mount_dir: &Path, write: Option<&str>, meanwhile: impl FnOnce()) -> serde_json::Value {
    let mut command = client("python3", "python3");
    command.arg(script()).arg(mount_dir).stdout(Stdio::piped());
    let mut watcher = ChildGuard(command.spawn().expect("start disk-stall.py"));
    let writer = write.map(|name| {
        let mut command = client("dd", "coreutils");
        command
            .arg("if=/dev/zero")
            .arg(format!("of={}", mount_dir.join(name).display()))
            .args(["bs=4k", "count=1000000", "oflag=direct,dsync", "status=none"])
            .stderr(Stdio::null());
        ChildGuard(command.spawn().expect("start dd"))
    });
    std::thread::sleep(Duration::from_millis(500));
    meanwhile();
    std::thread::sleep(Duration::from_millis(500));
    drop(writer);
    // SAFETY: signals the watcher this test started and still holds.
    unsafe { libc::kill(watcher.0.id() as libc::pid_t, libc::SIGTERM) };
    let status = watcher.wait_timeout(Duration::from_secs(10)).expect("the watcher stops");
    assert!(status.success(), "disk-stall.py failed: {status}");
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut watcher.0.stdout.take().expect("piped"), &mut stdout)
        .expect("read the report");
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|error| panic!("disk-stall.py printed no JSON ({error}): {stdout:?}"))
}

#[test]
fn the_disk_stall_watcher_reports_a_paused_device_and_no_other() {
    require_root_and_fuse();
    let dir = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&dir.path().join("data"), free_port());
    ferrite_ok(&node.api_url, &["volume", "create", "disk", "--size", "256M"]);
    let mount_dir = dir.path().join("mnt");

    let fuse = FuseFile::start(&dir.path().join("fuse"), "disk", &node.nbd_uri("disk"), 256 << 20);
    let device = LoopDevice::attach(&fuse.file);
    let mut command = client("mkfs.ext4", "e2fsprogs");
    command.args(["-q", "-F", device.path()]);
    run_ok(command);
    let mount = Mount::at(device.path(), &mount_dir);
    let loop_name = Path::new(device.path()).file_name().expect("a device name");

    let idle = watch(&mount_dir, None, || {});
    assert_eq!(idle["disk"].as_str(), loop_name.to_str(), "watched the loop device: {idle}");
    let idle_ms = idle["stall_max_ms"].as_u64().expect("a stall figure");
    let calm = watch(&mount_dir, Some("calm"), || {});
    let calm_ms = calm["stall_max_ms"].as_u64().expect("a stall figure");

    let paused = watch(&mount_dir, Some("paused"), || {
        let stopped = Stopped::stop(node.pid());
        std::thread::sleep(PAUSE);
        drop(stopped);
    });
    assert_eq!(paused["disk"].as_str(), loop_name.to_str(), "watched the loop device: {paused}");
    let paused_ms = paused["stall_max_ms"].as_u64().expect("a stall figure");
    let pause_ms = PAUSE.as_millis() as u64;
    assert!(
        paused_ms + PAUSE_SHORTER_MS >= pause_ms && paused_ms <= pause_ms + PAUSE_LONGER_MS,
        "a {pause_ms} ms pause of the node reported as {paused_ms} ms: {paused}"
    );
    assert!(paused["stalls_100ms"].as_u64() >= Some(1), "the stall is counted: {paused}");
    assert!(
        calm_ms + PAUSE_SHORTER_MS < pause_ms,
        "writes to a running node reported a {calm_ms} ms stall: {calm}"
    );
    assert!(
        idle_ms + PAUSE_SHORTER_MS < pause_ms,
        "a device with nothing to do reported a {idle_ms} ms stall: {idle}"
    );

    mount.unmount();
    device.detach();
    fuse.stop();
    node.stop_cleanly();
}
