//! Tests of the chunk store over simulated drives: the conformance check, the group-commit
//! ordering rule, failure latching with injected faults, and crashes at random points.

use std::cell::RefCell;
use std::future::Future;
use std::pin::pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use types::AlignedBuf;

use super::*;
use crate::format::HEADER_REGION_BYTES;
use crate::layout::{VolumeId, Volumes};
use crate::testing::{
    block_on, check_store, create_volume, join_all, run_polls, run_writer, verify_volume,
    CheckConfig, CheckReport, LocalBoxFuture, Oracle, Rng, SimDrive, SimEvent, Stopped,
    WriterContext,
};

const BLOCK: u64 = 4096;

fn sim_drives(count: u16, chunks_per_drive: u64, seed: u64, yields_max: u64) -> Vec<SimDrive> {
    let size_bytes = HEADER_REGION_BYTES + chunks_per_drive * CHUNK_SIZE_BYTES;
    (0..count)
        .map(|index| {
            SimDrive::new(index, size_bytes, seed.rotate_left(8) ^ u64::from(index), yields_max)
        })
        .collect()
}

fn filled(byte: u8, length_bytes: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::new(length_bytes as usize);
    buf.fill(byte);
    buf
}

#[test]
fn conformance_over_simulated_drives() {
    for seed in 0..3 {
        let drives = sim_drives(3, 6, seed, 3);
        let store = ChunkStore::new(drives.clone());
        let volumes = Volumes::new(3, 6);
        let config = CheckConfig { seed, ..CheckConfig::default() };
        let report: CheckReport = block_on(check_store(&store, &volumes, &config));
        assert!(report.blocks_verified > 1000, "{report:?}");
        let writes: u64 = drives.iter().map(|drive| drive.stats().writes).sum();
        let syncs: u64 = drives.iter().map(|drive| drive.stats().syncs).sum();
        assert!(
            syncs < writes,
            "concurrent writers share syncs: {syncs} syncs for {writes} writes"
        );
        assert!(store.failed_drives().is_empty());
    }
}

#[test]
fn acknowledges_only_after_a_sync_that_started_after_the_write() {
    let events = Rc::new(RefCell::new(Vec::new()));
    let drives = sim_drives(2, 2, 7, 4);
    for drive in &drives {
        drive.record_events(Rc::clone(&events));
    }
    let store = ChunkStore::new(drives.clone());
    let volumes = Volumes::new(2, 2);
    let map = block_on(create_volume(&store, &volumes, VolumeId(1), 2 * CHUNK_SIZE_BYTES));
    events.borrow_mut().clear();
    let writers: Vec<LocalBoxFuture<'_, ()>> = (0..16u64)
        .map(|writer| {
            let (store, map, events) = (&store, &map, &events);
            let future: LocalBoxFuture<'_, ()> = Box::pin(async move {
                for write in 0..20u64 {
                    // Writers alternate between the two chunks, so both drives see traffic.
                    let offset_bytes =
                        (write % 2) * CHUNK_SIZE_BYTES + (writer * 100 + write) * BLOCK;
                    let piece = map.pieces(offset_bytes, BLOCK).unwrap().next().unwrap();
                    let (result, _) = store.write(map, offset_bytes, filled(1, BLOCK)).await;
                    result.unwrap();
                    let acked = SimEvent::Acked {
                        drive: piece.drive,
                        offset_bytes: piece.drive_offset_bytes,
                    };
                    events.borrow_mut().push(acked);
                }
            });
            future
        })
        .collect();
    block_on(join_all(writers));

    let events = events.borrow();
    let mut in_flight = [None::<usize>; 2];
    let mut syncs: Vec<Vec<(usize, usize)>> = vec![Vec::new(), Vec::new()];
    for (position, event) in events.iter().enumerate() {
        match *event {
            SimEvent::SyncStarted { drive } => {
                let slot = &mut in_flight[usize::from(drive)];
                assert!(slot.is_none(), "two syncs in flight on drive {drive}");
                *slot = Some(position);
            }
            SimEvent::SyncDone { drive } => {
                let started = in_flight[usize::from(drive)].take().expect("a sync was started");
                syncs[usize::from(drive)].push((started, position));
            }
            _ => {}
        }
    }
    let mut acked = 0;
    for (position, event) in events.iter().enumerate() {
        let SimEvent::Acked { drive, offset_bytes } = *event else { continue };
        let written = events
            .iter()
            .position(|e| *e == SimEvent::WriteDone { drive, offset_bytes })
            .expect("the write completed before its ack");
        assert!(written < position);
        let covered = syncs[usize::from(drive)]
            .iter()
            .any(|&(started, done)| started > written && done < position);
        assert!(
            covered,
            "write at {offset_bytes} on drive {drive} acknowledged without a later sync"
        );
        acked += 1;
    }
    assert_eq!(acked, 16 * 20);
    let sync_count: usize = syncs.iter().map(Vec::len).sum();
    assert!(sync_count < acked / 2, "group commit shares syncs: {sync_count} syncs for {acked}");
}

