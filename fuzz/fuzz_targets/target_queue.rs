//! Fuzzes a connected `nvmf::target::Queue` with an arbitrary byte stream, delivered in
//! arbitrary pieces, with a tiny in-memory storage executor completing every request: the queue
//! must never panic, never consume more than it was given, and everything it sends must decode
//! as valid PDUs for the host.
//!
//! The first input byte picks where the stream starts: a fresh connection (the fuzzer writes the
//! ICReq), an enabled admin queue, or an I/O queue of an enabled controller (with or without
//! digests), and whether the rest is raw bytes or records the harness frames: a CapsuleCmd with
//! a fuzzed SQE and in-capsule data, an H2CData answering the last R2T (with fuzzed offset and
//! length), or raw bytes. Framed records reach deep into command handling at once; raw bytes
//! reach the decoder's corners. The second byte picks the piece size of raw streams.
#![no_main]

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use nvmf::command::{property, ConnectData, PropertySize, SglDescriptor, Sqe, CNTLID_DYNAMIC};
use nvmf::pdu::{self, DataHeader, Decoded, Framing, ICReq, Pdu, Role, R2T};
use nvmf::target::{
    Catalog, NamespaceInfo, Queue, StorageOperation, StorageRequest, SubsystemInfo, Target,
    TargetConfig,
};
use types::Nqn;

const BLOCK_BYTES: usize = 4096;
const VOLUME_BLOCKS: u64 = 64;
/// Rounds of receive, storage and output per input at most.
const ROUNDS_MAX: usize = 4096;
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";

fn subsystem() -> Nqn {
    Nqn::new("nqn.2024-01.io.ferrite:vol:fuzz").expect("a valid NQN")
}

struct OneVolume(NamespaceInfo);

impl Catalog for OneVolume {
    fn subsystems(&self) -> Vec<SubsystemInfo> {
        vec![SubsystemInfo { nqn: subsystem() }]
    }
    fn namespace(&self, subnqn: &Nqn) -> Option<NamespaceInfo> {
        (*subnqn == subsystem()).then(|| self.0.clone())
    }
}

/// Sparse blocks of the one volume.
#[derive(Default)]
struct Storage {
    blocks: HashMap<u64, Vec<u8>>,
}

impl Storage {
    fn execute(&mut self, queue: &mut Queue, request: StorageRequest) {
        let buf = match request.operation {
            StorageOperation::Read { lba, blocks, mut buf } => {
                assert_eq!(buf.len(), blocks as usize * BLOCK_BYTES);
                assert!(lba + u64::from(blocks) <= VOLUME_BLOCKS);
                for (index, chunk) in buf.chunks_exact_mut(BLOCK_BYTES).enumerate() {
                    match self.blocks.get(&(lba + index as u64)) {
                        Some(block) => chunk.copy_from_slice(block),
                        None => chunk.fill(0),
                    }
                }
                Some(buf)
            }
            StorageOperation::Write { lba, blocks, buf } => {
                assert_eq!(buf.len(), blocks as usize * BLOCK_BYTES);
                assert!(lba + u64::from(blocks) <= VOLUME_BLOCKS);
                for (index, chunk) in buf.chunks_exact(BLOCK_BYTES).enumerate() {
                    self.blocks.insert(lba + index as u64, chunk.to_vec());
                }
                Some(buf)
            }
            StorageOperation::Flush => None,
            StorageOperation::WriteZeroes { lba, blocks } => {
                assert!(lba + u64::from(blocks) <= VOLUME_BLOCKS);
                for index in 0..u64::from(blocks) {
                    self.blocks.remove(&(lba + index));
                }
                None
            }
            StorageOperation::Deallocate { ranges } => {
                for (lba, blocks) in ranges.iter() {
                    assert!(lba + u64::from(blocks) <= VOLUME_BLOCKS);
                }
                Some(ranges.into_buf())
            }
        };
        queue.complete(request.id, Ok(()), buf);
    }
}

/// A queue with the driver's receive buffer and the host's view of what it sent.
struct Connection {
    queue: Queue,
    unconsumed: Vec<u8>,
    /// The host's framing when the harness negotiated it; None when the fuzzer wrote the ICReq.
    host_framing: Option<Framing>,
    sent: Vec<u8>,
    closed: bool,
    /// The last R2T the target sent, for framed H2CData records.
    last_r2t: Option<R2T>,
}

