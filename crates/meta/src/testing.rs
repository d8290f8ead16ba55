//! The conformance suite every [`MetaStore`] implementation must pass.
//!
//! One suite for every backend (embedded and etcd) keeps them interchangeable: the control
//! plane's behaviour may not depend on where metadata lives. The suite panics with a message on
//! the first violation, like any test. [`EtcdServer`] runs a private etcd for the etcd store's
//! tests, here and in other crates.

mod etcd_server;

pub use etcd_server::{etcd_data_dir, EtcdServer};

use crate::{
    Compression, HostAccess, MetaError, MetaStore, NodeRecord, PathState, SnapshotRecord,
    VolumeOrigin, VolumeRecord,
};
use std::collections::BTreeSet;
use std::sync::Barrier;
use types::{Nqn, VolumeName};

/// How many times each race of [`check_concurrent_writers`] is run.
const RACE_ROUNDS: usize = 8;
/// How many volume ids each writer allocates in the allocation race.
const RACE_IDS_PER_WRITER: usize = 50;

/// Checks the [`MetaStore`] contract on `store`, which must be empty.
pub fn check_store(store: &dyn MetaStore) {
    check_empty(store);
    check_node(store);
    check_ids(store);
    check_volumes(store);
    check_snapshots(store);
}

fn name(name: &str) -> VolumeName {
    VolumeName::new(name).expect("the suite uses valid names")
}

fn record(store: &dyn MetaStore, volume: &str, size_bytes: u64) -> VolumeRecord {
    let id = store.allocate_volume_id().expect("allocate a volume id");
    VolumeRecord {
        id,
        name: name(volume),
        size_bytes,
        uuid: [id as u8; 16],
        created_unix_ms: 1_700_000_000_000 + id,
        chunks: (0..3).map(|index| (index as u16, index + id as u32)).collect(),
        host_access: HostAccess::Open,
        origin: None,
        // Every setting, so that each store round-trips each one.
        compression: Compression::ALL[id as usize % Compression::ALL.len()],
        // Every other record with hand-set path states, so each store round-trips them too.
        path_states: if id % 2 == 0 {
            [(1, PathState::Inaccessible), (3, PathState::NonOptimized)].into()
        } else {
            Default::default()
        },
    }
}

fn check_empty(store: &dyn MetaStore) {
    assert_eq!(store.revision().expect("revision"), 0, "an empty store is at revision 0");
    assert_eq!(store.node().expect("node"), None, "an empty store has no node record");
    assert_eq!(store.volumes().expect("volumes"), vec![], "an empty store has no volumes");
    assert_eq!(store.volume(&name("none")).expect("volume"), None);
}

fn check_node(store: &dyn MetaStore) {
    let before = store.revision().expect("revision");
    let node = NodeRecord {
        uuid: [7; 16],
        drive_count: 4,
        drive_size_bytes: 16 << 30,
        created_unix_ms: 1_700_000_000_000,
        external_drives: true,
    };
    let revision = store.put_node(&node).expect("put_node");
    assert!(revision > before, "put_node advances the revision");
    assert_eq!(store.revision().expect("revision"), revision);
    assert_eq!(store.node().expect("node"), Some(node.clone()));

    let replaced = NodeRecord { drive_count: 8, ..node };
    store.put_node(&replaced).expect("put_node again");
    assert_eq!(store.node().expect("node"), Some(replaced));
}

fn check_ids(store: &dyn MetaStore) {
    let first = store.allocate_volume_id().expect("allocate");
    let second = store.allocate_volume_id().expect("allocate");
    assert!(first > 0, "volume id 0 is never allocated");
    assert!(second > first, "volume ids increase: {first} then {second}");
}

