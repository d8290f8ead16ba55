//! Tests of the target driven through whole connections, the way a Linux host drives it, against
//! a tiny in-memory storage executor.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use proptest::prelude::*;
use types::{AlignedBuf, Nqn};

use super::*;
use crate::command::{
    admin_opcode, cns, feature, io_opcode, log_page, property, Cqe, DsmRange, PropertySize,
    SglDescriptor, Sqe, Status, CNTLID_DYNAMIC, NSID_ALL,
};
use crate::pdu::{
    self, DataHeader, Decoded, FatalErrorStatus, Framing, ICReq, ICResp, Pdu, Role, R2T,
};
use crate::structures::{
    controller_type, DiscoveryLogEntry, DiscoveryLogHeader, IdentifyController, IdentifyNamespace,
    NamespaceIdentifiers, DISCOVERY_LOG_RECORD_BYTES,
};

pub(super) const BLOCK: usize = 4096;
pub(super) const HOSTNQN: &str =
    "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";
pub(super) const HOST_ID: [u8; 16] = [0x11; 16];

pub(super) fn subnqn(name: &str) -> Nqn {
    types::VolumeName::new(name).unwrap().subsystem_nqn()
}

pub(super) struct TestCatalog {
    pub(super) namespaces: Vec<(Nqn, NamespaceInfo)>,
}

impl Catalog for TestCatalog {
    fn subsystems(&self) -> Vec<SubsystemInfo> {
        self.namespaces.iter().map(|(nqn, _)| SubsystemInfo { nqn: nqn.clone() }).collect()
    }
    fn namespace(&self, subnqn: &Nqn) -> Option<NamespaceInfo> {
        self.namespaces.iter().find(|(nqn, _)| nqn == subnqn).map(|(_, info)| info.clone())
    }
    fn host_allowed(&self, _subnqn: &Nqn, hostnqn: &Nqn) -> bool {
        !hostnqn.as_str().ends_with(":banned")
    }
}

pub(super) fn namespace(volume: u64, size: &Arc<AtomicU64>) -> NamespaceInfo {
    NamespaceInfo {
        volume,
        size_blocks: Arc::clone(size),
        block_size_bytes: BLOCK as u32,
        nguid: [volume as u8; 16],
        uuid: [volume as u8 + 1; 16],
        eui64: [volume as u8 + 2; 8],
        serial_number: format!("serial-{volume}"),
        read_only: false,
    }
}

pub(super) struct Fixture {
    pub(super) target: Arc<Target>,
    pub(super) size: Arc<AtomicU64>,
}

pub(super) fn fixture() -> Fixture {
    let size = Arc::new(AtomicU64::new(1024));
    let other = Arc::new(AtomicU64::new(256));
    let catalog = TestCatalog {
        namespaces: vec![
            (subnqn("db"), namespace(7, &size)),
            (subnqn("logs"), namespace(8, &other)),
        ],
    };
    let target = Arc::new(Target::new(TargetConfig::default(), Arc::new(catalog)));
    Fixture { target, size }
}

/// The storage a driver would call: 4 KiB blocks per volume, zeros when never written.
#[derive(Default)]
pub(super) struct Storage {
    pub(super) blocks: HashMap<(u64, u64), [u8; BLOCK]>,
    pub(super) fail_reads: bool,
    pub(super) flushes: usize,
}

impl Storage {
    pub(super) fn execute(
        &mut self,
        request: StorageRequest,
    ) -> (Result<(), StorageStatus>, Option<AlignedBuf>) {
        let volume = request.volume;
        match request.operation {
            StorageOperation::Read { lba, blocks, mut buf } => {
                assert_eq!(buf.len(), blocks as usize * BLOCK);
                if self.fail_reads {
                    return (Err(StorageStatus::UnrecoveredReadError), Some(buf));
                }
                for (index, chunk) in buf.chunks_exact_mut(BLOCK).enumerate() {
                    let block = self.blocks.get(&(volume, lba + index as u64));
                    chunk.copy_from_slice(block.unwrap_or(&[0; BLOCK]));
                }
                (Ok(()), Some(buf))
            }
            StorageOperation::Write { lba, blocks, buf } => {
                assert_eq!(buf.len(), blocks as usize * BLOCK);
                for (index, chunk) in buf.chunks_exact(BLOCK).enumerate() {
                    let mut block = [0u8; BLOCK];
                    block.copy_from_slice(chunk);
                    self.blocks.insert((volume, lba + index as u64), block);
                }
                (Ok(()), Some(buf))
            }
            StorageOperation::Flush => {
                self.flushes += 1;
                (Ok(()), None)
            }
            StorageOperation::WriteZeroes { lba, blocks } => {
                for index in 0..u64::from(blocks) {
                    self.blocks.remove(&(volume, lba + index));
                }
                (Ok(()), None)
            }
            StorageOperation::Deallocate { ranges } => {
                for (lba, blocks) in ranges.iter() {
                    for index in 0..u64::from(blocks) {
                        self.blocks.remove(&(volume, lba + index));
                    }
                }
                (Ok(()), Some(ranges.into_buf()))
            }
        }
    }
}

/// A received PDU, owned.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Received {
    ICResp(ICResp),
    Response(Cqe),
    Data(DataHeader, Vec<u8>),
    R2T(R2T),
    Term { fes: u16, fei: u32, header: Vec<u8> },
}

/// A host on one connection, with the driver's loop folded in.
pub(super) struct Host {
    pub(super) queue: Queue,
    pub(super) framing: Framing,
    /// Bytes sent by the host that the queue has not consumed yet (the driver's buffer).
    pub(super) unconsumed: Vec<u8>,
    /// Bytes sent by the queue that the host has not decoded yet.
    pub(super) inbox: Vec<u8>,
    pub(super) next_cid: u16,
    pub(super) now_ms: u64,
    pub(super) maxh2cdata: u32,
    pub(super) terminated: Option<Terminated>,
}

impl Host {
    pub(super) fn new(target: &Arc<Target>) -> Host {
        Host::new_on_port(target, target.default_port_id())
    }

    pub(super) fn new_on_port(target: &Arc<Target>, port_id: u16) -> Host {
        Host {
            queue: Queue::new_on_port(Arc::clone(target), "test".into(), port_id, 0),
            framing: Framing::new(Role::Host, 4 << 20),
            unconsumed: Vec::new(),
            inbox: Vec::new(),
            next_cid: 1,
            now_ms: 0,
            maxh2cdata: 0,
            terminated: None,
        }
    }

    /// Feeds bytes the way a driver does: keep what was not consumed, offer it again later.
    pub(super) fn send(&mut self, bytes: &[u8]) {
        self.unconsumed.extend_from_slice(bytes);
        match self.queue.receive(&self.unconsumed, self.now_ms) {
            Ok(consumed) => {
                self.unconsumed.drain(..consumed);
            }
            Err(terminated) => self.terminated = Some(terminated),
        }
    }

