//! The NBD frontend end to end, on a real `ferrite up`: standard clients we did not write
//! (libnbd's `nbdinfo`, `nbdcopy` and `nbdfuse`, `qemu-io`, fio's nbd engine) read and write
//! volumes; data crosses between NBD and NVMe/TCP both ways and survives a restart; a volume
//! restricted to listed NVMe hosts is not exported; a resize shows on new connections; a
//! rollback drains and resumes NBD I/O; a deleted volume's connections get errors and close,
//! as do those of a volume closed to NBD; a snapshot is a read-only export `VOLUME@SNAPSHOT`
//! of the moment it was taken, until it is deleted; and ext4 on a loop device over an nbdfuse file keeps
//! its files across a restart of the node.
//!
//! The clients are Debian packages (`libnbd-bin`, `qemu-utils`, `fio`, `fuse3`), installed by
//! `scripts/deps.sh`; a missing one fails its test with the package to install. The file system
//! test needs root (losetup, mount) and /dev/fuse, and fails without them: nothing is skipped.

mod common;

use common::{
    assert_no_error_lines, client, ferrite, ferrite_ok, free_port, pattern, pattern_mismatch,
    require_root_and_fuse, run, run_ok, runtime, volume_nqn, FuseFile, LoopDevice, Mount, Node,
    BLOCK_BYTES,
};
use initiator::{AlignedBuf, ConnectOptions, Controller};
use nbd::wire::{self, client_flag, command, option, reply_type};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
/// A connection the node must close is closed within this time.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the raw test client waits for one reply.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// A host NQN that no test connects with: listing it restricts a volume.
const LISTED_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000aa";

// ----- Running the standard clients -----

/// Runs qemu-io commands on `uri` (raw format) and requires that none failed: qemu-io reports a
/// failed command on its output and may still exit 0.
#[track_caller]
fn qemu_io(uri: &str, commands: &[&str]) -> String {
    let mut command = client("qemu-io", "qemu-utils");
    command.args(["-f", "raw", "-d", "unmap"]);
    for each in commands {
        command.args(["-c", each]);
    }
    command.arg(uri);
    let text = run_ok(command);
    for failure in ["fail", "error", "Error", "mismatch", "Pattern verification"] {
        assert!(!text.contains(failure), "qemu-io reported a failure:\n{text}");
    }
    text
}

/// `nbdinfo --json` of one export.
fn nbdinfo(uri: &str) -> String {
    let mut command = client("nbdinfo", "libnbd-bin");
    command.args(["--json", uri]);
    run_ok(command)
}

/// The export names `nbdinfo --list` shows.
fn listed_exports(node: &Node) -> Vec<String> {
    let mut command = client("nbdinfo", "libnbd-bin");
    command.args(["--list", "--json", &format!("nbd://{}", node.nbd_address)]);
    let finished = run(command);
    assert!(finished.status.success(), "nbdinfo --list failed:\n{}", finished.text);
    let json: serde_json::Value = serde_json::from_str(&finished.stdout)
        .unwrap_or_else(|error| panic!("nbdinfo --list --json: {error}:\n{}", finished.text));
    let mut names: Vec<String> = json["exports"]
        .as_array()
        .unwrap_or_else(|| panic!("no exports array in {json}"))
        .iter()
        .map(|export| export["export-name"].as_str().expect("export-name").to_owned())
        .collect();
    names.sort();
    names
}

/// Copies `from` to `to` with nbdcopy (either may be a file or an NBD URI).
fn nbdcopy(from: &str, to: &str) {
    let mut command = client("nbdcopy", "libnbd-bin");
    command.args([from, to]);
    run_ok(command);
}

/// Bytes that differ from block to block and offset to offset.
fn image(length: usize, salt: u32) -> Vec<u8> {
    (0..length)
        .map(|offset| ((offset as u32).wrapping_mul(2_654_435_761) ^ salt).rotate_left(7) as u8)
        .collect()
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("UTF-8 temp path")
}

