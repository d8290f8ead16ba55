//! The conformance suite every [`MetaStore`] implementation must pass.
//!
//! One suite for every backend (embedded and etcd) keeps them interchangeable: the control
//! plane's behaviour may not depend on where metadata lives. The suite panics with a message on
//! the first violation, like any test. [`EtcdServer`] runs a private etcd for the etcd store's
//! tests, here and in other crates.

mod etcd_server;

pub use etcd_server::EtcdServer;

use crate::{HostAccess, MetaError, MetaStore, NodeRecord, VolumeRecord};
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

/// Checks that two writers on one store cannot break its atomicity: `first` and `second` are
/// two handles on the same store (two clients of one etcd prefix, or the same embedded store
/// twice), and the store holds no volume named `race-*`.
///
/// - Racing creates of one name: exactly one wins, the other gets [`MetaError::VolumeExists`].
/// - Racing deletes of one volume: exactly one gets the record, the other
///   [`MetaError::VolumeNotFound`].
/// - Racing id allocations: every id is distinct and each writer's ids increase.
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
