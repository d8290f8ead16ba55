//! Tests of the erasure-coded log over simulated drives: the model test on coded geometries
//! (2+1, 4+2, 1+1) with restarts, power losses and GC; drives that die in the middle of a
//! verifying workload; a corrupt cell repaired from parity; more drives lost than the parity
//! covers; and drive replacement with a rebuild that runs beside writers, survives a crash, and
//! leaves the node able to lose another drive.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Waker};

use types::AlignedBuf;

use super::tests::{
    block_buf, contexts, run_until, soak, verify_all, volume_maps, writers, Node, BLOCK,
};
use super::LogError;
use crate::compress::Compression;
use crate::drive::Drive;
use crate::erasure::ErasureScheme;
use crate::local_sync::LocalNotify;
use crate::store::VolumeStore;
use crate::testing::{
    block_matches, block_on, describe_block, join_all, CheckReport, LocalBoxFuture, Oracle, Rng,
};
use crate::volumes::VolumeMap;

use super::format::BLOCK_BYTES;

fn scheme(data: u8, parity: u8) -> ErasureScheme {
    ErasureScheme::new(data, parity).unwrap()
}

/// Polls `future` `polls` times, runs `action` once, then polls it to the end.
fn run_with_event<F: Future>(future: F, polls: u64, action: impl FnOnce()) -> F::Output {
    let mut future = pin!(future);
    let mut context = Context::from_waker(Waker::noop());
    let mut action = Some(action);
    let mut count = 0u64;
    loop {
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut context) {
            if let Some(action) = action.take() {
                action();
            }
            return output;
        }
        count += 1;
        if count == polls {
            if let Some(action) = action.take() {
                action();
            }
        }
        assert!(count < 50_000_000, "the workload does not end");
    }
}

/// One round of writers on every volume; returns what they did.
fn workload(
    node: &Node,
    maps: &[Arc<VolumeMap>],
    oracle: &Oracle,
    seed: u64,
    ops: u32,
) -> CheckReport {
    let report = RefCell::new(CheckReport::default());
    let progress = LocalNotify::new();
    {
        let contexts = contexts(node, maps, oracle, &report, &progress, 2, false);
        block_on(join_all(writers(node, maps, &contexts, 2, seed, ops)));
    }
    report.into_inner()
}

#[test]
fn coded_model_with_restarts_crashes_and_gc() {
    for (drives, data, parity, segments) in [(3u16, 2u8, 1u8, 192), (6, 4, 2, 128), (2, 1, 1, 320)]
    {
        for seed in 0..2 * soak() {
            let mut node = Node::format_coded(segments, seed, 3, 3, drives, scheme(data, parity));
            eprintln!("DEBUG drives {drives} seed {seed}");
            let (_volumes, maps) = volume_maps(&[2000, 1500]);
            let compression = Compression::ALL[(seed % 3) as usize];
            for map in &maps {
                map.set_compression(compression);
            }
            let oracle = Oracle::new();
            let mut writes = 0;
            for round in 0..4u64 {
                let report = RefCell::new(CheckReport::default());
                let progress = LocalNotify::new();
                let phase_seed = seed * 1000 + round + u64::from(drives) * 77;
                let crash_round = round % 2 == 1;
                {
                    let contexts = contexts(&node, &maps, &oracle, &report, &progress, 3, false);
                    let futures =
                        writers(&node, &maps, &contexts, 3, phase_seed, 100 * soak() as u32);
                    if crash_round {
                        let budget = 2_000 + Rng::new(phase_seed).below(30_000);
                        run_until(join_all(futures), || false, budget);
                    } else {
                        block_on(join_all(futures));
                    }
                }
                writes += report.into_inner().writes;
                node = if crash_round { node.crash() } else { node.restart() };
                // Recovery rebuilds headers it cannot decode (a torn tail) from parity; host
                // reads never need to while every drive answers.
                let reconstructed =
                    || node.engine.counters.reconstructed_reads.load(Ordering::Relaxed);
                let before = reconstructed();
                if !crash_round {
                    // Its tries where each segment's header chain ends rebuilt nothing.
                    assert_eq!(before, 0, "a clean restart read nothing from parity");
                }
                assert!(verify_all(&node, &maps, &oracle) > 0);
                assert_eq!(reconstructed(), before, "nothing is rebuilt while every drive answers");
            }
            assert!(writes > 200, "{writes} writes");
            let stats = node.engine.stats();
            assert!(stats.failed_drives.is_empty());
        }
    }
}