#[test]
fn standard_clients_serve_volumes_next_to_nvme_tcp() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let node = Node::start(&data_dir, nvme_port);
    let api = node.api_url.clone();
    ferrite_ok(&api, &["volume", "create", "disk", "--size", "64M"]);
    ferrite_ok(&api, &["volume", "create", "copy", "--size", "32M"]);
    ferrite_ok(&api, &["volume", "create", "locked", "--size", "16M"]);
    ferrite_ok(&api, &["host", "allow", "locked", LISTED_HOST]);

    // The exports: the open volumes, with their sizes and the node's limits.
    assert_eq!(listed_exports(&node), ["copy", "disk"], "a restricted volume is not listed");
    let info = nbdinfo(&node.nbd_uri("disk"));
    for expected in [
        "\"export-size\": 67108864",
        "\"block_size_minimum\": 4096",
        "\"block_size_preferred\": 4096",
        "\"block_size_maximum\": 33554432",
        "\"is_read_only\": false",
        "\"can_flush\": true",
        "\"can_fua\": true",
        "\"can_trim\": true",
        "\"can_zero\": true",
        "\"can_multi_conn\": true",
    ] {
        assert!(info.contains(expected), "missing {expected} in:\n{info}");
    }
    // nbdinfo shows the server's message only in its debug output.
    let mut command = client("nbdinfo", "libnbd-bin");
    command.arg(node.nbd_uri("locked")).env("LIBNBD_DEBUG", "1");
    let refused = run(command);
    assert!(!refused.status.success(), "a restricted volume is exported:\n{}", refused.text);
    assert!(refused.text.contains("restricted to NVMe hosts"), "{}", refused.text);
    let mut command = client("nbdinfo", "libnbd-bin");
    command.arg(node.nbd_uri("nope"));
    assert!(!run(command).status.success(), "an unknown export must fail");

    // qemu-io: patterns, write zeroes, discard, flush, FUA, and an unaligned write that qemu
    // turns into read-modify-write because the node advertises a 4 KiB minimum block.
    qemu_io(
        &node.nbd_uri("disk"),
        &[
            "write -P 0xab 0 1M",
            "read -P 0xab 0 1M",
            "write -P 0xcd 1M 1M",
            "write -z 1M 1M",
            "read -P 0 1M 1M",
            "write -P 0xee 2M 64k",
            "discard 2M 64k",
            "read -P 0 2M 64k",
            "write -f -P 0x5c 3M 12k",
            "flush",
            "read -P 0x5c 3M 12k",
            "write -P 0x11 4198912 1k",
            "read -P 0x11 4198912 1k",
            "read -P 0 4194304 4608",
            "read -P 0 4199936 3072",
        ],
    );

    // NBD -> NVMe/TCP: the initiator reads what qemu-io wrote. NVMe/TCP -> NBD: nbdcopy reads
    // what the initiator wrote.
    let rt = runtime();
    let pattern_lba = (8 * MIB / BLOCK_BYTES) as u64;
    let address = node.nvme_address();
    rt.block_on(async {
        let controller =
            Controller::connect(address.as_str(), &volume_nqn("disk"), ConnectOptions::default())
                .await
                .expect("connect over NVMe/TCP");
        let mut queue = controller.open_io_queue(8).await.expect("open an I/O queue");
        let data = queue.read(0, AlignedBuf::new(MIB)).await.expect("read over NVMe/TCP");
        assert!(data.iter().all(|byte| *byte == 0xab), "NVMe/TCP reads what NBD wrote");
        let data = queue.read(768, AlignedBuf::new(3 * BLOCK_BYTES)).await.expect("read");
        assert!(data.iter().all(|byte| *byte == 0x5c), "NVMe/TCP reads the FUA write");
        queue.write(pattern_lba, pattern(pattern_lba, 64, 0xC0)).await.expect("write over NVMe");
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    let exported = dir.path().join("disk.img");
    nbdcopy(&node.nbd_uri("disk"), path_str(&exported));
    let disk = std::fs::read(&exported).expect("read the copy");
    assert_eq!(disk.len(), 64 * MIB);
    assert!(disk[..MIB].iter().all(|byte| *byte == 0xab));
    let pattern_at = 8 * MIB;
    if let Some(mismatch) =
        pattern_mismatch(&disk[pattern_at..pattern_at + 64 * BLOCK_BYTES], pattern_lba, 0xC0)
    {
        panic!("NBD reads what NVMe/TCP wrote: {mismatch}");
    }

    // nbdcopy in and out (several connections at once: multi-conn).
    let source = dir.path().join("source.img");
    let source_bytes = image(32 * MIB, 0x5eed);
    std::fs::write(&source, &source_bytes).expect("write the source image");
    nbdcopy(path_str(&source), &node.nbd_uri("copy"));
    let copied = dir.path().join("copied.img");
    nbdcopy(&node.nbd_uri("copy"), path_str(&copied));
    assert!(std::fs::read(&copied).expect("read the copy") == source_bytes, "copy round trip");

    // fio's nbd engine, random writes verified, away from the data above.
    let mut command = client("fio", "fio");
    command
        .args([
            "--name=ferrite-nbd",
            "--ioengine=nbd",
            &format!("--uri={}", node.nbd_uri("disk")),
            "--rw=randwrite",
            "--bs=4k",
            "--offset=32m",
            "--size=16m",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ])
        .current_dir(dir.path());
    let text = run_ok(command);
    assert!(!text.contains("verify: bad"), "{text}");

    // A resize shows on new connections.
    ferrite_ok(&api, &["volume", "resize", "copy", "48M"]);
    assert!(nbdinfo(&node.nbd_uri("copy")).contains("\"export-size\": 50331648"));

    // Everything is still there after a restart.
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "first run");
    let node = Node::start(&data_dir, nvme_port);
    let after = dir.path().join("after.img");
    nbdcopy(&node.nbd_uri("copy"), path_str(&after));
    let after = std::fs::read(&after).expect("read the copy");
    assert_eq!(after.len(), 48 * MIB);
    assert!(after[..32 * MIB] == source_bytes[..], "the copy survives the restart");
    assert!(after[32 * MIB..].iter().all(|byte| *byte == 0), "the grown part reads as zeros");
    qemu_io(&node.nbd_uri("disk"), &["read -P 0xab 0 1M", "read -P 0x5c 3M 12k"]);
    assert_eq!(listed_exports(&node), ["copy", "disk"]);
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "after the restart");
}

