//! The single-node metadata store: one redb file, `DATA-DIR/meta.redb`.
//!
//! redb gives ACID transactions with a durable commit (its default durability fsyncs before
//! `commit` returns), and takes an exclusive lock on the file, so two nodes cannot share a data
//! dir. Tables:
//!
//! | table | key | value |
//! |---|---|---|
//! | `volumes` | volume name | [`crate::record`] volume record |
//! | `snapshots` | (volume name, snapshot name) | [`crate::record`] snapshot record |
//! | `node` | `"node"` | [`crate::record`] node record |
//! | `counters` | `"revision"`, `"next_volume_id"` | u64 |

use crate::record::{
    decode_node, decode_snapshot, decode_volume, encode_node, encode_snapshot, encode_volume,
};
use crate::{MetaError, MetaStore, NodeRecord, SnapshotRecord, VolumeRecord};
use redb::{Database, ReadableTable, TableDefinition, WriteTransaction};
use std::path::{Path, PathBuf};
use types::VolumeName;

/// The file name of the embedded store inside a node's data dir.
pub const META_FILE_NAME: &str = "meta.redb";

const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
/// Keyed by (volume name, snapshot name): redb orders tuple keys element by element, so one
/// volume's snapshots are one contiguous range.
const SNAPSHOTS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("snapshots");
const NODE: TableDefinition<&str, &[u8]> = TableDefinition::new("node");
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");

const NODE_KEY: &str = "node";
const REVISION_KEY: &str = "revision";
const NEXT_VOLUME_ID_KEY: &str = "next_volume_id";
/// Volume ids start at 1 so that 0 never names a volume.
const FIRST_VOLUME_ID: u64 = 1;

/// The embedded metadata store of a single node.
pub struct EmbeddedStore {
    database: Database,
    path: PathBuf,
}

impl EmbeddedStore {
    /// Opens the store at `path`, creating it (and its tables) if it does not exist.
    pub fn open(path: &Path) -> Result<Self, MetaError> {
        let database = Database::create(path).map_err(|error| match error {
            redb::DatabaseError::DatabaseAlreadyOpen => MetaError::InUse { path: path.to_owned() },
            other => MetaError::Open { path: path.to_owned(), detail: other.to_string() },
        })?;
        let store = Self { database, path: path.to_owned() };
        store.write(|txn| {
            txn.open_table(VOLUMES).map_err(backend)?;
            txn.open_table(SNAPSHOTS).map_err(backend)?;
            txn.open_table(NODE).map_err(backend)?;
            txn.open_table(COUNTERS).map_err(backend)?;
            Ok(())
        })?;
        Ok(store)
    }

    /// Opens the store in `data_dir` under its standard name, [`META_FILE_NAME`].
    pub fn open_in(data_dir: &Path) -> Result<Self, MetaError> {
        Self::open(&data_dir.join(META_FILE_NAME))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `body` in one write transaction without advancing the revision.
    fn write<T>(
        &self,
        body: impl FnOnce(&WriteTransaction) -> Result<T, MetaError>,
    ) -> Result<T, MetaError> {
        let txn = self.database.begin_write().map_err(backend)?;
        // On error the transaction is dropped, which aborts it.
        let value = body(&txn)?;
        txn.commit().map_err(backend)?;
        Ok(value)
    }

    /// Runs `body` in one write transaction that advances the revision; returns what `body`
    /// returned and the new revision.
    fn write_revision<T>(
        &self,
        body: impl FnOnce(&WriteTransaction) -> Result<T, MetaError>,
    ) -> Result<(T, u64), MetaError> {
        self.write(|txn| {
            let value = body(txn)?;
            let mut counters = txn.open_table(COUNTERS).map_err(backend)?;
            let revision =
                counters.get(REVISION_KEY).map_err(backend)?.map_or(0, |value| value.value()) + 1;
            counters.insert(REVISION_KEY, revision).map_err(backend)?;
            Ok((value, revision))
        })
    }

    /// Checks that `id` was handed out by [`MetaStore::allocate_volume_id`] on this store.
    fn check_allocated(txn: &WriteTransaction, id: u64, what: &str) -> Result<(), MetaError> {
        let next_id = txn
            .open_table(COUNTERS)
            .map_err(backend)?
            .get(NEXT_VOLUME_ID_KEY)
            .map_err(backend)?
            .map_or(FIRST_VOLUME_ID, |value| value.value());
        if !(FIRST_VOLUME_ID..next_id).contains(&id) {
            return Err(MetaError::Backend {
                detail: format!("{what} id {id} was not allocated by this store"),
            });
        }
        Ok(())
    }

    fn read_counter(&self, key: &str) -> Result<Option<u64>, MetaError> {
        let txn = self.database.begin_read().map_err(backend)?;
        let counters = txn.open_table(COUNTERS).map_err(backend)?;
        let value = counters.get(key).map_err(backend)?.map(|value| value.value());
        Ok(value)
    }
}

impl MetaStore for EmbeddedStore {
    fn revision(&self) -> Result<u64, MetaError> {
        Ok(self.read_counter(REVISION_KEY)?.unwrap_or(0))
    }

