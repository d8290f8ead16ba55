//! Volumes and their data across the node's life, end to end: data written through the
//! initiator survives a clean stop (SIGTERM with a host still connected) and a restart byte for
//! byte, with the volume list unchanged; a volume grown while a host is connected shows its new
//! size on a re-identify and takes I/O there at once; a volume deleted while a host does I/O on
//! it closes that host's connection cleanly while the node goes on serving the other volumes.

mod common;

use common::{
    assert_no_error_lines, ferrite_ok, free_port, pattern, pattern_mismatch, runtime, volume_list,
    volume_nqn, Node, BLOCK_BYTES,
};
use initiator::{AlignedBuf, ConnectOptions, Controller, InitiatorError, IoQueue, Status};
use std::time::{Duration, Instant};

/// Blocks of 64 MiB (one chunk); a write across LBA 16384 spans two chunks.
const CHUNK_BLOCKS: u64 = (64 << 20) / BLOCK_BYTES as u64;
/// A deleted volume's connection must close within this time.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Commands that must answer promptly are given this long.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

async fn connect(address: &str, volume: &str) -> (Controller, IoQueue) {
    let controller = Controller::connect(address, &volume_nqn(volume), ConnectOptions::default())
        .await
        .unwrap_or_else(|error| panic!("connect to volume {volume}: {error}"));
    let queue = controller.open_io_queue(8).await.expect("open an I/O queue");
    (controller, queue)
}

async fn write_pattern(queue: &mut IoQueue, lba: u64, blocks: usize, tag: u64) {
    queue
        .write(lba, pattern(lba, blocks, tag))
        .await
        .unwrap_or_else(|error| panic!("write {blocks} blocks at LBA {lba}: {error}"));
}

async fn read_back(queue: &mut IoQueue, lba: u64, blocks: usize, tag: u64, context: &str) {
    let data = queue
        .read(lba, AlignedBuf::new(blocks * BLOCK_BYTES))
        .await
        .unwrap_or_else(|error| panic!("{context}: read {blocks} blocks at LBA {lba}: {error}"));
    if let Some(mismatch) = pattern_mismatch(&data, lba, tag) {
        panic!("{context}: {mismatch}");
    }
}

#[test]
fn data_and_volumes_survive_a_clean_stop() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let rt = runtime();
    let node = Node::start(&data_dir, nvme_port);
    ferrite_ok(&node.api_url, &["volume", "create", "alpha", "--size", "256M"]);
    ferrite_ok(&node.api_url, &["volume", "create", "beta", "--size", "64M"]);
    let alpha_blocks = (256u64 << 20) / BLOCK_BYTES as u64;
    // (volume, LBA, blocks, tag): single blocks, an R2T-sized write, one above MDTS (split by
    // the initiator), one across a chunk boundary, the last blocks of the volume.
    let writes: Vec<(&str, u64, usize, u64)> = vec![
        ("alpha", 0, 1, 0xA0),
        ("alpha", 1, 3, 0xA1),
        ("alpha", 100, 32, 0xA2),
        ("alpha", 1000, 768, 0xA3),
        ("alpha", CHUNK_BLOCKS - 3, 6, 0xA4),
        ("alpha", 3 * CHUNK_BLOCKS + 17, 2, 0xA5),
        ("alpha", alpha_blocks - 2, 2, 0xA6),
        ("beta", 0, 4, 0xB0),
        ("beta", CHUNK_BLOCKS - 1, 1, 0xB1),
    ];
    let address = node.nvme_address();
    // The hosts stay connected through the stop.
    let connections = rt.block_on(async {
        let mut connections = Vec::new();
        for volume in ["alpha", "beta"] {
            let (controller, mut queue) = connect(&address, volume).await;
            for &(_, lba, blocks, tag) in writes.iter().filter(|write| write.0 == volume) {
                write_pattern(&mut queue, lba, blocks, tag).await;
            }
            for &(_, lba, blocks, tag) in writes.iter().filter(|write| write.0 == volume) {
                read_back(&mut queue, lba, blocks, tag, "before the stop").await;
            }
            connections.push((controller, queue));
        }
        connections
    });
    let volumes_before = volume_list(&node.api_url);
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "first run");
    drop(connections);

    let node = Node::start(&data_dir, nvme_port);
    assert_eq!(volume_list(&node.api_url), volumes_before, "the volume list changed");
    let address = node.nvme_address();
    rt.block_on(async {
        for volume in ["alpha", "beta"] {
            let (controller, mut queue) = connect(&address, volume).await;
            for &(_, lba, blocks, tag) in writes.iter().filter(|write| write.0 == volume) {
                read_back(&mut queue, lba, blocks, tag, "after the restart").await;
            }
            // Blocks never written read as zeros.
            let zeros = queue.read(5000, AlignedBuf::new(2 * BLOCK_BYTES)).await.expect("read");
            assert!(zeros.iter().all(|byte| *byte == 0), "{volume}: unwritten blocks are not zero");
            drop(queue);
            controller.shutdown().await.expect("shut down");
        }
    });
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "second run");
}