/// Drives die in the middle of a verifying workload (one of 2+1, two of 4+2): no write fails,
/// nothing is lost, reads are rebuilt from parity, and the node restarts degraded. A
/// replacement is rebuilt, after which the node survives losing other drives.
#[test]
fn drives_lost_mid_workload_lose_nothing_and_a_rebuild_restores_redundancy() {
    for (drives, data, parity) in [(3u16, 2u8, 1u8), (6, 4, 2)] {
        let seed = u64::from(drives);
        let node = Node::format_coded(128, seed, 2, 2, drives, scheme(data, parity));
        let (_volumes, maps) = volume_maps(&[1500]);
        let oracle = Oracle::new();
        workload(&node, &maps, &oracle, seed, 60);
        let lost: Vec<u16> = (0..u16::from(parity)).map(|index| index * 2 + 1).collect();
        {
            let report = RefCell::new(CheckReport::default());
            let progress = LocalNotify::new();
            let contexts = contexts(&node, &maps, &oracle, &report, &progress, 2, false);
            let futures = writers(&node, &maps, &contexts, 2, seed + 1, 150);
            let dead: Vec<_> =
                lost.iter().map(|index| node.drives[usize::from(*index)].clone()).collect();
            run_with_event(join_all(futures), 200, || {
                dead.iter().for_each(|drive| drive.fail_all())
            });
            assert!(report.into_inner().writes > 100);
        }
        assert_eq!(node.engine.stats().failed_drives, lost, "the dead drives are latched");
        verify_all(&node, &maps, &oracle);
        let reconstructed = node.engine.counters.reconstructed_reads.load(Ordering::Relaxed);
        assert!(reconstructed > 0, "reads of the dead drives' blocks were rebuilt");
        // GC and checkpoints go on degraded.
        for _ in 0..4 {
            block_on(node.handles[0].gc_step()).unwrap();
        }
        // A restart with the drives still dead opens degraded.
        let mut node = node.restart();
        assert_eq!(node.report.drives_unusable, parity as u16);
        verify_all(&node, &maps, &oracle);
        workload(&node, &maps, &oracle, seed + 2, 40);
        // Replace them one at a time; writers run beside the first rebuild.
        for (round, index) in lost.iter().enumerate() {
            node.replace_drive(*index, seed * 10 + round as u64).unwrap();
            let refused = node.replace_drive(*index, 99);
            assert!(matches!(refused, Err(LogError::ReplaceRefused { .. })), "{refused:?}");
            if round == 0 {
                let report = RefCell::new(CheckReport::default());
                let progress = LocalNotify::new();
                let done = Cell::new(false);
                let contexts = contexts(&node, &maps, &oracle, &report, &progress, 2, false);
                let mut futures = writers(&node, &maps, &contexts, 2, seed + 3, 120);
                let rebuild: LocalBoxFuture<'_, ()> = Box::pin(async {
                    loop {
                        match node.handles[1].rebuild_step(64 << 10).await.unwrap() {
                            Some(progress) if progress.finished => break,
                            None => break,
                            Some(_) => {}
                        }
                    }
                    done.set(true);
                });
                futures.push(rebuild);
                block_on(join_all(futures));
                assert!(done.get());
            } else {
                node.finish_rebuild(256 << 10);
            }
            assert!(node.engine.rebuild_progress().is_none());
            verify_all(&node, &maps, &oracle);
        }
        assert!(node.engine.stats().failed_drives.is_empty(), "the replacements are healthy");
        // Full redundancy again: lose other drives and still read everything.
        let mut node = node.restart();
        verify_all(&node, &maps, &oracle);
        let others: Vec<u16> = (0..u16::from(parity)).map(|index| index * 2).collect();
        for index in &others {
            node.drives[usize::from(*index)].fail_all();
        }
        node.handles.truncate(1);
        verify_all(&node, &maps, &oracle);
        workload(&node, &maps, &oracle, seed + 4, 30);
        verify_all(&node, &maps, &oracle);
    }
}

