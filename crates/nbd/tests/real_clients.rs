//! End-to-end tests with real NBD clients: libnbd's `nbdinfo` and `nbdcopy`, `qemu-io` and fio's
//! nbd engine, against a tiny tokio server that drives `nbd::server::Connection` over exports
//! held in RAM.
//!
//! The clients are Debian packages (`libnbd-bin`, `qemu-utils`, `fio`); `scripts/deps.sh`
//! installs them. A missing client fails its test with the package to install: nothing is
//! skipped.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nbd::server::{Catalog, Connection, ExportInfo, Request, RequestKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const DISK_BYTES: usize = 16 << 20;
const SNAP_BYTES: usize = 1 << 20;
/// A client that runs longer than this is killed and its test fails.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);
/// Bytes read from the socket at a time.
const READ_CHUNK_BYTES: usize = 1 << 20;

type Disks = Arc<Mutex<HashMap<String, Vec<u8>>>>;

struct RamCatalog {
    exports: Vec<ExportInfo>,
}

impl Catalog for RamCatalog {
    fn list(&self) -> Vec<ExportInfo> {
        self.exports.clone()
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        self.exports.iter().find(|export| export.name == name).cloned()
    }
}

/// A server on 127.0.0.1:(free port) with a writable export "disk" and a read-only "snap" whose
/// bytes are `snap_byte(offset)`. Stops when dropped.
struct Server {
    address: SocketAddr,
    disks: Disks,
    _runtime: tokio::runtime::Runtime,
}

fn snap_byte(offset: usize) -> u8 {
    (offset / 4096 * 31 + offset % 251) as u8
}

impl Server {
    fn start() -> Server {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let listener =
            runtime.block_on(TcpListener::bind("127.0.0.1:0")).expect("bind 127.0.0.1:0");
        let address = listener.local_addr().expect("local address");
        let catalog = Arc::new(RamCatalog {
            exports: vec![
                ExportInfo {
                    name: "disk".to_owned(),
                    size_bytes: DISK_BYTES as u64,
                    read_only: false,
                    description: "Ferrite test disk".to_owned(),
                },
                ExportInfo {
                    name: "snap".to_owned(),
                    size_bytes: SNAP_BYTES as u64,
                    read_only: true,
                    description: "read-only snapshot".to_owned(),
                },
            ],
        });
        let mut disks = HashMap::new();
        disks.insert("disk".to_owned(), vec![0u8; DISK_BYTES]);
        disks.insert("snap".to_owned(), (0..SNAP_BYTES).map(snap_byte).collect());
        let disks: Disks = Arc::new(Mutex::new(disks));
        let accept_disks = Arc::clone(&disks);
        runtime.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let catalog: Arc<dyn Catalog> = catalog.clone();
                tokio::spawn(serve(stream, catalog, Arc::clone(&accept_disks)));
            }
        });
        Server { address, disks, _runtime: runtime }
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.address.port())
    }

    fn disk(&self, name: &str) -> Vec<u8> {
        self.disks.lock().unwrap()[name].clone()
    }
}

/// The driver loop: take bytes, execute requests, send output, until the connection is done.
async fn serve(mut stream: TcpStream, catalog: Arc<dyn Catalog>, disks: Disks) {
    stream.set_nodelay(true).expect("TCP_NODELAY");
    let mut connection = Connection::new(catalog, 0);
    let mut input = Vec::new();
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    loop {
        // Bounded: every pass takes bytes or executes requests, and both are finite.
        loop {
            let used = match connection.receive(&input) {
                Ok(used) => used,
                Err(error) => {
                    eprintln!("connection closed: {error}");
                    for chunk in connection.output_chunks() {
                        if stream.write_all(chunk).await.is_err() {
                            break;
                        }
                    }
                    return;
                }
            };
            input.drain(..used);
            let mut executed = 0;
            while let Some(request) = connection.next_request() {
                execute(&disks, &mut connection, request);
                executed += 1;
            }
            if connection.output_len() > 0 {
                for chunk in connection.output_chunks() {
                    if stream.write_all(chunk).await.is_err() {
                        return;
                    }
                }
                let sent = connection.output_len();
                connection.consume_output(sent);
            }
            if used == 0 && executed == 0 {
                break;
            }
        }
        if connection.wants_close() {
            return;
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(read) => input.extend_from_slice(&chunk[..read]),
        }
    }
}

