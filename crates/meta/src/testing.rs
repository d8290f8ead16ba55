//! The conformance suite every [`MetaStore`] implementation must pass.
//!
//! One suite for every backend (embedded now, etcd later) keeps them interchangeable: the
//! control plane's behaviour may not depend on where metadata lives. The suite panics with a
//! message on the first violation, like any test.

use crate::{HostAccess, MetaError, MetaStore, NodeRecord, VolumeRecord};
use types::{Nqn, VolumeName};

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
