//! The failover tests' verifying workload (`common::failover`) and the multipath host's I/O
//! timeout, proved against what one node offers today: two NVMe/TCP ports of one volume, whose
//! ANA states the test flips with `ferrite volume set-path` while the workload runs, and a port
//! reached through a proxy that stops answering as a stopped or cut-off node does. No block may
//! be lost or wrong, and the measured pause must match what the test did. A third test proves
//! the checker fails when a block is changed behind the workload's back.

mod common;

use std::time::{Duration, Instant};

use common::failover::{Report, StallingProxy, Workload};
use common::{
    assert_no_error_lines, ferrite_ok, free_port, pattern, runtime, volume_nqn, Node, BLOCK_BYTES,
};
use initiator::{ConnectOptions, Controller, LbaRange};

const VOLUME: &str = "failover";
const VOLUME_SIZE: &str = "64M";
/// The workload's blocks: 16 MiB of the volume.
const BLOCKS: std::ops::Range<u64> = 0..4096;
const WORKERS: usize = 4;
/// The hosts' I/O timeout: short, so the stalled path is given up quickly.
const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// Writes acknowledged between two steps of a test, so that each step happens under load.
const WRITES_PER_STEP: u64 = 500;
/// The workload must reach the next step's writes within this.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the test leaves the volume without a usable path during the ANA flip. The pause
/// the hosts see may be a little shorter: a state set through the API takes effect on the node
/// around the moment the command returns, not exactly at it.
const NO_PATH_GAP: Duration = Duration::from_millis(800);
/// What a measured pause may exceed what the test caused by (notices tick every 200 ms on the
/// node, and the machine is shared).
const PAUSE_SLACK: Duration = Duration::from_secs(3);

/// A node serving NVMe/TCP on two ports, with the test volume.
fn two_port_node(dir: &std::path::Path) -> (Node, String) {
    let second = format!("127.0.0.1:{}", free_port());
    let node = Node::start_with_drives(
        dir,
        free_port(),
        &["--drives", "2", "--drive-size", "1G", "--nvme-listen", &second],
    );
    ferrite_ok(&node.api_url, &["volume", "create", VOLUME, "--size", VOLUME_SIZE]);
    (node, second)
}

fn set_path(node: &Node, port: &str, state: &str) {
    ferrite_ok(&node.api_url, &["volume", "set-path", VOLUME, "--port", port, "--state", state]);
}

/// Waits for `more` writes beyond those acknowledged now.
#[track_caller]
fn step(workload: &Workload, more: u64, what: &str) {
    let target = workload.report().writes_acked + more;
    assert!(
        workload.wait_for_writes(target, STEP_TIMEOUT),
        "{what}: the workload did not reach {target} writes in {STEP_TIMEOUT:?}: {:?}",
        workload.report()
    );
}

#[test]
fn an_ana_flip_under_load_loses_no_block_and_its_pause_is_measured() {
    let dir = tempfile::tempdir().unwrap();
    let (node, second) = two_port_node(dir.path());
    // Only port 1 is usable at first, as only the primary's path is.
    set_path(&node, "2", "inaccessible");
    let mut workload = Workload::start(
        vec![node.nvme_address(), second],
        volume_nqn(VOLUME),
        BLOCKS,
        WORKERS,
        IO_TIMEOUT,
    );
    step(&workload, WRITES_PER_STEP, "before the flip");

    // A failover as the cluster will do it: the old primary's path turns inaccessible, and a
    // moment later the new primary's turns optimized. Meanwhile no path is usable.
    let flip_at = workload.report().elapsed;
    set_path(&node, "1", "inaccessible");
    std::thread::sleep(NO_PATH_GAP);
    set_path(&node, "2", "optimized");
    let flipped_at = workload.report().elapsed;
    step(&workload, WRITES_PER_STEP, "after the flip");

    let report = workload.stop();
    assert_eq!(report.wrong_blocks, Vec::<String>::new(), "{report:?}");
    assert_eq!(report.errors_retried, 0, "the hosts rode through the failover: {report:?}");
    assert!(report.reads_checked > 0, "{report:?}");
    assert!(report.current_paths.iter().all(|path| *path == Some(1)), "{report:?}");
    assert!(
        report.longest_pause >= NO_PATH_GAP * 3 / 4
            && report.longest_pause < flipped_at - flip_at + PAUSE_SLACK,
        "the pause should span the time without a usable path ({:?}): {report:?}",
        flipped_at - flip_at
    );
    assert!(
        report.pause_started_at + Duration::from_millis(500) >= flip_at
            && report.pause_started_at <= flipped_at,
        "the pause began at the flip ({flip_at:?}): {report:?}"
    );
    let check = workload.check_all();
    assert_eq!(check.wrong_blocks, Vec::<String>::new());
    assert_eq!(check.blocks_checked, BLOCKS.end - BLOCKS.start);
    assert!(check.blocks_written > 100, "{check:?}");
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "the node under the ANA flip");
}