    pub(super) fn pump(&mut self, storage: &mut Storage) {
        while let Some(request) = self.queue.next_request() {
            let id = request.id;
            let (result, buf) = storage.execute(request);
            self.queue.complete(id, result, buf);
        }
        let output = drain_output(&mut self.queue);
        self.inbox.extend_from_slice(&output);
    }

    pub(super) fn receive_all(&mut self) -> Vec<Received> {
        let mut received = Vec::new();
        loop {
            let decoded = pdu::decode(&self.inbox, &self.framing).expect("target output decodes");
            let (pdu, length) = match decoded {
                Decoded::Incomplete { .. } => break,
                Decoded::Pdu { pdu, consumed_bytes } => (pdu, consumed_bytes),
                Decoded::DataDigestMismatch { .. } => panic!("target sent a bad data digest"),
            };
            received.push(match pdu {
                Pdu::ICResp(icresp) => Received::ICResp(icresp),
                Pdu::CapsuleResp(cqe) => Received::Response(cqe),
                Pdu::C2HData(header, data) => Received::Data(header, data.to_vec()),
                Pdu::R2T(r2t) => Received::R2T(r2t),
                Pdu::C2HTermReq(term) => Received::Term {
                    fes: term.fes,
                    fei: term.fei,
                    header: term.pdu_header.to_vec(),
                },
                other => panic!("a controller does not send {other:?}"),
            });
            self.inbox.drain(..length);
        }
        received
    }

    pub(super) fn initialize(&mut self, header_digest: bool, data_digest: bool, hpda: u8) {
        let mut bytes = Vec::new();
        let icreq = ICReq { pfv: 0, hpda, header_digest, data_digest, maxr2t: 0 };
        pdu::encode_ic_req(&mut bytes, &icreq);
        self.send(&bytes);
        self.pump(&mut Storage::default());
        match self.receive_all().as_slice() {
            [Received::ICResp(icresp)] => {
                assert_eq!(icresp.pfv, 0);
                assert_eq!(icresp.cpda, CPDA);
                assert_eq!(
                    (icresp.header_digest, icresp.data_digest),
                    (header_digest, data_digest)
                );
                assert_eq!(icresp.maxh2cdata, MAXH2CDATA);
                self.framing.header_digest = header_digest;
                self.framing.data_digest = data_digest;
                self.framing.receive_pda = hpda;
                self.framing.send_pda = icresp.cpda;
                self.maxh2cdata = icresp.maxh2cdata;
            }
            other => panic!("expected ICResp, got {other:?}"),
        }
    }

    pub(super) fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1);
        self.next_cid
    }

    /// Sends `sqe` (its CID is replaced) with `write` data in the capsule or by R2T, runs
    /// storage, and returns the completion and the C2H data received for it.
    pub(super) fn exchange(
        &mut self,
        storage: &mut Storage,
        mut sqe: Sqe,
        write: &[u8],
        in_capsule: bool,
    ) -> (Cqe, Vec<u8>) {
        let cid = self.cid();
        sqe.set_cid(cid);
        let mut bytes = Vec::new();
        if !write.is_empty() {
            let sgl = if in_capsule {
                SglDescriptor::in_capsule(0, write.len() as u32)
            } else {
                SglDescriptor::transport(write.len() as u32)
            };
            sqe.set_sgl(sgl);
        }
        pdu::encode_capsule_cmd(
            &mut bytes,
            &self.framing,
            &sqe,
            if in_capsule { write } else { &[] },
        );
        self.send(&bytes);
        let mut data = Vec::new();
        // Each round answers at least one PDU; a 1 MiB write needs 8 R2Ts.
        for _ in 0..64 {
            self.pump(storage);
            for received in self.receive_all() {
                match received {
                    Received::Response(cqe) if cqe.cid == cid => return (cqe, data),
                    Received::Data(header, bytes) if header.cccid == cid => {
                        assert_eq!(header.datao as usize, data.len(), "C2H data in order");
                        data.extend_from_slice(&bytes);
                    }
                    Received::R2T(r2t) if r2t.cccid == cid => self.answer_r2t(&r2t, write),
                    other => panic!("unexpected {other:?} while waiting for cid {cid}"),
                }
            }
            assert!(self.terminated.is_none(), "terminated: {:?}", self.terminated);
        }
        panic!("no completion for cid {cid}");
    }

    pub(super) fn answer_r2t(&mut self, r2t: &R2T, write: &[u8]) {
        let mut bytes = Vec::new();
        let end = (r2t.r2to + r2t.r2tl) as usize;
        let mut offset = r2t.r2to as usize;
        // Split into PDUs no larger than MAXH2CDATA (and smaller, to exercise reassembly).
        let piece = (self.maxh2cdata as usize / 2).max(4096);
        while offset < end {
            let length = piece.min(end - offset);
            let header = DataHeader {
                cccid: r2t.cccid,
                ttag: r2t.ttag,
                datao: offset as u32,
                datal: length as u32,
                last: offset + length == end,
                success: false,
            };
            pdu::encode_data_pdu(
                &mut bytes,
                &self.framing,
                &header,
                &write[offset..offset + length],
            );
            offset += length;
        }
        self.send(&bytes);
    }

    pub(super) fn admin(&mut self, sqe: Sqe) -> (Cqe, Vec<u8>) {
        self.exchange(&mut Storage::default(), sqe, &[], false)
    }

    pub(super) fn connect(
        &mut self,
        qid: u16,
        sqsize: u16,
        cntlid: u16,
        subnqn: &Nqn,
        hostnqn: &str,
    ) -> Cqe {
        let data = crate::command::ConnectData {
            host_id: HOST_ID,
            cntlid,
            subnqn: subnqn.clone(),
            hostnqn: Nqn::new(hostnqn).unwrap(),
        };
        let mut bytes = Vec::new();
        data.encode(&mut bytes);
        let sqe = Sqe::connect(0, qid, sqsize, 5000);
        self.exchange(&mut Storage::default(), sqe, &bytes, true).0
    }

    pub(super) fn property_get(&mut self, offset: u32, size: PropertySize) -> u64 {
        let (cqe, _) = self.admin(Sqe::property_get(0, offset, size));
        assert!(cqe.status.is_success(), "{cqe:?}");
        cqe.result
    }

    /// ICReq, admin Connect, CC.EN = 1: a ready admin queue. Returns the controller ID.
    pub(super) fn bring_up_admin(&mut self, subnqn: &Nqn) -> u16 {
        self.initialize(false, false, 0);
        let cqe = self.connect(0, 31, CNTLID_DYNAMIC, subnqn, HOSTNQN);
        assert!(cqe.status.is_success(), "{cqe:?}");
        self.enable();
        cqe.dw0() as u16
    }

    pub(super) fn enable(&mut self) {
        let cc = property::CC_ENABLE
            | (6 << property::CC_IOSQES_SHIFT)
            | (4 << property::CC_IOCQES_SHIFT);
        let (cqe, _) =
            self.admin(Sqe::property_set(0, property::CC, PropertySize::Bytes4, u64::from(cc)));
        assert!(cqe.status.is_success());
    }

    pub(super) fn expect_termination(&mut self, fes: FatalErrorStatus, fei: u32) {
        self.pump(&mut Storage::default());
        let received = self.receive_all();
        match received.last() {
            Some(Received::Term { fes: got, fei: got_fei, .. }) => {
                assert_eq!((*got, *got_fei), (fes as u16, fei), "{received:?}");
            }
            other => panic!("expected C2HTermReq {fes:?}, got {other:?}"),
        }
        assert!(self.queue.wants_close());
        assert!(matches!(self.terminated, Some(Terminated::ProtocolError(_))));
        // Nothing more is taken.
        assert!(self.queue.receive(&[0; 8], 0).is_err());
    }
}

