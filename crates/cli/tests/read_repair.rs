//! Read repair across replicas on a real cluster (`common::cluster`: two nodes, three for the
//! failover; each node on two drive files without parity, so a damaged block has no second copy
//! on its own node):
//!
//! - The test writes known blocks, finds one of them in the primary's drive files (written raw:
//!   compression off) and flips bytes in it while the nodes run. A host's read of it through
//!   the primary returns the right data: the primary read the replica's copy, answered the
//!   host with it and rewrote its own. `ferrite volume show` and the metrics count it, nothing
//!   failed over, and the next read needs no repair.
//! - Then another block is damaged on both nodes: its read fails with the NVMe Unrecovered Read
//!   Error status, the blocks beside it still read, and the volume still takes writes (before
//!   read repair, any damaged block stopped a cluster node's volume until a restart).
//! - A block damaged on the replica (killed, damaged, restarted) is found by the replica's
//!   scrub, which has the primary send its copy: once the primary is killed in turn, the
//!   replica serves the block intact without needing any other copy. The scrub reads sealed
//!   segments only, so the test writes 16 MiB more after the blocks, and it waits out the write
//!   intent's linger first (10 s), so that the replica's return copies nothing and only the
//!   repair can replace the block.
//! - On three nodes, a host writes one block over and over while the primary is killed: the
//!   replicas hold its newest versions beyond the commit point they know, so the next primary's
//!   reconciliation pushes the block. Its own copy is damaged meanwhile: it takes the third
//!   node's copy instead, writes and pushes it, and serves (before, it stopped serving, and the
//!   third node was promoted in its place).

mod common;

use std::time::Duration;

use common::cluster::{Cluster, ClusterOptions};
use common::{
    damage, ferrite_ok, find_block, metric, pattern, pattern_mismatch, runtime, volume_nqn,
    BLOCK_BYTES,
};
use initiator::AlignedBuf;

const VOLUME: &str = "repaired";
const BLOCKS: usize = 64;
const TAG: u64 = 0x4EAD_4E9A;
/// Damaged on the primary only, then on both nodes.
const PRIMARY_ONLY_LBA: u64 = 10;
const EVERYWHERE_LBA: u64 = 40;
const IO_TIMEOUT: Duration = Duration::from_secs(20);
/// Time for a rewrite the counters show as started to complete before the block is read again.
const REWRITE_SETTLE: Duration = Duration::from_millis(500);
/// The service looks at the scrub's findings every second.
const FINDING_TIMEOUT: Duration = Duration::from_secs(10);
/// Written after the blocks so that their segment is sealed (the scrub reads only those).
const FILLER_LBAS: std::ops::Range<u64> = 1024..5120;
const FILLER_CHUNK_BLOCKS: u64 = 256;
/// A region of the write intent leaves 10 s after its last write (`replication` crate docs).
const INTENT_LINGER: Duration = Duration::from_secs(15);

/// Damages the newest version of `lba` in `node`'s drive files: of the blocks holding its
/// pattern under one of `tags` (each a write of the host, applied in order), the one with the
/// highest tag, which is the block the node's index points to. One pass over the files;
/// returns that tag.
fn damage_newest(cluster: &Cluster, node: usize, lba: u64, tags: std::ops::Range<u64>) -> u64 {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::fd::AsRawFd;
    let drives = cluster.node(node).data_dir().join("drives");
    let mut files: Vec<_> = std::fs::read_dir(&drives)
        .expect("list the drive files")
        .map(|entry| entry.expect("a drive file").path())
        .collect();
    files.sort();
    let mut newest: Option<(u64, Vec<(std::path::PathBuf, u64)>)> = None;
    let mut chunk = vec![0u8; 4 << 20];
    for path in files {
        let mut file = std::fs::File::open(&path).expect("open a drive file");
        let fd = file.as_raw_fd();
        // The files are sparse: only their data extents are read (the lseek calls fail past
        // the last one).
        let mut at: i64 = 0;
        loop {
            // SAFETY: plain lseek calls on a descriptor this function owns.
            let start = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
            if start < 0 {
                break;
            }
            // SAFETY: as above.
            let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
            assert!(end > start, "a data extent ends in a hole or at the end of the file");
            let mut offset = start as u64 - start as u64 % BLOCK_BYTES as u64;
            file.seek(SeekFrom::Start(offset)).expect("seek to the extent");
            while offset < end as u64 {
                let want = chunk.len().min((end as u64 - offset) as usize);
                let want = want.div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
                let mut filled = 0;
                while filled < want {
                    match file.read(&mut chunk[filled..want]).expect("read a drive file") {
                        0 => break,
                        read => filled += read,
                    }
                }
                for (index, block) in chunk[..filled].chunks_exact(BLOCK_BYTES).enumerate() {
                    let word = |at: usize| {
                        u64::from_le_bytes(block[at..at + 8].try_into().expect("eight bytes"))
                    };
                    if word(0) != lba {
                        continue;
                    }
                    let tag = word(8);
                    let newer = newest.as_ref().is_none_or(|(newest, _)| tag >= *newest);
                    if tags.contains(&tag) && newer && pattern_mismatch(block, lba, tag).is_none() {
                        let place = (path.clone(), offset + (index * BLOCK_BYTES) as u64);
                        match &mut newest {
                            Some((newest, places)) if *newest == tag => places.push(place),
                            _ => newest = Some((tag, vec![place])),
                        }
                    }
                }
                if filled < want {
                    break;
                }
                offset += filled as u64;
            }
            at = end;
        }
    }
    let (tag, places) = newest.expect("the node holds a version of the block");
    for (path, offset) in places {
        damage(&path, offset);
    }
    tag
}