fn check_volumes(store: &dyn MetaStore) {
    let revision_start = store.revision().expect("revision");

    // Create, in an order different from the names' order.
    let beta = record(store, "beta", 2 << 20);
    let alpha = record(store, "alpha", 1 << 20);
    let gamma = record(store, "gamma", 3 << 20);
    let mut last_revision = revision_start;
    for volume in [&beta, &alpha, &gamma] {
        let revision = store.create_volume(volume).expect("create_volume");
        assert!(revision > last_revision, "create_volume advances the revision");
        last_revision = revision;
    }
    assert_eq!(store.volume(&alpha.name).expect("volume"), Some(alpha.clone()));
    assert_eq!(
        store.volumes().expect("volumes"),
        vec![alpha.clone(), beta.clone(), gamma.clone()],
        "volumes are listed by name"
    );
    assert_eq!(store.revision().expect("revision"), last_revision, "reads keep the revision");

    // A taken name is refused, and the refusal changes nothing.
    let duplicate = record(store, "alpha", 5 << 20);
    match store.create_volume(&duplicate) {
        Err(MetaError::VolumeExists(taken)) => assert_eq!(taken, alpha.name),
        other => panic!("creating a duplicate name must fail with VolumeExists: {other:?}"),
    }
    assert_eq!(store.volume(&alpha.name).expect("volume"), Some(alpha.clone()));
    assert_eq!(store.revision().expect("revision"), last_revision, "failed writes change nothing");

    // Update.
    let mut grown = beta.clone();
    grown.size_bytes = 4 << 20;
    grown.chunks.push((9, 9));
    let revision = store.update_volume(&grown).expect("update_volume");
    assert!(revision > last_revision, "update_volume advances the revision");
    assert_eq!(store.volume(&beta.name).expect("volume"), Some(grown.clone()));

    // Host access is kept, both restricted and open again.
    let host = Nqn::new("nqn.2014-08.org.nvmexpress:uuid:1").expect("the suite uses valid NQNs");
    let restricted = VolumeRecord { host_access: HostAccess::Restricted([host].into()), ..grown };
    let revision = store.update_volume(&restricted).expect("update_volume");
    assert!(revision > last_revision, "update_volume advances the revision");
    last_revision = revision;
    assert_eq!(store.volume(&beta.name).expect("volume"), Some(restricted.clone()));
    let nobody =
        VolumeRecord { host_access: HostAccess::Restricted(Default::default()), ..restricted };
    store.update_volume(&nobody).expect("update_volume");
    assert_eq!(store.volume(&beta.name).expect("volume"), Some(nobody.clone()));
    let grown = VolumeRecord { host_access: HostAccess::Open, ..nobody };
    let revision = store.update_volume(&grown).expect("update_volume");
    assert!(revision > last_revision, "update_volume advances the revision");
    last_revision = revision;
    assert_eq!(store.volume(&beta.name).expect("volume"), Some(grown.clone()));

    // Updating an unknown volume, or a volume under a stale id, is refused.
    let unknown = VolumeRecord { name: name("unknown"), ..grown.clone() };
    assert!(matches!(store.update_volume(&unknown), Err(MetaError::VolumeNotFound(_))));
    let stale = VolumeRecord { id: gamma.id, ..grown.clone() };
    assert!(matches!(store.update_volume(&stale), Err(MetaError::VolumeNotFound(_))));
    assert_eq!(store.volume(&beta.name).expect("volume"), Some(grown.clone()));
    assert_eq!(store.revision().expect("revision"), last_revision, "failed writes change nothing");

    // Delete returns the last record.
    let deleted = store.delete_volume(&beta.name).expect("delete_volume");
    assert_eq!(deleted, grown);
    assert!(store.revision().expect("revision") > last_revision, "delete advances the revision");
    assert_eq!(store.volume(&beta.name).expect("volume"), None);
    assert!(matches!(store.delete_volume(&beta.name), Err(MetaError::VolumeNotFound(_))));
    assert_eq!(store.volumes().expect("volumes"), vec![alpha.clone(), gamma.clone()]);

    // A name freed by a delete can be used again, under a new id.
    let again = record(store, "beta", 1 << 20);
    assert!(again.id > gamma.id, "ids are never reused");
    store.create_volume(&again).expect("create a deleted name again");
    assert_eq!(store.volume(&again.name).expect("volume"), Some(again.clone()));
    assert!(
        matches!(store.update_volume(&grown), Err(MetaError::VolumeNotFound(_))),
        "the old volume's record must not overwrite the new volume of the same name"
    );

    for volume in [&alpha, &again, &gamma] {
        store.delete_volume(&volume.name).expect("delete_volume");
    }
    assert_eq!(store.volumes().expect("volumes"), vec![]);
}

fn snapshot_record(store: &dyn MetaStore, volume: &VolumeName, snapshot: &str) -> SnapshotRecord {
    let id = store.allocate_volume_id().expect("allocate a snapshot id");
    SnapshotRecord {
        id,
        volume: volume.clone(),
        name: name(snapshot),
        size_bytes: 1 << 20,
        uuid: [(id as u8).wrapping_add(100); 16],
        created_unix_ms: 1_700_000_000_000 + id,
    }
}

