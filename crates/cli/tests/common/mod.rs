//! What the end-to-end tests share: a `ferrite up` process owned by the test (killed and reaped
//! on drop, so a failing test leaves no node behind), its stderr kept for the ERROR-line check,
//! the `ferrite` client commands, the initiator-side helpers (patterns, NQNs, addresses), and
//! for the tests that put a real file system on a volume, the standard clients and the guards
//! of an nbdfuse file, a loop device over it and a mount (each released on drop); `failover`
//! holds the verifying workload of the failover tests, and `cluster` a private etcd with several
//! cluster nodes (and, for partitions, their network namespaces).
//!
//! Each test binary uses part of this module, so unused items are expected in some of them.
#![allow(dead_code)]

pub mod cluster;
pub mod failover;

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

pub const FERRITE: &str = env!("CARGO_BIN_EXE_ferrite");
/// How long `ferrite up` may take to start serving or to stop.
pub const NODE_TIMEOUT: Duration = Duration::from_secs(30);
/// Starts of `ferrite up` tried while its NVMe/TCP port is still held by a killed predecessor.
pub const START_ATTEMPTS_MAX: u32 = 40;
/// Pause between those attempts.
pub const START_RETRY_PAUSE: Duration = Duration::from_millis(250);
/// Every test node: two sparse 1 GiB drive files (32 chunks of 64 MiB).
pub const DRIVE_ARGS: [&str; 4] = ["--drives", "2", "--drive-size", "1G"];
pub const BLOCK_BYTES: usize = 4096;