pub(super) fn pattern(length: usize, seed: u8) -> Vec<u8> {
    (0..length).map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

pub(super) fn write(lba: u64, blocks: u32) -> Sqe {
    Sqe::write(0, 1, lba, blocks)
}

pub(super) fn read(lba: u64, blocks: u32) -> Sqe {
    Sqe::read(0, 1, lba, blocks).with_sgl(SglDescriptor::transport(blocks * BLOCK as u32))
}

pub(super) fn assert_status(cqe: &Cqe, expected: Status) {
    assert!(cqe.status.same_code(expected), "expected {expected:?}, got {:?}", cqe.status);
}

/// The whole sequence a Linux host runs, with each digest and alignment setting.
#[test]
fn linux_like_session() {
    for (header_digest, data_digest, hpda) in [(false, false, 0), (true, true, 0), (true, false, 3)]
    {
        let fixture = fixture();
        let mut storage = Storage::default();
        let nqn = subnqn("db");

        // Admin queue.
        let mut admin = Host::new(&fixture.target);
        admin.initialize(header_digest, data_digest, hpda);
        let connect = admin.connect(0, 31, CNTLID_DYNAMIC, &nqn, HOSTNQN);
        assert!(connect.status.is_success(), "{connect:?}");
        assert_eq!((connect.sqhd, connect.sqid), (1, 0));
        let cntlid = connect.dw0() as u16;
        assert!((1..=0xFFEF).contains(&cntlid));

        let cap = admin.property_get(property::CAP, PropertySize::Bytes8);
        assert_eq!(cap & 0xFFFF, 127, "MQES");
        assert_ne!(cap & (1 << 16), 0, "CQR");
        assert_ne!(cap & (1 << 37), 0, "CSS NVM");
        assert_eq!((cap >> 48) & 0xF, 0, "MPSMIN");
        assert_eq!((cap >> 24) & 0xFF, 15, "TO");
        assert_eq!(admin.property_get(property::VS, PropertySize::Bytes4), 0x10400);
        assert_eq!(admin.property_get(property::CSTS, PropertySize::Bytes4) & 1, 0);
        admin.enable();
        assert_eq!(admin.property_get(property::CSTS, PropertySize::Bytes4) & 1, 1, "RDY");

        let (cqe, data) = admin.admin(Sqe::identify(0, cns::CONTROLLER, 0, 0, 4096));
        assert!(cqe.status.is_success());
        let identify = IdentifyController::decode(&data).unwrap();
        assert_eq!(identify.cntlid, cntlid);
        assert_eq!(identify.mdts, 8);
        assert_eq!(identify.ioccsz, 516);
        assert_eq!(identify.iorcsz, 1);
        assert_eq!(identify.icdoff, 0);
        assert_eq!(identify.cntrltype, controller_type::IO);
        assert_eq!(identify.subnqn, nqn.as_str());
        assert_eq!(identify.serial_number, "serial-7");
        assert_eq!(identify.nn, 1);
        assert_eq!(identify.oncs, 0x0C);
        assert_eq!(identify.vwc, 0);
        assert_eq!(identify.maxcmd, 128);
        assert_eq!(identify.sgls & 0x3, 1);
        assert_eq!(identify.cmic & 0x2, 0x2);
        assert_eq!(identify.kas, 10);
        assert_eq!(identify.aerl, 3);

        let (cqe, data) = admin.admin(Sqe::identify(0, cns::ACTIVE_NAMESPACE_LIST, 0, 0, 4096));
        assert!(cqe.status.is_success());
        assert_eq!(&data[..8], &[1, 0, 0, 0, 0, 0, 0, 0]);
        let (_, data) = admin.admin(Sqe::identify(0, cns::NAMESPACE_DESCRIPTORS, 1, 0, 4096));
        let identifiers = NamespaceIdentifiers::decode(&data).unwrap();
        assert_eq!(
            (identifiers.nguid, identifiers.uuid, identifiers.eui64),
            ([7; 16], [8; 16], [9; 8])
        );
        let (_, data) = admin.admin(Sqe::identify(0, cns::NAMESPACE, 1, 0, 4096));
        let identify = IdentifyNamespace::decode(&data).unwrap();
        assert_eq!((identify.nsze, identify.ncap, identify.lbaf0_lbads), (1024, 1024, 12));
        assert_eq!(identify.nmic, 1);
        let (cqe, data) = admin.admin(Sqe::identify(0, cns::CSI_CONTROLLER, 0, 0, 4096));
        assert!(cqe.status.is_success() && data.len() == 4096);

        let (cqe, _) = admin.admin(Sqe::set_features(0, feature::NUMBER_OF_QUEUES, 7 | (7 << 16)));
        assert!(cqe.status.is_success());
        assert_eq!(cqe.dw0(), 7 | (7 << 16));
        let (cqe, _) =
            admin.admin(Sqe::set_features(0, feature::ASYNC_EVENT_CONFIGURATION, 1 << 8));
        assert!(cqe.status.is_success());
        let (cqe, _) = admin.admin(Sqe::keep_alive(0));
        assert!(cqe.status.is_success());

        // I/O queue.
        let mut io = Host::new(&fixture.target);
        io.initialize(header_digest, data_digest, hpda);
        let connect = io.connect(1, 127, cntlid, &nqn, HOSTNQN);
        assert!(connect.status.is_success(), "{connect:?}");
        assert_eq!((connect.dw0() as u16, connect.sqid, connect.sqhd), (cntlid, 1, 1));

        let small = pattern(BLOCK, 1);
        let (cqe, _) = io.exchange(&mut storage, write(10, 1), &small, true);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let large = pattern(128 * 1024, 2);
        let (cqe, _) = io.exchange(&mut storage, write(100, 32), &large, false);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let huge = pattern(1 << 20, 3);
        let (cqe, _) = io.exchange(&mut storage, write(200, 256), &huge, false);
        assert!(cqe.status.is_success(), "{cqe:?}");

        let (cqe, data) = io.exchange(&mut storage, read(10, 1), &[], false);
        assert!(cqe.status.is_success());
        assert_eq!(data, small);
        let (_, data) = io.exchange(&mut storage, read(100, 32), &[], false);
        assert_eq!(data, large);
        let (_, data) = io.exchange(&mut storage, read(200, 256), &[], false);
        assert_eq!(data, huge);

        let (cqe, _) = io.exchange(&mut storage, Sqe::flush(0, 1), &[], false);
        assert!(cqe.status.is_success());
        assert_eq!(storage.flushes, 1);

        let (cqe, _) =
            io.exchange(&mut storage, Sqe::write_zeroes(0, 1, 100, 4, false), &[], false);
        assert!(cqe.status.is_success());
        let (_, data) = io.exchange(&mut storage, read(100, 5), &[], false);
        assert!(data[..4 * BLOCK].iter().all(|b| *b == 0));
        assert_eq!(&data[4 * BLOCK..], &large[4 * BLOCK..5 * BLOCK]);

        let mut ranges = Vec::new();
        ranges
            .extend_from_slice(&DsmRange { context_attributes: 0, blocks: 2, slba: 110 }.encode());
        ranges
            .extend_from_slice(&DsmRange { context_attributes: 0, blocks: 0, slba: 5000 }.encode());
        let dsm = Sqe::dataset_management(0, 1, 2, true);
        let (cqe, _) = io.exchange(&mut storage, dsm, &ranges, true);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let (_, data) = io.exchange(&mut storage, read(109, 3), &[], false);
        assert_eq!(&data[..BLOCK], &large[9 * BLOCK..10 * BLOCK]);
        assert!(data[BLOCK..].iter().all(|b| *b == 0), "deallocated blocks read as zeros");
        // The same by R2T.
        let (cqe, _) =
            io.exchange(&mut storage, Sqe::dataset_management(0, 1, 2, true), &ranges, false);
        assert!(cqe.status.is_success(), "{cqe:?}");

        assert!(!io.queue.wants_close() && !admin.queue.wants_close());
        assert_eq!(fixture.target.controller_count(), 1);
        drop(io);
        drop(admin);
        assert_eq!(fixture.target.controller_count(), 0);
    }
}

#[test]
fn truncated_pdus_are_consumed_only_when_whole() {
    let fixture = fixture();
    let mut host = Host::new(&fixture.target);
    host.bring_up_admin(&subnqn("db"));
    let mut bytes = Vec::new();
    pdu::encode_capsule_cmd(&mut bytes, &host.framing, &Sqe::keep_alive(77), &[]);
    pdu::encode_capsule_cmd(&mut bytes, &host.framing, &Sqe::keep_alive(78), &[]);
    // Byte by byte: nothing is consumed until a whole PDU is there.
    let mut consumed_total = 0;
    let mut buffer = Vec::new();
    for byte in &bytes {
        buffer.push(*byte);
        let consumed = host.queue.receive(&buffer, 0).unwrap();
        assert!(consumed == 0 || consumed == 72, "{consumed}");
        buffer.drain(..consumed);
        consumed_total += consumed;
    }
    assert_eq!(consumed_total, bytes.len());
    host.pump(&mut Storage::default());
    let cids: Vec<u16> = host
        .receive_all()
        .into_iter()
        .map(|received| match received {
            Received::Response(cqe) => cqe.cid,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(cids, [77, 78]);
}

#[test]
fn bad_hlen_terminates_with_invalid_header_field() {
    let fixture = fixture();
    let mut host = Host::new(&fixture.target);
    host.bring_up_admin(&subnqn("db"));
    let mut bytes = Vec::new();
    pdu::encode_capsule_cmd(&mut bytes, &host.framing, &Sqe::keep_alive(1), &[]);
    bytes[2] = 70;
    host.send(&bytes);
    host.expect_termination(FatalErrorStatus::InvalidHeaderField, 2);
}

#[test]
fn bad_header_digest_terminates() {
    let fixture = fixture();
    let mut host = Host::new(&fixture.target);
    host.initialize(true, false, 0);
    let mut bytes = Vec::new();
    pdu::encode_capsule_cmd(&mut bytes, &host.framing, &Sqe::keep_alive(1), &[]);
    bytes[72] ^= 0xFF;
    host.send(&bytes);
    host.expect_termination(FatalErrorStatus::HeaderDigestError, 0);
}

#[test]
fn pdu_before_icreq_and_bad_pfv_terminate() {
    let fixture = fixture();
    let mut host = Host::new(&fixture.target);
    let mut bytes = Vec::new();
    pdu::encode_capsule_cmd(&mut bytes, &host.framing, &Sqe::keep_alive(1), &[]);
    host.send(&bytes);
    host.expect_termination(FatalErrorStatus::PduSequenceError, 0);

    let mut host = Host::new(&fixture.target);
    let mut bytes = Vec::new();
    pdu::encode_ic_req(
        &mut bytes,
        &ICReq { pfv: 1, hpda: 0, header_digest: false, data_digest: false, maxr2t: 0 },
    );
    host.send(&bytes);
    host.expect_termination(FatalErrorStatus::UnsupportedParameter, 8);
}

#[test]
fn data_digest_error_fails_only_the_command() {
    let fixture = fixture();
    let mut storage = Storage::default();
    let nqn = subnqn("db");
    let mut admin = Host::new(&fixture.target);
    let cntlid = admin.bring_up_admin(&nqn);
    let mut io = Host::new(&fixture.target);
    io.initialize(false, true, 0);
    assert!(io.connect(1, 15, cntlid, &nqn, HOSTNQN).status.is_success());

    // In-capsule data damaged.
    let data = pattern(BLOCK, 9);
    let mut bytes = Vec::new();
    let mut sqe = write(5, 1).with_sgl(SglDescriptor::in_capsule(0, BLOCK as u32));
    sqe.set_cid(50);
    pdu::encode_capsule_cmd(&mut bytes, &io.framing, &sqe, &data);
    bytes[100] ^= 1;
    io.send(&bytes);
    io.pump(&mut storage);
    match io.receive_all().as_slice() {
        [Received::Response(cqe)] => {
            assert_eq!(cqe.cid, 50);
            assert_status(cqe, Status::TRANSIENT_TRANSPORT_ERROR);
        }
        other => panic!("{other:?}"),
    }

    // H2CData damaged: the command fails once its data is in; the queue goes on.
    let mut sqe = write(6, 2).with_sgl(SglDescriptor::transport(2 * BLOCK as u32));
    sqe.set_cid(51);
    bytes.clear();
    pdu::encode_capsule_cmd(&mut bytes, &io.framing, &sqe, &[]);
    io.send(&bytes);
    io.pump(&mut storage);
    let r2t = match io.receive_all().as_slice() {
        [Received::R2T(r2t)] => *r2t,
        other => panic!("{other:?}"),
    };
    bytes.clear();
    let data = pattern(2 * BLOCK, 4);
    let header = DataHeader {
        cccid: 51,
        ttag: r2t.ttag,
        datao: 0,
        datal: BLOCK as u32,
        last: false,
        success: false,
    };
    pdu::encode_data_pdu(&mut bytes, &io.framing, &header, &data[..BLOCK]);
    let damaged = bytes.len() - 10;
    bytes[damaged] ^= 1;
    let header = DataHeader { datao: BLOCK as u32, last: true, ..header };
    pdu::encode_data_pdu(&mut bytes, &io.framing, &header, &data[BLOCK..]);
    io.send(&bytes);
    io.pump(&mut storage);
    match io.receive_all().as_slice() {
        [Received::Response(cqe)] => assert_status(cqe, Status::TRANSIENT_TRANSPORT_ERROR),
        other => panic!("{other:?}"),
    }
    assert!(storage.blocks.is_empty(), "nothing damaged was written");
    let (cqe, _) = io.exchange(&mut storage, write(6, 2), &data, false);
    assert!(cqe.status.is_success());
}

/// An I/O queue connected to subsystem "db", with its admin queue.
pub(super) fn io_queue(fixture: &Fixture) -> (Host, Host) {
    let nqn = subnqn("db");
    let mut admin = Host::new(&fixture.target);
    let cntlid = admin.bring_up_admin(&nqn);
    let mut io = Host::new(&fixture.target);
    io.initialize(false, false, 0);
    let cqe = io.connect(1, 31, cntlid, &nqn, HOSTNQN);
    assert!(cqe.status.is_success(), "{cqe:?}");
    (admin, io)
}

#[test]
fn h2c_data_outside_its_r2t_terminates() {
    let fixture = fixture();
    let (_admin, mut io) = io_queue(&fixture);
    let mut sqe = write(0, 1).with_sgl(SglDescriptor::transport(BLOCK as u32));
    sqe.set_cid(9);
    let mut bytes = Vec::new();
    pdu::encode_capsule_cmd(&mut bytes, &io.framing, &sqe, &[]);
    io.send(&bytes);
    io.pump(&mut Storage::default());
    let r2t = match io.receive_all().as_slice() {
        [Received::R2T(r2t)] => *r2t,
        other => panic!("{other:?}"),
    };
    assert_eq!((r2t.r2to, r2t.r2tl), (0, BLOCK as u32));
    bytes.clear();
    let header = DataHeader {
        cccid: 9,
        ttag: r2t.ttag,
        datao: 0,
        datal: 2 * BLOCK as u32,
        last: true,
        success: false,
    };
    pdu::encode_data_pdu(&mut bytes, &io.framing, &header, &pattern(2 * BLOCK, 0));
    io.send(&bytes);
    io.expect_termination(FatalErrorStatus::DataTransferOutOfRange, 0);
}

#[test]
fn h2c_data_with_unknown_ttag_or_datal_beyond_plen_terminates() {
    let fixture = fixture();
    let (_admin, mut io) = io_queue(&fixture);
    let mut bytes = Vec::new();
    let header = DataHeader { cccid: 9, ttag: 3, datao: 0, datal: 16, last: true, success: false };
    pdu::encode_data_pdu(&mut bytes, &io.framing, &header, &[0; 16]);
    io.send(&bytes);
    io.expect_termination(FatalErrorStatus::InvalidHeaderField, 10);

    let (_admin, mut io) = io_queue(&fixture);
    let mut bytes = Vec::new();
    pdu::encode_data_pdu(&mut bytes, &io.framing, &header, &[0; 16]);
    // DATAL claims more data than PLEN holds.
    bytes[16..20].copy_from_slice(&32u32.to_le_bytes());
    io.send(&bytes);
    io.expect_termination(FatalErrorStatus::InvalidHeaderField, 16);
}

#[test]
fn command_errors_complete_with_status_and_the_queue_goes_on() {
    let fixture = fixture();
    let (mut admin, mut io) = io_queue(&fixture);
    let mut storage = Storage::default();
    let check = |io: &mut Host, storage: &mut Storage, sqe: Sqe, write: &[u8], expected: Status| {
        let (cqe, data) = io.exchange(storage, sqe, write, true);
        assert_status(&cqe, expected);
        assert!(cqe.status.do_not_retry(), "{cqe:?}");
        assert!(data.is_empty());
    };
    check(&mut io, &mut storage, read(1020, 8), &[], Status::LBA_OUT_OF_RANGE);
    check(&mut io, &mut storage, read(u64::MAX, 2), &[], Status::LBA_OUT_OF_RANGE);
    check(&mut io, &mut storage, write(1024, 1), &pattern(BLOCK, 0), Status::LBA_OUT_OF_RANGE);
    check(
        &mut io,
        &mut storage,
        Sqe::write_zeroes(0, 1, 1000, 100, false),
        &[],
        Status::LBA_OUT_OF_RANGE,
    );
    // More than MDTS (1 MiB).
    check(&mut io, &mut storage, read(0, 257), &[], Status::INVALID_FIELD);
    // SGL length disagreeing with the block count.
    let short = Sqe::read(0, 1, 0, 2).with_sgl(SglDescriptor::transport(BLOCK as u32));
    check(&mut io, &mut storage, short, &[], Status::DATA_SGL_LENGTH_INVALID);
    let in_capsule_read =
        Sqe::read(0, 1, 0, 1).with_sgl(SglDescriptor::in_capsule(0, BLOCK as u32));
    check(&mut io, &mut storage, in_capsule_read, &[], Status::INVALID_FIELD);
    let keyed = Sqe::read(0, 1, 0, 1).with_sgl(SglDescriptor {
        address: 0,
        length: 4096,
        descriptor_type: 0x40,
    });
    check(&mut io, &mut storage, keyed, &[], Status::SGL_DESCRIPTOR_TYPE_INVALID);
    check(
        &mut io,
        &mut storage,
        Sqe::read(0, 2, 0, 1).with_sgl(SglDescriptor::transport(4096)),
        &[],
        Status::INVALID_NAMESPACE_OR_FORMAT,
    );
    check(&mut io, &mut storage, Sqe::new(io_opcode::COMPARE, 0), &[], Status::INVALID_OPCODE);
    check(&mut io, &mut storage, Sqe::new(admin_opcode::IDENTIFY, 0), &[], Status::INVALID_OPCODE);
    let bad_ranges = DsmRange { context_attributes: 0, blocks: 8, slba: 1020 }.encode();
    check(
        &mut io,
        &mut storage,
        Sqe::dataset_management(0, 1, 1, true),
        &bad_ranges,
        Status::LBA_OUT_OF_RANGE,
    );
    check(
        &mut io,
        &mut storage,
        Sqe::property_get(0, property::CAP, PropertySize::Bytes8),
        &[],
        Status::INVALID_QUEUE_TYPE,
    );
    // Admin side.
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::VOLATILE_WRITE_CACHE, 1));
    assert_status(&cqe, Status::INVALID_FIELD);
    let (cqe, _) = admin.admin(Sqe::get_features(0, feature::VOLATILE_WRITE_CACHE, 0));
    assert_status(&cqe, Status::INVALID_FIELD);
    let (cqe, _) = admin.admin(Sqe::get_log_page(0, NSID_ALL, 0x05, 0, 4096));
    assert_status(&cqe, Status::INVALID_LOG_PAGE);
    let (cqe, _) = admin.admin(Sqe::get_log_page(0, NSID_ALL, log_page::DISCOVERY, 0, 1024));
    assert_status(&cqe, Status::INVALID_LOG_PAGE);
    let (cqe, _) = admin.admin(Sqe::identify(0, cns::NAMESPACE, 2, 0, 4096));
    assert_status(&cqe, Status::INVALID_NAMESPACE_OR_FORMAT);
    let (cqe, _) = admin.admin(Sqe::identify(0, 0x55, 0, 0, 4096));
    assert_status(&cqe, Status::INVALID_FIELD);
    let (cqe, _) = admin.admin(Sqe::disconnect(0));
    assert_status(&cqe, Status::INVALID_QUEUE_TYPE);
    let mut auth = Sqe::disconnect(0);
    auth.set_cdw(1, u32::from(crate::command::fctype::AUTHENTICATION_SEND));
    let (cqe, _) = admin.admin(auth);
    assert_status(&cqe, Status::INVALID_OPCODE);
    let (cqe, _) = admin.admin(Sqe::abort(0, 1, 5));
    assert!(cqe.status.is_success());
    assert_eq!(cqe.dw0() & 1, 1, "not aborted");

    // A storage failure maps to its status.
    storage.fail_reads = true;
    let (cqe, data) = io.exchange(&mut storage, read(0, 1), &[], false);
    assert_status(&cqe, Status::UNRECOVERED_READ_ERROR);
    assert!(data.is_empty());
    storage.fail_reads = false;
    let (cqe, _) = io.exchange(&mut storage, read(0, 1), &[], false);
    assert!(cqe.status.is_success());
    assert!(!io.queue.wants_close());
}

#[test]
fn commands_before_connect_or_enable_are_sequence_errors() {
    let fixture = fixture();
    let mut host = Host::new(&fixture.target);
    host.initialize(false, false, 0);
    let (cqe, _) = host.admin(Sqe::identify(0, cns::CONTROLLER, 0, 0, 4096));
    assert_status(&cqe, Status::COMMAND_SEQUENCE_ERROR);
    let (cqe, _) = host.admin(Sqe::property_get(0, property::CAP, PropertySize::Bytes8));
    assert_status(&cqe, Status::COMMAND_SEQUENCE_ERROR);
    assert!(host.connect(0, 31, CNTLID_DYNAMIC, &subnqn("db"), HOSTNQN).status.is_success());
    // Connected but CC.EN = 0.
    let (cqe, _) = host.admin(Sqe::identify(0, cns::CONTROLLER, 0, 0, 4096));
    assert_status(&cqe, Status::COMMAND_SEQUENCE_ERROR);
    let cqe = host.connect(0, 31, CNTLID_DYNAMIC, &subnqn("db"), HOSTNQN);
    assert_status(&cqe, Status::COMMAND_SEQUENCE_ERROR);
}

#[test]
fn connect_refusals() {
    let fixture = fixture();
    let mut host = Host::new(&fixture.target);
    host.initialize(false, false, 0);
    let unknown = subnqn("nope");
    let cqe = host.connect(0, 31, CNTLID_DYNAMIC, &unknown, HOSTNQN);
    assert_status(&cqe, Status::CONNECT_INVALID_PARAMETERS);
    assert_eq!(cqe.dw0(), 0x1_0100, "IATTR data, IPO 256 (SUBNQN)");
    let cqe = host.connect(0, 31, CNTLID_DYNAMIC, &subnqn("db"), "nqn.2014-08.test:banned");
    assert_status(&cqe, Status::CONNECT_INVALID_HOST);
    let cqe = host.connect(0, 0, CNTLID_DYNAMIC, &subnqn("db"), HOSTNQN);
    assert_status(&cqe, Status::CONNECT_INVALID_PARAMETERS);
    assert_eq!(cqe.dw0(), 44, "IATTR SQE, IPO 44 (SQSIZE)");
    let cqe = host.connect(0, 128, CNTLID_DYNAMIC, &subnqn("db"), HOSTNQN);
    assert_eq!(cqe.dw0(), 44);
    let cqe = host.connect(0, 31, 5, &subnqn("db"), HOSTNQN);
    assert_status(&cqe, Status::INVALID_FIELD);
    let mut sqe = Sqe::connect(0, 0, 31, 0);
    sqe.set_cdw(10, 1);
    let (cqe, _) = host.exchange(&mut Storage::default(), sqe, &[0; 1024], true);
    assert_status(&cqe, Status::CONNECT_INCOMPATIBLE_FORMAT);
    // I/O queue with an unknown controller ID.
    let cqe = host.connect(1, 31, 0x1234, &subnqn("db"), HOSTNQN);
    assert_status(&cqe, Status::CONNECT_INVALID_PARAMETERS);
    assert_eq!(cqe.dw0(), 0x1_0010, "IATTR data, IPO 16 (CNTLID)");
    assert_eq!(fixture.target.controller_count(), 0);

    // I/O queue naming a real controller with another host, subsystem or queue ID.
    let mut admin = Host::new(&fixture.target);
    let cntlid = admin.bring_up_admin(&subnqn("db"));
    let cqe = host.connect(1, 31, cntlid, &subnqn("db"), "nqn.2014-08.other:host");
    assert_eq!(cqe.dw0(), 0x1_0200, "IPO 512 (HOSTNQN)");
    let cqe = host.connect(1, 31, cntlid, &subnqn("logs"), HOSTNQN);
    assert_eq!(cqe.dw0(), 0x1_0100);
    let cqe = host.connect(65, 31, cntlid, &subnqn("db"), HOSTNQN);
    assert_eq!(cqe.dw0(), 42, "IPO 42 (QID)");
    assert!(host.connect(1, 31, cntlid, &subnqn("db"), HOSTNQN).status.is_success());
    let mut second = Host::new(&fixture.target);
    second.initialize(false, false, 0);
    let cqe = second.connect(1, 31, cntlid, &subnqn("db"), HOSTNQN);
    assert_status(&cqe, Status::COMMAND_SEQUENCE_ERROR);
}

#[test]
fn connect_data_by_r2t() {
    let fixture = fixture();
    let mut host = Host::new(&fixture.target);
    host.initialize(false, false, 0);
    let data = crate::command::ConnectData {
        host_id: HOST_ID,
        cntlid: CNTLID_DYNAMIC,
        subnqn: subnqn("db"),
        hostnqn: Nqn::new(HOSTNQN).unwrap(),
    };
    let mut bytes = Vec::new();
    data.encode(&mut bytes);
    let (cqe, _) = host.exchange(&mut Storage::default(), Sqe::connect(0, 0, 31, 0), &bytes, false);
    assert!(cqe.status.is_success(), "{cqe:?}");
    assert_eq!(cqe.sqhd, 1);
}

#[test]
fn discovery_controller_serves_the_log_page() {
    let fixture = fixture();
    let mut host = Host::new(&fixture.target);
    host.bring_up_admin(&Nqn::discovery());
    let (cqe, data) = host.admin(Sqe::identify(0, cns::CONTROLLER, 0, 0, 4096));
    assert!(cqe.status.is_success());
    let identify = IdentifyController::decode(&data).unwrap();
    assert_eq!(identify.cntrltype, controller_type::DISCOVERY);
    assert_eq!(identify.subnqn, types::DISCOVERY_NQN);
    let (cqe, _) = host.admin(Sqe::identify(0, cns::NAMESPACE, 1, 0, 4096));
    assert_status(&cqe, Status::INVALID_FIELD);

    // Header first, then everything, as hosts do.
    let (cqe, data) = host.admin(Sqe::get_log_page(0, 0, log_page::DISCOVERY, 0, 1024));
    assert!(cqe.status.is_success());
    let header = DiscoveryLogHeader::decode(&data).unwrap();
    assert_eq!(header.record_count, 3, "the discovery subsystem and two NVM subsystems");
    let total = DISCOVERY_LOG_RECORD_BYTES * (1 + header.record_count as usize);
    let (_, data) = host.admin(Sqe::get_log_page(0, 0, log_page::DISCOVERY, 0, total as u32));
    assert_eq!(DiscoveryLogHeader::decode(&data), Some(header));
    let entries: Vec<DiscoveryLogEntry> = data[1024..]
        .chunks_exact(1024)
        .map(|chunk| DiscoveryLogEntry::decode(chunk).unwrap())
        .collect();
    assert_eq!(entries[0].subnqn, types::DISCOVERY_NQN);
    assert_eq!(entries[0].subtype, crate::structures::subtype::CURRENT_DISCOVERY);
    assert_eq!(entries[1].subnqn, subnqn("db").as_str());
    assert_eq!(entries[2].subnqn, subnqn("logs").as_str());
    for entry in &entries {
        assert_eq!((entry.trtype, entry.adrfam), (3, 1));
        assert_eq!((entry.traddr.as_str(), entry.trsvcid.as_str()), ("127.0.0.1", "4420"));
        assert_eq!(entry.cntlid, 0xFFFF);
    }
    // An offset read (LPOL) returns the tail, padded with zeros past the end.
    let (_, tail) = host.admin(Sqe::get_log_page(0, 0, log_page::DISCOVERY, 3072, 2048));
    assert_eq!(&tail[..1024], &data[3072..4096]);
    assert!(tail[1024..].iter().all(|b| *b == 0));
    let (cqe, _) = host.admin(Sqe::get_log_page(0, 0, log_page::DISCOVERY, 8192, 1024));
    assert_status(&cqe, Status::INVALID_FIELD);

    // A change of subsystems bumps the generation and raises a notice.
    let (cqe, _) = host.admin(Sqe::set_features(0, feature::ASYNC_EVENT_CONFIGURATION, 1 << 31));
    assert!(cqe.status.is_success());
    let mut bytes = Vec::new();
    pdu::encode_capsule_cmd(&mut bytes, &host.framing, &Sqe::async_event_request(900), &[]);
    host.send(&bytes);
    fixture.target.notify_subsystems_changed();
    host.queue.poll(0);
    host.pump(&mut Storage::default());
    match host.receive_all().as_slice() {
        [Received::Response(cqe)] => {
            assert_eq!(cqe.cid, 900);
            assert_eq!(cqe.dw0(), 2 | (0xF0 << 8) | (0x70 << 16));
        }
        other => panic!("{other:?}"),
    }
    let (_, data) = host.admin(Sqe::get_log_page(0, 0, log_page::DISCOVERY, 0, 1024));
    assert_eq!(DiscoveryLogHeader::decode(&data).unwrap().generation, header.generation + 1);
}

#[test]
fn namespace_change_raises_an_event_and_resize_is_seen() {
    let fixture = fixture();
    let (mut admin, mut io) = io_queue(&fixture);
    let mut storage = Storage::default();
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::ASYNC_EVENT_CONFIGURATION, 1 << 8));
    assert!(cqe.status.is_success());
    let mut bytes = Vec::new();
    for cid in 500..504 {
        pdu::encode_capsule_cmd(&mut bytes, &admin.framing, &Sqe::async_event_request(cid), &[]);
    }
    // A fifth exceeds AERL.
    pdu::encode_capsule_cmd(&mut bytes, &admin.framing, &Sqe::async_event_request(504), &[]);
    admin.send(&bytes);
    admin.pump(&mut storage);
    match admin.receive_all().as_slice() {
        [Received::Response(cqe)] => {
            assert_eq!(cqe.cid, 504);
            assert_status(cqe, Status::ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED);
        }
        other => panic!("{other:?}"),
    }

    // Grow the volume: LBAs past the old end become valid.
    let (cqe, _) = io.exchange(&mut storage, read(1024, 1), &[], false);
    assert_status(&cqe, Status::LBA_OUT_OF_RANGE);
    fixture.size.store(2048, Ordering::Relaxed);
    fixture.target.notify_namespace_changed(&subnqn("db"));
    fixture.target.notify_namespace_changed(&subnqn("db"));
    let (cqe, _) = io.exchange(&mut storage, read(1024, 1), &[], false);
    assert!(cqe.status.is_success());

    admin.queue.poll(0);
    admin.pump(&mut storage);
    match admin.receive_all().as_slice() {
        [Received::Response(cqe)] => {
            assert_eq!(cqe.cid, 500);
            assert_eq!(cqe.dw0(), 2 | (0x04 << 16));
        }
        other => panic!("one notice until the log is read: {other:?}"),
    }
    let (_, data) =
        admin.admin(Sqe::get_log_page(0, NSID_ALL, log_page::CHANGED_NAMESPACE_LIST, 0, 4096));
    assert_eq!(&data[..8], &[1, 0, 0, 0, 0, 0, 0, 0]);
    let (_, data) =
        admin.admin(Sqe::get_log_page(0, NSID_ALL, log_page::CHANGED_NAMESPACE_LIST, 0, 4096));
    assert!(data.iter().all(|b| *b == 0), "reading clears the list");
    let (_, data) = admin.admin(Sqe::identify(0, cns::NAMESPACE, 1, 0, 4096));
    assert_eq!(IdentifyNamespace::decode(&data).unwrap().nsze, 2048);
}