#[test]
fn a_failed_write_or_sync_latches_the_drive() {
    let drives = sim_drives(2, 2, 3, 0);
    let store = ChunkStore::new(drives.clone());
    let volumes = Volumes::new(2, 2);
    let map = block_on(create_volume(&store, &volumes, VolumeId(1), 2 * CHUNK_SIZE_BYTES));
    let first = map.chunk(0).unwrap().drive;
    let second = map.chunk(1).unwrap().drive;
    assert_ne!(first, second);

    drives[usize::from(first)].fail_write_after(1);
    let (result, _) = block_on(store.write(&map, 0, filled(1, BLOCK)));
    assert!(matches!(result, Err(StoreError::Io { drive, .. }) if drive == first), "{result:?}");
    assert_eq!(store.failed_drives(), [first]);

    let untouched = drives[usize::from(first)].stats();
    let (result, _) = block_on(store.write(&map, 0, filled(1, BLOCK)));
    let error = result.unwrap_err();
    assert!(matches!(error, StoreError::DriveFailed { drive } if drive == first));
    assert!(error.to_string().contains("latched failed"), "{error}");
    let (result, _) = block_on(store.read(&map, 0, filled(0, BLOCK)));
    assert!(matches!(result, Err(StoreError::DriveFailed { .. })));
    assert!(matches!(
        block_on(store.write_zeroes(&map, 0, BLOCK)),
        Err(StoreError::DriveFailed { .. })
    ));
    // A write across the boundary fails at its first piece, on the failed drive.
    let (result, _) = block_on(store.write(&map, CHUNK_SIZE_BYTES - BLOCK, filled(2, 2 * BLOCK)));
    assert!(matches!(result, Err(StoreError::DriveFailed { .. })));
    assert_eq!(drives[usize::from(first)].stats(), untouched, "no I/O reaches a latched drive");

    // The other drive still works, until a sync fails on it.
    let (result, _) = block_on(store.write(&map, CHUNK_SIZE_BYTES, filled(3, BLOCK)));
    result.unwrap();
    drives[usize::from(second)].fail_sync_after(1);
    let (result, _) = block_on(store.write(&map, CHUNK_SIZE_BYTES, filled(4, BLOCK)));
    assert!(matches!(result, Err(StoreError::Io { drive, .. }) if drive == second), "{result:?}");
    assert_eq!(store.failed_drives(), [first.min(second), first.max(second)]);
    // The acknowledged write is durable.
    let piece = map.pieces(CHUNK_SIZE_BYTES, BLOCK).unwrap().next().unwrap();
    let durable = drives[usize::from(second)].durable_bytes(piece.drive_offset_bytes, BLOCK);
    assert!(durable.iter().all(|b| *b == 3));
}