    fn node(&self) -> Result<Option<NodeRecord>, MetaError> {
        let txn = self.database.begin_read().map_err(backend)?;
        let table = txn.open_table(NODE).map_err(backend)?;
        let value = table.get(NODE_KEY).map_err(backend)?;
        value.map(|bytes| decode_node(NODE_KEY, bytes.value())).transpose()
    }

    fn put_node(&self, node: &NodeRecord) -> Result<u64, MetaError> {
        let bytes = encode_node(node);
        self.write_revision(|txn| {
            let mut table = txn.open_table(NODE).map_err(backend)?;
            table.insert(NODE_KEY, bytes.as_slice()).map_err(backend)?;
            Ok(())
        })
        .map(|((), revision)| revision)
    }

    fn allocate_volume_id(&self) -> Result<u64, MetaError> {
        self.write(|txn| {
            let mut counters = txn.open_table(COUNTERS).map_err(backend)?;
            let id = counters
                .get(NEXT_VOLUME_ID_KEY)
                .map_err(backend)?
                .map_or(FIRST_VOLUME_ID, |value| value.value());
            let next = id.checked_add(1).ok_or_else(|| MetaError::Backend {
                detail: "volume ids are exhausted".to_owned(),
            })?;
            counters.insert(NEXT_VOLUME_ID_KEY, next).map_err(backend)?;
            Ok(id)
        })
    }

    fn volume(&self, name: &VolumeName) -> Result<Option<VolumeRecord>, MetaError> {
        let txn = self.database.begin_read().map_err(backend)?;
        let table = txn.open_table(VOLUMES).map_err(backend)?;
        let value = table.get(name.as_str()).map_err(backend)?;
        value.map(|bytes| decode_volume(name.as_str(), bytes.value())).transpose()
    }

    fn volumes(&self) -> Result<Vec<VolumeRecord>, MetaError> {
        let txn = self.database.begin_read().map_err(backend)?;
        let table = txn.open_table(VOLUMES).map_err(backend)?;
        let mut records = Vec::new();
        // redb iterates in key order, so the list comes out sorted by name.
        for entry in table.iter().map_err(backend)? {
            let (key, value) = entry.map_err(backend)?;
            records.push(decode_volume(key.value(), value.value())?);
        }
        Ok(records)
    }

    fn create_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError> {
        let bytes = encode_volume(record);
        self.write_revision(|txn| {
            Self::check_allocated(txn, record.id, "volume")?;
            let mut table = txn.open_table(VOLUMES).map_err(backend)?;
            if table.get(record.name.as_str()).map_err(backend)?.is_some() {
                return Err(MetaError::VolumeExists(record.name.clone()));
            }
            table.insert(record.name.as_str(), bytes.as_slice()).map_err(backend)?;
            Ok(())
        })
        .map(|((), revision)| revision)
    }

    fn update_volume(&self, record: &VolumeRecord) -> Result<u64, MetaError> {
        let bytes = encode_volume(record);
        self.write_revision(|txn| {
            let mut table = txn.open_table(VOLUMES).map_err(backend)?;
            let existing = table
                .get(record.name.as_str())
                .map_err(backend)?
                .map(|value| decode_volume(record.name.as_str(), value.value()))
                .transpose()?;
            match existing {
                Some(existing) if existing.id == record.id => {}
                _ => return Err(MetaError::VolumeNotFound(record.name.clone())),
            }
            table.insert(record.name.as_str(), bytes.as_slice()).map_err(backend)?;
            Ok(())
        })
        .map(|((), revision)| revision)
    }

    fn delete_volume(&self, name: &VolumeName) -> Result<VolumeRecord, MetaError> {
        self.write_revision(|txn| {
            let mut table = txn.open_table(VOLUMES).map_err(backend)?;
            let removed = table
                .remove(name.as_str())
                .map_err(backend)?
                .map(|value| decode_volume(name.as_str(), value.value()))
                .transpose()?;
            removed.ok_or_else(|| MetaError::VolumeNotFound(name.clone()))
        })
        .map(|(record, _revision)| record)
    }