fn execute(disks: &Disks, connection: &mut Connection, request: Request) {
    let name = connection.export().expect("requests come after the handshake").name.clone();
    let mut disks = disks.lock().unwrap();
    let disk = disks.get_mut(&name).expect("exports have disks");
    let range = |offset: u64, length: usize| offset as usize..offset as usize + length;
    match request.kind {
        RequestKind::Read { offset, mut buf } => {
            let length = buf.len();
            buf.copy_from_slice(&disk[range(offset, length)]);
            connection.complete(request.id, Ok(()), Some(buf));
        }
        RequestKind::Write { offset, data, .. } => {
            disk[range(offset, data.len())].copy_from_slice(&data);
            connection.complete(request.id, Ok(()), Some(data));
        }
        RequestKind::Flush => connection.complete(request.id, Ok(()), None),
        RequestKind::Trim { offset, length_bytes, .. }
        | RequestKind::WriteZeroes { offset, length_bytes, .. } => {
            disk[range(offset, length_bytes as usize)].fill(0);
            connection.complete(request.id, Ok(()), None);
        }
    }
}

/// A command for `program`, which must be installed (it comes in the Debian package `package`).
fn client(program: &str, package: &str) -> Command {
    let found = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "`{program}` is not installed: install the Debian package `{package}` \
         (scripts/deps.sh installs it) to run the NBD client tests"
    );
    Command::new(program)
}