#[test]
fn latches_are_shared_between_stores() {
    let drives = sim_drives(2, 1, 4, 0);
    let first = ChunkStore::new(drives.clone());
    let second = ChunkStore::with_latches(drives.clone(), Arc::clone(first.latches()));
    let volumes = Volumes::new(2, 1);
    let map = block_on(create_volume(&first, &volumes, VolumeId(1), CHUNK_SIZE_BYTES));
    let drive = map.chunk(0).unwrap().drive;
    drives[usize::from(drive)].fail_sync_after(1);
    assert!(block_on(first.write(&map, 0, filled(1, BLOCK))).0.is_err());
    let (result, _) = block_on(second.read(&map, 0, filled(0, BLOCK)));
    assert!(matches!(result, Err(StoreError::DriveFailed { .. })), "{result:?}");
}

#[test]
fn a_dropped_sync_leader_hands_over() {
    let mut scenarios = 0;
    for seed in 0..20 {
        let drives = sim_drives(1, 1, seed, 20);
        let store = ChunkStore::new(drives.clone());
        let volumes = Volumes::new(1, 1);
        let map = block_on(create_volume(&store, &volumes, VolumeId(1), CHUNK_SIZE_BYTES));
        let syncs_before = drives[0].stats().syncs;
        let mut context = Context::from_waker(Waker::noop());
        let mut leader = Box::pin(store.write(&map, 0, filled(1, BLOCK)));
        // Poll the first writer until it leads a sync that is still in flight.
        let mut leading = false;
        for _ in 0..200 {
            if leader.as_mut().poll(&mut context).is_ready() {
                break;
            }
            if drives[0].stats().syncs == syncs_before + 1 {
                leading = true;
                break;
            }
        }
        if !leading {
            continue;
        }
        let mut follower = pin!(store.write(&map, BLOCK, filled(2, BLOCK)));
        let mut waiting = false;
        for _ in 0..200 {
            if let Poll::Ready((result, _)) = follower.as_mut().poll(&mut context) {
                result.unwrap();
                break;
            }
            if drives[0].stats().writes == 2 && store.commits[0].finished.waiter_count() == 1 {
                waiting = true;
                break;
            }
        }
        if !waiting {
            continue;
        }
        drop(leader);
        let (result, _) = block_on(follower);
        result.unwrap();
        assert_eq!(drives[0].stats().syncs, syncs_before + 2, "the follower led a new sync");
        assert!(drives[0]
            .durable_bytes(chunk_offset_bytes(0) + BLOCK, BLOCK)
            .iter()
            .all(|b| *b == 2));
        scenarios += 1;
    }
    assert!(scenarios > 3, "the scenario was reached {scenarios} times");
}

#[test]
fn acknowledged_writes_survive_crashes_at_random_points() {
    let mut interrupted = 0;
    let mut verified = 0;
    for seed in 0..40 {
        let mut rng = Rng::new(seed ^ 0xc4a5);
        let drives = sim_drives(3, 3, seed, 3);
        let store = ChunkStore::new(drives.clone());
        let volumes = Volumes::new(3, 3);
        let size_bytes = 2 * CHUNK_SIZE_BYTES + 500 * BLOCK;
        let map = block_on(create_volume(&store, &volumes, VolumeId(1), size_bytes));
        let oracle = Oracle::new();
        let report = RefCell::new(CheckReport::default());
        let progress = LocalNotify::new();
        let context = WriterContext {
            store: &store,
            map: &map,
            oracle: &oracle,
            report: &report,
            progress: &progress,
            tolerate_errors: false,
            io_blocks_max: 8,
        };
        let writers = 6;
        let futures: Vec<LocalBoxFuture<'_, ()>> = (0..writers)
            .map(|writer| {
                let future: LocalBoxFuture<'_, ()> = Box::pin(run_writer(
                    &context,
                    writer,
                    writers,
                    seed * 100 + writer as u64,
                    1000,
                ));
                future
            })
            .collect();
        match run_polls(join_all(futures), 1 + rng.below(4000)) {
            Ok(_) => {}
            Err(Stopped::PollsExhausted) => interrupted += 1,
            Err(Stopped::Stalled) => panic!("the writers stalled"),
        }
        for drive in &drives {
            drive.crash();
        }
        // Restart: a new store over what the drives kept; the layout comes from metadata.
        let restarted = ChunkStore::new(drives.clone());
        verified += block_on(verify_volume(&restarted, &map, &oracle));
        let acknowledged =
            oracle.touched(VolumeId(1)).iter().filter(|(_, tag)| tag.is_some()).count();
        assert!(acknowledged > 0 || report.borrow().writes == 0);
    }
    assert!(interrupted > 30, "most runs are cut short by the crash: {interrupted}");
    assert!(verified > 0);
}

