//! The stored form of metadata records: versioned JSON documents.
//!
//! Each record is one JSON object with a `"version"` field. Decoding reads the version first and
//! refuses a version it does not know, so an older build never misreads a newer record; a newer
//! build keeps a decoder for every version it ever wrote. JSON is chosen over a binary layout
//! because records are few, small and read rarely (at start and per API call), and an operator
//! can read them with redb's tools when something goes wrong.
//!
//! Version 1, volume record:
//! `{"version":1,"id":7,"name":"db-1","size_bytes":1073741824,"uuid":[16 bytes],
//!   "created_unix_ms":1700000000000,"chunks":[[drive,index],...]}`
//!
//! Version 1, node record:
//! `{"version":1,"uuid":[16 bytes],"drive_count":4,"drive_size_bytes":17179869184,
//!   "created_unix_ms":1700000000000}`

use crate::{Chunk, MetaError, NodeRecord, VolumeRecord};
use serde::{Deserialize, Serialize};
use types::VolumeName;

/// The only record format version this build writes and reads.
pub const RECORD_FORMAT_VERSION: u32 = 1;

#[derive(Deserialize)]
struct Envelope {
    version: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct VolumeV1 {
    version: u32,
    id: u64,
    name: String,
    size_bytes: u64,
    uuid: [u8; 16],
    created_unix_ms: u64,
    chunks: Vec<Chunk>,
}

#[derive(Serialize, Deserialize)]
struct NodeV1 {
    version: u32,
    uuid: [u8; 16],
    drive_count: u16,
    drive_size_bytes: u64,
    created_unix_ms: u64,
}

pub fn encode_volume(record: &VolumeRecord) -> Vec<u8> {
    let stored = VolumeV1 {
        version: RECORD_FORMAT_VERSION,
        id: record.id,
        name: record.name.as_str().to_owned(),
        size_bytes: record.size_bytes,
        uuid: record.uuid,
        created_unix_ms: record.created_unix_ms,
        chunks: record.chunks.clone(),
    };
    // Serialising plain integers, strings and vectors into memory cannot fail.
    serde_json::to_vec(&stored).expect("a volume record always serialises")
}

/// Decodes a volume record read from the store under `key` (the volume's name).
pub fn decode_volume(key: &str, bytes: &[u8]) -> Result<VolumeRecord, MetaError> {
    check_version(key, bytes)?;
    let stored: VolumeV1 = serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
    let name = VolumeName::new(&stored.name).map_err(|error| corrupt(key, error))?;
    if name.as_str() != key {
        return Err(corrupt(key, format!("it names volume {name:?}")));
    }
    Ok(VolumeRecord {
        id: stored.id,
        name,
        size_bytes: stored.size_bytes,
        uuid: stored.uuid,
        created_unix_ms: stored.created_unix_ms,
        chunks: stored.chunks,
    })
}

pub fn encode_node(record: &NodeRecord) -> Vec<u8> {
    let stored = NodeV1 {
        version: RECORD_FORMAT_VERSION,
        uuid: record.uuid,
        drive_count: record.drive_count,
        drive_size_bytes: record.drive_size_bytes,
        created_unix_ms: record.created_unix_ms,
    };
    serde_json::to_vec(&stored).expect("a node record always serialises")
}

pub fn decode_node(key: &str, bytes: &[u8]) -> Result<NodeRecord, MetaError> {
    check_version(key, bytes)?;
    let stored: NodeV1 = serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
    Ok(NodeRecord {
        uuid: stored.uuid,
        drive_count: stored.drive_count,
        drive_size_bytes: stored.drive_size_bytes,
        created_unix_ms: stored.created_unix_ms,
    })
}

fn check_version(key: &str, bytes: &[u8]) -> Result<(), MetaError> {
    let envelope: Envelope = serde_json::from_slice(bytes).map_err(|error| corrupt(key, error))?;
    match envelope.version {
        Some(version) if version == u64::from(RECORD_FORMAT_VERSION) => Ok(()),
        Some(version) => Err(MetaError::RecordVersionUnsupported {
            key: key.to_owned(),
            version,
            supported: RECORD_FORMAT_VERSION,
        }),
        None => Err(corrupt(key, "it has no format version")),
    }
}

fn corrupt(key: &str, detail: impl std::fmt::Display) -> MetaError {
    MetaError::RecordCorrupt { key: key.to_owned(), detail: detail.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume() -> VolumeRecord {
        VolumeRecord {
            id: 7,
            name: VolumeName::new("db-1").unwrap(),
            size_bytes: 1 << 30,
            uuid: [9; 16],
            created_unix_ms: 1_700_000_000_000,
            chunks: vec![(0, 1), (3, 4_000_000_000)],
        }
    }

    #[test]
    fn volume_round_trip() {
        let record = volume();
        assert_eq!(decode_volume("db-1", &encode_volume(&record)).unwrap(), record);
    }

    #[test]
    fn node_round_trip() {
        let record = NodeRecord {
            uuid: [1; 16],
            drive_count: 4,
            drive_size_bytes: 16 << 30,
            created_unix_ms: 5,
        };
        assert_eq!(decode_node("node", &encode_node(&record)).unwrap(), record);
    }

    #[test]
    fn unknown_version_is_refused() {
        let mut value: serde_json::Value =
            serde_json::from_slice(&encode_volume(&volume())).unwrap();
        value["version"] = 2.into();
        let bytes = serde_json::to_vec(&value).unwrap();
        let error = decode_volume("db-1", &bytes).unwrap_err();
        assert!(
            matches!(error, MetaError::RecordVersionUnsupported { version: 2, supported: 1, .. }),
            "{error}"
        );
        assert!(error.to_string().contains("format version 2"), "{error}");
        assert!(matches!(
            decode_node("node", &bytes),
            Err(MetaError::RecordVersionUnsupported { .. })
        ));
    }

    #[test]
    fn corrupt_records_are_refused() {
        let check = |key: &str, bytes: &[u8]| {
            let error = decode_volume(key, bytes).unwrap_err();
            assert!(matches!(error, MetaError::RecordCorrupt { .. }), "{key}: {error}");
        };
        check("db-1", b"");
        check("db-1", b"not json");
        check("db-1", br#"{"id":7}"#);
        check("db-1", br#"{"version":1,"id":7}"#);
        check("db-2", &encode_volume(&volume()));
        let mut value: serde_json::Value =
            serde_json::from_slice(&encode_volume(&volume())).unwrap();
        value["name"] = "Not A Name".into();
        check("Not A Name", &serde_json::to_vec(&value).unwrap());
        value["name"] = "db-1".into();
        value["uuid"] = serde_json::json!([1, 2, 3]);
        check("db-1", &serde_json::to_vec(&value).unwrap());
    }
}
