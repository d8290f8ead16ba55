//! Byte-level replays of what the Linux kernel host (drivers/nvme/host/tcp.c, fabrics.c, core.c,
//! multipath.c) and SPDK's host (lib/nvme/nvme_tcp.c, nvme_ctrlr.c, nvme_fabric.c) send, from
//! the first ICReq through namespace scan and the first I/O, with every response field those
//! hosts parse checked the way they check it.
//!
//! The commands are built here byte by byte from the NVMe and NVMe/TCP layouts, not with the
//! crate's own builders, so a layout mistake shared by an encoder and its decoder cannot hide.
//! docs/nvme-tcp.md lists, per host, the commands and the fields checked here.

use std::sync::Arc;

use super::tests::{fixture, subnqn, Fixture, Host, Received, Storage, BLOCK};
use super::{AnaState, Target, ANA_GROUP_ID};
use crate::command::{Cqe, Status};
use crate::pdu::{self, DataHeader, R2T};
use crate::structures::{
    ana_state, lba_format, lba_format_index, AnaLog, IdentifyController, IdentifyNamespace,
    NamespaceIdentifiers,
};

/// Linux's default host NQN form and a host ID, as `nvme gen-hostnqn` makes them.
const LINUX_HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:8b1c7a4e-2f3d-4c5b-9a6e-1f2e3d4c5b6a";
const LINUX_HOSTID: [u8; 16] = [
    0x8b, 0x1c, 0x7a, 0x4e, 0x2f, 0x3d, 0x4c, 0x5b, 0x9a, 0x6e, 0x1f, 0x2e, 0x3d, 0x4c, 0x5b, 0x6a,
];
const SPDK_HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000aa";

/// A raw 64-byte SQE, laid out as `struct nvme_command`.
#[derive(Clone, Copy)]
struct RawSqe([u8; 64]);

impl RawSqe {
    /// Opcode, FLAGS = 0x40 (PSDT 01b: SGL, metadata buffer) and CID, as both hosts set them.
    fn new(opcode: u8, cid: u16) -> RawSqe {
        let mut bytes = [0u8; 64];
        bytes[0] = opcode;
        bytes[1] = 0x40;
        bytes[2..4].copy_from_slice(&cid.to_le_bytes());
        RawSqe(bytes)
    }

    fn nsid(mut self, nsid: u32) -> RawSqe {
        self.0[4..8].copy_from_slice(&nsid.to_le_bytes());
        self
    }

    fn cdw(mut self, index: usize, value: u32) -> RawSqe {
        self.0[4 * index..4 * index + 4].copy_from_slice(&value.to_le_bytes());
        self
    }

    /// `nvme_tcp_set_sg_null` / SPDK's zero-length transport SGL: type 5Ah, length 0.
    fn sgl_null(mut self) -> RawSqe {
        self.0[24..40].fill(0);
        self.0[39] = 0x5A;
        self
    }

    /// Transport SGL data block (data by R2T/H2CData or C2HData).
    fn sgl_transport(mut self, length: u32) -> RawSqe {
        self.0[24..40].fill(0);
        self.0[32..36].copy_from_slice(&length.to_le_bytes());
        self.0[39] = 0x5A;
        self
    }

    /// Data block with offset: address = ICDOFF (0), in-capsule data.
    fn sgl_inline(mut self, length: u32) -> RawSqe {
        self.0[24..40].fill(0);
        self.0[32..36].copy_from_slice(&length.to_le_bytes());
        self.0[39] = 0x01;
        self
    }

    /// A Fabrics command: opcode 7Fh, FCTYPE at byte 4.
    fn fabrics(fctype: u8, cid: u16) -> RawSqe {
        let mut sqe = RawSqe::new(0x7F, cid);
        sqe.0[4] = fctype;
        sqe
    }

    fn connect(cid: u16, qid: u16, sqsize: u16, cattr: u8, kato_ms: u32) -> RawSqe {
        let mut sqe = RawSqe::fabrics(0x01, cid).sgl_inline(1024);
        sqe.0[40..42].copy_from_slice(&0u16.to_le_bytes()); // RECFMT 0
        sqe.0[42..44].copy_from_slice(&qid.to_le_bytes());
        sqe.0[44..46].copy_from_slice(&sqsize.to_le_bytes());
        sqe.0[46] = cattr;
        sqe.0[48..52].copy_from_slice(&kato_ms.to_le_bytes());
        sqe
    }

    fn property_get(cid: u16, offset: u32, eight_bytes: bool) -> RawSqe {
        let mut sqe = RawSqe::fabrics(0x04, cid).sgl_null();
        sqe.0[40] = u8::from(eight_bytes);
        sqe.0[44..48].copy_from_slice(&offset.to_le_bytes());
        sqe
    }

    fn property_set(cid: u16, offset: u32, value: u32) -> RawSqe {
        let mut sqe = RawSqe::fabrics(0x00, cid).sgl_null();
        sqe.0[44..48].copy_from_slice(&offset.to_le_bytes());
        sqe.0[48..52].copy_from_slice(&value.to_le_bytes());
        sqe
    }

    /// Identify: CNS in CDW10 bits 7:0, CSI in CDW11 bits 31:24, 4096 bytes.
    fn identify(cid: u16, cns: u8, nsid: u32, csi: u8) -> RawSqe {
        RawSqe::new(0x06, cid)
            .nsid(nsid)
            .cdw(10, u32::from(cns))
            .cdw(11, u32::from(csi) << 24)
            .sgl_transport(4096)
    }