#[test]
fn a_rebuild_interrupted_by_a_crash_starts_again_at_open() {
    let mut node = Node::format_coded(64, 5, 2, 1, 3, scheme(2, 1));
    let (_volumes, maps) = volume_maps(&[2000]);
    let oracle = Oracle::new();
    workload(&node, &maps, &oracle, 5, 80);
    node.drives[2].fail_all();
    workload(&node, &maps, &oracle, 6, 40);
    node.replace_drive(2, 77).unwrap();
    for _ in 0..3 {
        block_on(node.handles[0].rebuild_step(64 << 10)).unwrap();
    }
    let node = node.crash();
    let progress = node.engine.rebuild_progress().expect("the rebuild resumes");
    assert_eq!((progress.drive, progress.segments_done), (2, 0));
    verify_all(&node, &maps, &oracle);
    node.finish_rebuild(1 << 20);
    node.drives[0].fail_all();
    verify_all(&node, &maps, &oracle);
}

#[test]
fn a_corrupt_cell_is_rebuilt_from_parity() {
    let node = Node::format_coded(32, 7, 0, 1, 3, scheme(2, 1));
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let handle = &node.handles[0];
    let (result, _) = block_on(handle.write(map, 0, block_buf(map.volume(), 0, 4, 3)));
    result.unwrap();
    let (drive, offset_bytes) = node.place_of(map, 2);
    let mut bad = AlignedBuf::new(BLOCK_BYTES);
    bad.fill(0x5a);
    block_on(node.drives[usize::from(drive)].write_at(offset_bytes, bad)).0.unwrap();
    let (result, buf) = block_on(handle.read_blocks(map, 0, AlignedBuf::new(4 * BLOCK_BYTES)));
    result.unwrap();
    for (number, block) in (0..4u64).zip(buf.chunks(BLOCK_BYTES)) {
        assert!(block_matches(block, map.volume(), number, 3), "{}", describe_block(block));
    }
    let stats = node.engine.stats();
    assert_eq!(stats.checksum_errors, 1, "the damage is counted");
    assert_eq!(node.engine.counters.repaired_reads.load(Ordering::Relaxed), 1);
}

/// A crash that tears one data cell of a batch recovery keeps (its parity rebuilds it): recovery
/// writes the rebuilt cell back in place, so host reads afterwards find it whole and need no
/// parity, and nothing is counted as a checksum error.
#[test]
fn recovery_writes_back_a_torn_cell_it_rebuilt_from_parity() {
    let node = Node::format_coded(32, 8, 0, 1, 3, scheme(2, 1));
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let (result, _) = block_on(node.handles[0].write(map, 0, block_buf(map.volume(), 0, 4, 5)));
    result.unwrap();
    let (drive, offset_bytes) = node.place_of(map, 1);
    // What a torn write leaves: part new, part stale; made durable, as a crash could keep it.
    let mut torn = AlignedBuf::new(BLOCK_BYTES);
    torn.fill(0xa5);
    let target = &node.drives[usize::from(drive)];
    block_on(target.write_at(offset_bytes, torn)).0.unwrap();
    block_on(target.sync()).unwrap();
    let node = node.crash();
    assert_eq!(node.report.batches_torn, 0, "parity makes the batch whole: {:?}", node.report);
    assert_eq!(node.report.blocks_repaired, 1, "{:?}", node.report);
    let rebuilt = node.drives[usize::from(drive)].durable_bytes(offset_bytes, BLOCK_BYTES as u64);
    assert!(block_matches(&rebuilt, map.volume(), 1, 5), "written back durably");
    let reconstructed = || node.engine.counters.reconstructed_reads.load(Ordering::Relaxed);
    let before = reconstructed();
    let (result, buf) =
        block_on(node.handles[0].read_blocks(map, 0, AlignedBuf::new(4 * BLOCK_BYTES)));
    result.unwrap();
    for (number, block) in (0..4u64).zip(buf.chunks(BLOCK_BYTES)) {
        assert!(block_matches(block, map.volume(), number, 5), "{}", describe_block(block));
    }
    assert_eq!(reconstructed(), before, "reads need no parity once the cell is written back");
    assert_eq!(node.engine.stats().checksum_errors, 0);
}