#[test]
fn a_taken_nbd_port_or_a_bad_address_stops_the_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port to hold");
    let port = taken.local_addr().expect("held port").port();
    let up = |nbd_listen: &str| {
        ferrite(
            "http://127.0.0.1:1",
            &[
                "up",
                "--data-dir",
                path_str(&dir.path().join("data")),
                "--drives",
                "1",
                "--drive-size",
                "1G",
                "--api-listen",
                "127.0.0.1:0",
                "--nvme-listen",
                &format!("127.0.0.1:{}", free_port()),
                "--nbd-listen",
                nbd_listen,
            ],
        )
    };
    let output = up(&format!("127.0.0.1:{port}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "started on a taken NBD port: {stderr}");
    assert!(
        stderr.contains(&format!("NBD port {port} in use"))
            && stderr.contains("pass --nbd-listen ADDR or off"),
        "{stderr}"
    );
    let output = up("nowhere");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("neither an address") && stderr.contains("`off`"), "{stderr}");
}

// ----- A minimal client on the nbd crate's codec, to watch one connection closely -----

/// One NBD connection in transmission, with simple replies.
struct RawClient {
    stream: TcpStream,
    next_cookie: u64,
}

/// How NBD_OPT_GO was answered when it was refused.
#[derive(Debug)]
struct Refused {
    reply_type: u32,
    message: String,
}