    /// Get Log Page as `nvme_get_log` builds it: LID, LSP, NUMDL/NUMDU, LPOL/LPOU, CSI.
    fn get_log_page(cid: u16, nsid: u32, lid: u8, lsp: u8, length: u32) -> RawSqe {
        let numd = length / 4 - 1;
        RawSqe::new(0x02, cid)
            .nsid(nsid)
            .cdw(10, u32::from(lid) | (u32::from(lsp) << 8) | ((numd & 0xFFFF) << 16))
            .cdw(11, numd >> 16)
            .sgl_transport(length)
    }

    fn set_features(cid: u16, fid: u8, cdw11: u32) -> RawSqe {
        RawSqe::new(0x09, cid).cdw(10, u32::from(fid)).cdw(11, cdw11).sgl_null()
    }

    fn get_features(cid: u16, fid: u8) -> RawSqe {
        RawSqe::new(0x0A, cid).cdw(10, u32::from(fid)).sgl_null()
    }

    /// Read or Write: SLBA in CDW10-11, NLB (0's based) in CDW12.
    fn rw(opcode: u8, cid: u16, slba: u64, blocks: u32) -> RawSqe {
        RawSqe::new(opcode, cid)
            .nsid(1)
            .cdw(10, slba as u32)
            .cdw(11, (slba >> 32) as u32)
            .cdw(12, blocks - 1)
    }
}

/// The raw ICReq of both hosts: PFV 0, HPDA 0, digests as asked, MAXR2T 0 (one R2T).
fn icreq_bytes(header_digest: bool, data_digest: bool) -> Vec<u8> {
    let mut bytes = vec![0u8; 128];
    bytes[0] = 0x00; // ICReq
    bytes[2] = 128; // HLEN
    bytes[4..8].copy_from_slice(&128u32.to_le_bytes()); // PLEN
    bytes[11] = u8::from(header_digest) | (u8::from(data_digest) << 1);
    bytes
}

/// A raw CapsuleCmd PDU: common header, SQE, header digest, in-capsule data, data digest.
/// Neither host pads (CPDA 0).
fn capsule_bytes(sqe: &RawSqe, data: &[u8], header_digest: bool, data_digest: bool) -> Vec<u8> {
    let hdgst = if header_digest { 4 } else { 0 };
    let ddgst = if data_digest && !data.is_empty() { 4 } else { 0 };
    let plen = 72 + hdgst + data.len() + ddgst;
    let mut flags = 0;
    if header_digest {
        flags |= 0x01;
    }
    if ddgst > 0 {
        flags |= 0x02;
    }
    let pdo = if data.is_empty() { 0 } else { 72 + hdgst } as u8;
    let mut bytes = vec![0x04, flags, 72, pdo];
    bytes.extend_from_slice(&(plen as u32).to_le_bytes());
    bytes.extend_from_slice(&sqe.0);
    if header_digest {
        let digest = crc32c::crc32c(&bytes[..72]);
        bytes.extend_from_slice(&digest.to_le_bytes());
    }
    bytes.extend_from_slice(data);
    if ddgst > 0 {
        bytes.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    }
    bytes
}