/// A crash that tears the header cell of a batch recovery keeps (parity rebuilds the header):
/// recovery writes the header back too. And GC, which walks the header chain of segments found
/// by recovery, rebuilds a header cell that went bad later from its stripe instead of taking
/// the segment for damaged and refusing to clean it.
#[test]
fn a_torn_header_cell_is_written_back_and_gc_walks_past_a_bad_one() {
    let node = Node::format_coded(32, 12, 0, 1, 3, scheme(2, 1));
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let (result, _) = block_on(node.handles[0].write(map, 0, block_buf(map.volume(), 0, 4, 5)));
    result.unwrap();
    let geometry = *node.engine.geometry();
    let index = node.engine.index.get(map.volume().0).unwrap();
    let (location, _) = super::index::unpack(index.get(0)).unwrap();
    // Block 0 is the first data block of the only batch: its header is the position before.
    let (segment, data_position) = geometry.split(location);
    let header_position = data_position - 1;
    let (drive, offset_bytes) = geometry.place(segment, header_position);
    // Bad bytes over the header cell, made durable (as a crash could keep a torn write).
    let damage = |node: &Node, fill: u8| {
        let mut bad = AlignedBuf::new(BLOCK_BYTES);
        bad.fill(fill);
        let target = &node.drives[usize::from(drive)];
        block_on(target.write_at(offset_bytes, bad)).0.unwrap();
        block_on(target.sync()).unwrap();
    };
    damage(&node, 0xa5);
    let node = node.crash();
    assert_eq!(node.report.batches_torn, 0, "parity rebuilds the header: {:?}", node.report);
    assert_eq!(node.report.blocks_repaired, 1, "{:?}", node.report);
    let written_back = node.drives[usize::from(drive)].durable_bytes(offset_bytes, BLOCK);
    let decoded =
        super::format::BatchHeader::decode(&written_back, &geometry, segment, header_position);
    assert!(decoded.is_ok(), "the header is written back durably: {decoded:?}");
    // The header cell goes bad again (a stale drive, say); blocks 1..4 are overwritten, so
    // the segment is mostly garbage, and later writes seal it.
    damage(&node, 0x5a);
    let handle = &node.handles[0];
    let (result, _) = block_on(handle.write(map, BLOCK, block_buf(map.volume(), 1, 3, 6)));
    result.unwrap();
    let segment_of_block_0 = || {
        let index = node.engine.index.get(map.volume().0).unwrap();
        geometry.split(super::index::unpack(index.get(0)).unwrap().0).0
    };
    // Overwrite the rest of the volume until space runs low and GC (inline, or a step) takes
    // the segment; a write or a step that finds it damaged fails.
    for round in 0..40u64 {
        if segment_of_block_0() != segment {
            break;
        }
        for first in (100..400u64).step_by(50) {
            let data = block_buf(map.volume(), first, 50, 7 + round);
            let (result, _) = block_on(handle.write(map, first * BLOCK, data));
            result.unwrap_or_else(|error| panic!("write in round {round}: {error}"));
        }
        block_on(handle.gc_step()).unwrap_or_else(|error| panic!("GC failed: {error}"));
    }
    assert_ne!(segment_of_block_0(), segment, "GC relocated the segment's live block");
    let (result, buf) = block_on(handle.read_blocks(map, 0, AlignedBuf::new(4 * BLOCK_BYTES)));
    result.unwrap();
    for (number, block) in (0..4u64).zip(buf.chunks(BLOCK_BYTES)) {
        let generation = if number == 0 { 5 } else { 6 };
        assert!(
            block_matches(block, map.volume(), number, generation),
            "{}",
            describe_block(block)
        );
    }
}

/// Scrub while a replaced drive is being rebuilt: the new drive's cells of the segments not
/// restored yet hold nothing, so the parity of their stripes cannot be judged, and scrub leaves
/// it alone. (Before session 34 it recomputed that parity from the empty cells and wrote it over
/// the good parity on the other drives: the replaced drive's blocks could then not be rebuilt,
/// and read as unrecoverable.) After the rebuild every block reads right, also with another
/// drive lost.
#[test]
fn scrub_beside_a_rebuild_leaves_the_parity_it_cannot_judge() {
    let node = Node::format_coded(64, 13, 2, 1, 3, scheme(2, 1));
    let (_volumes, maps) = volume_maps(&[2000]);
    let oracle = Oracle::new();
    workload(&node, &maps, &oracle, 13, 80);
    // A restart seals the segments written, which scrub then covers.
    let mut node = node.restart();
    node.drives[1].fail_all();
    node.replace_drive(1, 79).unwrap();
    let during = scrub_pass(&node);
    assert!(during.blocks_verified > 100, "{during:?}");
    assert_eq!((during.blocks_damaged, during.parity_damaged), (0, 0), "{during:?}");
    node.finish_rebuild(1 << 20);
    verify_all(&node, &maps, &oracle);
    let after = scrub_pass(&node);
    assert_eq!((after.blocks_damaged, after.parity_damaged), (0, 0), "{after:?}");
    node.drives[0].fail_all();
    verify_all(&node, &maps, &oracle);
}