#[test]
fn injected_faults_lose_no_acknowledged_write() {
    let mut fired = 0;
    for seed in 0..24 {
        let mut rng = Rng::new(seed ^ 0xfa17);
        let drives = sim_drives(3, 1, seed, 2);
        let store = ChunkStore::new(drives.clone());
        let volumes = Volumes::new(3, 1);
        let map = block_on(create_volume(&store, &volumes, VolumeId(1), 3 * CHUNK_SIZE_BYTES));
        let faulty = rng.below(3) as u16;
        let countdown = 1 + rng.below(40);
        if rng.chance(1, 2) {
            drives[usize::from(faulty)].fail_write_after(countdown);
        } else {
            drives[usize::from(faulty)].fail_sync_after(countdown);
        }
        let oracle = Oracle::new();
        let report = RefCell::new(CheckReport::default());
        let progress = LocalNotify::new();
        let context = WriterContext {
            store: &store,
            map: &map,
            oracle: &oracle,
            report: &report,
            progress: &progress,
            tolerate_errors: true,
            io_blocks_max: 8,
        };
        let futures: Vec<LocalBoxFuture<'_, ()>> = (0..4)
            .map(|writer| {
                let future: LocalBoxFuture<'_, ()> =
                    Box::pin(run_writer(&context, writer, 4, seed * 10 + writer as u64, 150));
                future
            })
            .collect();
        block_on(join_all(futures));

        if drives[usize::from(faulty)].stats().faults_injected > 0 {
            fired += 1;
            assert_eq!(store.failed_drives(), [faulty]);
            assert!(report.borrow().failed_operations > 0);
            let chunk_number = (0..3).find(|n| map.chunk(*n).unwrap().drive == faulty).unwrap();
            let offset_bytes = chunk_number * CHUNK_SIZE_BYTES;
            let untouched = drives[usize::from(faulty)].stats();
            let (result, _) = block_on(store.write(&map, offset_bytes, filled(9, BLOCK)));
            assert!(matches!(result, Err(StoreError::DriveFailed { .. })), "{result:?}");
            let (result, _) = block_on(store.read(&map, offset_bytes, filled(0, BLOCK)));
            assert!(matches!(result, Err(StoreError::DriveFailed { .. })), "{result:?}");
            assert_eq!(drives[usize::from(faulty)].stats(), untouched);
        } else {
            assert!(store.failed_drives().is_empty());
        }
        for drive in &drives {
            drive.crash();
        }
        let restarted = ChunkStore::new(drives.clone());
        block_on(verify_volume(&restarted, &map, &oracle));
    }
    assert!(fired > 12, "the fault fired in {fired} runs");
}

#[test]
fn flush_and_empty_io() {
    let drives = sim_drives(1, 1, 5, 1);
    let store = ChunkStore::new(drives.clone());
    let volumes = Volumes::new(1, 1);
    let map = block_on(create_volume(&store, &volumes, VolumeId(1), CHUNK_SIZE_BYTES));
    block_on(store.flush(&map)).unwrap();
    let mut empty = AlignedBuf::new(4096);
    empty.set_len(0);
    let (result, _) = block_on(store.write(&map, 0, empty));
    result.unwrap();
    let (result, _) = block_on(store.read(&map, CHUNK_SIZE_BYTES, filled(0, BLOCK)));
    assert!(matches!(result, Err(StoreError::OutOfRange { .. })), "{result:?}");
    volumes.remove(VolumeId(1));
    assert!(matches!(block_on(store.flush(&map)), Err(StoreError::VolumeRemoved { .. })));
}