#[test]
fn a_path_that_stops_answering_is_given_up_after_the_io_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (node, second) = two_port_node(dir.path());
    // Port 1, reached through the proxy, is preferred; port 2 takes over when it is given up.
    set_path(&node, "2", "non-optimized");
    let proxy = StallingProxy::start(&node.nvme_address());
    let mut workload = Workload::start(
        vec![proxy.address(), second],
        volume_nqn(VOLUME),
        BLOCKS,
        WORKERS,
        IO_TIMEOUT,
    );
    step(&workload, WRITES_PER_STEP, "before the stall");

    let on_port = |port: usize| {
        move |report: &Report| report.current_paths.iter().all(|current| *current == Some(port))
    };
    assert!(workload.wait_until(STEP_TIMEOUT, on_port(0)), "{:?}", workload.report());

    let stalled_at = Instant::now();
    proxy.stall();
    step(&workload, WRITES_PER_STEP, "during the stall");
    let moved_after = stalled_at.elapsed();
    assert!(workload.wait_until(STEP_TIMEOUT, on_port(1)), "{:?}", workload.report());
    // The node comes back: the hosts reconnect in the background and return to port 1.
    proxy.resume();
    assert!(
        workload.wait_until(STEP_TIMEOUT, on_port(0)),
        "the hosts did not return to port 1: {:?}",
        workload.report()
    );
    step(&workload, WRITES_PER_STEP, "after the stall");

    let report = workload.stop();
    assert_eq!(report.wrong_blocks, Vec::<String>::new(), "{report:?}");
    assert_eq!(report.errors_retried, 0, "the hosts failed over by themselves: {report:?}");
    assert!(report.failovers >= 1, "commands timed out on the stalled path: {report:?}");
    assert!(moved_after >= IO_TIMEOUT * 3 / 4, "I/O moved after only {moved_after:?}");
    assert!(
        report.longest_pause >= IO_TIMEOUT * 3 / 4
            && report.longest_pause < IO_TIMEOUT + PAUSE_SLACK,
        "the pause should last about the I/O timeout ({IO_TIMEOUT:?}): {report:?}"
    );
    let check = workload.check_all();
    assert_eq!(check.wrong_blocks, Vec::<String>::new());
    drop(proxy);
    let stderr = node.stop_cleanly();
    // The node sees the proxied connections end abruptly; that is not an error on its side.
    assert_no_error_lines(&stderr, &[], "the node behind the stalled proxy");
}

#[test]
fn the_checker_finds_blocks_changed_behind_its_back() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let node = Node::start(dir.path(), port);
    ferrite_ok(&node.api_url, &["volume", "create", VOLUME, "--size", VOLUME_SIZE]);
    let nqn = volume_nqn(VOLUME);
    let mut workload =
        Workload::start(vec![node.nvme_address()], nqn.clone(), BLOCKS, WORKERS, IO_TIMEOUT);
    step(&workload, WRITES_PER_STEP, "writing");
    let report = workload.stop();
    assert_eq!(report.wrong_blocks, Vec::<String>::new(), "{report:?}");
    let clean = workload.check_all();
    assert_eq!(clean.wrong_blocks, Vec::<String>::new(), "before any change");

    // Three blocks the workload wrote and knows for sure: one gets another block's pattern,
    // one a torn copy of its own (right header, one byte off), one is deallocated.
    let acknowledged = workload.acknowledged_blocks();
    assert!(acknowledged.len() >= 3, "{acknowledged:?}");
    let [foreign, torn, zeroed] = [
        acknowledged[0],
        acknowledged[acknowledged.len() / 2],
        acknowledged[acknowledged.len() - 1],
    ];
    runtime().block_on(async {
        let controller = Controller::connect(node.nvme_address(), &nqn, ConnectOptions::default())
            .await
            .unwrap();
        let mut queue = controller.open_io_queue(4).await.unwrap();
        queue.write(foreign, pattern(foreign, 1, 0xBAD)).await.unwrap();
        let mut buffer = initiator::AlignedBuf::new(BLOCK_BYTES);
        buffer.set_len(BLOCK_BYTES);
        let mut block = queue.read(torn, buffer).await.unwrap();
        block[BLOCK_BYTES - 1] ^= 0x01;
        queue.write(torn, block).await.unwrap();
        queue.deallocate(&[LbaRange { lba: zeroed, blocks: 1 }]).await.unwrap();
    });

    let check = workload.check_all();
    assert_eq!(check.wrong_blocks.len(), 3, "{:?}", check.wrong_blocks);
    let listed = |lba: u64, needle: &str| {
        check
            .wrong_blocks
            .iter()
            .any(|line| line.starts_with(&format!("block {lba}:")) && line.contains(needle))
    };
    assert!(listed(foreign, "tag 0xbad"), "{:?}", check.wrong_blocks);
    assert!(listed(torn, "1 bytes differ"), "{:?}", check.wrong_blocks);
    assert!(listed(zeroed, "reads zeros"), "{:?}", check.wrong_blocks);
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "the node of the checker test");
}