/// Checks snapshot records: scoped to their volume, listed oldest first, refused for a missing
/// volume or a taken name in the same transaction that would store them. Leaves no volume and
/// no snapshot behind.
fn check_snapshots(store: &dyn MetaStore) {
    // Volume names where one is a prefix of the other, so that a listing by key prefix that
    // forgets the separator shows up.
    let parent = record(store, "parent", 1 << 20);
    let other = record(store, "parent-2", 1 << 20);
    for volume in [&parent, &other] {
        store.create_volume(volume).expect("create_volume");
    }
    assert_eq!(store.snapshots(&parent.name).expect("snapshots"), vec![]);
    assert_eq!(store.all_snapshots().expect("all_snapshots"), vec![]);
    assert_eq!(store.snapshot(&parent.name, &name("none")).expect("snapshot"), None);
    assert_eq!(store.snapshots(&name("missing")).expect("snapshots"), vec![]);

    // Created in an order different from the names' order: listed by creation.
    let zeta = snapshot_record(store, &parent.name, "zeta");
    let alpha = snapshot_record(store, &parent.name, "alpha");
    let mut last_revision = store.revision().expect("revision");
    for snapshot in [&zeta, &alpha] {
        let revision = store.create_snapshot(snapshot).expect("create_snapshot");
        assert!(revision > last_revision, "create_snapshot advances the revision");
        last_revision = revision;
    }
    assert_eq!(store.revision().expect("revision"), last_revision);
    assert_eq!(store.snapshot(&parent.name, &zeta.name).expect("snapshot"), Some(zeta.clone()));
    assert_eq!(
        store.snapshots(&parent.name).expect("snapshots"),
        vec![zeta.clone(), alpha.clone()],
        "a volume's snapshots are listed oldest first"
    );
    assert_eq!(store.revision().expect("revision"), last_revision, "reads keep the revision");

    // Snapshot names are scoped to their volume.
    let other_zeta = snapshot_record(store, &other.name, "zeta");
    last_revision = store.create_snapshot(&other_zeta).expect("same name on another volume");
    assert_eq!(
        store.snapshots(&parent.name).expect("snapshots"),
        vec![zeta.clone(), alpha.clone()]
    );
    assert_eq!(store.snapshots(&other.name).expect("snapshots"), vec![other_zeta.clone()]);
    assert_eq!(
        store.snapshot(&other.name, &zeta.name).expect("snapshot"),
        Some(other_zeta.clone())
    );
    assert_eq!(store.snapshot(&other.name, &alpha.name).expect("snapshot"), None);
    assert_eq!(
        store.all_snapshots().expect("all_snapshots"),
        vec![zeta.clone(), alpha.clone(), other_zeta.clone()],
        "all snapshots, by volume name, then oldest first"
    );

    // A taken name is refused, and the refusal changes nothing.
    let duplicate =
        SnapshotRecord { size_bytes: 2 << 20, ..snapshot_record(store, &parent.name, "zeta") };
    match store.create_snapshot(&duplicate) {
        Err(MetaError::SnapshotExists { volume, snapshot }) => {
            assert_eq!((volume, snapshot), (parent.name.clone(), zeta.name.clone()));
        }
        other => panic!("a duplicate snapshot name must fail with SnapshotExists: {other:?}"),
    }
    assert_eq!(store.snapshot(&parent.name, &zeta.name).expect("snapshot"), Some(zeta.clone()));
    assert_eq!(store.revision().expect("revision"), last_revision, "failed writes change nothing");

    // A snapshot of a missing volume is refused.
    let orphan = snapshot_record(store, &name("missing"), "zeta");
    match store.create_snapshot(&orphan) {
        Err(MetaError::VolumeNotFound(volume)) => assert_eq!(volume, orphan.volume),
        other => panic!("a snapshot of a missing volume must fail with VolumeNotFound: {other:?}"),
    }
    assert_eq!(store.snapshot(&orphan.volume, &orphan.name).expect("snapshot"), None);
    assert_eq!(store.revision().expect("revision"), last_revision, "failed writes change nothing");

    // An id the store never allocated is refused.
    let unallocated = SnapshotRecord { id: 0, ..snapshot_record(store, &parent.name, "beta") };
    assert!(store.create_snapshot(&unallocated).is_err(), "snapshot id 0 is never allocated");
    assert_eq!(store.snapshot(&parent.name, &unallocated.name).expect("snapshot"), None);

    // A clone remembers its origin, and keeps it once the parent and its snapshot are gone.
    let clone = VolumeRecord {
        origin: Some(VolumeOrigin {
            volume: parent.name.clone(),
            snapshot: zeta.name.clone(),
            snapshot_id: zeta.id,
        }),
        ..record(store, "clone", 1 << 20)
    };
    store.create_volume(&clone).expect("create a clone");
    assert_eq!(store.volume(&clone.name).expect("volume"), Some(clone.clone()));
    assert!(store.volumes().expect("volumes").contains(&clone));
    let updated = VolumeRecord { size_bytes: 2 << 20, ..clone.clone() };
    store.update_volume(&updated).expect("update a clone");
    assert_eq!(store.volume(&clone.name).expect("volume"), Some(updated.clone()));

    // Delete returns the last record.
    last_revision = store.revision().expect("revision");
    let deleted = store.delete_snapshot(&parent.name, &zeta.name).expect("delete_snapshot");
    assert_eq!(deleted, zeta);
    let revision = store.revision().expect("revision");
    assert!(revision > last_revision, "delete_snapshot advances the revision");
    assert_eq!(store.snapshot(&parent.name, &zeta.name).expect("snapshot"), None);
    assert!(matches!(
        store.delete_snapshot(&parent.name, &zeta.name),
        Err(MetaError::SnapshotNotFound { .. })
    ));
    assert!(matches!(
        store.delete_snapshot(&name("missing"), &zeta.name),
        Err(MetaError::SnapshotNotFound { .. })
    ));
    assert_eq!(store.revision().expect("revision"), revision, "failed writes change nothing");
    assert_eq!(store.snapshots(&parent.name).expect("snapshots"), vec![alpha.clone()]);
    assert_eq!(store.snapshots(&other.name).expect("snapshots"), vec![other_zeta.clone()]);

    // A name freed by a delete can be used again, under a new id, and lists as the newest.
    let again = snapshot_record(store, &parent.name, "zeta");
    store.create_snapshot(&again).expect("create a deleted snapshot name again");
    assert_eq!(
        store.snapshots(&parent.name).expect("snapshots"),
        vec![alpha.clone(), again.clone()]
    );

    // Deleting a volume leaves its snapshot records to the control plane.
    store.delete_volume(&parent.name).expect("delete_volume");
    assert_eq!(
        store.snapshots(&parent.name).expect("snapshots"),
        vec![alpha.clone(), again.clone()]
    );
    assert_eq!(
        store.volume(&clone.name).expect("volume"),
        Some(updated.clone()),
        "the clone stays"
    );
    for snapshot in [&alpha, &again, &other_zeta] {
        assert_eq!(
            &store.delete_snapshot(&snapshot.volume, &snapshot.name).expect("delete_snapshot"),
            snapshot
        );
    }
    assert_eq!(store.all_snapshots().expect("all_snapshots"), vec![]);
    for volume in [&other.name, &clone.name] {
        store.delete_volume(volume).expect("delete_volume");
    }
    assert_eq!(store.volumes().expect("volumes"), vec![]);
}