#[test]
fn resize_and_delete_while_hosts_are_connected() {
    let dir = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&dir.path().join("data"), free_port());
    let api = node.api_url.clone();
    for volume in ["grow", "gone", "stay"] {
        ferrite_ok(&api, &["volume", "create", volume, "--size", "64M"]);
    }
    let address = node.nvme_address();
    let rt = runtime();
    rt.block_on(async {
        // Grow a volume under a connected host.
        let (grow, mut grow_queue) = connect(&address, "grow").await;
        let old_blocks = grow_queue.namespace().size_blocks;
        assert_eq!(old_blocks, CHUNK_BLOCKS);
        let beyond = old_blocks + 10;
        let refused = grow_queue.write(beyond, pattern(beyond, 1, 0xC0)).await;
        assert!(
            refused
                .as_ref()
                .err()
                .and_then(InitiatorError::status)
                .is_some_and(|status| status.same_code(Status::LBA_OUT_OF_RANGE)),
            "a write past the end before the resize: {refused:?}"
        );
        let resized = ferrite_ok(&api, &["volume", "resize", "grow", "128M"]);
        assert!(resized.contains("resized volume grow (128MiB)"), "{resized}");
        let nsid = grow_queue.namespace().nsid;
        let namespace = grow.identify_namespace(nsid).await.expect("re-identify");
        assert_eq!(namespace.size_blocks, 2 * CHUNK_BLOCKS, "Identify Namespace after resize");
        // The queue opened before the resize takes I/O in the new space at once.
        write_pattern(&mut grow_queue, beyond, 1, 0xC1).await;
        read_back(&mut grow_queue, beyond, 1, 0xC1, "the grown space").await;
        write_pattern(&mut grow_queue, old_blocks - 1, 2, 0xC2).await;
        read_back(&mut grow_queue, old_blocks - 1, 2, 0xC2, "across the old end").await;

        // Delete a volume while a host does I/O on it.
        let (gone, mut gone_queue) = connect(&address, "gone").await;
        let (stay, mut stay_queue) = connect(&address, "stay").await;
        write_pattern(&mut stay_queue, 7, 4, 0xD0).await;
        write_pattern(&mut gone_queue, 7, 4, 0xE0).await;
        let busy = tokio::spawn(async move {
            let mut completed: u64 = 0;
            let mut statuses = Vec::new();
            loop {
                let lba = 8 * (completed % 64);
                let attempt = tokio::time::timeout(
                    COMMAND_TIMEOUT,
                    gone_queue.write(lba, pattern(lba, 2, 0xE1)),
                )
                .await;
                match attempt {
                    Err(_) => return Err(format!("a write hung after {completed} writes")),
                    Ok(Ok(_)) => completed += 1,
                    // Commands that reached the fenced volume fail with a status; the
                    // connection then closes.
                    Ok(Err(error)) if error.status().is_some() => statuses.push(error.status()),
                    Ok(Err(error)) => return Ok((completed, statuses, error, Instant::now())),
                }
                if statuses.len() > 1000 {
                    return Err(format!("the connection stayed open: {statuses:?}"));
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let delete_started = Instant::now();
        let api_for_delete = api.clone();
        let deleted = tokio::task::spawn_blocking(move || {
            ferrite_ok(&api_for_delete, &["volume", "delete", "gone"])
        })
        .await
        .expect("delete task");
        assert!(deleted.contains("deleted volume gone"), "{deleted}");
        let delete_took = delete_started.elapsed();
        let (completed, statuses, error, ended_at) = tokio::time::timeout(CLOSE_TIMEOUT, busy)
            .await
            .expect("the deleted volume's connection did not close")
            .expect("busy task")
            .expect("busy loop");
        eprintln!(
            "delete: {completed} writes before, then statuses {statuses:?}, then after {:?}: \
             {error} (the delete took {delete_took:?})",
            ended_at.duration_since(delete_started)
        );
        assert!(completed > 0, "no write completed before the delete");
        // The node closes the connection without reading what the host still sent, so the
        // kernel may answer with a reset instead of a FIN; both end the connection promptly
        // with no half-done command, which is what a host needs.
        let closed = match &error {
            InitiatorError::ConnectionClosed { .. } => true,
            InitiatorError::Io { source, .. } => {
                source.kind() == std::io::ErrorKind::ConnectionReset
            }
            _ => false,
        };
        assert!(closed, "the deleted volume's connection ended with {error:?}, not a close");
        assert!(
            statuses.iter().flatten().all(|status| status.same_code(Status::NAMESPACE_NOT_READY)),
            "writes to the deleted volume failed with {statuses:?}"
        );
        // Its admin connection is closed too, at once: the delete returned after the
        // controller was closed, and a queue checks that before handling any command.
        let identify = tokio::time::timeout(COMMAND_TIMEOUT, gone.identify_namespace(1)).await;
        assert!(
            matches!(identify, Ok(Err(_))),
            "Identify on the deleted volume's controller: {identify:?}"
        );
        drop(gone);
        let refused =
            Controller::connect(&*address, &volume_nqn("gone"), ConnectOptions::default()).await;
        assert!(
            matches!(refused, Err(InitiatorError::ConnectRejected { .. })),
            "connect to the deleted volume: {refused:?}"
        );

        // The node goes on serving the other volumes, on the old connections and on new ones.
        read_back(&mut stay_queue, 7, 4, 0xD0, "stay after the delete").await;
        write_pattern(&mut stay_queue, 100, 8, 0xD1).await;
        read_back(&mut grow_queue, beyond, 1, 0xC1, "grow after the delete").await;
        let (stay2, mut stay2_queue) = connect(&address, "stay").await;
        read_back(&mut stay2_queue, 100, 8, 0xD1, "a new connection to stay").await;
        for (controller, queue) in [(stay2, stay2_queue), (stay, stay_queue), (grow, grow_queue)] {
            drop(queue);
            controller.shutdown().await.expect("shut down");
        }
    });
    let list = volume_list(&api);
    let names: Vec<&str> = list["volumes"]
        .as_array()
        .expect("volumes array")
        .iter()
        .filter_map(|volume| volume["name"].as_str())
        .collect();
    assert_eq!(names, ["grow", "stay"]);
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "resize and delete");
}