impl RawClient {
    /// Connects, does the fixed newstyle handshake and NBD_OPT_GO on `export`.
    fn connect(address: &str, export: &str) -> Result<RawClient, Refused> {
        let mut stream = TcpStream::connect(address).expect("connect to the NBD port");
        stream.set_read_timeout(Some(REPLY_TIMEOUT)).expect("read timeout");
        let mut greeting = [0u8; wire::GREETING_BYTES];
        stream.read_exact(&mut greeting).expect("greeting");
        wire::decode_greeting(&greeting).expect("NBD greeting");
        let flags = client_flag::C_FIXED_NEWSTYLE | client_flag::C_NO_ZEROES;
        let mut out = flags.to_be_bytes().to_vec();
        let mut data = (export.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        wire::OptionHeader { option: option::GO, length: data.len() as u32 }.encode(&mut out);
        out.extend_from_slice(&data);
        stream.write_all(&out).expect("send NBD_OPT_GO");
        loop {
            let mut header = [0u8; wire::OPTION_REPLY_HEADER_BYTES];
            stream.read_exact(&mut header).expect("option reply");
            let header = wire::OptionReplyHeader::decode(&header).expect("option reply magic");
            let mut payload = vec![0u8; header.length as usize];
            stream.read_exact(&mut payload).expect("option reply data");
            match header.reply_type {
                reply_type::ACK => return Ok(RawClient { stream, next_cookie: 1 }),
                reply_type::INFO => {}
                other => {
                    let message = String::from_utf8_lossy(&payload).into_owned();
                    return Err(Refused { reply_type: other, message });
                }
            }
        }
    }

    /// Sends one request and waits for its simple reply: the error code (0 for success) and,
    /// for a successful read, its data.
    fn request(
        &mut self,
        command: u16,
        offset: u64,
        length: u32,
        data: &[u8],
    ) -> std::io::Result<(u32, Vec<u8>)> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut out = Vec::new();
        wire::RequestHeader { flags: 0, command, cookie, offset, length }.encode(&mut out);
        out.extend_from_slice(data);
        self.stream.write_all(&out)?;
        let mut header = [0u8; wire::SIMPLE_REPLY_BYTES];
        self.stream.read_exact(&mut header)?;
        let reply = wire::SimpleReply::decode(&header).map_err(|error| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, error.to_string())
        })?;
        assert_eq!(reply.cookie, cookie, "replies come in order here: one request at a time");
        let mut read = Vec::new();
        if command == command::READ && reply.error == 0 {
            read = vec![0u8; length as usize];
            self.stream.read_exact(&mut read)?;
        }
        Ok((reply.error, read))
    }

    #[track_caller]
    fn write_ok(&mut self, offset: u64, data: &[u8]) {
        let (error, _) =
            self.request(command::WRITE, offset, data.len() as u32, data).expect("write");
        assert_eq!(error, 0, "write at {offset} failed with errno {error}");
    }

    #[track_caller]
    fn read_ok(&mut self, offset: u64, length: usize) -> Vec<u8> {
        let (error, data) = self.request(command::READ, offset, length as u32, &[]).expect("read");
        assert_eq!(error, 0, "read at {offset} failed with errno {error}");
        data
    }

    /// Keeps writing until the node closes the connection, which it must do within
    /// [`CLOSE_TIMEOUT`]; every write answered on the way must have failed with one of
    /// `errors`.
    #[track_caller]
    fn expect_close(mut self, errors: &[u32], context: &str) {
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        self.stream.set_read_timeout(Some(CLOSE_TIMEOUT)).expect("read timeout");
        let block = [0x99u8; BLOCK_BYTES];
        loop {
            assert!(Instant::now() < deadline, "{context}: the connection stayed open");
            match self.request(command::WRITE, 0, BLOCK_BYTES as u32, &block) {
                Ok((error, _)) => {
                    assert!(errors.contains(&error), "{context}: a write got errno {error}");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(error)
                    if error.kind() == std::io::ErrorKind::WouldBlock
                        || error.kind() == std::io::ErrorKind::TimedOut =>
                {
                    panic!("{context}: no reply and no close within {CLOSE_TIMEOUT:?}")
                }
                // Closed (EOF or reset): what we wait for.
                Err(_) => return,
            }
        }
    }
}

#[test]
fn deletion_rollback_and_access_changes_reach_nbd_connections() {
    let dir = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&dir.path().join("data"), free_port());
    let api = node.api_url.clone();
    for volume in ["gone", "rolled", "shut"] {
        ferrite_ok(&api, &["volume", "create", volume, "--size", "16M"]);
    }
    let address = node.nbd_address.clone();

    // Deleting a volume drains its NBD I/O, then its connections get errors and close.
    let mut gone = RawClient::connect(&address, "gone").expect("GO gone");
    gone.write_ok(0, &[0x42; BLOCK_BYTES]);
    assert!(gone.read_ok(0, BLOCK_BYTES).iter().all(|byte| *byte == 0x42));
    ferrite_ok(&api, &["volume", "delete", "gone"]);
    gone.expect_close(&[108], "a deleted volume's connection");
    assert_eq!(listed_exports(&node), ["rolled", "shut"]);
    let refused = RawClient::connect(&address, "gone").err().expect("GO on a deleted volume");
    assert_eq!(refused.reply_type, reply_type::ERR_UNKNOWN, "{refused:?}");

    // A rollback pauses NBD I/O and resumes it on the rolled-back data.
    let mut rolled = RawClient::connect(&address, "rolled").expect("GO rolled");
    rolled.write_ok(8192, &[0x11; BLOCK_BYTES]);
    ferrite_ok(&api, &["snapshot", "create", "rolled", "before"]);
    rolled.write_ok(8192, &[0x22; BLOCK_BYTES]);
    ferrite_ok(&api, &["volume", "rollback", "rolled", "--to", "before"]);
    assert!(rolled.read_ok(8192, BLOCK_BYTES).iter().all(|byte| *byte == 0x11));
    rolled.write_ok(8192, &[0x33; BLOCK_BYTES]);
    assert!(rolled.read_ok(8192, BLOCK_BYTES).iter().all(|byte| *byte == 0x33));

    // Restricting a volume to listed NVMe hosts closes its NBD connections and hides it; the
    // refusal says why.
    let mut shut = RawClient::connect(&address, "shut").expect("GO shut");
    shut.write_ok(0, &[0x55; BLOCK_BYTES]);
    ferrite_ok(&api, &["host", "allow", "shut", LISTED_HOST]);
    shut.expect_close(&[1], "a volume closed to NBD");
    assert_eq!(listed_exports(&node), ["rolled", "rolled@before"]);
    let refused = RawClient::connect(&address, "shut").err().expect("GO on a restricted volume");
    assert_eq!(refused.reply_type, reply_type::ERR_POLICY, "{refused:?}");
    assert!(refused.message.contains("restricted to NVMe hosts"), "{refused:?}");
    // Opened again, it is exported again, with its data.
    ferrite_ok(&api, &["host", "allow", "shut", "any"]);
    let mut shut = RawClient::connect(&address, "shut").expect("GO shut again");
    assert!(shut.read_ok(0, BLOCK_BYTES).iter().all(|byte| *byte == 0x55));
    drop(shut);
    drop(rolled);

    let output = ferrite(&api, &["volume", "show", "gone"]);
    assert!(!output.status.success(), "the deleted volume is gone");
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "NBD deletion and rollback");
}