/// Where `lba`'s block (as written with `TAG`) is in `node`'s drive files; damages every copy.
fn damage_block(cluster: &Cluster, node: usize, lba: u64) {
    let mut expected = AlignedBuf::new(BLOCK_BYTES);
    expected.copy_from_slice(&pattern(lba, 1, TAG));
    let drives = cluster.node(node).data_dir().join("drives");
    let places = find_block(&drives, &expected);
    assert!(!places.is_empty(), "block {lba} is in {}'s drive files", cluster.node(node).name);
    for (path, offset) in places {
        damage(&path, offset);
    }
    assert!(find_block(&drives, &expected).is_empty(), "the damage took");
}

async fn connect(cluster: &Cluster, node: usize) -> initiator::MultipathNamespace {
    let paths = vec![cluster.node(node).nvme_address()];
    let options = initiator::ConnectOptions::default();
    let mut device =
        initiator::MultipathNamespace::connect(&paths, &volume_nqn(VOLUME), options, 1)
            .await
            .unwrap_or_else(|error| panic!("cannot connect to {VOLUME} on {paths:?}: {error}"));
    device.set_io_timeout(IO_TIMEOUT);
    device
}

/// Two nodes without parity and the test volume on both, uncompressed, served with both in
/// sync; returns the cluster and that state.
fn start_cluster() -> (Cluster, api::ReplicationInfo) {
    let options = ClusterOptions {
        up_args: vec!["--erasure-coding".to_owned(), "none".to_owned()],
        ..ClusterOptions::nodes(2)
    };
    let cluster = Cluster::start(&options);
    let create = ["volume", "create", VOLUME, "--size", "64M", "--replicas", "2"];
    ferrite_ok(&cluster.api_url(), &[&create[..], &["--compression", "off"]].concat());
    let state = cluster.wait_serving(VOLUME, 2, &[]);
    (cluster, state)
}

