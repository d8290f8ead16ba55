//! The background scrub end to end, on a real `ferrite up` with a high `--scrub-mb-per-s`:
//!
//! - With intact data (raw and compressed blocks, all in sealed segments after a restart) a
//!   pass completes, verifies every written block and finds nothing; `ferrite node show`, the
//!   REST JSON and the metrics say so.
//! - Then, with the node stopped, the test finds one written block in the drive files (it holds
//!   a distinctive pattern, written raw, so a plain search finds it) and flips bytes in it. After
//!   the next start the scrub reports exactly that damage, naming the volume, the block and the
//!   drive, and a host's read of that block fails with an error instead of returning the
//!   damaged data; the block's neighbours read fine.
//! - On a node with erasure coding 2+1 the same damage is rebuilt from its stripe and written
//!   back in place: the finding says repaired, and the block reads intact.

mod common;

use common::{
    assert_no_error_lines, damage, ferrite_ok, find_block, free_port, metric, pattern,
    pattern_mismatch, runtime, volume_nqn, Node, BLOCK_BYTES,
};
use initiator::{AlignedBuf, ConnectOptions, Controller};
use std::path::Path;
use std::time::{Duration, Instant};

/// Two sparse 1 GiB drive files without parity (so each block is stored once, and a damaged
/// one cannot be repaired from the other drive) and a scrub fast enough to finish a pass within
/// a tick.
const NODE_ARGS: [&str; 8] =
    ["--drives", "2", "--drive-size", "1G", "--scrub-mb-per-s", "1024", "--erasure-coding", "none"];
/// Blocks written to each volume.
const BLOCKS: usize = 64;
const VICTIM_TAG: u64 = 0x5C2B_B1D0;
/// The block of the victim volume the test damages.
const DAMAGED_LBA: u64 = 10;
/// How long a scrub pass may take to show up in `node show`.
const SCRUB_TIMEOUT: Duration = Duration::from_secs(30);

fn start(data_dir: &Path, nvme_port: u16) -> Node {
    Node::start_with_drives(data_dir, nvme_port, &NODE_ARGS)
}

fn node_json(api: &str) -> serde_json::Value {
    serde_json::from_str(&ferrite_ok(api, &["node", "show", "--json"])).expect("node show JSON")
}