/// One whole scrub pass from a new cursor on handle 0: the sum of its steps' counts.
fn scrub_pass(node: &Node) -> super::ScrubProgress {
    let mut cursor = super::ScrubCursor::new();
    let mut total = super::ScrubProgress::default();
    for _ in 0..10_000 {
        let progress = block_on(node.handles[0].scrub_step(&mut cursor, 4096)).unwrap();
        total.blocks_verified += progress.blocks_verified;
        total.blocks_damaged += progress.blocks_damaged;
        total.blocks_repaired += progress.blocks_repaired;
        total.chains_damaged += progress.chains_damaged;
        total.headers_damaged += progress.headers_damaged;
        total.headers_repaired += progress.headers_repaired;
        total.parity_damaged += progress.parity_damaged;
        total.parity_repaired += progress.parity_repaired;
        if progress.pass_completed {
            return total;
        }
    }
    panic!("a scrub pass does not end");
}

/// Scrub on a coded log meets a batch header cell that does not decode with live blocks after
/// it: it rebuilds the header from its stripe, writes it back, verifies the batch's blocks and
/// the rest of the chain (rather than reporting the chain broken), and the next pass is clean.
#[test]
fn scrub_rebuilds_a_bad_header_cell_and_walks_on() {
    let node = Node::format_coded(32, 11, 0, 1, 3, scheme(2, 1));
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    // Two batches in one segment: damage the first one's header, the chain goes on after it.
    for first in [0, 8u64] {
        let data = block_buf(map.volume(), first, 8, 6);
        let (result, _) = block_on(node.handles[0].write(map, first * BLOCK, data));
        result.unwrap();
    }
    // A restart seals the segment, which scrub then covers.
    let node = node.restart();
    let geometry = *node.engine.geometry();
    let index = node.engine.index.get(map.volume().0).unwrap();
    let place = |number: u64| geometry.split(super::index::unpack(index.get(number)).unwrap().0);
    let (segment, data_position) = place(0);
    assert_eq!(place(15).0, segment, "both batches are in one segment");
    // Block 0 is the first data block of its batch: its header is the position before.
    let header_position = data_position - 1;
    let (drive, offset_bytes) = geometry.place(segment, header_position);
    let mut bad = AlignedBuf::new(BLOCK_BYTES);
    bad.fill(0xa5);
    block_on(node.drives[usize::from(drive)].write_at(offset_bytes, bad)).0.unwrap();
    let pass = || scrub_pass(&node);
    let first = pass();
    assert_eq!((first.headers_damaged, first.headers_repaired), (1, 1), "{first:?}");
    assert_eq!(first.chains_damaged + first.blocks_damaged, 0, "{first:?}");
    assert!(first.blocks_verified >= 16, "every live block is verified: {first:?}");
    let written_back = node.drives[usize::from(drive)].durable_bytes(offset_bytes, BLOCK);
    let decoded =
        super::format::BatchHeader::decode(&written_back, &geometry, segment, header_position);
    assert!(decoded.is_ok(), "the header is written back durably: {decoded:?}");
    let findings = node.engine.scrub_findings();
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert_eq!(findings[0].damage, super::ScrubDamage::Header { segment });
    assert_eq!(findings[0].location, geometry.location(segment, header_position));
    assert_eq!((findings[0].drive, findings[0].repaired), (drive, true));
    let second = pass();
    assert_eq!(second.headers_damaged + second.chains_damaged + second.blocks_damaged, 0);
    assert!(second.blocks_verified >= 16, "{second:?}");
}