/// A port nothing listens on right now: the OS hands it out and we give it back.
/// Forwards the piped stdout of `child` line by line from a reader thread, so tests can wait for
/// a banner line without blocking on the pipe.
pub fn stdout_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let (sender, lines) = mpsc::channel();
    let reader = BufReader::new(child.stdout.take().expect("piped stdout"));
    std::thread::spawn(move || {
        for line in reader.lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("ephemeral port address").port()
}

/// The subsystem NQN of a Ferrite volume.
pub fn volume_nqn(name: &str) -> initiator::Nqn {
    initiator::Nqn::new(&format!("{}{name}", types::SUBSYSTEM_NQN_PREFIX)).expect("volume NQN")
}

/// How a node process ended.
#[derive(Debug)]
pub struct Exit {
    pub status: ExitStatus,
    pub stdout: Vec<String>,
    pub stderr: String,
}

/// A running `ferrite up`. Dropping it kills the process (only this one, by its own handle) and
/// waits for it.
pub struct Node {
    child: Child,
    pub api_url: String,
    pub nvme_port: u16,
    /// Where the node serves NBD (`--nbd-listen 127.0.0.1:0`: the port it printed).
    pub nbd_address: String,
    stdout: mpsc::Receiver<String>,
    stdout_lines: Vec<String>,
    stderr: Arc<Mutex<String>>,
    stderr_thread: Option<std::thread::JoinHandle<()>>,
}

impl Node {
    /// Starts `ferrite up` on `data_dir` serving NVMe/TCP on `nvme_port`, and waits until its
    /// REST API answers. If the port is still taken (a killed node's sockets), tries again.
    pub fn start(data_dir: &Path, nvme_port: u16) -> Node {
        Node::start_with_drives(data_dir, nvme_port, &DRIVE_ARGS)
    }

    /// [`Node::start`] with other drive arguments than [`DRIVE_ARGS`] (for example one small
    /// drive, to fill it).
    pub fn start_with_drives(data_dir: &Path, nvme_port: u16, drive_args: &[&str]) -> Node {
        let mut attempt = 1;
        loop {
            match Node::try_start(data_dir, nvme_port, drive_args) {
                Ok(node) => return node,
                Err(exit)
                    if attempt < START_ATTEMPTS_MAX
                        && exit.stderr.contains("cannot listen for NVMe/TCP") =>
                {
                    attempt += 1;
                    std::thread::sleep(START_RETRY_PAUSE);
                }
                Err(exit) => panic!(
                    "`ferrite up` exited with {} before serving (attempt {attempt}); stderr:\n{}",
                    exit.status, exit.stderr
                ),
            }
        }
    }

    fn try_start(data_dir: &Path, nvme_port: u16, drive_args: &[&str]) -> Result<Node, Exit> {
        let mut child = Command::new(FERRITE)
            .args(["up", "--data-dir"])
            .arg(data_dir)
            .args(["--api-listen", "127.0.0.1:0"])
            .args(["--nvme-listen", &format!("127.0.0.1:{nvme_port}")])
            .args(["--nbd-listen", "127.0.0.1:0"])
            .args(drive_args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn `ferrite up`");
        let stdout = stdout_lines(&mut child);
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = BufReader::new(child.stderr.take().expect("piped stderr"));
        let sink = Arc::clone(&stderr);
        let stderr_thread = std::thread::spawn(move || {
            let mut line = Vec::new();
            loop {
                line.clear();
                match pipe.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => sink
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push_str(&String::from_utf8_lossy(&line)),
                }
            }
        });
        let mut node = Node {
            child,
            api_url: String::new(),
            nvme_port,
            nbd_address: String::new(),
            stdout,
            stdout_lines: Vec::new(),
            stderr,
            stderr_thread: Some(stderr_thread),
        };
        match node.wait_for_line("REST API:") {
            Some(line) => {
                node.api_url = line.split_whitespace().last().unwrap_or_default().to_owned();
            }
            None => return Err(node.reap()),
        }
        match node.wait_for_line("NBD:") {
            Some(line) => {
                node.nbd_address = line.split_whitespace().last().unwrap_or_default().to_owned();
            }
            None => return Err(node.reap()),
        }
        node.wait_healthy();
        Ok(node)
    }

    /// Waits for a stdout line containing `needle`; `None` if stdout closed first (the process
    /// ended). Panics after [`NODE_TIMEOUT`].
    fn wait_for_line(&mut self, needle: &str) -> Option<String> {
        let deadline = Instant::now() + NODE_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) => {
                    self.stdout_lines.push(line.clone());
                    if line.contains(needle) {
                        return Some(line);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("`ferrite up` printed no line with {needle:?} in {NODE_TIMEOUT:?}")
                }
            }
        }
    }

    fn wait_healthy(&self) {
        let client = api::Client::new(&self.api_url).expect("API client");
        let deadline = Instant::now() + NODE_TIMEOUT;
        while let Err(error) = client.health() {
            assert!(Instant::now() < deadline, "/healthz never answered: {error}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> libc::pid_t {
        libc::pid_t::try_from(self.child.id()).expect("PID fits pid_t")
    }

    pub fn nvme_address(&self) -> String {
        format!("127.0.0.1:{}", self.nvme_port)
    }

    /// The NBD URI of export `name` (a volume).
    pub fn nbd_uri(&self, name: &str) -> String {
        format!("nbd://{}/{name}", self.nbd_address)
    }

    /// The node's stderr so far.
    pub fn stderr_now(&self) -> String {
        self.stderr.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Sends `signal` to this node's process (only to it) and waits for it to exit.
    pub fn signal_and_wait(mut self, signal: libc::c_int) -> Exit {
        // SAFETY: kill(2) has no memory effects; `pid` is our own child, not yet waited for, so
        // the PID cannot have been reused by another process.
        let sent = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(sent, 0, "kill({}, {signal}) failed", self.pid());
        let status = wait_with_timeout(&mut self.child, NODE_TIMEOUT)
            .unwrap_or_else(|| panic!("`ferrite up` did not exit after signal {signal}"));
        let mut exit = self.reap();
        exit.status = status;
        exit
    }

    /// SIGTERM, then requires a clean stop: exit status 0 and "stopped cleanly" on stdout.
    /// Returns the node's stderr.
    pub fn stop_cleanly(self) -> String {
        let exit = self.signal_and_wait(libc::SIGTERM);
        assert!(
            exit.status.success(),
            "`ferrite up` exited with {} on SIGTERM; stderr:\n{}",
            exit.status,
            exit.stderr
        );
        assert!(
            exit.stdout.iter().any(|line| line.contains("stopped cleanly")),
            "`ferrite up` did not print \"stopped cleanly\"; stdout: {:?}; stderr:\n{}",
            exit.stdout,
            exit.stderr
        );
        exit.stderr
    }

    /// Waits for the (ended or ending) process and collects its output.
    fn reap(&mut self) -> Exit {
        let status = wait_with_timeout(&mut self.child, NODE_TIMEOUT).unwrap_or_else(|| {
            let _ = self.child.kill();
            self.child.wait().expect("wait for `ferrite up`")
        });
        if let Some(thread) = self.stderr_thread.take() {
            let _ = thread.join();
        }
        while let Ok(line) = self.stdout.recv_timeout(Duration::from_secs(5)) {
            self.stdout_lines.push(line);
        }
        Exit { status, stdout: self.stdout_lines.clone(), stderr: self.stderr_now() }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A child process (other than a node) that the test owns: killed and reaped on drop.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Waits up to `timeout` for the child to exit; `None` if it is still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_with_timeout(&mut self.0, timeout)
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

pub fn wait_with_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait on our child") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Fails if `stderr` holds a tracing line at ERROR level, other than lines containing one of
/// `expected`.
#[track_caller]
pub fn assert_no_error_lines(stderr: &str, expected: &[&str], context: &str) {
    let unexpected: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains(" ERROR "))
        .filter(|line| !expected.iter().any(|allowed| line.contains(allowed)))
        .collect();
    assert!(
        unexpected.is_empty(),
        "{context}: unexpected ERROR log line(s):\n{}\nfull stderr:\n{stderr}",
        unexpected.join("\n")
    );
}

/// Runs `ferrite ARGS` against the node's API.
pub fn ferrite(api_url: &str, args: &[&str]) -> Output {
    Command::new(FERRITE)
        .args(args)
        .env("FERRITE_API", api_url)
        .stdin(Stdio::null())
        .output()
        .expect("run ferrite")
}

/// Runs a command that must succeed; returns its stdout.
#[track_caller]
pub fn ferrite_ok(api_url: &str, args: &[&str]) -> String {
    let output = ferrite(api_url, args);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "ferrite {args:?} failed ({}): {stderr}", output.status);
    stdout
}

/// The value of a counter or gauge without labels in a node's Prometheus metrics text.
#[track_caller]
pub fn metric(metrics: &str, series: &str) -> u64 {
    let line = metrics
        .lines()
        .find(|line| line.starts_with(series) && line[series.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no series {series} in the metrics"));
    line[series.len() + 1..].parse().expect("a counter")
}

/// The volumes as `ferrite volume list --json` prints them.
/// `volume list --json`, without each volume's `nbd_uri`: it names the NBD port of this start
/// of the node (each [`Node::start`] picks a free one), which is not what a volume is.
pub fn volume_list(api_url: &str) -> serde_json::Value {
    let text = ferrite_ok(api_url, &["volume", "list", "--json"]);
    let mut list: serde_json::Value = serde_json::from_str(&text).expect("volume list JSON");
    if let Some(volumes) = list["volumes"].as_array_mut() {
        for volume in volumes {
            if let Some(volume) = volume.as_object_mut() {
                volume.remove("nbd_uri");
            }
        }
    }
    list
}

/// A block-sized pattern that names its volume tag, LBA and a salt, so a block that lands at
/// the wrong place or comes from another write is told apart.
pub fn fill_pattern(buffer: &mut [u8], first_lba: u64, tag: u64) {
    assert_eq!(buffer.len() % BLOCK_BYTES, 0);
    for (index, block) in buffer.chunks_exact_mut(BLOCK_BYTES).enumerate() {
        let lba = first_lba + index as u64;
        let mut state = (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ tag) | 1;
        for word in block.chunks_exact_mut(8) {
            // xorshift64
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        block[..8].copy_from_slice(&lba.to_le_bytes());
        block[8..16].copy_from_slice(&tag.to_le_bytes());
    }
}

/// An aligned buffer of `blocks` blocks holding [`fill_pattern`].
pub fn pattern(first_lba: u64, blocks: usize, tag: u64) -> initiator::AlignedBuf {
    let mut buffer = initiator::AlignedBuf::new(blocks * BLOCK_BYTES);
    fill_pattern(&mut buffer, first_lba, tag);
    buffer
}

/// The first block of `actual` that differs from the pattern, with what it holds.
pub fn pattern_mismatch(actual: &[u8], first_lba: u64, tag: u64) -> Option<String> {
    let mut expected = vec![0u8; actual.len()];
    fill_pattern(&mut expected, first_lba, tag);
    actual.chunks_exact(BLOCK_BYTES).zip(expected.chunks_exact(BLOCK_BYTES)).enumerate().find_map(
        |(index, (got, want))| {
            (got != want).then(|| {
                let lba = first_lba + index as u64;
                let head = |bytes: &[u8]| {
                    (
                        u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default()),
                        u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default()),
                    )
                };
                let differing = got.iter().zip(want).filter(|(a, b)| a != b).count();
                format!(
                    "block {lba} (tag {tag:#x}): {differing} bytes differ; it holds header \
                     (lba, tag) {:?}, expected {:?}",
                    head(got),
                    head(want)
                )
            })
        },
    )
}

/// A multi-thread tokio runtime for the initiator (its keep-alive runs in the background while
/// the test's main thread blocks on processes).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

// ----- Standard clients and a file system on an NBD export (nbd.rs, pgbench.rs) -----

/// A client that runs longer than this is killed and its test fails.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// A command for `program`, which must be installed (from the Debian package `package`).
pub fn client(program: &str, package: &str) -> Command {
    let found = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "`{program}` is not installed: install the Debian package `{package}` (scripts/deps.sh \
         installs it) to run this test"
    );
    Command::new(program)
}

/// What a finished client printed.
pub struct Finished {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    /// Its stdout followed by its stderr.
    pub text: String,
}

/// Runs `command` to completion within [`CLIENT_TIMEOUT`] (killed and the test failed if not).
pub fn run(mut command: Command) -> Finished {
    let description = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start {description}: {error}"));
    // Read both pipes while the client runs, so that a chatty client never blocks on them.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            String::from_utf8_lossy(&bytes).into_owned()
        })
    };
    let stdout = drain(child.stdout.take().map(|pipe| Box::new(pipe) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|pipe| Box::new(pipe) as Box<dyn Read + Send>));
    let mut guard = ChildGuard(child);
    let Some(status) = guard.wait_timeout(CLIENT_TIMEOUT) else {
        drop(guard);
        panic!("{description} did not finish within {CLIENT_TIMEOUT:?}");
    };
    let stdout = stdout.join().expect("stdout reader");
    let text = format!("{stdout}{}", stderr.join().expect("stderr reader"));
    eprintln!("{description} ({status}):\n{text}");
    Finished { status, stdout, text }
}