#[test]
fn snapshots_are_read_only_exports_of_the_moment_they_were_taken() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let node = Node::start(&data_dir, free_port());
    let api = node.api_url.clone();
    ferrite_ok(&api, &["volume", "create", "db", "--size", "8M"]);
    let (taken, later) = (image(8 * MIB, 1), image(8 * MIB, 2));
    let file = dir.path().join("image");
    std::fs::write(&file, &taken).expect("write the image");
    nbdcopy(path_str(&file), &node.nbd_uri("db"));
    ferrite_ok(&api, &["snapshot", "create", "db", "nightly"]);
    std::fs::write(&file, &later).expect("write the image");
    nbdcopy(path_str(&file), &node.nbd_uri("db"));

    // The snapshot is an export of its own, read-only, holding what the volume held when it
    // was taken; the volume holds what was written after.
    assert_eq!(listed_exports(&node), ["db", "db@nightly"]);
    // The API names both exports, and the snapshot's NVMe subsystem.
    let shown = ferrite_ok(&api, &["volume", "show", "db"]);
    assert!(shown.contains(&format!("{:<13}{}\n", "nbd:", node.nbd_uri("db"))), "{shown}");
    let shown = ferrite_ok(&api, &["snapshot", "show", "db", "nightly"]);
    assert!(shown.contains(&format!("{:<11}{}\n", "nbd:", node.nbd_uri("db@nightly"))), "{shown}");
    assert!(shown.contains("nqn.2024-01.io.ferrite:snap:db:nightly (read-only"), "{shown}");
    let info = nbdinfo(&node.nbd_uri("db@nightly"));
    for expected in [
        "\"export-size\": 8388608",
        "\"is_read_only\": true",
        "\"can_trim\": false",
        "\"can_zero\": false",
        "Ferrite snapshot",
    ] {
        assert!(info.contains(expected), "missing {expected} in:\n{info}");
    }
    let copied = dir.path().join("copied");
    let same = |uri: &str, expected: &[u8], what: &str| {
        nbdcopy(uri, path_str(&copied));
        let read = std::fs::read(&copied).expect("read the copy");
        let differ = read.iter().zip(expected).position(|(a, b)| a != b);
        assert!(read.len() == expected.len() && differ.is_none(), "{what}: differs at {differ:?}");
    };
    same(&node.nbd_uri("db@nightly"), &taken, "the snapshot");
    same(&node.nbd_uri("db"), &later, "the volume");

    // Writes, trims and zeroings are refused with EPERM, and change nothing; reads go on.
    let address = node.nbd_address.clone();
    let mut raw = RawClient::connect(&address, "db@nightly").expect("GO db@nightly");
    let block = [0x77u8; BLOCK_BYTES];
    let refused =
        [(command::WRITE, &block[..]), (command::TRIM, &[][..]), (command::WRITE_ZEROES, &[][..])];
    for (command, data) in refused {
        let (error, _) = raw.request(command, 0, BLOCK_BYTES as u32, data).expect("request");
        assert_eq!(error, 1, "command {command} on a snapshot: errno {error}, not EPERM");
    }
    assert_eq!(raw.read_ok(0, 2 * BLOCK_BYTES), taken[..2 * BLOCK_BYTES]);

    // A volume closed to NBD closes its snapshots' connections too, and says why.
    ferrite_ok(&api, &["host", "allow", "db", LISTED_HOST]);
    raw.expect_close(&[1], "a snapshot of a volume closed to NBD");
    assert!(listed_exports(&node).is_empty());
    let refused = RawClient::connect(&address, "db@nightly").err().expect("GO on its snapshot");
    assert_eq!(refused.reply_type, reply_type::ERR_POLICY, "{refused:?}");
    assert!(refused.message.contains("snap:db:nightly"), "{refused:?}");
    let shown = ferrite_ok(&api, &["snapshot", "show", "db", "nightly", "--json"]);
    let json: serde_json::Value = serde_json::from_str(&shown).expect("snapshot show --json");
    assert!(json.get("nbd_uri").is_none(), "a restricted volume's snapshot has no NBD URI: {json}");
    let shown = ferrite_ok(&api, &["volume", "show", "db"]);
    assert!(shown.contains(&format!("{:<13}not exported: restricted", "nbd:")), "{shown}");
    ferrite_ok(&api, &["host", "allow", "db", "any"]);

    // Still exported after a restart.
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "NBD snapshots");
    let node = Node::start(&data_dir, free_port());
    let api = node.api_url.clone();
    assert_eq!(listed_exports(&node), ["db", "db@nightly"]);
    same(&node.nbd_uri("db@nightly"), &taken, "the snapshot after a restart");

    // Deleting the snapshot closes its connections and ends its export.
    let raw = RawClient::connect(&node.nbd_address, "db@nightly").expect("GO db@nightly");
    ferrite_ok(&api, &["snapshot", "delete", "db", "nightly"]);
    raw.expect_close(&[1, 108], "a deleted snapshot's connection");
    assert_eq!(listed_exports(&node), ["db"]);
    let refused = RawClient::connect(&node.nbd_address, "db@nightly").err().expect("GO");
    assert_eq!(refused.reply_type, reply_type::ERR_UNKNOWN, "{refused:?}");
    same(&node.nbd_uri("db"), &later, "the volume after its snapshot's deletion");
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "NBD snapshots after a restart");
}

