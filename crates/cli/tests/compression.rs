//! Per-volume compression end to end, on a real `ferrite up`: volumes created with lz4 (the
//! default), zstd and off are written over NVMe/TCP with text that compresses well and with
//! random data that does not; every byte reads back as written; `volume show`, the REST JSON,
//! `node show` and the metrics report the data reduction each achieved; a setting changed with
//! `volume set-compression` applies to new writes only; and after a restart the data and every
//! volume's setting are still there (new writes after the restart are stored as before it).
//!
//! Why it fails when compression is not applied: the text volumes' reduction must exceed
//! [`REDUCTION_MIN`], which only packed (compressed) blocks give; raw blocks give exactly 1.0.
//! The blocks written after the restart are measured on their own (the growth of the volume's
//! drive space), so a restart that forgot a volume's setting would store them raw and fail.

mod common;

use common::{
    assert_no_error_lines, ferrite, ferrite_ok, free_port, pattern, pattern_mismatch, runtime,
    volume_nqn, Node, BLOCK_BYTES,
};
use initiator::{AlignedBuf, ConnectOptions, Controller};

/// Blocks written per volume in each round: 1 MiB.
const BLOCKS: usize = 256;
/// Blocks per write command.
const WRITE_BLOCKS: usize = 64;
/// The reduction compressible text must at least reach (it reaches far more: the text below
/// packs 8 to 16 blocks per 4 KiB slot).
const REDUCTION_MIN: f64 = 1.5;
const RANDOM_TAG: u64 = 0x5EED;

/// Text that compresses well but differs in every block and line, so a misplaced block or a
/// decompression that returns another block's bytes is caught.
fn text(volume: &str, first_lba: u64, blocks: usize) -> AlignedBuf {
    let mut buffer = AlignedBuf::new(blocks * BLOCK_BYTES);
    for (index, block) in buffer.chunks_exact_mut(BLOCK_BYTES).enumerate() {
        let lba = first_lba + index as u64;
        let mut line = 0;
        let mut at = 0;
        while at < BLOCK_BYTES {
            let text = format!(
                "{volume} block {lba:08} line {line:03}: the quick brown fox jumps over the lazy \
                 dog; status=ok retries=0\n"
            );
            let take = text.len().min(BLOCK_BYTES - at);
            block[at..at + take].copy_from_slice(&text.as_bytes()[..take]);
            at += take;
            line += 1;
        }
    }
    buffer
}