/// Runs `command`, requires success, and returns its stdout followed by its stderr.
#[track_caller]
pub fn run_ok(command: Command) -> String {
    let description = format!("{command:?}");
    let finished = run(command);
    assert!(
        finished.status.success(),
        "{description} failed ({}):\n{}",
        finished.status,
        finished.text
    );
    finished.text
}

/// Checks what the file system tests need (root for losetup and mount, /dev/fuse for nbdfuse),
/// failing with what is missing: nothing is skipped.
pub fn require_root_and_fuse() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "the file system tests need root (losetup, mount); run them as root");
    assert!(
        Path::new("/dev/fuse").exists(),
        "the file system tests need /dev/fuse (nbdfuse): load the fuse module or give the \
         container the device"
    );
    client("fusermount3", "fuse3");
    client("losetup", "mount");
    client("mkfs.ext4", "e2fsprogs");
}

/// An nbdfuse process exposing an export as the file MOUNTPOINT/NAME; unmounted and stopped
/// (this process only) when dropped.
pub struct FuseFile {
    mountpoint: PathBuf,
    pub file: PathBuf,
    child: Option<ChildGuard>,
}

impl FuseFile {
    pub fn start(mountpoint: &Path, name: &str, uri: &str, size_bytes: u64) -> FuseFile {
        std::fs::create_dir_all(mountpoint).expect("create the FUSE mountpoint");
        let file = mountpoint.join(name);
        let mut command = client("nbdfuse", "libnbd-bin");
        command.arg(&file).arg(uri).stdin(Stdio::null());
        let child = ChildGuard(command.spawn().expect("start nbdfuse"));
        let mut fuse = FuseFile { mountpoint: mountpoint.to_owned(), file, child: Some(child) };
        let deadline = Instant::now() + CLIENT_TIMEOUT;
        while std::fs::metadata(&fuse.file).map(|metadata| metadata.len()).unwrap_or(0)
            != size_bytes
        {
            let child = fuse.child.as_mut().expect("nbdfuse child");
            if let Some(status) = child.wait_timeout(Duration::ZERO) {
                panic!("nbdfuse exited ({status}): FUSE must work here (/dev/fuse, root)");
            }
            assert!(Instant::now() < deadline, "nbdfuse did not mount within {CLIENT_TIMEOUT:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        fuse
    }

    /// Unmounts and waits for nbdfuse to exit.
    pub fn stop(mut self) {
        self.unmount();
    }

    fn unmount(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let _ = Command::new("fusermount3").arg("-u").arg(&self.mountpoint).status();
        if child.wait_timeout(Duration::from_secs(10)).is_none() {
            eprintln!("nbdfuse did not exit after unmounting; killing it");
        }
        // Dropping the guard kills it if it still runs.
    }
}

impl Drop for FuseFile {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// A loop device over a file, detached (this device only) when dropped.
pub struct LoopDevice {
    device: Option<String>,
}

impl LoopDevice {
    /// A loop device with 4 KiB sectors, so every I/O reaching the NBD export is aligned to the
    /// node's minimum block (nbdfuse does no read-modify-write).
    pub fn attach(file: &Path) -> LoopDevice {
        let mut command = client("losetup", "mount");
        command.args(["--find", "--show", "--sector-size", "4096"]).arg(file);
        let device = run_ok(command).lines().next().unwrap_or_default().trim().to_owned();
        assert!(device.starts_with("/dev/loop"), "losetup printed no device: {device:?}");
        LoopDevice { device: Some(device) }
    }

    pub fn path(&self) -> &str {
        self.device.as_deref().expect("attached")
    }

    pub fn detach(mut self) {
        self.release(true);
    }

    fn release(&mut self, required: bool) {
        let Some(device) = self.device.take() else { return };
        let status = Command::new("losetup").args(["-d", &device]).status();
        if required {
            assert!(status.is_ok_and(|status| status.success()), "losetup -d {device} failed");
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        self.release(false);
    }
}

/// A mounted file system, unmounted when dropped.
pub struct Mount {
    target: Option<PathBuf>,
}

impl Mount {
    pub fn at(device: &str, target: &Path) -> Mount {
        std::fs::create_dir_all(target).expect("create the mount target");
        let mut command = client("mount", "mount");
        command.arg(device).arg(target);
        run_ok(command);
        Mount { target: Some(target.to_owned()) }
    }

    pub fn unmount(mut self) {
        let target = self.target.take().expect("mounted");
        let mut command = client("umount", "mount");
        command.arg(&target);
        run_ok(command);
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(target) = self.target.take() {
            let _ = Command::new("umount").arg(&target).status();
        }
    }
}

/// Bytes of a drive file read at once while searching it.
const SEARCH_CHUNK_BYTES: usize = 4 << 20;

/// Every 4 KiB-aligned place in the drive files holding exactly `block`: `(file, offset)`.
pub fn find_block(drives_dir: &Path, block: &[u8]) -> Vec<(PathBuf, u64)> {
    let mut found = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(drives_dir)
        .expect("list the drive files")
        .map(|entry| entry.expect("a drive file").path())
        .collect();
    files.sort();
    let mut chunk = vec![0u8; SEARCH_CHUNK_BYTES];
    for path in files {
        let mut file = std::fs::File::open(&path).expect("open a drive file");
        let mut offset = 0u64;
        loop {
            let read = read_full(&mut file, &mut chunk);
            for (index, candidate) in chunk[..read].chunks_exact(BLOCK_BYTES).enumerate() {
                if candidate == block {
                    found.push((path.clone(), offset + (index * BLOCK_BYTES) as u64));
                }
            }
            if read < chunk.len() {
                break;
            }
            offset += read as u64;
        }
    }
    found
}

fn read_full(file: &mut std::fs::File, buffer: &mut [u8]) -> usize {
    let mut filled = 0;
    while filled < buffer.len() {
        match file.read(&mut buffer[filled..]).expect("read a drive file") {
            0 => break,
            read => filled += read,
        }
    }
    filled
}

/// Flips 64 bytes in the middle of the block at `offset` of `path`, durably.
pub fn damage(path: &Path, offset: u64) {
    let mut file =
        std::fs::OpenOptions::new().read(true).write(true).open(path).expect("open a drive file");
    let at = offset + (BLOCK_BYTES / 2) as u64;
    let mut bytes = [0u8; 64];
    file.seek(SeekFrom::Start(at)).expect("seek");
    file.read_exact(&mut bytes).expect("read the block");
    for byte in &mut bytes {
        *byte ^= 0xFF;
    }
    file.seek(SeekFrom::Start(at)).expect("seek");
    file.write_all(&bytes).expect("damage the block");
    file.sync_all().expect("sync the drive file");
}