#[test]
fn a_block_damaged_on_the_primary_is_read_from_the_replica_and_rewritten() {
    let (cluster, state) = start_cluster();
    let primary = cluster.index(state.primary.as_deref().expect("a primary"));
    let replica = 1 - primary;
    let rt = runtime();
    rt.block_on(async {
        let mut device = connect(&cluster, primary).await;
        device.write(0, &pattern(0, BLOCKS, TAG)).await.expect("write the blocks");
    });

    damage_block(&cluster, primary, PRIMARY_ONLY_LBA);
    rt.block_on(async {
        let mut device = connect(&cluster, primary).await;
        let all = device.read(0, BLOCKS * BLOCK_BYTES).await.expect("read through the primary");
        assert_eq!(pattern_mismatch(&all, 0, TAG), None, "the replica's copy reached the host");
    });
    // The rewrite may wait for the write intent to take its region (crate docs of
    // `replication`, "Read repair"); the counters are published a few times a second, after it.
    let local = cluster.wait_local(primary, VOLUME, "a read repaired and rewritten", |local| {
        local.reads_repaired >= 1 && local.blocks_repaired >= 1
    });
    assert_eq!(local.reads_unrecovered, 0, "{local:?}");
    std::thread::sleep(REWRITE_SETTLE);
    assert!(local.serving && !local.failed, "still the serving primary: {local:?}");
    let replica_view = cluster
        .wait_local(replica, VOLUME, "a peer read served", |local| local.peer_reads_served >= 1);
    assert!(!replica_view.serving, "{replica_view:?}");
    let after = cluster.replication(VOLUME).expect("replication state");
    assert_eq!(after.epoch, state.epoch, "no failover: {after:?}");
    let metrics = cluster.node(primary).client().metrics().expect("metrics");
    assert!(metric(&metrics, "ferrite_replication_reads_repaired_total") >= 1, "{metrics}");
    let shown = ferrite_ok(cluster.node(primary).api_url(), &["volume", "show", VOLUME]);
    assert!(shown.contains("read repair:"), "{shown}");
    // The primary's copy is whole again: reading it needs the replica no more.
    let repaired = local.reads_repaired;
    rt.block_on(async {
        let mut device = connect(&cluster, primary).await;
        let block = device.read(PRIMARY_ONLY_LBA, BLOCK_BYTES).await.expect("read again");
        assert_eq!(pattern_mismatch(&block, PRIMARY_ONLY_LBA, TAG), None);
    });
    let local = cluster.replication_at(primary, VOLUME).and_then(|state| state.local);
    assert_eq!(local.map(|local| local.reads_repaired), Some(repaired), "no second repair");

    // No good copy anywhere: only that block's read fails, with the media error status.
    damage_block(&cluster, primary, EVERYWHERE_LBA);
    damage_block(&cluster, replica, EVERYWHERE_LBA);
    rt.block_on(async {
        let mut device = connect(&cluster, primary).await;
        let error = device.read(EVERYWHERE_LBA, BLOCK_BYTES).await.expect_err("no good copy");
        let status = error.status().unwrap_or_else(|| panic!("not a status: {error}"));
        assert!(status.same_code(nvmf::command::Status::UNRECOVERED_READ_ERROR), "{error}");
        let next = device.read(EVERYWHERE_LBA + 1, BLOCK_BYTES).await.expect("its neighbour");
        assert_eq!(pattern_mismatch(&next, EVERYWHERE_LBA + 1, TAG), None);
        let fresh = pattern(EVERYWHERE_LBA, 1, TAG + 1);
        device.write(EVERYWHERE_LBA, &fresh).await.expect("the volume takes writes");
        let back = device.read(EVERYWHERE_LBA, BLOCK_BYTES).await.expect("read the new data");
        assert_eq!(pattern_mismatch(&back, EVERYWHERE_LBA, TAG + 1), None);
    });
    let local = cluster
        .wait_local(primary, VOLUME, "an unrecovered read", |local| local.reads_unrecovered >= 1);
    assert!(local.serving && !local.failed, "{local:?}");
}