    fn snapshots(&self, volume: &VolumeName) -> Result<Vec<SnapshotRecord>, MetaError> {
        let txn = self.database.begin_read().map_err(backend)?;
        let table = txn.open_table(SNAPSHOTS).map_err(backend)?;
        let mut records = Vec::new();
        // The range starts at the volume's first key; it ends at the first key of another
        // volume, since the empty string is no snapshot's name.
        for entry in table.range((volume.as_str(), "")..).map_err(backend)? {
            let (key, value) = entry.map_err(backend)?;
            let (key_volume, key_name) = key.value();
            if key_volume != volume.as_str() {
                break;
            }
            records.push(decode_snapshot(key_volume, key_name, value.value())?);
        }
        records.sort_by_key(|record| record.id);
        Ok(records)
    }

    fn all_snapshots(&self) -> Result<Vec<SnapshotRecord>, MetaError> {
        let txn = self.database.begin_read().map_err(backend)?;
        let table = txn.open_table(SNAPSHOTS).map_err(backend)?;
        let mut records = Vec::new();
        for entry in table.iter().map_err(backend)? {
            let (key, value) = entry.map_err(backend)?;
            let (key_volume, key_name) = key.value();
            records.push(decode_snapshot(key_volume, key_name, value.value())?);
        }
        // Key order groups the records by volume name; within a volume, oldest first.
        records.sort_by(|a, b| (&a.volume, a.id).cmp(&(&b.volume, b.id)));
        Ok(records)
    }

    fn snapshot(
        &self,
        volume: &VolumeName,
        name: &VolumeName,
    ) -> Result<Option<SnapshotRecord>, MetaError> {
        let txn = self.database.begin_read().map_err(backend)?;
        let table = txn.open_table(SNAPSHOTS).map_err(backend)?;
        let value = table.get((volume.as_str(), name.as_str())).map_err(backend)?;
        value
            .map(|bytes| decode_snapshot(volume.as_str(), name.as_str(), bytes.value()))
            .transpose()
    }

    fn create_snapshot(&self, record: &SnapshotRecord) -> Result<u64, MetaError> {
        let bytes = encode_snapshot(record);
        let key = (record.volume.as_str(), record.name.as_str());
        self.write_revision(|txn| {
            Self::check_allocated(txn, record.id, "snapshot")?;
            let volumes = txn.open_table(VOLUMES).map_err(backend)?;
            if volumes.get(record.volume.as_str()).map_err(backend)?.is_none() {
                return Err(MetaError::VolumeNotFound(record.volume.clone()));
            }
            let mut table = txn.open_table(SNAPSHOTS).map_err(backend)?;
            if table.get(key).map_err(backend)?.is_some() {
                return Err(MetaError::SnapshotExists {
                    volume: record.volume.clone(),
                    snapshot: record.name.clone(),
                });
            }
            table.insert(key, bytes.as_slice()).map_err(backend)?;
            Ok(())
        })
        .map(|((), revision)| revision)
    }

    fn delete_snapshot(
        &self,
        volume: &VolumeName,
        name: &VolumeName,
    ) -> Result<SnapshotRecord, MetaError> {
        self.write_revision(|txn| {
            let mut table = txn.open_table(SNAPSHOTS).map_err(backend)?;
            let removed = table
                .remove((volume.as_str(), name.as_str()))
                .map_err(backend)?
                .map(|value| decode_snapshot(volume.as_str(), name.as_str(), value.value()))
                .transpose()?;
            removed.ok_or_else(|| MetaError::SnapshotNotFound {
                volume: volume.clone(),
                snapshot: name.clone(),
            })
        })
        .map(|(record, _revision)| record)
    }
}

fn backend(error: impl Into<redb::Error>) -> MetaError {
    MetaError::Backend { detail: error.into().to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostAccess;

    #[test]
    fn conformance() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open_in(dir.path()).unwrap();
        crate::testing::check_store(&store);
    }

    #[test]
    fn concurrent_writers() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open_in(dir.path()).unwrap();
        crate::testing::check_concurrent_writers(&store, &store);
    }