/// Runs `command` to completion within [`CLIENT_TIMEOUT`]; fails the test if it times out.
fn run(mut command: Command) -> Output {
    let description = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start {description}: {error}"));
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    while child.try_wait().expect("wait for the client").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let output = child.wait_with_output().expect("client output");
            panic!(
                "{description} did not finish within {CLIENT_TIMEOUT:?}; stderr:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("client output")
}

/// Runs `command`, requires success, and returns its stdout followed by its stderr.
fn run_ok(command: Command) -> String {
    let description = format!("{command:?}");
    let output = run(command);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{description} failed ({}):\n{text}", output.status);
    eprintln!("{description}:\n{text}");
    text
}

#[test]
fn nbdinfo_lists_exports() {
    let server = Server::start();
    let mut command = client("nbdinfo", "libnbd-bin");
    command.args(["--list", "--json", &format!("nbd://127.0.0.1:{}", server.address.port())]);
    let text = run_ok(command);
    assert!(text.contains("\"export-name\": \"disk\""), "{text}");
    assert!(text.contains("\"export-name\": \"snap\""), "{text}");
    assert!(text.contains("Ferrite test disk"), "{text}");
}

#[test]
fn nbdinfo_describes_an_export() {
    let server = Server::start();
    let mut command = client("nbdinfo", "libnbd-bin");
    command.args(["--json", &server.uri("disk")]);
    let text = run_ok(command);
    for expected in [
        "\"export-size\": 16777216",
        "\"block_size_minimum\": 4096",
        "\"block_size_preferred\": 4096",
        "\"block_size_maximum\": 33554432",
        "\"is_read_only\": false",
        "\"can_flush\": true",
        "\"can_fua\": true",
        "\"can_trim\": true",
        "\"can_zero\": true",
        "\"can_multi_conn\": true",
        "\"Ferrite test disk\"",
    ] {
        assert!(text.contains(expected), "missing {expected} in:\n{text}");
    }
    let mut command = client("nbdinfo", "libnbd-bin");
    command.args(["--json", &server.uri("snap")]);
    let text = run_ok(command);
    assert!(text.contains("\"is_read_only\": true"), "{text}");
    assert!(text.contains("\"export-size\": 1048576"), "{text}");

    let mut command = client("nbdinfo", "libnbd-bin");
    command.arg(server.uri("nope"));
    let output = run(command);
    assert!(!output.status.success(), "an unknown export must fail");
}

#[test]
fn qemu_io_writes_and_reads_back() {
    let server = Server::start();
    let mut command = client("qemu-io", "qemu-utils");
    command.args([
        "-f",
        "raw",
        "-c",
        "write -P 0xab 0 64k",
        "-c",
        "read -P 0xab 0 64k",
        "-c",
        "write -P 0x5c 1M 12k",
        "-c",
        "flush",
        "-c",
        "read -P 0x5c 1M 12k",
        "-c",
        "write -z 64k 64k",
        "-c",
        "read -P 0 64k 64k",
        &server.uri("disk"),
    ]);
    let text = run_ok(command);
    // qemu-io reports a failed command on its output but may still exit 0.
    for failure in ["fail", "error", "Error", "mismatch"] {
        assert!(!text.contains(failure), "qemu-io reported a failure:\n{text}");
    }
    let disk = server.disk("disk");
    assert!(disk[..64 * 1024].iter().all(|byte| *byte == 0xab));
    assert!(disk[64 * 1024..128 * 1024].iter().all(|byte| *byte == 0));
    assert!(disk[1 << 20..(1 << 20) + 12 * 1024].iter().all(|byte| *byte == 0x5c));

    // An unaligned write goes through qemu's read-modify-write, since it honours the 4 KiB
    // minimum block size the server advertises.
    let mut command = client("qemu-io", "qemu-utils");
    command.args([
        "-f",
        "raw",
        "-c",
        "write -P 0x11 512 1k",
        "-c",
        "read -P 0x11 512 1k",
        &server.uri("disk"),
    ]);
    let text = run_ok(command);
    assert!(!text.contains("fail"), "{text}");
    let disk = server.disk("disk");
    assert!(disk[..512].iter().all(|byte| *byte == 0xab));
    assert!(disk[512..1536].iter().all(|byte| *byte == 0x11));
    assert!(disk[1536..4096].iter().all(|byte| *byte == 0xab));
}

#[test]
fn qemu_io_cannot_write_a_read_only_export() {
    let server = Server::start();
    let mut command = client("qemu-io", "qemu-utils");
    command.args(["-f", "raw", "-c", "write -P 0xab 0 4k", &server.uri("snap")]);
    let output = run(command);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("qemu-io on a read-only export ({}):\n{text}", output.status);
    assert!(
        !output.status.success() || text.contains("read-only") || text.contains("not permitted"),
        "writing a read-only export must fail:\n{text}"
    );
    assert_eq!(server.disk("snap"), (0..SNAP_BYTES).map(snap_byte).collect::<Vec<_>>());
}

#[test]
fn nbdcopy_to_and_from_an_export() {
    let server = Server::start();
    let directory = tempfile::tempdir().expect("temp dir");
    let source: PathBuf = directory.path().join("source.img");
    let pattern: Vec<u8> =
        (0..DISK_BYTES).map(|offset| (offset as u32).wrapping_mul(2_654_435_761) as u8).collect();
    std::fs::write(&source, &pattern).expect("write source image");

    let mut command = client("nbdcopy", "libnbd-bin");
    command.arg(&source).arg(server.uri("disk"));
    run_ok(command);
    assert!(server.disk("disk") == pattern, "the export holds the copied image");

    let copy = directory.path().join("copy.img");
    let mut command = client("nbdcopy", "libnbd-bin");
    command.arg(server.uri("disk")).arg(&copy);
    run_ok(command);
    assert!(std::fs::read(&copy).expect("read copy") == pattern, "the copy matches");

    let snap_copy = directory.path().join("snap.img");
    let mut command = client("nbdcopy", "libnbd-bin");
    command.arg(server.uri("snap")).arg(&snap_copy);
    run_ok(command);
    let expected: Vec<u8> = (0..SNAP_BYTES).map(snap_byte).collect();
    assert!(std::fs::read(&snap_copy).expect("read snap copy") == expected);
}

#[test]
fn fio_nbd_engine_verifies_its_writes() {
    let server = Server::start();
    let mut command = client("fio", "fio");
    command.args([
        "--name=ferrite-nbd",
        "--ioengine=nbd",
        &format!("--uri={}", server.uri("disk")),
        "--rw=randwrite",
        "--bs=4k",
        "--size=8m",
        "--iodepth=16",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
    ]);
    let text = run_ok(command);
    assert!(text.contains("ferrite-nbd"), "{text}");
    assert!(!text.contains("verify: bad"), "{text}");
}

/// An nbdfuse mount: unmounted, and the nbdfuse process we started stopped, when dropped.
struct FuseMount {
    mountpoint: PathBuf,
    child: std::process::Child,
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3").arg("-u").arg(&self.mountpoint).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn nbdfuse_exposes_an_export_as_a_file() {
    use std::io::{Read, Seek, SeekFrom, Write};
    let server = Server::start();
    let directory = tempfile::tempdir().expect("temp dir");
    let mountpoint = directory.path().join("mnt");
    std::fs::create_dir(&mountpoint).expect("create the mountpoint");
    // nbdfuse unmounts with fusermount3, from the Debian package fuse3.
    client("fusermount3", "fuse3");
    let mut command = client("nbdfuse", "libnbd-bin");
    command.arg(mountpoint.join("disk")).arg(server.uri("disk")).stdin(Stdio::null());
    let child = command.spawn().expect("start nbdfuse");
    let mut mount = FuseMount { mountpoint: mountpoint.clone(), child };
    let file = mountpoint.join("disk");
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    while std::fs::metadata(&file).map(|metadata| metadata.len()).unwrap_or(0) != DISK_BYTES as u64
    {
        if let Some(status) = mount.child.try_wait().expect("nbdfuse status") {
            panic!("nbdfuse exited ({status}): FUSE must be usable (/dev/fuse, CAP_SYS_ADMIN)");
        }
        assert!(Instant::now() < deadline, "nbdfuse did not mount within {CLIENT_TIMEOUT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }

    let mut handle =
        std::fs::OpenOptions::new().read(true).write(true).open(&file).expect("open the file");
    handle.seek(SeekFrom::Start(8192)).unwrap();
    handle.write_all(&[0x77; 8192]).expect("aligned write");
    handle.sync_all().expect("fsync");
    let mut back = vec![0; 8192];
    handle.seek(SeekFrom::Start(8192)).unwrap();
    handle.read_exact(&mut back).expect("aligned read");
    assert!(back.iter().all(|byte| *byte == 0x77));
    assert!(server.disk("disk")[8192..16384].iter().all(|byte| *byte == 0x77));

    // nbdfuse (libnbd 1.14) does no read-modify-write, so a write below the 4 KiB minimum block
    // fails with EINVAL. Whatever the client does, nothing else may change.
    handle.seek(SeekFrom::Start(100)).unwrap();
    let unaligned = handle.write_all(&[0x42; 10]).and_then(|()| handle.sync_all());
    drop(handle);
    drop(mount);
    let disk = server.disk("disk");
    match unaligned {
        Ok(()) => assert!(disk[100..110].iter().all(|byte| *byte == 0x42)),
        Err(error) => {
            assert_eq!(error.raw_os_error(), Some(22), "{error}");
            assert!(disk[100..110].iter().all(|byte| *byte == 0));
        }
    }
    assert!(disk[..100].iter().chain(&disk[110..8192]).all(|byte| *byte == 0));
}