#[test]
fn keep_alive_and_teardown() {
    let fixture = fixture();
    let (mut admin, mut io) = io_queue(&fixture);
    // KATO 5000 ms from Connect, rounded to the 1 s granularity.
    assert!(!admin.queue.keep_alive_expired(5000));
    assert!(admin.queue.keep_alive_expired(5001));
    admin.now_ms = 4000;
    let (cqe, _) = admin.admin(Sqe::keep_alive(0));
    assert!(cqe.status.is_success());
    assert!(!admin.queue.keep_alive_expired(9000));
    assert!(admin.queue.keep_alive_expired(9001));
    assert!(!io.queue.keep_alive_expired(1 << 40), "I/O queues follow their controller");
    // A queue that never connects expires.
    let idle = Queue::new(Arc::clone(&fixture.target), "idle".into(), 0);
    assert!(!idle.keep_alive_expired(CONNECT_DEADLINE_MS));
    assert!(idle.keep_alive_expired(CONNECT_DEADLINE_MS + 1));

    // Disconnect on the I/O queue, then a new I/O queue with the same ID is allowed.
    let cntlid = io.queue.cntlid().unwrap();
    let (cqe, _) = io.exchange(&mut Storage::default(), Sqe::disconnect(0), &[], false);
    assert!(cqe.status.is_success());
    assert!(io.queue.wants_close());
    assert_eq!(io.terminated, Some(Terminated::Disconnected));
    // The queue ID is free at once, and dropping the old queue later does not free it again.
    let mut again = Host::new(&fixture.target);
    again.initialize(false, false, 0);
    assert!(again.connect(1, 31, cntlid, &subnqn("db"), HOSTNQN).status.is_success());
    drop(io);
    let mut third = Host::new(&fixture.target);
    third.initialize(false, false, 0);
    assert_status(
        &third.connect(1, 31, cntlid, &subnqn("db"), HOSTNQN),
        Status::COMMAND_SEQUENCE_ERROR,
    );

    // Closing the admin queue closes the controller's I/O queues.
    drop(admin);
    assert!(again.queue.wants_close());
    again.queue.poll(0);
    assert_eq!(again.queue.receive(&[], 0), Err(Terminated::ControllerClosed));
}