    #[test]
    fn survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let name = VolumeName::new("kept").unwrap();
        let (record, snapshot, revision) = {
            let store = EmbeddedStore::open_in(dir.path()).unwrap();
            let id = store.allocate_volume_id().unwrap();
            let record = VolumeRecord {
                id,
                name: name.clone(),
                size_bytes: 1 << 20,
                uuid: [3; 16],
                created_unix_ms: 9,
                chunks: vec![(1, 2)],
                host_access: HostAccess::Restricted(
                    [types::Nqn::new("nqn.2014-08.org.nvmexpress:uuid:1").unwrap()].into(),
                ),
                origin: None,
                compression: crate::Compression::Zstd,
                path_states: Default::default(),
            };
            store.create_volume(&record).unwrap();
            let snapshot = SnapshotRecord {
                id: store.allocate_volume_id().unwrap(),
                volume: name.clone(),
                name: VolumeName::new("first").unwrap(),
                size_bytes: 1 << 20,
                uuid: [5; 16],
                created_unix_ms: 10,
            };
            store.create_snapshot(&snapshot).unwrap();
            let node = NodeRecord {
                uuid: [4; 16],
                drive_count: 2,
                drive_size_bytes: 1 << 30,
                created_unix_ms: 8,
                external_drives: false,
            };
            let revision = store.put_node(&node).unwrap();
            (record, snapshot, revision)
        };
        let store = EmbeddedStore::open_in(dir.path()).unwrap();
        assert_eq!(store.volume(&name).unwrap(), Some(record.clone()));
        assert_eq!(store.snapshots(&name).unwrap(), vec![snapshot.clone()]);
        assert!(store.allocate_volume_id().unwrap() > snapshot.id, "ids are not reused");
        assert_eq!(store.node().unwrap().unwrap().drive_count, 2);
        assert_eq!(store.revision().unwrap(), revision);
        assert!(store.allocate_volume_id().unwrap() > record.id, "ids are not reused after reopen");
    }

    #[test]
    fn second_open_is_refused_while_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let _first = EmbeddedStore::open_in(dir.path()).unwrap();
        let error = EmbeddedStore::open_in(dir.path()).err().unwrap();
        assert!(matches!(error, MetaError::InUse { .. }), "{error}");
    }

    #[test]
    fn unreadable_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(META_FILE_NAME);
        std::fs::write(&path, b"this is not a redb file at all, not even close").unwrap();
        let error = EmbeddedStore::open(&path).err().unwrap();
        assert!(matches!(error, MetaError::Open { .. }), "{error}");
    }

    /// A data dir written before host access control existed (version 1 volume records) opens,
    /// and its volumes are open to any host until changed.
    #[test]
    fn version_1_records_load() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open_in(dir.path()).unwrap();
        let old = br#"{"version":1,"id":3,"name":"old","size_bytes":1048576,"uuid":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"created_unix_ms":5,"chunks":[[0,0]]}"#;
        store
            .write(|txn| {
                let mut table = txn.open_table(VOLUMES).map_err(backend)?;
                table.insert("old", old.as_slice()).map_err(backend)?;
                Ok(())
            })
            .unwrap();
        let name = VolumeName::new("old").unwrap();
        let record = store.volume(&name).unwrap().unwrap();
        assert_eq!(record.host_access, HostAccess::Open);
        assert_eq!(record.chunks, vec![(0, 0)]);
        assert_eq!(store.volumes().unwrap(), vec![record.clone()]);

        // Changing it writes version 2.
        let hosts = [types::Nqn::new("nqn.x:host").unwrap()].into();
        let restricted = VolumeRecord { host_access: HostAccess::Restricted(hosts), ..record };
        store.update_volume(&restricted).unwrap();
        drop(store);
        let store = EmbeddedStore::open_in(dir.path()).unwrap();
        assert_eq!(store.volume(&name).unwrap(), Some(restricted));
    }

    #[test]
    fn record_with_unknown_version_is_refused_on_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open_in(dir.path()).unwrap();
        store
            .write(|txn| {
                let mut table = txn.open_table(VOLUMES).map_err(backend)?;
                table.insert("future", br#"{"version":99}"#.as_slice()).map_err(backend)?;
                Ok(())
            })
            .unwrap();
        let name = VolumeName::new("future").unwrap();
        assert!(matches!(store.volume(&name), Err(MetaError::RecordVersionUnsupported { .. })));
        assert!(matches!(store.volumes(), Err(MetaError::RecordVersionUnsupported { .. })));

        store
            .write(|txn| {
                let mut table = txn.open_table(SNAPSHOTS).map_err(backend)?;
                table
                    .insert(("kept", "future"), br#"{"version":2}"#.as_slice())
                    .map_err(backend)?;
                Ok(())
            })
            .unwrap();
        let (kept, future) = (VolumeName::new("kept").unwrap(), VolumeName::new("future").unwrap());
        let unsupported = |result: Result<_, MetaError>| {
            matches!(result, Err(MetaError::RecordVersionUnsupported { version: 2, .. }))
        };
        assert!(unsupported(store.snapshot(&kept, &future).map(drop)));
        assert!(unsupported(store.snapshots(&kept).map(drop)));
        assert!(unsupported(store.all_snapshots().map(drop)));
        assert!(unsupported(store.delete_snapshot(&kept, &future).map(drop)));
    }
}