#[test]
fn a_block_the_scrub_finds_damaged_on_a_replica_is_replaced_from_the_primary() {
    let (mut cluster, state) = start_cluster();
    let primary_name = state.primary.clone().expect("a primary");
    let primary = cluster.index(&primary_name);
    let replica = 1 - primary;
    let rt = runtime();
    rt.block_on(async {
        let mut device = connect(&cluster, primary).await;
        device.write(0, &pattern(0, BLOCKS, TAG)).await.expect("write the blocks");
        for lba in FILLER_LBAS.step_by(FILLER_CHUNK_BLOCKS as usize) {
            let filler = pattern(lba, FILLER_CHUNK_BLOCKS as usize, TAG + 2);
            device.write(lba, &filler).await.expect("write the filler");
        }
    });
    std::thread::sleep(INTENT_LINGER);

    // The replica's copy is damaged while it is down; its scrub's first pass after the start
    // finds it, and once the replica is back in sync the primary sends it its copy.
    cluster.kill9(replica);
    damage_block(&cluster, replica, PRIMARY_ONLY_LBA);
    cluster.restart(replica);
    cluster.wait_serving(VOLUME, 2, &[]);
    let local = cluster.wait_local(replica, VOLUME, "the damaged block replaced", |local| {
        local.damaged_found >= 1 && local.damaged_rewritten >= 1
    });
    assert!(!local.serving && !local.failed, "{local:?}");
    let sent = cluster.wait_local(primary, VOLUME, "a block sent for repair", |local| {
        local.blocks_sent_for_repair >= 1
    });
    // The replica's `node show` lists the scrub's finding as repaired now.
    let deadline = std::time::Instant::now() + FINDING_TIMEOUT;
    loop {
        let shown = ferrite_ok(cluster.node(replica).api_url(), &["node", "show", "--json"]);
        let node: serde_json::Value = serde_json::from_str(&shown).expect("node show JSON");
        let findings = node["scrub"]["findings"].as_array().cloned().unwrap_or_default();
        let finding = findings.iter().find(|finding| {
            finding["kind"] == "block" && finding["block"].as_u64() == Some(PRIMARY_ONLY_LBA)
        });
        if finding.is_some_and(|finding| finding["repaired"] == true) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "finding not repaired: {findings:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(sent.reads_repaired, 0, "no host read was needed: {sent:?}");

    // The replica alone now: it holds the block whole.
    cluster.kill9(primary);
    cluster.wait_serving(VOLUME, 1, &[&primary_name]);
    rt.block_on(async {
        let mut device = connect(&cluster, replica).await;
        let all = device.read(0, BLOCKS * BLOCK_BYTES).await.expect("read through the replica");
        assert_eq!(pattern_mismatch(&all, 0, TAG), None);
    });
    let local = cluster.replication_at(replica, VOLUME).and_then(|state| state.local);
    let local = local.expect("the replica's view");
    assert_eq!((local.reads_repaired, local.reads_unrecovered), (0, 0), "{local:?}");
}

#[test]
fn a_new_primary_takes_a_block_damaged_in_its_reconciliation_from_another_member() {
    const LBA: u64 = 7;
    let options = ClusterOptions {
        up_args: vec!["--erasure-coding".to_owned(), "none".to_owned()],
        ..ClusterOptions::nodes(3)
    };
    let mut cluster = Cluster::start(&options);
    let create = ["volume", "create", VOLUME, "--size", "64M", "--replicas", "3"];
    ferrite_ok(&cluster.api_url(), &[&create[..], &["--compression", "off"]].concat());
    let state = cluster.wait_serving(VOLUME, 3, &[]);
    let old_name = state.primary.clone().expect("a primary");
    let old = cluster.index(&old_name);
    // The manager promotes the in-sync member with the lowest node id.
    let info = cluster.cluster_info().expect("the cluster's nodes");
    let id_of = |index: usize| {
        let name = &cluster.node(index).name;
        info.nodes.iter().find(|node| &node.name == name).map(|node| node.id).expect("an id")
    };
    let mut others: Vec<usize> = (0..3).filter(|&index| index != old).collect();
    others.sort_by_key(|&index| id_of(index));
    let next = others[0];

    // One block written over and over (one write at a time): whenever the primary dies, the
    // replicas' newest version of it is beyond the commit point they know.
    let rt = runtime();
    let mut device = rt.block_on(connect(&cluster, old));
    // The next tag the writer uses: every tag below it was sent.
    let next_tag = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(TAG));
    let sent = std::sync::Arc::clone(&next_tag);
    let writer = rt.spawn(async move {
        loop {
            let tag = sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if device.write(LBA, &pattern(LBA, 1, tag)).await.is_err() {
                break;
            }
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    cluster.kill9(old);
    let killed = std::time::Instant::now();
    // Its last write fails only once the path's I/O timeout passes: no need to wait for it.
    writer.abort();
    let tags_end = next_tag.load(std::sync::atomic::Ordering::SeqCst);
    assert!(tags_end > TAG + 10, "the host wrote the block a few times");
    // Before the primary's lease runs out (2 s), the next primary's copy goes bad.
    damage_newest(&cluster, next, LBA, TAG..tags_end);
    assert!(killed.elapsed() < Duration::from_secs(1), "damaged before any failover");

    let state = cluster.wait_serving(VOLUME, 2, &[&old_name]);
    assert_eq!(state.primary.as_deref(), Some(cluster.node(next).name.as_str()), "{state:?}");
    let local =
        cluster.wait_local(next, VOLUME, "the damaged block taken from a member", |local| {
            local.reconcile_blocks_repaired >= 1
        });
    assert!(local.serving && !local.failed, "{local:?}");
    assert_eq!(local.reconcile_unrecovered, 0, "{local:?}");
    let block = rt.block_on(async {
        let mut device = connect(&cluster, next).await;
        device.read(LBA, BLOCK_BYTES).await.expect("read through the new primary")
    });
    let tag = u64::from_le_bytes(block[8..16].try_into().expect("eight bytes"));
    assert!((TAG..tags_end).contains(&tag), "a version the host wrote: tag {tag:#x}");
    assert_eq!(pattern_mismatch(&block, LBA, tag), None);
    let metrics = cluster.node(next).client().metrics().expect("metrics");
    assert!(metric(&metrics, "ferrite_replication_reconcile_blocks_repaired_total") >= 1);
    let shown = ferrite_ok(cluster.node(next).api_url(), &["volume", "show", VOLUME]);
    assert!(shown.contains("damaged blocks taken from another member"), "{shown}");
    let log = cluster.node(next).stderr_all();
    assert!(log.contains("met blocks damaged on this node: taking them from another member"));
    cluster.assert_no_error_lines(&[]);
}
