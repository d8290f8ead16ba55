//! Snapshots, clones and rollback end to end, on a real `ferrite up`: data written over NVMe/TCP
//! is held by a snapshot while the volume changes, a clone reads the snapshot and diverges from
//! it without touching the volume, a rollback brings the snapshot's data back, and all of it
//! survives a clean restart and a kill -9. Deleting the snapshot, then its volume, leaves the
//! clones intact. Bad requests get their documented error codes and messages that say what to
//! do.
//!
//! The restarts matter most: the node drops at start any engine data no metadata record names
//! and any snapshot record whose data the engine lacks, so a start that forgot snapshot ids would
//! destroy every snapshot and show an empty `snapshot list` here.

mod common;

use api::{Client, ClientError, ErrorCode};
use common::{
    assert_no_error_lines, ferrite, ferrite_ok, free_port, pattern, pattern_mismatch, runtime,
    volume_nqn, Node, BLOCK_BYTES,
};
use initiator::{AlignedBuf, ConnectOptions, Controller};

/// The blocks written with the first pattern.
const BLOCKS: usize = 64;
const TAG_A: u64 = 0xA;
const TAG_B: u64 = 0xB;
const TAG_CLONE: u64 = 0xC;
const TAG_D: u64 = 0xD;

/// Writes the pattern `tag` at `lba` of `volume` over a fresh connection.
fn write(
    rt: &tokio::runtime::Runtime,
    node: &Node,
    volume: &str,
    lba: u64,
    blocks: usize,
    tag: u64,
) {
    rt.block_on(async {
        let controller = Controller::connect(
            &node.nvme_address(),
            &volume_nqn(volume),
            ConnectOptions::default(),
        )
        .await
        .unwrap_or_else(|error| panic!("connect to {volume}: {error}"));
        let mut queue = controller.open_io_queue(8).await.expect("open an I/O queue");
        queue
            .write(lba, pattern(lba, blocks, tag))
            .await
            .unwrap_or_else(|error| panic!("write {volume} at LBA {lba}: {error}"));
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
}

/// The subsystem NQN of a volume, or of a snapshot written `VOLUME@SNAPSHOT` (read-only).
fn nqn_of(name: &str) -> initiator::Nqn {
    match name.split_once('@') {
        Some((volume, snapshot)) => {
            initiator::Nqn::new(&format!("{}{volume}:{snapshot}", types::SNAPSHOT_NQN_PREFIX))
                .expect("snapshot NQN")
        }
        None => volume_nqn(name),
    }
}

/// Snapshot `name` (`VOLUME@SNAPSHOT`) is served read-only over its own subsystem: a write
/// fails with Namespace Is Write Protected (Identify Namespace is checked by the nvmf tests).
fn expect_read_only(rt: &tokio::runtime::Runtime, node: &Node, name: &str) {
    rt.block_on(async {
        let controller =
            Controller::connect(&node.nvme_address(), &nqn_of(name), ConnectOptions::default())
                .await
                .unwrap_or_else(|error| panic!("connect to {name}: {error}"));
        let mut queue = controller.open_io_queue(8).await.expect("open an I/O queue");
        let refused = queue.write(0, pattern(0, 1, 0xEE)).await;
        let error = refused.expect_err("a write to a snapshot must fail");
        assert!(error.to_string().contains("Namespace is Write Protected"), "{name}: {error}");
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
}

/// Checks that `volume` holds, from `lba`, each `(blocks, tag)` run in turn.
#[track_caller]
fn expect(
    rt: &tokio::runtime::Runtime,
    node: &Node,
    volume: &str,
    lba: u64,
    runs: &[(usize, u64)],
    context: &str,
) {
    let total: usize = runs.iter().map(|(blocks, _)| blocks).sum();
    let data = rt.block_on(async {
        let controller =
            Controller::connect(&node.nvme_address(), &nqn_of(volume), ConnectOptions::default())
                .await
                .unwrap_or_else(|error| panic!("{context}: connect to {volume}: {error}"));
        let mut queue = controller.open_io_queue(8).await.expect("open an I/O queue");
        let data = queue
            .read(lba, AlignedBuf::new(total * BLOCK_BYTES))
            .await
            .unwrap_or_else(|error| panic!("{context}: read {volume}: {error}"));
        drop(queue);
        controller.shutdown().await.expect("shut down");
        data
    });
    let mut at = 0;
    for &(blocks, tag) in runs {
        let first = lba + at as u64;
        let bytes = &data[at * BLOCK_BYTES..(at + blocks) * BLOCK_BYTES];
        if let Some(mismatch) = pattern_mismatch(bytes, first, tag) {
            panic!("{context}: volume {volume}: {mismatch}");
        }
        at += blocks;
    }
}

fn json(api: &str, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ferrite_ok(api, args)).expect("JSON output")
}

fn snapshot_names(api: &str, volume: &str) -> Vec<String> {
    let list = json(api, &["snapshot", "list", volume, "--json"]);
    let snapshots = list["snapshots"].as_array().expect("a snapshots array");
    snapshots.iter().map(|snapshot| snapshot["name"].as_str().unwrap_or("").to_owned()).collect()
}

#[track_caller]
fn assert_code<T: std::fmt::Debug>(result: Result<T, ClientError>, code: ErrorCode, text: &str) {
    let error = result.expect_err("the request must fail");
    assert_eq!(error.code(), Some(code), "{error}");
    assert!(error.to_string().contains(text), "{error:?} does not say {text:?}");
}

/// Everything the volumes must hold after `snapshot s2` (see the test): checked before and
/// after each restart.
fn check_contents(rt: &tokio::runtime::Runtime, node: &Node, context: &str) {
    let api = &node.api_url;
    assert_eq!(snapshot_names(api, "vol"), ["s1", "s2"], "{context}: the snapshots of vol");
    // The snapshot itself, read over its own read-only subsystem.
    expect(rt, node, "vol@s1", 0, &[(BLOCKS, TAG_A)], context);
    expect_read_only(rt, node, "vol@s1");
    // vol was rolled back to s1 (A), then took D on its first 8 blocks.
    expect(rt, node, "vol", 0, &[(8, TAG_D), (BLOCKS - 8, TAG_A)], context);
    // c1: A with its own write in the middle.
    expect(rt, node, "c1", 0, &[(32, TAG_A), (16, TAG_CLONE), (16, TAG_A)], context);
    let c1 = json(api, &["volume", "show", "c1", "--json"]);
    assert_eq!(c1["origin"], "vol@s1", "{context}: {c1}");
    let vol = json(api, &["volume", "show", "vol", "--json"]);
    assert_eq!(vol["snapshot_count"], 2, "{context}: {vol}");
}

#[test]
fn snapshots_clones_and_rollback_survive_restarts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let rt = runtime();
    let node = Node::start(&data_dir, nvme_port);
    let api = node.api_url.clone();

    ferrite_ok(&api, &["volume", "create", "vol", "--size", "64M"]);
    write(&rt, &node, "vol", 0, BLOCKS, TAG_A);
    let taken = ferrite_ok(&api, &["snapshot", "create", "vol", "s1"]);
    assert!(taken.contains("took snapshot vol@s1 (64MiB)"), "{taken}");
    write(&rt, &node, "vol", 0, 16, TAG_B);
    expect(&rt, &node, "vol", 0, &[(16, TAG_B), (BLOCKS - 16, TAG_A)], "after writing B");
    expect(&rt, &node, "vol@s1", 0, &[(BLOCKS, TAG_A)], "s1 after writing B to vol");
    expect_read_only(&rt, &node, "vol@s1");

    // A clone reads the snapshot, not the volume, and its writes stay its own.
    let created = ferrite_ok(&api, &["volume", "create", "c1", "--from-snapshot", "vol@s1"]);
    assert!(created.contains("created volume c1 (64MiB)"), "{created}");
    expect(&rt, &node, "c1", 0, &[(BLOCKS, TAG_A)], "the fresh clone");
    write(&rt, &node, "c1", 32, 16, TAG_CLONE);
    expect(&rt, &node, "c1", 0, &[(32, TAG_A), (16, TAG_CLONE), (16, TAG_A)], "the written clone");
    expect(
        &rt,
        &node,
        "vol",
        0,
        &[(16, TAG_B), (BLOCKS - 16, TAG_A)],
        "vol after the clone's write",
    );

    // Rollback drops B.
    let rolled = ferrite_ok(&api, &["volume", "rollback", "vol", "--to", "s1"]);
    assert!(rolled.contains("rolled volume vol back to snapshot s1"), "{rolled}");
    expect(&rt, &node, "vol", 0, &[(BLOCKS, TAG_A)], "vol after the rollback");

    // The human output: table and key-value blocks.
    let list = ferrite_ok(&api, &["snapshot", "list", "vol"]);
    assert!(list.starts_with("NAME"), "{list}");
    assert!(list.lines().nth(1).is_some_and(|line| line.starts_with("s1 ")), "{list}");
    let shown = ferrite_ok(&api, &["volume", "show", "c1"]);
    assert!(shown.contains("origin:") && shown.contains("vol@s1"), "{shown}");
    let shown = ferrite_ok(&api, &["snapshot", "show", "vol", "s1"]);
    assert!(shown.contains("volume:    vol"), "{shown}");

    // A second snapshot of new data, then a clean restart.
    write(&rt, &node, "vol", 0, 8, TAG_D);
    ferrite_ok(&api, &["snapshot", "create", "vol", "s2"]);
    check_contents(&rt, &node, "before the restarts");
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "first run");

    let node = Node::start(&data_dir, nvme_port);
    check_contents(&rt, &node, "after a clean restart");
    // The engine still holds the snapshots: a clone of s2 reads D then A.
    ferrite_ok(&node.api_url, &["volume", "create", "c2", "--from-snapshot", "vol@s2"]);
    expect(&rt, &node, "c2", 0, &[(8, TAG_D), (BLOCKS - 8, TAG_A)], "c2 after the restart");

    // kill -9: no final checkpoint; the log alone must bring everything back.
    let exit = node.signal_and_wait(libc::SIGKILL);
    assert!(!exit.status.success());
    let node = Node::start(&data_dir, nvme_port);
    let api = node.api_url.clone();
    check_contents(&rt, &node, "after kill -9");
    expect(&rt, &node, "c2", 0, &[(8, TAG_D), (BLOCKS - 8, TAG_A)], "c2 after kill -9");
    let rolled = ferrite_ok(&api, &["volume", "rollback", "vol", "--to", "s1"]);
    assert!(rolled.contains("rolled volume vol back"), "{rolled}");
    expect(&rt, &node, "vol", 0, &[(BLOCKS, TAG_A)], "vol rolled back after kill -9");

    // Bad requests.
    let client = Client::new(&api).expect("API client");
    assert_code(client.create_snapshot("vol", "s1"), ErrorCode::SnapshotExists, "already has");
    assert_code(client.snapshot("vol", "nope"), ErrorCode::SnapshotNotFound, "no snapshot named");
    assert_code(client.delete_snapshot("vol", "nope"), ErrorCode::SnapshotNotFound, "nope");
    assert_code(client.rollback_volume("vol", "nope"), ErrorCode::SnapshotNotFound, "nope");
    assert_code(client.list_snapshots("ghost"), ErrorCode::VolumeNotFound, "ghost");
    assert_code(
        client.create_snapshot("vol", "Bad Name"),
        ErrorCode::InvalidName,
        "invalid volume name",
    );
    ferrite_ok(&api, &["volume", "create", "other", "--size", "16M"]);
    ferrite_ok(&api, &["snapshot", "create", "other", "o1"]);
    assert_code(client.rollback_volume("vol", "o1"), ErrorCode::SnapshotNotFound, "vol");
    let foreign = ferrite(&api, &["volume", "rollback", "vol", "--to", "other@o1"]);
    let message = String::from_utf8_lossy(&foreign.stderr);
    assert!(!foreign.status.success());
    assert!(message.contains("belongs to volume other, not to vol"), "{message}");
    let small =
        ferrite(&api, &["volume", "create", "small", "--from-snapshot", "vol@s1", "--size", "32M"]);
    let message = String::from_utf8_lossy(&small.stderr);
    assert!(!small.status.success());
    assert!(message.contains("a clone is at least as large as its snapshot"), "{message}");
    let bad_ref = ferrite(&api, &["volume", "create", "x", "--from-snapshot", "vol"]);
    assert!(String::from_utf8_lossy(&bad_ref.stderr).contains("is not VOLUME@SNAP"));
    assert_code(
        client.create_volume(&api::CreateVolume::clone_of_snapshot("x", "vol", "gone")),
        ErrorCode::SnapshotNotFound,
        "no snapshot named gone",
    );
    // A larger clone reads zeros past the snapshot's size.
    ferrite_ok(&api, &["volume", "create", "big", "--from-snapshot", "vol@s1", "--size", "128M"]);
    let big = json(&api, &["volume", "show", "big", "--json"]);
    assert_eq!(big["size_bytes"], 128u64 << 20);
    expect(&rt, &node, "big", 0, &[(BLOCKS, TAG_A)], "the larger clone");

    // Deleting the snapshot, then the volume, leaves the clones intact.
    let deleted = ferrite_ok(&api, &["snapshot", "delete", "vol", "s1"]);
    assert!(deleted.contains("deleted snapshot vol@s1"), "{deleted}");
    assert_eq!(snapshot_names(&api, "vol"), ["s2"]);
    expect(&rt, &node, "c1", 0, &[(32, TAG_A), (16, TAG_CLONE), (16, TAG_A)], "c1 without s1");
    ferrite_ok(&api, &["volume", "delete", "vol"]);
    assert_code(client.list_snapshots("vol"), ErrorCode::VolumeNotFound, "vol");
    expect(&rt, &node, "c1", 0, &[(32, TAG_A), (16, TAG_CLONE), (16, TAG_A)], "c1 without vol");
    expect(&rt, &node, "c2", 0, &[(8, TAG_D), (BLOCKS - 8, TAG_A)], "c2 without vol");
    let c1 = json(&api, &["volume", "show", "c1", "--json"]);
    assert_eq!(c1["origin"], "vol@s1", "the origin is kept: {c1}");

    // And once more across a restart, now that the parents are gone.
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "after kill -9");
    let node = Node::start(&data_dir, nvme_port);
    expect(&rt, &node, "c1", 0, &[(32, TAG_A), (16, TAG_CLONE), (16, TAG_A)], "c1, last start");
    expect(&rt, &node, "c2", 0, &[(8, TAG_D), (BLOCKS - 8, TAG_A)], "c2, last start");
    assert_eq!(snapshot_names(&node.api_url, "other"), ["o1"]);
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "last run");
}
