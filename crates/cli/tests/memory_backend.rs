//! `ferrite up --drive-backend memory` end to end: a node on RAM drives serves a volume that
//! `ferrite bench --fill --verify` writes and reads back, says everywhere that it is NOT
//! DURABLE (start-up lines, `node show`, the metrics), removes its scratch metadata when it
//! stops, and starts empty again. Also what it refuses: --data-dir, and drives that would not
//! fit in RAM.
//!
//! `common::Node` always passes --data-dir, which the memory backend refuses, so this file has
//! its own small process wrapper.

mod common;

use common::{
    assert_no_error_lines, ferrite, ferrite_ok, free_port, volume_list, volume_nqn,
    wait_with_timeout, FERRITE, NODE_TIMEOUT, START_ATTEMPTS_MAX, START_RETRY_PAUSE,
};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

const VOLUME: &str = "ram";
/// Two small memory drives, one data-path thread that busy-polls (so the verified workload also
/// runs through the polling path): little RAM, and fast on a busy machine.
const MEMORY_ARGS: [&str; 10] = [
    "--drive-backend",
    "memory",
    "--drives",
    "2",
    "--drive-size",
    "256M",
    "--data-threads",
    "1",
    "--poll-us",
    "100",
];

/// A running `ferrite up --drive-backend memory`, killed and reaped on drop.
struct MemoryNode {
    child: Child,
    api_url: String,
    nvme_port: u16,
    /// The stdout lines up to "Stop with Ctrl-C.".
    banner: Vec<String>,
    stdout: mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl MemoryNode {
    fn start(nvme_port: u16) -> MemoryNode {
        for attempt in 1..=START_ATTEMPTS_MAX {
            match MemoryNode::try_start(nvme_port) {
                Ok(node) => return node,
                Err(stderr) if stderr.contains("cannot listen for NVMe/TCP") => {
                    std::thread::sleep(START_RETRY_PAUSE);
                }
                Err(stderr) => panic!("`ferrite up` failed (attempt {attempt}):\n{stderr}"),
            }
        }
        panic!("NVMe/TCP port {nvme_port} stayed taken");
    }

    /// Starts the node and reads its banner; `Err(stderr)` if it exits first.
    fn try_start(nvme_port: u16) -> Result<MemoryNode, String> {
        let mut child = Command::new(FERRITE)
            .arg("up")
            .args(MEMORY_ARGS)
            .args(["--api-listen", "127.0.0.1:0"])
            .args(["--nvme-listen", &format!("127.0.0.1:{nvme_port}")])
            .args(["--nbd-listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn `ferrite up`");
        let stdout = common::stdout_lines(&mut child);
        let mut pipe = child.stderr.take().expect("piped stderr");
        let stderr = std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            String::from_utf8_lossy(&bytes).into_owned()
        });
        let mut node = MemoryNode {
            child,
            api_url: String::new(),
            nvme_port,
            banner: Vec::new(),
            stdout,
            stderr: Some(stderr),
        };
        let deadline = Instant::now() + NODE_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match node.stdout.recv_timeout(left) {
                Ok(line) if line.contains("Stop with Ctrl-C") => break,
                Ok(line) => node.banner.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(node.finish().1),
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("no banner in {NODE_TIMEOUT:?}"),
            }
        }
        node.api_url = node.banner_value("REST API:");
        Ok(node)
    }

    /// The value after `key` in the start-up banner.
    fn banner_value(&self, key: &str) -> String {
        let line = self.banner.iter().find(|line| line.trim_start().starts_with(key));
        let line = line.unwrap_or_else(|| panic!("no {key:?} in {:?}", self.banner));
        line.trim_start()[key.len()..].trim().to_owned()
    }

    fn target(&self) -> String {
        format!("nvme+tcp://127.0.0.1:{}/{}", self.nvme_port, volume_nqn(VOLUME))
    }

    /// SIGTERM; requires a clean stop. Returns stdout after the banner, and stderr.
    fn stop_cleanly(mut self) -> (Vec<String>, String) {
        // SAFETY: kill(2) has no memory effects; the PID is our own child, not yet waited for,
        // so it cannot have been reused by another process.
        let sent = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(sent, 0, "kill(SIGTERM) failed");
        let (lines, stderr) = self.finish();
        assert!(lines.iter().any(|line| line.contains("stopped cleanly")), "{lines:?}\n{stderr}");
        (lines, stderr)
    }

    /// Waits for the process to end; its remaining stdout lines and its stderr.
    fn finish(&mut self) -> (Vec<String>, String) {
        let status = wait_with_timeout(&mut self.child, NODE_TIMEOUT);
        if status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let lines: Vec<String> = self.stdout.try_iter().collect();
        let stderr = self.stderr.take().map(|thread| thread.join().unwrap_or_default());
        let stderr = stderr.unwrap_or_default();
        assert!(status.is_some_and(|status| status.success()), "exit {status:?}:\n{stderr}");
        (lines, stderr)
    }
}

