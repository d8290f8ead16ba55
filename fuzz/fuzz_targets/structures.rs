//! Fuzzes the decoders of data structures a host receives (Identify Controller and Namespace,
//! namespace descriptors, the active namespace list, LBA formats, the discovery log, the ANA
//! log) and the Connect data a target receives: never a panic, and what decodes re-encodes to
//! the same value where the structure has an encoder.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvmf::command::{ConnectData, Cqe, Sqe, CQE_BYTES, SQE_BYTES};
use nvmf::structures::{
    decode_active_namespace_list, lba_format, lba_format_index, AnaLog, DiscoveryLogEntry,
    DiscoveryLogHeader, IdentifyController, IdentifyNamespace, NamespaceIdentifiers,
    IDENTIFY_BYTES,
};

fuzz_target!(|data: &[u8]| {
    if let Some(identify) = IdentifyController::decode(data) {
        let _ = identify.model_number.len() + identify.subnqn.len();
    }
    if let Some(namespace) = IdentifyNamespace::decode(data) {
        let index = lba_format_index(namespace.flbas, namespace.nlbaf);
        let _ = lba_format(data, index);
    }
    if let Some(identifiers) = NamespaceIdentifiers::decode(data) {
        let mut out = vec![0u8; IDENTIFY_BYTES];
        identifiers.encode(&mut out);
        assert_eq!(NamespaceIdentifiers::decode(&out), Some(identifiers));
    }
    if let Some(nsids) = decode_active_namespace_list(data) {
        assert!(nsids.windows(2).all(|pair| pair[0] < pair[1]));
    }
    let _ = DiscoveryLogHeader::decode(data);
    let _ = DiscoveryLogEntry::decode(data);
    if let Some(log) = AnaLog::decode(data) {
        let mut out = Vec::new();
        log.encode(&mut out);
        assert_eq!(AnaLog::decode(&out), Some(log));
    }
    if let Ok(connect) = ConnectData::decode(data) {
        let mut out = Vec::new();
        connect.encode(&mut out);
        assert_eq!(ConnectData::decode(&out), Ok(connect));
    }
    if data.len() >= SQE_BYTES {
        let mut bytes = [0u8; SQE_BYTES];
        bytes.copy_from_slice(&data[..SQE_BYTES]);
        let sqe = Sqe::from_bytes(bytes);
        let _ =
            (sqe.sgl(), sqe.slba(), sqe.block_count(), sqe.property_size(), sqe.data_direction());
    }
    if data.len() >= CQE_BYTES {
        let mut bytes = [0u8; CQE_BYTES];
        bytes.copy_from_slice(&data[..CQE_BYTES]);
        let cqe = Cqe::decode(&bytes);
        assert_eq!(Cqe::decode(&cqe.encode()), cqe);
    }
});