impl Connection {
    fn new(target: &Arc<Target>) -> Connection {
        Connection {
            queue: Queue::new(Arc::clone(target), "fuzz".into(), 0),
            unconsumed: Vec::new(),
            host_framing: None,
            sent: Vec::new(),
            closed: false,
            last_r2t: None,
        }
    }

    /// Offers `bytes` the way the node's driver does, runs storage, collects the output.
    fn feed(&mut self, bytes: &[u8], storage: &mut Storage, now_ms: u64) {
        if self.closed {
            return;
        }
        self.unconsumed.extend_from_slice(bytes);
        match self.queue.receive(&self.unconsumed, now_ms) {
            Ok(consumed) => {
                assert!(consumed <= self.unconsumed.len());
                self.unconsumed.drain(..consumed);
                // A driver's buffer holds one largest PDU; the queue never needs more.
                if self.unconsumed.len() > Queue::pdu_size_max() {
                    self.unconsumed.truncate(Queue::pdu_size_max());
                }
            }
            Err(_) => self.closed = true,
        }
        while let Some(request) = self.queue.next_request() {
            storage.execute(&mut self.queue, request);
        }
        self.queue.poll(now_ms);
        // Sent in pieces of an odd size, so sends end inside PDU headers and Read data.
        let chunks: usize = self.queue.output_chunks().map(<[u8]>::len).sum();
        assert_eq!(chunks, self.queue.output_len(), "the chunks are the pending output");
        while self.queue.output_len() > 0 {
            let next: Vec<u8> = self.queue.output_chunks().flatten().take(4093).copied().collect();
            self.sent.extend_from_slice(&next);
            self.queue.consume_output(next.len());
        }
        self.check_output();
        if self.queue.wants_close() || self.queue.keep_alive_expired(now_ms) {
            self.closed = true;
        }
    }

    /// Everything sent decodes as whole, valid PDUs for the host.
    fn check_output(&mut self) {
        let Some(framing) = self.host_framing else {
            self.sent.clear();
            return;
        };
        let mut offset = 0;
        while offset < self.sent.len() {
            match pdu::decode(&self.sent[offset..], &framing) {
                Ok(Decoded::Pdu { pdu, consumed_bytes }) => {
                    if let Pdu::R2T(r2t) = pdu {
                        self.last_r2t = Some(r2t);
                    }
                    offset += consumed_bytes;
                }
                Ok(Decoded::Incomplete { .. }) => panic!("the target sent a partial PDU"),
                other => panic!("the target sent a bad PDU: {other:?}"),
            }
        }
        self.sent.clear();
    }

    /// ICReq with the given digests, as the harness's host.
    fn initialize(&mut self, storage: &mut Storage, header_digest: bool, data_digest: bool) {
        let mut bytes = Vec::new();
        pdu::encode_ic_req(
            &mut bytes,
            &ICReq { pfv: 0, hpda: 0, header_digest, data_digest, maxr2t: 0 },
        );
        self.feed(&bytes, storage, 0);
        let mut framing = Framing::new(Role::Host, 4 << 20);
        framing.header_digest = header_digest;
        framing.data_digest = data_digest;
        self.host_framing = Some(framing);
    }

    fn command(&mut self, storage: &mut Storage, sqe: &Sqe, data: &[u8]) {
        let framing = self.host_framing.expect("initialized");
        let mut bytes = Vec::new();
        pdu::encode_capsule_cmd(&mut bytes, &framing, sqe, data);
        self.feed(&bytes, storage, 0);
    }