/// Checks that two writers on one store cannot break its atomicity: `first` and `second` are
/// two handles on the same store (two clients of one etcd prefix, or the same embedded store
/// twice), and the store holds no volume named `race-*`.
///
/// - Racing creates of one name: exactly one wins, the other gets [`MetaError::VolumeExists`].
/// - Racing deletes of one volume: exactly one gets the record, the other
///   [`MetaError::VolumeNotFound`].
/// - Racing id allocations: every id is distinct and each writer's ids increase.
/// - Racing snapshot creates and deletes of one name: as for volumes, exactly one wins.
pub fn check_concurrent_writers(first: &dyn MetaStore, second: &dyn MetaStore) {
    let writers = [first, second];
    for round in 0..RACE_ROUNDS {
        let volume = name(&format!("race-{round}"));
        let records = writers
            .map(|store| VolumeRecord { name: volume.clone(), ..record(store, "race", 1 << 20) });
        let barrier = Barrier::new(writers.len());
        let created = std::thread::scope(|scope| {
            let handles = writers.iter().zip(&records).map(|(store, record)| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    store.create_volume(record)
                })
            });
            handles
                .collect::<Vec<_>>()
                .into_iter()
                .map(|handle| handle.join().expect("a writer panicked"))
                .collect::<Vec<_>>()
        });
        let winners: Vec<&VolumeRecord> = created
            .iter()
            .zip(&records)
            .filter_map(|(result, record)| match result {
                Ok(_) => Some(record),
                Err(MetaError::VolumeExists(taken)) => {
                    assert_eq!(taken, &volume);
                    None
                }
                Err(other) => panic!("a racing create failed with {other}"),
            })
            .collect();
        assert_eq!(
            winners.len(),
            1,
            "exactly one of two racing creates of {volume} wins: {created:?}"
        );
        for store in writers {
            assert_eq!(
                store.volume(&volume).expect("volume").as_ref(),
                Some(winners[0]),
                "both writers see the winner"
            );
        }

        let deleted = std::thread::scope(|scope| {
            let handles = writers.map(|store| {
                let (barrier, volume) = (&barrier, &volume);
                scope.spawn(move || {
                    barrier.wait();
                    store.delete_volume(volume)
                })
            });
            handles.map(|handle| handle.join().expect("a writer panicked"))
        });
        let removed: Vec<&VolumeRecord> = deleted
            .iter()
            .filter_map(|result| match result {
                Ok(record) => Some(record),
                Err(MetaError::VolumeNotFound(_)) => None,
                Err(other) => panic!("a racing delete failed with {other}"),
            })
            .collect();
        assert_eq!(removed, vec![winners[0]], "exactly one of two racing deletes gets the record");
        assert_eq!(first.volume(&volume).expect("volume"), None);
    }

    check_snapshot_races(writers);

    let barrier = Barrier::new(writers.len());
    let allocated = std::thread::scope(|scope| {
        let handles = writers.map(|store| {
            let barrier = &barrier;
            scope.spawn(move || {
                barrier.wait();
                (0..RACE_IDS_PER_WRITER)
                    .map(|_| store.allocate_volume_id().expect("allocate_volume_id"))
                    .collect::<Vec<u64>>()
            })
        });
        handles.map(|handle| handle.join().expect("a writer panicked"))
    });
    for ids in &allocated {
        assert!(
            ids.windows(2).all(|pair| pair[0] < pair[1]),
            "each writer's ids increase: {ids:?}"
        );
    }
    let distinct: BTreeSet<u64> = allocated.iter().flatten().copied().collect();
    assert_eq!(
        distinct.len(),
        writers.len() * RACE_IDS_PER_WRITER,
        "racing allocations give distinct ids"
    );
}