/// Waits until the node reports a completed scrub pass; returns its `scrub` section.
fn wait_for_pass(api: &str) -> serde_json::Value {
    let deadline = Instant::now() + SCRUB_TIMEOUT;
    loop {
        let scrub = node_json(api)["scrub"].clone();
        if scrub["passes_completed"].as_u64().unwrap_or(0) >= 1 {
            return scrub;
        }
        assert!(Instant::now() < deadline, "no scrub pass within {SCRUB_TIMEOUT:?}: {scrub}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

async fn connect(node: &Node, volume: &str) -> (Controller, initiator::IoQueue) {
    let controller =
        Controller::connect(&node.nvme_address(), &volume_nqn(volume), ConnectOptions::default())
            .await
            .unwrap_or_else(|error| panic!("connect to {volume}: {error}"));
    let queue = controller.open_io_queue(8).await.expect("open an I/O queue");
    (controller, queue)
}

/// Text that compresses well, so the second volume's blocks are stored packed.
fn text(blocks: usize) -> AlignedBuf {
    let mut buffer = AlignedBuf::new(blocks * BLOCK_BYTES);
    let line = b"scrub test: compressible text for a packed block, over and over.\n";
    for (index, byte) in buffer.iter_mut().enumerate() {
        *byte = line[index % line.len()];
    }
    buffer
}

/// The drive index of `DATA-DIR/drives/drive-NNN.img`.
fn drive_index(path: &Path) -> u64 {
    let name = path.file_name().and_then(|name| name.to_str()).expect("a drive file name");
    let digits = name.trim_start_matches("drive-").trim_end_matches(".img");
    digits.parse().unwrap_or_else(|_| panic!("unexpected drive file name {name}"))
}

#[test]
fn scrub_verifies_intact_data_and_reports_a_damaged_block() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let rt = runtime();

    let node = start(&data_dir, nvme_port);
    let api = node.api_url.clone();
    ferrite_ok(&api, &["volume", "create", "victim", "--size", "64M", "--compression", "off"]);
    ferrite_ok(&api, &["volume", "create", "packed", "--size", "64M"]);
    rt.block_on(async {
        let (controller, mut queue) = connect(&node, "victim").await;
        queue.write(0, pattern(0, BLOCKS, VICTIM_TAG)).await.expect("write the victim");
        drop(queue);
        controller.shutdown().await.expect("shut down");
        let (controller, mut queue) = connect(&node, "packed").await;
        queue.write(0, text(BLOCKS)).await.expect("write the packed volume");
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    let packed: serde_json::Value =
        serde_json::from_str(&ferrite_ok(&api, &["volume", "show", "packed", "--json"]))
            .expect("volume show JSON");
    assert!(packed["data_reduction"].as_f64().unwrap_or(0.0) > 1.5, "{packed}");
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "writing");

    // Restarted, every written segment is sealed: a pass verifies every block and finds nothing.
    let node = start(&data_dir, nvme_port);
    let api = node.api_url.clone();
    let scrub = wait_for_pass(&api);
    assert_eq!(scrub["errors"], 0, "{scrub}");
    assert_eq!(scrub["findings"], serde_json::json!([]), "{scrub}");
    assert_eq!(scrub["rate_mb_per_s"], 1024, "{scrub}");
    assert_eq!(scrub["blocks_verified"].as_u64(), Some(2 * BLOCKS as u64), "{scrub}");
    let shown = ferrite_ok(&api, &["node", "show"]);
    assert!(shown.contains("scrub passes:") && shown.contains("scrub errors:    0"), "{shown}");
    let metrics = api::Client::new(&api).expect("client").metrics().expect("metrics");
    assert!(metric(&metrics, "ferrite_scrub_passes_total") >= 1);
    assert_eq!(metric(&metrics, "ferrite_scrub_errors_total"), 0);
    assert_eq!(metric(&metrics, "ferrite_scrub_blocks_verified_total"), 2 * BLOCKS as u64);
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "intact scrub");

    // Damage the victim's block on its drive, behind the node's back.
    let mut expected = AlignedBuf::new(BLOCK_BYTES);
    expected.copy_from_slice(&pattern(DAMAGED_LBA, 1, VICTIM_TAG));
    let places = find_block(&data_dir.join("drives"), &expected);
    assert_eq!(places.len(), 1, "the block is stored once, raw: {places:?}");
    let (path, offset) = places[0].clone();
    damage(&path, offset);

    let node = start(&data_dir, nvme_port);
    let api = node.api_url.clone();
    let scrub = wait_for_pass(&api);
    assert_eq!(scrub["errors"], 1, "{scrub}");
    let findings = scrub["findings"].as_array().expect("findings");
    assert_eq!(findings.len(), 1, "{scrub}");
    let finding = &findings[0];
    assert_eq!(finding["kind"], "block", "{finding}");
    assert_eq!(finding["volume"], "victim", "{finding}");
    assert_eq!(finding["block"].as_u64(), Some(DAMAGED_LBA), "{finding}");
    assert_eq!(finding["drive"].as_u64(), Some(drive_index(&path)), "{finding}");
    assert_eq!(finding["repaired"], false, "{finding}");
    assert_eq!(scrub["blocks_verified"].as_u64(), Some(2 * BLOCKS as u64 - 1), "{scrub}");
    let shown = ferrite_ok(&api, &["node", "show"]);
    assert!(shown.contains("scrub errors:    1"), "{shown}");
    assert!(shown.contains("block 10 of volume victim is damaged"), "{shown}");
    let metrics = api::Client::new(&api).expect("client").metrics().expect("metrics");
    assert_eq!(metric(&metrics, "ferrite_scrub_errors_total"), 1);

    // A host's read of the damaged block fails; its neighbours read intact.
    rt.block_on(async {
        let (controller, mut queue) = connect(&node, "victim").await;
        let result = queue.read(DAMAGED_LBA, AlignedBuf::new(BLOCK_BYTES)).await;
        assert!(result.is_err(), "the damaged block was returned as data");
        let before = queue.read(0, AlignedBuf::new(DAMAGED_LBA as usize * BLOCK_BYTES)).await;
        let before = before.expect("read the blocks before the damaged one");
        assert_eq!(pattern_mismatch(&before, 0, VICTIM_TAG), None);
        let after_lba = DAMAGED_LBA + 1;
        let after_blocks = BLOCKS - after_lba as usize;
        let after = queue.read(after_lba, AlignedBuf::new(after_blocks * BLOCK_BYTES)).await;
        let after = after.expect("read the blocks after the damaged one");
        assert_eq!(pattern_mismatch(&after, after_lba, VICTIM_TAG), None);
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &["scrub found damaged data"], "damaged scrub");
}

/// On a node with erasure coding 2+1, the same damage is repaired: the scrub rebuilds the block
/// from its stripe, writes it back in place (the drive file holds the original bytes again) and
/// reports the finding as repaired, and hosts read the block intact.
#[test]
fn on_a_coded_node_scrub_repairs_a_damaged_block_in_place() {
    const CODED_ARGS: [&str; 8] = [
        "--drives",
        "3",
        "--drive-size",
        "1G",
        "--scrub-mb-per-s",
        "1024",
        "--erasure-coding",
        "2+1",
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let rt = runtime();
    let node = Node::start_with_drives(&data_dir, nvme_port, &CODED_ARGS);
    let api = node.api_url.clone();
    ferrite_ok(&api, &["volume", "create", "victim", "--size", "64M", "--compression", "off"]);
    rt.block_on(async {
        let (controller, mut queue) = connect(&node, "victim").await;
        queue.write(0, pattern(0, BLOCKS, VICTIM_TAG)).await.expect("write the victim");
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "writing");

    let mut expected = AlignedBuf::new(BLOCK_BYTES);
    expected.copy_from_slice(&pattern(DAMAGED_LBA, 1, VICTIM_TAG));
    let places = find_block(&data_dir.join("drives"), &expected);
    assert_eq!(places.len(), 1, "the block is stored once, raw: {places:?}");
    let (path, offset) = places[0].clone();
    damage(&path, offset);
    assert!(find_block(&data_dir.join("drives"), &expected).is_empty(), "the damage took");

    let node = Node::start_with_drives(&data_dir, nvme_port, &CODED_ARGS);
    let api = node.api_url.clone();
    let scrub = wait_for_pass(&api);
    let findings = scrub["findings"].as_array().expect("findings");
    assert_eq!(findings.len(), 1, "{scrub}");
    let finding = &findings[0];
    assert_eq!(finding["kind"], "block", "{finding}");
    assert_eq!(finding["volume"], "victim", "{finding}");
    assert_eq!(finding["block"].as_u64(), Some(DAMAGED_LBA), "{finding}");
    assert_eq!(finding["drive"].as_u64(), Some(drive_index(&path)), "{finding}");
    assert_eq!(finding["repaired"], true, "{finding}");
    rt.block_on(async {
        let (controller, mut queue) = connect(&node, "victim").await;
        let all = queue.read(0, AlignedBuf::new(BLOCKS * BLOCK_BYTES)).await.expect("read all");
        assert_eq!(pattern_mismatch(&all, 0, VICTIM_TAG), None);
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &["scrub found damaged data"], "repairing scrub");
    assert_eq!(
        find_block(&data_dir.join("drives"), &expected),
        vec![(path, offset)],
        "the block was rewritten in place"
    );
}

/// The scrub yields to hosts: on a node holding 64 MiB and scrubbing at 16 MiB/s (a pass of
/// about four seconds), a host reading without pause slows it to 1 MiB/s, which `node show`
/// says, and the scrub verifies no more than that while slowed; a second after the host stops
/// it reads at its full rate again.
#[test]
fn host_io_slows_the_scrub_down() {
    const DATA_BLOCKS: usize = 16 * 1024;
    const WRITE_BLOCKS: usize = 256;
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let args = ["--drives", "2", "--drive-size", "1G", "--scrub-mb-per-s", "16"];
    let rt = runtime();
    let node = Node::start_with_drives(&data_dir, nvme_port, &args);
    let api = node.api_url.clone();
    ferrite_ok(&api, &["volume", "create", "busy", "--size", "128M", "--compression", "off"]);
    rt.block_on(async {
        let (controller, mut queue) = connect(&node, "busy").await;
        for first in (0..DATA_BLOCKS).step_by(WRITE_BLOCKS) {
            let data = pattern(first as u64, WRITE_BLOCKS, VICTIM_TAG);
            queue.write(first as u64, data).await.expect("write");
        }
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    node.stop_cleanly();

    // Restarted (every segment sealed), a host reads over and over while the scrub runs.
    let node = Node::start_with_drives(&data_dir, nvme_port, &args);
    let api = node.api_url.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let stop = std::sync::Arc::clone(&stop);
        let address = node.nvme_address();
        std::thread::spawn(move || {
            runtime().block_on(async move {
                let controller =
                    Controller::connect(&address, &volume_nqn("busy"), ConnectOptions::default())
                        .await
                        .expect("connect");
                let mut queue = controller.open_io_queue(8).await.expect("open an I/O queue");
                let mut reads = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let first = (reads * 64) % DATA_BLOCKS as u64;
                    queue.read(first, AlignedBuf::new(64 * BLOCK_BYTES)).await.expect("read");
                    reads += 1;
                }
                drop(queue);
                controller.shutdown().await.expect("shut down");
                reads
            })
        })
    };
    let deadline = Instant::now() + SCRUB_TIMEOUT;
    let slowed = loop {
        let scrub = node_json(&api)["scrub"].clone();
        if scrub["slowed_for_hosts"] == true {
            break scrub;
        }
        assert!(Instant::now() < deadline, "the scrub never slowed for the reading host: {scrub}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(slowed["state"], "running", "{slowed}");
    assert_eq!(slowed["busy_rate_mb_per_s"], 1, "{slowed}");
    let shown = ferrite_ok(&api, &["node", "show"]);
    assert!(shown.contains("slowed to 1 MiB/s while hosts are busy"), "{shown}");
    let metrics = api::Client::new(&api).expect("client").metrics().expect("metrics");
    assert_eq!(metric(&metrics, "ferrite_scrub_slowed_for_hosts"), 1);
    // While slowed, it verifies about 1 MiB (256 blocks) a second, not 16 MiB.
    let before = node_json(&api)["scrub"]["blocks_verified"].as_u64().expect("verified");
    std::thread::sleep(Duration::from_secs(2));
    let scrub = node_json(&api)["scrub"].clone();
    let during = scrub["blocks_verified"].as_u64().expect("verified") - before;
    assert_eq!(scrub["slowed_for_hosts"], true, "{scrub}");
    assert!(during <= 3 * 256, "{during} blocks verified in 2 s while slowed: {scrub}");

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reads = reader.join().expect("the reader");
    assert!(reads > 0);
    // Hosts quiet: the full rate again, and the pass ends.
    let scrub = wait_for_pass(&api);
    assert_eq!(scrub["slowed_for_hosts"], false, "{scrub}");
    assert_eq!(scrub["errors"], 0, "{scrub}");
    let metrics = api::Client::new(&api).expect("client").metrics().expect("metrics");
    assert_eq!(metric(&metrics, "ferrite_scrub_slowed_for_hosts"), 0);
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "slowed scrub");
}