/// A raw H2CData PDU answering an R2T: LAST_PDU on the last one of the R2T.
fn h2c_bytes(
    r2t: &R2T,
    offset: u32,
    data: &[u8],
    last: bool,
    header_digest: bool,
    data_digest: bool,
) -> Vec<u8> {
    let hdgst = if header_digest { 4 } else { 0 };
    let ddgst = if data_digest { 4 } else { 0 };
    let plen = 24 + hdgst + data.len() + ddgst;
    let flags =
        u8::from(header_digest) | (u8::from(data_digest) << 1) | if last { 0x04 } else { 0 };
    let mut bytes = vec![0x06, flags, 24, 24 + hdgst as u8];
    bytes.extend_from_slice(&(plen as u32).to_le_bytes());
    bytes.extend_from_slice(&r2t.cccid.to_le_bytes());
    bytes.extend_from_slice(&r2t.ttag.to_le_bytes());
    bytes.extend_from_slice(&offset.to_le_bytes());
    bytes.extend_from_slice(&(data.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&[0; 4]);
    if header_digest {
        let digest = crc32c::crc32c(&bytes[..24]);
        bytes.extend_from_slice(&digest.to_le_bytes());
    }
    bytes.extend_from_slice(data);
    if data_digest {
        bytes.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    }
    bytes
}

/// The 1024 bytes of Connect data.
fn connect_data(hostid: &[u8; 16], cntlid: u16, subnqn: &str, hostnqn: &str) -> Vec<u8> {
    let mut data = vec![0u8; 1024];
    data[0..16].copy_from_slice(hostid);
    data[16..18].copy_from_slice(&cntlid.to_le_bytes());
    data[256..256 + subnqn.len()].copy_from_slice(subnqn.as_bytes());
    data[512..512 + hostnqn.len()].copy_from_slice(hostnqn.as_bytes());
    data
}

/// One host connection speaking raw bytes over the test harness.
struct Wire {
    host: Host,
    header_digest: bool,
    data_digest: bool,
}

impl Wire {
    /// TCP connect and ICReq/ICResp, checking ICResp as `nvme_tcp_init_connection` and SPDK's
    /// `nvme_tcp_icresp_handle` do.
    fn open(target: &Arc<Target>, port_id: u16, header_digest: bool, data_digest: bool) -> Wire {
        let mut host = Host::new_on_port(target, port_id);
        host.send(&icreq_bytes(header_digest, data_digest));
        host.pump(&mut Storage::default());
        assert_eq!(host.queue.output_len(), 0, "pump drained the output");
        let raw = std::mem::take(&mut host.inbox);
        assert_eq!(raw.len(), 128, "exactly one ICResp");
        assert_eq!(raw[0], 0x01, "type ICResp");
        assert_eq!(raw[2], 128, "HLEN");
        assert_eq!(u32::from_le_bytes(raw[4..8].try_into().unwrap()), 128, "PLEN");
        assert_eq!(u16::from_le_bytes([raw[8], raw[9]]), 0, "PFV 1.0");
        assert_eq!(raw[10], 0, "CPDA: Linux refuses any other");
        assert_eq!(raw[11] & 1 != 0, header_digest, "HDGST_ENABLE as asked");
        assert_eq!(raw[11] & 2 != 0, data_digest, "DDGST_ENABLE as asked");
        let maxh2cdata = u32::from_le_bytes(raw[12..16].try_into().unwrap());
        assert!(maxh2cdata >= 4096 && maxh2cdata % 4 == 0, "MAXH2CDATA {maxh2cdata}");
        host.framing.header_digest = header_digest;
        host.framing.data_digest = data_digest;
        host.maxh2cdata = maxh2cdata;
        Wire { host, header_digest, data_digest }
    }

    fn send(&mut self, sqe: &RawSqe, data: &[u8]) {
        let bytes = capsule_bytes(sqe, data, self.header_digest, self.data_digest);
        self.host.send(&bytes);
        assert!(self.host.terminated.is_none(), "{:?}", self.host.terminated);
    }

    /// Sends a command and returns its completion and C2H data; checks the C2HData PDUs the
    /// way both hosts do (in order, within the command's length, LAST_PDU on the last).
    fn command(&mut self, storage: &mut Storage, sqe: RawSqe, data: &[u8]) -> (Cqe, Vec<u8>) {
        let cid = u16::from_le_bytes([sqe.0[2], sqe.0[3]]);
        let expected_length = u32::from_le_bytes(sqe.0[32..36].try_into().unwrap()) as usize;
        let writes_by_r2t = sqe.0[39] == 0x5A && sqe.0[0] & 0x3 == 0x1 && !data.is_empty();
        self.send(&sqe, if writes_by_r2t { &[] } else { data });
        let mut received = Vec::new();
        let mut last_seen = false;
        for _ in 0..64 {
            self.host.pump(storage);
            for item in self.host.receive_all() {
                match item {
                    Received::Response(cqe) if cqe.cid == cid => {
                        assert_eq!(received.is_empty(), !last_seen, "LAST_PDU on the last C2HData");
                        return (cqe, received);
                    }
                    Received::Data(header, bytes) if header.cccid == cid => {
                        assert_eq!(header.datao as usize, received.len(), "C2HData in order");
                        assert!(!last_seen, "no C2HData after LAST_PDU");
                        received.extend_from_slice(&bytes);
                        assert!(received.len() <= expected_length, "C2HData beyond the SGL");
                        last_seen = header.last;
                        if header.success {
                            let cqe = Cqe { cid, ..Cqe::default() };
                            return (cqe, received);
                        }
                    }
                    Received::R2T(r2t) if r2t.cccid == cid => {
                        let end = (r2t.r2to + r2t.r2tl) as usize;
                        let mut offset = r2t.r2to as usize;
                        let mut bytes = Vec::new();
                        // Linux cuts H2CData at MAXH2CDATA.
                        while offset < end {
                            let length = (self.host.maxh2cdata as usize).min(end - offset);
                            let last = offset + length == end;
                            let piece = &data[offset..offset + length];
                            bytes.extend_from_slice(&h2c_bytes(
                                &r2t,
                                offset as u32,
                                piece,
                                last,
                                self.header_digest,
                                self.data_digest,
                            ));
                            offset += length;
                        }
                        self.host.send(&bytes);
                    }
                    other => panic!("unexpected {other:?} while waiting for CID {cid:#x}"),
                }
            }
        }
        panic!("no completion for CID {cid:#x}");
    }

    fn admin(&mut self, sqe: RawSqe) -> (Cqe, Vec<u8>) {
        let (cqe, data) = self.command(&mut Storage::default(), sqe, &[]);
        assert!(cqe.status.is_success(), "{cqe:?}");
        (cqe, data)
    }

    fn connect(&mut self, sqe: RawSqe, data: &[u8]) -> Cqe {
        let (cqe, _) = self.command(&mut Storage::default(), sqe, data);
        cqe
    }
}

/// What Linux checks of Identify Controller in `nvme_init_identify`, `nvme_tcp_setup_ctrl` and
/// `nvme_mpath_init_identify`.
fn check_identify_controller_like_linux(
    data: &[u8],
    cntlid: u16,
    subnqn: &str,
) -> IdentifyController {
    let identify = IdentifyController::decode(data).unwrap();
    assert_eq!(identify.cntlid, cntlid, "Mismatching cntlid: Connect vs Identify");
    assert_ne!(identify.kas, 0, "keep-alive support is mandatory for fabrics");
    assert_eq!(identify.icdoff, 0, "icdoff is not supported");
    assert_ne!(identify.sgls & 0x3, 0, "Mandatory sgls are not supported");
    assert!(identify.ioccsz >= 4, "IOCCSZ holds at least the SQE");
    assert_eq!(identify.iorcsz, 1);
    assert!(identify.maxcmd >= 32, "MAXCMD clamps the queue size");
    assert_eq!(identify.subnqn, subnqn);
    assert!(!identify.serial_number.is_empty() && !identify.model_number.is_empty());
    assert_eq!(identify.vwc & 1, 0, "no volatile write cache: no Flush needed");
    // Multipath: a multi-controller subsystem with ANA reporting.
    assert_ne!(identify.cmic & 0x2, 0, "CMIC multi-controller");
    assert_ne!(identify.cmic & 0x8, 0, "CMIC ANA reporting");
    assert!(identify.mnan >= 1 && identify.mnan <= identify.nn, "Invalid MNAN value");
    assert!(identify.nanagrpid >= 1 && identify.anagrpmax >= identify.nanagrpid);
    assert_ne!(identify.anatt, 0);
    assert_eq!(identify.anacap & 0x1F, 0x1F, "every ANA state reported");
    assert_ne!(identify.oaes & (1 << 11), 0, "ANA change notices");
    assert_ne!(identify.oaes & (1 << 8), 0, "namespace attribute notices");
    let page_bytes = 4096usize;
    let ana_log_bytes = 16 + 32 * identify.nanagrpid as usize + 4 * identify.mnan as usize;
    assert!(ana_log_bytes <= page_bytes << identify.mdts, "ANA log page larger than MDTS");
    identify
}

/// What `nvme_parse_ana_log` accepts.
fn check_ana_log_like_linux(data: &[u8], anagrpmax: u32) -> AnaLog {
    let log = AnaLog::decode(data).unwrap();
    for group in &log.groups {
        assert_ne!(group.grpid, 0);
        assert!(group.grpid <= anagrpmax);
        assert!(group.state != 0 && group.state <= ana_state::CHANGE);
    }
    log
}

fn ana_state_of(log: &AnaLog, grpid: u32) -> u8 {
    log.groups.iter().find(|group| group.grpid == grpid).map_or(0, |group| group.state)
}

/// `nvme connect -t tcp -a ADDR -s PORT -n NQN` on Linux 6.x with its defaults (kato 5 s,
/// queue_size 128, no digests; then with both digests), through the scan and the first I/O:
/// the partition table read, an in-capsule write and an R2T write. Then an ANA change reaches
/// the host by AER and the ANA log, I/O on the inaccessible path fails with a path status, and
/// `nvme disconnect` shuts the controller down.
#[test]
fn linux_host_replay() {
    for digests in [false, true] {
        let Fixture { target, .. } = fixture();
        let nqn = subnqn("db");
        let mut storage = Storage::default();
        let port_id = target.default_port_id();

        // Admin queue: connect, with the reserved tag Linux gives fabrics commands.
        let mut admin = Wire::open(&target, port_id, digests, digests);
        let data = connect_data(&LINUX_HOSTID, 0xFFFF, nqn.as_str(), LINUX_HOSTNQN);
        let cqe = admin.connect(RawSqe::connect(0x001F, 0, 31, 0, 5000), &data);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let cntlid = (cqe.dw0() & 0xFFFF) as u16;
        assert_eq!(cqe.dw0() >> 16 & 0x3, 0, "AUTHREQ: no authentication");
        assert_eq!(cqe.sqid, 0);

        // nvme_enable_ctrl: CAP, CC without EN, CAP again, CC with EN, CSTS until RDY.
        let (cqe, _) = admin.admin(RawSqe::property_get(0x1000, 0x00, true));
        let cap = cqe.result;
        assert_eq!((cap >> 48) & 0xF, 0, "MPSMIN 4 KiB: Linux's page size");
        assert_ne!(cap & (1 << 37), 0, "CAP.CSS NVM");
        assert_eq!(cap & (1 << 43), 0, "no I/O command set selection: CC.CSS stays 0");
        let mqes = (cap & 0xFFFF) as u16;
        assert!(mqes >= 127, "queue_size 128 fits");
        assert_ne!((cap >> 24) & 0xFF, 0, "CAP.TO bounds the ready wait");
        admin.admin(RawSqe::property_set(0x1001, 0x14, 0x0046_0000));
        admin.admin(RawSqe::property_get(0x1002, 0x00, true));
        admin.admin(RawSqe::property_set(0x1003, 0x14, 0x0046_0001));
        let (cqe, _) = admin.admin(RawSqe::property_get(0x1004, 0x1C, false));
        assert_eq!(cqe.result & 0x3, 0x1, "CSTS.RDY without CFS");

        // nvme_init_ctrl_finish: VS, Identify Controller, the ANA log, CNS 06h, the SMART log.
        let (cqe, _) = admin.admin(RawSqe::property_get(0x1005, 0x08, false));
        assert!(cqe.result as u32 >= 0x0001_0300, "VS 1.3 or later: descriptor list used");
        let (_, data) = admin.admin(RawSqe::identify(0x1006, 0x01, 0, 0));
        assert_eq!(data.len(), 4096);
        let identify = check_identify_controller_like_linux(&data, cntlid, nqn.as_str());
        let ana_log_bytes = 16 + 32 * identify.nanagrpid + 4 * identify.mnan;
        let ana_log = RawSqe::get_log_page(0x1007, 0xFFFF_FFFF, 0x0C, 0, ana_log_bytes);
        let (_, data) = admin.admin(ana_log);
        assert_eq!(data.len(), ana_log_bytes as usize);
        let log = check_ana_log_like_linux(&data, identify.anagrpmax);
        assert_eq!(ana_state_of(&log, ANA_GROUP_ID), ana_state::OPTIMIZED);
        assert_eq!(log.groups[0].nsids, [1]);
        let (_, data) = admin.admin(RawSqe::identify(0x1008, 0x06, 0, 0));
        assert!(data[..16].iter().all(|b| *b == 0), "no DMRL/DMRSL/WZSL limits");
        let (_, data) = admin.admin(RawSqe::get_log_page(0x1009, 0xFFFF_FFFF, 0x02, 0, 512));
        assert_eq!(data.len(), 512);

        // nvme_tcp_alloc_io_queues: Set Features Number of Queues for 2 queues.
        let (cqe, _) = admin.admin(RawSqe::set_features(0x100A, 0x07, 0x0001_0001));
        let granted = (cqe.dw0() & 0xFFFF).min(cqe.dw0() >> 16) + 1;
        assert_eq!(granted, 2);

        // I/O queues 1 and 2: ICReq, Connect with sqsize 127 and no KATO, data in capsule
        // (IOCCSZ * 16 - 64 bytes fit 1024).
        assert!(identify.ioccsz as usize * 16 - 64 >= 1024);
        let mut io_queues = Vec::new();
        for qid in 1..=2u16 {
            let mut io = Wire::open(&target, port_id, digests, digests);
            let data = connect_data(&LINUX_HOSTID, cntlid, nqn.as_str(), LINUX_HOSTNQN);
            let cqe = io.connect(RawSqe::connect(0x007F, qid, 127, 0, 0), &data);
            assert!(cqe.status.is_success(), "{cqe:?}");
            assert_eq!(cqe.dw0() & 0xFFFF, u32::from(cntlid));
            assert_eq!(cqe.sqid, qid);
            io_queues.push(io);
        }

        // nvme_start_ctrl: Async Event Configuration from OAES, one AER (CID 31 in Linux's
        // TCP driver), a Keep Alive at KATO / 2.
        let supported = identify.oaes & ((1 << 8) | (1 << 9) | (1 << 11) | (1 << 31));
        admin.admin(RawSqe::set_features(0x100B, 0x0B, supported));
        admin.send(&RawSqe::new(0x0C, 31).sgl_null(), &[]);
        admin.host.now_ms = 2500;
        admin.admin(RawSqe::new(0x18, 0x100C).sgl_null());

        // nvme_scan_work: active list, descriptors, CS independent, Identify Namespace.
        let (_, data) = admin.admin(RawSqe::identify(0x100D, 0x02, 0, 0));
        assert_eq!(crate::structures::decode_active_namespace_list(&data), Some(vec![1]));
        let (_, data) = admin.admin(RawSqe::identify(0x100E, 0x03, 1, 0));
        let ids = NamespaceIdentifiers::decode(&data).unwrap();
        assert_eq!((ids.nguid, ids.uuid, ids.eui64, ids.csi), ([7; 16], [8; 16], [9; 8], 0));
        // Descriptor lengths are the ones Linux insists on: EUI64 8, NGUID 16, UUID 16, CSI 1.
        assert_eq!(
            (data[0], data[1], data[12], data[13], data[32], data[33]),
            (1, 8, 2, 16, 3, 16)
        );
        assert_eq!((data[52], data[53]), (4, 1));
        let (_, data) = admin.admin(RawSqe::identify(0x100F, 0x08, 1, 0));
        assert_eq!(data[1] & 1, 1, "NMIC shared");
        assert_eq!(u32::from_le_bytes(data[4..8].try_into().unwrap()), ANA_GROUP_ID);
        assert_eq!(data[14] & 1, 1, "NSTAT ready");
        let (_, data) = admin.admin(RawSqe::identify(0x1010, 0x00, 1, 0));
        let namespace = IdentifyNamespace::decode(&data).unwrap();
        assert_ne!(namespace.ncap, 0, "namespace not allocated or attached");
        assert_eq!(namespace.nsze, 1024);
        assert_eq!(namespace.anagrpid, ANA_GROUP_ID);
        assert_eq!(namespace.nmic & 1, 1);
        assert_eq!(data[99] & 1, 0, "NSATTR: not read-only");
        let format = lba_format(&data, lba_format_index(namespace.flbas, namespace.nlbaf)).unwrap();
        assert_eq!((format.metadata_bytes, 1usize << format.lba_data_size_log2), (0, BLOCK));

        // First I/O: the partition table read, an in-capsule write, a write by R2T.
        let io = &mut io_queues[0];
        let read = RawSqe::rw(0x02, 0x2000, 0, 1).sgl_transport(4096);
        let (cqe, data) = io.command(&mut storage, read, &[]);
        assert!(cqe.status.is_success() && data == [0u8; 4096]);
        assert_eq!(cqe.sqid, 1);
        let block: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect();
        let write = RawSqe::rw(0x01, 0x2001, 8, 1).sgl_inline(4096);
        let (cqe, _) = io.command(&mut storage, write, &block);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let large: Vec<u8> = (0..256 * 1024).map(|i| (i % 241) as u8).collect();
        let write = RawSqe::rw(0x01, 0x2002, 64, 64).sgl_transport(large.len() as u32);
        let (cqe, _) = io.command(&mut storage, write, &large);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let read = RawSqe::rw(0x02, 0x2003, 64, 64).sgl_transport(large.len() as u32);
        let (_, data) = io_queues[1].command(&mut storage, read, &[]);
        assert_eq!(data, large);

        // The node makes this path inaccessible: the AER completes with an ANA change notice
        // naming log page 0Ch, the host rereads the ANA log, and I/O gets a path error.
        target.set_ana_state(&nqn, port_id, AnaState::Inaccessible);
        admin.host.queue.poll(admin.host.now_ms);
        admin.host.pump(&mut storage);
        match admin.host.receive_all().as_slice() {
            [Received::Response(cqe)] => {
                assert_eq!(cqe.cid, 31);
                assert_eq!(cqe.dw0(), 0x2 | (0x03 << 8) | (0x0C << 16), "notice, ANA change");
            }
            other => panic!("expected the AER completion, got {other:?}"),
        }
        let (_, data) =
            admin.admin(RawSqe::get_log_page(0x1011, 0xFFFF_FFFF, 0x0C, 0, ana_log_bytes));
        let log = check_ana_log_like_linux(&data, identify.anagrpmax);
        assert_eq!(ana_state_of(&log, ANA_GROUP_ID), ana_state::INACCESSIBLE);
        admin.send(&RawSqe::new(0x0C, 31).sgl_null(), &[]);
        let read = RawSqe::rw(0x02, 0x2004, 0, 1).sgl_transport(4096);
        let (cqe, data) = io_queues[0].command(&mut storage, read, &[]);
        assert!(data.is_empty());
        assert_eq!(cqe.status.raw() & 0x7FF, 0x302, "Asymmetric Access Inaccessible");
        assert!(cqe.status.is_path_error() && !cqe.status.do_not_retry(), "retried elsewhere");
        // Back to optimized: a second notice on the resubmitted AER, the log says so.
        target.set_ana_state(&nqn, port_id, AnaState::Optimized);
        admin.host.queue.poll(admin.host.now_ms);
        admin.host.pump(&mut storage);
        match admin.host.receive_all().as_slice() {
            [Received::Response(cqe)] => assert_eq!((cqe.cid, cqe.dw0()), (31, 0x000C_0302)),
            other => panic!("expected the AER completion, got {other:?}"),
        }
        let (_, data) =
            admin.admin(RawSqe::get_log_page(0x1014, 0xFFFF_FFFF, 0x0C, 0, ana_log_bytes));
        assert_eq!(ana_state_of(&AnaLog::decode(&data).unwrap(), ANA_GROUP_ID), 1);
        assert!(log.change_count < AnaLog::decode(&data).unwrap().change_count, "CHGCNT grows");
        let read = RawSqe::rw(0x02, 0x2005, 8, 1).sgl_transport(4096);
        let (cqe, data) = io_queues[0].command(&mut storage, read, &[]);
        assert!(cqe.status.is_success() && data == block);

        // `nvme disconnect`: CC.SHN normal with EN still set, CSTS until SHST complete.
        admin.admin(RawSqe::property_set(0x1012, 0x14, 0x0046_4001));
        let (cqe, _) = admin.admin(RawSqe::property_get(0x1013, 0x1C, false));
        assert_eq!(cqe.result & 0xC, 0x8, "CSTS.SHST complete");
        drop(admin);
        assert!(io_queues.iter().all(|io| io.host.queue.wants_close()));
        assert_eq!(target.controller_count(), 0);
    }
}

/// `nvme discover -t tcp` on Linux: the discovery controller (no KATO), Identify, the log
/// header, then the whole log; every entry as nvme-cli prints it.
#[test]
fn linux_discover_replay() {
    let Fixture { target, .. } = fixture();
    let mut wire = Wire::open(&target, target.default_port_id(), false, false);
    let discovery = types::DISCOVERY_NQN;
    let data = connect_data(&LINUX_HOSTID, 0xFFFF, discovery, LINUX_HOSTNQN);
    let cqe = wire.connect(RawSqe::connect(0x001F, 0, 31, 0, 0), &data);
    assert!(cqe.status.is_success(), "{cqe:?}");
    let cntlid = cqe.dw0() as u16;
    wire.admin(RawSqe::property_get(0x1000, 0x00, true));
    wire.admin(RawSqe::property_set(0x1001, 0x14, 0x0046_0000));
    wire.admin(RawSqe::property_set(0x1002, 0x14, 0x0046_0001));
    let (cqe, _) = wire.admin(RawSqe::property_get(0x1003, 0x1C, false));
    assert_eq!(cqe.result & 1, 1);
    let (_, data) = wire.admin(RawSqe::identify(0x1004, 0x01, 0, 0));
    let identify = IdentifyController::decode(&data).unwrap();
    assert_eq!((identify.cntlid, identify.cntrltype), (cntlid, 2));
    assert_eq!(identify.cmic & 0x8, 0, "no ANA on a discovery controller");
    let (_, header) = wire.admin(RawSqe::get_log_page(0x1005, 0, 0x70, 0, 1024));
    let generation = u64::from_le_bytes(header[0..8].try_into().unwrap());
    let records = u64::from_le_bytes(header[8..16].try_into().unwrap());
    assert_eq!(records, 3);
    let total = 1024 * (1 + records as u32);
    let (_, log) = wire.admin(RawSqe::get_log_page(0x1006, 0, 0x70, 0, total));
    assert_eq!(u64::from_le_bytes(log[0..8].try_into().unwrap()), generation, "stable log");
    for entry in log[1024..].chunks_exact(1024) {
        assert_eq!((entry[0], entry[1], entry[3]), (3, 1, 2), "TCP, IPv4, no secure channel");
        assert_eq!(u16::from_le_bytes([entry[6], entry[7]]), 0xFFFF, "dynamic controllers");
        assert_eq!(u16::from_le_bytes([entry[8], entry[9]]), 128, "ASQSZ");
        assert_eq!(&entry[32..37], b"4420\0");
        assert_eq!(&entry[512..522], b"127.0.0.1\0");
        assert_eq!(entry[768], 0, "SECTYPE none");
    }
    assert_eq!(log[1024 + 2], 3, "the current discovery subsystem comes first");
    assert_eq!(&log[2048 + 256..2048 + 256 + nqn_len("db")], subnqn("db").as_str().as_bytes());
}

fn nqn_len(name: &str) -> usize {
    subnqn(name).as_str().len()
}

/// SPDK's host (`spdk_nvme_connect`, then `spdk_nvme_ctrlr_alloc_io_qpair` and I/O), with its
/// defaults: KATO 10 s, admin queue 32, four AERs, Get Features KATO, 1024 queues asked for,
/// header and data digests as configured.
#[test]
fn spdk_host_replay() {
    for digests in [false, true] {
        let Fixture { target, .. } = fixture();
        let nqn = subnqn("db");
        let mut storage = Storage::default();
        let port_id = target.default_port_id();
        let hostid = [0xAA; 16];

        let mut admin = Wire::open(&target, port_id, digests, digests);
        let data = connect_data(&hostid, 0xFFFF, nqn.as_str(), SPDK_HOSTNQN);
        // SPDK numbers requests from 0; the Connect takes the first.
        let cqe = admin.connect(RawSqe::connect(0, 0, 31, 0, 10_000), &data);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let cntlid = cqe.dw0() as u16;

        // READ_VS, READ_CAP, CHECK_EN (CC), ENABLE (one CC write), CSTS until RDY.
        let (cqe, _) = admin.admin(RawSqe::property_get(1, 0x08, false));
        assert_eq!(cqe.result, 0x0001_0400);
        let (cqe, _) = admin.admin(RawSqe::property_get(2, 0x00, true));
        let cap = cqe.result;
        assert_ne!(cap & (1 << 37), 0);
        let (cqe, _) = admin.admin(RawSqe::property_get(3, 0x14, false));
        assert_eq!(cqe.result & 1, 0, "CC.EN 0 after Connect: no disable step");
        admin.admin(RawSqe::property_set(4, 0x14, 0x0046_0001));
        let (cqe, _) = admin.admin(RawSqe::property_get(5, 0x1C, false));
        assert_eq!(cqe.result & 1, 1);

        // IDENTIFY, CONFIGURE_AER (SMART warnings + OAES notices) and AERL + 1 AERs.
        let (_, data) = admin.admin(RawSqe::identify(6, 0x01, 0, 0));
        let identify = IdentifyController::decode(&data).unwrap();
        assert_eq!(identify.cntlid, cntlid);
        assert_eq!(identify.icdoff, 0);
        assert!(identify.ioccsz as usize * 16 - 64 >= 4096, "in-capsule writes of a block");
        let aer_config = 0x1F | (identify.oaes & ((1 << 8) | (1 << 9) | (1 << 11)));
        let (cqe, _) = admin.command(&mut storage, RawSqe::set_features(7, 0x0B, aer_config), &[]);
        assert!(cqe.status.is_success());
        let aers = usize::from(identify.aerl).min(7) + 1;
        for index in 0..aers {
            admin.send(&RawSqe::new(0x0C, 8 + index as u16).sgl_null(), &[]);
        }
        // SET_KEEP_ALIVE_TIMEOUT reads the KATO the controller uses.
        let (cqe, _) = admin.admin(RawSqe::get_features(20, 0x0F));
        assert_eq!(cqe.dw0(), 10_000);
        // SET_NUM_QUEUES: 1024 asked for, the grant is 0's based.
        let (cqe, _) = admin.admin(RawSqe::set_features(21, 0x07, 1023 | (1023 << 16)));
        let granted = (cqe.dw0() & 0xFFFF).min(cqe.dw0() >> 16) + 1;
        assert_eq!(granted, 64);
        // IDENTIFY_ACTIVE_NS, IDENTIFY_NS, IDENTIFY_ID_DESCS.
        let (_, data) = admin.admin(RawSqe::identify(22, 0x02, 0, 0));
        assert_eq!(&data[..8], &[1, 0, 0, 0, 0, 0, 0, 0]);
        let (_, data) = admin.admin(RawSqe::identify(23, 0x00, 1, 0));
        let namespace = IdentifyNamespace::decode(&data).unwrap();
        assert_eq!((namespace.nsze, namespace.lbaf0_lbads), (1024, 12));
        let (_, data) = admin.admin(RawSqe::identify(24, 0x03, 1, 0));
        assert_eq!(NamespaceIdentifiers::decode(&data).unwrap().uuid, [8; 16]);
        // SET_SUPPORTED_LOG_PAGES reads the ANA log (CMIC.ANA): header, groups, active NSIDs.
        let (_, data) = admin.admin(RawSqe::get_log_page(25, 0xFFFF_FFFF, 0x0C, 0, 16 + 32 + 4));
        let log = AnaLog::decode(&data).unwrap();
        assert_eq!(log.groups.len(), 1);
        assert_eq!((log.groups[0].grpid, log.groups[0].state), (namespace.anagrpid, 1));
        // Keep Alive at KATO / 2.
        admin.host.now_ms = 5_000;
        admin.admin(RawSqe::new(0x18, 26).sgl_null());

        // I/O qpair: Connect with sqsize 127 (io_queue_size clamped to MQES + 1).
        let mut io = Wire::open(&target, port_id, digests, digests);
        let data = connect_data(&hostid, cntlid, nqn.as_str(), SPDK_HOSTNQN);
        let cqe = io.connect(RawSqe::connect(0, 1, 127, 0, 0), &data);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let block: Vec<u8> = (0..8192).map(|i| (i * 7 % 256) as u8).collect();
        let write = RawSqe::rw(0x01, 1, 100, 2).sgl_inline(8192);
        let (cqe, _) = io.command(&mut storage, write, &block);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let large: Vec<u8> = (0..128 * 1024).map(|i| (i * 3 % 256) as u8).collect();
        let write = RawSqe::rw(0x01, 2, 200, 32).sgl_transport(128 * 1024);
        let (cqe, _) = io.command(&mut storage, write, &large);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let read = RawSqe::rw(0x02, 3, 100, 2).sgl_transport(8192);
        let (_, data) = io.command(&mut storage, read, &[]);
        assert_eq!(data, block);
        let read = RawSqe::rw(0x02, 4, 200, 32).sgl_transport(128 * 1024);
        let (_, data) = io.command(&mut storage, read, &[]);
        assert_eq!(data, large);
        assert!(!admin.host.queue.wants_close());
    }
}

/// Linux with `disable_sqflow`: CATTR bit 2 in every Connect; successful reads end with a
/// C2HData carrying LAST_PDU and SUCCESS and no CapsuleResp; failures and writes still get one.
#[test]
fn success_flag_when_sq_flow_control_is_disabled() {
    let Fixture { target, .. } = fixture();
    let nqn = subnqn("db");
    let mut storage = Storage::default();
    let port_id = target.default_port_id();
    let mut admin = Wire::open(&target, port_id, false, true);
    let data = connect_data(&LINUX_HOSTID, 0xFFFF, nqn.as_str(), LINUX_HOSTNQN);
    let cqe = admin.connect(RawSqe::connect(1, 0, 31, 0x04, 5000), &data);
    let cntlid = cqe.dw0() as u16;
    admin.admin(RawSqe::property_set(2, 0x14, 0x0046_0001));
    let mut io = Wire::open(&target, port_id, false, true);
    let data = connect_data(&LINUX_HOSTID, cntlid, nqn.as_str(), LINUX_HOSTNQN);
    assert!(io.connect(RawSqe::connect(1, 1, 127, 0x04, 0), &data).status.is_success());

    let block = vec![0x5Au8; 4096];
    let (cqe, _) = io.command(&mut storage, RawSqe::rw(0x01, 2, 3, 1).sgl_inline(4096), &block);
    assert!(cqe.status.is_success());
    // Read 2 MiB worth of PDUs: 256 KiB in two C2HData, the second with LAST_PDU | SUCCESS.
    io.send(&RawSqe::rw(0x02, 3, 0, 64).sgl_transport(256 * 1024), &[]);
    io.host.pump(&mut storage);
    let received = io.host.receive_all();
    let flags: Vec<(bool, bool)> = received
        .iter()
        .map(|item| match item {
            Received::Data(header, _) => (header.last, header.success),
            other => panic!("only C2HData, no CapsuleResp: {other:?}"),
        })
        .collect();
    assert_eq!(flags, [(false, false), (true, true)]);
    // A failed read still gets its CapsuleResp.
    let (cqe, _) = io.command(&mut storage, RawSqe::rw(0x02, 4, 5000, 1).sgl_transport(4096), &[]);
    assert!(cqe.status.same_code(Status::LBA_OUT_OF_RANGE));
    // The wire form of the flag: byte 1 = LAST_PDU (04h) | SUCCESS (08h) | DDGSTF (02h).
    let mut raw = Vec::new();
    let framing = io.host.queue.framing;
    let header = DataHeader { cccid: 9, ttag: 0, datao: 0, datal: 4, last: true, success: true };
    pdu::encode_data_pdu(&mut raw, &framing, &header, &[1, 2, 3, 4]);
    assert_eq!(raw[1], 0x04 | 0x08 | 0x02);
}