/// Runs `operation` on every writer at once and returns each writer's result, in order.
fn race<T: Send>(
    writers: [&dyn MetaStore; 2],
    operation: impl Fn(usize, &dyn MetaStore) -> T + Sync,
) -> Vec<T> {
    let barrier = Barrier::new(writers.len());
    std::thread::scope(|scope| {
        let handles: Vec<_> = writers
            .iter()
            .enumerate()
            .map(|(index, store)| {
                let (barrier, operation) = (&barrier, &operation);
                scope.spawn(move || {
                    barrier.wait();
                    operation(index, *store)
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().expect("a writer panicked")).collect()
    })
}

fn check_snapshot_races(writers: [&dyn MetaStore; 2]) {
    let volume = record(writers[0], "race-snapshots", 1 << 20);
    writers[0].create_volume(&volume).expect("create_volume");
    for round in 0..RACE_ROUNDS {
        let snapshot = name(&format!("race-{round}"));
        let records = writers.map(|store| SnapshotRecord {
            name: snapshot.clone(),
            ..snapshot_record(store, &volume.name, "race")
        });
        let created = race(writers, |index, store| store.create_snapshot(&records[index]));
        let winners: Vec<&SnapshotRecord> = created
            .iter()
            .zip(&records)
            .filter_map(|(result, record)| match result {
                Ok(_) => Some(record),
                Err(MetaError::SnapshotExists { .. }) => None,
                Err(other) => panic!("a racing snapshot create failed with {other}"),
            })
            .collect();
        assert_eq!(winners.len(), 1, "exactly one of two racing snapshot creates wins");
        for store in writers {
            assert_eq!(
                store.snapshot(&volume.name, &snapshot).expect("snapshot").as_ref(),
                Some(winners[0])
            );
        }

        let deleted = race(writers, |_, store| store.delete_snapshot(&volume.name, &snapshot));
        let removed: Vec<&SnapshotRecord> = deleted
            .iter()
            .filter_map(|result| match result {
                Ok(record) => Some(record),
                Err(MetaError::SnapshotNotFound { .. }) => None,
                Err(other) => panic!("a racing snapshot delete failed with {other}"),
            })
            .collect();
        assert_eq!(removed, vec![winners[0]], "exactly one of two racing deletes gets the record");
    }
    assert_eq!(writers[1].snapshots(&volume.name).expect("snapshots"), vec![]);
    writers[1].delete_volume(&volume.name).expect("delete_volume");
}