/// Two of three drives lost under 2+1: blocks on the surviving drive still read, every other
/// block is an error (never wrong data), and writes are refused.
#[test]
fn losing_more_drives_than_the_parity_is_an_error_on_exactly_the_data_affected() {
    let node = Node::format_coded(32, 9, 0, 1, 3, scheme(2, 1));
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let handle = &node.handles[0];
    let (result, _) = block_on(handle.write(map, 0, block_buf(map.volume(), 0, 64, 4)));
    result.unwrap();
    node.drives[0].fail_all();
    node.drives[1].fail_all();
    let index = node.engine.index.get(map.volume().0).unwrap();
    let (mut readable, mut unreadable) = (0, 0);
    for number in 0..64u64 {
        let (location, _) = super::index::unpack(index.get(number)).unwrap();
        let (segment, position) = node.engine.geometry.split(location);
        let drive = node.engine.geometry.place(segment, position).0;
        let (result, block) =
            block_on(handle.read(map, number * BLOCK, AlignedBuf::new(BLOCK_BYTES)));
        if drive == 2 {
            result.unwrap_or_else(|error| panic!("block {number} on the live drive: {error}"));
            assert!(block_matches(&block, map.volume(), number, 4));
            readable += 1;
        } else {
            assert!(
                result.is_err(),
                "block {number} on a dead drive read as {}",
                describe_block(&block)
            );
            unreadable += 1;
        }
    }
    assert!(readable > 0 && unreadable > 0, "{readable} {unreadable}");
    let (result, _) = block_on(handle.write(map, 100 * BLOCK, block_buf(map.volume(), 100, 1, 5)));
    assert!(result.is_err(), "writes are refused beyond the parity");
    assert!(node.engine.counters.unrecoverable_reads.load(Ordering::Relaxed) > 0);
    assert!(matches!(
        block_on(node.handles[0].begin_replace(0, node.drives[0].clone())),
        Err(LogError::ReplaceRefused { .. })
    ));
}

/// Scrub on a coded log finds a damaged block and a damaged parity cell, rewrites both from
/// their stripes, finds nothing on the next pass, and the repaired parity rebuilds a lost drive.
#[test]
fn scrub_repairs_damaged_blocks_and_parity_in_place() {
    let node = Node::format_coded(32, 11, 0, 1, 3, scheme(2, 1));
    let (_volumes, maps) = volume_maps(&[1000]);
    let map = &maps[0];
    let (result, _) = block_on(node.handles[0].write(map, 0, block_buf(map.volume(), 0, 64, 6)));
    result.unwrap();
    // A restart seals the segment, which scrub then covers.
    let node = node.restart();
    let geometry = *node.engine.geometry();
    let index = node.engine.index.get(map.volume().0).unwrap();
    let place = |number: u64| {
        let (location, _) = super::index::unpack(index.get(number)).unwrap();
        geometry.split(location)
    };
    let garbage = || {
        let mut bad = AlignedBuf::new(BLOCK_BYTES);
        bad.fill(0xa5);
        bad
    };
    let (segment, position) = place(2);
    let (drive, offset_bytes) = geometry.place(segment, position);
    block_on(node.drives[usize::from(drive)].write_at(offset_bytes, garbage())).0.unwrap();
    let (parity_segment, parity_position) = place(40);
    let stripe = parity_position / u32::from(geometry.data_shards);
    let (parity_drive, row) =
        geometry.cell_drive_row(geometry.cell(stripe, u32::from(geometry.data_shards)));
    let parity_offset = geometry.row_offset_bytes(parity_segment, row);
    block_on(node.drives[usize::from(parity_drive)].write_at(parity_offset, garbage())).0.unwrap();
    let pass = || scrub_pass(&node);
    let first = pass();
    assert_eq!((first.blocks_damaged, first.blocks_repaired), (1, 1), "{first:?}");
    assert_eq!((first.parity_damaged, first.parity_repaired), (1, 1), "{first:?}");
    let second = pass();
    assert_eq!(second.blocks_damaged + second.parity_damaged, 0, "{second:?}");
    assert!(second.blocks_verified >= 64);
    let findings = node.engine.scrub_findings();
    assert!(findings.iter().all(|finding| finding.repaired), "{findings:?}");
    // The rewritten parity is right: lose the drive holding block 40 and read it rebuilt.
    let lost = geometry.place(parity_segment, parity_position).0;
    node.drives[usize::from(lost)].fail_all();
    let (result, buf) =
        block_on(node.handles[0].read_blocks(map, 0, AlignedBuf::new(64 * BLOCK_BYTES)));
    result.unwrap();
    for (number, block) in (0..64u64).zip(buf.chunks(BLOCK_BYTES)) {
        assert!(
            block_matches(block, map.volume(), number, 6),
            "block {number}: {}",
            describe_block(block)
        );
    }
}