impl Drop for MemoryNode {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[test]
fn memory_node_serves_verified_data_then_forgets_everything() {
    let nvme_port = free_port();
    let node = MemoryNode::start(nvme_port);
    let banner = node.banner.join("\n");
    assert!(banner.contains("2 x 256MiB in RAM (memory backend)"), "{banner}");
    assert!(banner.contains("NOT DURABLE, data is lost when the node stops"), "{banner}");
    let meta_path = PathBuf::from(node.banner_value("metadata:"));
    let scratch_dir = meta_path.parent().expect("the metadata file has a folder").to_owned();
    assert!(meta_path.exists(), "{}", meta_path.display());

    ferrite_ok(&node.api_url, &["volume", "create", VOLUME, "--size", "64M"]);
    let bench = [
        "bench",
        "--target",
        &node.target(),
        "--fill",
        "--verify",
        "--workloads",
        "4k_randwrite,8k_randrw_80_20,4k_randread",
        "--runtime",
        "1",
        "--ramp",
        "0",
        "--quiet",
    ];
    let report = ferrite_ok(&node.api_url, &bench);
    assert!(report.contains("4k_randread"), "{report}");

    let show = ferrite_ok(&node.api_url, &["node", "show"]);
    assert!(show.contains("drive backend:   memory (NOT DURABLE"), "{show}");
    let json: serde_json::Value =
        serde_json::from_str(&ferrite_ok(&node.api_url, &["node", "show", "--json"])).unwrap();
    assert_eq!(json["drive_backend"], "memory", "{json}");
    assert_eq!(json["drive_count"], 2, "{json}");
    assert!(json["capacity"]["mapped_bytes"].as_u64().unwrap() > 0, "the fill wrote: {json}");
    let metrics = api::Client::new(&node.api_url).unwrap().metrics().unwrap();
    assert!(metrics.contains("ferrite_node_drive_backend{backend=\"memory\"} 1\n"), "{metrics}");
    assert!(metrics.contains("ferrite_node_drive_backend{backend=\"file\"} 0\n"), "{metrics}");
    let node_uuid = json["node_uuid"].as_str().unwrap().to_owned();

    let (_, stderr) = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "memory node");
    let warning = stderr.lines().find(|line| line.contains(" WARN "));
    let warning = warning.unwrap_or_else(|| panic!("no WARN line:\n{stderr}"));
    assert!(warning.contains("drive backend: memory — NOT DURABLE"), "{warning}");
    assert!(!scratch_dir.exists(), "{} outlived the node", scratch_dir.display());

    // A restart is a new, empty node: no volume whose data is gone.
    let node = MemoryNode::start(nvme_port);
    assert_eq!(volume_list(&node.api_url)["volumes"], serde_json::json!([]));
    let json: serde_json::Value =
        serde_json::from_str(&ferrite_ok(&node.api_url, &["node", "show", "--json"])).unwrap();
    assert_ne!(json["node_uuid"], node_uuid.as_str(), "{json}");
    assert_eq!(json["volume_count"], 0, "{json}");
    let (_, stderr) = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "restarted memory node");
}

#[test]
fn memory_backend_refuses_a_data_dir_and_drives_larger_than_ram() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let check = |args: &[&str], expect: &str| {
        let mut command = vec!["up", "--drive-backend", "memory"];
        command.extend_from_slice(args);
        command.extend_from_slice(&["--api-listen", "127.0.0.1:0", "--nvme-listen", "127.0.0.1:0"]);
        command.extend_from_slice(&["--nbd-listen", "off"]);
        let output = ferrite("http://127.0.0.1:1", &command);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{command:?} started");
        assert!(stderr.contains(expect), "{command:?}: {stderr:?} lacks {expect:?}");
    };
    check(
        &["--data-dir", data_dir.to_str().unwrap()],
        "--data-dir cannot be used with --drive-backend memory",
    );
    assert!(!data_dir.exists(), "a refused start creates nothing");
    // 4 x 1 PiB fits in no machine's RAM.
    check(&["--drive-size", "1P"], "do not fit in RAM: at most 75% of the");
}