    fn connect(&mut self, storage: &mut Storage, qid: u16, cntlid: u16) {
        let data = ConnectData {
            host_id: [1; 16],
            cntlid,
            subnqn: subsystem(),
            hostnqn: Nqn::new(HOSTNQN).expect("a valid NQN"),
        };
        let mut bytes = Vec::new();
        data.encode(&mut bytes);
        let sqe = Sqe::connect(0xFFF0, qid, 31, 60_000)
            .with_sgl(SglDescriptor::in_capsule(0, bytes.len() as u32));
        self.command(storage, &sqe, &bytes);
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, input)) = input.split_first() else { return };
    let Some((&piece, stream)) = input.split_first() else { return };
    let namespace = NamespaceInfo {
        volume: 1,
        size_blocks: Arc::new(AtomicU64::new(VOLUME_BLOCKS)),
        block_size_bytes: BLOCK_BYTES as u32,
        nguid: [1; 16],
        uuid: [2; 16],
        eui64: [3; 8],
        serial_number: "fuzz".into(),
        read_only: false,
    };
    let target = Arc::new(Target::new(TargetConfig::default(), Arc::new(OneVolume(namespace))));
    let mut storage = Storage::default();
    let mut admin = Connection::new(&target);
    let mut io = Connection::new(&target);
    let (header_digest, data_digest) = (mode & 0x10 != 0, mode & 0x20 != 0);
    let fuzzed = match mode % 3 {
        0 => &mut admin,
        start => {
            admin.initialize(&mut storage, header_digest, data_digest);
            admin.connect(&mut storage, 0, CNTLID_DYNAMIC);
            let cntlid = admin.queue.cntlid().expect("the harness's Connect is accepted");
            let cc = property::CC_ENABLE
                | (6 << property::CC_IOSQES_SHIFT)
                | (4 << property::CC_IOCQES_SHIFT);
            admin.command(
                &mut storage,
                &Sqe::property_set(0xFFF1, property::CC, PropertySize::Bytes4, u64::from(cc)),
                &[],
            );
            if start == 1 {
                &mut admin
            } else {
                io.initialize(&mut storage, header_digest, data_digest);
                io.connect(&mut storage, 1, cntlid);
                assert_eq!(io.queue.qid(), Some(1));
                &mut io
            }
        }
    };
    let mut now_ms = 0;
    if mode & 0x40 == 0 || fuzzed.host_framing.is_none() {
        let piece = usize::from(piece).max(1);
        for chunk in stream.chunks(piece).take(ROUNDS_MAX) {
            now_ms += 10;
            fuzzed.feed(chunk, &mut storage, now_ms);
            if fuzzed.closed {
                break;
            }
        }
        return;
    }
    let framing = fuzzed.host_framing.expect("checked above");
    let mut rest = input;
    for _ in 0..ROUNDS_MAX {
        let Some((&kind, after)) = rest.split_first() else { break };
        rest = after;
        let mut bytes = Vec::new();
        match kind % 4 {
            // CapsuleCmd: 64 bytes of SQE, then a length byte (in 64-byte units) of data.
            0 | 1 => {
                let Some(sqe) = rest.get(..64) else { break };
                let mut raw = [0u8; 64];
                raw.copy_from_slice(sqe);
                rest = &rest[64..];
                let length = rest.first().map_or(0, |units| usize::from(*units) * 64);
                rest = rest.get(1..).unwrap_or(&[]);
                let data = vec![kind; length];
                pdu::encode_capsule_cmd(&mut bytes, &framing, &Sqe::from_bytes(raw), &data);
            }
            // H2CData for the last R2T, offset and length nudged by the next two bytes.
            2 => {
                let Some(r2t) = fuzzed.last_r2t else { continue };
                let Some(&[shift, cut, flags]) =
                    rest.get(..3).map(|b| <&[u8; 3]>::try_from(b).expect("3 bytes"))
                else {
                    break;
                };
                rest = &rest[3..];
                let datao = r2t.r2to.wrapping_add(u32::from(shift) * 512) ^ u32::from(flags & 1);
                let datal = r2t.r2tl.saturating_sub(u32::from(cut) * 512).max(1);
                let header = DataHeader {
                    cccid: if flags & 2 == 0 { r2t.cccid } else { r2t.cccid ^ 1 },
                    ttag: if flags & 4 == 0 { r2t.ttag } else { r2t.ttag ^ 1 },
                    datao,
                    datal,
                    last: flags & 8 == 0,
                    success: false,
                };
                if datal as usize <= 2 << 20 {
                    pdu::encode_data_pdu(
                        &mut bytes,
                        &framing,
                        &header,
                        &vec![flags; datal as usize],
                    );
                }
            }
            // Raw bytes: a length byte, then that many bytes.
            _ => {
                let length = rest.first().map_or(0, |length| usize::from(*length));
                let raw = rest.get(1..1 + length).unwrap_or(&[]);
                bytes.extend_from_slice(raw);
                rest = rest.get(1 + length..).unwrap_or(&[]);
            }
        }
        now_ms += u64::from(kind >> 2) * 10;
        fuzzed.feed(&bytes, &mut storage, now_ms);
        if fuzzed.closed {
            break;
        }
    }
});