// ----- A real file system on an NBD export -----

/// The files the file system test writes: (name, contents).
fn files() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = (0..24u32)
        .map(|index| (format!("small-{index:02}.bin"), image(1000 + index as usize * 4099, index)))
        .collect();
    files.push(("large.bin".to_owned(), image(12 * MIB + 123, 0xfeed)));
    files
}

#[test]
fn ext4_on_an_nbdfuse_loop_device_survives_a_restart() {
    require_root_and_fuse();
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let size_bytes: u64 = 256 << 20;
    let node = Node::start(&data_dir, nvme_port);
    ferrite_ok(&node.api_url, &["volume", "create", "fs", "--size", "256M"]);
    let fuse_dir = dir.path().join("fuse");
    let mount_dir = dir.path().join("mnt");

    {
        // Declared in this order so that drops run mount, loop, fuse on any failure.
        let fuse = FuseFile::start(&fuse_dir, "fs", &node.nbd_uri("fs"), size_bytes);
        let device = LoopDevice::attach(&fuse.file);
        let mut command = client("mkfs.ext4", "e2fsprogs");
        command.args(["-q", "-F", device.path()]);
        run_ok(command);
        let mount = Mount::at(device.path(), &mount_dir);
        std::fs::create_dir(mount_dir.join("dir")).expect("mkdir");
        for (name, contents) in files() {
            std::fs::write(mount_dir.join("dir").join(&name), &contents).expect("write a file");
        }
        run_ok(client("sync", "coreutils"));
        mount.unmount();
        device.detach();
        fuse.stop();
    }
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "writing the file system");

    let node = Node::start(&data_dir, nvme_port);
    {
        let fuse = FuseFile::start(&fuse_dir, "fs", &node.nbd_uri("fs"), size_bytes);
        let device = LoopDevice::attach(&fuse.file);
        let mut command = client("fsck.ext4", "e2fsprogs");
        command.args(["-n", "-f", device.path()]);
        run_ok(command);
        let mount = Mount::at(device.path(), &mount_dir);
        for (name, contents) in files() {
            let read = std::fs::read(mount_dir.join("dir").join(&name)).expect("read a file");
            assert!(read == contents, "{name} changed across the restart");
        }
        mount.unmount();
        device.detach();
        fuse.stop();
    }
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "reading the file system back");
}