/// Writes `data` at `lba` of `volume`, then reads it back and requires the same bytes.
fn write_and_check(rt: &tokio::runtime::Runtime, node: &Node, volume: &str, lba: u64, data: &[u8]) {
    rt.block_on(async {
        let (controller, mut queue) = connect(node, volume).await;
        for (index, chunk) in data.chunks(WRITE_BLOCKS * BLOCK_BYTES).enumerate() {
            let mut buffer = AlignedBuf::new(chunk.len());
            buffer.copy_from_slice(chunk);
            let at = lba + (index * WRITE_BLOCKS) as u64;
            queue
                .write(at, buffer)
                .await
                .unwrap_or_else(|error| panic!("write {volume} at LBA {at}: {error}"));
        }
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    check(rt, node, volume, lba, data, "right after the write");
}

/// Reads `expected.len()` bytes of `volume` at `lba` and requires exactly `expected`.
#[track_caller]
fn check(
    rt: &tokio::runtime::Runtime,
    node: &Node,
    volume: &str,
    lba: u64,
    expected: &[u8],
    context: &str,
) {
    let data = rt.block_on(async {
        let (controller, mut queue) = connect(node, volume).await;
        let data = queue
            .read(lba, AlignedBuf::new(expected.len()))
            .await
            .unwrap_or_else(|error| panic!("{context}: read {volume}: {error}"));
        drop(queue);
        controller.shutdown().await.expect("shut down");
        data
    });
    if let Some(index) = (0..expected.len() / BLOCK_BYTES).find(|index| {
        let range = index * BLOCK_BYTES..(index + 1) * BLOCK_BYTES;
        data[range.clone()] != expected[range]
    }) {
        panic!("{context}: volume {volume}: block {} differs", lba + index as u64);
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

fn json(api: &str, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ferrite_ok(api, args)).expect("JSON output")
}

/// What `volume show --json` reports of a volume's space and compression.
#[derive(Debug, Clone, Copy)]
struct Space {
    mapped_bytes: u64,
    physical_bytes: u64,
    reduction: f64,
}

fn space(api: &str, volume: &str) -> Space {
    let shown = json(api, &["volume", "show", volume, "--json"]);
    let field = |name: &str| shown[name].as_u64().unwrap_or_else(|| panic!("{name} in {shown}"));
    Space {
        mapped_bytes: field("mapped_bytes"),
        physical_bytes: field("physical_used_bytes"),
        reduction: shown["data_reduction"].as_f64().unwrap_or_else(|| panic!("{shown}")),
    }
}

fn compression(api: &str, volume: &str) -> String {
    let shown = json(api, &["volume", "show", volume, "--json"]);
    shown["compression"].as_str().unwrap_or_else(|| panic!("compression in {shown}")).to_owned()
}

/// The reduction of what was written between two reports: the growth of mapped bytes per byte
/// of growth on the drives.
fn reduction_between(before: Space, after: Space) -> f64 {
    let mapped = after.mapped_bytes - before.mapped_bytes;
    let physical = after.physical_bytes - before.physical_bytes;
    assert!(physical > 0, "the new blocks take no space: {before:?} -> {after:?}");
    mapped as f64 / physical as f64
}

/// A series' value in the Prometheus text `metrics`.
fn metric(metrics: &str, series: &str) -> f64 {
    let line = metrics
        .lines()
        .find(|line| line.starts_with(series) && line[series.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no series {series} in the metrics"));
    line[series.len() + 1..].parse().expect("a number")
}

#[test]
fn volumes_compress_as_configured_and_keep_it_across_restarts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let rt = runtime();
    let node = Node::start(&data_dir, nvme_port);
    let api = node.api_url.clone();

    let created = ferrite_ok(&api, &["volume", "create", "text-lz4", "--size", "64M"]);
    assert!(created.contains("created volume text-lz4"), "{created}");
    for (name, setting) in [("text-zstd", "zstd"), ("text-off", "off"), ("switch", "off")] {
        ferrite_ok(&api, &["volume", "create", name, "--size", "64M", "--compression", setting]);
    }
    ferrite_ok(&api, &["volume", "create", "random", "--size", "64M"]);
    let refused =
        ferrite(&api, &["volume", "create", "bad", "--size", "64M", "--compression", "gzip"]);
    assert!(!refused.status.success(), "an unknown compression was accepted");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    for expected in ["unknown compression \"gzip\"", "lz4", "zstd", "off"] {
        assert!(stderr.contains(expected), "{stderr:?} lacks {expected:?}");
    }
    assert_eq!(compression(&api, "text-lz4"), "lz4", "lz4 is the default");
    assert_eq!(compression(&api, "random"), "lz4");
    assert_eq!(compression(&api, "text-zstd"), "zstd");
    assert_eq!(compression(&api, "text-off"), "off");
    let shown = ferrite_ok(&api, &["volume", "show", "text-zstd"]);
    assert!(shown.contains("compression: zstd"), "{shown}");

    // Round 1: text everywhere but `random`, random data there; all of it reads back.
    let texts: Vec<(&str, AlignedBuf)> = ["text-lz4", "text-zstd", "text-off", "switch"]
        .into_iter()
        .map(|name| (name, text(name, 0, BLOCKS)))
        .collect();
    for (name, data) in &texts {
        write_and_check(&rt, &node, name, 0, data);
    }
    let random = pattern(0, BLOCKS, RANDOM_TAG);
    write_and_check(&rt, &node, "random", 0, &random);

    let written_bytes = (BLOCKS * BLOCK_BYTES) as u64;
    let lz4 = space(&api, "text-lz4");
    let zstd = space(&api, "text-zstd");
    for (name, compressed) in [("text-lz4", lz4), ("text-zstd", zstd)] {
        assert_eq!(compressed.mapped_bytes, written_bytes, "{name}: {compressed:?}");
        assert!(compressed.reduction > REDUCTION_MIN, "{name} was not compressed: {compressed:?}");
        assert!(compressed.physical_bytes * 3 < written_bytes * 2, "{name}: {compressed:?}");
    }
    for name in ["text-off", "switch", "random"] {
        let raw = space(&api, name);
        assert_eq!(
            (raw.mapped_bytes, raw.physical_bytes),
            (written_bytes, written_bytes),
            "{name}"
        );
        assert_eq!(raw.reduction, 1.0, "{name}: stored raw");
    }
    let shown = ferrite_ok(&api, &["volume", "show", "text-lz4"]);
    assert!(shown.contains(&format!("{:.2}x", lz4.reduction)), "{shown}");
    let listed = ferrite_ok(&api, &["volume", "list"]);
    assert!(listed.contains("COMPRESSION") && listed.contains("REDUCTION"), "{listed}");
    let list = json(&api, &["volume", "list", "--json"]);
    let listed_lz4 = list["volumes"]
        .as_array()
        .and_then(|volumes| volumes.iter().find(|volume| volume["name"] == "text-lz4"))
        .unwrap_or_else(|| panic!("text-lz4 in {list}"));
    assert_eq!(listed_lz4["data_reduction"].as_f64(), Some(lz4.reduction), "{list}");

    // Node-wide: 5 MiB mapped, 3 of it raw, 2 compressed.
    let node_info = json(&api, &["node", "show", "--json"]);
    let capacity = &node_info["capacity"];
    let node_reduction = capacity["data_reduction"].as_f64().expect("data_reduction");
    let mapped = capacity["mapped_bytes"].as_u64().expect("mapped_bytes");
    let physical = capacity["mapped_physical_bytes"].as_u64().expect("mapped_physical_bytes");
    assert_eq!(mapped, 5 * written_bytes, "{node_info}");
    assert_eq!(physical, 3 * written_bytes + lz4.physical_bytes + zstd.physical_bytes);
    assert!((node_reduction - mapped as f64 / physical as f64).abs() < 1e-9, "{node_info}");
    assert!(node_reduction > 1.2, "{node_info}");
    let shown = ferrite_ok(&api, &["node", "show"]);
    assert!(shown.contains(&format!("data reduction:  {node_reduction:.2}x")), "{shown}");
    let metrics = api::Client::new(&api).expect("client").metrics().expect("metrics");
    assert!((metric(&metrics, "ferrite_data_reduction_ratio") - node_reduction).abs() < 1e-9);
    assert_eq!(metric(&metrics, "ferrite_mapped_physical_bytes"), physical as f64);
    let id = json(&api, &["volume", "show", "text-lz4", "--json"])["id"].clone();
    let series =
        format!("ferrite_volume_physical_used_bytes{{volume=\"text-lz4\",volume_id=\"{id}\"}}");
    assert_eq!(metric(&metrics, &series), lz4.physical_bytes as f64);

    // A changed setting applies to new writes only: the raw blocks stay raw.
    let changed = ferrite_ok(&api, &["volume", "set-compression", "switch", "zstd"]);
    assert!(changed.contains("compression zstd"), "{changed}");
    let before = space(&api, "switch");
    let second = text("switch", BLOCKS as u64, BLOCKS);
    write_and_check(&rt, &node, "switch", BLOCKS as u64, &second);
    let after = space(&api, "switch");
    assert!(reduction_between(before, after) > REDUCTION_MIN, "{before:?} -> {after:?}");
    assert!(after.reduction > 1.0 && after.reduction < 2.0, "old blocks were rewritten: {after:?}");

    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "first run");

    // After a restart: the same bytes, the same settings, the same space; new writes are
    // stored as each volume's setting says.
    let node = Node::start(&data_dir, nvme_port);
    for (name, data) in &texts {
        check(&rt, &node, name, 0, data, "after the restart");
    }
    check(&rt, &node, "switch", BLOCKS as u64, &second, "after the restart");
    let data = rt.block_on(async {
        let (controller, mut queue) = connect(&node, "random").await;
        let data = queue.read(0, AlignedBuf::new(BLOCKS * BLOCK_BYTES)).await.expect("read");
        drop(queue);
        controller.shutdown().await.expect("shut down");
        data
    });
    if let Some(mismatch) = pattern_mismatch(&data, 0, RANDOM_TAG) {
        panic!("after the restart: random: {mismatch}");
    }
    let api = node.api_url.clone();
    let expected_settings =
        [("text-lz4", "lz4"), ("text-zstd", "zstd"), ("text-off", "off"), ("switch", "zstd")];
    for (name, setting) in expected_settings {
        assert_eq!(compression(&api, name), setting, "{name} after the restart");
    }
    let lz4_again = space(&api, "text-lz4");
    assert_eq!(lz4_again.physical_bytes, lz4.physical_bytes, "space is rebuilt as it was");
    for (name, compressed) in [("text-lz4", true), ("text-zstd", true), ("text-off", false)] {
        let before = space(&api, name);
        let more = text(name, 2 * BLOCKS as u64, BLOCKS);
        write_and_check(&rt, &node, name, 2 * BLOCKS as u64, &more);
        let reduction = reduction_between(before, space(&api, name));
        if compressed {
            assert!(reduction > REDUCTION_MIN, "{name} after the restart: {reduction}");
        } else {
            assert_eq!(reduction, 1.0, "{name} after the restart");
        }
    }
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "second run");
}