#[test]
fn queue_overflow_terminates() {
    let fixture = fixture();
    let nqn = subnqn("db");
    let mut admin = Host::new(&fixture.target);
    let cntlid = admin.bring_up_admin(&nqn);
    let mut io = Host::new(&fixture.target);
    io.initialize(false, false, 0);
    assert!(io.connect(1, 3, cntlid, &nqn, HOSTNQN).status.is_success());
    // Four entries: four reads outstanding are tolerated, a fifth is not.
    let mut bytes = Vec::new();
    for cid in 0..5 {
        let mut sqe = read(cid, 1);
        sqe.set_cid(cid as u16 + 100);
        pdu::encode_capsule_cmd(&mut bytes, &io.framing, &sqe, &[]);
    }
    io.send(&bytes);
    io.expect_termination(FatalErrorStatus::PduSequenceError, 0);
}

#[test]
fn command_id_conflict() {
    let fixture = fixture();
    let (_admin, mut io) = io_queue(&fixture);
    let mut bytes = Vec::new();
    let mut sqe = read(0, 1);
    sqe.set_cid(7);
    pdu::encode_capsule_cmd(&mut bytes, &io.framing, &sqe, &[]);
    pdu::encode_capsule_cmd(&mut bytes, &io.framing, &sqe, &[]);
    io.send(&bytes);
    // No storage run: the first read is still outstanding when the second arrives.
    let output = drain_output(&mut io.queue);
    io.inbox.extend_from_slice(&output);
    match io.receive_all().as_slice() {
        [Received::Response(cqe)] => assert_status(cqe, Status::COMMAND_ID_CONFLICT),
        other => panic!("{other:?}"),
    }
    io.pump(&mut Storage::default());
    let received = io.receive_all();
    assert!(
        matches!(received.last(), Some(Received::Response(cqe)) if cqe.cid == 7 && cqe.status.is_success())
    );
}

#[test]
fn host_termination_closes_quietly() {
    let fixture = fixture();
    let (_admin, mut io) = io_queue(&fixture);
    let mut bytes = Vec::new();
    pdu::encode_term_req(
        &mut bytes,
        Role::Host,
        FatalErrorStatus::HeaderDigestError,
        0,
        &[1, 2, 3],
    );
    io.send(&bytes);
    assert_eq!(io.terminated, Some(Terminated::ByHost { fes: 3, fei: 0 }));
    assert_eq!(io.queue.output_len(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Arbitrary bytes after a valid set-up never panic the queue, and whatever it sends still
    /// decodes.
    #[test]
    fn queue_survives_arbitrary_input(
        chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 1..8),
        valid_prefix in any::<bool>(),
    ) {
        let fixture = fixture();
        let (_admin, mut io) = io_queue(&fixture);
        let mut storage = Storage::default();
        for chunk in &chunks {
            let mut bytes = Vec::new();
            if valid_prefix {
                // A well-formed capsule header whose SQE is the random bytes.
                let mut sqe = [0u8; 64];
                let take = chunk.len().min(64);
                sqe[..take].copy_from_slice(&chunk[..take]);
                pdu::encode_capsule_cmd(&mut bytes, &io.framing, &Sqe::from_bytes(sqe), &chunk[take..]);
            } else {
                bytes.extend_from_slice(chunk);
            }
            io.send(&bytes);
            io.pump(&mut storage);
            let _ = io.receive_all();
            if io.terminated.is_some() {
                break;
            }
        }
    }
}

/// A write-protected namespace (a snapshot) says so in Identify Namespace and refuses Write,
/// Write Zeroes and Deallocate before any storage request, while reads work.
#[test]
fn a_write_protected_namespace_refuses_writes_and_says_so() {
    let size = Arc::new(AtomicU64::new(64));
    let snapshot = NamespaceInfo { read_only: true, ..namespace(9, &size) };
    let catalog = TestCatalog { namespaces: vec![(subnqn("snap"), snapshot)] };
    let target = Arc::new(Target::new(TargetConfig::default(), Arc::new(catalog)));
    let nqn = subnqn("snap");
    let mut admin = Host::new(&target);
    let cntlid = admin.bring_up_admin(&nqn);
    let (cqe, data) = admin.admin(Sqe::identify(0, cns::NAMESPACE, 1, 0, 4096));
    assert!(cqe.status.is_success(), "{cqe:?}");
    assert_eq!(data[99] & 1, 1, "NSATTR: write protected");
    let mut io = Host::new(&target);
    io.initialize(false, false, 0);
    assert!(io.connect(1, 31, cntlid, &nqn, HOSTNQN).status.is_success());
    let mut storage = Storage::default();
    let (cqe, _) = io.exchange(&mut storage, write(0, 1), &pattern(BLOCK, 3), true);
    assert_status(&cqe, Status::NAMESPACE_WRITE_PROTECTED);
    let (cqe, _) = io.exchange(&mut storage, Sqe::write_zeroes(0, 1, 0, 4, false), &[], true);
    assert_status(&cqe, Status::NAMESPACE_WRITE_PROTECTED);
    assert!(storage.blocks.is_empty(), "nothing reached storage");
    let (cqe, data) = io.exchange(&mut storage, read(0, 1), &[], true);
    assert!(cqe.status.is_success(), "{cqe:?}");
    assert_eq!(data, vec![0; BLOCK]);
}

/// Takes everything the queue has to send, in sends of an odd size that end inside PDU headers
/// and inside spliced Read data, as a socket taking part of a write would.
pub(super) fn drain_output(queue: &mut Queue) -> Vec<u8> {
    const SEND_BYTES: usize = 4093;
    let mut sent = Vec::with_capacity(queue.output_len());
    while queue.output_len() > 0 {
        assert_eq!(queue.output_chunks().map(<[u8]>::len).sum::<usize>(), queue.output_len());
        assert!(queue.output_chunks().all(|chunk| !chunk.is_empty()));
        let next: Vec<u8> = queue.output_chunks().flatten().take(SEND_BYTES).copied().collect();
        sent.extend_from_slice(&next);
        queue.consume_output(next.len());
    }
    sent
}
